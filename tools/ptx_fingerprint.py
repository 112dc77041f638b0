"""Fingerprints of the PTX every kernel family generates, for representative configurations.

The PTX is normalised (comments, the target line and Numba's mangled symbol names dropped), so
a fingerprint changes only when the instructions do. tests/test_fingerprints.py compares them
with tests/ptx_fingerprints.json: a kernel whose code changed needs its family's ``REVISION``
bumped (numflash/config.py), which retires the tuned entries measured on the old code.

    python tools/ptx_fingerprint.py                 # print {kernel: fingerprint} as JSON
    python tools/ptx_fingerprint.py --record        # rewrite tests/ptx_fingerprints.json
    python tools/ptx_fingerprint.py --dump DIR      # also write each normalised PTX to DIR

The JSON printed also lists the kernels whose PTX has a float64 instruction ("float64").
"""

import argparse
import hashlib
import json
import os
import re
import sys
from pathlib import Path

os.environ.pop("NUMBA_ENABLE_CUDASIM", None)

from numflash import config, launch, selection  # noqa: E402
from numflash.families import wgmma_forward  # noqa: E402
from numflash.kernels import (  # noqa: E402
    backward_mma,
    backward_portable,
    backward_sm90,
    decode,
    decode_portable,
    forward,
    forward_portable,
    forward_sm90,
    offline,
    work_order,
)

RECORD = Path(__file__).resolve().parent.parent / "tests" / "ptx_fingerprints.json"
TARGET = (9, 0, "a")
_SKIP = (".version", ".target", ".file", ".loc", "//")


#: Numba declares one 64-bit global per device function (its exception slot), used by none
#: of the kernels' instructions: how a kernel is split into device functions does not count.
_SLOT = re.compile(r"^\.common \.global \.align 8 \.u64 _ZN[0-9A-Za-z_$]+;$")


_SYMBOL = re.compile(r"_ZN[0-9A-Za-z_$]+|_cudapy_smem_[0-9]+")
_SHARED_DECLARATION = ".extern .shared"


def normalise(ptx):
    """The PTX without comments, target and file lines or device functions' exception slots,
    symbols renamed in order of use in the code (shared arrays too: Numba numbers them by how
    many arrays the process compiled before), and a kernel's dynamic shared-array declarations
    sorted: Numba declares them in an order that changes from process to process (seen in
    the paged chunked-prefill kernel, which declares several)."""
    lines = [
        line
        for line in ptx.splitlines()
        if not (line.strip().startswith(_SKIP) or _SLOT.match(line.strip()))
    ]
    names = {}
    for declarations in (False, True):  # names by first use outside the declarations, then in
        for line in lines:
            if line.lstrip().startswith(_SHARED_DECLARATION) == declarations:
                for m in _SYMBOL.finditer(line):
                    names.setdefault(m.group(0), f"SYM{len(names)}")
    lines = [_SYMBOL.sub(lambda m: names[m.group(0)], line) for line in lines]
    at = [i for i, line in enumerate(lines) if line.lstrip().startswith(_SHARED_DECLARATION)]
    for i, line in zip(at, sorted(lines[i] for i in at)):
        lines[i] = line
    return "\n".join(lines)


