"""`LQLinear` and `QuantConv2d`: a linear layer and a 2-D convolution with LQ-Nets' learned weight
and activation quantizers.

Weights are quantized to ``w_bits`` with ±1 codes and a basis a output channel, activations to
``a_bits`` with 0/1 codes (±1 with ``signed_activations``) and one shared basis. In training the
forward quantizes in torch (levels, thresholds and ``searchsorted``, all on the device), the
gradients pass straight through (`_StraightThrough`: identity for weights, zero above the
largest level for activations), and each call refits the bases by LQ-Nets' QEM step (the least
squares basis of the current codes, as a moving average). Without gradients on a GPU the layer
quantizes and packs both operands into bit planes and runs the 1-bit tensor-core product
(`sparseblocks.quant`): no float of x̂ or ŵ is written. ``layout`` (a `BlockLayout` of the
(in, out) grid, as `BlockSparseLinear` takes) keeps only its blocks.

`QuantConv2d` does the same for ``torch.nn.functional.conv2d``: filters (out, in, R, S) with a basis
an output channel, activations with 0/1 codes (post-ReLU), and without gradients on a GPU the
images and filters packed along their channels and the implicit-GEMM b1 convolution
(`sparseblocks.quant.conv2d`); its output is then a channels-last tensor (NCHW shape, NHWC memory).
"""

import math
from typing import Any, Dict, Optional, Union

import torch

from .. import quant
from ..layout import BlockLayout, check_layout
from ..runtime.arrays import Operand
from ..runtime.devices import on_arrays_device

MOVING_AVERAGE = 0.9
RIDGE = 1e-4
NORM_PPF_0_75 = 0.6745


def _codes(bits, signed, like):
    """The (2^K, K) code values, row i the code whose bit k is bit k of i."""
    i = torch.arange(2 ** bits, device=like.device)[:, None]
    e = ((i >> torch.arange(bits, device=like.device)[None, :]) & 1).to(like.dtype)
    return 2 * e - 1 if signed else e


def levels(basis, signed):
    """(sorted levels (T, 2^K), each one's code (T, 2^K) int32, thresholds (T, 2^K - 1)) of bases (T, K)."""
    values = basis @ _codes(basis.shape[1], signed, basis).T
    sorted_values, order = torch.sort(values, dim=1, stable=True)
    return sorted_values, order.to(torch.int32), (sorted_values[:, 1:] + sorted_values[:, :-1]) / 2


def encode(x, basis, signed):
    """(codes, values) of the rows of x (R, C) under bases (T, K), T = R or 1: a value on a
    threshold takes the lower level, as the kernel's compares do."""
    sorted_values, order, thresholds = levels(basis.float(), signed)
    xf = x.float()
    if basis.shape[0] == 1:
        index = torch.searchsorted(thresholds[0].contiguous(), xf.contiguous(), side="left")
        return order[0][index], sorted_values[0][index]
    index = torch.searchsorted(thresholds.contiguous(), xf.contiguous(), side="left")
    return torch.gather(order, 1, index), torch.gather(sorted_values, 1, index)


def basis_update(x, codes, basis, signed, ridge, momentum=MOVING_AVERAGE):
    """QEM: the least-squares basis of the codes, blended in as a moving average; one basis a row
    where ``basis`` has a row per row of x. A singular fit leaves the basis as it was."""
    K = basis.shape[1]
    e = ((codes[..., None] >> torch.arange(K, device=codes.device)) & 1).to(torch.float32)
    e = 2 * e - 1 if signed else e
    x = x.float()
    if basis.shape[0] == 1:
        e, x = e.reshape(1, -1, K), x.reshape(1, -1)
    gram = torch.einsum("rck,rcl->rkl", e, e) + ridge * torch.eye(K, device=x.device)
    fit, info = torch.linalg.solve_ex(gram, torch.einsum("rck,rc->rk", e, x))
    fit = torch.where((info == 0)[:, None] & torch.isfinite(fit), fit, basis)
    return momentum * basis + (1 - momentum) * fit


class _StraightThrough(torch.autograd.Function):
    """The quantizer's values forward; backward the gradient itself, zeroed above ``top`` (the
    largest level: activations clip there) when given."""

    @staticmethod
    def forward(ctx, x, values, top):
        ctx.save_for_backward(x, top)
        return values.to(x.dtype)

    @staticmethod
    def backward(ctx, grad):
        x, top = ctx.saved_tensors
        if top.numel():
            grad = grad * (x <= top).to(grad.dtype)
        return grad, None, None


