"""Attention sinks (issue 32): one logit a head joins every row's softmax denominator with no
value, through ``attention(..., sinks=)`` and ``attention_varlen(..., sinks=)`` on each forward
family, forced by configuration, against numflash.reference's float64 reference with the same
sinks; the backward's dq, dk, dv and dsinks; bad sinks refused by name. The KV-cache call's
sinks are tested with its other variants (test_variants.py)."""

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
from test_variants import CASES as VARIANT_CASES
from test_variants import CONFIGS, MASKS, _forced

import numflash
from numflash.kernels.jit import SIMULATOR
from numflash.reference import Variants, attention_backward_reference, check_backward

#: test_variants' shapes (dtype, batch, seqlen_q, seqlen_k, nheads, nheads_k, head_dim, mask,
#: softcap), with sinks alone in most and beside a softcap in two.
CASES = [case[:-1] + (cap,) for case, cap in zip(VARIANT_CASES, (0.0, 0.0, 5.0, 0.0, 30.0, 0.0))]


def _sinks(nheads, seed=5):
    """Sink logits of several units, each side of the rows' own log-sum-exp."""
    return random_array((nheads,), "float32", np.random.default_rng(seed)) * 3


#: (family, case) of the forward tests: every pair on a GPU, a case a family in the simulator
#: (its time on CI).
FORWARD_PAIRS = (
    list(zip(CONFIGS, CASES))
    if SIMULATOR
    else [(family, case) for family in CONFIGS for case in CASES]
)


@pytest.mark.parametrize(
    "family, case", FORWARD_PAIRS, ids=lambda c: c if isinstance(c, str) else f"{c[0]}-{c[7]}"
)
def test_sinks_match_the_reference(family, case):
    dtype, batch, sq, sk, h, hk, d, mask, softcap = case
    config = _forced(family, dtype, d)
    q, k, v = random_qkv(batch, sq, sk, h, hk, d, dtype)
    sinks = _sinks(h)
    out = poisoned_like(q)
    res, lse = numflash.attention(
        q, k, v, out=out, return_lse=True, config=config, softcap=softcap, sinks=sinks,
        **MASKS[mask],
    )  # fmt: skip
    assert res is out
    variants = Variants(softcap=softcap, sinks=sinks)
    assert_matches_reference(q, k, v, out, lse, variants=variants, **MASKS[mask])


def test_sinks_in_float32_on_the_portable_kernel():
    q, k, v = random_qkv(2, 21, 30, 2, 1, 32, "float32")
    sinks = _sinks(2)
    out, lse = numflash.attention(q, k, v, causal=True, return_lse=True, sinks=sinks,
                                  config=CONFIGS["portable"])  # fmt: skip
    assert_matches_reference(q, k, v, out, lse, causal=True, variants=Variants(sinks=sinks))


@pytest.mark.parametrize("family", list(CONFIGS))
def test_rows_that_see_no_key_get_the_sink(family):
    """A window that hides every key from the first rows: out 0 and lse = the head's sink,
    where the plain call gives lse -inf."""
    config = _forced(family, "float16", 64)
    q, k, v = random_qkv(1, 80, 20, 2, 2, 64, "float16")
    sinks = _sinks(2)
    window = (0, 0)  # row i sees key i - 60 alone: rows below 60 see none
    out, lse = numflash.attention(q, k, v, window_size=window, return_lse=True, sinks=sinks,
                                  config=config)  # fmt: skip
    lse, out = to_numpy(lse), to_numpy(out).astype(np.float64)
    np.testing.assert_array_equal(out[:, :60], 0.0)
    np.testing.assert_allclose(lse[0, :, :60], np.repeat(to_numpy(sinks)[:, None], 60, 1),
                               rtol=1e-6)  # fmt: skip
    assert np.isfinite(lse).all()


def test_no_keys_at_all_give_the_sink():
    q = random_array((1, 5, 2, 64), "float16")
    k = v = random_array((1, 0, 2, 64), "float16")
    sinks = _sinks(2)
    out, lse = numflash.attention(q, k, v, return_lse=True, sinks=sinks)
    assert (to_numpy(out).astype(np.float64) == 0).all()
    np.testing.assert_array_equal(to_numpy(lse)[0], np.repeat(to_numpy(sinks)[:, None], 5, 1))


