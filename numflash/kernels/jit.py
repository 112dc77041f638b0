"""How numflash's kernels are compiled: one place that knows the simulator from the GPU.

Numba's CUDA simulator (``NUMBA_ENABLE_CUDASIM=1``) accepts only a subset of ``cuda.jit``'s
options, so kernel modules decorate through :func:`device_function` and :func:`kernel`, which
pass the GPU-only options (``forceinline``, ``lineinfo``, ``launch_bounds``) where they exist.
"""

import ctypes
import os
import struct

import numpy as np

from numba import cuda

#: True when kernels run in Numba's CUDA simulator (each thread a Python thread).
SIMULATOR = bool(cuda.config.ENABLE_CUDASIM)

#: Keep source line information in the compiled code, for compute-sanitizer reports
#: (``NUMFLASH_LINEINFO=1``). It does not change the generated instructions.
LINEINFO = os.environ.get("NUMFLASH_LINEINFO", "0") not in ("", "0")


def device_function(fn):
    """A device function, inlined into its caller (NVVM ``alwaysinline``).

    Inlining is forced because callers hand over ``cuda.local.array`` fragments indexed by
    unrolled constants: only inside one function can they stay in registers instead of local
    memory. In the simulator it is the simulator's device function, which points the names
    bound to ``numba.cuda`` in its module at the running kernel's simulated module while it
    runs (a kernel may call device functions of other modules).
    """
    if SIMULATOR:
        return cuda.jit(device=True)(fn)
    return cuda.jit(device=True, forceinline=True)(fn)


def kernel(fn=None, *, launch_bounds=None):
    """A ``cuda.jit`` kernel, compiled lazily on first launch."""

    def wrap(f):
        if SIMULATOR:
            return cuda.jit(f)
        opts = {"lineinfo": LINEINFO}
        if launch_bounds is not None:
            opts["launch_bounds"] = launch_bounds
        return cuda.jit(**opts)(f)

    return wrap if fn is None else wrap(fn)


def forward_signature(dtype_name):
    """Argument types of both forward kernels (None in the simulator, which types nothing).

    q, k, v, out as flat arrays (uint16 bits for fp16/bf16), lse (float32), the (batch, seqlen,
    head) element strides of q, k, v and out (int64), seqlen_q, seqlen_k, heads_per_kv (int32),
    softmax_scale * log2(e) (float32), window_left, window_right (int32).
    """
    if SIMULATOR:
        return None
    from numba.cuda import types

    elem = types.Array(types.float32 if dtype_name == "float32" else types.uint16, 1, "C")
    lse = types.Array(types.float32, 1, "C")
    return (
        (elem,) * 4 + (lse,) + (types.int64,) * 12 + (types.int32,) * 3
        + (types.float32,) + (types.int32,) * 2
    )  # fmt: skip


def backward_signatures(dtype_name):
    """Argument types of the portable backward kernels: {"preprocess", "dkdv", "dq"}.

    First the flat arrays (uint16 bits for fp16/bf16; lse and D float32), then the (batch,
    seqlen, head) element strides of each strided tensor (int64), then seqlen_q (int32); dkdv
    and dq go on with seqlen_k, heads_per_kv (int32), softmax_scale (float32), window_left,
    window_right (int32).
    """
    if SIMULATOR:
        return dict(preprocess=None, dkdv=None, dq=None)
    from numba.cuda import types

    elem = types.Array(types.float32 if dtype_name == "float32" else types.uint16, 1, "C")
    f32 = types.Array(types.float32, 1, "C")
    i64, i32 = types.int64, types.int32
    tail = (i32, i32, i32, types.float32, i32, i32)
    return dict(
        preprocess=(elem, elem, f32) + (i64,) * 6 + (i32,),
        dkdv=(elem,) * 4 + (f32, f32) + (elem,) * 2 + (i64,) * 18 + tail,
        dq=(elem,) * 4 + (f32, f32, elem) + (i64,) * 15 + tail,
    )


def tensor_core_backward_signature():
    """Argument types of the tensor-core backward kernel: q, k, v, dO (uint16 bits), lse, D
    (float32), dK, dV (uint16 bits), the dQ accumulator (float32); the (batch, seqlen, head)
    element strides of q, k, v, dO, dK, dV and dQ (int64); seqlen_q, seqlen_k, heads_per_kv
    (int32), softmax_scale (float32), window_left, window_right (int32)."""
    if SIMULATOR:
        return None
    from numba.cuda import types

    bits = types.Array(types.uint16, 1, "C")
    f32 = types.Array(types.float32, 1, "C")
    i32 = types.int32
    return ((bits,) * 4 + (f32, f32) + (bits, bits, f32) + (types.int64,) * 21
            + (i32, i32, i32, types.float32, i32, i32))  # fmt: skip


def tensor_core_dq_signature():
    """Argument types of the tensor-core backward's separate dQ kernel: q, k, v, dO (uint16
    bits), lse, D (float32), dQ (uint16 bits); the (batch, seqlen, head) element strides of q,
    k, v, dO and dQ (int64); seqlen_q, seqlen_k, heads_per_kv (int32), softmax_scale (float32),
    window_left, window_right (int32)."""
    if SIMULATOR:
        return None
    from numba.cuda import types

    bits = types.Array(types.uint16, 1, "C")
    f32 = types.Array(types.float32, 1, "C")
    i32 = types.int32
    return ((bits,) * 4 + (f32, f32, bits) + (types.int64,) * 15
            + (i32, i32, i32, types.float32, i32, i32))  # fmt: skip


