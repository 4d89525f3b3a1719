"""Block-sparse weight matmul on the GPU (twin of `reference/bsmm.py`).

Over a `BlockLayout` of ``(C/bs, K/bs)`` blocks with weights ``w[n_blocks, bs, bs]``:

* ``forward``:     ``y  = x · W``     (N, C) -> (N, K), over the layout's columns (CSC);
* ``input_grad``:  ``dx = dy · Wᵀ``   (N, K) -> (N, C), over its rows (CSR), reading
  each block transposed in shared memory (no transposed copy of ``w``);
* ``weight_grad``: ``dW = xᵀ · dy``   -> (n_blocks, bs, bs), the layout's blocks only.

``feature_axis=0`` activations ``(features, N)`` are indexed with swapped
axes by a compile-time flag (a transposed Numba device array would be a copy). Storage float16,
float32 or float64; float16 accumulates in float32. Any ``N >= 0``; output
features with no block are zero.

Versions:
  1. shared-memory tiles, one output element per thread (this file). Correct
     and simple: the baseline later versions are checked against.
"""

import numpy as np
from numba import cuda, float32, float64

from .._arrays import Operand, check_float, check_same_kind, check_shape, launch_stream

# One thread per output element of a tile of ROWS_PER_TILE[bs] rows x bs
# features, at most 256 threads a block.
ROWS_PER_TILE = {8: 16, 16: 16, 32: 8, 64: 4}
# Weight-gradient blocks: bs columns x WGRAD_ROWS[bs] threads; each thread
# owns bs / WGRAD_ROWS[bs] rows of the block.
WGRAD_ROWS = {8: 8, 16: 16, 32: 8, 64: 4}

# -- device helpers -----------------------------------------------------------


def _make_accessors(feature_axis):
    """load(a, row, feature) and store(a, row, feature, value) for activations of either axis."""
    if feature_axis == 1:

        @cuda.jit(device=True, inline=True)
        def load(a, row, feature):
            return a[row, feature]

        @cuda.jit(device=True, inline=True)
        def store(a, row, feature, value):
            a[row, feature] = value
    else:

        @cuda.jit(device=True, inline=True)
        def load(a, row, feature):
            return a[feature, row]

        @cuda.jit(device=True, inline=True)
        def store(a, row, feature, value):
            a[feature, row] = value

    return load, store


# -- kernel bodies ---------------------------------------------------------


def _make_product_kernel(bs, rows, acc_type, transpose_w, feature_axis):
    """out[:, f-block] = sum over the blocks j of f's line: a[:, g-block] · w[b] (or w[b]ᵀ)."""
    load, store = _make_accessors(feature_axis)

    @cuda.jit
    def product_kernel(out, a, w, line_ptr, other_idx, line_block, n_rows):
        tx = cuda.threadIdx.x
        ty = cuda.threadIdx.y
        line = cuda.blockIdx.y
        row = cuda.blockIdx.x * rows + ty
        a_tile = cuda.shared.array((rows, bs), acc_type)
        w_tile = cuda.shared.array((bs, bs), acc_type)
        acc = acc_type(0)
        for j in range(line_ptr[line], line_ptr[line + 1]):
            other = other_idx[j]
            block = j if transpose_w else line_block[j]
            a_tile[ty, tx] = acc_type(load(a, row, other * bs + tx)) if row < n_rows else acc_type(0)
            for e in range(ty * bs + tx, bs * bs, rows * bs):
                r = e // bs
                c = e - r * bs
                if transpose_w:
                    w_tile[c, r] = acc_type(w[block, r, c])
                else:
                    w_tile[r, c] = acc_type(w[block, r, c])
            cuda.syncthreads()  # a_tile and w_tile are loaded
            for i in range(bs):
                acc += a_tile[ty, i] * w_tile[i, tx]
            cuda.syncthreads()  # every thread is done reading before the next load
        if row < n_rows:
            store(out, row, line * bs + tx, acc)

    return product_kernel


def _make_weight_grad_kernel(bs, rows, acc_type, feature_axis):
    """dw[b] = x[:, c-block]ᵀ · dy[:, k-block], reducing over all N rows."""
    per_thread = bs // rows
    load, _ = _make_accessors(feature_axis)

    @cuda.jit
    def weight_grad_kernel(dw, x, dy, coords, n_rows):
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
            x_tile[ty, tx] = acc_type(load(x, n, c * bs + tx)) if n < n_rows else acc_type(0)
            dy_tile[ty, tx] = acc_type(load(dy, n, k * bs + tx)) if n < n_rows else acc_type(0)
            cuda.syncthreads()  # both tiles are loaded
            for r in range(rows):
                d = dy_tile[r, tx]
                for m in range(per_thread):
                    acc[m] += x_tile[r, ty + m * rows] * d
            cuda.syncthreads()  # every thread is done reading before the next load
        for m in range(per_thread):
            dw[block, ty + m * rows, tx] = acc[m]

    return weight_grad_kernel


# -- launch configuration ----------------------------------------------------

