"""A user's score_mod and mask_mod (issue 32): Numba device functions compiled into the
kernels through ``attention(..., score_mod=, mask_mod=, mod_args=)`` and
``attention_backward(..., score_mod_derivative=)``, against numflash.reference's float64
reference with the same functions (their Python functions run there); the built-in variants
beside them; rows a mask_mod leaves empty; bad functions and mod_args refused by name. Calls
with them run the families that take them (config.USER_MODS): the portable kernels, the
Hopper forward and the tensor-core backwards."""

import logging
import math

import numpy as np
import pytest
import test_kvcache
from numba import cuda
from support import (
    assert_gradients_match,
    assert_matches_reference,
    packed_qkv,
    poisoned_like,
    random_array,
    random_qkv,
    to_numpy,
    wgmma_or_skip,
    xp,
)

import numflash
from numflash import launch
from numflash.kernels import forward_portable
from numflash.kernels.jit import SIMULATOR
from numflash.reference import Variants


@cuda.jit(device=True)
def relative_bias(score, b, h, q_idx, kv_idx, slopes, document):
    """A score_mod: a per-head linear bias in the distance (ALiBi's sign-free cousin)."""
    return score + slopes[h] * (q_idx - kv_idx)


@cuda.jit(device=True)
def relative_bias_derivative(score, b, h, q_idx, kv_idx, slopes, document):
    return 1.0


@cuda.jit(device=True)
def same_document(b, h, q_idx, kv_idx, slopes, document):
    """A mask_mod: a query sees the keys of its own document (a packed sequence)."""
    return document[q_idx] == document[kv_idx]


@cuda.jit(device=True)
def squashed(score, b, h, q_idx, kv_idx):
    """A nonlinear score_mod, so that its derivative matters in the gradients."""
    return 0.5 * score + math.tanh(score) + 0.01 * b - 0.02 * h


@cuda.jit(device=True)
def squashed_derivative(score, b, h, q_idx, kv_idx):
    t = math.tanh(score)
    return 0.5 + (1.0 - t * t)


@cuda.jit(device=True)
def even_keys_of_odd_heads(b, h, q_idx, kv_idx):
    """A mask_mod that leaves the first rows of some heads without keys (under causal)."""
    return h % 2 == 0 or kv_idx % 2 == 1


def _documents(seqlen, lengths):
    """int32 document ids of ``seqlen`` keys, documents of ``lengths`` in turn."""
    ids = np.repeat(np.arange(len(lengths)), lengths)[:seqlen]
    return xp.asarray(np.pad(ids, (0, seqlen - len(ids)), mode="edge").astype(np.int32))


def _run(q, k, v, dtype, mask, mods, variants, forward_extra=None, derivative=None,
         backward_config=None):  # fmt: skip
    """Forward and backward (``backward_config``: forced) with ``mods`` (score_mod, mask_mod,
    mod_args), each against the reference with ``variants``."""
    extra = forward_extra or {}
    score_mod, mask_mod, mod_args = mods
    out = poisoned_like(q)
    res, lse = numflash.attention(q, k, v, out=out, return_lse=True, score_mod=score_mod,
                                  mask_mod=mask_mod, mod_args=mod_args, **mask, **extra)  # fmt: skip
    assert res is out
    assert_matches_reference(q, k, v, out, lse, variants=variants, **mask)
    dout = random_array(q.shape, dtype)
    extra = {k: v for k, v in extra.items() if k != "sinks"}
    grads = numflash.attention_backward(
        dout, q, k, v, out, lse, score_mod=score_mod, mask_mod=mask_mod, mod_args=mod_args,
        score_mod_derivative=derivative, config=backward_config, **mask, **extra,
    )  # fmt: skip
    assert_gradients_match(dout, q, k, v, *grads, variants=variants, **mask)
    return out, lse


def _document_mask_and_relative_bias(dtype, head_dim, backward_config=None):
    """Causal GQA over three documents of a sequence; queries fewer than keys (the last rows
    of the sequence, as a chunk of prefill)."""
    sq, sk = 19, 30
    q, k, v = random_qkv(2, sq, sk, 2, 1, head_dim, dtype)
    slopes = xp.asarray(np.array([0.05, -0.2], dtype=np.float32))
    document = _documents(sk, (12, 11, 7))
    mod_args = (slopes, document)
    variants = Variants(score_mod=relative_bias, score_mod_derivative=relative_bias_derivative,
                        mask_mod=same_document, mod_args=mod_args)  # fmt: skip
    _run(q, k, v, dtype, dict(causal=True), (relative_bias, same_document, mod_args), variants,
         derivative=relative_bias_derivative, backward_config=backward_config)  # fmt: skip


