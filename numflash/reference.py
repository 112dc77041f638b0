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


class Variants(NamedTuple):
    """The changes to the scores and the mask that attention variants make, as the reference
    applies them to a score ``s = softmax_scale * q.k``, in this order:

    - ``softcap`` > 0: ``s = softcap * tanh(s / softcap)`` (0: none);
    - ``alibi_slopes``, (nheads,) or (batch, nheads): ``s -= slope * |q_idx - kv_idx|``;
    - ``score_mod(s, b, h, q_idx, kv_idx, *mod_args)``: a Numba device function (its Python
      function runs here) or a plain one; ``score_mod_derivative`` the derivative of it with
      respect to ``s`` at the same arguments (the backward needs it);
    - ``mask_mod(b, h, q_idx, kv_idx, *mod_args)``: a key is seen where it is True and the
      causal / window mask lets it be;
    - ``sinks``, (nheads,): one logit a head that joins each row's softmax denominator with no
      value: out = sum_j e^{s_j} v_j / (sum_j e^{s_j} + e^{sink}), lse the log of that whole
      denominator; a row that sees no key gets out 0 and lse = sink.

    ``q_idx`` is the query's position among the keys (row + seqlen_k - seqlen_q, as the
    causal mask aligns it), ``kv_idx`` the key's; ``mod_args`` are arrays passed to both
    functions after the indices."""

    softcap: float = 0.0
    alibi_slopes: object = None
    sinks: object = None
    score_mod: object = None
    score_mod_derivative: object = None
    mask_mod: object = None
    mod_args: tuple = ()


def _host(x):
    """A NumPy copy of a CuPy array (``x`` itself otherwise)."""
    return x if isinstance(x, np.ndarray) or not hasattr(x, "get") else x.get()


def _elementwise(fn, grids, mod_args, otype):
    """``fn(*element, *mod_args)`` of each element of the broadcast ``grids``, on the host: a
    Numba device function runs as its Python function."""
    fn = getattr(fn, "py_func", fn)
    args = tuple(_host(a) for a in mod_args)
    call = np.vectorize(lambda *element: fn(*element, *args), otypes=[otype])
    return call(*np.broadcast_arrays(*(_host(g) for g in grids)))


class _Mods:
    """A call's :class:`Variants` over the scores of query rows ``rows`` (a slice) of every
    batch and head: shapes (b, h, rows, seqlen_k)."""

    def __init__(self, variants, batch, nheads, rows, seqlen_q, seqlen_k, xp):
        self.v = variants
        self.xp = xp
        offset = seqlen_k - seqlen_q
        self.grids = (
            np.arange(batch)[:, None, None, None],
            np.arange(nheads)[None, :, None, None],
            np.arange(rows.start + offset, rows.stop + offset)[None, None, :, None],
            np.arange(seqlen_k)[None, None, None, :],
        )
        self.mask = None
        if variants.mask_mod is not None:
            self.mask = xp.asarray(
                _elementwise(variants.mask_mod, self.grids, variants.mod_args, bool)
            )
        self.sink = None
        if variants.sinks is not None:
            self.sink = xp.asarray(_host(variants.sinks), dtype=xp.float64)[None, :, None, None]

    def scores(self, s, derivative=False):
        """(the modified scores, their derivative by ``s`` or None) of scores ``s``."""
        xp, v = self.xp, self.v
        slope = 1.0
        if v.softcap:
            t = xp.tanh(s / v.softcap)
            s = v.softcap * t
            slope = 1.0 - t * t
        if v.alibi_slopes is not None:
            slopes = xp.asarray(_host(v.alibi_slopes), dtype=xp.float64)
            slopes = slopes[None, :] if slopes.ndim == 1 else slopes
            distance = xp.asarray(np.abs(self.grids[2] - self.grids[3]))
            s = s - slopes[:, :, None, None] * distance
        if v.score_mod is not None:
            grids = (_host(s), *self.grids)
            if derivative:
                if v.score_mod_derivative is None:
                    raise ValueError("score_mod_derivative is needed for the gradients")
                d = _elementwise(v.score_mod_derivative, grids, v.mod_args, np.float64)
                slope = slope * xp.asarray(d)
            s = xp.asarray(_elementwise(v.score_mod, grids, v.mod_args, np.float64))
        return s, (slope if derivative else None)


