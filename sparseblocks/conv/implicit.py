"""The fast tensor-core convolution of aligned channel groups: an implicit GEMM over a shared
patch of the input, channels innermost (``mma.sync`` m16n8k16, fp16 and bf16, fp32 sums; fp32
in 3xTF32, below).

Each product reads the activations it gathers channels-last: a caller's channels-last arrays as
they are, others through a copy (``to_rows``: (N, C, DHW) to (N, DHW, C)), so that 16 channels of
one position are 32 contiguous bytes: a 16-byte ``cp.async`` moves half of them, and an
``ldmatrix`` row is 8 channels of one position. A thread block takes a box of 128 output positions,
``TP`` rows of ``QT`` columns of one output depth. The input those positions read through every tap
is one small box too, the patch: ``DD x PH x PW`` input positions (the halo included, zeros where
it lies in the padding). A tap is then a fixed shift in the patch, so a lane's ldmatrix row for any
tap is its position's patch row plus the tap's offset: the taps cost no gather and no barrier.

* ``forward(out, x_rows, filters, grp_ptr, grp_blk, blk_c0, ig, ...)``: 4 warps, each 32 of the
  positions by the group's G output channels. Stage after stage (a block of the group, 16 of
  its input channels), the filter slices of all taps (packed by `make_pack`: tap, output
  channel, 16 input channels) and the patch go to shared memory by cp.async into a ring of
  ``STAGES``, one barrier a stage; each tap multiplies them with ldmatrix rows shifted by its
  offset. The output is written from the accumulators, NCHW or channels-last. With stride 1 in
  every dim the same kernel is the input gradient: the output gradient's convolution with the
  filters transposed and flipped (`make_pack` ``transposed``), padding (taps - 1) x dilation -
  padding (`transposed_geometry`).
* ``filter_grad(part, dy_rows, x_rows, blk_c0, blk_k0, ig, ...)``: a thread block a (block,
  input-channel slice, group of up to 9 taps, share of the positions): per step of 128 output
  positions, dF[k, c, tap] += dy(k, positions) · patch(positions shifted by the tap, c), with
  the positions as the product's k. Each share writes its own partial sums (``part``); `make_sum`
  adds them in share order, so every run gives the same bits.

With `ConvConfig.stage_bytes` 64 a forward stage holds 32 channels of a position (16 of fp32),
two k-steps a tap: half the stages and barriers a tile, for a ring twice as large.

fp32's forward and stride-1 input gradient run the same kernel on slices of 8 channels:
a shared row is still 32 bytes, and the ldmatrix fragments that hold 16 channels of fp16 hold
exactly m16n8k8's tf32 fragments of 8 fp32 ones, so each step is ``mma_3xtf32`` (three tf32
products of each value's head and tail: about fp32's accuracy) where fp16 takes one mma.

``ig`` (`implicit_geometry`) holds the geometry as `simple.py`'s ``geo`` does, then the patch's
sizes and the tile counts. `plan` says whether a layer fits (the patch and the filter slices in
shared memory); the others run `tensorcore.py`'s gathering kernels.
"""

from numba import cuda, float32, int16, int32, int64, types, uint32, uint64

from ..bsmm.device import converters
from ..ptx.cp_async import copy16_or_zero, copy16_to, make_ring, shared_address, signed_address
from ..ptx.half2 import stored_as
from ..ptx.ldmatrix import ldmatrix_x4_at, ldmatrix_x4_trans_at
from ..ptx.mma import make_3xtf32_parts, mma_3xtf32, mma_bf16, mma_f16
from ..runtime.compile import divmod32, inlined, unrolled
from ..runtime.launch import dynamic_shared, fullest_waves

TILE = 128  # output positions a thread block (forward) or a step (filter gradient)
THREADS = 128
PAD = 16  # bytes after each shared row: eight consecutive rows start in eight bank groups
SHARED_MAX = 200 * 1024  # the most dynamic shared memory a thread block of these kernels (and `hopper`'s) takes
MAX_TAPS = 9  # taps a filter-gradient thread block
FILTER_WAVES = 2  # the filter gradients' thread blocks: at least enough to fill the multiprocessors this many times


def max_taps(storage, G, fp32_taps=5):
    """Taps a filter-gradient thread block takes: `MAX_TAPS`, or ``fp32_taps`` for fp32 at G = 32
    (`ConvConfig.fp32_filter_taps`), whose warps hold 8 accumulators a tap beside 3xTF32's parts."""
    return fp32_taps if storage == "float32" and G == 32 else MAX_TAPS


STAGES = 3  # the stage ring's depth


