"""ALiBi (issue 32): ``alibi_slopes`` of shape (nheads,) or (batch, nheads) take slope *
|q_idx - kv_idx| from every score after the softcap, through ``attention``,
``attention_varlen`` and the backward calls on each kernel family, forced by configuration,
against numflash.reference's float64 reference with the same slopes; bad slopes refused by
name. The KV-cache call's slopes are tested with its other variants (test_variants.py)."""

import numpy as np
import pytest
import support
from support import packed_qkv, random_array, random_qkv, to_numpy, xp
from test_variants import BACKWARD_CONFIGS, CONFIGS, MASKS, _forced
from test_variants import CASES as VARIANT_CASES

import numflash
from numflash.kernels.jit import SIMULATOR
from numflash.reference import Variants

#: test_variants' shapes (dtype, batch, seqlen_q, seqlen_k, nheads, nheads_k, head_dim, mask,
#: softcap), ALiBi alone in most and beside a softcap in two; slopes per head in even cases,
#: per sequence and head in odd ones.
CASES = [case[:-1] + (cap,) for case, cap in zip(VARIANT_CASES, (0.0, 0.0, 5.0, 0.0, 30.0, 0.0))]


def _slopes(case_index, batch, nheads):
    """Slopes of BLOOM's range (2^-8 .. 0.5, larger ones hide far keys entirely)."""
    shape = (nheads,) if case_index % 2 == 0 else (batch, nheads)
    rng = np.random.default_rng(11 + case_index)
    return xp.asarray(2.0 ** rng.uniform(-8, -1, shape), dtype=np.float32)


#: (family, case index) of the forward tests: every pair on a GPU, a case a family in the
#: simulator (its time on CI), both slope shapes among them.
FORWARD_PAIRS = (
    list(zip(CONFIGS, range(len(CASES))))
    if SIMULATOR
    else [(family, i) for family in CONFIGS for i in range(len(CASES))]
)


@pytest.mark.parametrize(
    "family, index", FORWARD_PAIRS, ids=lambda c: c if isinstance(c, str) else str(c)
)
def test_alibi_matches_the_reference(family, index):
    dtype, batch, sq, sk, h, hk, d, mask, softcap = CASES[index]
    config = _forced(family, dtype, d)
    q, k, v = random_qkv(batch, sq, sk, h, hk, d, dtype)
    slopes = _slopes(index, batch, h)
    out = support.poisoned_like(q)
    res, lse = numflash.attention(
        q, k, v, out=out, return_lse=True, config=config, softcap=softcap, alibi_slopes=slopes,
        **MASKS[mask],
    )  # fmt: skip
    assert res is out
    variants = Variants(softcap=softcap, alibi_slopes=slopes)
    support.assert_matches_reference(q, k, v, out, lse, variants=variants, **MASKS[mask])


@pytest.mark.parametrize("family", ["portable"] if SIMULATOR else list(CONFIGS))
def test_alibi_with_sinks_and_a_softcap(family):
    """Every built-in variant at once; the sink joins the biased scores' sum (in the
    simulator the portable kernel's alone: test_variants' KV-cache cases mix the three on
    the others)."""
    config = _forced(family, "bfloat16", 64)
    q, k, v = random_qkv(2, 37, 61, 4, 2, 64, "bfloat16")
    slopes = _slopes(1, 2, 4)
    sinks = random_array((4,), "float32") * 2
    out, lse = numflash.attention(q * 3, k, v, causal=True, return_lse=True, config=config,
                                  softcap=8.0, sinks=sinks, alibi_slopes=slopes)  # fmt: skip
    variants = Variants(softcap=8.0, sinks=sinks, alibi_slopes=slopes)
    support.assert_matches_reference(q * 3, k, v, out, lse, causal=True, variants=variants)


def test_alibi_in_float32_on_the_portable_kernel():
    q, k, v = random_qkv(2, 21, 30, 2, 1, 32, "float32")
    slopes = _slopes(0, 2, 2)
    out, lse = numflash.attention(q, k, v, return_lse=True, alibi_slopes=slopes)
    support.assert_matches_reference(q, k, v, out, lse, variants=Variants(alibi_slopes=slopes))


@pytest.mark.parametrize("scale", [-0.3, 0.0])
def test_alibi_at_a_negative_or_zero_scale(scale):
    """The tensor-core kernels rewrite a scale <= 0 (negated q, or zero scores at scale 1) and
    add the bias to raw scores in units of 1 / scale: the bias must survive the rewrite."""
    q, k, v = random_qkv(1, 40, 50, 2, 2, 64, "float16")
    slopes = _slopes(0, 1, 2) * 8
    out, lse = numflash.attention(q, k, v, return_lse=True, softmax_scale=scale,
                                  alibi_slopes=slopes)  # fmt: skip
    variants = Variants(alibi_slopes=slopes)
    support.assert_matches_reference(q, k, v, out, lse, softmax_scale=scale, variants=variants)


def test_alibi_with_few_query_rows():
    """Few query rows take the split-KV decode kernel's route (where the device has its
    family; the portable forward in the simulator): each row's own head's slope there, with
    the rows of several heads in one block."""
    q, k, v = random_qkv(2, 3, 90, 4, 1, 64, "float16")
    slopes = _slopes(1, 2, 4)
    out, lse = numflash.attention(q, k, v, causal=True, return_lse=True, alibi_slopes=slopes)
    variants = Variants(alibi_slopes=slopes)
    support.assert_matches_reference(q, k, v, out, lse, causal=True, variants=variants)


