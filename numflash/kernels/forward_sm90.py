"""The Hopper attention forward (sm_90a): FlashAttention's algorithm on warpgroup MMAs.

A work tile is a block of BLOCK_M query rows of one (head, batch). With a producer the launch
is persistent (a thread block a multiprocessor going through work tiles, tile_of and ranked
say in which order, a dense launch's from a work order made on the host: ordered; not over a
paged cache: persistent), else a thread block a tile. A block's CONSUMERS warpgroups (128
threads each) own 64 query rows apiece and keep their output accumulator ``acc`` (64 x
head_dim, fp32), running max ``m_i`` and running sum ``l_i`` in registers; the block's Q tile
stays in shared memory, and key/value tiles of BLOCK_N rows stream through a ring of STAGES
shared-memory slots filled by cp.async. Per key tile j and warpgroup:

    S_j = Q K_j^T                       wgmma m64nBLOCK_Nk16 x head_dim / 16, both operands read
                                        K-major from shared memory by descriptor
    m = max(m_i, rowmax(S_j) * scale * log2(e));  P_j = exp2(S_j * scale * log2(e) - m)
    alpha = exp2(m_i - m);  l_i = alpha * l_i + rowsum(P_j)
    acc = alpha * acc;  acc += P_j V_j  wgmma m64n{head_dim}k16 x BLOCK_N / 16, A = P_j rounded
                                        to 16 bits in registers (mma.sync's A layout: the
                                        accumulator layout of S_j), B = V_j read MN-major
    O = acc / l_i;  LSE = (m_i + log2(l_i)) * ln(2)

The products of one warpgroup overlap its own softmax (FlashAttention-3's intra-warpgroup
pipelining): S_{j+1} = Q K_{j+1}^T and acc += P_j V_j are issued together, the softmax of S_{j+1}
runs once the first has landed while the second is still in flight, and acc is rescaled only
after it lands. The warpgroups of a block share every tile and interleave on the tensor cores.

Two schedules load the tiles (``PRODUCER``). Without a producer every thread issues cp.async
copies, a tile STAGES - 2 tiles ahead of its use, between block-wide barriers. With one, a
warpgroup of its own does (warp specialisation, its registers handed to the consumers by
setmaxnreg): each thread's copies arrive at the slot's mbarrier when they land, K and V on
barriers of their own, and the consumers release a slot's K once S has landed and its V once
P V has; it loads the next work tile's Q once every S of the last has landed (Q_EMPTY) and
its keys as slots free up, while the consumers finish the last. With ``TMA`` the producer's
first warp instead publishes tensor maps of Q, K and V once (kernels/ptx_tma.py) and one of
its threads copies each tile with a TMA instruction per 64
columns, the bytes completing the slot's mbarrier; the rest of the warpgroup exits. With two
consumers and a producer, ``PINGPONG`` makes them take turns issuing their products (named
barriers), so that one's softmax runs while the other's products do.

Shared memory: every 64-column slice of a row-major tile (Q: BLOCK_M rows; K, V: BLOCK_N rows)
is one "atom" of 128-byte rows with the 128-byte swizzle (16-byte chunk c of row r at c ^ (r &
7), 8-row groups 1024 bytes apart; ptx_sm90's docstring), the atoms of a tile one after the
other (TMA writes this layout itself). Head dims that are not a multiple of 64 are zero-filled
up to one in shared memory, never read from global memory; S's products skip the k16 steps
that hold only zeros.

Key tiles that the causal or window mask hides from every row of the block are neither loaded
nor computed; tiles it hides partly are masked element by element. A packed batch (``VARLEN``)
runs the same body over each sequence's rows (cu_seqlens), as the mma.sync forward does; its
tensor maps are over all the packed rows, so a box reaching past a sequence's end holds the
next sequence's rows: masked out of S, and (zero_rows_past_end) zeroed in the last V tile.

Supports: float16 and bfloat16; head_dim a multiple of 8 up to 256; GQA/MQA; causal and sliding
windows aligned bottom-right; any seqlen_q and seqlen_k; rows that see no key (output 0, LSE
-inf); a softcap, sink logits and ALiBi (build's ``softcap``, ``sinks``, ``alibi``). Needs
compute capability 9.x (sm_90a) and ``scale_log2 > 0`` (as kernels/forward.py).
With ``cache`` the keys are a KV cache's (chunked prefill: a launch before appends the new rows,
or with ``append`` the producer's warps that issue no copies do, each work tile's before its
copies read them: append_tile), contiguous or paged, each sequence's length read on the
device. A paged cache's tiles load through the block table: by TMA as boxes of whole pages
where the page size allows it (paged_tma; a box a lane of the producer warp), else by cp.async
a row at a time; keys behind a page outside the cache are flagged absent (load_keys,
load_page_boxes).
docs/performance.md ("Hopper forward") has each schedule's measurements and what limits them.
"""

import functools

from numba import cuda, float32, int32, int64, uint8, uint16, uint32, uint64

from . import ptx, ptx_sm90, ptx_tma
from .block_mask import key_ranges
from .decode_portable import sequence_length
from .forward_portable import dense_bases, packed_bases, packed_sequence
from .fragments import PACK, acc_index, accumulator_position
from .jit import device_function, kernel
from .loads import (
    GROUP_BYTES,
    ROW_BYTES,
    page_of,
    page_shift_of,
    paged_row_loader,
    swizzled_descriptor,
    swizzled_row_loader,
)
from .mask import block_key_range, tile_needs_mask, visible_keys
from .mods import mod_functions
from .softmax import (
    LN2,
    LOG2E,
    NEG_INF,
    alibi_functions,
    final_lse,
    linear_alibi_step,
    raw_unit,
    row_starter,
    shift_of,
    sink_functions,
    softcap_function,
)

#: Query rows of one warpgroup: the M of every wgmma.
WARPGROUP_ROWS = 64
#: Global indices are ANDed with this (kernels/backward.py's NON_NEGATIVE): no wraparound code.
NON_NEGATIVE = (1 << 63) - 1


def padded_head_dim(head_dim):
    """The head_dim the shared tiles hold: whole 64-column atoms."""
    return (head_dim + 63) // 64 * 64


#: (producer, consumer) registers a thread after setmaxnreg, by consumer warpgroups; one
#: consumer keeps the 255 it has. 56 + 2 x 224 = 3 x 168 and 32 + 3 x 160 = 4 x 128 hand out
#: exactly the registers there are. FlashAttention-3's 40 / 232 made ptxas spill the producer's
#: cp.async addresses at head_dim 64, and the TMA producer's work-tile loop (persistent) at
#: head_dim 128 (sm_90a, CUDA 13; 224 leave the consumers room at 128).
REGISTER_SPLIT = {2: (56, 224), 3: (32, 160)}
#: ... when the producer reads a paged cache: its per-row page lookups (cp.async) spilled at 56
#: (head_dim 64, sm_90a, CUDA 13); by TMA, the warp's page lookups and flags take more than 24.
#: Also where the producer appends new rows (build's ``append``): at 56 its copies spilled 52
#: bytes over a contiguous cache (head_dim 128).
PAGED_REGISTER_SPLIT = {2: (72, 216), 3: (32, 160)}
#: The tensor maps a block publishes (Q, K, V), each staged in MAP_BYTES of shared memory.
MAPS = 3


def shared_memory_layout(head_dim, block_m, block_n, stages, paged=False):
    """(the first slot, one slot, V within a slot, the mbarriers, the staged tensor maps, the
    absent-key flags, total) in bytes from the block's 1024-byte aligned base, where the Q tile
    starts; the total includes 1024 bytes to align that base. The flags (a paged cache's:
    a byte per key of every slot, then an int32 per slot) take room only when ``paged``: at
    bytes, three stages of 128-key tiles fit at head_dim 128 (an int32 a key took 12 bytes
    more than the H200's 227 KiB)."""
    atoms = padded_head_dim(head_dim) // 64
    q_tile = block_m * ROW_BYTES * atoms
    kv_tile = block_n * ROW_BYTES * atoms
    slot = 2 * kv_tile
    barriers = q_tile + stages * slot
    maps = (barriers + 8 * (4 * stages + 2) + 127) // 128 * 128  # 128-byte aligned
    flags = maps + MAPS * ptx_tma.MAP_BYTES
    total = flags + (stages * (block_n + 4) if paged else 0) + GROUP_BYTES
    return q_tile, slot, kv_tile, barriers, maps, flags, total


#: The ``cache`` kinds of :func:`build` whose keys are a paged cache's: "paged" (tiles of
#: 64-column atoms BLOCK_N rows each), "grouped" (by TMA, each 8-row group of a tile holding
#: its rows of every atom, so that a page's box copies every atom at once: grouped_pages).
PAGED_CACHES = ("paged", "grouped")


def paged_tma(page_size, block_n):
    """Whether TMA reads a paged cache with tiles of ``block_n`` keys: each tile a whole number
    of boxes of min(page_size, block_n) rows, each box within one page and starting on a
    1024-byte boundary of the swizzled tile (8 rows)."""
    rows = min(page_size, block_n)
    return rows % 8 == 0 and block_n % rows == 0 and page_size % rows == 0


def grouped_pages(head_dim, page_size, block_n):
    """Whether TMA reads a paged cache's tiles in 8-row groups of every atom (``cache=
    "grouped"``): head_dim whole atoms, more than one (with one the layouts are the same), and
    boxes of a page as :func:`paged_tma`; the tensor maps must describe the arrays too
    (ptx_tma.grouped_templates)."""
    return head_dim % 64 == 0 and head_dim > 64 and paged_tma(page_size, block_n)


def persistent(producer, cache=None):
    """Whether the kernel's launch is persistent: a block a multiprocessor, each going through
    work tiles until none is left (with a producer, its loads of the next tile overlap the end
    of the last: FlashAttention-3's persistent kernel). Over a paged cache the tile loop's
    state pushed the producer's or the consumers' registers past what setmaxnreg leaves them
    (sm_90a, CUDA 13: tests/compile_targets.py): a block a tile."""
    return producer and cache not in PAGED_CACHES


def ordered(producer, varlen=False, cache=None):
    """Whether the launch's blocks may take their work tiles from a work order (listed, or -1
    for rounds of alternating direction: ranked): a persistent launch over a dense or packed
    batch. A dense launch's is made on the host (families.wgmma_forward.work_order: each
    round's costliest tiles to the blocks with the least work so far), a packed batch's on the
    device from its offsets (kernels/work_order.py). A KV cache's tiles keep the alternating
    rounds."""
    return persistent(producer, cache) and cache is None


#: The producer warps that copy a paged cache's tiles by TMA: 1, one warp issuing K's and V's
#: boxes in turn; 2, a warp each (produce_pages), which takes V's slot and copies out of the
#: next K's path (what the consumers waited for over pages): 1.14x at pages of 16, 1.04x at 64
#: on the H200 (``python tools/paged_prefill.py --producer-ab``; docs/performance.md).
PAGED_PRODUCER_WARPS = 2


def schedule(cfg, varlen=False, tma=True, cache=None):
    """:func:`build`'s arguments after the dtype for a WgmmaForwardConfig ``cfg``: its tiles and
    schedule, TMA loads where it asks for them and ``tma`` (the arrays allow them), ``varlen``,
    ``cache`` and the producer warps of a paged cache's TMA copies (PAGED_PRODUCER_WARPS)."""
    tma = cfg.tma and tma
    sizes = (cfg.consumers, cfg.block_n, cfg.stages)
    page_warps = PAGED_PRODUCER_WARPS if tma and cache in PAGED_CACHES else 1
    return sizes + (cfg.producer, cfg.pingpong, tma, varlen, cache, cfg.fma_exp2, page_warps)


#: The largest softcap whose bfloat16 kernels fix the softmax's max at the cap (bounded_rows):
#: probabilities down to exp(-2 softcap) = 2^-115 stay normal floats (ex2.approx.ftz flushes
#: below 2^-126) and bfloat16s. float16 (normal down to 2^-14) keeps the running max.
BOUNDED_SOFTCAP = 40.0


