"""Run one forward (or backward) call of a chosen configuration, for ncu to profile.

    ncu --clock-control none --section WarpStateStats -k regex:forward -s 2 -c 1 \\
        python tools/profile_kernel.py --head-dim 128 --config 64,64,4,2,1
    ncu --clock-control none --section WarpStateStats -k regex:dkdv -s 2 -c 1 \\
        python tools/profile_kernel.py --backward --config 64,8,2
    ncu --clock-control none --section WarpStateStats -k regex:dkdv -s 2 -c 1 \\
        python tools/profile_kernel.py --backward --wgmma 8,2,fused

``--wgmma`` takes the Hopper backward's configuration as tools/backward_ab.py spells it.
"""

import argparse
import os
import sys

import cupy

import numflash

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks"))
import peers  # noqa: E402
from backward_ab import parse_config  # noqa: E402  (tools/ is this script's directory)
from bench_forward import DTYPES  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--seqlen", type=int, default=4096)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--causal", action="store_true")
    ap.add_argument(
        "--backward",
        action="store_true",
        help="profile attention_backward (--config block_m,num_warps,stages)",
    )
    ap.add_argument("--config", default=None, help="block_m,block_n,num_warps,stages,q_in_regs")
    ap.add_argument("--wgmma", default=None, help="with --backward: " + parse_config.__doc__)
    ap.add_argument("--dtype", choices=["float16", "bfloat16"], default="float16")
    args = ap.parse_args()
    cfg = None
    if args.wgmma:
        if not args.backward or args.config:
            ap.error("--wgmma is a backward configuration: give --backward and no --config")
        cfg = parse_config(args.wgmma)
    elif args.config:
        values = [int(x) for x in args.config.split(",")]
        if args.backward:
            cfg = numflash.TensorCoreBackwardConfig(*values)
        else:
            bm, bn, nw, st, qr = values
            cfg = numflash.TensorCoreConfig(bm, bn, nw, st, bool(qr))
    q, k, v = peers.random_qkv(
        args.batch, args.seqlen, 2048 // args.head_dim, args.head_dim, DTYPES[args.dtype]
    )
    if args.backward:
        out, lse = numflash.attention(q, k, v, causal=args.causal, return_lse=True)
        dout = peers.random_qkv(*q.shape[:2], q.shape[2], q.shape[3], q.dtype, seed=5)[0]
    for _ in range(3):  # compile, warm up, then the profiled launch
        if args.backward:
            numflash.attention_backward(dout, q, k, v, out, lse, causal=args.causal, config=cfg)
        else:
            numflash.attention(q, k, v, causal=args.causal, config=cfg)
    cupy.cuda.Device().synchronize()


if __name__ == "__main__":
    main()
