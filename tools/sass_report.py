"""Instruction counts of a tensor-core kernel's SASS, whole and in its main loop; no GPU needed.

Compiles the kernel to PTX (Numba), links it to a cubin for the target with nvJitLink, and
disassembles it with nvdisasm (``pip install nvidia-cuda-nvdisasm``, or a CUDA toolkit). The
main loop is the loop body with the most HMMA: the query-block loop of the backward, the
key-tile loop of the forward. Where the loop branches between versions of its softmax step
(as the backward's masked and unmasked copies once did), the length of the path through each.

    python tools/sass_report.py --backward --config 64,8,2 --head-dim 128 [--dq-kernel]
    python tools/sass_report.py --backward --config 64,8,2,0   # dK/dV with atomic dQ
    python tools/sass_report.py --wgmma --config 8,2   # the Hopper backward (num_warps,stages)
    python tools/sass_report.py --decode --config 16,8,2,1   # KV cache (block_n,warps,stages,paged)
    python tools/sass_report.py --config 128,32,4,2,0 --head-dim 128 --nvdisasm PATH
    python tools/sass_report.py --config 128,64,4,2,1 --dump new.sass   # diff two trees

``--dump`` writes the instructions with their addresses and Numba's mangled names taken out,
so that the SASS of one kernel built from two versions of the source can be compared with diff;
``--dump-loop`` the main loop's alone.
"""

import argparse
import collections
import glob
import os
import re
import shutil
import subprocess
import sys
import tempfile

_INSTRUCTION = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)")
_LABEL = re.compile(r"^\s*\.(L_x_\d+):")
_TARGET = re.compile(r"`\(\.?(L_x_\d+)\)")


def find_nvdisasm(given):
    if given:
        return given
    found = shutil.which("nvdisasm")
    if found:
        return found
    import nvidia  # the nvidia-cuda-nvdisasm wheel installs under the nvidia namespace

    for root in nvidia.__path__:
        hits = glob.glob(os.path.join(root, "**", "bin", "nvdisasm"), recursive=True)
        if hits:
            return hits[0]
    sys.exit("nvdisasm not found: pip install nvidia-cuda-nvdisasm, or pass --nvdisasm")


def sass(kernel, signature, arch, nvdisasm):
    from cuda.core import Linker, LinkerOptions, ObjectCode

    from numflash.kernels import offline

    cc = (int(arch[3]), int(arch[4])) + (("a",) if arch.endswith("a") else ())
    ptx = offline.compile_ptx(kernel, signature, cc)
    cubin = Linker(ObjectCode.from_ptx(ptx.encode()), options=LinkerOptions(arch=arch)).link(
        "cubin"
    )
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin.code)
        f.flush()
        return subprocess.run(
            [nvdisasm, "-c", f.name], capture_output=True, text=True, check=True
        ).stdout


def parse(text):
    """[(address, opcode, line)] and {label: address}."""
    lines = text.splitlines()
    ops, labels, pending = [], {}, []
    for line in lines:
        label = _LABEL.match(line)
        if label:
            pending.append(label.group(1))
            continue
        m = _INSTRUCTION.search(line)
        if m:
            address = int(m.group(1), 16)
            for name in pending:
                labels[name] = address
            pending = []
            ops.append((address, m.group(2), line))
    return ops, labels


def normalised(line):
    """An instruction line without its address and with Numba's mangled symbols renamed."""
    line = re.sub(r"/\*[0-9a-f]+\*/", "", line)
    return re.sub(r"_ZN\w+", "<symbol>", line).strip()


_MMA = ("HMMA", "HGMMA")  # mma.sync and wgmma


def main_loop(ops, labels):
    """The loop with the most HMMA or HGMMA (then the longest): from a backward branch's
    target to the branch."""
    best, best_key = [], (-1, -1)
    for address, opcode, line in ops:
        target = _TARGET.search(line) if opcode == "BRA" else None
        if target and labels.get(target.group(1), address) < address:
            start = labels[target.group(1)]
            body = [op for op in ops if start <= op[0] <= address]
            key = (sum(op[1] in _MMA for op in body), len(body))
            if key > best_key:
                best, best_key = body, key
    return best


