"""Variable-length benchmark: a packed batch beside numflash's dense call and SDPA on padding.

One packed batch of ``--tokens`` tokens (32768) whose sequence lengths are drawn uniformly from
``--min-len``..``--max-len`` (64-8192, fixed seed; the last one is cut to make the total), one
process, numflash.timing.time_gpu (CUDA events, warm-up, median). For each dtype, head_dim and
mask, forward ("fwd") and backward ("bwd", the gradients from saved forward outputs):

- ``numflash-varlen``: attention_varlen / attention_varlen_backward on the packed rows;
- ``numflash-dense``: attention / attention_backward at seqlen ``--dense-seqlen`` (4096), batch
  tokens / seqlen: the speed the packed call is measured against;
- ``sdpa-flash-padded``: SDPA's FlashAttention-2 on the same sequences padded to the longest
  (batch = number of sequences), as a user without varlen would run them.

TFLOP/s count useful FLOPs only: per sequence for the packed batch and the padded one (the
padding's work is not counted), per batch row for the dense call.

    python benchmarks/bench_varlen.py [--dtypes float16 bfloat16] [--head-dims 64 128] [--sweep]

``--sweep`` also times the packed call with other tilings (``sweep_configs``) and tables the
chosen configuration's time against the fastest of them.

Writes benchmarks/results/varlen.json and varlen.md (and partial.json while it runs).
"""

import dataclasses
import itertools
import json
import os
import sys

import cupy
import numpy as np

import numflash
from numflash.device import current_device
from numflash.timing import attention_flops, time_gpu

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import peers  # noqa: E402
from bench_backward import sdpa_runs  # noqa: E402
from bench_forward import DTYPES  # noqa: E402


def draw_lengths(tokens, low, high, seed):
    """Lengths uniform in [low, high] until they hold ``tokens`` (the last one cut)."""
    rng = np.random.default_rng(seed)
    lengths = []
    while sum(lengths) < tokens:
        lengths.append(int(rng.integers(low, high + 1)))
    lengths[-1] -= sum(lengths) - tokens
    return lengths


def useful_flops(lengths, nheads, head_dim, causal, mode):
    return sum(attention_flops(1, nheads, n, n, head_dim, causal, mode) for n in lengths)


def varlen_runs(lengths, nheads, head_dim, dtype, causal, config=None, backward_config=None):
    """(forward, backward) of numflash's packed call (with these configurations if given)."""
    total = sum(lengths)
    q, k, v = (x[0] for x in peers.random_qkv(1, total, nheads, head_dim, dtype))
    dout = peers.random_qkv(1, total, nheads, head_dim, dtype, seed=5)[0][0]
    offsets = cupy.asarray(np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32))
    longest = max(lengths)
    args = (offsets, offsets, longest, longest)
    out, lse = numflash.attention_varlen(q, k, v, *args, causal=causal, return_lse=True)

    def fwd():
        return numflash.attention_varlen(q, k, v, *args, causal=causal, config=config)

    def bwd():
        return numflash.attention_varlen_backward(
            dout, q, k, v, out, lse, *args, causal=causal, config=backward_config
        )

    return fwd, bwd


def dense_runs(batch, seqlen, nheads, head_dim, dtype, causal):
    q, k, v = peers.random_qkv(batch, seqlen, nheads, head_dim, dtype)
    dout = peers.random_qkv(batch, seqlen, nheads, head_dim, dtype, seed=5)[0]
    out, lse = numflash.attention(q, k, v, causal=causal, return_lse=True)

    def fwd():
        return numflash.attention(q, k, v, causal=causal)

    def bwd():
        return numflash.attention_backward(dout, q, k, v, out, lse, causal=causal)

    return fwd, bwd


def padded_sdpa_runs(lengths, nheads, head_dim, dtype, causal):
    """(forward, backward) of SDPA FlashAttention-2 on (number of sequences, longest, ...): the
    rows past a sequence's length are padding whose results a user would discard."""
    q, k, v = peers.random_qkv(len(lengths), max(lengths), nheads, head_dim, dtype)
    bwd, _ = sdpa_runs(q, k, v, causal, "flash")
    return peers.sdpa_forward(q, k, v, causal, "flash"), bwd


