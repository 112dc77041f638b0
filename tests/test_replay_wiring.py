"""The repeated-call path of numflash.api, without a GPU: a call's signature key, the plan the
first call records, and which of the next call's pointers each replayed launch receives.

CuPy and the kernels are replaced by stand-ins (tests/support/standins.py): the full path is a
stub that records one launch taking every array of the call, as the real ones do. What the
kernels compute is tests/test_plans.py's part, on the GPU."""

import numpy as np
import pytest
from support.standins import DeviceArray, Foreign, foreign_intake

import numflash
from numflash import api, launch, plans
from numflash.arrays import KernelArray

STREAM = 0x5EED


class _Stream:
    ptr = STREAM


class _Prepared:
    """A prepared launch whose replay code notes the pointer each argument position got."""

    def __init__(self, roles, replays):
        self.roles = roles
        self.replays = replays

    def _replayed(self, stream, pointers):
        assert stream == STREAM
        self.replays.append(pointers)

    def lines(self, slots, pointer, stream, pad):
        given = ", ".join(f"{pos}: {pointer(role)}" for pos, role in self.roles.items())
        return [f"{pad}{slots}({stream}, {{{given}}})"]

    def namespace(self, slots):
        return {slots: self._replayed}


class _Launcher:
    def __init__(self, replays):
        self.replays = replays

    def prepare(self, grid, block, shared_bytes, args, roles):
        return _Prepared(dict(roles), self.replays)


class _Device:
    """numflash.api on stand-ins: arrays from DeviceArray, one device, one stream, and full
    paths that record one launch over the arrays they are given and make."""

    def __init__(self, monkeypatch):
        self.capturing = 0
        self.devices = 1
        self.full_calls = 0
        self.replays = []
        self.fills = []  # (address, value, count, stream) of each int length a replay wrote
        monkeypatch.setattr(api, "SIMULATOR", False)
        monkeypatch.setattr(api, "_plans", plans.PlanCache())
        monkeypatch.setattr(api._Cupy, "empty", lambda shape, dtype: DeviceArray(shape, dtype))
        monkeypatch.setattr(api._Cupy, "get_device", lambda: 0)
        monkeypatch.setattr(api._Cupy, "device_count", lambda: self.devices)
        monkeypatch.setattr(api._Cupy, "current_stream", _Stream)
        monkeypatch.setattr(api._Cupy, "stream_is_capturing", lambda stream: self.capturing)
        monkeypatch.setattr(api._Cupy, "fill", lambda *args: (self.fills.append(args) or 0,))
        monkeypatch.setattr(api, "_attention", self._forward)
        monkeypatch.setattr(api, "_attention_with_kvcache", self._kvcache)
        monkeypatch.setattr(api, "_attention_backward", self._backward)
        monkeypatch.setattr(api, "_attention_varlen", self._varlen)

    def _launch(self, *arrays):
        """The one launch a full path records: every array, then a scalar (nothing where the
        call is not recorded: one that gets no plan)."""
        if launch._recording.record is None:
            return
        args = tuple(KernelArray(x.data.ptr, x.size, x.dtype.itemsize, x) for x in arrays)
        launch._recording.record.launches.append(
            (_Launcher(self.replays), (1, 1, 1), (32, 1, 1), 0, (*args, 1.0))
        )

    def _launch_present(self, *arrays, mods=None):
        """The launch of the arrays given, then (as the kernels take them after the sinks and
        slopes) the mod_args and a block mask's index."""
        if mods is not None:
            _, _, mod_args, _, block_mask = mods
            arrays += tuple(mod_args) + ((block_mask.index,) if block_mask is not None else ())
        self._launch(*(x for x in arrays if x is not None))

    def _forward(self, q, k, v, causal, scale, window, return_lse, out, config, softcap=0.0,
                 sinks=None, alibi_slopes=None, mods=None):  # fmt: skip
        self.full_calls += 1
        out = DeviceArray(q.shape, q.dtype) if out is None else out
        lse = DeviceArray((q.shape[0], q.shape[2], q.shape[1]), np.float32)
        self._launch_present(q, k, v, out, sinks, alibi_slopes, lse, mods=mods)
        return (out, lse) if return_lse else out

    def _kvcache(self, q, k_cache, v_cache, k, v, seqlens, batch_idx, block_table, *rest):
        self.full_calls += 1
        return_lse, out = rest[4], rest[5]
        out = DeviceArray(q.shape, q.dtype) if out is None else out
        lse = DeviceArray((q.shape[0], q.shape[2], q.shape[1]), np.float32)
        if isinstance(seqlens, int):  # an array filled with it, as launch.host_lengths makes
            seqlens = DeviceArray((q.shape[0],), np.int32)
            if launch._recording.record is not None:
                launch._recording.record.fills.append(seqlens)
        sinks, slopes = rest[8:10]
        self._launch_present(q, k_cache, v_cache, k, v, seqlens, batch_idx, block_table, out,
                             sinks, slopes, lse, mods=rest[10] if len(rest) > 10 else None)  # fmt: skip
        return (out, lse) if return_lse else out

    def _varlen(self, q, k, v, cu_q, cu_k, max_q, max_k, causal, scale, window, return_lse, *rest):
        self.full_calls += 1
        out = DeviceArray(q.shape, q.dtype) if rest[0] is None else rest[0]
        lse = DeviceArray((q.shape[1], q.shape[0]), np.float32)
        mods = rest[5] if len(rest) > 5 else None
        self._launch_present(q, k, v, cu_q, cu_k, out, *rest[3:5], lse, mods=mods)
        return (out, lse) if return_lse else out

    def _backward(self, dout, q, k, v, out, lse, *flags):
        self.full_calls += 1
        sinks, slopes = flags[6:8]
        grads = tuple(DeviceArray(x.shape, x.dtype) for x in (q, k, v))
        if sinks is not None:  # dsinks
            grads += (DeviceArray(sinks.shape, sinks.dtype),)
        mods = flags[8] if len(flags) > 8 else None
        self._launch_present(dout, q, k, v, out, lse, sinks, slopes, *grads, mods=mods)
        return grads


