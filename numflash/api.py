"""Public functions. Each reads: validate -> normalise -> choose -> launch.

Nothing is launched and no output is touched until every argument has been checked
(:mod:`numflash.validation`); the configuration comes from :mod:`numflash.selection` unless
one is forced; :mod:`numflash.launch` pads, views and launches.
"""

import contextlib
import dataclasses

import numpy as np

from . import arrays, block_masks, cache, launch, plans, selection, signature, validation
from .config import TensorCoreDecodeConfig
from .device import current_device
from .kernels.jit import SIMULATOR

#: Plans of repeated calls (numflash.plans): on a GPU, for CuPy arrays.
_plans = plans.PlanCache()
_DEFAULT_WINDOW = (-1, -1)


def _window_key(window_size):
    """A window other than the default (which keys as None), with its types."""
    return (window_size.__class__, *map(type, window_size), window_size)


class _Cupy:
    """CuPy's functions the repeated-call path uses, bound on first use (a GPU call) instead of
    an import statement and attribute lookups in every call."""

    empty = get_device = current_stream = stream_is_capturing = device_count = fill = None
    ndarray = None

    @classmethod
    def bind(cls):
        import cupy

        cls.empty = cls.ndarray = cupy.ndarray  # (empty: cupy.empty without its frame, 0.5 us)
        cls.get_device = cupy.cuda.runtime.getDevice
        cls.current_stream = cupy.cuda.get_current_stream
        cls.stream_is_capturing = cupy.cuda.runtime.streamIsCapturing
        cls.device_count = cupy.cuda.runtime.getDeviceCount
        cls.fill = launch.memset_d32()


def _rows_key(max_seqlen):
    """A packed batch's max length as its plan key holds it: the bound the kernels cover where
    it is an int (validation.packed_bound), else itself (the full path refuses it by name)."""
    return validation.packed_bound(max_seqlen) if max_seqlen.__class__ is int else max_seqlen


_NAMESPACE = dict(Cupy=_Cupy, cache=cache, DEFAULT_WINDOW=_DEFAULT_WINDOW, window_key=_window_key)
_NAMESPACE.update(ROWS=_rows_key)
#: The public functions' parameters in their order, as their plans' keys hold them (the
#: arrays' roles follow this order, an absent one at address 0; the outputs a replay makes
#: take the roles after them: :func:`_output_roles`).
_ATTENTION = signature.Signature(
    "attention",
    [("q", "array"), ("k", "array"), ("v", "array"), ("causal", "value")]
    + [("softmax_scale", "value"), ("window_size", "window"), ("return_lse", "value")]
    + [("out", "optional"), ("config", "config"), ("softcap", "value")]
    + [("sinks", "optional"), ("alibi_slopes", "optional")],
    _NAMESPACE,
    output="out",
)
_BACKWARD = signature.Signature(
    "backward",
    [(name, "array") for name in ("dout", "q", "k", "v", "out", "lse")]
    + [("causal", "value"), ("softmax_scale", "value"), ("window_size", "window")]
    + [("deterministic", "value"), ("config", "config"), ("softcap", "value")]
    + [("sinks", "optional"), ("alibi_slopes", "optional")],
    _NAMESPACE,
)
_VARLEN = signature.Signature(
    "varlen",
    [(name, "array") for name in ("q", "k", "v", "cu_seqlens_q", "cu_seqlens_k")]
    + [("max_seqlen_q", "rows"), ("max_seqlen_k", "rows"), ("causal", "value")]
    + [("softmax_scale", "value"), ("window_size", "window"), ("return_lse", "value")]
    + [("out", "optional"), ("config", "config"), ("softcap", "value")]
    + [("sinks", "optional"), ("alibi_slopes", "optional")],
    _NAMESPACE,
    output="out",
)
_KVCACHE = signature.Signature(
    "kvcache",
    [("q", "array"), ("k_cache", "array"), ("v_cache", "array"), ("k", "optional")]
    + [("v", "optional"), ("cache_seqlens", "lengths"), ("cache_batch_idx", "optional")]
    + [("block_table", "optional"), ("causal", "value"), ("softmax_scale", "value")]
    + [("window_size", "window"), ("num_splits", "value"), ("return_lse", "value")]
    + [("out", "optional"), ("config", "config"), ("softcap", "value")]
    + [("sinks", "optional"), ("alibi_slopes", "optional")],
    _NAMESPACE,
    output="out",
)


def _capturing():
    """Whether CuPy's current stream is capturing a CUDA graph (False in the simulator)."""
    if SIMULATOR:
        return False
    if _Cupy.get_device is None:
        _Cupy.bind()
    return _Cupy.stream_is_capturing(_Cupy.current_stream().ptr)


def _refuse_under_capture(name, planned=True):
    """A call without a plan cannot be captured: it may compile kernels and allocates buffers
    that a graph would keep using after the call has freed them. ``planned``: whether calls
    of ``name`` get plans at all."""
    if _capturing():
        if not planned:
            raise RuntimeError(f"numflash.{name} cannot be captured into a CUDA graph yet")
        raise RuntimeError(
            f"numflash.{name} cannot be captured into a CUDA graph the first time it runs with "
            "these shapes, strides, dtypes and flags (out= given or not), nor with inputs it "
            "must copy (a head_dim that is not a multiple of 8, rows not 16-byte aligned): call "
            "it once eagerly on the capturing stream first"
        )


def _user_functions(score_mod, mask_mod, mod_args, derivative=None, block_mask=None):
    """A call's (score_mod, mask_mod, mod_args, score_mod_derivative, block_mask) when it has
    any of them, else None."""
    mods = (score_mod, mask_mod, mod_args, derivative, block_mask)
    if type(mod_args) is tuple and not mod_args and all(x is None for x in mods[:2] + mods[3:]):
        return None
    return mods


#: The signatures of calls with user functions, by (public function, number of mod_args):
#: its own parameters, then the functions and the block mask (compared by identity: a plan
#: replays the kernels they were compiled into) and each of the mod_args (array roles after
#: the function's own, so that a replay takes each call's arrays).
_MODS_SIGNATURES = {}
_MODS_VALUES = ("score_mod", "mask_mod", "score_mod_derivative", "block_mask")


