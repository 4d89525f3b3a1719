"""ldmatrix (ptx/ldmatrix.py): four 8 x 8 b16 matrices from shared memory, against NumPy; the
simulator's twin and the GPU agree."""

import numpy as np
from numba import cuda, uint32

from sparseblocks.ptx.cp_async import shared_address
from sparseblocks.ptx.ldmatrix import ldmatrix_x4, ldmatrix_x4_at, ldmatrix_x4_trans_at

ROWS, STRIDE = 40, 12  # a padded tile: rows of 12 words (48 bytes, 16-byte aligned)


def test_ldmatrix_x4_gives_each_lane_word_lane_mod_4_of_row_lane_div_4_of_each_matrix():
    rng = np.random.default_rng(7)
    tile = rng.integers(0, 2**32, (ROWS, STRIDE), dtype=np.uint64).astype(np.uint32)
    # lane 8q + i hands in row rows[q][i] from word words[q] (scattered rows, both 4-word halves)
    rows = rng.permutation(ROWS)[:32].reshape(4, 8)
    words = np.array([0, 4, 8, 4])
    starts = np.array([[rows[q, i], words[q]] for q in range(4) for i in range(8)], np.int32)

    @cuda.jit
    def kernel(out, tile, starts):
        shared = cuda.shared.array((ROWS, STRIDE), uint32)
        lane = cuda.threadIdx.x
        for i in range(lane, ROWS * STRIDE, 32):
            shared[i // STRIDE, i % STRIDE] = tile[i // STRIDE, i % STRIDE]
        cuda.syncthreads()
        got = ldmatrix_x4(shared, (starts[lane, 0], starts[lane, 1]))
        for q in range(4):
            out[lane, q] = got[q]

    out = cuda.to_device(np.zeros((32, 4), np.uint32))
    kernel[1, 32](out, cuda.to_device(tile), cuda.to_device(starts))
    got = out.copy_to_host()
    for lane in range(32):
        for q in range(4):
            assert got[lane, q] == tile[rows[q, lane // 4], words[q] + lane % 4], (lane, q)


def _lane_rows_kernel(load):
    """A kernel in which lane i hands in row starts[i] (row, word) of a shared copy of tile by
    its shared-window address, through `load` (ldmatrix_x4_at or ldmatrix_x4_trans_at)."""

    @cuda.jit
    def kernel(out, tile, starts):
        shared = cuda.shared.array((ROWS, STRIDE), uint32)
        lane = cuda.threadIdx.x
        for i in range(lane, ROWS * STRIDE, 32):
            shared[i // STRIDE, i % STRIDE] = tile[i // STRIDE, i % STRIDE]
        cuda.syncthreads()
        base = shared_address(shared, (0, 0))
        got = load(base + (starts[lane, 0] * STRIDE + starts[lane, 1]) * 4)
        for q in range(4):
            out[lane, q] = got[q]

    return kernel


def _scattered_rows(seed):
    rng = np.random.default_rng(seed)
    tile = rng.integers(0, 2**32, (ROWS, STRIDE), dtype=np.uint64).astype(np.uint32)
    rows = rng.permutation(ROWS)[:32].reshape(4, 8)
    words = np.array([4, 0, 8, 0])
    starts = np.array([[rows[q, i], words[q]] for q in range(4) for i in range(8)], np.int32)
    return tile, rows, words, starts


def _run(load, tile, starts):
    out = cuda.to_device(np.zeros((32, 4), np.uint32))
    _lane_rows_kernel(load)[1, 32](out, cuda.to_device(tile), cuda.to_device(starts))
    return out.copy_to_host()


def test_ldmatrix_x4_at_an_address_matches_the_indexed_form():
    tile, rows, words, starts = _scattered_rows(11)
    got = _run(ldmatrix_x4_at, tile, starts)
    for lane in range(32):
        for q in range(4):
            assert got[lane, q] == tile[rows[q, lane // 4], words[q] + lane % 4], (lane, q)


def test_ldmatrix_x4_trans_gives_each_lane_two_rows_of_one_column():
    """Matrix q's lane l gets stored rows 2(l % 4), 2(l % 4) + 1 at column l // 4, low then high."""
    tile, rows, words, starts = _scattered_rows(12)
    got = _run(ldmatrix_x4_trans_at, tile, starts)
    halves = tile.view(np.uint16)  # (ROWS, 2 * STRIDE)
    for lane in range(32):
        for q in range(4):
            column = 2 * words[q] + lane // 4
            lo = halves[rows[q, 2 * (lane % 4)], column]
            hi = halves[rows[q, 2 * (lane % 4) + 1], column]
            assert got[lane, q] == int(lo) | int(hi) << 16, (lane, q)