#: Shared memory a block gets without opting in to more (every CUDA GPU).
DEFAULT_SHARED_LIMIT = 48 * 1024


def _param_layout(argtypes):
    """(struct format, slots per argument) of the kernel parameters in Numba's ABI.

    A 1-D C-contiguous array is seven parameters (meminfo, parent, nitems, itemsize, data,
    shape[0], strides[0]); a scalar is one, of its C type. Every parameter gets its own 8-byte
    slot, so the parameter pointers are the buffer's start plus multiples of 8.
    """
    from numba.cuda import types

    scalars = {types.int32: "i4x", types.int64: "q", types.uint32: "I4x",
               types.float32: "f4x", types.float64: "d"}  # fmt: skip
    fmt, kinds = "=", []
    for ty in argtypes:
        if isinstance(ty, types.Array):
            if ty.ndim != 1 or ty.layout != "C":
                raise TypeError(f"only 1-D C arrays are launched directly; got {ty}")
            fmt += "QQqqQqq"
            kinds.append(7)
        elif ty in scalars:
            fmt += scalars[ty]
            kinds.append(1)
        else:
            raise TypeError(f"no direct launch for argument type {ty}")
    return fmt, kinds


class Launcher:
    """Launches one kernel compiled for a fixed signature, skipping Numba's per-call typing.

    On the GPU the kernel is compiled once for ``argtypes`` (on first use) and launched straight
    through the driver with the arguments packed here from the CuPy arrays' pointers. Numba's
    own launch is not used: it adopts each CuPy array through ``__cuda_array_interface__``,
    which synchronises the array's stream (the host would wait for all queued work at every
    call) and costs tens of microseconds per array. A launch needing more than 48 KiB of
    dynamic shared memory first raises the kernel's opt-in limit on that device.
    """

    def __init__(self, dispatcher, argtypes):
        self.dispatcher = dispatcher
        self.argtypes = argtypes
        self._compiled = None
        if not SIMULATOR:
            self._format, self._kinds = _param_layout(argtypes)
            self._struct = struct.Struct(self._format)
            self._offsets = np.arange(sum(self._kinds), dtype=np.uint64) * 8
        self._shared_opt_in = {}  # device id -> bytes allowed
        self._functions = {}  # device id -> CUfunction

    def compiled(self):
        if self._compiled is None:
            self._compiled = self.dispatcher.compile(self.argtypes)
        return self._compiled

    def _allow_shared(self, nbytes):
        """Raise the kernel's dynamic shared memory limit on the current device to ``nbytes``."""
        import cupy

        dev = cupy.cuda.runtime.getDevice()
        if self._shared_opt_in.get(dev, DEFAULT_SHARED_LIMIT) < nbytes:
            from numba.cuda.cudadrv.driver import driver

            cufunc = self.compiled()._codelibrary.get_cufunc()
            attr = _driver().CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
            driver.cuKernelSetAttribute(attr, nbytes, cufunc.handle, cufunc.device.id)
            self._shared_opt_in[dev] = nbytes

    def __call__(self, grid, block, stream, shared_bytes, args):
        """Launch on ``stream``, a ``CUstream`` handle as an int (0: the legacy default)."""
        if SIMULATOR:
            self.dispatcher[grid, block, stream, shared_bytes](*args)
            return
        if shared_bytes > DEFAULT_SHARED_LIMIT:
            self._allow_shared(shared_bytes)
        values = []
        for kind, value in zip(self._kinds, args):
            if kind == 7:  # a KernelArray (pointer, nitems, itemsize)
                values += (0, 0, value.nitems, value.itemsize, value.pointer, value.nitems,
                           value.itemsize)  # fmt: skip
            else:
                values.append(value)
        buffer = ctypes.create_string_buffer(self._struct.pack(*values), self._struct.size)
        pointers = self._offsets + np.uint64(ctypes.addressof(buffer))
        gx, gy, gz = grid
        bx, by, bz = _dim3(block)
        driver = _driver()
        (err,) = driver.cuLaunchKernel(self._function(), gx, gy, gz, bx, by, bz, shared_bytes,
                                       stream, pointers.ctypes.data, 0)  # fmt: skip
        # ``buffer`` and ``pointers`` stayed alive until the driver copied the parameters.
        if err != driver.CUresult.CUDA_SUCCESS:
            raise RuntimeError(f"cuLaunchKernel failed: {err!r} (grid {grid}, block {block}, "
                               f"{shared_bytes} bytes of shared memory)")  # fmt: skip

    def _function(self):
        """The kernel's CUfunction on the current device (Numba loads it as a CUkernel)."""
        import cupy

        dev = cupy.cuda.runtime.getDevice()
        function = self._functions.get(dev)
        if function is None:
            cufunc = self.compiled()._codelibrary.get_cufunc()
            driver = _driver()
            err, function = driver.cuKernelGetFunction(cufunc.handle)
            if err != driver.CUresult.CUDA_SUCCESS:
                raise RuntimeError(f"cuKernelGetFunction failed: {err!r}")
            self._functions[dev] = function
        return function


def _driver():
    from cuda.bindings import driver

    return driver


def _dim3(block):
    return (block, 1, 1) if isinstance(block, int) else tuple(block) + (1,) * (3 - len(block))
