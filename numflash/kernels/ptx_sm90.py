"""Hopper-only inline PTX (sm_90a): warpgroup matrix multiply (wgmma) and its fences.

The Hopper backward (kernels/backward_sm90.py) is built on it: wgmma reads its operands from
shared memory through 64-bit descriptors and accumulates asynchronously, which frees the
fragment registers that limit the mma.sync kernels. ``tests/wgmma_gemm.py`` multiplies small
tiles with each way of feeding it (both operands from shared memory, without and with the
128-byte swizzle; A from registers; B MN-major, one and two atoms wide), compiled for sm_90a
on CI (tests/test_compile.py) and checked against NumPy on a GPU (tests/test_wgmma.py).

It lives beside ptx.py rather than in it because ptx.py is part of the tuned forward's kernel
hash (numflash/cache.py): editing it would set aside the shipped tuned configurations until
re-tuned. The two modules share their conventions (ptx.py's docstring).

Facts used (PTX ISA, "Asynchronous Warpgroup Level Matrix Multiply-Accumulate"):

- A warpgroup is four consecutive warps (128 threads, the first warp's index a multiple of
  4); every instruction here is ``.sync.aligned``: all 128 threads reach it together.
- Shared-memory matrix descriptor, 64 bits: bits 0-13 the start address >> 4, 16-29 the
  leading-dimension byte offset >> 4 (between core matrices adjacent in K), 32-45 the
  stride-dimension byte offset >> 4 (between core matrices adjacent in M or N), 49-51 the base
  offset (0 for the layouts used here), 62-63 the swizzle (0 none, 1 128 B, 2 64 B, 3 32 B).
- A core matrix, without swizzle, is 8 rows of 16 bytes (8 fp16/bf16 values of K) stored as
  128 contiguous bytes.
- With the 128-byte swizzle (K-major), rows are 128 bytes (64 values of K) and groups of 8
  rows 1024 bytes apart (the stride offset; the leading offset is unused), the group's base
  1024-byte aligned; the 16-byte chunk c of row r is stored at chunk c ^ (r & 7). Each k16
  step starts 32 bytes further into the row: the hardware applies the swizzle to the
  address.
- A may instead come from registers: warp w's 16 rows as mma.sync's A fragment.
- B (or A) may be MN-major ("transposed", fp16/bf16 only): stored K x N with N contiguous.
  With the 128-byte swizzle its rows are 64 values of N, groups of 8 K-rows 1024 bytes apart,
  chunk c of K-row k at c ^ (k & 7); a k16 step is 16 rows further (2048 bytes). The stride
  offset steps between 8-row groups of K, the leading offset between 64-wide atoms of N (the
  canonical MN-major layouts of CUTLASS's descriptor comments; tests/wgmma_gemm.py's
  ``wide`` variant checks it at N = 128).
- The fp32 accumulator of ``m64nNk16`` (N / 2 values per thread): warp w of the group holds
  rows 16w..16w+15 laid out as mma.sync's C fragment, repeated for each 8 columns: value
  4i + r of lane (g = lane >> 2, t = lane & 3) is row 16w + g + 8 (r >> 1), column
  8i + 2t + (r & 1).
- Shared memory written by ordinary stores must be made visible to the async proxy
  (``fence.proxy.async.shared::cta``) and the threads synchronised before wgmma reads it;
  ``wgmma.fence`` orders the accumulator registers before the first wgmma of a group;
  ``commit_group`` / ``wait_group N`` wait for the products to land in the registers.

``red.global.add.v2.f32`` (PTX ISA 8.1, sm_90) adds two adjacent fp32 values to global memory
in one instruction, 8-byte aligned, with no result: the Hopper backward adds dQ up with it
where the dK/dV kernel computes dQ too (``reduce_add_pair``).

``cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32`` (PTX ISA 8.0, sm_90) adds a
contiguous run of fp32 values from shared memory into global memory through the TMA unit,
asynchronously: the issuing thread goes on at once, the shared source (16-byte aligned, a
multiple of 16 bytes) may be written again once ``cp.async.bulk.wait_group.read`` has seen the
thread's bulk groups read, and the block may exit once ``cp.async.bulk.wait_group`` has seen
them complete. What ordinary stores wrote into the source must be fenced to the async proxy
first (``fence_proxy_async``) by the threads that wrote it, before they synchronise with the
issuing thread (``bulk_reduce_add``, ``bulk_commit``, ``bulk_wait_read``, ``bulk_wait``;
``store_shared_pair`` writes two fp32 values into shared memory with one 8-byte store).

``load_16`` / ``store_16`` move 16 bytes of a 16-bit array (``ld.global.v4.u32`` /
``st.global.v4.u32``, the element 16-byte aligned), and ``fence_proxy_async_global``
(``fence.proxy.async.global``) orders a thread's ordinary stores to global memory before the
asynchronous proxy's later reads (a TMA copy that a thread issues after synchronising with the
writer): the Hopper forward's producer appends a KV cache's new rows with them before its TMA
copies read them back (kernels/forward_sm90.py). ``compiler_fence`` emits nothing: an empty
statement with a memory clobber, across which the compiler moves no load or store; ``opaque``
passes an int32 through a move the compiler cannot see through (a loop stepping by it is not
unrolled).

Barriers for warp-specialised kernels (PTX ISA, "mbarrier", "bar"):

- An mbarrier is 8 bytes of shared memory (8-byte aligned) initialised with an expected
  arrival count; its phase completes when that many arrivals have been made, and the next
  phase starts. ``mbarrier.try_wait.parity`` with parity P returns once the phase of parity P
  has completed: P = 0 waits for the first phase, and a waiter tracks its phase's parity.
  Arrivals release and waits acquire, so what a thread wrote before arriving is visible to a
  thread after its wait. ``cp.async.mbarrier.arrive.noinc`` arrives for the executing thread
  once all its earlier cp.async copies have landed, without the thread waiting for them;
  wgmma reads what the copies wrote after a wait on the barrier (CUTLASS's cp.async GMMA
  mainloops hand tiles over this way, with no proxy fence).
- ``mbarrier.arrive.expect_tx`` arrives and adds a byte count (the transaction count) that
  the phase also waits for: a TMA copy naming the barrier lowers it by the bytes it wrote
  (``complete_tx``) when they land, so the phase completes once every arrival is made and
  every expected byte has landed.
- Named barriers 1-15 (0 is __syncthreads): ``bar.sync id, n`` waits until ``n`` threads
  (a multiple of 32) have arrived at ``id``, counting itself; ``bar.arrive id, n`` counts
  itself without waiting.
- ``setmaxnreg.{inc,dec}.sync.aligned.u32 N`` (every thread of a warpgroup together) moves the
  warpgroup's register budget to N (24..256, a multiple of 8); ptxas obeys it only in a kernel
  whose register count at entry it knows (launch bounds with a minimum of blocks).

In Numba's CUDA simulator each name is a Python function with the semantics above, as in
ptx.py: the 128 threads of a warpgroup meet at a barrier, and the product is computed once
from the shared array the descriptors point into (read through the same layout rules,
swizzle included) and the threads' registers. The simulator follows this module's reading of
the PTX ISA; only a GPU can confirm that reading (tests/test_wgmma.py runs on both).
"""

