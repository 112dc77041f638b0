"""numflash.attention_backward against float64 reference gradients, and its argument checks."""

import numpy as np
import pytest
from support import (
    assert_gradients_match,
    random_array,
    random_qkv,
    to_numpy,
    wgmma_or_skip,
    xp,
)
from support.nvrtc import assert_compiles

import numflash
from numflash.arrays import to_float64
from numflash.reference import attention_backward_reference, attention_reference

MASKS = {
    "none": dict(),
    "causal": dict(causal=True),
    "window": dict(window_size=(5, 3)),
    "left": dict(window_size=(20, -1)),
    "right": dict(window_size=(-1, 157)),
}  # a left window alone: the dK/dV blocks reversed


def _run(q, k, v, mask, **kw):
    """Forward with numflash, a fresh random dout, numflash's backward; returns all of it."""
    out, lse = numflash.attention(q, k, v, return_lse=True, **mask)
    dout = random_array(q.shape, q.dtype)
    dq, dk, dv = numflash.attention_backward(dout, q, k, v, out, lse, **mask, **kw)
    return dout, dq, dk, dv


# -- the reference itself --------------------------------------------------------------------------


@pytest.mark.parametrize("mask", [dict(causal=True), dict(window_size=(2, 1)), dict()])
def test_reference_gradients_match_finite_differences(mask):
    """The float64 reference is the derivative of the float64 forward (GQA, masks, empty rows)."""
    rng = np.random.default_rng(7)
    q, dout = (rng.standard_normal((1, 6, 4, 3)) for _ in range(2))
    k, v = (rng.standard_normal((1, 4, 2, 3)) for _ in range(2))  # seqlen_q > seqlen_k
    kw = dict(softmax_scale=0.8, **mask)
    grads = attention_backward_reference(dout, q, k, v, **kw)

    def loss(**args):
        return float((attention_reference(**args, **kw)[0] * dout).sum())

    eps = 1e-6
    for name, x, grad in zip("qkv", (q, k, v), grads):
        numeric = np.zeros_like(x)
        for idx in np.ndindex(x.shape):
            plus, minus = x.copy(), x.copy()
            plus[idx] += eps
            minus[idx] -= eps
            args = dict(q=q, k=k, v=v)
            numeric[idx] = (loss(**{**args, name: plus}) - loss(**{**args, name: minus})) / (
                2 * eps
            )
        assert np.abs(numeric - grad).max() < 1e-7, name


# -- the kernels -----------------------------------------------------------------------------------

SIM_CASES = [
    ("float32", 16, 1, 1, 1, "none"),
    ("float16", 16, 7, 33, 2, "causal"),
    ("bfloat16", 16, 33, 7, 1, "window"),
    ("float16", 40, 33, 20, 2, "none"),
    ("float32", 8, 20, 33, 4, "causal"),
    ("bfloat16", 24, 17, 17, 1, "causal"),
]


@pytest.mark.parametrize("dtype,head_dim,seqlen_q,seqlen_k,gqa,mask", SIM_CASES)
def test_backward_matches_reference(dtype, head_dim, seqlen_q, seqlen_k, gqa, mask):
    q, k, v = random_qkv(2, seqlen_q, seqlen_k, 2 * gqa, 2, head_dim, dtype)
    cfg = numflash.PortableBackwardConfig(block_m=16, block_n=16)
    dout, dq, dk, dv = _run(q, k, v, MASKS[mask], config=cfg)
    assert_gradients_match(dout, q, k, v, dq, dk, dv, **MASKS[mask])


def test_rows_without_keys_contribute_nothing():
    # causal with seqlen_q > seqlen_k: the first rows see no key
    q, k, v = random_qkv(1, 12, 5, 2, 1, 8, "float32")
    dout, dq, dk, dv = _run(
        q, k, v, dict(causal=True), config=numflash.PortableBackwardConfig(16, 16)
    )
    assert bool((to_numpy(dq)[:, :7] == 0).all())
    assert_gradients_match(dout, q, k, v, dq, dk, dv, causal=True)


def test_keys_no_row_sees_get_zero_gradients():
    q, k, v = random_qkv(1, 4, 9, 1, 1, 8, "float32")
    dout, dq, dk, dv = _run(q, k, v, dict(window_size=(1, 0)))
    # query i sees keys i+4 and i+5 only: keys 0..3 are never seen
    assert bool((to_numpy(dk)[:, :4] == 0).all()) and bool((to_numpy(dv)[:, :4] == 0).all())
    assert_gradients_match(dout, q, k, v, dq, dk, dv, window_size=(1, 0))


def test_empty_sequences_give_zero_gradients():
    q, k, v = random_qkv(1, 3, 0, 2, 2, 8, "float16")
    out = xp.zeros(q.shape, dtype=q.dtype)
    lse = xp.full((1, 2, 3), -np.inf, dtype=np.float32)
    dq, dk, dv = numflash.attention_backward(random_array(q.shape, q.dtype), q, k, v, out, lse)
    assert dq.shape == q.shape and dk.shape == k.shape
    assert bool((to_float64(dq) == 0).all())


