"""Tensor-core weight gradient (version 5): each warp one patch of one block of dW.

Four warps a thread block (block 128: four thread blocks a block); blocks 16
and 32 may group ``v5_wgrad_group[bs]`` blocks of one block-row per warp,
sharing x's slice. fp32 rows of x and dy go to shared memory by cp.async where
aligned (``v5_wgrad_async``), N-splits are cut at multiples of
``v5_wgrad_rows`` and combined in order.
"""

from numba import cuda, float32, int64, uint32, uint64

from ..ptx.cp_async import (
    commit,
    copy16_or_zero,
    global_address,
    shared_address,
    waiter,
)
from ..ptx.mma import MMA_M, MMA_N, pack
from ..ptx.vector import load4
from .device import (
    SHARED_ALIGN,
    activation_io,
    interleave,
    mma_accumulate,
    weight_grad_output,
)
from .tensorcore import v5_values


def v5_wgrad_patches(cfg, bs):
    """Patches of a block of W (a warp each) in version 5's weight gradient: (bs / 32)²."""
    return (bs // min(bs, cfg.v5_warp_tile)) ** 2


def v5_wgrad_blocks(cfg, bs):
    """W blocks a thread block of version 5's weight gradient computes: one per warp, or one
    for all four warps (block 64: a 32-square patch each), or a share of one (block 128)."""
    return max(1, cfg.v5_wgrad_warps // v5_wgrad_patches(cfg, bs))


def v5_wgrad_spread(cfg, bs):
    """Thread blocks that share a block of W in version 5's weight gradient, each with
    ``v5_wgrad_warps`` of its patches: 1, or 4 at block 128 (16 patches, 4 warps)."""
    return max(1, v5_wgrad_patches(cfg, bs) // cfg.v5_wgrad_warps)


def v5_wgrad_warps(cfg, group):
    """Warps a thread block of version 5's weight gradient."""
    V5_WGRAD_GROUP_WARPS = cfg.v5_wgrad_group_warps
    V5_WGRAD_WARPS = cfg.v5_wgrad_warps
    return V5_WGRAD_GROUP_WARPS if group > 1 else V5_WGRAD_WARPS


def v5_wgrad_step(storage):
    """(rows of N, 32-bit words of a column) a step of version 5's weight gradient stages:
    32 rows as 16 words of pairs (16-bit storage), or 16 fp32 rows (the same shared memory)."""
    return 16 * v5_values(storage), 16


def make_weight_grad_v5(cfg, bs, storage, acc_type, feature_axis, vector=False, group=1, out_storage=None):
    """dw[b] (+ beta·dw[b]) on tensor cores: D = xᵀ·dy, k running along N.

    Each warp owns a min(bs, 32)-square patch of one block of W (two 16-row by
    four 8-column mma tiles at block 32), a thread block four warps: four
    blocks (block 16 and 32), the four patches of one (block 64), or four of
    the sixteen of one (block 128: four thread blocks a block). Warps
    work alone: each stages its own slices of x and dy in its own shared
    memory, a step of rows of N at a time (`v5_wgrad_step`), as 32-bit words
    along N: pairs of rows (16-bit storage, the k pairs the fragments take) or
    single fp32 rows (3xTF32, `mma_accumulate`), double-buffered through
    registers, `syncwarp` between steps. With ``vector`` (the launcher checked
    alignment and, for feature_axis 0, that N is a multiple of 4 words' rows)
    loads read 16 bytes: two rows of 8 features paired up, or one row of 4 fp32
    features (feature_axis 1), or 4 words' rows of one feature (feature_axis 0).
    Rows past this split's end are zero. fp32 with feature_axis 1 and
    ``vector`` (and V5_WGRAD_ASYNC): each 16-byte piece of a row goes to shared
    memory by cp.async instead, from addresses taken once, through a ring of
    V5_WGRAD_STAGES buffers a warp.

    With ``group`` G > 1 (one patch a block: blocks 16 and 32) a warp takes a
    segment of up to G consecutive blocks of one block-row
    (`BlockLayout.line_segments` over rows: CSR order is block order) instead
    of one block: it stages x's slice once a step for all of them and each
    block's slice of dy, and reuses x's A fragments for every block, so a
    block costs (1 + 1/G) slices of loads instead of 2. Warps with an empty
    row's segment leave at once.
    """
    V5_WARP_TILE = cfg.v5_warp_tile
    V5_WGRAD_ASYNC = cfg.v5_wgrad_async
    V5_WGRAD_STAGES = cfg.v5_wgrad_stages
    WT = min(bs, V5_WARP_TILE)  # side of a warp's patch
    SIDE = bs // WT
    PATCHES = SIDE * SIDE  # warps on one block
    WARPS = v5_wgrad_warps(cfg, group)
    PER = WARPS if group > 1 else v5_wgrad_blocks(cfg, bs)  # blocks (segments) a thread block
    SPREAD = 1 if group > 1 else v5_wgrad_spread(cfg, bs)  # thread blocks a block, WARPS patches each
    MT = WT // MMA_M
    NT = WT // MMA_N
    ROWS, KW = v5_wgrad_step(storage)  # rows of N and words a step
    VALUES = ROWS // KW
    PAIRS = VALUES == 2
    STRIDE = WT + 8  # words: conflict-free fragment reads (as version 5's weight tiles)
    TILE = KW * STRIDE
    if not vector:
        UNIT = 1
    else:  # words a load unit leaves in shared memory: 8 (two rows of 8 features) or 4
        UNIT = 8 if feature_axis == 1 and PAIRS else 4
    UNITS = KW * WT // UNIT
    PER_LANE = UNITS // 32
    ASYNC = V5_WGRAD_ASYNC and vector and feature_axis == 1 and not PAIRS
    STAGES = V5_WGRAD_STAGES if ASYNC else 2
    wait = waiter(STAGES - 1)  # groups a lane leaves in flight: those committed after a step's
    G = group  # blocks a warp takes: 1 (by coords), or a row segment of up to G blocks
    OPERANDS = 1 + G  # tiles of a stage: x's slice, then each block's slice of dy
    WARP_WORDS = OPERANDS * STAGES * TILE
    SIZE = WARPS * WARP_WORDS
    HELD = 1 if ASYNC else PER_LANE * UNIT  # words a lane holds per operand
    HELD_ALL = OPERANDS * HELD  # (local-array shapes must be literals, not expressions)
    ACC_ROWS = G * MT
    accumulate = mma_accumulate(cfg, storage)
    load, _ = activation_io(feature_axis)
    finish = weight_grad_output(bs, out_storage or storage, acc_type)

    @cuda.jit(device=True, inline=True)
    def fetch(a, held, h0, lane, col0, n0, n_end):
        """This lane's share of a step's rows n0... of features col0...col0 + WT - 1 of a, into
        held[h0...]."""
        last = n_end - 1
        for i in range(PER_LANE):
            e = lane + 32 * i
            if not vector:
                p, c = e // WT, e % WT
                n = n0 + VALUES * p
                col = uint64(col0 + c)
                lo = load(a, uint64(min(n, last)), col) if n <= last else 0
                if PAIRS:
                    hi = load(a, uint64(min(n + 1, last)), col) if n + 1 <= last else 0
                    held[h0 + i] = pack(lo, hi)
                else:
                    held[h0 + i] = uint32(lo)
            elif feature_axis == 1:
                p, cg = e // (WT // UNIT), e % (WT // UNIT)
                n = n0 + VALUES * p
                col = uint64((col0 + UNIT * cg) // VALUES)
                x0 = load4(a, (uint64(min(n, last)), col))
                if PAIRS:
                    x1 = load4(a, (uint64(min(n + 1, last)), col))
                    for c in range(8):
                        word = interleave(x0, x1, c)
                        if n + 1 > last:  # the second row is past the end
                            word = uint32(word & uint32(0xFFFF))
                        held[h0 + i * 8 + c] = word if n <= last else uint32(0)
                else:
                    for c in range(4):
                        held[h0 + i * 4 + c] = uint32(x0[c]) if n <= last else uint32(0)
            else:
                # 4 words' rows of one feature; the end is a multiple of them, so a unit is
                # all in or out.
                c, q = e // (KW // 4), e % (KW // 4)
                n = n0 + 4 * VALUES * q
                v = load4(a, (uint64(col0 + c), uint64(min(n, n_end - 4 * VALUES) // VALUES)))
                for w in range(4):
                    held[h0 + i * 4 + w] = uint32(v[w]) if n < n_end else uint32(0)

    @cuda.jit(device=True, inline=True)
    def deposit(tiles, held, h0, lane, at):
        for i in range(PER_LANE):
            e = lane + 32 * i
            if not vector:
                tiles[uint64(at + (e // WT) * STRIDE + e % WT)] = held[h0 + i]
            elif feature_axis == 1:
                slot = uint64(at + (e // (WT // UNIT)) * STRIDE + UNIT * (e % (WT // UNIT)))
                for c in range(UNIT):
                    tiles[slot + uint64(c)] = held[h0 + i * UNIT + c]
            else:
                slot = uint64(at + 4 * (e % (KW // 4)) * STRIDE + e // (KW // 4))
                for w in range(4):
                    tiles[slot + uint64(w * STRIDE)] = held[h0 + i * 4 + w]

    @cuda.jit(device=True, inline=True)
    def issue(shared, source, row_words, lane, col0, n0, n_end, at):
        """cp.async of this lane's share of a step's rows n0... of features col0... of an fp32
        source (feature_axis 1) into shared words at...; rows past n_end become zeros."""
        for i in range(PER_LANE):
            e = lane + 32 * i
            p, cg = e // (WT // 4), e % (WT // 4)
            n = n0 + p
            row = uint64(min(n, n_end - 1))
            copy16_or_zero(shared + uint64((at + p * STRIDE + 4 * cg) * 4),
                           source + (row * uint64(row_words) + uint64(col0 + 4 * cg)) * uint64(4), n < n_end)

    @cuda.jit(device=True, inline=True)
    def issue_step(shared, x_global, dy_global, x_words, dy_words, lane, c0, cols, count, n0, n_end, at):
        """cp.async of a step's tiles into the buffer at word at: x's rows, then each block's dy."""
        issue(shared, x_global, x_words, lane, c0, n0, n_end, at)
        for j in range(G):
            if j < count:  # the same for the whole warp
                issue(shared, dy_global, dy_words, lane, cols[j], n0, n_end, at + (1 + j) * TILE)

    @cuda.jit(device=True, inline=True)
    def fetch_step(x, dy, held, lane, c0, cols, count, n0, n_end):
        """A step's tiles into registers: x's rows, then each block's dy (HELD words apart)."""
        fetch(x, held, 0, lane, c0, n0, n_end)
        for j in range(G):
            if j < count:
                fetch(dy, held, (1 + j) * HELD, lane, cols[j], n0, n_end)

    @cuda.jit(device=True, inline=True)
    def deposit_step(tiles, held, lane, count, at):
        """fetch_step's registers into the buffer at word at (TILE words a tile)."""
        for o in range(OPERANDS):
            if o <= count:
                deposit(tiles, held, o * HELD, lane, at + o * TILE)

    @cuda.jit(device=True, inline=True)
    def multiply(tiles, acc, fa, ax, g, t, count):
        """acc += the step in the buffer at word ax: x's rows, then each block's rows of dy
        (TILE words apart); the A fragments of x serve every block."""
        for s in range(KW // 8):
            for mt in range(MT):
                at = uint64(ax + (s * 8 + t) * STRIDE + mt * MMA_M + g)
                fa[mt, 0] = tiles[at]
                fa[mt, 1] = tiles[at + uint64(8)]
                fa[mt, 2] = tiles[at + uint64(4 * STRIDE)]
                fa[mt, 3] = tiles[at + uint64(4 * STRIDE + 8)]
            for j in range(G):
                if j < count:  # the same for the whole warp
                    for nt in range(NT):
                        at = uint64(ax + (1 + j) * TILE + (s * 8 + t) * STRIDE + nt * MMA_N + g)
                        b0 = tiles[at]
                        b1 = tiles[at + uint64(4 * STRIDE)]
                        for mt in range(MT):
                            accumulate(acc, j * MT + mt, nt, fa, mt, b0, b1)

    @cuda.jit
    def weight_grad_v5(dw, workspace, x, dy, coords, seg_begin, seg_end, n_rows, rows_per_split, beta):
        lane = cuda.threadIdx.x % 32
        warp = cuda.threadIdx.x // 32
        g = lane >> 2
        t = lane % 4
        item = (cuda.blockIdx.x // SPREAD) * PER + warp // PATCHES  # a block, or a segment (G > 1)
        patch = (cuda.blockIdx.x % SPREAD) * WARPS + warp % PATCHES
        pm = (patch // SIDE) * WT  # the patch's first row (x feature) and column (dy feature) in the block
        pn = (patch % SIDE) * WT
        split = cuda.blockIdx.y
        n_begin = split * rows_per_split
        n_end = min(n_rows, n_begin + rows_per_split)
        tiles = cuda.shared.array(SIZE, uint32, alignment=SHARED_ALIGN)
        acc = cuda.local.array((ACC_ROWS, NT, 4), float32)
        held = cuda.local.array(HELD_ALL, uint32)
        fa = cuda.local.array((MT, 4), uint32)
        cols = cuda.local.array(G, int64)
        # Whole warps leave here; no thread-block barrier follows.
        if G == 1:
            if item >= dw.shape[0]:
                return
            first, count = item, 1
        else:
            if item >= seg_begin.shape[0]:
                return
            first = seg_begin[item]  # the segment's blocks are consecutive: CSR order is block order
            count = seg_end[item] - first
            if count == 0:  # an empty block-row
                return
        c0 = coords[first, 0] * bs + pm
        for j in range(G):
            cols[j] = coords[first + min(j, count - 1), 1] * bs + pn
        base = warp * WARP_WORDS
        for i in range(ACC_ROWS):
            for nt in range(NT):
                for q in range(4):
                    acc[i, nt, q] = float32(0)
        steps = (n_end - n_begin + ROWS - 1) // ROWS
        if ASYNC:  # a ring of STAGES buffers, STAGES - 1 steps of copies in flight
            shared, x_global, dy_global = shared_address(tiles, (0,)), global_address(x, (0, 0)), \
                global_address(dy, (0, 0))
            for s in range(STAGES - 1):  # step s goes to buffer s % STAGES
                if s < steps:
                    issue_step(shared, x_global, dy_global, x.shape[1], dy.shape[1], lane, c0, cols, count,
                               n_begin + s * ROWS, n_end, base + s * OPERANDS * TILE)
                commit()  # one group a step, empty or not, so that the wait below counts steps
            for step in range(steps):
                buf = step % STAGES
                nxt = step + STAGES - 1
                if nxt < steps:  # its copies land while this step is multiplied
                    issue_step(shared, x_global, dy_global, x.shape[1], dy.shape[1], lane, c0, cols, count,
                               n_begin + nxt * ROWS, n_end, base + ((buf + STAGES - 1) % STAGES) * OPERANDS * TILE)
                commit()
                wait()  # this lane's copies of this step have landed
                cuda.syncwarp()  # ... and every lane's
                multiply(tiles, acc, fa, base + buf * OPERANDS * TILE, g, t, count)
                cuda.syncwarp()  # the warp is done with this buffer before an issue refills it
        else:  # through registers
            if steps > 0:
                fetch_step(x, dy, held, lane, c0, cols, count, n_begin, n_end)
                deposit_step(tiles, held, lane, count, base)
            cuda.syncwarp()  # step 0 is in buffer 0
            for step in range(steps):
                buf = step & 1
                more = step + 1 < steps
                if more:  # the next step's loads land while this one is multiplied
                    fetch_step(x, dy, held, lane, c0, cols, count, n_begin + (step + 1) * ROWS, n_end)
                multiply(tiles, acc, fa, base + buf * OPERANDS * TILE, g, t, count)
                if more:
                    deposit_step(tiles, held, lane, count, base + (1 - buf) * OPERANDS * TILE)
                # The next step is in the other buffer, and the warp is done reading this one
                # before the step after next overwrites it.
                cuda.syncwarp()
        for j in range(G):
            if j < count:
                for mt in range(MT):
                    for nt in range(NT):
                        for q in range(4):
                            finish(dw, workspace, first + j, split, pm + mt * MMA_M + g + 8 * (q // 2),
                                   pn + nt * MMA_N + 2 * t + q % 2, acc[j * MT + mt, nt, q], beta)

    return weight_grad_v5
