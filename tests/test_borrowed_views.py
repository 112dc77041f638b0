"""The views a repeated call makes of PyTorch tensors it only borrows (arrays._borrowed_torch_view):
given again while the tensor is the same, made anew when anything a view depends on changed,
forgotten when the tensor dies. On stand-ins for a tensor, PyTorch and CuPy, so it runs
anywhere; tests/test_torch_tensors.py takes real tensors on a GPU."""

import gc
import types

import pytest

from numflash import arrays


class Tensor:
    """What _borrowed_torch_view reads of a tensor."""

    def __init__(self, pointer=0x1000, shape=(2, 8, 4, 64), strides=(2048, 256, 64, 1)):
        self.pointer, self.shape, self.strides = pointer, shape, strides
        self.dtype, self.requires_grad, self.device = "float16", False, 0

    def data_ptr(self):
        return self.pointer

    def stride(self):
        return self.strides

    def get_device(self):
        return self.device


class View:
    def __init__(self, tensor, owned):
        self.data = types.SimpleNamespace(device_id=0, ptr=tensor.pointer)
        self.owned = owned


@pytest.fixture
def world(monkeypatch):
    """(torch, cupy, the views made) on stand-ins: PyTorch's stream and CuPy's both 0."""
    made = []
    streams = {"torch": 0, "cupy": 0}

    def view(x, torch, cupy, owned=True):
        made.append(View(x, owned))
        return made[-1]

    torch = types.SimpleNamespace(
        _C=types.SimpleNamespace(_cuda_getCurrentRawStream=lambda device: streams["torch"])
    )
    cupy = types.SimpleNamespace(
        cuda=types.SimpleNamespace(
            get_current_stream=lambda: types.SimpleNamespace(ptr=streams["cupy"])
        )
    )
    monkeypatch.setattr(arrays, "_torch_view", view)
    monkeypatch.setattr(arrays, "_BORROWED", {})
    return torch, cupy, made, streams


def test_a_tensor_taken_again_gets_the_same_view_which_does_not_own_it(world):
    torch, cupy, made, _ = world
    t = Tensor()
    first = arrays._borrowed_torch_view(t, torch, cupy)
    assert arrays._borrowed_torch_view(t, torch, cupy) is first
    assert len(made) == 1 and not first.owned


@pytest.mark.parametrize(
    "change",
    [
        lambda t: setattr(t, "pointer", 0x2000),  # t.set_(...), t.data = ...
        lambda t: setattr(t, "shape", (2, 4, 8, 64)),  # t.resize_, t.unsqueeze_, ...
        lambda t: setattr(t, "strides", (2048, 64, 512, 1)),  # t.transpose_(1, 2)
        lambda t: setattr(t, "dtype", "bfloat16"),
        lambda t: setattr(t, "requires_grad", True),
        lambda t: setattr(t, "device", 1),
    ],
    ids=["address", "shape", "strides", "dtype", "grad", "device"],
)
def test_a_tensor_changed_in_place_gets_a_new_view(world, change):
    torch, cupy, made, _ = world
    t = Tensor()
    first = arrays._borrowed_torch_view(t, torch, cupy)
    change(t)
    assert arrays._borrowed_torch_view(t, torch, cupy) is not first
    assert len(made) == 2


def test_another_stream_is_checked_again(world):
    """PyTorch's current stream no longer CuPy's: the view is not given; _torch_view decides
    (it refuses, and DLPack takes the tensor)."""
    torch, cupy, made, streams = world
    t = Tensor()
    arrays._borrowed_torch_view(t, torch, cupy)
    streams["torch"] = 0x5EED
    arrays._borrowed_torch_view(t, torch, cupy)
    assert len(made) == 2


def test_a_dead_tensors_view_is_forgotten_and_never_given_to_another(world):
    torch, cupy, made, _ = world
    t = Tensor()
    arrays._borrowed_torch_view(t, torch, cupy)
    key = id(t)
    assert key in arrays._BORROWED
    del t
    gc.collect()
    assert key not in arrays._BORROWED
    # a new tensor whose id is a dead one's, its entry still there (no callback yet)
    u = Tensor()
    entry = (lambda: None, made[0], u.pointer, u.shape, u.strides, u.dtype, u.device)
    arrays._BORROWED[id(u)] = entry
    assert arrays._borrowed_torch_view(u, torch, cupy) is not made[0]


def test_the_views_remembered_are_bounded(world, monkeypatch):
    torch, cupy, made, _ = world
    monkeypatch.setattr(arrays, "BORROWED_VIEWS", 4)
    tensors = [Tensor(pointer=0x1000 * (i + 1)) for i in range(6)]
    for t in tensors:
        arrays._borrowed_torch_view(t, torch, cupy)
    assert len(arrays._BORROWED) == 4
    assert id(tensors[0]) not in arrays._BORROWED and id(tensors[-1]) in arrays._BORROWED


def test_intake_borrows_only_when_asked(world, monkeypatch):
    """An array the call hands back (out=) is taken by a view that keeps its tensor alive."""
    torch, cupy, made, _ = world
    torch.Tensor = Tensor
    cupy.ndarray = View
    monkeypatch.setattr(arrays, "SIMULATOR", False)
    monkeypatch.setattr(arrays, "_cupy", lambda: cupy)
    monkeypatch.setitem(__import__("sys").modules, "torch", torch)
    t = Tensor()
    assert arrays.intake(t, "out").owned
    assert not arrays.intake(t, "q", borrowed=True).owned
    assert arrays.intake(t, "q", borrowed=True) is made[-1]


def test_a_calls_tensors_are_found_again_with_one_stream_query_a_device(world, monkeypatch):
    """arrays.adopted, as a repeated call takes its arguments: the views made before given
    again, PyTorch's stream asked once for the call's tensors on one device, out= (``kept``)
    taken by a view that keeps its tensor alive, the rest of the arguments left as they are."""
    torch, cupy, made, streams = world
    torch.Tensor = Tensor
    cupy.ndarray = View
    asked = []
    ask = torch._C._cuda_getCurrentRawStream
    torch._C._cuda_getCurrentRawStream = lambda device: asked.append(device) or ask(device)
    monkeypatch.setattr(arrays, "SIMULATOR", False)
    monkeypatch.setattr(arrays, "_cupy", lambda: cupy)
    monkeypatch.setitem(__import__("sys").modules, "torch", torch)
    tensors = [Tensor(pointer=0x1000 * (i + 1)) for i in range(4)]
    args = (*tensors[:3], True, None, 7, tensors[3])
    parameters = [(name, "array") for name in ("q", "k", "v", "causal", "x", "n", "out")]
    positions, kept = (0, 1, 2, 4, 5, 6), 6
    first = arrays.adopted(args, positions, parameters, kept)
    assert first[3:6] == [True, None, 7] and first[6].owned
    assert [x.owned for x in first[:3]] == [False] * 3
    asked.clear()
    again = arrays.adopted(args, positions, parameters, kept)
    assert again[:3] == first[:3] and len(asked) == 1
    assert again[6] is not first[6] and again[6].owned
    streams["torch"] = 0x5EED  # PyTorch on another stream now: no view given again
    arrays.adopted(args, positions, parameters, kept)
    assert len(made) == 4 + 1 + 4  # the first call, out= again, then all four anew
    assert arrays.adopted((made[0],) * 3, (0, 1, 2), parameters, None) is None
