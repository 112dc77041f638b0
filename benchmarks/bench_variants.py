"""Attention-variant benchmark: what each built-in variant costs beside the plain call.

    python benchmarks/bench_variants.py [--dtypes float16 bfloat16] [--seqlens 4096 16384]
        [--variants softcap sinks alibi relbias relbias-f64 softcap-e2 relbias-e1 ...]

Shapes: 32 query heads, 8 KV heads, head_dim 128, batch x seqlen = 32768 tokens, causal and
not. For every variant (``softcap=30``; ``sinks``, one random logit a head; ``alibi``,
BLOOM's slopes 2^(-8 (h + 1) / 32); ``relbias``, a user's score_mod adding a per-head
slope times q_idx - kv_idx in float32, the slopes in mod_args; ``relbias-f64``, the same
written without the float32 conversion, so that Numba computes it in float64, to show what
that costs; any of them, ``plain`` too, with ``-e1`` or ``-e2`` after its name: the same
with 1 or 2 of every 4 probabilities by the FMA units' exp2, ``WgmmaForwardConfig.fma_exp2``,
the Hopper forward's default configuration for the call so changed, asked for by name) the
forward (``attention`` with its lse) and the backward
(``attention_backward``; over the forward's lse, which holds the sinks) run on the same inputs
as the plain call, in the same process; GPU time from CUDA events (numflash.timing.time_gpu,
L2 flushed between runs). The plain call and the variants are timed in turn ``--rounds`` times
and each keeps its fastest round's median: the H200's speed drifts by several percent between
timings a minute apart, which a single plain-then-variant pass reads as the variant's cost. Each
variant's output is first checked against the float64 reference on a small problem, so a fast
wrong kernel cannot pass. The table gives each variant's time as a ratio of the plain call's
(1.10 = 10% slower). relbias and relbias-f64 time the backward with the score_mod's
derivative (1) as ``score_mod_derivative``.

Then gpt-oss-style decoding: one query row a sequence, batch 64, 4096 cached tokens in pages of
16, 64 query heads / 8 KV heads, head_dim 64, a 128-token window, the new key and value
appended (the same slot every run): ``attention_with_kvcache`` with and without sinks.
Writes benchmarks/results/variants.json and variants.md.
"""

import dataclasses
import os
import sys

import cupy
from numba import cuda, float32

import numflash
from numflash import reference
from numflash.device import current_device
from numflash.timing import attention_flops, time_gpu

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import peers  # noqa: E402
from bench_forward import DTYPES  # noqa: E402

NHEADS, NHEADS_K, HEAD_DIM = 32, 8, 128

#: The variants timed ("plain" is the baseline).
VARIANTS = ("plain", "softcap", "sinks", "alibi", "relbias", "relbias-f64")
#: ... each also with 1 or 2 of every 4 exponentials on the FMA units (the Hopper forward).
FMA_EXP2 = tuple(f"{v}-e{k}" for v in VARIANTS for k in (1, 2))


@cuda.jit(device=True)
def relative_bias(score, b, h, q_idx, kv_idx, slopes):
    """relbias' score_mod: the head's slope times the distance, signed (T5's cousin of ALiBi),
    in float32 (the indices converted apart: the query's conversion is shared by its row)."""
    return score + slopes[h] * (float32(q_idx) - float32(kv_idx))


@cuda.jit(device=True)
def relative_bias_f64(score, b, h, q_idx, kv_idx, slopes):
    """relbias-f64's: float32 times Numba's int64 difference is float64 arithmetic."""
    return score + slopes[h] * (q_idx - kv_idx)


@cuda.jit(device=True)
def relative_bias_derivative(score, b, h, q_idx, kv_idx, slopes):
    """Both relative biases' derivative with respect to the score."""
    return float32(1.0)


def _slopes():
    return 2.0 ** (-8.0 * cupy.arange(1, NHEADS + 1, dtype=cupy.float32) / NHEADS)


