"""The tensor-core backward's mma.sync backend (any GPU from Ampere on): backward.py's dK/dV
and dQ kernels with their products on mma.sync m16n8k16 and ldmatrix.

Each warp owns 16 key rows (dK/dV kernel) or 16 query rows (dQ kernel): S^T = K Q^T and
dP^T = V dO^T take K, V as A fragments and Q, dO as B (ldmatrix), so P^T and dS^T come out in
registers in the layout dV += P^T dO and dK += dS^T Q take as A, with dO and Q read transposed
(``ldmatrix.trans``) as B. Shared-memory rows are padded by 16 bytes so the 8 rows an ldmatrix
reads fall in different banks; loads are cp.async, 16 bytes a thread.

With ``dq_separate=False`` the dK/dV kernel also adds dQ += dS K up: dS^T goes through shared
memory (stored as dS), the warps share the block's 16-row dQ tiles (split by columns where
there are more warps than tiles), and each adds its products to an fp32 (batch, seqlen_q,
heads, head_dim) buffer by atomics, in no fixed order (scaled and rounded afterwards).

With ``head_split=2`` two blocks share each key block (and each query block of the dQ kernel),
each accumulating half of the output columns; both compute the scores over the whole head_dim.
That is how head_dim 256 fits: its dK and dV accumulators would need 256 registers a thread.

Supports: head_dim a multiple of 16 * head_split up to 128 * head_split (the API zero-pads
others).
"""

import functools

from numba import cuda, float32, int64, uint16, uint32

from . import backward, ptx
from .backward import NON_NEGATIVE
from .fragments import MMA, PACK, acc_index
from .jit import device_function
from .loads import row_loader


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
    return (
        row,
        k_base,
        v_base,
        q_base,
        stage,
        ds_base,
        ds_row,
        ds_base + (block_m * ds_row if with_ds else 0),
    )