def _nonlinear_score_mod_after_the_built_ins(head_dim, sinks=True, backward_config=None):
    """softcap and ALiBi change the score first, then the score_mod; the gradients go through
    the score_mod's derivative and the softcap's; sinks join the forward's sums."""
    q, k, v = random_qkv(1, 45, 45, 2, 1, head_dim, "float16")
    alibi = xp.asarray(np.array([0.3, 0.05], dtype=np.float32))
    extra = dict(softcap=4.0, alibi_slopes=alibi)
    if sinks:
        extra["sinks"] = xp.asarray(np.array([0.5, -1.0], dtype=np.float32))
    variants = Variants(score_mod=squashed, score_mod_derivative=squashed_derivative, **extra)
    _run(q, k, v, "float16", dict(window_size=(20, 5)), (squashed, None, ()), variants, extra,
         derivative=squashed_derivative, backward_config=backward_config)  # fmt: skip


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_a_document_mask_and_a_relative_bias_match_the_reference(dtype):
    _document_mask_and_relative_bias(dtype, 24)


def test_a_nonlinear_score_mod_after_the_built_in_variants():
    _nonlinear_score_mod_after_the_built_ins(32)


def test_rows_a_mask_mod_leaves_without_keys_give_zero_and_minus_infinity():
    q, k, v = random_qkv(1, 30, 30, 2, 2, 16, "float16")
    variants = Variants(mask_mod=even_keys_of_odd_heads)
    out, lse = _run(q, k, v, "float16", dict(causal=True), (None, even_keys_of_odd_heads, ()),
                    variants)  # fmt: skip
    lse = to_numpy(lse)
    assert np.isneginf(lse[0, 1, 0]) and np.isfinite(lse[0, 0, 0])  # head 1, row 0: key 0 only
    assert (to_numpy(out)[0, 0, 1].astype(np.float64) == 0).all()


def test_new_mod_args_each_call_with_one_compiled_kernel(caplog):
    """The kernel is compiled once per function (the log says so once); each call reads its
    own mod_args (no plan replays an earlier call's)."""

    @cuda.jit(device=True)
    def bias_once(score, b, h, q_idx, kv_idx, slopes, document):  # this test's own function
        return score + slopes[h] * (q_idx - kv_idx)

    q, k, v = random_qkv(1, 24, 24, 4, 4, 16, "float16")
    builds = forward_portable.build.cache_info().misses
    with caplog.at_level(logging.INFO, logger="numflash"):
        for seed in range(3):
            slopes = random_array((4,), "float32", np.random.default_rng(seed))
            document = _documents(24, (7 + seed, 17 - seed))
            mod_args = (slopes, document)
            out, lse = numflash.attention(q, k, v, return_lse=True, score_mod=bias_once,
                                          mask_mod=same_document, mod_args=mod_args)  # fmt: skip
            variants = Variants(score_mod=bias_once, mask_mod=same_document, mod_args=mod_args)
            assert_matches_reference(q, k, v, out, lse, variants=variants)
    compiled = [r.getMessage() for r in caplog.records if r.getMessage().startswith("compiling")]
    assert len(compiled) == 1, compiled  # the family's kernel: portable, or Hopper's on a GPU
    assert compiled[0].endswith(" for float16, score_mod=bias_once, mask_mod=same_document")
    if SIMULATOR:
        assert forward_portable.build.cache_info().misses - builds == 1


def test_calls_without_user_functions_compile_what_they_compiled_before():
    """A plain call's kernel key holds no Mods (its PTX is fingerprinted unchanged:
    tests/test_fingerprints.py)."""
    q, k, v = random_qkv(1, 8, 8, 1, 1, 16, "float16")
    p = numflash.validation.problem(q, k, v, False, None, (-1, -1))[-1]
    assert p.mods is None and launch.variant_key(p) == () and launch.variant_arrays(p) == ()


def _plain_device(b, h, q_idx, kv_idx):
    return True


def _ints(*shape, dtype=np.int32):
    return xp.asarray(np.zeros(shape, dtype))


