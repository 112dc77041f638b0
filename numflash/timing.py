"""The one way numflash times GPU work: CUDA events, warm-up, median of many runs, L2 flushed.

Used by the benchmarks and the autotuner alike, so that a tuned speed-up and a benchmark table
measure the same thing.
"""

import statistics
from dataclasses import dataclass

#: Bytes written between timed runs to evict the previous run's data from L2 (the H100/H200 L2
#: holds 50/60 MB; twice that leaves nothing behind).
L2_FLUSH_BYTES = 128 * 1024 * 1024


@dataclass(frozen=True)
class Timing:
    median_ms: float
    min_ms: float
    max_ms: float
    runs: int

    def tflops(self, flops):
        return flops / (self.median_ms * 1e-3) / 1e12


_flush_buffer = None


def _flush_l2(cupy):
    global _flush_buffer
    if _flush_buffer is None:
        _flush_buffer = cupy.empty(L2_FLUSH_BYTES // 4, dtype=cupy.int32)
    _flush_buffer.fill(0)


def time_gpu(fn, *, warmup=3, runs=20, flush_l2=True, max_total_ms=None):
    """Median wall time of ``fn()`` on CuPy's current stream, measured with CUDA events (a host
    clock in the simulator, where kernels run synchronously on the host).

    ``fn`` is called ``warmup`` times untimed (compilation and first-use costs stay out), then
    ``runs`` times, each between two events, after an L2 flush when ``flush_l2``. With
    ``max_total_ms`` the timed runs stop early once that much GPU time has been spent (at least
    3 runs are kept).
    """
    from .kernels.jit import SIMULATOR

    if SIMULATOR:
        return _time_simulated(fn, warmup, runs, max_total_ms)
    import cupy

    stream = cupy.cuda.get_current_stream()
    for _ in range(warmup):
        fn()
    stream.synchronize()
    times = []
    for i in range(runs):
        if flush_l2:
            _flush_l2(cupy)
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
    import time

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
