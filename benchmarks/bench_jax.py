"""numflash inside jax.jit beside jax.nn.dot_product_attention and beside numflash called
eagerly on CuPy, on the GPU.

    python benchmarks/bench_jax.py [--seqlens 4096] [--head-dims 128] [--dtypes bfloat16]

Training rows (batch x seqlen = 16384 tokens, heads x head_dim = 2048, a quarter of the heads
for K and V, causal and not): the forward, and the forward with its backward (``jax.vjp`` with
a given dout, jitted; eagerly ``attention`` with its lse, then ``attention_backward``), for
numflash.jax in jit, jax.nn.dot_product_attention with implementation "cudnn" and "xla", and
numflash on CuPy arrays holding the same values. Decoding rows: one step of ``--layers``
``attention_with_kvcache`` calls (a row a sequence, the step's key and value appended, paged
caches of 16-token pages), jitted as one program with the caches donated, beside the same calls
made eagerly on CuPy; with the device memory JAX holds before and after the jitted step (a copy
of a cache would show there).

Every time is host wall-clock over a burst of calls ended by a synchronisation
(``block_until_ready``; the CuPy stream's), divided by the burst's calls, median of the bursts:
JAX's work runs on XLA's streams, where CuPy's events do not see it, so both sides are timed the
same way. Writes jax.json and jax.md in --out-dir.
"""

import os
import statistics
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # numflash's buffers are CuPy's

import cupy  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import numflash  # noqa: E402
import numflash.jax as njax  # noqa: E402
from numflash.arrays import from_float  # noqa: E402
from numflash.device import current_device  # noqa: E402
from numflash.timing import attention_flops  # noqa: E402

TOKENS, WIDTH = 16384, 2048
PAGE = 16


def wall_ms(fn, sync, calls=10, bursts=7, warmup=2):
    """Median ms a call of ``fn`` over bursts of ``calls``, each burst ended by ``sync(result)``."""
    for _ in range(warmup):
        sync(fn())
    times = []
    for _ in range(bursts):
        start = time.perf_counter()
        for _ in range(calls):
            result = fn()
        sync(result)
        times.append((time.perf_counter() - start) / calls * 1e3)
    return statistics.median(times)


def to_cupy(x):
    """A CuPy copy of JAX array ``x`` (16-bit floats through their bits: CuPy's bfloat16 is
    a view of uint16, numflash.arrays)."""
    host = np.asarray(x)
    return cupy.asarray(host.view(np.uint16)).view(host.dtype)


def cupy_sync(_):
    cupy.cuda.get_current_stream().synchronize()


