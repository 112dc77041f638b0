"""Attention over a KV cache (decoding), portable: in-place append, paged or contiguous caches,
split-KV with an fp32 combine. No tensor cores: the correctness path for every GPU and the
simulator, and the reference the fast decode kernels are tested against.

Three kernels, launched in order on one stream:

1. ``append``: new rows k, v (batch, seqlen_new, nheads_k, head_dim) into the cache at
   positions cache_seqlens[b] .. + seqlen_new - 1 of sequence b, one warp per (new row, kv
   head, batch). A position at or past the sequence's capacity, or on a page whose block-table
   entry is out of range, is not written.
2. ``split_attention``: one block per (split, block of query rows, kv head, batch). The rows of
   a block are the (query head of the kv head's GQA group, query position) pairs, one thread
   each, so every K/V tile a block loads serves the whole group. Split ``s`` covers keys
   [s * chunk, (s + 1) * chunk) of the sequence's keys (cache_seqlens[b] + seqlen_new, at most
   its capacity); each thread runs the online softmax over its row's visible keys there and
   writes an unnormalised-free partial: O_s (normalised within the split, fp32) and LSE_s.
3. ``combine``: out = sum_s exp(LSE_s - LSE) O_s with LSE = log sum_s exp(LSE_s), one block
   per (query row, head), one thread per column; rows that see no key get 0 and -inf.

Keys are addressed through ``key_row``: the cache slot cache_batch_idx[b] (contiguous) or the
page block_table[b, j // page_size] (paged). Whatever the device-side index arrays hold, no
read or write leaves the arrays: sequence lengths are clamped to [0, capacity], page and slot
indices outside their range are skipped (their keys read as absent).

Supports: float16, bfloat16, float32; head_dim up to 256; GQA; causal and window masks aligned
bottom-right against each sequence's length after the append.
"""

import functools
import math

from numba import cuda, float32, int32, int64, uint16

from . import ptx
from .forward_portable import FROM_F32, TO_F32, tile_absorber
from .jit import device_function, kernel
from .mask import visible_keys
from .mods import mod_functions
from .softmax import LN2, LOG2E, NEG_INF, alibi_functions, final_lse, inverse_sum, softcap_functions


@device_function
def clamp(x, lo, hi):
    return min(max(x, lo), hi)


