"""Quantized images and their convolutions: validate, then launch.

* `quantize_image(x, basis, signed=False)`: a `QuantImage` of an image batch (N, C, H, W), or
  (N, H, W, C) with ``channels_last``: K bit planes of each pixel's channels, 32 a word;
* `quantize_filters(weight, basis)`: the same for a filter bank (O, C, R, S), ±1 codes and a basis
  an output channel (a filter bank packs as O images of R x S pixels);
* `conv2d(a, w, stride, padding, dilation, bias=None, relu=False)`: ``y = â ⋆ ŵ`` from the
  planes, channels last (N, P, Q, O), by the 1-bit tensor cores' implicit GEMM (`tensorcore`)
  or the teaching kernel (`simple.make_simt_conv`). Only the output is written as floats.

Activations take 0/1 codes (post-ReLU, as LQ-Nets quantizes them), so zero padding is exact: a
tap outside the image contributes nothing. The NumPy twin is `reference.quant.conv2d`.
"""

from typing import Any, Optional

import numpy as np

from ..runtime.arrays import Array, Operand, check_dtype, launch_stream
from ..runtime.compile import cached
from ..runtime.devices import on_arrays_device
from ..runtime.launch import launch
from .api import OUT_DTYPES, VERSIONS, BitPlanes, _basis_rows, _groups, _like, levels, planes_and_bias
from .config import QuantConfig, as_config
from .pack import make_pack_image
from .simple import make_simt_conv
from .tensorcore import block_warps, make_tensorcore_product, row_groups

WORD = 32
PACK_THREADS = 128


