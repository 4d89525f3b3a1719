"""Version 7's weight gradients (Hopper ``wgmma``; the loop, ring and epilogue of `hopper.py`).

dW's blocks are C (BM x BN) += A (BM x k) · B (k x BN) with A = xᵀ and B = dy, k walking N (an
N-split's rows a thread block, `dispatch.wgrad_splits`). With feature_axis 1 both operands are
MN-major (k = N down their stored rows), with 0 K-major. A thread block computes

* one block (``kind`` True): a tile of bs x bs;
* 2 or 4 blocks of one block-row (`PAIRED`, ``v7_wgrad_pairs``, ``v7_wgrad_pair_width``): a tile
  of bs x 2 bs (4 bs), B dy's column-blocks side by side, so that x's columns are read once for
  all of them;
* n blocks of one block-column (`STACKED`, ``v7_wgrad_stacks``, blocks of 32, where a block alone
  is narrower than wgmma's 64 rows): a tile of n bs x bs, A the n blocks' columns of x stacked,
  so that dy's columns are read once for all.

Paired and stacked tiles carry their blocks in ``coords`` (`dispatch.wgrad_pairs`,
`dispatch.wgrad_stacks`); a block index of -1 marks a slot no block fills (it repeats the tile's
first block's operands and is not stored)."""

from numba import cuda, float32, int32, int64

from ..ptx.cp_async import global_address, shared_address, signed_address
from ..ptx.vector import load4, store4
from ..ptx.wgmma import WARPGROUP, WGMMA_M, align_up
from ..runtime.compile import inlined
from ..runtime.launch import dynamic_shared
from .device import converters
from .hopper import make_hopper_loop, make_staging, stored_of
from .hopper_shapes import ATOM, PAIRED, STACKED, jit_for, producing, shared_bytes, v7_shape, v7_threads


