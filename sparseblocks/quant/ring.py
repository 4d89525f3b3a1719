"""The pipelined dense product: bit planes on ``mma.sync`` b1 tensor cores, the tiles staged by a
cp.async ring.

The same sums and tile shape as `tensorcore`'s kernel with every weight plane in one pass (a
thread block ``rows`` rows of every activation plane by ``group_cols`` outputs of every weight
plane; ``warps_m`` x ``warps_n`` warps), but no word passes through a register on its way to
shared memory:

* **ring**: ``ring_stages`` stages of ``chunk_words`` words of every tile row in flight
  (`ptx.cp_async.make_ring`, dynamic shared memory), 16-byte copies, a thread's rows' addresses
  made once. Words past the row's end land as zeros (cp.async's source size 0); a row past N or
  O reads the last row (its outputs are never stored).
* **counts**: the planes' rows' bit counts that signed formats need (``pa``, ``pb``) come from a
  kernel of their own (`make_row_counts`, a warp a row), not from the staging threads.
* **mma**: as `tensorcore`: a warp's fragments by ``ldmatrix`` from the stage, every activation
  plane meeting every weight plane, the stage's mma steps written out.

The integers become the output as in `tensorcore`'s epilogue, in its order (`plane_dot`, the
bases' products, summed over plane pairs in fp32, bias, ReLU, two outputs a store), so both
kernels give the same bits. Rows of a multiple of 4 words (packed rows are whole 8-word steps),
16-byte-aligned planes, every weight plane's accumulators within ``fused_acc`` and the stages
within the device's shared memory (`ring_fits`): `matmul` takes this kernel there when
``ring_stages`` is set (3 by default), and `tensorcore`'s otherwise (block-sparse word lists,
convolutions).
"""

from numba import cuda, float32, int32, int64, uint32

from ..ptx.cp_async import copy4_or_zero, copy8_or_zero, copy16_or_zero, make_ring, shared_address, signed_address
from ..ptx.ldmatrix import ldmatrix_x4_at
from ..ptx.mma import B1_WORDS, mma_b1_and
from ..runtime.backend import SIMULATOR
from ..runtime.compile import unrolled
from ..runtime.launch import dynamic_shared
from .simple import make_plane_dot
from .tensorcore import (FULL_MASK, PAD, make_epilogue, make_plane_outputs, make_share_counts,
                         plane_passes, tile_shape, vector_words, warp_rows)

HALF_STEP = 16  # bytes of half an mma step's words (ldmatrix's second pair of 8 x 16-byte matrices)
SHARED_LIMIT = 227 * 1024  # sm_90's dynamic shared memory a thread block (`runtime.launch.shared_memory_limit`)


def ring_bytes(cfg, a_bits, w_bits, group_cols, warps_m):
    """The ring's shared memory: its stages of every tile row's ``chunk_words`` words (padded),
    every activation plane's rows and every weight plane's outputs."""
    rows = a_bits * warps_m * warp_rows(cfg, a_bits) + w_bits * group_cols
    return cfg.ring_stages * rows * (cfg.chunk_words + PAD) * 4


def ring_fits(cfg, a_bits, w_bits, group_cols, warps_m, warps_n, limit=SHARED_LIMIT):
    """Whether a ring is asked for, every weight plane's accumulators fit one pass (`plane_passes`)
    and the stages fit ``limit`` bytes of shared memory."""
    one_pass = plane_passes(cfg, a_bits, w_bits, group_cols, warps_m, warps_n)[1] == 1
    return cfg.ring_stages > 0 and one_pass and ring_bytes(cfg, a_bits, w_bits, group_cols, warps_m) <= limit