def test_alibi_over_a_packed_batch():
    """Positions within each sequence, and sequence b's row of (batch, nheads) slopes."""
    lengths_q, lengths_k = [5, 0, 40, 17], [9, 3, 40, 30]
    h, hk, d = 4, 2, 64
    q, k, v, cu_q, cu_k = packed_qkv(lengths_q, lengths_k, h, hk, d, "float16")
    slopes = _slopes(1, len(lengths_q), h)
    dout = random_array(q.shape, "float16")
    args = (q, k, v, cu_q, cu_k, max(lengths_q), max(lengths_k))
    cu_q, cu_k = to_numpy(cu_q), to_numpy(cu_k)
    out, lse = numflash.attention_varlen(*args, causal=True, return_lse=True, alibi_slopes=slopes)
    dq, dk, dv = numflash.attention_varlen_backward(
        dout, q, k, v, out, lse, *args[3:], causal=True, alibi_slopes=slopes
    )
    for b in range(len(lengths_q)):
        rows, keys = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        if rows.stop == rows.start:
            continue
        variants = Variants(alibi_slopes=slopes[b : b + 1])
        seq = [x[None] for x in (q[rows], k[keys], v[keys])]
        support.assert_matches_reference(*seq, out[rows][None], lse[:, rows][None], causal=True,
                                 variants=variants)  # fmt: skip
        support.assert_gradients_match(dout[rows][None], *seq, dq[rows][None], dk[keys][None],
                               dv[keys][None], causal=True, variants=variants)  # fmt: skip


#: (backward family, case index) pairs: every pair on a GPU; in the simulator one case a
#: family (the portable kernel's and the shared tensor-core skeleton's element function).
BACKWARD_PAIRS = [
    (family, i)
    for family in BACKWARD_CONFIGS
    for i in range(len(CASES))
    if not SIMULATOR or i == {"portable": 0, "tensor-core": 1, "hopper": 2}.get(family)
]


@pytest.mark.parametrize(
    "family, index", BACKWARD_PAIRS, ids=lambda c: c if isinstance(c, str) else str(c)
)
def test_alibi_gradients_match_the_reference(family, index):
    dtype, batch, sq, sk, h, hk, d, mask, softcap = CASES[index]
    config = support.wgmma_or_skip(BACKWARD_CONFIGS[family])
    q, k, v = random_qkv(batch, sq, sk, h, hk, d, dtype)
    slopes = _slopes(index, batch, h)
    dout = random_array(q.shape, dtype)
    kw = dict(softcap=softcap, alibi_slopes=slopes, **MASKS[mask])
    out, lse = numflash.attention(q, k, v, return_lse=True, **kw)
    dq, dk, dv = numflash.attention_backward(dout, q, k, v, out, lse, config=config, **kw)
    variants = Variants(softcap=softcap, alibi_slopes=slopes)
    support.assert_gradients_match(dout, q, k, v, dq, dk, dv, variants=variants, **MASKS[mask])


def test_repeated_calls_with_other_slopes_are_not_mixed_up():
    """Calls that differ only in their slopes (one shape) each see their own, and a plain
    call after them is plain."""
    q, k, v = random_qkv(1, 64, 64, 2, 2, 64, "float16")
    for index in (0, 2, 0):
        slopes = _slopes(index, 1, 2)
        out, lse = numflash.attention(q, k, v, return_lse=True, alibi_slopes=slopes)
        support.assert_matches_reference(q, k, v, out, lse, variants=Variants(alibi_slopes=slopes))
    out, lse = numflash.attention(q, k, v, return_lse=True)
    support.assert_matches_reference(q, k, v, out, lse)


def test_zero_slopes_are_plain_attention():
    q, k, v = random_qkv(1, 30, 50, 2, 2, 64, "float16")
    zero = xp.zeros((2,), np.float32)
    biased = numflash.attention(q, k, v, alibi_slopes=zero, config=CONFIGS["portable"])
    plain = numflash.attention(q, k, v, config=CONFIGS["portable"])
    np.testing.assert_array_equal(
        support.to_numpy(biased).view(np.uint16), support.to_numpy(plain).view(np.uint16)
    )


@pytest.mark.parametrize(
    "slopes, error, words",
    [
        (np.zeros(3, np.float32), ValueError, "alibi_slopes must have shape (nheads,) = (2,)"),
        (np.zeros((3, 2), np.float32), ValueError, "or (batch, nheads) = (1, 2)"),
        (np.zeros((1, 2, 1), np.float32), ValueError, "alibi_slopes must have shape"),
        (np.zeros(2, np.float64), TypeError, "alibi_slopes must have dtype float32"),
        ([0.5, 0.25], TypeError, "alibi_slopes"),
    ],
)
def test_bad_slopes_are_refused_by_name(slopes, error, words):
    q, k, v = random_qkv(1, 8, 8, 2, 2, 64, "float16")
    if isinstance(slopes, np.ndarray):
        slopes = xp.asarray(slopes)
    pattern = words.replace("(", r"\(").replace(")", r"\)")
    with pytest.raises(error, match=pattern):
        numflash.attention(q, k, v, alibi_slopes=slopes)
    out, lse = numflash.attention(q, k, v, return_lse=True)
    with pytest.raises(error, match=pattern):
        numflash.attention_backward(q, q, k, v, out, lse, alibi_slopes=slopes)
