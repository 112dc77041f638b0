"""Check and time tensor-core backward configurations side by side with SDPA's FlashAttention-2.

For each (head_dim, dtype, causal, seqlen) every feasible TensorCoreBackwardConfig of the grid
is first checked against the float64 reference gradients on fresh random inputs (a small
ragged problem with GQA), then its backward is timed on the benchmark shape (batch x seqlen =
32k tokens, nheads x head_dim = 2048); SDPA's FlashAttention-2 backward runs in the same process
on the same inputs. Used to choose the backward defaults and to study what limits the kernel.

    python benchmarks/backward_variants.py --head-dims 128 --seqlens 4096 --out rows.json

``--kernel-variants`` times the default configuration also with other block orders
(backward.build_kernels' ``heavy_group``: 0, the grid's order; 1, each (head, batch) pair's
heaviest rows first; 8, heaviest rows first across groups of 8 pairs) and with the dQ kernel on
a second stream beside the dK/dV kernel (numflash.api._DQ_BESIDE_DKDV); ``--heavy-groups``
and ``--dq-beside`` choose other variants, ``--tiles`` other configurations than the default
(block_m x num_warps, e.g. 64x4), ``--dq-separate`` dQ by atomics (0) as well, ``--wgmma``
the Hopper dK/dV kernel (1; kernels/backward_sm90.py) or the mma.sync one (0). Every run also
reports its time per kernel (D = rowsum(dO * O), dK/dV, dQ), from CUDA events around the
launches.

    python benchmarks/backward_variants.py --kernel-variants --heavy-groups 8 16 --dq-beside 0 \
        --tiles 64x8 64x4 --head-dims 128 --seqlens 4096 --causal yes
"""

import argparse
import collections
import contextlib
import dataclasses
import functools
import itertools
import json
import os
import statistics
import sys
import time

import cupy
import numpy as np

import numflash
import numflash.api
from numflash import reference
from numflash.config import TensorCoreBackwardConfig, default_config
from numflash.device import current_device
from numflash.kernels import backward
from numflash.timing import attention_flops, time_gpu

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import peers  # noqa: E402
from bench_backward import sdpa_runs  # noqa: E402


def configs(head_dim, device, args):
    """The feasible points of the grid (block_m 32-128, 4 or 8 warps: fewer were slower; the
    stages, dq_separate and head_split that ``args`` names), the default first."""
    default = default_config(TensorCoreBackwardConfig.family, head_dim, device)[1]
    yield default
    splits = [2] if head_dim > 128 else args.head_split
    separate = args.dq_separate or [0, 1]
    for bm, nw, st, sep, split in itertools.product((32, 64, 128), (4, 8), args.stages,
                                                    separate, splits):  # fmt: skip
        cfg = TensorCoreBackwardConfig(bm, nw, st, bool(sep), split)
        if cfg != default and not cfg.problems(head_dim, device):
            yield cfg


#: (build_kernels' heavy_group, api._DQ_BESIDE_DKDV): the library's settings first (None: its
#: heavy_group, 8 with the dQ kernel, 1 with atomic dQ)
KERNEL_VARIANTS = [(None, numflash.api._DQ_BESIDE_DKDV), (0, False), (1, False), (8, True)]
_build_kernels = backward.build_kernels


def kernel_variants(args):
    """The (heavy_group, dq_beside) pairs that --heavy-groups and --dq-beside name, else
    KERNEL_VARIANTS."""
    if args.heavy_groups is None and args.dq_beside is None:
        return KERNEL_VARIANTS
    groups = args.heavy_groups or [KERNEL_VARIANTS[0][0]]
    beside = args.dq_beside or [int(KERNEL_VARIANTS[0][1])]
    return [(g, bool(b)) for g in groups for b in beside]


def variant_configs(default, tiles, dq_separate, wgmma=None):
    """The default configuration with each BMxNW of ``tiles`` (block_m x num_warps), each of
    ``dq_separate`` and each of ``wgmma``, where given."""
    shapes = [tuple(int(n) for n in t.lower().split("x")) for t in tiles or []]
    shapes = shapes or [(default.block_m, default.num_warps)]
    separate = [bool(s) for s in dq_separate or [default.dq_separate]]
    kernels = [bool(w) for w in wgmma or [default.wgmma]]
    return [dataclasses.replace(default, block_m=bm, num_warps=nw, dq_separate=sep, wgmma=w)
            for bm, nw in shapes for sep in separate for w in kernels]  # fmt: skip


