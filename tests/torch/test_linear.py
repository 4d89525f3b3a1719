"""BlockSparseLinear, sparsify and BlockRegrowth against dense masked nn.Linear models (needs torch)."""

import copy

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

torch = pytest.importorskip("torch")

from sparseblocks.runtime.backend import SIMULATOR  # noqa: E402
from sparseblocks.torch import BlockRegrowth, BlockSparseLinear, sparsify  # noqa: E402

DEVICE = "cpu" if SIMULATOR else "cuda"


@pytest.fixture(autouse=True, scope="module", params=["torch", "kernels"] if SIMULATOR else ["kernels"])
def cpu_path(request):
    """Without a GPU every test runs twice, so that neither path can drift: on the CPU path
    (torch's operations, `sparseblocks.torch.cpu`) and on the kernels in the simulator."""
    from sparseblocks.torch import cpu

    previous = cpu.kernels_on_cpu(request.param == "kernels")
    yield request.param
    cpu.kernels_on_cpu(previous)


def masked_dense(layer):
    """The nn.Linear that `layer` stands for: its dense weight, zeros outside the layout."""
    dense = torch.nn.Linear(layer.in_features, layer.out_features, bias=layer.bias is not None,
                            device=layer.weight.device, dtype=layer.weight.dtype)
    with torch.no_grad():
        dense.weight.copy_(layer.to_dense())
        if layer.bias is not None:
            dense.bias.copy_(layer.bias)
    return dense


def blocks_of(layer, dense_weight):
    """The layout's blocks of a dense (out, in) matrix, as the layer stores them."""
    bs = layer.block_size
    grid = dense_weight.t().reshape(layer.in_features // bs, bs, layer.out_features // bs, bs).permute(0, 2, 1, 3)
    return grid[layer.block_coords[:, 0], layer.block_coords[:, 1]]


@given(shape=st.sampled_from([(16, 24), (24, 8), (8, 32)]), lead=st.sampled_from([(5,), (2, 3), (1,), (0,)]),
       density=st.sampled_from([0.3, 0.5, 1.0]), bias=st.booleans(), relu=st.booleans(), seed=st.integers(0, 100))
def test_gradients_match_a_dense_masked_linear_in_float64(shape, lead, density, bias, relu, seed):
    """The layer (with ``activation="relu"``: and a ReLU) against nn.Linear (and nn.ReLU)."""
    torch.manual_seed(seed)
    layer = BlockSparseLinear(*shape, bias=bias, density=density, block_size=8, seed=seed, device=DEVICE,
                              dtype=torch.float64, activation="relu" if relu else None)
    dense = masked_dense(layer)
    dense = torch.nn.Sequential(dense, torch.nn.ReLU()) if relu else dense
    x = torch.randn(*lead, shape[0], dtype=torch.float64, device=DEVICE, requires_grad=True)
    x_dense = x.detach().clone().requires_grad_(True)
    y, y_dense = layer(x), dense(x_dense)
    dense = dense[0] if relu else dense
    assert y.shape == (*lead, shape[1])
    torch.testing.assert_close(y, y_dense, rtol=1e-12, atol=1e-12)
    grad = torch.randn_like(y)
    y.backward(grad)
    y_dense.backward(grad)
    torch.testing.assert_close(x.grad, x_dense.grad, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(layer.weight.grad, blocks_of(layer, dense.weight.grad), rtol=1e-12, atol=1e-12)
    if bias:
        torch.testing.assert_close(layer.bias.grad, dense.bias.grad, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("activation", [None, "relu"])
def test_gradcheck(activation):
    layer = BlockSparseLinear(16, 8, density=0.5, block_size=8, device=DEVICE, dtype=torch.float64,
                              activation=activation)
    x = torch.randn(3, 16, dtype=torch.float64, device=DEVICE, requires_grad=True)
    torch.autograd.gradcheck(lambda x, w, b: torch.func.functional_call(layer, {"weight": w, "bias": b}, (x,)),
                             (x, layer.weight, layer.bias), fast_mode=True)


@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 1e-5), (torch.float16, 3e-3), (torch.bfloat16, 2e-2)])
def test_storage_dtypes(dtype, tolerance):
    torch.manual_seed(0)
    layer = BlockSparseLinear(16, 24, density=0.5, block_size=8, device=DEVICE).to(dtype)
    x = torch.randn(6, 16, device=DEVICE).to(dtype).requires_grad_(True)
    y = layer(x)
    assert y.dtype == dtype
    want = x.double() @ layer.to_dense().double().t() + layer.bias.double()
    torch.testing.assert_close(y.double(), want, rtol=tolerance, atol=tolerance)
    y.float().sum().backward()
    assert layer.weight.grad.dtype == dtype and x.grad.dtype == dtype


