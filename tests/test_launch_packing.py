"""The packed kernel parameters a plan replays, without a GPU: Numba's ABI as numflash.launch
packs it (an array is seven 8-byte slots, its data pointer the fifth), and the pointers a
replay patches into that buffer landing on the arrays' data slots and nowhere else.

The driver is not called: the launch function is a stand-in that notes its arguments. That
the kernels read these parameters as packed is the GPU tests' part (every launch uses them)."""

import ctypes
import gc
import struct
import weakref

import numpy as np
import pytest

from numflash import launch
from numflash.arrays import KernelArray

SPECS = {
    name: getattr(launch, name)
    for name in ("FORWARD", "FORWARD_VARLEN", "DQ", "TENSOR_CORE_DKDV", "DECODE", "APPEND")
}
#: A kernel with a variant's arrays: its trailing *variant, one array argument each.
SPECS["FORWARD with sinks"] = launch.FORWARD._replace(variant=(("sinks", "float32"),))
#: ... with tensor maps: two templates (MAP_WORDS int64 each) and the map buffer, as the
#: Hopper backward's TMA kernels take them.
SPECS["TENSOR_CORE_DKDV with tensor maps"] = launch.TENSOR_CORE_DKDV._replace(
    variant=(("alibi", "float32"),) + launch.tensor_map_arguments("dkdv")
)


@pytest.fixture
def typed(monkeypatch):
    """Kernel signatures and launchers as on a GPU (the simulator types nothing)."""
    monkeypatch.setattr(launch, "SIMULATOR", False)


def _arguments(signature):
    """Distinct values for each parameter of ``signature``: arrays at addresses 1 GiB apart."""
    from numba.cuda import types

    flat = []
    for ty in signature:  # a trailing *variant: its arrays, one argument each
        flat += list(ty) if isinstance(ty, (types.StarArgTuple, types.StarArgUniTuple)) else [ty]
    args = []
    for i, ty in enumerate(flat):
        if isinstance(ty, types.Array):
            itemsize = ty.dtype.bitwidth // 8
            args.append(KernelArray((i + 1) << 30, 1000 + i, itemsize))
        elif isinstance(ty, types.UniTuple):
            args.append(tuple(100 * i + j for j in range(ty.count)))
        elif ty == types.float32:
            args.append(0.5 + i)
        else:
            args.append(-i)
    return args


def _prepared(spec, dtype_name):
    launcher = launch.Launcher(None, spec.signature(dtype_name))
    launcher._function = lambda: 0xF00  # the CUfunction handle, without a driver
    args = _arguments(launcher.argtypes)
    arrays = [i for i, a in enumerate(args) if isinstance(a, KernelArray)]
    roles = {position: role for role, position in enumerate(arrays)}
    prepared = launcher.prepare((3, 2, 1), 128, 4096, args, roles)
    return launcher, prepared, args, arrays


def _unpack(launcher, prepared):
    return launcher._struct.unpack(bytes(prepared.buffer))


@pytest.mark.parametrize("dtype_name", ["float16", "float32"])
@pytest.mark.parametrize("name", SPECS)
def test_each_parameter_has_an_8_byte_slot_and_arrays_take_seven(typed, name, dtype_name):
    launcher, prepared, args, arrays = _prepared(SPECS[name], dtype_name)
    slots = sum(abs(kind) for kind in launcher._kinds)
    assert launcher._struct.size == 8 * slots
    addresses = np.frombuffer(prepared.pointers, np.uint64)
    assert prepared.address == prepared.pointers.ctypes.data
    assert list(addresses - addresses[0]) == [8 * i for i in range(slots)]
    values, slot = _unpack(launcher, prepared), 0
    for arg in args:
        if isinstance(arg, KernelArray):  # meminfo, parent, nitems, itemsize, data, shape, strides
            n, size = arg.nitems, arg.itemsize
            assert values[slot : slot + 7] == (0, 0, n, size, arg.pointer, n, size)
            slot += 7
        elif isinstance(arg, tuple):
            assert values[slot : slot + len(arg)] == arg
            slot += len(arg)
        else:
            assert values[slot] == pytest.approx(arg)
            slot += 1


