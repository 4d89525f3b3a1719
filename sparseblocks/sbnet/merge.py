"""A scatter into a copy of y in one pass: every pixel written once.

`link_windows` links the blocks into a map of the windows (a chain where
several blocks share one); the merge kernel then writes each pixel of the copy
as y's value plus (or replaced by) the values of the windows over it, read
through the map. Applies to channels-last blocks covering ``merge_min_cover``
of the image or more.
"""

import numpy as np
from numba import cuda, from_dtype, int32, int64, uint32, uint64

from .device import vector_ops

CHAINED = 1 << 30  # a window map entry's flag: more blocks of the same window follow in the chain


@cuda.jit
def fill_int32(array, value):
    i = cuda.grid(1)
    if i < array.size:
        array[i] = value


@cuda.jit
def link_windows(slots, chain, indices, count, n_blocks, N, count_h, count_w, first_h, first_w, fill):
    """The window map of a merging scatter: ``slots`` [N, count_h, count_w] (every window whose
    rows and columns reach the image; -1: none) gets each block's row i, below the count, at its
    window; a window given more than once keeps one row there, flagged CHAINED, and the others
    in ``chain`` (row -> next row of the same window, or -1). Windows of no image or off it are
    left out: they write nothing. With ``fill`` the launch is one thread block, which empties
    the map itself first (one launch fewer where the map is small), else it was filled with -1
    before."""
    if fill:
        for k in range(cuda.threadIdx.x, slots.size, cuda.blockDim.x):
            slots[k] = -1
        cuda.syncthreads()  # the map is empty before any row is linked into it
    for i in range(cuda.grid(1), min(n_blocks, count[0]), cuda.gridsize(1)):
        n = indices[i, 0]
        r = int64(indices[i, 1]) - first_h
        c = int64(indices[i, 2]) - first_w
        if 0 <= n < N and 0 <= r < count_h and 0 <= c < count_w:
            at = (int64(n) * count_h + r) * count_w + c
            before = cuda.atomic.exch(slots, at, int32(i))
            if before == -1:
                chain[i] = -1
            else:  # (the last row exchanged in sees a row before it, so the flag is set at the end)
                chain[i] = before & (CHAINED - 1)
                cuda.atomic.or_(slots, at, int32(CHAINED))