def test_autocast_runs_the_products_in_the_autocast_dtype():
    layer = BlockSparseLinear(16, 8, density=0.5, block_size=8, device=DEVICE)
    x = torch.randn(4, 16, device=DEVICE)
    dtype = torch.bfloat16 if DEVICE == "cpu" else torch.float16
    with torch.autocast(DEVICE, dtype=dtype):
        y = layer(x)
    assert y.dtype == dtype
    y.float().sum().backward()
    assert layer.weight.grad.dtype == torch.float32  # the parameter's own dtype
    torch.testing.assert_close(y.float(), masked_dense(layer)(x), rtol=3e-2, atol=3e-2)


def test_autocast_weight_gradient_comes_from_the_kernels_fp32_sums(cpu_path):
    """Under autocast the kernels take the fp32 weight and bias as they are and store the weight's
    gradient from their fp32 sums (OpenAI's dw_dtype), the bias's summed in fp32: no 16-bit
    rounding between them and the parameters."""
    if cpu_path == "torch":
        pytest.skip("the CPU path casts the weight, as torch's own layers do under autocast")
    layer = BlockSparseLinear(16, 8, density=0.5, block_size=8, device=DEVICE)
    x = torch.randn(6, 16, device=DEVICE)
    dtype = torch.bfloat16 if DEVICE == "cpu" else torch.float16
    with torch.autocast(DEVICE, dtype=dtype):
        y = layer(x)
    dy = torch.randn_like(y)
    y.backward(dy)
    want = blocks_of(layer, (x.to(dtype).double().t() @ dy.double()).t())
    assert layer.weight.grad.dtype == torch.float32 and layer.bias.grad.dtype == torch.float32
    torch.testing.assert_close(layer.weight.grad.double(), want, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(layer.bias.grad.double(), dy.double().sum(0), rtol=1e-6, atol=1e-6)
    want = x.to(dtype).double() @ layer.to_dense().to(dtype).double().t() + layer.bias.detach().double()
    torch.testing.assert_close(y.double(), want, rtol=1e-2, atol=1e-2)


def test_init_is_scaled_to_the_density():
    torch.manual_seed(0)
    layer = BlockSparseLinear(256, 64, density=0.25, block_size=8, device=DEVICE)
    fan_in = 256 * 0.25
    assert float(layer.weight.abs().max()) <= 1 / fan_in ** 0.5
    assert float(layer.weight.abs().max()) > 0.9 / fan_in ** 0.5


def test_repr_and_to_dense():
    layer = BlockSparseLinear(16, 8, density=0.5, block_size=8, device=DEVICE)
    assert "block_size=8" in repr(layer) and "density=0.5" in repr(layer)
    dense = layer.to_dense()
    assert dense.shape == (8, 16)
    assert torch.equal(dense.t().ne(0).cpu(), torch.as_tensor(layer.layout.element_mask()) & dense.t().ne(0).cpu())


def test_state_dict_round_trip_takes_the_saved_layout():
    torch.manual_seed(0)
    saved = BlockSparseLinear(16, 24, density=0.5, block_size=8, seed=1, device=DEVICE)
    loaded = BlockSparseLinear(16, 24, density=1.0, block_size=8, device=DEVICE)
    loaded.load_state_dict(saved.state_dict())
    assert loaded.layout == saved.layout
    assert torch.equal(loaded.weight, saved.weight) and torch.equal(loaded.bias, saved.bias)
    x = torch.randn(3, 16, device=DEVICE)
    assert torch.equal(loaded(x), saved(x))
    assert set(saved.state_dict()) == {"weight", "bias", "block_mask"}


def test_state_dict_of_another_layout_shape_is_a_clear_error():
    saved = BlockSparseLinear(16, 24, density=0.5, block_size=8, device=DEVICE)
    other = BlockSparseLinear(32, 24, density=0.5, block_size=8, device=DEVICE)
    with pytest.raises(RuntimeError, match="block_mask: expected a layout of"):
        other.load_state_dict(saved.state_dict())
    state = saved.state_dict()
    state["weight"] = state["weight"][:1]
    with pytest.raises(RuntimeError, match="weight: expected shape"):
        saved.load_state_dict(state)


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="density, layout"):
        BlockSparseLinear(16, 8)
    with pytest.raises(ValueError, match="multiples of block_size"):
        BlockSparseLinear(20, 8, density=0.5, block_size=8)
    with pytest.raises(ValueError, match="block_size"):
        BlockSparseLinear(24, 24, density=0.5, block_size=12)
    with pytest.raises(ValueError, match="density"):
        BlockSparseLinear(16, 8, density=0, block_size=8)
    with pytest.raises(ValueError, match="layout: expected a grid"):
        BlockSparseLinear(16, 8, layout=np.ones((1, 1)), block_size=8)
    with pytest.raises(ValueError, match="activation: expected None or 'relu'"):
        BlockSparseLinear(16, 8, density=0.5, block_size=8, activation="gelu")
    layer = BlockSparseLinear(16, 8, density=0.5, block_size=8, device=DEVICE)
    with pytest.raises(ValueError, match="input: expected 16 features"):
        layer(torch.randn(2, 8, device=DEVICE))
    with pytest.raises(TypeError, match="input: expected dtype"):
        layer(torch.randn(2, 16, device=DEVICE, dtype=torch.float64))


