"""Hopper tiles (version 7): fp16 and bf16 products and weight gradients on ``wgmma``.

The same GEMM as version 6 (`tiles.py`): C (BM x BN) += A (BM x k) · B (k x BN), k walked BK at a
time (forward: x rows by W's blocks of a block-column; input_grad: dy rows by Wᵀ's blocks of a
block-row; weight_grad: xᵀ by dy, one block of dW a tile). What differs is the multiply:

* 16-byte cp.async copies fill a ring of ``stages`` shared buffers of BK = 64 values of k, laid
  out as wgmma reads them: 128-byte-swizzled atoms (`ptx.wgmma`, `make_hopper_loop`). Consecutive
  threads copy consecutive 16-byte chunks of a stored row, so a warp reads whole 128-byte lines,
  and the swizzle spreads its stores over every bank. An operand whose stored rows run along k is
  K-major, one whose rows run along m or n is MN-major, and wgmma's transpose flag takes either:
  every feature axis is the same loop.
* Warpgroups own one or two 64-row tiles each (``v7_tiles``; a product's thread block: 256 rows of
  two warpgroups by default), and all BN (a block's) columns: one ``wgmma`` m64nBNk16 a tile and
  k16 step, asynchronous, the accumulators in registers (BN / 2 a thread a tile).
* Warp-specialized (``v7_producer``, the products' default; ``v7_wgrad_producer``): one more
  warpgroup only copies, each stage completing on its "full" mbarrier, and the multiplying
  warpgroups only wait, multiply and hand each buffer back on its "empty" mbarrier
  (`make_split`, `ptx.mbarrier`); the copies run a whole ring ahead, and no barrier of the thread
  block runs in the loop. Otherwise every thread copies and multiplies: a stage's batch is
  committed, then the copies of stage + stages - 2 are issued into the buffer whose batch the
  previous iteration's wait (``wait_group 1``) retired in every warpgroup before this
  iteration's barrier; one barrier a stage (`make_ring`). Whoever reads a landed stage fences it
  for the async proxy (wgmma's reads) first.
* The epilogue stages the fp32 accumulators in the ring's shared memory and writes runs of 4
  values, a warp whole rows (`make_staging`), in the storage dtype or to the split workspaces.
  Persistent products (``v7_persistent``: feature_axis 1, one thread block a multiprocessor
  walking the tiles round one ring) stage in 16 bits beside the ring (`make_staging16`), so the
  next tile's copies go on meanwhile.

Shapes, shared memory and what a config may ask: `hopper_shapes.py`; the weight-gradient
kernels, built of this loop: `hopper_wgrad.py`.

On an sm_90 GPU (`dispatch.hopper`), where the operands fit (`dispatch.tiles_fit`, as version 6);
version 6 runs elsewhere. The simulator runs these kernels when a test asks (its wgmma is a
warpgroup collective), on one-warpgroup tiles: each wgmma there is a 128-thread rendezvous.
"""

from numba import cuda, float32, int16, int32, int64, types, uint64

from ..ptx.cp_async import commit, copy16_or_zero, global_address, shared_address, signed_address, waiter
from ..ptx.half2 import bf16_of_float
from ..ptx.ldmatrix import load4_shared_at
from ..ptx.mbarrier import BYTES as BAR_BYTES
from ..ptx.mbarrier import arrive, copy_arrive, named_barrier
from ..ptx.mbarrier import init as bar_init
from ..ptx.mbarrier import wait as bar_wait
from ..ptx.tma import expect_tx, load_2d
from ..ptx.vector import load4, store2, store4
from ..ptx.wgmma import WARPGROUP, WGMMA_K, WGMMA_M, align_up, descriptor, fence, make_mma, make_settle, proxy_fence
from ..ptx.wgmma import commit as wg_commit
from ..ptx.wgmma import waiter as wg_waiter
from ..runtime.compile import inlined, unrolled
from ..runtime.launch import dynamic_shared
from .device import bias_reader, converters, grouped_tile, pair_reader, tile_of
from .hopper_shapes import (  # noqa: F401 (re-exported: V7_BLOCKS, V7_STORAGE, v7_check, split_registers, ...)
    ATOM, CHUNK, PAIRED, SM_SHARED, STACKED, SUM_PHASES, V7_BLOCKS, V7_STORAGE, V7_WGRAD_BLOCKS, barriers_at, hand_over,
    jit_for, persistent, persistent_config, producing, resident, shared_bytes, split_registers, staged16_at,
    staged_shape, swizzle_of, make_place, v7_check, v7_shape, v7_threads,
)