def test_strided_inputs_and_softmax_scale():
    q, k, v = (random_array((1, 2, 19, 16), "float16").transpose(0, 2, 1, 3) for _ in range(3))
    kw = dict(causal=True, softmax_scale=-0.4)
    out, lse = numflash.attention(q, k, v, return_lse=True, **kw)
    dout = random_array((1, 2, 19, 16), "float16").transpose(0, 2, 1, 3)
    dq, dk, dv = numflash.attention_backward(
        dout, q, k, v, out, lse, **kw, config=numflash.PortableBackwardConfig(16, 16)
    )
    assert_gradients_match(dout, q, k, v, dq, dk, dv, **kw)


# -- the tensor-core kernel --------------------------------------------------------------------------

TC = numflash.TensorCoreBackwardConfig  # TC(block_m, num_warps, stages, dq_separate)
WG = numflash.WgmmaBackwardConfig
#: the tiles through an mbarrier ring, two warpgroups: unsynchronised, and taking turns
RING = WG(num_warps=8, stages=3, ring=True)
PINGPONG = WG(8, 3, ring=True, pingpong=True)
#: the ring with pingpong turns adding dQ up in the dK/dV kernel (a third turn a query block)
RING_DQ = WG(8, 3, dq_separate=False, ring=True, pingpong=True)
RING_DQ_TMA = WG(8, 3, dq_separate=False, ring=True, pingpong=True, tma=True)
#: sm_90.json's tuned Hopper backward entries: the ring by TMA, A rounded before the wgmma
#: fence, the warpgroups not taking turns (128-row tiles at head_dim 64)
TUNED = WG(8, 3, pack_first=True, ring=True, tma=True)
TUNED_64 = WG(8, 3, pack_first=True, ring=True, tma=True, block_m=128)
#: 128-row tiles through the ring filled by TMA (head_dim 64)
TMA_128 = WG(8, 3, ring=True, pingpong=True, tma=True, block_m=128)

TC_SIM_CASES = [
    ("float16", 16, 9, 21, 1, "none", TC(16, 1, 2, False)),
    ("bfloat16", 32, 20, 13, 2, "causal", TC(32, 2, 2, False)),
    ("float16", 24, 17, 17, 2, "window", TC(16, 1, 2, False)),
    ("bfloat16", 16, 33, 7, 2, "causal", TC(16, 1, 2, False)),  # the first rows see no key
    ("float16", 16, 70, 80, 2, "causal", TC(64, 4, 2, False)),  # several query blocks, two stages
    ("bfloat16", 32, 45, 40, 2, "none", TC(32, 4, 1, False)),  # dQ split by columns; one stage
    ("float16", 32, 50, 70, 1, "causal", TC(32, 4, 2, False)),  # dQ split by columns; two stages
    # dQ from the separate kernel (deterministic): several key tiles, both stage counts
    ("float16", 16, 40, 75, 2, "causal", TC(16, 2, 2, True)),
    ("bfloat16", 32, 37, 30, 2, "window", TC(32, 1, 1, True)),
    ("float16", 16, 9, 33, 1, "none", TC(16, 1, 2, True)),
    ("float16", 16, 20, 50, 1, "none", TC(16, 1, 1, True)),  # one stage over four key tiles
    # tiles that need no mask (all of them; those below the diagonal)
    ("bfloat16", 16, 64, 48, 1, "none", TC(16, 1, 1, False)),
    ("float16", 16, 64, 64, 2, "causal", TC(16, 1, 2, False)),
    # the same with the dQ kernel, two warps: some warps see their whole tile, others not
    ("float16", 16, 64, 96, 2, "none", TC(32, 2, 2, True)),
    ("bfloat16", 32, 64, 64, 1, "causal", TC(32, 2, 2, True)),
    # a left window alone (the dK/dV kernel's key blocks run last first), several key blocks
    ("float16", 16, 50, 60, 1, "left", TC(16, 1, 2, True)),
    ("bfloat16", 16, 40, 40, 2, "left", TC(16, 1, 1, False)),
    # two blocks per key block, each with half of the output columns (as head_dim 256 needs)
    ("float16", 32, 21, 30, 2, "causal", TC(16, 1, 2, False, head_split=2)),
    ("bfloat16", 64, 40, 33, 1, "window", TC(32, 2, 1, True, head_split=2)),
    # the Hopper wgmma kernels (kernels/backward_sm90.py; in the simulator ptx_sm90's Python
    # wgmma reads their swizzled tiles)
    ("float16", 64, 70, 80, 2, "causal", WG(num_warps=8, stages=2)),  # two query blocks
    ("bfloat16", 64, 40, 150, 1, "window", WG(num_warps=4, stages=1)),  # three key blocks
    ("bfloat16", 128, 65, 33, 1, "none", WG(num_warps=4, stages=2)),  # two head_dim atoms
    ("float16", 64, 50, 60, 2, "left", WG(num_warps=4, stages=2)),  # key blocks last first
    ("bfloat16", 64, 70, 80, 1, "causal", WG(num_warps=4, stages=2, pack_first=True)),
    # dQ added up by the dK/dV kernel on wgmma (dq_separate=False; by bulk reductions, the
    # atomics on the GPU: TC_GPU_CASES), each warpgroup's share of its columns: 32 at a
    # 64-byte offset into the atom, 64 an atom (one warpgroup's share: TC_GPU_CASES)
    ("float16", 64, 70, 80, 2, "causal", WG(num_warps=8, stages=2, dq_separate=False)),
    ("bfloat16", 128, 40, 75, 2, "left", WG(num_warps=8, stages=1, dq_separate=False)),
    # the tiles through an mbarrier ring of three slots: four query blocks (dK/dV kernel), and
    # five key tiles (dQ kernel), so each wraps around the ring; the two warpgroups taking
    # turns with their products (pingpong) in the first
    ("float16", 64, 200, 40, 1, "none", WG(num_warps=8, stages=3, ring=True, pingpong=True)),
    ("bfloat16", 64, 40, 260, 1, "causal", WG(num_warps=4, stages=3, ring=True)),
    # ... adding dQ up in the dK/dV kernel: three query blocks, so a dS tile is rewritten
    ("bfloat16", 64, 130, 40, 1, "causal", RING_DQ),
    # ... filled by TMA boxes (ptx_tma's simulated copy): four query blocks, so the ring wraps
    # around, the last and the dQ kernel's key tile zero-filled past the end; the blocks start
    # at rows 3, 67, ..., so their LSE and D runs are copied from 3 rows before (a 16-byte
    # boundary of the padded buffers)
    ("float16", 64, 200, 40, 1, "right", WG(num_warps=4, stages=3, ring=True, tma=True)),
    # 128-row tiles (head_dim 64, through the ring), each short: one query block of 100 rows
    # (dK/dV kernel), a key tile of 100 keys (dQ kernel); with 64-row steps alone dQ is off
    ("bfloat16", 64, 100, 100, 1, "causal", WG(8, 3, ring=True, pingpong=True, block_m=128)),
    ("float16", 64, 100, 100, 1, "causal", TUNED_64),  # sm_90.json's head_dim 64 entries
]


