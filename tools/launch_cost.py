"""What a kernel launch costs the host on this machine, by parameter volume and stream kind.

    python tools/launch_cost.py [--json PATH]

Empty Numba kernels taking 0-20 one-dimensional arrays (seven 8-byte parameter slots each in
Numba's ABI) and 0-120 int64 scalars, launched through numflash's prepared launches (CuPy's
binding of cuLaunchKernel, as a replayed call launches), on the legacy default stream, a
blocking and a non-blocking stream, and the per-thread default stream. Per configuration: the
host time of a launch in bursts of 100 (``_burst``), back to back over 10,000 (``_b2b``), and
the GPU time per launch of 2,000 back to back (``_gpu``). Then what CuPy charges for an output
array, what reading a CuPy array's shape, strides, dtype and address costs, and a CPU-speed
yardstick (a dict lookup) to compare machines and runs by.
"""

import argparse
import os
import sys
import time
import timeit

import cupy
from numba import cuda
from numba.cuda import types

from numflash import arrays, launch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks"))
import host_overhead  # noqa: E402

#: (arrays, int64 scalars) of each empty kernel: the decode kernel takes 120 slots.
KERNELS = [(0, 0), (0, 1), (1, 0), (5, 0), (13, 0), (0, 42), (0, 120), (13, 29), (20, 0)]


def back_to_back_us(fn, calls=10000):
    fn()
    cupy.cuda.Device().synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    host = (time.perf_counter() - start) / calls * 1e6
    cupy.cuda.Device().synchronize()
    return round(host, 3)


def burst_us(fn):
    """Host time of one call in bursts of 100 (host_overhead.per_call_us), rounded."""
    return round(host_overhead.per_call_us(fn, bursts=100, calls=100), 3)


def empty_kernel(n_arrays, n_scalars):
    """A launcher of an empty kernel of ``n_arrays`` uint16 arrays and ``n_scalars`` int64s."""
    names = [f"a{i}" for i in range(n_arrays)] + [f"s{i}" for i in range(n_scalars)]
    namespace = {}
    exec(f"def k({', '.join(names)}):\n    pass\n", namespace)
    argtypes = (types.Array(types.uint16, 1, "C"),) * n_arrays + (types.int64,) * n_scalars
    return launch.Launcher(cuda.jit(namespace["k"]), argtypes)


def array_fields_ns(x):
    """ns to read (and compare) what a plan's matcher reads of a CuPy array (timeit, best of 5):
    the public shape and strides tuples against the lists CuPy keeps them in."""
    shape, strides = x.shape, x.strides
    names = dict(x=x, S=shape, T=strides, Sl=list(shape), Tl=list(strides), dt=x.dtype)
    expressions = [
        "x.shape",
        "x._shape",
        "x.strides",
        "x._strides",
        "x.data.ptr",
        "x.data.device_id",
        "x.dtype is dt",
        "x.shape != S or x.strides != T",
        "x._shape != Sl or x._strides != Tl",
    ]
    best = {}
    for expression in expressions:
        times = timeit.repeat(expression, globals=names, number=200000, repeat=5)
        best[expression] = round(min(times) / 200000 * 1e9, 1)
    return best


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    results = {}
    view = arrays.kernel_view(cupy.zeros(1024, cupy.uint16))[0]
    streams = {
        "null": cupy.cuda.Stream.null,
        "nonblocking": cupy.cuda.Stream(non_blocking=True),
        "blocking": cupy.cuda.Stream(),
        "ptds": cupy.cuda.Stream.ptds,
    }
    for n_arrays, n_scalars in KERNELS:
        launcher = empty_kernel(n_arrays, n_scalars)
        prepared = launcher.prepare(
            (1, 1, 1), (32, 1, 1), 0, (view,) * n_arrays + (0,) * n_scalars, {}
        )
        row = {"slots": 7 * n_arrays + n_scalars}
        for name, stream in streams.items():
            with stream:

                def fn(stream=stream):
                    prepared.launch(stream.ptr, ())

                row[name + "_burst"] = burst_us(fn)
                row[name + "_b2b"] = back_to_back_us(fn)
                row[name + "_gpu"] = round(host_overhead.gpu_per_call_us(fn), 3)
        results[f"arrays{n_arrays}_scalars{n_scalars}"] = row
        print(f"arrays{n_arrays}_scalars{n_scalars}", row, flush=True)
    pool = cupy.get_default_memory_pool()
    shape = (4, 1, 8, 64)
    memory = pool.malloc(4 * 8 * 64 * 2)
    results["alloc"] = {
        "cupy_empty": burst_us(lambda: cupy.empty(shape, cupy.float16)),
        "cupy_ndarray": burst_us(lambda: cupy.ndarray(shape, cupy.float16)),
        "pool_malloc": burst_us(lambda: pool.malloc(4096)),
        "ndarray_on_memptr": burst_us(lambda: cupy.ndarray(shape, cupy.float16, memory)),
        "getDevice": burst_us(cupy.cuda.runtime.getDevice),
        "get_current_stream": burst_us(cupy.cuda.get_current_stream),
        "streamIsCapturing": burst_us(lambda: cupy.cuda.runtime.streamIsCapturing(0)),
    }
    results["array_fields_ns"] = array_fields_ns(cupy.ndarray(shape, cupy.float16, memory))
    table = {(1, 2, 3): 1}
    lookups = timeit.repeat(lambda: table.get((1, 2, 3)), number=200000, repeat=5)
    results["cpu_calibration"] = {
        "dict_tuple_lookup_ns": round(min(lookups) / 200000 * 1e9, 1),
        "python": sys.version.split()[0],
    }
    host_overhead.report(results, args.json)


if __name__ == "__main__":
    main()
