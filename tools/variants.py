"""Check and time tensor-core configurations side by side with SDPA's FlashAttention-2.

For each (head_dim, dtype, causal) every feasible configuration of a grid is first checked
against the float64 reference on fresh random inputs, then timed on the benchmark shape; the
peer runs in the same process on the same inputs. Used to choose the shipped defaults before the
autotuner exists and to study what limits the kernel.

    python tools/variants.py --head-dims 64 128 --seqlens 4096 --out results.json
"""

import argparse
import itertools
import json
import os
import sys
import time

import cupy
import numpy as np

import numflash
from numflash import reference
from numflash.arrays import from_float
from numflash.config import TensorCoreConfig
from numflash.device import current_device
from numflash.selection import default_tensor_core_config
from numflash.timing import attention_flops, time_gpu

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks"))
import peers  # noqa: E402


def check(cfg, head_dim, dtype, causal, seed):
    """max error against the float64 reference, and the bar it must stay under."""
    q, k, v = peers.random_qkv(1, 777, 4, head_dim, dtype, seed)
    out = from_float(cupy.full(q.shape, cupy.nan, dtype=cupy.float32), q.dtype)  # poisoned
    out, lse = numflash.attention(q, k, v, causal=causal, out=out, config=cfg, return_lse=True)
    result = reference.check(q, k, v, out, lse, causal=causal)
    return (result.err if result.ok else float("inf")), result.bar


GRIDS = {
    "small": dict(
        block_m=(64, 128),
        block_n=(64, 128),
        num_warps=(4, 8),
        stages=(2, 3),
        q_in_registers=(True,),
    ),
    "full": dict(
        block_m=(64, 128),
        block_n=(32, 64, 128),
        num_warps=(4, 8),
        stages=(2, 3),
        q_in_registers=(True, False),
    ),
}


#: Hand-picked candidates per head_dim (block_m, block_n, num_warps, stages, q_in_registers).
FOCUS = {
    64: [(128, 64, 4, 2, True), (128, 64, 4, 3, True), (128, 128, 4, 2, True),
         (128, 64, 8, 2, True), (128, 128, 8, 2, True), (64, 128, 4, 2, True),
         (128, 64, 4, 2, False)],
    128: [(128, 64, 8, 2, True), (128, 64, 8, 3, True), (128, 32, 4, 2, False),
          (128, 32, 4, 3, False), (128, 64, 4, 2, False), (64, 32, 4, 2, True),
          (128, 128, 8, 2, True), (64, 64, 4, 3, True)],
}  # fmt: skip
#: Zero-spill candidates (ptxas report, sm_90a) for choosing the defaults.
NO_SPILL = {
    64: [(128, 64, 4, 2, False), (128, 64, 4, 3, False), (64, 64, 4, 2, True)],
    128: [
        (128, 32, 4, 2, False),
        (128, 32, 4, 3, False),
        (64, 64, 4, 2, True),
        (128, 64, 8, 2, True),
    ],
    256: [(64, 32, 4, 2, False), (64, 32, 4, 3, False), (64, 16, 4, 2, False)],
}


def grid(head_dim, name):
    if name in ("focus", "no-spill"):
        table = FOCUS if name == "focus" else NO_SPILL
        yield from (TensorCoreConfig(*c) for c in table.get(head_dim, []))
        return
    g = GRIDS[name]
    for bm, bn, nw, st, qr in itertools.product(
        g["block_m"], g["block_n"], g["num_warps"], g["stages"], g["q_in_registers"]
    ):
        cfg = TensorCoreConfig(bm, bn, nw, st, qr)
        if not cfg.problems(head_dim, current_device()):
            yield cfg


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    peers.add_problem_arguments(ap)
    ap.set_defaults(head_dims=[64, 128])
    ap.add_argument("--grid", choices=["default", "focus", "no-spill", *GRIDS], default="focus")
    args = ap.parse_args()
    dev = current_device()
    rows = []
    for hd, dt, dtype, causal, seqlen, batch, nheads in peers.problems(args):
        q, k, v = peers.random_qkv(batch, seqlen, nheads, hd, dtype, seed=1)
        flops = attention_flops(batch, nheads, seqlen, seqlen, hd, causal)
        peer = None
        if peers.torch_available():
            peer = time_gpu(peers.sdpa_forward(q, k, v, causal, "flash")).tflops(flops)
        default = default_tensor_core_config(hd)
        cfgs = [default]
        if args.grid != "default":
            cfgs += [c for c in grid(hd, args.grid) if c != default]
        for i, cfg in enumerate(cfgs):
            t0 = time.time()
            try:
                err, bar = check(cfg, hd, dtype, causal, seed=100 + i)
                tf = time_gpu(peers.numflash_forward(q, k, v, causal, cfg)).tflops(flops)
            except Exception as exc:  # a variant that fails to build or launch is reported
                print(f"  {cfg}: FAILED {type(exc).__name__}: {exc}", flush=True)
                continue
            row = dict(head_dim=hd, dtype=dt, causal=causal, seqlen=seqlen, batch=batch,
                       nheads=nheads, config=cfg.to_dict(), tflops=tf, sdpa_flash=peer,
                       ratio=tf / peer if peer else None, err=err, bar=bar, ok=err <= bar,
                       default=cfg == default)  # fmt: skip
            rows.append(row)
            print(
                f"hd{hd} {dt} causal={causal} s{seqlen} {cfg.block_m}x{cfg.block_n} "
                f"w{cfg.num_warps} st{cfg.stages} qr={int(cfg.q_in_registers)}: "
                f"{tf:6.1f} TFLOP/s  sdpa-flash {peer or float('nan'):6.1f}  "
                f"ratio {row['ratio'] or float('nan'):.3f}  err {err:.2e} (bar {bar:.2e}) "
                f"{'ok' if row['ok'] else 'WRONG'}  [{time.time() - t0:.1f}s]",
                flush=True,
            )
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": dev.name, "rows": rows}, f, indent=1)
    best = {}
    for r in rows:
        key = (r["head_dim"], r["dtype"], r["causal"], r["seqlen"])
        if r["ok"] and (key not in best or r["tflops"] > best[key]["tflops"]):
            best[key] = r
    print("\nbest per key:")
    for key, r in sorted(best.items()):
        print(f"  {key}: {r['config']} {r['tflops']:.1f} TFLOP/s ratio {r['ratio']}")
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    np.seterr(all="ignore")
    sys.exit(main())
