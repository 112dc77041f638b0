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
import types

os.environ.pop("NUMBA_ENABLE_CUDASIM", None)

from numba import cuda, float32  # noqa: E402

from numflash import cache, launch  # noqa: E402
from numflash.config import TensorCoreBackwardConfig, config_from_dict  # noqa: E402
from numflash.families import wgmma_forward as wgmma_family  # noqa: E402
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
)
from numflash.selection import (  # noqa: E402
    default_config,
    default_portable_backward_config,
    default_portable_config,
    default_tensor_core_config,
    default_tensor_core_varlen_backward_config,
    prefill_config,
)
from numflash.validation import Mods  # noqa: E402

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
    "mbarrier.try_wait",
    "cp.async.mbarrier.arrive",
    "cp.async.bulk.tensor",
    "cp.async.bulk.tensor.5d",
    "tensormap.replace",
    "tensormap.cp_fenceproxy",
    "setmaxnreg",
    "cp.reduce.async.bulk",
    "red.global.add",
    "bar.arrive",
    "st.global.v4.u32",
]


def report(kernel, dtype, cc, resources, signature=None):
    ptx = offline.compile_ptx(kernel, signature or forward_signature(dtype), cc)
    entry = {"target": offline.arch_name(cc), "counts": {i: ptx.count(i) for i in INSTRUCTIONS}}
    if resources:
        entry["resources"] = _with_remarks(offline.resource_usage(ptx, cc))
    return entry


def reports(family, kernels, targets, resources, **fields):
    """A report for each kernel and target: ``kernels`` holds (name, kernel, spec) triples
    (spec: the launch.KernelSpec it takes), ptxas' report read for the targets among
    ``resources``, ``fields`` what each report says besides (head_dim, dtype, ...)."""
    dtype = fields["dtype"]
    return [
        {"family": family, "kernel": name, **fields,
         **report(kernel, dtype, cc, cc in resources, spec.signature(dtype))}
        for name, kernel, spec in kernels
        for cc in targets
    ]  # fmt: skip


def _with_remarks(usage):
    """ptxas' report with its log cut down to the numbered remarks (e.g. "(C7511) ...
    wgmma.mma_async instructions are serialized") and warnings."""
    usage["remarks"] = [
        line
        for line in usage.pop("log").splitlines()
        if re.search(r"\(C\d{4}\)", line) or "arning" in line
    ]
    return usage


def _shipped():
    """(file, head_dim, dtype, configuration dict) of every distinct tuned configuration in
    numflash/configs of the mma.sync forward, and of the Hopper forward and backward where it
    is neither the family's default nor the default of the entry's own seqlen bucket and mask
    (an entry that kept it): the families' own compile targets build those."""
    found = []
    for path in sorted(cache.SHIPPED_DIR.glob("sm_*.json")):
        for key, entry in cache.shipped_entries(path.stem).items():
            item = (path.name, key.head_dim, key.dtype, entry["config"])
            if key.family in ("wgmma-forward", "wgmma-backward"):
                defaults = [
                    default_config(key.family, key.head_dim, None, key=k)[1].to_dict()
                    for k in (None, key)
                ]
                if entry["config"] in defaults:
                    continue
            elif key.family != "tensor-core":
                continue
            if item not in found:
                found.append(item)
    return found


