"""Compile every kernel family for every target architecture without a GPU; print a JSON report.

Run by tests/test_compile.py in a subprocess with the simulator off (the test process itself
may be in the simulator). For each kernel: which instructions its PTX holds, and ptxas' resource
report (registers, stack frame, spills).

    python tests/compile_targets.py [--quick | --shipped]
"""

import json
import os
import re
import sys

os.environ.pop("NUMBA_ENABLE_CUDASIM", None)

from numflash import cache, launch  # noqa: E402
from numflash.config import TensorCoreBackwardConfig, config_from_dict  # noqa: E402
from numflash.kernels import (  # noqa: E402
    backward_mma,
    backward_portable,
    backward_sm90,
    forward,
    forward_portable,
    offline,
)
from numflash.selection import (  # noqa: E402
    default_config,
    default_portable_backward_config,
    default_portable_config,
    default_tensor_core_config,
)

forward_signature = launch.FORWARD.signature

#: Ampere, Ada, Hopper, Blackwell (B200: sm_100a; RTX 50 series: sm_120). ptxas' resource report
#: (spills, stack) is read for RESOURCE_TARGET, the GPU the defaults were chosen on.
TENSOR_CORE_TARGETS = [(8, 0), (8, 6), (8, 9), (9, 0, "a"), (10, 0, "a"), (12, 0)]
RESOURCE_TARGET = (9, 0, "a")
PORTABLE_TARGETS = [(7, 5), (9, 0, "a"), (12, 0)]
INSTRUCTIONS = [
    "mma.sync.aligned.m16n8k16",
    "ldmatrix.sync.aligned",
    "cp.async.cg.shared.global",
    "cp.async.wait_group",
    "ex2.approx",
    "shfl.sync.bfly",
    "wgmma.mma_async",
    "wgmma.fence",
    "wgmma.wait_group",
    "fence.proxy.async",
]


def report(kernel, dtype, cc, resources, signature=None):
    ptx = offline.compile_ptx(kernel, signature or forward_signature(dtype), cc)
    entry = {"target": offline.arch_name(cc), "counts": {i: ptx.count(i) for i in INSTRUCTIONS}}
    if resources:
        usage = offline.resource_usage(ptx, cc)
        # ptxas' numbered remarks (e.g. "(C7511) ... wgmma.mma_async instructions are
        # serialized") and warnings
        usage["remarks"] = [
            line
            for line in usage.pop("log").splitlines()
            if re.search(r"\(C\d{4}\)", line) or "arning" in line
        ]
        entry["resources"] = usage
    return entry


def shipped_configurations():
    """Every distinct tuned tensor-core configuration in numflash/configs, compiled for the
    targets of the architecture its file serves (sm_90.json: sm_90a), with ptxas' report."""
    results = []
    for path in sorted(cache.SHIPPED_DIR.glob("sm_*.json")):
        major = int(path.stem[3:]) // 10
        targets = [cc for cc in TENSOR_CORE_TARGETS if cc[0] == major]
        seen = set()
        for key, entry in cache.shipped_entries(path.stem).items():
            cfg = config_from_dict(entry["config"])
            if key.family != "tensor-core" or (key.head_dim, key.dtype, cfg) in seen:
                continue
            seen.add((key.head_dim, key.dtype, cfg))
            kernel = forward.build(
                key.head_dim,
                key.dtype,
                cfg.block_m,
                cfg.block_n,
                cfg.num_warps,
                cfg.stages,
                cfg.q_in_registers,
            )
            for cc in targets:
                results.append(
                    {
                        "family": "shipped",
                        "file": path.name,
                        "head_dim": key.head_dim,
                        "dtype": key.dtype,
                        "config": cfg.to_dict(),
                        **report(kernel, key.dtype, cc, resources=True),
                    }
                )
    return results


