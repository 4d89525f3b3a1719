"""Quantized arrays and their products: validate, then launch.

* `quantize(x, basis, signed)`: a `QuantArray` of x's rows, K bit planes packed 32 values a word;
* `dequantize(q)`: its values, ``Σ_k v_k e_k``, as fp32;
* `matmul(a, w, layout=None, bias=None, relu=False, out_dtype="float32")`: ``y = â · ŵᵀ`` from
  the planes (activations (N, C) with one basis, weights (O, C) with a basis a row), over the
  present blocks of a `BlockLayout` of the (C, O) grid when one is given.
"""

from typing import Any, Optional

import numpy as np

from ..layout import BlockLayout, check_layout
from ..runtime.arrays import Array, Operand, check_dtype, launch_stream
from ..runtime.backend import SIMULATOR
from ..runtime.compile import cached
from ..runtime.devices import active, on_arrays_device
from ..runtime.launch import data_pointer, launch, shared_memory_limit
from ..ptx.vector import aligned, fours_fit
from .config import QuantConfig, as_config
from .pack import make_pack, make_pack_words, make_unpack
from .simple import make_simt_product
from .ring import make_ring_product, make_row_counts, ring_fits
from .tensorcore import block_warps, make_tensorcore_product, row_groups, vector_words, warp_rows

MAX_BITS = 4
WORD = 32
WORD_ALIGN = 8  # words a packed row is padded to: one 256-bit step of the b1 mma
VERSIONS = ("simt", "tensorcore")
OUT_DTYPES = ("float32", "float16")
PACK_THREADS = 128  # threads a block of `make_pack_words`


def _words_of(array, kind):
    """An fp16 (R, C) device array or tensor (an `Operand`'s ``kind``) as 32-bit words (R, C / 2):
    two values a word."""
    if kind == "torch" and not SIMULATOR:  # (the simulator's torch operands are device arrays)
        import torch

        return array.view(torch.int32)
    return array.view(np.uint32)


