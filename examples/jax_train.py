"""Train a small attention model in JAX with numflash's attention inside a jitted train step,
beside the same model on jax.nn.dot_product_attention.

    python examples/jax_train.py [--steps 200] [--seqlen 32] [--batch 32] [--dim 64]

The model: token and position embeddings, one causal multi-head attention layer (bf16 q, k, v;
numflash.jax.attention or jax.nn.dot_product_attention with implementation "xla"), a residual
connection, a two-layer MLP and a linear read-out. The task: output the token three positions
back, which the layer solves only by attending there.
Both runs start from the same parameters and see the same batches; every step is one
``jax.jit`` of the loss, ``jax.value_and_grad`` and an Adam update, so numflash's forward and
backward run inside XLA's program (numflash.jax's buffer_callback). Prints both loss curves
and their largest difference: they agree to bf16's rounding, the attention's only difference.

On a GPU, JAX's CUDA backend; without one, JAX's CPU backend and numflash's CUDA simulator
(tiny sizes: the simulator runs every GPU thread in Python).
"""

import argparse
import functools
import math
import os

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # numflash's buffers are CuPy's

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import numflash.jax as njax  # noqa: E402


def init_params(key, vocab, seqlen, dim):
    keys = jax.random.split(key, 8)

    def normal(k, *shape, scale):
        return jax.random.normal(k, shape, jnp.float32) * scale

    s = 1 / math.sqrt(dim)
    return {
        "tok": normal(keys[0], vocab, dim, scale=1.0),
        "pos": normal(keys[1], seqlen, dim, scale=1.0),
        "wqkv": normal(keys[2], dim, 3 * dim, scale=s),
        "wo": normal(keys[3], dim, dim, scale=s),
        "w1": normal(keys[4], dim, 2 * dim, scale=s),
        "w2": normal(keys[5], 2 * dim, dim, scale=1 / math.sqrt(2 * dim)),
        "out": normal(keys[6], dim, vocab, scale=s),
    }


def numflash_attention(q, k, v):
    return njax.attention(q, k, v, causal=True)


def jax_attention(q, k, v):
    return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="xla")


def loss_fn(params, tokens, targets, heads, attend):
    """Mean cross-entropy of the logits against ``targets``; ``attend`` takes bf16 (batch, seqlen,
    heads, head_dim) q, k, v."""
    batch, seqlen = tokens.shape
    dim = params["tok"].shape[1]
    x = params["tok"][tokens] + params["pos"][None, :seqlen]
    qkv = (x @ params["wqkv"]).reshape(batch, seqlen, 3, heads, dim // heads)
    q, k, v = (qkv[:, :, i].astype(jnp.bfloat16) for i in range(3))
    att = attend(q, k, v).astype(jnp.float32).reshape(batch, seqlen, dim)
    x = x + att @ params["wo"]
    x = x + jax.nn.gelu(x @ params["w1"]) @ params["w2"]
    logits = x @ params["out"]
    logp = jax.nn.log_softmax(logits, axis=-1)
    return -jnp.take_along_axis(logp, targets[..., None], axis=-1).mean()


def adam_init(params):
    zeros = jax.tree_util.tree_map(jnp.zeros_like, params)
    return zeros, zeros, jnp.zeros((), jnp.int32)


@functools.partial(jax.jit, static_argnames=("heads", "attend", "lr"))
def train_step(params, opt, tokens, targets, heads, attend, lr=3e-3):
    """One jitted step: loss, gradients (through numflash's backward where ``attend`` is
    numflash's) and an Adam update."""
    loss, grads = jax.value_and_grad(loss_fn)(params, tokens, targets, heads, attend)
    m, v, t = opt
    t = t + 1
    m = jax.tree_util.tree_map(lambda m, g: 0.9 * m + 0.1 * g, m, grads)
    v = jax.tree_util.tree_map(lambda v, g: 0.999 * v + 0.001 * g * g, v, grads)
    c1, c2 = 1 - 0.9**t, 1 - 0.999**t
    params = jax.tree_util.tree_map(
        lambda p, m, v: p - lr * (m / c1) / (jnp.sqrt(v / c2) + 1e-8), params, m, v
    )
    return params, (m, v, t), loss


#: The task: each position outputs the token SHIFT positions before it (its own where there is
#: none), which a causal attention layer solves by attending SHIFT keys back.
SHIFT = 3


def batch_of(rng, batch, seqlen, vocab):
    """Random tokens and their targets: the token SHIFT positions earlier (or itself)."""
    tokens = rng.integers(0, vocab, size=(batch, seqlen))
    targets = tokens.copy()
    targets[:, SHIFT:] = tokens[:, :-SHIFT]
    return jnp.asarray(tokens, jnp.int32), jnp.asarray(targets, jnp.int32)


def train(steps=200, batch=32, seqlen=32, dim=64, heads=4, vocab=16, seed=0, out=print):
    """Both runs' losses, step by step: {"numflash": [...], "jax": [...]}."""
    params0 = init_params(jax.random.PRNGKey(seed), vocab, seqlen, dim)
    runs = {"numflash": numflash_attention, "jax": jax_attention}
    state = {name: (params0, adam_init(params0)) for name in runs}
    losses = {name: [] for name in runs}
    rng = np.random.default_rng(seed)
    for step in range(steps):
        tokens, targets = batch_of(rng, batch, seqlen, vocab)
        for name, attend in runs.items():
            params, opt = state[name]
            params, opt, loss = train_step(params, opt, tokens, targets, heads, attend)
            state[name] = (params, opt)
            losses[name].append(float(loss))
        if step % 20 == 0 or step == steps - 1:
            out(f"step {step:4d}  loss numflash {losses['numflash'][-1]:.4f}  "
                f"jax {losses['jax'][-1]:.4f}")  # fmt: skip
    gap = max(abs(a - b) for a, b in zip(losses["numflash"], losses["jax"]))
    out(f"largest difference between the loss curves: {gap:.4f} (from ln(vocab) = "
        f"{math.log(vocab):.3f})")  # fmt: skip
    return losses


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--seqlen", type=int, default=32)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--heads", type=int, default=4)
    args = ap.parse_args()
    train(args.steps, args.batch, args.seqlen, args.dim, args.heads)


if __name__ == "__main__":
    main()
