"""numflash.signature without a GPU: a plan key's matcher takes exactly the calls with that key.

Arrays are stand-ins (tests/support/standins.py); the device, stream and cache generation come
from a namespace the test controls."""

import inspect

import numpy as np
import pytest
from support.standins import DeviceArray, Memory

import numflash
from numflash import api, signature

DEFAULT_WINDOW = api._DEFAULT_WINDOW


class _Cupy:
    device = 0
    stream = 0x5EED

    @classmethod
    def get_device(cls):
        return cls.device

    @classmethod
    def current_stream(cls):
        return type("Stream", (), {"ptr": cls.stream})


class _Cache:
    generation = 3


@pytest.fixture
def namespace(monkeypatch):
    monkeypatch.setattr(_Cupy, "device", 0)
    monkeypatch.setattr(_Cupy, "stream", 0x5EED)
    monkeypatch.setattr(_Cache, "generation", 3)
    return dict(Cupy=_Cupy, cache=_Cache, DEFAULT_WINDOW=DEFAULT_WINDOW, window_key=api._window_key)


def _kvcache(namespace):
    return signature.Signature("kvcache", api._KVCACHE.parameters, namespace)


def _call(**change):
    """A paged decoding step's arguments in attention_with_kvcache's order, with ``change``."""
    parameters = inspect.signature(numflash.attention_with_kvcache).parameters
    args = {name: parameter.default for name, parameter in parameters.items()}
    args.update(q=DeviceArray((2, 1, 8, 64)), k=DeviceArray((2, 1, 2, 64)))
    args.update(k_cache=DeviceArray((16, 4, 2, 64)), v_cache=DeviceArray((16, 4, 2, 64)))
    args.update(v=DeviceArray((2, 1, 2, 64)), cache_seqlens=DeviceArray((2,), np.int32))
    args.update(block_table=DeviceArray((2, 8), np.int32), causal=True)
    args.update(change)
    return tuple(args[name] for name, _ in api._KVCACHE.parameters)


@pytest.mark.parametrize("one_device", [True, False])
def test_a_matcher_takes_a_call_with_its_key_and_returns_the_keys_addresses(namespace, one_device):
    sig = _kvcache(namespace)
    key, _ = sig.key(*_call())
    match = sig.matcher(key, one_device)
    other = _call()  # new arrays, new addresses, the same signature
    other_key, pointers = sig.key(*other)
    assert other_key == key
    assert match(*other) == pointers
    assert pointers[6] == 0 and all(pointers[i] for i in (0, 1, 2, 3, 4, 5, 7))


CHANGES = {
    "q shape": dict(q=DeviceArray((2, 2, 8, 64))),
    "q dtype": dict(q=DeviceArray((2, 1, 8, 64), np.float32)),
    "q strides": dict(q=DeviceArray((2, 1, 8, 64), strides=(2048, 1024, 128, 2))),
    "q alignment": dict(q=DeviceArray((2, 1, 8, 64), ptr=(1 << 40) + 8)),
    "k_cache shape": dict(k_cache=DeviceArray((16, 8, 2, 64))),
    "v_cache dtype": dict(v_cache=DeviceArray((16, 4, 2, 64), np.float32)),
    "k absent": dict(k=None),
    "v shape": dict(v=DeviceArray((2, 2, 2, 64))),
    "lengths an int": dict(cache_seqlens=5),
    "lengths int64": dict(cache_seqlens=DeviceArray((2,), np.int64)),
    "slot map given": dict(cache_batch_idx=DeviceArray((2,), np.int32)),
    "no block table": dict(block_table=None),
    "block table wider": dict(block_table=DeviceArray((2, 9), np.int32)),
    "causal False": dict(causal=False),
    "causal 1": dict(causal=1),
    "scale given": dict(softmax_scale=0.125),
    "window given": dict(window_size=(4, 0)),
    "default window spelled out": dict(window_size=(-1, -1)),
    "num_splits 2": dict(num_splits=2),
    "num_splits False": dict(num_splits=False),
    "return_lse": dict(return_lse=True),
    "out given": dict(out=DeviceArray((2, 1, 8, 64))),
    "config given": dict(config=("a", "config")),
}


@pytest.mark.parametrize("change", CHANGES.values(), ids=list(CHANGES))
def test_every_part_of_the_key_changed_alone_turns_a_call_away(namespace, change):
    sig = _kvcache(namespace)
    key, _ = sig.key(*_call())
    changed = _call(**change)
    assert sig.key(*changed)[0] != key
    assert sig.matcher(key, one_device=True)(*changed) is None


@pytest.mark.parametrize("change", CHANGES.values(), ids=list(CHANGES))
def test_a_key_with_any_of_those_parts_takes_its_own_calls(namespace, change):
    sig = _kvcache(namespace)
    key, _ = sig.key(*_call(**change))
    changed = _call(**change)
    assert sig.matcher(key, one_device=True)(*changed) == sig.key(*changed)[1]


