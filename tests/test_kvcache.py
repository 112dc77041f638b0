"""attention_with_kvcache against the float64 reference, sequence by sequence: contiguous and
paged caches (shuffled block tables, any page size), appends, GQA, masks, splits; the cache
after an append equals the old cache plus the new rows, bitwise; hostile device-side lengths
and indices stay inside the arrays; bad input is refused by name."""

import zlib
from typing import NamedTuple

import numpy as np
import pytest
from support import poisoned_like, random_array, to_numpy, xp

import numflash
from numflash.kernels.jit import SIMULATOR
from numflash.reference import check


class Case(NamedTuple):
    dtype: str
    lengths: tuple  # cache_seqlens of each sequence before the append
    seqlen_q: int
    seqlen_new: int
    nheads: int
    nheads_k: int
    head_dim: int
    page_size: int = 0  # 0: a contiguous cache
    capacity: int = 0  # keys per sequence (contiguous) or pages' rows (paged); 0: the longest
    mask: dict = {}
    num_splits: int = 0
    permute: bool = False  # cache_batch_idx a permutation of the cache rows


CASES = [
    Case("float16", (0, 1, 7), seqlen_q=1, seqlen_new=1, nheads=4, nheads_k=1, head_dim=16),
    Case("bfloat16", (7, 33), seqlen_q=3, seqlen_new=0, nheads=4, nheads_k=4, head_dim=24,
         mask=dict(causal=True), num_splits=3),
    Case("float32", (5, 0), seqlen_q=2, seqlen_new=2, nheads=8, nheads_k=2, head_dim=8,
         permute=True, capacity=12),
    Case("float16", (13, 1), seqlen_q=4, seqlen_new=4, nheads=2, nheads_k=2, head_dim=16,
         page_size=3, mask=dict(causal=True), num_splits=2),
    Case("bfloat16", (9, 30), seqlen_q=1, seqlen_new=1, nheads=8, nheads_k=1, head_dim=16,
         page_size=1, num_splits=4),
    Case("float16", (40, 17), seqlen_q=2, seqlen_new=1, nheads=4, nheads_k=2, head_dim=32,
         page_size=16, mask=dict(window_size=(9, 0)), num_splits=2),
    # two row groups of 16 (8 heads x 3 positions) split three ways, appending 3 rows
    Case("bfloat16", (20, 5), seqlen_q=3, seqlen_new=3, nheads=8, nheads_k=1, head_dim=16,
         page_size=4, mask=dict(causal=True), num_splits=3),
    # more splits than a warp has lanes (35 of 37 with keys for the tensor-core kernel's
    # 32-key slots, the last two with none)
    Case("float16", (1100, 0), seqlen_q=1, seqlen_new=1, nheads=2, nheads_k=1, head_dim=8,
         num_splits=37),
    # one split of ten slots of pages of 5: the tensor-core kernel fetches each slot's pages
    # while the previous slot loads
    Case("bfloat16", (300, 45), seqlen_q=1, seqlen_new=1, nheads=2, nheads_k=1, head_dim=16,
         page_size=5, num_splits=1),
    # head dims of the tensor-core kernel's swizzled layout: 64, and 56 (padded to 64, its
    # zero columns swizzled too)
    Case("float16", (50, 9), seqlen_q=2, seqlen_new=1, nheads=4, nheads_k=2, head_dim=64,
         page_size=16, num_splits=2),
    Case("bfloat16", (37,), seqlen_q=1, seqlen_new=2, nheads=2, nheads_k=1, head_dim=56,
         mask=dict(causal=True)),
    # chunked prefill: more new rows than a block of the Hopper forward holds, over pages that
    # a key tile crosses (16 and 3 rows), a permuted contiguous cache, fewer new keys than
    # query rows under a window
    Case("bfloat16", (70, 3), seqlen_q=80, seqlen_new=80, nheads=2, nheads_k=1, head_dim=64,
         page_size=16, mask=dict(causal=True)),
    Case("float16", (5, 100), seqlen_q=66, seqlen_new=66, nheads=2, nheads_k=2, head_dim=128,
         page_size=3),
    Case("float16", (40, 0), seqlen_q=70, seqlen_new=30, nheads=2, nheads_k=1, head_dim=64,
         permute=True, mask=dict(window_size=(50, 10))),
]  # fmt: skip
if not SIMULATOR:  # the lengths of the grid, on the GPU
    CASES += [
        Case("float16", (0, 1, 7, 113, 1023, 4097), seqlen_q=1, seqlen_new=1, nheads=32,
             nheads_k=8, head_dim=128),
        Case("bfloat16", (113, 1023), seqlen_q=8, seqlen_new=8, nheads=8, nheads_k=1,
             head_dim=64, page_size=256, mask=dict(causal=True)),
        Case("float16", (4097, 7), seqlen_q=4, seqlen_new=0, nheads=8, nheads_k=2,
             head_dim=128, page_size=16, mask=dict(window_size=(100, 0)), num_splits=7),
        # chunked prefill at head_dim 128 over pages of 16: a box of every atom a page
        Case("bfloat16", (300, 1000), seqlen_q=130, seqlen_new=130, nheads=8, nheads_k=2,
             head_dim=128, page_size=16, mask=dict(causal=True)),
    ]  # fmt: skip


