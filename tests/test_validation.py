"""Every bad input raises ValueError or TypeError naming the argument, before any launch."""

import numpy as np
import pytest
from support import poisoned_like, random_array, random_qkv, xp

import numflash
from numflash.config import PortableConfig, TensorCoreConfig
from numflash.kernels.jit import SIMULATOR


@pytest.fixture
def qkv():
    return random_qkv(2, 8, 8, 4, 2, 16, "float16")


def _raises(exc, match, *args, **kwargs):
    with pytest.raises(exc, match=match):
        numflash.attention(*args, **kwargs)


@pytest.mark.parametrize("which", ["q", "k", "v"])
def test_wrong_rank_names_the_argument(qkv, which):
    args = dict(zip("qkv", qkv))
    args[which] = args[which][0]
    _raises(ValueError, f"{which} must have 4 dimensions", args["q"], args["k"], args["v"])


@pytest.mark.parametrize("which", ["q", "k", "v"])
def test_not_an_array(qkv, which):
    args = dict(zip("qkv", qkv))
    args[which] = [[1.0]]
    _raises(TypeError, f"{which} must be", args["q"], args["k"], args["v"])


def test_mismatched_batch(qkv):
    q, k, v = qkv
    _raises(ValueError, "batch sizes differ", q[:1], k, v)


def test_mismatched_head_dim():
    q, _, _ = random_qkv(1, 4, 4, 2, 2, 16, "float16")
    _, k, v = random_qkv(1, 4, 4, 2, 2, 8, "float16")
    _raises(ValueError, "head_dim differs", q, k, v)


def test_mismatched_kv_seqlen(qkv):
    q, k, v = qkv
    _raises(ValueError, "k and v must have the same seqlen", q, k, v[:, :3])


def test_mismatched_kv_heads(qkv):
    q, k, v = qkv
    _raises(ValueError, "k and v must have the same nheads", q, k, v[:, :, :1])


def test_heads_not_divisible(qkv):
    q, _, _ = qkv
    _, k, v = random_qkv(2, 8, 8, 4, 3, 16, "float16")
    _raises(ValueError, r"nheads of q \(4\) must be a multiple of nheads of k and v \(3\)", q, k, v)


def test_mismatched_dtypes(qkv):
    q, k, v = qkv
    _raises(TypeError, "must share one dtype", q, k.astype(np.float32), v)


@pytest.mark.parametrize("dtype", [np.float64, np.int32, np.complex64])
def test_unsupported_dtype(dtype):
    q = xp.zeros((1, 4, 1, 8), dtype=dtype)
    _raises(TypeError, "q has dtype .*accepted: float16, bfloat16, float32", q, q, q)


@pytest.mark.parametrize("head_dim", [257, 512])
def test_head_dim_too_large(head_dim):
    q, k, v = random_qkv(1, 2, 2, 1, 1, head_dim, "float16")
    _raises(ValueError, "head_dim must be in", q, k, v)


