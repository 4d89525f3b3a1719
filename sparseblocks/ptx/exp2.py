"""``exp2_ftz(x)``: 2 ** x in float32 as the softmax kernels want it, one ``ex2.approx.ftz.f32``.

Numba's ``math.exp2`` of a float32 becomes ``ex2.approx.f32``, which keeps subnormal results: ptxas
wraps the one MUFU.EX2 in a compare and two multiplies (a scaling for inputs below -126), three
more instructions for every probability of an attention tile. Flushed to zero, they go: a result
below 2**-126 is 0, which a softmax's sum and products do not miss (relative error of the rest:
2**-22, as the unflushed instruction's). -inf gives 0; +inf gives +inf; NaN gives NaN.

In the CUDA simulator the twin is ``math.exp2`` in float32, subnormal results flushed to 0.
"""

import math

import numpy as np
from ..runtime.backend import SIMULATOR

TINY = float(np.finfo(np.float32).tiny)  # 2**-126: the least normal float32

if SIMULATOR:
    def exp2_ftz(x):
        x = float(x)
        if x != x or x >= 128:
            return np.float32(x if x != x else math.inf)
        y = math.exp2(x)
        return np.float32(0 if y < TINY else y)

else:
    from llvmlite import ir
    from numba import types
    from numba.cuda.extending import intrinsic

    @intrinsic
    def exp2_ftz(typingctx, x):
        if x != types.float32:
            return None

        def codegen(context, builder, sig, args):
            f32 = ir.FloatType()
            asm = ir.InlineAsm(ir.FunctionType(f32, [f32]), "ex2.approx.ftz.f32 $0, $1;", "=f,f")
            return builder.call(asm, list(args))

        return types.float32(types.float32), codegen