#: (what a call adds, the error, its message) of the refused calls.
BAD = [
    (lambda: dict(mask_mod=_plain_device), TypeError, "mask_mod must be a Numba CUDA device"),
    (lambda: dict(score_mod=lambda s, b, h, i, j: s), TypeError, "score_mod must be a Numba"),
    (lambda: dict(mod_args=(_ints(3),)), ValueError, "neither was given"),
    (lambda: dict(mask_mod=even_keys_of_odd_heads, mod_args=[_ints(2, 3)]), ValueError,
     r"mod_args\[0\] must be a non-empty 1-D"),
    (lambda: dict(mask_mod=even_keys_of_odd_heads, mod_args=(_ints(3, dtype=np.float64),)),
     TypeError, r"mod_args\[0\] must have dtype int32, int64 or float32"),
    (lambda: dict(mask_mod=even_keys_of_odd_heads, mod_args=_ints(3)), TypeError,
     "mod_args must be a tuple"),
]  # fmt: skip


@pytest.mark.parametrize("kwargs, error, match", BAD, ids=[b[2][:30] for b in BAD])
def test_bad_functions_and_mod_args_are_refused_by_name(kwargs, error, match):
    q, k, v = random_qkv(1, 8, 8, 2, 2, 16, "float16")
    with pytest.raises(error, match=match):
        numflash.attention(q, k, v, **kwargs())


def test_the_backward_of_a_score_mod_needs_its_derivative():
    q, k, v = random_qkv(1, 8, 8, 1, 1, 16, "float16")
    out, lse = numflash.attention(q, k, v, return_lse=True, score_mod=squashed)
    with pytest.raises(ValueError, match="score_mod_derivative"):
        numflash.attention_backward(q, q, k, v, out, lse, score_mod=squashed)
    with pytest.raises(ValueError, match="without a score_mod"):
        numflash.attention_backward(q, q, k, v, out, lse, score_mod_derivative=squashed)


def test_calls_with_user_functions_look_plans_up_by_keys_that_hold_them(monkeypatch):
    """A call with user functions looks its plan up under its own signature, whose key holds
    the functions (and the block mask) and each of the mod_args, never under the plain one:
    a replay must not run another call's kernel or arrays (tests/test_replay_wiring.py
    replays them on stand-ins)."""
    from numflash import api

    looked_up = []

    def note(sig, args, name):
        looked_up.append((sig, args))
        return None, None, args

    monkeypatch.setattr(api, "_repeated", note)
    q, k, v = random_qkv(1, 8, 8, 1, 1, 16, "float16")
    cu = xp.asarray(np.array([0, 3, 8], dtype=np.int32))
    out, lse = numflash.attention(q, k, v, return_lse=True, mask_mod=even_keys_of_odd_heads)
    numflash.attention_backward(q, q, k, v, out, lse, mask_mod=even_keys_of_odd_heads)
    packed = (q[0], k[0], v[0], cu, cu, 5, 5)
    slopes, documents = xp.zeros((1,), np.float32), _documents(8, (3, 5))
    numflash.attention_varlen(*packed, mask_mod=same_document, mod_args=(slopes, documents))
    numflash.attention_with_kvcache(q[:, :1], k, v, cache_seqlens=8, score_mod=squashed)
    functions = [even_keys_of_odd_heads, even_keys_of_odd_heads, same_document, None]
    arrays = [(), (), (slopes, documents), ()]
    assert len(looked_up) == 4
    for (sig, args), function, mod_args in zip(looked_up, functions, arrays):
        assert " with mods and " in sig.name, sig.name
        values = dict(zip((name for name, _ in sig.parameters), args))
        assert values["mask_mod"] is function
        assert values["score_mod"] is (squashed if function is None else None)
        given = [values[n] for n, _ in sig.parameters if n.startswith("mod_arg")]
        assert len(given) == len(mod_args) and all(a is b for a, b in zip(given, mod_args))


