"""The float formats `float_cast` converts between: (exponent bits, mantissa bits, bias, kind).

``kind`` "ieee": the all-ones exponent holds inf (mantissa 0) and NaN; "fn" (OCP's E4M3FN):
no inf, the all-ones exponent is a normal binade but for its all-ones mantissa, the one NaN.
Bits are stored as unsigned integers of the format's width (uint8 for fp8; int16 for fp16 and
bf16, as the kernels take them).
"""

FORMATS = {
    "float32": (8, 23, 127, "ieee"),
    "float16": (5, 10, 15, "ieee"),
    "bfloat16": (8, 7, 127, "ieee"),
    "float8_e4m3fn": (4, 3, 7, "fn"),
    "float8_e5m2": (5, 2, 15, "ieee"),
}
FP8 = ("float8_e4m3fn", "float8_e5m2")


def numpy_dtype(name):
    """NumPy's dtype of a format (ml_dtypes' for bf16 and fp8)."""
    import numpy as np

    if name in ("float32", "float16"):
        return np.dtype(name)
    import ml_dtypes

    return np.dtype(getattr(ml_dtypes, name))


def nan_bits(dtype):
    """The quiet NaN of a format, sign clear (ml_dtypes' and NumPy's)."""
    E, M, _, kind = FORMATS[dtype]
    ones = ((1 << E) - 1) << M
    return ones | ((1 << M) - 1) if kind == "fn" else ones | (1 << (M - 1))


def max_bits(dtype):
    """The largest finite value's bits."""
    E, M, _, kind = FORMATS[dtype]
    if kind == "fn":
        return (((1 << E) - 1) << M) | ((1 << M) - 2)
    return (((1 << E) - 2) << M) | ((1 << M) - 1)