def use_kernel_variant(heavy_group, dq_beside):
    """Make the API build its tensor-core backward kernels with ``heavy_group`` and launch its
    dQ kernel beside the dK/dV kernel if ``dq_beside``."""
    backward.build_kernels = functools.partial(_build_kernels, heavy_group=heavy_group)
    numflash.api._DQ_BESIDE_DKDV = dq_beside
    numflash.api._launchers.clear()


@contextlib.contextmanager
def recorded_launches():
    """Within it, every launch of the backward's kernels appends (kind, the host's
    perf_counter at the launch, start event, stop event) to the list it yields, the events
    recorded around the launch on the kernel's stream."""
    launched = []
    originals = {name: getattr(numflash.api, name)
                 for name in ("_tensor_core_launcher", "_backward_launcher")}  # fmt: skip

    def traced(launcher_of):
        def launcher(kind, *args):
            launch = launcher_of(kind, *args)

            def run(*largs):
                stream = cupy.cuda.ExternalStream(largs[2])  # the one the kernel runs on
                start, stop = cupy.cuda.Event(), cupy.cuda.Event()
                host = time.perf_counter()
                start.record(stream)
                launch(*largs)
                stop.record(stream)
                launched.append((kind, host, start, stop))

            return run

        return launcher

    for name, launcher_of in originals.items():
        setattr(numflash.api, name, traced(launcher_of))
    try:
        yield launched
    finally:
        for name, launcher_of in originals.items():
            setattr(numflash.api, name, launcher_of)


def kernel_ms(fn, runs=10):
    """{kernel: median ms} of the backward's kernels (preprocess, dkdv, dq) over ``runs`` calls
    of fn, from CUDA events recorded on the stream around each launch."""
    with recorded_launches() as launched:
        fn()  # warm-up
        launched.clear()
        for _ in range(runs):
            fn()
        cupy.cuda.get_current_stream().synchronize()
    events = collections.defaultdict(list)
    for kind, _, start, stop in launched:
        events[kind].append(cupy.cuda.get_elapsed_time(start, stop))
    return {kind: statistics.median(times) for kind, times in events.items()}