@pytest.mark.parametrize("dtype,head_dim,seqlen_q,seqlen_k,gqa,mask,tiles", TC_SIM_CASES)
def test_tensor_core_backward_matches_reference(
    dtype, head_dim, seqlen_q, seqlen_k, gqa, mask, tiles
):
    """The tensor-core kernels' own source (mma.sync, and wgmma where asked), in the simulator
    on CI and on the GPU."""
    cfg = wgmma_or_skip(tiles)
    q, k, v = random_qkv(1, seqlen_q, seqlen_k, gqa, 1, head_dim, dtype)
    dout, dq, dk, dv = _run(q, k, v, MASKS[mask], config=cfg)
    assert_gradients_match(dout, q, k, v, dq, dk, dv, **MASKS[mask])


TC_GPU_CASES = [
    pytest.param(
        dtype, hd, sq, sk, gqa, mask, tiles, id=f"{dtype}-d{hd}-q{sq}-k{sk}-g{gqa}-{mask}-{tiles}"
    )
    for dtype, hd, (sq, sk), gqa, mask, tiles in [
        ("float16", 64, (1023, 517), 1, "causal", TC(64, 4, 2, False)),
        ("bfloat16", 128, (256, 256), 2, "none", TC(64, 4, 2, False)),
        ("float16", 128, (113, 203), 4, "window", TC(32, 2, 2, False)),
        ("bfloat16", 96, (517, 1023), 1, "causal", TC(128, 8, 2, False)),
        ("float16", 40, (300, 300), 2, "none", TC(64, 2, 2, False)),
        ("bfloat16", 64, (300, 451), 1, "window", TC(32, 4, 1, False)),  # 1 stage, dQ split by cols
        ("float16", 128, (777, 777), 2, "causal", TC(64, 8, 1, False)),
        ("bfloat16", 128, (1023, 517), 2, "causal", TC(64, 8, 2, True)),  # the dQ kernel
        ("float16", 64, (300, 451), 1, "window", TC(128, 4, 2, True)),
        ("float16", 96, (113, 203), 4, "none", TC(32, 2, 1, True)),
        # head_dim 256
        ("bfloat16", 256, (517, 1023), 2, "causal", TC(32, 4, 2, False, head_split=2)),
        # padded to 224
        ("float16", 200, (300, 300), 1, "window", TC(32, 4, 2, True, head_split=2)),
        ("float16", 128, (777, 777), 2, "none", TC(64, 4, 2, False, head_split=2)),
        # dK/dV from the Hopper wgmma kernel (compute capability 9.x only)
        ("float16", 128, (1023, 517), 2, "causal", WG(num_warps=8, stages=2)),
        ("bfloat16", 128, (777, 777), 1, "none", WG(num_warps=8, stages=1)),
        ("bfloat16", 120, (113, 203), 4, "window", WG(num_warps=8, stages=2)),  # padded to 128
        ("float16", 64, (300, 451), 2, "window", WG(num_warps=4, stages=2)),
        ("bfloat16", 64, (517, 1023), 1, "left", WG(num_warps=8, stages=2)),
        ("float16", 128, (2048, 2048), 1, "causal", WG(num_warps=4, stages=2)),
        # the A fragments rounded before the wgmma fence
        ("float16", 128, (1023, 517), 2, "causal", WG(num_warps=8, stages=2, pack_first=True)),
        ("bfloat16", 64, (300, 451), 1, "window", WG(num_warps=8, stages=1, pack_first=True)),
        # dQ added up by the dK/dV kernel: bulk reductions (dq_bulk), and atomics
        ("float16", 128, (1023, 517), 2, "causal", WG(num_warps=8, stages=2, dq_separate=False)),
        ("bfloat16", 120, (113, 203), 4, "window", WG(num_warps=8, stages=1, dq_separate=False)),
        ("bfloat16", 64, (517, 1023), 1, "left", WG(num_warps=4, stages=2, dq_separate=False)),
        ("float16", 64, (2048, 2048), 2, "none", WG(num_warps=8, stages=2, dq_separate=False)),
        ("bfloat16", 128, (777, 777), 2, "causal", WG(8, 2, dq_separate=False, dq_bulk=False)),
        ("float16", 64, (300, 451), 1, "window", WG(4, 1, dq_separate=False, dq_bulk=False)),
        # the tiles through an mbarrier ring (the warpgroups unsynchronised)
        ("bfloat16", 128, (1023, 517), 2, "causal", RING),
        ("float16", 64, (517, 1023), 1, "window", RING),
        ("float16", 128, (777, 777), 2, "none", RING),
        ("bfloat16", 64, (300, 451), 1, "left", WG(num_warps=4, stages=3, ring=True)),
        # ... the warpgroups taking turns with their products (pingpong)
        ("bfloat16", 128, (1023, 517), 2, "causal", PINGPONG),
        ("float16", 64, (517, 1023), 1, "window", PINGPONG),
        ("float16", 128, (777, 777), 2, "none", PINGPONG),
        # ... and dQ added up in the dK/dV kernel, in a third turn
        ("bfloat16", 128, (1023, 517), 2, "causal", RING_DQ),
        ("float16", 64, (517, 1023), 1, "window", RING_DQ),
        ("float16", 128, (777, 777), 2, "none", RING_DQ),
        ("bfloat16", 64, (2048, 2048), 1, "left", RING_DQ),
        # ... the ring's tiles by TMA
        ("bfloat16", 128, (1023, 517), 2, "causal", WG(8, 3, ring=True, pingpong=True, tma=True)),
        ("float16", 64, (517, 1023), 1, "window", WG(8, 3, ring=True, pingpong=True, tma=True)),
        ("float16", 128, (777, 777), 2, "none", WG(8, 3, ring=True, tma=True)),
        ("bfloat16", 64, (300, 451), 1, "left", WG(4, 3, ring=True, tma=True)),
        # sm_90.json's tuned entries
        ("float16", 64, (517, 1023), 2, "causal", TUNED_64),
        ("bfloat16", 64, (777, 777), 1, "window", WG(8, 3, ring=True, tma=True, block_m=128)),
        ("float16", 128, (1023, 517), 4, "causal", TUNED),
        ("bfloat16", 128, (1023, 517), 2, "causal", RING_DQ_TMA),
        ("float16", 64, (2048, 2048), 1, "left", RING_DQ_TMA),
        # 128-row tiles at head_dim 64: the ring by cp.async (pingpong or not) and by TMA
        ("bfloat16", 64, (1023, 517), 2, "causal", WG(8, 3, ring=True, pingpong=True, block_m=128)),
        ("float16", 64, (777, 777), 2, "none", WG(8, 3, ring=True, block_m=128)),
        ("float16", 64, (300, 451), 1, "left", WG(8, 3, ring=True, tma=True, block_m=128)),
        ("float16", 64, (517, 1023), 1, "window", TMA_128),
        ("bfloat16", 64, (2048, 2048), 1, "causal", TMA_128),
    ]
]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,head_dim,seqlen_q,seqlen_k,gqa,mask,tiles", TC_GPU_CASES)
def test_tensor_core_backward_on_gpu(dtype, head_dim, seqlen_q, seqlen_k, gqa, mask, tiles):
    cfg = wgmma_or_skip(tiles)
    q, k, v = random_qkv(2, seqlen_q, seqlen_k, 2 * gqa, 2, head_dim, dtype)
    dout, dq, dk, dv = _run(q, k, v, MASKS[mask], config=cfg)
    assert_gradients_match(dout, q, k, v, dq, dk, dv, **MASKS[mask])


