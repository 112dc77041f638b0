"""Tensor-core attention backward (FlashAttention-2's dK/dV kernel) on mma.sync and ldmatrix.

One thread block per (block of BLOCK_N keys, kv head, batch); each warp owns 16 key rows and
keeps their dK and dV accumulators (fp32) in registers while blocks of BLOCK_M query rows (q, dO,
their log2-domain LSE and D = rowsum(dO * O)) stream through shared memory, for every query head
of the GQA group in turn. Per query block, with the key rows as the M side of every mma:

    S^T  = K Q^T,  dP^T = V dO^T                  ldmatrix (K, V: A; Q, dO: B), fp32 accumulators
    P^T  = exp2(S^T * scale * log2(e) - lse_log2[query]),  0 where the mask hides the pair
    dS^T = P^T * (dP^T - D[query])
    dV  += P^T dO,  dK += dS^T Q                  P^T and dS^T packed to 16 bits in registers:
                                                  their accumulator layout is the A layout
    dQ  += dS K                                   dS^T through shared memory (stored as dS),
                                                  fp32 atomics into a (batch, seqlen_q, heads,
                                                  head_dim) buffer, scaled and rounded after

Q, dO, LSE and D of the next query block load (cp.async; LSE and D into registers) while the
current one is computed, with ``stages=2``. The warps share each block's dQ += dS K by 16-row
tiles, split by columns when there are more warps than tiles.

With ``dq_separate=True`` the dK/dV kernel leaves dQ alone and a second kernel computes it:
one block per 16 * NUM_WARPS query rows (16 per warp) with Q and dO resident and tiles of
BLOCK_M keys and values streaming, S = Q K^T and dP = dO V^T recomputed, dS = P (dP - D), and
dQ += dS K summed in registers by one thread per element in key order: deterministic, no
atomics, at the cost of computing S and dP twice.

numflash.attention_backward takes the separate dQ kernel by default for fp16/bf16: on the H200
it was faster than the atomics (benchmarks/NOTES.md), and its gradients are bitwise
reproducible. The atomic version (``dq_separate=False``) sums in an order that varies between
runs, so ``deterministic=True`` refuses it.

With ``head_split=2`` two blocks share each key block (and each query block of the dQ kernel),
each accumulating half of the output columns; both compute the scores over the whole head_dim.
That is how head_dim 256 fits: its dK and dV accumulators would need 256 registers a thread.

Supports: float16 and bfloat16; head_dim a multiple of 16 * head_split up to 128 * head_split
(the API zero-pads others); GQA; causal and window masks bottom-right; any seqlen_q and
seqlen_k.
"""

import functools
from typing import NamedTuple

from numba import cuda, float32, int32, int64, uint16, uint32

from . import ptx
from .backward_portable import _row_log2_lse, block_query_range
from .jit import device_function, kernel
from .softmax import block_key_range, visible_keys

_MMA = {"float16": ptx.mma_f16, "bfloat16": ptx.mma_bf16}
#: Global indices are ANDed with this before use. Numba wraps negative indices around as Python
#: does (cuda.atomic.add always), about eight integer instructions per access; with the sign bit
#: known to be clear the compiler drops that code, and the AND itself vanishes into the address
#: arithmetic (the index is scaled past bit 63). Indices here are never negative.
NON_NEGATIVE = (1 << 63) - 1
_PACK = {"float16": ptx.pack_f16x2, "bfloat16": ptx.pack_bf16x2}


def shared_memory_layout(head_dim, block_m, block_n, stages, with_ds=True):
    """(row pitch, offsets of K, V, the Q/dO stages, one stage's size, dS, dS row pitch, total),
    in 16-bit elements. Stage s holds Q at Q_BASE + s * STAGE and dO at + block_m rows. The dQ
    kernel uses the same layout with the roles swapped (Q, dO resident; K, V tiles streaming)
    and no dS (``with_ds=False``, as the dK/dV kernel when it leaves dQ to it)."""
    row = head_dim + 8  # +16 bytes per row: the 8 rows an ldmatrix reads hit different banks
    ds_row = block_n + 8
    k_base = 0
    v_base = k_base + block_n * row
    q_base = v_base + block_n * row
    stage = 2 * block_m * row
    ds_base = q_base + stages * stage
    return (row, k_base, v_base, q_base, stage, ds_base, ds_row,
            ds_base + (block_m * ds_row if with_ds else 0))  # fmt: skip


