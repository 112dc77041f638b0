"""Argument checks of the public functions, each error naming the argument.

Every function here raises ValueError or TypeError that says which argument is wrong, what was
given and what is accepted; none launches anything or touches an output. :func:`problem`
returns the normalised :class:`Problem` a call poses.
"""

import dataclasses
import math
import numbers

import numpy as np

from . import arrays
from .block_masks import BlockMask
from .config import MAX_HEAD_DIM, families
from .kernels.jit import SIMULATOR

#: CUDA caps gridDim.y and gridDim.z at 65535; heads and batch are launched along them.
MAX_GRID_YZ = 65535
MAX_INT32 = 2**31 - 1
#: The largest finite float32: the kernels take the scale as one.
_FLOAT32_MAX = float(np.finfo(np.float32).max)


@dataclasses.dataclass(frozen=True)
class Problem:
    """What a call computes, normalised: sizes, dtype name, scale and window (causal is the
    window (left, 0); -1 means unbounded, and a bound past every key is clamped), the softcap
    of the scores (0: none), whether a sink logit a head joins the softmax and whether ALiBi
    biases the scores (the arrays travel beside the problem: check_sinks,
    check_alibi_slopes)."""

    batch: int
    seqlen_q: int
    seqlen_k: int
    nheads: int
    nheads_k: int
    head_dim: int
    dtype: str
    scale: float
    window_left: int
    window_right: int
    softcap: float = 0.0
    sinks: bool = False
    alibi: bool = False
    mods: object = None  # a Mods: the user's score and mask functions (check_mods)

    @property
    def heads_per_kv(self):
        return self.nheads // self.nheads_k


def shape_str(x):
    return "(" + ", ".join(str(n) for n in x.shape) + ")"


def check_flag(value, name):
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be a bool; got {value!r}")
    return bool(value)


def check_window(window_size, causal):
    if window_size.__class__ is tuple and len(window_size) == 2:  # the common case, at once
        left, right = window_size
        if left.__class__ is int and right.__class__ is int and left >= -1 and right >= -1:
            return left, 0 if causal else right
    ok = isinstance(window_size, (tuple, list)) and len(window_size) == 2
    if ok:
        ok = all(
            isinstance(w, numbers.Integral) and not isinstance(w, bool) and w >= -1
            for w in window_size
        )
    if not ok:
        raise ValueError(
            "window_size must be a pair (left, right) of ints >= -1, -1 meaning unbounded; "
            f"got {window_size!r}"
        )
    left, right = (int(w) for w in window_size)
    if causal:
        right = 0  # causal is the window (left, 0)
    return left, right


def _clamp_window(w, seqlen_q, seqlen_k):
    """A window wider than seqlen_q + seqlen_k hides nothing: say so with an int32 the kernels
    take (any reach beyond that bound sees the same keys)."""
    return w if w <= seqlen_q + seqlen_k else seqlen_q + seqlen_k


def _real_number(value, name, accepted):
    """``value`` as a float, or TypeError naming ``name`` where it is no real number (a bool
    is not); a number past float's range comes back as inf."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be {accepted}; got {value!r}")
    try:
        return float(value)
    except OverflowError:
        return math.inf


def check_scale(softmax_scale, head_dim):
    if softmax_scale is None:
        return 1.0 / math.sqrt(head_dim)
    scale = _real_number(softmax_scale, "softmax_scale", "a real number or None")
    if not math.isfinite(scale) or abs(scale) > _FLOAT32_MAX:
        raise ValueError(
            f"softmax_scale must be finite in float32 (|scale| <= {_FLOAT32_MAX:.4g}); "
            f"got {softmax_scale!r}"
        )
    return scale


def check_softcap(softcap):
    """The softcap as a float: 0 (none) or a finite positive number within float32."""
    if softcap.__class__ is float and 0.0 <= softcap <= _FLOAT32_MAX:
        return softcap
    cap = _real_number(softcap, "softcap", "a real number (0 for none)")
    if not (math.isfinite(cap) and 0.0 <= cap <= _FLOAT32_MAX):
        raise ValueError(
            f"softcap must be 0 (none) or a finite positive number within float32; got {softcap!r}"
        )
    return cap


def _variant_array(x, name, q, shapes, expected):
    """A variant's array as the kernels read it: float32, of one of ``shapes`` (``expected``
    says which in the error), on q's device, C-contiguous (a copy where it was strided)."""
    x = arrays.intake(x, name)
    if x.dtype != np.float32:
        raise TypeError(f"{name} must have dtype float32; got {x.dtype}")
    if x.shape not in shapes:
        raise ValueError(f"{name} must have shape {expected}; got {shape_str(x)}")
    check_device(x, name, q, "q")
    return arrays.array_module(x).ascontiguousarray(x)