def make_hopper_loop(cfg, bs, storage, weight_grad, a_mn_major, b_mn_major):
    """The device functions of the loop (see `tiles.make_tile_loop`, whose shape they follow):

    * ``copy_plan(tid, a_to, b_to, a_row, a_col, b_row, b_col)``: this thread's chunks, their shared
      offsets in buffer 0 and their (stored row, first value) in the operand's stage tile;
    * ``issue(base, tid, buf, a_global, b_global, a_from, a_to, b_from, b_to, a_keep, b_keep)``;
    * ``multiply(acc, desc_a, desc_b, buf)``: this warpgroup's wgmmas of the stage in buffer buf,
      from descriptors of buffer 0 at its rows (``desc_a``) and at B's start (``desc_b``);
    * ``descriptors(base, group)``: those descriptors;
    * ``make_ring(sources)``: the pipelined loop over a kernel's stages, built of the above; the
      maker returns this, `copy_plan`, `descriptors` and the chunks a thread copies of A and B.

    Shared tiles are in the 128-byte-swizzled canonical layouts (`ptx.wgmma`): a K-major operand
    (stored rows along k: BK = 64 values, one 128-byte row) is atoms of 8 of its rows, one after
    another; an MN-major one (stored rows along m or n) is, for each 64 of m or n, BK / 8 atoms of
    8 values of k. Consecutive threads copy consecutive chunks of a stored row, so a warp reads
    whole 128-byte lines, and the swizzle spreads its stores over every bank. Blocks of 32 (BK =
    32, and B 32 wide) lay the operands whose stored rows are 64 bytes in the 64-byte swizzle: the
    same layouts with atoms of 8 rows of 64 bytes (`swizzle_of`).
    """
    BM, BN, GROUPS, TILES, BK, STAGES = v7_shape(cfg, bs, weight_grad)
    T = WARPGROUP * GROUPS
    A_BYTES, B_BYTES = 2 * BM * BK, 2 * BN * BK
    STAGE_BYTES = A_BYTES + B_BYTES
    STEPS = BK // WGMMA_K
    A_W, A_MODE = swizzle_of(a_mn_major, BM, BK)
    B_W, B_MODE = swizzle_of(b_mn_major, BN, BK)
    A_ATOM, B_ATOM = 8 * A_W, 8 * B_W  # an atom: 8 rows of a swizzle row
    A_GROUP, B_GROUP = (BK // 8) * A_ATOM, (BK // 8) * B_ATOM  # an MN-major tile's group of A_W / 2 of m or n
    kind = "bf16" if storage == "bfloat16" else "f16"
    mma = make_mma(BN, kind, a_mn_major, b_mn_major)
    mma_second = make_mma(BN, kind, a_mn_major, b_mn_major, first=BN // 2)  # a warpgroup's second tile

    def plan(mn_major, side):
        """(chunks, chunks a stored row, per thread, all threads full) of an operand's stage."""
        rows, per_row = (BK, side // CHUNK) if mn_major else (side, BK // CHUNK)
        chunks = rows * per_row
        return chunks, per_row, -(-chunks // T), chunks % T == 0

    A_CHUNKS, A_CPR, A_PER, A_ALL = plan(a_mn_major, BM)
    B_CHUNKS, B_CPR, B_PER, B_ALL = plan(b_mn_major, BN)

    place_a = make_place(a_mn_major, A_W, A_ATOM, A_GROUP)
    place_b = make_place(b_mn_major, B_W, B_ATOM, B_GROUP)

    @inlined
    def copy_plan(tid, a_to, b_to, a_row, a_col, b_row, b_col):
        for i in range(A_PER):
            e = tid + i * T
            if A_ALL or e < A_CHUNKS:
                a_row[i], a_col[i], a_to[i] = place_a(e, A_CPR)
        for i in range(B_PER):
            e = tid + i * T
            if B_ALL or e < B_CHUNKS:
                b_row[i], b_col[i], to = place_b(e, B_CPR)
                b_to[i] = A_BYTES + to

    @inlined
    def issue(base, tid, buf, a_global, b_global, a_from, a_to, b_from, b_to, a_keep, b_keep):
        at = base + buf * STAGE_BYTES
        for i in range(A_PER):
            if A_ALL or tid + i * T < A_CHUNKS:
                copy16_or_zero(at + a_to[i], a_global + (a_from[i] if a_keep[i] else 0), a_keep[i])
        for i in range(B_PER):
            if B_ALL or tid + i * T < B_CHUNKS:
                copy16_or_zero(at + b_to[i], b_global + (b_from[i] if b_keep[i] else 0), b_keep[i])

    # A k16 step moves a K-major descriptor 32 bytes along its rows (inside the swizzle atom), an
    # MN-major one two atoms down; in the descriptor's 16-byte units.
    A_STEP = (2 * A_ATOM if a_mn_major else 32) // 16
    B_STEP = (2 * B_ATOM if b_mn_major else 32) // 16
    A_TILE = (64 // (A_W // 2)) * A_GROUP if a_mn_major else 8 * A_ATOM  # bytes from one 64-row tile of A to the next

    @inlined
    def step(s, acc, desc_a, desc_b):
        mma(acc, desc_a + uint64(s * A_STEP), desc_b + uint64(s * B_STEP), int32(1))
        if TILES > 1:
            mma_second(acc, desc_a + uint64(s * A_STEP + A_TILE // 16), desc_b + uint64(s * B_STEP), int32(1))

    steps = unrolled(STEPS, step, inline=inlined)

    @inlined
    def multiply(acc, desc_a, desc_b, buf):
        move = uint64(buf * (STAGE_BYTES // 16))
        fence()
        steps(acc, desc_a + move, desc_b + move)
        wg_commit()

    @inlined
    def descriptors(base, group):
        """Buffer 0's descriptors of this warpgroup's first 64 rows of A, and of B. K-major: atoms
        of 8 rows an atom apart (lbo unused); MN-major: groups of W / 2 of m or n a group apart,
        atoms of 8 k an atom apart."""
        a = descriptor(base + group * TILES * A_TILE, A_GROUP if a_mn_major else 16, A_ATOM, A_MODE)
        b = descriptor(base + A_BYTES, B_GROUP if b_mn_major else 16, B_ATOM, B_MODE)
        return a, b

    LEAD = STAGES - 2  # stages in flight ahead of the one multiplied
    wait = waiter(LEAD - 1)
    wg_wait_one, wg_wait_all = wg_waiter(1), wg_waiter(0)
    settle = make_settle(TILES * BN)

    def make_ring(sources):
        """``ring(acc, base, tid, n_stages, where, a_from, a_to, b_from, b_to, a_keep, b_keep, desc_a,
        desc_b)``: the whole pipelined loop into ``acc``, the kernel's stage addresses from
        ``sources(s, where, a_keep, b_keep)`` (``where``: a tuple of what it needs)."""

        @inlined
        def ring(acc, base, tid, n_stages, where, a_from, a_to, b_from, b_to, a_keep, b_keep, desc_a, desc_b):
            for s in range(LEAD):  # stage s goes to buffer s
                if s < n_stages:
                    a_at, b_at = sources(s, where, a_keep, b_keep)
                    issue(base, tid, s, a_at, b_at, a_from, a_to, b_from, b_to, a_keep, b_keep)
                commit()  # one group a stage, empty or not, so that the wait counts stages
            buf = 0
            for stage in range(n_stages):
                wait()  # this thread's copies of the stage have landed ...
                proxy_fence()  # ... and are visible to wgmma's reads
                cuda.syncthreads()  # every thread's; every warpgroup has retired stage - 2's batch
                multiply(acc, desc_a, desc_b, buf)
                nxt = stage + LEAD
                if nxt < n_stages:
                    a_at, b_at = sources(nxt, where, a_keep, b_keep)
                    into = buf + LEAD if buf + LEAD < STAGES else buf + LEAD - STAGES
                    issue(base, tid, into, a_at, b_at, a_from, a_to, b_from, b_to, a_keep, b_keep)
                commit()
                wg_wait_one()
                buf = buf + 1 if buf < STAGES - 1 else 0
            wg_wait_all()
            settle(acc)

        return ring

    P = WARPGROUP  # the copying warpgroup's threads (`make_split`)
    A_PER_P, B_PER_P = -(-A_CHUNKS // P), -(-B_CHUNKS // P)
    A_ALL_P, B_ALL_P = A_CHUNKS % P == 0, B_CHUNKS % P == 0
    # Bulk copies of a stage (`ptx.tma`): an MN-major operand a box of 64 of m or n by BK of k a 64-wide group,
    # a group apart; a K-major A a box of BK by all its rows, a K-major B one a block's rows (paired tiles: 2 or 4).
    A_BOXES, B_BOXES = (BM // 64 if a_mn_major else 1), (max(BN // 64, 1) if b_mn_major else BN // bs)
    B_BOX_STEP = B_GROUP if b_mn_major else bs * B_W  # shared bytes from one of B's boxes to the next

    @inlined
    def next_boxes(g, s, where, inner, outer):  # (B's box g from the first's coordinates)
        return (inner + 64 * g, outer) if b_mn_major else (inner, outer + bs * g)

    def make_split(stage_sources, a_chunk, b_chunk, stage, boxes=None, column_sums=False, b_box=next_boxes):
        """The warp-specialized loop: ``init(bars, readers)``, ``produce(lane, base, bars, n_stages, where,
        buf, parity)`` for the copying warpgroup and ``consume(acc, bars, n_stages, desc_a, desc_b,
        lane, buf, parity)`` for each multiplying one, each a tile's stages, from the ring position
        the previous tile left (a persistent thread block's tiles go round one ring); and
        ``specialized(start, base, tid, n_stages, where, staged)``, a thread block's one tile whole:
        the barriers set up (``start``: shared memory's first address), the copying warpgroup's
        stages and the others' products, staged by ``stage`` (`make_staging`) into ``staged``.
        ``stage_sources(s, where)`` gives stage s's global addresses of A and B;
        ``a_chunk(row, col, s, where)`` a chunk's byte offset from A's and whether to read it
        (else 16 zero bytes), likewise ``b_chunk``.

        With ``boxes`` (``v7_tma``) one thread of the copying warpgroup copies each stage by bulk
        tensor copies instead: ``boxes(s, where)`` gives the (inner, outer) coordinates of the
        stage's first box of A and of B, in the tensor maps of ``maps`` (A's map address, A's
        address, B's map address, B's address: `ptx.tma.load_2d`; past its dims, zeros), and the
        stage's full barrier completes on that thread's arrival (``expect_tx``) and the copies' bytes.
        ``b_box(g, s, where, inner, outer)``: B's box g from the first's (a paired tile's: its blocks').

        Stage s goes to buffer s % stages. Its full barrier completes once each of the copying
        threads' copies of it have landed (``copy_arrive``); its empty barrier once each
        multiplying warp has retired the wgmmas that read it (one arrival a warp, after the
        next stage's wait), and the copies of stage s + stages wait for that. No barrier of the
        whole thread block runs inside the loop, and the copies run a whole ring ahead.

        With ``column_sums`` (bulk copies, B MN-major: a weight gradient's dy with feature_axis
        1) the copying warpgroup's warps 1 .. BN / 64, idle beside the one thread that issues the
        copies, also sum B's columns where ``where[10]`` is nonzero: each thread a 16-byte chunk
        (8 columns) of every fourth row of each stage as it lands, arriving on the empty barrier
        too (``init``'s ``readers``: one arrival a warp a phase), and on the multiplying
        warpgroups' named barrier before they stage their tiles over the ring; rows 4 where[12]
        .. 4 where[12] + 3 of ``where[11]`` (`SUM_PHASES` for this N-split, one a row phase) get the fp32
        sums at columns where[7] + c (B's first column plus c). Nothing leaves shared memory for
        it: dy's columns are read from global memory once, by the copies."""

        @inlined
        def copy_a(i, lane, at, a_at, s, where):
            e = lane + i * P
            if A_ALL_P or e < A_CHUNKS:
                row, col, to = place_a(e, A_CPR)
                offset, keep = a_chunk(row, col, s, where)
                copy16_or_zero(at + to, a_at + (offset if keep else 0), keep)

        @inlined
        def copy_b(i, lane, at, b_at, s, where):
            e = lane + i * P
            if B_ALL_P or e < B_CHUNKS:
                row, col, to = place_b(e, B_CPR)
                offset, keep = b_chunk(row, col, s, where)
                copy16_or_zero(at + A_BYTES + to, b_at + (offset if keep else 0), keep)

        copies_a = unrolled(A_PER_P, copy_a, inline=inlined)
        copies_b = unrolled(B_PER_P, copy_b, inline=inlined)
        BULK = boxes is not None
        FULL_COUNT, EMPTY_COUNT = (1 if BULK else P), 4 * GROUPS  # a full barrier's arrivals a phase, an empty one's
        if column_sums and not (BULK and b_mn_major and BN % 64 == 0 and BN // 64 <= 3):
            raise ValueError("column_sums: expected bulk copies of an MN-major B up to 192 wide")
        READERS = BN // 64 if column_sums else 0  # the copying warpgroup's warps that sum B's columns
        halves = pair_reader(storage)

        @inlined
        def init(bars, readers):
            for i in range(STAGES):
                bar_init(bars + i * BAR_BYTES, FULL_COUNT)
                bar_init(bars + (STAGES + i) * BAR_BYTES, EMPTY_COUNT + readers)

        if column_sums:
            PHASES = 32 * READERS // B_CPR  # the summing threads a 16-byte chunk (8 columns) of a row
            assert PHASES == SUM_PHASES and BK % 8 == 0

            @inlined
            def readers_of(where):
                return READERS if where[10] != 0 else 0

            @inlined
            def add_word(i, sums, word):
                lo, hi = halves(int32(word))
                sums[2 * i] += lo
                sums[2 * i + 1] += hi

            @inlined
            def add_words(sums, words):
                w0, w1, w2, w3 = words
                add_word(0, sums, w0)
                add_word(1, sums, w1)
                add_word(2, sums, w2)
                add_word(3, sums, w3)

            @inlined
            def add_rows(j, sums, even, odd):
                add_words(sums, load4_shared_at(even + j * B_ATOM))
                add_words(sums, load4_shared_at(odd + j * B_ATOM))

            add_stage = unrolled(BK // 8, add_rows, inline=inlined)

            @inlined
            def sum_columns(t, lane, base, bars, n_stages, where):
                """Columns 8c .. 8c + 7 of B (c = t % B_CPR, one 16-byte chunk of a row) over rows
                p, p + 4, .. of each stage (p = t // B_CPR), summed as the stages land; the sums of
                the PHASES row phases are rows where[12] PHASES + p of where[11]. A stage's rows
                p + 8j and p + 4 + 8j sit an atom j apart from rows p and p + 4 (the same swizzle),
                whose chunk c `place_b` finds: two addresses a thread, then constant steps."""
                c, p = t % B_CPR, t // B_CPR
                even = base + A_BYTES + place_b(p * B_CPR + c, B_CPR)[2]
                odd = base + A_BYTES + place_b((p + 4) * B_CPR + c, B_CPR)[2]
                sums = cuda.local.array(8, float32)
                for i in range(8):
                    sums[i] = float32(0)
                buf, parity = 0, 0
                for s in range(n_stages):
                    bar_wait(bars + buf * BAR_BYTES, parity)  # the stage's bulk copies have landed
                    add_stage(sums, even + buf * STAGE_BYTES, odd + buf * STAGE_BYTES)
                    cuda.syncwarp()
                    if lane == 0:
                        arrive(bars + (STAGES + buf) * BAR_BYTES)
                    buf += 1
                    if buf == STAGES:
                        buf, parity = 0, parity ^ 1
                # (the multiplying warpgroups stage their tiles over the ring once every reader is past it)
                named_barrier(1, GROUPS * WARPGROUP + 32 * READERS)
                row, k = where[12] * PHASES + p, where[7] + 8 * c
                for i in range(8):
                    where[11][row, k + i] = sums[i]
        else:

            @inlined
            def readers_of(where):
                return 0

            @inlined
            def sum_columns(t, lane, base, bars, n_stages, where):
                return

        @inlined
        def produce(lane, base, bars, n_stages, where, buf, parity, maps):
            """One tile's stages, from buffer ``buf`` whose empty barrier's awaited parity is
            ``parity`` (0 and 1 at a kernel's start: the first time round every buffer is empty);
            returns where the next tile starts."""
            for s in range(n_stages):
                if BULK:
                    if lane == 0:
                        bar_wait(bars + (STAGES + buf) * BAR_BYTES, parity)
                        full = bars + buf * BAR_BYTES
                        expect_tx(full, STAGE_BYTES)
                        a_inner, a_outer, b_inner, b_outer = boxes(s, where)
                        at = base + buf * STAGE_BYTES
                        for g in range(A_BOXES):
                            load_2d(at + g * A_GROUP, maps[0], maps[1], a_inner + 64 * g, a_outer, full)
                        for g in range(B_BOXES):
                            inner, outer = b_box(g, s, where, b_inner, b_outer)
                            load_2d(at + A_BYTES + g * B_BOX_STEP, maps[2], maps[3], inner, outer, full)
                else:
                    bar_wait(bars + (STAGES + buf) * BAR_BYTES, parity)
                    a_at, b_at = stage_sources(s, where)
                    at = base + buf * STAGE_BYTES
                    copies_a(lane, at, a_at, s, where)
                    copies_b(lane, at, b_at, s, where)
                    copy_arrive(bars + buf * BAR_BYTES)
                buf += 1
                if buf == STAGES:
                    buf, parity = 0, parity ^ 1
            return buf, parity

        @inlined
        def multiply_stage(acc, desc_a, desc_b, buf, s, where):
            multiply(acc, desc_a, desc_b, buf)

        walk = make_walk(STAGES, BULK, multiply_stage, settle)

        @inlined
        def consume(acc, bars, n_stages, desc_a, desc_b, lane, buf, parity):
            """One tile's stages into ``acc`` (`make_walk`)."""
            return walk(acc, bars, n_stages, desc_a, desc_b, lane, buf, parity, 0)

        # (summing warps keep more registers, for loads in flight)
        give, take = hand_over(cfg, bs, GROUPS, weight_grad, cfg.v7_wgrad_sum_registers if column_sums else None)
        BARS = barriers_at(cfg, bs, weight_grad)
        ACC_ALL = TILES * (BN // 2)

        @inlined
        def specialized(start, base, tid, n_stages, where, staged, maps):
            bars = start + BARS
            readers = readers_of(where)
            if tid == 0:
                init(bars, readers)
            cuda.syncthreads()
            group, thread = tid // WARPGROUP, tid % WARPGROUP
            warp, lane = thread // 32, thread % 32
            if group == GROUPS:  # the copying warpgroup
                give()
                if 1 <= warp <= readers:  # (bulk copies: warp 0's first thread issues them all)
                    sum_columns(thread - 32, lane, base, bars, n_stages, where)
                else:
                    produce(thread, base, bars, n_stages, where, 0, 1, maps)
            else:
                take()
                desc_a, desc_b = descriptors(base, group)
                acc = cuda.local.array(ACC_ALL, float32)
                for i in range(ACC_ALL):
                    acc[i] = float32(0)
                consume(acc, bars, n_stages, desc_a, desc_b, lane, 0, 0)
                # every warpgroup's wgmmas, and the column sums' readers, have read the ring
                named_barrier(1, GROUPS * WARPGROUP + 32 * readers)
                stage(acc, staged, group * TILES * WGMMA_M + 16 * warp + lane // 4, 2 * (lane % 4))
            cuda.syncthreads()

        return init, produce, consume, specialized

    return copy_plan, make_ring, descriptors, (A_PER, B_PER), make_split


def make_walk(stages, bulk, multiply_stage, settle):
    """A multiplying warpgroup's walk round a warp-specialized ring (`make_split`):
    ``walk(acc, bars, n_stages, desc_a, desc_b, lane, buf, parity, where)`` runs one tile's stages
    into ``acc``, from buffer ``buf`` whose full barrier's awaited parity is ``parity`` (0, 0 at a
    kernel's start), each stage's wgmmas issued and committed by ``multiply_stage(acc, desc_a,
    desc_b, buf, s, where)``; returns where the next tile starts. Every buffer it read is handed
    back on its empty barrier (``bars``: ``stages`` full barriers, then as many empty ones), once
    the wgmmas that read it have retired. ``bulk``: the stages came by bulk copies, which write
    through wgmma's async proxy (no proxy fence)."""
    wg_wait_one, wg_wait_all = wg_waiter(1), wg_waiter(0)

    @inlined
    def walk(acc, bars, n_stages, desc_a, desc_b, lane, buf, parity, where):
        last = buf
        for s in range(n_stages):
            bar_wait(bars + buf * BAR_BYTES, parity)  # the stage's copies have landed ...
            if not bulk:
                proxy_fence()  # ... and are visible to wgmma's reads
            multiply_stage(acc, desc_a, desc_b, buf, s, where)
            wg_wait_one()  # the previous stage's wgmmas have retired: its buffer is free
            if s > 0 and lane == 0:
                arrive(bars + (stages + last) * BAR_BYTES)
            last = buf
            buf += 1
            if buf == stages:
                buf, parity = 0, parity ^ 1
        wg_wait_all()
        settle(acc)
        if n_stages > 0 and lane == 0:
            arrive(bars + (stages + last) * BAR_BYTES)
        return buf, parity

    return walk


def stored_of(storage, acc_type):
    """from_acc(value) -> what the epilogue stores (`device.converters`' own), bf16 rounded by the
    hardware (`ptx.half2.bf16_of_float`: version 7 runs on sm_90 only)."""
    if storage == "bfloat16":
        return bf16_of_float
    return converters(storage, acc_type)[1]


def make_staging(cfg, bs, weight_grad, transposed, threads=None):
    """The epilogue's two halves, after the ring (whose shared memory they reuse, once a barrier
    has seen every warpgroup's last wgmma retired):

    * ``stage(acc, tile, row, col0)``: this thread's accumulators into the shared fp32 tile (1-D,
      `staged_shape`), ``row`` and ``col0`` those of its first (`ptx.wgmma.acc_position`);
    * ``chunk(tid, i)``: (row, first column) of the i-th run of 4 staged values this thread
      writes out, or row -1 past the tile. Consecutive threads take consecutive runs of a row, so
      a warp's reads are conflict-free and its global stores whole lines (an accumulator's own
      layout would store two values a thread, eight rows a warp instruction:
      `docs/performance.md` measures the difference).

    ``threads``: the threads that write the tile out (the multiplying warpgroups' by default)."""
    BM, BN, GROUPS, TILES, _, _ = v7_shape(cfg, bs, weight_grad)
    ROWS, COLS, PITCH = staged_shape(cfg, bs, weight_grad, transposed)
    T = threads or WARPGROUP * GROUPS
    ACC = BN // 2  # accumulators a thread a 64-row tile
    CPR = COLS // 4  # runs of 4 a staged row
    RUNS = ROWS * CPR
    PER = -(-RUNS // T)

    @inlined
    def put(p, acc, tile, row, col0):
        t, q = p // (ACC // 2), p % (ACC // 2)
        j, h = q // 2, q % 2
        r = row + WGMMA_M * t + 8 * h
        c = col0 + 8 * j
        if transposed:
            tile[c * PITCH + r] = acc[2 * p]
            tile[(c + 1) * PITCH + r] = acc[2 * p + 1]
        else:
            store2(tile, (r * PITCH + c,), (acc[2 * p], acc[2 * p + 1]))

    stage = unrolled(TILES * ACC // 2, put, inline=inlined)

    @inlined
    def chunk(tid, i):
        e = tid + i * T
        if e >= RUNS:
            return -1, 0
        return e // CPR, (e % CPR) * 4

    return stage, chunk, PER, PITCH


def make_staging16(cfg, bs, from_acc):
    """A persistent product's epilogue (`make_staging`'s, for feature_axis 1, in the storage dtype,
    into its own tile beside the ring, which the next tile's copies fill meanwhile):

    * ``stage16(acc, tile, at, row, col0)``: this thread's accumulators, as pairs of 16-bit
      values, into the tile starting at value ``at`` of the 16-bit shared array ``tile``;
    * ``chunk16(thread, i)``: (row, first column) of the i-th run of 4 values a multiplying thread
      writes out, or row -1 past the tile. Pitches of BN + 8 values put a warp's stores of its
      pairs on distinct banks;
    * ``sums(acc, workspace, slot, row, col0, n_rows)``: the fp32 accumulators straight into a
      split line's workspace slot (rows before n_rows)."""
    BM, BN, GROUPS, TILES, _, _ = v7_shape(cfg, bs)
    PITCH = BN + 8
    T = WARPGROUP * GROUPS
    ACC = BN // 2
    CPR = BN // 4
    RUNS = BM * CPR
    PER = -(-RUNS // T)

    @inlined
    def put(p, acc, tile, at, row, col0):
        t, q = p // (ACC // 2), p % (ACC // 2)
        r = row + WGMMA_M * t + 8 * (q % 2)
        c = col0 + 8 * (q // 2)
        store2(tile, (at + r * PITCH + c,), (from_acc(acc[2 * p]), from_acc(acc[2 * p + 1])))

    stage16 = unrolled(TILES * ACC // 2, put, inline=inlined)

    @inlined
    def put32(p, acc, workspace, slot, row, col0, n_rows):
        t, q = p // (ACC // 2), p % (ACC // 2)
        r = row + WGMMA_M * t + 8 * (q % 2)
        if r < n_rows:
            store2(workspace, (slot, r, col0 + 8 * (q // 2)), (acc[2 * p], acc[2 * p + 1]))

    sums = unrolled(TILES * ACC // 2, put32, inline=inlined)  # (an index known when compiled: registers)

    @inlined
    def chunk16(thread, i):
        e = thread + i * T
        if e >= RUNS:
            return -1, 0
        return e // CPR, (e % CPR) * 4

    return stage16, chunk16, sums, PER


def make_product_v7(cfg, bs, storage, acc_type, transpose_w, feature_axis, bias_kind=None, relu=False):
    """Products (forward, or with ``transpose_w`` input_grad) on version 7 tiles: a thread block
    owns BM rows of one segment of an output block-line, as in version 6 (`tiles.make_product_v6`),
    whose conventions it keeps: rows past N read the last row(s) and are not written. Persistent
    (`persistent`) with feature_axis 1 at the block sizes of ``v7_persistent``.

    ``bias_kind``: the dtype of a bias the epilogue adds to each output feature before rounding
    (``bias``, one value a feature), or None (``bias`` a stand-in); ``relu``: the epilogue then
    takes the max with 0. A line cut into segments leaves both to the combining pass."""
    PERSIST = persistent(cfg, bs, False, feature_axis)
    if PERSIST:
        cfg = persistent_config(cfg, bs)
    BM, BN, _, TILES, BK, _ = v7_shape(cfg, bs)
    ACC = BN // 2  # accumulators a thread a 64-row tile
    ACC_ALL = TILES * ACC  # (Numba sizes a local array by a name, not an expression)
    SPB = bs // BK
    GROUP = cfg.product_group
    A_MN = feature_axis == 0  # x (C, N): a stored row is a feature (k), the rows (m) run along it
    B_MN = not transpose_w  # W's block: k (its rows) down, outputs along; Wᵀ: k along its rows
    from_acc = stored_of(storage, acc_type)
    BLOCK = bs * bs
    B_K_STEP = 1 if transpose_w else bs

    GROUPS = v7_shape(cfg, bs)[2]
    SPLIT = cfg.v7_producer
    THREADS = v7_threads(cfg, bs)
    give, take = hand_over(cfg, bs, GROUPS, False)
    stage, chunk, OUT_PER, PITCH = make_staging(cfg, bs, False, A_MN, THREADS)
    # (feature_axis 1, threads whole staged rows of runs of 4: a thread's runs share their columns)
    ONE_COLUMN = not A_MN and THREADS % (staged_shape(cfg, bs, False, A_MN)[1] // 4) == 0
    STAGED16, PITCH16, _ = staged16_at(cfg, bs)
    STAGED16 //= 2  # (in 16-bit values)
    T = GROUPS * WARPGROUP
    stage16, chunk16, sums, OUT_PER16 = make_staging16(cfg, bs, from_acc)
    STORE_T = int16 if storage == "bfloat16" else types.float16
    BIAS = bias_kind is not None
    bias_at = bias_reader(bias_kind, float32)

    @inlined
    def relu_of(v):
        return float32(0) if v < float32(0) else v  # (NaN kept, as torch's ReLU)

    @inlined
    def bias4(bias, at, step):
        """The bias's values at, at + step, ... (step 0: one value for all 4); zeros without one."""
        if BIAS:
            return (bias_at(bias, at), bias_at(bias, at + step), bias_at(bias, at + 2 * step),
                    bias_at(bias, at + 3 * step))
        return float32(0), float32(0), float32(0), float32(0)

    @inlined
    def biased(v, b):
        """4 fp32 values plus their bias values ``b`` (`bias4`), and with ``relu`` their max with 0."""
        if BIAS:
            v = (v[0] + b[0], v[1] + b[1], v[2] + b[2], v[3] + b[3])
        if relu:
            v = (relu_of(v[0]), relu_of(v[1]), relu_of(v[2]), relu_of(v[3]))
        return v

    @inlined
    def add_pair(p, acc, bias, first):
        """The bias on accumulators 2p and 2p + 1 (`make_staging16`'s columns: first + 8 (q // 2), + 1)."""
        q = p % (ACC // 2)
        acc[2 * p] += bias_at(bias, first + 8 * (q // 2))
        acc[2 * p + 1] += bias_at(bias, first + 8 * (q // 2) + 1)

    add_bias = unrolled(ACC_ALL // 2, add_pair, inline=inlined)

    @inlined
    def clamp_pair(p, acc):
        acc[2 * p] = relu_of(acc[2 * p])
        acc[2 * p + 1] = relu_of(acc[2 * p + 1])

    clamp = unrolled(ACC_ALL // 2, clamp_pair, inline=inlined)

    @inlined
    def stage_sources(s, where):
        """Global addresses of stage s's first chunks (as version 6's)."""
        begin, other_idx, line_block, a_base, w_base, lead, row0, n_rows = where
        j = begin + s // SPB
        k0 = (s % SPB) * BK
        feature = int64(other_idx[j]) * bs + k0
        a_stage = 2 * (feature * lead if A_MN else feature)
        b_stage = 2 * (int64(j if transpose_w else line_block[j]) * BLOCK + k0 * B_K_STEP)
        return a_base + a_stage, w_base + b_stage

    @inlined
    def sources(s, where, a_keep, b_keep):
        return stage_sources(s, where)

    @inlined
    def a_chunk(row, col, s, where):
        """A chunk's offset from its stage's address: rows past N read the last row(s)."""
        lead, row0, n_rows = where[5], where[6], where[7]
        if A_MN:  # a stored row is a feature, the tile's rows run along it
            return 2 * (int64(row) * lead + min(row0 + col, n_rows - 8)), True
        return 2 * (int64(min(row0 + row, n_rows - 1)) * lead + col), True

    @inlined
    def b_chunk(row, col, s, where):
        return 2 * int64(row * bs + col), True

    @inlined
    def boxes(s, where):
        """Stage s's first boxes (`tma_maps`): A's at (row0, feature) feature_axis 0, else
        (feature, row0); B's in W's rows (block j's at j bs): Wᵀ's (k0, j bs), W's (0, its k0)."""
        j = where[0] + s // SPB
        k0 = int32((s % SPB) * BK)
        feature = int32(where[1][j]) * bs + k0
        row0 = int32(where[6])
        b_inner, b_outer = (k0, int32(j) * bs) if transpose_w else (int32(0), int32(where[2][j]) * bs + k0)
        if A_MN:
            return row0, feature, b_inner, b_outer
        return feature, row0, b_inner, b_outer

    BARS_P = staged16_at(cfg, bs)[2]
    copy_plan, make_ring, descriptors, (A_PER, B_PER), make_split = make_hopper_loop(
        cfg, bs, storage, False, A_MN, B_MN)
    ring = make_ring(sources)
    init, produce, consume, specialized = make_split(stage_sources, a_chunk, b_chunk, stage,
                                                     boxes if SPLIT and cfg.v7_tma else None)

    @jit_for(cfg, bs, GROUPS, False)
    def product_v7(out, workspace, a, w, bias, seg_line, seg_begin, seg_end, seg_slot, other_idx, line_block, n_rows,
                   a_map, w_map):
        tid = cuda.threadIdx.x
        group, thread = tid // WARPGROUP, tid % WARPGROUP
        tile, seg = grouped_tile(GROUP)
        row0 = tile * BM
        begin = seg_begin[seg]
        n_stages = (seg_end[seg] - begin) * SPB
        lead = int64(a.shape[1])
        smem = cuda.shared.array(0, int32)
        base = align_up(shared_address(smem, (0,)), ATOM)
        a_base = signed_address(a, (0, 0))
        w_base = signed_address(w, (0, 0, 0))
        where = (begin, other_idx, line_block, a_base, w_base, lead, row0, n_rows)
        maps = (global_address(a_map, (0,)), a_base, global_address(w_map, (0,)), w_base)
        warp, lane = thread // 32, thread % 32
        if PERSIST:
            bars = shared_address(smem, (0,)) + BARS_P
            if tid == 0:
                init(bars, 0)
            cuda.syncthreads()
            tiles = (n_rows + BM - 1) // BM
            segments = seg_line.shape[0]
            if group == GROUPS:  # the copying warpgroup: every tile's stages, round one ring
                give()
                buf, parity = 0, 1
                for pid in range(cuda.blockIdx.x, tiles * segments, cuda.gridDim.x):
                    tile, seg = tile_of(pid, tiles, segments, GROUP)
                    begin = seg_begin[seg]
                    where = (begin, other_idx, line_block, a_base, w_base, lead, tile * BM, n_rows)
                    buf, parity = produce(thread, base, bars, (seg_end[seg] - begin) * SPB, where, buf, parity,
                                          maps)
            else:
                take()
                desc_a, desc_b = descriptors(base, group)
                acc = cuda.local.array(ACC_ALL, float32)
                staged16 = cuda.shared.array(0, STORE_T)
                buf, parity = 0, 0
                for pid in range(cuda.blockIdx.x, tiles * segments, cuda.gridDim.x):
                    tile, seg = tile_of(pid, tiles, segments, GROUP)
                    begin = seg_begin[seg]
                    for i in range(ACC_ALL):
                        acc[i] = float32(0)
                    buf, parity = consume(acc, bars, (seg_end[seg] - begin) * SPB, desc_a, desc_b, lane, buf, parity)
                    row0 = tile * BM
                    line, slot = seg_line[seg], seg_slot[seg]
                    row = group * TILES * WGMMA_M + 16 * warp + lane // 4
                    if slot >= 0:  # a segment's fp32 sums, for the combine pass: straight from the registers
                        sums(acc, workspace, slot, row0 + row, 2 * (lane % 4), n_rows)
                    else:
                        if BIAS:
                            add_bias(acc, bias, line * bs + 2 * (lane % 4))
                        if relu:
                            clamp(acc)
                        named_barrier(1, T)  # every thread has read the last tile's staged values
                        stage16(acc, staged16, STAGED16, row, 2 * (lane % 4))
                        named_barrier(1, T)
                        for i in range(OUT_PER16):
                            r, c = chunk16(thread + WARPGROUP * group, i)
                            if r >= 0 and row0 + r < n_rows:
                                store4(out, (row0 + r, line * bs + c), load4(staged16, (STAGED16 + r * PITCH16 + c,)))
            cuda.syncthreads()
            return
        if SPLIT:
            specialized(shared_address(smem, (0,)), base, tid, n_stages, where, cuda.shared.array(0, float32), maps)
        else:
            a_from = cuda.local.array(A_PER, int64)
            a_to = cuda.local.array(A_PER, int32)
            a_row = cuda.local.array(A_PER, int32)
            a_col = cuda.local.array(A_PER, int32)
            a_keep = cuda.local.array(A_PER, int32)
            b_from = cuda.local.array(B_PER, int64)
            b_to = cuda.local.array(B_PER, int32)
            b_row = cuda.local.array(B_PER, int32)
            b_col = cuda.local.array(B_PER, int32)
            b_keep = cuda.local.array(B_PER, int32)
            copy_plan(tid, a_to, b_to, a_row, a_col, b_row, b_col)
            for i in range(A_PER):
                if A_MN:  # a stored row is a feature, the tile's rows run along it
                    a_from[i] = 2 * (int64(a_row[i]) * lead + min(row0 + a_col[i], n_rows - 8))
                else:
                    a_from[i] = 2 * (int64(min(row0 + a_row[i], n_rows - 1)) * lead + a_col[i])
                a_keep[i] = 1
            for i in range(B_PER):
                b_from[i] = 2 * (int64(b_row[i]) * bs + b_col[i])
                b_keep[i] = 1
            desc_a, desc_b = descriptors(base, group)
            acc = cuda.local.array(ACC_ALL, float32)
            for i in range(ACC_ALL):
                acc[i] = float32(0)

            ring(acc, base, tid, n_stages, where, a_from, a_to, b_from, b_to, a_keep, b_keep, desc_a, desc_b)

            cuda.syncthreads()  # every warpgroup's wgmmas have read the ring
            staged = cuda.shared.array(0, float32)
            stage(acc, staged, group * TILES * WGMMA_M + 16 * warp + lane // 4, 2 * (lane % 4))
            cuda.syncthreads()
        staged = cuda.shared.array(0, float32)
        line, slot = seg_line[seg], seg_slot[seg]
        # (read once where a thread's runs share their columns: stores to out might alias the bias
        # for all the compiler knows, so it would read it again after each)
        column_bias = bias4(bias, line * bs + chunk(tid, 0)[1], 1)
        for i in range(OUT_PER):
            r, c = chunk(tid, i)
            if r >= 0:
                v = load4(staged, (r * PITCH + c,))
                if A_MN:  # r: the block's column (a feature), c: the first of 4 rows (tokens)
                    if row0 + c < n_rows:  # (n_rows is a multiple of 8: `dispatch.tiles_fit`)
                        if slot >= 0:
                            for e in range(4):
                                workspace[slot, row0 + c + e, r] = v[e]
                        else:
                            v = biased(v, bias4(bias, line * bs + r, 0))
                            store4(out, (line * bs + r, row0 + c),
                                   (from_acc(v[0]), from_acc(v[1]), from_acc(v[2]), from_acc(v[3])))
                elif row0 + r < n_rows:
                    if slot >= 0:
                        store4(workspace, (slot, row0 + r, c), v)
                    else:
                        v = biased(v, column_bias if ONE_COLUMN else bias4(bias, line * bs + c, 1))
                        store4(out, (row0 + r, line * bs + c),
                               (from_acc(v[0]), from_acc(v[1]), from_acc(v[2]), from_acc(v[3])))

    return dynamic_shared(product_v7, shared_bytes(cfg, bs, False, feature_axis))