def shipped_one(file, head_dim, dtype, config):
    """One shipped configuration compiled for the targets of the architecture its file serves
    (sm_90.json: sm_90a), with ptxas' report; a Hopper forward's dense and packed kernels as
    wgmma_forward reports them (a call of either kind takes the entry), marked with its file."""
    if config["family"] == "wgmma-forward":
        return [
            {**e, "shipped": file}
            for varlen in (False, True)
            for e in wgmma_forward(head_dim, dtype, config, varlen)
        ]
    if config["family"] == "wgmma-backward":
        knobs = {k: v for k, v in config.items() if k not in ("family", "num_warps", "stages")}
        built = wgmma_backward(head_dim, dtype, config["num_warps"], config["stages"], **knobs)
        return [{**e, "shipped": file, "config": config} for e in built]
    major = int(file[3:-5]) // 10
    cfg = config_from_dict(config)
    kernel = forward.build(
        head_dim, dtype, cfg.block_m, cfg.block_n, cfg.num_warps, cfg.stages, cfg.q_in_registers
    )
    return [
        {
            "family": "shipped",
            "file": file,
            "head_dim": head_dim,
            "dtype": dtype,
            "config": config,
            **report(kernel, dtype, cc, resources=True),
        }
        for cc in TENSOR_CORE_TARGETS
        if cc[0] == major
    ]


def tensor_core_forward(hd, dtype, varlen=False):
    """The default tiles' dense kernel, or with ``varlen`` the packed-batch one."""
    cfg = default_tensor_core_config(hd)
    tiles = (cfg.block_m, cfg.block_n, cfg.num_warps, cfg.stages, cfg.q_in_registers)
    kernel = (forward.build_varlen if varlen else forward.build)(hd, dtype, *tiles)
    spec = launch.FORWARD_VARLEN if varlen else launch.FORWARD
    kernels = [("varlen" if varlen else "dense", kernel, spec)]
    return reports("tensor-core", kernels, TENSOR_CORE_TARGETS, (RESOURCE_TARGET,),
                   head_dim=hd, dtype=dtype, config=cfg.to_dict())  # fmt: skip


def tensor_core_forward_mods(hd, dtype, mods):
    """The default tiles' dense kernel with a user's functions (``mods``), ptxas' report for
    sm_90a; its own family name, as tensor_core_forward's entries are checked for every
    target."""
    cfg = default_tensor_core_config(hd)
    tiles = (cfg.block_m, cfg.block_n, cfg.num_warps, cfg.stages, cfg.q_in_registers)
    kernel = forward.build(hd, dtype, *tiles, mods=mods)
    spec = launch.FORWARD._replace(variant=_mod_arrays(mods))
    return reports("tensor-core-mods", [("dense", kernel, spec)], [RESOURCE_TARGET],
                   [RESOURCE_TARGET], head_dim=hd, dtype=dtype, config=cfg.to_dict(),
                   block_mask=mods.block_mask)  # fmt: skip


def portable_forward(hd, dtype):
    cfg = default_portable_config(hd)
    tiles = (cfg.block_m, cfg.block_n)
    kernels = [
        ("dense", forward_portable.build(hd, dtype, *tiles), launch.FORWARD),
        ("varlen", forward_portable.build_varlen(hd, dtype, *tiles), launch.FORWARD_VARLEN),
    ]
    return reports("portable", kernels, PORTABLE_TARGETS, (),
                   head_dim=hd, dtype=dtype, config=cfg.to_dict())  # fmt: skip


def portable_backward(hd, dtype):
    cfg = default_portable_backward_config(hd)
    tiles = (cfg.block_m, cfg.block_n)
    kernels = [
        ("preprocess", backward_portable.build_preprocess(hd, dtype, 8), launch.PREPROCESS),
        ("dkdv", backward_portable.build_dkdv(hd, dtype, *tiles), launch.PORTABLE_DKDV),
        ("dq", backward_portable.build_dq(hd, dtype, *tiles), launch.DQ),
        ("dkdv-varlen", backward_portable.build_dkdv(hd, dtype, *tiles, varlen=True),
         launch.PORTABLE_DKDV_VARLEN),
        ("dq-varlen", backward_portable.build_dq(hd, dtype, *tiles, varlen=True),
         launch.DQ_VARLEN),
    ]  # fmt: skip
    return reports("portable-backward", kernels, PORTABLE_TARGETS, (),
                   head_dim=hd, dtype=dtype, config=cfg.to_dict())  # fmt: skip