@pytest.fixture
def device(monkeypatch):
    return _Device(monkeypatch)


def _qkv(batch=2, seqlen_q=3, seqlen_k=40, nheads=8, nheads_k=2, head_dim=64):
    return (
        DeviceArray((batch, seqlen_q, nheads, head_dim)),
        DeviceArray((batch, seqlen_k, nheads_k, head_dim)),
        DeviceArray((batch, seqlen_k, nheads_k, head_dim)),
    )


def _pointers(*arrays):
    """The replay's expected {argument position: pointer}: the arrays in launch order."""
    return {pos: x.data.ptr for pos, x in enumerate(arrays)}


@pytest.mark.parametrize("return_lse", [False, True])
def test_attention_replays_with_the_new_calls_pointers(device, return_lse):
    numflash.attention(*_qkv(), causal=True, return_lse=return_lse)  # records the plan
    q, k, v = _qkv()
    got = numflash.attention(q, k, v, causal=True, return_lse=return_lse)
    out, lse = got if return_lse else (got, None)
    assert device.full_calls == 1
    assert (out.shape, out.dtype) == (q.shape, q.dtype)
    if return_lse:
        assert (lse.shape, lse.dtype) == ((2, 8, 3), np.float32)
        assert device.replays == [_pointers(q, k, v, out, lse)]
    else:  # the lse nobody asked for is the plan's own buffer, the same at every replay
        (replay,) = device.replays
        assert {p: replay[p] for p in range(4)} == _pointers(q, k, v, out)
        assert 4 not in replay


@pytest.mark.parametrize(
    "change",
    [
        dict(causal=1),  # True and 1 are different calls
        dict(softmax_scale=0.125),
        dict(softmax_scale=1),
        dict(window_size=(4, 0)),
        dict(return_lse=True),
        dict(softcap=30.0),
        dict(q=DeviceArray((2, 3, 8, 64), np.dtype("float32"))),
        dict(q=DeviceArray((2, 3, 8, 64), strides=(3 * 8 * 128, 128, 3 * 128, 2))),  # a view
        dict(q=DeviceArray((2, 3, 8, 64), ptr=(1 << 40) + 8)),  # only 8-byte aligned
        dict(k=DeviceArray((2, 41, 2, 64)), v=DeviceArray((2, 41, 2, 64))),
    ],
    ids=lambda change: ",".join(change),
)
def test_a_call_that_differs_in_its_signature_records_its_own_plan(device, change):
    q, k, v = _qkv()
    numflash.attention(q, k, v, causal=True)
    numflash.attention(*_qkv(), causal=True)
    assert device.full_calls == 1
    args = dict(q=q, k=k, v=v, causal=True)
    args.update(change)
    numflash.attention(**args)
    assert device.full_calls == 2, f"{change} reached the plan of another signature"


def test_another_stream_or_a_new_cache_generation_records_its_own_plan(device, monkeypatch):
    numflash.attention(*_qkv())
    monkeypatch.setattr(api._Cupy, "current_stream", type("Other", (), {"ptr": 7}))
    numflash.attention(*_qkv())
    monkeypatch.setattr(api.cache, "generation", api.cache.generation + 1)
    numflash.attention(*_qkv())
    assert device.full_calls == 3


def _kvcache_arrays():
    q = DeviceArray((2, 1, 8, 64))
    caches = (DeviceArray((16, 4, 2, 64)), DeviceArray((16, 4, 2, 64)))
    new = (DeviceArray((2, 1, 2, 64)), DeviceArray((2, 1, 2, 64)))
    seqlens = DeviceArray((2,), np.int32)
    table = DeviceArray((2, 8), np.int32)
    return q, caches, new, seqlens, table


