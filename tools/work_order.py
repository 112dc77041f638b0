"""The Hopper forward's work order against the alternating rounds it replaced, on a GPU.

    python tools/work_order.py [--head-dims 64 128 256] [--seqlens 1024 4096 16384]
                               [--dtypes float16] [--causal both] [--runs 20] [--out PATH]

A persistent dense launch takes its work tiles from the order families.wgmma_forward.work_order
makes. For each problem (batch x seqlen = --tokens, heads x head_dim = --model-dim) this times
the default configuration's call in one process with that order and with ALTERNATING (rounds
of a tile a block alternating in direction, which the kernel works out itself), the two
taking turns --rounds times, each keeping its fastest round, and compares their outputs (the
same tiles, so the same bits); cuDNN's forward beside them where PyTorch is there. It prints
the gain the cost model (tile_costs) predicts beside the one measured.
"""

import argparse
import json
import os
import sys
from pathlib import Path

import numpy as np

import numflash
from numflash import api, launch, selection
from numflash.device import current_device
from numflash.families import wgmma_forward
from numflash.timing import attention_flops, time_gpu

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks"))
import peers  # noqa: E402


def alternating_order(p, block_m, block_n, section, blocks):
    """work_order's answer for the rounds alternating in direction."""
    return wgmma_forward.ALTERNATING


def _as_list(order, p, block_m, blocks):
    """An order as work_order's list, ALTERNATING worked out as the kernel does."""
    if order is not wgmma_forward.ALTERNATING:
        return order
    tiles = launch._ceil_div(p.seqlen_q, block_m) * p.nheads * p.batch
    owner = wgmma_forward._alternating(tiles, blocks)
    ranks = np.argsort(owner, kind="stable")
    offsets = np.searchsorted(owner[ranks], np.arange(blocks + 1))
    return np.concatenate([offsets, ranks])


def spans(p, cfg, head_dim):
    """(alternating, ordered) makespans over the balanced share, in tile_costs' model."""
    section = wgmma_forward._wgmma_work(p, head_dim)[-1]
    blocks = wgmma_forward._wgmma_grid(cfg, p)[0]
    cost = wgmma_forward.tile_costs(p, cfg.block_m, cfg.block_n, section)
    ideal = cost.sum() / blocks
    out = []
    for make in (alternating_order, wgmma_forward.work_order):
        order = _as_list(make(p, cfg.block_m, cfg.block_n, section, blocks), p, cfg.block_m, blocks)
        offsets, ranks = order[: blocks + 1], order[blocks + 1 :]
        out.append(max(cost[ranks[offsets[x] : offsets[x + 1]]].sum() for x in range(blocks)))
    return out[0] / ideal, out[1] / ideal


def _line(row):
    """A row as the tool prints it."""
    tf, span, cudnn = row["tflops"], row["model_span"], row["cudnn_tflops"]
    gain, model = tf["ordered"] / tf["alternating"], span["alternating"] / span["ordered"]
    ratio = f"{tf['ordered'] / cudnn:.3f}" if cudnn else "-"
    problem = f"hd{row['head_dim']} {row['dtype']} causal={int(row['causal'])} s{row['seqlen']}"
    timed = f"alternating {tf['alternating']:6.1f} ordered {tf['ordered']:6.1f} TFLOP/s"
    return (
        f"{problem}: {timed}, gain {gain:.3f} (model {model:.3f}) | x cuDNN {ratio} | "
        f"same bits {row['same_bits']}"
    )


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    peers.add_problem_arguments(ap)
    ap.set_defaults(head_dims=[64, 128, 256], seqlens=[1024, 4096, 16384])
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    rows = []
    for hd, dt, dtype, causal, seqlen, batch, nheads in peers.problems(args):
        q, k, v = peers.random_qkv(batch, seqlen, nheads, hd, dtype, seed=1)
        p = numflash.validation.problem(q, k, v, causal, None, (-1, -1))[-1]
        cfg = selection.forward(p, current_device()).config
        if not isinstance(cfg, wgmma_forward.WgmmaForwardConfig):
            print(f"hd{hd}: the default is {type(cfg).__name__}, not the Hopper forward")
            continue
        flops = attention_flops(batch, nheads, seqlen, seqlen, hd, causal)
        # the two orders take turns --rounds times, each keeping its fastest round (the GPU's
        # speed drifts over a minute); each turn builds its launch anew
        made = wgmma_forward.work_order
        found, outs = {}, {}
        for _ in range(args.rounds):
            for name, make in (("alternating", alternating_order), ("ordered", made)):
                wgmma_forward.work_order = make
                wgmma_forward._orders.clear()
                launch._prepared.clear()
                api._plans.clear()
                try:
                    call = peers.numflash_forward(q, k, v, causal)
                    outs[name] = call()
                    t = time_gpu(call, runs=args.runs)
                finally:
                    wgmma_forward.work_order = made
                if name not in found or t.median_ms < found[name].median_ms:
                    found[name] = t
        same = bool((outs["alternating"].view(np.uint16) == outs["ordered"].view(np.uint16)).all())
        cudnn = None
        if peers.torch_available():
            try:
                cudnn = time_gpu(peers.sdpa_forward(q, k, v, causal, "cudnn"), runs=args.runs)
            except Exception as exc:  # cuDNN refuses some shapes
                print(f"  cudnn: {type(exc).__name__}: {exc}")
        alternating, ordered = spans(p, cfg, hd)
        tf = {name: t.tflops(flops) for name, t in found.items()}
        row = dict(head_dim=hd, dtype=dt, causal=causal, seqlen=seqlen, batch=batch,
                   nheads=nheads, config=cfg.to_dict(), tflops=tf, same_bits=same,
                   cudnn_tflops=cudnn.tflops(flops) if cudnn else None,
                   model_span=dict(alternating=alternating, ordered=ordered))  # fmt: skip
        rows.append(row)
        print(_line(row), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps({"device": current_device().name, "rows": rows}))
    return 0 if all(r["same_bits"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
