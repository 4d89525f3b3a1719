"""The normalizations' public functions: validation, outputs, launches."""

from ..runtime.arrays import Operand, check_dtype, check_same_kind, launch_stream
from ..runtime.compile import cached
from ..runtime.devices import on_arrays_device
from ..runtime.launch import launch
from .config import as_config
from .layer import forward_launch, make_backward, make_forward, make_param_grads

DTYPES = ("float16", "bfloat16", "float32", "float64")


def _acc(dtype):
    return "float64" if dtype == "float64" else "float32"


def _operands(x, g, b, axis, epsilon, extra=()):
    """Checked operands (x, g, b, *extra) and the problem's (N, C)."""
    if axis not in (0, 1):
        raise ValueError(f"axis: expected 0 (x is (C, N)) or 1 (x is (N, C)), got {axis!r}")
    try:
        if isinstance(epsilon, (str, bytes)):
            raise TypeError
        epsilon = float(epsilon)
    except (TypeError, ValueError):
        raise TypeError(f"epsilon: expected a number, got {epsilon!r}") from None
    if not epsilon >= 0:
        raise ValueError(f"epsilon: expected a number >= 0, got {epsilon}")
    ops = [Operand(x, "x"), Operand(g, "g"), Operand(b, "b")] + [Operand(a, name) for name, a in extra]
    check_same_kind(ops)
    for op in ops:
        check_dtype(op, DTYPES)
        op.require_contiguous()
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
def layer_norm(x, g, b, axis=1, epsilon=1e-6, relu=False, config=None, stats=False):
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
        kernel = cached(make_forward, cfg, x_op.dtype, g_op.dtype, _numba(acc), axis, bool(relu))
        grid, threads = forward_launch(cfg, axis, N)
        launch(kernel, grid, threads, stream, (y, mean, rstd, x_op.device(stream), g_op.device(stream),
                                               b_op.device(stream), epsilon))
    out = x_op.result(native, y, stream)
    if not stats:
        return out
    return out, x_op.result(mean_native, mean, stream), x_op.result(rstd_native, rstd, stream)


@on_arrays_device
def layer_norm_grad(dy, x, g, b, mean, rstd, axis=1, relu=False, config=None):
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
    key = (cfg, x_op.dtype, g_op.dtype, _numba(acc), axis, bool(relu))
    if N:
        grid, threads = forward_launch(cfg, axis, N)
        launch(cached(make_backward, *key), grid, threads, stream, (dx, dy_dev, x_dev, g_dev, b_dev, mean_dev, rstd_dev))
    partials, finish = cached(make_param_grads, *key)
    if axis == 1:
        chunks = max(1, -(-N // cfg.grad_rows))
        work = x_op.scratch((chunks, 2, C), acc, stream)
        columns = -(-C // cfg.row_threads)
        launch(partials, (columns, chunks), cfg.row_threads, stream, (work, dy_dev, x_dev, g_dev, b_dev, mean_dev,
                                                                     rstd_dev))
        launch(finish, columns, cfg.row_threads, stream, (dg, db, work))
    else:
        launch(partials, C, cfg.row_threads, stream, (dg, db, dy_dev, x_dev, g_dev, b_dev, mean_dev, rstd_dev))
    return (x_op.result(dx_native, dx, stream), g_op.result(dg_native, dg, stream),
            g_op.result(db_native, db, stream))


def _numba(acc):
    from numba import float32, float64

    return float64 if acc == "float64" else float32