def exp2_blocks(loop, labels):
    """The straight-line blocks of the loop that hold ex2 (MUFU): more than one means the
    loop branches between versions of the softmax step (e.g. masked, unmasked)."""
    starts = set(labels.values())
    blocks, current = [], []
    for address, opcode, line in loop:
        if address in starts and current:
            blocks.append(current)
            current = []
        current.append(opcode)
        if opcode in ("BRA", "EXIT"):
            blocks.append(current)
            current = []
    blocks.append(current)
    return [len(b) for b in blocks if "MUFU" in b]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backward", action="store_true", help="the mma.sync backward")
    ap.add_argument("--wgmma", action="store_true", help="the Hopper (wgmma) backward")
    ap.add_argument("--decode", action="store_true", help="the tensor-core KV-cache kernel")
    ap.add_argument(
        "--dq-kernel",
        action="store_true",
        help="with --backward: the dQ kernel instead of the dK/dV kernel",
    )
    ap.add_argument(
        "--config",
        required=True,
        help="backward: block_m,num_warps,stages[,dq_separate[,head_split]] "
        "(TensorCoreBackwardConfig's fields; dq_separate 0 or 1, default 1); "
        "wgmma: num_warps,stages; decode: block_n,num_warps,stages,paged (0 or 1); "
        "forward: block_m,block_n,num_warps,stages,q_in_registers",
    )
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument(
        "--heavy-group",
        type=int,
        default=None,
        help="with --backward: build_kernels' heavy_group (default: the library's)",
    )
    ap.add_argument("--dtype", default="float16", choices=["float16", "bfloat16"])
    ap.add_argument("--arch", default="sm_90a")
    ap.add_argument("--nvdisasm", default=None)
    ap.add_argument("--dump", metavar="PATH", help="write the normalised instructions there")
    ap.add_argument("--dump-loop", metavar="PATH", help="the same for the main loop alone")
    args = ap.parse_args()
    values = [int(x) for x in args.config.split(",")]
    from numflash import launch

    if args.backward or args.wgmma:
        dq = args.dq_kernel
        spec = launch.DQ if dq else launch.TENSOR_CORE_DKDV
        signature = spec.signature(args.dtype)
        if args.wgmma:
            from numflash.kernels import backward_sm90

            num_warps, stages = values[:2]
            kernels = backward_sm90.build_kernels(args.head_dim, args.dtype, num_warps, stages)
        else:
            from numflash.kernels import backward_mma

            block_m, num_warps, stages, separate, split = (values + [1, 1][len(values) - 3 :])[:5]
            if dq and not separate:
                ap.error("--dq-kernel: the configuration has dq_separate=0 (no dQ kernel)")
            kernels = backward_mma.build_kernels(
                args.head_dim,
                args.dtype,
                block_m,
                num_warps,
                stages,
                bool(separate),
                split,
                heavy_group=args.heavy_group,
            )
        kernel = kernels.dq if dq else kernels.dkdv
    elif args.decode:
        from numflash.kernels import decode

        bn, nw, st, paged = values
        kernel = decode.build(args.head_dim, args.dtype, bn, nw, st, bool(paged))
        signature = launch.DECODE.signature(args.dtype)
    else:
        from numflash.kernels import forward

        bm, bn, nw, st, qr = values
        kernel = forward.build(args.head_dim, args.dtype, bm, bn, nw, st, bool(qr))
        signature = launch.FORWARD.signature(args.dtype)
    ops, labels = parse(sass(kernel, signature, args.arch, find_nvdisasm(args.nvdisasm)))
    if args.dump:
        with open(args.dump, "w") as f:
            f.writelines(normalised(line) + "\n" for _, _, line in ops)
    loop = main_loop(ops, labels)
    if args.dump_loop:
        with open(args.dump_loop, "w") as f:
            f.writelines(normalised(line) + "\n" for _, _, line in loop)
    for name, part in (("kernel", ops), ("main loop", loop)):
        counts = collections.Counter(op for _, op, _ in part)
        top = ", ".join(f"{op} {n}" for op, n in counts.most_common(10))
        print(
            f"{name}: {len(part)} instructions; HMMA {counts['HMMA']}, HGMMA "
            f"{counts['HGMMA']}, LDSM {counts['LDSM']}, BRA {counts['BRA']}, ATOMG "
            f"{counts['ATOMG']}; most common: {top}"
        )
    versions = exp2_blocks(loop, labels)
    if len(versions) > 1:  # one path through the loop takes one version, skipping the rest
        paths = ", ".join(str(len(loop) - sum(versions) + n) for n in versions)
        print(f"main loop paths: {paths} instructions (ex2 blocks of {versions} instructions)")


if __name__ == "__main__":
    main()
