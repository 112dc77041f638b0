"""The Python a repeated call runs between its arguments and the driver, on any machine.

    python tools/replay_cost.py [--runs 15] [--calls 20000] [--json PATH]

numflash.api on stand-ins (tests/support/standins.py): CuPy's arrays, device and stream are
replaced, the first call of each signature records one launch over every array of the call
(as the real full paths do), and a replay patches its pointers into a list and calls a no-op
builtin where the driver would launch. What is timed is therefore a repeated call's own Python:
its matcher, the overlap check, its outputs, the pointer patches, without cuLaunchKernel and
without CuPy (a stand-in's shape and strides are Python properties, slower to read than
CuPy's). The calls: a tiny forward, the same on another library's arrays (taken as the
stand-ins they hold, at no cost: what is timed is numflash's own route to them), its
backward and a paged decoding step. Per call: the best of ``--runs`` runs of ``--calls``
back-to-back calls (best, not median: on a shared machine the other runs are the slower
ones).

To compare with another tree, run this file with that tree's numflash first on the path:
``PYTHONPATH=/path/to/other/checkout python tools/replay_cost.py``.
"""

import argparse
import os
import sys
import timeit

os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "1")  # no GPU needed; replays never run a kernel
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))
sys.path.insert(0, os.path.join(HERE, "..", "benchmarks"))

import numpy as np  # noqa: E402
from host_overhead import report  # noqa: E402  (imports CuPy, which needs no GPU to load)
from support.standins import DeviceArray, Foreign, foreign_intake  # noqa: E402

import numflash  # noqa: E402
from numflash import api, launch, plans  # noqa: E402
from numflash.arrays import KernelArray  # noqa: E402

STREAM = 0x5EED  # a created stream's (a replay on the legacy default stream, 0, skips more)


class _Prepared:
    """A prepared launch over a list of slots, its launch a no-op builtin (``abs``) given the
    stream: as numflash.launch.PreparedLaunch writes it out (:meth:`lines`), and as a function
    (``launch``) for trees whose plans call one."""

    def __init__(self, roles):
        self.slots = [0] * (max(roles, default=0) + 1)
        self.roles = roles  # argument position -> role
        source = "def launch(stream, p):\n"
        source += "".join(f"    s[{pos}] = p[{role}]\n" for pos, role in roles.items())
        namespace = self.namespace("s")
        exec(source + "    cuLaunchKernel(stream)\n", namespace)
        self.launch = namespace["launch"]

    def lines(self, slots, pointer, stream, pad):
        lines = [f"{pad}{slots}[{pos}] = {pointer(role)}" for pos, role in self.roles.items()]
        return lines + [f"{pad}cuLaunchKernel({stream})"]

    def namespace(self, slots):
        return {slots: self.slots, "cuLaunchKernel": abs}


class _Launcher:
    def prepare(self, grid, block, shared_bytes, args, roles):
        return _Prepared(dict(roles))


#: Calls that took a stand-in full path: one per signature when every repeat replays.
full_paths = []


def _record(*arrays):
    """The one launch a stand-in full path records: every array of the call, then a scalar."""
    full_paths.append(len(arrays))
    args = tuple(KernelArray(x.data.ptr, x.size, x.dtype.itemsize, x) for x in arrays)
    launch._recording.record.launches.append((_Launcher(), (1, 1, 1), (32, 1, 1), 0, (*args, 1)))


def _lse(q):
    return DeviceArray((q.shape[0], q.shape[2], q.shape[1]), np.float32)


def _forward(q, k, v, causal, scale, window, return_lse, out, config, softcap=0.0, sinks=None,
             alibi_slopes=None, mods=None):  # fmt: skip
    """The forward's stand-in full path (the tool's calls take no variant arrays)."""
    out = DeviceArray(q.shape, q.dtype) if out is None else out
    lse = _lse(q)
    _record(q, k, v, out, lse)
    return (out, lse) if return_lse else out


def _kvcache(q, k_cache, v_cache, k, v, seqlens, batch_idx, block_table, *rest):
    return_lse, out = rest[4], rest[5]
    out = DeviceArray(q.shape, q.dtype) if out is None else out
    lse = _lse(q)
    present = (q, k_cache, v_cache, k, v, seqlens, batch_idx, block_table, out, lse)
    _record(*(x for x in present if x is not None and not isinstance(x, int)))
    return (out, lse) if return_lse else out


def _backward(dout, q, k, v, out, lse, *flags):
    grads = tuple(DeviceArray(x.shape, x.dtype) for x in (q, k, v))
    _record(dout, q, k, v, out, lse, *grads)
    return grads


class _Stream:
    ptr = STREAM


def stand_in():
    """numflash.api on stand-ins: one device, one stream, the full paths above; the
    stand-ins are its CuPy arrays, and a :class:`Foreign` the array it holds."""
    api.SIMULATOR = False
    api.arrays.intake = foreign_intake
    api._plans = plans.PlanCache()
    cupy = api._Cupy
    cupy.empty = cupy.ndarray = DeviceArray
    cupy.get_device = int  # 0
    cupy.device_count = lambda: 1
    cupy.current_stream = _Stream
    cupy.stream_is_capturing = lambda stream: False
    api._attention, api._attention_with_kvcache = _forward, _kvcache
    api._attention_backward = _backward


def calls():
    """{name: call}: a tiny forward (also on :class:`Foreign` arrays), its backward, and a
    paged decoding step with an append (seven arrays), as benchmarks/host_overhead.py times
    them on the GPU."""
    q, k, v, dout, out = (DeviceArray((1, 128, 1, 64)) for _ in range(5))
    lse = _lse(q)
    qd = DeviceArray((4, 1, 8, 64))
    k_cache, v_cache = DeviceArray((64, 16, 2, 64)), DeviceArray((64, 16, 2, 64))
    k_new, v_new = DeviceArray((4, 1, 2, 64)), DeviceArray((4, 1, 2, 64))
    table, lengths = DeviceArray((4, 16), np.int32), DeviceArray((4,), np.int32)
    fq, fk, fv = (Foreign(DeviceArray((1, 96, 1, 64))) for _ in range(3))  # a plan of its own
    return {
        "attention": lambda: numflash.attention(q, k, v),
        "attention on another library's arrays": lambda: numflash.attention(fq, fk, fv),
        "attention_backward": lambda: numflash.attention_backward(dout, q, k, v, out, lse),
        "attention_with_kvcache": lambda: numflash.attention_with_kvcache(
            qd, k_cache, v_cache, k_new, v_new, cache_seqlens=lengths, block_table=table
        ),
    }


def best_us(fn, runs, calls):
    fn()  # records the plan
    fn()
    return min(timeit.repeat(fn, number=calls, repeat=runs)) / calls * 1e6


def arguments(doc, runs, calls):
    """The parsed --runs, --calls (defaults ``runs``, ``calls``) and --json of a timing tool
    that ``doc`` describes."""
    parser = argparse.ArgumentParser(description=doc.split("\n")[0])
    parser.add_argument("--runs", type=int, default=runs)
    parser.add_argument("--calls", type=int, default=calls)
    parser.add_argument("--json", default=None, help="also write the results here")
    return parser.parse_args()


def main():
    args = arguments(__doc__, 15, 20000)
    stand_in()
    results = {"numflash": os.path.dirname(numflash.__file__)}
    for name, fn in calls().items():
        results[f"{name}_us"] = round(best_us(fn, args.runs, args.calls), 3)
    if len(full_paths) != len(results) - 1:
        raise SystemExit(f"a repeated call did not replay: {len(full_paths)} full paths")
    report(results, args.json)


if __name__ == "__main__":
    main()
