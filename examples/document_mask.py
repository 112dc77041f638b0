"""Document masking of a packed batch: documents of random lengths in one sequence, each
token attending (causally) to its own document only, through a mask_mod and its block mask.

    python examples/document_mask.py [--documents 8] [--min-len 128] [--max-len 1024]
                                     [--head-dim 64]

The documents' ids are a device array handed to the mask_mod as a mod_arg;
``numflash.block_mask`` evaluates the mask once per 128 x 128 block, and the forward and
backward calls take it (``block_mask=``), so the forward skips the tiles between documents
and the per-score mask inside them. The same rows also go through ``attention_varlen`` (the
documents as a packed batch), the native route for this mask: outputs and gradients must agree
within fp16 rounding. Prints the block mask's sparsity, both forwards' times (on a GPU; the
first calls, which compile, untimed) and the largest differences. (The backward with a
mask_mod runs the portable kernels, slow beside the tensor-core ones even with the tiles
the block mask hides skipped: keep the sequence short.)
"""

import argparse
import sys
import time

import numpy as np
from numba import cuda

import numflash
from numflash.arrays import from_float, to_float64
from numflash.kernels.jit import SIMULATOR

if SIMULATOR:
    xp = np
else:
    import cupy as xp

HEADS, KV_HEADS = 8, 2


@cuda.jit(device=True)
def same_document(b, h, q_idx, kv_idx, document):
    return document[q_idx] == document[kv_idx]


def parse(argv):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--documents", type=int, default=8)
    ap.add_argument("--min-len", type=int, default=128)
    ap.add_argument("--max-len", type=int, default=1024)
    ap.add_argument("--head-dim", type=int, default=64)
    args = ap.parse_args(argv)
    if args.documents < 1 or args.min_len < 1 or args.max_len < args.min_len:
        ap.error("need at least one document and 1 <= --min-len <= --max-len")
    if not 1 <= args.head_dim <= 256:
        ap.error("--head-dim must be 1 to 256")
    return args


def random(rng, *shape):
    return from_float(xp.asarray(rng.standard_normal(shape, dtype=np.float32)), np.float16)


def timed(fn, runs=10):
    """Milliseconds a call, host and GPU together (a GPU's stream synchronised)."""
    fn()
    sync = (lambda: None) if SIMULATOR else xp.cuda.Device().synchronize
    sync()
    start = time.perf_counter()
    for _ in range(runs):
        fn()
    sync()
    return (time.perf_counter() - start) / runs * 1e3


def main(argv=None):
    args = parse(argv)
    rng = np.random.default_rng(0)
    lengths = rng.integers(args.min_len, args.max_len + 1, args.documents)
    total = int(lengths.sum())
    document = xp.asarray(np.repeat(np.arange(len(lengths)), lengths).astype(np.int32))
    offsets = xp.asarray(np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32))
    longest = int(lengths.max())
    shapes = ((1, total, h, args.head_dim) for h in (HEADS, KV_HEADS, KV_HEADS, HEADS))
    q, k, v, dout = (random(rng, *shape) for shape in shapes)

    # one mask for every head (nheads None) of the one sequence
    bm = numflash.block_mask(same_document, 1, None, total, total, mod_args=(document,))
    out, lse = numflash.attention(q, k, v, causal=True, return_lse=True, block_mask=bm)
    grads = numflash.attention_backward(dout, q, k, v, out, lse, causal=True, block_mask=bm)

    packed = [x[0] for x in (q, k, v, dout)]
    ref, ref_lse = numflash.attention_varlen(*packed[:3], offsets, offsets, longest, longest,
                                             causal=True, return_lse=True)  # fmt: skip
    ref_grads = numflash.attention_varlen_backward(
        packed[3], *packed[:3], ref, ref_lse, offsets, offsets, longest, longest, causal=True
    )
    diffs = [float(np.abs(to_float64(a)[0] - to_float64(b)).max())
             for a, b in zip((out, *grads), (ref, *ref_grads))]  # fmt: skip

    print(f"{args.documents} documents, {total} tokens: {bm.sparsity():.1%} of the blocks empty")
    if not SIMULATOR:
        mask_ms = timed(lambda: numflash.attention(q, k, v, causal=True, block_mask=bm))
        varlen_ms = timed(lambda: numflash.attention_varlen(
            *packed[:3], offsets, offsets, longest, longest, causal=True))  # fmt: skip
        print(f"forward: block mask {mask_ms:.3f} ms, attention_varlen {varlen_ms:.3f} ms")
    print("largest differences (out, dq, dk, dv): " + ", ".join(f"{d:.2e}" for d in diffs))
    worst = max(diffs)
    if not worst < 2e-2:
        sys.exit(f"the block-masked call and attention_varlen differ by {worst:.3g}")
    return worst


if __name__ == "__main__":
    main()
