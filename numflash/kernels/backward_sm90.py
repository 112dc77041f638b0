"""The tensor-core backward's Hopper backend (sm_90a): backward.py's dK/dV and dQ kernels with
their products on wgmma.

One thread block per (block of 64 * GROUPS keys, kv head, batch), GROUPS warpgroups of 128
threads; warpgroup w owns keys 64w..64w+63 and keeps their dK and dV (fp32) in registers while
blocks of BLOCK_M = 64 (or 128) query rows (Q, dO, their LSE and D) stream through shared
memory, for every query head of the GQA group in turn. Per query block and warpgroup:

    S^T  = K Q^T,  dP^T = V dO^T      m64n{BLOCK_M}k16 x head_dim / 16 each, both operands
                                      read K-major from shared memory by descriptor
    P^T, dS^T                         as backward.py (same device function: wgmma's m64
                                      accumulators repeat mma.sync's C layout per warp)
    dV  += P^T dO, dK += dS^T Q       m64n{head_dim}k16 x BLOCK_M / 16 each: A = P^T or
                                      dS^T rounded to 16 bits in registers (mma.sync's A
                                      layout), B = dO or Q read MN-major from the same
                                      shared tiles

With ``dq_separate=False`` (order-free: FlashAttention-3's five products instead of seven) the
dK/dV kernel adds dQ up as well, and there is no dQ kernel:

    dS                                dS^T rounded to 16 bits into a shared tile as dS (query
                                      rows x the block's keys, 64 keys an atom, swizzled)
    dQ  += dS K                       m64n{head_dim / warpgroups}k16 x BLOCK_N / 16: warpgroup
                                      w takes its share of dQ's columns, A = dS and B = the
                                      resident K tile (MN-major) by descriptor
                                      into fp32 registers, then (``dq_bulk``, as configured by default)
                                      stored by each warp into shared memory and added to an
                                      fp32 buffer by one asynchronous bulk reduction a warp
                                      (bulk_dq), or added to a (b, s, h, d) fp32 buffer two
                                      columns at a time (red.global.add.v2.f32); the call
                                      scales and rounds it into dq afterwards

The dS stores, the barrier and dQ's products are issued while dV's and dK's are in flight.

The dQ kernel is backward.py's with the roles swapped: one block per 64 * GROUPS
query rows, warpgroup w's 64 rows of Q and dO resident in the slots that hold K and V above,
tiles of BLOCK_M keys and values streaming through the stages; S = Q K^T and dP = dO V^T
(m64n{BLOCK_M}k16), dS = P (dP - D) row by row, dQ += dS K (A = dS in registers, B = the K
tile read MN-major), each element summed by one thread in key order: deterministic.

What wgmma changes against mma.sync: the operands come from shared memory without ldmatrix
(no fragment registers for B, no ldmatrix instructions), and the four warps of a warpgroup
issue one instruction for a 64 x N tile, asynchronously, which leaves the registers to the
accumulators: 2 x head_dim / 2 for dK and dV plus 2 x 32 for S^T and dP^T a thread.

Shared memory: every 64-column slice of a row-major tile (K, V: BLOCK_N rows; Q, dO: BLOCK_M
rows) is one "atom" of 128-byte rows with the 128-byte swizzle (16-byte chunk c of row r at
c ^ (r & 7), 8-row groups 1024 bytes apart, ptx_sm90's docstring), atoms of a tile one after
the other. The same bytes are a K-major operand (rows x head_dim: S^T, dP^T) and an MN-major
one (queries x head_dim with head_dim as N: dV, dK; the leading offset steps between atoms).
Loads are cp.async, 16 bytes a thread, rows past the end zero-filled, each thread keeping its
chunk of a row from pass to pass (loads.swizzled_tile_loader: an add and a compare a chunk).

Supports: float16 and bfloat16; head_dim 64 or 128; GQA; causal and window masks bottom-right;
any seqlen_q and seqlen_k. Compute capability 9.x (sm_90a) only. Each warpgroup waits for
its products before using them (no overlap of a warpgroup's own products with its softmax
step; the two warpgroups of a block overlap each other): docs/performance.md.
"""

import functools

from numba import cuda, float32, int32, int64, uint16, uint32, uint64

from . import backward, ptx, ptx_sm90, ptx_tma
from .fragments import PACK, acc_index
from .jit import device_function
from .loads import GROUP_BYTES, ROW_BYTES, swizzled_descriptor, swizzled_tile_loader

#: Query rows per streaming tile by default: the N of S^T's wgmma and the K of dV's (four k16
#: steps); 128 (BLOCK_MS) halves the tile's fixed costs where its registers fit (head_dim 64).
BLOCK_M = 64
BLOCK_MS = (BLOCK_M, 128)
#: Head dims the kernel takes (whole 64-column atoms; 128 is the most that fits in registers).
HEAD_DIMS = (64, 128)
#: Warps per block: one or two warpgroups (two need 255 registers a thread, 1 block per SM).
NUM_WARPS = (4, 8)


#: Columns of dQ a bulk reduction sends with ``ring`` and dQ added up in the dK/dV kernel: a
#: warp's 16 rows of 32 columns (2 KB) through its shared-memory slot at a time, so that the
#: two dS tiles fit beside the ring at head_dim 128 (ring_query_block_step).
RING_PLANE_COLS = 32


def dq_planes(head_dim, num_warps, ring):
    """Planes of dQ's fp32 buffer the dK/dV kernel's bulk reductions add into
    (launch.bulk_dq_buffer): one a warpgroup, or with ``ring`` one per 32 columns."""
    if ring:
        return head_dim // min(head_dim * 4 // num_warps, RING_PLANE_COLS)
    return num_warps // 4


