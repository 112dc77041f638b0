"""Forward-pass benchmark: numflash beside SDPA (FlashAttention-2, cuDNN) and naive CuPy.

Every number comes from one process on one GPU, each provider timed on the same inputs with
numflash.timing.time_gpu (CUDA events, warm-up, median, L2 flushed between runs).

    python benchmarks/bench_forward.py                 # the full table (a few minutes on an H200)
    python benchmarks/bench_forward.py --quick         # head_dim 128, fp16, three seqlens

Writes benchmarks/results/latest.json, latest.md and PNG plots (TFLOP/s and peak memory against
seqlen) unless --out-dir says elsewhere. ``peak_bytes`` is the device memory a call allocates
beyond its inputs, at its peak.
"""

import itertools
import json
import os
import sys

import cupy

from numflash.arrays import BFLOAT16
from numflash.device import current_device
from numflash.timing import attention_flops, time_gpu

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import peers  # noqa: E402

PROVIDERS = ["numflash", "sdpa-flash", "sdpa-cudnn", "cupy-naive"]
DTYPES = {"float16": cupy.float16, "bfloat16": BFLOAT16}


class PeakMemory:
    """Tracks the peak of CuPy's pool (the allocator numflash and the naive version use)."""

    def __init__(self):
        self.pool = cupy.get_default_memory_pool()
        self.peak = 0
        cupy.cuda.set_allocator(self.malloc)

    def malloc(self, size):
        mem = self.pool.malloc(size)
        self.peak = max(self.peak, self.pool.used_bytes())
        return mem

    def measure(self, fn):
        """Peak bytes allocated while ``fn()`` runs, beyond what was allocated before."""
        cupy.cuda.Device().synchronize()
        base = self.pool.used_bytes()
        self.peak = base
        result = fn()
        cupy.cuda.Device().synchronize()
        del result
        return self.peak - base


def torch_peak(fn):
    import torch

    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    result = fn()
    torch.cuda.synchronize()
    del result
    return torch.cuda.max_memory_allocated() - base


def runner(provider, q, k, v, causal):
    if provider == "numflash":
        return peers.numflash_forward(q, k, v, causal)
    if provider == "cupy-naive":
        return peers.naive_forward(q, k, v, causal)
    return peers.sdpa_forward(q, k, v, causal, provider.split("-")[1])


def is_oom(exc):
    text = f"{type(exc).__name__} {exc}".lower()
    return "out of memory" in text or "outofmemory" in text


