"""The pipelined 1-bit product: dense W1A1 on ``mma.sync`` b1 tensor cores, its tiles staged by a
cp.async ring.

The same sums and tile shape as `tensorcore`'s kernel for one activation and one weight plane
(a thread block ``rows`` rows of the activations by ``group_cols`` outputs; ``warps_m`` x
``warps_n`` warps), but no word passes through a register on its way to shared memory:

* **ring**: ``ring_stages`` stages of ``chunk_words`` words of every tile row in flight
  (`ptx.cp_async.make_ring`), 16-byte copies, a thread's rows' addresses made once. Words past
  the row's end land as zeros (cp.async's source size 0); a row past N or O reads the last row
  (its outputs are never stored).
* **counts**: the rows' bit counts that signed formats need (``pa``, ``pb``) come from a kernel of
  their own over the planes (`make_row_counts`, a warp a row), not from the staging threads.
* **mma**: as `tensorcore`: a warp's fragments by ``ldmatrix`` from the stage, its (rows x
  outputs) grid of ``and.popc`` mmas.

The integers then become the output as in `tensorcore`'s one-pair epilogue (`plane_dot`, the
bases' product, bias, ReLU, two outputs a store), so both kernels give the same bits. Rows of a
multiple of 4 words (packed rows are whole 8-word steps), 16-byte-aligned planes, stages within
227 KB of dynamic shared memory (`ring_fits`): `matmul` takes this kernel there when
``ring_stages`` is set, and `tensorcore`'s otherwise.
"""

from numba import cuda, float32, int32, int64, uint32

from ..ptx.cp_async import copy16_or_zero, make_ring, shared_address, signed_address
from ..ptx.ldmatrix import ldmatrix_x4_at
from ..ptx.mma import B1_WORDS, mma_b1_and
from ..runtime.backend import SIMULATOR
from ..runtime.compile import unrolled
from ..runtime.launch import dynamic_shared
from .simple import make_finish, make_plane_dot
from .tensorcore import FULL_MASK, PAD, make_store_pair, warp_rows

PARTS_BYTES = 16  # a copy


SHARED_LIMIT = 227 * 1024  # dynamic shared memory a thread block may take (sm_80 164 KB, sm_90 227 KB)


def ring_bytes(cfg, group_cols, warps_m):
    """The ring's shared memory: its stages of every tile row's ``chunk_words`` words (padded)."""
    return cfg.ring_stages * (warps_m * warp_rows(cfg, 1) + group_cols) * (cfg.chunk_words + PAD) * 4


def ring_fits(cfg, group_cols, warps_m, limit=SHARED_LIMIT):
    """Whether a ring is asked for and its stages fit ``limit`` bytes of shared memory."""
    return cfg.ring_stages > 0 and ring_bytes(cfg, group_cols, warps_m) <= limit


