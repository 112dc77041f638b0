"""Portable attention backward: shared-memory tiles and fp32 math, no tensor cores.

FlashAttention-2's backward (Dao, 2023) without warp-level instructions, so it runs on every GPU
that numba-cuda supports and in the CUDA simulator. Attention is recomputed from q, k and the
saved log-sum-exp; nothing of size seqlen_q x seqlen_k is stored. Three kernels:

1. ``preprocess``: ``D_i = rowsum(dO_i * O_i)`` in fp32, one warp per query row.
2. ``dkdv``: one thread block per (block of BLOCK_N keys, kv head, batch), one thread per key,
   holding that key's k, v and its dk, dv accumulators in fp32. Query rows stream through shared
   memory BLOCK_M at a time (q, dO, lse, D), for every query head of the GQA group in turn, so a
   group's sum is formed in one thread in a fixed order: no atomics.
3. ``dq``: one thread block per (block of BLOCK_M query rows, head, batch), one thread per row,
   holding q, dO and the dq accumulator; key and value tiles stream through shared memory.

With p = exp(s * scale - lse), per visible (query i, key j):
``dv_j += p dO_i; dp = dO_i . v_j; ds = p (dp - D_i); dk_j += ds q_i scale; dq_i += ds k_j scale``.
Every sum runs in a fixed order, so the gradients are bitwise reproducible (``deterministic``
holds whatever the flag says). Each thread sums one tile of rows (or keys) on its own, then adds
that sum to its total: with GQA a key's dK sums every row of every head of its group, and one
running fp32 sum over 8 heads x 177 rows had 6.5x the rounding error of tile sums added up (a
float32 case of tests/test_random.py, replayed in NumPy). Rows that see no key contribute
nothing; keys that no row sees get dk = dv = 0.
"""

import functools

from numba import cuda, float32, int64

from . import ptx
from .block_mask import key_ranges, query_ranges
from .forward_portable import (
    FROM_F32,
    TO_F32,
    packed_sequence,
    query_row_position,
    tile_pair_loader,
)
from .jit import device_function, kernel
from .mask import block_query_range, visible_keys
from .mods import mod_functions
from .softmax import LOG2E, NEG_INF, alibi_functions, row_log2_lse, softcap_gradient_functions


@functools.lru_cache(maxsize=None)
def build_preprocess(head_dim, dtype_name, rows, padded=False):
    """D = rowsum(dO * O) in fp32: one warp per query row, ``rows`` rows (warps) a block; grid
    (ceil(seqlen_q / rows), nheads, batch). The lanes read consecutive elements, so each load
    of the warp is one contiguous run of the row, and sum their parts by shuffles in a fixed
    order. (With a thread per row, each reading its own, every load of a warp touched 32 rows:
    the tensor-core backward took 14.20 ms against 13.59 ms now, fp16 head_dim 128 at 32k
    tokens x 2048 on the H200; this kernel takes 0.14 ms of it.)

    ``padded``: the kernel also takes the forward's ``lse`` (contiguous (batch, nheads,
    seqlen_q)) and writes ``lse_log2`` (each row's LSE in the log2 domain, +inf where -inf)
    beside ``delta``, both (batch, nheads, padded_rows) with zeros in rows seqlen_q.. (grid
    ceil(padded_rows / rows)): the rows the Hopper backward copies a block at a time
    (backward.padded_stat_rows)."""
    HEAD_DIM = head_dim
    PASSES = (head_dim + 31) // 32
    to_f32 = TO_F32[dtype_name]

    @device_function
    def row_delta(do, o, do_st, o_st, head, batch, row, lane):
        """rowsum(dO * O) of ``row``, whole-warp (the shuffles), the same value in every lane."""
        do_sb, do_ss, do_sh = do_st
        o_sb, o_ss, o_sh = o_st
        do_base = batch * do_sb + head * do_sh + row * do_ss
        o_base = batch * o_sb + head * o_sh + row * o_ss
        acc = float32(0.0)
        for j in range(PASSES):
            d = j * 32 + lane
            if d < HEAD_DIM:
                acc += to_f32(do[do_base + d]) * to_f32(o[o_base + d])
        for mask in (16, 8, 4, 2, 1):
            acc += ptx.shfl_xor(acc, mask)
        return acc

    @kernel
    def preprocess(do, o, delta, do_st, o_st, seqlen_q):
        head = cuda.blockIdx.y
        batch = cuda.blockIdx.z
        lane = cuda.threadIdx.x & 31
        row = cuda.blockIdx.x * rows + (cuda.threadIdx.x >> 5)
        if row < seqlen_q:  # the same for the whole warp, as the shuffles need
            acc = row_delta(do, o, do_st, o_st, head, batch, row, lane)
            if lane == 0:
                delta[(batch * cuda.gridDim.y + head) * seqlen_q + row] = acc

    @kernel
    def preprocess_padded(do, o, lse, lse_log2, delta, do_st, o_st, seqlen_q, padded_rows):
        head = cuda.blockIdx.y
        batch = cuda.blockIdx.z
        lane = cuda.threadIdx.x & 31
        row = cuda.blockIdx.x * rows + (cuda.threadIdx.x >> 5)
        head_row = int64(batch * cuda.gridDim.y + head)
        if row < seqlen_q:  # the same for the whole warp, as the shuffles need
            acc = row_delta(do, o, do_st, o_st, head, batch, row, lane)
            if lane == 0:
                delta[head_row * padded_rows + row] = acc
                lse_log2[head_row * padded_rows + row] = row_log2_lse(
                    lse[head_row * seqlen_q + row]
                )
        elif row < padded_rows and lane == 0:  # past the end: every pair with the row is masked
            delta[head_row * padded_rows + row] = float32(0.0)
            lse_log2[head_row * padded_rows + row] = float32(0.0)

    return preprocess_padded if padded else preprocess