def test_c_contiguous_arrays_of_one_shape_share_a_key_whatever_their_extent_1_strides(namespace):
    """A dimension of extent 1 addresses nothing: CuPy's C-contiguity flag ignores its stride,
    and so do the key and the matcher. A key of strided arrays still takes only those strides."""
    sig = _kvcache(namespace)
    key, _ = sig.key(*_call())
    newaxis = DeviceArray((2, 1, 8, 64), strides=(1024, 0, 128, 2))  # q[:, None] of a (2, 8, 64)
    call = _call(q=newaxis)
    assert sig.key(*call)[0] == key
    assert sig.matcher(key, one_device=True)(*call) == sig.key(*call)[1]
    strided = _call(q=DeviceArray((2, 1, 8, 64), strides=(2048, 1024, 128, 2)))
    strided_key, _ = sig.key(*strided)
    assert sig.matcher(strided_key, one_device=True)(*call) is None
    assert sig.matcher(strided_key, one_device=True)(*strided) is not None


def test_an_int_length_matches_by_type_with_its_value_in_place_of_an_address(namespace):
    """A replay writes an int length into an array of the plan's (numflash.plans), so any
    value has the key: one plan serves a decoding loop whose length advances every step."""
    sig = _kvcache(namespace)
    key, pointers = sig.key(*_call(cache_seqlens=5))
    assert pointers[5] == 5 and key == sig.key(*_call(cache_seqlens=6))[0]
    match = sig.matcher(key, one_device=True)
    assert match(*_call(cache_seqlens=5))[5] == 5
    assert match(*_call(cache_seqlens=6))[5] == 6
    assert match(*_call(cache_seqlens=True)) is None  # an int, but a bool
    assert sig.key(*_call(cache_seqlens=True))[0] != key


@pytest.mark.parametrize(
    "where", ["device", "stream", "generation"], ids=lambda where: f"another {where}"
)
def test_another_device_stream_or_cache_generation_turns_a_call_away(namespace, where):
    sig = _kvcache(namespace)
    key, _ = sig.key(*_call())
    match = sig.matcher(key, one_device=where != "device")
    if where == "device":
        _Cupy.device = 1
    elif where == "stream":
        _Cupy.stream = 7
    else:
        _Cache.generation += 1
    call = _call()
    assert match(*call) is None
    assert sig.key(*call)[0] != key


def test_with_one_device_a_matcher_asks_for_no_device(namespace, monkeypatch):
    """The process's only device is always the current one, and every array is on it."""
    sig = _kvcache(namespace)
    key, _ = sig.key(*_call())
    match = sig.matcher(key, one_device=True)
    monkeypatch.setattr(_Cupy, "get_device", None)
    assert "device" not in match.source
    assert match(*_call()) is not None


def test_an_array_on_another_device_is_turned_away_where_there_are_several(namespace):
    sig = _kvcache(namespace)
    key, _ = sig.key(*_call())
    elsewhere = DeviceArray((16, 4, 2, 64))
    elsewhere.data = Memory(elsewhere.data.ptr, device_id=1)
    call = _call(v_cache=elsewhere)
    assert sig.key(*call)[0] != key
    assert sig.matcher(key, one_device=False)(*call) is None


def test_arrays_that_are_not_cupys_raise_attribute_error_for_the_caller_to_catch(namespace):
    sig = _kvcache(namespace)
    key, _ = sig.key(*_call())
    call = _call(q=np.zeros((2, 1, 8, 64), np.float16))
    with pytest.raises(AttributeError):
        sig.key(*call)
    with pytest.raises(AttributeError):
        sig.matcher(key, one_device=True)(*call)


def test_a_matcher_is_made_only_for_a_key_of_its_signature(namespace):
    sig = _kvcache(namespace)
    key, _ = sig.key(*_call())
    with pytest.raises(ValueError, match="not a key of kvcache"):
        sig.matcher(key[:2] + ("attention",) + key[3:])
    with pytest.raises(ValueError, match="unknown parameter kind"):
        signature.Signature("f", [("q", "tensor")], namespace)


@pytest.mark.parametrize(
    "function, sig",
    [
        (api.attention, api._ATTENTION),
        (api.attention_backward, api._BACKWARD),
        (api.attention_with_kvcache, api._KVCACHE),
        (api.attention_varlen, api._VARLEN),
    ],
    ids=lambda x: getattr(x, "__name__", ""),
)
def test_a_signature_holds_every_parameter_of_its_function_in_order(function, sig):
    """A parameter left out of the key would let calls that differ in it share a plan; the
    variant arrays last (api._unplanned sends calls that give them down the full path), then
    the user functions' parameters, which no key holds: a call that gives any of them takes
    the full path before any plan is looked up (tests/test_mods.py)."""
    names = list(inspect.signature(function).parameters)
    user = USER_FUNCTION_PARAMETERS.get(function.__name__, [])
    assert [name for name, _ in sig.parameters] + user == names
    assert names[len(names) - len(user) - 2 :][:2] == ["sinks", "alibi_slopes"]


#: The parameters of a user's score_mod and mask_mod (and their block mask), by public
#: function.
USER_FUNCTION_PARAMETERS = {
    "attention": ["score_mod", "mask_mod", "mod_args", "block_mask"],
    "attention_backward": [
        "score_mod",
        "mask_mod",
        "mod_args",
        "score_mod_derivative",
        "block_mask",
    ],
    "attention_varlen": ["score_mod", "mask_mod", "mod_args"],
    "attention_with_kvcache": ["score_mod", "mask_mod", "mod_args"],
}
