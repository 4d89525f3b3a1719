"""`sparseblocks.torch.cast.float_cast`: the same bits as the NumPy twin (ml_dtypes; the written-out
stochastic rounding), on the kernels and (without a GPU) on the CPU path; its gradient; opcheck."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("ml_dtypes")

from sparseblocks.cast import DTYPES  # noqa: E402
from sparseblocks.reference import cast as reference  # noqa: E402
from sparseblocks.runtime.backend import SIMULATOR  # noqa: E402
from sparseblocks.torch.cast import float_cast, float_cast_op  # noqa: E402

DEVICE = "cpu" if SIMULATOR else "cuda"
VALUES = np.array([0.0, -0.0, 1.0, -3.3, 448, 449, 464, 465, 480, 57344, 61440, 65520, 3.4e38, np.inf, -np.inf,
                   2 ** -9, 2 ** -10, 3 * 2 ** -11, 2 ** -17, 1e-30, 1e-39, 0.1, -7.77, 1000.5], np.float32)


@pytest.fixture(autouse=True, params=["torch", "kernels"] if SIMULATOR else ["kernels"])
def path(request, configure):
    from sparseblocks import cast
    from sparseblocks.torch import cpu

    if SIMULATOR:
        configure(cast, threads=32, waves=2)
    previous = cpu.kernels_on_cpu(request.param == "kernels")
    yield request.param
    cpu.kernels_on_cpu(previous)


def bits(t):
    t = t.detach().cpu()
    return t.view(torch.uint8 if t.element_size() == 1 else torch.int16 if t.element_size() == 2 else torch.int32) \
        .numpy().astype(np.int64)


def twin_bits(a, dtype):
    return np.asarray(a).view(reference._bits_dtype(dtype)).astype(np.int64)


@pytest.mark.parametrize("dst", [d for d in DTYPES if d != "float32"])
@pytest.mark.parametrize("stochastic, saturate", [(False, False), (False, True), (True, False)])
def test_the_bits_are_the_twins(dst, stochastic, saturate):
    x = torch.from_numpy(VALUES).to(DEVICE)
    got = float_cast(x, dst, stochastic=stochastic, saturate=saturate, seed=9, offset=4)
    want = reference.float_cast(VALUES, dst, stochastic=stochastic, saturate=saturate, seed=9, offset=4)
    assert got.dtype == getattr(torch, dst)
    np.testing.assert_array_equal(bits(got) & reference_mask(dst), twin_bits(want, dst) & reference_mask(dst))


def reference_mask(dst):
    return (1 << (8 * np.dtype(reference._bits_dtype(dst)).itemsize)) - 1


def test_the_gradient_is_cast_back():
    x = torch.tensor([1.1, -2.3, 500.0], device=DEVICE, requires_grad=True)
    y = float_cast(x, "float8_e5m2")
    y.float().sum().backward()
    torch.testing.assert_close(x.grad, torch.ones_like(x))
    x.grad = None
    float_cast(x, "bfloat16", dx_dtype="float16").float().mul(3).sum().backward()
    torch.testing.assert_close(x.grad, torch.full_like(x, 3.0))


def test_opcheck_and_errors():
    x = torch.from_numpy(VALUES[:8].copy()).to(DEVICE)
    torch.library.opcheck(float_cast_op, (x, "bfloat16", False, True, 0, 0))
    with pytest.raises(ValueError, match="dtype: expected one of"):
        float_cast(x, "float4")
    with pytest.raises(ValueError, match="seed: expected an int"):
        float_cast(x, "float16", seed=2 ** 63)
