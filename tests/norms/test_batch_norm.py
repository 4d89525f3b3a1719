"""Batch norm (sparseblocks/norms/batch.py) against its NumPy twin: NCHW and (N, C), every dtype,
large means, inference with running statistics, the backward, and errors."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sparseblocks import norms
from sparseblocks.norms import NormsConfig
from sparseblocks.reference import norms as reference
from sparseblocks.runtime.backend import SIMULATOR
from strategies import TOLERANCE, numpy_dtype

SMALL = NormsConfig(row_threads=32, column_warps=2, column_rows=3, grad_rows=3) if SIMULATOR else NormsConfig()


def close(got, want, dtype, name, factor=1.0):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert got.shape == want.shape, name
    bound = 4 * factor * TOLERANCE[dtype] * (np.linalg.norm(want) + 1.0)
    assert np.linalg.norm(got - want) <= bound, f"{name}: {np.linalg.norm(got - want):.3g} > {bound:.3g}"


@settings(max_examples=12 if SIMULATOR else 50, deadline=None)
@given(shape=st.sampled_from([(2, 3, 4, 5), (1, 2, 3), (5, 4), (3, 1, 1, 7), (1, 3, 1, 1)]),
       dtype=st.sampled_from(["float32", "float16", "bfloat16", "float64"]), mean=st.sampled_from([0.0, 40.0]),
       seed=st.integers(0, 99))
def test_batch_norm_and_its_gradients_match_the_twin(shape, dtype, mean, seed):
    rng = np.random.default_rng(seed)
    x = (mean + rng.standard_normal(shape)).astype(numpy_dtype(dtype))
    C = shape[1]
    g, b = rng.standard_normal(C).astype(numpy_dtype(dtype)), rng.standard_normal(C).astype(numpy_dtype(dtype))
    y, m, v = norms.batch_norm(x, g, b, stats=True, config=SMALL)
    want, want_m, want_v = reference.batch_norm(x, g, b)
    spread = 1 + mean  # (a large mean costs the relative accuracy of x itself, not of the sums)
    close(y, want, dtype, "y", spread)
    close(m, want_m, "float64" if dtype == "float64" else "float32", "mean", spread)
    close(v, want_v, "float64" if dtype == "float64" else "float32", "var", spread)
    np.testing.assert_array_equal(norms.batch_norm_inference(x, g, b, m, v, config=SMALL), y)
    dy = rng.standard_normal(shape).astype(numpy_dtype(dtype))
    dx, dg, db = norms.batch_norm_grad(dy, x, g, m, v, config=SMALL)
    for name, got, w in zip(("dx", "dg", "db"), (dx, dg, db), reference.batch_norm_grad(dy, x, g)):
        close(got, w, dtype, name, spread * 4)
    assert dx.dtype == x.dtype and dg.dtype == db.dtype == g.dtype


X, G = np.zeros((2, 3, 4), np.float32), np.ones(3, np.float32)


@pytest.mark.parametrize("call, error, match", [
    (lambda: norms.batch_norm(X[0, 0], G, G), ValueError, r"x: expected \(N, C, ...\)"),
    (lambda: norms.batch_norm(np.zeros((0, 3), np.float32), G, G), ValueError, "at least one value a channel"),
    (lambda: norms.batch_norm(X, G[:2], G), ValueError, r"g: expected shape \(3,\)"),
    (lambda: norms.batch_norm(X, G, G.astype(np.float64)), TypeError, "dtype mismatch"),
    (lambda: norms.batch_norm(X, G, G, epsilon=-1), ValueError, "epsilon"),
    (lambda: norms.batch_norm_inference(X, G, G, G.astype(np.float16), G.astype(np.float16)), TypeError, "mean, var"),
    (lambda: norms.batch_norm_grad(X[:1], X, G, G, G), ValueError, "dy: expected x's shape"),
])
def test_batch_norm_refuses_bad_input(call, error, match):
    with pytest.raises(error, match=match):
        call()
