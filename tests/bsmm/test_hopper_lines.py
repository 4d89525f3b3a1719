"""Products of several output block-lines a thread block (`bsmm/hopper_lines.py`, ``v7_lines``)
against the NumPy reference: its schedule everywhere, the kernel in the simulator on one small
case and on an sm_90 GPU over drawn layouts."""

from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sparseblocks import bsmm
from sparseblocks.bsmm.dispatch import hopper as on_hopper
from sparseblocks.bsmm.hopper_lines import line_groups, lines_check, make_product_lines
from sparseblocks.layout import BlockLayout
from sparseblocks.runtime import compile as compile_cache
from sparseblocks.runtime.arrays import poisoned_outputs
from sparseblocks.runtime.backend import SIMULATOR
from strategies import assert_close, layouts, values
from test_bsmm import assert_products
from test_hopper import draw_operands

gpu = pytest.mark.skipif(SIMULATOR or not on_hopper(), reason="wgmma: an sm_90 GPU")


def ran_lines():
    return [key[0] for key in compile_cache._kernels].count(make_product_lines)


@settings(max_examples=40, deadline=None)
@given(layout=layouts(block_sizes=(32,), max_blocks=12, kinds=("random", "full", "single", "skewed")),
       transpose_w=st.booleans(), L=st.integers(2, 5))
