"""Compile numflash's kernels for any target architecture on a machine without a GPU.

``numba.cuda.compile_ptx`` takes the target compute capability as an argument, but typing a
call to a ``cuda.jit`` device function asks the driver for the current device's compute
capability (numba-cuda 0.30, ``CUDADispatcher.compile_device``). :func:`target` stands a fake
device in for that one question while compiling, so the compile checks run on CI.

:func:`resource_usage` links the PTX with nvJitLink (through ``cuda.core``) and reads ptxas'
report: registers, spills, stack frame, shared memory.
"""

import contextlib
import re
import threading
from types import SimpleNamespace

from numba import cuda

_lock = threading.Lock()


@contextlib.contextmanager
def target(cc):
    """Within this block, device functions are compiled for compute capability ``cc``."""
    from numba.cuda import dispatcher

    fake = SimpleNamespace(compute_capability=tuple(cc[:2]))
    with _lock:
        saved = dispatcher.get_current_device
        dispatcher.get_current_device = lambda: fake
        try:
            yield
        finally:
            dispatcher.get_current_device = saved


def arch_name(cc):
    """(9, 0, 'a') -> 'sm_90a'."""
    return "sm_%d%d%s" % (cc[0], cc[1], cc[2] if len(cc) > 2 else "")


def compile_ptx(kernel, signature, cc, launch_bounds=False):
    """PTX of ``kernel`` (a ``cuda.jit`` dispatcher) for ``signature`` and target ``cc``; with
    ``launch_bounds``, under the kernel's own launch bounds (.maxntid, .minnctapersm), which
    bound the registers ptxas may give a thread, as when the kernel is compiled for a launch."""
    options = _launch_bounds(kernel) if launch_bounds else {}
    with target(cc):
        ptx, _ = cuda.compile_ptx(kernel.py_func, signature, cc=cc, **options)
    return ptx


def _launch_bounds(kernel):
    """The kernel's launch bounds as compile options ({} where it has none)."""
    bounds = kernel.targetoptions.get("launch_bounds")
    return {} if bounds is None else {"launch_bounds": bounds}


_USAGE = re.compile(
    r"(?P<stack>\d+) bytes stack frame, (?P<spill_stores>\d+) bytes spill stores, "
    r"(?P<spill_loads>\d+) bytes spill loads.*?Used (?P<registers>\d+) registers",
    re.S,
)


def resource_usage(ptx, cc):
    """ptxas' report for the one kernel in ``ptx``: a dict of registers, stack and spill bytes."""
    from cuda.core import ObjectCode

    return _linked_usage(ObjectCode.from_ptx(ptx.encode()), cc, lto=False)


def lto_resource_usage(kernel, signature, cc):
    """As :func:`resource_usage`, for ``kernel`` compiled as Numba compiles it for a launch:
    to LTO-IR under its launch bounds, linked by nvJitLink with link-time optimisation. Linking
    PTX instead compiles it as one unit among others, and ptxas then ignores setmaxnreg
    (remark C7504), so the warp-specialised kernels are only judged this way."""
    from cuda.core import ObjectCode

    with target(cc):
        ltoir, _ = cuda.compile(
            kernel.py_func,
            signature,
            device=False,
            cc=cc,
            output="ltoir",
            abi="numba",
            **_launch_bounds(kernel),
        )
    return _linked_usage(ObjectCode.from_ltoir(ltoir), cc, lto=True)


def _linked_usage(code, cc, lto):
    from cuda.core import Linker, LinkerOptions

    options = LinkerOptions(arch=arch_name(cc), ptxas_options=["-v"], link_time_optimization=lto)
    linker = Linker(code, options=options)
    linker.link("cubin")
    log = linker.get_info_log()
    match = _USAGE.search(log)
    if match is None:
        raise RuntimeError(f"no resource report in the linker's log:\n{log}")
    return {name: int(value) for name, value in match.groupdict().items()} | {"log": log}