def _setup(case, rng):
    """The call's arrays, and what the test needs to rebuild each sequence's keys."""
    batch = len(case.lengths)
    longest = max(case.lengths) + case.seqlen_new
    capacity = case.capacity or longest
    shape_q = (batch, case.seqlen_q, case.nheads, case.head_dim)
    q = random_array(shape_q, case.dtype, rng)
    new = None
    if case.seqlen_new:
        shape_new = (batch, case.seqlen_new, case.nheads_k, case.head_dim)
        new = tuple(random_array(shape_new, case.dtype, rng) for _ in range(2))
    if case.page_size:
        pages_each = -(-capacity // case.page_size)
        num_blocks = batch * pages_each + 3  # a few pages nobody uses
        order = rng.permutation(num_blocks)[: batch * pages_each].astype(np.int32)
        table = order.reshape(batch, pages_each)
        cache_shape = (num_blocks, case.page_size, case.nheads_k, case.head_dim)
        kw = dict(block_table=xp.asarray(table))
    else:
        slots = batch + (1 if case.permute else 0)
        cache_shape = (slots, capacity, case.nheads_k, case.head_dim)
        index = rng.permutation(slots)[:batch].astype(np.int32) if case.permute else None
        kw = dict(cache_batch_idx=None if index is None else xp.asarray(index))
    caches = tuple(random_array(cache_shape, case.dtype, rng) for _ in range(2))
    lengths = xp.asarray(np.array(case.lengths, dtype=np.int32))
    return q, caches, new, lengths, kw


def _sequence(cache, b, length, kw):
    """Keys 0 .. length - 1 of sequence b, gathered from a host copy of the cache."""
    if "block_table" in kw:
        table = to_numpy(kw["block_table"])
        page = cache.shape[1]
        return np.stack([cache[table[b, j // page], j % page] for j in range(length)])[None]
    index = kw.get("cache_batch_idx")
    slot = b if index is None else int(to_numpy(index)[b])
    return cache[slot, :length][None]


#: The kernels each case runs with: what numflash chooses (the portable kernel in the
#: simulator, the tensor-core one on a GPU for fp16/bf16), and each family forced.
KERNELS = {
    "default": None,
    "portable": numflash.PortableDecodeConfig(),
    "tensor-core": numflash.TensorCoreDecodeConfig(block_n=16, num_warps=2, stages=2),
    # a deeper ring, several rows a thread per slot and more key rows than threads (each
    # thread finds two rows' places in a paged cache)
    "tensor-core-deep": numflash.TensorCoreDecodeConfig(block_n=64, num_warps=1, stages=3),
    # the Hopper forward over the caches (chunked prefill), its producer loading by TMA (by
    # cp.async the pages TMA boxes cannot take: sizes not a multiple of 8)
    "hopper": numflash.WgmmaForwardConfig(consumers=1, block_n=64, stages=2, pingpong=False),
}


#: The most query rows a decode kernel is forced to run in the simulator (the chunked-prefill
#: cases of more rows take it one to two and a half minutes each; the GPU runs them all).
SIMULATED_ROWS = 16


def _config(kernel, case):
    """The forced configuration of ``kernel`` for ``case``; skips what it cannot run."""
    config = KERNELS[kernel]
    if kernel == "portable" and SIMULATOR:
        pytest.skip("the simulator's default kernel")
    if kernel in ("tensor-core", "tensor-core-deep", "hopper") and (
        case.dtype == "float32" or case.head_dim % 8
    ):
        pytest.skip("the tensor-core kernels take fp16/bf16 and head_dim a multiple of 8")
    if kernel == "hopper" and case.num_splits > 1:
        pytest.skip("the Hopper forward does not split the keys")
    if SIMULATOR and kernel.startswith("tensor-core") and case.seqlen_q > SIMULATED_ROWS:
        pytest.skip("chunked prefill forced on the decode kernels: on the GPU (minutes here)")
    return config


@pytest.mark.parametrize("kernel", list(KERNELS))
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c.dtype}-{c.lengths}-p{c.page_size}")
def test_kvcache_matches_reference_and_appends_in_place(case, kernel):
    run_and_check(case, _config(kernel, case))


def run_and_check(case, config, functions=None, variants_of=None):
    """One call of ``case`` with ``config``: the caches after the append, bitwise, and each
    sequence's output and LSE against the reference (also used by tests/sanitizer_cases.py).
    ``functions``: the call's score_mod, mask_mod and mod_args (a dict), with
    ``variants_of(b)`` the reference's numflash.reference.Variants of sequence b."""
    rng = np.random.default_rng(zlib.crc32(repr(case).encode()))
    q, (k_cache, v_cache), new, lengths, kw = _setup(case, rng)
    before = [to_numpy(c).copy() for c in (k_cache, v_cache)]
    out = poisoned_like(q)
    k, v = new if new else (None, None)
    _, lse = numflash.attention_with_kvcache(
        q,
        k_cache,
        v_cache,
        k,
        v,
        cache_seqlens=lengths,
        out=out,
        return_lse=True,
        num_splits=case.num_splits,
        config=config,
        **case.mask,
        **kw,
        **(functions or {}),
    )
    after = [to_numpy(c) for c in (k_cache, v_cache)]
    # -- the caches: the old ones with the new rows written where they belong, nothing else
    expected = [c.copy() for c in before]
    if new:
        for b, length in enumerate(case.lengths):
            for i in range(case.seqlen_new):
                j = length + i
                for c, rows in zip(expected, new):
                    if "block_table" in kw:
                        page = to_numpy(kw["block_table"])[b, j // case.page_size]
                        c[page, j % case.page_size] = to_numpy(rows)[b, i]
                    else:
                        index = kw.get("cache_batch_idx")
                        slot = b if index is None else int(to_numpy(index)[b])
                        c[slot, j] = to_numpy(rows)[b, i]
    for name, got, want in zip(("k_cache", "v_cache"), after, expected):
        assert (got.view(np.uint8) == want.view(np.uint8)).all(), f"{name} is not old + new"
    # -- each sequence against the reference over its keys after the append
    for b, length in enumerate(case.lengths):
        n = length + case.seqlen_new
        ks, vs = (xp.asarray(_sequence(c, b, n, kw)) for c in after)
        variants = variants_of(b) if variants_of else None
        result = check(q[b : b + 1], ks, vs, out[b : b + 1], lse[b : b + 1], **case.mask,
                       variants=variants)  # fmt: skip
        assert result.nan == 0, f"sequence {b}: {result.nan} NaN outputs"
        assert result.err <= result.bar, f"sequence {b}: err {result.err:.3e} > {result.bar:.3e}"
        assert result.lse_err <= result.lse_bar, f"sequence {b}: lse err {result.lse_err:.3e}"


def test_an_int_cache_seqlens_is_every_sequence_s_length():
    rng = np.random.default_rng(7)
    q = random_array((2, 1, 2, 16), "float16", rng)
    k_cache, v_cache = (random_array((2, 9, 1, 16), "float16", rng) for _ in range(2))
    by_int = numflash.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=6)
    by_array = numflash.attention_with_kvcache(
        q, k_cache, v_cache, cache_seqlens=xp.asarray(np.array([6, 6], np.int32))
    )
    assert (to_numpy(by_int).view(np.uint16) == to_numpy(by_array).view(np.uint16)).all()


@pytest.mark.parametrize("kernel", ["default", "tensor-core", "hopper"])
def test_hostile_device_lengths_and_pages_stay_inside_the_arrays(kernel):
    """Lengths beyond the capacity or negative, and block-table entries out of range: nothing
    outside the caches is read or written (the simulator raises on any out-of-range index),
    rows past a sequence's capacity are not written, absent pages read as no keys."""
    rng = np.random.default_rng(11)
    q = random_array((3, 2, 2, 16), "float16", rng)
    new = [random_array((3, 2, 1, 16), "float16", rng) for _ in range(2)]
    caches = [random_array((5, 4, 1, 16), "float16", rng) for _ in range(2)]
    table = xp.asarray(np.array([[0, 1], [2, 99], [-7, 4]], np.int32))
    lengths = xp.asarray(np.array([10**6, 5, -5], np.int32))
    before = [to_numpy(c).copy() for c in caches]
    out, lse = numflash.attention_with_kvcache(
        q,
        *caches,
        *new,
        cache_seqlens=lengths,
        block_table=table,
        return_lse=True,
        config=KERNELS[kernel],
    )
    after = [to_numpy(c) for c in caches]
    # sequence 0 is full (length clamped to its 8 keys): no row of its pages changed
    for got, old in zip(after, before):
        assert (got[[0, 1]].view(np.uint16) == old[[0, 1]].view(np.uint16)).all()
        assert (got[3].view(np.uint16) == old[3].view(np.uint16)).all()  # nobody's page
    assert not np.isnan(to_numpy(out).astype(np.float32)).any()


def _spy_on_append_launches(monkeypatch):
    """The arguments of each append launch of the calls that follow (a list), in a fresh plan
    cache (a replay launches nothing through Python)."""
    from numflash import api, launch

    launched = []
    monkeypatch.setattr(api, "_plans", type(api._plans)())
    monkeypatch.setattr(launch, "_prepared", {})
    append = launch.append_new_rows
    spy = lambda *a: launched.append(a) or append(*a)  # noqa: E731
    monkeypatch.setattr(launch, "append_new_rows", spy)
    return launched


def test_a_short_chunk_is_appended_by_the_kernel_over_a_contiguous_cache_alone(monkeypatch):
    """numflash's choice (wgmma_forward.PAGED_APPEND off): the Hopper forward appends a short
    chunk over a contiguous cache itself, and over pages of 16 after an append launch."""
    config = _config("hopper", Case("float16", (0,), 3, 3, 2, 1, 64))
    rng = np.random.default_rng(5)
    q = random_array((1, 3, 2, 64), "float16", rng)
    new = [random_array((1, 3, 1, 64), "float16", rng) for _ in range(2)]
    contiguous = [random_array((1, 32, 1, 64), "float16", rng) for _ in range(2)]
    pages = [random_array((2, 16, 1, 64), "float16", rng) for _ in range(2)]
    table = dict(block_table=xp.asarray(np.array([[1, 0]], np.int32)))
    launched = _spy_on_append_launches(monkeypatch)
    numflash.attention_with_kvcache(q, *contiguous, *new, cache_seqlens=5, config=config)
    assert not launched
    numflash.attention_with_kvcache(q, *pages, *new, cache_seqlens=5, config=config, **table)
    assert len(launched) == 1


@pytest.mark.parametrize("page_size", [0, 16])
def test_hostile_lengths_stay_inside_the_arrays_when_the_hopper_forward_appends(
    page_size, monkeypatch
):
    """As above for the Hopper forward appending the new rows itself (TMA copies: a contiguous
    cache, or pages of 16): lengths past the capacity or negative, a cache row or pages outside
    the cache; no row but the sequences' new ones changes, no NaN."""
    from numflash.families import wgmma_forward

    monkeypatch.setattr(wgmma_forward, "PAGED_APPEND", True)  # (off by default: pages too)
    rng = np.random.default_rng(12)
    q = random_array((3, 3, 2, 64), "float16", rng)
    new = [random_array((3, 3, 1, 64), "float16", rng) for _ in range(2)]
    lengths = xp.asarray(np.array([10**6, 14, -2], np.int32))
    if page_size:  # two pages a sequence: the second's out of range, the third's negative
        caches = [random_array((5, 16, 1, 64), "float16", rng) for _ in range(2)]
        kw = dict(block_table=xp.asarray(np.array([[0, 1], [2, 99], [-7, 4]], np.int32)))
        changed = {(2, 14), (2, 15)}  # (page, row): sequence 1's rows 14 and 15 (16 is absent)
    else:
        caches = [random_array((3, 32, 1, 64), "float16", rng) for _ in range(2)]
        kw = dict(cache_batch_idx=xp.asarray(np.array([0, 2, 7], np.int32)))
        changed = {(2, 14), (2, 15), (2, 16)}
    before = [to_numpy(c).copy() for c in caches]
    launched = _spy_on_append_launches(monkeypatch)
    out = numflash.attention_with_kvcache(
        q, *caches, *new, cache_seqlens=lengths, config=KERNELS["hopper"], **kw
    )
    assert not launched, "the new rows were appended by a launch of their own"
    for got, old, rows in zip((to_numpy(c) for c in caches), before, new):
        for page, row in changed:
            assert (
                got[page, row].view(np.uint16) == to_numpy(rows)[1, row - 14].view(np.uint16)
            ).all()
            got[page, row] = old[page, row]
        assert (got.view(np.uint16) == old.view(np.uint16)).all(), "a row outside the new ones"
    assert not np.isnan(to_numpy(out).astype(np.float32)).any()


@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("kernel", list(KERNELS))
def test_what_a_cache_holds_past_a_sequence_never_reaches_its_output(kernel, paged):
    """NaN in every cache row past each sequence's length (after its append): the outputs are
    finite and equal the reference over the sequence's keys. (The Hopper forward's TMA copies
    read whole tiles, or whole pages, of a cache: those rows included.)"""
    config = _config(kernel, Case("float16", (0,), 3, 0, 2, 1, 64))
    rng = np.random.default_rng(17)
    lengths, new = (5, 70), 2
    q = random_array((2, 3, 2, 64), "float16", rng)
    k, v = (random_array((2, new, 1, 64), "float16", rng) for _ in range(2))
    caches = [to_numpy(random_array((2, 128, 1, 64), "float16", rng)) for _ in range(2)]
    for c in caches:
        for b, n in enumerate(lengths):
            c[b, n + new :] = np.nan
    kw = {}
    if paged:  # pages of 16, each sequence's in order, after the other's
        caches = [c.reshape(16, 16, 1, 64) for c in caches]
        kw["block_table"] = xp.asarray(np.arange(16, dtype=np.int32).reshape(2, 8))
    k_cache, v_cache = (xp.asarray(c) for c in caches)
    out, lse = numflash.attention_with_kvcache(
        q, k_cache, v_cache, k, v, cache_seqlens=xp.asarray(np.array(lengths, np.int32)),
        return_lse=True, config=config, **kw,
    )  # fmt: skip
    assert np.isfinite(to_numpy(out).astype(np.float32)).all()
    for b, n in enumerate(lengths):
        ks, vs = (xp.asarray(to_numpy(c).reshape(2, 128, 1, 64)[b : b + 1, : n + new])
                  for c in (k_cache, v_cache))  # fmt: skip
        result = check(q[b : b + 1], ks, vs, out[b : b + 1], lse[b : b + 1])
        assert result.err <= result.bar and result.lse_err <= result.lse_bar, (b, result)


@pytest.mark.parametrize("page", [4, 16])
@pytest.mark.parametrize("kernel", list(KERNELS))
def test_keys_behind_a_page_outside_the_cache_are_absent(kernel, page):
    """Keys whose block-table entry is no page of the cache count as absent: the output is
    the reference over the other keys (the page may be anywhere in the sequence). Pages of 16
    take the Hopper forward's TMA boxes, of 4 its cp.async copies."""
    config = _config(kernel, Case("float16", (0,), 3, 0, 2, 1, 16))
    rng = np.random.default_rng(13)
    q = random_array((2, 3, 2, 16), "float16", rng)
    k_cache, v_cache = (random_array((4, page, 1, 16), "float16", rng) for _ in range(2))
    table = xp.asarray(np.array([[0, 99, 1], [-1, 2, 3]], np.int32))
    lengths = xp.asarray(np.array([2 * page + 3, 3 * page], np.int32))
    out, lse = numflash.attention_with_kvcache(
        q, k_cache, v_cache, cache_seqlens=lengths, block_table=table, return_lse=True,
        config=config,
    )  # fmt: skip
    pages = to_numpy(k_cache), to_numpy(v_cache)
    present = ([0, 1], [2, 3])  # each sequence's pages in the cache, in order
    for b, (used, keys) in enumerate(zip(present, (page + 3, 2 * page))):
        ks, vs = (xp.asarray(np.concatenate([c[i] for i in used])[None, :keys]) for c in pages)
        result = check(q[b : b + 1], ks, vs, out[b : b + 1], lse[b : b + 1])
        assert result.err <= result.bar and result.lse_err <= result.lse_bar, (b, result)


@pytest.mark.parametrize("kernel", list(KERNELS))
@pytest.mark.parametrize("splits", [1, 3])
def test_a_nan_key_reaches_exactly_the_rows_that_see_it(kernel, splits):
    """A NaN in one cached key: the query rows that see it get NaN outputs and lse (the exact
    result, never hidden by the merge of warps or of splits), the rows that do not stay
    exact. The tensor-core kernel's padding rows (16 a block, here 2 of them real) see every
    key; their NaNs must not reach the real rows."""
    if kernel == "hopper" and splits > 1:
        pytest.skip("the Hopper forward does not split the keys")
    rng = np.random.default_rng(5)
    length = 150
    q = random_array((2, 2, 1, 16), "float16", rng)  # 2 query positions, 1 head: 2 rows
    k_cache, v_cache = (random_array((2, length, 1, 16), "float16", rng) for _ in range(2))
    k_host = to_numpy(k_cache)
    k_host[0, length - 1, 0, 5] = np.nan  # sequence 0's last key: only its last row sees it
    k_cache = xp.asarray(k_host)
    lengths = xp.asarray(np.array([length, length], np.int32))
    out, lse = numflash.attention_with_kvcache(
        q, k_cache, v_cache, cache_seqlens=lengths, causal=True, return_lse=True,
        num_splits=splits, config=KERNELS[kernel],
    )  # fmt: skip
    out32 = to_numpy(out).astype(np.float32)
    lse32 = to_numpy(lse)
    assert np.isnan(out32[0, 1]).all() and np.isnan(lse32[0, 0, 1])
    finite = [out32[0, 0], out32[1], lse32[0, 0, :1], lse32[1]]
    assert all(np.isfinite(x).all() for x in finite), "a NaN reached a row that does not see it"
    for b, rows in ((0, slice(0, 1)), (1, slice(0, 2))):
        ks, vs = (xp.asarray(to_numpy(c)[b : b + 1]) for c in (k_cache, v_cache))
        keys = length - 1 if b == 0 else length  # row 0 of sequence 0 sees all but the last
        result = check(
            q[b : b + 1, rows], ks[:, :keys], vs[:, :keys], out[b : b + 1, rows],
            lse[b : b + 1, :, rows], causal=True,
        )  # fmt: skip
        assert result.err <= result.bar and result.lse_err <= result.lse_bar, (b, result)


@pytest.mark.parametrize(
    "change, error, message",
    [
        (dict(cache_seqlens=8), ValueError, r"cache_seqlens \+ seqlen_new must be in \[0, 9\]"),
        (dict(cache_seqlens=-1), ValueError, "cache_seqlens"),
        (dict(cache_seqlens=1.5), TypeError, "cache_seqlens must be an int or an int32 array"),
        (dict(cache_seqlens="lengths"), TypeError, "cache_seqlens must be an int or an int32"),
        (dict(cache_seqlens=True), TypeError, "cache_seqlens must be an int or an int32 array"),
        (dict(cache_seqlens=[3, 3]), TypeError, "cache_seqlens must be an int or an int32"),
        (dict(k=None), ValueError, "k and v must be given together"),
        (dict(num_splits=-1), ValueError, "num_splits must be >= 0"),
        (dict(num_splits=2.0), TypeError, "num_splits must be an int"),
        (dict(cache_batch_idx="table"), TypeError, "cache_batch_idx"),
        (dict(causal="yes"), TypeError, "causal must be a bool"),
        (dict(config=KERNELS["hopper"], num_splits=2), ValueError, "does not split the keys"),
        (
            dict(config=numflash.TensorCoreConfig()),
            TypeError,
            "WgmmaForwardConfig or None; got TensorCoreConfig",
        ),
    ],
)
def test_bad_arguments_are_refused_by_name(change, error, message):
    rng = np.random.default_rng(3)
    args = dict(
        q=random_array((2, 1, 2, 16), "float16", rng),
        k_cache=random_array((2, 9, 1, 16), "float16", rng),
        v_cache=random_array((2, 9, 1, 16), "float16", rng),
        k=random_array((2, 2, 1, 16), "float16", rng),
        v=random_array((2, 2, 1, 16), "float16", rng),
        cache_seqlens=3,
    )
    args.update(change)
    before = to_numpy(args["k_cache"]).copy()
    with pytest.raises(error, match=message):
        numflash.attention_with_kvcache(**args)
    assert (to_numpy(args["k_cache"]).view(np.uint16) == before.view(np.uint16)).all()


@pytest.mark.parametrize("reader", ["q", "k", "v", "k_cache", "cache_seqlens", "block_table"])
def test_an_out_sharing_memory_with_an_input_is_refused(reader):
    """The kernel writes out while other blocks still read every input: an out over any of
    them would change what they read."""
    rng = np.random.default_rng(5)
    # nheads == nheads_k and seqlen_q == seqlen_new: out has the shape of q, k and v alike
    q, k, v = (random_array((2, 2, 2, 16), "float16", rng) for _ in range(3))
    k_cache, v_cache = (random_array((6, 4, 2, 16), "float16", rng) for _ in range(2))
    buffer = xp.zeros(q.size + 8, np.float16)  # out's elements, then room for an int32 array
    out = buffer[: q.size].reshape(q.shape)
    args = dict(cache_seqlens=xp.asarray(np.array([1, 2], np.int32)))
    args.update(block_table=xp.asarray(np.array([[0, 1], [2, 3]], np.int32)))
    if reader in ("cache_seqlens", "block_table"):  # an index array over out's last bytes
        shape = args[reader].shape
        n = int(np.prod(shape))  # int32 elements: 2 n float16 ones, n of them out's
        args[reader] = buffer[q.size - n : q.size + n].view(np.int32).reshape(shape)
    elif reader == "k_cache":
        out = k_cache.reshape(-1)[: q.size].reshape(q.shape)
    else:
        out = dict(q=q, k=k, v=v)[reader]
    before = to_numpy(k_cache).copy()
    with pytest.raises(ValueError, match=f"out overlaps {reader} in memory"):
        numflash.attention_with_kvcache(q, k_cache, v_cache, k, v, out=out, **args)
    assert (to_numpy(k_cache).view(np.uint16) == before.view(np.uint16)).all()


@pytest.mark.parametrize("index", ["cache_seqlens", "block_table"])
def test_a_cache_appended_to_that_holds_an_index_array_is_refused(index):
    """The append writes the caches while blocks read the lengths and the table."""
    rng = np.random.default_rng(6)
    q, k, v = (random_array((2, 1, 2, 16), "float16", rng) for _ in range(3))
    k_cache, v_cache = (random_array((6, 4, 2, 16), "float16", rng) for _ in range(2))
    args = dict(cache_seqlens=xp.asarray(np.array([1, 2], np.int32)))
    args.update(block_table=xp.asarray(np.array([[0, 1], [2, 3]], np.int32)))
    held = k_cache[5].reshape(-1)[: 2 * args[index].size].view(np.int32)  # the last page
    held[...] = args[index].reshape(-1)
    args[index] = held.reshape(args[index].shape)
    with pytest.raises(ValueError, match=f"k_cache overlaps {index} in memory"):
        numflash.attention_with_kvcache(q, k_cache, v_cache, k, v, **args)
    numflash.attention_with_kvcache(q, k_cache, v_cache, **args)  # no append: only read


def test_one_cache_for_both_k_and_v_is_refused_only_with_an_append():
    rng = np.random.default_rng(7)
    q, k, v = (random_array((2, 1, 2, 16), "float16", rng) for _ in range(3))
    cache = random_array((2, 5, 2, 16), "float16", rng)
    before = to_numpy(cache).copy()
    with pytest.raises(ValueError, match="k_cache and v_cache are the same memory"):
        numflash.attention_with_kvcache(q, cache, cache, k, v, cache_seqlens=2)
    assert (to_numpy(cache).view(np.uint16) == before.view(np.uint16)).all()
    numflash.attention_with_kvcache(q, cache, cache, cache_seqlens=2)  # read only: V = K


def test_the_hopper_forward_takes_no_head_dim_it_would_pad():
    rng = np.random.default_rng(3)
    q = random_array((1, 40, 2, 20), "float16", rng)
    cache = random_array((1, 64, 1, 20), "float16", rng)
    with pytest.raises(ValueError, match="head_dim a multiple of 8; got head_dim=20"):
        numflash.attention_with_kvcache(q, cache, cache, cache_seqlens=10, config=KERNELS["hopper"])


def test_a_hopper_configuration_without_room_for_a_paged_caches_flags_is_refused():
    """A paged cache's absent-key flags take shared memory a contiguous one does not: a forced
    configuration that fits only without them is refused by name before any launch (on a
    device whose limit lies between the two)."""
    import dataclasses

    from numflash import validation
    from numflash.device import current_device

    rng = np.random.default_rng(5)
    q = random_array((1, 40, 2, 64), "float16", rng)
    pages = random_array((4, 16, 1, 64), "float16", rng)
    table = xp.asarray(np.arange(4, dtype=np.int32)[None])
    config = numflash.WgmmaForwardConfig(consumers=2, block_n=128, stages=2)
    args = (None, None, 10, None, table, True, None, (-1, -1), 0)
    p = validation.kvcache_problem(q, pages, pages, *args)[-1]
    limit = config.shared_memory_bytes(64) + 8  # the flags need more than 8 bytes
    device = dataclasses.replace(current_device(), max_shared_per_block=limit)
    with pytest.raises(ValueError, match="cannot run over a paged cache here: needs"):
        validation.check_decode_config(config, p, device)
    contiguous = validation.kvcache_problem(q, pages, pages, *args[:4], None, *args[5:])[-1]
    assert validation.check_decode_config(config, contiguous, device) is config


def test_shapes_and_dtypes_are_refused_by_name():
    rng = np.random.default_rng(4)
    q = random_array((2, 1, 2, 16), "float16", rng)
    cache = random_array((2, 9, 1, 16), "float16", rng)
    with pytest.raises(TypeError, match="k_cache must have q's dtype"):
        numflash.attention_with_kvcache(q, cache.astype(np.float32), cache, cache_seqlens=1)
    with pytest.raises(ValueError, match="k_cache and v_cache must have one shape"):
        numflash.attention_with_kvcache(q, cache, cache[:, :5], cache_seqlens=1)
    with pytest.raises(ValueError, match="block_table must have shape"):
        numflash.attention_with_kvcache(
            q, cache, cache, cache_seqlens=1, block_table=xp.zeros((3, 2), np.int32)
        )
    with pytest.raises(TypeError, match="block_table must have dtype int32"):
        numflash.attention_with_kvcache(
            q, cache, cache, cache_seqlens=1, block_table=xp.zeros((2, 2), np.int64)
        )
    with pytest.raises(ValueError, match="k_cache holds 1 sequences but q has batch 2"):
        numflash.attention_with_kvcache(q, cache[:1], cache[:1], cache_seqlens=1)
    with pytest.raises(ValueError, match="nheads of q \\(2\\) must be a multiple"):
        three = random_array((2, 9, 3, 16), "float16", rng)
        numflash.attention_with_kvcache(q, three, three, cache_seqlens=1)
    if SIMULATOR:  # NumPy views can be read-only; CuPy arrays cannot
        frozen = cache.copy()
        frozen.flags.writeable = False
        new = random_array((2, 1, 1, 16), "float16", rng)
        with pytest.raises(ValueError, match="k_cache is read-only"):
            numflash.attention_with_kvcache(q, frozen, cache.copy(), new, new, cache_seqlens=1)


def test_interleaved_k_and_v_caches_of_one_buffer():
    """k_cache and v_cache as views of one (slots, seqlen, 2, nheads_k, head_dim) buffer, as
    packed KV caches are kept: their spans overlap, their elements do not. On a GPU that is
    the same as separate caches; the simulator, which copies each kernel argument and writes it
    back whole, refuses it by name."""
    rng = np.random.default_rng(5)
    q = random_array((2, 1, 2, 16), "float16", rng)
    packed = random_array((2, 9, 2, 1, 16), "float16", rng)
    new = [random_array((2, 1, 1, 16), "float16", rng) for _ in range(2)]
    separate = [xp.ascontiguousarray(packed[:, :, i]) for i in range(2)]
    views = (packed[:, :, 0], packed[:, :, 1])
    if SIMULATOR:
        with pytest.raises(ValueError, match="k_cache and v_cache share one buffer"):
            numflash.attention_with_kvcache(q, *views, *new, cache_seqlens=4)
        return
    out = numflash.attention_with_kvcache(q, *views, *new, cache_seqlens=4)
    expected = numflash.attention_with_kvcache(q, *separate, *new, cache_seqlens=4)
    assert (to_numpy(out).view(np.uint16) == to_numpy(expected).view(np.uint16)).all()
    for view, alone in zip(views, separate):
        assert (to_numpy(view).view(np.uint16) == to_numpy(alone).view(np.uint16)).all()


def test_split_count_fills_the_multiprocessors():
    """num_splits=0: no split while batch x kv heads x row blocks fill 80% of a wave, else the
    fewest splits within 95% of the best wave efficiency, each keeping a key tile; a given
    count is kept (at most 128). On an H200-like device (132 multiprocessors, one block of the
    default tensor-core configuration each)."""
    import dataclasses

    from numflash import selection
    from numflash.device import current_device
    from numflash.validation import KVCacheProblem

    h200 = dataclasses.replace(
        current_device(),
        compute_capability=(9, 0),
        multiprocessors=132,
        max_shared_per_block=232448,
        simulated=False,
    )

    def splits(batch, capacity, num_splits=0, seqlen_q=1, cache_seqlens=None):
        p = KVCacheProblem(
            batch=batch,
            seqlen_q=seqlen_q,
            seqlen_new=0,
            nheads=32,
            nheads_k=8,
            head_dim=128,
            dtype="float16",
            scale=0.1,
            window_left=-1,
            window_right=-1,
            capacity=capacity,
            slots=batch,
            page_size=0,
            max_blocks=0,
            cache_seqlens=cache_seqlens,
            num_splits=num_splits,
            cache_aligned=True,
        )
        choice, count = selection.decode(p, h200)
        assert isinstance(choice.config, numflash.TensorCoreDecodeConfig)
        return count

    assert splits(batch=64, capacity=4096) == 1  # 512 blocks already
    assert splits(batch=1, capacity=131072) == 16  # 8 blocks: 128 of a 132-block wave
    assert splits(batch=1, capacity=64) == 1  # one 64-key tile: one split
    assert splits(batch=1, capacity=4096, num_splits=5) == 5
    assert splits(batch=1, capacity=4096, num_splits=1000) == selection.MAX_SPLITS
    # an int cache_seqlens does not move the choice: one replay plan serves every step
    assert splits(batch=1, capacity=131072, cache_seqlens=100) == 16


def test_prefill_rows_follow_how_the_forward_reads_the_cache():
    import dataclasses

    from numflash import selection
    from numflash.validation import KVCacheProblem

    p = KVCacheProblem(1, 64, 64, 8, 2, 128, "float16", 0.1, -1, -1, 8192, 1, 0, 0, None, 0)
    assert selection.prefill_rows(p) == selection.PREFILL_ROWS["contiguous"]
    for page, entry in (
        (16, "small pages"),
        (8, "small pages"),
        (64, "large pages"),
        (256, "large pages"),
        (5, "paged by cp.async"),
        (24, "paged by cp.async"),
    ):
        paged = dataclasses.replace(p, page_size=page, max_blocks=8192 // page + 1)
        assert selection.prefill_rows(paged) == selection.PREFILL_ROWS[entry], page


def test_chunked_prefill_keeps_tiles_that_read_pages_by_tma():
    """A configuration (tuned for dense calls) whose key tiles would not read a paged cache by
    TMA where 128-key tiles do runs chunked prefill on 128-key tiles; over a contiguous cache,
    or pages its tiles read by TMA, it runs as it is."""
    import dataclasses

    from numflash import selection
    from numflash.families.wgmma_forward import WgmmaForwardConfig
    from numflash.validation import KVCacheProblem

    p = KVCacheProblem(1, 64, 64, 8, 2, 128, "float16", 0.1, -1, -1, 8192, 1, 0, 0, None, 0)
    tuned = WgmmaForwardConfig(block_n=112)
    assert selection.prefill_config(tuned, p) == tuned
    for page, block_n in ((16, 112), (64, 128), (256, 128), (24, 112), (8, 112)):
        paged = dataclasses.replace(p, page_size=page, max_blocks=8192 // page + 1)
        assert selection.prefill_config(tuned, paged).block_n == block_n, page
    wide = WgmmaForwardConfig(block_n=192)  # past 128 keys over any page size
    paged = dataclasses.replace(p, page_size=24, max_blocks=8192 // 24 + 1)
    assert selection.prefill_config(wide, paged).block_n == 128


#: Short chunks the Hopper forward appends itself (wgmma_forward.appends_in_kernel: at most a
#: block of query rows and of new rows; KERNELS["hopper"] has 64).
APPEND_CASES = [
    # a permuted contiguous cache, GQA, the new rows crossing a key tile
    Case("float16", (60, 3), seqlen_q=10, seqlen_new=10, nheads=4, nheads_k=2, head_dim=64,
         permute=True, mask=dict(causal=True)),
    # pages of 16 (TMA boxes), fewer query rows than new rows behind a window: new rows that
    # no block reads reach the cache too
    Case("bfloat16", (70, 20), seqlen_q=3, seqlen_new=40, nheads=2, nheads_k=1, head_dim=64,
         page_size=16, mask=dict(window_size=(4, 0))),
    # head_dim 128 over pages of 8 (a box of every atom a page), a page outside the cache
    Case("bfloat16", (5, 64), seqlen_q=12, seqlen_new=12, nheads=2, nheads_k=1, head_dim=128,
         page_size=8, mask=dict(causal=True)),
]  # fmt: skip


@pytest.mark.parametrize("producer_warps", [1, 2])
@pytest.mark.parametrize(
    "case", APPEND_CASES, ids=lambda c: f"{c.dtype}-{c.lengths}-p{c.page_size}"
)
def test_the_hopper_forward_appends_a_short_chunk_itself(monkeypatch, case, producer_warps):
    """Chunked prefill of at most a block of rows: the kernel's own producer warps write the
    new rows into the cache before its copies read them (forward_sm90.build's ``append``),
    with no append launch; the caches after the call and the output as run_and_check wants
    them; with one producer warp copying a paged cache's K and V, or two."""
    from numflash.families import wgmma_forward
    from numflash.kernels import forward_sm90

    monkeypatch.setattr(forward_sm90, "PAGED_PRODUCER_WARPS", producer_warps)
    monkeypatch.setattr(wgmma_forward, "PAGED_APPEND", True)  # (off by default: pages too)
    launched = _spy_on_append_launches(monkeypatch)
    run_and_check(case, _config("hopper", case))
    assert not launched, "the new rows were appended by a launch of their own"


@pytest.mark.parametrize("producer_warps", [1, 2])
def test_the_hopper_forward_copies_a_page_of_every_atom_at_once(monkeypatch, producer_warps):
    """head_dim 128 over pages of 8 rows: a TMA box copies a page's rows of both 64-column
    atoms at once (the tiles in 8-row groups of every atom: forward_sm90.grouped_pages), keys
    behind a page outside the cache are absent (anywhere in a sequence), and the last tile's
    rows past a sequence's end are zeroed in that layout (here the cache rows past it hold
    NaN: a NaN times a probability of 0 would reach the output); with one producer warp
    issuing K's and V's boxes, or a warp each (forward_sm90.PAGED_PRODUCER_WARPS)."""
    from numflash import api, launch
    from numflash.families import wgmma_forward
    from numflash.kernels import forward_sm90

    monkeypatch.setattr(forward_sm90, "PAGED_PRODUCER_WARPS", producer_warps)
    monkeypatch.setattr(api, "_plans", type(api._plans)())  # no plan replays another kernel
    monkeypatch.setattr(launch, "_prepared", {})
    made = []
    grouped_maps = wgmma_forward._grouped_maps
    monkeypatch.setattr(
        wgmma_forward, "_grouped_maps", lambda *a: made.append(grouped_maps(*a)) or made[-1]
    )
    config = _config("hopper", Case("bfloat16", (0,), 5, 0, 2, 1, 128))
    rng = np.random.default_rng(17)
    page = 8
    q = random_array((2, 5, 2, 128), "bfloat16", rng)
    k_host, v_host = (to_numpy(random_array((21, page, 1, 128), "bfloat16", rng)) for _ in "kv")
    table = np.array([[0, 99, 1, 2, 3, 4, 5, 6, 7, 8], [-1, 9, 10, 11, 12, 13, 14, 15, 16, 17]])
    lengths = (75, 66)
    for b, n in enumerate(lengths):  # NaN past each sequence's end, in its last page
        last = table[b, (n - 1) // page]
        k_host[last, n % page or page :] = np.nan
        v_host[last, n % page or page :] = np.nan
    k_cache, v_cache = xp.asarray(k_host), xp.asarray(v_host)
    hosts = (k_host, v_host)
    out, lse = numflash.attention_with_kvcache(
        q, k_cache, v_cache, cache_seqlens=xp.asarray(np.array(lengths, np.int32)),
        block_table=xp.asarray(table.astype(np.int32)), return_lse=True, config=config,
    )  # fmt: skip
    assert made and made[-1] is not None, "the grouped tensor maps were not made"
    for b, n in enumerate(lengths):
        used = [p for p in table[b, : -(-n // page)] if 0 <= p < 21]
        keys = n - page * sum(1 for p in table[b, : -(-n // page)] if not 0 <= p < 21)
        ks, vs = (xp.asarray(np.concatenate([c[i] for i in used])[None, :keys]) for c in hosts)
        result = check(q[b : b + 1], ks, vs, out[b : b + 1], lse[b : b + 1])
        assert result.nan == 0 and result.err <= result.bar, (b, result)
        assert result.lse_err <= result.lse_bar, (b, result)