def test_calls_with_user_functions_are_refused_under_capture_until_they_have_a_plan(
    monkeypatch,
):
    """Under stream capture a call with user functions and no plan yet (always, in the
    simulator) is refused as any such call is, with the first call's message; one with a
    block mask and mod_args given too never gets a plan, and says so."""
    from numflash import api

    monkeypatch.setattr(api, "_capturing", lambda: True)
    q, k, v = random_qkv(1, 8, 8, 1, 1, 16, "float16")
    cu = xp.asarray(np.array([0, 3, 8], dtype=np.int32))
    packed = (q[0], k[0], v[0], cu, cu, 5, 5)
    calls = [
        lambda: numflash.attention(q, k, v, mask_mod=even_keys_of_odd_heads),
        lambda: numflash.attention_varlen(*packed, mod_args=(cu,)),
        lambda: numflash.attention_backward(
            q, q, k, v, q, q[..., 0], score_mod_derivative=squashed_derivative
        ),
        lambda: numflash.attention_with_kvcache(
            q[:, :1], k, v, cache_seqlens=8, score_mod=squashed
        ),
        lambda: numflash.attention(q, k, v),
    ]
    for call in calls:
        with pytest.raises(RuntimeError, match="the first time it runs"):
            call()
    mask = numflash.block_mask(even_keys_of_odd_heads, 1, 1, 8, 8)
    with pytest.raises(RuntimeError, match=r"block_mask and mod_args cannot be captured.*yet"):
        numflash.attention(q, k, v, block_mask=mask, mod_args=(cu,))


def _forward_with_variants_and_user_functions(config, head_dim, dtype):
    """A relative bias and a document mask after a softcap and ALiBi, GQA, causal, fewer
    queries than keys, the last key tile past the end, through ``config``'s forward."""
    q, k, v = random_qkv(1, 40, 80, 2, 1, head_dim, dtype)
    slopes = xp.asarray(np.array([0.05, -0.2], dtype=np.float32))
    alibi = xp.asarray(np.array([0.1, 0.3], dtype=np.float32))
    mod_args = (slopes, _documents(80, (30, 31, 19)))
    out = poisoned_like(q)
    res, lse = numflash.attention(
        q, k, v, causal=True, out=out, return_lse=True, config=config, softcap=5.0,
        alibi_slopes=alibi, score_mod=relative_bias, mask_mod=same_document, mod_args=mod_args,
    )  # fmt: skip
    assert res is out
    variants = Variants(softcap=5.0, alibi_slopes=alibi, score_mod=relative_bias,
                        mask_mod=same_document, mod_args=mod_args)  # fmt: skip
    assert_matches_reference(q, k, v, out, lse, causal=True, variants=variants)


#: The Hopper forward's schedules with a user's functions: one in the simulator (a score's
#: user functions are Python calls there, minutes a case), both on a GPU.
HOPPER = [numflash.WgmmaForwardConfig(1, 64, 2, pingpong=False)]
if not SIMULATOR:
    HOPPER.append(numflash.WgmmaForwardConfig(2, 64, 2, producer=False, pingpong=False, tma=False))


@pytest.mark.parametrize("config", HOPPER, ids=["producer-tma", "no-producer"][: len(HOPPER)])
def test_the_hopper_forward_takes_user_functions_after_the_built_in_variants(config):
    """The wgmma forward's tiles (forward_sm90.mod_scores): a relative bias and a document
    mask after a softcap and ALiBi (whose linear shortcut steps aside for them), GQA, causal,
    fewer queries than keys, a last key tile past the end (on a GPU, the schedule without a
    producer too)."""
    from numflash.device import current_device

    if not current_device().has_wgmma:
        pytest.skip("the Hopper forward needs compute capability 9.x")
    _forward_with_variants_and_user_functions(config, 64, "bfloat16")


@pytest.mark.parametrize(
    "config",
    [numflash.TensorCoreConfig(16, 32, 1, 2), numflash.TensorCoreConfig(32, 16, 1, 3, False)],
    ids=["one-row-tile", "two-row-tiles"],
)
def test_the_mma_forward_takes_user_functions_after_the_built_in_variants(config):
    """The mma.sync forward's tiles (forward.mod_scores): as the Hopper's test, with one and
    two 16-row tiles a warp (each row its own call), several key tiles, the last past the
    end."""
    _forward_with_variants_and_user_functions(config, 24, "float16")


