"""Calls from several Python threads, each on its own CuPy stream, and on either of two GPUs."""

import numpy as np
import pytest
from support import random_array, random_qkv, run_on_streams, xp

import numflash
from numflash.kernels.jit import SIMULATOR

pytestmark = pytest.mark.gpu

THREADS = 8
CALLS = 50


def _work(seed):
    """A thread's problem: forward then backward, at a head_dim no other test compiles (so the
    threads race to build the same kernels)."""
    q, k, v = random_qkv(1, 200 + seed, 200, 4, 2, 72, "bfloat16" if seed % 2 else "float16")
    dout = random_array(q.shape, q.dtype)
    return q, k, v, dout


def _call(q, k, v, dout):
    out, lse = numflash.attention(q, k, v, causal=True, return_lse=True)
    return (out, lse, *numflash.attention_backward(dout, q, k, v, out, lse, causal=True))


def _bits(results):
    return [np.asarray(x.view(xp.uint8).get()) for x in results]


def test_threads_on_their_own_streams_equal_serial_calls():
    problems = [_work(seed) for seed in range(THREADS)]
    xp.cuda.Device().synchronize()

    def run(index):
        for _ in range(CALLS):
            last = _call(*problems[index])
        return last

    results = {i: _bits(last) for i, last in run_on_streams(THREADS, run).items()}
    for index, problem in enumerate(problems):
        serial = _bits(_call(*problem))
        for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), results[index], serial):
            assert (a == b).all(), f"thread {index}: {name} differs from the serial call"


@pytest.mark.skipif(SIMULATOR or xp.cuda.runtime.getDeviceCount() < 2, reason="needs two GPUs")
def test_either_device_runs_its_own_arrays_and_refuses_the_other():
    with xp.cuda.Device(0):
        q0, k0, v0 = random_qkv(1, 130, 130, 2, 1, 64, "float16")
        expected = _bits([numflash.attention(q0, k0, v0, causal=True)])
        out0 = xp.empty_like(q0)  # empty_like allocates on the current device, not q0's
    with xp.cuda.Device(1):
        q1, k1, v1 = (xp.asarray(x) for x in (q0, k0, v0))  # copies on device 1
        assert q1.device.id == 1
    for current in (0, 1):
        with xp.cuda.Device(current):
            out1 = numflash.attention(q1, k1, v1, causal=True)
            assert out1.device.id == 1
            assert (_bits([out1])[0] == expected[0]).all()
            with pytest.raises(ValueError, match="q, k and v must be on the same GPU"):
                numflash.attention(q0, k1, v1)
            with pytest.raises(ValueError, match="out is on device 0 but q is on 1"):
                numflash.attention(q1, k1, v1, out=out0)


def _decode_step(q, k_cache, v_cache, k, v, lengths, table):
    return numflash.attention_with_kvcache(
        q, k_cache, v_cache, k, v, cache_seqlens=lengths, block_table=table, return_lse=True
    )


@pytest.mark.skipif(SIMULATOR or xp.cuda.runtime.getDeviceCount() < 2, reason="needs two GPUs")
def test_backward_and_kvcache_on_the_other_device_repeat_bitwise():
    """Repeated calls (the second and later replay a plan) on device 1's arrays, with either
    device current, give device 0's bits: a plan never launches on the wrong device."""
    with xp.cuda.Device(0):
        q, k, v = random_qkv(1, 150, 150, 4, 2, 64, "bfloat16")
        dout = random_array(q.shape, q.dtype)
        qd = random_qkv(3, 1, 1, 8, 2, 128, "float16")[0]
        k_cache, v_cache = random_qkv(40, 16, 16, 2, 2, 128, "float16")[1:]
        k_new, v_new = random_qkv(3, 1, 1, 2, 2, 128, "float16")[1:]
        table = xp.arange(38, -1, -1, dtype=xp.int32).reshape(3, 13)  # 39 of the 40 pages
        lengths = xp.asarray(np.array([5, 100, 190], np.int32))
        inputs = (q, k, v, dout, qd, k_cache, v_cache, k_new, v_new, table, lengths)
        fresh = [x.copy() for x in (k_cache, v_cache)]  # each step appends in place
        expected = _bits(
            _call(q, k, v, dout) + _decode_step(qd, *fresh, k_new, v_new, lengths, table)
        )
    with xp.cuda.Device(1):
        q, k, v, dout, qd, k_cache, v_cache, k_new, v_new, table, lengths = (
            xp.asarray(x) for x in inputs
        )
    for current in (0, 1, 0, 1):
        with xp.cuda.Device(1):
            fresh = [x.copy() for x in (k_cache, v_cache)]  # copy() allocates on the current one
        with xp.cuda.Device(current):
            got = _call(q, k, v, dout) + _decode_step(qd, *fresh, k_new, v_new, lengths, table)
            assert all(x.device.id == 1 for x in got)
            for name, a, b in zip(
                ("out", "lse", "dq", "dk", "dv", "kv out", "kv lse"), _bits(got), expected
            ):
                assert (a == b).all(), f"{name} differs with device {current} current"
