"""The one way numflash times GPU work: CUDA events, warm-up, median of many runs, L2 flushed,
the host's time to issue the work kept out.

Used by the benchmarks and the autotuner alike, so that a tuned speed-up and a benchmark table
measure the same thing.
"""

import statistics
import time
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Timing:
    median_ms: float
    min_ms: float
    max_ms: float
    runs: int

    def tflops(self, flops):
        return flops / (self.median_ms * 1e-3) / 1e12


#: Bytes read between timed runs to evict the previous run's data from L2 (the H100/H200 L2
#: holds 50/60 MB; twice that leaves nothing behind). Read, not written: a fill would leave the
#: L2 full of dirty lines that the timed kernel's first reads must write back to HBM first.
L2_FLUSH_BYTES = 128 * 1024 * 1024
#: The GPU waits at least this long before each timed run (see :func:`time_gpu`).
MIN_HOLD_NS = 50_000
#: ... and at most this long, whatever the call's host time.
MAX_HOLD_NS = 20_000_000

_SOURCE = r"""
extern "C" __global__ void numflash_read(const int4* __restrict__ p, long long n, int* sink) {
    int acc = 0;
    long long stride = (long long)gridDim.x * blockDim.x;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        int4 x = __ldcg(p + i);
        acc ^= x.x ^ x.y ^ x.z ^ x.w;
    }
    if (acc != 0) sink[0] = acc;  // the buffer is zeros: never taken, but the loads stay
}

extern "C" __global__ void numflash_hold(long long ns) {
    unsigned long long start, now;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
    do {
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
    } while (now - start < (unsigned long long)ns);
}
"""


class _Flush:
    """The kernels that run between timed runs, made on first use: an L2 eviction by reading
    a zeroed buffer, and a hold that keeps the GPU busy for a while."""

    _made = None

    @classmethod
    def get(cls, cupy):
        if cls._made is None:
            module = cupy.RawModule(code=_SOURCE)
            buffer = cupy.zeros(L2_FLUSH_BYTES // 16 * 4, dtype=cupy.int32)
            sink = cupy.zeros(1, dtype=cupy.int32)
            cls._made = (module.get_function("numflash_read"), module.get_function("numflash_hold"))
            cls._made += (buffer, sink)
        return cls._made


def _flush_l2(cupy):
    read, _, buffer, sink = _Flush.get(cupy)
    read((1024,), (256,), (buffer, np.int64(buffer.size // 4), sink))


def _hold(cupy, ns):
    _Flush.get(cupy)[1]((1,), (1,), (np.int64(ns),))


def time_gpu(fn, *, warmup=3, runs=20, flush_l2=True, max_total_ms=None):
    """Median GPU time of ``fn()`` on CuPy's current stream, measured with CUDA events (a host
    clock in the simulator, where kernels run synchronously on the host).

    ``fn`` is called ``warmup`` times untimed (compilation and first-use costs stay out), then
    ``runs`` times, each between two events, after an L2 flush when ``flush_l2``. Before each
    timed run the GPU is held busy (a kernel that waits on the GPU's clock) for three times the
    host time ``fn`` took in the last warm-up call, at least MIN_HOLD_NS: the start event
    fires when the hold ends, by which time ``fn`` has queued its work, so the figure is the
    GPU's time for that work alone, not the host's time to issue it (a call whose host side
    outlasts its kernels would otherwise be timed by its host side). With ``max_total_ms``
    the timed runs stop early once that much GPU time has been spent (at least 3 runs are
    kept).
    """
    from .kernels.jit import SIMULATOR

    if SIMULATOR:
        return _time_simulated(fn, warmup, runs, max_total_ms)
    import cupy

    stream = cupy.cuda.get_current_stream()
    host_ns = 0
    for _ in range(warmup):
        began = time.perf_counter_ns()
        fn()
        host_ns = time.perf_counter_ns() - began
        stream.synchronize()
    hold_ns = min(max(3 * host_ns, MIN_HOLD_NS), MAX_HOLD_NS)
    times = []
    for i in range(runs):
        if flush_l2:
            _flush_l2(cupy)
        _hold(cupy, hold_ns)
        start, stop = cupy.cuda.Event(), cupy.cuda.Event()
        start.record(stream)
        fn()
        stop.record(stream)
        stop.synchronize()
        times.append(cupy.cuda.get_elapsed_time(start, stop))
        if max_total_ms is not None and i >= 2 and sum(times) > max_total_ms:
            break
    return Timing(statistics.median(times), min(times), max(times), len(times))


def _time_simulated(fn, warmup, runs, max_total_ms):
    """The simulator runs kernels synchronously on the host: a host clock times them."""
    for _ in range(warmup):
        fn()
    times = []
    for i in range(runs):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
        if max_total_ms is not None and i >= 2 and sum(times) > max_total_ms:
            break
    return Timing(statistics.median(times), min(times), max(times), len(times))


def attention_flops(batch, nheads, seqlen_q, seqlen_k, head_dim, causal, mode="fwd"):
    """FLOPs as FlashAttention's benchmarks count them: 4 b h sq sk d, halved when causal;
    the backward pass is 2.5 forwards."""
    flops = 4.0 * batch * nheads * seqlen_q * seqlen_k * head_dim
    if causal:
        flops /= 2
    return flops * {"fwd": 1.0, "bwd": 2.5, "fwd+bwd": 3.5}[mode]