def _mods_call(sig, mods, args):
    """(signature, arguments) of a call of ``sig`` with user functions (``mods`` as
    :func:`_user_functions` gives them) and its own ``args``: the extended signature
    (:data:`_MODS_SIGNATURES`) and ``args`` followed by the functions, the block mask and
    the mod_args; (None, None) for a call that gets no plan: a block mask given with
    mod_args (the block mask's own arrays are the only ones it takes, which a replay could
    not check) or mod_args that are not a tuple or list (the full path refuses them)."""
    score_mod, mask_mod, mod_args, derivative, block_mask = mods
    if not isinstance(mod_args, (tuple, list)) or (block_mask is not None and mod_args):
        return None, None
    key = (sig.name, len(mod_args))
    extended = _MODS_SIGNATURES.get(key)
    if extended is None:
        parameters = [*sig.parameters, *((name, "value") for name in _MODS_VALUES)]
        parameters += [(f"mod_arg{i}", "array") for i in range(len(mod_args))]
        output = None if sig.out_position is None else sig.parameters[sig.out_position][0]
        name = f"{sig.name} with mods and {len(mod_args)} mod_args"  # (its own recent plans)
        extended = signature.Signature(name, parameters, _NAMESPACE, output)
        _MODS_SIGNATURES[key] = extended
    return extended, (*args, score_mod, mask_mod, derivative, block_mask, *mod_args)


def _lookup(sig, args, mods, name, full_path):
    """The start of every public call that may have a plan: ``sig`` its signature, ``args``
    its own arguments in that order, ``mods`` its user functions (:func:`_user_functions`),
    ``full_path(*args, mods)`` what runs it without a plan. Returns (result, None) where a
    plan replayed the call or the full path ran it without recording (no key, or a call
    that gets no plan: :func:`_mods_call`, refused under capture with a block mask), else
    (None, (key, args, mods, the mod_args as plan roles)) for the caller to record, the
    arrays as :func:`_repeated` adopted them."""
    full = args
    if mods is not None:
        extended, full = _mods_call(sig, mods, args)
        if extended is None:
            if mods[4] is not None:
                _refuse_under_capture(f"{name} with a block_mask and mod_args", planned=False)
            return full_path(*args, mods), None
        sig = extended
    result, key, full = _repeated(sig, full, name)
    if result is not None:
        return result, None
    count, mod_roles = len(args), ()
    if mods is not None:  # the mod_args as _repeated adopted them
        mod_roles = tuple(full[count + len(_MODS_VALUES) :])
        mods = (mods[0], mods[1], mod_roles if mod_roles else mods[2], mods[3], mods[4])
    args = full[:count]
    if key is None:
        return full_path(*args, mods), None
    return None, (sig, key, args, mods, mod_roles)


def _recent(sig, args):
    """The :class:`numflash.plans.Recent` plans a call of ``sig`` tries first: its function's,
    and for a packed batch its max lengths' bounds' (a training loop's steps cycle through more
    bounds than plans.RECENT: each step then finds its bounds' plans, not the other bounds')."""
    if not sig.rows_positions:
        return _plans.recent_for(sig.name)
    return _plans.recent_for((sig.name, *[_rows_key(args[i]) for i in sig.rows_positions]))


def _find(sig, args):
    """(plan, pointers, key) of a call with arguments ``args`` (in signature ``sig``'s order):
    the plan of its key if there is one, its arrays' addresses in role order and the key;
    (None, None, None) where the arguments have no key (not CuPy arrays, or unhashable)."""
    if _Cupy.get_device is None:
        _Cupy.bind()
    try:
        key, pointers = sig.key(*args)
        plan = _plans.get(key)  # hashing raises TypeError for an unhashable argument
    except (AttributeError, TypeError):
        return None, None, None
    if plan is not None:
        _recent(sig, args).add(plan.ready().run)
    return plan, pointers, key


def _adopted(sig, args):
    """``args`` with each array argument that is not a CuPy array taken as one through
    :func:`numflash.arrays.intake` (a PyTorch tensor or JAX array through DLPack: the same
    memory, no copy), which the full path would do anyway; None where one cannot be taken
    (the full path then refuses it by name) or where every array is a CuPy one already."""
    try:  # out= is handed back: its array keeps a tensor alive; the others are borrowed
        taken = arrays.adopted(args, sig.array_positions, sig.parameters, sig.out_position)
    except TypeError:
        return None
    return tuple(taken) if taken is not None else None


def _repeated(sig, args, name):
    """(result, key, args) of a call of public function ``name`` with arguments ``args`` (in
    signature ``sig``'s order): its result where a plan replays it, else None; its key where
    it was built (None where a recent plan took the call, where the call has no key, and in
    the simulator); and its arguments, the arrays that are not CuPy arrays taken as CuPy ones
    (:func:`_adopted`: first where the first array is not one, else when that gives the call
    a key). A call first tries its function's
    most recent plans, each through its run (its key's matcher and its replay in one function,
    numflash.plans), then builds its key and replays that key's plan; a call without a plan
    under stream capture is refused (:func:`_refuse_under_capture`)."""
    plan = key = None
    if not SIMULATOR:
        if not isinstance(args[sig.array_positions[0]], _Cupy.ndarray or arrays.cupy_ndarray()):
            args = _adopted(sig, args) or args  # PyTorch tensors, JAX arrays: CuPy ones first
        try:
            for run in _recent(sig, args).entries:
                result = run(*args)
                if result is not None:
                    return result, None, args
        except (AttributeError, TypeError, ValueError):  # not CuPy arrays, or odd flags
            pass
        plan, pointers, key = _find(sig, args)
        if key is None:  # another library's arrays past the first: as CuPy arrays, a key
            adopted = _adopted(sig, args)
            if adopted is not None:
                args = adopted
                plan, pointers, key = _find(sig, args)
    if plan is None:
        _refuse_under_capture(name)
        return None, key, args
    out = None if sig.out_position is None else args[sig.out_position]
    return plan.replay(pointers, out), key, args


def _planned(sig, key, recorded, roles, tail, overlaps=(), outputs=(), lengths=()):
    """Keep the plan of a recorded call whose arrays are on the current device (``tail``: what
    its replays do besides the launches, :class:`numflash.plans.Tail`; ``outputs``: the
    (shape, dtype) of each output its replays make; ``lengths``: its int lengths, as
    :func:`numflash.plans.make` takes them). Its replay is written when a call first finds it
    (:meth:`numflash.plans.Plan.ready`), which puts it first among its function's recent
    plans."""
    if roles[0].data.device_id == key[0]:
        plan = plans.make(recorded, roles, overlaps, outputs, lengths)
        if plan is not None:
            one_device = _Cupy.device_count() == 1

            def write(plan):
                head = sig.match_parts(key, one_device)
                plan.replayer(key[1], tail, _Cupy.empty, _Cupy.stream_is_capturing, _plans.pin,
                              head, _Cupy.fill)  # fmt: skip

            plan.defer(write)
            _plans.put(key, plan)


