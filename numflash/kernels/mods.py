"""A user's score and mask functions (``score_mod``, ``mask_mod``), compiled into the kernels.

A call's :class:`numflash.validation.Mods` names them: Numba CUDA device functions

    score_mod(score, b, h, q_idx, kv_idx, *mod_args) -> the new score
    mask_mod(b, h, q_idx, kv_idx, *mod_args) -> whether the key is seen
    score_mod_derivative(score, b, h, q_idx, kv_idx, *mod_args) -> d score_mod / d score

with ``score`` = softmax_scale * q . k after the softcap and ALiBi, in natural units (the
kernels keep scores in the log2 domain and convert on the way in and out), ``q_idx`` the
query's position among the keys (row + seqlen_k - seqlen_q, the causal mask's alignment),
``kv_idx`` the key's, ``b`` the batch entry (a packed batch's sequence) and ``h`` the query
head, all int32; ``mod_args`` are the kernel's ``*variant`` arrays from the first mod
argument on (launch.variant_arrays' order). Each function is compiled again from its Python
function as an inlined device function (a user's ``cuda.jit(device=True)`` is a real call a
score otherwise), once per function.
"""

import collections
import functools

from numba import float32, int32

from .jit import device_function
from .softmax import LN2, LOG2E, NEG_INF


@functools.lru_cache(maxsize=None)
def inlined(fn):
    """``fn`` (a Numba CUDA device function, or its Python function) as an inlined device
    function of numflash's kernels."""
    return device_function(getattr(fn, "py_func", fn))


@device_function
def _seen(b, h, q_idx, kv_idx, *mod_args):
    return True


@device_function
def _unchanged(score, b, h, q_idx, kv_idx, *mod_args):
    return score


@device_function
def _unit(score, b, h, q_idx, kv_idx, *mod_args):
    return float32(1.0)


#: What mod_functions makes of a kernel's user functions (each described there).
ModFunctions = collections.namedtuple(
    "ModFunctions",
    "modded gradient modded_and_factor natural_modded natural_scored block_mask_at",
)


@functools.lru_cache(maxsize=None)
def mod_functions(mods, first):
    """The ModFunctions of a kernel compiled with ``mods`` (a validation.Mods, or None: the
    identity and 1), whose ``*variant`` arrays from index ``first`` on are the mod_args (and
    after them, with a block mask, its index: kernels/block_mask.py).

    ``modded(x, b, h, q_idx, kv_idx, variant) -> x'``: a score ``x`` the causal / window
    mask lets a query see (log2 domain) as the user's functions change it: -inf where
    mask_mod says the key is not seen, else score_mod's score (log2 domain).
    ``gradient(...)``: the factor by which dS of the modded score becomes dS of ``x``,
    score_mod_derivative at ``x`` (1 without a score_mod; a key masked by mask_mod has p =
    0, so its factor is never used); ``modded_and_factor(...)``: both.
    ``natural_modded``: ``modded`` of a score in natural units, returned in natural units (a
    kernel that scales its scores anyway saves the conversions); ``natural_scored``: the
    same without mask_mod (for keys a block mask says every row sees).
    ``block_mask_at``: where a block mask's index is among the ``*variant`` arrays, after
    the mod_args (a kernel takes it as ``variant[at:at + 1][0]``: a heterogeneous tuple
    takes constant slices, not indices, and a device function cannot return an array it
    took from a tuple)."""
    SCORE = mods is not None and mods.score_mod is not None
    MASK = mods is not None and mods.mask_mod is not None
    DERIVATIVE = mods is not None and mods.score_mod_derivative is not None
    score_mod = inlined(mods.score_mod) if SCORE else _unchanged
    mask_mod = inlined(mods.mask_mod) if MASK else _seen
    derivative = inlined(mods.score_mod_derivative) if DERIVATIVE else _unit
    FIRST = first
    END = first + (len(mods.kinds) if mods is not None else 0)  # the block mask's index there

    def natural_function(masked):
        @device_function
        def natural(score, b, h, q_idx, kv_idx, variant):
            b, h, q_idx, kv_idx = int32(b), int32(h), int32(q_idx), int32(kv_idx)
            if MASK and masked:
                if not mask_mod(b, h, q_idx, kv_idx, *variant[FIRST:END]):
                    return NEG_INF
            if SCORE:
                return float32(score_mod(score, b, h, q_idx, kv_idx, *variant[FIRST:END]))
            return score

        return natural

    natural_modded, natural_scored = natural_function(True), natural_function(False)

    @device_function
    def modded(x, b, h, q_idx, kv_idx, variant):
        if SCORE:
            return natural_modded(x * float32(LN2), b, h, q_idx, kv_idx, variant) * float32(LOG2E)
        return natural_modded(x, b, h, q_idx, kv_idx, variant)  # a mask alone: any unit

    @device_function
    def gradient(x, b, h, q_idx, kv_idx, variant):
        if DERIVATIVE:
            b, h, q_idx, kv_idx = int32(b), int32(h), int32(q_idx), int32(kv_idx)
            natural = x * float32(LN2)
            return float32(derivative(natural, b, h, q_idx, kv_idx, *variant[FIRST:END]))
        return float32(1.0)

    @device_function
    def modded_and_factor(x, b, h, q_idx, kv_idx, variant):
        """(modded, gradient) of one score; the factor 0 where the key is masked (p = 0
        there, and a derivative of no use might not be finite)."""
        y = modded(x, b, h, q_idx, kv_idx, variant)
        factor = float32(0.0)
        if y != NEG_INF:
            factor = gradient(x, b, h, q_idx, kv_idx, variant)
        return y, factor

    return ModFunctions(modded, gradient, modded_and_factor, natural_modded, natural_scored, END)
