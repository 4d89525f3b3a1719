"""Philox4x32-10 (Salmon et al., Random123): counter-based random bits, shared by the kernels that
draw them (`cast`'s stochastic rounding, `ew.dropout`, attention's dropout).

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


def threshold(keep_prob, bits=32):
    """The ``bits``-bit word below which a value is kept with probability ``keep_prob``:
    keep_prob · 2^bits rounded down, at most 2^bits (every word)."""
    return min(int(keep_prob * 2.0 ** bits), 2 ** bits)


def check_word(name, value, bits=64):
    """A seed's or an offset's check: an int from 0 to 2**bits - 1, else a ValueError naming it."""
    import numpy as np

    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or not 0 <= value < 2 ** bits:
        raise ValueError(f"{name}: expected an int from 0 to 2**{bits} - 1, got {value!r}")


def words_host(counters, seed, offset):
    """The four words of ``philox(counter, offset; seed)`` for an array of counters, on the host
    (NumPy, uint64 words): what CPU tensors use (`sparseblocks.torch.ew.dropout`,
    `sparseblocks.torch.cast`), the same words as the kernels'."""
    import numpy as np

    g = np.asarray(counters, np.uint64)
    c = [g & np.uint64(MASK), g >> np.uint64(32), np.full_like(g, offset & MASK), np.full_like(g, offset >> 32)]
    k0, k1 = np.uint64(seed & MASK), np.uint64(seed >> 32)
    mask = np.uint64(MASK)
    for _ in range(10):
        p0, p1 = np.uint64(M0) * c[0], np.uint64(M1) * c[2]
        c = [(p1 >> np.uint64(32)) ^ c[1] ^ k0, p1 & mask, (p0 >> np.uint64(32)) ^ c[3] ^ k1, p0 & mask]
        k0, k1 = (k0 + np.uint64(W0)) & mask, (k1 + np.uint64(W1)) & mask
    return c


def keep_bits_host(n, keep_prob, seed, offset):
    """`sparseblocks.ew.dropout`'s keep bits for n elements, on the host: word e % 4 of block e // 4."""
    import numpy as np

    words = np.stack(words_host(np.arange(-(-n // 4)), seed, offset), axis=1).reshape(-1)[:n]
    return words < np.uint64(threshold(keep_prob))
