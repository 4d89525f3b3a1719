"""The fused products' one kernel: gather + ``mma.sync`` product, or product + adding scatter.

`make_kernel` builds, for a storage (fp16: m16n8k16; fp32: 3xTF32) and a tile
``(rows, cols, words, stages, warps, registers)``, a kernel whose thread block
computes ``rows`` stack pixels (block, window row, window column) by ``cols``
output channels. Each thread works out once where in the image the pixels it
copies lie (zero-filled copies for pixels off the image, blocks past the count
or rows past the stack); input channels then go through a ring of ``stages``
shared buffers, filled by cp.async ``stages - 1`` ahead of the multiply, the
weight's rows beside them, 16-byte units XOR-swizzled (`_swizzle`) so that
neither copies nor fragment reads meet in a bank. An NCHW image's pixels come
a stage ahead in registers instead. With ``scatter`` the kernel reads the
stack's rows in order and adds each result row into the image pixel it lies on.
Indices are unsigned: Numba wraps a signed index round the array's end.
"""

from numba import boolean, cuda, float32, int32, int64, uint32, uint64

from ..ptx.cp_async import commit, copy16_or_zero, global_address, shared_address, waiter
from ..ptx.half2 import add_half2, half2_of_floats
from ..ptx.mma import MMA_M, MMA_N, mma_3xtf32, mma_f16
from ..ptx.nanmax import max_nan
from ..ptx.vector import load4, store2, store4
from ..runtime.backend import SIMULATOR
from ..sbnet.device import FULL_MASK, joined, quotient, swapped

WARP = 32


WARPS = 4  # warps of a thread block, each ROWS / WARPS pixels by all COLS output channels


ROWS = 128  # stack pixels a thread block


COLS = 64  # output channels a thread block


WORDS = 16  # 32-bit words of input channels a stage takes of a pixel (and of a weight row): 16 or 32


STAGES = 3  # shared buffers in the ring (cp.async runs STAGES - 1 stages ahead)


UNIT = 16  # bytes of one cp.async


DTYPES = ("float16", "float32")


MAX_PIXELS = 2**31  # stack pixels (32-bit tile arithmetic, `quotient`)


SHARED_ALIGN = None if SIMULATOR else 16  # cp.async's; the simulator takes none (NumPy's buffers are)


