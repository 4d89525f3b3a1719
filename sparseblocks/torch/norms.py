"""Layer norm for torch: `layer_norm(x, g, b, axis=1, epsilon=1e-6, relu=False)`, differentiable.

A torch custom op (``torch.ops.sparseblocks.layer_norm``, returning y and the rows' mean and rstd)
with a fake kernel and autograd through ``torch.ops.sparseblocks.layer_norm_backward``, so that
`torch.compile(fullgraph=True)` takes it with no graph break. On a GPU both run the kernels
(`sparseblocks.norms`); on CPU tensors torch's own operations compute the same thing (sums in
fp32, fp64 for fp64), unless the kernels were asked for there (`torch.cpu.kernels_on_cpu`).
"""

from typing import Tuple

import torch

from .. import norms
from . import cpu


def _sum_dtype(dtype):
    return torch.float64 if dtype == torch.float64 else torch.float32


def _rows(t, axis):
    return t if axis == 1 else t.t()


def _cpu_forward(x, g, b, axis, epsilon, relu):
    acc = _sum_dtype(x.dtype)
    xr = _rows(x, axis).to(acc)
    mean = xr.mean(dim=1)
    centred = xr - mean[:, None]
    rstd = torch.rsqrt(centred.square().mean(dim=1) + epsilon)
    y = centred * rstd[:, None] * g.to(acc) + b.to(acc)
    if relu:
        y = torch.where(y < 0, torch.zeros((), dtype=acc), y)
    return _rows(y.to(x.dtype), axis).contiguous(), mean, rstd


def _cpu_backward(dy, x, g, b, mean, rstd, axis, relu):
    acc = _sum_dtype(x.dtype)
    xr, dyr, gf = _rows(x, axis).to(acc), _rows(dy, axis).to(acc), g.to(acc)
    xhat = (xr - mean[:, None]) * rstd[:, None]
    if relu:
        dyr = torch.where(xhat * gf + b.to(acc) > 0, dyr, torch.zeros((), dtype=acc))
    dxhat = dyr * gf
    dx = rstd[:, None] * (dxhat - dxhat.mean(dim=1, keepdim=True) - xhat * (dxhat * xhat).mean(dim=1, keepdim=True))
    return (_rows(dx.to(x.dtype), axis).contiguous(), (dyr * xhat).sum(dim=0).to(g.dtype),
            dyr.sum(dim=0).to(g.dtype))


@torch.library.custom_op("sparseblocks::layer_norm", mutates_args=())
def layer_norm_op(x: torch.Tensor, g: torch.Tensor, b: torch.Tensor, axis: int, epsilon: float,
                  relu: bool) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(y, mean, rstd) of `sparseblocks.norms.layer_norm`."""
    if cpu.takes(x):
        norms.api._operands(x, g, b, axis, epsilon)  # (the kernels' checks and errors)
        return _cpu_forward(x, g, b, axis, epsilon, relu)
    y, mean, rstd = norms.layer_norm(x.contiguous(), g.contiguous(), b.contiguous(), axis, epsilon, relu, stats=True)
    return y, mean, rstd


@torch.library.custom_op("sparseblocks::layer_norm_backward", mutates_args=())
def layer_norm_backward_op(dy: torch.Tensor, x: torch.Tensor, g: torch.Tensor, b: torch.Tensor, mean: torch.Tensor,
                           rstd: torch.Tensor, axis: int, relu: bool) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dx, dg, db) of `sparseblocks.norms.layer_norm_grad`."""
    if cpu.takes(x):
        return _cpu_backward(dy, x, g, b, mean, rstd, axis, relu)
    dx, dg, db = norms.layer_norm_grad(dy.contiguous(), x, g, b, mean, rstd, axis, relu)
    return dx, dg, db


@layer_norm_op.register_fake
def _(x, g, b, axis, epsilon, relu):
    n = x.shape[1 - axis]
    acc = _sum_dtype(x.dtype)
    return x.new_empty(x.shape), x.new_empty((n,), dtype=acc), x.new_empty((n,), dtype=acc)


@layer_norm_backward_op.register_fake
def _(dy, x, g, b, mean, rstd, axis, relu):
    return x.new_empty(x.shape), g.new_empty(g.shape), g.new_empty(g.shape)


def _setup(ctx, inputs, output):
    x, g, b, axis, _, relu = inputs
    _, mean, rstd = output
    ctx.save_for_backward(x, g, b, mean, rstd)
    ctx.axis, ctx.relu = axis, relu
    ctx.mark_non_differentiable(mean, rstd)


def _backward(ctx, dy, _mean, _rstd):
    x, g, b, mean, rstd = ctx.saved_tensors
    dx, dg, db = layer_norm_backward_op(dy.contiguous(), x, g, b, mean, rstd, ctx.axis, ctx.relu)
    return dx, dg, db, None, None, None