def test_from_dense_keeps_exactly_the_top_norm_blocks():
    torch.manual_seed(0)
    linear = torch.nn.Linear(24, 16, device=DEVICE)
    with torch.no_grad():  # blocks of distinct, known norms: block (c, k) scaled by a permutation
        scale = torch.randperm(6).reshape(3, 2).float().add(1).to(DEVICE)
        linear.weight.mul_(scale.repeat_interleave(8, 0).repeat_interleave(8, 1).t())
    for criterion in ("l2", "l1", "max"):
        layer = BlockSparseLinear.from_dense(linear, density=0.5, block_size=8, criterion=criterion)
        w = linear.weight.detach().t().reshape(3, 8, 2, 8).abs()
        norms = {"l2": w.pow(2).sum((1, 3)).sqrt(), "l1": w.sum((1, 3)), "max": w.amax((1, 3))}[criterion]
        top = norms.flatten().argsort(descending=True)[:3]
        want = torch.zeros(6, dtype=torch.bool, device=DEVICE)
        want[top] = True
        assert torch.equal(layer.block_mask.flatten(), want)
        torch.testing.assert_close(layer.weight, blocks_of(layer, linear.weight.detach()))
        assert torch.equal(layer.bias, linear.bias)
    rescaled = BlockSparseLinear.from_dense(linear, density=0.5, block_size=8, rescale=True)
    torch.testing.assert_close(rescaled.weight.norm(), linear.weight.norm())


def test_sparsify_changes_only_matching_layers_and_equals_the_dense_masked_model():
    torch.manual_seed(0)
    model = torch.nn.TransformerEncoder(torch.nn.TransformerEncoderLayer(
        16, 2, dim_feedforward=32, dropout=0.0, batch_first=True, device=DEVICE), 2, enable_nested_tensor=False)
    before = {name: type(m) for name, m in model.named_modules()}
    replaced = sparsify(model, [r"layers\.\d+\.linear[12]"], density=0.5, block_size=8)
    assert sorted(replaced) == ["layers.0.linear1", "layers.0.linear2", "layers.1.linear1", "layers.1.linear2"]
    for name, module in model.named_modules():
        assert isinstance(module, BlockSparseLinear) == (name in replaced), name
        if name not in replaced:
            assert type(module) is before[name]
    dense = torch.nn.TransformerEncoder(torch.nn.TransformerEncoderLayer(
        16, 2, dim_feedforward=32, dropout=0.0, batch_first=True, device=DEVICE), 2, enable_nested_tensor=False)
    state = {k: v for k, v in model.state_dict().items() if "linear" not in k}
    dense.load_state_dict(state, strict=False)
    for name in replaced:
        dense.get_submodule(name).load_state_dict(masked_dense(model.get_submodule(name)).state_dict())
    x = torch.randn(2, 3, 16, device=DEVICE)
    torch.testing.assert_close(model(x), dense(x), rtol=1e-5, atol=1e-5)
    model.eval(), dense.eval()
    with torch.no_grad():  # (where the encoder's fused fast path would read the weights directly)
        torch.testing.assert_close(model(x), dense(x), rtol=1e-5, atol=1e-5)