@pytest.mark.parametrize("name", SPECS)
def test_a_replay_patches_each_arrays_data_slot_and_nothing_else(typed, name, monkeypatch):
    calls = []
    monkeypatch.setattr(launch, "_launch_kernel", lambda: lambda *a: calls.append(a))
    launcher, prepared, args, arrays = _prepared(SPECS[name], "float16")
    before = _unpack(launcher, prepared)
    new = [(7 << 40) + 256 * role for role in range(len(arrays))]
    prepared.launch(0x5EED, new)
    after = _unpack(launcher, prepared)
    data_slots = _data_slots(launcher)
    assert [after[s] for s in data_slots] == new
    assert [a for i, a in enumerate(after) if i not in data_slots] == [
        b for i, b in enumerate(before) if i not in data_slots
    ]
    assert calls == [(0xF00, 3, 2, 1, 128, 1, 1, 4096, 0x5EED, prepared.address, 0)]


class _Driver:
    """cuLaunchKernel as the driver sees it: the parameters read through the pointer array it is
    handed, at the moment of the launch."""

    class CUresult:
        CUDA_SUCCESS = 0

    def __init__(self, slots):
        self.slots, self.seen = slots, []

    def cuLaunchKernel(self, function, gx, gy, gz, bx, by, bz, shared, stream, params, extra):
        addresses = (ctypes.c_uint64 * self.slots).from_address(params)
        self.seen.append(b"".join(ctypes.string_at(a, 8) for a in addresses))
        return (0,)


@pytest.mark.parametrize("name", SPECS)
def test_an_eager_launch_hands_the_driver_what_a_prepared_one_packs(typed, name, monkeypatch):
    """A launch without a plan packs into one buffer its thread reuses: each launch's
    parameters are its own arguments', slot for slot, whatever the thread launched before."""
    launcher, prepared, args, arrays = _prepared(SPECS[name], "float16")
    driver = _Driver(sum(abs(kind) for kind in launcher._kinds))
    monkeypatch.setattr(launch, "_driver", lambda: driver)
    launcher._static = 0
    moved = [
        a._replace(pointer=a.pointer + (5 << 40)) if isinstance(a, KernelArray) else a for a in args
    ]
    for call in (moved, args):
        launcher((3, 2, 1), 128, 0x5EED, 4096, call)
    assert driver.seen[1] == bytes(prepared.buffer)
    assert driver.seen[0] != driver.seen[1]
    assert launcher._params() == launcher._params()  # one buffer for the thread


def _data_slots(launcher):
    """The slot of each array argument's data pointer, from the slot counts alone."""
    out, slot = [], 0
    for kind in launcher._kinds:
        if kind == 7:
            out.append(slot + 4)
        slot += abs(kind)
    return out


def test_a_format_per_parameter_type_and_a_refusal_for_others(typed):
    from numba.cuda import types

    fmt, kinds = launch._param_layout(
        (types.Array(types.uint16, 1, "C"), types.UniTuple(types.int64, 3), types.int32)
    )
    assert (fmt, kinds) == ("=QQqqQqqqqqi4x", [7, -3, 1])
    assert struct.calcsize(fmt) == 8 * 11
    # a trailing *variant: an array and a tensor map's template, one argument each
    variant = types.StarArgTuple.from_types(
        (types.Array(types.float32, 1, "C"), types.UniTuple(types.int64, 16))
    )
    fmt, kinds = launch._param_layout((types.int32, variant))
    assert (fmt, kinds) == ("=i4xQQqqQqq" + "q" * 16, [1, 7, -16])
    for bad in (types.Array(types.uint16, 2, "C"), types.Array(types.uint16, 1, "A"), types.int8):
        with pytest.raises(TypeError):
            launch._param_layout((bad,))


