"""Tensor-core attention forward (FlashAttention-2) on mma.sync, ldmatrix and cp.async.

The algorithm and partitioning of FlashAttention-2 (Dao, 2023): one thread block per (block of
BLOCK_M query rows, head, batch); each warp owns M_TILES tiles of 16 query rows and keeps their
output accumulator ``acc``, running max ``m_i`` and running sum ``l_i`` in registers. Key and
value tiles of BLOCK_N rows stream through a ring of STAGES shared-memory slots filled by
cp.async, so the next tiles load while the tensor cores work on the current one:

    S   = Q K_j^T * softmax_scale * log2(e)      mma.sync m16n8k16, fp32 accumulators
    m   = max(m_i, rowmax(S));  P = exp2(S - m);  alpha = exp2(m_i - m)
    l_i = alpha * l_i + rowsum(P);  acc = alpha * acc + P V_j   (P re-packed to fp16/bf16 in
                                                                 registers as the A operand)
    O   = acc / l_i;  LSE = (m_i + log2(l_i)) * ln(2)

Fragments come from shared memory through ldmatrix (``.trans`` for V); shared-memory rows are
padded by 16 bytes so the 8 rows an ldmatrix reads fall in different banks. Key tiles that the
causal or window mask hides from every row of the block are never loaded nor computed; tiles
that it hides partly are masked element by element.

Supports: float16 and bfloat16; head_dim a multiple of 8 up to 256 (zero-padded to a multiple of
16 in shared memory); GQA/MQA; causal and sliding windows aligned bottom-right; any seqlen_q and
seqlen_k; rows that see no key (output 0, LSE -inf). Needs compute capability 8.0+ and
``scale_log2 > 0``: the row max is taken on unscaled scores and the scale is folded into the
fma before ex2 (numflash.attention rewrites a scale <= 0 exactly). Packed batches of
variable-length sequences run the same block body (:func:`build_varlen`); a softcap of the
scores is a compile-time constant of the build, and so is whether sink logits (one a head, the
kernel's ``*variant`` array) join each row's sum in the epilogue, and so are ALiBi slopes (the
next ``*variant`` array) biasing every tile's scores, and so are a user's score_mod and mask_mod
(kernels/mods.py, after the softcap and ALiBi; their mod_args the next arrays) with a block
mask's index last (kernels/block_mask.py: a block runs the keys it shows its rows, and calls
no mask_mod on its run of tiles it shows whole). Does not: dropout, KV cache
(numflash.kernels.decode).
"""

import functools

from numba import cuda, float32, int32, int64, uint16, uint32

from . import ptx
from .block_mask import key_ranges
from .forward_portable import dense_bases, packed_bases, packed_sequence
from .fragments import PACK, acc_index, accumulator_position
from .jit import device_function, kernel
from .loads import row_loader
from .mask import block_key_range, tile_needs_mask, visible_keys
from .mods import mod_functions
from .softmax import (
    LN2,
    LOG2E,
    NEG_INF,
    alibi_functions,
    final_lse,
    inverse_sum,
    linear_alibi_step,
    raw_unit,
    row_starter,
    sink_functions,
    softcap_function,
)
from .warp_step import warp_step


def shared_memory_layout(head_dim, block_m, block_n, stages):
    """(row pitch, K offset, V offset, total elements) of the kernel's dynamic shared memory."""
    row = (head_dim + 15) // 16 * 16 + 8  # +8 elements = 16 bytes: conflict-free ldmatrix
    k_base = block_m * row
    v_base = k_base + stages * block_n * row
    return row, k_base, v_base, v_base + stages * block_n * row


