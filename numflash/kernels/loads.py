"""Global -> shared row loads with cp.async, shared by the tensor-core kernels.

Every tensor-core kernel moves tiles of rows (one row: head_dim 16-bit values, 16-byte chunks)
from a strided global tensor into shared memory with cp.async, zero-filling rows past the end
instead of reading them. :func:`row_loader` writes rows at a fixed pitch (padded rows, for
ldmatrix); :func:`swizzled_row_loader` writes 128-byte-swizzled atoms (for wgmma).
"""

import functools

from numba import int64, uint32

from . import ptx
from .jit import device_function


@functools.lru_cache(maxsize=None)
def row_loader(row_pitch, chunks, threads, whole_tile_fast_path=False):
    """The device function ``load_rows(dst, src, first, stride, rows_left, nrows, tid)``:
    cp.async ``nrows`` rows of ``chunks`` 16-byte chunks of ``src`` from element ``first``
    (row pitch ``stride``) to shared address ``dst``, rows ``row_pitch`` elements apart; rows
    at or past ``rows_left`` are zero-filled, not read. ``threads`` threads share the work, one
    chunk each per pass. ``whole_tile_fast_path``: a tile whose rows are all in range (all but
    the last) skips the per-row checks."""
    ROW, CHUNKS = row_pitch, chunks
    ROWS_PER_PASS = threads // CHUNKS  # rows one pass of all threads covers
    FAST = whole_tile_fast_path

    @device_function
    def load_rows(dst, src, first, stride, rows_left, nrows, tid):
        r = tid // CHUNKS
        col = (tid - r * CHUNKS) * 8
        if r < ROWS_PER_PASS:
            dst += uint32((r * ROW + col) * 2)
            offset = first + int64(r) * stride + col
            step = ROWS_PER_PASS * stride
            if FAST and rows_left >= nrows and nrows % ROWS_PER_PASS == 0:
                for p in range(nrows // ROWS_PER_PASS):
                    ptx.cp_async_16(
                        dst + uint32(p * ROWS_PER_PASS * ROW * 2), src, offset, uint32(16)
                    )
                    offset += step
            else:
                for p in range((nrows + ROWS_PER_PASS - 1) // ROWS_PER_PASS):
                    row = r + p * ROWS_PER_PASS
                    if row < nrows:
                        valid = row < rows_left
                        ptx.cp_async_16(
                            dst + uint32(p * ROWS_PER_PASS * ROW * 2),
                            src,
                            offset if valid else first,
                            uint32(16) if valid else uint32(0),
                        )
                    offset += step

    return load_rows
