"""The cast kernel: decode each value to fp32, encode it in the target format from fp32's bits.

Encoding keeps the target's mantissa bits of fp32's 24 (with the implicit 1), shifting further
where the value falls among the target's subnormals, and rounds what is shifted out: to nearest
even, or stochastically (up with probability remainder / 2^shift, from 32 random bits of
`philox` per element: counter (element, offset), key seed). A carry out of the mantissa moves
to the next binade; past the largest finite value the result is inf ("ieee" formats), NaN
(E4M3FN, which has no inf: ml_dtypes' rule), or with ``saturate`` the largest finite value of
that sign. NaN stays NaN (the format's quiet NaN, sign kept; payloads are not carried). fp32
sources' subnormals are far below every target's smallest subnormal and round to zero (or
stochastically to it).

That kernel (`make_cast`) spells the rounding out, and serves stochastic rounding. Rounding to
nearest even has a fast kernel (`make_fast_cast`) with the same results: the hardware rounds
(``cvt`` to fp8 pairs, `ptx.fp8`; to fp16 pairs, `ptx.half2`; bf16 by adding half an ulp to
fp32's bits), and the kernel fixes up what the hardware does differently: NaN's sign and bits,
and overflow past the format's rounding limit (the hardware's fp8 conversion saturates). fp16
sources are widened by the hardware too, and a thread converts 4 values, by one load and one
store where the arrays are aligned.
"""

import math

from numba import cuda, float32, int16, int64, uint8, uint32
from numba.cuda import libdevice

from ..philox import philox
from ..ptx.fp8 import e4m3x2_of_floats, e5m2x2_of_floats
from ..ptx.half2 import floats_of_half2, half2_of_floats
from ..ptx.vector import load4, store4
from .formats import FORMATS, max_bits, nan_bits

# The smallest magnitude that rounds past each format's largest finite value (to nearest even):
# halfway to the next binade's first value, which the tie reaches where the largest value's
# mantissa is odd (E5M2, fp16, bf16) but not in E4M3FN (448 = 1.75·2⁸, an even mantissa).
OVERFLOW = {"float8_e4m3fn": 464.0, "float8_e5m2": 61440.0, "float16": 65520.0,
            "bfloat16": float.fromhex("0x1.ff0000p+127")}


def make_decode(src):
    """``decode(stored) -> float32`` of a source format's stored element."""
    if src == "float32":
        return cuda.jit(device=True, inline=True)(lambda v: float32(v))
    if src == "bfloat16":
        @cuda.jit(device=True, inline=True)
        def from_bf16(bits):
            return libdevice.int_as_float(int64(bits) << 16)

        return from_bf16
    E, M, BIAS, kind = FORMATS[src]  # fp16 and fp8, from their bits (fp16 read as int16)
    EXP_ONES, MAN_ONES = (1 << E) - 1, (1 << M) - 1
    WIDTH = (1 << (1 + E + M)) - 1
    SUBNORMAL = 2.0 ** (1 - BIAS - M)
    FN = kind == "fn"

    @cuda.jit(device=True, inline=True)
    def from_bits(stored):
        b = int64(stored) & WIDTH
        negative = (b >> (E + M)) & 1
        exp, man = (b >> M) & EXP_ONES, b & MAN_ONES
        if exp == EXP_ONES and (not FN or man == MAN_ONES):
            special = float32(math.nan) if FN or man != 0 else float32(math.inf)
            return -special if negative else special  # (a NaN keeps its sign, as ml_dtypes decodes it)
        if exp == 0:
            value = float32(man) * float32(SUBNORMAL)
        else:
            value = libdevice.int_as_float(((exp - BIAS + 127) << 23) | (man << (23 - M)))
        return -value if negative else value

    return from_bits


