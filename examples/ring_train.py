"""examples/train_reverse.py's model trained with its sequence split across ranks (ring attention).

    python examples/ring_train.py [--world 2] [--steps 300] [--seqlen 32] [--batch 64] [--nccl]

Each rank holds a zigzag shard of every sequence's positions (numflash.distributed.shard):
embeddings, projections and read-out run on its own tokens, the attention layer runs as
ring_attention over the ring of ranks (its keys and values travel, its gradients come back),
and the parameter gradients are the sum of every rank's. So the loss is the one the whole
sequence gives on one device: the script prints both for the first batch, then trains.

The ranks are threads of this process: on one device over a LocalRing (also in Numba's
simulator, with tiny sizes), or with ``--nccl`` one GPU each over NCCL.
"""

import argparse
import math
import threading
import time

import numpy as np
from train_reverse import Adam, init_params, loss_and_grads, xp

from numflash import distributed


def rank_loss_and_grads(params, tokens, targets, heads, rank, world, ring):
    """The sum of the cross-entropy over this rank's tokens (scaled by the whole batch's token
    count, as train_reverse's mean), its correct guesses, and its part of every gradient."""
    batch, seqlen = tokens.shape
    dim = params["wq"].shape[0]
    head_dim = dim // heads
    mine = distributed.shard(xp.arange(seqlen), rank, world, axis=0)  # this rank's positions
    tok, tgt = tokens[:, mine], targets[:, mine]
    local = len(mine)
    n_all = batch * seqlen

    x = params["tok"][tok] + params["pos"][mine][None]
    split = (batch, local, heads, head_dim)
    q, k, v = ((x @ params[w]).reshape(split).astype(np.float16) for w in ("wq", "wk", "wv"))
    att, lse = distributed.ring_attention(q, k, v, ring, return_lse=True)
    a = att.astype(np.float32).reshape(batch, local, dim)
    h = x + a @ params["wo"]
    logits = h @ params["out"]
    logits -= logits.max(axis=-1, keepdims=True)
    probs = xp.exp(logits)
    probs /= probs.sum(axis=-1, keepdims=True)
    one_hot = xp.eye(probs.shape[-1], dtype=np.float32)[tgt]
    loss_sum = float(-(xp.log(probs + 1e-9) * one_hot).sum()) / n_all
    correct = int((probs.argmax(axis=-1) == tgt).sum())

    n = batch * local
    dlogits = (probs - one_hot) / n_all
    grads = {"out": h.reshape(n, dim).T @ dlogits.reshape(n, -1)}
    dh = dlogits @ params["out"].T
    grads["wo"] = a.reshape(n, dim).T @ dh.reshape(n, dim)
    da = (dh @ params["wo"].T).reshape(split).astype(np.float16)
    dq, dk, dv = distributed.ring_attention_backward(da, q, k, v, att, lse, ring)
    dx = dh
    for w, g in (("wq", dq), ("wk", dk), ("wv", dv)):
        g = g.astype(np.float32).reshape(batch, local, dim)
        grads[w] = x.reshape(n, dim).T @ g.reshape(n, dim)
        dx = dx + g @ params[w].T
    grads["pos"] = xp.zeros_like(params["pos"])
    grads["pos"][mine] = dx.sum(axis=0)
    grads["tok"] = xp.zeros_like(params["tok"])
    if xp is np:
        np.add.at(grads["tok"], tok.ravel(), dx.reshape(n, dim))
    else:
        import cupyx

        cupyx.scatter_add(grads["tok"], tok.ravel(), dx.reshape(n, dim))
    return loss_sum, correct, grads


def _on_device(rank, nccl):
    if not nccl:
        return _Nothing()
    import cupy

    return cupy.cuda.Device(rank)


class _Nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _to_device(x, rank, nccl):
    """``x`` on rank ``rank``'s device (through the host: this is a toy)."""
    if not nccl:
        return x
    import cupy

    with cupy.cuda.Device(rank):
        return cupy.asarray(cupy.asnumpy(x))


def ring_loss_and_grads(params, tokens, targets, heads, rings, nccl=False):
    """(mean loss, accuracy, gradients) of one batch, its sequence split over ``rings``' ranks,
    each in a thread; the gradients summed on the first rank's device."""
    world = len(rings)
    results, errors = [None] * world, []

    def run(rank):
        try:
            with _on_device(rank, nccl):
                mine = {k: _to_device(p, rank, nccl) for k, p in params.items()}
                data = [_to_device(a, rank, nccl) for a in (tokens, targets)]
                results[rank] = rank_loss_and_grads(mine, *data, heads, rank, world, rings[rank])
        except BaseException as exc:
            errors.append((rank, exc))
            if hasattr(rings[rank], "stop"):
                rings[rank].stop()

    threads = [threading.Thread(target=run, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise RuntimeError(f"rank {errors[0][0]} failed: {errors[0][1]!r}") from errors[0][1]
    loss = sum(r[0] for r in results)
    accuracy = sum(r[1] for r in results) / tokens.size
    grads = {name: sum(_to_device(r[2][name], 0, nccl) for r in results) for name in results[0][2]}
    return loss, accuracy, grads


def make_rings(world, nccl):
    if nccl:
        return distributed.nccl_communicators(list(range(world)))
    return distributed.LocalRing.group(world)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--seqlen", type=int, default=32)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--vocab", type=int, default=16)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--nccl", action="store_true", help="one GPU a rank, NCCL between them")
    args = ap.parse_args(argv)
    if args.seqlen % (2 * args.world):
        ap.error(f"--seqlen must be a multiple of 2 x --world = {2 * args.world}")
    rng = np.random.default_rng(0)
    params = init_params(rng, args.vocab, args.seqlen, args.dim)
    rings = make_rings(args.world, args.nccl)
    opt = Adam(params, args.lr)
    start = time.perf_counter()
    history = []
    for step in range(1, args.steps + 1):
        tokens = xp.asarray(rng.integers(0, args.vocab, size=(args.batch, args.seqlen)))
        targets = tokens[:, ::-1].copy()
        loss, accuracy, grads = ring_loss_and_grads(
            params, tokens, targets, args.heads, rings, args.nccl
        )
        if step == 1:
            whole = loss_and_grads(params, tokens, targets, args.heads)[0]
            print(f"first batch: loss {loss:.5f} over {args.world} ranks, {whole:.5f} on one")
        opt.step(params, grads)
        history.append((step, loss, accuracy))
        if step % 25 == 0 or step == args.steps:
            print(f"step {step:4d}  loss {loss:.4f}  accuracy {accuracy:.3f}  "
                  f"({time.perf_counter() - start:.1f} s)")  # fmt: skip
    print(
        f"loss {history[0][1]:.4f} -> {history[-1][1]:.4f} (ln(vocab) = {math.log(args.vocab):.4f})"
    )
    return history


if __name__ == "__main__":
    main()