def check_alibi_slopes(slopes, q, batch, nheads):
    """None, or ALiBi slopes as the kernels read them: float32 of shape (nheads,) or (batch,
    nheads) on q's device, as a contiguous array (their values are not read: a non-finite
    slope makes NaN scores, which reach the rows' outputs)."""
    if slopes is None:
        return None
    expected = f"(nheads,) = ({nheads},) or (batch, nheads) = ({batch}, {nheads})"
    return _variant_array(slopes, "alibi_slopes", q, ((nheads,), (batch, nheads)), expected)


def check_sinks(sinks, q, nheads):
    """The sink logits as a C-contiguous float32 array of shape (nheads,) on q's device (a
    copy where they were strided), or None."""
    if sinks is None:
        return None
    return _variant_array(sinks, "sinks", q, ((nheads,),), f"(nheads,) = ({nheads},)")


@dataclasses.dataclass(frozen=True)
class Mods:
    """A call's user functions (kernels/mods.py says how the kernels call them) and the
    kernel element type of each of its mod_args ("int32", "int64" or "float32"): what its
    kernels are compiled for, besides the problem."""

    score_mod: object = None
    mask_mod: object = None
    score_mod_derivative: object = None
    kinds: tuple = ()
    #: Whether a block mask's index follows the mod_args (kernels/block_mask.py).
    block_mask: bool = False


#: The mod_args dtypes the kernels take, as kernel element types.
_MOD_ARG_KINDS = {np.dtype(np.int32): "int32", np.dtype(np.int64): "int64",
                  np.dtype(np.float32): "float32"}  # fmt: skip


def check_device_function(fn, name):
    """``fn`` if it is a Numba CUDA device function (``numba.cuda.jit(device=True)``)."""
    device = getattr(fn, "targetoptions", {}).get("device") or getattr(fn, "_device", False)
    if not (device and callable(getattr(fn, "py_func", None))):
        raise TypeError(
            f"{name} must be a Numba CUDA device function (decorated with "
            f"@numba.cuda.jit(device=True)); got {fn!r}"
        )
    return fn


def check_mods(score_mod, mask_mod, mod_args, q, score_mod_derivative=None, backward=False,
               block_mask=None):  # fmt: skip
    """(Mods or None, the mod_args as the kernels read them) of a call's user functions:
    each None or a Numba CUDA device function; ``mod_args`` a tuple or list of 1-D
    C-contiguous int32, int64 or float32 arrays on q's device, which only calls with a
    score_mod or mask_mod take. ``backward``: a score_mod needs its derivative.
    ``block_mask``: a BlockMask checked against the call (check_block_mask), its index
    after the mod_args."""
    if not isinstance(mod_args, (tuple, list)):
        raise TypeError(f"mod_args must be a tuple of arrays; got {type(mod_args).__name__}")
    if score_mod is None and mask_mod is None:
        if mod_args:
            raise ValueError("mod_args are passed to score_mod and mask_mod; neither was given")
        if score_mod_derivative is not None:
            raise ValueError("score_mod_derivative was given without a score_mod")
        return None, ()
    if score_mod is not None:
        check_device_function(score_mod, "score_mod")
    if mask_mod is not None:
        check_device_function(mask_mod, "mask_mod")
    if score_mod_derivative is not None:
        if score_mod is None:
            raise ValueError("score_mod_derivative was given without a score_mod")
        check_device_function(score_mod_derivative, "score_mod_derivative")
    elif backward and score_mod is not None:
        raise ValueError(
            "the gradients through a score_mod need score_mod_derivative(score, b, h, q_idx, "
            "kv_idx, *mod_args), its derivative with respect to score"
        )
    args, kinds = check_mod_args(mod_args, q, "q")
    if block_mask is not None:
        args += (block_mask.index,)
    mods = Mods(score_mod, mask_mod, score_mod_derivative, kinds, block_mask is not None)
    return mods, args