def test_the_mma_forward_takes_a_mask_alone_with_sinks():
    """mask_mod alone (the raw scores kept, no unit change), sinks in the row sums, rows it
    leaves without keys: output 0, lse the sink."""
    q, k, v = random_qkv(1, 30, 30, 2, 2, 16, "bfloat16")
    sinks = xp.asarray(np.array([0.5, -1.0], dtype=np.float32))
    out = poisoned_like(q)
    res, lse = numflash.attention(q, k, v, causal=True, out=out, return_lse=True, sinks=sinks,
                                  config=numflash.TensorCoreConfig(16, 16, 1, 2),
                                  mask_mod=even_keys_of_odd_heads)  # fmt: skip
    assert res is out
    variants = Variants(sinks=sinks, mask_mod=even_keys_of_odd_heads)
    assert_matches_reference(q, k, v, out, lse, causal=True, variants=variants)


@pytest.mark.skipif(SIMULATOR, reason="minutes a case in the simulator")
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("which", ["score_mod", "mask_mod"])
def test_the_hopper_forward_runs_user_functions_alone_on_whole_tiles(which, causal):
    """Tiles whose rows and keys all exist (mod_scores without a check per score) and tiles no
    built-in mask cuts (the softmax that allows a row without keys so far), each function
    alone, at the default configuration, head_dim 128."""
    from numflash.device import current_device

    if not current_device().has_wgmma:
        pytest.skip("the Hopper forward needs compute capability 9.x")
    q, k, v = random_qkv(2, 300, 520, 4, 2, 128, "float16")
    slopes = xp.asarray(np.array([0.05, -0.2, 0.01, 0.3], dtype=np.float32))
    mod_args = (slopes, _documents(520, (100, 3, 250, 167)))
    functions = {which: relative_bias if which == "score_mod" else same_document}
    out = poisoned_like(q)
    res, lse = numflash.attention(q, k, v, causal=causal, out=out, return_lse=True,
                                  mod_args=mod_args, **functions)  # fmt: skip
    assert res is out
    variants = Variants(mod_args=mod_args, **functions)
    assert_matches_reference(q, k, v, out, lse, causal=causal, variants=variants)


TC = numflash.TensorCoreBackwardConfig
WG = numflash.WgmmaBackwardConfig
#: The tensor-core backwards (backward.user_element_function in their shared skeleton): mma.sync
#: with dQ from its own kernel and by atomics, the Hopper kernels alike (head_dim 64 or 128).
TENSOR_CORE_BACKWARDS = [
    (TC(16, 2, 2, True), 24),
    (TC(16, 1, 2, False), 24),
    (WG(num_warps=4, stages=2), 64),
    (WG(num_warps=8, stages=2, dq_separate=False), 64),
]


@pytest.mark.parametrize(
    "config, head_dim", TENSOR_CORE_BACKWARDS, ids=["mma", "mma-atomic", "wgmma", "wgmma-fused"]
)
def test_the_tensor_core_backwards_take_a_document_mask_and_a_relative_bias(config, head_dim):
    """As the first test, through each tensor-core backward: the user's functions called
    only for pairs the causal mask lets through (the document ids end at the last key)."""
    _document_mask_and_relative_bias("bfloat16", head_dim, wgmma_or_skip(config))


@pytest.mark.parametrize("config, head_dim", TENSOR_CORE_BACKWARDS[::3], ids=["mma", "wgmma-fused"])
def test_the_tensor_core_backwards_take_a_nonlinear_score_mod_after_the_built_ins(config, head_dim):
    """As the second test (softcap and ALiBi first, the score_mod's derivative and the cap's
    in the gradients, a window), through a tensor-core backward."""
    _nonlinear_score_mod_after_the_built_ins(head_dim, False, wgmma_or_skip(config))


def test_calls_with_user_functions_run_the_families_that_take_them():
    """Every forward and backward family takes them: on an H200 the Hopper forward and
    backward, on an A100 the mma.sync ones, as for a plain call."""
    from numflash import selection
    from numflash.device import DeviceInfo

    h200 = DeviceInfo("NVIDIA H200", (9, 0), 132, 232448, 1024)
    a100 = DeviceInfo("NVIDIA A100", (8, 0), 108, 166912, 1024)
    q, k, v = random_qkv(1, 8, 8, 1, 1, 128, "float16")
    p = numflash.validation.problem(q, k, v, False, None, (-1, -1))[-1]
    user = numflash.validation.check_mods(None, even_keys_of_odd_heads, (), q)[0]
    p_mods = numflash.validation.Problem(**{**p.__dict__, "mods": user})
    assert selection.forward_family(p, h200) == "wgmma-forward"
    assert selection.forward_family(p_mods, h200) == "wgmma-forward"
    assert selection.forward_family(p, a100) == "tensor-core"
    assert selection.forward_family(p_mods, a100) == "tensor-core"
    assert selection.backward(p_mods, h200, False).config.family == "wgmma-backward"
    assert selection.backward(p_mods, a100, False).config.family == "tensor-core-backward"


