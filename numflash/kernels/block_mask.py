"""Block masks: a mask_mod evaluated once per (query block, key block), and what the kernels
read of it (numflash.block_masks makes them).

A block mask covers a call's (batch, nheads, seqlen_q, seqlen_k) in blocks of BLOCK_SIZE
query rows by BLOCK_SIZE keys, each one of three kinds: EMPTY (the mask_mod sees no key of it
for any row), PARTIAL, FULL (every row sees every key that exists). The kinds stay with the
BlockMask; the kernels read ``index`` (int32), the last of their ``*variant`` arrays: the
header (HEADER words: the batch entries and heads it was made for, each 1 where the mask is
the same for all, its query blocks, its key blocks, seqlen_q, seqlen_k, where the columns
start), then for each (batch entry, head, query block) ROW_WORDS words, in key blocks: ``[lo,
hi)`` outside which every block is EMPTY (lo = hi: none is seen), and ``[full_lo, full_hi)``,
the longest run of FULL blocks (the first of the longest); then the columns, the same for
each (batch entry, head, key block) in query blocks (the backward's dK and dV run over a key
block's query rows).

A kernel with a block mask runs only the key tiles of ``[lo, hi)`` (their union over the
query blocks its rows span, intersected with the causal / window range) and skips mask_mod
on tiles inside the FULL run (its intersection over those query blocks): a range test a tile,
the ranges read once a row block; the backwards run dQ over the seen key range and dK, dV
over a key block's seen query range (the tensor-core dK/dV kernel: the union over its GQA
group's heads). The blocks inside ``[lo, hi)`` that are EMPTY
still run, masked per element, and FULL blocks outside the longest run take the per-element
mask (masks with such holes or runs are rare: a document, prefix or window mask leaves one
run of seen blocks, and one of FULL blocks, a query block).
"""

import functools

from numba import cuda, int32, uint8

from .jit import device_function, kernel
from .mods import inlined

#: Query rows and keys of a block (a kernel's tile may span several: key_ranges).
BLOCK_SIZE = 128

EMPTY, PARTIAL, FULL = 0, 1, 2

#: Words of ``index`` before the ranges.
HEADER = 8

#: Words of ``index`` a (batch entry, head, query block): lo, hi, full_lo, full_hi.
ROW_WORDS = 4


@device_function
def _entry(index, b, h, block, blocks):
    """The flat (batch entry, head, block) entry, ``blocks`` a (batch entry, head), of
    ``index``'s rows (query blocks) or columns (key blocks)."""
    batches, heads = index[0], index[1]
    bb = b if batches > 1 else 0
    hh = h if heads > 1 else 0
    return (int32(bb) * heads + int32(hh)) * blocks + int32(block)


@device_function
def key_ranges(index, b, h, first_row, last_row):
    """(lo, hi, full_lo, full_hi) in keys for rows ``first_row..last_row`` of (b, h): the
    union of their query blocks' seen ranges (``lo >= hi``: no key seen) and the
    intersection of their FULL runs (``full_lo >= full_hi``: none)."""
    lo, hi = int32(index[5]), int32(0)
    full_lo, full_hi = int32(0), int32(index[3] * BLOCK_SIZE)
    for block in range(first_row // BLOCK_SIZE, last_row // BLOCK_SIZE + 1):
        at = HEADER + ROW_WORDS * _entry(index, b, h, block, index[2])
        if index[at] < index[at + 1]:
            lo = min(lo, int32(index[at] * BLOCK_SIZE))
            hi = max(hi, int32(index[at + 1] * BLOCK_SIZE))
        full_lo = max(full_lo, int32(index[at + 2] * BLOCK_SIZE))
        full_hi = min(full_hi, int32(index[at + 3] * BLOCK_SIZE))
    return lo, min(hi, int32(index[5])), full_lo, full_hi


@device_function
def query_ranges(index, b, h, first_key, last_key):
    """The query rows ``[lo, hi)`` outside which no row of (b, h) sees keys
    ``first_key..last_key`` by the block mask (``lo >= hi``: none)."""
    lo, hi = int32(index[4]), int32(0)
    for block in range(first_key // BLOCK_SIZE, last_key // BLOCK_SIZE + 1):
        at = index[6] + ROW_WORDS * _entry(index, b, h, block, index[3])
        if index[at] < index[at + 1]:
            lo = min(lo, int32(index[at] * BLOCK_SIZE))
            hi = max(hi, int32(index[at + 1] * BLOCK_SIZE))
    return lo, min(hi, int32(index[4]))


@kernel
def row_ranges(kinds, index, first_word, rows, blocks):
    """``index``'s ROW_WORDS words, from ``first_word`` on, of each of ``rows`` rows of
    ``kinds`` (``blocks`` each: a query block's key blocks, or a key block's query blocks),
    a thread a row."""
    row = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    if row < rows:
        first = row * blocks
        lo, hi = int32(0), int32(0)
        best_lo, best_len = int32(0), int32(0)
        run_lo, run_len = int32(0), int32(0)
        for kb in range(blocks):
            kind = kinds[first + kb]
            if kind != uint8(EMPTY):
                if hi == 0:
                    lo = int32(kb)
                hi = int32(kb + 1)
            if kind == uint8(FULL):
                if run_len == 0:
                    run_lo = int32(kb)
                run_len += 1
                if run_len > best_len:
                    best_lo, best_len = run_lo, run_len
            else:
                run_len = int32(0)
        at = first_word + ROW_WORDS * row
        index[at] = lo
        index[at + 1] = hi
        index[at + 2] = best_lo
        index[at + 3] = best_lo + best_len


@functools.lru_cache(maxsize=None)
def evaluator(mask_mod):
    """The kernel ``evaluate(kinds, heads, blocks_q, blocks_k, seqlen_q, seqlen_k,
    mod_args)`` (``mod_args`` a tuple of arrays) that writes each block's kind, grid
    (blocks_k, blocks_q, batch entries x heads), BLOCK_SIZE threads a block, one key a thread
    over the block's rows; ``mask_mod``'s b and h are the grid's (0 for a mask made the same
    for all)."""
    seen_by = inlined(mask_mod)

    @kernel
    def evaluate(kinds, heads, blocks_q, blocks_k, seqlen_q, seqlen_k, mod_args):
        kb, qb, bh = cuda.blockIdx.x, cuda.blockIdx.y, cuda.blockIdx.z
        b, h = bh // heads, bh % heads
        counts = cuda.shared.array(2, int32)  # (seen, existing)
        tid = cuda.threadIdx.x
        if tid < 2:
            counts[tid] = 0
        cuda.syncthreads()
        key = kb * BLOCK_SIZE + tid
        seen = int32(0)
        existing = int32(0)
        if key < seqlen_k:
            for i in range(BLOCK_SIZE):
                row = qb * BLOCK_SIZE + i
                if row < seqlen_q:
                    existing += 1
                    q_idx = int32(row + seqlen_k - seqlen_q)
                    if seen_by(int32(b), int32(h), q_idx, int32(key), *mod_args):
                        seen += 1
        cuda.atomic.add(counts, 0, seen)
        cuda.atomic.add(counts, 1, existing)
        cuda.syncthreads()
        if tid == 0:
            kind = PARTIAL
            if counts[0] == 0:
                kind = EMPTY
            elif counts[0] == counts[1]:
                kind = FULL
            kinds[(bh * blocks_q + qb) * blocks_k + kb] = uint8(kind)

    return evaluate
