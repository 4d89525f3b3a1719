"""The SBNet reference against independent formulations: pooling by strided windows,
element-by-element loops, and sparse convolution equal to dense convolution."""

import numpy as np
import pytest
from hypothesis import assume, given
from hypothesis import strategies as st
from numpy.lib.stride_tricks import sliding_window_view

from sparseblocks.reference import sbnet as reference
from strategies import block_grid, block_indices, geometries, images

# -- independent formulations ---------------------------------------------------


def pooled_by_windows(mask, bsize, bstride, boffset, bcount, avgpool):
    """Pool every window at once: pad the mask so each window is whole, then stride over it."""
    N, H, W = mask.shape
    if 0 in bcount:
        return np.zeros((N, *bcount))
    lo = [min(0, o) for o in boffset]
    hi = [max(s, o + (c - 1) * st + b) for s, o, c, st, b in zip((H, W), boffset, bcount, bstride, bsize)]
    fill = 0.0 if avgpool else -np.inf
    padded = np.full((N, hi[0] - lo[0], hi[1] - lo[1]), fill)
    padded[:, -lo[0]:-lo[0] + H, -lo[1]:-lo[1] + W] = mask
    start = [o - l for o, l in zip(boffset, lo)]
    windows = sliding_window_view(padded[:, start[0]:, start[1]:], bsize, axis=(1, 2))
    windows = windows[:, ::bstride[0], ::bstride[1]][:, :bcount[0], :bcount[1]]
    return windows.sum(axis=(3, 4)) / (bsize[0] * bsize[1]) if avgpool else windows.max(axis=(3, 4))


def gather_by_elements(x, indices, bsize, bstride, boffset):
    N, H, W, C = x.shape
    out = np.zeros((len(indices), bsize[0], bsize[1], C), x.dtype)
    for i, (n, bh, bw) in enumerate(indices):
        for r in range(bsize[0]):
            for s in range(bsize[1]):
                h, w = boffset[0] + bh * bstride[0] + r, boffset[1] + bw * bstride[1] + s
                if 0 <= n < N and 0 <= h < H and 0 <= w < W:
                    out[i, r, s] = x[n, h, w]
    return out


def scatter_by_elements(blocks, indices, y, bsize, bstride, boffset, add):
    out = y.copy()
    N, H, W, C = y.shape
    for i, (n, bh, bw) in enumerate(indices):
        for r in range(bsize[0]):
            for s in range(bsize[1]):
                h, w = boffset[0] + bh * bstride[0] + r, boffset[1] + bw * bstride[1] + s
                if 0 <= n < N and 0 <= h < H and 0 <= w < W:
                    out[n, h, w] = out[n, h, w] + blocks[i, r, s] if add else blocks[i, r, s]
    return out


def conv2d(x, w, stride, padding):
    """Dense NHWC convolution (cross-correlation), TensorFlow's padding."""
    kh, kw = w.shape[:2]
    top, bottom, left, right = reference.conv_padding(x.shape[1:3], (kh, kw), stride, padding)
    xp = np.pad(x, ((0, 0), (top, bottom), (left, right), (0, 0)))
    windows = sliding_window_view(xp, (kh, kw), axis=(1, 2))[:, ::stride[0], ::stride[1]]
    return np.einsum("nhwcij,ijck->nhwk", windows, w)


# -- strategies ------------------------------------------------------------------

geometry = geometries()


# -- tests -----------------------------------------------------------------------


@pytest.mark.parametrize("avgpool", [False, True])
@given(image=images(channels=False), g=geometry, tol=st.sampled_from([0.0, 0.1, 0.5]))
def test_reduce_mask_equals_window_pooling(image, g, tol, avgpool):
    _, mask = image
    mask = np.abs(mask)
    bcount = reference.block_count(mask.shape[1:], g["bstride"], g["boffset"])
    want = np.argwhere(pooled_by_windows(mask, g["bsize"], g["bstride"], g["boffset"], bcount, avgpool) > tol)
    got = reference.reduce_mask(mask, tol=tol, avgpool=avgpool, **g)
    assert got.dtype == np.int32 and got.shape[1] == 3
    assert np.array_equal(got, want)  # row-major order