def test_a_paged_decoding_step_replays_with_the_new_calls_pointers(device):
    q, (kc, vc), (k, v), seqlens, table = _kvcache_arrays()
    numflash.attention_with_kvcache(q, kc, vc, k, v, cache_seqlens=seqlens, block_table=table)
    q, _, (k, v), seqlens2, _ = _kvcache_arrays()  # the same caches and table, a new step
    out = numflash.attention_with_kvcache(
        q, kc, vc, k, v, cache_seqlens=seqlens2, block_table=table
    )
    assert device.full_calls == 1
    (replay,) = device.replays
    want = _pointers(q, kc, vc, k, v, seqlens2, table, out)
    assert {p: replay[p] for p in want} == want


def test_an_int_cache_length_replays_with_its_value_written_into_the_plan_s_lengths(device):
    """A decoding loop passing its length as an int advancing every step replays one plan,
    each replay writing the step's length into the array the full path filled; a length the
    full path would refuse (past the capacity, 32, less the appended row) is left to it."""
    q, (kc, vc), (k, v), _, table = _kvcache_arrays()
    for length in (3, 4, 5, 31):
        numflash.attention_with_kvcache(q, kc, vc, k, v, cache_seqlens=length, block_table=table)
    assert device.full_calls == 1 and len(device.replays) == 3
    (plan,) = api._plans._plans.values()
    ((_, filled, _, _),) = plan.fills
    assert device.fills == [(filled.data.ptr, n, 2, STREAM) for n in (4, 5, 31)]
    assert all(5 not in replay for replay in device.replays)  # its address stays in the launch
    for refused in (32, -1, True):
        numflash.attention_with_kvcache(q, kc, vc, k, v, cache_seqlens=refused, block_table=table)
    assert device.full_calls == 4 and len(device.fills) == 3


def test_a_replay_with_an_int_cache_length_gives_the_table_its_pointer(device):
    q, (kc, vc), (k, v), _, table = _kvcache_arrays()
    numflash.attention_with_kvcache(q, kc, vc, k, v, cache_seqlens=3, block_table=table)
    q, _, (k, v), _, _ = _kvcache_arrays()
    table2 = DeviceArray(table.shape, np.int32)
    out = numflash.attention_with_kvcache(q, kc, vc, k, v, cache_seqlens=3, block_table=table2)
    assert device.full_calls == 1
    (replay,) = device.replays
    want = _pointers(q, kc, vc, k, v, table2, out)  # the filled lengths at 5, kept
    want = {p + (p >= 5): pointer for p, pointer in want.items()}
    assert {p: replay[p] for p in want} == want and 5 not in replay


def test_one_array_in_several_roles_replays_and_a_call_with_them_apart_gets_its_own_plan(
    device,
):
    """attention(q, q, q) replays; a call with three arrays of its key is refused by that plan
    and records its own, which then serves both."""
    q = DeviceArray((2, 40, 2, 64))
    for _ in range(3):
        out = numflash.attention(q, q, q)
    assert device.full_calls == 1 and len(device.replays) == 2
    assert {p: device.replays[-1][p] for p in range(4)} == _pointers(q, q, q, out)
    apart = [DeviceArray(q.shape) for _ in range(3)]
    numflash.attention(*apart)
    assert device.full_calls == 2
    out = numflash.attention(*apart)
    assert {p: device.replays[-1][p] for p in range(4)} == _pointers(*apart, out)
    out = numflash.attention(q, q, q)
    assert device.full_calls == 2
    assert {p: device.replays[-1][p] for p in range(4)} == _pointers(q, q, q, out)


def test_one_array_as_new_k_and_v_replays(device):
    q, (kc, vc), (k, _), seqlens, table = _kvcache_arrays()
    for _ in range(3):
        numflash.attention_with_kvcache(q, kc, vc, k, k, cache_seqlens=seqlens, block_table=table)
    assert device.full_calls == 1 and len(device.replays) == 2
    assert device.replays[-1][3] == device.replays[-1][4] == k.data.ptr


def test_a_packed_batch_replays_with_new_offsets_and_max_lengths_in_one_multiple_of_128(device):
    """A training loop's packed batches: new offsets every step (one array for q and k, as
    self-attention passes them), max lengths that change within one bound (97-104)."""
    q, k, v = (DeviceArray((300, 4, 64)) for _ in range(3))
    steps = [(DeviceArray((5,), np.int32), m) for m in (100, 104, 97, 99)]
    for cu, longest in steps:
        out = numflash.attention_varlen(q, k, v, cu, cu, longest, longest, causal=True)
    assert device.full_calls == 1 and len(device.replays) == 3
    assert {p: device.replays[-1][p] for p in range(6)} == _pointers(q, k, v, cu, cu, out)
    for other in (105, 0, True, float("nan"), float("inf")):  # another bound; four refused
        numflash.attention_varlen(q, k, v, cu, cu, other, 100, causal=True)
    assert device.full_calls == 6