def test_a_plans_replay_patches_and_launches_each_of_its_launches_in_order(typed, monkeypatch):
    """A plan of two real prepared launches (the append and the decode kernel), its replay
    written out as one function: each launch's data slots of the call's arrays get the call's
    pointers, the output's slot the array the replay made, the rest stays as recorded; the
    launches go out in order on the plan's stream; a replay under capture pins the plan."""
    from support.standins import DeviceArray

    from numflash import plans

    calls = []
    monkeypatch.setattr(launch, "_launch_kernel", lambda: lambda *a: calls.append(a))
    record = launch.Record()
    launchers = []
    for n, spec in enumerate((launch.APPEND, launch.DECODE)):
        launcher = launch.Launcher(None, spec.signature("float16"))
        launcher._function = lambda: 0xF00
        launchers.append(launcher)
        args = [  # the two launches' arrays apart
            a._replace(pointer=a.pointer + (n << 40)) if isinstance(a, KernelArray) else a
            for a in _arguments(launcher.argtypes)
        ]
        record.launches.append((launcher, (3, 2, 1), 128, 4096, args))
    # roles: the first two arrays of the first launch (the call's inputs), the first array of
    # the second (the output the replay makes); every other array is the plan's own
    first = [a for a in record.launches[0][4] if isinstance(a, KernelArray)]
    second = [a for a in record.launches[1][4] if isinstance(a, KernelArray)]
    roles = [DeviceArray((a.nitems,), np.uint8, ptr=a.pointer) for a in (*first[:2], second[0])]
    plan = plans.make(record, roles, outputs=(((16,), np.float16),))
    made = DeviceArray((16,), ptr=0x7700)
    pinned, capturing = [], [False]
    plan.replayer(
        0x5EED,
        plans.Tail(((0, 2),), (0,)),
        lambda shape, dtype: made,
        lambda stream: capturing[0] and stream == 0x5EED,
        pinned.append,
    )
    before = [_unpack(launcher, prepared) for launcher, prepared in zip(launchers, plan.launches)]
    assert plan.replay([0xA000, 0xB000, 0], None) is made
    after = [_unpack(launcher, prepared) for launcher, prepared in zip(launchers, plan.launches)]
    slots = [_data_slots(launcher) for launcher in launchers]
    new = {slots[0][0]: 0xA000, slots[0][1]: 0xB000}, {slots[1][0]: 0x7700}
    for b, a, patched in zip(before, after, new):
        assert [a[i] for i in patched] == list(patched.values())
        assert [x for i, x in enumerate(a) if i not in patched] == [
            x for i, x in enumerate(b) if i not in patched
        ]
    head = (0xF00, 3, 2, 1, 128, 1, 1, 4096, 0x5EED)
    assert calls == [(*head, prepared.address, 0) for prepared in plan.launches]
    assert pinned == []
    capturing[0] = True
    plan.replay([0xA000, 0xB000, 0], None)
    assert pinned == [plan.holder]
    # nothing the plan refers to refers back to it: dropped, it goes at once, with its buffers
    # (the cyclic garbage collector, off here, would free an old one only now and then)
    # ... while its replay, which a recent list may still hold, keeps what it launches with:
    # the packed parameters and the array of their addresses the driver is handed
    plan.ready()
    gone = weakref.ref(plan)
    replay = plan.replay
    kept = [weakref.ref(prepared.pointers) for prepared in plan.launches]
    gc.disable()
    try:
        del plan
        assert gone() is None
        assert all(x() is not None for x in kept)
        del replay
        assert all(x() is None for x in kept)
    finally:
        gc.enable()


# -- launches prepared per geometry (numflash.launch.prepared) ----------------------------------


def _slot_values(address):
    """The values of a launch's parameter slots, from the address of its parameters' addresses:
    an eager launch's (its Launcher's buffer for this thread) or a prepared one's."""
    counts = {pl.address: len(pl.pointers) for found in launch._prepared.values()
              for pl in found.launches}  # fmt: skip
    for launcher in launch._launchers.values():
        params = getattr(launcher._thread, "params", None)
        if params is not None:
            counts[params[1]] = len(launcher._offsets)
    first = ctypes.c_uint64.from_address(address).value
    return list((ctypes.c_uint64 * counts[address]).from_address(first))


@pytest.fixture
def stand_ins(monkeypatch):
    """numflash on full_path_cost's stand-ins (an H200 without a GPU); yields the launches
    the driver got, each (function, grid, block, shared bytes, stream, parameter slots)."""
    import os

    monkeypatch.syspath_prepend(os.path.join(os.path.dirname(__file__), "..", "tools"))
    import full_path_cost

    got = []

    def launched(*args):
        got.append((args[:9], _slot_values(args[9])))

    full_path_cost.stand_in(monkeypatch.setattr, launched)
    return full_path_cost, got


def _twice_and_fresh(call, first, second, got):
    """The launches of ``call(*first)`` (its geometry's first call), ``call(*second)`` (run
    prepared) and ``call(*second)`` again once the prepared launches are dropped (the full
    build)."""
    runs = []
    for arrays_, clear in ((first, False), (second, False), (second, True)):
        if clear:
            launch._prepared.clear()
        del got[:]
        call(*arrays_)
        runs.append(list(got))
    return runs


