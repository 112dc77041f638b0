"""One 64 x 64 x 16 tile multiplied with wgmma (numflash/kernels/ptx_sm90.py): C = A @ B^T for
A (64 x 16) and B (64 x 16) in fp16 or bf16, both copied to shared memory in the no-swizzle
K-major layout, C in fp32. The smallest kernel that exercises the descriptor, the fences and
the accumulator layout: compiled for sm_90a by tests/compile_targets.py, run on a GPU by
tests/test_wgmma.py.
"""

import functools

from numba import cuda, float32, types, uint16

from numflash.kernels import ptx, ptx_sm90

M = N = 64
K = 16
#: no swizzle, K-major: core matrix (8 rows x 8 values, 128 bytes) (r, k) of an operand at byte
#: r * STRIDE_BYTES + k * LEADING_BYTES, each of its rows 16 bytes
LEADING_BYTES, STRIDE_BYTES = 128, 256
B_OFFSET_BYTES = M * K * 2  # B after A in shared memory
SHARED_BYTES = B_OFFSET_BYTES + N * K * 2
THREADS = 128  # one warpgroup


def signature():
    vector = types.Array(types.uint16, 1, "C")
    return types.void(vector, vector, types.Array(types.float32, 1, "C"))


def core_offset(row, col):
    """Element offset of (row, col) of a 64 x 16 operand in the layout above."""
    return ((row >> 3) * STRIDE_BYTES + (col >> 3) * LEADING_BYTES) // 2 + (row & 7) * 8 + (col & 7)


@functools.lru_cache(maxsize=None)
def build(dtype_name):
    wgmma = {"float16": ptx_sm90.wgmma_m64n64k16_f16,
             "bfloat16": ptx_sm90.wgmma_m64n64k16_bf16}[dtype_name]  # fmt: skip
    offset = cuda.jit(device=True, forceinline=True)(core_offset)

    @cuda.jit
    def gemm(a, b, c):
        """a, b: the bits of 64 x 16 row-major operands (1024 each); c: 64 x 64 fp32 out."""
        smem = cuda.shared.array(0, uint16)
        tid = cuda.threadIdx.x
        for i in range(2 * M * K // THREADS):  # A's values, then B's
            e = tid + i * THREADS
            row, col = (e & (M * K - 1)) >> 4, e & 15
            if e < M * K:
                smem[offset(row, col)] = a[e]
            else:
                smem[B_OFFSET_BYTES // 2 + offset(row, col)] = b[e - M * K]
        ptx_sm90.fence_proxy_async()
        cuda.syncthreads()
        base = ptx.shared_address(smem, 0)
        desc_a = ptx_sm90.matrix_descriptor(base, LEADING_BYTES, STRIDE_BYTES, 0)
        desc_b = ptx_sm90.matrix_descriptor(base + B_OFFSET_BYTES, LEADING_BYTES,
                                            STRIDE_BYTES, 0)  # fmt: skip
        z = float32(0)
        acc = (z, z, z, z, z, z, z, z, z, z, z, z, z, z, z, z,
               z, z, z, z, z, z, z, z, z, z, z, z, z, z, z, z)  # fmt: skip
        ptx_sm90.wgmma_fence()
        acc = wgmma(acc, desc_a, desc_b)
        ptx_sm90.wgmma_commit()
        ptx_sm90.wgmma_wait(0)
        warp, lane = tid >> 5, tid & 31
        g, t = lane >> 2, lane & 3
        for i in range(N // 8):
            for r in range(4):
                row = 16 * warp + g + 8 * (r >> 1)
                col = 8 * i + 2 * t + (r & 1)
                c[row * N + col] = acc[4 * i + r]

    return gemm