import functools
import threading

import numpy as np
from numba import uint32, uint64

from . import ptx
from .jit import SIMULATOR, device_function

#: 1 / x by rcp.approx (ptx.reciprocal): what the Hopper kernels divide by.
reciprocal = ptx.reciprocal

__all__ = [
    "aligned_index",
    "matrix_descriptor",
    "wgmma_fence",
    "wgmma_commit",
    "wgmma_wait",
    "fence_proxy_async",
    "wgmma",
    "wgmma_update",
    "fence_operands",
    "quotient32",
    "reciprocal",
    "mbarrier_init",
    "mbarrier_arrive",
    "mbarrier_expect_tx",
    "mbarrier_wait",
    "cp_async_arrive",
    "named_barrier_sync",
    "named_barrier_arrive",
    "warpgroup_barrier",
    "pair_barrier_sync",
    "pair_barrier_arrive",
    "set_max_registers",
    "reduce_add_pair",
    "store_shared_pair",
    "bulk_reduce_add",
    "bulk_commit",
    "bulk_wait_read",
    "bulk_wait",
    "load_16",
    "store_16",
    "fence_proxy_async_global",
    "compiler_fence",
    "opaque",
]

#: swizzle field values of the descriptor
SWIZZLE_NONE, SWIZZLE_128B, SWIZZLE_64B, SWIZZLE_32B = 0, 1, 2, 3


def _check_shape(ab, n):
    if ab not in ("f16", "bf16") or n % 8 or not 8 <= n <= 256:
        raise ValueError(f"wgmma: no m64n{n}k16 for {ab!r} (f16 or bf16, n = 8, 16, ..., 256)")


