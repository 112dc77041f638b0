"""numflash.distributed: the zigzag layout, and ring attention forward and backward over ranks
of one process (LocalRing, each rank a thread), against the float64 reference on the whole
sequence. In the simulator the kernels are numflash's portable ones on small shapes; on a GPU
the default kernels, every rank on the one GPU. NCCL between two GPUs is not tested yet."""

import threading

import numpy as np
import pytest
from support import assert_gradients_match, assert_matches_reference, random_array, xp

from numflash import distributed
from numflash.distributed import LocalRing, ring_attention, ring_attention_backward, shard, unshard


def _on_every_rank(world, fn):
    """[fn(rank, ring endpoint) for each rank], each rank in a thread of its own."""
    rings = LocalRing.group(world)
    results, errors = [None] * world, []

    def run(rank):
        try:
            results[rank] = fn(rank, rings[rank])
        except BaseException as exc:  # re-raised below, with the rank
            errors.append((rank, exc))
            rings[rank].stop()  # the other ranks stop waiting for this one

    threads = [threading.Thread(target=run, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=1800)
    if errors:
        rank, exc = errors[0]
        raise AssertionError(f"rank {rank} failed: {exc!r}") from exc
    return results


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
    "world,causal,dtype",
    [(2, True, "float16"), (3, True, "float16"), (2, False, "float16"), (3, True, "bfloat16")],
)
def test_ring_attention_matches_attention_on_the_whole_sequence(world, causal, dtype):
    chunk, heads, kv_heads, head_dim = 4, 2, 1, 16
    seqlen = 2 * world * chunk
    q = random_array((1, seqlen, heads, head_dim), dtype)
    k, v = (random_array((1, seqlen, kv_heads, head_dim), dtype) for _ in range(2))
    dout = random_array(q.shape, dtype)

    def rank_work(rank, ring):
        mine = [shard(x, rank, world) for x in (q, k, v, dout)]
        out, lse = ring_attention(*mine[:3], ring, causal=causal, return_lse=True)
        grads = ring_attention_backward(mine[3], *mine[:3], out, lse, ring, causal=causal)
        return out, lse, grads

    results = _on_every_rank(world, rank_work)
    out = unshard([r[0] for r in results])
    lse = unshard([r[1] for r in results], axis=2)
    assert_matches_reference(q, k, v, out, lse, causal=causal)
    dq, dk, dv = (unshard([r[2][i] for r in results]) for i in range(3))
    assert_gradients_match(dout, q, k, v, dq, dk, dv, causal=causal)


def test_ring_attention_refuses_what_it_cannot_do():
    q = random_array((1, 8, 2, 16), "float16")
    ring = LocalRing.group(1)[0]
    with pytest.raises(NotImplementedError, match="window_size"):
        ring_attention(q, q, q, ring, window_size=(4, 0))
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

    with pytest.raises(AssertionError, match="rank 1 gives up|a rank of the ring stopped"):
        _on_every_rank(2, rank_work)
