"""numflash.jax: attention inside jax.jit, differentiated by jax.grad, against the float64
reference. Without a GPU: JAX's CPU backend and numflash's simulator (the buffers are NumPy
arrays); on a GPU: JAX's GPU backend, the kernels on XLA's stream. Skipped where JAX is absent
or its backend does not match (a CPU-only JAX on a GPU machine)."""

import numpy as np
import pytest
from support import (
    assert_gradients_match,
    assert_matches_reference,
    packed_qkv,
    random_array,
    random_qkv,
    to_numpy,
)

from numflash.kernels.jit import SIMULATOR
from numflash.reference import Variants

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


def test_a_softcap_under_jit_and_grad_matches_the_reference():
    """softcap (static) reaches the forward and the backward kernels."""
    q, k, v = random_qkv(1, 10, 14, 2, 1, 16, "float16")
    q = q * 4  # scores of several units, so that the cap bends them
    dout = random_array(q.shape, "float16")
    jq, jk, jv, jd = (jnp.asarray(np.asarray(x if SIMULATOR else x.get())) for x in (q, k, v, dout))
    variants = Variants(softcap=1.5)
    attend = jax.jit(lambda a, b, c: njax.attention(a, b, c, causal=True, return_lse=True,
                                                    softcap=1.5))  # fmt: skip
    out, lse = attend(jq, jk, jv)
    assert_matches_reference(q, k, v, _host(out), _host(lse), causal=True, variants=variants)

    def loss(a, b, c):
        o = njax.attention(a, b, c, causal=True, softcap=1.5)
        return jnp.sum(o.astype(jnp.float32) * jd.astype(jnp.float32))

    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(jq, jk, jv)
    assert_gradients_match(dout, q, k, v, *(_host(g) for g in grads), causal=True,
                           variants=variants)  # fmt: skip


def _jax(x):
    return jnp.asarray(np.asarray(x if SIMULATOR else x.get()))


def test_sinks_and_alibi_slopes_under_jit_and_grad_match_numflash_s_calls():
    """sinks and (batch, heads) ALiBi slopes reach the forward and backward kernels: out and
    lse against the reference, and out, lse, dq, dk, dv and dsinks bit for bit what
    numflash's own calls give on the same arrays (the same kernels, through XLA's buffers);
    the slopes get no gradient."""
    import numflash

    q, k, v = random_qkv(2, 10, 14, 4, 2, 16, "float16")
    dout = random_array(q.shape, "float16")
    rng = np.random.default_rng(11)
    sinks = rng.normal(size=4).astype(np.float32)
    slopes = rng.uniform(0.05, 0.5, size=(2, 4)).astype(np.float32)
    jq, jk, jv, jd = (_jax(x) for x in (q, k, v, dout))
    js, jslopes = jnp.asarray(sinks), jnp.asarray(slopes)
    mask = dict(causal=True, window_size=(6, 0))

    def attend(a, b, c, s, m, return_lse=False):
        return njax.attention(a, b, c, return_lse=return_lse, sinks=s, alibi_slopes=m, **mask)

    out, lse = jax.jit(lambda *args: attend(*args, return_lse=True))(jq, jk, jv, js, jslopes)
    variants = Variants(sinks=sinks, alibi_slopes=slopes)
    assert_matches_reference(q, k, v, _host(out), _host(lse), variants=variants, **mask)

    def loss(a, b, c, s, m):
        return jnp.sum(attend(a, b, c, s, m).astype(jnp.float32) * jd.astype(jnp.float32))

    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4)))(jq, jk, jv, js, jslopes)
    assert float(jnp.abs(grads[4]).max()) == 0.0  # the slopes: no gradient
    s_host, m_host = _host(sinks), _host(slopes)
    want_out, want_lse = numflash.attention(q, k, v, return_lse=True, sinks=s_host,
                                            alibi_slopes=m_host, **mask)  # fmt: skip
    want = numflash.attention_backward(dout, q, k, v, want_out, want_lse, sinks=s_host,
                                       alibi_slopes=m_host, **mask)  # fmt: skip
    names = ("out", "lse", "dq", "dk", "dv", "dsinks")
    for name, got, expected in zip(names, (out, lse, *grads[:4]), (want_out, want_lse, *want)):
        got, expected = to_numpy(_host(got)), to_numpy(expected)
        assert got.shape == expected.shape and got.dtype == expected.dtype, name
        assert (got.view(np.uint8) == expected.view(np.uint8)).all(), name


