"""The bsmm reference against independent formulations: dense products through `to_dense`."""

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from sparseblocks.reference import bsmm as reference
from strategies import arrays, layouts


def operands(data, layout, dtype=np.float64):
    n = data.draw(st.integers(1, 9), label="N")
    C, K = layout.dense_shape
    x = data.draw(arrays((n, C), dtype), label="x")
    dy = data.draw(arrays((n, K), dtype), label="dy")
    w = data.draw(arrays(layout.w_shape, dtype), label="w")
    return x, dy, w


@pytest.mark.parametrize("feature_axis", [1, 0])
@given(layout=layouts(max_blocks=4), data=st.data())
def test_products_equal_dense_products(layout, data, feature_axis):
    x, dy, w = operands(data, layout)
    W = layout.to_dense(w)
    t = (lambda a: a) if feature_axis == 1 else (lambda a: np.ascontiguousarray(a.T))
    np.testing.assert_allclose(t(reference.forward(t(x), w, layout, feature_axis)), x @ W, atol=1e-12)
    np.testing.assert_allclose(t(reference.input_grad(t(dy), w, layout, feature_axis)), dy @ W.T, atol=1e-12)
    # The weight gradient is the dense xᵀ·dy restricted to the layout's blocks.
    dense_grad = np.where(layout.element_mask(), x.T @ dy, 0.0)
    np.testing.assert_allclose(
        layout.to_dense(reference.weight_grad(t(x), t(dy), layout, feature_axis)), dense_grad, atol=1e-12
    )


@given(layout=layouts(max_blocks=4), data=st.data())
def test_forward_and_input_grad_are_adjoint(layout, data):
    x, dy, w = operands(data, layout)
    lhs = np.sum(reference.forward(x, w, layout) * dy)
    rhs = np.sum(x * reference.input_grad(dy, w, layout))
    assert lhs == pytest.approx(rhs, rel=1e-10, abs=1e-10)
    # ⟨dW, w⟩ = ⟨x·W, dy⟩: the weight gradient is the derivative of that pairing.
    assert np.sum(reference.weight_grad(x, dy, layout) * w) == pytest.approx(lhs, rel=1e-10, abs=1e-10)


def test_upcast_false_keeps_the_dtype():
    from sparseblocks.layout import BlockLayout

    layout = BlockLayout.dense((1, 1), 8)
    x = np.ones((2, 8), np.float32)
    w = np.ones(layout.w_shape, np.float32)
    assert reference.forward(x, w, layout).dtype == np.float64
    assert reference.forward(x, w, layout, upcast=False).dtype == np.float32
    assert reference.weight_grad(x, x, layout, upcast=False).dtype == np.float32
    with pytest.raises(ValueError, match="feature_axis"):
        reference.forward(x, w, layout, feature_axis=2)
