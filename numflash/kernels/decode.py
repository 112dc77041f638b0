"""Attention over a KV cache on the tensor cores (mma.sync): split-KV decoding that reads the
cache at the speed of HBM.

Decoding reads every cached key and value once and does little arithmetic on them, so the
kernel is built around the loads. One thread block per (split, block of 16 query rows, kv head,
batch); its rows are the (query head of the kv head's GQA group, query position) pairs, so each
K/V byte serves the whole group. The block streams its split's keys through a ring of STAGES
shared-memory slots filled by cp.async, KEYS = NUM_WARPS * BLOCK_N keys a slot, gathered row by
row through the cache slot or the block table (any page size). The ring's rows are swizzled
(:mod:`.warp_step`) where the head dim allows, so that each 128-byte line of a cache row is
copied into one aligned 128-byte piece of shared memory: the padded rows split the copies into
2.6 times as many L2 requests (docs/performance.md, "Decode"). Each warp takes its own BLOCK_N
keys of every slot and runs FlashAttention-2's step on them (:mod:`.warp_step`: S = Q K^T,
online softmax, O += P V with fp32 accumulators); at the end the warps' rows are merged through
shared memory. With one split the block writes the output and LSE itself; with several it writes
fp32 partials (O normalised within the split, and its LSE), counts itself in at its row group's
counter, and the last block of the group to arrive weights the partials by exp(LSE_s - LSE)
into the output (and sets the counter back to zero for the next launch).

New rows (k, v) are written into the cache by the blocks themselves, so a decoding step is one
launch: the first block of each (kv head, sequence) writes them all, and every block that reads
some of them writes those first, so that what it reads is in place whichever block runs first
(the copies are of the same bytes).

A split covers an equal share of the keys its rows can see (window and causal bounds included),
rounded to whole slots, so a sliding window over a long cache reads only the window. Keys past
a sequence's length (cache_seqlens[b] + seqlen_new, clamped to the capacity), behind an
out-of-range cache slot or page, or masked for a row, score -inf; nothing outside the arrays is
read.

Supports: float16 and bfloat16; head_dim a multiple of 8 up to 256 (cache rows 16-byte
aligned); GQA; causal and window masks aligned bottom-right against each sequence's length after
the append; ``scale_log2 > 0`` (the launch negates q for a negative scale). Needs compute
capability 8.0+.
"""

import functools
import math

from numba import cuda, float32, int32, int64, uint16, uint32

from . import ptx
from .decode_portable import address_function, sequence_length
from .forward_portable import FROM_F32
from .fragments import acc_index, accumulator_position
from .jit import SIMULATOR, device_function, kernel
from .mask import block_key_range, visible_keys
from .mods import mod_functions
from .softmax import (
    LN2,
    LOG2E,
    NEG_INF,
    alibi_functions,
    final_lse,
    inverse_sum,
    raw_unit,
    row_starter,
    shift_of,
    sink_functions,
    softcap_function,
)
from .warp_step import swizzled_chunk, warp_step

#: Query rows of a block: one 16-row mma tile.
ROWS = 16
#: A paged key row's state in store_addresses' table.
FOUND, PAST_END, BAD_PAGE = 0, 1, 2
#: Most splits a launch may have (numflash.selection caps the count here): the last block of a
#: row group keeps every split's weight of its rows in shared memory.
MAX_SPLITS = 128


def swizzled(head_dim):
    """Whether the kernel's Q tile and ring use the swizzled layout (:mod:`.warp_step`): head
    dims padded to a multiple of 64; the others keep the padded rows."""
    return (head_dim + 15) // 16 * 16 % 64 == 0


#: 16-bit elements the ring may start past the dynamic shared memory's start, to begin on a
#: 128-byte boundary (the swizzled layout's rows are 128-byte aligned).
ALIGN_ELEMENTS = 64


def shared_memory_layout(head_dim, block_n, num_warps, stages):
    """(row pitch, K offset, V offset, total 16-bit elements) of the dynamic shared memory: the
    Q tile, then ``stages`` K slots and ``stages`` V slots of num_warps * block_n rows, from
    the first 128-byte boundary. Once the keys are done the same memory holds fp32 rows: every
    warp's rows being merged, then the splits' weights (``merge_floats``)."""
    row = (head_dim + 15) // 16 * 16
    if not swizzled(head_dim):
        row += 8  # +16 bytes: the 8 rows of an ldmatrix in other banks
    keys = num_warps * block_n
    k_base = ROWS * row
    v_base = k_base + stages * keys * row
    ring = v_base + stages * keys * row
    return row, k_base, v_base, max(ring + ALIGN_ELEMENTS, 2 * merge_floats(head_dim, num_warps))


