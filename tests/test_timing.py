"""numflash.timing: the one timer of the benchmarks and the autotuner."""

import time

import pytest
from support.nvrtc import assert_compiles

from numflash import timing
from numflash.timing import time_gpu


def test_flush_and_hold_kernels_compile():
    """The L2 flush's and the hold's C code (CuPy compiles it on a GPU's first timing)."""
    assert_compiles(timing._SOURCE)


@pytest.mark.gpu
def test_host_time_before_the_kernels_is_not_timed():
    """A call that spends 5 ms on the host before queueing a microsecond of GPU work is timed
    at its GPU work: the hold before the start event covers the host's part."""
    import cupy

    x = cupy.ones(4096, cupy.float32)

    def slow_host():
        time.sleep(0.005)
        x.__iadd__(1)

    assert time_gpu(slow_host, runs=5).median_ms < 0.5


@pytest.mark.gpu
def test_gpu_work_is_timed():
    """The hold does not hide the work itself: ten times the work takes longer."""
    import cupy

    x = cupy.ones(1 << 26, cupy.float32)

    def once():
        x.__iadd__(1)

    def ten():
        for _ in range(10):
            x.__iadd__(1)

    one, many = time_gpu(once, runs=7).median_ms, time_gpu(ten, runs=7).median_ms
    assert 5 * one < many < 20 * one


@pytest.mark.simulator
def test_the_simulator_times_the_call_on_the_host():
    """Without a GPU the kernels run inside the call: a host clock times all of it."""
    assert time_gpu(lambda: time.sleep(0.01), warmup=1, runs=3).median_ms >= 9