@pytest.mark.parametrize("mask", ["causal", "left"])
def test_blocks_in_heavy_group_order_match_reference(mask):
    """Blocks started in groups of (head, batch) pairs, heaviest rows first across a group
    (backward_mma.build_kernels' heavy_group; the library's is 8): 3 heads x 2 batches in
    groups of 4, the second group partial, for both kernels."""
    from numflash import launch
    from numflash.kernels import backward_mma
    from numflash.reference import check_backward
    from numflash.validation import problem

    q, k, v = random_qkv(2, 40, 36, 3, 3, 16, "bfloat16")
    out, lse = numflash.attention(q, k, v, return_lse=True, **MASKS[mask])
    dout = random_array(q.shape, "bfloat16")
    *_, p = problem(
        q, k, v, MASKS[mask].get("causal", False), None, MASKS[mask].get("window_size", (-1, -1))
    )
    kernels = backward_mma.build_kernels(16, "bfloat16", 16, 1, 2, True, heavy_group=4)
    cfg = numflash.TensorCoreBackwardConfig(16, 1, 2, True)
    dq, dk, dv = (xp.empty(x.shape, x.dtype) for x in (q, k, v))

    def launchers(head_dim, varlen, tma=False):  # (mma.sync: no TMA)
        assert not varlen
        key = ("heavy_group=4", head_dim)
        return (
            launch.launcher(
                key + ("dkdv",), lambda: kernels.dkdv, launch.TENSOR_CORE_DKDV, "bfloat16"
            ),
            launch.launcher(key + ("dq",), lambda: kernels.dq, launch.DQ, "bfloat16"),
        )

    launch.tensor_core_backward(cfg, launchers, p, dout, q, k, v, out, lse, dq, dk, dv)
    for result in check_backward(dout, q, k, v, dq, dk, dv, **MASKS[mask]):
        assert result.nan == 0 and result.err <= result.bar, result


