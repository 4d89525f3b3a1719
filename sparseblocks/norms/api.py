"""The normalizations' public functions: validation, outputs, launches."""

from typing import Any, Optional, Tuple

import numpy as np

from ..runtime.arrays import Array, Operand, check_same_kind, checked_operands, launch_stream
from ..runtime.compile import cached
from ..runtime.devices import on_arrays_device
from ..ptx.vector import fours_fit
from ..runtime.launch import launch
from .config import NormsConfig, as_config
from .batch import make_batch_norm
from . import columns, layer, strips
from .columns import column_launch
from .layer import finish_launch, make_param_grads, make_zeros, param_grid, row_shape

DTYPES = ("float16", "bfloat16", "float32", "float64")


def _acc(dtype):
    return "float64" if dtype == "float64" else "float32"


def _epsilon(epsilon):
    try:
        if isinstance(epsilon, (str, bytes)):
            raise TypeError
        epsilon = float(epsilon)
    except (TypeError, ValueError):
        raise TypeError(f"epsilon: expected a number, got {epsilon!r}") from None
    if not epsilon >= 0:
        raise ValueError(f"epsilon: expected a number >= 0, got {epsilon}")
    return epsilon


def _operands(x, g, b, axis, epsilon, extra=()):
    """Checked operands (x, g, b, *extra) and the problem's (N, C)."""
    if axis not in (0, 1):
        raise ValueError(f"axis: expected 0 (x is (C, N)) or 1 (x is (N, C)), got {axis!r}")
    epsilon = _epsilon(epsilon)
    ops = checked_operands([("x", x), ("g", g), ("b", b), *extra], DTYPES, same_dtype=False)
    x_op, g_op, b_op = ops[:3]
    if len(x_op.shape) != 2:
        raise ValueError(f"x: expected a 2-D array ({'(N, C)' if axis == 1 else '(C, N)'}), got shape {x_op.shape}")
    C = x_op.shape[axis]
    if C < 1:
        raise ValueError(f"x: expected at least one feature on axis {axis}, got shape {x_op.shape}")
    for op in (g_op, b_op):
        if op.shape != (C,):
            raise ValueError(f"{op.name}: expected shape ({C},) (x's features on axis {axis}), got {op.shape}")
    if g_op.dtype != b_op.dtype:
        raise TypeError(f"dtype mismatch: g {g_op.dtype}, b {b_op.dtype}")
    return ops, x_op.shape[1 - axis], C, epsilon