def _output_roles(sig):
    """The role of a call's first output: the one after its parameters' array roles (out=,
    sinks and alibi_slopes among them, at address 0 where absent)."""
    return len(sig.array_positions)


def _forward_tail(sig, out_role, given, return_lse):
    """The :class:`numflash.plans.Tail` of a forward or KV-cache call (signature ``sig``)
    whose out= has role ``out_role``: out made into that role unless ``given``, lse made into
    the role after the parameters' and returned when asked for."""
    made = ((0, out_role),) if not given else ()
    made += ((1, _output_roles(sig)),) if return_lse else ()
    result = (None if given else 0,) + ((1,) if return_lse else ())
    return plans.Tail(made, result)


def _outputs(q):
    """(shape, dtype) of the out and lse a forward or KV-cache call over ``q`` returns."""
    b, sq, h, _ = q.shape
    return (q.shape, q.dtype), ((b, h, sq), np.dtype(np.float32))


_STAY = contextlib.nullcontext()


def _with_mods(p, q, mods, backward=False):
    """(``p`` with its Mods, the mod_args as the kernels read them, a block mask's arrays
    after them) of a call's (score_mod, mask_mod, mod_args, score_mod_derivative,
    block_mask), or (p, ()) for None."""
    if mods is None:
        return p, ()
    score_mod, mask_mod, mod_args, derivative, block_mask = mods
    mask_mod, mod_args = validation.check_block_mask(block_mask, mask_mod, mod_args, p, q)
    checked, mod_args = validation.check_mods(score_mod, mask_mod, mod_args, q, derivative,
                                              backward, block_mask)  # fmt: skip
    return dataclasses.replace(p, mods=checked), mod_args


def _variant(sinks, alibi_slopes):
    """A validated call's variant arrays, in launch.variant_arrays' order."""
    return tuple(x for x in (sinks, alibi_slopes) if x is not None)


def _empty_rows(out, lse, sinks, heads):
    """A call without keys: out 0, lse -inf, or each head's sink with sinks (``heads``: the
    index that spreads the sinks over lse's layout). No kernel: a plan would not repeat it."""
    launch.note_unrecorded_work()
    arrays.bits(out)[...] = 0
    if sinks is None:
        lse[...] = -np.inf
    else:
        lse[...] = sinks[heads]


def _on_device(x):
    """A context in which ``x``'s GPU is the current device: no switch in the simulator, nor
    where the process sees one GPU (which is then current)."""
    if isinstance(x, np.ndarray):
        return _STAY
    if _Cupy.get_device is None:
        _Cupy.bind()
    return _STAY if _Cupy.device_count() == 1 else x.device


def selected_config(q, k, v, *, causal=False, window_size=(-1, -1), config=None, softcap=0.0):
    """The configuration ``attention(q, k, v, ...)`` would run with, and where it comes from.

    Returns ``(config, source)``: source is "forced" (``config=`` given), "user cache <path>",
    "shipped <path>" (tuned configurations in the user's cache or shipped with numflash, see
    ``numflash autotune``) or "heuristic"; a call with few query rows runs the KV-cache
    kernel, which its source says with the split count. Takes the same arguments and raises
    the same errors as :func:`attention`; launches nothing.
    """
    q, k, v, p = validation.problem(q, k, v, causal, None, window_size, softcap)
    with _on_device(q):
        device = current_device()
        if config is not None:
            return selection.Selection(validation.check_forward_config(config, p, device), "forced")
        route = _decode_route(q, k, v, p, causal, None, window_size, device)
        if route is not None:
            _, choice, splits = route
            source = f"{choice.source}; few query rows: the KV-cache kernel, {splits} split(s)"
            return selection.Selection(choice.config, source)
        return selection.forward(p, device)


def block_mask(mask_mod, batch, nheads, seqlen_q, seqlen_k, *, mod_args=()):
    """Evaluate ``mask_mod(b, h, q_idx, kv_idx, *mod_args)`` (a Numba CUDA device function, as
    :func:`attention`'s ``mask_mod``) for every (row, key) of the shape once, on the GPU, and
    keep what each block of 128 rows by 128 keys needs: none of its keys seen, some, or all.
    Pass the returned :class:`numflash.BlockMask` as ``block_mask=`` to :func:`attention` and
    :func:`attention_backward` of that shape, for any layer and step.

    ``batch`` and ``nheads`` may be None where the mask is the same for every batch entry or
    head: mask_mod is then called with b = 0 or h = 0 alone, and the block mask serves calls
    of any batch or heads. q_idx is the query's position among the keys (row + seqlen_k -
    seqlen_q), as in the attention calls. ``mod_args`` are the arrays the calls will pass: the
    block mask holds what mask_mod made of their values now, so new values need a new block
    mask. It costs one mask_mod call per (batch entry, head, row, key) it covers."""
    validation.check_device_function(mask_mod, "mask_mod")
    batch = validation.check_count(batch, "batch", optional=True)
    nheads = validation.check_count(nheads, "nheads", optional=True)
    seqlen_q = validation.check_count(seqlen_q, "seqlen_q")
    seqlen_k = validation.check_count(seqlen_k, "seqlen_k")
    if not isinstance(mod_args, (tuple, list)):
        raise TypeError(f"mod_args must be a tuple of arrays; got {type(mod_args).__name__}")
    like = arrays.intake(mod_args[0], "mod_args[0]") if mod_args else None
    mod_args = validation.check_mod_args(mod_args, like, "mod_args[0]")[0]
    entries = (batch or 1) * (nheads or 1)
    if entries > block_masks.MAX_ENTRIES:
        raise ValueError(
            f"block_mask covers at most {block_masks.MAX_ENTRIES} (batch x nheads) entries; "
            f"got {entries} (give None for a batch or heads the mask does not depend on)"
        )
    with _on_device(like) if like is not None else contextlib.nullcontext():
        return block_masks.make(mask_mod, batch, nheads, seqlen_q, seqlen_k, mod_args)