def bench(args, memory):
    records = []
    providers = [p for p in PROVIDERS if p.startswith("sdpa") is False or peers.torch_available()]
    for dtype, hd, causal, seqlen in itertools.product(
        args.dtypes, args.head_dims, [False, True], args.seqlens
    ):
        batch, nheads = max(1, args.tokens // seqlen), args.model_dim // hd
        q, k, v = peers.random_qkv(batch, seqlen, nheads, hd, DTYPES[dtype])
        flops = attention_flops(batch, nheads, seqlen, seqlen, hd, causal)
        for provider in providers:
            if provider == "cupy-naive" and dtype == "bfloat16":
                continue  # CuPy has no bfloat16 matmul: there is no naive CuPy bf16 attention
            run = runner(provider, q, k, v, causal)
            naive = provider == "cupy-naive"
            try:
                t = time_gpu(
                    run, warmup=1 if naive else 3, runs=5 if naive else 20, max_total_ms=3000
                )
                peak = torch_peak(run) if provider.startswith("sdpa") else memory.measure(run)
            except Exception as exc:
                if not is_oom(exc):
                    raise
                print(f"  {provider} {dtype} hd{hd} s{seqlen}: out of memory", flush=True)
                cupy.get_default_memory_pool().free_all_blocks()
                continue
            shape = peers.problem(batch, nheads, seqlen, seqlen, hd, causal)
            rec = peers.record(t, flops, provider, "fwd", dtype, **shape, peak_bytes=int(peak))
            records.append(rec)
            print(
                f"{provider:11s} {dtype:8s} hd{hd:<4d} causal={int(causal)} s{seqlen:<6d} "
                f"b{batch:<3d} {t.median_ms:9.3f} ms {rec['tflops']:7.1f} TFLOP/s",
                flush=True,
            )
        del q, k, v
        cupy.get_default_memory_pool().free_all_blocks()
        with open(os.path.join(args.out_dir, "partial.json"), "w") as f:
            json.dump(records, f)  # what a run stopped early still leaves behind
    return records


def memory_sweep(args, memory):
    """Peak memory of one call against seqlen at batch 1, 16 heads, head_dim 128, fp16."""
    records = []
    for provider in ("numflash", "cupy-naive"):
        for seqlen in args.memory_seqlens:
            q, k, v = peers.random_qkv(1, seqlen, 16, 128, cupy.float16)
            run = runner(provider, q, k, v, False)
            peak = None
            try:
                run()  # compile / warm up outside the measurement
                peak = memory.measure(run)
            except Exception as exc:
                if not is_oom(exc):
                    raise
                print(f"  memory: {provider} runs out of memory at seqlen {seqlen}", flush=True)
            del q, k, v, run
            cupy.get_default_memory_pool().free_all_blocks()
            if peak is None:
                break
            shape = peers.problem(1, 16, seqlen, seqlen, 128, False)
            rec = peers.record(None, None, provider, "fwd-memory", "float16", **shape)
            records.append(dict(rec, peak_bytes=int(peak)))
            print(f"memory {provider:10s} s{seqlen:<6d} {peak / 2**20:12.1f} MiB", flush=True)
    return records


def markdown(records, device):
    fwd = [r for r in records if r["mode"] == "fwd"]
    by_key = {}
    for r in fwd:
        key = (r["dtype"], r["head_dim"], r["causal"], r["seqlen_q"])
        by_key.setdefault(key, {})[r["provider"]] = r["tflops"]
    lines = [
        f"Forward TFLOP/s on {device}, batch x seqlen = 32k tokens, nheads x head_dim = 2048 "
        "(median of CUDA-event timings; ratios are numflash / peer).",
        "",
        "| dtype | head_dim | causal | seqlen | numflash | SDPA FA2 | SDPA cuDNN | naive CuPy "
        "| vs FA2 | vs cuDNN |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for (dtype, hd, causal, seqlen), row in sorted(by_key.items()):

        def cell(p):
            return f"{row[p]:.0f}" if p in row else "-"

        def ratio(p):
            return f"{row['numflash'] / row[p]:.2f}x" if p in row and "numflash" in row else "-"

        lines.append(
            f"| {dtype} | {hd} | {'yes' if causal else 'no'} | {seqlen} | {cell('numflash')} | "
            f"{cell('sdpa-flash')} | {cell('sdpa-cudnn')} | {cell('cupy-naive')} | "
            f"{ratio('sdpa-flash')} | {ratio('sdpa-cudnn')} |"
        )
    mem = [r for r in records if r["mode"] == "fwd-memory"]
    if mem:
        lines += [
            "",
            "Peak extra device memory of one forward call (batch 1, 16 heads, "
            "head_dim 128, fp16), MiB:",
            "",
            "| seqlen | numflash | naive CuPy |",
            "|---|---|---|",
        ]
        seqlens = sorted({r["seqlen_q"] for r in mem})
        for s in seqlens:
            row = {r["provider"]: r["peak_bytes"] / 2**20 for r in mem if r["seqlen_q"] == s}
            lines.append(
                f"| {s} | {row.get('numflash', float('nan')):.0f} | "
                + (f"{row['cupy-naive']:.0f} |" if "cupy-naive" in row else "out of memory |")
            )
    return "\n".join(lines) + "\n"


def plots(records, out_dir):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib missing: no plots", flush=True)
        return
    fwd = [r for r in records if r["mode"] == "fwd"]
    panels = sorted({(r["dtype"], r["head_dim"], r["causal"]) for r in fwd})
    cols = min(4, len(panels))
    rows = (len(panels) + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(4 * cols, 3.3 * rows), squeeze=False)
    for ax in axes.flat[len(panels) :]:
        ax.axis("off")
    for ax, (dtype, hd, causal) in zip(axes.flat, panels):
        for provider in PROVIDERS:
            pts = sorted(
                (r["seqlen_q"], r["tflops"])
                for r in fwd
                if r["provider"] == provider
                and (r["dtype"], r["head_dim"], r["causal"]) == (dtype, hd, causal)
            )
            if pts:
                ax.plot(*zip(*pts), marker="o", label=provider)
        ax.set_xscale("log", base=2)
        ax.set_title(f"{dtype} hd{hd} {'causal' if causal else 'full'}", fontsize=9)
        ax.set_xlabel("seqlen")
        ax.set_ylabel("TFLOP/s")
    labels = {}
    for ax in axes.flat:  # one legend for all panels (bf16 panels have no naive CuPy line)
        for handle, label in zip(*ax.get_legend_handles_labels()):
            labels.setdefault(label, handle)
    fig.legend(labels.values(), labels.keys(), loc="upper center", ncol=len(labels), fontsize=9)
    fig.tight_layout(rect=(0, 0, 1, 0.95))
    fig.savefig(os.path.join(out_dir, "forward_tflops.png"), dpi=110)
    mem = [r for r in records if r["mode"] == "fwd-memory"]
    if mem:
        fig, ax = plt.subplots(figsize=(5, 3.6))
        for provider in ("numflash", "cupy-naive"):
            pts = sorted(
                (r["seqlen_q"], r["peak_bytes"] / 2**30) for r in mem if r["provider"] == provider
            )
            if pts:
                ax.plot(*zip(*pts), marker="o", label=provider)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("seqlen (batch 1, 16 heads, head_dim 128)")
        ax.set_ylabel("peak extra memory (GiB)")
        ax.legend()
        fig.tight_layout()
        fig.savefig(os.path.join(out_dir, "forward_memory.png"), dpi=110)


def main():
    ap = peers.parser(__doc__, head_dims=(64, 128))
    ap.add_argument("--seqlens", type=int, nargs="+", default=[512, 1024, 2048, 4096, 8192, 16384])
    ap.add_argument(
        "--memory-seqlens", type=int, nargs="+", default=[1024, 4096, 8192, 16384, 32768, 65536]
    )
    ap.add_argument("--tokens", type=int, default=32768, help="batch * seqlen")
    ap.add_argument("--model-dim", type=int, default=2048, help="nheads * head_dim")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument(
        "--plot-only",
        metavar="JSON",
        default=None,
        help="redraw the plots of a results file into --out-dir; no GPU needed",
    )
    ap.add_argument(
        "--merge",
        default=None,
        help="records (JSON list) of an earlier run on this device to include; each "
        "table row still comes from one process",
    )
    args = ap.parse_args()
    os.makedirs(args.out_dir, exist_ok=True)  # partial.json goes there during the run
    if args.quick:
        args.dtypes, args.head_dims, args.seqlens = ["float16"], [128], [1024, 4096, 16384]
        args.memory_seqlens = [4096, 16384]
    if args.plot_only:
        with open(args.plot_only) as f:
            plots(json.load(f)["records"], args.out_dir)
        return
    dev = current_device()
    memory = PeakMemory()
    records = bench(args, memory) + memory_sweep(args, memory)
    if args.merge:
        with open(args.merge) as f:
            records = json.load(f) + records
    table = markdown(records, dev.name)
    peers.save_results(args.out_dir, "latest", dev, records, table, merged_from=args.merge)
    plots(records, args.out_dir)
    os.remove(os.path.join(args.out_dir, "partial.json"))


if __name__ == "__main__":
    main()
