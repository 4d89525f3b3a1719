"""The sparse block's config: its switches decide the fused kernels and the NCHW output's layout."""

from dataclasses import replace

import pytest

torch = pytest.importorskip("torch")

import sparseblocks.torch as sbt  # noqa: E402
from sparseblocks.torch import bottleneck  # noqa: E402
from sparseblocks.torch.res_block import _Windows  # noqa: E402


def windows(config, data_format="NCHW"):
    indices = torch.zeros(4, 3, dtype=torch.int32)
    return _Windows(indices, None, False, data_format, ((16, 16), (14, 14), (-1, -1)), ((14, 14), (14, 14), 0),
                    config=config)


def test_the_nchw_output_switch():
    image = torch.zeros(1, 64, 28, 28, dtype=torch.float16)
    on = sbt.ResBlockConfig()
    assert bottleneck._nhwc_out_of_nchw(on, image, (14, 14))
    assert not bottleneck._nhwc_out_of_nchw(replace(on, nchw_input_nhwc_out=False), image, (14, 14))
    fp32 = image.float()
    assert not bottleneck._nhwc_out_of_nchw(replace(on, nchw_input_nhwc_out_fused=False), fp32, (14, 14), True)


def test_the_fused_switches():
    image = torch.zeros(1, 64, 28, 28, dtype=torch.float16)
    h2 = torch.zeros(4, 14, 14, 16, dtype=torch.float16)
    w3 = torch.zeros(64, 16, 1, 1, dtype=torch.float16)
    w1 = torch.zeros(16, 64, 1, 1, dtype=torch.float16)
    config = sbt.ResBlockConfig()
    assert not bottleneck._fuses_scatter(windows(replace(config, fused_scatter_nchw=False)), image, h2, w3, True)
    assert not bottleneck._fuses_gather(windows(replace(config, fused_gather_max_out=8)), image, w1, True)
    assert not bottleneck._fuses_gather(windows(replace(config, fused_gather=False)), image, w1, True)


def test_a_block_takes_a_config():
    config = replace(sbt.ResBlockConfig(), fused_gather=False)
    block = sbt.SparseResBlock(8, 4, block_size=6, config=config)
    assert block.config is config
    block.config = None
    assert block.config is sbt.config.DEFAULT
    with pytest.raises(TypeError, match="config"):
        sbt.SparseResBlock(8, 4, config={"fused_gather": False})
