"""Block masks: which (query block, key block) pairs a mask_mod hides entirely or shows
entirely, worked out once on the GPU, so that attention calls skip the hidden tiles and the
per-score mask on the shown ones (kernels/block_mask.py holds the kernel side)."""

import logging
import warnings

import numpy as np
from numba.core.errors import NumbaPerformanceWarning

from . import arrays
from .kernels import block_mask as kernel_side
from .kernels.jit import SIMULATOR

#: Query rows and keys of a block.
BLOCK_SIZE = kernel_side.BLOCK_SIZE

#: The most (batch entries x heads) one block mask covers (the evaluation's grid z).
MAX_ENTRIES = 65535

_log = logging.getLogger("numflash")
#: The mask_mods whose evaluation kernel was made (kernels/block_mask.evaluator caches it).
_evaluated = set()


class BlockMask:
    """What :func:`numflash.block_mask` worked out of a mask_mod for one shape; pass it as
    ``block_mask=`` to :func:`numflash.attention` and :func:`numflash.attention_backward`,
    for any layer and step with that shape, mask_mod and mod_args.

    Attributes: ``mask_mod``, ``mod_args`` (what it was made with), ``batch``, ``nheads``
    (None: the same for every batch entry or head), ``seqlen_q``, ``seqlen_k``, ``kinds``
    (each block's, uint8: EMPTY 0, PARTIAL 1, FULL 2) and ``index`` (what the kernels read
    of them), device arrays laid out as kernels/block_mask.py says."""

    __slots__ = ("mask_mod", "mod_args", "batch", "nheads", "seqlen_q", "seqlen_k", "index",
                 "kinds")  # fmt: skip

    def __init__(self, mask_mod, mod_args, batch, nheads, seqlen_q, seqlen_k, index, kinds):
        self.mask_mod, self.mod_args = mask_mod, mod_args
        self.batch, self.nheads, self.seqlen_q, self.seqlen_k = batch, nheads, seqlen_q, seqlen_k
        self.index, self.kinds = index, kinds

    @property
    def shape(self):
        """(batch entries, heads, query blocks, key blocks) of ``kinds``."""
        entries = (self.batch or 1, self.nheads or 1)
        return entries + (_blocks(self.seqlen_q), _blocks(self.seqlen_k))

    def counts(self):
        """{"empty": n, "partial": n, "full": n}: the blocks of each kind (a copy to the host)."""
        kinds = np.asarray(self.kinds.get() if hasattr(self.kinds, "get") else self.kinds)
        found = np.bincount(kinds, minlength=3)
        return {"empty": int(found[0]), "partial": int(found[1]), "full": int(found[2])}

    def sparsity(self):
        """The fraction of blocks the mask hides entirely."""
        counts = self.counts()
        return counts["empty"] / max(1, sum(counts.values()))

    def __repr__(self):
        name = getattr(self.mask_mod, "__name__", repr(self.mask_mod))
        return (f"BlockMask({name}, batch={self.batch}, nheads={self.nheads}, seqlen_q="
                f"{self.seqlen_q}, seqlen_k={self.seqlen_k}, block={BLOCK_SIZE})")  # fmt: skip


def _blocks(n):
    return (n + BLOCK_SIZE - 1) // BLOCK_SIZE


def make(mask_mod, batch, nheads, seqlen_q, seqlen_k, mod_args):
    """The BlockMask of arguments numflash.block_mask checked: ``mod_args`` the arrays as
    the kernels read them, ``batch`` and ``nheads`` positive ints or None."""
    entries = (batch or 1) * (nheads or 1)
    like = mod_args[0] if mod_args else None
    xp = np if SIMULATOR else arrays.array_module(like) if like is not None else arrays._cupy()
    blocks_q, blocks_k = _blocks(seqlen_q), _blocks(seqlen_k)
    kinds = xp.empty(entries * blocks_q * blocks_k, dtype=np.uint8)
    rows, columns = entries * blocks_q, entries * blocks_k
    first_column = kernel_side.HEADER + kernel_side.ROW_WORDS * rows
    index = xp.zeros(first_column + kernel_side.ROW_WORDS * columns, dtype=np.int32)
    header = (batch or 1, nheads or 1, blocks_q, blocks_k, seqlen_q, seqlen_k, first_column)
    index[: len(header)] = xp.asarray(header, dtype=np.int32)
    if mask_mod not in _evaluated:
        _evaluated.add(mask_mod)
        _log.info("compiling the block-mask evaluation of mask_mod=%s",
                  getattr(mask_mod, "__name__", mask_mod))  # fmt: skip
    evaluate = kernel_side.evaluator(mask_mod)
    shape = (nheads or 1, blocks_q, blocks_k, seqlen_q, seqlen_k)
    with warnings.catch_warnings():  # Numba's launch warns of small grids; these are cheap
        warnings.simplefilter("ignore", NumbaPerformanceWarning)
        _run(evaluate, (blocks_k, blocks_q, entries), BLOCK_SIZE, (kinds, *shape, tuple(mod_args)))
        by_key = xp.ascontiguousarray(kinds.reshape(entries, blocks_q, blocks_k).transpose(0, 2, 1))
        ranges = ((kinds, kernel_side.HEADER, rows, blocks_k),
                  (by_key.reshape(-1), first_column, columns, blocks_q))  # fmt: skip
        for source, first_word, count, blocks in ranges:
            grid = (count + _RANGE_THREADS - 1) // _RANGE_THREADS
            _run(kernel_side.row_ranges, grid, _RANGE_THREADS,
                 (source, index, first_word, count, blocks))  # fmt: skip
    return BlockMask(mask_mod, mod_args, batch, nheads, seqlen_q, seqlen_k, index, kinds)


#: Threads a block of kernels/block_mask.row_ranges (a row of kinds a thread).
_RANGE_THREADS = 128


def _run(kernel, grid, threads, args):
    """Launch ``kernel`` on CuPy's current stream. Numba types a tuple only of its own device
    arrays, so CuPy's go as Numba views (zero-copy)."""
    if SIMULATOR:
        kernel[grid, threads](*args)
        return
    from numba import cuda

    def view(x):
        if isinstance(x, tuple):
            return tuple(view(y) for y in x)
        return cuda.as_cuda_array(x) if hasattr(x, "__cuda_array_interface__") else x

    stream = cuda.external_stream(arrays.current_stream())
    kernel[grid, threads, stream](*(view(x) for x in args))
