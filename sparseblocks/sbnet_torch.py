"""SBNet for torch: autograd for sparse gather and scatter, and a sparse ResNet block.

* `sparse_gather(x, indices, ...)`: differentiable; its gradient is an atomic
  scatter-add of the block gradients (windows may overlap), with the same
  ``transpose`` and ``data_format``.
* `sparse_scatter(blocks, indices, y, ...)`: differentiable in ``blocks`` (a
  gather of the output gradient, same ``transpose``) and in ``y``: the output
  gradient itself when adding, and when overwriting the output gradient with
  the written windows stamped out (they no longer depend on ``y``). With
  ``inplace=True`` it writes into ``y`` and tells autograd so (usable in
  training like any in-place op). Overwriting overlapping windows has no
  defined gradient (nor value), as in SBNet.
* `SparseResBlock`: SBNet's bottleneck — gather the active windows with a
  fused NHWC -> NCHW transpose, 1x1, 3x3 and 1x1 VALID convolutions on the
  block stack (the 3x3 through cuDNN, channels_last; the 1x1s as matrix
  products over the stack's pixels, the first batched by window on an NCHW
  stack), add-scatter the result back onto the input (in the input's own
  layout where the stack came through the transpose: no transpose back).
  Its output equals the dense block ``x + F(x)`` on the active region and
  ``x`` elsewhere; the block geometry comes from the convolutions
  (`reference.sbnet.calc_block_params_res_block`). In training, gather,
  residual and scatter are one autograd node (`_WindowResidual`: the input's
  gradient is the output's plus the window gradients added atomically into a
  copy of it; no double backward) whose backward is written out (a dozen
  torch calls, no autograd graph of the residual); a subclass that overrides
  `residual` or `residual_nhwc` gets autograd's backward of its own instead.
  Without gradients, the kernels alone, the gather fused into the first 1x1
  product where that is faster (`FUSED_GATHER`, `kernels.gather_matmul`), and the
  last product into the scatter in place (`FUSED_SCATTER`; an NCHW input's
  too, `FUSED_SCATTER_NCHW`, its output then NHWC).
  ``graphs=True`` replays CUDA graphs of the residual and its backward
  (`_ResidualGraphs`).

Tensors are NCHW as torch likes them; the kernels want NHWC memory, so pass
``channels_last`` tensors (``x.to(memory_format=torch.channels_last)``) to
skip a copy.
"""

import torch

from ._arrays import torch_stream_handle
from .kernels import gather_matmul as fused_kernels
from .kernels import sbnet as kernels
from .reference.sbnet import calc_block_params_res_block, check_geometry, pair


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
    """

    KERNELS = (1, 3, 1)

    def __init__(self, channels, bottleneck, block_size=16, transpose=False, graphs=False):
        super().__init__()
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
        self._geometries = {}

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
        channels_last convolution. Session 18, H100, the block in a CUDA graph, 1 x 400 x 700 x
        256 -> 64: fp32 1.2-1.4x faster than with cuDNN's 1x1 convolutions (forward 0.317 ->
        0.233 ms at 10.7 % active, training step 1.446 -> 1.170), fp16 the same."""
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
        indices, count = kernels.reduce_mask(mask, p.bsize, p.bstride, p.boffset, tol=tol, avgpool=avgpool,
                                             bcount=p.bcount)
        if isinstance(indices, torch.Tensor):
            indices = indices[:int(count[0])]
        return indices, count

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

        cls = type(self)
        if cls.residual is SparseResBlock.residual and cls.residual_nhwc is SparseResBlock.residual_nhwc:
            residual, params = _WRITTEN_OUT[nchw_stack], weights
        else:  # a subclass's own residual: autograd differentiates it
            residual = _Traced(self.residual if nchw_stack else self.residual_nhwc)
            params = tuple(self.parameters())
        training = torch.is_grad_enabled() and (image.requires_grad or any(w.requires_grad for w in params))
        # (an in-place call without gradients may add an fp32 NCHW input's output by the fused kernel)
        fused_last = inplace and not training and weights[2].shape[1] <= FUSED_SCATTER_MAX_IN
        windows = _Windows(indices, count, transpose, data_format, (p.bsize, p.bstride, p.boffset),
                           (p.bsize_out, p.bsize_out, 0),
                           nhwc_out=transpose or _nhwc_out_of_nchw(image, p.bsize_out, fused_last))
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


# An NCHW stack's residual writes its output NHWC (`_bottleneck_nchw_nhwc_out`: the last 1x1 one product
# over all the stack's pixels, where NCHW it was batched products of 196-pixel blocks, cuBLAS's
# slowest shapes here) where the stack came through the transpose (the image NHWC: the scatter then
# skips the transpose, as the backward does, `_bottleneck_nchw_image_backward`) and, with
# NCHW_INPUT_NHWC_OUT, from an fp16 NCHW image (the scatter then goes through the transpose, whose
# fp16 pair tiles cost less than the product saves; fp32's element tiles cost more). Session 34,
# H100, graph µs, 1 x 400 x 700 x 256 -> 64 (`scripts/nchw_input_routes.py`) at 5 / 10 / 25 / 50 %
# of the windows, fp16: residual NCHW out / NHWC out 30.0 / 22.8, 48.0 / 38.2, 96.3 / 76.4, 174.2 /
# 136.8; scatter of NCHW / NHWC blocks into the NCHW image 26.2 / 29.0, 54.1 / 57.5, 121.0 / 129.6,
# 227.7 / 246.2; fp32 at 25 / 50 %: residual 337.8 / 326.3, 681.9 / 638.2, scatter 182.5 / 264.9,
# 360.7 / 552.1. Session 35 (the pair tiles' scatter rewritten), fp16 scatter of NCHW / NHWC blocks:
# 27.0 / 22.6, 53.7 / 47.2, 121.5 / 95.7, 230.2 / 156.7.
# NCHW_INPUT_NHWC_OUT_FUSED: an in-place call without gradients flips any NCHW input's output NHWC
# where the fused product and scatter will add it (fp32 too, whose other calls keep the NCHW output).
# Session 37, H100, fp32 block on 1 x 256 x 400 x 700 at 5 / 10 / 25 / 50 %, graph µs, NCHW output
# and scatter / flipped and fused: 189.7 / 173.8, 294.8 / 212.4, 657.0 / 449.7, 1276.6 / 870.2.
NCHW_INPUT_NHWC_OUT = True
NCHW_INPUT_NHWC_OUT_FUSED = True


