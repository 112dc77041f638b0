"""Chunked-prefill benchmark: many new query rows over a long KV cache, with the append.

    python benchmarks/bench_prefill.py [--dtypes float16] [--page-sizes 16] [--runs 30]

Shapes (32 query heads, 8 KV heads, head_dim 128, causal aligned bottom-right): 4 sequences of
128 new rows over 8192 cached keys, and 1 sequence of 2048 new rows over 16384. numflash runs
``attention_with_kvcache`` (the new rows' k and v appended at ``cache_seqlens``, the cache as a
device array, contiguous and paged with shuffled block tables) and ``attention`` on the same
tensors (q against the cache's first cached + new rows, nothing appended); SDPA's
FlashAttention-2 and cuDNN run that second problem on the same memory (``causal_lower_right``).
The append writes the same slots at every run, so each run does the same work. Kernel time
from CUDA events (numflash.timing.time_gpu, L2 flushed between runs), TFLOP/s counted over the
attention alone. Writes benchmarks/results/prefill.json and prefill.md.

``--crossover`` instead times the KV-cache call (4 sequences over 8192 cached keys, contiguous
and paged) at 16-256 new rows (``--rows``) on both of its routes, the split-KV decode kernel
and the Hopper forward, the evidence for selection.PREFILL_ROWS (docs/performance.md,
"Chunked prefill").
"""

import os
import sys
import types

import cupy

import numflash
from numflash import selection
from numflash.device import current_device
from numflash.families import wgmma_forward
from numflash.timing import attention_flops, time_gpu

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import peers  # noqa: E402
from bench_decode import paged_copy, sdpa_run  # noqa: E402
from bench_forward import DTYPES  # noqa: E402

#: (name, batch, new rows, cached keys)
SHAPES = [
    ("b4 new128 cached8192", 4, 128, 8192),
    ("b1 new2048 cached16384", 1, 2048, 16384),
]
NHEADS, NHEADS_K, HEAD_DIM = 32, 8, 128


def shape_arrays(batch, new, cached, dtype):
    """(q, k_new, v_new, k_cache, v_cache) of one shape: ``new`` rows appended to caches of
    ``cached`` keys (and room for the new ones)."""
    q, k_new, v_new = (
        peers.random_qkv(batch, new, heads, HEAD_DIM, dtype, seed=s)[0]
        for s, heads in ((1, NHEADS), (2, NHEADS_K), (3, NHEADS_K))
    )
    k_cache, v_cache = peers.random_qkv(batch, cached + new, NHEADS_K, HEAD_DIM, dtype)[:2]
    return q, k_new, v_new, k_cache, v_cache


def cache_layouts(k_cache, v_cache, page_sizes, shuffled=True):
    """(layout, k cache, v cache, {"block_table": table} or {}) of the contiguous cache and of
    the same keys in pages of each size (bench_decode's paged_copy)."""
    layouts = [("contiguous", k_cache, v_cache, {})]
    for page in page_sizes:
        kp, vp, table = paged_copy(k_cache, v_cache, page, shuffled=shuffled)
        layouts.append((f"paged {page}", kp, vp, {"block_table": table}))
    return layouts


def kvcache_runs(q, k_new, v_new, layouts, cached, config=None, nf=numflash):
    """(layout, callable) of the KV-cache call appending k_new, v_new over each of
    ``layouts`` (cache_layouts) after ``cached`` keys (``config`` forced where given), through
    the numflash package ``nf`` (tools/paged_prefill.py --against loads another checkout's)."""
    batch = q.shape[0]
    lengths = cupy.full((batch,), cached, dtype=cupy.int32)
    out = []
    for layout, kc, vc, kw in layouts:

        def run(kc=kc, vc=vc, kw=kw):
            return nf.attention_with_kvcache(
                q, kc, vc, k_new, v_new, cache_seqlens=lengths, causal=True, config=config, **kw
            )

        out.append((layout, run))
    return out


def runs_for(q, k_new, v_new, k_cache, v_cache, cached, page_sizes):
    """(provider, layout, callable) for one shape: the KV-cache call on each layout, then
    ``attention`` and SDPA on q against the cache's first cached + new rows."""
    new = q.shape[1]
    lengths = cupy.full((q.shape[0],), cached, dtype=cupy.int32)
    runs = kvcache_runs(q, k_new, v_new, cache_layouts(k_cache, v_cache, page_sizes), cached)
    out = [("numflash kvcache", layout, run) for layout, run in runs]
    # what the KV-cache call attends to once it has appended
    numflash.attention_with_kvcache(q, k_cache, v_cache, k_new, v_new, cache_seqlens=lengths)
    k_all, v_all = k_cache[:, : cached + new], v_cache[:, : cached + new]
    out.append(
        (
            "numflash attention",
            "contiguous",
            lambda: numflash.attention(q, k_all, v_all, causal=True),
        )
    )
    if peers.torch_available():
        for backend in ("flash", "cudnn"):
            run = sdpa_run(q, k_all, v_all, True, backend)
            if run is not None:
                out.append((f"sdpa-{backend}", "contiguous", run))
    return out


def bench(args):
    records = []
    for dtype in args.dtypes:
        for name, batch, new, cached in SHAPES:
            q, k_new, v_new, k_cache, v_cache = shape_arrays(batch, new, cached, DTYPES[dtype])
            flops = attention_flops(batch, NHEADS, new, cached + new, HEAD_DIM, False)
            flops -= batch * NHEADS * 2 * new * (new - 1) * HEAD_DIM  # the keys causal hides
            for provider, layout, run in runs_for(
                q, k_new, v_new, k_cache, v_cache, cached, args.page_sizes
            ):
                t = time_gpu(run, warmup=3, runs=args.runs)
                rec = dict(shape=name, dtype=dtype, provider=provider, layout=layout,
                           us=t.median_ms * 1e3, tflops=t.tflops(flops))  # fmt: skip
                records.append(rec)
                print(f"{dtype} {name:24s} {provider:18s} {layout:10s} {rec['us']:9.1f} us "
                      f"{rec['tflops']:6.1f} TFLOP/s", flush=True)  # fmt: skip
    return records


