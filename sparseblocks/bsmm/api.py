"""The matmul's public functions: validate, then plan, then launch.

Over a `BlockLayout` of ``(C/bs, K/bs)`` blocks with weights ``w[n_blocks, bs, bs]``:

* ``forward``:     ``y  = x · W``     (N, C) -> (N, K), over the layout's block-columns;
* ``input_grad``:  ``dx = dy · Wᵀ``   (N, K) -> (N, C), over its block-rows, each block read
  transposed (no transposed copy of ``w``);
* ``weight_grad``: ``dW = xᵀ · dy``   on the layout's blocks only, optionally
  ``out = xᵀ·dy + beta·out``.

``feature_axis=1``: activations ``(N, features)``; ``0``: ``(features, N)``. Storage fp16,
bf16, fp32 or fp64; accumulation in fp32 (fp64 for fp64). Any ``N >= 0``; output features
with no block are zero. Every sum runs in a fixed order: results are bitwise repeatable.
``version=`` picks a kernel family (`dispatch.VERSIONS`), ``config=`` its knobs.
"""

from __future__ import annotations

from typing import Optional, Tuple, Union

from ..layout import BlockLayout, check_block_size, check_layout
from ..philox import check_word
from ..runtime.devices import on_arrays_device
from ..ptx.vector import aligned
from ..runtime import arrays as _arrays
from ..runtime import plans
from ..runtime.arrays import (
    Array,
    Operand,
    check_dtype,
    check_same_dtype,
    check_same_kind,
    check_shape,
    launch_stream,
)
from ..runtime.backend import SIMULATOR
from ..runtime.launch import data_pointer, launch
from .block_norms import CRITERIA, make_block_norms, norm_threads
from .config import BsmmConfig, as_config

from .dispatch import (
    VERSIONS,
    default_version,
    launch_add_bias,
    launch_column_sums,
    launch_product,
    launch_product_v1,
    launch_transpose_blocks,
    launch_weight_grad,
    _index,
    compiled,
    words,
)
from .normalize import make_identity, make_l2_normalize, make_ortho
from .plans import (
    keep_product_plan,
    keep_weight_grad_plan,
    replayed_product,
    replayed_weight_grad,
)
from .tensorcore import V5_STORAGE


def _check_common(cfg, ops, feature_axis, version):
    """Validate; return the version to run (`default_version` where ``version`` is None)."""
    if feature_axis not in (0, 1):
        raise ValueError(f"feature_axis: expected 0 or 1, got {feature_axis!r}")
    if version is not None and version not in VERSIONS:
        raise ValueError(f"version: expected one of {VERSIONS} or None, got {version!r}")
    check_same_kind(ops)
    for op in ops:
        check_dtype(op)
        op.require_contiguous()
    check_same_dtype(ops)
    return default_version(ops[0].dtype, cfg) if version is None else version


def _check_activation(op, features, feature_axis, what):
    if len(op.shape) != 2:
        raise ValueError(f"{op.name}: expected a 2-D array {what}, got shape {op.shape}")
    if op.shape[feature_axis] != features:
        raise ValueError(
            f"{op.name}: expected {features} features on axis {feature_axis} {what}, got shape {op.shape}"
        )
    return op.shape[1 - feature_axis]


def _own_or_fp32(dtype):
    """The dtypes a bias or dW may take beside activations of ``dtype``: its own, and fp32 for
    16-bit ones."""
    return (dtype, "float32") if dtype in ("float16", "bfloat16") else (dtype,)


def _check_bias(bias, a, out_features):
    """The bias as an Operand (one value an output feature: a's dtype, or fp32 with 16-bit a), or None."""
    if bias is None:
        return None
    op = Operand(bias, "bias")
    check_same_kind((a, op))
    allowed = _own_or_fp32(a.dtype)
    if op.dtype not in allowed:
        raise TypeError(f"bias: expected dtype in {list(allowed)} ({a.name} is {a.dtype}), got {op.dtype}")
    check_shape(op, (out_features,))
    op.require_contiguous()
    return op