def _nhwc_out_of_nchw(image, window, fused_last=False):
    """Whether an NCHW stack from this NCHW image has its output NHWC (NCHW_INPUT_NHWC_OUT): where
    the adding scatter of NHWC blocks of the output ``window`` (every ``window``, from 0) into it goes
    by the fp16 pair tiles (`kernels.pair_shapes`: C, W and the window's width even, rows of at most
    PAIR_TILE_PIXELS pixels), not by the generic tile; with NCHW_INPUT_NHWC_OUT_FUSED, also where
    ``fused_last`` (an in-place call without gradients) lets the fused product and scatter add it
    (`FUSED_SCATTER_NCHW`: fp32 too)."""
    if not NCHW_INPUT_NHWC_OUT:
        return False
    if (NCHW_INPUT_NHWC_OUT_FUSED and fused_last and FUSED_SCATTER and FUSED_SCATTER_NCHW
            and image.dtype in (torch.float16, torch.float32)
            and fused_kernels.nchw_scatter_fits(image.element_size(), image.shape[3], image.data_ptr(),
                                                *check_geometry(window, window, 0))):
        return True
    return image.dtype == torch.float16 and kernels.pair_shapes(True, True, False, image.shape, False, True,
                                                                "float16", (window, window, (0, 0)))


class _Windows:
    """Where a block's windows are: indices, count, stack layout, the gather (input window) and
    scatter (output window) geometries, and whether an NCHW stack's output comes NHWC
    (``nhwc_out``; an NHWC stack's always does)."""

    def __init__(self, indices, count, transpose, data_format, gather_at, scatter_at, nhwc_out=False):
        self.indices, self.count, self.transpose, self.data_format = indices, count, transpose, data_format
        self.gather_at, self.scatter_at, self.nhwc_out = gather_at, scatter_at, nhwc_out

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


def _relu_backward(grad, out):
    """ReLU's gradient from its output (zero where the output is)."""
    return torch.ops.aten.threshold_backward.default(grad, out, 0)


def _conv_backward(grad, x, weight, needs):
    """(input gradient, weight gradient) of a stride-1, unpadded, bias-free convolution; None for
    what ``needs`` (two flags) does not ask for."""
    if not any(needs):
        return None, None
    return torch.ops.aten.convolution_backward.default(grad, x, weight, None, [1, 1], [0, 0], [1, 1], False,
                                                       [0, 0], 1, [*needs, False])[:2]


# The NHWC stack's first ReLU fused into the matrix product before it (cuBLASLt's epilogue:
# `torch._addmm_activation` with a zero bias; where cuBLASLt cannot take the shapes, torch runs
# the product and the ReLU apart). torch gives that op no derivative: where autograd records (a
# caller differentiating `residual_nhwc`), they run apart. Session 24, H100, graph ms, fp16 at
# 10 / 25 / 50 % active, fused / apart: forward 0.057 / 0.059, 0.139 / 0.143, 0.268 / 0.279,
# training step 0.375 / 0.377, 0.526 / 0.531, 0.816 / 0.828; host time of an eager fp16
# forward 0.18-0.23 against 0.22-0.31 ms (`scripts/res_block_ab.py --graph`).
# cuDNN's fused convolution and ReLU (`torch.cudnn_convolution_relu`) for the 3x3 saved a
# little more device time in fp16 but cost more host time than the two calls, and in fp32 more
# device time: not used.
# Off since session 30: the epilogue's ReLU makes a NaN 0 (H100, fp16 and fp32:
# `scripts/nan_paths.py`), where torch's ReLU and the dense block keep it, so a diverging model's
# NaNs would vanish inside the block. The 2-4 % of device time and one torch call of host time
# are the price of NaNs coming out where the dense block's do.
FUSED_MATMUL_RELU = False
_zero_biases = {}


def _zero_bias(like, n):
    """n zeros of like's dtype and device, kept where made outside a graph capture (one made in
    a capture is zeroed only by the graph's replays, and its memory is the graph's)."""
    key = (like.dtype, like.device, n)
    bias = _zero_biases.get(key)
    if bias is None:
        bias = torch.zeros(n, dtype=like.dtype, device=like.device)
        if not (like.is_cuda and torch.cuda.is_current_stream_capturing()):
            _zero_biases[key] = bias
    return bias


def _recorded(x, w):
    """Whether autograd records an operation on x and w."""
    return torch.is_grad_enabled() and (x.requires_grad or w.requires_grad)


def _relu(x, into=None):
    """ReLU in place, or into ``into`` (a graph's buffer) when given."""
    return x.relu_() if into is None else torch.clamp_min(x, 0, out=into)


def _matmul(x, w, into=None):
    """``x @ w`` over x's last axis; into ``into`` (x's leading shape) when given."""
    if into is None:
        return x @ w
    torch.mm(x.reshape(-1, x.shape[-1]), w, out=into.view(-1, w.shape[1]))
    return into


def _matmul_relu(x, w, into=None):
    """``relu(x @ w)`` over x's last axis, into ``into`` when given."""
    if not FUSED_MATMUL_RELU or _recorded(x, w):
        return _matmul(x, w, into).relu_()
    rows, bias = x.reshape(-1, x.shape[-1]), _zero_bias(x, w.shape[1])
    if into is None:
        return torch._addmm_activation(bias, rows, w).view(*x.shape[:-1], w.shape[1])
    torch._addmm_activation(bias, rows, w, out=into.view(-1, w.shape[1]))
    return into


# The residual and its backward take ``into``: buffers to write the tensors that outlive a call
# (the output, the ReLUs' outputs, the stack's gradient) into, as a CUDA graph of them must
# (`_Slot`); None allocates.
NOWHERE = (None, None, None)