def make_encode(dst, stochastic, saturate):
    """``encode(value: float32, random: uint32) -> bits`` in the target format (an int64)."""
    E, M, BIAS, kind = FORMATS[dst]
    FN = kind == "fn"
    SIGN = 1 << (E + M)
    NAN, MAX = nan_bits(dst), max_bits(dst)
    INF = ((1 << E) - 1) << M
    MAX_EXP = (1 << E) - 1  # an exponent field this large (or larger) is out of the finite range ...
    FN_TOP = MAX_EXP  # ... except in E4M3FN, whose top binade is finite below its NaN

    @cuda.jit(device=True, inline=True)
    def overflowed(sign):
        if saturate:
            return sign | MAX
        return sign | (NAN if FN else INF)

    @cuda.jit(device=True, inline=True)
    def encode(value, random):
        u = int64(libdevice.float_as_int(value)) & 0xFFFFFFFF
        sign = SIGN if (u >> 31) & 1 else 0
        magnitude = u & 0x7FFFFFFF
        if magnitude > 0x7F800000:
            return sign | NAN
        if magnitude == 0x7F800000:
            return overflowed(sign)
        exp32, man32 = magnitude >> 23, magnitude & 0x7FFFFF
        full, unbiased = (man32, -126) if exp32 == 0 else (man32 | 0x800000, exp32 - 127)
        field = unbiased + BIAS
        normal = field >= 1 and exp32 != 0  # (fp32's subnormals are bf16's: same exponent range)
        shift = min(23 - M if normal else 23 - M + 1 - field, 40)
        m = full >> shift
        rest = full - (m << shift)
        if stochastic:
            if rest + (int64(random) & ((int64(1) << min(shift, 32)) - 1)) * (int64(1) << max(shift - 32, 0)) \
                    >= (int64(1) << shift):
                m += 1
        else:
            half = int64(1) << (shift - 1)
            if rest > half or (rest == half and (m & 1) == 1):
                m += 1
        if normal:
            if m == (1 << (M + 1)):
                m >>= 1
                field += 1
            bits_exp, bits_man = field, m - (1 << M)
        elif m == (1 << M):  # a subnormal rounded up into the smallest normal
            bits_exp, bits_man = 1, 0
        else:
            bits_exp, bits_man = 0, m
        if FN:
            if bits_exp > FN_TOP or (bits_exp == FN_TOP and bits_man == (1 << M) - 1):
                return overflowed(sign)
        elif bits_exp >= MAX_EXP:
            return overflowed(sign)
        return sign | (bits_exp << M) | bits_man

    return encode


def make_cast(src, dst, stochastic, saturate):
    """``cast(out, x, seed_lo, seed_hi, offset)``: out (the target's stored type, flat) from x."""
    decode = make_decode(src)
    encode = make_encode("float16" if dst == "float32" else dst, stochastic, saturate)  # (fp32: unused)
    WIDE = dst == "float32"
    HALF = dst in ("float16", "bfloat16")
    if WIDE:
        stochastic = False

    @cuda.jit
    def cast(out, x, seed_lo, seed_hi, offset):
        start, step = cuda.grid(1), cuda.gridsize(1)
        for e in range(start, x.shape[0], step):
            value = decode(x[e])
            random = uint32(0)
            if stochastic:
                random = philox(uint32(e & 0xFFFFFFFF), uint32(e >> 32), uint32(offset & 0xFFFFFFFF),
                                uint32(offset >> 32), uint32(seed_lo), uint32(seed_hi))[0]
            if WIDE:  # (fp32 holds every source exactly: nothing to round)
                out[e] = value
            elif HALF:
                bits = encode(value, random)
                out[e] = int16(bits - 0x10000 if bits >= 0x8000 else bits)
            else:
                out[e] = encode(value, random)

    return cast


