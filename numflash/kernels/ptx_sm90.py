"""Hopper-only inline PTX (sm_90a): warpgroup matrix multiply (wgmma) and its fences.

Groundwork for the backward's next design (benchmarks/NOTES.md, "Where that leaves issue 5"):
wgmma reads both operands from shared memory through 64-bit descriptors and accumulates
asynchronously, which frees the fragment registers that limit the mma.sync kernels. Nothing in
the library calls it yet; ``tests/wgmma_gemm.py`` multiplies tiles with it (both operands from
shared memory, without and with the 128-byte swizzle; A from registers), compiled for sm_90a
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
- The fp32 accumulator of ``m64nNk16`` (N / 2 values per thread): warp w of the group holds
  rows 16w..16w+15 laid out as mma.sync's C fragment, repeated for each 8 columns: value
  4i + r of lane (g = lane >> 2, t = lane & 3) is row 16w + g + 8 (r >> 1), column
  8i + 2t + (r & 1).
- Shared memory written by ordinary stores must be made visible to the async proxy
  (``fence.proxy.async.shared::cta``) and the threads synchronised before wgmma reads it;
  ``wgmma.fence`` orders the accumulator registers before the first wgmma of a group;
  ``commit_group`` / ``wait_group N`` wait for the products to land in the registers.

In Numba's CUDA simulator these names raise NotImplementedError: wgmma kernels need an sm_90a
GPU.
"""

import functools

from numba import uint64

from .jit import SIMULATOR, device_function

__all__ = [
    "matrix_descriptor",
    "wgmma_fence",
    "wgmma_commit",
    "wgmma_wait",
    "fence_proxy_async",
    "wgmma",
]

#: swizzle field values of the descriptor
SWIZZLE_NONE, SWIZZLE_128B, SWIZZLE_64B, SWIZZLE_32B = 0, 1, 2, 3


@device_function
def matrix_descriptor(address, leading_bytes, stride_bytes, swizzle):
    """The 64-bit shared-memory matrix descriptor of the operand at shared byte ``address``
    (a multiple of 16), core matrices ``leading_bytes`` apart in K and ``stride_bytes`` apart
    in M or N."""
    return (
        uint64((address >> 4) & 0x3FFF)
        | (uint64((leading_bytes >> 4) & 0x3FFF) << uint64(16))
        | (uint64((stride_bytes >> 4) & 0x3FFF) << uint64(32))
        | (uint64(swizzle & 3) << uint64(62))
    )


def _check_shape(ab, n):
    if ab not in ("f16", "bf16") or n % 8 or not 8 <= n <= 256:
        raise ValueError(f"wgmma: no m64n{n}k16 for {ab!r} (f16 or bf16, n = 8, 16, ..., 256)")


if SIMULATOR:

    def _needs_gpu(*args):
        raise NotImplementedError("wgmma needs an sm_90a GPU; the CUDA simulator cannot run it")

    wgmma_fence = wgmma_commit = wgmma_wait = fence_proxy_async = _needs_gpu

    def wgmma(ab, n, a_in_registers=False):
        _check_shape(ab, n)
        return _needs_gpu

else:
    from llvmlite import ir
    from numba.cuda import types
    from numba.cuda.extending import intrinsic

    _F32 = ir.FloatType()

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

    @functools.lru_cache(maxsize=None)
    def wgmma(ab, n, a_in_registers=False):
        """The intrinsic ``acc = wgmma(acc, a, desc_b)`` for D (64 x n fp32, n / 2 values per
        thread, a UniTuple) += A (64 x 16) @ B (16 x n, stored n x 16 K-major, descriptor
        ``desc_b``), ``ab`` "f16" or "bf16", n a multiple of 8 up to 256.

        A is a descriptor (uint64) of a K-major 64 x 16 operand, or with ``a_in_registers``
        four uint32 per thread: warp w's rows 16w..16w+15 as mma.sync's A fragment (ptx.py).
        Neither operand is scaled or transposed. The accumulators go in tied to the outputs.
        """
        _check_shape(ab, n)
        values = n // 2
        regs = ", ".join(f"${i}" for i in range(values))
        a_count = 4 if a_in_registers else 1
        a_ops = list(range(values, values + a_count))
        b_op, scale_op = values + a_count, values + a_count + 1
        a_text = ", ".join(f"${i}" for i in a_ops)
        a_text = f"{{{a_text}}}" if a_in_registers else a_text
        # scale-a, scale-b 1; A (from shared memory only) and B not transposed
        immediates = "1, 1, 0" if a_in_registers else "1, 1, 0, 0"
        asm = (
            f"{{ .reg .pred p; setp.ne.b32 p, ${scale_op}, 0; "
            f"wgmma.mma_async.sync.aligned.m64n{n}k16.f32.{ab}.{ab} "
            f"{{{regs}}}, {a_text}, ${b_op}, p, {immediates}; }}"
        )
        constraints = ",".join(["=f"] * values + ["r" if a_in_registers else "l"] * a_count
                               + ["l", "r"] + [str(i) for i in range(values)] + ["~{memory}"])
        rtype = types.UniTuple(types.float32, values)
        a_type = types.UniTuple(types.uint32, 4) if a_in_registers else types.uint64

        @intrinsic
        def mma_async(typingctx, acc, a, desc_b):
            if acc != rtype:
                return None
            sig = rtype(rtype, a_type, types.uint64)

            def codegen(context, builder, sig, args):
                acc_in = [builder.extract_value(args[0], i) for i in range(values)]
                a_in = ([builder.extract_value(args[1], i) for i in range(4)] if a_in_registers
                        else [args[1]])  # fmt: skip
                operands = a_in + [args[2], ir.Constant(ir.IntType(32), 1)] + acc_in
                fnty = ir.FunctionType(ir.LiteralStructType([_F32] * values),
                                       [x.type for x in operands])  # fmt: skip
                res = builder.asm(fnty, asm, constraints, operands, True)
                out = [builder.extract_value(res, i) for i in range(values)]
                return context.make_tuple(builder, rtype, out)

            return sig, codegen

        return mma_async
