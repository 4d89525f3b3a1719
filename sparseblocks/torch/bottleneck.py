"""The bottleneck's dense part on a block stack, and which fused kernels a call takes.

The 1x1 convolutions are matrix products over the stack's pixels (batched by
window on an NCHW stack, read transposed: nothing is copied between layouts),
the 3x3 runs through cuDNN on channels_last; each has its written-out backward.
Without gradients the gather can fuse into the first product (`_fuses_gather`)
and the last product into the in-place scatter (`_fuses_scatter`), by the
switches below; eager calls bound by the host take them at any size.
"""

import torch

from .. import fused as fused_kernels
from ..sbnet.config import DEFAULT as SBNET_DEFAULT
from ..sbnet.dispatch import pair_shapes
from ..windows import check_geometry


def _nhwc_out_of_nchw(cfg, image, window, fused_last=False):
    """Whether an NCHW stack from this NCHW image has its output NHWC (``cfg.nchw_input_nhwc_out``):
    where the adding scatter of NHWC blocks of the output ``window`` (every ``window``, from 0)
    into it goes by the fp16 pair tiles (`sbnet.dispatch.pair_shapes`), not by the generic tile;
    with ``cfg.nchw_input_nhwc_out_fused``, also where ``fused_last`` (an in-place call without
    gradients) lets the fused product and scatter add it (fp32 too)."""
    if not cfg.nchw_input_nhwc_out:
        return False
    if (cfg.nchw_input_nhwc_out_fused and fused_last and cfg.fused_scatter and cfg.fused_scatter_nchw
            and image.dtype in (torch.float16, torch.float32)
            and fused_kernels.nchw_scatter_fits(image.element_size(), image.shape[3], image.data_ptr(),
                                                *check_geometry(window, window, 0))):
        return True
    return image.dtype == torch.float16 and pair_shapes(SBNET_DEFAULT, True, True, False, image.shape, False, True,
                                                        "float16", (window, window, (0, 0)))


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
    return _matmul(x, w, into).relu_()


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


def _fuses_gather(windows, image, w1, any_size=False):
    """Whether a call without gradients takes `fused.sparse_gather_matmul` for its gather and
    first product: a layout it applies to, tensors the kernel takes, few output channels, and
    pixels enough (``any_size``: however few, `_host_bound`)."""
    cfg = windows.config
    if not cfg.fused_gather or (windows.data_format, windows.transpose) not in cfg.fused_gather_layouts:
        return False
    size = windows.gather_at[0]  # (h, w): the block's geometry
    return (w1.shape[0] <= cfg.fused_gather_max_out
            and (any_size or len(windows.indices) * size[0] * size[1] >= cfg.fused_gather_min_pixels)
            and fused_kernels.takes(image, w1, windows.data_format, size))


def _fuses_scatter(windows, image, h2, w3, any_size=False):
    """Whether an in-place call without gradients takes `fused.sparse_matmul_scatter` for its last
    product and the scatter: the output NHWC (an NHWC stack's, or a flipped NCHW stack's), an NHWC
    image (or an NCHW one, ``fused_scatter_nchw``), tensors and windows the kernel takes, a narrow
    product and pixels enough (``any_size``: however few, `_host_bound`)."""
    cfg, data_format = windows.config, windows.data_format
    if not cfg.fused_scatter or (data_format == "NCHW" and not cfg.fused_scatter_nchw):
        return False
    size = windows.scatter_at[0]
    least = 0 if any_size else cfg.fused_scatter_min_pixels.get((data_format, _DTYPE_NAMES.get(image.dtype)), 0)
    return (h2.shape[-1] <= cfg.fused_scatter_max_in and len(windows.indices) * size[0] * size[1] >= least
            and fused_kernels.scatter_takes(h2, w3, image, data_format, *windows.scatter_at))


_DTYPE_NAMES = {torch.float16: "float16", torch.float32: "float32", torch.float64: "float64",
                torch.bfloat16: "bfloat16"}


def _host_bound(cfg, image):
    """Whether a call without gradients on `image` is bound by the host's time (a CUDA tensor's,
    launched as it comes: no graph capture), where the fused kernels pay at any size."""
    return cfg.fused_when_host_bound and image.is_cuda and not torch.cuda.is_current_stream_capturing()


def _without_grad(residual, weights, windows, image, inplace):
    """`image` (or a copy of it) plus the residual of its windows, no autograd: on the NHWC stack
    the first product takes the gather (`_fuses_gather`), and where the output is NHWC (an NHWC
    stack's or a flipped one's) and so is the image the last the scatter (`_fuses_scatter`), where
    that pays."""
    if not (isinstance(residual, _WrittenOut) and residual.nhwc_output(windows)):
        out = residual.forward(windows.gather(image), weights, keep=False)[0]
        return windows.scatter(out.contiguous(), image, inplace, atomic=False)
    w1, w2, w3 = weights
    any_size = _host_bound(windows.config, image)
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
