"""gpt-oss-style attention in a decoding loop: a learned sink logit a head and a 128-token
sliding window, over a paged KV cache.

    python examples/sinks_decode.py [--batch 4] [--prompt 1000] [--steps 32] [--window 128]

Each sequence's prompt enters the paged cache through one chunked-prefill call; then every step
appends one token's key and value and attends its query over the cache
(``attention_with_kvcache(..., window_size=(window - 1, 0), sinks=sinks)``), the lengths on the
device advancing by one (the steps after the first, which compiles its kernel, are timed: host
and GPU together, each call on the full path, as calls with sinks are not replayed from
plans). At the end every step's output is compared with one
``numflash.attention`` pass over the whole sequences with the same window and sinks (its rows
at the decoded positions): the two routes, the split-KV decode kernel and the forward kernel,
must agree within fp16 rounding. Prints the time per step and the largest difference.
"""

import argparse
import sys
import time

import numpy as np

import numflash
from numflash.arrays import from_float, to_float64
from numflash.kernels.jit import SIMULATOR

if SIMULATOR:
    xp = np
else:
    import cupy as xp

HEADS, KV_HEADS, HEAD_DIM, PAGE = 8, 2, 64, 16


def parse(argv):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--prompt", type=int, default=1000)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--window", type=int, default=128, help="keys a query sees, itself included")
    args = ap.parse_args(argv)
    for name in ("batch", "prompt", "steps", "window"):
        if getattr(args, name) < 1:
            ap.error(f"--{name} must be at least 1")
    return args


def random(rng, *shape):
    return from_float(xp.asarray(rng.standard_normal(shape, dtype=np.float32)), np.float16)


def main(argv=None):
    args = parse(argv)
    rng = np.random.default_rng(0)
    b, total = args.batch, args.prompt + args.steps
    window = (args.window - 1, 0)  # the query and the window - 1 keys before it
    sinks = xp.asarray(rng.standard_normal(HEADS, dtype=np.float32))
    q, k, v = (random(rng, b, total, h, HEAD_DIM) for h in (HEADS, KV_HEADS, KV_HEADS))

    # the pages of sequence i: every b-th page from i on (as a pool hands them out)
    pages_per_seq = -(-total // PAGE)
    table = np.arange(b * pages_per_seq, dtype=np.int32).reshape(pages_per_seq, b).T
    block_table = xp.asarray(table.copy())
    k_cache, v_cache = (xp.zeros((b * pages_per_seq, PAGE, KV_HEADS, HEAD_DIM), np.float16)
                        for _ in range(2))  # fmt: skip
    seqlens = xp.zeros((b,), dtype=np.int32)

    def step(rows):
        """Attend (and append) rows ``rows`` of every sequence."""
        return numflash.attention_with_kvcache(
            q[:, rows], k_cache, v_cache, k[:, rows], v[:, rows], cache_seqlens=seqlens,
            block_table=block_table, causal=True, window_size=window, sinks=sinks,
        )  # fmt: skip

    step(slice(0, args.prompt))  # the prompt, as chunked prefill
    seqlens += args.prompt
    outputs = []
    for t in range(args.prompt, total):
        if t == args.prompt + min(1, args.steps - 1):  # the first step compiled its kernel
            if not SIMULATOR:
                xp.cuda.get_current_stream().synchronize()
            began = time.perf_counter()
        outputs.append(step(slice(t, t + 1)))
        seqlens += 1
    if not SIMULATOR:
        xp.cuda.get_current_stream().synchronize()
    timed = max(1, args.steps - 1)
    per_step_us = (time.perf_counter() - began) / timed * 1e6

    whole = numflash.attention(q, k, v, causal=True, window_size=window, sinks=sinks)
    decoded = xp.concatenate(outputs, axis=1)
    diff = float(np.abs(to_float64(decoded) - to_float64(whole[:, args.prompt :])).max())
    print(f"{args.steps} steps of batch {b} over {args.prompt}+ cached tokens, window "
          f"{args.window}, sinks: {per_step_us:.1f} us a step (host and GPU); largest "
          f"difference from one pass over the whole sequences: {diff:.2e}")  # fmt: skip
    if diff > 4e-3:
        sys.exit(f"the decoding loop and the whole-sequence pass differ by {diff:.3g}")
    return diff


if __name__ == "__main__":
    main()