def _mods(variants, q, rows, seqlen_k):
    """The :class:`_Mods` of ``variants`` over query rows ``rows`` of (b, h, s, d) ``q``, None
    for a call without variants."""
    if variants is None or not (
        variants.softcap
        or any(
            x is not None
            for x in (variants.alibi_slopes, variants.sinks, variants.score_mod, variants.mask_mod)
        )
    ):
        return None
    b, h, seqlen_q, _ = q.shape
    return _Mods(variants, b, h, rows, seqlen_q, seqlen_k, array_module(q))


def _row_softmax(scores, mods):
    """(p, finite row max, denominator, whether the row has one) of masked ``scores``: p =
    e^{s - max}, the denominator their sum plus a sink's e^{sink - max}."""
    xp = array_module(scores)
    row_max = scores.max(axis=-1, keepdims=True)
    sink = None if mods is None else mods.sink
    if sink is not None:
        row_max = xp.maximum(row_max, sink.astype(scores.dtype))
    finite_max = xp.where(xp.isfinite(row_max), row_max, 0.0)
    p = xp.exp(scores - finite_max)
    denominator = p.sum(axis=-1, keepdims=True)
    if sink is not None:
        denominator = denominator + xp.exp(sink.astype(scores.dtype) - finite_max)
    return p, finite_max, denominator, denominator > 0


def _modified(q, k, scale, mask, mods, rnd, derivative=False):
    """(masked scores, mask, derivative of the scores by q.k * scale or None)."""
    xp = array_module(q)
    scores = rnd(xp.einsum("bhqd,bhkd->bhqk", q, k) * scale)
    slope = None
    if mods is not None:
        scores, slope = mods.scores(scores, derivative)
        scores = rnd(scores.astype(q.dtype))
        if mods.mask is not None:
            mask = mask & mods.mask
    return xp.where(mask, scores, -xp.inf), mask, slope


def _softmax_attention(q, k, v, scale, mask, rounding=None, mods=None):
    """Attention over float arrays of layout (b, h, s, d); ``rounding`` is applied after each
    op; ``mods``: the call's :class:`_Mods` over these rows, if any."""
    xp = array_module(q)
    rnd = rounding or (lambda a: a)
    scores, _, _ = _modified(q, k, scale, mask, mods, rnd)
    p, finite_max, denominator, seen = _row_softmax(scores, mods)
    probs = rnd(p / xp.where(seen, denominator, 1.0))
    out = rnd(xp.einsum("bhqk,bhkd->bhqd", probs, v))
    lse = xp.where(seen, finite_max + xp.log(xp.where(seen, denominator, 1.0)), -xp.inf)[..., 0]
    return out, lse


def _prepare(q, k, v, softmax_scale, convert):
    nheads = q.shape[2]
    scale = 1.0 / math.sqrt(q.shape[-1]) if softmax_scale is None else float(softmax_scale)
    qh = convert(q).transpose(0, 2, 1, 3)
    kh = convert(_expand_kv(k, nheads)).transpose(0, 2, 1, 3)
    vh = convert(_expand_kv(v, nheads)).transpose(0, 2, 1, 3)
    return qh, kh, vh, scale


