"""`SparseProj` for torch: a module-free wrapper whose maps are custom ops with autograd
(``torch.ops.sparseblocks.proj_gather`` and ``proj_scatter``), on the kernels (`sparseblocks.proj`)
or, on CPU tensors, torch's indexing."""

from typing import List, Optional

import numpy as np
import torch

from ..proj import SparseProj as _KernelProj
from . import cpu

_kernel_projs = {}
WRITE, ADD, MULTIPLY = 0, 1, 2


def _kernels(lut, nhidden, axis):
    key = (tuple(lut), nhidden, axis)
    proj = _kernel_projs.get(key)
    if proj is None:
        proj = _kernel_projs[key] = _KernelProj(nhidden, gather_lut=np.asarray(lut), feature_axis=axis)
    return proj


def _index(lut, t):
    return torch.as_tensor(lut, dtype=torch.long, device=t.device)


@torch.library.custom_op("sparseblocks::proj_gather", mutates_args=())
def gather_op(x: torch.Tensor, b: Optional[torch.Tensor], lut: List[int], nhidden: int, axis: int) -> torch.Tensor:
    """x's features ``lut`` (times b's where given: the gradient of scatter_mul)."""
    if cpu.takes(x):
        _kernels(lut, nhidden, axis)._ops([("x", x)], [nhidden])
        picked = x.index_select(axis, _index(lut, x))
        return (picked * b.index_select(axis, _index(lut, x)) if b is not None else picked).contiguous()
    proj = _kernels(lut, nhidden, axis)
    return proj._gather(x, b)


@torch.library.custom_op("sparseblocks::proj_scatter", mutates_args=())
def scatter_op(x: torch.Tensor, y: Optional[torch.Tensor], lut: List[int], nhidden: int, axis: int,
               mode: int) -> torch.Tensor:
    """x placed at features ``lut`` of zeros (mode 0, y None), or added to / multiplied into a copy of y."""
    if cpu.takes(x):
        proj = _kernels(lut, nhidden, axis)
        proj._ops([("x", x)] + ([("y", y)] if y is not None else []), [proj.nproj, nhidden][:1 + (y is not None)])
        index = _index(lut, x)
        shape = (x.shape[0], nhidden) if axis == 1 else (nhidden, x.shape[1])
        out = x.new_zeros(shape) if y is None else y.clone()
        if mode == MULTIPLY:
            return out.index_copy(axis, index, out.index_select(axis, index) * x)
        return out.index_add(axis, index, x) if mode == ADD else out.index_copy(axis, index, x)
    return _kernels(lut, nhidden, axis)._scatter(x, y, mode)


@gather_op.register_fake
def _(x, b, lut, nhidden, axis):
    return x.new_empty((x.shape[0], len(lut)) if axis == 1 else (len(lut), x.shape[1]))


@scatter_op.register_fake
def _(x, y, lut, nhidden, axis, mode):
    return x.new_empty((x.shape[0], nhidden) if axis == 1 else (nhidden, x.shape[1]))


def _gather_setup(ctx, inputs, output):
    x, b, ctx.lut, ctx.nhidden, ctx.axis = inputs
    ctx.save_for_backward(x, b)


def _gather_backward(ctx, dy):
    x, b = ctx.saved_tensors
    dy = dy.contiguous()
    dx = scatter_op(dy * b.index_select(ctx.axis, _index(ctx.lut, dy)) if b is not None else dy, None, ctx.lut,
                    ctx.nhidden, ctx.axis, WRITE)
    db = scatter_op(dy * x.index_select(ctx.axis, _index(ctx.lut, dy)), None, ctx.lut, ctx.nhidden, ctx.axis,
                    WRITE) if b is not None else None
    return dx, db, None, None, None


def _scatter_setup(ctx, inputs, output):
    x, y, ctx.lut, ctx.nhidden, ctx.axis, ctx.mode = inputs
    ctx.save_for_backward(x, y)


def _scatter_backward(ctx, dout):
    x, y = ctx.saved_tensors
    dout = dout.contiguous()
    if ctx.mode == MULTIPLY:  # out[lut] = y[lut]·x: dx = (dout·y)[lut], dy = dout with [lut] times x
        return (gather_op(dout, y, ctx.lut, ctx.nhidden, ctx.axis),
                scatter_op(x, dout, ctx.lut, ctx.nhidden, ctx.axis, MULTIPLY), None, None, None, None)
    dx = gather_op(dout, None, ctx.lut, ctx.nhidden, ctx.axis)
    return dx, (dout if y is not None else None), None, None, None, None


gather_op.register_autograd(_gather_backward, setup_context=_gather_setup)
scatter_op.register_autograd(_scatter_backward, setup_context=_scatter_setup)


class SparseProj:
    """`sparseblocks.proj.SparseProj`'s maps on torch tensors, differentiable."""

    def __init__(self, nhidden, nproj=None, proj_stride=None, block_size=32, gather_lut=None, feature_axis=1):
        kernel = _KernelProj(nhidden, nproj, proj_stride, block_size, gather_lut, feature_axis)
        self.nhidden, self.nproj, self.feature_axis = kernel.nhidden, kernel.nproj, feature_axis
        self.lut = [int(v) for v in kernel.gather_lut]
        _kernel_projs[(tuple(self.lut), self.nhidden, feature_axis)] = kernel

    def gather(self, x):
        return gather_op(x.contiguous(), None, self.lut, self.nhidden, self.feature_axis)

    def scatter(self, x):
        return scatter_op(x.contiguous(), None, self.lut, self.nhidden, self.feature_axis, WRITE)

    def scatter_add(self, x, y):
        return scatter_op(x.contiguous(), y.contiguous(), self.lut, self.nhidden, self.feature_axis, ADD)

    def scatter_mul(self, x, y):
        return scatter_op(x.contiguous(), y.contiguous(), self.lut, self.nhidden, self.feature_axis, MULTIPLY)