def _batched(weight, n):
    """A 1x1 convolution's weight as n matrices [out, in] for `torch.bmm` (one, n times: no copy)."""
    w = weight.flatten(1)
    return w.expand(n, *w.shape)


def _pixels(t):
    """An NHWC stack [n, h, w, c] as [n, h * w, c] (a view where t is contiguous)."""
    return t.reshape(t.shape[0], t.shape[1] * t.shape[2], t.shape[3])


def _bmm(a, b, shape, into=None):
    """``torch.bmm(a, b)`` viewed as ``shape``; written into ``into`` (of that shape), and
    ``into`` returned, when given."""
    if into is None:
        return torch.bmm(a, b).view(shape)
    torch.bmm(a, b, out=into.view(a.shape[0], a.shape[1], b.shape[2]))
    return into


# The NCHW stack's 1x1 convolutions are batched matrix products that read each block transposed,
# and its 3x3 runs on an NHWC first-ReLU output. cuDNN's convolutions on the NCHW stack
# converted it, and their channels_last outputs, between layouts (torch copies as long as the
# stack); this way nothing is copied. Where the stack came through the transpose, the backward
# takes and gives its gradients in the image's layout (`_bottleneck_nchw_image_backward`).
# Session 27, H100, 1 x 400 x 700 x 256 -> 64, graph µs at 10 / 25 / 50 % active, SBNet's fused
# transpose (`transpose=True`), now / cuDNN: fp16 forward 81 / 172, 179 / 423, 347 / 855 (dense
# 381), training step 406 / 742, 596 / 1476, 966 / 2768 (dense 1001); fp32 forward 214 / 413,
# 480 / 997, 958 / 2001, training 1108 / 1676, 1977 / 3504, 3476 / 6616. NCHW input, fp16
# forward 167 / 259, 360 / 609, 690 / 1199 (`scripts/nchw_stack_variants.py`).
def _bottleneck_nchw(stack, w1, w2, w3, into=NOWHERE):
    """F on an NCHW stack (`SparseResBlock.residual`): the output NCHW, and what its backward
    needs: (stack, h1, h2), the ReLUs' outputs NHWC."""
    h1 = _nchw_first_relu(stack, w1, into[0])
    h2 = _second_relu(h1, w2, into[1])
    n = stack.shape[0]
    columns = _pixels(h2).transpose(1, 2)
    return _bmm(_batched(w3, n), columns, (n, w3.shape[0], *h2.shape[1:3]), into[2]), (stack, h1, h2)


def _nchw_first_relu(stack, w1, into=None):
    """The NCHW stack's first 1x1 convolution and ReLU: batched products that read each block
    transposed, the output NHWC."""
    n, c, bh, bw = stack.shape
    rows = stack.view(n, c, bh * bw).transpose(1, 2)
    return _bmm(rows, _batched(w1, n).transpose(1, 2), (n, bh, bw, w1.shape[0]), into).relu_()


def _bottleneck_nchw_nhwc_out(stack, w1, w2, w3, into=NOWHERE):
    """`_bottleneck_nchw` with the output NHWC (`_Windows.nhwc_out`): the last 1x1 one product over
    all the stack's pixels (in place into an NHWC image: fused into the scatter, `_fuses_scatter`)."""
    h1 = _nchw_first_relu(stack, w1, into[0])
    out, h2 = _after_first_product(h1, w2, w3, into)
    return out, (stack, h1, h2)


def _nchw_weight_grad(grad, stack, weight):
    """The first 1x1's weight gradient from its NHWC output gradient and the NCHW stack: a sum over
    the windows of batched products (one product would need the stack transposed)."""
    pixels = _pixels(grad)
    columns = stack.view(stack.shape[0], stack.shape[1], pixels.shape[1])
    return torch.bmm(pixels.transpose(1, 2), columns.transpose(1, 2)).sum(0).view(weight.shape)


def _second_relu_backward(grad_h2, h1, h2, w2, need_h1, need_w2):
    """From the gradient of the second ReLU's output (both ReLUs' outputs NHWC): (the gradient
    of the first 1x1's output, NHWC, or None where ``need_h1`` is false; w2's gradient or None)."""
    grad_h1, grad_w2 = _conv_backward(_relu_backward(grad_h2, h2).permute(0, 3, 1, 2), h1.permute(0, 3, 1, 2),
                                      w2, (need_h1, need_w2))
    return (_relu_backward(grad_h1.permute(0, 2, 3, 1), h1) if need_h1 else None), grad_w2


def _bottleneck_nchw_backward(saved, weights, grad_out, needs, into=None):
    """Gradients of (stack, w1, w2, w3) for those ``needs`` asks for (None for the others)."""
    stack, h1, h2 = saved
    w1, w2, w3 = weights
    n = stack.shape[0]
    need_h1 = needs[0] or needs[1]
    need_h2 = need_h1 or needs[2]
    g = grad_out.reshape(n, grad_out.shape[1], grad_out.shape[2] * grad_out.shape[3])
    grad_w3 = torch.bmm(g, _pixels(h2)).sum(0).view(w3.shape) if needs[3] else None
    grad_h1 = grad_w2 = grad_stack = grad_w1 = None
    if need_h2:
        grad_h1, grad_w2 = _second_relu_backward(torch.bmm(g.transpose(1, 2), _batched(w3, n)).view(h2.shape),
                                                 h1, h2, w2, need_h1, needs[2])
    if need_h1:
        grad_w1 = _nchw_weight_grad(grad_h1, stack, w1) if needs[1] else None
        grad_h1 = _pixels(grad_h1)
        if needs[0]:
            grad_stack = _bmm(_batched(w1, n).transpose(1, 2), grad_h1.transpose(1, 2), stack.shape, into)
    return grad_stack, grad_w1, grad_w2, grad_w3


