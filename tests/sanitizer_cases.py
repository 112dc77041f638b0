"""A small matrix of attention calls for compute-sanitizer (memcheck, racecheck) on a GPU.

    NUMFLASH_LINEINFO=1 compute-sanitizer --tool memcheck --report-api-errors no \\
        python tests/sanitizer_cases.py [--tensor-core-backward-only]

Every case runs the forward and then the backward pass from its outputs.

CuPy's memory pool would hide small overruns inside pooled blocks, so it is switched off: every
array is its own allocation. Each case is also checked against the reference.
"""

import sys

import cupy

cupy.cuda.set_allocator(None)

import numflash  # noqa: E402
from numflash.config import (  # noqa: E402
    PortableConfig,
    TensorCoreBackwardConfig,
    TensorCoreConfig,
    WgmmaBackwardConfig,
)
from numflash.device import current_device  # noqa: E402

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from support import (  # noqa: E402
    assert_gradients_match,
    assert_matches_reference,
    poisoned_like,
    random_array,
    random_qkv,
)

CASES = [
    # dtype, batch, seqlen_q, seqlen_k, nheads, nheads_k, head_dim, mask kwargs, config
    ("float16", 1, 77, 130, 2, 1, 64, dict(causal=True), None),
    ("bfloat16", 2, 130, 77, 2, 2, 128, dict(), None),
    ("float16", 1, 65, 65, 4, 2, 40, dict(window_size=(16, 8)), None),
    ("bfloat16", 1, 33, 200, 2, 1, 256, dict(causal=True), None),
    ("float16", 1, 100, 100, 2, 1, 64, dict(), TensorCoreConfig(128, 64, 4, 3, True)),
    ("float16", 1, 100, 100, 2, 1, 128, dict(causal=True), TensorCoreConfig(128, 32, 4, 2, False)),
    ("float32", 1, 70, 45, 2, 1, 96, dict(causal=True), PortableConfig()),
]


#: The tensor-core backward, forced: atomic dQ (two stages, one stage, split by columns), the
#: dQ kernel, head_dim split over two blocks, the blocks' order reversed.
TC_BACKWARD = [
    (
        "float16",
        1,
        77,
        130,
        2,
        1,
        64,
        dict(causal=True),
        TensorCoreBackwardConfig(64, 8, 2, dq_separate=False),
    ),
    ("bfloat16", 2, 130, 77, 2, 2, 128, dict(), TensorCoreBackwardConfig(64, 8, 2, False)),
    (
        "float16",
        1,
        65,
        65,
        4,
        2,
        40,
        dict(window_size=(16, 8)),
        TensorCoreBackwardConfig(16, 1, 1, False),
    ),
    (
        "bfloat16",
        1,
        200,
        150,
        2,
        1,
        96,
        dict(causal=True),
        TensorCoreBackwardConfig(32, 4, 2, False),
    ),
    (
        "float16",
        2,
        150,
        201,
        4,
        2,
        128,
        dict(causal=True),
        TensorCoreBackwardConfig(64, 8, 2, dq_separate=True),
    ),
    (
        "bfloat16",
        1,
        90,
        70,
        2,
        1,
        64,
        dict(window_size=(9, 4)),
        TensorCoreBackwardConfig(32, 2, 1, dq_separate=True),
    ),
    (
        "bfloat16",
        1,
        100,
        180,
        2,
        1,
        256,
        dict(causal=True),
        TensorCoreBackwardConfig(32, 4, 2, False, 2),
    ),
    ("float16", 1, 70, 90, 2, 2, 160, dict(), TensorCoreBackwardConfig(32, 4, 2, True, 2)),
    # a left window alone: the dK/dV kernel's key blocks run from the last
    (
        "float16",
        1,
        90,
        120,
        2,
        1,
        64,
        dict(window_size=(20, -1)),
        TensorCoreBackwardConfig(32, 2, 2, dq_separate=True),
    ),
    # the Hopper wgmma kernels (compute capability 9.x only): two warpgroups and one, both
    # stage counts, head_dim 128 and 64, a left window alone
    (
        "float16",
        2,
        150,
        201,
        4,
        2,
        128,
        dict(causal=True),
        WgmmaBackwardConfig(num_warps=8, stages=2),
    ),
    (
        "bfloat16",
        1,
        90,
        70,
        2,
        1,
        64,
        dict(window_size=(9, 4)),
        WgmmaBackwardConfig(num_warps=4, stages=1),
    ),
    (
        "float16",
        1,
        90,
        200,
        2,
        1,
        128,
        dict(window_size=(20, -1)),
        WgmmaBackwardConfig(num_warps=8, stages=1),
    ),
]


def main(cases=CASES):
    for dtype, b, sq, sk, h, hk, d, mask, cfg in cases:
        q, k, v = random_qkv(b, sq, sk, h, hk, d, dtype)
        out = poisoned_like(q)
        _, lse = numflash.attention(q, k, v, out=out, return_lse=True, config=cfg, **mask)
        cupy.cuda.Device().synchronize()
        assert_matches_reference(q, k, v, out, lse, **mask)
        dout = random_array(q.shape, dtype)
        dq, dk, dv = numflash.attention_backward(dout, q, k, v, out, lse, **mask)
        cupy.cuda.Device().synchronize()
        assert_gradients_match(dout, q, k, v, dq, dk, dv, **mask)
        print(f"ok {dtype} b{b} q{sq} k{sk} h{h}/{hk} d{d} {mask} {cfg}", flush=True)
    for dtype, b, sq, sk, h, hk, d, mask, cfg in TC_BACKWARD:
        if cfg.wgmma and not current_device().has_wgmma:
            print(f"skipped (no wgmma here) {cfg}", flush=True)
            continue
        q, k, v = random_qkv(b, sq, sk, h, hk, d, dtype)
        out, lse = numflash.attention(q, k, v, return_lse=True, **mask)
        dout = random_array(q.shape, dtype)
        dq, dk, dv = numflash.attention_backward(dout, q, k, v, out, lse, config=cfg, **mask)
        cupy.cuda.Device().synchronize()
        assert_gradients_match(dout, q, k, v, dq, dk, dv, **mask)
        print(f"ok backward {dtype} b{b} q{sq} k{sk} h{h}/{hk} d{d} {mask} {cfg}", flush=True)


if __name__ == "__main__":
    main([] if "--tensor-core-backward-only" in sys.argv else CASES)
