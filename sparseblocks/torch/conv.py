"""`BlockSparseConv1d`, `2d` and `3d`: `sparseblocks.conv.BlocksparseConv` as torch modules.

The three products are custom ops with autograd (``torch.ops.sparseblocks.conv_forward``,
``conv_input_grad``, ``conv_filter_grad``), so a compiled model runs them with no graph break.
A layer crosses the op boundary as a string key (its geometry's digest), which a compiled graph
holds as a constant. The filters are one flat parameter, the blocks' (len(ks), len(cs), *TRS) one
after another (OpenAI's collapsed form; `BlockSparseConv2d.filters` gives them a block each).

On CPU tensors the products are torch's own: the layer's dense filter (the blocks added where
they sit) through ``torch.nn.functional.conv3d`` and its gradients, the same sums as the kernels.
"""

import hashlib
import math
from typing import Any, List, Optional

import numpy as np
import torch

from ..conv import BlocksparseConv, BlocksparseDeconv
from . import cpu

_layers = {}


def _key(op):
    text = repr((op.BCK, op.TRS, op._g, op.edge_bias, op.deconv))
    key = hashlib.sha1(text.encode()).hexdigest()[:20]
    _layers.setdefault(key, op)
    return key


def _dense_index(op):
    """For each filter value, its flat index in the dense (K, C, T, R, S) filter."""
    trs = int(np.prod(op._g["TRS"]))
    out = []
    for cs, ks in op._blocks:
        k, c, t = np.meshgrid(np.asarray(ks), np.asarray(cs), np.arange(trs), indexing="ij")
        out.append(((k * op._C + c) * trs + t).reshape(-1))
    return np.concatenate(out)


def _cpu_parts(op, t):
    """(the dense filter index, the edge-group index of each output position) as tensors on t's
    device, made at each call from NumPy arrays kept with the layer (a tensor kept across calls
    would outlive the fake and functional tensors of a compiled graph's tracing)."""
    held = op.__dict__.get("_torch_index")
    if held is None:
        held = op.__dict__["_torch_index"] = (_dense_index(op), op._host["edge"].astype(np.int64))
    return tuple(torch.as_tensor(a, device=t.device) for a in held)


def _as5(x, size):
    return x.reshape(x.shape[:2] + tuple(size))


def _dense(op, f):
    index, _ = _cpu_parts(op, f)
    W = f.new_zeros(op._K * op._C * int(np.prod(op._g["TRS"])))
    W.index_add_(0, index, f.reshape(-1))
    return W.view((op._K, op._C) + tuple(op._g["TRS"]))


def _conv_args(op):
    g = op._g
    return dict(stride=g["strides"], padding=g["padding"], dilation=g["dilates"])


def _edge_add(op, out, bias):
    _, edge = _cpu_parts(op, out)
    full = torch.cat([bias, bias.new_zeros(bias.shape[0], 1)], dim=1)  # (group -1: the zeros column)
    return out + full[:, edge].reshape((1,) + out.shape[1:])


def _convolve(op, f, x):
    """The underlying convolution's forward on CPU tensors: x (N, conv's C, *DHW) -> (N, K, *MPQ)."""
    return torch.nn.functional.conv3d(_as5(x, op._g["DHW"]), _dense(op, f), **_conv_args(op))


def _transposed(op, f, dy):
    """Its input gradient: dy (N, conv's K, *MPQ) -> (N, C, *DHW)."""
    N = dy.shape[0]
    return torch.nn.grad.conv3d_input((N, op._C) + tuple(op._g["DHW"]), _dense(op, f), _as5(dy, op._g["MPQ"]),
                                      **_conv_args(op))


def _filter(op, dy, x):
    """Its filter gradient, flat, from dy (its output's) and x (its input)."""
    index, _ = _cpu_parts(op, x)
    dW = torch.nn.grad.conv3d_weight(_as5(x, op._g["DHW"]), (op._K, op._C) + tuple(op._g["TRS"]),
                                     _as5(dy, op._g["MPQ"]), **_conv_args(op))
    return dW.reshape(-1)[index]


