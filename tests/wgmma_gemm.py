"""Tiles multiplied with wgmma (numflash/kernels/ptx_sm90.py): C = A @ B^T for A (64 x K) and
B (64 x K) in fp16 or bf16, C (64 x 64) in fp32, by one warpgroup. Three variants, each the
smallest kernel that exercises one way the backward would feed wgmma:

- ``plain``: K = 16, both operands in shared memory without swizzle (core matrices of 8 rows
  x 16 bytes, 128 bytes apart in K and 256 bytes apart in rows);
- ``swizzled``: K = 64, both operands in shared memory with the 128-byte swizzle (rows of 128
  bytes, 8-row groups 1024 bytes apart, 16-byte chunk c of row r at c ^ (r & 7)), four k16
  steps, each 32 bytes further into the rows;
- ``registers``: as ``swizzled``, but A from registers in mma.sync's A fragment layout;
- ``transposed``: as ``swizzled``, but C = A @ B for B stored K x 64 (N contiguous,
  "MN-major"), 128-byte swizzled by K-row, each k16 step 16 rows (2048 bytes) further;
- ``wide``: as ``transposed`` with N = 128: B's two 64-wide atoms of N in two swizzled blocks
  8192 bytes apart (the leading offset), C 64 x 128.

Compiled for sm_90a by tests/compile_targets.py; run by tests/test_wgmma.py on a GPU and in the
simulator (where ptx_sm90's Python wgmma reads the same layouts).
"""

import functools

from numba import cuda, float32, types, uint16, uint32

from numflash.kernels import ptx, ptx_sm90
from numflash.kernels.jit import device_function

M = N = 64
THREADS = 128  # one warpgroup
VARIANTS = {"plain": 16, "swizzled": 64, "registers": 64, "transposed": 64, "wide": 64}  # -> K
WIDTH = {"wide": 128}  # N of the variants where it is not 64
MN_MAJOR = ("transposed", "wide")  # B stored K x N
BLOCK_BYTES = 64 * 128  # a swizzled block: 64 rows of 128 bytes


def signature():
    vector = types.Array(types.uint16, 1, "C")
    return types.void(vector, vector, types.Array(types.float32, 1, "C"))


def shared_bytes(variant):
    """Dynamic shared memory: A and B, and 1024 bytes to align the swizzled operands."""
    return (64 + WIDTH.get(variant, N)) * VARIANTS[variant] * 2 + 1024


@device_function
def plain_offset(row, col):
    """Element offset of (row, col) of a 64 x 16 operand without swizzle."""
    return ((row >> 3) * 256 + (col >> 3) * 128) // 2 + (row & 7) * 8 + (col & 7)


@device_function
def swizzled_chunk(row, chunk):
    """Byte offset of 16-byte chunk ``chunk`` (any along a row of 64-value blocks) of ``row``,
    in 128-byte swizzled blocks of 64 rows (rows of 64 values of K for K-major operands, of N
    for MN-major ones)."""
    block, c = chunk >> 3, chunk & 7
    return block * BLOCK_BYTES + (row >> 3) * 1024 + (row & 7) * 128 + ((c ^ (row & 7)) << 4)


@device_function
def swizzled_offset(row, col):
    """Element offset of (row, col) of a 64-row operand with the 128-byte swizzle."""
    return swizzled_chunk(row, col >> 3) // 2 + (col & 7)


@device_function
def zero_accumulators():
    """The 32 fp32 accumulators of a 64 x 64 tile per thread, zero."""
    z = float32(0)
    sixteen = (z, z, z, z, z, z, z, z, z, z, z, z, z, z, z, z)
    return sixteen + sixteen  # (a 32-value literal trips Numba's bytecode peephole)