def _bottleneck_nchw_image_backward(saved, weights, grad_out, needs, into=None):
    """`_bottleneck_nchw_backward` with the output's and the stack's gradients NHWC, the image's
    layout where the forward gathered through the transpose: the backward's gather and atomic
    scatter then copy without transposing (the scatter of a transposed stack adds each value
    atomically on its own, ~3x slower in fp16), and the other products are single ones."""
    return _bottleneck_nhwc_backward(saved, weights, grad_out, needs, into, nchw_stack=True)


def _bottleneck_nhwc(stack, w1, w2, w3, into=NOWHERE):
    """F on an NHWC stack (`SparseResBlock.residual_nhwc`), and what its backward needs (the
    stack and both ReLUs' outputs, NHWC)."""
    h1 = _first_relu(stack, w1, into[0])
    out, h2 = _after_first_product(h1, w2, w3, into)
    return out, (stack, h1, h2)


def _first_relu(stack, w1, into=None):
    """The NHWC bottleneck's first 1x1 convolution and ReLU, over the stack's pixels."""
    return _matmul_relu(stack, w1.flatten(1).t(), into)


def _second_relu(h1, w2, into=None):
    """The NHWC bottleneck's 3x3 convolution and ReLU, from its first ReLU's output."""
    return _relu(torch.nn.functional.conv2d(h1.permute(0, 3, 1, 2), w2).permute(0, 2, 3, 1), into)


def _after_first_product(h1, w2, w3, into=NOWHERE):
    """The NHWC bottleneck from its first ReLU's output on: (its output, the second ReLU's)."""
    h2 = _second_relu(h1, w2, into[1])
    return _matmul(h2, w3.flatten(1).t(), into[2]), h2


# Calls without gradients on an NHWC stack of FUSED_GATHER_MIN_PIXELS pixels or more gather the
# windows straight into the first 1x1 product and its ReLU (`kernels.gather_matmul`: the stack,
# the block's largest tensor, is never written). Session 25, H100, graph µs, 1 x 400 x 700 x 256
# -> 64, windows of 16 every 14, fp16 at 5 / 10 / 25 / 50 % of the windows (19k to 174k stack
# pixels), fused / gather then cuBLAS: 13.1 / 10.2, 17.3 / 22.6, 37.6 / 57.6, 61.2 / 110.3; fp32
# 33.4 / 37.2, 47.6 / 70.0, 89.3 / 161.3, 172.1 / 300.8. Few windows leave a thread block a
# multiprocessor, one warp a scheduler, its latencies exposed: there the two calls stay. Nor
# where the product has more than FUSED_GATHER_MAX_OUT output channels: there the product, not
# the stack's memory, bounds it, and cuBLAS's (wgmma) is faster than the kernel's mma.sync
# (fp16 512 -> 128 at 10 / 50 %: 20.7 / 12.0, 55.3 / 57.4 µs; 1024 -> 256: 23.0 / 9.5, 49.3 /
# 29.0; `results/gather_matmul.md`).
# FUSED_GATHER_LAYOUTS: the (image layout, transpose) of the windows it applies to; its output,
# the first ReLU's, is NHWC from either stack, so the NCHW stack's blocks take it too (an NCHW
# image's by its own kernel, `gather_matmul`'s NCHW tile). Session 36, H100, graph µs, same
# geometry at 10 / 25 / 50 %, block without gradients in place, unfused / fused: NCHW fp16 input
# 113.9 / 99.5, 232.7 / 195.5, 390.2 / 321.1 (dense channels_last block 381.4); channels_last input
# with ``transpose=True`` 66.0 / 50.7, 138.9 / 106.5, 266.9 / 189.1. At 5 % (below
# FUSED_GATHER_MIN_PIXELS) the NCHW kernel is no faster than the gather and the product apart
# (17.3 against 16.6 + 6.9). `scripts/nchw_fused_gather.py`.
FUSED_GATHER = True
FUSED_GATHER_MIN_PIXELS = 32768
FUSED_GATHER_MAX_OUT = 64
FUSED_GATHER_LAYOUTS = {("NHWC", False), ("NCHW", False), ("NCHW", True), ("NHWC", True)}


def _fuses_gather(windows, image, w1, any_size=False):
    """Whether a call without gradients takes `kernels.gather_matmul` for its gather and first
    product: a layout it applies to, tensors the kernel takes, few output channels, and pixels
    enough (``any_size``: however few, `_host_bound`)."""
    if not FUSED_GATHER or (windows.data_format, windows.transpose) not in FUSED_GATHER_LAYOUTS:
        return False
    size = windows.gather_at[0]  # (h, w): the block's geometry
    return (w1.shape[0] <= FUSED_GATHER_MAX_OUT
            and (any_size or len(windows.indices) * size[0] * size[1] >= FUSED_GATHER_MIN_PIXELS)
            and fused_kernels.takes(image, w1, windows.data_format, size))


# In-place calls without gradients on an NHWC stack add the last 1x1 product straight into the
# image (`kernels.gather_matmul.sparse_matmul_scatter`: the product's stack is never written) where
# the product has at most FUSED_SCATTER_MAX_IN input channels and the stack FUSED_SCATTER_MIN_PIXELS
# output pixels or more (by dtype). Session 26, H100, graph µs, 1 x 400 x 700, 64 -> 256, windows of
# 14, at 5 / 10 / 25 / 50 % of the windows (14k to 144k output pixels), fused / cuBLAS then the
# scatter (`results/gather_matmul.md`): fp16 11.7 / 9.5, 19.2 / 18.2, 43.2 / 53.1, 95.9 / 114.3;
# fp32 28.0 / 33.2, 44.3 / 64.9, 114.4 / 167.6, 211.5 / 319.2. Wider products are slower fused in
# fp16 (128 -> 512: 0.66-0.95x, 256 -> 1024: 0.52-0.71x). A call into a copy of the image gains
# nothing: the copy's pass and the windows' adds move the bytes that the product and a merged
# scatter do.
# FUSED_SCATTER_NCHW: an NCHW image too (an fp16 NCHW input's NHWC output, `NCHW_INPUT_NHWC_OUT`,
# added through the transpose by words), where cuBLAS and the pair tiles' scatter ran: session 37,
# H100, 1 x 256 x 400 x 700, 64 -> 256, at 5 / 10 / 25 / 50 %, 23.3 / 50.8 / 101.9 / 173.0 µs against
# 30.0 / 57.0 / 112.1 / 185.9 (`scripts/nchw_fused_scatter.py`).
FUSED_SCATTER = True
FUSED_SCATTER_NCHW = True
FUSED_SCATTER_MAX_IN = 64
FUSED_SCATTER_MIN_PIXELS = {("NHWC", torch.float16): 49152}  # (others: any)