def _format(t):
    """torch.channels_last (or _3d) where t is a 4-D (5-D) tensor laid out so and not also
    contiguous; else None. Such tensors go to the kernels channels-last, with no copy."""
    fmt = {4: torch.channels_last, 5: torch.channels_last_3d}.get(t.dim())
    return fmt if fmt is not None and not t.is_contiguous() and t.is_contiguous(memory_format=fmt) else None


def _like(t, out):
    """out laid out as t is (channels_last kept)."""
    fmt = _format(t)
    return out.contiguous(memory_format=fmt) if fmt is not None else out


@torch.library.custom_op("sparseblocks::conv_forward", mutates_args=())
def conv_forward(f: torch.Tensor, x: torch.Tensor, bias: Optional[torch.Tensor], key: str) -> torch.Tensor:
    """The layer's forward (`BlocksparseConv.__call__`; a deconvolution's: the transposed one)."""
    op = _layers[key]
    if cpu.takes(x):
        N = x.shape[0]
        out = (_transposed(op, f, x) if op.deconv else _convolve(op, f, x)).reshape(op.o_shape(N))
        return _like(x, _edge_add(op, out, bias) if bias is not None else out)
    if _format(x) is not None:
        return op(f.contiguous(), x.movedim(1, -1), edge_bias=bias, channels_last=True).movedim(-1, 1)
    return op(f.contiguous(), x.contiguous(), edge_bias=bias)


@torch.library.custom_op("sparseblocks::conv_input_grad", mutates_args=())
def conv_input_grad(f: torch.Tensor, dy: torch.Tensor, key: str) -> torch.Tensor:
    op = _layers[key]
    if cpu.takes(dy):
        N = dy.shape[0]
        return _like(dy, (_convolve(op, f, dy) if op.deconv else _transposed(op, f, dy)).reshape(op.i_shape(N)))
    if _format(dy) is not None:
        return op.input_grad(f.contiguous(), dy.movedim(1, -1), channels_last=True).movedim(-1, 1)
    return op.input_grad(f.contiguous(), dy.contiguous())


@torch.library.custom_op("sparseblocks::conv_filter_grad", mutates_args=())
def conv_filter_grad(dy: torch.Tensor, x: torch.Tensor, key: str) -> torch.Tensor:
    """The present blocks' filter gradients, flat (`BlocksparseConv.filter_grad`)."""
    op = _layers[key]
    if cpu.takes(x):
        return _filter(op, x, dy) if op.deconv else _filter(op, dy, x)
    if _format(x) is not None and _format(dy) is not None:
        grads = op.filter_grad(dy.movedim(1, -1), x.movedim(1, -1), channels_last=True)
    else:
        grads = op.filter_grad(dy.contiguous(), x.contiguous())
    return torch.cat([b.reshape(-1) for b in grads])


@conv_forward.register_fake
def _(f, x, bias, key):
    return _like(x, x.new_empty(_layers[key].o_shape(x.shape[0])))


@conv_input_grad.register_fake
def _(f, dy, key):
    return _like(dy, dy.new_empty(_layers[key].i_shape(dy.shape[0])))


@conv_filter_grad.register_fake
def _(dy, x, key):
    return x.new_empty((_layers[key].f_size,))


def _setup(ctx, inputs, output):
    f, x, bias, key = inputs
    ctx.key, ctx.has_bias = key, bias is not None
    ctx.save_for_backward(f, x)


def _backward(ctx, dy):
    f, x = ctx.saved_tensors
    op = _layers[ctx.key]
    fmt = _format(x)  # (dy channels-last where x is: the kernels take both so, with no copies)
    dy = dy.contiguous(memory_format=fmt) if fmt is not None else dy.contiguous()
    df = conv_filter_grad(dy, x, ctx.key) if ctx.needs_input_grad[0] else None
    dx = conv_input_grad(f, dy, ctx.key) if ctx.needs_input_grad[1] else None
    dbias = None
    if ctx.has_bias and ctx.needs_input_grad[2]:
        _, edge = _cpu_parts(op, dy)
        groups = len(op._edges)
        sums = dy.reshape(dy.shape[0], dy.shape[1], -1).sum(0)  # (K, MPQ)
        dbias = sums.new_zeros(dy.shape[1], groups + 1).index_add_(1, torch.where(edge < 0, groups, edge), sums)
        dbias = dbias[:, :groups]
    return df, dx, dbias, None