def mma_backward(hd, dtype, config):
    """The dense kernels with ``config`` (None: the default) and the varlen ones with the same
    one where given, else the varlen default."""
    if config:
        cfg = vcfg = config_from_dict(config)
    else:
        cfg = default_config("tensor-core-backward", hd, None)[1]
        vcfg = default_tensor_core_varlen_backward_config(hd)

    def built(c):
        return backward_mma.build_kernels(
            hd, dtype, c.block_m, c.num_warps, c.stages, c.dq_separate, c.head_split
        )

    dense = [("dkdv", built(cfg).dkdv, launch.TENSOR_CORE_DKDV)]
    varlen = [("dkdv-varlen", built(vcfg).dkdv_varlen, launch.TENSOR_CORE_DKDV_VARLEN)]
    if cfg.dq_separate:
        dense.append(("dq", built(cfg).dq, launch.DQ))
        varlen.append(("dq-varlen", built(vcfg).dq_varlen, launch.DQ_VARLEN))
    return [
        entry
        for c, kernels in ((cfg, dense), (vcfg, varlen))
        for entry in reports("tensor-core-backward", kernels, TENSOR_CORE_TARGETS,
                             (RESOURCE_TARGET,), head_dim=hd, dtype=dtype, config=c.to_dict())
    ]  # fmt: skip


def portable_decode(hd, dtype, paged):
    cfg = default_config("portable-decode", hd, None)[1]
    split = decode_portable.build_split_attention(hd, dtype, cfg.block_m, cfg.block_n, paged)
    kernels = [
        ("append", decode_portable.build_append(hd, dtype, paged), launch.APPEND),
        ("split", split, launch.SPLIT_ATTENTION),
        ("combine", decode_portable.build_combine(hd, dtype), launch.COMBINE),
    ]
    return reports("portable-decode", kernels, PORTABLE_TARGETS, (),
                   head_dim=hd, dtype=dtype, paged=paged, config=cfg.to_dict())  # fmt: skip


def tensor_core_decode(hd, dtype, paged):
    cfg = default_config("tensor-core-decode", hd, None)[1]
    kernel = decode.build(hd, dtype, cfg.block_n, cfg.num_warps, cfg.stages, paged)
    return reports("tensor-core-decode", [("decode", kernel, launch.DECODE)],
                   TENSOR_CORE_TARGETS, (RESOURCE_TARGET,),
                   head_dim=hd, dtype=dtype, paged=paged, config=cfg.to_dict())  # fmt: skip


def decode_mods(hd, dtype, paged):
    """The KV-cache kernels at ``hd`` with a user's functions (MODS): the tensor-core kernel
    (its default tiles) and the portable split kernel, ptxas' report for sm_90a."""
    arrays = _mod_arrays(MODS)
    cfg = default_config("tensor-core-decode", hd, None)[1]
    kernel = decode.build(hd, dtype, cfg.block_n, cfg.num_warps, cfg.stages, paged, mods=MODS)
    portable = default_config("portable-decode", hd, None)[1]
    split = decode_portable.build_split_attention(hd, dtype, portable.block_m, portable.block_n,
                                                  paged, mods=MODS)  # fmt: skip
    kernels = [("decode", kernel, launch.DECODE._replace(variant=arrays)),
               ("split", split, launch.SPLIT_ATTENTION._replace(variant=arrays))]  # fmt: skip
    return reports("decode-mods", kernels, [RESOURCE_TARGET], [RESOURCE_TARGET], head_dim=hd,
                   dtype=dtype, paged=paged)  # fmt: skip


def wgmma_tiles(dtype):
    """The tiles of tests/wgmma_gemm.py (sm_90a only), assembled by ptxas."""
    import wgmma_gemm

    out = [
        {
            "family": "wgmma",
            "dtype": dtype,
            "variant": variant,
            **report(
                wgmma_gemm.build(dtype, variant),
                dtype,
                (9, 0, "a"),
                resources=True,
                signature=wgmma_gemm.signature(),
            ),
        }
        for variant in wgmma_gemm.VARIANTS
    ]
    out.append(
        {
            "family": "wgmma",
            "dtype": dtype,
            "variant": "chain",
            **report(
                wgmma_gemm.build_chain(dtype),
                dtype,
                (9, 0, "a"),
                resources=True,
                signature=wgmma_gemm.chain_signature(),
            ),
        }
    )
    return out