def test_reduce_mask_of_empty_mask_gives_no_blocks():
    indices = reference.reduce_mask(np.zeros((2, 8, 8)), bsize=4, bstride=4)
    assert indices.shape == (0, 3) and indices.dtype == np.int32


@pytest.mark.parametrize("transpose", [False, True])
@given(image=images(), g=geometry)
def test_gather_equals_element_loop(image, g, transpose):
    rng, x = image
    indices = block_indices(rng, x.shape, g)
    want = gather_by_elements(x, indices, g["bsize"], g["bstride"], g["boffset"])
    got = reference.sparse_gather(x, indices, transpose=transpose, **g)
    assert np.array_equal(got, want.transpose(0, 3, 1, 2) if transpose else want)


@pytest.mark.parametrize("add", [False, True])
@given(image=images(), g=geometry)
def test_scatter_equals_element_loop(image, g, add):
    rng, y = image
    indices = block_indices(rng, y.shape, g)
    blocks = rng.standard_normal((len(indices), *g["bsize"], y.shape[3]))
    want = scatter_by_elements(blocks, indices, y, g["bsize"], g["bstride"], g["boffset"], add)
    got = reference.sparse_scatter(blocks, indices, y, add=add, **g)
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)
    transposed = reference.sparse_scatter(blocks.transpose(0, 3, 1, 2), indices, y, add=add, transpose=True, **g)
    np.testing.assert_array_equal(transposed, got)
    before = y.copy()
    inplace = reference.sparse_scatter(blocks, indices, y, add=add, inplace=True, **g)
    assert inplace is y and np.array_equal(y, got)
    assert not np.array_equal(before, y) or np.array_equal(before, got)


@given(image=images(), g=geometry, transpose=st.booleans())
def test_nchw_is_nhwc_with_the_other_block_layout(image, g, transpose):
    rng, x = image
    indices = block_indices(rng, x.shape, g)
    nchw = np.ascontiguousarray(x.transpose(0, 3, 1, 2))
    blocks = reference.sparse_gather(nchw, indices, transpose=transpose, data_format="NCHW", **g)
    np.testing.assert_array_equal(blocks, reference.sparse_gather(x, indices, transpose=not transpose, **g))
    back = reference.sparse_scatter(blocks, indices, np.zeros_like(nchw), add=True, transpose=transpose,
                                    data_format="NCHW", **g)
    want = reference.sparse_scatter(blocks, indices, np.zeros_like(x), add=True, transpose=not transpose, **g)
    np.testing.assert_array_equal(back, want.transpose(0, 3, 1, 2))


@given(image=images(), g=geometry)
def test_gather_and_scatter_add_are_adjoint(image, g):
    rng, x = image
    indices = block_indices(rng, x.shape, g)
    b = rng.standard_normal((len(indices), *g["bsize"], x.shape[3]))
    lhs = np.sum(reference.sparse_gather(x, indices, **g) * b)
    rhs = np.sum(x * reference.sparse_scatter(b, indices, np.zeros_like(x), add=True, **g))
    assert lhs == pytest.approx(rhs, rel=1e-10, abs=1e-10)


@given(image=images(), g=geometry)
def test_gather_then_scatter_restores_non_overlapping_blocks(image, g):
    _, x = image
    assume(all(st >= b for st, b in zip(g["bstride"], g["bsize"])))
    indices = block_grid(x.shape, g)
    blocks = reference.sparse_gather(x, indices, **g)
    poisoned = np.full_like(x, np.nan)
    restored = reference.sparse_scatter(blocks, indices, poisoned, **g)
    covered = ~np.isnan(restored)
    np.testing.assert_array_equal(restored[covered], x[covered])
    if g["bstride"] == g["bsize"] and g["boffset"] == (0, 0):
        assert covered.all()