@device_function
def store_tile(c, acc, tid):
    """A 64 x N fp32 accumulator tile (wgmma's layout, N / 2 values a thread) into ``c``,
    row-major."""
    warp, lane = tid >> 5, tid & 31
    g, t = lane >> 2, lane & 3
    width = 2 * len(acc)
    for i in range(width // 8):
        for r in range(4):
            c[(16 * warp + g + 8 * (r >> 1)) * width + 8 * i + 2 * t + (r & 1)] = acc[4 * i + r]


@functools.lru_cache(maxsize=None)
def build(dtype_name, variant):
    ab = {"float16": "f16", "bfloat16": "bf16"}[dtype_name]
    K = VARIANTS[variant]
    SWIZZLED = variant != "plain"
    REGISTER_A = variant == "registers"
    B_TRANSPOSED = variant in MN_MAJOR
    WIDE = variant == "wide"
    B_ROWS, B_COLS = (K, WIDTH.get(variant, N)) if B_TRANSPOSED else (N, K)
    mma = ptx_sm90.wgmma(
        ab, B_COLS if B_TRANSPOSED else N, a_in_registers=REGISTER_A, b_transposed=B_TRANSPOSED
    )
    offset = swizzled_offset if SWIZZLED else plain_offset
    OPERAND = 64 * K  # values of A
    LEADING, STRIDE = (16, 1024) if SWIZZLED else (128, 256)  # bytes; 16 = unused
    # MN-major B: 8-row groups of K a stride apart, 64-wide atoms of N a leading offset apart
    # (at N = 64 there is one atom and the field is unused)
    B_LEADING = BLOCK_BYTES if B_TRANSPOSED else LEADING
    B_STEP = 2048 if B_TRANSPOSED else 32  # bytes per k16 step
    SWIZZLE = ptx_sm90.SWIZZLE_128B if SWIZZLED else ptx_sm90.SWIZZLE_NONE

    @cuda.jit
    def gemm(a, b, c):
        """a, b: the bits of 64 x K row-major operands (b K x N when MN-major); c: 64 x N
        fp32 out, A B^T (A B when MN-major)."""
        smem = cuda.shared.array(0, uint16)
        tid = cuda.threadIdx.x
        first = ptx_sm90.aligned_index(smem, 1024)
        for i in range(OPERAND // THREADS):  # A's values
            e = tid + i * THREADS
            smem[first + offset(e // K, e & (K - 1))] = a[e]
        for i in range(B_ROWS * B_COLS // THREADS):  # B's
            e = tid + i * THREADS
            smem[first + OPERAND + offset(e // B_COLS, e & (B_COLS - 1))] = b[e]
        ptx_sm90.fence_proxy_async()
        cuda.syncthreads()
        base = ptx.shared_address(smem, first)
        acc = zero_accumulators() + zero_accumulators() if WIDE else zero_accumulators()
        ptx_sm90.wgmma_fence()
        for s in range(K // 16):
            step = s * 32  # bytes into each swizzled row (the plain operand has one step)
            desc_b = ptx_sm90.matrix_descriptor(
                base + 2 * OPERAND + s * B_STEP, B_LEADING, STRIDE, SWIZZLE
            )
            if REGISTER_A:  # warp w's rows 16w.. as mma.sync's A fragment
                lane = tid & 31
                at = (16 * (tid >> 5) + (lane >> 2)) * K + 16 * s + 2 * (lane & 3)
                frag = (
                    uint32(a[at]) | (uint32(a[at + 1]) << 16),
                    uint32(a[at + 8 * K]) | (uint32(a[at + 8 * K + 1]) << 16),
                    uint32(a[at + 8]) | (uint32(a[at + 9]) << 16),
                    uint32(a[at + 8 * K + 8]) | (uint32(a[at + 8 * K + 9]) << 16),
                )
                acc = mma(acc, frag, desc_b)
            else:
                desc_a = ptx_sm90.matrix_descriptor(base + step, LEADING, STRIDE, SWIZZLE)
                acc = mma(acc, desc_a, desc_b)
        ptx_sm90.wgmma_commit()
        ptx_sm90.wgmma_wait(0)
        store_tile(c, acc, tid)

    return gemm


# -- two products chained, as the backward's dV += P^T dO would run -----------------------------

CHAIN_K = 128  # head_dim: two 64-value (128-byte) swizzle blocks along K
CHAIN_A, CHAIN_B, CHAIN_D = 0, 2 * BLOCK_BYTES, 4 * BLOCK_BYTES  # byte offsets


def chain_shared_bytes():
    return 5 * BLOCK_BYTES + 1024


@functools.lru_cache(maxsize=None)
def build_chain(dtype_name):
    """C (64 x 64 fp32) = round(A B^T) D for A, B (64 x 128) and D (64 x 64, row-major), all
    16-bit: A, B and D loaded by cp.async into 128-byte swizzled shared memory; S = A B^T by
    eight k16 steps across the two 64-value blocks of K; S rounded to 16 bits in registers and
    used as the register A operand of the second product, D the MN-major B operand."""
    ab = {"float16": "f16", "bfloat16": "bf16"}[dtype_name]
    scores = ptx_sm90.wgmma(ab, N)
    product = ptx_sm90.wgmma(ab, N, a_in_registers=True, b_transposed=True)
    pack = ptx.pack_f16x2 if ab == "f16" else ptx.pack_bf16x2
    SW = ptx_sm90.SWIZZLE_128B

    @cuda.jit
    def chain(a, b, d, c):
        smem = cuda.shared.array(0, uint16)
        tid = cuda.threadIdx.x
        base = ptx.shared_address(smem, ptx_sm90.aligned_index(smem, 1024))
        for i in range(2 * 64 * 16 // THREADS):  # A's and B's 16-byte chunks, 16 a row
            e = tid + i * THREADS
            row, chunk = (e & 1023) >> 4, e & 15
            src = row * 128 + chunk * 8
            at = swizzled_chunk(row, chunk)
            if e < 1024:
                ptx.cp_async_16(base + uint32(CHAIN_A + at), a, src, uint32(16))
            else:
                ptx.cp_async_16(base + uint32(CHAIN_B + at), b, src, uint32(16))
        for i in range(64 * 8 // THREADS):  # D's chunks, 8 a row
            e = tid + i * THREADS
            row, chunk = e >> 3, e & 7
            src = row * 64 + chunk * 8
            ptx.cp_async_16(base + uint32(CHAIN_D + swizzled_chunk(row, chunk)), d, src, uint32(16))
        ptx.cp_async_commit()
        ptx.cp_async_wait(0)
        ptx_sm90.fence_proxy_async()
        cuda.syncthreads()
        s = zero_accumulators()
        ptx_sm90.wgmma_fence()
        for step in range(CHAIN_K // 16):
            at = (step >> 2) * BLOCK_BYTES + (step & 3) * 32
            desc_a = ptx_sm90.matrix_descriptor(base + CHAIN_A + at, 16, 1024, SW)
            desc_b = ptx_sm90.matrix_descriptor(base + CHAIN_B + at, 16, 1024, SW)
            s = scores(s, desc_a, desc_b)
        ptx_sm90.wgmma_commit()
        ptx_sm90.wgmma_wait(0)
        out = zero_accumulators()
        ptx_sm90.wgmma_fence()  # the A fragments below are written by ordinary instructions
        for j in range(4):  # S's columns 16j..16j+15 are the k16 step j of the second product
            frag = (
                pack(s[8 * j], s[8 * j + 1]),
                pack(s[8 * j + 2], s[8 * j + 3]),
                pack(s[8 * j + 4], s[8 * j + 5]),
                pack(s[8 * j + 6], s[8 * j + 7]),
            )
            desc_d = ptx_sm90.matrix_descriptor(base + CHAIN_D + j * 2048, 1024, 1024, SW)
            out = product(out, frag, desc_d)
        ptx_sm90.wgmma_commit()
        ptx_sm90.wgmma_wait(0)
        store_tile(c, out, tid)

    return chain


def chain_signature():
    vector = types.Array(types.uint16, 1, "C")
    return types.void(vector, vector, vector, types.Array(types.float32, 1, "C"))
