"""``opaque_u32(x)``: x as a uint32, through a ``mov.b32`` the compiler may neither move nor merge.

A kernel that walks many items in a loop (a thread block's block-columns) makes the same values
in every iteration from loop-invariant inputs: its row, lane and warp indices, and from them
addresses, bounds and predicates. LLVM hoists all of those out of the loop and keeps them live
across it, which can cost dozens of registers (and the thread blocks a multiprocessor that go
with them). A value read through ``opaque_u32`` inside the loop is new each iteration (the
``mov`` has a side effect), so everything made from it is made there, where it is used.

In the CUDA simulator it is x's low 32 bits as ``np.uint32``.
"""

from ..runtime.backend import SIMULATOR

if SIMULATOR:
    import numpy as np

    def opaque_u32(value):
        return np.uint32(int(value) & 0xFFFFFFFF)  # (its low 32 bits, as the mov.b32 takes them)

else:
    from llvmlite import ir
    from numba import types
    from numba.cuda.extending import intrinsic

    @intrinsic
    def opaque_u32(typingctx, value):
        if not isinstance(value, types.Integer):
            return None

        def codegen(context, builder, sig, args):
            word = context.cast(builder, args[0], sig.args[0], types.uint32)
            asm = ir.InlineAsm(ir.FunctionType(ir.IntType(32), [ir.IntType(32)]), "mov.b32 $0, $1;", "=r,r",
                               side_effect=True)
            return builder.call(asm, [word])

        return types.uint32(value), codegen
