"""Chunked prefill over a contiguous cache and over paged ones: where the paged forward's time goes.

Times ``attention_with_kvcache`` (fp16, 32 query heads, 8 KV heads, head_dim 128, causal) on
the Hopper forward for benchmarks/bench_prefill.py's two shapes (4 sequences of 128 new rows
over 8192 cached, 1 of 2048 over 16384) and with its arrays, over a contiguous cache and over
the same keys in pages of each size (shuffled, as benchmarks/bench_decode.py lays them out);
CUDA events, median of 30 runs. Beside that benchmark it forces schedules and register splits
and runs each call once for a profiler.

    python tools/paged_prefill.py [--page-sizes 16 128 0] [--in-order] [--persistent]
                                  [--stages 3] [--registers 24,240] [--grouped-ab [--rounds 3]]
                                  [--producer-ab [--rounds 3]] [--against OTHER [--rounds 3]]
                                  [--append-cost [--rounds 3]] [--append-ab [--rounds 3]]
    ncu --profile-from-start off -k regex:forward_sm90 --metrics smsp__inst_executed.sum \\
        python tools/paged_prefill.py --profile      # one call of each, the first shape

A page size of 0 is one page a sequence (the cache's whole capacity: a tensor map over pages
that are the contiguous cache's rows); ``--in-order`` lays the pages out in order instead of
shuffled; ``--persistent`` runs the paged kernel persistent (forward_sm90.persistent), as the
contiguous one runs. ``--stages`` forces a WgmmaForwardConfig of 2 consumers, 128-key tiles and pingpong with that
many stages (default: numflash's choice); ``--registers P,C`` sets what setmaxnreg gives the
producer and each consumer of the paged kernel for this run (forward_sm90.PAGED_REGISTER_SPLIT).
``--grouped-ab`` times each paged layout twice in one process, taking turns ``--rounds`` times
(each its fastest round): with the tiles in 8-row groups of every atom, a page's box copying
them all (forward_sm90.grouped_pages, numflash's choice where the maps allow it), and with
one box a page and atom (the layout of other page sizes). ``--producer-ab`` takes the same
turns with one producer warp issuing K's and V's boxes and with a warp each
(forward_sm90.PAGED_PRODUCER_WARPS). ``--against`` times each layout with
this checkout's numflash and another checkout's (loaded beside it as tools/host_ab.py does, its
kernels compiled apart), taking turns ``--rounds`` times, and says whether the two gave the same
bits: how a kernel change is measured without the noise between processes
(``git worktree add ../before HEAD~1``, then ``--against ../before``). ``--append-cost``
times, in turns, ``attention`` on the keys and each layout's call with its new rows and
without (no k and v, the lengths counting the rows an earlier call appended): what the
in-place append adds. ``--append-ab`` times short chunks (and cold caches) with the
kernel's own append and with the append launch, in turns. The append kernel alone: ``ncu
--profile-from-start off -k regex:append --section SpeedOfLight python tools/paged_prefill.py
--profile``.
"""

import argparse
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.join(HERE, "..", "benchmarks")]

import cupy  # noqa: E402
from bench_prefill import SHAPES, cache_layouts, kvcache_runs, shape_arrays  # noqa: E402

import numflash  # noqa: E402
from numflash import api, launch  # noqa: E402
from numflash.kernels import forward_sm90  # noqa: E402
from numflash.timing import time_gpu  # noqa: E402


