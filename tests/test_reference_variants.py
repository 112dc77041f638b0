"""The float64 reference of the attention variants (numflash.reference.Variants: softcap,
ALiBi, sinks, score_mod, mask_mod), which the variant kernels will be judged against: checked
here against the definitions written out one score at a time, and its gradients against
central finite differences of the reference's own forward."""

import math

import numpy as np
import pytest
from test_mods import relative_bias, relative_bias_derivative, same_document

from numflash import reference
from numflash.reference import Variants

B, SQ, SK, H, HK, D = 2, 5, 7, 4, 2, 8


def _inputs(seed=0):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((B, SQ, H, D))
    k = rng.standard_normal((B, SK, HK, D))
    v = rng.standard_normal((B, SK, HK, D))
    return q, k, v


#: mod_args of the calls with a score_mod or mask_mod: a bias slope a head, a document a key.
MOD_ARGS = (np.array([0.1, -0.2, 0.3, 0.0]), np.array([0, 0, 1, 1, 1, 2, 2]))


def _all(rng=None):
    """Every variant at once, with values that move the result."""
    rng = rng or np.random.default_rng(1)
    return Variants(
        softcap=2.5,
        alibi_slopes=rng.uniform(0.1, 0.6, (B, H)),
        sinks=rng.standard_normal(H),
        score_mod=relative_bias,
        score_mod_derivative=relative_bias_derivative,
        mask_mod=same_document,
        mod_args=(rng.uniform(-0.3, 0.3, H), np.array([0, 0, 0, 1, 1, 1, 2])),
    )


def _by_definition(q, k, v, causal, window, variants):
    """(out, lse) one score at a time, as Variants' docstring defines them."""
    scale = 1 / math.sqrt(D)
    out = np.zeros((B, SQ, H, D))
    lse = np.zeros((B, H, SQ))
    slopes = None if variants.alibi_slopes is None else np.asarray(variants.alibi_slopes)
    for b in range(B):
        for h in range(H):
            hk = h // (H // HK)
            for i in range(SQ):
                qi = i + SK - SQ
                seen, scores = [], []
                for j in range(SK):
                    left, right = window
                    if causal:
                        right = 0
                    if (right >= 0 and j > qi + right) or (left >= 0 and j < qi - left):
                        continue
                    if variants.mask_mod is not None and not variants.mask_mod.py_func(
                        b, h, qi, j, *variants.mod_args
                    ):
                        continue
                    s = scale * float(q[b, i, h] @ k[b, j, hk])
                    if variants.softcap:
                        s = variants.softcap * math.tanh(s / variants.softcap)
                    if slopes is not None:
                        slope = slopes[h] if slopes.ndim == 1 else slopes[b, h]
                        s -= slope * abs(qi - j)
                    if variants.score_mod is not None:
                        s = variants.score_mod.py_func(s, b, h, qi, j, *variants.mod_args)
                    seen.append(j)
                    scores.append(s)
                terms = [math.exp(s) for s in scores]
                total = sum(terms)
                if variants.sinks is not None:
                    total += math.exp(variants.sinks[h])
                if total == 0:
                    lse[b, h, i] = -math.inf
                    continue
                lse[b, h, i] = math.log(total)
                for j, t in zip(seen, terms):
                    out[b, i, h] += t / total * v[b, j, hk]
    return out, lse


CASES = [
    ("softcap", Variants(softcap=1.5)),
    ("alibi per head", Variants(alibi_slopes=np.array([0.5, 0.25, 0.125, 0.0625]))),
    ("alibi per batch and head", Variants(alibi_slopes=np.linspace(0.1, 0.8, B * H).reshape(B, H))),
    ("sinks", Variants(sinks=np.array([0.5, -1.0, 2.0, 0.0]))),
    (
        "score_mod",
        Variants(
            score_mod=relative_bias,
            score_mod_derivative=relative_bias_derivative,
            mod_args=MOD_ARGS,
        ),
    ),
    ("mask_mod", Variants(mask_mod=same_document, mod_args=MOD_ARGS)),
    ("all", _all()),
]