# -- packed batches: b is the sequence, q_idx and kv_idx positions within it --------------------


@cuda.jit(device=True)
def sequence_bias(score, b, h, q_idx, kv_idx, per_sequence):
    """A nonlinear score_mod that depends on the sequence (b) and on the positions."""
    return 0.5 * score + math.tanh(score) + per_sequence[b] * (float(q_idx) - float(kv_idx))


@cuda.jit(device=True)
def sequence_bias_derivative(score, b, h, q_idx, kv_idx, per_sequence):
    t = math.tanh(score)
    return 0.5 + (1.0 - t * t)


@cuda.jit(device=True)
def thinned_by_sequence(b, h, q_idx, kv_idx, per_sequence):
    """A mask_mod that hides every third key, shifted by the sequence, for head 1 only."""
    return h == 0 or (kv_idx + b) % 3 != 0


def _at_sequence(fn, s, scored):
    """``fn``'s Python function with b shifted by ``s``: the reference runs one sequence of a
    packed batch as a batch of one."""
    py = fn.py_func
    if scored:
        return lambda score, b, *rest: py(score, b + s, *rest)
    return lambda b, *rest: py(b + s, *rest)


def _sequence_variants(s, per_sequence):
    return Variants(score_mod=_at_sequence(sequence_bias, s, True),
                    score_mod_derivative=_at_sequence(sequence_bias_derivative, s, True),
                    mask_mod=_at_sequence(thinned_by_sequence, s, False),
                    mod_args=(per_sequence,))  # fmt: skip


#: (forward config, backward config, head_dim) of the packed-batch cases: numflash's choice
#: (the portable kernels in the simulator), the mma.sync kernels, and on a GPU the Hopper
#: backward (its packed kernels and its user functions each have simulator cases of their own:
#: CI's time).
PACKED = [
    (None, None, 16),
    (numflash.TensorCoreConfig(16, 16, 1, 2), TC(16, 1, 2, False), 16),
]
if not SIMULATOR:
    PACKED.append((None, WG(num_warps=4, stages=2), 64))


@pytest.mark.parametrize(
    "forward, backward, head_dim", PACKED, ids=["chosen", "mma", "wgmma"][: len(PACKED)]
)
def test_a_packed_batch_calls_the_user_functions_per_sequence(forward, backward, head_dim):
    """attention_varlen and its backward with a score_mod and a mask_mod that read b (the
    sequence) and positions within it, causal, GQA, an empty sequence and one without keys,
    against the reference run sequence by sequence."""
    backward = wgmma_or_skip(backward)
    lengths_q, lengths_k = (7, 0, 19, 4), (12, 5, 23, 0)
    rng = np.random.default_rng(32)
    q, k, v, cu_q, cu_k = packed_qkv(lengths_q, lengths_k, 2, 1, head_dim, "bfloat16", rng)
    oq, ok = to_numpy(cu_q), to_numpy(cu_k)
    per_sequence = xp.asarray(np.array([0.05, -0.3, 0.1, 0.2], dtype=np.float32))
    functions = dict(score_mod=sequence_bias, mask_mod=thinned_by_sequence,
                     mod_args=(per_sequence,))  # fmt: skip
    packed = (cu_q, cu_k, max(lengths_q), max(lengths_k))
    out = poisoned_like(q)
    res, lse = numflash.attention_varlen(q, k, v, *packed, causal=True, out=out, return_lse=True,
                                         config=forward, **functions)  # fmt: skip
    assert res is out
    dout = random_array(q.shape, "bfloat16", rng)
    grads = numflash.attention_varlen_backward(
        dout, q, k, v, out, lse, *packed, causal=True, config=backward,
        score_mod_derivative=sequence_bias_derivative, **functions,
    )  # fmt: skip
    for s in range(len(lengths_q)):
        rows, keys = slice(oq[s], oq[s + 1]), slice(ok[s], ok[s + 1])
        if rows.start == rows.stop or keys.start == keys.stop:
            assert (to_numpy(out[rows]).astype(np.float32) == 0).all()
            assert (to_numpy(grads[0][rows]).astype(np.float32) == 0).all()
            continue
        variants = _sequence_variants(s, per_sequence)
        q_s, k_s, v_s = q[None, rows], k[None, keys], v[None, keys]
        assert_matches_reference(q_s, k_s, v_s, out[None, rows], lse[:, rows][None], causal=True,
                                 variants=variants)  # fmt: skip
        assert_gradients_match(dout[None, rows], q_s, k_s, v_s, grads[0][None, rows],
                               grads[1][None, keys], grads[2][None, keys], causal=True,
                               variants=variants)  # fmt: skip


