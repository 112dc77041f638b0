"""Portable tiled attention forward: shared-memory tiles and fp32 math, no tensor cores.

FlashAttention's algorithm (Dao et al., 2022; the online softmax of Milakov & Gimelshein, 2018)
without any warp-level instruction, so it runs on every GPU that numba-cuda supports and in the
CUDA simulator. It is the path for float32 inputs and for GPUs older than Ampere, and the
baseline the tensor-core kernel is tested against.

Partitioning: one thread block per (block of BLOCK_M query rows, head, batch) and one thread per
query row, holding that row of Q and of the output accumulator in fp32. Each tile of BLOCK_N keys
and values is loaded into shared memory once (converted to fp32) and read by every thread.

Supports: float16, bfloat16 (both as uint16 bits) and float32; any head_dim up to 256; GQA;
causal and sliding-window masks aligned bottom-right; seqlen_q != seqlen_k; rows that see no key
(output 0, LSE -inf); a softcap of the scores (a compile-time constant); sink logits (one a
head) and ALiBi slopes, the ``*variant`` arrays (compile-time switches); a user's score_mod
and mask_mod (kernels/mods.py, their mod_args the last ``*variant`` arrays). Packed batches:
:func:`build_varlen`. Does not: dropout.
"""

import functools

from numba import cuda, float32, int64

from . import ptx
from .block_mask import key_ranges
from .jit import device_function, kernel
from .mask import block_key_range, visible_keys
from .mods import mod_functions
from .softmax import (
    LOG2E,
    NEG_INF,
    alibi_functions,
    final_lse,
    inverse_sum,
    shift_of,
    sink_functions,
    softcap_functions,
)


@device_function
def _identity(x):
    return float32(x)


#: How each input dtype's elements become fp32 and back (16-bit types travel as uint16 bits).
TO_F32 = {"float16": ptx.f16_to_f32, "bfloat16": ptx.bf16_to_f32, "float32": _identity}
FROM_F32 = {"float16": ptx.f32_to_f16, "bfloat16": ptx.f32_to_bf16, "float32": _identity}


def tile_pair_loader(rows, head_dim, threads, to_f32):
    """A device function that copies rows ``r0..r0+rows-1`` of two tensors (element offsets
    ``a_base``, ``b_base``, row strides ``a_ss``, ``b_ss``) into two fp32 shared tiles of
    ``rows x head_dim``, ``threads`` threads sharing the work; rows at or past ``n_rows`` are 0."""
    TILE = rows * head_dim

    @device_function
    def load(a, b, a_tile, b_tile, a_base, b_base, a_ss, b_ss, r0, n_rows, tid):
        for idx in range(tid, TILE, threads):
            r = idx // head_dim
            d = idx - r * head_dim
            row = r0 + r
            if row < n_rows:
                a_tile[idx] = to_f32(a[a_base + row * a_ss + d])
                b_tile[idx] = to_f32(b[b_base + row * b_ss + d])
            else:
                a_tile[idx] = float32(0.0)
                b_tile[idx] = float32(0.0)

    return load


@functools.lru_cache(maxsize=None)
def tile_absorber(block_n, head_dim):
    """The device function ``absorb_tile(s, v_tile, acc, m_i, m_new, l_i) -> l_i``: one thread's
    online-softmax update with a tile's scores ``s`` (log2 domain, -inf where hidden) whose
    max with m_i is m_new: acc and l_i are rescaled to m_new, then acc += P V and l_i += sum P
    with P = exp2(s - m_new). Keys with P = 0 are skipped."""
    BLOCK_N, HEAD_DIM = block_n, head_dim

    @device_function
    def absorb_tile(s, v_tile, acc, m_i, m_new, l_i):
        shift = shift_of(m_new)
        alpha = ptx.exp2(m_i - shift)
        l_i *= alpha
        for d in range(HEAD_DIM):
            acc[d] *= alpha
        for j in range(BLOCK_N):
            p = ptx.exp2(s[j] - shift)
            if p != float32(0.0):
                l_i += p
                for d in range(HEAD_DIM):
                    acc[d] += p * v_tile[j * HEAD_DIM + d]
        return l_i

    return absorb_tile


