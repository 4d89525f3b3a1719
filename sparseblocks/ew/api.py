"""The element-wise ops' public functions: validation, broadcasting, outputs, launches."""

from typing import Any, Optional, Sequence, Tuple

import numpy as np

from ..philox import check_word, threshold
from ..runtime.arrays import Array, Operand, check_dtype, check_same_kind, checked_operands, launch_stream
from ..runtime.compile import cached
from ..runtime.devices import on_arrays_device
from ..ptx.vector import fours_fit
from ..runtime.launch import launch, multiprocessors
from .config import EwConfig, as_config
from .dropout import make_dropout
from .kernels import (
    make_add_n,
    make_binary_flat,
    make_binary_kernel,
    make_cwise_linear,
    make_lstm_kernels,
    make_reduce_to,
    make_split4,
    make_unary_kernel,
)
from .ops import BINARY, UNARY

DTYPES = ("float16", "bfloat16", "float32", "float64")
MAX_DIMS = 4  # broadcasting's dimensions (NCHW)
MAX_INPUTS = 8


def _acc(dtype):
    from numba import float32, float64

    return float64 if dtype == "float64" else float32


def _acc_name(dtype):
    return "float64" if dtype == "float64" else "float32"


def _operands(named):
    return checked_operands(named, DTYPES)


def _flat(device):
    return device.reshape(-1)


