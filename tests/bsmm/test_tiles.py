"""Version 6 (tensor-core tiles, bsmm/tiles.py) against the NumPy reference: every product, both
feature axes, the ring's wrap, split lines and N-splits, the fallback to version 5, block 128."""

from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sparseblocks import bsmm
from sparseblocks.bsmm import tiles
from sparseblocks.layout import BlockLayout
from sparseblocks.runtime import compile as compile_cache
from sparseblocks.runtime.arrays import poisoned_outputs
from sparseblocks.runtime.backend import SIMULATOR
from strategies import arrays, layouts, values
from test_bsmm import assert_products, to_axis

# The simulator meets 32 Python threads at every ldmatrix and mma: one-warp tiles there, k16
# product stages, so that a block of 32 is two stages and the three-buffer ring wraps inside a
# line, and 32-row weight-gradient stages, longer than a block of 16 is wide (its tiles of xᵀ
# and dy then take more shared memory down their rows than across them).
SMALL = dict(v6_tiles={16: (16, 1, 1), 32: (32, 1, 1)}, v6_wgrad_warps={16: (1, 1), 32: (1, 1)},
             v6_k=16, v6_wgrad_k=32, v6_stages=3, v6_wgrad_stages=3)
# On a GPU: the defaults, with block 16's weight gradient (version 5 by default) given version 6 tiles too.
GPU = dict(v6_wgrad_warps={**bsmm.DEFAULT.v6_wgrad_warps, 16: (1, 1)})
CFG = replace(bsmm.DEFAULT, **(SMALL if SIMULATOR else GPU))
few = settings(max_examples=2) if SIMULATOR else settings()
CASES = ([(16, "float16"), (32, "bfloat16")] if SIMULATOR
         else [(bs, dtype) for bs in (16, 32, 64, 128) for dtype in ("float16", "bfloat16")])
MAX_BLOCKS = {16: 3, 32: 2, 64: 3, 128: 2}


def ran_tiles():
    """Which version 6 kernels the compile cache holds: (products, weight gradients)."""
    made = [key[0] for key in compile_cache._kernels]
    return made.count(tiles.make_product_v6), made.count(tiles.make_weight_grad_v6)