def variant_kwargs(variant, q, k, v, causal):
    """(the forward's keyword arguments that turn ``variant`` on for this call, the
    backward's)."""
    if variant in FMA_EXP2:  # the Hopper forward's default, exp2 partly on the FMA units
        forward, backward = variant_kwargs(variant[:-3], q, k, v, causal)
        softcap = forward.get("softcap", 0.0)
        config = numflash.selected_config(q, k, v, causal=causal, softcap=softcap)[0]
        if not isinstance(config, numflash.WgmmaForwardConfig):
            raise SystemExit(f"{variant} times the Hopper forward; this call runs {config}")
        config = dataclasses.replace(config, fma_exp2=int(variant[-1]))
        return {**forward, "config": config}, backward
    if variant == "softcap":
        return {"softcap": 30.0}, {"softcap": 30.0}
    if variant == "sinks":
        sinks = cupy.random.default_rng(3).standard_normal(NHEADS, dtype=cupy.float32)
        return {"sinks": sinks}, {}
    if variant == "alibi":
        slopes = _slopes()
        return {"alibi_slopes": slopes}, {"alibi_slopes": slopes}
    if variant in ("relbias", "relbias-f64"):
        fn = relative_bias if variant == "relbias" else relative_bias_f64
        forward = {"score_mod": fn, "mod_args": (_slopes(),)}
        return forward, {**forward, "score_mod_derivative": relative_bias_derivative}
    return {}, {}


def gqa_arrays(batch, seqlen, dtype, seed=0):
    """q (NHEADS heads), k and v (NHEADS_K heads) and a dout like q."""
    q, dout = peers.random_qkv(batch, seqlen, NHEADS, HEAD_DIM, dtype, seed)[:2]
    k, v = peers.random_qkv(batch, seqlen, NHEADS_K, HEAD_DIM, dtype, seed + 1)[:2]
    return q, k, v, dout


def check(dtype, causal, variant):
    """Raise unless the variant's forward matches the float64 reference on a small problem."""
    q, k, v, _ = gqa_arrays(1, 300, dtype, seed=7)
    kwargs, _ = variant_kwargs(variant, q, k, v, causal)
    out, lse = numflash.attention(q, k, v, causal=causal, return_lse=True, **kwargs)
    named = {key: value for key, value in kwargs.items() if key != "config"}
    result = reference.check(q, k, v, out, lse, causal=causal, variants=reference.Variants(**named))
    if not result.ok:
        raise SystemExit(f"{variant} forward wrong: error {result.err:.3g} > bar {result.bar:.3g}")


def time_problem(dtype, causal, seqlen, batch, runs, variants, rounds):
    """{variant: (forward timing, backward timing)} on one problem, the plain call's first:
    every variant timed in turn ``rounds`` times, each keeping its fastest round's."""
    q, k, v, dout = gqa_arrays(batch, seqlen, dtype)
    calls = {}
    for variant in ("plain", *variants):
        kwargs, backward_kwargs = variant_kwargs(variant, q, k, v, causal)
        out, lse = numflash.attention(q, k, v, causal=causal, return_lse=True, **kwargs)

        def forward(kwargs=kwargs):
            numflash.attention(q, k, v, causal=causal, return_lse=True, **kwargs)

        def backward(kwargs=backward_kwargs, out=out, lse=lse):
            numflash.attention_backward(dout, q, k, v, out, lse, causal=causal, **kwargs)

        calls[variant] = (forward, backward)
    best = {}
    for _ in range(rounds):
        for variant, fns in calls.items():
            found = tuple(time_gpu(fn, runs=runs) for fn in fns)
            kept = best.get(variant, found)
            best[variant] = tuple(min(a, b, key=lambda t: t.median_ms) for a, b in zip(kept, found))
    return best


#: gpt-oss's decoding shape: (batch, cached tokens, heads, kv heads, head_dim, window, page)
DECODE = (64, 4096, 64, 8, 64, 128, 16)


