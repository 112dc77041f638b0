"""Launch machinery: kernel parameter specs, the launcher cache, launches prepared per
geometry, and one launch builder per kernel family (padding, views, grids); a family with a
module of its own (numflash/families/) registers its builders here (:func:`launches`).

A :class:`KernelSpec` describes a kernel's arguments once: its flat arrays, the tensors whose
(batch, seqlen, head) element strides follow as one int64 triple each, and its scalars. Both
the Numba signature a kernel is compiled for and the arguments packed for each launch come from
it, so the two cannot disagree. A :class:`Launcher` launches one compiled kernel straight
through the driver, skipping Numba's per-call typing.
"""

import contextlib
import ctypes
import dataclasses
import functools
import logging
import struct
import threading
from typing import NamedTuple

import numpy as np

from . import arrays, kernel_cache
from . import config as configs
from .kernels import (
    backward as backward_kernels,
)
from .kernels import (
    backward_mma,
    backward_portable,
    decode_portable,
    forward_portable,
    ptx_tma,
)
from .kernels import (
    decode as decode_kernels,
)
from .kernels import (
    forward as forward_kernels,
)
from .kernels.jit import SIMULATOR
from .kernels.softmax import LOG2E

# -- launchers by family ----------------------------------------------------------------------

#: {configuration type: its family's launch builder}; forward and backward builders take
#: (cfg, problem, arrays..., offsets=None), KV-cache builders (cfg, num_splits, problem, q,
#: views, geometry, stream).
LAUNCHERS = {}


#: {configuration type: chunked prefill's launch builder} of the forward families that read KV
#: caches (``READS_KV_CACHE``), taking (cfg, problem, q, k_cache, v_cache, views, geometry,
#: stream); the new rows, where ``views`` holds "k" and "v", are its to append (its kernel, or
#: :func:`append_new_rows` before it).
PREFILL_LAUNCHERS = {}


def launches(config_type, table=LAUNCHERS):
    """Register the decorated function as the launch builder of ``config_type``'s family (in
    ``table``: PREFILL_LAUNCHERS for its KV-cache calls)."""

    def register(fn):
        table[config_type] = fn
        return fn

    return register


# -- parameter specs --------------------------------------------------------------------------

#: The mask and scale every attention kernel takes after its arrays and strides.
ATTENTION_SCALARS = (
    ("seqlen_q", "int32"),
    ("seqlen_k", "int32"),
    ("heads_per_kv", "int32"),
    ("scale", "float32"),
    ("window_left", "int32"),
    ("window_right", "int32"),
)


class KernelSpec(NamedTuple):
    """A kernel's parameters: ``arrays`` as (name, "elem" | "float32" | "int32" | "int64") flat
    1-D arrays ("elem": the problem's element type, 16-bit floats as their uint16 bits), then
    for each name in ``strided`` its (batch, seqlen, head) strides as one int64 triple, then
    ``scalars`` as (name, "int32" | "float32" | "map"), a "map" a tensor map's template
    (kernels/ptx_tma.py) as MAP_WORDS int64."""

    arrays: tuple
    strided: tuple
    scalars: tuple
    #: The arrays an attention variant adds (:func:`variant_arrays`), as ``arrays`` (or a
    #: "map", a template handed as ``(words,)`` in the views), taken by the kernel's trailing
    #: ``*variant`` parameter; None for a kernel without one. A plain
    #: call's kernel takes an empty tuple there, which compiles to the same PTX as no
    #: parameter at all.
    variant: tuple = None

    def signature(self, dtype_name):
        """The Numba argument types (None in the simulator, which types nothing)."""
        if SIMULATOR:
            return None
        from numba.cuda import types

        elem = types.float32 if dtype_name == "float32" else types.uint16
        kinds = {"elem": elem, "float32": types.float32, "int32": types.int32, "int64": types.int64}
        scalar = {
            "int32": types.int32,
            "float32": types.float32,
            "map": types.UniTuple(types.int64, ptx_tma.MAP_WORDS),
        }
        variant = ()
        if self.variant is not None:
            extra = tuple(
                scalar[kind] if kind == "map" else types.Array(kinds[kind], 1, "C")
                for _, kind in self.variant
            )
            variant = (types.StarArgTuple.from_types(extra),)
        return (
            tuple(types.Array(kinds[kind], 1, "C") for _, kind in self.arrays)
            + (types.UniTuple(types.int64, 3),) * len(self.strided)
            + tuple(scalar[kind] for _, kind in self.scalars)
            + variant
        )

    def args(self, views, scalars):
        """The launch arguments from ``views`` ({array name: arrays.kernel_view(x)}) and
        ``scalars`` (values in the spec's order, already of their types); the variant's
        arrays last, one argument each (the kernel gathers them into ``variant``)."""
        return (
            tuple(views[name][0] for name, _ in self.arrays)
            + tuple(tuple(views[name][1][:3]) for name in self.strided)
            + tuple(scalars)
            + tuple(views[name][0] for name, _ in self.variant or ())
        )

    def for_problem(self, p):
        """This spec with the variant arrays problem ``p`` asks for."""
        return self._replace(variant=variant_arrays(p))


FORWARD = KernelSpec(
    arrays=(("q", "elem"), ("k", "elem"), ("v", "elem"), ("o", "elem"), ("lse", "float32")),
    strided=("q", "k", "v", "o"),
    scalars=ATTENTION_SCALARS,
    variant=(),
)
PREPROCESS = KernelSpec(
    arrays=(("do", "elem"), ("o", "elem"), ("delta", "float32")),
    strided=("do", "o"),
    scalars=(("seqlen_q", "int32"),),
)
#: D, and the LSE in the log2 domain, into buffers of padded rows (kernels/backward.py's
#: padded_stat_rows): the Hopper backward's bulk copies.
PREPROCESS_PADDED = KernelSpec(
    arrays=(("do", "elem"), ("o", "elem"), ("lse", "float32"), ("lse_log2", "float32"),
            ("delta", "float32")),
    strided=("do", "o"),
    scalars=(("seqlen_q", "int32"), ("padded_rows", "int32")),
)  # fmt: skip
_BACKWARD_INPUTS = (
    ("q", "elem"),
    ("k", "elem"),
    ("v", "elem"),
    ("do", "elem"),
    ("lse", "float32"),
    ("delta", "float32"),
)
PORTABLE_DKDV = KernelSpec(
    arrays=_BACKWARD_INPUTS + (("dk", "elem"), ("dv", "elem")),
    strided=("q", "k", "v", "do", "dk", "dv"),
    scalars=ATTENTION_SCALARS,
    variant=(),
)
#: The tensor-core dK/dV kernels: dQ's fp32 accumulator last (atomic dQ only; else unused).
TENSOR_CORE_DKDV = KernelSpec(
    arrays=_BACKWARD_INPUTS + (("dk", "elem"), ("dv", "elem"), ("dq_acc", "float32")),
    strided=("q", "k", "v", "do", "dk", "dv", "dq_acc"),
    scalars=ATTENTION_SCALARS,
    variant=(),
)
#: Every dQ kernel (portable, mma.sync, wgmma).
DQ = KernelSpec(
    arrays=_BACKWARD_INPUTS + (("dq", "elem"),),
    strided=("q", "k", "v", "do", "dq"),
    scalars=ATTENTION_SCALARS,
    variant=(),
)


#: Forward over a packed batch (varlen): the cumulative sequence offsets after the arrays,
#: max lengths in place of the lengths, the arrays' row counts last.
FORWARD_VARLEN = KernelSpec(
    arrays=FORWARD.arrays + (("cu_q", "int32"), ("cu_k", "int32")),
    strided=("q", "k", "v", "o"),
    scalars=ATTENTION_SCALARS + (("total_q", "int32"), ("total_k", "int32")),
    variant=(),
)


def attention_scalars(p, scale):
    """ATTENTION_SCALARS' values for problem ``p`` with the kernel's ``scale``."""
    return (
        p.seqlen_q,
        p.seqlen_k,
        p.heads_per_kv,
        np.float32(scale),
        p.window_left,
        p.window_right,
    )


# -- launching --------------------------------------------------------------------------------

#: Shared memory a block gets without opting in to more (every CUDA GPU).
DEFAULT_SHARED_LIMIT = 48 * 1024


