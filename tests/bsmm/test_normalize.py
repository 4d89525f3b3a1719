"""Initialization and normalization on the device (bsmm/normalize.py) against the NumPy twins:
identity_init, ortho_init, l2_normalize and its gradient, with and without a gain, and errors."""

import numpy as np
import pytest

from sparseblocks import bsmm
from sparseblocks.bsmm.openai import BlocksparseMatMul
from sparseblocks.layout import BlockLayout
from sparseblocks.reference import bsmm as reference

LAYOUT = BlockLayout(np.array([[1, 0, 1], [1, 1, 0], [0, 0, 0]]), 8)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_identity_init_is_the_host_ones(dtype):
    like = np.zeros(LAYOUT.w_shape, dtype)
    got = bsmm.identity_init(LAYOUT, like, scale=0.5)
    np.testing.assert_array_equal(got, BlocksparseMatMul(LAYOUT, 8).identity_init(0.5, dtype))


@pytest.mark.parametrize("dtype, tol", [(np.float32, 1e-5), (np.float16, 2e-3), (np.float64, 1e-5)])
def test_ortho_init_gives_orthonormal_block_columns_as_the_twin(dtype, tol):
    """Each block-column's stacked blocks have orthonormal columns (times scale): the twin's Q of
    the same Gaussians; block-column 2 has no blocks. One result a seed, another for another."""
    like = np.zeros(LAYOUT.w_shape, dtype)
    got = bsmm.ortho_init(LAYOUT, like, seed=7, scale=2.0)
    assert got.dtype == dtype
    np.testing.assert_allclose(got, reference.ortho_init(LAYOUT, 7, 2.0), rtol=tol, atol=tol)
    for k in range(LAYOUT.shape[1]):
        blocks = LAYOUT.col_block[LAYOUT.col_ptr[k]:LAYOUT.col_ptr[k + 1]]
        if len(blocks):
            stack = got[blocks].reshape(-1, 8).astype(np.float64) / 2
            np.testing.assert_allclose(stack.T @ stack, np.eye(8), atol=4 * tol)
    np.testing.assert_array_equal(bsmm.ortho_init(LAYOUT, like, seed=7, scale=2.0), got)
    assert not np.allclose(bsmm.ortho_init(LAYOUT, like, seed=8, scale=2.0), got)
    np.testing.assert_array_equal(BlocksparseMatMul(LAYOUT, 8).ortho_init(7, dtype), bsmm.ortho_init(LAYOUT, like, 7))


@pytest.mark.parametrize("with_gain", [False, True])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_l2_normalize_and_its_gradient_match_the_twin(with_gain, dtype):
    rng = np.random.default_rng(2)
    w = rng.standard_normal(LAYOUT.w_shape).astype(dtype)
    w[0, :, 3] = 0  # a column with no norm in this block (others still hold some)
    gain = rng.uniform(0.5, 2, LAYOUT.dense_shape[1]).astype(dtype) if with_gain else None
    tol = 1e-5 if dtype == np.float32 else 1e-12
    got = bsmm.l2_normalize(w, LAYOUT, gain)
    np.testing.assert_allclose(got, reference.l2_normalize(w, LAYOUT, gain), rtol=tol, atol=tol)
    dy = rng.standard_normal(LAYOUT.w_shape).astype(dtype)
    dw, dg = bsmm.l2_normalize_grad(dy, w, LAYOUT, gain)
    want_dw, want_dg = reference.l2_normalize_grad(dy, w, LAYOUT, gain)
    np.testing.assert_allclose(dw, want_dw, rtol=10 * tol, atol=10 * tol)
    if with_gain:
        np.testing.assert_allclose(dg, want_dg, rtol=10 * tol, atol=10 * tol)
    else:
        assert dg is None


def test_a_column_of_zeros_stays_zero_and_finite():
    w = np.zeros(LAYOUT.w_shape, np.float32)
    assert np.array_equal(bsmm.l2_normalize(w, LAYOUT), w)
    dw, _ = bsmm.l2_normalize_grad(np.ones_like(w), w, LAYOUT, epsilon=1e-6)
    np.testing.assert_allclose(dw, 1e3, rtol=1e-5)  # g·r·dy with r = 1/sqrt(epsilon)


@pytest.mark.parametrize("call, error, match", [
    (lambda: bsmm.l2_normalize(np.ones((2, 8, 8), np.float32), LAYOUT), ValueError, r"w: expected shape \(4, 8, 8\)"),
    (lambda: bsmm.l2_normalize(np.ones(LAYOUT.w_shape, np.float32), LAYOUT, np.ones(5, np.float32)), ValueError,
     r"gain: expected shape \(24,\)"),
    (lambda: bsmm.l2_normalize(np.ones(LAYOUT.w_shape, np.float32), LAYOUT, epsilon=0), ValueError, "epsilon"),
    (lambda: bsmm.identity_init(LAYOUT, np.ones((1, 8, 8), np.float32)), ValueError, "like: expected shape"),
    (lambda: bsmm.ortho_init(LAYOUT, np.ones((1, 8, 8), np.float32)), ValueError, "like: expected shape"),
    (lambda: bsmm.ortho_init(LAYOUT, np.ones(LAYOUT.w_shape, np.float32), seed=-1), ValueError, "seed: expected"),
    (lambda: bsmm.ortho_init(LAYOUT, np.ones(LAYOUT.w_shape, np.float32), scale="big"), TypeError, "scale: expected"),
])
def test_bad_input_is_refused(call, error, match):
    with pytest.raises(error, match=match):
        call()
