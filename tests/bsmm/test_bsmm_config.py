"""The matmul's config: every switch gives the reference's products, and configs key the caches."""

from dataclasses import replace

import numpy as np
import pytest

from sparseblocks import BlockLayout, bsmm
from sparseblocks.reference import bsmm as reference
from sparseblocks.runtime import compile as compile_cache
from sparseblocks.runtime.backend import SIMULATOR
from sparseblocks.runtime.tuning import Table
from strategies import assert_close

SWITCHES = [  # (field, value, version, dtype): the variant a switch selects, beside the default's kernel
    ("v4_vector", False, 4, "float32"),
    ("v4_layout", {16: "swizzle", 32: "swizzle", 64: "swizzle"}, 4, "float32"),
    ("v4_unroll", {16: False, 32: False, 64: False}, 4, "float32"),
    ("v5_vector", False, 5, "float16"),
    ("v5_wgrad_async", False, 5, "float32"),
    ("v5_wgrad", False, 5, "float16"),
    ("tensor_core_default", frozenset(), None, "float32"),
]


@pytest.mark.parametrize("field, value, version, dtype", SWITCHES)
def test_each_switch_gives_the_reference_products(field, value, version, dtype):
    config = replace(bsmm.DEFAULT, **{field: value})
    layout = BlockLayout(np.array([[1, 0], [1, 1]], bool), 16)
    rng = np.random.default_rng(7)
    x = rng.standard_normal((9 if SIMULATOR else 300, 32)).astype(dtype)
    dy = rng.standard_normal((len(x), 32)).astype(dtype)
    w = rng.standard_normal(layout.w_shape).astype(dtype)
    y = bsmm.forward(x, w, layout, version=version, config=config)
    dx = bsmm.input_grad(dy, w, layout, version=version, config=config)
    dw = bsmm.weight_grad(x, dy, layout, version=version, config=config)
    assert_close(y, reference.forward(x, w, layout), dtype, "forward")
    assert_close(dx, reference.input_grad(dy, w, layout), dtype, "input_grad")
    assert_close(dw, reference.weight_grad(x, dy, layout), dtype, "weight_grad")


def test_configs_are_frozen_hashable_and_checked():
    config = replace(bsmm.DEFAULT, v5_stages=4, v5_warps={16: 2, 32: 4, 64: 8})
    assert isinstance(config.v5_warps, Table) and hash(config) == hash(replace(config))
    assert config != bsmm.DEFAULT and bsmm.DEFAULT.v5_stages == 3
    with pytest.raises(TypeError):
        config.v5_warps[16] = 8
    with pytest.raises(ValueError, match="v5_stages"):
        replace(bsmm.DEFAULT, v5_stages=7)
    with pytest.raises(ValueError, match="v5_wgrad_warps"):  # (a block's patches split evenly among its warps)
        replace(bsmm.DEFAULT, v5_wgrad_warps=3)
    with pytest.raises(TypeError, match="config"):
        bsmm.forward(np.zeros((1, 16), np.float32), np.zeros((1, 16, 16), np.float32),
                     BlockLayout.dense((1, 1), 16), config={"v5_stages": 2})


def test_a_config_compiles_its_own_kernels():
    """A kernel made under one config is never handed out under another."""
    layout = BlockLayout.dense((1, 1), 8)
    x = np.ones((3, 8), np.float32)
    w = np.ones(layout.w_shape, np.float32)
    bsmm.forward(x, w, layout, version=1)
    other = replace(bsmm.DEFAULT, rows_per_tile={8: 8, 16: 16, 32: 8, 64: 4})
    y = bsmm.forward(x, w, layout, version=1, config=other)
    np.testing.assert_array_equal(y, np.full((3, 8), 8, np.float32))
    made = {key[1] for key in compile_cache._kernels if key[0] is bsmm.simple.make_product_v1}
    assert {bsmm.DEFAULT, other} <= made


def test_short_lines_take_their_own_version_7_tiles():
    """``v7_short_lines``: a product whose output lines sum few blocks on average runs on the
    rule's fields (a table's entry for its block size, a scalar itself); longer lines, other block
    sizes and no rule keep the config."""
    from sparseblocks.bsmm.dispatch import v7_config

    cfg = replace(bsmm.DEFAULT, v7_short_lines={128: {"mean_blocks": 2.0, "v7_tiles": 1, "v7_stages": 3}})
    mask = np.zeros((8, 4), bool)
    mask[:3, 0] = mask[0, 1:] = True  # 6 blocks: 1.5 a column (forward), 0.75 a row (input_grad)
    short = v7_config(cfg, BlockLayout(mask, 128), transpose_w=False)
    assert (short.v7_tiles[128], short.v7_stages[128], short.v7_tiles[64]) == (1, 3, cfg.v7_tiles[64])
    assert v7_config(cfg, BlockLayout(mask, 128), transpose_w=True) is short
    mask[:, :] = True  # 8 a column
    assert v7_config(cfg, BlockLayout(mask, 128), transpose_w=False) is cfg
    assert v7_config(cfg, BlockLayout(mask[:1], 64), transpose_w=False) is cfg
    default = v7_config(bsmm.DEFAULT, BlockLayout(mask[:1], 128), transpose_w=False)  # (the default's rule)
    assert (default.v7_groups[128], default.v7_stages[128], default.v7_blocks[128], default.v7_producer_registers,
            default.v7_tiles[128]) == (1, 3, 2, 40, bsmm.DEFAULT.v7_tiles[128])
    off = replace(bsmm.DEFAULT, v7_producer=False)  # (a residency needs warp-specialized products)
    assert v7_config(off, BlockLayout(mask[:1], 128), transpose_w=False) is off
    for rule in ({"mean_blocks": 0.0, "v7_tiles": 1}, {"v7_tiles": 1}, {"mean_blocks": 2.0, "v7_stages": 9},
                 {"mean_blocks": 2.0, "v6_wgrad_k": 16}, (2.0, 1, 3)):
        with pytest.raises(ValueError, match=r"v7_short_lines\[128\]"):
            replace(bsmm.DEFAULT, v7_short_lines={128: rule})