@device_function
def packed_sequence(cu_seqlens, b, total, max_len):
    """(first row, length) of sequence b of a packed batch: rows cu_seqlens[b] ..
    cu_seqlens[b + 1] - 1 clamped to [0, total), at most ``max_len`` of them."""
    start = min(max(cu_seqlens[b], 0), total)
    end = min(max(cu_seqlens[b + 1], start), total)
    return int64(start), min(end - start, max_len)


@device_function
def dense_bases(strides, b, head, kv_head, seqlen_q, nheads):
    """Where row 0 of (batch ``b``, ``head``) starts in q, k and v (at ``kv_head``), o, and
    lse (batch, nheads, seqlen_q), for arrays whose (batch, seqlen, head) element strides are
    ``strides`` (q, k, v, o)."""
    q_st, k_st, v_st, o_st = strides
    return (
        b * q_st[0] + head * q_st[2],
        b * k_st[0] + kv_head * k_st[2],
        b * v_st[0] + kv_head * v_st[2],
        b * o_st[0] + head * o_st[2],
        (int64(b) * nheads + head) * seqlen_q,
    )


@device_function
def packed_bases(strides, q_start, k_start, head, kv_head, total_q):
    """As :func:`dense_bases` for the sequence of a packed batch whose rows start at
    ``q_start`` and ``k_start`` (packed_sequence); lse (nheads, total_q)."""
    q_st, k_st, v_st, o_st = strides
    return (
        q_start * q_st[1] + head * q_st[2],
        k_start * k_st[1] + kv_head * k_st[2],
        k_start * v_st[1] + kv_head * v_st[2],
        q_start * o_st[1] + head * o_st[2],
        int64(head) * total_q + q_start,
    )


@device_function
def query_row_position(m_block, tid, block_m, seqlen_q, seqlen_k, window_left, window_right):
    """Where thread ``tid`` of query block ``m_block`` works, one thread per query row:
    (m0, row, active, n_lo, n_hi, lo, hi), ``[n_lo, n_hi)`` the keys any row of the block
    sees and ``[lo, hi)`` those this thread's row sees."""
    m0 = m_block * block_m
    row = m0 + tid
    active = row < seqlen_q
    last_row = min(m0 + block_m, seqlen_q) - 1
    n_lo, n_hi = block_key_range(m0, last_row, seqlen_q, seqlen_k, window_left, window_right)
    lo, hi = visible_keys(row, seqlen_q, seqlen_k, window_left, window_right)
    return m0, row, active, n_lo, n_hi, lo, hi


