"""Array intake: what numflash accepts, how it hands arrays to kernels, on which stream.

On a GPU the public functions take CuPy arrays, or anything CuPy can adopt without a copy: an
object with ``__dlpack__`` (JAX, PyTorch, ...) or ``__cuda_array_interface__`` (Numba, ...).
In Numba's CUDA simulator they take NumPy arrays instead. dtypes: float16, bfloat16
(``ml_dtypes.bfloat16``, which is CuPy's bfloat16) and float32.

Kernels see every tensor as a flat 1-D array over the memory it spans plus its element strides,
so any strided view whose last dimension is contiguous is read in place.
"""

import sys
import weakref
from typing import NamedTuple

import ml_dtypes
import numpy as np

from .kernels.jit import SIMULATOR

BFLOAT16 = np.dtype(ml_dtypes.bfloat16)
#: dtype name -> the dtype kernels see its elements as (16-bit floats travel as their bits).
KERNEL_DTYPES = {"float16": np.uint16, "bfloat16": np.uint16, "float32": np.float32}
SUPPORTED = tuple(KERNEL_DTYPES)


_NAMES = {np.dtype(np.float16): "float16", BFLOAT16: "bfloat16", np.dtype(np.float32): "float32"}


def dtype_name(dtype):
    """'float16', 'bfloat16' or 'float32' for a supported dtype, else None."""
    try:
        return _NAMES.get(dtype) or _NAMES.get(np.dtype(dtype))  # the first is the fast path
    except TypeError:
        return None


def _cupy():
    import cupy

    return cupy


def cupy_ndarray():
    """CuPy's array type."""
    return _cupy().ndarray


def intake(x, name, borrowed=False):
    """``x`` as a CuPy array (NumPy in the simulator); TypeError naming ``name`` otherwise.
    ``borrowed``: the array is read or written during the call and never handed back (a
    PyTorch tensor's view is then one that does not keep the tensor alive, remembered for
    the calls that take the tensor again: :func:`_borrowed_torch_view`)."""
    if SIMULATOR:
        if isinstance(x, np.ndarray):
            return x
        raise TypeError(
            f"{name} must be a NumPy array in the CUDA simulator; got {type(x).__name__}"
        )
    cupy = _cupy()
    if isinstance(x, cupy.ndarray):
        return x
    if isinstance(x, np.ndarray):
        raise TypeError(
            f"{name} is a NumPy (host) array; numflash runs on the GPU: pass a CuPy array "
            f"(cupy.asarray({name}))"
        )
    torch = sys.modules.get("torch")  # a tensor's module is loaded when there is a tensor
    if torch is not None and type(x) is torch.Tensor:
        adopted = (_borrowed_torch_view if borrowed else _torch_view)(x, torch, cupy)
        if adopted is not None:
            return adopted
    if hasattr(x, "__dlpack__"):
        try:
            return cupy.from_dlpack(x)
        except Exception as exc:  # CPU tensors, unsupported dtypes, ...
            raise TypeError(f"{name} could not be adopted through DLPack: {exc}") from None
    if hasattr(x, "__cuda_array_interface__"):
        return cupy.asarray(x)
    raise TypeError(
        f"{name} must be a CuPy array or a GPU array exposing __dlpack__ or "
        f"__cuda_array_interface__; got {type(x).__name__}"
    )


#: torch dtypes taken by :func:`_torch_view`, by their names, and CuPy's dtype for each.
_TORCH_DTYPES = {
    "torch.float16": np.dtype(np.float16), "torch.bfloat16": BFLOAT16,
    "torch.float32": np.dtype(np.float32), "torch.int32": np.dtype(np.int32),
}  # fmt: skip


def _torch_view(x, torch, cupy, owned=True):
    """A CUDA ``torch.Tensor`` as a CuPy array over its memory, or None where DLPack is to
    take it: the same array ``cupy.from_dlpack`` makes, without PyTorch's Python half of
    the exchange (17 against 5 us a tensor on the H100 machine: docs/performance.md, "PyTorch
    tensors"). Only where that exchange would do nothing else: a dense CUDA tensor of a
    dtype numflash reads, holding at least one element, needing no gradient (DLPack refuses
    those, and so does this) and no lazily negated view, while PyTorch's current stream on
    its device is CuPy's (else DLPack makes CuPy's stream wait for PyTorch's). The array
    keeps ``x`` alive where ``owned``."""
    dtype = _TORCH_DTYPES.get(str(x.dtype))
    if dtype is None or not x.is_cuda or x.requires_grad or x.layout is not torch.strided:
        return None
    if x.is_neg():  # a lazily negated view: its memory holds the values before the negation
        return None
    device = x.device.index
    if _torch_stream(torch, device) != cupy.cuda.get_current_stream().ptr:
        return None
    shape, pointer = tuple(x.shape), x.data_ptr()
    if not pointer or 0 in shape:
        return None
    strides = tuple(s * dtype.itemsize for s in x.stride())
    span = sum((n - 1) * s for n, s in zip(shape, strides)) + dtype.itemsize
    memory = cupy.cuda.UnownedMemory(pointer, span, x if owned else None, device)
    return cupy.ndarray(shape, dtype, cupy.cuda.MemoryPointer(memory, 0), strides)