def time_decode(dtype, runs):
    """(plain timing, timing with sinks) of one gpt-oss-style decoding step (DECODE)."""
    batch, cached, heads, kv_heads, d, window, page = DECODE
    rng = cupy.random.default_rng(4)

    def randn(*shape):
        return rng.standard_normal(shape, dtype=cupy.float32).astype(dtype)

    pages = batch * (cached + page) // page
    k_cache, v_cache = randn(pages, page, kv_heads, d), randn(pages, page, kv_heads, d)
    table = cupy.arange(pages, dtype=cupy.int32).reshape(batch, -1)
    seqlens = cupy.full((batch,), cached, dtype=cupy.int32)
    q, k, v = randn(batch, 1, heads, d), randn(batch, 1, kv_heads, d), randn(batch, 1, kv_heads, d)
    sinks = rng.standard_normal(heads, dtype=cupy.float32)
    timings = []
    for extra in ({}, {"sinks": sinks}):

        def step(extra=extra):
            numflash.attention_with_kvcache(
                q, k_cache, v_cache, k, v, cache_seqlens=seqlens, block_table=table,
                causal=True, window_size=(window - 1, 0), **extra,
            )  # fmt: skip

        timings.append(time_gpu(step, runs=runs))
    return timings


def main():
    ap = peers.parser(__doc__, choices=list(DTYPES))
    ap.add_argument("--seqlens", type=int, nargs="+", default=[4096, 16384])
    ap.add_argument("--causal", choices=["no", "yes", "both"], default="both")
    ap.add_argument("--tokens", type=int, default=32768, help="batch * seqlen")
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=3, help="turns of timing every variant")
    ap.add_argument("--variants", nargs="+", choices=VARIANTS[1:] + FMA_EXP2,
                    default=list(VARIANTS[1:]))  # fmt: skip
    ap.add_argument("--no-decode", action="store_true", help="skip the decoding step")
    args = ap.parse_args()
    dev = current_device()
    print(f"device: {dev.name} ({dev.arch}), numflash {numflash.__version__}", flush=True)
    causals = {"no": [False], "yes": [True], "both": [False, True]}[args.causal]
    records = []
    lines = [
        "| dtype | seqlen | causal | variant | fwd ms | fwd / plain | bwd ms | bwd / plain |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for dt in args.dtypes:
        for causal in causals:
            for variant in ("plain", *args.variants):
                check(DTYPES[dt], causal, variant)
            for seqlen in args.seqlens:
                batch = max(1, args.tokens // seqlen)
                timings = time_problem(
                    DTYPES[dt], causal, seqlen, batch, args.runs, args.variants, args.rounds
                )
                flops = attention_flops(batch, NHEADS, seqlen, seqlen, HEAD_DIM, causal)
                plain_fwd, plain_bwd = timings["plain"]
                for variant, (fwd, bwd) in timings.items():
                    fields = peers.problem(batch, NHEADS, seqlen, seqlen, HEAD_DIM, causal)
                    for mode, timing, scale in (("forward", fwd, 1.0), ("backward", bwd, 2.5)):
                        records.append(
                            peers.record(
                                timing,
                                flops * scale,
                                "numflash",
                                mode,
                                dt,
                                variant=variant,
                                nheads_k=NHEADS_K,
                                **fields,
                            )
                        )
                    backward = (f"| {bwd.median_ms:.3f} | "
                                f"{bwd.median_ms / plain_bwd.median_ms:.3f} |")  # fmt: skip
                    lines.append(
                        f"| {dt} | {seqlen} | {causal} | {variant} | {fwd.median_ms:.3f} | "
                        f"{fwd.median_ms / plain_fwd.median_ms:.3f} {backward}"
                    )
                    print(lines[-1], flush=True)
    if args.no_decode:
        peers.save_results(args.out_dir, "variants", dev, records, "\n".join(lines) + "\n")
        return
    lines += [
        "",
        "gpt-oss-style decoding step (batch 64 x 4096 cached in pages of 16, 64 / 8 heads, "
        "head_dim 64, window 128), us:",
        "",
        "| dtype | plain | sinks | sinks / plain |",
        "|---|---|---|---|",
    ]
    for dt in args.dtypes:
        plain, sinks = time_decode(DTYPES[dt], args.runs)
        for variant, timing in (("plain", plain), ("sinks", sinks)):
            records.append(peers.record(timing, 0, "numflash", "decode", dt, variant=variant))
        lines.append(f"| {dt} | {plain.median_ms * 1e3:.1f} | {sinks.median_ms * 1e3:.1f} | "
                     f"{sinks.median_ms / plain.median_ms:.3f} |")  # fmt: skip
        print(lines[-1], flush=True)
    peers.save_results(args.out_dir, "variants", dev, records, "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
