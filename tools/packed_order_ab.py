"""A packed batch's Hopper forward with its work order made on the device and without it
(the alternating rounds over every slot), beside varlen_attn (GPU, compute capability 9.x).

    python tools/packed_order_ab.py [--tokens 65536] [--max-len 4096] [--rounds 2]
        [--head-dims 64 128] [--dtypes float16 bfloat16] [--sequences given]
        [--configs 2,128,2,p,t ...] [--order-rounds N] [--json PATH]

One packed batch (benchmarks/bench_varlen.py's draw_lengths: lengths uniform in 64..max-len,
seed 0), model dim 2048, the head dims and dtypes asked for, causal and not; ``--sequences``
puts the same lengths in another order (``longest-first``, ``longest-last``) or gives every
sequence the mean length (``equal``: the same tokens, no row block past a sequence's end
but the last); each way in a process of its own (families.wgmma_forward.DEVICE_PACKED_ORDER
and DEVICE_PACKED_ORDER_MASKED set before the first call, PACKED_ORDER_ROUNDS as it stands
or ``--order-rounds``: 0 times small batches through the order too),
the processes taking turns ``--rounds`` times; each figure the fastest round's median of 30
CUDA-event timings, useful TFLOP/s. varlen_attn
(torch.nn.attention.varlen, FlashAttention-2's varlen kernel) runs in the first way's process.
``--configs`` also times each Hopper forward configuration named (tools/hopper_forward.py's
form: consumers,block_n,stages[,p][,pp][,t][,e1|e2]) beside numflash's choice, each case's
varlen_attn figure standing beside all of them.
"""

import argparse
import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def arranged(lengths, sequences):
    """``lengths`` in the order (or the equal lengths) ``--sequences`` asks for."""
    if sequences == "equal":
        n = len(lengths)
        return [sum(lengths) // n + (i < sum(lengths) % n) for i in range(n)]
    if sequences == "given":
        return lengths
    return sorted(lengths, reverse=sequences == "longest-first")


def child(mode, tokens, max_len, head_dims, dtypes, sequences, configs=(), order_rounds=None):
    """{case: (packed ms, varlen_attn ms or None, TFLOP of the case)} in this process."""
    sys.path.insert(0, os.path.join(HERE, "..", "benchmarks"))
    sys.path.insert(0, HERE)
    from numflash.families import wgmma_forward

    wgmma_forward.DEVICE_PACKED_ORDER = wgmma_forward.DEVICE_PACKED_ORDER_MASKED = mode == "on"
    if order_rounds is not None:
        wgmma_forward.PACKED_ORDER_ROUNDS = order_rounds
    from bench_varlen import draw_lengths, torch_varlen_runs, useful_flops, varlen_runs
    from hopper_forward import parse_config

    from numflash.timing import time_gpu

    lengths = arranged(draw_lengths(tokens, 64, max_len, 0), sequences)
    found = {}
    for dtype, hd, causal in [(d, h, c) for d in dtypes for h in head_dims for c in (True, False)]:
        nheads = 2048 // hd
        peer = None
        if mode == "on":
            theirs, _ = torch_varlen_runs(lengths, nheads, hd, dtype, causal)
            peer = time_gpu(theirs, runs=30).median_ms if theirs is not None else None
        flops = useful_flops(lengths, nheads, hd, causal, "fwd") / 1e12
        case = f"{dtype} d{hd} {'causal' if causal else 'full'}"
        for text in (None, *configs):
            config = parse_config(text) if text else None
            fwd, _ = varlen_runs(lengths, nheads, hd, dtype, causal, config=config)
            ms = time_gpu(fwd, runs=30).median_ms
            found[f"{case} [{text}]" if text else case] = (ms, peer, flops)
    print(json.dumps(found))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=65536)
    parser.add_argument("--max-len", type=int, default=4096)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--head-dims", type=int, nargs="+", default=[64, 128])
    parser.add_argument("--dtypes", nargs="+", default=["float16", "bfloat16"])
    parser.add_argument(
        "--sequences", choices=("given", "longest-first", "longest-last", "equal"),
        default="given",
    )  # fmt: skip
    parser.add_argument("--configs", nargs="*", default=[])
    parser.add_argument("--order-rounds", type=int, default=None)
    parser.add_argument("--json", default=None)
    parser.add_argument("--child", choices=("on", "off"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(args.child, args.tokens, args.max_len, args.head_dims, args.dtypes,
                     args.sequences, args.configs, args.order_rounds)  # fmt: skip
    best = {}
    for _ in range(args.rounds):
        for mode in ("on", "off"):
            done = subprocess.run(
                [sys.executable, __file__, "--child", mode, "--tokens", str(args.tokens),
                 "--max-len", str(args.max_len), "--head-dims", *map(str, args.head_dims),
                 "--dtypes", *args.dtypes, "--sequences", args.sequences,
                 "--configs", *args.configs,
                 *(["--order-rounds", str(args.order_rounds)] if args.order_rounds is not None
                   else [])],
                capture_output=True, text=True,
            )  # fmt: skip
            if done.returncode:
                raise SystemExit(f"the {mode} process failed:\n{done.stderr[-3000:]}")
            for case, (ms, peer, flops) in json.loads(done.stdout.splitlines()[-1]).items():
                row = best.setdefault(case, {"flops": flops})
                row[mode] = min(row.get(mode, float("inf")), ms)
                if peer is not None:
                    row["varlen_attn"] = min(row.get("varlen_attn", float("inf")), peer)
    print("| case | order on | order off | on / off | varlen_attn | on / varlen_attn |")
    print("|---|---|---|---|---|---|")
    for case, row in best.items():
        on, off, peer, flops = row["on"], row["off"], row.get("varlen_attn"), row["flops"]
        theirs = f"{flops / peer * 1e3:.1f} | {peer / on:.3f}x" if peer else "- | -"
        print(f"| {case} | {flops / on * 1e3:.1f} | {flops / off * 1e3:.1f} | "
              f"{off / on:.3f}x | {theirs} |")  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump(best, f, indent=1)


if __name__ == "__main__":
    main()
