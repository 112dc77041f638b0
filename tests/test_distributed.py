"""numflash.distributed: the zigzag layout, and ring attention forward and backward over ranks
of one process (LocalRing, each rank a thread), against the float64 reference on the whole
sequence. In the simulator the kernels are numflash's portable ones on small shapes; on a GPU
the default kernels, every rank on the one GPU. NCCL between two GPUs is not tested yet."""

import numpy as np
import pytest
from support import (
    assert_gradients_match,
    assert_matches_reference,
    random_array,
    to_float64,
    to_numpy,
    xp,
)

from numflash import distributed
from numflash.distributed import (
    LocalRing,
    ring_attention,
    ring_attention_backward,
    run_ranks,
    shard,
    unshard,
)
from numflash.reference import Variants


def _on_every_rank(world, fn):
    """[fn(rank, ring endpoint) for each rank], each rank in a thread of its own."""
    return run_ranks(fn, LocalRing.group(world), timeout=1800)


def _ring_forward_and_backward(world, q, k, v, dout, **call):
    """(out, lse, the gradients, each rank's (out, lse, gradients)) of ring attention over
    ``world`` ranks of one process on the zigzag shards of the whole sequence's q, k, v and
    dout, forward and backward with the same ``call`` keywords; out, lse and the gradients
    put back in sequence order (a rank-local dsinks stays as each rank gave it)."""

    def rank_work(rank, ring):
        mine = [shard(x, rank, world) for x in (q, k, v, dout)]
        out, lse = ring_attention(*mine[:3], ring, return_lse=True, **call)
        grads = ring_attention_backward(mine[3], *mine[:3], out, lse, ring, **call)
        return out, lse, grads

    results = _on_every_rank(world, rank_work)
    out = unshard([r[0] for r in results])
    lse = unshard([r[1] for r in results], axis=2)
    grads = [unshard([r[2][i] for r in results]) for i in range(3)]
    return out, lse, grads + [None] * (len(results[0][2]) - 3), results


@pytest.mark.parametrize("world", [1, 2, 3])
def test_shard_and_unshard_are_inverse_and_zigzag(world):
    x = xp.arange(2 * 6 * world * 3).reshape(2, 6 * world, 3)
    shards = [shard(x, r, world) for r in range(world)]
    c = 3  # 6 * world rows in 2 * world chunks
    for r, s in enumerate(shards):
        assert s.shape == (2, 2 * c, 3)
        assert bool((s[:, :c] == x[:, r * c : (r + 1) * c]).all())
        assert bool((s[:, c:] == x[:, (2 * world - 1 - r) * c : (2 * world - r) * c]).all())
    assert bool((unshard(shards) == x).all())
    y = x.transpose(0, 2, 1)  # along another axis
    assert bool((unshard([shard(y, r, world, axis=2) for r in range(world)], axis=2) == y).all())


def test_shard_refuses_lengths_and_ranks_that_do_not_fit():
    x = xp.zeros((1, 10, 2))
    with pytest.raises(ValueError, match="2 x world = 4"):
        shard(x, 0, 2)
    with pytest.raises(ValueError, match="rank must be in"):
        shard(x, 5, 5)


@pytest.mark.parametrize(
    "world,causal,dtype,window",
    [
        (2, True, "float16", (-1, -1)),
        (3, True, "float16", (-1, -1)),
        (2, False, "float16", (-1, -1)),
        (3, True, "bfloat16", (-1, -1)),
        (3, True, "float16", (5, -1)),  # a sliding window behind each query
        (2, False, "float16", (3, 6)),  # a window on both sides
    ],
)
def test_ring_attention_matches_attention_on_the_whole_sequence(world, causal, dtype, window):
    chunk, heads, kv_heads, head_dim = 4, 2, 1, 16
    seqlen = 2 * world * chunk
    q = random_array((1, seqlen, heads, head_dim), dtype)
    k, v = (random_array((1, seqlen, kv_heads, head_dim), dtype) for _ in range(2))
    dout = random_array(q.shape, dtype)

    out, lse, (dq, dk, dv), _ = _ring_forward_and_backward(
        world, q, k, v, dout, causal=causal, window_size=window
    )
    assert_matches_reference(q, k, v, out, lse, causal=causal, window_size=window)
    assert_gradients_match(dout, q, k, v, dq, dk, dv, causal=causal, window_size=window)