def calls(batch, new, cached, page_sizes, config, shuffled=True, nf=numflash):
    """(layout, call) for the contiguous cache and each page size (0: the whole capacity),
    over the same keys, through the numflash package ``nf``."""
    q, k_new, v_new, k_cache, v_cache = shape_arrays(batch, new, cached, cupy.float16)
    sizes = [size or k_cache.shape[1] for size in page_sizes]
    layouts = cache_layouts(k_cache, v_cache, sizes, shuffled)
    return kvcache_runs(q, k_new, v_new, layouts, cached, config, nf)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--page-sizes", type=int, nargs="+", default=[16, 64, 128, 256])
    ap.add_argument("--in-order", action="store_true", help="pages in order, not shuffled")
    ap.add_argument("--persistent", action="store_true", help="the paged kernel persistent")
    ap.add_argument("--stages", type=int, help="force 2 consumers, 128-key tiles, pingpong")
    ap.add_argument("--registers", help="P,C: the paged kernel's producer and consumer registers")
    ap.add_argument("--profile", action="store_true", help="one call each under the profiler")
    ap.add_argument("--grouped-ab", action="store_true", help="grouped tiles against one-atom")
    ap.add_argument("--producer-ab", action="store_true", help="two producer warps against one")
    ap.add_argument("--against", help="another checkout, timed in turns with this one")
    ap.add_argument("--append-cost", action="store_true", help="calls with and without k, v")
    ap.add_argument("--append-ab", action="store_true", help="the kernel's append or a launch")
    ap.add_argument("--rounds", type=int, default=3, help="the turns of the A/B options")
    args = ap.parse_args()
    if args.registers:
        producer, consumer = (int(x) for x in args.registers.split(","))
        split = dict(forward_sm90.PAGED_REGISTER_SPLIT)
        split[2] = (producer, consumer)
        forward_sm90.PAGED_REGISTER_SPLIT = split
    if args.persistent:
        forward_sm90.persistent = lambda producer, cache=None: producer
    config = None
    if args.stages:
        config = numflash.WgmmaForwardConfig(2, 128, args.stages, pingpong=True)
    if args.profile:
        shape = calls(*SHAPES[0][1:], args.page_sizes, config, not args.in_order)
        for _, call in shape:
            call()
        cupy.cuda.Device().synchronize()
        cupy.cuda.runtime.profilerStart()
        for _, call in shape:
            call()
        cupy.cuda.Device().synchronize()
        cupy.cuda.runtime.profilerStop()
        return
    if args.grouped_ab:
        return grouped_ab(args, config)
    if args.producer_ab:
        return producer_ab(args, config)
    if args.against:
        return against(args)
    if args.append_cost:
        return append_cost(args, config)
    if args.append_ab:
        return append_ab(args, config)
    found = {}
    for name, *sizes in SHAPES:
        for layout, call in calls(*sizes, args.page_sizes, config, not args.in_order):
            found[f"{name}, {layout}"] = us = time_gpu(call, warmup=3, runs=30).median_ms * 1e3
            print(f"{name:24s} {layout:12s} {us:9.1f} us", flush=True)
    settings = {"stages": args.stages, "registers": args.registers, "in_order": args.in_order}
    print(json.dumps({**settings, "persistent": args.persistent, "us": found}))


def grouped_ab(args, config):
    """--grouped-ab: each layout with and without grouped tiles, in turns; prints both."""
    grouped_pages = forward_sm90.grouped_pages

    def use(grouped):
        forward_sm90.grouped_pages = grouped_pages if grouped else lambda *a: False

    _turns(args, config, {"": lambda: use(True), ", one-atom boxes": lambda: use(False)})
    use(True)  # numflash's own choice again


def producer_ab(args, config):
    """--producer-ab: each layout with one producer warp and with two (K's and V's), in turns."""

    default = forward_sm90.PAGED_PRODUCER_WARPS

    def use(warps):
        forward_sm90.PAGED_PRODUCER_WARPS = warps

    _turns(args, config, {"": lambda: use(1), ", two producer warps": lambda: use(2)})
    use(default)  # numflash's own choice again


def append_cost(args, config):
    """--append-cost: per shape, ``attention`` on the keys and each layout's call with its new
    rows and without them, in turns; prints each, its speed beside attention's, and JSON."""
    found = {}
    for name, batch, new, cached in SHAPES:
        q, k_new, v_new, k_cache, v_cache = shape_arrays(batch, new, cached, cupy.float16)
        runs = {"attention": lambda: numflash.attention(q, k_cache, v_cache, causal=True)}
        sizes = [size or k_cache.shape[1] for size in args.page_sizes]
        layouts = cache_layouts(k_cache, v_cache, sizes, not args.in_order)
        appending = kvcache_runs(q, k_new, v_new, layouts, cached, config)
        lengths = cupy.full((batch,), cached + new, dtype=cupy.int32)
        for (layout, call), (_, kc, vc, kw) in zip(appending, layouts):

            def without(kc=kc, vc=vc, kw=kw):  # the rows the call appends, counted as cached
                return numflash.attention_with_kvcache(
                    q, kc, vc, cache_seqlens=lengths, causal=True, config=config, **kw
                )

            runs[f"{layout}, appending"] = call
            runs[f"{layout}, without new rows"] = without
        _fastest_in_turns(runs, args.rounds, found, name)
        for label in runs:
            us = found[f"{name}, {label}"]
            ratio = found[f"{name}, attention"] / us
            print(f"{name:24s} {label:34s} {us:9.1f} us  {ratio:.3f}x attention", flush=True)
    print(json.dumps({"rounds": args.rounds, "us": found}))


#: --append-ab's shapes beside SHAPES' first: (name, batch, new rows, cached keys)
APPEND_SHAPES = [
    ("b8 new128 cached1024", 8, 128, 1024),
    ("b4 new128 cached0", 4, 128, 0),
    ("b32 new64 cached0", 32, 64, 0),
]