def attention(
    q,
    k,
    v,
    *,
    causal=False,
    softmax_scale=None,
    window_size=_DEFAULT_WINDOW,
    return_lse=False,
    out=None,
    config=None,
    softcap=0.0,
    sinks=None,
    alibi_slopes=None,
    score_mod=None,
    mask_mod=None,
    mod_args=(),
    block_mask=None,
):
    """Exact softmax attention, computed tile by tile on chip (FlashAttention).

    Args:
        q: (batch, seqlen_q, nheads, head_dim), float16, bfloat16 or float32.
        k, v: (batch, seqlen_k, nheads_k, head_dim), q's dtype; nheads % nheads_k == 0
            (grouped-query / multi-query attention). Any strides; arrays whose last dimension
            is contiguous are read in place, others copied.
        causal: mask aligned to the bottom-right corner: query i sees key j iff
            j <= i + seqlen_k - seqlen_q.
        softmax_scale: scale of q k^T before the softmax; default 1 / sqrt(head_dim).
        window_size: (left, right) sliding window, -1 meaning unbounded: query i sees key j iff
            i + seqlen_k - seqlen_q - left <= j <= i + seqlen_k - seqlen_q + right.
        return_lse: also return the log-sum-exp of each row's scores.
        out: optional output array (q's shape and dtype, sharing no memory with q, k or v).
        config: force a kernel configuration (:class:`numflash.TensorCoreConfig`,
            :class:`numflash.WgmmaForwardConfig` or :class:`numflash.PortableConfig`); by
            default numflash chooses, and a call of at most 16 query rows runs the split-KV
            kernel of :func:`attention_with_kvcache` over k and v (:func:`selected_config`
            says which).
        softcap: cap the scores: s = softmax_scale * q . k becomes softcap * tanh(s /
            softcap) before the mask and the softmax (Gemma 2: 50); 0 (the default) for none.
            Each softcap value compiles its own kernels; :func:`attention_backward` takes the
            same value.
        sinks: optional float32 (nheads,) on q's device: a logit a head that joins every
            row's softmax denominator with no value (gpt-oss's attention sinks): out_i =
            sum_j e^{s_ij} v_j / (sum_j e^{s_ij} + e^{sinks[h]}), and lse the log of that whole
            denominator. :func:`attention_backward` takes the same sinks and returns their
            gradient too. Repeated calls replay as any others, with whatever values the
            sinks array holds then.
        alibi_slopes: optional float32 (nheads,) or (batch, nheads) on q's device: ALiBi
            (BLOOM, MPT): after the softcap each score gets -slope * |i + seqlen_k - seqlen_q
            - j| for query i and key j (the causal mask's alignment). The backward takes the
            same slopes.
        score_mod: optional Numba CUDA device function (``@numba.cuda.jit(device=True)``)
            ``score_mod(score, b, h, q_idx, kv_idx, *mod_args) -> float``, compiled into the
            kernel: each score the masks let through (after the softcap and ALiBi) becomes
            what it returns. ``b`` is the batch entry, ``h`` the query head, ``q_idx`` the
            query's position among the keys (i + seqlen_k - seqlen_q, the causal mask's
            alignment: negative for the first rows where seqlen_q > seqlen_k), ``kv_idx`` the
            key's, all int32; it is called only for rows and keys that exist. Return float32
            (arithmetic on float64 values runs at float64's speed).
        mask_mod: optional Numba CUDA device function ``mask_mod(b, h, q_idx, kv_idx,
            *mod_args) -> bool``: a key is seen where it returns True and causal /
            window_size let it be. A row it leaves without keys gets output 0 and lse -inf.
        mod_args: arrays passed to score_mod and mask_mod after the indices: 1-D,
            C-contiguous, int32, int64 or float32, on q's device (bias tables, document ids).
            Every kernel family of attention and attention_backward takes them; such calls
            compile their kernels once per function. A repeated call with the same
            functions (the same objects) and block mask replays its plan, whatever the
            mod_args hold, and so may be captured into a CUDA graph; one with a block_mask
            and mod_args given too does not (give the block mask alone: its mod_args are
            the ones it was made with).
        block_mask: optional numflash.BlockMask (``numflash.block_mask(mask_mod, ...)``) made
            for this call's shape: the key tiles its mask_mod hides from a whole row block
            are skipped, and mask_mod is not called on tiles it shows whole. The call's
            mask_mod and mod_args default to the block mask's and must otherwise be the same
            function and arrays.

    Returns:
        out (q's shape and dtype), and with ``return_lse`` the tuple (out, lse) where lse is
        float32 (batch, nheads, seqlen_q), natural log. A row that sees no key gets output 0 and
        lse -inf (with sinks: the row's sink); a NaN or inf among a row's scores makes that
        row's output and lse NaN.

    Kernels run on CuPy's current stream; the call returns without synchronising. A repeated
    call (same shapes, strides, dtypes, flags, device and stream, ``out`` given or not)
    replays the launches of the first (numflash.plans).
    """
    args = (q, k, v, causal, softmax_scale, window_size, return_lse, out, config, softcap, sinks)
    args += (alibi_slopes,)
    mods = _user_functions(score_mod, mask_mod, mod_args, block_mask=block_mask)
    # no plan yet, or an out= overlapping an input: the full path refuses it by name
    result, found = _lookup(_ATTENTION, args, mods, "attention", _attention)
    if found is None:
        return result
    sig, key, args, mods, mod_roles = found
    q, k, v, out = (*args[:3], args[7])
    given = out is not None
    with launch.recording() as recorded:
        result = _attention(*args, mods)
    out, lse = result if return_lse else (result, None)
    # a given out was refused overlapping q, k, v, the sinks, the slopes or the mod_args
    overlaps = [(3, r) for r in (0, 1, 2, *range(4, 6 + len(mod_roles))) if given]
    tail = _forward_tail(sig, 3, given, return_lse)
    roles = (q, k, v, out, *args[10:12], *mod_roles, lse)
    _planned(sig, key, recorded, roles, tail, overlaps, _outputs(q))
    return result


def _decode_route(q, k, v, p, causal, softmax_scale, window_size, device):
    """(KV-cache problem, selection, split count) of a forward call with few query rows that
    the split-KV decode kernel takes (selection.few_query_rows): k and v as a contiguous cache
    of seqlen_k keys, nothing appended. None for any other call."""
    if p.seqlen_k == 0 or not selection.few_query_rows(p) or p.mods is not None:
        return None
    try:  # the arguments were checked as attention's: a refusal here only rules the route out
        kp = validation.kvcache_problem(
            q,
            k,
            v,
            None,
            None,
            p.seqlen_k,
            None,
            None,
            causal,
            softmax_scale,
            window_size,
            0,
            p.softcap,
            p.sinks,
            p.alibi,
        )[-1]
    except (TypeError, ValueError):
        return None
    if selection.decode_family(kp, device) != TensorCoreDecodeConfig.family:
        return None
    choice, splits = selection.decode(kp, device)
    return kp, choice, splits


