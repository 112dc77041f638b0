"""Facts about the current device that the dispatcher, the configurations and the CLI need."""

import functools
from dataclasses import dataclass

from numba import cuda

from .kernels.jit import SIMULATOR

#: Families of forward kernels. "tensor-core" needs mma.sync with fp16/bf16 operands (sm_80+);
#: "portable" runs on every GPU numba-cuda supports and in the simulator.
TENSOR_CORE = "tensor-core"
PORTABLE = "portable"
#: The backward kernels without tensor cores (every GPU, every dtype, the simulator).
PORTABLE_BACKWARD = "portable-backward"
#: The tensor-core backward on mma.sync (sm_80+, fp16/bf16).
TENSOR_CORE_BACKWARD = "tensor-core-backward"
#: The Hopper backward on warpgroup MMAs (sm_90a only, fp16/bf16, head_dim 64 and 128).
WGMMA_BACKWARD = "wgmma-backward"
#: The Hopper forward on warpgroup MMAs (sm_90a only, fp16/bf16, head_dim a multiple of 8).
WGMMA_FORWARD = "wgmma-forward"
#: Attention over a KV cache without tensor cores (every GPU, every dtype, the simulator).
PORTABLE_DECODE = "portable-decode"
#: Attention over a KV cache on mma.sync (sm_80+, fp16/bf16, head_dim a multiple of 8).
TENSOR_CORE_DECODE = "tensor-core-decode"

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

    def preferred_family(self, dtype_name):
        """The family a call takes when no configuration is forced.

        fp16 and bf16 go to the tensor cores where the GPU has them; float32 and older GPUs take
        the portable kernel. The simulator reports compute capability 5.2 and so defaults to the
        portable kernel; the tensor-core kernel runs there when a configuration asks for it.
        """
        if dtype_name in ("float16", "bfloat16") and not self.simulated:
            if self.compute_capability >= TENSOR_CORE_MIN_CC:
                return TENSOR_CORE
        return PORTABLE


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
