"""Calls from several Python threads, each on its own CuPy stream, and on either of two GPUs."""

import threading

import numpy as np
import pytest
from support import random_array, random_qkv, xp

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
    results, errors = {}, []

    def run(index):
        try:
            with xp.cuda.Stream(non_blocking=True) as stream:
                for _ in range(CALLS):
                    last = _call(*problems[index])
                stream.synchronize()
            results[index] = _bits(last)
        except Exception as exc:  # reported below, with the thread's index
            errors.append((index, exc))

    threads = [threading.Thread(target=run, args=(i,)) for i in range(THREADS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    for index, problem in enumerate(problems):
        serial = _bits(_call(*problem))
        for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), results[index], serial):
            assert (a == b).all(), f"thread {index}: {name} differs from the serial call"


@pytest.mark.skipif(SIMULATOR or xp.cuda.runtime.getDeviceCount() < 2, reason="needs two GPUs")
def test_either_device_runs_its_own_arrays_and_refuses_the_other():
    with xp.cuda.Device(0):
        q0, k0, v0 = random_qkv(1, 130, 130, 2, 1, 64, "float16")
        expected = _bits([numflash.attention(q0, k0, v0, causal=True)])
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
                numflash.attention(q1, k1, v1, out=xp.empty_like(q0))
