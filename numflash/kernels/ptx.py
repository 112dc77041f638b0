"""Every inline-PTX instruction numflash uses, each beside its simulator fallback.

This is the only module that knows LLVM inline assembly. On a GPU each name below is a Numba
``@intrinsic`` that emits one PTX instruction through llvmlite's ``builder.asm``; in Numba's
CUDA simulator (``NUMBA_ENABLE_CUDASIM=1``) the same name is a Python function with the same
semantics, so the tensor-core kernels' own source runs on a machine without a GPU.

Conventions shared by the kernels:

- 16-bit floats (fp16 and bf16) travel as their bits: ``uint16`` in arrays, two of them packed
  in a ``uint32`` in mma fragments, the element with the lower index in the low half.
- Shared-memory operands are 32-bit byte addresses in the shared window, taken once with
  :func:`shared_address` and offset by constants (which ptxas folds into the instruction).
- Global operands are a flat ``uint16`` array and an element index (int64).
- Warp-collective instructions (mma, ldmatrix, shuffles) must be reached by all 32 lanes of a
  warp together, as on the hardware; the simulator exchanges lane values through a per-warp
  barrier to compute the same result.

Fragment layouts (PTX ISA, "Matrix fragments for mma.m16n8k16"), with ``g = lane >> 2`` and
``t = lane & 3``:

- A (16 x 16, row-major), 4 regs: (row g, cols 2t..2t+1), (row g+8, same cols),
  (row g, cols 8+2t..), (row g+8, cols 8+2t..).
- B (16 x 8, k x n), 2 regs: (k 2t..2t+1, col g), (k 8+2t.., col g).
- C/D (16 x 8, fp32), 4 values: (row g, cols 2t, 2t+1), (row g+8, cols 2t, 2t+1).
"""

import threading

import numpy as np
from numba import cuda

from .jit import SIMULATOR, device_function

__all__ = [
    "shared_address",
    "mma_f16",
    "mma_bf16",
    "ldmatrix_x4",
    "ldmatrix_x4_trans",
    "cp_async_16",
    "cp_async_commit",
    "cp_async_wait",
    "exp2",
    "exp2_fma",
    "fma",
    "pack_f16x2",
    "pack_bf16x2",
    "shfl_xor",
    "shfl_index",
    "f16_to_f32",
    "bf16_to_f32",
    "f32_to_f16",
    "f32_to_bf16",
]

#: 2**f on [0, 1) as 1 + f (C1 + f (C2 + f C3)), a cubic fitted here to the least maximum
#: relative error (8.6e-5, about 2^-13.5: below a 16-bit probability's rounding) by Lawson's
#: iteration over 20,001 points; p(0) = 1 exactly, p(1) = 1.99983. Used by exp2_fma.
EXP2_CUBIC = (np.float32(0.69511634), np.float32(0.227647), np.float32(0.0770652))


def _f32_hex(x):
    """PTX's spelling of a float32 constant (0fXXXXXXXX)."""
    return "0f%08X" % int(np.float32(x).view(np.uint32))


