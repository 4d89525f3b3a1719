"""NaN-propagating max for kernels: ``max_nan(a, b)`` and ``max_nan_select(a, b)``.

PTX's plain ``max.f32`` (what Numba's ``max`` of floats becomes) returns the other operand
where one is NaN, and Python's ``max`` (the simulator's) keeps a NaN only in first place;
numpy's max, which the references use, returns NaN. ``max_nan`` is ``max.NaN.f32``: float32,
sm_80 and later, one instruction (FMNMX.NAN), as plain max. ``max_nan_select`` is a compare
and a select of any float type (three instructions), for the rest.

In the CUDA simulator ``max_nan`` is ``max_nan_select``.
"""

from numba import cuda

from ..runtime.backend import SIMULATOR


@cuda.jit(device=True, inline=True)
def max_nan_select(a, b):
    """max(a, b), NaN where either is."""
    return a if a > b or a != a else b


if SIMULATOR:
    max_nan = max_nan_select

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
