"""Block-sparse attention fused on the tensor cores, flash-style: fp16 and bf16 (``mma.sync``
m16n8k16, fp32 accumulators), head_dim 16 to 128 (a multiple of 16), blocks a multiple of 64.

Nothing of size seq x seq is written. A thread block of four warps takes a tile of rows on one
side: the forward 4 x ``warp_rows`` queries (16 or 32 a warp: one or two m16 tiles, each k and v
fragment read from shared memory feeding both), the backward 64 queries (dq) or 64 keys (dk and
dv), 16 a warp. It walks the tiles of 64 on the other side that its block-row (or block-column)
of the layout has, a block of 128 being two tiles. The tiles it walks go from global to shared
memory by 16-byte cp.async into a ring, ``stages - 1`` tiles ahead of the one multiplied, one
barrier a tile; the warps take their mma fragments with ``ldmatrix`` (``.trans`` for an operand
whose k runs down its rows).

* ``forward(out, lse, q, k, v, ...)``: a query tile's scores S = q kᵀ (scaled, in base 2) against
  each key tile, an online softmax (the rows' running maxima and sums, the output rescaled
  where a maximum grows), then out += P v, with P taken from S's accumulators as the A fragments
  of the next product (the C fragments of two m16n8 tiles are the A fragment of one m16k16:
  FlashAttention-2's register reuse). The log-sum-exp of each query row is kept for the
  backward; a row that sees no key gets zeros and -inf.
* ``key_grads(dk, dv, q, k, v, dout, lse, delta, ...)``: a key tile's dv = Pᵀ dout and
  dk = scale dSᵀ q over the query tiles of its block-column (the layout's transpose), with
  P = exp(S - lse) and dS = P (dout vᵀ - delta) computed again a query tile at a time.
* ``query_grads(dq, q, k, v, dout, lse, delta, ...)``: a query tile's dq = scale dS k over the key
  tiles of its block-row. Each gradient is written once by the thread block that owns it:
  no atomics, and the same bits on every run.

With ``dropout`` (a kernel maker's flag; the kernels take the rule, threshold, seed's words,
offset and 1 / keep, as arguments in any case) the forward multiplies P by keep before out += P v
and divides out by keep's probability at the end; dq's and dk's dP = dout vᵀ and dv's P go
through the same mask, each element's bit drawn again (`make_dropout_parts`).

``delta`` = rowsum(dout · out) (`simple.make_deltas`). A tile's rows that the causal mask hides
from all of a tile's keys contribute nothing; the tiles past the diagonal are not walked at all.
The three-kernel version (`simple.py`) is the readable statement of the same math.
"""

import math

from numba import cuda, float32, int32, int64, uint32, uint64

from ..ptx.cp_async import copy16_to, make_ring, shared_address, signed_address
from ..ptx.exp2 import exp2_ftz
from ..ptx.half2 import bf16_of_float, half2_of_floats, stored_as
from ..ptx.ldmatrix import ldmatrix_x4_at, ldmatrix_x4_trans_at
from ..ptx.mma import FULL_MASK, mma_bf16, mma_f16, pack
from ..ptx.vector import load2
from ..runtime.compile import divmod32, inlined, unrolled
from ..runtime.launch import dynamic_shared
from .dropout import keep_square, make_masking

TILE = 64  # rows of a query or key tile
WARPS = TILE // 16
THREADS = 32 * WARPS
PAD = 16  # bytes after each shared row: eight rows start in eight bank groups
STORAGE = ("float16", "bfloat16")
LN2 = math.log(2.0)
LOG2E = 1.0 / LN2


def fits(dtype, head_dim, block_size):
    """Why the fused kernels cannot take a call ('' where they can)."""
    if dtype not in STORAGE:
        return f"dtype {dtype}: the fused kernels take {' and '.join(STORAGE)}"
    if head_dim % 16 or not 16 <= head_dim <= 128:
        return f"head_dim {head_dim}: the fused kernels take multiples of 16 up to 128"
    if block_size % TILE:
        return f"block size {block_size}: the fused kernels take multiples of {TILE}"
    return ""


def _row_bytes(D):
    return 2 * D + PAD


def _pack_of(storage):
    if storage == "bfloat16":
        @inlined
        def pack2(lo, hi):
            return pack(bf16_of_float(lo), bf16_of_float(hi))
    else:
        @inlined
        def pack2(lo, hi):
            return uint32(half2_of_floats(lo, hi))
    return pack2