def make_ring_product(cfg, signed_a, signed_w, bias, relu, group_cols, warps_m, warps_n, paired):
    """The kernel ``product(y, a_planes, w_planes, a_basis, w_basis, bias_values, a_counts,
    w_counts, N, O, words, seen)``: y (N * O) and the planes (rows * words) flat; ``a_counts``
    (N,) and ``w_counts`` (O,) the rows' bit counts (`make_row_counts`; read only where the other
    side is signed); grid (groups of ``group_cols`` outputs, row tiles)."""
    plane_dot = make_plane_dot(signed_a, signed_w)
    store_pair = make_store_pair(make_finish(bias, relu), paired)
    WARP_ROWS = warp_rows(cfg, 1)
    ROWS = warps_m * WARP_ROWS
    MT = WARP_ROWS // 16  # mma rows a warp
    NC = group_cols // warps_n // 8  # mma columns a warp
    TILE_ROWS = ROWS + group_cols  # the rows' words, then the outputs'
    CW = cfg.chunk_words
    ROW = (CW + PAD) * 4  # bytes a tile row (padded: ldmatrix's 8 rows in distinct banks)
    STAGE = TILE_ROWS * ROW
    STAGES = cfg.ring_stages
    STEPS = CW // B1_WORDS
    PARTS = CW * 4 // PARTS_BYTES  # copies a tile row
    THREADS = 32 * warps_m * warps_n
    APART = THREADS // PARTS  # tile rows between a thread's copies (its part of a row stays the same)
    COPIES = -(-TILE_ROWS // APART)  # a thread's copies a stage
    need_pa, need_pb = signed_w, signed_a

    @cuda.jit(device=True, inline=True)
    def issue(s, at, args):
        """Stage s (words s·CW on) of this thread's copies into the buffer at ``at``: tile rows
        ``first``, ``first + APART``, ...; the same part of each (so one test of the row's end)."""
        offsets, a_at, w_at, first, part, words = args
        word = s * CW + part * 4
        keep = word < words
        step = int64(word) * 4 if keep else int64(0)  # (kept inside the row where nothing is read)
        for i in range(COPIES):
            row = first + i * APART
            if (i + 1) * APART <= TILE_ROWS or row < TILE_ROWS:  # (the first clause known when compiled)
                to = at + row * ROW + PARTS_BYTES * part
                if (i + 1) * APART <= ROWS or (i * APART < ROWS and row < ROWS):
                    copy16_or_zero(to, a_at + (offsets[i] + step), keep)
                else:
                    copy16_or_zero(to, w_at + (offsets[i] + step), keep)

    prime, advance = make_ring(issue, STAGES, STAGE)

    @cuda.jit(device=True, inline=True)
    def step_of(step, at, acc, af, a_lane, b_lane, quarter):
        """mma step ``step`` of the stage at ``at``: the warp's A fragments, then its B fragments
        two mma columns a load (an odd last one twice), each meeting every A."""
        for mt in range(MT):
            a = ldmatrix_x4_at(at + a_lane + mt * 16 * ROW + step * B1_WORDS * 4)
            for i in range(4):
                af[mt, i] = a[i]
        for nt in range(0, NC, 2):
            other = nt + quarter // 2 if nt + 1 < NC else nt
            b = ldmatrix_x4_at(at + b_lane + other * 8 * ROW + step * B1_WORDS * 4)
            for h in range(2 if nt + 1 < NC else 1):
                for mt in range(MT):
                    d = mma_b1_and(af[mt, 0], af[mt, 1], af[mt, 2], af[mt, 3], b[2 * h], b[2 * h + 1],
                                   acc[mt, nt + h, 0], acc[mt, nt + h, 1], acc[mt, nt + h, 2], acc[mt, nt + h, 3])
                    acc[mt, nt + h, 0] = d[0]
                    acc[mt, nt + h, 1] = d[1]
                    acc[mt, nt + h, 2] = d[2]
                    acc[mt, nt + h, 3] = d[3]

    steps = unrolled(STEPS, step_of)  # (the stage's steps written out: constant offsets)

    @cuda.jit(**({} if cfg.max_registers is None or SIMULATOR else {"max_registers": cfg.max_registers}))
    def product(y, a_planes, w_planes, a_basis, w_basis, bias_values, a_counts, w_counts, N, O, words, seen):
        tile = cuda.shared.array(0, int32)  # (dynamic: the ring's stages)
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
        offsets = cuda.local.array(COPIES, int64)  # (byte offsets of this thread's copies' rows)
        for i in range(COPIES):
            row = min(first + i * APART, TILE_ROWS - 1)
            line = min(row0 + row, N - 1) if row < ROWS else min(col0 + row - ROWS, O - 1)
            offsets[i] = int64(line) * words * 4
        acc = cuda.local.array((MT, NC, 4), int32)
        af = cuda.local.array((MT, 4), uint32)
        rows = cuda.local.array((MT, 2), int32)
        for mt in range(MT):
            for nt in range(NC):
                for i in range(4):
                    acc[mt, nt, i] = 0
        count = (words + CW - 1) // CW
        args = (offsets, a_at, w_at, first, part, words)
        quarter = lane // 8
        a_lane = (wm * WARP_ROWS + lane % 8 + 8 * (quarter % 2)) * ROW + PARTS_BYTES * (quarter // 2)
        b_lane = (ROWS + wn * NC * 8 + lane % 8) * ROW + PARTS_BYTES * (quarter % 2)
        prime(base, count, args)
        buf = 0
        for s in range(count):
            at, buf = advance(s, buf, base, count, args)
            steps(at, acc, af, a_lane, b_lane, quarter)
        u = a_basis[0]
        for mt in range(MT):  # (the rows' terms of the plane dots, once for every output column)
            r = row0 + wm * WARP_ROWS + mt * 16 + g
            rows[mt, 0] = plane_dot(0, a_counts[min(r, N - 1)] if need_pa else int32(0), 0, seen)
            rows[mt, 1] = plane_dot(0, a_counts[min(r + 8, N - 1)] if need_pa else int32(0), 0, seen)
        for nt in range(NC):
            c = col0 + wn * NC * 8 + nt * 8 + 2 * t
            v_lo = w_basis[c, 0] if c < O else float32(0)
            v_hi = w_basis[c + 1, 0] if c + 1 < O else float32(0)
            col_lo = plane_dot(0, 0, w_counts[min(c, O - 1)] if need_pb else int32(0), 0)
            col_hi = plane_dot(0, 0, w_counts[min(c + 1, O - 1)] if need_pb else int32(0), 0)
            s_lo = u * v_lo
            s_hi = u * v_hi
            for mt in range(MT):
                r = row0 + wm * WARP_ROWS + mt * 16 + g
                row_lo, row_hi = rows[mt, 0], rows[mt, 1]
                lo0 = s_lo * float32(plane_dot(acc[mt, nt, 0], 0, 0, 0) + row_lo + col_lo)
                hi0 = s_hi * float32(plane_dot(acc[mt, nt, 1], 0, 0, 0) + row_lo + col_hi)
                lo1 = s_lo * float32(plane_dot(acc[mt, nt, 2], 0, 0, 0) + row_hi + col_lo)
                hi1 = s_hi * float32(plane_dot(acc[mt, nt, 3], 0, 0, 0) + row_hi + col_hi)
                if r < N:
                    store_pair(y, int64(r) * O + c, c, O, lo0, hi0, bias_values)
                if r + 8 < N:
                    store_pair(y, int64(r + 8) * O + c, c, O, lo1, hi1, bias_values)

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
