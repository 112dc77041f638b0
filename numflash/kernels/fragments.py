"""mma.sync m16n8k16 fragments: the per-dtype instructions and where each value lives.

A warp's fp32 accumulator of a 16 x 8 tile is four registers a lane (C layout): elements
``4 t + 2 h`` and ``4 t + 2 h + 1`` of tile ``t`` hold row ``lane // 4 + 8 h`` and columns
``2 (lane % 4)`` and ``+ 1``. Two adjacent accumulator tiles (16 x 16), rounded to 16 bits in
pairs, are the A fragment of the next product (P V, dS K, P^T dO): FlashAttention-2's trick of
keeping P in registers. wgmma's m64 accumulators repeat this layout for each warp of the
warpgroup, so the same helpers serve both.

The forward's two products (S = Q K^T, O += P V) keep their operand indices written out: with
these helpers there, NVVM stopped unrolling the head_dim 32 kernel fully for sm_100a and
sm_120 (48 of its 64 mma in the PTX; tests/test_compile.py counts them).
"""

from . import ptx
from .jit import device_function

#: The m16n8k16 product of each 16-bit input type, fp32 accumulators.
MMA = {"float16": ptx.mma_f16, "bfloat16": ptx.mma_bf16}
#: Two fp32 values rounded into one register of two 16-bit values (low, high).
PACK = {"float16": ptx.pack_f16x2, "bfloat16": ptx.pack_bf16x2}


@device_function
def tile_base(tile):
    """The first of this lane's four registers of fragment or accumulator tile ``tile``."""
    return tile * 4


@device_function
def accumulator_position(index, lane):
    """(row, column) within its warp's 16 x N accumulator of this lane's value ``index`` (mma.sync's
    C layout, repeated every 8 columns; wgmma's m64 accumulators repeat it per warp): row
    lane // 4 + 8 ((index >> 1) & 1), column 8 (index >> 2) + 2 (lane & 3) + (index & 1). With a
    constant ``index`` the offsets fold; masks and score modifiers find (q_idx, kv_idx) here."""
    return (lane >> 2) + 8 * ((index >> 1) & 1), 8 * (index >> 2) + 2 * (lane & 3) + (index & 1)


@device_function
def acc_index(tile, h):
    """The first of this lane's two elements of row half ``h`` (0: row lane // 4, 1: row
    lane // 4 + 8) in 8-column accumulator tile ``tile``."""
    return tile * 4 + 2 * h