def check(cfg, head_dim, dtype, causal, seed):
    """(worst error / bar over dq, dk, dv; NaN count) on a small GQA problem with ragged sizes."""
    rng = np.random.default_rng(seed)
    q, k, v, dout = (
        cupy.asarray(rng.standard_normal(shape).astype(np.float32)).astype(dtype)
        for shape in ((1, 333, 4, head_dim), (1, 517, 2, head_dim), (1, 517, 2, head_dim),
                      (1, 333, 4, head_dim))
    )  # fmt: skip
    out, lse = numflash.attention(q, k, v, causal=causal, return_lse=True)
    dq, dk, dv = numflash.attention_backward(dout, q, k, v, out, lse, causal=causal, config=cfg)
    checks = reference.check_backward(dout, q, k, v, dq, dk, dv, causal=causal)
    return max(c.err / c.bar for c in checks), sum(c.nan for c in checks)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    peers.add_problem_arguments(ap)
    ap.add_argument("--only-default", action="store_true")
    ap.add_argument("--kernel-variants", action="store_true",
                    help="the default configuration, also in other block orders and with dQ beside dK/dV")
    ap.add_argument("--heavy-groups", type=int, nargs="+",
                    help="with --kernel-variants: these block orders (build_kernels' heavy_group)")
    ap.add_argument("--dq-beside", type=int, nargs="+", choices=[0, 1],
                    help="with --kernel-variants: the dQ kernel beside dK/dV (1) or after it (0)")
    ap.add_argument("--tiles", nargs="+", metavar="BMxNW",
                    help="with --kernel-variants: these block_m x num_warps, not the default's")
    ap.add_argument("--wgmma", type=int, nargs="+", choices=[0, 1],
                    help="with --kernel-variants: dK/dV from the mma.sync kernel (0) or the "
                    "Hopper wgmma kernel (1); default: the default configuration's")
    ap.add_argument("--stages", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--dq-separate", type=int, nargs="+", choices=[0, 1],
                    help="dQ from its own kernel (1) or atomics (0); the grid's default: both, "
                    "--kernel-variants': the default configuration's")
    ap.add_argument("--head-split", type=int, nargs="+", default=[1], choices=[1, 2],
                    help="at head_dim <= 128 (above it, 2 is needed)")
    args = ap.parse_args()
    dev = current_device()
    rows = []
    for hd, dt, dtype, causal, seqlen, batch, nheads in peers.problems(args):
        q, k, v = peers.random_qkv(batch, seqlen, nheads, hd, dtype, seed=1)
        out, lse = numflash.attention(q, k, v, causal=causal, return_lse=True)
        dout = peers.random_qkv(batch, seqlen, nheads, hd, dtype, seed=2)[0]
        flops = attention_flops(batch, nheads, seqlen, seqlen, hd, causal, "bwd")
        peer = None
        if peers.torch_available():
            peer = time_gpu(sdpa_runs(q, k, v, causal, "flash")[0]).tflops(flops)
        cfgs = list(configs(hd, dev, args))
        if args.kernel_variants:
            runs = []
            for cfg in variant_configs(cfgs[0], args.tiles, args.dq_separate, args.wgmma):
                problems = cfg.problems(hd, dev)
                if problems:
                    print(f"  {cfg}: skipped, {'; '.join(problems)}", flush=True)
                else:
                    runs += [(cfg, variant) for variant in kernel_variants(args)]
        else:
            kept = cfgs[:1] if args.only_default else cfgs
            runs = [(cfg, KERNEL_VARIANTS[0]) for cfg in kept]
        for i, (cfg, variant) in enumerate(runs):
            t0 = time.time()
            use_kernel_variant(*variant)
            backward_call = functools.partial(numflash.attention_backward, dout, q, k, v, out,
                                              lse, causal=causal, config=cfg)  # fmt: skip
            try:
                ratio_to_bar, nans = check(cfg, hd, dtype, causal, seed=100 + i)
                t = time_gpu(backward_call)
                per_kernel = kernel_ms(backward_call)
            except Exception as exc:  # a variant that fails to build or launch is reported
                print(f"  {cfg} {variant}: FAILED {type(exc).__name__}: {exc}", flush=True)
                continue
            tf = t.tflops(flops)
            ok = ratio_to_bar <= 1 and nans == 0
            row = dict(head_dim=hd, dtype=dt, causal=causal, seqlen=seqlen, batch=batch,
                       nheads=nheads, config=cfg.to_dict(), heavy_group=variant[0],
                       dq_beside_dkdv=variant[1],
                       ms=t.median_ms, kernel_ms=per_kernel, tflops=tf,
                       sdpa_flash=peer, ratio=tf / peer if peer else None,
                       err_over_bar=ratio_to_bar, nans=nans, ok=ok, default=i == 0)  # fmt: skip
            rows.append(row)
            kernels = " ".join(f"{kind} {ms:.2f}" for kind, ms in per_kernel.items())
            print(f"hd{hd} {dt} causal={int(causal)} s{seqlen} bm{cfg.block_m} w{cfg.num_warps} "
                  f"st{cfg.stages}{' dq-kernel' if cfg.dq_separate else ''}"
                  f"{' split2' if cfg.head_split == 2 else ''}{' wgmma' if cfg.wgmma else ''}"
                  f" heavy-group {'default' if variant[0] is None else variant[0]}"
                  f"{' dq-beside' if variant[1] else ''}: "
                  f"{t.median_ms:8.3f} ms ({kernels}) {tf:6.1f} TFLOP/s  "
                  f"sdpa-flash {peer or float('nan'):6.1f}  ratio {row['ratio'] or float('nan'):.3f}"
                  f"  err/bar {ratio_to_bar:.2f} {'ok' if ok else 'WRONG'}  "
                  f"[{time.time() - t0:.1f}s]", flush=True)  # fmt: skip
        del q, k, v, out, lse, dout
        cupy.get_default_memory_pool().free_all_blocks()
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": dev.name, "rows": rows}, f, indent=1)
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    np.seterr(all="ignore")
    sys.exit(main())