def training_rows(dtype, seqlen, head_dim, causal):
    batch, heads = TOKENS // seqlen, WIDTH // head_dim
    kv_heads = max(1, heads // 4)
    rng = np.random.default_rng(0)

    def draw(h):
        return rng.standard_normal((batch, seqlen, h, head_dim)).astype(np.float32)

    host = [draw(heads), draw(kv_heads), draw(kv_heads), draw(heads)]
    jq, jk, jv, jd = (jnp.asarray(x, dtype) for x in host)
    cq, ck, cv, cd = (to_cupy(x) for x in (jq, jk, jv, jd))  # the same values
    providers = {
        "numflash.jax (jit)": lambda q, k, v: njax.attention(q, k, v, causal=causal),
        "jax cudnn (jit)": lambda q, k, v: jax.nn.dot_product_attention(
            q, k, v, is_causal=causal, implementation="cudnn"
        ),
        "jax xla (jit)": lambda q, k, v: jax.nn.dot_product_attention(
            q, k, v, is_causal=causal, implementation="xla"
        ),
    }
    rows = []
    for mode in ("fwd", "fwd+bwd"):
        flops = attention_flops(batch, heads, seqlen, seqlen, head_dim, causal, mode)
        for name, attend in providers.items():
            if mode == "fwd":
                jitted = jax.jit(attend)
                args = (jq, jk, jv)
            else:  # the forward and, for the dout given, the backward
                jitted = jax.jit(lambda q, k, v, d, attend=attend: jax.vjp(attend, q, k, v)[1](d))
                args = (jq, jk, jv, jd)
            try:
                ms = wall_ms(lambda jitted=jitted, args=args: jitted(*args), jax.block_until_ready)
            except Exception as exc:  # a backend that refuses the shape: say so, go on
                print(f"  {name} {mode}: {type(exc).__name__}: {exc}"[:300], flush=True)
                continue
            rows.append(dict(provider=name, mode=mode, ms=ms, tflops=flops / ms / 1e9))

        def eager():
            out, lse = numflash.attention(cq, ck, cv, causal=causal, return_lse=True)
            if mode == "fwd":
                return out
            return numflash.attention_backward(cd, cq, ck, cv, out, lse, causal=causal)

        ms = wall_ms(eager, cupy_sync)
        rows.append(dict(provider="numflash (CuPy, eager)", mode=mode, ms=ms,
                         tflops=flops / ms / 1e9))  # fmt: skip
    for r in rows:
        r.update(dtype=dtype, seqlen=seqlen, head_dim=head_dim, causal=causal, batch=batch)
        print(f"{dtype} seqlen {seqlen} d{head_dim} {'causal' if causal else 'full'} "
              f"{r['mode']:7s} {r['provider']:24s} {r['ms']:8.3f} ms {r['tflops']:6.1f} TFLOP/s",
              flush=True)  # fmt: skip
    return rows


def decode_rows(dtype, layers, batch, length, heads=32, kv_heads=8, head_dim=128):
    """One decoding step of ``layers`` calls, jitted and eager."""
    pages_per_seq = length // PAGE + 1
    pages = batch * pages_per_seq
    rng = np.random.default_rng(1)
    table = rng.permutation(pages).reshape(batch, pages_per_seq).astype(np.int32)
    shape = (pages, PAGE, kv_heads, head_dim)
    seqlens = np.full((batch,), length, np.int32)  # each step appends at the same place
    q = rng.standard_normal((batch, 1, heads, head_dim)).astype(np.float32)
    kn = rng.standard_normal((batch, 1, kv_heads, head_dim)).astype(np.float32)
    jq, jk = jnp.asarray(q, dtype), jnp.asarray(kn, dtype)
    jtable, jlens = jnp.asarray(table), jnp.asarray(seqlens)

    keys = iter(jax.random.split(jax.random.PRNGKey(2), 2 * layers))
    caches = tuple(
        tuple(jax.random.normal(next(keys), shape, jnp.float32).astype(dtype) for _ in "kv")
        for _ in range(layers)
    )

    def step(q, k, caches, seqlens, table):
        outs, kept = [], []
        for k_cache, v_cache in caches:
            out, k_cache, v_cache = njax.attention_with_kvcache(
                q, k_cache, v_cache, k, k, cache_seqlens=seqlens, block_table=table, causal=True
            )
            outs.append(out)
            kept.append((k_cache, v_cache))
        return jnp.stack(outs), tuple(kept)

    jitted = jax.jit(step, donate_argnums=(2,))
    state = {"caches": caches}

    def run_jitted():
        outs, state["caches"] = jitted(jq, jk, state["caches"], jlens, jtable)
        return outs

    stats = jax.devices()[0].memory_stats() or {}
    run_jitted()
    jax.block_until_ready(state["caches"])
    before = (jax.devices()[0].memory_stats() or {}).get("bytes_in_use")
    ms_jit = wall_ms(run_jitted, jax.block_until_ready)
    after = (jax.devices()[0].memory_stats() or {}).get("bytes_in_use")
    cache_bytes = 2 * layers * int(np.prod(shape)) * jnp.dtype(dtype).itemsize
    crng = cupy.random.default_rng(2)
    ccaches = [
        tuple(from_float(crng.standard_normal(shape, dtype=cupy.float32), dtype) for _ in "kv")
        for _ in range(layers)
    ]
    cq, ck = to_cupy(jq), to_cupy(jk)
    ctable, clens = cupy.asarray(table), cupy.asarray(seqlens)

    def eager():
        return [
            numflash.attention_with_kvcache(
                cq, kc, vc, ck, ck, cache_seqlens=clens, block_table=ctable, causal=True
            )
            for kc, vc in ccaches
        ]

    ms_eager = wall_ms(eager, cupy_sync)
    row = dict(mode="decode step", layers=layers, batch=batch, length=length, dtype=dtype,
               ms_jit=ms_jit, ms_eager=ms_eager, cache_bytes=cache_bytes,
               jax_bytes_in_use_before=before, jax_bytes_in_use_after=after,
               jax_peak_bytes=stats.get("peak_bytes_in_use"))  # fmt: skip
    print(f"decode step, {layers} layers, batch {batch} x {length} ({dtype}): jit {ms_jit:.3f} ms, "
          f"eager {ms_eager:.3f} ms ({ms_jit / ms_eager:.2f}x); JAX bytes in use {before} -> "
          f"{after}, caches {cache_bytes}", flush=True)  # fmt: skip
    return [row]


def table(records):
    lines = ["| dtype | seqlen | head_dim | causal | mode | provider | ms | TFLOP/s |",
             "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in records:
        if r["mode"] == "decode step":
            continue
        lines.append(f"| {r['dtype']} | {r['seqlen']} | {r['head_dim']} | "
                     f"{'yes' if r['causal'] else 'no'} | {r['mode']} | {r['provider']} | "
                     f"{r['ms']:.3f} | {r['tflops']:.1f} |")  # fmt: skip
    for r in records:
        if r["mode"] == "decode step":
            lines.append(f"\nDecode step, {r['layers']} calls, batch {r['batch']} x {r['length']} "
                         f"cached: jit {r['ms_jit']:.3f} ms, eager CuPy {r['ms_eager']:.3f} ms "
                         f"({r['ms_jit'] / r['ms_eager']:.2f}x).")  # fmt: skip
    return "\n".join(lines) + "\n"


def main():
    import sys

    here = os.path.dirname(os.path.abspath(__file__))
    sys.path.insert(0, here)
    import peers

    ap = peers.parser(__doc__, ("bfloat16",), (128,), choices=["float16", "bfloat16"])
    ap.add_argument("--seqlens", type=int, nargs="+", default=[4096])
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--decode-batch", type=int, default=16)
    ap.add_argument("--decode-length", type=int, default=4096)
    args = ap.parse_args()
    if jax.default_backend() != "gpu":
        raise SystemExit(f"bench_jax needs JAX's GPU backend; it has {jax.default_backend()}")
    records = []
    for dtype in args.dtypes:
        for seqlen in args.seqlens:
            for hd in args.head_dims:
                for causal in (False, True):
                    records += training_rows(dtype, seqlen, hd, causal)
        records += decode_rows(dtype, args.layers, args.decode_batch, args.decode_length)
    peers.save_results(args.out_dir, "jax", current_device(), records, table(records))


if __name__ == "__main__":
    main()
