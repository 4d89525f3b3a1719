"""Block-sparse attention's forward on Hopper's warpgroup tensor cores (``wgmma``): fp16 and bf16,
head_dim 64 or 128, blocks a multiple of 64. The same walk and online softmax as `fused.forward`
(FlashAttention-2's), on warpgroups instead of warps:

* a thread block of ``groups`` warpgroups takes 64 ``groups`` queries of one block-row, 64 a
  warpgroup; their tile is copied once into shared memory;
* the key and value tiles of 64 keys (or 128, the forward's ``keys``) that the block-row has go
  into a ring of ``stages`` stages (16-byte cp.async from every thread, `ptx.cp_async.make_ring`),
  one barrier a tile;
* a warpgroup's scores S = q kᵀ (64 x 64, or 64 x 128) are ``head_dim / 16`` wgmmas from shared
  memory; the online softmax runs on them in registers (a thread holds 2 rows of 16 (32) scores:
  the accumulator layout, `ptx.wgmma.acc_position`), and P, packed to 16 bits, is the A of out += P v
  straight from the registers (`ptx.wgmma.make_mma_rs`: the C fragments of two n8 column blocks
  are the A fragment of one k16 step, as in `fused.py`), v's tile the B operand from shared memory.

Shared tiles lie in wgmma's 128-byte swizzle, a tile of R rows (64, or the forward's 128 keys) as
``head_dim / 64`` column groups of R rows x 128 bytes, 16-byte chunk c of row r at chunk
``c ^ (r % 8)``. The q tile
and k tiles are K-major operands (k = head_dim along a row), the v tiles MN-major (k = keys down
the rows, n = head_dim along them): one layout serves all three. In the backward each warpgroup
waits for its products before the next tile's barrier, so that the ring may refill the buffer
they read; the forward overlaps one tile's products with the next tile's softmax (`make_forward`).

With ``dropout`` (a maker's flag; the kernels take the rule's five arguments after
`fused.make_forward`'s in any case, as the mma.sync kernels do) P goes through the mask before it
is packed for out += P v, dq's and dk's dP and dv's P likewise (`make_dropout_parts`), each
element's bit the one `fused` and `simple` draw.
"""

import math

from numba import cuda, float32, int32, int64, uint32, uint64

from ..ptx.cp_async import copy16_to, shared_address, signed_address
from ..ptx.exp2 import exp2_ftz
from ..ptx.half2 import stored_as
from ..ptx.mma import FULL_MASK
from ..ptx.vector import load2
from ..ptx.wgmma import SWIZZLE_128, WARPGROUP, align_up, commit, descriptor, fence, make_mma, make_mma_rs
from ..ptx.wgmma import make_settle, proxy_fence, waiter
from ..runtime.compile import inlined, unrolled
from ..runtime.launch import dynamic_shared
from .dropout import keep_square, make_masking
from .fused import LN2, LOG2E, TILE, _pack_of, key_walk, make_key_ring, make_query_ring, make_row_maxima, query_walk

HEAD_DIMS = (64, 128)
ATOM = 1024  # 8 rows of 128 bytes: the swizzle's period
GROUP_BYTES = TILE * 128  # a 64-row tile's column group of 64 values
SHARED_MAX = 227 * 1024  # a thread block's dynamic shared memory on sm_90


def fits(dtype, head_dim, block_size, groups, keys=TILE, stages=2):
    """Why the wgmma kernels cannot take a call ('' where they can): ``keys`` and ``stages``, the
    forward's tiles of keys and ring."""
    if dtype not in ("float16", "bfloat16"):
        return f"dtype {dtype}: the wgmma forward takes float16 and bfloat16"
    if head_dim not in HEAD_DIMS:
        return f"head_dim {head_dim}: the wgmma forward takes {HEAD_DIMS}"
    if block_size % (TILE * groups):
        return f"block size {block_size}: the wgmma forward's {groups} warpgroups take {TILE * groups} queries"
    if block_size % keys:
        return f"block size {block_size}: the wgmma forward's tiles take {keys} keys"
    if shared_bytes(head_dim, stages, groups, keys) > SHARED_MAX:
        return f"head_dim {head_dim}: {stages} stages of {keys} keys take more than {SHARED_MAX} bytes of shared"
    return ""