def append_ab(args, config):
    """--append-ab: per shape (SHAPES' first and APPEND_SHAPES: short chunks, which the
    Hopper forward appends itself), dtype and layout, the call with the kernel's own append
    (wgmma_forward.appends_in_kernel, over pages too: PAGED_APPEND) and with the append
    launch before it, in turns; prints
    both, the speed of the first over the second, whether they gave the same bits (output
    and caches), and JSON."""
    from bench_forward import DTYPES

    from numflash.families import wgmma_forward

    rows, paged = wgmma_forward.APPEND_ROWS, wgmma_forward.PAGED_APPEND
    found, same = {}, {}

    def use(label):
        wgmma_forward.APPEND_ROWS = rows if label.endswith("kernel") else 0
        wgmma_forward.PAGED_APPEND = label.endswith("kernel")  # over pages too
        _forget_kernels()

    for dtype in ("float16", "bfloat16"):
        for name, batch, new, cached in SHAPES[:1] + APPEND_SHAPES:
            arrays = shape_arrays(batch, new, cached, DTYPES[dtype])
            sizes = [size or arrays[3].shape[1] for size in args.page_sizes]
            layouts = cache_layouts(*arrays[3:], sizes, not args.in_order)
            for (layout, call), (_, kc, vc, _) in zip(
                kvcache_runs(*arrays[:3], layouts, cached, config), layouts
            ):
                bits = []
                for label in ("kernel", "launch"):
                    use(label)
                    out = call()
                    bits.append([x.view(cupy.uint16).copy() for x in (out, kc, vc)])
                key = f"{dtype} {name}, {layout}"
                same[key] = all(bool((a == b).all()) for a, b in zip(*bits))
                runs = {"append by the kernel": call, "append launch": call}
                _fastest_in_turns(runs, args.rounds, found, key, before=use)
                mine, theirs = (found[f"{key}, {label}"] for label in runs)
                print(f"{key:44s} {mine:8.1f} us, launch {theirs:8.1f} us: "
                      f"{theirs / mine:.3f}x, same bits {same[key]}", flush=True)  # fmt: skip
    use("kernel")
    wgmma_forward.PAGED_APPEND = paged  # numflash's own choice again
    print(json.dumps({"rounds": args.rounds, "us": found, "same_bits": same}))


def _forget_kernels():
    """After a switch of the kernels numflash builds: a replay plan keeps the kernels it
    recorded, and so does a launch prepared for the geometry."""
    api._plans.clear()
    launch._prepared.clear()


def _fastest_in_turns(runs, rounds, found, prefix, alternate=False, before=None):
    """Time each of ``runs`` ({label: call}) in turns, ``rounds`` times (every other round in
    reverse order where ``alternate``; ``before(label)`` first where given), keeping each
    label's fastest median (us) in ``found`` under "``prefix``, label"."""
    labels = list(runs)
    for r in range(rounds):
        for label in labels[::-1] if alternate and r % 2 else labels:
            if before is not None:
                before(label)
            us = time_gpu(runs[label], warmup=3, runs=30).median_ms * 1e3
            key = f"{prefix}, {label}"
            found[key] = min(found.get(key, us), us)


def _turns(args, config, variants):
    """Each paged layout under each of ``variants`` ({label suffix: a call that switches to it},
    the first's suffix empty) in turns, ``--rounds`` times, each its fastest round; the
    contiguous cache under the first alone. Prints them and their JSON."""
    found, taken = {}, list(variants.items())
    for name, *sizes in SHAPES:
        for layout, call in calls(*sizes, args.page_sizes, config, not args.in_order):
            switches = {layout + suffix: switch for suffix, switch in taken}
            if layout == "contiguous":
                switches = dict(list(switches.items())[:1])

            def before(label, switches=switches):
                switches[label]()
                _forget_kernels()

            runs = dict.fromkeys(switches, call)
            _fastest_in_turns(runs, args.rounds, found, name, before=before)
            for key in [k for k in found if k.startswith(f"{name}, {layout}")]:
                print(f"{key:56s} {found[key]:9.1f} us", flush=True)
    print(json.dumps({"variants": list(variants), "rounds": args.rounds, "us": found}))


def against(args):
    """--against: each layout with this checkout's numflash and the other's, in turns; each
    tree runs on its own copy of the same arrays (the inputs are seeded)."""
    from host_ab import load_other

    packages = {"this": numflash, "other": load_other(args.against)}
    found, same = {}, {}
    for name, *sizes in SHAPES:
        per_tree = []
        for nf in packages.values():
            config = (
                nf.WgmmaForwardConfig(2, 128, args.stages, pingpong=True) if args.stages else None
            )
            per_tree.append(calls(*sizes, args.page_sizes, config, not args.in_order, nf))
        for (layout, this_run), (_, other_run) in zip(*per_tree):
            runs = {"this": this_run, "other": other_run}
            same[f"{name}, {layout}"] = bool((this_run() == other_run()).all())
            _fastest_in_turns(runs, args.rounds, found, f"{name}, {layout}", alternate=True)
            this, other = (found[f"{name}, {layout}, {tree}"] for tree in runs)
            print(f"{name:24s} {layout:12s} this {this:9.1f} us  other {other:9.1f} us  "
                  f"other/this {other / this:.3f}  same bits {same[f'{name}, {layout}']}",
                  flush=True)  # fmt: skip
    print(json.dumps({"against": args.against, "rounds": args.rounds, "us": found, "same": same}))


if __name__ == "__main__":
    main()
