"""Reference attention: float64 ground truth, and a naive same-precision version for error bars.

Tests, benchmarks and the autotuner all judge the kernels against :func:`attention_reference`.
The bar for a 16-bit result (flash-attn's tests'): ``max|out - ref| <= 2 * max|naive - ref| + atol``, where
``naive`` is :func:`attention_naive`, attention computed plainly in the input precision.

Both work on NumPy and CuPy arrays of layout (batch, seqlen, nheads, head_dim) and follow
``numflash.attention``'s semantics exactly (GQA, bottom-right causal/window masks, rows that see
no key give 0 and LSE -inf).
"""

import math
from typing import NamedTuple

import numpy as np

from .arrays import array_module, dtype_name, from_float, to_float32, to_float64


def visibility_mask(seqlen_q, seqlen_k, causal=False, window_size=(-1, -1), xp=np):
    """Boolean (seqlen_q, seqlen_k): True where query i sees key j (bottom-right aligned)."""
    left, right = window_size
    if causal:
        right = 0
    i = xp.arange(seqlen_q)[:, None]
    j = xp.arange(seqlen_k)[None, :]
    diagonal = i + seqlen_k - seqlen_q
    mask = xp.ones((seqlen_q, seqlen_k), dtype=bool)
    if right >= 0:
        mask &= j <= diagonal + right
    if left >= 0:
        mask &= j >= diagonal - left
    return mask


