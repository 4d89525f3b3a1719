"""SBNet's config: every switch gives the reference's gathers, scatters and reduce_mask."""

from dataclasses import replace

import numpy as np
import pytest

from sparseblocks import sbnet
from sparseblocks.reference import sbnet as reference

SWITCHES = [  # (field, value, the images it changes the kernels of)
    ("row_copies", False, "NHWC", "float32"),  # channels-last copies by elements, not 16-byte rows
    ("row_tile_window_major", True, "NHWC", "float32"),  # transposing row tiles window by window
    ("row_tile_window_major", False, "NHWC", "float16"),  # ... tile by tile
    ("merge", False, "NHWC", "float32"),  # a scatter into a copy: the copy, then the scatter
    ("pairs", False, "NCHW", "float16"),  # NCHW fp16 copies by elements, not pairs
    ("pair_tile_gathers", False, "NCHW", "float16"),  # NCHW fp16 gathers through the generic tile
    ("reduce_version", 1, "NHWC", "float32"),  # reduce_mask's pooling, then compaction
]


@pytest.mark.parametrize("field, value, data_format, dtype", SWITCHES)
def test_each_switch_gives_the_reference(field, value, data_format, dtype):
    config = replace(sbnet.DEFAULT, **{field: value})
    rng = np.random.default_rng(3)
    mask = (rng.random((1, 10, 12)) < 0.15).astype(np.float32)
    g = {"bsize": 4, "bstride": 4, "boffset": 0}
    indices, count = sbnet.reduce_mask(mask, config=config, **g)
    np.testing.assert_array_equal(indices, reference.reduce_mask(mask, **g))
    shape = (1, 10, 12, 8) if data_format == "NHWC" else (1, 8, 10, 12)
    x = rng.standard_normal(shape).astype(dtype)
    for transpose in (False, True):
        blocks = sbnet.sparse_gather(x, indices, transpose=transpose, data_format=data_format, config=config, **g)
        want = reference.sparse_gather(x, indices, transpose=transpose, data_format=data_format, **g)
        np.testing.assert_array_equal(blocks, want.astype(dtype))
        y = sbnet.sparse_scatter(blocks, indices, x, add=True, transpose=transpose, data_format=data_format,
                                 config=config, **g)
        want = reference.sparse_scatter(blocks, indices, x, add=True, transpose=transpose, data_format=data_format,
                                        **g)
        np.testing.assert_allclose(y.astype(np.float64), want, rtol=2e-3, atol=2e-3)


def test_config_is_checked():
    with pytest.raises(ValueError, match="pass_loads"):
        replace(sbnet.DEFAULT, pass_loads=5)
    with pytest.raises(TypeError, match="config"):
        sbnet.reduce_mask(np.zeros((1, 4, 4), np.float32), 2, 2, config=object())
