"""`SparseResBlock`: SBNet's sparse bottleneck, equal to the dense block on the active windows.

Gather the active windows (with a fused NHWC -> NCHW transpose where asked), run
the 1x1, 3x3 and 1x1 VALID convolutions on the block stack, add-scatter the
result back onto the input. The output is ``x + F(x)`` on the active region and
``x`` elsewhere; the geometry comes from the convolutions
(`windows.calc_block_params_res_block`). In training, gather, residual and
scatter are one autograd node (`_WindowResidual`) with a written-out backward;
a subclass that overrides ``residual`` or ``residual_nhwc`` gets autograd's
backward of its own. ``graphs=True`` replays CUDA graphs of the residual and its
backward (`graphs`). Under `torch.compile`, and on CPU tensors (`torch.cpu`), the block is the
gather and scatter ops around the residual's torch operations (`_traced_forward`). Pass ``channels_last`` tensors to
skip a copy.
"""

from typing import Any, Dict, Optional, Tuple, Union

import torch

from .. import fused as fused_kernels
from .. import sbnet as kernels
from ..runtime.devices import on_arrays_device
from ..windows import calc_block_params_res_block, pair
from . import cpu
from . import fused as fused_ops  # noqa: F401 (registers the fused custom ops `_traced_forward` calls)
from .bottleneck import _bottleneck_nchw, _bottleneck_nhwc, _matmul, _nhwc_out_of_nchw, _second_relu, _without_grad
from .bottleneck import _WrittenOut
from .config import DEFAULT, ResBlockConfig, as_config
from .graphs import _WRITTEN_OUT, _ResidualGraphs, _Traced
from .sbnet import _written_into, sparse_gather, sparse_scatter


