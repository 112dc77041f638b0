"""The Hopper forward's work order against the alternating rounds it replaced, on a GPU.

    python tools/work_order.py [--head-dims 64 128 256] [--seqlens 1024 4096 16384]
                               [--dtypes float16] [--causal both] [--runs 20] [--rounds 3]
                               [--window N] [--out PATH]

A persistent dense launch takes its work tiles from the order families.wgmma_forward.work_order
makes. For each problem (batch x seqlen = --tokens, heads x head_dim = --model-dim) this times
the default configuration's call in one process with that order and with ALTERNATING (rounds
of a tile a block alternating in direction, which the kernel works out itself), the two
taking turns --rounds times, each keeping its fastest round, and compares their outputs (the
same tiles, so the same bits); cuDNN's forward beside them where PyTorch is there. It prints
the gain the cost model (tile_costs) predicts beside the one measured. ``--window N`` adds a
candidate order to the turns (window_order: LPT within windows of N rounds), for trying one
before work_order takes it.
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
    return wgmma_forward.listed_order(wgmma_forward._alternating(tiles, blocks), blocks)


def window_order(rounds):
    """A candidate order, not numflash's: the tiles of each window of ``rounds`` rounds (in
    rank order) to the least-loaded blocks, costliest first (LPT within the window), so a
    block may take none or several tiles of a window. In tile_costs' model, windows of two
    rounds take head_dim 256 causal at 1024 keys from 1.066x the balanced share (work_order)
    to 1.020x."""

    def make(p, block_m, block_n, section, blocks):
        cost = wgmma_forward.tile_costs(p, block_m, block_n, section)
        load = np.zeros(blocks)
        owner = np.empty(len(cost), dtype=np.int64)
        for start in range(0, len(cost), blocks * rounds):
            window = np.arange(start, min(start + blocks * rounds, len(cost)))
            for rank in window[np.argsort(-cost[window], kind="stable")]:
                owner[rank] = taker = int(np.argmin(load))
                load[taker] += cost[rank]
        return wgmma_forward.listed_order(owner, blocks)

    return make


def spans(p, cfg, head_dim, arms):
    """{arm: its makespan over the balanced share in tile_costs' model}."""
    section = wgmma_forward._wgmma_work(p, head_dim)[-1]
    blocks = wgmma_forward._wgmma_grid(cfg, p)[0]
    cost = wgmma_forward.tile_costs(p, cfg.block_m, cfg.block_n, section)
    out = {}
    for name, make in arms.items():
        order = _as_list(make(p, cfg.block_m, cfg.block_n, section, blocks), p, cfg.block_m, blocks)
        offsets, ranks = order[: blocks + 1], order[blocks + 1 :]
        most = max(cost[ranks[offsets[x] : offsets[x + 1]]].sum() for x in range(blocks))
        out[name] = most / (cost.sum() / blocks)
    return out


def _line(row):
    """A row as the tool prints it: each order's TFLOP/s, and its gain over the alternation
    measured and in the model."""
    tf, span, cudnn = row["tflops"], row["model_span"], row["cudnn_tflops"]
    problem = f"hd{row['head_dim']} {row['dtype']} causal={int(row['causal'])} s{row['seqlen']}"
    arms = [f"alternating {tf['alternating']:6.1f}"] + [
        f"{name} {tf[name]:6.1f} (gain {tf[name] / tf['alternating']:.3f}, model "
        f"{span['alternating'] / span[name]:.3f})"
        for name in tf
        if name != "alternating"
    ]
    ratio = f"{tf['ordered'] / cudnn:.3f}" if cudnn else "-"
    same = f"same bits {row['same_bits']}"
    return f"{problem}: {', '.join(arms)} TFLOP/s | ordered x cuDNN {ratio} | {same}"


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    peers.add_problem_arguments(ap)
    ap.set_defaults(head_dims=[64, 128, 256], seqlens=[1024, 4096, 16384])
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--window", type=int, default=0,
                    help="also time window_order of this many rounds (0: not)")  # fmt: skip
    args = ap.parse_args()
    made = wgmma_forward.work_order
    arms = {"alternating": alternating_order, "ordered": made}
    if args.window:
        arms[f"window{args.window}"] = window_order(args.window)
    rows = []
    for hd, dt, dtype, causal, seqlen, batch, nheads in peers.problems(args):
        q, k, v = peers.random_qkv(batch, seqlen, nheads, hd, dtype, seed=1)
        p = numflash.validation.problem(q, k, v, causal, None, (-1, -1))[-1]
        cfg = selection.forward(p, current_device()).config
        if not isinstance(cfg, wgmma_forward.WgmmaForwardConfig):
            print(f"hd{hd}: the default is {type(cfg).__name__}, not the Hopper forward")
            continue
        flops = attention_flops(batch, nheads, seqlen, seqlen, hd, causal)
        # the orders take turns --rounds times, each keeping its fastest round (the GPU's
        # speed drifts over a minute); each turn builds its launch anew
        found, outs = {}, {}
        for _ in range(args.rounds):
            for name, make in arms.items():
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
        bits = [out.view(np.uint16) for out in outs.values()]
        same = all(bool((x == bits[0]).all()) for x in bits[1:])
        cudnn = None
        if peers.torch_available():
            try:
                cudnn = time_gpu(peers.sdpa_forward(q, k, v, causal, "cudnn"), runs=args.runs)
            except Exception as exc:  # cuDNN refuses some shapes
                print(f"  cudnn: {type(exc).__name__}: {exc}")
        tf = {name: t.tflops(flops) for name, t in found.items()}
        row = dict(head_dim=hd, dtype=dt, causal=causal, seqlen=seqlen, batch=batch,
                   nheads=nheads, config=cfg.to_dict(), tflops=tf, same_bits=same,
                   cudnn_tflops=cudnn.tflops(flops) if cudnn else None,
                   model_span=spans(p, cfg, hd, arms))  # fmt: skip
        rows.append(row)
        print(_line(row), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps({"device": current_device().name, "rows": rows}))
    return 0 if all(r["same_bits"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
