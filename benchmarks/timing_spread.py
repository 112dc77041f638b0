"""Where the run-to-run spread of the backward benchmark comes from.

For each problem, numflash's backward and SDPA's FlashAttention-2 backward are timed in
alternation, each run after an L2 flush between two CUDA events (as numflash.timing.time_gpu
does), and for each run also the host time of the call itself. Printed per provider: the
quantiles of the event times, the host time of the call, and the median of the per-pair ratios
(numflash / SDPA TFLOP/s over runs taken back to back), beside the ratio of the two medians
that bench_backward.py reports.

    python benchmarks/timing_spread.py --dtypes float16 bfloat16 --seqlens 4096 --runs 60

``--gaps`` instead follows numflash's calls launch by launch: for each of its kernels, the host
time from the call's start to the launch, and the GPU's idle time before the kernel starts
(from CUDA events recorded around each launch, which add a few microseconds of host time).
"""

import argparse
import collections
import gc
import os
import statistics
import sys
import time

import cupy
import numpy as np

from numflash import timing

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import peers  # noqa: E402
from backward_variants import recorded_launches  # noqa: E402
from bench_backward import numflash_runs, sdpa_runs  # noqa: E402


def one_run(fn, stream):
    """(event ms, host ms of the call) of one flushed run of fn."""
    timing._flush_l2(cupy)
    start, stop = cupy.cuda.Event(), cupy.cuda.Event()
    start.record(stream)
    t0 = time.perf_counter()
    fn()
    host = (time.perf_counter() - t0) * 1e3
    stop.record(stream)
    stop.synchronize()
    return cupy.cuda.get_elapsed_time(start, stop), host


def launch_gaps(fn, stream, runs):
    """{kernel: (median host ms from the call's start to its launch, median GPU idle ms before
    it)} over ``runs`` flushed calls of fn, and the median idle time after the last kernel."""
    host_at, idle_before = collections.defaultdict(list), collections.defaultdict(list)
    idle_after = []
    with recorded_launches() as launched:
        for _ in range(runs):
            launched.clear()
            timing._flush_l2(cupy)
            start, stop = cupy.cuda.Event(), cupy.cuda.Event()
            start.record(stream)
            t0 = time.perf_counter()
            fn()
            stop.record(stream)
            stop.synchronize()
            previous = start
            for kind, host, begin, end in launched:
                host_at[kind].append((host - t0) * 1e3)
                idle_before[kind].append(cupy.cuda.get_elapsed_time(previous, begin))
                previous = end
            idle_after.append(cupy.cuda.get_elapsed_time(previous, stop))
    gaps = {kind: (statistics.median(host_at[kind]), statistics.median(idle_before[kind]))
            for kind in host_at}  # fmt: skip
    return gaps, statistics.median(idle_after)


def quantiles(xs):
    xs = sorted(xs)
    pick = [xs[int(f * (len(xs) - 1))] for f in (0, 0.1, 0.5, 0.9, 1)]
    return " ".join(f"{x:7.3f}" for x in pick)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    peers.add_problem_arguments(ap)
    ap.add_argument("--runs", type=int, default=60)
    ap.add_argument("--no-gc", action="store_true", help="garbage collector off while timing")
    ap.add_argument("--gaps", action="store_true", help="numflash's launches one by one")
    args = ap.parse_args()
    stream = cupy.cuda.get_current_stream()
    print("quantiles: min p10 median p90 max (ms)")
    for hd, dt, dtype, causal, seqlen, batch, nheads in peers.problems(args):
        q, k, v = peers.random_qkv(batch, seqlen, nheads, hd, dtype, seed=1)
        ours = numflash_runs(q, k, v, causal, "default")[0]
        theirs = sdpa_runs(q, k, v, causal, "flash")[0]
        for fn in (ours, theirs) * 3:  # warm-up
            fn()
        stream.synchronize()
        label = f"hd{hd} {dt} causal={int(causal)} s{seqlen}"
        if args.gaps:
            gaps, after = launch_gaps(ours, stream, args.runs)
            steps = "  ".join(f"{kind}: launched at {host:.3f}, GPU idle {idle:.3f} before"
                              for kind, (host, idle) in gaps.items())  # fmt: skip
            print(f"{label} (ms) {steps}; idle after the last {after:.3f}", flush=True)
            continue
        if args.no_gc:
            gc.disable()
        rows = {"numflash": [], "sdpa-flash": []}
        try:
            for _ in range(args.runs):
                rows["numflash"].append(one_run(ours, stream))
                rows["sdpa-flash"].append(one_run(theirs, stream))
        finally:
            gc.enable()
        for name, runs in rows.items():
            print(f"{label} {name:10s} event {quantiles([e for e, _ in runs])}   "
                  f"host call {quantiles([h for _, h in runs])}", flush=True)  # fmt: skip
        pairs = [s[0] / n[0] for n, s in zip(rows["numflash"], rows["sdpa-flash"])]
        medians = (statistics.median(e for e, _ in rows["sdpa-flash"])
                   / statistics.median(e for e, _ in rows["numflash"]))  # fmt: skip
        print(f"{label} ratio: of medians {medians:.3f}, median of back-to-back pairs "
              f"{statistics.median(pairs):.3f} (p10 {quantiles(pairs).split()[1]}, "
              f"p90 {quantiles(pairs).split()[3]})", flush=True)  # fmt: skip
        del q, k, v
        cupy.get_default_memory_pool().free_all_blocks()
    return 0


if __name__ == "__main__":
    np.seterr(all="ignore")
    sys.exit(main())
