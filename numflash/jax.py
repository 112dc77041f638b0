"""numflash inside JAX: ``jax.jit`` and ``jax.grad`` through ``buffer_callback`` (JAX >= 0.6.1).

``attention(q, k, v, ...)`` takes JAX arrays (batch, seqlen, heads, head_dim) and returns
JAX arrays, traceable: inside ``jax.jit`` it becomes one ``jax.experimental.buffer_callback``
whose Python runs numflash's kernels on XLA's own buffers, and under ``jax.grad`` its
``jax.custom_vjp`` saves out and lse and runs numflash's backward the same way. On a GPU the
kernels run on XLA's CUDA stream (``ctx.stream``; no copy of the inputs, no host
synchronisation); in Numba's CUDA simulator, with JAX's CPU backend, the buffers are NumPy
arrays and the same code runs there (that is how CI tests it).

The lse returned with ``return_lse=True`` is not differentiable (it goes through
``jax.lax.stop_gradient``): a loss that uses it gets no gradient through it, as in flash-attn.
Under ``jax.vmap`` the vmapped axes join the batch dimension: one launch for all of them
(slice by slice for a call with sinks or ALiBi slopes, which the three functions take as JAX
arrays: the sinks differentiable, the slopes not).
``attention_varlen`` does the same for packed batches (offsets as int32 JAX arrays, the max
lengths static); ``attention_with_kvcache`` appends to caches aliased in and out (donated, they
are updated in place). On a GPU the kernels must be compiled before XLA records a command
buffer (a first call outside one does it).
"""

import contextlib
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.buffer_callback import buffer_callback

from . import api
from .kernels.jit import SIMULATOR

__all__ = ["attention", "attention_varlen", "attention_with_kvcache"]


#: CuPy views of XLA buffers by (address, shape, dtype): a jitted program hands its
#: callbacks the same buffers step after step, and making the views anew was most of a small
#: decoding step's host time (docs/performance.md, "numflash inside jax.jit"). A view owns
#: nothing: it is used only inside a callback handed a buffer at its address, valid then.
_views = {}
#: Views kept at most; past it the cache starts again.
MAX_VIEWS = 1024


def _array(buffer):
    """An XLA buffer as the array numflash takes: NumPy on the CPU (the simulator), CuPy on a
    GPU (its memory, not a copy: the buffer's dtype kept, bf16 included)."""
    if SIMULATOR:
        return np.asarray(buffer)
    pointer = buffer.__cuda_array_interface__["data"][0]
    key = (pointer, tuple(buffer.shape), buffer.dtype)
    view = _views.get(key)
    if view is None:
        import cupy

        dtype = np.dtype(buffer.dtype)
        nbytes = math.prod(key[1]) * dtype.itemsize
        memory = cupy.cuda.UnownedMemory(pointer, nbytes, None)
        view = cupy.ndarray(key[1], dtype=dtype, memptr=cupy.cuda.MemoryPointer(memory, 0))
        if len(_views) >= MAX_VIEWS:
            _views.clear()
        _views[key] = view
    return view


def _flat(array, trailing):
    """``array`` with every leading dimension beyond its ``trailing`` last ones folded into
    one: the batch axes ``jax.vmap`` adds (buffer_callback's "broadcast_all" hands every
    input and output the vmapped axes in front) join the batch dimension."""
    return array.reshape((-1,) + array.shape[array.ndim - trailing :])


class _StreamHandle:
    """A CUDA stream pointer in the ``__cuda_stream__`` protocol (CuPy 14's from_external)."""

    def __init__(self, pointer):
        self.pointer = pointer

    def __cuda_stream__(self):
        return (0, self.pointer)


#: CuPy's view of each XLA stream a callback has run on, by pointer: made once, not per call
#: (XLA keeps its streams for the life of its client; the view owns nothing).
_xla_streams = {}


def _on_xla_stream(ctx):
    """CuPy's current stream made XLA's for the callback (nothing to do in the simulator)."""
    if SIMULATOR:
        return contextlib.nullcontext()
    stream = _xla_streams.get(ctx.stream)
    if stream is None:
        import cupy

        if hasattr(cupy.cuda.Stream, "from_external"):  # CuPy 14; ExternalStream before it
            stream = cupy.cuda.Stream.from_external(_StreamHandle(ctx.stream))
        else:
            stream = cupy.cuda.ExternalStream(ctx.stream)
        stream = _xla_streams.setdefault(ctx.stream, stream)
    return stream


