"""Repeated calls replay a plan (numflash.plans): results bitwise equal to the full path, new
arrays' pointers patched in, no plan where a replay would not be exact, value checks kept."""

import numpy as np
import pytest
from numba import cuda, float32
from support import random_array, random_qkv, xp

import numflash
from numflash import api, validation

pytestmark = pytest.mark.gpu


def _bits(x):
    return np.asarray(x.view(xp.uint8).get())


def _plan_count():
    return len(api._plans._plans)


def _step_equals_full_path(step, q, caches, twins, k, v, lengths, table=None):
    """One KV-cache step through the public call on ``caches`` and through the full path on
    their ``twins`` (the same contents): out and lse bitwise equal."""
    got = numflash.attention_with_kvcache(
        q, *caches, k, v, cache_seqlens=lengths, block_table=table, return_lse=True
    )
    want = api._attention_with_kvcache(
        q, *twins, k, v, lengths, None, table, False, None, (-1, -1), 0, True, None, None
    )
    for name, a, b in zip(("out", "lse"), got, want):
        assert (_bits(a) == _bits(b)).all(), f"step {step}: {name}"


def _same_caches(caches, twins):
    for c, t in zip(caches, twins):
        assert (_bits(c) == _bits(t)).all()


def test_repeated_attention_replays_and_equals_the_full_path():
    api._plans.clear()
    for return_lse in (False, True):
        for trial in range(3):  # the first call records, the next two replay
            q, k, v = random_qkv(2, 77, 130, 8, 2, 128, "float16")
            got = numflash.attention(q, k, v, causal=True, return_lse=return_lse)
            want = api._attention(q, k, v, True, None, (-1, -1), return_lse, None, None)
            for a, b in zip(got if return_lse else (got,), want if return_lse else (want,)):
                assert (_bits(a) == _bits(b)).all(), f"trial {trial}, return_lse={return_lse}"
    assert _plan_count() == 2  # one plan per return_lse


def test_attention_with_few_query_rows_replays_the_kv_cache_kernel_s_plan():
    """Few query rows run the KV-cache kernel over k and v, with lengths it fills from k's
    shape (part of the signature): the plan keeps them and replays."""
    api._plans.clear()
    for trial in range(3):
        q, k, v = random_qkv(2, 4, 3000, 8, 2, 128, "float16")
        got = numflash.attention(q, k, v, return_lse=True)
        want = api._attention(q, k, v, False, None, (-1, -1), True, None, None)
        for a, b in zip(got, want):
            assert (_bits(a) == _bits(b)).all(), f"trial {trial}"
    assert _plan_count() == 1


def test_no_plan_where_the_full_path_copies_an_input():
    api._plans.clear()
    q, k, v = random_qkv(1, 40, 40, 2, 2, 100, "bfloat16")  # head_dim 100: padded to 104
    for _ in range(2):
        got = numflash.attention(q, k, v)
        want = api._attention(q, k, v, False, None, (-1, -1), False, None, None)
        assert (_bits(got) == _bits(want)).all()
    assert _plan_count() == 0


def test_a_flag_of_another_type_does_not_reach_a_plan():
    """causal=1 is refused by name even after causal=True made a plan (1 == True in a dict)."""
    q, k, v = random_qkv(1, 16, 16, 2, 2, 64, "float16")
    numflash.attention(q, k, v, causal=True)
    numflash.attention(q, k, v, causal=True)
    with pytest.raises(TypeError, match="causal"):
        numflash.attention(q, k, v, causal=1)


def _paged_caches(rng, batch, pages, page=16):
    """(block table, paged bf16 caches of 2 KV heads and head_dim 64, copies of them): the
    pages of each sequence in shuffled order."""
    table = xp.asarray(rng.permutation(batch * pages).astype(np.int32).reshape(batch, pages))
    caches = [random_array((batch * pages, page, 2, 64), "bfloat16", rng) for _ in range(2)]
    return table, caches, [c.copy() for c in caches]


