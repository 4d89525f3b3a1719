"""Attention's dropout bits: which (query, key) probabilities a call keeps.

Philox (`sparseblocks.philox`) draws four 32-bit words a counter: eight 16-bit halves. Here a
counter covers the eight (query, key) pairs of one head that one thread of a tensor-core score
fragment holds: queries q and q + 8 (q % 16 < 8) against keys k, k + 1, k + 8 and k + 9 (k % 16 < 8,
k even), counter ``((bh·Q + qg)·K + kg, offset)`` under ``seed`` (bh = batch·heads + head; qg =
8 (q // 16) + q % 8 of Q = 8 ⌈S / 16⌉, kg = 4 (k // 16) + (k % 8) // 2 of K = 4 ⌈S / 16⌉). Pair
(q + 8 a, k + 8 b + c) takes half c of word 2a + b (c = 0 the low half); it is kept where that
half is below keep·2¹⁶, so the keep probability is a multiple of 2⁻¹⁶.

The fused kernels' fragments (`ptx.wgmma.acc_position`, mma.sync's C fragment) give a thread
rows r and r + 8 and columns 2t, 2t + 1, 2t + 8, 2t + 9 of each 16 x 16 square: with queries for
rows (the forward, dq) one Philox block serves all eight of its values there; with keys for
rows (dk and dv) two blocks serve them, four values each, and the two lanes of rows r and r ^ 1
need the same two: each draws one and they trade halves by a shuffle. The backward regenerates
the forward's bits and stores nothing.

* ``kept_score(bh, S, q, k, rule)``: one pair (the three kernels);
* ``keep_square(bits, at, bh, S, row, col, rows_along, rule)``: bits ``at`` to ``at + 7`` of
  bits[0] set where a thread's values of one 16 x 16 square are kept: value v at row row + 8
  ((v // 2) % 2) and column col + 8 (v // 4) + v % 2 (the fragments' order), rows queries
  (``rows_along``) or keys; row % 16 < 8, col % 16 < 8 and even; with keys for rows, called by
  the whole warp together, lane l's row the lane l ^ 4's with its lowest bit flipped (the
  fragments' rows are the lane's group);
* ``make_masking(keep_step, apply_step, n)``: a fused kernel's ``keep(bits, bh, S, row, col0, t,
  rows_along, threshold, seed_lo, seed_hi, offset)`` (bits[0] cleared, then ``keep_step`` for
  each of n steps) and ``apply(x, bits, factor)`` (``apply_step`` for each), from its own steps
  over its accumulators' layout;
* ``keep_host(B, H, S, dropout_p, seed, offset)``: the (B, H, S, S) bits on the host (torch's CPU
  path).

``rule``: (threshold, seed's low word, seed's high word, offset), as `api._dropout_rule` makes it;
its threshold is ``philox.threshold(keep, 16)``.
"""

import numpy as np
from numba import cuda, int32, uint32, uint64

from ..philox import MASK, philox, threshold, words_host
from ..runtime.compile import inlined, unrolled

FULL = 0xFFFFFFFF  # (every lane of the warp)


@cuda.jit(device=True, inline=True)
def _words(bh, S, q, k, seed_lo, seed_hi, offset):
    """Philox's block for the square holding pair (q, k) (any of its eight)."""
    tiles = (uint64(S) + uint64(15)) >> uint64(4)
    qg = ((uint64(q) >> uint64(4)) << uint64(3)) + (uint64(q) & uint64(7))
    kg = ((uint64(k) >> uint64(4)) << uint64(2)) + ((uint64(k) & uint64(7)) >> uint64(1))
    g = (uint64(bh) * (tiles << uint64(3)) + qg) * (tiles << uint64(2)) + kg
    return philox(uint32(g & uint64(MASK)), uint32(g >> uint64(32)), uint32(uint64(offset) & uint64(MASK)),
                  uint32(uint64(offset) >> uint64(32)), seed_lo, seed_hi)


@cuda.jit(device=True, inline=True)
def _kept(word, high, threshold):
    """Whether half ``high`` (0 low, 1 high) of ``word`` is below ``threshold`` (at most 2¹⁶)."""
    return ((uint32(word) >> uint32(16 * high)) & uint32(0xFFFF)) < uint32(threshold)


@cuda.jit(device=True, inline=True)
def _pick(w, i):
    return w[0] if i == 0 else (w[1] if i == 1 else (w[2] if i == 2 else w[3]))


