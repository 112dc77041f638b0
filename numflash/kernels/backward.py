"""The tensor-core attention backward (FlashAttention-2's), written once: the dK/dV and dQ
kernels' skeletons and the device functions every backend shares.

One thread block per (block of BLOCK_N keys, kv head, batch) in the dK/dV kernel; its key rows
keep their dK and dV accumulators (fp32) in registers while blocks of BLOCK_M query rows (Q,
dO, their log2-domain LSE and D = rowsum(dO * O)) stream through shared memory, for every query
head of the GQA group in turn. Per query block, with the key rows as the M side of every product:

    S^T  = K Q^T,  dP^T = V dO^T                  fp32 accumulators
    P^T  = exp2(S^T * scale * log2(e) - lse_log2[query]),  0 where the mask hides the pair
    dS^T = P^T * (dP^T - D[query])
    dV  += P^T dO,  dK += dS^T Q                  P^T and dS^T rounded to 16 bits in registers:
                                                  their accumulator layout is the A layout

The dQ kernel is the same with the roles swapped: one block per BLOCK_N query rows with Q and
dO resident, tiles of BLOCK_M keys and values streaming, S = Q K^T and dP = dO V^T recomputed,
dS = P (dP - D), and dQ += dS K summed in registers by one thread per element in key order:
deterministic, at the cost of computing S and dP twice.

A backend supplies the products and the shared-memory layout as a :class:`Backend` of
compile-time constants and device functions: kernels/backward_mma.py (mma.sync and ldmatrix,
any GPU from Ampere on) and kernels/backward_sm90.py (Hopper's wgmma). :func:`build_kernels`
closes the skeletons over one backend, so every call inlines and the loops unroll.

A user's score_mod and mask_mod (kernels/mods.py) change each score the causal / window mask
lets through, after the softcap and ALiBi, and dS is multiplied by score_mod's derivative
there; a block mask (kernels/block_mask.py) narrows the query rows a key block runs over (the
union over its GQA group's heads) and the keys a row block runs over.

Supports: float16 and bfloat16; GQA; causal and window masks bottom-right; any seqlen_q and
seqlen_k; the head dims each backend names.
"""

import functools
from typing import NamedTuple

from numba import cuda, float32, int32, int64, uint16, uint32, uint64

from . import ptx
from .block_mask import key_ranges, query_ranges
from .forward_portable import packed_sequence
from .fragments import PACK, acc_index, accumulator_position, tile_base
from .jit import device_function, kernel
from .mask import block_key_range, block_query_range, visible_keys
from .mods import mod_functions
from .softmax import LOG2E, alibi_functions, row_log2_lse, softcap_gradient_functions

#: Global indices are ANDed with this before use. Numba wraps negative indices around as Python
#: does (cuda.atomic.add always), about eight integer instructions per access; with the sign bit
#: known to be clear the compiler drops that code, and the AND itself vanishes into the address
#: arithmetic (the index is scaled past bit 63). Indices here are never negative.
NON_NEGATIVE = (1 << 63) - 1


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
def capped_p_and_ds_function(softcap):
    """``capped_p_and_ds(s, dp, neg_lse, d, scale_log2, a, b)``: p_and_ds of a score capped
    as the forward capped it (softmax.softcap_functions' ``a`` and ``b``), dS multiplied by
    the cap's derivative there."""
    _, capped_and_slope = softcap_gradient_functions(softcap, fast=True)

    @device_function
    def capped_p_and_ds(s, dp, neg_lse, d, scale_log2, a, b):
        capped, slope = capped_and_slope(s, a, b)
        p = ptx.exp2(ptx.fma(capped, scale_log2, neg_lse))
        return p, p * (dp - d) * slope

    return capped_p_and_ds


@functools.lru_cache(maxsize=None)
def element_function(softcap=0.0, alibi=False):
    """``p_and_ds_of(s, dp, neg_lse, d, scale_log2, a, b, distance, slope)``: (P, dS) of one
    element of raw score ``s`` as the forward changed it: capped (``softcap`` > 0, with
    softmax.softcap_functions' ``a`` and ``b``; dS times the cap's derivative), then with
    ``alibi`` less ``slope`` (log2 domain) times |``distance``| (the derivative 1)."""
    SOFTCAP = softcap > 0
    ALIBI = alibi
    capped_p_and_ds = capped_p_and_ds_function(softcap if SOFTCAP else 1.0)
    _, capped_and_slope = softcap_gradient_functions(softcap if SOFTCAP else 1.0, fast=True)
    _, biased = alibi_functions(alibi)

    @device_function
    def p_and_ds_of(s, dp, neg_lse, d, scale_log2, a, b, distance, slope):
        if not ALIBI:
            if SOFTCAP:
                return capped_p_and_ds(s, dp, neg_lse, d, scale_log2, a, b)
            return p_and_ds(s, dp, neg_lse, d, scale_log2)
        factor = float32(1.0)
        if SOFTCAP:
            s, factor = capped_and_slope(s, a, b)
        p = ptx.exp2(biased(ptx.fma(s, scale_log2, neg_lse), distance, slope))
        return p, p * (dp - d) * factor

    return p_and_ds_of


@functools.lru_cache(maxsize=None)
def user_element_function(softcap=0.0, alibi=False, mods=None):
    """``user_p_and_ds(seen, s, dp, neg_lse, d, scale_log2, a, b, distance, slope, user,
    q_idx, kv_idx)``: element_function's (P, dS) where the user's functions (``mods``, a
    validation.Mods) change the score after the softcap and ALiBi: mask_mod may hide the
    pair, score_mod change the score, its derivative multiplies dS. Called only where the
    causal / window mask lets the pair through (``seen``), so a user's function never sees
    a row or key that does not exist; (0, 0) elsewhere. ``user``: (the batch entry or
    sequence, the query head, the kernel's ``*variant`` arrays)."""
    SOFTCAP = softcap > 0
    _, capped_and_slope = softcap_gradient_functions(softcap if SOFTCAP else 1.0, fast=True)
    _, biased = alibi_functions(alibi)
    modded_and_factor = mod_functions(mods, int(alibi)).modded_and_factor

    @device_function
    def user_p_and_ds(seen, s, dp, neg_lse, d, scale_log2, a, b, distance, slope, user, q, kv):
        p, ds = float32(0.0), float32(0.0)
        if seen:
            factor = float32(1.0)
            if SOFTCAP:
                s, factor = capped_and_slope(s, a, b)
            x = biased(s * scale_log2, distance, slope)  # log2 domain, as the forward's
            batch, head, variant = user
            x, mod_factor = modded_and_factor(x, batch, head, q, kv, variant)
            p = ptx.exp2(x + neg_lse)
            ds = p * (dp - d) * (factor * mod_factor)
        return p, ds

    return user_p_and_ds


@device_function
def partly_masked(lo0, hi0, lo1, hi1, last):
    """Whether a lane's two rows of visible columns [lo, hi) leave out any of its columns
    0..last (the mask's tests can be skipped where no lane of a warp's does)."""
    return (lo0 > 0) | (hi0 <= last) | (lo1 > 0) | (hi1 <= last)


@device_function
def mask_tests_needed(lo0, hi0, lo1, hi1, last, voting):
    """Whether this warp runs the mask's tests: always unless ``voting`` (a compile-time
    constant), else where some lane's rows leave out any of its columns 0..last
    (partly_masked), one vote a warp."""
    if not voting:
        return True
    return ptx.any_lane(partly_masked(lo0, hi0, lo1, hi1, last))


