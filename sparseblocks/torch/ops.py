"""The matmul's three products as torch custom ops (``torch.ops.sparseblocks.*``).

Registered with `torch.library.custom_op`, each with a fake kernel (shapes and dtypes only, for
`torch.compile`'s tracing) and the forward with its autograd, so that a compiled model runs the
kernels with no graph break, and CUDA graphs (``mode="reduce-overhead"`` or `torch.cuda.graph`)
capture them. Kernels launch on torch's current stream.

A layout crosses the op boundary as a string, `layout_key` (block size, grid, and the mask's bits),
since custom ops take tensors and plain values only. A compiled graph holds it as a constant, so a
new layout (after `BlockRegrowth` moves blocks) is a new graph. `layout_of` turns it back into the
`BlockLayout`, kept in a small cache (so the layout's device indices are made once).
"""

import base64
from collections import OrderedDict
from typing import Optional, Tuple

import numpy as np
import torch

from .. import bsmm
from ..layout import BlockLayout

_CACHED_LAYOUTS = 64
_layouts = OrderedDict()


def layout_key(layout):
    """The string a custom op takes for ``layout``: ``"bs:Cb:Kb:<mask bits, base64>"``."""
    bits = base64.b64encode(np.packbits(layout.mask).tobytes()).decode()
    Cb, Kb = layout.shape
    key = f"{layout.block_size}:{Cb}:{Kb}:{bits}"
    _remember(key, layout)
    return key


def layout_of(key):
    """The `BlockLayout` of a `layout_key` string."""
    layout = _layouts.get(key)
    if layout is None:
        bs, Cb, Kb, bits = key.split(":", 3)
        Cb, Kb = int(Cb), int(Kb)
        mask = np.unpackbits(np.frombuffer(base64.b64decode(bits), np.uint8), count=Cb * Kb)
        layout = BlockLayout(mask.reshape(Cb, Kb), int(bs))
        _remember(key, layout)
    return layout


def _remember(key, layout):
    _layouts[key] = layout
    _layouts.move_to_end(key)
    while len(_layouts) > _CACHED_LAYOUTS:
        _layouts.popitem(last=False)


def _compute_weight(w, x):
    """W in x's dtype: an fp32 master weight with fp16 or bf16 activations (autocast) is cast
    here, inside the op, so that its gradient comes back in fp32 from the kernel itself."""
    return w if w.dtype == x.dtype else w.to(x.dtype)


@torch.library.custom_op("sparseblocks::bsmm_forward", mutates_args=())
def bsmm_forward(x: torch.Tensor, w: torch.Tensor, layout: str, bias: Optional[torch.Tensor] = None,
                 relu: bool = False) -> torch.Tensor:
    """``y = x · W (+ bias)``, with ``relu`` its max with 0: x (N, C) -> (N, K); W and the bias in
    x's dtype, or fp32 with fp16 or bf16 x (the bias added, and the max taken, before the output
    is rounded where the kernel's epilogue does so)."""
    return bsmm.forward(x, _compute_weight(w, x), layout_of(layout), bias=bias, relu=relu)


@torch.library.custom_op("sparseblocks::bsmm_input_grad", mutates_args=())
def bsmm_input_grad(dy: torch.Tensor, w: torch.Tensor, layout: str) -> torch.Tensor:
    """``dx = dy · Wᵀ``: dy (N, K) -> (N, C)."""
    return bsmm.input_grad(dy, w, layout_of(layout))


@torch.library.custom_op("sparseblocks::bsmm_weight_grad", mutates_args=())
def bsmm_weight_grad(x: torch.Tensor, dy: torch.Tensor, layout: str, dtype: torch.dtype) -> torch.Tensor:
    """``dW = xᵀ · dy`` on the layout's blocks: (n_blocks, bs, bs), in ``dtype`` (x's, or fp32)."""
    return _weight_grad(x, dy, layout, dtype)


def _weight_grad(x, dy, layout, dtype):
    return bsmm.weight_grad(x, dy, layout_of(layout), out_dtype=str(dtype).removeprefix("torch."))


