"""BlocksparseMatMul: OpenAI blocksparse's interface over the bsmm kernels."""

import numpy as np
import pytest

from sparseblocks import BlockLayout, BlocksparseMatMul
from sparseblocks.reference import bsmm as reference
from strategies import assert_close


def test_shapes_and_sizes_follow_openai():
    mask = np.array([[1, 0, 1], [0, 1, 0]])
    bsmm = BlocksparseMatMul(mask, block_size=16, feature_axis=1)
    assert bsmm.w_shape == (3, 16, 16) and bsmm.blocks == 3
    assert (bsmm.C, bsmm.K) == (32, 48)
    assert bsmm.i_shape(5) == (5, 32) and bsmm.o_shape(5) == (5, 48)
    assert BlocksparseMatMul(mask, 16, feature_axis=0).i_shape(5) == (32, 5)
    assert bsmm.sparsity == 0.5  # fraction of blocks present, as OpenAI reports it
    assert bsmm.block_coord(2) == (1, 1)
    assert bsmm.flops(10) == 2 * 10 * 3 * 16 * 16
    assert "BlocksparseMatMul" in repr(bsmm)


@pytest.mark.parametrize("feature_axis", [1, 0])
def test_products_through_the_class(feature_axis):
    layout = BlockLayout.random((2, 3), 0.5, seed=4, block_size=8)
    bsmm = BlocksparseMatMul(layout, feature_axis=feature_axis)
    rng = np.random.default_rng(0)
    x = rng.standard_normal(bsmm.i_shape(7)).astype(np.float32)
    dy = rng.standard_normal(bsmm.o_shape(7)).astype(np.float32)
    w = rng.standard_normal(bsmm.w_shape).astype(np.float32)
    assert_close(bsmm(x, w), reference.forward(x, w, layout, feature_axis), "float32")
    assert_close(bsmm.input_grad(dy, w), reference.input_grad(dy, w, layout, feature_axis), "float32")
    assert_close(bsmm.weight_grad(x, dy), reference.weight_grad(x, dy, layout, feature_axis), "float32")


def test_initialisers():
    layout = BlockLayout(np.array([[1, 1], [0, 1], [1, 1]]), 8)
    bsmm = BlocksparseMatMul(layout)
    identity = layout.to_dense(bsmm.identity_init(scale=2.0))
    np.testing.assert_array_equal(identity[:16, :16], 2 * np.eye(16))
    assert not identity[16:].any()
    W = layout.to_dense(bsmm.ortho_init(seed=1).astype(np.float64))
    for k in range(layout.shape[1]):
        column = W[:, k * 8:(k + 1) * 8]
        np.testing.assert_allclose(column.T @ column, np.eye(8), atol=1e-5)


def test_bad_arguments():
    layout = BlockLayout.dense((2, 2), 8)
    with pytest.raises(ValueError, match="block_size"):
        BlocksparseMatMul(layout, block_size=16)
    with pytest.raises(ValueError, match="feature_axis"):
        BlocksparseMatMul(layout, feature_axis=-1)
    with pytest.raises(ValueError, match="version"):
        BlocksparseMatMul(layout, version=0)
