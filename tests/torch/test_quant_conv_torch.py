"""`QuantConv2d`: its float path against the twin's quantizers and torch's convolution, the
straight-through gradients, the packed convolution on a GPU (its training: `test_quant_linear`)."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from sparseblocks.reference import quant as reference  # noqa: E402
from sparseblocks.runtime.backend import SIMULATOR  # noqa: E402
from sparseblocks.torch import QuantConv2d  # noqa: E402

DEVICE = "cpu" if SIMULATOR else "cuda"


def quantized_values(layer, x):
    """The twin's quantized activations and filters of a layer (thresholds in fp32, as the kernels')."""
    a_basis = layer.a_basis.numpy()
    _, a = reference.encode(x.numpy(), a_basis, False, threshold_dtype=np.float32)
    w = layer.weight.detach().reshape(layer.out_channels, -1).numpy()
    _, w_hat = reference.encode(w, layer.w_basis.numpy(), True, threshold_dtype=np.float32)
    return torch.tensor(a, dtype=torch.float32), torch.tensor(w_hat.reshape(layer.weight.shape), dtype=torch.float32)


@pytest.mark.parametrize("stride, padding, dilation", [(1, 1, 1), (2, (0, 1), (2, 1))])
def test_float_path_is_torchs_convolution_of_the_twins_values(stride, padding, dilation):
    torch.manual_seed(0)
    layer = QuantConv2d(6, 5, (3, 2), stride, padding, dilation, w_bits=2, a_bits=3).eval()
    x = torch.rand(2, 6, 7, 8) * 2
    a, w = quantized_values(layer, x)
    want = torch.nn.functional.conv2d(a, w, layer.bias.detach(), layer.stride, layer.padding, layer.dilation)
    torch.testing.assert_close(layer(x.requires_grad_(True)).detach(), want, rtol=1e-5, atol=1e-5)
    with torch.no_grad():  # (on the CPU without gradients: the same torch operations)
        torch.testing.assert_close(layer(x.detach()), want, rtol=1e-5, atol=1e-5)


def test_gradients_pass_straight_through():
    """The filters' gradient is the float convolution's with the quantized values; the input's is
    zero above the top level."""
    torch.manual_seed(1)
    layer = QuantConv2d(3, 4, 3, padding=1, w_bits=2, a_bits=2).eval()
    x = (torch.rand(1, 3, 5, 5) * 3).requires_grad_(True)
    layer(x).sum().backward()
    a, w = quantized_values(layer, x.detach())
    a.requires_grad_(True)
    w.requires_grad_(True)
    torch.nn.functional.conv2d(a, w, None, 1, 1).sum().backward()
    torch.testing.assert_close(layer.weight.grad, w.grad, rtol=1e-5, atol=1e-5)
    top = float(reference.levels(layer.a_basis.numpy(), False)[0][-1])
    torch.testing.assert_close(x.grad, torch.where(x.detach() <= top, a.grad, 0.0), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("make, error, match", [
    (lambda: QuantConv2d(4, 4, 3, w_bits=0), ValueError, "w_bits: expected an int from 1 to 4"),
    (lambda: QuantConv2d(4, 4, 0), ValueError, "kernel_size: expected an int or two ints of at least 1"),
    (lambda: QuantConv2d(4, 4, 3, padding=-1), ValueError, "padding: expected"),
    (lambda: QuantConv2d(4, 4, 3)(torch.ones(1, 3, 5, 5)), ValueError, "x: expected \\(N, 4, H, W\\)"),
])
def test_bad_arguments(make, error, match):
    with pytest.raises(error, match=match):
        make()


@pytest.mark.gpu
@pytest.mark.skipif(SIMULATOR, reason="the packed path runs on a GPU")
@pytest.mark.parametrize("dtype, channels_last, stride", [(torch.float32, False, 1), (torch.float16, True, 1),
                                                          (torch.float32, True, 2)])
def test_packed_convolution_equals_the_float_quantizers(dtype, channels_last, stride):
    """Without gradients on a GPU the bit planes and the b1 convolution give what the float
    quantizers give with gradients, from NCHW or channels-last input."""
    torch.manual_seed(2)
    layer = QuantConv2d(96, 80, 3, stride, padding=1, w_bits=2, a_bits=2).to(DEVICE, dtype).eval()
    x = torch.randn(3, 96, 14, 13, device=DEVICE, dtype=dtype).relu()
    if channels_last:
        x = x.to(memory_format=torch.channels_last)
    with torch.no_grad():
        packed = layer(x)
    with torch.backends.cudnn.flags(enabled=True, allow_tf32=False):  # (the float path in full fp32, not TF32)
        floats = layer(x.clone().requires_grad_(True)).detach()
    assert packed.dtype == dtype and packed.shape == floats.shape
    assert packed.is_contiguous(memory_format=torch.channels_last)
    error = ((packed.float() - floats.float()).abs().max() / floats.float().abs().max()).item()
    assert error < (1e-2 if dtype == torch.float16 else 1e-5), error


@pytest.mark.skipif(not SIMULATOR, reason="the simulator runs the packed path on CPU tensors (GPU: the test above)")
@pytest.mark.parametrize("channels_last, stride", [(False, 1), (True, 2)])
def test_packed_path_glue_in_the_simulator(configure, channels_last, stride):
    """The packed convolution's torch side (the weight and images packed along their channels, NCHW
    or channels-last, the result a channels-last view) on CPU tensors through the simulator's kernels,
    against the float quantizers."""
    from sparseblocks import quant

    configure(quant, warps_m=1, warps_n=1, warp_rows=32, dense_cols=16, chunk_words=8)
    torch.manual_seed(4)
    layer = QuantConv2d(40, 8, 3, stride, padding=1, w_bits=2, a_bits=2).eval()
    x = torch.rand(1, 40, 5, 4)
    if channels_last:
        x = x.to(memory_format=torch.channels_last)
    packed = layer.packed_forward(x)
    floats = layer(x.clone().requires_grad_(True)).detach()
    assert packed.shape == floats.shape and packed.is_contiguous(memory_format=torch.channels_last)
    torch.testing.assert_close(packed, floats, rtol=1e-5, atol=1e-5)
