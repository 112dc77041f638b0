"""Online-softmax pieces shared by the kernels.

Scores live in the log2 domain (``s * softmax_scale * log2(e)``) so that the kernels use ex2.
"""

import functools
import math

from numba import float32, int32

from . import ptx
from .jit import device_function

LOG2E = 1.4426950408889634  # 1 / ln(2): exp(x) = 2 ** (x * LOG2E)
LN2 = 0.6931471805599453
NEG_INF = float32(-math.inf)


@device_function
def shift_of(m_i):
    """What a row's log2-domain scores are shifted by before exp2: its running max, or 0 while
    that max is still -inf (only masked keys so far), so that -inf - -inf never makes a NaN."""
    if m_i == NEG_INF:
        return float32(0.0)
    return m_i


@device_function
def final_lse(m_i, l_i):
    """Natural-log log-sum-exp of a row from its log2-domain max and sum; -inf if no key (a
    sum of 0), NaN if a score was NaN (a NaN sum)."""
    if l_i == float32(0.0):
        return NEG_INF
    return float32((m_i + math.log2(l_i)) * float32(LN2))


@device_function
def inverse_sum(l_i):
    """1 / l_i for the output's normalisation: 0 for a row that saw no key (O = 0), NaN for a
    NaN sum, so that a NaN among the scores reaches the output instead of looking empty."""
    if l_i == float32(0.0):
        return float32(0.0)
    return float32(1.0) / l_i


@device_function
def row_log2_lse(lse_value):
    """A row's LSE in the log2 domain; +inf for a row that saw no key, so that its p is 0."""
    if lse_value == NEG_INF:
        return -NEG_INF
    return lse_value * float32(LOG2E)


@functools.lru_cache(maxsize=None)
def row_starter(rows, acc_regs):
    """``start_rows(m_i, l_i, acc)``: a thread's ``rows`` running maxima -inf and sums 0 and its
    ``acc_regs`` accumulators 0, before a block's first key tile."""
    ROWS, ACC_REGS = rows, acc_regs

    @device_function
    def start_rows(m_i, l_i, acc):
        for r in range(ROWS):
            m_i[r] = NEG_INF
            l_i[r] = float32(0.0)
        for i in range(ACC_REGS):
            acc[i] = float32(0.0)

    return start_rows


@functools.lru_cache(maxsize=None)
def sink_functions(sinks):
    """(``sink_of(variant, head) -> sink``, ``with_sink(m_i, l_i, sink) -> (m, l, factor)``)
    for a kernel compiled with sink logits (``sinks``, a compile-time flag) or without.

    ``sink_of``: head ``head``'s sink in the log2 domain, from the kernel's ``*variant``
    arrays (the sinks first); -inf without sinks, which changes nothing. ``with_sink``: a
    row's log2-domain max ``m_i`` and sum ``l_i`` with the sink joined to the sum (a logit
    with no value), and the factor by which its output accumulator, kept relative to m_i,
    is rescaled to the new max: O = acc * factor / l and final_lse(m, l) hold the sink. A row
    that saw no key gets l = 1 at m = sink (O = 0, LSE = the sink); a -inf sink changes
    nothing and a NaN one makes the row NaN. Without sinks, (m_i, l_i, 1): the epilogues call
    it either way."""
    SINKS = sinks

    @device_function
    def sink_of(variant, head):
        if SINKS:
            return variant[0][head] * float32(LOG2E)
        return NEG_INF

    @device_function
    def with_sink(m_i, l_i, sink):
        if not SINKS:
            return m_i, l_i, float32(1.0)
        m = max(m_i, sink)
        shift = shift_of(m)
        factor = ptx.exp2(m_i - shift)
        return m, l_i * factor + ptx.exp2(sink - shift), factor

    return sink_of, with_sink


@functools.lru_cache(maxsize=None)
def alibi_functions(alibi, sinks=False):
    """(``slope_of(variant, b, head, nheads, unit) -> slope``, ``biased(x, distance,
    slope)``) for a kernel compiled with ALiBi slopes (``alibi``, a compile-time flag) or
    without. The slopes are the kernel's ``*variant`` array after the sinks (``sinks``: the
    kernel has them; launch.variant_arrays' order), flat (nheads,) or (batch, nheads).

    ``slope_of``: sequence ``b``'s slope of head ``head`` (of ``nheads``) times ``unit``,
    the factor to the domain of the kernel's scores where it adds the bias: log2(e) for
    log2-domain scores, 1 / scale for raw ones (q . k, which the softmax's scale turns into
    the bias); 0 without ALiBi. ``biased``: score ``x`` less slope * |distance|, distance
    = q_idx - kv_idx as a float (exact to 2^24 positions); ``x`` itself without ALiBi. A
    masked score (-inf) stays -inf."""
    ALIBI = alibi
    INDEX = 1 if sinks else 0

    @device_function
    def slope_of(variant, b, head, nheads, unit):
        if ALIBI:
            slopes = variant[INDEX]
            i = b * nheads + head
            if i >= slopes.shape[0]:  # (nheads,): every sequence's
                i = head
            return slopes[i] * unit
        return float32(0.0)

    @device_function
    def biased(x, distance, slope):
        if ALIBI:
            return ptx.fma(-slope, abs(distance), x)
        return x

    return slope_of, biased


