"""Hopper-only inline PTX (sm_90a): warpgroup matrix multiply (wgmma) and its fences.

Groundwork for the backward's next design (benchmarks/NOTES.md, "Where that leaves issue 5"):
wgmma reads both operands from shared memory through 64-bit descriptors and accumulates
asynchronously, which frees the fragment registers that limit the mma.sync kernels. Nothing in
the library calls it yet; ``tests/wgmma_gemm.py`` multiplies one tile with it, compiled for
sm_90a on CI (tests/test_compile.py) and checked against NumPy on a GPU (tests/test_wgmma.py).

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

from numba import uint64

from .jit import SIMULATOR, device_function

__all__ = [
    "matrix_descriptor",
    "wgmma_fence",
    "wgmma_commit",
    "wgmma_wait",
    "fence_proxy_async",
    "wgmma_m64n64k16_f16",
    "wgmma_m64n64k16_bf16",
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


if SIMULATOR:

    def _needs_gpu(*args):
        raise NotImplementedError("wgmma needs an sm_90a GPU; the CUDA simulator cannot run it")

    wgmma_fence = wgmma_commit = wgmma_wait = fence_proxy_async = _needs_gpu
    wgmma_m64n64k16_f16 = wgmma_m64n64k16_bf16 = _needs_gpu

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

    def _make_wgmma_m64n64k16(ab):
        # D (64 x 64 f32, 32 values per thread) += A (64 x 16, K-major, descriptor $32) @
        # B (16 x 64, stored N x K K-major, descriptor $33); both operands unscaled, not
        # transposed. The accumulators come in as inputs tied to the outputs.
        values = 32
        regs = ", ".join(f"${i}" for i in range(values))
        asm = (
            "{ .reg .pred p; setp.ne.b32 p, $34, 0; "
            f"wgmma.mma_async.sync.aligned.m64n64k16.f32.{ab}.{ab} "
            f"{{{regs}}}, $32, $33, p, 1, 1, 0, 0; }}"
        )
        constraints = ",".join(["=f"] * values + ["l", "l", "r"] + [str(i) for i in range(values)])

        @intrinsic
        def wgmma(typingctx, acc, desc_a, desc_b):
            rtype = types.UniTuple(types.float32, values)
            if acc != rtype:
                return None
            sig = rtype(rtype, types.uint64, types.uint64)

            def codegen(context, builder, sig, args):
                acc_in = [builder.extract_value(args[0], i) for i in range(values)]
                operands = [args[1], args[2], ir.Constant(ir.IntType(32), 1)] + acc_in
                ret = ir.LiteralStructType([_F32] * values)
                fnty = ir.FunctionType(ret, [a.type for a in operands])
                res = builder.asm(fnty, asm, constraints + ",~{memory}", operands, True)
                out = [builder.extract_value(res, i) for i in range(values)]
                return context.make_tuple(builder, rtype, out)

            return sig, codegen

        return wgmma

    wgmma_m64n64k16_f16 = _make_wgmma_m64n64k16("f16")
    wgmma_m64n64k16_bf16 = _make_wgmma_m64n64k16("bf16")
