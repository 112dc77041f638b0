"""Check and time Hopper forward (wgmma) configurations beside SDPA's FlashAttention-2 and cuDNN.

First every configuration named runs a set of awkward problems (GQA, masks, odd lengths, head
dims that are not a multiple of 64, a packed batch) against the float64 reference, outputs
poisoned with NaN; then each is timed on the benchmark shapes (batch x seqlen = --tokens, heads
x head_dim = --model-dim), the peers in the same process on the same inputs. One call of the
GPU machine answers which tiles to ship and how far from cuDNN they are.

    python tools/hopper_forward.py --configs 8,128,3 8,64,4 --head-dims 64 128 --seqlens 4096
"""

import argparse
import json
import os
import sys
import time

import cupy
import numpy as np

import numflash
from numflash import reference
from numflash.arrays import from_float
from numflash.config import WgmmaForwardConfig
from numflash.device import current_device
from numflash.selection import default_tensor_core_config
from numflash.timing import attention_flops, time_gpu

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks"))
import peers  # noqa: E402

#: (batch, seqlen_q, seqlen_k, nheads, nheads_k, causal, window): the awkward problems.
CHECKS = [
    (2, 333, 333, 4, 2, False, (-1, -1)),
    (1, 777, 1023, 4, 1, True, (-1, -1)),
    (2, 203, 113, 2, 2, True, (-1, -1)),  # rows that see no key
    (1, 1, 300, 2, 2, False, (-1, -1)),
    (1, 600, 600, 2, 1, False, (100, 0)),
]


def poisoned(shape, dtype):
    return from_float(cupy.full(shape, cupy.nan, dtype=cupy.float32), dtype)


def check_dense(cfg, head_dim, dtype, seed):
    """The worst (err / bar) over CHECKS, and the first failure's description."""
    worst, failure = 0.0, None
    rng = cupy.random.default_rng(seed)
    for b, sq, sk, h, hk, causal, window in CHECKS:
        q, k, v = (
            from_float(rng.standard_normal((b, s, n, head_dim), dtype=cupy.float32), dtype)
            for s, n in ((sq, h), (sk, hk), (sk, hk))
        )
        out = poisoned(q.shape, q.dtype)
        kw = dict(causal=causal, window_size=window)
        out, lse = numflash.attention(q, k, v, out=out, config=cfg, return_lse=True, **kw)
        res = reference.check(q, k, v, out, lse, **kw)
        ratio = max(res.err / res.bar, res.lse_err / res.lse_bar if res.lse_bar else 0.0)
        if res.nan:
            ratio = float("inf")
        if res.nan or not res.ok:
            failure = failure or f"{(b, sq, sk, h, hk, causal, window)}: {res}"
        worst = max(worst, ratio)
    return worst, failure


def check_varlen(cfg, head_dim, dtype, seed):
    """A packed batch with an empty sequence, causal, GQA: (err / bar, failure)."""
    lengths = [37, 0, 300, 129, 1]
    cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    total = int(cu[-1])
    rng = cupy.random.default_rng(seed)
    q = from_float(rng.standard_normal((total, 4, head_dim), dtype=cupy.float32), dtype)
    k, v = (
        from_float(rng.standard_normal((total, 2, head_dim), dtype=cupy.float32), dtype)
        for _ in range(2)
    )
    out = poisoned(q.shape, q.dtype)
    cu_d = cupy.asarray(cu)
    out = numflash.attention_varlen(
        q, k, v, cu_d, cu_d, max(lengths), max(lengths), causal=True, out=out, config=cfg
    )
    worst = 0.0
    for i, n in enumerate(lengths):
        if n == 0:
            continue
        s = slice(int(cu[i]), int(cu[i + 1]))
        res = reference.check(q[None, s], k[None, s], v[None, s], out[None, s], causal=True)
        if res.nan or not res.ok:
            return float("inf"), f"varlen sequence {i} ({n} rows): {res}"
        worst = max(worst, res.err / res.bar)
    return worst, None


def parse_config(text):
    """consumers,block_n,stages[,p (a producer)][,pp (pingpong)][,t (TMA loads)][,e1 or e2
    (fma_exp2)], e.g. 2,128,2,p,pp,t,e2"""
    parts = text.split(",")
    consumers, block_n, stages = (int(x) for x in parts[:3])
    flags = parts[3:]
    fma_exp2 = next((int(f[1:]) for f in flags if f in ("e1", "e2")), 0)
    return WgmmaForwardConfig(
        consumers, block_n, stages, producer="p" in flags, pingpong="pp" in flags,
        tma="t" in flags, fma_exp2=fma_exp2,
    )  # fmt: skip


def no_loader(chunks, threads, padded_chunks=None):
    """A swizzled row loader's stand-in (kernels/loads.py) whose ``load_rows`` does nothing:
    the "loads" ablation of this tool and tools/backward_ab.py."""
    from numflash.kernels.jit import device_function

    @device_function
    def load_rows(dst, src, first, stride, rows_left, nrows, atom_bytes, tid):
        pass

    return load_rows