@functools.lru_cache(maxsize=None)
def probabilities_function(q_tiles, softcap=0.0, alibi=False, mods=None, vote=True):
    """The device function ``probabilities_and_ds`` over ``q_tiles`` 8-query tiles of S^T in
    the accumulator layout that mma.sync's C fragments and wgmma's m64 accumulators share;
    ``softcap`` > 0, ``alibi``: of scores changed as the forward changed them
    (element_function); ``mods``: and by a user's functions (user_element_function).
    ``vote``: a warp that sees every pair skips the mask's tests (one vote a warp); False:
    every element tested, one path (the mma.sync kernels: with both paths their head_dim 128
    dK/dV kernel spills 28 bytes under ptxas 13.0)."""
    Q_TILES = q_tiles
    VOTING = vote and mods is None  # (a user's mask_mod hides pairs no range shows)
    SOFTCAP = softcap > 0
    MODS = mods is not None
    cap_factors, _ = softcap_gradient_functions(softcap if SOFTCAP else 1.0, fast=True)
    p_and_ds_of = element_function(softcap, alibi)
    user_p_and_ds = user_element_function(softcap, alibi, mods)
    MAX_COL = 8 * (Q_TILES - 1) + 1  # a lane's last query, from its first (accumulator_position)

    @device_function
    def element_into(
        st, dpt, i, col, lo, hi, neg_lse, d, scale_log2, a, b, at, slope, user, q, kv, masked
    ):  # fmt: skip
        """st[i] <- P and dpt[i] <- dS of one element, query ``col`` columns from the lane's
        first: 0 unless lo <= col < hi (the causal / window mask's range), which is tested
        only where ``masked`` (a constant). The plain path tests the range after its
        arithmetic, as it always did: testing it first changes the plain kernels' PTX
        (tests/test_fingerprints.py)."""
        if MODS:
            seen = (lo <= int32(col)) & (int32(col) < hi)
            st[i], dpt[i] = user_p_and_ds(
                seen, st[i], dpt[i], neg_lse, d, scale_log2, a, b, at, slope, user, q, kv
            )
        else:
            p, ds = p_and_ds_of(st[i], dpt[i], neg_lse, d, scale_log2, a, b, at, slope)
            if masked:
                seen = (lo <= int32(col)) & (int32(col) < hi)
                st[i] = p if seen else float32(0.0)
                dpt[i] = ds if seen else float32(0.0)
            else:
                st[i] = p
                dpt[i] = ds

    @device_function
    def elements_into(args, masked):
        """probabilities_and_ds' elements, every query tile's, from ``args`` = (st, dpt,
        lse_tile, d_tile, the lane's first query in the tiles, (lo0, hi0, lo1, hi1): the two
        key rows' visible columns, tested only where ``masked``, scale_log2, the softcap's
        factors, distance, slope, user, q_first, key0)."""
        st, dpt, lse_tile, d_tile, first, ranges, scale_log2, a, b = args[:9]
        distance, slope, user, q_first, key0 = args[9:]
        lo0, hi0, lo1, hi1 = ranges
        for qt in range(Q_TILES):
            for e in range(2):
                i = tile_base(qt) + e  # key row key0
                _, col = accumulator_position(i, 0)  # the query, from the lane's first
                neg_lse = -lse_tile[first + uint32(col)]
                d = d_tile[first + uint32(col)]
                at = distance + float32(col)
                element_into(
                    st, dpt, i, col, lo0, hi0, neg_lse, d, scale_log2, a, b, at, slope, user,
                    q_first + col, key0, masked,
                )  # fmt: skip
                element_into(  # key row key0 + 8
                    st, dpt, i + 2, col, lo1, hi1, neg_lse, d, scale_log2, a, b,
                    at - float32(8), slope, user, q_first + col, key0 + 8, masked,
                )  # fmt: skip

    @device_function
    def probabilities_and_ds(
        st, dpt, lse_tile, d_tile, stats, key0, m0, lane, seqlen_q, seqlen_k, scale_log2, wl, wr,
        score_args,
    ):  # fmt: skip
        """st <- P^T and dpt <- dS^T = P^T (dP^T - D) for this lane's key rows key0 and
        key0 + 8 (elements 0-1 and 2-3 of every query tile); 0 where the pair is masked.
        ``score_args``: (the head's ALiBi slope in the log2 domain, read only with ALiBi; the
        user_element_function's ``user``, read only with ``mods``).

        No branch per element: every element is computed and masked ones are selected away,
        and each query's LSE and D are read once for both key rows (``stats`` is the block's
        offset in the shared tiles). Per element branches cost a reconvergence barrier and a
        serial shared-load -> ex2 chain each (a user's functions take one: they may read
        memory a row or key past the end would not have). A warp whose every pair is visible
        (most blocks: all but the causal diagonal's, a window's edges and the last rows or
        keys) skips the tests and selects, one branch a warp (a vote, so ptxas knows it is
        uniform): 168 of the head_dim 128 dK/dV kernel's 1960 instructions."""
        slope, user = score_args
        first = uint32(stats + (lane & 3) * 2)  # this lane's first query in the tiles
        lo0, hi0 = visible_queries(key0, m0, lane, seqlen_q, seqlen_k, wl, wr)
        lo1, hi1 = visible_queries(key0 + 8, m0, lane, seqlen_q, seqlen_k, wl, wr)
        cap_a, cap_b = float32(0.0), float32(0.0)
        if SOFTCAP:
            cap_a, cap_b = cap_factors(scale_log2)
        # q_idx - kv_idx of the lane's first query and key row key0 (ALiBi); q_idx of that
        # query (a user's functions)
        q_first = m0 + (lane & 3) * 2 + seqlen_k - seqlen_q
        distance = float32(q_first - key0)
        args = (st, dpt, lse_tile, d_tile, first, (lo0, hi0, lo1, hi1), scale_log2, cap_a, cap_b,
                distance, slope, user, q_first, key0)  # fmt: skip
        if mask_tests_needed(lo0, hi0, lo1, hi1, MAX_COL, VOTING):
            elements_into(args, True)
        else:
            elements_into(args, False)

    return probabilities_and_ds


@device_function
def floor_quotient(a, b):
    return a // b


@functools.lru_cache(maxsize=None)
def block_position_function(block_n, head_split, part, heavy_group, quotient=None):
    """The device function ``block_position`` of kernels whose blocks own ``block_n`` rows
    (keys or queries) and ``part`` output columns, ``head_split`` blocks per block of rows,
    in ``heavy_group``'s order under one-sided masks (build_kernels). ``quotient(a, b)``
    divides by the grid's sizes (None: Python's ``//`` on Numba's 64-bit integers)."""
    BLOCK_N, HEAD_SPLIT, PART, HEAVY_GROUP = block_n, head_split, part, heavy_group
    divide = quotient or floor_quotient

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
                lse_tile[stage * BLOCK_M + r] = row_log2_lse(lse_r[j])
                d_tile[stage * BLOCK_M + r] = d_r[j]

    return fetch_row_stats, store_row_stats


@functools.lru_cache(maxsize=None)
def row_writer(part, dtype_name):
    """The device function ``write_rows`` of 16-row accumulator tiles ``part`` columns wide
    (mma.sync's C layout, which wgmma's m64 accumulators repeat per warp)."""
    D_TILES = part // 8
    pack = PACK[dtype_name]

    @device_function
    def write_rows(out, acc, base, stride, row0, lane, rows, factor):
        """acc * factor (16 rows x ``part``) to ``out``'s rows row0.. below ``rows``, from element
        ``base`` of each (the block's first column). Each lane's pair goes out as one 32-bit
        store, so ``base`` and ``stride`` are even: the gradients are numflash's own buffers."""
        for h in range(2):
            row = row0 + (lane >> 2) + 8 * h
            if row < rows:
                at = base + int64(row) * stride
                for dt in range(D_TILES):
                    col = dt * 8 + (lane & 3) * 2
                    i = acc_index(dt, h)
                    pair = pack(acc[i] * factor, acc[i + 1] * factor)
                    ptx.store_pair(out, (at + col) & NON_NEGATIVE, pair)

    return write_rows


@device_function
def row_stats(lse, delta, row_base, row, first_col, seqlen_q, seqlen_k, wl, wr, in_log2):
    """(log2-domain LSE, D, first and end visible key relative to ``first_col``) of query
    ``row``; an empty range for a row past the end. ``in_log2``: lse holds the log2-domain
    values already (padded_stat_rows' buffers)."""
    if row < seqlen_q:
        at = (row_base + row) & NON_NEGATIVE
        lo, hi = visible_keys(row, seqlen_q, seqlen_k, wl, wr)
        lse_log2 = lse[at] if in_log2 else row_log2_lse(lse[at])
        return (lse_log2, delta[at], int32(lo - first_col), int32(hi - first_col))
    return float32(0.0), float32(0.0), int32(0), int32(0)