def _attention(
    q, k, v, causal, softmax_scale, window_size, return_lse, out, config, softcap=0.0, sinks=None,
    alibi_slopes=None, mods=None,
):  # fmt: skip
    # -- validate and normalise
    q, k, v, p = validation.problem(q, k, v, causal, softmax_scale, window_size, softcap,
                                    sinks is not None, alibi_slopes is not None)  # fmt: skip
    sinks = validation.check_sinks(sinks, q, p.nheads)
    alibi_slopes = validation.check_alibi_slopes(alibi_slopes, q, p.batch, p.nheads)
    p, mod_args = _with_mods(p, q, mods)
    return_lse = validation.check_flag(return_lse, "return_lse")
    out = validation.check_out(out, q, k, v)
    if out is not None:
        others = {"sinks": sinks, "alibi_slopes": alibi_slopes}
        others.update((f"mod_args[{i}]", x) for i, x in enumerate(mod_args))
        validation.check_no_overlap(out, "out", others)
    variant = _variant(sinks, alibi_slopes) + mod_args
    with _on_device(q):
        device = current_device()
        cfg = validation.check_forward_config(config, p, device)
        # -- choose: few query rows go to the decode kernel, unless a configuration is forced
        route = None
        if cfg is None:
            route = _decode_route(q, k, v, p, causal, softmax_scale, window_size, device)
            if route is None:
                cfg = selection.forward(p, device).config
        # -- launch
        if out is None:
            out = arrays.empty(q.shape, q.dtype, like=q)
        lse = arrays.empty((p.batch, p.nheads, p.seqlen_q), np.float32, like=q)
        if out.size:
            if p.seqlen_k == 0:  # nothing to attend to: every row is empty
                _empty_rows(out, lse, sinks, (None, slice(None), None))
            elif route is not None:
                kp, choice, splits = route
                launch.kvcache(choice.config, splits, kp, q, k, v, *(None,) * 5, out, lse, variant)
            else:
                launch.forward(cfg, p, q, k, v, out, lse, variant)
    return (out, lse) if return_lse else out


def attention_varlen(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    *,
    causal=False,
    softmax_scale=None,
    window_size=_DEFAULT_WINDOW,
    return_lse=False,
    out=None,
    config=None,
    softcap=0.0,
    sinks=None,
    alibi_slopes=None,
    score_mod=None,
    mask_mod=None,
    mod_args=(),
):
    """Attention over a packed batch of sequences of different lengths, without padding, in
    flash-attn's vocabulary (``flash_attn_varlen_func``).

    Args:
        q: (total_q, nheads, head_dim); k, v: (total_k, nheads_k, head_dim), q's dtype.
        cu_seqlens_q, cu_seqlens_k: int32 (batch + 1,) on q's device: sequence b is rows
            cu_seqlens[b] .. cu_seqlens[b + 1] - 1 (starting at 0, never decreasing; empty
            sequences allowed).
        max_seqlen_q, max_seqlen_k: ints >= 1, the longest sequences or more (rounded up by
            at most an eighth, exact below 16: validation.packed_bound; they size the grid
            without reading the offsets).
        causal, softmax_scale, window_size: as :func:`attention`, masks aligned bottom-right
            within each sequence's own lengths.
        return_lse: also return lse, float32 (nheads, total_q).
        out: optional output array (q's shape and dtype, sharing no memory with an input).
        config: force a forward configuration (:class:`numflash.TensorCoreConfig`,
            :class:`numflash.WgmmaForwardConfig` or :class:`numflash.PortableConfig`) as for
            :func:`attention`; by default numflash chooses as for a dense call of the max
            lengths.
        softcap: as :func:`attention` (:func:`attention_varlen_backward` takes it too).
        sinks: as :func:`attention` (a row that sees no key gets lse = its head's sink).
        alibi_slopes: as :func:`attention`, (nheads,) or (batch, nheads) with batch =
            len(cu_seqlens_q) - 1, positions within each sequence.
        score_mod, mask_mod, mod_args: as :func:`attention`, with ``b`` the sequence and
            ``q_idx``, ``kv_idx`` positions within it (q_idx aligned bottom-right against
            the sequence's own lengths, as the causal mask). A packed batch takes no
            block_mask: its sequences are its blocks already.

    Offsets on the device are trusted for their values but never followed outside the arrays:
    they are clamped to [0, total], and a sequence longer than its max_seqlen's bound is cut
    to it (its later rows are not written, its later keys not seen).
    Rows that see no key give 0 and lse -inf.

    Kernels run on CuPy's current stream; the call returns without synchronising. A repeated
    call (same shapes, strides, dtypes, flags, device and stream, max lengths of the same
    bound, ``out`` given or not) replays the launches of the first, whatever the offsets hold
    (numflash.plans).
    """
    args = (q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal)
    args += (softmax_scale, window_size, return_lse, out, config, softcap, sinks, alibi_slopes)
    mods = _user_functions(score_mod, mask_mod, mod_args)
    result, found = _lookup(_VARLEN, args, mods, "attention_varlen", _attention_varlen)
    if found is None:
        return result
    sig, key, args, mods, mod_roles = found
    q, k, v, cu_seqlens_q, cu_seqlens_k, out = (*args[:5], args[11])
    given = out is not None
    with launch.recording() as recorded:
        result = _attention_varlen(*args, mods)
    out, lse = result if return_lse else (result, None)
    # a given out was refused overlapping an input (the sinks, slopes and mod_args too)
    overlaps = [(5, r) for r in (0, 1, 2, 3, 4, *range(6, 8 + len(mod_roles))) if given]
    tail = _forward_tail(sig, 5, given, return_lse)
    outputs = (q.shape, q.dtype), ((q.shape[1], q.shape[0]), np.dtype(np.float32))
    roles = (q, k, v, cu_seqlens_q, cu_seqlens_k, out, *args[14:16], *mod_roles, lse)
    _planned(sig, key, recorded, roles, tail, overlaps, outputs)
    return result


def _attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal,
                      softmax_scale, window_size, return_lse, out, config, softcap=0.0,
                      sinks=None, alibi_slopes=None, mods=None):  # fmt: skip
    q, k, v, cu_q, cu_k, p = validation.varlen_problem(q, k, v, cu_seqlens_q, cu_seqlens_k,
        max_seqlen_q, max_seqlen_k, causal, softmax_scale, window_size, softcap,
        sinks is not None, alibi_slopes is not None)  # fmt: skip
    sinks = validation.check_sinks(sinks, q, p.nheads)
    alibi_slopes = validation.check_alibi_slopes(alibi_slopes, q, p.batch, p.nheads)
    p, mod_args = _with_mods(p, q, mods)
    return_lse = validation.check_flag(return_lse, "return_lse")
    out = validation.check_out(out, q, k, v)
    if out is not None:
        inputs = {"cu_seqlens_q": cu_q, "cu_seqlens_k": cu_k, "sinks": sinks}
        inputs.update((f"mod_args[{i}]", x) for i, x in enumerate(mod_args))
        validation.check_no_overlap(out, "out", dict(inputs, alibi_slopes=alibi_slopes))
    with _on_device(q):
        device = current_device()
        cfg = validation.check_varlen_config(config, p, device)
        if cfg is None:
            cfg = selection.forward_varlen(p, device).config
        if out is None:
            out = arrays.empty(q.shape, q.dtype, like=q)
        lse = arrays.empty((p.nheads, q.shape[0]), np.float32, like=q)
        if out.size:
            if k.shape[0] == 0:  # nothing to attend to: every row is empty
                _empty_rows(out, lse, sinks, (slice(None), None))
            else:
                variant = _variant(sinks, alibi_slopes) + mod_args
                launch.forward_varlen(cfg, p, q, k, v, out, lse, cu_q, cu_k, variant)
    return (out, lse) if return_lse else out