def test_sparsify_fuses_a_following_relu():
    """``fuse_relu``: a replaced layer followed by an nn.ReLU in an nn.Sequential takes it (the
    ReLU module becomes an Identity); one followed by something else, or the last, does not."""
    torch.manual_seed(0)
    dense = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 16), torch.nn.GELU(),
                                torch.nn.Linear(16, 8), torch.nn.ReLU()).to(DEVICE)
    model = copy.deepcopy(dense)
    replaced = sparsify(model, [r"[02]"], density=0.5, block_size=8, fuse_relu=True)
    assert sorted(replaced) == ["0", "2"] and type(model[1]) is torch.nn.Identity and type(model[3]) is torch.nn.GELU
    assert model[0].activation == "relu" and model[2].activation is None and type(model[5]) is torch.nn.ReLU
    for i in (0, 2):
        dense[i].load_state_dict(masked_dense(model[i]).state_dict())
    x = torch.randn(5, 16, device=DEVICE)
    torch.testing.assert_close(model(x), dense(x), rtol=1e-5, atol=1e-5)


def test_sparsify_names_a_layer_it_cannot_cut():
    model = torch.nn.Sequential(torch.nn.Linear(16, 12))
    with pytest.raises(ValueError, match="0: linear: expected features that are multiples"):
        sparsify(model, ["0"], density=0.5, block_size=8)


def _regrowth_model(grow):
    torch.manual_seed(0)
    model = torch.nn.Sequential(BlockSparseLinear(16, 24, density=0.5, block_size=8, device=DEVICE),
                                torch.nn.ReLU(), BlockSparseLinear(24, 16, density=0.5, block_size=8, device=DEVICE))
    optimizer = BlockRegrowth(torch.optim.Adam(model.parameters(), lr=1e-2), model, every=2, fraction=0.34,
                              grow=grow)
    return model, optimizer


@pytest.mark.parametrize("grow", ["gradient", "random"])
def test_regrowth_keeps_the_block_count_and_resets_exactly_the_moved_blocks_state(grow):
    model, optimizer = _regrowth_model(grow)
    x, target = torch.randn(8, 16, device=DEVICE), torch.randn(8, 16, device=DEVICE)
    layer = model[0]
    for step in range(2):
        mask, coords = layer.block_mask.clone(), layer.block_coords.clone()
        torch.nn.functional.mse_loss(model(x), target).backward()
        if step == 1:  # the step that regrows: what Adam's step leaves, before the move
            optimizer.optimizer.step()
            weight, state = layer.weight.detach().clone(), {k: v.clone() for k, v in optimizer.state[layer.weight].items()}
            optimizer.steps += 1
            for each in optimizer.layers:
                optimizer.regrow(each, 0.34)
        else:
            optimizer.step()
        optimizer.zero_grad()
    assert layer.n_blocks == 3 and int(layer.block_mask.sum()) == 3
    moved = (mask & ~layer.block_mask).sum()
    assert int(moved) == 1 and int((layer.block_mask & ~mask).sum()) == 1
    old_id = {tuple(c): b for b, c in enumerate(coords.tolist())}
    for b, c in enumerate(layer.block_coords.tolist()):
        if tuple(c) in old_id:  # kept: its weight and moments came along
            assert torch.equal(layer.weight[b], weight[old_id[tuple(c)]])
            for name in ("exp_avg", "exp_avg_sq"):
                assert torch.equal(optimizer.state[layer.weight][name][b], state[name][old_id[tuple(c)]])
        else:  # grown: zero weight, zero moments
            assert not layer.weight[b].any()
            for name in ("exp_avg", "exp_avg_sq"):
                assert not optimizer.state[layer.weight][name][b].any()


def test_regrowth_grows_where_the_dense_gradient_is_largest():
    torch.manual_seed(0)
    layer = BlockSparseLinear(24, 16, density=0.5, block_size=8, device=DEVICE)
    optimizer = BlockRegrowth(torch.optim.SGD(layer.parameters(), lr=0.0), layer, every=1, fraction=0.34)
    c, k = (int(i) for i in (~layer.block_mask).nonzero()[0])
    # x only on input block c and dy only on output block k: the dense gradient xᵀ·dy is block (c, k) alone.
    x = torch.zeros(4, 24, device=DEVICE)
    x[:, c * 8:(c + 1) * 8] = 1.0
    dy = torch.zeros(4, 16, device=DEVICE)
    dy[:, k * 8:(k + 1) * 8] = 1.0
    (layer(x) * dy).sum().backward()
    optimizer.step()
    assert bool(layer.block_mask[c, k]) and layer.n_blocks == 3