def _product(cfg, a, w, layout, feature_axis, transpose_w, version, max_segment=None, bias=None, relu=False):
    if not isinstance(relu, bool):
        raise TypeError(f"relu: expected a bool, got {relu!r}")
    check_layout(layout)
    if plans.kept and max_segment is None:
        out = replayed_product(cfg, a, w, layout, feature_axis, transpose_w, version, bias, relu)
        if out is not None:
            return out
    given = version
    a, w = Operand(a, "dy" if transpose_w else "x"), Operand(w, "w")
    version = _check_common(cfg, (a, w), feature_axis, version)
    check_shape(w, layout.w_shape)
    C, K = layout.dense_shape
    in_features, out_features = (K, C) if transpose_w else (C, K)
    n_rows = _check_activation(a, in_features, feature_axis, f"(layout has {C} inputs, {K} outputs)")
    bias = _check_bias(bias, a, out_features)

    stream = launch_stream((a, w) if bias is None else (a, w, bias))
    out_shape = (n_rows, out_features) if feature_axis == 1 else (out_features, n_rows)
    native, out = a.empty(out_shape, stream)
    if n_rows:
        if version == 1:
            launch_product_v1(cfg, out, a, w, layout, n_rows, transpose_w, feature_axis, stream)
            if bias is not None or relu:
                launch_add_bias(out, None if bias is None else bias.device(stream), a.dtype,
                                None if bias is None else bias.dtype, n_rows, feature_axis, stream, relu)
        else:
            launched = launch_product(cfg, out, a, w, layout, n_rows, transpose_w, feature_axis, stream,
                                      max_segment, version, bias, relu)
            if max_segment is None:
                keep_product_plan(cfg, a, w, bias, layout, feature_axis, transpose_w, given, out_shape, launched,
                                  relu)
    return a.result(native, out, stream)


@on_arrays_device
def forward(x: Array, w: Array, layout: BlockLayout, feature_axis: int = 1, version: Optional[int] = None,
            config: Optional[BsmmConfig] = None, bias: Optional[Array] = None, relu: bool = False) -> Array:
    """``y = x · W`` for block-sparse ``W`` given as ``w[n_blocks, bs, bs]`` over ``layout``;
    with ``bias`` (one value an output feature, x's dtype or fp32 with fp16/bf16 x) ``x · W +
    bias``, and with ``relu`` ``max(x · W (+ bias), 0)``: version 7 adds the bias and takes the max
    in its epilogue before rounding (others in a pass of their own, on the rounded product)."""
    return _product(as_config(config), x, w, layout, feature_axis, False, version, bias=bias, relu=relu)


@on_arrays_device
def input_grad(dy: Array, w: Array, layout: BlockLayout, feature_axis: int = 1, version: Optional[int] = None,
               config: Optional[BsmmConfig] = None) -> Array:
    """``dx = dy · Wᵀ`` for block-sparse ``W``."""
    return _product(as_config(config), dy, w, layout, feature_axis, True, version)


def _weight_grad_dtype(x, out, out_dtype):
    """dW's dtype: x's, or fp32 from 16-bit x (``out_dtype``, or an fp32 ``out``)."""
    wanted = out_dtype if out_dtype is not None else (x.dtype if out is None else out.dtype)
    allowed = _own_or_fp32(x.dtype)
    if out_dtype is not None and out is not None and out.dtype != out_dtype:
        raise ValueError(f"out: expected out_dtype {out_dtype}, got {out.dtype}")
    if wanted not in allowed:
        name = "out_dtype" if out_dtype is not None else "out"
        raise TypeError(f"{name}: expected dtype in {list(allowed)} (x is {x.dtype}), got {wanted}")
    return wanted