def test_packed_batches_cycling_through_more_bounds_than_recent_plans_skip_the_key(
    device, monkeypatch
):
    """Max lengths cycling through more bounds than plans.RECENT: each bound's plans are tried
    first by the calls of that bound (api._recent), so after one round no call builds a key."""
    q, k, v = (DeviceArray((3000, 4, 64)) for _ in range(3))
    bounds = [100 * (i + 1) for i in range(plans.RECENT + 3)]
    for longest in bounds * 2:  # recorded, then found by key and made recent
        numflash.attention_varlen(q, k, v, *[DeviceArray((5,), np.int32)] * 2, longest, 64)
    keys = []
    original = api._VARLEN.key
    monkeypatch.setattr(api._VARLEN, "key", lambda *a: keys.append(a) or original(*a))
    for longest in bounds:
        cu = DeviceArray((5,), np.int32)
        out = numflash.attention_varlen(q, k, v, cu, cu, longest, 64)
        assert {p: device.replays[-1][p] for p in range(6)} == _pointers(q, k, v, cu, cu, out)
    assert keys == [] and device.full_calls == len(bounds)


def test_arrays_of_another_library_replay_as_the_arrays_they_are_taken_as(device, monkeypatch):
    monkeypatch.setattr(api.arrays, "intake", foreign_intake)
    q, (kc, vc), (k, v), seqlens, table = _kvcache_arrays()
    for _ in range(3):
        given = [Foreign(x) for x in (q, kc, vc, k, v, seqlens, table)]
        out = numflash.attention_with_kvcache(
            *given[:5], cache_seqlens=given[5], block_table=given[6]
        )
    assert device.full_calls == 1 and len(device.replays) == 2
    (q, kc, vc, k, v, seqlens, table) = (x.inner for x in given)
    assert {p: device.replays[-1][p] for p in range(8)} == _pointers(
        q, kc, vc, k, v, seqlens, table, out
    )
    for _ in range(2):
        out = numflash.attention(*(Foreign(x) for x in _qkv()))
    assert device.full_calls == 2 and len(device.replays) == 3
    keys = []  # taken as CuPy arrays before the recent plans are tried: no key built
    original = api._ATTENTION.key
    monkeypatch.setattr(api._ATTENTION, "key", lambda *a: keys.append(a) or original(*a))
    q, k, v = _qkv()
    out = numflash.attention(*(Foreign(x) for x in (q, k, v)))
    assert keys == [] and device.full_calls == 2 and len(device.replays) == 4
    assert {p: device.replays[-1][p] for p in range(4)} == _pointers(q, k, v, out)


def test_new_rows_inside_the_cache_are_left_to_the_full_path_to_refuse(device):
    q, (kc, vc), (k, v), seqlens, table = _kvcache_arrays()
    numflash.attention_with_kvcache(q, kc, vc, k, v, cache_seqlens=seqlens, block_table=table)
    inside = DeviceArray(k.shape, ptr=kc.data.ptr + 256)  # overlaps k_cache
    for q_, k_ in ((q, inside), (DeviceArray(q.shape, ptr=vc.data.ptr), k)):
        numflash.attention_with_kvcache(q_, kc, vc, k_, v, cache_seqlens=seqlens, block_table=table)
    assert device.replays == [] and device.full_calls == 3


def test_an_index_array_inside_a_cache_is_left_to_the_full_path_only_with_an_append(device):
    q, (kc, vc), (k, v), seqlens, table = _kvcache_arrays()
    inside = DeviceArray(table.shape, np.int32, ptr=vc.data.ptr + 512)  # the table in v_cache
    numflash.attention_with_kvcache(q, kc, vc, k, v, cache_seqlens=seqlens, block_table=table)
    numflash.attention_with_kvcache(q, kc, vc, k, v, cache_seqlens=seqlens, block_table=inside)
    assert device.replays == [] and device.full_calls == 2  # the append would write it
    numflash.attention_with_kvcache(q, kc, vc, cache_seqlens=seqlens, block_table=table)
    numflash.attention_with_kvcache(q, kc, vc, cache_seqlens=seqlens, block_table=inside)
    assert len(device.replays) == 1 and device.full_calls == 3  # read only: replayed


