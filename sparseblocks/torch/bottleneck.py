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
