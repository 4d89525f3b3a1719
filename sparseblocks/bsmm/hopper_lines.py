"""Hopper products of several output block-lines a thread block (``v7_lines``), at block 32.

A block-32 product tile (`hopper.make_product_v7`) reads a 128 x 32 tile of x for every block it
multiplies: 8 KB of x and 2 KB of W for 2·128·32·32 FLOP, so it runs at the speed of L2, not of
the tensor cores (`docs/performance.md`). Here a thread block owns BM rows of L neighbouring
output block-lines (``v7_lines[bs]``: L block-columns of W in the forward, L block-rows in the
input gradient), and walks the union of the other indices those lines have blocks at: each stage
is one x tile (BM x bs, read once) and the L lines' W blocks there side by side, a zero block
where a line has none. The L blocks are one B operand N = L·bs wide (a block is one swizzle atom
along N, the next block the next atom), so a stage is one ``wgmma`` m64n(L·bs)k16 a k16 step and
64-row tile: a few instructions, none guarded. The tensor cores multiply the zero blocks too
(at 25 % density four lines have 1.47 blocks a stage of 4), and in return x crosses from L2
1.47x less often (2.1x at 50 %) and the multiplying warps issue almost nothing but wgmmas.

The schedule (`line_groups`): for each group of L lines, its entries in ascending other index,
each with the L block indices (-1 where the line has no block there).

Warp-specialized as `hopper.make_split`: a copying warpgroup fills a ring of ``v7_lines_stages``
buffers by cp.async (zeros by cp.async's zero fill where a line has no block), each stage
completing on its full mbarrier; the multiplying warpgroups (``v7_lines_groups``, each
``v7_lines_tiles`` 64-row tiles) wait, multiply, and hand the buffer back on its empty
mbarrier. Shared tiles are 64-byte-swizzled (rows of 32 values), as block 32's products. The
epilogue stages the fp32 accumulators in the ring's shared memory, then writes rows of L x bs
values. feature_axis 1 (x and the output (N, features)); rows past N read the last row and are
not written.
"""

import numpy as np
from numba import cuda, float32, int32, int64, uint64

from ..ptx.cp_async import copy16_or_zero, shared_address, signed_address
from ..ptx.mbarrier import BYTES as BAR_BYTES
from ..ptx.mbarrier import copy_arrive, named_barrier
from ..ptx.mbarrier import init as bar_init
from ..ptx.mbarrier import wait as bar_wait
from ..ptx.vector import load4, store2, store4
from ..ptx.wgmma import WARPGROUP, WGMMA_K, WGMMA_M, align_up, descriptor, fence, make_mma, make_settle
from ..ptx.wgmma import commit as wg_commit
from ..runtime.compile import bounded, inlined, unrolled
from ..runtime.launch import dynamic_shared
from .device import grouped_tile
from .hopper_shapes import ATOM, CHUNK, make_place, swizzle_of

LINES_BLOCKS = (32,)  # block sizes the kernel takes: a stage is one block's k (a 64-byte swizzle row)


def lines_shape(cfg, bs):
    """(BM, L, warpgroups, 64-row tiles a warpgroup, stages) of a lines product tile."""
    groups, tiles = cfg.v7_lines_groups.get(bs, 2), cfg.v7_lines_tiles.get(bs, 1)
    return groups * tiles * WGMMA_M, cfg.v7_lines.get(bs, 0), groups, tiles, cfg.v7_lines_stages


def lines_threads(cfg, bs):
    """A lines product's threads: its multiplying warpgroups and the copying one."""
    return WARPGROUP * (lines_shape(cfg, bs)[2] + 1)


def lines_layout(cfg, bs):
    """(stage bytes, x tile bytes, a W block's bytes, staged fp32 tile's pitch in words, where
    the mbarriers start, all shared bytes)."""
    BM, L, _, _, STAGES = lines_shape(cfg, bs)
    A_BYTES, B_BYTES = 2 * BM * bs, 2 * bs * bs
    STAGE = A_BYTES + L * B_BYTES
    PITCH = L * bs + 8  # (a warp's pairs of accumulators on distinct banks)
    bars = max(STAGES * STAGE + ATOM, 4 * BM * PITCH + ATOM)
    return STAGE, A_BYTES, B_BYTES, PITCH, bars, bars + 2 * STAGES * BAR_BYTES