#: Threads of the sink-gradient kernel's block (a power of two: its tree reduction halves them).
SINK_GRADIENT_THREADS = 256


@functools.lru_cache(maxsize=None)
def build_sink_gradient():
    """dsinks[h] = -sum over batch and rows of exp(sinks[h] - lse) * D, the gradient of the
    loss by each head's sink logit (D = rowsum(dO * O), lse holding the sinks): one block a
    head, grid (nheads,), SINK_GRADIENT_THREADS threads, lse and D contiguous (batch, nheads,
    seqlen_q). Each thread sums a fixed stride of the rows and the block halves the partials
    in a fixed order: the same inputs give the same bits. A row whose lse is -inf (a -inf
    sink and no key) weighs nothing."""
    THREADS = SINK_GRADIENT_THREADS

    @kernel
    def sink_gradient(lse, delta, sinks, dsinks, batch, seqlen_q):
        part = cuda.shared.array(THREADS, float32)
        head = cuda.blockIdx.x
        nheads = cuda.gridDim.x
        tid = cuda.threadIdx.x
        sink = sinks[head]
        acc = float32(0.0)
        for b in range(batch):
            base = (int64(b) * nheads + head) * seqlen_q
            for i in range(tid, seqlen_q, THREADS):
                x = lse[base + i]
                if x != NEG_INF:
                    acc += ptx.exp2((sink - x) * float32(LOG2E)) * delta[base + i]
        part[tid] = acc
        cuda.syncthreads()
        width = THREADS // 2
        while width > 0:
            if tid < width:
                part[tid] += part[tid + width]
            cuda.syncthreads()
            width //= 2
        if tid == 0:
            dsinks[head] = -part[0]

    return sink_gradient


def _score_and_dp(head_dim):
    """A device function: (q . k, dO . v) of one query row and one key row, each pair of rows
    read at its own offset (q and dO share one, k and v the other)."""

    @device_function
    def score_and_dp(q, do, qd_offset, k, v, kv_offset):
        s = float32(0.0)
        dp = float32(0.0)
        for d in range(head_dim):
            s += q[qd_offset + d] * k[kv_offset + d]
            dp += do[qd_offset + d] * v[kv_offset + d]
        return s, dp

    return score_and_dp


