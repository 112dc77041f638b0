"""How numflash's kernels are compiled: one place that knows the simulator from the GPU.

Numba's CUDA simulator (``NUMBA_ENABLE_CUDASIM=1``) accepts only a subset of ``cuda.jit``'s
options, so kernel modules decorate through :func:`device_function` and :func:`kernel`, which
pass the GPU-only options (``forceinline``, ``lineinfo``, ``launch_bounds``) where they exist.
In the simulator, importing this module also makes ``cuda.shared.array`` safe for a block's
concurrent threads (:func:`_serialise_simulated_shared_arrays`).
"""

import os
import sys
import threading

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


def _serialise_simulated_shared_arrays():
    """Make the simulator's ``cuda.shared.array`` safe for a block's concurrent threads.

    numba-cuda 0.30's simulator gives each call site of a block one NumPy array, created by
    the first thread to get there: it looks the site up and, when absent, makes and stores a
    new array, with no lock. Two threads that interleave between the look-up and the store
    each get an array of their own, so one reads an ``np.empty`` tile the others never wrote
    (garbage in the output, inf among it). Here the look-up and the store happen under one lock;
    the call site is the caller's (file, line), as numba keys it. Dynamic shared memory
    (shape 0) is one buffer per block already and goes to numba unchanged. An ``alignment``
    (which the simulator refuses) is dropped: NumPy's buffers are 16-byte aligned or more,
    and what a kernel asks it for is the alignment of a GPU copy's address.
    """
    import numpy as np
    from numba.cuda import types
    from numba.cuda.np import numpy_support
    from numba.cuda.simulator import kernelapi

    unsafe = kernelapi.FakeCUDAShared.array
    lock = threading.Lock()

    def array(self, shape, dtype, alignment=None):
        if shape == 0:
            return unsafe(self, shape, dtype)
        caller = sys._getframe(1)
        site = (caller.f_code.co_filename, caller.f_lineno)
        with lock:
            res = self._allocations.get(site)
            if res is None:
                if isinstance(dtype, types.Type):
                    dtype = numpy_support.as_dtype(dtype)
                res = self._allocations[site] = np.empty(shape, dtype)
        return res

    kernelapi.FakeCUDAShared.array = array


if SIMULATOR:
    _serialise_simulated_shared_arrays()