def attention_varlen_backward(
    dout,
    q,
    k,
    v,
    out,
    lse,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    *,
    causal=False,
    softmax_scale=None,
    window_size=(-1, -1),
    deterministic=False,
    config=None,
    softcap=0.0,
    sinks=None,
    alibi_slopes=None,
    score_mod=None,
    mask_mod=None,
    mod_args=(),
    score_mod_derivative=None,
):
    """Gradients of :func:`attention_varlen`: ``(dq, dk, dv)`` of ``sum(out * dout)``, with
    the forward's arguments (``softcap``, ``alibi_slopes``, ``score_mod``, ``mask_mod`` and
    ``mod_args`` too; a score_mod with its ``score_mod_derivative``, as
    :func:`attention_backward` takes it) and its outputs out and lse (nheads, total_q); with
    ``sinks`` also dsinks, as :func:`attention_backward` returns it.
    The kernels and ``deterministic`` as for :func:`attention_backward`, chosen as for a dense
    call of the max lengths; ``config`` forces a backward configuration as there. Rows of no
    sequence, or past a max_seqlen's bound (the forward's cut), get zero gradients.

    Kernels run on CuPy's current stream; the call returns without synchronising. Refused
    under stream capture: it zeroes the gradients outside its kernels, which a replay plan
    does not redo.
    """
    _refuse_under_capture("attention_varlen_backward", planned=False)
    q, k, v, cu_q, cu_k, p = validation.varlen_problem(q, k, v, cu_seqlens_q, cu_seqlens_k,
        max_seqlen_q, max_seqlen_k, causal, softmax_scale, window_size, softcap,
        alibi=alibi_slopes is not None)  # fmt: skip
    mods = (score_mod, mask_mod, mod_args, score_mod_derivative, None)
    p, mod_args = _with_mods(p, q, mods, backward=True)
    return _gradients(p, dout, q, k, v, out, lse, (p.nheads, q.shape[0]), deterministic, config,
                      (cu_q, cu_k), sinks, alibi_slopes, mod_args)  # fmt: skip


def selected_backward_config(
    q, k, v, *, causal=False, window_size=(-1, -1), deterministic=False, config=None
):
    """The configuration ``attention_backward`` would run with for these inputs, and where it
    comes from: ``(config, source)`` as :func:`selected_config` returns it. Launches nothing."""
    q, k, v, p = validation.problem(q, k, v, causal, None, window_size)
    deterministic = validation.check_flag(deterministic, "deterministic")
    with _on_device(q):
        device = current_device()
        if config is not None:
            cfg = validation.check_backward_config(config, p, deterministic, device)
            return selection.Selection(cfg, "forced")
        return selection.backward(p, device, deterministic)


def attention_backward(
    dout,
    q,
    k,
    v,
    out,
    lse,
    *,
    causal=False,
    softmax_scale=None,
    window_size=_DEFAULT_WINDOW,
    deterministic=False,
    config=None,
    softcap=0.0,
    sinks=None,
    alibi_slopes=None,
    score_mod=None,
    mask_mod=None,
    mod_args=(),
    score_mod_derivative=None,
    block_mask=None,
):
    """Gradients of :func:`attention`: ``(dq, dk, dv)`` of ``sum(out * dout)``.

    Args:
        dout: the gradient of the loss with respect to ``out``; q's shape and dtype.
        q, k, v: the forward's inputs.
        out, lse: the forward's outputs (``attention(..., return_lse=True)``); attention is
            recomputed from q, k and lse, never stored.
        causal, softmax_scale, window_size, softcap, alibi_slopes: as given to the forward
            call (a softcap or slopes the forward had and the backward is not given give wrong
            gradients: the backward recomputes the scores from these arguments).
        deterministic: ask for bitwise reproducible gradients. Every kernel family is, except
            an mma.sync or Hopper configuration with ``dq_separate=False`` (dQ added up by
            atomics or bulk reductions, in no fixed order): with the flag, a tuned
            configuration of that kind runs with ``dq_separate=True`` instead, and a forced
            one is refused.
        config: force a :class:`numflash.PortableBackwardConfig`, a
            :class:`numflash.TensorCoreBackwardConfig` (mma.sync, fp16/bf16, compute capability
            8.0+) or a :class:`numflash.WgmmaBackwardConfig` (Hopper). By default numflash
            chooses (:func:`selected_backward_config` tells which).
        sinks: the forward's sink logits, float32 (nheads,), if it had them: dq, dk and dv
            need only the forward's lse (which holds them); given, the call also returns
            dsinks = -sum over batch and rows of exp(sinks[h] - lse) * rowsum(dout * out),
            summed in a fixed order.
        score_mod, mask_mod, mod_args: as given to the forward call.
        score_mod_derivative: with a score_mod, a Numba CUDA device function
            ``score_mod_derivative(score, b, h, q_idx, kv_idx, *mod_args) -> float``, the
            derivative of score_mod with respect to score at these arguments (a score_mod
            without it is an error: the gradients need it).
        block_mask: as given to the forward call (checked against the call): dQ skips the
            key tiles it hides from a row block, dK and dV the query rows it hides from a key
            block.

    Returns:
        dq with q's shape and dtype; dk and dv with k's shape and dtype; with ``sinks``, also
        dsinks, float32 (nheads,). With GQA, dk and dv sum the contributions of every query
        head of their group. Rows that see no key contribute nothing; keys that no row sees
        get zero gradients; a NaN in the inputs propagates.

    Kernels run on CuPy's current stream; the call returns without synchronising. A repeated
    call replays the launches of the first (numflash.plans).
    """
    args = (dout, q, k, v, out, lse, causal, softmax_scale, window_size, deterministic, config)
    args += (softcap, sinks, alibi_slopes)
    mods = _user_functions(score_mod, mask_mod, mod_args, score_mod_derivative, block_mask)
    grads, found = _lookup(_BACKWARD, args, mods, "attention_backward", _attention_backward)
    if found is None:
        return grads
    sig, key, args, mods, mod_roles = found
    with launch.recording() as recorded:
        grads = _attention_backward(*args, mods)
    outputs = [(x.shape, x.dtype) for x in grads]  # dq, dk, dv, and dsinks with sinks
    first = _output_roles(sig)
    made = tuple((i, first + i) for i in range(len(grads)))
    tail = plans.Tail(made, tuple(range(len(grads))))
    roles = (*args[:6], *args[12:14], *mod_roles, *grads)
    _planned(sig, key, recorded, roles, tail, (), outputs)
    return grads


