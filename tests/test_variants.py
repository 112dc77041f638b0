"""Attention variants through the public calls (issue 32), against numflash.reference's float64
reference with the same variants: the softcap, forward and backward, on each kernel family,
forced by configuration, and every variant over a KV cache (test_sinks.py and test_alibi.py
hold the sinks' and ALiBi's other tests). In the simulator each family's
kernel runs its own source on small shapes, a case a family (CI's time); on a GPU every case
on every family, at larger sizes too."""

import math

import numpy as np
import pytest
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
from numflash.kernels import forward_sm90
from numflash.kernels.jit import SIMULATOR
from numflash.reference import Variants, check

#: The forward families, forced: the portable kernel, mma.sync and the Hopper forward (a
#: consumer warpgroup of 64 rows with its producer in the simulator, the default on a GPU).
CONFIGS = {
    "portable": numflash.PortableConfig(block_m=32, block_n=16),
    "tensor-core": numflash.TensorCoreConfig(64, 32, 4, 2),
    "hopper": numflash.WgmmaForwardConfig(1, 64, 2, pingpong=False)
    if SIMULATOR
    else numflash.WgmmaForwardConfig(),
}
MASKS = {"none": {}, "causal": dict(causal=True), "window": dict(window_size=(19, 3))}

#: (dtype, batch, seqlen_q, seqlen_k, nheads, nheads_k, head_dim, mask, softcap)
CASES = [
    ("float16", 1, 40, 70, 2, 1, 64, "causal", 1.5),
    ("bfloat16", 2, 33, 33, 2, 2, 64, "window", 0.75),
    ("float16", 1, 17, 90, 4, 2, 64, "none", 30.0),
]
if not SIMULATOR:
    CASES += [
        ("bfloat16", 2, 300, 1000, 8, 2, 128, "causal", 50.0),
        ("float16", 1, 1023, 777, 4, 4, 128, "none", 2.0),
        ("bfloat16", 2, 500, 500, 4, 1, 64, "window", 5.0),
    ]


def _forced(family, dtype, head_dim):
    config = CONFIGS[family]
    if family != "portable" and dtype == "float32":
        pytest.skip("the tensor-core kernels take fp16 and bf16")
    device = numflash.device.current_device()
    problems = config.problems(head_dim, device)
    if problems:
        pytest.skip("; ".join(problems))
    return config


def _case_id(c):
    return c if isinstance(c, str) else f"{c[0]}-q{c[2]}-k{c[3]}-{c[7]}-cap{c[8]}"


def _pairs(families):
    """(family, case) pairs: every one on a GPU; in the simulator (CI's time) one case a
    family, the families' cases apart so that every case and mask runs."""
    if not SIMULATOR:
        return [(family, case) for family in families for case in CASES]
    return [(family, CASES[i % len(CASES)]) for i, family in enumerate(families)]


@pytest.mark.parametrize("sinks", [False, True])
def test_a_bfloat16_softcap_fixes_the_hopper_forwards_max_at_the_cap(sinks):
    """bfloat16 with a softcap of at most forward_sm90.BOUNDED_SOFTCAP: the Hopper forward
    takes the cap for every row's max (bounded_rows). Rows that see no key (causal, more rows
    than keys), scores capped at both ends (q scaled up), a row whose every score sits near
    -softcap (probabilities near exp(-2 softcap)), and a sink logit above the cap."""
    config = _forced("hopper", "bfloat16", 64)
    softcap = 30.0
    assert softcap <= forward_sm90.BOUNDED_SOFTCAP
    q, k, v = random_qkv(1, 50, 40, 2, 1, 64, "bfloat16")
    q = q * 8
    k_host = to_numpy(k).copy()
    q_host = to_numpy(q).copy()
    k_host[0, :, 0, :] = k_host[0, 0, 0, :]  # every key the same, and row 45 against it
    q_host[0, 45, :, :] = -k_host[0, 0, 0, :] * 8
    q, k = xp.asarray(q_host), xp.asarray(k_host)
    extra = {"sinks": xp.asarray(np.array([40.0, -3.0], dtype=np.float32))} if sinks else {}
    out = poisoned_like(q)
    res, lse = numflash.attention(
        q, k, v, out=out, return_lse=True, config=config, softcap=softcap, causal=True, **extra
    )
    assert res is out
    variants = Variants(softcap=softcap, **extra)
    assert_matches_reference(q, k, v, out, lse, causal=True, variants=variants)