def test_tensor_core_backward_with_separate_dq_is_deterministic(fwd):
    cfg = numflash.TensorCoreBackwardConfig(16, 1, dq_separate=True)
    first = _call(fwd, config=cfg, deterministic=True)
    for a, b in zip(first, _call(fwd, config=cfg, deterministic=True)):
        assert bool((a.view(xp.uint16) == b.view(xp.uint16)).all())
    assert_gradients_match(fwd["dout"], fwd["q"], fwd["k"], fwd["v"], *first)


def test_tensor_core_backward_refuses_what_it_cannot_do(fwd):
    with pytest.raises(ValueError, match="deterministic=True needs dq_separate=True"):
        _call(
            fwd,
            config=numflash.TensorCoreBackwardConfig(16, 1, dq_separate=False),
            deterministic=True,
        )
    with pytest.raises(ValueError, match="wgmma-backward with dq_separate=False adds dQ up"):
        _call(fwd, config=WG(dq_separate=False), deterministic=True)
    q32 = random_array((1, 5, 2, 8), "float32")
    k32, v32 = (random_array((1, 6, 1, 8), "float32") for _ in range(2))
    with pytest.raises(TypeError, match="tensor-core backward takes float16 or bfloat16"):
        _call(
            fwd,
            q=q32,
            k=k32,
            v=v32,
            dout=q32,
            out=q32,
            config=numflash.TensorCoreBackwardConfig(16, 1),
        )
    with pytest.raises(ValueError, match="2 warps cannot share dQ's 1 row tiles x 2 column"):
        _call(fwd, config=numflash.TensorCoreBackwardConfig(16, 2, dq_separate=False))
    big = dict(
        q=random_array((1, 5, 2, 256), "float16"),
        dout=random_array((1, 5, 2, 256), "float16"),
        out=random_array((1, 5, 2, 256), "float16"),
        k=random_array((1, 6, 1, 256), "float16"),
        v=random_array((1, 6, 1, 256), "float16"),
    )
    with pytest.raises(
        ValueError,
        match="head_dim=256 with head_split=1: each block's 256/1 "
        "columns must be a multiple of 16 in \\[16, 128\\]",
    ):
        _call(fwd, **big, config=numflash.TensorCoreBackwardConfig(16, 1))


# -- on the GPU ------------------------------------------------------------------------------------