def test_a_packed_batch_refuses_a_score_mod_without_its_derivative_in_the_backward():
    q = random_array((10, 1, 16), "float16")
    cu = xp.asarray(np.array([0, 4, 10], dtype=np.int32))
    out, lse = numflash.attention_varlen(q, q, q, cu, cu, 6, 6, return_lse=True,
                                         score_mod=squashed)  # fmt: skip
    with pytest.raises(ValueError, match="score_mod_derivative"):
        numflash.attention_varlen_backward(q, q, q, q, out, lse, cu, cu, 6, 6, score_mod=squashed)


# -- KV-cache calls: b is q's batch row, q_idx the query's position after the append ----------

#: Decode cases of tests/test_kvcache.py (paged, split, GQA, causal and window, two row groups
#: of the tensor-core kernel) and a chunked prefill over pages for the Hopper forward (on the
#: GPU test_kvcache's 80 rows; in the simulator 20 rows over one key tile).
KV_CASES = [test_kvcache.CASES[i] for i in (3, 5, 6)]
_SMALL_PREFILL = dict(seqlen_q=20, seqlen_new=20, nheads=2, nheads_k=1, head_dim=64, page_size=16)
KV_CASES.append(
    test_kvcache.Case("bfloat16", (10, 3), mask=dict(causal=True), **_SMALL_PREFILL)
    if SIMULATOR
    else test_kvcache.CASES[11]
)
#: The KV-cache kernels: the decode kernels for the decoding cases, the Hopper forward for the
#: prefill.
KV_KERNELS = ["default", "tensor-core", "tensor-core-deep", "hopper"]


@pytest.mark.parametrize("kernel", KV_KERNELS)
@pytest.mark.parametrize("case", KV_CASES, ids=lambda c: f"{c.seqlen_q}x{c.lengths}")
def test_a_kv_cache_call_calls_the_user_functions_per_sequence(case, kernel):
    """attention_with_kvcache with a score_mod and a mask_mod that read b and the positions
    after the append, through each KV-cache kernel, against the reference sequence by
    sequence (and the caches appended to, bitwise: test_kvcache.run_and_check)."""
    hopper = kernel == "hopper"
    if hopper != (case.seqlen_q > test_kvcache.SIMULATED_ROWS):
        pytest.skip("the decode kernels take the decoding cases, the Hopper forward the prefill")
    config = test_kvcache._config(kernel, case)
    if hopper:
        from numflash.device import current_device

        if not current_device().has_wgmma:
            pytest.skip("the Hopper forward needs compute capability 9.x")
    per_sequence = xp.asarray(np.array([0.05, -0.3], dtype=np.float32))
    functions = dict(score_mod=sequence_bias, mask_mod=thinned_by_sequence,
                     mod_args=(per_sequence,))  # fmt: skip
    test_kvcache.run_and_check(case, config, functions,
                               lambda b: _sequence_variants(b, per_sequence))  # fmt: skip


def test_a_kv_cache_call_refuses_mod_args_in_the_caches_it_writes():
    """An append writes the caches: mod_args read from them would see old or new rows by
    the order of the blocks, so they are refused by name (as the slopes and sinks are)."""
    q = random_array((1, 1, 2, 16), "float16")
    cache = random_array((1, 8, 2, 16), "float16")
    new = random_array((1, 1, 2, 16), "float16")
    table = numflash.arrays.bits(cache).reshape(-1)[:4].view(np.int32)
    v_cache = random_array((1, 8, 2, 16), "float16")
    with pytest.raises(ValueError, match=r"mod_args\[0\]"):
        numflash.attention_with_kvcache(q, cache, v_cache, new, new, cache_seqlens=3,
                                        mask_mod=thinned_by_sequence, mod_args=(table,))  # fmt: skip