@pytest.mark.parametrize("causal,window", [(False, (-1, -1)), (True, (-1, -1)), (False, (2, 1))])
@pytest.mark.parametrize("name,variants", CASES, ids=[c[0] for c in CASES])
def test_the_reference_follows_the_definitions(name, variants, causal, window):
    q, k, v = _inputs()
    out, lse = reference.attention_reference(
        q, k, v, causal=causal, window_size=window, variants=variants
    )
    want_out, want_lse = _by_definition(q, k, v, causal, window, variants)
    np.testing.assert_allclose(out, want_out, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(lse, want_lse, rtol=1e-12, atol=1e-12)
    naive, naive_lse = reference.attention_naive(
        q.astype(np.float32), k.astype(np.float32), v.astype(np.float32), causal=causal,
        window_size=window, variants=variants,
    )  # fmt: skip
    np.testing.assert_allclose(naive, want_out, atol=1e-5)


def test_a_row_that_sees_no_key_gets_out_0_and_its_sink_as_lse():
    q, k, v = _inputs()
    sinks = np.array([0.5, -1.0, 2.0, 0.0])
    # window (0, 0) on rows past the keys' diagonal... a causal call with more queries than keys
    q = np.concatenate([q, q], axis=1)  # 10 rows over 7 keys: the first 3 see no key
    out, lse = reference.attention_reference(q, k, v, causal=True, variants=Variants(sinks=sinks))
    assert not out[:, :3].any()
    np.testing.assert_array_equal(lse[:, :, :3], np.broadcast_to(sinks[None, :, None], (B, H, 3)))
    assert np.isfinite(lse).all()


def test_no_variants_is_the_plain_reference():
    q, k, v = _inputs()
    plain = reference.attention_reference(q, k, v, causal=True)
    for variants in (None, Variants(), Variants(softcap=0.0)):
        same = reference.attention_reference(q, k, v, causal=True, variants=variants)
        for a, b in zip(plain, same):
            np.testing.assert_array_equal(a, b)


def _loss(q, k, v, dout, variants, sinks=None, **kw):
    if sinks is not None:
        variants = variants._replace(sinks=sinks)
    out, _ = reference.attention_reference(q, k, v, variants=variants, **kw)
    return float((out * dout).sum())


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("name,variants", CASES, ids=[c[0] for c in CASES])
def test_the_reference_gradients_are_the_forwards_derivatives(name, variants, causal):
    """Analytic dq, dk, dv (and dsinks) against central differences of the forward, at a few
    random elements of each."""
    q, k, v = _inputs(2)
    dout = np.random.default_rng(3).standard_normal(q.shape)
    kw = dict(causal=causal)
    grads = reference.attention_backward_reference(dout, q, k, v, variants=variants, **kw)
    assert len(grads) == (4 if variants.sinks is not None else 3)
    arrays = [q, k, v] + (
        [np.array(variants.sinks, dtype=float)] if variants.sinks is not None else []
    )
    rng = np.random.default_rng(4)
    eps = 1e-6
    for which, (x, grad) in enumerate(zip(arrays, grads)):
        for _ in range(6):
            index = tuple(rng.integers(0, n) for n in x.shape)
            values = []
            for sign in (1, -1):
                moved = [a.copy() for a in arrays]
                moved[which][index] += sign * eps
                sinks = moved[3] if len(moved) == 4 else None
                values.append(_loss(*moved[:3], dout, variants, sinks, **kw))
            numeric = (values[0] - values[1]) / (2 * eps)
            assert abs(grad[index] - numeric) <= 1e-6 * (1 + abs(numeric)), (which, index)


def test_a_score_mod_without_its_derivative_has_no_gradient():
    q, k, v = _inputs()
    variants = Variants(score_mod=relative_bias, mod_args=MOD_ARGS)
    with pytest.raises(ValueError, match="score_mod_derivative"):
        reference.attention_backward_reference(q, q, k, v, variants=variants)


def test_the_naive_gradients_and_the_check_take_variants():
    """attention_backward_naive in fp32 stays near the float64 reference with every variant,
    and check_backward judges dsinks beside dq, dk, dv."""
    q, k, v = (x.astype(np.float32) for x in _inputs(5))
    dout = np.random.default_rng(6).standard_normal(q.shape).astype(np.float32)
    variants = _all()
    ref = reference.attention_backward_reference(dout, q, k, v, variants=variants)
    naive = reference.attention_backward_naive(dout, q, k, v, variants=variants)
    assert len(naive) == 4
    for a, b in zip(naive, ref):
        np.testing.assert_allclose(a, b, atol=1e-4)
    results = reference.check_backward(
        dout, q, k, v, *naive[:3], variants=variants, dsinks=naive[3]
    )
    assert [r.name for r in results] == ["dq", "dk", "dv", "dsinks"] and all(r.ok for r in results)
    wrong = naive[3] + 0.1
    results = reference.check_backward(dout, q, k, v, *naive[:3], variants=variants, dsinks=wrong)
    assert not results[3].ok