def check_mod_args(mod_args, like, like_name):
    """(arrays, kernel element types) of ``mod_args``: 1-D C-contiguous int32, int64 or
    float32 arrays on ``like``'s device."""
    args, kinds = [], []
    for i, x in enumerate(mod_args):
        name = f"mod_args[{i}]"
        x = arrays.intake(x, name)
        kind = _MOD_ARG_KINDS.get(np.dtype(x.dtype))
        if kind is None:
            raise TypeError(f"{name} must have dtype int32, int64 or float32; got {x.dtype}")
        if x.ndim != 1 or not x.flags.c_contiguous or x.size == 0:
            raise ValueError(
                f"{name} must be a non-empty 1-D C-contiguous array (index a table flat); got "
                f"shape {shape_str(x)}" + ("" if x.ndim != 1 else ", strided")
            )
        if like is not None:
            check_device(x, name, like, like_name)
        args.append(x)
        kinds.append(kind)
    return tuple(args), tuple(kinds)


def check_count(value, name, optional=False):
    """``value`` as a positive int (a Python or NumPy integer; None where ``optional``)."""
    if value is None and optional:
        return None
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be a positive int{' or None' if optional else ''}; "
                        f"got {value!r}")  # fmt: skip
    if value < 1:
        raise ValueError(f"{name} must be at least 1; got {value}")
    return int(value)


def _same_arrays(a, b):
    """Whether two tuples of arrays hold the same arrays (the same memory, shape, dtype)."""
    return len(a) == len(b) and all(
        x.dtype == y.dtype and arrays.same_elements(x, y) for x, y in zip(a, b)
    )


def check_block_mask(block_mask, mask_mod, mod_args, p, q):
    """(mask_mod, mod_args) of a call with ``block_mask`` (a numflash.BlockMask, or None):
    the block mask's where the call gives none, else the same function and arrays it was
    made with; its shape the call's (a batch or heads of None: any)."""
    if block_mask is None:
        return mask_mod, mod_args
    if not isinstance(block_mask, BlockMask):
        raise TypeError(
            f"block_mask must be a numflash.BlockMask (numflash.block_mask(...)); got "
            f"{type(block_mask).__name__}"
        )
    made = (block_mask.batch, block_mask.nheads, block_mask.seqlen_q, block_mask.seqlen_k)
    call = (p.batch, p.nheads, p.seqlen_q, p.seqlen_k)
    if any(m is not None and m != c for m, c in zip(made, call)):
        show = ", ".join("any" if m is None else str(m) for m in made)
        raise ValueError(
            f"block_mask was made for (batch, nheads, seqlen_q, seqlen_k) = ({show}); the "
            f"call has {call}"
        )
    if mask_mod is None:
        mask_mod = block_mask.mask_mod
    elif mask_mod is not block_mask.mask_mod:
        raise ValueError("mask_mod is not the function block_mask was made with")
    if not mod_args:
        mod_args = block_mask.mod_args
    elif not _same_arrays(tuple(arrays.intake(x, "mod_args") for x in mod_args),
                          block_mask.mod_args):  # fmt: skip
        raise ValueError(
            "mod_args are not the arrays block_mask was made with (a block mask holds what its "
            "mask_mod saw of them: make it again for new ones)"
        )
    check_device(block_mask.kinds, "block_mask", q, "q")
    return mask_mod, mod_args


def check_qkv(q, k, v):
    """Shapes, dtypes and devices of q, k, v; returns the dtype name."""
    name = _qkv_fine(q, k, v)
    return name if name is not None else _check_qkv_each(q, k, v)


def _qkv_fine(q, k, v):
    """The dtype name of q, k and v where every check of :func:`check_qkv` passes, at the cost
    of a few comparisons; else None (the checks one by one then say what is wrong)."""
    qs, ks, vs = q.shape, k.shape, v.shape
    if not (len(qs) == len(ks) == len(vs) == 4 and ks == vs and q.dtype == k.dtype == v.dtype):
        return None
    b, _, h, d = qs
    name = arrays.dtype_name(q.dtype)
    if name is None or ks[0] != b or ks[3] != d or not 1 <= d <= MAX_HEAD_DIM:
        return None
    if ks[2] == 0 or h % ks[2] or h > MAX_GRID_YZ or b > MAX_GRID_YZ:
        return None
    device = arrays.device_id(q)
    if arrays.device_id(k) != device or arrays.device_id(v) != device:
        return None
    return name