def make_fast_cast(src, dst, saturate, vector, groups=1):
    """``cast(out, x, seed_lo, seed_hi, offset)`` as `make_cast`'s, rounding to nearest even (the
    seeds unused); ``vector``: x and out start at a multiple of 4 elements, and a thread casts
    ``groups`` groups of 4 values an iteration, a grid's stride apart (each a vector load and
    store, a warp's 32 contiguous), else one value."""
    decode = make_decode(src)
    WIDE = dst == "float32"
    E, M, _, kind = FORMATS[dst]
    SIGN, NAN = 1 << (E + M), nan_bits(dst)
    OVER = max_bits(dst) if saturate else (NAN if kind == "fn" else ((1 << E) - 1) << M)
    LIMIT = OVERFLOW.get(dst, 0.0)
    STRICT = dst == "float8_e4m3fn"  # (its limit itself rounds down to 448)

    @cuda.jit(device=True, inline=True)
    def decode2(a, b):
        if src == "float16":  # (the hardware widens a pair of halves exactly, but a NaN loses its sign)
            v0, v1 = floats_of_half2(uint32(((int64(b) & 0xFFFF) << 16) | (int64(a) & 0xFFFF)))
            if v0 != v0 or v1 != v1:
                return decode(a), decode(b)
            return v0, v1
        return decode(a), decode(b)

    @cuda.jit(device=True, inline=True)
    def fixed(bits, value):
        """The hardware's rounding of value, with NaN and overflow as the format defines them
        (selects, no branches: they run on every value)."""
        sign = SIGN if libdevice.float_as_int(value) < 0 else 0
        magnitude = abs(value)
        over = magnitude > float32(LIMIT) or (not STRICT and magnitude == float32(LIMIT))
        fixed_bits = int64(sign | OVER) if over else int64(bits)
        return int64(sign | NAN) if value != value else fixed_bits

    @cuda.jit(device=True, inline=True)
    def bf16_bits(value):
        u = int64(libdevice.float_as_int(value)) & 0xFFFFFFFF
        return (u + 0x7FFF + ((u >> 16) & 1)) >> 16

    @cuda.jit(device=True, inline=True)
    def encode2(v0, v1):
        if dst == "float8_e4m3fn":
            pair = int64(e4m3x2_of_floats(v0, v1))
            return fixed(pair & 0xFF, v0), fixed(pair >> 8, v1)
        if dst == "float8_e5m2":
            pair = int64(e5m2x2_of_floats(v0, v1))
            return fixed(pair & 0xFF, v0), fixed(pair >> 8, v1)
        if dst == "float16":
            word = int64(half2_of_floats(v0, v1)) & 0xFFFFFFFF
            return fixed(word & 0xFFFF, v0), fixed(word >> 16, v1)
        return fixed(bf16_bits(v0) & 0xFFFF, v0), fixed(bf16_bits(v1) & 0xFFFF, v1)

    @cuda.jit(device=True, inline=True)
    def stored(bits):
        if dst in ("float16", "bfloat16"):
            return int16(bits - 0x10000 if bits >= 0x8000 else bits)
        return uint8(bits)

    @cuda.jit(device=True, inline=True)
    def cast4(s):
        """4 loaded source values as the 4 values to store."""
        v0, v1 = decode2(s[0], s[1])
        v2, v3 = decode2(s[2], s[3])
        if WIDE:
            return v0, v1, v2, v3
        b0, b1 = encode2(v0, v1)
        b2, b3 = encode2(v2, v3)
        return stored(b0), stored(b1), stored(b2), stored(b3)

    @cuda.jit
    def cast(out, x, seed_lo, seed_hi, offset):
        start, step = cuda.grid(1), cuda.gridsize(1)
        n, first = x.shape[0], 0
        if vector:
            quads, q = n // 4, start
            if groups == 2:
                while q + step < quads:  # (two groups, a grid's stride apart: both loads before either store)
                    e, e2 = 4 * q, 4 * (q + step)
                    s, t = load4(x, (e,)), load4(x, (e2,))
                    store4(out, (e,), cast4(s))
                    store4(out, (e2,), cast4(t))
                    q += 2 * step
            while q < quads:
                store4(out, (4 * q,), cast4(load4(x, (4 * q,))))
                q += step
            first = quads * 4
        for e in range(first + start, n, step):
            v, _ = decode2(x[e], x[e])
            if WIDE:
                out[e] = v
            else:
                b, _ = encode2(v, v)
                out[e] = stored(b)

    return cast