def _param_layout(argtypes):
    """(struct format, slots per argument) of the kernel parameters in Numba's ABI.

    A 1-D C-contiguous array is seven parameters (meminfo, parent, nitems, itemsize, data,
    shape[0], strides[0]); a tuple of n scalars is n parameters; a scalar is one, of its C
    type. Every parameter gets its own 8-byte slot, so the parameter pointers are the buffer's
    start plus multiples of 8.
    """
    from numba.cuda import types

    scalars = {
        types.int32: "i4x",
        types.int64: "q",
        types.uint32: "I4x",
        types.float32: "f4x",
        types.float64: "d",
    }
    fmt, kinds = "=", []

    def add(ty, in_variant=False):
        nonlocal fmt
        if isinstance(ty, types.Array):
            if ty.ndim != 1 or ty.layout != "C":
                raise TypeError(f"only 1-D C arrays are launched directly; got {ty}")
            fmt += "QQqqQqq"
            kinds.append(7)
        elif isinstance(ty, types.UniTuple) and ty.dtype in scalars:
            fmt += scalars[ty.dtype] * ty.count
            kinds.append(-ty.count)
        elif isinstance(ty, types.BaseTuple) and not in_variant:
            # a kernel's trailing *variant (empty in a plain call): its arrays and tensor-map
            # templates, passed one argument each
            for t in ty:
                add(t, True)
        elif ty in scalars and not in_variant:
            fmt += scalars[ty]
            kinds.append(1)
        else:
            raise TypeError(f"no direct launch for argument type {ty}")

    for ty in argtypes:
        add(ty)
    return fmt, kinds


def _driver():
    from cuda.bindings import driver

    return driver


def memset_d32():
    """The driver's cuMemsetD32Async(address, value, count, stream) -> (error,)."""
    return _driver().cuMemsetD32Async


def _dim3(block):
    return (block, 1, 1) if isinstance(block, int) else tuple(block) + (1,) * (3 - len(block))


class Record:
    """The launches of one recorded call: (launcher, grid, block, shared bytes, args) each,
    whether device work ran outside them, and the int32 arrays filled with a host length
    (:func:`host_lengths`), which a replay fills again with its call's value."""

    def __init__(self):
        self.launches = []
        self.unrecorded_work = False
        self.fills = []

    def prepare(self, by_pointer):
        """(the launches packed for running again, the roles they read in place, the arrays
        they read that the call made for itself): an array argument at an address of
        ``by_pointer`` ({address: role indices}) takes the first of those roles' address at
        each run (:meth:`Launcher.prepare`); any other (a buffer the call made, an array a
        kernel is handed and never reads) stays as recorded, and its array is to be kept."""
        seen, keep, launches = set(), [], []
        for launcher, grid, block, shared_bytes, args in self.launches:
            slots = {}
            for position, arg in enumerate(args):
                if isinstance(arg, arrays.KernelArray):
                    found = by_pointer.get(arg.pointer)
                    if found is None:
                        keep.append(arg.owner)
                    else:
                        slots[position] = found[0]
                        seen.update(found)
            launches.append(launcher.prepare(grid, block, shared_bytes, args, slots))
        return tuple(launches), seen, keep


class _Recording(threading.local):
    record = None  # the Record of the call being recorded on this thread, if any


_recording = _Recording()


@contextlib.contextmanager
def recording():
    """Notes every launch made on this thread inside the block in the Record it yields
    (numflash.plans replays them)."""
    record = _recording.record = Record()
    try:
        yield record
    finally:
        _recording.record = None


def host_lengths(xp, n, value):
    """An int32 array of ``n`` copies of a length given as a Python int (a KV-cache call's
    int cache_seqlens), for kernels that read lengths from the device; noted in the call's
    Record, if recorded: a replay writes the next call's value into it."""
    lengths = xp.full((n,), value, dtype=xp.int32)
    if _recording.record is not None:
        _recording.record.fills.append(lengths)
    return lengths


def note_unrecorded_work():
    """Device work outside a Launcher (a copy, a fill) that a replay of the launches would
    skip: the call being recorded gets no plan."""
    if _recording.record is not None:
        _recording.record.unrecorded_work = True


@functools.cache
def _launch_kernel():
    """CuPy's binding of cuLaunchKernel (function, grid x/y/z, block x/y/z, dynamic shared
    bytes, stream, parameter addresses, extra)."""
    from cupy_backends.cuda.api.driver import launchKernel

    return launchKernel


class PreparedLaunch:
    """One recorded launch with its parameters packed once. :meth:`lines` writes out the code
    of a replay of it: the pointers of the arrays that change from call to call written into
    the packed parameters, one assignment each, and the launch through CuPy's binding of
    cuLaunchKernel with its constants bound, so a replay runs no loop and unpacks nothing
    (numflash.plans writes a plan's launches into one function). :attr:`launch` ``(stream,
    role_pointers)`` is that code for this launch alone (``source``), written on first use.
    ``patch``: (slot of a data pointer, index of the role whose pointer it takes), one pair
    per patched array."""

    __slots__ = ("buffer", "slots", "pointers", "address", "patch", "head", "leading")
    __slots__ += ("_launch", "source")

    def __init__(self, function, grid, block, shared_bytes, buffer, pointers, patch):
        self.buffer = buffer  # the packed parameters (ctypes buffer of 8-byte slots)
        self.slots = memoryview(buffer).cast("B").cast("Q")  # ... as uint64s, to patch
        self.pointers = pointers  # the parameters' addresses (numpy uint64), which stay put
        self.address = int(pointers.ctypes.data)  # ... and where they are
        self.patch = patch
        self.head = tuple(int(x) for x in (function, *grid, *block, shared_bytes))
        # the launch's function, grid, block and shared bytes, as source text
        self.leading = ", ".join(map(str, self.head))
        self._launch = self.source = None

    def run(self, stream, pointers):
        """Patch ``pointers`` (the call's addresses in role order) in and launch on ``stream``.
        The packed parameters are this launch's own: one thread at a time (the caller sees to
        it)."""
        slots = self.slots
        for slot, role in self.patch:
            slots[slot] = pointers[role]
        _launch_kernel()(*self.head, stream, self.address, 0)

    @property
    def launch(self):
        if self._launch is None:
            lines = ["def launch(stream, p):", *self.lines("s", "p[{}]".format, "stream", "    ")]
            namespace = self.namespace("s")
            source = "\n".join(lines) + "\n"
            exec(compile(source, "<numflash prepared launch>", "exec"), namespace)
            self._launch, self.source = namespace["launch"], source
        return self._launch

    def lines(self, slots, pointer, stream, pad):
        """Lines of code that patch and launch: ``slots`` names :attr:`slots`, ``pointer(role)``
        is the expression of a role's pointer, ``stream`` the stream's; each line indented by
        ``pad``; :meth:`namespace` what they name."""
        lines = [f"{pad}{slots}[{slot}] = {pointer(role)}" for slot, role in self.patch]
        lines.append(f"{pad}cuLaunchKernel({self.leading}, {stream}, {self.address}, 0)")
        return lines

    def namespace(self, slots):
        """What :meth:`lines` names besides the pointers and the stream, and what the address
        written into them points to (the parameters' addresses): a replay may outlive this
        object (a plan dropped from the cache whose run a recent list still holds)."""
        return {slots: self.slots, f"{slots}_addresses": self.pointers,
                "cuLaunchKernel": _launch_kernel()}  # fmt: skip