def test_one_cache_for_k_and_v_is_left_to_the_full_path_only_with_an_append(device):
    q, (kc, vc), (k, v), seqlens, table = _kvcache_arrays()
    for new in ((k, v), (k, v), (None, None), (None, None)):  # a plan each, then the same cache
        numflash.attention_with_kvcache(q, kc, vc, *new, cache_seqlens=seqlens, block_table=table)
        numflash.attention_with_kvcache(q, kc, kc, *new, cache_seqlens=seqlens, block_table=table)
    # appends: the first call and both with one cache; reads: the first call alone
    assert device.full_calls == 4 and len(device.replays) == 4


def test_backward_replays_with_the_new_calls_pointers(device):
    def arrays():
        q, k, v = _qkv()
        return (DeviceArray(q.shape), q, k, v, DeviceArray(q.shape), DeviceArray((2, 8, 3), "f4"))

    numflash.attention_backward(*arrays(), causal=True)
    inputs = arrays()
    dq, dk, dv = numflash.attention_backward(*inputs, causal=True)
    assert device.full_calls == 1
    assert device.replays == [_pointers(*inputs, dq, dk, dv)]
    assert [g.shape for g in (dq, dk, dv)] == [x.shape for x in inputs[1:4]]


def _heads(*shape):
    return DeviceArray(shape, np.float32)


def test_attention_with_sinks_and_slopes_replays_with_the_new_calls_pointers(device):
    """The variant arrays are roles like the others: a repeated call replays with its own
    sinks and slopes, and the lse it asked for takes the role after them."""
    numflash.attention(*_qkv(), sinks=_heads(8), alibi_slopes=_heads(2, 8), return_lse=True)
    q, k, v = _qkv()
    sinks, slopes = _heads(8), _heads(2, 8)
    out, lse = numflash.attention(q, k, v, sinks=sinks, alibi_slopes=slopes, return_lse=True)
    assert device.full_calls == 1
    assert device.replays == [_pointers(q, k, v, out, sinks, slopes, lse)]
    numflash.attention(q, k, v, sinks=_heads(8), alibi_slopes=_heads(8), return_lse=True)
    assert device.full_calls == 2, "slopes of another shape reached the plan"


@pytest.mark.parametrize("variant", ["sinks", "alibi_slopes"])
def test_a_call_with_a_variant_array_and_one_without_have_their_own_plans(device, variant):
    q, k, v = _qkv()
    numflash.attention(q, k, v)
    numflash.attention(q, k, v, **{variant: _heads(8)})
    numflash.attention(q, k, v, **{variant: _heads(8)})
    numflash.attention(q, k, v)
    assert device.full_calls == 2 and len(device.replays) == 2


def test_an_out_overlapping_the_sinks_is_left_to_the_full_path(device):
    q, k, v = _qkv()
    sinks = _heads(8)
    numflash.attention(q, k, v, sinks=sinks, out=DeviceArray(q.shape))
    inside = DeviceArray(q.shape, ptr=sinks.data.ptr + 16)
    numflash.attention(q, k, v, sinks=sinks, out=inside)
    assert device.full_calls == 2, "an out overlapping the sinks was replayed"


def test_backward_with_sinks_replays_and_returns_dsinks(device):
    def arrays():
        q, k, v = _qkv()
        return (DeviceArray(q.shape), q, k, v, DeviceArray(q.shape), DeviceArray((2, 8, 3), "f4"))

    numflash.attention_backward(*arrays(), sinks=_heads(8))
    inputs, sinks = arrays(), _heads(8)
    grads = numflash.attention_backward(*inputs, sinks=sinks)
    assert device.full_calls == 1 and len(grads) == 4
    assert device.replays == [_pointers(*inputs, sinks, *grads)]
    assert (grads[3].shape, grads[3].dtype) == ((8,), np.float32)


def test_a_gpt_oss_decoding_step_with_sinks_replays(device):
    """A paged decoding step with sinks, as gpt-oss's layers make it, every step."""
    q, (kc, vc), (k, v), seqlens, table = _kvcache_arrays()
    sinks = _heads(8)
    call = dict(cache_seqlens=seqlens, block_table=table, sinks=sinks, window_size=(127, 0))
    numflash.attention_with_kvcache(q, kc, vc, k, v, **call)
    q, _, (k, v), _, _ = _kvcache_arrays()
    out = numflash.attention_with_kvcache(q, kc, vc, k, v, **call)
    assert device.full_calls == 1
    assert device.replays == [_pointers(q, kc, vc, k, v, seqlens, table, out, sinks)]
    for other in (kc, vc):  # sinks inside a cache an append writes: the full path's to refuse
        inside = DeviceArray((8,), np.float32, ptr=other.data.ptr + 64)
        numflash.attention_with_kvcache(q, kc, vc, k, v, **dict(call, sinks=inside))
    assert device.full_calls == 3