def lines_check(cfg, bs):
    """Why ``v7_lines[bs]`` cannot be built under ``cfg`` ('' where it can)."""
    BM, L, GROUPS, TILES, STAGES = lines_shape(cfg, bs)
    if bs not in LINES_BLOCKS:
        return f"block {bs}: the lines products take blocks of {LINES_BLOCKS}"
    if not isinstance(L, int) or not 2 <= L <= 8:
        return f"expected 2 to 8 lines a thread block, got {L!r}"
    if not 1 <= GROUPS <= 2 or TILES not in (1, 2):
        return f"{GROUPS} warpgroups of {TILES} 64-row tiles: expected 1 or 2 of 1 or 2"
    if L * TILES * bs // 2 > 128:
        return f"{L} lines of {TILES} tiles keep {L * TILES * bs // 2} accumulators a thread (at most 128)"
    if not 3 <= STAGES <= 8:
        return f"v7_lines_stages: expected 3 to 8, got {STAGES}"
    if lines_layout(cfg, bs)[5] > cfg.v6_max_shared:
        return f"{lines_layout(cfg, bs)[5]} bytes of shared memory over v6_max_shared (fewer stages or lines)"
    return ""


def line_groups(layout, transpose_w, L):
    """The lines products' schedule over ``layout``: (begin, other, blocks) with group g's
    entries at begin[g]:begin[g + 1], each an other index (ascending: W's block-row in the
    forward, block-column in the input gradient) and the block indices of the group's L lines
    there (``blocks``, (entries, L) int32, -1 where the line has none)."""
    if transpose_w:  # lines are W's block-rows, in row order: block j is the j-th stored
        ptr, other, block = layout.row_ptr, layout.col_idx, np.arange(layout.n_blocks)
    else:
        ptr, other, block = layout.col_ptr, layout.row_idx, layout.col_block
    ptr, other, block = (np.asarray(a, np.int64) for a in (ptr, other, block))
    n_lines, n_other = len(ptr) - 1, layout.shape[1 if transpose_w else 0]
    groups = -(-n_lines // L)
    line = np.repeat(np.arange(n_lines), np.diff(ptr))
    keys, entry = np.unique((line // L) * n_other + other, return_inverse=True)
    blocks = np.full((len(keys), L), -1, np.int32)
    blocks[entry.reshape(-1), line % L] = block
    begin = np.searchsorted(keys // n_other, np.arange(groups + 1)).astype(np.int32)
    return begin, (keys % n_other).astype(np.int32), blocks


def make_product_lines(cfg, bs, storage, acc_type, transpose_w, feature_axis):
    """``product_lines(out, a, w, begin, other, blocks, n_rows, n_lines)`` on a grid of (row
    tiles, line groups), `lines_shape`'s threads plus a copying warpgroup."""
    from .hopper import make_walk, stored_of

    if feature_axis != 1:
        raise ValueError("the lines products take feature_axis 1")
    BM, L, GROUPS, TILES, STAGES = lines_shape(cfg, bs)
    STAGE, A_BYTES, B_BYTES, PITCH, BARS, _ = lines_layout(cfg, bs)
    BK = bs
    STEPS = BK // WGMMA_K
    ACC = bs // 2  # accumulators a thread a 64-row tile of one line
    ACC_ALL = L * TILES * ACC
    B_MN = not transpose_w  # W's block: k down, outputs along; Wᵀ's: k along its stored rows
    A_W, A_MODE = swizzle_of(False, BM, BK)
    B_W, B_MODE = swizzle_of(B_MN, bs, BK)
    A_ATOM, B_ATOM = 8 * A_W, 8 * B_W
    B_GROUP = (BK // 8) * B_ATOM
    place_a = make_place(False, A_W, A_ATOM, 0)
    place_b = make_place(B_MN, B_W, B_ATOM, B_GROUP)
    A_CPR, B_CPR = BK // CHUNK, (bs if B_MN else BK) // CHUNK
    P = WARPGROUP  # the copying warpgroup's threads
    A_PER, B_PER = BM * A_CPR // P, bs * B_CPR // P  # (whole: BM and bs are multiples of 32)
    A_TILE = 8 * A_ATOM  # bytes from one 64-row tile of x to the next
    A_STEP, B_STEP = 32 // 16, (2 * B_ATOM if B_MN else 32) // 16  # a k16 step, in 16-byte units
    kind = "bf16" if storage == "bfloat16" else "f16"
    from_acc = stored_of(storage, acc_type)
    EMPTY_COUNT = 4 * GROUPS  # an empty barrier's arrivals: one a multiplying warp

    # A stage's wgmmas: a k16 step and 64-row tile, one m64n(L·bs)k16 into that tile's L·ACC
    # accumulators (lines in column order), B all L blocks from the stage's first: W's blocks lie
    # one swizzle atom along N apart (lbo, MN-major) or 8-row groups on (sbo, K-major)
    assert B_GROUP == B_BYTES  # (a block's bytes: the stride from one line's block to the next)
    mma_0 = make_mma(L * bs, kind, False, B_MN)
    mma_1 = make_mma(L * bs, kind, False, B_MN, first=L * ACC)

    @inlined
    def multiply(acc, desc_a, desc_b):
        for step in range(STEPS):
            a, b = desc_a + uint64(step * A_STEP), desc_b + uint64(step * B_STEP)
            mma_0(acc, a, b, int32(1))
            if TILES == 2:
                mma_1(acc, a + uint64(A_TILE // 16), b, int32(1))

    @inlined
    def multiply_stage(acc, desc_a, desc_b, buf, s, where):
        move = uint64(buf * (STAGE // 16))
        fence()
        multiply(acc, desc_a + move, desc_b + move)
        wg_commit()

    walk = make_walk(STAGES, False, multiply_stage, make_settle(2 * ACC_ALL))

    @inlined
    def put(p, acc, tile, at, row, col0):
        """Accumulator pair p (tile, then `ptx.wgmma.acc_position`'s order along its L·bs
        columns) into the tile starting at word ``at``."""
        t, q = p // (L * ACC // 2), p % (L * ACC // 2)
        r = row + WGMMA_M * t + 8 * (q % 2)
        c = col0 + 8 * (q // 2)
        store2(tile, (at + r * PITCH + c,), (acc[2 * p], acc[2 * p + 1]))

    stage_acc = unrolled(ACC_ALL // 2, put, inline=inlined)
    RUNS = BM * (L * bs // 4)  # runs of 4 staged values
    OUT_PER = -(-RUNS // (WARPGROUP * GROUPS))
    CPR = L * bs // 4

    GROUP = cfg.product_group

    @bounded(WARPGROUP * (GROUPS + 1))
    def product_lines(out, a, w, begin, other, blocks, n_rows, n_lines):
        tid = cuda.threadIdx.x
        group, thread = tid // WARPGROUP, tid % WARPGROUP
        warp, lane = thread // 32, thread % 32
        tile, g = grouped_tile(GROUP)
        row0 = tile * BM
        first = begin[g]
        n_stages = begin[g + 1] - first
        lead = int64(a.shape[1])
        smem = cuda.shared.array(0, int32)
        start = shared_address(smem, (0,))
        base = align_up(start, ATOM)
        bars = start + BARS
        if tid == 0:
            for i in range(STAGES):
                bar_init(bars + i * BAR_BYTES, P)
                bar_init(bars + (STAGES + i) * BAR_BYTES, EMPTY_COUNT)
        cuda.syncthreads()
        if group == GROUPS:  # the copying warpgroup
            a_base, w_base = signed_address(a, (0, 0)), signed_address(w, (0, 0, 0))
            buf, parity = 0, 1  # (the first time round every buffer is empty)
            for s in range(n_stages):
                u = first + s
                bar_wait(bars + (STAGES + buf) * BAR_BYTES, parity)
                at = base + buf * STAGE
                feature = int64(other[u]) * bs
                for i in range(A_PER):
                    row, col, to = place_a(thread + i * P, A_CPR)
                    src = a_base + 2 * (int64(min(row0 + row, n_rows - 1)) * lead + feature + col)
                    copy16_or_zero(at + to, src, True)
                for j in range(L):  # (a line without a block there: a zero block)
                    b = blocks[u, j]
                    for i in range(B_PER):
                        row, col, to = place_b(thread + i * P, B_CPR)
                        copy16_or_zero(at + A_BYTES + j * B_BYTES + to,
                                       w_base + 2 * (int64(max(b, 0)) * (bs * bs) + row * bs + col), b >= 0)
                copy_arrive(bars + buf * BAR_BYTES)
                buf += 1
                if buf == STAGES:
                    buf, parity = 0, parity ^ 1
        else:
            desc_a = descriptor(base + group * TILES * A_TILE, 16, A_ATOM, A_MODE)
            desc_b = descriptor(base + A_BYTES, B_GROUP if B_MN else 16, B_ATOM, B_MODE)
            acc = cuda.local.array(ACC_ALL, float32)
            for i in range(ACC_ALL):
                acc[i] = float32(0)
            walk(acc, bars, n_stages, desc_a, desc_b, lane, 0, 0, first)
            named_barrier(1, GROUPS * WARPGROUP)  # every warpgroup's wgmmas have read the ring
            staged = cuda.shared.array(0, float32)
            at = (base - start) // 4
            stage_acc(acc, staged, at, group * TILES * WGMMA_M + 16 * warp + lane // 4, 2 * (lane % 4))
            named_barrier(1, GROUPS * WARPGROUP)
            line0 = g * L
            for i in range(OUT_PER):
                e = thread + WARPGROUP * group + i * (WARPGROUP * GROUPS)
                if e < RUNS:
                    r, c = e // CPR, (e % CPR) * 4
                    if row0 + r < n_rows and line0 + c // bs < n_lines:
                        v = load4(staged, (at + r * PITCH + c,))
                        store4(out, (row0 + r, line0 * bs + c),
                               (from_acc(v[0]), from_acc(v[1]), from_acc(v[2]), from_acc(v[3])))
        cuda.syncthreads()

    return dynamic_shared(product_lines, lines_layout(cfg, bs)[5])