class Launcher:
    """Launches one kernel compiled for a fixed signature, skipping Numba's per-call typing.

    On the GPU the kernel is compiled once for ``argtypes`` (on first use) and launched straight
    through the driver with the arguments packed here from the CuPy arrays' pointers. Numba's
    own launch is not used: it adopts each CuPy array through ``__cuda_array_interface__``,
    which synchronises the array's stream (the host would wait for all queued work at every
    call) and costs tens of microseconds per array. A launch whose dynamic and static shared
    memory together exceed 48 KiB first raises the kernel's opt-in limit on that device.
    """

    def __init__(self, dispatcher, argtypes, key=None):
        self.dispatcher = dispatcher
        self.argtypes = argtypes
        self.key = key  # what numflash.kernel_cache names its file by (None: not kept)
        self._compiled = {}  # compute capability -> Numba's compiled kernel
        self._lock = threading.Lock()
        if not SIMULATOR:
            self._format, self._kinds = _param_layout(argtypes)
            self._struct = struct.Struct(self._format)
            slots = sum(abs(kind) for kind in self._kinds)
            self._offsets = np.arange(slots, dtype=np.uint64) * 8
        self._shared_opt_in = {}  # device id -> bytes allowed
        self._static = None  # static shared memory bytes, once compiled
        self._functions = {}  # device id -> CUfunction
        self._thread = threading.local()  # .params: this thread's parameter buffer

    def compiled(self):
        """Numba's compiled kernel for the current device's compute capability: kept on disk
        by numflash.kernel_cache, so compiled once a machine (a kept kernel holds the cubin of
        one compute capability, so a process with GPUs of two has one of each)."""
        cc = kernel_cache.current_cc()
        found = self._compiled.get(cc)
        if found is None:
            with self._lock:
                found = self._compiled.get(cc)
                if found is None:
                    found = kernel_cache.compiled(self.key, self.dispatcher, self.argtypes)
                    self._compiled[cc] = found
        return found

    def _static_shared(self):
        """The kernel's static shared memory in bytes: without an opt-in, dynamic shared memory
        may take what the static part leaves of DEFAULT_SHARED_LIMIT."""
        if self._static is None:
            self._static = self.compiled().shared_mem_per_block
        return self._static

    def _allow_shared(self, nbytes):
        """Raise the kernel's dynamic shared memory limit on the current device to ``nbytes``."""
        import cupy

        dev = cupy.cuda.runtime.getDevice()
        if self._shared_opt_in.get(dev, DEFAULT_SHARED_LIMIT - self._static_shared()) < nbytes:
            from numba.cuda.cudadrv.driver import driver

            cufunc = self.compiled()._codelibrary.get_cufunc()
            attr = _driver().CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
            driver.cuKernelSetAttribute(attr, nbytes, cufunc.handle, cufunc.device.id)
            self._shared_opt_in[dev] = nbytes

    def __call__(self, grid, block, stream, shared_bytes, args):
        """Launch on ``stream``, a ``CUstream`` handle as an int (0: the legacy default)."""
        if SIMULATOR:
            self.dispatcher[grid, block, stream, shared_bytes](*args)
            return
        if shared_bytes > DEFAULT_SHARED_LIMIT - self._static_shared():
            self._allow_shared(shared_bytes)
        buffer, pointers = self._params()
        self._struct.pack_into(buffer, 0, *self._values(args))
        gx, gy, gz = _dim3(grid)
        bx, by, bz = _dim3(block)
        driver = _driver()
        (err,) = driver.cuLaunchKernel(
            self._function(), gx, gy, gz, bx, by, bz, shared_bytes, stream, pointers, 0
        )
        # the driver copied the parameters: the buffer is free for this thread's next launch
        if err != driver.CUresult.CUDA_SUCCESS:
            raise RuntimeError(
                f"cuLaunchKernel failed: {err!r} (grid {grid}, block {block}, "
                f"{shared_bytes} bytes of shared memory)"
            )
        if _recording.record is not None:
            _recording.record.launches.append((self, grid, block, shared_bytes, args))

    def prepare(self, grid, block, shared_bytes, args, roles):
        """A :class:`PreparedLaunch` of this launch on the current device; ``roles`` maps the
        position of an array argument to the index of the call's pointer that replaces its
        address at each launch."""
        buffer, pointers = self._pack(args)
        patch = []
        slot = 0
        for position, kind in enumerate(self._kinds):
            if kind == 7 and position in roles:
                patch.append((slot + 4, roles[position]))  # the array's data pointer
            slot += abs(kind)
        return PreparedLaunch(
            int(self._function()),
            _dim3(grid),
            _dim3(block),
            shared_bytes,
            buffer,
            pointers,
            tuple(patch),
        )

    def _params(self):
        """(buffer, address of its parameter addresses) this thread packs its launches into:
        cuLaunchKernel copies the parameters before it returns, so one buffer a thread serves
        every launch (a new one a launch, with its addresses, cost microseconds)."""
        found = getattr(self._thread, "params", None)
        if found is None:
            buffer = ctypes.create_string_buffer(self._struct.size)
            pointers = self._offsets + np.uint64(ctypes.addressof(buffer))
            found = self._thread.params = (buffer, pointers.ctypes.data)
            self._thread.keep = pointers
        return found

    def _pack(self, args):
        """(buffer, parameter addresses) of ``args`` in Numba's ABI, made for them (a prepared
        launch keeps both)."""
        values = self._values(args)
        buffer = ctypes.create_string_buffer(self._struct.pack(*values), self._struct.size)
        return buffer, self._offsets + np.uint64(ctypes.addressof(buffer))

    def _values(self, args):
        """``args`` flattened into the values of the parameters' slots."""
        values = []
        for kind, value in zip(self._kinds, args):
            if kind == 7:  # a KernelArray (pointer, nitems, itemsize)
                values += (
                    0,
                    0,
                    value.nitems,
                    value.itemsize,
                    value.pointer,
                    value.nitems,
                    value.itemsize,
                )
            elif kind < 0:  # a tuple of scalars
                values += value
            else:
                values.append(value)
        return values

    def _function(self):
        """The kernel's CUfunction on the current device (Numba loads it as a CUkernel)."""
        import cupy

        dev = cupy.cuda.runtime.getDevice()
        function = self._functions.get(dev)
        if function is None:
            cufunc = self.compiled()._codelibrary.get_cufunc()
            driver = _driver()
            err, function = driver.cuKernelGetFunction(cufunc.handle)
            if err != driver.CUresult.CUDA_SUCCESS:
                raise RuntimeError(f"cuKernelGetFunction failed: {err!r}")
            self._functions[dev] = function
        return function


_launchers = {}
_launchers_lock = threading.Lock()


_log = logging.getLogger("numflash")


def _user_functions(key):
    """What the compile log adds for a kernel key holding a call's Mods (", score_mod=name,
    mask_mod=name"), else the empty string."""
    for part in key:
        if isinstance(part, tuple) and len(part) == 2 and part[0] == "mods":
            mods = part[1]
            named = [(n, getattr(mods, n)) for n in ("score_mod", "mask_mod")]
            return "".join(f", {n}={getattr(f, '__name__', f)}" for n, f in named if f)
    return ""


def launcher(key, build, spec, dtype_name):
    """The Launcher stored under ``key``, made on first use from ``build()`` (a kernel
    dispatcher) and ``spec``'s signature for ``dtype_name``, which says so in the "numflash"
    log (INFO: the kernel compiles at its first launch). Safe from several threads."""
    found = _launchers.get(key)
    if found is None:
        with _launchers_lock:
            found = _launchers.get(key)
            if found is None:
                found = _launchers[key] = Launcher(build(), spec.signature(dtype_name), key)
                name = getattr(found.dispatcher, "__name__", type(found.dispatcher).__name__)
                kept = kernel_cache.enabled() and kernel_cache.storable(key)
                _log.info("compiling %s for %s%s%s", name, dtype_name, _user_functions(key),
                          " (or loading it from the kernel cache)" if kept else "")  # fmt: skip
    return found


# -- launches prepared per geometry -----------------------------------------------------------


class Prepared:
    """The launches of a call whose parameters depend on its arrays only through their
    addresses, packed once (:meth:`Launcher.prepare`) and run again with another call's
    addresses (:func:`prepared`). ``keep``: arrays the first call made for itself and the
    launches read (the Hopper forward's map buffer, arrays it is handed and never reads), kept
    alive and used again."""

    __slots__ = ("launches", "keep")

    def __init__(self, launches, keep):
        self.launches = launches
        self.keep = keep

    def run(self, stream, pointers):
        for launch in self.launches:
            launch.run(stream, pointers)


def _prepare(record, roles):
    """The :class:`Prepared` of a recorded call over ``roles`` (its arrays), or None where
    running its launches again with new addresses would not be the call: device work outside
    them (a copy of an input), a length filled from the host, a role none of them reads in
    place, or more than MAX_KEPT_BYTES of buffers the call made for itself."""
    if record.unrecorded_work or record.fills or not record.launches:
        return None
    by_pointer = {}
    for i, x in enumerate(roles):
        by_pointer.setdefault(x.data.ptr, []).append(i)
    # roles at one address are at one address in every call of the key (prepared's)
    launches, seen, keep = record.prepare(by_pointer)
    if len(seen) != len(roles) or sum(x.nbytes for x in keep) > MAX_KEPT_BYTES:
        return None
    return Prepared(launches, keep)


#: Prepared launches by geometry (:func:`prepared`), emptied when it holds MAX_PREPARED.
_prepared = {}
MAX_PREPARED = 256
#: The most bytes a prepared launch keeps of buffers its first call made (the backward's row
#: sums, a decoding step's split partials): a call needing more is large enough that its
#: kernels dwarf the full path's host time, and the cache holds at most MAX_PREPARED * 1 MiB.
MAX_KEPT_BYTES = 1 << 20


def prepared(head, roles, build):
    """Run ``build()``, which launches a call's kernels over ``roles`` (its arrays: inputs and
    outputs) on the current device and stream, through the launches prepared for its geometry.

    ``head`` holds what besides the arrays' shapes and strides decides the launches (family,
    configuration, problem). A geometry met before on this thread, device and stream runs its
    prepared launches with the arrays' addresses patched in: no views, tensor-map templates,
    argument lists or packing, and the buffers the first call made used again (kernels on a
    stream run one after another). The first call runs ``build()`` and prepares its launches
    where running them again is exact (:func:`_prepare`); so does every call whose arrays are
    not all 16-byte aligned or have a negative stride (the full path may copy them), and every
    call being recorded for a replay plan (numflash.plans), which keeps buffers of its own."""
    if SIMULATOR or _recording.record is not None:
        return build()
    pointers = [x.data.ptr for x in roles]
    low = 0
    for pointer in pointers:
        low |= pointer
    if low & 15:
        return build()
    key = (*head, *[(x.shape, x.strides) for x in roles], threading.get_ident())
    stream = arrays.current_stream()
    key += (roles[0].data.device_id, stream)  # the current device: the caller made it so
    if len(set(pointers)) != len(pointers):  # q is k is v, one offsets array for q and k
        key += tuple(pointers.index(pointer) for pointer in pointers)
    found = _prepared.get(key)
    if found is not None:
        return found.run(stream, pointers)
    if any(s < 0 for x in roles for s in x.strides):
        return build()
    with recording() as record:
        build()
    found = _prepare(record, roles)
    if found is not None:
        if len(_prepared) >= MAX_PREPARED:
            _prepared.clear()
        _prepared[key] = found


