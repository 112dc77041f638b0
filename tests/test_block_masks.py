"""Block masks (issue 32): ``numflash.block_mask`` evaluates a mask_mod per (query block, key
block) on the GPU; ``attention(..., block_mask=)`` skips the key tiles it hides from a whole
row block and mask_mod on the tiles it shows whole. Its kinds against the mask evaluated on the
host; the calls against the float64 reference with the same mask_mod (a block mask changes
what runs, never the result); a block mask for another shape, function or arrays refused."""

import functools

import numpy as np
import pytest
from numba import cuda
from support import (
    assert_gradients_match,
    assert_matches_reference,
    poisoned_like,
    random_array,
    random_qkv,
    to_numpy,
    wgmma_or_skip,
    xp,
)

import numflash
from numflash.kernels import block_mask as kernel_side
from numflash.kernels.jit import SIMULATOR
from numflash.reference import Variants

BLOCK = kernel_side.BLOCK_SIZE


@cuda.jit(device=True)
def same_document(b, h, q_idx, kv_idx, document):
    return document[q_idx] == document[kv_idx]


@functools.lru_cache(maxsize=None)
def _documents_of_heads():
    """(document ids, their block mask) of document_of_head over 2 x 2 x 290 x 320, made once
    for the tests that read them, as a model makes one for all its layers (in the simulator
    its 371,200 mask_mod calls took most of each test's time)."""
    document = _documents((100, 3, 150, 47, 20))
    return document, numflash.block_mask(document_of_head, 2, 2, 290, 320, mod_args=(document,))


@cuda.jit(device=True)
def document_of_head(b, h, q_idx, kv_idx, document):
    """Head 1's rows from 140 on see nothing (row blocks without keys); batch entry 1 sees
    keys before 40 beside its document."""
    if h == 1 and q_idx >= 140:
        return False
    return document[q_idx] == document[kv_idx] or (b == 1 and kv_idx < 40)


@cuda.jit(device=True)
def window_of(b, h, q_idx, kv_idx):
    """A sliding window of 100 keys back, written as a mask."""
    return kv_idx <= q_idx and q_idx - kv_idx < 100


@cuda.jit(device=True)
def wide_window(b, h, q_idx, kv_idx):
    """A window of 400 keys each way: FULL blocks beside PARTIAL ones."""
    return abs(q_idx - kv_idx) < 400


def _documents(lengths):
    return xp.asarray(np.repeat(np.arange(len(lengths)), lengths).astype(np.int32))


