"""The tensor memory accelerator (TMA, sm_90): tiles copied from global to shared memory by
the hardware, described by a tensor map.

A kernel asks for a box of a tensor (up to 5 dimensions, the innermost contiguous) with one
instruction issued by one thread; the copy lands in shared memory with the 128-byte swizzle
that wgmma reads, elements outside the tensor zero-filled, and it completes a transaction
count on an mbarrier (ptx_sm90's ``mbarrier_expect_tx``). No registers, no address arithmetic
per 16 bytes: the loads of the Hopper forward cost its producer a handful of instructions per
tile instead of cp.async's one per 16 bytes and thread.

Facts used (PTX ISA: cp.async.bulk.tensor, cp.async.bulk, tensormap.replace,
tensormap.cp_fenceproxy, fence.proxy.tensormap; CUDA driver API: cuTensorMapEncodeTiled):

- A tensor map is 128 opaque bytes made on the host by ``cuTensorMapEncodeTiled``: element
  type, rank, the global address (16-byte aligned), the sizes (innermost first), the byte
  strides of the outer dimensions (multiples of 16, below 2^40), the box (at most 256
  elements a dimension; with the 128-byte swizzle at most 128 bytes innermost), swizzle and
  out-of-bounds fill. A box written with the 128-byte swizzle is the layout of ptx_sm90's
  K-major and MN-major 128-byte-swizzled operands (128-byte rows, 16-byte chunk c of row r at
  c ^ (r & 7)) when its shared address is 1024-byte aligned.
- ``cp.async.bulk.tensor`` reads the map from ``.param``, ``.const`` or ``.global`` memory.
  numba-cuda passes no by-value kernel parameter wider than a scalar, so a kernel here takes
  each map as 16 int64 scalars (a "template"), writes it to shared memory, replaces the global
  address in it with its array's (``tensormap.replace``) and copies it to global memory with a
  release fence (``tensormap.cp_fenceproxy``, warp-wide); then ``fence.proxy.tensormap
  acquire`` before the first copy that reads it. What the kernel takes from a template is the
  shapes and strides, never the address, so a recorded launch (numflash.plans) stays exact
  when its arrays change.
- Every block of a launch writes the same bytes to the same global map (the launch's arrays
  are the same for all), so a map is never seen half written by a block that uses it. A
  launch's map buffer is its own, or one that only launches before it on its stream used (a
  replay plan keeps its buffer, as it keeps its other buffers: numflash.plans).
- ``cp.async.bulk`` copies a contiguous run of bytes with no tensor map (:func:`load_bulk`):
  both addresses 16-byte aligned, the size a multiple of 16, nothing zero-filled (the caller
  keeps the run inside its array); it completes on an mbarrier as a box does.

In Numba's CUDA simulator the template is this module's own encoding of the same fields
(:func:`template`), a global address is (array, element index), and the copy is done at once,
swizzle and zero fill included, completing the mbarrier's transaction count as the hardware
does.
"""

import threading

import numpy as np
from numba import int32, int64

from . import ptx, ptx_sm90
from .jit import SIMULATOR, device_function

#: A tensor map's size, and as the int64 words a kernel takes it in.
MAP_BYTES = 128
MAP_WORDS = MAP_BYTES // 8
#: The box's innermost extent in elements of 16 bits: one 128-byte swizzle row.
BOX_INNER = 64

_DATA_TYPES = {"float16": 6, "bfloat16": 9}  # CU_TENSOR_MAP_DATA_TYPE_FLOAT16, _BFLOAT16


def problems(dims, strides, itemsize=2):
    """Why a tensor of ``dims`` elements (innermost first) and outer element ``strides`` can
    not have a tensor map (empty when it can)."""
    out = []
    if any(not 1 <= d <= 1 << 32 for d in dims):
        out.append(f"sizes {dims} outside [1, 2^32]")
    if any((s * itemsize) % 16 or not 0 <= s * itemsize < 1 << 40 for s in strides):
        out.append(f"strides {strides} not multiples of 16 bytes below 2^40")
    return out


