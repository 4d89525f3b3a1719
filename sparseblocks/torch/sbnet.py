"""Differentiable SBNet gather and scatter for torch.

* `sparse_gather(x, indices, ...)`: its gradient is an atomic scatter-add of the
  block gradients (windows may overlap), with the same ``transpose`` and
  ``data_format``.
* `sparse_scatter(blocks, indices, y, ...)`: differentiable in ``blocks`` (a
  gather of the output gradient) and in ``y``: the output gradient itself when
  adding, and with the written windows stamped out when overwriting. With
  ``inplace=True`` it writes into ``y`` and tells autograd so. Overwriting
  overlapping windows has no defined gradient (nor value), as in SBNet.
"""

import torch

from .. import sbnet as kernels


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
        return kernels.sparse_gather(x.detach(), indices, transpose=transpose, count=count, **geometry)

    @staticmethod
    def backward(ctx, grad_blocks):
        indices, *count = ctx.saved_tensors
        zeros = grad_blocks.new_zeros(ctx.shape)
        # Windows may overlap or repeat (every SparseResBlock's share a halo): add atomically,
        # into the fresh zeros themselves (into a copy would read and write the image once more).
        grad_x = kernels.sparse_scatter(grad_blocks.contiguous(), indices, zeros, add=True, atomic=True,
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
        out = kernels.sparse_scatter(blocks.detach(), indices, y.detach(), add=add, atomic=atomic,
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
        grad_blocks = kernels.sparse_gather(grad_out, indices, transpose=ctx.transpose, count=count,
                                            **ctx.geometry)
        if ctx.add:
            grad_y = grad_out
        else:  # the written windows no longer depend on y: stamp them out
            holes = grad_out.new_zeros(ctx.blocks_shape)
            grad_y = kernels.sparse_scatter(holes, indices, grad_out, transpose=ctx.transpose, count=count,
                                            **ctx.geometry)
        return grad_y, grad_blocks, None, None, None, None, None, None, None


def sparse_gather(x, indices, bsize, bstride, boffset=0, transpose=False, count=None, data_format="NHWC"):
    """Differentiable `sparseblocks.kernels.sbnet.sparse_gather`."""
    return _SparseGather.apply(x, indices, count, transpose, _geometry_kwargs(bsize, bstride, boffset, data_format))


def sparse_scatter(blocks, indices, y, bsize, bstride, boffset=0, add=False, atomic=False,
                   transpose=False, inplace=False, count=None, data_format="NHWC"):
    """Differentiable `sparseblocks.kernels.sbnet.sparse_scatter`."""
    return _SparseScatter.apply(y, blocks, indices, count, add, atomic, transpose, inplace,
                                _geometry_kwargs(bsize, bstride, boffset, data_format))
