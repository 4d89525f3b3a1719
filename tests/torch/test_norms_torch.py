"""`sparseblocks.torch.layer_norm`: the custom op's autograd (gradcheck in float64), opcheck,
torch.compile with no graph break, on the kernels and (without a GPU) on the CPU path too."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from sparseblocks.reference import norms as reference  # noqa: E402
from sparseblocks.runtime.backend import SIMULATOR  # noqa: E402
from sparseblocks.torch import layer_norm  # noqa: E402
from sparseblocks.torch.norms import layer_norm_op  # noqa: E402

DEVICE = "cpu" if SIMULATOR else "cuda"


@pytest.fixture(autouse=True, params=["torch", "kernels"] if SIMULATOR else ["kernels"])
def path(request, configure):
    """Without a GPU each test runs on the CPU path (torch's ops) and on the kernels in the
    simulator (one warp a row there)."""
    from sparseblocks import norms
    from sparseblocks.torch import cpu

    if SIMULATOR:
        configure(norms, row_threads=32, column_warps=2, column_rows=3, grad_rows=3)
    previous = cpu.kernels_on_cpu(request.param == "kernels")
    yield request.param
    cpu.kernels_on_cpu(previous)


def _inputs(axis, dtype=torch.float64, n=5, c=7, seed=0):
    g = torch.Generator().manual_seed(seed)
    shape = (n, c) if axis == 1 else (c, n)
    make = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64).to(DEVICE, dtype)  # noqa: E731
    return make(*shape) + 2, make(c), make(c)


@pytest.mark.parametrize("axis", [1, 0])
@pytest.mark.parametrize("relu", [False, True])
def test_gradcheck_in_float64(axis, relu, path):
    if path == "kernels" and SIMULATOR and (axis, relu) not in ((1, True), (0, False)):
        pytest.skip("two cases on the kernels in the simulator (tests/norms checks them against the twin)")
    x, g, b = (t.requires_grad_(True) for t in _inputs(axis))
    torch.autograd.gradcheck(lambda x, g, b: layer_norm(x, g, b, axis=axis, relu=relu), (x, g, b), fast_mode=True)


@pytest.mark.parametrize("axis", [1, 0])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_values_and_gradients_match_the_twin(axis, dtype, path):
    if path == "kernels" and SIMULATOR and (axis, dtype) != (0, torch.bfloat16):
        pytest.skip("one case on the kernels in the simulator (tests/norms checks them against the twin)")
    x, g, b = (t.requires_grad_(True) for t in _inputs(axis, dtype, n=6, c=40, seed=1))
    y = layer_norm(x, g, b, axis=axis, relu=True)
    dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(2)).to(DEVICE, dtype)
    y.backward(dy)
    host = lambda t: t.detach().float().cpu().numpy()  # noqa: E731
    want = reference.layer_norm(host(x), host(g), host(b), axis, relu=True)[0]
    dx, dg, db = reference.layer_norm_grad(host(dy), host(x), host(g), host(b), axis, relu=True)
    tol = {"rtol": 2e-2, "atol": 2e-2} if dtype == torch.bfloat16 else {"rtol": 1e-4, "atol": 1e-4}
    for name, got, w in (("y", y, want), ("dx", x.grad, dx), ("dg", g.grad, dg), ("db", b.grad, db)):
        assert got.dtype == dtype, name
        np.testing.assert_allclose(host(got), w, **tol, err_msg=name)


def test_opcheck():
    x, g, b = _inputs(1, torch.float32)
    torch.library.opcheck(layer_norm_op, (x, g, b, 1, 1e-6, True))
    torch.library.opcheck(layer_norm_op, (x.t().contiguous(), g, b, 0, 1e-5, False))


def test_compiles_with_no_graph_break():
    x, g, b = (t.requires_grad_(True) for t in _inputs(1, torch.float32))
    eager = layer_norm(x, g, b, relu=True)
    compiled = torch.compile(lambda x, g, b: layer_norm(x, g, b, relu=True) * 2, fullgraph=True)
    out = compiled(x, g, b)
    torch.testing.assert_close(out, eager * 2)
    out.sum().backward()
    assert x.grad is not None and g.grad is not None


def test_bad_input_gives_the_kernels_errors():
    x, g, b = _inputs(1, torch.float32)
    with pytest.raises(ValueError, match=r"g: expected shape \(7,\)"):
        layer_norm(x, g[:3], b)
    with pytest.raises(ValueError, match="axis: expected 0"):
        layer_norm(x, g, b, axis=3)
    with pytest.raises(TypeError, match="x: expected a torch tensor"):
        layer_norm(np.zeros((5, 7), np.float32), g, b)


def test_batch_norm_gradcheck_opcheck_and_twin():
    from sparseblocks.torch import batch_norm
    from sparseblocks.torch.norms import batch_norm_op

    g = torch.Generator().manual_seed(3)
    x = (torch.randn(2, 3, 4, 2, generator=g, dtype=torch.float64) + 1).to(DEVICE).requires_grad_(True)
    w = torch.randn(3, generator=g, dtype=torch.float64).to(DEVICE).requires_grad_(True)
    b = torch.randn(3, generator=g, dtype=torch.float64).to(DEVICE).requires_grad_(True)
    torch.autograd.gradcheck(batch_norm, (x, w, b), fast_mode=True)
    y, mean, var = batch_norm(x, w, b, stats=True)
    want, want_mean, want_var = reference.batch_norm(*(t.detach().cpu().numpy() for t in (x, w, b)))
    np.testing.assert_allclose(y.detach().cpu().numpy(), want, rtol=1e-10, atol=1e-10)
    np.testing.assert_allclose(var.cpu().numpy(), want_var, rtol=1e-10)
    torch.library.opcheck(batch_norm_op, (x.detach().float(), w.detach().float(), b.detach().float(), 1e-5))
