"""A packed batch's work order, made on the GPU (the Hopper forward's persistent launch).

A dense persistent launch takes its work tiles in an order the host makes once per geometry
(families.wgmma_forward.work_order). A packed batch's tiles hang on the sequences' lengths,
which only the device holds, so the launch went through every (row block of the longest
sequence, head, sequence) in rank order: the row blocks past a sequence's end cost each
block a visit, and the tiles' costs rose and fell along the rounds. This kernel, launched
just before the forward on the same stream, reads the offsets and writes the order the
forward's listed path takes (forward_sm90.first_round and ranked): the tiles that hold rows
only, a sequence's together, the sequences costliest first by the same model as the host's
(key tiles its last row block sees under the mask plus TILE_OVERHEAD), each sequence's
row blocks last first (under a causal mask they see the most keys), handed out in rounds of
``blocks`` tiles whose direction alternates, so each block's sum of falling costs comes out
alike. Which block runs a tile changes no bit of its output.

A sequence's tiles stay together because the tiles in flight at once then share their keys
and values in L2, as the dense launch's rank order keeps them (forward_sm90.tile_of): sorted
by each row block's own cost, a causal batch's tiles in flight were the same row block of
many sequences, none sharing its keys, and the packed forward ran 0.77x the alternating
rounds at head_dim 128 (H100; docs/performance.md, "A packed batch's work order").

One block of THREADS threads: the (sequence, row block) slots' keys into shared memory,
a bitonic sort of them (the costliest sequences first, then by sequence and row block: the
order is deterministic), then each slot's tiles (a head each, next to each other, so a GQA
group's heads run together) written to their blocks' lists.
"""

import functools

from numba import cuda, int32, int64

from .jit import device_function, kernel

#: A slot's sort key: (COST_CAP - its sequence's cost) << 32 | (sequence, row block last
#: first), so that ascending keys are the costliest sequences first, a sequence's slots
#: together; an empty slot (no rows) sorts after every cost, padding after those.
COST_CAP = 1 << 20
_SLOT_MASK = (1 << 32) - 1


@device_function
def slot_cost(cu_q, cu_k, slot, m_blocks, total_q, total_k, max_q, max_k, block_m, block_n,
              window_left, window_right, overhead):  # fmt: skip
    """The model's cost of slot ``slot`` (sequence slot // m_blocks, row block slot %
    m_blocks): the key tiles its rows see plus ``overhead``; -1 where the row block holds no
    row (past its sequence's end). Lengths clamped as forward_portable.packed_sequence does."""
    b = slot // m_blocks
    m = slot - b * m_blocks
    q0 = min(max(cu_q[b], 0), total_q)
    rows = min(min(max(cu_q[b + 1], q0), total_q) - q0, max_q)
    k0 = min(max(cu_k[b], 0), total_k)
    keys = min(min(max(cu_k[b + 1], k0), total_k) - k0, max_k)
    first = m * block_m
    if first >= rows:
        return int32(-1)
    last = min(first + block_m, rows) - 1
    offset = keys - rows  # the mask aligned bottom-right (kernels/mask.py)
    hi = keys
    if window_right >= 0:
        hi = min(hi, last + offset + window_right + 1)
    lo = 0
    if window_left >= 0:
        lo = max(lo, first + offset - window_left)
    seen = 0
    if hi > lo:
        seen = (hi + block_n - 1) // block_n - lo // block_n
    return int32(min(seen + overhead, COST_CAP))


@device_function
def sequence_cost(cu_q, cu_k, b, m_blocks, total_q, total_k, max_q, max_k, block_m, block_n,
                  window_left, window_right, overhead):  # fmt: skip
    """The model's cost of sequence ``b``'s last row block, the key its slots are sorted by
    (the costliest row block under a causal mask; without a mask every row block's cost;
    under a window near the costliest, as a short last block sees fewer keys); -1 where the
    sequence holds no row."""
    q0 = min(max(cu_q[b], 0), total_q)
    rows = min(min(max(cu_q[b + 1], q0), total_q) - q0, max_q)
    if rows <= 0:
        return int32(-1)
    last = b * m_blocks + (rows - 1) // block_m
    return slot_cost(cu_q, cu_k, int32(last), m_blocks, total_q, total_k, max_q, max_k, block_m,
                     block_n, window_left, window_right, overhead)  # fmt: skip