def test_a_packed_batch_with_slopes_replays(device):
    q, k, v = (DeviceArray((300, 4, 64)) for _ in range(3))
    for _ in range(2):
        cu, slopes = DeviceArray((5,), np.int32), _heads(4, 4)
        out = numflash.attention_varlen(q, k, v, cu, cu, 100, 100, alibi_slopes=slopes)
    assert device.full_calls == 1
    assert device.replays == [_pointers(q, k, v, cu, cu, out, slopes)]


def _score_mod(score, b, h, q_idx, kv_idx, bias):
    """A stand-in for a user's score_mod (the stand-ins' full path runs nothing)."""
    return score + bias[h]


def _mask_mod(b, h, q_idx, kv_idx, bias):
    return kv_idx <= q_idx


def _replayed(device, *arrays):
    """Whether the one replay so far gave the launch exactly the pointers of ``arrays``, the
    call's arrays (the stand-in launch takes a user function call's mod_args last)."""
    (replay,) = device.replays
    return sorted(replay.values()) == sorted(x.data.ptr for x in arrays)


class _BlockMask:
    """A stand-in block mask: the index array its kernels read."""

    def __init__(self):
        self.index = DeviceArray((64,), np.int32)


def test_attention_with_user_functions_replays_with_the_new_calls_mod_args(device):
    """The functions are part of the key (by identity), each of the mod_args a role: a
    repeated call replays with its own arrays; other functions record their own plan."""
    bias = DeviceArray((8,), np.float32)
    numflash.attention(*_qkv(), score_mod=_score_mod, mod_args=(bias,), return_lse=True)
    q, k, v = _qkv()
    bias2 = DeviceArray((8,), np.float32)
    out, lse = numflash.attention(q, k, v, score_mod=_score_mod, mod_args=[bias2],
                                  return_lse=True)  # fmt: skip
    assert device.full_calls == 1
    assert _replayed(device, q, k, v, out, lse, bias2)
    numflash.attention(q, k, v, score_mod=_mask_mod, mod_args=(bias2,), return_lse=True)
    numflash.attention(q, k, v, mask_mod=_mask_mod, mod_args=(bias2,), return_lse=True)
    numflash.attention(q, k, v, score_mod=_score_mod, mod_args=(bias2, bias), return_lse=True)
    numflash.attention(q, k, v, return_lse=True)
    assert device.full_calls == 5 and len(device.replays) == 1


def test_a_block_mask_is_part_of_the_key_and_with_mod_args_gets_no_plan(device):
    """One block mask for every layer and step replays; a new one records its plan; a call
    with a block mask and its mod_args given too takes the full path every time."""
    mask, other = _BlockMask(), _BlockMask()
    for _ in range(3):
        numflash.attention(*_qkv(), mask_mod=_mask_mod, block_mask=mask)
    assert device.full_calls == 1 and len(device.replays) == 2
    # the index is no role: the launch keeps the address it recorded (the block mask's own)
    assert mask.index.data.ptr not in device.replays[-1].values()
    numflash.attention(*_qkv(), mask_mod=_mask_mod, block_mask=other)
    assert device.full_calls == 2
    bias = DeviceArray((8,), np.float32)
    for _ in range(2):
        numflash.attention(*_qkv(), mask_mod=_mask_mod, block_mask=mask, mod_args=(bias,))
    assert device.full_calls == 4


def test_an_out_overlapping_a_mod_arg_is_left_to_the_full_path(device):
    q, k, v = _qkv()
    bias = DeviceArray((8,), np.float32)
    call = dict(score_mod=_score_mod, mod_args=(bias,))
    numflash.attention(q, k, v, out=DeviceArray(q.shape), **call)
    numflash.attention(q, k, v, out=DeviceArray(q.shape, ptr=bias.data.ptr), **call)
    assert device.full_calls == 2, "an out over a mod_arg was replayed"


def test_backward_with_user_functions_replays(device):
    def arrays():
        q, k, v = _qkv()
        return (DeviceArray(q.shape), q, k, v, DeviceArray(q.shape), DeviceArray((2, 8, 3), "f4"))

    call = dict(score_mod=_score_mod, score_mod_derivative=_mask_mod)
    numflash.attention_backward(*arrays(), mod_args=(DeviceArray((8,), np.float32),), **call)
    inputs, bias = arrays(), DeviceArray((8,), np.float32)
    grads = numflash.attention_backward(*inputs, mod_args=(bias,), **call)
    assert device.full_calls == 1
    assert _replayed(device, *inputs, *grads, bias)