def torch_varlen_runs(lengths, nheads, head_dim, dtype, causal):
    """(forward, backward) of ``torch.nn.attention.varlen.varlen_attn`` (FlashAttention-2's
    varlen kernel) on the same packed rows, the backward through autograd from one saved
    forward; (None, None) where this torch has no varlen_attn."""
    import torch

    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None, None
    total = sum(lengths)
    q, k, v = (
        torch.from_dlpack(x[0]).requires_grad_()
        for x in peers.random_qkv(1, total, nheads, head_dim, dtype)
    )
    dout = torch.from_dlpack(peers.random_qkv(1, total, nheads, head_dim, dtype, seed=5)[0][0])
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    cu = torch.from_dlpack(cupy.asarray(offsets))
    longest = max(lengths)
    window = (-1, 0) if causal else (-1, -1)

    def fwd():
        with torch.no_grad():
            return varlen_attn(q, k, v, cu, cu, longest, longest, window_size=window)

    out = varlen_attn(q, k, v, cu, cu, longest, longest, window_size=window)

    def bwd():
        return torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)

    return fwd, bwd


def sweep_configs(dtype, head_dim):
    """(forward, backward) configurations a packed call is also timed with under ``--sweep``:
    every tensor-core forward tiling shipped for this dtype and head_dim (any length bucket),
    the heuristic and the same with 64 query rows a block; the backward defaults of both tensor-core families and their
    neighbours."""
    from numflash import cache, selection
    from numflash.config import TensorCoreBackwardConfig, WgmmaBackwardConfig, config_from_dict

    device = current_device()
    default = selection.default_tensor_core_config(head_dim)
    forward = {default, dataclasses.replace(default, block_m=64)}
    for key, entry in cache.shipped_entries(device.arch).items():
        if (key.family, key.dtype, key.head_dim) == ("tensor-core", dtype, head_dim):
            forward.add(config_from_dict(entry["config"]))
    backward = [TensorCoreBackwardConfig(64, 8, 2), TensorCoreBackwardConfig(64, 4, 2),
                TensorCoreBackwardConfig(32, 4, 2)]  # fmt: skip
    if device.has_wgmma and head_dim in (64, 128):
        # the default (a packed batch runs its ring by cp.async), the ring with 64-row tiles,
        # two stages and one
        hopper = selection.default_config(WgmmaBackwardConfig.family, head_dim, device)[1]
        ring = WgmmaBackwardConfig(8, 3, ring=True, pingpong=True, tma=True)
        backward += [hopper, ring, WgmmaBackwardConfig(8, 2), WgmmaBackwardConfig(4, 2),
                     WgmmaBackwardConfig(8, 1)]  # fmt: skip
        backward = list(dict.fromkeys(backward))  # (at head_dim 128 the default is the ring)
    return sorted(forward, key=repr), backward


