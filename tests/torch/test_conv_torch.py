"""`BlockSparseConv1d/2d/3d` (sparseblocks/torch/conv.py): the layer against a dense convolution
with its dense filter, gradients by gradcheck in float64 through the custom ops (the kernels in the
simulator, and torch's ops on CPU tensors), opcheck, and torch.compile with no graph break."""

import numpy as np
import pytest
import torch

from sparseblocks.reference import conv as reference
from sparseblocks.torch import BlockSparseConv1d, BlockSparseConv2d, BlockSparseConv3d
from sparseblocks.torch import conv as conv_ops

BCK = [([0, 1], [0]), ([1, 2], [1, 2]), ([2], [0])]


def device():
    return "cuda" if torch.cuda.is_available() else "cpu"


def test_layer_matches_the_dense_convolution(path):
    torch.manual_seed(0)
    layer = BlockSparseConv2d(BCK, 3, (5, 6), stride=(1, 2), padding="SAME", device=device())
    x = torch.randn(2, 3, 5, 6, device=device())
    W = torch.tensor(reference.dense_filter([f.detach().cpu().numpy() for f in layer.filters()], layer.op.BCK,
                                            layer.op._g, 3, 3)[:, :, 0], dtype=torch.float32, device=device())
    want = torch.nn.functional.conv2d(x, W, stride=(1, 2), padding=1)
    torch.testing.assert_close(layer(x), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("cls, size", [(BlockSparseConv1d, (5,)), (BlockSparseConv2d, (3, 4)),
                                       (BlockSparseConv3d, (2, 2, 3))])
def test_gradcheck_in_float64(path, cls, size):
    """Input, filter and edge-bias gradients of a strided layer (through the simulator's kernels in
    1-D only: gradcheck's many calls; tests/conv checks their 2-D and 3-D products)."""
    torch.manual_seed(1)
    dims = len(size)
    if path and dims > 1 and not torch.cuda.is_available():
        pytest.skip("the simulator's kernels: 1-D here, every dim in tests/conv")
    layer = cls(BCK, 2, size, stride=[1] * (dims - 1) + [2], dilation=1, padding=[1] * dims, edge_bias=True,
                device=device(), dtype=torch.float64)
    with torch.no_grad():
        layer.edge.normal_()
    x = torch.randn(1, 3, *size, device=device(), dtype=torch.float64, requires_grad=True)
    f = layer.weight.detach().clone().requires_grad_(True)
    e = layer.edge.detach().clone().requires_grad_(True)
    assert torch.autograd.gradcheck(lambda f, x, e: conv_ops.conv_forward(f, x, e, layer.key), (f, x, e),
                                    eps=1e-6, atol=1e-6)


def test_channels_last_tensors_keep_their_layout(path):
    """A channels_last input gives a channels_last output and input gradient, the values of the
    contiguous call's; its fake tensors carry the same strides (opcheck)."""
    torch.manual_seed(4)
    layer = BlockSparseConv2d(BCK, 3, (4, 5), edge_bias=True, device=device())
    x = torch.randn(2, 3, 4, 5, device=device())
    xl = x.contiguous(memory_format=torch.channels_last).requires_grad_(True)
    xc = x.clone().requires_grad_(True)
    out, want = layer(xl), layer(xc)
    assert out.is_contiguous(memory_format=torch.channels_last) and not out.is_contiguous()
    torch.testing.assert_close(out, want)
    dy = torch.randn_like(want)
    gl = torch.autograd.grad(out, (xl, layer.weight), dy)
    gc = torch.autograd.grad(want, (xc, layer.weight), dy)
    assert gl[0].is_contiguous(memory_format=torch.channels_last)
    for got, expected in zip(gl, gc):
        torch.testing.assert_close(got, expected)
    torch.library.opcheck(conv_ops.conv_forward, (layer.weight.detach(), xl.detach(), layer.edge.detach(),
                                                  layer.key), test_utils=("test_schema", "test_faketensor"))


def test_opcheck_and_compile(path):
    torch.manual_seed(2)
    layer = BlockSparseConv2d(BCK, 3, (4, 5), edge_bias=True, device=device())
    x = torch.randn(2, 3, 4, 5, device=device())
    checks = {"test_utils": ("test_schema", "test_faketensor")}
    torch.library.opcheck(conv_ops.conv_forward, (layer.weight.detach(), x, layer.edge.detach(), layer.key), **checks)
    explained = torch._dynamo.explain(layer)(x)
    assert explained.graph_break_count == 0
    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
    xs = x.clone().requires_grad_(True)
    out = compiled(xs)
    out.square().sum().backward()
    want_x = x.clone().requires_grad_(True)
    layer.zero_grad()
    grad_w = torch.autograd.grad(layer(want_x).square().sum(), [want_x, layer.weight])
    torch.testing.assert_close(xs.grad, grad_w[0], rtol=1e-4, atol=1e-5)


def test_bad_inputs_raise():
    layer = BlockSparseConv2d(BCK, 3, (4, 5))
    with pytest.raises(ValueError, match="expected \\(N, C, H, W\\)"):
        layer(torch.randn(3, 4, 5))
    with pytest.raises(TypeError, match="dtype"):
        layer(torch.randn(1, 3, 4, 5, dtype=torch.float64))
    with pytest.raises(ValueError, match="kernel_size, input_size"):
        BlockSparseConv2d(BCK, (3, 3, 3), (4, 5))
    assert [list(f.shape) for f in layer.filters()] == [[1, 2, 3, 3], [2, 2, 3, 3], [1, 1, 3, 3]]
    assert np.isclose(float(layer.filters()[0].abs().max()), float(layer.filters()[0].abs().max()))


def test_transposed_layer_is_the_convolutions_transpose(path):
    """A strided 2-D transposed layer against torch's conv_transpose2d with its dense filter, and
    its gradients by gradcheck in float64 (1-D; not through the simulator's kernels, whose
    deconvolution products tests/conv checks against the convolution's)."""
    from sparseblocks.torch import BlockSparseConvTranspose1d, BlockSparseConvTranspose2d

    torch.manual_seed(3)
    layer = BlockSparseConvTranspose2d(BCK, 3, (3, 4), stride=2, padding=1, device=device())
    assert list(layer.filters()[1].shape) == [2, 2, 3, 3]
    x = torch.randn(2, 3, 3, 4, device=device())
    # the transposed layer's dense filter, (in channels, out channels, 3, 3) as conv_transpose2d takes it
    W = torch.zeros(3, 3, 3, 3, device=device())
    for (cs, ks), f in zip(BCK, layer.filters()):
        W[np.ix_(cs, ks)] += f.detach()
    want = torch.nn.functional.conv_transpose2d(x, W, stride=2, padding=1)
    torch.testing.assert_close(layer(x), want, rtol=1e-5, atol=1e-5)
    if path and not torch.cuda.is_available():
        return
    small = BlockSparseConvTranspose1d(BCK, 2, (3,), stride=2, padding=0, device=device(), dtype=torch.float64)
    x = torch.randn(1, 3, 3, device=device(), dtype=torch.float64, requires_grad=True)
    f = small.weight.detach().clone().requires_grad_(True)
    assert torch.autograd.gradcheck(lambda f, x: conv_ops.conv_forward(f, x, None, small.key), (f, x), eps=1e-6,
                                    atol=1e-6)