@pytest.mark.parametrize("family, case", _pairs(list(CONFIGS)), ids=_case_id)
def test_softcap_matches_the_reference(family, case):
    dtype, batch, sq, sk, h, hk, d, mask, softcap = case
    config = _forced(family, dtype, d)
    q, k, v = random_qkv(batch, sq, sk, h, hk, d, dtype)
    q = q * 4  # scores of several units, so that the cap bends them
    out = poisoned_like(q)
    res, lse = numflash.attention(
        q, k, v, out=out, return_lse=True, config=config, softcap=softcap, **MASKS[mask]
    )
    assert res is out
    variants = Variants(softcap=softcap)
    assert_matches_reference(q, k, v, out, lse, variants=variants, **MASKS[mask])


#: The Hopper forward with 1 or 2 of every 4 exponentials on the FMA units (ptx.exp2_fma).
FMA_EXP2 = [numflash.WgmmaForwardConfig(1, 64, 2, pingpong=False, fma_exp2=2)]
if not SIMULATOR:
    FMA_EXP2 += [numflash.WgmmaForwardConfig(fma_exp2=k) for k in (1, 2)]


@pytest.mark.parametrize(
    "config", FMA_EXP2, ids=lambda c: f"{c.consumers}x{c.block_n}-e{c.fma_exp2}"
)
@pytest.mark.parametrize("case", CASES[:1] if SIMULATOR else CASES, ids=_case_id)
def test_softcap_with_exponentials_on_the_fma_units_matches_the_reference(config, case):
    """WgmmaForwardConfig.fma_exp2 (exp2 by a cubic for part of the probabilities), under the
    softcap it is made for: in the simulator one row block over one key tile, causal (CI's
    time; the GPU runs every case)."""
    dtype, batch, sq, sk, h, hk, d, mask, softcap = case
    _forced("hopper", dtype, d)  # skips where the Hopper forward cannot run
    if SIMULATOR:
        batch, sq, sk, h, hk = 1, 20, 50, 1, 1
    q, k, v = random_qkv(batch, sq, sk, h, hk, d, dtype)
    q = q * 4
    out = poisoned_like(q)
    res, lse = numflash.attention(
        q, k, v, out=out, return_lse=True, config=config, softcap=softcap, **MASKS[mask]
    )
    assert res is out
    assert_matches_reference(q, k, v, out, lse, variants=Variants(softcap=softcap), **MASKS[mask])


def test_softcap_in_float32_on_the_portable_kernel():
    q, k, v = random_qkv(1, 20, 45, 2, 1, 32, "float32")
    out, lse = numflash.attention(q * 3, k, v, return_lse=True, causal=True, softcap=1.0)
    variants = Variants(softcap=1.0)
    assert_matches_reference(q * 3, k, v, out, lse, causal=True, variants=variants)


def test_softcap_with_few_query_rows_is_capped():
    """Calls of at most 16 query rows run the split-KV decode kernel on a GPU (the portable
    forward in the simulator): capped there too."""
    q, k, v = random_qkv(2, 3, 200, 4, 2, 64, "float16")
    out, lse = numflash.attention(q * 4, k, v, return_lse=True, softcap=0.5)
    assert_matches_reference(q * 4, k, v, out, lse, variants=Variants(softcap=0.5))


def test_a_softcap_past_every_score_is_plain_attention():
    q, k, v = random_qkv(1, 30, 50, 2, 2, 64, "float16")
    capped = numflash.attention(q, k, v, softcap=1e6, config=CONFIGS["portable"])
    plain = numflash.attention(q, k, v, config=CONFIGS["portable"])
    np.testing.assert_allclose(
        to_numpy(capped).astype(np.float32), to_numpy(plain).astype(np.float32), atol=2e-3
    )


def test_repeated_calls_with_other_softcaps_are_not_mixed_up():
    """A repeated call replays its first call's launches (numflash.plans): the softcap is part
    of what makes a call repeated, so a new value compiles and runs its own kernel."""
    q, k, v = random_qkv(1, 64, 64, 2, 2, 64, "float16")
    q = q * 4
    for softcap in (0.5, 2.0, 0.0, 0.5, 2.0, 0.0):
        out, lse = numflash.attention(q, k, v, return_lse=True, softcap=softcap)
        variants = Variants(softcap=softcap) if softcap else None
        assert_matches_reference(q, k, v, out, lse, variants=variants)