class SparseResBlock(torch.nn.Module):
    """SBNet's bottleneck residual block, computed only on the active blocks of a mask.

    ``channels -> bottleneck (1x1) -> bottleneck (3x3) -> channels (1x1)``,
    ReLU between, convolutions without bias so that the zeros read outside
    the image stay zeros, as the dense block's zero padding does.
    ``block_size`` is the input window (the output window is 2 smaller).

    Layout of the block stack the convolutions see: with ``transpose`` (SBNet's
    own), a channels_last input is gathered through the fused transpose into
    an NCHW stack, whose last 1x1 product writes its output NHWC, added back
    without the transpose (the backward's gradients likewise stay in the
    image's layout); without it (the default) a
    channels_last input gives an NHWC stack, whose 1x1 convolutions are matrix
    products over its pixels and whose 3x3 cuDNN's channels_last convolution
    takes as it is (`residual_nhwc`), and an NCHW input an NCHW stack.

    ``graphs=True``: calls on a GPU replay CUDA graphs of the residual and
    (training) of its backward, one per capacity of windows
    (`_ResidualGraphs`): the host then launches a gather, a graph and a
    scatter where it would launch each convolution, matrix product and ReLU.
    Each capacity's first call captures its graphs (milliseconds; buffers for
    the largest capacity seen stay held until `release_graphs`). A training
    call holds its buffers until its backward has run; a second backward
    through one forward (``retain_graph``) raises once a later call has
    taken them. Not inside another capture (the caller's graph holds the
    block's work then), not for a subclass's own residual.

    Under autocast the block runs in its input's dtype (autocast off inside
    it): the kernels add the residual into an image of its own dtype.
    ``config``: a `ResBlockConfig`, which fused kernels calls take.
    """

    KERNELS = (1, 3, 1)

    def __init__(self, channels: int, bottleneck: int, block_size: Union[int, Tuple[int, int]] = 16,
                 transpose: bool = False, graphs: bool = False, config: Optional[ResBlockConfig] = None) -> None:
        super().__init__()
        self._config = as_config(config) if config is not None else None
        if min(pair(block_size, "block_size")) < 3:
            raise ValueError(f"block_size: expected at least 3 on both axes (the 3x3 convolution's window), "
                             f"got {block_size!r}")
        self.block_size = block_size
        self.transpose = bool(transpose)
        self.graphs = bool(graphs)
        self._graphs = _ResidualGraphs()
        self.conv1 = torch.nn.Conv2d(channels, bottleneck, 1, bias=False)
        self.conv2 = torch.nn.Conv2d(bottleneck, bottleneck, 3, bias=False)
        self.conv3 = torch.nn.Conv2d(bottleneck, channels, 1, bias=False)
        self._geometries: Dict[Any, Any] = {}

    @property
    def config(self):
        """The block's `ResBlockConfig` (given, or the library's default at each call)."""
        return as_config(self._config)

    @config.setter
    def config(self, config):
        self._config = as_config(config) if config is not None else None

    def weights(self):
        """The three convolutions' weights, as the residual uses them."""
        try:  # (the registered parameters: ~1 µs, where nn.Module's attribute lookups take ~3.5)
            modules = self._modules
            return (modules["conv1"]._parameters["weight"], modules["conv2"]._parameters["weight"],
                    modules["conv3"]._parameters["weight"])
        except KeyError:  # a weight that is not a registered parameter (a parametrization, a tensor)
            return self.conv1.weight, self.conv2.weight, self.conv3.weight

    def release_graphs(self):
        """Drop the CUDA graphs (``graphs=True``) and the memory they hold."""
        self._graphs = _ResidualGraphs()

    def residual(self, x):
        """F(x) on an NCHW stack (VALID 3x3: 2 pixels smaller). The convolutions' weights are
        used directly (`weights`): module hooks on conv1..conv3 do not run."""
        return _bottleneck_nchw(x, *self.weights())[0]

    def residual_nhwc(self, stack):
        """F on an NHWC stack ``[n, bh, bw, C]`` -> ``[n, bh - 2, bw - 2, C]``: the same weights,
        the 1x1 convolutions as matrix products over the stack's pixels (cuBLAS), the 3x3 a
        channels_last convolution (faster than cuDNN's 1x1 convolutions in fp32)."""
        return _bottleneck_nhwc(stack, *self.weights())[0]

    def dense(self, x):
        """The same block computed densely (SAME padding): ``x + F(x)``."""
        h = torch.relu(self.conv1(x))
        h = torch.relu(torch.nn.functional.conv2d(h, self.conv2.weight, padding=1))
        return x + self.conv3(h)

    def geometry(self, shape):
        """Block geometry for an NCHW input shape (`reference.sbnet.BlockParams`), computed once
        per shape and block size (tens of µs of Python, every forward)."""
        N, C, H, W = shape
        key = (N, C, H, W, self.block_size)
        params = self._geometries.get(key)
        if params is None:
            params = self._geometries[key] = calc_block_params_res_block((N, H, W, C), self.block_size,
                                                                         self.KERNELS, 1, "SAME")
        return params

    def active_blocks(self, mask, tol=0.0, avgpool=False):
        """Indices ``[count, 3]`` and count of the windows of a mask ``[N, H, W]`` this block computes.

        The indices are cut to the active windows, so the convolutions run on
        those alone: one host sync per mask, which every block sharing the
        mask's geometry reuses (as SBNet does).
        """
        if len(mask.shape) != 3:
            raise ValueError(f"mask: expected [N, H, W], got shape {tuple(mask.shape)}")
        p = self.geometry((mask.shape[0], 0, mask.shape[1], mask.shape[2]))
        reduce = cpu.reduce_mask if isinstance(mask, torch.Tensor) and cpu.takes(mask) else kernels.reduce_mask
        indices, count = reduce(mask, p.bsize, p.bstride, p.boffset, tol=tol, avgpool=avgpool, bcount=p.bcount)
        if isinstance(indices, torch.Tensor):
            indices = indices[:int(count[0])]
        return indices, count

    @on_arrays_device  # (x's: the graphs' streams and torch's current device may be another's)
    def forward(self, x, indices, count=None, inplace=False):
        """``x`` NCHW (channels_last or contiguous); blocks from `active_blocks`.

        With ``inplace`` the residual is added into ``x`` itself, as SBNet does:
        no copy of the whole input, which at low active fractions would cost
        more than the blocks. ``x`` is returned then.
        """
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"x: expected a torch tensor, got {type(x).__name__}")
        if torch.is_autocast_enabled(x.device.type):
            # The block runs in x's dtype: the kernels add blocks of one dtype into an image of
            # the same, and autocast would give the residual another.
            with torch.autocast(x.device.type, enabled=False):
                return self.forward(x, indices, count, inplace)
        weights = self.weights()
        _check_input(x, weights[0])
        p = self.geometry(x.shape)
        if x.is_contiguous(memory_format=torch.channels_last):
            image, data_format, transpose = x.permute(0, 2, 3, 1), "NHWC", self.transpose
        else:
            if inplace and not x.is_contiguous():
                raise ValueError("x: inplace needs a contiguous or channels_last x")
            image, data_format, transpose = x.contiguous(), "NCHW", False
        nchw_stack = data_format == "NCHW" or transpose
        if torch.compiler.is_compiling() or cpu.takes(image):  # (CPU tensors: torch's ops, `torch.cpu`)
            y = self._traced_forward(image, indices, count, inplace, data_format, transpose, nchw_stack, p)
            return y.permute(0, 3, 1, 2) if data_format == "NHWC" else y

        cls = type(self)
        if cls.residual is SparseResBlock.residual and cls.residual_nhwc is SparseResBlock.residual_nhwc:
            residual, params = _WRITTEN_OUT[nchw_stack], weights
        else:  # a subclass's own residual: autograd differentiates it
            residual = _Traced(self.residual if nchw_stack else self.residual_nhwc)
            params = tuple(self.parameters())
        training = torch.is_grad_enabled() and (image.requires_grad or any(w.requires_grad for w in params))
        # (an in-place call without gradients may add an fp32 NCHW input's output by the fused kernel)
        fused_last = inplace and not training and weights[2].shape[1] <= self.config.fused_scatter_max_in
        windows = _Windows(indices, count, transpose, data_format, (p.bsize, p.bstride, p.boffset),
                           (p.bsize_out, p.bsize_out, 0),
                           nhwc_out=transpose or _nhwc_out_of_nchw(self.config, image, p.bsize_out, fused_last),
                           config=self.config)
        graphs = None
        if (self.graphs and image.is_cuda and isinstance(residual, _WrittenOut) and len(indices)
                and not torch.cuda.is_current_stream_capturing()):
            stack_shape = (image.shape[-1 if data_format == "NHWC" else 1], *p.bsize)
            graphs = (self._graphs, stack_shape if nchw_stack else (*stack_shape[1:], stack_shape[0]),
                      (residual.flips(windows), residual.flips_output(windows)))
        if training:
            y = _WindowResidual.apply(image, residual, windows, inplace, graphs, *params)
        else:
            y = None if graphs is None else graphs[0].run(residual, params, windows, image, inplace, *graphs[1:])
            if y is None:
                y = _without_grad(residual, params, windows, image, inplace)
        return y.permute(0, 3, 1, 2) if data_format == "NHWC" else y


    def _traced_forward(self, image, indices, count, inplace, data_format, transpose, nchw_stack, p):
        """The block as torch.compile traces it: the gather and the adding scatter as custom ops
        (`sparseblocks.torch.sbnet`), the residual as torch operations between them, for the
        compiler to fuse and differentiate. ``graphs`` and the fused kernels are not used:
        ``mode="reduce-overhead"`` captures the whole in CUDA graphs. Eager calls on CPU tensors
        take it too: the gather and scatter then index with torch (`torch.cpu`), and autograd
        differentiates the whole."""
        if torch.compiler.is_compiling() and self._compiles_fused(image, indices, data_format, transpose, p):
            return self._compiled_fused(image, indices, count, inplace, data_format, p)
        kwargs = {"transpose": transpose, "count": count, "data_format": data_format}
        stack = sparse_gather(image, indices, p.bsize, p.bstride, p.boffset, **kwargs)
        out = self.residual(stack) if nchw_stack else self.residual_nhwc(stack)
        return sparse_scatter(out.contiguous(), indices, image, p.bsize_out, p.bsize_out, 0, add=True,
                              inplace=inplace, **kwargs)


    def _compiles_fused(self, image, indices, data_format, transpose, p):
        """Whether the compiled block takes the fused custom ops (`torch.fused`): the library's own
        residual, and a first product `_fuses_gather` would fuse (its layout, few output channels,
        pixels enough), decided from shapes as the graph is traced."""
        cls, cfg = type(self), self.config
        w1 = self.weights()[0]
        return (cls.residual is SparseResBlock.residual and cls.residual_nhwc is SparseResBlock.residual_nhwc
                and cfg.fused_gather and (data_format, transpose) in cfg.fused_gather_layouts
                and w1.shape[0] <= cfg.fused_gather_max_out
                and indices.shape[0] * p.bsize[0] * p.bsize[1] >= cfg.fused_gather_min_pixels)

    def _compiled_fused(self, image, indices, count, inplace, data_format, p):
        """The compiled block on the fused kernels: the gather into the first product and its ReLU
        (NHWC, whatever the image's layout), the second ReLU and the last product as torch
        operations, and in an in-place call without gradients the last product added into the
        image by the fused scatter; else the adding scatter of the NHWC stack (the transpose for
        an NCHW image)."""
        cfg = self.config
        w1, w2, w3 = self.weights()
        geometry = (list(p.bsize), list(p.bstride), list(p.boffset))
        h1 = torch.ops.sparseblocks.sbnet_gather_matmul(image, indices, count, w1, *geometry, data_format)
        h2 = _second_relu(h1, w2)
        grad = torch.is_grad_enabled() and (image.requires_grad or any(w.requires_grad for w in (w1, w2, w3)))
        if (inplace and not grad and cfg.fused_scatter and (data_format == "NHWC" or cfg.fused_scatter_nchw)
                and h2.shape[-1] <= cfg.fused_scatter_max_in):
            out_at = (list(p.bsize_out), list(p.bsize_out), [0, 0])
            torch.ops.sparseblocks.sbnet_matmul_scatter_(h2, indices, count, w3, image, *out_at, data_format)
            return image
        out = _matmul(h2, w3.flatten(1).t()).contiguous()
        return sparse_scatter(out, indices, image, p.bsize_out, p.bsize_out, 0, add=True, inplace=inplace,
                              transpose=data_format == "NCHW", count=count, data_format=data_format)