def _fuses_scatter(windows, image, h2, w3, any_size=False):
    """Whether an in-place call without gradients takes `kernels.gather_matmul.sparse_matmul_scatter`
    for its last product and the scatter: the output NHWC (an NHWC stack's, or a flipped NCHW
    stack's), an NHWC image (or an NCHW one, FUSED_SCATTER_NCHW), tensors and windows the kernel
    takes, a narrow product and pixels enough (``any_size``: however few, `_host_bound`)."""
    data_format = windows.data_format
    if not FUSED_SCATTER or (data_format == "NCHW" and not FUSED_SCATTER_NCHW):
        return False
    size = windows.scatter_at[0]
    least = 0 if any_size else FUSED_SCATTER_MIN_PIXELS.get((data_format, image.dtype), 0)
    return (h2.shape[-1] <= FUSED_SCATTER_MAX_IN and len(windows.indices) * size[0] * size[1] >= least
            and fused_kernels.scatter_takes(h2, w3, image, data_format, *windows.scatter_at))


# Below those pixel counts the fused kernels cost the device a few µs more than the torch calls
# they replace (the first product and its ReLU, the last product), but those calls cost the host
# 15-35 µs each (torch's profiler, H200), and there an eager call (a CUDA tensor, no graph capture,
# no `graphs=True`) is bound by the host's time: at 5 % of the benchmark's windows the device's
# work is ~30 µs, the host's ~200 µs. Such calls take the fused kernels at any size
# (FUSED_WHEN_HOST_BOUND); in a capture, the device's time decides. Session 38, H200, fp16, host
# µs a call, two rounds, off / on: 4.8 % 471, 307 / 131, 127; 10.7 % 161, 157 / 128, 129
# (`scripts/host_res_block_forward.py`).
FUSED_WHEN_HOST_BOUND = True


def _host_bound(image):
    """Whether a call without gradients on `image` is bound by the host's time: a CUDA tensor's,
    launched as it comes (no graph capture)."""
    return FUSED_WHEN_HOST_BOUND and image.is_cuda and not torch.cuda.is_current_stream_capturing()


def _without_grad(residual, weights, windows, image, inplace):
    """`image` (or a copy of it) plus the residual of its windows, no autograd: on the NHWC stack
    the first product takes the gather (`_fuses_gather`), and where the output is NHWC (an NHWC
    stack's or a flipped one's) and so is the image the last the scatter (`_fuses_scatter`), where
    that pays."""
    if not (isinstance(residual, _WrittenOut) and residual.nhwc_output(windows)):
        out = residual.forward(windows.gather(image), weights, keep=False)[0]
        return windows.scatter(out.contiguous(), image, inplace, atomic=False)
    w1, w2, w3 = weights
    any_size = _host_bound(image)
    if _fuses_gather(windows, image, w1, any_size):
        h1 = windows.gather_matmul(image, w1)
    else:
        h1 = residual.first(windows.gather(image), w1)
    h2 = _second_relu(h1, w2)
    if inplace and _fuses_scatter(windows, image, h2, w3, any_size):
        return windows.matmul_scatter(h2, w3, image)
    return windows.scatter(_matmul(h2, w3.flatten(1).t()), image, inplace, atomic=False,
                           transpose=windows.out_transpose(True))


def _bottleneck_nhwc_backward(saved, weights, grad_out, needs, into=None, nchw_stack=False):
    """`_bottleneck_nchw_backward` for the NHWC stack: the 1x1s' gradients are matrix products
    over all the stack's pixels at once. ``nchw_stack``: the saved stack is NCHW (the first
    weight's gradient is then a sum of batched products), the rest NHWC."""
    stack, h1, h2 = saved
    w1, w2, w3 = weights
    need_h1 = needs[0] or needs[1]
    need_h2 = need_h1 or needs[2]

    def weight_grad(grad, x, weight):  # sum over the pixels of grad x^T, as the weight is shaped
        return (grad.reshape(-1, grad.shape[-1]).t() @ x.reshape(-1, x.shape[-1])).view(weight.shape)

    grad_w3 = weight_grad(grad_out, h2, w3) if needs[3] else None
    grad_h1 = grad_w2 = grad_stack = grad_w1 = None
    if need_h2:
        grad_h1, grad_w2 = _second_relu_backward(grad_out @ w3.flatten(1), h1, h2, w2, need_h1, needs[2])
    if need_h1:
        grad_w1 = (_nchw_weight_grad if nchw_stack else weight_grad)(grad_h1, stack, w1) if needs[1] else None
        grad_stack = _matmul(grad_h1, w1.flatten(1), into) if needs[0] else None
    return grad_stack, grad_w1, grad_w2, grad_w3


class _WrittenOut:
    """The block's own residual with its backward written out: a dozen torch calls, where
    autograd's would build the residual's graph in the forward and run it through a nested
    engine call in the backward. ``first``: its first product and ReLU (the stack -> the first
    ReLU's output). ``nhwc_forward``: the forward with its output NHWC where the stack is not
    (`flips_output`); ``image_backward``: the backward with the gradients in the image's layout,
    for stacks gathered through the transpose (`flips`)."""

    def __init__(self, forward, backward, first, nhwc_forward=None, image_backward=None):
        self._forward, self._backward, self.first = forward, backward, first
        self._nhwc_forward, self._image_backward = nhwc_forward, image_backward
        self.output_flips = nhwc_forward is not None  # (where the windows ask, `_Windows.nhwc_out`)

    def flips(self, windows):
        """Whether the backward's gather and scatter of these windows skip the transpose (the
        gradients then come and go in the image's layout)."""
        return windows.transpose and self._image_backward is not None

    def flips_output(self, windows):
        """Whether the forward's output for these windows comes NHWC though the stack is not
        (`_Windows.nhwc_out`; its scatter's transpose: `_Windows.out_transpose`)."""
        return windows.nhwc_out and self.output_flips

    def nhwc_output(self, windows):
        """Whether the output comes NHWC: an NHWC stack's, or flipped."""
        return self._forward is _bottleneck_nhwc or self.flips_output(windows)

    def forward(self, stack, weights, keep=False, into=NOWHERE, flipped=False):
        return (self._nhwc_forward if flipped else self._forward)(stack, *weights, into=into)

    def backward(self, saved, weights, grad_out, needs, into=None, flipped=False):
        return (self._image_backward if flipped else self._backward)(saved, weights, grad_out, needs, into=into)