@device_function
def lane_row_stats(lse, delta, row_base, warp_row, lane, n_lo, seqlen_q, seqlen_k, wl, wr, in_log2):
    """The row statistics of this lane's two query rows, warp_row + lane // 4 and 8 rows below,
    as one group: (lse_0, d_0, lo_0, hi_0, lse_1, d_1, lo_1, hi_1), each row's log2-domain
    LSE, D and visible keys relative to the lane's first column of a key range starting at
    ``n_lo`` (row_stats). ``row_base``: where the head's row 0 is in lse and delta. row_ds
    takes the group as it is."""
    row0 = warp_row + (lane >> 2)
    first_col = n_lo + (lane & 3) * 2
    return row_stats(
        lse, delta, row_base, row0, first_col, seqlen_q, seqlen_k, wl, wr, in_log2
    ) + row_stats(lse, delta, row_base, row0 + 8, first_col, seqlen_q, seqlen_k, wl, wr, in_log2)


#: Rows past a query block's that a bulk copy of its LSE or D takes (tma): the copy starts at
#: the block's first row rounded down to a multiple of 4, 16 bytes (padded_stat_rows).
STAT_COPY_EXTRA = 4


def padded_stat_rows(seqlen_q, block_m):
    """Rows a head takes in the LSE and D that the Hopper backward's dK/dV kernel copies in
    bulk with its tiles (tma; backward_portable.build_preprocess's ``padded``): a multiple of
    4, so every head's row 0 is 16-byte aligned, and ``block_m`` more, so that the copy of a
    block's block_m + 4 rows from its first row rounded down to a multiple of 4 stays inside
    for every first row below seqlen_q."""
    return (seqlen_q + 3) // 4 * 4 + block_m + STAT_COPY_EXTRA - 4


padded_stat_rows_on_device = device_function(padded_stat_rows)


@functools.lru_cache(maxsize=None)
def row_ds_function(key_tiles, softcap=0.0, alibi=False, mods=None, vote=True):
    """The device function ``row_ds`` over ``key_tiles`` 8-key tiles of S (query rows in the
    accumulator layout that mma.sync's C fragments and wgmma's m64 accumulators share);
    ``softcap`` > 0, ``alibi``: of scores changed as the forward changed them
    (element_function); ``mods``: and by a user's functions (user_element_function);
    ``vote`` as probabilities_function's."""
    Q_TILES = key_tiles
    VOTING = vote and mods is None  # (a user's mask_mod hides pairs no range shows)
    SOFTCAP = softcap > 0
    MODS = mods is not None
    cap_factors, _ = softcap_gradient_functions(softcap if SOFTCAP else 1.0, fast=True)
    p_and_ds_of = element_function(softcap, alibi)
    user_p_and_ds = user_element_function(softcap, alibi, mods)
    MAX_COL = 8 * (Q_TILES - 1) + 1  # a lane's last key, from its first (accumulator_position)

    @device_function
    def row_ds(dp, s, stats, shift, scale_log2, bias):
        """dp <- dS = P (dP - D) for this lane's query rows (elements 0-1: the first, 2-3: the
        second, of every key tile); 0 where masked. ``stats``: lane_row_stats' group, whose
        visible keys are moved ``shift`` columns left (the tile's offset from the first). No
        branch per element, and none of the tests in a warp that sees every pair (see
        probabilities_and_ds). ``bias``: (q_idx - kv_idx of the first
        row and the lane's first column of the first tile, the head's ALiBi slope in the log2
        domain), read only with ALiBi; then user_element_function's ``user``, q_idx of the
        lane's first row and kv_idx of its first column of the first tile, read only with
        ``mods``."""
        distance0, slope, user, q0, kv0 = bias
        lse_0, d_0, lo_0, hi_0, lse_1, d_1, lo_1, hi_1 = stats
        lo_0 = int32(lo_0 - shift)
        hi_0 = int32(hi_0 - shift)
        lo_1 = int32(lo_1 - shift)
        hi_1 = int32(hi_1 - shift)
        cap_a, cap_b = float32(0.0), float32(0.0)
        if SOFTCAP:
            cap_a, cap_b = cap_factors(scale_log2)
        distance0 = distance0 - float32(shift)
        args = (dp, s, (lse_0, d_0, lo_0, hi_0, lse_1, d_1, lo_1, hi_1), shift, scale_log2,
                cap_a, cap_b, distance0, slope, user, q0, kv0)  # fmt: skip
        if mask_tests_needed(lo_0, hi_0, lo_1, hi_1, MAX_COL, VOTING):
            row_elements(args, True)
        else:
            row_elements(args, False)

    @device_function
    def row_elements(args, masked):
        """row_ds' elements, every key tile's, from ``args`` = (dp, s, the shifted row
        statistics, shift, scale_log2, the softcap's factors, distance0, slope, user, q0,
        kv0); the visible ranges tested only where ``masked``."""
        dp, s, stats, shift, scale_log2, cap_a, cap_b = args[:7]
        distance0, slope, user, q0, kv0 = args[7:]
        lse_0, d_0, lo_0, hi_0, lse_1, d_1, lo_1, hi_1 = stats
        for qt in range(Q_TILES):
            for e in range(4):
                i = tile_base(qt) + e
                _, col = accumulator_position(i, 0)  # the key, from the lane's first
                second = e >= 2  # the lane's second row
                neg_lse = -(lse_1 if second else lse_0)
                d = d_1 if second else d_0
                at = distance0 + float32(8 if second else 0) - float32(col)
                if MODS:
                    lo = lo_1 if second else lo_0
                    hi = hi_1 if second else hi_0
                    seen = (lo <= int32(col)) & (int32(col) < hi)
                    _, dp[i] = user_p_and_ds(
                        seen, s[i], dp[i], neg_lse, d, scale_log2, cap_a, cap_b, at, slope, user,
                        q0 + (8 if second else 0), kv0 + shift + col,
                    )  # fmt: skip
                    continue
                # the plain path's order, as element_into's
                _, ds = p_and_ds_of(s[i], dp[i], neg_lse, d, scale_log2, cap_a, cap_b, at, slope)
                if masked:
                    lo = lo_1 if second else lo_0
                    hi = hi_1 if second else hi_0
                    dp[i] = ds if (lo <= int32(col)) & (int32(col) < hi) else float32(0.0)
                else:
                    dp[i] = ds

    return row_ds


def query_block_loader(load_pair, fetch_row_stats, group_threads=None):
    """The dK/dV kernels' device function ``load_query_block``, from their own ``load_pair``
    (cp.async of BLOCK_M rows of two arrays into a stage, one commit group) and
    ``fetch_row_stats``; with ``group_threads`` (a power of 2) the threads fetch by groups of
    that many, each group its own copy."""
    GROUPED = group_threads is not None
    GROUP_MASK = (group_threads or 1) - 1

    @device_function
    def load_query_block(
        stage_addr,
        q,
        do,
        lse,
        delta,
        lse_r,
        d_r,
        rows,
        head,
        m0,
        q_st,
        do_st,
        seqlen_q,
        tid,
    ):
        """Start loading query rows m0.. of query head ``head``: their Q and dO into the stage
        at ``stage_addr``, their LSE and D into registers (lse_r, d_r). ``rows``: where the
        sequence's query rows start in q and in do, and (a, b, stride): head h's row 0 is at
        (a + h) * stride + b in lse and delta."""
        q_first, do_first, _, _, _ = rows
        _, q_ss, q_sh = q_st
        _, do_ss, do_sh = do_st
        load_pair(
            stage_addr,
            q,
            do,
            q_first + head * q_sh + int64(m0) * q_ss,
            q_ss,
            do_first + head * do_sh + int64(m0) * do_ss,
            do_ss,
            seqlen_q - m0,
            tid,
        )
        fetch_query_stats(lse, delta, lse_r, d_r, rows, head, m0, seqlen_q, tid)

    @device_function
    def fetch_query_stats(lse, delta, lse_r, d_r, rows, head, m0, seqlen_q, tid):
        """Start loading the LSE and D of query rows m0.. of ``head`` into registers (lse_r,
        d_r): load_query_block's second half."""
        _, _, lse_a, lse_b, lse_stride = rows
        lse_base = (lse_a + head) * lse_stride + lse_b
        if GROUPED:
            tid = tid & GROUP_MASK
        fetch_row_stats(lse_r, d_r, lse, delta, lse_base, m0, seqlen_q, tid)

    return load_query_block, fetch_query_stats