@functools.lru_cache(maxsize=None)
def row_attender(
    head_dim, dtype_name, block_m, block_n, softcap=0.0, sinks=False, alibi=False, mods=None
):  # fmt: skip
    """The device function ``attend_rows(q, k, v, o, lse, bases, row_strides, seqlen_q,
    seqlen_k, scale_log2, window, m_block, sink, slope, b, head, variant)``: query block
    ``m_block`` of one (sequence ``b``, ``head``), one thread per row. ``bases`` (q, k, v, o,
    lse) index the sequence's row 0 for this head (lse: row 0's entry), rows ``row_strides``
    (q, k, v, o) elements apart; ``window`` is (left, right). ``softcap`` > 0 caps the scores
    (softmax.softcap_functions); with ``sinks`` the head's ``sink`` joins each row's sum
    (softmax.sink_functions); with ``alibi`` the scores less ``slope`` (log2 domain) times
    the distance (softmax.alibi_functions); ``mods`` (a validation.Mods): the user's
    score_mod and mask_mod after them (kernels/mods.py, mod_args in ``variant``)."""
    SOFTCAP = softcap > 0
    MODS = mods is not None
    _, with_sink = sink_functions(sinks)
    _, biased = alibi_functions(alibi)
    user = mod_functions(mods, int(sinks) + int(alibi))
    modded = user.modded
    BLOCK_MASK = MODS and mods.block_mask
    MASK_AT, MASK_END = user.block_mask_at, user.block_mask_at + 1
    cap_factors, capped = softcap_functions(softcap if SOFTCAP else 1.0)
    HEAD_DIM = head_dim
    BLOCK_M = block_m
    BLOCK_N = block_n
    TILE = BLOCK_N * HEAD_DIM
    to_f32 = TO_F32[dtype_name]
    from_f32 = FROM_F32[dtype_name]
    # K_j, V_j (keys n0..n0+BLOCK_N-1) into shared memory as fp32; keys past the end are 0.
    load_kv_tile = tile_pair_loader(BLOCK_N, HEAD_DIM, BLOCK_M, to_f32)
    absorb_tile = tile_absorber(BLOCK_N, HEAD_DIM)

    @device_function
    def attend_rows(
        q, k, v, o, lse, bases, row_strides, seqlen_q, seqlen_k, scale_log2, window, m_block,
        sink, slope, b, head, variant,
    ):  # fmt: skip
        q_base, k_base, v_base, o_base, lse_base = bases
        q_ss, k_ss, v_ss, o_ss = row_strides
        window_left, window_right = window
        k_tile = cuda.shared.array(TILE, float32)
        v_tile = cuda.shared.array(TILE, float32)
        q_row = cuda.local.array(HEAD_DIM, float32)
        acc = cuda.local.array(HEAD_DIM, float32)
        s = cuda.local.array(BLOCK_N, float32)

        tid = cuda.threadIdx.x
        m0, row, active, n_lo, n_hi, lo, hi = query_row_position(
            m_block, tid, BLOCK_M, seqlen_q, seqlen_k, window_left, window_right
        )
        if BLOCK_MASK:  # and the keys the block mask shows some row of the block
            last_row = min(m0 + BLOCK_M, seqlen_q) - 1
            bm_lo, bm_hi, _, _ = key_ranges(variant[MASK_AT:MASK_END][0], b, head, m0, last_row)
            n_lo, n_hi = max(n_lo, bm_lo), min(n_hi, bm_hi)

        q_at = q_base + row * q_ss
        for d in range(HEAD_DIM):
            q_row[d] = to_f32(q[q_at + d]) if active else float32(0.0)
            acc[d] = float32(0.0)
        m_i = NEG_INF
        l_i = float32(0.0)
        q_idx = float32(row + seqlen_k - seqlen_q)  # the row's position among the keys
        cap_a, cap_b = float32(0.0), float32(0.0)
        if SOFTCAP:
            cap_a, cap_b = cap_factors(scale_log2)

        for n0 in range(n_lo, n_hi, BLOCK_N):
            cuda.syncthreads()  # every thread is done with the previous tile
            load_kv_tile(k, v, k_tile, v_tile, k_base, v_base, k_ss, v_ss, n0, seqlen_k, tid)
            cuda.syncthreads()

            # -- s = q K_j^T * scale * log2(e); keys this row does not see -> -inf
            m_new = m_i
            for j in range(BLOCK_N):
                key = n0 + j
                score = NEG_INF
                if lo <= key and key < hi:
                    dot = float32(0.0)
                    for d in range(HEAD_DIM):
                        dot += q_row[d] * k_tile[j * HEAD_DIM + d]
                    if SOFTCAP:
                        dot = capped(dot, cap_a, cap_b)
                    score = biased(dot * scale_log2, q_idx - float32(key), slope)
                    if MODS:  # rows of the sequence only: the user's functions index by them
                        at = row + seqlen_k - seqlen_q
                        score = modded(score, b, head, at, key, variant) if active else NEG_INF
                s[j] = score
                m_new = max(m_new, score)

            # -- update m_i and l_i; acc = alpha * acc + p V_j
            l_i = absorb_tile(s, v_tile, acc, m_i, m_new, l_i)
            m_i = m_new

        if active:
            m_i, l_i, factor = with_sink(m_i, l_i, sink)
            inv_l = inverse_sum(l_i) * factor
            o_at = o_base + row * o_ss
            for d in range(HEAD_DIM):
                o[o_at + d] = from_f32(acc[d] * inv_l)
            lse[lse_base + row] = final_lse(m_i, l_i)

    return attend_rows


