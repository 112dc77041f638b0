"""Decode benchmark: attention over a KV cache, numflash beside SDPA (FlashAttention-2, cuDNN).

    python benchmarks/bench_decode.py [--dtypes float16 bfloat16] [--page-sizes 1 16 256]
                                      [--configs 16,4,3 32,4,2] [--num-splits 0]

Shapes (32 query heads, 8 KV heads, head_dim 128): decoding one query row at batch 1 x cache
131072, batch 8 x 8192 and batch 64 x 4096, and a speculative step of 4 query rows, causal, at
batch 16 x 4096. numflash runs ``attention_with_kvcache`` on a contiguous cache and on paged
caches (shuffled block tables) of each page size; SDPA gets the same contiguous memory as
(batch, heads, seqlen, head_dim) views with ``enable_gqa=True`` (causal: aligned bottom-right
with ``causal_lower_right``). Kernel time from CUDA events (numflash.timing.time_gpu, L2
flushed between runs), cache_seqlens as a device array as a server keeps it; the figure of
merit is the KV bytes read per second (batch x cache length x kv heads x head_dim x 2 tensors x
the element size) and its fraction of the HBM peak (--hbm-tbs, the H200's 4.8 TB/s).

``--configs`` times numflash's tensor-core kernel with each block_n,num_warps,stages besides the
configuration it chooses, on every layout; ``--num-splits`` likewise for split counts on the
contiguous cache (0: numflash chooses).
Writes benchmarks/results/decode.json, decode.md and decode.png.
"""

import os
import sys

import cupy
import numpy as np

import numflash
from numflash.device import current_device
from numflash.timing import time_gpu

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import peers  # noqa: E402
from bench_forward import DTYPES  # noqa: E402

#: (name, batch, seqlen_q, cache length, causal)
SHAPES = [
    ("decode b1 131072", 1, 1, 131072, False),
    ("decode b8 8192", 8, 1, 8192, False),
    ("decode b64 4096", 64, 1, 4096, False),
    ("speculative b16 q4 4096", 16, 4, 4096, True),
]
NHEADS, NHEADS_K, HEAD_DIM = 32, 8, 128


def kv_bytes(batch, length, dtype):
    return batch * length * NHEADS_K * HEAD_DIM * 2 * cupy.dtype(dtype).itemsize


def paged_copy(k_cache, v_cache, page_size, seed=0, shuffled=True):
    """(k pages, v pages, block_table) holding the same sequences, pages in shuffled order
    (``shuffled=False``: in order, sequence after sequence)."""
    batch, length = k_cache.shape[:2]
    pages = -(-length // page_size)
    order = np.arange(batch * pages)
    if shuffled:
        order = np.random.default_rng(seed).permutation(batch * pages)
    order = cupy.asarray(order.astype(np.int32))
    table = order.reshape(batch, pages)
    out = []
    for cache in (k_cache, v_cache):
        padded = cupy.zeros((batch, pages * page_size) + cache.shape[2:], cache.dtype)
        padded[:, :length] = cache
        paged = cupy.empty((batch * pages, page_size) + cache.shape[2:], cache.dtype)
        paged[order] = padded.reshape((batch * pages, page_size) + cache.shape[2:])
        out.append(paged)
    return out[0], out[1], table


def sdpa_run(q, k_cache, v_cache, causal, backend, top_left=False):
    """SDPA on the same memory, or None where the backend refuses the problem. ``top_left``:
    ``is_causal=True``, which SDPA aligns to the top-left corner (query i sees keys 0..i, a
    different mask), timed for comparison with figures measured so."""
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.bias import causal_lower_right

    which = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}[backend]
    qt, kt, vt = (torch.from_dlpack(x).transpose(1, 2) for x in (q, k_cache, v_cache))
    mask = causal_lower_right(qt.shape[2], kt.shape[2]) if causal and not top_left else None

    def run():
        with sdpa_kernel(which):
            return torch.nn.functional.scaled_dot_product_attention(
                qt, kt, vt, attn_mask=mask, is_causal=top_left, enable_gqa=True
            )

    try:
        run()
        torch.cuda.synchronize()
    except RuntimeError as exc:
        print(f"  sdpa-{backend} refused: {str(exc).splitlines()[0][:120]}", flush=True)
        return None
    return run


