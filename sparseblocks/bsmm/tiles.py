"""Tensor-core tiles (version 6): fp16 and bf16 products and weight gradients as one pipelined GEMM.

Every product is C (BM x BN) += A (BM x k) · B (k x BN), k walked BK at a time:

* forward:     A = x rows, B = a block of W,   k over the blocks of an output block-column;
* input_grad:  A = dy rows, B = a block of Wᵀ, k over the blocks of a block-row;
* weight_grad: A = xᵀ, B = dy, one block of dW a tile, k over N (or one N-split of it).

A stage (BK of k of both operands) goes from global to shared memory by 16-byte cp.async, into
a ring of ``stages`` buffers, ``stages - 1`` ahead of the multiply, one barrier a stage. Each
operand sits in shared memory as it lies in global memory: rows of 16-byte chunks along its
contiguous axis, padded by 16 bytes so that eight rows start in eight different bank groups.
Warps own WM x WN patches (fp32 accumulators in registers) and take their mma fragments with
``ldmatrix``: plain where the operand's k runs along its rows (x with feature_axis 1, Wᵀ),
``.trans`` where k runs down them (W, dy and x in the weight gradient), so any feature axis is
the same loop with other flags. Blocks of `BsmmConfig.v6_tiles` (16-128 by default; weight gradients
those of `v6_wgrad_warps`, 32-128); operands 16-byte aligned, and N a multiple of 8 with feature_axis
0 (N then runs along rows): `dispatch.tiles_fit` checks, and version 5 runs otherwise.
"""

from numba import cuda, float32, int32, int64, uint32

from ..ptx.cp_async import commit, copy16_or_zero, shared_address, signed_address, waiter
from ..ptx.ldmatrix import ldmatrix_x4_at, ldmatrix_x4_trans_at
from ..ptx.mma import MMA_K, MMA_M, MMA_N
from ..ptx.mma import mma_bf16, mma_f16
from ..ptx.vector import store2
from ..runtime.compile import unrolled
from ..runtime.launch import dynamic_shared
from .device import converters, grouped_tile, product_output, weight_grad_output

V6_STORAGE = ("float16", "bfloat16")
CHUNK = 8  # 16-bit values a 16-byte chunk
PAD = 16  # bytes after each shared row


def v6_shape(cfg, bs, weight_grad=False):
    """(BM, BN, warps along m, warps along n, BK, stages) of a version 6 tile: a product's BM
    rows by one block's bs features, or a weight gradient's bs x bs block."""
    if weight_grad:
        warps_m, warps_n = cfg.v6_wgrad_warps[bs]
        return bs, bs, warps_m, warps_n, cfg.v6_wgrad_k, cfg.v6_wgrad_stages
    rows, warps_m, warps_n = cfg.v6_tiles[bs]
    return rows, bs, warps_m, warps_n, min(bs, cfg.v6_k), cfg.v6_stages


def v6_threads(cfg, bs, weight_grad=False):
    _, _, warps_m, warps_n, _, _ = v6_shape(cfg, bs, weight_grad)
    return 32 * warps_m * warps_n


def v6_check(cfg, bs, weight_grad=False):
    """Why a block size's version 6 tiles cannot be built under ``cfg`` ('' where they can)."""
    table = cfg.v6_wgrad_warps if weight_grad else cfg.v6_tiles
    if bs not in table:
        return f"no version 6 tile for block {bs}"
    BM, BN, WARPS_M, WARPS_N, BK, STAGES = v6_shape(cfg, bs, weight_grad)
    if BM % (WARPS_M * MMA_M) or BN % (WARPS_N * 2 * MMA_N) or BK % MMA_K or (bs % BK and not weight_grad):
        return (f"block {bs}: tile {BM} x {BN} (k {BK}) does not split into {WARPS_M} x {WARPS_N} warps "
                "of whole mma pairs")
    if not 2 <= STAGES <= 5:
        return f"stages: expected 2 to 5, got {STAGES}"
    if shared_bytes(cfg, bs, weight_grad) > cfg.v6_max_shared:
        return f"block {bs}: {shared_bytes(cfg, bs, weight_grad)} bytes of shared memory over v6_max_shared"
    return ""


def _operand(rows_along_k, side, BK):
    """(rows, bytes a row with its pad, chunks a row) of an operand's shared tile: ``side`` (BM or
    BN) rows of BK values where k runs along the rows, else BK rows of ``side`` values."""
    rows, values = (side, BK) if rows_along_k else (BK, side)
    return rows, 2 * values + PAD, values // CHUNK