def _attention_backward(
    dout, q, k, v, out, lse, causal, softmax_scale, window_size, deterministic, config,
    softcap=0.0, sinks=None, alibi_slopes=None, mods=None,
):  # fmt: skip
    # -- validate and normalise (the sinks change no gradient kernel: lse holds them)
    q, k, v, p = validation.problem(q, k, v, causal, softmax_scale, window_size, softcap,
                                    alibi=alibi_slopes is not None)  # fmt: skip
    p, mod_args = _with_mods(p, q, mods, backward=True)
    lse_shape = (p.batch, p.nheads, p.seqlen_q)
    return _gradients(p, dout, q, k, v, out, lse, lse_shape, deterministic, config, None, sinks,
                      alibi_slopes, mod_args)  # fmt: skip


def _gradients(
    p, dout, q, k, v, out, lse, lse_shape, deterministic, config, offsets=None, sinks=None,
    alibi_slopes=None, mod_args=(),
):  # fmt: skip
    """(dq, dk, dv) of the validated problem ``p`` over q, k, v: dense, or a packed batch with
    ``offsets`` = (cu_q, cu_k) (lse of shape ``lse_shape``); with ``sinks`` a fourth, dsinks
    (launch.sink_gradient). The gradient kernels take the ALiBi slopes (the sinks only
    through lse)."""
    dout = validation.check_like(dout, "dout", q, "q")
    out = validation.check_like(out, "out", q, "q")
    lse = validation.check_like(lse, "lse", q, "q", dtype=np.dtype(np.float32), shape=lse_shape)
    sinks = validation.check_sinks(sinks, q, p.nheads)
    alibi_slopes = validation.check_alibi_slopes(alibi_slopes, q, p.batch, p.nheads)
    variant = _variant(None, alibi_slopes) + mod_args
    deterministic = validation.check_flag(deterministic, "deterministic")
    with _on_device(q):
        device = current_device()
        cfg = validation.check_backward_config(config, p, deterministic, device)
        # -- choose
        if cfg is None:
            choose = selection.backward if offsets is None else selection.backward_varlen
            cfg = choose(p, device, deterministic).config
        # -- launch
        grads = tuple(arrays.empty(x.shape, x.dtype, like=q) for x in (q, k, v))
        if grads[0].size == 0 or k.size == 0:
            launch.note_unrecorded_work()  # (a plan would not repeat the fills)
            for g in grads:  # nothing attends: every gradient is 0
                arrays.bits(g)[...] = 0
        elif offsets is None:
            launch.backward(cfg, p, dout, q, k, v, out, lse, *grads, variant=variant)
        else:
            launch.backward_varlen(
                cfg, p, dout, q, k, v, out, lse, *grads, *offsets, variant=variant
            )
        if sinks is None:
            return grads
        dsinks = arrays.empty((p.nheads,), np.float32, like=q)
        if q.size == 0:
            launch.note_unrecorded_work()
            dsinks[...] = 0
        else:
            launch.sink_gradient(p, dout, out, lse, sinks, dsinks, packed=offsets is not None)
    return (*grads, dsinks)


def selected_kvcache_config(
    q,
    k_cache,
    v_cache,
    k=None,
    v=None,
    *,
    cache_seqlens,
    cache_batch_idx=None,
    block_table=None,
    causal=False,
    window_size=(-1, -1),
    num_splits=0,
    config=None,
    softcap=0.0,
):
    """``(selection, num_splits)``: the configuration ``attention_with_kvcache`` would run with
    for these arguments, where it comes from (as :func:`selected_config` says), and the split
    count. Raises the same errors; launches and writes nothing."""
    q, k_cache, v_cache, k, v, _, _, _, p = validation.kvcache_problem(
        q, k_cache, v_cache, k, v, cache_seqlens, cache_batch_idx, block_table, causal, None,
        window_size, num_splits, softcap)  # fmt: skip
    with _on_device(q):
        device = current_device()
        return selection.decode(p, device, validation.check_decode_config(config, p, device))


