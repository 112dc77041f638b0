"""Whether a host-time row moved because of the patterns before it or because the host did
(GPU): benchmarks/host_overhead.py's call patterns, each followed by the repeated
``attention`` on CuPy arrays and on PyTorch tensors over the same memory, timed as
host_overhead times a call (bursts of 20 with the GPU drained between them).

    python tools/host_drift.py [--bursts 100] [--json PATH]

Prints a row a pattern: the pattern's own us a call, then the two calls' just after it, and
the two calls alone before any pattern ran. Where the CuPy call moves with the tensor call,
the host's speed moved, not anything a pattern left behind (docs/performance.md, "PyTorch
tensors").
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks"))

import host_overhead  # noqa: E402
from peers import random_qkv  # noqa: E402

import numflash  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--bursts", type=int, default=100)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    import torch  # (after the options: --help needs no PyTorch)

    q, k, v = random_qkv(2, 128, 4, 64, "float16")
    tq, tk, tv = (torch.from_dlpack(x) for x in (q, k, v))
    calls = {
        "cupy": lambda: numflash.attention(q, k, v),
        "torch": lambda: numflash.attention(tq, tk, tv),
    }
    timed = host_overhead.per_call_us
    host_overhead.warm_up()
    found = {"device": torch.cuda.get_device_name()}
    found["alone"] = {name: round(timed(fn, args.bursts), 2) for name, fn in calls.items()}
    rows = []

    def followed(fn, bursts=500, calls_=20):
        us = timed(fn, bursts, calls_)
        rows.append([round(us, 2)] + [round(timed(c, args.bursts), 2) for c in calls.values()])
        return us

    host_overhead.per_call_us = followed  # the patterns call it through the module
    try:
        patterns = host_overhead.call_patterns()
    finally:
        host_overhead.per_call_us = timed
    found["after each pattern (its us, cupy, torch)"] = {
        name: row for name, row in zip(patterns, rows)
    }
    host_overhead.report(found, args.json)


if __name__ == "__main__":
    main()
