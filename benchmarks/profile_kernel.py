"""Run one forward call of a chosen configuration, for ncu to profile.

    ncu --clock-control none --section WarpStateStats -k regex:forward -s 2 -c 1 \\
        python benchmarks/profile_kernel.py --head-dim 128 --config 64,64,4,2,1
"""

import argparse
import os
import sys

import cupy

import numflash

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import peers  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--seqlen", type=int, default=4096)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--config", default=None, help="block_m,block_n,num_warps,stages,q_in_regs")
    args = ap.parse_args()
    cfg = None
    if args.config:
        bm, bn, nw, st, qr = (int(x) for x in args.config.split(","))
        cfg = numflash.TensorCoreConfig(bm, bn, nw, st, bool(qr))
    q, k, v = peers.random_qkv(args.batch, args.seqlen, 2048 // args.head_dim, args.head_dim,
                               cupy.float16)  # fmt: skip
    for _ in range(3):  # compile, warm up, then the profiled launch
        numflash.attention(q, k, v, causal=args.causal, config=cfg)
    cupy.cuda.Device().synchronize()


if __name__ == "__main__":
    main()