def merge_floats(head_dim, num_warps):
    """fp32 values of the merge buffer: each warp's ROWS rows (head_dim padded, MERGE_PITCH),
    or ROWS rows of MAX_SPLITS weights (the combine)."""
    return ROWS * max(num_warps * ((head_dim + 15) // 16 * 16 + 8), MAX_SPLITS)


@functools.lru_cache(maxsize=None)
def build(
    head_dim, dtype_name, block_n, num_warps, stages, paged, softcap=0.0, sinks=False, alibi=False,
    mods=None,
):  # fmt: skip
    """The tensor-core decode kernel: grid (num_splits * ceil(group * seqlen_q / 16), nheads_k,
    batch), 32 * num_warps threads, ``shared_memory_layout(...)[3] * 2`` bytes of dynamic
    shared memory; with several splits, ``counters`` holds one zero int32 per row group
    (batch, kv head, block of 16 rows), and every launch leaves them zero. With ``sinks`` the
    row's head's sink logit (the ``*variant`` array) joins its sum where the output is made:
    the one split's merge, or the combine of several (their partials hold no sink). With
    ``alibi`` each row's head's slope (the next array) times the distance is taken from its
    scores (bias_scores). ``mods`` (a validation.Mods): the user's score_mod and mask_mod on
    the scores each row sees, after the built-ins (mod_scores; the mod_args the ``*variant``
    arrays after them)."""
    HEAD_DIM = head_dim
    HD_PAD = (head_dim + 15) // 16 * 16
    BLOCK_N, NUM_WARPS, STAGES = block_n, num_warps, stages
    THREADS = 32 * NUM_WARPS
    KEYS = NUM_WARPS * BLOCK_N  # keys of one ring slot
    N_TILES = BLOCK_N // 8
    K_STEPS = HD_PAD // 16
    D_TILES = HD_PAD // 8
    CHUNKS = HEAD_DIM // 8  # 16-byte chunks of a cache row
    ROWS_PER_PASS = THREADS // CHUNKS  # rows one pass of the block's threads loads
    PASSES = (KEYS + ROWS_PER_PASS - 1) // ROWS_PER_PASS  # rows of a slot one thread copies
    PAGED = paged
    ROW, K_BASE, V_BASE, _ = shared_memory_layout(head_dim, block_n, num_warps, stages)
    SWIZZLE = swizzled(head_dim)
    SLOT = KEYS * ROW
    PENDING = STAGES - 1  # cp.async groups left in flight when a slot is consumed
    Q_PENDING = STAGES - 1  # ... when the Q tile (the first group) is
    QF_REGS = K_STEPS * 4
    S_REGS = N_TILES * 4
    ACC_REGS = D_TILES * 4
    SOFTCAP = softcap > 0  # the scores capped (softmax.softcap_function)
    cap_scores = softcap_function(S_REGS, softcap if SOFTCAP else 1.0)
    start_rows = row_starter(2, ACC_REGS)
    SINKS = sinks
    sink_of, with_sink = sink_functions(sinks)
    ALIBI = alibi
    slope_of, biased = alibi_functions(alibi, sinks)
    MODS = mods is not None
    SCORE_MOD = MODS and mods.score_mod is not None
    natural_modded = mod_functions(mods, int(sinks) + int(alibi)).natural_modded
    FLAGS = STAGES * KEYS
    ABSENT = FLAGS + STAGES  # shared-array sizes must be plain constants
    ADDRESSES = 4 * KEYS  # two tiles' (k_at, v_at) pairs
    STATES = 2 * KEYS
    ADDRESS_ROUNDS = (KEYS + THREADS - 1) // THREADS  # rows of a tile one thread finds
    ML = 2 * ROWS * NUM_WARPS  # each warp's rows' running max and sum
    MERGE_PITCH = HD_PAD + 8  # fp32 row pitch of the merge (merge_floats): 2-way bank conflicts
    # The merge and the combine give each thread one output row and COLS of its columns (TPR
    # threads a row, on adjacent columns): a thread finds its row's weights once (one division
    # by seqlen_q, one exp2 a warp or split) instead of once per element of 8 rows, which
    # took the merge and combine 2-5 us of a short decoding call (docs/performance.md).
    TPR = THREADS // ROWS  # threads of one output row
    COLS = (HEAD_DIM + TPR - 1) // TPR  # columns of it a thread merges: j, j + TPR, ...
    SPLIT_UNROLL = max(1, 32 // COLS)  # splits a thread loads before adding any up
    PARTS = SPLIT_UNROLL * COLS  # local-array sizes must be plain constants
    cache_slot = address_function(False)  # (found, slot, row) of a contiguous cache's key
    from_f32 = FROM_F32[dtype_name]
    # Past head_dim 128 the query fragments would not fit beside the accumulators: they are
    # read from shared memory at every tile instead.
    Q_IN_REGS = HD_PAD <= 128
    load_q_fragments, mma_qk, online_softmax, mma_pv = warp_step(
        dtype_name, 1, N_TILES, HD_PAD, ROW, Q_IN_REGS, SWIZZLE
    )

    @device_function
    def chunk_at(r, c):
        """Where 16-byte chunk c of ring (or Q tile) row r is stored."""
        return swizzled_chunk(r, c) if SWIZZLE else c

    @device_function
    def ring_start(smem):
        """16-bit elements from the dynamic shared memory's start to the ring's (the first
        128-byte boundary; the simulator has no addresses to align)."""
        if SIMULATOR:
            return int32(0)
        return int32(((uint32(128) - (ptx.shared_address(smem, 0) & uint32(127))) & 127) >> 1)

    @device_function
    def zero_padding_columns(smem, start, tid):
        """Columns HEAD_DIM..HD_PAD-1 of every row take part in the mma: make them zero once."""
        if HD_PAD > HEAD_DIM:
            rows = ROWS + 2 * STAGES * KEYS
            for i in range(tid, rows * (HD_PAD - HEAD_DIM), THREADS):
                r = i // (HD_PAD - HEAD_DIM)
                col = HEAD_DIM + (i - r * (HD_PAD - HEAD_DIM))
                c = col >> 3
                smem[start + r * ROW + chunk_at(r, c) * 8 + col - c * 8] = uint16(0)

    @device_function
    def table_entry(j, keys):
        """(page, row within it) of key j of the block's sequence (j < capacity), its page from
        the block table: a shift for a power of two page size (page_shift >= 0), else one
        32-bit division."""
        block_table, geometry = keys[4], keys[5]
        page_size, max_blocks, _, page_shift = geometry
        if page_shift >= 0:
            index = uint32(j) >> uint32(page_shift)
        else:
            index = uint32(j) // uint32(page_size)
        page = block_table[int64(keys[6][0]) * max_blocks + int64(index)]
        return page, int32(uint32(j) - index * uint32(page_size))

    @device_function
    def cache_row(j, keys, wanted, page, row):
        """(found, k_at, v_at): where key j of the block's sequence is in k_cache and v_cache
        (this kv head's row): row ``row`` of ``page`` (paged: table_entry's) or in the
        sequence's cache slot; found is False where the row is not ``wanted`` or has no valid
        slot or page. ``k_head``, ``v_head`` (in ``keys``): the kv head's offset within a key
        row's cache slot or page, and (contiguous caches) the sequence's slot itself, valid
        when ``sequence_found``."""
        _, _, kc_st, vc_st, _, geometry, place = keys
        _, k_head, v_head, sequence_found = place[1:]
        kc_sb, kc_ss, _ = kc_st
        vc_sb, vc_ss, _ = vc_st
        found = wanted
        if PAGED:
            found = found and page >= 0 and page < geometry[2]
            k_at = int64(page) * kc_sb + int64(row) * kc_ss + k_head
            v_at = int64(page) * vc_sb + int64(row) * vc_ss + v_head
        else:
            found = found and sequence_found
            k_at = k_head + int64(j) * kc_ss
            v_at = v_head + int64(j) * vc_ss
        return found, k_at, v_at

    @device_function
    def tile_pages(pages, page_rows, n0, keys, tid):
        """Paged caches: the block-table entries (pages) and rows within them of this thread's
        rows of the tile of keys n0 .. n0 + KEYS - 1, one thread a row (page_rows -1 past
        n_end). The table loads are left in flight: store_addresses uses them a loop
        iteration later, so that no warp waits for them."""
        n_end = keys[6][1]
        for i in range(ADDRESS_ROUNDS):
            r = tid + i * THREADS
            j = int32(n0 + r)
            pages[i] = int32(-1)
            page_rows[i] = int32(-1)
            if r < KEYS and j < n_end:
                pages[i], page_rows[i] = table_entry(j, keys)

    @device_function
    def store_addresses(addresses, states, tile, pages, page_rows, keys, tid):
        """Paged caches: where each key row of tile ``tile`` is in k_cache and v_cache (from
        tile_pages), into buffer tile % 2 of ``addresses`` (k_at, v_at pairs; 0 where not
        found) and ``states`` (FOUND, PAST_END or BAD_PAGE). Done a tile ahead of the tile's
        copies and once a row, not by each of its CHUNKS copying threads."""
        base = (tile & 1) * KEYS
        for i in range(ADDRESS_ROUNDS):
            r = tid + i * THREADS
            if r < KEYS:
                k_at = int64(0)
                v_at = int64(0)
                state = PAST_END
                if page_rows[i] >= 0:
                    found, k_found, v_found = cache_row(0, keys, True, pages[i], page_rows[i])
                    state = BAD_PAGE
                    if found:
                        k_at = k_found
                        v_at = v_found
                        state = FOUND
                addresses[2 * (base + r)] = k_at
                addresses[2 * (base + r) + 1] = v_at
                states[base + r] = state

    @device_function
    def load_slot(smem_addr, absent, addresses, states, stage, tile, n0, keys, tid):
        """cp.async keys n0 .. n0 + KEYS - 1 (the block's key tile ``tile``) of sequence b into
        ring slot ``stage``; rows past n_end or behind a bad page are zero-filled. A row behind
        a bad page is marked absent, ``absent[stage * KEYS + row] = tile``, and so is the slot,
        ``absent[FLAGS + stage] = tile`` (a tile number needs no reset between uses of a slot).
        ``keys``: where the block's keys are, the same for every slot (see the kernel);
        ``addresses``, ``states``: the rows' places in the caches (store_addresses; paged).

        CHUNKS adjacent threads read one row, a 16-byte chunk each, so a warp's pass reads
        whole rows (full 128-byte lines: half the L2 requests of 32-byte pieces of many rows);
        each row's address comes from store_addresses (paged) or cache_row."""
        k_cache, v_cache = keys[0], keys[1]
        n_end = keys[6][1]
        k_dst = smem_addr + uint32((K_BASE + stage * SLOT) * 2)
        v_dst = smem_addr + uint32((V_BASE + stage * SLOT) * 2)
        chunk = int32(tid % CHUNKS)
        first = int32(tid // CHUNKS)
        row0 = (tile & 1) * KEYS + first  # this thread's first row in the address buffers
        if first < ROWS_PER_PASS:
            for p in range(PASSES):
                r = first + int32(p * ROWS_PER_PASS)
                j = int32(n0 + r)
                if p < PASSES - 1 or KEYS % ROWS_PER_PASS == 0 or r < KEYS:
                    if PAGED:
                        k_at = addresses[2 * (row0 + p * ROWS_PER_PASS)]
                        v_at = addresses[2 * (row0 + p * ROWS_PER_PASS) + 1]
                        state = states[row0 + p * ROWS_PER_PASS]
                        found = state == FOUND
                        if chunk == 0 and state == BAD_PAGE:
                            absent[stage * KEYS + r] = tile
                            absent[FLAGS + stage] = tile
                    else:
                        found, k_at, v_at = cache_row(j, keys, j < n_end, 0, 0)
                        k_at = k_at if found else 0
                        v_at = v_at if found else 0
                    size = uint32(16) if found else uint32(0)
                    dst = uint32((r * ROW + chunk_at(r, chunk) * 8) * 2)
                    ptx.cp_async_16(k_dst + dst, k_cache, k_at + chunk * 8, size)
                    ptx.cp_async_16(v_dst + dst, v_cache, v_at + chunk * 8, size)

    @device_function
    def mask_scores(s, absent, stage, tile, warp, lane, n0, lo0, hi0, lo1, hi1):
        """-inf for this lane's scores of keys its rows do not see ([lo_h, hi_h) for row half
        h) or that are absent."""
        for nt in range(N_TILES):
            for e in range(2):
                i = acc_index(nt, 0) + e
                _, col = accumulator_position(i, lane)
                c = warp * BLOCK_N + col  # key within the slot
                j = n0 + c
                here = (not PAGED) or absent[stage * KEYS + c] != tile
                s[i] = s[i] if here and lo0 <= j and j < hi0 else NEG_INF
                i = acc_index(nt, 1) + e
                s[i] = s[i] if here and lo1 <= j and j < hi1 else NEG_INF

    @device_function
    def row_bias(variant, b, kv_head, rr, rows, seqlen_q, seqlen_k, heads_per_kv, scale_log2):
        """(q_idx, ALiBi slope in units of 1 / scale) of block row ``rr``: its query's
        position among the keys and its head's slope (0 for a padding row)."""
        if rr >= rows:
            return float32(0.0), float32(0.0)
        i, head, _ = output_row(b, kv_head, rr, seqlen_q, heads_per_kv)
        nheads = cuda.gridDim.y * heads_per_kv
        slope = slope_of(variant, b, head, nheads, raw_unit(scale_log2))
        return float32(i + seqlen_k - seqlen_q), slope

    @device_function
    def bias_scores(s, lane, k0, bias0, bias1):
        """ALiBi on this lane's scores of the warp's keys k0.. for its two rows, ``bias0``
        and ``bias1`` their row_bias; the column offsets are constants."""
        for h in range(2):
            q_idx, slope = bias0 if h == 0 else bias1
            distance = q_idx - float32(k0 + (lane & 3) * 2)
            for nt in range(N_TILES):
                for e in range(2):
                    i = acc_index(nt, h) + e
                    _, col = accumulator_position(i, 0)
                    s[i] = biased(s[i], distance - float32(col), slope)

    @device_function
    def row_user(b, kv_head, rr, rows, seqlen_q, seqlen_k, heads_per_kv):
        """(whether block row ``rr`` is a query's, its head, q_idx) as the user's functions
        take them (kernels/mods.py): q_idx its position in the sequence after the append."""
        if rr >= rows:
            return False, int32(0), int32(0)
        i, head, _ = output_row(b, kv_head, rr, seqlen_q, heads_per_kv)
        return True, int32(head), int32(i + seqlen_k - seqlen_q)

    @device_function
    def mod_scores(s, lane, k0, b, user0, user1, lo0, hi0, lo1, hi1, unit, variant):
        """The user's score_mod and mask_mod on this lane's scores of the warp's keys k0.. for
        its two rows (``user0``, ``user1``: their row_user), where the row sees the key
        ([lo_h, hi_h): causal, window, the split): raw scores in, in natural units out with a
        score_mod (``unit``: softmax_scale; the softmax then takes LOG2E as its unit), the raw
        score or -inf with a mask alone. Padding rows and keys a row does not see are left."""
        for h in range(2):
            real, head, q_idx = user0 if h == 0 else user1
            lo, hi = (lo0, hi0) if h == 0 else (lo1, hi1)
            if real:
                for nt in range(N_TILES):
                    for e in range(2):
                        i = acc_index(nt, h) + e
                        key = k0 + accumulator_position(i, lane)[1]
                        if lo <= key and key < hi:
                            x = s[i] * unit if SCORE_MOD else s[i]
                            s[i] = natural_modded(x, b, head, q_idx, key, variant)

    @device_function
    def row_keys(rr, rows, seqlen_q, seqlen_k, wl, wr, n_end):
        """[lo, hi) of the keys block row ``rr`` sees. A padding row (zero Q, never written)
        sees every key of the split, so that it does not keep its warp's tiles from skipping
        the mask."""
        if rr >= rows:
            return 0, n_end
        i = rr - (rr // seqlen_q) * seqlen_q
        lo, hi = visible_keys(i, seqlen_q, seqlen_k, wl, wr)
        return lo, min(hi, n_end)

    @device_function
    def publish_warp(acc, m_i, l_i, merged, merge_ml, warp, lane):
        """This warp's rows into shared memory: its accumulators (unnormalised) at rows
        warp * ROWS ..., its rows' running max and sum in merge_ml."""
        for h in range(2):  # whole-row sums (each lane held a quarter of its row's)
            l_i[h] += ptx.shfl_xor(l_i[h], 1)
            l_i[h] += ptx.shfl_xor(l_i[h], 2)
        for h in range(2):
            row = (lane >> 2) + 8 * h
            at = (warp * ROWS + row) * MERGE_PITCH
            for dt in range(D_TILES):
                col = dt * 8 + (lane & 3) * 2
                i = acc_index(dt, h)
                merged[at + col] = acc[i]
                merged[at + col + 1] = acc[i + 1]
            if (lane & 3) == 0:
                merge_ml[(warp * ROWS + row) * 2] = m_i[h]
                merge_ml[(warp * ROWS + row) * 2 + 1] = l_i[h]

    @device_function
    def output_row(b, kv_head, rr, seqlen_q, heads_per_kv):
        """(i, head, row_at) of row rr of a kv head's group x seqlen_q rows (the merge's and
        the combine's): its query position, its query head and its index in (batch, nheads,
        seqlen_q)."""
        g = rr // seqlen_q
        i = rr - g * seqlen_q
        head = kv_head * heads_per_kv + g
        nheads = cuda.gridDim.y * heads_per_kv
        row_at = (int64(b) * nheads + head) * seqlen_q + i
        return i, head, row_at

    @device_function
    def write_out(out, o_st, b, i, head, d, value):
        """out[b, i, head, d] = value, in out's dtype."""
        o_sb, o_ss, o_sh = o_st
        out[b * o_sb + i * o_ss + head * o_sh + d] = from_f32(value)

    @device_function
    def merge_and_write(
        merged, merge_ml, out, lse, o_part, lse_part, o_st, b, kv_head, rr0, rows, seqlen_q,
        heads_per_kv, split, num_splits, tid, variant,
    ):  # fmt: skip
        """Every thread merges COLS columns of one of the block's rows across the warps'
        published rows (weights exp2(m_w - m)) and writes them: the output and LSE with one
        split, else the split's fp32 partial (O normalised within the split, and its LSE)."""
        nheads = cuda.gridDim.y * heads_per_kv
        r = tid // TPR
        j = tid - r * TPR
        rr = rr0 + r
        if rr < rows:
            weights = cuda.local.array(NUM_WARPS, float32)
            m = NEG_INF
            for w in range(NUM_WARPS):
                m = max(m, merge_ml[(w * ROWS + r) * 2])
            shift = shift_of(m)
            total = float32(0.0)
            for w in range(NUM_WARPS):
                weights[w] = ptx.exp2(merge_ml[(w * ROWS + r) * 2] - shift)
                total += merge_ml[(w * ROWS + r) * 2 + 1] * weights[w]
            inv = inverse_sum(total)
            i, head, row_at = output_row(b, kv_head, rr, seqlen_q, heads_per_kv)
            if SINKS and num_splits == 1:
                m, total, factor = with_sink(m, total, sink_of(variant, head))
                inv = inverse_sum(total) * factor
            if num_splits > 1:
                row_at += int64(split) * cuda.gridDim.z * nheads * seqlen_q
            for c in range(COLS):
                d = j + c * TPR
                if d < HEAD_DIM:
                    value = float32(0.0)
                    for w in range(NUM_WARPS):
                        value += merged[(w * ROWS + r) * MERGE_PITCH + d] * weights[w]
                    value *= inv
                    if num_splits == 1:
                        write_out(out, o_st, b, i, head, d, value)
                    else:
                        o_part[row_at * HEAD_DIM + d] = value
            if j == 0:
                if num_splits == 1:
                    lse[row_at] = final_lse(m, total)
                else:
                    lse_part[row_at] = final_lse(m, total)

    @device_function
    def write_new_rows(k, v, k_st, v_st, keys, lo, hi, start, kv_head, tid):
        """Cache rows lo .. hi - 1 of this kv head from the new rows (row j is k's and v's row
        j - start), where the row has a cache slot or page."""
        k_cache, v_cache = keys[0], keys[1]
        b = keys[6][0]
        k_sb, k_ss, k_sh = k_st
        v_sb, v_ss, v_sh = v_st
        for e in range(tid, (hi - lo) * HEAD_DIM, THREADS):
            r = e // HEAD_DIM
            d = e - r * HEAD_DIM
            j = lo + r
            page, row = table_entry(j, keys) if PAGED else (int32(0), int32(0))
            found, k_at, v_at = cache_row(j, keys, True, page, row)
            if found:
                i = int64(j - start)
                k_cache[k_at + d] = k[b * k_sb + i * k_ss + kv_head * k_sh + d]
                v_cache[v_at + d] = v[b * v_sb + i * v_ss + kv_head * v_sh + d]

    @device_function
    def combine_partials(
        o_part, lse_part, out, lse, o_st, b, kv_head, rr0, rows, seqlen_q, heads_per_kv,
        num_splits, tid, variant,
    ):  # fmt: skip
        """The output and LSE of the block's rows from every split's partial: out = sum_s
        exp(LSE_s - LSE) O_s with LSE = log sum_s exp(LSE_s); rows that see no key get 0 and
        -inf. Each thread takes COLS columns of one row and merges the splits as their partials
        arrive (a running max and sum, as the online softmax), loading SPLIT_UNROLL splits' LSEs
        and partials at once so that those loads are in flight together."""
        nheads = cuda.gridDim.y * heads_per_kv
        split_rows = int64(cuda.gridDim.z) * nheads * seqlen_q  # from one split to the next
        r = tid // TPR
        j = tid - r * TPR
        rr = rr0 + r
        if rr < rows:
            i, head, row_at = output_row(b, kv_head, rr, seqlen_q, heads_per_kv)
            values = cuda.local.array(COLS, float32)
            parts = cuda.local.array(PARTS, float32)
            lses = cuda.local.array(SPLIT_UNROLL, float32)
            for c in range(COLS):
                values[c] = float32(0.0)
            m = NEG_INF
            total = float32(0.0)
            for s0 in range(0, num_splits, SPLIT_UNROLL):  # SPLIT_UNROLL splits' loads in flight
                for u in range(SPLIT_UNROLL):
                    lses[u] = NEG_INF
                    if s0 + u < num_splits:
                        at = row_at + (s0 + u) * split_rows
                        lses[u] = lse_part[at]
                        for c in range(COLS):
                            d = j + c * TPR
                            parts[u * COLS + c] = (
                                o_part[at * HEAD_DIM + d] if d < HEAD_DIM else float32(0.0)
                            )
                for u in range(SPLIT_UNROLL):
                    x = lses[u]
                    if x != NEG_INF:  # a split that saw no key weighs nothing
                        m_new = max(m, x)
                        keep = ptx.exp2((m - m_new) * float32(LOG2E))
                        w = ptx.exp2((x - m_new) * float32(LOG2E))
                        total = total * keep + w
                        for c in range(COLS):
                            values[c] = values[c] * keep + w * parts[u * COLS + c]
                        m = m_new
            if SINKS:  # the sink joins the sum once, as a split with no value
                x = sink_of(variant, head) * float32(LN2)
                m_new = max(m, x)
                shift = shift_of(m_new)
                keep = ptx.exp2((m - shift) * float32(LOG2E))
                total = total * keep + ptx.exp2((x - shift) * float32(LOG2E))
                for c in range(COLS):
                    values[c] *= keep
                m = m_new
            inv = inverse_sum(total)
            for c in range(COLS):
                d = j + c * TPR
                if d < HEAD_DIM:
                    write_out(out, o_st, b, i, head, d, values[c] * inv)
            if j == 0:
                if total == float32(0.0):
                    lse[row_at] = NEG_INF
                else:
                    lse[row_at] = m + float32(LN2) * float32(math.log2(total))

    @kernel(launch_bounds=THREADS)
    def decode(
        q,
        k_cache,
        v_cache,
        seqlens,
        batch_idx,
        block_table,
        o_part,
        lse_part,
        out,
        lse,
        k,
        v,
        counters,
        q_st,
        kc_st,
        vc_st,
        o_st,
        k_st,
        v_st,
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
        *variant,
    ):
        q_sb, q_ss, q_sh = q_st
        smem = cuda.shared.array(0, uint16)
        # paged: the tile each slot row was last found absent in, then each slot's
        # (mask_scores, load_slot); the last split block's flag (the combine)
        absent = cuda.shared.array(ABSENT, int32)
        merge_acc = cuda.shared.array(0, float32)  # the same memory as smem, once the keys are done
        merge_ml = cuda.shared.array(ML, float32)
        qf = cuda.local.array(QF_REGS, uint32)
        addresses = cuda.shared.array(ADDRESSES, int64)  # paged: two tiles' rows (store_addresses)
        pages = cuda.local.array(ADDRESS_ROUNDS, int32)  # paged: the tile after next's pages ...
        page_rows = cuda.local.array(ADDRESS_ROUNDS, int32)  # ... and rows in them (tile_pages)
        states = cuda.shared.array(STATES, int32)
        pf = cuda.local.array(4, uint32)
        s = cuda.local.array(S_REGS, float32)
        acc = cuda.local.array(ACC_REGS, float32)
        m_i = cuda.local.array(2, float32)
        l_i = cuda.local.array(2, float32)

        tid = cuda.threadIdx.x
        lane = tid & 31
        warp = tid >> 5
        split = cuda.blockIdx.x % num_splits
        rr0 = (cuda.blockIdx.x // num_splits) * ROWS  # first (head in group, position) row
        kv_head = cuda.blockIdx.y
        b = cuda.blockIdx.z
        rows = heads_per_kv * seqlen_q
        last = min(rr0 + ROWS, rows) - 1
        # the block's two index loads, issued together (a round trip each if one waited for
        # the other), and its Q rows' copies (the first cp.async group) while they are away
        seqlen_k = sequence_length(seqlens, b, seqlen_new, capacity)
        sequence_found = True
        slot = int64(0)
        if not PAGED:
            sequence_found, slot, _ = cache_slot(b, 0, batch_idx, block_table, 0, 0, slots)
        start = ring_start(smem)
        smem_addr = ptx.shared_address(smem, start)
        for c in range(tid, ROWS * CHUNKS, THREADS):  # zero past the group
            r = c // CHUNKS
            col = (c - r * CHUNKS) * 8
            rr = rr0 + r
            g = rr // seqlen_q
            i = rr - g * seqlen_q
            at = b * q_sb + i * q_ss + (kv_head * heads_per_kv + g) * q_sh + col
            valid = rr < rows
            dst = smem_addr + uint32((r * ROW + chunk_at(r, col >> 3) * 8) * 2)
            ptx.cp_async_16(dst, q, at if valid else int64(0), uint32(16) if valid else uint32(0))
        ptx.cp_async_commit()

        # -- the keys this block's rows see, and this split's equal share of them in whole slots
        first_i = rr0 - (rr0 // seqlen_q) * seqlen_q
        last_i = last - (last // seqlen_q) * seqlen_q
        if rr0 // seqlen_q != last // seqlen_q:  # rows of two heads: every position
            first_i = 0
            last_i = seqlen_q - 1
        n_lo, n_hi = block_key_range(first_i, last_i, seqlen_q, seqlen_k, window_left, window_right)
        n_lo = int32(max(n_lo, 0))
        span = max(int32(n_hi) - n_lo, 0)
        chunk = (span + num_splits - 1) // num_splits
        chunk = (chunk + KEYS - 1) // KEYS * KEYS
        n_begin = int32(n_lo + split * chunk)
        n_end = int32(min(n_begin + chunk, n_hi))

        # -- where this kv head's rows are: within any page, or in the sequence's cache slot
        kc_sb, kc_ss, kc_sh = kc_st
        vc_sb, vc_ss, vc_sh = vc_st
        k_head = int64(kv_head) * kc_sh
        v_head = int64(kv_head) * vc_sh
        if not PAGED:
            k_head += slot * kc_sb
            v_head += slot * vc_sb
        n_tiles = int32(0)  # none without a cache slot: every row sees no key
        if n_end > n_begin and sequence_found:
            n_tiles = int32((n_end - n_begin + KEYS - 1) // KEYS)

        # where every slot's keys come from: the caches, the page table, this sequence's rows
        page_shift = int32(-1)  # log2(page_size) when it is a power of two
        if PAGED and page_size > 0 and (page_size & (page_size - 1)) == 0:
            page_shift = int32(0)
            while (1 << page_shift) < page_size:
                page_shift += 1
        geometry = (page_size, max_blocks, slots, page_shift)
        place = (b, n_end, k_head, v_head, sequence_found)
        keys = (k_cache, v_cache, kc_st, vc_st, block_table, geometry, place)

        # -- the new rows into the cache: all of them by the group's first block, and those this
        # block reads by itself (before its copies read them back)
        if seqlen_new > 0:
            first_new = seqlens[b]
            lo = first_new
            hi = first_new + seqlen_new
            if split != 0 or rr0 != 0:
                lo = max(lo, n_begin)
                hi = min(hi, n_end)
            write_new_rows(
                k, v, k_st, v_st, keys, max(lo, 0), min(hi, capacity), first_new, kv_head, tid
            )
            cuda.syncthreads()

        # -- prologue: STAGES - 1 slots, one group each (the Q rows' group went first)
        if PAGED:
            for i in range(tid, ABSENT, THREADS):
                absent[i] = int32(-1)
            cuda.syncthreads()
        zero_padding_columns(smem, start, tid)
        for st in range(STAGES - 1):
            n0 = n_begin + st * KEYS
            if PAGED:
                tile_pages(pages, page_rows, n0, keys, tid)
                store_addresses(addresses, states, st, pages, page_rows, keys, tid)
                cuda.syncthreads()
            if st < n_tiles:
                load_slot(smem_addr, absent, addresses, states, st, st, n0, keys, tid)
            ptx.cp_async_commit()
        if PAGED:  # the loop's first tile (its buffer was read before the last barrier), and
            # the pages of the tile after it
            tile_pages(pages, page_rows, n_begin + (STAGES - 1) * KEYS, keys, tid)
            store_addresses(addresses, states, STAGES - 1, pages, page_rows, keys, tid)
            tile_pages(pages, page_rows, n_begin + STAGES * KEYS, keys, tid)

        # each lane's ldmatrix row (and column, unless swizzled: warp_step finds it)
        q_addr = smem_addr + uint32((lane & 15) * ROW * 2)
        k_lane = uint32(((lane & 7) + ((lane >> 4) << 3)) * ROW * 2)
        v_lane = uint32((lane & 15) * ROW * 2)
        if not SWIZZLE:
            q_addr += uint32((lane >> 4) * 16)
            k_lane += uint32(((lane >> 3) & 1) * 16)
            v_lane += uint32((lane >> 4) * 16)
        warp_keys = uint32(warp * BLOCK_N * ROW * 2)
        ptx.cp_async_wait(Q_PENDING)  # the Q group has landed (for this thread's copies) ...
        cuda.syncthreads()  # ... and for every thread's
        if Q_IN_REGS:
            for kk in range(K_STEPS):
                load_q_fragments(qf, q_addr, 0, kk, kk * 4)
        lo0, hi0 = row_keys(
            rr0 + (lane >> 2), rows, seqlen_q, seqlen_k, window_left, window_right, n_end
        )
        lo1, hi1 = row_keys(
            rr0 + (lane >> 2) + 8, rows, seqlen_q, seqlen_k, window_left, window_right, n_end
        )
        bias0, bias1 = (float32(0.0), float32(0.0)), (float32(0.0), float32(0.0))
        if ALIBI:
            bias0 = row_bias(variant, b, kv_head, rr0 + (lane >> 2), rows, seqlen_q, seqlen_k,
                             heads_per_kv, scale_log2)  # fmt: skip
            bias1 = row_bias(variant, b, kv_head, rr0 + (lane >> 2) + 8, rows, seqlen_q,
                             seqlen_k, heads_per_kv, scale_log2)  # fmt: skip
        user0 = user1 = (False, int32(0), int32(0))
        unit = scale_log2 * float32(LN2)  # softmax_scale
        softmax_unit = scale_log2
        if MODS:
            user0 = row_user(b, kv_head, rr0 + (lane >> 2), rows, seqlen_q, seqlen_k, heads_per_kv)
            user1 = row_user(b, kv_head, rr0 + (lane >> 2) + 8, rows, seqlen_q, seqlen_k,
                             heads_per_kv)  # fmt: skip
        if SCORE_MOD:  # mod_scores leaves natural units
            softmax_unit = float32(LOG2E)
        lo_both = max(lo0, lo1)  # the keys both of this lane's rows see
        hi_both = min(hi0, hi1)
        start_rows(m_i, l_i, acc)

        stage = int32(0)
        for it in range(n_tiles):
            cuda.syncthreads()  # every warp is done with the slot consumed last: refill it ...
            if it + STAGES - 1 < n_tiles:
                free = stage - 1 if stage > 0 else STAGES - 1  # the slot consumed last
                n0 = n_begin + (it + STAGES - 1) * KEYS
                load_slot(
                    smem_addr, absent, addresses, states, free, it + STAGES - 1, n0, keys, tid
                )
                if PAGED:  # the next tile's places, into the other buffer, while this one
                    # loads (its pages were loaded an iteration ago); then the pages after it
                    store_addresses(addresses, states, it + STAGES, pages, page_rows, keys, tid)
                    tile_pages(pages, page_rows, n0 + 2 * KEYS, keys, tid)
            ptx.cp_async_commit()  # possibly empty: keeps the group count uniform
            ptx.cp_async_wait(PENDING)  # ... before waiting for slot `stage` (this thread's
            cuda.syncthreads()  # copies, then every thread's), so all slots are in flight
            slot_addr = smem_addr + uint32(stage * SLOT * 2) + warp_keys
            mma_qk(qf, s, q_addr, slot_addr + uint32(K_BASE * 2) + k_lane)
            if SOFTCAP:
                cap_scores(s, scale_log2)
            n0 = n_begin + it * KEYS
            k0 = n0 + warp * BLOCK_N  # this warp's first key of the slot
            if ALIBI:
                bias_scores(s, lane, k0, bias0, bias1)
            if MODS:
                mod_scores(s, lane, k0, b, user0, user1, lo0, hi0, lo1, hi1, unit, variant)
            seen = lo_both <= k0 and k0 + BLOCK_N <= hi_both  # by both rows: nothing to mask ...
            if PAGED:
                seen = seen and absent[FLAGS + stage] != it  # ... unless a page was bad
            if not seen:
                mask_scores(s, absent, stage, it, warp, lane, n0, lo0, hi0, lo1, hi1)
            online_softmax(s, m_i, l_i, acc, softmax_unit, m_i)  # (no row offsets: not read)
            mma_pv(s, pf, acc, slot_addr + uint32(V_BASE * 2) + v_lane)
            stage = int32(stage + 1) if stage + 1 < STAGES else int32(0)

        ptx.cp_async_wait(0)  # nothing may be in flight when the block exits ...
        cuda.syncthreads()  # ... and every warp is done with the slots that merge_acc reuses
        publish_warp(acc, m_i, l_i, merge_acc, merge_ml, warp, lane)
        cuda.syncthreads()
        merge_and_write(
            merge_acc, merge_ml, out, lse, o_part, lse_part, o_st, b, kv_head, rr0, rows,
            seqlen_q, heads_per_kv, split, num_splits, tid, variant,
        )  # fmt: skip
        if num_splits > 1:  # -- the last split block of the row group to arrive combines
            cuda.syncthreads()  # every thread's partial is written (for the block) ...
            if tid == 0:
                ptx.fence_acq_rel_gpu()  # ... and released before the block counts itself in
                group = (int64(b) * cuda.gridDim.y + kv_head) * (cuda.gridDim.x // num_splits)
                group += cuda.blockIdx.x // num_splits
                last = cuda.atomic.add(counters, group, 1) == num_splits - 1
                if last:
                    counters[group] = 0  # every split has arrived: ready for the next launch
                    ptx.fence_acq_rel_gpu()  # acquire: the partials released before the counts
                absent[0] = int32(1) if last else int32(0)
            cuda.syncthreads()
            if absent[0] == 1:
                combine_partials(
                    o_part, lse_part, out, lse, o_st, b, kv_head, rr0, rows, seqlen_q,
                    heads_per_kv, num_splits, tid, variant,
                )  # fmt: skip

    return decode