#: The views :func:`_borrowed_torch_view` made, by the id of their tensor: (a weak reference
#: to the tensor, the view, and the tensor's address, shape, strides, dtype and device when
#: it was made). An entry leaves when its tensor dies.
_BORROWED = {}
#: At most this many views are remembered; a new one beyond them drops the oldest.
BORROWED_VIEWS = 64


def _borrowed_torch_view(x, torch, cupy):
    """:func:`_torch_view` of a tensor that a call reads or writes and never hands back: a
    view that does not keep ``x`` alive (the caller holds it for the call), made once and
    given again to the calls that take ``x`` while ``x`` lives with the same address, shape,
    strides, dtype and device, needs no gradient and PyTorch's current stream is still
    CuPy's. A repeated call on tensors then costs a few attribute reads a tensor, not a new
    CuPy array (docs/performance.md, "PyTorch tensors")."""
    view = _view_again(x, torch, cupy, {})
    if view is not None:
        return view
    view = _torch_view(x, torch, cupy, owned=False)
    if view is not None:
        _remember(x, view)
    return view


def _view_again(x, torch, cupy, streams):
    """The view :func:`_borrowed_torch_view` made of ``x`` where it may be given again (the
    same tensor, address, shape, strides, dtype and device, no gradient, PyTorch's current
    stream on the device CuPy's), else None. ``streams``: whether the streams agree, by
    device, as one call found them (a dict the call keeps, so that its tensors on one device
    ask PyTorch and CuPy once)."""
    entry = _BORROWED.get(id(x))
    if entry is None:
        return None
    ref, view, pointer, shape, strides, dtype, device = entry
    if not (
        ref() is x
        and x.data_ptr() == pointer
        and x.shape == shape
        and x.stride() == strides
        and x.dtype is dtype
        and not x.requires_grad
        and x.get_device() == device
    ):
        return None
    same = streams.get(device)
    if same is None:
        same = _torch_stream(torch, device) == cupy.cuda.get_current_stream().ptr
        streams[device] = same
    return view if same else None


def adopted(args, positions, parameters, kept):
    """``args`` as a list with each array at ``positions`` that is not a CuPy array taken as
    one through :func:`intake` (borrowed, but for position ``kept``: out=, which the call hands
    back), or None where every one is a CuPy array already; TypeError naming the parameter
    (``parameters[i][0]``) where one cannot be taken. A PyTorch tensor whose view a call
    before made is found again first, the streams compared once a device for the call's
    tensors, not once a tensor (docs/performance.md, "PyTorch tensors")."""
    cupy = _cupy()
    torch = sys.modules.get("torch")
    tensor = getattr(torch, "Tensor", None)
    taken, streams = None, {}
    for i in positions:
        x = args[i]
        if x is None or isinstance(x, int) or isinstance(x, cupy.ndarray):
            continue
        if taken is None:
            taken = list(args)
        view = None
        if x.__class__ is tensor and i != kept:
            view = _view_again(x, torch, cupy, streams)
        taken[i] = view if view is not None else intake(x, parameters[i][0], i != kept)
    return taken


def _remember(x, view):
    """Keep ``view`` of tensor ``x`` in _BORROWED until ``x`` dies (or BORROWED_VIEWS newer
    ones come)."""
    key = id(x)

    def forget(ref):
        entry = _BORROWED.get(key)
        if entry is not None and entry[0] is ref:  # not a later tensor's under the same id
            _BORROWED.pop(key, None)

    while len(_BORROWED) >= BORROWED_VIEWS:
        try:
            _BORROWED.pop(next(iter(_BORROWED)), None)
        except (StopIteration, RuntimeError):  # emptied or changed by another thread
            break
    data = view.data  # the address and device _torch_view read, not asked of x again
    _BORROWED[key] = (
        weakref.ref(x, forget),
        view,
        data.ptr,
        x.shape,
        x.stride(),
        x.dtype,
        data.device_id,
    )


def _torch_stream(torch, device):
    """The address of PyTorch's current stream on ``device``: through the binding PyTorch's
    own compiled code asks (a tenth of ``torch.cuda.current_stream``'s cost), where there is
    one."""
    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    return raw(device) if raw is not None else torch.cuda.current_stream(device).cuda_stream


def array_module(x):
    return np if isinstance(x, np.ndarray) else _cupy()


