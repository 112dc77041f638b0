"""The PTX intrinsics against NumPy.

The same kernels run through the simulator fallbacks on CI and through the real instructions on
a GPU, so on the GPU these tests also prove that the fallbacks mean what the hardware does.
"""

import ml_dtypes
import numpy as np
import pytest
from numba import cuda, float32, uint16, uint32
from support import to_numpy, xp

from numflash.kernels import ptx

ROW = 24  # 16 columns + 8 padding, as the kernels pitch their shared-memory rows
A_OFF, BT_OFF, B_OFF = 0, 16 * ROW, 32 * ROW
SMEM_ELEMENTS = 48 * ROW  # a plain constant: cuda.shared.array does not fold expressions

DTYPES = {"float16": np.float16, "bfloat16": ml_dtypes.bfloat16}


def _tile_kernel(mma):
    @cuda.jit
    def kernel(a, bt, b, out_nt, out_t):
        """out_nt = A @ BT^T and out_t = A @ B for 16x16 tiles, through cp.async and ldmatrix."""
        smem = cuda.shared.array(SMEM_ELEMENTS, uint16)
        lane = cuda.threadIdx.x
        r = lane >> 1
        c = (lane & 1) * 8
        base = ptx.shared_address(smem, 0)
        lane_row = uint32((r * ROW + c) * 2)
        ptx.cp_async_16(base + uint32(A_OFF * 2) + lane_row, a, r * 16 + c, uint32(16))
        ptx.cp_async_16(base + uint32(BT_OFF * 2) + lane_row, bt, r * 16 + c, uint32(16))
        ptx.cp_async_16(base + uint32(B_OFF * 2) + lane_row, b, r * 16 + c, uint32(16))
        ptx.cp_async_commit()
        ptx.cp_async_wait(0)
        cuda.syncthreads()
        a_lane = ((lane & 15) * ROW + (lane >> 4) * 8) * 2
        k_lane = (((lane & 7) + ((lane >> 4) << 3)) * ROW + ((lane >> 3) & 1) * 8) * 2
        a0, a1, a2, a3 = ptx.ldmatrix_x4(base, uint32(A_OFF * 2 + a_lane))
        b0, b1, b2, b3 = ptx.ldmatrix_x4(base, uint32(BT_OFF * 2 + k_lane))
        t0, t1, t2, t3 = ptx.ldmatrix_x4_trans(base, uint32(B_OFF * 2 + a_lane))
        zero = float32(0.0)
        g = lane >> 2
        col = (lane & 3) * 2
        for tile in range(2):
            if tile == 0:
                d = mma(a0, a1, a2, a3, b0, b1, zero, zero, zero, zero)
                e = mma(a0, a1, a2, a3, t0, t1, zero, zero, zero, zero)
            else:
                d = mma(a0, a1, a2, a3, b2, b3, zero, zero, zero, zero)
                e = mma(a0, a1, a2, a3, t2, t3, zero, zero, zero, zero)
            n = tile * 8 + col
            out_nt[g, n], out_nt[g, n + 1], out_nt[g + 8, n], out_nt[g + 8, n + 1] = d
            out_t[g, n], out_t[g, n + 1], out_t[g + 8, n], out_t[g + 8, n + 1] = e

    return kernel


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_cp_async_ldmatrix_mma_tile(dtype):
    rng = np.random.default_rng(7)
    mats = [rng.standard_normal((16, 16)).astype(DTYPES[dtype]) for _ in range(3)]
    a, bt, b = (m.astype(np.float64) for m in mats)
    bits = [xp.asarray(m.view(np.uint16).reshape(-1)) for m in mats]
    out_nt = xp.full((16, 16), np.nan, dtype=np.float32)
    out_t = xp.full((16, 16), np.nan, dtype=np.float32)
    mma = ptx.mma_f16 if dtype == "float16" else ptx.mma_bf16
    _tile_kernel(mma)[1, 32](*bits, out_nt, out_t)
    # 16-term fp32 sums of exact products: a few ulp of the result's magnitude.
    np.testing.assert_allclose(to_numpy(out_nt), a @ bt.T, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(to_numpy(out_t), a @ b, rtol=1e-5, atol=1e-5)


@cuda.jit
def _lane_ops(x, shuffled, exps, f16_bits, bf16_bits, f16_pack, bf16_pack, back16, backbf):
    lane = cuda.threadIdx.x
    v = x[lane]
    shuffled[lane] = ptx.shfl_xor(v, 1) + float32(2.0) * ptx.shfl_xor(v, 2)
    exps[lane] = ptx.exp2(v)
    f16_bits[lane] = ptx.f32_to_f16(v)
    bf16_bits[lane] = ptx.f32_to_bf16(v)
    f16_pack[lane] = ptx.pack_f16x2(v, -v)
    bf16_pack[lane] = ptx.pack_bf16x2(v, -v)
    back16[lane] = ptx.f16_to_f32(f16_bits[lane])
    backbf[lane] = ptx.bf16_to_f32(bf16_bits[lane])


def test_lane_operations():
    # Rounding ties for bf16 (1 + 2^-8 lies halfway), a NaN, infinities, overflow for fp16.
    special = [1.0 + 2.0**-8, 1.0 + 3 * 2.0**-8, np.nan, np.inf, -np.inf, 70000.0, -0.0, 1e-30]
    values = np.concatenate([special, np.linspace(-20, 3, 32 - len(special))]).astype(np.float32)
    x = xp.asarray(values)
    outs = [xp.zeros(32, np.float32) for _ in range(2)]
    bits = [xp.zeros(32, np.uint16) for _ in range(2)]
    packs = [xp.zeros(32, np.uint32) for _ in range(2)]
    backs = [xp.zeros(32, np.float32) for _ in range(2)]
    _lane_ops[1, 32](x, *outs, *bits, *packs, *backs)
    shuffled, exps = (to_numpy(o) for o in outs)
    lanes = np.arange(32)
    expected = values[lanes ^ 1] + 2 * values[lanes ^ 2]
    np.testing.assert_array_equal(np.isnan(shuffled), np.isnan(expected))
    np.testing.assert_allclose(shuffled[~np.isnan(expected)], expected[~np.isnan(expected)])
    finite = np.isfinite(values)
    with np.errstate(over="ignore"):  # the special values include ones past float32/fp16 range
        np.testing.assert_allclose(exps[finite], np.exp2(values[finite]), rtol=2e-6, atol=1e-37)
        f16 = values.astype(np.float16)
    assert exps[4] == 0 and exps[3] == np.inf
    bf16 = values.astype(ml_dtypes.bfloat16)
    f16_bits, bf16_bits = (to_numpy(b) for b in bits)
    nan = np.isnan(values)
    np.testing.assert_array_equal(f16_bits[~nan], f16.view(np.uint16)[~nan])
    np.testing.assert_array_equal(bf16_bits[~nan], bf16.view(np.uint16)[~nan])
    assert np.isnan(f16_bits.view(np.float16)[nan]).all()
    assert np.isnan(bf16_bits.view(ml_dtypes.bfloat16)[nan].astype(np.float32)).all()
    f16_pack, bf16_pack = (to_numpy(p) for p in packs)
    np.testing.assert_array_equal((f16_pack & 0xFFFF)[~nan], f16.view(np.uint16)[~nan])
    np.testing.assert_array_equal((f16_pack >> 16)[~nan], (-f16).view(np.uint16)[~nan])
    np.testing.assert_array_equal((bf16_pack & 0xFFFF)[~nan], bf16.view(np.uint16)[~nan])
    np.testing.assert_array_equal((bf16_pack >> 16)[~nan], (-bf16).view(np.uint16)[~nan])
    back16, backbf = (to_numpy(b) for b in backs)
    np.testing.assert_array_equal(back16[~nan], f16.astype(np.float32)[~nan])
    np.testing.assert_array_equal(backbf[~nan], bf16.astype(np.float32)[~nan])


@cuda.jit
def _any_lane(marked, answers):
    lane = cuda.threadIdx.x
    answers[lane] = 1 if ptx.any_lane(marked[lane] != 0) else 0


@pytest.mark.parametrize("marked_lanes", [(), (0,), (31,), (5, 17), tuple(range(32))])
def test_any_lane_gives_every_lane_the_warps_answer(marked_lanes):
    marked = np.zeros(32, np.int32)
    marked[list(marked_lanes)] = 1
    answers = xp.full(32, 7, np.int32)  # poisoned: every lane must write its answer
    _any_lane[1, 32](xp.asarray(marked), answers)
    np.testing.assert_array_equal(to_numpy(answers), np.full(32, int(bool(marked_lanes))))


@cuda.jit
def _tanh(x, out):
    lane = cuda.threadIdx.x
    out[lane] = ptx.tanh(x[lane])


def test_tanh_is_within_its_documented_error():
    values = np.concatenate(
        [[0.0, -0.0, 1e-6, 20.0, -20.0, np.inf, -np.inf], np.linspace(-4, 4, 25)]
    )
    x = xp.asarray(values.astype(np.float32))
    out = xp.zeros(32, np.float32)
    _tanh[1, 32](x, out)
    got, want = to_numpy(out).astype(np.float64), np.tanh(values.astype(np.float64))
    np.testing.assert_allclose(got, want, rtol=2.0**-10, atol=1e-7)


@cuda.jit
def _exp2_fma(x, out):
    i = cuda.grid(1)
    if i < x.size:
        out[i] = ptx.exp2_fma(x[i])


def test_exp2_on_the_fma_units_is_within_its_error_and_keeps_nan_and_minus_infinity():
    """ptx.exp2_fma (the cubic of ptx.EXP2_CUBIC scaled by 2**floor(x)): within 1e-4 of exp2
    relative over the exponents a softmax makes (x <= 0) and a little above, exact at whole
    numbers, +0 for -inf and from -127 down, NaN for NaN."""
    grid = np.linspace(-30.0, 3.0, 3301)
    special = [0.0, -1.0, -126.0, -126.5, -127.0, -200.0, -np.inf, np.nan]
    values = np.concatenate([grid, special]).astype(np.float32)
    x = xp.asarray(values)
    out = xp.zeros(values.shape, np.float32)
    _exp2_fma[(values.size + 127) // 128, 128](x, out)
    got = to_numpy(out).astype(np.float64)
    want = np.exp2(grid.astype(np.float32).astype(np.float64))
    np.testing.assert_allclose(got[: grid.size], want, rtol=1e-4, atol=0)
    tail = got[grid.size :]
    assert tail[0] == 1.0 and tail[1] == 0.5 and tail[2] == 2.0**-126
    assert 0 < tail[3] < 2.0**-126 or tail[3] == 0  # below the normal range: flushed or tiny
    assert (tail[4:7] == 0).all() and np.isnan(tail[7])


TILE_ELEMENTS = 64 * 128  # the largest tile below: 64 rows of 128 16-bit values


def _loader_kernel(load_rows, threads, atom_bytes):
    @cuda.jit
    def kernel(src, out, first, stride, rows_left, nrows):
        """A swizzled tile loaded into shared memory poisoned with 0xFFFF, copied out."""
        smem = cuda.shared.array(TILE_ELEMENTS, uint16)
        tid = cuda.threadIdx.x
        for i in range(tid, TILE_ELEMENTS, threads):
            smem[i] = uint16(0xFFFF)
        cuda.syncthreads()
        load_rows(
            ptx.shared_address(smem, 0), src, first, stride, rows_left, nrows, atom_bytes, tid
        )
        ptx.cp_async_commit()
        ptx.cp_async_wait(0)
        cuda.syncthreads()
        for i in range(tid, TILE_ELEMENTS, threads):
            out[i] = smem[i]

    return kernel


@pytest.mark.parametrize(
    "chunks,threads,nrows,rows_left",
    [(8, 128, 40, 37), (16, 128, 64, 70), (16, 256, 64, 20), (8, 256, 64, 64)],
)
def test_the_tile_loader_writes_what_the_row_loader_does(chunks, threads, nrows, rows_left):
    """loads.swizzled_tile_loader (each thread keeps its chunk from pass to pass) fills the
    same swizzled bytes as loads.swizzled_row_loader: rows past ``rows_left`` zero, rows
    from ``nrows`` on untouched (a tile of 40 rows ends in half a pass)."""
    from numflash.kernels import loads

    cols = chunks * 8
    stride, first = cols + 24, 8  # padded rows, 16-byte aligned
    rng = np.random.default_rng(chunks + threads + nrows)
    src = rng.integers(0, 0xFFFF, first + 80 * stride, dtype=np.uint16)
    atom_bytes = nrows * 128  # the atoms of a tile one after the other
    found = []
    for make in (loads.swizzled_row_loader, loads.swizzled_tile_loader):
        out = xp.zeros(TILE_ELEMENTS, dtype=xp.uint16)
        kernel = _loader_kernel(make(chunks, threads), threads, atom_bytes)
        kernel[1, threads](xp.asarray(src), out, first, stride, rows_left, nrows)
        found.append(to_numpy(out))
    assert (found[0] == found[1]).all()
    tile = found[1].view(np.uint8)
    rows = np.arange(nrows)[:, None, None]
    chunk = np.arange(chunks)[None, :, None]
    byte = np.arange(16)[None, None, :]
    at = (chunk >> 3) * atom_bytes + rows * 128 + (((chunk & 7) ^ (rows & 7)) << 4) + byte
    element = first + rows * stride + chunk * 8 + byte // 2
    expected = np.where(rows < rows_left, src.view(np.uint8)[element * 2 + byte % 2], 0)
    assert (tile[at] == expected).all()
    written = np.zeros(tile.size, dtype=bool)
    written[at.ravel()] = True
    assert (tile[~written] == 0xFF).all()  # the poison where no row of the tile goes
