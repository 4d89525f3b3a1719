"""SIMT weight gradients: ``dW[b] = x[:, c-block]ᵀ · dy[:, k-block]`` (+ ``beta·dW[b]``).

Version 3: groups of threads each own a P x P patch of a block and take
interleaved rows of N, two rows of x and dy in flight per thread, branch-free;
the groups' sums are added in a fixed order. Version 4 (feature_axis 1, blocks
16-64): sub-groups of threads own one block each, a thread an 8 x 8 patch
read 16 bytes at a time. With several N-splits each split writes a workspace
slot and `make_combine_wgrad` adds them in order.
"""

from numba import cuda, uint64

from .device import (
    SHARED_ALIGN,
    STATIC_SHARED,
    activation_io,
    activation_vector_load,
    add_outer_8x8,
    chunk_position,
    converters,
    fitted,
    weight_grad_output,
)


def make_weight_grad_v3(cfg, bs, storage, acc_type, feature_axis, out_storage=None):
    """dw[b] (+ beta·dw[b]) over this thread block's share of N; splits go to a workspace."""
    WGRAD_CHUNK = cfg.wgrad_chunk
    WGRAD_PATCH = cfg.wgrad_patch
    WGRAD_THREADS = cfg.wgrad_threads
    P = WGRAD_PATCH[bs]
    PX = bs // P  # threads across the block's columns (and rows) within a group
    GT = PX * PX  # threads per group
    T = WGRAD_THREADS
    G = T // GT  # groups, each taking every G-th row of a chunk
    RED = G * bs * bs if G > 1 else 1
    SIZE = acc_type.bitwidth // 8
    NC = fitted(WGRAD_CHUNK, 2 * (bs + 1) * SIZE, STATIC_SHARED - RED * SIZE)  # (rows of both tiles)
    TILE_SHAPE = (NC, bs + 1)  # +1 column against bank conflicts of the transposed stores
    load, _ = activation_io(feature_axis)
    to_acc, from_acc = converters(storage, acc_type)

    position = chunk_position(feature_axis, NC, bs)

    finish = weight_grad_output(bs, out_storage or storage, acc_type)

    @cuda.jit
    def weight_grad_v3(dw, workspace, x, dy, coords, n_rows, rows_per_split, beta):
        tid = cuda.threadIdx.x
        g = tid // GT
        gtid = tid - g * GT
        gx = gtid % PX
        gy = gtid // PX
        block = cuda.blockIdx.x
        split = cuda.blockIdx.y
        c = coords[block, 0]
        k = coords[block, 1]
        n_begin = split * rows_per_split
        n_end = min(n_rows, n_begin + rows_per_split)
        x_s = cuda.shared.array(TILE_SHAPE, acc_type)
        dy_s = cuda.shared.array(TILE_SHAPE, acc_type)
        reduce_s = cuda.shared.array(RED, acc_type)
        acc = cuda.local.array((P, P), acc_type)
        x_frag = cuda.local.array(P, acc_type)
        dy_frag = cuda.local.array(P, acc_type)
        for i in range(P):
            for q in range(P):
                acc[i, q] = acc_type(0)
        for n0 in range(n_begin, n_end, NC):
            last = n_end - 1
            for e0 in range(tid, NC * bs, 2 * T):
                r0, f0 = position(e0)
                r1, f1 = position(e0 + T)
                # Rows past the end read the last row (a valid address) and are zeroed.
                x0 = to_acc(load(x, min(n0 + r0, last), c * bs + f0))
                d0 = to_acc(load(dy, min(n0 + r0, last), k * bs + f0))
                x1 = to_acc(load(x, min(n0 + r1, last), c * bs + f1))
                d1 = to_acc(load(dy, min(n0 + r1, last), k * bs + f1))
                x_s[r0, f0] = x0 if n0 + r0 <= last else acc_type(0)
                dy_s[r0, f0] = d0 if n0 + r0 <= last else acc_type(0)
                x_s[r1, f1] = x1 if n0 + r1 <= last else acc_type(0)
                dy_s[r1, f1] = d1 if n0 + r1 <= last else acc_type(0)
            cuda.syncthreads()  # x_s and dy_s hold this chunk of rows
            for rr in range(NC // G):
                r = rr * G + g
                for i in range(P):
                    x_frag[i] = x_s[r, gy * P + i]
                for q in range(P):
                    dy_frag[q] = dy_s[r, gx * P + q]
                for i in range(P):
                    for q in range(P):
                        acc[i, q] += x_frag[i] * dy_frag[q]
            cuda.syncthreads()  # everyone is done with this chunk before it is overwritten
        if G > 1:
            for i in range(P):
                for q in range(P):
                    reduce_s[g * bs * bs + (gy * P + i) * bs + gx * P + q] = acc[i, q]
            cuda.syncthreads()  # every group's partial block is in reduce_s
            for e0 in range(0, bs * bs, T):
                e = e0 + tid
                if e < bs * bs:
                    total = acc_type(0)
                    for group in range(G):
                        total += reduce_s[group * bs * bs + e]
                    finish(dw, workspace, block, split, e // bs, e % bs, total, beta)
        else:
            for i in range(P):
                for q in range(P):
                    finish(dw, workspace, block, split, gy * P + i, gx * P + q, acc[i, q], beta)

    return weight_grad_v3


def make_weight_grad_v4(cfg, bs, storage, acc_type, feature_axis, vector=False, out_storage=None):
    """dw[b] (+ beta·dw[b]) with an 8 x 8 patch per thread and 16-byte shared reads (feature_axis 1).

    A thread block holds S sub-groups, each computing one block of W over this
    thread block's slice of N: per row of a chunk, a thread reads 8 values of
    x and 8 of dy (four 16-byte shared loads) for 64 multiply-adds. Each
    sub-group's tiles start 16 floats past a multiple of 32, so the two
    sub-groups of a warp (block 32) read distinct banks. With ``vector`` (the
    launcher checked alignment) x and dy are read 4 values at a time.
    """
    V4_OPTIONS = cfg.v4_jit_options
    V4_WGRAD_BATCH = cfg.v4_wgrad_batch
    V4_WGRAD_ROWS = cfg.v4_wgrad_rows
    V4_WGRAD_THREADS = cfg.v4_wgrad_threads
    V4_WIDTH = cfg.v4_width
    GT = (bs // 8) ** 2  # threads per sub-group
    T = V4_WGRAD_THREADS
    S = T // GT
    NC = V4_WGRAD_ROWS[bs]
    GX = bs // 8
    HALF = bs // 2
    TILE = NC * bs
    SUB = 2 * TILE + 16  # one sub-group's x and dy tiles (+16: the next one's banks are shifted)
    SIZE = S * SUB
    V = V4_WIDTH if vector else 1  # values per load
    LOADS = TILE // GT // V  # of x, and as many of dy, per thread and chunk
    BATCH = min(LOADS, V4_WGRAD_BATCH // V)  # loads of each in flight before their stores (divides LOADS)
    IN_FLIGHT = BATCH * V
    load = activation_vector_load(feature_axis, V)
    to_acc, _ = converters(storage, acc_type)
    dw_in, from_acc = converters(out_storage or storage, acc_type)  # (dW's own dtype)

    @cuda.jit(**V4_OPTIONS)
    def weight_grad_v4(dw, workspace, x, dy, coords, n_rows, rows_per_split, beta):
        tid = cuda.threadIdx.x
        g = tid // GT
        t = tid - g * GT
        gx = t % GX
        gy = t // GX
        n_blocks = dw.shape[0]
        block = cuda.blockIdx.x * S + g
        bc = min(block, n_blocks - 1)  # idle sub-groups past the last block read a valid one
        c0 = coords[bc, 0] * bs
        k0 = coords[bc, 1] * bs
        split = cuda.blockIdx.y
        n_begin = split * rows_per_split
        n_end = min(n_rows, n_begin + rows_per_split)
        last = n_end - 1
        tiles = cuda.shared.array(SIZE, acc_type, alignment=SHARED_ALIGN)
        acc = cuda.local.array((8, 8), acc_type)
        fx = cuda.local.array(8, acc_type)
        fd = cuda.local.array(8, acc_type)
        vx = cuda.local.array(IN_FLIGHT, acc_type)
        vd = cuda.local.array(IN_FLIGHT, acc_type)
        for i in range(8):
            for q in range(8):
                acc[i, q] = acc_type(0)
        base = g * SUB
        for n0 in range(n_begin, n_end, NC):
            for i0 in range(0, LOADS, BATCH):  # BATCH loads of x and of dy in flight, then their stores
                for u in range(BATCH):
                    e = (t + (i0 + u) * GT) * V  # element of the chunk: rows of bs values
                    row = n0 + e // bs
                    r = uint64(min(row, last))
                    xs = load(x, r, uint64(c0 + e % bs))
                    ds = load(dy, r, uint64(k0 + e % bs))
                    for c in range(V):  # rows past the slice are zero
                        vx[u * V + c] = to_acc(xs[c]) if row <= last else acc_type(0)
                        vd[u * V + c] = to_acc(ds[c]) if row <= last else acc_type(0)
                for u in range(BATCH):
                    e = (t + (i0 + u) * GT) * V
                    for c in range(V):
                        tiles[uint64(base + e + c)] = vx[u * V + c]
                        tiles[uint64(base + TILE + e + c)] = vd[u * V + c]
            cuda.syncthreads()  # every sub-group's x and dy tiles hold this chunk
            for rr in range(NC):
                # Offsets as (quad index) * 4, unsigned: the compiler merges each four loads.
                ox = uint64((base + rr * bs) // 4 + gy) * uint64(4)
                od = uint64((base + TILE + rr * bs) // 4 + gx) * uint64(4)
                for i in range(4):
                    fx[i] = tiles[ox + uint64(i)]
                    fx[4 + i] = tiles[ox + uint64(HALF + i)]
                    fd[i] = tiles[od + uint64(i)]
                    fd[4 + i] = tiles[od + uint64(HALF + i)]
                add_outer_8x8(acc, fx, fd)
            cuda.syncthreads()  # every thread is done with this chunk before it is overwritten
        # Through shared memory (the chunk tiles, free now, hold one block per
        # sub-group), so that acc is only indexed by unrolled loops: the
        # epilogue's branches would otherwise keep it out of registers.
        for i in range(8):
            for q in range(8):
                r = gy * 4 + (i % 4) + (i // 4) * HALF
                tiles[uint64(base + r * bs + gx * 4 + (q % 4) + (q // 4) * HALF)] = acc[i, q]
        cuda.syncthreads()  # each sub-group's block is in its tiles
        if block < n_blocks:
            for e in range(t, bs * bs, GT):
                total = tiles[uint64(base + e)]
                if workspace.shape[0] > 1:
                    workspace[split, block, e] = total
                else:
                    r = e // bs
                    col = e - r * bs
                    if beta != 0:
                        total += acc_type(beta) * dw_in(dw[block, r, col])
                    dw[block, r, col] = from_acc(total)

    return weight_grad_v4


def make_combine_wgrad(cfg, bs, storage, acc_type, out_storage=None):
    """dw = sum of the N-splits of the workspace, in order (+ beta·dw)."""
    COMBINE_THREADS = cfg.combine_threads
    to_acc, from_acc = converters(out_storage or storage, acc_type)  # (dW's own dtype)

    @cuda.jit
    def combine_wgrad(dw, workspace, beta):
        block = cuda.blockIdx.y
        e = cuda.blockIdx.x * COMBINE_THREADS + cuda.threadIdx.x
        if e < bs * bs:
            total = acc_type(0)
            for split in range(workspace.shape[0]):
                total += workspace[split, block, e]
            r = e // bs
            col = e - r * bs
            if beta != 0:
                total += acc_type(beta) * to_acc(dw[block, r, col])
            dw[block, r, col] = from_acc(total)

    return combine_wgrad
