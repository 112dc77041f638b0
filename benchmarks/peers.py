"""The implementations numflash is measured against, each as a callable on numflash's layout.

Every provider takes q, k, v as CuPy arrays of layout (batch, seqlen, nheads, head_dim) and
returns a function that runs one forward pass. PyTorch's SDPA is fed the same memory through
DLPack, transposed to its (batch, heads, seqlen, head_dim) layout without a copy.
"""

import itertools
import math

import cupy

import numflash
from numflash.arrays import from_float


def random_qkv(batch, seqlen, nheads, head_dim, dtype, seed=0):
    """Fresh standard-normal q, k, v of layout (batch, seqlen, nheads, head_dim) in ``dtype``."""
    rng = cupy.random.default_rng(seed)
    shape = (batch, seqlen, nheads, head_dim)
    return [from_float(rng.standard_normal(shape, dtype=cupy.float32), dtype) for _ in range(3)]


def versions():
    """{package: version} of what a benchmark ran with."""
    import platform
    from importlib.metadata import version

    found = {"numflash": numflash.__version__, "python": platform.python_version()}
    for name in ("numba", "numba-cuda", "cupy-cuda13x", "torch", "numpy"):
        try:
            found[name] = version(name)
        except Exception:  # not installed
            pass
    return found


def parser(doc, dtypes=("float16", "bfloat16"), head_dims=None, **dtype_options):
    """A benchmark's argument parser, its description ``doc``'s first line, with the options
    every benchmark takes: --dtypes (default ``dtypes``; ``dtype_options``: more of
    add_argument's keywords, choices say) and --out-dir (default benchmarks/results); and
    --head-dims where ``head_dims`` gives their default."""
    import argparse
    import os

    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--dtypes", nargs="+", default=list(dtypes), **dtype_options)
    results = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
    ap.add_argument("--out-dir", default=results, help="where results go (made if absent)")
    if head_dims is not None:
        ap.add_argument("--head-dims", type=int, nargs="+", default=list(head_dims))
    return ap


def save_results(out_dir, name, device, records, table, **extra):
    """Write ``name``.json (device, date, versions, the command, ``extra``, the records) and
    ``name``.md (``table`` under a comment naming the run) into ``out_dir``; print the table."""
    import datetime
    import json
    import os
    import sys

    result = {
        "device": device.name,
        "compute_capability": list(device.compute_capability),
        "date": datetime.date.today().isoformat(),
        "versions": versions(),
        "command": "python " + " ".join(sys.argv),
        **extra,
        "records": records,
    }
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, f"{name}.json"), "w") as f:
        json.dump(result, f, indent=1)
    with open(os.path.join(out_dir, f"{name}.md"), "w") as f:
        f.write(f"<!-- {result['date']}, {device.name}, {result['versions']} -->\n\n" + table)
    print("\n" + table, flush=True)
    return result


#: The fields of a record that name its attention problem (:func:`problem`).
PROBLEM_FIELDS = ("batch", "nheads", "seqlen_q", "seqlen_k", "head_dim", "causal")


def problem(batch, nheads, seqlen_q, seqlen_k, head_dim, causal):
    """A record's fields naming an attention problem (PROBLEM_FIELDS)."""
    return dict(zip(PROBLEM_FIELDS, (batch, nheads, seqlen_q, seqlen_k, head_dim, causal)))


def record(timing, flops, provider, mode, dtype, **fields):
    """A benchmark's record of one timing: who ran what (``fields``: the problem and any
    more), its median in ms and its TFLOP/s for ``flops`` (both None without a timing)."""
    rec = dict(provider=provider, mode=mode, dtype=dtype, **fields)
    rec["ms"] = None if timing is None else timing.median_ms
    rec["tflops"] = None if timing is None else timing.tflops(flops)
    return rec


def numflash_forward(q, k, v, causal, config=None):
    """Allocates its output in every call, as SDPA and the naive version do, so that time and
    peak memory compare like with like."""

    def run():
        return numflash.attention(q, k, v, causal=causal, config=config)

    return run


def naive_forward(q, k, v, causal):
    """Attention as a CuPy user writes it: scores in fp32 through matmul, softmax, matmul."""
    scale = 1.0 / math.sqrt(q.shape[-1])
    qh, kh, vh = (x.transpose(0, 2, 1, 3) for x in (q, k, v))

    def run():
        s = cupy.matmul(qh, kh.transpose(0, 1, 3, 2)).astype(cupy.float32) * scale
        if causal:
            sq, sk = s.shape[-2:]
            keep = cupy.tri(sq, sk, sk - sq, dtype=bool)
            s = cupy.where(keep, s, -cupy.inf)
        s -= s.max(axis=-1, keepdims=True)
        p = cupy.exp(s)
        p /= p.sum(axis=-1, keepdims=True)
        return cupy.matmul(p.astype(q.dtype), vh)

    return run


def torch_available():
    try:
        import torch

        return torch.cuda.is_available()
    except ImportError:
        return False


def sdpa_forward(q, k, v, causal, backend):
    """torch SDPA with one backend forced: "flash" (FlashAttention-2) or "cudnn"."""
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    which = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}[backend]
    qt, kt, vt = (torch.from_dlpack(x).transpose(1, 2) for x in (q, k, v))
    gqa = q.shape[2] != k.shape[2]

    def run():
        with sdpa_kernel(which):
            return torch.nn.functional.scaled_dot_product_attention(
                qt, kt, vt, is_causal=causal, enable_gqa=gqa
            )

    return run


def add_problem_arguments(ap):
    """The options the variants scripts share: which problems, at the benchmarks' shape."""
    ap.add_argument("--head-dims", type=int, nargs="+", default=[128])
    ap.add_argument("--seqlens", type=int, nargs="+", default=[4096])
    ap.add_argument("--dtypes", nargs="+", default=["float16"])
    ap.add_argument("--causal", choices=["no", "yes", "both"], default="both")
    ap.add_argument("--tokens", type=int, default=32768, help="batch * seqlen")
    ap.add_argument("--model-dim", type=int, default=2048, help="nheads * head_dim")
    ap.add_argument("--out", default=None)


def problems(args):
    """(head_dim, dtype name, dtype, causal, seqlen, batch, nheads) for every problem ``args``
    asks for, batch x seqlen = --tokens and nheads x head_dim = --model-dim; first prints the
    device."""
    from numflash.arrays import BFLOAT16
    from numflash.device import current_device

    dev = current_device()
    print(f"device: {dev.name} ({dev.arch}), numflash {numflash.__version__}", flush=True)
    causals = {"no": [False], "yes": [True], "both": [False, True]}[args.causal]
    for hd, dt, causal, seqlen in itertools.product(
        args.head_dims, args.dtypes, causals, args.seqlens
    ):
        dtype = cupy.float16 if dt == "float16" else BFLOAT16
        yield hd, dt, dtype, causal, seqlen, max(1, args.tokens // seqlen), args.model_dim // hd