def bench(args):
    records = []
    torch_ok = peers.torch_available()
    for dtype in args.dtypes:
        for name, batch, seqlen_q, length, causal in SHAPES:
            q = peers.random_qkv(batch, seqlen_q, NHEADS, HEAD_DIM, DTYPES[dtype], seed=1)[0]
            k_cache, v_cache = peers.random_qkv(batch, length, NHEADS_K, HEAD_DIM, DTYPES[dtype])[
                :2
            ]
            lengths = cupy.full((batch,), length, dtype=cupy.int32)
            nbytes = kv_bytes(batch, length, k_cache.dtype)
            runs = []  # (provider, layout, config label, callable)
            layouts = [("contiguous", k_cache, v_cache, {})]
            for page in args.page_sizes:
                kp, vp, table = paged_copy(k_cache, v_cache, page)
                layouts.append((f"paged {page}", kp, vp, {"block_table": table}))
            for layout, kc, vc, kw in layouts:
                configs = [None] + args.configs
                for cfg in configs:
                    for splits in args.num_splits if cfg is None and not kw else [0]:
                        options = dict(
                            cache_seqlens=lengths,
                            causal=causal,
                            num_splits=splits,
                            config=cfg,
                            **kw,
                        )

                        def run(kc=kc, vc=vc, options=options):
                            return numflash.attention_with_kvcache(q, kc, vc, **options)

                        try:
                            chosen, used = numflash.selected_kvcache_config(q, kc, vc, **options)
                        except ValueError as exc:  # a configuration this GPU cannot run
                            print(f"  skipped: {exc}"[:200], flush=True)
                            continue
                        label = dict(chosen.config.to_dict(), num_splits=used)
                        label["chosen"] = cfg is None and splits == 0
                        label["source"] = chosen.source.split(" ")[0]  # shipped, heuristic, ...
                        runs.append(("numflash", layout, label, run))
            if torch_ok:
                for backend in ("flash", "cudnn"):
                    run = sdpa_run(q, k_cache, v_cache, causal, backend)
                    if run is not None:
                        runs.append((f"sdpa-{backend}", "contiguous", None, run))
                    if causal:
                        run = sdpa_run(q, k_cache, v_cache, causal, backend, top_left=True)
                        if run is not None:
                            runs.append((f"sdpa-{backend}", "top-left causal", None, run))
            for provider, layout, label, run in runs:
                try:
                    t = time_gpu(run, warmup=3, runs=args.runs)
                except Exception as exc:  # a configuration that cannot run: say so, go on
                    print(f"  {provider} {layout} {label} failed: {exc!r}"[:300], flush=True)
                    continue
                rate = nbytes / (t.median_ms * 1e-3) / 1e12
                rec = dict(shape=name, dtype=dtype, batch=batch, seqlen_q=seqlen_q,
                           cache_length=length, causal=causal, provider=provider, layout=layout,
                           config=label, us=t.median_ms * 1e3, kv_tbs=rate,
                           hbm_fraction=rate / args.hbm_tbs)  # fmt: skip
                records.append(rec)
                print(
                    f"{dtype} {name:26s} {provider:10s} {layout:11s} {t.median_ms * 1e3:9.1f} us "
                    f"{rate:5.2f} TB/s  {label or ''}",
                    flush=True,
                )
    return records


def markdown(records, device):
    lines = [
        f"Decode on {device}: GPU time and KV read rate (fraction of HBM peak); numflash rows "
        "by cache layout.",
        "",
        "| dtype | shape | provider | layout | time (us) | KV TB/s | of peak |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in records:
        if r["provider"] == "numflash" and not r["config"]["chosen"]:
            continue  # a configuration or split count forced for comparison: in the JSON
        lines.append(
            f"| {r['dtype']} | {r['shape']} | {r['provider']} | {r['layout']} | "
            f"{r['us']:.1f} | {r['kv_tbs']:.2f} | {r['hbm_fraction']:.0%} |"
        )
    if any(r["layout"] == "top-left causal" for r in records):
        lines += [
            "",
            '"top-left causal": SDPA\'s `is_causal=True`, which aligns the mask to the top-left '
            "corner: query i sees keys 0..i, so it reads a few keys, not the cache; its rate is "
            "the cache size over its time, not what it read. The other causal rows use the "
            "bottom-right mask (`causal_lower_right`), numflash's.",
        ]
    return "\n".join(lines) + "\n"


def plot(records, path):
    """KV read rate per shape and provider (numflash's chosen configuration per layout)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown = [
        r
        for r in records
        if (r["provider"] != "numflash" or r["config"]["chosen"])
        and r["layout"] != "top-left causal"  # another mask: it reads a few keys
    ]
    dtypes = sorted({r["dtype"] for r in shown})
    fig, axes = plt.subplots(1, len(dtypes), figsize=(7 * len(dtypes), 4.5), squeeze=False)
    for ax, dtype in zip(axes[0], dtypes):
        rows = [r for r in shown if r["dtype"] == dtype]
        shapes = list(dict.fromkeys(r["shape"] for r in rows))
        series = list(dict.fromkeys((r["provider"], r["layout"]) for r in rows))
        width = 0.8 / len(series)
        for i, (provider, layout) in enumerate(series):
            values = {
                r["shape"]: r["kv_tbs"]
                for r in rows
                if (r["provider"], r["layout"]) == (provider, layout)
            }
            xs = [s + (i - len(series) / 2 + 0.5) * width for s in range(len(shapes))]
            ax.bar(xs, [values.get(s, 0) for s in shapes], width, label=f"{provider} {layout}")
        ax.set_xticks(range(len(shapes)), shapes, rotation=15, fontsize=8)
        ax.set_ylabel("KV cache read, TB/s")
        ax.set_title(dtype)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main():
    ap = peers.parser(__doc__)
    ap.add_argument("--page-sizes", type=int, nargs="*", default=[1, 16, 256])
    ap.add_argument(
        "--configs",
        nargs="*",
        default=[],
        type=lambda s: numflash.TensorCoreDecodeConfig(*map(int, s.split(","))),
        help="block_n,num_warps,stages of the tensor-core kernel, timed besides the chosen one",
    )
    ap.add_argument("--num-splits", type=int, nargs="+", default=[0])
    ap.add_argument("--runs", type=int, default=30)
    ap.add_argument("--hbm-tbs", type=float, default=4.8, help="the GPU's HBM peak, TB/s")
    args = ap.parse_args()
    if 0 not in args.num_splits:
        args.num_splits = [0] + args.num_splits
    dev = current_device()
    print(f"device: {dev.name} ({dev.arch}), numflash {numflash.__version__}", flush=True)
    records = bench(args)
    table = markdown(records, dev.name)
    peers.save_results(args.out_dir, "decode", dev, records, table)
    try:
        plot(records, os.path.join(args.out_dir, "decode.png"))
    except ImportError:
        print("matplotlib is not installed: no plot")


if __name__ == "__main__":
    main()
