"""numflash.jax: attention inside jax.jit, differentiated by jax.grad, against the float64
reference. Without a GPU: JAX's CPU backend and numflash's simulator (the buffers are NumPy
arrays); on a GPU: JAX's GPU backend, the kernels on XLA's stream. Skipped where JAX is absent
or its backend does not match (a CPU-only JAX on a GPU machine)."""

import numpy as np
import pytest
from support import assert_gradients_match, assert_matches_reference, random_array, random_qkv

from numflash.kernels.jit import SIMULATOR

jax = pytest.importorskip("jax")
jnp = jax.numpy
if jax.default_backend() != ("cpu" if SIMULATOR else "gpu"):
    pytest.skip(f"JAX's {jax.default_backend()} backend does not match", allow_module_level=True)

import numflash.jax as njax  # noqa: E402


def _host(x):
    return np.asarray(x) if SIMULATOR else __import__("cupy").asarray(np.asarray(x))


CASES = [
    ("float16", 1, 12, 20, 2, 1, 16, dict(causal=True)),
    ("bfloat16", 2, 9, 9, 2, 2, 32, dict()),
    ("float16", 1, 16, 16, 4, 2, 16, dict(window_size=(3, 2))),
]


@pytest.mark.parametrize("dtype,batch,sq,sk,heads,kv_heads,head_dim,mask", CASES)
def test_attention_under_jit_and_grad_matches_the_reference(
    dtype, batch, sq, sk, heads, kv_heads, head_dim, mask
):
    q, k, v = random_qkv(batch, sq, sk, heads, kv_heads, head_dim, dtype)
    dout = random_array(q.shape, dtype)
    jq, jk, jv, jd = (jnp.asarray(np.asarray(x if SIMULATOR else x.get())) for x in (q, k, v, dout))

    out, lse = jax.jit(lambda a, b, c: njax.attention(a, b, c, return_lse=True, **mask))(jq, jk, jv)
    assert out.dtype == jq.dtype and lse.dtype == jnp.float32
    assert_matches_reference(q, k, v, _host(out), _host(lse), **mask)

    def loss(a, b, c):
        o = njax.attention(a, b, c, **mask)
        return jnp.sum(o.astype(jnp.float32) * jd.astype(jnp.float32))

    grads = jax.jit(jax.grad(jax.checkpoint(loss), argnums=(0, 1, 2)))(jq, jk, jv)
    assert_gradients_match(dout, q, k, v, *(_host(g) for g in grads), **mask)


def test_the_lse_carries_no_gradient():
    def fresh():
        x = random_array((1, 8, 2, 16), "float16")
        return jnp.asarray(np.asarray(x if SIMULATOR else x.get()))

    q, k, v = fresh(), fresh(), fresh()

    def loss(a):
        return njax.attention(a, k, v, return_lse=True)[1].sum()

    assert float(jnp.abs(jax.grad(loss)(q).astype(jnp.float32)).max()) == 0.0


def test_vmap_folds_its_axis_into_the_batch():
    """jax.vmap over a leading axis (k and v shared by every slice in the forward): each slice
    as the reference gives it, forward and gradients (the callbacks fold the vmapped axis into
    the batch dimension)."""
    slices = [random_qkv(2, 8, 10, 2, 1, 16, "float16") for _ in range(3)]
    douts = [random_array(s[0].shape, "float16") for s in slices]

    def stack(xs):
        return jnp.asarray(np.stack([np.asarray(x if SIMULATOR else x.get()) for x in xs]))

    q, k, v = (stack([s[i] for s in slices]) for i in range(3))
    dout = stack(douts)
    shared = jax.vmap(lambda a: njax.attention(a, k[0], v[0], causal=True, return_lse=True))
    out, lse = jax.jit(shared)(q)
    for i, (qi, _, _) in enumerate(slices):
        assert_matches_reference(qi, slices[0][1], slices[0][2], _host(out[i]), _host(lse[i]),
                                 causal=True)  # fmt: skip

    def loss(a, b, c, d):
        return jnp.sum(
            njax.attention(a, b, c, causal=True).astype(jnp.float32) * d.astype(jnp.float32)
        )

    grads = jax.jit(jax.vmap(jax.grad(loss, argnums=(0, 1, 2))))(q, k, v, dout)
    for i, (qi, ki, vi) in enumerate(slices):
        assert_gradients_match(douts[i], qi, ki, vi, *(_host(g[i]) for g in grads), causal=True)


def test_attention_varlen_under_jit_and_grad_matches_each_sequence():
    """A packed batch with an empty sequence, GQA, causal: out, lse and gradients of every
    sequence against the reference (the offsets traced as int32 JAX arrays)."""
    lengths = [5, 0, 9, 3]
    cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    total = int(cu[-1])
    q = random_array((total, 2, 16), "float16")
    k, v = (random_array((total, 1, 16), "float16") for _ in range(2))
    dout = random_array(q.shape, "float16")
    jq, jk, jv, jd = (jnp.asarray(np.asarray(x if SIMULATOR else x.get())) for x in (q, k, v, dout))
    offsets = jnp.asarray(cu)

    def attend(a, b, c, offsets, return_lse=False):
        return njax.attention_varlen(a, b, c, offsets, offsets, 9, 9, causal=True,
                                     return_lse=return_lse)  # fmt: skip

    out, lse = jax.jit(lambda a, b, c, o: attend(a, b, c, o, True))(jq, jk, jv, offsets)

    def loss(a, b, c):
        return jnp.sum(attend(a, b, c, offsets).astype(jnp.float32) * jd.astype(jnp.float32))

    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(jq, jk, jv)
    out, lse, *grads = (_host(x) for x in (out, lse, *grads))
    for i, n in enumerate(lengths):
        if n:
            s = slice(int(cu[i]), int(cu[i + 1]))
            one = [x[None, s] for x in (q, k, v)]
            assert_matches_reference(*one, out[None, s], lse[None, :, s], causal=True)
            assert_gradients_match(dout[None, s], *one, *(g[None, s] for g in grads), causal=True)
