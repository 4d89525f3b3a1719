"""NCHW fp16 images against NHWC blocks, by words: adding scatters and gathers.

A tile of ``pair_tile_pairs`` channel pairs by whole window rows goes through
shared memory, so that the image side reads and writes 32-bit words of two
pixels and the block side words of two channels. Gathers take whole window
rows whose image words fit ``pair_gather_words``.
"""

from numba import cuda, int32, int64, uint32, uint64

from ..runtime.backend import SIMULATOR
from .device import first_line, next_line, put_word, swapped


def make_pair_tile_kernels(cfg, atomic):
    """Adding scatters of NHWC blocks into an NCHW fp16 image, two halves a word on both sides.

    The block side moves a pixel's channels in pairs, the image side a
    channel's pixels in pairs (a window row's words, as `make_pair_kernels`):
    a thread takes pixel p's and p + 1's words of channels c and c + 1 from the
    shared tile and swaps their halves (a 2 x 2 transpose in registers) into
    channel c's and c + 1's words of the two pixels. The tile holds
    PAIR_TILE_PAIRS channel pairs of whole window rows (at most
    PAIR_TILE_PIXELS pixels), so both sides' accesses are 4 bytes where the
    generic tile moved 2. Thread block (i, y, z) takes window i's rows y * R...
    (R whole rows a tile) and channel pairs z * PAIR_TILE_PAIRS.... The launcher
    checked what `pair_path` does (even widths, 4-byte alignment, a scatter
    that is not atomic only at even columns, an even C). An atomic scatter's
    image words at a window row's ends get the window's half alone, as the pair
    kernels'. (Gathers swap after the tile: `make_pair_tile_gathers`.)

    The tile's pixels are one run of the blocks, read with no division,
    PAIR_TILE_LOADS loads a thread in flight. On the image's side a thread
    keeps its word of the row and carries its line's channel pair and row (one
    division a thread); its first PAIR_TILE_UNROLL items' old words, which do
    not depend on the tile, are loaded before the tile is filled, so both
    phases' reads are in flight at once. Coordinates are carried, not divided
    for each item (a division by a run-time count costs tens of instructions).
    """
    PAIR_TILE_LOADS = cfg.pair_tile_loads
    PAIR_TILE_MAX_REGISTERS = cfg.pair_tile_max_registers
    PAIR_TILE_PAIRS = cfg.pair_tile_pairs
    PAIR_TILE_PIXELS = cfg.pair_tile_pixels
    PAIR_TILE_THREADS = cfg.pair_tile_threads
    PAIR_TILE_UNROLL = cfg.pair_tile_unroll
    CP = PAIR_TILE_PAIRS
    TP = PAIR_TILE_PIXELS
    T = PAIR_TILE_THREADS
    U = PAIR_TILE_UNROLL
    TILE_WORDS = TP * (CP + 1)  # [tile pixel][channel pair], flat; +1: an odd row stride (banks)
    LOADS = min(-(-TP * CP // T), PAIR_TILE_LOADS)  # phase 1's loads a thread in flight ...
    PASSES = -(-TP * CP // (T * LOADS))  # ... in this many passes
    if T % CP or T < TP // 2 + 1:
        raise ValueError("PAIR_TILE_THREADS: expected a multiple of PAIR_TILE_PAIRS, no fewer than a window "
                         "row's image words (PAIR_TILE_PIXELS // 2 + 1)")

    @cuda.jit(device=True, inline=True)
    def next_items(image, items, olds, line, qq, rr, lines, per_pass, dq, dr, rows, h, H, k_ok, at, plane,
                   image_words):
        """Phase 2's next U items from line ``line`` (pair qq, tile row rr; h: the tile's first image
        row, at: channel 2 q0's word there): ``items`` (rr + 65536 qq: rr < TP, qq < CP; -1: none) and, not atomic,
        the two channels' old image words loaded; the carried (line, qq, rr) after them."""
        for u in range(U):
            items[u] = -1
            if line < lines:
                if k_ok and 0 <= h + rr < H:
                    items[u] = rr | (qq << 16)
                    if not atomic:
                        spot = at + (int64(2 * qq) * H + rr) * image_words
                        olds[u, 0] = image[uint64(spot)]
                        olds[u, 1] = image[uint64(spot + plane)]
                # (written out, not `next_line`: with it, ptxas's allocation at PAIR_TILE_MAX_REGISTERS
                # gave wrong sums on the GPU, though correct uncapped)
                line += per_pass
                qq += dq
                rr += dr
                if rr >= rows:
                    rr -= rows
                    qq += 1
        return line, qq, rr

    @cuda.jit(**({} if PAIR_TILE_MAX_REGISTERS is None or SIMULATOR else {"max_registers": PAIR_TILE_MAX_REGISTERS}))
    def copy_pair_tiles(image, blocks, indices, count, halves, N, C, H, W, size_h, size_w, stride_h, stride_w,
                        offset_h, offset_w):
        """image, blocks: int32 words, flat; halves: the image as float16 (an atomic add's ends)."""
        i = cuda.blockIdx.x
        if i >= count[0]:
            return  # the same for the whole thread block, before the barrier
        n = indices[i, 0]
        h0 = offset_h + indices[i, 1] * stride_h  # (64-bit: a far window's start must not wrap)
        w0 = offset_w + indices[i, 2] * stride_w
        if not 0 <= n < N:
            return  # the same for the whole thread block, before the barrier
        tile = cuda.shared.array(TILE_WORDS, uint32)
        size_w = int32(size_w)  # (at most PAIR_TILE_PIXELS)
        R = TP // size_w  # window rows a tile
        r0 = int32(cuda.blockIdx.y * R)
        rows = min(R, int32(size_h) - r0)
        q0 = int32(cuda.blockIdx.z * CP)
        pairs = min(CP, int32(C >> 1) - q0)
        t = int32(cuda.threadIdx.x)
        # Phase 2 (the image's side) is placed first: thread t takes image word t % D of the
        # (channel pair, tile row) lines t // D, + T // D, ... (as `first_line` does, written out:
        # see `next_items`). Its first items' old words do not depend on the tile: they are loaded
        # before it, so both phases' reads are in flight at once.
        odd = int32(w0 & 1)
        D = (size_w >> 1) + odd  # image-side words a row
        per_pass = T // D
        d = t % D
        line = t // D
        qq = line // rows
        rr = line - qq * rows
        dq = per_pass // rows
        dr = per_pass - dq * rows
        lines = pairs * rows if t < per_pass * D else 0  # (the threads past the last whole pass: none)
        image_words = W >> 1
        k = (w0 >> 1) + d  # the image word: columns 2k, 2k + 1, window pixels p, p + 1
        p = 2 * d - odd
        low_in = p >= 0
        high_in = p + 1 < size_w
        plane = int64(H) * image_words  # words of a channel's plane
        at = ((int64(n) * C + 2 * q0) * H + h0 + r0) * image_words + k  # channel 2 q0's, row r0's word k
        items = cuda.local.array(U, int32)
        olds = cuda.local.array((U, 2), int32)
        k_ok = 0 <= k < image_words
        line, qq, rr = next_items(image, items, olds, line, qq, rr, lines, per_pass, dq, dr, rows, h0 + r0, H, k_ok,
                                  at, plane, image_words)
        # Phase 1: the tile's pixels are whole window rows, one run of the blocks: thread t takes
        # channel pair t % CP of pixels t // CP, + T // CP, ... (CP a constant: no division).
        q = t % CP
        step = T // CP
        pixels = rows * size_w
        first = (int64(i) * size_h + r0) * size_w * (C >> 1) + q0 + q  # the tile's pixel 0, pair q
        values = cuda.local.array(LOADS, uint32)
        for pass_ in range(0, PASSES * LOADS, LOADS):
            for u in range(LOADS):  # LOADS in flight
                pu = t // CP + (pass_ + u) * step
                if q < pairs and pu < pixels:
                    values[u] = uint32(blocks[uint64(first + int64(pu) * (C >> 1))])
            for u in range(LOADS):
                pu = t // CP + (pass_ + u) * step
                if q < pairs and pu < pixels:
                    tile[uint32(pu * (CP + 1) + q)] = values[u]
        cuda.syncthreads()  # the tile holds the blocks' words
        while True:
            for u in range(U):
                if items[u] >= 0:
                    item_r = items[u] & 0xFFFF
                    item_q = items[u] >> 16
                    place = (item_r * size_w + p) * (CP + 1) + item_q  # (the low half's pixel)
                    low = tile[uint32(place)] if low_in else uint32(0)
                    high = tile[uint32(place + CP + 1)] if high_in else uint32(0)
                    firsts = swapped(low, high)  # (channel c's word, channel c + 1's)
                    spot = at + (int64(2 * item_q) * H + item_r) * image_words
                    for j in range(2):
                        put_word(image, halves, spot + j * plane, int32(firsts[j]), olds[u, j], low_in, high_in,
                                  True, atomic)
            if line >= lines:
                break
            line, qq, rr = next_items(image, items, olds, line, qq, rr, lines, per_pass, dq, dr, rows, h0 + r0, H,
                                      k_ok, at, plane, image_words)

    return copy_pair_tiles


def make_pair_tile_gathers(cfg):
    """Gathers of an NCHW fp16 image into NHWC blocks (through the transpose), two halves a word.

    Thread block (i, y, z) takes window i's channels y * CG... (CG = 2 *
    PAIR_GATHER_PAIRS) and rows z * R... (R a launch argument: the rows whose
    words fit PAIR_GATHER_WORDS). First the image words that cover each
    (channel, row) line of that piece (D a line: the window's row from the
    word holding its first half; windows at odd columns read a word more) go
    into a shared tile ``raw[channel][row][word]``, PAIR_TILE_UNROLL loads a
    thread in flight, zero off the image, for a window of no image and for
    rows past the count: thread t takes word t % D of lines t // D, + T // D,
    ..., the line's channel and row carried. Then a thread takes a block word,
    pixel p's halves of channels c and c + 1: two shared words, the halves
    picked by the column's parity. Consecutive threads take consecutive
    channel pairs of a pixel, so a warp writes two pixels' runs of 2 * CG
    bytes; one channel's lines start an odd count of words after the previous
    channel's in the tile (``stride``), so those 16 reads hit 16 banks and the
    next pixel's the others (or the same words). One division a thread,
    coordinates carried rather than divided for every item (tens of
    instructions a division by a run-time count). The launcher checked what `pair_gather_rows`
    does (W and C even, 4-byte aligned pointers, window rows of at most
    PAIR_TILE_PIXELS pixels).
    """
    PAIR_GATHER_PAIRS = cfg.pair_gather_pairs
    PAIR_GATHER_WORDS = cfg.pair_gather_words
    PAIR_TILE_THREADS = cfg.pair_tile_threads
    PAIR_TILE_UNROLL = cfg.pair_tile_unroll
    CG = 2 * PAIR_GATHER_PAIRS
    T = PAIR_TILE_THREADS
    U = PAIR_TILE_UNROLL

    @cuda.jit
    def gather_pair_tiles(image, blocks, indices, count, N, C, H, W, size_h, size_w, stride_h, stride_w,
                          offset_h, offset_w, R):
        """image, blocks: int32 words, flat; R: window rows a thread block."""
        i = cuda.blockIdx.x
        raw = cuda.shared.array(PAIR_GATHER_WORDS, uint32)
        n = indices[i, 0]
        h0 = offset_h + indices[i, 1] * stride_h
        w0 = offset_w + indices[i, 2] * stride_w
        ok = i < count[0] and 0 <= n < N
        nc = min(max(n, 0), N - 1)
        c0 = cuda.blockIdx.y * CG
        channels = min(CG, C - c0)
        r0 = cuda.blockIdx.z * R
        rows = min(R, size_h - r0)
        odd = w0 & 1
        D = (odd + size_w + 1) >> 1  # image words a row
        stride = (rows * D) | 1  # words from a channel's lines in the tile to the next's (odd: see above)
        image_words = W >> 1
        k0 = w0 >> 1  # the image word holding the window row's first half
        t = cuda.threadIdx.x
        # Phase 1: thread t takes word t % D of the tile's (channel, row) lines t // D, + T // D,
        # ... (`first_line`).
        d, line, c, rr, per_pass, dc, dr, lines = first_line(t, T, D, rows, channels)
        k = k0 + d
        k_ok = ok and 0 <= k < image_words
        plane = ((int64(nc) * C + c0) * H + h0 + r0) * image_words + k  # channel c0's, row r0's word k
        values = cuda.local.array(U, uint32)
        spots = cuda.local.array(U, int32)  # a word's place in the tile (-1: none)
        while line < lines:
            for u in range(U):  # all loads first: U in flight
                spots[u] = -1
                if line < lines:
                    h = h0 + r0 + rr
                    values[u] = uint32(0)
                    if k_ok and 0 <= h < H:
                        values[u] = uint32(image[uint64(plane + (int64(c) * H + rr) * image_words)])
                    spots[u] = c * stride + rr * D + d
                line, c, rr = next_line(line, c, rr, per_pass, dc, dr, rows)
            for u in range(U):
                if spots[u] >= 0:
                    raw[uint32(spots[u])] = values[u]
        cuda.syncthreads()  # the tile holds the piece's image words
        # Phase 2: thread t takes channel pair t % P of pixels t // P, + T // P, ... (P a constant:
        # no division), the pixel's row and column carried.
        P = PAIR_GATHER_PAIRS
        q = t % P
        step = T // P
        j = t // P
        rr = 0
        while j >= size_w:
            j -= size_w
            rr += 1
        dj = step % size_w
        drr = step // size_w
        pairs = channels >> 1
        out = (int64(i) * size_h + r0) * size_w * (C >> 1) + (c0 >> 1) + q
        while rr < rows:
            if q < pairs:
                s_ = odd + j
                at = 2 * q * stride + rr * D + (s_ >> 1)
                a = raw[uint32(at)]  # channel c's word holding the pixel's half ...
                b = raw[uint32(at + stride)]  # ... and channel c + 1's
                if s_ & 1:
                    word = (a >> uint32(16)) | (b & uint32(0xFFFF0000))
                else:
                    word = (a & uint32(0xFFFF)) | (b << uint32(16))
                blocks[uint64(out + (int64(rr) * size_w + j) * (C >> 1))] = int32(word)
            j += dj
            rr += drr
            if j >= size_w:
                j -= size_w
                rr += 1

    return gather_pair_tiles