@functools.lru_cache(maxsize=None)
def build(head_dim, dtype_name, block_m, block_n, softcap=0.0, sinks=False, alibi=False,
          mods=None):  # fmt: skip
    """The portable forward kernel specialised for one (head_dim, dtype, tile, variant) key."""
    attend_rows = row_attender(head_dim, dtype_name, block_m, block_n, softcap, sinks, alibi, mods)
    sink_of, _ = sink_functions(sinks)
    slope_of, _ = alibi_functions(alibi, sinks)

    @kernel
    def forward_portable(
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
        m_block = cuda.blockIdx.x
        head = cuda.blockIdx.y
        batch = cuda.blockIdx.z
        kv_head = head // heads_per_kv
        bases = dense_bases((q_st, k_st, v_st, o_st), batch, head, kv_head, seqlen_q,
                            cuda.gridDim.y)  # fmt: skip
        attend_rows(
            q, k, v, o, lse, bases, (q_st[1], k_st[1], v_st[1], o_st[1]), seqlen_q, seqlen_k,
            scale_log2, (window_left, window_right), m_block, sink_of(variant, head),
            slope_of(variant, batch, head, cuda.gridDim.y, float32(LOG2E)), batch, head, variant,
        )  # fmt: skip

    return forward_portable


@functools.lru_cache(maxsize=None)
def build_varlen(head_dim, dtype_name, block_m, block_n, softcap=0.0, sinks=False, alibi=False,
                 mods=None):  # fmt: skip
    """The portable forward over a packed batch: q (total_q, nheads, head_dim), k and v
    (total_k, nheads_k, head_dim), sequence b at rows cu_q[b] .. cu_q[b + 1] - 1 (keys alike);
    grid (ceil(max_seqlen_q / block_m), nheads, batch). Offsets are clamped to the arrays and
    lengths to max_seqlen: no read or write leaves q, k, v, o or lse (nheads, total_q)."""
    attend_rows = row_attender(head_dim, dtype_name, block_m, block_n, softcap, sinks, alibi, mods)
    sink_of, _ = sink_functions(sinks)
    slope_of, _ = alibi_functions(alibi, sinks)
    BLOCK_M = block_m

    @kernel
    def forward_portable_varlen(
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
        head = cuda.blockIdx.y
        b = cuda.blockIdx.z
        q_start, seqlen_q = packed_sequence(cu_q, b, total_q, max_seqlen_q)
        k_start, seqlen_k = packed_sequence(cu_k, b, total_k, max_seqlen_k)
        m_block = cuda.blockIdx.x
        if m_block * BLOCK_M >= seqlen_q:
            return  # past this sequence's end: the whole block
        kv_head = head // heads_per_kv
        bases = packed_bases((q_st, k_st, v_st, o_st), q_start, k_start, head, kv_head, total_q)
        attend_rows(
            q, k, v, o, lse, bases, (q_st[1], k_st[1], v_st[1], o_st[1]), seqlen_q, seqlen_k,
            scale_log2, (window_left, window_right), m_block, sink_of(variant, head),
            slope_of(variant, b, head, cuda.gridDim.y, float32(LOG2E)), b, head, variant,
        )  # fmt: skip

    return forward_portable_varlen