def _check_qkv_each(q, k, v):
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.ndim != 4:
            raise ValueError(
                f"{name} must have 4 dimensions (batch, seqlen, nheads, head_dim); "
                f"got shape {shape_str(x)}"
            )
    devices = {name: arrays.device_id(x) for name, x in (("q", q), ("k", k), ("v", v))}
    if len(set(devices.values())) > 1:
        raise ValueError(f"q, k and v must be on the same GPU; got devices {devices}")
    names = {name: arrays.dtype_name(x.dtype) for name, x in (("q", q), ("k", k), ("v", v))}
    for name, x in (("q", q), ("k", k), ("v", v)):
        if names[name] is None:
            raise TypeError(f"{name} has dtype {x.dtype}; accepted: float16, bfloat16, float32")
    if len(set(names.values())) > 1:
        raise TypeError(f"q, k and v must share one dtype; got {names}")
    b, sq, h, d = q.shape
    if k.shape[0] != b or v.shape[0] != b:
        raise ValueError(
            f"batch sizes differ: q {shape_str(q)}, k {shape_str(k)}, v {shape_str(v)}"
        )
    if k.shape[1] != v.shape[1]:
        raise ValueError(f"k and v must have the same seqlen; got {k.shape[1]} and {v.shape[1]}")
    if k.shape[2] != v.shape[2]:
        raise ValueError(f"k and v must have the same nheads; got {k.shape[2]} and {v.shape[2]}")
    if k.shape[3] != d or v.shape[3] != d:
        raise ValueError(
            f"head_dim differs: q {d}, k {k.shape[3]}, v {v.shape[3]}; all three must match"
        )
    if not 1 <= d <= MAX_HEAD_DIM:
        raise ValueError(f"head_dim must be in [1, {MAX_HEAD_DIM}]; got {d}")
    h_k = k.shape[2]
    if h_k == 0 or h % h_k:
        raise ValueError(
            f"nheads of q ({h}) must be a multiple of nheads of k and v ({h_k}) (GQA/MQA)"
        )
    if h > MAX_GRID_YZ or b > MAX_GRID_YZ:
        raise ValueError(f"nheads and batch must be at most {MAX_GRID_YZ}; got {h} and {b}")
    return names["q"]


def check_device(x, name, like, like_name):
    if arrays.device_id(x) != arrays.device_id(like):
        raise ValueError(
            f"{name} is on device {arrays.device_id(x)} but {like_name} is on "
            f"{arrays.device_id(like)}"
        )


def check_writable(x, name):
    """An output must be writable (NumPy views in the simulator can be read-only)."""
    if isinstance(x, np.ndarray) and not x.flags.writeable:
        raise ValueError(f"{name} is read-only; pass a writable array")


def check_no_overlap(x, name, others):
    """``x`` (an output) must share no memory with any of ``others`` ({name: array or None},
    None for an absent one): a block would write over rows that another block still reads."""
    for other_name, other in others.items():
        if other is not None and arrays.may_share_memory(x, other):
            raise ValueError(
                f"{name} overlaps {other_name} in memory; pass an output that shares no memory "
                "with the inputs"
            )


def check_out(out, q, k, v):
    if out is None:
        return None
    out = arrays.intake(out, "out")
    if out.shape != q.shape:
        raise ValueError(f"out must have q's shape {shape_str(q)}; got {shape_str(out)}")
    if out.dtype != q.dtype:
        raise TypeError(f"out must have q's dtype {q.dtype}; got {out.dtype}")
    check_device(out, "out", q, "q")
    check_writable(out, "out")
    check_no_overlap(out, "out", {"q": q, "k": k, "v": v})
    return out


def check_like(x, name, like, like_name, dtype=None, shape=None):
    """``x`` adopted as an array with ``like``'s shape, dtype and device (or the given ones)."""
    x = arrays.intake(x, name)
    shape = like.shape if shape is None else shape
    dtype = like.dtype if dtype is None else dtype
    if x.shape != shape:
        what = f"{like_name}'s shape" if shape == like.shape else "shape"
        raise ValueError(
            f"{name} must have {what} ({', '.join(map(str, shape))}); got {shape_str(x)}"
        )
    if x.dtype != dtype:
        raise TypeError(f"{name} must have dtype {dtype}; got {x.dtype}")
    check_device(x, name, like, like_name)
    return x


def problem(
    q, k, v, causal, softmax_scale, window_size, softcap=0.0, sinks=False, alibi=False, mods=None
):  # fmt: skip
    """The validated arrays and the normalised :class:`Problem` they pose (``sinks``,
    ``alibi``: whether the call has sink logits, ALiBi slopes; ``mods``: its Mods, from
    check_mods)."""
    q = arrays.intake(q, "q")
    k = arrays.intake(k, "k")
    v = arrays.intake(v, "v")
    dtype = check_qkv(q, k, v)
    causal = check_flag(causal, "causal")
    left, right = check_window(window_size, causal)
    scale = check_scale(softmax_scale, q.shape[-1])
    b, sq, h, d = q.shape
    sk = k.shape[1]
    left, right = _clamp_window(left, sq, sk), _clamp_window(right, sq, sk)
    cap = check_softcap(softcap)
    p = Problem(b, sq, sk, h, k.shape[2], d, dtype, scale, left, right, cap, bool(sinks),
                bool(alibi), mods)  # fmt: skip
    return q, k, v, p