_kernels = {}


def _acc_type(dtype):
    return float64 if dtype == np.float64 else float32


def _product_kernel(bs, dtype, transpose_w, feature_axis):
    key = ("product", bs, dtype, transpose_w, feature_axis)
    if key not in _kernels:
        _kernels[key] = _make_product_kernel(bs, ROWS_PER_TILE[bs], _acc_type(dtype), transpose_w, feature_axis)
    return _kernels[key]


def _weight_grad_kernel(bs, dtype, feature_axis):
    key = ("weight_grad", bs, dtype, feature_axis)
    if key not in _kernels:
        _kernels[key] = _make_weight_grad_kernel(bs, WGRAD_ROWS[bs], _acc_type(dtype), feature_axis)
    return _kernels[key]


def _index(layout, name, stream):
    """Layout index arrays on the device, cached per layout."""
    cache = _device_indices.setdefault(layout, {})
    if name not in cache:
        cache[name] = cuda.to_device(getattr(layout, name), stream=stream)
    return cache[name]


_device_indices = {}

# -- public functions ---------------------------------------------------------


def _check_activation(op, features, feature_axis, what):
    if len(op.shape) != 2:
        raise ValueError(f"{op.name}: expected a 2-D array {what}, got shape {op.shape}")
    if op.shape[feature_axis] != features:
        raise ValueError(
            f"{op.name}: expected {features} features on axis {feature_axis} {what}, got shape {op.shape}"
        )
    return op.shape[1 - feature_axis]


def _check_common(ops, layout, feature_axis):
    if feature_axis not in (0, 1):
        raise ValueError(f"feature_axis: expected 0 or 1, got {feature_axis!r}")
    check_same_kind(ops)
    for op in ops:
        check_float(op)
        op.require_contiguous()
    if len({op.dtype for op in ops}) > 1:
        raise TypeError("dtype mismatch: " + ", ".join(f"{op.name} {op.dtype}" for op in ops))


def _product(a, w, layout, feature_axis, transpose_w):
    a_name = "dy" if transpose_w else "x"
    a, w = Operand(a, a_name), Operand(w, "w")
    _check_common((a, w), layout, feature_axis)
    check_shape(w, layout.w_shape)
    C, K = layout.dense_shape
    in_features, out_features = (K, C) if transpose_w else (C, K)
    layout_desc = f"(layout has {C} inputs, {K} outputs)"
    n_rows = _check_activation(a, in_features, feature_axis, layout_desc)

    stream = launch_stream((a, w))
    shape = (n_rows, out_features) if feature_axis == 1 else (out_features, n_rows)
    native, out = a.empty(shape, stream=stream)
    if n_rows == 0:
        return a.result(native, out, stream)
    bs = layout.block_size
    rows = ROWS_PER_TILE[bs]
    if transpose_w:
        line_ptr, other_idx, line_block = "row_ptr", "col_idx", "col_idx"
    else:
        line_ptr, other_idx, line_block = "col_ptr", "row_idx", "col_block"
    kernel = _product_kernel(bs, a.dtype, transpose_w, feature_axis)
    grid = ((n_rows + rows - 1) // rows, out_features // bs)
    kernel[grid, (bs, rows), stream](
        out, a.device(stream), w.device(stream),
        _index(layout, line_ptr, stream), _index(layout, other_idx, stream),
        _index(layout, line_block, stream), n_rows,
    )
    return a.result(native, out, stream)


def forward(x, w, layout, feature_axis=1):
    """``y = x · W`` for block-sparse ``W`` given as ``w[n_blocks, bs, bs]`` over ``layout``."""
    return _product(x, w, layout, feature_axis, transpose_w=False)


def input_grad(dy, w, layout, feature_axis=1):
    """``dx = dy · Wᵀ`` for block-sparse ``W``."""
    return _product(dy, w, layout, feature_axis, transpose_w=True)


def weight_grad(x, dy, layout, feature_axis=1):
    """``dW = xᵀ · dy`` on the layout's blocks, as ``(n_blocks, bs, bs)``."""
    x, dy = Operand(x, "x"), Operand(dy, "dy")
    _check_common((x, dy), layout, feature_axis)
    C, K = layout.dense_shape
    n_x = _check_activation(x, C, feature_axis, f"(layout has {C} inputs)")
    n_dy = _check_activation(dy, K, feature_axis, f"(layout has {K} outputs)")
    if n_x != n_dy:
        raise ValueError(f"x and dy: expected the same N, got {n_x} and {n_dy}")

    stream = launch_stream((x, dy))
    native, dw = x.empty(layout.w_shape, stream=stream)
    if layout.n_blocks == 0:
        return x.result(native, dw, stream)
    bs = layout.block_size
    kernel = _weight_grad_kernel(bs, x.dtype, feature_axis)
    kernel[layout.n_blocks, (bs, WGRAD_ROWS[bs]), stream](
        dw, x.device(stream), dy.device(stream),
        _index(layout, "coords", stream), n_x,
    )
    return x.result(native, dw, stream)