def wgmma_backward(
    hd, dtype, warps, stages, softcap=0.0, pack_first=False, dq_separate=True, mods=None,
    dq_bulk=True, ring=False, pingpong=False, tma=False, block_m=64,
):  # fmt: skip
    """The Hopper backward's kernels (``block_m``-row streaming tiles); ``mods``: a user's functions (BACKWARD_MODS, or with a
    block mask: BLOCK_MASK_MODS), the dense kernels alone; ``dq_bulk`` as the configuration's
    (without dq_separate: dQ by bulk reductions, else by atomics); ``ring``: the tiles
    through an mbarrier ring; ``pingpong``: the warpgroups taking turns with their products;
    ``tma``: the ring filled by TMA, the dense kernels alone (the packed ones keep cp.async)."""
    built = backward_sm90.build_kernels(
        hd, dtype, warps, stages, softcap=softcap, pack_first=pack_first,
        dq_separate=dq_separate, mods=mods, dq_bulk=dq_bulk, ring=ring, pingpong=pingpong,
        tma=tma, block_m=block_m,
    )  # fmt: skip
    kernels = [("dkdv", built.dkdv, launch.TENSOR_CORE_DKDV)]
    if dq_separate:
        kernels.append(("dq", built.dq, launch.DQ))
    if tma:
        kernels = [
            (name, k, spec._replace(variant=launch.tensor_map_arguments(name)))
            for name, k, spec in kernels
        ]
    elif mods is None:
        kernels.append(("dkdv-varlen", built.dkdv_varlen, launch.TENSOR_CORE_DKDV_VARLEN))
        if dq_separate:
            kernels.append(("dq-varlen", built.dq_varlen, launch.DQ_VARLEN))
    else:
        kernels = [(name, k, spec._replace(variant=_mod_arrays(mods))) for name, k, spec in kernels]
    return reports("wgmma-backward", kernels, [(9, 0, "a")], [(9, 0, "a")], head_dim=hd,
                   dtype=dtype, num_warps=warps, softcap=softcap, pack_first=pack_first,
                   dq_separate=dq_separate, mods=mods is not None,
                   dq_bulk=dq_bulk and not dq_separate, ring=ring, pingpong=pingpong,
                   tma=tma, block_m=block_m)  # fmt: skip


def mma_backward_mods(hd, dtype, mods):
    """The mma.sync backward's default kernels at ``hd`` with a user's functions (``mods``),
    ptxas' report for sm_90a: its own family name, since they are not held to no spill."""
    cfg = default_config("tensor-core-backward", hd, None)[1]
    built = backward_mma.build_kernels(
        hd, dtype, cfg.block_m, cfg.num_warps, cfg.stages, cfg.dq_separate, cfg.head_split,
        mods=mods,
    )  # fmt: skip
    kernels = [
        (name, kernel, spec._replace(variant=_mod_arrays(mods)))
        for name, kernel, spec in (("dkdv", built.dkdv, launch.TENSOR_CORE_DKDV),
                                   ("dq", built.dq, launch.DQ))
    ]  # fmt: skip
    return reports("tensor-core-backward-mods", kernels, [RESOURCE_TARGET], [RESOURCE_TARGET],
                   head_dim=hd, dtype=dtype, block_mask=mods.block_mask)  # fmt: skip


def _mod_arrays(mods):
    """The ``*variant`` arrays of a kernel with ``mods`` (launch.variant_arrays' order)."""
    arrays = tuple((f"mod_args[{i}]", kind) for i, kind in enumerate(mods.kinds))
    return arrays + ((("block_mask.index", "int32"),) if mods.block_mask else ())