def device_id(x):
    """The GPU an array lives on (0 in the simulator)."""
    return 0 if isinstance(x, np.ndarray) else x.data.device_id


def empty(shape, dtype, like):
    """An uninitialised array of ``like``'s kind: NumPy's in the simulator, else CuPy's on the
    current device (through ``cupy.ndarray``: cupy.empty's Python frame costs every call's
    outputs half a microsecond each)."""
    if isinstance(like, np.ndarray):
        return np.empty(shape, dtype)
    return _cupy().ndarray(shape, dtype)


class KernelArray(NamedTuple):
    """What a GPU launch needs of a flat array: its address, length and element size (building
    a CuPy view per argument and call would cost microseconds each)."""

    pointer: int
    nitems: int
    itemsize: int
    #: The array the pointer belongs to (kept alive by a plan that replays the launch).
    owner: object = None


#: kernel_view's (span, element strides) by (shape, strides, itemsize): a call's arrays keep
#: their layouts from call to call, and working them out again cost a microsecond an array.
_layouts = {}


def _span_and_strides(shape, strides, itemsize):
    """(elements an array of this layout spans, its strides in elements)."""
    strides = tuple([s // itemsize for s in strides])
    span = 0
    if all(shape):
        span = 1
        for n, s in zip(shape, strides):
            span += (n - 1) * s
    return span, strides


def kernel_view(x):
    """(flat, strides): ``x`` as a 1-D array over the memory it spans, and its element strides.

    ``flat`` is a :class:`KernelArray` on the GPU, a NumPy view in the simulator. ``x`` must
    have a contiguous last dimension and non-negative strides (callers copy otherwise). 16-bit
    floats travel as uint16.
    """
    itemsize = x.dtype.itemsize
    layout = (x.shape, x.strides, itemsize)
    found = _layouts.get(layout)
    if found is None:
        if len(_layouts) >= 4096:
            _layouts.clear()
        found = _layouts[layout] = _span_and_strides(*layout)
    span, strides = found
    if isinstance(x, np.ndarray):
        kdtype = KERNEL_DTYPES.get(dtype_name(x.dtype), x.dtype)
        flat = np.lib.stride_tricks.as_strided(x.view(kdtype), shape=(span,), strides=(itemsize,))
        if not x.flags.writeable:  # the simulator copies every array back after a launch
            flat = flat.copy()
    else:
        flat = KernelArray(x.data.ptr, span, itemsize, x)
    return flat, strides


def view_aligned(view, elements):
    """Whether a :func:`kernel_view` starts and steps (every dimension but the last) at
    multiples of ``elements`` elements."""
    flat, strides = view
    address = flat.ctypes.data if isinstance(flat, np.ndarray) else flat.pointer
    if address % (elements * flat.itemsize):
        return False
    return all(s % elements == 0 for s in strides[:-1])


def _byte_span(x):
    """[first, last) byte addresses that ``x``'s elements occupy (empty for a size-0 array)."""
    start = x.ctypes.data if isinstance(x, np.ndarray) else x.data.ptr
    if x.size == 0:
        return start, start
    low = high = start
    for n, s in zip(x.shape, x.strides):
        if s < 0:
            low += (n - 1) * s
        else:
            high += (n - 1) * s
    return low, high + x.dtype.itemsize


def same_elements(a, b):
    """Whether ``a`` and ``b`` view the same elements: one start address, shape and strides."""
    return _byte_span(a) == _byte_span(b) and a.shape == b.shape and a.strides == b.strides


def may_share_memory(a, b):
    """Whether the memory spans of ``a`` and ``b`` intersect (arrays on one device)."""
    a_lo, a_hi = _byte_span(a)
    b_lo, b_hi = _byte_span(b)
    return a_lo < b_hi and b_lo < a_hi


def readable_in_place(x, alignment_elements=1):
    """Whether kernels can read ``x`` as it is: contiguous last dimension, non-negative strides,
    and strides and start address aligned to ``alignment_elements`` (cp.async moves 16 bytes)."""
    itemsize = x.dtype.itemsize
    if x.ndim and x.shape[-1] > 1 and x.strides[-1] != itemsize:
        return False
    for s in x.strides[:-1]:
        if s < 0 or (s // itemsize) % alignment_elements:
            return False
    address = x.ctypes.data if isinstance(x, np.ndarray) else x.data.ptr
    return address % (alignment_elements * itemsize) == 0


def bits(x):
    """``x`` viewed as uint16 when it holds 16-bit floats, else ``x``.

    Copies and fills of fp16/bf16 arrays go through this view: moving bits needs no arithmetic,
    and CuPy has no elementwise kernels for bfloat16.
    """
    return x.view(np.uint16) if x.dtype.itemsize == 2 else x


def as_kernel_input(x, alignment_elements=1):
    """``x`` itself when kernels can read it in place, else a C-contiguous copy."""
    if readable_in_place(x, alignment_elements):
        return x
    return array_module(x).ascontiguousarray(bits(x)).view(x.dtype)


def pad_last_dim(x, size):
    """A C-contiguous copy of ``x`` with its last dimension zero-padded to ``size``."""
    padded = array_module(x).zeros(x.shape[:-1] + (size,), dtype=bits(x).dtype)
    padded[..., : x.shape[-1]] = bits(x)
    return padded.view(x.dtype)


def to_float32(x):
    """A float32 copy, exact for 16-bit floats (bfloat16 through its bits: CuPy has no bf16
    arithmetic)."""
    xp = array_module(x)
    if dtype_name(x.dtype) == "bfloat16":
        return (x.view(xp.uint16).astype(xp.uint32) << 16).view(xp.float32)
    return x.astype(xp.float32)


def to_float64(x):
    """An exact float64 copy (bfloat16 through its bits: CuPy has no bf16 arithmetic)."""
    xp = array_module(x)
    if dtype_name(x.dtype) == "bfloat16":
        return to_float32(x).astype(xp.float64)
    return x.astype(xp.float64)


def from_float(x, dtype):
    """Round a float array to ``dtype`` (to nearest even; bfloat16 included)."""
    xp = array_module(x)
    if dtype_name(dtype) == "bfloat16":
        if xp is np:
            return x.astype(np.float32).astype(BFLOAT16)
        bits = x.astype(xp.float32).view(xp.uint32)
        nan = xp.isnan(x)
        rounded = (bits + (0x7FFF + ((bits >> 16) & 1))) >> 16
        rounded = xp.where(nan, (bits >> 16) | 0x40, rounded).astype(xp.uint16)
        return rounded.view(BFLOAT16)
    return x.astype(dtype)


_ROUNDING_KERNELS = {}  # (dtype name, kernel name) -> a CuPy kernel of rounding_kernel

#: dst = round(src * scale) in one pass: fp16 through CuPy's float16 (to nearest even), bf16
#: by the same integer rounding as from_float (to nearest even, NaN kept quiet).
_ROUND_SCALED_CODE = {
    "float16": "y = float16(x * s);",
    "bfloat16": """
        float v = x * s;
        unsigned int b = __float_as_uint(v);
        unsigned int even = (b + 0x7FFFu + ((b >> 16) & 1u)) >> 16;
        y = (unsigned short)(isnan(v) ? ((b >> 16) | 0x40u) : even);
    """,
}


def round_scaled_into(dst, src, scale):
    """``dst[...] = round(src * scale)`` for a float32 ``src`` and a 16-bit float ``dst`` of
    the same shape, bitwise as ``from_float(src * float32(scale), dst.dtype)``: on the GPU in
    one elementwise kernel (CuPy's multiply, then from_float's passes, read and wrote the array
    five to ten times)."""
    if array_module(src) is np:
        bits(dst)[...] = bits(from_float(src * np.float32(scale), dst.dtype))
        return
    kernel = rounding_kernel(dst.dtype, "float32 x, float32 s", "", "numflash_round_scaled")
    kernel(src, np.float32(scale), rounding_output(dst))


def rounding_kernel(dtype, params, read, name):
    """A CuPy ElementwiseKernel (made once per ``dtype`` and ``name``) taking ``params`` and
    writing ``y = round(x * s)`` to its ``dtype`` output as round_scaled_into does, where the
    C code ``read`` defines ``float x`` (empty when x is a parameter) and a parameter is ``s``;
    its output is ``rounding_output(dst)``."""
    key = (dtype_name(dtype), name)
    kernel = _ROUNDING_KERNELS.get(key)
    if kernel is None:
        out, code = rounding_source(dtype, read)
        kernel = _cupy().ElementwiseKernel(params, out, code, f"{name}_{key[0]}")
        _ROUNDING_KERNELS[key] = kernel
    return kernel


def rounding_source(dtype, read):
    """The (output parameter, C body) of a rounding_kernel for ``dtype`` and ``read``: the
    rounding in a scope of its own, so that ``read`` may use any name."""
    name = dtype_name(dtype)
    out = "float16 y" if name == "float16" else "uint16 y"
    return out, read + "{" + _ROUND_SCALED_CODE[name] + "}"


def rounding_output(dst):
    """What a rounding_kernel writes ``dst`` (float16, or bfloat16 as its bits) through."""
    return dst if dtype_name(dst.dtype) == "float16" else dst.view(np.uint16)


def current_stream():
    """The handle (``CUstream`` as an int) of CuPy's current stream; 0 in the simulator."""
    if SIMULATOR:
        return 0
    return _cupy().cuda.get_current_stream().ptr
