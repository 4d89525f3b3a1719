"""The convolution's forward (and stride-1 input gradient) on Hopper's ``wgmma``: an implicit GEMM
whose taps cost nothing but a descriptor's start address.

A thread block is one output group of G channels over a tile of 8 rows of 8 x ``groups`` output
positions of one output depth, a warpgroup each 8 x 8 (the filter block read once for them all):
wgmma m64nGk16, A the positions by input
channels, B the input channels by the group's output channels. The input patch those positions
read through every tap (DD x PH x PW positions, the halo included, zeros in the padding) lies in
shared memory in wgmma's no-swizzle layout, chunk-major: 8 channels (16 bytes) of each patch
position, position after position, one chunk of channels after another. Eight neighbouring
output positions of one output row then read eight neighbouring patch positions, 128 contiguous
bytes: a core matrix. So tap (t, r, s)'s A is the descriptor whose start is the patch's shifted
by the tap's offset in patch positions, with ``sbo`` the patch row's pitch (the next output row)
and ``lbo`` the chunk's stride (the next 8 channels): no copy, gather or barrier a tap. The
filter block (packed by `implicit.make_pack` in 16-byte rows: chunk of 8 input channels, tap,
output channel) is B, K-major, ``lbo`` the chunk's stride and ``sbo`` 8 output channels.

Stages are the group's input blocks, each its patch and its filter block, through a ring of
cp.async copies (`ptx.cp_async.make_ring`, fenced for the async proxy); each stage's wgmmas are
waited for before the next, so a buffer is free once the barrier passes. Stride 1 only (eight
outputs' inputs 16 bytes apart). The epilogue stores from the accumulators (and the edge bias),
channels-last or NCHW, as `implicit.make_forward`'s does.

`make_filter_grad` (``ConvConfig.hopper_filter_grad``) takes the filter gradient the same way,
with the positions as the product's k: the patch of 64 / G blocks of one output group is A (m =
their 64 input channels), a tile's output gradient B, both MN-major, a tap a descriptor's start;
or (``ConvConfig.hopper_filter_dy_a``) the output gradient of 64 / G blocks of one input group is
A (m = their 64 output channels), read into registers once a k16 step and used by every tap, and
the patch of that input group B (n = G), so that a tap's wgmma reads only B from shared memory.
"""

from numba import cuda, float32, int32, int64, uint32, uint64

from ..bsmm.device import converters
from ..bsmm.hopper_shapes import SM_SHARED
from ..ptx.cp_async import commit, copy16_or_zero, copy16_to, make_ring, shared_address, signed_address
from ..ptx.half2 import stored_as
from ..ptx.ldmatrix import ldmatrix_x4_at, ldmatrix_x4_trans_at
from ..ptx.vector import store2
from ..ptx.wgmma import WARPGROUP, descriptor, fence, make_mma, make_mma_rs, make_settle, proxy_fence
from ..ptx.wgmma import commit as wg_commit
from ..ptx.wgmma import waiter as wg_waiter
from ..runtime.compile import bounded, divmod32, inlined, unrolled
from ..runtime.launch import dynamic_shared
from .implicit import SHARED_MAX, make_tiles

TILE_ROWS = TILE_COLS = 8  # a tile's output rows and columns: 64 positions, wgmma's m
STAGES = 3
CHUNK = 16  # bytes: 8 channels of a position


