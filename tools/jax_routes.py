"""What each pure-Python route into a jitted JAX program costs a call on its own.

numflash.jax runs numflash inside ``jax.jit`` through ``jax.experimental.buffer_callback``.
The other route without C++ is ``jax.ffi.ffi_call`` with a handler written in ctypes (as
NVIDIA Warp does). This script times both with nothing to do: a jitted step of ``--calls``
calls, each handing a small array on to the next (aliased in and out, so none is elided),
against the same step of as many additions; the difference a call is the route's fixed cost,
and the gap between the routes the most a switch could save a numflash call. The FFI handler
reads what a real one needs (the stream on a GPU, every buffer's address and shape) and
answers XLA's metadata query with the API version it was written against.

    python tools/jax_routes.py [--calls 32]

On the CPU backend the handler is registered for the host platform (no stream). The struct
layouts follow XLA's FFI C API (xla/ffi/api/c_api.h, API 0.x): a call frame's extension list
and stage, its argument and result lists, a buffer's data type, address, rank and dimensions.
"""

import argparse
import ctypes
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks"))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from bench_jax import wall_ms  # noqa: E402
from jax.experimental.buffer_callback import buffer_callback  # noqa: E402

_METADATA, _EXECUTE = 1, 3  # XLA_FFI_Extension_Metadata, XLA_FFI_ExecutionStage_EXECUTE


class _Extension(ctypes.Structure):
    pass


_Extension._fields_ = [
    ("struct_size", ctypes.c_size_t),
    ("type", ctypes.c_int),
    ("next", ctypes.POINTER(_Extension)),
]


#: Every struct of the API begins with its size and a list of extensions.
_HEAD = [("struct_size", ctypes.c_size_t), ("extension_start", ctypes.POINTER(_Extension))]


class _Version(ctypes.Structure):
    _fields_ = [
        *_HEAD,
        ("major", ctypes.c_int),
        ("minor", ctypes.c_int),
    ]


class _Metadata(ctypes.Structure):
    _fields_ = [
        ("struct_size", ctypes.c_size_t),
        ("api_version", _Version),
        ("traits", ctypes.c_uint32),
    ]


class _MetadataExtension(ctypes.Structure):
    _fields_ = [("base", _Extension), ("metadata", ctypes.POINTER(_Metadata))]


class _List(ctypes.Structure):
    """XLA_FFI_Args and XLA_FFI_Rets: a count, the kinds, the pointers."""

    _fields_ = [
        *_HEAD,
        ("size", ctypes.c_int64),
        ("types", ctypes.POINTER(ctypes.c_int)),
        ("items", ctypes.POINTER(ctypes.c_void_p)),
    ]


class _Attrs(ctypes.Structure):
    _fields_ = [
        *_HEAD,
        ("size", ctypes.c_int64),
        ("types", ctypes.c_void_p),
        ("names", ctypes.c_void_p),
        ("attrs", ctypes.c_void_p),
    ]


class _Buffer(ctypes.Structure):
    _fields_ = [
        *_HEAD,
        ("dtype", ctypes.c_int),
        ("data", ctypes.c_void_p),
        ("rank", ctypes.c_int64),
        ("dims", ctypes.POINTER(ctypes.c_int64)),
    ]


class _StreamArgs(ctypes.Structure):
    _fields_ = [
        *_HEAD,
        ("ctx", ctypes.c_void_p),
        ("stream", ctypes.c_void_p),
    ]


_StreamGet = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.POINTER(_StreamArgs))


class _Api(ctypes.Structure):
    """The head of XLA_FFI_Api, up to the stream getter (the fifth function)."""

    _fields_ = [
        *_HEAD,
        ("api_version", _Version),
        ("internal_api", ctypes.c_void_p),
        ("error_create", ctypes.c_void_p),
        ("error_get_message", ctypes.c_void_p),
        ("error_destroy", ctypes.c_void_p),
        ("handler_register", ctypes.c_void_p),
        ("stream_get", _StreamGet),
    ]


class _CallFrame(ctypes.Structure):
    _fields_ = [
        *_HEAD,
        ("api", ctypes.POINTER(_Api)),
        ("ctx", ctypes.c_void_p),
        ("stage", ctypes.c_int),
        ("args", _List),
        ("rets", _List),
        ("attrs", _Attrs),
        ("future", ctypes.c_void_p),
    ]


_Handler = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.POINTER(_CallFrame))


def _buffers(items, n):
    """(address, shape) of each of ``n`` buffers."""
    out = []
    for i in range(n):
        b = ctypes.cast(items[i], ctypes.POINTER(_Buffer)).contents
        out.append((b.data, tuple(b.dims[j] for j in range(b.rank))))
    return out


def ffi_noop(gpu, calls_seen):
    """A registered FFI target whose handler reads its call and does nothing else."""

    def handler(frame_pointer):
        frame = frame_pointer.contents
        if frame.extension_start:
            ext = frame.extension_start.contents
            if ext.type == _METADATA:  # XLA asks which API the handler speaks
                meta = ctypes.cast(frame.extension_start, ctypes.POINTER(_MetadataExtension))
                version = meta.contents.metadata.contents.api_version
                version.major, version.minor = 0, 1
                meta.contents.metadata.contents.traits = 0
                return None
        if frame.stage != _EXECUTE:
            return None
        if gpu:
            args = _StreamArgs(ctypes.sizeof(_StreamArgs), None, frame.ctx, None)
            frame.api.contents.stream_get(ctypes.byref(args))
        _buffers(frame.args.items, frame.args.size)
        _buffers(frame.rets.items, frame.rets.size)
        calls_seen[0] += 1
        return None

    callback = _Handler(handler)
    address = ctypes.cast(callback, ctypes.c_void_p).value
    name = f"numflash_noop_{id(callback)}"
    platform = "CUDA" if gpu else "cpu"
    jax.ffi.register_ffi_target(name, jax.ffi.pycapsule(address), platform=platform)
    return name, callback  # the caller keeps the ctypes function alive


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=32, help="calls a jitted step")
    args = ap.parse_args()
    gpu = jax.default_backend() == "gpu"
    x = jnp.zeros((16,), jnp.float32)
    shape = jax.ShapeDtypeStruct(x.shape, x.dtype)
    seen = {"buffer_callback": [0], "ffi": [0]}

    def nothing(ctx, out, x):
        seen["buffer_callback"][0] += 1

    name, keep = ffi_noop(gpu, seen["ffi"])
    links = {
        "addition": lambda y: y + 1,
        "buffer_callback": buffer_callback(nothing, shape, input_output_aliases={0: 0}),
        "ffi": jax.ffi.ffi_call(name, shape, input_output_aliases={0: 0}),
    }

    def chained(link):
        def step(y):
            for _ in range(args.calls):
                y = link(y)
            return y

        return jax.jit(step)

    steps = {route: chained(link) for route, link in links.items()}
    ms = {
        route: wall_ms(lambda s=step: s(x), jax.block_until_ready, bursts=15, warmup=3)
        for route, step in steps.items()
    }
    print(f"JAX {jax.__version__}, {jax.devices()[0].device_kind}, {args.calls} calls a step")
    print(f"  a step of additions: {ms['addition']:.3f} ms")
    for route in ("buffer_callback", "ffi"):
        us = (ms[route] - ms["addition"]) / args.calls * 1e3
        print(f"  {route}: {ms[route]:.3f} ms a step, {us:.1f} us a call beyond an addition "
              f"({seen[route][0]} calls ran)")  # fmt: skip
    del keep


if __name__ == "__main__":
    main()