def _check_input(x, w1):
    """The block's input against its first weight, before anything is launched: an [N, C, H, W]
    tensor of the weight's channels, dtype and device."""
    if x.dim() != 4:
        raise ValueError(f"x: expected [N, C, H, W], got shape {tuple(x.shape)}")
    if x.shape[1] != w1.shape[1]:
        raise ValueError(f"x: expected {w1.shape[1]} channels (the block's), got {x.shape[1]}")
    if x.dtype != w1.dtype:
        raise TypeError(f"x: expected the block's dtype {w1.dtype}, got {x.dtype}")
    if x.device != w1.device:
        raise ValueError(f"x: expected the block's device {w1.device}, got {x.device}")


class _Windows:
    """Where a block's windows are: indices, count, stack layout, the gather (input window) and
    scatter (output window) geometries, and whether an NCHW stack's output comes NHWC
    (``nhwc_out``; an NHWC stack's always does)."""

    def __init__(self, indices, count, transpose, data_format, gather_at, scatter_at, nhwc_out=False,
                 config=DEFAULT):
        self.indices, self.count, self.transpose, self.data_format = indices, count, transpose, data_format
        self.gather_at, self.scatter_at, self.nhwc_out, self.config = gather_at, scatter_at, nhwc_out, config

    def out_transpose(self, nhwc):
        """The scatter's ``transpose`` for the residual's output: where that is NHWC (``nhwc``),
        whether the image is NCHW; else the windows' own (None)."""
        return self.data_format == "NCHW" if nhwc else None

    def _kwargs(self, transpose=None):
        return {"transpose": self.transpose if transpose is None else transpose, "count": self.count,
                "data_format": self.data_format}

    def gather(self, image, at=None, out=None, transpose=None):
        return kernels.sparse_gather(image, self.indices, *(at or self.gather_at), out=out, **self._kwargs(transpose))

    def gather_matmul(self, image, weight, out=None):
        """relu(gather(image) @ weight^T) in one kernel (`kernels.gather_matmul`): the first 1x1
        convolution and its ReLU without the stack, the output NHWC (as both stacks' first ReLU's)."""
        return fused_kernels.sparse_gather_matmul(image, self.indices, weight, *self.gather_at, count=self.count,
                                                  relu=True, out=out, data_format=self.data_format)

    def matmul_scatter(self, blocks, weight, image):
        """image += scatter(blocks @ weight^T) at the output windows, in place, in one kernel
        (`kernels.gather_matmul`): the NHWC stack's last 1x1 convolution and the residual's add
        without the product's stack."""
        return fused_kernels.sparse_matmul_scatter(blocks, self.indices, weight, image, *self.scatter_at,
                                                   count=self.count, data_format=self.data_format)

    def scatter(self, blocks, image, inplace, atomic, at=None, transpose=None):
        """Add the blocks into `image` (a copy of it unless `inplace`)."""
        out = kernels.sparse_scatter(blocks, self.indices, image, *(at or self.scatter_at), add=True,
                                     atomic=atomic, inplace=inplace, **self._kwargs(transpose))
        return _written_into(image, out) if inplace else out


