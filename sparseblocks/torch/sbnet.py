"""Differentiable SBNet gather and scatter for torch.

* `sparse_gather(x, indices, ...)`: its gradient is an atomic scatter-add of the
  block gradients (windows may overlap), with the same ``transpose`` and
  ``data_format``.
* `sparse_scatter(blocks, indices, y, ...)`: differentiable in ``blocks`` (a
  gather of the output gradient) and in ``y``: the output gradient itself when
  adding, and with the written windows stamped out when overwriting. With
  ``inplace=True`` it writes into ``y`` and tells autograd so. Overwriting
  overlapping windows has no defined gradient (nor value), as in SBNet.

On CPU tensors both compute with torch's own indexing (`torch.cpu`), as `BlockSparseLinear` does.

Both are also torch custom ops (``torch.ops.sparseblocks.sbnet_gather``, ``sbnet_scatter`` and
the in-place ``sbnet_scatter_``), with fake kernels and autograd, which the functions call where
`torch.compile` traces: a compiled model runs the kernels with no graph break, and
``mode="reduce-overhead"`` captures them in its CUDA graphs. Eager calls skip the custom op's
dispatch through the `autograd.Function` twins below. A compiled in-place scatter that needs
gradients writes a new image and copies it into ``y`` (custom ops with autograd are functional).
"""

from typing import List, Optional

import torch

from .. import sbnet as kernels
from ..sbnet.api import block_shape
from ..windows import check_geometry
from . import cpu


def _on(t):
    """Where a call with ``t`` computes: the kernels, or on CPU tensors torch's own ops (`cpu`)."""
    return cpu if cpu.takes(t) else kernels


def _geometry_kwargs(bsize, bstride, boffset, data_format):
    return {"bsize": bsize, "bstride": bstride, "boffset": boffset, "data_format": data_format}


def _written_into(y, out):
    """``y`` after an in-place scatter that returned ``out``: on a GPU the same object; the
    simulator works on copies of host tensors, so there the result is copied back."""
    if out is not y:
        y.copy_(out)
    return y


class _SparseGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, indices, count, transpose, geometry):
        ctx.save_for_backward(indices, *(() if count is None else (count,)))
        ctx.shape, ctx.transpose, ctx.geometry = x.shape, transpose, geometry
        return _on(x).sparse_gather(x.detach(), indices, transpose=transpose, count=count, **geometry)

    @staticmethod
    def backward(ctx, grad_blocks):
        indices, *count = ctx.saved_tensors
        zeros = grad_blocks.new_zeros(ctx.shape)
        # Windows may overlap or repeat (every SparseResBlock's share a halo): add atomically,
        # into the fresh zeros themselves (into a copy would read and write the image once more).
        grad_x = _on(zeros).sparse_scatter(grad_blocks.contiguous(), indices, zeros, add=True, atomic=True,
                                        transpose=ctx.transpose, inplace=True,
                                        count=count[0] if count else None, **ctx.geometry)
        return _written_into(zeros, grad_x), None, None, None, None


class _SparseScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, blocks, indices, count, add, atomic, transpose, inplace, geometry):
        # (y first: autograd's CopySlices, which takes over when y is a view written in place,
        # expects the written input first)
        ctx.save_for_backward(indices, *(() if count is None else (count,)))
        ctx.add, ctx.transpose, ctx.geometry, ctx.blocks_shape = add, transpose, geometry, blocks.shape
        out = _on(y).sparse_scatter(blocks.detach(), indices, y.detach(), add=add, atomic=atomic,
                                     transpose=transpose, inplace=inplace, count=count, **geometry)
        if inplace:
            ctx.mark_dirty(y)
            return _written_into(y, out)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        indices, *count = ctx.saved_tensors
        count = count[0] if count else None
        grad_out = grad_out.contiguous()
        grad_blocks = _on(grad_out).sparse_gather(grad_out, indices, transpose=ctx.transpose, count=count,
                                            **ctx.geometry)
        if ctx.add:
            grad_y = grad_out
        else:  # the written windows no longer depend on y: stamp them out
            holes = grad_out.new_zeros(ctx.blocks_shape)
            grad_y = _on(grad_out).sparse_scatter(holes, indices, grad_out, transpose=ctx.transpose, count=count,
                                            **ctx.geometry)
        return grad_y, grad_blocks, None, None, None, None, None, None, None


# The custom ops. The geometry crosses the op boundary as three (h, w) lists.

@torch.library.custom_op("sparseblocks::sbnet_gather", mutates_args=())
def sbnet_gather(x: torch.Tensor, indices: torch.Tensor, count: Optional[torch.Tensor], bsize: List[int],
                 bstride: List[int], boffset: List[int], transpose: bool, data_format: str) -> torch.Tensor:
    """`sparseblocks.sbnet.sparse_gather` as a custom op."""
    return _on(x).sparse_gather(x, indices, bsize, bstride, boffset, transpose=transpose, count=count,
                                 data_format=data_format)