class _Traced:
    """Any residual (a subclass's), differentiated by autograd: its graph is built in the
    forward (``keep``) and run in the backward."""

    def __init__(self, residual):
        self.residual = residual

    @staticmethod
    def flips(windows):  # (autograd's backward takes the gradient in the output's layout)
        return False

    @staticmethod
    def flips_output(windows):  # (the subclass's residual gives its stack's layout)
        return False

    nhwc_output = flips_output

    def forward(self, stack, params, keep, flipped=False):  # (never flipped: see `flips`)
        if not keep:
            return self.residual(stack), None
        with torch.enable_grad():
            out = self.residual(stack.requires_grad_(True))
        return out.detach(), (stack, out)

    @staticmethod
    def backward(saved, params, grad_out, needs, flipped=False):  # (never flipped: see `flips`)
        stack, out = saved
        wanted = [t for t, need in zip((stack, *params), needs) if need]
        # (retained: autograd frees `out`, and with it this graph, once the block's node is spent)
        found = iter(torch.autograd.grad(out, wanted, grad_out, allow_unused=True, retain_graph=True))
        return tuple(next(found) if need else None for need in needs)


_WRITTEN_OUT = {False: _WrittenOut(_bottleneck_nhwc, _bottleneck_nhwc_backward, _first_relu),
                True: _WrittenOut(_bottleneck_nchw, _bottleneck_nchw_backward, _nchw_first_relu,
                                  _bottleneck_nchw_nhwc_out, _bottleneck_nchw_image_backward)}  # by NCHW stack