class _WindowResidual(torch.autograd.Function):
    """``image + scatter_add(residual(gather(image)))`` in one autograd node.

    One node instead of a gather and a scatter: the image's gradient is the
    output gradient plus the window gradients added into a copy of it
    (atomically: windows overlap by their halo), not a zeroed image scattered
    into and then summed with it. ``residual`` is a `_WrittenOut` or a
    `_Traced`; the parameters are saved for the backward, so an in-place change
    to one between forward and backward raises, as in torch's own nodes.
    """

    @staticmethod
    def forward(ctx, image, residual, windows, inplace, graphs, *params):  # (image first: see _SparseScatter)
        # graphs: (the block's `_ResidualGraphs`, the stack's shape, whether the backward flips), or None
        ctx.lease, saved = None, ()
        if graphs is not None:
            needs = (ctx.needs_input_grad[0], *ctx.needs_input_grad[5:])
            ctx.lease = graphs[0].lease(residual, params, image, *graphs[1:], len(windows.indices), needs)
        if ctx.lease is not None:
            y = ctx.lease.forward(windows, image if inplace else image.detach(), inplace)
        else:
            flip = residual.flips_output(windows)
            out, saved = residual.forward(windows.gather(image.detach()), params, keep=True, flipped=flip)
            y = windows.scatter(out.contiguous(), image if inplace else image.detach(), inplace, atomic=False,
                                transpose=windows.out_transpose(flip))
        # The residual's intermediates too: autograd frees them after the backward unless it is
        # to run again (retain_graph).
        ctx.save_for_backward(*params, *saved)
        ctx.residual, ctx.windows, ctx.n_params = residual, windows, len(params)
        if inplace:  # (y is image itself then)
            ctx.mark_dirty(image)
        return y

    @staticmethod
    def backward(ctx, grad_y):
        windows = ctx.windows
        grad_y = grad_y.contiguous()
        saved = ctx.saved_tensors  # (raises if a weight was changed in place since the forward)
        needs = (ctx.needs_input_grad[0], *ctx.needs_input_grad[5:])
        if ctx.lease is not None:
            grads = ctx.lease.backward(windows, grad_y)
        else:
            flip = ctx.residual.flips(windows)
            transpose = False if flip else None
            grad_out = windows.gather(grad_y, at=windows.scatter_at, transpose=transpose)
            grads = ctx.residual.backward(saved[ctx.n_params:], saved[:ctx.n_params], grad_out, needs, flipped=flip)
            if needs[0]:
                grads = (windows.scatter(grads[0].contiguous(), grad_y, False, atomic=True, at=windows.gather_at,
                                         transpose=transpose), *grads[1:])
        return (grads[0] if needs[0] else None, None, None, None, None, *grads[1:])