def _grid(cfg, n):
    return max(1, min(-(-n // cfg.threads), cfg.waves * multiprocessors())), cfg.threads


def _run(cfg, kernel, n, stream, args):
    if n:
        grid, threads = _grid(cfg, n)
        launch(kernel, grid, threads, stream, args)


# -- unary ----------------------------------------------------------------------------


@on_arrays_device
def unary(op: str, x: Array, alpha: float = 1.0, config: Optional[EwConfig] = None) -> Array:
    """``op(x)`` element by element, ``op`` one of `UNARY` (``alpha``: elu's), in x's dtype."""
    cfg = as_config(config)
    if op not in UNARY:
        raise ValueError(f"op: expected one of {UNARY}, got {op!r}")
    (x_op,) = _operands([("x", x)])
    stream = launch_stream((x_op,))
    native, y = x_op.empty(x_op.shape, stream)
    args = (_flat(y), _flat(x_op.device(stream)))
    unary_kernel, _ = cached(make_unary_kernel, x_op.dtype, _acc(x_op.dtype), op, fours_fit(*args))
    _run(cfg, unary_kernel, int(np.prod(x_op.shape)), stream, (*args, float(alpha)))
    return x_op.result(native, y, stream)


@on_arrays_device
def unary_grad(op: str, dy: Array, x: Array, y: Array, alpha: float = 1.0, config: Optional[EwConfig] = None) -> Array:
    """The gradient of ``y = op(x)`` for ``dy``."""
    cfg = as_config(config)
    if op not in UNARY:
        raise ValueError(f"op: expected one of {UNARY}, got {op!r}")
    dy_op, x_op, y_op = _operands([("dy", dy), ("x", x), ("y", y)])
    for other in (dy_op, y_op):
        if other.shape != x_op.shape:
            raise ValueError(f"{other.name}: expected x's shape {x_op.shape}, got {other.shape}")
    stream = launch_stream((dy_op, x_op, y_op))
    native, dx = x_op.empty(x_op.shape, stream)
    args = (_flat(dx), *(_flat(o.device(stream)) for o in (dy_op, x_op, y_op)))
    _, grad_kernel = cached(make_unary_kernel, x_op.dtype, _acc(x_op.dtype), op, fours_fit(*args))
    _run(cfg, grad_kernel, int(np.prod(x_op.shape)), stream, (*args, float(alpha)))
    return x_op.result(native, dx, stream)


def _unary_function(op):
    def function(x: Array, config: Optional[EwConfig] = None) -> Array:
        return unary(op, x, config=config)

    function.__name__ = function.__qualname__ = op
    function.__doc__ = f"``{op}(x)`` element by element (`unary`)."
    return function


negative, reciprocal, square, sqrt, exp, log, sigmoid, tanh, relu = (
    _unary_function(op) for op in UNARY if op != "elu")


def elu(x: Array, alpha: float = 1.0, config: Optional[EwConfig] = None) -> Array:
    """``x`` where positive, else ``alpha·(exp(x) - 1)`` (`unary`)."""
    return unary("elu", x, alpha, config)


# -- binary, with broadcasting ----------------------------------------------------------


def broadcast(a_shape, b_shape):
    """(output shape, the output's and each operand's 4-D padded shapes) of NumPy broadcasting."""
    ndim = max(len(a_shape), len(b_shape))
    if ndim > MAX_DIMS:
        raise ValueError(f"a, b: expected at most {MAX_DIMS} dimensions, got shapes {a_shape} and {b_shape}")
    pad = lambda s: (1,) * (MAX_DIMS - len(s)) + tuple(s)  # noqa: E731
    pa, pb = pad(a_shape), pad(b_shape)
    out = []
    for x, y in zip(pa, pb):
        if x != y and 1 not in (x, y):
            raise ValueError(f"a, b: shapes {a_shape} and {b_shape} do not broadcast")
        out.append(max(x, y) if 0 not in (x, y) else 0)
    return tuple(out[MAX_DIMS - ndim:]), tuple(out), pa, pb


def _strides(padded, out):
    """Element strides of a C-contiguous operand of ``padded`` shape, 0 where it broadcasts."""
    strides, step = [], 1
    for extent in reversed(padded):
        strides.append(step)
        step *= extent
    strides = strides[::-1]
    return tuple(0 if p == 1 and o != 1 else s for p, s, o in zip(padded, strides, out))


@on_arrays_device
def binary(op: str, a: Array, b: Array, config: Optional[EwConfig] = None) -> Array:
    """``op(a, b)`` element by element with NumPy's broadcasting (up to 4 dimensions), ``op`` one
    of `BINARY`; a and b of one dtype, the result in it."""
    cfg = as_config(config)
    if op not in BINARY:
        raise ValueError(f"op: expected one of {BINARY}, got {op!r}")
    a_op, b_op = _operands([("a", a), ("b", b)])
    shape, out4, pa, pb = broadcast(a_op.shape, b_op.shape)
    stream = launch_stream((a_op, b_op))
    native, out = a_op.empty(shape, stream)
    n = int(np.prod(shape))
    args = (_flat(out), _flat(a_op.device(stream)), _flat(b_op.device(stream)))
    if a_op.shape == b_op.shape:
        kernel, _ = cached(make_binary_flat, a_op.dtype, _acc(a_op.dtype), op, fours_fit(*args))
        _run(cfg, kernel, n, stream, args)
    else:
        kernel, _ = cached(make_binary_kernel, a_op.dtype, _acc(a_op.dtype), op, n < 2 ** 31)
        _run(cfg, kernel, n, stream, (*args, *out4[1:], *_strides(pa, out4), *_strides(pb, out4)))
    return a_op.result(native, out, stream)


@on_arrays_device
def binary_grad(op: str, dy: Array, a: Array, b: Array, config: Optional[EwConfig] = None) -> Tuple[Array, Array]:
    """(da, db): the gradients of ``op(a, b)`` for ``dy`` (the output's shape), each summed back to
    its operand's shape over the dimensions it was broadcast along."""
    cfg = as_config(config)
    if op not in BINARY:
        raise ValueError(f"op: expected one of {BINARY}, got {op!r}")
    dy_op, a_op, b_op = _operands([("dy", dy), ("a", a), ("b", b)])
    shape, out4, pa, pb = broadcast(a_op.shape, b_op.shape)
    if dy_op.shape != shape:
        raise ValueError(f"dy: expected the output's shape {shape}, got {dy_op.shape}")
    stream = launch_stream((dy_op, a_op, b_op))
    acc = _acc_name(a_op.dtype)
    n = int(np.prod(shape))
    if a_op.shape == b_op.shape:  # (nothing broadcast: the gradients in the operands' dtype at once)
        (da_native, da), (db_native, db) = a_op.empty(shape, stream), b_op.empty(shape, stream)
        args = (_flat(da), _flat(db), *(_flat(o.device(stream)) for o in (dy_op, a_op, b_op)))
        _, grad_kernel = cached(make_binary_flat, a_op.dtype, _acc(a_op.dtype), op, fours_fit(*args))
        _run(cfg, grad_kernel, n, stream, args)
        return a_op.result(da_native, da, stream), b_op.result(db_native, db, stream)
    full_a, full_b = a_op.scratch((max(n, 1),), acc, stream), a_op.scratch((max(n, 1),), acc, stream)
    _, grad_kernel = cached(make_binary_kernel, a_op.dtype, _acc(a_op.dtype), op, n < 2 ** 31)
    _run(cfg, grad_kernel, n, stream, (full_a, full_b, _flat(dy_op.device(stream)), _flat(a_op.device(stream)),
                                       _flat(b_op.device(stream)), *out4[1:], *_strides(pa, out4), *_strides(pb, out4)))
    reduce_to = cached(make_reduce_to, a_op.dtype, _acc(a_op.dtype))
    results = []
    for op_, padded, full in ((a_op, pa, full_a), (b_op, pb, full_b)):
        native, grad = op_.empty(op_.shape, stream)
        reach = tuple(o if p == 1 else 1 for p, o in zip(padded, out4))
        _run(cfg, reduce_to, int(np.prod(op_.shape)), stream, (_flat(grad), full, *padded[1:], *reach, *out4[1:]))
        results.append(op_.result(native, grad, stream))
    return tuple(results)


def _binary_function(op):
    def function(a: Array, b: Array, config: Optional[EwConfig] = None) -> Array:
        return binary(op, a, b, config)

    function.__name__ = function.__qualname__ = op
    function.__doc__ = f"``{op}(a, b)`` element by element, with broadcasting (`binary`)."
    return function


add, subtract, multiply, divide, maximum, minimum = (_binary_function(op) for op in BINARY)


# -- add_n, cwise_linear, split4 / concat4 ------------------------------------------------


@on_arrays_device
def add_n(xs: Sequence[Array], config: Optional[EwConfig] = None) -> Array:
    """The sum of 1 to 8 arrays of one shape and dtype in one pass (OpenAI's ``add_n8``), added in
    order in fp32 (fp64 for fp64) and rounded once."""
    cfg = as_config(config)
    xs = list(xs)
    if not 1 <= len(xs) <= MAX_INPUTS:
        raise ValueError(f"xs: expected 1 to {MAX_INPUTS} arrays, got {len(xs)}")
    ops = _operands([(f"xs[{k}]", x) for k, x in enumerate(xs)])
    for op in ops[1:]:
        if op.shape != ops[0].shape:
            raise ValueError(f"{op.name}: expected xs[0]'s shape {ops[0].shape}, got {op.shape}")
    stream = launch_stream(ops)
    native, out = ops[0].empty(ops[0].shape, stream)
    flats = [_flat(op.device(stream)) for op in ops]
    flats += [flats[0]] * (MAX_INPUTS - len(flats))
    kernel = cached(make_add_n, ops[0].dtype, _acc(ops[0].dtype), len(xs), fours_fit(out, *flats))
    _run(cfg, kernel, int(np.prod(ops[0].shape)), stream, (_flat(out), *flats))
    return ops[0].result(native, out, stream)


def _channels(x_op, a_op, b_op):
    if len(x_op.shape) < 2:
        raise ValueError(f"x: expected (N, C, ...) with channels on axis 1, got shape {x_op.shape}")
    C = x_op.shape[1]
    for op in (a_op, b_op):
        if op is not None and op.shape != (C,):
            raise ValueError(f"{op.name}: expected shape ({C},) (x's channels), got {op.shape}")
    return C, int(np.prod(x_op.shape[2:]))


@on_arrays_device
def cwise_linear(x: Array, a: Optional[Array] = None, b: Optional[Array] = None,
                 config: Optional[EwConfig] = None) -> Array:
    """``a[c]·x + b[c]`` over x's channel axis (axis 1 of (N, C, ...), NCHW's middle), ``a`` and
    ``b`` (C,) or None (then 1 and 0)."""
    cfg = as_config(config)
    named = [("x", x)] + [(n, v) for n, v in (("a", a), ("b", b)) if v is not None]
    ops = _operands(named)
    x_op = ops[0]
    a_op = next((o for o in ops if o.name == "a"), None)
    b_op = next((o for o in ops if o.name == "b"), None)
    C, S = _channels(x_op, a_op, b_op)
    stream = launch_stream(ops)
    native, y = x_op.empty(x_op.shape, stream)
    x_dev = _flat(x_op.device(stream))
    kernel, _ = cached(make_cwise_linear, x_op.dtype, _acc(x_op.dtype), a_op is not None, b_op is not None,
                       cfg.threads)
    _run(cfg, kernel, int(np.prod(x_op.shape)), stream,
         (_flat(y), x_dev, a_op.device(stream) if a_op else x_dev, b_op.device(stream) if b_op else x_dev, C, S))
    return x_op.result(native, y, stream)


@on_arrays_device
def cwise_linear_grad(dy: Array, x: Array, a: Optional[Array] = None,
                      config: Optional[EwConfig] = None) -> Tuple[Array, Array, Array]:
    """(dx, da, db) of `cwise_linear` for ``dy``: ``dx = a[c]·dy``, ``da[c] = Σ dy·x``,
    ``db[c] = Σ dy`` over every axis but the channels'."""
    cfg = as_config(config)
    ops = _operands([("dy", dy), ("x", x)] + ([("a", a)] if a is not None else []))
    dy_op, x_op = ops[:2]
    a_op = ops[2] if a is not None else None
    if dy_op.shape != x_op.shape:
        raise ValueError(f"dy: expected x's shape {x_op.shape}, got {dy_op.shape}")
    C, S = _channels(x_op, a_op, None)
    stream = launch_stream(ops)
    dx_native, dx = x_op.empty(x_op.shape, stream)
    da_native, da = x_op.empty((C,), stream)
    db_native, db = x_op.empty((C,), stream)
    x_dev = _flat(x_op.device(stream))
    _, kernel = cached(make_cwise_linear, x_op.dtype, _acc(x_op.dtype), a_op is not None, True, cfg.threads)
    if C:
        launch(kernel, C, cfg.threads, stream, (_flat(dx), da, db, _flat(dy_op.device(stream)), x_dev,
                                                a_op.device(stream) if a_op else x_dev, C, S))
    return x_op.result(dx_native, dx, stream), x_op.result(da_native, da, stream), x_op.result(db_native, db, stream)


def _quarters(x_op):
    if len(x_op.shape) < 1 or x_op.shape[-1] % 4:
        raise ValueError(f"x: expected a last dimension that is a multiple of 4, got shape {x_op.shape}")
    return x_op.shape[-1] // 4


@on_arrays_device
def split4(x: Array, config: Optional[EwConfig] = None) -> Tuple[Array, Array, Array, Array]:
    """The four equal quarters of ``x`` along its last axis, as four new arrays."""
    cfg = as_config(config)
    (x_op,) = _operands([("x", x)])
    K = _quarters(x_op)
    stream = launch_stream((x_op,))
    parts = [x_op.empty((*x_op.shape[:-1], K), stream) for _ in range(4)]
    kernel, _ = cached(make_split4, x_op.dtype)
    _run(cfg, kernel, int(np.prod(x_op.shape)), stream, (*(_flat(d) for _, d in parts), _flat(x_op.device(stream)), K))
    return tuple(x_op.result(n, d, stream) for n, d in parts)


@on_arrays_device
def concat4(p0: Array, p1: Array, p2: Array, p3: Array, config: Optional[EwConfig] = None) -> Array:
    """Four arrays of one shape joined along their last axis (the inverse of `split4`)."""
    cfg = as_config(config)
    ops = _operands([(f"p{k}", p) for k, p in enumerate((p0, p1, p2, p3))])
    for op in ops[1:]:
        if op.shape != ops[0].shape:
            raise ValueError(f"{op.name}: expected p0's shape {ops[0].shape}, got {op.shape}")
    if len(ops[0].shape) < 1:
        raise ValueError("p0: expected at least one dimension")
    K = ops[0].shape[-1]
    stream = launch_stream(ops)
    native, x = ops[0].empty((*ops[0].shape[:-1], 4 * K), stream)
    _, kernel = cached(make_split4, ops[0].dtype)
    _run(cfg, kernel, int(np.prod(ops[0].shape)) * 4, stream, (_flat(x), *(_flat(op.device(stream)) for op in ops), K))
    return ops[0].result(native, x, stream)


# -- fused LSTM gates -------------------------------------------------------------------


def _gate_operands(c, gates, extra=()):
    """(operands, H, gate stride, merged) of c (N, H) and four (N, H) gates or one (N, 4H)."""
    if len(gates) not in (1, 4):
        raise ValueError(f"gates: expected four gate arrays (i, f, o, u) or one merged, got {len(gates)}")
    names = ["i", "f", "o", "u"] if len(gates) == 4 else ["gates"]
    ops = _operands([("c", c)] + list(zip(names, gates)) + list(extra))
    c_op = ops[0]
    if len(c_op.shape) != 2:
        raise ValueError(f"c: expected (N, H), got shape {c_op.shape}")
    N, H = c_op.shape
    want = (N, H) if len(gates) == 4 else (N, 4 * H)
    for op in ops[1:1 + len(gates)]:
        if op.shape != want:
            raise ValueError(f"{op.name}: expected shape {want}, got {op.shape}")
    return ops, N, H, len(gates) == 1


def _lstm_quads(cfg, dtype):
    """Groups of 4 columns a thread an iteration of the vector LSTM kernels: ``lstm_quads16`` for
    16-bit gates, else 1."""
    return cfg.lstm_quads16 if dtype in ("float16", "bfloat16") else 1


@on_arrays_device
def fused_lstm_gates(c: Array, *gates: Array, config: Optional[EwConfig] = None) -> Tuple[Array, Array]:
    """OpenAI's ``fused_lstm_gates``: ``(c_next, h)`` with ``c_next = σ(f)·c + σ(i)·tanh(u)`` and
    ``h = σ(o)·tanh(c_next)``, from c (N, H) and the gates' pre-activations: four (N, H) arrays
    i, f, o, u, or one (N, 4H) array of them in that order."""
    cfg = as_config(config)
    ops, N, H, merged = _gate_operands(c, gates)
    stream = launch_stream(ops)
    c_op = ops[0]
    (cn_native, c_next), (h_native, h) = c_op.empty((N, H), stream), c_op.empty((N, H), stream)
    flats = [_flat(op.device(stream)) for op in ops]
    gate_args = [flats[1][q * H:] for q in range(4)] if merged else flats[1:]
    vector = H % 4 == 0 and fours_fit(c_next, h, *flats)
    quads = _lstm_quads(cfg, c_op.dtype)
    kernel, _ = cached(make_lstm_kernels, c_op.dtype, _acc(c_op.dtype), vector, quads)
    _run(cfg, kernel, (N * H) // (4 * quads) if vector else N * H, stream,
         (_flat(c_next), _flat(h), flats[0], *gate_args, H, 4 * H if merged else H))
    return c_op.result(cn_native, c_next, stream), c_op.result(h_native, h, stream)


@on_arrays_device
def fused_lstm_gates_grad(c: Array, *gates: Array, dc_next: Array, dh: Array,
                          config: Optional[EwConfig] = None) -> Tuple[Array, ...]:
    """(dc, dgates...) of `fused_lstm_gates` for the gradients of c_next and h: the gates' as
    four arrays, or one merged (N, 4H), as they were given."""
    cfg = as_config(config)
    ops, N, H, merged = _gate_operands(c, gates, (("dc_next", dc_next), ("dh", dh)))
    for op in ops[-2:]:
        if op.shape != (N, H):
            raise ValueError(f"{op.name}: expected c's shape {(N, H)}, got {op.shape}")
    stream = launch_stream(ops)
    c_op = ops[0]
    dc_native, dc = c_op.empty((N, H), stream)
    if merged:
        grads = [c_op.empty((N, 4 * H), stream)]
        grad_args = [_flat(grads[0][1])[q * H:] for q in range(4)]
    else:
        grads = [c_op.empty((N, H), stream) for _ in range(4)]
        grad_args = [_flat(d) for _, d in grads]
    flats = [_flat(op.device(stream)) for op in ops]
    gate_args = [flats[1][q * H:] for q in range(4)] if merged else flats[1:5]
    vector = H % 4 == 0 and fours_fit(dc, *(_flat(d) for _, d in grads), *flats)
    quads = _lstm_quads(cfg, c_op.dtype)
    _, kernel = cached(make_lstm_kernels, c_op.dtype, _acc(c_op.dtype), vector, quads)
    _run(cfg, kernel, (N * H) // (4 * quads) if vector else N * H, stream,
         (_flat(dc), *grad_args, flats[0], *gate_args, flats[-2], flats[-1], H, 4 * H if merged else H))
    return (c_op.result(dc_native, dc, stream), *(c_op.result(n, d, stream) for n, d in grads))


# -- dropout ----------------------------------------------------------------------------


def _dropout_settings(keep_prob, seed, offset):
    try:
        keep_prob = float(keep_prob)
    except (TypeError, ValueError):
        raise TypeError(f"keep_prob: expected a number, got {keep_prob!r}") from None
    if not 0.0 < keep_prob <= 1.0:
        raise ValueError(f"keep_prob: expected a probability in (0, 1], got {keep_prob}")
    check_word("seed", seed)
    check_word("offset", offset)
    return threshold(keep_prob), 1.0 / keep_prob, int(seed), int(offset)


def _run_dropout(cfg, x, keep_prob, seed, offset, mask, packed, name):
    threshold, scale, seed, offset = _dropout_settings(keep_prob, seed, offset)
    named = [(name, x)] + ([("mask", mask)] if mask is not None else [])
    ops = [Operand(a, n) for n, a in named]
    check_same_kind(ops)
    x_op = ops[0]
    check_dtype(x_op, DTYPES)
    for op in ops:
        op.require_contiguous()
    n = int(np.prod(x_op.shape))
    words = -(-n // 32)
    if mask is not None and (ops[1].dtype != "uint32" or ops[1].shape != (words,)):
        raise ValueError(f"mask: expected ({words},) uint32 (the packed mask of {n} values), got {ops[1].shape} "
                         f"{ops[1].dtype}")
    stream = launch_stream(ops)
    native, y = x_op.empty(x_op.shape, stream)
    mask_native, mask_device = (x_op.empty((max(words, 1),), stream, dtype="uint32") if packed
                                else (None, ops[1].device(stream) if mask is not None else None))
    if mask_device is None:
        mask_device = x_op.scratch((1,), "uint32", stream)
    if n:
        x_dev = _flat(x_op.device(stream))
        kernel = cached(make_dropout, x_op.dtype, _acc(x_op.dtype), bool(packed), mask is not None,
                        fours_fit(_flat(y), x_dev))
        groups = -(-n // 4)
        grid = max(1, min(-(-groups // cfg.threads), cfg.waves * multiprocessors()))
        launch(kernel, grid, cfg.threads, stream, (_flat(y), mask_device, x_dev, threshold,
                                                   scale, seed & 0xFFFFFFFF, seed >> 32, offset, n))
    out = x_op.result(native, y, stream)
    return (out, x_op.result(mask_native, mask_device, stream)) if packed else out


@on_arrays_device
def dropout(x: Array, keep_prob: float = 0.8, seed: int = 0, offset: int = 0, mask: Optional[Array] = None,
            packed: bool = False, config: Optional[EwConfig] = None) -> Any:
    """OpenAI's ``dropout``: each value kept with probability ``keep_prob`` and scaled by
    1 / keep_prob, else 0. The keep bits are Philox's for (element, ``offset``) under ``seed``, so a
    seed and offset give one mask on every call and the backward (`dropout_grad`) regenerates it.
    With ``packed`` it returns ``(y, mask)``, the mask as bits (bit e % 32 of uint32 word e // 32),
    which ``mask=`` takes instead of the random bits."""
    return _run_dropout(as_config(config), x, keep_prob, seed, offset, mask, packed, "x")


@on_arrays_device
def dropout_grad(dy: Array, keep_prob: float = 0.8, seed: int = 0, offset: int = 0, mask: Optional[Array] = None,
                 config: Optional[EwConfig] = None) -> Array:
    """The gradient of `dropout` with the same keep_prob, seed and offset (or packed ``mask``):
    dy where kept, scaled by 1 / keep_prob, else 0."""
    return _run_dropout(as_config(config), dy, keep_prob, seed, offset, mask, False, "dy")
