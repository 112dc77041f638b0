"""Train one attention layer to reverse a sequence, with CuPy and numflash alone.

    python examples/train_reverse.py [--steps 300] [--seqlen 32] [--batch 64] [--softcap 50]
        [--alibi]

The model: token and position embeddings, one multi-head attention layer (numflash.attention,
fp16), a residual connection and a linear read-out. The task: output the input sequence
backwards, which the layer can only solve by attending from position i to position L-1-i. Every
gradient is written out below with CuPy matmuls; the attention's comes from
numflash.attention_backward. No autograd framework is involved. ``--softcap`` caps the
attention's scores as Gemma 2 does (softcap * tanh(s / softcap)), forward and backward;
``--alibi`` biases them by distance as BLOOM does (alibi_slopes: BLOOM's slopes a head).

Prints the loss and accuracy as it trains; the loss falls from ln(vocab) towards 0.
In Numba's CUDA simulator (no GPU) the same script runs on NumPy arrays, slowly: use tiny sizes.
"""

import argparse
import functools
import math
import time

import numpy as np

import numflash
from numflash.kernels.jit import SIMULATOR

if SIMULATOR:
    xp = np
else:
    import cupy as xp


def init_params(rng, vocab, seqlen, dim):
    def normal(*shape, scale):
        return xp.asarray(rng.standard_normal(shape).astype(np.float32) * scale)

    return {
        "tok": normal(vocab, dim, scale=1.0),
        "pos": normal(seqlen, dim, scale=1.0),
        "wq": normal(dim, dim, scale=1 / math.sqrt(dim)),
        "wk": normal(dim, dim, scale=1 / math.sqrt(dim)),
        "wv": normal(dim, dim, scale=1 / math.sqrt(dim)),
        "wo": normal(dim, dim, scale=1 / math.sqrt(dim)),
        "out": normal(dim, vocab, scale=1 / math.sqrt(dim)),
    }


def alibi_slopes(heads):
    """BLOOM's ALiBi slopes: 2^(-8 (h + 1) / heads) for head h, float32 on the arrays' device."""
    return xp.asarray(2.0 ** (-8.0 * np.arange(1, heads + 1) / heads), dtype=np.float32)


def loss_and_grads(params, tokens, targets, heads, softcap=0.0, alibi=False):
    """Cross-entropy of the model on one batch, and its gradient for every parameter; with a
    ``softcap``, the attention's scores capped as Gemma 2 caps them, with ``alibi`` biased as
    BLOOM biases them (the forward and backward given the same values)."""
    variants = dict(softcap=softcap, alibi_slopes=alibi_slopes(heads) if alibi else None)
    loss_sum, correct, grads = part_loss_and_grads(
        params,
        tokens,
        targets,
        heads,
        xp.arange(tokens.shape[1]),
        tokens.size,
        functools.partial(_attend, **variants),
        functools.partial(_attend_backward, **variants),
    )
    return loss_sum, correct / tokens.size, grads


def _attend(q, k, v, softcap=0.0, alibi_slopes=None):
    return numflash.attention(q, k, v, return_lse=True, softcap=softcap, alibi_slopes=alibi_slopes)


def _attend_backward(dout, q, k, v, out, lse, softcap=0.0, alibi_slopes=None):
    return numflash.attention_backward(
        dout, q, k, v, out, lse, softcap=softcap, alibi_slopes=alibi_slopes
    )