def _host_kinds(fn, batch, nheads, seqlen_q, seqlen_k, *args):
    """(batch, nheads, blocks_q, blocks_k) kinds of ``fn`` evaluated here."""
    host = [to_numpy(a) for a in args]
    blocks_q, blocks_k = -(-seqlen_q // BLOCK), -(-seqlen_k // BLOCK)
    kinds = np.zeros((batch, nheads, blocks_q, blocks_k), dtype=np.uint8)
    for b in range(batch):
        for h in range(nheads):
            seen = np.array([[bool(fn.py_func(b, h, i + seqlen_k - seqlen_q, j, *host))
                              for j in range(seqlen_k)] for i in range(seqlen_q)])  # fmt: skip
            for qb in range(blocks_q):
                for kb in range(blocks_k):
                    tile = seen[qb * BLOCK : (qb + 1) * BLOCK, kb * BLOCK : (kb + 1) * BLOCK]
                    kinds[b, h, qb, kb] = 2 if tile.all() else 1 if tile.any() else 0
    return kinds


def _assert_ranges(bm, expected):
    """``bm.index`` holds each query block's seen key blocks and its longest FULL run."""
    index = to_numpy(bm.index)
    ranges = index[kernel_side.HEADER : index[6]]
    ranges = ranges.reshape(expected.shape[:3] + (kernel_side.ROW_WORDS,))
    for b, h, qb in np.ndindex(*expected.shape[:3]):
        seen = np.flatnonzero(expected[b, h, qb])
        want = (seen[0], seen[-1] + 1) if seen.size else (0, 0)
        assert tuple(ranges[b, h, qb, :2]) == want
        full_lo, full_hi = ranges[b, h, qb, 2:]
        assert (expected[b, h, qb, full_lo:full_hi] == 2).all()
        flags = "".join("x" if kind == 2 else "." for kind in expected[b, h, qb])
        assert full_hi - full_lo == max(len(run) for run in flags.split("."))


def _assert_columns(bm, expected):
    """``bm.index``'s columns: each key block's seen query blocks."""
    index = to_numpy(bm.index)
    columns = index[index[6] :].reshape(expected.shape[:2] + (expected.shape[3], -1))
    for b, h, kb in np.ndindex(*columns.shape[:3]):
        seen = np.flatnonzero(expected[b, h, :, kb])
        want = (seen[0], seen[-1] + 1) if seen.size else (0, 0)
        assert tuple(columns[b, h, kb, :2]) == want


def test_the_kinds_and_ranges_match_the_mask_evaluated_on_the_host():
    document = _documents((100, 3, 150, 47))
    bm = numflash.block_mask(document_of_head, 2, 2, 300, 300, mod_args=(document,))
    expected = _host_kinds(document_of_head, 2, 2, 300, 300, document)
    assert bm.shape == expected.shape
    kinds = to_numpy(bm.kinds).reshape(expected.shape)
    np.testing.assert_array_equal(kinds, expected)
    assert tuple(to_numpy(bm.index)[:6]) == (2, 2, 3, 3, 300, 300)
    _assert_ranges(bm, expected)
    _assert_columns(bm, expected)
    counts = bm.counts()
    assert sum(counts.values()) == expected.size
    assert counts["empty"] == int((expected == 0).sum()) > 0
    assert bm.sparsity() == pytest.approx(counts["empty"] / expected.size)


@pytest.mark.parametrize("fn, seqlen_q, seqlen_k", [(window_of, 260, 400), (wide_window, 520, 520)])
def test_a_mask_the_same_for_every_batch_entry_and_head_is_made_once(fn, seqlen_q, seqlen_k):
    bm = numflash.block_mask(fn, None, None, seqlen_q, seqlen_k)
    expected = _host_kinds(fn, 1, 1, seqlen_q, seqlen_k)
    np.testing.assert_array_equal(to_numpy(bm.kinds).reshape(expected.shape), expected)
    _assert_ranges(bm, expected)
    _assert_columns(bm, expected)
    assert fn.__name__ in repr(bm) and bm.batch is None and bm.nheads is None
    assert (bm.counts()["full"] > 0) == (fn is wide_window)


@pytest.mark.parametrize("causal", [False, True])
def test_the_portable_forward_with_a_block_mask_matches_the_reference(causal):
    """Row blocks past their documents' keys (skipped tiles), head 1's row blocks without
    keys (output 0, lse -inf), GQA, fewer queries than keys."""
    document, bm = _documents_of_heads()
    q, k, v = random_qkv(2, 290, 320, 2, 1, 16, "float16")
    out = poisoned_like(q)
    cfg = numflash.PortableConfig(block_m=64, block_n=32)
    res, lse = numflash.attention(q, k, v, causal=causal, out=out, return_lse=True, config=cfg,
                                  block_mask=bm)  # fmt: skip
    assert res is out
    variants = Variants(mask_mod=document_of_head, mod_args=(document,))
    assert_matches_reference(q, k, v, out, lse, causal=causal, variants=variants)
    assert np.isneginf(to_numpy(lse)[0, 1, -1])


def test_the_mma_forward_with_a_block_mask_matches_the_reference():
    """The mma.sync forward (forward.mod_scores), causal: skipped tiles, and the wide
    window's runs of tiles shown whole, where it calls no mask_mod (the simulator evaluates
    a block mask a score at a time: 83k here)."""
    q, k, v = random_qkv(1, 160, 520, 1, 1, 16, "float16")
    bm = numflash.block_mask(wide_window, None, None, 160, 520)
    out = poisoned_like(q)
    cfg = numflash.TensorCoreConfig(64, 64, 4, 2)
    res, lse = numflash.attention(q, k, v, causal=True, out=out, return_lse=True, config=cfg,
                                  block_mask=bm)  # fmt: skip
    assert res is out
    assert_matches_reference(q, k, v, out, lse, causal=True,
                             variants=Variants(mask_mod=wide_window))  # fmt: skip


def test_the_backward_skips_what_the_block_mask_of_its_forward_hides():
    """dQ over each row block's seen keys, dK and dV over each key block's seen rows, per
    head of a GQA group (head 1's rows from 140 on see nothing), batch entries apart. (The
    forward is checked on this mask by the forward tests; the gradients' reference is made
    from q, k, v alone.)"""
    document, bm = _documents_of_heads()
    q, k, v = random_qkv(2, 290, 320, 2, 1, 16, "float16")
    out, lse = numflash.attention(q, k, v, causal=True, return_lse=True, block_mask=bm)
    variants = Variants(mask_mod=document_of_head, mod_args=(document,))
    dout = random_array(q.shape, "float16")
    cfg = numflash.PortableBackwardConfig(block_m=32, block_n=64)
    grads = numflash.attention_backward(dout, q, k, v, out, lse, causal=True, config=cfg,
                                        block_mask=bm)  # fmt: skip
    assert_gradients_match(dout, q, k, v, *grads, causal=True, variants=variants)


#: Backward configurations through the tensor-core skeleton (its block-mask ranges serve both
#: backends); in the simulator every score's user functions are Python calls: 35 minutes for
#: the mma.sync case below, so it is a slow test there.
TENSOR_CORE_BACKWARDS = [
    pytest.param(
        numflash.TensorCoreBackwardConfig(64, 4, 2, True),
        16,
        marks=pytest.mark.slow if SIMULATOR else (),
        id="mma",
    ),
    pytest.param(
        numflash.WgmmaBackwardConfig(num_warps=8, stages=2, dq_separate=False),
        64,
        marks=pytest.mark.slow if SIMULATOR else (),
        id="wgmma-fused",
    ),
]


def test_the_tensor_core_backward_skips_blocks_of_other_documents():
    """The mma.sync backward's kernels (the tensor-core skeleton's ranges) on two documents
    of 128 and 8 tokens, causal: the key blocks of the first skip the last rows, the last
    row block skips the first document's keys (GQA: the slow test below)."""
    document = _documents((128, 8))
    q, k, v = random_qkv(1, 136, 136, 1, 1, 16, "bfloat16")
    bm = numflash.block_mask(same_document, None, None, 136, 136, mod_args=(document,))
    out, lse = numflash.attention(q, k, v, causal=True, return_lse=True, block_mask=bm)
    variants = Variants(mask_mod=same_document, mod_args=(document,))
    dout = random_array(q.shape, "bfloat16")
    cfg = numflash.TensorCoreBackwardConfig(16, 1, 2, True)
    grads = numflash.attention_backward(dout, q, k, v, out, lse, causal=True, config=cfg,
                                        block_mask=bm)  # fmt: skip
    assert_gradients_match(dout, q, k, v, *grads, causal=True, variants=variants)


@pytest.mark.parametrize("config, head_dim", TENSOR_CORE_BACKWARDS)
def test_the_tensor_core_backwards_skip_what_the_block_mask_hides(config, head_dim):
    """As the portable backward's test through the tensor-core backwards' skeleton: a key
    block runs over the rows the block mask shows it to some head of its GQA group (head 1's
    rows from 140 on see nothing), a row block over its seen keys."""
    config = wgmma_or_skip(config)
    document, bm = _documents_of_heads()
    q, k, v = random_qkv(2, 290, 320, 2, 1, head_dim, "bfloat16")
    out, lse = numflash.attention(q, k, v, causal=True, return_lse=True, block_mask=bm)
    variants = Variants(mask_mod=document_of_head, mod_args=(document,))
    dout = random_array(q.shape, "bfloat16")
    grads = numflash.attention_backward(dout, q, k, v, out, lse, causal=True, config=config,
                                        block_mask=bm)  # fmt: skip
    assert_gradients_match(dout, q, k, v, *grads, causal=True, variants=variants)


@pytest.mark.skipif(SIMULATOR, reason="minutes a case in the simulator")
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
def test_the_hopper_forward_with_a_block_mask_matches_the_reference(causal, head_dim):
    """The default configuration (192-key tiles at head_dim 64: a tile over two blocks),
    documents of a packed sequence, head 1's row blocks without keys."""
    from numflash.device import current_device

    if not current_device().has_wgmma:
        pytest.skip("the Hopper forward needs compute capability 9.x")
    document = _documents((300, 3, 700, 160, 37))
    q, k, v = random_qkv(2, 1100, 1200, 4, 2, head_dim, "bfloat16")
    bm = numflash.block_mask(document_of_head, 2, 4, 1100, 1200, mod_args=(document,))
    out = poisoned_like(q)
    res, lse = numflash.attention(q, k, v, causal=causal, out=out, return_lse=True,
                                  block_mask=bm)  # fmt: skip
    assert res is out
    variants = Variants(mask_mod=document_of_head, mod_args=(document,))
    assert_matches_reference(q, k, v, out, lse, causal=causal, variants=variants)


@pytest.mark.skipif(SIMULATOR, reason="minutes a case in the simulator")
def test_the_hopper_forward_with_a_block_mask_and_a_score_mod():
    """Tiles the block mask shows whole call the score_mod alone."""
    from numflash.device import current_device

    if not current_device().has_wgmma:
        pytest.skip("the Hopper forward needs compute capability 9.x")

    @cuda.jit(device=True)
    def halved(score, b, h, q_idx, kv_idx):
        return score * 0.5 + 0.01 * h

    q, k, v = random_qkv(1, 700, 700, 2, 2, 128, "float16")
    bm = numflash.block_mask(wide_window, None, None, 700, 700)
    out, lse = numflash.attention(q, k, v, return_lse=True, score_mod=halved, block_mask=bm)
    variants = Variants(mask_mod=wide_window, score_mod=halved)
    assert_matches_reference(q, k, v, out, lse, variants=variants)
    assert bm.counts()["full"] > 0


def test_a_block_mask_is_checked_against_the_call():
    document = _documents((40, 24))
    q, k, v = random_qkv(1, 64, 64, 2, 2, 16, "float16")
    bm = numflash.block_mask(same_document, 1, 2, 64, 64, mod_args=(document,))
    with pytest.raises(TypeError, match="block_mask must be a numflash.BlockMask"):
        numflash.attention(q, k, v, block_mask=object())
    with pytest.raises(ValueError, match=r"block_mask was made for .*\(1, 2, 64, 64\).*64, 70"):
        q2, k2, v2 = random_qkv(1, 64, 70, 2, 2, 16, "float16")
        numflash.attention(q2, k2, v2, block_mask=bm)
    with pytest.raises(ValueError, match="mask_mod is not the function"):
        numflash.attention(q, k, v, mask_mod=window_of, block_mask=bm)
    with pytest.raises(ValueError, match="mod_args are not the arrays"):
        numflash.attention(q, k, v, mod_args=(document.copy(),), block_mask=bm)
    with pytest.raises(ValueError, match="mod_args are not the arrays"):
        numflash.attention_backward(q, q, k, v, q, xp.zeros((1, 2, 64), xp.float32),
                                    mod_args=(document.copy(),), block_mask=bm)  # fmt: skip
    numflash.attention(q, k, v, mask_mod=same_document, mod_args=(document,), block_mask=bm)


@pytest.mark.parametrize(
    "args, kwargs, error, match",
    [
        ((len, 1, 1, 8, 8), {}, TypeError, "mask_mod must be a Numba CUDA device function"),
        ((window_of, 0, 1, 8, 8), {}, ValueError, "batch must be at least 1"),
        ((window_of, 1, 1.5, 8, 8), {}, TypeError, "nheads must be a positive int or None"),
        ((window_of, 1, 1, None, 8), {}, TypeError, "seqlen_q must be a positive int;"),
        ((same_document, 1, 1, 8, 8), {"mod_args": (xp.zeros(8, xp.float64),)}, TypeError,
         "mod_args\\[0\\] must have dtype"),
        ((window_of, 1, 1, 8, 8), {"mod_args": 3}, TypeError, "mod_args must be a tuple"),
        ((window_of, 300, 300, 8, 8), {}, ValueError, "at most 65535"),
    ],
)  # fmt: skip
def test_bad_block_mask_arguments_are_refused_by_name(args, kwargs, error, match):
    with pytest.raises(error, match=match):
        numflash.block_mask(*args, **kwargs)


def test_the_first_block_mask_of_a_function_says_it_compiles(caplog):
    @cuda.jit(device=True)
    def prefix_and_causal(b, h, q_idx, kv_idx):
        return kv_idx < 20 or kv_idx <= q_idx

    with caplog.at_level("INFO", logger="numflash"):
        numflash.block_mask(prefix_and_causal, None, None, 40, 40)
        numflash.block_mask(prefix_and_causal, None, None, 50, 50)
    said = [r.getMessage() for r in caplog.records if "block-mask evaluation" in r.getMessage()]
    assert said == ["compiling the block-mask evaluation of mask_mod=prefix_and_causal"]
