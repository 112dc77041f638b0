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