def local_memory_bytes(cfg):
    """The most local memory a thread of any kernel launched with ``cfg`` uses (spilled
    registers, or arrays the compiler could not keep in registers): 0 is what a tuned
    configuration must show. None in the simulator, or before any such kernel was launched."""
    if SIMULATOR:
        return None
    sizes = [
        launcher.compiled().local_mem_per_thread
        for key, launcher in list(_launchers.items())
        if len(key) > 3 and key[3] == cfg
    ]
    return max(sizes) if sizes else None


def _ceil_div(a, b):
    return (a + b - 1) // b


# -- forward ----------------------------------------------------------------------------------


def _kernel_input(x, alignment_elements=1):
    """arrays.as_kernel_input, noting the copy it may make (a replay would skip it)."""
    y = arrays.as_kernel_input(x, alignment_elements)
    if y is not x:
        note_unrecorded_work()
    return y


def _padded(x, head_dim):
    """arrays.pad_last_dim, noting the copy."""
    note_unrecorded_work()
    return arrays.pad_last_dim(x, head_dim)


def _positive_scale(q, scale):
    """(q', scale') with scale' > 0 and the same attention: the tensor-core kernel takes each
    row's max on unscaled scores, which only orders them right for a positive scale."""
    if scale > 0:
        return q, scale
    note_unrecorded_work()  # the copy below
    xp = arrays.array_module(q)
    if scale == 0:  # every visible score is 0: the same as q = 0 at any scale
        return xp.zeros(q.shape, dtype=np.uint16).view(q.dtype), 1.0  # 16-bit: only fp16/bf16 here
    # q.k * scale == (-q).k * |scale|; negate by flipping the sign bit (exact, bf16 included)
    flipped = xp.ascontiguousarray(arrays.bits(q)) ^ np.uint16(0x8000)
    return flipped.view(q.dtype), -scale


def _output_target(out, head_dim, p):
    """(where the kernel writes, whether that is ``out`` itself): a padded or contiguous
    temporary where the kernel cannot write ``out`` in place (the Hopper forward stores two
    elements at once: rows an even number of elements apart)."""
    if head_dim == p.head_dim and arrays.readable_in_place(out, alignment_elements=2):
        return out, True
    return arrays.empty(out.shape[:-1] + (head_dim,), out.dtype, like=out), False


def _copy_back(out, target, p):
    note_unrecorded_work()
    arrays.bits(out)[...] = arrays.bits(target)[..., : p.head_dim]


def _packed_offsets(offsets, q, k):
    """A packed batch's kernel arguments beyond the dense ones: the views of its offsets
    (cu_q, cu_k), and the scalars after the attention scalars, the arrays' row counts."""
    views = {
        name: arrays.kernel_view(arrays.as_kernel_input(x))
        for name, x in zip(("cu_q", "cu_k"), offsets)
    }
    return views, (q.shape[0], k.shape[0])


def _launch_forward(
    build, spec_key, cfg, p, arrays_in, head_dim, scale_log2, shared, offsets, extra=None,
    grid=None, variant=(),
):  # fmt: skip
    """Launch a forward kernel over ``arrays_in`` = (q, k, v, out, lse): dense, or a packed
    batch with ``offsets`` = (cu_q, cu_k) (the kernel of ``build`` is then the varlen one and
    ``p`` holds the max lengths). ``extra``: (the kernel's spec, views of its arrays beyond
    FORWARD_VARLEN's, its scalars beyond them). ``grid``: a block per (row block, head,
    batch) unless given. ``variant``: the arrays of variant_arrays(p), in its order."""
    q, k, v, out, lse = arrays_in
    target, direct = _output_target(out, head_dim, p)
    named = (("q", q), ("k", k), ("v", v), ("o", target), ("lse", lse))
    scalars = attention_scalars(p, scale_log2)
    if offsets is None:
        spec = FORWARD
        views = {name: arrays.kernel_view(x) for name, x in named}
    else:
        spec = FORWARD_VARLEN
        views, totals = _packed_offsets(offsets, q, k)
        # a packed batch's (rows, heads, head_dim) arrays as one sequence of a batch of one; lse
        # is read flat (a dense call's, of 3 dimensions too, needs no view made)
        views.update(
            (name, arrays.kernel_view(x[None] if x.ndim == 3 and name != "lse" else x))
            for name, x in named
        )
        scalars += totals
    if extra is not None:
        spec, more_views, more_scalars = extra
        views.update(more_views)
        scalars += more_scalars
    spec = spec.for_problem(p)
    views.update(_variant_views(p, variant))
    launch = launcher(spec_key, build, spec, p.dtype)
    if grid is None:
        grid = (_ceil_div(p.seqlen_q, cfg.block_m), p.nheads, p.batch)
    launch(grid, cfg.threads, arrays.current_stream(), shared, spec.args(views, scalars))
    if not direct:
        _copy_back(out, target, p)


def variant_key(p):
    """What a kernel's compile key gains from the attention variant ``p`` (a Problem) asks
    for: nothing for plain attention, so its kernels are the ones compiled without variants."""
    key = (("softcap", p.softcap),) if p.softcap else ()
    key += (("sinks",) if p.sinks else ()) + (("alibi",) if p.alibi else ())
    return key + ((("mods", p.mods),) if p.mods is not None else ())


def variant_arrays(p):
    """The arrays a kernel's ``*variant`` takes for problem ``p``, as KernelSpec.arrays, in
    this order: the sink logits (float32, one a query head), then the ALiBi slopes (float32,
    (nheads,) or (batch, nheads) flat), each where the call has them
    (softmax.alibi_functions' index), then the mod_args of its user functions
    (kernels/mods.py, from index :func:`first_mod_arg`), then a block mask's index
    (kernels/block_mask.py) where it has one."""
    sinks = (("sinks", "float32"),) if p.sinks else ()
    variant = sinks + ((("alibi_slopes", "float32"),) if p.alibi else ())
    kinds = () if p.mods is None else p.mods.kinds
    variant += tuple((f"mod_args[{i}]", kind) for i, kind in enumerate(kinds))
    if p.mods is not None and p.mods.block_mask:  # kernels/block_mask.py
        variant += (("block_mask.index", "int32"),)
    return variant


def first_mod_arg(p):
    """The index of the first mod_args array among a kernel's ``*variant`` arrays."""
    return int(p.sinks) + int(p.alibi)


def _variant_views(p, variant):
    """{name: arrays.kernel_view(x)} of ``variant``, the arrays of variant_arrays(p)."""
    return {name: arrays.kernel_view(x) for (name, _), x in zip(variant_arrays(p), variant)}


def _tensor_core_inputs(cfg, p, q, k, v):
    """(q, k, v, scale, head_dim) as the tensor-core forward kernels read them: a positive
    scale, head_dim padded as ``cfg`` runs it, rows on 16-byte boundaries (cp.async moves 16
    bytes)."""
    q, scale = _positive_scale(q, p.scale)
    head_dim = cfg.kernel_head_dim(p.head_dim)
    if head_dim != p.head_dim:
        q, k, v = (_padded(x, head_dim) for x in (q, k, v))
    q, k, v = (_kernel_input(x, alignment_elements=8) for x in (q, k, v))
    return q, k, v, scale, head_dim


@launches(configs.TensorCoreConfig)
def _tensor_core_forward(cfg, p, q, k, v, out, lse, offsets=None, variant=()):
    q, k, v, scale, head_dim = _tensor_core_inputs(cfg, p, q, k, v)
    varlen = offsets is not None
    key = (configs.TensorCoreConfig, head_dim, p.dtype, cfg) + (("varlen",) if varlen else ())
    key += variant_key(p)
    tiles = (cfg.block_m, cfg.block_n, cfg.num_warps, cfg.stages, cfg.q_in_registers)
    build = forward_kernels.build_varlen if varlen else forward_kernels.build
    _launch_forward(
        lambda: build(head_dim, p.dtype, *tiles, p.softcap, p.sinks, p.alibi, p.mods),
        key,
        cfg,
        p,
        (q, k, v, out, lse),
        head_dim,
        scale * LOG2E,
        cfg.shared_memory_bytes(head_dim),
        offsets,
        variant=variant,
    )


