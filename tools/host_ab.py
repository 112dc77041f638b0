"""Host cost of repeated calls, this checkout against another, in one process on the GPU machine.

    python tools/host_ab.py OTHER_CHECKOUT [--rounds 6] [--json PATH]

The host time of a repeated call moves between leases of the GPU machine, and between runs on
one lease, by more than a change to the call's Python saves, so two trees timed in separate runs
cannot be told apart. Here both run in one process: numflash from this checkout, and the other
checkout's loaded under the name ``numflash_other``. In each round every call is timed for both
trees one after the other, the order flipped from round to round, with SDPA once a round:
``attention``, ``attention_backward`` and ``attention_with_kvcache`` (a paged decoding step
with an append, with and without ``out=``), and the full paths of the first two (what a call
without a plan runs), on benchmarks/host_overhead.py's problems and with
its timing (``per_call_us``: bursts of 20 calls, the GPU drained between bursts). The two trees'
results are compared first. Prints each round and the medians; ``--json`` keeps them.
"""

import argparse
import importlib.util
import json
import os
import pathlib
import statistics
import sys

import cupy

import numflash

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks"))
from host_overhead import per_call_us, warm_up  # noqa: E402
from peers import random_qkv  # noqa: E402


def load_other(checkout):
    """The numflash package of another checkout, imported as ``numflash_other`` (its modules
    import each other relatively, so they load beside this checkout's)."""
    root = pathlib.Path(checkout).resolve() / "numflash"
    spec = importlib.util.spec_from_file_location(
        "numflash_other", root / "__init__.py", submodule_search_locations=[str(root)]
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules["numflash_other"] = module
    spec.loader.exec_module(module)
    return module


def calls(nf):
    """{name: call} of package ``nf``, on benchmarks/host_overhead.py's problems."""
    q, k, v = random_qkv(1, 128, 1, 64, "float16")
    out, lse = nf.attention(q, k, v, return_lse=True)
    dout = random_qkv(1, 128, 1, 64, "float16", seed=1)[0]
    qd = random_qkv(4, 1, 8, 64, "float16", seed=2)[0]
    k_cache, v_cache = random_qkv(64, 16, 2, 64, "float16", seed=3)[:2]
    k_new, v_new = random_qkv(4, 1, 2, 64, "float16", seed=4)[:2]
    table = cupy.arange(64, dtype=cupy.int32).reshape(4, 16)
    lengths = cupy.full((4,), 100, dtype=cupy.int32)
    out_d = cupy.empty_like(qd)
    step = (qd, k_cache, v_cache, k_new, v_new)
    full = (False, None, (-1, -1), False, None, None)  # causal, scale, window, lse, out, config
    return {
        "attention": lambda: nf.attention(q, k, v),
        "attention_backward": lambda: nf.attention_backward(dout, q, k, v, out, lse),
        "attention_with_kvcache": lambda: nf.attention_with_kvcache(
            *step, cache_seqlens=lengths, block_table=table
        ),
        "attention_with_kvcache[out given]": lambda: nf.attention_with_kvcache(
            *step, cache_seqlens=lengths, block_table=table, out=out_d
        ),
        # the full paths, which a call without a plan takes (its first, or one no plan takes)
        "attention[full path]": lambda: nf.api._attention(q, k, v, *full),
        "attention_backward[full path]": lambda: nf.api._attention_backward(
            dout, q, k, v, out, lse, False, None, (-1, -1), False, None
        ),
    }


def same_results(a, b):
    """Whether two calls' results agree (the backward to fp16 rounding: its dQ may be summed in
    another order)."""
    a = a if isinstance(a, tuple) else (a,)
    b = b if isinstance(b, tuple) else (b,)
    return all(
        bool(cupy.allclose(x.astype(cupy.float32), y.astype(cupy.float32), rtol=0, atol=2e-3))
        for x, y in zip(a, b, strict=True)
    )


def sdpa():
    """PyTorch's SDPA on attention's problem, or None without PyTorch."""
    try:
        import torch
        import torch.nn.functional as F
    except ImportError:
        return None
    q, k, v = (torch.from_dlpack(x).transpose(1, 2) for x in random_qkv(1, 128, 1, 64, "float16"))
    return lambda: F.scaled_dot_product_attention(q, k, v)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("other", help="the other checkout (the folder holding its numflash/)")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    trees = {"this": numflash, "other": load_other(args.other)}
    timed = {name: calls(nf) for name, nf in trees.items()}
    for call in timed["this"]:
        if not same_results(timed["this"][call](), timed["other"][call]()):
            raise SystemExit(f"the two trees disagree on {call}")
    warm_up()
    peer = sdpa()
    rounds = []
    for r in range(args.rounds):
        order = ["this", "other"] if r % 2 == 0 else ["other", "this"]
        row = {tree: {} for tree in order}
        for call in timed["this"]:
            for tree in order:
                row[tree][call] = round(per_call_us(timed[tree][call]), 2)
        if peer is not None:
            row["sdpa"] = round(per_call_us(peer), 2)
        rounds.append(row)
        print(f"round {r}: {json.dumps(row)}", flush=True)
    medians = {
        tree: {call: statistics.median(row[tree][call] for row in rounds) for call in timed[tree]}
        for tree in trees
    }
    if peer is not None:
        medians["sdpa"] = statistics.median(row["sdpa"] for row in rounds)
    results = {
        "this": os.path.dirname(numflash.__file__),
        "other": os.path.dirname(trees["other"].__file__),
        "medians_us": medians,
        "rounds_us": rounds,
    }
    print(json.dumps(results["medians_us"], indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
            f.write("\n")


if __name__ == "__main__":
    main()