def attention_reference(
    q, k, v, *, causal=False, softmax_scale=None, window_size=(-1, -1), query_chunk=1024,
    variants=None,
):  # fmt: skip
    """(out, lse) in float64: out (batch, seqlen_q, nheads, head_dim), lse (batch, nheads, seqlen_q).

    Computed ``query_chunk`` query rows at a time so that long sequences fit in memory.
    ``variants``: the call's :class:`Variants`, if any.
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
            qh[:, :, rows], kh, vh, scale, mask[rows], mods=_mods(variants, qh, rows, seqlen_k)
        )
    return out.transpose(0, 2, 1, 3), lse


def _low_precision(dtype):
    """(to fp32, round through ``dtype`` and back to fp32): how the naive versions compute."""

    def rounding(a):
        return to_float32(from_float(a, dtype))

    return to_float32, rounding


def attention_naive(
    q, k, v, *, causal=False, softmax_scale=None, window_size=(-1, -1), variants=None
):
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
    mods = _mods(variants, qh, slice(0, q.shape[1]), k.shape[1])
    out, lse = _softmax_attention(qh, kh, vh, xp.float32(scale), mask, rounding, mods)
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


def check(
    q, k, v, out, lse=None, *, causal=False, softmax_scale=None, window_size=(-1, -1),
    variants=None,
):  # fmt: skip
    """How far ``out`` (and ``lse``) are from the float64 reference, against that bar.

    The bar is twice the error of :func:`attention_naive` (the same attention computed plainly
    in the input precision) plus ``ATOL``; LSE rows without keys must be -inf on both sides.
    """
    xp = array_module(q)
    kw = dict(causal=causal, window_size=window_size, softmax_scale=softmax_scale)
    kw.update(variants=variants)
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


def _softmax_backward(q, k, v, dout, scale, mask, rounding=None, mods=None):
    """(dq, dk, dv, dsinks or None) over float arrays of layout (b, h, s, d); ``rounding`` after
    each op; ``mods``: the call's :class:`_Mods` over these rows, if any.

    p = softmax(s) over the visible keys (a sink in the denominator), s the scores q k^T *
    scale as the variants change them; dv = p^T dout; dp = dout v^T; ds = p * (dp - delta);
    the gradient by q k^T * scale is ds times the derivative of the variants' change (softcap:
    1 - tanh^2, ALiBi: 1, score_mod: its derivative); dq = that k * scale, dk = its^T q *
    scale; a sink's gradient -sum_rows e^{sink - lse} delta. delta = rowsum(dp * p) exactly;
    with ``rounding`` it is rowsum(dout * out) from the rounded output, the formula
    FlashAttention's backward uses (its error dominates when a row's softmax is peaked on few
    keys, so a naive bar without it is narrower than the algorithm can meet).
    """
    xp = array_module(q)
    rnd = rounding or (lambda a: a)
    scores, mask, slope = _modified(q, k, scale, mask, mods, lambda a: a, derivative=True)
    p, finite_max, denominator, seen = _row_softmax(scores, mods)
    p = rnd(p / xp.where(seen, denominator, 1.0))
    dv = rnd(xp.einsum("bhqk,bhqd->bhkd", p, dout))
    dp = rnd(xp.einsum("bhqd,bhkd->bhqk", dout, v))
    if rounding is None:
        delta = (p * dp).sum(axis=-1, keepdims=True)
    else:  # as FlashAttention's backward: from the output as stored, in the input dtype
        out = rnd(xp.einsum("bhqk,bhkd->bhqd", p, v))
        delta = (dout * out).sum(axis=-1, keepdims=True)
    ds = rnd(p * (dp - delta))
    if slope is not None:
        ds = rnd(xp.where(mask, ds * slope, 0.0))
    dq = rnd(xp.einsum("bhqk,bhkd->bhqd", ds, k) * scale)
    dk = rnd(xp.einsum("bhqk,bhqd->bhkd", ds, q) * scale)
    dsinks = None
    if mods is not None and mods.sink is not None:
        lse = finite_max + xp.log(xp.where(seen, denominator, 1.0))
        weight = xp.exp(mods.sink.astype(q.dtype) - lse)  # every row has a denominator
        dsinks = -(weight * delta).sum(axis=(0, 2, 3))
    return dq, dk, dv, dsinks


def attention_backward_reference(
    dout, q, k, v, *, causal=False, softmax_scale=None, window_size=(-1, -1), query_chunk=512,
    variants=None,
):  # fmt: skip
    """(dq, dk, dv) in float64, the gradients of ``sum(attention(q, k, v) * dout)``, and with
    ``variants`` holding sinks a fourth, dsinks (nheads,).

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
    dsinks = xp.zeros((q.shape[2],), dtype=xp.float64)
    for start in range(0, q.shape[1], query_chunk):
        rows = slice(start, min(start + query_chunk, q.shape[1]))
        mods = _mods(variants, qh, rows, k.shape[1])
        dq[:, :, rows], dk_part, dv_part, dsinks_part = _softmax_backward(
            qh[:, :, rows], kh, vh, doh[:, :, rows], scale, mask[rows], mods=mods
        )
        dk += dk_part
        dv += dv_part
        if dsinks_part is not None:
            dsinks += dsinks_part
    nheads_k = k.shape[2]
    grads = (
        dq.transpose(0, 2, 1, 3),
        _sum_groups(dk.transpose(0, 2, 1, 3), nheads_k),
        _sum_groups(dv.transpose(0, 2, 1, 3), nheads_k),
    )
    return grads + ((dsinks,) if variants is not None and variants.sinks is not None else ())


