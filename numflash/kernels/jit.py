"""How numflash's kernels are compiled: one place that knows the simulator from the GPU.

Numba's CUDA simulator (``NUMBA_ENABLE_CUDASIM=1``) accepts only a subset of ``cuda.jit``'s
options, so kernel modules decorate through :func:`device_function` and :func:`kernel`, which
pass the GPU-only options (``forceinline``, ``lineinfo``, ``launch_bounds``) where they exist.
"""

import os

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
    memory. In the simulator it is plain Python.
    """
    if SIMULATOR:
        return fn
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


#: Shared memory a block gets without opting in to more (every CUDA GPU).
DEFAULT_SHARED_LIMIT = 48 * 1024


class Launcher:
    """Launches one kernel compiled for a fixed signature, skipping Numba's per-call typing.

    On the GPU the kernel is compiled once for ``argtypes`` (on first use); a launch needing more
    than 48 KiB of dynamic shared memory first raises the kernel's opt-in limit on that device.
    """

    def __init__(self, dispatcher, argtypes):
        self.dispatcher = dispatcher
        self.argtypes = argtypes
        self._compiled = None
        self._shared_opt_in = {}  # device id -> bytes allowed

    def compiled(self):
        if self._compiled is None:
            self._compiled = self.dispatcher.compile(self.argtypes)
        return self._compiled

    def _allow_shared(self, nbytes):
        from cuda.bindings import driver as binding
        from numba.cuda.cudadrv.driver import driver

        cufunc = self.compiled()._codelibrary.get_cufunc()
        dev = cufunc.device.id
        if self._shared_opt_in.get(dev, DEFAULT_SHARED_LIMIT) < nbytes:
            attr = binding.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
            driver.cuKernelSetAttribute(attr, nbytes, cufunc.handle, dev)
            self._shared_opt_in[dev] = nbytes

    def __call__(self, grid, block, stream, shared_bytes, args):
        if SIMULATOR:
            self.dispatcher[grid, block, stream, shared_bytes](*args)
            return
        if shared_bytes > DEFAULT_SHARED_LIMIT:
            self._allow_shared(shared_bytes)
        self.compiled().launch(args, grid, block, stream, shared_bytes)