@on_arrays_device
def layer_norm(x: Array, g: Array, b: Array, axis: int = 1, epsilon: float = 1e-6, relu: bool = False,
               config: Optional[NormsConfig] = None, stats: bool = False) -> Any:
    """OpenAI's ``layer_norm``: each row of features normalized to zero mean and unit variance,
    scaled by ``g`` and shifted by ``b`` (both (C,)), then ReLU'd with ``relu``.

    ``x`` is (N, C) with ``axis`` 1, (C, N) with 0 (the two activation layouts of `bsmm`);
    fp16, bf16, fp32 or fp64, and ``g``/``b`` of any of those (both one dtype). Returns y, in x's
    dtype and layout; with ``stats`` also the (N,) mean and rstd (fp32; fp64 for fp64 x) that the
    backward (`layer_norm_grad`) takes."""
    cfg = as_config(config)
    (x_op, g_op, b_op), N, C, epsilon = _operands(x, g, b, axis, epsilon)
    stream = launch_stream((x_op, g_op, b_op))
    native, y = x_op.empty(x_op.shape, stream)
    acc = _acc(x_op.dtype)
    mean_native, mean = x_op.empty((N,), stream, dtype=acc)
    rstd_native, rstd = x_op.empty((N,), stream, dtype=acc)
    if N:
        x_dev, g_dev, b_dev = x_op.device(stream), g_op.device(stream), b_op.device(stream)
        vector = _vector(x_op.shape[1], y, x_dev, g_dev, b_dev, mean, rstd)  # (axis 0 reads the stats by 4s)
        key = (cfg, x_op.dtype, g_op.dtype, _numba(acc), bool(relu), vector)
        strip = strips.strip_width(cfg, C, N, x_op.dtype, (x_dev, y)) if axis == 0 else 0  # (axis 0 in one pass)
        if axis == 1:
            shape = row_shape(cfg, C)
            launch(cached(layer.make_forward, *key, shape), -(-N // shape[2]), (shape[0], shape[2]), stream,
                   (y, mean, rstd, x_dev, g_dev, b_dev, epsilon))
        elif strip:
            launch(cached(strips.make_strip_forward, *key, C, strip), -(-N // strip), 32 * cfg.column_warps, stream,
                   (y, mean, rstd, x_dev, g_dev, b_dev, epsilon))
        else:
            sums, stats_kernel, apply = cached(columns.make_forward, *key)
            (grid, block), (stats_grid, stats_threads) = column_launch(cfg, C, N)
            work = x_op.scratch((grid[1], 2, N), acc, stream)
            launch(sums, grid, block, stream, (work, x_dev))
            launch(stats_kernel, stats_grid, stats_threads, stream, (mean, rstd, work, x_dev, epsilon))
            launch(apply, grid, block, stream, (y, x_dev, g_dev, b_dev, mean, rstd))
    out = x_op.result(native, y, stream)
    if not stats:
        return out
    return out, x_op.result(mean_native, mean, stream), x_op.result(rstd_native, rstd, stream)


@on_arrays_device
def layer_norm_grad(dy: Array, x: Array, g: Array, b: Array, mean: Array, rstd: Array, axis: int = 1,
                    relu: bool = False, config: Optional[NormsConfig] = None) -> Tuple[Array, Array, Array]:
    """(dx, dg, db) of `layer_norm` for the output gradient ``dy`` (x's shape and dtype), from the
    forward's ``mean`` and ``rstd`` (``stats=True``). dx in x's dtype, dg and db in g's."""
    cfg = as_config(config)
    ops, N, C, _ = _operands(x, g, b, axis, 0.0, (("dy", dy), ("mean", mean), ("rstd", rstd)))
    x_op, g_op, b_op, dy_op, mean_op, rstd_op = ops
    acc = _acc(x_op.dtype)
    if dy_op.shape != x_op.shape or dy_op.dtype != x_op.dtype:
        raise ValueError(f"dy: expected x's shape {x_op.shape} and dtype {x_op.dtype}, got {dy_op.shape} {dy_op.dtype}")
    for op in (mean_op, rstd_op):
        if op.shape != (N,) or op.dtype != acc:
            raise ValueError(f"{op.name}: expected ({N},) {acc} (the forward's stats=True), got {op.shape} {op.dtype}")
    stream = launch_stream(ops)
    dx_native, dx = x_op.empty(x_op.shape, stream)
    dg_native, dg = g_op.empty((C,), stream)
    db_native, db = g_op.empty((C,), stream)
    devices = [op.device(stream) for op in ops]
    x_dev, g_dev, b_dev, dy_dev, mean_dev, rstd_dev = devices
    (grid, block), (stats_grid, stats_threads) = column_launch(cfg, C, N)
    # (axis 0 in one pass where strips of x and dy fit shared memory)
    strip = strips.strip_width(cfg, C, N, x_op.dtype, (x_dev, dy_dev, dx), held=2) if axis == 0 else 0
    if axis == 0 and N and not strip:  # (the column sums and means, which the kernels read by 4s too)
        sum_work = x_op.scratch((grid[1], 2, N), acc, stream)
        column_means = x_op.scratch((2, N), acc, stream)
        devices += [sum_work, column_means]
    vector = _vector(x_op.shape[1], dx, *devices)
    key = (cfg, x_op.dtype, g_op.dtype, _numba(acc), bool(relu))
    partials, finish = cached(make_param_grads, *key, vector if axis == 1 else False)
    shape = row_shape(cfg, C)
    if axis == 1:
        if N:
            launch(cached(layer.make_backward, *key, vector, shape), -(-N // shape[2]),
                   (shape[0], shape[2]), stream, (dx, dy_dev, x_dev, g_dev, b_dev, mean_dev, rstd_dev))
        grid = param_grid(cfg, C, N)
        work = x_op.scratch((grid[1], 2, C), acc, stream)
        launch(partials, grid, cfg.row_threads, stream, (work, dy_dev, x_dev, g_dev, b_dev, mean_dev, rstd_dev))
    elif strip:
        work = x_op.scratch((-(-N // strip), 2, C), acc, stream)
        launch(cached(strips.make_strip_backward, *key, vector, C, strip), -(-N // strip), 32 * cfg.column_warps,
               stream, (dx, work, dy_dev, x_dev, g_dev, b_dev, mean_dev, rstd_dev))
    else:
        sums, means, apply = cached(columns.make_backward, *key, vector)
        if N:
            work = x_op.scratch((grid[0], 2, C), acc, stream)
            launch(sums, grid, block, stream, (sum_work, dy_dev, x_dev, g_dev, b_dev, mean_dev, rstd_dev))
            launch(means, stats_grid, stats_threads, stream, (column_means, sum_work))
            launch(apply, grid, block, stream, (dx, work, dy_dev, x_dev, g_dev, b_dev, mean_dev, rstd_dev,
                                                column_means))
        else:
            work = x_op.scratch((1, 2, C), acc, stream)
            launch(cached(make_zeros, _numba(acc)), -(-2 * C // 256), 256, stream, (work.reshape(-1),))
    finish_grid, finish_block = finish_launch(cfg, C)
    launch(finish, finish_grid, finish_block, stream, (dg, db, work))
    return (x_op.result(dx_native, dx, stream), g_op.result(dg_native, dg, stream),
            g_op.result(db_native, db, stream))


def _vector(width, *arrays):
    """Whether the layer-norm kernels may move 4 values a load: rows of a multiple of 4 and every
    array aligned to 4 elements."""
    return width % 4 == 0 and fours_fit(*arrays)


def _channels(x, g, b, epsilon, extra=()):
    """Checked NCHW operands (x, g, b, *extra), C, S (values a sample a channel) and epsilon."""
    epsilon = _epsilon(epsilon)
    ops = checked_operands([("x", x), ("g", g), ("b", b), *extra], DTYPES, same_dtype=False)
    x_op, g_op, b_op = ops[:3]
    if len(x_op.shape) < 2 or x_op.shape[0] * int(np.prod(x_op.shape[2:])) < 1:
        raise ValueError(f"x: expected (N, C, ...) with at least one value a channel, got shape {x_op.shape}")
    C = x_op.shape[1]
    for op in ops[1:]:
        if op.shape != (C,):
            raise ValueError(f"{op.name}: expected shape ({C},) (x's channels), got {op.shape}")
    if g_op.dtype != b_op.dtype:
        raise TypeError(f"dtype mismatch: g {g_op.dtype}, b {b_op.dtype}")
    return ops, C, int(np.prod(x_op.shape[2:])), epsilon


def _grid(cfg, n):
    from ..runtime.launch import multiprocessors

    return max(1, min(-(-n // cfg.row_threads), 16 * multiprocessors()))


@on_arrays_device
def batch_norm(x: Array, g: Array, b: Array, epsilon: float = 1e-5, stats: bool = False,
               config: Optional[NormsConfig] = None) -> Any:
    """OpenAI's ``batch_norm`` for NCHW (x (N, C, ...)): each channel normalized over the batch and
    its positions with the batch's mean and biased variance, scaled by ``g`` and shifted by ``b``.
    With ``stats`` also the (C,) mean and variance (fp32; fp64 for fp64), for running averages and
    `batch_norm_grad`."""
    cfg = as_config(config)
    (x_op, g_op, b_op), C, S, epsilon = _channels(x, g, b, epsilon)
    stream = launch_stream((x_op, g_op, b_op))
    acc = _acc(x_op.dtype)
    native, y = x_op.empty(x_op.shape, stream)
    mean_native, mean = x_op.empty((C,), stream, dtype=acc)
    var_native, var = x_op.empty((C,), stream, dtype=acc)
    stats_kernel, normalize, _ = cached(make_batch_norm, cfg, x_op.dtype, g_op.dtype, _numba(acc))
    flat = x_op.device(stream).reshape(-1)
    if C:
        launch(stats_kernel, C, cfg.row_threads, stream, (mean, var, flat, C, S))
        launch(normalize, _grid(cfg, flat.shape[0]), cfg.row_threads, stream,
               (y.reshape(-1), flat, g_op.device(stream), b_op.device(stream), mean, var, epsilon, C, S))
    out = x_op.result(native, y, stream)
    return (out, x_op.result(mean_native, mean, stream), x_op.result(var_native, var, stream)) if stats else out


@on_arrays_device
def batch_norm_inference(x: Array, g: Array, b: Array, mean: Array, var: Array, epsilon: float = 1e-5,
                         config: Optional[NormsConfig] = None) -> Array:
    """OpenAI's ``batch_norm_inference``: x normalized with given (C,) ``mean`` and ``var`` (running
    averages; x's dtype or fp32)."""
    cfg = as_config(config)
    (x_op, g_op, b_op, m_op, v_op), C, S, epsilon = _channels(x, g, b, epsilon, (("mean", mean), ("var", var)))
    stream = launch_stream((x_op, g_op, b_op, m_op, v_op))
    native, y = x_op.empty(x_op.shape, stream)
    _, normalize, _ = cached(make_batch_norm, cfg, x_op.dtype, g_op.dtype, _numba(_acc(x_op.dtype)))
    if m_op.dtype != v_op.dtype or m_op.dtype not in ("float32", "float64"):
        raise TypeError(f"mean, var: expected one dtype of float32 or float64, got {m_op.dtype} and {v_op.dtype}")
    flat = x_op.device(stream).reshape(-1)
    if C:
        launch(normalize, _grid(cfg, flat.shape[0]), cfg.row_threads, stream,
               (y.reshape(-1), flat, g_op.device(stream), b_op.device(stream), m_op.device(stream),
                v_op.device(stream), epsilon, C, S))
    return x_op.result(native, y, stream)


@on_arrays_device
def batch_norm_grad(dy: Array, x: Array, g: Array, mean: Array, var: Array, epsilon: float = 1e-5,
                    config: Optional[NormsConfig] = None) -> Tuple[Array, Array, Array]:
    """(dx, dg, db) of `batch_norm` for ``dy`` (x's shape and dtype), from the batch's ``mean`` and
    ``var`` (``stats=True``)."""
    cfg = as_config(config)
    ops, C, S, epsilon = _channels(x, g, g, epsilon, (("mean", mean), ("var", var)))
    x_op, g_op, _, m_op, v_op = ops
    dy_op = Operand(dy, "dy")
    check_same_kind([x_op, dy_op])
    if dy_op.shape != x_op.shape or dy_op.dtype != x_op.dtype:
        raise ValueError(f"dy: expected x's shape {x_op.shape} and dtype {x_op.dtype}, got {dy_op.shape} {dy_op.dtype}")
    dy_op.require_contiguous()
    acc = _acc(x_op.dtype)
    for op in (m_op, v_op):
        if op.dtype != acc:
            raise ValueError(f"{op.name}: expected ({C},) {acc} (the forward's stats=True), got {op.shape} {op.dtype}")
    stream = launch_stream(ops + [dy_op])
    dx_native, dx = x_op.empty(x_op.shape, stream)
    dg_native, dg = g_op.empty((C,), stream)
    db_native, db = g_op.empty((C,), stream)
    _, _, backward = cached(make_batch_norm, cfg, x_op.dtype, g_op.dtype, _numba(acc))
    if C:
        launch(backward, C, cfg.row_threads, stream, (dx.reshape(-1), dg, db, dy_op.device(stream).reshape(-1),
                                                      x_op.device(stream).reshape(-1), g_op.device(stream),
                                                      m_op.device(stream), v_op.device(stream), epsilon, C, S))
    return (x_op.result(dx_native, dx, stream), g_op.result(dg_native, dg, stream),
            g_op.result(db_native, db, stream))


def _numba(acc):
    from numba import float32, float64

    return float64 if acc == "float64" else float32
