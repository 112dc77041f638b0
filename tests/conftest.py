"""One test command for every machine.

Without a GPU the suite runs in Numba's CUDA simulator (NUMBA_ENABLE_CUDASIM=1, chosen here
before numba is imported) and compiles kernels to PTX for each target in a subprocess; with a
GPU it runs everything on the device.
"""

import ctypes
import os
import sys


def _gpu_present():
    try:
        ctypes.CDLL("libcuda.so.1")
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:  # no driver, no device, no CuPy: no GPU
        return False


# JAX takes 75% of the GPU's memory when its backend starts, which leaves CuPy and the other
# pytest workers (-n auto) none: on the H100 machine every test_jax.py test ran out of memory.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

if "NUMBA_ENABLE_CUDASIM" not in os.environ and not _gpu_present():
    os.environ["NUMBA_ENABLE_CUDASIM"] = "1"

if os.environ.get("NUMBA_ENABLE_CUDASIM") == "1":
    # Simulated warps exchange lane values through barriers: every collective hands the GIL to
    # 32 threads in turn, and the default 5 ms switch interval makes each handover slow.
    sys.setswitchinterval(0.001)

import pytest  # noqa: E402

if os.environ.get("NUMBA_ENABLE_CUDASIM") == "1":
    from _simulator import poll_blocks_gently

    poll_blocks_gently()

from numflash.kernels.jit import SIMULATOR  # noqa: E402


def pytest_report_header(config):
    if SIMULATOR:
        return "numflash: Numba CUDA simulator (no GPU found)"
    from numflash.device import current_device

    dev = current_device()
    return f"numflash: {dev.name} ({dev.arch})"


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    skip_sim = pytest.mark.skip(reason="simulator only")
    skip_slow = pytest.mark.skip(reason="long-running: select it with -m slow")
    slow_chosen = "slow" in (config.getoption("markexpr") or "")
    for item in items:
        if "slow" in item.keywords and not slow_chosen:
            item.add_marker(skip_slow)
        if SIMULATOR and "gpu" in item.keywords:
            item.add_marker(skip_gpu)
        if not SIMULATOR and "simulator" in item.keywords:
            item.add_marker(skip_sim)