def template(dtype_name, dims, strides, box, address):
    """The tensor map of a ``dtype_name`` tensor of ``dims`` elements (innermost first) and
    outer element ``strides``, box ``box``, 128-byte swizzle, zero fill, as MAP_WORDS int64
    values, encoded with ``address`` (16-byte aligned): any address serves, since the kernel
    replaces it with its array's, so callers make a template once per geometry.

    Raises ValueError when the driver refuses the map (see :func:`problems`)."""
    make = _simulated_template if SIMULATOR else _encoded_template
    return make(dtype_name, dims, strides, box, address)


def templates(dtype_name, xs, box_rows):
    """The templates of dense (batch, seqlen, heads, head_dim) arrays ``xs`` as 4-D tensors,
    innermost first, boxes of BOX_INNER columns by ``box_rows`` rows (one count an array), or
    None where a tensor map cannot describe one of them (an address not 16-byte aligned, a
    stride not a multiple of 16 bytes). A template holds no address the kernel uses (it
    writes its arrays' in), so they are made once per geometry, with this call's addresses."""
    return _once_per_geometry(
        (dtype_name, tuple(box_rows)),
        xs,
        lambda addresses: _geometry_templates(dtype_name, xs, addresses, box_rows),
    )


def _once_per_geometry(key, xs, make):
    """``make(addresses)`` of arrays ``xs``, kept under ``key`` and their shapes and strides;
    None where an address is not 16-byte aligned."""
    addresses = tuple(0 if SIMULATOR else x.data.ptr for x in xs)
    if any(a % 16 for a in addresses):
        return None
    key += tuple((x.shape, x.strides) for x in xs)
    found = _templates.get(key, False)
    if found is False:
        if len(_templates) >= 1024:
            _templates.clear()
        found = _templates[key] = make(addresses)
    return found


#: Tensor-map templates (or None: no tensor map describes the arrays) by dtype, box rows and
#: the arrays' shapes and strides.
_templates = {}


