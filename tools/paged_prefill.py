"""Chunked prefill over a contiguous cache and over paged ones: where the paged forward's time goes.

Times ``attention_with_kvcache`` (fp16, 32 query heads, 8 KV heads, head_dim 128, causal) on
the Hopper forward for bench_prefill's two shapes (4 sequences of 128 new rows over 8192 cached,
1 of 2048 over 16384), over a contiguous cache and over the same keys in pages of each size
(shuffled, as benchmarks/bench_decode.py lays them out); CUDA events, median of 30 runs.

    python tools/paged_prefill.py [--page-sizes 16 128 256] [--stages 3] [--registers 24,240]
    ncu --profile-from-start off -k regex:forward_sm90 --metrics smsp__inst_executed.sum \\
        python tools/paged_prefill.py --profile      # one call of each, the first shape

``--stages`` forces a WgmmaForwardConfig of 2 consumers, 128-key tiles and pingpong with that
many stages (default: numflash's choice); ``--registers P,C`` sets what setmaxnreg gives the
producer and each consumer of the paged kernel for this run (forward_sm90.PAGED_REGISTER_SPLIT).
"""

import argparse
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.join(HERE, "..", "benchmarks")]

import cupy  # noqa: E402
import peers  # noqa: E402
from bench_decode import paged_copy  # noqa: E402

import numflash  # noqa: E402
from numflash.kernels import forward_sm90  # noqa: E402
from numflash.timing import time_gpu  # noqa: E402

SHAPES = [("b4, 128 new over 8192", 4, 128, 8192), ("b1, 2048 new over 16384", 1, 2048, 16384)]


def calls(batch, new, cached, page_sizes, config):
    """(layout, call) for the contiguous cache and each page size, over the same keys."""
    q, k, v = (
        peers.random_qkv(batch, new, heads, 128, cupy.float16, seed=seed)[0]
        for seed, heads in ((1, 32), (2, 8), (3, 8))
    )
    k_cache, v_cache = peers.random_qkv(batch, cached + new, 8, 128, cupy.float16)[:2]
    lengths = cupy.full((batch,), cached, dtype=cupy.int32)
    common = dict(cache_seqlens=lengths, causal=True, config=config)
    out = [
        ("contiguous", lambda: numflash.attention_with_kvcache(q, k_cache, v_cache, k, v, **common))
    ]
    for page in page_sizes:
        k_pages, v_pages, table = paged_copy(k_cache, v_cache, page)

        def paged(kp=k_pages, vp=v_pages, table=table):
            return numflash.attention_with_kvcache(q, kp, vp, k, v, block_table=table, **common)

        out.append((f"pages of {page}", paged))
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--page-sizes", type=int, nargs="+", default=[16, 64, 128, 256])
    ap.add_argument("--stages", type=int, help="force 2 consumers, 128-key tiles, pingpong")
    ap.add_argument("--registers", help="P,C: the paged kernel's producer and consumer registers")
    ap.add_argument("--profile", action="store_true", help="one call each under the profiler")
    args = ap.parse_args()
    if args.registers:
        producer, consumer = (int(x) for x in args.registers.split(","))
        split = dict(forward_sm90.PAGED_REGISTER_SPLIT)
        split[2] = (producer, consumer)
        forward_sm90.PAGED_REGISTER_SPLIT = split
    config = None
    if args.stages:
        config = numflash.WgmmaForwardConfig(2, 128, args.stages, pingpong=True)
    if args.profile:
        shape = calls(*SHAPES[0][1:], args.page_sizes, config)
        for _, call in shape:
            call()
        cupy.cuda.Device().synchronize()
        cupy.cuda.runtime.profilerStart()
        for _, call in shape:
            call()
        cupy.cuda.Device().synchronize()
        cupy.cuda.runtime.profilerStop()
        return
    found = {}
    for name, *sizes in SHAPES:
        for layout, call in calls(*sizes, args.page_sizes, config):
            found[f"{name}, {layout}"] = us = time_gpu(call, warmup=3, runs=30).median_ms * 1e3
            print(f"{name:26s} {layout:12s} {us:9.1f} us", flush=True)
    print(json.dumps({"stages": args.stages, "registers": args.registers, "us": found}))


if __name__ == "__main__":
    main()
