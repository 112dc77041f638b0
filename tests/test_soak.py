"""Shared state under load: replay plans, configuration and kernel caches and the buffers plans
reuse, with many threads on many streams.

Eight threads, each on its own CuPy stream, run 10,000 mixed calls between them (forward and
backward of random shapes, KV-cache decoding steps with appends over a contiguous and a paged
cache with lengths on the device and as an int, chunked prefill, packed batches with new
offsets every call; a third of the decoding calls and of the forward and backward ones at
head_dim 64 with sinks, a quarter of those forward and backward ones with a score_mod), each
thread a program drawn from its seed. Every output of every call equals, bitwise, the output
of the same program run alone afterwards on the default stream, and the memory pool stops
growing once every signature has been seen. On the GPU, and slow (``-s`` shows each
program's progress, the first fifth of it mostly compiling):

    python -m pytest -m slow -s tests/test_soak.py
"""

import sys
import time

import numpy as np
import pytest
from numba import cuda, float32
from support import random_array, run_on_streams, to_numpy, xp

import numflash

pytestmark = [pytest.mark.gpu, pytest.mark.slow]

THREADS = 8
CALLS = 10_000 // THREADS
#: Elements of the largest array a digest reads.
LARGEST = 1 << 18


@cuda.jit(device=True)
def _relative_bias(score, b, h, q_idx, kv_idx, slopes):
    return score + slopes[h] * (float32(q_idx) - float32(kv_idx))


@cuda.jit(device=True)
def _relative_bias_derivative(score, b, h, q_idx, kv_idx, slopes):
    return float32(1.0)


