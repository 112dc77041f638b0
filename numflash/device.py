"""Facts about the current device that the dispatcher, the configurations and the CLI need:
what it is and which instructions it has (no policy: which kernel family a call takes is
numflash.selection's)."""

import functools
from dataclasses import dataclass

from numba import cuda

from .kernels.jit import SIMULATOR

#: The first compute capability with mma.sync m16n8k16, ldmatrix and cp.async (Ampere).
TENSOR_CORE_MIN_CC = (8, 0)


@dataclass(frozen=True)
class DeviceInfo:
    name: str
    compute_capability: tuple
    multiprocessors: int
    #: Shared memory one block may use once its kernel opts in (sharedMemPerBlockOptin).
    max_shared_per_block: int
    max_threads_per_block: int
    simulated: bool = False

    @property
    def arch(self):
        """The architecture name numflash keys its caches by, e.g. ``sm_90``."""
        return "sm_%d%d" % self.compute_capability

    def runs(self, hardware):
        """Whether kernels that need ``hardware`` (a family's HARDWARE, numflash.config) can run
        here: "portable" everywhere, "mma.sync" from sm_80, "wgmma" on 9.x; the simulator runs
        them all."""
        if hardware == "portable" or self.simulated:
            return True
        if hardware == "wgmma":
            return self.has_wgmma
        if hardware == "mma.sync":
            return self.compute_capability >= TENSOR_CORE_MIN_CC
        raise ValueError(f"unknown hardware {hardware!r}")

    @property
    def has_wgmma(self):
        """Whether the Hopper wgmma kernels can run here: compute capability 9.x (sm_90a; its
        instructions are not in later architectures), or the simulator."""
        return self.simulated or self.compute_capability[0] == 9


#: The simulator has no hardware limits of its own; these mirror an H100/H200 so that the same
#: configurations are feasible there and on the GPU.
SIMULATED_DEVICE = DeviceInfo(
    name="Numba CUDA simulator",
    compute_capability=(5, 2),
    multiprocessors=1,
    max_shared_per_block=232448,
    max_threads_per_block=1024,
    simulated=True,
)


@functools.lru_cache(maxsize=None)
def _device_info(device_id):
    dev = cuda.get_current_device()
    name = dev.name.decode() if isinstance(dev.name, bytes) else str(dev.name)
    return DeviceInfo(
        name=name,
        compute_capability=tuple(dev.compute_capability),
        multiprocessors=int(dev.MULTIPROCESSOR_COUNT),
        max_shared_per_block=int(dev.MAX_SHARED_MEMORY_PER_BLOCK_OPTIN),
        max_threads_per_block=int(dev.MAX_THREADS_PER_BLOCK),
    )


def current_device():
    """The :class:`DeviceInfo` of the current CUDA device (CuPy's current device on a GPU)."""
    if SIMULATOR:
        return SIMULATED_DEVICE
    import cupy

    # numba-cuda adopts the context that is current on the thread, which is CuPy's: both use
    # the device's primary context, so kernels launch where CuPy's arrays live.
    return _device_info(cupy.cuda.runtime.getDevice())


def gpu_available():
    """True when a CUDA driver and at least one GPU are present (never raises)."""
    if SIMULATOR:
        return False
    try:
        return bool(cuda.is_available()) and len(cuda.gpus) > 0
    except Exception:  # a missing or broken driver is a plain "no"
        return False