def filter_shares(tiles, work, slots):
    """Shares of the tiles each of a filter gradient's ``work`` rows of thread blocks (units or
    blocks, slices, tap groups) splits into thread blocks, all alike, where the GPU holds ``slots``
    of them at once: at least enough for `FILTER_WAVES` waves (at most ``tiles``), and of up to
    twice that many the count whose last wave is fullest (`runtime.launch.fullest_waves`)."""
    low = max(1, min(tiles, -(-FILTER_WAVES * slots // work)))
    return fullest_waves(work, slots, low, min(tiles, 2 * low))


def slice_channels(storage, row_bytes=32):
    """Channels a forward stage slice (a shared row's ``row_bytes``, 32 or 64; `ConvConfig.stage_bytes`):
    16 or 32 of fp16 and bf16, 8 or 16 of fp32."""
    return row_bytes // value_bytes(storage)


def value_bytes(storage):
    return 4 if storage == "float32" else 2


def mma_of(storage):
    """A step's tensor-core product: m16n8k16 of fp16 or bf16, or fp32's m16n8k8 in 3xTF32."""
    return {"bfloat16": mma_bf16, "float16": mma_f16, "float32": mma_3xtf32}[storage]


def filter_split(G):
    """(CC, WS) of the filter gradient for channel groups of G: the input channels a thread block
    takes, and the shares of each step's positions its warps split (each its own partial)."""
    return (32 if G == 32 else 16), (4 if G == 16 else 1)


def tile_shape(Q):
    """(QT, TP): a tile's columns (a power of two from 8 up to 128, the first >= Q) and rows."""
    QT = 8
    while QT < min(Q, TILE):
        QT *= 2
    return QT, TILE // QT


def implicit_geometry(geo, QT):
    """``geo`` (the 18 ints of `simple.py`: DHW, MPQ, TRS, strides, padding, dilations) followed
    by the patch's DD, PH and PW and the tile counts along Q and P: a list of 23 ints."""
    geo = [int(v) for v in geo]
    TP = TILE // QT
    T, R, S = geo[6:9]
    u = geo[9:12]
    dil = geo[15:18]
    P, Q = geo[4], geo[5]
    DD = (T - 1) * dil[0] + 1
    PH = (min(TP, P) - 1) * u[1] + (R - 1) * dil[1] + 1  # (a tile's rows past P read nothing)
    PW = (QT - 1) * u[2] + (S - 1) * dil[2] + 1
    return geo + [DD, PH, PW, -(-Q // QT), -(-P // TP)]


def transposed_geometry(geo):
    """The input gradient of a convolution of stride 1 as a convolution: the output gradient
    (MPQ) in, the input's DHW out, padding (taps - 1) x dilation - padding (may be negative)."""
    geo = [int(v) for v in geo]
    pads = [(geo[6 + i] - 1) * geo[15 + i] - geo[12 + i] for i in range(3)]
    return geo[3:6] + geo[0:3] + geo[6:9] + [1, 1, 1] + pads + geo[15:18]


def patch_rows(ig):
    return ig[18] * ig[19] * ig[20]


def capacity(ig):
    """The patch rows a kernel is built for: the patch's, rounded up to 64 (fewer builds)."""
    return -(-patch_rows(ig) // 64) * 64


def forward_shared(G, TRS, cap, row_bytes=32):
    return STAGES * (TRS * G + cap) * (row_bytes + PAD)


def filter_shared(G, cap, E=2):
    cc = filter_split(G)[0]
    return STAGES * (TILE * (E * G + PAD) + cap * (E * cc + PAD))


def plan(ig, G, filter_grad=False, E=2, row_bytes=32):
    """Whether the implicit kernels take a geometry: the patch and the stage ring fit in shared
    memory (the filter gradient's for values of E bytes, the forward's for rows of ``row_bytes``),
    and the patch's sizes fit the packed 10-bit fields the filter gradient keeps."""
    cap = capacity(ig)
    TRS = ig[6] * ig[7] * ig[8]
    if max(ig[18:21]) >= 1024:
        return False
    if filter_grad:
        return filter_shared(G, cap, E) <= SHARED_MAX
    return forward_shared(G, TRS, cap, row_bytes) <= SHARED_MAX


@inlined
def row_factors(ig):
    """`make_tiles`' ``patch_row`` factors, read once into registers: a tile row's patch rows
    (the row stride times the patch's width), a column's (the column stride), the output rows."""
    return int32(ig[10] * ig[20]), int32(ig[11]), int32(ig[4])


def make_tiles(QT, TP=None):
    """The tile arithmetic both kernels share (and `hopper.py`'s), for tiles of QT columns
    (`tile_shape`) and TP rows (``TILE // QT`` where None):

    * ``where(tile, ig)``: position tile ``tile``'s (image, output depth, first row, first
      column), in the order both kernels walk them;
    * ``patch_row(j, factors)``: the patch row that a tile's position j reads at the first tap (0
      for a position past the last output row: its result is never kept), in 32 bits from the
      factors `row_factors` took from ``ig`` once;
    * ``tap_shift(tap, ig)``: how many patch rows further tap ``tap`` reads."""
    TP = TILE // QT if TP is None else TP
    QSH = QT.bit_length() - 1  # (QT a power of two)

    @inlined
    def where(tile, ig):
        tiles_q, tiles_p = ig[21], ig[22]
        n, rest = divmod32(tile, tiles_q * tiles_p * ig[3])
        m, rest = divmod32(rest, tiles_q * tiles_p)
        p, q = divmod32(rest, tiles_q)
        return n, m, p * TP, q * QT

    @inlined
    def patch_row(j, factors):
        row_step, col_step, rows = factors
        r = int32(j) >> int32(QSH)
        return int32(r * row_step + (int32(j) & int32(QT - 1)) * col_step) if r < rows else int32(0)

    @inlined
    def tap_shift(tap, ig):
        ts, s = divmod32(tap, ig[8])  # (32-bit: a 64-bit division is a call of some 60 instructions)
        t, r = divmod32(ts, ig[7])
        return ((int32(t) * ig[15]) * ig[19] + int32(r) * ig[16]) * ig[20] + int32(s) * ig[17]

    return where, patch_row, tap_shift


def make_patch_copies(CH, ROW, cap, E=2):
    """The patch's copies, shared by both kernels, for patch rows of CH 16-byte chunks (CH x 16 / E
    channels of E bytes of one input position) ROW bytes apart, ``cap`` rows (a multiple of 64: PER
    = CH cap / THREADS copies a thread fill them exactly, so that a copy past the patch, zeros,
    stays inside the stage's rows):

    * ``plan_patch(jobs, tid, PH, PW)``: each of this thread's copies' patch row as its (depth, row,
      column) in 10-bit fields, fixed for the kernel (`plan` keeps the patch's sizes below 1024);
    * ``copy_patch(at, x_at, jobs, count, n, d0, h0, w0, D, H, W, C, c_first, tid)``: the first
      ``count`` copies of image n's patch whose first position is (d0, h0, w0), channels from
      c_first of x's C, into shared ``at``; zeros where a position lies outside the input;
    * the same in two halves, ``place_patch(sources, jobs, count, d0, h0, w0, D, H, W, C, tid)``
      (each copy's source, in values from its image's start less the first channel, -1 outside
      the input) and ``copy_placed(at, image_at, sources, c_first, tid)`` (``image_at``: the
      image's address): a walk whose stages share a patch's positions places them once
      (`make_forward`)."""
    if CH * cap % THREADS:
        raise ValueError(f"cap: {cap} patch rows of {CH} copies do not split into {THREADS} threads' copies")
    PER = CH * cap // THREADS

    @inlined
    def plan_patch(jobs, tid, PH, PW):
        for i in range(PER):
            row = (tid + i * THREADS) // CH
            jobs[i] = ((row // (PH * PW)) << 20) | (((row // PW) % PH) << 10) | (row % PW)

    @inlined
    def place_patch(sources, jobs, count, d0, h0, w0, D, H, W, C, tid):
        for i in range(PER):
            c = tid + i * THREADS
            sources[i] = -1
            if c < count:
                code = jobs[i]
                d, h, w = d0 + (code >> 20), h0 + ((code >> 10) & 1023), w0 + (code & 1023)
                if 0 <= d < D and 0 <= h < H and 0 <= w < W:
                    sources[i] = ((d * H + h) * W + w) * C + (16 // E) * (c % CH)

    @inlined
    def copy_placed(at, image_at, sources, c_first, tid):
        for i in range(PER):
            c = tid + i * THREADS
            keep = sources[i] >= 0
            copy16_or_zero(at + (c // CH) * ROW + 16 * (c % CH),
                           image_at + (E * int64(sources[i] + c_first) if keep else 0), keep)

    @inlined
    def copy_patch(at, x_at, jobs, count, n, d0, h0, w0, D, H, W, C, c_first, tid):
        sources = cuda.local.array(PER, int32)
        place_patch(sources, jobs, count, d0, h0, w0, D, H, W, C, tid)
        copy_placed(at, x_at + E * int64(n) * (D * H * W) * C, sources, c_first, tid)

    return plan_patch, copy_patch, place_patch, copy_placed


def make_to_rows(storage):
    """``to_rows(out, x, C, L)``: out (N, L, C) from x (N, C, L), through 32 x 32 shared tiles
    (coalesced on both sides); grid (L / 32, C / 32, N), 256 threads."""
    SMEM_T = int32 if storage == "bfloat16" else float32  # (32-bit slots: no bank conflicts; exact)
    OUT_T = {"bfloat16": int16, "float16": types.float16, "float32": float32}[storage]

    @cuda.jit
    def to_rows(out, x, C, L):
        tile = cuda.shared.array((32, 33), SMEM_T)
        tid = cuda.threadIdx.x
        tx, ty = tid % 32, tid // 32
        l0, c0, n = cuda.blockIdx.x * 32, cuda.blockIdx.y * 32, cuda.blockIdx.z
        frm = (int64(n) * C + c0 + ty) * L + l0 + tx  # (offsets taken once: 8 rows a step)
        if l0 + tx < L:
            for i in range(4):
                if c0 + ty + 8 * i < C:
                    tile[ty + 8 * i, tx] = SMEM_T(x[frm + 8 * i * L])
        cuda.syncthreads()
        to = (int64(n) * L + l0 + ty) * C + c0 + tx
        if c0 + tx < C:
            for i in range(4):
                if l0 + ty + 8 * i < L:
                    out[to + 8 * i * C] = OUT_T(tile[tx, ty + 8 * i])

    return to_rows


def make_to_rows_pairs():
    """``to_rows(out, x, C, L)`` for 16-bit values, C and L even, both arrays seen as 32-bit words:
    out (N, L, C) from x (N, C, L) through tiles of 64 x 64 values. A thread reads the two words of
    channels c, c + 1 at positions l, l + 1 (a 2 x 2 square), swaps their halves into the words of
    positions l and l + 1 at channels c, c + 1, and the tile's words cross shared memory: every
    global access is a warp's 128 contiguous bytes, four times `make_to_rows`' 32 x 2 bytes a
    thread. Grid (L / 64, C / 64, N), 256 threads."""

    @cuda.jit
    def to_rows(out, x, C, L):
        lo = cuda.shared.array((32, 33), uint32)  # [position pair, channel pair]: position l0 + 2 j
        hi = cuda.shared.array((32, 33), uint32)  # ... and l0 + 2 j + 1
        tid = cuda.threadIdx.x
        tx, ty = tid % 32, tid // 32
        l0, c0, n = cuda.blockIdx.x * 64, cuda.blockIdx.y * 64, cuda.blockIdx.z
        CW, LW = C // 2, L // 2  # words a row
        lw = l0 // 2 + tx
        for i in range(4):
            cp = ty + 8 * i
            c = c0 + 2 * cp
            if lw < LW and c < C:
                a = uint32(x[(int64(n) * C + c) * LW + lw])
                b = uint32(x[(int64(n) * C + c + 1) * LW + lw])
                lo[tx, cp] = (a & uint32(0xFFFF)) | (b << uint32(16))
                hi[tx, cp] = (a >> uint32(16)) | (b & uint32(0xFFFF0000))
        cuda.syncthreads()
        cw = c0 // 2 + tx
        for i in range(4):
            lp = ty + 8 * i
            p = l0 + 2 * lp
            if cw < CW and p < L:
                out[(int64(n) * L + p) * CW + cw] = int32(lo[lp, tx])
                out[(int64(n) * L + p + 1) * CW + cw] = int32(hi[lp, tx])

    return to_rows


def make_pack(storage, G, transposed=False, row_bytes=32):
    """``pack(out, f, blocks, TRS)``: each block's G x G x TRS filter as (slice of CS channels,
    tap, output channel, CS input channels), the forward's stage order (CS: `slice_channels` of
    ``row_bytes``). ``transposed``: the input gradient's, rows the input channels, slices of output
    channels, the taps reversed."""
    CS = slice_channels(storage, row_bytes)

    @cuda.jit
    def pack(out, f, blocks, TRS):
        size = G * G * TRS
        for i in range(cuda.grid(1), blocks * size, cuda.gridsize(1)):
            b, rest = i // size, i % size
            c = rest % CS
            row = (rest // CS) % G
            tap = (rest // (CS * G)) % TRS
            ch = rest // (CS * G * TRS)
            if transposed:  # (out row: an input channel; c: an output channel of slice ch)
                at = ((ch * CS + c) * G + row) * TRS + (TRS - 1 - tap)
            else:
                at = (row * G + ch * CS + c) * TRS + tap
            out[i] = f[b * size + at]

    return pack


def make_forward(storage, G, QT, cap, TRS, rows_out=False, row_bytes=32, biased=True):
    """The forward (or stride-1 input gradient) kernel for channel groups of G, tiles of QT
    columns, patches of up to ``cap`` rows and TRS taps (a ring of `STAGES` stages); see the
    module's docstring. ``rows_out``: the output written channels-last (N, positions, rows).
    ``row_bytes``: a stage's shared row (32: 16 fp16 channels of a position, a k16 step of each
    tap; 64: 32 channels, two k16 steps a tap, half the stages and barriers). Without ``biased``
    (a call with no edge bias) the kernel has no bias code."""
    MT = G // 16
    ROW = row_bytes + PAD
    CH = row_bytes // 16  # 16-byte copies a row
    KR = row_bytes // 32  # k16 (fp32: k8) steps a row
    AROWS = TRS * G
    STAGE = (AROWS + cap) * ROW
    A_COPIES = CH * AROWS
    A_PER = -(-A_COPIES // THREADS)
    P_PER = -(-CH * cap // THREADS)
    CS = slice_channels(storage, row_bytes)
    E = value_bytes(storage)
    NC = G // CS
    mma = mma_of(storage)
    narrow = stored_as(storage)
    widen, _ = converters(storage, float32)
    plan_patch, _, place_patch, copy_placed = make_patch_copies(CH, ROW, cap, E)
    where, patch_row, tap_shift = make_tiles(QT)

    def zero_step(i, acc):
        acc[i // 16, (i // 4) % 4, i % 4] = float32(0)

    zero = unrolled(MT * 16, inlined(zero_step), inline=inlined)

    def load_step(mt, fa, at):
        a4 = ldmatrix_x4_at(at + mt * 16 * ROW)
        fa[mt, 0], fa[mt, 1], fa[mt, 2], fa[mt, 3] = a4[0], a4[1], a4[2], a4[3]

    load_a = unrolled(MT, inlined(load_step), inline=inlined)

    def mma_step(mt, nt, h2, acc, fa, fb):
        d4 = mma(fa[mt, 0], fa[mt, 1], fa[mt, 2], fa[mt, 3], fb[2 * h2], fb[2 * h2 + 1],
                 acc[mt, nt, 0], acc[mt, nt, 1], acc[mt, nt, 2], acc[mt, nt, 3])
        acc[mt, nt, 0], acc[mt, nt, 1], acc[mt, nt, 2], acc[mt, nt, 3] = d4[0], d4[1], d4[2], d4[3]

    mma_strip = unrolled(MT, inlined(mma_step), inline=inlined)  # (nt, h2, acc, fa, fb): every m-tile

    def pair_step(p2, acc, fa, at, row0, row1):
        fb = ldmatrix_x4_at(at + (row0 if p2 == 0 else row1) * ROW)
        mma_strip(2 * p2, 0, acc, fa, fb)
        mma_strip(2 * p2 + 1, 1, acc, fa, fb)

    pairs = unrolled(2, inlined(pair_step), inline=inlined)

    def place_step(i, spots, edges, pos0, n, m, P, Q, p0, q0, MPQ, OUT_ROWS, edge, has_bias):
        """Position i (of the lane's 8: mma column i // 2, its value i % 2) of the tile: its part
        of an output's index (-1 past the output's edge), and its edge-bias row."""
        pos = pos0 + (i // 2) * 8 + i % 2
        tp, tq = pos // QT, pos % QT
        spots[i], edges[i] = int64(-1), -1
        if p0 + tp < P and q0 + tq < Q:
            o = (m * P + p0 + tp) * Q + q0 + tq
            spots[i] = (int64(n) * MPQ + o) * OUT_ROWS if rows_out else int64(o)
            if biased and has_bias:
                edges[i] = edge[o]

    places = unrolled(8, inlined(place_step), inline=inlined)

    def channel_step(i, chans, k0, n, MPQ, OUT_ROWS):
        """Channel i (of the lane's 2 MT: mma row i // 2, its half i % 2): its part of an index."""
        k = k0 + (i // 2) * 16 + 8 * (i % 2)
        chans[i] = int64(k) if rows_out else (int64(n) * OUT_ROWS + k) * MPQ

    CHANS = 2 * MT  # a lane's channels of the tile
    channels = unrolled(CHANS, inlined(channel_step), inline=inlined)

    def make_stores(with_bias):
        def store_step(i, out, acc, spots, edges, chans, k0, bias):
            mt, nt, j = i // 16, (i // 4) % 4, i % 4
            spot = spots[2 * nt + j % 2]
            if spot >= 0:
                value = acc[mt, nt, j]
                if with_bias:
                    e = edges[2 * nt + j % 2]
                    if e >= 0:
                        value += widen(bias[k0 + mt * 16 + 8 * (j // 2), e])
                out[uint64(spot + chans[2 * mt + j // 2])] = narrow(value)  # (unsigned: no wraparound check)

        return unrolled(MT * 16, inlined(store_step), inline=inlined)

    stores, stores_bias = make_stores(False), make_stores(True)

    @inlined
    def store(out, acc, pos0, k0, n, OUT_ROWS, m, P, Q, p0, q0, MPQ, bias, edge, has_bias):
        """The tile's outputs from the accumulators (and the edge bias): each of the lane's 8
        positions and 2 MT channels placed once, then an add and a store a value."""
        spots = cuda.local.array(8, int64)
        edges = cuda.local.array(8, int32)
        chans = cuda.local.array(CHANS, int64)
        places(spots, edges, pos0, n, m, P, Q, p0, q0, MPQ, OUT_ROWS, edge, has_bias)
        channels(chans, k0, n, MPQ, OUT_ROWS)
        if biased and has_bias:
            stores_bias(out, acc, spots, edges, chans, k0, bias)
        else:
            stores(out, acc, spots, edges, chans, k0, bias)

    @inlined
    def stage(at, f_at, x_at, jobs, placed, sources, e, ch, c_first, tile, ig, IN_ROWS, tid):
        """Stage (block e, slice ch of its input channels, position tile ``tile``) into ``at``:
        the filter slices of every tap, then the patch (zeros where it lies in the padding), whose
        copies' ``sources`` are placed once a tile (``placed``: the tile they are for, its image's
        byte offset in x)."""
        a_from = f_at + E * int64((e * NC + ch) * AROWS * CS)
        for i in range(A_PER):
            c = tid + i * THREADS
            if c < A_COPIES:
                copy16_to(at + (c // CH) * ROW + (c % CH) * 16, a_from + 16 * c)
        count = CH * ig[18] * ig[19] * ig[20]
        if placed[0] != tile:  # (a walk's stages come in order: a tile's first places its patch)
            n, m, p0, q0 = where(tile, ig)
            place_patch(sources, jobs, count, m * ig[9] - ig[12], p0 * ig[10] - ig[13], q0 * ig[11] - ig[14],
                        ig[0], ig[1], ig[2], IN_ROWS, tid)
            placed[0], placed[1] = tile, E * int64(n) * (ig[0] * ig[1] * ig[2]) * IN_ROWS
        copy_placed(at + AROWS * ROW, x_at + placed[1], sources, c_first, tid)

    @inlined
    def issue(s, at, args):
        """Stage s of this thread block's walk (`make_ring`'s issue): tile first_tile + s //
        per_tile, then its blocks and their slices."""
        f_at, x_at, jobs, placed, sources, grp_blk, blk_c0, ptr, per_tile, first_tile, ig, IN_ROWS, tid = args
        tile, rest = divmod32(s, per_tile)
        e = grp_blk[ptr + rest // NC]
        ch = rest % NC
        stage(at, f_at, x_at, jobs, placed, sources, e, ch, blk_c0[e] + CS * ch, first_tile + tile, ig, IN_ROWS, tid)

    prime, advance = make_ring(issue, STAGES, STAGE)

    @cuda.jit
    def forward(out, x, f, grp_ptr, grp_blk, blk_c0, ig, N, OUT_ROWS, IN_ROWS, bias, edge, has_bias, tiles,
                workers):
        M, P, Q = ig[3], ig[4], ig[5]
        MPQ = M * P * Q
        tid = cuda.threadIdx.x
        lane, warp = tid % 32, tid // 32
        worker, g = cuda.blockIdx.x, cuda.blockIdx.y
        first_tile = (worker * tiles) // workers
        my_tiles = ((worker + 1) * tiles) // workers - first_tile
        smem = cuda.shared.array(0, int32)
        base = shared_address(smem, (0,))
        x_at = signed_address(x, (0,))
        f_at = signed_address(f, (0,))
        jobs = cuda.local.array(P_PER, int32)  # this thread's patch copies (`make_patch_copies`)
        plan_patch(jobs, tid, ig[19], ig[20])
        q8, r8 = lane // 8, lane % 8
        a_lane = ((q8 % 2) * 8 + r8) * ROW + (q8 // 2) * 16
        j = warp * 32 + (q8 // 2) * 8 + r8  # the lane's ldmatrix rows: positions j and j + 16
        factors = row_factors(ig)
        row0, row1 = patch_row(j, factors), patch_row(j + 16, factors)
        b_col = AROWS * ROW + (q8 % 2) * 16
        shifts = cuda.local.array(TRS, int32)  # each tap's offset in patch rows
        for tap in range(TRS):
            shifts[tap] = tap_shift(tap, ig)
        acc = cuda.local.array((MT, 4, 4), float32)
        zero(acc)
        fa = cuda.local.array((MT, 4), uint32)
        pos0, k0 = warp * 32 + 2 * (lane % 4), g * G + lane // 4

        ptr = grp_ptr[g]
        per_tile = (grp_ptr[g + 1] - ptr) * NC
        if per_tile == 0:  # an output group no block reaches: zeros (and its bias)
            for tile in range(first_tile, first_tile + my_tiles):
                n, m, p0, q0 = where(tile, ig)
                store(out, acc, pos0, k0, n, OUT_ROWS, m, P, Q, p0, q0, MPQ, bias, edge, has_bias)
            return
        count = my_tiles * per_tile
        placed = cuda.local.array(2, int64)  # the tile whose patch copies' sources are placed, its image's offset ...
        placed[0] = -1
        sources = cuda.local.array(P_PER, int32)  # ... and those sources
        ring = (f_at, x_at, jobs, placed, sources, grp_blk, blk_c0, ptr, per_tile, first_tile, ig, IN_ROWS, tid)
        prime(base, count, ring)
        buf = 0
        for s in range(count):
            at, buf = advance(s, buf, base, count, ring)
            for tap in range(TRS):
                for kr in range(KR):
                    load_a(fa, at + tap * G * ROW + a_lane + 32 * kr)
                    pairs(acc, fa, at + b_col + 32 * kr, row0 + shifts[tap], row1 + shifts[tap])
            tile, rest = divmod32(s, per_tile)
            if rest == per_tile - 1:
                n, m, p0, q0 = where(first_tile + tile, ig)
                store(out, acc, pos0, k0, n, OUT_ROWS, m, P, Q, p0, q0, MPQ, bias, edge, has_bias)
                zero(acc)

    return dynamic_shared(forward, STAGES * STAGE)  # (= forward_shared(G, TRS, cap, row_bytes))


def make_filter_grad(storage, G, QT, cap, TAPS):
    """The filter gradient's partial sums for channel groups of G, tiles of QT columns, patches of
    up to ``cap`` rows and up to TAPS taps a thread block; see the module's docstring. Warps: G =
    16, four shares of each step's positions (each its own partial); G = 32, the four (16 output,
    16 input channels) quarters; G = 64, the four 16-row strips of a 16-input-channel slice.

    fp32 runs 3xTF32 on k8 steps of positions, its fragments read from the shared rows a word a
    register (m16n8k8's tf32 A is dy's rows across, which ``ldmatrix.trans`` cannot give in
    32-bit values), A split into its tf32 parts once a step for all the taps
    (`ptx.mma.make_3xtf32_parts`), the patch rows from factors held in registers (`row_factors`);
    its rows are twice fp16's bytes."""
    CC, WS = filter_split(G)
    FP32 = storage == "float32"
    E = value_bytes(storage)
    AROW = E * G + PAD  # a staged dy row: a position's G output channels
    BROW = E * CC + PAD  # a patch row: a position's CC input channels
    AW, BW = AROW // 4, BROW // 4  # (in 32-bit words)
    STAGE = TILE * AROW + cap * BROW
    A_CH, B_CH = E * G // 16, E * CC // 16  # 16-byte chunks a row
    A_PER = -(-TILE * A_CH // THREADS)
    P_PER = -(-cap * B_CH // THREADS)
    KS = TILE // (8 if FP32 else 16) // WS  # k steps (of k8 or k16) a warp a stage
    mma = mma_of(storage)
    split, mma_split = make_3xtf32_parts()
    plan_patch, copy_patch, _, _ = make_patch_copies(B_CH, BROW, cap, E)
    where, patch_row, tap_shift = make_tiles(QT)

    def zero_step(i, acc):
        acc[i // 8, (i // 4) % 2, i % 4] = float32(0)

    zero = unrolled(TAPS * 8, inlined(zero_step), inline=inlined)

    def tap_step(ti, acc, fa, at, row, shifts, tap0, TRS):
        if tap0 + ti < TRS:
            fb = ldmatrix_x4_trans_at(at + (row + shifts[ti]) * BROW)
            for h2 in range(2):
                d4 = mma(fa[0], fa[1], fa[2], fa[3], fb[2 * h2], fb[2 * h2 + 1],
                         acc[ti, h2, 0], acc[ti, h2, 1], acc[ti, h2, 2], acc[ti, h2, 3])
                acc[ti, h2, 0], acc[ti, h2, 1], acc[ti, h2, 2], acc[ti, h2, 3] = d4[0], d4[1], d4[2], d4[3]

    taps = unrolled(TAPS, inlined(tap_step), inline=inlined)

    def tap_step32(ti, acc, ah, at, words, b_at, row0, row1, shifts, tap0, TRS):
        """fp32: one k8 step's tap, A's parts (heads ``ah``, tails ``at``) given: B's b0 and b1
        (positions t and t + 4 of the step, at patch rows row0 and row1 before the tap's shift),
        channel g of each n8 tile, a word each (32-bit offsets: no wraparound test)."""
        if tap0 + ti < TRS:
            r0, r1 = uint32(b_at + (row0 + shifts[ti]) * BW), uint32(b_at + (row1 + shifts[ti]) * BW)
            for h2 in range(2):
                d4 = mma_split(ah[0], ah[1], ah[2], ah[3], at[0], at[1], at[2], at[3],
                               words[r0 + uint32(8 * h2)], words[r1 + uint32(8 * h2)],
                               acc[ti, h2, 0], acc[ti, h2, 1], acc[ti, h2, 2], acc[ti, h2, 3])
                acc[ti, h2, 0], acc[ti, h2, 1], acc[ti, h2, 2], acc[ti, h2, 3] = d4[0], d4[1], d4[2], d4[3]

    taps32 = unrolled(TAPS, inlined(tap_step32), inline=inlined)

    def store_step(i, part, acc, slot, k0, c0, tap0, TRS):
        ti, h2, j = i // 8, (i // 4) % 2, i % 4
        tap = tap0 + ti
        if tap < TRS:
            k = k0 + 8 * (j // 2)
            c = c0 + 8 * h2 + j % 2
            part[slot + (k * G + c) * TRS + tap] = acc[ti, h2, j]

    store = unrolled(TAPS * 8, inlined(store_step), inline=inlined)

    @inlined
    def split_a(ah, at, words, a_w):
        """A's four words of a k8 step (dy[position t (+ 4), channel g (+ 8)]) at word a_w, as
        their tf32 heads and tails."""
        for r in range(4):
            ah[r], at[r] = split(words[uint32(a_w + (r // 2) * 4 * AW + (r % 2) * 8)])

    @inlined
    def stage(at, dy_at, x_at, jobs, count, tile, ig, K, C, k0, c0, tid):
        """Copies of position tile ``tile`` into the buffer at ``at``: the dy rows, then the
        first ``count`` copies of the patch."""
        M, P, Q = ig[3], ig[4], ig[5]
        n, m, p0, q0 = where(tile, ig)
        for i in range(A_PER):
            c = tid + i * THREADS
            j, part = c // A_CH, c % A_CH
            tp, tq = j // QT, j % QT
            keep = c < TILE * A_CH and p0 + tp < P and q0 + tq < Q
            frm = dy_at
            if keep:
                frm = dy_at + E * ((int64(n) * (M * P * Q) + (m * P + p0 + tp) * Q + q0 + tq) * K + k0
                                   + (16 // E) * part)
            if c < TILE * A_CH:
                copy16_or_zero(at + j * AROW + 16 * part, frm, keep)
        copy_patch(at + TILE * AROW, x_at, jobs, count, n, m * ig[9] - ig[12], p0 * ig[10] - ig[13],
                   q0 * ig[11] - ig[14], ig[0], ig[1], ig[2], C, c0, tid)

    @inlined
    def issue_ring(s, at, args):
        dy_at, x_at, jobs, count_p, first, ig, K, C, k0, c0, tid = args
        stage(at, dy_at, x_at, jobs, count_p, first + s, ig, K, C, k0, c0, tid)

    prime, advance = make_ring(issue_ring, STAGES, STAGE, counter=False)

    @cuda.jit
    def filter_grad(part, dy, x, blk_c0, blk_k0, ig, N, K, C, tiles, shares, f_size):
        PH, PW = ig[19], ig[20]
        TRS = ig[6] * ig[7] * ig[8]
        patch = ig[18] * PH * PW
        tid = cuda.threadIdx.x
        lane, warp = tid % 32, tid // 32
        share = cuda.blockIdx.x
        slices = G // CC
        b, cs = cuda.blockIdx.y // slices, cuda.blockIdx.y % slices
        tap0 = cuda.blockIdx.z * TAPS
        k0, c0 = blk_k0[b], blk_c0[b] + cs * CC
        if WS > 1:
            wk, wc, ws = 0, 0, warp
        elif G == 32:
            wk, wc, ws = warp % 2, warp // 2, 0
        else:
            wk, wc, ws = warp, 0, 0
        smem = cuda.shared.array(0, int32)
        base = shared_address(smem, (0,))
        dy_at = signed_address(dy, (0,))
        x_at = signed_address(x, (0,))
        jobs = cuda.local.array(P_PER, int32)  # this thread's patch copies (`make_patch_copies`)
        plan_patch(jobs, tid, PH, PW)
        count_p = patch * B_CH  # (the patch's copies)
        q8, r8 = lane // 8, lane % 8
        a_lane = ((q8 // 2) * 8 + r8) * AROW + 2 * (wk * 16 + (q8 % 2) * 8)
        b_col = 2 * (wc * 16 + (q8 // 2) * 8)
        factors = row_factors(ig)  # (the patch rows' factors, held for the walk)
        b_rows = cuda.local.array(KS, int32)  # the lane's patch rows (positions) of each k16 step
        if not FP32:  # (fp32 takes its positions' rows as it goes: two a k8 step)
            for i in range(KS):
                b_rows[i] = patch_row((ws + WS * i) * 16 + (q8 % 2) * 8 + r8, factors)
        g, t = lane // 4, lane % 4
        words = cuda.shared.array(0, uint32)
        shifts = cuda.local.array(TAPS, int32)  # each tap's offset in patch rows
        for ti in range(TAPS):
            shifts[ti] = tap_shift(min(tap0 + ti, TRS - 1), ig)
        acc = cuda.local.array((TAPS, 2, 4), float32)
        zero(acc)
        ah = cuda.local.array(4, uint32)  # (fp32: a step's A, split)
        at_ = cuda.local.array(4, uint32)
        first = (share * tiles) // shares
        count = ((share + 1) * tiles) // shares - first
        ring = (dy_at, x_at, jobs, count_p, first, ig, K, C, k0, c0, tid)
        prime(base, count, ring)
        buf = 0
        for s in range(count):
            at, buf = advance(s, buf, base, count, ring)
            if FP32:  # (word offsets from the shared array's start)
                w_at = int32(at - base) // 4
                for i in range(KS):
                    j = int32((ws + WS * i) * 8 + t)  # this lane's positions of the step: j and j + 4
                    split_a(ah, at_, words, w_at + j * AW + wk * 16 + g)  # A[g, t] = dy[position t, channel g]
                    taps32(acc, ah, at_, words, w_at + TILE * AW + wc * 16 + g, patch_row(j, factors),
                           patch_row(j + 4, factors), shifts, tap0, TRS)
            else:
                for i in range(KS):
                    ks = ws + WS * i
                    fa = ldmatrix_x4_trans_at(at + ks * 16 * AROW + a_lane)
                    taps(acc, fa, at + TILE * AROW + b_col, b_rows[i], shifts, tap0, TRS)
        slot = int64(share * WS + ws) * f_size + int64(b) * (G * G * TRS)
        store(part, acc, slot, wk * 16 + lane // 4, cs * CC + wc * 16 + 2 * (lane % 4), tap0, TRS)

    return dynamic_shared(filter_grad, filter_shared(G, cap, E))


def make_sum(storage):
    """``add(out, part, parts, size)``: out[i] = the sum over p of part[p, i], in order of p."""
    narrow = stored_as(storage)

    @cuda.jit
    def add(out, part, parts, size):
        for i in range(cuda.grid(1), size, cuda.gridsize(1)):
            total = float32(0)
            for p in range(parts):
                total += part[int64(p) * size + i]
            out[i] = narrow(total)

    return add
