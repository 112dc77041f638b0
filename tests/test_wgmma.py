"""wgmma (numflash/kernels/ptx_sm90.py, under the Hopper backward): the tiles of
tests/wgmma_gemm.py against NumPy. On a GPU of compute capability 9.x this checks the
hardware; in the simulator, the kernels' layouts against ptx_sm90's reading of them (CI also
compiles the kernels for sm_90a through ptxas: tests/test_compile.py)."""

import numpy as np
import pytest
from support import random_array, to_numpy, xp

from numflash.arrays import bits, from_float, to_float64
from numflash.kernels.jit import SIMULATOR


@pytest.mark.parametrize("variant", ["plain", "swizzled", "registers", "transposed", "wide"])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_wgmma_tile_matches_numpy(dtype, variant):
    from numflash.device import current_device

    if not SIMULATOR and current_device().compute_capability[0] != 9:
        pytest.skip("wgmma needs compute capability 9.x (sm_90a)")
    import wgmma_gemm

    k = wgmma_gemm.VARIANTS[variant]
    n = wgmma_gemm.WIDTH.get(variant, wgmma_gemm.N)
    transposed = variant in wgmma_gemm.MN_MAJOR
    a = random_array((wgmma_gemm.M, k), dtype)
    b = random_array((k, n) if transposed else (n, k), dtype)
    c = xp.full((wgmma_gemm.M, n), np.nan, dtype=np.float32)  # poisoned
    kernel = wgmma_gemm.build(dtype, variant)
    kernel[1, wgmma_gemm.THREADS, 0, wgmma_gemm.shared_bytes(variant)](
        bits(a).ravel(), bits(b).ravel(), c.ravel()
    )
    if not SIMULATOR:
        xp.cuda.get_current_stream().synchronize()
    b64 = to_numpy(to_float64(b))
    expected = to_numpy(to_float64(a)) @ (b64 if transposed else b64.T)
    # fp32 accumulation of up to 64 exact products of values ~N(0, 1): far inside 1e-4
    np.testing.assert_allclose(to_numpy(c), expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_wgmma_chained_products_match_numpy(dtype):
    """S = A B^T over head_dim 128 (two swizzle blocks of K), rounded to 16 bits in registers
    and multiplied by D as the register A operand: the backward's dV += P^T dO, with its loads
    by cp.async into swizzled shared memory."""
    from numflash.device import current_device

    if not SIMULATOR and current_device().compute_capability[0] != 9:
        pytest.skip("wgmma needs compute capability 9.x (sm_90a)")
    import wgmma_gemm

    a, b = (random_array((64, wgmma_gemm.CHAIN_K), dtype) for _ in range(2))
    d = random_array((64, 64), dtype)
    c = xp.full((64, 64), np.nan, dtype=np.float32)  # poisoned
    kernel = wgmma_gemm.build_chain(dtype)
    kernel[1, wgmma_gemm.THREADS, 0, wgmma_gemm.chain_shared_bytes()](
        bits(a).ravel(), bits(b).ravel(), bits(d).ravel(), c.ravel()
    )
    if not SIMULATOR:
        xp.cuda.get_current_stream().synchronize()
    s = to_numpy(to_float64(a)) @ to_numpy(to_float64(b)).T
    rounded = to_numpy(to_float64(from_float(xp.asarray(s.astype(np.float32)), a.dtype)))
    d64 = to_numpy(to_float64(d))
    expected = rounded @ d64
    # S accumulates in fp32 on the GPU, in fp64 here: a value of S near a rounding boundary may
    # round the other way, moving the output by one 16-bit step of S times a value of D.
    ulp = 2.0 ** (np.floor(np.log2(np.abs(s).max())) - (10 if dtype == "float16" else 7))
    np.testing.assert_allclose(to_numpy(c), expected, rtol=0, atol=4 * ulp * np.abs(d64).max())