#: The new rows a sequence --crossover times by default.
CROSSOVER_ROWS = (16, 32, 48, 64, 96, 128, 256)


def crossover(args, rows=CROSSOVER_ROWS, batch=4, cached=8192, kv_heads=NHEADS_K):
    """us of the KV-cache call per route (the decode kernel: what numflash chooses with
    PREFILL_ROWS out of reach; the Hopper forward: its default configuration forced), with
    NHEADS query heads over ``kv_heads`` KV heads."""
    records = []
    dtype = DTYPES[args.dtypes[0]]
    k_cache, v_cache = peers.random_qkv(batch, cached + max(rows), kv_heads, HEAD_DIM, dtype)[:2]
    lengths = cupy.full((batch,), cached, dtype=cupy.int32)
    layouts = [("contiguous", k_cache, v_cache, {})]
    for page in args.page_sizes:
        kp, vp, table = paged_copy(k_cache, v_cache, page)
        layouts.append((f"paged {page}", kp, vp, {"block_table": table}))
    for new in rows:
        q, k_new, v_new = (
            peers.random_qkv(batch, new, heads, HEAD_DIM, dtype, seed=s)[0]
            for s, heads in ((1, NHEADS), (2, kv_heads), (3, kv_heads))
        )
        for layout, kc, vc, kw in layouts:
            args_ = (q, kc, vc, k_new, v_new)
            kw = dict(kw, cache_seqlens=lengths, causal=True)
            hopper = selection.prefill_config(
                wgmma_forward.default_wgmma_forward_config(HEAD_DIM), _paged(kw, kc)
            )
            saved = dict(selection.PREFILL_ROWS)
            selection.PREFILL_ROWS.update(dict.fromkeys(saved, 1 << 30))
            try:
                decode = numflash.selected_kvcache_config(*args_, **kw)[0].config
            finally:
                selection.PREFILL_ROWS.update(saved)
            for route, config in (("decode", decode), ("hopper", hopper)):
                t = time_gpu(lambda c=config: numflash.attention_with_kvcache(*args_, **kw, config=c),
                             warmup=3, runs=args.runs)  # fmt: skip
                rec = dict(rows=new, layout=layout, route=route, us=t.median_ms * 1e3,
                           kv_heads=kv_heads)  # fmt: skip
                records.append(rec)
                print(f"rows {new:4d} {layout:10s} {route:7s} {rec['us']:9.1f} us", flush=True)
    return records


def _paged(kw, cache):
    """A stand-in problem for selection.prefill_config: whether the call is paged, and its
    page size."""
    paged = "block_table" in kw
    return types.SimpleNamespace(paged=paged, page_size=cache.shape[1] if paged else 0)


def markdown(records, device):
    lines = [
        f"Chunked prefill on {device}: {NHEADS} query heads, {NHEADS_K} KV heads, head_dim "
        f"{HEAD_DIM}, causal; us per call (median of CUDA-event timings), TFLOP/s of the "
        "attention.",
        "",
        "| dtype | shape | provider | layout | us | TFLOP/s |",
        "|---|---|---|---|---|---|",
    ]
    for r in records:
        lines.append(
            f"| {r['dtype']} | {r['shape']} | {r['provider']} | {r['layout']} | {r['us']:.1f} "
            f"| {r['tflops']:.0f} |"
        )
    return "\n".join(lines) + "\n"


def main():
    ap = peers.parser(__doc__, ("float16",), choices=sorted(DTYPES))
    ap.add_argument("--page-sizes", type=int, nargs="*", default=[16])
    ap.add_argument("--runs", type=int, default=30)
    ap.add_argument("--crossover", action="store_true", help="time both routes at 16-256 rows")
    ap.add_argument("--rows", type=int, nargs="*", default=list(CROSSOVER_ROWS),
                    help="--crossover's new rows a sequence")  # fmt: skip
    ap.add_argument("--kv-heads", type=int, default=NHEADS_K,
                    help=f"--crossover's KV heads (of {NHEADS} query heads)")  # fmt: skip
    args = ap.parse_args()
    dev = current_device()
    if args.crossover:
        records = crossover(args, tuple(args.rows), kv_heads=args.kv_heads)
        lines = [f"KV-cache call by route on {dev.name} (b4, 8192 cached keys, causal, "
                 f"{NHEADS} / {args.kv_heads} heads), us:", ""]  # fmt: skip
        lines += ["| rows | layout | decode kernel | Hopper forward |", "|---|---|---|---|"]
        by = {(r["rows"], r["layout"], r["route"]): r["us"] for r in records}
        for new, layout in dict.fromkeys((r["rows"], r["layout"]) for r in records):
            lines.append(f"| {new} | {layout} | {by[new, layout, 'decode']:.1f} | "
                         f"{by[new, layout, 'hopper']:.1f} |")  # fmt: skip
        peers.save_results(args.out_dir, "prefill_crossover", dev, records, "\n".join(lines))
        return
    records = bench(args)
    table = markdown(records, dev.name)
    peers.save_results(args.out_dir, "prefill", dev, records, table)


if __name__ == "__main__":
    main()