@launches(configs.PortableConfig)
def _portable_forward(cfg, p, q, k, v, out, lse, offsets=None, variant=()):
    q, k, v = (_kernel_input(x) for x in (q, k, v))
    varlen = offsets is not None
    key = (configs.PortableConfig, p.head_dim, p.dtype, cfg) + (("varlen",) if varlen else ())
    key += variant_key(p)
    build = forward_portable.build_varlen if varlen else forward_portable.build
    _launch_forward(
        lambda: build(
            p.head_dim, p.dtype, cfg.block_m, cfg.block_n, p.softcap, p.sinks, p.alibi, p.mods
        ),
        key,
        cfg,
        p,
        (q, k, v, out, lse),
        p.head_dim,
        p.scale * LOG2E,
        0,
        offsets,
        variant=variant,
    )


_unread = {}


def _unread_array(xp, dtype):
    """A one-element array of ``dtype`` that a kernel is handed and never reads (the offsets
    of a dense call of a kernel that also serves packed ones), made once per device."""
    key = (0 if SIMULATOR else xp.cuda.runtime.getDevice(), dtype)
    found = _unread.get(key)
    if found is None:
        found = _unread[key] = xp.zeros((1,), dtype=dtype)
    return found


def _absent_offsets(xp):
    """The (cu_q, cu_k) a dense call hands the Hopper forward, whose dense and packed kernels
    take the same parameters."""
    found = _unread_array(xp, xp.int32)
    return found, found


_attributes = {}
#: What the simulator's device says: one multiprocessor (its one block goes through every
#: tile, which the tests see) and an L2 cache of 64 KiB (sections of a pair or two at the
#: tests' sizes).
_SIMULATED_ATTRIBUTES = {"MultiProcessorCount": 1, "L2CacheSize": 64 << 10}


def _device_attribute(name):
    """A CUDA attribute of the current device, read once."""
    if SIMULATOR:
        return _SIMULATED_ATTRIBUTES[name]
    import cupy

    dev = cupy.cuda.runtime.getDevice()
    found = _attributes.get((dev, name))
    if found is None:
        found = _attributes[dev, name] = cupy.cuda.Device(dev).attributes[name]
    return found


def _multiprocessors():
    return _device_attribute("MultiProcessorCount")


def forward(cfg, p, q, k, v, out, lse, variant=()):
    """out and lse of problem ``p`` with configuration ``cfg`` (validated arrays, sizes > 0),
    through the launch prepared for its geometry (:func:`prepared`); ``variant``: the arrays
    of variant_arrays(p)."""
    build = LAUNCHERS[type(cfg)]
    roles = (q, k, v, out, lse, *variant)
    prepared((cfg, p), roles, lambda: build(cfg, p, q, k, v, out, lse, variant=variant))


def forward_varlen(cfg, p, q, k, v, out, lse, cu_q, cu_k, variant=()):
    """out (total_q, nheads, head_dim) and lse (nheads, total_q) of a packed batch; ``p``
    holds the max lengths and the batch (validated arrays)."""
    build = LAUNCHERS[type(cfg)]
    roles = (q, k, v, out, lse, cu_q, cu_k, *variant)
    offsets = (cu_q, cu_k)
    prepared(
        (cfg, p), roles, lambda: build(cfg, p, q, k, v, out, lse, offsets=offsets, variant=variant)
    )


# -- backward ---------------------------------------------------------------------------------

#: Query rows (one warp each) per block of the D = rowsum(dO * O) kernel.
_PREPROCESS_ROWS = 8


def _preprocess(p, dout, out, lse, padded_rows=None):
    """(lse as a contiguous array, D = rowsum(dout * out) in fp32), D computed on the GPU.
    With ``padded_rows`` (kernels/backward.py's padded_stat_rows) both are (batch, nheads,
    padded_rows), zero past seqlen_q, and the LSE is in the log2 domain."""
    xp = arrays.array_module(out)
    lse = xp.ascontiguousarray(lse)
    padded = padded_rows is not None
    rows = padded_rows if padded else p.seqlen_q
    delta = xp.empty(lse.shape[:-1] + (rows,), dtype=xp.float32)
    spec = PREPROCESS_PADDED if padded else PREPROCESS
    launch = launcher(
        ("preprocess", p.head_dim, p.dtype) + (("padded",) if padded else ()),
        lambda: backward_portable.build_preprocess(p.head_dim, p.dtype, _PREPROCESS_ROWS, padded),
        spec,
        p.dtype,
    )
    views = {
        "do": arrays.kernel_view(dout),
        "o": arrays.kernel_view(out),
        "delta": arrays.kernel_view(delta),
    }
    scalars = (p.seqlen_q,)
    if padded:
        views["lse"] = arrays.kernel_view(lse)
        lse = xp.empty_like(delta)
        views["lse_log2"] = arrays.kernel_view(lse)
        scalars += (rows,)
    grid = (_ceil_div(rows, _PREPROCESS_ROWS), p.nheads, p.batch)
    launch(grid, 32 * _PREPROCESS_ROWS, arrays.current_stream(), 0, spec.args(views, scalars))
    return lse, delta


SINK_GRADIENT = KernelSpec(
    arrays=(("lse", "float32"), ("delta", "float32"), ("sinks", "float32"),
            ("dsinks", "float32")),
    strided=(),
    scalars=(("batch", "int32"), ("seqlen_q", "int32")),
)  # fmt: skip


def sink_gradient(p, dout, out, lse, sinks, dsinks, packed=False):
    """dsinks (float32 (nheads,)) of a call with sink logits: D = rowsum(dout * out) again
    (_preprocess), then one block a head sums exp(sink - lse) * D in a fixed order
    (backward_portable.build_sink_gradient). ``packed``: a packed batch's (total, heads,
    head_dim) arrays and its (nheads, total) lse, as one sequence."""
    dout, out = (_kernel_input(x) for x in (dout, out))
    if packed:
        p = dataclasses.replace(p, batch=1, seqlen_q=dout.shape[0])
        dout, out = dout[None], out[None]
    lse, delta = _preprocess(p, dout, out, lse)
    views = {name: arrays.kernel_view(x) for name, x in
             (("lse", lse), ("delta", delta), ("sinks", sinks), ("dsinks", dsinks))}  # fmt: skip
    kernel = launcher(("sink gradient",), backward_portable.build_sink_gradient, SINK_GRADIENT,
                      "float32")  # fmt: skip
    kernel(
        (p.nheads,),
        backward_portable.SINK_GRADIENT_THREADS,
        arrays.current_stream(),
        0,
        SINK_GRADIENT.args(views, (p.batch, p.seqlen_q)),
    )


def _row_statistics(p, dout, out, lse, grads, offsets):
    """(lse, D) of a backward (_preprocess). For a packed batch (``offsets`` given) D is row
    by row, so the dense preprocess kernel computes it over the packed rows as one sequence,
    and the gradients ``grads`` are zeroed: rows of no sequence, or past the kernels' cut
    (validation.packed_bound), keep 0."""
    if offsets is None:
        return _preprocess(p, dout, out, lse)
    packed = dataclasses.replace(p, batch=1, seqlen_q=dout.shape[0], seqlen_k=grads[1].shape[0])
    statistics = _preprocess(packed, dout[None], out[None], lse)
    note_unrecorded_work()  # the zeroing
    for g in grads:
        arrays.bits(g)[...] = 0
    return statistics


#: The portable backward over a packed batch: as FORWARD_VARLEN extends FORWARD.
PORTABLE_DKDV_VARLEN = KernelSpec(
    arrays=PORTABLE_DKDV.arrays + (("cu_q", "int32"), ("cu_k", "int32")),
    strided=PORTABLE_DKDV.strided,
    scalars=FORWARD_VARLEN.scalars,
    variant=(),
)
DQ_VARLEN = KernelSpec(
    arrays=DQ.arrays + (("cu_q", "int32"), ("cu_k", "int32")),
    strided=DQ.strided,
    scalars=FORWARD_VARLEN.scalars,
    variant=(),
)