@device_function
def linear_alibi_step(slope, first_key, last_key, first_row, last_row, wl, wr):
    """(whether ALiBi is linear in the key over a tile, the bias's change from one key to
    the next there): keys first_key..last_key of a tile and rows whose positions among the
    keys are first_row..last_row, under window (wl, wr). Linear where every key a row sees
    is on one side of it: a causal mask (wr 0) or the keys before every row give +slope
    (-slope |q - k| = slope k - slope q), keys after every row (or wl 0) -slope; a tile the
    diagonal crosses is not linear. The forwards then add step * column to the scores and
    the rest, a row's offset, to its max and its exponent's shift (one fma a score, where
    |distance| takes two)."""
    below = wr == 0 or last_key <= first_row  # every seen key at or before its row
    linear = below or wl == 0 or first_key >= last_row  # ... or at or after it
    return linear, (slope if below else -slope)


@device_function
def raw_unit(scale_log2):
    """alibi_functions' ``unit`` for raw scores (q . k, scaled by ``scale_log2`` > 0 in the
    softmax): log2(e) / scale_log2 = 1 / scale, by rcp.approx (an IEEE division is a
    subroutine call, which made ptxas serialise the Hopper kernels' wgmma)."""
    return float32(LOG2E) * ptx.reciprocal(scale_log2)


@device_function
def ceil_div(a, b):
    return int32((a + b - 1) // b)


@device_function
def _ieee_inverse(x):
    return float32(1.0) / x


@functools.lru_cache(maxsize=None)
def softcap_functions(softcap, fast=False):
    """(``factors(scale_log2) -> (a, b)``, ``capped(x, a, b)``) for a softcap (> 0, a
    compile-time constant): a raw score x (q . k, before the scale) becomes b tanh(a x), with
    a = scale / softcap and b = 1 / a, which the softmax's scale by ``scale_log2`` (scale *
    log2(e)) turns into softcap * tanh(scale * q . k / softcap) in the log2 domain, so the
    kernels' softmax runs unchanged. A scale of 0 gives every score 0. Applied before the
    mask (the mask's -inf must stay -inf). ``fast``: tanh by the special-function unit
    (ptx.tanh, for the 16-bit kernels, as FlashAttention's); else libdevice's float32 tanh,
    which at head_dim 64 made the Hopper kernel keep a stack frame."""
    INV = float32(1.0 / (softcap * LOG2E))
    tanh = ptx.tanh if fast else math.tanh
    # 1 / a by rcp.approx in the 16-bit kernels: the IEEE division is a subroutine call, which
    # made ptxas serialise the Hopper backward's wgmma (remark C7509)
    inverse = ptx.reciprocal if fast else _ieee_inverse

    @device_function
    def factors(scale_log2):
        a = scale_log2 * INV
        return a, (inverse(a) if a != float32(0.0) else float32(0.0))

    @device_function
    def capped(x, a, b):
        return b * float32(tanh(a * x))

    return factors, capped


def softcap_function(count, softcap, folded=False):
    """``softcap_scores(s, scale_log2) -> unit``: softcap_functions' transform of the first
    ``count`` raw scores of the register fragment ``s`` of a 16-bit kernel (fast tanh), and
    the unit the softmax then multiplies them by into the log2 domain. ``folded``: the cap's
    outer factor b is left to that unit, s holding tanh(a x) and the unit being b *
    scale_log2 (softcap * log2(e)), one multiplication a score fewer (a kernel whose later
    steps read the scores in raw units, ALiBi's bias or a score_mod, cannot take it); else
    s holds b tanh(a x) and the unit is scale_log2."""
    factors, capped = softcap_functions(softcap, fast=True)
    FOLDED = folded

    @device_function
    def softcap_scores(s, scale_log2):
        a, b = factors(scale_log2)
        if FOLDED:
            for i in range(count):
                s[i] = ptx.tanh(a * s[i])
            return b * scale_log2
        for i in range(count):
            s[i] = capped(s[i], a, b)
        return scale_log2

    return softcap_scores


@functools.lru_cache(maxsize=None)
def softcap_gradient_functions(softcap, fast=False):
    """(softcap_functions' ``factors``, ``capped_and_slope(x, a, b) -> (b tanh(a x), 1 -
    tanh(a x)^2)``): a backward kernel's capped score, as its forward computed it, and the
    derivative of the cap at it, by which dS = P (dP - D) is multiplied."""
    factors, _ = softcap_functions(softcap, fast)
    tanh = ptx.tanh if fast else math.tanh

    @device_function
    def capped_and_slope(x, a, b):
        t = float32(tanh(a * x))
        return b * t, float32(1.0) - t * t

    return factors, capped_and_slope
