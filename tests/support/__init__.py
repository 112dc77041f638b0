"""Helpers shared by the tests: arrays for the current mode, and the reference checks they assert."""

import threading

import numpy as np

from numflash.arrays import BFLOAT16, from_float, to_float64
from numflash.kernels.jit import SIMULATOR
from numflash.reference import check, check_backward

if SIMULATOR:
    xp = np
else:
    import cupy as xp

DTYPES = {"float16": np.dtype(np.float16), "bfloat16": BFLOAT16, "float32": np.dtype(np.float32)}

_seed = [1234]


def wgmma_or_skip(config):
    """``config``; a pytest skip where it is a wgmma backward configuration and the GPU (or the
    simulated one) has no wgmma."""
    import pytest

    from numflash import WgmmaBackwardConfig
    from numflash.device import current_device

    if isinstance(config, WgmmaBackwardConfig) and not current_device().has_wgmma:
        pytest.skip("wgmma needs compute capability 9.x")
    return config


def fresh_rng():
    """A new generator per call: every check draws inputs nobody has seen before."""
    _seed[0] += 1
    return np.random.default_rng(_seed[0])


def random_array(shape, dtype, rng=None):
    """Standard-normal values rounded to ``dtype``, on the GPU when there is one."""
    rng = rng or fresh_rng()
    values = rng.standard_normal(shape, dtype=np.float32)
    return from_float(xp.asarray(values), DTYPES[dtype] if isinstance(dtype, str) else dtype)


def random_qkv(batch, seqlen_q, seqlen_k, nheads, nheads_k, head_dim, dtype):
    rng = fresh_rng()
    q = random_array((batch, seqlen_q, nheads, head_dim), dtype, rng)
    k = random_array((batch, seqlen_k, nheads_k, head_dim), dtype, rng)
    v = random_array((batch, seqlen_k, nheads_k, head_dim), dtype, rng)
    return q, k, v


def offsets(lengths):
    """The cumulative offsets of a packed batch's sequences of ``lengths``: int32 (n + 1,) on
    the host."""
    return np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)


def packed_qkv(lengths_q, lengths_k, nheads, nheads_k, head_dim, dtype, rng=None):
    """A packed batch: random q (sum(lengths_q), nheads, head_dim), k and v (sum(lengths_k),
    nheads_k, head_dim), and the offsets of both on the device (attention_varlen's cu_seqlens)."""
    rng = rng or fresh_rng()
    q = random_array((sum(lengths_q), nheads, head_dim), dtype, rng)
    k, v = (random_array((sum(lengths_k), nheads_k, head_dim), dtype, rng) for _ in range(2))
    return q, k, v, xp.asarray(offsets(lengths_q)), xp.asarray(offsets(lengths_k))


def poisoned_like(q):
    """An output buffer full of NaN, so an element the kernel forgets to write fails the test."""
    out = xp.empty(q.shape, dtype=q.dtype)
    if q.dtype.itemsize == 2:
        out.view(np.uint16)[...] = 0x7E00 if q.dtype == np.float16 else 0x7FC0
    else:
        out[...] = np.nan
    return out


def to_numpy(x):
    return x if isinstance(x, np.ndarray) else x.get()


def assert_matches_reference(
    q, k, v, out, lse, *, causal=False, window_size=(-1, -1), softmax_scale=None, variants=None
):
    """out and lse against float64 (with ``variants``: numflash.reference.Variants), under 2 x
    the naive same-precision error + ATOL; rows that see no key must give output 0 and lse
    -inf."""
    kw = dict(causal=causal, window_size=window_size, softmax_scale=softmax_scale)
    result = check(q, k, v, out, lse, variants=variants, **kw)
    assert result.nan == 0, f"{result.nan} output elements are NaN"
    assert result.err <= result.bar, f"max |out - ref| = {result.err:.3e} > bar {result.bar:.3e}"
    assert result.lse_err <= result.lse_bar, (
        f"max |lse - ref| = {result.lse_err:.3e} > bar {result.lse_bar:.3e} "
        "(inf: rows without keys must have lse -inf, never NaN)"
    )
    lse = to_numpy(lse)
    assert lse.dtype == np.float32 and lse.shape == (q.shape[0], q.shape[2], q.shape[1])
    empty = np.isneginf(lse)
    if empty.any():
        out64 = to_numpy(to_float64(out))
        rows = np.broadcast_to(empty.transpose(0, 2, 1)[..., None], out64.shape)
        assert (out64[rows] == 0).all(), "rows without keys must output 0"
    return result.err, result.bar


def assert_gradients_match(dout, q, k, v, dq, dk, dv, variants=None, **mask):
    """dq, dk, dv: shapes, dtypes, no NaN, and each under its bar against float64 gradients
    (with ``variants``: numflash.reference.Variants)."""
    assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape
    assert dq.dtype == q.dtype and dk.dtype == k.dtype and dv.dtype == v.dtype
    for result in check_backward(dout, q, k, v, dq, dk, dv, variants=variants, **mask):
        assert result.nan == 0, f"{result.name}: {result.nan} NaN elements"
        assert result.err <= result.bar, (
            f"{result.name}: max |grad - ref| = {result.err:.3e} > bar {result.bar:.3e}"
        )


def run_on_streams(count, body):
    """``{i: body(i)}`` for i < ``count``, each run in a thread of its own on a non-blocking
    CuPy stream of its own (synchronised before the thread ends); fails naming every thread
    that raised, with what it raised."""
    results, errors = {}, []

    def run(index):
        try:
            with xp.cuda.Stream(non_blocking=True) as stream:
                results[index] = body(index)
                stream.synchronize()
        except Exception as exc:  # reported below, with the thread's index
            errors.append((index, exc))

    threads = [threading.Thread(target=run, args=(i,)) for i in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    return results


def json_from_subprocess(argv, name, tmp_path_factory, worker_id, timeout=1800):
    """The JSON that the last line of ``python argv...`` prints, with the simulator off and the
    repository first on the path. Under pytest-xdist one worker runs it and the others wait for
    its result (a file beside the workers' temporary folders, under a lock), so a fixture that
    compiles every kernel does it once per test run, not once per worker."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    from filelock import FileLock

    def run():
        root = Path(__file__).resolve().parent.parent.parent
        env = dict(
            os.environ, PYTHONPATH=os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])
        )
        env.pop("NUMBA_ENABLE_CUDASIM", None)
        done = subprocess.run(
            [sys.executable, *map(str, argv)],
            capture_output=True,
            text=True,
            env=env,
            timeout=timeout,
        )
        assert done.returncode == 0, done.stderr[-4000:]
        return done.stdout.strip().splitlines()[-1]

    if worker_id == "master":  # not under xdist
        return json.loads(run())
    shared = tmp_path_factory.getbasetemp().parent / f"{name}.json"
    with FileLock(str(shared) + ".lock"):
        if not shared.is_file():
            shared.write_text(run())
    return json.loads(shared.read_text())