@device_function
def next_query_block(head, m0, m_lo, m_hi, block_m):
    """The (query head, first row) of the query block after rows m0.. of ``head``: the next
    block of rows in [m_lo, m_hi), else the first of the next head of the GQA group."""
    m0 += block_m
    if m0 >= m_hi:
        return head + 1, m_lo
    return head, m0


@device_function
def drain_copies(lane):
    """Wait for this thread's cp.async copies (a backend's ``drain``)."""
    ptx.cp_async_wait(0)


class Kernels(NamedTuple):
    dkdv: object  # dK and dV; with an atomic backend also dQ
    dq: object  # dQ alone, in a fixed order; None where the dK/dV kernel adds dQ up
    dkdv_varlen: object  # the same two over a packed batch
    dq_varlen: object


class Ring(NamedTuple):
    """A backend's mbarrier ring (``Backend.ring``): the streaming tiles go through STAGES
    slots, each with a full barrier (every thread's copies into it landed: cp.async arrivals)
    and an empty one (every thread done reading it), so that no block barrier per tile keeps
    the warpgroups in step. Device functions, ``bars`` the block's 2 x STAGES mbarriers
    (``cuda.shared.array(2 * STAGES, uint64)``) and ``t`` a tile's index in the block's stream
    (its slot t % STAGES):

    - ``start(bars, tid)``: initialise the barriers, then a block barrier;
    - ``wait_full(bars, t)``: tile t has landed in its slot;
    - ``release(bars, t)``: this thread is done reading tile t's slot;
    - ``claim(bars, t)``: before tile t is loaded: every thread has released the slot's last
      tile (t - STAGES; nothing to wait for while t < STAGES);
    - ``filled(bars, t)``: this thread's copies of tile t arrive when they land;
    - ``group_sync(warp)``: a barrier of this warp's warpgroup alone;
    - ``take_turn(warp)``, ``pass_turn(warp)``: around the issue of a warpgroup's products,
      where the warpgroups take turns (pingpong; else nothing): wait for this warpgroup's
      turn, then hand the turn to the other;
    - ``first_turn(warp)``, ``last_turn(warp)``: once before the stream and once after it (the
      first turn given to the first warpgroup; the last pass taken up).
    """

    start: object
    wait_full: object
    release: object
    claim: object
    filled: object
    group_sync: object
    take_turn: object
    pass_turn: object
    first_turn: object
    last_turn: object


class Backend(NamedTuple):
    """What a backend gives the skeletons (sizes in elements unless named bytes).

    Sizes: ``block_m`` (rows of a streaming tile), ``block_n`` (rows a block owns), ``threads``,
    ``stages``, ``s_regs`` (a thread's share of one score tile), ``acc_regs`` (of one output
    accumulator), ``dq_regs`` (of the atomic dQ's accumulator; 1 without), ``stage0`` and
    ``stage_bytes`` (where the streaming stages start and their size in bytes).

    Device functions:

    - ``block_position(one_sided, reverse)``: (tid, lane, warp, first row, first output column,
      head, batch) of this block (block_position_function).
    - ``shared_base(smem)``: the 32-bit shared address the layout starts at.
    - ``load_resident(base, a, b, a_first, a_ss, b_first, b_ss, rows_left, warp, lane,
      col_base, tid)``: cp.async the block's own rows of two tensors (K and V, or Q and dO), one
      commit group; returns the operands of this warp's rows (a tuple ``query_block_step`` and
      ``key_tile_step`` take as they are).
    - ``load_pair(stage_addr, a, b, a_first, a_ss, b_first, b_ss, rows_left, tid)``: cp.async
      BLOCK_M rows of two tensors into a stage, one commit group.
    - ``landed()``: wait for this thread's copies, make them visible to the products, then
      for every thread.
    - ``query_block_step(st, dpt, dk_acc, dv_acc, resident, stage_addr, scores)``: dK/dV +=
      one query block, dS^T left in ``dpt``; ``scores`` is what probabilities_function's
      function takes after st and dpt (lse_tile, d_tile, stats, key0, m0, lane, seqlen_q,
      seqlen_k, scale_log2, wl, wr, score_args), handed on as it is; with ``dq_atomic`` its
      products may still be in flight (``atomic_dq`` then waits for them).
    - ``key_tile_step(s, dp, acc, resident, stage_addr, row_stats, shift, scale_log2, bias)``:
      dQ += one key tile (``bias`` goes to row_ds_function's function as it is).
    - ``atomic_dq(smem, base, dpt, dqa, dq_acc, dq_head, dq_ss, dq_sh, m0, col_base, warp,
      lane, seqlen_q, dk_acc, dv_acc)``: dQ += dS K into the fp32 buffer (``dq_atomic``),
      else never called; on return dK/dV's products of the block have landed in their
      accumulators.
    - ``drain(lane)``: wait for what the dK/dV kernel's block still has in flight before it
      writes dK and dV and exits (drain_copies: its cp.async copies).
    - ``divide(a, b)``: the integer quotient the block index math uses.

    ``ring``: None (the tiles handed over by a block barrier each: ``landed``) or a
    :class:`Ring` (needs ``stages`` >= 3: the tile STAGES - 1 ahead is loaded after a tile's
    step, into the slot of the tile before it). With a ring each warpgroup keeps its own copy
    of a query block's LSE and D (its threads fetch and store them, then ``group_sync``), so
    nothing makes one warpgroup wait for the other but a slot still being read. With a ring
    and ``dq_atomic`` (else None),
    ``ring_query_block_step(st, dpt, dk_acc, dv_acc, dqa, resident, stage_addr, scores,
    pending)``: query_block_step that also adds the block's dQ up, pending = (base, dq_acc,
    dq_acc's index of the block's head, dq_ss, dq_sh, the block's first row, its index in the
    stream, warp, lane); its products have landed on return.

    With a ring, ``ring_boxes`` (else None) fills the dense kernels' slots by the tensor
    memory accelerator: ``publish_maps(maps, a, b, base, warp, lane)`` once a block makes the
    launch's tensor maps of the streaming arrays (Q and dO, or K and V) from the templates in
    ``maps`` (the dense kernels' last three ``*variant`` arguments: the two templates,
    ptx_tma's, and the launch's int64 map buffer), and ``ring_boxes(bars, t,
    stage_addr, maps, row, head, batch, tid, stats)`` claims tile t's slot and copies rows
    row.. of (head, batch) of both arrays into it for every thread (the full barriers expect
    one arrival: Ring.filled is not called); ``stats`` (the dK/dV kernel's; None in the dQ
    kernel's) = (lse, delta, an element index in both, two shared addresses): a run of
    BLOCK_M + STAT_COPY_EXTRA values of each copied in bulk with the tile. The dense kernels
    then take lse and delta as backward_portable's padded preprocess writes them
    (padded_stat_rows; the LSE in the log2 domain), one copy of the stat tiles for both
    warpgroups. The packed-batch kernels keep the cp.async ring.
    """

    block_m: int
    block_n: int
    threads: int
    stages: int
    s_regs: int
    acc_regs: int
    dq_regs: int
    stage0: int
    stage_bytes: int
    dq_atomic: bool
    block_position: object
    shared_base: object
    load_resident: object
    load_pair: object
    landed: object
    query_block_step: object
    key_tile_step: object
    atomic_dq: object
    divide: object
    write_rows: object
    drain: object = drain_copies
    ring: object = None
    ring_query_block_step: object = None
    publish_maps: object = None
    ring_boxes: object = None