def cases():
    """(family, name, kernel, signature) of the kernels fingerprinted."""
    for hd, dt in [(64, "float16"), (96, "float16"), (128, "bfloat16"), (256, "float16")]:
        c = selection.default_tensor_core_config(hd)
        kernel = forward.build(
            hd, dt, c.block_m, c.block_n, c.num_warps, c.stages, c.q_in_registers
        )
        yield (
            config.TensorCoreConfig.family,
            f"forward-{hd}-{dt}",
            kernel,
            launch.FORWARD.signature(dt),
        )
    c = selection.default_tensor_core_config(128)
    yield (
        config.TensorCoreConfig.family,
        "forward-varlen-128-bfloat16",
        forward.build_varlen(
            128, "bfloat16", c.block_m, c.block_n, c.num_warps, c.stages, c.q_in_registers
        ),
        launch.FORWARD_VARLEN.signature("bfloat16"),
    )
    for hd, dt in [(64, "float32"), (128, "float16")]:
        yield (
            config.PortableConfig.family,
            f"forward-{hd}-{dt}",
            forward_portable.build(hd, dt, 64, 32),
            launch.FORWARD.signature(dt),
        )
        yield (
            config.PortableConfig.family,
            f"forward-varlen-{hd}-{dt}",
            forward_portable.build_varlen(hd, dt, 64, 32),
            launch.FORWARD_VARLEN.signature(dt),
        )
        family = config.PortableBackwardConfig.family
        yield (
            family,
            f"preprocess-{hd}-{dt}",
            backward_portable.build_preprocess(hd, dt, 8),
            launch.PREPROCESS.signature(dt),
        )
        yield (
            family,
            f"dkdv-{hd}-{dt}",
            backward_portable.build_dkdv(hd, dt, 32, 32),
            launch.PORTABLE_DKDV.signature(dt),
        )
        yield (
            family,
            f"dq-{hd}-{dt}",
            backward_portable.build_dq(hd, dt, 32, 32),
            launch.DQ.signature(dt),
        )
        yield (
            family,
            f"dkdv-varlen-{hd}-{dt}",
            backward_portable.build_dkdv(hd, dt, 32, 32, varlen=True),
            launch.PORTABLE_DKDV_VARLEN.signature(dt),
        )
        yield (
            family,
            f"dq-varlen-{hd}-{dt}",
            backward_portable.build_dq(hd, dt, 32, 32, varlen=True),
            launch.DQ_VARLEN.signature(dt),
        )
    family = config.TensorCoreBackwardConfig.family
    for hd, dt, tiles, separate, split in [
        (64, "float16", (64, 8, 2), True, 1),
        (128, "bfloat16", (64, 8, 2), True, 1),
        (256, "bfloat16", (32, 8, 2), True, 2),
        (128, "float16", (64, 8, 2), False, 1),
        (128, "float16", (32, 4, 1), True, 1),
    ]:
        kernels = backward_mma.build_kernels(hd, dt, *tiles, separate, split)
        name = (
            f"{hd}-{dt}-{'x'.join(map(str, tiles))}-{'separate' if separate else 'atomic'}-{split}"
        )
        yield family, f"dkdv-{name}", kernels.dkdv, launch.TENSOR_CORE_DKDV.signature(dt)
        if separate:
            yield family, f"dq-{name}", kernels.dq, launch.DQ.signature(dt)
    family = config.PortableDecodeConfig.family
    for hd, dt, paged in [(128, "float16", False), (64, "bfloat16", True)]:
        name = f"{hd}-{dt}-{'paged' if paged else 'contiguous'}"
        yield (
            family,
            f"append-{name}",
            decode_portable.build_append(hd, dt, paged),
            launch.APPEND.signature(dt),
        )
        yield (
            family,
            f"split-{name}",
            decode_portable.build_split_attention(hd, dt, 64, 32, paged),
            launch.SPLIT_ATTENTION.signature(dt),
        )
        yield (
            family,
            f"combine-{name}",
            decode_portable.build_combine(hd, dt),
            launch.COMBINE.signature(dt),
        )
    family = config.TensorCoreDecodeConfig.family
    for hd, dt, tiles, paged in [
        (128, "float16", (16, 4, 3), False),
        (64, "bfloat16", (32, 2, 2), True),
    ]:
        name = f"{hd}-{dt}-{'x'.join(map(str, tiles))}-{'paged' if paged else 'contiguous'}"
        yield (
            family,
            f"decode-{name}",
            decode.build(hd, dt, *tiles, paged),
            launch.DECODE.signature(dt),
        )
    family = config.WgmmaBackwardConfig.family
    for hd, dt, warps, stages, pack, fused, bulk, ring, pingpong in [
        (128, "float16", 8, 2, False, False, False, False, False),
        (64, "bfloat16", 4, 1, False, False, False, False, False),
        (128, "float16", 8, 2, True, False, False, False, False),
        (128, "float16", 8, 2, False, True, False, False, False),  # dQ added up in dK/dV's kernel
        (128, "float16", 8, 2, False, True, True, False, False),  # ... by bulk reductions
        (128, "bfloat16", 8, 3, False, False, False, True, False),  # tiles through a ring
        (128, "bfloat16", 8, 3, False, False, False, True, True),  # ... taking turns
        (128, "bfloat16", 8, 3, False, True, True, True, True),  # ... dQ added up there too
    ]:
        kernels = backward_sm90.build_kernels(
            hd, dt, warps, stages, pack_first=pack, dq_separate=not fused, dq_bulk=bulk,
            ring=ring, pingpong=pingpong,
        )  # fmt: skip
        name = (
            f"{hd}-{dt}-{warps}-{stages}"
            + ("-pack" if pack else "")
            + ("-fused" if fused else "")
            + ("-bulk" if bulk else "")
            + ("-ring" if ring else "")
            + ("-pingpong" if pingpong else "")
        )
        yield family, f"dkdv-{name}", kernels.dkdv, launch.TENSOR_CORE_DKDV.signature(dt)
        if not fused:
            yield family, f"dq-{name}", kernels.dq, launch.DQ.signature(dt)
    # ... the ring's tiles by TMA (and with dQ added up in the dK/dV kernel); at head_dim 64
    # with 128-row tiles (the defaults)
    for hd, fused, block_m in ((128, False, 64), (128, True, 64), (64, False, 128)):
        kernels = backward_sm90.build_kernels(
            hd, "bfloat16", 8, 3, dq_separate=not fused, dq_bulk=True, ring=True, pingpong=True,
            tma=True, block_m=block_m,
        )  # fmt: skip
        for kernel, spec in (("dkdv", launch.TENSOR_CORE_DKDV), ("dq", launch.DQ))[: 2 - fused]:
            spec = spec._replace(variant=launch.tensor_map_arguments(kernel))
            name = f"{kernel}-{hd}-bfloat16-8-3" + ("-fused-bulk" if fused else "")
            name += "-ring-pingpong-tma" + ("-m128" if block_m == 128 else "")
            yield family, name, getattr(kernels, kernel), spec.signature("bfloat16")
    family = config.WgmmaForwardConfig.family
    pingpong = config.WgmmaForwardConfig(2, 128, 2, producer=True, pingpong=True)
    # the Hopper forward: defaults, packed, pingpong, and head_dim 128 with Gemma 2's softcap
    # and with Grok's (at most BOUNDED_SOFTCAP: the max fixed at the cap)
    for hd, dt, c, varlen, softcap in [
        (64, "float16", None, False, 0.0),
        (128, "bfloat16", None, False, 0.0),
        (256, "float16", None, False, 0.0),
        (128, "bfloat16", None, True, 0.0),
        (128, "float16", pingpong, False, 0.0),
        (128, "bfloat16", None, False, 50.0),
        (128, "bfloat16", None, False, 30.0),
    ]:
        c = c or wgmma_forward.default_wgmma_forward_config(hd)
        schedule = forward_sm90.schedule(c, varlen)
        tiles = "x".join(str(int(t)) for t in schedule[:6])  # less varlen, cache, fma_exp2
        cap = "" if not softcap else "-softcap" if softcap == 50.0 else f"-softcap{softcap:g}"
        name = f"{hd}-{dt}-{tiles}{'-varlen' if varlen else ''}{cap}"
        yield (
            family,
            f"forward-{name}",
            forward_sm90.build(hd, dt, *schedule, softcap=softcap),
            wgmma_forward.WGMMA_FORWARD.signature(dt),
        )
    # a packed batch's work order, made on the device before its launch (the largest sort)
    yield (
        family,
        "packed-work-order-4096",
        work_order.build(4096, 512),
        wgmma_forward.WORK_ORDER.signature("float16"),
    )
    # chunked prefill over a KV cache, contiguous and paged (as selection.prefill_config runs
    # it; "grouped": pages whose boxes copy every atom at once)
    for cache in ("contiguous", "paged", "grouped"):
        c = wgmma_forward.default_wgmma_forward_config(128)
        schedule = forward_sm90.schedule(c, cache=cache)
        yield (
            family,
            f"kvcache-{cache}-128-float16",
            forward_sm90.build(128, "float16", *schedule),
            wgmma_forward.WGMMA_KVCACHE.signature("float16"),
        )
        # ... appending a short chunk's new rows itself (wgmma_forward.appends_in_kernel)
        yield (
            family,
            f"kvcache-{cache}-append-128-float16",
            forward_sm90.build(128, "float16", *schedule, append=True),
            wgmma_forward.WGMMA_KVCACHE.signature("float16"),
        )