def test_sinks_with_few_query_rows():
    """Few query rows take the split-KV decode kernel's route (where the device has its
    family; the portable forward in the simulator), the sink joined there."""
    q, k, v = random_qkv(2, 3, 90, 4, 2, 64, "float16")
    sinks = _sinks(4)
    out, lse = numflash.attention(q, k, v, causal=True, return_lse=True, sinks=sinks)
    assert_matches_reference(q, k, v, out, lse, causal=True, variants=Variants(sinks=sinks))


def test_sinks_over_a_packed_batch():
    lengths_q, lengths_k = [5, 0, 40, 17], [9, 3, 40, 30]
    h, hk, d = 4, 2, 64
    q, k, v, cu_q, cu_k = packed_qkv(lengths_q, lengths_k, h, hk, d, "float16")
    sinks = _sinks(h)
    out, lse = numflash.attention_varlen(q, k, v, cu_q, cu_k, max(lengths_q), max(lengths_k),
                                         causal=True, return_lse=True, sinks=sinks)  # fmt: skip
    variants = Variants(sinks=sinks)
    for b in range(len(lengths_q)):
        rows = slice(int(cu_q[b]), int(cu_q[b + 1]))
        keys = slice(int(cu_k[b]), int(cu_k[b + 1]))
        if rows.stop == rows.start:
            continue
        assert_matches_reference(q[rows][None], k[keys][None], v[keys][None], out[rows][None],
                                 lse[:, rows][None], causal=True, variants=variants)  # fmt: skip


def test_repeated_calls_with_other_sinks_are_not_mixed_up():
    """Calls that differ only in their sinks array (one shape) each see their own."""
    q, k, v = random_qkv(1, 64, 64, 2, 2, 64, "float16")
    for seed in (1, 2, 3, 2):
        sinks = _sinks(2, seed=seed)
        out, lse = numflash.attention(q, k, v, return_lse=True, sinks=sinks)
        assert_matches_reference(q, k, v, out, lse, variants=Variants(sinks=sinks))
    plain_out, plain_lse = numflash.attention(q, k, v, return_lse=True)
    assert_matches_reference(q, k, v, plain_out, plain_lse)


#: (backward family, case) pairs, forced (the simulator's small tiles; on a GPU the defaults):
#: every pair on a GPU; in the simulator the portable kernel's alone, as the dq, dk, dv
#: kernels are the plain calls' (the lse holds the sinks) and dsinks has one kernel for all.
BACKWARD_PAIRS = [
    (family, case)
    for family in ("portable", "tensor-core", "hopper")
    for case in CASES
    if not SIMULATOR or (family == "portable" and case is CASES[0])
]


def _dsinks_from(dout, out, lse, sinks):
    """(dsinks, the sum of its terms' magnitudes) in float64 from the output and lse as
    stored: -sum over batch and rows of e^(sink - lse) * rowsum(dout * out), the formula the
    backward evaluates."""
    delta = (to_numpy(dout).astype(np.float64) * to_numpy(out).astype(np.float64)).sum(-1)
    weight = np.exp(to_numpy(sinks).astype(np.float64)[None, :, None] - to_numpy(lse))
    terms = weight * delta.transpose(0, 2, 1)  # (batch, nheads, seqlen_q)
    return -terms.sum(axis=(0, 2)), np.abs(terms).sum(axis=(0, 2))


def _assert_dsinks_match(dsinks, result, reference, dout, out, lse, sinks):
    """dsinks as the formula gives it over the stored output and lse, to float32 summation
    error; and against the float64 ``reference`` under check_backward's ``result.bar``
    widened by how far the stored output's rounding moves the formula (in bf16 that alone can
    exceed twice the naive implementation's error: both sum thousands of rounded terms)."""
    assert result.name == "dsinks" and result.nan == 0, result
    given, scale = _dsinks_from(dout, out, lse, sinks)
    dsinks = to_numpy(dsinks)
    np.testing.assert_allclose(dsinks, given, rtol=0, atol=1e-5 * scale.max() + 1e-6)
    stored_output_shift = np.abs(given - to_numpy(reference)).max()
    assert result.err <= result.bar + stored_output_shift, (result, stored_output_shift)