@launches(configs.PortableBackwardConfig)
def _portable_backward(cfg, p, dout, q, k, v, out, lse, dq, dk, dv, offsets=None, variant=()):
    """The portable dK/dV and dQ kernels: dense, or a packed batch with ``offsets`` = (cu_q,
    cu_k) (``p`` then holds the max lengths; see _row_statistics); ``variant``: the arrays
    of variant_arrays(p)."""
    q, k, v, dout, out = (_kernel_input(x) for x in (q, k, v, dout, out))
    scalars = attention_scalars(p, p.scale)
    lse, delta = _row_statistics(p, dout, out, lse, (dq, dk, dv), offsets)
    if offsets is None:
        specs, tag, views = (PORTABLE_DKDV, DQ), (), {}
    else:
        views, totals = _packed_offsets(offsets, q, k)
        scalars += totals
        specs, tag = (PORTABLE_DKDV_VARLEN, DQ_VARLEN), ("varlen",)
        q, k, v, dout, dq, dk, dv = (x[None] for x in (q, k, v, dout, dq, dk, dv))
    for name, x in (("q", q), ("k", k), ("v", v), ("do", dout), ("lse", lse),
                    ("delta", delta), ("dq", dq), ("dk", dk), ("dv", dv)):  # fmt: skip
        views[name] = arrays.kernel_view(x)
    views.update(_variant_views(p, variant))
    stream = arrays.current_stream()
    d, dtype, tiles = p.head_dim, p.dtype, (cfg.block_m, cfg.block_n)
    extra = {"varlen": True} if offsets is not None else {}
    if p.softcap:
        extra["softcap"] = p.softcap
    if p.alibi:
        extra["alibi"] = True
    if p.mods is not None:
        extra["mods"] = p.mods
    specs = tuple(spec.for_problem(p) for spec in specs)
    for kind, build, spec, grid, threads in (
        ("dkdv", backward_portable.build_dkdv, specs[0],
         (_ceil_div(p.seqlen_k, cfg.block_n), p.nheads_k, p.batch), cfg.block_n),
        ("dq", backward_portable.build_dq, specs[1],
         (_ceil_div(p.seqlen_q, cfg.block_m), p.nheads, p.batch), cfg.block_m),
    ):  # fmt: skip
        kernel = launcher(
            (configs.PortableBackwardConfig, *tag, d, dtype, cfg, kind) + variant_key(p),
            lambda build=build: build(d, dtype, *tiles, **extra),
            spec,
            dtype,
        )
        kernel(grid, threads, stream, 0, spec.args(views, scalars))


def backward_varlen(cfg, p, dout, q, k, v, out, lse, dq, dk, dv, cu_q, cu_k, variant=()):
    """dq, dk, dv (total rows first) of a packed batch; ``p`` holds the max lengths."""
    build = LAUNCHERS[type(cfg)]
    roles = (dout, q, k, v, out, lse, dq, dk, dv)
    prepared(
        (cfg, p),
        roles + (cu_q, cu_k, *variant),
        lambda: build(cfg, p, *roles, offsets=(cu_q, cu_k), variant=variant),
    )


#: The tensor-core dK/dV kernels over a packed batch: as FORWARD_VARLEN extends FORWARD.
TENSOR_CORE_DKDV_VARLEN = KernelSpec(
    arrays=TENSOR_CORE_DKDV.arrays + (("cu_q", "int32"), ("cu_k", "int32")),
    strided=TENSOR_CORE_DKDV.strided,
    scalars=FORWARD_VARLEN.scalars,
    variant=(),
)


def tensor_core_backward(
    cfg, kernels, p, dout, q, k, v, out, lse, dq, dk, dv, offsets=None, variant=(), maps=None
):
    """D, then the dK/dV kernel; dQ either accumulated there in fp32 by atomics and then scaled
    and rounded, or (``dq_separate``) written by the dQ kernel. ``kernels(head_dim, varlen,
    tma)`` gives the family's (dK/dV, dQ) Launchers. Dense, or a packed batch with ``offsets``
    = (cu_q, cu_k) as in _portable_backward. ``maps(q, k, v, do)`` (a dense call's kernel
    inputs; None where tensor maps cannot describe them) gives the streaming tiles' tensor-map
    templates, ((Q's, dO's), (K's, V's)), for kernels that load them by TMA
    (kernels/backward.py's Backend.ring_boxes)."""
    xp = arrays.array_module(q)
    dout, out = (_kernel_input(x) for x in (dout, out))
    varlen = offsets is not None
    head_dim = cfg.kernel_head_dim(p.head_dim)
    kernel_dout = dout  # (dout itself goes to the D kernel)
    if head_dim != p.head_dim:
        q, k, v, kernel_dout = (_padded(x, head_dim) for x in (q, k, v, dout))
    q, k, v, kernel_dout = (_kernel_input(x, alignment_elements=8) for x in (q, k, v, kernel_dout))
    templates = None if maps is None or varlen else maps(q, k, v, kernel_dout)
    if templates is None:
        lse, delta = _row_statistics(p, dout, out, lse, (dq, dk, dv), offsets)
    else:  # the dK/dV kernel copies them in bulk with its tiles
        padded_rows = backward_kernels.padded_stat_rows(p.seqlen_q, cfg.block_m)
        lse, delta = _preprocess(p, dout, out, lse, padded_rows)
    dout = kernel_dout
    direct = head_dim == p.head_dim
    dq_t, dk_t, dv_t = (
        g if direct else arrays.empty(g.shape[:-1] + (head_dim,), g.dtype, like=g)
        for g in (dq, dk, dv)
    )
    # dQ's fp32 accumulator for the atomics; a placeholder when the dQ kernel writes dQ itself
    planes = cfg.dq_planes(head_dim)
    if planes:
        dq_acc, dq_acc_view = bulk_dq_buffer(q, head_dim, planes, cfg.block_m, varlen)
    else:
        acc_shape = (1,) * q.ndim if cfg.dq_separate else q.shape[:-1] + (head_dim,)
        dq_acc = xp.zeros(acc_shape, dtype=xp.float32)
        dq_acc_view = dq_acc[None] if varlen else dq_acc
    if not cfg.dq_separate:
        note_unrecorded_work()  # the zeroing, and dQ rounded after the kernels
    named = (("q", q), ("k", k), ("v", v), ("do", dout), ("dq", dq_t), ("dk", dk_t),
             ("dv", dv_t))  # fmt: skip
    views = {name: arrays.kernel_view(x[None] if varlen else x) for name, x in named}
    views["dq_acc"] = arrays.kernel_view(dq_acc_view)
    views["lse"], views["delta"] = arrays.kernel_view(lse), arrays.kernel_view(delta)
    views.update(_variant_views(p, variant))
    scalars = attention_scalars(p, p.scale)
    if varlen:
        offset_views, totals = _packed_offsets(offsets, q, k)
        views.update(offset_views)
        scalars += totals
    if templates is not None:
        buffer = arrays.empty((4 * ptx_tma.MAP_WORDS,), np.int64, like=q)
        for kernel, pair, at in (("dkdv", templates[0], 0), ("dq", templates[1], 2)):
            views[f"{kernel}_maps"] = arrays.kernel_view(buffer[at * ptx_tma.MAP_WORDS :])
            for name, words in zip(("a", "b"), pair):
                views[f"{kernel}_{name}_map"] = (words,)
    specs = _tensor_core_backward_specs(p, varlen, templates is not None)
    stream, smem = arrays.current_stream(), cfg.shared_memory_bytes(head_dim)
    dkdv, dq_kernel = kernels(head_dim, varlen, templates is not None)
    blocks = _ceil_div(p.seqlen_k, cfg.block_n) * cfg.head_split
    dkdv((blocks, p.nheads_k, p.batch), cfg.threads, stream, smem, specs[0].args(views, scalars))
    if cfg.dq_separate:
        blocks = _ceil_div(p.seqlen_q, cfg.block_n) * cfg.head_split
        grid = (blocks, p.nheads, p.batch)
        dq_kernel(grid, cfg.threads, stream, smem, specs[1].args(views, scalars))
    elif planes:
        round_bulk_dq_into(dq, dq_acc, planes, p.scale)
    else:
        arrays.round_scaled_into(dq, dq_acc[..., : p.head_dim], p.scale)
    if not direct:
        if cfg.dq_separate:
            _copy_back(dq, dq_t, p)
        _copy_back(dk, dk_t, p)
        _copy_back(dv, dv_t, p)


