"""``numflash autotune``: plan the problem keys, run a study per key, record, report.

Each key's winner is written to the cache as soon as its study ends, so a run that is stopped
keeps what it finished, and the studies themselves (SQLite) resume where they stopped.
"""

import dataclasses
import itertools
import sys
import time

from numflash import cache
from numflash.config import CONFIG_TYPES, MAX_HEAD_DIM, TensorCoreConfig
from numflash.selection import default_config

from . import space

QUICK = dict(
    head_dims=[64, 128],
    dtypes=["float16"],
    masks=["full", "causal"],
    seqlens=[4096],
    trials=8,
    timeout_per_key=120,
)


def _bounded_int(flag, low, high=None):
    """An argparse type: an int in [low, high], else an error naming ``flag``."""
    import argparse

    def parse(text):
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{flag} takes integers; got {text!r}") from None
        if value < low or (high is not None and value > high):
            bound = f"in [{low}, {high}]" if high is not None else f">= {low}"
            raise argparse.ArgumentTypeError(f"{flag} takes integers {bound}; got {value}")
        return value

    return parse


def _positive_float(flag):
    """An argparse type: a finite number > 0, else an error naming ``flag``."""
    import argparse
    import math

    def parse(text):
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"{flag} takes a number of seconds; got {text!r}"
            ) from None
        if not (math.isfinite(value) and value > 0):
            raise argparse.ArgumentTypeError(f"{flag} takes a number of seconds > 0; got {text}")
        return value

    return parse


def add_arguments(parser):
    parser.add_argument(
        "--family",
        default=TensorCoreConfig.family,
        choices=list(CONFIG_TYPES),
        help="the kernels to tune: the forward's (default), the backward's or the KV cache's "
        "(a decoding step over caches of --seqlens keys)",
    )
    parser.add_argument(
        "--head-dims",
        type=_bounded_int("--head-dims", 1, MAX_HEAD_DIM),
        nargs="+",
        default=[64, 128],
    )
    parser.add_argument(
        "--dtypes",
        nargs="+",
        default=["float16", "bfloat16"],
        choices=["float16", "bfloat16", "float32"],
    )
    parser.add_argument(
        "--masks", nargs="+", default=["full", "causal"], choices=["full", "causal", "window"]
    )
    parser.add_argument(
        "--seqlens",
        type=_bounded_int("--seqlens", 1, cache.MAX_BUCKET),
        nargs="+",
        default=[1024, 4096, 16384],
        help="sequence lengths; each is tuned at its power-of-two bucket",
    )
    parser.add_argument(
        "--grids",
        nargs="+",
        default=list(cache.GRIDS),
        choices=list(cache.GRIDS),
        help="KV-cache families: the grid classes to tune, calls whose thread blocks without "
        "splits fill fewer or more than two a multiprocessor (tuned at batch 8 and 66 of "
        "32/8 heads on the H200)",
    )
    # the run's numbers: (option, its type, default, help)
    numbers = [
        ("--trials", _bounded_int("--trials", 1), 30,
         "configurations compiled and measured per key (duplicate and infeasible proposals are "
         "skipped and do not count)"),
        ("--timeout-per-key", _positive_float("--timeout-per-key"), 600,
         "seconds a key's study may start new trials for"),
        ("--budget", _positive_float("--budget"), None,
         "seconds for the whole run: no key starts after it is spent"),
        ("--runoff-rounds", _bounded_int("--runoff-rounds", 0), None,
         "rounds in which a key's winner, where it is not the default, is timed again in turn "
         "with the default, written only if it stays MIN_GAIN (2%%) faster; 0: no runoff "
         "(default: tuning.study.RUNOFF_ROUNDS, 3)"),
        ("--jobs", _bounded_int("--jobs", 1), None,
         "processes that compile each study's first configurations before any is timed (kept "
         "in the compiled-kernel cache; 1: each trial compiles its own; default: "
         "tuning.precompile.default_jobs(), 8 at most)"),
    ]  # fmt: skip
    for option, kind, default, text in numbers:
        parser.add_argument(option, type=kind, default=default, help=text)
    parser.add_argument(
        "--quick",
        action="store_true",
        help="head dims 64 and 128, fp16, full and causal, seqlen 4096, 8 trials",
    )
    parser.add_argument("--fresh", action="store_true", help="ignore and replace stored studies")
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="print the plan (keys, space sizes) and exit; needs no GPU",
    )
    parser.add_argument(
        "--output",
        default=None,
        help="write winners to this file instead of the user's cache "
        "(how numflash/configs/ files are made)",
    )


def plan(args):
    if args.quick:
        for name, value in QUICK.items():
            setattr(args, name, value)
    if CONFIG_TYPES[args.family].HARDWARE != "portable" and "float32" in args.dtypes:
        raise SystemExit("numflash autotune: the tensor-core kernels take float16 and bfloat16")
    grids = args.grids if args.family in cache.GRID_FAMILIES else [""]
    keys = []
    for dtype, hd, mask, seqlen, grid in itertools.product(
        args.dtypes, args.head_dims, args.masks, args.seqlens, grids
    ):
        head_dim = default_config(args.family, hd, None)[0]  # the head_dim it runs at
        bucket = cache.seqlen_bucket(seqlen)
        key = cache.ProblemKey(args.family, dtype, head_dim, mask, bucket, grid)
        if key not in keys:
            keys.append(key)
    return keys