conv_forward.register_autograd(_backward, setup_context=_setup)


class _BlockSparseConvNd(torch.nn.Module):
    dims = 2
    transposed = False

    def __init__(self, BCK: Any, kernel_size: Any, input_size: Any, stride: Any = 1, padding: Any = "SAME",
                 dilation: Any = 1, edge_bias: bool = False, output_size: Any = None, device: Any = None,
                 dtype: Any = None) -> None:
        super().__init__()
        size = [kernel_size] * self.dims if np.isscalar(kernel_size) else list(kernel_size)
        inputs = [input_size] * self.dims if np.isscalar(input_size) else list(input_size)
        if len(size) != self.dims or len(inputs) != self.dims:
            raise ValueError(f"kernel_size, input_size: expected {self.dims} sizes each, got {size} and {inputs}")
        if self.transposed:
            if edge_bias:
                raise ValueError("edge_bias: a transposed layer takes none")
            self.op = BlocksparseDeconv(BCK, size, inputs, output_size, stride, dilation, padding)
        else:
            self.op = BlocksparseConv(BCK, size, inputs, output_size, stride, dilation, padding, edge_bias)
        self.key = _key(self.op)
        self.weight = torch.nn.Parameter(torch.empty(self.op.f_size, device=device, dtype=dtype))
        self.edge = torch.nn.Parameter(torch.zeros(self.op.edge_bias_shape(), device=device, dtype=dtype)) \
            if edge_bias else None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Each block's filter uniform in ±1/sqrt(its fan-in: a filter row's values), as ``nn.Conv``
        initializes its own."""
        with torch.no_grad():
            for b, part in enumerate(self.filters()):
                bound = 1 / math.sqrt(max(1, int(np.prod(part.shape[1:]))))
                part.uniform_(-bound, bound)
            if self.edge is not None:
                self.edge.zero_()

    def filters(self) -> List[torch.Tensor]:
        """The blocks' filters, views of the flat weight (``f_shape(b)`` each)."""
        off = self.op._f_off
        return [self.weight[off[b]:off[b + 1]].view(self.op.f_shape(b)) for b in range(len(self.op.BCK))]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != self.dims + 2:
            raise ValueError(f"x: expected (N, C, {', '.join('DHW'[3 - self.dims:])}), got shape {tuple(x.shape)}")
        if x.dtype != self.weight.dtype:
            raise TypeError(f"x: expected the layer's dtype {self.weight.dtype}, got {x.dtype}")
        return conv_forward(self.weight, x, self.edge, self.key)


class BlockSparseConv1d(_BlockSparseConvNd):
    """A 1-D convolution whose channel connectivity is ``BCK``'s blocks (`BlocksparseConv`):
    ``(N, C, W) -> (N, K, Q)``, the filters one flat parameter ``weight`` (``filters()``: a view a
    block), and with ``edge_bias`` the parameter ``edge`` (`BlocksparseConv.edge_bias_shape`)."""

    dims = 1


class BlockSparseConv2d(_BlockSparseConvNd):
    """`BlockSparseConv1d` in 2-D: ``(N, C, H, W) -> (N, K, P, Q)``."""

    dims = 2


class BlockSparseConv3d(_BlockSparseConvNd):
    """`BlockSparseConv1d` in 3-D: ``(N, C, D, H, W) -> (N, K, M, P, Q)``."""

    dims = 3


class BlockSparseConvTranspose1d(_BlockSparseConvNd):
    """The transposed `BlockSparseConv1d` over the same blocks (`BlocksparseDeconv`): ``BCK``'s
    ``(cs, ks)`` connect this layer's input channels cs to its output channels ks, block b's filter
    is ``(len(cs), len(ks), *kernel_size)``; ``output_size`` settles a strided layer's output size
    (the smallest by default)."""

    dims = 1
    transposed = True


class BlockSparseConvTranspose2d(BlockSparseConvTranspose1d):
    """`BlockSparseConvTranspose1d` in 2-D."""

    dims = 2


class BlockSparseConvTranspose3d(BlockSparseConvTranspose1d):
    """`BlockSparseConvTranspose1d` in 3-D."""

    dims = 3
