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


def compile_ptx(kernel, signature, cc):
    """PTX of ``kernel`` (a ``cuda.jit`` dispatcher) for ``signature`` and target ``cc``."""
    with target(cc):
        ptx, _ = cuda.compile_ptx(kernel.py_func, signature, cc=cc)
    return ptx


_USAGE = re.compile(
    r"(?P<stack>\d+) bytes stack frame, (?P<spill_stores>\d+) bytes spill stores, "
    r"(?P<spill_loads>\d+) bytes spill loads.*?Used (?P<registers>\d+) registers",
    re.S,
)


def resource_usage(ptx, cc):
    """ptxas' report for the one kernel in ``ptx``: a dict of registers, stack and spill bytes."""
    from cuda.core import Linker, LinkerOptions, ObjectCode

    options = LinkerOptions(arch=arch_name(cc), ptxas_options=["-v"])
    linker = Linker(ObjectCode.from_ptx(ptx.encode()), options=options)
    linker.link("cubin")
    log = linker.get_info_log()
    match = _USAGE.search(log)
    if match is None:
        raise RuntimeError(f"no resource report in the linker's log:\n{log}")
    return {name: int(value) for name, value in match.groupdict().items()} | {"log": log}