def dq_split(head_dim, block_m, num_warps):
    """How the warps share dQ += dS K of a query block: (column pieces per 16-row tile, 8-column
    tiles per piece, pieces per warp), or None where the warps cannot split it evenly."""
    row_tiles = block_m // 16
    pieces = max(1, num_warps // row_tiles)
    d_tiles = head_dim // 8
    if (row_tiles * pieces) % num_warps or d_tiles % pieces or (d_tiles // pieces) % 2:
        return None
    return pieces, d_tiles // pieces, row_tiles * pieces // num_warps


@device_function
def visible_queries(key, m0, lane, seqlen_q, seqlen_k, wl, wr):
    """The query columns [lo, hi) of the block that key row ``key`` sees, relative to this
    lane's first column (so each element's test compares with a constant); empty for a
    padding row past the last key."""
    lo, hi = block_query_range(key, key, seqlen_q, seqlen_k, wl, wr)
    if key >= seqlen_k:
        hi = lo
    first = m0 + (lane & 3) * 2
    return int32(lo - first), int32(hi - first)


@device_function
def p_and_ds(s, dp, neg_lse, d, scale_log2):
    """(P, dS = P (dP - D)) of one element, P = exp2(S * scale * log2(e) - lse)."""
    p = ptx.exp2(ptx.fma(s, scale_log2, neg_lse))
    return p, p * (dp - d)


@functools.lru_cache(maxsize=None)
def probabilities_function(q_tiles):
    """The device function ``probabilities_and_ds`` over ``q_tiles`` 8-query tiles of S^T in
    the accumulator layout that mma.sync's C fragments and wgmma's m64 accumulators share."""
    Q_TILES = q_tiles

    @device_function
    def probabilities_and_ds(st, dpt, lse_tile, d_tile, stats, key0, m0, lane, seqlen_q,
                             seqlen_k, scale_log2, wl, wr):  # fmt: skip
        """st <- P^T and dpt <- dS^T = P^T (dP^T - D) for this lane's key rows key0 and
        key0 + 8 (elements 0-1 and 2-3 of every query tile); 0 where the pair is masked.

        No branch per element: every element is computed and masked ones are selected away,
        and each query's LSE and D are read once for both key rows (``stats`` is the block's
        offset in the shared tiles). Per element branches cost a reconvergence barrier and a
        serial shared-load -> ex2 chain each."""
        first = uint32(stats + (lane & 3) * 2)  # this lane's first query in the tiles
        lo0, hi0 = visible_queries(key0, m0, lane, seqlen_q, seqlen_k, wl, wr)
        lo1, hi1 = visible_queries(key0 + 8, m0, lane, seqlen_q, seqlen_k, wl, wr)
        for qt in range(Q_TILES):
            for e in range(2):
                col = qt * 8 + e
                neg_lse = -lse_tile[first + uint32(col)]
                d = d_tile[first + uint32(col)]
                i = qt * 4 + e  # key row key0
                p, ds = p_and_ds(st[i], dpt[i], neg_lse, d, scale_log2)
                seen = (lo0 <= int32(col)) & (int32(col) < hi0)
                st[i] = p if seen else float32(0.0)
                dpt[i] = ds if seen else float32(0.0)
                i += 2  # key row key0 + 8
                p, ds = p_and_ds(st[i], dpt[i], neg_lse, d, scale_log2)
                seen = (lo1 <= int32(col)) & (int32(col) < hi1)
                st[i] = p if seen else float32(0.0)
                dpt[i] = ds if seen else float32(0.0)

    return probabilities_and_ds


@device_function
def _floor_quotient(a, b):
    return a // b


@functools.lru_cache(maxsize=None)
def block_position_function(block_n, head_split, part, heavy_group, quotient=None):
    """The device function ``block_position`` of kernels whose blocks own ``block_n`` rows
    (keys or queries) and ``part`` output columns, ``head_split`` blocks per block of rows,
    in ``heavy_group``'s order under one-sided masks (build_kernels). ``quotient(a, b)``
    divides by the grid's sizes (None: Python's ``//`` on Numba's 64-bit integers)."""
    BLOCK_N, HEAD_SPLIT, PART, HEAVY_GROUP = block_n, head_split, part, heavy_group
    divide = quotient or _floor_quotient

    @device_function
    def block_position(one_sided, reverse):
        """(thread, lane, warp, the first of the block's BLOCK_N rows (keys in the dK/dV
        kernel, queries in the dQ kernel), its first output column, its head (kv head in the
        dK/dV kernel), its batch).

        The grid is (HEAD_SPLIT blocks per block of rows, heads, batch), and blocks start in
        the order of their linear index, x fastest. Under a ``one_sided`` mask that index is
        read in HEAVY_GROUP's order (build_kernels), the last rows taken as the heaviest if
        ``reverse``, else the first."""
        tid = cuda.threadIdx.x
        row_blocks = cuda.gridDim.x // HEAD_SPLIT
        column_part = (cuda.blockIdx.x % HEAD_SPLIT) * PART
        rows = cuda.blockIdx.x // HEAD_SPLIT
        head = cuda.blockIdx.y
        batch = cuda.blockIdx.z
        if one_sided and HEAVY_GROUP > 1:  # (with 1 group per pair, the grid's own order)
            linear = cuda.blockIdx.x + cuda.gridDim.x * (head + cuda.gridDim.y * batch)
            index = linear // HEAD_SPLIT
            group = divide(index, row_blocks * HEAVY_GROUP)
            size = min(HEAVY_GROUP, cuda.gridDim.y * cuda.gridDim.z - group * HEAVY_GROUP)
            local = index - group * row_blocks * HEAVY_GROUP
            rows = divide(local, size)
            pair = group * HEAVY_GROUP + local - rows * size
            batch = divide(pair, cuda.gridDim.y)
            head = pair - batch * cuda.gridDim.y
        if one_sided and HEAVY_GROUP > 0 and reverse:
            rows = row_blocks - 1 - rows
        return tid, tid & 31, tid >> 5, rows * BLOCK_N, column_part, head, batch

    return block_position


def stat_loads(block_m, threads):
    """LSE and D values each thread fetches per query block."""
    return (block_m + threads - 1) // threads


@functools.lru_cache(maxsize=None)
def row_stats_functions(block_m, threads):
    """(fetch_row_stats, store_row_stats): the LSE and D of ``block_m`` query rows, fetched by
    ``threads`` threads into registers (STAT_LOADS a thread) and stored into shared tiles."""
    BLOCK_M, THREADS = block_m, threads
    STAT_LOADS = stat_loads(block_m, threads)

    @device_function
    def fetch_row_stats(lse_r, d_r, lse, delta, row_base, m0, seqlen_q, tid):
        """Start loading the raw LSE and D of query rows m0.. into registers (0 past the end).
        Nothing here uses the values, so the loads stay in flight while the block computes."""
        for j in range(STAT_LOADS):
            row = m0 + tid + j * THREADS
            if tid + j * THREADS < BLOCK_M and row < seqlen_q:
                at = (row_base + row) & NON_NEGATIVE
                lse_r[j] = lse[at]
                d_r[j] = delta[at]
            else:  # past the end: every pair with this row is masked
                lse_r[j] = float32(0.0)
                d_r[j] = float32(0.0)

    @device_function
    def store_row_stats(lse_tile, d_tile, lse_r, d_r, stage, tid):
        """The fetched LSE (in the log2 domain) and D into shared stage ``stage``."""
        for j in range(STAT_LOADS):
            r = tid + j * THREADS
            if r < BLOCK_M:
                lse_tile[stage * BLOCK_M + r] = _row_log2_lse(lse_r[j])
                d_tile[stage * BLOCK_M + r] = d_r[j]

    return fetch_row_stats, store_row_stats


@functools.lru_cache(maxsize=None)
def row_writer(part, dtype_name):
    """The device function ``write_rows`` of 16-row accumulator tiles ``part`` columns wide
    (mma.sync's C layout, which wgmma's m64 accumulators repeat per warp)."""
    D_TILES = part // 8
    pack = _PACK[dtype_name]

    @device_function
    def write_rows(out, acc, base, stride, row0, lane, rows, factor):
        """acc * factor (16 rows x ``part``) to ``out``'s rows row0.. below ``rows``, from element
        ``base`` of each (the block's first column)."""
        for h in range(2):
            row = row0 + (lane >> 2) + 8 * h
            if row < rows:
                at = base + int64(row) * stride
                for dt in range(D_TILES):
                    col = dt * 8 + (lane & 3) * 2
                    i = dt * 4 + 2 * h
                    pair = pack(acc[i] * factor, acc[i + 1] * factor)
                    out[(at + col) & NON_NEGATIVE] = uint16(pair & uint32(0xFFFF))
                    out[(at + col + 1) & NON_NEGATIVE] = uint16(pair >> uint32(16))

    return write_rows


@device_function
def row_stats(lse, delta, row_base, row, first_col, seqlen_q, seqlen_k, wl, wr):
    """(log2-domain LSE, D, first and end visible key relative to ``first_col``) of query
    ``row``; an empty range for a row past the end."""
    if row < seqlen_q:
        at = (row_base + row) & NON_NEGATIVE
        lo, hi = visible_keys(row, seqlen_q, seqlen_k, wl, wr)
        return (_row_log2_lse(lse[at]), delta[at], int32(lo - first_col),
                int32(hi - first_col))  # fmt: skip
    return float32(0.0), float32(0.0), int32(0), int32(0)


@device_function
def lane_row_stats(lse, delta, batch, head, warp_row, lane, n_lo, seqlen_q, seqlen_k, wl, wr):
    """row_stats of this lane's two query rows, warp_row + lane // 4 and 8 rows below, their
    visible keys relative to the lane's first column of a key range starting at ``n_lo``:
    (lse_0, d_0, lo_0, hi_0, lse_1, d_1, lo_1, hi_1)."""
    row0 = warp_row + (lane >> 2)
    row_base = (int64(batch) * cuda.gridDim.y + head) * seqlen_q
    first_col = n_lo + (lane & 3) * 2
    return (row_stats(lse, delta, row_base, row0, first_col, seqlen_q, seqlen_k, wl, wr)
            + row_stats(lse, delta, row_base, row0 + 8, first_col, seqlen_q, seqlen_k, wl, wr))


@functools.lru_cache(maxsize=None)
def row_ds_function(key_tiles):
    """The device function ``row_ds`` over ``key_tiles`` 8-key tiles of S (query rows in the
    accumulator layout that mma.sync's C fragments and wgmma's m64 accumulators share)."""
    Q_TILES = key_tiles

    @device_function
    def row_ds(dp, s, lse_0, lse_1, d_0, d_1, lo_0, hi_0, lo_1, hi_1, scale_log2):
        """dp <- dS = P (dP - D) for this lane's query rows (elements 0-1: the first, 2-3: the
        second, of every key tile); 0 where masked. lo/hi: the visible keys relative to this
        lane's first column. No branch per element (see probabilities_and_ds)."""
        for qt in range(Q_TILES):
            for e in range(4):
                i = qt * 4 + e
                col = qt * 8 + (e & 1)
                second = e >= 2
                _, ds = p_and_ds(s[i], dp[i], -(lse_1 if second else lse_0),
                                 d_1 if second else d_0, scale_log2)  # fmt: skip
                lo = lo_1 if second else lo_0
                hi = hi_1 if second else hi_0
                dp[i] = ds if (lo <= int32(col)) & (int32(col) < hi) else float32(0.0)

    return row_ds


def query_block_loader(load_pair, fetch_row_stats):
    """The dK/dV kernels' device function ``load_query_block``, from their own ``load_pair``
    (cp.async of BLOCK_M rows of two arrays into a stage, one commit group) and
    ``fetch_row_stats``."""

    @device_function
    def load_query_block(stage_addr, q, do, lse, delta, lse_r, d_r, batch, head, m0, q_sb, q_ss,
                         q_sh, do_sb, do_ss, do_sh, nheads, seqlen_q, tid):  # fmt: skip
        """Start loading query rows m0.. of query head ``head``: their Q and dO into the stage
        at ``stage_addr``, their LSE and D into registers (lse_r, d_r)."""
        load_pair(stage_addr, q, do, batch * q_sb + head * q_sh + int64(m0) * q_ss, q_ss,
                  batch * do_sb + head * do_sh + int64(m0) * do_ss, do_ss, seqlen_q - m0, tid)
        fetch_row_stats(lse_r, d_r, lse, delta, (int64(batch) * nheads + head) * seqlen_q, m0,
                        seqlen_q, tid)  # fmt: skip

    return load_query_block


@device_function
def next_query_block(head, m0, m_lo, m_hi, block_m):
    """The (query head, first row) of the query block after rows m0.. of ``head``: the next
    block of rows in [m_lo, m_hi), else the first of the next head of the GQA group."""
    m0 += block_m
    if m0 >= m_hi:
        return head + 1, m_lo
    return head, m0


class Kernels(NamedTuple):
    dkdv: object  # dK and dV; with dq_separate=False also dQ, by atomics
    dq: object  # dQ alone, in a fixed order (dq_separate=True), else None


def build(head_dim, dtype_name, block_m, num_warps, stages, dq_separate=False, head_split=1):
    """The dK/dV kernel (accumulating dQ by atomics unless ``dq_separate``)."""
    return build_kernels(head_dim, dtype_name, block_m, num_warps, stages, dq_separate,
                         head_split).dkdv  # fmt: skip


def build_dq(head_dim, dtype_name, block_m, num_warps, stages, head_split=1):
    """The separate dQ kernel: one block per 16 * num_warps query rows, block_m keys a tile."""
    return build_kernels(head_dim, dtype_name, block_m, num_warps, stages, True, head_split).dq


@functools.lru_cache(maxsize=None)
def build_kernels(head_dim, dtype_name, block_m, num_warps, stages, dq_separate, head_split=1,
                  *, heavy_group=None):  # fmt: skip
    """Both kernels of one configuration, sharing their device functions; all sizes are
    compile-time. Numba compiles each only when it is first launched.

    ``heavy_group``: under a mask bounded on one side only, where the blocks' work differs
    (causal: the dK/dV kernel's first keys and the dQ kernel's last query rows see the most),
    the blocks start heaviest first, so that short ones fill the last wave. With G > 0, groups
    of G (head, batch) pairs run one after the other, and within a group the blocks of rows
    run heaviest first across the group's pairs. G = 1 orders each pair's rows; a larger G
    keeps the heaviest blocks further from the end, at the price of G pairs' inputs in L2 at
    once; 0 keeps the grid's order. The library's G = 8 was the fastest or within noise of it
    on the H200 (2026-11-30, ``benchmarks/backward_variants.py --kernel-variants``, head_dim
    128, fp16 and bf16, 32k tokens x 2048): causal 4096, dK/dV 3.92 and dQ 2.98 ms against
    4.01 and 3.13 at G = 1; causal 16384, dQ 10.86-11.10 against 11.15-11.22. G = 16 and 32
    were no faster. Without a mask the order does not change, yet the G = 8 build measured
    1-3% faster there too (non-causal 4096: dK/dV 7.32-7.38 against 7.45 ms, dQ 5.65-5.69
    against 5.84), unexplained: the dQ kernel's loop is the same length at G = 1 and 8
    (benchmarks/NOTES.md). None, the default, is 8 with ``dq_separate`` and 1 without: the
    dK/dV kernel with atomic dQ spills 60 bytes at G = 8 (64 x 128 tiles, head_dim 128, 255
    registers; none at G = 1) and ran 1.6% slower (13.62 against 13.40 ms, non-causal 4096).

    ``head_split`` blocks share each key block (dK/dV kernel) or query block (dQ kernel), each
    accumulating one slice of head_dim / head_split output columns; every one computes the
    scores over the whole head_dim. That keeps the accumulators of head_dim 256 in registers
    (and halves them at 128, for more warps per SM, at the price of the scores twice)."""
    HEAD_DIM = head_dim  # a multiple of 16 * head_split
    BLOCK_M, NUM_WARPS, STAGES = block_m, num_warps, stages
    HEAD_SPLIT = head_split
    HEAVY_GROUP = heavy_group if heavy_group is not None else (8 if dq_separate else 1)
    PART = HEAD_DIM // HEAD_SPLIT  # output columns per block
    DQ_ATOMIC = not dq_separate
    BLOCK_N = 16 * NUM_WARPS  # one 16-row tile of keys per warp
    THREADS = 32 * NUM_WARPS
    Q_TILES = BLOCK_M // 8  # 8-query column tiles of S^T
    K_STEPS = HEAD_DIM // 16  # k16 steps of S^T = K Q^T
    D_TILES = PART // 8  # 8-column tiles of a block's dK and dV (or dQ)
    M_STEPS = BLOCK_M // 16  # k16 steps of dV += P^T dO
    N_STEPS = BLOCK_N // 16  # k16 steps of dQ += dS K
    # dQ's share of each warp in the dK/dV kernel (atomic dQ only)
    DQ_PIECES, DQ_TILES, DQ_UNITS = dq_split(PART, BLOCK_M, NUM_WARPS) or (1, 2, 0)
    ROW, K_BASE, V_BASE, Q_BASE, STAGE, DS_BASE, DS_ROW, _ = shared_memory_layout(
        head_dim, block_m, BLOCK_N, stages, with_ds=DQ_ATOMIC
    )
    DO_OFFSET = BLOCK_M * ROW  # dO after Q within a stage
    CHUNKS = HEAD_DIM // 8  # 16-byte chunks per row
    ROWS_PER_PASS = THREADS // CHUNKS
    STAT_LOADS = stat_loads(BLOCK_M, THREADS)  # LSE and D values per thread per block
    STAT_TILE = STAGES * BLOCK_M  # LSE and D of every stage
    S_REGS = Q_TILES * 4
    ACC_REGS = D_TILES * 4
    DQ_REGS = DQ_TILES * 4
    mma = _MMA[dtype_name]
    pack = _PACK[dtype_name]
    block_position = block_position_function(BLOCK_N, HEAD_SPLIT, PART, HEAVY_GROUP)
    probabilities_and_ds = probabilities_function(Q_TILES)
    fetch_row_stats, store_row_stats = row_stats_functions(BLOCK_M, THREADS)
    write_rows = row_writer(PART, dtype_name)
    row_ds = row_ds_function(Q_TILES)

    @device_function
    def load_rows(dst, src, first, stride, rows_left, nrows, tid):
        """cp.async ``nrows`` rows of ``src`` from element ``first`` (row pitch ``stride``) to
        shared address ``dst``; rows at or past ``rows_left`` are zero-filled, not read."""
        r = tid // CHUNKS
        col = (tid - r * CHUNKS) * 8
        if r < ROWS_PER_PASS:
            dst += uint32((r * ROW + col) * 2)
            offset = first + int64(r) * stride + col
            for p in range((nrows + ROWS_PER_PASS - 1) // ROWS_PER_PASS):
                row = r + p * ROWS_PER_PASS
                if row < nrows:
                    valid = row < rows_left
                    ptx.cp_async_16(dst + uint32(p * ROWS_PER_PASS * ROW * 2), src,
                                    offset if valid else first,
                                    uint32(16) if valid else uint32(0))  # fmt: skip
                offset += ROWS_PER_PASS * stride

    @device_function
    def load_block_pair(stage_addr, a, b, a_first, a_ss, b_first, b_ss, rows_left, tid):
        """cp.async BLOCK_M rows of two arrays (Q and dO, or K and V) into a stage, as one
        commit group."""
        load_rows(stage_addr, a, a_first, a_ss, rows_left, BLOCK_M, tid)
        load_rows(stage_addr + uint32(DO_OFFSET * 2), b, b_first, b_ss, rows_left, BLOCK_M, tid)
        ptx.cp_async_commit()

    load_query_block = query_block_loader(load_block_pair, fetch_row_stats)

    @device_function
    def mma_pair(acc, c, a0, a1, a2, a3, b0, b1, b2, b3):
        """acc[c..c+3] += A B0 and acc[c+4..c+7] += A B1: two adjacent 8-column tiles."""
        acc[c], acc[c + 1], acc[c + 2], acc[c + 3] = mma(
            a0, a1, a2, a3, b0, b1, acc[c], acc[c + 1], acc[c + 2], acc[c + 3])
        acc[c + 4], acc[c + 5], acc[c + 6], acc[c + 7] = mma(
            a0, a1, a2, a3, b2, b3, acc[c + 4], acc[c + 5], acc[c + 6], acc[c + 7])

    @device_function
    def mma_rows_by_queries(acc, a_addr, b_addr):
        """acc (16 key rows x BLOCK_M queries) = A (16 x HEAD_DIM, rows of K or V) times the
        transpose of B (BLOCK_M x HEAD_DIM, rows of Q or dO)."""
        for i in range(S_REGS):
            acc[i] = float32(0.0)
        for kk in range(K_STEPS):
            a0, a1, a2, a3 = ptx.ldmatrix_x4(a_addr, kk * 16 * 2)
            for qp in range(Q_TILES // 2):
                b0, b1, b2, b3 = ptx.ldmatrix_x4(b_addr, (qp * 16 * ROW + kk * 16) * 2)
                mma_pair(acc, qp * 8, a0, a1, a2, a3, b0, b1, b2, b3)

    @device_function
    def mma_accumulate(acc, frag, b_addr):
        """acc (16 key rows x PART) += F (16 x BLOCK_M, in ``frag``'s accumulator layout) times
        B (BLOCK_M x PART, from rows of dO or Q, read transposed by ldmatrix; ``b_addr`` points
        at the block's first column)."""
        for kk in range(M_STEPS):
            c = kk * 8  # accumulator tiles 2kk, 2kk+1 are the A fragment of k-step kk
            f0 = pack(frag[c], frag[c + 1])
            f1 = pack(frag[c + 2], frag[c + 3])
            f2 = pack(frag[c + 4], frag[c + 5])
            f3 = pack(frag[c + 6], frag[c + 7])
            for dp in range(D_TILES // 2):
                b0, b1, b2, b3 = ptx.ldmatrix_x4_trans(b_addr, (kk * 16 * ROW + dp * 16) * 2)
                mma_pair(acc, dp * 8, f0, f1, f2, f3, b0, b1, b2, b3)

    @device_function
    def query_block_step(st, dpt, dk_acc, dv_acc, k_rows, v_rows, q_stage, do_stage, b_lane,
                         out_lane, lse_tile, d_tile, stats, key0, m0, lane, seqlen_q, seqlen_k,
                         scale_log2, wl, wr):  # fmt: skip
        """One warp's work on one query block in the dK/dV kernel. Straight-line code, so
        that the compiler overlaps the P/dS arithmetic with the mma on either side: copies
        without the mask tests for tiles seen whole, behind a warp-uniform branch, measured
        2-4% slower on the H200 although 11-13% shorter (benchmarks/NOTES.md)."""
        # -- S^T = K Q^T and dP^T = V dO^T for this warp's 16 keys
        mma_rows_by_queries(st, k_rows, q_stage + b_lane)
        mma_rows_by_queries(dpt, v_rows, do_stage + b_lane)
        # -- P^T and dS^T, masked pairs 0
        probabilities_and_ds(st, dpt, lse_tile, d_tile, stats, key0, m0, lane, seqlen_q,
                             seqlen_k, scale_log2, wl, wr)  # fmt: skip
        # -- dV += P^T dO, dK += dS^T Q
        mma_accumulate(dv_acc, st, do_stage + out_lane)
        mma_accumulate(dk_acc, dpt, q_stage + out_lane)

    @device_function
    def store_ds(smem, dpt, warp, lane):
        """dS^T of this warp's key rows into shared memory as dS: row = query, column = key.
        One base index per lane; every store's offset from it is a compile-time constant.
        Each key row's two adjacent queries are rounded by one paired cvt (a bf16 rounding
        of its own costs about eight integer instructions)."""
        base = uint32(DS_BASE + (lane & 3) * 2 * DS_ROW + warp * 16 + (lane >> 2))
        for qt in range(Q_TILES):
            for h in range(2):  # key rows key0 and key0 + 8
                i = qt * 4 + 2 * h
                pair = pack(dpt[i], dpt[i + 1])  # queries col, col + 1
                offset = qt * 8 * DS_ROW + 8 * h
                smem[base + uint32(offset)] = uint16(pair & uint32(0xFFFF))
                smem[base + uint32(offset + DS_ROW)] = uint16(pair >> uint32(16))

    @device_function
    def accumulate_dq(dqa, ds_addr, k_addr, col0, dq_acc, dq_base, dq_ss, q_row0, seqlen_q,
                      lane):  # fmt: skip
        """dQ rows q_row0.. (16 of them), columns col0.. (DQ_TILES * 8 of them) += dS K, added
        atomically to the fp32 buffer."""
        for i in range(DQ_REGS):
            dqa[i] = float32(0.0)
        for kk in range(N_STEPS):
            a0, a1, a2, a3 = ptx.ldmatrix_x4(ds_addr, kk * 16 * 2)
            for dp in range(DQ_TILES // 2):
                b0, b1, b2, b3 = ptx.ldmatrix_x4_trans(k_addr, (kk * 16 * ROW + col0 + dp * 16) * 2)
                mma_pair(dqa, dp * 8, a0, a1, a2, a3, b0, b1, b2, b3)
        for h in range(2):
            row = q_row0 + (lane >> 2) + 8 * h
            if row < seqlen_q:
                base = dq_base + int64(row) * dq_ss + col0 + (lane & 3) * 2
                for dt in range(DQ_TILES):
                    at = (base + dt * 8) & NON_NEGATIVE
                    cuda.atomic.add(dq_acc, at, dqa[dt * 4 + 2 * h])
                    at = (base + dt * 8 + 1) & NON_NEGATIVE
                    cuda.atomic.add(dq_acc, at, dqa[dt * 4 + 2 * h + 1])

    @kernel(launch_bounds=THREADS)
    def dkdv(
        q, k, v, do, lse, delta, dk, dv, dq_acc,
        q_sb, q_ss, q_sh, k_sb, k_ss, k_sh, v_sb, v_ss, v_sh, do_sb, do_ss, do_sh,
        dk_sb, dk_ss, dk_sh, dv_sb, dv_ss, dv_sh, dq_sb, dq_ss, dq_sh,
        seqlen_q, seqlen_k, heads_per_kv, scale, window_left, window_right,
    ):  # fmt: skip
        smem = cuda.shared.array(0, uint16)
        lse_tile = cuda.shared.array(STAT_TILE, float32)
        d_tile = cuda.shared.array(STAT_TILE, float32)
        st = cuda.local.array(S_REGS, float32)
        dpt = cuda.local.array(S_REGS, float32)
        dk_acc = cuda.local.array(ACC_REGS, float32)
        dv_acc = cuda.local.array(ACC_REGS, float32)
        dqa = cuda.local.array(DQ_REGS, float32)
        lse_r = cuda.local.array(STAT_LOADS, float32)
        d_r = cuda.local.array(STAT_LOADS, float32)

        # n0: the block's first key. The first keys are seen by the most queries under a causal
        # mask, the last ones under a left window alone.
        tid, lane, warp, n0, col_base, kv_head, batch = block_position(
            (window_left < 0) != (window_right < 0), window_right < 0)
        last_key = min(n0 + BLOCK_N, seqlen_k) - 1
        m_lo, m_hi = block_query_range(n0, last_key, seqlen_q, seqlen_k, window_left,
                                       window_right)  # fmt: skip
        scale_log2 = scale * float32(1.4426950408889634)
        # The query blocks this key block sees, for every query head of the GQA group in turn.
        blocks_per_head = (m_hi - m_lo + BLOCK_M - 1) // BLOCK_M if m_hi > m_lo else 0
        n_blocks = heads_per_kv * blocks_per_head
        nheads = cuda.gridDim.y * heads_per_kv

        # -- K and V of this block stay in shared memory for the whole kernel
        smem_addr = ptx.shared_address(smem, 0)
        k_first = batch * k_sb + kv_head * k_sh + int64(n0) * k_ss
        v_first = batch * v_sb + kv_head * v_sh + int64(n0) * v_ss
        load_rows(smem_addr + uint32(K_BASE * 2), k, k_first, k_ss, seqlen_k - n0, BLOCK_N, tid)
        load_rows(smem_addr + uint32(V_BASE * 2), v, v_first, v_ss, seqlen_k - n0, BLOCK_N, tid)
        ptx.cp_async_commit()

        # ldmatrix lane addresses: A fragments of 16 rows (a warp's keys, or a dQ row tile) and
        # B fragments of pairs of 8-row tiles (non-transposed) or of k16 x 16 blocks (.trans).
        a_lane = uint32(((lane & 15) * ROW + (lane >> 4) * 8) * 2)
        b_lane = uint32((((lane & 7) + ((lane >> 4) << 3)) * ROW + ((lane >> 3) & 1) * 8) * 2)
        ds_lane = uint32(((lane & 15) * DS_ROW + (lane >> 4) * 8) * 2)
        k_rows = smem_addr + uint32((K_BASE + warp * 16 * ROW) * 2) + a_lane
        v_rows = smem_addr + uint32((V_BASE + warp * 16 * ROW) * 2) + a_lane
        k_trans = smem_addr + uint32(K_BASE * 2) + a_lane

        for i in range(ACC_REGS):
            dk_acc[i] = float32(0.0)
            dv_acc[i] = float32(0.0)
        key0 = n0 + warp * 16 + (lane >> 2)  # this lane's key rows: key0 and key0 + 8
        out_lane = a_lane + uint32(col_base * 2)  # .trans B fragments of the output columns

        # The block to load next: its query head and first row, and its stage.
        next_head = kv_head * heads_per_kv
        next_m0 = m_lo
        first_stage = smem_addr + uint32(Q_BASE * 2)
        if STAGES > 1 and n_blocks > 0:  # prologue: the first block's loads
            load_query_block(first_stage, q, do, lse, delta, lse_r, d_r, batch, next_head, m_lo,
                             q_sb, q_ss, q_sh, do_sb, do_ss, do_sh, nheads, seqlen_q,
                             tid)  # fmt: skip
            store_row_stats(lse_tile, d_tile, lse_r, d_r, 0, tid)

        for it in range(n_blocks):
            head = next_head
            m0 = next_m0
            stage = it % STAGES
            next_head, next_m0 = next_query_block(head, m0, m_lo, m_hi, BLOCK_M)
            if STAGES == 1:  # load this block, then wait for it
                cuda.syncthreads()  # every warp is done with the previous block
                load_query_block(first_stage, q, do, lse, delta, lse_r, d_r, batch, head, m0,
                                 q_sb, q_ss, q_sh, do_sb, do_ss, do_sh, nheads, seqlen_q,
                                 tid)  # fmt: skip
                store_row_stats(lse_tile, d_tile, lse_r, d_r, 0, tid)
                ptx.cp_async_wait(0)
                cuda.syncthreads()
            else:  # this block has landed; start the next one's loads into the other stage
                ptx.cp_async_wait(0)
                cuda.syncthreads()  # ... for every thread; and every warp is done with it - 1
                if it + 1 < n_blocks:
                    load_query_block(first_stage + uint32((1 - stage) * STAGE * 2), q, do, lse,
                                     delta, lse_r, d_r, batch, next_head, next_m0, q_sb, q_ss,
                                     q_sh, do_sb, do_ss, do_sh, nheads, seqlen_q, tid)  # fmt: skip

            q_stage = smem_addr + uint32((Q_BASE + stage * STAGE) * 2)
            do_stage = q_stage + uint32(DO_OFFSET * 2)
            query_block_step(st, dpt, dk_acc, dv_acc, k_rows, v_rows, q_stage, do_stage, b_lane,
                             out_lane, lse_tile, d_tile, stage * BLOCK_M, key0, m0, lane,
                             seqlen_q, seqlen_k, scale_log2, window_left, window_right)  # fmt: skip
            # -- dQ += dS K through shared memory (unless the dQ kernel computes it)
            if DQ_ATOMIC:
                store_ds(smem, dpt, warp, lane)
                cuda.syncthreads()
                dq_head = batch * dq_sb + head * dq_sh
                for t in range(DQ_UNITS):
                    unit = warp * DQ_UNITS + t
                    tile = unit // DQ_PIECES
                    col0 = col_base + (unit - tile * DQ_PIECES) * DQ_TILES * 8
                    ds_addr = smem_addr + uint32((DS_BASE + tile * 16 * DS_ROW) * 2) + ds_lane
                    accumulate_dq(dqa, ds_addr, k_trans, col0, dq_acc, dq_head, dq_ss,
                                  m0 + tile * 16, seqlen_q, lane)  # fmt: skip
            if STAGES > 1 and it + 1 < n_blocks:  # the next block's LSE and D, fetched above
                store_row_stats(lse_tile, d_tile, lse_r, d_r, 1 - stage, tid)

        ptx.cp_async_wait(0)  # nothing may be in flight when the block exits (no query block)
        row0 = n0 + warp * 16
        write_rows(dk, dk_acc, batch * dk_sb + kv_head * dk_sh + col_base, dk_ss, row0, lane,
                   seqlen_k, scale)  # fmt: skip
        write_rows(dv, dv_acc, batch * dv_sb + kv_head * dv_sh + col_base, dv_ss, row0, lane,
                   seqlen_k, float32(1.0))  # fmt: skip

    @device_function
    def key_tile_step(s, dp, acc, q_rows, do_rows, k_stage, v_stage, b_lane, out_lane, lse_0,
                      lse_1, d_0, d_1, lo_0, hi_0, lo_1, hi_1, scale_log2):  # fmt: skip
        """One warp's work on one key tile in the dQ kernel (straight-line, as
        query_block_step)."""
        # -- S = Q K^T and dP = dO V^T for this warp's 16 query rows
        mma_rows_by_queries(s, q_rows, k_stage + b_lane)
        mma_rows_by_queries(dp, do_rows, v_stage + b_lane)
        # -- dS = P (dP - D), masked pairs 0
        row_ds(dp, s, lse_0, lse_1, d_0, d_1, lo_0, hi_0, lo_1, hi_1, scale_log2)
        # -- dQ += dS K (K read transposed)
        mma_accumulate(acc, dp, k_stage + out_lane)

    @kernel(launch_bounds=THREADS)
    def dq_kernel(
        q, k, v, do, lse, delta, dq,
        q_sb, q_ss, q_sh, k_sb, k_ss, k_sh, v_sb, v_ss, v_sh, do_sb, do_ss, do_sh,
        dq_sb, dq_ss, dq_sh, seqlen_q, seqlen_k, heads_per_kv, scale, window_left, window_right,
    ):  # fmt: skip
        """dQ = scale * sum over keys of dS K for 16 * NUM_WARPS query rows (16 per warp), each
        element summed by one thread in key order: deterministic. The dK/dV kernel with the
        roles swapped: Q and dO stay in the slots that hold K and V there, and tiles of BLOCK_M
        keys and values stream through the stages that hold Q and dO there."""
        smem = cuda.shared.array(0, uint16)
        s = cuda.local.array(S_REGS, float32)
        dp = cuda.local.array(S_REGS, float32)
        acc = cuda.local.array(ACC_REGS, float32)

        # m0: the block's first query row. The last rows see the most keys under a causal mask,
        # the first ones under a left window alone.
        tid, lane, warp, m0, col_base, head, batch = block_position(
            (window_left < 0) != (window_right < 0), window_left < 0)
        kv_head = head // heads_per_kv
        last_row = min(m0 + BLOCK_N, seqlen_q) - 1
        n_lo, n_hi = block_key_range(m0, last_row, seqlen_q, seqlen_k, window_left, window_right)
        n_tiles = (n_hi - n_lo + BLOCK_M - 1) // BLOCK_M if n_hi > n_lo else 0
        scale_log2 = scale * float32(1.4426950408889634)

        # -- Q and dO of this block stay in shared memory for the whole kernel
        smem_addr = ptx.shared_address(smem, 0)
        load_rows(smem_addr + uint32(K_BASE * 2), q, batch * q_sb + head * q_sh + int64(m0) * q_ss,
                  q_ss, seqlen_q - m0, BLOCK_N, tid)  # fmt: skip
        load_rows(smem_addr + uint32(V_BASE * 2), do,
                  batch * do_sb + head * do_sh + int64(m0) * do_ss, do_ss, seqlen_q - m0, BLOCK_N,
                  tid)  # fmt: skip
        ptx.cp_async_commit()

        a_lane = uint32(((lane & 15) * ROW + (lane >> 4) * 8) * 2)
        b_lane = uint32((((lane & 7) + ((lane >> 4) << 3)) * ROW + ((lane >> 3) & 1) * 8) * 2)
        q_rows = smem_addr + uint32((K_BASE + warp * 16 * ROW) * 2) + a_lane
        do_rows = smem_addr + uint32((V_BASE + warp * 16 * ROW) * 2) + a_lane
        out_lane = a_lane + uint32(col_base * 2)  # .trans B fragments of the output columns

        # -- this lane's two query rows: LSE, D and visible keys (relative to its first column)
        warp_row = m0 + warp * 16
        lse_0, d_0, lo_0, hi_0, lse_1, d_1, lo_1, hi_1 = lane_row_stats(
            lse, delta, batch, head, warp_row, lane, n_lo, seqlen_q, seqlen_k, window_left,
            window_right)
        for i in range(ACC_REGS):
            acc[i] = float32(0.0)

        k_first = batch * k_sb + kv_head * k_sh + int64(n_lo) * k_ss  # key tile `it` below
        v_first = batch * v_sb + kv_head * v_sh + int64(n_lo) * v_ss
        if STAGES > 1 and n_tiles > 0:  # prologue: the first key tile's loads
            load_block_pair(smem_addr + uint32(Q_BASE * 2), k, v, k_first, k_ss, v_first, v_ss,
                            seqlen_k - n_lo, tid)  # fmt: skip
        for it in range(n_tiles):
            n0 = n_lo + it * BLOCK_M
            stage = it % STAGES
            if STAGES == 1:
                cuda.syncthreads()  # every warp is done with the previous tile
                load_block_pair(smem_addr + uint32(Q_BASE * 2), k, v, k_first, k_ss, v_first,
                                v_ss, seqlen_k - n0, tid)  # fmt: skip
                ptx.cp_async_wait(0)
                cuda.syncthreads()
            else:
                ptx.cp_async_wait(0)
                cuda.syncthreads()  # tile `it` landed for all; every warp is done with it - 1
                if it + 1 < n_tiles:
                    load_block_pair(smem_addr + uint32((Q_BASE + (1 - stage) * STAGE) * 2), k, v,
                                    k_first + int64(BLOCK_M) * k_ss, k_ss,
                                    v_first + int64(BLOCK_M) * v_ss, v_ss,
                                    seqlen_k - n0 - BLOCK_M, tid)  # fmt: skip
            k_stage = smem_addr + uint32((Q_BASE + stage * STAGE) * 2)
            v_stage = k_stage + uint32(DO_OFFSET * 2)
            # the lanes' visible keys are relative to the first tile's columns: shifted here
            shift = int32(it * BLOCK_M)
            key_tile_step(s, dp, acc, q_rows, do_rows, k_stage, v_stage, b_lane, out_lane, lse_0,
                          lse_1, d_0, d_1, int32(lo_0 - shift), int32(hi_0 - shift),
                          int32(lo_1 - shift), int32(hi_1 - shift), scale_log2)  # fmt: skip
            k_first += int64(BLOCK_M) * k_ss  # key tile it + 1
            v_first += int64(BLOCK_M) * v_ss

        ptx.cp_async_wait(0)  # nothing may be in flight when the block exits (no key tile)
        write_rows(dq, acc, batch * dq_sb + head * dq_sh + col_base, dq_ss, warp_row, lane,
                   seqlen_q, scale)  # fmt: skip

    return Kernels(dkdv, dq_kernel if dq_separate else None)
