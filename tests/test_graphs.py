"""CUDA graphs: calls captured on a CuPy stream replay with results bitwise equal to eager
calls, including a decoding loop whose cache_seqlens advance on the device between replays."""

import numpy as np
import pytest
from support import random_array, random_qkv, xp

import numflash
from numflash import api

pytestmark = pytest.mark.gpu


def _bits(x):
    return np.asarray(x.view(xp.uint8).get())


def _capture(stream, fn):
    """(graph, what fn returned while captured) after one eager call of fn on ``stream`` (the
    kernels compiled, the memory pool holding blocks of the sizes fn allocates)."""
    with stream:
        fn()
        stream.synchronize()
        stream.begin_capture()
        try:
            result = fn()
        finally:
            graph = stream.end_capture()
    return graph, result


def test_forward_and_backward_replay_bitwise():
    stream = xp.cuda.Stream(non_blocking=True)
    q, k, v = random_qkv(2, 100, 130, 4, 2, 64, "float16")
    dout = random_array(q.shape, "float16")

    def step():
        out, lse = numflash.attention(q, k, v, causal=True, return_lse=True)
        return (out, lse, *numflash.attention_backward(dout, q, k, v, out, lse, causal=True))

    graph, captured = _capture(stream, step)
    graph.launch(stream)
    stream.synchronize()
    eager = step()
    for name, got, want in zip(("out", "lse", "dq", "dk", "dv"), captured, eager):
        assert (_bits(got) == _bits(want)).all(), name


def test_a_decoding_step_replays_with_lengths_advancing_on_the_device():
    stream = xp.cuda.Stream(non_blocking=True)
    rng = np.random.default_rng(5)
    batch, page, pages = 2, 16, 6
    table = xp.asarray(rng.permutation(batch * pages).astype(np.int32).reshape(batch, pages))
    caches = [random_array((batch * pages, page, 2, 128), "float16", rng) for _ in range(2)]
    twins = [c.copy() for c in caches]
    q = random_array((batch, 1, 8, 128), "float16", rng)
    k, v = (random_array((batch, 1, 2, 128), "float16", rng) for _ in range(2))
    lengths = xp.asarray(np.array([3, 50], np.int32))

    def step():
        return numflash.attention_with_kvcache(
            q, *caches, k, v, cache_seqlens=lengths, block_table=table
        )

    graph, out = _capture(stream, step)
    # the warm-up call appended at [3, 50]: the twins and the lengths catch up with it
    with stream:
        api._attention_with_kvcache(
            q, *twins, k, v, lengths, None, table, False, None, (-1, -1), 0, False, None, None
        )
        lengths += 1
    for step_index in range(5):
        with stream:
            for x in (q, k, v):  # new inputs, in the captured arrays
                x[...] = random_array(x.shape, "float16", rng)
            graph.launch(stream)
            want = api._attention_with_kvcache(
                q, *twins, k, v, lengths, None, table, False, None, (-1, -1), 0, False, None, None
            )
            lengths += 1
        stream.synchronize()
        assert (_bits(out) == _bits(want)).all(), f"step {step_index}"
    for c, t in zip(caches, twins):
        assert (_bits(c) == _bits(t)).all()


def test_a_call_without_a_plan_is_refused_under_capture():
    """The first call of a signature would compile and allocate inside the capture: a clear
    error instead, and the capture is left to the caller to end."""
    stream = xp.cuda.Stream(non_blocking=True)
    q, k, v = random_qkv(1, 33, 47, 2, 1, 64, "float16")  # shapes no other test captures
    with stream:
        stream.begin_capture()
        try:
            with pytest.raises(RuntimeError, match="captured into a CUDA graph"):
                numflash.attention(q, k, v, window_size=(5, 5))
        finally:
            stream.end_capture()


def test_calls_with_out_are_captured_and_write_into_it():
    """A serving loop's static buffers: out= given eagerly once, then captured; the graph
    writes into the same out at every replay."""
    stream = xp.cuda.Stream(non_blocking=True)
    rng = np.random.default_rng(8)
    q, k, v = random_qkv(2, 33, 70, 4, 2, 64, "bfloat16")
    caches = [random_array((3, 64, 2, 64), "bfloat16", rng) for _ in range(2)]
    qd = random_array((3, 1, 4, 64), "bfloat16", rng)
    out, out_d = xp.empty_like(q), xp.empty_like(qd)

    def step():
        a = numflash.attention(q, k, v, causal=True, out=out)
        b = numflash.attention_with_kvcache(qd, *caches, cache_seqlens=40, out=out_d)
        return a, b

    graph, (a, b) = _capture(stream, step)
    assert a is out and b is out_d
    with stream:  # a non-blocking stream: the new inputs are written on it, in its order
        for x in (q, qd):
            x[...] = random_array(x.shape, "bfloat16", rng)
        out[...] = 0
        out_d[...] = 0
        graph.launch(stream)
    stream.synchronize()
    want = api._attention(q, k, v, True, None, (-1, -1), False, None, None)
    want_d = api._attention_with_kvcache(
        qd, *caches, None, None, 40, None, None, False, None, (-1, -1), 0, False, None, None
    )
    assert (_bits(out) == _bits(want)).all()
    assert (_bits(out_d) == _bits(want_d)).all()


def test_a_decoding_step_with_sinks_is_captured_and_reads_the_sinks_at_each_launch():
    """gpt-oss's decoding step (sinks, a window) captured; the graph reads the sinks array
    when it runs, so new values written into it count."""
    stream = xp.cuda.Stream(non_blocking=True)
    rng = np.random.default_rng(9)
    caches = [random_array((2, 300, 2, 64), "bfloat16", rng) for _ in range(2)]
    q = random_array((2, 1, 8, 64), "bfloat16", rng)
    sinks = xp.asarray(rng.normal(size=8).astype(np.float32))
    call = dict(cache_seqlens=250, window_size=(127, 0), causal=True, sinks=sinks)

    def step():
        return numflash.attention_with_kvcache(q, *caches, return_lse=True, **call)

    graph, captured = _capture(stream, step)
    with stream:
        sinks[...] = xp.asarray(rng.normal(size=8).astype(np.float32))
        graph.launch(stream)
    stream.synchronize()
    want = api._attention_with_kvcache(q, *caches, None, None, 250, None, None, True, None,
                                       (127, 0), 0, True, None, None, 0.0, sinks)  # fmt: skip
    for name, got, expected in zip(("out", "lse"), captured, want):
        assert (_bits(got) == _bits(expected)).all(), name
