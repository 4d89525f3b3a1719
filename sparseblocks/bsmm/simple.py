"""The teaching kernels (version 1): one output element per thread, shared-memory tiles.

``product``: a thread block owns ``rows_per_tile[bs]`` rows x one block of output
features and walks its block-line (a column of W's blocks for the forward, a
row for ``input_grad``), loading a tile of activations and one block of W into
shared memory per step. ``weight_grad``: a thread block owns one block of dW and
walks all N rows. Read these first: every faster family computes the same sums
(`sparseblocks.reference.bsmm` is their NumPy twin).
"""

from numba import cuda

from .device import activation_io, converters


def make_product_v1(cfg, bs, storage, acc_type, transpose_w, feature_axis):
    """out[:, line-block] = sum over the line's blocks: a[:, other-block] · w[b] (or w[b]ᵀ)."""
    ROWS_PER_TILE = cfg.rows_per_tile
    rows = ROWS_PER_TILE[bs]
    KC = min(bs, 32)  # rows of W's block (k) in shared memory at a time
    load, store = activation_io(feature_axis)
    to_acc, from_acc = converters(storage, acc_type)

    @cuda.jit
    def product_v1(out, a, w, line_ptr, other_idx, line_block, n_rows):
        tx = cuda.threadIdx.x
        ty = cuda.threadIdx.y
        line = cuda.blockIdx.y
        row = cuda.blockIdx.x * rows + ty
        a_tile = cuda.shared.array((rows, bs), acc_type)
        w_tile = cuda.shared.array((KC, bs), acc_type)
        acc = acc_type(0)
        for j in range(line_ptr[line], line_ptr[line + 1]):
            other = other_idx[j]
            block = j if transpose_w else line_block[j]
            a_tile[ty, tx] = to_acc(load(a, row, other * bs + tx)) if row < n_rows else acc_type(0)
            for k0 in range(0, bs, KC):
                # k rows k0..k0 + KC - 1 of the block (of Wᵀ: a column strip of the stored block),
                # read in storage order
                for e in range(ty * bs + tx, KC * bs, rows * bs):
                    if transpose_w:
                        c, r = e // KC, e % KC
                        w_tile[r, c] = to_acc(w[block, c, k0 + r])
                    else:
                        r, c = e // bs, e % bs
                        w_tile[r, c] = to_acc(w[block, k0 + r, c])
                cuda.syncthreads()  # a_tile and this strip of w_tile are loaded
                for i in range(KC):
                    acc += a_tile[ty, k0 + i] * w_tile[i, tx]
                cuda.syncthreads()  # every thread is done reading before the next load
        if row < n_rows:
            store(out, row, line * bs + tx, from_acc(acc))

    return product_v1


def make_weight_grad_v1(cfg, bs, storage, acc_type, feature_axis, out_storage=None):
    """dw[b] = x[:, c-block]ᵀ · dy[:, k-block] (+ beta·dw[b]), reducing over all N rows."""
    WGRAD_ROWS = cfg.wgrad_rows
    rows = WGRAD_ROWS[bs]
    per_thread = bs // rows
    load, _ = activation_io(feature_axis)
    to_acc, _ = converters(storage, acc_type)
    dw_in, from_acc = converters(out_storage or storage, acc_type)  # (dW's own dtype)

    @cuda.jit
    def weight_grad_v1(dw, x, dy, coords, n_rows, beta):
        tx = cuda.threadIdx.x
        ty = cuda.threadIdx.y
        block = cuda.blockIdx.x
        c = coords[block, 0]
        k = coords[block, 1]
        x_tile = cuda.shared.array((rows, bs), acc_type)
        dy_tile = cuda.shared.array((rows, bs), acc_type)
        acc = cuda.local.array(per_thread, acc_type)
        for m in range(per_thread):
            acc[m] = acc_type(0)
        for n0 in range(0, n_rows, rows):
            n = n0 + ty
            x_tile[ty, tx] = to_acc(load(x, n, c * bs + tx)) if n < n_rows else acc_type(0)
            dy_tile[ty, tx] = to_acc(load(dy, n, k * bs + tx)) if n < n_rows else acc_type(0)
            cuda.syncthreads()  # both tiles are loaded
            for r in range(rows):
                d = dy_tile[r, tx]
                for m in range(per_thread):
                    acc[m] += x_tile[r, ty + m * rows] * d
            cuda.syncthreads()  # every thread is done reading before the next load
        for m in range(per_thread):
            value = acc[m]
            if beta != 0:
                value += acc_type(beta) * dw_in(dw[block, ty + m * rows, tx])
            dw[block, ty + m * rows, tx] = from_acc(value)

    return weight_grad_v1
