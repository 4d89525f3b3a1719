"""`sparseblocks.torch.ew`: the element-wise custom ops' autograd (gradcheck in float64), opcheck
and torch.compile, on the kernels and (without a GPU) on the CPU path too."""

import pytest

torch = pytest.importorskip("torch")

from sparseblocks.runtime.backend import SIMULATOR  # noqa: E402
from sparseblocks.torch import ew  # noqa: E402

DEVICE = "cpu" if SIMULATOR else "cuda"


@pytest.fixture(autouse=True, params=["torch", "kernels"] if SIMULATOR else ["kernels"])
def path(request, configure):
    from sparseblocks import ew as kernels
    from sparseblocks.torch import cpu

    if SIMULATOR:
        configure(kernels, threads=32, waves=2)
    previous = cpu.kernels_on_cpu(request.param == "kernels")
    yield request.param
    cpu.kernels_on_cpu(previous)


def rand(*shape, positive=False, seed=0):
    g = torch.Generator().manual_seed(seed + len(shape))
    t = torch.rand(*shape, generator=g, dtype=torch.float64) + 0.5
    t = t if positive else t * torch.where(torch.rand(*shape, generator=g) < 0.5, -1.0, 1.0).double()
    return t.to(DEVICE).requires_grad_(True)


@pytest.mark.parametrize("op", ["reciprocal", "sqrt", "log", "sigmoid", "tanh", "elu", "square"])
def test_unary_gradcheck(op):
    x = rand(3, 4, positive=op in ("sqrt", "log"))
    torch.autograd.gradcheck(lambda x: ew.unary(op, x, 0.7), (x,), fast_mode=True)


@pytest.mark.parametrize("op", ["add", "subtract", "multiply", "divide", "maximum"])
@pytest.mark.parametrize("shapes", [((3, 4), (3, 4)), ((2, 3, 4), (4,)), ((3, 1), (1, 5))])
def test_binary_gradcheck_with_broadcasting(op, shapes, path):
    if path == "kernels" and SIMULATOR and shapes != ((2, 3, 4), (4,)):
        pytest.skip("the broadcasting case on the kernels in the simulator (tests/ew checks every shape)")
    a, b = rand(*shapes[0], seed=1), rand(*shapes[1], seed=2)
    torch.autograd.gradcheck(lambda a, b: ew.binary(op, a, b), (a, b), fast_mode=True)


def test_add_n_cwise_linear_and_lstm_gates_gradcheck():
    xs = [rand(2, 3, seed=k) for k in range(3)]
    torch.autograd.gradcheck(lambda *xs: ew.add_n(xs), tuple(xs), fast_mode=True)
    x, a, b = rand(2, 3, 2, 2), rand(3, seed=5), rand(3, seed=6)
    torch.autograd.gradcheck(ew.cwise_linear, (x, a, b), fast_mode=True)
    torch.autograd.gradcheck(lambda x, b: ew.cwise_linear(x, None, b), (x, b), fast_mode=True)
    c = rand(2, 3, seed=7)
    gates = [rand(2, 3, seed=8 + k) for k in range(4)]
    torch.autograd.gradcheck(lambda c, *g: torch.cat(ew.fused_lstm_gates(c, *g)), (c, *gates), fast_mode=True)
    merged = rand(2, 12, seed=12)
    torch.autograd.gradcheck(lambda c, g: torch.cat(ew.fused_lstm_gates(c, g)), (c, merged), fast_mode=True)


def test_the_ops_match_torch():
    x, y = rand(4, 5).detach().float(), rand(5, seed=3).detach().float()
    torch.testing.assert_close(ew.sigmoid(x), torch.sigmoid(x))
    torch.testing.assert_close(ew.maximum(x, y), torch.maximum(x, y))
    torch.testing.assert_close(ew.elu(x, 0.5), torch.nn.functional.elu(x, 0.5))


def test_opcheck():
    x, y = rand(3, 4).detach().float(), rand(4, seed=1).detach().float()
    torch.library.opcheck(ew.unary_op, (x, "tanh", 1.0))
    torch.library.opcheck(ew.binary_op, (x, y, "multiply"))
    torch.library.opcheck(ew.add_n_op, ([x, x * 2],))
    torch.library.opcheck(ew.cwise_linear_op, (x.reshape(3, 4, 1), y, None))
    torch.library.opcheck(ew.lstm_gates_op, (x, [x, x, x, x]))


def test_compiles_with_no_graph_break():
    x, y = rand(3, 4).detach().float().requires_grad_(True), rand(4, seed=1).detach().float()

    def f(x, y):
        return ew.tanh(ew.add(ew.multiply(x, y), x)).sum()

    out = torch.compile(f, fullgraph=True)(x, y)
    torch.testing.assert_close(out, f(x, y))
    out.backward()
    assert x.grad is not None


def test_dropout_trains_and_its_mask_is_the_kernels():
    from sparseblocks.philox import keep_bits_host

    x = rand(6, 50).detach().float().requires_grad_(True)
    y = ew.dropout(x, 0.7, seed=4, offset=100)
    keep = torch.from_numpy(keep_bits_host(x.numel(), 0.7, 4, 100)).reshape(x.shape).to(x.device)
    torch.testing.assert_close(y, torch.where(keep, x / 0.7, 0 * x))
    y.sum().backward()
    torch.testing.assert_close(x.grad, torch.where(keep, torch.full_like(x, 1 / 0.7), 0 * x))
    torch.library.opcheck(ew.dropout_op, (x.detach(), 0.7, 4, 100))
    x64 = rand(3, 5)
    torch.autograd.gradcheck(lambda x: ew.dropout(x, 0.5, seed=1), (x64,), fast_mode=True)