def attention_backward_naive(
    dout, q, k, v, *, causal=False, softmax_scale=None, window_size=(-1, -1), variants=None
):
    """The gradients as a plain implementation in the input precision computes them: every
    intermediate (p, dv, dp, ds, dq, dk) rounded to the input dtype, fp32 between roundings,
    GQA sums in fp32. Returns (dq, dk, dv) in the input dtype, and with sinks dsinks in
    float32."""
    xp = array_module(q)
    dtype = q.dtype
    as_f32, rounding = _low_precision(dtype)
    qh, kh, vh, scale = _prepare(q, k, v, softmax_scale, as_f32)
    doh = as_f32(dout).transpose(0, 2, 1, 3)
    mask = visibility_mask(q.shape[1], k.shape[1], causal, window_size, xp)
    mods = _mods(variants, qh, slice(0, q.shape[1]), k.shape[1])
    dq, dk, dv, dsinks = _softmax_backward(qh, kh, vh, doh, xp.float32(scale), mask, rounding, mods)
    nheads_k = k.shape[2]
    dk, dv = (_sum_groups(g.transpose(0, 2, 1, 3), nheads_k) for g in (dk, dv))
    grads = (
        from_float(dq.transpose(0, 2, 1, 3), dtype),
        from_float(dk, dtype),
        from_float(dv, dtype),
    )
    return grads + (() if dsinks is None else (dsinks.astype(xp.float32),))


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
    dout, q, k, v, dq, dk, dv, *, causal=False, softmax_scale=None, window_size=(-1, -1),
    variants=None, dsinks=None,
):  # fmt: skip
    """(GradCheck for dq, dk, dv, and dsinks where given): each gradient
    against the float64 reference, under twice the naive same-precision error plus the
    dtype's rounding slack (flash-attn's test bar)."""
    xp = array_module(q)
    kw = dict(causal=causal, window_size=window_size, softmax_scale=softmax_scale)
    kw.update(variants=variants)
    refs = attention_backward_reference(dout, q, k, v, **kw)
    naives = attention_backward_naive(dout, q, k, v, **kw)
    dtype = q.dtype
    results = []
    names, grads = ("dq", "dk", "dv", "dsinks"), (dq, dk, dv, dsinks)
    for name, grad, ref, naive in zip(names, grads, refs, naives):
        if grad is None:  # dsinks not asked for
            continue
        grad64 = to_float64(grad)
        atol = max(_rounding_atol(ref, dtype), ATOL[dtype_name(dtype)])
        bar = 2 * _max_abs(to_float64(naive) - ref) + atol
        results.append(GradCheck(name, _max_abs(grad64 - ref), bar, int(xp.isnan(grad64).sum())))
    return tuple(results)
