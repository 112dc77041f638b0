"""Ring attention scaling: forward + backward on several GPUs of one process against one GPU.

    python benchmarks/bench_ring.py [--world 2] [--seqlens 65536 131072 262144] [--runs 5]

32 query heads, 8 KV heads, head_dim 128, causal, bf16, batch 1. For each sequence length:
numflash.attention + attention_backward on GPU 0 over the whole sequence (T1); ring_attention
+ ring_attention_backward on ``--world`` GPUs, one thread a GPU, NCCL communicators from
numflash.distributed.nccl_communicators (T2); and the same ring with the transfers taken out
(each rank keeps computing on its own slices: the same kernels and shapes, no NCCL), which
shows what the overlap hides. Times are wall clock between synchronised starts and the last
GPU's end, median of ``--runs`` after a warm-up. Scaling efficiency = T1 / (world x T2).
Each record also gives the largest difference of the ring's output and gradients from the
single-GPU call's (tests/test_distributed_nccl.py holds them to the same-precision bar).
"""

import argparse
import json
import os
import statistics
import sys
import threading
import time

import cupy
import numpy as np

import numflash
from numflash import distributed

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import peers  # noqa: E402
from bench_forward import DTYPES  # noqa: E402

NHEADS, NHEADS_K, HEAD_DIM = 32, 8, 128


class _NoTransfer:
    """A ring that moves nothing: ``shift`` hands a rank its own arrays back."""

    def __init__(self, rank, size):
        self.rank, self.size = rank, size

    def shift(self, xs):
        return _Done(list(xs))


class _Done:
    def __init__(self, xs):
        self.xs = xs

    def wait(self):
        return self.xs


def _run_ranks(world, work):
    """work(rank) on every GPU at once, one thread each; the wall time from the moment all
    have started until the last has finished (its stream drained)."""
    start = threading.Barrier(world)
    times = [None] * world

    def run(rank, _ring):
        start.wait()
        t0 = time.perf_counter()
        work(rank)
        cupy.cuda.get_current_stream().synchronize()
        times[rank] = (t0, time.perf_counter())

    distributed.run_ranks(run, [None] * world, devices=range(world))
    return max(t[1] for t in times) - max(t[0] for t in times)


def bench(args):
    records = []
    world = args.world
    comms = distributed.nccl_communicators(list(range(world)))
    dtype = DTYPES[args.dtype]
    for seqlen in args.seqlens:
        q, k, v = peers.random_qkv(1, seqlen, NHEADS, HEAD_DIM, dtype, seed=1)
        k, v = (x[:, :, :NHEADS_K].copy() for x in (k, v))
        dout = peers.random_qkv(1, seqlen, NHEADS, HEAD_DIM, dtype, seed=2)[0]

        def single():
            out, lse = numflash.attention(q, k, v, causal=True, return_lse=True)
            return out, lse, numflash.attention_backward(dout, q, k, v, out, lse, causal=True)

        shards = []
        for rank in range(world):
            with cupy.cuda.Device(rank):
                shards.append(
                    [cupy.asarray(distributed.shard(x, rank, world).get()) for x in (q, k, v, dout)]
                )
        outputs = [None] * world

        def ring_step(rings):
            def work(rank):
                mq, mk, mv, md = shards[rank]
                out, lse = distributed.ring_attention(
                    mq, mk, mv, rings[rank], causal=True, return_lse=True
                )
                grads = distributed.ring_attention_backward(
                    md, mq, mk, mv, out, lse, rings[rank], causal=True
                )
                outputs[rank] = (out, *grads)

            return work

        timed = {}
        for name, fn in (
            ("1 GPU", lambda: _run_ranks(1, lambda r: single())),
            (f"{world} GPUs", lambda: _run_ranks(world, ring_step(comms))),
            (
                f"{world} GPUs, no transfers",
                lambda: _run_ranks(world, ring_step([_NoTransfer(r, world) for r in range(world)])),
            ),
        ):
            fn()  # warm-up (compiles, plans)
            timed[name] = statistics.median(fn() for _ in range(args.runs))
        _run_ranks(world, ring_step(comms))  # the checked run
        ref_out, _, ref_grads = single()
        worst = 0.0
        for i, ref in enumerate((ref_out, *ref_grads)):
            got = distributed.unshard([cupy.asnumpy(o[i]) for o in outputs])
            err = float(np.abs(got.astype(np.float32) - cupy.asnumpy(ref).astype(np.float32)).max())
            worst = max(worst, err)
        t1, t2 = timed["1 GPU"], timed[f"{world} GPUs"]
        rec = dict(seqlen=seqlen, world=world, dtype=args.dtype, seconds=timed,
                   efficiency=t1 / (world * t2), max_abs_diff_vs_1gpu=worst)  # fmt: skip
        records.append(rec)
        print(json.dumps(rec), flush=True)
    return records


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--seqlens", type=int, nargs="+", default=[65536, 131072, 262144])
    ap.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if cupy.cuda.runtime.getDeviceCount() < args.world:
        raise SystemExit(f"bench_ring: needs {args.world} GPUs")
    records = bench(args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(records, f, indent=1)


if __name__ == "__main__":
    main()