def part_loss_and_grads(params, tokens, targets, heads, positions, n_all, attend, attend_backward):
    """The model on the tokens at ``positions`` of each sequence (``tokens`` and ``targets``
    hold every position), its attention through ``attend(q, k, v) -> (out, lse)`` and
    ``attend_backward(dout, q, k, v, out, lse) -> (dq, dk, dv)``: (the cross-entropy summed
    over these tokens / ``n_all``, how many it guesses right, its gradient for every
    parameter). With every position and n_all the batch's token count: the batch's mean loss."""
    tokens, targets = tokens[:, positions], targets[:, positions]
    batch, seqlen = tokens.shape
    dim = params["wq"].shape[0]
    head_dim = dim // heads

    # -- forward
    x = params["tok"][tokens] + params["pos"][positions][None]  # (B, L, D)
    split = (batch, seqlen, heads, head_dim)
    q, k, v = ((x @ params[w]).reshape(split).astype(np.float16) for w in ("wq", "wk", "wv"))
    att, lse = attend(q, k, v)
    a = att.astype(np.float32).reshape(batch, seqlen, dim)
    h = x + a @ params["wo"]
    logits = h @ params["out"]
    logits -= logits.max(axis=-1, keepdims=True)
    probs = xp.exp(logits)
    probs /= probs.sum(axis=-1, keepdims=True)
    one_hot = xp.eye(probs.shape[-1], dtype=np.float32)[targets]
    loss = float(-(xp.log(probs + 1e-9) * one_hot).sum()) / n_all
    correct = int((probs.argmax(axis=-1) == targets).sum())

    # -- backward
    n = batch * seqlen
    dlogits = (probs - one_hot) / n_all
    grads = {"out": h.reshape(n, dim).T @ dlogits.reshape(n, -1)}
    dh = dlogits @ params["out"].T
    grads["wo"] = a.reshape(n, dim).T @ dh.reshape(n, dim)
    da = (dh @ params["wo"].T).reshape(split).astype(np.float16)
    dq, dk, dv = attend_backward(da, q, k, v, att, lse)
    dx = dh
    for w, g in (("wq", dq), ("wk", dk), ("wv", dv)):
        g = g.astype(np.float32).reshape(batch, seqlen, dim)
        grads[w] = x.reshape(n, dim).T @ g.reshape(n, dim)
        dx = dx + g @ params[w].T
    grads["pos"] = xp.zeros_like(params["pos"])
    grads["pos"][positions] = dx.sum(axis=0)
    grads["tok"] = xp.zeros_like(params["tok"])
    if xp is np:
        np.add.at(grads["tok"], tokens.ravel(), dx.reshape(n, dim))
    else:
        import cupyx

        cupyx.scatter_add(grads["tok"], tokens.ravel(), dx.reshape(n, dim))
    return loss, correct, grads


class Adam:
    def __init__(self, params, lr, betas=(0.9, 0.98), eps=1e-8):
        self.lr, self.betas, self.eps, self.t = lr, betas, eps, 0
        self.m = {k: xp.zeros_like(p) for k, p in params.items()}
        self.v = {k: xp.zeros_like(p) for k, p in params.items()}

    def step(self, params, grads):
        self.t += 1
        b1, b2 = self.betas
        for name, g in grads.items():
            self.m[name] = b1 * self.m[name] + (1 - b1) * g
            self.v[name] = b2 * self.v[name] + (1 - b2) * g * g
            m_hat = self.m[name] / (1 - b1**self.t)
            v_hat = self.v[name] / (1 - b2**self.t)
            params[name] -= self.lr * m_hat / (xp.sqrt(v_hat) + self.eps)


def train(
    steps=300,
    seqlen=32,
    batch=64,
    vocab=16,
    dim=64,
    heads=4,
    lr=3e-3,
    seed=0,
    log_every=25,
    out=print,
    softcap=0.0,
    alibi=False,
):
    """Train and return the list of (step, loss, accuracy)."""
    rng = np.random.default_rng(seed)
    params = init_params(rng, vocab, seqlen, dim)
    opt = Adam(params, lr)
    history = []
    start = time.perf_counter()
    for step in range(1, steps + 1):
        tokens = xp.asarray(rng.integers(0, vocab, size=(batch, seqlen)))
        targets = tokens[:, ::-1].copy()
        loss, accuracy, grads = loss_and_grads(params, tokens, targets, heads, softcap, alibi)
        opt.step(params, grads)
        history.append((step, loss, accuracy))
        if step == 1 or step % log_every == 0 or step == steps:
            out(
                f"step {step:4d}  loss {loss:.4f}  accuracy {accuracy:.3f}  "
                f"({time.perf_counter() - start:.1f} s)"
            )
    return history


def add_arguments(ap):
    """The model's and the training's options (examples/ring_train.py takes them too)."""
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--seqlen", type=int, default=32)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--vocab", type=int, default=16)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--lr", type=float, default=3e-3)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(ap)
    ap.add_argument(
        "--softcap", type=float, default=0.0, help="cap the attention scores (Gemma 2: 50)"
    )
    ap.add_argument("--alibi", action="store_true", help="ALiBi with BLOOM's slopes")
    args = ap.parse_args()
    sizes = (args.steps, args.seqlen, args.batch, args.vocab, args.dim, args.heads, args.lr)
    history = train(*sizes, softcap=args.softcap, alibi=args.alibi)
    first, last = history[0][1], history[-1][1]
    print(f"loss {first:.4f} -> {last:.4f} (ln(vocab) = {math.log(args.vocab):.4f})")


if __name__ == "__main__":
    main()