@pytest.mark.parametrize("scale", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_softmax_scale(qkv, scale):
    _raises(ValueError, "softmax_scale must be finite", *qkv, softmax_scale=scale)


@pytest.mark.parametrize("scale", ["0.1", True, [1.0]])
def test_softmax_scale_wrong_type(qkv, scale):
    _raises(TypeError, "softmax_scale must be a real number", *qkv, softmax_scale=scale)


@pytest.mark.parametrize("window", [(-2, 0), (1,), (1, 2, 3), "ab", (1.5, 2), (True, 1), None])
def test_invalid_window(qkv, window):
    _raises(ValueError, "window_size must be a pair", *qkv, window_size=window)


@pytest.mark.parametrize("flag", ["causal", "return_lse"])
def test_flags_must_be_bool(qkv, flag):
    _raises(TypeError, f"{flag} must be a bool", *qkv, **{flag: "yes"})


def test_out_wrong_shape(qkv):
    q, k, v = qkv
    out = xp.empty((2, 8, 4, 8), dtype=q.dtype)
    _raises(ValueError, "out must have q's shape", q, k, v, out=out)


def test_out_wrong_dtype(qkv):
    q, k, v = qkv
    out = xp.empty(q.shape, dtype=np.float32)
    _raises(TypeError, "out must have q's dtype", q, k, v, out=out)


def test_out_not_an_array(qkv):
    _raises(TypeError, "out must be", *qkv, out=object())


def test_bad_input_leaves_out_untouched(qkv):
    q, k, v = qkv
    out = poisoned_like(q)
    with pytest.raises(ValueError):
        numflash.attention(q, k, v, out=out, window_size=(-5, 0))
    assert bool(xp.isnan(out.astype(np.float32)).all())


def test_config_wrong_type(qkv):
    _raises(TypeError, "config must be", *qkv, config={"block_m": 64})


def test_infeasible_tensor_core_config(qkv):
    _raises(ValueError, "block_n=48 is not one of", *qkv, config=TensorCoreConfig(block_n=48))
    _raises(ValueError, "block_m=48 must be", *qkv, config=TensorCoreConfig(block_m=48))


def test_tensor_core_config_with_float32():
    q, k, v = random_qkv(1, 4, 4, 1, 1, 16, "float32")
    _raises(
        TypeError,
        "tensor-core kernel takes float16 or bfloat16",
        q,
        k,
        v,
        config=TensorCoreConfig(),
    )


def test_shared_memory_limit_is_checked():
    q, k, v = random_qkv(1, 4, 4, 1, 1, 256, "float16")
    cfg = TensorCoreConfig(block_m=128, block_n=128, num_warps=8, stages=4, q_in_registers=False)
    _raises(ValueError, "bytes of shared memory per block", q, k, v, config=cfg)


def test_portable_config_static_shared_memory():
    q, k, v = random_qkv(1, 4, 4, 1, 1, 256, "float32")
    _raises(ValueError, "static shared memory", q, k, v, config=PortableConfig(block_n=64))


@pytest.mark.skipif(not SIMULATOR, reason="host arrays are refused on a GPU (next test)")
def test_simulator_takes_numpy(qkv):
    out = numflash.attention(*qkv)
    assert isinstance(out, np.ndarray)


@pytest.mark.gpu
def test_host_arrays_are_refused_on_gpu():
    q = np.zeros((1, 4, 1, 8), dtype=np.float16)
    _raises(TypeError, "q is a NumPy \\(host\\) array", q, q, q)


@pytest.mark.gpu
def test_arrays_on_different_gpus_are_refused():
    import cupy

    if cupy.cuda.runtime.getDeviceCount() < 2:
        pytest.skip("needs two GPUs")
    q, k, v = random_qkv(1, 4, 4, 1, 1, 8, "float16")
    with cupy.cuda.Device(1):
        k1 = cupy.asarray(k)
    _raises(ValueError, "same GPU", q, k1, v)


def test_random_array_helper_is_not_zero():
    a = random_array((4, 4), "float16")
    assert bool((a != 0).any())


def test_numpy_scalars_are_taken_where_python_numbers_are(qkv):
    """Configurations, window sizes, softmax_scale, max lengths and cache lengths given as NumPy
    scalars (what indexing an array yields) behave as the Python numbers they hold."""
    cfg = PortableConfig(block_m=np.int64(32), block_n=np.int32(16))
    assert cfg == PortableConfig(32, 16) and type(cfg.block_m) is int and not cfg.problems(16, None)
    hopper = numflash.WgmmaForwardConfig(np.int64(2), np.int64(128), np.int8(3), np.bool_(False))
    assert hopper == numflash.WgmmaForwardConfig(2, 128, 3, False) and hash(hopper)
    q, k, v = qkv
    window = (np.int64(3), np.int32(1))
    scale = np.float32(0.25)
    out = numflash.attention(q, k, v, window_size=window, softmax_scale=scale, config=cfg)
    again = numflash.attention(q, k, v, window_size=(3, 1), softmax_scale=0.25, config=cfg)
    assert bool((out == again).all())
    flat = [x.reshape(-1, *x.shape[2:]) for x in (q, k, v)]
    cu = xp.asarray(np.array([0, 8, 16], np.int32))
    packed = numflash.attention_varlen(*flat, cu, cu, np.int64(8), np.int32(8))
    assert packed.shape == flat[0].shape
    cache_k, cache_v = (random_array((2, 16, 2, 16), "float16") for _ in range(2))
    for lengths in (np.int64(5), 5):
        numflash.attention_with_kvcache(q[:, :1], cache_k, cache_v, cache_seqlens=lengths)