@torch.library.custom_op("sparseblocks::bsmm_weight_bias_grad", mutates_args=())
def bsmm_weight_bias_grad(x: torch.Tensor, dy: torch.Tensor, layout: str, dtype: torch.dtype,
                          bias_dtype: torch.dtype) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(xᵀ · dy, dy summed over N)``: dW as `bsmm_weight_grad` and the bias gradient in
    ``bias_dtype`` (x's, or fp32), the sums taken by the weight gradient's kernel where it can
    (`bsmm.weight_grad`'s ``dbias_dtype``)."""
    return _weight_bias_grad(x, dy, layout, dtype, bias_dtype)


def _weight_bias_grad(x, dy, layout, dtype, bias_dtype):
    return bsmm.weight_grad(x, dy, layout_of(layout), out_dtype=str(dtype).removeprefix("torch."),
                            dbias_dtype=str(bias_dtype).removeprefix("torch."))


@bsmm_forward.register_fake
def _(x, w, layout, bias=None, relu=False):
    return x.new_empty((x.shape[0], layout_of(layout).dense_shape[1]))


@bsmm_input_grad.register_fake
def _(dy, w, layout):
    return dy.new_empty((dy.shape[0], layout_of(layout).dense_shape[0]))


@bsmm_weight_grad.register_fake
def _(x, dy, layout, dtype):
    return x.new_empty(layout_of(layout).w_shape, dtype=dtype)


@bsmm_weight_bias_grad.register_fake
def _(x, dy, layout, dtype, bias_dtype):
    return (x.new_empty(layout_of(layout).w_shape, dtype=dtype),
            x.new_empty((layout_of(layout).dense_shape[1],), dtype=bias_dtype))


def _setup_forward(ctx, inputs, output):
    x, w, layout = inputs[:3]
    bias = inputs[3] if len(inputs) > 3 else None
    ctx.relu = len(inputs) > 4 and inputs[4]
    ctx.save_for_backward(x, w, output if ctx.relu else None)  # (a ReLU's output: its gradient's mask)
    ctx.layout = layout
    ctx.bias_dtype = None if bias is None else bias.dtype


def _gradients(ctx, dy, input_grad, weight_grad, weight_bias_grad):
    """(dx, dw, None, dbias, None) of ``y = x · W + bias`` through the given input and weight
    gradient functions; dw in W's dtype (an fp32 master weight's comes from the kernel's fp32
    sums), dbias the sum of dy's rows in the bias's dtype (summed in fp32 or wider), by the weight
    gradient's call (``weight_bias_grad``) where both are wanted. With a fused ReLU, dy is first
    zeroed where the output is (ReLU's own backward)."""
    x, w, y = ctx.saved_tensors
    if ctx.relu:
        dy = torch.ops.aten.threshold_backward(dy, y, 0)
    dy = dy.contiguous()
    dx = input_grad(dy, _compute_weight(w, x), ctx.layout) if ctx.needs_input_grad[0] else None
    dw = dbias = None
    wants_bias = ctx.bias_dtype is not None and ctx.needs_input_grad[3]
    if ctx.needs_input_grad[1]:
        direct = w.dtype in (x.dtype, torch.float32)  # (the kernel stores these; another cast after it)
        if wants_bias:
            summed = ctx.bias_dtype if ctx.bias_dtype in (x.dtype, torch.float32) else torch.float32
            dw, dbias = weight_bias_grad(x, dy, ctx.layout, w.dtype if direct else x.dtype, summed)
            dbias = dbias.to(ctx.bias_dtype)
        else:
            dw = weight_grad(x, dy, ctx.layout, w.dtype if direct else x.dtype)
        dw = dw if direct else dw.to(w.dtype)
    elif wants_bias:
        dbias = dy.sum(0, dtype=torch.promote_types(ctx.bias_dtype, torch.float32)).to(ctx.bias_dtype)
    return dx, dw, None, dbias, None


def _backward_forward(ctx, dy):
    return _gradients(ctx, dy, bsmm_input_grad, bsmm_weight_grad, bsmm_weight_bias_grad)


bsmm_forward.register_autograd(_backward_forward, setup_context=_setup_forward)


class _Product(torch.autograd.Function):
    """The same forward and backward as `bsmm_forward` without the custom op's dispatch (~25 µs a
    call): what an eager call runs (`product`)."""

    @staticmethod
    def forward(ctx, x, w, layout, bias, relu):
        y = bsmm.forward(x, _compute_weight(w, x), layout_of(layout), bias=bias, relu=relu)
        _setup_forward(ctx, (x, w, layout, bias, relu), y)
        return y

    @staticmethod
    def backward(ctx, dy):
        return _gradients(ctx, dy, lambda dy, w, key: bsmm.input_grad(dy, w, layout_of(key)),
                          _weight_grad, _weight_bias_grad)


def product(x, w, layout, bias=None, relu=False):
    """``x · W (+ bias)``, with ``relu`` its max with 0, with autograd: the custom op where
    torch.compile traces, else its eager twin. W and the bias in x's dtype, or fp32 master copies
    with fp16 or bf16 x (W cast inside, the bias added as it is; their gradients come back fp32)."""
    if torch.compiler.is_compiling():
        return bsmm_forward(x, w, layout, bias, relu)
    if torch.is_grad_enabled() and (x.requires_grad or w.requires_grad or (bias is not None and bias.requires_grad)):
        return _Product.apply(x, w, layout, bias, relu)
    return bsmm.forward(x, _compute_weight(w, x), layout_of(layout), bias=bias, relu=relu)
