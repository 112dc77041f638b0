"""Block-mask benchmark: masks written as a mask_mod with their block mask, beside the calls
that say the same thing natively.

    python benchmarks/bench_block_mask.py [--dtypes float16 bfloat16] [--runs 20] [--rounds 2]

Shapes: 32 query heads, 8 KV heads, head_dim 128.
- Documents: 8 documents of 512-4096 tokens (drawn once, seed 0) packed in one sequence,
  causal within each: ``attention(causal=True, mask_mod=same_document, block_mask=...)`` on
  (1, total) arrays against ``attention_varlen(causal=True)`` on the same rows; the mask_mod
  without its block mask beside them (every tile of the causal triangle runs).
- Sliding window: batch 2 x 16384, each query sees itself and the WINDOW keys before it:
  ``mask_mod=window`` with its block mask against ``window_size=(WINDOW, 0)``.
Each call's output is checked against the native call's first (the same attention: they must
agree within the dtype's rounding); block-mask creation is timed apart (once per shape, its
cost is not a call's). GPU time from CUDA events (numflash.timing.time_gpu, L2 flushed); the
calls of a problem timed in turn ``--rounds`` times, each keeping its fastest round's median.
Writes benchmarks/results/block_mask.json and block_mask.md.
"""

import os
import sys

import cupy
import numpy as np
from numba import cuda

import numflash
from numflash.device import current_device
from numflash.timing import attention_flops, time_gpu

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import peers  # noqa: E402
from bench_forward import DTYPES  # noqa: E402

NHEADS, NHEADS_K, HEAD_DIM = 32, 8, 128

#: The sliding window's keys before each query (the query's own key besides).
WINDOW = 1024


@cuda.jit(device=True)
def same_document(b, h, q_idx, kv_idx, document):
    return document[q_idx] == document[kv_idx]


@cuda.jit(device=True)
def window(b, h, q_idx, kv_idx):
    return kv_idx <= q_idx and q_idx - kv_idx <= WINDOW


def document_lengths(count=8, low=512, high=4096, seed=0):
    return [int(n) for n in np.random.default_rng(seed).integers(low, high + 1, count)]


def gqa(batch, seqlen, dtype, seed=0):
    q = peers.random_qkv(batch, seqlen, NHEADS, HEAD_DIM, dtype, seed)[0]
    k, v = peers.random_qkv(batch, seqlen, NHEADS_K, HEAD_DIM, dtype, seed + 1)[:2]
    return q, k, v


def agree(out, ref, what):
    """Raise unless ``out`` matches the native call's ``ref`` within 16-bit rounding."""
    err = float(abs(out.astype(cupy.float32) - ref.astype(cupy.float32)).max())
    if not err < 2e-2:
        raise SystemExit(f"{what}: differs from the native call by {err:.3g}")


def timed(calls, runs, rounds):
    best = {}
    for _ in range(rounds):
        for name, fn in calls.items():
            found = time_gpu(fn, runs=runs)
            if name not in best or found.median_ms < best[name].median_ms:
                best[name] = found
    return best


def documents(dtype, runs, rounds):
    """{name: timing} of the packed documents, and (flops, block mask build ms, sparsity)."""
    lengths = document_lengths()
    total = sum(lengths)
    q, k, v = gqa(1, total, dtype)
    ids = cupy.asarray(np.repeat(np.arange(len(lengths)), lengths).astype(np.int32))
    cu = cupy.asarray(np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32))
    longest = max(lengths)
    build = time_gpu(lambda: numflash.block_mask(same_document, None, None, total, total,
                                                 mod_args=(ids,)), runs=5)  # fmt: skip
    bm = numflash.block_mask(same_document, None, None, total, total, mod_args=(ids,))
    packed = [x[0] for x in (q, k, v)]
    calls = {
        "attention_varlen": lambda: numflash.attention_varlen(
            *packed, cu, cu, longest, longest, causal=True),
        "mask_mod + block_mask": lambda: numflash.attention(
            q, k, v, causal=True, block_mask=bm),
        "mask_mod alone": lambda: numflash.attention(
            q, k, v, causal=True, mask_mod=same_document, mod_args=(ids,)),
    }  # fmt: skip
    ref = numflash.attention_varlen(*packed, cu, cu, longest, longest, causal=True)
    agree(numflash.attention(q, k, v, causal=True, block_mask=bm)[0], ref, "block mask")
    flops = sum(attention_flops(1, NHEADS, n, n, HEAD_DIM, True) for n in lengths)
    return timed(calls, runs, rounds), (flops, build.median_ms, bm.sparsity(), lengths)


def sliding_window(dtype, runs, rounds, batch=2, seqlen=16384):
    q, k, v = gqa(batch, seqlen, dtype)
    build = time_gpu(lambda: numflash.block_mask(window, None, None, seqlen, seqlen), runs=5)
    bm = numflash.block_mask(window, None, None, seqlen, seqlen)
    calls = {
        "window_size": lambda: numflash.attention(q, k, v, window_size=(WINDOW, 0)),
        "mask_mod + block_mask": lambda: numflash.attention(q, k, v, block_mask=bm),
    }
    ref = numflash.attention(q, k, v, window_size=(WINDOW, 0))
    agree(numflash.attention(q, k, v, block_mask=bm), ref, "window block mask")
    # the keys each query sees: WINDOW + 1, fewer for the first WINDOW rows
    seen = sum(min(i, WINDOW) + 1 for i in range(seqlen))
    flops = 4 * batch * NHEADS * HEAD_DIM * seen
    return timed(calls, runs, rounds), (flops, build.median_ms, bm.sparsity(), None)


def main():
    ap = peers.parser(__doc__, choices=list(DTYPES))
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=2, help="turns of timing every call")
    args = ap.parse_args()
    dev = current_device()
    print(f"device: {dev.name} ({dev.arch}), numflash {numflash.__version__}", flush=True)
    records = []
    lines = [
        "| dtype | mask | call | ms | TFLOP/s | / native |",
        "|---|---|---|---|---|---|",
    ]
    notes = []
    for dt in args.dtypes:
        for mask, run in (("documents", documents), ("sliding window", sliding_window)):
            timings, (flops, build_ms, sparsity, lengths) = run(DTYPES[dt], args.runs, args.rounds)
            native = next(iter(timings.values()))
            for call, timing in timings.items():
                records.append(peers.record(timing, flops, "numflash", call, dt, mask=mask))
                lines.append(
                    f"| {dt} | {mask} | {call} | {timing.median_ms:.3f} | "
                    f"{timing.tflops(flops):.0f} | {timing.median_ms / native.median_ms:.3f} |"
                )
                print(lines[-1], flush=True)
            shape = f"documents {lengths}" if lengths else f"window {WINDOW}, 2 x 16384"
            notes.append(f"{dt}, {shape}: block mask made in {build_ms:.3f} ms, "
                         f"{sparsity:.1%} of its blocks empty")  # fmt: skip
    table = "\n".join(lines) + "\n\n" + "\n".join(f"- {n}" for n in notes) + "\n"
    peers.save_results(args.out_dir, "block_mask", dev, records, table)


if __name__ == "__main__":
    main()
