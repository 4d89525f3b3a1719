"""Plain NCHW fp16 gathers and scatters two or four halves a word.

Where a window's rows start on words (odd first columns included), rows go as
int32 words of two halves, or int64 words of four where widths are multiples
of 4; scatters of quads and atomic adds lay a strip of windows side by side in
each warp (``pair_strips``).
"""

from numba import cuda, int32, int64, uint64

from ..runtime.backend import SIMULATOR
from .device import WARP, joined, joined_quad, put_quad, put_word


def make_pair_kernels(cfg, scatter, add, atomic, halves=2, strip=False):
    """Plain copies between an NCHW fp16 image and NCHW blocks, ``halves`` (2 or 4) halves a word.

    A window row of channel c is size_w contiguous halves on both sides, but a
    window may start at an odd column (every window does at SparseResBlock's
    offset of -1), where the element kernel's 2-byte accesses run at about half
    the copy bandwidth. The launcher checked that every row of both
    sides starts on a word: W and size_w multiples of ``halves``, both pointers
    aligned to a word.

    A thread writes one aligned word of its destination (a block row's for a
    gather, an image row's for a scatter) from the one or two aligned source
    words that hold its halves (`joined`, `joined_quad`). So nothing moves at
    a half's offset but, in an atomic scatter (words of two halves only), the
    image words at a window row's two ends, which it shares with the
    neighbouring windows: there the window's half is added alone. Other
    scatters take windows that start on a word only (`pair_path`: with their
    ends' halves apart they ran 10-20 % slower than the element kernel), so
    they write whole words. Words of four halves (int64: `PAIR_HALVES`) move
    twice the bytes a load of the same count of loads and registers. Thread t
    takes word t % D of rows t // D, t // D + per_pass, ... of the window's
    C * size_h rows (D words a row): a division once a thread, the row's channel
    and row carried along.

    With ``strip`` a thread block takes G = 32 // L consecutive windows (L
    lanes a window: `strip_lanes`) instead of one: lane l of a warp takes
    word l % L of window l // L, and warp w rows w, w + 8, ... of the block's
    part, so one warp instruction moves one row of G windows. Where those lie
    side by side (consecutive active windows of a window row) that is one run
    of the image row, whose sectors shared at the windows' seams go in one
    request; one window a thread block asks for 8 image rows of 32-36 bytes,
    three in four of them straddling two sectors (1400-byte image rows). The
    DRAM bytes stay the same; scatters gain by fewer, fuller
    L2 requests, gathers lose by writing their block rows a window apart.
    """
    COPY_THREADS = cfg.copy_threads
    PAIR_MAX_REGISTERS = cfg.pair_max_registers
    PAIR_UNROLL = cfg.pair_unroll
    prefetch_old = add and not atomic
    quad = halves == 4
    word = int64 if quad else int32
    shift = 2 if quad else 1  # log2(halves)

    @cuda.jit(**({} if PAIR_MAX_REGISTERS is None or SIMULATOR else {"max_registers": PAIR_MAX_REGISTERS}))
    def copy_pairs(image, blocks, indices, count, halves_, N, C, H, W, size_h, size_w, stride_h, stride_w,
                   offset_h, offset_w, lanes_):
        """image, blocks: words, flat; halves_: the image as float16 (an atomic add's ends);
        lanes_: with ``strip``, the lanes a window's row takes (`strip_lanes`)."""
        t = cuda.threadIdx.x
        if strip:
            lane = t % WARP
            slot = lane // lanes_
            i = cuda.blockIdx.x * (WARP // lanes_) + slot
            if slot >= WARP // lanes_ or i >= indices.shape[0]:
                return  # (no barrier in this kernel)
        else:
            i = cuda.blockIdx.x
        live = i < count[0]  # a gather's row past the count: zeros, as a window off the image
        if scatter and not live:
            return
        n = indices[i, 0]
        h0 = offset_h + indices[i, 1] * stride_h
        w0 = offset_w + indices[i, 2] * stride_w
        n_ok = live and 0 <= n < N
        if scatter and not n_ok:
            return
        phase = w0 & (halves - 1)  # halves into the first source word the window starts
        odd = phase != 0
        row_words = size_w >> shift  # a block row's
        image_words = W >> shift  # an image row's
        D = row_words + (1 if odd and scatter else 0)  # destination words a row
        if strip:
            d = lane % lanes_
            if d >= D:
                return  # (an atomic scatter's window at an even column: one word fewer)
            per_pass = COPY_THREADS // WARP
            first_row = t // WARP
        else:
            per_pass = COPY_THREADS // D
            if t >= per_pass * D:
                return
            d = t % D
            first_row = t // D
        rows = C * size_h
        per_part = -(-rows // cuda.gridDim.y)
        row = cuda.blockIdx.y * per_part + first_row
        row_end = min(rows, (cuda.blockIdx.y + 1) * per_part)
        c = row // size_h
        r = row - c * size_h
        dc = per_pass // size_h
        dr = per_pass - dc * size_h
        k = (w0 >> shift) + d  # the image word: a gather's first source, a scatter's destination
        if scatter:
            col = k << shift  # the image column of the destination's first half ...
            p = col - w0  # ... and its half of the block row
            low_ok = 0 <= p and 0 <= k < image_words
            high_ok = p + 1 < size_w and 0 <= k < image_words
            m = d - (1 if odd else 0)  # the block word holding half p
            first = min(max(m, 0), row_words - 1)
            second = min(m + 1, row_words - 1)
        else:
            col = w0 + (d << shift)  # the image column of the destination's first half
            first = min(max(k, 0), image_words - 1)
            second = min(max(k + 1, 0), image_words - 1)
            bits = uint64(0)
            for h_ in range(halves):
                if 0 <= col + h_ < W:
                    bits |= uint64(0xFFFF) << uint64(16 * h_)
            keep = word(bits)
        nc = min(max(n, 0), N - 1)
        rv = cuda.local.array(PAIR_UNROLL, int64)
        cv = cuda.local.array(PAIR_UNROLL, int64)
        hv = cuda.local.array(PAIR_UNROLL, int64)
        values = cuda.local.array(PAIR_UNROLL, word)
        olds = cuda.local.array(PAIR_UNROLL, word)
        while row < row_end:
            for u in range(PAIR_UNROLL):
                rv[u] = row
                cv[u] = c
                hv[u] = h0 + r
                row += per_pass
                c += dc
                r += dr
                if r >= size_h:
                    r -= size_h
                    c += 1
            for u in range(PAIR_UNROLL):  # all loads first: PAIR_UNROLL in flight
                cu = min(cv[u], C - 1)  # the last pass may run past the window: read a valid address
                h = hv[u]
                if scatter:
                    at = (int64(i) * rows + min(rv[u], rows - 1)) * row_words
                    low = blocks[uint64(at + first)]
                    if quad:
                        values[u] = low  # (a quad scatter's windows start on words)
                    else:
                        values[u] = joined(low, blocks[uint64(at + second)] if odd else low, odd)
                    if prefetch_old:
                        at = ((int64(n) * C + cu) * H + min(max(h, 0), H - 1)) * image_words
                        olds[u] = image[uint64(at + min(max(k, 0), image_words - 1))]
                else:
                    at = ((int64(nc) * C + cu) * H + min(max(h, 0), H - 1)) * image_words
                    low = image[uint64(at + first)]
                    high = image[uint64(at + second)] if odd else low
                    value = joined_quad(low, high, phase) if quad else joined(low, high, odd)
                    values[u] = value & keep if n_ok and 0 <= h < H else word(0)
            for u in range(PAIR_UNROLL):
                if rv[u] < row_end:
                    if not scatter:
                        blocks[uint64((int64(i) * rows + rv[u]) * row_words + d)] = values[u]
                    elif (low_ok or high_ok) and 0 <= hv[u] < H:
                        at = ((int64(n) * C + cv[u]) * H + hv[u]) * image_words + k
                        if quad:
                            put_quad(image, at, values[u], olds[u], add)
                        else:
                            put_word(image, halves_, at, values[u], olds[u], low_ok, high_ok, add, atomic)

    return copy_pairs
