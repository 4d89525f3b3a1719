"""Device helpers SBNet's kernel families share (and the fused products reuse).

Division by a magic multiplier (`quotient`, `magic`), splitting a flat index
into window coordinates, joining and swapping halves of 32- and 64-bit words
(fp16 pairs), putting words into an image with or without adds, and walking a
window's lines. Kernels index arrays by unsigned values where they can: Numba
wraps a signed index round the array's end (a test and an add every access).
"""

import numpy as np
from numba import cuda, float32, from_dtype, int32, int64, uint32, uint64

from ..ptx.half2 import add_half2, atomic_add_half, atomic_add_half2, floats_of_half2
from ..ptx.vector import load2, load4, store2, store4

FULL_MASK = 0xFFFFFFFF


WARP = 32


@cuda.jit(device=True, inline=True)
def quotient(x, magic):
    """x // d for 0 <= x < 2^31, `magic` = magic(d): a multiply and a shift where a division by
    a value known only at run time is ~15 dependent instructions."""
    m = uint64(magic) & uint64(0xFFFFFFFF)
    return int32((uint64(x) * m) >> (uint64(magic) >> uint64(32)))


@cuda.jit(device=True, inline=True)
def split(p, d, inv):
    """(p // d, p % d) for 0 <= p < 2**24 through a float reciprocal (64-bit division is slow)."""
    q = int64(float32(p) * inv)
    rest = p - q * d
    if rest < 0:
        q -= 1
        rest += d
    elif rest >= d:
        q += 1
        rest -= d
    return q, rest


@cuda.jit(device=True, inline=True)
def joined(low, high, odd):
    """The int32 word of the high half of ``low`` and the low half of ``high`` where ``odd``
    (two halves that straddle an aligned word), else ``low``."""
    if odd:
        return int32((uint32(low) >> uint32(16)) | (uint32(high) << uint32(16)))
    return low


@cuda.jit(device=True, inline=True)
def joined_quad(low, high, phase):
    """The int64 word of four halves that start ``phase`` halves into the aligned word ``low``
    and run on into ``high`` (``low`` itself where ``phase`` is 0)."""
    if phase != 0:
        shift = uint64(16 * phase)
        return int64((uint64(low) >> shift) | (uint64(high) << (uint64(64) - shift)))
    return low


@cuda.jit(device=True, inline=True)
def add_quad(a, b):
    """The int64 word of the four fp16 sums of the halves of ``a`` and ``b`` (two add.rn.f16x2)."""
    low = add_half2(int32(a), int32(b))
    high = add_half2(int32(a >> 32), int32(b >> 32))
    return (int64(high) << 32) | int64(uint32(low))


HALF = from_dtype(np.dtype("float16"))


@cuda.jit(device=True, inline=True)
def put_word(image, halves, at, value, old, low_ok, high_ok, add, atomic):
    """A scatter's int32 word ``value`` into image word ``at`` where both its halves are the
    window's: written, added to ``old`` (the word read before) or added atomically; where one
    half is (a row's end in an atomic scatter: no other is sent such words), that half added
    alone (``halves``: the image as float16), the word's other half being a neighbour's."""
    if low_ok and high_ok:
        if atomic:
            atomic_add_half2(image, (at,), value)
        elif add:
            image[uint64(at)] = add_half2(old, value)
        else:
            image[uint64(at)] = value
    elif atomic:
        low, high = floats_of_half2(value)
        atomic_add_half(halves, (2 * at + (0 if low_ok else 1),), HALF(low if low_ok else high))


@cuda.jit(device=True, inline=True)
def put_quad(image, at, value, old, add):
    """A scatter's int64 word of four halves into image word ``at``, all four the window's:
    written, or added to ``old`` (the word read before)."""
    image[uint64(at)] = add_quad(old, value) if add else value


@cuda.jit(device=True, inline=True)
def swapped(a, b):
    """The 2 x 2 transpose of fp16 pairs: words of pixels p (a) and p + 1 (b), two channels each ->
    words of channels c and c + 1, two pixels each (low half: pixel p), and back the same way.
    (uint32(...): Numba computes uint32 shifts in 64 bits, where the simulator's NumPy wraps them at
    32: the high bits must not reach a caller.)"""
    return uint32((a & uint32(0xFFFF)) | (b << uint32(16))), uint32((a >> uint32(16)) | (b & uint32(0xFFFF0000)))


@cuda.jit(device=True, inline=True)
def first_line(t, threads, D, rows, groups):
    """Thread t's place among a thread block's ``groups`` x ``rows`` lines of D words each, taken
    word t % D of lines t // D, + per_pass, ... (per_pass = threads // D): one division a thread,
    the line's group and row carried by `next_line` (divisions by run-time values cost tens of
    instructions each). Returns (word, line, group, row, per_pass,
    group step, row step, lines: none for the threads past the last whole pass)."""
    per_pass = threads // D
    d = t % D
    line = t // D
    group = line // rows
    row = line - group * rows
    dg = per_pass // rows
    dr = per_pass - dg * rows
    return d, line, group, row, per_pass, dg, dr, groups * rows if t < per_pass * D else 0


@cuda.jit(device=True, inline=True)
def next_line(line, group, row, per_pass, dg, dr, rows):
    """`first_line`'s carried (line, group, row), one pass on."""
    group += dg
    row += dr
    if row >= rows:
        row -= rows
        group += 1
    return line + per_pass, group, row


def vector_ops(vector_dtype, half2):
    """(WIDTH, load, store, zeros, plus): device functions on 16-byte vectors of WIDTH elements
    of ``vector_dtype`` at a flat element offset of a 1-D array (the caller checked alignment);
    ``plus`` adds two vectors, element by element, or with ``half2`` the fp16 pairs of int32
    words (add.rn.f16x2)."""
    element = from_dtype(np.dtype(vector_dtype))
    WIDTH = 16 // np.dtype(vector_dtype).itemsize

    @cuda.jit(device=True, inline=True)
    def load(array, offset):
        if WIDTH == 4:
            return load4(array, (offset,))
        return load2(array, (offset,))

    @cuda.jit(device=True, inline=True)
    def store(array, offset, values):
        if WIDTH == 4:
            store4(array, (offset,), values)
        else:
            store2(array, (offset,), values)

    @cuda.jit(device=True, inline=True)
    def zeros():
        if WIDTH == 4:
            return element(0), element(0), element(0), element(0)
        return element(0), element(0)

    @cuda.jit(device=True, inline=True)
    def plus(a, b):
        if WIDTH == 4:
            if half2:
                return add_half2(a[0], b[0]), add_half2(a[1], b[1]), add_half2(a[2], b[2]), add_half2(a[3], b[3])
            return a[0] + b[0], a[1] + b[1], a[2] + b[2], a[3] + b[3]
        return a[0] + b[0], a[1] + b[1]

    return WIDTH, load, store, zeros, plus


def magic(d):
    """`quotient`'s magic number of a divisor 1 <= d < 2^31: m = ceil(2^(31 + l) / d) with
    2^l >= d (m < 2^32), and the shift 31 + l above it. x * m / 2^(31 + l) exceeds x / d by
    less than x / 2^(31 + l) < 1 / d for x < 2^31, so its floor is x // d."""
    bits = (d - 1).bit_length()
    return (-(-(1 << (31 + bits)) // d)) | ((31 + bits) << 32)
