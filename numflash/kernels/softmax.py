"""Masking and online-softmax pieces shared by the forward kernels.

The mask is flash-attn's, aligned to the bottom-right corner: with ``offset = seqlen_k -
seqlen_q``, query row ``i`` sees key ``j`` iff ``0 <= j < seqlen_k`` and

    i + offset - window_left <= j <= i + offset + window_right

where a negative window bound means unbounded. Causal attention is ``window_right = 0``.

Scores live in the log2 domain (``s * softmax_scale * log2(e)``) so that the kernels use ex2.
"""

import math

from numba import float32, int32

from .jit import device_function

LOG2E = 1.4426950408889634  # 1 / ln(2): exp(x) = 2 ** (x * LOG2E)
LN2 = 0.6931471805599453
NEG_INF = float32(-math.inf)


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
def shift_of(m_i):
    """What a row's log2-domain scores are shifted by before exp2: its running max, or 0 while
    that max is still -inf (only masked keys so far), so that -inf - -inf never makes a NaN."""
    if m_i == NEG_INF:
        return float32(0.0)
    return m_i


@device_function
def final_lse(m_i, l_i):
    """Natural-log log-sum-exp of a row from its log2-domain max and sum; -inf if no key."""
    if l_i > float32(0.0):
        return float32((m_i + math.log2(l_i)) * float32(LN2))
    return NEG_INF


@device_function
def ceil_div(a, b):
    return int32((a + b - 1) // b)