class _Program:
    """One thread's calls, drawn from ``seed``: the same calls on the same inputs, in the same
    order, whenever it runs. Each output goes into :meth:`digest`."""

    def __init__(self, seed):
        self.seed, self.rng = seed, np.random.default_rng(seed)
        self.dtype = "bfloat16" if seed % 2 else "float16"
        self.digests = xp.zeros(CALLS * 6 + 4, dtype=xp.uint64)  # 6 outputs a call at most
        self.weights = xp.asarray(self.rng.integers(1, 1 << 40, LARGEST, dtype=np.uint64))
        self.count = 0
        # a contiguous cache (4 sequences of 256) and a paged one (64 pages of 16), each with
        # lengths on the device; the contiguous one also with an int length
        self.caches = [self.array((4, 256, 2, 64)) for _ in range(2)]
        self.paged = [self.array((64, 16, 2, 64)) for _ in range(2)]
        self.table = xp.asarray(self.rng.permutation(64).astype(np.int32).reshape(4, 16))
        self.lengths = xp.zeros((4,), dtype=xp.int32)
        self.paged_lengths = xp.zeros((4,), dtype=xp.int32)
        self.int_length = 0

    def array(self, shape, dtype=None):
        return random_array(shape, dtype or self.dtype, self.rng)

    def sinks(self, nheads):
        """A third of the calls take sink logits (new values each call), the rest none."""
        return self.array((nheads,), "float32") if self.rng.integers(3) == 0 else None

    def digest(self, *outputs):
        """A weighted sum of each output's bits, kept on the device (no synchronisation)."""
        for x in outputs:
            bits = x.reshape(-1).view(xp.uint16 if x.dtype.itemsize == 2 else xp.uint32)
            self.digests[self.count] = (bits.astype(xp.uint64) * self.weights[: bits.size]).sum()
            self.count += 1

    def forward(self, backward):
        b = int(self.rng.choice([1, 2]))
        sq = 128 if backward else int(self.rng.choice([1, 128]))
        hk, d = int(self.rng.choice([1, 4])), int(self.rng.choice([64, 128]))
        causal = bool(self.rng.integers(2))
        q, k, v = (self.array((b, n, h, d)) for n, h in ((sq, 4), (200, hk), (200, hk)))
        # the variants at head_dim 64 only: what they add here is plans and their arrays
        # under load; their kernels at each head_dim are the kernel tests' (and each variant
        # at each head dim, dtype and mask is one more kernel this process compiles)
        sinks, mods = (self.sinks(4) if d == 64 else None), {}
        if d == 64 and self.rng.integers(4) == 0:  # a relative bias through a score_mod
            mods = dict(score_mod=_relative_bias, mod_args=(self.array((4,), "float32"),))
        out, lse = numflash.attention(q, k, v, causal=causal, return_lse=True, sinks=sinks,
                                      **mods)  # fmt: skip
        self.digest(out, lse)
        if backward:
            dout = self.array(q.shape)
            if mods:
                mods["score_mod_derivative"] = _relative_bias_derivative
            grads = numflash.attention_backward(
                dout, q, k, v, out, lse, causal=causal, deterministic=True, sinks=sinks, **mods
            )
            self.digest(*grads)

    def decode(self):
        """One step over one of the caches: 1 or 2 new rows (the split-KV kernel) or 33
        (chunked prefill on Hopper), appended; sequences start again once a cache is full."""
        rows = int(self.rng.choice([1, 1, 2, 33]))
        which = int(self.rng.integers(3))  # device lengths, int length, paged
        q = self.array((4, rows, 8, 64))
        k, v = self.array((4, rows, 2, 64)), self.array((4, rows, 2, 64))
        sinks = self.sinks(8)
        if which == 2:
            if int(self.paged_lengths.max()) + rows > 256:
                self.paged_lengths[...] = 0
            out = numflash.attention_with_kvcache(
                q, *self.paged, k, v, cache_seqlens=self.paged_lengths, block_table=self.table,
                causal=True, sinks=sinks,
            )  # fmt: skip
            self.paged_lengths += rows
        elif which == 1:
            if self.int_length + rows > 256:
                self.int_length = 0
            out = numflash.attention_with_kvcache(
                q, *self.caches, k, v, cache_seqlens=self.int_length, causal=True, sinks=sinks
            )
            self.int_length += rows
        else:
            if int(self.lengths.max()) + rows > 256:
                self.lengths[...] = 0
            out = numflash.attention_with_kvcache(
                q, *self.caches, k, v, cache_seqlens=self.lengths, causal=True, sinks=sinks
            )
            self.lengths += rows
        self.digest(out)

    def packed(self):
        total = 600
        cuts = np.sort(self.rng.choice(np.arange(1, total), 3, replace=False))
        cu_host = np.concatenate([[0], cuts, [total]]).astype(np.int32)
        longest = int(np.diff(cu_host).max())
        q, k, v = (self.array((total, 4, 64)) for _ in range(3))
        cu = xp.asarray(cu_host)
        out, lse = numflash.attention_varlen(
            q, k, v, cu, cu, longest, longest, causal=True, return_lse=True
        )
        self.digest(out, lse)

    def run(self, pool_bytes=None):
        """Every call; ``pool_bytes``: a list given the memory pool's size after a quarter of
        the calls and after the last."""
        steps = (lambda: self.forward(False), lambda: self.forward(True), self.decode)
        steps += (self.packed,)
        start = time.perf_counter()
        for i in range(CALLS):
            steps[int(self.rng.integers(len(steps)))]()
            if (i + 1) % (CALLS // 5) == 0:
                print(f"soak: program {self.seed}{'' if pool_bytes is None else ' (threaded)'}, "
                      f"{i + 1} calls in {time.perf_counter() - start:.1f} s", file=sys.stderr)  # fmt: skip
            if pool_bytes is not None and i + 1 in (CALLS // 4, CALLS):
                xp.cuda.get_current_stream().synchronize()
                pool_bytes.append(xp.get_default_memory_pool().total_bytes())
        self.digest(*self.caches, *self.paged)
        return to_numpy(self.digests[: self.count])


def test_threads_on_their_own_streams_equal_each_program_run_alone():
    pools = {seed: [] for seed in range(THREADS)}
    results = run_on_streams(THREADS, lambda seed: _Program(seed).run(pools[seed]))
    quarter = max(pool[0] for pool in pools.values())
    end = max(pool[1] for pool in pools.values())
    assert end <= quarter + (64 << 20), f"memory pool {quarter} bytes at a quarter, {end} at end"
    for seed in range(THREADS):
        alone = _Program(seed).run()
        assert results[seed].shape == alone.shape
        differ = np.flatnonzero(results[seed] != alone)
        assert differ.size == 0, f"thread {seed}: outputs {differ[:10]} differ from its run alone"
