"""numflash.plans' rules, without a GPU: which recorded calls get a plan, which pointer each
replayed launch takes from which role, what a plan keeps, and the overlaps refused at replay.

Arrays and launchers here are stand-ins with the attributes plans.make reads (a CuPy array's
shape, strides, dtype, size and data.ptr; a Launcher's prepare); tests/test_plans.py runs the
same rules through real calls on the GPU."""

import numpy as np
import pytest
from support.standins import DeviceArray

from numflash import plans
from numflash.arrays import KernelArray
from numflash.launch import Record


def _array(ptr, shape, dtype=np.float16, strides=None):
    return DeviceArray(shape, dtype, ptr, strides)


def _argument(x):
    """The KernelArray a launch of ``x`` records."""
    return KernelArray(x.data.ptr, x.size, x.dtype.itemsize, x)


class _Launcher:
    """Launcher.prepare's contract: the argument positions replaced at replay, by role."""

    def prepare(self, grid, block, shared_bytes, args, roles):
        return dict(roles)


def _record(*launches, unrecorded_work=False, fills=()):
    record = Record()
    record.launches = [(_Launcher(), (1, 1, 1), (32, 1, 1), 0, args) for args in launches]
    record.unrecorded_work = unrecorded_work
    record.fills = list(fills)
    return record


Q, K, OUT = (_array(ptr, (2, 8, 4, 16)) for ptr in (0x1000, 0x9000, 0x11000))


def test_each_array_argument_is_replaced_by_its_role_and_the_rest_is_kept():
    partial = _array(0x20000, (64,), np.float32)  # a buffer the full path made for itself
    record = _record(
        (_argument(Q), 7, _argument(K), _argument(partial)),
        (_argument(partial), _argument(OUT), 1.5),
    )
    plan = plans.make(record, (Q, K, OUT))
    assert plan is not None
    assert plan.launches == ({0: 0, 2: 1}, {1: 2})  # positions -> roles, launch by launch
    assert plan.keep == [partial, partial]  # alive as long as the plan: replays write it
    assert plan.spans == [2 * 8 * 4 * 16 * 2] * 3


@pytest.mark.parametrize(
    "record, roles, why",
    [
        (_record(), (), "the full path launched nothing (an empty problem), whatever the roles"),
        (_record((_argument(Q),), unrecorded_work=True), (Q,), "a copy or a fill beside it"),
        (_record((_argument(OUT),)), (Q, OUT), "q was copied before the kernel read it"),
        (
            _record((_argument(Q), _argument(_array(0x1000, (8,))))),
            (Q, _array(0x1000, (8,))),
            "two roles of different layouts at one address",
        ),
        (_record((_argument(Q),)), (Q, None), "an int length that filled no array"),
        (
            _record((_argument(_array(0x1000, (4, 4), strides=(-8, 2))),)),
            (_array(0x1000, (4, 4), strides=(-8, 2)),),
            "a negative stride: the kernel took another address than data.ptr",
        ),
    ],
)
def test_no_plan_where_a_replay_would_not_be_exact(record, roles, why):
    lengths = ((1, 0, 31),) if why == "an int length that filled no array" else ()
    assert plans.make(record, roles, lengths=lengths) is None, why


def test_one_array_in_two_roles_is_read_through_the_first_and_must_be_one_again():
    """attention(q, q, q), or one array as both new k and new v: the launches take the first
    role's pointer for each, and a replay refuses a call where the roles are apart."""
    record = _record((_argument(Q), _argument(Q), _argument(Q), _argument(OUT)))
    plan = plans.make(record, (Q, Q, Q, OUT))
    assert plan.launches == ({0: 0, 1: 0, 2: 0, 3: 3},) and plan.same == ((0, 1), (0, 2))
    # an array of their layout among the launches' own: a copy of one of them, maybe
    copy = _array(0x40000, Q.shape)
    record = _record((_argument(copy), _argument(Q), _argument(Q), _argument(OUT)))
    assert plans.make(record, (Q, Q, Q, OUT)) is None