def _check_offsets(cu, name, like):
    """cu_seqlens: an int32 vector of batch + 1 offsets on ``like``'s device; when its values
    are on the host (NumPy, the simulator), starting at 0 and non-decreasing."""
    cu = arrays.intake(cu, name)
    if cu.dtype != np.int32:
        raise TypeError(f"{name} must have dtype int32; got {cu.dtype}")
    if cu.ndim != 1 or cu.shape[0] < 2:
        raise ValueError(
            f"{name} must have shape (batch + 1,) with batch >= 1; got {shape_str(cu)}"
        )
    check_device(cu, name, like, "q")
    if isinstance(cu, np.ndarray):
        if cu[0] != 0 or (np.diff(cu) < 0).any():
            raise ValueError(f"{name} must start at 0 and never decrease; got {cu.tolist()}")
    return cu


def varlen_problem(
    q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, scale, window,
    softcap=0.0, sinks=False, alibi=False,
):  # fmt: skip
    """Validated packed arrays (q, k, v, cu_seqlens_q, cu_seqlens_k) and the :class:`Problem`
    of the batch: batch = len(cu_seqlens_q) - 1, seqlens the max lengths as the kernels cover
    them (:func:`packed_bound`)."""
    q = arrays.intake(q, "q")
    k = arrays.intake(k, "k")
    v = arrays.intake(v, "v")
    for name, x, total in (("q", q, "total_q"), ("k", k, "total_k"), ("v", v, "total_k")):
        if x.ndim != 3:
            raise ValueError(
                f"{name} must have 3 dimensions ({total}, nheads, head_dim); got shape "
                f"{shape_str(x)}"
            )
    dtype = check_qkv(q[None], k[None], v[None])
    cu_q = _check_offsets(cu_seqlens_q, "cu_seqlens_q", q)
    cu_k = _check_offsets(cu_seqlens_k, "cu_seqlens_k", q)
    if cu_k.shape != cu_q.shape:
        raise ValueError(
            f"cu_seqlens_k must have cu_seqlens_q's shape {shape_str(cu_q)}; got {shape_str(cu_k)}"
        )
    for name, cu, x, total in (
        ("cu_seqlens_q", cu_q, q, "total_q"),
        ("cu_seqlens_k", cu_k, k, "total_k"),
    ):
        if isinstance(cu, np.ndarray) and cu[-1] != x.shape[0]:
            raise ValueError(
                f"{name} ends at {cu[-1]} but the packed array holds {x.shape[0]} rows ({total})"
            )
    max_seqlen_q = _check_int(max_seqlen_q, "max_seqlen_q", low=1)
    max_seqlen_k = _check_int(max_seqlen_k, "max_seqlen_k", low=1)
    for name, value in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
        if value > MAX_INT32:
            raise ValueError(f"{name} must be below 2**31; got {value}")
    batch = cu_q.shape[0] - 1
    if batch > MAX_GRID_YZ:
        raise ValueError(
            f"batch (len(cu_seqlens_q) - 1) must be at most {MAX_GRID_YZ}; got {batch}"
        )
    causal = check_flag(causal, "causal")
    left, right = check_window(window, causal)
    scale = check_scale(scale, q.shape[-1])
    rows_q, rows_k = packed_bound(max_seqlen_q), packed_bound(max_seqlen_k)
    left, right = (_clamp_window(w, rows_q, rows_k) for w in (left, right))
    h, d = q.shape[1:]
    cap = check_softcap(softcap)
    p = Problem(batch, rows_q, rows_k, h, k.shape[1], d, dtype, scale, left, right, cap,
                bool(sinks), bool(alibi))  # fmt: skip
    return q, k, v, cu_q, cu_k, p


#: A packed batch's grid and cut take its max lengths rounded up to a step of 1/8 to 1/16 of
#: their size (PACKED_STEPS steps a power of two, exact below it), so that a training loop
#: whose max lengths change every step runs a few configurations and replay plans, not one
#: per value (numflash.plans). Steps are powers of two: where a step is no larger than the
#: row tile (up to 8 tiles of rows) the grid has exactly the row blocks the value gives, past
#: that at most an eighth more, which find no row and return.
PACKED_STEPS = 16