def make_ring_product(cfg, a_bits, w_bits, signed_a, signed_w, bias, relu, group_cols, warps_m, warps_n, paired,
                      block_words=0):
    """The kernel ``product(y, a_planes, w_planes, a_basis, w_basis, bias_values, a_counts,
    w_counts, ptr, blocks, N, O, words, seen)``: y (N * O) and the planes (bits * rows * words)
    flat; grid (groups of ``group_cols`` outputs, row tiles). Every weight plane in the one pass
    (`ring_fits`).

    Dense rows (``block_words`` 0): 16-byte copies; ``a_counts`` (a_bits * N) and ``w_counts``
    (w_bits * O) the planes' rows' bit counts (`make_row_counts`; read only where the other side
    is signed), ``seen`` the values a row; ``ptr`` and ``blocks`` unread. A layout's word lists
    (blocks of ``block_words`` 1 or 2 words: 4- or 8-byte copies, a block each): a group is a
    block-column, its present blocks ``blocks[ptr[g]:ptr[g + 1]]``, ``seen`` the values a block;
    the rows' bit counts over those blocks are the copying threads' popcounts of the words they
    copied, read back from each landed stage and summed over the lanes of a row (the counts
    unread)."""
    plane_dot = make_plane_dot(signed_a, signed_w)
    WARP_ROWS, ROWS, MR, MT, NC, A_ROWS = tile_shape(cfg, a_bits, group_cols, warps_m, warps_n)  # (then the outputs)
    TILE_ROWS = A_ROWS + w_bits * group_cols
    ONE_PAIR = a_bits == 1 and w_bits == 1
    pair_out, store_out, bias_pair = make_epilogue(plane_dot, bias, relu, paired, ONE_PAIR, MR, NC, WARP_ROWS)
    CW = cfg.chunk_words
    ROW = (CW + PAD) * 4  # bytes a tile row (padded: ldmatrix's 8 rows in distinct banks)
    STAGE = TILE_ROWS * ROW
    STAGES = cfg.ring_stages
    STEPS = CW // B1_WORDS
    LIST = block_words > 0
    BW = max(block_words, 1)
    VW = vector_words(BW) if LIST else 4  # words a copy
    COPY = 4 * VW
    copy_or_zero = {16: copy16_or_zero, 8: copy8_or_zero, 4: copy4_or_zero}[COPY]
    PARTS = CW // VW  # copies a tile row
    THREADS = 32 * warps_m * warps_n
    APART = THREADS // PARTS  # tile rows between a thread's copies (its part of a row stays the same)
    COPIES = -(-TILE_ROWS // APART)  # a thread's copies a stage
    need_pa, need_pb = signed_w, signed_a
    COUNT = LIST and (need_pa or need_pb)  # (a list's counts from the landed stages)
    plane_outputs = make_plane_outputs(plane_dot, pair_out, bias_pair, need_pa, need_pb, LIST, MT, MR, NC, w_bits, ROWS,
                                       A_ROWS, group_cols, WARP_ROWS)

    @cuda.jit(device=True, inline=True)
    def issue(s, at, args):
        """Stage s (words s·CW on of the row or the list) of this thread's copies into the buffer
        at ``at``: tile rows ``first``, ``first + APART``, ...; the same part of each (so one test
        of the list's end, one list entry)."""
        offsets, a_at, w_at, first, part, total, blocks, start = args
        slot = s * CW + part * VW
        keep = slot < total
        word = slot
        if LIST:  # (a copy is a block: its list entry's words)
            word = blocks[start + uint32(slot) // BW] * BW if keep else 0
        step = int64(word) * 4 if keep else int64(0)  # (kept inside the row where nothing is read)
        for i in range(COPIES):
            row = first + i * APART
            if (i + 1) * APART <= TILE_ROWS or row < TILE_ROWS:  # (the first clause known when compiled)
                to = at + row * ROW + COPY * part
                # (a list's many small copies keep their rows' word offsets in 32 bits: fewer registers;
                # its word is 0 where nothing is read)
                offset = int64(offsets[i] + word) * 4 if LIST else offsets[i] + step
                if (i + 1) * APART <= A_ROWS or (i * APART < A_ROWS and row < A_ROWS):
                    copy_or_zero(to, a_at + offset, keep)
                else:
                    copy_or_zero(to, w_at + offset, keep)

    @cuda.jit(device=True, inline=True)
    def count_copied(tile, word0, counts, first, part):
        """Add the set bits of this thread's copies of the landed stage at ``tile[word0]`` to
        ``counts`` (rows whose plane dots need them)."""
        for i in range(COPIES):
            row = first + i * APART
            if row < TILE_ROWS and (need_pa if row < A_ROWS else need_pb):
                at = word0 + row * (ROW // 4) + part * VW
                for v in range(VW):
                    counts[i] += cuda.popc(tile[at + v])

    @cuda.jit(device=True, inline=True)
    def copy_row(i):
        """The tile row of this thread's i-th copy."""
        return cuda.threadIdx.x // PARTS + i * APART

    share_counts = make_share_counts(COPIES, PARTS, TILE_ROWS, copy_row)

    prime, advance = make_ring(issue, STAGES, STAGE)

    @cuda.jit(device=True, inline=True)
    def first_row(mt, wm):
        """The tile row of the first of mma row mt's 16 rows in warp row wm (plane mt // MR)."""
        return (mt // MR) * ROWS + wm * WARP_ROWS + (mt % MR) * 16

    @cuda.jit(device=True, inline=True)
    def step_of(step, at, acc, af, a_lane, b_lane, wm, quarter):
        """mma step ``step`` of the stage at ``at``: the warp's A fragments (every activation
        plane), then each weight plane's B fragments two mma columns a load (an odd last one
        twice), each meeting every A."""
        for mt in range(MT):
            a = ldmatrix_x4_at(at + a_lane + first_row(mt, wm) * ROW + step * B1_WORDS * 4)
            for i in range(4):
                af[mt, i] = a[i]
        for j in range(w_bits):
            for nt in range(0, NC, 2):
                other = nt + quarter // 2 if nt + 1 < NC else nt
                b = ldmatrix_x4_at(at + b_lane + (j * group_cols + other * 8) * ROW + step * B1_WORDS * 4)
                for h in range(2 if nt + 1 < NC else 1):
                    for mt in range(MT):
                        d = mma_b1_and(af[mt, 0], af[mt, 1], af[mt, 2], af[mt, 3], b[2 * h], b[2 * h + 1],
                                       acc[j, mt, nt + h, 0], acc[j, mt, nt + h, 1], acc[j, mt, nt + h, 2],
                                       acc[j, mt, nt + h, 3])
                        acc[j, mt, nt + h, 0] = d[0]
                        acc[j, mt, nt + h, 1] = d[1]
                        acc[j, mt, nt + h, 2] = d[2]
                        acc[j, mt, nt + h, 3] = d[3]

    steps = unrolled(STEPS, step_of)  # (the stage's steps written out: constant offsets)

    @cuda.jit(**({} if cfg.max_registers is None or SIMULATOR else {"max_registers": cfg.max_registers}))
    def product(y, a_planes, w_planes, a_basis, w_basis, bias_values, a_counts, w_counts, ptr, blocks, N, O, words,
                seen):
        tile = cuda.shared.array(0, int32)  # (dynamic: the ring's stages)
        totals = cuda.shared.array(TILE_ROWS if COUNT else 1, int32)  # (a list's rows' counts)
        tid = cuda.threadIdx.x
        lane, warp = tid % 32, tid // 32
        wm, wn = warp // warps_n, warp % warps_n
        g, t = lane >> 2, lane % 4
        row0 = cuda.blockIdx.y * ROWS
        col0 = cuda.blockIdx.x * group_cols
        base = shared_address(tile, (0,))
        a_at = signed_address(a_planes, (0,))
        w_at = signed_address(w_planes, (0,))
        first, part = tid // PARTS, tid % PARTS
        offsets = cuda.local.array(COPIES, int32 if LIST else int64)  # (its copies' rows: words, or bytes)
        for i in range(COPIES):
            row = uint32(min(first + i * APART, TILE_ROWS - 1))  # (unsigned: divisions by constants are shifts)
            if row < A_ROWS:
                line = int64(row // uint32(ROWS)) * N + min(row0 + int64(row % uint32(ROWS)), N - 1)
            else:
                out_row = row - uint32(A_ROWS)
                line = int64(out_row // uint32(group_cols)) * O + min(col0 + int64(out_row % uint32(group_cols)), O - 1)
            offsets[i] = int32(line * words) if LIST else int64(line) * words * 4
        acc = cuda.local.array((w_bits, MT, NC, 4), int32)
        af = cuda.local.array((MT, 4), uint32)
        rows = cuda.local.array((MT, 2), int32)
        out = cuda.local.array((MR, NC, 4), float32)
        counts = cuda.local.array(COPIES, int32)
        start = ptr[cuda.blockIdx.x] if LIST else 0
        total = (ptr[cuda.blockIdx.x + 1] - start) * BW if LIST else words
        if LIST:
            seen = (total // BW) * seen
        count = (total + CW - 1) // CW
        quarter = lane // 8
        a_lane = (lane % 8 + 8 * (quarter % 2)) * ROW + HALF_STEP * (quarter // 2)
        b_lane = (A_ROWS + wn * NC * 8 + lane % 8) * ROW + HALF_STEP * (quarter % 2)
        args = (offsets, a_at, w_at, first, part, total, blocks, start)
        for j in range(w_bits):
            for mt in range(MT):
                for nt in range(NC):
                    for i in range(4):
                        acc[j, mt, nt, i] = 0
        for m in range(MR):
            for nt in range(NC):
                for i in range(4):
                    out[m, nt, i] = float32(0)
        for i in range(COPIES):
            counts[i] = 0
        prime(base, count, args)
        buf = 0
        for s in range(count):
            at, buf = advance(s, buf, base, count, args)
            if COUNT:
                count_copied(tile, (at - base) // 4, counts, first, part)
            steps(at, acc, af, a_lane, b_lane, wm, quarter)
        if COUNT:
            share_counts(totals, counts)
            cuda.syncthreads()
        if LIST:  # (the rows' terms of the plane dots, once for every output column; then the columns')
            plane_outputs(y, out, acc, rows, totals, totals, a_basis, w_basis, bias_values, seen, 0, row0, col0, N, O,
                          wm, wn, g, t)
        else:
            plane_outputs(y, out, acc, rows, a_counts, w_counts, a_basis, w_basis, bias_values, seen, 0, row0, col0, N,
                          O, wm, wn, g, t)
        if not ONE_PAIR:
            store_out(y, out, row0 + wm * WARP_ROWS + g, col0 + wn * NC * 8 + 2 * t, N, O, bias_values)

    return dynamic_shared(product, STAGES * STAGE)


def make_row_counts():
    """``counts(out, planes, rows, words)``: out[r] = the set bits of row r's ``words`` words of
    ``planes`` (flat), a warp a row (its lanes' popcounts, then shuffles); launch ``rows`` warps."""

    @cuda.jit
    def counts(out, planes, rows, words):
        lane = cuda.threadIdx.x % 32
        r = (cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x) // 32
        if r >= rows:  # (a whole warp: no shuffle waits on it)
            return
        total = int32(0)
        for w in range(lane, words, 32):
            total += cuda.popc(planes[int64(r) * words + w])
        for offset in (16, 8, 4, 2, 1):
            total += cuda.shfl_xor_sync(FULL_MASK, total, offset)
        if lane == 0:
            out[r] = total

    return counts
