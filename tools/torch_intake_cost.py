"""What taking PyTorch tensors costs a call's host, numflash's intake against DLPack's (GPU).

    python tools/torch_intake_cost.py [--runs 3] [--calls 3000] [--json PATH]

``numflash.attention`` on three CUDA tensors (2 x 128 x 4 x 64, fp16), repeated (its replay
plan), in turns in one process: as numflash takes them (views remembered from the call
before, ``numflash.arrays._borrowed_torch_view``), with a new view of each every call
(``numflash.arrays._torch_view``) and with every tensor taken by ``cupy.from_dlpack``; the
same call on the CuPy arrays under the tensors; and the parts: one tensor through
``cupy.from_dlpack``, through ``_torch_view``, its remembered view found again, PyTorch's
``__dlpack__`` alone, ``torch.cuda.current_stream`` and the raw stream query the views make;
and the three tensors taken as a repeated call takes them (``arrays.adopted``, the streams
compared once) beside one ``arrays.intake`` a tensor, as the calls took them before.
Each way is also timed on tensors seen once (new tensor objects every call, as a training
step's q, k and v are): what remembering a view costs where it is never found again. Host
time a call, the best of ``--runs`` runs of ``--calls`` calls (1000 on tensors seen once),
each run the median over bursts of 20 calls with the GPU drained between them, as
benchmarks/host_overhead.py times a call (docs/performance.md, "PyTorch tensors").
"""

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks"))

import cupy  # noqa: E402
from host_overhead import per_call_us, report  # noqa: E402
from peers import random_qkv  # noqa: E402

import numflash  # noqa: E402
from numflash import arrays  # noqa: E402


def best_us(fn, runs, calls, burst=20):
    """The best of ``runs`` runs' host time a call (us), after a warm-up: each run
    benchmarks/host_overhead.py's :func:`per_call_us`, the median over bursts of ``burst``
    calls with the GPU drained between them, ``calls`` calls in all. Timed back to back
    without the drains, the CuPy call read 12.2 us against host_overhead's 7.8 on one H100
    host: likely the launch queue filling with these kernels, the host then waiting on the
    GPU."""
    for _ in range(calls // 10):
        fn()
    bursts = max(1, calls // burst)
    return min(per_call_us(fn, bursts=bursts, calls=burst) for _ in range(runs))


def once_us(tq, tk, tv, runs, calls=1000, burst=20):
    """:func:`best_us` of ``attention`` where every call takes new tensor objects (views of
    ``tq``, ``tk``, ``tv``, made before the clock starts), as a loop over fresh activations
    does."""
    stream = cupy.cuda.get_current_stream()
    best = float("inf")
    for _ in range(runs):
        means = []
        for _ in range(calls // burst):
            fresh = [tuple(t.view(t.shape) for t in (tq, tk, tv)) for _ in range(burst)]
            stream.synchronize()
            start = time.perf_counter()
            for q, k, v in fresh:
                numflash.attention(q, k, v)
            means.append((time.perf_counter() - start) / burst * 1e6)
            del fresh
        best = min(best, statistics.median(means))
    stream.synchronize()
    return best


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--calls", type=int, default=3000)
    parser.add_argument("--json", default=None, help="also write the results here")
    args = parser.parse_args()
    import torch  # (after the options: --help needs no PyTorch)

    q, k, v = random_qkv(2, 128, 4, 64, "float16")
    tq, tk, tv = (torch.from_dlpack(x) for x in (q, k, v))
    view, borrowed = arrays._torch_view, arrays._borrowed_torch_view
    found = {"device": torch.cuda.get_device_name()}

    def call():
        return numflash.attention(tq, tk, tv)

    def no_view(x, torch, cupy, owned=True):
        return None  # DLPack takes the tensor

    intakes = {  # (_torch_view, _borrowed_torch_view) of each way
        "borrowed views": (view, borrowed),
        "a new view each call": (view, view),
        "cupy.from_dlpack": (no_view, no_view),
    }
    for _ in range(2):  # in turns, each keeping its best
        for label, (arrays._torch_view, arrays._borrowed_torch_view) in intakes.items():
            arrays._BORROWED.clear()
            key = f"attention on tensors, {label}_us"
            found[key] = min(found.get(key, float("inf")), best_us(call, args.runs, args.calls))
            # tensors a call sees once (a training step's q, k, v): new tensor objects over
            # the same memory, made before the clock starts
            key = f"attention on tensors seen once, {label}_us"
            found[key] = min(found.get(key, float("inf")), once_us(tq, tk, tv, args.runs))
    arrays._torch_view, arrays._borrowed_torch_view = view, borrowed
    parts = {
        "attention on the CuPy arrays": lambda: numflash.attention(q, k, v),
        "one tensor, cupy.from_dlpack": lambda: cupy.from_dlpack(tq),
        "one tensor, numflash's view": lambda: view(tq, torch, cupy),
        "one tensor, its borrowed view again": lambda: borrowed(tq, torch, cupy),
        "tensor.__dlpack__(stream=1)": lambda: tq.__dlpack__(stream=1),
        "torch.cuda.current_stream": lambda: torch.cuda.current_stream(0).cuda_stream,
        "the raw stream query": lambda: arrays._torch_stream(torch, 0),
    }
    sig = numflash.api._ATTENTION
    taken = (tq, tk, tv, False, None, (-1, -1), False, None, None, 0.0, None, None)

    def one_by_one():  # api._adopted before arrays.adopted: arrays.intake a tensor
        adopted = list(taken)
        for i in sig.array_positions:
            x = taken[i]
            if x is None or isinstance(x, int) or isinstance(x, arrays.cupy_ndarray()):
                continue
            adopted[i] = arrays.intake(x, sig.parameters[i][0], i != sig.out_position)
        return tuple(adopted)

    parts["three tensors, one intake each (the route before)"] = one_by_one
    parts["three tensors, arrays.adopted"] = lambda: arrays.adopted(
        taken, sig.array_positions, sig.parameters, sig.out_position
    )
    for label, fn in parts.items():
        found[f"{label}_us"] = best_us(fn, args.runs, args.calls)
    report({key: round(value, 2) if isinstance(value, float) else value
            for key, value in found.items()}, args.json)  # fmt: skip


if __name__ == "__main__":
    main()