def test_regrowth_scores_take_the_fused_relus_gradient():
    """With ``activation="relu"`` the scores are the block norms of xᵀ·dz, dz the gradient through
    the ReLU (zero where the output is), as for nn.Sequential(layer, nn.ReLU())."""
    from sparseblocks.torch.linear import block_norms

    torch.manual_seed(1)
    layer = BlockSparseLinear(24, 16, density=0.5, block_size=8, device=DEVICE, activation="relu")
    layer._grow_scores_wanted = True
    x = torch.randn(6, 24, device=DEVICE)
    y = layer(x)
    grad = torch.randn_like(y)
    y.backward(grad)
    dz = grad * (y > 0)
    assert (y == 0).any()
    torch.testing.assert_close(layer._grow_scores, block_norms(x.t() @ dz, 8))


def test_training_steps_decrease_the_loss():
    torch.manual_seed(0)
    model = torch.nn.Sequential(BlockSparseLinear(16, 16, density=0.5, block_size=8, device=DEVICE),
                                torch.nn.ReLU(), BlockSparseLinear(16, 8, density=0.5, block_size=8, device=DEVICE))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    x, target = torch.randn(8, 16, device=DEVICE), torch.randn(8, 8, device=DEVICE)
    losses = []
    for _ in range(3):
        loss = torch.nn.functional.mse_loss(model(x), target)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0]


def test_compiles_with_no_graph_break():
    model = torch.nn.Sequential(BlockSparseLinear(16, 24, density=0.5, block_size=8, device=DEVICE),
                                torch.nn.GELU(),
                                BlockSparseLinear(24, 16, density=0.5, block_size=8, device=DEVICE, activation="relu"),
                                BlockSparseLinear(16, 8, density=0.5, block_size=8, device=DEVICE))
    x = torch.randn(2, 3, 16, device=DEVICE)
    # aot_eager traces forward and backward through the fake kernels; inductor is tested on the GPU.
    assert_compiles_as_eager(model, x, "aot_eager" if SIMULATOR else "inductor")


def assert_compiles_as_eager(model, x, backend):
    """``model`` compiles whole (no graph break, one graph), and the compiled model's output and
    gradients (of x and the first layer's weight) are the eager model's."""
    explained = torch._dynamo.explain(model)(x)
    assert explained.graph_break_count == 0 and explained.graph_count == 1
    compiled = torch.compile(model, fullgraph=True, backend=backend)
    x_eager = x.clone().requires_grad_(True)
    x.requires_grad_(True)
    y = compiled(x)
    torch.testing.assert_close(y, model(x_eager))
    grads = torch.autograd.grad(y.sum(), (x, model[0].weight))
    want = torch.autograd.grad(model(x_eager).sum(), (x_eager, model[0].weight))
    for got, expected in zip(grads, want):
        torch.testing.assert_close(got, expected)


@pytest.mark.parametrize("bias, relu", [(False, False), (True, False), (True, True)])
def test_product_op_passes_opcheck(bias, relu, cpu_path):
    """The forward's custom op (with and without the bias it adds, and the ReLU it takes) against
    torch's own checks: schema, fake kernel, autograd registration and dispatch."""
    if cpu_path == "torch":
        pytest.skip("the custom op runs the kernels")
    from sparseblocks.layout import BlockLayout
    from sparseblocks.torch import ops

    layout = BlockLayout.random((2, 3), 0.5, seed=2, block_size=8)
    x = torch.randn(5, 16, device=DEVICE, dtype=torch.float64, requires_grad=True)
    w = torch.randn(layout.w_shape, device=DEVICE, dtype=torch.float64, requires_grad=True)
    b = torch.randn(24, device=DEVICE, dtype=torch.float64, requires_grad=True) if bias else None
    torch.library.opcheck(ops.bsmm_forward, (x, w, ops.layout_key(layout), b, relu))
    if bias:  # (the weight gradient with the bias gradient: two outputs)
        dy = torch.randn(5, 24, device=DEVICE, dtype=torch.float64)
        torch.library.opcheck(ops.bsmm_weight_bias_grad,
                              (x.detach(), dy, ops.layout_key(layout), torch.float64, torch.float64))
