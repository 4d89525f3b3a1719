"""`LQLinear`: its quantizers against the LQ-Nets twin, the straight-through gradients, training
(`QuantConv2d`'s too), the packed product on a GPU, layouts."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from sparseblocks.layout import BlockLayout  # noqa: E402
from sparseblocks.reference import quant as reference  # noqa: E402
from sparseblocks.runtime.backend import SIMULATOR  # noqa: E402
from sparseblocks.torch import LQLinear, QuantConv2d  # noqa: E402
from sparseblocks.torch import quant as lq  # noqa: E402

DEVICE = "cpu" if SIMULATOR else "cuda"


@pytest.mark.parametrize("signed, rows", [(True, 4), (False, 1)])
def test_encode_and_basis_update_are_the_twins(signed, rows):
    rng = np.random.default_rng(0)
    basis = (rng.uniform(0.1, 1, (rows, 3)) * 2.0 ** np.arange(3)).astype(np.float32)
    x = (rng.standard_normal((4, 50)) * 3).astype(np.float32)
    codes, values = lq.encode(torch.tensor(x), torch.tensor(basis), signed)
    want_codes, want_values = reference.encode(x, basis if rows > 1 else basis[0], signed, threshold_dtype=np.float32)
    np.testing.assert_array_equal(codes.numpy(), want_codes)
    np.testing.assert_allclose(values.numpy(), want_values, rtol=1e-6)
    ridge = lq.RIDGE if signed else 0.0
    new = lq.basis_update(torch.tensor(x), codes, torch.tensor(basis), signed, ridge)
    want = reference.basis_update(x if rows > 1 else x.reshape(-1), want_codes if rows > 1 else want_codes.reshape(-1),
                                  basis if rows > 1 else basis[0], signed, ridge=ridge)
    np.testing.assert_allclose(new.numpy().reshape(want.shape), want, rtol=1e-4, atol=1e-5)


def test_straight_through_gradients_are_the_twins():
    """Weights: the gradient itself; activations: zero above the largest level. The backward is a
    linear map of the gradient (gradcheck), whose Jacobian is the twin's mask."""
    basis = torch.tensor([[0.3, 0.6]], dtype=torch.float64)
    x = torch.tensor([-0.5, 0.1, 0.85, 1.1, 3.0], dtype=torch.float64, requires_grad=True)
    for signed, clip in ((True, False), (False, True)):
        def vjp(grad):
            return torch.autograd.grad(lq.straight_through(x, basis, signed, clip), x, grad, create_graph=True)[0]

        torch.autograd.gradcheck(vjp, (torch.randn(5, dtype=torch.float64, requires_grad=True),))
        got = vjp(torch.ones(5, dtype=torch.float64))
        want = reference.ste_grad(x.detach().numpy(), np.ones(5), basis[0].numpy(), signed)
        np.testing.assert_array_equal(got.detach().numpy(), want)


def _linear_case():
    model = torch.nn.Sequential(LQLinear(32, 64, w_bits=2, a_bits=2), torch.nn.ReLU(), LQLinear(64, 4))
    x = torch.randn(256, 32)
    return model, model[0], x, x[:, :4].clone()


def _conv_case():
    model = torch.nn.Sequential(torch.nn.Conv2d(1, 8, 3, padding=1), torch.nn.ReLU(),
                                QuantConv2d(8, 8, 3, padding=1, w_bits=2, a_bits=2), torch.nn.ReLU(),
                                torch.nn.Flatten(), torch.nn.Linear(8 * 6 * 6, 3))
    x = torch.randn(64, 1, 6, 6)
    target = torch.stack([x.mean((1, 2, 3)), x[:, 0, :3].mean((1, 2)), x[:, 0, 3:].mean((1, 2))], 1)
    return model, model[2], x, target


@pytest.mark.parametrize("case", [_linear_case, _conv_case], ids=["LQLinear", "QuantConv2d"])
def test_training_decreases_the_loss_and_fits_the_bases(case):
    torch.manual_seed(0)
    model, layer, x, target = case()
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    basis = layer.w_basis.clone()
    losses = []
    for _ in range(60):
        optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), target)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < 0.6 * losses[0]
    assert not torch.equal(basis, layer.w_basis)  # the QEM steps moved it
    model.eval()
    before = layer.a_basis.clone()
    model(x)
    assert torch.equal(before, layer.a_basis)  # evaluation leaves the bases