@cuda.jit(device=True)
def _relative_bias(score, b, h, q_idx, kv_idx, slopes, document):
    """A user's score_mod (tests/test_mods.py's), for the compile of a kernel with one."""
    return score + slopes[h] * float32(q_idx - kv_idx)


@cuda.jit(device=True)
def _same_document(b, h, q_idx, kv_idx, slopes, document):
    return document[q_idx] == document[kv_idx]


@cuda.jit(device=True)
def _relative_bias_derivative(score, b, h, q_idx, kv_idx, slopes, document):
    return float32(1.0)


#: A user's score_mod and mask_mod with their mod_args' element types.
MODS = Mods(_relative_bias, _same_document, None, ("float32", "int32"))
#: ... with score_mod's derivative, as the backward takes them; and with a block mask.
BACKWARD_MODS = Mods(_relative_bias, _same_document, _relative_bias_derivative, MODS.kinds)
BLOCK_MASK_MODS = Mods(_relative_bias, _same_document, _relative_bias_derivative, MODS.kinds, True)


def wgmma_forward(
    hd, dtype, config, varlen, cache=None, softcap=0.0, variants=False, mods=False,
    page_warps=None, append=False,
):  # fmt: skip
    """The Hopper forward with ``config`` (None: the default at ``hd``), dense, packed or over
    a KV cache (``cache``: "contiguous", "paged" or "grouped"), its scores capped by
    ``softcap`` where given, with sinks and ALiBi slopes where ``variants``, with a user's
    score_mod and mask_mod where ``mods`` (MODS), a paged cache's TMA copies by ``page_warps``
    producer warps (None: forward_sm90.PAGED_PRODUCER_WARPS, as selection runs it), the new
    rows appended by the kernel where ``append``. Its
    resources are read as Numba builds it for a launch (offline.lto_resource_usage): linking
    its PTX alone makes ptxas ignore setmaxnreg."""
    cfg = config_from_dict(config) if config else default_config("wgmma-forward", hd, None)[1]
    if cache:  # as selection runs it
        paged = cache in forward_sm90.PAGED_CACHES
        cfg = prefill_config(cfg, types.SimpleNamespace(paged=paged, page_size=16 if paged else 0))
    schedule = forward_sm90.schedule(cfg, varlen, cache=cache)
    if page_warps is not None:
        schedule = schedule[:-1] + (page_warps,)
    kernel = forward_sm90.build(
        hd, dtype, *schedule, softcap=softcap, sinks=variants, alibi=variants,
        mods=MODS if mods else None, append=append,
    )  # fmt: skip
    spec = wgmma_family.WGMMA_KVCACHE if cache else wgmma_family.WGMMA_FORWARD
    extra = (("sinks", "float32"), ("alibi_slopes", "float32")) if variants else ()
    if mods:
        extra += tuple((f"mod_args[{i}]", kind) for i, kind in enumerate(MODS.kinds))
    if extra:
        spec = spec._replace(variant=extra)
    signature = spec.signature(dtype)
    cc = (9, 0, "a")
    ptx = offline.compile_ptx(kernel, signature, cc, launch_bounds=True)
    usage = _with_remarks(offline.lto_resource_usage(kernel, signature, cc))
    return [
        {
            "family": "wgmma-forward",
            "kernel": (f"kvcache-{cache}" if cache else "varlen" if varlen else "dense")
            + ("-1warp" if page_warps == 1 else "")
            + ("-append" if append else ""),
            "head_dim": hd,
            "dtype": dtype,
            "softcap": softcap,
            "variants": variants,
            "mods": mods,
            "config": cfg.to_dict(),
            "target": offline.arch_name(cc),
            "counts": {i: ptx.count(i) for i in INSTRUCTIONS},
            "resources": usage,
        }
    ]