def test_a_decoding_loop_replays_with_lengths_advancing_on_the_device():
    """One plan serves every step of a paged decoding loop with appends: cache_seqlens grows
    on the device; outputs and caches equal a second loop run through the full path."""
    api._plans.clear()
    rng = np.random.default_rng(3)
    batch = 3
    table, caches, twins = _paged_caches(rng, batch, pages=8)
    lengths = xp.asarray(np.array([5, 40, 71], np.int32))
    for step in range(4):
        q = random_array((batch, 1, 8, 64), "bfloat16", rng)
        k, v = (random_array((batch, 1, 2, 64), "bfloat16", rng) for _ in range(2))
        _step_equals_full_path(step, q, caches, twins, k, v, lengths, table)
        lengths += 1
    _same_caches(caches, twins)
    assert _plan_count() == 1


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_a_decoding_loop_with_an_int_length_advancing_replays_one_plan(paged):
    """An int cache_seqlens advancing every step replays one plan, each replay writing the
    step's length into the plan's lengths array; outputs, lse and caches equal a second loop
    run through the full path, and a length past the capacity is still refused."""
    api._plans.clear()
    rng = np.random.default_rng(4)
    batch, capacity = 2, 128
    shape = (batch * capacity // 16, 16, 2, 64) if paged else (batch, capacity, 2, 64)
    table = xp.arange(batch * capacity // 16, dtype=xp.int32).reshape(batch, -1) if paged else None
    caches = [random_array(shape, "float16", rng) for _ in range(2)]
    twins = [c.copy() for c in caches]
    for step in range(6):
        q = random_array((batch, 1, 8, 64), "float16", rng)
        k, v = (random_array((batch, 1, 2, 64), "float16", rng) for _ in range(2))
        _step_equals_full_path(step, q, caches, twins, k, v, 30 + 17 * step, table)
    _same_caches(caches, twins)
    assert _plan_count() == 1
    with pytest.raises(ValueError, match="cache_seqlens"):
        numflash.attention_with_kvcache(q, *caches, k, v, cache_seqlens=capacity, block_table=table)


def test_one_array_in_several_roles_replays_and_equals_the_full_path():
    """attention(q, q, q) as the first call of its signature, then repeated; one array as both
    new k and new v of a decoding step."""
    api._plans.clear()
    rng = np.random.default_rng(5)
    for trial in range(3):
        q = random_array((2, 70, 4, 64), "bfloat16", rng)
        got = numflash.attention(q, q, q, causal=True)
        want = api._attention(q, q, q, True, None, (-1, -1), False, None, None)
        assert (_bits(got) == _bits(want)).all(), f"trial {trial}"
    caches = [random_array((2, 64, 2, 64), "float16", rng) for _ in range(2)]
    twins = [c.copy() for c in caches]
    lengths = xp.asarray(np.array([3, 20], np.int32))
    for step in range(3):
        q = random_array((2, 1, 4, 64), "float16", rng)
        kv = random_array((2, 1, 2, 64), "float16", rng)
        _step_equals_full_path(step, q, caches, twins, kv, kv, lengths)
        lengths += 1
    _same_caches(caches, twins)
    assert _plan_count() == 2


def test_packed_batches_with_new_offsets_and_max_lengths_replay_and_equal_the_full_path():
    """A training loop over packed batches: new offsets and max lengths every step (one
    offsets array for q and k), replayed by one plan per bound of the max length."""
    api._plans.clear()
    rng = np.random.default_rng(6)
    total = 600
    q, k, v = (random_array((total, 4, 64), "float16", rng) for _ in range(3))
    bounds = set()
    for step in range(5):
        cuts = np.sort(rng.choice(np.arange(1, total), 3, replace=False))
        cu_host = np.concatenate([[0], cuts, [total]]).astype(np.int32)
        longest = int(np.diff(cu_host).max())
        bounds.add(validation.packed_bound(longest))
        cu = xp.asarray(cu_host)
        for return_lse in (False, True):
            got = numflash.attention_varlen(
                q, k, v, cu, cu, longest, longest, causal=True, return_lse=return_lse
            )
            want = api._attention_varlen(
                q, k, v, cu, cu, longest, longest, True, None, (-1, -1), return_lse, None, None
            )
            for a, b in zip(got if return_lse else (got,), want if return_lse else (want,)):
                assert (_bits(a) == _bits(b)).all(), f"step {step}, return_lse={return_lse}"
    assert _plan_count() == 2 * len(bounds)  # one plan per bound and return_lse


def _stride_0_seqlen(x):
    """x (batch, heads, head_dim) as (batch, 1, heads, head_dim), its seqlen stride 0."""
    b, h, d = x.shape
    strides = (x.strides[0], 0, *x.strides[1:])
    return xp.lib.stride_tricks.as_strided(x, shape=(b, 1, h, d), strides=strides)


def test_c_contiguous_inputs_with_other_strides_on_extent_1_dims_replay_one_plan():
    """A decoding step's q, k and v viewed with stride 0 on their seqlen dimension of extent 1
    replay the plan a step with freshly allocated ones made: bitwise the full path."""
    api._plans.clear()
    rng = np.random.default_rng(4)
    caches = [random_array((2, 64, 2, 64), "float16", rng) for _ in range(2)]
    twins = [c.copy() for c in caches]
    lengths = xp.asarray(np.array([7, 30], np.int32))
    for step in range(3):
        q, k, v = (random_array((2, h, 64), "float16", rng) for h in (8, 2, 2))
        if step == 0:  # the recorded call: contiguous (2, 1, h, 64) arrays
            q, k, v = (xp.ascontiguousarray(x[:, None]) for x in (q, k, v))
        else:
            q, k, v = (_stride_0_seqlen(x) for x in (q, k, v))
            assert q.strides[1] == 0 and q.flags.c_contiguous
        _step_equals_full_path(step, q, caches, twins, k, v, lengths)
        lengths += 1
    _same_caches(caches, twins)
    assert _plan_count() == 1


def test_overlapping_new_rows_are_refused_after_a_plan_exists():
    """The plan of a call whose new k is a row of another buffer does not take a call whose
    new k, of the same shape and strides, is a row of the cache it is written to."""
    q = random_array((1, 1, 2, 64), "float16")
    caches = [random_array((1, 32, 1, 64), "float16") for _ in range(2)]
    elsewhere = random_array((1, 32, 1, 64), "float16")
    v = random_array((1, 1, 1, 64), "float16")
    for _ in range(2):
        numflash.attention_with_kvcache(q, *caches, elsewhere[:, 5:6], v, cache_seqlens=3)
    with pytest.raises(ValueError, match="overlaps"):
        numflash.attention_with_kvcache(q, *caches, caches[0][:, 5:6], v, cache_seqlens=3)


def test_repeated_backward_replays_and_equals_the_full_path():
    api._plans.clear()
    for trial in range(3):
        q, k, v = random_qkv(1, 150, 201, 4, 2, 128, "bfloat16")
        out, lse = numflash.attention(q, k, v, causal=True, return_lse=True)
        dout = random_array(q.shape, "bfloat16")
        got = numflash.attention_backward(dout, q, k, v, out, lse, causal=True)
        want = api._attention_backward(dout, q, k, v, out, lse, True, None, (-1, -1), False, None)
        for name, a, b in zip(("dq", "dk", "dv"), got, want):
            assert (_bits(a) == _bits(b)).all(), f"trial {trial}: {name}"
    assert _plan_count() == 2  # the forward's and the backward's


def test_calls_with_sinks_and_slopes_replay_with_each_call_s_values():
    """Forward and backward with sinks and ALiBi slopes (new values every trial: a replay
    reads them from the call's arrays) equal the full path bit for bit, one plan each."""
    api._plans.clear()
    rng = np.random.default_rng(5)
    for trial in range(3):
        q, k, v = random_qkv(2, 150, 201, 4, 2, 128, "float16")
        sinks = xp.asarray(rng.normal(size=4).astype(np.float32))
        slopes = xp.asarray(rng.uniform(0.01, 0.5, size=(2, 4)).astype(np.float32))
        variants = dict(sinks=sinks, alibi_slopes=slopes)
        out, lse = numflash.attention(q, k, v, causal=True, return_lse=True, **variants)
        want = api._attention(q, k, v, True, None, (-1, -1), True, None, None, 0.0, sinks, slopes)
        for name, a, b in zip(("out", "lse"), (out, lse), want):
            assert (_bits(a) == _bits(b)).all(), f"trial {trial}: {name}"
        dout = random_array(q.shape, "float16", rng)
        got = numflash.attention_backward(dout, q, k, v, out, lse, causal=True, **variants)
        want = api._attention_backward(dout, q, k, v, out, lse, True, None, (-1, -1), False,
                                       None, 0.0, sinks, slopes)  # fmt: skip
        for name, a, b in zip(("dq", "dk", "dv", "dsinks"), got, want):
            assert (_bits(a) == _bits(b)).all(), f"trial {trial}: {name}"
    assert _plan_count() == 2  # the forward's and the backward's


def test_a_gpt_oss_decoding_loop_with_sinks_replays_one_plan():
    """Paged decoding with appends, sinks and a 128-key window, as gpt-oss's layers run it:
    one plan for every step, outputs, lse and caches equal to the full path's."""
    api._plans.clear()
    rng = np.random.default_rng(6)
    batch = 3
    table, caches, twins = _paged_caches(rng, batch, pages=16)
    lengths = xp.asarray(np.array([5, 140, 201], np.int32))
    sinks = xp.asarray(rng.normal(size=8).astype(np.float32))
    call = dict(block_table=table, window_size=(127, 0), causal=True, sinks=sinks)
    for step in range(4):
        q = random_array((batch, 1, 8, 64), "bfloat16", rng)
        k, v = (random_array((batch, 1, 2, 64), "bfloat16", rng) for _ in range(2))
        got = numflash.attention_with_kvcache(q, *caches, k, v, cache_seqlens=lengths,
                                              return_lse=True, **call)  # fmt: skip
        want = api._attention_with_kvcache(q, *twins, k, v, lengths, None, table, True, None,
                                           (127, 0), 0, True, None, None, 0.0, sinks)  # fmt: skip
        for name, a, b in zip(("out", "lse"), got, want):
            assert (_bits(a) == _bits(b)).all(), f"step {step}: {name}"
        lengths += 1
    _same_caches(caches, twins)
    assert _plan_count() == 1


@cuda.jit(device=True)
def _relative_bias(score, b, h, q_idx, kv_idx, slopes, documents):
    return score + slopes[h] * (float32(q_idx) - float32(kv_idx))


@cuda.jit(device=True)
def _relative_bias_derivative(score, b, h, q_idx, kv_idx, slopes, documents):
    return float32(1.0)


@cuda.jit(device=True)
def _same_document(b, h, q_idx, kv_idx, slopes, documents):
    return documents[q_idx] == documents[kv_idx]


def _mod_args(rng, heads, seqlen):
    slopes = xp.asarray(rng.uniform(-0.3, 0.3, size=heads).astype(np.float32))
    cuts = np.sort(rng.choice(np.arange(1, seqlen), 3, replace=False))
    documents = np.zeros(seqlen, np.int32)
    for cut in cuts:
        documents[cut:] += 1
    return slopes, xp.asarray(documents)


def test_calls_with_user_functions_replay_with_each_call_s_mod_args():
    """A relative bias and a document mask with new mod_args values every trial, forward and
    backward: each replay equal to the full path bit for bit, one plan each."""
    api._plans.clear()
    rng = np.random.default_rng(16)
    mods = dict(score_mod=_relative_bias, mask_mod=_same_document)
    for trial in range(3):
        q, k, v = random_qkv(1, 130, 130, 4, 2, 128, "bfloat16")
        mod_args = _mod_args(rng, 4, 130)
        out, lse = numflash.attention(q, k, v, causal=True, return_lse=True, mod_args=mod_args,
                                      **mods)  # fmt: skip
        full = (*mods.values(), mod_args, None, None)
        want = api._attention(q, k, v, True, None, (-1, -1), True, None, None, mods=full)
        for name, a, b in zip(("out", "lse"), (out, lse), want):
            assert (_bits(a) == _bits(b)).all(), f"trial {trial}: {name}"
        dout = random_array(q.shape, "bfloat16", rng)
        got = numflash.attention_backward(dout, q, k, v, out, lse, causal=True,
                                          mod_args=mod_args,
                                          score_mod_derivative=_relative_bias_derivative, **mods)  # fmt: skip
        full = (*mods.values(), mod_args, _relative_bias_derivative, None)
        want = api._attention_backward(dout, q, k, v, out, lse, True, None, (-1, -1), False,
                                       None, 0.0, None, None, full)  # fmt: skip
        for name, a, b in zip(("dq", "dk", "dv"), got, want):
            assert (_bits(a) == _bits(b)).all(), f"trial {trial}: {name}"
    assert _plan_count() == 2


def test_one_block_mask_for_every_call_replays_one_plan():
    """A block mask made once serves a layer's calls: replays equal the full path."""
    api._plans.clear()
    rng = np.random.default_rng(17)
    mod_args = _mod_args(rng, 4, 300)
    mask = numflash.block_mask(_same_document, None, None, 300, 300, mod_args=mod_args)
    for trial in range(3):
        q, k, v = random_qkv(1, 300, 300, 4, 2, 64, "float16")
        out = numflash.attention(q, k, v, score_mod=_relative_bias, block_mask=mask)
        full = (_relative_bias, None, (), None, mask)
        want = api._attention(q, k, v, False, None, (-1, -1), False, None, None, mods=full)
        assert (_bits(out) == _bits(want)).all(), f"trial {trial}"
    assert _plan_count() == 1


def test_a_dropped_output_is_reused_and_a_held_one_never_written_again():
    """A replay hands out its last output again once the caller has let go of it (its result
    still exact), and never while anything refers to it or its memory: a name, a view, a view
    at an offset, its MemoryPointer, a DLPack capsule."""
    api._plans.clear()
    q, k, v = random_qkv(2, 33, 90, 4, 2, 64, "float16")
    numflash.attention(q, k, v)  # records the plan
    want = _bits(api._attention(q, k, v, False, None, (-1, -1), False, None, None))
    ptr = numflash.attention(q, k, v).data.ptr  # dropped at once
    again = numflash.attention(q, k, v)
    assert again.data.ptr == ptr and (_bits(again) == want).all()
    del again
    holds = {
        "name": lambda x: x,
        "view": lambda x: x.reshape(-1),
        "view at an offset": lambda x: x[1:],
        "memory pointer": lambda x: x.data,
        "DLPack capsule": lambda x: x.__dlpack__(),
    }
    for what, hold in holds.items():
        out = numflash.attention(q, k, v)
        out_ptr = out.data.ptr
        holder = hold(out)
        del out
        for _ in range(2):  # neither the next call nor the one after takes it
            q2, k2, v2 = random_qkv(2, 33, 90, 4, 2, 64, "float16")
            fresh = numflash.attention(q2, k2, v2)
            assert fresh.data.ptr != out_ptr, f"an output held by a {what} was written again"
            del fresh
        del holder


def test_calls_with_out_replay_into_it_and_an_overlapping_out_is_still_refused():
    api._plans.clear()
    q, k, v = random_qkv(1, 50, 90, 4, 1, 128, "float16")
    caches = [random_array((2, 64, 1, 128), "float16") for _ in range(2)]
    for trial in range(3):  # the first call of each records, the next two replay
        out = random_array(q.shape, "float16")  # poisoned with values, overwritten
        assert numflash.attention(q, k, v, out=out) is out
        want = api._attention(q, k, v, False, None, (-1, -1), False, None, None)
        assert (_bits(out) == _bits(want)).all(), f"trial {trial}"
        out_d = random_array((2, 1, 4, 128), "float16")
        qd = random_array((2, 1, 4, 128), "float16")
        got = numflash.attention_with_kvcache(qd, *caches, cache_seqlens=33, out=out_d)
        want = api._attention_with_kvcache(
            qd, *caches, None, None, 33, None, None, False, None, (-1, -1), 0, False, None, None
        )
        assert got is out_d and (_bits(out_d) == _bits(want)).all(), f"trial {trial}"
    assert _plan_count() == 2
    with pytest.raises(ValueError, match="out overlaps q"):
        numflash.attention(q, k, v, out=q)
    with pytest.raises(ValueError, match="out overlaps k_cache"):
        inside = caches[0].reshape(-1)[: qd.size].reshape(qd.shape)  # q's shape, in the cache
        numflash.attention_with_kvcache(qd, *caches, cache_seqlens=33, out=inside)