def _stacked_steps(x, dy, feature_axis):
    """(x, dy) of a grouped weight gradient as one problem: the T steps' rows side by side."""
    shapes = [tuple(getattr(a, "shape", ())) for a in (x, dy)]
    if any(len(s) != 3 for s in shapes) or shapes[0][0] != shapes[1][0]:
        raise ValueError(f"x and dy: expected stacks of the same T steps, 3-D each, got shapes {shapes[0]} and "
                         f"{shapes[1]}")
    if feature_axis == 1:
        return x.reshape(-1, shapes[0][2]), dy.reshape(-1, shapes[1][2])
    if feature_axis != 0:
        raise ValueError(f"feature_axis: expected 0 or 1, got {feature_axis!r}")
    joined = []
    for a, (T, F, N) in zip((x, dy), shapes):
        if hasattr(a, "permute"):  # torch
            joined.append(a.permute(1, 0, 2).reshape(F, T * N).contiguous())
        elif hasattr(a, "transpose") and not hasattr(a, "copy_to_host"):  # NumPy, CuPy
            joined.append(a.transpose(1, 0, 2).reshape(F, T * N).copy())
        else:
            raise TypeError("x, dy: a grouped weight gradient with feature_axis 0 takes NumPy, CuPy or torch stacks")
    return tuple(joined)


@on_arrays_device
def weight_grad(x: Array, dy: Array, layout: BlockLayout, feature_axis: int = 1, out: Optional[Array] = None,
                beta: float = 0.0, version: Optional[int] = None, splits: Optional[int] = None,
                config: Optional[BsmmConfig] = None, out_dtype: Optional[str] = None,
                dbias_dtype: Optional[str] = None) -> Union[Array, Tuple[Array, Array]]:
    """``dW = xᵀ · dy`` on the layout's blocks, as ``(n_blocks, bs, bs)``.

    With ``out`` the result goes there, as ``out = xᵀ·dy + beta·out`` (so the
    gradients of a weight shared across steps add up without a copy); ``out``
    is then returned, and must not share memory with ``x`` or ``dy``
    (ValueError). ``splits`` (not version 1) overrides how many slices of N are
    summed separately and then combined in order.

    ``out_dtype`` "float32" from fp16 or bf16 x and dy (OpenAI's ``dw_dtype``): the fp32 sums are
    stored as they are, no 16-bit rounding between them and an fp32 master weight; an fp32 ``out``
    does the same (with ``beta``). By default dW has x's dtype (or ``out``'s).

    Grouped (OpenAI's ``group_param_grads``): x and dy stacked over T steps that share the layout,
    (T, N, C) and (T, N, K) (with feature_axis 0, (T, C, N) and (T, K, N)), give the one dW summed
    over the steps, in one launch: the steps' rows are one sum (feature_axis 0 copies the stack
    into (C, T·N) first).

    ``dbias_dtype`` (x's dtype, or "float32" with fp16 or bf16 x): the bias gradient too, dy's
    sums over N (one value an output feature, summed in fp32, fp64 for fp64, in a fixed order),
    returned as ``(dW, db)``. Version 7's block-128 weight gradient (warp-specialized, feature_axis
    1) sums each block-column in one of its blocks' thread blocks, from the dy stages it copies
    anyway; other cases, and block-columns without blocks, in a pass of their own.
    """
    cfg = as_config(config)
    check_layout(layout)
    if len(getattr(x, "shape", ())) == 3 or len(getattr(dy, "shape", ())) == 3:
        x, dy = _stacked_steps(x, dy, feature_axis)
    if plans.kept:
        dw = replayed_weight_grad(cfg, x, dy, layout, feature_axis, out, beta, version, splits, out_dtype,
                                  dbias_dtype)
        if dw is not None:
            return dw
    given = version
    x, dy = Operand(x, "x"), Operand(dy, "dy")
    ops: Tuple[Operand, ...] = (x, dy) if out is None else (x, dy, Operand(out, "out"))
    version = _check_common(cfg, ops[:2], feature_axis, version)
    given_dtype, out_dtype = out_dtype, _weight_grad_dtype(x, None if out is None else ops[2], out_dtype)
    if out is not None:
        check_same_kind(ops)
        ops[2].require_contiguous()
    C, K = layout.dense_shape
    n_x = _check_activation(x, C, feature_axis, f"(layout has {C} inputs)")
    n_dy = _check_activation(dy, K, feature_axis, f"(layout has {K} outputs)")
    if n_x != n_dy:
        raise ValueError(f"x and dy: expected the same N, got {n_x} and {n_dy}")
    try:
        beta = float(beta)
    except (TypeError, ValueError):
        raise TypeError(f"beta: expected a number, got {beta!r}") from None
    if out is None and beta != 0:
        raise ValueError("beta: accumulating (beta != 0) needs out=")
    if out is not None:
        check_shape(ops[2], layout.w_shape)
        if ops[2].kind == "numpy":
            raise TypeError("out: expected a device array (a NumPy out= would be a copy)")
        _arrays.check_disjoint(ops[2], (x, dy))
    if dbias_dtype is not None and dbias_dtype not in _own_or_fp32(x.dtype):
        raise TypeError(f"dbias_dtype: expected one of {list(_own_or_fp32(x.dtype))} (x is {x.dtype}), "
                        f"got {dbias_dtype!r}")

    stream = launch_stream(ops)
    if out is None:
        native, dw = x.empty(layout.w_shape, stream, dtype=out_dtype)
    else:
        native, dw = ops[2].native, ops[2].device(stream)
    db = None if dbias_dtype is None else x.empty((K,), stream, dtype=dbias_dtype)
    if layout.n_blocks:
        launched = launch_weight_grad(cfg, dw, x, dy, layout, n_x, feature_axis, beta, stream, version, splits,
                                      out_dtype, None if db is None else (db[1], dbias_dtype))
        keep_weight_grad_plan(cfg, x, dy, None if out is None else ops[2], layout, feature_axis, beta, given,
                              splits, launched, given_dtype, out_dtype, dbias_dtype)
    elif db is not None:
        launch_column_sums(db[1], dbias_dtype, dy, layout, n_x, feature_axis, stream)
    if out is not None and not (SIMULATOR and ops[2].kind == "torch"):
        result = out  # the caller's own array (an Operand holds a detached torch view of it)
    else:
        result = (x if out is None else ops[2]).result(native, dw, stream)
    return result if db is None else (result, x.result(db[0], db[1], stream))