class QuantImage(BitPlanes):
    """A quantized image batch: K bit planes ``(K, N, H, W, words)`` uint32 (channel c of a pixel
    is bit ``c % 32`` of its word ``c // 32``; zero bits past C), its basis ``(T, K)`` fp32 (T = N:
    a basis an image, a filter bank's output channels; or 1), the channel count and whether the
    codes are ±1 (``signed``). Arrays of the caller's kind, as `QuantArray`'s are."""

    def __init__(self, planes, basis, channels, signed):
        self.planes, self.basis, self.channels, self.signed = planes, basis, int(channels), bool(signed)
        if len(planes.shape) != 5:
            raise ValueError(f"planes: expected (bits, N, H, W, words), got shape {tuple(planes.shape)}")
        bits, images, _, _, words = planes.shape
        if words != -(-self.channels // WORD):
            raise ValueError(f"planes: expected {-(-self.channels // WORD)} words a pixel for {channels} channels, "
                             f"got {words}")
        self._check_bases(bits, images)

    @property
    def shape(self):
        """(N, C, H, W), as the float batch it stands for."""
        _, images, height, width, _ = self.planes.shape
        return (images, self.channels, height, width)

    def __repr__(self):
        return f"QuantImage(shape={self.shape}, bits={self.bits}, signed={self.signed})"


@on_arrays_device
def quantize_image(x: Array, basis: Any, signed: bool = False, channels_last: bool = False,
                   config: Optional[QuantConfig] = None) -> QuantImage:
    """Encode an image batch ``x`` (N, C, H, W) (``channels_last``: (N, H, W, C)), fp16 or fp32,
    to its nearest levels and pack each pixel's channels: a `QuantImage`. ``basis`` (K,) or (N, K)
    on the host. A NaN takes the lowest level."""
    x_op = Operand(x, "x")
    check_dtype(x_op, ("float16", "float32"))
    x_op.require_contiguous()
    if len(x_op.shape) != 4:
        raise ValueError(f"x: expected a 4-D array ({'N, H, W, C' if channels_last else 'N, C, H, W'}), "
                         f"got shape {x_op.shape}")
    images = x_op.shape[0]
    basis = _basis_rows(basis, images, "basis")
    _, order, thresholds = levels(basis, signed)
    return pack_image(x_op, thresholds.astype(np.float32), order.astype(np.int32), basis, signed, channels_last,
                      as_config(config))


def quantize_filters(weight: Array, basis: Any, config: Optional[QuantConfig] = None) -> QuantImage:
    """A filter bank ``weight`` (O, C, R, S) with ±1 codes and a basis an output channel (O, K)."""
    return quantize_image(weight, basis, signed=True, config=config)


def pack_image(x_op, thresholds, order, basis, signed, channels_last, cfg):
    """Launch the image packing kernel on ``x_op`` (an `Operand` of a 4-D batch): thresholds
    (T, 2^K - 1), codes (T, 2^K) and basis (T, K), host or device arrays (T = N or 1)."""
    if channels_last:
        images, height, width, channels = x_op.shape
        strides = (height * width * channels, 1, channels)
    else:
        images, channels, height, width = x_op.shape
        strides = (channels * height * width, height * width, 1)
    bits = basis.shape[1]
    words = -(-channels // WORD)
    stream = launch_stream((x_op,))
    native, planes = x_op.empty((bits, images, height, width, words), stream, dtype="uint32")
    rows = images * height * width
    if rows and words:
        flat = Operand(x_op.native.reshape(-1), x_op.name)
        kernel = cached(make_pack_image, cfg, bits, basis.shape[0] != 1)
        tables = [Operand(table, name).device(stream) for table, name in ((thresholds, "thresholds"), (order, "order"))]
        launch(kernel, (-(-rows // PACK_THREADS), words), PACK_THREADS, stream,
               (planes.reshape(bits, rows, words), flat.device(stream), *tables, channels, height * width, *strides))
    planes = x_op.result(native, planes, stream)
    if isinstance(basis, np.ndarray):
        basis = _like(x_op, np.ascontiguousarray(basis, np.float32), stream)
    return QuantImage(planes, basis, channels, signed)


def _pair(value, name, low):
    pair = (value, value) if isinstance(value, (int, np.integer)) else tuple(value)
    if len(pair) != 2 or not all(isinstance(v, (int, np.integer)) and v >= low for v in pair):
        raise ValueError(f"{name}: expected an int or two ints of at least {low}, got {value!r}")
    return tuple(int(v) for v in pair)


def _steps(stride, padding, dilation):
    """((SH, SW), (PH, PW), (DH, DW)): a convolution's strides, padding and dilations, checked."""
    return _pair(stride, "stride", 1), _pair(padding, "padding", 0), _pair(dilation, "dilation", 1)


def output_shape(a_shape, w_shape, stride=1, padding=0, dilation=1):
    """(N, P, Q, O) of a convolution of a batch (N, C, H, W) by filters (O, C, R, S)."""
    return _output_shape(a_shape, w_shape, *_steps(stride, padding, dilation))


def _output_shape(a_shape, w_shape, strides, pads, dilations):
    N, _, H, W = a_shape
    O, _, R, S = w_shape
    (sh, sw), (ph, pw), (dh, dw) = strides, pads, dilations
    return (N, (H + 2 * ph - dh * (R - 1) - 1) // sh + 1, (W + 2 * pw - dw * (S - 1) - 1) // sw + 1, O)


@on_arrays_device
def conv2d(a: QuantImage, w: QuantImage, stride: Any = 1, padding: Any = 0, dilation: Any = 1,
           bias: Optional[Array] = None, relu: bool = False, out_dtype: str = "float32", version: str = "tensorcore",
           config: Optional[QuantConfig] = None) -> Array:
    """``y = â ⋆ ŵ (+ bias, ReLU)`` from bit planes, as ``torch.nn.functional.conv2d`` of the
    quantized values (cross-correlation, zero padding): ``a`` a `QuantImage` of activations (0/1
    codes, one basis), ``w`` one of filters (±1 codes, a basis an output channel); ``y`` (N, P, Q,
    O), channels last, in ``out_dtype`` (fp32 or fp16), an array of a's planes' kind."""
    cfg = as_config(config)
    for name, q in (("a", a), ("w", w)):
        if not isinstance(q, QuantImage):
            raise TypeError(f"{name}: expected a QuantImage, got {type(q).__name__}")
    if a.signed or a.basis.shape[0] != 1:
        raise ValueError("a: expected activations: 0/1 codes (signed=False) and one basis for all images")
    if not w.signed or w.basis.shape[0] != w.shape[0]:
        raise ValueError("w: expected filters: ±1 codes (signed=True) and a basis an output channel")
    if a.channels != w.channels:
        raise ValueError(f"w: expected {a.channels} channels (a's), got {w.channels}")
    if out_dtype not in OUT_DTYPES:
        raise ValueError(f"out_dtype: expected one of {OUT_DTYPES}, got {out_dtype!r}")
    if version not in VERSIONS:
        raise ValueError(f"version: expected one of {VERSIONS}, got {version!r}")
    steps = _steps(stride, padding, dilation)
    N, P, Q, O = _output_shape(a.shape, w.shape, *steps)
    if P < 1 or Q < 1:
        raise ValueError(f"w: filters of {w.shape[2:]} (dilated) do not fit the padded {a.shape[2:]} images")
    (sh, sw), (ph, pw), (dh, dw) = steps
    _, C, H, W = a.shape
    R, S = w.shape[2:]
    WC = -(-C // WORD)
    if N * P * Q * O >= 2 ** 31:
        raise ValueError(f"a, w: expected an output of fewer than 2^31 values, got {N * P * Q * O}")
    a_planes, w_planes, bias_values, stream = planes_and_bias(a, w, bias, O)
    native, y = a_planes.empty((N, P, Q, O), stream, dtype=out_dtype)
    geometry = (H, W, P, Q, R, S, sh, sw, ph, pw, dh, dw, WC)
    if N and O:
        a_basis, w_basis = Operand(a.basis, "a.basis").device(stream)[0], Operand(w.basis, "w.basis").device(stream)
        if version == "simt":
            kernel = cached(make_simt_conv, cfg, a.bits, w.bits, bias is not None, bool(relu), geometry)
            grid = (-(-O // cfg.simt_cols), -(-(N * P * Q) // cfg.simt_rows))
            launch(kernel, grid, (cfg.simt_cols, cfg.simt_rows), stream,
                   (y, a_planes.device(stream), w_planes.device(stream), a_basis, w_basis, bias_values))
        else:
            pixels = N * P * Q
            group_cols = min(cfg.dense_cols, -(-O // 8) * 8)
            ptr, blocks, _, _, _ = _groups(None, WORD * R * S * WC, O, group_cols, stream)
            flat = [Operand(q.planes.reshape(-1), name) for q, name in ((a, "a.planes"), (w, "w.planes"))]
            warps_m, warps_n = block_warps(cfg, a.bits, pixels, group_cols)
            kernel = cached(make_tensorcore_product, cfg, a.bits, w.bits, False, True, bias is not None, bool(relu),
                            R * S * WC, group_cols, warps_m, warps_n, O % 2 == 0, geometry)
            grid = (len(ptr) - 1, row_groups(cfg, pixels, a.bits, warps_m))
            launch(kernel, grid, warps_m * warps_n * 32, stream,
                   (y.reshape(-1), flat[0].device(stream), flat[1].device(stream), a_basis, w_basis, bias_values, ptr,
                    blocks, 0, pixels, O, R * S * WC))
    return a_planes.result(native, y, stream)