@functools.lru_cache(maxsize=None)
def address_function(paged):
    """The device function ``key_row(b, j, batch_idx, block_table, page_size, max_blocks,
    slots)``: (found, cache slot or page, row within it) of key j of sequence b."""
    PAGED = paged

    @device_function
    def key_row(b, j, batch_idx, block_table, page_size, max_blocks, slots):
        if PAGED:
            page = block_table[int64(b) * max_blocks + j // page_size]
            return (page >= 0) & (page < slots), int64(page), j - (j // page_size) * page_size
        slot = batch_idx[b]
        return (slot >= 0) & (slot < slots), int64(slot), j

    return key_row


@device_function
def sequence_length(seqlens, b, seqlen_new, capacity):
    """Keys of sequence b after the append: cache_seqlens[b] + seqlen_new within [0, capacity]."""
    return clamp(seqlens[b] + seqlen_new, 0, capacity)


#: Threads of an append block: one warp a (new row, kv head, sequence), each lane copying
#: ceil(head_dim / 32) elements of K and of V, every load issued before the first store: 6.1 us
#: against 6.6-8.0 for head_dim threads an element each (H200, docs/performance.md).
APPEND_THREADS = 32


@functools.lru_cache(maxsize=None)
def build_append(head_dim, dtype_name, paged):
    """The append kernel: grid (seqlen_new, nheads_k, batch), APPEND_THREADS threads."""
    HEAD_DIM = head_dim
    PER_LANE = -(-head_dim // APPEND_THREADS)
    ELEM = float32 if dtype_name == "float32" else uint16
    key_row = address_function(paged)

    @kernel
    def append(
        k,
        v,
        k_cache,
        v_cache,
        seqlens,
        batch_idx,
        block_table,
        k_st,
        v_st,
        kc_st,
        vc_st,
        page_size,
        max_blocks,
        slots,
        capacity,
    ):
        k_sb, k_ss, k_sh = k_st
        v_sb, v_ss, v_sh = v_st
        kc_sb, kc_ss, kc_sh = kc_st
        vc_sb, vc_ss, vc_sh = vc_st
        i = cuda.blockIdx.x
        h = cuda.blockIdx.y
        b = cuda.blockIdx.z
        lane = cuda.threadIdx.x
        pos = seqlens[b] + i
        if 0 <= pos and pos < capacity:
            found, slot, row = key_row(b, pos, batch_idx, block_table, page_size, max_blocks, slots)
            if found:
                ks = cuda.local.array(PER_LANE, ELEM)
                vs = cuda.local.array(PER_LANE, ELEM)
                k_at = b * k_sb + i * k_ss + h * k_sh + lane
                v_at = b * v_sb + i * v_ss + h * v_sh + lane
                for j in range(PER_LANE):  # every load first: they are in flight together
                    if lane + j * APPEND_THREADS < HEAD_DIM:
                        ks[j] = k[k_at + j * APPEND_THREADS]
                        vs[j] = v[v_at + j * APPEND_THREADS]
                kc_at = slot * kc_sb + row * kc_ss + h * kc_sh + lane
                vc_at = slot * vc_sb + row * vc_ss + h * vc_sh + lane
                for j in range(PER_LANE):
                    if lane + j * APPEND_THREADS < HEAD_DIM:
                        k_cache[kc_at + j * APPEND_THREADS] = ks[j]
                        v_cache[vc_at + j * APPEND_THREADS] = vs[j]

    return append


@functools.lru_cache(maxsize=None)
def build_split_attention(
    head_dim, dtype_name, block_m, block_n, paged, softcap=0.0, sinks=False, alibi=False,
    mods=None,
):  # fmt: skip
    """The split-KV kernel: grid (num_splits * ceil(group * seqlen_q / block_m), nheads_k,
    batch), block_m threads; ``softcap`` > 0 caps the scores (softmax.softcap_functions);
    with ``alibi`` each row's head's slope times the distance is taken from its scores (the
    slopes the ``*variant`` array after the sinks, which ``sinks`` says it is handed and the
    combine reads); ``mods`` (a validation.Mods): the user's score_mod and mask_mod after
    them on each score the row sees (kernels/mods.py; q_idx the query's position in the
    sequence after the append, the mod_args the ``*variant`` arrays after the slopes)."""
    HEAD_DIM, BLOCK_M, BLOCK_N = head_dim, block_m, block_n
    SOFTCAP = softcap > 0
    cap_factors, capped = softcap_functions(softcap if SOFTCAP else 1.0)
    slope_of, biased = alibi_functions(alibi, sinks)
    TILE = BLOCK_N * HEAD_DIM
    to_f32 = TO_F32[dtype_name]
    key_row = address_function(paged)
    absorb_tile = tile_absorber(BLOCK_N, HEAD_DIM)
    MODS = mods is not None
    modded = mod_functions(mods, int(sinks) + int(alibi)).modded

    @device_function
    def load_tile(tiles, cache, index, b, n0, n_end, kv_head, tid):
        """Keys n0 .. n0 + BLOCK_N - 1 of sequence b (those below n_end) into ``tiles`` (the K
        and V tiles, fp32, and which of their keys exist: a key behind an out-of-range slot
        or page does not), from ``cache`` (k_cache, v_cache and their strides) through
        ``index`` (batch_idx, block_table, page_size, max_blocks, slots: key_row's)."""
        k_tile, v_tile, present = tiles
        k_cache, v_cache, kc_st, vc_st = cache
        batch_idx, block_table, page_size, max_blocks, slots = index
        kc_sb, kc_ss, kc_sh = kc_st
        vc_sb, vc_ss, vc_sh = vc_st
        for r in range(tid, BLOCK_N, BLOCK_M):
            j = n0 + r
            found = False
            slot = int64(0)
            row = j
            if j < n_end:
                found, slot, row = key_row(
                    b, j, batch_idx, block_table, page_size, max_blocks, slots
                )
            present[r] = 1 if found else 0
            k_at = slot * kc_sb + row * kc_ss + kv_head * kc_sh
            v_at = slot * vc_sb + row * vc_ss + kv_head * vc_sh
            for d in range(HEAD_DIM):
                k_tile[r * HEAD_DIM + d] = to_f32(k_cache[k_at + d]) if found else float32(0.0)
                v_tile[r * HEAD_DIM + d] = to_f32(v_cache[v_at + d]) if found else float32(0.0)

    @kernel
    def split_attention(
        q,
        k_cache,
        v_cache,
        seqlens,
        batch_idx,
        block_table,
        o_part,
        lse_part,
        q_st,
        kc_st,
        vc_st,
        seqlen_q,
        seqlen_new,
        heads_per_kv,
        scale_log2,
        window_left,
        window_right,
        page_size,
        max_blocks,
        slots,
        capacity,
        num_splits,
        chunk,
        *variant,
    ):
        q_sb, q_ss, q_sh = q_st
        k_tile = cuda.shared.array(TILE, float32)
        v_tile = cuda.shared.array(TILE, float32)
        present = cuda.shared.array(BLOCK_N, int32)
        q_row = cuda.local.array(HEAD_DIM, float32)
        acc = cuda.local.array(HEAD_DIM, float32)
        s = cuda.local.array(BLOCK_N, float32)

        tid = cuda.threadIdx.x
        split = cuda.blockIdx.x % num_splits
        r = (cuda.blockIdx.x // num_splits) * BLOCK_M + tid  # (head in group, position) pair
        kv_head = cuda.blockIdx.y
        b = cuda.blockIdx.z
        active = r < heads_per_kv * seqlen_q
        head = kv_head * heads_per_kv + r // seqlen_q
        i = r - (r // seqlen_q) * seqlen_q
        seqlen_k = sequence_length(seqlens, b, seqlen_new, capacity)
        n_start = split * chunk
        n_end = min(n_start + chunk, seqlen_k)
        lo, hi = visible_keys(i, seqlen_q, seqlen_k, window_left, window_right)
        q_base = b * q_sb + i * q_ss + head * q_sh
        for d in range(HEAD_DIM):
            q_row[d] = to_f32(q[q_base + d]) if active else float32(0.0)
            acc[d] = float32(0.0)
        m_i = NEG_INF
        cap_a, cap_b = float32(0.0), float32(0.0)
        if SOFTCAP:  # once a thread, not once a score
            cap_a, cap_b = cap_factors(scale_log2)
        slope = float32(0.0)  # ALiBi's, log2 domain
        if active:
            slope = slope_of(variant, b, head, cuda.gridDim.y * heads_per_kv, float32(LOG2E))
        q_idx = float32(i + seqlen_k - seqlen_q)
        l_i = float32(0.0)
        for n0 in range(n_start, n_end, BLOCK_N):
            cuda.syncthreads()  # every thread is done with the previous tile
            load_tile(
                (k_tile, v_tile, present),
                (k_cache, v_cache, kc_st, vc_st),
                (batch_idx, block_table, page_size, max_blocks, slots),
                b,
                n0,
                n_end,
                kv_head,
                tid,
            )
            cuda.syncthreads()
            # -- s = q K^T * scale * log2(e) over this row's visible, present keys; -inf elsewhere
            m_new = m_i
            for jj in range(BLOCK_N):
                j = n0 + jj
                score = NEG_INF
                if active and lo <= j and j < hi and j < n_end and present[jj] == 1:
                    dot = float32(0.0)
                    for d in range(HEAD_DIM):
                        dot += q_row[d] * k_tile[jj * HEAD_DIM + d]
                    if SOFTCAP:
                        dot = capped(dot, cap_a, cap_b)
                    score = biased(dot * scale_log2, q_idx - float32(j), slope)
                    if MODS:
                        score = modded(score, b, head, int32(i + seqlen_k - seqlen_q), j, variant)
                s[jj] = score
                m_new = max(m_new, score)
            # -- update m_i and l_i; acc = alpha * acc + p V
            l_i = absorb_tile(s, v_tile, acc, m_i, m_new, l_i)
            m_i = m_new
        if active:
            # partials: (split, batch, head, position) rows of head_dim fp32, and their LSE
            at = ((int64(split) * cuda.gridDim.z + b) * (cuda.gridDim.y * heads_per_kv) + head) * (
                seqlen_q
            ) + i
            inv_l = inverse_sum(l_i)
            for d in range(HEAD_DIM):
                o_part[at * HEAD_DIM + d] = acc[d] * inv_l
            lse_part[at] = final_lse(m_i, l_i)

    return split_attention


def combine_threads(head_dim):
    """Threads of a combine block: one per output column, whole warps."""
    return max(32, (head_dim + 31) // 32 * 32)


@functools.lru_cache(maxsize=None)
def build_combine(head_dim, dtype_name, sinks=False):
    """The combine kernel: grid (nheads * seqlen_q, batch), combine_threads(head_dim) threads,
    one output column each (the split weights are recomputed by every thread: num_splits
    exp2 a thread, from values the whole block reads at once). With ``sinks`` the head's sink
    logit (the ``*variant`` array) joins the sum as a split with no value."""
    HEAD_DIM = head_dim
    SINKS = sinks
    from_f32 = FROM_F32[dtype_name]

    @kernel
    def combine(o_part, lse_part, out, lse, out_st, seqlen_q, nheads, num_splits, *variant):
        o_sb, o_ss, o_sh = out_st
        r = cuda.blockIdx.x  # head * seqlen_q + position
        b = cuda.blockIdx.y
        d = cuda.threadIdx.x
        head = r // seqlen_q
        i = r - head * seqlen_q
        stride = int64(cuda.gridDim.y) * nheads * seqlen_q  # from one split to the next
        first = (int64(b) * nheads + head) * seqlen_q + i
        m = NEG_INF
        for s in range(num_splits):
            m = max(m, lse_part[first + s * stride])
        sink = NEG_INF
        if SINKS:
            sink = variant[0][head]
            m = max(m, sink)
        shift = m if m != NEG_INF else float32(0.0)
        total = float32(0.0)
        if SINKS:
            total = ptx.exp2((sink - shift) * float32(LOG2E))
        value = float32(0.0)
        for s in range(num_splits):
            w = ptx.exp2((lse_part[first + s * stride] - shift) * float32(LOG2E))
            total += w
            if d < HEAD_DIM:
                value += w * o_part[(first + s * stride) * HEAD_DIM + d]
        if d < HEAD_DIM:
            out[b * o_sb + i * o_ss + head * o_sh + d] = from_f32(value * inverse_sum(total))
        if d == 0:
            if total == float32(0.0):
                lse[first] = NEG_INF
            else:
                lse[first] = shift + float32(LN2) * float32(math.log2(total))

    return combine
