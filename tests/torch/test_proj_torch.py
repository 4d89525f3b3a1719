"""`sparseblocks.torch.proj.SparseProj`: gradcheck in float64, opcheck, against torch's indexing,
on the kernels and (without a GPU) on the CPU path too."""

import pytest

torch = pytest.importorskip("torch")

from sparseblocks.runtime.backend import SIMULATOR  # noqa: E402
from sparseblocks.torch.proj import SparseProj, gather_op, scatter_op  # noqa: E402

DEVICE = "cpu" if SIMULATOR else "cuda"


@pytest.fixture(autouse=True, params=["torch", "kernels"] if SIMULATOR else ["kernels"])
def path(request):
    from sparseblocks.torch import cpu

    previous = cpu.kernels_on_cpu(request.param == "kernels")
    yield request.param
    cpu.kernels_on_cpu(previous)


@pytest.mark.parametrize("axis", [1, 0])
def test_the_maps_train(axis):
    proj = SparseProj(10, gather_lut=[7, 1, 4], feature_axis=axis)
    g = torch.Generator().manual_seed(axis)
    shape = lambda width: (3, width) if axis == 1 else (width, 3)  # noqa: E731
    h = torch.randn(*shape(10), generator=g, dtype=torch.float64).to(DEVICE).requires_grad_(True)
    p = torch.randn(*shape(3), generator=g, dtype=torch.float64).to(DEVICE).requires_grad_(True)
    for f, args in ((proj.gather, (h,)), (proj.scatter, (p,)), (proj.scatter_add, (p, h)), (proj.scatter_mul, (p, h))):
        torch.autograd.gradcheck(f, args, fast_mode=True)
    want = h.detach().index_select(axis, torch.tensor([7, 1, 4], device=DEVICE))
    torch.testing.assert_close(proj.gather(h), want)
    torch.library.opcheck(gather_op, (h.detach().float(), None, [7, 1, 4], 10, axis))
    torch.library.opcheck(scatter_op, (p.detach().float(), h.detach().float(), [7, 1, 4], 10, axis, 2))