@pytest.mark.parametrize("padding", ["SAME", "VALID"])
@pytest.mark.parametrize("ksize, stride, bsize", [(1, 1, 4), (3, 1, 5), (3, 1, 7), (3, 2, 7), (5, 1, 6)])
def test_block_params_make_sparse_convolution_equal_dense(ksize, stride, bsize, padding):
    """gather → VALID conv → scatter over the geometry equals the dense convolution on active blocks."""
    rng = np.random.default_rng(ksize * 100 + bsize)
    x = rng.standard_normal((2, 13, 11, 3))
    w = rng.standard_normal((ksize, ksize, 3, 2))
    dense = conv2d(x, w, (stride, stride), padding)
    p = reference.calc_block_params(x.shape, bsize, ksize, stride, padding)
    mask = rng.random(x.shape[:3]) < 0.15
    indices = reference.reduce_mask(mask, p.bsize, p.bstride, p.boffset, tol=0.5, bcount=p.bcount)
    all_indices = reference.reduce_mask(np.ones(x.shape[:3]), p.bsize, p.bstride, p.boffset, bcount=p.bcount)
    for chosen in (indices, all_indices):
        blocks = reference.sparse_gather(x, chosen, p.bsize, p.bstride, p.boffset)
        convolved = conv2d(blocks, w, (stride, stride), "VALID")
        assert convolved.shape[1:3] == p.bsize_out
        base = np.full(dense.shape, np.nan)
        sparse = reference.sparse_scatter(convolved, chosen, base, p.bsize_out, p.bsize_out, 0)
        written = ~np.isnan(sparse)
        np.testing.assert_allclose(sparse[written], dense[written], rtol=1e-12, atol=1e-12)
    assert written.all(), "all blocks together cover the whole output"


def test_block_params_match_sbnet():
    p = reference.calc_block_params((1, 5, 5, 1), (3, 3), (3, 3), (1, 1), "SAME")
    assert p == reference.BlockParams(bsize=(3, 3), bsize_out=(1, 1), boffset=(-1, -1),
                                      bcount=(5, 5), bstride=(1, 1))
    mask = np.zeros((1, 5, 5))
    mask[0, 1, 2] = mask[0, 2, 0] = 1
    indices = reference.reduce_mask(mask, p.bsize, p.bstride, p.boffset, tol=0.1, bcount=p.bcount)
    active = np.zeros((5, 5), int)
    active[indices[:, 1], indices[:, 2]] = 1
    # SBNet's own example: the 3x3 neighbourhoods of the two set pixels.
    assert active.tolist() == [[0, 1, 1, 1, 0], [1, 1, 1, 1, 0], [1, 1, 1, 1, 0], [1, 1, 0, 0, 0], [0, 0, 0, 0, 0]]
    res = reference.calc_block_params_res_block((1, 400, 700, 64), 13, [1, 3, 1], 1, "SAME")
    assert res == reference.calc_block_params((1, 400, 700, 64), 13, 3, 1, "SAME")
    assert res.bsize_out == (11, 11) and res.boffset == (-1, -1)


@pytest.mark.parametrize("call, message", [
    (lambda: reference.reduce_mask(np.ones((4, 4)), 2, 2), "mask"),
    (lambda: reference.reduce_mask(np.ones((1, 4, 4)), 0, 2), "bsize"),
    (lambda: reference.reduce_mask(np.ones((1, 4, 4)), 2, (1, 0)), "bstride"),
    (lambda: reference.reduce_mask(np.ones((1, 4, 4)), 2.5, 2), "bsize"),
    (lambda: reference.sparse_gather(np.ones((4, 4, 1)), np.zeros((1, 3)), 2, 2), "x"),
    (lambda: reference.sparse_gather(np.ones((1, 4, 4, 1)), np.zeros((1, 2)), 2, 2), "indices"),
    (lambda: reference.sparse_scatter(np.ones((2, 2, 2, 1)), np.zeros((1, 3)), np.ones((1, 4, 4, 1)), 2, 2),
     "blocks"),
    (lambda: reference.sparse_scatter(np.ones((1, 2, 2, 3)), np.zeros((1, 3)), np.ones((1, 4, 4, 1)), 2, 2),
     "blocks"),
    (lambda: reference.calc_block_params((8, 8), 4, 3, 2, "SAME"), "strides"),
    (lambda: reference.calc_block_params((8, 8), 2, 3, 1, "SAME"), "bsize"),
    (lambda: reference.calc_block_params((8, 8), 4, 3, 1, "FULL"), "padding"),
])
def test_bad_arguments_are_refused(call, message):
    with pytest.raises((ValueError, TypeError), match=message):
        call()