if not SIMULATOR:
    from llvmlite import ir
    from numba.cuda import cgutils, types
    from numba.cuda.extending import intrinsic

    _I16 = ir.IntType(16)
    _I32 = ir.IntType(32)
    _I64 = ir.IntType(64)
    _F32 = ir.FloatType()

    def _asm(builder, out_types, asm, constraints, args, side_effect):
        """Emit one inline-asm statement; several outputs come back as an LLVM struct."""
        if not out_types:
            ret = ir.VoidType()
        elif len(out_types) == 1:
            ret = out_types[0]
        else:
            ret = ir.LiteralStructType(out_types)
        fnty = ir.FunctionType(ret, [a.type for a in args])
        return builder.asm(fnty, asm, constraints, args, side_effect)

    def _as_tuple(context, builder, tuple_type, struct, count):
        values = [builder.extract_value(struct, i) for i in range(count)]
        return context.make_tuple(builder, tuple_type, values)

    def element_pointer(context, builder, array_type, array, index):
        ary = context.make_array(array_type)(context, builder, array)
        return cgutils.get_item_pointer(context, builder, array_type, ary, [index])

    def _shared_address(builder, pointer):
        """The 32-bit shared-window address that ldmatrix and cp.async take."""
        shared = builder.addrspacecast(pointer, ir.PointerType(pointer.type.pointee, 3))
        return builder.trunc(builder.ptrtoint(shared, _I64), _I32)

    def _global_address(builder, pointer):
        glob = builder.addrspacecast(pointer, ir.PointerType(pointer.type.pointee, 1))
        return builder.ptrtoint(glob, _I64)

    # -- tensor cores -------------------------------------------------------------------------

    def _make_mma(ab):
        # D (16x8 f32) = A (16x16 ab, row) @ B (16x8 ab, col) + C; operands $4..$7 A, $8..$9 B.
        asm = (
            f"mma.sync.aligned.m16n8k16.row.col.f32.{ab}.{ab}.f32 "
            "{$0, $1, $2, $3}, {$4, $5, $6, $7}, {$8, $9}, {$10, $11, $12, $13};"
        )
        constraints = "=f,=f,=f,=f," + ",".join(["r"] * 6 + ["f"] * 4)

        @intrinsic
        def mma(typingctx, a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
            rtype = types.UniTuple(types.float32, 4)
            sig = rtype(*([types.uint32] * 6 + [types.float32] * 4))

            def codegen(context, builder, sig, args):
                res = _asm(builder, [_F32] * 4, asm, constraints, list(args), False)
                return _as_tuple(context, builder, rtype, res, 4)

            return sig, codegen

        return mma

    mma_f16 = _make_mma("f16")
    mma_bf16 = _make_mma("bf16")

    @intrinsic
    def shared_address(typingctx, smem, index):
        """The 32-bit shared-window byte address of ``smem[index]`` (a shared array)."""
        sig = types.uint32(smem, types.intp)

        def codegen(context, builder, sig, args):
            ptr = element_pointer(context, builder, sig.args[0], args[0], args[1])
            return _shared_address(builder, ptr)

        return sig, codegen

    def _make_ldmatrix(trans):
        # Four 8x8 b16 matrices; lanes 8i..8i+7 give the row addresses of matrix i, and each
        # lane receives (row lane>>2, cols 2*(lane&3)..+1) of every matrix (of its transpose
        # with .trans). The address is ``base + offset`` bytes, added in 32 bits here.
        suffix = ".trans" if trans else ""
        asm = f"ldmatrix.sync.aligned.m8n8.x4{suffix}.shared.b16 {{$0, $1, $2, $3}}, [$4];"

        @intrinsic
        def ldmatrix(typingctx, base, offset):
            rtype = types.UniTuple(types.uint32, 4)
            sig = rtype(types.uint32, types.uint32)

            def codegen(context, builder, sig, args):
                addr = builder.add(args[0], args[1])
                res = _asm(builder, [_I32] * 4, asm, "=r,=r,=r,=r,r,~{memory}", [addr], True)
                return _as_tuple(context, builder, rtype, res, 4)

            return sig, codegen

        return ldmatrix

    ldmatrix_x4 = _make_ldmatrix(False)
    ldmatrix_x4_trans = _make_ldmatrix(True)

    # -- asynchronous copies global -> shared (sm_80+) ------------------------------------------

    @intrinsic
    def cp_async_16(typingctx, dst, gmem, gmem_index, src_bytes):
        """Copy 16 bytes from ``gmem[gmem_index]`` to shared address ``dst``; only the first
        ``src_bytes`` (0 or 16) are read, the rest zero-filled."""
        sig = types.void(types.uint32, gmem, types.int64, types.uint32)

        def codegen(context, builder, sig, args):
            src = element_pointer(context, builder, sig.args[1], args[1], args[2])
            operands = [args[0], _global_address(builder, src), args[3]]
            _asm(
                builder,
                [],
                "cp.async.cg.shared.global [$0], [$1], 16, $2;",
                "r,l,r,~{memory}",
                operands,
                True,
            )
            return context.get_dummy_value()

        return sig, codegen

    @intrinsic
    def store_pair(typingctx, array, index, value):
        """``value``'s low and high 16 bits into ``array[index]`` and ``array[index + 1]`` (a
        16-bit array, the element 4-byte aligned) as one 32-bit store."""
        sig = types.void(array, types.int64, types.uint32)

        def codegen(context, builder, sig, args):
            pointer = element_pointer(context, builder, sig.args[0], args[0], args[1])
            builder.store(args[2], builder.bitcast(pointer, _I32.as_pointer()), align=4)
            return context.get_dummy_value()

        return sig, codegen

    @intrinsic
    def cp_async_commit(typingctx):
        sig = types.void()

        def codegen(context, builder, sig, args):
            _asm(builder, [], "cp.async.commit_group;", "~{memory}", [], True)
            return context.get_dummy_value()

        return sig, codegen

    @intrinsic
    def cp_async_wait(typingctx, pending):
        """Wait until at most ``pending`` (a compile-time constant) committed groups are in flight."""
        if not isinstance(pending, types.IntegerLiteral):
            return None
        count = pending.literal_value
        sig = types.void(pending)

        def codegen(context, builder, sig, args):
            _asm(builder, [], f"cp.async.wait_group {count};", "~{memory}", [], True)
            return context.get_dummy_value()

        return sig, codegen

    @intrinsic
    def fence_acq_rel_gpu(typingctx):
        """fence.acq_rel.gpu: with a later atomic, releases this thread's (and, after a
        barrier, its block's) earlier writes; after an atomic, acquires what it saw released."""
        sig = types.void()

        def codegen(context, builder, sig, args):
            _asm(builder, [], "fence.acq_rel.gpu;", "~{memory}", [], True)
            return context.get_dummy_value()

        return sig, codegen

    # -- arithmetic and conversions -------------------------------------------------------------

    def _unary_f32(name, instruction, doc, float32_only=False):
        """The intrinsic ``name(x) -> float32`` that runs the one PTX ``instruction`` on x
        (``float32_only``: typed for a float32 argument alone, else x is converted)."""

        def typer(typingctx, x):
            if float32_only and x != types.float32:
                return None
            sig = types.float32(types.float32)

            def codegen(context, builder, sig, args):
                return _asm(builder, [_F32], f"{instruction} $0, $1;", "=f,f", list(args), False)

            return sig, codegen

        typer.__name__ = typer.__qualname__ = name
        typer.__doc__ = doc
        return intrinsic(typer)

    exp2 = _unary_f32(
        "exp2", "ex2.approx.ftz.f32", "2**x with the special-function unit (2 ulp); -inf gives +0."
    )
    # exp2_fma: the exponent n = floor(x) read from the low bits of x + 1.5 * 2**23 rounded
    # down (exact for |n| <= 127), 2**(x - n) by the cubic, then times 2**n built as bits:
    # (n << 23) + the bits of 1.0. x is first clamped to -127 by max.NaN, which passes a NaN
    # through (the cubic's result is then NaN, and stays so in the product); at -127 and
    # below those bits are 0, so -inf gives +0 as ex2 does.
    _EXP2_FMA = (
        "{ .reg .f32 c, r, n, f, p; .reg .b32 e; "
        "max.NaN.ftz.f32 c, $1, 0fC2FE0000; "
        "add.rm.ftz.f32 r, c, 0f4B400000; "
        "sub.ftz.f32 n, r, 0f4B400000; "
        "sub.ftz.f32 f, c, n; "
        f"fma.rn.ftz.f32 p, f, {_f32_hex(EXP2_CUBIC[2])}, {_f32_hex(EXP2_CUBIC[1])}; "
        f"fma.rn.ftz.f32 p, p, f, {_f32_hex(EXP2_CUBIC[0])}; "
        "fma.rn.ftz.f32 p, p, f, 0f3F800000; "
        "mov.b32 e, r; shl.b32 e, e, 23; add.s32 e, e, 1065353216; mov.b32 n, e; "
        "mul.ftz.f32 $0, p, n; }"
    )

    @intrinsic
    def exp2_fma(typingctx, x):
        """2**x (x <= 127) on the FMA and integer units, not the special-function unit: a
        cubic on x's fraction (EXP2_CUBIC, relative error 8.6e-5) scaled by 2**floor(x);
        -inf gives +0 and NaN NaN, as :func:`exp2`. Nine SASS instructions on sm_90a (ptxas
        fuses the shift and the add) against ex2's one, for kernels whose special-function
        unit is their bound (sm_80+: max.NaN)."""
        if x != types.float32:
            return None
        sig = types.float32(types.float32)

        def codegen(context, builder, sig, args):
            return _asm(builder, [_F32], _EXP2_FMA, "=f,f", list(args), False)

        return sig, codegen

    reciprocal = _unary_f32(
        "reciprocal",
        "rcp.approx.ftz.f32",
        """1 / x (rcp.approx, within 1 ulp; 0 gives inf, NaN NaN). The IEEE-rounded reciprocal
        that ``1 / x`` compiles to is a subroutine call in SASS, which serialises every wgmma of
        a Hopper kernel (remark C7509, as ptx_sm90.quotient32 says).""",
        float32_only=True,
    )
    tanh = _unary_f32(
        "tanh",
        "tanh.approx.f32",
        """tanh(x) with the special-function unit (sm_75+; maximum relative error about
        2^-11): for scores headed for 16-bit probabilities, not for float32 results.""",
    )

    @intrinsic
    def fma(typingctx, a, b, c):
        """a * b + c, rounded once."""
        sig = types.float32(types.float32, types.float32, types.float32)

        def codegen(context, builder, sig, args):
            return _asm(
                builder, [_F32], "fma.rn.f32 $0, $1, $2, $3;", "=f,f,f,f", list(args), False
            )

        return sig, codegen

    def _make_pack(ab):
        # cvt.rn.{ab}x2.f32 d, a, b puts a in the high half: pass (hi, lo).
        asm = f"cvt.rn.{ab}x2.f32 $0, $1, $2;"

        @intrinsic
        def pack(typingctx, lo, hi):
            sig = types.uint32(types.float32, types.float32)

            def codegen(context, builder, sig, args):
                return _asm(builder, [_I32], asm, "=r,f,f", [args[1], args[0]], False)

            return sig, codegen

        return pack

    pack_f16x2 = _make_pack("f16")
    pack_bf16x2 = _make_pack("bf16")

    @device_function
    def shfl_xor(x, lane_mask):
        """The value of ``x`` held by lane ``lane ^ lane_mask``, all 32 lanes taking part."""
        return cuda.shfl_xor_sync(0xFFFFFFFF, x, lane_mask)

    @device_function
    def shfl_index(x, source):
        """The value of ``x`` held by lane ``source``, all 32 lanes taking part."""
        return cuda.shfl_sync(0xFFFFFFFF, x, source)

    @device_function
    def sync_warp():
        """__syncwarp over all 32 lanes: what each lane wrote to shared memory before is seen
        by every lane after."""
        cuda.syncwarp(0xFFFFFFFF)

    @device_function
    def any_lane(predicate):
        """Whether ``predicate`` holds in any lane, all 32 lanes taking part: one answer for
        the warp, which ptxas knows, so a branch on it is uniform (no lane takes the other
        side, and warp-wide steps inside need no code for lanes that went apart)."""
        return cuda.any_sync(0xFFFFFFFF, predicate)

    @intrinsic
    def f16_to_f32(typingctx, bits):
        sig = types.float32(types.uint16)

        def codegen(context, builder, sig, args):
            return _asm(builder, [_F32], "cvt.f32.f16 $0, $1;", "=f,h", list(args), False)

        return sig, codegen

    @intrinsic
    def f32_to_f16(typingctx, x):
        """Round to nearest even; overflow gives +-inf as IEEE says."""
        sig = types.uint16(types.float32)

        def codegen(context, builder, sig, args):
            return _asm(builder, [_I16], "cvt.rn.f16.f32 $0, $1;", "=h,f", list(args), False)

        return sig, codegen

    @intrinsic
    def _bits_to_f32(typingctx, bits):
        sig = types.float32(types.uint32)

        def codegen(context, builder, sig, args):
            return builder.bitcast(args[0], _F32)

        return sig, codegen

    @intrinsic
    def _f32_to_bits(typingctx, x):
        sig = types.uint32(types.float32)

        def codegen(context, builder, sig, args):
            return builder.bitcast(args[0], _I32)

        return sig, codegen

    # bf16 is the top half of an fp32, so both conversions are integer arithmetic that any GPU
    # runs (cvt with .bf16 needs sm_80); the portable kernel relies on that.

    @device_function
    def bf16_to_f32(bits):
        return _bits_to_f32(types.uint32(bits) << types.uint32(16))

    @device_function
    def f32_to_bf16(x):
        """Round to nearest even, NaN kept a (quiet) NaN."""
        b = _f32_to_bits(x)
        if (b & types.uint32(0x7FFFFFFF)) > types.uint32(0x7F800000):
            return types.uint16((b >> types.uint32(16)) | types.uint32(0x40))
        rounding = types.uint32(0x7FFF) + ((b >> types.uint32(16)) & types.uint32(1))
        return types.uint16((b + rounding) >> types.uint32(16))

else:
    import ml_dtypes

    _BF16 = np.dtype(ml_dtypes.bfloat16)
    _registry_lock = threading.Lock()

    class _WarpExchange:
        """The simulator's stand-in for a warp's register network.

        Each lane deposits its operands and waits at one barrier; the barrier's action runs the
        collective once for the whole warp, and each lane picks up its own result. A lane cannot
        start the next collective's action before every lane has left this one, so one barrier
        per collective is enough.
        """

        def __init__(self):
            self.inputs = [None] * 32
            self.results = None
            self.collective = None
            self.barrier = threading.Barrier(32, action=self._run, timeout=600)

        def _run(self):
            self.results = self.collective(self.inputs)

    def _exchange():
        thread = threading.current_thread()
        key = (tuple(thread.blockIdx), thread.thread_id >> 5)
        with _registry_lock:
            table = thread._manager.__dict__.setdefault("_numflash_warps", {})
            exchange = table.get(key)
            if exchange is None:
                exchange = table[key] = _WarpExchange()
        return thread.thread_id & 31, exchange

    def _warp_collective(collective, value):
        """Run ``collective`` (32 lane inputs -> 32 lane results) as one warp-wide step."""
        lane, exchange = _exchange()
        exchange.inputs[lane] = value
        exchange.collective = collective
        exchange.barrier.wait()
        return exchange.results[lane]

    def _halves(words, dtype):
        """uint32 words (n,) -> their (lo, hi) 16-bit floats as float64 (n, 2)."""
        words = np.ascontiguousarray(words, dtype=np.uint32)
        return words.view(np.uint16).reshape(-1, 2).view(dtype).astype(np.float64)

    def _make_mma(dtype):
        def collective(inputs):
            regs = np.array([lane[:6] for lane in inputs], dtype=np.uint32)  # (32, 6)
            acc = np.array([lane[6:] for lane in inputs], dtype=np.float64)  # (32, 4)
            lane = np.arange(32)
            g, t = lane >> 2, lane & 3
            a = np.zeros((16, 16))
            b = np.zeros((16, 8))
            for reg, (row, col) in enumerate(((0, 0), (8, 0), (0, 8), (8, 8))):
                pair = _halves(regs[:, reg], dtype)
                a[g + row, col + 2 * t] = pair[:, 0]
                a[g + row, col + 2 * t + 1] = pair[:, 1]
            for reg, k0 in ((4, 0), (5, 8)):
                pair = _halves(regs[:, reg], dtype)
                b[k0 + 2 * t, g] = pair[:, 0]
                b[k0 + 2 * t + 1, g] = pair[:, 1]
            # Products of 16-bit floats are exact; accumulate in fp64 and round once to fp32.
            d = a @ b
            out = np.stack([d[g, 2 * t], d[g, 2 * t + 1], d[g + 8, 2 * t], d[g + 8, 2 * t + 1]], 1)
            return [tuple(np.float32(x) for x in row) for row in out + acc]

        def mma(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
            return _warp_collective(collective, (a0, a1, a2, a3, b0, b1, c0, c1, c2, c3))

        return mma

    mma_f16 = _make_mma(np.float16)
    mma_bf16 = _make_mma(_BF16)

    class _SharedAddress:
        """A shared-memory byte address in the simulator: the array and an element index."""

        def __init__(self, array, index):
            self.array = array
            self.index = index

        def __add__(self, byte_offset):
            byte_offset = int(byte_offset)
            assert byte_offset % 2 == 0, "uint16 shared memory is addressed in 2-byte steps"
            return _SharedAddress(self.array, self.index + byte_offset // 2)

        __radd__ = __add__

    def shared_address(smem, index):
        return _SharedAddress(smem, int(index))

    def _make_ldmatrix(trans):
        def collective(inputs):
            # Matrix m's rows come from the addresses of lanes 8m..8m+7.
            mats = [
                np.stack([a.array[a.index : a.index + 8] for a in inputs[8 * m : 8 * m + 8]])
                for m in range(4)
            ]
            if trans:
                mats = [mat.T for mat in mats]
            results = []
            for lane in range(32):
                g, t = lane >> 2, lane & 3
                results.append(
                    tuple(
                        np.uint32(int(mat[g, 2 * t]) | (int(mat[g, 2 * t + 1]) << 16))
                        for mat in mats
                    )
                )
            return results

        def ldmatrix(base, offset):
            return _warp_collective(collective, base + offset)

        return ldmatrix

    ldmatrix_x4 = _make_ldmatrix(False)
    ldmatrix_x4_trans = _make_ldmatrix(True)

    def cp_async_16(dst, gmem, gmem_index, src_bytes):
        # The simulator copies at once; wait_group then has nothing left to wait for.
        gi = int(gmem_index)
        if int(src_bytes) == 0:
            dst.array[dst.index : dst.index + 8] = 0
        else:
            dst.array[dst.index : dst.index + 8] = gmem[gi : gi + 8]

    def store_pair(array, index, value):
        i = int(index)
        assert i % 2 == 0, "store_pair: an odd index is not 4-byte aligned"
        array[i] = np.uint16(int(value) & 0xFFFF)
        array[i + 1] = np.uint16(int(value) >> 16)

    def cp_async_commit():
        pass

    def cp_async_wait(pending):
        pass

    def fence_acq_rel_gpu():
        pass  # the simulator's threads share memory coherently

    def exp2(x):
        with np.errstate(over="ignore"):
            return np.float32(np.exp2(np.float32(x)))

    def exp2_fma(x):
        x = np.float32(x)
        if np.isnan(x):
            return x
        c = max(x, np.float32(-127.0))
        n = np.floor(c)
        f = np.float32(c - n)
        c1, c2, c3 = EXP2_CUBIC
        p = np.float32(np.float32(np.float32(c3 * f + c2) * f + c1) * f + np.float32(1.0))
        scale = np.float32(0.0) if n <= -127 else np.float32(np.ldexp(np.float32(1.0), int(n)))
        with np.errstate(over="ignore"):
            return np.float32(p * scale)

    def tanh(x):
        return np.float32(np.tanh(np.float32(x)))

    def reciprocal(x):
        with np.errstate(divide="ignore"):
            return np.float32(np.float32(1.0) / np.float32(x))

    def fma(a, b, c):
        # The fp32 product is exact in fp64, so this rounds (nearly always) as fma does.
        return np.float32(float(a) * float(b) + float(c))

    def _pack(lo, hi, dtype):
        with np.errstate(over="ignore"):
            bits = np.array([lo, hi], dtype=np.float32).astype(dtype).view(np.uint16)
        return np.uint32(int(bits[0]) | (int(bits[1]) << 16))

    def pack_f16x2(lo, hi):
        return _pack(lo, hi, np.float16)

    def pack_bf16x2(lo, hi):
        return _pack(lo, hi, _BF16)

    def _shfl_xor_collective(inputs):
        return [inputs[lane ^ int(inputs[lane][1])][0] for lane in range(32)]

    def shfl_xor(x, lane_mask):
        return _warp_collective(_shfl_xor_collective, (x, lane_mask))

    def _shfl_index_collective(inputs):
        return [inputs[int(inputs[lane][1]) & 31][0] for lane in range(32)]

    def shfl_index(x, source):
        return _warp_collective(_shfl_index_collective, (x, source))

    def _any_lane_collective(inputs):
        return [any(bool(value) for value in inputs)] * 32

    def any_lane(predicate):
        return _warp_collective(_any_lane_collective, bool(predicate))

    def _sync_collective(inputs):
        return [None] * 32

    def sync_warp():
        _warp_collective(_sync_collective, None)

    def f16_to_f32(bits):
        return np.float32(np.uint16(bits).view(np.float16))

    def bf16_to_f32(bits):
        return np.float32(np.uint16(bits).view(_BF16))

    def f32_to_f16(x):
        with np.errstate(over="ignore"):
            return np.float16(np.float32(x)).view(np.uint16)

    def f32_to_bf16(x):
        return np.array(np.float32(x)).astype(_BF16).view(np.uint16)[()]
