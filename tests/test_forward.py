"""numflash.attention against the float64 reference: both kernel families, awkward shapes."""

import itertools

import numpy as np
import pytest
from support import (
    assert_matches_reference,
    poisoned_like,
    random_array,
    random_qkv,
    xp,
)

import numflash
from numflash.config import PortableConfig, TensorCoreConfig

MASKS = {"none": dict(), "causal": dict(causal=True), "window": dict(window_size=(8, 4))}


def _covering_cases(dtypes, head_dims, seqlens, gqa_ratios):
    """Every (dtype, head_dim, seqlens) triple once; masks and GQA ratios rotate through them,
    so each value of each parameter meets many values of the others without the full product."""
    for i, (dtype, hd, (sq, sk)) in enumerate(itertools.product(dtypes, head_dims, seqlens)):
        mask = list(MASKS)[i % len(MASKS)]
        ratio = gqa_ratios[(i // len(MASKS)) % len(gqa_ratios)]
        yield pytest.param(
            dtype, hd, sq, sk, ratio, mask, id=f"{dtype}-d{hd}-q{sq}-k{sk}-g{ratio}-{mask}"
        )


SEQLENS = [(1, 1), (7, 33), (33, 7), (80, 80), (33, 80)]


@pytest.mark.parametrize(
    "dtype,head_dim,seqlen_q,seqlen_k,gqa,mask",
    list(_covering_cases(["float16", "float32", "bfloat16"], [16, 40, 64], SEQLENS, [1, 2, 4])),
)
def test_portable_kernel_matches_reference(dtype, head_dim, seqlen_q, seqlen_k, gqa, mask):
    q, k, v = random_qkv(1, seqlen_q, seqlen_k, gqa, 1, head_dim, dtype)
    out = poisoned_like(q)
    cfg = PortableConfig(block_m=32, block_n=16)
    res, lse = numflash.attention(q, k, v, out=out, return_lse=True, config=cfg, **MASKS[mask])
    assert res is out
    assert_matches_reference(q, k, v, out, lse, **MASKS[mask])


#: Small enough for the simulator: one or four warps, tiles of 16 and 32 keys.
SIM_TC_CASES = [
    # dtype, head_dim, seqlen_q, seqlen_k, gqa, mask, config
    ("float16", 32, 33, 40, 2, "causal", TensorCoreConfig(16, 16, 1, 2, True)),
    ("bfloat16", 32, 17, 50, 1, "window", TensorCoreConfig(16, 16, 1, 3, False)),
    ("float16", 40, 20, 9, 1, "none", TensorCoreConfig(16, 32, 1, 2, True)),
    ("bfloat16", 16, 70, 70, 2, "causal", TensorCoreConfig(64, 32, 4, 2, True)),
    ("float16", 24, 5, 19, 4, "none", TensorCoreConfig(32, 16, 1, 2, False)),
]


@pytest.mark.parametrize(
    "dtype,head_dim,seqlen_q,seqlen_k,gqa,mask,cfg",
    [pytest.param(*c, id=f"{c[0]}-d{c[1]}-q{c[2]}-k{c[3]}-g{c[4]}-{c[5]}") for c in SIM_TC_CASES],
)
def test_tensor_core_kernel_matches_reference(dtype, head_dim, seqlen_q, seqlen_k, gqa, mask, cfg):
    q, k, v = random_qkv(1, seqlen_q, seqlen_k, gqa, 1, head_dim, dtype)
    out = poisoned_like(q)
    _, lse = numflash.attention(q, k, v, out=out, return_lse=True, config=cfg, **MASKS[mask])
    assert_matches_reference(q, k, v, out, lse, **MASKS[mask])


def test_causal_rows_that_see_no_key_give_zero_and_minus_inf():
    # seqlen_q > seqlen_k with a bottom-right causal mask: the first 5 rows see nothing.
    q, k, v = random_qkv(1, 9, 4, 2, 1, 16, "float32")
    out, lse = numflash.attention(q, k, v, causal=True, return_lse=True)
    lse = lse if isinstance(lse, np.ndarray) else lse.get()
    out = out if isinstance(out, np.ndarray) else out.get()
    assert np.isneginf(lse[:, :, :5]).all() and np.isfinite(lse[:, :, 5:]).all()
    assert (out[:, :5] == 0).all()


def test_window_excluding_everything_gives_zero_rows():
    q, k, v = random_qkv(1, 6, 6, 1, 1, 8, "float16")
    # left=0, right=0 keeps only the diagonal; shift it out of range with seqlen_k < seqlen_q.
    out, lse = numflash.attention(q, k[:, :2], v[:, :2], window_size=(0, 0), return_lse=True)
    assert_matches_reference(q, k[:, :2], v[:, :2], out, lse, window_size=(0, 0))


def test_softmax_scale_is_applied():
    q, k, v = random_qkv(1, 12, 12, 1, 1, 16, "float32")
    out, lse = numflash.attention(q, k, v, softmax_scale=0.37, return_lse=True)
    assert_matches_reference(q, k, v, out, lse, softmax_scale=0.37)


@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_empty_sequences_launch_nothing(dtype):
    q, k, v = random_qkv(2, 0, 5, 2, 1, 16, dtype)
    out, lse = numflash.attention(q, k, v, return_lse=True)
    assert out.shape == (2, 0, 2, 16) and lse.shape == (2, 2, 0)
    q, k, v = random_qkv(1, 3, 0, 2, 1, 16, dtype)
    out, lse = numflash.attention(q, k, v, return_lse=True)
    assert (out == 0).all() and bool(xp.isneginf(lse).all())


def test_strided_views_are_read_in_place():
    # (batch, nheads, seqlen, head_dim) arrays transposed to numflash's layout.
    rng_shape = (1, 3, 21, 16)
    q, k, v = (random_array(rng_shape, "float16").transpose(0, 2, 1, 3) for _ in range(3))
    out, lse = numflash.attention(q, k, v, causal=True, return_lse=True)
    assert_matches_reference(q, k, v, out, lse, causal=True)


def test_output_buffer_with_foreign_strides():
    q, k, v = random_qkv(1, 10, 10, 2, 2, 8, "float32")
    big = poisoned_like(random_array((1, 2, 10, 8), "float32"))
    out = big.transpose(0, 2, 1, 3)  # (1, 10, 2, 8) view with non-default strides
    res, lse = numflash.attention(q, k, v, out=out, return_lse=True)
    assert res is out
    assert_matches_reference(q, k, v, out, lse)


# -- on a GPU ---------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("causal", [False, True])
def test_acceptance_shape(dtype, causal):
    """A long sequence on the default (tensor-core) path, output poisoned first."""
    q, k, v = random_qkv(2, 4096, 4096, 16, 16, 128, dtype)
    out = poisoned_like(q)
    _, lse = numflash.attention(q, k, v, causal=causal, out=out, return_lse=True)
    assert_matches_reference(q, k, v, out, lse, causal=causal)


GPU_HEAD_DIMS = [32, 40, 64, 72, 96, 128, 160, 256]


@pytest.mark.gpu
@pytest.mark.parametrize(
    "dtype,head_dim,seqlen_q,seqlen_k,gqa,mask",
    list(
        _covering_cases(
            ["float16", "bfloat16"],
            GPU_HEAD_DIMS,
            [(1, 1), (113, 203), (203, 113), (1023, 1023), (128, 1023), (7, 1)],
            [1, 2, 4, 8],
        )
    ),
)
def test_default_path_matrix(dtype, head_dim, seqlen_q, seqlen_k, gqa, mask):
    q, k, v = random_qkv(2, seqlen_q, seqlen_k, 2 * gqa, 2, head_dim, dtype)
    out = poisoned_like(q)
    _, lse = numflash.attention(q, k, v, out=out, return_lse=True, **MASKS[mask])
    assert_matches_reference(q, k, v, out, lse, **MASKS[mask])


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [17, 100, 250])
def test_head_dims_not_multiple_of_8_are_padded(head_dim):
    q, k, v = random_qkv(1, 77, 91, 2, 1, head_dim, "float16")
    out, lse = numflash.attention(q, k, v, causal=True, return_lse=True)
    assert_matches_reference(q, k, v, out, lse, causal=True)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_portable_kernel_on_gpu(dtype):
    q, k, v = random_qkv(2, 300, 517, 4, 2, 96, dtype)
    out = poisoned_like(q)
    _, lse = numflash.attention(
        q, k, v, causal=True, out=out, return_lse=True, config=PortableConfig()
    )
    assert_matches_reference(q, k, v, out, lse, causal=True)


@pytest.mark.gpu
def test_runs_on_cupys_current_stream():
    import cupy

    q, k, v = random_qkv(1, 2048, 2048, 8, 8, 128, "bfloat16")
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        out = poisoned_like(q)
        _, lse = numflash.attention(q, k, v, out=out, return_lse=True)
        done = cupy.cuda.Event()
        done.record(stream)
    done.synchronize()
    assert_matches_reference(q, k, v, out, lse)


@pytest.mark.gpu
def test_call_returns_before_its_kernel_finishes():
    """attention() queues its kernel and returns: it must not wait for the GPU (adopting CuPy
    arrays through __cuda_array_interface__ would synchronise their stream)."""
    import cupy

    q, k, v = random_qkv(1, 16384, 16384, 16, 16, 128, "float16")
    numflash.attention(q, k, v, causal=True)  # compile and warm up
    stream = cupy.cuda.get_current_stream()
    stream.synchronize()
    numflash.attention(q, k, v, causal=True)  # a few milliseconds of GPU work
    finished = cupy.cuda.Event()
    finished.record(stream)
    assert not finished.done


@pytest.mark.gpu
def test_transposed_bhsd_views_on_gpu():
    q, k, v = (random_array((2, 16, 1000, 128), "float16").transpose(0, 2, 1, 3) for _ in range(3))
    assert not q.flags.c_contiguous
    out, lse = numflash.attention(q, k, v, causal=True, return_lse=True)
    assert_matches_reference(q, k, v, out, lse, causal=True)


@pytest.mark.gpu
def test_forward_is_deterministic():
    q, k, v = random_qkv(2, 1531, 1531, 8, 4, 128, "float16")
    first = numflash.attention(q, k, v, causal=True)
    for _ in range(100):
        again = numflash.attention(q, k, v, causal=True)
        assert bool((again.view(xp.uint16) == first.view(xp.uint16)).all())


@pytest.mark.gpu
def test_memory_is_linear_in_seqlen():
    """At seqlen 32768 a call allocates its output and LSE and nothing of size seqlen^2."""
    import cupy

    q, k, v = random_qkv(1, 32768, 32768, 16, 16, 128, "float16")
    numflash.attention(q, k, v)  # compile and warm up outside the measurement
    cupy.cuda.Device().synchronize()
    pool = cupy.get_default_memory_pool()
    pool.free_all_blocks()
    before = pool.used_bytes()
    out, lse = numflash.attention(q, k, v, return_lse=True)
    cupy.cuda.Device().synchronize()
    extra = pool.used_bytes() - before
    assert extra <= out.nbytes + lse.nbytes + 4096, extra


@pytest.mark.parametrize("scale", [-0.3, 0.0])
@pytest.mark.parametrize(
    "cfg",
    [
        TensorCoreConfig(block_m=16, block_n=16, num_warps=1, stages=2, q_in_registers=True),
        PortableConfig(block_m=32, block_n=16),
    ],
    ids=["tc", "portable"],
)
def test_negative_and_zero_softmax_scale(scale, cfg):
    # The tensor-core kernel folds the scale into exp2 after a max over unscaled scores; the
    # API must still give the exact attention for scales that reverse or erase the order.
    q, k, v = random_qkv(1, 17, 23, 2, 1, 16, "float16")
    out, lse = numflash.attention(
        q, k, v, causal=True, softmax_scale=scale, return_lse=True, config=cfg
    )
    assert_matches_reference(q, k, v, out, lse, causal=True, softmax_scale=scale)


def test_windows_wider_than_the_sequences_are_unbounded():
    q, k, v = random_qkv(1, 9, 14, 1, 1, 8, "float32")
    wide = numflash.attention(q, k, v, window_size=(10**12, 10**15))
    full = numflash.attention(q, k, v)
    assert bool((wide == full).all())


H200 = numflash.device.DeviceInfo("NVIDIA H200", (9, 0), 132, 232448, 1024)


@pytest.mark.parametrize("seqlen_q,routed", [(1, True), (16, True), (17, False)])
def test_few_query_rows_take_the_kvcache_kernel(seqlen_q, routed):
    """A dense call of at most 16 query rows runs the split-KV decode kernel over k and v
    (where the tensor-core decode kernel takes the call); more rows, the forward."""
    from numflash import api, validation

    q, k, v = random_qkv(2, seqlen_q, 300, 8, 2, 64, "float16")
    p = validation.problem(q, k, v, True, None, (-1, -1))[-1]
    route = api._decode_route(q, k, v, p, True, None, (-1, -1), H200)
    assert (route is not None) == routed
    if routed:
        kp, choice, splits = route
        assert isinstance(choice.config, numflash.TensorCoreDecodeConfig) and splits >= 1
        assert (kp.capacity, kp.seqlen_new, kp.cache_seqlens) == (300, 0, 300)
    q32, k32, v32 = random_qkv(1, seqlen_q, 300, 2, 1, 64, "float32")
    p32 = validation.problem(q32, k32, v32, False, None, (-1, -1))[-1]
    assert api._decode_route(q32, k32, v32, p32, False, None, (-1, -1), H200) is None


@pytest.mark.gpu
@pytest.mark.parametrize(
    "seqlen_q,mask", [(1, {}), (5, dict(causal=True)), (16, dict(window_size=(700, 3)))]
)
def test_few_query_rows_match_the_reference_and_the_kvcache_call(seqlen_q, mask):
    q, k, v = random_qkv(2, seqlen_q, 5000, 8, 2, 128, "bfloat16")
    out, lse = numflash.attention(q, k, v, return_lse=True, out=poisoned_like(q), **mask)
    assert_matches_reference(q, k, v, out, lse, **mask)
    if numflash.device.current_device().runs("mma.sync"):
        cached = numflash.attention_with_kvcache(q, k, v, cache_seqlens=5000, **mask)
        assert bool((out.view(np.uint16) == cached.view(np.uint16)).all())
        assert "few query rows" in numflash.selected_config(q, k, v, **mask)[1]