def build_kernels(backend, alibi=False, mods=None):
    """The dK/dV kernel and (unless the backend adds dQ up by atomics) the dQ kernel, closed
    over ``backend``, each dense and over a packed batch; Numba compiles each on its first
    launch. With ``alibi`` the ALiBi slopes are the kernels' ``*variant`` array, and each
    head's slope goes to the backend's steps (its probabilities_function and row_ds_function
    built with ``alibi`` too). With ``mods`` (a validation.Mods, the backend's element
    functions built with it too) the mod_args follow, then a block mask's index where
    ``mods.block_mask``, and the steps get (batch entry, head, ``*variant``) besides. With
    the backend's ``ring_boxes`` the dense kernels take three more last: their tensor maps'
    templates and a buffer to publish them in (Backend).

    One block body per kernel (``dkdv_block``, ``dq_block``) takes where its sequence starts in
    every array and its lengths; the dense kernels give it batch ``blockIdx.z``'s, the packed
    ones (``*_varlen``) sequence ``blockIdx.z``'s from the cumulative offsets (clamped to the
    arrays, the lengths to the max lengths), so no read or write leaves the arrays whatever
    the offsets hold. A packed block past its sequence's end exits at once."""
    BLOCK_M, BLOCK_N, THREADS, STAGES = (
        backend.block_m,
        backend.block_n,
        backend.threads,
        backend.stages,
    )
    S_REGS, ACC_REGS, DQ_REGS = backend.s_regs, backend.acc_regs, backend.dq_regs
    STAGE0, STAGE_BYTES, DQ_ATOMIC = backend.stage0, backend.stage_bytes, backend.dq_atomic
    RING = backend.ring is not None
    # the dense kernels' tensor maps (Backend.ring_boxes)
    TMA = RING and backend.ring_boxes is not None
    # LSE and D values a thread fetches per block: with a ring, a warpgroup's threads fetch
    # their group's copy
    STAT_THREADS = 128 if RING else THREADS
    STAT_LOADS = stat_loads(BLOCK_M, STAT_THREADS)
    GROUPS = THREADS // STAT_THREADS  # copies of the LSE and D tiles
    # LSE and D of every stage (and copy); with TMA one copy, a slot's run from its first
    # row rounded down to 16 bytes (STAT_COPY_EXTRA), copied in bulk to a 16-byte boundary
    STAT_ROWS = BLOCK_M + STAT_COPY_EXTRA if TMA else BLOCK_M
    STAT_TILE = STAGES * STAT_ROWS if TMA else GROUPS * STAGES * BLOCK_M
    STAT_ALIGN = 16 if TMA else None
    RING_BARRIERS = 2 * STAGES  # a ring's full and empty mbarriers
    if RING and (STAGES < 3 or DQ_ATOMIC and backend.ring_query_block_step is None):
        raise ValueError(
            f"a ring of tiles needs stages >= 3 (not {STAGES}), and with dQ added up "
            "ring_query_block_step (the schedule that orders its dS tiles)"
        )
    block_position = backend.block_position
    shared_base = backend.shared_base
    load_resident = backend.load_resident
    load_pair = backend.load_pair
    landed = backend.landed
    query_block_step = backend.query_block_step
    key_tile_step = backend.key_tile_step
    atomic_dq = backend.atomic_dq
    ring_query_block_step = backend.ring_query_block_step
    divide = backend.divide
    write_rows = backend.write_rows
    drain = backend.drain
    fetch_row_stats, store_row_stats = row_stats_functions(BLOCK_M, STAT_THREADS)
    load_query_block, fetch_query_stats = query_block_loader(
        load_pair, fetch_row_stats, STAT_THREADS if RING else None
    )
    ring = backend.ring if RING else Ring(*(None,) * len(Ring._fields))
    slope_of, _ = alibi_functions(alibi)
    BLOCK_MASK = mods is not None and mods.block_mask
    # the index among *variant: constant slice bounds (a tuple of arrays takes no run-time
    # index, and an expression there is one)
    MASK_AT = mod_functions(mods, int(alibi)).block_mask_at
    MASK_END = MASK_AT + 1
    # the dense kernels' tensor maps: after every variant array above
    MAPS_AT = int(alibi) + (0 if mods is None else len(mods.kinds) + int(BLOCK_MASK))
    MAPS_END = MAPS_AT + 3  # two templates and the launch's map buffer
    publish_maps, ring_boxes = backend.publish_maps, backend.ring_boxes

    @device_function
    def masked_query_range(variant, b, kv_head, heads_per_kv, n0, last_key, m_lo, m_hi):
        """[m_lo, m_hi) narrowed to the rows a block mask shows keys n0..last_key to, for
        some head of kv head ``kv_head``'s group (the union over the group)."""
        if BLOCK_MASK:
            index = variant[MASK_AT:MASK_END][0]
            lo, hi = m_hi, m_lo
            for head in range(kv_head * heads_per_kv, (kv_head + 1) * heads_per_kv):
                h_lo, h_hi = query_ranges(index, b, head, n0, last_key)
                if h_lo < h_hi:
                    lo, hi = min(lo, h_lo), max(hi, h_hi)
            return max(m_lo, lo), min(m_hi, hi)
        return m_lo, m_hi

    @device_function
    def masked_key_range(variant, b, head, m0, last_row, n_lo, n_hi):
        """[n_lo, n_hi) narrowed to the keys a block mask shows rows m0..last_row of
        ``head``."""
        if BLOCK_MASK:
            index = variant[MASK_AT:MASK_END][0]
            lo, hi, _, _ = key_ranges(index, b, head, m0, last_row)
            return max(n_lo, lo), min(n_hi, hi)
        return n_lo, n_hi

    @device_function
    def fill_query_slot(
        bars, t, stage_addr, q, do, lse, delta, lse_r, d_r, lse_tile, d_tile, rows, head, m0,
        q_st, do_st, seqlen_q, b, maps, tid,
    ):  # fmt: skip
        """Query block ``t`` of the ring (rows m0.. of ``head``) into its slot at
        ``stage_addr`` once the slot is free: by the tensor memory accelerator where the
        kernel has tensor ``maps`` (Backend.ring_boxes; its LSE and D too, from
        padded_stat_rows' buffers into the slot's run of the stat tiles, stat_slot), else by
        every thread's cp.async, its LSE and D into registers."""
        if maps is not None:
            _, _, lse_a, lse_b, lse_stride = rows
            at = (lse_a + head) * lse_stride + lse_b + (m0 & ~3)
            into = uint32(t) % uint32(STAGES) * uint32(STAT_ROWS)
            stats = (lse, delta, at, ptx.shared_address(lse_tile, into),
                     ptx.shared_address(d_tile, into))  # fmt: skip
            ring_boxes(bars, t, stage_addr, maps, int32(m0), int32(head), int32(b), tid, stats)
        else:
            ring.claim(bars, t)
            load_query_block(stage_addr, q, do, lse, delta, lse_r, d_r, rows, head, m0, q_st,
                             do_st, seqlen_q, tid)  # fmt: skip
            ring.filled(bars, t)

    @device_function
    def stat_slot(slot, group, m0):
        """Where ring slot ``slot``'s query block (first row m0) starts in the stat tiles: in
        this warpgroup's copy (``group``: its first slot), or with TMA in the one run of
        STAT_ROWS a slot that the bulk copies filled from row m0 rounded down to 16 bytes."""
        if TMA:
            return slot * uint32(STAT_ROWS) + uint32(m0 & 3)
        return (group + slot) * BLOCK_M

    @device_function
    def ring_query_blocks(
        q, do, lse, delta, q_st, do_st, rows, seqlen_q, seqlen_k, window_left, window_right,
        variant, b, resident, st, dpt, dk_acc, dv_acc, lse_r, d_r, lse_tile, d_tile, base, head,
        m_lo, m_hi, n_blocks, key0, scale_log2, nheads, warp, lane, tid, dqa, dq_acc, dq_first,
        dq_ss, dq_sh, maps,
    ):  # fmt: skip
        """dkdv_block's query blocks through the backend's ring: block t in slot t % STAGES,
        loaded STAGES - 1 blocks ahead, after block t - STAGES's slot is released by every
        thread; LSE and D in this warpgroup's copy of the tiles, stored for block it + 1 once
        block it's step is done (the values fetched one block earlier), then a warpgroup
        barrier. The resident K and V (and the first block's LSE and D) are waited for once,
        behind a block barrier. With TMA the LSE and D come with their block's tiles, one copy
        in the slot's run of the stat tiles, and no warpgroup barrier is needed. With
        DQ_ATOMIC the backend's ring_query_block_step adds each block's dQ up too."""
        bars = cuda.shared.array(RING_BARRIERS, uint64)
        group = (warp >> 2) * STAGES  # this warpgroup's tiles of LSE and D
        gtid = tid & (STAT_THREADS - 1)  # this thread within its warpgroup
        first_stage = base + uint32(STAGE0)
        ring.start(bars, tid)
        ring.first_turn(warp)
        m0 = m_lo
        load_head, load_m0 = head, m_lo  # the next block to load
        for j in range(STAGES - 1):  # prologue: blocks 0 .. STAGES - 2
            if j < n_blocks:
                fill_query_slot(
                    bars, uint32(j), first_stage + uint32(j * STAGE_BYTES), q, do, lse, delta,
                    lse_r, d_r, lse_tile, d_tile, rows, load_head, load_m0, q_st, do_st,
                    seqlen_q, b, maps, tid,
                )  # fmt: skip
                if j == 0 and not TMA:
                    store_row_stats(lse_tile, d_tile, lse_r, d_r, group, gtid)
                load_head, load_m0 = next_query_block(load_head, load_m0, m_lo, m_hi, BLOCK_M)
        landed()  # K and V (every thread's copies, and block 0's), block 0's LSE and D
        for it in range(n_blocks):
            slot = uint32(it) % uint32(STAGES)  # (32-bit: the division is a multiply)
            ring.wait_full(bars, it)
            score_args = (slope_of(variant, b, head, nheads, float32(LOG2E)), (b, head, variant))
            stats = stat_slot(slot, group, m0)
            scores = (lse_tile, d_tile, stats, key0, m0, lane, seqlen_q, seqlen_k, scale_log2,
                      window_left, window_right, score_args)  # fmt: skip
            stage_addr = first_stage + slot * uint32(STAGE_BYTES)
            if DQ_ATOMIC:
                pending = (base, dq_acc, dq_first + head * dq_sh, dq_ss, dq_sh, m0, it, warp,
                           lane)  # fmt: skip
                ring_query_block_step(
                    st, dpt, dk_acc, dv_acc, dqa, resident, stage_addr, scores, pending
                )
            else:
                query_block_step(st, dpt, dk_acc, dv_acc, resident, stage_addr, scores)
            ring.release(bars, it)  # (the step's products have landed)
            if it + 1 < n_blocks:
                if not TMA:
                    nxt = uint32(uint32(it) + uint32(1)) % uint32(STAGES)
                    store_row_stats(lse_tile, d_tile, lse_r, d_r, group + nxt, gtid)
                ahead = it + STAGES - 1
                if ahead < n_blocks:
                    into = uint32(ahead) % uint32(STAGES)
                    fill_query_slot(
                        bars, ahead, first_stage + into * uint32(STAGE_BYTES), q, do, lse,
                        delta, lse_r, d_r, lse_tile, d_tile, rows, load_head, load_m0, q_st,
                        do_st, seqlen_q, b, maps, tid,
                    )  # fmt: skip
                    load_head, load_m0 = next_query_block(load_head, load_m0, m_lo, m_hi, BLOCK_M)
                if not TMA:
                    ring.group_sync(warp)  # block it + 1's LSE and D, for the whole warpgroup
            head, m0 = next_query_block(head, m0, m_lo, m_hi, BLOCK_M)
        ring.last_turn(warp)

    @device_function
    def fill_key_slot(bars, t, stage_addr, k, v, k_at, v_at, k_ss, v_ss, keys_left, coords,
                      maps, tid):  # fmt: skip
        """Key tile ``t`` of the ring (K and V from element k_at and v_at, ``keys_left`` keys
        on; coords = (its first key, kv head, batch)) into its slot at ``stage_addr`` once
        the slot is free: by the tensor memory accelerator where the kernel has tensor
        ``maps`` (Backend.ring_boxes), else by every thread's cp.async."""
        if maps is not None:
            n0, kv_head, b = coords
            ring_boxes(bars, t, stage_addr, maps, int32(n0), int32(kv_head), int32(b), tid, None)
        else:
            ring.claim(bars, t)
            load_pair(stage_addr, k, v, k_at, k_ss, v_at, v_ss, keys_left, tid)
            ring.filled(bars, t)

    @device_function
    def ring_key_tiles(
        k, v, k_at, v_at, k_ss, v_ss, keys_left, n_tiles, s, dp, acc, resident, first_stage,
        row_stats, scale_log2, bias, tid, coords, maps,
    ):  # fmt: skip
        """dq_block's key tiles through the backend's ring: tile t in slot t % STAGES, loaded
        STAGES - 1 tiles ahead, after tile t - STAGES's slot is released by every thread. The
        resident Q and dO are waited for once, behind a block barrier. ``coords``: (the first
        tile's first key, kv head, batch), for tensor ``maps`` (fill_key_slot)."""
        n_lo, kv_head, b = coords
        bars = cuda.shared.array(RING_BARRIERS, uint64)
        ring.start(bars, tid)
        ring.first_turn(tid >> 5)
        for j in range(STAGES - 1):  # prologue: tiles 0 .. STAGES - 2
            if j < n_tiles:
                rows = int64(j * BLOCK_M)
                fill_key_slot(bars, uint32(j), first_stage + uint32(j * STAGE_BYTES), k, v,
                              k_at + rows * k_ss, v_at + rows * v_ss, k_ss, v_ss,
                              keys_left - j * BLOCK_M, (n_lo + j * BLOCK_M, kv_head, b), maps,
                              tid)  # fmt: skip
        landed()  # Q and dO (every thread's copies, and tile 0's)
        for it in range(n_tiles):
            t = uint32(it)  # (32-bit: the slot's division by STAGES is a multiply)
            ring.wait_full(bars, t)
            key_tile_step(s, dp, acc, resident,
                          first_stage + (t % uint32(STAGES)) * uint32(STAGE_BYTES), row_stats,
                          int32(it * BLOCK_M), scale_log2, bias)  # fmt: skip
            ring.release(bars, t)  # (the step's products have landed)
            ahead = uint32(t + uint32(STAGES - 1))
            if ahead < uint32(n_tiles):  # (unsigned against signed would compare as float64)
                rows = int64(ahead * uint32(BLOCK_M))
                skip = int32(ahead * uint32(BLOCK_M))
                fill_key_slot(bars, ahead,
                              first_stage + (ahead % uint32(STAGES)) * uint32(STAGE_BYTES), k, v,
                              k_at + rows * k_ss, v_at + rows * v_ss, k_ss, v_ss,
                              keys_left - skip, (n_lo + skip, kv_head, b), maps,
                              tid)  # fmt: skip
        ring.last_turn(tid >> 5)

    @device_function
    def dkdv_block(
        q,
        k,
        v,
        do,
        lse,
        delta,
        dk,
        dv,
        dq_acc,
        q_st,
        k_st,
        v_st,
        do_st,
        dk_st,
        dv_st,
        dq_st,
        firsts,
        rows,
        seqlen_q,
        seqlen_k,
        heads_per_kv,
        scale,
        window_left,
        window_right,
        position,
        variant,
        b,
        maps,
    ):
        """dK and dV of one key block (and dQ's atomics). ``firsts``: where the sequence starts
        in k, v, dk, dv and dq_acc; ``rows``: in q, do, lse and delta (load_query_block);
        ``position``: block_position's (tid, lane, warp, n0, col_base, kv_head); ``variant``,
        ``b``: the kernel's variant arrays and the sequence (ALiBi's slopes); ``maps``: Q's
        and dO's tensor-map templates and the launch's map buffer (a dense kernel with
        Backend.ring_boxes), else None."""
        k_first, v_first, dk_first, dv_first, dq_first = firsts
        _, k_ss, k_sh = k_st
        _, v_ss, v_sh = v_st
        _, dk_ss, dk_sh = dk_st
        _, dv_ss, dv_sh = dv_st
        _, dq_ss, dq_sh = dq_st
        tid, lane, warp, n0, col_base, kv_head = position
        smem = cuda.shared.array(0, uint16)
        lse_tile = cuda.shared.array(STAT_TILE, float32, alignment=STAT_ALIGN)
        d_tile = cuda.shared.array(STAT_TILE, float32, alignment=STAT_ALIGN)
        st = cuda.local.array(S_REGS, float32)
        dpt = cuda.local.array(S_REGS, float32)
        dk_acc = cuda.local.array(ACC_REGS, float32)
        dv_acc = cuda.local.array(ACC_REGS, float32)
        dqa = cuda.local.array(DQ_REGS, float32)
        lse_r = cuda.local.array(STAT_LOADS, float32)
        d_r = cuda.local.array(STAT_LOADS, float32)

        last_key = min(n0 + BLOCK_N, seqlen_k) - 1
        m_lo, m_hi = block_query_range(n0, last_key, seqlen_q, seqlen_k, window_left, window_right)
        m_lo, m_hi = masked_query_range(variant, b, kv_head, heads_per_kv, n0, last_key, m_lo, m_hi)
        scale_log2 = scale * float32(LOG2E)
        # The query blocks this key block sees, for every query head of the GQA group in turn.
        blocks_per_head = (m_hi - m_lo + BLOCK_M - 1) // BLOCK_M if m_hi > m_lo else 0
        n_blocks = heads_per_kv * blocks_per_head

        # -- K and V of this block stay in shared memory for the whole kernel
        base = shared_base(smem)
        if maps is not None:
            publish_maps(maps, q, do, base, warp, lane)
        resident = load_resident(
            base,
            k,
            v,
            k_first + kv_head * k_sh + int64(n0) * k_ss,
            k_ss,
            v_first + kv_head * v_sh + int64(n0) * v_ss,
            v_ss,
            seqlen_k - n0,
            warp,
            lane,
            col_base,
            tid,
        )

        for i in range(ACC_REGS):
            dk_acc[i] = float32(0.0)
            dv_acc[i] = float32(0.0)
        key0 = n0 + warp * 16 + (lane >> 2)  # this lane's key rows: key0 and key0 + 8

        # The block to load next: its query head and first row, and its stage.
        next_head = kv_head * heads_per_kv
        next_m0 = m_lo
        first_stage = base + uint32(STAGE0)
        nheads = cuda.gridDim.y * heads_per_kv
        if RING:
            ring_query_blocks(
                q, do, lse, delta, q_st, do_st, rows, seqlen_q, seqlen_k, window_left,
                window_right, variant, b, resident, st, dpt, dk_acc, dv_acc, lse_r, d_r,
                lse_tile, d_tile, base, next_head, m_lo, m_hi, n_blocks, key0, scale_log2,
                nheads, warp, lane, tid, dqa, dq_acc, dq_first, dq_ss, dq_sh, maps,
            )  # fmt: skip
            n_blocks = 0  # (the loop below is the block-barrier schedule's)
        if STAGES > 1 and n_blocks > 0:  # prologue: the first block's loads
            load_query_block(
                first_stage, q, do, lse, delta, lse_r, d_r, rows, next_head, m_lo, q_st, do_st,
                seqlen_q, tid,
            )  # fmt: skip
            store_row_stats(lse_tile, d_tile, lse_r, d_r, 0, tid)

        for it in range(n_blocks):
            head = next_head
            m0 = next_m0
            stage = it % STAGES
            next_head, next_m0 = next_query_block(head, m0, m_lo, m_hi, BLOCK_M)
            if STAGES == 1:  # load this block, then wait for it
                cuda.syncthreads()  # every warp is done with the previous block
                load_query_block(
                    first_stage, q, do, lse, delta, lse_r, d_r, rows, head, m0, q_st, do_st,
                    seqlen_q, tid,
                )  # fmt: skip
                store_row_stats(lse_tile, d_tile, lse_r, d_r, 0, tid)
                landed()
            else:  # this block has landed; start the next one's loads into the other stage
                landed()  # ... and every warp is done with block it - 1
                if it + 1 < n_blocks:
                    load_query_block(
                        first_stage + uint32((1 - stage) * STAGE_BYTES), q, do, lse, delta,
                        lse_r, d_r, rows, next_head, next_m0, q_st, do_st, seqlen_q, tid,
                    )  # fmt: skip

            score_args = (slope_of(variant, b, head, nheads, float32(LOG2E)), (b, head, variant))
            scores = (lse_tile, d_tile, stage * BLOCK_M, key0, m0, lane, seqlen_q, seqlen_k,
                      scale_log2, window_left, window_right, score_args)  # fmt: skip
            query_block_step(
                st, dpt, dk_acc, dv_acc, resident, first_stage + uint32(stage * STAGE_BYTES), scores
            )
            if DQ_ATOMIC:  # -- dQ += dS K through shared memory, by atomics
                atomic_dq(
                    smem,
                    base,
                    dpt,
                    dqa,
                    dq_acc,
                    dq_first + head * dq_sh,
                    dq_ss,
                    dq_sh,
                    m0,
                    col_base,
                    warp,
                    lane,
                    seqlen_q,
                    dk_acc,
                    dv_acc,
                )
            if STAGES > 1 and it + 1 < n_blocks:  # the next block's LSE and D, fetched above
                store_row_stats(lse_tile, d_tile, lse_r, d_r, 1 - stage, tid)

        drain(lane)  # nothing may be in flight when the block exits (no query block)
        row0 = n0 + warp * 16
        write_rows(
            dk, dk_acc, dk_first + kv_head * dk_sh + col_base, dk_ss, row0, lane, seqlen_k, scale
        )
        write_rows(
            dv,
            dv_acc,
            dv_first + kv_head * dv_sh + col_base,
            dv_ss,
            row0,
            lane,
            seqlen_k,
            float32(1.0),
        )

    @device_function
    def dq_block(
        q,
        k,
        v,
        do,
        dq,
        lse,
        delta,
        q_st,
        k_st,
        v_st,
        do_st,
        dq_st,
        firsts,
        lse_base,
        seqlen_q,
        seqlen_k,
        heads_per_kv,
        scale,
        window_left,
        window_right,
        position,
        variant,
        b,
        maps,
    ):
        """dQ = scale * sum over keys of dS K for BLOCK_N query rows, each element summed by
        one thread in key order: deterministic. ``variant``, ``b``: the kernel's variant
        arrays and the sequence (ALiBi's slopes, a user's functions, a block mask). The
        dK/dV block with the roles swapped: Q and
        dO stay in the slots that hold K and V there, and tiles of BLOCK_M keys and values
        stream through the stages that hold Q and dO there. ``firsts``: where the sequence
        starts in q, k, v, do and dq; ``lse_base``: where this head's row 0 is in lse and
        delta; ``position``: block_position's (tid, lane, warp, m0, col_base, head); ``maps``:
        K's and V's tensor-map templates and the launch's map buffer (a dense kernel with
        Backend.ring_boxes), else None."""
        q_first, k_first, v_first, do_first, dq_first = firsts
        _, q_ss, q_sh = q_st
        _, k_ss, k_sh = k_st
        _, v_ss, v_sh = v_st
        _, do_ss, do_sh = do_st
        _, dq_ss, dq_sh = dq_st
        tid, lane, warp, m0, col_base, head = position
        smem = cuda.shared.array(0, uint16)
        s = cuda.local.array(S_REGS, float32)
        dp = cuda.local.array(S_REGS, float32)
        acc = cuda.local.array(ACC_REGS, float32)

        kv_head = divide(head, heads_per_kv)
        last_row = min(m0 + BLOCK_N, seqlen_q) - 1
        n_lo, n_hi = block_key_range(m0, last_row, seqlen_q, seqlen_k, window_left, window_right)
        n_lo, n_hi = masked_key_range(variant, b, head, m0, last_row, n_lo, n_hi)
        slope = slope_of(variant, b, head, cuda.gridDim.y, float32(LOG2E))
        n_tiles = (n_hi - n_lo + BLOCK_M - 1) // BLOCK_M if n_hi > n_lo else 0
        scale_log2 = scale * float32(LOG2E)

        # -- Q and dO of this block stay in shared memory for the whole kernel
        base = shared_base(smem)
        if maps is not None:
            publish_maps(maps, k, v, base, warp, lane)
        resident = load_resident(
            base,
            q,
            do,
            q_first + head * q_sh + int64(m0) * q_ss,
            q_ss,
            do_first + head * do_sh + int64(m0) * do_ss,
            do_ss,
            seqlen_q - m0,
            warp,
            lane,
            col_base,
            tid,
        )

        # -- this lane's two query rows: LSE, D and visible keys (relative to its first column)
        warp_row = m0 + warp * 16
        row_stats = lane_row_stats(
            lse,
            delta,
            lse_base,
            warp_row,
            lane,
            n_lo,
            seqlen_q,
            seqlen_k,
            window_left,
            window_right,
            TMA,  # (padded_stat_rows' buffers: log2-domain already)
        )
        for i in range(ACC_REGS):
            acc[i] = float32(0.0)
        # ALiBi: q_idx - kv_idx of the lane's first row and first column of the first tile;
        # a user's functions: those q_idx and kv_idx
        q0 = warp_row + (lane >> 2) + seqlen_k - seqlen_q
        kv0 = n_lo + (lane & 3) * 2
        distance = float32(warp_row + (lane >> 2) + seqlen_k - seqlen_q - n_lo - (lane & 3) * 2)

        k_at = k_first + kv_head * k_sh + int64(n_lo) * k_ss  # key tile `it` below
        v_at = v_first + kv_head * v_sh + int64(n_lo) * v_ss
        first_stage = base + uint32(STAGE0)
        if RING:
            ring_key_tiles(
                k, v, k_at, v_at, k_ss, v_ss, seqlen_k - n_lo, n_tiles, s, dp, acc, resident,
                first_stage, row_stats, scale_log2, (distance, slope, (b, head, variant), q0, kv0),
                tid, (n_lo, kv_head, b), maps,
            )  # fmt: skip
            n_tiles = 0  # (the loop below is the block-barrier schedule's)
        if STAGES > 1 and n_tiles > 0:  # prologue: the first key tile's loads
            load_pair(first_stage, k, v, k_at, k_ss, v_at, v_ss, seqlen_k - n_lo, tid)
        for it in range(n_tiles):
            n0 = n_lo + it * BLOCK_M
            stage = it % STAGES
            if STAGES == 1:
                cuda.syncthreads()  # every warp is done with the previous tile
                load_pair(first_stage, k, v, k_at, k_ss, v_at, v_ss, seqlen_k - n0, tid)
                landed()
            else:
                landed()  # tile `it` landed for all; every warp is done with it - 1
                if it + 1 < n_tiles:
                    load_pair(
                        first_stage + uint32((1 - stage) * STAGE_BYTES),
                        k,
                        v,
                        k_at + int64(BLOCK_M) * k_ss,
                        k_ss,
                        v_at + int64(BLOCK_M) * v_ss,
                        v_ss,
                        seqlen_k - n0 - BLOCK_M,
                        tid,
                    )
            # the lanes' visible keys are relative to the first tile's columns: shifted there
            key_tile_step(
                s,
                dp,
                acc,
                resident,
                first_stage + uint32(stage * STAGE_BYTES),
                row_stats,
                int32(it * BLOCK_M),
                scale_log2,
                (distance, slope, (b, head, variant), q0, kv0),
            )
            k_at += int64(BLOCK_M) * k_ss  # key tile it + 1
            v_at += int64(BLOCK_M) * v_ss

        ptx.cp_async_wait(0)  # nothing may be in flight when the block exits (no key tile)
        write_rows(
            dq, acc, dq_first + head * dq_sh + col_base, dq_ss, warp_row, lane, seqlen_q, scale
        )

    @device_function
    def stat_stride(seqlen_q):
        """A head's rows in the dense kernels' lse and delta: padded_stat_rows' with TMA."""
        if TMA:
            return padded_stat_rows_on_device(seqlen_q, BLOCK_M)
        return seqlen_q

    @kernel(launch_bounds=THREADS)
    def dkdv(
        q,
        k,
        v,
        do,
        lse,
        delta,
        dk,
        dv,
        dq_acc,
        q_st,
        k_st,
        v_st,
        do_st,
        dk_st,
        dv_st,
        dq_st,
        seqlen_q,
        seqlen_k,
        heads_per_kv,
        scale,
        window_left,
        window_right,
        *variant,
    ):
        # n0: the block's first key. The first keys are seen by the most queries under a causal
        # mask, the last ones under a left window alone.
        tid, lane, warp, n0, col_base, kv_head, batch = block_position(
            (window_left < 0) != (window_right < 0), window_right < 0
        )
        nheads = cuda.gridDim.y * heads_per_kv
        dkdv_block(
            q, k, v, do, lse, delta, dk, dv, dq_acc, q_st, k_st, v_st, do_st, dk_st, dv_st, dq_st,
            (batch * k_st[0], batch * v_st[0], batch * dk_st[0], batch * dv_st[0],
             batch * dq_st[0]),
            (batch * q_st[0], batch * do_st[0], int64(batch) * nheads, 0, stat_stride(seqlen_q)),
            seqlen_q, seqlen_k, heads_per_kv, scale, window_left, window_right,
            (tid, lane, warp, n0, col_base, kv_head), variant, batch,
            variant[MAPS_AT:MAPS_END] if TMA else None,
        )  # fmt: skip

    @kernel(launch_bounds=THREADS)
    def dkdv_varlen(
        q,
        k,
        v,
        do,
        lse,
        delta,
        dk,
        dv,
        dq_acc,
        cu_q,
        cu_k,
        q_st,
        k_st,
        v_st,
        do_st,
        dk_st,
        dv_st,
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
        """dkdv over a packed batch: q, do, dq_acc (total_q, nheads, head_dim), k, v, dk, dv
        (total_k, nheads_k, head_dim) viewed with a batch of 1, lse and delta (nheads,
        total_q); sequence b is rows cu_q[b] .. cu_q[b + 1] - 1 (keys alike)."""
        tid, lane, warp, n0, col_base, kv_head, b = block_position(
            (window_left < 0) != (window_right < 0), window_right < 0
        )
        q_start, seqlen_q = packed_sequence(cu_q, b, total_q, max_seqlen_q)
        k_start, seqlen_k = packed_sequence(cu_k, b, total_k, max_seqlen_k)
        if n0 >= seqlen_k:
            return  # past this sequence's keys: the whole block
        dkdv_block(
            q, k, v, do, lse, delta, dk, dv, dq_acc, q_st, k_st, v_st, do_st, dk_st, dv_st, dq_st,
            (k_start * k_st[1], k_start * v_st[1], k_start * dk_st[1], k_start * dv_st[1],
             q_start * dq_st[1]),
            (q_start * q_st[1], q_start * do_st[1], int64(0), q_start, total_q),
            seqlen_q, seqlen_k, heads_per_kv, scale, window_left, window_right,
            (tid, lane, warp, n0, col_base, kv_head), variant, b, None,
        )  # fmt: skip

    @kernel(launch_bounds=THREADS)
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
        # m0: the block's first query row. The last rows see the most keys under a causal mask,
        # the first ones under a left window alone.
        tid, lane, warp, m0, col_base, head, batch = block_position(
            (window_left < 0) != (window_right < 0), window_left < 0
        )
        dq_block(
            q, k, v, do, dq, lse, delta, q_st, k_st, v_st, do_st, dq_st,
            (batch * q_st[0], batch * k_st[0], batch * v_st[0], batch * do_st[0],
             batch * dq_st[0]),
            (int64(batch) * cuda.gridDim.y + head) * stat_stride(seqlen_q),
            seqlen_q, seqlen_k, heads_per_kv, scale, window_left, window_right,
            (tid, lane, warp, m0, col_base, head), variant, batch,
            variant[MAPS_AT:MAPS_END] if TMA else None,
        )  # fmt: skip

    @kernel(launch_bounds=THREADS)
    def dq_varlen(
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
        """dq_kernel over a packed batch (arrays as dkdv_varlen's)."""
        tid, lane, warp, m0, col_base, head, b = block_position(
            (window_left < 0) != (window_right < 0), window_left < 0
        )
        q_start, seqlen_q = packed_sequence(cu_q, b, total_q, max_seqlen_q)
        k_start, seqlen_k = packed_sequence(cu_k, b, total_k, max_seqlen_k)
        if m0 >= seqlen_q:
            return  # past this sequence's query rows: the whole block
        dq_block(
            q, k, v, do, dq, lse, delta, q_st, k_st, v_st, do_st, dq_st,
            (q_start * q_st[1], k_start * k_st[1], k_start * v_st[1], q_start * do_st[1],
             q_start * dq_st[1]),
            int64(head) * total_q + q_start,
            seqlen_q, seqlen_k, heads_per_kv, scale, window_left, window_right,
            (tid, lane, warp, m0, col_base, head), variant, b, None,
        )  # fmt: skip

    if DQ_ATOMIC:
        return Kernels(dkdv, None, dkdv_varlen, None)
    return Kernels(dkdv, dq_kernel, dkdv_varlen, dq_varlen)
