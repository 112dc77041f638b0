"""Backward and forward+backward benchmark: numflash beside SDPA (FlashAttention-2, cuDNN).

Same method as bench_forward.py (one process, numflash.timing.time_gpu, fresh random inputs),
same record format with "mode": "bwd" (the gradients from saved forward outputs) or "fwd+bwd"
(both passes). SDPA's backward is timed as ``torch.autograd.grad`` of a retained graph, which
runs exactly its backward kernels.

    python benchmarks/bench_backward.py [--seqlens 4096 16384] [--head-dims 128]
                                        [--numflash-kernel default|portable|tensor-core|wgmma]
                                        [--deterministic]

``--numflash-kernel`` forces numflash's backward kernels (default: what attention_backward
chooses); each record names the configuration that ran. ``--deterministic`` times numflash's
backward with ``deterministic=True`` (bitwise reproducible gradients) and says so in each
record.

Writes benchmarks/results/backward.json and backward.md (backward-deterministic.json and .md
with ``--deterministic``).
"""

import itertools
import os
import sys

import cupy

import numflash
from numflash.device import current_device
from numflash.timing import attention_flops, time_gpu

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import peers  # noqa: E402
from bench_forward import DTYPES  # noqa: E402

PROVIDERS = ["numflash", "sdpa-flash", "sdpa-cudnn"]


KERNELS = {
    "default": None,
    "portable": numflash.PortableBackwardConfig,
    "tensor-core": numflash.TensorCoreBackwardConfig,
    "wgmma": numflash.WgmmaBackwardConfig,
}


def numflash_runs(q, k, v, causal, kernel, deterministic=False):
    """(backward only, forward + backward, the backward's configuration) for numflash."""
    out, lse = numflash.attention(q, k, v, causal=causal, return_lse=True)
    dout = peers.random_qkv(*q.shape[:2], q.shape[2], q.shape[3], q.dtype, seed=5)[0]
    config = KERNELS[kernel]
    if config is not None:  # the family's heuristic tiles for this head_dim
        from numflash.selection import default_config

        config = default_config(config.family, q.shape[-1], current_device())[1]
    chosen = numflash.selected_backward_config(
        q, k, v, causal=causal, config=config, deterministic=deterministic
    ).config
    options = dict(causal=causal, config=config, deterministic=deterministic)

    def bwd():
        return numflash.attention_backward(dout, q, k, v, out, lse, **options)

    def fwd_bwd():
        o, lse = numflash.attention(q, k, v, causal=causal, return_lse=True)
        return numflash.attention_backward(dout, q, k, v, o, lse, **options)

    return bwd, fwd_bwd, chosen.to_dict()


def sdpa_runs(q, k, v, causal, backend):
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    which = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}[backend]
    qt, kt, vt = (torch.from_dlpack(x).transpose(1, 2).detach().requires_grad_() for x in (q, k, v))
    dout = torch.randn_like(qt)

    def forward():
        with sdpa_kernel(which):
            return torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)

    saved = forward()

    def bwd():
        return torch.autograd.grad(saved, (qt, kt, vt), dout, retain_graph=True)

    def fwd_bwd():
        return torch.autograd.grad(forward(), (qt, kt, vt), dout)

    return bwd, fwd_bwd


def bench(args):
    records = []
    providers = [p for p in PROVIDERS if not p.startswith("sdpa") or peers.torch_available()]
    for dtype, hd, causal, seqlen in itertools.product(
        args.dtypes, args.head_dims, [False, True], args.seqlens
    ):
        batch, nheads = max(1, args.tokens // seqlen), args.model_dim // hd
        q, k, v = peers.random_qkv(batch, seqlen, nheads, hd, DTYPES[dtype])
        for provider in providers:
            config = None
            if provider == "numflash":
                *runs, config = numflash_runs(
                    q, k, v, causal, args.numflash_kernel, args.deterministic
                )
            else:
                runs = sdpa_runs(q, k, v, causal, provider.split("-")[1])
            for mode, run in zip(("bwd", "fwd+bwd"), runs):
                slow = config is not None and config["family"] == "portable-backward"
                t = time_gpu(
                    run, warmup=1 if slow else 3, runs=3 if slow else 20, max_total_ms=args.max_ms
                )
                flops = attention_flops(batch, nheads, seqlen, seqlen, hd, causal, mode)
                shape = peers.problem(batch, nheads, seqlen, seqlen, hd, causal)
                rec = peers.record(t, flops, provider, mode, dtype, **shape, config=config)
                if provider == "numflash":
                    rec["deterministic"] = args.deterministic
                records.append(rec)
                print(
                    f"{provider:11s} {mode:8s} {dtype:8s} hd{hd:<4d} causal={int(causal)} "
                    f"s{seqlen:<6d} b{batch:<3d} {t.median_ms:10.3f} ms "
                    f"{rec['tflops']:7.1f} TFLOP/s",
                    flush=True,
                )
        del q, k, v
        cupy.get_default_memory_pool().free_all_blocks()
    return records


def markdown(records, device, deterministic=False):
    rows = {}
    for r in records:
        key = (r["mode"], r["dtype"], r["head_dim"], r["causal"], r["seqlen_q"])
        rows.setdefault(key, {})[r["provider"]] = r["tflops"]
    lines = [
        f"Backward TFLOP/s on {device} (2.5 forwards of FLOPs; fwd+bwd: 3.5), batch x seqlen = "
        "32k tokens, nheads x head_dim = 2048; ratios are numflash / peer"
        + ("; numflash with deterministic=True." if deterministic else "."),
        "",
        "| mode | dtype | head_dim | causal | seqlen | numflash | SDPA FA2 | SDPA cuDNN | vs FA2 "
        "| vs cuDNN |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for (mode, dtype, hd, causal, seqlen), row in sorted(rows.items()):

        def cell(p):
            return f"{row[p]:.1f}" if p in row else "-"

        def ratio(p):
            return f"{row['numflash'] / row[p]:.3f}x" if "numflash" in row and p in row else "-"

        lines.append(
            f"| {mode} | {dtype} | {hd} | {'yes' if causal else 'no'} | {seqlen} | "
            f"{cell('numflash')} | {cell('sdpa-flash')} | {cell('sdpa-cudnn')} | "
            f"{ratio('sdpa-flash')} | {ratio('sdpa-cudnn')} |"
        )
    return "\n".join(lines) + "\n"


def main():
    ap = peers.parser(__doc__, head_dims=(128,))
    ap.add_argument("--seqlens", type=int, nargs="+", default=[4096, 16384])
    ap.add_argument("--tokens", type=int, default=32768, help="batch * seqlen")
    ap.add_argument("--model-dim", type=int, default=2048, help="nheads * head_dim")
    ap.add_argument(
        "--max-ms",
        type=float,
        default=20000,
        help="GPU time a timing may spend before it stops early (at least 3 runs)",
    )
    ap.add_argument("--numflash-kernel", choices=list(KERNELS), default="default")
    ap.add_argument(
        "--deterministic", action="store_true", help="numflash's backward with deterministic=True"
    )
    args = ap.parse_args()
    dev = current_device()
    records = bench(args)
    table = markdown(records, dev.name, args.deterministic)
    name = "backward-deterministic" if args.deterministic else "backward"
    peers.save_results(args.out_dir, name, dev, records, table)


if __name__ == "__main__":
    main()