def _capacity(n):
    """Rows of the stack a graph is captured for: ``n`` windows rounded up to a multiple of 8
    up to 128, above to a sixteenth of n's power of two (at most 1/16 of the rows wasted above
    128; sixteen graphs an octave). Session 21, H100: with eighths, eager calls the device
    bounds (fp16 at 50 % active, fp32 at 25-50 %) were 4-10 % slower graphed than not."""
    if n <= 128:
        return -(-n // 8) * 8
    step = 1 << (n.bit_length() - 5)
    return -(-n // step) * step


def _rows_like(t, rows):
    """Zeros of ``rows`` rows, each shaped and laid out as t's rows are (channels_last kept)."""
    channels_last = t.dim() == 4 and not t.is_contiguous() and t.is_contiguous(memory_format=torch.channels_last)
    return torch.empty((rows, *t.shape[1:]), dtype=t.dtype, device=t.device,
                       memory_format=torch.channels_last if channels_last else torch.contiguous_format).zero_()


def _captured(fn, pool):
    """A CUDA graph of ``fn()`` in the memory pool `pool`, and what fn returned in the capture,
    after one run on a side stream (cuBLAS and cuDNN choose and allocate outside the capture)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        outputs = fn()
    return graph, outputs


def _signature(windows, image, inplace):
    """Everything the public gather and scatter check, or their kept plans depend on, that a
    slot does not fix (the image contiguous: the block's forward made it so)."""
    indices, count = windows.indices, windows.count
    return (image.shape, image.data_ptr() % 16, indices.shape, indices.dtype, indices.get_device(),
            indices.is_contiguous(), indices.data_ptr() % 16,
            count is None or (count.shape, count.dtype, count.get_device()), inplace, windows.transpose,
            windows.data_format, windows.gather_at, windows.scatter_at)


class _Slot:
    """Buffers for `rows` windows and the CUDA graphs of a residual captured on their first rows.

    The stack (the gather writes it), the residual's output (the scatter reads
    it), both ReLUs' outputs (the backward reads them) and, once a training
    call has come, the output's and the stack's gradients. Every tensor that
    outlives a graph's replay lives in these buffers (`into`), so the graphs
    of all capacities share them, and what the graphs allocate is spent
    within one replay: all of them share one memory pool (they replay one at
    a time, in one stream's order). A graph of a capacity runs all its rows:
    those past a call's count hold an earlier call's windows (see `_Lease`).
    """

    def __init__(self, residual, weights, image, stack_shape, rows, flip=(False, False)):
        # flip: (whether the backward's gradients are in the image's layout, whether the forward's
        # output is NHWC though the stack is NCHW)
        self.residual, self.weights, self.rows = residual, weights, rows
        self.flip, self.flip_out = flip
        self.stream = torch_stream_handle()  # (its key's: a slot serves one stream)
        self.stack = image.new_zeros((rows, *stack_shape))
        # (each row's shape and layout)
        out, (_, h1, h2) = residual.forward(self.stack[:2], weights, flipped=self.flip_out)
        self.h1, self.h2, self.out = _rows_like(h1, rows), _rows_like(h2, rows), _rows_like(out.contiguous(), rows)
        self.grad_out = self.grad_stack = None
        self.pool = torch.cuda.graph_pool_handle()
        self.forwards, self.backwards, self.launches = {}, {}, {}
        self.busy, self.generation = False, 0

    def round_trip(self, windows, image, inplace, capacity, zero_rest, needs=None):
        """Windows of `image` gathered into the slot, a graph of `capacity` rows replayed, its
        result added back into a copy of `image` (or into it, `inplace`); `zero_rest`: the
        gathered rows from the windows' to the capacity zeroed first.

        Without `needs`, the residual's forward: gathered at the input windows into the stack,
        its output added at the output windows; returns (y, None). With `needs` (the flags of
        `_WrittenOut.backward`), its backward: the output gradient `image` gathered at the output
        windows, the stack's gradient added atomically at the input windows where ``needs[0]``
        asks for it; returns (that or None, the graph's gradients). A signature seen before
        (`_signature`) launches the kept gather (or fused gather and product) and scatter (or
        fused product and scatter) directly (`kernels.kept_launches`, `gather_matmul.kept_launch`,
        `kept_scatter_launch`): an eager call of a sparse block is bound by the host's time, and
        the device waits for the first launch."""
        backward = needs is not None
        n, indices, count = len(windows.indices), windows.indices, windows.count
        # (None: the windows' own. A flipped backward takes and gives its gradients in the image's
        # layout, without the transpose; an output flipped NHWC goes back through the transpose where
        # the image is NCHW, without it where it is NHWC: `_Windows.out_transpose`.)
        transpose = False if backward and self.flip else None
        scatter_transpose = (False if self.flip else None) if backward else windows.out_transpose(self.flip_out)
        source, result = (self.grad_out, self.grad_stack) if backward else (self.stack, self.out)
        gather_at, scatter_at = (windows.scatter_at, windows.gather_at) if backward else (
            windows.gather_at, windows.scatter_at)
        # Without gradients the gather may go straight into the first product (`_fuses_gather`):
        # no stack, and a graph from the first ReLU's output on; in place, the last product
        # straight into the image (`_fuses_scatter`): a graph up to the second ReLU's output. A
        # signature seen before knows (training calls, `zero_rest`, keep the stack: their backward
        # reads it).
        key = (_signature(windows, image, inplace), backward, zero_rest, FUSED_GATHER, FUSED_SCATTER,
               FUSED_SCATTER_NCHW)
        kept = self.launches.get(key)
        if kept is not None:
            fused, fused_last = kept[4:]
        else:
            plain = not (backward or zero_rest) and self.residual.nhwc_output(windows)
            fused = plain and _fuses_gather(windows, image, self.weights[0])
            fused_last = plain and inplace and _fuses_scatter(windows, image, self.h2, self.weights[2])
        if fused_last:
            result = self.h2
        stream = self.stream if kept else None
        if fused and kept:
            kept[0](stream, self.h1.data_ptr(), image.data_ptr(), self.weights[0].data_ptr(), indices.data_ptr(),
                    kept[2] or count.data_ptr())
        elif fused:
            windows.gather_matmul(image.detach(), self.weights[0], out=self.h1[:n])
        elif kept:
            kept[0](stream, image.data_ptr(), source.data_ptr(), indices.data_ptr(), kept[2] or count.data_ptr())
        else:
            windows.gather(image.detach(), at=gather_at, out=source[:n], transpose=transpose)
        if zero_rest and n < capacity:
            source[n:capacity].zero_()
        if backward:
            graph, outputs = self.backward(capacity, needs)
        else:
            graph, outputs = self.forward(capacity, fused, fused_last), None
        graph.replay()
        if backward and not needs[0]:
            return None, outputs
        if kept:
            return kept[1](stream, image, result.data_ptr(), indices.data_ptr(), kept[3] or count.data_ptr()), outputs
        if fused_last:
            y = windows.matmul_scatter(self.h2[:n], self.weights[2], image)
        else:
            y = windows.scatter(result[:n], image, inplace, atomic=backward, at=scatter_at,
                                transpose=scatter_transpose)
        kept = kernels.kept_launches(image, indices, result[:n], count, *gather_at,
                                     windows.transpose if transpose is None else transpose,
                                     windows.data_format, inplace, scatter_at, atomic=backward, gather=not fused,
                                     scatter=not fused_last,
                                     scatter_transpose=windows.transpose if scatter_transpose is None
                                     else scatter_transpose)
        if kept is not None and fused:  # the fused gather's kept launch in the gather's place
            first = fused_kernels.kept_launch(image, indices, self.weights[0], count, *gather_at, relu=True,
                                              data_format=windows.data_format)
            kept = None if first is None else (first[0], kept[1], first[1], kept[3])
        if kept is not None and fused_last:  # and the fused product and scatter's in the scatter's
            last = fused_kernels.kept_scatter_launch(self.h2[:n], indices, self.weights[2], image, count, *scatter_at,
                                                     data_format=windows.data_format)
            kept = None if last is None else (kept[0], _adding_into(last[0], self.weights[2]), kept[2], last[1])
        if kept is not None:
            self.launches[key] = (*kept, fused, fused_last)
        return y, outputs

    def forward(self, capacity, fused=False, fused_last=False):
        """The residual's graph on the first `capacity` rows (`fused`: from the first ReLU's
        output, which the fused gather and product wrote, on; `fused_last`: up to the second
        ReLU's output, which the fused product and scatter read)."""
        graph = self.forwards.get((capacity, fused, fused_last))
        if graph is None:
            c = capacity
            w1, w2, w3 = self.weights
            if fused_last:
                def run():
                    h1 = self.h1[:c] if fused else self.residual.first(self.stack[:c], w1, self.h1[:c])
                    _second_relu(h1, w2, self.h2[:c])
            elif fused:
                def run():
                    _after_first_product(self.h1[:c], w2, w3, into=(None, self.h2[:c], self.out[:c]))
            else:
                def run():
                    self.residual.forward(self.stack[:c], self.weights, into=(self.h1[:c], self.h2[:c], self.out[:c]),
                                          flipped=self.flip_out)
            graph = self.forwards[(c, fused, fused_last)] = _captured(run, self.pool)[0]
        return graph

    def backward(self, capacity, needs):
        """The residual's backward's graph on the first `capacity` rows, for the gradients `needs`
        asks for, and its outputs (the stack's gradient a view of `grad_stack`)."""
        found = self.backwards.get((capacity, needs))
        if found is None:
            if self.grad_out is None:  # (flipped: NHWC, from the NCHW stack's shape; the output's by its own)
                out, stack = self.out, self.stack
                self.grad_out = torch.zeros_like(out) if self.flip == self.flip_out else out.new_zeros(
                    out.permute(*((0, 2, 3, 1) if self.flip else (0, 3, 1, 2))).shape)
                self.grad_stack = stack.new_zeros(stack.permute(0, 2, 3, 1).shape) if self.flip else \
                    torch.zeros_like(stack)
            c = capacity
            saved = (self.stack[:c], self.h1[:c], self.h2[:c])
            found = self.backwards[(c, needs)] = _captured(lambda: self.residual.backward(
                saved, self.weights, self.grad_out[:c], needs, into=self.grad_stack[:c], flipped=self.flip), self.pool)
        return found


def _adding_into(launch, weight):
    """A kept `sparse_matmul_scatter` launch (`gather_matmul.kept_scatter_launch`) called as
    `kernels.kept_launches`' scatters are: ``(stream handle, image, blocks, indices, count)`` ->
    the image, added into in place (the weight: the slot's own, whose address is in its key)."""
    pointer = weight.data_ptr()

    def scatter(stream, image, blocks, indices, count):
        launch(stream, image.data_ptr(), blocks, pointer, indices, count)
        return image

    return scatter


class _Lease:
    """A slot held for one training call, from its forward to the end of its backward (or until
    its autograd node is gone, with no backward run).

    Rows past the call's count enter the weights' gradients (sums over every
    row the graphs run), so they are zeroed in the stack and in the output's
    gradient: zeros add nothing, where an earlier call's windows would, and an
    earlier call's overflow (inf) would make NaN of them.
    """

    def __init__(self, slot, capacity, n, needs):
        self.slot, self.capacity, self.n, self.needs = slot, capacity, n, needs
        self.generation = slot.generation
        slot.forward(capacity)
        slot.backward(capacity, needs)  # (captured now: not on autograd's thread, mid-backward)

    def forward(self, windows, image, inplace):
        """`image` plus the residual of its windows (`_Slot.round_trip`)."""
        return self.slot.round_trip(windows, image, inplace, self.capacity, zero_rest=True)[0]

    def backward(self, windows, grad_y):
        """Gradients of (image, w1, w2, w3) for those `needs` asks for (None for the others):
        the image's is grad_y plus the stack's gradient added atomically at the input windows
        (into a copy of grad_y)."""
        slot = self.slot
        if slot.generation != self.generation:
            raise RuntimeError("SparseResBlock(graphs=True): a later call has overwritten what this backward "
                               "reads (a second backward through one forward needs graphs=False)")
        grad_image, grads = slot.round_trip(windows, grad_y, False, self.capacity, zero_rest=True, needs=self.needs)
        # The weights' gradients are copied: autograd may keep what it is given (as .grad), and
        # the next replay overwrites the graph's own.
        grads = (grad_image, *(None if g is None else g.clone() for g in grads[1:]))
        self.release()  # (all that reads the slot's buffers is queued: stream order does the rest)
        return grads

    def release(self):
        if self.slot.generation == self.generation:
            self.slot.busy = False

    __del__ = release


class _ResidualGraphs:
    """CUDA graphs of a block's residual (a `_WrittenOut`) and of its backward.

    A graph is captured per capacity (`_capacity` of the window count) on the
    first rows of a slot's buffers (`_Slot`) and replayed for every count up
    to it: the gather writes the count's windows into the slot's stack
    (``sparse_gather(out=)``), the graph runs the residual on all the
    capacity's rows, the scatter reads the count's rows of its output. A
    training call holds its slot until its backward has run (`_Lease`); a
    call without gradients until its scatter is queued. Slots per dtype,
    device, stack shape, stream and weights (their addresses: the graphs read
    the weights' memory, so in-place updates are seen; new weight tensors get
    new slots and free the old), at most MAX_SLOTS held at once (beyond, calls
    run without graphs); a slot too small for a count is replaced by one of
    twice its rows (or the count's capacity), its graphs captured anew.
    """

    MAX_SLOTS = 4

    def __init__(self):
        self._sets = {}

    def __deepcopy__(self, memo):  # (graphs and their buffers belong to the original module)
        return _ResidualGraphs()

    def __getstate__(self):
        return {"_sets": {}}

    def _acquire(self, residual, weights, image, stack_shape, flip, n):
        """(a free slot of the key's with room for n windows, marked held, the capacity), or
        (None, capacity) when MAX_SLOTS are held."""
        capacity = _capacity(n)
        pointers = tuple(w.data_ptr() for w in weights)
        key = (image.dtype, image.device, stack_shape, flip, torch_stream_handle(), residual, pointers)
        slots = self._sets.get(key)
        if slots is None:  # (held slots of dropped keys live on in their leases)
            self._sets = {k: v for k, v in self._sets.items() if k[-1] == pointers}
            slots = self._sets[key] = []
        slot = next((s for s in slots if not s.busy), None)
        if slot is None or slot.rows < capacity:
            if slot is None and len(slots) >= self.MAX_SLOTS:
                return None, capacity
            rows = capacity if slot is None else max(capacity, 2 * slot.rows)
            if slot is not None:
                slots.remove(slot)
            slot = _Slot(residual, weights, image, stack_shape, rows, flip)
            slots.append(slot)
        slot.busy = True
        slot.generation += 1
        return slot, capacity

    def run(self, residual, weights, windows, image, inplace, stack_shape, flip):
        """A call without gradients through the graphs, or None (then it runs without).

        Rows past the windows' hold an earlier call's: computed, never scattered.
        """
        slot, capacity = self._acquire(residual, weights, image, stack_shape, flip, len(windows.indices))
        if slot is None:
            return None
        try:
            return slot.round_trip(windows, image, inplace, capacity, zero_rest=False)[0]
        finally:
            slot.busy = False

    def lease(self, residual, weights, image, stack_shape, flip, n, needs):
        """A `_Lease` for a training call, or None (then it runs without graphs)."""
        slot, capacity = self._acquire(residual, weights, image, stack_shape, flip, n)
        return None if slot is None else _Lease(slot, capacity, n, needs)


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
