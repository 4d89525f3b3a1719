"""The fast product: bit-plane products on ``mma.sync`` m16n8k256 b1 ``and.popc`` tensor cores.

The same sums as the teaching kernel (`simple`), tiled the way a GEMM is. A thread block owns
``rows`` rows of the activations (``warps_m`` warps of them) and one group of ``group_cols``
outputs (a block-column of the layout, or ``dense_cols`` of a dense product; ``warps_n`` warps
across them). It runs over the words its outputs see (the group's word list: its present blocks'
words, in order) ``chunk_words`` words at a time:

* **stage**: every thread loads its share of the chunk, all activation planes of the block's rows
  and one weight plane of its outputs, into registers (vector loads of 1, 2 or 4 words, as the
  blocks allow), then stores it into one shared tile. The next chunk's loads are issued before
  the mmas of this one, so they are in flight while the tensor cores work. Words past the list's
  end load as zeros; a row past N or O reads the last row instead (its outputs are never
  stored). The thread also counts the bits it stages (SIMT ``popc``): each row's ``pa`` (and each
  output's ``pb`` where activations are signed), summed over the lanes sharing a row once the
  list is done.
* **mma**: each warp reads its fragments from the tile by ``ldmatrix`` (an A fragment, 16 rows x
  256 bits, in one instruction; B fragments two mma columns at a time), the next step's while this
  step's mmas run, and runs a (planes × rows) × outputs grid of mmas: every activation plane
  meets the weight plane from the one load. A tile row is padded by 4 words, so the 8 rows of an
  ``ldmatrix`` matrix fall in distinct banks.

A convolution (``geometry`` given) is the same GEMM, implicitly: a row is an output pixel, its
list the filter's taps, each tap's channel words (``WC``) read from the input pixel under it (no
im2col in memory: a tap outside the image stages zeros), and the weight rows are the filters'
words in the same order. Activations have 0/1 codes there, so the zeros contribute nothing.

Weight planes are passes over the list, one at a time (the accumulators stay within registers),
or all in one pass where their accumulators fit ``fused_acc`` registers a thread (`plane_passes`):
the tile then holds every weight plane's rows of the group, so the activations are staged and
their fragments loaded once for all of them. Each plane's integers ``P`` are turned into plane
dots with ``pa``, ``pb`` (`plane_dot`) and scaled by ``u_j · v[o, k]`` into fp32 outputs (stored
at once where one pair of planes is all there is); bias, ReLU and the conversion to y's dtype
close, two neighbouring outputs a store.
"""

from numba import cuda, float32, int32, int64, uint32

from ..ptx.ldmatrix import ldmatrix_x4
from ..ptx.mma import B1_WORDS, mma_b1_and
from ..ptx.vector import load2, load4, store2, store4
from ..runtime.backend import SIMULATOR
from .simple import make_finish_value, make_plane_dot

FULL_MASK = 0xFFFFFFFF
PAD = 4  # words after each tile row: a row an odd number of 16 bytes (mod 128), for ldmatrix's banks


@cuda.jit(device=True, inline=True)
def load_words4(staged, n, planes, at):
    x = load4(planes, (at,))
    staged[n, 0], staged[n, 1], staged[n, 2], staged[n, 3] = x[0], x[1], x[2], x[3]


@cuda.jit(device=True, inline=True)
def load_words2(staged, n, planes, at):
    x = load2(planes, (at,))
    staged[n, 0], staged[n, 1] = x[0], x[1]


@cuda.jit(device=True, inline=True)
def load_words1(staged, n, planes, at):
    staged[n, 0] = planes[at]


@cuda.jit(device=True, inline=True)
def store_words4(tile, row, column, staged, n):
    store4(tile, (row, column), (staged[n, 0], staged[n, 1], staged[n, 2], staged[n, 3]))


@cuda.jit(device=True, inline=True)
def store_words2(tile, row, column, staged, n):
    store2(tile, (row, column), (staged[n, 0], staged[n, 1]))