@pytest.mark.parametrize("world,causal,window", [(2, True, (-1, -1)), (3, True, (5, -1))])
def test_ring_attention_with_sinks_and_a_softcap_matches_the_whole_sequence(world, causal, window):
    """Gemma-style softcap and gpt-oss-style sinks around the ring: out and lse against the
    reference on the whole sequence, dq, dk, dv against its gradients, and the ranks' dsinks
    summed as the formula gives it over the whole out and lse."""
    chunk, heads, kv_heads, head_dim = 4, 2, 1, 16
    seqlen = 2 * world * chunk
    q = random_array((1, seqlen, heads, head_dim), "float16") * 3
    k, v = (random_array((1, seqlen, kv_heads, head_dim), "float16") for _ in range(2))
    dout = random_array(q.shape, "float16")
    sinks_host = np.random.default_rng(15).normal(size=heads).astype(np.float32)
    sinks = xp.asarray(sinks_host)
    variants = Variants(softcap=2.0, sinks=sinks_host)
    mask = dict(causal=causal, window_size=window)
    out, lse, (dq, dk, dv, _), results = _ring_forward_and_backward(
        world, q, k, v, dout, softcap=2.0, sinks=sinks, **mask
    )
    assert_matches_reference(q, k, v, out, lse, variants=variants, **mask)
    assert_gradients_match(dout, q, k, v, dq, dk, dv, variants=variants, **mask)
    dsinks = sum(to_numpy(r[2][3]).astype(np.float64) for r in results)
    delta = (to_numpy(to_float64(dout)) * to_numpy(to_float64(out))).sum(axis=3)  # (b, s, h)
    terms = np.exp(sinks_host[None, :, None] - to_numpy(lse).astype(np.float64))
    want = -(terms * delta.transpose(0, 2, 1)).sum(axis=(0, 2))
    np.testing.assert_allclose(dsinks, want, rtol=1e-4, atol=1e-5)


def test_ring_attention_refuses_what_it_cannot_do():
    q = random_array((1, 8, 2, 16), "float16")
    ring = LocalRing.group(1)[0]
    with pytest.raises(ValueError, match="window_size"):
        ring_attention(q, q, q, ring, window_size=(4, -2))
    with pytest.raises(ValueError, match="one even length"):
        ring_attention(q[:, :7], q[:, :7], q[:, :7], ring)
    with pytest.raises(TypeError, match="NcclCommunicator"):
        ring_attention(q, q, q, object())
    assert distributed.__all__  # the module's public names


def test_a_ring_of_one_is_plain_attention():
    q, k, v = (random_array((2, 12, 2, 16), "float16") for _ in range(3))
    out, lse = ring_attention(q, k, v, LocalRing.group(1)[0], causal=True, return_lse=True)
    assert_matches_reference(q, k, v, out, lse, causal=True)
    assert out.dtype == q.dtype and lse.dtype == np.float32


def test_a_rank_that_fails_stops_the_ring_instead_of_hanging_it():
    def rank_work(rank, ring):
        if rank == 1:
            raise ValueError("rank 1 gives up")
        return ring.shift([xp.zeros(3)]).wait()  # waits for rank 1, which never shifts

    with pytest.raises(RuntimeError, match="rank 1 gives up|a rank of the ring stopped"):
        _on_every_rank(2, rank_work)


def test_a_window_moved_to_a_block_keeps_exactly_the_pairs_it_sees():
    """distributed._visible against brute force: the part of a block it keeps, with the window
    it gives numflash.attention there (aligned bottom-right), sees exactly the pairs the global
    window lets through, and nothing it cuts off sees anything."""
    from numflash.distributed import _visible

    def api_sees(i, j, rows, keys, left, right):  # numflash.attention's window rule
        d = keys - rows
        return (left < 0 or j >= i + d - left) and (right < 0 or j <= i + d + right)

    for q_first in range(0, 13, 3):
        for k_first in range(0, 13, 4):
            for left in (-1, 0, 2, 5):
                for right in (-1, 0, 1, 4):
                    want = {
                        (i, j)
                        for i in range(4)
                        for j in range(5)
                        if (left < 0 or k_first + j >= q_first + i - left)
                        and (right < 0 or k_first + j <= q_first + i + right)
                    }
                    found = _visible(q_first, 4, k_first, 5, left, right)
                    if found is None:
                        assert not want
                        continue
                    rows, keys, (wl, wr) = found
                    assert wl >= -1 and wr >= -1 and (wl != -1 or left < 0)
                    sq, sk = rows.stop - rows.start, keys.stop - keys.start
                    got = {
                        (rows.start + i, keys.start + j)
                        for i in range(sq)
                        for j in range(sk)
                        if api_sees(i, j, sq, sk, wl, wr)
                    }
                    assert got == want, (q_first, k_first, left, right)