def make_weight_grad_v7(cfg, bs, storage, acc_type, feature_axis, out_storage=None, kind=True, column_sums=False):
    """dw[b] (+ beta·dw[b]) on version 7 tiles, the blocks of a thread block as ``kind`` says
    (True, `PAIRED`, `STACKED`: the module's docstring), k along its N-split, as in version 6
    (`tiles.make_weight_grad_v6`). ``coords``: the layout's (row, column) a block, or with
    `PAIRED` `dispatch.wgrad_pairs`' (row, the columns of b_0 .., then b_0 ..), with `STACKED`
    `dispatch.wgrad_stacks`' (column, n rows, n blocks).

    ``column_sums`` (one block a thread block, warp-specialized with bulk copies, feature_axis 1):
    a block b with ``summing[b]`` nonzero also sums its split's rows of dy's block-column into
    ``sums[SUM_PHASES split .., column features]`` (fp32, a row for each phase of the rows), from
    the stages its copies bring (`hopper.make_split`): the bias gradient with no read of dy of its
    own. Otherwise ``sums`` and ``summing`` are unread."""
    paired, stacked = kind == PAIRED, kind == STACKED
    BM, BN, GROUPS, TILES, BK, _ = v7_shape(cfg, bs, kind)
    STACK = BM // bs  # blocks down a tile
    WIDE = BN // bs  # blocks across a tile
    ACC_ALL = TILES * (BN // 2)
    MN = feature_axis == 1
    to_acc, _ = converters(out_storage or storage, acc_type)  # (dW's own dtype)
    from_acc = stored_of(out_storage or storage, acc_type)

    @inlined
    def keep_flags(keep, rows, cols, n0, n_end):
        for i in range(len(keep)):
            keep[i] = (n0 + (rows[i] if MN else cols[i])) < n_end

    @inlined
    def sources(s, where, a_keep, b_keep):
        """Global addresses of stage s's first chunks (rows n0 = n_begin + s BK... of x and dy),
        and the keep flags of its chunks."""
        n_begin, n_end, x_base, dy_base, x_lead, dy_lead, a_row, a_col, b_row, b_col = where
        n0 = n_begin + s * BK
        keep_flags(a_keep, a_row, a_col, n0, n_end)
        keep_flags(b_keep, b_row, b_col, n0, n_end)
        x_stage = 2 * (int64(n0) * x_lead if MN else int64(n0))
        dy_stage = 2 * (int64(n0) * dy_lead if MN else int64(n0))
        return x_base + x_stage, dy_base + dy_stage

    @inlined
    def stage_sources(s, where):
        """Global addresses of stage s's first chunks (rows n0 = n_begin + s BK... of x and dy)."""
        n_begin, x_base, dy_base, x_lead, dy_lead = where[0], where[2], where[3], where[4], where[5]
        n0 = n_begin + s * BK
        x_stage = 2 * (int64(n0) * x_lead if MN else int64(n0))
        dy_stage = 2 * (int64(n0) * dy_lead if MN else int64(n0))
        return x_base + x_stage, dy_base + dy_stage

    @inlined
    def a_offset(block, coords, row, col, x_lead):
        """A chunk's byte offset from x's stage address: a stacked tile's feature (row of A)
        ``m`` is feature m % bs of block m // bs's block-row."""
        if stacked:
            m = col if MN else row
            feature = coords[block, 1 + m // bs] * bs + m % bs
            return 2 * (int64(row) * x_lead + feature) if MN else 2 * (int64(feature) * x_lead + col)
        return 2 * (int64(row) * x_lead + col)

    @inlined
    def a_chunk(row, col, s, where):
        """A chunk's offset from its stage's address (`a_offset`, from ``where``'s block and
        coords), and whether its row of N is before the end."""
        n0 = where[0] + s * BK
        return a_offset(where[8], where[9], row, col, where[4]), n0 + (row if MN else col) < where[1]

    @inlined
    def b_offset(block, coords, row, col, dy_lead):
        """A chunk's byte offset from dy's stage address: a paired tile's columns j bs on are its
        block j's."""
        if paired:
            if MN:
                k = coords[block, 1 + col // bs] * bs + col % bs
                return 2 * (int64(row) * dy_lead + k)
            k = coords[block, 1 + row // bs] * bs + row % bs
            return 2 * (int64(k) * dy_lead + col)
        return 2 * (int64(row) * dy_lead + col)

    @inlined
    def b_chunk(row, col, s, where):
        n0 = where[0] + s * BK
        return b_offset(where[8], where[9], row, col, where[5]), n0 + (row if MN else col) < where[1]

    @inlined
    def boxes(s, where):
        """Stage s's first boxes (`tma_maps`): x's and dy's at their block's first feature
        (``where[6]``, ``where[7]``) and row n0 of N."""
        n0 = int32(where[0] + s * BK)
        if MN:
            return int32(where[6]), n0, int32(where[7]), n0
        return n0, int32(where[6]), n0, int32(where[7])

    @inlined
    def pair_boxes(g, s, where, inner, outer):
        """A paired tile's box g of dy (`hopper.make_split`'s ``b_box``): 64 columns of its
        block (64 g) // bs at row n0 (feature_axis 1), or block g's rows (0)."""
        coords, block = where[9], where[8]
        if MN:
            return int32(coords[block, 1 + (64 * g) // bs] * bs + (64 * g) % bs), outer
        return inner, int32(coords[block, 1 + g] * bs)

    if column_sums:

        @inlined
        def column_task(summing, block):
            """Whether this block sums dy's block-column (`hopper.make_split`'s ``where[10]``)."""
            return summing[block]
    else:

        @inlined
        def column_task(summing, block):
            return int32(0)

    SPLIT = producing(cfg, kind, bs)
    THREADS = v7_threads(cfg, bs, kind)
    copy_plan, make_ring, descriptors, (A_PER, B_PER), make_split = make_hopper_loop(cfg, bs, storage, kind, MN, MN)
    ring = make_ring(sources)
    stage, chunk, OUT_PER, PITCH = make_staging(cfg, bs, kind, False, THREADS)
    bulk = SPLIT and cfg.v7_tma and (kind is True or paired)  # (a stacked tile's blocks of x are not boxes)
    init, produce, consume, specialized = make_split(stage_sources, a_chunk, b_chunk, stage,
                                                     boxes if bulk else None, column_sums,
                                                     *((pair_boxes,) if paired else ()))

    @jit_for(cfg, bs, GROUPS, kind)
    def weight_grad_v7(dw, workspace, x, dy, coords, n_rows, rows_per_split, beta, sums, summing, x_map, dy_map):
        tid = cuda.threadIdx.x
        group, thread = tid // WARPGROUP, tid % WARPGROUP
        warp, lane = thread // 32, thread % 32
        block = cuda.blockIdx.x
        split = cuda.blockIdx.y
        n_begin = split * rows_per_split
        n_end = min(n_begin + rows_per_split, n_rows)
        n_stages = max(0, (n_end - n_begin + BK - 1) // BK)
        x_lead, dy_lead = int64(x.shape[1]), int64(dy.shape[1])
        smem = cuda.shared.array(0, int32)
        base = align_up(shared_address(smem, (0,)), ATOM)
        if paired:  # dy's two column-blocks: each chunk's offset holds its block's first feature
            x_base = signed_address(x, (0, coords[block, 0] * bs) if MN else (coords[block, 0] * bs, 0))
            dy_base = signed_address(dy, (0, 0))
        elif stacked:  # x's blocks: each chunk's offset holds its block's first feature
            x_base = signed_address(x, (0, 0))
            dy_base = signed_address(dy, (0, coords[block, 0] * bs) if MN else (coords[block, 0] * bs, 0))
        elif MN:  # x (N, C), dy (N, K): a stored row is a row of N (k)
            x_base = signed_address(x, (0, coords[block, 0] * bs))
            dy_base = signed_address(dy, (0, coords[block, 1] * bs))
        else:  # x (C, N), dy (K, N): a stored row is a feature, N runs along it
            x_base = signed_address(x, (coords[block, 0] * bs, 0))
            dy_base = signed_address(dy, (coords[block, 1] * bs, 0))
        if SPLIT:
            x_at, dy_at = signed_address(x, (0, 0)), signed_address(dy, (0, 0))
            maps = (global_address(x_map, (0,)), x_at, global_address(dy_map, (0,)), dy_at)
            where = (n_begin, n_end, x_base, dy_base, x_lead, dy_lead, coords[block, 0] * bs, coords[block, 1] * bs,
                     block, coords, column_task(summing, block), sums, split)
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
                a_from[i] = a_offset(block, coords, a_row[i], a_col[i], x_lead)
            for i in range(B_PER):
                b_from[i] = b_offset(block, coords, b_row[i], b_col[i], dy_lead)
            desc_a, desc_b = descriptors(base, group)
            acc = cuda.local.array(ACC_ALL, float32)
            for i in range(ACC_ALL):
                acc[i] = float32(0)

            ring(acc, base, tid, n_stages,
                 (n_begin, n_end, x_base, dy_base, x_lead, dy_lead, a_row, a_col, b_row, b_col),
                 a_from, a_to, b_from, b_to, a_keep, b_keep, desc_a, desc_b)

            cuda.syncthreads()  # every warpgroup's wgmmas have read the ring
            staged = cuda.shared.array(0, float32)
            stage(acc, staged, group * TILES * WGMMA_M + 16 * warp + lane // 4, 2 * (lane % 4))
            cuda.syncthreads()
        staged = cuda.shared.array(0, float32)
        for i in range(OUT_PER):
            r, c = chunk(tid, i)
            out, rr, cc = block, r, c
            if paired:  # (the tile's columns j bs on are block j's)
                out = coords[block, 1 + WIDE + c // bs]
                cc = c % bs
            elif stacked and r >= 0:  # (its rows bs at a time are its blocks')
                out = coords[block, 1 + STACK + r // bs]
                rr = r % bs
            if r >= 0 and out >= 0:
                v = load4(staged, (r * PITCH + c,))
                if workspace.shape[0] > 1:  # this N-split's sums, which the combine kernel adds in order
                    store4(workspace, (split, out, rr * bs + cc), v)
                else:
                    v0, v1, v2, v3 = v
                    if beta != 0:
                        b = acc_type(beta)
                        o0, o1, o2, o3 = load4(dw, (out, rr, cc))
                        v0 += b * to_acc(o0)
                        v1 += b * to_acc(o1)
                        v2 += b * to_acc(o2)
                        v3 += b * to_acc(o3)
                    store4(dw, (out, rr, cc), (from_acc(v0), from_acc(v1), from_acc(v2), from_acc(v3)))

    return dynamic_shared(weight_grad_v7, shared_bytes(cfg, bs, kind))