@cuda.jit(device=True, inline=True)
def store_words1(tile, row, column, staged, n):
    tile[row, column] = staged[n, 0]


VECTORS = {4: (load_words4, store_words4), 2: (load_words2, store_words2), 1: (load_words1, store_words1)}


def vector_words(block_words):
    """Words a staging load moves: 4, 2 or 1, as the list's blocks of `block_words` allow."""
    return 4 if block_words % 4 == 0 else 2 if block_words % 2 == 0 else 1


def warp_rows(cfg, a_bits):
    """Rows a warp takes of each activation plane (its tile holds them all)."""
    return max(16, cfg.warp_rows // a_bits // 16 * 16)


def block_warps(cfg, a_bits, rows, group_cols):
    """(warps along the rows, warps along the outputs) of a thread block: no warp without rows, no
    more activation tile rows than 1-bit activations have, and whole mmas of outputs a warp."""
    per_warp = warp_rows(cfg, a_bits)
    warps_m = max(1, min(cfg.warps_m, -(-rows // per_warp), cfg.warps_m * cfg.warp_rows // (a_bits * per_warp)))
    warps_n = cfg.warps_n
    while group_cols % (8 * warps_n):
        warps_n //= 2
    return warps_m, warps_n


def row_groups(cfg, rows, a_bits, warps_m):
    """The register-staged product's thread blocks along the rows: ``rows`` in tiles of
    ``warps_m`` warps' rows."""
    return -(-rows // (warps_m * warp_rows(cfg, a_bits)))


def tile_shape(cfg, a_bits, group_cols, warps_m, warps_n):
    """(rows a warp of each activation plane, rows a tile, mma rows a warp's plane, mma rows a warp
    in all, mma columns a warp, the tile's activation rows: plane j's row r at j · rows + r)."""
    WARP_ROWS = warp_rows(cfg, a_bits)
    ROWS = warps_m * WARP_ROWS
    MR = WARP_ROWS // 16
    return WARP_ROWS, ROWS, MR, a_bits * MR, group_cols // warps_n // 8, a_bits * ROWS


def plane_passes(cfg, a_bits, w_bits, group_cols, warps_m, warps_n):
    """(weight planes a pass, passes): all ``w_bits`` in one pass where their accumulators take at
    most ``cfg.fused_acc`` registers a thread and the tile fits 48 KB of shared memory, else one."""
    MT = a_bits * (warp_rows(cfg, a_bits) // 16)
    NC = group_cols // warps_n // 8
    rows = a_bits * warps_m * warp_rows(cfg, a_bits) + w_bits * group_cols
    fits = w_bits * MT * NC * 4 <= cfg.fused_acc and rows * (cfg.chunk_words + PAD + 1) * 4 <= 48 * 1024
    return (w_bits, 1) if w_bits > 1 and fits else (1, w_bits)


def make_store_pair(bias, relu, paired):
    """``store_pair(y, at, c, O, lo, hi, b_lo, b_hi)``: y[at], y[at + 1] (outputs c, c + 1 of a
    row) = lo, hi with ``bias`` their bias values ``b_lo``, ``b_hi`` added (read once a column
    pair by `make_bias_pair`, not once a store: stores to y might alias the bias for all the
    compiler knows, so it would read it again after each) and with ``relu`` the max with 0: one
    store where both are inside and rows are of an even length (``paired``: the pair aligned),
    else one a value."""

    finish = make_finish_value(bias, relu)

    @cuda.jit(device=True, inline=True)
    def store_pair(y, at, c, O, lo, hi, b_lo, b_hi):
        if paired and c + 1 < O:
            store2(y, (at,), (finish(lo, b_lo), finish(hi, b_hi)))
        else:
            if c < O:
                y[at] = finish(lo, b_lo)
            if c + 1 < O:
                y[at + 1] = finish(hi, b_hi)

    return store_pair


def make_bias_pair(bias):
    """``bias_pair(bias_values, c, O) -> (b_lo, b_hi)``: outputs c's and c + 1's bias values (0
    past O, or without ``bias``)."""

    @cuda.jit(device=True, inline=True)
    def bias_pair(bias_values, c, O):
        if bias:
            return (bias_values[c] if c < O else float32(0)), (bias_values[c + 1] if c + 1 < O else float32(0))
        return float32(0), float32(0)

    return bias_pair


def make_epilogue(plane_dot, bias, relu, paired, one_pair, MR, NC, WARP_ROWS):
    """A product kernel's epilogue, shared by `make_tensorcore_product` and `ring`'s, so both give
    the same bits: ``pair_out(y, out, acc, j, mt, nt, rows, col_lo, col_hi, u, v_lo, v_hi, r0, c,
    N, O, b_lo, b_hi)`` turns weight plane j's and mma row mt's integers (``acc[j, mt, nt]``) into
    their plane dots (``rows[mt]``, ``col_lo``/``col_hi``: the row's and the columns' terms), scaled
    by ``u·v``: stored at once with ``one_pair`` (rows ``r0`` + 16 (mt % MR) and 8 below, columns
    c and c + 1, with their bias values ``b_lo``, ``b_hi``), else added to ``out[mt % MR, nt]``;
    ``store_out(y, out, r0, c0, N, O, bias_values)`` then stores ``out`` (a warp's rows from r0 +
    the lane's group, its mma columns from c0 + the lane's pair); ``bias_pair`` (`make_bias_pair`)."""
    store_pair = make_store_pair(bias, relu, paired)
    bias_pair = make_bias_pair(bias)

    @cuda.jit(device=True, inline=True)
    def pair_out(y, out, acc, j, mt, nt, rows, col_lo, col_hi, u, v_lo, v_hi, r0, c, N, O, b_lo, b_hi):
        m = mt % MR
        s_lo = u * v_lo
        s_hi = u * v_hi
        lo0 = s_lo * float32(int32(plane_dot(acc[j, mt, nt, 0], 0, 0, 0) + rows[mt, 0] + col_lo))
        hi0 = s_hi * float32(int32(plane_dot(acc[j, mt, nt, 1], 0, 0, 0) + rows[mt, 0] + col_hi))
        lo1 = s_lo * float32(int32(plane_dot(acc[j, mt, nt, 2], 0, 0, 0) + rows[mt, 1] + col_lo))
        hi1 = s_hi * float32(int32(plane_dot(acc[j, mt, nt, 3], 0, 0, 0) + rows[mt, 1] + col_hi))
        if one_pair:  # (the only pair of planes: straight out, no fp32 tile kept)
            r = r0 + m * 16
            if r < N:
                store_pair(y, int64(r) * O + c, c, O, lo0, hi0, b_lo, b_hi)
            if r + 8 < N:
                store_pair(y, int64(r + 8) * O + c, c, O, lo1, hi1, b_lo, b_hi)
        else:
            out[m, nt, 0] += lo0
            out[m, nt, 1] += hi0
            out[m, nt, 2] += lo1
            out[m, nt, 3] += hi1

    @cuda.jit(device=True, inline=True)
    def store_out(y, out, r0, c0, N, O, bias_values):
        n, o = int32(N), int32(O)  # (32-bit indices: fewer instructions)
        for nt in range(NC):
            c = int32(c0) + nt * 8
            b_lo, b_hi = bias_pair(bias_values, c, o)  # (once for the column pair's rows)
            for m in range(MR):
                for h in range(2):
                    r = int32(r0) + m * 16 + 8 * h
                    if r < n:
                        store_pair(y, int64(r) * o + c, c, o, out[m, nt, 2 * h], out[m, nt, 2 * h + 1], b_lo, b_hi)

    return pair_out, store_out, bias_pair


def make_share_counts(COPIES, LANES, TILE_ROWS, row_of):
    """``share_counts(totals, counts)``: each tile row's bit count, ``counts[n]`` of the ``LANES``
    neighbouring lanes that staged or copied a part of it (a thread's n-th row: ``row_of(n)``,
    ``TILE_ROWS`` or past for none), summed by shuffles into ``totals[row]`` (by the first lane)."""

    @cuda.jit(device=True, inline=True)
    def share_counts(totals, counts):
        for n in range(COPIES):
            c = counts[n]
            step = LANES // 2
            while step > 0:
                c += cuda.shfl_xor_sync(FULL_MASK, c, step)
                step //= 2
            row = row_of(n)
            if cuda.threadIdx.x % LANES == 0 and row < TILE_ROWS:
                totals[row] = c

    return share_counts


def make_plane_outputs(plane_dot, pair_out, bias_pair, need_pa, need_pb, tile_counts, MT, MR, NC, WP, ROWS, A_ROWS,
                       group_cols, WARP_ROWS):
    """A product kernel's closing, shared by `make_tensorcore_product` and `ring`'s:
    ``plane_outputs(y, out, acc, rows, a_counts, w_counts, a_basis, w_basis, bias_values, seen,
    k0, row0, col0, N, O, wm, wn, g, t)`` turns the warp's integers of weight planes k0 to
    k0 + WP - 1 into outputs through `make_epilogue`'s ``pair_out``: first its rows' terms of the
    plane dots (into ``rows``), then each weight plane's output columns' (the staged kernel's
    order: weight plane, output column, activation plane). The rows' and outputs' bit counts are
    read where a plane dot needs them: with ``tile_counts`` from a count a tile row (``a_counts``
    and ``w_counts`` both the tile's totals: activation rows first, then each weight plane's
    outputs), else from the planes' rows' counts (a_bits x N and w_bits x O)."""

    @cuda.jit(device=True, inline=True)
    def plane_outputs(y, out, acc, rows, a_counts, w_counts, a_basis, w_basis, bias_values, seen, k0, row0, col0, N, O,
                      wm, wn, g, t):
        n, o, r_0, c_0 = int32(N), int32(O), int32(row0), int32(col0)  # (32-bit indices: fewer instructions)
        for mt in range(MT):
            if tile_counts:
                r = (mt // MR) * ROWS + wm * WARP_ROWS + (mt % MR) * 16 + g
                rows[mt, 0] = plane_dot(0, a_counts[r] if need_pa else int32(0), 0, seen)
                rows[mt, 1] = plane_dot(0, a_counts[r + 8] if need_pa else int32(0), 0, seen)
            else:
                r = r_0 + wm * WARP_ROWS + (mt % MR) * 16 + g
                plane = (mt // MR) * n
                rows[mt, 0] = plane_dot(0, a_counts[plane + min(r, n - 1)] if need_pa else int32(0), 0, seen)
                rows[mt, 1] = plane_dot(0, a_counts[plane + min(r + 8, n - 1)] if need_pa else int32(0), 0, seen)
        for j in range(WP):
            k = k0 + j
            for nt in range(NC):
                local = wn * NC * 8 + nt * 8 + 2 * t
                c = c_0 + local
                v_lo = w_basis[c, k] if c < o else float32(0)
                v_hi = w_basis[c + 1, k] if c + 1 < o else float32(0)
                if tile_counts:
                    b_row = A_ROWS + j * group_cols + local
                    col_lo = int32(plane_dot(0, 0, w_counts[b_row] if need_pb else int32(0), 0))
                    col_hi = int32(plane_dot(0, 0, w_counts[b_row + 1] if need_pb else int32(0), 0))
                else:
                    col_lo = int32(plane_dot(0, 0, w_counts[k * o + min(c, o - 1)] if need_pb else int32(0), 0))
                    col_hi = int32(plane_dot(0, 0, w_counts[k * o + min(c + 1, o - 1)] if need_pb else int32(0), 0))
                b_lo, b_hi = bias_pair(bias_values, c, o)  # (once for the column pair's rows)
                for mt in range(MT):
                    pair_out(y, out, acc, j, mt, nt, rows, col_lo, col_hi, a_basis[mt // MR], v_lo, v_hi,
                             r_0 + wm * WARP_ROWS + g, c, n, o, b_lo, b_hi)

    return plane_outputs


def make_tensorcore_product(cfg, a_bits, w_bits, signed_a, signed_w, bias, relu, block_words, group_cols,
                            warps_m, warps_n, paired, geometry=None):
    """The kernel ``product(y, a_planes, w_planes, a_basis, w_basis, bias_values, ptr, blocks,
    seen_a_block, N, O, words)``: y (N * O), the planes (bits * rows * words) flat, so that a
    thread's row addresses are made once a pass and a chunk only adds its word. ``geometry``: a
    convolution's ``(H, W, P, Q, R, S, SH, SW, PH, PW, DH, DW, WC)`` (then N counts output pixels,
    the activation planes are (bits, images, H, W, WC), the weights' rows R·S·WC words)."""
    plane_dot = make_plane_dot(signed_a, signed_w)
    WARP_ROWS, ROWS, MR, MT, NC, A_ROWS = tile_shape(cfg, a_bits, group_cols, warps_m, warps_n)  # (then outputs ...)
    WP, PASSES = plane_passes(cfg, a_bits, w_bits, group_cols, warps_m, warps_n)  # weight planes a pass
    B_ROWS = WP * group_cols  # ... of each weight plane of the pass, plane j's from A_ROWS + j * group_cols
    TILE_ROWS = A_ROWS + B_ROWS
    CW = cfg.chunk_words
    STRIDE = CW + PAD
    STEPS = CW // B1_WORDS
    CONV = geometry is not None
    H, W, P, Q, R, S, SH, SW, PH, PW, DH, DW, WC = geometry if CONV else (1,) * 13
    VW = vector_words(WC if CONV else block_words)  # (a conv's vectors stay within a tap)
    PER_ROW = CW // VW  # staging loads a tile row (consecutive threads, a power of two up to 32)
    ROW_STRIDE = 32 * warps_m * warps_n // PER_ROW  # tile rows between a thread's loads
    LOADS_A = -(-A_ROWS // ROW_STRIDE)  # a thread's loads of activation rows ...
    LOADS = LOADS_A + -(-B_ROWS // ROW_STRIDE)  # ... then of weight rows
    ONE_PAIR = a_bits == 1 and w_bits == 1
    pair_out, store_out, bias_pair = make_epilogue(plane_dot, bias, relu, paired, ONE_PAIR, MR, NC, WARP_ROWS)
    DENSE = CONV or block_words % 8 == 0  # (a layout's blocks are 1 or 2 words, a dense row whole steps)
    need_pa = signed_w
    need_pb = signed_a
    plane_outputs = make_plane_outputs(plane_dot, pair_out, bias_pair, need_pa, need_pb, True, MT, MR, NC, WP, ROWS,
                                       A_ROWS, group_cols, WARP_ROWS)
    load_vector, store_vector = VECTORS[VW]

    @cuda.jit(device=True, inline=True)
    def tile_row(n):
        """The tile row of this thread's load n (TILE_ROWS: none, where the rows run out)."""
        row = cuda.threadIdx.x // PER_ROW + (n if n < LOADS_A else n - LOADS_A) * ROW_STRIDE
        if n < LOADS_A:
            return row if row < A_ROWS else TILE_ROWS
        return A_ROWS + row if row < B_ROWS else TILE_ROWS

    @cuda.jit(device=True, inline=True)
    def row_bases(bases, corners, k, row0, col0, N, O, words):
        """Where each row this thread stages starts in its planes (a convolution's activation rows:
        their image's plane and the corner of their taps, ``corners``; weight rows of the pass's
        planes from ``k``). A row past N or O reads the last row instead: its outputs are never
        stored, so its words need not be zeros."""
        for n in range(LOADS):
            row = tile_row(n)
            if n < LOADS_A:
                plane = row // ROWS
                if CONV:
                    pixel = min(row0 + row - plane * ROWS, N - 1)
                    image = pixel // (P * Q)
                    bases[n] = (plane * (N // (P * Q)) + image) * (H * W * WC)
                    corners[n, 0] = (pixel // Q) % P * SH - PH
                    corners[n, 1] = pixel % Q * SW - PW
                else:
                    bases[n] = (plane * N + min(row0 + row - plane * ROWS, N - 1)) * words
            else:
                j, c = (row - A_ROWS) // group_cols, (row - A_ROWS) % group_cols
                bases[n] = ((k + j) * O + min(col0 + c, O - 1)) * words

    @cuda.jit(device=True, inline=True)
    def fetch(staged, bases, corners, a_planes, w_planes, blocks, first, total, chunk):
        """This thread's share of chunk `chunk` into registers (zeros past the list's end, and
        where a convolution's tap falls outside the image)."""
        slot = int32(chunk) * CW + int32(cuda.threadIdx.x % PER_ROW) * VW
        word = slot  # (a dense product's list: the row's words)
        if not DENSE and slot < total:
            i = uint32(slot) // block_words
            word = blocks[first + i] * block_words + (slot - i * block_words)
        tap = slot // WC
        r = tap // S
        s = tap - r * S
        for n in range(LOADS):
            for v in range(VW):
                staged[n, v] = uint32(0)
            if slot < total and tile_row(n) < TILE_ROWS:
                if n < LOADS_A and CONV:
                    ih = corners[n, 0] + r * DH
                    iw = corners[n, 1] + s * DW
                    if 0 <= ih < H and 0 <= iw < W:
                        load_vector(staged, n, a_planes, bases[n] + (ih * W + iw) * WC + slot - tap * WC)
                elif n < LOADS_A:
                    load_vector(staged, n, a_planes, bases[n] + word)
                else:
                    load_vector(staged, n, w_planes, bases[n] + word)

    @cuda.jit(device=True, inline=True)
    def put(tile, staged, counts):
        """The staged words into the tile, counting their bits where a plane dot needs them."""
        column = (cuda.threadIdx.x % PER_ROW) * VW
        for n in range(LOADS):
            row = tile_row(n)
            if row < TILE_ROWS:
                store_vector(tile, row, column, staged, n)
                if need_pa if n < LOADS_A else need_pb:
                    for v in range(VW):
                        counts[n] += cuda.popc(staged[n, v])

    share_counts = make_share_counts(LOADS, PER_ROW, TILE_ROWS, tile_row)

    @cuda.jit(device=True, inline=True)
    def first_row(mt, wm):
        """The tile row of the first of mma row mt's 16 rows in warp row wm (plane mt // MR)."""
        return (mt // MR) * ROWS + wm * WARP_ROWS + (mt % MR) * 16

    @cuda.jit(device=True, inline=True)
    def fragments(af, bf, buffer, tile, step, wm, wn, lane):
        """A warp's A and B fragments (every weight plane of the pass) of mma step `step` of the
        tile, into af/bf[buffer] (ldmatrix: lane 8q + i hands in row i of matrix q; a lane gets
        word lane % 4 of row lane // 4 of each)."""
        quarter = lane // 8
        for mt in range(MT):
            row = first_row(mt, wm) + lane % 8 + 8 * (quarter % 2)
            a = ldmatrix_x4(tile, (row, step * B1_WORDS + 4 * (quarter // 2)))
            for i in range(4):
                af[buffer, mt, i] = a[i]
        for j in range(WP):
            for nt in range(0, NC, 2):  # (two mma columns a load; an odd last one twice)
                other = nt + quarter // 2 if nt + 1 < NC else nt
                b = ldmatrix_x4(tile, (A_ROWS + j * group_cols + wn * NC * 8 + other * 8 + lane % 8,
                                       step * B1_WORDS + 4 * (quarter % 2)))
                bf[buffer, j, nt, 0] = b[0]
                bf[buffer, j, nt, 1] = b[1]
                if nt + 1 < NC:
                    bf[buffer, j, nt + 1, 0] = b[2]
                    bf[buffer, j, nt + 1, 1] = b[3]

    @cuda.jit(**({} if cfg.max_registers is None or SIMULATOR else {"max_registers": cfg.max_registers}))
    def product(y, a_planes, w_planes, a_basis, w_basis, bias_values, ptr, blocks, seen_a_block, N, O, words):
        tile = cuda.shared.array((TILE_ROWS, STRIDE), uint32)
        totals = cuda.shared.array(TILE_ROWS, int32)
        lane = cuda.threadIdx.x % 32
        warp = cuda.threadIdx.x // 32
        wm = warp // warps_n
        wn = warp % warps_n
        g = lane >> 2
        t = lane % 4
        row0 = cuda.blockIdx.y * ROWS
        group = cuda.blockIdx.x
        col0 = group * group_cols
        first = ptr[group]
        count = ptr[group + 1] - first
        total = int32(count * block_words)
        seen = count * seen_a_block
        chunks = (total + CW - 1) // CW

        out = cuda.local.array((MR, NC, 4), float32)
        acc = cuda.local.array((WP, MT, NC, 4), int32)
        af = cuda.local.array((2, MT, 4), uint32)
        bf = cuda.local.array((2, WP, NC, 2), uint32)
        staged = cuda.local.array((LOADS, VW), uint32)
        counts = cuda.local.array(LOADS, int32)
        bases = cuda.local.array(LOADS, int32)
        corners = cuda.local.array((LOADS, 2), int32)
        rows = cuda.local.array((MT, 2), int32)
        for m in range(MR):
            for nt in range(NC):
                for i in range(4):
                    out[m, nt, i] = float32(0)
        for pass_ in range(PASSES):
            k0 = pass_ * WP  # the pass's first weight plane
            for j in range(WP):
                for mt in range(MT):
                    for nt in range(NC):
                        for i in range(4):
                            acc[j, mt, nt, i] = 0
            for n in range(LOADS):
                counts[n] = 0
            row_bases(bases, corners, int32(k0), int32(row0), int32(col0), int32(N), int32(O), int32(words))
            fetch(staged, bases, corners, a_planes, w_planes, blocks, first, total, 0)
            for chunk in range(chunks):
                cuda.syncthreads()  # (the previous chunk's fragments are read)
                put(tile, staged, counts)
                cuda.syncthreads()
                if chunk + 1 < chunks:
                    fetch(staged, bases, corners, a_planes, w_planes, blocks, first, total, chunk + 1)
                fragments(af, bf, 0, tile, 0, wm, wn, lane)
                for step in range(STEPS):  # (the next step's fragments load while this one's mmas run)
                    now = step % 2
                    if step + 1 < STEPS:
                        fragments(af, bf, 1 - now, tile, step + 1, wm, wn, lane)
                    for j in range(WP):
                        for mt in range(MT):
                            for nt in range(NC):
                                d = mma_b1_and(af[now, mt, 0], af[now, mt, 1], af[now, mt, 2], af[now, mt, 3],
                                               bf[now, j, nt, 0], bf[now, j, nt, 1],
                                               acc[j, mt, nt, 0], acc[j, mt, nt, 1], acc[j, mt, nt, 2],
                                               acc[j, mt, nt, 3])
                                acc[j, mt, nt, 0] = d[0]
                                acc[j, mt, nt, 1] = d[1]
                                acc[j, mt, nt, 2] = d[2]
                                acc[j, mt, nt, 3] = d[3]
            cuda.syncthreads()  # (the previous pass's totals are read)
            share_counts(totals, counts)
            cuda.syncthreads()
            # P -> plane dots (linear in P, pa, pb: a row's and a column's terms apart) -> scaled
            plane_outputs(y, out, acc, rows, totals, totals, a_basis, w_basis, bias_values, seen, k0, row0, col0, N, O,
                          wm, wn, g, t)
        if not ONE_PAIR:
            store_out(y, out, row0 + wm * WARP_ROWS + g, col0 + wn * NC * 8 + 2 * t, N, O, bias_values)

    return product
