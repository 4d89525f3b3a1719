"""The block-sparse convolution's twin (reference/conv.py) against torch's dense convolution with
the layer's dense filter (its blocks added where they sit): forward, both gradients and the
filter's, over 1-3 spatial dims, strides, dilations and padding; its edge-bias groups."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sparseblocks.reference import conv as reference


@st.composite
def layers(draw):
    """(BCK, C, K, geometry, N): a few blocks of channel groups (overlapping, uneven, one channel
    possibly in none), 1-3 spatial dims."""
    dims = draw(st.integers(1, 3))
    C, K = draw(st.integers(1, 6)), draw(st.integers(1, 6))
    BCK = []
    for _ in range(draw(st.integers(1, 3))):
        cs = draw(st.lists(st.integers(0, C - 1), min_size=1, max_size=C, unique=True))
        ks = draw(st.lists(st.integers(0, K - 1), min_size=1, max_size=K, unique=True))
        BCK.append((cs, ks))
    TRS = [draw(st.integers(1, 3)) for _ in range(dims)]
    DHW = [draw(st.integers(3, 7)) for _ in range(dims)]
    strides = [draw(st.integers(1, 2)) for _ in range(dims)]
    dilates = [draw(st.integers(1, 2)) for _ in range(dims)]
    padding = draw(st.sampled_from(["SAME", "VALID", [draw(st.integers(0, 2))] * dims]))
    g = reference.geometry(TRS, DHW, strides=strides, dilates=dilates, padding=padding)
    if min(g["MPQ"]) < 1:
        g = reference.geometry(TRS, DHW, strides=strides, dilates=dilates, padding="SAME")
    return BCK, C, K, g, draw(st.integers(1, 2))


@settings(max_examples=40, deadline=None)
@given(layer=layers(), seed=st.integers(0, 2**16))
def test_twin_matches_torchs_dense_convolution(layer, seed):
    BCK, C, K, g, N = layer
    rng = np.random.default_rng(seed)
    F = [rng.standard_normal((len(ks), len(cs)) + g["TRS"]) for cs, ks in BCK]
    I = rng.standard_normal((N, C) + g["DHW"])
    dO = rng.standard_normal((N, K) + g["MPQ"])
    W = torch.tensor(reference.dense_filter(F, BCK, g, C, K), requires_grad=True)
    x = torch.tensor(I, requires_grad=True)
    y = torch.nn.functional.conv3d(x, W, stride=g["strides"], padding=g["padding"], dilation=g["dilates"])
    assert tuple(y.shape[2:]) == g["MPQ"]
    y.backward(torch.tensor(dO))
    np.testing.assert_allclose(reference.forward(F, I, BCK, g, K), y.detach().numpy(), atol=1e-10)
    np.testing.assert_allclose(reference.input_grad(F, dO, BCK, g, C), x.grad.numpy(), atol=1e-10)
    for (cs, ks), df in zip(BCK, reference.filter_grad(dO, I, BCK, g)):
        np.testing.assert_allclose(df, W.grad.numpy()[np.ix_(ks, cs)], atol=1e-10)


def test_edge_groups_and_bias():
    """A 3x3 SAME filter on a 4x5 image: the 14 border positions fall in 8 groups (4 corners, 4
    sides), the 6 inner ones in none; the bias adds to its group's positions and its gradient
    sums them."""
    g = reference.geometry((3, 3), (4, 5))
    groups = reference.edge_map(g)
    assert len(groups) == 8 and sum(len(p) for p in groups) == 4 * 5 - 2 * 3
    bias = np.arange(2 * 8, dtype=np.float64).reshape(2, 8)
    O = np.zeros((1, 2, 1, 4, 5))
    out = reference.edge_bias(O, bias, g).reshape(2, -1)
    for e, positions in enumerate(groups):
        np.testing.assert_array_equal(out[:, positions], bias[:, e:e + 1] * np.ones(len(positions)))
    np.testing.assert_array_equal(reference.edge_bias_grad(np.ones((3, 2, 1, 4, 5)), g),
                                  3 * np.array([len(p) for p in groups])[None].repeat(2, 0))


def test_deconvolution_sizes():
    """A deconvolution's output is the input a convolution of the same geometry maps to its input."""
    g = reference.geometry((3, 3), (5, 6), strides=2, padding="SAME", deconv=True)
    forward = reference.geometry((3, 3), g["DHW"], strides=2, padding="SAME")
    assert forward["MPQ"] == g["MPQ"] == (1, 5, 6)


@pytest.mark.parametrize("padding, message", [("FULL", "SAME"), ([1, 2, 3], "values")])
def test_bad_padding_raises(padding, message):
    with pytest.raises(ValueError, match=message):
        reference.geometry((3, 3), (5, 5), padding=padding)