def jobs(quick):
    """(function, arguments) of every compile, in the report's order."""
    out = []
    for hd in [64, 128] if quick else [32, 64, 96, 128, 256]:
        out += [(tensor_core_forward, (hd, dtype)) for dtype in ("float16", "bfloat16")]
    out += [(tensor_core_forward, (128, dtype, True)) for dtype in ("float16", "bfloat16")]
    out += [(shipped_one, item) for item in _shipped()]
    for hd, dtype in [(64, "float32"), (128, "float16"), (256, "bfloat16")]:
        out += [(portable_forward, (hd, dtype)), (portable_backward, (hd, dtype))]
    out += [(portable_decode, (128, "float16", False)), (portable_decode, (64, "bfloat16", True))]
    for hd, dtype, paged in [
        (128, "float16", False),
        (128, "bfloat16", True),
        (256, "float16", True),
    ]:
        out.append((tensor_core_decode, (hd, dtype, paged)))
    # the defaults (dQ from its own kernel), and dQ by atomics from the dK/dV kernel
    atomic = TensorCoreBackwardConfig(64, 8, 2, dq_separate=False).to_dict()
    for hd, dtype, config in [
        (64, "float16", None),
        (128, "bfloat16", None),
        (256, "bfloat16", None),
        (128, "float16", atomic),
    ]:
        out.append((mma_backward, (hd, dtype, config)))
    out += [(wgmma_tiles, (dtype,)) for dtype in ("float16", "bfloat16")]
    # the Hopper backward: two warpgroups at head_dim 128 (the default), one and one stage at 64
    out += [(wgmma_backward, (128, "float16", 8, 2)), (wgmma_backward, (64, "bfloat16", 4, 1))]
    # ... with Gemma 2's softcap (head_dim 128: at 64 the forward's 192-key tiles spill 16 bytes)
    out.append((wgmma_backward, (128, "bfloat16", 8, 2, 50.0)))
    out.append((wgmma_backward, (128, "float16", 8, 2, 0.0, True)))  # A rounded before the fence
    # dQ added up by the dK/dV kernel (dq_separate=False), both head dims: by bulk reductions
    # (the default), at 64 by atomics too
    out.append((wgmma_backward, (128, "bfloat16", 8, 2, 0.0, False, False)))
    out.append((wgmma_backward, (64, "float16", 8, 2, 0.0, False, False)))
    out.append((wgmma_backward, (64, "bfloat16", 8, 2, 0.0, False, False, None, False)))
    # the tiles through an mbarrier ring (three stages; 255 registers at head_dim 128), the
    # warpgroups taking turns with their products (the plain ring: tests/ptx_fingerprints.json)
    out.append((wgmma_backward, (128, "bfloat16", 8, 3, 0.0, False, True, None, True, True, True)))
    # ... adding dQ up in the dK/dV kernel (255 registers at head_dim 128 with cp.async, 246
    # with TMA), filled by TMA
    out.append(
        (wgmma_backward, (128, "float16", 8, 3, 0.0, False, False, None, True, True, True, True))
    )
    # ... the ring filled by TMA
    out.append(
        (wgmma_backward, (128, "bfloat16", 8, 3, 0.0, False, True, None, True, True, True, True))
    )
    # 128-row streaming tiles at head_dim 64: the ring with pingpong turns by cp.async (and the
    # packed kernels) and filled by TMA
    out.append((wgmma_backward, (64, "float16", 8, 3) + (0.0, False, True, None, True) + (True,
                True, False, 128)))  # fmt: skip
    out.append((wgmma_backward, (64, "bfloat16", 8, 3) + (0.0, False, True, None, True) + (True,
                True, True, 128)))  # fmt: skip
    # a user's functions, with a block mask too; the mma.sync backward's with them
    out.append((wgmma_backward, (128, "float16", 8, 2, 0.0, False, True, BACKWARD_MODS)))
    out.append((wgmma_backward, (128, "bfloat16", 8, 2, 0.0, False, False, BLOCK_MASK_MODS)))
    out.append((mma_backward_mods, (128, "float16", BLOCK_MASK_MODS)))
    out.append((tensor_core_forward_mods, (128, "bfloat16", BLOCK_MASK_MODS)))
    out.append((decode_mods, (128, "float16", True)))
    # the Hopper forward: the defaults, packed, one consumer without a producer, TMA loads
    # with pingpong and without
    one = {"family": "wgmma-forward", "consumers": 1, "block_n": 128, "stages": 3}
    one.update(producer=False, pingpong=False, tma=False)
    tma = {"family": "wgmma-forward", "consumers": 2, "block_n": 128, "stages": 2}
    tma.update(producer=True, pingpong=True, tma=True)
    tma_plain = dict(tma, stages=3, pingpong=False)
    # head_dim 64's defaults at seqlen buckets to SHORT_BUCKET, causal and non-causal
    short = dict(tma, stages=4, pingpong=False)
    short_full = dict(short, stages=2)
    for hd, dtype, config, varlen in [
        (128, "float16", None, False),
        (64, "bfloat16", None, False),
        (256, "float16", None, False),
        (128, "bfloat16", None, True),
        (64, "float16", one, False),
        (128, "float16", tma, False),
        (64, "bfloat16", tma_plain, False),
        (64, "float16", short, False),
        (64, "bfloat16", short_full, False),
    ]:
        out.append((wgmma_forward, (hd, dtype, config, varlen)))
    # ... over a KV cache (chunked prefill): the defaults (TMA), contiguous and paged (a page's
    # boxes of one atom, and of every atom: grouped), and a paged cache by cp.async (page sizes
    # TMA boxes cannot take)
    copies = dict(tma_plain, block_n=128, stages=2, tma=False)
    for hd, dtype, config, layout in [
        (128, "float16", None, "contiguous"),
        (128, "bfloat16", None, "paged"),
        (128, "bfloat16", None, "grouped"),
        (64, "float16", None, "paged"),
        (64, "float16", copies, "paged"),
    ]:
        out.append((wgmma_forward, (hd, dtype, config, False, layout)))
    # ... a paged cache's K and V copied by one producer warp (PAGED_PRODUCER_WARPS = 1)
    out.append((wgmma_forward, (128, "float16", None, False, "grouped", 0.0, False, False, 1)))
    # ... the new rows appended by the producer's other warps (short chunks), contiguous and
    # grouped pages copied by one producer warp and by two
    for layout, warps in (("contiguous", None), ("grouped", None), ("grouped", 1)):
        args = (128, "bfloat16", None, False, layout, 0.0, False, False, warps, True)
        out.append((wgmma_forward, args))
    out.append((wgmma_forward, (128, "bfloat16", None, False, None, 50.0)))
    # ... a softcap of at most BOUNDED_SOFTCAP: the max fixed at the cap
    out.append((wgmma_forward, (128, "bfloat16", None, False, None, 30.0)))
    # ... half its probabilities by the FMA units' exp2
    fma_exp2 = dict(default_config("wgmma-forward", 128, None)[1].to_dict(), fma_exp2=2)
    out.append((wgmma_forward, (128, "bfloat16", fma_exp2, False, None, 50.0)))
    out.append((wgmma_forward, (128, "float16", None, False, None, 0.0, True)))  # sinks, ALiBi
    out.append((wgmma_forward, (128, "float16", None, False, None, 0.0, False, True)))  # mods
    return out


def _run(job):
    function, args = job
    return function(*args)


def main(selected):
    """Every job in worker processes (one per core), the report as one JSON line."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    workers = min(len(selected), os.cpu_count() or 1)
    with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("fork")) as pool:
        results = [entry for entries in pool.map(_run, selected) for entry in entries]
    print(json.dumps(results))


if __name__ == "__main__":
    if "--shipped" in sys.argv:  # the shipped configurations alone, with ptxas' reports
        main([(shipped_one, item) for item in _shipped()])
    else:
        main(jobs("--quick" in sys.argv))