def shared_bytes(cfg, bs, weight_grad=False, a_along_k=None, b_along_k=None):
    """Bytes of the ring: its stages of A's and B's tiles as the operands lie (``*_along_k``), or
    the most either way lies (None: what `v6_check` bounds)."""
    BM, BN, _, _, BK, STAGES = v6_shape(cfg, bs, weight_grad)

    def tile(along_k, side):
        ways = (True, False) if along_k is None else (along_k,)
        return max(rows * stride for rows, stride, _ in (_operand(way, side, BK) for way in ways))

    return STAGES * (tile(a_along_k, BM) + tile(b_along_k, BN))


def make_tile_loop(cfg, bs, storage, weight_grad, a_along_k, b_along_k):
    """The device functions of the pipelined loop, shared by both kernels:

    * ``copy_plan(tid, a_from, a_to, b_from, b_to, a_row, a_col, b_row, b_col)``: each of this
      thread's chunks: its shared offset in buffer 0, and its (row, chunk) in the operand tile,
      from which the kernel works out its global offset once;
    * ``issue(base, buf, a_global, b_global, a_from, a_to, b_from, b_to, a_keep, b_keep)``: one
      stage's cp.async copies into buffer ``buf``, from the global addresses ``a_global`` and
      ``b_global`` of the stage (plus each chunk's offset), zeros where a keep flag is false;
    * ``multiply_head`` and ``multiply_tail(acc, fa, fb, base, buf, a_lane, b_lane)``: acc += the
      stage in buffer ``buf``, from this lane's ldmatrix row addresses (`lane_offsets`), its first
      ``v6_copy_step`` k16 steps and the rest: a stage's copies are issued between them;
    * ``lane_offsets(lane, warp_m, warp_n)``: those addresses' offsets in buffer 0.
    """
    BM, BN, WARPS_M, WARPS_N, BK, STAGES = v6_shape(cfg, bs, weight_grad)
    T = 32 * WARPS_M * WARPS_N
    WM, WN = BM // WARPS_M, BN // WARPS_N
    MT, NT, NP = WM // MMA_M, WN // MMA_N, WN // (2 * MMA_N)
    STEPS = BK // MMA_K
    A_ROWS, A_STRIDE, A_CPR = _operand(a_along_k, BM, BK)
    B_ROWS, B_STRIDE, B_CPR = _operand(b_along_k, BN, BK)
    A_BYTES, B_BYTES = A_ROWS * A_STRIDE, B_ROWS * B_STRIDE
    STAGE_BYTES = A_BYTES + B_BYTES
    A_CHUNKS, B_CHUNKS = A_ROWS * A_CPR, B_ROWS * B_CPR
    A_PER, B_PER = -(-A_CHUNKS // T), -(-B_CHUNKS // T)
    A_ALL, B_ALL = A_CHUNKS % T == 0, B_CHUNKS % T == 0
    mma = mma_bf16 if storage == "bfloat16" else mma_f16
    load_a = ldmatrix_x4_at if a_along_k else ldmatrix_x4_trans_at
    load_b = ldmatrix_x4_at if b_along_k else ldmatrix_x4_trans_at
    # Byte steps between a lane's fragments: k16 steps s, then mma rows mt (A) or pairs np (B).
    A_STEP_K = 2 * MMA_K if a_along_k else MMA_K * A_STRIDE
    A_STEP_M = MMA_M * A_STRIDE if a_along_k else 2 * MMA_M
    B_STEP_K = 2 * MMA_K if b_along_k else MMA_K * B_STRIDE
    B_STEP_N = 2 * MMA_N * B_STRIDE if b_along_k else 4 * MMA_N

    @cuda.jit(device=True, inline=True)
    def copy_plan(tid, a_from, a_to, b_from, b_to, a_row, a_col, b_row, b_col):
        for i in range(A_PER):
            e = tid + i * T
            if A_ALL or e < A_CHUNKS:
                a_row[i], a_col[i] = e // A_CPR, (e % A_CPR) * CHUNK
                a_to[i] = a_row[i] * A_STRIDE + 2 * a_col[i]
        for i in range(B_PER):
            e = tid + i * T
            if B_ALL or e < B_CHUNKS:
                b_row[i], b_col[i] = e // B_CPR, (e % B_CPR) * CHUNK
                b_to[i] = A_BYTES + b_row[i] * B_STRIDE + 2 * b_col[i]

    @cuda.jit(device=True, inline=True)
    def issue(base, tid, buf, a_global, b_global, a_from, a_to, b_from, b_to, a_keep, b_keep):
        """(A chunk dropped by its keep flag reads nothing, and points at the stage's first
        chunk, which is in the array, rather than past its end.)"""
        at = base + buf * STAGE_BYTES
        for i in range(A_PER):
            if A_ALL or tid + i * T < A_CHUNKS:
                copy16_or_zero(at + a_to[i], a_global + (a_from[i] if a_keep[i] else 0), a_keep[i])
        for i in range(B_PER):
            if B_ALL or tid + i * T < B_CHUNKS:
                copy16_or_zero(at + b_to[i], b_global + (b_from[i] if b_keep[i] else 0), b_keep[i])

    @cuda.jit(device=True, inline=True)
    def lane_offsets(lane, warp_m, warp_n):
        """(A, B) byte offsets in buffer 0 of the rows this lane hands to ldmatrix at k step 0,
        mma row 0 (A) and mma column pair 0 (B). Lanes 8q..8q+7 give the rows of matrix q:
        A's matrices are (m 0-7, k 0-7), (m 8-15, k 0-7), (m 0-7, k 8-15), (m 8-15, k 8-15),
        B's (k 0-7, n 0-7), (k 8-15, n 0-7), (k 0-7, n 8-15), (k 8-15, n 8-15)."""
        q, r = lane // 8, lane % 8
        m = warp_m * WM + (q % 2) * 8
        ka = (q // 2) * 8
        n = warp_n * WN + (q // 2) * 8
        kb = (q % 2) * 8
        if a_along_k:
            a = (m + r) * A_STRIDE + 2 * ka
        else:
            a = (ka + r) * A_STRIDE + 2 * m
        if b_along_k:
            b = A_BYTES + (n + r) * B_STRIDE + 2 * kb
        else:
            b = A_BYTES + (kb + r) * B_STRIDE + 2 * n
        return a, b

    @cuda.jit(device=True, inline=True)
    def step(s, acc, fa, fb, a_at, b_at):
        """acc += k16 step s of a stage: A's fragments from a_at, B's from b_at (this lane's rows)."""
        for mt in range(MT):
            f = load_a(a_at + (s * A_STEP_K + mt * A_STEP_M))
            for q in range(4):
                fa[mt, q] = f[q]
        for p in range(NP):
            f = load_b(b_at + (s * B_STEP_K + p * B_STEP_N))
            for q in range(4):
                fb[p, q] = f[q]
        for mt in range(MT):
            for nt in range(NT):
                p, h = nt // 2, 2 * (nt % 2)
                d = mma(fa[mt, 0], fa[mt, 1], fa[mt, 2], fa[mt, 3], fb[p, h], fb[p, h + 1],
                        acc[mt, nt, 0], acc[mt, nt, 1], acc[mt, nt, 2], acc[mt, nt, 3])
                for q in range(4):
                    acc[mt, nt, q] = d[q]

    MULTIPLIED = STEPS if cfg.v6_multiply else 0  # (none: the loop only moves the data, a floor)
    head = unrolled(min(cfg.v6_copy_step, MULTIPLIED), step)
    tail = unrolled(MULTIPLIED, step, start=min(cfg.v6_copy_step, MULTIPLIED))

    @cuda.jit(device=True, inline=True)
    def multiply_head(acc, fa, fb, base, buf, a_lane, b_lane):
        """The stage's k16 steps before its thread issues the next stage's copies (v6_copy_step)."""
        at = base + buf * STAGE_BYTES
        head(acc, fa, fb, at + a_lane, at + b_lane)

    @cuda.jit(device=True, inline=True)
    def multiply_tail(acc, fa, fb, base, buf, a_lane, b_lane):
        at = base + buf * STAGE_BYTES
        tail(acc, fa, fb, at + a_lane, at + b_lane)

    return copy_plan, issue, lane_offsets, multiply_head, multiply_tail


def make_product_v6(cfg, bs, storage, acc_type, transpose_w, feature_axis):
    """Products (forward, or with ``transpose_w`` input_grad) on version 6 tiles.

    A thread block owns BM rows of one segment of an output block-line (its blocks
    ``seg_begin..seg_end`` of the column, or row, index), row tiles handed out in groups
    (`device.grouped_tile`). Rows past N read the last row (feature_axis 1) or the last 8
    (feature_axis 0): a row's outputs depend on that row alone, and they are not written.
    Outputs go out two neighbours at a time where they are neighbours in memory."""
    BM, BN, WARPS_M, WARPS_N, BK, STAGES = v6_shape(cfg, bs)
    T = 32 * WARPS_M * WARPS_N
    WM, WN = BM // WARPS_M, BN // WARPS_N
    MT, NT, NP = WM // MMA_M, WN // MMA_N, WN // (2 * MMA_N)
    SPB = bs // BK  # stages a block
    GROUP = cfg.product_group
    A_ALONG_K = feature_axis == 1
    copy_plan, issue, lane_offsets, multiply_head, multiply_tail = make_tile_loop(
        cfg, bs, storage, False, A_ALONG_K, transpose_w)
    A_ROWS, _, A_CPR = _operand(A_ALONG_K, BM, BK)
    B_ROWS, _, B_CPR = _operand(transpose_w, BN, BK)
    A_PER, B_PER = -(-(A_ROWS * A_CPR) // T), -(-(B_ROWS * B_CPR) // T)
    wait = waiter(STAGES - 2)
    emit = product_output(bs, storage, acc_type, feature_axis)
    _, from_acc = converters(storage, acc_type)
    BLOCK = bs * bs  # values a stored block
    # A stage's k0 moves B's rows (W: k down the block's rows) or its columns (Wᵀ: k along them).
    B_K_STEP = 1 if transpose_w else bs

    @cuda.jit(device=True, inline=True)
    def store_row(i, acc, out, workspace, line, slot, row0, col0, n_rows):
        """Row pair i (mma row i // 2, upper or lower 8) of this lane's outputs: rows row0 + 8 i,
        columns col0 + 8 nt and the next, two neighbours a store where they are in memory."""
        mt, half = i // 2, i % 2
        row = row0 + mt * MMA_M + 8 * half
        if row < n_rows:
            for nt in range(NT):
                col = col0 + nt * MMA_N
                v0, v1 = acc[mt, nt, 2 * half], acc[mt, nt, 2 * half + 1]
                if slot >= 0:
                    store2(workspace, (slot, row, col), (v0, v1))
                elif feature_axis == 1:
                    store2(out, (row, line * bs + col), (from_acc(v0), from_acc(v1)))
                else:
                    emit(out, workspace, slot, line, row, col, v0)
                    emit(out, workspace, slot, line, row, col + 1, v1)

    store_rows = unrolled(2 * MT, store_row)

    @cuda.jit(device=True, inline=True)
    def sources(s, begin, other_idx, line_block, a_base, w_base, lead):
        """Global addresses of stage s's first chunks: A's features other * bs + k0 (at row 0),
        B's block of the line's entry begin + s // SPB, at its k0."""
        j = begin + s // SPB
        k0 = (s % SPB) * BK
        feature = int64(other_idx[j]) * bs + k0
        a_stage = 2 * (feature if A_ALONG_K else feature * lead)
        b_stage = 2 * (int64(j if transpose_w else line_block[j]) * BLOCK + k0 * B_K_STEP)
        return a_base + a_stage, w_base + b_stage

    @cuda.jit
    def product_v6(out, workspace, a, w, seg_line, seg_begin, seg_end, seg_slot, other_idx, line_block, n_rows):
        tid = cuda.threadIdx.x
        lane, warp = tid % 32, tid // 32
        warp_m, warp_n = warp // WARPS_N, warp % WARPS_N
        tile, seg = grouped_tile(GROUP)
        row0 = tile * BM
        begin = seg_begin[seg]
        n_stages = (seg_end[seg] - begin) * SPB
        lead = int64(a.shape[1])  # a's row length: features (axis 1) or N (axis 0)
        smem = cuda.shared.array(0, int32)  # the ring (dynamic: over the 48 KB of static)
        base = shared_address(smem, (0,))
        a_base = signed_address(a, (0, 0))
        w_base = signed_address(w, (0, 0, 0))
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
        copy_plan(tid, a_from, a_to, b_from, b_to, a_row, a_col, b_row, b_col)
        # Global byte offsets of this thread's chunks in the stage of features 0 (A) and of
        # block 0 at k 0 (B); a stage adds its features' (A) and its block's and k's (B).
        for i in range(A_PER):
            if A_ALONG_K:  # a row of the tile is a row of a
                a_from[i] = 2 * (int64(min(row0 + a_row[i], n_rows - 1)) * lead + a_col[i])
            else:  # a row of the tile is a feature: its values run along N
                a_from[i] = 2 * (int64(a_row[i]) * lead + min(row0 + a_col[i], n_rows - 8))
            a_keep[i] = 1
        for i in range(B_PER):
            b_from[i] = 2 * (int64(b_row[i]) * bs + b_col[i])
            b_keep[i] = 1
        a_lane, b_lane = lane_offsets(lane, warp_m, warp_n)
        acc = cuda.local.array((MT, NT, 4), float32)
        fa = cuda.local.array((MT, 4), uint32)
        fb = cuda.local.array((NP, 4), uint32)
        for mt in range(MT):
            for nt in range(NT):
                for q in range(4):
                    acc[mt, nt, q] = float32(0)

        for s in range(STAGES - 1):  # stage s goes to buffer s
            if s < n_stages:
                a_at, b_at = sources(s, begin, other_idx, line_block, a_base, w_base, lead)
                issue(base, tid, s, a_at, b_at, a_from, a_to, b_from, b_to, a_keep, b_keep)
            commit()  # one group a stage, empty or not, so that the wait counts stages
        buf = 0
        for stage in range(n_stages):
            wait()  # this thread's copies of this stage have landed
            # Every thread's have, and every warp is done with the buffer refilled below.
            cuda.syncthreads()
            multiply_head(acc, fa, fb, base, buf, a_lane, b_lane)
            nxt = stage + STAGES - 1
            if nxt < n_stages:  # into the buffer multiplied last, which every warp is done with
                a_at, b_at = sources(nxt, begin, other_idx, line_block, a_base, w_base, lead)
                issue(base, tid, buf - 1 if buf > 0 else STAGES - 1, a_at, b_at, a_from, a_to, b_from, b_to,
                      a_keep, b_keep)
            commit()
            multiply_tail(acc, fa, fb, base, buf, a_lane, b_lane)
            buf = buf + 1 if buf < STAGES - 1 else 0

        store_rows(acc, out, workspace, seg_line[seg], seg_slot[seg], row0 + warp_m * WM + lane // 4,
                   warp_n * WN + 2 * (lane % 4), n_rows)

    return dynamic_shared(product_v6, shared_bytes(cfg, bs, False, A_ALONG_K, transpose_w))


def make_weight_grad_v6(cfg, bs, storage, acc_type, feature_axis, out_storage=None):
    """dw[b] (+ beta·dw[b]) on version 6 tiles: a thread block a block, k along its N-split.

    A = xᵀ and B = dy: with feature_axis 1 both have k (N) down their rows (ldmatrix.trans),
    with 0 along them. Rows past the split's end are zeros (cp.async reads nothing there).
    A split's rows start at a multiple of 8 (`v5_wgrad_rows`), and N is one where it is the
    contiguous axis, so a chunk of 8 rows is wholly in or out."""
    BM, BN, WARPS_M, WARPS_N, BK, STAGES = v6_shape(cfg, bs, True)
    T = 32 * WARPS_M * WARPS_N
    WM, WN = BM // WARPS_M, BN // WARPS_N
    MT, NT, NP = WM // MMA_M, WN // MMA_N, WN // (2 * MMA_N)
    ALONG_K = feature_axis == 0  # N runs along the stored rows of x and dy
    copy_plan, issue, lane_offsets, multiply_head, multiply_tail = make_tile_loop(cfg, bs, storage, True, ALONG_K, ALONG_K)
    A_ROWS, _, A_CPR = _operand(ALONG_K, BM, BK)
    B_ROWS, _, B_CPR = _operand(ALONG_K, BN, BK)
    A_PER, B_PER = -(-(A_ROWS * A_CPR) // T), -(-(B_ROWS * B_CPR) // T)
    wait = waiter(STAGES - 2)
    finish = weight_grad_output(bs, out_storage or storage, acc_type)

    @cuda.jit(device=True, inline=True)
    def keep_flags(keep, rows, cols, n0, n_end):
        """Which chunks of a stage of rows n0... hold rows before n_end."""
        for i in range(len(keep)):
            keep[i] = (n0 + (cols[i] if ALONG_K else rows[i])) < n_end

    @cuda.jit(device=True, inline=True)
    def sources(s, n_begin, n_end, x_base, dy_base, x_lead, dy_lead, a_keep, a_row, a_col, b_keep, b_row,
                b_col):
        """Global addresses of stage s's first chunks (rows n0 = n_begin + s BK... of x and dy),
        and the keep flags of its chunks."""
        n0 = n_begin + s * BK
        keep_flags(a_keep, a_row, a_col, n0, n_end)
        keep_flags(b_keep, b_row, b_col, n0, n_end)
        x_stage = 2 * (int64(n0) if ALONG_K else int64(n0) * x_lead)
        dy_stage = 2 * (int64(n0) if ALONG_K else int64(n0) * dy_lead)
        return x_base + x_stage, dy_base + dy_stage

    @cuda.jit(device=True, inline=True)
    def finish_row(i, acc, dw, workspace, block, split, r0, col0, beta):
        """Row pair i of this lane's results (see the product's store_row) into dw or the workspace."""
        mt, half = i // 2, i % 2
        for nt in range(NT):
            for q in range(2):
                finish(dw, workspace, block, split, r0 + mt * MMA_M + 8 * half, col0 + nt * MMA_N + q,
                       acc[mt, nt, 2 * half + q], beta)

    finish_rows = unrolled(2 * MT, finish_row)

    @cuda.jit
    def weight_grad_v6(dw, workspace, x, dy, coords, n_rows, rows_per_split, beta):
        tid = cuda.threadIdx.x
        lane, warp = tid % 32, tid // 32
        warp_m, warp_n = warp // WARPS_N, warp % WARPS_N
        block = cuda.blockIdx.x
        split = cuda.blockIdx.y
        n_begin = split * rows_per_split
        n_end = min(n_begin + rows_per_split, n_rows)
        n_stages = max(0, (n_end - n_begin + BK - 1) // BK)
        x_lead, dy_lead = int64(x.shape[1]), int64(dy.shape[1])
        smem = cuda.shared.array(0, int32)  # the ring (dynamic: over the 48 KB of static)
        base = shared_address(smem, (0,))
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
        copy_plan(tid, a_from, a_to, b_from, b_to, a_row, a_col, b_row, b_col)
        # The block's features, x's c * bs... and dy's k * bs..., at row 0; a stage adds its n0.
        if ALONG_K:  # x (C, N), dy (K, N): a tile row is a feature, k (N) runs along it
            x_base = signed_address(x, (coords[block, 0] * bs, 0))
            dy_base = signed_address(dy, (coords[block, 1] * bs, 0))
        else:  # x (N, C), dy (N, K): a tile row is a row of N
            x_base = signed_address(x, (0, coords[block, 0] * bs))
            dy_base = signed_address(dy, (0, coords[block, 1] * bs))
        for i in range(A_PER):
            a_from[i] = 2 * (int64(a_row[i]) * x_lead + a_col[i])
        for i in range(B_PER):
            b_from[i] = 2 * (int64(b_row[i]) * dy_lead + b_col[i])
        a_lane, b_lane = lane_offsets(lane, warp_m, warp_n)
        acc = cuda.local.array((MT, NT, 4), float32)
        fa = cuda.local.array((MT, 4), uint32)
        fb = cuda.local.array((NP, 4), uint32)
        for mt in range(MT):
            for nt in range(NT):
                for q in range(4):
                    acc[mt, nt, q] = float32(0)

        for s in range(STAGES - 1):
            if s < n_stages:
                a_at, b_at = sources(s, n_begin, n_end, x_base, dy_base, x_lead, dy_lead, a_keep, a_row, a_col,
                                     b_keep, b_row, b_col)
                issue(base, tid, s, a_at, b_at, a_from, a_to, b_from, b_to, a_keep, b_keep)
            commit()
        buf = 0
        for stage in range(n_stages):
            wait()
            cuda.syncthreads()  # as in the product: the stage landed, the old buffer is free
            multiply_head(acc, fa, fb, base, buf, a_lane, b_lane)
            nxt = stage + STAGES - 1
            if nxt < n_stages:
                a_at, b_at = sources(nxt, n_begin, n_end, x_base, dy_base, x_lead, dy_lead, a_keep, a_row, a_col,
                                     b_keep, b_row, b_col)
                issue(base, tid, buf - 1 if buf > 0 else STAGES - 1, a_at, b_at, a_from, a_to, b_from, b_to,
                      a_keep, b_keep)
            commit()
            multiply_tail(acc, fa, fb, base, buf, a_lane, b_lane)
            buf = buf + 1 if buf < STAGES - 1 else 0

        finish_rows(acc, dw, workspace, block, split, warp_m * WM + lane // 4, warp_n * WN + 2 * (lane % 4), beta)

    return dynamic_shared(weight_grad_v6, shared_bytes(cfg, bs, True, ALONG_K, ALONG_K))
