"""The fused SBNet kernels (`sparseblocks.fused`) as torch custom ops, for `SparseResBlock` under
`torch.compile`:

* ``torch.ops.sparseblocks.sbnet_gather_matmul(x, indices, count, weight, bsize, bstride,
  boffset, data_format)``: ``relu(sparse_gather(x) @ weight.T)`` as an NHWC stack
  ``[n_blocks, bh, bw, C_out]``, whatever x's layout (the block's first 1x1 convolution and its
  ReLU without the gathered stack). Differentiable in x and weight: the backward gathers the
  stack again for the weight's gradient and scatter-adds the stack's gradient into x's (windows
  overlap by their halo).
* ``torch.ops.sparseblocks.sbnet_matmul_scatter_(blocks, indices, count, weight, y, bsize,
  bstride, boffset, data_format)``: ``y += sparse_scatter(blocks @ weight.T)`` in place, blocks
  an NHWC stack (the last 1x1 convolution and the residual's add); no autograd (the block takes
  it in calls without gradients only).

Each runs the fused kernel where it takes the tensors (`fused.takes`, `fused.scatter_takes`: a
device's or the simulator's, aligned, contiguous) and otherwise the same math from the gather,
scatter and matrix product apart, so that a compiled graph, which fixes its ops when traced, is
right for any tensors it is later called with. On CPU tensors both compute with torch's ops
(`torch.cpu`).
"""

from typing import List, Optional

import torch

from .. import fused as kernels
from . import cpu
from .sbnet import _on, _written_into


def _transpose(data_format):
    """The gather and scatter flag that makes a stack NHWC for an image of ``data_format``."""
    return data_format == "NCHW"


def _geometry(bsize, bstride, boffset):
    return tuple(bsize), tuple(bstride), tuple(boffset)


@torch.library.custom_op("sparseblocks::sbnet_gather_matmul", mutates_args=())
def sbnet_gather_matmul(x: torch.Tensor, indices: torch.Tensor, count: Optional[torch.Tensor], weight: torch.Tensor,
                        bsize: List[int], bstride: List[int], boffset: List[int], data_format: str) -> torch.Tensor:
    """``relu(sparse_gather(x) @ weight.T)``, NHWC, in one kernel where it takes the tensors."""
    size, stride, offset = _geometry(bsize, bstride, boffset)
    if not cpu.takes(x) and kernels.takes(x, weight, data_format, size):
        return kernels.sparse_gather_matmul(x, indices, weight, size, stride, offset, count=count, relu=True,
                                            data_format=data_format)
    stack = _on(x).sparse_gather(x, indices, size, stride, offset, transpose=_transpose(data_format), count=count,
                                 data_format=data_format)
    return torch.relu(stack @ weight.flatten(1).t())


@sbnet_gather_matmul.register_fake
def _(x, indices, count, weight, bsize, bstride, boffset, data_format):
    return x.new_empty((indices.shape[0], bsize[0], bsize[1], weight.shape[0]))


def _setup_gather_matmul(ctx, inputs, output):
    x, indices, count, weight, bsize, bstride, boffset, data_format = inputs
    ctx.save_for_backward(x, indices, weight, output, *(() if count is None else (count,)))
    ctx.geometry, ctx.data_format = (bsize, bstride, boffset), data_format


def _backward_gather_matmul(ctx, grad):
    x, indices, weight, out, *count = ctx.saved_tensors
    count = count[0] if count else None
    (bsize, bstride, boffset), data_format = ctx.geometry, ctx.data_format
    transpose = _transpose(data_format)
    grad_h = torch.ops.aten.threshold_backward.default(grad, out, 0)  # (ReLU's, from its output)
    grad_x = grad_w = None
    if ctx.needs_input_grad[3]:
        stack = torch.ops.sparseblocks.sbnet_gather(x, indices, count, bsize, bstride, boffset, transpose, data_format)
        grad_w = (grad_h.reshape(-1, grad_h.shape[-1]).t() @ stack.reshape(-1, stack.shape[-1])).view(weight.shape)
    if ctx.needs_input_grad[0]:
        grad_stack = (grad_h @ weight.flatten(1)).contiguous()
        grad_x = torch.ops.sparseblocks.sbnet_scatter(grad_stack, indices, torch.zeros_like(x), count, bsize, bstride,
                                                      boffset, True, True, transpose, data_format)
    return grad_x, None, None, grad_w, None, None, None, None


sbnet_gather_matmul.register_autograd(_backward_gather_matmul, setup_context=_setup_gather_matmul)


@torch.library.custom_op("sparseblocks::sbnet_matmul_scatter_", mutates_args=("y",))
def sbnet_matmul_scatter_(blocks: torch.Tensor, indices: torch.Tensor, count: Optional[torch.Tensor],
                          weight: torch.Tensor, y: torch.Tensor, bsize: List[int], bstride: List[int],
                          boffset: List[int], data_format: str) -> None:
    """``y += sparse_scatter(blocks @ weight.T)`` in place, in one kernel where it takes the tensors."""
    size, stride, offset = _geometry(bsize, bstride, boffset)
    if not cpu.takes(y) and kernels.scatter_takes(blocks, weight, y, data_format, size, stride, offset):
        _written_into(y, kernels.sparse_matmul_scatter(blocks, indices, weight, y, size, stride, offset, count=count,
                                                       data_format=data_format))
        return
    out = (blocks @ weight.flatten(1).t()).contiguous()
    _written_into(y, _on(y).sparse_scatter(out, indices, y, size, stride, offset, add=True, atomic=False,
                                           transpose=_transpose(data_format), inplace=True, count=count,
                                           data_format=data_format))


@sbnet_matmul_scatter_.register_fake
def _(blocks, indices, count, weight, y, bsize, bstride, boffset, data_format):
    return None