def _geometry_templates(dtype_name, xs, addresses, box_rows):
    """:func:`templates` worked out: None where a stride is not a multiple of 16 bytes."""
    found = []
    for x, address, rows in zip(xs, addresses, box_rows):
        batch, seqlen, heads, head_dim = x.shape
        sb, ss, sh, _ = (s // x.dtype.itemsize for s in x.strides)
        dims = (head_dim, seqlen, heads, batch)
        # the stride of a dimension of one element is never used: any multiple of 16 bytes
        strides = tuple(8 if n == 1 else s for n, s in ((seqlen, ss), (heads, sh), (batch, sb)))
        if problems(dims, strides):
            return None
        box = (BOX_INNER, rows, 1, 1)
        found.append(template(dtype_name, dims, strides, box, address))
    return tuple(found)


def grouped_templates(dtype_name, xs, box_rows):
    """The templates of paged caches ``xs`` (pages, page_size, kv heads, head_dim) as 5-D
    tensors whose boxes land a tile's rows as 8-row groups holding every 64-column atom
    (kernels/forward_sm90.py, ``cache="grouped"``): innermost first, 64 columns, 8 rows, the
    atoms (128 bytes apart), the kv heads and every 8-row group of the cache (group g of page
    p numbered p x page_size / 8 + g, which needs the pages page_size rows apart); boxes of
    (64, 8, atoms, 1, ``box_rows`` / 8). None where that does not describe an array: head_dim
    not whole atoms, page_size or ``box_rows`` not multiples of 8, pages not page_size rows
    apart, 2^30 groups or more (int32 coordinates, the absent pages' past them), an address
    or stride the tensor map cannot take, or the driver refusing it."""
    return _once_per_geometry(
        ("grouped", dtype_name, box_rows),
        xs,
        lambda addresses: _grouped_geometry(dtype_name, xs, addresses, box_rows),
    )


def _grouped_geometry(dtype_name, xs, addresses, box_rows):
    found = []
    for x, address in zip(xs, addresses):
        pages, page_size, heads, head_dim = x.shape
        sp, sr, sh, _ = (s // x.dtype.itemsize for s in x.strides)
        groups = pages * page_size // 8
        if head_dim % BOX_INNER or page_size % 8 or box_rows % 8 or groups >= 1 << 30:
            return None
        if pages > 1 and sp != page_size * sr:
            return None
        dims = (BOX_INNER, 8, head_dim // BOX_INNER, heads, groups)
        strides = (sr, BOX_INNER, 8 if heads == 1 else sh, 8 * sr)
        if problems(dims, strides):
            return None
        box = (BOX_INNER, 8, head_dim // BOX_INNER, 1, box_rows // 8)
        try:
            found.append(template(dtype_name, dims, strides, box, address))
        except ValueError:  # the driver refused the geometry: the caller loads otherwise
            return None
    return tuple(found)


def _encoded_template(dtype_name, dims, strides, box, address):
    from cuda.bindings import driver

    rank = len(dims)
    err, tensor_map = driver.cuTensorMapEncodeTiled(
        driver.CUtensorMapDataType(_DATA_TYPES[dtype_name]),
        rank,
        address,
        [driver.cuuint64_t(d) for d in dims],
        [driver.cuuint64_t(s * 2) for s in strides],
        [driver.cuuint32_t(b) for b in box],
        [driver.cuuint32_t(1)] * rank,
        driver.CUtensorMapInterleave.CU_TENSOR_MAP_INTERLEAVE_NONE,
        driver.CUtensorMapSwizzle.CU_TENSOR_MAP_SWIZZLE_128B,
        driver.CUtensorMapL2promotion.CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
        driver.CUtensorMapFloatOOBfill.CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE,
    )
    if err != driver.CUresult.CUDA_SUCCESS:
        raise ValueError(f"cuTensorMapEncodeTiled refused dims {dims} strides {strides}: {err}")
    words = np.array([int(w) for w in tensor_map.opaque], dtype=np.uint64)
    return tuple(int(w) for w in words.view(np.int64))


if SIMULATOR:
    _tables_lock = threading.Lock()
    _sources = {}  # (map buffer address, word index) -> the array a published map reads

    def _simulated_template(dtype_name, dims, strides, box, address):
        """rank, dims (5), outer strides (4, elements), box (5): the fields the simulated
        copy reads, padded to MAP_WORDS."""
        rank = len(dims)
        pad = 5 - rank
        words = [rank, *dims, *(1,) * pad, *strides, *(0,) * pad, *box, *(1,) * pad]
        return tuple(words + [0] * (MAP_WORDS - len(words)))

    class _GlobalAddress:
        """A global address in the simulator: an array and an element index."""

        def __init__(self, array, index):
            self.array = array
            self.index = int(index)

        def key(self):
            return (self.array.__array_interface__["data"][0], self.index)

    def global_address(array, index):
        return _GlobalAddress(array, index)

    def _staging_key(address):
        return (address.array.__array_interface__["data"][0], address.index)

    def store_map_word(address, word, value):
        """Word ``word`` of the map staged at shared ``address``."""
        at = address.index + 4 * int(word)
        address.array[at : at + 4] = np.array([value], dtype=np.int64).view(np.uint16)

    def _staged_sources():
        """This block's {staged map's shared address: the array it reads}."""
        manager = threading.current_thread()._manager
        with _tables_lock:
            return manager.__dict__.setdefault("_numflash_staged_maps", {})

    def replace_address(address, source):
        _staged_sources()[_staging_key(address)] = source

    def publish(gmem, address):
        # warp-wide: runs once every lane has arrived, lane 0's staging done before it
        def collective(inputs):
            words = address.array[address.index : address.index + 4 * MAP_WORDS]
            gmem.array[gmem.index : gmem.index + MAP_WORDS] = words.view(np.int64)
            with _tables_lock:
                _sources[gmem.key()] = staged[_staging_key(address)]
            return [None] * 32

        staged = _staged_sources()
        ptx._warp_collective(collective, None)

    def acquire(gmem):
        pass

    def load_box(gmem, dst, barrier, c0, c1, c2, c3):
        """Copy the box at coordinates (c0 innermost, c1, c2, c3) of the map at ``gmem`` into
        shared ``dst`` (swizzled 128-byte rows), zeros outside the tensor, and complete its
        bytes on the mbarrier at shared ``barrier``."""
        _copy_box(gmem, dst, barrier, (c0, c1, c2, c3, 0))

    def load_box5(gmem, dst, barrier, c0, c1, c2, c3, c4):
        """:func:`load_box` of a 5-D map."""
        _copy_box(gmem, dst, barrier, (c0, c1, c2, c3, c4))

    def _copy_box(gmem, dst, barrier, coords):
        """The box at ``coords`` (5, innermost first), written as the hardware writes it: its
        rows (innermost extent) in the order of the outer dimensions, the first fastest."""
        words = [int(w) for w in gmem.array[gmem.index : gmem.index + MAP_WORDS]]
        dims, strides, box = words[1:6], [1, *words[6:10]], words[10:15]
        with _tables_lock:
            source = _sources[gmem.key()]
        coords = tuple(int(c) for c in coords)
        rows = box[1] * box[2] * box[3] * box[4]
        tile = np.zeros((rows, box[0]), dtype=np.uint16)
        for r in range(rows):
            outer, rest = [], r
            for extent in box[1:]:
                outer.append(rest % extent)
                rest //= extent
            at = [coords[i + 1] + outer[i] for i in range(4)]
            if not all(0 <= a < d for a, d in zip(at, dims[1:])):
                continue
            first = source.index + sum(a * s for a, s in zip(at, strides[1:]))
            cols = np.arange(box[0]) + coords[0]
            inside = (cols >= 0) & (cols < dims[0])
            tile[r, inside] = source.array[first + cols[inside]]
        byte = dst.index * 2 + np.arange(rows)[:, None] * 2 * box[0] + np.arange(box[0]) * 2
        byte = byte ^ (((byte >> 7) & 7) << 4)  # the 128-byte swizzle on the address
        dst.array[byte // 2] = tile
        ptx_sm90._mbarrier(barrier).complete_tx(tile.nbytes)

    def load_bulk(src, dst, nbytes, barrier):
        """Copy ``nbytes`` from global ``src`` to shared ``dst`` (an element of a shared
        array) and complete them on the mbarrier at shared ``barrier``."""
        n = int(nbytes)
        source = src.array.reshape(-1).view(np.uint8)
        target = dst.array.reshape(-1).view(np.uint8)
        at, to = src.index * src.array.itemsize, dst.index * dst.array.itemsize
        target[to : to + n] = source[at : at + n]
        ptx_sm90._mbarrier(barrier).complete_tx(n)

else:
    from llvmlite import ir
    from numba.cuda import types
    from numba.cuda.extending import intrinsic

    _I32 = ir.IntType(32)

    @intrinsic
    def global_address(typingctx, array, index):
        """The 64-bit global address of ``array[index]``."""
        sig = types.uint64(array, types.int64)

        def codegen(context, builder, sig, args):
            pointer = ptx.element_pointer(context, builder, sig.args[0], args[0], args[1])
            return ptx._global_address(builder, pointer)

        return sig, codegen

    @intrinsic
    def store_map_word(typingctx, address, word, value):
        """Store int64 ``value`` as word ``word`` of the map staged at shared ``address``."""
        sig = types.void(types.uint32, types.int32, types.int64)

        def codegen(context, builder, sig, args):
            at = builder.add(args[0], builder.mul(args[1], ir.Constant(_I32, 8)))
            ptx_sm90._void_asm(builder, "st.shared.b64 [$0], $1;", "r,l,~{memory}", [at, args[2]])
            return context.get_dummy_value()

        return sig, codegen

    replace_address = ptx_sm90._operands_statement(
        "tensormap.replace.tile.global_address.shared::cta.b1024.b64 [$0], $1;",
        2,
        "Set the global address of the map staged at shared ``address`` (uint32, 128-byte "
        "aligned) to ``source`` (uint64, 16-byte aligned).",
        (types.uint32, types.uint64),
    )
    publish = ptx_sm90._operands_statement(
        "bar.warp.sync -1; "
        "tensormap.cp_fenceproxy.global.shared::cta.tensormap::generic.release.gpu"
        ".sync.aligned [$0], [$1], 128;",
        2,
        "Copy the map staged at shared ``address`` (uint32) to global ``gmem`` (uint64, 64-byte "
        "aligned) and release it to the tensor-map proxy; every thread of the warp together, "
        "after a warp barrier that orders the lane that staged the map before the copy that "
        "reads it.",
        (types.uint64, types.uint32),
    )
    acquire = ptx_sm90._operands_statement(
        "fence.proxy.tensormap::generic.acquire.gpu [$0], 128;",
        1,
        "Make the map at global ``gmem`` (uint64), published by :func:`publish`, the one this "
        "thread's copies read (the tensor-map proxy's acquire).",
        (types.uint64,),
    )

    def _box_copy(rank):
        """(signature, codegen) of the copy of a box of a ``rank``-D map: global map, shared
        destination, shared mbarrier, then ``rank`` int32 coordinates, innermost first."""
        coords = ", ".join(f"${3 + i}" for i in range(rank))
        asm = (
            f"cp.async.bulk.tensor.{rank}d.shared::cluster.global.mbarrier::complete_tx::bytes "
            f"[$0], [$1, {{{coords}}}], [$2];"
        )
        constraints = "r,l,r" + ",r" * rank + ",~{memory}"

        def codegen(context, builder, sig, args):
            gmem, dst, barrier, *at = args
            ptx_sm90._void_asm(builder, asm, constraints, [dst, gmem, barrier, *at])
            return context.get_dummy_value()

        return types.void(types.uint64, types.uint32, types.uint32, *(types.int32,) * rank), codegen

    @intrinsic
    def load_box(typingctx, gmem, dst, barrier, c0, c1, c2, c3):
        """Copy the box at coordinates (c0 innermost, c1, c2, c3; int32) of the 4-D map at
        global ``gmem`` into shared ``dst`` (1024-byte aligned), completing its bytes on the
        mbarrier at shared ``barrier``."""
        return _box_copy(4)

    @intrinsic
    def load_box5(typingctx, gmem, dst, barrier, c0, c1, c2, c3, c4):
        """:func:`load_box` of a 5-D map (coordinates c0 innermost .. c4)."""
        return _box_copy(5)

    @intrinsic
    def load_bulk(typingctx, src, dst, nbytes, barrier):
        """Copy ``nbytes`` (a multiple of 16) from global ``src`` (uint64, 16-byte aligned) to
        shared ``dst`` (uint32, 16-byte aligned) by one bulk copy, no tensor map, completing
        its bytes on the mbarrier at shared ``barrier``."""
        sig = types.void(types.uint64, types.uint32, types.uint32, types.uint32)

        def codegen(context, builder, sig, args):
            src, dst, nbytes, barrier = args
            asm = (
                "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes "
                "[$0], [$1], $2, [$3];"
            )
            ptx_sm90._void_asm(builder, asm, "r,l,r,r,~{memory}", [dst, src, nbytes, barrier])
            return context.get_dummy_value()

        return sig, codegen


@device_function
def publish_map(maps, index, staged, words, source, lane):
    """Warp-wide: tensor map ``index`` of a launch's ``maps`` (int64, MAP_WORDS a map) made
    from template ``words`` (staged in shared memory at ``staged``) with global address
    ``source``."""
    if lane == 0:
        for w in range(MAP_WORDS):
            store_map_word(staged, int32(w), words[w])
        replace_address(staged, source)
    publish(global_address(maps, int64(index * MAP_WORDS)), staged)