def tunable(keys, device):
    """({key: its Workload} for the keys whose workload this device can hold, in order, and
    [(key, why not)] for the others)."""
    from .objective import Workload

    kept, skipped = {}, []
    for key in keys:
        try:
            kept[key] = Workload.for_key(key, device)
        except ValueError as exc:
            skipped.append((key, str(exc)))
    return kept, skipped


def _device(dry_run):
    from numflash.device import SIMULATED_DEVICE, current_device, gpu_available
    from numflash.kernels.jit import SIMULATOR

    if SIMULATOR or gpu_available():
        return current_device(), None
    if dry_run:
        # an H200's multiprocessors, which set the KV-cache workloads' batches
        device = dataclasses.replace(SIMULATED_DEVICE, multiprocessors=132)
        return device, "no GPU here: feasibility and batches counted against an H200's limits"
    raise SystemExit("numflash autotune: no CUDA GPU found (use --dry-run to see the plan)")


def print_plan(keys, args, device, note, out, skipped=()):
    """The plan: ``keys`` ({key: Workload}), then the ``skipped`` keys with why."""
    config_type = CONFIG_TYPES[args.family]
    total = len(list(space.all_points(config_type)))
    print(f"device: {device.name} ({device.arch})" + (f" [{note}]" if note else ""), file=out)
    print(
        f"{len(keys)} keys x {args.trials} trials (at most {args.timeout_per_key:.0f} s each); "
        f"search space: {total} points per key",
        file=out,
    )
    for key, w in keys.items():
        feasible = len(space.feasible_points(config_type, key.head_dim, device))
        shape = ""
        if key.grid:
            shape = f" (batch {w.batch} x {w.seqlen} cached keys, {w.nheads}/{w.nheads_k} heads)"
        print(f"  {key}: {feasible} feasible points{shape}", file=out)
    for key, why in skipped:
        print(f"  {key}: skipped ({why})", file=out)
    target = args.output or cache.cache_dir() / (
        "sm_XY.json (XY: the GPU's compute capability)" if note else f"{device.arch}.json"
    )
    print(f"winners -> {target}", file=out)


def report(results, out):
    header = (
        f"{'key':40s} {'default ms':>10s} {'tuned ms':>9s} {'speedup':>7s} "
        f"{'ok/wrong/failed/skipped':>23s}  tuned config"
    )
    print("\n" + header, file=out)
    print("-" * len(header), file=out)
    for r in results:
        cfg = r.best_config
        cfg_text = (
            ", ".join(f"{k}={v}" for k, v in cfg.to_dict().items() if k != "family") if cfg else "-"
        )
        fmt = lambda x, spec: format(x, spec) if x is not None else "-"  # noqa: E731
        counts = f"{r.complete}/{r.rejected}/{r.pruned + r.failed}/{r.skipped}"
        if r.runoff is not None and not r.runoff["kept"]:
            cfg_text += (
                f"  (the default: the study's winner ran {r.runoff['winner_ms']:.3f} ms "
                f"in the runoff, under {r.runoff['min_gain']:.0%} faster)"
            )
        print(
            f"{str(r.key):40s} {fmt(r.default_ms, '10.3f')} {fmt(r.best_ms, '9.3f')} "
            f"{fmt(r.speedup, '7.2f')} {counts:>23s}  {cfg_text}",
            file=out,
        )
    problems = [(r.key, *p) for r in results for p in r.problems]
    if problems:
        print("\nconfigurations that failed or gave wrong results:", file=out)
    for key, number, config, why in problems:
        knobs = ", ".join(f"{k}={v}" for k, v in config.items() if k != "family")
        print(f"  {key} trial {number} ({knobs}): {why[:300]}", file=out)


def main(args, out=sys.stdout):
    device, note = _device(args.dry_run)
    keys, skipped = tunable(plan(args), device)
    print_plan(keys, args, device, note, out, skipped)
    if args.dry_run:
        return 0
    from . import precompile
    from .study import tune_key

    start = time.monotonic()  # the budget counts the compiling too
    jobs = precompile.default_jobs() if args.jobs is None else args.jobs
    precompile.run(list(keys), device, args.trials, jobs, out)
    results = []
    # a file named by --output records, in its header and in each entry, the command that made it
    given = {"command": "numflash " + " ".join(sys.argv[1:])} if args.output else {}
    for i, (key, workload) in enumerate(keys.items(), 1):
        left = None if args.budget is None else args.budget - (time.monotonic() - start)
        if left is not None and left <= 0:
            print(f"budget spent: {len(keys) - i + 1} keys not tuned", file=out)
            break
        timeout = args.timeout_per_key if left is None else min(args.timeout_per_key, left)
        print(f"[{i}/{len(keys)}] {key}", file=out, flush=True)
        result = tune_key(
            key,
            device,
            trials=args.trials,
            timeout_s=timeout,
            fresh=args.fresh,
            progress=True,
            workload=workload,
            **({} if args.runoff_rounds is None else {"runoff_rounds": args.runoff_rounds}),
        )
        results.append(result)
        if result.best_config is not None:
            cache.record(device, {key: {**result.entry(), **given}}, given, path=args.output)
    report(results, out)
    return 0 if all(r.best_config is not None for r in results) else 1