@torch.library.custom_op("sparseblocks::sbnet_scatter", mutates_args=())
def sbnet_scatter(blocks: torch.Tensor, indices: torch.Tensor, y: torch.Tensor, count: Optional[torch.Tensor],
                  bsize: List[int], bstride: List[int], boffset: List[int], add: bool, atomic: bool,
                  transpose: bool, data_format: str) -> torch.Tensor:
    """`sparseblocks.sbnet.sparse_scatter` into a copy of ``y``, as a custom op."""
    return _on(y).sparse_scatter(blocks, indices, y, bsize, bstride, boffset, add=add, atomic=atomic,
                                  transpose=transpose, count=count, data_format=data_format)


@torch.library.custom_op("sparseblocks::sbnet_scatter_", mutates_args=("y",))
def sbnet_scatter_(blocks: torch.Tensor, indices: torch.Tensor, y: torch.Tensor, count: Optional[torch.Tensor],
                   bsize: List[int], bstride: List[int], boffset: List[int], add: bool, atomic: bool,
                   transpose: bool, data_format: str) -> None:
    """`sparseblocks.sbnet.sparse_scatter` into ``y`` itself, as a custom op (no autograd)."""
    _written_into(y, _on(y).sparse_scatter(blocks, indices, y, bsize, bstride, boffset, add=add, atomic=atomic,
                                            transpose=transpose, inplace=True, count=count, data_format=data_format))


@sbnet_gather.register_fake
def _(x, indices, count, bsize, bstride, boffset, transpose, data_format):
    channels_last = data_format == "NHWC"
    return x.new_empty(block_shape(indices.shape[0], tuple(bsize), x.shape[3 if channels_last else 1],
                                   channels_last, transpose))


@sbnet_scatter.register_fake
def _(blocks, indices, y, count, bsize, bstride, boffset, add, atomic, transpose, data_format):
    return torch.empty_like(y, memory_format=torch.contiguous_format)


@sbnet_scatter_.register_fake
def _(blocks, indices, y, count, bsize, bstride, boffset, add, atomic, transpose, data_format):
    return None


def _setup_gather(ctx, inputs, output):
    x, indices, count, *geometry, transpose, data_format = inputs
    ctx.save_for_backward(indices, count)
    ctx.shape, ctx.geometry, ctx.transpose, ctx.data_format = x.shape, geometry, transpose, data_format


def _gather_backward(ctx, grad_blocks):
    indices, count = ctx.saved_tensors
    grad_x = grad_blocks.new_zeros(ctx.shape)  # windows may overlap: add atomically (see _SparseGather)
    sbnet_scatter_(grad_blocks.contiguous(), indices, grad_x, count, *ctx.geometry, True, True, ctx.transpose,
                   ctx.data_format)
    return grad_x, None, None, None, None, None, None, None


def _setup_scatter(ctx, inputs, output):
    blocks, indices, y, count, *geometry, add, atomic, transpose, data_format = inputs
    ctx.save_for_backward(indices, count)
    ctx.blocks_shape, ctx.geometry, ctx.add = blocks.shape, geometry, add
    ctx.transpose, ctx.data_format = transpose, data_format


def _scatter_backward(ctx, grad_out):
    indices, count = ctx.saved_tensors
    grad_out = grad_out.contiguous()
    grad_blocks = sbnet_gather(grad_out, indices, count, *ctx.geometry, ctx.transpose, ctx.data_format)
    if ctx.add:
        grad_y = grad_out
    else:  # the written windows no longer depend on y: stamp them out
        grad_y = sbnet_scatter(grad_out.new_zeros(ctx.blocks_shape), indices, grad_out, count, *ctx.geometry,
                               False, False, ctx.transpose, ctx.data_format)
    return grad_blocks, None, grad_y, None, None, None, None, None, None, None, None


sbnet_gather.register_autograd(_gather_backward, setup_context=_setup_gather)
sbnet_scatter.register_autograd(_scatter_backward, setup_context=_setup_scatter)


def _geometry_lists(bsize, bstride, boffset):
    return [list(v) for v in check_geometry(bsize, bstride, boffset)]


def sparse_gather(x, indices, bsize, bstride, boffset=0, transpose=False, count=None, data_format="NHWC"):
    """Differentiable `sparseblocks.sbnet.sparse_gather` (the custom op where torch.compile traces)."""
    if torch.compiler.is_compiling():
        return sbnet_gather(x, indices, count, *_geometry_lists(bsize, bstride, boffset), transpose, data_format)
    return _SparseGather.apply(x, indices, count, transpose, _geometry_kwargs(bsize, bstride, boffset, data_format))


def sparse_scatter(blocks, indices, y, bsize, bstride, boffset=0, add=False, atomic=False,
                   transpose=False, inplace=False, count=None, data_format="NHWC"):
    """Differentiable `sparseblocks.sbnet.sparse_scatter` (the custom ops where torch.compile traces)."""
    if torch.compiler.is_compiling():
        args = (indices, y, count, *_geometry_lists(bsize, bstride, boffset), add, atomic, transpose, data_format)
        if not inplace:
            return sbnet_scatter(blocks, *args)
        if torch.is_grad_enabled() and (y.requires_grad or blocks.requires_grad):
            return y.copy_(sbnet_scatter(blocks, *args))
        sbnet_scatter_(blocks, *args)
        return y
    return _SparseScatter.apply(y, blocks, indices, count, add, atomic, transpose, inplace,
                                _geometry_kwargs(bsize, bstride, boffset, data_format))