def _row_pair_loader(head_dim, to_f32):
    """A device function: one row of each of two tensors into fp32 registers (each from its
    own offset), zeros where ``active`` is false (a thread past the last row)."""

    @device_function
    def load_row_pair(a, b, a_base, b_base, a_row, b_row, active):
        for d in range(head_dim):
            a_row[d] = to_f32(a[a_base + d]) if active else float32(0.0)
            b_row[d] = to_f32(b[b_base + d]) if active else float32(0.0)

    return load_row_pair


@functools.lru_cache(maxsize=None)
def build_dkdv(head_dim, dtype_name, block_m, block_n, varlen=False, softcap=0.0, alibi=False,
               mods=None):  # fmt: skip
    """dK and dV: grid (ceil(seqlen_k / block_n), nheads_k, batch), block_n threads. With
    ``varlen`` over a packed batch: the cumulative offsets cu_q, cu_k after the arrays, max
    lengths in place of the lengths, the arrays' row counts last. ``softcap``, ``alibi``,
    ``mods`` (a validation.Mods): the scores as the forward changed them (the slopes, then
    the mod_args, the kernel's ``*variant`` arrays; kernels/mods.py)."""
    HEAD_DIM = head_dim
    BLOCK_M = block_m
    BLOCK_N = block_n
    TILE = BLOCK_M * HEAD_DIM
    to_f32 = TO_F32[dtype_name]
    from_f32 = FROM_F32[dtype_name]

    load_q_do = tile_pair_loader(BLOCK_M, HEAD_DIM, BLOCK_N, to_f32)
    load_k_v = _row_pair_loader(HEAD_DIM, to_f32)
    score_and_dp = _score_and_dp(HEAD_DIM)
    SOFTCAP = softcap > 0  # the scores capped as the forward capped them
    cap_factors, capped_and_slope = softcap_gradient_functions(softcap if SOFTCAP else 1.0)
    slope_of, biased = alibi_functions(alibi)
    MODS = mods is not None
    user = mod_functions(mods, int(alibi))
    modded_and_factor = user.modded_and_factor
    BLOCK_MASK = MODS and mods.block_mask
    MASK_AT, MASK_END = user.block_mask_at, user.block_mask_at + 1

    @device_function
    def load_query_tile(
        q,
        do,
        lse,
        delta,
        q_tile,
        do_tile,
        lse_tile,
        d_tile,
        q_base,
        do_base,
        q_ss,
        do_ss,
        row_base,
        m0,
        seqlen_q,
        tid,
    ):
        """Rows m0..m0+BLOCK_M-1 of q and dO as fp32, with their LSE (log2) and D; rows past
        the end get zeros and an LSE of +inf (p = 0)."""
        load_q_do(q, do, q_tile, do_tile, q_base, do_base, q_ss, do_ss, m0, seqlen_q, tid)
        for r in range(tid, BLOCK_M, BLOCK_N):
            row = m0 + r
            if row < seqlen_q:
                lse_tile[r] = row_log2_lse(lse[row_base + row])
                d_tile[r] = delta[row_base + row]
            else:
                lse_tile[r] = -NEG_INF
                d_tile[r] = float32(0.0)

    @device_function
    def dkdv_block(
        q, k, v, do, lse, delta, dk, dv, offsets, row_off, row_head_stride, strides, seqlen_q,
        seqlen_k, heads_per_kv, scale, window, kv_head, n_block, variant, b,
    ):  # fmt: skip
        """dK and dV of keys n_block * BLOCK_N .. of one (sequence ``b``, kv head):
        ``offsets`` (q, k, v, do, dk, dv) index the sequence's row 0 (head 0) in each array,
        whose (batch, row, head) ``strides`` come alike; lse and D of (head, row) at row_off +
        head * row_head_stride + row; ``window`` is (left, right)."""
        q_off, k_off, v_off, do_off, dk_off, dv_off = offsets
        q_st, k_st, v_st, do_st, dk_st, dv_st = strides
        window_left, window_right = window
        _, q_ss, q_sh = q_st
        _, k_ss, k_sh = k_st
        _, v_ss, v_sh = v_st
        _, do_ss, do_sh = do_st
        _, dk_ss, dk_sh = dk_st
        _, dv_ss, dv_sh = dv_st
        q_tile = cuda.shared.array(TILE, float32)
        do_tile = cuda.shared.array(TILE, float32)
        lse_tile = cuda.shared.array(BLOCK_M, float32)
        d_tile = cuda.shared.array(BLOCK_M, float32)
        k_row = cuda.local.array(HEAD_DIM, float32)
        v_row = cuda.local.array(HEAD_DIM, float32)
        dk_acc = cuda.local.array(HEAD_DIM, float32)
        dv_acc = cuda.local.array(HEAD_DIM, float32)
        dk_tile_sum = cuda.local.array(HEAD_DIM, float32)
        dv_tile_sum = cuda.local.array(HEAD_DIM, float32)

        tid = cuda.threadIdx.x
        n0 = n_block * BLOCK_N
        key = n0 + tid
        active = key < seqlen_k
        last_key = min(n0 + BLOCK_N, seqlen_k) - 1
        m_lo, m_hi = block_query_range(n0, last_key, seqlen_q, seqlen_k, window_left, window_right)
        scale_log2 = scale * float32(LOG2E)
        cap_a, cap_b = float32(0.0), float32(0.0)
        if SOFTCAP:
            cap_a, cap_b = cap_factors(scale_log2)

        k_base = k_off + kv_head * k_sh + key * k_ss
        v_base = v_off + kv_head * v_sh + key * v_ss
        load_k_v(k, v, k_base, v_base, k_row, v_row, active)
        for d in range(HEAD_DIM):
            dk_acc[d] = float32(0.0)
            dv_acc[d] = float32(0.0)

        nheads = cuda.gridDim.y * heads_per_kv
        for head in range(kv_head * heads_per_kv, (kv_head + 1) * heads_per_kv):
            slope_h = slope_of(variant, b, head, nheads, float32(LOG2E))
            q_base = q_off + head * q_sh
            do_base = do_off + head * do_sh
            row_base = row_off + head * row_head_stride
            rows_lo, rows_hi = m_lo, m_hi
            if BLOCK_MASK:  # and the rows the block mask shows some key of the block
                index = variant[MASK_AT:MASK_END][0]
                bm_lo, bm_hi = query_ranges(index, b, head, n0, last_key)
                rows_lo, rows_hi = max(m_lo, bm_lo), min(m_hi, bm_hi)
            for m0 in range(rows_lo, rows_hi, BLOCK_M):
                cuda.syncthreads()  # every thread is done with the previous tile
                load_query_tile(
                    q,
                    do,
                    lse,
                    delta,
                    q_tile,
                    do_tile,
                    lse_tile,
                    d_tile,
                    q_base,
                    do_base,
                    q_ss,
                    do_ss,
                    row_base,
                    m0,
                    seqlen_q,
                    tid,
                )
                cuda.syncthreads()
                if active:
                    # -- this tile's sums first, then into the totals (see the docstring)
                    for d in range(HEAD_DIM):
                        dk_tile_sum[d] = float32(0.0)
                        dv_tile_sum[d] = float32(0.0)
                    for i in range(BLOCK_M):
                        lo, hi = visible_keys(m0 + i, seqlen_q, seqlen_k, window_left, window_right)
                        if lo <= key and key < hi and m0 + i < seqlen_q:
                            s, dp = score_and_dp(q_tile, do_tile, i * HEAD_DIM, k_row, v_row, 0)
                            slope = float32(1.0)
                            if SOFTCAP:
                                s, slope = capped_and_slope(s, cap_a, cap_b)
                            q_idx = float32(m0 + i + seqlen_k - seqlen_q)
                            score = biased(s * scale_log2, q_idx - float32(key), slope_h)
                            if MODS:
                                at = m0 + i + seqlen_k - seqlen_q
                                score, factor = modded_and_factor(score, b, head, at, key, variant)
                            p = ptx.exp2(score - lse_tile[i])
                            ds = p * (dp - d_tile[i])
                            if MODS:
                                ds = ds * factor
                            if SOFTCAP:
                                ds = ds * slope
                            for d in range(HEAD_DIM):
                                dv_tile_sum[d] += p * do_tile[i * HEAD_DIM + d]
                                dk_tile_sum[d] += ds * q_tile[i * HEAD_DIM + d]
                    for d in range(HEAD_DIM):
                        dk_acc[d] += dk_tile_sum[d]
                        dv_acc[d] += dv_tile_sum[d]

        if active:
            dk_base = dk_off + kv_head * dk_sh + key * dk_ss
            dv_base = dv_off + kv_head * dv_sh + key * dv_ss
            for d in range(HEAD_DIM):
                dk[dk_base + d] = from_f32(dk_acc[d] * scale)
                dv[dv_base + d] = from_f32(dv_acc[d])

    if varlen:

        @kernel
        def dkdv(
            q,
            k,
            v,
            do,
            lse,
            delta,
            dk,
            dv,
            cu_q,
            cu_k,
            q_st,
            k_st,
            v_st,
            do_st,
            dk_st,
            dv_st,
            max_seqlen_q,
            max_seqlen_k,
            heads_per_kv,
            scale,
            window_left,
            window_right,
            total_q,
            total_k,
            *variant,
        ):
            b = cuda.blockIdx.z
            q_start, seqlen_q = packed_sequence(cu_q, b, total_q, max_seqlen_q)
            k_start, seqlen_k = packed_sequence(cu_k, b, total_k, max_seqlen_k)
            if cuda.blockIdx.x * BLOCK_N >= seqlen_k:
                return  # past this sequence's keys: the whole block
            offsets = (
                q_start * q_st[1],
                k_start * k_st[1],
                k_start * v_st[1],
                q_start * do_st[1],
                k_start * dk_st[1],
                k_start * dv_st[1],
            )
            strides = (q_st, k_st, v_st, do_st, dk_st, dv_st)
            window = (window_left, window_right)
            dkdv_block(
                q, k, v, do, lse, delta, dk, dv, offsets, q_start, int64(total_q), strides,
                seqlen_q, seqlen_k, heads_per_kv, scale, window, cuda.blockIdx.y, cuda.blockIdx.x,
                variant, b,
            )  # fmt: skip

    else:

        @kernel
        def dkdv(
            q,
            k,
            v,
            do,
            lse,
            delta,
            dk,
            dv,
            q_st,
            k_st,
            v_st,
            do_st,
            dk_st,
            dv_st,
            seqlen_q,
            seqlen_k,
            heads_per_kv,
            scale,
            window_left,
            window_right,
            *variant,
        ):
            batch = cuda.blockIdx.z
            nheads = cuda.gridDim.y * heads_per_kv
            offsets = (
                batch * q_st[0],
                batch * k_st[0],
                batch * v_st[0],
                batch * do_st[0],
                batch * dk_st[0],
                batch * dv_st[0],
            )
            strides = (q_st, k_st, v_st, do_st, dk_st, dv_st)
            window = (window_left, window_right)
            row_off = int64(batch) * nheads * seqlen_q
            dkdv_block(
                q, k, v, do, lse, delta, dk, dv, offsets, row_off, int64(seqlen_q), strides,
                seqlen_q, seqlen_k, heads_per_kv, scale, window, cuda.blockIdx.y, cuda.blockIdx.x,
                variant, batch,
            )  # fmt: skip

    return dkdv