def test_a_decoding_step_with_user_functions_replays_and_checks_the_mod_args(device):
    """A decoding step with a mask_mod replays with its new mod_args; a mod_arg inside a
    cache being appended to is left to the full path (which refuses it)."""
    q, (kc, vc), (k, v), seqlens, table = _kvcache_arrays()
    call = dict(cache_seqlens=seqlens, block_table=table, mask_mod=_mask_mod)
    numflash.attention_with_kvcache(q, kc, vc, k, v, mod_args=(DeviceArray((2,), np.int32),),
                                    **call)  # fmt: skip
    ids = DeviceArray((2,), np.int32)
    out = numflash.attention_with_kvcache(q, kc, vc, k, v, mod_args=(ids,), **call)
    assert device.full_calls == 1
    assert _replayed(device, q, kc, vc, k, v, seqlens, table, out, ids)
    inside = DeviceArray((2,), np.int32, ptr=kc.data.ptr + 64)
    numflash.attention_with_kvcache(q, kc, vc, k, v, mod_args=(inside,), **call)
    assert device.full_calls == 2


def test_a_packed_batch_with_user_functions_replays(device):
    q, k, v = (DeviceArray((300, 4, 64)) for _ in range(3))
    for _ in range(2):
        cu, ids = DeviceArray((5,), np.int32), DeviceArray((300,), np.int32)
        out = numflash.attention_varlen(q, k, v, cu, cu, 100, 100, mask_mod=_mask_mod,
                                        mod_args=(ids,))  # fmt: skip
    assert device.full_calls == 1
    assert _replayed(device, q, k, v, cu, cu, out, ids)


def test_a_call_with_user_functions_is_captured_once_it_has_a_plan(device):
    q, k, v = _qkv()
    bias = DeviceArray((8,), np.float32)
    call = dict(score_mod=_score_mod, mod_args=(bias,))
    device.capturing = 1
    with pytest.raises(RuntimeError, match="captured into a CUDA graph the first time"):
        numflash.attention(q, k, v, **call)
    device.capturing = 0
    numflash.attention(q, k, v, **call)
    device.capturing = 1
    numflash.attention(q, k, v, **call)
    assert device.full_calls == 1 and len(device.replays) == 1
    with pytest.raises(RuntimeError, match="cannot be captured into a CUDA graph yet"):
        numflash.attention(q, k, v, mask_mod=_mask_mod, block_mask=_BlockMask(), mod_args=(bias,))


def test_a_replay_under_capture_pins_its_plan(device):
    numflash.attention(*_qkv())  # a plan that keeps its own lse buffer
    (plan,) = api._plans._plans.values()
    numflash.attention(*_qkv())
    assert not plan.pinned
    device.capturing = 1
    numflash.attention(*_qkv())
    assert plan.pinned and plan.holder in api._plans._pinned


def test_a_replay_on_the_legacy_default_stream_asks_nothing_about_capture(device, monkeypatch):
    """Capture cannot begin on the legacy default stream (0): a replay there skips the check."""
    monkeypatch.setattr(_Stream, "ptr", 0)
    monkeypatch.setattr(_Prepared, "_replayed", lambda self, stream, pointers: None)
    numflash.attention(*_qkv())
    (plan,) = api._plans._plans.values()
    assert plan.replay_source is None  # written when a call first finds the plan
    device.capturing = 1  # what the check would have found
    numflash.attention(*_qkv())
    assert "capturing" not in plan.replay_source
    assert device.full_calls == 1 and not plan.pinned


def test_a_replay_hands_out_its_last_output_again_only_once_nothing_refers_to_it(device):
    q, k, v = _qkv()
    numflash.attention(q, k, v)  # records the plan
    first = numflash.attention(q, k, v)
    first_id, first_ptr = id(first), first.data.ptr
    del first  # dropped, as a decoding loop drops each layer's output
    again = numflash.attention(q, k, v)
    assert (id(again), again.data.ptr) == (first_id, first_ptr)
    # held by a name, through its memory pointer, or through the memory under it: a new array
    for hold in (lambda x: x, lambda x: x.data, lambda x: x.data.mem):
        out = numflash.attention(q, k, v)
        holder, ptr = hold(out), out.data.ptr
        del out
        fresh = numflash.attention(q, k, v)
        assert fresh.data.ptr != ptr, "an output still referred to was handed out again"
        del holder, fresh
    assert device.full_calls == 1


def test_each_output_of_a_replay_is_reused_on_its_own(device):
    q, k, v = _qkv()
    dout, out, lse = DeviceArray(q.shape), DeviceArray(q.shape), DeviceArray((2, 8, 3))
    numflash.attention_backward(dout, q, k, v, out, lse)
    dq, dk, dv = numflash.attention_backward(dout, q, k, v, out, lse)
    before = [x.data.ptr for x in (dq, dk, dv)]
    keep = dk
    del dq, dk, dv
    grads = numflash.attention_backward(dout, q, k, v, out, lse)
    assert [x.data.ptr for x in grads] == [before[0], grads[1].data.ptr, before[2]]
    assert grads[1] is not keep and grads[1].data.ptr != keep.data.ptr
    assert [x.shape for x in grads] == [q.shape, k.shape, v.shape]


