"""A seeded randomised differential test: problems drawn over shapes, GQA ratios, masks and
windows, dtypes, strides, seqlen_q != seqlen_k and head dims, forward and backward against the
float64 reference. 500 problems on a GPU, a few small ones in the simulator.

A failure prints the seed and the problem; ``NUMFLASH_RANDOM_SEED=N python -m pytest
tests/test_random.py`` draws another set.
"""

import os

import numpy as np
import pytest
from support import assert_gradients_match, assert_matches_reference, poisoned_like, random_array

import numflash
from numflash.kernels.jit import SIMULATOR

SEED = int(os.environ.get("NUMFLASH_RANDOM_SEED", "20261130"))
PROBLEMS = 6 if SIMULATOR else 500
#: Head dims drawn (a few, so that the kernels compiled stay few): padded and unpadded, wgmma's
#: and mma.sync's, the largest.
HEAD_DIMS = [8, 24] if SIMULATOR else [8, 40, 64, 100, 128, 256]
MAX_SEQLEN = 24 if SIMULATOR else 300
GQA = [1, 2] if SIMULATOR else [1, 2, 4, 8]


def draw(rng):
    """One problem: a dict of the call's sizes, dtype, mask and layout."""
    dtype = str(rng.choice(["float16", "bfloat16", "float32"], p=[0.45, 0.45, 0.1]))
    head_dim = int(rng.choice(HEAD_DIMS[:2] if dtype == "float32" else HEAD_DIMS))
    nheads_k = int(rng.integers(1, 3))
    mask = str(rng.choice(["none", "causal", "window", "left"]))
    seqlen_q, seqlen_k = (int(n) for n in rng.integers(1, MAX_SEQLEN + 1, size=2))
    kwargs = {}
    if mask == "causal":
        kwargs["causal"] = True
    elif mask == "window":
        kwargs["window_size"] = tuple(int(w) for w in rng.integers(-1, MAX_SEQLEN // 2, size=2))
    elif mask == "left":
        kwargs["window_size"] = (int(rng.integers(0, MAX_SEQLEN)), -1)
    if rng.random() < 0.3:
        kwargs["softmax_scale"] = float(rng.uniform(-1.0, 1.0))
    return dict(
        dtype=dtype,
        batch=int(rng.integers(1, 3)),
        seqlen_q=seqlen_q,
        seqlen_k=seqlen_k,
        nheads=nheads_k * int(rng.choice(GQA)),
        nheads_k=nheads_k,
        head_dim=head_dim,
        transposed=bool(rng.random() < 0.3),  # (batch, heads, seqlen, dim) memory
        kwargs=kwargs,
    )


def _array(shape, dtype, transposed, rng):
    if not transposed:
        return random_array(shape, dtype, rng)
    b, s, h, d = shape
    return random_array((b, h, s, d), dtype, rng).transpose(0, 2, 1, 3)


def check(problem, rng):
    p = problem
    q = _array(
        (p["batch"], p["seqlen_q"], p["nheads"], p["head_dim"]), p["dtype"], p["transposed"], rng
    )
    k, v = (
        _array(
            (p["batch"], p["seqlen_k"], p["nheads_k"], p["head_dim"]),
            p["dtype"],
            p["transposed"],
            rng,
        )
        for _ in range(2)
    )
    out = poisoned_like(q)
    _, lse = numflash.attention(q, k, v, out=out, return_lse=True, **p["kwargs"])
    assert_matches_reference(q, k, v, out, lse, **p["kwargs"])
    dout = _array(q.shape, p["dtype"], p["transposed"], rng)
    grads = numflash.attention_backward(dout, q, k, v, out, lse, **p["kwargs"])
    assert_gradients_match(dout, q, k, v, *grads, **p["kwargs"])


def test_random_problems_match_the_reference():
    rng = np.random.default_rng(SEED)
    for index in range(PROBLEMS):
        problem = draw(rng)
        try:
            check(problem, rng)
        except Exception as exc:
            pytest.fail(
                f"seed {SEED}, problem {index}: {problem}\n{type(exc).__name__}: {exc}",
                pytrace=True,
            )