#: A PTX instruction on float64 values (an operand type .f64: cvt, setp, arithmetic).
_FLOAT64 = re.compile(r"^\s*(?:@!?%p\d+\s+)?[a-z][\w.]*\.f64\b", re.M)


def fingerprints(dump=None):
    """({family: {kernel name: fingerprint}} for TARGET, the kernels whose PTX computes in
    float64 as "family/name")."""
    out, float64 = {}, []
    for family, name, kernel, signature in cases():
        text = normalise(offline.compile_ptx(kernel, signature, TARGET))
        if dump:
            Path(dump, f"{family}-{name}.ptx").write_text(text)
        out.setdefault(family, {})[name] = hashlib.sha256(text.encode()).hexdigest()[:16]
        if _FLOAT64.search(text):
            float64.append(f"{family}/{name}")
        print(family, name, out[family][name], file=sys.stderr, flush=True)
    return out, float64


def toolchain():
    """What the PTX depends on besides numflash: the libnvvm that compiled it (its file's hash:
    NVVM's own version number is the same across CUDA 13 releases whose output differs)."""
    from numba.cuda.cudadrv import libs

    path = libs.get_cuda_paths()["nvvm"].info
    digest = hashlib.sha256(Path(path).read_bytes()).hexdigest()[:12]
    return f"libnvvm {Path(path).name} sha256:{digest}"


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--record", action="store_true", help=f"write {RECORD.name}")
    parser.add_argument("--dump", metavar="DIR", help="write each normalised PTX there")
    parser.add_argument("--compact", action="store_true", help="print the JSON on one line")
    args = parser.parse_args()
    if args.dump:
        os.makedirs(args.dump, exist_ok=True)
    prints, float64 = fingerprints(args.dump)
    result = {
        "toolchain": toolchain(),
        "families": {
            family: {"revision": config.CONFIG_TYPES[family].REVISION, "kernels": kernels}
            for family, kernels in prints.items()
        },
    }
    if args.record:
        RECORD.write_text(json.dumps(result, indent=1, sort_keys=True) + "\n")
    result["float64"] = float64  # (not recorded: tests/test_fingerprints.py wants none)
    print(
        json.dumps(result, sort_keys=True)
        if args.compact
        else json.dumps(result, indent=1, sort_keys=True)
    )


if __name__ == "__main__":
    main()
