"""Count the SASS instructions of fingerprinted kernels, compiled here for sm_90a: no GPU needed.

The kernels are tools/ptx_fingerprint.py's cases, named as there (``python
tools/ptx_fingerprint.py`` lists them). Each one's PTX, compiled under the kernel's launch
bounds as for a launch (without them ptxas ignores setmaxnreg), is assembled by the CUDA toolkit's
``ptxas`` and disassembled by ``nvdisasm`` (the toolkit's, or the ``nvidia-cuda-nvdisasm``
wheel's: ``--nvdisasm PATH``); the census prints ptxas' register and spill report, the count of
every opcode, its numbered remarks (C7519: a warpgroup.arrive it added before a wgmma
whose registers were touched), and the code ptxas adds around warp-wide steps in lanes that may have gone apart
(``WARPSYNC.COLLECTIVE``). The PTX's ``.version`` is lowered to what this ptxas reads where the
NVVM that wrote it is newer. A static count: which paths run how often needs Nsight Compute.

    python tools/sass_census.py kvcache-contiguous-128-float16 kvcache-paged-128-float16
"""

import argparse
import collections
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

os.environ.pop("NUMBA_ENABLE_CUDASIM", None)
sys.path.insert(0, str(Path(__file__).resolve().parent))

import ptx_fingerprint  # noqa: E402

from numflash.kernels import offline  # noqa: E402

_INSTRUCTION = re.compile(r"^\s*/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_]+)")


def _tool(name, given):
    found = given or shutil.which(name)
    if not found:
        raise SystemExit(f"sass_census: no {name} found (give its path with --{name})")
    return found


def _assemble(ptxas, ptx, source, cubin):
    """ptxas' run on ``ptx`` (written to ``source``); once more with the ``.version`` ptxas
    names as its newest where it refuses a newer one."""
    for _ in range(2):
        source.write_text(ptx)
        done = subprocess.run(
            [ptxas, "-arch=sm_90a", "-v", str(source), "-o", str(cubin)],
            capture_output=True,
            text=True,
        )
        newest = re.search(r"Unsupported \.version \S+; current version is '([\d.]+)'", done.stderr)
        if not newest:
            return done
        ptx = re.sub(r"^\.version \S+", f".version {newest.group(1)}", ptx, flags=re.M)
    return done


def census(name, kernel, signature, ptxas, nvdisasm, workdir):
    ptx = offline.compile_ptx(kernel, signature, ptx_fingerprint.TARGET, launch_bounds=True)
    cubin = workdir / f"{name}.cubin"
    done = _assemble(ptxas, ptx, workdir / f"{name}.ptx", cubin)
    if done.returncode:
        raise SystemExit(f"sass_census: ptxas failed on {name}:\n{done.stderr}")
    report = [line.split(":", 1)[-1].strip() for line in done.stderr.splitlines()]
    remarks = collections.Counter(re.findall(r"\((C\d+)\)", done.stderr))
    sass = subprocess.run([nvdisasm, "-c", str(cubin)], capture_output=True, text=True).stdout
    ops = collections.Counter()
    for line in sass.splitlines():
        m = _INSTRUCTION.match(line)
        if m:
            ops[m.group(1)] += 1
    return {
        "ptxas": [line for line in report if re.match(r"Used |\d+ bytes stack frame", line)]
        + [f"remark {code} x{n}" for code, n in sorted(remarks.items())],
        "instructions": sum(ops.values()),
        "collective": sass.count("WARPSYNC.COLLECTIVE"),
        "opcodes": dict(ops.most_common()),
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("kernels", nargs="+", help="names from tools/ptx_fingerprint.py's cases")
    ap.add_argument("--ptxas", help="the ptxas to assemble with (default: on PATH)")
    ap.add_argument("--nvdisasm", help="the nvdisasm to disassemble with (default: on PATH)")
    ap.add_argument("--top", type=int, default=16, help="opcodes printed per kernel")
    args = ap.parse_args()
    ptxas, nvdisasm = _tool("ptxas", args.ptxas), _tool("nvdisasm", args.nvdisasm)
    wanted = set(args.kernels)
    with tempfile.TemporaryDirectory() as tmp:
        for _, name, kernel, signature in ptx_fingerprint.cases():
            if name not in wanted:
                continue
            wanted.discard(name)
            found = census(name, kernel, signature, ptxas, nvdisasm, Path(tmp))
            print(f"{name}: {found['instructions']} instructions, "
                  f"{found['collective']} WARPSYNC.COLLECTIVE; {'; '.join(found['ptxas'])}")  # fmt: skip
            top = list(found["opcodes"].items())[: args.top]
            print("  " + ", ".join(f"{op} {n}" for op, n in top))
    if wanted:
        raise SystemExit(f"sass_census: no such kernel among the cases: {sorted(wanted)}")


if __name__ == "__main__":
    main()