def attention_with_kvcache(
    q,
    k_cache,
    v_cache,
    k=None,
    v=None,
    *,
    cache_seqlens,
    cache_batch_idx=None,
    block_table=None,
    causal=False,
    softmax_scale=None,
    window_size=_DEFAULT_WINDOW,
    num_splits=0,
    return_lse=False,
    out=None,
    config=None,
    softcap=0.0,
    sinks=None,
    alibi_slopes=None,
    score_mod=None,
    mask_mod=None,
    mod_args=(),
):
    """Attention of new query rows over a KV cache, appending new keys and values in place
    (decoding, speculative decoding, chunked prefill), in flash-attn's vocabulary.

    Args:
        q: (batch, seqlen_q, nheads, head_dim), seqlen_q >= 1.
        k_cache, v_cache: a contiguous cache (batch_cache, seqlen_cache, nheads_k, head_dim), or
            a paged one (num_blocks, page_size, nheads_k, head_dim) with ``block_table``; q's
            dtype; any page_size >= 1.
        k, v: optional (batch, seqlen_new, nheads_k, head_dim): written into the caches at
            positions cache_seqlens[b] .. + seqlen_new - 1 and attended to in the same call.
        cache_seqlens: tokens already cached, an int or an int32 array (batch,) on the device
            (read on the device: the call does not synchronise). Not advanced by the call.
        cache_batch_idx: int32 (batch,), the cache row of each batch row (contiguous caches).
        block_table: int32 (batch, max_blocks), the pages of each sequence (paged caches).
        causal, softmax_scale, window_size: as :func:`attention`, aligned bottom-right against
            each sequence's length after the append.
        num_splits: thread blocks sharing one sequence's keys; 0 chooses. More than 1 keeps
            the call on the split-KV decode kernels.
        return_lse: also return lse, float32 (batch, nheads, seqlen_q).
        out: optional output array (q's shape and dtype, sharing no memory with an input).
        config: force a :class:`numflash.TensorCoreDecodeConfig` (fp16/bf16, compute
            capability 8.0+, head_dim a multiple of 8, caches with 16-byte aligned rows), a
            :class:`numflash.PortableDecodeConfig`, or a :class:`numflash.WgmmaForwardConfig`
            (the Hopper forward over the caches; compute capability 9.x, as the tensor-core
            kernel otherwise, one split); by default numflash chooses: on compute capability
            9.x a call with more new query rows than selection.prefill_rows (24 over a
            contiguous cache or pages of 64 rows or more, 36 over smaller pages whose size is
            a multiple of 8, 48 over other pages: chunked prefill, long drafts) runs the
            Hopper forward after appending, fewer the split-KV decode kernel.
        softcap: as :func:`attention`, on every kernel this call may run.
        sinks: as :func:`attention`: float32 (nheads,), joined to every row's sum.
        alibi_slopes: as :func:`attention`, (nheads,) or (batch, nheads): a query's position
            is its place in the sequence after the append.
        score_mod, mask_mod, mod_args: as :func:`attention`, with ``b`` q's batch row and
            ``q_idx`` the query's position in the sequence after the append (as the causal
            mask aligns it), ``kv_idx`` the key's; mod_args must not share memory with the
            caches an append writes. Such a call takes no block_mask; it replays as
            :func:`attention`'s.

    Lengths that can be checked on the host (an int cache_seqlens, the shapes) are; lengths
    and indices on the device are trusted for their values but never followed outside the
    arrays: a sequence's length is clamped to its capacity, rows past the capacity are not
    written, and a key behind an out-of-range cache row or page is treated as absent.

    Kernels run on CuPy's current stream; the call returns without synchronising. A repeated
    call (same shapes, strides, dtypes, flags, device and stream, ``out`` given or not)
    replays the launch of the first (numflash.plans).
    """
    args = (q, k_cache, v_cache, k, v, cache_seqlens, cache_batch_idx, block_table, causal)
    args += (softmax_scale, window_size, num_splits, return_lse, out, config, softcap, sinks)
    args += (alibi_slopes,)
    mods = _user_functions(score_mod, mask_mod, mod_args)
    # no plan yet, a written cache or an out= overlapping an input, or one cache for k and v
    # (an append would write one over the other): the full path refuses it by name
    result, found = _lookup(_KVCACHE, args, mods, "attention_with_kvcache", _attention_with_kvcache)
    if found is None:
        return result
    sig, key, args, mods, mod_roles = found
    q, k_cache, v_cache, k, v, cache_seqlens, cache_batch_idx, block_table = args[:8]
    out = args[13]
    seqlens, lengths = cache_seqlens, ()
    if isinstance(cache_seqlens, int):  # filled into an array of its own (launch.host_lengths)
        seqlens, lengths = None, ((5, 0, _capacity(k_cache, block_table) - _rows(k)),)
    given = out is not None
    with launch.recording() as recorded:
        result = _attention_with_kvcache(*args, mods)
    out, lse = result if return_lse else (result, None)
    roles = (q, k_cache, v_cache, k, v, seqlens, cache_batch_idx, block_table, out, *args[16:18])
    roles += (*mod_roles, lse)
    # the caches are written: validation refused them overlapping q or the new rows, and (an
    # append writing them) the lengths, the slot map, the table, the sinks, the slopes and
    # the mod_args; a given out, any input
    variant = tuple(range(9, 11 + len(mod_roles)))
    readers = (0, 3, 4, 5, 6, 7, *variant) if k is not None else (0, 3, 4)
    overlaps = [(c, r) for c in (1, 2) for r in readers]
    overlaps += [(8, r) for r in (0, 1, 2, 3, 4, 5, 6, 7, *variant) if given]
    tail = _forward_tail(sig, 8, given, return_lse)
    if k is not None:  # the signature fixes the two caches' layouts: equal addresses, one cache
        tail = tail._replace(distinct=((1, 2),))
    _planned(sig, key, recorded, roles, tail, overlaps, _outputs(q), lengths)
    return result


def _capacity(k_cache, block_table):
    """Keys a sequence of a validated KV-cache call can hold."""
    if block_table is None:
        return k_cache.shape[1]
    return block_table.shape[1] * k_cache.shape[1]


def _rows(k):
    """New rows a validated KV-cache call appends."""
    return 0 if k is None else k.shape[1]


def _attention_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens, cache_batch_idx,
                            block_table, causal, softmax_scale, window_size, num_splits,
                            return_lse, out, config, softcap=0.0, sinks=None,
                            alibi_slopes=None, mods=None):  # fmt: skip
    q, k_cache, v_cache, k, v, seqlens, batch_idx, block_table, p = validation.kvcache_problem(
        q, k_cache, v_cache, k, v, cache_seqlens, cache_batch_idx, block_table, causal,
        softmax_scale, window_size, num_splits, softcap, sinks is not None,
        alibi_slopes is not None)  # fmt: skip
    sinks = validation.check_sinks(sinks, q, p.nheads)
    alibi_slopes = validation.check_alibi_slopes(alibi_slopes, q, p.batch, p.nheads)
    p, mod_args = _with_mods(p, q, mods)
    return_lse = validation.check_flag(return_lse, "return_lse")
    caches = dict(k_cache=k_cache, v_cache=v_cache) if k is not None else {}  # written
    variant = {"sinks": sinks, "alibi_slopes": alibi_slopes}
    variant.update((f"mod_args[{i}]", x) for i, x in enumerate(mod_args))
    for name, x in variant.items():
        if x is not None:
            validation.check_no_overlap(x, name, caches)
    if out is not None:
        out = validation.check_like(out, "out", q, "q")
        validation.check_writable(out, "out")
        inputs = dict(q=q, k_cache=k_cache, v_cache=v_cache, k=k, v=v, cache_seqlens=seqlens)
        inputs.update(cache_batch_idx=batch_idx, block_table=block_table, **variant)
        validation.check_no_overlap(out, "out", inputs)
    with _on_device(q):
        device = current_device()
        choice, splits = selection.decode(
            p, device, validation.check_decode_config(config, p, device)
        )
        cfg = choice.config
        if out is None:
            out = arrays.empty(q.shape, q.dtype, like=q)
        lse = arrays.empty((p.batch, p.nheads, p.seqlen_q), np.float32, like=q)
        if out.size:
            launch.kvcache(cfg, splits, p, q, k_cache, v_cache, k, v, seqlens, batch_idx,
                           block_table, out, lse, _variant(sinks, alibi_slopes) + mod_args)  # fmt: skip
    return (out, lse) if return_lse else out