def _same_but_kept(eager, prepared, fresh, pointers):
    """A prepared run launches what a full build of the same arrays does, slot for slot, but
    for the buffers the first call made, which it uses again; every array's address lands."""
    assert len(prepared) == len(fresh) > 0
    for first, (head, slots), (fresh_head, fresh_slots) in zip(eager, prepared, fresh):
        assert head == fresh_head
        differ = [i for i, (a, b) in enumerate(zip(slots, fresh_slots)) if a != b]
        assert all(slots[i] == first[1][i] for i in differ)  # a kept buffer
        assert not set(pointers) & {fresh_slots[i] for i in differ}
    assert set(pointers) <= {x for _, slots in prepared for x in slots}


@pytest.mark.parametrize("aliased", [False, True], ids=["distinct", "q is k is v"])
def test_a_prepared_forward_launches_what_the_full_build_does(typed, stand_ins, aliased):
    """launch.forward's second call of a geometry runs the launch prepared by its first with
    the new arrays' addresses: the parameters are the full build's for those arrays, but for
    the tensor-map buffer the first call made (kept and used again). q is k is v keys apart
    and patches one address into the three."""
    tool, got = stand_ins
    from numflash import selection, validation

    def arrays_(n=128):
        q, k, v, out = (tool._Array((1, n, 2, 64)) for _ in range(4))
        if aliased:
            k = v = q
        return q, k, v, out, tool._Array((1, 2, n), np.float32)

    first, second = arrays_(), arrays_()
    p = validation.problem(*first[:3], False, None, (-1, -1))[-1]
    cfg = selection.forward(p, tool.H200).config
    runs = _twice_and_fresh(lambda *a: launch.forward(cfg, p, *a), first, second, got)
    assert len(launch._prepared) == 1
    _same_but_kept(*runs, [x.data.ptr for x in second])


def test_a_prepared_backward_launches_what_the_full_build_does(typed, stand_ins):
    """The backward's three launches (row sums, dK/dV, dQ) prepared: the second call of a
    geometry launches what a full build of its arrays does, the row sums' buffer kept."""
    tool, got = stand_ins
    from numflash import selection, validation

    def arrays_():
        xs = [tool._Array((1, 128, 2, 64)) for _ in range(8)]
        return (*xs[:5], tool._Array((1, 2, 128), np.float32), *xs[5:])

    first, second = arrays_(), arrays_()
    p = validation.problem(*first[1:4], True, None, (-1, -1))[-1]
    cfg = selection.backward(p, tool.H200, True).config
    runs = _twice_and_fresh(lambda *a: launch.backward(cfg, p, *a), first, second, got)
    assert len(runs[1]) == 3
    _same_but_kept(*runs, [x.data.ptr for x in second])


def test_what_is_not_prepared(typed, stand_ins, monkeypatch):
    """No launch is prepared for arrays off 16-byte boundaries (the full path copies them), for
    a call recorded for a replay plan (which keeps buffers of its own), nor where the first
    call made more than MAX_KEPT_BYTES of buffers; each of them runs the full build."""
    tool, got = stand_ins
    from numflash import selection, validation

    def arrays_(n=128, offset=0):
        q, k, v, out = (tool._Array((1, n, 2, 64)) for _ in range(4))
        out.data.ptr += offset  # still written in place: pairs of elements
        return q, k, v, out, tool._Array((1, 2, n), np.float32)

    p = validation.problem(*arrays_()[:3], False, None, (-1, -1))[-1]
    cfg = selection.forward(p, tool.H200).config
    builds = []
    real = launch.LAUNCHERS[type(cfg)]
    monkeypatch.setitem(
        launch.LAUNCHERS, type(cfg), lambda *a, **k: builds.append(1) or real(*a, **k)
    )
    for _ in range(2):
        launch.forward(cfg, p, *arrays_(offset=8))
    assert len(builds) == 2 and not launch._prepared
    with launch.recording() as record:
        launch.forward(cfg, p, *arrays_())
    assert len(builds) == 3 and len(record.launches) == 1 and not launch._prepared
    monkeypatch.setattr(launch, "MAX_KEPT_BYTES", 100)  # less than the map buffer
    for _ in range(2):
        launch.forward(cfg, p, *arrays_())
    assert len(builds) == 5 and not launch._prepared
    monkeypatch.setattr(launch, "MAX_KEPT_BYTES", 1 << 20)
    for _ in range(2):
        launch.forward(cfg, p, *arrays_())
    assert len(builds) == 6 and len(launch._prepared) == 1