def ablate(parts):
    """Take parts out of the kernels about to be built, to see what limits them (the results
    are wrong, so use with --no-check): "loads" makes cp.async tile loads do nothing (the
    schedules without TMA), "exp" replaces exp2 by a multiplication. Must run before any
    kernel is built."""
    from numba import float32

    from numflash.kernels import forward_sm90, ptx
    from numflash.kernels.jit import device_function

    if "loads" in parts:
        forward_sm90.swizzled_row_loader = no_loader
    if "exp" in parts:

        @device_function
        def scaled(x):
            return x * float32(0.001)

        ptx.exp2 = scaled


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    peers.add_problem_arguments(ap)
    ap.add_argument("--ablate", nargs="+", choices=["loads", "exp"], default=[],
                    help=ablate.__doc__.split(":")[0])  # fmt: skip
    ap.add_argument("--configs", nargs="+", required=True, help=parse_config.__doc__)
    ap.add_argument("--no-check", action="store_true")
    ap.add_argument("--no-peers", action="store_true")
    ap.add_argument("--runs", type=int, default=20)
    args = ap.parse_args()
    if args.ablate:
        ablate(args.ablate)
        args.no_check = True
    configs = [parse_config(c) for c in args.configs]
    rows = []
    checked = {}
    for hd, dt, dtype, causal, seqlen, batch, nheads in peers.problems(args):
        usable = [c for c in configs if not c.problems(hd, current_device())]
        for c in configs:
            if c not in usable:
                print(f"skipped {c} at hd{hd}: {c.problems(hd, current_device())}", flush=True)
        if not args.no_check:
            for cfg in usable:
                if (cfg, hd, dt) in checked:
                    continue
                t0 = time.time()
                worst, failure = check_dense(cfg, hd, dtype, seed=hd)
                vworst, vfailure = check_varlen(cfg, hd, dtype, seed=hd + 1)
                checked[(cfg, hd, dt)] = max(worst, vworst)
                status = "ok" if max(worst, vworst) <= 1 else "WRONG"
                print(
                    f"check hd{hd} {dt} {cfg}: err/bar dense {worst:.3f} varlen {vworst:.3f} "
                    f"{status} [{time.time() - t0:.1f}s]",
                    flush=True,
                )
                for f in (failure, vfailure):
                    if f:
                        print("   ", f, flush=True)
        q, k, v = peers.random_qkv(batch, seqlen, nheads, hd, dtype, seed=1)
        flops = attention_flops(batch, nheads, seqlen, seqlen, hd, causal)
        found = {}
        if not args.no_peers and peers.torch_available():
            for name in ("flash", "cudnn"):
                try:
                    fn = peers.sdpa_forward(q, k, v, causal, name)
                    found[name] = time_gpu(fn, runs=args.runs).tflops(flops)
                except Exception as exc:  # cuDNN refuses some shapes
                    print(f"  sdpa {name}: {type(exc).__name__}: {exc}", flush=True)
        mma = time_gpu(
            peers.numflash_forward(q, k, v, causal, default_tensor_core_config(hd)), runs=args.runs
        )
        found["mma.sync"] = mma.tflops(flops)
        for cfg in usable:
            try:
                tf = time_gpu(peers.numflash_forward(q, k, v, causal, cfg), runs=args.runs)
                tf = tf.tflops(flops)
            except Exception as exc:
                print(f"  {cfg}: FAILED {type(exc).__name__}: {exc}", flush=True)
                continue
            row = dict(head_dim=hd, dtype=dt, causal=causal, seqlen=seqlen, batch=batch,
                       nheads=nheads, config=cfg.to_dict(), tflops=tf, peers=found,
                       ok=checked.get((cfg, hd, dt), 0.0) <= 1)  # fmt: skip
            rows.append(row)
            cudnn = found.get("cudnn")
            print(
                f"hd{hd} {dt} causal={int(causal)} s{seqlen} c{cfg.consumers} n{cfg.block_n} "
                f"st{cfg.stages} p{int(cfg.producer)} pp{int(cfg.pingpong)} t{int(cfg.tma)} "
                f"e{cfg.fma_exp2}: "
                f"{tf:6.1f} TFLOP/s | "
                f"FA2 {found.get('flash', float('nan')):6.1f} "
                f"cuDNN {cudnn or float('nan'):6.1f} mma.sync {found['mma.sync']:6.1f} | "
                f"x cuDNN {tf / cudnn if cudnn else float('nan'):.3f}",
                flush=True,
            )
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"rows": rows, "checked": [
                dict(config=c.to_dict(), head_dim=h, dtype=d, worst=w)
                for (c, h, d), w in checked.items()]}, f, indent=1)  # fmt: skip
    return 0 if all(w <= 1 for w in checked.values()) else 1


if __name__ == "__main__":
    np.seterr(all="ignore")
    sys.exit(main())