def main(quick):
    results = []
    head_dims = [64, 128] if quick else [32, 64, 96, 128, 256]
    for hd in head_dims:
        for dtype in ["float16", "bfloat16"]:
            cfg = default_tensor_core_config(hd)
            kernel = forward.build(
                hd, dtype, cfg.block_m, cfg.block_n, cfg.num_warps, cfg.stages, cfg.q_in_registers
            )
            for cc in TENSOR_CORE_TARGETS:
                # ptxas' report on the newest target is enough to see spills.
                entry = report(kernel, dtype, cc, resources=cc == RESOURCE_TARGET)
                results.append(
                    {
                        "family": "tensor-core",
                        "head_dim": hd,
                        "dtype": dtype,
                        "config": cfg.to_dict(),
                        **entry,
                    }
                )
                print(json.dumps(results[-1]), file=sys.stderr, flush=True)
    results += shipped_configurations()
    for hd, dtype in [(64, "float32"), (128, "float16"), (256, "bfloat16")]:
        cfg = default_portable_config(hd)
        kernel = forward_portable.build(hd, dtype, cfg.block_m, cfg.block_n)
        for cc in PORTABLE_TARGETS:
            entry = report(kernel, dtype, cc, resources=False)
            results.append(
                {
                    "family": "portable",
                    "head_dim": hd,
                    "dtype": dtype,
                    "config": cfg.to_dict(),
                    **entry,
                }
            )
    for hd, dtype in [(64, "float32"), (128, "float16"), (256, "bfloat16")]:
        cfg = default_portable_backward_config(hd)
        signatures = {
            "preprocess": launch.PREPROCESS.signature(dtype),
            "dkdv": launch.PORTABLE_DKDV.signature(dtype),
            "dq": launch.DQ.signature(dtype),
        }
        kernels = {
            "preprocess": backward_portable.build_preprocess(hd, dtype, 8),
            "dkdv": backward_portable.build_dkdv(hd, dtype, cfg.block_m, cfg.block_n),
            "dq": backward_portable.build_dq(hd, dtype, cfg.block_m, cfg.block_n),
        }
        for name, kernel in kernels.items():
            for cc in PORTABLE_TARGETS:
                entry = report(kernel, dtype, cc, resources=False, signature=signatures[name])
                results.append(
                    {
                        "family": "portable-backward",
                        "kernel": name,
                        "head_dim": hd,
                        "dtype": dtype,
                        "config": cfg.to_dict(),
                        **entry,
                    }
                )
    # the defaults (dQ from its own kernel), and dQ by atomics from the dK/dV kernel
    atomic = TensorCoreBackwardConfig(64, 8, 2, dq_separate=False)
    for hd, dtype, cfg in [
        (64, "float16", None),
        (128, "bfloat16", None),
        (256, "bfloat16", None),
        (128, "float16", atomic),
    ]:
        cfg = cfg or default_config("tensor-core-backward", hd, None)[1]
        tiles, split = (cfg.block_m, cfg.num_warps, cfg.stages), cfg.head_split
        built = backward_mma.build_kernels(hd, dtype, *tiles, cfg.dq_separate, split)
        kernels = {"dkdv": (built.dkdv, launch.TENSOR_CORE_DKDV.signature(dtype))}
        if cfg.dq_separate:
            kernels["dq"] = (built.dq, launch.DQ.signature(dtype))
        for name, (kernel, signature) in kernels.items():
            for cc in TENSOR_CORE_TARGETS:
                entry = report(
                    kernel, dtype, cc, resources=cc == RESOURCE_TARGET, signature=signature
                )
                results.append(
                    {
                        "family": "tensor-core-backward",
                        "head_dim": hd,
                        "dtype": dtype,
                        "kernel": name,
                        "config": cfg.to_dict(),
                        **entry,
                    }
                )
    # wgmma (sm_90a only): the tiles of tests/wgmma_gemm.py, assembled by ptxas
    import wgmma_gemm

    for dtype in ["float16", "bfloat16"]:
        for variant in wgmma_gemm.VARIANTS:
            entry = report(
                wgmma_gemm.build(dtype, variant),
                dtype,
                (9, 0, "a"),
                resources=True,
                signature=wgmma_gemm.signature(),
            )
            results.append({"family": "wgmma", "dtype": dtype, "variant": variant, **entry})
        entry = report(
            wgmma_gemm.build_chain(dtype),
            dtype,
            (9, 0, "a"),
            resources=True,
            signature=wgmma_gemm.chain_signature(),
        )
        results.append({"family": "wgmma", "dtype": dtype, "variant": "chain", **entry})
    # the Hopper backward kernels (sm_90a only): two warpgroups at head_dim 128, the library's
    # default there; one warpgroup and one stage at 64
    for hd, dtype, warps, stages in [(128, "float16", 8, 2), (64, "bfloat16", 4, 1)]:
        kernels = backward_sm90.build_kernels(hd, dtype, warps, stages)
        for name, kernel, signature in [
            ("dkdv", kernels.dkdv, launch.TENSOR_CORE_DKDV.signature(dtype)),
            ("dq", kernels.dq, launch.DQ.signature(dtype)),
        ]:
            entry = report(kernel, dtype, (9, 0, "a"), resources=True, signature=signature)
            results.append(
                {
                    "family": "wgmma-backward",
                    "head_dim": hd,
                    "dtype": dtype,
                    "kernel": name,
                    "num_warps": warps,
                    **entry,
                }
            )
    print(json.dumps(results))


if __name__ == "__main__":
    if "--shipped" in sys.argv:  # the shipped configurations alone, with ptxas' reports
        print(json.dumps(shipped_configurations()))
    else:
        main("--quick" in sys.argv)