@device_function
def list_start(x, rounds, rem, blocks):
    """Where block ``x``'s list starts among the tiles: ``rounds`` full rounds of ``blocks``
    tiles give each block one, and the last ``rem`` tiles go to blocks 0.. where that round
    runs forward (an even one), to blocks .., blocks - 1 where it runs back."""
    if rounds % 2 == 0:
        return x * rounds + min(x, rem)
    return x * rounds + max(0, x - (blocks - rem))


@device_function
def tile_rank(b, m, head, m_blocks, nheads, pairs, section):
    """forward_sm90.tile_of's inverse: the rank of (row block m, head, sequence b)."""
    pair = b * nheads + head
    sec = pair // section
    first = sec * section
    width = min(section, pairs - first)
    return int32(sec * section * m_blocks + (m_blocks - 1 - m) * width + pair - first)


@functools.lru_cache(maxsize=None)
def build(slots, threads):
    """The order kernel for at most ``slots`` (sequence, row block) slots (a power of two),
    ``threads`` threads, one block: grid (1,), ``threads`` threads.

    Parameters: cu_q, cu_k (int32, batch + 1), order (int32: blocks + 1 list starts, then
    the tiles' ranks, a block's list after another's); batch, m_blocks (row blocks of the
    longest sequence), nheads, section (forward_sm90.tile_of's pairs a section), blocks (the
    forward's grid), total_q, total_k (rows of the packed arrays), max_q, max_k (the max
    lengths), block_m, block_n, window_left, window_right (-1: none), overhead (the model's
    cost of a tile beside its key tiles)."""
    SLOTS, THREADS = slots, threads

    @kernel
    def packed_work_order(cu_q, cu_k, order, batch, m_blocks, nheads, section, blocks, total_q,
                          total_k, max_q, max_k, block_m, block_n, window_left, window_right,
                          overhead):  # fmt: skip
        keys = cuda.shared.array(SLOTS, int64)
        counted = cuda.shared.array(1, int32)
        tid = cuda.threadIdx.x
        n = batch * m_blocks
        if n > SLOTS:  # (the host never asks): the rounds alternating over every slot instead
            if tid == 0:
                order[0] = -1
            return
        if tid == 0:
            counted[0] = 0
        cuda.syncthreads()
        size = 2
        while size < n:
            size *= 2
        for i in range(tid, size, THREADS):
            key = int64(COST_CAP + 2) << 32 | int64(i)  # padding, after everything
            if i < n:
                cost = slot_cost(cu_q, cu_k, int32(i), m_blocks, total_q, total_k, max_q,
                                 max_k, block_m, block_n, window_left, window_right,
                                 overhead)  # fmt: skip
                if cost >= 0:
                    cuda.atomic.add(counted, 0, 1)
                    b = i // m_blocks
                    cost = sequence_cost(cu_q, cu_k, b, m_blocks, total_q, total_k, max_q,
                                         max_k, block_m, block_n, window_left, window_right,
                                         overhead)  # fmt: skip
                    reversed_slot = b * m_blocks + m_blocks - 1 - (i - b * m_blocks)
                    key = int64(COST_CAP - cost) << 32 | int64(reversed_slot)
                else:
                    key = int64(COST_CAP + 1) << 32 | int64(i)
            keys[i] = key
        cuda.syncthreads()
        # bitonic sort of keys[0:size], ascending
        k = 2
        while k <= size:
            j = k // 2
            while j > 0:
                for i in range(tid, size, THREADS):
                    partner = i ^ j
                    if partner > i:
                        a, c = keys[i], keys[partner]
                        if (a > c) == ((i & k) == 0):
                            keys[i], keys[partner] = c, a
                cuda.syncthreads()
                j //= 2
            k *= 2
        filled = counted[0]
        tiles = filled * nheads
        rounds = tiles // blocks
        rem = tiles - rounds * blocks
        for x in range(tid, blocks + 1, THREADS):
            order[x] = list_start(x, rounds, rem, blocks) if x < blocks else tiles
        pairs = nheads * batch
        for s in range(tid, filled, THREADS):
            slot = int32(keys[s] & _SLOT_MASK)  # (sequence, row block last first)
            b = slot // m_blocks
            m = m_blocks - 1 - (slot - b * m_blocks)
            position = s * nheads
            r = position // blocks
            w = position - r * blocks
            for head in range(nheads):
                x = w if r % 2 == 0 else blocks - 1 - w
                order[blocks + 1 + list_start(x, rounds, rem, blocks) + r] = tile_rank(
                    b, m, head, m_blocks, nheads, pairs, section
                )
                w += 1
                if w == blocks:
                    w = 0
                    r += 1

    return packed_work_order