def make_tile_parts(storage, D, cols=TILE, mt=1):
    """The device functions the three kernels share, for warps of ``mt`` m16 tiles (16 mt rows):

    * ``plan(tid)``: (to, frm), this thread's first chunk of a tile: its byte offsets in a shared
      tile and in the global rows (the next ones are THREADS chunks on);
    * ``copy_tile(at, source, to, frm)``: a tile's cp.async copies into shared ``at`` from global
      ``source`` (the address of its first row);
    * ``copy_pair(at, first, second, row0, to, frm)``: two tiles of the same rows of two arrays;
    * ``lanes(lane, warp)``: this lane's ldmatrix row offsets in a tile: (A rows of its warp, B
      rows with k along D, B rows with k down the rows);
    * ``times_rows(acc, fa, a_at, b_at)``: acc (16 mt x cols) += A · Bᵀ, A a warp's rows (x D) of
      the tile at ``a_at`` (its lane's ldmatrix rows), B ``cols`` rows of a tile from ``b_at`` (k
      along D: S = q kᵀ, dP = dout vᵀ); ``fa``: registers for A's fragments of a k16 step;
    * ``times_tile(acc, fp, at)``: acc (16 mt x D) += P (16 mt x cols, A fragments fp by k16
      step) · B, B ``cols`` rows of a tile from ``at`` (k down its rows: out += P v, dq += dS k);
    * ``as_fragments(fp, s)``: the 16 mt x cols values of s (C fragments) as A fragments;
    * ``store(out, acc, f, at, t)``: a warp's 16 mt x D accumulators, each row 8 i (i < 2 mt) of
      the lane's times ``f[i]``, into the rows of ``out`` from element offset ``at`` (the lane's
      first row's).

    Accumulators are (mt, n-tile, 4) arrays, fragments (mt, k16 step, 4): each B fragment taken
    from shared memory feeds 2 mt products.
    """
    ROW = _row_bytes(D)
    CH = D // 8  # 16-byte chunks a row
    PER = TILE * CH // THREADS
    KS = D // 16  # k16 steps along D; pairs of n-tiles of a 16 x D product
    PAIRS = cols // 16  # pairs of n-tiles of a 16 x cols product; k16 steps along cols
    mma = mma_bf16 if storage == "bfloat16" else mma_f16
    pack2 = _pack_of(storage)
    STEP = THREADS // CH  # rows from one of a thread's chunks to its next

    @inlined
    def plan(tid):
        return (tid // CH) * ROW + 16 * (tid % CH), (tid // CH) * 2 * D + 16 * (tid % CH)

    @inlined
    def copy_tile(at, source, to, frm):
        for i in range(PER):
            copy16_to(at + (to + i * STEP * ROW), source + (frm + i * STEP * 2 * D))

    @inlined
    def copy_pair(at, first, second, row0, to, frm):
        """Two tiles of rows from ``row0`` (of two arrays at ``first`` and ``second``), one after the
        other from shared ``at``: a key tile and its value tile, or a query tile and its dout tile."""
        copy_tile(at, first + 2 * int64(row0) * D, to, frm)
        copy_tile(at + TILE * ROW, second + 2 * int64(row0) * D, to, frm)

    @inlined
    def lanes(lane, warp):
        """Lanes 8q..8q+7 give matrix q's rows: A's (m 0-7, k 0-7), (m 8-15, k 0-7), (m 0-7, k 8-15),
        (m 8-15, k 8-15); B's (k 0-7, n 0-7), (k 8-15, n 0-7), (k 0-7, n 8-15), (k 8-15, n 8-15)."""
        q, r = lane // 8, lane % 8
        a = (warp * 16 * mt + (q % 2) * 8 + r) * ROW + 2 * (q // 2) * 8
        b_along = ((q // 2) * 8 + r) * ROW + 2 * (q % 2) * 8
        b_down = ((q % 2) * 8 + r) * ROW + 2 * (q // 2) * 8
        return a, b_along, b_down

    def rows_step(i, acc, fa, a_at, b_at):
        s, p = i // PAIRS, i % PAIRS  # k16 step along D, pair of 8-row n-tiles
        if p == 0:  # (the A fragments of step s, for all its pairs)
            for m in range(mt):
                x = ldmatrix_x4_at(a_at + (m * 16 * ROW + 32 * s))
                for j in range(4):
                    fa[m, j] = x[j]
        f = ldmatrix_x4_at(b_at + (p * 16 * ROW + 32 * s))
        for m in range(mt):
            for h in range(2):
                n = 2 * p + h
                d = mma(fa[m, 0], fa[m, 1], fa[m, 2], fa[m, 3], f[2 * h], f[2 * h + 1],
                        acc[m, n, 0], acc[m, n, 1], acc[m, n, 2], acc[m, n, 3])
                for j in range(4):
                    acc[m, n, j] = d[j]

    times_rows = unrolled(KS * PAIRS, inlined(rows_step), inline=inlined)

    def tile_step(i, acc, fp, at):
        s, p = i // KS, i % KS  # k16 step along the tile's rows, pair of n-tiles along D
        f = ldmatrix_x4_trans_at(at + (s * 16 * ROW + 32 * p))
        for m in range(mt):
            for h in range(2):
                n = 2 * p + h
                d = mma(fp[m, s, 0], fp[m, s, 1], fp[m, s, 2], fp[m, s, 3], f[2 * h], f[2 * h + 1],
                        acc[m, n, 0], acc[m, n, 1], acc[m, n, 2], acc[m, n, 3])
                for j in range(4):
                    acc[m, n, j] = d[j]

    times_tile = unrolled(PAIRS * KS, inlined(tile_step), inline=inlined)

    def fragment_of_step(n, fp, s):
        for m in range(mt):
            fp[m, n // 2, 2 * (n % 2)] = pack2(s[m, n, 0], s[m, n, 1])
            fp[m, n // 2, 2 * (n % 2) + 1] = pack2(s[m, n, 2], s[m, n, 3])

    as_fragments = unrolled(2 * PAIRS, inlined(fragment_of_step), inline=inlined)
    from_acc = stored_as(storage)

    def store_step(n, out, acc, f, at, t):
        for m in range(mt):
            for j in range(4):
                i = 2 * m + j // 2
                out[at + 8 * i * D + 8 * n + 2 * t + j % 2] = from_acc(acc[m, n, j] * f[i])

    store = unrolled(D // 8, inlined(store_step), inline=inlined)
    return plan, copy_tile, copy_pair, lanes, times_rows, times_tile, as_fragments, store


@inlined
def query_walk(row_ptr, blk_col, H, S, bs, QT, causal, keys):
    """(batch x head, first query, first block, tiles a block, key tiles walked) of this thread
    block's tile of QT queries (the longest causal rows first): its block-row's blocks of
    bs / ``keys`` key tiles each, less, with ``causal``, those starting past its last query (a
    row's blocks run by column: the tiles it walks are a prefix)."""
    n_qt = S // QT
    bh = cuda.blockIdx.x // n_qt
    q0 = (n_qt - 1 - cuda.blockIdx.x % n_qt) * QT
    row, sub = (bh % H) * (S // bs) + q0 // bs, bs // keys
    first, last = row_ptr[row], row_ptr[row + 1]
    n = (last - first) * sub
    if causal:  # each block's tiles starting before q0 + QT
        n = 0
        for b in range(first, last):
            n += min(sub, max(0, (q0 + QT - blk_col[b] * bs + keys - 1) // keys))
    return bh, q0, first, sub, n


def make_row_maxima(R):
    """``settle_maxima(peak, top, use, corr, total)``: a thread's R rows' new maxima, each row's
    ``peak`` over a part's scores folded across its four lanes and into the running ``top``; the
    level the exponentials take (``use``: 0 for a row that has seen no key), the factor the old
    sums and outputs take (``corr``), the sums rescaled; returns whether any factor is not 1."""
    NEG = float32(-math.inf)

    @inlined
    def settle_maxima(peak, top, use, corr, total):
        grew = False
        for i in range(R):
            m = peak[i]
            m = max(m, cuda.shfl_xor_sync(FULL_MASK, m, 1))
            m = max(m, cuda.shfl_xor_sync(FULL_MASK, m, 2))
            m = max(m, top[i])
            was = use[i]
            use[i] = m if m != NEG else float32(0)
            corr[i] = exp2_ftz(was - use[i]) if top[i] != NEG else float32(0)
            top[i] = m
            total[i] *= corr[i]
            grew = grew or corr[i] != float32(1)
        return grew

    return settle_maxima


@inlined
def key_walk(col_ptr, col_block, blk_row, H, S, bs, KT, causal):
    """(batch x head, first key, first block, tiles a block, query tiles walked, tiles skipped) of
    this thread block's KT keys: the query tiles of its block-column (the layout's transpose), less,
    with ``causal``, those wholly before its first key (a column's blocks run by row: a prefix)."""
    n_kt = S // KT
    bh = cuda.blockIdx.x // n_kt
    k0 = (cuda.blockIdx.x % n_kt) * KT  # (the keys of the most causal queries first)
    cols, sub = S // bs, bs // TILE
    first, last = col_ptr[(bh % H) * cols + k0 // bs], col_ptr[(bh % H) * cols + k0 // bs + 1]
    n = (last - first) * sub
    skip = 0
    if causal:  # each block's tiles ending at or before k0
        for b in range(first, last):
            skip += min(sub, max(0, (k0 - blk_row[col_block[b]] * bs) // TILE))
        n -= skip
    return bh, k0, first, sub, n, skip


def make_key_ring(copy_pair, stages, stage_bytes, visible=None, lag=1, keys=TILE):
    """The key and value tiles (``keys`` keys each) of a query tile's present blocks, a stage a
    ring buffer (`ptx.cp_async.make_ring`, with its ``visible`` and ``lag``; the forward and dq
    walk the same keys): ``key_of(e, blk_col, first, sub, bs)``, the first key of stage e (tile
    ``e % sub`` of the walk's block ``e // sub``), and the ring's ``prime`` and ``advance`` over the
    args ``(k_at, v_at, blk_col, first, sub, bs, to, frm)``."""

    @inlined
    def key_of(e, blk_col, first, sub, bs):
        b, j = divmod32(e, sub)
        return blk_col[first + b] * bs + j * keys

    @inlined
    def issue(e, at, args):
        k_at, v_at, blk_col, first, sub, bs, to, frm = args
        copy_pair(at, k_at, v_at, key_of(e, blk_col, first, sub, bs), to, frm)

    prime, advance = make_ring(issue, stages, stage_bytes, visible=visible, lag=lag)
    return key_of, prime, advance


def make_query_ring(copy_pair, stages, stage_bytes, levels, visible=None):
    """The q and dout tiles of a key tile's block-column, less the ``skip`` the causal mask hides,
    a stage a ring buffer, with their 64 queries' lse and then delta values ``levels`` bytes into
    the stage: ``query_of(e, skip, blk_row, col_block, first, sub, bs)``, the first query of stage
    e, and the ring's ``prime`` and ``advance`` over the args ``(tid, skip, blk_row, col_block,
    first, sub, bs, q_at, do_at, lse_at, delta_at, to, frm)``."""
    ROWS_CH = 4 * TILE // 16  # 16-byte chunks of a tile's 64 lse (or delta) values

    @inlined
    def query_of(e, skip, blk_row, col_block, first, sub, bs):
        b, j = divmod32(e + skip, sub)
        return blk_row[col_block[first + b]] * bs + j * TILE

    @inlined
    def issue(e, at, args):
        tid, skip, blk_row, col_block, first, sub, bs, q_at, do_at, lse_at, delta_at, to, frm = args
        query0 = query_of(e, skip, blk_row, col_block, first, sub, bs)
        copy_pair(at, q_at, do_at, query0, to, frm)
        if tid < 2 * ROWS_CH:
            source = lse_at if tid < ROWS_CH else delta_at
            copy16_to(at + levels + 16 * tid, source + 4 * int64(query0) + 16 * (tid % ROWS_CH))

    prime, advance = make_ring(issue, stages, stage_bytes, visible=visible)
    return query_of, prime, advance


def make_dropout_parts(cols=TILE, mt=1):
    """Dropout on a warp's score fragments ((mt, cols // 8, 4) C fragments, rows queries with
    ``rows_along``, else keys): pair (query i, key j) of head bh kept where `dropout.keep_square`
    says, the bits `simple.make_dropped` and the twin draw.

    * ``keep(bits, bh, S, row, col_first, t, rows_along, threshold, seed_lo, seed_hi, offset)``:
      bits[0] (uint64) gets bit (m·N + n)·4 + j set where fragment value (m, n, j) is kept (a
      lane's rows row + 16 m + 8 (j // 2), columns col_first + 8 n + 2 t + j % 2); fragments n
      and n + 1 (n even) are the lane's eight values of a 16 x 16 square, taken at once;
    * ``apply(x, bits, factor)``: x·factor where kept, else 0."""
    N = cols // 8

    def keep_step(n, bits, bh, S, row, col_first, t, rows_along, threshold, seed_lo, seed_hi, offset):
        if n % 2 == 0:
            for m in range(mt):
                keep_square(bits, (m * N + n) * 4, bh, S, row + 16 * m, col_first + 8 * n + 2 * t, rows_along,
                            threshold, seed_lo, seed_hi, offset)

    def apply_step(n, x, bits, factor):
        for m in range(mt):
            for j in range(4):
                on = (bits[0] >> uint64((m * N + n) * 4 + j)) & uint64(1)
                x[m, n, j] = x[m, n, j] * factor if on else float32(0)

    return make_masking(keep_step, apply_step, N)


def forward_rows(block_size, warp_rows):
    """Query rows a warp of the forward takes: ``warp_rows`` (16 or 32) where the block size is a
    multiple of the thread block's 4 warp_rows, else 16."""
    return warp_rows if block_size % (WARPS * warp_rows) == 0 else 16


def make_forward(storage, D, stages, warp_rows=16, cols=TILE, dropout=False):
    """``cols``: the keys of a stage taken at a time (64, or 32: half the scores' registers);
    ``dropout``: P through the rule's mask (see the module's docstring)."""
    MT = warp_rows // 16
    NS, NP, PARTS = cols // 8, cols // 16, TILE // cols  # n-tiles (and pairs) of the scores; parts of a stage
    QT = WARPS * warp_rows  # rows of a query tile
    ROW = _row_bytes(D)
    TILE_BYTES = TILE * ROW
    KEPT = QT * ROW
    STAGE = 2 * TILE_BYTES  # a key tile, then its value tile
    DN, R = D // 8, 2 * MT  # R: rows of a lane
    plan, copy_tile, copy_pair, lanes, times_rows, times_tile, as_fragments, store = make_tile_parts(storage, D, cols, MT)
    key_of, prime, advance = make_key_ring(copy_pair, stages, STAGE)
    settle_maxima = make_row_maxima(R)
    NEG = float32(-math.inf)  # (a float32: max() and selects in f32)
    keep, drop = make_dropout_parts(cols, MT)

    def mask_step(n, s, top, scale2, key0, row, t):
        """Scale column block n of the scores, hide the keys past a row's query, and fold its values
        into the rows' maxima."""
        for m in range(MT):
            for j in range(4):
                x = s[m, n, j] * scale2
                if key0 + 8 * n + 2 * t + j % 2 > row + 16 * m + 8 * (j // 2):
                    x = NEG
                s[m, n, j] = x
                top[2 * m + j // 2] = max(top[2 * m + j // 2], x)

    def scale_step(n, s, top, scale2):
        """The same where no key of the part comes after a query of the warp's."""
        for m in range(MT):
            for j in range(4):
                x = s[m, n, j] * scale2
                s[m, n, j] = x
                top[2 * m + j // 2] = max(top[2 * m + j // 2], x)

    mask = unrolled(NS, inlined(mask_step), inline=inlined)
    scale_max = unrolled(NS, inlined(scale_step), inline=inlined)

    def exp_step(n, s, use, total):
        for m in range(MT):
            for j in range(4):
                p = exp2_ftz(s[m, n, j] - use[2 * m + j // 2])
                s[m, n, j] = p
                total[2 * m + j // 2] += p

    exps = unrolled(NS, inlined(exp_step), inline=inlined)

    def rescale_step(n, o, corr):
        for m in range(MT):
            for j in range(4):
                o[m, n, j] *= corr[2 * m + j // 2]

    rescale = unrolled(DN, inlined(rescale_step), inline=inlined)

    @cuda.jit
    def forward(out, lse, q, k, v, row_ptr, blk_col, H, S, bs, scale2, causal, threshold, seed_lo, seed_hi, offset,
                factor):
        tid = cuda.threadIdx.x
        lane, warp = tid % 32, tid // 32
        g, t = lane // 4, lane % 4
        bh, q0, first, sub, n = query_walk(row_ptr, blk_col, H, S, bs, QT, causal, TILE)
        smem = cuda.shared.array(0, int32)
        base = shared_address(smem, (0,))
        head = int64(bh) * S * D
        q_at = signed_address(q, (0,)) + 2 * (head + int64(q0) * D)
        k_at = signed_address(k, (0,)) + 2 * head
        v_at = signed_address(v, (0,)) + 2 * head
        to, frm = plan(tid)
        a_lane, b_along, b_down = lanes(lane, warp)
        fa = cuda.local.array((MT, 4), uint32)
        fp = cuda.local.array((MT, NP, 4), uint32)
        s = cuda.local.array((MT, NS, 4), float32)
        o = cuda.local.array((MT, DN, 4), float32)
        top = cuda.local.array(R, float32)
        use = cuda.local.array(R, float32)
        corr = cuda.local.array(R, float32)
        total = cuda.local.array(R, float32)
        peak = cuda.local.array(R, float32)
        bits = cuda.local.array(1, uint64)
        scale2 = float32(scale2)
        for m in range(MT):
            for i in range(DN):
                for j in range(4):
                    o[m, i, j] = float32(0)
        for i in range(R):
            top[i], use[i], total[i] = NEG, float32(0), float32(0)

        if n > 0:
            for m in range(MT):
                copy_tile(base + m * TILE_BYTES, q_at + 2 * m * TILE * D, to, frm)
        ring = (k_at, v_at, blk_col, first, sub, bs, to, frm)
        prime(base + KEPT, n, ring)
        buf = 0
        row = q0 + warp * 16 * MT + g  # the lane's first row; the others 8, 16, 24 on
        for e in range(n):
            stage_at, buf = advance(e, buf, base + KEPT, n, ring)
            for part in range(PARTS):
                key0 = key_of(e, blk_col, first, sub, bs) + part * cols
                at = stage_at + part * cols * ROW  # the part's keys (values: TILE_BYTES on)
                for m in range(MT):
                    for i in range(NS):
                        for j in range(4):
                            s[m, i, j] = float32(0)
                times_rows(s, fa, base + a_lane, at + b_along)
                for i in range(R):
                    peak[i] = NEG
                if causal and key0 + cols > q0 + warp * 16 * MT:
                    mask(s, peak, scale2, key0, row, t)
                else:
                    scale_max(s, peak, scale2)
                grew = settle_maxima(peak, top, use, corr, total)
                if cuda.any_sync(FULL_MASK, grew):  # (once the maxima settle, no rescaling)
                    rescale(o, corr)
                exps(s, use, total)
                if dropout:  # (the sums above are the undropped softmax's)
                    keep(bits, bh, S, row, key0, t, True, threshold, seed_lo, seed_hi, offset)
                    drop(s, bits, float32(1))
                as_fragments(fp, s)
                times_tile(o, fp, at + TILE_BYTES + b_down)

        for i in range(R):
            total[i] += cuda.shfl_xor_sync(FULL_MASK, total[i], 1)
            total[i] += cuda.shfl_xor_sync(FULL_MASK, total[i], 2)
            corr[i] = (float32(factor) if dropout else float32(1)) / total[i] if total[i] > 0 else float32(0)
            if t == 0:
                lse[bh * S + row + 8 * i] = (use[i] + math.log2(total[i])) * float32(LN2) if total[i] > 0 else NEG
        store(out, o, corr, head + int64(row) * D, t)

    return dynamic_shared(forward, KEPT + stages * STAGE)


def make_backward_parts(cols=TILE):
    """The element-wise steps of both backward kernels on a warp's 16 x cols scores (C fragments,
    (1, n-tile, 4)),
    whose rows are queries and columns keys (``rows_along``: query_grads) or the other way
    (key_grads):

    * ``probabilities(s, scale2, lse, rows_along, col_first, row, t, masked)``: scores into
      P = exp2(scale2 s - lse log2 e), 0 where the causal mask hides the pair (``masked``: it may)
      or the query sees nothing (lse -inf); ``lse`` the lane's two rows' or the ``cols`` columns';
      callers branch on ``masked``, so that the tiles the mask cannot reach skip it;
    * ``score_grads(dp, p, delta, rows_along, t)``: dP into dS = P (dP - delta), ``delta`` as lse.
    """
    NEG, INF = float32(-math.inf), float32(math.inf)

    @inlined
    def pair_of(values, rows_along, n, t):
        """The two values a lane's fragment of column block n takes: its two rows' (``rows_along``),
        else its two columns' (2 t, 2 t + 1), one 8-byte load."""
        if rows_along:
            return values[0], values[1]
        return load2(values, (8 * n + 2 * t,))

    def probability_step(n, s, scale2, lse, rows_along, col_first, row, t, masked):
        lo, hi = pair_of(lse, rows_along, n, t)
        # (lse to base 2 once a pair; a query that sees nothing, lse -inf, to +inf: its exp2 is 0)
        lo = INF if lo == NEG else lo * float32(LOG2E)
        hi = INF if hi == NEG else hi * float32(LOG2E)
        for j in range(4):
            col = 8 * n + 2 * t + j % 2
            r = row + 8 * (j // 2)
            if rows_along:  # a query row, key columns
                level = hi if j // 2 else lo
                hidden = masked and col_first + col > r
            else:  # a key row, query columns
                level = hi if j % 2 else lo
                hidden = masked and r > col_first + col
            s[0, n, j] = float32(0) if hidden else exp2_ftz(s[0, n, j] * scale2 - level)

    probabilities = unrolled(cols // 8, inlined(probability_step), inline=inlined)

    def grad_step(n, dp, p, delta, rows_along, t):
        lo, hi = pair_of(delta, rows_along, n, t)
        for j in range(4):
            d = (hi if j // 2 else lo) if rows_along else (hi if j % 2 else lo)
            dp[0, n, j] = p[0, n, j] * (dp[0, n, j] - d)

    score_grads = unrolled(cols // 8, inlined(grad_step), inline=inlined)
    return probabilities, score_grads


def make_query_grads(storage, D, stages, dropout=False):
    """dq of a query tile: its q and dout tiles kept, the key and value tiles of its block-row in
    the ring; ``dropout``: dP through the rule's mask."""
    ROW = _row_bytes(D)
    TILE_BYTES = TILE * ROW
    KEPT, STAGE = 2 * TILE_BYTES, 2 * TILE_BYTES
    DN = D // 8
    plan, copy_tile, copy_pair, lanes, times_rows, times_tile, as_fragments, store = make_tile_parts(storage, D)
    probabilities, score_grads = make_backward_parts()
    keep, drop = make_dropout_parts()
    key_of, prime, advance = make_key_ring(copy_pair, stages, STAGE)

    @cuda.jit
    def query_grads(dq, q, k, v, dout, lse, delta, row_ptr, blk_col, H, S, bs, scale, scale2, causal, threshold,
                    seed_lo, seed_hi, offset, factor):
        tid = cuda.threadIdx.x
        lane, warp = tid % 32, tid // 32
        g, t = lane // 4, lane % 4
        bh, q0, first, sub, n = query_walk(row_ptr, blk_col, H, S, bs, TILE, causal, TILE)
        smem = cuda.shared.array(0, int32)
        base = shared_address(smem, (0,))
        head = int64(bh) * S * D
        k_at = signed_address(k, (0,)) + 2 * head
        v_at = signed_address(v, (0,)) + 2 * head
        to, frm = plan(tid)
        a_lane, b_along, b_down = lanes(lane, warp)
        fa = cuda.local.array((1, 4), uint32)
        fp = cuda.local.array((1, 4, 4), uint32)
        s = cuda.local.array((1, 8, 4), float32)
        dp = cuda.local.array((1, 8, 4), float32)
        acc = cuda.local.array((1, DN, 4), float32)
        l2 = cuda.local.array(2, float32)
        dl = cuda.local.array(2, float32)
        f = cuda.local.array(2, float32)
        bits = cuda.local.array(1, uint64)
        scale2 = float32(scale2)
        row = q0 + warp * 16 + g
        for i in range(2):
            l2[i] = lse[bh * S + row + 8 * i]
            dl[i] = delta[bh * S + row + 8 * i]
        for i in range(DN):
            for j in range(4):
                acc[0, i, j] = float32(0)
        if n > 0:
            copy_pair(base, signed_address(q, (0,)) + 2 * head, signed_address(dout, (0,)) + 2 * head, q0, to, frm)
        ring = (k_at, v_at, blk_col, first, sub, bs, to, frm)
        prime(base + KEPT, n, ring)
        buf = 0
        for e in range(n):
            at, buf = advance(e, buf, base + KEPT, n, ring)
            key0 = key_of(e, blk_col, first, sub, bs)
            for i in range(8):
                for j in range(4):
                    s[0, i, j] = float32(0)
                    dp[0, i, j] = float32(0)
            times_rows(s, fa, base + a_lane, at + b_along)  # S = q kᵀ
            if causal and key0 + TILE > q0 + warp * 16:
                probabilities(s, scale2, l2, True, key0, row, t, True)
            else:
                probabilities(s, scale2, l2, True, key0, row, t, False)
            times_rows(dp, fa, base + TILE_BYTES + a_lane, at + TILE_BYTES + b_along)  # dP = dout vᵀ
            if dropout:
                keep(bits, bh, S, row, key0, t, True, threshold, seed_lo, seed_hi, offset)
                drop(dp, bits, float32(factor))
            score_grads(dp, s, dl, True, t)
            as_fragments(fp, dp)
            times_tile(acc, fp, at + b_down)  # dq += dS k
        f[0], f[1] = float32(scale), float32(scale)
        store(dq, acc, f, head + int64(row) * D, t)

    return dynamic_shared(query_grads, KEPT + stages * STAGE)


def make_key_grads(storage, D, stages, dropout=False):
    """dk and dv of a key tile: its k and v tiles kept, the q and dout tiles of its block-column
    (with their rows' lse and delta, 64 floats each) in the ring; ``dropout``: dv's P and dk's dP
    through the rule's mask."""
    ROW = _row_bytes(D)
    TILE_BYTES = TILE * ROW
    KEPT, STAGE = 2 * TILE_BYTES, 2 * TILE_BYTES + 2 * 4 * TILE
    DN = D // 8
    # A query tile in two halves of 32 (fewer registers: a warp's dk and dv take 2 D of them)
    HALF = TILE // 2
    NT, FP = HALF // 8, HALF // 16  # a half's n-tiles, and k16 steps
    plan, copy_tile, copy_pair, lanes, times_rows, times_tile, as_fragments, store = make_tile_parts(storage, D, HALF, 1)
    probabilities, score_grads = make_backward_parts(HALF)
    keep, drop = make_dropout_parts(HALF)

    query_of, prime, advance = make_query_ring(copy_pair, stages, STAGE, 2 * TILE_BYTES)

    @cuda.jit
    def key_grads(dk, dv, q, k, v, dout, lse, delta, col_ptr, col_block, blk_row, H, S, bs, scale, scale2, causal,
                  threshold, seed_lo, seed_hi, offset, factor):
        tid = cuda.threadIdx.x
        lane, warp = tid % 32, tid // 32
        g, t = lane // 4, lane % 4
        bh, k0, first, sub, n, skip = key_walk(col_ptr, col_block, blk_row, H, S, bs, TILE, causal)
        smem = cuda.shared.array(0, int32)
        floats = cuda.shared.array(0, float32)
        base = shared_address(smem, (0,))
        head = int64(bh) * S * D
        q_at = signed_address(q, (0,)) + 2 * head
        do_at = signed_address(dout, (0,)) + 2 * head
        lse_at = signed_address(lse, (0,)) + 4 * int64(bh) * S
        delta_at = signed_address(delta, (0,)) + 4 * int64(bh) * S
        to, frm = plan(tid)
        a_lane, b_along, b_down = lanes(lane, warp)
        fa = cuda.local.array((1, 4), uint32)
        fp = cuda.local.array((1, FP, 4), uint32)
        s = cuda.local.array((1, NT, 4), float32)
        dp = cuda.local.array((1, NT, 4), float32)
        dropped = cuda.local.array((1, NT, 4), float32)
        bits = cuda.local.array(1, uint64)
        dk_acc = cuda.local.array((1, DN, 4), float32)
        dv_acc = cuda.local.array((1, DN, 4), float32)
        f = cuda.local.array(2, float32)
        scale2 = float32(scale2)
        key = k0 + warp * 16 + g
        for i in range(DN):
            for j in range(4):
                dk_acc[0, i, j] = float32(0)
                dv_acc[0, i, j] = float32(0)
        if n > 0:
            copy_pair(base, signed_address(k, (0,)) + 2 * head, signed_address(v, (0,)) + 2 * head, k0, to, frm)
        ring = (tid, skip, blk_row, col_block, first, sub, bs, q_at, do_at, lse_at, delta_at, to, frm)
        prime(base + KEPT, n, ring)
        buf = 0
        for e in range(n):
            at, buf_next = advance(e, buf, base + KEPT, n, ring)
            query0 = query_of(e, skip, blk_row, col_block, first, sub, bs)
            levels = (KEPT + buf * STAGE + 2 * TILE_BYTES) // 4  # this stage's lse, then delta, in floats
            for half in range(2):
                for i in range(NT):
                    for j in range(4):
                        s[0, i, j] = float32(0)
                        dp[0, i, j] = float32(0)
                rows = at + half * HALF * ROW  # the half's queries in the q tile (dout's: TILE_BYTES on)
                col0 = query0 + half * HALF
                at_levels = levels + half * HALF
                times_rows(s, fa, base + a_lane, rows + b_along)  # Sᵀ = k qᵀ
                levels_of = floats[at_levels:at_levels + HALF]
                if causal and col0 < k0 + warp * 16 + 16:
                    probabilities(s, scale2, levels_of, False, col0, key, t, True)
                else:
                    probabilities(s, scale2, levels_of, False, col0, key, t, False)
                if dropout:  # dv from the dropped P; dS from P and the dropped dP
                    keep(bits, bh, S, key, col0, t, False, threshold, seed_lo, seed_hi, offset)
                    for i in range(NT):
                        for j in range(4):
                            dropped[0, i, j] = s[0, i, j]
                    drop(dropped, bits, float32(factor))
                    as_fragments(fp, dropped)
                else:
                    as_fragments(fp, s)
                times_tile(dv_acc, fp, rows + TILE_BYTES + b_down)  # dv += Pᵀ dout
                times_rows(dp, fa, base + TILE_BYTES + a_lane, rows + TILE_BYTES + b_along)  # dPᵀ = v doutᵀ
                if dropout:
                    drop(dp, bits, float32(factor))
                score_grads(dp, s, floats[at_levels + TILE:at_levels + TILE + HALF], False, t)
                as_fragments(fp, dp)
                times_tile(dk_acc, fp, rows + b_down)  # dk += dSᵀ q
            buf = buf_next
        f[0], f[1] = float32(scale), float32(scale)
        store(dk, dk_acc, f, head + int64(key) * D, t)
        f[0], f[1] = float32(1), float32(1)
        store(dv, dv_acc, f, head + int64(key) * D, t)

    return dynamic_shared(key_grads, KEPT + stages * STAGE)