def _keywords(causal, scale, window, softcap, buffers, given):
    """The keywords a callback passes numflash: its static options, and the sinks and ALiBi
    slopes from its trailing ``buffers`` (those of the two ``given`` says the call has, in
    that order; None for the others)."""
    buffers = iter(buffers)
    sinks, slopes = (_array(next(buffers)) if present else None for present in given)
    return dict(causal=causal, softmax_scale=scale, window_size=window, softcap=softcap,
                sinks=sinks, alibi_slopes=slopes)  # fmt: skip


def _backward_into(ctx, outs, backward, arrays, keywords, fold):
    """``backward(*arrays, **keywords)`` on XLA's stream, each gradient written into its
    output buffer: dq, dk and dv (with ``fold``, the vmapped axes folded into their batch
    dimension), then dsinks where the call has sinks."""
    with _on_xla_stream(ctx):
        for buffer, grad in zip(outs, backward(*arrays, **keywords)):
            target = _array(buffer)
            (_flat(target, 3) if fold and grad.ndim == 4 else target)[...] = grad


@functools.lru_cache(maxsize=256)  # one callable per options: JAX caches by the callable
def _forward_callback(options, given=(False, False)):
    causal, scale, window, softcap = options

    def callback(ctx, outs, q, k, v, *variants):
        out, lse = _flat(_array(outs[0]), 3), _flat(_array(outs[1]), 2)
        keywords = _keywords(causal, scale, window, softcap, variants, given)
        with _on_xla_stream(ctx):
            _, got = api.attention(*(_flat(_array(x), 3) for x in (q, k, v)), return_lse=True,
                                   out=out, **keywords)  # fmt: skip
            lse[...] = got

    return callback


@functools.lru_cache(maxsize=256)
def _backward_callback(options, given=(False, False)):
    causal, scale, window, softcap = options

    def callback(ctx, outs, dout, q, k, v, out, lse, *variants):
        arrays = (*(_flat(_array(b), 3) for b in (dout, q, k, v, out)), _flat(_array(lse), 2))
        keywords = _keywords(causal, scale, window, softcap, variants, given)
        _backward_into(ctx, outs, api.attention_backward, arrays, keywords, fold=True)

    return callback


#: Under jax.vmap every input and output gets the vmapped axes in front (the callbacks fold
#: them into the batch dimension: one launch for the whole vmapped batch).
_VMAP = "broadcast_all"


def _shape(x, dtype=None):
    return jax.ShapeDtypeStruct(x.shape, dtype or x.dtype)


def _vmap_method(variants):
    """How a call's callbacks run under jax.vmap: folded into the batch, or with sinks or
    slopes (one set a call, which a vmapped axis may vary) one vmapped slice at a time."""
    return _VMAP if all(x is None for x in variants) else "sequential"


def _present(variants):
    return tuple(x for x in variants if x is not None)


def _given(variants):
    return tuple(x is not None for x in variants)


def _forward(q, k, v, variants, options):
    lse = jax.ShapeDtypeStruct((q.shape[0], q.shape[2], q.shape[1]), jnp.float32)
    callback = _forward_callback(options, _given(variants))
    call = buffer_callback(callback, (_shape(q), lse), vmap_method=_vmap_method(variants))
    return call(q, k, v, *_present(variants))


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _attention(q, k, v, variants, options):
    return _forward(q, k, v, variants, options)


def _attention_fwd(q, k, v, variants, options):
    out, lse = _forward(q, k, v, variants, options)
    return (out, lse), (q, k, v, variants, out, lse)


def _variant_cotangents(variants, dsinks):
    """The cotangents of (sinks, alibi_slopes): dsinks where there are sinks, zeros for the
    slopes (not differentiated, as in flash-attn), None for what the call did not take."""
    sinks, slopes = variants
    return (None if sinks is None else dsinks, None if slopes is None else jnp.zeros_like(slopes))


def _attention_bwd(options, saved, cotangents):
    q, k, v, variants, out, lse = saved
    dout = cotangents[0]  # lse's cotangent is zero: the public function stops its gradient
    shapes = (_shape(q), _shape(k), _shape(v))
    shapes += () if variants[0] is None else (_shape(variants[0]),)  # dsinks
    callback = _backward_callback(options, _given(variants))
    call = buffer_callback(callback, shapes, vmap_method=_vmap_method(variants))
    grads = call(dout, q, k, v, out, lse, *_present(variants))
    dsinks = grads[3] if len(grads) > 3 else None
    return (*grads[:3], _variant_cotangents(variants, dsinks))


_attention.defvjp(_attention_fwd, _attention_bwd)


