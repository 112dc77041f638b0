"""Stand-ins for CuPy arrays and the device, to check numflash's host logic without a GPU: the
repeated-call path (numflash.api, numflash.plans) reads only these attributes of an array."""

import itertools

import numpy as np

_addresses = itertools.count(1 << 32, 1 << 24)  # 16 MiB apart: stand-ins never overlap


class Memory:
    """A CuPy MemoryPointer's address and device, and the allocation it points into."""

    def __init__(self, ptr, device_id=0):
        self.ptr = ptr
        self.device_id = device_id
        self.mem = object()


class DeviceArray:
    """A CuPy array's shape, strides (bytes, C order unless given), dtype, size and memory, at
    ``ptr`` (a fresh address by default)."""

    def __init__(self, shape, dtype=np.float16, ptr=None, strides=None):
        self.shape = tuple(shape)
        self.dtype = np.dtype(dtype)
        if strides is None:
            strides, step = [], self.dtype.itemsize
            for n in reversed(self.shape):
                strides.insert(0, step)
                step *= n
        self.strides = tuple(strides)
        self.size = int(np.prod(self.shape))
        self.nbytes = self.size * self.dtype.itemsize
        self.data = Memory(next(_addresses) if ptr is None else ptr)
        self._contiguous = _c_contiguous(self.shape, self.strides, self.dtype.itemsize)

    @property
    def _shape(self):  # CuPy's own field: a new list at each read
        return list(self.shape)

    @property
    def _strides(self):
        return list(self.strides)

    @property
    def _c_contiguous(self):  # CuPy keeps this flag as a field; so does a stand-in, below
        return self._contiguous


def _c_contiguous(shape, strides, itemsize):
    """CuPy's C-contiguity: the strides of dimensions of extent 1 are not compared."""
    if 0 in shape:
        return True
    step = itemsize
    for n, s in zip(reversed(shape), reversed(strides)):
        if n != 1:
            if s != step:
                return False
            step *= n
    return True


class Foreign:
    """An array of another library (a PyTorch tensor, a JAX array) over a stand-in, which
    numflash takes as a CuPy array of the same memory (arrays.intake: DLPack); on stand-ins,
    :func:`foreign_intake` takes it as the stand-in it holds."""

    def __init__(self, inner):
        self.inner = inner


def foreign_intake(x, name, borrowed=False):
    """arrays.intake on stand-ins: a :class:`Foreign` as the array it holds, the rest as is."""
    return x.inner if isinstance(x, Foreign) else x