def _swizzle(units):
    """swizzle(r): what a shared row's 16-byte units are XORed with, for rows of `units` units (4
    or 8: 64 or 128 bytes). The 8 rows a warp's fragment reads take at one word (rows r..r+7,
    words t = 0..3 of one unit) then lie in 8 distinct 4-bank groups, and the copies of a
    quarter-warp (a whole 128-byte line) stay in distinct banks: a padding of 4 words a row did
    the first but not the second."""
    rows_a_line = 8 // units

    @cuda.jit(device=True, inline=True)
    def swizzle(r):
        return (r // rows_a_line) % units

    return swizzle


@cuda.jit(device=True, inline=True)
def _window_place(q, indices, active, n_images, height, area, size_w, stride_h, stride_w, offset_h, offset_w,
                  magic_area, magic_w):
    """(n, h, c, whether the row is there) of stack pixel q (block, window row, window column): its
    image, row and column (the column may be off the image); the row is not there where it is off
    the image, its block past the count, or its index out of range."""
    b = quotient(q, magic_area)
    within = q - b * int32(area)
    wr = quotient(within, magic_w)
    if b >= active:
        return int64(0), int64(0), int64(0), False
    n = int64(indices[b, 0])
    h = int64(offset_h) + int64(indices[b, 1]) * stride_h + wr
    c = int64(offset_w) + int64(indices[b, 2]) * stride_w + (within - wr * int32(size_w))
    return n, h, c, 0 <= n < n_images and 0 <= h < height


@cuda.jit(device=True, inline=True)
def _window_pixel(q, indices, active, n_images, height, width, area, size_w, stride_h, stride_w, offset_h,
                  offset_w, magic_area, magic_w, planes):
    """The image pixel that stack pixel q lies on, or -1: off the image, its block past the count,
    or its index out of range. Flat over (n, h, w) where `planes` is 1 (NHWC), the flat index of
    its channel 0 in an NCHW image of `planes` channels."""
    n, h, c, there = _window_place(q, indices, active, n_images, height, area, size_w, stride_h, stride_w,
                                   offset_h, offset_w, magic_area, magic_w)
    if there and 0 <= c < width:
        return (n * planes * height + h) * width + c
    return int64(-1)


def make_kernel(storage, relu, vector_out, rows=ROWS, cols=COLS, words=WORDS, stages=STAGES, warps=WARPS,
                registers=None, scatter=False, nchw=False):
    """The fused gather and product for one storage dtype and tile shape (see the module docstring);
    with `scatter`, the fused product and adding scatter instead.

    Arguments: out ``[pixels, C_out]`` (the result's rows; with `vector_out`, fp16's as int32 words
    ``[pixels, C_out / 2]``), x (the image, flat), w ``[C_out, C]``, indices, count (a one-element
    device array), then the image's and the windows' sizes and `magic` numbers of the window's
    area and width. `vector_out` (C_out a multiple of 8 fp16 or 2 fp32 values, out aligned to
    that): fp16 results go through shared memory to whole 16-byte rows of out, fp32 ones as
    pairs (8 bytes: a lane quad writes a whole 32-byte sector); else value by value.
    `registers`: a cap on the registers a thread (ptxas), or None.

    With `scatter` the roles turn round: x is the block stack (flat, its rows read in order), and
    out the image's pixels ``[N * H * W, C_out]`` (words likewise), into which each result row is
    added at the pixel its stack pixel lies on (`_window_pixel`; none: dropped). The windows must
    not overlap: no two thread blocks add into one pixel.

    With `nchw` the image is NCHW, x its int32 words (fp16: two columns a word, W even; fp32: one
    value), the window's width even. Its channels are not contiguous but its columns are, so the
    tile's pixels come by plain loads of pixel pairs (`load_nchw`: a warp's eight lanes along a
    run of pairs read a window row's run of a channel), one stage ahead in registers, and go into
    the same pixel-major ring by `store_nchw` (fp16: the 2 x 2 transpose of halves, `swapped`, a
    pair at an odd column joined from the two words it straddles, `joined`); the weight still
    comes by cp.async. A ring of 2 stages.

    With `scatter` and `nchw` out is an NCHW image (flat; fp16: its int32 words, W even), and the
    stack pixels of a tile row pair lie on one image word a channel (windows of an even width
    starting at even columns: the launcher's conditions). fp16 results (`vector_out`) leave
    through a channel-major tile in shared memory (`write`: the pairs' halves swapped between
    lanes, then word runs of a channel along the window rows, added by add.rn.f16x2); fp32 ones
    value by value from the fragments (a warp's eight rows are consecutive pixels)."""
    PAIRS = storage == "float16"  # two 16-bit values a word, else one fp32
    ITEM = 2 if PAIRS else 4
    THREADS = warps * WARP
    UNITS = words * 4 // UNIT  # cp.async units of a pixel a stage
    A_TILE = rows * words
    W_TILE = cols * words
    OUT_WORDS = cols // 2  # words of a staged fp16 output row (NT units of 16 bytes)
    STAGED = vector_out and PAIRS
    GATHER_NCHW = nchw and not scatter  # the tile's pixels come from an NCHW image
    SCATTER_NCHW = nchw and scatter  # its results go into one
    # (shared-array shapes must be constants, not expressions; the ring takes the output tile after)
    # A scatter into an NCHW fp16 image stages its tile channel-major: row c (an output channel)
    # holds the words of its tile row pairs, T_STRIDE words apart (4 words of padding: a warp's
    # stores from the fragments then meet 32 distinct banks).
    T_ROWS = rows // 2  # words of a channel's row in that tile
    T_STRIDE = T_ROWS + 4
    T_SIZE = cols * T_STRIDE if STAGED and SCATTER_NCHW else 0
    ITEMS = cols * T_ROWS // THREADS  # the words a thread adds there, C_STEP channels apart
    C_STEP = THREADS // T_ROWS
    A_SIZE = max(stages * A_TILE, rows * OUT_WORDS if STAGED else 0, T_SIZE)
    W_SIZE = stages * W_TILE
    A_PER = rows * UNITS // THREADS  # a thread's copies of a stage
    W_PER = cols * UNITS // THREADS
    ROW_STEP = THREADS // UNITS  # from one of a thread's pixels to its next
    WARP_ROWS = rows // warps
    MT = WARP_ROWS // MMA_M
    NT = cols // MMA_N
    ROW_VALUES = 2 * NT  # a fragment row's values of out (an NCHW fp32 scatter reads them all first)
    STEPS = words // 8  # mma steps a stage: 8 words of k each (k16 of fp16, two k8 of fp32)
    assert rows * UNITS % THREADS == 0 and cols * UNITS % THREADS == 0 and WARP_ROWS % MMA_M == 0
    assert words in (16, 32) and 2 <= stages <= 4
    PIXELS = rows if scatter else 1  # a scatter's target pixels of the tile's rows
    # A scatter with whole 16-byte units of out (`vector_out`) copies the tile's pixels of out into
    # shared memory by cp.async with its first stage, so that their reads overlap the product's,
    # not follow it: the epilogue reads them from there.
    PREFETCH = scatter and vector_out and not nchw  # (an NCHW image's: `write`)
    Y_UNITS = cols * ITEM // UNIT  # 16-byte units of a tile row of out
    Y_SIZE = rows * Y_UNITS * 4 if PREFETCH else 1
    assert not PREFETCH or Y_UNITS % 8 == 0  # (`y_word` swizzles a row's units by r % 8)
    Y_TYPE = uint32 if PAIRS else float32
    # NCHW: a warp fills NCHW_PAIRS pixel pairs of a stage, a lane A_PAIRS of them (8 lanes along the
    # pairs) by J_STEPS words of each (4 lanes along the words); HELD words loaded an item.
    NCHW_PAIRS = rows // 2 // warps
    A_PAIRS = NCHW_PAIRS // 8
    J_STEPS = words // 4
    HELD = 4 if PAIRS else 2
    C_WORD = 2 if PAIRS else 1  # channels a word of a pixel's row holds
    C_STAGE = words * C_WORD  # channels a stage
    if GATHER_NCHW:
        assert stages == 2 and NCHW_PAIRS % 8 == 0
    if SCATTER_NCHW:
        assert vector_out == PAIRS  # (fp16 through the staged tile, fp32 from the fragments)
        assert not PAIRS or THREADS % T_ROWS == 0
    wait = waiter(stages - 2)
    swizzle = _swizzle(UNITS)
    out_swizzle = _swizzle(min(NT, 8))

    @cuda.jit(device=True, inline=True)
    def multiply_add(acc, mt, nt, fa, b0, b1):
        if PAIRS:
            d = mma_f16(fa[mt, 0], fa[mt, 1], fa[mt, 2], fa[mt, 3], b0, b1,
                        acc[mt, nt, 0], acc[mt, nt, 1], acc[mt, nt, 2], acc[mt, nt, 3])
            for q in range(4):
                acc[mt, nt, q] = d[q]
        else:  # 3xTF32 from zero, added in fp32: the tensor cores' own fp32 sums drift (bsmm's finding)
            d = mma_3xtf32(fa[mt, 0], fa[mt, 1], fa[mt, 2], fa[mt, 3], b0, b1,
                           float32(0), float32(0), float32(0), float32(0))
            for q in range(4):
                acc[mt, nt, q] += d[q]

    @cuda.jit(device=True, inline=True)
    def fetch(stage, buf, a_shared, w_shared, a_global, w_global, a_from, a_keep, w_from, w_keep, a_to, w_to,
              unit_bytes, row_bytes):
        """This thread's copies of one stage (a row's bytes from stage * words * 4 on) into buffer
        buf; its unit (bytes unit_bytes on in the stage) is zeros past the row's end."""
        k_bytes = stage * (words * 4)
        on_row = k_bytes + unit_bytes < row_bytes
        for i in range(0 if GATHER_NCHW else A_PER):  # (NCHW: `load_nchw`)
            inside = on_row and a_keep[i]
            copy16_or_zero(a_shared + (a_to[i] + uint64(buf * A_TILE * 4)),
                           a_global + (a_from[i] + uint64(k_bytes) if inside else uint64(0)), inside)
        for i in range(W_PER):
            inside = on_row and w_keep[i]
            copy16_or_zero(w_shared + (w_to[i] + uint64(buf * W_TILE * 4)),
                           w_global + (w_from[i] + uint64(k_bytes) if inside else uint64(0)), inside)

    @cuda.jit(device=True, inline=True)
    def word_at(r, word):
        """Where word `word` of shared row r lies (its unit swizzled)."""
        return r * words + ((word // 4) ^ swizzle(r)) * 4 + word % 4

    @cuda.jit(device=True, inline=True)
    def load_nchw(x, held, stage, base, lo_ok, hi_ok, plane, channels, jl):
        """This thread's image words of stage `stage` into `held`, zeros off the image and past the
        channels: for each of its pairs (first word `base` of channel 0; `lo_ok`, `hi_ok`: whether
        its first and second word are the image's) and its words jl + 4 b of a pixel's stage row,
        fp16 channels 2 j and 2 j + 1 (the first word, then its next where the pair straddles it),
        fp32 channel j of both pixels. (Indices uint64: see `multiply`.)"""
        c0 = stage * C_STAGE + C_WORD * jl
        first = int64(c0) * plane
        step = int64(4 * C_WORD) * plane  # from word j to word j + 4
        for b in range(J_STEPS):
            c = c0 + 4 * C_WORD * b
            for a in range(A_PAIRS):
                # (A pair at column -1 of image 0's row 0 starts at word -1 of channel 0, never read:
                # at + 1 wraps round to word 0, as the simulator warns; memcheck finds no access there.)
                at = uint64(base[a] + first + b * step)
                for v in range(HELD):
                    held[a, b, v] = uint32(0)
                if c < channels:
                    if lo_ok[a]:
                        held[a, b, 0] = uint32(x[at])
                        if PAIRS:
                            held[a, b, 1] = uint32(x[at + uint64(plane)])
                    if hi_ok[a]:
                        held[a, b, HELD // 2] = uint32(x[at + uint64(1)])
                        if PAIRS:
                            held[a, b, 3] = uint32(x[at + uint64(plane + 1)])

    @cuda.jit(device=True, inline=True)
    def store_nchw(a_s, held, buf, odd, warp, lane):
        """`load_nchw`'s words into buffer buf as the pixels' words. Lanes 4-7 of each eight store
        their pair's second pixel first: a store's 32 lanes then meet 32 distinct banks (row 2 p in
        one half of them, row 2 p + 1 in the other)."""
        ppl, jl = lane % 8, lane // 8
        first = 1 if ppl >= 4 else 0
        for a in range(A_PAIRS):
            r = 2 * (warp * NCHW_PAIRS + ppl + 8 * a)
            for b in range(J_STEPS):
                j = jl + 4 * b
                if PAIRS:
                    p0, p1 = swapped(uint32(joined(held[a, b, 0], held[a, b, 2], odd[a])),
                                      uint32(joined(held[a, b, 1], held[a, b, 3], odd[a])))
                else:
                    p0, p1 = held[a, b, 0], held[a, b, 1]
                at = buf * A_TILE
                a_s[uint32(at + word_at(r + first, j))] = p1 if first else p0
                a_s[uint32(at + word_at(r + 1 - first, j))] = p0 if first else p1

    @cuda.jit(device=True, inline=True)
    def multiply(a_s, w_s, acc, fa, buf, s, ar, t, bc, sw):
        """acc += step s of the stage in buffer buf: A rows ar, ar + 8 (and 16 below), words
        t, t + 4 of the step; B (weight rows) bc + 8 nt, the same words. Every row this lane
        reads is g (= ar, bc) plus a multiple of 8, so all share g's swizzle, sw: the words'
        places are the same two in every row (an XOR a row kept ~80 more addresses live). The
        indices are uint32: Numba wraps a signed index round the array's end (five instructions a
        load), and LLVM narrows the 64-bit arithmetic that only feeds their low 32 bits."""
        lo = ((2 * s) ^ sw) * 4 + t
        hi = ((2 * s + 1) ^ sw) * 4 + t
        for mt in range(MT):
            at = buf * A_TILE + (ar + mt * MMA_M) * words
            fa[mt, 0] = a_s[uint32(at + lo)]
            fa[mt, 1] = a_s[uint32(at + 8 * words + lo)]
            fa[mt, 2] = a_s[uint32(at + hi)]
            fa[mt, 3] = a_s[uint32(at + 8 * words + hi)]
        for nt in range(NT):
            at = buf * W_TILE + (bc + nt * MMA_N) * words
            b0 = w_s[uint32(at + lo)]
            b1 = w_s[uint32(at + hi)]
            for mt in range(MT):
                multiply_add(acc, mt, nt, fa, b0, b1)

    @cuda.jit(device=True, inline=True)
    def result(acc, mt, nt, q):
        v = acc[mt, nt, q]
        return max_nan(v, float32(0)) if relu else v  # (max would make a NaN 0: torch's ReLU keeps it)

    @cuda.jit(device=True, inline=True)
    def y_word(r, unit):
        """Where unit `unit` of tile row r of out lies in y_s, in words: XOR-swizzled by the row, so
        that the 8 rows a fragment's lanes read (fp32) lie in distinct banks."""
        return (r * Y_UNITS + (unit ^ (r % 8))) * 4

    @cuda.jit(device=True, inline=True)
    def target(pixels, r, row0, n_pixels):
        """The row of out that tile row r goes to, or -1."""
        if scatter:
            return pixels[uint32(r)]
        row = row0 + r
        return int64(row) if row < n_pixels else int64(-1)

    @cuda.jit(device=True, inline=True)
    def write(out, a_s, y_s, pixels, acc, tid, warp, g, t, row0, col0, n_pixels, n_out, plane):
        """The tile's results into out (see `vector_out`), or with `scatter` added to it (NCHW: at
        pixels[r] + channel x `plane`, in out's items)."""
        if STAGED and SCATTER_NCHW:
            # A thread adds into one row pair's words of channels c_first, c_first + C_STEP, ...: all
            # its image words are read first, before the staging (a loop of reads and writes of out
            # waited out a read's latency each word, the compiler unable to tell them apart).
            pp = tid % T_ROWS
            c_first = tid // T_ROWS
            p = pixels[uint32(2 * pp)]
            held = cuda.local.array(ITEMS, uint32)
            base = uint64((p >> 1) + int64(col0 + c_first) * plane) if p >= 0 else uint64(0)
            for i in range(ITEMS):
                held[i] = uint32(0)
                if p >= 0 and col0 + c_first + i * C_STEP < n_out:
                    held[i] = uint32(out[base + uint64(i * C_STEP) * uint64(plane)])
            cuda.syncthreads()  # every warp is done reading the ring, which now takes the transposed tile
            odd = (g & 1) != 0  # (rows g and g + 1 of a fragment: lanes 4 apart)
            for mt in range(MT):
                for half in range(2):
                    r = warp * WARP_ROWS + mt * MMA_M + g + 8 * half
                    for nt in range(NT):
                        mine = half2_of_floats(result(acc, mt, nt, 2 * half), result(acc, mt, nt, 2 * half + 1))
                        other = cuda.shfl_xor_sync(FULL_MASK, mine, 4)
                        # the pair's channel 2 t (an even row's lane) or 2 t + 1 (an odd row's)
                        if odd:
                            word = swapped(uint32(other), uint32(mine))[1]
                        else:
                            word = swapped(uint32(mine), uint32(other))[0]
                        a_s[uint32((nt * MMA_N + 2 * t + (g & 1)) * T_STRIDE + (r >> 1))] = word
            cuda.syncthreads()  # the transposed tile is in shared memory
            for i in range(ITEMS):  # (a warp along a channel's row pairs)
                c = c_first + i * C_STEP
                if p >= 0 and col0 + c < n_out:
                    out[base + uint64(i * C_STEP) * uint64(plane)] = int32(
                        add_half2(held[i], a_s[uint32(c * T_STRIDE + pp)]))
            return
        if SCATTER_NCHW:  # (fp32: a warp's eight rows g are consecutive pixels, a sector a channel)
            row_values = cuda.local.array(ROW_VALUES, float32)  # a row's values, read before any is written
            for mt in range(MT):
                for half in range(2):
                    r = warp * WARP_ROWS + mt * MMA_M + g + 8 * half
                    p = pixels[uint32(r)]
                    for j in range(ROW_VALUES):
                        col = col0 + (j // 2) * MMA_N + 2 * t + j % 2
                        row_values[j] = float32(0)
                        if p >= 0 and col < n_out:
                            row_values[j] = float32(out[uint64(p + int64(col) * plane)])
                    for j in range(ROW_VALUES):
                        col = col0 + (j // 2) * MMA_N + 2 * t + j % 2
                        if p >= 0 and col < n_out:
                            v = row_values[j] + result(acc, mt, j // 2, 2 * half + j % 2)
                            out[uint64(p + int64(col) * plane)] = v
            return
        if STAGED:
            cuda.syncthreads()  # every warp is done reading the ring, which now takes the output tile
            for mt in range(MT):
                for half in range(2):
                    r = warp * WARP_ROWS + mt * MMA_M + g + 8 * half
                    for nt in range(NT):
                        word = half2_of_floats(result(acc, mt, nt, 2 * half), result(acc, mt, nt, 2 * half + 1))
                        a_s[uint32(r * OUT_WORDS + (nt ^ out_swizzle(r)) * 4 + t)] = word
            cuda.syncthreads()  # the output tile is in shared memory
            for e in range(tid, rows * NT, THREADS):  # 16-byte units, a row's together
                r = e // NT
                j = e - r * NT
                row = target(pixels, r, row0, n_pixels)
                if row >= 0 and col0 + j * 8 < n_out:
                    at = (row, (col0 + j * 8) // 2)
                    staged = load4(a_s, (uint32(r * OUT_WORDS + (j ^ out_swizzle(r)) * 4),))
                    if scatter:  # (the product rounded to fp16, then added: as a product and a scatter)
                        old = load4(y_s, (uint32(y_word(r, j)),))
                        store4(out, at, (add_half2(old[0], staged[0]), add_half2(old[1], staged[1]),
                                         add_half2(old[2], staged[2]), add_half2(old[3], staged[3])))
                    else:  # (int32: out's words are; the simulator's NumPy raises on a uint32 past int32's range)
                        store4(out, at, (int32(staged[0]), int32(staged[1]), int32(staged[2]), int32(staged[3])))
            return
        for mt in range(MT):
            for half in range(2):
                r = warp * WARP_ROWS + mt * MMA_M + g + 8 * half
                row = target(pixels, r, row0, n_pixels)
                if row >= 0:
                    for nt in range(NT):
                        c = nt * MMA_N + 2 * t
                        col = col0 + c
                        if vector_out:
                            if col < n_out:  # (n_out even: col + 1 too)
                                lo, hi = result(acc, mt, nt, 2 * half), result(acc, mt, nt, 2 * half + 1)
                                if PREFETCH:  # (fp32: a unit is 4 values, and c even)
                                    at = y_word(r, c // 4) + c % 4
                                    lo, hi = lo + float32(y_s[uint32(at)]), hi + float32(y_s[uint32(at + 1)])
                                store2(out, (row, col), (lo, hi))
                        else:
                            for e in range(2):
                                if col + e < n_out:
                                    v = result(acc, mt, nt, 2 * half + e)
                                    if scatter:
                                        v += float32(out[row, col + e])
                                    out[row, col + e] = v

    @cuda.jit(**({} if registers is None or SIMULATOR else {"max_registers": registers}))  # (the simulator takes none)
    def gather_matmul(out, x, w, indices, count, n_images, height, width, channels, n_out, n_pixels,
                      area, size_w, stride_h, stride_w, offset_h, offset_w, magic_area, magic_w):
        tid = cuda.threadIdx.x
        lane = tid % WARP
        warp = tid // WARP
        g = lane >> 2
        t = lane % 4
        row0 = int32(cuda.blockIdx.x) * int32(rows)
        col0 = int32(cuda.blockIdx.y) * int32(cols)
        a_s = cuda.shared.array(A_SIZE, uint32, alignment=SHARED_ALIGN)
        w_s = cuda.shared.array(W_SIZE, uint32, alignment=SHARED_ALIGN)
        acc = cuda.local.array((MT, NT, 4), float32)
        fa = cuda.local.array((MT, 4), uint32)
        a_from = cuda.local.array(A_PER, uint64)  # bytes from x's start to the unit's first stage
        a_keep = cuda.local.array(A_PER, boolean)
        a_to = cuda.local.array(A_PER, uint64)  # bytes from the ring's start (buffer 0)
        w_from = cuda.local.array(W_PER, uint64)
        w_keep = cuda.local.array(W_PER, boolean)
        w_to = cuda.local.array(W_PER, uint64)
        unit = tid % UNITS
        row_bytes = channels * ITEM
        active = count[0]
        pixels = cuda.shared.array(PIXELS, int64)
        y_s = cuda.shared.array(Y_SIZE, Y_TYPE, alignment=SHARED_ALIGN)
        if scatter:  # where the tile's rows go
            for r in range(tid, rows, THREADS):
                q = row0 + r
                pixels[r] = int64(-1) if q >= n_pixels else _window_pixel(
                    q, indices, active, n_images, height, width, area, size_w, stride_h, stride_w, offset_h,
                    offset_w, magic_area, magic_w, n_out if SCATTER_NCHW else 1)
        if PREFETCH:
            cuda.syncthreads()  # every tile row's pixel is in `pixels`
            y_shared = shared_address(y_s, (0,))
            y_global = global_address(out, (0, 0))
            out_bytes = int64(n_out) * ITEM
            for e in range(tid, rows * Y_UNITS, THREADS):  # (landed with the first stage: one group)
                r = e // Y_UNITS
                j = e - r * Y_UNITS
                p = pixels[r]
                inside = p >= 0 and col0 + j * (UNIT // ITEM) < n_out
                copy16_or_zero(y_shared + uint64(y_word(r, j) * 4),
                               y_global + (uint64(p * out_bytes + (col0 * ITEM + j * UNIT)) if inside else uint64(0)),
                               inside)
        # Where this thread's pixels lie (in the image; a scatter's in the stack): once, before the
        # first copy.
        for i in range(0 if GATHER_NCHW else A_PER):
            r = tid // UNITS + i * ROW_STEP
            q = row0 + r
            a_to[i] = uint64(word_at(r, unit * 4) * 4)
            a_from[i] = uint64(unit * UNIT)
            p = int64(-1)
            if q < n_pixels:
                p = int64(q) if scatter else _window_pixel(q, indices, active, n_images, height, width, area, size_w,
                                                           stride_h, stride_w, offset_h, offset_w, magic_area, magic_w,
                                                           1)
            a_keep[i] = p >= 0
            if p >= 0:
                a_from[i] += uint64(p * row_bytes)
        for i in range(W_PER):
            r = tid // UNITS + i * ROW_STEP
            w_to[i] = uint64(word_at(r, unit * 4) * 4)
            w_from[i] = uint64((col0 + r) * int64(row_bytes) + unit * UNIT)
            w_keep[i] = col0 + r < n_out
        a_shared = shared_address(a_s, (0,))
        w_shared = shared_address(w_s, (0,))
        a_global = global_address(x, (0,))
        w_global = global_address(w, (0, 0))
        for mt in range(MT):
            for nt in range(NT):
                for q in range(4):
                    acc[mt, nt, q] = float32(0)
        n_stages = (row_bytes + words * 4 - 1) // (words * 4)
        ar = warp * WARP_ROWS + g
        sw = swizzle(g)
        if GATHER_NCHW:
            held = cuda.local.array((A_PAIRS, J_STEPS, HELD), uint32)
            base = cuda.local.array(A_PAIRS, int64)  # word (fp32: value) of channel 0 where a pair starts
            lo_ok = cuda.local.array(A_PAIRS, boolean)
            hi_ok = cuda.local.array(A_PAIRS, boolean)
            odd = cuda.local.array(A_PAIRS, boolean)  # (fp16) a pair at an odd column: it straddles two words
            row_words = width // 2 if PAIRS else width
            plane = int64(height) * row_words
            for a in range(A_PAIRS):
                base[a] = int64(0)
                lo_ok[a] = False
                hi_ok[a] = False
                odd[a] = False
                q = row0 + 2 * (warp * NCHW_PAIRS + lane % 8 + 8 * a)
                if q < n_pixels:  # (and q + 1: the windows' areas are even)
                    n, h, c, there = _window_place(q, indices, active, n_images, height, area, size_w, stride_h,
                                                   stride_w, offset_h, offset_w, magic_area, magic_w)
                    if there:
                        k = c >> 1 if PAIRS else c  # the word holding the pair's first value (c -1: word -1)
                        base[a] = (n * channels * height + h) * row_words + k
                        if PAIRS:
                            odd[a] = (c & 1) != 0
                        lo_ok[a] = 0 <= k < row_words
                        hi_ok[a] = (odd[a] or not PAIRS) and 0 <= k + 1 < row_words
            load_nchw(x, held, 0, base, lo_ok, hi_ok, plane, channels, lane // 8)
            if n_stages > 0:
                fetch(0, 0, a_shared, w_shared, a_global, w_global, a_from, a_keep, w_from, w_keep, a_to, w_to,
                      unit * UNIT, row_bytes)
            commit()
            store_nchw(a_s, held, 0, odd, warp, lane)
            buf = 0
            for stage in range(n_stages):
                wait()  # this thread's copies of the stage's weight rows have landed
                # The stage is in buffer buf (every thread's stores and copies), and every warp is
                # done with the other buffer, which the next stage's copies and stores refill.
                cuda.syncthreads()
                nxt = stage + 1
                if nxt < n_stages:
                    fetch(nxt, 1 - buf, a_shared, w_shared, a_global, w_global, a_from, a_keep, w_from, w_keep,
                          a_to, w_to, unit * UNIT, row_bytes)
                    load_nchw(x, held, nxt, base, lo_ok, hi_ok, plane, channels, lane // 8)
                commit()
                for s in range(STEPS):
                    multiply(a_s, w_s, acc, fa, buf, s, ar, t, g, sw)
                if nxt < n_stages:
                    store_nchw(a_s, held, 1 - buf, odd, warp, lane)
                buf = 1 - buf
            write(out, a_s, y_s, pixels, acc, tid, warp, g, t, row0, col0, n_pixels, n_out, int64(0))
            return
        for s in range(stages - 1):
            if s < n_stages:
                fetch(s, s, a_shared, w_shared, a_global, w_global, a_from, a_keep, w_from, w_keep, a_to, w_to,
                      unit * UNIT, row_bytes)
            commit()  # one group a stage, empty or not, so that the wait below counts stages
        buf = 0
        for stage in range(n_stages):
            wait()  # this thread's copies of this stage have landed
            # This stage is in buffer buf (every thread's copies), and every warp is done with
            # the previous stage, whose buffer the fetch below refills.
            cuda.syncthreads()
            nxt = stage + stages - 1
            if nxt < n_stages:
                fetch(nxt, buf - 1 if buf > 0 else stages - 1, a_shared, w_shared, a_global, w_global,
                      a_from, a_keep, w_from, w_keep, a_to, w_to, unit * UNIT, row_bytes)
            commit()
            for s in range(STEPS):
                multiply(a_s, w_s, acc, fa, buf, s, ar, t, g, sw)
            buf = buf + 1 if buf < stages - 1 else 0
        # (NCHW: the image's plane in out's items: fp16 words, fp32 values)
        write(out, a_s, y_s, pixels, acc, tid, warp, g, t, row0, col0, n_pixels, n_out,
              int64(height) * width // 2 if PAIRS else int64(height) * width)

    return gather_matmul