@pytest.mark.parametrize(
    "softcap, error, words",
    [
        (-1.0, ValueError, "softcap must be 0"),
        (math.nan, ValueError, "softcap must be 0"),
        (math.inf, ValueError, "softcap must be 0"),
        (1e300, ValueError, "within float32"),
        ("50", TypeError, "softcap must be a real number"),
        (True, TypeError, "softcap must be a real number"),
        (None, TypeError, "softcap must be a real number"),
    ],
)
def test_bad_softcaps_are_refused_by_name(softcap, error, words):
    q, k, v = random_qkv(1, 8, 8, 1, 1, 64, "float16")
    with pytest.raises(error, match=words):
        numflash.attention(q, k, v, softcap=softcap)


def test_selected_config_takes_the_softcap_and_says_what_runs():
    q, k, v = random_qkv(1, 4, 300, 2, 1, 64, "float16")
    plain = numflash.selected_config(q, k, v)
    capped = numflash.selected_config(q, k, v, softcap=20.0)
    assert capped == plain  # every family caps: the choice does not change
    with pytest.raises(ValueError, match="softcap"):
        numflash.selected_config(q, k, v, softcap=-2.0)


#: The KV-cache call's kernels, forced: the portable split kernel, the tensor-core decode
#: kernel, and the Hopper forward over the caches (chunked prefill).
KVCACHE_CONFIGS = {
    "portable": numflash.PortableDecodeConfig(),
    "tensor-core": numflash.TensorCoreDecodeConfig(block_n=16, num_warps=2, stages=2),
    "hopper": CONFIGS["hopper"],
}


#: The variants over a KV cache: (name, softcap, sinks, ALiBi slopes' shape or None,
#: num_splits, paged), contiguous and paged where the variant is given both; several splits
#: take the decode kernels' combine, where a sink joins the sum, one split their merge.
KVCACHE_VARIANTS = [
    ("softcap", 1.5, False, None, 0, False),
    ("softcap", 1.5, False, None, 0, True),
    ("sinks", 0.0, True, None, 1, False),
    ("softcap-sinks-3-splits", 4.0, True, None, 3, True),
    ("alibi", 0.0, False, (4,), 1, False),
    ("alibi-per-sequence-sinks-2-splits", 2.0, True, (2, 4), 2, True),
]


#: (family, variant) pairs: all on a GPU; in the simulator the Hopper forward (the slowest
#: to simulate, and never split) with the paged variants alone, and ALiBi in its mixed case.
KVCACHE_PAIRS = [
    (family, variant)
    for family in KVCACHE_CONFIGS
    for variant in KVCACHE_VARIANTS
    # the Hopper kernel's paged cases alone, and ALiBi beside the other variants alone
    if not SIMULATOR or ((family != "hopper" or variant[5]) and variant[0] != "alibi")
]


