"""Dropout (OpenAI's ``dropout``) on counter-based random bits: nothing is stored for the backward.

Element e is kept when word ``e % 4`` of ``philox(e // 4, offset; seed)`` is below
``keep_prob · 2³²``; kept values are scaled by 1 / keep_prob. The same seed and offset give the
same mask on every launch, so the backward regenerates it. A thread draws one Philox block for
4 consecutive elements; with ``packed`` the kernel also writes the mask as bits (bit e % 32 of word
e // 32), each warp assembling its 4 words from 4 ballots (the low-bit kernels' packing). A given
packed mask replaces the random bits (forward or backward).
"""

from numba import cuda, int64, uint32, uint64

from ..bsmm.device import converters
from ..philox import philox
from ..ptx.vector import load4, store4

FULL_MASK = 0xFFFFFFFF
WARP = 32


def make_dropout(storage, acc_type, packed, given, vector):
    """``dropout(y, mask, x, threshold, scale, seed_lo, seed_hi, offset, n)``: y = x·keep·scale over
    n elements (flat); ``mask`` the packed words (written where ``packed``, read where ``given``).
    ``vector``: x and y start at a multiple of 4 elements, so a whole group moves by one load and
    one store."""
    to_acc, from_acc = converters(storage, acc_type)

    @cuda.jit(device=True, inline=True)
    def scaled(v, keep, scale):
        return from_acc(to_acc(v) * scale if keep else acc_type(0))

    @cuda.jit(device=True, inline=True)
    def nibble_word(b0, b1, b2, b3, k):
        """Word k of a warp's 128 elements from the 4 ballots (bit L of ballot j: element 4L + j)."""
        word = uint32(0)
        for m in range(8):
            lane = 8 * k + m
            word |= uint32(((b0 >> lane) & 1) | (((b1 >> lane) & 1) << 1) | (((b2 >> lane) & 1) << 2)
                           | (((b3 >> lane) & 1) << 3)) << uint32(4 * m)
        return word

    @cuda.jit(device=True, inline=True)
    def kept(mask, words, e, j, threshold):
        if given:
            return (mask[e >> 5] >> uint32(e & 31)) & 1 == 1
        return uint64(words[j]) < uint64(threshold)

    @cuda.jit
    def dropout(y, mask, x, threshold, scale, seed_lo, seed_hi, offset, n):
        lane = cuda.threadIdx.x % WARP
        warp = cuda.grid(1) // WARP
        warps = cuda.gridsize(1) // WARP
        groups = (n + 3) // 4
        for base in range(warp * WARP, groups, warps * WARP):  # (whole warps: the ballots need every lane)
            g = int64(base + lane)
            words = philox(uint32(g & FULL_MASK), uint32(g >> 32), uint32(offset & FULL_MASK), uint32(offset >> 32),
                           uint32(seed_lo), uint32(seed_hi)) if not given else (uint32(0), uint32(0), uint32(0), uint32(0))
            k0 = k1 = k2 = k3 = False
            if vector and 4 * g + 3 < n:
                e = 4 * g
                k0, k1 = kept(mask, words, e, 0, threshold), kept(mask, words, e + 1, 1, threshold)
                k2, k3 = kept(mask, words, e + 2, 2, threshold), kept(mask, words, e + 3, 3, threshold)
                v = load4(x, (e,))
                s = acc_type(scale)
                store4(y, (e,), (scaled(v[0], k0, s), scaled(v[1], k1, s), scaled(v[2], k2, s), scaled(v[3], k3, s)))
            else:
                for j in range(4):
                    e = 4 * g + j
                    if e < n:
                        keep = kept(mask, words, e, j, threshold)
                        y[e] = scaled(x[e], keep, acc_type(scale))
                        if j == 0:
                            k0 = keep
                        elif j == 1:
                            k1 = keep
                        elif j == 2:
                            k2 = keep
                        else:
                            k3 = keep
            if packed:
                b0, b1 = cuda.ballot_sync(FULL_MASK, k0), cuda.ballot_sync(FULL_MASK, k1)
                b2, b3 = cuda.ballot_sync(FULL_MASK, k2), cuda.ballot_sync(FULL_MASK, k3)
                if lane < 4:
                    at = (4 * base) // 32 + lane
                    if at < mask.shape[0]:
                        mask[at] = nibble_word(uint64(b0), uint64(b1), uint64(b2), uint64(b3), lane)

    return dropout
