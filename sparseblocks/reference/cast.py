"""NumPy twin of `sparseblocks.cast.float_cast`: ml_dtypes' conversions (round to nearest even;
inf past the range, or NaN for E4M3FN), the saturating variant by clipping first, and the
stochastic rounding written out on fp32's bits with the same random words (`reference.philox`)."""

import numpy as np

from ..cast.formats import FORMATS, max_bits, nan_bits, numpy_dtype
from .philox import philox


def _bits_dtype(name):
    return {8: np.uint8, 16: np.uint16, 32: np.uint32}[numpy_dtype(name).itemsize * 8]


def largest(name):
    return np.array([max_bits(name)], _bits_dtype(name)).view(numpy_dtype(name))[0].astype(np.float64)


def float_cast(x, dtype, stochastic=False, saturate=False, seed=0, offset=0):
    """``x`` (fp32, fp16, bf16 or fp8) in ``dtype``, as an array of that dtype."""
    values = np.asarray(x).astype(np.float32)
    if dtype == "float32":
        return values
    if stochastic:
        return _stochastic(values, dtype, saturate, seed, offset)
    if saturate:
        top = np.float32(largest(dtype))
        values = np.where(np.isnan(values), values, np.clip(values, -top, top)).astype(np.float32)
    with np.errstate(over="ignore", invalid="ignore"):
        return values.astype(numpy_dtype(dtype))


def _stochastic(values, dtype, saturate, seed, offset):
    E, M, BIAS, kind = FORMATS[dtype]
    u = values.reshape(-1).view(np.uint32).astype(np.int64)
    n = u.size
    e = np.arange(n, dtype=np.int64)
    random = philox(e & 0xFFFFFFFF, e >> 32, offset & 0xFFFFFFFF, offset >> 32, seed & 0xFFFFFFFF,
                    seed >> 32)[0].astype(np.int64)
    sign = np.where((u >> 31) & 1, 1 << (E + M), 0)
    magnitude = u & 0x7FFFFFFF
    exp32, man32 = magnitude >> 23, magnitude & 0x7FFFFF
    full = np.where(exp32 == 0, man32, man32 | 0x800000)
    field = np.where(exp32 == 0, -126, exp32 - 127) + BIAS
    normal = (field >= 1) & (exp32 != 0)
    shift = np.minimum(np.where(normal, 23 - M, 23 - M + 1 - field), 40)
    m = full >> shift
    rest = full - (m << shift)
    draw = (random & ((np.int64(1) << np.minimum(shift, 32)) - 1)) * (np.int64(1) << np.maximum(shift - 32, 0))
    m = m + (rest + draw >= (np.int64(1) << shift))
    carry = normal & (m == (1 << (M + 1)))
    m = np.where(carry, m >> 1, m)
    field = np.where(carry, field + 1, field)
    bits_exp = np.where(normal, field, np.where(m == (1 << M), 1, 0))
    bits_man = np.where(normal, m - (1 << M), np.where(m == (1 << M), 0, m))
    top = (1 << E) - 1
    if kind == "fn":
        over = (bits_exp > top) | ((bits_exp == top) & (bits_man == (1 << M) - 1))
        over_bits = nan_bits(dtype)
    else:
        over = bits_exp >= top
        over_bits = top << M
    over_bits = max_bits(dtype) if saturate else over_bits
    bits = np.where(over | (magnitude == 0x7F800000), sign | over_bits, sign | (bits_exp << M) | bits_man)
    bits = np.where(magnitude > 0x7F800000, sign | nan_bits(dtype), bits)
    return bits.astype(_bits_dtype(dtype)).view(numpy_dtype(dtype)).reshape(values.shape)
