"""Greedy decoding in JAX over paged KV caches: numflash.jax.attention_with_kvcache inside one
``jax.jit`` of a ``jax.lax.fori_loop``, the caches carried through the loop and appended in
place.

    python examples/jax_decode.py [--batch 8] [--layers 4] [--prompt 16] [--new 48]

The model: a toy decoder (token and position embeddings, ``--layers`` attention layers with
grouped-query heads and residual connections, a linear read-out), random weights. Each step
feeds every sequence's current token through the layers; each layer's attention appends the
step's key and value to its paged cache (pages of 16 tokens, each sequence's pages scattered
through the cache by its block table) and attends over everything cached so far. The prompt is
fed the same way, one token a step, then the argmax token is fed back. The caches are the
loop's carry and the jit's donated arguments, and numflash's outputs alias them
(input_output_aliases), so that XLA can hand numflash the same buffers every step instead of
copying a cache (benchmarks/bench_jax.py checks a jitted step of this kind on the GPU: the
device memory in use is the same after it; this loop's own was not measured).

The check: the logits each step produced equal, within bf16's rounding, those of one causal
forward pass over the whole generated sequence with jax.nn.dot_product_attention. Prints the
tokens and the largest difference. On a GPU, JAX's CUDA backend; without one, JAX's CPU backend
and numflash's CUDA simulator (tiny sizes).
"""

import argparse
import math
import os

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # numflash's buffers are CuPy's

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import numflash.jax as njax  # noqa: E402

PAGE = 16


def init_params(key, vocab, length, dim, layers, heads, kv_heads):
    head_dim = dim // heads
    keys = iter(jax.random.split(key, 3 + 4 * layers))
    s = 1 / math.sqrt(dim)

    def normal(*shape, scale):
        return jax.random.normal(next(keys), shape, jnp.float32) * scale

    return {
        "tok": normal(vocab, dim, scale=1.0),
        "pos": normal(length, dim, scale=1.0),
        "out": normal(dim, vocab, scale=s),
        "layers": [
            {
                "wq": normal(dim, heads * head_dim, scale=s),
                "wk": normal(dim, kv_heads * head_dim, scale=s),
                "wv": normal(dim, kv_heads * head_dim, scale=s),
                "wo": normal(heads * head_dim, dim, scale=s),
            }
            for _ in range(layers)
        ],
    }


def projections(layer, x, heads, kv_heads):
    """bf16 q (batch, rows, heads, head_dim), k and v (..., kv_heads, head_dim) of ``x``."""
    batch, rows, dim = x.shape
    head_dim = dim // heads

    def split(w, n):
        return (x @ w).reshape(batch, rows, n, head_dim).astype(jnp.bfloat16)

    return split(layer["wq"], heads), split(layer["wk"], kv_heads), split(layer["wv"], kv_heads)


def step_logits(params, tokens, position, caches, seqlens, block_table, heads, kv_heads):
    """One decoding step: the logits after ``tokens`` (batch,) at ``position``, and the caches
    with this step's keys and values appended."""
    x = (params["tok"][tokens] + params["pos"][position])[:, None]  # (batch, 1, dim)
    new_caches = []
    for layer, (k_cache, v_cache) in zip(params["layers"], caches):
        q, k, v = projections(layer, x, heads, kv_heads)
        out, k_cache, v_cache = njax.attention_with_kvcache(
            q, k_cache, v_cache, k, v, cache_seqlens=seqlens, block_table=block_table,
            causal=True,
        )  # fmt: skip
        x = x + out.astype(jnp.float32).reshape(x.shape[0], 1, -1) @ layer["wo"]
        new_caches.append((k_cache, v_cache))
    return (x[:, 0] @ params["out"]), tuple(new_caches)


def generate(params, prompt, caches, block_table, total, heads, kv_heads):
    """Feed ``prompt`` (batch, prompt_len) a token a step, then the argmax token, until
    ``total`` tokens: (tokens (batch, total), logits of each step (total - 1, batch, vocab),
    caches). One fori_loop; the caches are its carry."""
    batch, prompt_len = prompt.shape
    vocab = params["out"].shape[1]
    tokens = jnp.zeros((batch, total), jnp.int32).at[:, :prompt_len].set(prompt)
    logits_all = jnp.zeros((total - 1, batch, vocab), jnp.float32)

    def body(t, carry):
        tokens, logits_all, caches = carry
        seqlens = jnp.full((batch,), t, jnp.int32)  # tokens cached before this step's
        logits, caches = step_logits(
            params, tokens[:, t], t, caches, seqlens, block_table, heads, kv_heads
        )
        following = jnp.where(t + 1 < prompt_len, tokens[:, t + 1], jnp.argmax(logits, -1))
        tokens = tokens.at[:, t + 1].set(following.astype(jnp.int32))
        return tokens, logits_all.at[t].set(logits), caches

    return jax.lax.fori_loop(0, total - 1, body, (tokens, logits_all, caches))


def full_logits(params, tokens, heads, kv_heads):
    """Logits at every position of ``tokens`` from one causal pass, jax.nn.dot_product_attention
    over the whole sequence (the reference)."""
    x = params["tok"][tokens] + params["pos"][None, : tokens.shape[1]]
    for layer in params["layers"]:
        q, k, v = projections(layer, x, heads, kv_heads)
        out = jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="xla")
        x = x + out.astype(jnp.float32).reshape(x.shape) @ layer["wo"]
    return x @ params["out"]


def run(batch=8, layers=4, prompt_len=16, new=48, dim=256, heads=8, kv_heads=2, vocab=64,
        seed=0, out=print):  # fmt: skip
    """Generate, check against the full pass; returns (tokens, largest logit difference, the
    scale of the logits)."""
    total = prompt_len + new
    pages_per_seq = -(-total // PAGE)
    head_dim = dim // heads
    params = init_params(jax.random.PRNGKey(seed), vocab, total, dim, layers, heads, kv_heads)
    rng = np.random.default_rng(seed)
    prompt = jnp.asarray(rng.integers(0, vocab, size=(batch, prompt_len)), jnp.int32)
    # every sequence's pages scattered through one pool of pages per layer (and some spare)
    pages = batch * pages_per_seq + 3
    table = rng.permutation(pages)[: batch * pages_per_seq].reshape(batch, pages_per_seq)
    block_table = jnp.asarray(table, jnp.int32)
    shape = (pages, PAGE, kv_heads, head_dim)
    caches = tuple(
        (jnp.zeros(shape, jnp.bfloat16), jnp.zeros(shape, jnp.bfloat16)) for _ in range(layers)
    )
    decode = jax.jit(generate, static_argnums=(4, 5, 6), donate_argnums=(2,))
    tokens, logits, caches = decode(params, prompt, caches, block_table, total, heads, kv_heads)
    reference = full_logits(params, tokens, heads, kv_heads)[:, :-1].transpose(1, 0, 2)
    gap = float(jnp.abs(logits - reference).max())
    scale = float(jnp.abs(reference).max())
    out(f"generated (first sequence): {np.asarray(tokens[0, prompt_len:]).tolist()}")
    out(f"largest logit difference from one causal pass: {gap:.4f} (logits up to {scale:.2f})")
    return tokens, gap, scale


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--prompt", type=int, default=16)
    ap.add_argument("--new", type=int, default=48)
    args = ap.parse_args()
    run(args.batch, args.layers, args.prompt, args.new)


if __name__ == "__main__":
    main()
