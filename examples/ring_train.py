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
import time

import numpy as np
from train_reverse import Adam, add_arguments, init_params, loss_and_grads, part_loss_and_grads, xp

from numflash import distributed


def rank_loss_and_grads(params, tokens, targets, heads, rank, world, ring):
    """This rank's part (train_reverse.part_loss_and_grads) on its zigzag shard of every
    sequence's positions, the attention over the ring."""

    def attend(q, k, v):
        return distributed.ring_attention(q, k, v, ring, return_lse=True)

    def attend_backward(dout, q, k, v, out, lse):
        return distributed.ring_attention_backward(dout, q, k, v, out, lse, ring)

    positions = distributed.shard(xp.arange(tokens.shape[1]), rank, world, axis=0)
    return part_loss_and_grads(
        params, tokens, targets, heads, positions, tokens.size, attend, attend_backward
    )


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

    def run(rank, ring):
        mine = {k: _to_device(p, rank, nccl) for k, p in params.items()}
        data = [_to_device(a, rank, nccl) for a in (tokens, targets)]
        return rank_loss_and_grads(mine, *data, heads, rank, world, ring)

    results = distributed.run_ranks(run, rings, devices=range(world) if nccl else None)
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
    add_arguments(ap)
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
