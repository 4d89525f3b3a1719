"""``max_nan(a, b)``: the larger of two float32 values, NaN where either is, in one instruction.

PTX's plain ``max.f32`` (what Numba's ``max`` of floats becomes) returns the other operand
where one is NaN; ``max.NaN.f32`` (sm_80 and later) returns NaN, as numpy's max does. A
compare and select does the same in three instructions (`sbnet._max_nan`).

In the CUDA simulator it is that compare and select in Python.
"""

from .._backend import SIMULATOR

if SIMULATOR:
    def max_nan(a, b):
        return a if a > b or a != a else b

else:
    from llvmlite import ir
    from numba import types
    from numba.cuda.extending import intrinsic

    @intrinsic
    def max_nan(typingctx, a, b):
        if a != types.float32 or b != types.float32:
            return None

        def codegen(context, builder, sig, args):
            f32 = ir.FloatType()
            asm = ir.InlineAsm(ir.FunctionType(f32, [f32, f32]), "max.NaN.f32 $0, $1, $2;", "=f,f,f")
            return builder.call(asm, list(args))

        return types.float32(types.float32, types.float32), codegen
