"""BlockLayout: derived indices agree with the mask, conversions round-trip, bad input is refused."""

import pickle

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from sparseblocks import bsmm
from sparseblocks.layout import BLOCK_SIZES, BlockLayout
from strategies import arrays, layouts


@given(layouts(max_blocks=6))
def test_indices_describe_the_mask(layout):
    mask = layout.mask
    assert layout.n_blocks == mask.sum() == len(layout.coords)
    for array in (layout.coords, layout.row_ptr, layout.col_idx, layout.col_ptr,
                  layout.row_idx, layout.col_block):
        assert array.dtype == np.int32 and not array.flags.writeable
    # Block numbering is row-major: coords are np.nonzero(mask) in C order.
    assert np.array_equal(layout.coords, np.argwhere(mask))
    for c in range(mask.shape[0]):
        blocks = range(layout.row_ptr[c], layout.row_ptr[c + 1])
        assert [tuple(layout.coords[b]) for b in blocks] == [(c, k) for k in np.flatnonzero(mask[c])]
        assert list(layout.col_idx[list(blocks)]) == list(np.flatnonzero(mask[c]))
    for k in range(mask.shape[1]):
        entries = range(layout.col_ptr[k], layout.col_ptr[k + 1])
        assert list(layout.row_idx[list(entries)]) == list(np.flatnonzero(mask[:, k]))
        for j in entries:
            assert tuple(layout.coords[layout.col_block[j]]) == (layout.row_idx[j], k)
    assert sorted(layout.col_block) == list(range(layout.n_blocks))


@given(layouts(max_blocks=4), st.data())
def test_dense_round_trip(layout, data):
    w = data.draw(arrays(layout.w_shape, np.float64))
    W = layout.to_dense(w)
    assert W.shape == layout.dense_shape
    assert np.array_equal(layout.from_dense(W), w)
    assert not W[~layout.element_mask()].any()
    for b in range(layout.n_blocks):
        c, k = layout.block_coord(b)
        bs = layout.block_size
        assert np.array_equal(W[c * bs:(c + 1) * bs, k * bs:(k + 1) * bs], w[b])


@given(st.integers(1, 8), st.integers(1, 8), st.floats(0, 1), st.integers(0, 100))
def test_random_has_exact_block_count(cb, kb, density, seed):
    layout = BlockLayout.random((cb, kb), density, seed=seed, block_size=8)
    assert layout.n_blocks == round(density * cb * kb)
    assert layout == BlockLayout.random((cb, kb), density, seed=seed, block_size=8)


def test_constructors_and_properties():
    dense = BlockLayout.dense((2, 3), block_size=16)
    assert dense.n_blocks == 6 and dense.density == 1.0
    assert dense.shape == (2, 3) and dense.dense_shape == (32, 48) and dense.w_shape == (6, 16, 16)
    element_mask = np.zeros((32, 48), bool)
    element_mask[17, 40] = True
    from_mask = BlockLayout.from_mask(element_mask, block_size=16)
    assert from_mask.n_blocks == 1 and from_mask.block_coord(0) == (1, 2)
    assert "n_blocks=1" in repr(from_mask)
    assert BlockLayout.random((4, 4), 0.0).n_blocks == 0


def test_equality_hashing_pickling():
    mask = np.eye(3, dtype=int)
    a, b = BlockLayout(mask, 8), BlockLayout(mask.astype(bool), 8)
    assert a == b and hash(a) == hash(b) and len({a, b}) == 1
    assert a != BlockLayout(mask, 16)
    assert a != BlockLayout(1 - mask, 8)
    assert pickle.loads(pickle.dumps(a)) == a
    with pytest.raises(AttributeError):
        a.block_size = 16
    with pytest.raises(ValueError):
        a.mask[0, 0] = False