def _static(softmax_scale, window_size, softcap):
    """The static options every call takes, as Python values (scale, window, softcap; the
    softcap as given: numflash checks it when the call runs, as the others)."""
    scale = None if softmax_scale is None else float(softmax_scale)
    return scale, tuple(int(w) for w in window_size), softcap


def _variants(sinks, alibi_slopes):
    """(sinks, alibi_slopes) as the callbacks take them: float32 JAX arrays or None; the
    slopes outside differentiation."""
    sinks = None if sinks is None else jnp.asarray(sinks, jnp.float32)
    if alibi_slopes is not None:
        alibi_slopes = jax.lax.stop_gradient(jnp.asarray(alibi_slopes, jnp.float32))
    return sinks, alibi_slopes


def attention(
    q, k, v, *, causal=False, softmax_scale=None, window_size=(-1, -1), return_lse=False,
    softcap=0.0, sinks=None, alibi_slopes=None,
):  # fmt: skip
    """:func:`numflash.attention` on JAX arrays, usable inside ``jax.jit`` and differentiable
    with ``jax.grad`` (q, k, v and the sinks; the lse is not differentiable). Same arguments
    and semantics: q (batch, seqlen_q, heads, head_dim), k and v (batch, seqlen_k, heads_k,
    head_dim), float16 or bfloat16 on a GPU; returns out, and with ``return_lse`` the lse
    (batch, heads, seqlen_q, float32); ``softcap`` (a Python number, static) caps the scores
    in the forward and the gradients. ``sinks`` (heads,) and ``alibi_slopes`` (heads,) or
    (batch, heads): JAX arrays, taken as float32; the sinks get their gradient, the slopes
    none. Under ``jax.vmap`` a call with either runs a launch per vmapped slice. Bad
    arguments raise when the call runs (inside the callback under jit)."""
    scale, window, softcap = _static(softmax_scale, window_size, softcap)
    variants = _variants(sinks, alibi_slopes)
    out, lse = _attention(q, k, v, variants, (bool(causal), scale, window, softcap))
    return (out, jax.lax.stop_gradient(lse)) if return_lse else out


# -- packed batches ---------------------------------------------------------------------------


@functools.lru_cache(maxsize=256)
def _varlen_forward_callback(options, given=(False, False)):
    causal, scale, window, max_q, max_k, softcap = options

    def callback(ctx, outs, q, k, v, cu_q, cu_k, *variants):
        out, lse = (_array(b) for b in outs)
        keywords = _keywords(causal, scale, window, softcap, variants, given)
        with _on_xla_stream(ctx):
            _, got = api.attention_varlen(
                *(_array(x) for x in (q, k, v, cu_q, cu_k)), max_q, max_k, return_lse=True,
                out=out, **keywords,
            )  # fmt: skip
            lse[...] = got

    return callback


@functools.lru_cache(maxsize=256)
def _varlen_backward_callback(options, given=(False, False)):
    causal, scale, window, max_q, max_k, softcap = options

    def callback(ctx, outs, dout, q, k, v, out, lse, cu_q, cu_k, *variants):
        arrays = (*(_array(x) for x in (dout, q, k, v, out, lse, cu_q, cu_k)), max_q, max_k)
        keywords = _keywords(causal, scale, window, softcap, variants, given)
        _backward_into(ctx, outs, api.attention_varlen_backward, arrays, keywords, fold=False)

    return callback


def _varlen_forward(q, k, v, cu_q, cu_k, variants, options):
    lse = jax.ShapeDtypeStruct((q.shape[1], q.shape[0]), jnp.float32)
    # a packed batch has no batch axis to fold a vmapped one into: slices run one by one
    callback = _varlen_forward_callback(options, _given(variants))
    call = buffer_callback(callback, (_shape(q), lse), vmap_method="sequential")
    return call(q, k, v, cu_q, cu_k, *_present(variants))


@functools.partial(jax.custom_vjp, nondiff_argnums=(6,))
def _attention_varlen(q, k, v, cu_q, cu_k, variants, options):
    return _varlen_forward(q, k, v, cu_q, cu_k, variants, options)


def _attention_varlen_fwd(q, k, v, cu_q, cu_k, variants, options):
    out, lse = _varlen_forward(q, k, v, cu_q, cu_k, variants, options)
    return (out, lse), (q, k, v, out, lse, cu_q, cu_k, variants)