@functools.lru_cache(maxsize=None)
def build(
    head_dim, dtype_name, consumers, block_n, stages, producer, pingpong, tma, varlen=False,
    cache=None, fma_exp2=0, page_warps=1, softcap=0.0, sinks=False, alibi=False, mods=None,
    append=False,
):  # fmt: skip
    """The kernel of one configuration; every size is a compile-time constant. ``producer``: a
    warpgroup of its own loads the tiles (else every thread does, between barriers);
    ``pingpong``: two consumer warpgroups take turns issuing their products; ``tma``: the
    producer's loads are TMA copies through the tensor maps the kernel is given (else
    cp.async). ``varlen``: over a packed batch (grid (blocks of max_seqlen_q, nheads, batch),
    lse (nheads, total_q)); else dense (lse (batch, nheads, seqlen_q)); both take
    families.wgmma_forward.WGMMA_FORWARD's parameters. ``cache`` ("contiguous", or
    PAGED_CACHES' "paged" and "grouped"): the keys are a KV cache's (chunked prefill), each
    sequence's length read on the device; the kernel takes
    families.wgmma_forward.WGMMA_KVCACHE's parameters. ``fma_exp2``: of every 4 probabilities
    a thread computes, how many are exp2 on the FMA units (ptx.exp2_fma) rather than the
    special-function unit (0: none; on the H200 every k was slower, docs/performance.md).
    ``page_warps``: the producer warps of a paged cache's TMA copies (PAGED_PRODUCER_WARPS).
    ``softcap`` > 0 caps the scores (softmax.softcap_function; in bfloat16, up to
    BOUNDED_SOFTCAP and without ALiBi or user functions, the softmax's max fixed at the cap:
    bounded_rows); with ``sinks`` the head's
    sink logit, the kernel's first ``*variant`` array, joins each row's sum
    (softmax.sink_functions); with ``alibi`` the scores less the head's slope (the next
    array) times the distance
    (softmax.alibi_functions); ``mods`` (a validation.Mods): the user's score_mod and mask_mod
    after them (kernels/mods.py; the mod_args the last ``*variant`` arrays), every tile then
    taking the masked softmax. ``append`` (a KV cache read by TMA): the producer warps that
    issue no copies write the call's new rows into the cache first (append_tile), each work
    tile those its key tiles hold, instead of a launch of their own before."""
    if pingpong and (consumers != 2 or not producer):
        raise ValueError("pingpong takes two consumer warpgroups and a producer")
    if tma and not producer:
        raise ValueError("TMA loads take a producer")
    if varlen and cache is not None:
        raise ValueError("a KV cache's call is not a packed batch")
    if cache == "grouped" and not (tma and head_dim % 64 == 0):
        raise ValueError("a grouped paged cache is read by TMA, head_dim whole atoms")
    if cache in PAGED_CACHES and tma and block_n > 256:  # a box a lane: at most 32 boxes of 8 rows
        raise ValueError("paged TMA loads take tiles of at most 256 keys")
    if page_warps not in (1, 2) or page_warps == 2 and not (cache in PAGED_CACHES and tma):
        raise ValueError(f"page_warps is 1, or 2 for a paged cache by TMA; got {page_warps}")
    if append and (cache is None or not tma or (mods is not None and mods.block_mask)):
        raise ValueError("the kernel appends new rows over a KV cache read by TMA, no block mask")
    if fma_exp2 not in (0, 1, 2, 3, 4):
        raise ValueError(f"fma_exp2 is a count of 4 probabilities; got {fma_exp2}")
    FMA_EXP2 = fma_exp2
    HEAD_DIM, HD_PAD = head_dim, padded_head_dim(head_dim)
    BLOCK_N, STAGES, VARLEN = block_n, stages, varlen
    PRODUCER, PINGPONG, TMA = producer, pingpong, tma
    CACHE, PAGED, GROUPED = cache is not None, cache in PAGED_CACHES, cache == "grouped"
    SOFTCAP = softcap > 0
    # the cap's outer factor in the softmax's unit where nothing after the cap reads raw scores
    # (with FMA_EXP2, no default, the fold made ptxas spill 40 bytes at head_dim 128)
    folded = not (alibi or mods is not None or FMA_EXP2)
    # ... and then, in bfloat16, the softmax's max fixed at the cap (bounded_rows)
    BOUNDED = SOFTCAP and folded and dtype_name == "bfloat16" and softcap <= BOUNDED_SOFTCAP
    sink_of, with_sink = sink_functions(sinks)
    ALIBI = alibi
    slope_of, biased = alibi_functions(alibi, sinks)
    MODS = mods is not None
    SCORE_MOD = MODS and mods.score_mod is not None
    user = mod_functions(mods, int(sinks) + int(alibi))
    natural_modded, natural_scored = user.natural_modded, user.natural_scored
    BLOCK_MASK = MODS and mods.block_mask
    MASK_AT, MASK_END = user.block_mask_at, user.block_mask_at + 1
    PERSISTENT = persistent(producer, cache)
    ORDERED = ordered(producer, varlen, cache)
    BLOCK_M = WARPGROUP_ROWS * consumers
    CONSUMER_THREADS = 128 * consumers
    THREADS = CONSUMER_THREADS + (128 if PRODUCER else 0)
    LOAD_THREADS = 128 if PRODUCER else THREADS  # the threads that issue cp.async copies
    ARRIVALS = 1 if TMA else LOAD_THREADS  # arrivals that fill a slot: one expect_tx with TMA
    # ... a K slot of a paged cache: the copies and the absent-key flags (refill, load_page_boxes)
    # (by TMA every lane of the producer warp, after its keys' absent flags: mark_absent_boxes)
    K_ARRIVALS = ARRIVALS + (32 if TMA else ARRIVALS) if PAGED else ARRIVALS
    FIRST_CONSUMER = 1 if PRODUCER else 0  # the first consumer warpgroup
    # the producer warps that copy by TMA: a paged cache's K and V a warp each (produce_pages)
    PAGE_WARPS = page_warps
    MAPS_BARRIER = 4  # the named barrier of those two warps (1, 2: pingpong's; 3: the consumers')
    MAPS_THREADS = 32 * PAGE_WARPS
    # APPEND: the producer's other warps write the new rows (append_tile), and each work tile
    # its copying warps and they meet at APPEND_BARRIER (the whole producer warpgroup) before
    # the first key tile that holds one of those rows is copied
    APPEND, APPEND_BARRIER = append, 5
    APPEND_THREADS = 128 - MAPS_THREADS
    COPY_ROWS = APPEND_THREADS // (head_dim // 8)  # rows those threads copy at once
    # Registers a thread after setmaxnreg (REGISTER_SPLIT): what the producer gives up the
    # consumers take; one consumer has all it can use already.
    MOVE_REGISTERS = PRODUCER and consumers in REGISTER_SPLIT
    split = PAGED_REGISTER_SPLIT if PAGED or append else REGISTER_SPLIT
    PRODUCER_REGISTERS, CONSUMER_REGISTERS = split.get(consumers, (0, 0))
    Q_ATOM = BLOCK_M * ROW_BYTES  # bytes of one atom of the Q tile
    KV_ATOM = BLOCK_N * ROW_BYTES  # ... of a K or V tile
    layout = shared_memory_layout(head_dim, BLOCK_M, BLOCK_N, STAGES, PAGED)
    STAGE0, SLOT, V_OFF, BARRIERS, STAGED_MAPS, FLAGS, _ = layout
    STAMPS = STAGES * BLOCK_N // 4  # the per-slot int32 stamps after the per-key bytes
    ATOMS = HD_PAD // 64
    # a K or V tile's 64-column atoms and 8-row groups, bytes apart: atoms whole planes of
    # BLOCK_N rows, or (GROUPED) each 8-row group [atom][8 rows][64 columns]
    KV_ATOM_AT = GROUP_BYTES if GROUPED else KV_ATOM
    KV_GROUP_AT = ATOMS * GROUP_BYTES if GROUPED else GROUP_BYTES
    MAP_BYTES, MAP_WORDS, BOX_INNER = ptx_tma.MAP_BYTES, ptx_tma.MAP_WORDS, ptx_tma.BOX_INNER
    CHUNKS = HEAD_DIM // 8  # 16-byte chunks of a row in global memory
    PAD_CHUNKS = HD_PAD // 8  # ... in shared memory (the rest zero-filled)
    K_STEPS = (HEAD_DIM + 15) // 16  # k16 steps of S = Q K^T that hold data
    PV_STEPS = BLOCK_N // 16  # k16 steps of acc += P V
    S_REGS = BLOCK_N // 2  # a 64 x BLOCK_N fp32 tile over 128 threads
    PF_REGS = BLOCK_N // 4  # ... as P, two 16-bit values a register
    ACC_REGS = HD_PAD // 2
    N_TILES = BLOCK_N // 8  # 8-key column tiles of S
    D_TILES = HD_PAD // 8
    PENDING = STAGES - 2  # cp.async groups left in flight when the next tile must have landed
    ab = {"float16": "f16", "bfloat16": "bf16"}[dtype_name]
    pack = PACK[dtype_name]
    score_start = ptx_sm90.wgmma_update(ab, BLOCK_N, accumulate=False)
    score_step = ptx_sm90.wgmma_update(ab, BLOCK_N)
    value_step = ptx_sm90.wgmma_update(ab, HD_PAD, a_in_registers=True, b_transposed=True)

    # -- shared memory: swizzled atoms, cp.async loads -------------------------------------------

    load_rows = swizzled_row_loader(CHUNKS, LOAD_THREADS, PAD_CHUNKS)
    load_paged_rows = paged_row_loader(CHUNKS, LOAD_THREADS, PAD_CHUNKS)
    descriptor = swizzled_descriptor

    @device_function
    def kv_descriptor(address, leading):
        """The descriptor of a K or V tile at shared ``address`` (8-row groups KV_GROUP_AT
        bytes apart; V's atoms ``leading``)."""
        return ptx_sm90.matrix_descriptor(address, leading, KV_GROUP_AT, ptx_sm90.SWIZZLE_128B)

    @device_function
    def slot_address(base, slot):
        """The shared address of ring slot ``slot`` (its K; its V is V_OFF bytes further)."""
        return base + uint32(STAGE0) + uint32(slot) * uint32(SLOT)

    # -- a paged KV cache: where its keys are, and those behind a page outside the cache ------

    # ``pages`` (kernel arguments of a paged cache, dummies otherwise): (block_table, the
    # sequence's first entry in it, page_size, log2(page_size) or -1, K's and V's page strides,
    # pages in the cache, the sequence's keys, K's and V's kv-head offsets, the int32 index of
    # the flags in the dynamic shared memory, the first new key: FRESH below). A key behind a
    # page outside [0, slots) is absent: its row is zero-filled and (mark_absent,
    # load_page_boxes) its byte in the slot set, the slot stamped with the tile's number, so
    # that the consumers mask it; a slot's bytes count only for the tile its stamp names, and
    # need no reset between the uses of a slot.
    TABLE, TABLE_BASE, PAGE_SIZE, PAGE_SHIFT, K_PAGES, V_PAGES, SLOTS, SEQLEN_K = range(8)
    K_HEAD, V_HEAD, FLAG0 = 8, 9, 10
    # ... and (APPEND) the sequence's first new key: the kernel's own append writes keys
    # FRESH.. of the cache (cache_seqlens[b]), which the copies may read only after it
    FRESH = 11

    @device_function
    def load_keys(dst, src, first, stride, keys_left, pages, v_side, tid):
        """cp.async one tile of K (V with ``v_side``) rows: ``first`` row ``stride`` elements
        apart, or (paged) keys seqlen_k - keys_left .. through the block table."""
        if PAGED:
            geometry = (
                pages[TABLE],
                pages[TABLE_BASE],
                pages[PAGE_SIZE],
                pages[PAGE_SHIFT],
                pages[V_PAGES] if v_side else pages[K_PAGES],
                pages[SLOTS],
            )
            head = pages[V_HEAD] if v_side else pages[K_HEAD]
            n0 = pages[SEQLEN_K] - keys_left
            load_paged_rows(dst, src, head, stride, geometry, n0, keys_left, BLOCK_N, KV_ATOM,
                            tid)  # fmt: skip
        else:
            load_rows(dst, src, first, stride, keys_left, BLOCK_N, KV_ATOM, tid)

    @device_function
    def init_flags(flag0, tid):
        """Paged: no slot stamped (-1 is no tile's number); a block barrier follows."""
        if PAGED:
            stamps = cuda.shared.array(0, int32)
            for i in range(tid, STAGES, THREADS):
                stamps[flag0 + STAMPS + i] = int32(-1)

    @device_function
    def mark_absent(pages, slot, t, keys_left, tid):
        """Paged: the byte of every key of tile ``t`` (in ``slot``), set where the key is behind
        a page outside the cache, and the slot stamped with ``t`` where one is."""
        if PAGED:
            flags = cuda.shared.array(0, uint8)
            stamps = cuda.shared.array(0, int32)
            n0 = pages[SEQLEN_K] - keys_left
            for r in range(tid, min(BLOCK_N, keys_left), LOAD_THREADS):
                index, _ = page_of(n0 + r, pages[PAGE_SIZE], pages[PAGE_SHIFT])
                page = pages[TABLE][pages[TABLE_BASE] + int64(index)]
                absent = page < 0 or page >= pages[SLOTS]
                flags[pages[FLAG0] * 4 + slot * BLOCK_N + r] = uint8(1 if absent else 0)
                if absent:
                    stamps[pages[FLAG0] + STAMPS + slot] = int32(t)

    @device_function
    def absent_keys(pages, slot, t, lane):
        """Paged: bit i set where this lane's i-th key column of tile ``t`` (in ``slot``) is
        absent; 0 otherwise. Read before the slot is released (a refill rewrites its flags)."""
        bad = uint64(0)
        if PAGED:
            flags = cuda.shared.array(0, uint8)
            stamps = cuda.shared.array(0, int32)
            at = pages[FLAG0] * 4 + slot * BLOCK_N + (lane & 3) * 2
            if stamps[pages[FLAG0] + STAMPS + slot] == t:
                for i in range(S_REGS // 2):
                    _, col = accumulator_position(4 * (i >> 1) + (i & 1), 0)
                    if flags[at + col] != 0:
                        bad |= uint64(1) << uint64(i)
        return bad

    @device_function
    def load_tile(base, slot, t, k, v, k_first, v_first, k_ss, v_ss, keys_left, pages, tid):
        """cp.async key tile ``t``'s K and V rows into slot ``slot``; (k_first, v_first,
        keys_left) of the tile after it."""
        at = slot_address(base, slot)
        mark_absent(pages, slot, t, keys_left, tid)
        load_keys(at, k, k_first, k_ss, keys_left, pages, False, tid)
        load_keys(at + uint32(V_OFF), v, v_first, v_ss, keys_left, pages, True, tid)
        return (
            k_first + int64(BLOCK_N) * k_ss,
            v_first + int64(BLOCK_N) * v_ss,
            int32(keys_left - BLOCK_N),
        )

    @device_function
    def landed():
        """Wait for this thread's cp.async groups but PENDING, make them visible to wgmma (the
        async proxy), then for every thread's."""
        ptx.cp_async_wait(PENDING)
        ptx_sm90.fence_proxy_async()
        cuda.syncthreads()

    # -- the two products ------------------------------------------------------------------------

    @device_function
    def issue_scores(s, q_desc, k_desc):
        """S = Q K^T (64 rows x BLOCK_N keys) issued: k16 step kk is 32 bytes into atom kk // 4."""
        for kk in range(K_STEPS):
            q_step = (kk >> 2) * Q_ATOM + (kk & 3) * 32
            k_step = (kk >> 2) * KV_ATOM_AT + (kk & 3) * 32
            if kk == 0:
                score_start(s, q_desc, k_desc)
            else:
                score_step(s, q_desc + uint64(q_step >> 4), k_desc + uint64(k_step >> 4))

    @device_function
    def issue_values(acc, pf, v_desc):
        """acc += P V (P: ``pf``, the A fragment of each k16 step of keys; V read MN-major, k16
        step j two 8-row groups further)."""
        for j in range(PV_STEPS):
            a = (pf[4 * j], pf[4 * j + 1], pf[4 * j + 2], pf[4 * j + 3])
            value_step(acc, a, v_desc + uint64((j * 2 * KV_GROUP_AT) >> 4))

    # -- softmax on the accumulator layout -------------------------------------------------------

    @device_function
    def mask_scores(s, row0, n0, lane, seqlen_q, seqlen_k, wl, wr, bad):
        """-inf for the keys this lane's rows (row0 + lane // 4 and 8 below) do not see among
        the tile's scores (keys n0..), and (paged) for its ``bad`` key columns."""
        for h in range(2):
            lo, hi = visible_keys(row0 + 8 * h + (lane >> 2), seqlen_q, seqlen_k, wl, wr)
            first = n0 + (lane & 3) * 2  # this lane's first column: the offsets are constants
            lo = int32(lo - first)
            hi = int32(hi - first)
            for i in range(S_REGS // 2):
                index = 4 * (i >> 1) + 2 * h + (i & 1)
                _, col = accumulator_position(index, 0)
                seen = (lo <= int32(col)) & (int32(col) < hi)
                if PAGED:
                    seen = seen & (((bad >> uint64(i)) & uint64(1)) == uint64(0))
                s[index] = s[index] if seen else NEG_INF

    @device_function
    def bias_scores(s, row0, n0, m0, lane, seqlen_q, seqlen_k, wl, wr, slope):
        """ALiBi on the scores of the tile of keys n0.. of this lane's rows (row0 + lane // 4
        and 8 below; raw scores: ``slope`` in units of 1 / scale): the rows' offsets (t_0,
        t_1), s left holding each biased score less its row's offset, which softmax_rows
        adds to the row's max and to the exponent's shift. Linear in the key where
        softmax.linear_alibi_step says so (one fma with a constant, the lane's column
        offset, a score), else |distance|."""
        offset = seqlen_k - seqlen_q  # a row's position among the keys less its index
        # q_idx - kv_idx of this lane's first row and its first column of the tile
        distance = float32(row0 + (lane >> 2) + offset - n0 - (lane & 3) * 2)
        linear, step = linear_alibi_step(
            slope, n0, n0 + BLOCK_N - 1, m0 + offset, m0 + BLOCK_M - 1 + offset, wl, wr
        )
        if linear and not MODS:  # a user's score_mod is handed each whole biased score
            for i in range(S_REGS):
                _, col = accumulator_position(i, 0)
                s[i] = ptx.fma(step, float32(col), s[i])
            return -step * distance, -step * (distance + float32(8))
        for h in range(2):
            for i in range(S_REGS // 2):
                index = 4 * (i >> 1) + 2 * h + (i & 1)
                _, col = accumulator_position(index, 0)
                at = distance + float32(8 * h - col)
                s[index] = biased(s[index], at, slope)
        return float32(0.0), float32(0.0)

    def mod_tile_function(checked, masked):
        """mod_scores' loop (``checked``: only for the rows and keys that exist; ``masked``:
        with mask_mod, else score_mod alone), a column's two rows after each other, so that
        what the functions work out from the key alone is worked out once."""
        natural = natural_modded if masked else natural_scored

        @device_function
        def mod_tile(s, row0, n0, lane, seqlen_q, seqlen_k, scale_log2, ctx):
            b, head, variant, _ = ctx
            unit = scale_log2 * float32(LN2)  # softmax_scale
            row = row0 + (lane >> 2)
            first = n0 + (lane & 3) * 2
            for i in range(S_REGS // 2):
                column = 4 * (i >> 1) + (i & 1)  # row h's register: column + 2 h
                key = first + accumulator_position(column, 0)[1]
                for h in range(2):
                    at = row + 8 * h + seqlen_k - seqlen_q
                    if not checked or (row + 8 * h < seqlen_q and key < seqlen_k):
                        r = column + 2 * h
                        if SCORE_MOD:  # left in natural units (mod_scores)
                            s[r] = natural(s[r] * unit, b, head, at, key, variant)
                        else:  # a mask alone: the raw score or -inf
                            s[r] = natural(s[r], b, head, at, key, variant)

        return mod_tile

    mod_tile, checked_mod_tile = mod_tile_function(False, True), mod_tile_function(True, True)
    scored_tile, checked_scored_tile = (
        mod_tile_function(False, False),
        mod_tile_function(True, False),
    )

    @device_function
    def mod_scores(s, row0, n0, lane, seqlen_q, seqlen_k, scale_log2, ctx, full):
        """The user's score_mod and mask_mod (kernels/mods.py) on the tile of keys n0.. of
        this lane's rows (row0 + lane // 4 and 8 below; raw scores, scale_log2 their unit in
        the log2 domain), for the rows and keys that exist; ``ctx`` (b, head, the kernel's
        ``*variant`` arrays). A warp whose 16 rows and the tile's keys all exist calls them
        without a check per score. With a score_mod the scores are left in natural units
        (every tile's: its unit in the log2 domain is then LOG2E, absorb), the rows and keys
        that do not exist as they were (the mask hides those keys; those rows are not
        written). ``full``: the block mask shows every row every key of the tile, so
        mask_mod is not called (a constant False without a block mask)."""
        whole = row0 + 16 <= seqlen_q and n0 + BLOCK_N <= seqlen_k
        if BLOCK_MASK and full:
            if SCORE_MOD:
                if whole:
                    scored_tile(s, row0, n0, lane, seqlen_q, seqlen_k, scale_log2, ctx)
                else:
                    checked_scored_tile(s, row0, n0, lane, seqlen_q, seqlen_k, scale_log2, ctx)
        elif whole:
            mod_tile(s, row0, n0, lane, seqlen_q, seqlen_k, scale_log2, ctx)
        else:
            checked_mod_tile(s, row0, n0, lane, seqlen_q, seqlen_k, scale_log2, ctx)

    @device_function
    def probability(x, scale_log2, neg_shift, j):
        """exp2(x * scale_log2 + neg_shift) of a row's ``j``-th score a thread holds: on the
        FMA units for FMA_EXP2 of every 4 (j, a constant once the loops are unrolled), else by
        the special-function unit."""
        if j % 4 < FMA_EXP2:
            return ptx.exp2_fma(ptx.fma(x, scale_log2, neg_shift))
        return ptx.exp2(ptx.fma(x, scale_log2, neg_shift))

    def softmax_function(masked):
        """``softmax_rows`` for a tile the mask cuts through (``masked``: a row may have seen
        only hidden keys so far, its max still -inf) or for one it does not (every row sees a
        key of it, so its max is finite and shifts the scores as it is)."""

        @device_function
        def softmax_rows(s, m_i, l_i, alpha, scale_log2, offsets):
            """P = exp2(S * scale_log2 - m) left in s; m_i, l_i updated, alpha the factor that
            rescales acc (applied once acc has landed). The row max is taken on the raw scores
            (scale_log2 > 0 keeps their order), so each probability costs an fma and an ex2.
            With ALiBi, s holds each score less its row's ``offsets`` (bias_scores). BOUNDED:
            m is the bound every capped score keeps to, no max taken and nothing rescaled."""
            if BOUNDED:
                bounded_rows(s, m_i, l_i, alpha, scale_log2)
                return
            for h in range(2):
                m_raw = s[acc_index(0, h)]
                for nt in range(N_TILES):
                    i = acc_index(nt, h)
                    m_raw = max(m_raw, max(s[i], s[i + 1]))
                if ALIBI:
                    m_raw += offsets[h]
                m_raw = max(m_raw, ptx.shfl_xor(m_raw, 1))  # the 4 lanes of a row
                m_raw = max(m_raw, ptx.shfl_xor(m_raw, 2))
                m_new = max(m_i[h], m_raw * scale_log2)
                shift = shift_of(m_new) if masked else m_new
                alpha[h] = ptx.exp2(m_i[h] - shift)
                m_i[h] = m_new
                neg_shift = -shift
                if ALIBI:
                    neg_shift = ptx.fma(offsets[h], scale_log2, neg_shift)
                row_sum = row_probabilities(s, h, scale_log2, neg_shift)
                l_i[h] = l_i[h] * alpha[h] + row_sum  # this lane's part; the 4 summed at the end

        return softmax_rows

    @device_function
    def row_probabilities(s, h, scale_log2, neg_shift):
        """The probabilities of this lane's row half ``h`` left in s; their sum."""
        row_sum = float32(0.0)
        for nt in range(N_TILES):
            i = acc_index(nt, h)
            s[i] = probability(s[i], scale_log2, neg_shift, 2 * nt)
            s[i + 1] = probability(s[i + 1], scale_log2, neg_shift, 2 * nt + 1)
            row_sum += s[i] + s[i + 1]
        return row_sum

    @device_function
    def bounded_rows(s, m_i, l_i, alpha, scale_log2):
        """softmax_rows where the scores are tanh values (a folded softcap): every score is
        at most 1, its log2-domain value at most scale_log2 (softcap log2(e)), so the rows'
        max is that bound from the first tile on: no max to take or share among the lanes,
        alpha 1 and acc never rescaled (rescale_and_pack). A probability is then at least
        exp(-2 softcap), a normal float and bfloat16 while softcap <= BOUNDED_SOFTCAP."""
        for h in range(2):
            m_i[h] = scale_log2
            alpha[h] = float32(1.0)
            l_i[h] += row_probabilities(s, h, scale_log2, -scale_log2)

    softmax_rows, masked_softmax_rows = softmax_function(False), softmax_function(True)
    cap_scores = softcap_function(S_REGS, softcap if SOFTCAP else 1.0, folded=folded)
    start_rows = row_starter(2, ACC_REGS)

    @device_function
    def absorb(
        s, m_i, l_i, alpha, row0, n0, m0, lane, seqlen_q, seqlen_k, scale_log2, wl, wr, bad,
        slope, ctx,
    ):  # fmt: skip
        """Mask the tile of keys n0.. where it needs it (``bad``: absent_keys), then its
        softmax. Each case runs its own copy of the softmax, so that the wait for acc += P V
        that follows starts a basic block of its own: ptxas hoisted it to the top of the block
        that held the softmax, which then no longer overlapped the product."""
        if SOFTCAP:
            scale_log2 = cap_scores(s, scale_log2)
        offsets = (float32(0.0), float32(0.0))
        if ALIBI:
            offsets = bias_scores(s, row0, n0, m0, lane, seqlen_q, seqlen_k, wl, wr, slope)
        if MODS:
            full_lo, full_hi = ctx[3]  # every row of the block sees every key of the tile
            full = BLOCK_MASK and full_lo <= n0 and n0 + BLOCK_N <= full_hi
            mod_scores(s, row0, n0, lane, seqlen_q, seqlen_k, scale_log2, ctx, full)
        if SCORE_MOD:  # mod_scores left natural units: the softmax's multiply converts them
            scale_log2 = float32(LOG2E)
        needs = tile_needs_mask(m0, m0 + BLOCK_M - 1, n0, n0 + BLOCK_N, seqlen_q, seqlen_k, wl, wr)
        if PAGED:  # decided for the whole warp: a branch on one lane's ``bad`` bits made ptxas
            # wrap the softmax's shuffles for lanes that went apart (1.4x slower, performance.md)
            needs = needs or ptx.any_lane(bad != uint64(0))
        if needs:
            mask_scores(s, row0, n0, lane, seqlen_q, seqlen_k, wl, wr, bad)
            masked_softmax_rows(s, m_i, l_i, alpha, scale_log2, offsets)
        elif MODS:  # a row may have seen only keys the user's functions hid so far
            masked_softmax_rows(s, m_i, l_i, alpha, scale_log2, offsets)
        else:
            softmax_rows(s, m_i, l_i, alpha, scale_log2, offsets)

    @device_function
    def rescale_and_pack(acc, s, pf, alpha):
        """acc *= alpha (per row; not BOUNDED, where alpha is 1), and P rounded to 16 bits in
        the A layout of acc += P V."""
        if not BOUNDED:
            for dt in range(D_TILES):
                for h in range(2):
                    i = acc_index(dt, h)
                    acc[i] *= alpha[h]
                    acc[i + 1] *= alpha[h]
        for j in range(PV_STEPS):
            c = 8 * j  # score tiles 2j and 2j + 1: the A fragment of k16 step j
            pf[4 * j] = pack(s[c], s[c + 1])
            pf[4 * j + 1] = pack(s[c + 2], s[c + 3])
            pf[4 * j + 2] = pack(s[c + 4], s[c + 5])
            pf[4 * j + 3] = pack(s[c + 6], s[c + 7])

    # -- output ----------------------------------------------------------------------------------

    @device_function
    def write_output(o, lse, acc, m_i, l_i, o_base, o_ss, lse_base, row0, lane, seqlen_q, sink):
        """O = acc / l_i (0 where l_i = 0) and the row's LSE, for this lane's two rows (the
        ``sink`` joined to l_i with sinks)."""
        for h in range(2):
            l_row = l_i[h]
            l_row += ptx.shfl_xor(l_row, 1)
            l_row += ptx.shfl_xor(l_row, 2)
            m_row = m_i[h]
            row = row0 + (lane >> 2) + 8 * h
            if row < seqlen_q:
                m_row, l_row, factor = with_sink(m_row, l_row, sink)
                # 0 for a row that saw no key (O = 0); NaN for a NaN sum (softmax.inverse_sum)
                inv_l = ptx_sm90.reciprocal(l_row) if l_row != float32(0.0) else float32(0.0)
                inv_l *= factor
                at = o_base + int64(row) * o_ss
                for dt in range(D_TILES):
                    col = dt * 8 + (lane & 3) * 2
                    if col < HEAD_DIM:
                        i = acc_index(dt, h)
                        pair = pack(acc[i] * inv_l, acc[i + 1] * inv_l)
                        ptx.store_pair(o, (at + col) & NON_NEGATIVE, pair)
                if (lane & 3) == 0:
                    lse[(lse_base + row) & NON_NEGATIVE] = final_lse(m_row, l_row)

    @device_function
    def write_empty_block(o, lse, o_base, o_ss, lse_base, m0, seqlen_q, tid, sink):
        """Rows that see no key at all: O = 0, LSE = -inf (the sink with sinks; the consumer
        threads)."""
        m_empty, l_empty, _ = with_sink(NEG_INF, float32(0.0), sink)
        empty_lse = final_lse(m_empty, l_empty)
        t = tid - 128 * FIRST_CONSUMER
        for i in range(t, BLOCK_M * HEAD_DIM, CONSUMER_THREADS):
            r = i // HEAD_DIM
            if m0 + r < seqlen_q:
                o[(o_base + int64(m0 + r) * o_ss + (i - r * HEAD_DIM)) & NON_NEGATIVE] = uint16(0)
        for r in range(t, BLOCK_M, CONSUMER_THREADS):
            if m0 + r < seqlen_q:
                lse[(lse_base + m0 + r) & NON_NEGATIVE] = empty_lse

    # -- the pipeline's synchronisation ------------------------------------------------------

    # mbarriers, by index: a slot's K or V has landed (FULL_K + slot, FULL_V + slot); every
    # consumer is done with a slot's K or V (EMPTY_K + slot, EMPTY_V + slot); Q has landed;
    # every consumer is done with Q (its last S has landed: the next tile's Q may come in).
    # K and V are handed over apart: a K slot is free again once S = Q K^T has landed, half an
    # iteration before its V, so the producer runs further ahead in the same shared memory.
    FULL_K, FULL_V, EMPTY_K, EMPTY_V, Q_FULL = 0, STAGES, 2 * STAGES, 3 * STAGES, 4 * STAGES
    Q_EMPTY = Q_FULL + 1

    @device_function
    def barrier_address(base, index):
        """The shared address of mbarrier ``index``."""
        return base + uint32(BARRIERS + 8 * index)

    @device_function
    def init_barriers(base, tid):
        """The producer's 128 threads (with TMA: its one thread that copies) arrive at the full
        barriers and Q's; every consumer thread at the empty ones."""
        if tid == 0:
            if PAGED:  # a K slot's flags arrive apart from its copies (refill)
                for i in range(STAGES):
                    ptx_sm90.mbarrier_init(barrier_address(base, FULL_K + i), uint32(K_ARRIVALS))
                    ptx_sm90.mbarrier_init(barrier_address(base, FULL_V + i), uint32(ARRIVALS))
                for i in range(2 * STAGES):
                    ptx_sm90.mbarrier_init(
                        barrier_address(base, EMPTY_K + i), uint32(CONSUMER_THREADS)
                    )
            else:
                for i in range(2 * STAGES):
                    ptx_sm90.mbarrier_init(barrier_address(base, FULL_K + i), uint32(ARRIVALS))
                    ptx_sm90.mbarrier_init(
                        barrier_address(base, EMPTY_K + i), uint32(CONSUMER_THREADS)
                    )
            ptx_sm90.mbarrier_init(barrier_address(base, Q_FULL), uint32(ARRIVALS))
            ptx_sm90.mbarrier_init(barrier_address(base, Q_EMPTY), uint32(CONSUMER_THREADS))
        cuda.syncthreads()

    @device_function
    def refill(base, empty, full, t, slot, src, first, stride, keys_left, offset, pages, v_side,
               ptid):  # fmt: skip
        """The block's t-th tile of K or V (``v_side``; ``offset`` into the slot; t counts every
        tile through the ring since the block began) into ``slot`` once its last tile there is
        released; its copies arrive at ``full`` by themselves when they land
        (cp.async.mbarrier.arrive): the producer never waits for its own loads. Paged, K's
        absent-key flags arrive first (an arrival releases the thread's writes)."""
        if t >= STAGES:  # the consumers' release of this slot's last tile (t - STAGES)
            phase = uint32(((t // STAGES) - 1) & 1)
            ptx_sm90.mbarrier_wait(barrier_address(base, empty + slot), phase)
        if PAGED and not v_side:
            mark_absent(pages, slot, t, keys_left, ptid)
            ptx_sm90.mbarrier_arrive(barrier_address(base, full + slot))
        load_keys(slot_address(base, slot) + uint32(offset), src, first, stride, keys_left,
                  pages, v_side, ptid)  # fmt: skip
        ptx_sm90.cp_async_arrive(barrier_address(base, full + slot))

    @device_function
    def ring_slot(g):
        """The ring slot of the block's g-th key tile."""
        return int32(g - (g // STAGES) * STAGES)

    @device_function
    def wait_for_q_room(base, job):
        """Before the block's ``job``-th Q tile is loaded: the consumers are done with the
        last one (every S of it has landed)."""
        if job > 0:
            ptx_sm90.mbarrier_wait(barrier_address(base, Q_EMPTY), uint32((job - 1) & 1))

    @device_function
    def produce(q, k, v, base, q_first, q_ss, q_rows, k_first, v_first, k_ss, v_ss, keys_left,
                n_tiles, pages, ptid, g0, job):  # fmt: skip
        """The producer warpgroup: the block's ``job``-th Q tile, then its ``n_tiles`` key
        tiles' K and V into the ring, after the ``g0`` tiles of the block's earlier work."""
        wait_for_q_room(base, job)
        load_rows(base, q, q_first, q_ss, q_rows, BLOCK_M, Q_ATOM, ptid)
        ptx_sm90.cp_async_arrive(barrier_address(base, Q_FULL))
        slot = ring_slot(g0)
        for t in range(n_tiles):
            refill(base, EMPTY_K, FULL_K, g0 + t, slot, k, k_first, k_ss, keys_left, 0, pages,
                   False, ptid)  # fmt: skip
            refill(base, EMPTY_V, FULL_V, g0 + t, slot, v, v_first, v_ss, keys_left, V_OFF,
                   pages, True, ptid)  # fmt: skip
            k_first += int64(BLOCK_N) * k_ss
            v_first += int64(BLOCK_N) * v_ss
            keys_left = int32(keys_left - BLOCK_N)
            slot = int32(slot + 1) if slot + 1 < STAGES else int32(0)

    @device_function
    def load_boxes(tensor_map, dst, atom_bytes, barrier, row, head, b):
        """Every 64-column atom of the box of rows ``row``.. of (head, b) into the tile at
        ``dst``, its bytes completing on ``barrier``."""
        for a in range(ATOMS):
            ptx_tma.load_box(tensor_map, dst + uint32(a * atom_bytes), barrier,
                             int32(a * BOX_INNER), row, head, b)  # fmt: skip

    @device_function
    def table_entry(pages, n0, lane):
        """Paged TMA, warp-wide: the block-table entry of this lane's box of the tile of keys
        n0.. (boxes of min(page_size, BLOCK_N) rows, the lane's number its box's), or
        ``pages[SLOTS]`` where the box starts past the sequence's end (never looked up). Every
        box's entry is read at once, one a lane, once for K and V; box_page checks it."""
        box_rows = min(pages[PAGE_SIZE], BLOCK_N)
        r0 = lane * box_rows
        found = pages[SLOTS]
        if r0 < BLOCK_N and r0 < pages[SEQLEN_K] - n0:
            index, _ = page_of(n0 + r0, pages[PAGE_SIZE], pages[PAGE_SHIFT])
            found = pages[TABLE][pages[TABLE_BASE] + int64(index)]
        return found

    @device_function
    def box_page(pages, found):
        """The page a box copies from, given its table entry (table_entry): the entry, or
        ``pages[SLOTS]`` where it is outside the cache, which the map reads out of bounds
        (zeros) as it does a box past the sequence's end."""
        return found if found >= 0 and found < pages[SLOTS] else pages[SLOTS]

    @device_function
    def mark_absent_boxes(pages, slot, t, keys, box_rows, page, lane):
        """Paged TMA, warp-wide, K's side of tile ``t`` (``keys``: the sequence's keys from the
        tile's first on; ``page``: this lane's box's, box_page): where a box within the
        sequence lies behind a page outside the cache, every key's byte of the slot is written
        (set behind such a page) and the slot stamped with ``t``, a lane a key; a tile with no
        such box leaves the slot as it is (its stamp names another tile). Each lane then
        arrives at the slot's full barrier (load_page_boxes), releasing its own writes: a
        sync_warp before lane 0's arrival alone orders them too, but compute-sanitizer's
        racecheck does not follow that chain (it reported the consumers' reads of the flags as
        hazards)."""
        r0 = lane * box_rows
        absent = r0 < BLOCK_N and r0 < keys and page == pages[SLOTS]
        if ptx.any_lane(absent):  # one answer for the warp: the shuffles below take every lane
            flags = cuda.shared.array(0, uint8)
            stamps = cuda.shared.array(0, int32)
            at = pages[FLAG0] * 4 + slot * BLOCK_N
            for j in range((BLOCK_N + 31) // 32):
                r = j * 32 + lane
                box_page = ptx.shfl_index(page, ptx_sm90.quotient32(min(r, BLOCK_N - 1), box_rows))
                if r < BLOCK_N:
                    flags[at + r] = uint8(1 if r < keys and box_page == pages[SLOTS] else 0)
            if lane == 0:
                stamps[pages[FLAG0] + STAMPS + slot] = int32(t)

    @device_function
    def load_page_boxes(tensor_map, dst, barrier, n0, kv_head, pages, slot, t, v_side, page,
                        lane):  # fmt: skip
        """Paged TMA, warp-wide: the tile of keys n0.. as boxes of min(page_size, BLOCK_N) rows,
        each within one page (the map is over the pages: kernels.forward_sm90.paged_tma), lane
        i copying box i from the page it found (table_entry, box_page): with one thread issuing
        every box's copies the call was 1.3-1.4x slower at 16-key pages (docs/performance.md). K's
        side flags the keys behind a page outside the cache (mark_absent_boxes), then every
        lane arrives (releasing the flags it wrote)."""
        box_rows = min(pages[PAGE_SIZE], BLOCK_N)
        keys = pages[SEQLEN_K] - n0  # the sequence's keys from n0 on
        boxes = ptx_sm90.quotient32(BLOCK_N, box_rows)
        if not v_side:
            mark_absent_boxes(pages, slot, t, keys, box_rows, page, lane)
        if lane < boxes:
            r0 = lane * box_rows
            within = uint32(0)
            if r0 < keys:
                _, within = page_of(n0 + r0, pages[PAGE_SIZE], pages[PAGE_SHIFT])
            if GROUPED:  # every atom in one copy; 8-row groups numbered across the pages
                group = page * (pages[PAGE_SIZE] >> 3) + int32(within >> 3)
                ptx_tma.load_box5(tensor_map, dst + uint32((r0 >> 3) * KV_GROUP_AT), barrier,
                                  int32(0), int32(0), int32(0), kv_head, int32(group))  # fmt: skip
            else:
                load_boxes(tensor_map, dst + uint32(r0 * ROW_BYTES), KV_ATOM, barrier,
                           int32(within), kv_head, int32(page))  # fmt: skip
        if not v_side:
            ptx_sm90.mbarrier_arrive(barrier)

    @device_function
    def refill_box(base, empty, full, t, slot, tensor_map, offset, n0, kv_head, b, pages,
                   v_side, page, lane):  # fmt: skip
        """TMA: the block's t-th tile of K or V (``v_side``; ``offset`` into the slot) into
        ``slot`` once its last tile there is released; lane 0 alone, or (paged) the producer warp with the pages
        of its boxes (table_entry, box_page)."""
        if t >= STAGES:  # the consumers' release of this slot's last tile (t - STAGES)
            phase = uint32(((t // STAGES) - 1) & 1)
            ptx_sm90.mbarrier_wait(barrier_address(base, empty + slot), phase)
        barrier = barrier_address(base, full + slot)
        if lane == 0:
            ptx_sm90.mbarrier_expect_tx(barrier, uint32(ATOMS * KV_ATOM))
        dst = slot_address(base, slot) + uint32(offset)
        if PAGED:
            load_page_boxes(tensor_map, dst, barrier, n0, kv_head, pages, slot, t, v_side, page,
                            lane)  # fmt: skip
        else:
            load_boxes(tensor_map, dst, KV_ATOM, barrier, n0, kv_head, b)

    @device_function
    def publish_maps(q, k, v, maps, templates, base, lane):
        """The TMA producer warp, once a block: publishes the Q, K and V maps (each lane then
        acquires them: in a paged cache's tiles every lane issues copies)."""
        q_words, k_words, v_words = templates
        staged = base + uint32(STAGED_MAPS)
        ptx_tma.publish_map(maps, 0, staged, q_words, ptx_tma.global_address(q, int64(0)), lane)
        ptx_tma.publish_map(maps, 1, staged + uint32(MAP_BYTES), k_words,
                            ptx_tma.global_address(k, int64(0)), lane)  # fmt: skip
        ptx_tma.publish_map(maps, 2, staged + uint32(2 * MAP_BYTES), v_words,
                            ptx_tma.global_address(v, int64(0)), lane)  # fmt: skip
        acquire_maps(maps)

    @device_function
    def acquire_maps(maps):
        """This thread's acquire of the launch's published maps, before its TMA copies."""
        for index in range(MAPS):
            ptx_tma.acquire(ptx_tma.global_address(maps, int64(index * MAP_WORDS)))

    @device_function
    def produce_boxes(maps, base, m0, coords, first_tile, n_tiles, pages, lane, warp, g0, job):
        """The producer warp with TMA (the maps published): one thread copies the block's
        ``job``-th Q tile and its ``n_tiles`` key tiles' K and V into the ring, after the
        ``g0`` tiles of its earlier work. A paged cache's tiles: the whole warp, a box a lane,
        or with PAGE_WARPS 2 a warp for K's and one for V's (produce_pages)."""
        head, kv_head, b, kv_b, q_row0, k_row0 = coords
        k_map = ptx_tma.global_address(maps, int64(MAP_WORDS))
        v_map = ptx_tma.global_address(maps, int64(2 * MAP_WORDS))
        slot = ring_slot(g0)
        fresh = fresh_tile(pages, first_tile, n_tiles)
        kv = (k_map, v_map, k_row0, first_tile, kv_head, kv_b)
        if lane == 0 and (PAGE_WARPS == 1 or warp == 0):  # (Q: the first warp's lane 0)
            wait_for_q_room(base, job)
            q_full = barrier_address(base, Q_FULL)
            ptx_sm90.mbarrier_expect_tx(q_full, uint32(ATOMS * Q_ATOM))
            load_boxes(ptx_tma.global_address(maps, int64(0)), base, Q_ATOM, q_full,
                       int32(q_row0 + m0), head, b)  # fmt: skip
            if not PAGED:  # (APPEND: the tiles before the new rows)
                slot = copy_tiles(base, int32(0), fresh, slot, g0, kv, pages)
        if APPEND and not PAGED:  # the rest once the new rows are in the cache
            appended()
            if lane == 0:
                copy_tiles(base, fresh, n_tiles, slot, g0, kv, pages)
        if PAGED and PAGE_WARPS == 1:  # the warp looks the tiles' pages up, copies their boxes
            found = table_entry(pages, int32(k_row0 + first_tile * BLOCK_N), lane)
            for t in range(n_tiles):
                if APPEND and t == fresh:
                    appended()
                n0 = int32(k_row0 + (first_tile + t) * BLOCK_N)
                page = box_page(pages, found)
                refill_box(base, EMPTY_K, FULL_K, g0 + t, slot, k_map, 0, n0, kv_head, kv_b,
                           pages, False, page, lane)  # fmt: skip
                # the next tile's entries, read while the producer waits for V's slot: read
                # after it, their latency delayed the next K (the consumers' longest wait)
                found = table_entry(pages, int32(n0 + BLOCK_N), lane)
                refill_box(base, EMPTY_V, FULL_V, g0 + t, slot, v_map, V_OFF, n0, kv_head,
                           kv_b, pages, True, page, lane)  # fmt: skip
                slot = int32(slot + 1) if slot + 1 < STAGES else int32(0)
            if APPEND and fresh == n_tiles:
                appended()
        elif PAGED:
            first = int32(k_row0 + first_tile * BLOCK_N)
            if warp == 0:
                produce_pages(base, EMPTY_K, FULL_K, k_map, 0, first, n_tiles, kv_head, kv_b,
                              pages, False, slot, g0, lane, fresh)  # fmt: skip
            else:
                produce_pages(base, EMPTY_V, FULL_V, v_map, V_OFF, first, n_tiles, kv_head,
                              kv_b, pages, True, slot, g0, lane, fresh)  # fmt: skip

    @device_function
    def copy_tiles(base, t0, t1, slot, g0, kv, pages):
        """Lane 0 of the TMA producer (not paged): K and V of the work tile's key tiles t0 ..
        t1 - 1 (``kv``: the K and V maps, the sequence's first row in them, the work tile's
        first key tile, the kv head and the batch coordinate) into the ring from ``slot`` on,
        after the ``g0`` tiles of the block's earlier work; the slot after them."""
        k_map, v_map, k_row0, first_tile, kv_head, kv_b = kv
        for t in range(t0, t1):
            n0 = int32(k_row0 + (first_tile + t) * BLOCK_N)
            refill_box(base, EMPTY_K, FULL_K, g0 + t, slot, k_map, 0, n0, kv_head, kv_b, pages,
                       False, int32(0), int32(0))  # fmt: skip
            refill_box(base, EMPTY_V, FULL_V, g0 + t, slot, v_map, V_OFF, n0, kv_head, kv_b,
                       pages, True, int32(0), int32(0))  # fmt: skip
            slot = int32(slot + 1) if slot + 1 < STAGES else int32(0)
        return slot

    @device_function
    def fresh_tile(pages, first_tile, n_tiles):
        """APPEND: the first of the work tile's ``n_tiles`` key tiles (from ``first_tile`` on)
        that holds a key the kernel appends (pages[FRESH] on), n_tiles where none does; else
        n_tiles."""
        if not APPEND:
            return n_tiles
        ahead = pages[FRESH] - first_tile * BLOCK_N
        if ahead <= 0:
            return int32(0)
        return int32(min(ahead // BLOCK_N, n_tiles))

    @device_function
    def appended():
        """APPEND, each producer warp once a work tile: the warps that copy wait here until
        the work tile's new rows are in the cache, which append_tile's warps have written when
        they arrive. The warp converges first (bar.sync is warp-aligned)."""
        ptx.sync_warp()
        ptx_sm90.named_barrier_sync(APPEND_BARRIER, 128)

    @device_function
    def produce_pages(base, empty, full, tensor_map, offset, first, n_tiles, kv_head, kv_b, pages,
                      v_side, slot, g0, lane, fresh):  # fmt: skip
        """Paged TMA, warp-wide: the K or V (``v_side``) boxes of the block's ``n_tiles`` key
        tiles from key ``first`` on, with PAGE_WARPS 2: K and V a warp each, so that the next K
        waits neither for V's slot nor for V's boxes, as it does behind one warp issuing both in
        turn (a box a pass of an ELECT loop; docs/performance.md). Each tile's table entries are
        read a tile ahead, before the wait for the slot, which covers their latency. ``fresh``
        (APPEND): the first tile to wait for the new rows."""
        found = table_entry(pages, first, lane)
        for t in range(n_tiles):
            if APPEND and t == fresh:
                appended()
            n0 = int32(first + t * BLOCK_N)
            page = box_page(pages, found)
            found = table_entry(pages, int32(n0 + BLOCK_N), lane)
            refill_box(base, empty, full, g0 + t, slot, tensor_map, offset, n0, kv_head, kv_b,
                       pages, v_side, page, lane)  # fmt: skip
            slot = int32(slot + 1) if slot + 1 < STAGES else int32(0)
        if APPEND and fresh == n_tiles:
            appended()

    @device_function
    def landed_half(base, full, it, slot):
        """With the producer: wait for tile ``it``'s K or V (``full``) in ``slot``. Without,
        both have landed since the end of the previous step."""
        if PRODUCER:
            phase = uint32((it // STAGES) & 1)
            ptx_sm90.mbarrier_wait(barrier_address(base, full + slot), phase)

    @device_function
    def release_half(base, empty, slot):
        """With the producer: this thread is done with ``slot``'s K or V (``empty``)."""
        if PRODUCER:
            ptx_sm90.mbarrier_arrive(barrier_address(base, empty + slot))

    @device_function
    def take_turn(group):
        """Pingpong: wait until the other consumer warpgroup has issued its products."""
        if PINGPONG:
            if group == 0:
                ptx_sm90.named_barrier_sync(1, 256)
            else:
                ptx_sm90.named_barrier_sync(2, 256)

    @device_function
    def pass_turn(group, last):
        """Pingpong: let the other consumer warpgroup issue; the second warpgroup's last turn
        passes nothing (the first has issued its last), so every arrival is waited for."""
        if PINGPONG:
            if group == 0:
                ptx_sm90.named_barrier_arrive(2, 256)
            elif not last:
                ptx_sm90.named_barrier_arrive(1, 256)

    @device_function
    def zero_rows_past_end(base, slot, keys_left, tid):
        """The last tile by TMA of a KV cache or a packed batch: its V rows at or past
        ``keys_left`` hold whatever the cache holds there, or the next sequence's rows (a NaN
        times a probability of 0 is NaN), so the consumers zero them before acc += P V reads
        them (K's are masked out of S)."""
        if keys_left < BLOCK_N:
            words = cuda.shared.array(0, uint32)
            first = (ptx_sm90.aligned_index(cuda.shared.array(0, uint16), GROUP_BYTES) >> 1) + (
                STAGE0 + slot * SLOT + V_OFF
            ) // 4
            row_words = ROW_BYTES // 4  # an atom's rows are ROW_BYTES apart (the swizzle
            # permutes chunks within a row)
            per_atom = (BLOCK_N - keys_left) * row_words
            t = tid - (128 if PRODUCER else 0)
            if GROUPED:  # row r's atom a: (r // 8) KV_GROUP_AT + a GROUP_BYTES + (r % 8) ROW_BYTES
                per_row = ATOMS * row_words
                for i in range(t, ATOMS * per_atom, CONSUMER_THREADS):
                    r = keys_left + i // per_row
                    a = (i % per_row) // row_words
                    at = (r >> 3) * (KV_GROUP_AT // 4) + a * (GROUP_BYTES // 4)
                    words[first + at + (r & 7) * row_words + i % row_words] = uint32(0)
            else:
                for i in range(t, ATOMS * per_atom, CONSUMER_THREADS):
                    a = i // per_atom
                    words[
                        first + a * (KV_ATOM // 4) + keys_left * row_words + (i - a * per_atom)
                    ] = uint32(0)
            ptx_sm90.fence_proxy_async()  # the zeros, for wgmma's reads (the async proxy)
            ptx_sm90.named_barrier_sync(3, CONSUMER_THREADS)

    # -- one block of query rows ---------------------------------------------------------------

    @device_function
    def start_block(flag0, tid):
        """Once a block, before its tiles: a paged cache's slot stamps and the mbarriers."""
        init_flags(flag0, tid)
        if PRODUCER:
            init_barriers(block_base(), tid)  # a block barrier: the stamps too
        elif PAGED:
            cuda.syncthreads()

    @device_function
    def start_producer(q, k, v, maps, templates, lane, warp):
        """The producer warpgroup, once: its registers handed to the consumers, the TMA
        producer's tensor maps published. Whether this warp loads the tiles (of the TMA
        producer, the first alone)."""
        if MOVE_REGISTERS:
            ptx_sm90.set_max_registers(PRODUCER_REGISTERS, False)
        if TMA and PAGE_WARPS == 1:
            if warp != 0:
                return False
            publish_maps(q, k, v, maps, templates, block_base(), lane)
        elif TMA:  # V's warp acquires the maps once the first has published them
            if warp >= PAGE_WARPS:
                return False
            if warp == 0:
                publish_maps(q, k, v, maps, templates, block_base(), lane)
            ptx_sm90.named_barrier_sync(MAPS_BARRIER, MAPS_THREADS)
            if warp != 0:
                acquire_maps(maps)
        return True

    @device_function
    def start_consumer():
        """A consumer warpgroup with a producer, once: the registers the producer gave up."""
        if MOVE_REGISTERS:
            ptx_sm90.set_max_registers(CONSUMER_REGISTERS, True)

    @device_function
    def block_base():
        """The shared address of the block's 1024-byte aligned base (its Q tile)."""
        smem = cuda.shared.array(0, uint16)
        return ptx.shared_address(smem, ptx_sm90.aligned_index(smem, GROUP_BYTES))

    @device_function
    def tile_of(rank, work):
        """(block of query rows, head, batch) of the launch's rank-th work tile, ``work`` =
        (row blocks, heads, batch x heads, pairs a section): sections of (batch, head) pairs
        one after another (their keys and values fit the L2 cache together), each going
        through its row blocks last first (under a causal mask they see the most keys), its
        pairs next to each other."""
        m_blocks, nheads, pairs, section = work
        sec = ptx_sm90.quotient32(rank, section * m_blocks)
        first = sec * section
        width = min(section, pairs - first)
        within = rank - sec * section * m_blocks
        step = ptx_sm90.quotient32(within, width)
        pair = first + within - step * width
        b = ptx_sm90.quotient32(pair, nheads)
        return int32(m_blocks - 1 - step), int32(pair - b * nheads), int32(b)

    @device_function
    def first_round(order, tiles):
        """(start, reverse, end, listed) of this block's first round of work tiles: with a
        work order (ORDERED, and its first entry not -1: families.wgmma_forward.work_order, a
        packed batch's kernels/work_order.py)
        its place there, where its tiles end and True, else the launch's first round, its
        ``tiles`` and False."""
        if ORDERED:
            if order[0] >= 0:
                return order[cuda.blockIdx.x], False, order[cuda.blockIdx.x + 1], True
        return int32(0), False, tiles, False

    @device_function
    def ranked(order, start, reverse, listed, end):
        """The rank of this block's work tile in the round ``start``: the order's entry where
        ``listed`` (``end``: where the block's entries end; past it, end, which no loop
        reaches), else tile start +
        blockIdx.x of the round of tiles start.. (a tile a block), the rounds alternating in
        direction so that each block's sum of the (falling) costs of its tiles comes out
        alike."""
        if ORDERED and listed:
            if start < end:
                return order[cuda.gridDim.x + 1 + start]
            return end
        if reverse:
            return int32(start + cuda.gridDim.x - 1 - cuda.blockIdx.x)
        return int32(start + cuda.blockIdx.x)

    @device_function
    def following(start, reverse, tiles, listed):
        """The next round's (start, reverse): the order's next entry where ``listed``,
        gridDim.x tiles on when the launch is persistent, else none (``tiles``; the loops over
        the rounds then fold away)."""
        if ORDERED and listed:
            return int32(start + 1), reverse
        if PERSISTENT:
            return int32(start + cuda.gridDim.x), not reverse
        return tiles, reverse

    @device_function
    def attend_block(
        q, k, v, o, lse, bases, row_strides, m_block, seqlen_q, seqlen_k, scale_log2, window,
        tid, lane, warp, maps, coords, pages, g0, job, producing, sink, slope, ctx,
    ):  # fmt: skip
        """This thread's part (``producing``: the producer's; a constant where inlined, so each
        role's loop holds its code alone) in rows m_block * BLOCK_M .. + BLOCK_M - 1 of one (sequence, head): ``bases`` (q, k, v,
        o, lse) is where the sequence's row 0 of this head (its kv head for k, v) starts in
        each array, rows ``row_strides`` (q, k, v, o) elements apart; ``window`` (left, right).
        With TMA: ``maps`` the launch's tensor maps (published), ``coords`` (head, kv_head,
        batch of q, batch of k and v, the sequence's first row in q and in k and v: a packed
        batch's tensor maps are over all its rows) the block's. ``pages``: a paged cache's
        geometry (see load_keys). ``g0`` key tiles and ``job`` Q tiles went through the block's
        shared memory before (its earlier work tiles). The key tiles it took (0: its rows see
        no key). ``sink``: the head's sink logit, read only with sinks; ``slope``: its ALiBi
        slope in units of 1 / scale, read only with ALiBi; ``ctx``: (b, head, the kernel's
        ``*variant`` arrays, the keys of a block mask's FULL run: set here), read only with a
        user's functions (mod_scores)."""
        q_base, k_base, v_base, o_base, lse_base = bases
        q_ss, k_ss, v_ss, o_ss = row_strides
        wl, wr = window

        m0 = m_block * BLOCK_M
        last_row = min(m0 + BLOCK_M, seqlen_q) - 1
        n_lo, n_hi = block_key_range(m0, last_row, seqlen_q, seqlen_k, wl, wr)
        if BLOCK_MASK:  # and the keys the block mask shows some row of the block
            b, head, variant, _ = ctx
            index = variant[MASK_AT:MASK_END][0]
            lo, hi, full_lo, full_hi = key_ranges(index, b, head, m0, last_row)
            n_lo, n_hi = max(n_lo, lo), min(n_hi, hi)
            ctx = (b, head, variant, (full_lo, full_hi))
        if n_hi <= n_lo:
            if not producing:
                write_empty_block(o, lse, o_base, o_ss, lse_base, m0, seqlen_q, tid, sink)
            return int32(0)
        first_tile = int32(n_lo // BLOCK_N)
        n_tiles = int32((n_hi - first_tile * BLOCK_N + BLOCK_N - 1) // BLOCK_N)
        base = block_base()
        q_first = q_base + int64(m0) * q_ss
        k_first = k_base + int64(first_tile * BLOCK_N) * k_ss
        v_first = v_base + int64(first_tile * BLOCK_N) * v_ss
        keys_left = int32(seqlen_k - first_tile * BLOCK_N)  # valid rows of the next tile to load

        if producing:  # the producer warpgroup (with TMA, its first warp, or PAGE_WARPS)
            if TMA:
                produce_boxes(maps, base, m0, coords, first_tile, n_tiles, pages, lane, warp, g0,
                              job)  # fmt: skip
            else:
                produce(q, k, v, base, q_first, q_ss, seqlen_q - m0, k_first, v_first, k_ss,
                        v_ss, keys_left, n_tiles, pages, tid, g0, job)  # fmt: skip
            return n_tiles
        if not PRODUCER:
            # -- prologue: Q, then the first STAGES key/value tiles, each a cp.async group
            load_rows(base, q, q_first, q_ss, seqlen_q - m0, BLOCK_M, Q_ATOM, tid)
            ptx.cp_async_commit()
            for st in range(STAGES):
                if st < n_tiles:
                    k_first, v_first, keys_left = load_tile(
                        base, st, g0 + st, k, v, k_first, v_first, k_ss, v_ss, keys_left, pages,
                        tid,
                    )  # fmt: skip
                ptx.cp_async_commit()
        consume(k, v, o, lse, base, k_first, v_first, k_ss, v_ss, keys_left, o_base, o_ss,
                lse_base, m0, first_tile, n_tiles, seqlen_q, seqlen_k, scale_log2, wl, wr, tid,
                lane, warp, pages, g0, job, sink, slope, ctx)  # fmt: skip
        return n_tiles

    @device_function
    def finish_producer():
        """After the block's last tile: no copy of this thread in flight when it exits."""
        if not TMA:
            ptx.cp_async_commit()
            ptx.cp_async_wait(0)

    @device_function
    def consume(k, v, o, lse, base, k_first, v_first, k_ss, v_ss, keys_left, o_base, o_ss,
                lse_base, m0, first_tile, n_tiles, seqlen_q, seqlen_k, scale_log2, wl, wr, tid,
                lane, warp, pages, g0, job, sink, slope, ctx):  # fmt: skip
        """A consumer warpgroup's 64 rows over the work tile's key tiles, the block's ``job``-th
        Q tile and its g0-th key tile on; without a producer its threads also refill the ring
        (k_first, v_first, keys_left: the next tile to load; the ring starts at slot 0)."""
        s = cuda.local.array(S_REGS, float32)
        pf = cuda.local.array(PF_REGS, uint32)
        acc = cuda.local.array(ACC_REGS, float32)
        m_i = cuda.local.array(2, float32)
        l_i = cuda.local.array(2, float32)
        alpha = cuda.local.array(2, float32)
        group = (warp >> 2) - FIRST_CONSUMER  # this warp's consumer warpgroup: its 64 rows of Q
        row0 = m0 + group * WARPGROUP_ROWS + (warp & 3) * 16  # this warp's first row
        q_desc = descriptor(base + uint32(group * WARPGROUP_ROWS * ROW_BYTES), 16)
        start_rows(m_i, l_i, acc)
        if PINGPONG and group == 1:  # the first warpgroup issues first
            ptx_sm90.named_barrier_arrive(1, 256)

        # -- S_0 = Q K_0^T and its softmax
        slot = ring_slot(g0) if PRODUCER else int32(0)  # the slot of the tile whose P is in pf
        if PRODUCER:
            ptx_sm90.mbarrier_wait(barrier_address(base, Q_FULL), uint32(job & 1))
            landed_half(base, FULL_K, g0, slot)
        else:
            landed()  # Q and tiles 0 and 1
        take_turn(group)
        ptx_sm90.wgmma_fence()
        issue_scores(s, q_desc, kv_descriptor(slot_address(base, slot), 16))
        ptx_sm90.wgmma_commit()
        pass_turn(group, False)
        ptx_sm90.wgmma_wait(0)
        ptx_sm90.fence_operands(s, S_REGS)
        bad = absent_keys(pages, slot, g0, lane)
        release_half(base, EMPTY_K, slot)
        n0 = int32(first_tile * BLOCK_N)
        absorb(s, m_i, l_i, alpha, row0, n0, m0, lane, seqlen_q, seqlen_k, scale_log2, wl, wr,
               bad, slope, ctx)  # fmt: skip
        rescale_and_pack(acc, s, pf, alpha)

        for it in range(1, n_tiles):
            nxt = int32(slot + 1) if slot + 1 < STAGES else int32(0)
            slot_addr = slot_address(base, slot)
            next_addr = slot_address(base, nxt)
            landed_half(base, FULL_K, g0 + it, nxt)
            landed_half(base, FULL_V, g0 + it - 1, slot)
            # -- S_it = Q K_it^T and acc += P_{it-1} V_{it-1}, issued together
            take_turn(group)
            ptx_sm90.fence_operands(s, S_REGS)
            ptx_sm90.fence_operands(acc, ACC_REGS)
            ptx_sm90.wgmma_fence()
            issue_scores(s, q_desc, kv_descriptor(next_addr, 16))
            ptx_sm90.wgmma_commit()
            issue_values(acc, pf, kv_descriptor(slot_addr + uint32(V_OFF), KV_ATOM_AT))
            ptx_sm90.wgmma_commit()
            pass_turn(group, False)
            # -- the softmax of S_it while acc += P V is in flight
            ptx_sm90.wgmma_wait(1)
            ptx_sm90.fence_operands(s, S_REGS)
            bad = absent_keys(pages, nxt, g0 + it, lane)
            release_half(base, EMPTY_K, nxt)
            n0 = int32((first_tile + it) * BLOCK_N)
            absorb(s, m_i, l_i, alpha, row0, n0, m0, lane, seqlen_q, seqlen_k, scale_log2, wl, wr,
                   bad, slope, ctx)  # fmt: skip
            # P must be computed before the wait below, not moved after it by the compiler
            # (it moves register arithmetic freely across the asm statements otherwise)
            ptx_sm90.fence_operands(s, S_REGS)
            ptx_sm90.wgmma_wait(0)
            ptx_sm90.fence_operands(acc, ACC_REGS)
            release_half(base, EMPTY_V, slot)
            rescale_and_pack(acc, s, pf, alpha)
            if not PRODUCER:
                # -- every thread is done with slot `slot`: refill it; tile it + 1 must land
                cuda.syncthreads()
                if it - 1 + STAGES < n_tiles:
                    k_first, v_first, keys_left = load_tile(
                        base, slot, g0 + it - 1 + STAGES, k, v, k_first, v_first, k_ss, v_ss,
                        keys_left, pages, tid,
                    )  # fmt: skip
                ptx.cp_async_commit()  # possibly empty: keeps the group count uniform
                if it + 1 < n_tiles:
                    landed()
            slot = nxt

        if PRODUCER:  # every S has landed: the producer may bring the next work tile's Q in
            ptx_sm90.mbarrier_arrive(barrier_address(base, Q_EMPTY))
        # -- the last tile's acc += P V
        landed_half(base, FULL_V, g0 + n_tiles - 1, slot)
        if (CACHE or VARLEN) and TMA:
            zero_rows_past_end(base, slot, seqlen_k - (first_tile + n_tiles - 1) * BLOCK_N, tid)
        take_turn(group)
        ptx_sm90.fence_operands(acc, ACC_REGS)
        ptx_sm90.wgmma_fence()
        issue_values(acc, pf, kv_descriptor(slot_address(base, slot) + uint32(V_OFF), KV_ATOM_AT))
        ptx_sm90.wgmma_commit()
        pass_turn(group, True)
        ptx_sm90.wgmma_wait(0)
        ptx_sm90.fence_operands(acc, ACC_REGS)
        release_half(base, EMPTY_V, slot)  # the block's next work tile may refill it
        if not PRODUCER:
            ptx.cp_async_wait(0)  # nothing may be in flight when the tile's work ends
        write_output(o, lse, acc, m_i, l_i, o_base, o_ss, lse_base, row0, lane, seqlen_q, sink)

    @device_function
    def counted(taken, g, job):
        """(key tiles, Q tiles) through the block's shared memory after a work tile that took
        ``taken`` key tiles."""
        if taken > 0:
            return int32(g + taken), int32(job + 1)
        return g, job

    @device_function
    def dense_tile(
        tile, work, producing, q, k, v, o, lse, cu_q, cu_k, maps, strides, seqlen_q, seqlen_k,
        heads_per_kv, scale_log2, window, total_q, total_k, tid, lane, warp, g, job, variant,
    ):  # fmt: skip
        """Work tile ``tile`` of forward_sm90 (attend_block); the key tiles it took."""
        q_st, k_st, v_st, o_st = strides
        m_block, head, b = tile_of(tile, work)
        nheads = work[1]
        # a 32-bit division: a 64-bit one is a call, which serialises every wgmma (ptx_sm90)
        kv_head = ptx_sm90.quotient32(head, heads_per_kv)
        if VARLEN:  # seqlen_q and seqlen_k are the max lengths
            q_start, rows = packed_sequence(cu_q, b, total_q, seqlen_q)
            k_start, keys = packed_sequence(cu_k, b, total_k, seqlen_k)
            lengths = (int32(rows), int32(keys))
            if m_block * BLOCK_M >= lengths[0]:  # row blocks past the sequence's end
                return int32(0)
            bases = packed_bases(strides, q_start, k_start, head, kv_head, total_q)
            coords = (head, kv_head, int32(0), int32(0), q_start, k_start)
        else:
            lengths = (seqlen_q, seqlen_k)
            bases = dense_bases(strides, b, head, kv_head, seqlen_q, nheads)
            coords = (head, kv_head, b, b, int64(0), int64(0))
        unpaged = (cu_q, int64(0), int32(0), int32(0), int64(0), int64(0), int32(0), int32(0),
                   int64(0), int64(0), int32(0), int32(0))  # fmt: skip
        return attend_block(
            q, k, v, o, lse, bases, (q_st[1], k_st[1], v_st[1], o_st[1]), m_block, lengths[0],
            lengths[1], scale_log2, window, tid, lane, warp, maps, coords, unpaged, g, job,
            producing, sink_of(variant, head),
            slope_of(variant, b, head, nheads, raw_unit(scale_log2)),
            (b, head, variant, (int32(0), int32(0))),
        )  # fmt: skip

    # setmaxnreg needs the register count at entry: a block per multiprocessor. A block works
    # through tiles blockIdx.x, + gridDim.x, ... of the launch's work (tile_of): with a producer
    # the launch is persistent (a block per multiprocessor), its loads of the next tile running
    # while the consumers finish the last. The producer's and the consumers' loops are apart:
    # the producer's registers (setmaxnreg) hold its loop's state alone.
    @kernel(launch_bounds=(THREADS, 1) if PRODUCER else THREADS)
    def forward_sm90(
        q, k, v, o, lse, cu_q, cu_k, maps, order, q_st, k_st, v_st, o_st, seqlen_q, seqlen_k,
        heads_per_kv, scale_log2, window_left, window_right, total_q, total_k, nheads, batch,
        section, q_map, k_map, v_map, *variant,
    ):  # fmt: skip
        tid = cuda.threadIdx.x  # read first: the order the registers are allocated in
        lane = tid & 31
        warp = tid >> 5
        start_block(int32(0), tid)
        strides = (q_st, k_st, v_st, o_st)
        window = (window_left, window_right)
        m_blocks = int32((seqlen_q + BLOCK_M - 1) // BLOCK_M)  # (of the longest sequence)
        work = (m_blocks, nheads, int32(nheads * batch), section)
        tiles = int32(m_blocks * nheads * batch)
        g, job = int32(0), int32(0)  # key tiles and Q tiles through the shared memory so far
        start, reverse, end, listed = first_round(order, tiles)  # the round of work tiles
        # setmaxnreg's register counts hold where its role's code alone follows (ptxas); each
        # loop reads the next tile's rank before the tile's work (a load from the work order
        # at the start of each tile cost 3-5% at 1024 keys)
        if PRODUCER and warp < 4:
            if not start_producer(q, k, v, maps, (q_map, k_map, v_map), lane, warp):
                return
            upcoming = ranked(order, start, reverse, listed, end)
            while start < end:
                tile = upcoming
                start, reverse = following(start, reverse, tiles, listed)
                upcoming = ranked(order, start, reverse, listed, end)
                if tile < tiles:
                    taken = dense_tile(
                        tile, work, True, q, k, v, o, lse, cu_q, cu_k, maps, strides, seqlen_q,
                        seqlen_k, heads_per_kv, scale_log2, window, total_q, total_k, tid, lane,
                        warp, g, job, variant,
                    )  # fmt: skip
                    g, job = counted(taken, g, job)
            finish_producer()
        else:
            start_consumer()
            upcoming = ranked(order, start, reverse, listed, end)
            while start < end:
                tile = upcoming
                start, reverse = following(start, reverse, tiles, listed)
                upcoming = ranked(order, start, reverse, listed, end)
                if tile < tiles:
                    taken = dense_tile(
                        tile, work, False, q, k, v, o, lse, cu_q, cu_k, maps, strides, seqlen_q,
                        seqlen_k, heads_per_kv, scale_log2, window, total_q, total_k, tid, lane,
                        warp, g, job, variant,
                    )  # fmt: skip
                    g, job = counted(taken, g, job)

    @device_function
    def cache_sequence(seqlens, batch_idx, b, seqlen_new, capacity, slots):
        """(keys of sequence b after the append, its cache row: 0 when paged) of
        forward_sm90_kvcache; no keys where a contiguous cache's row is outside [0, slots)."""
        seqlen_k = sequence_length(seqlens, b, seqlen_new, capacity)
        slot = int32(0)
        if not PAGED:
            slot = batch_idx[b]
            if slot < 0 or slot >= slots:
                seqlen_k = int32(0)
                slot = int32(0)
        return seqlen_k, slot

    # -- APPEND: the new rows written into the cache by the producer's other warps ----------

    @device_function
    def new_chunk(new, new_st, b, kv_head, i, c):
        """The 16 bytes of chunk ``c`` of new row ``i`` of (b, kv_head) in ``new`` (k or v)."""
        at = int64(b) * new_st[0] + int64(i) * new_st[1] + int64(kv_head) * new_st[2]
        return ptx_sm90.load_16(new, (at + int64(c * 8)) & NON_NEGATIVE)

    @device_function
    def cache_row(place, key):
        """(whether it has one, the cache row or page, the row within it) of the sequence's key
        ``key`` (``place``: (b, kv_head, block_table, the sequence's first entry, page_size,
        log2(page_size) or -1, slots, the contiguous cache's row)). In 32 bits (page_of), as
        the copies' lookups: decode_portable's key_row divides in 64, and a 64-bit division
        makes ptxas serialise a kernel's wgmma (docs/performance.md, "Hopper backward")."""
        _, _, block_table, table_base, page_size, page_shift, slots, row = place
        if PAGED:
            index, within = page_of(key, page_size, page_shift)
            page = block_table[table_base + int64(index)]
            return page >= 0 and page < slots, int64(page), within
        return True, int64(row), uint32(key)

    @device_function
    def store_chunk(k_cache, v_cache, kc_st, vc_st, kv_head, where, c, k_words, v_words):
        """Chunk ``c`` of a key into the caches where it has a row (``where``: cache_row's)."""
        found, row, within = where
        if found:
            k_at = row * kc_st[0] + int64(within) * kc_st[1] + int64(kv_head) * kc_st[2]
            v_at = row * vc_st[0] + int64(within) * vc_st[1] + int64(kv_head) * vc_st[2]
            ptx_sm90.store_16(k_cache, (k_at + int64(c * 8)) & NON_NEGATIVE, k_words)
            ptx_sm90.store_16(v_cache, (v_at + int64(c * 8)) & NON_NEGATIVE, v_words)

    @device_function
    def append_rows(k, v, k_cache, v_cache, new_strides, kc_st, vc_st, place, lo, hi, fresh, a):
        """Keys lo .. hi - 1 of the sequence (new rows key - fresh of k and v) into the caches,
        16 bytes a copy; ``a``: this thread among the APPEND_THREADS, which copies chunk a %
        CHUNKS of every COPY_ROWS-th row from a // CHUNKS on, two rows' loads issued before
        their stores. The loop is kept from unrolling (an opaque step) and each pass ends in a
        compiler fence: unrolled over a contiguous cache, its addresses and loads spilled the
        producer's registers (setmaxnreg's count; 36-72 bytes at head_dim 64-256)."""
        k_st, v_st = new_strides
        b, kv_head = place[0], place[1]
        c = a % CHUNKS
        if a < COPY_ROWS * CHUNKS:
            for key in range(lo + a // CHUNKS, hi, ptx_sm90.opaque(2 * COPY_ROWS)):
                other = min(key + COPY_ROWS, hi - 1)  # (past the end: key's row again)
                # the block-table entries with the rows' loads: before a store, a load of
                # the next entry would wait for it (the compiler cannot tell them apart)
                w0 = cache_row(place, key)
                w1 = cache_row(place, other)
                k0 = new_chunk(k, k_st, b, kv_head, key - fresh, c)
                v0 = new_chunk(v, v_st, b, kv_head, key - fresh, c)
                k1 = new_chunk(k, k_st, b, kv_head, other - fresh, c)
                v1 = new_chunk(v, v_st, b, kv_head, other - fresh, c)
                store_chunk(k_cache, v_cache, kc_st, vc_st, kv_head, w0, c, k0, v0)
                store_chunk(k_cache, v_cache, kc_st, vc_st, kv_head, w1, c, k1, v1)
                ptx_sm90.compiler_fence()

    @device_function
    def append_tile(
        tile, work, k, v, k_cache, v_cache, seqlens, batch_idx, block_table, strides,
        new_strides, seqlen_q, seqlen_new, heads_per_kv, window, page_size, max_blocks, slots,
        capacity, a,
    ):  # fmt: skip
        """APPEND, the producer's warps that copy no tiles, for work tile ``tile`` of
        forward_sm90_kvcache: the new rows among the keys of its key tiles (those its copying
        warps read, masked keys included: a V row behind a masked key still meets a zero
        probability) into the caches, then the rendezvous with those warps (appended), which
        a work tile that sees no key skips, as they do. A key any block reads is written by
        that block first, so every block reads its own writes; several blocks write the same
        bytes. The first row block of a kv head's first query head writes every new row, so
        that rows no block reads (behind a window) reach the cache too."""
        _, kc_st, vc_st, _ = strides
        m_block, head, b = tile_of(tile, work)
        kv_head = ptx_sm90.quotient32(head, heads_per_kv)
        seqlen_k, slot = cache_sequence(seqlens, batch_idx, b, seqlen_new, capacity, slots)
        m0 = m_block * BLOCK_M
        last_row = min(m0 + BLOCK_M, seqlen_q) - 1
        n_lo, n_hi = block_key_range(m0, last_row, seqlen_q, seqlen_k, window[0], window[1])
        keys = n_hi > n_lo
        first = int32(max(n_lo, 0) // BLOCK_N) * BLOCK_N
        end = first + int32((max(n_hi - first, 0) + BLOCK_N - 1) // BLOCK_N) * BLOCK_N
        fresh = seqlens[b]
        lo, hi = max(fresh, first), min(seqlen_k, end)
        if m_block == 0 and head == kv_head * heads_per_kv:  # every new row
            lo, hi = max(fresh, 0), seqlen_k
        elif not keys:
            lo = hi
        page_shift = page_shift_of(page_size) if PAGED else int32(-1)
        place = (b, kv_head, block_table, int64(b) * max_blocks, page_size, page_shift, slots,
                 slot)  # fmt: skip
        if lo < hi:
            append_rows(k, v, k_cache, v_cache, new_strides, kc_st, vc_st, place, lo, hi, fresh,
                        a)  # fmt: skip
            ptx_sm90.fence_proxy_async_global()  # for the TMA copies that read them back
        if keys:
            appended()

    @device_function
    def cache_tile(
        tile, work, producing, q, k_cache, v_cache, o, lse, seqlens, batch_idx, block_table,
        maps, strides, seqlen_q, seqlen_new, heads_per_kv, scale_log2, window, page_size,
        max_blocks, slots, capacity, flag0, tid, lane, warp, g, job, variant,
    ):  # fmt: skip
        """Work tile ``tile`` of forward_sm90_kvcache (attend_block); the key tiles it took."""
        q_st, kc_st, vc_st, o_st = strides
        m_block, head, b = tile_of(tile, work)
        nheads = work[1]
        kv_head = ptx_sm90.quotient32(head, heads_per_kv)
        seqlen_k, slot = cache_sequence(seqlens, batch_idx, b, seqlen_new, capacity, slots)
        q_base, _, _, o_base, lse_base = dense_bases(strides, b, head, kv_head, seqlen_q, nheads)
        k_head = int64(kv_head) * kc_st[2]
        v_head = int64(kv_head) * vc_st[2]
        k_base, v_base = k_head, v_head
        if not PAGED:
            k_base = k_head + int64(slot) * kc_st[0]
            v_base = v_head + int64(slot) * vc_st[0]
        page_shift = page_shift_of(page_size) if PAGED else int32(-1)
        pages = (block_table, int64(b) * max_blocks, page_size, page_shift, kc_st[0], vc_st[0],
                 slots, seqlen_k, k_head, v_head, flag0, seqlens[b])  # fmt: skip
        return attend_block(
            q, k_cache, v_cache, o, lse, (q_base, k_base, v_base, o_base, lse_base),
            (q_st[1], kc_st[1], vc_st[1], o_st[1]), m_block, seqlen_q, seqlen_k, scale_log2,
            window, tid, lane, warp, maps, (head, kv_head, b, slot, int64(0), int64(0)), pages,
            g, job, producing, sink_of(variant, head),
            slope_of(variant, b, head, nheads, raw_unit(scale_log2)),
            (b, head, variant, (int32(0), int32(0))),
        )  # fmt: skip

    @kernel(launch_bounds=(THREADS, 1) if PRODUCER else THREADS)
    def forward_sm90_kvcache(
        q, k_cache, v_cache, o, lse, seqlens, batch_idx, block_table, maps, k, v, q_st, kc_st,
        vc_st, o_st, k_st, v_st, seqlen_q, seqlen_new, heads_per_kv, scale_log2, window_left,
        window_right, page_size, max_blocks, slots, capacity, nheads, batch, section, q_map,
        k_map, v_map, *variant,
    ):  # fmt: skip
        """Chunked prefill: q (batch, seqlen_q, nheads, head_dim) over sequence b's keys of the
        caches, cache_seqlens[b] + seqlen_new of them within [0, capacity] (the new rows were
        appended before, or with APPEND the kernel appends k and v, (batch, seqlen_new,
        nheads_k, head_dim) with rows 16-byte aligned, itself; unread otherwise), in cache row
        batch_idx[b] (contiguous; none outside [0, slots): every row sees no key) or through
        block_table's row b (paged)."""
        tid = cuda.threadIdx.x
        lane = tid & 31
        warp = tid >> 5
        smem = cuda.shared.array(0, uint16)
        flag0 = int32((ptx_sm90.aligned_index(smem, GROUP_BYTES) * 2 + FLAGS) >> 2)
        start_block(flag0, tid)
        strides = (q_st, kc_st, vc_st, o_st)
        window = (window_left, window_right)
        m_blocks = int32((seqlen_q + BLOCK_M - 1) // BLOCK_M)  # (of the longest sequence)
        work = (m_blocks, nheads, int32(nheads * batch), section)
        tiles = int32(m_blocks * nheads * batch)
        g, job = int32(0), int32(0)  # key tiles and Q tiles through the shared memory so far
        start, reverse, end, _ = first_round(maps, tiles)  # the round of work tiles (no order)
        if PRODUCER and warp < 4:
            if not start_producer(q, k_cache, v_cache, maps, (q_map, k_map, v_map), lane, warp):
                while APPEND and start < end:  # the warps that copy no tiles append
                    tile = ranked(maps, start, reverse, False, end)
                    if tile < tiles:
                        append_tile(
                            tile, work, k, v, k_cache, v_cache, seqlens, batch_idx,
                            block_table, strides, (k_st, v_st), seqlen_q, seqlen_new,
                            heads_per_kv, window, page_size, max_blocks, slots, capacity,
                            tid - MAPS_THREADS,
                        )  # fmt: skip
                    start, reverse = following(start, reverse, tiles, False)
                return
            while start < end:
                tile = ranked(maps, start, reverse, False, end)
                if tile < tiles:
                    taken = cache_tile(
                        tile, work, True, q, k_cache, v_cache, o, lse, seqlens, batch_idx,
                        block_table, maps, strides, seqlen_q, seqlen_new, heads_per_kv,
                        scale_log2, window, page_size, max_blocks, slots, capacity, flag0, tid,
                        lane, warp, g, job, variant,
                    )  # fmt: skip
                    g, job = counted(taken, g, job)
                start, reverse = following(start, reverse, tiles, False)
            finish_producer()
        else:
            start_consumer()
            while start < end:
                tile = ranked(maps, start, reverse, False, end)
                if tile < tiles:
                    taken = cache_tile(
                        tile, work, False, q, k_cache, v_cache, o, lse, seqlens, batch_idx,
                        block_table, maps, strides, seqlen_q, seqlen_new, heads_per_kv,
                        scale_log2, window, page_size, max_blocks, slots, capacity, flag0, tid,
                        lane, warp, g, job, variant,
                    )  # fmt: skip
                    g, job = counted(taken, g, job)
                start, reverse = following(start, reverse, tiles, False)

    return forward_sm90_kvcache if CACHE else forward_sm90