@pytest.mark.parametrize("mask, block_size, error, message", [
    (np.ones(3), 8, ValueError, "2-D"),
    (np.ones((2, 2, 2)), 8, ValueError, "2-D"),
    (np.ones((0, 3)), 8, ValueError, "non-empty"),
    (np.array([[0, 2]]), 8, ValueError, "0 and 1"),
    (np.array([[0.5, 1]]), 8, ValueError, "0 and 1"),
    (np.array([["a", "b"]]), 8, ValueError, "0 and 1"),
    (np.ones((2, 2)), 12, ValueError, "block_size"),
    (np.ones((2, 2)), 8.0, TypeError, "block_size"),
    (np.ones((2, 2)), True, TypeError, "block_size"),
])
def test_bad_input_is_refused(mask, block_size, error, message):
    with pytest.raises(error, match=message):
        BlockLayout(mask, block_size)


def test_int32_overflow_is_refused():
    with pytest.raises(ValueError, match="int32"):
        BlockLayout(np.ones((1, 2**31 // 64 + 1), bool), 64)
    # 1024 x 1024 blocks of 64 would need 2**32 stored weights: the layout is made (attention
    # takes it), its weights' shape refused, and so every op on weights.
    layout = BlockLayout(np.ones((1024, 1024), bool), 64)
    with pytest.raises(ValueError, match="int32"):
        layout.w_shape
    with pytest.raises(ValueError, match="int32"):
        bsmm.forward(np.zeros((1, 1024 * 64), np.float32), np.zeros((1, 64, 64), np.float32), layout)


def test_bad_helper_arguments():
    layout = BlockLayout.dense((2, 2), 8)
    with pytest.raises(ValueError, match="density"):
        BlockLayout.random((2, 2), 1.5)
    with pytest.raises(ValueError, match="shape"):
        BlockLayout.random((0, 2), 0.5)
    with pytest.raises(ValueError, match="w: expected shape"):
        layout.to_dense(np.zeros((3, 8, 8)))
    with pytest.raises(ValueError, match="W: expected shape"):
        layout.from_dense(np.zeros((16, 8)))
    with pytest.raises(IndexError):
        layout.block_coord(4)
    with pytest.raises(ValueError, match="multiple"):
        BlockLayout.from_mask(np.ones((10, 16)), 8)
    assert set(BLOCK_SIZES) == {8, 16, 32, 64, 128}


# -- builders -----------------------------------------------------------------------


@given(cb=st.integers(1, 9), kb=st.integers(1, 9), data=st.data())
def test_random_takes_an_exact_block_count(cb, kb, data):
    n = data.draw(st.integers(0, cb * kb))
    assert BlockLayout.random((cb, kb), n_blocks=n, seed=data.draw(st.integers(0, 9))).n_blocks == n


@given(cb=st.integers(1, 9), kb=st.integers(1, 9), lower=st.integers(0, 4), upper=st.integers(0, 4))
def test_banded_is_the_band(cb, kb, lower, upper):
    mask = BlockLayout.banded((cb, kb), lower, upper, block_size=8).mask
    for c in range(cb):
        for k in range(kb):
            assert mask[c, k] == (-lower <= k - c <= upper)


@given(n=st.integers(1, 24), stride=st.integers(1, 8), causal=st.booleans(), summary=st.integers(1, 8))
def test_the_sparse_transformer_patterns_follow_their_definitions(n, stride, causal, summary):
    summary = min(summary, stride)
    strided = BlockLayout.strided(n, stride, causal=causal).mask
    fixed = BlockLayout.fixed(n, stride, summary, causal=causal).mask
    for i in range(n):
        for j in range(n):
            d = i - j if causal else abs(i - j)
            assert strided[i, j] == (d >= 0 and (d < stride or d % stride == 0))
            seen = i // stride == j // stride or j % stride >= stride - summary
            assert fixed[i, j] == (seen and (j <= i or not causal))
    assert strided.diagonal().all() and fixed.diagonal().all()  # every query sees itself
    assert np.array_equal(BlockLayout.causal(n).mask, np.tril(np.ones((n, n), bool)))


@given(data=st.data(), criterion=st.sampled_from(["l2", "l1", "max"]))
def test_from_weights_keeps_the_largest_blocks(data, criterion):
    cb, kb = data.draw(st.integers(1, 5)), data.draw(st.integers(1, 5))
    W = np.random.default_rng(data.draw(st.integers(0, 99))).standard_normal((8 * cb, 8 * kb))
    n = data.draw(st.integers(0, cb * kb))
    layout = BlockLayout.from_weights(W, 8, n_blocks=n, criterion=criterion)
    tiles = np.abs(W.reshape(cb, 8, kb, 8))
    norm = {"l2": np.sqrt((tiles ** 2).sum(axis=(1, 3))), "l1": tiles.sum(axis=(1, 3)), "max": tiles.max(axis=(1, 3))}
    kept, dropped = norm[criterion][layout.mask], norm[criterion][~layout.mask]
    assert layout.n_blocks == n and (not kept.size or not dropped.size or kept.min() >= dropped.max())


@pytest.mark.parametrize("call, match", [
    (lambda: BlockLayout.random((2, 2)), "one of density and n_blocks"),
    (lambda: BlockLayout.random((2, 2), 0.5, n_blocks=1), "one of density and n_blocks"),
    (lambda: BlockLayout.random((2, 2), n_blocks=5), "n_blocks: expected an int from 0 to 4"),
    (lambda: BlockLayout.banded((2, 2), -1), "lower: expected an int of at least 0"),
    (lambda: BlockLayout.strided(4, 0), "stride: expected an int of at least 1"),
    (lambda: BlockLayout.fixed(4, 2, summary=3), "summary: expected at most stride"),
    (lambda: BlockLayout.causal(0), "n: expected an int of at least 1"),
    (lambda: BlockLayout.from_weights(np.ones((8, 12)), 8, 0.5), "sides multiples of block_size 8"),
    (lambda: BlockLayout.from_weights(np.ones((8, 8)), 8, 0.5, criterion="l3"), "criterion: expected one of"),
])
def test_builders_refuse_bad_arguments(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_plot_and_show_layout_write_pictures(tmp_path):
    pytest.importorskip("matplotlib")
    from sparseblocks.__main__ import main

    layout = BlockLayout.random((6, 5), 0.5, block_size=8)
    path = layout.plot(tmp_path / "a.png", w=np.ones(layout.w_shape))
    assert path.read_bytes()[:4] == b"\x89PNG"
    assert main(["show-layout", "strided:12:3", str(tmp_path / "b.png")]) == 0
    assert (tmp_path / "b.png").read_bytes()[:4] == b"\x89PNG"
    with pytest.raises(SystemExit, match="unknown layout"):
        main(["show-layout", "spiral:3"])


@given(n=st.integers(1, 16), g=st.integers(0, 4), window=st.integers(0, 3), causal=st.booleans())
def test_global_window_follows_its_definition(n, g, window, causal):
    mask = BlockLayout.global_window(n, g, window, causal=causal).mask
    for i in range(n):
        for j in range(n):
            seen = abs(i - j) <= window or i < g or j < g
            assert mask[i, j] == (seen and (j <= i or not causal))


@given(lengths=st.lists(st.integers(1, 4), min_size=1, max_size=5), causal=st.booleans())
def test_documents_see_only_themselves(lengths, causal):
    mask = BlockLayout.documents(lengths, causal=causal).mask
    document = np.repeat(np.arange(len(lengths)), lengths)
    for i in range(len(document)):
        for j in range(len(document)):
            assert mask[i, j] == (document[i] == document[j] and (j <= i or not causal))
    with pytest.raises(ValueError, match=r"lengths\[1\]: expected an int of at least 1"):
        BlockLayout.documents([2, 0])
