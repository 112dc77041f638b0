"""The kernel parameter buffer of a replayed launch (numflash.launch.parameter_buffer), built
from Numba's one-slot-a-parameter packing at the driver's offsets."""

import struct

import pytest

from numflash import launch


def test_parameters_land_at_their_offsets_with_their_sizes():
    # an 8-byte pointer, a 4-byte int, a 4-byte float, an 8-byte int: one 8-byte slot each
    slots = struct.pack("=Qi4xf4xq", 0x1122334455667788, -5, 1.5, 7)
    layout = [(0, 8), (8, 4), (12, 4), (16, 8)]  # natural alignment, as the driver reports
    out = launch.parameter_buffer(slots, layout)
    assert len(out) == 24
    assert struct.unpack("=Qifq", out) == (0x1122334455667788, -5, 1.5, 7)


def test_the_buffer_is_padded_to_whole_8_byte_words():
    slots = struct.pack("=Qi4x", 1, 2)
    out = launch.parameter_buffer(slots, [(0, 8), (8, 4)])
    assert len(out) == 16 and out[12:] == bytes(4)


@pytest.mark.gpu  # kernel signatures are Numba types on a GPU (None in the simulator)
def test_numba_abi_sizes_of_the_kv_cache_kernel():
    # 13 arrays of seven 8-byte parameters, six (3,) int64 stride tuples and eleven 4-byte
    # scalars (ten int32 and the float32 scale): what cuFuncGetParamInfo must agree with
    fmt, kinds, sizes = launch._param_layout(launch.DECODE.signature("float16"))
    assert len(sizes) == sum(abs(k) for k in kinds) == 120
    assert struct.calcsize(fmt) == 8 * len(sizes)
    assert sizes.count(4) == 11 and sizes.count(8) == 109