def straight_through(x, basis, signed, clip):
    """x's quantized values with the straight-through gradient (clipped above the top level where
    ``clip``)."""
    _, values = encode(x.detach(), basis, signed)
    top = levels(basis.float(), signed)[0][:, -1].max() if clip else x.new_empty(0)
    return _StraightThrough.apply(x, values, top)


class _LearnedQuantizers(torch.nn.Module):
    """The bases of a layer's two quantizers, their QEM steps and the packing kernels' tables.
    The bases are buffers (``w_basis`` (out, w_bits), ``a_basis`` (a_bits,)), saved with the state
    dict and updated in training mode only."""

    def _make_bases(self, outputs, fan_in, w_bits, a_bits, signed_activations, momentum, device, keep_packed):
        for name, bits in (("w_bits", w_bits), ("a_bits", a_bits)):
            if not isinstance(bits, int) or not 1 <= bits <= quant.api.MAX_BITS:
                raise ValueError(f"{name}: expected an int from 1 to {quant.api.MAX_BITS}, got {bits!r}")
        self.w_bits, self.a_bits, self.signed_activations = w_bits, a_bits, bool(signed_activations)
        self.momentum, self.keep_packed = momentum, bool(keep_packed)
        powers = 2.0 ** torch.arange(w_bits, dtype=torch.float32, device=device)
        w_base = NORM_PPF_0_75 * math.sqrt(2.0 / fan_in) / 2 ** (w_bits - 1)
        self.register_buffer("w_basis", (powers * w_base).repeat(outputs, 1))
        a_powers = 2.0 ** torch.arange(a_bits, dtype=torch.float32, device=device)
        self.register_buffer("a_basis", a_powers * 2 * NORM_PPF_0_75 / (2 ** a_bits - 1))

    def _refit(self, w_rows, x):
        """One QEM step of both bases: the weights' rows (out, fan_in), the activations' values."""
        with torch.no_grad():
            w = w_rows.float()
            w_basis = self.w_basis.float()
            codes, _ = encode(w, w_basis, True)
            self.w_basis.copy_(basis_update(w, codes, w_basis, True, RIDGE, self.momentum))
            a = self.a_basis[None].float()
            x = x.reshape(1, -1)
            codes, _ = encode(x, a, self.signed_activations)
            self.a_basis.copy_(basis_update(x, codes, a, self.signed_activations, 0.0, self.momentum)[0])

    def _kept(self, name, key, make):
        """``make()``; with ``keep_packed`` the value kept under ``name`` while ``key`` (what torch
        sees of its inputs: version counters, addresses, dtypes) stays the same."""
        kept = getattr(self, name, None)
        if not self.keep_packed or kept is None or kept[0] != key:
            kept = (key, make())
            setattr(self, name, kept)
        return kept[1]

    def _activation_tables(self):
        """The packing kernels' (thresholds, codes, basis) of the activations, made on the device
        (no host sync). With ``keep_packed`` they are kept until the basis changes as torch sees
        it (in training each call's refit changes it)."""
        def make():
            a_basis = self.a_basis[None].float().contiguous()  # (a layer moved to fp16 moved its bases too)
            _, a_order, a_thresholds = levels(a_basis, self.signed_activations)
            return a_thresholds.contiguous(), a_order.contiguous(), a_basis

        key = (self.a_basis._version, self.a_basis.data_ptr(), self.a_basis.dtype, self.signed_activations)
        return self._kept("_kept_tables", key, make)

    def _fp32_bias(self):
        """The bias as the products add it (fp32, contiguous), or None; with ``keep_packed`` kept
        while it stays as it is (so that an fp16 layer's call does not convert it each time)."""
        if self.bias is None:
            return None
        key = (self.bias._version, self.bias.data_ptr(), self.bias.dtype)
        return self._kept("_kept_bias", key, lambda: self.bias.detach().float().contiguous())

    def _packed_weight(self, pack):
        """The weight's bit planes, ``pack(w, thresholds, codes, basis)``'s. With ``keep_packed``
        they are kept until the weight or its basis changes as torch sees it, so that an inference
        call quantizes and packs its activations only; a change made through ``.data`` is not
        seen: call `repack`."""
        def make():
            w_basis = self.w_basis.float().contiguous()
            _, w_order, w_thresholds = levels(w_basis, True)
            w = self.weight.detach().contiguous()
            w = w.float() if w.dtype not in (torch.float16, torch.float32) else w
            return pack(Operand(w, "weight"), w_thresholds.contiguous(), w_order.contiguous(), w_basis)

        key = (self.weight._version, self.w_basis._version, self.weight.data_ptr(), self.w_basis.data_ptr(),
               self.weight.dtype)
        return self._kept("_weight_planes", key, make)

    def repack(self):
        """Drop the kept bit planes of the weight (``keep_packed``), the activations' tables and
        the fp32 bias: the next call makes them again (after a change through ``.data``)."""
        self._weight_planes = self._kept_tables = self._kept_bias = None


