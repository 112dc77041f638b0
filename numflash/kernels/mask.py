"""Mask geometry shared by every kernel: which keys a query row sees, and which rows or keys a
block of the other side can see at all.

The mask is flash-attn's, aligned to the bottom-right corner: with ``offset = seqlen_k -
seqlen_q``, query row ``i`` sees key ``j`` iff ``0 <= j < seqlen_k`` and

    i + offset - window_left <= j <= i + offset + window_right

where a negative window bound means unbounded. Causal attention is ``window_right = 0``.
"""

from .jit import device_function


@device_function
def visible_keys(row, seqlen_q, seqlen_k, window_left, window_right):
    """The keys ``[lo, hi)`` that query ``row`` sees (empty when ``hi <= lo``)."""
    diagonal = row + seqlen_k - seqlen_q
    hi = seqlen_k
    if window_right >= 0:
        hi = min(hi, diagonal + window_right + 1)
    lo = 0
    if window_left >= 0:
        lo = max(lo, diagonal - window_left)
    return lo, hi


@device_function
def block_key_range(first_row, last_row, seqlen_q, seqlen_k, window_left, window_right):
    """The keys ``[lo, hi)`` that any of the rows ``first_row..last_row`` sees.

    The visible interval slides right with the row, so its union over the rows runs from the
    first row's lower end to the last row's upper end.
    """
    lo, _ = visible_keys(first_row, seqlen_q, seqlen_k, window_left, window_right)
    _, hi = visible_keys(last_row, seqlen_q, seqlen_k, window_left, window_right)
    return lo, hi


@device_function
def tile_needs_mask(first_row, last_row, n0, n1, seqlen_q, seqlen_k, window_left, window_right):
    """Whether some key of ``[n0, n1)`` is hidden from some row of ``first_row..last_row``."""
    # Every row of the block sees [lo of the last row, hi of the first row).
    _, hi_first = visible_keys(first_row, seqlen_q, seqlen_k, window_left, window_right)
    lo_last, _ = visible_keys(last_row, seqlen_q, seqlen_k, window_left, window_right)
    return n0 < lo_last or n1 > hi_first


@device_function
def block_query_range(first_key, last_key, seqlen_q, seqlen_k, window_left, window_right):
    """The query rows ``[lo, hi)`` that see any of the keys ``first_key..last_key``.

    Row ``i`` sees key ``j`` iff ``j - window_right <= i + offset <= j + window_left`` (offset =
    seqlen_k - seqlen_q), so the rows of a block of keys run from
    the first key's lower end to the last key's upper end.
    """
    offset = seqlen_k - seqlen_q
    lo = 0
    if window_right >= 0:
        lo = max(lo, first_key - window_right - offset)
    hi = seqlen_q
    if window_left >= 0:
        hi = min(hi, last_key + window_left - offset + 1)
    return lo, hi