def test_sinks_under_vmap_run_each_slice_with_its_own_sinks():
    """A vmapped axis over q and the sinks: each slice as the reference gives it with its
    own sinks (the callbacks run slice by slice)."""
    slices = [random_qkv(1, 6, 9, 2, 1, 16, "float16") for _ in range(3)]
    sinks = np.random.default_rng(12).normal(size=(3, 2)).astype(np.float32)
    q = jnp.stack([_jax(s[0]) for s in slices])
    k, v = _jax(slices[0][1]), _jax(slices[0][2])
    out, lse = jax.jit(jax.vmap(lambda a, s: njax.attention(a, k, v, sinks=s, return_lse=True)))(
        q, jnp.asarray(sinks)
    )
    for i, (qi, _, _) in enumerate(slices):
        assert_matches_reference(qi, slices[0][1], slices[0][2], _host(out[i]), _host(lse[i]),
                                 variants=Variants(sinks=sinks[i]))  # fmt: skip


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
    q, k, v, cu, _ = packed_qkv(lengths, lengths, 2, 1, 16, "float16")
    cu = to_numpy(cu)
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


def test_a_decoding_step_appends_to_donated_caches_and_loops_in_fori_loop():
    """attention_with_kvcache under jit with the caches donated: the new keys and values land
    at each sequence's length, the rest of the caches kept, the output as the reference gives
    it over the appended cache; in a fori_loop the caches are the carry, lengths advancing."""
    from numflash.reference import check

    batch, capacity = 2, 24
    kc, vc = (random_array((batch, capacity, 1, 16), "float16") for _ in range(2))
    q = random_array((batch, 1, 2, 16), "float16")
    kn, vn = (random_array((batch, 1, 1, 16), "float16") for _ in range(2))
    lengths = np.array([5, 11], np.int32)
    host = [np.asarray(x if SIMULATOR else x.get()) for x in (q, kc, vc, kn, vn)]
    jq, jkc, jvc, jkn, jvn = (jnp.asarray(x) for x in host)

    def step(a, kc, vc, k, v, lengths):
        return njax.attention_with_kvcache(a, kc, vc, k, v, cache_seqlens=lengths, causal=True)

    out, kc2, vc2 = jax.jit(step, donate_argnums=(1, 2))(jq, jkc, jvc, jkn, jvn, lengths)
    out, kc2, vc2 = (np.asarray(x) for x in (out, kc2, vc2))
    q_h, kc_h, _, kn_h, vn_h = host
    for b, n in enumerate(lengths):
        assert (kc2[b, n].view(np.uint16) == kn_h[b, 0].view(np.uint16)).all()
        assert (vc2[b, n].view(np.uint16) == vn_h[b, 0].view(np.uint16)).all()
        assert (kc2[b, :n].view(np.uint16) == kc_h[b, :n].view(np.uint16)).all()
        assert check(q_h[b : b + 1], kc2[b : b + 1, : n + 1], vc2[b : b + 1, : n + 1],
                     out[b : b + 1], causal=True).ok  # fmt: skip

    def body(i, carry):
        kc, vc, lengths = carry
        _, kc, vc = step(jq, kc, vc, jkn, jvn, lengths)
        return kc, vc, lengths + 1

    loop = jax.jit(lambda kc, vc: jax.lax.fori_loop(0, 3, body, (kc, vc, jnp.asarray(lengths))))
    kc3, _, final = (np.asarray(x) for x in loop(jnp.asarray(host[1]), jnp.asarray(host[2])))
    assert (final == lengths + 3).all()
    for b, n in enumerate(lengths):
        for t in range(3):
            assert (kc3[b, n + t].view(np.uint16) == kn_h[b, 0].view(np.uint16)).all()


def test_a_decoding_step_over_a_paged_cache_matches_the_contiguous_one():
    """The same step over pages of 4 rows in shuffled order (block_table): the same output, the
    appended rows in the right pages."""
    batch, capacity, page = 2, 24, 4
    kc, vc = (random_array((batch, capacity, 1, 16), "float16") for _ in range(2))
    q = random_array((batch, 1, 2, 16), "float16")
    kn, vn = (random_array((batch, 1, 1, 16), "float16") for _ in range(2))
    lengths = jnp.asarray(np.array([5, 11], np.int32))
    host = [np.asarray(x if SIMULATOR else x.get()) for x in (q, kc, vc, kn, vn)]
    pages = capacity // page
    order = np.random.default_rng(7).permutation(batch * pages)  # page slot of (b, p)
    table = order.reshape(batch, pages).astype(np.int32)
    paged = []
    for cache in host[1:3]:
        p = np.zeros((batch * pages, page, 1, 16), cache.dtype)
        p[order] = cache.reshape(batch * pages, page, 1, 16)
        paged.append(jnp.asarray(p))
    jq, jkn, jvn = (jnp.asarray(host[i]) for i in (0, 3, 4))
    want, kc2, _ = njax.attention_with_kvcache(
        jq, jnp.asarray(host[1]), jnp.asarray(host[2]), jkn, jvn, cache_seqlens=lengths
    )
    got, kp2, _ = njax.attention_with_kvcache(
        jq, *paged, jkn, jvn, cache_seqlens=lengths, block_table=jnp.asarray(table)
    )
    assert np.abs(np.asarray(got, np.float32) - np.asarray(want, np.float32)).max() <= 1e-3
    kp2 = np.asarray(kp2)[table].reshape(batch, capacity, 1, 16)  # back in sequence order
    assert (kp2.view(np.uint16) == np.asarray(kc2).view(np.uint16)).all()


