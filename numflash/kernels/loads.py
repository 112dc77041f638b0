"""Global -> shared row loads with cp.async, shared by the tensor-core kernels.

Every tensor-core kernel moves tiles of rows (one row: head_dim 16-bit values, 16-byte chunks)
from a strided global tensor into shared memory with cp.async, zero-filling rows past the end
instead of reading them. :func:`row_loader` writes rows at a fixed pitch (padded rows, for
ldmatrix); :func:`swizzled_row_loader` writes 128-byte-swizzled atoms (for wgmma): every
64-column slice of a tile is one atom of 128-byte rows, 16-byte chunk c of row r stored at
c ^ (r & 7), 8-row groups 1024 bytes apart, the atoms of a tile one after the other (the
layout ptx_sm90's docstring describes; :func:`swizzled_descriptor` points wgmma at it).
"""

import functools

from numba import int32, int64, uint32

from . import ptx, ptx_sm90
from .jit import device_function

#: Bytes of one swizzled row (64 16-bit values) and of one 8-row group of them.
ROW_BYTES, GROUP_BYTES = 128, 1024


@device_function
def swizzled(row, chunk, atom_bytes):
    """Byte offset of 16-byte chunk ``chunk`` of ``row`` in a tile of swizzled atoms
    ``atom_bytes`` apart."""
    c = chunk & 7
    return (
        (chunk >> 3) * atom_bytes
        + (row >> 3) * GROUP_BYTES
        + (row & 7) * ROW_BYTES
        + ((c ^ (row & 7)) << 4)
    )


@device_function
def swizzled_descriptor(address, leading):
    """The wgmma descriptor of the swizzled operand at shared ``address``: 8-row groups
    GROUP_BYTES apart and (MN-major) atoms ``leading`` bytes apart. Adding (bytes >> 4) to it
    moves it by ``bytes``: shared addresses stay below 2^18, inside the 14-bit field."""
    return ptx_sm90.matrix_descriptor(address, leading, GROUP_BYTES, ptx_sm90.SWIZZLE_128B)