def make_merge_kernels(cfg, add, vector_dtype, half2):
    """A scatter into a copy of an NHWC image in one pass: thread block (row, k) writes pixels
    k * P... of image row ``row`` (n * H + h), every 16-byte vector of each, as y's value plus
    (``add``) or replaced by (else) the block values of the windows over it.

    The arrays are flat views of ``vector_dtype`` elements, as the row copies'. A pixel lies
    in at most two windows along each axis (the launcher checked 2 * stride >= size), so the
    windows over image row h are found once per thread block and those over a pixel by one
    division. Their map entries for the thread block's run (the two window rows, the windows
    the run reaches) are read once into shared memory. A window repeated in the indices adds
    every block of it (its chain); overwriting, the first window found lands. Sums go in the
    order of the windows' positions, not of their rows: one pixel's result does not depend on
    how the blocks were listed (unless a window repeats)."""
    MERGE_SPAN = cfg.merge_span
    MERGE_UNROLL = cfg.merge_unroll
    WIDTH, load, store, zeros, plus = vector_ops(vector_dtype, half2)
    element = from_dtype(np.dtype(vector_dtype))

    @cuda.jit(device=True, inline=True)
    def window_of(x, stride, size, count):
        """The windows over coordinate x (relative to the first window's start) along one axis:
        (the later one or -1, its offset in it, the earlier one or -1, its offset)."""
        later, earlier, d = -1, -1, 0
        if x >= 0:
            j = int32(uint32(x) // uint32(stride))
            d = x - j * stride
            if j < count and d < size:
                later = j
            if 1 <= j <= count and d + stride < size:
                earlier = j - 1
        return later, d, earlier, d + stride

    @cuda.jit(device=True, inline=True)
    def take(acc, found, entry, blocks, chain, d, e, q, size_h, size_w, CV):
        """acc plus (or replaced by, where none was found yet) the values at window row d,
        column e, vector q of the blocks of map entry ``entry`` (-1: none)."""
        if entry == -1:
            return acc, found
        slot = entry & (CHAINED - 1)
        while slot >= 0:
            got = load(blocks, uint64((((int64(slot) * size_h + d) * size_w + e) * CV + q) * WIDTH))
            if add:
                acc = plus(acc, got)
            elif not found:
                acc = got
            found = True
            slot = chain[slot] if add and entry & CHAINED else -1  # (overwriting: one block lands)
        return acc, found

    @cuda.jit(device=True, inline=True)
    def load_run(olds, y, row_start, start, total, threads):
        """y's vectors start, start + threads, ... (MERGE_UNROLL of them, zeros past the run's
        total) into ``olds``: all loads in flight before any is used."""
        for u in range(MERGE_UNROLL):
            v = start + u * threads
            got = load(y, uint64((row_start + v) * WIDTH)) if v < total else zeros()
            for k in range(WIDTH):
                olds[u, k] = got[k]

    @cuda.jit
    def merge_rows(out, y, blocks, slots, chain, N, H, W, CV, size_h, size_w, stride_h, stride_w,
                   start_h, start_w, count_h, count_w, P):
        """out, y: [N, H, W, C] as CV vectors a pixel; blocks [n_blocks, bh, bw, C]; slots: the
        window map (`link_windows`), whose first window starts at image row start_h, column
        start_w; P pixels a thread block."""
        row = uint32(cuda.blockIdx.x)
        n = int32(row // uint32(H))
        h = int32(row - uint32(n) * uint32(H))
        w0 = int32(cuda.blockIdx.y) * P
        pixels = min(P, W - w0)
        total = pixels * CV
        threads = cuda.blockDim.x
        r_late, d_late, r_early, d_early = window_of(h - start_h, stride_h, size_h, count_h)
        # The windows the run's pixels lie in: columns lo..hi of the map.
        x_lo = w0 - start_w
        x_hi = x_lo + pixels - 1
        lo = 0
        if x_lo >= 0:
            lo = max(int32(uint32(x_lo) // uint32(stride_w)) - 1, 0)
        hi = -1
        if x_hi >= 0:
            hi = min(int32(uint32(x_hi) // uint32(stride_w)), count_w - 1)
        span = max(hi - lo + 1, 0)
        row_start = (int64(row) * W + w0) * CV  # the run's first vector
        olds = cuda.local.array((MERGE_UNROLL, WIDTH), element)
        start = cuda.threadIdx.x
        load_run(olds, y, row_start, start, total, threads)  # (in flight while the map is read)
        entries = cuda.shared.array((2, MERGE_SPAN), int32)
        map_row = int64(n) * count_h
        for k in range(cuda.threadIdx.x, 2 * span, threads):
            which = 1 if k >= span else 0
            c = k - which * span
            r = r_early if which else r_late
            entries[which, c] = slots[(map_row + r) * count_w + lo + c] if r >= 0 else -1
        cuda.syncthreads()  # the run's window map entries are in shared memory
        while start < total:
            if start > cuda.threadIdx.x:
                load_run(olds, y, row_start, start, total, threads)
            for u in range(MERGE_UNROLL):
                v = start + u * threads
                if v < total:
                    if WIDTH == 4:
                        acc = olds[u, 0], olds[u, 1], olds[u, 2], olds[u, 3]
                    else:
                        acc = olds[u, 0], olds[u, 1]
                    p = int32(uint32(v) // uint32(CV))
                    q = v - p * CV
                    c_late, e_late, c_early, e_early = window_of(w0 + p - start_w, stride_w, size_w, count_w)
                    found = False
                    if r_late >= 0:
                        if c_late >= 0:
                            acc, found = take(acc, found, entries[0, c_late - lo], blocks, chain, d_late, e_late,
                                              q, size_h, size_w, CV)
                        if c_early >= 0:
                            acc, found = take(acc, found, entries[0, c_early - lo], blocks, chain, d_late,
                                              e_early, q, size_h, size_w, CV)
                    if r_early >= 0:
                        if c_late >= 0:
                            acc, found = take(acc, found, entries[1, c_late - lo], blocks, chain, d_early,
                                              e_late, q, size_h, size_w, CV)
                        if c_early >= 0:
                            acc, found = take(acc, found, entries[1, c_early - lo], blocks, chain, d_early,
                                              e_early, q, size_h, size_w, CV)
                    store(out, uint64((row_start + v) * WIDTH), acc)
            start += threads * MERGE_UNROLL

    return merge_rows
