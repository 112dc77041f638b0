"""PyTorch tensors as arguments: read in place, on the right stream, kept alive (GPU only)."""

import pytest
from support import assert_matches_reference, random_qkv

import numflash
from numflash import arrays

pytestmark = pytest.mark.gpu
torch = pytest.importorskip("torch")


def _tensors(*shape_and_dtype):
    """q, k, v as CuPy arrays and as PyTorch tensors over the same memory."""
    q, k, v = random_qkv(*shape_and_dtype)
    return (q, k, v), tuple(torch.from_dlpack(x) for x in (q, k, v))


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_pytorch_tensors_give_the_cupy_arrays_results(dtype):
    (q, k, v), (tq, tk, tv) = _tensors(2, 77, 131, 4, 2, 128, dtype)
    out, lse = numflash.attention(tq, tk, tv, causal=True, return_lse=True)
    assert_matches_reference(q, k, v, out, lse, causal=True)
    again = numflash.attention(tq, tk, tv, causal=True)  # the replay plan's call
    assert bool((again.view("uint16") == out.view("uint16")).all())


def test_a_tensor_is_taken_as_dlpack_would_take_it():
    import cupy

    (_, _, _), (tq, _, _) = _tensors(2, 64, 64, 4, 4, 64, "bfloat16")
    for t in (tq, tq.transpose(1, 2), tq[:, 3:], tq[..., :32]):
        mine, theirs = arrays._torch_view(t, torch, cupy), cupy.from_dlpack(t)
        assert mine is not None
        assert (mine.data.ptr, mine.shape, mine.strides, mine.dtype) == (
            theirs.data.ptr, theirs.shape, theirs.strides, theirs.dtype,
        )  # fmt: skip
        assert mine.data.device_id == theirs.data.device_id
    assert arrays._torch_view(torch._neg_view(tq), torch, cupy) is None  # memory holds -values


def test_tensors_on_another_stream_go_through_dlpack():
    """PyTorch's current stream is not CuPy's: DLPack makes CuPy's wait for it."""
    import cupy

    (q, k, v), (tq, tk, tv) = _tensors(1, 300, 300, 2, 2, 64, "float16")
    cupy.cuda.Device().synchronize()  # q, k, v written before PyTorch's stream reads them
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        assert arrays._torch_view(tq, torch, cupy) is None
        scaled = [t * 1 for t in (tq, tk, tv)]  # written on PyTorch's stream, read on CuPy's
        out, lse = numflash.attention(*scaled, return_lse=True)
    cupy.cuda.get_current_stream().synchronize()
    assert_matches_reference(q, k, v, out, lse)


def test_refusals_name_the_argument():
    (_, _, _), (tq, tk, tv) = _tensors(1, 16, 16, 2, 2, 64, "float16")
    with pytest.raises(TypeError, match="^q could not be adopted through DLPack"):
        numflash.attention(tq.clone().requires_grad_(), tk, tv)
    with pytest.raises(TypeError, match="^k"):
        numflash.attention(tq, tk.cpu(), tv)


def test_the_adopted_array_keeps_the_tensor_memory():
    import cupy

    t = torch.randn(1 << 20, device="cuda", dtype=torch.float16)
    expected = cupy.from_dlpack(t).copy()
    adopted = arrays.intake(t, "q")
    before = torch.cuda.memory_allocated()
    del t
    assert torch.cuda.memory_allocated() == before  # still held by the adopted array
    torch.empty(1 << 20, device="cuda", dtype=torch.float16).fill_(7)  # would reuse freed memory
    assert bool((adopted == expected).all())
    del adopted
    assert torch.cuda.memory_allocated() < before


def test_a_repeated_call_borrows_its_tensors_and_follows_them():
    """A call's tensors are taken by views remembered for the next call (not keeping them
    alive), made anew when a tensor's memory or layout changed in place; out= is handed back
    and keeps its tensor."""
    import cupy

    (q, k, v), (tq, tk, tv) = _tensors(2, 64, 64, 4, 4, 64, "float16")
    out = numflash.attention(tq, tk, tv, causal=True)
    again = numflash.attention(tq, tk, tv, causal=True)
    assert bool((again.view("uint16") == out.view("uint16")).all())
    assert arrays._BORROWED[id(tq)][0]() is tq
    (_, _, v2), _ = _tensors(2, 64, 64, 4, 4, 64, "float16")
    tv.data = torch.from_dlpack(v2)  # another memory under the same tensor
    out, lse = numflash.attention(tq, tk, tv, causal=True, return_lse=True)
    assert_matches_reference(q, k, v2, out, lse, causal=True)
    t = torch.randn(1 << 20, device="cuda", dtype=torch.float16)
    arrays.intake(t, "q", borrowed=True)
    before = torch.cuda.memory_allocated()
    key = id(t)
    del t
    assert torch.cuda.memory_allocated() < before and key not in arrays._BORROWED
    to = torch.empty_like(tq)
    given = numflash.attention(tq, tk, tv, out=to)
    before = torch.cuda.memory_allocated()
    del to
    assert torch.cuda.memory_allocated() == before  # held by the array handed back
    assert isinstance(given, cupy.ndarray)