layer_norm_op.register_autograd(_backward, setup_context=_setup)


def layer_norm(x, g, b, axis=1, epsilon=1e-6, relu=False):
    """OpenAI's ``layer_norm`` on torch tensors, with autograd: x (N, C) normalized over its C
    features with ``axis`` 1, x (C, N) with 0; ``g`` and ``b`` (C,); ReLU'd with ``relu``."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x: expected a torch tensor, got {type(x).__name__}")
    return layer_norm_op(x.contiguous(), g, b, int(axis), float(epsilon), bool(relu))[0]


# -- batch norm ---------------------------------------------------------------------------


def _cpu_batch_stats(x):
    axes = (0,) + tuple(range(2, x.dim()))
    xf = x.to(_sum_dtype(x.dtype))
    mean = xf.mean(dim=axes)
    return mean, (xf - mean.reshape((1, -1) + (1,) * (x.dim() - 2))).square().mean(dim=axes)


def _per_channel(v, x):
    return v.reshape((1, -1) + (1,) * (x.dim() - 2))


@torch.library.custom_op("sparseblocks::batch_norm", mutates_args=())
def batch_norm_op(x: torch.Tensor, g: torch.Tensor, b: torch.Tensor, epsilon: float
                  ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(y, mean, var) of `sparseblocks.norms.batch_norm`."""
    if cpu.takes(x):
        norms.api._channels(x, g, b, epsilon)
        mean, var = _cpu_batch_stats(x)
        acc = mean.dtype
        y = (x.to(acc) - _per_channel(mean, x)) * torch.rsqrt(_per_channel(var, x) + epsilon) * \
            _per_channel(g.to(acc), x) + _per_channel(b.to(acc), x)
        return y.to(x.dtype), mean, var
    y, mean, var = norms.batch_norm(x, g.contiguous(), b.contiguous(), epsilon, stats=True)
    return y, mean, var


@torch.library.custom_op("sparseblocks::batch_norm_backward", mutates_args=())
def batch_norm_backward_op(dy: torch.Tensor, x: torch.Tensor, g: torch.Tensor, mean: torch.Tensor, var: torch.Tensor,
                           epsilon: float) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dx, dg, db) of `sparseblocks.norms.batch_norm_grad`."""
    if cpu.takes(x):
        axes = (0,) + tuple(range(2, x.dim()))
        acc = mean.dtype
        rstd = torch.rsqrt(var + epsilon)
        xhat = (x.to(acc) - _per_channel(mean, x)) * _per_channel(rstd, x)
        d = dy.to(acc)
        s1, s2 = d.mean(dim=axes), (d * xhat).mean(dim=axes)
        dx = _per_channel(g.to(acc) * rstd, x) * (d - _per_channel(s1, x) - xhat * _per_channel(s2, x))
        return dx.to(x.dtype), (d * xhat).sum(dim=axes).to(g.dtype), d.sum(dim=axes).to(g.dtype)
    dx, dg, db = norms.batch_norm_grad(dy.contiguous(), x, g, mean, var, epsilon)
    return dx, dg, db


@batch_norm_op.register_fake
def _(x, g, b, epsilon):
    acc = _sum_dtype(x.dtype)
    return torch.empty_like(x), x.new_empty((x.shape[1],), dtype=acc), x.new_empty((x.shape[1],), dtype=acc)


@batch_norm_backward_op.register_fake
def _(dy, x, g, mean, var, epsilon):
    return torch.empty_like(x), torch.empty_like(g), torch.empty_like(g)


def _batch_setup(ctx, inputs, output):
    x, g, _, epsilon = inputs
    ctx.save_for_backward(x, g, output[1], output[2])
    ctx.epsilon = epsilon
    ctx.mark_non_differentiable(output[1], output[2])


def _batch_backward(ctx, dy, _mean, _var):
    x, g, mean, var = ctx.saved_tensors
    dx, dg, db = batch_norm_backward_op(dy.contiguous(), x, g, mean, var, ctx.epsilon)
    return dx, dg, db, None


batch_norm_op.register_autograd(_batch_backward, setup_context=_batch_setup)


def batch_norm(x, g, b, epsilon=1e-5, stats=False):
    """OpenAI's ``batch_norm`` for NCHW torch tensors, with autograd: each channel over the batch
    and its positions; with ``stats`` also the batch's (C,) mean and variance (for running
    averages: the inference form is `sparseblocks.norms.batch_norm_inference`)."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x: expected a torch tensor, got {type(x).__name__}")
    y, mean, var = batch_norm_op(x.contiguous(), g, b, float(epsilon))
    return (y, mean, var) if stats else y