if SIMULATOR:
    _lock = threading.Lock()

    class _Descriptor:
        """The simulator's descriptor: the operand's address (ptx's _SharedAddress, its array's
        first element taken as 1024-byte aligned) and the layout fields."""

        def __init__(self, address, leading_bytes, stride_bytes, swizzle):
            self.address = address
            self.leading = int(leading_bytes)
            self.stride = int(stride_bytes)
            self.swizzle = int(swizzle)

        def __add__(self, units):
            """The descriptor moved by ``units`` x 16 bytes (the address field's unit)."""
            return _Descriptor(
                self.address + 16 * int(units), self.leading, self.stride, self.swizzle
            )

        def read(self, rows, cols, mn_major):
            """The operand as a (rows x cols) uint16 array: rows = M or N and cols = K for a
            K-major operand; rows = K and cols = N for an MN-major one."""
            base = self.address.index * 2  # byte address in the shared window
            r = np.arange(rows)[:, None]
            c = np.arange(cols)[None, :]
            if self.swizzle == SWIZZLE_NONE:
                if mn_major:
                    raise NotImplementedError("MN-major operands without swizzle")
                byte = base + (r >> 3) * self.stride + (c >> 3) * self.leading + (r & 7) * 16
                byte = byte + (c & 7) * 2
            elif self.swizzle == SWIZZLE_128B:
                if cols > 64 and not mn_major:
                    raise NotImplementedError("K-major rows wider than one 128-byte atom")
                # 8-row groups: stride apart (K-major: groups of M/N rows; MN-major: of K rows);
                # MN-major 64-wide atoms of N: leading apart
                byte = base + (r >> 3) * self.stride + (r & 7) * 128 + (c & 63) * 2
                byte = byte + (c >> 6) * self.leading
                byte = byte ^ (((byte >> 7) & 7) << 4)
            else:
                raise NotImplementedError(f"swizzle mode {self.swizzle}")
            assert (byte % 2 == 0).all()
            return self.address.array[byte // 2]

    def matrix_descriptor(address, leading_bytes, stride_bytes, swizzle):
        return _Descriptor(address, leading_bytes, stride_bytes, swizzle)

    def aligned_index(smem, alignment):
        return 0  # the simulator's shared arrays start aligned

    def _nothing(*args):
        pass

    wgmma_fence = wgmma_commit = wgmma_wait = fence_proxy_async = _nothing

    class _GroupExchange(ptx._WarpExchange):
        """ptx.py's warp exchange, for the 128 threads of a warpgroup."""

        def __init__(self):
            self.inputs = [None] * 128
            self.results = self.collective = None
            self.barrier = threading.Barrier(128, action=self._run, timeout=600)

    def _group_collective(collective, value):
        """Run ``collective`` (128 thread inputs -> 128 results) as one warpgroup-wide step."""
        thread = threading.current_thread()
        key = (tuple(thread.blockIdx), thread.thread_id >> 7)
        with _lock:  # one exchange per warpgroup and launch
            groups = thread._manager.__dict__.setdefault("_numflash_warpgroups", {})
            exchange = groups.get(key) or groups.setdefault(key, _GroupExchange())
        index = thread.thread_id & 127
        exchange.inputs[index] = value
        exchange.collective = collective
        exchange.barrier.wait()
        return exchange.results[index]

    _FLOATS = {"f16": np.float16, "bf16": ptx._BF16}

    def _as_float(bits, ab):
        return np.asarray(bits, dtype=np.uint16).view(_FLOATS[ab]).astype(np.float64)

    def _register_a(inputs, ab):
        """A (64 x 16) from each warp's mma.sync A fragments."""
        a = np.zeros((64, 16))
        for thread, (_, frag, _) in enumerate(inputs):
            w, g, t = thread >> 5, (thread & 31) >> 2, thread & 3
            for reg, (row, col) in enumerate(((0, 0), (8, 0), (0, 8), (8, 8))):
                word = int(frag[reg])
                for half in range(2):
                    bits = (word >> 16 * half) & 0xFFFF
                    a[16 * w + g + row, col + 2 * t + half] = _as_float(bits, ab)
        return a

    def wgmma(ab, n, a_in_registers=False, b_transposed=False, accumulate=True):
        _check_shape(ab, n)
        values = n // 2
        thread = np.arange(128)
        w, g, t = thread >> 5, (thread & 31) >> 2, thread & 3

        def collective(inputs):
            if a_in_registers:
                a = _register_a(inputs, ab)
            else:
                a = _as_float(inputs[0][1].read(64, 16, mn_major=False), ab)
            desc_b = inputs[0][2]
            if b_transposed:
                b = _as_float(desc_b.read(16, n, mn_major=True), ab)  # K x N
            else:
                b = _as_float(desc_b.read(n, 16, mn_major=False), ab).T
            d = a @ b  # products of 16-bit floats are exact; one rounding to fp32 below
            if accumulate:
                acc = np.array([x[0] for x in inputs], dtype=np.float64)  # (128, values)
            else:  # scale-d 0: the registers' old bits are never read (they may be a NaN
                # whose cast numpy reports as an invalid value)
                acc = np.zeros((128, values))
            i, r = np.arange(values) >> 2, np.arange(values) & 3
            rows = (16 * w + g)[:, None] + 8 * (r >> 1)[None, :]
            cols = 8 * i[None, :] + (2 * t)[:, None] + (r & 1)[None, :]
            out = (acc + d[rows, cols]).astype(np.float32)
            return [tuple(row) for row in out]

        def mma_async(acc, a, desc_b):
            return _group_collective(collective, (acc, a, desc_b))

        return mma_async

    def wgmma_update(ab, n, a_in_registers=False, b_transposed=False, accumulate=True):
        mma = wgmma(ab, n, a_in_registers, b_transposed, accumulate)

        def mma_async(acc, a, desc_b):
            acc[:] = mma(tuple(acc), a, desc_b)

        return mma_async

    def fence_operands(acc, count):
        pass

    def quotient32(a, b):
        return int(a) // int(b)

    class _Barrier:
        """One simulated barrier: arrivals counted toward ``count``, phases numbered."""

        def __init__(self, count=0):
            self.count = count
            self.arrived = 0
            self.tx = 0  # bytes of asynchronous copies expected and not yet landed
            self.phase = 0
            self.changed = threading.Condition()

        def arrive(self, count=None, expect_bytes=0):
            with self.changed:
                self.arrived += 1
                self.tx += expect_bytes
                self._complete_if_done(count)
                return self.phase

        def complete_tx(self, nbytes):
            """``nbytes`` of an asynchronous copy have landed."""
            with self.changed:
                self.tx -= nbytes
                self._complete_if_done()

        def _complete_if_done(self, count=None):
            if self.arrived == (count or self.count) and self.tx == 0:
                self.arrived = 0
                self.phase += 1
                self.changed.notify_all()

        def wait_past(self, phase):
            with self.changed:
                if not self.changed.wait_for(lambda: self.phase > phase, timeout=600):
                    raise RuntimeError("a simulated barrier waited 600 s: the kernel deadlocks")

    def _block_barrier(kind, key):
        """The simulated barrier ``key`` of this thread's block (created on first use)."""
        thread = threading.current_thread()
        with _lock:
            table = thread._manager.__dict__.setdefault("_numflash_barriers", {})
            name = (tuple(thread.blockIdx), kind, key)
            found = table.get(name)
            if found is None:
                found = table[name] = _Barrier()
        return found

    def _mbarrier(address):
        # keyed by where it is: each thread may hold its own view of the block's shared memory
        byte = address.array.ctypes.data + address.index * address.array.itemsize
        return _block_barrier("mbarrier", byte)

    def mbarrier_init(address, count):
        barrier = _mbarrier(address)
        barrier.count, barrier.arrived, barrier.tx, barrier.phase = int(count), 0, 0, 0

    def mbarrier_arrive(address):
        _mbarrier(address).arrive()

    def mbarrier_expect_tx(address, nbytes):
        _mbarrier(address).arrive(expect_bytes=int(nbytes))

    def cp_async_arrive(address):
        _mbarrier(address).arrive()  # the simulator's copies are complete when issued

    def mbarrier_wait(address, parity):
        barrier = _mbarrier(address)
        with barrier.changed:
            phase = barrier.phase
        if (phase & 1) == int(parity):  # that phase is the current one: wait for it to end
            barrier.wait_past(phase)

    def named_barrier_sync(index, count):
        barrier = _block_barrier("bar", int(index))
        with barrier.changed:
            phase = barrier.phase
        barrier.arrive(int(count))
        barrier.wait_past(phase)

    def named_barrier_arrive(index, count):
        _block_barrier("bar", int(index)).arrive(int(count))

    def warpgroup_barrier(index):
        named_barrier_sync(index, 128)

    def pair_barrier_sync(index):
        named_barrier_sync(index, 256)

    def pair_barrier_arrive(index):
        named_barrier_arrive(index, 256)

    def set_max_registers(count, increase):
        pass

    def reduce_add_pair(array, index, a, b):
        with _lock:  # other blocks' threads add to the same elements
            array[index] += np.float32(a)
            array[index + 1] += np.float32(b)

    def store_shared_pair(address, a, b):
        pair = np.array([a, b], dtype=np.float32).view(address.array.dtype)
        address.array[address.index : address.index + len(pair)] = pair

    def bulk_reduce_add(array, index, address, nbytes):
        words = int(nbytes) // address.array.itemsize
        source = address.array[address.index : address.index + words].view(np.float32)
        index = int(index)
        with _lock:  # the simulator's copies are complete when issued
            array[index : index + len(source)] += source

    def bulk_commit():
        pass

    def bulk_wait_read():
        pass

    def bulk_wait():
        pass

    fence_proxy_async_global = compiler_fence = _nothing

    def opaque(x):
        return x

    def _sixteen_bytes(array, index, name):
        i = int(index)
        assert i % 8 == 0, f"{name}: the element is not 16-byte aligned"
        assert 0 <= i and i + 8 <= len(array), f"{name}: elements {i}.. outside the array"
        return i

    def load_16(array, index):
        i = _sixteen_bytes(array, index, "load_16")
        return array[i : i + 8].copy()

    def store_16(array, index, words):
        i = _sixteen_bytes(array, index, "store_16")
        array[i : i + 8] = words


else:
    from llvmlite import ir
    from numba.cuda import types
    from numba.cuda.extending import intrinsic

    _F32 = ir.FloatType()

    @device_function
    def matrix_descriptor(address, leading_bytes, stride_bytes, swizzle):
        """The 64-bit shared-memory matrix descriptor of the operand at shared byte ``address``
        (a multiple of 16), core matrices ``leading_bytes`` apart in K and ``stride_bytes``
        apart in M or N (for the swizzled layouts: module docstring)."""
        return (
            uint64((address >> 4) & 0x3FFF)
            | (uint64((leading_bytes >> 4) & 0x3FFF) << uint64(16))
            | (uint64((stride_bytes >> 4) & 0x3FFF) << uint64(32))
            | (uint64(swizzle & 3) << uint64(62))
        )

    @device_function
    def aligned_index(smem, alignment):
        """The index of the first element of the shared array ``smem`` (uint16) whose address
        is a multiple of ``alignment`` bytes (a power of two; 1024 for the 128-byte swizzle)."""
        raw = ptx.shared_address(smem, 0)
        aligned = (raw + uint32(alignment - 1)) & ~uint32(alignment - 1)
        return (aligned - raw) >> uint32(1)

    def _statement(asm):
        """An intrinsic without operands that emits ``asm`` with a memory clobber."""

        @intrinsic
        def statement(typingctx):
            sig = types.void()

            def codegen(context, builder, sig, args):
                fnty = ir.FunctionType(ir.VoidType(), [])
                builder.asm(fnty, asm, "~{memory}", [], True)
                return context.get_dummy_value()

            return sig, codegen

        return statement

    wgmma_fence = _statement("wgmma.fence.sync.aligned;")
    wgmma_commit = _statement("wgmma.commit_group.sync.aligned;")
    fence_proxy_async = _statement("fence.proxy.async.shared::cta;")
    bulk_commit = _statement("cp.async.bulk.commit_group;")
    bulk_wait_read = _statement("cp.async.bulk.wait_group.read 0;")
    bulk_wait = _statement("cp.async.bulk.wait_group 0;")
    fence_proxy_async_global = _statement("fence.proxy.async.global;")
    compiler_fence = _statement("")  # no instruction: memory operations stay on their side

    @intrinsic
    def opaque(typingctx, x):
        """``x`` (int32) through a register move the compiler cannot see through: a loop
        stepping by it has no trip count LLVM can work out, so it is not unrolled."""
        sig = types.int32(types.int32)

        def codegen(context, builder, sig, args):
            fnty = ir.FunctionType(ir.IntType(32), [ir.IntType(32)])
            return builder.asm(fnty, "mov.b32 $0, $1;", "=r,r", list(args), False)

        return sig, codegen

    _V4 = ir.VectorType(ir.IntType(32), 4)
    _WORDS = types.UniTuple(types.uint32, 4)

    def _global_v4(context, builder, array_type, array, index):
        """``array[index]``'s address as a global-space pointer to four 32-bit words."""
        pointer = ptx.element_pointer(context, builder, array_type, array, index)
        return builder.addrspacecast(builder.bitcast(pointer, _V4.as_pointer()),
                                     ir.PointerType(_V4, 1))  # fmt: skip

    @intrinsic
    def load_16(typingctx, array, index):
        """The 16 bytes at ``array[index]`` (a 16-bit array, the element 16-byte aligned) as
        four uint32, by one ld.global.v4.u32."""
        sig = _WORDS(array, types.int64)

        def codegen(context, builder, sig, args):
            vector = builder.load(_global_v4(context, builder, sig.args[0], *args), align=16)
            words = [builder.extract_element(vector, ir.Constant(ir.IntType(32), i))
                     for i in range(4)]  # fmt: skip
            return context.make_tuple(builder, _WORDS, words)

        return sig, codegen

    @intrinsic
    def store_16(typingctx, array, index, words):
        """Four uint32 (load_16's) into the 16 bytes at ``array[index]``, by one
        st.global.v4.u32."""
        sig = types.void(array, types.int64, _WORDS)

        def codegen(context, builder, sig, args):
            vector = ir.Constant(_V4, ir.Undefined)
            for i in range(4):
                word = builder.extract_value(args[2], i)
                vector = builder.insert_element(vector, word, ir.Constant(ir.IntType(32), i))
            pointer = _global_v4(context, builder, sig.args[0], args[0], args[1])
            builder.store(vector, pointer, align=16)
            return context.get_dummy_value()

        return sig, codegen

    @intrinsic
    def wgmma_wait(typingctx, pending):
        """Wait until at most ``pending`` (a compile-time constant) committed wgmma groups are
        in flight."""
        from numba.cuda.types import IntegerLiteral

        if not isinstance(pending, IntegerLiteral):
            return None
        count = pending.literal_value
        sig = types.void(pending)

        def codegen(context, builder, sig, args):
            fnty = ir.FunctionType(ir.VoidType(), [])
            builder.asm(fnty, f"wgmma.wait_group.sync.aligned {count};", "~{memory}", [], True)
            return context.get_dummy_value()

        return sig, codegen

    def _wgmma_asm(ab, n, a_in_registers, b_transposed):
        """(asm, constraints) of one m64nNk16: operands the n / 2 accumulators (outputs), A
        (four registers or a descriptor), B's descriptor, the scale-d flag, then the
        accumulators again as inputs tied to the outputs."""
        _check_shape(ab, n)
        values = n // 2
        regs = ", ".join(f"${i}" for i in range(values))
        a_count = 4 if a_in_registers else 1
        a_ops = list(range(values, values + a_count))
        b_op, scale_op = values + a_count, values + a_count + 1
        a_text = ", ".join(f"${i}" for i in a_ops)
        a_text = f"{{{a_text}}}" if a_in_registers else a_text
        # scale-a, scale-b 1; A (from shared memory only) not transposed; B as asked
        tnsp_b = int(b_transposed)
        immediates = f"1, 1, {tnsp_b}" if a_in_registers else f"1, 1, 0, {tnsp_b}"
        asm = (
            f"{{ .reg .pred p; setp.ne.b32 p, ${scale_op}, 0; "
            f"wgmma.mma_async.sync.aligned.m64n{n}k16.f32.{ab}.{ab} "
            f"{{{regs}}}, {a_text}, ${b_op}, p, {immediates}; }}"
        )
        constraints = ",".join(
            ["=f"] * values
            + ["r" if a_in_registers else "l"] * a_count
            + ["l", "r"]
            + [str(i) for i in range(values)]
            + ["~{memory}"]
        )
        return asm, constraints

    def _wgmma_operands(builder, a_in_registers, args, acc_in, accumulate=True):
        """The asm's inputs: A, B's descriptor, the scale-d flag (0: D = A B, the accumulators'
        values ignored), the accumulators."""
        a_in = (
            [builder.extract_value(args[1], i) for i in range(4)] if a_in_registers else [args[1]]
        )
        return a_in + [args[2], ir.Constant(ir.IntType(32), int(accumulate))] + acc_in

    def _emit(builder, asm, constraints, operands, count):
        """The inline asm with ``count`` fp32 outputs; their values."""
        fnty = ir.FunctionType(ir.LiteralStructType([_F32] * count), [x.type for x in operands])
        res = builder.asm(fnty, asm, constraints, operands, True)
        return [builder.extract_value(res, i) for i in range(count)]

    def _array_pointers(context, builder, array_type, array, count):
        """Pointers to elements 0..count-1 of a 1-D array."""
        index = [context.get_constant(types.intp, i) for i in range(count)]
        return [ptx.element_pointer(context, builder, array_type, array, i) for i in index]

    def _is_f32_vector(acc):
        return isinstance(acc, types.Array) and acc.ndim == 1 and acc.dtype == types.float32

    @intrinsic
    def quotient32(typingctx, a, b):
        """a // b for non-negative integers below 2^31, as one 32-bit unsigned division.

        Numba computes in 64 bits, and a 64-bit division by a value known only at run time
        is a call to a helper routine: ptxas then serialises every wgmma of the kernel
        (remark C7509, "presence of Extern calls")."""
        if not (isinstance(a, types.Integer) and isinstance(b, types.Integer)):
            return None
        sig = types.int64(a, b)

        def codegen(context, builder, sig, args):
            i32 = ir.IntType(32)
            x, y = (
                builder.trunc(v, i32)
                if v.type.width > 32
                else builder.zext(v, i32)
                if v.type.width < 32
                else v
                for v in args
            )
            return builder.zext(builder.udiv(x, y), ir.IntType(64))

        return sig, codegen

    def _void_asm(builder, asm, constraints, operands):
        fnty = ir.FunctionType(ir.VoidType(), [x.type for x in operands])
        builder.asm(fnty, asm, constraints, operands, True)

    #: The inline-asm constraint of each operand type the statements take.
    _CONSTRAINTS = {types.uint32: "r", types.uint64: "l"}

    def _operands_statement(asm, count, doc, operand_types=None):
        """An intrinsic of ``count`` (1 or 2) operands, $0 and $1, uint32 unless
        ``operand_types`` says otherwise (uint32 or uint64 each), that emits ``asm`` with a
        memory clobber."""
        operand_types = operand_types or (types.uint32,) * count
        constraints = ",".join([_CONSTRAINTS[t] for t in operand_types] + ["~{memory}"])

        def codegen(context, builder, sig, args):
            _void_asm(builder, asm, constraints, list(args))
            return context.get_dummy_value()

        if count == 1:

            @intrinsic
            def statement(typingctx, a):
                return types.void(*operand_types), codegen

        else:

            @intrinsic
            def statement(typingctx, a, b):
                return types.void(*operand_types), codegen

        statement.__doc__ = doc
        return statement

    warpgroup_barrier = _operands_statement(
        "bar.sync $0, 128;",
        1,
        "bar.sync on named barrier ``index`` (uint32, a run-time value) for 128 threads: one "
        "warpgroup's barrier, its number worked out from the warp (no branch between "
        "barriers: a branch ptxas cannot prove the warpgroup takes together made it serialise "
        "the kernel's wgmma, remark C7519).",
    )
    pair_barrier_sync = _operands_statement(
        "bar.sync $0, 256;",
        1,
        "bar.sync on named barrier ``index`` (uint32, a run-time value) for 256 threads: two "
        "warpgroups' barrier (warpgroup_barrier's reason for a run-time number).",
    )
    pair_barrier_arrive = _operands_statement(
        "bar.arrive $0, 256;",
        1,
        "bar.arrive on named barrier ``index`` (uint32, a run-time value) for 256 threads: "
        "counts this thread toward pair_barrier_sync's 256 without waiting.",
    )
    mbarrier_init = _operands_statement(
        "mbarrier.init.shared::cta.b64 [$0], $1;",
        2,
        "Initialise the mbarrier at shared ``address`` (uint32) to expect ``count`` arrivals "
        "(uint32) a phase.",
    )
    mbarrier_arrive = _operands_statement(
        "{ .reg .b64 state; mbarrier.arrive.shared::cta.b64 state, [$0]; }",
        1,
        "Arrive at the mbarrier at shared ``address`` (release: earlier writes first).",
    )
    mbarrier_expect_tx = _operands_statement(
        "mbarrier.arrive.expect_tx.shared::cta.b64 _, [$0], $1;",
        2,
        "Arrive at the mbarrier at shared ``address`` and add ``nbytes`` (uint32) to the bytes "
        "of asynchronous copies (TMA) its phase waits for besides the arrivals.",
    )
    cp_async_arrive = _operands_statement(
        "cp.async.mbarrier.arrive.noinc.shared::cta.b64 [$0];",
        1,
        "Arrive at the mbarrier at shared ``address`` once this thread's earlier cp.async "
        "copies have landed (.noinc: the arrival counts toward the expected count).",
    )
    # wait until the phase of parity $1 (0 or 1) of the mbarrier at shared address $0 has
    # completed (acquire); the label is local to the asm's braces
    mbarrier_wait = _operands_statement(
        "{ .reg .pred done; retry: mbarrier.try_wait.parity.shared::cta.b64 done, [$0], $1; "
        "@!done bra retry; }",
        2,
        "Wait until the phase of parity ``parity`` (0 or 1, uint32) of the mbarrier at shared "
        "``address`` has completed (acquire).",
    )

    def _literal_pair(first, second):
        from numba.cuda.types import IntegerLiteral

        if isinstance(first, IntegerLiteral) and isinstance(second, IntegerLiteral):
            return first.literal_value, second.literal_value
        return None

    def _named_barrier(op, doc):
        @intrinsic
        def named_barrier(typingctx, index, count):
            values = _literal_pair(index, count)
            if values is None:
                return None
            sig = types.void(index, count)

            def codegen(context, builder, sig, args):
                _void_asm(builder, "bar.{} {}, {};".format(op, *values), "~{memory}", [])
                return context.get_dummy_value()

            return sig, codegen

        named_barrier.__doc__ = doc
        return named_barrier

    named_barrier_sync = _named_barrier(
        "sync",
        "bar.sync ``index``, ``count`` (compile-time constants): wait until ``count`` "
        "threads, this one included, have arrived at named barrier ``index``.",
    )
    named_barrier_arrive = _named_barrier(
        "arrive",
        "bar.arrive ``index``, ``count`` (compile-time constants): count this thread toward "
        "named barrier ``index`` without waiting.",
    )

    @intrinsic
    def set_max_registers(typingctx, count, increase):
        """setmaxnreg: this warpgroup's registers a thread raised (``increase``) or lowered to
        ``count``; both compile-time constants."""
        from numba.cuda.types import BooleanLiteral, IntegerLiteral

        if not isinstance(count, IntegerLiteral) or not isinstance(increase, BooleanLiteral):
            return None
        n, op = count.literal_value, "inc" if increase.literal_value else "dec"
        if n % 8 or not 24 <= n <= 256:
            raise ValueError(f"setmaxnreg takes a multiple of 8 in [24, 256], not {n}")
        sig = types.void(count, increase)

        def codegen(context, builder, sig, args):
            _void_asm(builder, f"setmaxnreg.{op}.sync.aligned.u32 {n};", "~{memory}", [])
            return context.get_dummy_value()

        return sig, codegen

    def _global_f32_statement(asm, operand_types, doc):
        """An intrinsic ``(array, index, a, b)`` that emits ``asm`` with the global address of
        ``array[index]`` (a float32 array in global memory) as $0, then a and b (typed as
        ``operand_types``: float32 or uint32 each), with a memory clobber."""
        constraint = {types.float32: "f", types.uint32: "r"}
        constraints = ",".join(["l"] + [constraint[t] for t in operand_types] + ["~{memory}"])

        @intrinsic
        def statement(typingctx, array, index, a, b):
            if not (isinstance(array, types.Array) and array.dtype == types.float32):
                return None
            if not isinstance(index, types.Integer):
                return None
            sig = types.void(array, index, *operand_types)

            def codegen(context, builder, sig, args):
                pointer = ptx.element_pointer(context, builder, sig.args[0], args[0], args[1])
                operands = [ptx._global_address(builder, pointer), args[2], args[3]]
                _void_asm(builder, asm, constraints, operands)
                return context.get_dummy_value()

            return sig, codegen

        statement.__doc__ = doc
        return statement

    reduce_add_pair = _global_f32_statement(
        "red.global.add.v2.f32 [$0], {$1, $2};",
        (types.float32, types.float32),
        "array[index] += a and array[index + 1] += b, one ``red.global.add.v2.f32`` (sm_90): a "
        "float32 ``array`` in global memory, ``index`` even from an 8-byte aligned start, no "
        "value returned and no order among the adds of different threads.",
    )
    bulk_reduce_add = _global_f32_statement(
        "cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [$0], [$1], $2;",
        (types.uint32, types.uint32),
        "bulk_reduce_add(array, index, address, nbytes): array[index:index + nbytes / 4] += "
        "the fp32 values at shared byte ``address``, one asynchronous bulk reduction (module "
        "docstring): ``index`` 16-byte aligned, ``nbytes`` a multiple of 16.",
    )

    @intrinsic
    def store_shared_pair(typingctx, address, a, b):
        """Two fp32 values into shared memory at byte ``address`` (uint32, 8-byte aligned)
        with one st.shared.v2.f32."""
        if not isinstance(address, types.Integer):
            return None
        sig = types.void(types.uint32, types.float32, types.float32)

        def codegen(context, builder, sig, args):
            asm = "st.shared.v2.f32 [$0], {$1, $2};"
            _void_asm(builder, asm, "r,f,f,~{memory}", list(args))
            return context.get_dummy_value()

        return sig, codegen

    @functools.lru_cache(maxsize=None)
    def wgmma_update(ab, n, a_in_registers=False, b_transposed=False, accumulate=True):
        """``mma(acc, a, desc_b)``: as :func:`wgmma`, the accumulators in ``acc``, a float32
        local array of n / 2 values updated in place (indexed by constants only, so that
        they live in registers). Without ``accumulate``, acc = A B: what acc held is ignored
        (the first k16 step of a product, without zeroing the registers first)."""
        asm, constraints = _wgmma_asm(ab, n, a_in_registers, b_transposed)
        values = n // 2
        a_type = types.UniTuple(types.uint32, 4) if a_in_registers else types.uint64

        @intrinsic
        def mma_async(typingctx, acc, a, desc_b):
            if not _is_f32_vector(acc):
                return None
            sig = types.void(acc, a_type, types.uint64)

            def codegen(context, builder, sig, args):
                pointers = _array_pointers(context, builder, sig.args[0], args[0], values)
                acc_in = [builder.load(p) for p in pointers]
                operands = _wgmma_operands(builder, a_in_registers, args, acc_in, accumulate)
                for p, value in zip(pointers, _emit(builder, asm, constraints, operands, values)):
                    builder.store(value, p)
                return context.get_dummy_value()

            return sig, codegen

        return mma_async

    @intrinsic
    def fence_operands(typingctx, acc, count):
        """An empty asm statement that reads and writes the first ``count`` (a compile-time
        constant) values of the float32 or uint32 array ``acc``: ordinary code that uses the
        accumulators of wgmma stays after the ``wgmma_wait`` before it, and code that sets them
        (or the packed A fragments of a product) before the ``wgmma_fence`` after it (the
        compiler may not move them across)."""
        from numba.cuda.types import IntegerLiteral

        words = isinstance(acc, types.Array) and acc.ndim == 1 and acc.dtype == types.uint32
        if not (_is_f32_vector(acc) or words) or not isinstance(count, IntegerLiteral):
            return None
        sig = types.void(acc, count)
        count = count.literal_value
        element, constraint = (ir.IntType(32), "=r") if words else (_F32, "=f")

        def codegen(context, builder, sig, args):
            pointers = _array_pointers(context, builder, sig.args[0], args[0], count)
            constraints = ",".join([constraint] * count + [str(i) for i in range(count)])
            operands = [builder.load(p) for p in pointers]
            fnty = ir.FunctionType(ir.LiteralStructType([element] * count), [element] * count)
            res = builder.asm(fnty, "", constraints, operands, True)
            for i, p in enumerate(pointers):
                builder.store(builder.extract_value(res, i), p)
            return context.get_dummy_value()

        return sig, codegen

    @functools.lru_cache(maxsize=None)
    def wgmma(ab, n, a_in_registers=False, b_transposed=False):
        """The intrinsic ``acc = wgmma(acc, a, desc_b)`` for D (64 x n fp32, n / 2 values per
        thread, a UniTuple) += A (64 x 16) @ B (16 x n, descriptor ``desc_b``), ``ab`` "f16"
        or "bf16", n a multiple of 8 up to 256.

        A is a descriptor (uint64) of a K-major 64 x 16 operand, or with ``a_in_registers``
        four uint32 per thread: warp w's rows 16w..16w+15 as mma.sync's A fragment (ptx.py).
        B is stored n x 16 K-major, or with ``b_transposed`` 16 x n MN-major (n contiguous).
        Neither operand is scaled. The accumulators go in tied to the outputs.
        """
        asm, constraints = _wgmma_asm(ab, n, a_in_registers, b_transposed)
        values = n // 2
        rtype = types.UniTuple(types.float32, values)
        a_type = types.UniTuple(types.uint32, 4) if a_in_registers else types.uint64

        @intrinsic
        def mma_async(typingctx, acc, a, desc_b):
            if acc != rtype:
                return None
            sig = rtype(rtype, a_type, types.uint64)

            def codegen(context, builder, sig, args):
                acc_in = [builder.extract_value(args[0], i) for i in range(values)]
                operands = _wgmma_operands(builder, a_in_registers, args, acc_in)
                out = _emit(builder, asm, constraints, operands, values)
                return context.make_tuple(builder, rtype, out)

            return sig, codegen

        return mma_async
