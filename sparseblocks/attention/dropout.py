"""Attention's dropout bits: which (query, key) probabilities a call keeps.

Philox (`sparseblocks.philox`) draws four words a counter. Here a counter covers a 2 x 2 square of
(query, key) pairs of one head: the pairs (q, k) with q // 2 and k // 2 given, counter
``((bh·R + q // 2)·R + k // 2, offset)`` under ``seed`` (bh = batch·heads + head, R = ⌈S / 2⌉),
word ``2 (q % 2) + k % 2``; a pair is kept where its word is below keep·2³². A thread of the
fused kernels holds two neighbours of one square whichever side its rows are (a query and its
two keys 2t, 2t + 1 in the forward and dq; a key and two queries in dk and dv), so one Philox
block serves two probabilities in every kernel; the backward regenerates the forward's bits.

* ``kept_score(bh, S, q, k, rule)``: one pair (the three kernels);
* ``kept_scores(bh, S, q, k, along_keys, rule)``: (q, k) and its neighbour in the square, (q, k + 1)
  with ``along_keys``, else (q + 1, k); q or k even accordingly;
* ``keep_pair(bits, at, bh, S, row, col, rows_along, rule)``: bits ``at`` and ``at + 1`` of
  bits[0] set where a thread's two neighbours (row, col) and (row, col + 1) of a score tile are
  kept, its rows queries (``rows_along``) or keys (the fused kernels);
* ``make_masking(keep_step, apply_step, n)``: a fused kernel's ``keep(bits, bh, S, row, col0, t,
  rows_along, threshold, seed_lo, seed_hi, offset)`` (bits[0] cleared, then ``keep_step`` for
  each of n steps) and ``apply(x, bits, factor)`` (``apply_step`` for each), from its own steps
  over its accumulators' layout;
* ``keep_host(B, H, S, dropout_p, seed, offset)``: the (B, H, S, S) bits on the host (torch's CPU
  path).

``rule``: (threshold, seed's low word, seed's high word, offset), as `api._dropout_rule` makes it.
"""

import numpy as np
from numba import cuda, uint32, uint64

from ..philox import MASK, philox, threshold, words_host
from ..runtime.compile import inlined, unrolled


@cuda.jit(device=True, inline=True)
def _words(bh, S, q, k, seed_lo, seed_hi, offset):
    half = (uint64(S) + uint64(1)) >> uint64(1)
    g = (uint64(bh) * half + (uint64(q) >> uint64(1))) * half + (uint64(k) >> uint64(1))
    return philox(uint32(g & uint64(MASK)), uint32(g >> uint64(32)), uint32(uint64(offset) & uint64(MASK)),
                  uint32(uint64(offset) >> uint64(32)), seed_lo, seed_hi)


@cuda.jit(device=True, inline=True)
def kept_score(bh, S, q, k, threshold, seed_lo, seed_hi, offset):
    w = _words(bh, S, q, k, seed_lo, seed_hi, offset)
    j = (uint64(q) & uint64(1)) * uint64(2) + (uint64(k) & uint64(1))
    word = w[0] if j == 0 else (w[1] if j == 1 else (w[2] if j == 2 else w[3]))
    return uint64(word) < uint64(threshold)


@cuda.jit(device=True, inline=True)
def kept_scores(bh, S, q, k, along_keys, threshold, seed_lo, seed_hi, offset):
    w = _words(bh, S, q, k, seed_lo, seed_hi, offset)
    if along_keys:  # (q, k), (q, k + 1), k even: words 2 (q % 2), 2 (q % 2) + 1
        if uint64(q) & uint64(1):
            return uint64(w[2]) < uint64(threshold), uint64(w[3]) < uint64(threshold)
        return uint64(w[0]) < uint64(threshold), uint64(w[1]) < uint64(threshold)
    if uint64(k) & uint64(1):  # (q, k), (q + 1, k), q even: words k % 2, 2 + k % 2
        return uint64(w[1]) < uint64(threshold), uint64(w[3]) < uint64(threshold)
    return uint64(w[0]) < uint64(threshold), uint64(w[2]) < uint64(threshold)


@cuda.jit(device=True, inline=True)
def keep_pair(bits, at, bh, S, row, col, rows_along, threshold, seed_lo, seed_hi, offset):
    if rows_along:  # (query row; keys col, col + 1)
        k0, k1 = kept_scores(bh, S, row, col, True, threshold, seed_lo, seed_hi, offset)
    else:  # (key row; queries col, col + 1)
        k0, k1 = kept_scores(bh, S, col, row, False, threshold, seed_lo, seed_hi, offset)
    bits[0] |= (uint64(k0) << uint64(at)) | (uint64(k1) << uint64(at + 1))


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
    half = (S + 1) // 2
    bh = np.arange(B * H, dtype=np.uint64)[:, None, None]
    q = np.arange(S, dtype=np.uint64)[None, :, None]
    k = np.arange(S, dtype=np.uint64)[None, None, :]
    counters = (bh * np.uint64(half) + q // np.uint64(2)) * np.uint64(half) + k // np.uint64(2)
    words = np.stack(words_host(counters.reshape(-1), seed, offset))  # (4, B·H·S·S)
    index = ((q % np.uint64(2)) * np.uint64(2) + k % np.uint64(2)) + np.zeros_like(counters)
    chosen = np.take_along_axis(words, index.reshape(1, -1).astype(np.int64), axis=0)[0]
    return (chosen < np.uint64(threshold(1.0 - dropout_p))).reshape(B, H, S, S)