class LQLinear(_LearnedQuantizers):
    """``y = x̂ · ŵᵀ + b`` with learned low-bit quantizers (see the module's docstring).

    ``w_bits`` and ``a_bits`` from 1 to 4. The bases are buffers (``w_basis`` (out, w_bits),
    ``a_basis`` (a_bits,)), saved with the state dict, and updated in training mode only.
    ``keep_packed``: calls without gradients on a GPU keep the weight's bit planes while the
    weight and its basis stay as they are, and the activations' tables and the fp32 bias while
    theirs do (changes made through ``.data`` are not seen: `repack`).
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *, w_bits: int = 2, a_bits: int = 2,
                 signed_activations: bool = False, layout: Optional[BlockLayout] = None,
                 momentum: float = MOVING_AVERAGE, keep_packed: bool = False,
                 device: Optional[Union[str, torch.device]] = None, dtype: Optional[torch.dtype] = None) -> None:
        super().__init__()
        self._make_bases(out_features, in_features, w_bits, a_bits, signed_activations, momentum, device, keep_packed)
        if layout is not None:
            check_layout(layout)
            if layout.dense_shape != (in_features, out_features) or layout.block_size < 32:
                raise ValueError(f"layout: expected a ({in_features}, {out_features}) grid of blocks of 32 or 64, "
                                 f"got {layout.dense_shape} in blocks of {layout.block_size}")
        factory: Dict[str, Any] = {"device": device, "dtype": dtype}
        self.in_features, self.out_features, self.layout = in_features, out_features, layout
        self.weight = torch.nn.Parameter(torch.empty(out_features, in_features, **factory))
        self.bias = torch.nn.Parameter(torch.empty(out_features, **factory)) if bias else None
        mask = (torch.ones(out_features, in_features) if layout is None
                else torch.as_tensor(layout.element_mask().T.copy(), dtype=torch.float32))
        self.register_buffer("element_mask", mask.to(device=device), persistent=False)
        self.reset_parameters()

    def reset_parameters(self):
        torch.nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))
        if self.bias is not None:
            bound = 1 / math.sqrt(self.in_features)
            torch.nn.init.uniform_(self.bias, -bound, bound)

    def extra_repr(self):
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"w_bits={self.w_bits}, a_bits={self.a_bits}" + (", block-sparse" if self.layout is not None else ""))

    def update_bases(self, x):
        """One QEM step of both bases on the current weight and the activations ``x`` (rows, in)."""
        self._refit(self.weight.detach() * self.element_mask, x)

    def forward(self, x):
        if x.shape[-1] != self.in_features:
            raise ValueError(f"x: expected {self.in_features} features in its last dimension, got {x.shape[-1]}")
        rows = x.reshape(-1, self.in_features)
        if self.training:
            self.update_bases(rows.detach())
        grad = torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad)
        if not grad and rows.is_cuda and rows.dtype in (torch.float16, torch.float32):
            y = self.packed_forward(rows)
        else:
            w = straight_through(self.weight, self.w_basis, True, clip=False) * self.element_mask.to(x.dtype)
            a = straight_through(rows, self.a_basis[None], self.signed_activations, clip=True)
            y = torch.nn.functional.linear(a, w.to(a.dtype), None if self.bias is None else self.bias.to(a.dtype))
        return y.reshape(*x.shape[:-1], self.out_features)

    @on_arrays_device
    def packed_forward(self, rows):
        """The product from bit planes (a GPU, no gradients): both operands quantized and packed by
        the ballot kernel with thresholds made on the device, then the b1 tensor-core product."""
        cfg = quant.config.DEFAULT
        wq = self._packed_weight(lambda w, *tables: quant.api.pack(w, *tables, True, cfg))
        aq = quant.api.pack(Operand(rows.contiguous(), "x"), *self._activation_tables(), self.signed_activations, cfg)
        bias = self._fp32_bias()
        out_dtype = "float16" if rows.dtype == torch.float16 else "float32"
        return quant.matmul(aq, wq, layout=self.layout, bias=bias, out_dtype=out_dtype)


class QuantConv2d(_LearnedQuantizers):
    """``y = x̂ ⋆ ŵ + b``, ``torch.nn.Conv2d`` with learned low-bit quantizers (see the module's
    docstring): ``w_bits`` (±1 codes, a basis an output channel) and ``a_bits`` (0/1 codes, one
    basis: the input is expected after a ReLU) from 1 to 4; ``stride``, ``padding`` (ints, zero
    padding) and ``dilation`` as ``Conv2d`` takes them; ``keep_packed`` as `LQLinear`'s."""

    def __init__(self, in_channels: int, out_channels: int, kernel_size: Any, stride: Any = 1, padding: Any = 0,
                 dilation: Any = 1, bias: bool = True, *, w_bits: int = 2, a_bits: int = 2,
                 momentum: float = MOVING_AVERAGE, keep_packed: bool = False,
                 device: Optional[Union[str, torch.device]] = None, dtype: Optional[torch.dtype] = None) -> None:
        super().__init__()
        pair = quant.conv._pair
        self.kernel_size, self.stride = pair(kernel_size, "kernel_size", 1), pair(stride, "stride", 1)
        self.padding, self.dilation = pair(padding, "padding", 0), pair(dilation, "dilation", 1)
        R, S = self.kernel_size
        self._make_bases(out_channels, in_channels * R * S, w_bits, a_bits, False, momentum, device, keep_packed)
        factory: Dict[str, Any] = {"device": device, "dtype": dtype}
        self.in_channels, self.out_channels = in_channels, out_channels
        self.weight = torch.nn.Parameter(torch.empty(out_channels, in_channels, R, S, **factory))
        self.bias = torch.nn.Parameter(torch.empty(out_channels, **factory)) if bias else None
        self.reset_parameters()

    def reset_parameters(self):
        torch.nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))
        if self.bias is not None:
            bound = 1 / math.sqrt(self.weight[0].numel())
            torch.nn.init.uniform_(self.bias, -bound, bound)

    def extra_repr(self):
        return (f"{self.in_channels}, {self.out_channels}, kernel_size={self.kernel_size}, stride={self.stride}, "
                f"padding={self.padding}, dilation={self.dilation}, bias={self.bias is not None}, "
                f"w_bits={self.w_bits}, a_bits={self.a_bits}")

    def update_bases(self, x):
        """One QEM step of both bases on the current filters and the activations ``x``."""
        self._refit(self.weight.detach().reshape(self.out_channels, -1), x)

    def forward(self, x):
        if x.dim() != 4 or x.shape[1] != self.in_channels:
            raise ValueError(f"x: expected (N, {self.in_channels}, H, W), got shape {tuple(x.shape)}")
        if self.training:
            self.update_bases(x.detach())
        grad = torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad)
        if not grad and x.is_cuda and x.dtype in (torch.float16, torch.float32):
            return self.packed_forward(x)
        out = self.out_channels
        w = straight_through(self.weight.reshape(out, -1), self.w_basis, True, clip=False).reshape(self.weight.shape)
        a = straight_through(x.reshape(1, -1), self.a_basis[None], False, clip=True).reshape(x.shape)
        return torch.nn.functional.conv2d(a, w.to(a.dtype), None if self.bias is None else self.bias.to(a.dtype),
                                          self.stride, self.padding, self.dilation)

    @on_arrays_device
    def packed_forward(self, x):
        """The convolution from bit planes (a GPU, no gradients): images and filters packed along
        their channels, then the implicit-GEMM b1 convolution; a channels-last result."""
        cfg = quant.config.DEFAULT
        channels_last = not x.is_contiguous() and x.is_contiguous(memory_format=torch.channels_last)
        images = x.permute(0, 2, 3, 1) if channels_last else x.contiguous()
        wq = self._packed_weight(lambda w, *tables: quant.conv.pack_image(w, *tables, True, False, cfg))
        aq = quant.conv.pack_image(Operand(images, "x"), *self._activation_tables(), False, channels_last, cfg)
        bias = self._fp32_bias()
        out_dtype = "float16" if x.dtype == torch.float16 else "float32"
        y = quant.conv2d(aq, wq, self.stride, self.padding, self.dilation, bias=bias, out_dtype=out_dtype)
        return y.permute(0, 3, 1, 2)