GPU_CASES = [
    pytest.param(dtype, hd, sq, sk, gqa, mask, id=f"{dtype}-d{hd}-q{sq}-k{sk}-g{gqa}-{mask}")
    for i, (dtype, hd, (sq, sk)) in enumerate(
        (dtype, hd, seqlens)
        for dtype in ("float16", "bfloat16")
        for hd in (32, 64, 96, 128, 256)
        for seqlens in ((113, 203), (256, 256), (1023, 517))
    )
    for gqa in ((1, 2, 4)[i % 3],)
    for mask in (list(MASKS)[(i // 3) % 3],)
]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,head_dim,seqlen_q,seqlen_k,gqa,mask", GPU_CASES)
def test_backward_matches_reference_on_gpu(dtype, head_dim, seqlen_q, seqlen_k, gqa, mask):
    q, k, v = random_qkv(2, seqlen_q, seqlen_k, 2 * gqa, 2, head_dim, dtype)
    _poison_pool()
    dout, dq, dk, dv = _run(q, k, v, MASKS[mask])
    assert_gradients_match(dout, q, k, v, dq, dk, dv, **MASKS[mask])


def _poison_pool(nbytes=64 << 20):
    """Fill freed pool memory with NaN bits, so that gradients the kernels fail to write (they
    come out of the same pool) show up as NaN."""
    import cupy

    block = cupy.full(nbytes // 4, 0x7FC07FC0, dtype=cupy.uint32)
    del block


@pytest.mark.gpu
@pytest.mark.parametrize(
    "config", [None, numflash.PortableBackwardConfig()], ids=["default-tensor-core", "portable"]
)
def test_backward_is_deterministic(config):
    q, k, v = random_qkv(2, 777, 777, 8, 2, 128, "bfloat16")
    dout, *first = _run(q, k, v, dict(causal=True), deterministic=True, config=config)
    out, lse = numflash.attention(q, k, v, causal=True, return_lse=True)
    assert_gradients_match(dout, q, k, v, *first, causal=True)
    for _ in range(20):
        again = numflash.attention_backward(
            dout, q, k, v, out, lse, causal=True, deterministic=True, config=config
        )
        for a, b in zip(first, again):
            assert bool((a.view(xp.uint16) == b.view(xp.uint16)).all())


def _long_context_reference(q, k, v, dout, key_slices, chunk=1 << 16):
    """float64 gradients of causal attention (one batch entry, no GQA) over many keys, the keys
    taken ``chunk`` at a time so that k and v are never whole in float64: (dq, [(dk, dv) of
    each slice of ``key_slices``]), in numflash's layouts."""
    sq, sk, heads, d = q.shape[1], k.shape[1], q.shape[2], q.shape[3]
    scale = 1.0 / np.sqrt(d)
    q64, do64 = (to_float64(x)[0].transpose(1, 0, 2) for x in (q, dout))  # (heads, sq, d)
    rows = xp.arange(sq)[:, None] + (sk - sq)  # row i sees keys j <= i + sk - sq

    def scores(keys):
        kc = to_float64(k[0, keys]).transpose(1, 0, 2)
        s = xp.einsum("hqd,hkd->hqk", q64, kc) * scale
        return xp.where(xp.arange(keys.start, keys.stop)[None, :] <= rows, s, -np.inf)

    chunks = [slice(c, min(c + chunk, sk)) for c in range(0, sk, chunk)]
    top, total = xp.full((heads, sq), -np.inf), xp.zeros((heads, sq))
    for keys in chunks:  # the rows' log-sum-exp
        s = scores(keys)
        new_top = xp.maximum(top, s.max(axis=-1))
        total = total * xp.exp(top - new_top) + xp.exp(s - new_top[..., None]).sum(axis=-1)
        top = new_top
    lse = (top + xp.log(total))[..., None]

    def step(keys):  # (p, dp, vc, kc) of a slice of keys
        kc, vc = (to_float64(x[0, keys]).transpose(1, 0, 2) for x in (k, v))
        p = xp.exp(scores(keys) - lse)
        return p, xp.einsum("hqd,hkd->hqk", do64, vc), kc

    delta = sum((p * dp).sum(axis=-1, keepdims=True) for p, dp, _ in map(step, chunks))
    dq = xp.zeros_like(q64)
    for keys in chunks:
        p, dp, kc = step(keys)
        dq += xp.einsum("hqk,hkd->hqd", p * (dp - delta), kc) * scale
    slices = []
    for keys in key_slices:
        p, dp, _ = step(keys)
        dv = xp.einsum("hqk,hqd->khd", p, do64)
        dk = xp.einsum("hqk,hqd->khd", p * (dp - delta), q64) * scale
        slices.append((dk, dv))
    return dq.transpose(1, 0, 2)[None], slices


@pytest.mark.gpu
@pytest.mark.slow
def test_backward_over_keys_past_2_31_elements():
    """16 query rows over 2^20 + 64 keys of 16 heads at head_dim 128 (bf16, causal, the
    default kernels: at head_dim 128 the TMA ring): k, v, dk and dv hold more than 2^31
    elements, so every index past there must be 64-bit. dQ (a sum over every key) against the
    float64 reference, and dK, dV of the first 64 keys and of the last 64, whose every element
    lies past 2^31; the bar is 2^-5 of the reference's largest magnitude, far below what a
    wrong index gives and above bf16's rounding of sums in fp32."""
    heads, head_dim, seqlen_k = 16, 128, (1 << 20) + 64
    assert (seqlen_k - 64) * heads * head_dim >= 2**31
    q, k, v = random_qkv(1, 16, seqlen_k, heads, heads, head_dim, "bfloat16")
    dout, dq, dk, dv = _run(q, k, v, MASKS["causal"])
    ends = (slice(0, 64), slice(seqlen_k - 64, seqlen_k))
    ref_dq, ref_slices = _long_context_reference(q, k, v, dout, ends)
    pairs = [("dq", dq[0], ref_dq[0])]
    for keys, (ref_dk, ref_dv) in zip(ends, ref_slices):
        pairs += [(f"dk[{keys}]", dk[0, keys], ref_dk), (f"dv[{keys}]", dv[0, keys], ref_dv)]
    for name, grad, ref in pairs:
        grad = to_float64(grad)
        err, bar = float(abs(grad - ref).max()), 2**-5 * float(abs(ref).max())
        assert not bool(xp.isnan(grad).any()) and err <= bar, f"{name}: {err:.3e} > {bar:.3e}"


# -- validation ------------------------------------------------------------------------------------


@pytest.fixture
def fwd():
    q, k, v = random_qkv(1, 5, 6, 2, 1, 8, "float16")
    out, lse = numflash.attention(q, k, v, return_lse=True)
    return dict(dout=random_array(q.shape, "float16"), q=q, k=k, v=v, out=out, lse=lse)


def _call(fwd, **changes):
    args = {**fwd, **changes}
    kw = {
        name: args.pop(name)
        for name in list(args)
        if name not in ("dout", "q", "k", "v", "out", "lse")
    }
    return numflash.attention_backward(
        args["dout"], args["q"], args["k"], args["v"], args["out"], args["lse"], **kw
    )


def test_a_backward_that_adds_dq_up_itself_keeps_no_dq_launcher(fwd):
    """dq_separate=False: the dK/dV kernel adds dQ up, so there is no dQ kernel and no
    launcher of one (the tuner's spill check, launch.local_memory_bytes, asks every launcher
    of a configuration for its compiled kernel)."""
    from numflash import launch

    cfg = numflash.TensorCoreBackwardConfig(16, 1, dq_separate=False)
    dq, dk, dv = _call(fwd, config=cfg)
    # (other tests may have run this configuration on other shapes: each a dK/dV launcher)
    mine = [key for key in launch._launchers if len(key) > 3 and key[3] == cfg]
    assert mine and all(key[-1] == "dkdv" for key in mine), mine
    assert all(launch._launchers[key].dispatcher is not None for key in mine)


def test_tensor_core_gpus_take_the_tensor_core_backward_everywhere(fwd, tmp_path, monkeypatch):
    """fp16/bf16 on a GPU with mma.sync: the tensor-core backward at every head_dim (wgmma on
    Hopper where it fits), and with deterministic=True a tuned atomic configuration gets the
    dQ kernel instead. The heuristics alone: no shipped entries, an empty user cache."""
    import dataclasses

    from numflash import cache, selection
    from numflash.validation import problem

    monkeypatch.setenv("NUMFLASH_CACHE_DIR", str(tmp_path))
    (tmp_path / "shipped").mkdir()
    monkeypatch.setattr(cache, "SHIPPED_DIR", tmp_path / "shipped")
    cache.reload()
    h200 = dataclasses.replace(
        numflash.device.current_device(), compute_capability=(9, 0), simulated=False
    )
    a100 = dataclasses.replace(h200, compute_capability=(8, 0))
    q, k, v = fwd["q"], fwd["k"], fwd["v"]
    big = [random_array(x.shape[:-1] + (256,), "float16") for x in (q, k, v)]
    p = problem(q, k, v, False, None, (-1, -1))[-1]
    p_big = problem(*big, False, None, (-1, -1))[-1]
    for device, deterministic in [(a100, False), (a100, True)]:
        cfg, source = selection.backward(p, device, deterministic)
        assert isinstance(cfg, numflash.TensorCoreBackwardConfig) and cfg.dq_separate
        assert source == "heuristic"
    assert selection.backward(p_big, a100, False).config.head_split == 2
    assert selection.backward(p_big, h200, False).config.head_split == 2  # no wgmma at 256
    assert selection.backward(p, h200, False).config == numflash.TensorCoreBackwardConfig()
    hd64 = [random_array(x.shape[:-1] + (64,), "float16") for x in (q, k, v)]
    p64 = problem(*hd64, False, None, (-1, -1))[-1]
    # at head_dim 64 with 128-row tiles
    tiles128 = numflash.WgmmaBackwardConfig(8, 3, ring=True, pingpong=True, tma=True, block_m=128)
    assert selection.backward(p64, h200, False).config == tiles128
    assert selection.backward(p64, a100, False).config == numflash.TensorCoreBackwardConfig()
    # packed batches: the dense choice, but 32 query rows where the mma.sync heuristic takes 64
    # at head_dim 128 (its varlen dK/dV kernel would spill)
    hd128 = [random_array(x.shape[:-1] + (128,), "float16") for x in (q, k, v)]
    p128 = problem(*hd128, False, None, (-1, -1))[-1]
    # at head_dim 128 the Hopper default is the ring with pingpong turns, filled by TMA
    # (deterministic too)
    pingpong = numflash.WgmmaBackwardConfig(8, 3, ring=True, pingpong=True, tma=True)
    assert selection.backward_varlen(p128, h200, True).config == pingpong
    assert selection.backward(p128, h200, True).config == pingpong
    varlen = selection.backward_varlen(p128, a100, True)
    assert varlen == (numflash.TensorCoreBackwardConfig(32, 8, 2), "heuristic")
    assert selection.backward_varlen(p64, a100, True).config == numflash.TensorCoreBackwardConfig()

    atomic = numflash.TensorCoreBackwardConfig(16, 1, dq_separate=False)
    key = cache.ProblemKey.of("tensor-core-backward", "float16", 16, 5, 7, -1, -1)
    path = cache.record(a100, {key: {"config": atomic.to_dict(), "time_ms": 1.0}})
    try:
        cfg, source = selection.backward(p, a100, False)
        assert cfg == atomic and source == f"user cache {path}"
        cfg, source = selection.backward(p, a100, True)
        assert cfg == numflash.TensorCoreBackwardConfig(16, 1, dq_separate=True)
        assert source == f"user cache {path}, dq_separate for deterministic=True"
        assert selection.backward_varlen(p, a100, False) == (atomic, f"user cache {path}")
    finally:
        cache.reload()


def test_dout_of_the_wrong_shape(fwd):
    with pytest.raises(ValueError, match=r"dout must have q's shape \(1, 5, 2, 8\); got"):
        _call(fwd, dout=random_array((1, 5, 2, 4), "float16"))


def test_out_of_the_wrong_dtype(fwd):
    with pytest.raises(TypeError, match="out must have dtype float16; got float32"):
        _call(fwd, out=random_array((1, 5, 2, 8), "float32"))


def test_lse_of_the_wrong_shape_or_dtype(fwd):
    with pytest.raises(ValueError, match=r"lse must have shape \(1, 2, 5\); got \(1, 5, 2\)"):
        _call(fwd, lse=xp.zeros((1, 5, 2), dtype=np.float32))
    with pytest.raises(TypeError, match="lse must have dtype float32; got float16"):
        _call(fwd, lse=xp.zeros((1, 2, 5), dtype=np.float16))


def test_lse_not_an_array(fwd):
    with pytest.raises(TypeError, match="lse must be"):
        _call(fwd, lse=[0.0] * 10)


def test_backward_validates_like_the_forward(fwd):
    with pytest.raises(ValueError, match="window_size"):
        _call(fwd, window_size=(-2, 0))
    with pytest.raises(ValueError, match="k and v must have the same seqlen"):
        _call(fwd, v=random_array((1, 7, 1, 8), "float16"))


def test_deterministic_must_be_bool(fwd):
    with pytest.raises(TypeError, match="deterministic must be a bool"):
        _call(fwd, deterministic="yes")


def test_backward_config_is_checked(fwd):
    with pytest.raises(TypeError, match="config must be one of numflash.TensorCoreBackwardConfig"):
        _call(fwd, config=numflash.PortableConfig())
    with pytest.raises(ValueError, match="static shared memory"):
        _call(
            fwd,
            q=random_array((1, 5, 2, 256), "float16"),
            k=random_array((1, 6, 1, 256), "float16"),
            v=random_array((1, 6, 1, 256), "float16"),
            dout=random_array((1, 5, 2, 256), "float16"),
            out=random_array((1, 5, 2, 256), "float16"),
            config=numflash.PortableBackwardConfig(128, 128),
        )


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_round_scaled_into_matches_from_float_bitwise(dtype):
    """The atomic path's final pass over dQ (arrays.round_scaled_into: one CuPy kernel on the
    GPU) rounds exactly as from_float does: ties, overflow, subnormals, infinities, NaN, and a
    strided source like dQ's padded accumulator."""
    from numflash import arrays

    rng = np.random.default_rng(7)
    src = rng.standard_normal((3, 50, 2, 40)).astype(np.float32) * np.float32(1e3)
    special = np.array(
        [
            0.0,
            -0.0,
            np.inf,
            -np.inf,
            np.nan,
            65504.0,
            65520.0,
            1e-8,
            -3e-39,
            1.0 + 2.0**-8,
            1.0 + 3 * 2.0**-8,
            3.4e38,
        ],
        dtype=np.float32,
    )
    src.reshape(-1)[: special.size] = special
    padded = xp.asarray(np.concatenate([src, np.zeros_like(src[..., :8])], axis=-1))[..., :40]
    dst = xp.empty(src.shape, dtype=arrays.BFLOAT16 if dtype == "bfloat16" else np.float16)
    arrays.bits(dst)[...] = 0x5555  # poison
    arrays.round_scaled_into(dst, padded, 0.125)
    expected = arrays.from_float(xp.asarray(src) * np.float32(0.125), dst.dtype)
    np.testing.assert_array_equal(to_numpy(arrays.bits(dst)), to_numpy(arrays.bits(expected)))


_C_TYPES = {"float32": "float", "int32": "int", "uint16": "unsigned short", "float16": "float16"}


def _elementwise_source(params, out, body):
    """C source for ``body`` the way a CuPy ElementwiseKernel wraps it: raw parameters as
    pointers, the others (scalars, or an array's element at ``i``) as values, the output a
    reference to its element ``i``."""
    args = []
    for param in params.split(","):
        *raw, ctype, name = param.split()
        ctype = _C_TYPES[ctype]
        if raw:
            args.append(f"const {ctype}* {name}")
        else:
            args.append(f"{ctype} {name}")
    out_type, out_name = out.split()
    args.append(f"{_C_TYPES[out_type]}* _{out_name}")
    return (
        "struct float16 { unsigned short bits; __device__ float16(float) : bits(0) {} };\n"
        f'extern "C" __global__ void rounding({", ".join(args)}, long long n) {{\n'
        "  for (long long i = blockIdx.x * blockDim.x + threadIdx.x; i < n;"
        " i += gridDim.x * blockDim.x) {\n"
        f"    {_C_TYPES[out_type]}& {out_name} = _{out_name}[i];\n"
        f"{body}\n  }}\n}}\n"
    )


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("kernel", ["round_scaled", "bulk_dq"])
def test_rounding_kernels_compile(dtype, kernel):
    """The C code of the CuPy kernels that round dQ (arrays.rounding_kernel) compiles with NVRTC
    for sm_90: CuPy compiles it only on a GPU, so a name clash or a typo would otherwise first
    show there."""
    from numflash import arrays, launch

    params, read = {
        "round_scaled": ("float32 x, float32 s", ""),
        "bulk_dq": (launch._BULK_DQ_PARAMS, launch._BULK_DQ_READ),
    }[kernel]
    dt = np.dtype(np.float16) if dtype == "float16" else arrays.BFLOAT16
    out, body = arrays.rounding_source(dt, read)
    assert_compiles(_elementwise_source(params, out, body))
