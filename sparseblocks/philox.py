"""Philox4x32-10 (Salmon et al., Random123): counter-based random bits, shared by the kernels that
draw them (`cast`'s stochastic rounding, `ew.dropout`).

``philox(c0, c1, c2, c3, k0, k1)`` -> four uint32 words, a pure function of a 128-bit counter and
a 64-bit key: a kernel draws the words for element e from (e, offset) under the key (seed), so
the same seed and offset give the same bits on every launch, in any order, and a backward
regenerates a forward's mask instead of storing it. Its NumPy twin is
`sparseblocks.reference.philox`; both give Random123's known answers.
"""

from numba import cuda, uint32, uint64

M0, M1 = 0xD2511F53, 0xCD9E8D57  # the round multipliers
W0, W1 = 0x9E3779B9, 0xBB67AE85  # the key schedule's increments (golden ratio, sqrt(3) - 1)
MASK = 0xFFFFFFFF


@cuda.jit(device=True, inline=True)
def philox(c0, c1, c2, c3, k0, k1):
    c0, c1, c2, c3 = uint64(c0), uint64(c1), uint64(c2), uint64(c3)
    k0, k1 = uint64(k0), uint64(k1)
    for _ in range(10):
        p0 = uint64(M0) * c0
        p1 = uint64(M1) * c2
        c0, c1, c2, c3 = (p1 >> uint64(32)) ^ c1 ^ k0, p1 & uint64(MASK), (p0 >> uint64(32)) ^ c3 ^ k1, p0 & uint64(MASK)
        k0 = (k0 + uint64(W0)) & uint64(MASK)
        k1 = (k1 + uint64(W1)) & uint64(MASK)
    return uint32(c0), uint32(c1), uint32(c2), uint32(c3)
