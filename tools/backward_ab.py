"""Hopper backward configurations timed against each other in one process, taking turns.

    python tools/backward_ab.py --configs 8,2 8,3,ring 8,3,ring,pingpong [--head-dims 64 128]
                                [--seqlens 4096]
                                [--dtypes float16 bfloat16] [--causal both] [--runs 15]
                                [--rounds 3] [--out PATH] [--ablate loads stats]

For each problem (batch x seqlen = --tokens, heads x head_dim = --model-dim) the backward
(attention_backward from one saved forward) runs once with each configuration, the gradients
compared bit for bit with the first configuration's (the GPU tests check them against the
float64 reference), then the configurations take turns --rounds times, each keeping
its fastest round (the GPU's clock drifts over a minute); cuDNN's backward beside them where
PyTorch is there. A knob that changes only when registers are rounded (pack_first) must give
the same bits; dQ added up in no fixed order (fused: by bulk reductions, or with atomic by
atomics) may differ in its last bits, and the line then
gives its largest difference from the first configuration's dQ relative to dQ's largest
magnitude (dK and dV must still match bit for bit).
"""

import argparse
import json
import os
import sys

import numpy as np

import numflash
from numflash.config import WgmmaBackwardConfig
from numflash.timing import attention_flops, time_gpu

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks"))
import peers  # noqa: E402
from bench_backward import sdpa_runs  # noqa: E402


def parse_config(text):
    """num_warps,stages[,pack (pack_first)][,fused (dq_separate=False)][,atomic (dq_bulk=False)]
    [,ring (ring=True, stages 3)][,pingpong (pingpong=True, with ring)][,tma (tma=True, with
    ring)][,m128 (block_m=128)], e.g. 8,2,fused or 8,3,ring,pingpong,tma"""
    parts = text.split(",")
    warps, stages = (int(x) for x in parts[:2])
    unknown = set(parts[2:]) - {"pack", "fused", "atomic", "ring", "pingpong", "tma", "m128"}
    if unknown:
        raise SystemExit(f"--configs {text}: unknown {', '.join(sorted(unknown))}")
    flags = parts[2:]
    return WgmmaBackwardConfig(
        warps,
        stages,
        pack_first="pack" in flags,
        dq_separate="fused" not in flags,
        dq_bulk="atomic" not in flags,
        ring="ring" in flags,
        pingpong="pingpong" in flags,
        tma="tma" in flags,
        block_m=128 if "m128" in flags else 64,
    )


def _bits(grads):
    return [np.asarray(g.view(np.uint16).get()) for g in grads]


def ablate(parts):
    """Take parts out of the kernels about to be built, to see what limits them (the gradients
    are wrong; compare the time, and the ratio to cuDNN, with a run without): "loads" makes
    the cp.async tile loads do nothing (the streaming Q and dO, K and V tiles and the resident
    ones), "stats" the LSE and D fetches (0 for every row). Must run before any kernel is
    built."""
    from hopper_forward import no_loader  # (tools/ is this script's directory)
    from numba import float32

    from numflash.kernels import backward, backward_sm90
    from numflash.kernels.jit import device_function

    if "loads" in parts:
        backward_sm90.swizzled_tile_loader = no_loader
    if "stats" in parts:
        stats = backward.row_stats_functions

        def no_fetch(block_m, threads):
            _, store_row_stats = stats(block_m, threads)
            loads = backward.stat_loads(block_m, threads)

            @device_function
            def fetch_row_stats(lse_r, d_r, lse, delta, row_base, m0, seqlen_q, tid):
                for j in range(loads):
                    lse_r[j] = float32(0.0)
                    d_r[j] = float32(0.0)

            return fetch_row_stats, store_row_stats

        backward.row_stats_functions = no_fetch


def _agreement(first, grads):
    """The gradients against the first configuration's: the same bits, or how far dQ is off
    (dK and dV must be the same bits)."""
    bits = _bits(grads)
    if all((a == b).all() for a, b in zip(first, bits)):
        return "same bits"
    if not all((a == b).all() for a, b in zip(first[1:], bits[1:])):
        return "DIFFERENT dK/dV BITS"
    dq0 = first[0].view(grads[0].dtype).astype(np.float32)
    dq = bits[0].view(grads[0].dtype).astype(np.float32)
    scale = max(float(np.abs(dq0).max()), 1e-30)
    return f"dQ within {float(np.abs(dq - dq0).max()) / scale:.1e}"


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    peers.add_problem_arguments(ap)
    ap.set_defaults(head_dims=[64, 128])
    ap.add_argument("--configs", nargs="+", required=True, help=parse_config.__doc__)
    ap.add_argument("--runs", type=int, default=15)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--ablate", nargs="+", choices=["loads", "stats"], default=[],
                    help=ablate.__doc__.split(":")[0])  # fmt: skip
    args = ap.parse_args()
    if args.ablate:
        ablate(args.ablate)
    configs = [parse_config(c) for c in args.configs]
    rows = []
    for hd, dt, dtype, causal, seqlen, batch, nheads in peers.problems(args):
        q, k, v = peers.random_qkv(batch, seqlen, nheads, hd, dtype, seed=1)
        dout = peers.random_qkv(batch, seqlen, nheads, hd, dtype, seed=5)[0]
        out, lse = numflash.attention(q, k, v, causal=causal, return_lse=True)
        flops = attention_flops(batch, nheads, seqlen, seqlen, hd, causal, "bwd")

        def call(cfg):
            return lambda: numflash.attention_backward(
                dout, q, k, v, out, lse, causal=causal, config=cfg
            )

        first = _bits(call(configs[0])())
        same = {str(c): _agreement(first, call(c)()) for c in configs}
        found = {}
        for _ in range(args.rounds):
            for cfg in configs:
                t = time_gpu(call(cfg), runs=args.runs)
                if str(cfg) not in found or t.median_ms < found[str(cfg)].median_ms:
                    found[str(cfg)] = t
        cudnn = None
        if peers.torch_available():
            try:
                cudnn = time_gpu(sdpa_runs(q, k, v, causal, "cudnn")[0], runs=args.runs)
                cudnn = cudnn.tflops(flops)
            except Exception as exc:  # cuDNN refuses some shapes
                print(f"  cudnn: {type(exc).__name__}: {exc}", flush=True)
        tf = {name: t.tflops(flops) for name, t in found.items()}
        base = tf[str(configs[0])]
        cells = [
            f"{name} {x:6.1f} ({x / base:.3f}x"
            + (f", {x / cudnn:.3f}x cuDNN" if cudnn else "")
            + f", {same[name]})"
            for name, x in tf.items()
        ]
        print(f"hd{hd} {dt} causal={int(causal)} s{seqlen}: " + " | ".join(cells), flush=True)
        rows.append(dict(head_dim=hd, dtype=dt, causal=causal, seqlen=seqlen, batch=batch,
                         nheads=nheads, tflops=tf, cudnn_tflops=cudnn, agreement=same))  # fmt: skip
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