def geometry(geo, groups=1, rows=1):
    """``geo`` (the 18 ints of `simple.py`: DHW, MPQ, TRS, strides, padding, dilations) followed by
    the patch's DD, PH and PW and the tile counts along Q and P: 23 ints, as `implicit`'s, for
    tiles of ``groups`` warpgroups side by side, each ``rows`` 8 x 8 wgmma tiles down the rows."""
    geo = [int(v) for v in geo]
    T, R, S = geo[6:9]
    dil = geo[15:18]
    cols, tile_rows = TILE_COLS * groups, TILE_ROWS * rows
    DD = (T - 1) * dil[0] + 1
    PH = tile_rows - 1 + (R - 1) * dil[1] + 1
    PW = cols - 1 + (S - 1) * dil[2] + 1
    return geo + [DD, PH, PW, -(-geo[5] // cols), -(-geo[4] // tile_rows)]


def fits(geo, G, groups=1, stages=STAGES, rows=1):
    """Whether a layer takes this kernel: stride 1, channel groups of 16, 32 or 64, output rows of
    at least 8, and a ring of ``stages`` in shared memory."""
    return (G in (16, 32, 64) and tuple(int(v) for v in geo[9:12]) == (1, 1, 1) and int(geo[4]) >= TILE_ROWS
            and ring_bytes(geometry(geo, groups, rows), G, stages) <= SHARED_MAX)


def stage_bytes(hg, G):
    TRS = hg[6] * hg[7] * hg[8]
    return (G // 8) * (patch_positions(hg) + TRS * G) * CHUNK


def ring_bytes(hg, G, stages, keep=0):
    """The forward's shared memory: a ring of ``stages`` stages, each a block's patch and filter,
    or with ``keep`` filter blocks kept, each a patch, and the kept filters after them."""
    TRS = hg[6] * hg[7] * hg[8]
    if not keep:
        return stages * stage_bytes(hg, G)
    return (stages * patch_positions(hg) + keep * TRS * G) * (G // 8) * CHUNK


def kept_fits(hg, G, blocks, stages=STAGES):
    """Whether a ring of patch-only stages and ``blocks`` kept filter blocks fit in shared memory."""
    return ring_bytes(hg, G, stages, blocks) <= SHARED_MAX


def keep_pays(hg, G, most, stages=STAGES):
    """Whether keeping an output group's ``most`` filter blocks lets at least as many thread blocks
    share a multiprocessor's shared memory as the ring of patches and filters (`forward_stages`)
    does: kept, a filter is read once a thread block, but a kept ring that costs a resident
    thread block costs more (fp16, 32 x 56², G = 32: one block a group 1.27x, most 4 of 8 at
    25 % 1.05x, most 6 at 50 %, a thread block fewer, 0.76x)."""
    return rings_fit(hg, G, stages, most) >= rings_fit(hg, G, forward_stages(most, stages))


def rings_fit(hg, G, stages, keep=0):
    """Thread blocks whose forward rings (`ring_bytes`) share a multiprocessor's shared memory,
    each reserving 1 KB."""
    return SM_SHARED // (ring_bytes(hg, G, stages, keep) + 1024)


def patch_positions(hg):
    return int(hg[18] * hg[19] * hg[20])


def make_where(cols, rows=1):
    """(``where(tile, hg)``: tile ``tile``'s (image, output depth, first row, first column) as
    int32, for tiles of ``rows`` x `TILE_ROWS` rows of ``cols`` columns; ``tap_shift``:
    `implicit.make_tiles`')."""
    tile_of, _, tap_shift = make_tiles(cols, TILE_ROWS * rows)

    @inlined
    def where(tile, hg):
        n, m, p0, q0 = tile_of(tile, hg)
        return int32(n), int32(m), int32(p0), int32(q0)

    return where, tap_shift


def make_spots(per, threads, copies, CK, with_block):
    """``spots(spot, hg, IN_ROWS)``: each of this thread's patch copies (``per`` of them, of
    ``copies`` a stage, 16 bytes each, chunk-major) placed in the patch, the same for every tile:
    ``spot[i]`` its depth, row and column there (depth -1: no copy) and its source's offset from
    the patch's first position's, in values, less its block's first channel; ``with_block``, then
    its block's place among blocks of ``CK`` chunks (the filter gradient's unit)."""

    @inlined
    def spots(spot, hg, IN_ROWS):
        H, W = hg[1], hg[2]
        PP = hg[18] * hg[19] * hg[20]
        for i in range(per):
            c = cuda.threadIdx.x + i * threads
            spot[i, 0] = -1
            if c < copies:
                ck, pos = divmod32(c, PP)
                rest, w = divmod32(pos, hg[20])
                dd, h = divmod32(rest, hg[19])
                spot[i, 0], spot[i, 1], spot[i, 2] = int32(dd), int32(h), int32(w)
                spot[i, 3] = ((int32(dd) * H + int32(h)) * W + int32(w)) * IN_ROWS + 8 * (int32(ck) % CK)
                if with_block:
                    spot[i, 4] = int32(ck) // CK

    return spots


def forward_stages(most, stages=STAGES):
    """The forward's ring for a layer whose output groups hold at most ``most`` blocks (a thread
    block's stages, filters not kept): ``stages`` (`ConvConfig.hopper_stages`), or fewer where
    ``most + 1`` put every stage in flight at once; 2 at least."""
    return max(2, min(stages, most + 1))


def forward_blocks(hg, G, stages, blocks, keep=0):
    """Thread blocks a multiprocessor the forward's registers are capped for: the most, up to
    ``blocks`` (`ConvConfig.hopper_blocks`), whose shared memory (`ring_bytes`, ``keep`` filters
    kept) fits a multiprocessor's (each thread block reserving 1 KB); 0 (no cap) where fewer than
    two fit, or ``blocks`` is 0. More would only cost registers: shared memory bounds residency."""
    most = min(blocks, rings_fit(hg, G, stages, keep))
    return most if most >= 2 else 0


def make_forward(storage, G, TRS, positions, rows_out=False, groups=1, keep=0, biased=True, stages=STAGES,
                 blocks=0, rows=1):
    """The kernel for channel groups of G, TRS taps, patches of ``positions`` positions and tiles of
    ``groups`` warpgroups (see the module's docstring). ``rows_out``: the output written
    channels-last (N, positions, channels).

    ``keep`` 0: grid (tiles, output groups), a thread block a tile, each stage a block's patch and
    filter. ``keep`` K: grid (workers, output groups), each thread block walking its share of the
    tiles with its group's filter blocks (up to K) copied once and kept in shared memory, each
    stage only a patch (a tile's blocks in turn): the filters' bytes are read once a thread
    block instead of once a tile.

    The epilogue stores each value from its register (channels-last, a lane's two neighbouring
    channels by one 32-bit store). Without ``biased`` (a call with no edge bias) it has no bias
    code. ``stages``: the ring's (`forward_stages`); ``blocks`` (`ConvConfig.
    hopper_blocks`): thread blocks a multiprocessor its registers are capped for (0: no cap).
    ``rows`` (`ConvConfig.hopper_rows`): 8 x 8 tiles a warpgroup down the output rows, each its
    own accumulators, A the same descriptor 8 patch rows further: a stage's filter block and
    copies serve ``rows`` times the positions."""
    THREADS = WARPGROUP * groups
    CK = G // 8  # chunks of 8 channels a position
    A_CHUNK = positions * CHUNK  # a patch chunk's stride (lbo)
    B_CHUNK = TRS * G * CHUNK  # a filter chunk's stride (lbo)
    A_BYTES, B_BYTES = CK * A_CHUNK, CK * B_CHUNK
    STAGE = A_BYTES + (0 if keep else B_BYTES)
    KEPT = stages * STAGE  # (where kept filters start)
    A_COPIES, B_COPIES = CK * positions, CK * TRS * G
    A_PER, B_PER = -(-A_COPIES // THREADS), -(-B_COPIES // THREADS)
    E = 2
    ACC = G // 2  # accumulators a thread
    kind = "bf16" if storage == "bfloat16" else "f16"
    mma = make_mma(G, kind, False, False)
    settle = make_settle(G)
    wg_wait_all = wg_waiter(0)
    narrow = stored_as(storage)
    widen, _ = converters(storage, float32)

    @inlined
    def issue(s, at, args):
        """Stage s: tile s // count's block s % count (a thread block of one tile: its s-th
        block): its patch (its input channels from c_first; the copies placed once a tile), then
        that block's packed filter unless ``keep``."""
        x_at, f_at, sources, spot, grp_blk, blk_c0, ptr, count, first_tile, placed, hg, IN_ROWS = args
        tile, b = divmod32(s, count)
        if placed[0] != tile:  # (a tile's stages come in order: its first places the patch's copies)
            n, m, p0, q0 = where(first_tile + int32(tile), hg)
            place(sources, spot, m, p0, q0, hg, IN_ROWS)
            placed[0], placed[1] = tile, E * int64(n) * (hg[0] * hg[1] * hg[2]) * IN_ROWS
        image_at = x_at + placed[1]
        e = grp_blk[ptr + b]
        c_first = blk_c0[e]
        for i in range(A_PER):
            c = cuda.threadIdx.x + i * THREADS
            if c < A_COPIES:
                inside = sources[i] >= 0
                copy16_or_zero(at + c * CHUNK, image_at + (E * int64(sources[i] + c_first) if inside else 0), inside)
        if not keep:
            copy_filter(at + A_BYTES, f_at, e)

    @inlined
    def copy_filter(to, f_at, e):
        f_from = f_at + E * int64(e) * (G * G * TRS)
        for i in range(B_PER):
            c = cuda.threadIdx.x + i * THREADS
            if c < B_COPIES:
                copy16_to(to + c * CHUNK, f_from + CHUNK * c)

    where, tap_shift = make_where(TILE_COLS * groups, rows)
    DOWN = uint64(TILE_ROWS * CHUNK // 16)  # (the next 8 x 8 tile's A: 8 patch rows on, times the pitch)

    prime, advance = make_ring(issue, stages, STAGE, visible=proxy_fence)

    def tap_step(tap, acc, acc2, at, b_at, shifts, group, hg):
        """Tap ``tap``'s k16 steps: A the patch shifted by the tap's offset (and this warpgroup's 8
        columns), B its filter slices (the block's filter at ``b_at``); with ``rows`` 2, the tile
        below into ``acc2``."""
        a = descriptor(at + (shifts[tap] + TILE_COLS * group) * CHUNK, A_CHUNK, hg[20] * CHUNK, 0)
        b = descriptor(b_at + tap * G * CHUNK, B_CHUNK, 8 * CHUNK, 0)
        for kk in range(CK // 2):  # (two chunks a k16 step)
            mma(acc, a + uint64(kk * 2 * A_CHUNK // 16), b + uint64(kk * 2 * B_CHUNK // 16), int32(1))
            if rows == 2:
                mma(acc2, a + uint64(kk * 2 * A_CHUNK // 16) + DOWN * uint64(hg[20]),
                    b + uint64(kk * 2 * B_CHUNK // 16), int32(1))

    taps = unrolled(TRS, inlined(tap_step), inline=inlined)

    spots = make_spots(A_PER, THREADS, A_COPIES, CK, False)

    @inlined
    def place(sources, spot, m, p0, q0, hg, IN_ROWS):
        """Each of this thread's patch copies' source for the tile at (m, p0, q0), in values from its
        image's start less the block's first channel, -1 outside the input (zeros)."""
        D, H, W = hg[0], hg[1], hg[2]
        d0, h0, w0 = m - hg[12], p0 - hg[13], q0 - hg[14]
        first = ((d0 * H + h0) * W + w0) * IN_ROWS  # (the patch's first position's, maybe outside)
        for i in range(A_PER):
            sources[i] = -1
            if spot[i, 0] >= 0:  # (a copy this thread makes: its spot's other fields are set)
                d, h, w = d0 + spot[i, 0], h0 + spot[i, 1], w0 + spot[i, 2]
                if 0 <= d < D and 0 <= h < H and 0 <= w < W:
                    sources[i] = first + spot[i, 3]

    @inlined
    def store(out, acc, n, m, p0, q0, k0, hg, OUT_ROWS, bias, edge, has_bias):
        """The tile's outputs from the accumulators: lane l of warp w holds positions 16 w + l // 4
        (+ 8) and channels 8 j + 2 (l % 4) (+ 1) (`ptx.wgmma.acc_position`)."""
        M, P, Q = hg[3], hg[4], hg[5]
        MPQ = M * P * Q
        tid = cuda.threadIdx.x
        group, warp, lane = tid // WARPGROUP, (tid % WARPGROUP) // 32, tid % 32
        o_of = cuda.local.array(2, int32)  # a lane's two positions (-1: past the output's edge) ...
        b_of = cuda.local.array(2, int32)  # ... and their edge-bias columns (-1: none), read once
        for h in range(2):
            row = 16 * warp + lane // 4 + 8 * h
            p, q = p0 + row // TILE_COLS, q0 + TILE_COLS * group + row % TILE_COLS
            o_of[h], b_of[h] = -1, -1
            if p < P and q < Q:
                o_of[h] = (m * P + p) * Q + q
                if biased and has_bias:
                    b_of[h] = edge[o_of[h]]
        if rows_out:  # (a lane's two channels are neighbours: one 32-bit store, K and k even)
            for i in range(ACC // 2):
                j, h = i // 2, i % 2
                k = k0 + 8 * j + 2 * (lane % 4)
                o = o_of[h]
                if o >= 0:
                    v0, v1 = acc[2 * i], acc[2 * i + 1]
                    if biased and b_of[h] >= 0:
                        v0 += widen(bias[k, b_of[h]])
                        v1 += widen(bias[k + 1, b_of[h]])
                    store2(out, (uint64((int64(n) * MPQ + o) * OUT_ROWS + k),), (narrow(v0), narrow(v1)))
        else:
            for i in range(ACC):
                j, h, e = i // 4, (i // 2) % 2, i % 2
                k = k0 + 8 * j + 2 * (lane % 4) + e
                o = o_of[h]
                if o >= 0:
                    value = acc[i]
                    if biased and b_of[h] >= 0:
                        value += widen(bias[k, b_of[h]])
                    out[uint64((int64(n) * OUT_ROWS + k) * MPQ + o)] = narrow(value)

    @inlined
    def tap_shifts(shifts, hg):
        """Each tap's offset in patch positions (dilated)."""
        for tap in range(TRS):
            shifts[tap] = tap_shift(tap, hg)

    @(bounded(THREADS, blocks) if blocks else cuda.jit)
    def forward(out, x, f, grp_ptr, grp_blk, blk_c0, hg, OUT_ROWS, IN_ROWS, bias, edge, has_bias, tiles, workers):
        worker, g = cuda.blockIdx.x, cuda.blockIdx.y
        first_tile = (worker * tiles) // workers if keep else worker
        my_tiles = ((worker + 1) * tiles) // workers - first_tile if keep else 1
        smem = cuda.shared.array(0, int32)
        base = shared_address(smem, (0,))
        acc = cuda.local.array(ACC, float32)
        acc2 = cuda.local.array(ACC, float32)  # (the tile below, with rows 2)
        for i in range(ACC):
            acc[i] = float32(0)
            acc2[i] = float32(0)
        ptr = grp_ptr[g]
        count = grp_ptr[g + 1] - ptr
        if count == 0:  # an output group no block reaches: zeros (and its bias)
            for tile in range(first_tile, first_tile + my_tiles):
                n, m, p0, q0 = where(tile, hg)
                for r in range(rows):
                    store(out, acc, n, m, p0 + TILE_ROWS * r, q0, g * G, hg, OUT_ROWS, bias, edge, has_bias)
            return
        x_at, f_at = signed_address(x, (0,)), signed_address(f, (0,))
        if keep:  # the group's filters, once (their own commit group, waited for with the first stage)
            for b in range(count):
                copy_filter(base + KEPT + b * B_BYTES, f_at, grp_blk[ptr + b])
            commit()
        sources = cuda.local.array(A_PER, int32)
        spot = cuda.local.array((A_PER, 4), int32)
        spots(spot, hg, IN_ROWS)
        placed = cuda.local.array(2, int64)  # the tile whose patch copies are placed, its image's offset
        placed[0] = -1
        args = (x_at, f_at, sources, spot, grp_blk, blk_c0, ptr, count, first_tile, placed, hg, IN_ROWS)
        shifts = cuda.local.array(TRS, int32)
        tap_shifts(shifts, hg)
        total = my_tiles * count
        prime(base, total, args)
        buf = 0
        for s in range(total):
            at, buf = advance(s, buf, base, total, args)
            tile, b = divmod32(s, count)
            fence()
            taps(acc, acc2, at, base + KEPT + b * B_BYTES if keep else at + A_BYTES, shifts,
                 cuda.threadIdx.x // WARPGROUP, hg)
            wg_commit()
            wg_wait_all()  # (the buffer is free for the copies the next barrier lets in)
            if b == count - 1:
                settle(acc)
                n, m, p0, q0 = where(first_tile + int32(tile), hg)
                store(out, acc, n, m, p0, q0, g * G, hg, OUT_ROWS, bias, edge, has_bias)
                if rows == 2:
                    settle(acc2)
                    store(out, acc2, n, m, p0 + TILE_ROWS, q0, g * G, hg, OUT_ROWS, bias, edge, has_bias)
                for i in range(ACC):
                    acc[i] = float32(0)
                    acc2[i] = float32(0)

    return dynamic_shared(forward, KEPT + keep * B_BYTES)


FILTER_M = 64  # a filter-gradient unit's input channels: wgmma's m (64 / G blocks of one output group)
FILTER_ACC = 96  # accumulators a thread of the filter gradient holds at most (its taps' 64 x G tiles)
FILTER_COLS = 16  # a filter-gradient tile's output columns (8 rows of them: 128 positions, k of 8 k16 steps)


def filter_taps(TRS, G, taps=0):
    """Taps each of a filter-gradient thread block's two warpgroups takes (its tap group's first
    half, then its second): ``taps`` (`ConvConfig.hopper_filter_taps`) or, where 0, half the taps
    at most ``FILTER_ACC / (G / 2)``; never more than half the taps."""
    return max(1, min(-(-TRS // 2), taps or FILTER_ACC // (G // 2)))


def filter_geometry(geo):
    """`geometry` for the filter gradient's tiles of 8 rows of `FILTER_COLS` positions."""
    return geometry(geo, FILTER_COLS // TILE_COLS)


def filter_stage_bytes(hg, G, dy_a=False):
    """A filter-gradient stage's bytes: the unit's patch and a tile's dy (``dy_a``: the patch of one
    input group and the dy of the unit's output groups)."""
    patch, dy = (G // 8, FILTER_M // 8) if dy_a else (FILTER_M // 8, G // 8)
    return patch * patch_positions(hg) * CHUNK + dy * TILE_ROWS * FILTER_COLS * CHUNK


def dy_first_fits(geo, dy_pointer):
    """Whether the filter gradient with dy as A may read a channels-first dy as it lies (`make_filter_grad`'s
    ``dy_first``): output rows of whole runs of 8 positions (16 bytes) from a 16-byte aligned start."""
    return int(geo[5]) % 8 == 0 and dy_pointer % 16 == 0


def filter_stages(overlap):
    """The filter gradient's ring: 3 stages, or 4 where a stage's wgmmas run on under the next
    stage's barrier (``overlap``, `ConvConfig.hopper_filter_overlap`)."""
    return STAGES + 1 if overlap else STAGES


def filter_fits(geo, G, overlap=False, dy_a=False):
    """Whether a layer's filter gradient takes `make_filter_grad`: `fits`' conditions, for its ring."""
    return (G in (16, 32, 64) and tuple(int(v) for v in geo[9:12]) == (1, 1, 1) and int(geo[4]) >= TILE_ROWS
            and filter_stages(overlap) * filter_stage_bytes(filter_geometry(geo), G, dy_a) <= SHARED_MAX)


def filter_units(blocks, G, dy_a=False):
    """The filter gradient's units: the blocks of each output group (``dy_a``: of each input
    group) (``blocks``: (first input channel, first output channel) a block) in runs of 64 / G,
    as an int32 array (units, 64 / G), -1 past a group's last block."""
    import numpy as np

    per = FILTER_M // G
    groups: dict = {}
    for b, (c0, k0) in enumerate(blocks):
        groups.setdefault(c0 if dy_a else k0, []).append(b)
    units = [run[i:i + per] + [-1] * (per - len(run[i:i + per])) for run in groups.values()
             for i in range(0, len(run), per)]
    return np.array(units or [[-1] * per], np.int32).reshape(-1, per)


def make_filter_grad(storage, G, TRS, positions, TW, overlap=False, dy_a=False, dy_first=False):
    """The filter gradient's partial sums on wgmma, for channel groups of G, TRS taps, patches of
    ``positions`` positions and ``TW`` taps a warpgroup (`filter_taps`).

    dF[k, c, tap] = Σ over positions of dy[position, k] · x[position + tap's offset, c]: the
    positions are the product's k. A unit (`filter_units`) is up to 64 / G blocks of one output
    group, whose input channels make wgmma's m = 64: A is their patch (the forward's layout, the
    blocks' channels one chunk of 8 after another), MN-major (a core matrix: 8 positions of one
    output row, shifted by the tap, 8 channels each; ``lbo`` the patch row's pitch, the next output
    row; ``sbo`` the chunk's stride); B is the tile's output gradient, n = the group's G output
    channels, MN-major as well (staged chunk-major in the k steps' order of positions). A tile
    is 8 rows of `FILTER_COLS` positions, eight k16 steps (a pair of rows, half of them), each
    every tap's wgmma. Warpgroup w takes taps ``tap0 + w·TW`` onwards, TW of them (past the last,
    the last again, never stored), each a 64 x G tile of accumulators.

    Grid (shares, units, tap groups of 2·TW): a thread block walks its share of the tiles, a stage
    a tile, and writes its unit's blocks' sums of its taps into ``part``'s slot of its share (the
    implicit GEMM's layout: share, block, k, c, tap), which `implicit.make_sum` adds in order.
    With ``overlap`` a stage's wgmmas are waited for only after the next stage's are issued (a
    ring of 4 whose copies skip the buffer still read), so the tensor cores run on through the
    barrier between two stages; else each stage's before the barrier.

    With ``dy_a`` the roles turn: a unit is up to 64 / G blocks of one input group, whose output
    channels make m; a stage holds that group's patch (G channels) and the tile's dy of the
    blocks' output groups (one chunk of 8 channels after another, block after block). Each warp
    reads its 16 rows of A (dy, 16 positions of the k16 step) into registers by one
    ``ldmatrix.trans`` a step, and every tap's wgmma takes them (`ptx.wgmma.make_mma_rs`), its B
    the patch shifted by the tap (n = G, the same descriptor the patch has as A otherwise): a
    tap's wgmma reads G x 16 values of shared memory instead of (64 + G) x 16.

    With ``dy_first`` too (`dy_first_fits`: output rows of whole 16-byte runs), dy is read as the
    caller's channels-first array, not a channels-last copy: a copy is 8 positions of an output
    row of one channel (a thread pair a row's 16, 32 bytes), staged k-major (8 positions of the 64
    channels after another 8), A's rows as `ldmatrix` reads them untransposed."""
    THREADS = 2 * WARPGROUP
    CK = G // 8  # chunks of 8 channels a block
    UNIT = FILTER_M // G  # blocks a unit
    ACC = G // 2  # accumulators a thread a tap
    HELD = TW * ACC  # ... and all of them
    PATCH_CK, DY_CK = (CK, FILTER_M // 8) if dy_a else (FILTER_M // 8, CK)  # chunks a position of each
    A_CHUNK = positions * CHUNK  # a patch chunk's stride (sbo)
    A_BYTES = PATCH_CK * A_CHUNK  # (the patch, first in a stage, A or with dy_a B)
    TILE = TILE_ROWS * FILTER_COLS  # positions a tile (a stage)
    B_CHUNK = TILE * CHUNK  # a dy chunk's stride (sbo)
    STAGE = A_BYTES + DY_CK * B_CHUNK
    A_COPIES, B_COPIES = PATCH_CK * positions, DY_CK * TILE
    A_PER, B_PER = -(-A_COPIES // THREADS), -(-B_COPIES // THREADS)
    E = 2
    kind = "bf16" if storage == "bfloat16" else "f16"
    settle = make_settle(TW * G)
    RING = filter_stages(overlap)
    wg_wait_all, wg_wait_stage = wg_waiter(0), wg_waiter(1 if overlap else 0)
    where, tap_shift = make_where(FILTER_COLS)

    spots = make_spots(A_PER, THREADS, A_COPIES, CK, not dy_a)

    @inlined
    def issue(s, at, args):
        """Stage s: tile ``first + s``'s patch of the unit's input channels (zeros in the padding and
        for a missing block) and its output gradient (zeros past the output's edges); ``firsts``
        the unit's blocks' first input channels (with ``dy_a``: first output channels) and ``ch``
        the first channel the unit shares on the other side (its output group's; its input group's)."""
        x_at, dy_at, spot, firsts, ch, first, hg, IN_ROWS, K = args
        D, H, W = hg[0], hg[1], hg[2]
        M, P, Q = hg[3], hg[4], hg[5]
        n, m, p0, q0 = where(first + int32(s), hg)
        d0, h0, w0 = m - hg[12], p0 - hg[13], q0 - hg[14]
        image = E * int64(n) * (D * H * W) * IN_ROWS
        corner = ((d0 * H + h0) * W + w0) * IN_ROWS  # (the patch's first position's, maybe outside)
        for i in range(A_PER):
            c = cuda.threadIdx.x + i * THREADS
            if spot[i, 0] >= 0:
                d, h, w = d0 + spot[i, 0], h0 + spot[i, 1], w0 + spot[i, 2]
                c_first = ch if dy_a else firsts[spot[i, 4]]
                inside = c_first >= 0 and 0 <= d < D and 0 <= h < H and 0 <= w < W
                source = x_at + (image + E * int64(corner + spot[i, 3] + c_first) if inside else 0)
                copy16_or_zero(at + c * CHUNK, source, inside)
        b_at = at + A_BYTES
        for i in range(B_PER):
            c = cuda.threadIdx.x + i * THREADS
            if c < B_COPIES and dy_first:  # (channel kk's 8 positions at tile row r, columns 8 half ..)
                kk, rest = divmod32(c, 2 * TILE_ROWS)
                r, half = divmod32(rest, 2)
                p, q = p0 + int32(r), q0 + 8 * int32(half)
                k_first = firsts[kk // G]
                keep = p < P and q < Q and k_first >= 0
                row = (int64(n) * K + k_first + kk % G) * (M * P * Q) + (m * P + p) * Q + q
                ks = 2 * (r // 2) + half  # (the k16 step, and its 8-position half r % 2)
                copy16_or_zero(b_at + ((2 * ks + r % 2) * FILTER_M + kk) * CHUNK, dy_at + (E * row if keep else 0),
                               keep)
            elif c < B_COPIES:
                j, pp = divmod32(c, TILE)  # (chunk j of position pp in the k steps' order)
                ks, rest = divmod32(pp, 16)
                r, c8 = divmod32(rest, 8)
                p, q = p0 + 2 * int32(ks // 2) + int32(r), q0 + 8 * int32(ks % 2) + int32(c8)
                if dy_a:  # (chunk j: block j // CK's output channels, zeros for a missing block)
                    k_first = firsts[j // CK]
                    keep = p < P and q < Q and k_first >= 0
                    k_at = k_first + 8 * int32(j % CK)
                else:
                    keep = p < P and q < Q
                    k_at = ch + 8 * int32(j)
                source = dy_at + (E * ((int64(n) * (M * P * Q) + (m * P + p) * Q + q) * K + k_at) if keep else 0)
                copy16_or_zero(b_at + c * CHUNK, source, keep)

    prime, advance = make_ring(issue, RING, STAGE, counter=False, visible=proxy_fence, lag=2 if overlap else 1)

    @inlined
    def patch_of(at, ks, shift, hg):
        """The patch's descriptor at k16 step ks's rows and columns, shifted by a tap's offset."""
        row = 2 * (ks // 2) * hg[20] + TILE_COLS * (ks % 2)
        return descriptor(at + (shift + row) * CHUNK, hg[20] * CHUNK, A_CHUNK, 0)

    def make_tap(i):
        """This warpgroup's i-th tap at k16 step ks: the patch (`patch_of`) is A and the step's 16
        positions of dy B; with ``dy_a`` the patch is B, A the step's dy in a0-a3."""
        if dy_a:
            mma_rs = make_mma_rs(G, kind, True, first=i * ACC)

            def tap(acc, at, ks, shifts, hg, a0, a1, a2, a3):
                mma_rs(acc, a0, a1, a2, a3, patch_of(at, ks, shifts[i], hg), int32(1))
        else:
            mma = make_mma(G, kind, True, True, first=i * ACC)

            def tap(acc, at, ks, shifts, hg, a0, a1, a2, a3):
                dy = descriptor(at + A_BYTES + ks * 16 * CHUNK, 8 * CHUNK, B_CHUNK, 0)
                mma(acc, patch_of(at, ks, shifts[i], hg), dy, int32(1))

        return inlined(tap)

    namespace = {f"tap{i}": make_tap(i) for i in range(TW)}
    exec("def taps(acc, at, ks, shifts, hg, a0, a1, a2, a3):\n" + "\n".join(
        f"    tap{i}(acc, at, ks, shifts, hg, a0, a1, a2, a3)" for i in range(TW)) + "\n", namespace)
    taps = inlined(namespace["taps"])

    if dy_a:
        def step(ks, acc, at, shifts, hg, lane_at):
            """k16 step ks of a stage: this warp's rows of its dy (``lane_at``: this lane's ldmatrix
            row of step 0, from the stage's start), then a fence (registers a wgmma reads were
            written), then the taps."""
            if dy_first:
                a0, a1, a2, a3 = ldmatrix_x4_at(at + lane_at + ks * (2 * FILTER_M) * CHUNK)
            else:
                a0, a1, a2, a3 = ldmatrix_x4_trans_at(at + lane_at + ks * 16 * CHUNK)
            fence()
            taps(acc, at, ks, shifts, hg, a0, a1, a2, a3)
    else:
        def step(ks, acc, at, shifts, hg, lane_at):
            zero = uint32(0)  # (no A registers: the taps' A is the patch)
            taps(acc, at, ks, shifts, hg, zero, zero, zero, zero)

    # A stage's k16 steps written out: rolled, the accumulators cross the loop's edge between
    # wgmmas in flight, and ptxas serialises them (it injects warpgroup.arrive, warning C7519).
    steps = unrolled(TILE // 16, inlined(step), inline=inlined)

    ROW_STEP, COLUMN_STEP = (G * TRS, TRS) if dy_a else (TRS, G * TRS)  # (part's (k, c, tap) layout)

    @inlined
    def store(part, acc, slot, unit_blk, u, tap0):
        """The accumulators into the share's slot: lane l of warp w holds the unit's input channels
        16 w + l // 4 (+ 8) and output channels 8 j + 2 (l % 4) (+ 1) of each tap (with ``dy_a``
        output channels and input channels)."""
        tid = cuda.threadIdx.x % WARPGROUP
        warp, lane = tid // 32, tid % 32
        for h in range(2):
            row = 16 * warp + lane // 4 + 8 * h
            b = unit_blk[u, row // G]
            if b >= 0:
                at = slot + int64(b) * (G * G * TRS) + (row % G) * ROW_STEP
                for i in range(TW):
                    tap = tap0 + i
                    if tap < TRS:
                        for j in range(ACC // 4):
                            for e in range(2):
                                column = 8 * j + 2 * (lane % 4) + e
                                part[at + column * COLUMN_STEP + tap] = acc[i * ACC + 4 * j + 2 * h + e]

    @cuda.jit
    def filter_grad(part, dy, x, unit_blk, blk_c0, blk_k0, hg, IN_ROWS, K, tiles, shares, f_size):
        share, u = cuda.blockIdx.x, cuda.blockIdx.y
        group = cuda.threadIdx.x // WARPGROUP
        tap0 = (cuda.blockIdx.z * 2 + group) * TW  # (this warpgroup's first tap)
        smem = cuda.shared.array(0, int32)
        base = shared_address(smem, (0,))
        acc = cuda.local.array(HELD, float32)
        for i in range(HELD):
            acc[i] = float32(0)
        firsts = cuda.local.array(UNIT, int32)  # the unit's blocks' first input (dy_a: output) channels
        for j in range(UNIT):  # (-1: none)
            b = unit_blk[u, j]
            firsts[j] = (blk_k0[b] if dy_a else blk_c0[b]) if b >= 0 else -1
        ch = blk_c0[unit_blk[u, 0]] if dy_a else blk_k0[unit_blk[u, 0]]
        # (dy_a: this lane's ldmatrix row of step 0: lanes 8q .. 8q + 7 give matrix q's rows, the
        # positions (q // 2) 8 .. of its warp's 16 output channels' chunk 2 w + q % 2)
        warp, lane = (cuda.threadIdx.x % WARPGROUP) // 32, cuda.threadIdx.x % 32
        q = lane // 8
        lane_at = A_BYTES + ((2 * warp + q % 2) * TILE + (q // 2) * 8 + lane % 8) * CHUNK
        if dy_first:  # (matrix q: the step's 8-position half q // 2 of channels 16 w + 8 (q % 2) ..)
            lane_at = A_BYTES + ((q // 2) * FILTER_M + 16 * warp + 8 * (q % 2) + lane % 8) * CHUNK
        spot = cuda.local.array((A_PER, 5), int32)
        spots(spot, hg, IN_ROWS)
        shifts = cuda.local.array(TW, int32)  # each of this warpgroup's taps' offset in patch positions
        for i in range(TW):
            shifts[i] = tap_shift(min(tap0 + i, TRS - 1), hg)
        first = (share * tiles) // shares
        count = ((share + 1) * tiles) // shares - first
        args = (signed_address(x, (0,)), signed_address(dy, (0,)), spot, firsts, ch, first, hg, IN_ROWS, K)
        prime(base, count, args)
        buf = 0
        for s in range(count):
            at, buf = advance(s, buf, base, count, args)
            fence()
            steps(acc, at, shifts, hg, lane_at)
            wg_commit()
            wg_wait_stage()  # (the buffer the next barrier lets copies into is free: the stage before's)
        wg_wait_all()
        settle(acc)
        store(part, acc, int64(share) * f_size, unit_blk, u, tap0)

    return dynamic_shared(filter_grad, RING * STAGE)
