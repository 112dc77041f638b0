"""The Python a call without a replay plan runs before the driver, on any machine.

    python tools/full_path_cost.py [--runs 7] [--calls 5000] [--json PATH]

The full path of ``numflash.attention`` in three parts, on stand-ins (tests/support/standins.py)
for CuPy's arrays, its allocator, device and stream, with the GPU taken to be an H200 (compute
capability 9.0, 132 multiprocessors): validation (``numflash.validation.problem``), the
configuration lookup (``numflash.selection.forward``) and the Hopper forward's launch
(``numflash.launch.forward`` with the default configuration: input checks, tensor-map templates,
argument views, packing). The driver is a stand-in that returns at once and no kernel is compiled,
so neither cuLaunchKernel (about 4.5 us on the H200 machine) nor CuPy's allocations are timed; a
stand-in's construction (each output the launch allocates) is, and its shape and strides are Python
attributes where CuPy's are C fields: the figures compare trees on one machine, not a GPU host's
cost. Per part: the best of ``--runs`` runs of ``--calls`` calls.
``PYTHONPATH=/path/to/other/checkout python tools/full_path_cost.py`` times another tree.
"""

import dataclasses
import os
import sys
import types

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
os.environ["NUMBA_ENABLE_CUDASIM"] = "0"  # launches typed as on a GPU (replay_cost keeps it)

import numpy as np  # noqa: E402
import replay_cost  # noqa: E402
from support.standins import DeviceArray  # noqa: E402

import numflash  # noqa: E402
from numflash import api, arrays, device, launch, selection, validation  # noqa: E402
from numflash.families import wgmma_forward  # noqa: E402
from numflash.kernels import ptx_tma  # noqa: E402

#: The GPU the stand-ins stand for.
H200 = dataclasses.replace(
    device.SIMULATED_DEVICE,
    name="NVIDIA H200 (stand-in)",
    compute_capability=(9, 0),
    multiprocessors=132,
    simulated=False,
)


class _Array(DeviceArray):
    """A stand-in with the attributes the full path reads beyond a replay's."""

    @property
    def ndim(self):
        return len(self.shape)

    @property
    def device(self):
        return types.SimpleNamespace(id=self.data.device_id)

    def __getitem__(self, index):
        if isinstance(index, slice):  # buffer[start:], as the backward cuts its map buffer
            assert len(self.shape) == 1 and index.stop is None and index.step is None
            start = index.start or 0
            ptr = self.data.ptr + start * self.strides[0]
            return _Array((self.shape[0] - start,), self.dtype, ptr, self.strides)
        assert index is None  # x[None], as the launches view packed arrays
        return _Array((1,) + self.shape, self.dtype, self.data.ptr, (0,) + self.strides)


def _empty(shape, dtype=np.float32):
    return _Array(shape, dtype)


class _Driver:
    class CUresult:
        CUDA_SUCCESS = 0

    def __init__(self, launched):
        self.launched = launched

    def cuLaunchKernel(self, *args):
        self.launched(*args)
        return (0,)


def stand_in(set_attr=setattr, launched=lambda *args: None):
    """numflash's CuPy, driver and device on stand-ins: ``set_attr`` sets each attribute
    replaced (``setattr``: for the rest of the process; a test's monkeypatch.setattr: for the
    test), ``launched`` gets each launch's arguments (function, grid, block, shared bytes,
    stream, address of the parameters' addresses, extra), eager or prepared."""
    stream = types.SimpleNamespace(ptr=0x5EED)
    runtime = types.SimpleNamespace(getDevice=lambda: 0, getDeviceCount=lambda: 1)
    cupy = types.SimpleNamespace(
        ndarray=_Array, empty=_empty, zeros=_empty, ascontiguousarray=lambda x: x,
        empty_like=lambda x: _Array(x.shape, x.dtype),
        asarray=lambda x: _Array(x.shape, x.dtype),
        int32=np.int32, int64=np.int64,
        float32=np.float32, cuda=types.SimpleNamespace(
            runtime=runtime, get_current_stream=lambda: stream),
    )  # fmt: skip
    set_attr(arrays, "_cupy", lambda: cupy)
    set_attr(arrays, "array_module", lambda x: cupy)
    for module in (arrays, launch, api):
        set_attr(module, "SIMULATOR", False)
    attributes = {"MultiProcessorCount": H200.multiprocessors, "L2CacheSize": 60 << 20}
    set_attr(launch, "_device_attribute", attributes.__getitem__)
    set_attr(launch, "_driver", lambda: _Driver(launched))
    set_attr(launch, "_launch_kernel", lambda: launched)
    set_attr(launch, "_prepared", {})
    for cache in ("_orders", "_alternating_arrays"):  # device arrays the stand-ins made
        set_attr(wgmma_forward, cache, {})
    set_attr(
        ptx_tma, "template", lambda dtype, dims, strides, box, address: (0,) * ptx_tma.MAP_WORDS
    )
    set_attr(launch.Launcher, "_static_shared", lambda self: 0)
    set_attr(launch.Launcher, "_function", lambda self: 0xF00)
    set_attr(launch.Launcher, "_allow_shared", lambda self, nbytes: None)
    set_attr(device, "current_device", lambda: H200)
    set_attr(api, "current_device", lambda: H200)
    set_attr(api._Cupy, "device_count", runtime.getDeviceCount)
    set_attr(api._Cupy, "get_device", runtime.getDevice)


def parts(head_dim=64):
    """{name: call} of the full path's parts for one small problem (1 x 128 x 1 x head_dim,
    fp16), as benchmarks/host_overhead.py times the whole on the GPU, and the whole of the
    forward and of the backward (out standing in for dout)."""
    q, k, v, out = (_Array((1, 128, 1, head_dim)) for _ in range(4))
    lse = _Array((1, 1, 128), np.float32)
    p = validation.problem(q, k, v, False, None, (-1, -1))[-1]
    config = selection.forward(p, H200).config
    return {
        "validation": lambda: validation.problem(q, k, v, False, None, (-1, -1)),
        "selection": lambda: selection.forward(p, H200),
        f"launch[{type(config).__name__}]": lambda: launch.forward(config, p, q, k, v, out, lse),
        "attention (the whole)": lambda: api._attention(
            q, k, v, False, None, (-1, -1), False, None, None
        ),
        "attention_backward (the whole)": lambda: api._attention_backward(
            out, q, k, v, out, lse, False, None, (-1, -1), False, None
        ),
    }


def main():
    args = replay_cost.arguments(__doc__, 7, 5000)
    stand_in()
    results = {"numflash": os.path.dirname(numflash.__file__)}
    for name, fn in parts().items():
        results[f"{name}_us"] = round(replay_cost.best_us(fn, args.runs, args.calls), 3)
    replay_cost.report(results, args.json)


if __name__ == "__main__":
    main()