def _expand_kv(x, nheads):
    """(b, s, nheads_k, d) -> (b, s, nheads, d): each kv head serves nheads // nheads_k q heads."""
    return x.repeat(nheads // x.shape[2], axis=2)


def _softmax_attention(q, k, v, scale, mask, rounding=None):
    """Attention over float arrays of layout (b, h, s, d); ``rounding`` is applied after each op."""
    xp = array_module(q)
    rnd = rounding or (lambda a: a)
    scores = rnd(xp.einsum("bhqd,bhkd->bhqk", q, k) * scale)
    scores = xp.where(mask, scores, -xp.inf)
    row_max = scores.max(axis=-1, keepdims=True)
    finite_max = xp.where(xp.isfinite(row_max), row_max, 0.0)
    p = xp.exp(scores - finite_max)
    row_sum = p.sum(axis=-1, keepdims=True)
    seen = row_sum > 0
    probs = rnd(p / xp.where(seen, row_sum, 1.0))
    out = rnd(xp.einsum("bhqk,bhkd->bhqd", probs, v))
    lse = xp.where(seen, finite_max + xp.log(xp.where(seen, row_sum, 1.0)), -xp.inf)[..., 0]
    return out, lse


def _prepare(q, k, v, softmax_scale, convert):
    nheads = q.shape[2]
    scale = 1.0 / math.sqrt(q.shape[-1]) if softmax_scale is None else float(softmax_scale)
    qh = convert(q).transpose(0, 2, 1, 3)
    kh = convert(_expand_kv(k, nheads)).transpose(0, 2, 1, 3)
    vh = convert(_expand_kv(v, nheads)).transpose(0, 2, 1, 3)
    return qh, kh, vh, scale


def attention_reference(
    q, k, v, *, causal=False, softmax_scale=None, window_size=(-1, -1), query_chunk=1024
):
    """(out, lse) in float64: out (batch, seqlen_q, nheads, head_dim), lse (batch, nheads, seqlen_q).

    Computed ``query_chunk`` query rows at a time so that long sequences fit in memory.
    """
    xp = array_module(q)
    qh, kh, vh, scale = _prepare(q, k, v, softmax_scale, to_float64)
    seqlen_q, seqlen_k = q.shape[1], k.shape[1]
    mask = visibility_mask(seqlen_q, seqlen_k, causal, window_size, xp)
    out = xp.empty(qh.shape, dtype=xp.float64)
    lse = xp.empty(qh.shape[:3], dtype=xp.float64)
    for start in range(0, seqlen_q, query_chunk):
        rows = slice(start, min(start + query_chunk, seqlen_q))
        out[:, :, rows], lse[:, :, rows] = _softmax_attention(
            qh[:, :, rows], kh, vh, scale, mask[rows]
        )
    return out.transpose(0, 2, 1, 3), lse


def _low_precision(dtype):
    """(to fp32, round through ``dtype`` and back to fp32): how the naive versions compute."""

    def rounding(a):
        return to_float32(from_float(a, dtype))

    return to_float32, rounding


def attention_naive(q, k, v, *, causal=False, softmax_scale=None, window_size=(-1, -1)):
    """Attention as a plain implementation in the input precision computes it.

    Every intermediate (scores, probabilities, output) is rounded to the input dtype, as a
    framework's matmuls and softmax in fp16/bf16 would; the math between roundings is fp32.
    Returns (out in the input dtype, lse in float32).
    """
    xp = array_module(q)
    dtype = q.dtype
    as_f32, rounding = _low_precision(dtype)
    qh, kh, vh, scale = _prepare(q, k, v, softmax_scale, as_f32)
    mask = visibility_mask(q.shape[1], k.shape[1], causal, window_size, xp)
    out, lse = _softmax_attention(qh, kh, vh, xp.float32(scale), mask, rounding)
    return from_float(out.transpose(0, 2, 1, 3), dtype), lse.astype(xp.float32)


#: Absolute slack added to twice the naive implementation's error : what a
#: correct kernel may lose beyond the naive version when both errors are near zero.
ATOL = {"float16": 1e-4, "bfloat16": 1e-3, "float32": 1e-5}
LSE_ATOL = 1e-4


class Check(NamedTuple):
    err: float  # max |out - reference|
    bar: float  # 2 * max |naive - reference| + ATOL[dtype]
    lse_err: float
    lse_bar: float
    nan: int  # output elements that are NaN

    @property
    def ok(self):
        return self.nan == 0 and self.err <= self.bar and self.lse_err <= self.lse_bar


def _max_abs(a):
    """max |a| as a float, 0 for an empty array (CuPy's max has no ``initial=``)."""
    return float(abs(a).max()) if a.size else 0.0


def check(q, k, v, out, lse=None, *, causal=False, softmax_scale=None, window_size=(-1, -1)):
    """How far ``out`` (and ``lse``) are from the float64 reference, against that bar.

    The bar is twice the error of :func:`attention_naive` (the same attention computed plainly
    in the input precision) plus ``ATOL``; LSE rows without keys must be -inf on both sides.
    """
    xp = array_module(q)
    kw = dict(causal=causal, window_size=window_size, softmax_scale=softmax_scale)
    ref, lse_ref = attention_reference(q, k, v, **kw)
    naive, lse_naive = attention_naive(q, k, v, **kw)
    dtype = dtype_name(q.dtype)
    out64 = to_float64(out)
    nan = int(xp.isnan(out64).sum())
    err = _max_abs(out64 - ref)
    bar = 2 * _max_abs(to_float64(naive) - ref) + ATOL[dtype]
    lse_err = lse_bar = 0.0
    if lse is not None:
        empty = xp.isneginf(lse_ref)
        if bool((xp.isneginf(lse) != empty).any()) or bool(xp.isnan(lse).any()):
            lse_err = math.inf
        elif bool((~empty).any()):
            seen = ~empty
            lse_err = _max_abs(lse[seen] - lse_ref[seen])
            lse_bar = 2 * _max_abs(lse_naive[seen] - lse_ref[seen]) + LSE_ATOL
    return Check(err, bar, lse_err, lse_bar, nan)


# -- gradients -------------------------------------------------------------------------------------


def _sum_groups(x, nheads_k):
    """(b, s, nheads, d) -> (b, s, nheads_k, d): GQA gradients sum over each group's q heads."""
    b, s, h, d = x.shape
    return x.reshape(b, s, nheads_k, h // nheads_k, d).sum(axis=3)


def _softmax_backward(q, k, v, dout, scale, mask, rounding=None):
    """(dq, dk, dv) over float arrays of layout (b, h, s, d); ``rounding`` after each op.

    p = softmax(q k^T * scale) over the visible keys; dv = p^T dout; dp = dout v^T;
    ds = p * (dp - delta); dq = ds k * scale; dk = ds^T q * scale. delta = rowsum(dp * p)
    exactly; with ``rounding`` it is rowsum(dout * out) from the rounded output, the formula
    FlashAttention's backward uses (its error dominates when a row's softmax is peaked on few
    keys, so a naive bar without it is narrower than the algorithm can meet).
    """
    xp = array_module(q)
    rnd = rounding or (lambda a: a)
    scores = xp.where(mask, xp.einsum("bhqd,bhkd->bhqk", q, k) * scale, -xp.inf)
    row_max = scores.max(axis=-1, keepdims=True)
    p = xp.exp(scores - xp.where(xp.isfinite(row_max), row_max, 0.0))
    row_sum = p.sum(axis=-1, keepdims=True)
    p = rnd(p / xp.where(row_sum > 0, row_sum, 1.0))
    dv = rnd(xp.einsum("bhqk,bhqd->bhkd", p, dout))
    dp = rnd(xp.einsum("bhqd,bhkd->bhqk", dout, v))
    if rounding is None:
        delta = (p * dp).sum(axis=-1, keepdims=True)
    else:  # as FlashAttention's backward: from the output as stored, in the input dtype
        out = rnd(xp.einsum("bhqk,bhkd->bhqd", p, v))
        delta = (dout * out).sum(axis=-1, keepdims=True)
    ds = rnd(p * (dp - delta))
    dq = rnd(xp.einsum("bhqk,bhkd->bhqd", ds, k) * scale)
    dk = rnd(xp.einsum("bhqk,bhqd->bhkd", ds, q) * scale)
    return dq, dk, dv


def attention_backward_reference(
    dout, q, k, v, *, causal=False, softmax_scale=None, window_size=(-1, -1), query_chunk=512
):
    """(dq, dk, dv) in float64, the gradients of ``sum(attention(q, k, v) * dout)``.

    Layouts as :func:`attention_reference`; dk and dv have k's shape (summed over the query
    heads of each GQA group). Rows that see no key contribute nothing. Computed
    ``query_chunk`` query rows at a time.
    """
    xp = array_module(q)
    qh, kh, vh, scale = _prepare(q, k, v, softmax_scale, to_float64)
    doh = to_float64(dout).transpose(0, 2, 1, 3)
    mask = visibility_mask(q.shape[1], k.shape[1], causal, window_size, xp)
    dq = xp.empty(qh.shape, dtype=xp.float64)
    dk = xp.zeros(kh.shape, dtype=xp.float64)
    dv = xp.zeros(vh.shape, dtype=xp.float64)
    for start in range(0, q.shape[1], query_chunk):
        rows = slice(start, min(start + query_chunk, q.shape[1]))
        dq[:, :, rows], dk_part, dv_part = _softmax_backward(
            qh[:, :, rows], kh, vh, doh[:, :, rows], scale, mask[rows]
        )
        dk += dk_part
        dv += dv_part
    nheads_k = k.shape[2]
    return (
        dq.transpose(0, 2, 1, 3),
        _sum_groups(dk.transpose(0, 2, 1, 3), nheads_k),
        _sum_groups(dv.transpose(0, 2, 1, 3), nheads_k),
    )


def attention_backward_naive(
    dout, q, k, v, *, causal=False, softmax_scale=None, window_size=(-1, -1)
):
    """The gradients as a plain implementation in the input precision computes them: every
    intermediate (p, dv, dp, ds, dq, dk) rounded to the input dtype, fp32 between roundings,
    GQA sums in fp32. Returns (dq, dk, dv) in the input dtype."""
    xp = array_module(q)
    dtype = q.dtype
    as_f32, rounding = _low_precision(dtype)
    qh, kh, vh, scale = _prepare(q, k, v, softmax_scale, as_f32)
    doh = as_f32(dout).transpose(0, 2, 1, 3)
    mask = visibility_mask(q.shape[1], k.shape[1], causal, window_size, xp)
    dq, dk, dv = _softmax_backward(qh, kh, vh, doh, xp.float32(scale), mask, rounding)
    nheads_k = k.shape[2]
    dk, dv = (_sum_groups(g.transpose(0, 2, 1, 3), nheads_k) for g in (dk, dv))
    return (
        from_float(dq.transpose(0, 2, 1, 3), dtype),
        from_float(dk, dtype),
        from_float(dv, dtype),
    )


class GradCheck(NamedTuple):
    name: str  # "dq", "dk" or "dv"
    err: float  # max |grad - reference|
    bar: float  # 2 * max |naive - reference| + atol
    nan: int

    @property
    def ok(self):
        return self.nan == 0 and self.err <= self.bar


def _rounding_atol(ref, dtype):
    """flash-attn's absolute slack for a gradient: twice the rounding step of the dtype at the
    gradient's magnitude, measured as |round(ref + 0.3) - 0.3 - ref|."""
    shifted = to_float64(from_float(ref + 0.3, dtype)) - 0.3
    return 2 * _max_abs(shifted - ref)


def check_backward(
    dout, q, k, v, dq, dk, dv, *, causal=False, softmax_scale=None, window_size=(-1, -1)
):
    """(GradCheck for dq, dk, dv): each gradient against the float64 reference, under twice the
    naive same-precision error plus the dtype's rounding slack (flash-attn's test bar)."""
    xp = array_module(q)
    kw = dict(causal=causal, window_size=window_size, softmax_scale=softmax_scale)
    refs = attention_backward_reference(dout, q, k, v, **kw)
    naives = attention_backward_naive(dout, q, k, v, **kw)
    dtype = q.dtype
    results = []
    for name, grad, ref, naive in zip(("dq", "dk", "dv"), (dq, dk, dv), refs, naives):
        grad64 = to_float64(grad)
        atol = max(_rounding_atol(ref, dtype), ATOL[dtype_name(dtype)])
        bar = 2 * _max_abs(to_float64(naive) - ref) + atol
        results.append(GradCheck(name, _max_abs(grad64 - ref), bar, int(xp.isnan(grad64).sum())))
    return tuple(results)