@functools.lru_cache(maxsize=None)
def _block_attender(
    head_dim, dtype_name, block_m, block_n, num_warps, stages, q_in_registers, softcap=0.0,
    sinks=False, alibi=False, mods=None,
):  # fmt: skip
    """The device function that attends one block of query rows (all sizes compile-time),
    shared by the dense and the packed (varlen) kernels; ``softcap`` > 0 caps the scores
    (softmax.softcap_function); with ``sinks`` the head's sink joins each row's sum
    (softmax.sink_functions); with ``alibi`` the scores less the head's slope times the
    distance (softmax.alibi_functions, bias_scores); with ``mods`` (a validation.Mods) a
    user's functions change them (mod_scores) and a block mask narrows the keys."""
    HEAD_DIM = head_dim
    HD_PAD = (head_dim + 15) // 16 * 16  # the mma reduction runs over 16 columns at a time
    BLOCK_M, BLOCK_N, NUM_WARPS, STAGES = block_m, block_n, num_warps, stages
    Q_IN_REGS = q_in_registers
    THREADS = 32 * NUM_WARPS
    M_TILES = BLOCK_M // (16 * NUM_WARPS)  # 16-row tiles per warp
    N_TILES = BLOCK_N // 8  # 8-key column tiles of S
    K_STEPS = HD_PAD // 16  # k16 steps of S = Q K^T
    D_TILES = HD_PAD // 8  # 8-column tiles of the output
    ROW, K_BASE, V_BASE, _ = shared_memory_layout(head_dim, block_m, block_n, stages)
    TILE = BLOCK_N * ROW
    CHUNKS = HEAD_DIM // 8  # 16-byte chunks of real data per row
    PENDING = STAGES - 2  # cp.async groups left in flight when a tile is consumed
    Q_PENDING = STAGES - 1  # ... when the Q tile (the first group) is
    # Register arrays per thread (their sizes must be plain constants for cuda.local.array).
    QF_REGS = M_TILES * K_STEPS * 4
    PF_REGS = M_TILES * 4  # P of one k16 step, packed to 16 bits
    S_REGS = M_TILES * N_TILES * 4
    ACC_REGS = M_TILES * D_TILES * 4
    ROWS = M_TILES * 2
    pack = PACK[dtype_name]
    SOFTCAP = softcap > 0
    cap_scores = softcap_function(S_REGS, softcap if SOFTCAP else 1.0)
    start_rows = row_starter(ROWS, ACC_REGS)
    _, with_sink = sink_functions(sinks)
    ALIBI = alibi
    _, biased = alibi_functions(alibi)
    load_rows = row_loader(ROW, CHUNKS, THREADS, whole_tile_fast_path=True)
    load_q_fragments, mma_qk, online_softmax, mma_pv = warp_step(
        dtype_name, M_TILES, N_TILES, HD_PAD, ROW, Q_IN_REGS, offsets=alibi
    )
    MODS = mods is not None
    SCORE_MOD = MODS and mods.score_mod is not None
    BLOCK_MASK = MODS and mods.block_mask
    user = mod_functions(mods, int(sinks) + int(alibi))
    MASK_AT, MASK_END = user.block_mask_at, user.block_mask_at + 1

    # -- tile loads (global -> shared, asynchronous) ----------------------------------------------

    @device_function
    def zero_padding_columns(smem, tid):
        """Columns HEAD_DIM..HD_PAD-1 of every row take part in the mma: make them zero once."""
        if HD_PAD > HEAD_DIM:
            rows = BLOCK_M + 2 * STAGES * BLOCK_N
            for i in range(tid, rows * (HD_PAD - HEAD_DIM), THREADS):
                r = i // (HD_PAD - HEAD_DIM)
                smem[r * ROW + HEAD_DIM + (i - r * (HD_PAD - HEAD_DIM))] = uint16(0)

    @device_function
    def mask_row(s, first, row, first_col, seqlen_q, seqlen_k, wl, wr):
        """-inf for the keys ``row`` does not see among this lane's scores ``s[first + 4 nt + e]``
        (columns ``first_col + 8 nt + e``)."""
        lo, hi = visible_keys(row, seqlen_q, seqlen_k, wl, wr)
        lo -= first_col  # bounds relative to this lane's first column: the offsets are constants
        hi -= first_col
        for nt in range(N_TILES):
            for e in range(2):
                _, col = accumulator_position(4 * nt + e, 0)  # from the lane's first column
                visible = lo <= col and col < hi
                s[first + 4 * nt + e] = s[first + 4 * nt + e] if visible else NEG_INF

    @device_function
    def bias_row(s, first, distance, slope):
        """ALiBi as |distance| on this lane's scores ``s[first + 4 nt + e]`` of one row:
        ``distance`` is the row's position among the keys less the lane's first column; the
        column offsets are constants (as mask_row's)."""
        for nt in range(N_TILES):
            for e in range(2):
                _, col = accumulator_position(4 * nt + e, 0)
                i = first + 4 * nt + e
                s[i] = biased(s[i], distance - float32(col), slope)

    @device_function
    def bias_scores(s, t, row0, n0, m0, lane, seqlen_q, seqlen_k, wl, wr, slope):
        """ALiBi on the scores of the tile of keys n0.. (raw scores: ``slope`` in units of
        1 / scale), t[r] the offset of this lane's row r left out of s (online_softmax adds
        it): linear in the key where softmax.linear_alibi_step says so (one fma with a
        constant a score, the rest in t), else |distance|."""
        offset = seqlen_k - seqlen_q
        distance = float32(row0 + (lane >> 2) + offset - n0 - (lane & 3) * 2)
        linear, step = linear_alibi_step(
            slope, n0, n0 + BLOCK_N - 1, m0 + offset, m0 + BLOCK_M - 1 + offset, wl, wr
        )
        if linear and not MODS:  # a user's score_mod is handed each whole biased score
            for mt in range(M_TILES):
                for j in range(4 * N_TILES):
                    _, col = accumulator_position(j, 0)
                    i = mt * 4 * N_TILES + j
                    s[i] = ptx.fma(step, float32(col), s[i])
                for h in range(2):
                    t[mt * 2 + h] = -step * (distance + float32(16 * mt + 8 * h))
            return
        # One call per row this lane holds, each with constant offsets (as mask_scores)
        bias_row(s, 0, distance, slope)
        bias_row(s, 2, distance + float32(8), slope)
        if M_TILES == 2:
            bias_row(s, 4 * N_TILES, distance + float32(16), slope)
            bias_row(s, 4 * N_TILES + 2, distance + float32(24), slope)
        for r in range(ROWS):
            t[r] = float32(0.0)

    def each_row(row_step):
        """``rows(s, row0, n0, lane, seqlen_q, seqlen_k, x, y)``: ``row_step(s, first, row,
        first_col, seqlen_q, seqlen_k, x, y)`` on the tile of keys n0.. of every row this lane
        holds. One call per row, each with constant offsets: a loop over the row tiles is
        not unrolled by NVVM at M_TILES = 2 and would move s to local memory."""

        @device_function
        def rows(s, row0, n0, lane, seqlen_q, seqlen_k, x, y):
            col = n0 + (lane & 3) * 2
            row = row0 + (lane >> 2)
            row_step(s, 0, row, col, seqlen_q, seqlen_k, x, y)
            row_step(s, 2, row + 8, col, seqlen_q, seqlen_k, x, y)
            if M_TILES == 2:
                row_step(s, 4 * N_TILES, row + 16, col, seqlen_q, seqlen_k, x, y)
                row_step(s, 4 * N_TILES + 2, row + 24, col, seqlen_q, seqlen_k, x, y)

        return rows

    #: mask_scores(s, row0, n0, lane, seqlen_q, seqlen_k, wl, wr): hidden keys -> -inf, in a
    #: tile the mask cuts through.
    mask_scores = each_row(mask_row)

    def mod_rows_function(masked):
        """``mod_rows``: the user's functions on this lane's rows (``masked``: mask_mod and
        score_mod, else score_mod alone)."""
        natural = user.natural_modded if masked else user.natural_scored

        @device_function
        def mod_row(s, first, row, first_col, seqlen_q, seqlen_k, unit, ctx):
            """The user's functions on this lane's scores ``s[first + 4 nt + e]`` of ``row``
            (columns ``first_col + 8 nt + e``) where the row and the key exist: with a
            score_mod in natural units (``unit``: softmax_scale a raw score) and left so, a
            mask alone on the raw scores (each one itself or -inf)."""
            b, head, variant = ctx
            if row < seqlen_q:
                at = row + seqlen_k - seqlen_q  # the row's position among the keys
                for nt in range(N_TILES):
                    for e in range(2):
                        _, col = accumulator_position(4 * nt + e, 0)
                        key = first_col + col
                        i = first + 4 * nt + e
                        if key < seqlen_k:
                            x = s[i] * unit if SCORE_MOD else s[i]
                            s[i] = natural(x, b, head, at, key, variant)

        return each_row(mod_row)

    mod_rows, scored_rows = mod_rows_function(True), mod_rows_function(False)

    @device_function
    def mod_scores(s, row0, n0, lane, seqlen_q, seqlen_k, unit, ctx, full):
        """The user's functions (kernels/mods.py) on the tile of keys n0.. of this lane's
        rows (mod_rows); ``full``: the block mask shows every row of the block every key of
        the tile, so mask_mod is not called (a constant False without a block mask)."""
        if BLOCK_MASK and full:
            if SCORE_MOD:
                scored_rows(s, row0, n0, lane, seqlen_q, seqlen_k, unit, ctx)
        else:
            mod_rows(s, row0, n0, lane, seqlen_q, seqlen_k, unit, ctx)

    @device_function
    def write_output(o, lse, acc, m_i, l_i, o_base, o_ss, lse_base, row0, lane, seqlen_q, sink):
        """O = acc / l_i (0 where l_i = 0) and the row's LSE, for this warp's rows."""
        for mt in range(M_TILES):
            for h in range(2):
                r = mt * 2 + h
                l_row = l_i[r]
                l_row += ptx.shfl_xor(l_row, 1)
                l_row += ptx.shfl_xor(l_row, 2)
                m_row = m_i[r]
                row = row0 + mt * 16 + (lane >> 2) + 8 * h
                if row < seqlen_q:
                    m_row, l_row, factor = with_sink(m_row, l_row, sink)
                    inv_l = inverse_sum(l_row) * factor
                    out_row = o_base + int64(row) * o_ss
                    for dt in range(D_TILES):
                        col = dt * 8 + (lane & 3) * 2
                        if col < HEAD_DIM:
                            i = acc_index(mt * D_TILES + dt, h)
                            pair = pack(acc[i] * inv_l, acc[i + 1] * inv_l)
                            o[out_row + col] = uint16(pair & uint32(0xFFFF))
                            o[out_row + col + 1] = uint16(pair >> uint32(16))
                    if (lane & 3) == 0:
                        lse[lse_base + row] = final_lse(m_row, l_row)

    @device_function
    def write_empty_block(o, lse, o_base, o_ss, lse_base, m0, seqlen_q, tid, sink):
        """Rows that see no key at all: O = 0, LSE = -inf (the sink with sinks)."""
        for i in range(tid, BLOCK_M * HEAD_DIM, THREADS):
            r = i // HEAD_DIM
            if m0 + r < seqlen_q:
                o[o_base + int64(m0 + r) * o_ss + (i - r * HEAD_DIM)] = uint16(0)
        m_empty, l_empty, _ = with_sink(NEG_INF, float32(0.0), sink)
        empty_lse = final_lse(m_empty, l_empty)
        for r in range(tid, BLOCK_M, THREADS):
            if m0 + r < seqlen_q:
                lse[lse_base + m0 + r] = empty_lse

    # -- one block of query rows of one sequence and head --------------------------------------

    @device_function
    def attend_block(
        q, k, v, o, lse, bases, row_strides, m_block, seqlen_q, seqlen_k, scale_log2, window,
        tid, lane, warp, sink, slope, ctx,
    ):  # fmt: skip
        """Rows m_block * BLOCK_M .. + BLOCK_M - 1 of one (sequence, head), by thread ``tid``
        (``lane`` of ``warp``) of the block: ``bases`` (q, k, v, o, lse) is where the
        sequence's row 0 of this head (its kv head for k, v) starts in each array, rows
        ``row_strides`` (q, k, v, o) elements apart; ``window`` is (left, right); ``sink``
        the head's sink logit (log2 domain), read only with sinks; ``slope`` its ALiBi slope
        in units of 1 / scale, read only with ALiBi; ``ctx`` (the sequence, the head, the
        kernel's ``*variant`` arrays), read only with a user's functions."""
        q_base, k_base, v_base, o_base, lse_base = bases
        q_ss, k_ss, v_ss, o_ss = row_strides
        window_left, window_right = window
        smem = cuda.shared.array(0, uint16)
        qf = cuda.local.array(QF_REGS, uint32)
        pf = cuda.local.array(PF_REGS, uint32)
        s = cuda.local.array(S_REGS, float32)
        acc = cuda.local.array(ACC_REGS, float32)
        m_i = cuda.local.array(ROWS, float32)
        l_i = cuda.local.array(ROWS, float32)
        t = m_i  # the rows' ALiBi offsets (bias_scores), not read without ALiBi; no array
        if ALIBI:  # of its own then: even unread it moved an add in the plain kernel's PTX
            t = cuda.local.array(ROWS, float32)

        m0 = m_block * BLOCK_M
        last_row = min(m0 + BLOCK_M, seqlen_q) - 1

        n_lo, n_hi = block_key_range(m0, last_row, seqlen_q, seqlen_k, window_left, window_right)
        full_lo, full_hi = int32(0), int32(0)  # the keys the block mask shows every row of
        if BLOCK_MASK:  # and the keys the block mask shows some row of the block
            b, head, variant = ctx
            index = variant[MASK_AT:MASK_END][0]
            lo, hi, full_lo, full_hi = key_ranges(index, b, head, m0, last_row)
            n_lo, n_hi = max(n_lo, lo), min(n_hi, hi)
        if n_hi <= n_lo:
            write_empty_block(o, lse, o_base, o_ss, lse_base, m0, seqlen_q, tid, sink)
            return
        first_tile = int32(n_lo // BLOCK_N)
        # Loop state in int32: Numba widens integer arithmetic to 64 bits, two registers each.
        n_tiles = int32((n_hi - first_tile * BLOCK_N + BLOCK_N - 1) // BLOCK_N)

        # -- prologue: Q, then the first STAGES - 1 key/value tiles, each its own cp.async group
        smem_addr = ptx.shared_address(smem, 0)
        q_first = q_base + int64(m0) * q_ss
        k_first = k_base + int64(first_tile * BLOCK_N) * k_ss
        v_first = v_base + int64(first_tile * BLOCK_N) * v_ss
        k_step = int64(BLOCK_N) * k_ss  # elements from one key tile to the next
        v_step = int64(BLOCK_N) * v_ss
        zero_padding_columns(smem, tid)
        load_rows(smem_addr, q, q_first, q_ss, seqlen_q - m0, BLOCK_M, tid)
        ptx.cp_async_commit()
        keys_left = int32(seqlen_k - first_tile * BLOCK_N)  # valid rows of the next tile to load
        for st in range(STAGES - 1):
            if st < n_tiles:
                slot_addr = smem_addr + uint32(st * TILE * 2)
                load_rows(slot_addr + uint32(K_BASE * 2), k, k_first, k_ss, keys_left, BLOCK_N, tid)
                load_rows(slot_addr + uint32(V_BASE * 2), v, v_first, v_ss, keys_left, BLOCK_N, tid)
                k_first += k_step
                v_first += v_step
                keys_left = int32(keys_left - BLOCK_N)
            ptx.cp_async_commit()

        # Lane offsets of the ldmatrix row addresses (see ptx.py for the fragment layouts).
        row0 = m0 + warp * M_TILES * 16
        q_addr = smem_addr + uint32(
            ((warp * M_TILES * 16 + (lane & 15)) * ROW + (lane >> 4) * 8) * 2
        )
        k_lane = uint32((((lane & 7) + ((lane >> 4) << 3)) * ROW + ((lane >> 3) & 1) * 8) * 2)
        v_lane = uint32(((lane & 15) * ROW + (lane >> 4) * 8) * 2)

        if Q_IN_REGS:
            ptx.cp_async_wait(Q_PENDING)
            cuda.syncthreads()
            for mt in range(M_TILES):
                for kk in range(K_STEPS):
                    load_q_fragments(qf, q_addr, mt, kk, (mt * K_STEPS + kk) * 4)

        start_rows(m_i, l_i, acc)

        stage = int32(0)
        for it in range(n_tiles):
            ptx.cp_async_wait(PENDING)  # tile `it` has landed (for this thread's copies) ...
            cuda.syncthreads()  # ... for every thread's, and slot it-1 is free again
            if it + STAGES - 1 < n_tiles:
                slot = stage - 1 if stage > 0 else STAGES - 1
                slot_addr = smem_addr + uint32(slot * TILE * 2)
                load_rows(slot_addr + uint32(K_BASE * 2), k, k_first, k_ss, keys_left, BLOCK_N, tid)
                load_rows(slot_addr + uint32(V_BASE * 2), v, v_first, v_ss, keys_left, BLOCK_N, tid)
                k_first += k_step
                v_first += v_step
                keys_left = int32(keys_left - BLOCK_N)
            ptx.cp_async_commit()  # possibly empty: keeps the group count uniform

            n0 = int32((first_tile + it) * BLOCK_N)
            stage_addr = smem_addr + uint32(stage * TILE * 2)
            # -- S = Q K_j^T (raw scores; the scale is folded into the softmax's fma)
            mma_qk(qf, s, q_addr, stage_addr + uint32(K_BASE * 2) + k_lane)
            if SOFTCAP:
                cap_scores(s, scale_log2)
            if ALIBI:
                bias_scores(s, t, row0, n0, m0, lane, seqlen_q, seqlen_k, window_left,
                            window_right, slope)  # fmt: skip
            unit_log2 = scale_log2  # of the scores in s, for the softmax
            if MODS:
                full = BLOCK_MASK and full_lo <= n0 and n0 + BLOCK_N <= full_hi
                unit = scale_log2 * float32(LN2)  # softmax_scale
                mod_scores(s, row0, n0, lane, seqlen_q, seqlen_k, unit, ctx, full)
                if SCORE_MOD:  # natural units now: the softmax's multiply converts them
                    unit_log2 = float32(LOG2E)
            if tile_needs_mask(
                m0,
                m0 + BLOCK_M - 1,
                n0,
                n0 + BLOCK_N,
                seqlen_q,
                seqlen_k,
                window_left,
                window_right,
            ):
                mask_scores(s, row0, n0, lane, seqlen_q, seqlen_k, window_left, window_right)
            # -- update m_i and l_i, rescale acc, P = exp2(S * scale - m_i)
            online_softmax(s, m_i, l_i, acc, unit_log2, t)
            # -- acc += P V_j
            mma_pv(s, pf, acc, stage_addr + uint32(V_BASE * 2) + v_lane)
            stage = int32(stage + 1) if stage + 1 < STAGES else int32(0)

        ptx.cp_async_wait(0)  # nothing may be in flight when the block exits
        write_output(o, lse, acc, m_i, l_i, o_base, o_ss, lse_base, row0, lane, seqlen_q, sink)

    return attend_block


@functools.lru_cache(maxsize=None)
def build(
    head_dim, dtype_name, block_m, block_n, num_warps, stages, q_in_registers, softcap=0.0,
    sinks=False, alibi=False, mods=None,
):  # fmt: skip
    """The tensor-core forward kernel specialised for one key; all sizes are compile-time."""
    attend_block = _block_attender(
        head_dim, dtype_name, block_m, block_n, num_warps, stages, q_in_registers, softcap, sinks,
        alibi, mods,
    )  # fmt: skip
    sink_of, _ = sink_functions(sinks)
    slope_of, _ = alibi_functions(alibi, sinks)

    @kernel(launch_bounds=32 * num_warps)
    def forward(
        q,
        k,
        v,
        o,
        lse,
        q_st,
        k_st,
        v_st,
        o_st,
        seqlen_q,
        seqlen_k,
        heads_per_kv,
        scale_log2,
        window_left,
        window_right,
        *variant,
    ):
        tid = cuda.threadIdx.x  # read first: the order the registers are allocated in
        lane = tid & 31
        warp = tid >> 5
        # The longest rows first: under a causal mask the last query blocks see the most keys.
        m_block = cuda.gridDim.x - 1 - cuda.blockIdx.x
        head = cuda.blockIdx.y
        batch = cuda.blockIdx.z
        kv_head = head // heads_per_kv
        bases = dense_bases((q_st, k_st, v_st, o_st), batch, head, kv_head, seqlen_q,
                            cuda.gridDim.y)  # fmt: skip
        attend_block(
            q, k, v, o, lse, bases, (q_st[1], k_st[1], v_st[1], o_st[1]), m_block, seqlen_q,
            seqlen_k, scale_log2, (window_left, window_right), tid, lane, warp,
            sink_of(variant, head),
            slope_of(variant, batch, head, cuda.gridDim.y, raw_unit(scale_log2)),
            (batch, head, variant),
        )  # fmt: skip

    return forward


@functools.lru_cache(maxsize=None)
def build_varlen(
    head_dim, dtype_name, block_m, block_n, num_warps, stages, q_in_registers, softcap=0.0,
    sinks=False, alibi=False, mods=None,
):  # fmt: skip
    """The tensor-core forward over a packed batch: q (total_q, nheads, head_dim), k and v
    (total_k, nheads_k, head_dim), sequence b at rows cu_q[b] .. cu_q[b + 1] - 1 (keys alike);
    grid (ceil(max_seqlen_q / block_m), nheads, batch), lse (nheads, total_q). Offsets are
    clamped to the arrays and lengths to max_seqlen: no read or write leaves q, k, v, o or
    lse. The same block body as the dense kernel (:func:`build`)."""
    attend_block = _block_attender(
        head_dim, dtype_name, block_m, block_n, num_warps, stages, q_in_registers, softcap, sinks,
        alibi, mods,
    )  # fmt: skip
    sink_of, _ = sink_functions(sinks)
    slope_of, _ = alibi_functions(alibi, sinks)
    BLOCK_M = block_m

    @kernel(launch_bounds=32 * num_warps)
    def forward_varlen(
        q,
        k,
        v,
        o,
        lse,
        cu_q,
        cu_k,
        q_st,
        k_st,
        v_st,
        o_st,
        max_seqlen_q,
        max_seqlen_k,
        heads_per_kv,
        scale_log2,
        window_left,
        window_right,
        total_q,
        total_k,
        *variant,
    ):
        tid = cuda.threadIdx.x  # read first: the order the registers are allocated in
        lane = tid & 31
        warp = tid >> 5
        head = cuda.blockIdx.y
        b = cuda.blockIdx.z
        q_start, seqlen_q = packed_sequence(cu_q, b, total_q, max_seqlen_q)
        k_start, seqlen_k = packed_sequence(cu_k, b, total_k, max_seqlen_k)
        # The longest rows first, as in the dense kernel; blocks past the sequence's end exit.
        m_block = cuda.gridDim.x - 1 - cuda.blockIdx.x
        if m_block * BLOCK_M >= seqlen_q:
            return
        kv_head = head // heads_per_kv
        bases = packed_bases((q_st, k_st, v_st, o_st), q_start, k_start, head, kv_head, total_q)
        attend_block(
            q, k, v, o, lse, bases, (q_st[1], k_st[1], v_st[1], o_st[1]), m_block, seqlen_q,
            seqlen_k, scale_log2, (window_left, window_right), tid, lane, warp,
            sink_of(variant, head),
            slope_of(variant, b, head, cuda.gridDim.y, raw_unit(scale_log2)),
            (b, head, variant),
        )  # fmt: skip

    return forward_varlen