def shared_memory_layout(
    head_dim, num_warps, stages, dq_separate=True, dq_bulk=False, ring=False, tma=False,
    block_m=BLOCK_M,
):  # fmt: skip
    """(K, V, the first stage, one stage, dO within a stage, dS, dQ, the staged tensor maps,
    total) in bytes from the block's 1024-byte aligned base; dS's tile (BLOCK_M query rows x
    the block's keys) only without ``dq_separate`` (two with ``ring``:
    ring_query_block_step), dQ's staging slots for the bulk reductions (BLOCK_M rows x
    head_dim, fp32; with ``ring`` BLOCK_M rows x RING_PLANE_COLS a warpgroup) only with
    ``dq_bulk`` too, the two tensor maps a kernel publishes (publish_maps) only with ``tma``;
    the total includes 1024 bytes to align that base. BLOCK_M: ``block_m`` here."""
    BLOCK_M = block_m  # (the module's default unless asked, as in build_kernels)
    atoms = head_dim // 64
    block_n = 16 * num_warps
    kv = block_n * ROW_BYTES * atoms
    tile = BLOCK_M * ROW_BYTES * atoms
    stage = 2 * tile  # Q, then dO
    ds = 2 * kv + stages * stage
    ds_bytes = 0 if dq_separate else BLOCK_M * ROW_BYTES * (block_n // 64) * (2 if ring else 1)
    dq = ds + ds_bytes
    # a warpgroup's slots hold its BLOCK_M rows of one plane
    plane_cols = head_dim // dq_planes(head_dim, num_warps, ring)
    dq_bytes = BLOCK_M * plane_cols * 4 * (num_warps // 4) if dq_bulk and not dq_separate else 0
    maps = dq + dq_bytes  # (a multiple of 1024: every region above is)
    maps_bytes = 2 * ptx_tma.MAP_BYTES if tma else 0
    return 0, kv, 2 * kv, stage, tile, ds, dq, maps, maps + maps_bytes + GROUP_BYTES


@functools.lru_cache(maxsize=None)
def ring_functions(stages, threads, pingpong=False, tma=False):
    """The mbarrier ring (backward.Ring) of ``stages`` slots handed between ``threads``
    threads: a full barrier a slot that every thread's cp.async copies arrive at when they
    land (``cp.async.mbarrier.arrive.noinc``; wgmma reads the tile after a wait on it, with no
    proxy fence: ptx_sm90's docstring), and an empty one that every thread arrives at once its
    products have read the slot. Barrier i of the block's ``bars``: full i < STAGES, then
    empty. Named barriers 1 and 2 are the warpgroups' own (warpgroup_barrier: no branch).
    ``pingpong`` (two warpgroups): the warpgroups take turns issuing their products, the
    first first; named barrier 3 + g is warpgroup g's turn, which the other's 128 threads
    pass to it by arriving there (pair_barrier_*: numbered at run time, no branch).
    ``tma``: one thread fills a slot by the tensor memory accelerator (build_kernels'
    ring_boxes), so a full barrier expects that thread's arrival with the bytes, not every
    thread's."""
    STAGES, THREADS, BARRIERS = uint32(stages), threads, 2 * stages  # (32-bit slot math)
    FILLERS = 1 if tma else threads
    PINGPONG = pingpong

    @device_function
    def start(bars, tid):
        if tid == 0:
            for i in range(BARRIERS):
                count = FILLERS if i < STAGES else THREADS
                ptx_sm90.mbarrier_init(ptx.shared_address(bars, i), uint32(count))
        cuda.syncthreads()

    @device_function
    def wait_full(bars, t):
        t = uint32(t)
        ptx_sm90.mbarrier_wait(ptx.shared_address(bars, t % STAGES), (t // STAGES) & uint32(1))

    @device_function
    def release(bars, t):
        t = uint32(t)
        ptx_sm90.mbarrier_arrive(ptx.shared_address(bars, STAGES + t % STAGES))

    @device_function
    def claim(bars, t):
        t = uint32(t)
        if t >= STAGES:  # the slot's last tile, t - STAGES, is phase t // STAGES - 1 there
            phase = (t // STAGES - uint32(1)) & uint32(1)
            ptx_sm90.mbarrier_wait(ptx.shared_address(bars, STAGES + t % STAGES), phase)

    @device_function
    def filled(bars, t):
        t = uint32(t)
        ptx_sm90.cp_async_arrive(ptx.shared_address(bars, t % STAGES))

    @device_function
    def group_sync(warp):
        ptx_sm90.warpgroup_barrier(uint32(1) + (uint32(warp) >> uint32(2)))

    @device_function
    def take_turn(warp):
        if PINGPONG:
            ptx_sm90.pair_barrier_sync(uint32(3) + (uint32(warp) >> uint32(2)))

    @device_function
    def pass_turn(warp):
        if PINGPONG:
            ptx_sm90.pair_barrier_arrive(uint32(4) - (uint32(warp) >> uint32(2)))

    @device_function
    def first_turn(warp):
        if PINGPONG and (uint32(warp) >> uint32(2)) == uint32(1):
            ptx_sm90.pair_barrier_arrive(uint32(3))  # the first warpgroup's turn comes first

    @device_function
    def last_turn(warp):
        if PINGPONG and (uint32(warp) >> uint32(2)) == uint32(0):
            ptx_sm90.pair_barrier_sync(uint32(3))  # the second's last pass, taken up

    return backward.Ring(
        start, wait_full, release, claim, filled, group_sync, take_turn, pass_turn, first_turn,
        last_turn,
    )  # fmt: skip


@functools.lru_cache(maxsize=None)
def build_kernels(
    head_dim, dtype_name, num_warps, stages, heavy_group=8, softcap=0.0, alibi=False,
    pack_first=False, dq_separate=True, mods=None, dq_bulk=False, ring=False, pingpong=False,
    tma=False, block_m=BLOCK_M,
):  # fmt: skip
    """The kernels of one configuration (backward.Kernels): dK/dV and dQ, or with
    ``dq_separate=False`` the dK/dV kernel alone, adding dQ up by atomics (module docstring).
    ``heavy_group``: as backward_mma.build_kernels (8 there with the dQ kernel); ``softcap``
    > 0, ``alibi``: of scores changed as the forward changed them
    (backward.element_function); ``mods``: and by a user's functions
    (backward.user_element_function), with a block mask where ``mods.block_mask``.
    ``pack_first``:
    the products that take their A from registers (dV, dK; dQ) get it rounded to 16 bits
    before the wgmma fence, behind an operand fence of its own; else each k16 step's A is
    rounded as it is issued, after the fence, and ptxas waits for the warpgroup before every
    such product but the first (remark C7519: 7 in the dK/dV kernel, 3 in dQ's at head_dim
    128). ``dq_bulk`` (without ``dq_separate``): dQ goes to its fp32 buffer by bulk
    reductions from shared memory, not by atomics from registers (``bulk_dq``). ``ring``:
    the streaming tiles go through a ring of ``stages`` (3) slots handed over by mbarriers
    (ring_functions) instead of a block barrier a tile, so that the two warpgroups may drift
    apart and one's softmax step run beside the other's products. With dQ added up here
    only with ``pingpong`` and ``dq_bulk`` (ring_query_block_step: the turns order the dS
    tiles). ``pingpong`` (with ``ring`` and two warpgroups): the warpgroups take turns issuing
    their products (ring_functions), so that one's products run while the other's softmax
    step does instead of both waiting for the tensor cores at once. ``tma`` (with ``ring``):
    the dense kernels' streaming tiles (Q and dO; K and V in the dQ kernel) come into the
    ring's slots by the tensor memory accelerator, one thread issuing a slot's boxes
    (ring_boxes) over tensor maps the kernel publishes from the templates it is handed
    (publish_maps), so that the other threads issue no copies; the packed-batch kernels keep
    cp.async. ``block_m``: rows of the streaming tiles (query rows; keys in the dQ kernel),
    BLOCK_M or, with dQ from its own kernel, 128 (S^T and dP^T then take 64 registers a
    thread each: head_dim 64 only, as WgmmaBackwardConfig says)."""
    if (
        head_dim not in HEAD_DIMS
        or block_m not in BLOCK_MS
        or (block_m != BLOCK_MS[0] and not dq_separate)
        or num_warps not in NUM_WARPS
        or stages not in ((3,) if ring else (1, 2))
        or (ring and not dq_separate and not (pingpong and dq_bulk))
        or (pingpong and (not ring or num_warps != 8))
        or (tma and not ring)
    ):
        raise ValueError(
            f"wgmma backward: head_dim {head_dim} in {HEAD_DIMS}, num_warps "
            f"{num_warps} in {NUM_WARPS}, stages {stages} in {(3,) if ring else (1, 2)}, "
            f"block_m {block_m} in {BLOCK_MS} (128 only with dq_separate)"
            + (", and the ring adds dQ up only with pingpong and dq_bulk" if ring else "")
            + (", and pingpong only with the ring and num_warps 8" if pingpong else "")
            + (", and tma only with the ring" if tma else "")
        )
    RING = ring_functions(stages, 32 * num_warps, pingpong, tma)  # its turns: nothing without
    BLOCK_M = block_m  # the tiles' rows (the module's default unless asked)
    HEAD_DIM, STAGES, PACK_FIRST, FUSED_DQ = head_dim, stages, pack_first, not dq_separate
    DQ_BULK = FUSED_DQ and dq_bulk
    RING_DQ = ring and FUSED_DQ  # dQ in a turn of its own (ring_query_block_step)
    ab = {"float16": "f16", "bfloat16": "bf16"}[dtype_name]
    BLOCK_N = 16 * num_warps  # 64 keys per warpgroup
    THREADS = 32 * num_warps
    KV_ATOM = BLOCK_N * ROW_BYTES  # bytes of one atom of K or V
    TILE_ATOM = BLOCK_M * ROW_BYTES  # of Q or dO, and of dS (64 keys)
    K_OFF, V_OFF, STAGE0, STAGE, DO_OFF, DS_OFF, DQ_OFF, MAPS_OFF, _ = shared_memory_layout(
        head_dim, num_warps, stages, dq_separate, dq_bulk, ring, tma, block_m
    )
    ATOMS = HEAD_DIM // 64  # 64-column atoms of a row: a tensor map's box each
    STAT_BYTES = (BLOCK_M + backward.STAT_COPY_EXTRA) * 4  # a query block's LSE (or D) copy
    MAP_BYTES, MAP_WORDS = ptx_tma.MAP_BYTES, ptx_tma.MAP_WORDS
    DS_BYTES = (DQ_OFF - DS_OFF) // (2 if RING_DQ else 1)  # one dS tile (two with RING_DQ)
    CHUNKS = HEAD_DIM // 8  # 16-byte chunks per row
    K_STEPS = HEAD_DIM // 16  # k16 steps of S^T = K Q^T
    M_STEPS = BLOCK_M // 16  # k16 steps of dV += P^T dO
    S_REGS = BLOCK_M // 2  # a 64 x BLOCK_M fp32 tile over 128 threads
    WORDS = S_REGS // 2  # ... rounded to 16 bits, two a register
    ACC_REGS = HEAD_DIM // 2
    scores = ptx_sm90.wgmma_update(ab, BLOCK_M)
    update = ptx_sm90.wgmma_update(ab, HEAD_DIM, a_in_registers=True, b_transposed=True)
    pack = PACK[dtype_name]
    # dQ += dS K (without dq_separate): each warpgroup's share of dQ's columns
    DQ_COLS = HEAD_DIM * 4 // num_warps
    DQ_REGS = DQ_COLS // 2
    # dQ's buffer with dq_bulk: planes of PLANE_COLS columns, DQ_PARTS a warpgroup
    PLANES = dq_planes(head_dim, num_warps, ring)
    PLANE_COLS = HEAD_DIM // PLANES
    DQ_PARTS = DQ_COLS // PLANE_COLS  # (1 or 2: bulk_dq)
    DQ_SHIFT = PLANE_COLS.bit_length() - 1
    WARP_DQ_BYTES = 16 * PLANE_COLS * 4  # a warp's 16 rows of one plane's columns
    N_STEPS = BLOCK_N // 16  # k16 steps over the block's keys
    Q_TILES = BLOCK_M // 8
    dq_first = ptx_sm90.wgmma_update(ab, DQ_COLS, b_transposed=True, accumulate=False)
    dq_update = ptx_sm90.wgmma_update(ab, DQ_COLS, b_transposed=True)
    probabilities_and_ds = backward.probabilities_function(BLOCK_M // 8, softcap, alibi, mods)
    row_ds = backward.row_ds_function(BLOCK_M // 8, softcap, alibi, mods)

    load_rows = swizzled_tile_loader(CHUNKS, THREADS)
    descriptor = swizzled_descriptor

    @device_function
    def rows_by_queries(acc, a_desc, b_desc):
        """acc (64 rows x BLOCK_M queries) += A (the warpgroup's 64 rows of K or V) B^T (the
        stage's Q or dO), over head_dim: k16 step kk is 32 bytes into atom kk // 4."""
        for kk in range(K_STEPS):
            a_step = (kk >> 2) * KV_ATOM + (kk & 3) * 32
            b_step = (kk >> 2) * TILE_ATOM + (kk & 3) * 32
            scores(acc, a_desc + uint64(a_step >> 4), b_desc + uint64(b_step >> 4))

    @device_function
    def accumulate(acc, frag, b_desc):
        """acc (64 rows x head_dim) += F (64 x BLOCK_M, ``frag`` in the accumulator layout,
        rounded to 16 bits here) B (BLOCK_M x head_dim, MN-major: k16 step j is 16 rows, 2048
        bytes, further)."""
        for j in range(M_STEPS):
            c = 8 * j  # accumulator tiles 2j and 2j + 1: the A fragment of k16 step j
            a = (
                pack(frag[c], frag[c + 1]),
                pack(frag[c + 2], frag[c + 3]),
                pack(frag[c + 4], frag[c + 5]),
                pack(frag[c + 6], frag[c + 7]),
            )
            update(acc, a, b_desc + uint64((j * 16 * ROW_BYTES) >> 4))

    @device_function
    def pack_into(words, frag):
        """``frag`` (64 x BLOCK_M in the accumulator layout) rounded to 16 bits into
        ``words``, two values a register, in the order accumulate_packed takes them; fenced,
        so that the rounding stays before the wgmma fence that follows."""
        for i in range(WORDS):
            words[i] = pack(frag[2 * i], frag[2 * i + 1])
        ptx_sm90.fence_operands(words, WORDS)

    @device_function
    def accumulate_packed(acc, words, b_desc):
        """accumulate, its A already rounded (pack_into)."""
        for j in range(M_STEPS):
            c = 4 * j
            a = (words[c], words[c + 1], words[c + 2], words[c + 3])
            update(acc, a, b_desc + uint64((j * 16 * ROW_BYTES) >> 4))

    @device_function
    def take_turn():
        """Before a warpgroup issues its products: its turn (pingpong; else nothing)."""
        RING.take_turn(uint32(cuda.threadIdx.x) >> uint32(5))

    @device_function
    def pass_turn():
        """After it committed them: the other warpgroup's turn (pingpong; else nothing)."""
        RING.pass_turn(uint32(cuda.threadIdx.x) >> uint32(5))

    @device_function
    def score_pair(acc0, acc1, a0_desc, b0_desc, a1_desc, b1_desc):
        """acc0 = A0 B0^T and acc1 = A1 B1^T (rows_by_queries, from zero), landed in the
        registers: S^T and dP^T (dK/dV kernel) or S and dP (dQ kernel)."""
        for i in range(S_REGS):
            acc0[i] = float32(0.0)
            acc1[i] = float32(0.0)
        ptx_sm90.fence_operands(acc0, S_REGS)
        ptx_sm90.fence_operands(acc1, S_REGS)
        take_turn()
        ptx_sm90.wgmma_fence()
        rows_by_queries(acc0, a0_desc, b0_desc)
        rows_by_queries(acc1, a1_desc, b1_desc)
        ptx_sm90.wgmma_commit()
        pass_turn()
        ptx_sm90.wgmma_wait(0)
        ptx_sm90.fence_operands(acc0, S_REGS)
        ptx_sm90.fence_operands(acc1, S_REGS)

    @device_function
    def dkdv_products(st, dpt, dk_acc, dv_acc, q_addr, do_addr):
        """dV += P^T dO and dK += dS^T Q in the warpgroup's turn, waited for unless dQ's
        products follow (atomic_dq waits)."""
        # (the A fragments are written by ordinary code: fence)
        if PACK_FIRST:
            pt = cuda.local.array(WORDS, uint32)
            dst = cuda.local.array(WORDS, uint32)
            pack_into(pt, st)
            pack_into(dst, dpt)
        ptx_sm90.fence_operands(dv_acc, ACC_REGS)
        ptx_sm90.fence_operands(dk_acc, ACC_REGS)
        take_turn()
        ptx_sm90.wgmma_fence()
        if PACK_FIRST:
            accumulate_packed(dv_acc, pt, descriptor(do_addr, TILE_ATOM))
            accumulate_packed(dk_acc, dst, descriptor(q_addr, TILE_ATOM))
        else:
            accumulate(dv_acc, st, descriptor(do_addr, TILE_ATOM))
            accumulate(dk_acc, dpt, descriptor(q_addr, TILE_ATOM))
        ptx_sm90.wgmma_commit()
        pass_turn()
        if not FUSED_DQ or RING_DQ:  # (else atomic_dq waits, after issuing dQ's products)
            # the stage and the A fragments are read until the products land
            ptx_sm90.wgmma_wait(0)
            ptx_sm90.fence_operands(dv_acc, ACC_REGS)
            ptx_sm90.fence_operands(dk_acc, ACC_REGS)

    @device_function
    def query_block_step(st, dpt, dk_acc, dv_acc, resident, stage_addr, scores):
        """One warpgroup's work on one query block (the stage at ``stage_addr``)."""
        k_desc, v_desc = resident
        q_addr, do_addr = stage_addr, stage_addr + uint32(DO_OFF)
        # -- S^T = K Q^T and dP^T = V dO^T for this warpgroup's 64 keys
        score_pair(st, dpt, k_desc, descriptor(q_addr, 16), v_desc, descriptor(do_addr, 16))
        # -- P^T and dS^T, masked pairs 0
        probabilities_and_ds(st, dpt, *scores)
        if FUSED_DQ:  # dS for dQ += dS K (atomic_dq), before dV's and dK's products go out
            store_ds(dpt, scores[5], uint32(0))  # the lane
        dkdv_products(st, dpt, dk_acc, dv_acc, q_addr, do_addr)

    @device_function
    def load_pair(stage_addr, a, b, a_first, a_ss, b_first, b_ss, rows_left, tid):
        """cp.async BLOCK_M rows of two arrays (Q and dO, or K and V) into a stage, as one
        commit group."""
        load_rows(stage_addr, a, a_first, a_ss, rows_left, BLOCK_M, TILE_ATOM, tid)
        load_rows(stage_addr + uint32(DO_OFF), b, b_first, b_ss, rows_left, BLOCK_M, TILE_ATOM, tid)
        ptx.cp_async_commit()

    @device_function
    def publish_maps(maps, a, b, base, warp, lane):
        """Warp 0, once a block (tma): the launch's tensor maps of ``a`` and ``b`` (Q and dO,
        or K and V) from ``maps`` = (a's template, b's template, the launch's map buffer),
        acquired for the copies warp 0's first thread issues (ring_boxes)."""
        if warp == 0:
            a_words, b_words, buffer = maps
            staged = base + uint32(MAPS_OFF)
            ptx_tma.publish_map(buffer, 0, staged, a_words, ptx_tma.global_address(a, int64(0)),
                                lane)  # fmt: skip
            ptx_tma.publish_map(buffer, 1, staged + uint32(MAP_BYTES), b_words,
                                ptx_tma.global_address(b, int64(0)), lane)  # fmt: skip
            for i in range(2):
                ptx_tma.acquire(ptx_tma.global_address(buffer, int64(i * MAP_WORDS)))

    @device_function
    def ring_boxes(bars, t, stage_addr, maps, row, head, batch, tid, stats):
        """tma: tile ``t`` of the ring (rows row.. of ``head`` and ``batch``, of both arrays
        publish_maps made maps of; ``maps`` as there) into ``stage_addr``, its slot: warp 0
        waits for the slot to be free, then its first thread issues the copies (issue_boxes);
        rows past the end are zero-filled by the copy. ``stats``: None, or the block's LSE and
        D to copy in bulk with it, (lse, delta, the first element's index in both, its shared
        address in each: STAT_BYTES each, 16-byte aligned)."""
        if ptx.any_lane(tid < 32):  # (a branch ptxas knows to be uniform; and below, a
            RING.claim(bars, t)  # warp converged again: else it serializes the wgmmas, C7519)
            if tid == 0:
                issue_boxes(bars, t, stage_addr, maps, row, head, batch, stats)
            ptx.sync_warp()

    @device_function
    def issue_boxes(bars, t, stage_addr, maps, row, head, batch, stats):
        """ring_boxes' thread 0: expect tile t's bytes on its slot's full barrier, then copy
        every 64-column box of both arrays into the slot (and the LSE and D runs, ``stats``)."""
        full = ptx.shared_address(bars, uint32(t) % uint32(STAGES))
        if stats is not None:
            ptx_sm90.mbarrier_expect_tx(full, uint32(2 * ATOMS * TILE_ATOM + 2 * STAT_BYTES))
            lse, delta, at, lse_to, d_to = stats
            ptx_tma.load_bulk(ptx_tma.global_address(lse, at), lse_to, uint32(STAT_BYTES), full)
            ptx_tma.load_bulk(ptx_tma.global_address(delta, at), d_to, uint32(STAT_BYTES), full)
        else:
            ptx_sm90.mbarrier_expect_tx(full, uint32(2 * ATOMS * TILE_ATOM))
        a_map = ptx_tma.global_address(maps[2], int64(0))
        b_map = ptx_tma.global_address(maps[2], int64(MAP_WORDS))
        for a in range(ATOMS):
            col = int32(a * ptx_tma.BOX_INNER)
            ptx_tma.load_box(a_map, stage_addr + uint32(a * TILE_ATOM), full, col, row,
                             head, batch)  # fmt: skip
            ptx_tma.load_box(b_map, stage_addr + uint32(DO_OFF + a * TILE_ATOM), full, col,
                             row, head, batch)  # fmt: skip

    @device_function
    def load_resident(
        base, a, b, a_first, a_ss, b_first, b_ss, rows_left, warp, lane, col_base, tid
    ):
        """cp.async the block's BLOCK_N rows of two arrays (K and V, or Q and dO) into the
        slots that hold them for the whole kernel, as one commit group; the descriptors of
        this warpgroup's 64 rows of each (64 rows into every atom)."""
        load_rows(base + uint32(K_OFF), a, a_first, a_ss, rows_left, BLOCK_N, KV_ATOM, tid)
        load_rows(base + uint32(V_OFF), b, b_first, b_ss, rows_left, BLOCK_N, KV_ATOM, tid)
        ptx.cp_async_commit()
        rows = (warp >> 2) * 64 * ROW_BYTES  # this warp's warpgroup
        return (
            descriptor(base + uint32(K_OFF + rows), 16),
            descriptor(base + uint32(V_OFF + rows), 16),
        )

    @device_function
    def landed():
        """Wait for this thread's cp.async groups, make them visible to wgmma (the async
        proxy), then for every thread."""
        ptx.cp_async_wait(0)
        ptx_sm90.fence_proxy_async()
        cuda.syncthreads()

    @device_function
    def key_tile_step(s, dp, acc, resident, stage_addr, row_stats, shift, scale_log2, bias):
        """One warpgroup's work on one key tile (the stage at ``stage_addr``) in the dQ
        kernel."""
        q_desc, do_desc = resident
        k_addr, v_addr = stage_addr, stage_addr + uint32(DO_OFF)
        # -- S = Q K^T and dP = dO V^T for this warpgroup's 64 query rows
        score_pair(s, dp, q_desc, descriptor(k_addr, 16), do_desc, descriptor(v_addr, 16))
        # -- dS = P (dP - D), masked pairs 0
        row_ds(dp, s, row_stats, shift, scale_log2, bias)
        # -- dQ += dS K
        if PACK_FIRST:
            ds = cuda.local.array(WORDS, uint32)
            pack_into(ds, dp)
        ptx_sm90.fence_operands(acc, ACC_REGS)
        take_turn()
        ptx_sm90.wgmma_fence()
        if PACK_FIRST:
            accumulate_packed(acc, ds, descriptor(k_addr, TILE_ATOM))
        else:
            accumulate(acc, dp, descriptor(k_addr, TILE_ATOM))
        ptx_sm90.wgmma_commit()
        pass_turn()
        ptx_sm90.wgmma_wait(0)
        ptx_sm90.fence_operands(acc, ACC_REGS)

    @device_function
    def shared_base(smem):
        """The block's 1024-byte aligned base (the swizzle repeats every 8 rows of 128 bytes)."""
        return ptx.shared_address(smem, ptx_sm90.aligned_index(smem, GROUP_BYTES))

    @device_function
    def store_ds(dpt, lane, slot):
        """dS^T of this warp's 16 key rows (``dpt``, the accumulator layout: key rows g and
        g + 8, queries 8 qt + 2t and + 1), rounded to 16 bits, into the dS tile (with RING_DQ
        tile ``slot`` of two) as dS: row = query, 64 keys (this warpgroup's) an atom, 16-byte
        chunk c of row r at c ^ (r & 7). The rows of one store are 2t + e: the four lanes t
        write four chunks, no conflict."""
        smem = cuda.shared.array(0, uint16)
        # unsigned throughout: a signed index costs Numba's negative-index code at every store
        warp = uint32(cuda.threadIdx.x) >> uint32(5)
        first = ptx_sm90.aligned_index(smem, GROUP_BYTES) + uint32(DS_OFF >> 1)
        if RING_DQ:
            first += slot * uint32(DS_BYTES >> 1)
        first = uint32(first + (warp >> uint32(2)) * uint32(TILE_ATOM >> 1))
        g, t = uint32(lane >> 2), uint32(lane & 3)
        for h in range(2):  # key rows g and g + 8: 16-byte chunks 2 (warp & 3) + h
            chunk = uint32((warp & uint32(3)) * uint32(2) + uint32(h))
            for e in range(2):  # queries 2t + e (+ 8 qt), a row each
                row = uint32(t * uint32(2) + uint32(e))
                at = uint32(first + row * uint32(ROW_BYTES // 2) + ((chunk ^ row) << uint32(3)) + g)
                for qt in range(Q_TILES):
                    pair = pack(dpt[acc_index(qt, h)], dpt[acc_index(qt, h) + 1])
                    half = uint16((pair >> uint32(16 * e)) & uint32(0xFFFF))
                    smem[at + uint32(qt * 8 * ROW_BYTES // 2)] = half

    @device_function
    def dq_products(dqa, ds_desc, k_desc):
        """dqa = dS (64 query rows x the block's keys) K (those keys x this warpgroup's
        columns, MN-major): k16 step kk is A's atom kk // 4, 32 bytes in a step, and B's rows
        16 kk.. (2048 bytes a step). dqa's old values are not read."""
        for kk in range(N_STEPS):
            a_step = (kk >> 2) * TILE_ATOM + (kk & 3) * 32
            b_step = kk * 16 * ROW_BYTES
            a_desc, b_desc = ds_desc + uint64(a_step >> 4), k_desc + uint64(b_step >> 4)
            if kk == 0:
                dq_first(dqa, a_desc, b_desc)
            else:
                dq_update(dqa, a_desc, b_desc)

    @device_function
    def bulk_dq_part(base, dqa, dq_acc, tile, part, warp, lane):
        """bulk_dq's reduction of ``dqa``'s columns in plane ``part`` of the warpgroup's, whose
        tile is at ``tile``."""
        rows0 = (warp & 3) * 16
        source = base + uint32(DQ_OFF) + uint32(((warp >> 2) * BLOCK_M + rows0) * PLANE_COLS * 4)
        first = tile + int64(rows0 * PLANE_COLS)
        key0 = uint32(first >> DQ_SHIFT)  # the plane row of the warp's first row, mod 8
        if lane == 0:
            ptx_sm90.bulk_wait_read()  # the last reduction from the slot has read it
        ptx.sync_warp()
        g, t = uint32(lane >> 2), uint32(lane & 3)
        for h in range(2):  # rows g and g + 8
            row = g + uint32(8 * h)
            key = (key0 + row) & uint32(7)
            # columns 8 dt + 2 t and + 1 are chunk 2 dt + t // 2, stored at (2 dt + t // 2) ^ key
            # = 2 (dt ^ key // 2) + (t // 2 ^ key & 1): a byte offset of the lane and row, and
            # (dt << 5) ^ (key // 2 << 5) for each dt
            lane_bytes = (
                row * uint32(PLANE_COLS * 4)
                + (((t >> uint32(1)) ^ (key & uint32(1))) << uint32(4))
                + ((t & uint32(1)) << uint32(3))
            )
            pair_key = (key >> uint32(1)) << uint32(5)
            for dt in range(PLANE_COLS // 8):
                i = acc_index(part * (PLANE_COLS // 8) + dt, h)
                at = source + (lane_bytes + (uint32(dt << 5) ^ pair_key))
                ptx_sm90.store_shared_pair(at, dqa[i], dqa[i + 1])
        ptx_sm90.fence_proxy_async()  # the stores, visible to the bulk reduction
        ptx.sync_warp()
        if lane == 0:
            ptx_sm90.bulk_reduce_add(dq_acc, first, source, uint32(WARP_DQ_BYTES))
            ptx_sm90.bulk_commit()

    @device_function
    def bulk_dq(base, dqa, dq_acc, dq_head, dq_ss, dq_sh, m0, warp, lane):
        """This warp's 16 rows of dQ's share (``dqa``, the accumulator layout) of query block
        m0 added to dq_acc (fp32; ``dq_head`` its index of the head, ``dq_ss`` and ``dq_sh``
        its row and head strides) by DQ_PARTS bulk reductions, into the BLOCK_M x PLANE_COLS
        tiles of the warpgroup's planes (rows PLANE_COLS apart in a plane, planes dq_sh /
        PLANES apart and starting at multiples of 8 rows). A part's rows go through
        the warp's slot of the dQ tile in shared memory as dq_acc holds them: 16-byte chunk c
        of plane row r at c ^ (r & 7), so that a store's eight rows and four lanes meet every
        bank twice (launch's reader undoes it)."""
        plane_stride = dq_sh // PLANES
        tile = dq_head + (warp >> 2) * DQ_PARTS * plane_stride + int64(m0) * dq_ss
        bulk_dq_part(base, dqa, dq_acc, tile, 0, warp, lane)
        if DQ_PARTS == 2:  # (constant parts: dqa's registers are indexed by constants only)
            bulk_dq_part(base, dqa, dq_acc, tile + plane_stride, 1, warp, lane)

    @device_function
    def drain(lane):
        """Nothing in flight when the block exits: its cp.async copies, and with DQ_BULK the
        bulk reductions its warps' first lanes issued (they read shared memory)."""
        backward.drain_copies(lane)
        if DQ_BULK and lane == 0:
            ptx_sm90.bulk_wait()

    @device_function
    def atomic_dq(
        smem, base, dpt, dqa, dq_acc, dq_head, dq_ss, dq_sh, m0, col_base, warp, lane, seqlen_q,
        dk_acc, dv_acc,
    ):  # fmt: skip
        """dQ rows m0.. += dS K over the block's keys, this warpgroup's DQ_COLS columns, added
        to dq_acc (fp32) by atomics, or with DQ_BULK by bulk_dq into the warpgroup's plane
        (dq_sh / PLANES apart); dS was stored by query_block_step, whose dV and dK products
        are waited for here too."""
        ptx_sm90.fence_proxy_async()  # the dS stores, visible to wgmma
        cuda.syncthreads()  # ... every warpgroup's
        col0, ds_desc, k_desc = dq_operands(base, uint32(0), warp)
        ptx_sm90.wgmma_fence()
        dq_products(dqa, ds_desc, k_desc)
        ptx_sm90.wgmma_commit()
        ptx_sm90.wgmma_wait(0)  # dV's, dK's and dQ's products; dS is read until then
        ptx_sm90.fence_operands(dv_acc, ACC_REGS)
        ptx_sm90.fence_operands(dk_acc, ACC_REGS)
        ptx_sm90.fence_operands(dqa, DQ_REGS)
        if DQ_BULK:
            bulk_dq(base, dqa, dq_acc, dq_head, dq_ss, dq_sh, m0, warp, lane)
            return
        for h in range(2):
            row = m0 + (warp & 3) * 16 + (lane >> 2) + 8 * h
            if row < seqlen_q:
                # (reduce_add_pair takes the index as it is: no wraparound code to mask away)
                at = dq_head + int64(row) * dq_ss + col_base + col0 + (lane & 3) * 2
                for dt in range(DQ_COLS // 8):
                    i = acc_index(dt, h)
                    ptx_sm90.reduce_add_pair(dq_acc, at + dt * 8, dqa[i], dqa[i + 1])

    @device_function
    def dq_operands(base, slot, warp):
        """(this warpgroup's first column of dQ, dq_products' A and B descriptors): dS tile
        ``slot`` (0, or with RING_DQ 0 or 1; the query block's rows, both warpgroups' keys)
        and the warpgroup's DQ_COLS columns of K."""
        col0 = (warp >> 2) * DQ_COLS
        ds_desc = descriptor(base + uint32(DS_OFF) + slot * uint32(DS_BYTES), 16)
        k_desc = descriptor(
            base + uint32(K_OFF) + uint32((col0 >> 6) * KV_ATOM + (col0 & 63) * 2), KV_ATOM
        )
        return col0, ds_desc, k_desc

    @device_function
    def ring_query_block_step(st, dpt, dk_acc, dv_acc, dqa, resident, stage_addr, scores, pending):
        """query_block_step with dQ added up through the ring (RING_DQ): block t's dS goes to
        dS tile t % 2, and its dQ products take a third turn, after both warpgroups' turns
        of dV's and dK's products, then go to the buffer (bulk_dq). ``pending``: (base,
        dq_acc, dq_acc's index of the block's head, its row and head strides, the block's
        first row, t, warp, lane). The turns order the tiles (strict alternation: a
        warpgroup's turn follows the other's last one): the other warpgroup stored its half
        of tile t before its turn of dV's and dK's products, which precedes this third turn;
        tile t + 2 (the same slot) is stored after block t + 2's first turn, which follows
        both warpgroups' third turns of block t + 1, each taken after the warpgroup waited
        for its dQ products of block t."""
        base = pending[0]
        slot = uint32(pending[6]) & uint32(1)
        warp = pending[7]
        k_desc, v_desc = resident
        q_addr, do_addr = stage_addr, stage_addr + uint32(DO_OFF)
        # -- S^T = K Q^T and dP^T = V dO^T for this warpgroup's 64 keys
        score_pair(st, dpt, k_desc, descriptor(q_addr, 16), v_desc, descriptor(do_addr, 16))
        # -- P^T and dS^T, masked pairs 0; dS into its tile, visible to both warpgroups' dQ
        probabilities_and_ds(st, dpt, *scores)
        store_ds(dpt, pending[8], slot)
        ptx_sm90.fence_proxy_async()
        dkdv_products(st, dpt, dk_acc, dv_acc, q_addr, do_addr)
        # -- dQ = dS K over both warpgroups' keys, this warpgroup's columns, in a third turn
        _, ds_desc, k_desc = dq_operands(base, slot, warp)
        ptx_sm90.fence_operands(dqa, DQ_REGS)
        take_turn()
        ptx_sm90.wgmma_fence()
        dq_products(dqa, ds_desc, k_desc)
        ptx_sm90.wgmma_commit()
        pass_turn()
        ptx_sm90.wgmma_wait(0)  # (dS's tile is read until then)
        ptx_sm90.fence_operands(dqa, DQ_REGS)
        _, dq_acc, dq_head, dq_ss, dq_sh, m0, _, _, lane = pending
        bulk_dq(base, dqa, dq_acc, dq_head, dq_ss, dq_sh, m0, warp, lane)

    return backward.build_kernels(
        backward.Backend(
            block_m=BLOCK_M,
            block_n=BLOCK_N,
            threads=THREADS,
            stages=STAGES,
            s_regs=S_REGS,
            acc_regs=ACC_REGS,
            dq_regs=DQ_REGS if FUSED_DQ else 1,
            stage0=STAGE0,
            stage_bytes=STAGE,
            dq_atomic=FUSED_DQ,
            block_position=backward.block_position_function(
                BLOCK_N, 1, HEAD_DIM, heavy_group, ptx_sm90.quotient32
            ),
            shared_base=shared_base,
            load_resident=load_resident,
            load_pair=load_pair,
            landed=landed,
            query_block_step=query_block_step,
            key_tile_step=key_tile_step,
            atomic_dq=atomic_dq,
            drain=drain,
            ring=RING if ring else None,
            publish_maps=publish_maps if tma else None,
            ring_boxes=ring_boxes if tma else None,
            ring_query_block_step=ring_query_block_step if RING_DQ else None,
            divide=ptx_sm90.quotient32,
            write_rows=backward.row_writer(HEAD_DIM, dtype_name),
        ),
        alibi,
        mods,
    )