def dq_split(head_dim, block_m, num_warps):
    """How the warps share dQ += dS K of a query block: (column pieces per 16-row tile, 8-column
    tiles per piece, pieces per warp), or None where the warps cannot split it evenly."""
    row_tiles = block_m // 16
    pieces = max(1, num_warps // row_tiles)
    d_tiles = head_dim // 8
    if (row_tiles * pieces) % num_warps or d_tiles % pieces or (d_tiles // pieces) % 2:
        return None
    return pieces, d_tiles // pieces, row_tiles * pieces // num_warps


@functools.lru_cache(maxsize=None)
def build_kernels(
    head_dim, dtype_name, block_m, num_warps, stages, dq_separate, head_split=1, *, heavy_group=None,
    softcap=0.0, alibi=False, mods=None,
):  # fmt: skip
    """Both kernels of one configuration (backward.Kernels; no dQ kernel without
    ``dq_separate``); all sizes are compile-time. ``softcap``, ``alibi``: of scores changed as
    the forward changed them (backward.element_function); ``mods``: and by a user's functions
    (backward.user_element_function), with a block mask where ``mods.block_mask``.

    ``heavy_group``: under a mask bounded on one side only, where the blocks' work differs
    (causal: the dK/dV kernel's first keys and the dQ kernel's last query rows see the most),
    the blocks start heaviest first, so that short ones fill the last wave: groups of G (head,
    batch) pairs run one after the other, and within a group the blocks of rows run heaviest
    first across the group's pairs (backward.block_position_function). None, the default, is 8
    with ``dq_separate`` (the fastest on the H200, docs/performance.md) and 1 without (the
    atomic dK/dV kernel spills at 8)."""
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
    S_REGS = Q_TILES * 4
    ACC_REGS = D_TILES * 4
    DQ_REGS = DQ_TILES * 4
    mma = MMA[dtype_name]
    pack = PACK[dtype_name]
    # (no vote: a warp's two paths spill at head_dim 128, backward.probabilities_function)
    probabilities_and_ds = backward.probabilities_function(Q_TILES, softcap, alibi, mods, False)
    row_ds = backward.row_ds_function(Q_TILES, softcap, alibi, mods, False)
    load_rows = row_loader(ROW, HEAD_DIM // 8, THREADS)

    @device_function
    def shared_base(smem):
        return ptx.shared_address(smem, 0)

    @device_function
    def landed():
        ptx.cp_async_wait(0)
        cuda.syncthreads()

    @device_function
    def load_pair(stage_addr, a, b, a_first, a_ss, b_first, b_ss, rows_left, tid):
        """cp.async BLOCK_M rows of two arrays (Q and dO, or K and V) into a stage, as one
        commit group."""
        load_rows(stage_addr, a, a_first, a_ss, rows_left, BLOCK_M, tid)
        load_rows(stage_addr + uint32(DO_OFFSET * 2), b, b_first, b_ss, rows_left, BLOCK_M, tid)
        ptx.cp_async_commit()

    @device_function
    def load_resident(
        base, a, b, a_first, a_ss, b_first, b_ss, rows_left, warp, lane, col_base, tid
    ):
        """K and V (or Q and dO) of the block, one commit group; this warp's ldmatrix
        addresses: (A rows of a, A rows of b, the B lane offset, the .trans B offset of the
        block's output columns)."""
        load_rows(base + uint32(K_BASE * 2), a, a_first, a_ss, rows_left, BLOCK_N, tid)
        load_rows(base + uint32(V_BASE * 2), b, b_first, b_ss, rows_left, BLOCK_N, tid)
        ptx.cp_async_commit()
        # ldmatrix lane addresses: A fragments of 16 rows, B fragments of pairs of 8-row tiles
        # (non-transposed) or of k16 x 16 blocks (.trans)
        a_lane = uint32(((lane & 15) * ROW + (lane >> 4) * 8) * 2)
        b_lane = uint32((((lane & 7) + ((lane >> 4) << 3)) * ROW + ((lane >> 3) & 1) * 8) * 2)
        return (
            base + uint32((K_BASE + warp * 16 * ROW) * 2) + a_lane,
            base + uint32((V_BASE + warp * 16 * ROW) * 2) + a_lane,
            b_lane,
            a_lane + uint32(col_base * 2),
        )

    @device_function
    def mma_pair(acc, c, a0, a1, a2, a3, b0, b1, b2, b3):
        """acc[c..c+3] += A B0 and acc[c+4..c+7] += A B1: two adjacent 8-column tiles."""
        acc[c], acc[c + 1], acc[c + 2], acc[c + 3] = mma(
            a0, a1, a2, a3, b0, b1, acc[c], acc[c + 1], acc[c + 2], acc[c + 3]
        )
        acc[c + 4], acc[c + 5], acc[c + 6], acc[c + 7] = mma(
            a0, a1, a2, a3, b2, b3, acc[c + 4], acc[c + 5], acc[c + 6], acc[c + 7]
        )

    @device_function
    def mma_rows_by_queries(acc, a_addr, b_addr):
        """acc (16 rows x BLOCK_M) = A (16 x HEAD_DIM, this warp's rows of K or V) times the
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
        """acc (16 rows x PART) += F (16 x BLOCK_M, in ``frag``'s accumulator layout) times
        B (BLOCK_M x PART, from rows of dO, Q or K, read transposed by ldmatrix; ``b_addr``
        points at the block's first column)."""
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
    def query_block_step(st, dpt, dk_acc, dv_acc, resident, stage_addr, scores):
        """One warp's work on one query block in the dK/dV kernel. Straight-line code, so
        that the compiler overlaps the P/dS arithmetic with the mma on either side (copies
        without the mask tests for whole tiles, behind a branch, measured slower on the H200:
        docs/performance.md)."""
        k_rows, v_rows, b_lane, out_lane = resident
        q_stage = stage_addr
        do_stage = stage_addr + uint32(DO_OFFSET * 2)
        # -- S^T = K Q^T and dP^T = V dO^T for this warp's 16 keys
        mma_rows_by_queries(st, k_rows, q_stage + b_lane)
        mma_rows_by_queries(dpt, v_rows, do_stage + b_lane)
        # -- P^T and dS^T, masked pairs 0
        probabilities_and_ds(st, dpt, *scores)
        # -- dV += P^T dO, dK += dS^T Q
        mma_accumulate(dv_acc, st, do_stage + out_lane)
        mma_accumulate(dk_acc, dpt, q_stage + out_lane)

    @device_function
    def key_tile_step(s, dp, acc, resident, stage_addr, row_stats, shift, scale_log2, bias):
        """One warp's work on one key tile in the dQ kernel (straight-line, as
        query_block_step)."""
        q_rows, do_rows, b_lane, out_lane = resident
        k_stage = stage_addr
        v_stage = stage_addr + uint32(DO_OFFSET * 2)
        # -- S = Q K^T and dP = dO V^T for this warp's 16 query rows
        mma_rows_by_queries(s, q_rows, k_stage + b_lane)
        mma_rows_by_queries(dp, do_rows, v_stage + b_lane)
        # -- dS = P (dP - D), masked pairs 0
        row_ds(dp, s, row_stats, shift, scale_log2, bias)
        # -- dQ += dS K (K read transposed)
        mma_accumulate(acc, dp, k_stage + out_lane)

    @device_function
    def store_ds(smem, dpt, warp, lane):
        """dS^T of this warp's key rows into shared memory as dS: row = query, column = key.
        One base index per lane; every store's offset from it is a compile-time constant.
        Each key row's two adjacent queries are rounded by one paired cvt (a bf16 rounding
        of its own costs about eight integer instructions)."""
        base = uint32(DS_BASE + (lane & 3) * 2 * DS_ROW + warp * 16 + (lane >> 2))
        for qt in range(Q_TILES):
            for h in range(2):  # key rows key0 and key0 + 8
                i = acc_index(qt, h)
                pair = pack(dpt[i], dpt[i + 1])  # queries col, col + 1
                offset = qt * 8 * DS_ROW + 8 * h
                smem[base + uint32(offset)] = uint16(pair & uint32(0xFFFF))
                smem[base + uint32(offset + DS_ROW)] = uint16(pair >> uint32(16))

    @device_function
    def accumulate_dq(dqa, ds_addr, k_addr, col0, dq_acc, dq_base, dq_ss, q_row0, seqlen_q, lane):
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
                    cuda.atomic.add(dq_acc, at, dqa[acc_index(dt, h)])
                    at = (base + dt * 8 + 1) & NON_NEGATIVE
                    cuda.atomic.add(dq_acc, at, dqa[acc_index(dt, h) + 1])

    @device_function
    def atomic_dq(
        smem, base, dpt, dqa, dq_acc, dq_head, dq_ss, dq_sh, m0, col_base, warp, lane, seqlen_q,
        dk_acc, dv_acc,
    ):  # fmt: skip
        """dQ += dS K for the block's query rows: dS through shared memory, the warps sharing
        the 16-row tiles (DQ_UNITS each, split by columns), fp32 atomics."""
        store_ds(smem, dpt, warp, lane)
        cuda.syncthreads()
        ds_lane = uint32(((lane & 15) * DS_ROW + (lane >> 4) * 8) * 2)
        k_trans = base + uint32(K_BASE * 2) + uint32(((lane & 15) * ROW + (lane >> 4) * 8) * 2)
        for t in range(DQ_UNITS):
            unit = warp * DQ_UNITS + t
            tile = unit // DQ_PIECES
            col0 = col_base + (unit - tile * DQ_PIECES) * DQ_TILES * 8
            ds_addr = base + uint32((DS_BASE + tile * 16 * DS_ROW) * 2) + ds_lane
            accumulate_dq(
                dqa, ds_addr, k_trans, col0, dq_acc, dq_head, dq_ss, m0 + tile * 16, seqlen_q, lane
            )

    return backward.build_kernels(
        backward.Backend(
            block_m=BLOCK_M,
            block_n=BLOCK_N,
            threads=THREADS,
            stages=STAGES,
            s_regs=S_REGS,
            acc_regs=ACC_REGS,
            dq_regs=DQ_REGS if DQ_ATOMIC else 1,
            stage0=Q_BASE * 2,
            stage_bytes=STAGE * 2,
            dq_atomic=DQ_ATOMIC,
            block_position=backward.block_position_function(BLOCK_N, HEAD_SPLIT, PART, HEAVY_GROUP),
            shared_base=shared_base,
            load_resident=load_resident,
            load_pair=load_pair,
            landed=landed,
            query_block_step=query_block_step,
            key_tile_step=key_tile_step,
            atomic_dq=atomic_dq,
            divide=backward.floor_quotient,
            write_rows=backward.row_writer(PART, dtype_name),
        ),
        alibi,
        mods,
    )
