"""C code that CuPy compiles only on a GPU, compiled here by NVRTC (from the cuda-bindings wheel
numba-cuda brings), so a typo or a name clash shows on CI."""

import pytest


def assert_compiles(source, arch="compute_90"):
    """``source`` (C++ for the GPU) compiles with NVRTC for ``arch``; skips where NVRTC's
    bindings are not installed."""
    nvrtc = pytest.importorskip("cuda.bindings.nvrtc")
    err, program = nvrtc.nvrtcCreateProgram(source.encode(), b"source.cu", 0, [], [])
    assert err == nvrtc.nvrtcResult.NVRTC_SUCCESS
    try:
        (err,) = nvrtc.nvrtcCompileProgram(program, 1, [f"--gpu-architecture={arch}".encode()])
        _, size = nvrtc.nvrtcGetProgramLogSize(program)
        log = b" " * size
        nvrtc.nvrtcGetProgramLog(program, log)
        assert err == nvrtc.nvrtcResult.NVRTC_SUCCESS, log.decode(errors="replace")
    finally:
        nvrtc.nvrtcDestroyProgram(program)