def _swizzled_copier(chunks, threads, padded_chunks, locate):
    """The device function ``load_rows(dst, src, where, rows_left, nrows, atom_bytes, tid)``:
    cp.async ``nrows`` rows of ``chunks`` 16-byte chunks of ``src`` into the swizzled tile at
    shared address ``dst``, row r's first element at ``locate(where, r)`` = (element, whether
    it is there to read); rows at or past ``rows_left`` or not there, and chunks ``chunks``..
    ``padded_chunks`` - 1 of every row, are zero-filled, not read (from ``where[0]``, an
    element of ``src``). ``threads`` threads share the work, consecutive threads taking
    consecutive chunks of a row."""
    CHUNKS, THREADS = chunks, threads
    PADDED = padded_chunks or chunks
    POWER_OF_TWO = PADDED & (PADDED - 1) == 0

    @device_function
    def load_rows(dst, src, where, rows_left, nrows, atom_bytes, tid):
        for p in range((nrows * PADDED + THREADS - 1) // THREADS):
            e = tid + p * THREADS
            row = e // PADDED
            chunk = e & (PADDED - 1) if POWER_OF_TWO else e - row * PADDED
            if (nrows * PADDED) % THREADS == 0 or row < nrows:
                valid = row < rows_left and (CHUNKS == PADDED or chunk < CHUNKS)
                at, there = locate(where, row, valid)
                at += chunk * 8
                valid = valid and there
                ptx.cp_async_16(
                    dst + uint32(swizzled(row, chunk, atom_bytes)),
                    src,
                    at if valid else where[0],
                    uint32(16) if valid else uint32(0),
                )

    return load_rows


@device_function
def _strided_row(where, row, wanted):
    """(first element, True) of row ``row`` of rows ``where`` = (first, stride)."""
    return where[0] + int64(row) * where[1], True


@functools.lru_cache(maxsize=None)
def swizzled_row_loader(chunks, threads, padded_chunks=None):
    """The device function ``load_rows(dst, src, first, stride, rows_left, nrows, atom_bytes,
    tid)``: :func:`_swizzled_copier`'s, for rows of ``src`` from element ``first``, ``stride``
    elements apart."""
    copy = _swizzled_copier(chunks, threads, padded_chunks, _strided_row)

    @device_function
    def load_rows(dst, src, first, stride, rows_left, nrows, atom_bytes, tid):
        copy(dst, src, (first, stride), rows_left, nrows, atom_bytes, tid)

    return load_rows


@functools.lru_cache(maxsize=None)
def swizzled_tile_loader(chunks, threads):
    """:func:`swizzled_row_loader`'s ``load_rows`` for tiles whose threads keep their chunk
    from pass to pass: ``chunks`` (a power of 2) divides ``threads`` and a pass covers a
    whole number of 8-row groups, so each thread's first row, chunk and swizzled offset are
    worked out once and every pass adds a constant to both addresses (one 64-bit add and a
    compare a chunk, where the general loader works out row, swizzle and a 64-bit product
    each time; with ``nrows`` a multiple of a pass's rows, as every caller's, the test of
    the last pass's rows against ``nrows`` folds away). Other shapes get the general one."""
    CHUNKS, ROWS_PER_PASS = chunks, threads // chunks
    if threads % chunks or chunks & (chunks - 1) or ROWS_PER_PASS % 8:
        return swizzled_row_loader(chunks, threads)
    PASS_BYTES = ROWS_PER_PASS * ROW_BYTES  # whole 8-row groups: the swizzle repeats

    @device_function
    def load_rows(dst, src, first, stride, rows_left, nrows, atom_bytes, tid):
        row = tid // CHUNKS
        chunk = tid & (CHUNKS - 1)
        dst += uint32(swizzled(row, chunk, atom_bytes))
        at = first + int64(row) * stride + chunk * 8
        step = int64(ROWS_PER_PASS) * stride
        left = rows_left - row  # this thread's rows at or past the end are zero-filled
        for p in range((nrows + ROWS_PER_PASS - 1) // ROWS_PER_PASS):
            if nrows % ROWS_PER_PASS == 0 or row + p * ROWS_PER_PASS < nrows:
                valid = p * ROWS_PER_PASS < left
                ptx.cp_async_16(
                    dst + uint32(p * PASS_BYTES),
                    src,
                    at if valid else first,
                    uint32(16) if valid else uint32(0),
                )
            at += step

    return load_rows


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


@device_function
def page_shift_of(page_size):
    """log2(page_size) for a power-of-two page size, else -1 (what :func:`page_of` takes)."""
    page_shift = int32(-1)
    if page_size > 0 and (page_size & (page_size - 1)) == 0:
        page_shift = int32(0)
        while (1 << page_shift) < page_size:
            page_shift += 1
    return page_shift


@device_function
def page_of(key, page_size, page_shift):
    """(index in the block table, row within the page) of a sequence's key ``key``: a shift
    for a power-of-two page size (``page_shift`` >= 0), else one 32-bit division."""
    if page_shift >= 0:
        index = uint32(key) >> uint32(page_shift)
    else:
        index = uint32(key) // uint32(page_size)
    return index, uint32(key) - index * uint32(page_size)


@device_function
def _paged_row(where, row, wanted):
    """(first element, whether its page is in the cache) of row ``row`` of the keys ``where``
    = (head, row_stride, pages, n0) (see :func:`paged_row_loader`); the table is read only
    for a ``wanted`` row (one past the sequence may be past the table)."""
    head, row_stride, pages, n0 = where
    table, table_base, page_size, page_shift, page_stride, slots = pages
    page = int32(0)
    within = uint32(0)
    if wanted:
        index, within = page_of(n0 + row, page_size, page_shift)
        page = table[table_base + int64(index)]
    at = int64(page) * page_stride + int64(within) * row_stride + head
    return at, page >= 0 and page < slots


@functools.lru_cache(maxsize=None)
def paged_row_loader(chunks, threads, padded_chunks=None):
    """:func:`swizzled_row_loader` for rows of a paged KV cache: the device function
    ``load_rows(dst, src, head, row_stride, pages, n0, rows_left, nrows, atom_bytes, tid)``
    copies keys n0 .. n0 + nrows - 1 of one sequence, key j from row j % page_size of page
    ``table[table_base + j // page_size]`` (element ``page * page_stride + row * row_stride +
    head``), where ``pages`` = (table, table_base, page_size, page_shift, page_stride, slots);
    rows at or past ``rows_left`` and rows behind a page outside [0, slots) are zero-filled,
    not read."""
    copy = _swizzled_copier(chunks, threads, padded_chunks, _paged_row)

    @device_function
    def load_rows(dst, src, head, row_stride, pages, n0, rows_left, nrows, atom_bytes, tid):
        copy(dst, src, (head, row_stride, pages, n0), rows_left, nrows, atom_bytes, tid)

    return load_rows