@pytest.mark.parametrize("block_size, dtype", CASES)
@few
@given(data=st.data(), feature_axis=st.sampled_from([1, 0]))
def test_tile_products_match_reference(data, block_size, dtype, feature_axis):
    layout = data.draw(layouts(block_sizes=(block_size,), max_blocks=MAX_BLOCKS[block_size],
                               kinds=("random", "full", "single", "skewed")))
    n = data.draw(st.integers(1, 40 if SIMULATOR else 600), label="N")
    n = n if feature_axis == 1 else 8 * -(-n // 8)  # (N along rows: whole chunks of 8, else version 5 runs)
    C, K = layout.dense_shape
    x, dy = data.draw(arrays((n, C), dtype), label="x"), data.draw(arrays((n, K), dtype), label="dy")
    w = data.draw(arrays(layout.w_shape, dtype), label="w")
    xa, dya = to_axis(x, feature_axis), to_axis(dy, feature_axis)
    before = ran_tiles()
    with poisoned_outputs():
        y = bsmm.forward(xa, w, layout, feature_axis, version=6, config=CFG)
        dx = bsmm.input_grad(dya, w, layout, feature_axis, version=6, config=CFG)
        dw = bsmm.weight_grad(xa, dya, layout, feature_axis, version=6, config=CFG)
    assert_products(y, dx, dw, xa, dya, w, layout, feature_axis, dtype)
    if before == (0, 0):
        assert ran_tiles()[0] and (ran_tiles()[1] or not layout.n_blocks), "version 6 did not run"


@pytest.mark.parametrize("max_segment, splits", [(1, 3)] if SIMULATOR else [(1, 3), (2, 2)])
def test_tile_split_lines_and_rows_match_reference(max_segment, splits):
    """Segments of long lines summed in order by the combine pass; N = 100 cut into splits of
    whole 32-row multiples (64 + 36: the second ends inside a stage, zero-filled), and uncut:
    four stages, so that the weight gradient's three-buffer ring wraps."""
    from sparseblocks.reference import bsmm as reference
    from strategies import assert_close

    bs, dtype = 16, "float16"
    layout = BlockLayout(np.array([[1, 1], [1, 0], [1, 1]]), bs)
    rng = np.random.default_rng(5)
    C, K = layout.dense_shape
    x, dy = values(rng, (24, C), dtype), values(rng, (24, K), dtype)
    w = values(rng, layout.w_shape, dtype)
    one = BlockLayout(np.ones((1, 1)), bs)  # (the long weight gradient: one block, the slow part here)
    long_x, long_dy = values(rng, (100, bs), dtype), values(rng, (100, bs), dtype)
    with poisoned_outputs():
        y = bsmm.api._product(CFG, x, w, layout, 1, False, 6, max_segment=max_segment)
        dx = bsmm.api._product(CFG, dy, w, layout, 1, True, 6, max_segment=max_segment)
        dw = bsmm.weight_grad(x, dy, layout, version=6, config=CFG)
        cut = bsmm.weight_grad(long_x, long_dy, one, version=6, splits=splits, config=CFG)
        whole = bsmm.weight_grad(long_x, long_dy, one, version=6, splits=1, config=CFG)
    assert_products(y, dx, dw, x, dy, w, layout, 1, dtype)
    magnitude = reference.weight_grad(np.abs(long_x.astype(np.float64)), np.abs(long_dy.astype(np.float64)), one)
    for got in (cut, whole):
        assert_close(got, reference.weight_grad(long_x, long_dy, one), dtype, "weight_grad",
                     magnitude=magnitude, terms=100)


def test_tiles_fall_back_where_operands_do_not_fit():
    """A misaligned x (or N off whole chunks with feature_axis 0) runs version 5, with the same results."""
    from numba import cuda

    bs, dtype = 16, "float16"
    layout = BlockLayout(np.ones((1, 1)), bs)
    rng = np.random.default_rng(6)
    n = 12
    C, K = layout.dense_shape
    x, dy, w = values(rng, (n, C), dtype), values(rng, (n, K), dtype), values(rng, layout.w_shape, dtype)
    storage = cuda.to_device(np.concatenate([np.zeros(1, x.dtype), x.ravel()]))
    shifted = storage[1:].reshape(x.shape)  # 2 bytes off 16-byte alignment
    compile_cache._kernels.clear()
    w_device = cuda.to_device(w)
    y = bsmm.forward(shifted, w_device, layout, version=6, config=CFG).copy_to_host()
    dw = bsmm.weight_grad(shifted, cuda.to_device(dy), layout, version=6, config=CFG).copy_to_host()
    dx = bsmm.input_grad(to_axis(dy, 0), w, layout, 0, version=6, config=CFG)  # N = 12: not whole chunks of 8
    assert ran_tiles() == (0, 0)
    assert_products(y, to_axis(dx, 0).copy(), dw, x, dy, w, layout, 1, dtype)


def test_tile_weight_grad_accumulates_into_out():
    """out = xᵀ·dy + beta·out (fp16: a Numba device array holds no bf16)."""
    dtype = "float16"
    from numba import cuda

    from sparseblocks.reference import bsmm as reference
    from strategies import assert_close

    layout = BlockLayout(np.array([[1, 0], [1, 1]]), 16)
    rng = np.random.default_rng(7)
    x, dy = values(rng, (24, 32), dtype), values(rng, (24, 32), dtype)
    previous = values(rng, layout.w_shape, dtype)
    out = cuda.to_device(previous)
    bsmm.weight_grad(cuda.to_device(x), cuda.to_device(dy), layout, out=out, beta=0.5, version=6, config=CFG)
    got = out.copy_to_host()
    want = reference.weight_grad(x, dy, layout) + 0.5 * previous.astype(np.float64)
    assert_close(got, want, dtype, "weight_grad with beta")


@pytest.mark.gpu
@pytest.mark.parametrize("block_size", [64, 128])
def test_tile_results_are_bitwise_repeatable(block_size):
    layout = BlockLayout.random((8, 8), 0.4, seed=1, block_size=block_size)
    rng = np.random.default_rng(8)
    n = 1000
    C, K = layout.dense_shape
    x, dy, w = values(rng, (n, C), "float16"), values(rng, (n, K), "float16"), values(rng, layout.w_shape, "float16")
    first = (bsmm.forward(x, w, layout), bsmm.input_grad(dy, w, layout), bsmm.weight_grad(x, dy, layout))
    again = (bsmm.forward(x, w, layout), bsmm.input_grad(dy, w, layout), bsmm.weight_grad(x, dy, layout))
    for a, b in zip(first, again):
        assert np.array_equal(a.view(np.uint16), b.view(np.uint16))


@pytest.mark.parametrize("fields, message", [
    (dict(v6_tiles={32: (96, 4, 1)}), "v6_tiles"),
    (dict(v6_tiles={32: (128, 4, 4)}), "v6_tiles"),
    (dict(v6_k=24), "v6_tiles"),
    (dict(v6_stages=6), "stages"),
    (dict(v6_wgrad_warps={64: (3, 1)}), "v6_wgrad_warps"),
    (dict(v6_tiles={128: (1024, 16, 1)}), "shared memory"),
])
def test_config_refuses_tiles_the_kernels_cannot_take(fields, message):
    from dataclasses import replace

    with pytest.raises(ValueError, match=message):
        replace(bsmm.DEFAULT, **fields)


def test_tiles_that_multiply_nothing_only_move_the_data():
    """``v6_multiply=False`` (the data movement's floor, for `tools/sweep.py --unchecked`): the same
    copies and epilogue, every output zero."""
    rng = np.random.default_rng(4)
    layout = BlockLayout(np.array([[1, 0], [1, 1]]), 16)
    x = values(rng, (24, 32), "float16")
    w = values(rng, layout.w_shape, "float16")
    floor = replace(CFG, v6_multiply=False)
    assert np.abs(np.asarray(bsmm.forward(x, w, layout, version=6, config=CFG), np.float64)).max() > 0
    assert not np.asarray(bsmm.forward(x, w, layout, version=6, config=floor), np.float64).any()
    assert not np.asarray(bsmm.weight_grad(x, x, layout, version=6, config=floor), np.float64).any()