def bulk_dq_buffer(q, head_dim, planes, block_m, varlen):
    """(buffer, kernel view) of dQ's fp32 sums where warpgroups add their columns up by bulk
    reductions (kernels/backward_sm90.bulk_dq), zeroed. The buffer is (batch, nheads, planes
    x rows, head_dim / planes): warpgroup w's columns in plane w, rows in order (a packed
    batch: batch 1, its rows), so a warpgroup's tile of ``block_m`` rows is one contiguous
    run; rows past the last reach a tile on (a tile's rows past its sequence add zeros), and
    a plane's rows are a multiple of 8 (bulk_dq swizzles by the row mod 8). The kernels see
    it as (batch, planes x rows, nheads, columns): dQ's row, head and batch strides, the
    plane stride the head stride / planes."""
    xp = arrays.array_module(q)
    batch, rows = (1, q.shape[0]) if varlen else q.shape[:2]
    rows = _ceil_div(rows + block_m - 1, 8) * 8
    nheads = q.shape[-2]
    buffer = xp.zeros((batch, nheads, planes * rows, head_dim // planes), dtype=xp.float32)
    return buffer, buffer.transpose(0, 2, 1, 3)


def bulk_dq_values(buffer, planes, shape):
    """dQ's sums in dQ's ``shape`` ((batch, seqlen, nheads, head_dim), or a packed batch's
    (rows, nheads, head_dim)) from a bulk_dq_buffer of ``planes`` planes: the swizzle undone
    (16-byte chunk c of plane row r was stored at c ^ (r & 7)) and the planes side by side
    again. Each element is read where _BULK_DQ_READ reads it on the GPU, by the same
    arithmetic, so the simulator's tests check the formula that kernel runs."""
    xp = arrays.array_module(buffer)
    _, nheads, plane_rows, cols = buffer.shape
    seqlen, head_dim = shape[-3], shape[-1]
    rows = plane_rows // planes
    t = xp.arange(int(np.prod(shape)), dtype=xp.int64)  # dq's logical index i
    c = t % head_dim
    t //= head_dim
    h = t % nheads
    t //= nheads
    r = t % seqlen
    batch = t // seqlen
    plane = c // cols
    cc = c - plane * cols
    chunk = (cc >> 2) ^ (r & 7)
    at = (((batch * nheads + h) * planes + plane) * rows + r) * cols + chunk * 4 + (cc & 3)
    return buffer.reshape(-1)[at].reshape(shape)


#: C code of round_bulk_dq_into: x = dQ's sum at logical index i of dq (batch, seqlen,
#: nheads, head_dim; a packed batch's (rows, nheads, head_dim) as batch 1), read where
#: bulk_dq stored it (bulk_dq_values' arithmetic, line by line).
_BULK_DQ_PARAMS = (
    "raw float32 acc, float32 s, int32 seqlen, int32 nheads, int32 head_dim, int32 planes, "
    "int32 rows, int32 cols"
)
_BULK_DQ_READ = """
    long long t = i;
    const int c = (int)(t % head_dim); t /= head_dim;
    const int h = (int)(t % nheads); t /= nheads;
    const int r = (int)(t % seqlen);
    const long long batch = t / seqlen;
    const int plane = c / cols, cc = c - plane * cols;
    const int chunk = (cc >> 2) ^ (r & 7);
    const long long at = (((batch * nheads + h) * planes + plane) * rows + r) * cols + chunk * 4
        + (cc & 3);
    float x = acc[at];
"""


def round_bulk_dq_into(dq, buffer, planes, scale):
    """``dq[...] = round(scale * dQ's sums)`` from a bulk_dq_buffer of ``planes`` planes: on
    the GPU one elementwise pass that reads each sum where bulk_dq stored it (the buffer is
    read once; a gather that undoes the swizzle first cost about 2.6 ms at 32k tokens x 2048
    on the H200, docs/performance.md); elsewhere bulk_dq_values, then round_scaled_into."""
    if arrays.array_module(buffer) is np:
        arrays.round_scaled_into(dq, bulk_dq_values(buffer, planes, dq.shape), scale)
        return
    _, nheads, plane_rows, cols = buffer.shape
    kernel = arrays.rounding_kernel(dq.dtype, _BULK_DQ_PARAMS, _BULK_DQ_READ, "numflash_bulk_dq")
    seqlen, head_dim = dq.shape[-3], dq.shape[-1]
    kernel(
        buffer, np.float32(scale), np.int32(seqlen), np.int32(nheads), np.int32(head_dim),
        np.int32(planes), np.int32(plane_rows // planes), np.int32(cols), arrays.rounding_output(dq),
    )  # fmt: skip


def _tensor_core_backward_specs(p, varlen, tma=False):
    """The (dK/dV, dQ) KernelSpecs of the tensor-core backward kernels for problem ``p``;
    ``tma``: each takes its tensor maps' templates and buffer after the variant arrays
    (tensor_core_backward)."""
    specs = (TENSOR_CORE_DKDV_VARLEN, DQ_VARLEN) if varlen else (TENSOR_CORE_DKDV, DQ)
    specs = tuple(spec.for_problem(p) for spec in specs)
    if tma:
        specs = tuple(
            spec._replace(variant=spec.variant + tensor_map_arguments(kernel))
            for spec, kernel in zip(specs, ("dkdv", "dq"))
        )
    return specs


def tensor_map_arguments(kernel):
    """The ``*variant`` entries (KernelSpec.variant) of a backward ``kernel``'s ("dkdv" or
    "dq") tensor maps: its two streaming arrays' templates and the launch's map buffer."""
    return ((f"{kernel}_a_map", "map"), (f"{kernel}_b_map", "map"), (f"{kernel}_maps", "int64"))


def _tensor_core_launchers(family, build, head_dim, p, cfg, varlen, tma=False):
    """The (dK/dV, dQ) Launchers of a tensor-core backward family; ``build()`` gives its
    backward.Kernels (``build(tma)`` where ``tma``: the dense kernels load by TMA). dQ is None
    where the dK/dV kernel adds dQ up by atomics."""
    key = (family, head_dim, p.dtype, cfg) + (("varlen",) if varlen else ()) + variant_key(p)
    if tma:
        key += ("tma",)
        build = functools.partial(build, True)
    specs = _tensor_core_backward_specs(p, varlen, tma)
    if varlen:
        dkdv = launcher(key + ("dkdv",), lambda: build().dkdv_varlen, specs[0], p.dtype)
    else:
        dkdv = launcher(key + ("dkdv",), lambda: build().dkdv, specs[0], p.dtype)
    if not cfg.dq_separate:  # no dQ kernel to launch (or to keep a launcher of)
        return dkdv, None
    dq = launcher(
        key + ("dq",), lambda: build().dq_varlen if varlen else build().dq, specs[1], p.dtype
    )
    return dkdv, dq


@launches(configs.TensorCoreBackwardConfig)
def _mma_backward(cfg, p, *tensors, offsets=None, variant=()):
    def kernels(head_dim, varlen, tma=False):  # (no TMA: mma.sync's kernels load by cp.async)
        def build():
            return backward_mma.build_kernels(
                head_dim,
                p.dtype,
                cfg.block_m,
                cfg.num_warps,
                cfg.stages,
                cfg.dq_separate,
                cfg.head_split,
                softcap=p.softcap,
                alibi=p.alibi,
                mods=p.mods,
            )

        return _tensor_core_launchers(
            configs.TensorCoreBackwardConfig, build, head_dim, p, cfg, varlen
        )

    tensor_core_backward(cfg, kernels, p, *tensors, offsets=offsets, variant=variant)


def backward(cfg, p, dout, q, k, v, out, lse, dq, dk, dv, variant=()):
    """dq, dk, dv of problem ``p`` with configuration ``cfg`` (validated arrays, sizes > 0),
    through the launches prepared for its geometry (:func:`prepared`); ``variant``: the
    arrays of variant_arrays(p)."""
    build = LAUNCHERS[type(cfg)]
    roles = (dout, q, k, v, out, lse, dq, dk, dv)
    prepared((cfg, p), roles + variant, lambda: build(cfg, p, *roles, variant=variant))


# -- attention over a KV cache ----------------------------------------------------------------

APPEND = KernelSpec(
    arrays=(("k", "elem"), ("v", "elem"), ("k_cache", "elem"), ("v_cache", "elem"),
            ("seqlens", "int32"), ("batch_idx", "int32"), ("block_table", "int32")),
    strided=("k", "v", "k_cache", "v_cache"),
    scalars=(("page_size", "int32"), ("max_blocks", "int32"), ("slots", "int32"),
             ("capacity", "int32")),
)  # fmt: skip
SPLIT_ATTENTION = KernelSpec(
    arrays=(("q", "elem"), ("k_cache", "elem"), ("v_cache", "elem"), ("seqlens", "int32"),
            ("batch_idx", "int32"), ("block_table", "int32"), ("o_part", "float32"),
            ("lse_part", "float32")),
    strided=("q", "k_cache", "v_cache"),
    scalars=(("seqlen_q", "int32"), ("seqlen_new", "int32"), ("heads_per_kv", "int32"),
             ("scale", "float32"), ("window_left", "int32"), ("window_right", "int32"),
             ("page_size", "int32"), ("max_blocks", "int32"), ("slots", "int32"),
             ("capacity", "int32"), ("num_splits", "int32"), ("chunk", "int32")),
    variant=(),
)  # fmt: skip
COMBINE = KernelSpec(
    arrays=(("o_part", "float32"), ("lse_part", "float32"), ("out", "elem"), ("lse", "float32")),
    strided=("out",),
    scalars=(("seqlen_q", "int32"), ("nheads", "int32"), ("num_splits", "int32")),
    variant=(),
)

#: The tensor-core KV-cache kernel, the whole call in one launch: SPLIT_ATTENTION's arrays,
#: the output it writes (itself with one split, by its row groups' last blocks with several),
#: the new rows it appends and its row groups' arrival counters; its chunks are computed per
#: block.
DECODE = KernelSpec(
    arrays=SPLIT_ATTENTION.arrays
    + (("out", "elem"), ("lse", "float32"), ("k", "elem"), ("v", "elem"), ("counters", "int32")),
    strided=("q", "k_cache", "v_cache", "out", "k", "v"),
    scalars=SPLIT_ATTENTION.scalars[:-1],
    variant=(),
)


def kvcache(
    cfg, num_splits, p, q, k_cache, v_cache, k, v, seqlens, batch_idx, block_table, out, lse,
    variant=(),
):  # fmt: skip
    """:func:`_kvcache` through the launches prepared for its geometry (:func:`prepared`):
    the arrays given, which of them are, the configuration, split count and problem."""
    given = (q, k_cache, v_cache, k, v, seqlens, batch_idx, block_table, out, lse)
    present = tuple(x is not None for x in given)
    prepared(
        (cfg, num_splits, p, present),
        [x for x in given if x is not None] + list(variant),
        lambda: _kvcache(cfg, num_splits, p, *given, variant),
    )


def _kvcache(
    cfg, num_splits, p, q, k_cache, v_cache, k, v, seqlens, batch_idx, block_table, out, lse,
    variant=(),
):  # fmt: skip
    """Append k, v (when given), then attention of q over each sequence's keys split
    ``num_splits`` ways, the partials combined into out and lse: one launch of the tensor-core
    kernel, or the portable append, split and combine kernels. Index arrays may be None:
    ``seqlens`` (a device array unless p.cache_seqlens is an int), ``batch_idx`` (the
    identity), ``block_table`` (contiguous cache); stand-ins of ``batch`` int32s are made for
    them, nothing the size of the cache. ``variant``: the arrays of variant_arrays(p)."""
    xp = arrays.array_module(q)
    if seqlens is None:
        seqlens = host_lengths(xp, p.batch, p.cache_seqlens)
    if batch_idx is None:
        batch_idx = xp.arange(p.batch, dtype=xp.int32)
    if block_table is None:
        block_table = xp.zeros((1,), dtype=xp.int32)
    stream = arrays.current_stream()
    geometry = (p.page_size, p.max_blocks, p.slots, p.capacity)
    views = {
        "k_cache": arrays.kernel_view(k_cache),
        "v_cache": arrays.kernel_view(v_cache),
        "seqlens": arrays.kernel_view(xp.ascontiguousarray(seqlens)),
        "batch_idx": arrays.kernel_view(xp.ascontiguousarray(batch_idx)),
        "block_table": arrays.kernel_view(xp.ascontiguousarray(block_table)),
    }
    views.update(_variant_views(p, variant))
    d, dtype = p.head_dim, p.dtype
    portable = isinstance(cfg, configs.PortableDecodeConfig)
    prefill = cfg.ROLE == "forward"  # chunked prefill on a forward family (the Hopper forward)
    if k is not None and p.seqlen_new:
        k, v = (_kernel_input(x) for x in (k, v))
        views.update(k=arrays.kernel_view(k), v=arrays.kernel_view(v))
        if portable:  # the tensor-core decode kernel appends by itself; chunked prefill's
            append_new_rows(p, views, geometry, stream)  # launcher decides (its kernel may)
    target, direct = _output_target(out, d, p)
    # partials of (split, batch, head, position), fp32: the portable kernels' always
    if num_splits > 1 or portable:
        o_part = xp.empty((num_splits, p.batch, p.nheads, p.seqlen_q, d), dtype=xp.float32)
        lse_part = xp.empty((num_splits, p.batch, p.nheads, p.seqlen_q), dtype=xp.float32)
    else:
        o_part = lse_part = xp.empty((1,), dtype=xp.float32)  # unused
    views.update(
        o_part=arrays.kernel_view(o_part),
        lse_part=arrays.kernel_view(lse_part),
        out=arrays.kernel_view(target),
        lse=arrays.kernel_view(lse),
    )
    if prefill:  # a forward configuration: LAUNCHERS holds its forward's launcher
        PREFILL_LAUNCHERS[type(cfg)](cfg, p, q, k_cache, v_cache, views, geometry, stream)
    else:
        LAUNCHERS[type(cfg)](cfg, num_splits, p, q, views, geometry, stream)
    if portable:  # the combine takes the sinks alone
        alone = dataclasses.replace(p, alibi=False, mods=None)
        spec = COMBINE._replace(variant=variant_arrays(alone))
        combine = launcher(
            (PORTABLE_DECODE_COMBINE, d, dtype) + (("sinks",) if p.sinks else ()),
            lambda: decode_portable.build_combine(d, dtype, p.sinks),
            spec,
            dtype,
        )
        combine(
            (p.nheads * p.seqlen_q, p.batch),
            decode_portable.combine_threads(d),
            stream,
            0,
            spec.args(views, (p.seqlen_q, p.nheads, num_splits)),
        )
    if not direct:
        _copy_back(out, target, p)


@launches(configs.PortableDecodeConfig)
def _portable_kvcache(cfg, num_splits, p, q, views, geometry, stream):
    """The portable split kernel: partials, also for one split (the combine writes out)."""
    d, dtype = p.head_dim, p.dtype
    views["q"] = arrays.kernel_view(_kernel_input(q))
    chunk = _ceil_div(_ceil_div(p.capacity, num_splits), cfg.block_n) * cfg.block_n
    spec = SPLIT_ATTENTION.for_problem(p)
    split = launcher(
        (type(cfg), d, dtype, cfg, p.paged) + variant_key(p),
        lambda: decode_portable.build_split_attention(
            d, dtype, cfg.block_m, cfg.block_n, p.paged, p.softcap, p.sinks, p.alibi, p.mods
        ),
        spec,
        dtype,
    )
    rows = _ceil_div(p.heads_per_kv * p.seqlen_q, cfg.block_m)
    scalars = (
        p.seqlen_q,
        p.seqlen_new,
        p.heads_per_kv,
        np.float32(p.scale * LOG2E),
        p.window_left,
        p.window_right,
        *geometry,
        num_splits,
        chunk,
    )
    split(
        (num_splits * rows, p.nheads_k, p.batch),
        cfg.block_m,
        stream,
        0,
        spec.args(views, scalars),
    )


def append_new_rows(p, views, geometry, stream):
    """The portable append kernel: the new rows ``views["k"]``, ``views["v"]`` into the caches
    at each sequence's length, before a kernel that reads them there."""
    d, dtype, paged = p.head_dim, p.dtype, p.paged
    append = launcher(
        (PORTABLE_DECODE_APPEND, d, dtype, paged),
        lambda: decode_portable.build_append(d, dtype, paged),
        APPEND,
        dtype,
    )
    grid = (p.seqlen_new, p.nheads_k, p.batch)
    append(grid, decode_portable.APPEND_THREADS, stream, 0, APPEND.args(views, geometry))


@launches(configs.TensorCoreDecodeConfig)
def _tensor_core_kvcache(cfg, num_splits, p, q, views, geometry, stream):
    """The tensor-core kernel: the append, the attention and (several splits) the combine in
    one launch."""
    d, dtype = p.head_dim, p.dtype
    xp = arrays.array_module(q)
    q, scale = _positive_scale(q, p.scale)
    views["q"] = arrays.kernel_view(_kernel_input(q, alignment_elements=8))
    if "k" not in views:  # nothing to append (seqlen_new is 0): never read
        views["k"] = views["v"] = views["q"]
    rows = _ceil_div(p.heads_per_kv * p.seqlen_q, decode_kernels.ROWS)
    if num_splits > 1:
        if num_splits > decode_kernels.MAX_SPLITS:
            raise ValueError(f"at most {decode_kernels.MAX_SPLITS} splits; got {num_splits}")
        # One arrival counter per row group. Zeroed here once: every launch leaves them zero,
        # so a plan's replays reuse them as they are.
        views["counters"] = arrays.kernel_view(
            xp.zeros((p.batch * p.nheads_k * rows,), dtype=xp.int32)
        )
    else:
        views["counters"] = views["seqlens"]  # never touched with one split
    tiles = (cfg.block_n, cfg.num_warps, cfg.stages, p.paged)
    spec = DECODE.for_problem(p)
    launch = launcher(
        (configs.TensorCoreDecodeConfig, d, dtype, cfg, p.paged) + variant_key(p),
        lambda: decode_kernels.build(d, dtype, *tiles, p.softcap, p.sinks, p.alibi, p.mods),
        spec,
        dtype,
    )
    scalars = (
        p.seqlen_q,
        p.seqlen_new,
        p.heads_per_kv,
        np.float32(scale * LOG2E),
        p.window_left,
        p.window_right,
        *geometry,
        num_splits,
    )
    launch(
        (num_splits * rows, p.nheads_k, p.batch),
        cfg.threads,
        stream,
        cfg.shared_memory_bytes(d),
        spec.args(views, scalars),
    )


#: One launch builder per KV-cache family.


#: Launcher keys of the KV-cache kernels that no configuration names.
PORTABLE_DECODE_APPEND = "portable-decode append"
PORTABLE_DECODE_COMBINE = "portable-decode combine"
