"""The CUDA simulator the CPU suite runs kernels in, where numflash corrects numba-cuda's."""

import sys
import threading

import pytest

pytestmark = pytest.mark.simulator

THREADS = 8
BLOCKS = 1000


def test_a_blocks_threads_share_one_static_shared_array():
    """Threads of a block that reach ``cuda.shared.array`` together get the same array.

    Without numflash's lock, numba-cuda 0.30's simulator splits the allocation in a few of
    these blocks (each such thread then works on an ``np.empty`` tile of its own), so the test
    fails most runs; with it, never."""
    from numba.cuda import float32
    from numba.cuda.simulator.kernelapi import FakeCUDAShared

    split = 0
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # hand the GIL over often, as a busy simulated block does
    try:
        for _ in range(BLOCKS):
            split += _allocation_split(FakeCUDAShared(0), float32)
    finally:
        sys.setswitchinterval(interval)
    assert split == 0, f"{split} of {BLOCKS} blocks got more than one array"


def _allocation_split(shared, dtype):
    """Whether THREADS threads calling ``shared.array`` at once got more than one array."""
    got = [None] * THREADS
    together = threading.Barrier(THREADS)

    def allocate(i):
        together.wait()
        got[i] = shared.array(1024, dtype)

    threads = [threading.Thread(target=allocate, args=(i,)) for i in range(THREADS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return len({id(a) for a in got}) > 1
