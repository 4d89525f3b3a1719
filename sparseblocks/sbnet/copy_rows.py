"""Channels-last gathers and scatters a window row at a time, 16 bytes a thread-step.

Where a pixel is whole 16-byte vectors and the pointers are aligned: plain
copies, adds (fp16 two halves a word), and fp32 / fp16 transposes through a
shared tile of ``row_tile_c`` channels by a run of the window's pixels.
"""

import numpy as np
from numba import cuda, float32, from_dtype, int32, int64, uint32, uint64

from ..ptx.half2 import floats_of_half2
from ..ptx.vector import load4, load4_words, store4
from .device import vector_ops


def make_row_kernels(cfg, scatter, transpose, add, vector_dtype, half2, pixels, block_width=4, window_major=False):
    """Gather/scatter of a channels-last (NHWC) image a window row at a time, 16 bytes a thread-step.

    A window's row r is bw contiguous pixels of the image (bw * C elements in a
    row), so thread block (i, r) moves it with 16-byte vector loads and stores
    (`_vector.py`), no per-element index arithmetic: the row's vectors left and
    right of the image are a range [lo, hi) computed once. The arrays are flat
    views of ``vector_dtype`` elements (WIDTH of them 16 bytes): float32 or
    float64 data, or int32 words of fp16 pairs (``half2``: adds by add_half2).
    The launcher checked that a pixel is whole vectors and the pointers are
    16-byte aligned.

    With ``transpose`` (float32 or float16; blocks [n_blocks, C, bh, bw]) thread
    block (i, y, z) moves a `pixels` x ROW_TILE_C tile through a float32 shared
    tile (pixels y * pixels... of the window, its rows one run; with
    ``window_major`` the three are one grid axis, tile fastest, then chunk z,
    then window i): read along C from the image (or along the block's pixels),
    written along the other, four values (16 or 8 bytes) a step on the image's
    side and `block_width` (4 where bh * bw is a multiple of 4, else 1) on the
    block's; adds in float32, rounded once (for fp16 the same as an fp16 add).
    A thread loads all its vectors before it uses any, and fp16
    vectors wait in registers as the two words they came in (`load4_words`),
    widened to float32 only where used: widened, or kept as halves, next to
    their load, each load waits in its branch for the one before (the SASS shows it).
    """
    ROW_TILE_C = cfg.row_tile_c
    ROW_TILE_THREADS = cfg.row_tile_threads
    ROW_UNROLL = cfg.row_unroll
    element = from_dtype(np.dtype(vector_dtype))
    WIDTH, load, store, zeros, plus = vector_ops(vector_dtype, half2)
    CT = ROW_TILE_C
    PT = pixels
    CQ = CT // 4  # 16-byte vectors of a tile's pixel
    BV = block_width
    SQ = PT // BV  # block-side steps along a tile's channel (a block row's pixels)
    PER = PT * CQ // ROW_TILE_THREADS  # image-side vectors a thread moves (a literal: local shapes)
    PER_B = PT * CT // BV // ROW_TILE_THREADS  # block-side steps a thread moves
    PER_MOST = max(PER, PER_B)
    STEP = ROW_TILE_THREADS // CQ  # tile pixels between a thread's image-side vectors
    TILE_SHAPE_ROWS = (PT, CT + 1)  # +1: a column read (4 pixels of a channel) hits distinct banks
    HALF = vector_dtype == "float16"
    WORDS = 2 if HALF else 4  # what a staged vector of 4 values holds: fp16, 2 words of 2 halves
    staged = uint32 if HALF else float32

    @cuda.jit(device=True, inline=True)
    def row_of(indices, count, N, H, stride_h, stride_w, offset_h, offset_w):
        """(whether this thread block's window is below the count, its n, h, w0, whether its row
        is inside the image): the count and the window's indices are read together (the
        compiler may still sink the column's load past the count's test)."""
        i = cuda.blockIdx.x
        active = count[0]
        n = indices[i, 0]  # i < the indices' rows: a valid read even past the count
        h = offset_h + indices[i, 1] * stride_h + cuda.blockIdx.y
        w0 = offset_w + indices[i, 2] * stride_w
        return i < active, n, h, w0, 0 <= n < N and 0 <= h < H

    @cuda.jit
    def copy_rows(image, blocks, indices, count, N, H, W, CV, size_h, size_w, stride_h, stride_w,
                  offset_h, offset_w):
        """Plain: blocks [n_blocks, bh, bw, C]; CV vectors a pixel."""
        live, n, h, w0, row_ok = row_of(indices, count, N, H, stride_h, stride_w, offset_h, offset_w)
        row_ok = row_ok and live  # a gather's row past the count: zeros, as a window off the image
        if scatter and not row_ok:
            return
        total = size_w * CV
        lo = (min(max(w0, 0), w0 + size_w) - w0) * CV  # vectors left of the image
        hi = (max(min(w0 + size_w, W), w0) - w0) * CV
        if not row_ok:
            hi = lo  # a gather writes zeros
        image_row = ((int64(n) * H + h) * W + w0) * CV * WIDTH  # (off the image left of lo: not read)
        block_row = ((int64(cuda.blockIdx.x) * size_h + cuda.blockIdx.y) * size_w) * CV * WIDTH
        threads = cuda.blockDim.x
        values = cuda.local.array((ROW_UNROLL, WIDTH), element)
        olds = cuda.local.array((ROW_UNROLL, WIDTH), element)
        for start in range(cuda.threadIdx.x, total, threads * ROW_UNROLL):
            for u in range(ROW_UNROLL):  # every load first: ROW_UNROLL in flight
                v = start + u * threads
                inside = lo <= v < hi
                if scatter:
                    got = load(blocks, uint64(block_row + v * WIDTH)) if inside else zeros()
                    old = load(image, uint64(image_row + v * WIDTH)) if inside and add else zeros()
                    for k in range(WIDTH):
                        olds[u, k] = old[k]
                else:
                    got = load(image, uint64(image_row + v * WIDTH)) if inside else zeros()
                for k in range(WIDTH):
                    values[u, k] = got[k]
            for u in range(ROW_UNROLL):
                v = start + u * threads
                if WIDTH == 4:
                    got = values[u, 0], values[u, 1], values[u, 2], values[u, 3]
                    old = olds[u, 0], olds[u, 1], olds[u, 2], olds[u, 3]
                else:
                    got = values[u, 0], values[u, 1]
                    old = olds[u, 0], olds[u, 1]
                if scatter:
                    if lo <= v < hi:
                        store(image, uint64(image_row + v * WIDTH), plus(got, old) if add else got)
                elif v < total:
                    store(blocks, uint64(block_row + v * WIDTH), got)

    @cuda.jit(device=True, inline=True)
    def tile_vector(u):
        """This thread's image-side vector u of a transposing tile: (s, q), tile pixel s,
        channels 4q... of the tile's."""
        return cuda.threadIdx.x // CQ + STEP * u, cuda.threadIdx.x % CQ

    @cuda.jit(device=True, inline=True)
    def image_vector(u, n, h0, w0, p0, c0, N, H, W, C, size_w, area):
        """`tile_vector(u)`'s (s, q), its flat offset in the image (channels c0 + 4q...), and
        whether it lies in the window and the image. Tile pixel s is pixel p0 + s of the
        window's rows read as one run: row (p0 + s) // size_w."""
        s, q = tile_vector(u)
        p = p0 + s
        r = int32(uint32(p) // uint32(size_w))  # (32-bit: a 64-bit division is a call)
        h = h0 + r
        w = w0 + (p - r * size_w)
        inside = p < area and c0 + 4 * q < C and 0 <= n < N and 0 <= h < H and 0 <= w < W
        return s, q, uint64(((n * H + h) * W + w) * C + c0 + 4 * q), inside

    @cuda.jit(device=True, inline=True)
    def block_step(u, p0, c0, C, area):
        """This thread's block-side step u of a transposing tile: (k, c), channel c0 + c, tile
        pixels BV k..., and whether it lies in the window and its channels."""
        e = cuda.threadIdx.x + u * ROW_TILE_THREADS
        k, c = e % SQ, e // SQ
        return k, c, c0 + c < C and p0 + BV * k < area

    @cuda.jit(device=True, inline=True)
    def load_staged(array, offset, inside):
        """array[offset:offset + 4] as staged (fp16: its 2 words), or zeros where not `inside`."""
        if HALF:
            if inside:
                return load4_words(array, (offset,))
            return uint32(0), uint32(0)
        if inside:
            return load4(array, (offset,))
        return float32(0), float32(0), float32(0), float32(0)

    @cuda.jit(device=True, inline=True)
    def widened(staging, u, j):
        """Value j of staged vector u, as float32."""
        if HALF:
            low, high = floats_of_half2(staging[u, j // 2])
            return high if j % 2 else low
        return staging[u, j]

    @cuda.jit
    def copy_rows_transposed(image, blocks, indices, count, N, H, W, C, size_h, size_w, stride_h, stride_w,
                             offset_h, offset_w):
        """blocks [n_blocks, C, bh, bw]; C a multiple of 4; ROW_TILE_THREADS threads. Thread block
        (i, y, z) takes pixels y * PT... of window i, its rows read one after another as one
        run (tiles cross rows), and channels z * CT...: for a channel, the tile's pixels are
        one run of the block, written or read as one. Every loop loads all its values before
        it stores any: stored as they came, each load waited for the one before (the loop is
        not unrolled)."""
        if window_major:
            tiles = uint32((size_h * size_w + PT - 1) // PT)
            chunks = uint32((C + CT - 1) // CT)
            b = uint32(cuda.blockIdx.x)
            iz = b // tiles
            y = int32(b - iz * tiles)
            i = int32(iz // chunks)
            z = int32(iz - uint32(i) * chunks)
        else:
            i, y, z = cuda.blockIdx.x, cuda.blockIdx.y, cuda.blockIdx.z
        active = count[0]  # read with the window's indices (i < their rows: valid past the count)
        n = int64(indices[i, 0])
        h0 = offset_h + indices[i, 1] * stride_h
        w0 = offset_w + indices[i, 2] * stride_w
        if i >= active:
            n = int64(-1)  # a gather's row past the count: zeros, as a window of no image
        if scatter and not 0 <= n < N:
            return  # the same for the whole thread block, before the barrier (a scatter's window
            # of no image lands nowhere)
        p0 = int32(y) * PT
        c0 = int32(z) * CT
        area = size_h * size_w  # the window's pixels: a channel's run in the block
        tile = cuda.shared.array(TILE_SHAPE_ROWS, float32)
        block_run = int64(i) * C * area + p0  # channel 0's first tile pixel
        # Arithmetic in float32: fp16 operators are calls, and arrays live across calls go to
        # local memory.
        values = cuda.local.array((PER_MOST, WORDS), staged)
        olds = cuda.local.array((PER, WORDS), staged)
        singles = cuda.local.array(PER_B, float32)  # block_width 1 (a fallback: widened as loaded)
        # The image side: vector (s, q) is tile pixel s, channels c0 + 4q...; the block side:
        # step (k, c) is channel c0 + c, tile pixels BV k...
        if scatter:
            for u in range(PER_B):
                k, c, inside = block_step(u, p0, c0, C, area)
                at = uint64(block_run + (c0 + c) * area + BV * k)
                if BV == 4:
                    got = load_staged(blocks, at, inside)
                    for j in range(WORDS):
                        values[u, j] = got[j]
                elif inside:
                    singles[u] = float32(blocks[at])
            if add:  # the old values of what this thread writes below, loaded with the blocks
                for u in range(PER):
                    _, _, at, inside = image_vector(u, n, h0, w0, p0, c0, N, H, W, C, size_w, area)
                    old = load_staged(image, at, inside)
                    for j in range(WORDS):
                        olds[u, j] = old[j]
            for u in range(PER_B):
                k, c, _ = block_step(u, p0, c0, C, area)  # (past the window: unused)
                if BV == 4:
                    for j in range(4):
                        tile[4 * k + j, c] = widened(values, u, j)
                else:
                    tile[k, c] = singles[u]
            cuda.syncthreads()  # the tile holds the blocks' values
            for u in range(PER):
                s, q, at, inside = image_vector(u, n, h0, w0, p0, c0, N, H, W, C, size_w, area)
                if inside:
                    # An add in float32 rounded once to `element` is the element's own sum (fp16:
                    # float32's 24 bits >= 2 x 11 + 2, so the double rounding is exact); element()
                    # of a tile value alone is exact (it came from an `element`).
                    a, b, c, d = tile[s, 4 * q], tile[s, 4 * q + 1], tile[s, 4 * q + 2], tile[s, 4 * q + 3]
                    if add:
                        a, b = a + widened(olds, u, 0), b + widened(olds, u, 1)
                        c, d = c + widened(olds, u, 2), d + widened(olds, u, 3)
                    store4(image, (at,), (element(a), element(b), element(c), element(d)))
        else:
            for u in range(PER):
                _, _, at, inside = image_vector(u, n, h0, w0, p0, c0, N, H, W, C, size_w, area)
                got = load_staged(image, at, inside)
                for j in range(WORDS):
                    values[u, j] = got[j]
            for u in range(PER):
                s, q = tile_vector(u)
                for j in range(4):
                    tile[s, 4 * q + j] = widened(values, u, j)  # (zeros outside)
            cuda.syncthreads()  # the tile holds the image's values
            for u in range(PER_B):
                k, c, inside = block_step(u, p0, c0, C, area)
                if inside:
                    s = BV * k
                    at = uint64(block_run + (c0 + c) * area + s)
                    if BV == 4:
                        store4(blocks, (at,), (element(tile[s, c]), element(tile[s + 1, c]),
                                               element(tile[s + 2, c]), element(tile[s + 3, c])))
                    else:
                        blocks[at] = element(tile[s, c])

    return copy_rows_transposed if transpose else copy_rows