def shared_bytes(D, stages, groups, keys=TILE):
    """The forward's dynamic shared memory: the query tiles, the ring of ``keys``-row key and
    value tiles, and room to align to an atom."""
    return groups * TILE * 2 * D + stages * 2 * keys * 2 * D + ATOM


def make_tiles(storage, D, stages, groups, lag=1, keys=TILE):
    """What the wgmma kernels share, for ``groups`` warpgroups of 64 queries a thread block and
    ring tiles of ``keys`` rows (64, or 128 in the forward: a column group of a tile is its rows
    x 128 bytes):

    * ``plan(tid, rows)``: (to, frm), this thread's first chunk of a tile of ``rows`` rows, its
      byte offsets in the shared tile and in the global rows;
    * ``copy_tile(at, source, to, frm)``: a 64-row tile's cp.async copies from global ``source``
      (its first row's address) into the swizzled shared tile at ``at``; (to, frm) = ``plan(tid, 64)``;
    * ``copy_pair(at, first, second, row0, to, frm)``: the ring tiles of rows from ``row0`` of two
      arrays, one after the other (`fused.make_key_ring`, `fused.make_query_ring` take it;
      (to, frm) = ``plan(tid, keys)``);
    * ``prime``, ``step``: the ring of key and value tiles of a query tile's walk
      (`fused.make_key_ring` with ``lag``, the async-proxy fence before each barrier);
      ``step(e, buf, ring_at, n, ring)``, the walk's step e: the ring's stage e (its address, the
      next ``buf``, its first key);
    * ``k_major(at)``: the descriptor of a K-major operand tile (k = head_dim along its rows);
    * ``products(acc, a_desc, b_desc)``: acc (64 x keys) = A · Bᵀ over head_dim, A a 64-row
      tile's and B a ring tile's K-major descriptors (S = q kᵀ, dP = dout vᵀ);
    * ``times_tile(acc, p, at)``: acc (64 x D) += P · T, P (64 x keys) a warpgroup's packed A
      registers (keys / 4 a thread, `pack_step`), T the ring tile at ``at`` as an MN-major B;
    * ``pack_step(i, s, p)``: after score i of s is final, its pair into P's registers (odd i);
    * ``zero(acc)``: a 64 x D accumulator's values a thread to 0;
    * ``store(out, acc, f0, f1, at)``: them times f0 (a thread's first row) or f1 (its second, 8
      on) into ``out``'s rows from element ``at`` (the thread's first row's, plus 2 t)."""
    THREADS = WARPGROUP * groups
    RING_BYTES, RING_GROUP = keys * 2 * D, keys * 128  # a ring tile, a column group of it
    CH = D // 8  # 16-byte chunks a row
    PER = TILE * CH // THREADS  # chunks of a tile a thread copies
    STEP = THREADS // CH  # rows from one of them to the next (a multiple of 8: the same swizzle row)
    KD = D // 16  # k16 steps along head_dim
    kind = "bf16" if storage == "bfloat16" else "f16"
    mma_rows = make_mma(keys, kind, False, False)
    mma_first = make_mma(keys, kind, False, False, overwrite=True)
    mma_tile = make_mma_rs(D, kind, True)
    pack2 = _pack_of(storage)

    @inlined
    def plan(tid, rows):
        """(to, frm): this thread's first chunk of a tile of ``rows`` rows, its byte offsets in the
        shared tile and in the global rows; the next are STEP rows on (STEP * 128 and STEP * 2D
        bytes)."""
        row, c = tid // CH, tid % CH
        return (c // 8) * (rows * 128) + row * 128 + 16 * ((c % 8) ^ (row % 8)), row * 2 * D + 16 * c

    @inlined
    def copy_rows(at, source, to, frm, per):
        for i in range(per):
            copy16_to(at + (to + i * STEP * 128), source + (frm + i * STEP * 2 * D))

    @inlined
    def copy_tile(at, source, to, frm):
        copy_rows(at, source, to, frm, PER)

    @inlined
    def copy_pair(at, first, second, row0, to, frm):
        copy_rows(at, first + 2 * int64(row0) * D, to, frm, PER * keys // TILE)
        copy_rows(at + RING_BYTES, second + 2 * int64(row0) * D, to, frm, PER * keys // TILE)

    key_of, prime, advance = make_key_ring(copy_pair, stages, 2 * RING_BYTES, visible=proxy_fence, lag=lag,
                                           keys=keys)

    @inlined
    def step(e, buf, ring_at, n, ring):
        stage_at, buf = advance(e, buf, ring_at, n, ring)
        blk_col, first, sub, bs = ring[2], ring[3], ring[4], ring[5]
        return stage_at, buf, key_of(e, blk_col, first, sub, bs)

    @inlined
    def k_major(address):
        return descriptor(address, 16, ATOM, SWIZZLE_128)

    def rows_step(s, acc, a_desc, b_desc):
        # k16 step s: column group s // 4 of each tile, 32 bytes a step along its rows
        move_a = uint64(((s // 4) * GROUP_BYTES + (s % 4) * 32) // 16)
        move_b = uint64(((s // 4) * RING_GROUP + (s % 4) * 32) // 16)
        if s == 0:  # (the old scores no operand: see `ptx.wgmma`)
            mma_first(acc, a_desc + move_a, b_desc + move_b, int32(0))
        else:
            mma_rows(acc, a_desc + move_a, b_desc + move_b, int32(1))

    products = unrolled(KD, inlined(rows_step), inline=inlined)

    def tile_step(s, acc, p, b_desc):
        # rows 16 s .. 16 s + 15 of the tile: two atoms of 8 rows down it
        mma_tile(acc, p[4 * s], p[4 * s + 1], p[4 * s + 2], p[4 * s + 3], b_desc + uint64(s * 2 * ATOM // 16),
                 int32(1))

    steps = unrolled(keys // 16, inlined(tile_step), inline=inlined)

    @inlined
    def times_tile(acc, p, at):
        steps(acc, p, descriptor(at, RING_GROUP, ATOM, SWIZZLE_128))

    @inlined
    def pack_step(i, s, p):
        if i % 2 == 1:
            p[i // 2] = pack2(s[i - 1], s[i])

    def zero_step(i, acc):
        acc[i] = float32(0)

    zero = unrolled(D // 2, inlined(zero_step), inline=inlined)
    from_acc = stored_as(storage)

    def store_step(i, out, acc, f0, f1, at):
        h = (i // 2) % 2
        out[at + 8 * h * D + 8 * (i // 4) + i % 2] = from_acc(acc[i] * (f1 if h else f0))

    store = unrolled(D // 2, inlined(store_step), inline=inlined)
    return plan, copy_tile, copy_pair, (prime, step), k_major, products, times_tile, pack_step, zero, store


def make_dropout_parts(SN):
    """Dropout on a thread's SN accumulators of a 64-row tile (`ptx.wgmma.acc_position`: value i
    at row row + 8 ((i // 2) % 2), column col0 + 8 (i // 4) + 2 t + i % 2), rows queries with
    ``rows_along``, else keys; pair (query, key) of head bh kept as `dropout.keep_square` says,
    a thread's eight values of each 16 x 16 square (values 8u to 8u + 7) at once:

    * ``keep(bits, bh, S, row, col0, t, rows_along, threshold, seed_lo, seed_hi, offset)``: bit i
      of bits[0] (uint64) set where value i is kept;
    * ``apply(x, bits, factor)``: x·factor where kept, else 0."""

    def keep_step(i, bits, bh, S, row, col0, t, rows_along, threshold, seed_lo, seed_hi, offset):
        if i % 8 == 0:
            keep_square(bits, i, bh, S, row, col0 + 2 * i + 2 * t, rows_along, threshold, seed_lo, seed_hi, offset)

    def apply_step(i, x, bits, factor):
        x[i] = x[i] * factor if (bits[0] >> uint64(i)) & uint64(1) else float32(0)

    return make_masking(keep_step, apply_step, SN)


def make_forward(storage, D, stages, groups, keys=TILE, dropout=False):
    """The forward kernel ``forward(out, lse, q, k, v, row_ptr, blk_col, H, S, bs, scale2, causal)``
    (`fused.make_forward`'s arguments) for ``groups`` warpgroups of 64 queries a thread block,
    scoring ``keys`` keys a tile (64 or 128: fewer steps of the ring and of the walk a key).

    Pipelined as FlashAttention-3 within a warpgroup: the scores of tile e + 1 are issued before
    out += P v of tile e, and their softmax runs while that product is in flight (exponentials in
    the score registers, packed into P once the product is done with P's). The ring keeps stage e
    while stage e + 1 is read (``lag`` 2: ``stages`` 3 or 4). ``dropout``: P through the rule's
    mask before it is packed."""
    QT = TILE * groups  # queries of a thread block
    TILE_BYTES = TILE * 2 * D
    KEPT = groups * TILE_BYTES
    RING = keys * 2 * D  # a key (value) tile of the ring
    SN, ON = keys // 2, D // 2  # accumulators a thread: scores (64 x keys), output (64 x D)
    PN = SN // 2  # P's registers: two scores each
    plan, copy_tile, _, key_ring, k_major, scores, times_tile, pack_step, zero, store = make_tiles(
        storage, D, stages, groups, lag=2, keys=keys)
    prime, step = key_ring
    settle_scores, settle_out = make_settle(keys), make_settle(D)
    settle_maxima = make_row_maxima(2)
    wg_wait, wait_scores = waiter(0), waiter(1)
    NEG = float32(-math.inf)

    def softmax_step(i, s, top, scale2):
        """Scale score i, fold it into its row's maximum."""
        x = s[i] * scale2
        s[i] = x
        h = (i // 2) % 2
        top[h] = max(top[h], x)

    def masked_step(i, s, top, scale2, key0, row, t):
        """The same, the score hidden past its row's query (a tile on the causal diagonal)."""
        x = s[i] * scale2
        if key0 + 8 * (i // 4) + 2 * t + i % 2 > row + 8 * ((i // 2) % 2):
            x = NEG
        s[i] = x
        h = (i // 2) % 2
        top[h] = max(top[h], x)

    scale_max = unrolled(SN, inlined(softmax_step), inline=inlined)
    scale_max_masked = unrolled(SN, inlined(masked_step), inline=inlined)

    def exp_step(i, s, use, total):
        h = (i // 2) % 2
        x = exp2_ftz(s[i] - use[h])
        total[h] += x
        s[i] = x

    exps = unrolled(SN, inlined(exp_step), inline=inlined)
    packs = unrolled(SN, inlined(pack_step), inline=inlined)

    @inlined
    def soften(s, peak, top, use, corr, total, scale2, key0, row, t, masked):
        """A tile's scores into their exponentials (in s) against the rows' new maxima; whether
        the output must be rescaled by ``corr``."""
        for h in range(2):
            peak[h] = NEG
        if masked:  # (apart: the predicated mask would cost every tile some 80 instructions)
            scale_max_masked(s, peak, scale2, key0, row, t)
        else:
            scale_max(s, peak, scale2)
        grew = settle_maxima(peak, top, use, corr, total)
        exps(s, use, total)
        return cuda.any_sync(FULL_MASK, grew)  # (once the maxima settle, no rescaling)

    def rescale_step(i, o, corr):
        o[i] *= corr[(i // 2) % 2]

    rescale = unrolled(ON, inlined(rescale_step), inline=inlined)
    keep, drop = make_dropout_parts(SN)

    @inlined
    def pack_dropped(s, p, bits, bh, S, row, key0, t, rule):
        """P into p (16 bits), through the dropout mask with ``dropout`` (the sums are undropped)."""
        if dropout:
            keep(bits, bh, S, row, key0, t, True, rule[0], rule[1], rule[2], rule[3])
            drop(s, bits, float32(1))
        packs(s, p)

    @cuda.jit
    def forward(out, lse, q, k, v, row_ptr, blk_col, H, S, bs, scale2, causal, threshold, seed_lo, seed_hi, offset,
                factor):
        tid = cuda.threadIdx.x
        group, me = tid // WARPGROUP, tid % WARPGROUP
        g, t = (me % 32) // 4, me % 4
        bh, q0, first, sub, n = query_walk(row_ptr, blk_col, H, S, bs, QT, causal, keys)
        smem = cuda.shared.array(0, int32)
        base = align_up(shared_address(smem, (0,)), ATOM)
        head = int64(bh) * S * D
        q_at = signed_address(q, (0,)) + 2 * (head + int64(q0) * D)
        k_at = signed_address(k, (0,)) + 2 * head
        v_at = signed_address(v, (0,)) + 2 * head
        to, frm = plan(tid, TILE)
        to_ring = plan(tid, keys)[0]
        s = cuda.local.array(SN, float32)
        o = cuda.local.array(ON, float32)
        p = cuda.local.array(PN, uint32)
        top = cuda.local.array(2, float32)
        use = cuda.local.array(2, float32)
        corr = cuda.local.array(2, float32)
        total = cuda.local.array(2, float32)
        peak = cuda.local.array(2, float32)
        bits = cuda.local.array(1, uint64)
        rule = (threshold, seed_lo, seed_hi, offset)
        scale2 = float32(scale2)
        zero(o)
        for h in range(2):
            top[h], use[h], total[h] = NEG, float32(0), float32(0)

        if n > 0:
            for m in range(groups):
                copy_tile(base + m * TILE_BYTES, q_at + 2 * m * TILE * D, to, frm)
        ring = (k_at, v_at, blk_col, first, sub, bs, to_ring, frm)
        ring_at = base + KEPT
        prime(ring_at, n, ring)
        q_desc = k_major(base + group * TILE_BYTES)
        first_row = q0 + group * TILE  # this warpgroup's
        row = first_row + 16 * (me // 32) + g  # the thread's first row; its second 8 on
        buf = 0
        at = ring_at
        if n > 0:  # tile 0's scores, softmax and P
            at, buf, key0 = step(0, buf, ring_at, n, ring)
            fence()
            scores(s, q_desc, k_major(at))
            commit()
            wg_wait()
            settle_scores(s)
            soften(s, peak, top, use, corr, total, scale2, key0, row, t, causal and key0 + keys - 1 > first_row)
            pack_dropped(s, p, bits, bh, S, row, key0, t, rule)
        grew = False  # (tile 0's output starts at 0)
        for e in range(n - 1):
            nxt, buf, key0 = step(e + 1, buf, ring_at, n, ring)
            fence()
            scores(s, q_desc, k_major(nxt))  # S = q kᵀ of tile e + 1
            commit()
            if grew:  # the output to tile e's maxima, before its product (FlashAttention-3's order)
                rescale(o, corr)
            fence()  # (for every warp: the fence is .aligned, and ``grew`` is a warp's vote)
            times_tile(o, p, at + RING)  # out += P v of tile e
            commit()
            wait_scores()
            settle_scores(s)
            grew = soften(s, peak, top, use, corr, total, scale2, key0, row, t,
                          causal and key0 + keys - 1 > first_row)
            wg_wait()
            settle_out(o)
            pack_dropped(s, p, bits, bh, S, row, key0, t, rule)
            at = nxt
        if n > 0:
            if grew:
                rescale(o, corr)
            fence()
            times_tile(o, p, at + RING)
            commit()
        wg_wait()
        settle_out(o)

        for h in range(2):
            total[h] += cuda.shfl_xor_sync(FULL_MASK, total[h], 1)
            total[h] += cuda.shfl_xor_sync(FULL_MASK, total[h], 2)
            corr[h] = (float32(factor) if dropout else float32(1)) / total[h] if total[h] > 0 else float32(0)
            if t == 0:
                lse[bh * S + row + 8 * h] = (use[h] + math.log2(total[h])) * float32(LN2) if total[h] > 0 else NEG
        store(out, o, corr[0], corr[1], head + int64(row) * D + 2 * t)

    return dynamic_shared(forward, shared_bytes(D, stages, groups, keys))


def make_query_grads(storage, D, stages, groups, dropout=False):
    """dq of ``groups`` warpgroups' 64 queries (`fused.make_query_grads`'s arguments): their q and
    dout tiles kept, the key and value tiles of their block-row in the ring, and for each
    S = q kᵀ and dP = dout vᵀ (wgmma from shared tiles), P = exp(S - lse), dS = P (dP - delta),
    then dq += dS k with dS from the registers. Pipelined as the forward: tile e + 1's products
    are issued before tile e's dq product, and its dS made while that runs (a ring of ``stages``
    + 1 buffers, which keeps the tile before); ``dropout``: dP through the rule's mask."""
    QT = TILE * groups
    TILE_BYTES = TILE * 2 * D
    KEPT = 2 * groups * TILE_BYTES  # the q tiles, then the dout tiles
    SN, ON = TILE // 2, D // 2
    PN = SN // 2
    plan, copy_tile, _, key_ring, k_major, products, times_tile, pack_step, zero, store = make_tiles(
        storage, D, stages + 1, groups, lag=2)
    prime, step = key_ring
    settle_scores, settle_out = make_settle(TILE), make_settle(D)
    wg_wait, wait_scores = waiter(0), waiter(1)
    NEG, INF = float32(-math.inf), float32(math.inf)

    def grad_step(i, s, dp, level, dl, scale2, key0, row, t, masked):
        """Score i into P (0 where the mask hides it or its query sees nothing), then dS into s."""
        h = (i // 2) % 2
        hidden = masked and key0 + 8 * (i // 4) + 2 * t + i % 2 > row + 8 * h
        x = float32(0) if hidden else exp2_ftz(s[i] * scale2 - level[h])
        s[i] = x * (dp[i] - dl[h])

    grads = unrolled(SN, inlined(grad_step), inline=inlined)
    packs = unrolled(SN, inlined(pack_step), inline=inlined)
    keep, drop = make_dropout_parts(SN)

    @inlined
    def issue_scores(s, dp, q_desc, do_desc, at):
        """The S and dP of the ring's tile at ``at``, issued (fenced, committed)."""
        fence()
        products(s, q_desc, k_major(at))  # S = q kᵀ
        products(dp, do_desc, k_major(at + TILE_BYTES))  # dP = dout vᵀ
        commit()

    @inlined
    def ds_of(s, dp, level, dl, scale2, key0, row, t, masked, bits, bh, S, rule):
        """dS in s, once S and dP have landed (the mask apart, so that other tiles skip it)."""
        settle_scores(s)
        settle_scores(dp)
        if dropout:
            keep(bits, bh, S, row, key0, t, True, rule[0], rule[1], rule[2], rule[3])
            drop(dp, bits, float32(rule[4]))
        if masked:
            grads(s, dp, level, dl, scale2, key0, row, t, True)
        else:
            grads(s, dp, level, dl, scale2, key0, row, t, False)

    @cuda.jit
    def query_grads(dq, q, k, v, dout, lse, delta, row_ptr, blk_col, H, S, bs, scale, scale2, causal, threshold,
                    seed_lo, seed_hi, offset, factor):
        tid = cuda.threadIdx.x
        group, me = tid // WARPGROUP, tid % WARPGROUP
        g, t = (me % 32) // 4, me % 4
        bh, q0, first, sub, n = query_walk(row_ptr, blk_col, H, S, bs, QT, causal, TILE)
        smem = cuda.shared.array(0, int32)
        base = align_up(shared_address(smem, (0,)), ATOM)
        head = int64(bh) * S * D
        to, frm = plan(tid, TILE)
        s = cuda.local.array(SN, float32)
        dp = cuda.local.array(SN, float32)
        acc = cuda.local.array(ON, float32)
        p = cuda.local.array(PN, uint32)
        level = cuda.local.array(2, float32)
        dl = cuda.local.array(2, float32)
        bits = cuda.local.array(1, uint64)
        rule = (threshold, seed_lo, seed_hi, offset, factor)
        scale2 = float32(scale2)
        first_row = q0 + group * TILE
        row = first_row + 16 * (me // 32) + g
        for h in range(2):  # (lse to base 2; a query that sees nothing, lse -inf, to +inf: its exp2 is 0)
            lse_h = lse[bh * S + row + 8 * h]
            level[h] = INF if lse_h == NEG else lse_h * float32(LOG2E)
            dl[h] = delta[bh * S + row + 8 * h]
        zero(acc)
        if n > 0:
            q_at = signed_address(q, (0,)) + 2 * (head + int64(q0) * D)
            do_at = signed_address(dout, (0,)) + 2 * (head + int64(q0) * D)
            for m in range(groups):
                copy_tile(base + m * TILE_BYTES, q_at + 2 * m * TILE * D, to, frm)
                copy_tile(base + (groups + m) * TILE_BYTES, do_at + 2 * m * TILE * D, to, frm)
        ring = (signed_address(k, (0,)) + 2 * head, signed_address(v, (0,)) + 2 * head, blk_col, first, sub, bs,
                to, frm)
        ring_at = base + KEPT
        prime(ring_at, n, ring)
        q_desc = k_major(base + group * TILE_BYTES)
        do_desc = k_major(base + (groups + group) * TILE_BYTES)
        buf = 0
        at = ring_at
        if n > 0:  # tile 0's dS
            at, buf, key0 = step(0, buf, ring_at, n, ring)
            issue_scores(s, dp, q_desc, do_desc, at)
            wg_wait()
            ds_of(s, dp, level, dl, scale2, key0, row, t, causal and key0 + TILE - 1 > first_row, bits, bh, S, rule)
            packs(s, p)
        for e in range(n - 1):
            nxt, buf, key0 = step(e + 1, buf, ring_at, n, ring)
            issue_scores(s, dp, q_desc, do_desc, nxt)  # tile e + 1's
            times_tile(acc, p, at)  # dq += dS k of tile e
            commit()
            wait_scores()
            ds_of(s, dp, level, dl, scale2, key0, row, t, causal and key0 + TILE - 1 > first_row, bits, bh, S, rule)
            wg_wait()
            settle_out(acc)
            packs(s, p)
            at = nxt
        if n > 0:
            fence()
            times_tile(acc, p, at)
            commit()
        wg_wait()
        settle_out(acc)
        store(dq, acc, float32(scale), float32(scale), head + int64(row) * D + 2 * t)

    return dynamic_shared(query_grads, shared_bytes(D, stages + 1, groups) + groups * TILE * 2 * D)


def make_key_grads(storage, D, stages, groups, dropout=False):
    """dk and dv of ``groups`` warpgroups' 64 keys (`fused.make_key_grads`'s arguments): their k and
    v tiles kept, the q and dout tiles of their block-column (with those rows' lse and delta) in
    the ring; for each, Sᵀ = k qᵀ and dPᵀ = v doutᵀ from shared tiles, Pᵀ = exp(Sᵀ - lse),
    dv += Pᵀ dout, dSᵀ = Pᵀ (dPᵀ - delta), dk += dSᵀ q, Pᵀ and dSᵀ from the registers;
    ``dropout``: dv's Pᵀ and dSᵀ's dPᵀ through the rule's mask."""
    KT = TILE * groups  # keys of a thread block
    TILE_BYTES = TILE * 2 * D
    KEPT = 2 * groups * TILE_BYTES  # the k tiles, then the v tiles
    STAGE = 2 * TILE_BYTES + ATOM  # a q tile, its dout tile, then 64 lse and 64 delta (an atom, aligned)
    SN, ON = TILE // 2, D // 2
    PN = SN // 2
    plan, copy_tile, copy_pair, _, k_major, products, times_tile, pack_step, zero, store = make_tiles(
        storage, D, stages, groups)
    query_of, prime, advance = make_query_ring(copy_pair, stages, STAGE, 2 * TILE_BYTES, visible=proxy_fence)
    settle_scores, settle_out = make_settle(TILE), make_settle(D)
    wg_wait = waiter(0)
    NEG, INF = float32(-math.inf), float32(math.inf)

    def probability_step(i, s, floats, levels, scale2, query0, key, t, masked, p, pair):
        """Score i (key row, query column) into Pᵀ, 0 where the mask hides it or the query sees
        nothing; its query's lse (and its neighbour's) one 8-byte load a column block, taken to
        base 2 there (a query that sees nothing, lse -inf, to +inf: its exp2 is 0)."""
        col = 8 * (i // 4) + 2 * t + i % 2
        if i % 4 == 0:
            a, b = load2(floats, (levels + col,))
            pair[0] = INF if a == NEG else a * float32(LOG2E)
            pair[1] = INF if b == NEG else b * float32(LOG2E)
        hidden = masked and key + 8 * ((i // 2) % 2) > query0 + col
        s[i] = float32(0) if hidden else exp2_ftz(s[i] * scale2 - pair[i % 2])
        pack_step(i, s, p)

    probabilities = unrolled(SN, inlined(probability_step), inline=inlined)

    def grad_step(i, s, dp, floats, deltas, t, p, pair):
        if i % 4 == 0:
            pair[0], pair[1] = load2(floats, (deltas + 8 * (i // 4) + 2 * t,))
        dp[i] = s[i] * (dp[i] - pair[i % 2])
        pack_step(i, dp, p)

    grads = unrolled(SN, inlined(grad_step), inline=inlined)
    packs = unrolled(SN, inlined(pack_step), inline=inlined)
    keep, drop = make_dropout_parts(SN)

    @cuda.jit
    def key_grads(dk, dv, q, k, v, dout, lse, delta, col_ptr, col_block, blk_row, H, S, bs, scale, scale2, causal,
                  threshold, seed_lo, seed_hi, offset, factor):
        tid = cuda.threadIdx.x
        group, me = tid // WARPGROUP, tid % WARPGROUP
        g, t = (me % 32) // 4, me % 4
        bh, k0, first, sub, n, skip = key_walk(col_ptr, col_block, blk_row, H, S, bs, KT, causal)
        smem = cuda.shared.array(0, int32)
        floats = cuda.shared.array(0, float32)
        start = shared_address(smem, (0,))
        base = align_up(start, ATOM)
        head = int64(bh) * S * D
        to, frm = plan(tid, TILE)
        s = cuda.local.array(SN, float32)
        dp = cuda.local.array(SN, float32)
        dk_acc = cuda.local.array(ON, float32)
        dv_acc = cuda.local.array(ON, float32)
        p = cuda.local.array(PN, uint32)
        ds = cuda.local.array(PN, uint32)
        pair = cuda.local.array(2, float32)
        bits = cuda.local.array(1, uint64)
        dropped = cuda.local.array(SN, float32)
        scale2 = float32(scale2)
        first_key = k0 + group * TILE
        key = first_key + 16 * (me // 32) + g
        zero(dk_acc)
        zero(dv_acc)
        if n > 0:
            for m in range(groups):
                copy_tile(base + m * TILE_BYTES, signed_address(k, (0,)) + 2 * (head + int64(k0 + m * TILE) * D), to,
                          frm)
                copy_tile(base + (groups + m) * TILE_BYTES,
                          signed_address(v, (0,)) + 2 * (head + int64(k0 + m * TILE) * D), to, frm)
        ring = (tid, skip, blk_row, col_block, first, sub, bs, signed_address(q, (0,)) + 2 * head,
                signed_address(dout, (0,)) + 2 * head, signed_address(lse, (0,)) + 4 * int64(bh) * S,
                signed_address(delta, (0,)) + 4 * int64(bh) * S, to, frm)
        ring_at = base + KEPT
        prime(ring_at, n, ring)
        k_desc = k_major(base + group * TILE_BYTES)
        v_desc = k_major(base + (groups + group) * TILE_BYTES)
        buf = 0
        for e in range(n):
            stage_at, buf_next = advance(e, buf, ring_at, n, ring)
            query0 = query_of(e, skip, blk_row, col_block, first, sub, bs)
            levels = (stage_at - start + 2 * TILE_BYTES) // 4  # this stage's lse, then delta, in floats
            fence()
            products(s, k_desc, k_major(stage_at))  # Sᵀ = k qᵀ
            products(dp, v_desc, k_major(stage_at + TILE_BYTES))  # dPᵀ = v doutᵀ
            commit()
            wg_wait()
            settle_scores(s)
            settle_scores(dp)
            if causal and query0 < first_key + TILE - 1:  # (the mask apart, so that other tiles skip it)
                probabilities(s, floats, levels, scale2, query0, key, t, True, p, pair)
            else:
                probabilities(s, floats, levels, scale2, query0, key, t, False, p, pair)
            if dropout:  # dv from the dropped Pᵀ (packed again), dSᵀ from Pᵀ and the dropped dPᵀ
                keep(bits, bh, S, key, query0, t, False, threshold, seed_lo, seed_hi, offset)
                for i in range(SN):
                    dropped[i] = s[i]
                drop(dropped, bits, float32(factor))
                packs(dropped, p)
                drop(dp, bits, float32(factor))
            fence()
            times_tile(dv_acc, p, stage_at + TILE_BYTES)  # dv += Pᵀ dout, while dSᵀ is made
            grads(s, dp, floats, levels + TILE, t, ds, pair)
            fence()
            times_tile(dk_acc, ds, stage_at)  # dk += dSᵀ q
            commit()
            wg_wait()  # (here, before the loop turns: waited for after it, ptxas serializes every wgmma, C7514)
            buf = buf_next
        settle_out(dk_acc)
        settle_out(dv_acc)
        at = head + int64(key) * D + 2 * t
        store(dk, dk_acc, float32(scale), float32(scale), at)
        store(dv, dv_acc, float32(1), float32(1), at)

    return dynamic_shared(key_grads, 2 * groups * TILE_BYTES + stages * STAGE + ATOM)