def test_a_layout_keeps_only_its_blocks():
    """With a layout the output is x̂ · (ŵ masked by the layout)ᵀ + b: the absent blocks' quantized
    weights (never zero for ±1 codes) are left out, not quantized zeros."""
    torch.manual_seed(1)
    layout = BlockLayout(np.array([[1, 0], [0, 1], [1, 1]], np.uint8), 32)
    layer = LQLinear(96, 64, layout=layout).eval()
    x = torch.rand(5, 96)
    w_hat = lq.encode(layer.weight.detach(), layer.w_basis, True)[1]
    a_hat = lq.encode(x, layer.a_basis[None], False)[1]
    mask = torch.as_tensor(layout.element_mask().T.copy(), dtype=torch.float32)
    torch.testing.assert_close(layer(x.requires_grad_(True)), a_hat @ (w_hat * mask).T + layer.bias)


@pytest.mark.parametrize("make, error, match", [
    (lambda: LQLinear(8, 8, w_bits=5), ValueError, "w_bits: expected an int from 1 to 4"),
    (lambda: LQLinear(64, 64, layout=np.ones((2, 2))), TypeError, "layout: expected a BlockLayout"),
    (lambda: LQLinear(64, 64, layout=BlockLayout(np.ones((8, 8)), 8)), ValueError, "layout: expected a \\(64, 64\\)"),
])
def test_bad_arguments(make, error, match):
    with pytest.raises(error, match=match):
        make()


@pytest.mark.gpu
@pytest.mark.skipif(SIMULATOR, reason="the packed path runs on a GPU")
@pytest.mark.parametrize("dtype, signed, sparse", [(torch.float32, False, False), (torch.float16, False, True),
                                                    (torch.float32, True, False)])
def test_packed_product_equals_the_float_quantizers(dtype, signed, sparse):
    """Without gradients on a GPU the bit planes and the b1 product give what the float
    quantizers give with gradients."""
    torch.manual_seed(2)
    layout = BlockLayout.random((8, 4), 0.5, block_size=32) if sparse else None
    layer = LQLinear(256, 128, w_bits=2, a_bits=3, signed_activations=signed, layout=layout).to(DEVICE, dtype).eval()
    x = torch.randn(70, 256, device=DEVICE, dtype=dtype).relu()
    with torch.no_grad():
        packed = layer(x)
    floats = layer(x.clone().requires_grad_(True))
    assert packed.dtype == dtype
    error = ((packed.float() - floats.detach().float()).abs().max() / floats.detach().float().abs().max()).item()
    assert error < (1e-2 if dtype == torch.float16 else 1e-5), error  # (fp16: the float path's own rounding)


@pytest.mark.skipif(not SIMULATOR, reason="the simulator runs the packed path on CPU tensors (GPU: the test above)")
def test_kept_planes_follow_the_weight_as_torch_sees_it(configure, monkeypatch):
    """``keep_packed``: the weight is packed once while it stays as it is, again after an in-place
    change torch counts, not after one through ``.data`` until `repack`."""
    from sparseblocks import quant

    configure(quant, warps_m=1, warps_n=1, warp_rows=32, dense_cols=16, chunk_words=8, pack_warps=1)
    packed = []
    pack = quant.api.pack
    monkeypatch.setattr(quant.api, "pack", lambda x_op, *args: packed.append(x_op.name) or pack(x_op, *args))
    torch.manual_seed(3)
    layer = LQLinear(64, 16, w_bits=1, a_bits=1, keep_packed=True).eval()
    x = torch.rand(3, 64)

    def floats():
        return layer(x.clone().requires_grad_(True)).detach()

    first = layer.packed_forward(x)
    torch.testing.assert_close(layer.packed_forward(x), first)
    assert packed.count("weight") == 1 and packed.count("x") == 2
    with torch.no_grad():
        layer.weight.neg_()
    torch.testing.assert_close(layer.packed_forward(x), floats(), rtol=1e-5, atol=1e-5)
    assert packed.count("weight") == 2
    layer.weight.data.neg_()  # (not seen: the kept planes stay)
    stale = layer.packed_forward(x)
    assert packed.count("weight") == 2
    layer.repack()
    torch.testing.assert_close(layer.packed_forward(x), floats(), rtol=1e-5, atol=1e-5)
    assert packed.count("weight") == 3 and not torch.allclose(stale, floats())
    # The activations' tables and the fp32 bias are kept the same way.
    tables, bias = layer._activation_tables(), layer._fp32_bias()
    assert layer._activation_tables() is tables and layer._fp32_bias() is bias
    with torch.no_grad():
        layer.a_basis.mul_(1.5)
        layer.bias.add_(1.0)
    assert layer._activation_tables() is not tables and layer._fp32_bias() is not bias
    torch.testing.assert_close(layer.packed_forward(x), floats(), rtol=1e-5, atol=1e-5)
    layer.keep_packed = False
    assert layer._activation_tables() is not layer._activation_tables()