@on_arrays_device
def transpose_blocks(w: Array, layout: BlockLayout, config: Optional[BsmmConfig] = None) -> Array:
    """W's blocks transposed into the layout's column order: ``wt[p] = w[layout.col_block[p]]ᵀ``
    (fp32, fp16 or bf16, ``w`` 4-byte aligned), as the forward makes for itself where
    `BsmmConfig.v5_transposed_forward` names its block size and storage, at its rows or more."""
    cfg = as_config(config)
    check_layout(layout)
    w = Operand(w, "w")
    check_dtype(w, V5_STORAGE)
    w.require_contiguous()
    check_shape(w, layout.w_shape)
    stream = launch_stream((w,))
    native, wt = w.empty(layout.w_shape, stream)
    w_device = w.device(stream)
    if not aligned(data_pointer(w_device), 4, 1):
        raise ValueError("w: expected a 4-byte aligned array (its blocks are read as 32-bit words)")
    launch_transpose_blocks(cfg, words(wt), words(w_device), layout, w.dtype, stream)
    return w.result(native, wt, stream)


@on_arrays_device
def block_norms(a: Array, block_size: int, criterion: str = "l2", config: Optional[BsmmConfig] = None) -> Array:
    """Norms of the ``block_size``-square blocks of a dense 2-D ``a`` (R, S), as (R/bs, S/bs):
    ``criterion`` ``"l2"``, ``"l1"`` or ``"max"`` (see `block_norms`). fp32 (fp64 for fp64 ``a``).
    For an ``nn.Linear`` weight (out, in), the layout's (in, out) grid is the result transposed."""
    cfg = as_config(config)
    if criterion not in CRITERIA:
        raise ValueError(f"criterion: expected one of {CRITERIA}, got {criterion!r}")
    bs = check_block_size(block_size)
    a = Operand(a, "a")
    check_dtype(a)
    a.require_contiguous()
    if len(a.shape) != 2 or a.shape[0] % bs or a.shape[1] % bs:
        raise ValueError(f"a: expected a 2-D array whose sides are multiples of block_size {bs}, got shape {a.shape}")
    stream = launch_stream((a,))
    grid = (a.shape[0] // bs, a.shape[1] // bs)
    acc = "float64" if a.dtype == "float64" else "float32"
    native, out = a.empty(grid, stream, dtype=acc)
    if grid[0] and grid[1]:
        kernel = compiled(cfg, make_block_norms, bs, a.dtype, criterion)
        launch(kernel, (grid[1], grid[0]), norm_threads(cfg, bs), stream, (out, a.device(stream)))
    return a.result(native, out, stream)


# -- initialization and normalization on the device (`normalize.py`) ---------------------


@on_arrays_device
def identity_init(layout: BlockLayout, like: Array, scale: float = 1.0, config: Optional[BsmmConfig] = None) -> Array:
    """Weights ``(n_blocks, bs, bs)`` that are ``scale`` times the identity on the layout's
    diagonal blocks and zero elsewhere (OpenAI's ``identity_init``), as an array of ``like``'s
    kind, dtype and device (``like``: any array of the layout's ``w_shape``)."""
    cfg = as_config(config)
    check_layout(layout)
    op = Operand(like, "like")
    check_dtype(op)
    check_shape(op, layout.w_shape)
    stream = launch_stream((op,))
    native, w = op.empty(layout.w_shape, stream)
    n = layout.n_blocks * layout.block_size ** 2
    if n:
        kernel = compiled(cfg, make_identity, layout.block_size, op.dtype)
        launch(kernel, max(1, min(-(-n // 256), 1024)), 256, stream, (w, _index(layout, "coords", stream), float(scale)))
    return op.result(native, w, stream)


@on_arrays_device
def ortho_init(layout: BlockLayout, like: Array, seed: int = 0, scale: float = 1.0,
               config: Optional[BsmmConfig] = None) -> Array:
    """Weights ``(n_blocks, bs, bs)`` whose every block-column (its stacked blocks: the inputs it
    connects by bs outputs) has orthonormal columns, times ``scale`` (OpenAI's ``ortho_init``): the
    Q of a Gaussian matrix's QR, from Philox bits under ``seed`` (one result a seed, on every
    device). As an array of ``like``'s kind, dtype and device (``like``: any array of the layout's
    ``w_shape``). Its twin is `sparseblocks.reference.bsmm.ortho_init`."""
    cfg = as_config(config)
    check_layout(layout)
    check_word("seed", seed)
    try:
        scale = float(scale)
    except (TypeError, ValueError):
        raise TypeError(f"scale: expected a number, got {scale!r}") from None
    op = Operand(like, "like")
    check_dtype(op)
    check_shape(op, layout.w_shape)
    stream = launch_stream((op,))
    native, w = op.empty(layout.w_shape, stream)
    if layout.n_blocks:
        work = op.scratch(layout.w_shape, "float32", stream)  # (the sums run in fp32, as the kernels')
        kernel = compiled(cfg, make_ortho, layout.block_size, op.dtype)
        col_ptr, col_block = _index(layout, "col_ptr", stream), _index(layout, "col_block", stream)
        launch(kernel, layout.shape[1], 32, stream, (w, work, col_ptr, col_block, int(seed) & 0xFFFFFFFF,
                                                     int(seed) >> 32, scale))
    return op.result(native, w, stream)


def _normalize_operands(w, layout, gain, extra=()):
    check_layout(layout)
    ops = [Operand(w, "w")] + ([Operand(gain, "gain")] if gain is not None else []) + \
        [Operand(a, name) for name, a in extra]
    check_same_kind(ops)
    for op in ops:
        check_dtype(op)
        op.require_contiguous()
    check_shape(ops[0], layout.w_shape)
    if gain is not None:
        check_shape(ops[1], (layout.dense_shape[1],))
    for op in ops[1 + (gain is not None):]:
        check_shape(op, layout.w_shape)
        if op.dtype != ops[0].dtype:
            raise TypeError(f"dtype mismatch: w {ops[0].dtype}, {op.name} {op.dtype}")
    return ops


def _epsilon(epsilon):
    try:
        epsilon = float(epsilon)
    except (TypeError, ValueError):
        raise TypeError(f"epsilon: expected a number, got {epsilon!r}") from None
    if not epsilon > 0:
        raise ValueError(f"epsilon: expected a number > 0, got {epsilon}")
    return epsilon


@on_arrays_device
def l2_normalize(w: Array, layout: BlockLayout, gain: Optional[Array] = None, epsilon: float = 1e-6,
                 config: Optional[BsmmConfig] = None) -> Array:
    """OpenAI's ``l2_normalize``: each output feature's column of the dense W (its entries in the
    layout's blocks) divided by its l2 norm, ``rsqrt(max(Σ W[:, k]², epsilon))``, times
    ``gain[k]`` where given (K,). Returns a new array like ``w``."""
    cfg = as_config(config)
    epsilon = _epsilon(epsilon)
    ops = _normalize_operands(w, layout, gain)
    stream = launch_stream(ops)
    native, out = ops[0].empty(layout.w_shape, stream)
    normalize, _ = compiled(cfg, make_l2_normalize, layout.block_size, ops[0].dtype,
                            ops[1].dtype if gain is not None else ops[0].dtype, gain is not None)
    w_dev = ops[0].device(stream)
    if layout.n_blocks:
        launch(normalize, layout.shape[1], layout.block_size, stream,
               (out, w_dev, ops[1].device(stream) if gain is not None else w_dev.reshape(-1),
                _index(layout, "col_ptr", stream), _index(layout, "col_block", stream), epsilon))
    return ops[0].result(native, out, stream)


@on_arrays_device
def l2_normalize_grad(dy: Array, w: Array, layout: BlockLayout, gain: Optional[Array] = None, epsilon: float = 1e-6,
                      config: Optional[BsmmConfig] = None) -> Tuple[Array, Optional[Array]]:
    """(dw, dgain) of `l2_normalize` for ``dy`` (w's shape); dgain None without a gain."""
    cfg = as_config(config)
    epsilon = _epsilon(epsilon)
    ops = _normalize_operands(w, layout, gain, (("dy", dy),))
    w_op, dy_op = ops[0], ops[-1]
    stream = launch_stream(ops)
    dw_native, dw = w_op.empty(layout.w_shape, stream)
    g_op = ops[1] if gain is not None else None
    dg_native, dg = g_op.empty(g_op.shape, stream) if g_op is not None else (None, None)
    _, grad = compiled(cfg, make_l2_normalize, layout.block_size, w_op.dtype,
                       g_op.dtype if g_op is not None else w_op.dtype, g_op is not None)
    w_dev = w_op.device(stream)
    if layout.n_blocks:
        flat = w_dev.reshape(-1)
        launch(grad, layout.shape[1], layout.block_size, stream,
               (dw, dg if dg is not None else flat, dy_op.device(stream), w_dev,
                g_op.device(stream) if g_op is not None else flat, _index(layout, "col_ptr", stream),
                _index(layout, "col_block", stream), epsilon))
    elif dg is not None:
        from ..sbnet.dispatch import zero

        zero(dg, stream)
    return w_op.result(dw_native, dw, stream), (g_op.result(dg_native, dg, stream) if g_op is not None else None)