def test_line_groups_cover_each_block_once(layout, transpose_w, L):
    """Each block is in one entry, at its line's place in its group and its other index; a
    group's entries ascend without repeats; lines with no block leave -1."""
    begin, other, blocks = line_groups(layout, transpose_w, L)
    coords = np.asarray(layout.coords).reshape(-1, 2)
    n_lines = layout.shape[0 if transpose_w else 1]
    assert len(begin) == -(-n_lines // L) + 1 and begin[0] == 0 and begin[-1] == len(other)
    seen = []
    for g in range(len(begin) - 1):
        entries = other[begin[g]:begin[g + 1]]
        assert np.all(np.diff(entries) > 0)
        for u in range(begin[g], begin[g + 1]):
            for j in range(L):
                b = blocks[u, j]
                if b >= 0:
                    line, at = (coords[b][0], coords[b][1]) if transpose_w else (coords[b][1], coords[b][0])
                    assert (line, at) == (g * L + j, other[u])
                    seen.append(int(b))
            assert np.any(blocks[u] >= 0)
    assert sorted(seen) == list(range(layout.n_blocks))


@pytest.mark.parametrize("fields, message", [
    ({"v7_lines": {64: 2}}, r"blocks of \(32,\)"), ({"v7_lines": {32: 9}}, "2 to 8 lines"),
    ({"v7_lines": {32: 8}, "v7_lines_tiles": {32: 2}}, "accumulators"),
    ({"v7_lines": {32: 4}, "v7_lines_stages": 2}, "v7_lines_stages"),
    ({"v7_lines": {32: 4}, "v7_lines_groups": {32: 3}}, "warpgroups"), ({"v7_lines_from": 1.5}, "v7_lines_from"),
    ({"v7_lines_from": True}, "v7_lines_from")])
def test_config_refuses_lines_the_kernel_cannot_take(fields, message):
    with pytest.raises(ValueError, match=message):
        replace(bsmm.DEFAULT, **fields)
    assert lines_check(bsmm.DEFAULT, 32) != ""  # (off by default: no lines a tile named)


@pytest.mark.skipif(not SIMULATOR, reason="the GPU cases below cover it")
@pytest.mark.parametrize("dtype, L, tiles", [("float16", 2, 1), ("bfloat16", 3, 1), ("float16", 3, 1),
                                             ("bfloat16", 2, 2)])
def test_lines_products_run_in_the_simulator(monkeypatch, dtype, L, tiles):
    """One warpgroup of one or two 64-row tiles and the copying warpgroup, a ring of 3: the forward and
    the input gradient over a 7 x 3 grid of blocks of 32 with blocks missing (a line's zero block
    in a buffer that held one of its blocks the time round before), 8 rows (rows past N read the
    last, not written)."""
    from sparseblocks.bsmm import dispatch
    from sparseblocks.reference import bsmm as reference

    monkeypatch.setattr(dispatch, "hopper", lambda: True)
    cfg = replace(bsmm.DEFAULT, v7_lines={32: L}, v7_lines_groups={32: 1}, v7_lines_tiles={32: tiles},
                  v7_lines_stages=3)
    layout = BlockLayout(np.array([[1, 0, 1], [1, 1, 0], [0, 0, 1], [1, 0, 0], [0, 1, 1], [1, 0, 0], [0, 0, 1]]), 32)
    rng = np.random.default_rng(5)
    x, dy, w = values(rng, (8, 224), dtype), values(rng, (8, 96), dtype), values(rng, layout.w_shape, dtype)
    before = ran_lines()
    with poisoned_outputs():
        y = bsmm.forward(x, w, layout, 1, version=7, config=cfg)
        dx = bsmm.input_grad(dy, w, layout, 1, version=7, config=cfg)
    assert ran_lines() == before + 2
    with poisoned_outputs():  # (below v7_lines_from: a line a tile)
        bsmm.forward(x, w, layout, 1, version=7, config=replace(cfg, v7_lines_from=0.6))
    assert ran_lines() == before + 2
    for name, got, want in (("forward", y, reference.forward(x, w, layout)),
                            ("input_grad", dx, reference.input_grad(dy, w, layout))):
        assert_close(np.asarray(got), want, dtype, name, terms=224)


@gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@settings(max_examples=12, deadline=None)
@given(data=st.data(), shape=st.sampled_from([(2, 2, 1, 4), (4, 2, 1, 4), (4, 1, 2, 3), (3, 2, 1, 6),
                                              (8, 2, 1, 3)]))
def test_lines_products_match_reference(data, dtype, shape):
    """``v7_lines`` on the GPU: (lines, warpgroups, tiles a warpgroup, stages) over drawn layouts
    and N from 1 to 700, the forward and the input gradient (the weight gradient as by default)."""
    L, groups, tiles, stages = shape
    layout, w, xa, dya = draw_operands(data, 32, dtype, 1, 6)
    cfg = replace(bsmm.DEFAULT, v7_lines={32: L}, v7_lines_groups={32: groups}, v7_lines_tiles={32: tiles},
                  v7_lines_stages=stages)
    with poisoned_outputs():
        y = bsmm.forward(xa, w, layout, 1, version=7, config=cfg)
        dx = bsmm.input_grad(dya, w, layout, 1, version=7, config=cfg)
        dw = bsmm.weight_grad(xa, dya, layout, 1, version=7, config=cfg)
    assert_products(y, dx, dw, xa, dya, w, layout, 1, dtype)
    if layout.n_blocks:
        assert ran_lines() > 0


@gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_lines_products_replay_a_kept_plan(dtype, monkeypatch):
    """Repeated torch calls of the lines products go through a kept plan: its launch rewrites
    out, x and W (the lines kernel's own argument positions), and the schedule stays."""
    torch = pytest.importorskip("torch")
    from sparseblocks.reference import bsmm as reference
    from sparseblocks.runtime import plans

    monkeypatch.setattr(plans, "kept", {})
    layout = BlockLayout.random((8, 6), 0.4, seed=3, block_size=32)
    cfg = replace(bsmm.DEFAULT, v7_lines={32: 2})
    tdtype = getattr(torch, dtype)
    replayed = []
    original = bsmm.api.replayed_product
    monkeypatch.setattr(bsmm.api, "replayed_product", lambda *a: replayed.append(original(*a)) or replayed[-1])
    for call in range(3):  # the first call keeps a plan, the next two replay it (new pointers each)
        w = torch.randn(layout.w_shape, device="cuda", dtype=tdtype)
        x = torch.randn(300, 256, device="cuda", dtype=tdtype)
        dy = torch.randn(300, 192, device="cuda", dtype=tdtype)
        y = bsmm.forward(x, w, layout, config=cfg)
        dx = bsmm.input_grad(dy, w, layout, config=cfg)
        x64, dy64, w64 = (t.double().cpu().numpy() for t in (x, dy, w))
        assert_close(y.double().cpu().numpy(), reference.forward(x64, w64, layout), dtype, "forward")
        assert_close(dx.double().cpu().numpy(), reference.input_grad(dy64, w64, layout), dtype, "input_grad")
        assert (replayed[-1] is not None) == (call > 0)
    assert ran_lines() > 0 and len(plans.kept) == 2