def packed_words(columns):
    """Words of a packed row of `columns` values, padded to whole `WORD_ALIGN` words."""
    words = -(-columns // WORD)
    return -(-words // WORD_ALIGN) * WORD_ALIGN


def levels(basis, signed):
    """(sorted levels, each one's code, thresholds between them) of bases (T, K), in float64:
    codes ``e`` over {-1, +1}^K (``signed``) or {0, 1}^K, bit k of a code the bit of e_k."""
    basis = np.asarray(basis, np.float64)
    K = basis.shape[-1]
    bits = (np.arange(2 ** K)[:, None] >> np.arange(K)[None, :]) & 1
    values = basis @ ((2 * bits - 1) if signed else bits).T
    order = np.argsort(values, axis=-1, kind="stable")
    sorted_values = np.take_along_axis(values, order, -1)
    return sorted_values, order, (sorted_values[..., 1:] + sorted_values[..., :-1]) / 2


class BitPlanes:
    """What the quantized containers share: K bit planes first in ``planes`` (of the caller's
    kind, passed on through ``__cuda_array_interface__``), a basis ``(T, K)`` (T: a row each, or 1),
    and whether the codes are ±1 (``signed``)."""

    def _check_bases(self, bits, rows):
        if not 1 <= bits <= MAX_BITS:
            raise ValueError(f"planes: expected 1 to {MAX_BITS} bit planes, got {bits}")
        if tuple(self.basis.shape) not in ((1, bits), (rows, bits)):
            raise ValueError(f"basis: expected (1, {bits}) or ({rows}, {bits}), got {tuple(self.basis.shape)}")

    @property
    def bits(self):
        return self.planes.shape[0]

    @property
    def device(self):
        """Its planes' device (a torch tensor's or CuPy array's; None for NumPy arrays): the calls
        that take it run there (`runtime.devices`)."""
        return getattr(self.planes, "device", None)

    @property
    def __cuda_array_interface__(self):
        return self.planes.__cuda_array_interface__


class QuantArray(BitPlanes):
    """A quantized 2-D array: K bit planes ``(K, rows, words)`` uint32 (bit ``c % 32`` of word
    ``c // 32`` holds value c's bit; zero bits past the row), its basis ``(T, K)`` fp32 (T = rows:
    a basis a row, or 1: one for all), whether the codes are ±1 (``signed``) or 0/1, and the
    logical shape ``(rows, columns)``. ``planes`` and ``basis`` are arrays of the caller's kind;
    on a GPU the object passes its planes on through ``__cuda_array_interface__``."""

    def __init__(self, planes, basis, columns, signed):
        self.planes, self.basis, self.columns, self.signed = planes, basis, int(columns), bool(signed)
        bits, rows, words = planes.shape
        if words != packed_words(self.columns):
            raise ValueError(f"planes: expected {packed_words(self.columns)} words a row for {columns} columns, "
                             f"got {words}")
        self._check_bases(bits, rows)

    @property
    def shape(self):
        return (self.planes.shape[1], self.columns)

    def __repr__(self):
        return (f"QuantArray(shape={self.shape}, bits={self.bits}, signed={self.signed}, "
                f"basis={'a row' if self.basis.shape[0] != 1 else 'shared'})")


def _basis_rows(basis, rows, name):
    basis = np.asarray(basis, np.float32)
    if basis.ndim == 1:
        basis = basis[None, :]
    if basis.ndim != 2 or basis.shape[0] not in (1, rows) or not 1 <= basis.shape[1] <= MAX_BITS:
        raise ValueError(f"{name}: expected (K,) or ({rows}, K) with K from 1 to {MAX_BITS}, got shape {basis.shape}")
    if not np.isfinite(basis).all():
        raise ValueError(f"{name}: expected finite values")
    return basis


@on_arrays_device
def quantize(x: Array, basis: Any, signed: bool, config: Optional[QuantConfig] = None) -> QuantArray:
    """Encode the rows of ``x`` (R, C) (fp16 or fp32) to their nearest levels and pack the codes'
    bits: a `QuantArray` whose planes are arrays of x's kind. ``basis`` (K,) or (R, K), on the
    host (its thresholds are made there). A NaN takes the lowest level."""
    cfg = as_config(config)
    x_op = Operand(x, "x")
    check_dtype(x_op, ("float16", "float32"))
    x_op.require_contiguous()
    if len(x_op.shape) != 2:
        raise ValueError(f"x: expected a 2-D array (rows, columns), got shape {x_op.shape}")
    rows, columns = x_op.shape
    basis = _basis_rows(basis, rows, "basis")
    _, order, thresholds = levels(basis, signed)
    return pack(x_op, thresholds.astype(np.float32), order.astype(np.int32), basis, signed, cfg)


def pack(x_op, thresholds, order, basis, signed, cfg):
    """Launch the quantize-and-pack kernel on the rows of ``x_op`` (an `Operand`): thresholds
    (T, 2^K - 1) fp32, the code of each sorted level (T, 2^K) int32 and the basis (T, K) fp32,
    host or device arrays (the torch layer makes them on the device). The planes come back as an
    array of x's kind, with the basis as given (a host basis as an array of x's kind)."""
    rows, columns = x_op.shape
    bits = basis.shape[1]
    stream = launch_stream((x_op,))
    words = packed_words(columns)
    native, planes = x_op.empty((bits, rows, words), stream, dtype="uint32")
    per_row = basis.shape[0] != 1
    tables = [Operand(table, name).device(stream) for table, name in ((thresholds, "thresholds"), (order, "order"))]
    x_dev = x_op.device(stream)
    if rows and words and cfg.pack_vector and columns % WORD == 0 and aligned(data_pointer(x_dev), 16, 1):
        half = x_op.dtype == "float16"
        kernel = cached(make_pack_words, cfg, bits, per_row, half)
        launch(kernel, (-(-words // PACK_THREADS), rows), PACK_THREADS, stream,
               (planes, _words_of(x_dev, x_op.kind) if half else x_dev, *tables, columns))
    elif rows and words:
        warps = min(cfg.pack_warps, -(-words // cfg.pack_words))  # (no warp without words)
        grid = (-(-words // (warps * cfg.pack_words)), rows)
        kernel = cached(make_pack, cfg, bits, per_row)
        launch(kernel, grid, warps * 32, stream, (planes, x_dev, *tables, columns))
    planes = x_op.result(native, planes, stream)
    if isinstance(basis, np.ndarray):
        basis = _like(x_op, np.ascontiguousarray(basis, np.float32), stream)
    return QuantArray(planes, basis, columns, signed)


def _on_device(array, stream):
    from numba import cuda

    return cuda.to_device(np.ascontiguousarray(array), stream=stream)


_zeros: dict = {}


def _no_bias(stream):
    ordinal = active()
    if ordinal not in _zeros:
        _zeros[ordinal] = _on_device(np.zeros(1, np.float32), stream)
    return _zeros[ordinal]


def _like(op, host, stream):
    """A host array as an array of op's kind (numpy stays numpy)."""
    if op.kind == "numpy":
        return host
    if op.kind == "torch":
        import torch

        return torch.as_tensor(host, device=op.native.device)
    if op.kind == "cupy":
        import cupy

        with op.native.device:
            return cupy.asarray(host)
    return _on_device(host, stream)


@on_arrays_device
def dequantize(q: QuantArray, config: Optional[QuantConfig] = None) -> Array:
    """The values of a `QuantArray`, fp32 (rows, columns), as an array of its planes' kind."""
    cfg = as_config(config)
    planes = Operand(q.planes, "q.planes")
    stream = launch_stream((planes,))
    rows, columns = q.shape
    native, out = planes.empty((rows, columns), stream, dtype="float32")
    if rows and columns:
        kernel = cached(make_unpack, cfg, q.bits, q.signed, q.basis.shape[0] != 1)
        launch(kernel, (-(-columns // 128), rows), 128, stream,
               (out, planes.device(stream), Operand(q.basis, "q.basis").device(stream), columns))
    return planes.result(native, out, stream)


_dense_groups: dict = {}


def _groups(layout, columns, outputs, group_cols, stream):
    """(ptr, blocks, block_words, group_cols, values a block), the first two on the device (made
    once, then kept: a dense shape's here, a layout's in its schedule cache): the input blocks
    each group of outputs sees. Dense: every row's words as one block, groups of `group_cols`
    outputs; a layout: its block-columns' present blocks (CSC), a group a block-column."""
    if layout is None:
        key = (columns, outputs, group_cols, active())
        if key not in _dense_groups:
            groups = -(-outputs // group_cols)
            _dense_groups[key] = (_on_device(np.arange(groups + 1, dtype=np.int32), stream),
                                  _on_device(np.zeros(max(groups, 1), np.int32), stream))
        return (*_dense_groups[key], packed_words(columns), group_cols, columns)
    bs = layout.block_size
    cache = layout._schedules
    key = ("quant", "groups", active())
    if key not in cache:
        blocks = np.asarray(layout.row_idx, np.int32)
        cache[key] = (_on_device(np.asarray(layout.col_ptr, np.int32), stream),
                      _on_device(blocks if len(blocks) else np.zeros(1, np.int32), stream))
    return (*cache[key], bs // WORD, bs, bs)


def planes_and_bias(a, w, bias, O):
    """A product's or convolution's (a's and w's planes as `Operand`, the bias (O,) fp32 on the
    device, or a zero where none, the call's stream), after checking them: planes of fewer than 2^31
    words (the tensor-core kernels' word offsets are 32-bit) and the bias's shape and dtype."""
    for name, q in (("a", a), ("w", w)):
        words = int(np.prod(q.planes.shape))
        if words >= 2 ** 31:
            raise ValueError(f"{name}: expected fewer than 2^31 words of planes, got {words}")
    a_planes, w_planes = Operand(a.planes, "a.planes"), Operand(w.planes, "w.planes")
    stream = launch_stream((a_planes, w_planes))
    if bias is None:
        return a_planes, w_planes, _no_bias(stream), stream
    bias_op = Operand(bias, "bias")
    check_dtype(bias_op, ("float32",))
    if bias_op.shape != (O,):
        raise ValueError(f"bias: expected shape ({O},), got {bias_op.shape}")
    return a_planes, w_planes, bias_op.device(stream), stream


def _row_counts(owner, flat, rows, words, needed, stream):
    """The (rows,) int32 bit counts of ``flat``'s rows of ``words`` (`ring.make_row_counts`), a
    scratch array of ``owner``'s kind; where not ``needed``, one unread element."""
    if not needed:
        return owner.scratch((1,), "int32", stream)
    out = owner.scratch((rows,), "int32", stream)
    launch(cached(make_row_counts), -(-rows // 8), 256, stream, (out, flat, rows, words))
    return out


def _copies_fit(block_words, words, *planes):
    """Whether a layout's blocks of ``block_words`` words are whole copies of the ring (4 or 8
    bytes): the rows of ``words`` and the planes' addresses aligned to them."""
    size = 4 * vector_words(block_words)
    return (words * 4) % size == 0 and all(data_pointer(p) % size == 0 for p in planes)


def _check_layout(layout, columns, outputs):
    check_layout(layout)
    if layout.block_size < WORD:
        raise ValueError(f"layout: expected a block size of 32 or 64 (whole words of bits), got {layout.block_size}")
    if layout.dense_shape != (columns, outputs):
        raise ValueError(f"layout: expected a ({columns}, {outputs}) grid (inputs, outputs), got {layout.dense_shape}")


@on_arrays_device
def matmul(a: QuantArray, w: QuantArray, layout: Optional[BlockLayout] = None, bias: Optional[Array] = None,
           relu: bool = False, out_dtype: str = "float32", version: str = "tensorcore",
           config: Optional[QuantConfig] = None) -> Array:
    """``y = â · ŵᵀ (+ bias, ReLU)`` from bit planes: ``a`` a `QuantArray` of activations (N, C)
    with one basis, ``w`` one of weights (O, C) with a basis a row; ``y`` (N, O) in ``out_dtype``
    (fp32 or fp16), an array of a's planes' kind. With a ``layout`` (a `BlockLayout` of the
    (C, O) grid, blocks of 32 or 64) only its present blocks are summed, as the weight masked by
    the layout. ``version``: "tensorcore" (b1 ``mma.sync``) or "simt" (the teaching kernel)."""
    cfg = as_config(config)
    for name, q in (("a", a), ("w", w)):
        if not isinstance(q, QuantArray):
            raise TypeError(f"{name}: expected a QuantArray, got {type(q).__name__}")
    if a.columns != w.columns:
        raise ValueError(f"w: expected {a.columns} columns (a's), got {w.columns}")
    if a.basis.shape[0] != 1:
        raise ValueError("a: expected one basis for all rows (activations)")
    if w.basis.shape[0] != w.shape[0]:
        raise ValueError(f"w: expected a basis a row ({w.shape[0]}, K) (weights), got {tuple(w.basis.shape)}")
    if out_dtype not in OUT_DTYPES:
        raise ValueError(f"out_dtype: expected one of {OUT_DTYPES}, got {out_dtype!r}")
    if version not in VERSIONS:
        raise ValueError(f"version: expected one of {VERSIONS}, got {version!r}")
    N, C = a.shape
    O = w.shape[0]
    if layout is not None:
        _check_layout(layout, C, O)
    a_planes, w_planes, bias_values, stream = planes_and_bias(a, w, bias, O)
    native, y = a_planes.empty((N, O), stream, dtype=out_dtype)
    if N and O:
        # (a dense product's group no wider than O, rounded up to an mma's 8 columns)
        ptr, blocks, block_words, group_cols, seen = _groups(layout, C, O, min(cfg.dense_cols, -(-O // 8) * 8),
                                                             stream)
        key = (a.bits, w.bits, a.signed, w.signed, bias is not None, bool(relu), block_words, group_cols)
        a_basis, w_basis = Operand(a.basis, "a.basis").device(stream)[0], Operand(w.basis, "w.basis").device(stream)
        if version == "simt":
            kernel = cached(make_simt_product, cfg, *key)
            grid = (-(-O // cfg.simt_cols), -(-N // cfg.simt_rows))
            launch(kernel, grid, (cfg.simt_cols, cfg.simt_rows), stream,
                   (y, a_planes.device(stream), w_planes.device(stream), a_basis, w_basis, bias_values, ptr, blocks,
                    seen))
        else:
            # (flat planes and output: a thread's row addresses are made once, then words added)
            flat = [Operand(array.reshape(-1), name) for array, name in ((a.planes, "a.planes"), (w.planes, "w.planes"))]
            warps_m, warps_n = block_warps(cfg, a.bits, N, group_cols)
            grid = (len(ptr) - 1, -(-N // (warps_m * warp_rows(cfg, a.bits))))
            a_flat, w_flat, words = flat[0].device(stream), flat[1].device(stream), a.planes.shape[2]
            ring = ring_fits(cfg, a.bits, w.bits, group_cols, warps_m, warps_n, shared_memory_limit())
            if layout is None and words % 4 == 0 and ring and fours_fit(a_flat, w_flat):  # (16-byte copies)
                # (the planes' rows' bit counts, where the other side is signed)
                a_counts = _row_counts(a_planes, a_flat, a.bits * N, words, w.signed, stream)
                w_counts = _row_counts(a_planes, w_flat, w.bits * O, words, a.signed, stream)
                kernel = cached(make_ring_product, cfg, *key[:6], group_cols, warps_m, warps_n, O % 2 == 0)
                launch(kernel, grid, warps_m * warps_n * 32, stream,
                       (y.reshape(-1), a_flat, w_flat, a_basis, w_basis, bias_values, a_counts, w_counts, ptr, blocks,
                        N, O, words, seen))
            elif layout is not None and cfg.ring_lists and ring and _copies_fit(block_words, words, a_flat, w_flat):
                # (a layout's word lists, a block a 4- or 8-byte copy; the counts from the stages)
                kernel = cached(make_ring_product, cfg, *key[:6], group_cols, warps_m, warps_n, O % 2 == 0,
                                block_words)
                launch(kernel, grid, warps_m * warps_n * 32, stream,
                       (y.reshape(-1), a_flat, w_flat, a_basis, w_basis, bias_values, ptr, ptr, ptr, blocks, N, O,
                        words, seen))
            else:
                kernel = cached(make_tensorcore_product, cfg, *key, warps_m, warps_n, O % 2 == 0)
                grid = (len(ptr) - 1, row_groups(cfg, N, a.bits, warps_m))
                launch(kernel, grid, warps_m * warps_n * 32, stream,
                       (y.reshape(-1), a_flat, w_flat, a_basis, w_basis, bias_values, ptr, blocks, seen, N, O, words))
    return a_planes.result(native, y, stream)