@cuda.jit(device=True, inline=True)
def kept_score(bh, S, q, k, threshold, seed_lo, seed_hi, offset):
    w = _words(bh, S, q, k, seed_lo, seed_hi, offset)
    word = _pick(w, ((uint32(q) >> uint32(3)) & uint32(1)) * uint32(2) + ((uint32(k) >> uint32(3)) & uint32(1)))
    return _kept(word, uint32(k) & uint32(1), threshold)


@cuda.jit(device=True, inline=True)
def _two(x, y, threshold, high_x, high_y):
    """Bit 0: half ``high_x`` of x kept; bit 1: half ``high_y`` of y kept."""
    return uint64(_kept(x, high_x, threshold)) | (uint64(_kept(y, high_y, threshold)) << uint64(1))


@cuda.jit(device=True, inline=True)
def keep_square(bits, at, bh, S, row, col, rows_along, threshold, seed_lo, seed_hi, offset):
    if rows_along:
        # queries row + 8a, keys col + 8b + c: value v = 4b + 2a + c is half c of word 2a + b
        w = _words(bh, S, row, col, seed_lo, seed_hi, offset)
        got = _two(w[0], w[0], threshold, 0, 1) | (_two(w[2], w[2], threshold, 0, 1) << uint64(2)) \
            | (_two(w[1], w[1], threshold, 0, 1) << uint64(4)) | (_two(w[3], w[3], threshold, 0, 1) << uint64(6))
    else:
        # keys row + 8a, queries col + 8b + c (a block for each c): value v is half row % 2 of
        # word 2b + a of block c, so values 2i and 2i + 1 take word i of blocks 0 and 1. The lane
        # of row ^ 1 (lane ^ 4: the fragments' rows are the lane's group) needs the same two
        # blocks, the other half of each word: each lane draws block c = row % 2 and hands the
        # other lane that block's bits for its half (one shuffle; the warp calls this together)
        high = uint32(row) & uint32(1)
        w = _words(bh, S, col + high, row, seed_lo, seed_hi, offset)
        mine, theirs = uint32(0), uint32(0)
        for i in range(4):
            mine |= uint32(_kept(w[i], high, threshold)) << uint32(i)
            theirs |= uint32(_kept(w[i], high ^ uint32(1), threshold)) << uint32(i)
        other = uint32(cuda.shfl_xor_sync(FULL, int32(theirs), 4))  # (32-bit ints: what the intrinsic takes)
        first, second = (mine, other) if high == uint32(0) else (other, mine)
        got = uint64(0)
        for i in range(4):
            got |= (uint64((first >> uint32(i)) & uint32(1)) << uint64(2 * i)) \
                | (uint64((second >> uint32(i)) & uint32(1)) << uint64(2 * i + 1))
    bits[0] |= got << uint64(at)


def make_masking(keep_step, apply_step, n):
    keep_steps = unrolled(n, inlined(keep_step), inline=inlined)
    apply = unrolled(n, inlined(apply_step), inline=inlined)

    @inlined
    def keep(bits, bh, S, row, col0, t, rows_along, threshold, seed_lo, seed_hi, offset):
        bits[0] = uint64(0)
        keep_steps(bits, bh, S, row, col0, t, rows_along, threshold, seed_lo, seed_hi, offset)

    return keep, apply


def keep_host(B, H, S, dropout_p, seed, offset=0):
    """The (B, H, S, S) keep bits of a call with these arguments (NumPy; the kernels' bits)."""
    tiles = (S + 15) // 16
    bh = np.arange(B * H, dtype=np.uint64)[:, None, None]
    q = np.arange(S, dtype=np.uint64)[None, :, None]
    k = np.arange(S, dtype=np.uint64)[None, None, :]
    qg = (q >> np.uint64(4)) * np.uint64(8) + (q & np.uint64(7))
    kg = (k >> np.uint64(4)) * np.uint64(4) + ((k & np.uint64(7)) >> np.uint64(1))
    counters = (bh * np.uint64(8 * tiles) + qg) * np.uint64(4 * tiles) + kg
    words = np.stack(words_host(counters.reshape(-1), seed, offset))  # (4, B·H·S·S)
    index = ((q >> np.uint64(3)) & np.uint64(1)) * np.uint64(2) + ((k >> np.uint64(3)) & np.uint64(1)) \
        + np.zeros_like(counters)
    chosen = np.take_along_axis(words, index.reshape(1, -1).astype(np.int64), axis=0)[0]
    half = (chosen >> (np.uint64(16) * (k & np.uint64(1)) + np.zeros_like(counters)).reshape(-1)) & np.uint64(0xFFFF)
    return (half < np.uint64(threshold(1.0 - dropout_p, 16))).reshape(B, H, S, S)
