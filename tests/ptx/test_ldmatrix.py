"""ldmatrix (ptx/ldmatrix.py): four 8 x 8 b16 matrices from shared memory, plain and transposed,
by index and by address, and a lane's own 16 bytes, against NumPy; the simulator's twin and the
GPU agree."""

import numpy as np
from numba import cuda, uint32

from sparseblocks.ptx.cp_async import shared_address
from sparseblocks.ptx.ldmatrix import ldmatrix_x4, ldmatrix_x4_at, ldmatrix_x4_trans_at, load4_shared_at

ROWS, STRIDE = 40, 12  # a padded tile: rows of 12 words (48 bytes, 16-byte aligned)


@cuda.jit(device=True)
def by_index(shared, row, word):
    return ldmatrix_x4(shared, (row, word))


@cuda.jit(device=True)
def by_address(shared, row, word):
    return ldmatrix_x4_at(shared_address(shared, (0, 0)) + (row * STRIDE + word) * 4)


@cuda.jit(device=True)
def transposed(shared, row, word):
    return ldmatrix_x4_trans_at(shared_address(shared, (0, 0)) + (row * STRIDE + word) * 4)


def run(load, seed):
    """(tile, rows, words, what each lane got) where lane 8q + i hands in row rows[q][i] from word
    words[q] of a shared copy of a random tile (scattered rows, both 4-word halves), through
    `load(shared, row, word)`."""
    rng = np.random.default_rng(seed)
    tile = rng.integers(0, 2**32, (ROWS, STRIDE), dtype=np.uint64).astype(np.uint32)
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
        got = load(shared, starts[lane, 0], starts[lane, 1])
        for q in range(4):
            out[lane, q] = got[q]

    out = cuda.to_device(np.zeros((32, 4), np.uint32))
    kernel[1, 32](out, cuda.to_device(tile), cuda.to_device(starts))
    return tile, rows, words, out.copy_to_host()


def test_ldmatrix_x4_gives_each_lane_word_lane_mod_4_of_row_lane_div_4_of_each_matrix():
    for load in (by_index, by_address):
        tile, rows, words, got = run(load, 7)
        for lane in range(32):
            for q in range(4):
                assert got[lane, q] == tile[rows[q, lane // 4], words[q] + lane % 4], (load, lane, q)


def test_ldmatrix_x4_trans_gives_each_lane_two_rows_of_one_column():
    """Matrix q's lane l gets stored rows 2(l % 4), 2(l % 4) + 1 at column l // 4, low then high."""
    tile, rows, words, got = run(transposed, 12)
    halves = tile.view(np.uint16)  # (ROWS, 2 * STRIDE)
    for lane in range(32):
        for q in range(4):
            column = 2 * words[q] + lane // 4
            lo = halves[rows[q, 2 * (lane % 4)], column]
            hi = halves[rows[q, 2 * (lane % 4) + 1], column]
            assert got[lane, q] == int(lo) | int(hi) << 16, (lane, q)


def test_load4_shared_at_gives_a_lane_the_4_words_at_its_address():
    """Each lane its own row's 4 words, from a multiple of 16 bytes along it."""
    rng = np.random.default_rng(3)
    tile = rng.integers(0, 2**32, (ROWS, STRIDE), dtype=np.uint64).astype(np.uint32)
    rows = rng.permutation(ROWS)[:32].astype(np.int32)
    words = (np.arange(32, dtype=np.int32) % 3) * 4

    @cuda.jit
    def kernel(out, tile, rows, words):
        shared = cuda.shared.array((ROWS, STRIDE), uint32)
        lane = cuda.threadIdx.x
        for i in range(lane, ROWS * STRIDE, 32):
            shared[i // STRIDE, i % STRIDE] = tile[i // STRIDE, i % STRIDE]
        cuda.syncthreads()
        w0, w1, w2, w3 = load4_shared_at(shared_address(shared, (0, 0)) + (rows[lane] * STRIDE + words[lane]) * 4)
        out[lane, 0], out[lane, 1], out[lane, 2], out[lane, 3] = w0, w1, w2, w3

    out = cuda.to_device(np.zeros((32, 4), np.uint32))
    kernel[1, 32](out, cuda.to_device(tile), cuda.to_device(rows), cuda.to_device(words))
    got = out.copy_to_host()
    for lane in range(32):
        np.testing.assert_array_equal(got[lane], tile[rows[lane], words[lane]:words[lane] + 4])
