"""fp8 conversions in hardware: ``e4m3x2_of_floats(lo, hi)`` and ``e5m2x2_of_floats(lo, hi)``.

Each rounds two float32 values to nearest even in one instruction,
``cvt.rn.satfinite.{e4m3x2,e5m2x2}.f32`` (sm_89 and later), and returns the 16-bit word of the two
bytes (``lo``'s in the low byte) as a uint16. PTX offers these conversions only saturating
(``.satfinite``): past the largest finite value (448 for E4M3FN, 57344 for E5M2) the result is
that value of the same sign, and a NaN gives a NaN. A caller that wants inf or NaN on overflow
(`cast`'s default, ml_dtypes' rule) compares the input with the rounding limit itself.

In the CUDA simulator the same names clamp to the largest finite value and round with ml_dtypes
(a NaN gives 0x7F, the hardware's quiet NaN).
"""

from ..runtime.backend import SIMULATOR

LARGEST = {"e4m3": 448.0, "e5m2": 57344.0}

if SIMULATOR:
    import numpy as np

    def _pair(kind):
        import ml_dtypes

        dtype = ml_dtypes.float8_e4m3fn if kind == "e4m3" else ml_dtypes.float8_e5m2

        def convert(lo, hi):
            values = np.array([lo, hi], np.float32)
            nan = np.isnan(values)
            bits = np.clip(values, -LARGEST[kind], LARGEST[kind]).astype(dtype).view(np.uint8).astype(np.uint16)
            bits[nan] = 0x7F
            return np.uint16(bits[0] | (bits[1] << 8))

        return convert

    e4m3x2_of_floats, e5m2x2_of_floats = _pair("e4m3"), _pair("e5m2")

else:
    from llvmlite import ir
    from numba import types
    from numba.cuda.extending import intrinsic

    def _pair(kind):
        @intrinsic
        def convert(typingctx, lo, hi):
            if not (isinstance(lo, types.Float) and isinstance(hi, types.Float)):
                return None

            def codegen(context, builder, sig, args):
                f32 = ir.FloatType()
                values = [context.cast(builder, v, t, types.float32) for v, t in zip(args, sig.args)]
                # cvt d, a, b puts a in d's upper byte and b in its lower byte
                asm = ir.InlineAsm(ir.FunctionType(ir.IntType(16), [f32, f32]),
                                   f"cvt.rn.satfinite.{kind}x2.f32 $0, $2, $1;", "=h,f,f")
                return builder.call(asm, values)

            return types.uint16(lo, hi), codegen

        return convert

    e4m3x2_of_floats, e5m2x2_of_floats = _pair("e4m3"), _pair("e5m2")