def _same_bits(names, got, expected):
    for name, a, b in zip(names, got, expected):
        a, b = to_numpy(_host(a)), to_numpy(b)
        assert a.shape == b.shape and a.dtype == b.dtype, name
        assert (a.view(np.uint8) == b.view(np.uint8)).all(), name


def test_a_packed_batch_with_sinks_and_slopes_matches_numflash_s_calls():
    """attention_varlen with sinks and (batch, heads) slopes: out, lse, dq, dk, dv and dsinks
    bit for bit what numflash's own calls give on the same arrays."""
    import numflash

    lengths = [5, 0, 9, 3]
    q, k, v, cu, _ = packed_qkv(lengths, lengths, 2, 1, 16, "float16")
    dout = random_array(q.shape, "float16")
    rng = np.random.default_rng(13)
    sinks = rng.normal(size=2).astype(np.float32)
    slopes = rng.uniform(0.05, 0.5, size=(4, 2)).astype(np.float32)
    jq, jk, jv, jd, jcu = (_jax(x) for x in (q, k, v, dout, cu))
    variants = dict(sinks=jnp.asarray(sinks), alibi_slopes=jnp.asarray(slopes))

    def attend(a, b, c, s, return_lse=False):
        return njax.attention_varlen(a, b, c, jcu, jcu, 9, 9, causal=True,
                                     return_lse=return_lse, sinks=s,
                                     alibi_slopes=variants["alibi_slopes"])  # fmt: skip

    out, lse = jax.jit(lambda a, b, c, s: attend(a, b, c, s, True))(jq, jk, jv, variants["sinks"])

    def loss(a, b, c, s):
        return jnp.sum(attend(a, b, c, s).astype(jnp.float32) * jd.astype(jnp.float32))

    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))(jq, jk, jv, variants["sinks"])
    host = dict(sinks=_host(sinks), alibi_slopes=_host(slopes), causal=True)
    want_out, want_lse = numflash.attention_varlen(q, k, v, cu, cu, 9, 9, return_lse=True, **host)
    want = numflash.attention_varlen_backward(dout, q, k, v, want_out, want_lse, cu, cu, 9, 9,
                                              **host)  # fmt: skip
    _same_bits(("out", "lse", "dq", "dk", "dv", "dsinks"), (out, lse, *grads),
               (want_out, want_lse, *want))  # fmt: skip


def test_a_gpt_oss_decoding_step_with_sinks_matches_numflash_s_call():
    """A paged decoding step with an append, sinks and a 128-key window: out and the caches
    bit for bit what numflash.attention_with_kvcache gives on copies of the same caches."""
    import numflash

    batch, page, pages = 2, 16, 12
    rng = np.random.default_rng(14)
    table = rng.permutation(batch * pages).astype(np.int32).reshape(batch, pages)
    kc, vc = (random_array((batch * pages, page, 1, 16), "bfloat16", rng) for _ in range(2))
    q = random_array((batch, 1, 4, 16), "bfloat16", rng)
    kn, vn = (random_array((batch, 1, 1, 16), "bfloat16", rng) for _ in range(2))
    lengths = np.array([40, 150], np.int32)
    sinks = rng.normal(size=4).astype(np.float32)
    call = dict(causal=True, window_size=(127, 0))
    got, k2, v2 = jax.jit(lambda *a: njax.attention_with_kvcache(
        *a[:5], cache_seqlens=a[5], block_table=a[6], sinks=a[7], **call))(
        *(_jax(x) for x in (q, kc, vc, kn, vn)), jnp.asarray(lengths), jnp.asarray(table),
        jnp.asarray(sinks))  # fmt: skip
    want = numflash.attention_with_kvcache(
        q, kc, vc, kn, vn, cache_seqlens=_host(lengths), block_table=_host(table),
        sinks=_host(sinks), **call,
    )  # fmt: skip
    _same_bits(("out", "k_cache", "v_cache"), (got, k2, v2), (want, kc, vc))