def packed_bound(max_seqlen):
    """The rows of a packed sequence the kernels cover: ``max_seqlen`` (an int) rounded up to
    a multiple of the power of two 1/8 to 1/16 of it (itself below PACKED_STEPS), within
    int32."""
    n = int(max_seqlen)
    step = 1 << max(0, n.bit_length() - PACKED_STEPS.bit_length() + 1)
    return min(-(-n // step) * step, MAX_INT32)


def _config_problems(config, p, device):
    head_dim = config.kernel_head_dim(p.head_dim)
    reasons = config.problems(head_dim, device)
    if reasons:
        raise ValueError(f"config {config} cannot run here: " + "; ".join(reasons))
    return config


def _names(types):
    return ", ".join(f"numflash.{t.__name__}" for t in types)


#: How messages name the kernels of each HARDWARE (config.py) but the portable ones, and the
#: kernels of each ROLE.
_HARDWARE_NAMES = {"mma.sync": "tensor-core", "wgmma": "wgmma"}
_ROLE_NAMES = {"forward": "kernel", "backward": "backward", "decode": "KV-cache kernel"}


def _check_family(config, role, p):
    """A forced configuration is of a family of ``role``, and one that takes ``p``'s dtype."""
    types = families(role)
    if not isinstance(config, types):
        raise TypeError(
            f"config must be one of {_names(types)} or None; got {type(config).__name__}"
        )
    if config.HARDWARE != "portable" and p.dtype == "float32":
        raise TypeError(
            f"config: the {_HARDWARE_NAMES[config.HARDWARE]} {_ROLE_NAMES[role]} takes float16 "
            "or bfloat16, not float32"
        )
    if p.mods is not None and not config.USER_MODS:
        takes = _names(t for t in types if t.USER_MODS)
        raise ValueError(
            f"config: {type(config).__name__} does not take a score_mod or mask_mod yet; "
            f"{takes} do (or leave config=None)"
        )


def check_forward_config(config, p, device):
    """A forced forward configuration, checked against the problem and the device."""
    if config is None:
        return None
    _check_family(config, "forward", p)
    return _config_problems(config, p, device)


def check_varlen_config(config, p, device):
    """A forced configuration of a packed-batch forward: any forward family's."""
    return check_forward_config(config, p, device)


def check_backward_config(config, p, deterministic, device):
    """A forced backward configuration, checked against the problem, the flag and the device."""
    if config is None:
        return None
    _check_family(config, "backward", p)
    if deterministic and not getattr(config, "dq_separate", True):
        raise ValueError(
            f"config: {config.family} with dq_separate=False adds dQ up in no fixed order "
            "(atomics or bulk reductions); deterministic=True needs dq_separate=True (or the "
            "portable backward)"
        )
    return _config_problems(config, p, device)


def check_decode_config(config, p, device):
    """A forced KV-cache configuration, checked against the problem and the device: a decode
    family's, or a forward family's that reads KV caches (the Hopper forward: chunked prefill;
    it reads the caches in place, so it takes no head_dim it would pad)."""
    if config is None:
        return None
    takes = families("decode") + tuple(c for c in families("forward") if c.READS_KV_CACHE)
    if not isinstance(config, takes):
        raise TypeError(
            f"config must be one of {_names(takes)} or None; got {type(config).__name__}"
        )
    if config.ROLE == "forward":
        _check_family(config, "forward", p)
        if p.head_dim % 8:
            raise ValueError(
                "config: the Hopper forward reads a KV cache in place and takes head_dim a "
                f"multiple of 8; got head_dim={p.head_dim}"
            )
        if p.num_splits > 1:
            raise ValueError(
                f"config: the Hopper forward does not split the keys; got num_splits={p.num_splits}"
            )
        reasons = config.paged_cache_problems(p.head_dim, device) if p.paged else []
        if reasons:
            raise ValueError(f"config {config} cannot run over a paged cache here: {reasons[0]}")
    else:
        _check_family(config, "decode", p)
    if config.HARDWARE != "portable":
        if not p.cache_aligned:
            raise ValueError(
                "config: the tensor-core KV-cache kernel reads the caches in place in 16-byte "
                "chunks; k_cache and v_cache need 16-byte aligned rows (strides multiples of 8)"
            )
    return _config_problems(config, p, device)


# -- attention over a KV cache ----------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class KVCacheProblem:
    """A KV-cache call, normalised. ``capacity``: keys a sequence can hold (seqlen_cache, or
    max_blocks * page_size); ``slots``: cache rows (batch_cache) or pages (num_blocks);
    ``page_size`` 0 for a contiguous cache; ``cache_seqlens``: the Python int when one was
    given, else None (the lengths are on the device)."""

    batch: int
    seqlen_q: int
    seqlen_new: int
    nheads: int
    nheads_k: int
    head_dim: int
    dtype: str
    scale: float
    window_left: int
    window_right: int
    capacity: int
    slots: int
    page_size: int
    max_blocks: int
    cache_seqlens: object
    num_splits: int
    #: Both caches' rows start on 16-byte boundaries (what the tensor-core kernel's cp.async
    #: reads in place; the cache cannot be copied, it is written).
    cache_aligned: bool = False
    #: The softcap of the scores (0: none), as Problem's.
    softcap: float = 0.0
    #: Sink logits, as Problem's.
    sinks: bool = False
    #: ALiBi slopes, as Problem's.
    alibi: bool = False
    #: A user's score_mod and mask_mod, which KV-cache calls do not take yet: None.
    mods: object = None

    @property
    def heads_per_kv(self):
        return self.nheads // self.nheads_k

    @property
    def paged(self):
        return self.page_size > 0

    @property
    def seqlen_k(self):
        """The most keys a sequence can see (what the configuration lookup buckets by)."""
        return self.capacity


def _check_index_array(x, name, shape, like):
    """An int32 array of ``shape`` on ``like``'s device."""
    x = arrays.intake(x, name)
    if x.dtype != np.int32:
        raise TypeError(f"{name} must have dtype int32; got {x.dtype}")
    if x.shape != shape:
        raise ValueError(f"{name} must have shape {shape}; got {shape_str(x)}")
    check_device(x, name, like, "q")
    return x


def _check_int(value, name, low=None):
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int; got {value!r}")
    if low is not None and value < low:
        raise ValueError(f"{name} must be >= {low}; got {value}")
    return int(value)


def kvcache_problem(q, k_cache, v_cache, k, v, cache_seqlens, cache_batch_idx, block_table,
                    causal, softmax_scale, window_size, num_splits, softcap=0.0,
                    sinks=False, alibi=False):  # fmt: skip
    """Validated arrays (q, k_cache, v_cache, k, v, cache_seqlens as an array or None,
    cache_batch_idx, block_table) and the :class:`KVCacheProblem` they pose. Checks everything
    that can be known without reading device memory; nothing is written."""
    q = arrays.intake(q, "q")
    k_cache = arrays.intake(k_cache, "k_cache")
    v_cache = arrays.intake(v_cache, "v_cache")
    for name, x in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        if x.ndim != 4:
            raise ValueError(f"{name} must have 4 dimensions; got shape {shape_str(x)}")
    b, sq, h, d = q.shape
    dtype = arrays.dtype_name(q.dtype)
    if dtype is None:
        raise TypeError(f"q has dtype {q.dtype}; accepted: float16, bfloat16, float32")
    for name, x in (("k_cache", k_cache), ("v_cache", v_cache)):
        if x.dtype != q.dtype:
            raise TypeError(f"{name} must have q's dtype {q.dtype}; got {x.dtype}")
        check_device(x, name, q, "q")
    if k_cache.shape != v_cache.shape:
        raise ValueError(
            f"k_cache and v_cache must have one shape; got {shape_str(k_cache)} and "
            f"{shape_str(v_cache)}"
        )
    slots, rows, h_k, d_k = k_cache.shape
    if d_k != d or not 1 <= d <= MAX_HEAD_DIM:
        raise ValueError(f"head_dim must match and be in [1, {MAX_HEAD_DIM}]: q {d}, k_cache {d_k}")
    if h_k == 0 or h % h_k:
        raise ValueError(f"nheads of q ({h}) must be a multiple of k_cache's nheads ({h_k})")
    if sq < 1:
        raise ValueError(f"q must hold at least one query row; got seqlen_q {sq}")
    if h > MAX_GRID_YZ or b > MAX_GRID_YZ:
        raise ValueError(f"nheads and batch must be at most {MAX_GRID_YZ}; got {h} and {b}")
    # -- paged or contiguous
    if block_table is not None:
        if cache_batch_idx is not None:
            raise ValueError(
                "cache_batch_idx applies to contiguous caches; a paged cache maps "
                "sequences to pages through block_table"
            )
        block_table = arrays.intake(block_table, "block_table")
        if block_table.ndim != 2 or block_table.shape[0] != b or block_table.shape[1] < 1:
            raise ValueError(
                f"block_table must have shape (batch, max_blocks) = ({b}, >= 1); got "
                f"{shape_str(block_table)}"
            )
        block_table = _check_index_array(block_table, "block_table", block_table.shape, q)
        page_size, max_blocks = rows, block_table.shape[1]
        if page_size < 1:
            raise ValueError("the paged cache's page_size (k_cache.shape[1]) must be >= 1")
        capacity = page_size * max_blocks
    else:
        page_size, max_blocks, capacity = 0, 0, rows
        if cache_batch_idx is not None:
            cache_batch_idx = _check_index_array(cache_batch_idx, "cache_batch_idx", (b,), q)
        elif slots < b:
            raise ValueError(
                f"k_cache holds {slots} sequences but q has batch {b}; pass cache_batch_idx to "
                "map batch rows to cache rows"
            )
    # -- new keys and values
    if (k is None) != (v is None):
        raise ValueError("k and v must be given together (or neither)")
    seqlen_new = 0
    if k is not None:
        k = arrays.intake(k, "k")
        v = arrays.intake(v, "v")
        for name, x in (("k", k), ("v", v)):
            if x.ndim != 4 or x.shape[0] != b or x.shape[2:] != (h_k, d):
                raise ValueError(
                    f"{name} must have shape (batch, seqlen_new, nheads_k, head_dim) = ({b}, "
                    f"seqlen_new, {h_k}, {d}); got {shape_str(x)}"
                )
            if x.dtype != q.dtype:
                raise TypeError(f"{name} must have q's dtype {q.dtype}; got {x.dtype}")
            check_device(x, name, q, "q")
        if k.shape[1] != v.shape[1]:
            raise ValueError(f"k and v must have one seqlen_new; got {k.shape[1]}, {v.shape[1]}")
        seqlen_new = k.shape[1]
        check_writable(k_cache, "k_cache")
        check_writable(v_cache, "v_cache")
        if k_cache.size and arrays.same_elements(k_cache, v_cache):
            raise ValueError(
                "k_cache and v_cache are the same memory: the append would write k and v over "
                "each other; pass two caches (or two interleaved views of one buffer)"
            )
        # k_cache and v_cache may be interleaved views of one buffer (their elements differ),
        # except in the simulator, which copies each argument and writes it back whole
        if SIMULATOR and arrays.may_share_memory(k_cache, v_cache):
            raise ValueError(
                "k_cache and v_cache share one buffer; the CUDA simulator writes each kernel "
                "argument back whole, so it cannot append into both: pass separate arrays"
            )
        check_no_overlap(k_cache, "k_cache", {"k": k, "v": v, "q": q})
        check_no_overlap(v_cache, "v_cache", {"k": k, "v": v, "q": q})
    # -- lengths
    host_seqlens = None
    if isinstance(cache_seqlens, numbers.Integral) and not isinstance(cache_seqlens, bool):
        host_seqlens = int(cache_seqlens)
        if host_seqlens < 0 or host_seqlens + seqlen_new > capacity:
            raise ValueError(
                f"cache_seqlens + seqlen_new must be in [0, {capacity}] (the cache's capacity "
                f"per sequence); got {host_seqlens} + {seqlen_new}"
            )
        cache_seqlens = None
    elif cache_seqlens is None:
        raise TypeError("cache_seqlens is required: an int or an int32 array (batch,)")
    elif isinstance(cache_seqlens, (bool, numbers.Number, str, list, tuple)):
        raise TypeError(
            f"cache_seqlens must be an int or an int32 array (batch,); got {cache_seqlens!r}"
        )
    else:
        cache_seqlens = _check_index_array(cache_seqlens, "cache_seqlens", (b,), q)
    if k is not None:  # the append writes the caches while blocks read the index arrays
        indices = dict(
            cache_seqlens=cache_seqlens, cache_batch_idx=cache_batch_idx, block_table=block_table
        )
        check_no_overlap(k_cache, "k_cache", indices)
        check_no_overlap(v_cache, "v_cache", indices)
    num_splits = _check_int(num_splits, "num_splits", low=0)
    causal = check_flag(causal, "causal")
    left, right = check_window(window_size, causal)
    scale = check_scale(softmax_scale, d)
    left, right = (_clamp_window(w, sq, capacity) for w in (left, right))
    problem = KVCacheProblem(
        b,
        sq,
        seqlen_new,
        h,
        h_k,
        d,
        dtype,
        scale,
        left,
        right,
        capacity,
        slots,
        page_size,
        max_blocks,
        host_seqlens,
        num_splits,
        all(arrays.readable_in_place(x, alignment_elements=8) for x in (k_cache, v_cache)),
        check_softcap(softcap),
        bool(sinks),
        bool(alibi),
    )
    return q, k_cache, v_cache, k, v, cache_seqlens, cache_batch_idx, block_table, problem