@functools.lru_cache(maxsize=None)
def build_dq(head_dim, dtype_name, block_m, block_n, varlen=False, softcap=0.0, alibi=False,
             mods=None):  # fmt: skip
    """dQ: grid (ceil(seqlen_q / block_m), nheads, batch), block_m threads (``varlen``,
    ``softcap``, ``alibi``, ``mods``: as :func:`build_dkdv`)."""
    HEAD_DIM = head_dim
    BLOCK_M = block_m
    BLOCK_N = block_n
    TILE = BLOCK_N * HEAD_DIM
    to_f32 = TO_F32[dtype_name]
    from_f32 = FROM_F32[dtype_name]

    # K_j, V_j (keys n0..n0+BLOCK_N-1) into shared memory as fp32; keys past the end are 0.
    load_kv_tile = tile_pair_loader(BLOCK_N, HEAD_DIM, BLOCK_M, to_f32)
    load_q_do = _row_pair_loader(HEAD_DIM, to_f32)
    score_and_dp = _score_and_dp(HEAD_DIM)
    SOFTCAP = softcap > 0  # the scores capped as the forward capped them
    cap_factors, capped_and_slope = softcap_gradient_functions(softcap if SOFTCAP else 1.0)
    slope_of, biased = alibi_functions(alibi)
    MODS = mods is not None
    user = mod_functions(mods, int(alibi))
    modded_and_factor = user.modded_and_factor
    BLOCK_MASK = MODS and mods.block_mask
    MASK_AT, MASK_END = user.block_mask_at, user.block_mask_at + 1

    @device_function
    def dq_block(
        q, k, v, do, lse, delta, dq, offsets, row_base, strides, seqlen_q, seqlen_k, scale,
        window, head, kv_head, m_block, alibi_slope, variant, b,
    ):  # fmt: skip
        """dQ of query block m_block of one (sequence ``b``, head): ``offsets`` (q, k, v, do,
        dq) index the sequence's row 0 (head 0) in each array, whose (batch, row, head)
        ``strides`` come alike; lse and D of row i at row_base + i; ``window`` is (left,
        right); ``alibi_slope`` the head's (log2 domain), read only with ALiBi; ``variant``
        the kernel's ``*variant`` arrays (the mod_args, read only with ``mods``)."""
        q_off, k_off, v_off, do_off, dq_off = offsets
        q_st, k_st, v_st, do_st, dq_st = strides
        window_left, window_right = window
        _, q_ss, q_sh = q_st
        _, k_ss, k_sh = k_st
        _, v_ss, v_sh = v_st
        _, do_ss, do_sh = do_st
        _, dq_ss, dq_sh = dq_st
        k_tile = cuda.shared.array(TILE, float32)
        v_tile = cuda.shared.array(TILE, float32)
        q_row = cuda.local.array(HEAD_DIM, float32)
        do_row = cuda.local.array(HEAD_DIM, float32)
        dq_acc = cuda.local.array(HEAD_DIM, float32)
        dq_tile_sum = cuda.local.array(HEAD_DIM, float32)

        tid = cuda.threadIdx.x
        m0, row, active, n_lo, n_hi, lo, hi = query_row_position(
            m_block, tid, BLOCK_M, seqlen_q, seqlen_k, window_left, window_right
        )
        if BLOCK_MASK:  # and the keys the block mask shows some row of the block
            last_row = min(m0 + BLOCK_M, seqlen_q) - 1
            index = variant[MASK_AT:MASK_END][0]
            bm_lo, bm_hi, _, _ = key_ranges(index, b, head, m0, last_row)
            n_lo, n_hi = max(n_lo, bm_lo), min(n_hi, bm_hi)
        scale_log2 = scale * float32(LOG2E)
        cap_a, cap_b = float32(0.0), float32(0.0)
        if SOFTCAP:
            cap_a, cap_b = cap_factors(scale_log2)

        q_base = q_off + head * q_sh + row * q_ss
        do_base = do_off + head * do_sh + row * do_ss
        load_q_do(q, do, q_base, do_base, q_row, do_row, active)
        for d in range(HEAD_DIM):
            dq_acc[d] = float32(0.0)
        row_lse = -NEG_INF
        row_d = float32(0.0)
        q_idx = float32(row + seqlen_k - seqlen_q)
        if active:
            row_lse = row_log2_lse(lse[row_base + row])
            row_d = delta[row_base + row]

        k_base = k_off + kv_head * k_sh
        v_base = v_off + kv_head * v_sh
        for n0 in range(n_lo, n_hi, BLOCK_N):
            cuda.syncthreads()  # every thread is done with the previous tile
            load_kv_tile(k, v, k_tile, v_tile, k_base, v_base, k_ss, v_ss, n0, seqlen_k, tid)
            cuda.syncthreads()
            for d in range(HEAD_DIM):  # this tile's sum first, then into the total
                dq_tile_sum[d] = float32(0.0)
            for j in range(BLOCK_N):
                key = n0 + j
                if lo <= key and key < hi:
                    s, dp = score_and_dp(q_row, do_row, 0, k_tile, v_tile, j * HEAD_DIM)
                    slope = float32(1.0)
                    if SOFTCAP:
                        s, slope = capped_and_slope(s, cap_a, cap_b)
                    score = biased(s * scale_log2, q_idx - float32(key), alibi_slope)
                    factor = float32(1.0)
                    if MODS:  # rows of the sequence only: the user's functions index by them
                        factor = float32(0.0)
                        if active:
                            at = row + seqlen_k - seqlen_q
                            score, factor = modded_and_factor(score, b, head, at, key, variant)
                    ds = ptx.exp2(score - row_lse) * (dp - row_d)
                    if MODS:
                        ds = ds * factor
                    if SOFTCAP:
                        ds = ds * slope
                    for d in range(HEAD_DIM):
                        dq_tile_sum[d] += ds * k_tile[j * HEAD_DIM + d]
            for d in range(HEAD_DIM):
                dq_acc[d] += dq_tile_sum[d]

        if active:
            dq_base = dq_off + head * dq_sh + row * dq_ss
            for d in range(HEAD_DIM):
                dq[dq_base + d] = from_f32(dq_acc[d] * scale)

    if varlen:

        @kernel
        def dq_kernel(
            q,
            k,
            v,
            do,
            lse,
            delta,
            dq,
            cu_q,
            cu_k,
            q_st,
            k_st,
            v_st,
            do_st,
            dq_st,
            max_seqlen_q,
            max_seqlen_k,
            heads_per_kv,
            scale,
            window_left,
            window_right,
            total_q,
            total_k,
            *variant,
        ):
            head = cuda.blockIdx.y
            b = cuda.blockIdx.z
            q_start, seqlen_q = packed_sequence(cu_q, b, total_q, max_seqlen_q)
            k_start, seqlen_k = packed_sequence(cu_k, b, total_k, max_seqlen_k)
            if cuda.blockIdx.x * BLOCK_M >= seqlen_q:
                return  # past this sequence's rows: the whole block
            offsets = (
                q_start * q_st[1],
                k_start * k_st[1],
                k_start * v_st[1],
                q_start * do_st[1],
                q_start * dq_st[1],
            )
            strides = (q_st, k_st, v_st, do_st, dq_st)
            window = (window_left, window_right)
            row_base = int64(head) * total_q + q_start
            dq_block(
                q, k, v, do, lse, delta, dq, offsets, row_base, strides, seqlen_q, seqlen_k, scale,
                window, head, head // heads_per_kv, cuda.blockIdx.x,
                slope_of(variant, b, head, cuda.gridDim.y, float32(LOG2E)), variant, b,
            )  # fmt: skip

    else:

        @kernel
        def dq_kernel(
            q,
            k,
            v,
            do,
            lse,
            delta,
            dq,
            q_st,
            k_st,
            v_st,
            do_st,
            dq_st,
            seqlen_q,
            seqlen_k,
            heads_per_kv,
            scale,
            window_left,
            window_right,
            *variant,
        ):
            head = cuda.blockIdx.y
            batch = cuda.blockIdx.z
            offsets = (
                batch * q_st[0],
                batch * k_st[0],
                batch * v_st[0],
                batch * do_st[0],
                batch * dq_st[0],
            )
            strides = (q_st, k_st, v_st, do_st, dq_st)
            window = (window_left, window_right)
            row_base = (int64(batch) * cuda.gridDim.y + head) * seqlen_q
            dq_block(
                q, k, v, do, lse, delta, dq, offsets, row_base, strides, seqlen_q, seqlen_k, scale,
                window, head, head // heads_per_kv, cuda.blockIdx.x,
                slope_of(variant, batch, head, cuda.gridDim.y, float32(LOG2E)), variant, batch,
            )  # fmt: skip

    return dq_kernel
