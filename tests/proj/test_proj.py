"""SparseProj (sparseblocks/proj) against its NumPy twin: every map and gradient, both feature
axes, every dtype, the default lookup tables, and errors."""

import numpy as np
import pytest

from sparseblocks.proj import SparseProj
from sparseblocks.reference import proj as reference
from strategies import numpy_dtype


def _t(a, axis):
    return a if axis == 1 else np.ascontiguousarray(a.T)


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16", "float64"])
@pytest.mark.parametrize("axis", [1, 0])
def test_the_maps_and_their_gradients_match_the_twin(dtype, axis):
    rng = np.random.default_rng(axis)
    lut = rng.permutation(40)[:13]
    proj = SparseProj(40, gather_lut=lut, feature_axis=axis)
    cast = lambda a: a.astype(numpy_dtype(dtype))  # noqa: E731
    h, p = cast(rng.uniform(0.5, 2, (5, 40))), cast(rng.uniform(0.5, 2, (5, 13)))
    both = lambda got: np.asarray(got if axis == 1 else got.T, np.float64)  # noqa: E731
    ph, pp = _t(h, axis), _t(p, axis)
    np.testing.assert_array_equal(both(proj.gather(ph)), reference.gather(h, lut))
    np.testing.assert_array_equal(both(proj.scatter(pp)), reference.scatter(p, lut, 40))
    np.testing.assert_allclose(both(proj.scatter_add(pp, ph)), reference.scatter_add(p, h, lut), rtol=1e-2)
    np.testing.assert_allclose(both(proj.scatter_mul(pp, ph)), reference.scatter_mul(p, h, lut), rtol=1e-2)
    np.testing.assert_array_equal(both(proj.gather_grad(pp)), reference.scatter(p, lut, 40))
    np.testing.assert_array_equal(both(proj.scatter_grad(ph)), reference.gather(h, lut))
    dx, dy = proj.scatter_mul_grad(ph, pp, ph)
    want_dx, want_dy = reference.scatter_mul_grad(h, p, h, lut)
    np.testing.assert_allclose(both(dx), want_dx, rtol=1e-2)
    np.testing.assert_allclose(both(dy), want_dy, rtol=1e-2)
    dx, dy = proj.scatter_add_grad(ph)
    np.testing.assert_array_equal(both(dx), reference.gather(h, lut))


def test_default_lookup_tables():
    np.testing.assert_array_equal(SparseProj(12, nproj=4).gather_lut, [0, 3, 6, 9])
    np.testing.assert_array_equal(SparseProj(12, proj_stride=5).gather_lut, [0, 5])
    np.testing.assert_array_equal(SparseProj(12, nproj=3, proj_stride=2).gather_lut, [0, 2, 4])


@pytest.mark.parametrize("call, match", [
    (lambda: SparseProj(8), "expected nproj, proj_stride or gather_lut"),
    (lambda: SparseProj(8, gather_lut=[0, 0]), "distinct indices"),
    (lambda: SparseProj(8, gather_lut=[9]), r"distinct indices in \[0, 8\)"),
    (lambda: SparseProj(8, nproj=5, proj_stride=2), "do not fit"),
    (lambda: SparseProj(8, nproj=2, block_size=48), "block_size: expected a multiple of 32"),
    (lambda: SparseProj(8, nproj=2).gather(np.ones((3, 7), np.float32)), r"x: expected \(N, 8\)"),
    (lambda: SparseProj(8, nproj=2).scatter_add(np.ones((3, 2), np.float32), np.ones((4, 8), np.float32)),
     "y: expected 3 rows"),
])
def test_bad_input_is_refused(call, match):
    with pytest.raises(ValueError, match=match):
        call()
