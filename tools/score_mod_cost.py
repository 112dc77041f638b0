"""What a user's score_mod costs the Hopper forward, by how it is written.

A relative-position bias (score + slope[h] * (q_idx - kv_idx)) in four forms, beside a
score_mod that returns the score (what handing scores to a function costs by itself) and one
that adds the head's slope alone (what a load adds): ``rel_split`` converts each index to
float32 apart (the query's conversion is shared by its row, the key's by its column),
``rel_int`` converts the int difference (Numba widens int32 - int32 to int64: a 64-bit
conversion a score), ``rel_magic`` converts each index by exponent bits instead of a
conversion instruction, ``rel_f64`` leaves float32 * int64 to Numba, which is float64 a score.
Benchmark shape: 32 query heads, 8 KV heads, head_dim 128, batch x seqlen = 32768 tokens.
Each form is first checked against the float64 reference on a small problem (``rel_magic``
against ``rel_split``, whose result it must equal: its helper is not host code); then the
plain call and every form are timed in turn ``--rounds`` times (numflash.timing.time_gpu,
medians, the fastest round kept), in one process.

    python tools/score_mod_cost.py [--dtypes float16] [--seqlens 4096 16384] [--causal both]
"""

import argparse
import os
import sys

from numba import cuda, float32, uint32

import numflash
from numflash import reference
from numflash.kernels import ptx
from numflash.timing import time_gpu

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks"))
import bench_variants  # noqa: E402
from bench_forward import DTYPES  # noqa: E402


@cuda.jit(device=True)
def identity(score, b, h, q_idx, kv_idx, slopes):
    return score


@cuda.jit(device=True)
def head_bias(score, b, h, q_idx, kv_idx, slopes):
    return score + slopes[h]


#: benchmarks/bench_variants.py's relbias and relbias-f64.
rel_split, rel_f64 = bench_variants.relative_bias, bench_variants.relative_bias_f64


@cuda.jit(device=True)
def rel_int(score, b, h, q_idx, kv_idx, slopes):
    return score + slopes[h] * float32(q_idx - kv_idx)


@cuda.jit(device=True)
def exponent_float(i):
    """float32(i) for 0 <= i < 2^23, by the bits of 2^23 + i less 2^23 (GPU code only)."""
    return ptx._bits_to_f32(uint32(0x4B000000) | uint32(i)) - float32(8388608.0)


@cuda.jit(device=True)
def rel_magic(score, b, h, q_idx, kv_idx, slopes):
    return score + slopes[h] * (exponent_float(q_idx) - exponent_float(kv_idx))


FORMS = {
    "identity": identity,
    "head_bias": head_bias,
    "rel_split": rel_split,
    "rel_int": rel_int,
    "rel_magic": rel_magic,
    "rel_f64": rel_f64,
}


def check(dtype, causal, slopes):
    """Raise unless every form's forward is right on a small problem."""
    q, k, v, _ = bench_variants.gqa_arrays(1, 300, dtype, seed=7)
    for name, fn in FORMS.items():
        kwargs = {"score_mod": fn, "mod_args": (slopes,)}
        out, lse = numflash.attention(q, k, v, causal=causal, return_lse=True, **kwargs)
        if name == "rel_magic":
            split = numflash.attention(q, k, v, causal=causal, score_mod=rel_split,
                                       mod_args=(slopes,))  # fmt: skip
            if not bool((out == split).all()):
                raise SystemExit("rel_magic differs from rel_split")
            continue
        variants = reference.Variants(**kwargs)
        result = reference.check(q, k, v, out, lse, causal=causal, variants=variants)
        if not result.ok:
            raise SystemExit(f"{name} wrong: error {result.err:.3g} > bar {result.bar:.3g}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dtypes", nargs="+", default=["float16"], choices=sorted(DTYPES))
    ap.add_argument("--seqlens", nargs="+", type=int, default=[4096, 16384])
    ap.add_argument("--causal", choices=("no", "yes", "both"), default="both")
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--runs", type=int, default=15)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    slopes = bench_variants._slopes()
    causals = {"no": [False], "yes": [True], "both": [False, True]}[args.causal]
    print("| dtype | seqlen | causal | " + " | ".join(["plain ms", *FORMS]) + " |")
    print("|---" * (4 + len(FORMS)) + "|", flush=True)
    for dt in args.dtypes:
        for causal in causals:
            check(DTYPES[dt], causal, slopes)
            for seqlen in args.seqlens:
                batch = max(1, args.tokens // seqlen)
                q, k, v, _ = bench_variants.gqa_arrays(batch, seqlen, DTYPES[dt])
                calls = {"plain": {}}
                calls.update({n: {"score_mod": f, "mod_args": (slopes,)} for n, f in FORMS.items()})
                best = {}
                for _ in range(args.rounds):
                    for name, kwargs in calls.items():

                        def call(kwargs=kwargs):
                            numflash.attention(q, k, v, causal=causal, **kwargs)

                        ms = time_gpu(call, runs=args.runs).median_ms
                        best[name] = min(best.get(name, ms), ms)
                ratios = [f"{best[n] / best['plain']:.3f}" for n in FORMS]
                print(f"| {dt} | {seqlen} | {causal} | {best['plain']:.3f} | "
                      + " | ".join(ratios) + " |", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