@pytest.mark.parametrize(
    "family, variant",
    KVCACHE_PAIRS,
    ids=lambda c: c if isinstance(c, str) else c[0] + ("-paged" if c[5] else "-contiguous"),
)
def test_variants_over_a_kv_cache_match_the_reference(family, variant):
    """attention_with_kvcache(softcap=, sinks=, alibi_slopes=) with an append: each
    sequence's rows against the reference over its keys after the append."""
    _, softcap, with_sinks, slopes_shape, num_splits, paged = variant
    config = KVCACHE_CONFIGS[family]
    problems = config.problems(64, numflash.device.current_device())
    if problems:
        pytest.skip("; ".join(problems))
    rows = 20 if family == "hopper" else 3
    lengths, new, capacity, page = [50, 70], 2, 96, 16
    q = random_array((2, rows, 4, 64), "float16") * 4
    k_new, v_new = (random_array((2, new, 2, 64), "float16") for _ in range(2))
    k_cache, v_cache = (random_array((2, capacity, 2, 64), "float16") for _ in range(2))
    kw = {}
    if paged:  # the same rows as pages of 16, in reverse order
        table = np.arange(2 * capacity // page, dtype=np.int32)[::-1].reshape(2, -1)
        order = xp.asarray(table.reshape(-1).copy())
        k_pages, v_pages = (
            xp.empty((2 * capacity // page, page, 2, 64), x.dtype) for x in (k_cache, v_cache)
        )
        k_pages[order] = k_cache.reshape(-1, page, 2, 64)
        v_pages[order] = v_cache.reshape(-1, page, 2, 64)
        caches, kw = (k_pages, v_pages), dict(block_table=xp.asarray(table.copy()))
    else:
        caches = (k_cache, v_cache)
    seqlens = xp.asarray(np.array(lengths, np.int32))
    sinks = random_array((4,), "float32") * 3 if with_sinks else None
    slopes = None
    if slopes_shape is not None:
        slopes = xp.asarray(np.random.default_rng(3).uniform(0.05, 0.5, slopes_shape), np.float32)
    if family == "hopper":
        num_splits = 0  # the Hopper forward does not split the keys
    out, lse = numflash.attention_with_kvcache(
        q, *caches, k_new, v_new, cache_seqlens=seqlens, causal=True, return_lse=True,
        config=config, softcap=softcap, sinks=sinks, num_splits=num_splits, alibi_slopes=slopes,
        **kw,
    )  # fmt: skip
    for b, length in enumerate(lengths):
        row_slopes = slopes if slopes is None or slopes.ndim == 1 else slopes[b : b + 1]
        variants = Variants(softcap=softcap, sinks=sinks, alibi_slopes=row_slopes)
        keys = slice(0, length + new)
        k_b = xp.concatenate([k_cache[b, :length], k_new[b]])[None]
        v_b = xp.concatenate([v_cache[b, :length], v_new[b]])[None]
        assert k_b.shape[1] == keys.stop
        result = check(
            q[b : b + 1], k_b, v_b, out[b : b + 1], lse[b : b + 1], causal=True,
            variants=variants,
        )  # fmt: skip
        assert result.nan == 0 and result.err <= result.bar, (b, result)
        assert result.lse_err <= result.lse_bar, (b, result)


#: The backward families, forced (the simulator's small tiles; on a GPU the defaults).
BACKWARD_CONFIGS = {
    "portable": numflash.PortableBackwardConfig(16, 16),
    "tensor-core": numflash.TensorCoreBackwardConfig(16, 1, 2, True),
    "tensor-core-atomic": numflash.TensorCoreBackwardConfig(32, 2, 2, False),
    "hopper": numflash.WgmmaBackwardConfig(num_warps=4, stages=2),
}


@pytest.mark.parametrize("family, case", _pairs(list(BACKWARD_CONFIGS)), ids=_case_id)
def test_softcap_gradients_match_the_reference(family, case):
    """attention_backward(softcap=) on each backward family: dS is multiplied by the cap's
    derivative at each score, as the reference differentiates it."""
    dtype, batch, sq, sk, h, hk, d, mask, softcap = case
    config = wgmma_or_skip(BACKWARD_CONFIGS[family])
    q, k, v = random_qkv(batch, sq, sk, h, hk, d, dtype)
    q = q * 4
    out, lse = numflash.attention(
        q, k, v, return_lse=True, softcap=softcap, config=CONFIGS["portable"], **MASKS[mask]
    )
    dout = random_array(q.shape, dtype)
    dq, dk, dv = numflash.attention_backward(
        dout, q, k, v, out, lse, softcap=softcap, config=config, **MASKS[mask]
    )
    variants = Variants(softcap=softcap)
    assert_gradients_match(dout, q, k, v, dq, dk, dv, variants=variants, **MASKS[mask])


def test_softcap_gradients_of_a_packed_batch_match_each_sequence():
    lengths = [30, 0, 45, 1]
    q, k, v, cu_d, _ = packed_qkv(lengths, lengths, 2, 1, 64, "float16")
    cu = to_numpy(cu_d)
    q = q * 4
    dout = random_array(q.shape, "float16")
    args = (q, k, v, cu_d, cu_d, max(lengths), max(lengths))
    out, lse = numflash.attention_varlen(*args, causal=True, return_lse=True, softcap=3.0)
    dq, dk, dv = numflash.attention_varlen_backward(
        dout, q, k, v, out, lse, cu_d, cu_d, max(lengths), max(lengths), causal=True,
        softcap=3.0,
    )  # fmt: skip
    for b in range(len(lengths)):
        rows = slice(int(cu[b]), int(cu[b + 1]))
        if rows.start == rows.stop:
            continue
        assert_gradients_match(
            dout[None, rows], q[None, rows], k[None, rows], v[None, rows], dq[None, rows],
            dk[None, rows], dv[None, rows], variants=Variants(softcap=3.0), causal=True,
        )  # fmt: skip