def test_an_int_length_s_array_is_kept_with_the_bounds_a_replay_checks():
    lengths = _array(0x30000, (2,), np.int32)
    record = _record((_argument(Q), _argument(lengths)), fills=(lengths,))
    plan = plans.make(record, (Q, None), lengths=((1, 0, 31),))
    assert plan.fills == ((1, lengths, 0, 31),) and plan.keep == [lengths]
    # a fill no length names (attention's few-rows route over k and v): kept as it is
    plan = plans.make(record, (Q, None))
    assert plan.fills == () and plan.keep == [lengths]


def test_absent_roles_are_skipped_and_their_overlaps_dropped():
    record = _record((_argument(Q), _argument(OUT)))
    plan = plans.make(record, (Q, None, OUT), overlaps=((1, 0), (2, 0)))
    assert plan.launches == ({0: 0, 1: 2},)
    assert plan.overlaps == ((2, 0),)
    assert plan.spans[1] == 0


def test_overlapping_roles_are_refused_at_replay_and_touching_ones_are_not():
    plan = plans.make(_record((_argument(Q), _argument(OUT))), (Q, OUT), overlaps=((1, 0),))
    span = plan.spans[0]
    assert plan.disjoint([0x1000, 0x1000 + span])  # out starts where q ends
    assert plan.disjoint([0x1000 + span, 0x1000])  # q starts where out ends
    assert not plan.disjoint([0x1000, 0x1000 + span - 2])  # one element shared
    assert not plan.disjoint([0x1000 + span - 2, 0x1000])
    assert not plan.disjoint([0x1000, 0x1000])


def test_checks_of_one_kind_share_their_code_and_keep_their_own_spans():
    """Two shapes of one call kind compile one check (plans._checks), each with its spans and
    its remembered pointers; a plan without pairs checks nothing."""
    first = plans._disjoint_check([64, 32], ((1, 0),))
    second = plans._disjoint_check([128, 32], ((1, 0),))
    assert first.__code__ is second.__code__
    assert first([0x1000, 0x1000 + 64]) and not second([0x1000, 0x1000 + 64])
    assert second([0x1000, 0x1000 + 128]) and first([0x1000, 0x1000 + 64])
    assert plans._disjoint_check([64, 32], ()) is plans._no_pairs


def test_the_remembered_disjoint_pointers_are_a_copy():
    """A replay appends to and patches the list it checked: the next call's list is compared
    with the pointers as they were checked, not with that list."""
    plan = plans.make(_record((_argument(Q), _argument(OUT))), (Q, OUT), overlaps=((1, 0),))
    span = plan.spans[0]
    pointers = [0x1000, 0x1000 + span]
    assert plan.disjoint(pointers)
    assert plan.disjoint([0x1000, 0x1000 + span])  # the same pointers again
    pointers[1] = 0x1000 + span - 2  # the checked list changed afterwards
    assert not plan.disjoint(pointers)
    assert not plan.disjoint([0x1000, 0x1000 + span - 2])
    assert plan.disjoint([0x1000, 0x1000 + span])


def test_a_cache_keeps_the_latest_plans_and_forgets_all_but_pinned_ones():
    cache = plans.PlanCache()
    made = [plans.make(_record((_argument(Q),)), (Q,)) for _ in range(plans.MAX_PLANS + 2)]
    for i, plan in enumerate(made[:-1]):
        cache.put(i, plan)
    assert cache.get(0) is None and cache.get(1) is made[1]  # the oldest went first
    assert cache.get(plans.MAX_PLANS) is made[-2]
    cache.put(plans.MAX_PLANS + 1, made[-1])  # the least recently looked up goes: 2, not 1
    assert cache.get(2) is None and cache.get(1) is made[1]
    cache.pin(made[5].holder)
    cache.clear()
    assert cache.get(5) is None  # forgotten by the cache ...
    assert made[5].pinned and made[5].holder in cache._pinned  # ... but its buffers stay alive