def test_outputs_over_the_reuse_limit_are_new_every_call(device, monkeypatch):
    monkeypatch.setattr(plans, "REUSE_BYTES", 100)
    q, k, v = _qkv()
    numflash.attention(q, k, v)
    ids = set()
    for _ in range(3):
        out = numflash.attention(q, k, v)
        ids.add(out.data.ptr)
        del out
    assert len(ids) == 3


def test_a_call_with_out_replays_into_the_given_out(device):
    q, k, v = _qkv()
    numflash.attention(q, k, v, out=DeviceArray(q.shape))  # records the plan with out=
    numflash.attention(q, k, v)  # another signature: out=None
    assert device.full_calls == 2
    q, k, v = _qkv()
    out = DeviceArray(q.shape)
    got = numflash.attention(q, k, v, out=out)
    assert got is out and device.full_calls == 2
    assert {p: device.replays[-1][p] for p in range(4)} == _pointers(q, k, v, out)


@pytest.mark.parametrize("role", ["q", "k", "v"])
def test_an_out_overlapping_an_input_is_left_to_the_full_path(device, role):
    q, k, v = _qkv()
    numflash.attention(q, k, v, out=DeviceArray(q.shape))
    arrays = dict(q=q, k=k, v=v)
    inside = DeviceArray(q.shape, ptr=arrays[role].data.ptr + 128)
    numflash.attention(q, k, v, out=inside)
    assert device.full_calls == 2, f"an out overlapping {role} was replayed"


def test_a_decoding_step_with_out_replays_into_it_and_checks_it_against_every_input(device):
    q, (kc, vc), (k, v), seqlens, table = _kvcache_arrays()
    call = dict(cache_seqlens=seqlens, block_table=table)
    numflash.attention_with_kvcache(q, kc, vc, k, v, out=DeviceArray(q.shape), **call)
    q2, _, (k2, v2), _, _ = _kvcache_arrays()
    out = DeviceArray(q.shape)
    assert numflash.attention_with_kvcache(q2, kc, vc, k2, v2, out=out, **call) is out
    assert device.full_calls == 1
    want = _pointers(q2, kc, vc, k2, v2, seqlens, table, out)
    assert {p: device.replays[-1][p] for p in want} == want
    for other in (q2, kc, vc, k2, v2, seqlens, table):
        inside = DeviceArray(q.shape, ptr=other.data.ptr)
        numflash.attention_with_kvcache(q2, kc, vc, k2, v2, out=inside, **call)
    assert device.full_calls == 8 and len(device.replays) == 1


def test_a_repeated_call_is_taken_by_its_plans_matcher_without_building_the_key(
    device, monkeypatch
):
    numflash.attention(*_qkv())  # records the plan, and builds the key
    numflash.attention(*_qkv())  # finds the plan by its key: it is written and made recent
    keys = []
    original = api._ATTENTION.key
    monkeypatch.setattr(api._ATTENTION, "key", lambda *a: keys.append(a) or original(*a))
    q, k, v = _qkv()
    out = numflash.attention(q, k, v)
    assert keys == [] and device.full_calls == 1
    assert {p: device.replays[-1][p] for p in range(4)} == _pointers(q, k, v, out)


def test_more_signatures_than_the_recent_plans_still_replay_through_their_keys(device):
    lengths = range(40, 40 + plans.RECENT + 2)
    for seqlen_k in lengths:  # each a signature of its own, recorded
        numflash.attention(*_qkv(seqlen_k=seqlen_k))
    for _ in range(2):
        for seqlen_k in lengths:  # ... and replayed in turn
            q, k, v = _qkv(seqlen_k=seqlen_k)
            out = numflash.attention(q, k, v)
            assert {p: device.replays[-1][p] for p in range(4)} == _pointers(q, k, v, out)
    assert device.full_calls == len(lengths)
    assert len(api._plans.recent["attention"].entries) == plans.RECENT


def test_recent_lists_are_bounded(device):
    """Packed batches over ever more bounds of max lengths each get a recent list; past
    plans.MAX_RECENT_LISTS they are all dropped (each holds its plans' buffers), and calls go
    on replaying through their keys."""
    q, k, v = (DeviceArray((3000, 4, 64)) for _ in range(3))
    cu = DeviceArray((5,), np.int32)
    sizes = []
    for step in range(plans.MAX_RECENT_LISTS + 10):
        numflash.attention_varlen(q, k, v, cu, cu, 64 << step % 20, 64 * (step + 1))
        sizes.append(len(api._plans.recent))
    assert max(sizes) == plans.MAX_RECENT_LISTS and sizes[-1] < sizes[-11]
    out = numflash.attention_varlen(q, k, v, cu, cu, 64, 64)
    assert {p: device.replays[-1][p] for p in range(6)} == _pointers(q, k, v, cu, cu, out)