def bench(args, lengths):
    records = []
    for dtype, hd, causal in itertools.product(args.dtypes, args.head_dims, [False, True]):
        nheads = args.model_dim // hd
        dense_batch = max(1, args.tokens // args.dense_seqlen)
        providers = {
            "numflash-varlen": (
                lambda: varlen_runs(lengths, nheads, hd, DTYPES[dtype], causal),
                lambda mode: useful_flops(lengths, nheads, hd, causal, mode),
            ),
            "numflash-dense": (
                lambda: dense_runs(
                    dense_batch, args.dense_seqlen, nheads, hd, DTYPES[dtype], causal
                ),
                lambda mode: attention_flops(
                    dense_batch, nheads, args.dense_seqlen, args.dense_seqlen, hd, causal, mode
                ),
            ),
        }
        if args.sweep:

            def swept(forced):
                """The packed call's run of the forced configuration's mode alone."""
                fwd, bwd = varlen_runs(lengths, nheads, hd, DTYPES[dtype], causal, **forced)
                return (fwd, None) if "config" in forced else (None, bwd)

            forward, backward = sweep_configs(dtype, hd)
            for argument, configs in (("config", forward), ("backward_config", backward)):
                for cfg in configs:
                    providers[f"sweep {cfg!r}"] = (
                        lambda forced={argument: cfg}: swept(forced),
                        lambda mode: useful_flops(lengths, nheads, hd, causal, mode),
                    )
        if peers.torch_available():
            providers["torch-varlen"] = (
                lambda: torch_varlen_runs(lengths, nheads, hd, DTYPES[dtype], causal),
                lambda mode: useful_flops(lengths, nheads, hd, causal, mode),
            )
            providers["sdpa-flash-padded"] = (
                lambda: padded_sdpa_runs(lengths, nheads, hd, DTYPES[dtype], causal),
                lambda mode: useful_flops(lengths, nheads, hd, causal, mode),
            )
        for provider, (make, flops) in providers.items():
            runs = make()
            for mode, run in zip(("fwd", "bwd"), runs):
                if run is None:
                    continue
                t = time_gpu(run, warmup=5, runs=args.runs, max_total_ms=args.max_ms)
                shape = dict(head_dim=hd, nheads=nheads, causal=causal)
                rec = peers.record(t, flops(mode), provider, mode, dtype, **shape)
                records.append(rec)
                print(
                    f"{provider[:17]:17s} {mode:3s} {dtype:8s} hd{hd:<4d} causal={int(causal)} "
                    f"{t.median_ms:9.3f} ms {rec['tflops']:7.1f} TFLOP/s",
                    flush=True,
                )
            del runs
            cupy.get_default_memory_pool().free_all_blocks()
            with open(os.path.join(args.out_dir, "partial.json"), "w") as f:
                json.dump(records, f)  # what a run stopped early still leaves behind
    return records


def markdown(records, device, lengths):
    rows = {}
    for r in records:
        key = (r["mode"], r["dtype"], r["head_dim"], r["causal"])
        rows.setdefault(key, {})[r["provider"]] = r
    lines = [
        f"Packed batch on {device}: {len(lengths)} sequences, {sum(lengths)} tokens, lengths "
        f"{min(lengths)}-{max(lengths)}; useful TFLOP/s (median of CUDA-event timings). "
        "vs dense: packed / numflash dense at the same head_dim, mask and dtype; "
        "vs padded: SDPA FA2 time on the padded batch / packed time; vs varlen_attn: "
        "torch.nn.attention.varlen.varlen_attn's time on the same rows / packed time.",
        "",
        "| mode | dtype | head_dim | causal | packed | dense | SDPA FA2 padded | varlen_attn "
        "| vs dense | vs padded | vs varlen_attn |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for (mode, dtype, hd, causal), row in sorted(rows.items()):
        packed, dense = row.get("numflash-varlen"), row.get("numflash-dense")
        padded = row.get("sdpa-flash-padded")
        torch_varlen = row.get("torch-varlen")

        def cell(r):
            return f"{r['tflops']:.0f}" if r else "-"

        vs_dense = f"{packed['tflops'] / dense['tflops']:.2f}" if packed and dense else "-"
        vs_padded = f"{padded['ms'] / packed['ms']:.2f}x" if packed and padded else "-"
        vs_varlen = f"{torch_varlen['ms'] / packed['ms']:.2f}x" if packed and torch_varlen else "-"
        lines.append(
            f"| {mode} | {dtype} | {hd} | {'yes' if causal else 'no'} | {cell(packed)} | "
            f"{cell(dense)} | {cell(padded)} | {cell(torch_varlen)} | {vs_dense} | {vs_padded} "
            f"| {vs_varlen} |"
        )
    swept = {key: row for key, row in rows.items() if any(p.startswith("sweep") for p in row)}
    if swept:
        lines += [
            "",
            "The configuration numflash chose (from the dense keys of the max lengths) beside "
            "the fastest of the tilings swept: chosen time / fastest time.",
            "",
            "| mode | dtype | head_dim | causal | chosen ms | fastest ms | fastest | ratio |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for (mode, dtype, hd, causal), row in sorted(swept.items()):
            chosen = row.get("numflash-varlen")
            name, best = min(
                ((p, r) for p, r in row.items() if p.startswith("sweep")),
                key=lambda item: item[1]["ms"],
            )
            if chosen:
                lines.append(
                    f"| {mode} | {dtype} | {hd} | {'yes' if causal else 'no'} | "
                    f"{chosen['ms']:.3f} | {best['ms']:.3f} | {name[6:]} | "
                    f"{chosen['ms'] / best['ms']:.2f} |"
                )
    return "\n".join(lines) + "\n"


def main():
    ap = peers.parser(__doc__, head_dims=(64, 128))
    ap.add_argument("--tokens", type=int, default=32768, help="tokens in the packed batch")
    ap.add_argument("--min-len", type=int, default=64)
    ap.add_argument("--max-len", type=int, default=8192)
    ap.add_argument("--seed", type=int, default=0, help="of the drawn lengths")
    ap.add_argument("--dense-seqlen", type=int, default=4096)
    ap.add_argument("--model-dim", type=int, default=2048, help="nheads * head_dim")
    ap.add_argument("--runs", type=int, default=10)
    ap.add_argument("--max-ms", type=float, default=3000.0, help="GPU time one timing may use")
    ap.add_argument(
        "--sweep",
        action="store_true",
        help="also time the packed call with other tilings (sweep_configs): is the choice "
        "reused from the dense keys as good?",
    )
    args = ap.parse_args()
    os.makedirs(args.out_dir, exist_ok=True)  # partial.json goes there during the run
    lengths = draw_lengths(args.tokens, args.min_len, args.max_len, args.seed)
    dev = current_device()
    records = bench(args, lengths)
    table = markdown(records, dev.name, lengths)
    peers.save_results(args.out_dir, "varlen", dev, records, table, lengths=lengths)
    os.remove(os.path.join(args.out_dir, "partial.json"))


if __name__ == "__main__":
    main()