def _attention_varlen_bwd(options, saved, cotangents):
    q, k, v, out, lse, cu_q, cu_k, variants = saved
    shapes = (_shape(q), _shape(k), _shape(v))
    shapes += () if variants[0] is None else (_shape(variants[0]),)  # dsinks
    callback = _varlen_backward_callback(options, _given(variants))
    call = buffer_callback(callback, shapes, vmap_method="sequential")
    grads = call(cotangents[0], q, k, v, out, lse, cu_q, cu_k, *_present(variants))
    dsinks = grads[3] if len(grads) > 3 else None
    # the offsets are integers: no cotangent
    return (*grads[:3], None, None, _variant_cotangents(variants, dsinks))


_attention_varlen.defvjp(_attention_varlen_fwd, _attention_varlen_bwd)


def attention_varlen(
    q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *, causal=False,
    softmax_scale=None, window_size=(-1, -1), return_lse=False, softcap=0.0, sinks=None,
    alibi_slopes=None,
):  # fmt: skip
    """:func:`numflash.attention_varlen` on JAX arrays, under ``jax.jit`` and ``jax.grad``:
    q (total_q, heads, head_dim), k and v (total_k, heads_k, head_dim), ``cu_seqlens_*`` int32
    JAX arrays (batch + 1,), ``max_seqlen_*`` Python ints (static: they size the launch).
    Returns out, and with ``return_lse`` the lse (heads, total_q), not differentiable;
    ``softcap``, ``sinks`` and ``alibi_slopes`` ((heads,) or (batch, heads)) as
    :func:`attention`'s."""
    scale, window, softcap = _static(softmax_scale, window_size, softcap)
    options = (bool(causal), scale, window, int(max_seqlen_q), int(max_seqlen_k), softcap)
    variants = _variants(sinks, alibi_slopes)
    out, lse = _attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, variants, options)
    return (out, jax.lax.stop_gradient(lse)) if return_lse else out


# -- the KV cache -----------------------------------------------------------------------------


@functools.lru_cache(maxsize=256)
def _kvcache_callback(options, appends, paged, given=(False, False)):
    causal, scale, window, softcap = options

    def callback(ctx, outs, q, k_cache, v_cache, *rest):
        # the caches' outputs alias their inputs (input_output_aliases): the append and the
        # attention work on the output buffers, which hold the caches
        out, k_out, v_out = (_array(b) for b in outs)
        rest = list(rest)
        k, v = (_array(rest.pop(0)), _array(rest.pop(0))) if appends else (None, None)
        seqlens = _array(rest.pop(0))
        block_table = _array(rest.pop(0)) if paged else None
        keywords = _keywords(causal, scale, window, softcap, rest, given)  # the variants left
        with _on_xla_stream(ctx):
            api.attention_with_kvcache(
                _array(q), k_out, v_out, k, v, cache_seqlens=seqlens, block_table=block_table,
                out=out, **keywords,
            )  # fmt: skip

    return callback


def attention_with_kvcache(
    q, k_cache, v_cache, k=None, v=None, *, cache_seqlens, block_table=None, causal=False,
    softmax_scale=None, window_size=(-1, -1), softcap=0.0, sinks=None, alibi_slopes=None,
):  # fmt: skip
    """:func:`numflash.attention_with_kvcache` on JAX arrays, under ``jax.jit`` (not
    differentiable: inference). Returns ``(out, k_cache, v_cache)``: the caches with k and v
    appended at ``cache_seqlens`` (an int32 JAX array (batch,)), as outputs aliased to the
    caches given, so that with donated caches (``jax.jit(..., donate_argnums=...)``, or the
    carry of ``jax.lax.fori_loop`` / ``scan``) a decoding step appends in place without
    copying them. Contiguous caches (batch, seqlen_cache, heads_k, head_dim) or paged ones
    with ``block_table`` (batch, max_blocks) int32; ``softcap``, ``sinks`` and
    ``alibi_slopes`` as :func:`attention`'s (gpt-oss: sinks and a 128-key window)."""
    options = (bool(causal), *_static(softmax_scale, window_size, softcap))
    variants = _variants(sinks, alibi_slopes)
    appends, paged = k is not None, block_table is not None
    if appends != (v is not None):
        raise ValueError("attention_with_kvcache: give k and v together, or neither")
    args = [q, k_cache, v_cache] + ([k, v] if appends else [])
    args += [jnp.asarray(cache_seqlens, jnp.int32)] + ([block_table] if paged else [])
    args += _present(variants)
    shapes = (_shape(q), _shape(k_cache), _shape(v_cache))
    call = buffer_callback(
        _kvcache_callback(options, appends, paged, _given(variants)), shapes,
        vmap_method="sequential", input_output_aliases={1: 1, 2: 2},
    )  # fmt: skip
    return call(*args)