@pytest.mark.parametrize(
    "family, case", BACKWARD_PAIRS, ids=lambda c: c if isinstance(c, str) else f"{c[0]}-{c[7]}"
)
def test_gradients_with_sinks_match_the_reference(family, case):
    """dq, dk, dv of a call with sinks (the backward kernels read them through lse) and
    dsinks, against the reference's gradients with the same sinks (BACKWARD_PAIRS)."""
    from test_variants import BACKWARD_CONFIGS

    dtype, batch, sq, sk, h, hk, d, mask, softcap = case
    config = wgmma_or_skip(BACKWARD_CONFIGS[family])
    q, k, v = random_qkv(batch, sq, sk, h, hk, d, dtype)
    sinks = _sinks(h)
    dout = random_array(q.shape, dtype)
    kw = dict(softcap=softcap, **MASKS[mask])
    out, lse = numflash.attention(q, k, v, return_lse=True, sinks=sinks, **kw)
    dq, dk, dv, dsinks = numflash.attention_backward(
        dout, q, k, v, out, lse, sinks=sinks, config=config, **kw
    )
    assert dsinks.shape == (h,) and dsinks.dtype == np.float32
    variants = Variants(softcap=softcap, sinks=sinks)
    results = check_backward(dout, q, k, v, dq, dk, dv, variants=variants, dsinks=dsinks,
                             **MASKS[mask])  # fmt: skip
    for result in results[:3]:
        assert result.nan == 0 and result.err <= result.bar, result
    reference = attention_backward_reference(dout, q, k, v, variants=variants, **MASKS[mask])[3]
    _assert_dsinks_match(dsinks, results[3], reference, dout, out, lse, sinks)
    # the plain backward over the same lse gives the same dq, dk, dv
    plain = numflash.attention_backward(dout, q, k, v, out, lse, config=config, **kw)
    for a, b in zip(plain, (dq, dk, dv)):
        np.testing.assert_array_equal(to_numpy(a).view(np.uint16), to_numpy(b).view(np.uint16))


def test_sink_gradients_of_a_packed_batch():
    lengths = [12, 0, 20, 1]
    q, k, v, cu_d, _ = packed_qkv(lengths, lengths, 4, 2, 64, "float16")
    cu = to_numpy(cu_d)
    dout = random_array(q.shape, "float16")
    sinks = _sinks(4)
    args = (q, k, v, cu_d, cu_d, max(lengths), max(lengths))
    out, lse = numflash.attention_varlen(*args, causal=True, return_lse=True, sinks=sinks)
    dq, dk, dv, dsinks = numflash.attention_varlen_backward(
        dout, q, k, v, out, lse, *args[3:], causal=True, sinks=sinks
    )
    variants = Variants(sinks=sinks)
    want = np.zeros(4)
    for b in range(len(lengths)):
        rows = slice(int(cu[b]), int(cu[b + 1]))
        if rows.stop == rows.start:
            continue
        seq = [x[rows][None] for x in (dout, q, k, v)]
        refs = attention_backward_reference(*seq, causal=True, variants=variants)
        want += to_numpy(refs[3])
        assert_gradients_match(*seq, dq[rows][None], dk[rows][None], dv[rows][None],
                               causal=True, variants=variants)  # fmt: skip
    np.testing.assert_allclose(to_numpy(dsinks), want, rtol=2e-2, atol=2e-3)


def test_sink_gradients_are_repeatable():
    """dsinks is summed in a fixed order: the same bits at every call."""
    q, k, v = random_qkv(2, 24, 24, 2, 1, 64, "float16")
    sinks = _sinks(2)
    dout = random_array(q.shape, "float16")
    out, lse = numflash.attention(q, k, v, causal=True, return_lse=True, sinks=sinks)
    config = numflash.PortableBackwardConfig(16, 16)
    runs = [
        to_numpy(
            numflash.attention_backward(
                dout, q, k, v, out, lse, causal=True, sinks=sinks, config=config
            )[3]
        )  # fmt: skip
        for _ in range(2)
    ]
    np.testing.assert_array_equal(runs[0], runs[1])


@pytest.mark.parametrize(
    "sinks, error, words",
    [
        (np.zeros(3, np.float32), ValueError, "sinks must have shape (nheads,) = (2,)"),
        (np.zeros(2, np.float64), TypeError, "sinks must have dtype float32"),
        (np.zeros((1, 2), np.float32), ValueError, "sinks must have shape"),
        ([0.0, 1.0], TypeError, "sinks"),
    ],
)
def test_bad_sinks_are_refused_by_name(sinks, error, words):
    q, k, v = random_qkv(1, 8, 8, 2, 2, 64, "float16")
    if isinstance(sinks, np.ndarray):
        sinks = xp.asarray(sinks)
    with pytest.raises(error, match=words.replace("(", r"\(").replace(")", r"\)")):
        numflash.attention(q, k, v, sinks=sinks)
