"""Two fp16 additions in one instruction: ``add_half2(a, b)``.

``a`` and ``b`` are 32-bit words, each the bits of two neighbouring fp16
values (an fp16 array viewed as int32); the result is the word of their two
sums, each rounded to nearest (``add.rn.f16x2``). Numba has no bit cast
between int32 and a pair of halves, so the compiled function is an
intrinsic that emits the PTX instruction on the words themselves. It lets a
channels-last fp16 add move 4 bytes a thread-step instead of 2
(`sbnet.sparse_scatter` with ``add``).

In the CUDA simulator the same name decodes the words with NumPy and adds in
float64 (exact for two fp16 values), rounding once to fp16 as the hardware.
"""

from .._backend import SIMULATOR

if SIMULATOR:
    import numpy as np

    def add_half2(a, b):
        words = (np.array([a, b], np.int64) & 0xFFFFFFFF).astype(np.uint32)
        halves = words.view(np.float16).astype(np.float64)
        sums = (halves[:2] + halves[2:]).astype(np.float16)
        return np.int32(sums.view(np.int32)[0])

else:
    from llvmlite import ir
    from numba import types
    from numba.cuda.extending import intrinsic

    @intrinsic
    def add_half2(typingctx, a, b):
        if not (isinstance(a, types.Integer) and isinstance(b, types.Integer) and a.bitwidth == b.bitwidth == 32):
            return None

        def codegen(context, builder, sig, args):
            i32 = ir.IntType(32)
            asm = ir.InlineAsm(ir.FunctionType(i32, [i32, i32]), "add.rn.f16x2 $0, $1, $2;", "=r,r,r")
            return builder.call(asm, list(args))

        return a(a, b), codegen
