"""Version 7 (Hopper wgmma tiles, bsmm/hopper.py) against the NumPy reference on an sm_90 GPU:
every product, both feature axes, split lines and N-splits with their zero-filled tails, and
bitwise repeatability. Its config errors are checked everywhere; its wgmma twin in the simulator
is checked in tests/ptx/test_wgmma.py (the kernels themselves would take minutes of threads there)."""

from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sparseblocks import bsmm
from sparseblocks.bsmm import hopper, hopper_wgrad
from sparseblocks.bsmm.dispatch import hopper as on_hopper
from sparseblocks.layout import BlockLayout
from sparseblocks.runtime import compile as compile_cache
from sparseblocks.runtime.arrays import poisoned_outputs
from sparseblocks.runtime.backend import SIMULATOR
from strategies import arrays, layouts, values
from test_bsmm import assert_products, to_axis

gpu = pytest.mark.skipif(SIMULATOR or not on_hopper(), reason="wgmma: an sm_90 GPU")
CASES = [(bs, dtype) for bs in (64, 128) for dtype in ("float16", "bfloat16")]


def ran_hopper():
    made = [key[0] for key in compile_cache._kernels]
    return made.count(hopper.make_product_v7), made.count(hopper_wgrad.make_weight_grad_v7)


def draw_operands(data, block_size, dtype, feature_axis, max_blocks):
    """(layout, w, x, dy) of a drawn product: x and dy in ``feature_axis``'s layout, N from 1 to
    700 (a multiple of 8 where N runs along rows: whole chunks of 8, else version 5 runs)."""
    layout = data.draw(layouts(block_sizes=(block_size,), max_blocks=max_blocks,
                               kinds=("random", "full", "single", "skewed")))
    n = data.draw(st.integers(1, 700), label="N")
    n = n if feature_axis == 1 else 8 * -(-n // 8)
    C, K = layout.dense_shape
    x, dy = data.draw(arrays((n, C), dtype), label="x"), data.draw(arrays((n, K), dtype), label="dy")
    w = data.draw(arrays(layout.w_shape, dtype), label="w")
    return layout, w, to_axis(x, feature_axis), to_axis(dy, feature_axis)


@gpu
@pytest.mark.parametrize("block_size, dtype", CASES)
@settings(max_examples=15, deadline=None)
@given(data=st.data(), feature_axis=st.sampled_from([1, 0]))
def test_hopper_products_match_reference(data, block_size, dtype, feature_axis):
    layout, w, xa, dya = draw_operands(data, block_size, dtype, feature_axis, 3)
    with poisoned_outputs():
        y = bsmm.forward(xa, w, layout, feature_axis, version=7)
        dx = bsmm.input_grad(dya, w, layout, feature_axis, version=7)
        dw = bsmm.weight_grad(xa, dya, layout, feature_axis, version=7)
    assert_products(y, dx, dw, xa, dya, w, layout, feature_axis, dtype)
    assert ran_hopper() != (0, 0)


BLOCK_32 = replace(bsmm.DEFAULT, v7_groups={32: 2, 64: 2, 128: 2}, v7_tiles={32: 2, 64: 2, 128: 2},
                   v7_stages={32: 6, 64: 5, 128: 4})


@gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@settings(max_examples=12, deadline=None)
@given(data=st.data(), feature_axis=st.sampled_from([1, 0]), producer=st.booleans(),
       stacks=st.sampled_from([(2, 1), (4, 1), (4, 2), (8, 2), (8, 4)]))
def test_block_32_products_match_reference(data, dtype, feature_axis, producer, stacks):
    """Blocks of 32 on version 7 (`BLOCK_32`: wgmma m64n32k16, the 64-byte swizzle), warp-specialized
    or on the barrier ring: the forward and the input gradient; the weight gradient's blocks of a
    block-column stacked down a tile (``v7_wgrad_stacks``: ``stacks`` blocks on warpgroups), with N-splits,
    likewise warp-specialized or not."""
    layout, w, xa, dya = draw_operands(data, 32, dtype, feature_axis, 5)
    cfg = replace(BLOCK_32, v7_producer=producer, v7_wgrad_stacks={32: stacks[0]}, v7_wgrad_groups={32: stacks[1]},
                  v7_wgrad_stack_producer=producer and stacks[1] < 4)  # a copying warpgroup beside 4 leaves too few registers
    with poisoned_outputs():
        y = bsmm.forward(xa, w, layout, feature_axis, version=7, config=cfg)
        dx = bsmm.input_grad(dya, w, layout, feature_axis, version=7, config=cfg)
        dw = bsmm.weight_grad(xa, dya, layout, feature_axis, version=7, config=cfg,
                              splits=data.draw(st.sampled_from([None, 1, 3]), label="splits"))
    assert_products(y, dx, dw, xa, dya, w, layout, feature_axis, dtype)
    if layout.n_blocks:  # an empty layout launches nothing
        made = [key for key in compile_cache._kernels if key[2] == 32]
        assert any(key[0] is hopper.make_product_v7 for key in made)
        assert any(key[0] is hopper_wgrad.make_weight_grad_v7 and key[-1] == hopper.STACKED for key in made)


PRODUCER = replace(bsmm.DEFAULT, v7_producer=True, v7_wgrad_producer=True, v7_persistent={})
COPYING = replace(PRODUCER, v7_tma=False)  # the copying warpgroup's cp.async instead of bulk copies
PERSISTENT = replace(PRODUCER, v7_persistent={64: 4, 128: 3})
# products of 128-row tiles (one warpgroup of two tiles), two thread blocks a multiprocessor
TWO_BLOCKS = replace(PRODUCER, v7_groups={64: 2, 128: 1}, v7_stages={64: 5, 128: 3}, v7_blocks={128: 2},
                     v7_producer_registers=40)
PAIRED_WGRAD = replace(bsmm.DEFAULT, v7_wgrad_pairs={64: 6, 128: 4}, v7_wgrad_pairs_fill=0,
                       v7_wgrad_pair_producer=False)  # (the barrier ring)
PAIRED_SPLIT = replace(PAIRED_WGRAD, v7_wgrad_pairs={64: 4, 128: 3}, v7_wgrad_pair_producer=True)  # (bulk copies)
PAIRED_COPYING = replace(PAIRED_SPLIT, v7_tma=False, v7_wgrad_pair_blocks={64: 2})  # (cp.async, two a multiprocessor)
PAIRED_WIDE = replace(PAIRED_WGRAD, v7_wgrad_pairs={64: 4}, v7_wgrad_pair_width={64: 4})  # (4 blocks a tile)


@gpu
@pytest.mark.parametrize("block_size, dtype", CASES)
@settings(max_examples=12, deadline=None)
@given(data=st.data(), feature_axis=st.sampled_from([1, 0]))
def test_hopper_producer_matches_reference(data, block_size, dtype, feature_axis):
    """``v7_producer``: every product on warp-specialized thread blocks (mbarrier rings, bulk
    tensor copies or with ``v7_tma`` off cp.async), with split lines and N-splits; with
    ``v7_persistent``, feature_axis 1's products on persistent thread blocks; with
    ``v7_wgrad_pairs``, weight gradients two (or, ``v7_wgrad_pair_width``, four) blocks a thread
    block (on the barrier ring, or warp-specialized: ``v7_wgrad_pair_producer``, bulk copies or
    cp.async built for two thread blocks a multiprocessor, ``v7_wgrad_pair_blocks``); with
    ``v7_blocks``, block 128's products two thread blocks a multiprocessor."""
    layout, w, xa, dya = draw_operands(data, block_size, dtype, feature_axis, 5)
    segment = data.draw(st.sampled_from([None, 1]), label="max_segment")
    cfg = data.draw(st.sampled_from([PRODUCER, COPYING, PERSISTENT, PAIRED_WGRAD, PAIRED_SPLIT, PAIRED_COPYING,
                                     PAIRED_WIDE, TWO_BLOCKS]), label="config")
    with poisoned_outputs():
        y = bsmm.api._product(cfg, xa, w, layout, feature_axis, False, 7, max_segment=segment)
        dx = bsmm.input_grad(dya, w, layout, feature_axis, version=7, config=cfg)
        dw = bsmm.weight_grad(xa, dya, layout, feature_axis, version=7, config=cfg,
                              splits=data.draw(st.sampled_from([None, 1, 3]), label="splits"))
    assert_products(y, dx, dw, xa, dya, w, layout, feature_axis, dtype)


@gpu
@pytest.mark.parametrize("max_segment, splits", [(1, 3), (None, 1)])
@pytest.mark.parametrize("feature_axis", [1, 0])
def test_hopper_split_lines_and_rows_match_reference(max_segment, splits, feature_axis):
    """Segments of a line summed by the combine pass; N = 296 cut into splits of whole 32-row
    multiples, the last ending inside a 64-row stage (zero-filled)."""
    from sparseblocks.reference import bsmm as reference
    from strategies import assert_close

    bs, dtype = 64, "bfloat16"
    layout = BlockLayout(np.array([[1, 1], [1, 0], [1, 1]]), bs)
    rng = np.random.default_rng(7)
    C, K = layout.dense_shape
    n = 296  # (a multiple of 8, so that feature_axis 0 runs version 7 too)
    x, dy, w = values(rng, (n, C), dtype), values(rng, (n, K), dtype), values(rng, layout.w_shape, dtype)
    xa, dya = to_axis(x, feature_axis), to_axis(dy, feature_axis)
    cfg = bsmm.DEFAULT
    with poisoned_outputs():
        y = bsmm.api._product(cfg, xa, w, layout, feature_axis, False, 7, max_segment=max_segment)
        dx = bsmm.api._product(cfg, dya, w, layout, feature_axis, True, 7, max_segment=max_segment)
        dw = bsmm.weight_grad(xa, dya, layout, feature_axis, version=7, splits=splits)
    assert_products(y, dx, dw, xa, dya, w, layout, feature_axis, dtype)
    magnitude = reference.weight_grad(np.abs(x.astype(np.float64)), np.abs(dy.astype(np.float64)), layout)
    assert_close(dw, reference.weight_grad(x, dy, layout), dtype, "weight_grad", magnitude=magnitude, terms=n)


@gpu
@pytest.mark.parametrize("block_size", [64, 128])
@pytest.mark.parametrize("splits, feature_axis", [(1, 1), (3, 0)])
def test_hopper_weight_grad_accumulates_into_out(block_size, splits, feature_axis):
    """``out = xᵀ·dy + 0.5·out`` on version 7: in place with one N-split, through the workspace
    with three."""
    import torch

    from sparseblocks.reference import bsmm as reference
    from strategies import assert_close

    layout = BlockLayout(np.array([[1, 0], [1, 1]]), block_size)
    rng = np.random.default_rng(8)
    C, K = layout.dense_shape
    x, dy = values(rng, (264, C), "float16"), values(rng, (264, K), "float16")
    previous = values(rng, layout.w_shape, "float16")
    out = torch.tensor(previous, device="cuda")
    to = lambda a: torch.tensor(np.ascontiguousarray(to_axis(a, feature_axis)), device="cuda")
    before = ran_hopper()[1]
    assert bsmm.weight_grad(to(x), to(dy), layout, feature_axis, out=out, beta=0.5, splits=splits,
                            version=7) is out
    assert ran_hopper()[1] >= max(before, 1)
    want = reference.weight_grad(x, dy, layout) + 0.5 * previous.astype(np.float64)
    assert_close(out.cpu().numpy(), want, "float16", "weight_grad into out", terms=265)


@gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_hopper_is_the_default_and_bitwise_repeatable(dtype):
    layout = BlockLayout.random((6, 6), 0.4, seed=2, block_size=128)
    rng = np.random.default_rng(9)
    n = 1000
    C, K = layout.dense_shape
    x, dy, w = values(rng, (n, C), dtype), values(rng, (n, K), dtype), values(rng, layout.w_shape, dtype)
    assert bsmm.default_version(dtype) == 7
    first = (bsmm.forward(x, w, layout), bsmm.input_grad(dy, w, layout), bsmm.weight_grad(x, dy, layout))
    again = (bsmm.forward(x, w, layout), bsmm.input_grad(dy, w, layout), bsmm.weight_grad(x, dy, layout))
    for a, b in zip(first, again):
        assert np.array_equal(np.asarray(a).view(np.uint16), np.asarray(b).view(np.uint16))


@gpu
def test_hopper_products_replay_in_a_cuda_graph():
    """Bulk copies read tensor maps made for each operand's address: a graph captured on fresh
    tensors (kept plans, maps made and uploaded while the stream captures) replays the eager
    values bitwise, and the new values written into its inputs."""
    import torch

    layout = BlockLayout.random((4, 4), 0.5, seed=3, block_size=128)
    make = lambda *shape: torch.randn(*shape, device="cuda", dtype=torch.float16)  # noqa: E731
    x, dy, w = make(520, 512), make(520, 512), make(*layout.w_shape) / 20
    calls = lambda x, dy, w: (bsmm.forward(x, w, layout), bsmm.input_grad(dy, w, layout),  # noqa: E731
                              bsmm.weight_grad(x, dy, layout))
    eager = calls(x, dy, w)
    inputs = (x.clone(), dy.clone(), w.clone())  # (addresses no map was made for)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = calls(*inputs)
    graph.replay()
    assert all(torch.equal(a, b) for a, b in zip(out, eager))
    inputs[0].mul_(2)
    graph.replay()
    again = calls(inputs[0].clone(), dy, w)
    assert torch.equal(out[0], again[0]) and torch.equal(out[2], again[2])


@pytest.mark.parametrize("fields, message", [
    (dict(v7_groups={128: 5}), "warpgroups"),
    (dict(v7_groups={32: 2}, v7_stages={64: 5, 128: 4}), "v7_stages\\[32\\]: expected 3 to 6 stages"),
    (dict(v7_groups={16: 1}, v7_stages={16: 3}), "blocks of \\(32, 64, 128\\)"),
    (dict(v7_k=32), "swizzle row"),
    (dict(v7_stages={32: 4, 64: 7, 128: 4}), "v7_stages\\[64\\]"),
    (dict(v7_wgrad_k=32), "swizzle row"),
    (dict(v7_tiles={128: 3}), "1 or 2 tiles"),
    (dict(v7_wgrad_groups={128: 4}), "128 rows in all"),
    (dict(v7_wgrad_stages=2), "v7_wgrad_stages"),
    (dict(v7_wgrad_stack_stages=7), "v7_wgrad_stack_stages: expected 3 to 6"),
    (dict(v7_persistent={64: 7}), "3 to 6 stages"),
    (dict(v7_persistent={128: 4}), "v7_persistent\\[128\\].*shared memory"),
    (dict(v7_producer_registers=100), "v7_producer_registers"),
    (dict(v7_wgrad_pairs={128: 6}), "v7_wgrad_pairs\\[128\\].*shared memory"),
    (dict(v7_wgrad_pairs_fill=-1), "v7_wgrad_pairs_fill: expected an int >= 0"),
    (dict(v7_wgrad_pair_width={64: 3}), "v7_wgrad_pair_width\\[64\\]: expected 2 or 4 blocks a tile, got 3"),
    (dict(v7_wgrad_pair_producer=False, v7_wgrad_pair_blocks={64: 2}),
     "v7_wgrad_pair_blocks\\[64\\]: .*of warp-specialized kernels"),
    (dict(v7_wgrad_pair_producer=True, v7_wgrad_pair_blocks={64: 4}),
     "got 2 \\(the most that fit v7_wgrad_pair_blocks\\[64\\] = 4\\)"),
    (dict(v7_wgrad_pair_blocks={32: 2}), "v7_wgrad_pair_blocks: expected block sizes of \\(64, 128\\)"),
    (dict(v7_wgrad_blocks={128: 3}), "got 2 \\(the most that fit v7_wgrad_blocks\\[128\\] = 3\\)"),
    (dict(v7_blocks={64: 4}), "expected 2 or 3 thread blocks"),
    (dict(v7_wgrad_producer_registers=160), "would keep 96 registers"),
    (dict(v7_wgrad_sum_registers=60), "v7_wgrad_sum_registers: expected a multiple of 8 from 24 to 256, got 60"),
    (dict(v7_wgrad_sum_registers=160), "would keep 96 registers"),
    (dict(v7_blocks={128: 2}), "v7_blocks\\[128\\].*do not fit a multiprocessor"),
    (dict(v7_blocks={128: 2}, v7_producer=False), "of warp-specialized kernels"),
    (dict(v7_wgrad_blocks={32: 2}), "v7_wgrad_blocks: expected block sizes"),
    (dict(v7_wgrad_stacks={64: 2}), "v7_wgrad_stacks\\[64\\]: block 64: version 7 takes blocks of \\(32,\\)"),
    (dict(v7_wgrad_stacks={32: 3}), "v7_wgrad_stacks\\[32\\]: expected 2, 4 or 8 blocks a tile, got 3"),
    (dict(v7_wgrad_stacks={32: 4}, v7_wgrad_groups={32: 4}), "128 rows in all"),
    (dict(v7_wgrad_stacks={32: 8}, v7_wgrad_groups={32: 1}), "1 warpgroups of 4 64-row tiles"),
])
def test_config_refuses_hopper_tiles_the_kernels_cannot_take(fields, message):
    with pytest.raises(ValueError, match=message):
        replace(bsmm.DEFAULT, **fields)


def test_block_128_weight_gradients_run_two_thread_blocks_a_multiprocessor():
    """``v7_wgrad_blocks`` (block 128 by default): one multiplying warpgroup of two tiles and the
    copying one, two thread blocks a multiprocessor: the 3 stages that fit two, a cap of 128
    registers at entry, 40 for the copying warpgroup and 216 for the multiplying one (56 and 200
    where the copying warpgroup also sums the bias gradient's columns); block 64 keeps one thread
    block, its barrier ring of ``v7_wgrad_stages``."""
    cfg = bsmm.DEFAULT
    assert hopper.producing(cfg, True, 128) and not hopper.producing(cfg, True, 64)
    _, _, groups, tiles, _, stages = hopper.v7_shape(cfg, 128, True)
    assert (groups, tiles, stages) == (1, 2, 3) and hopper.v7_threads(cfg, 128, True) == 256
    assert hopper.split_registers(cfg, groups, hopper.resident(cfg, 128, True), True) == (40, 216)
    assert hopper.split_registers(cfg, groups, 2, True, cfg.v7_wgrad_sum_registers) == (56, 200)
    assert 2 * (hopper.shared_bytes(cfg, 128, True) + 1024) <= hopper.SM_SHARED
    assert hopper.v7_shape(cfg, 64, True)[5] == cfg.v7_wgrad_stages
    # (products too, given 128-row tiles and 3 stages: `v7_blocks`)
    assert hopper.v7_shape(TWO_BLOCKS, 128)[:3] == (128, 128, 1) and hopper.v7_threads(TWO_BLOCKS, 128) == 256
    assert hopper.split_registers(TWO_BLOCKS, 1, hopper.resident(TWO_BLOCKS, 128, False)) == (40, 216)


@pytest.mark.skipif(not SIMULATOR, reason="the GPU cases above cover it")
@pytest.mark.parametrize("dtype, feature_axis, tiles", [("bfloat16", 0, 1), ("float16", 1, 2)])
def test_hopper_product_runs_in_the_simulator(monkeypatch, dtype, feature_axis, tiles):
    """One warpgroup, one stage of version 7 through the simulator's wgmma twin (one block of 64
    and 8 rows: every wgmma there is a 128-thread rendezvous), with one or two 64-row tiles."""
    from sparseblocks.bsmm import dispatch

    monkeypatch.setattr(dispatch, "hopper", lambda: True)
    cfg = replace(bsmm.DEFAULT, v7_groups={64: 1}, v7_tiles={64: tiles}, v7_stages={64: 3})
    layout = BlockLayout(np.ones((1, 1)), 64)
    rng = np.random.default_rng(3)
    x, w = values(rng, (8, 64), dtype), values(rng, layout.w_shape, dtype)
    before = ran_hopper()[0]
    y = bsmm.forward(to_axis(x, feature_axis), w, layout, feature_axis, version=7, config=cfg)
    assert ran_hopper()[0] == before + 1
    from sparseblocks.reference import bsmm as reference
    from strategies import assert_close

    got = np.asarray(y) if feature_axis == 1 else np.asarray(y).T
    assert_close(got, reference.forward(x, w, layout), dtype, "forward")


@pytest.mark.skipif(not SIMULATOR, reason="the GPU cases above cover it")
@pytest.mark.parametrize("feature_axis, producer", [(1, True), (0, False), (1, False)])
def test_block_32_products_run_in_the_simulator(monkeypatch, feature_axis, producer):
    """Blocks of 32 on version 7: a stage a block (k 32), the K-major operands and the 32-wide
    MN-major B (W's block in the forward) in the 64-byte swizzle, wgmma m64n32k16; the forward and
    the input gradient over a 2 x 2 grid with a block missing, through a ring of 3 (the copying
    warpgroup's cp.async with ``producer``, else the barrier ring)."""
    from sparseblocks.bsmm import dispatch
    from sparseblocks.reference import bsmm as reference
    from strategies import assert_close

    monkeypatch.setattr(dispatch, "hopper", lambda: True)
    cfg = replace(bsmm.DEFAULT, v7_groups={32: 1, 64: 2, 128: 2}, v7_tiles={32: 1, 64: 2, 128: 2},
                  v7_stages={32: 3, 64: 5, 128: 4}, v7_producer=producer)
    layout = BlockLayout(np.array([[1, 1], [0, 1]]), 32)
    rng = np.random.default_rng(7)
    x, dy, w = values(rng, (8, 64), "float16"), values(rng, (8, 64), "float16"), values(rng, layout.w_shape, "float16")
    before = ran_hopper()[0]
    y = bsmm.forward(to_axis(x, feature_axis), w, layout, feature_axis, version=7, config=cfg)
    dx = bsmm.input_grad(to_axis(dy, feature_axis), w, layout, feature_axis, version=7, config=cfg)
    assert ran_hopper()[0] == before + 2
    for name, got, want in (("forward", y, reference.forward(x, w, layout)),
                            ("input_grad", dx, reference.input_grad(dy, w, layout))):
        got = np.asarray(got) if feature_axis == 1 else np.asarray(got).T
        assert_close(got, want, "float16", name, terms=64)


@pytest.mark.skipif(not SIMULATOR, reason="the GPU cases above cover it")
@pytest.mark.parametrize("feature_axis", [1, 0])
def test_hopper_weight_grad_runs_in_the_simulator(monkeypatch, feature_axis):
    """Version 7's weight gradient through the simulator's twin: 100 rows are two 64-row stages,
    the second zero-filled past the end, in a ring of three buffers."""
    from sparseblocks.bsmm import dispatch
    from sparseblocks.reference import bsmm as reference
    from strategies import assert_close

    monkeypatch.setattr(dispatch, "hopper", lambda: True)
    cfg = replace(bsmm.DEFAULT, v7_wgrad_stages=3)
    layout = BlockLayout(np.ones((1, 1)), 64)
    rng = np.random.default_rng(4)
    n = 100 if feature_axis == 1 else 104  # (N along rows: whole chunks of 8)
    x, dy = values(rng, (n, 64), "float16"), values(rng, (n, 64), "float16")
    before = ran_hopper()[1]
    dw = bsmm.weight_grad(to_axis(x, feature_axis), to_axis(dy, feature_axis), layout, feature_axis, version=7,
                          config=cfg)
    assert ran_hopper()[1] == before + 1
    assert_close(dw, reference.weight_grad(x, dy, layout), "float16", "weight_grad", terms=n)


def test_wave_splits_fill_whole_rounds(monkeypatch):
    """`dispatch.wave_splits` on 132 multiprocessors, block 128's weight-gradient stages (64 rows,
    two thread blocks a multiprocessor), N = 4096: 51 blocks split two ways (one thread block of
    32 stages on each multiprocessor; three ways, as a fill of one a multiprocessor asks, puts
    two of 22 on some), 102 and 256 not at all (split two ways, some multiprocessors run two of
    32 stages and the sums are read again); never more splits than stages."""
    from sparseblocks.bsmm import dispatch

    monkeypatch.setattr(dispatch, "multiprocessors", lambda: 132)
    flops, block = 2 * 128 * 128 * 64, 128 * 128 * 4
    for blocks, want in ((51, 2), (102, 1), (256, 1)):
        assert dispatch.wave_splits(blocks, 4096, 64, flops, 2, blocks * block) == want, blocks
    assert dispatch.wave_splits(1, 256, 64, flops, 1, block) == 4  # (one block: its 4 stages apart)
    assert dispatch.wave_splits(1, 100, 64, flops, 1, block) == 1  # (one stage and a part)


@pytest.mark.skipif(not SIMULATOR, reason="the GPU cases above cover it")
def test_hopper_weight_grad_splits_by_the_wave_model_in_the_simulator(monkeypatch):
    """``v7_wgrad_waves``: the weight gradient's N-splits from `dispatch.wave_splits` (one block on
    16 multiprocessors, 256 rows: four splits of a stage each, and the combining pass)."""
    from sparseblocks.bsmm import dispatch
    from sparseblocks.reference import bsmm as reference
    from strategies import assert_close

    chosen = []
    model = dispatch.wave_splits
    monkeypatch.setattr(dispatch, "hopper", lambda: True)
    monkeypatch.setattr(dispatch, "multiprocessors", lambda: 16)
    monkeypatch.setattr(dispatch, "wave_splits", lambda *args, **kw: chosen.append(model(*args, **kw)) or chosen[-1])
    cfg = replace(bsmm.DEFAULT, v7_wgrad_stages=3, v7_wgrad_waves=True)
    layout = BlockLayout(np.ones((1, 1)), 64)
    rng = np.random.default_rng(5)
    x, dy = values(rng, (256, 64), "float16"), values(rng, (256, 64), "float16")
    dw = bsmm.weight_grad(x, dy, layout, version=7, config=cfg)
    assert chosen == [4]
    assert_close(dw, reference.weight_grad(x, dy, layout), "float16", "weight_grad", terms=256)


@pytest.mark.skipif(not SIMULATOR, reason="the GPU cases above cover it")
@pytest.mark.parametrize("feature_axis", [1, 0])
def test_hopper_split_line_runs_in_the_simulator(monkeypatch, feature_axis):
    """A block-column of two blocks cut into two segments: each thread block's staged tile goes to
    its workspace slot (rows of 4 values, or with feature_axis 0 one value a row), which the
    combine pass sums."""
    from sparseblocks.bsmm import dispatch
    from sparseblocks.reference import bsmm as reference
    from strategies import assert_close

    monkeypatch.setattr(dispatch, "hopper", lambda: True)
    cfg = replace(bsmm.DEFAULT, v7_groups={64: 1}, v7_tiles={64: 1}, v7_stages={64: 3})
    layout = BlockLayout(np.ones((2, 1)), 64)
    rng = np.random.default_rng(5)
    x, w = values(rng, (8, 128), "float16"), values(rng, layout.w_shape, "float16")
    y = bsmm.api._product(cfg, to_axis(x, feature_axis), w, layout, feature_axis, False, 7, max_segment=1)
    got = np.asarray(y) if feature_axis == 1 else np.asarray(y).T
    assert_close(got, reference.forward(x, w, layout), "float16", "forward", terms=128)


@pytest.mark.skipif(not SIMULATOR, reason="the GPU cases above cover it")
@pytest.mark.parametrize("splits", [1, 2])
def test_hopper_weight_grad_into_out_runs_in_the_simulator(monkeypatch, splits):
    """``out = xᵀ·dy + beta·out`` through version 7's staged epilogue: in place with one N-split,
    through the workspace and the combine pass with two."""
    from sparseblocks.bsmm import dispatch
    from sparseblocks.reference import bsmm as reference
    from strategies import assert_close

    monkeypatch.setattr(dispatch, "hopper", lambda: True)
    cfg = replace(bsmm.DEFAULT, v7_wgrad_stages=3 + splits)  # (a config of its own: a kernel compiled here)
    layout = BlockLayout(np.ones((1, 1)), 64)
    rng = np.random.default_rng(6)
    x, dy = values(rng, (128, 64), "float16"), values(rng, (128, 64), "float16")
    out = values(rng, layout.w_shape, "float16")
    expected = reference.weight_grad(x, dy, layout) + 0.5 * out.astype(np.float64)
    before = ran_hopper()[1]
    from numba import cuda

    out_device = cuda.to_device(out)
    bsmm.weight_grad(cuda.to_device(x), cuda.to_device(dy), layout, out=out_device, beta=0.5, version=7, splits=splits, config=cfg)
    assert ran_hopper()[1] == before + 1
    assert_close(out_device.copy_to_host(), expected, "float16", "weight_grad", terms=129)


@pytest.mark.skipif(not SIMULATOR, reason="the GPU cases above cover it")
@pytest.mark.parametrize("feature_axis, tma, splits", [(1, True, 1), (0, True, 2), (1, False, 1), (0, False, 1)])
def test_hopper_producer_runs_in_the_simulator(monkeypatch, feature_axis, tma, splits):
    """``v7_producer``: a copying warpgroup beside one multiplying warpgroup, the stages handed
    over by mbarriers, copied by bulk tensor copies (``v7_tma``) or cp.async. A forward of 5
    stages (a block-column of 5 blocks of 64) and a weight gradient of 5 (300 rows, the last
    stage partly zero-filled) go round a ring of 3 buffers twice, so each barrier completes
    phases of both parities; two N-splits of the weight gradient end at a stage's end."""
    from sparseblocks.bsmm import dispatch
    from sparseblocks.reference import bsmm as reference
    from strategies import assert_close

    monkeypatch.setattr(dispatch, "hopper", lambda: True)
    cfg = replace(bsmm.DEFAULT, v7_groups={64: 1}, v7_tiles={64: 1}, v7_stages={64: 3}, v7_wgrad_stages=3,
                  v7_producer=True, v7_wgrad_producer=True, v7_persistent={}, v7_tma=tma)
    assert hopper.v7_threads(cfg, 64) == 256 and hopper.split_registers(cfg, 1) is None
    rng = np.random.default_rng(7)
    layout = BlockLayout(np.ones((5, 1)), 64)
    x, w = values(rng, (8, 320), "float16"), values(rng, layout.w_shape, "float16")
    before = ran_hopper()
    y = bsmm.forward(to_axis(x, feature_axis), w, layout, feature_axis, version=7, config=cfg)
    got = np.asarray(y) if feature_axis == 1 else np.asarray(y).T
    assert_close(got, reference.forward(x, w, layout), "float16", "forward", terms=320)
    layout = BlockLayout(np.ones((1, 1)), 64)
    n = 300 if feature_axis == 1 else 304
    x, dy = values(rng, (n, 64), "float16"), values(rng, (n, 64), "float16")
    dw = bsmm.weight_grad(to_axis(x, feature_axis), to_axis(dy, feature_axis), layout, feature_axis, version=7,
                          config=cfg, splits=splits)
    assert_close(dw, reference.weight_grad(x, dy, layout), "float16", "weight_grad", terms=n)
    assert ran_hopper() == (before[0] + 1, before[1] + 1)


@pytest.mark.skipif(not SIMULATOR, reason="the GPU cases below cover it")
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_hopper_weight_gradient_sums_the_bias_gradient_in_the_simulator(monkeypatch, dtype):
    """``dbias_dtype`` on a warp-specialized weight gradient with bulk copies: the first block of
    each block-column also sums its N-split's rows of dy (2 splits of 320 rows, 5 and 4 stages
    round a ring of 3, the last partly past N), the empty block-column in a pass of its own."""
    from sparseblocks.bsmm import dispatch
    from sparseblocks.reference import bsmm as reference
    from strategies import assert_close

    monkeypatch.setattr(dispatch, "hopper", lambda: True)
    cfg = replace(PRODUCER, v7_groups={64: 1}, v7_tiles={64: 1}, v7_stages={64: 3}, v7_wgrad_stages=3, v7_tma=True,
                  v7_wgrad_pairs={})
    fused = []
    original = dispatch.launch_column_sums
    monkeypatch.setattr(dispatch, "launch_column_sums", lambda *a: fused.append(a[-1]) or original(*a))
    layout = BlockLayout(np.array([[1, 0, 1], [1, 0, 0]]), 64)
    rng = np.random.default_rng(8)
    x, dy = values(rng, (520, 128), dtype), values(rng, (520, 192), dtype)
    with poisoned_outputs():
        dw, db = bsmm.weight_grad(x, dy, layout, version=7, config=cfg, splits=2, dbias_dtype="float32")
    assert fused and fused[-1] is not None and list(np.asarray(fused[-1][1].copy_to_host())) == [1, 1, 0]
    assert_close(db, reference.bias_grad(dy), "float32", "bias_grad",
                 magnitude=reference.bias_grad(np.abs(np.asarray(dy, np.float64))), terms=520)
    assert_close(dw, reference.weight_grad(x, dy, layout), dtype, "weight_grad", terms=520)


@pytest.mark.skipif(not SIMULATOR, reason="the GPU cases above cover it")
@pytest.mark.parametrize("feature_axis, max_segment, persistent", [(1, None, False), (0, 1, False), (1, 1, True)])
def test_hopper_epilogue_adds_the_bias_in_the_simulator(monkeypatch, feature_axis, max_segment, persistent):
    """A bias added by version 7's epilogue before rounding (an fp32 bias to fp16 outputs, a bf16
    one to bf16), and the ReLU after it: from the staged fp32 tile, from the registers before a
    persistent product's 16-bit staging, or by the combining pass where a line is cut into
    segments; no other launch."""
    from sparseblocks.bsmm import dispatch
    from sparseblocks.reference import bsmm as reference
    from strategies import assert_close

    monkeypatch.setattr(dispatch, "hopper", lambda: True)
    if persistent:
        cfg = replace(bsmm.DEFAULT, v7_groups={64: 1}, v7_tiles={64: 1}, v7_producer=True, v7_persistent={64: 3})
        layout, n, dtype, bias_dtype = BlockLayout(np.ones((3, 2)), 64), 72, "bfloat16", "bfloat16"
    else:  # (the staged fp32 tile: feature_axis 1's runs of 4 share a column, their bias read once)
        cfg = replace(bsmm.DEFAULT, v7_groups={64: 1}, v7_tiles={64: 1}, v7_stages={64: 3}, v7_persistent={})
        layout, n, dtype, bias_dtype = BlockLayout(np.ones((2, 1)), 64), 8, "float16", "float32"
    rng = np.random.default_rng(6)
    C, K = layout.dense_shape
    x, w = values(rng, (n, C), dtype), values(rng, layout.w_shape, dtype)
    bias = values(rng, (K,), bias_dtype)
    made = []
    original = dispatch.cached
    monkeypatch.setattr(dispatch, "cached", lambda maker, *key: made.append(maker.__name__) or original(maker, *key))
    with poisoned_outputs():
        y = bsmm.api._product(cfg, to_axis(x, feature_axis), w, layout, feature_axis, False, 7,
                              max_segment=max_segment, bias=bias, relu=True)
    assert "make_add_bias" not in made and "make_product_v7" in made
    got = np.asarray(y) if feature_axis == 1 else np.asarray(y).T
    want = reference.forward(x, w, layout, bias=np.asarray(bias, np.float64), relu=True)
    assert_close(got, want, dtype, "forward", terms=C + 1)
    assert (want == 0).any() and (want > 0).any()  # (the ReLU's both sides)


@pytest.mark.skipif(not SIMULATOR, reason="the GPU cases above cover it")
@pytest.mark.parametrize("max_segment", [None, 1])
def test_hopper_persistent_product_runs_in_the_simulator(monkeypatch, max_segment):
    """``v7_persistent``: the simulator's one multiprocessor runs one thread block, which walks all
    4 tiles (2 row tiles, the last partial, by 2 block-columns of 3 blocks) round one ring of 3
    buffers, storing each tile's 16-bit staged values while the copies of the next fill the ring;
    with ``max_segment`` 1 each block is a segment, its fp32 sums stored for the combine pass."""
    from sparseblocks.bsmm import dispatch
    from sparseblocks.reference import bsmm as reference
    from strategies import assert_close

    monkeypatch.setattr(dispatch, "hopper", lambda: True)
    cfg = replace(bsmm.DEFAULT, v7_groups={64: 1}, v7_tiles={64: 1}, v7_producer=True, v7_persistent={64: 3})
    layout = BlockLayout(np.ones((3, 2)), 64)
    rng = np.random.default_rng(8)
    x, w = values(rng, (72, 192), "bfloat16"), values(rng, layout.w_shape, "bfloat16")
    with poisoned_outputs():
        y = bsmm.api._product(cfg, x, w, layout, 1, False, 7, max_segment=max_segment)
    assert_close(np.asarray(y), reference.forward(x, w, layout), "bfloat16", "forward", terms=192)


@pytest.mark.skipif(not SIMULATOR, reason="the GPU cases above cover it")
@pytest.mark.parametrize("feature_axis, splits, producer, tma", [(1, 1, False, True), (0, 2, False, True),
                                                                  (1, 2, True, True), (0, 1, True, True),
                                                                  (1, 1, True, False)])
def test_hopper_paired_weight_grad_runs_in_the_simulator(monkeypatch, feature_axis, splits, producer, tma):
    """``v7_wgrad_pairs``: two blocks of a block-row a thread block (x's columns read once for
    both), a row of three blocks leaving one alone (its tile's second half not stored); into an
    ``out`` with beta, in place or through the N-splits' combine; on the barrier ring, or
    (``producer``) warp-specialized: one thread's bulk copies (``tma``: a box of x, one of dy a
    block, two thread blocks a multiprocessor's registers) or a copying warpgroup's cp.async."""
    cfg = replace(bsmm.DEFAULT, v7_wgrad_pairs={64: 3}, v7_wgrad_pair_producer=producer, v7_tma=tma,
                  v7_wgrad_pair_blocks={64: 2} if producer and tma else {})
    made = weight_grad_into_out(monkeypatch, cfg, BlockLayout(np.array([[1, 1, 0], [0, 0, 1], [1, 1, 1]]), 64),
                                feature_axis, splits, 9)
    assert not producer or made.v7_tma == tma  # (the maps made: bulk copies, not the cp.async fallback)


@pytest.mark.skipif(not SIMULATOR, reason="the GPU cases above cover it")
@pytest.mark.parametrize("feature_axis, splits, producer", [(1, 2, False), (0, 1, False), (1, 1, True),
                                                             (0, 2, True)])
def test_hopper_four_wide_weight_grad_runs_in_the_simulator(monkeypatch, feature_axis, splits, producer):
    """``v7_wgrad_pair_width`` 4: four blocks of a block-row a thread block (a tile of 64 x 256,
    x's columns read once for four): a row of five blocks is a tile of four and one alone, a row
    of three a tile with one slot no block fills (neither stored); on the barrier ring or
    warp-specialized (bulk copies: four boxes of dy a stage)."""
    made = weight_grad_into_out(monkeypatch, replace(bsmm.DEFAULT, v7_wgrad_pairs={64: 3}, v7_wgrad_pair_width={64: 4},
                                                     v7_wgrad_pair_producer=producer),
                                BlockLayout(np.array([[1, 1, 0, 1, 0], [1, 1, 1, 1, 1], [0, 0, 1, 0, 0]]), 64),
                                feature_axis, splits, 10)
    assert not producer or made.v7_tma


def test_wgrad_pairs_take_a_block_rows_blocks_width_at_a_time():
    """`dispatch.wgrad_pairs`: (row, the tile's block-columns, its blocks), slots no block fills
    -1 with their column the tile's first block's."""
    from sparseblocks.bsmm import dispatch

    layout = BlockLayout(np.array([[1, 1, 0, 1, 0], [1, 1, 1, 1, 1]]), 64)
    assert dispatch.wgrad_pairs(layout, 4).tolist() == [[0, 0, 1, 3, 0, 0, 1, 2, -1], [1, 0, 1, 2, 3, 3, 4, 5, 6],
                                                        [1, 4, 4, 4, 4, 7, -1, -1, -1]]
    assert dispatch.wgrad_pairs(layout).tolist() == [[0, 0, 1, 0, 1], [0, 3, 3, 2, -1], [1, 0, 1, 3, 4],
                                                     [1, 2, 3, 5, 6], [1, 4, 4, 7, -1]]


def weight_grad_into_out(monkeypatch, cfg, layout, feature_axis, splits, seed, n=72):
    """Version 7's weight gradient under ``cfg`` in the simulator, into an ``out`` with beta 0.5
    (``splits`` N-splits), against the reference; returns the config its kernel was made for."""
    from numba import cuda

    from sparseblocks.bsmm import dispatch
    from sparseblocks.reference import bsmm as reference
    from strategies import assert_close

    monkeypatch.setattr(dispatch, "hopper", lambda: True)
    rng = np.random.default_rng(seed)
    C, K = layout.dense_shape
    x, dy = values(rng, (n, C), "float16"), values(rng, (n, K), "float16")
    out = values(rng, layout.w_shape, "float16")
    expected = reference.weight_grad(x, dy, layout) + 0.5 * out.astype(np.float64)
    before = ran_hopper()[1]
    out_device = cuda.to_device(out)
    bsmm.weight_grad(cuda.to_device(to_axis(x, feature_axis)), cuda.to_device(to_axis(dy, feature_axis)), layout,
                     feature_axis, out=out_device, beta=0.5, version=7, splits=splits, config=cfg)
    assert ran_hopper()[1] == before + 1
    assert_close(out_device.copy_to_host(), expected, "float16", "weight_grad", terms=n + 1)
    return [key[1] for key in compile_cache._kernels if key[0] is hopper_wgrad.make_weight_grad_v7][-1]


@pytest.mark.skipif(not SIMULATOR, reason="the GPU cases above cover it")
def test_short_lines_run_the_two_block_products_in_the_simulator(monkeypatch):
    """The default `v7_short_lines` rule at block 128 (one warpgroup of two tiles, 3 stages, two
    thread blocks a multiprocessor): the forward and the input gradient of a layout of 1.5 blocks
    a line, through the simulator's twins."""
    from sparseblocks.bsmm import dispatch
    from sparseblocks.reference import bsmm as reference
    from strategies import assert_close

    monkeypatch.setattr(dispatch, "hopper", lambda: True)
    layout = BlockLayout(np.array([[1, 0], [1, 1]]), 128)
    assert dispatch.v7_config(bsmm.DEFAULT, layout, False).v7_blocks[128] == 2
    rng = np.random.default_rng(4)
    x, dy = values(rng, (8, 256), "float16"), values(rng, (8, 256), "float16")
    w = values(rng, layout.w_shape, "float16")
    before = ran_hopper()[0]
    y = bsmm.forward(x, w, layout, version=7)
    dx = bsmm.input_grad(dy, w, layout, version=7)
    assert ran_hopper()[0] == before + 2
    assert_close(np.asarray(y), reference.forward(x, w, layout), "float16", "forward")
    assert_close(np.asarray(dx), reference.input_grad(dy, w, layout), "float16", "input_grad")


def test_stacked_weight_gradient_tiles_cover_each_block_once():
    """`dispatch.wgrad_stacks`: each block-column's blocks in order, n a tile, the last tile of a
    column padded with block -1 at its first block's row; the tile's shape (n bs rows)."""
    from sparseblocks.bsmm import dispatch

    layout = BlockLayout(np.array([[1, 1, 0], [0, 1, 1], [1, 1, 0]]), 32)
    coords = np.asarray(layout.coords).reshape(-1, 2)
    stacks = dispatch.wgrad_stacks(layout, 2)
    assert stacks.shape[1] == 5
    for column, r0, r1, b0, b1 in stacks:
        assert tuple(coords[b0]) == (r0, column) and (b1 == -1 and r1 == r0 or tuple(coords[b1]) == (r1, column))
    blocks = sorted(int(b) for b in stacks[:, 3:].ravel() if b >= 0)
    assert blocks == list(range(layout.n_blocks)) and len(stacks) == 1 + 2 + 1
    cfg = replace(bsmm.DEFAULT, v7_wgrad_stacks={32: 8}, v7_wgrad_groups={32: 2}, v7_wgrad_stack_producer=False,
                  v7_wgrad_pair_producer=False)
    assert hopper.v7_shape(cfg, 32, hopper.STACKED) == (256, 32, 2, 2, 64, cfg.v7_wgrad_stack_stages)
    assert not hopper.producing(cfg, hopper.STACKED, 32) and hopper.v7_threads(cfg, 32, hopper.STACKED) == 256
    split = replace(cfg, v7_wgrad_stack_producer=True)  # (a copying warpgroup besides the two multiplying)
    assert hopper.producing(split, hopper.STACKED, 32) and hopper.v7_threads(split, 32, hopper.STACKED) == 384
    assert not hopper.producing(split, hopper.PAIRED, 64)
    assert hopper.producing(replace(cfg, v7_wgrad_pair_producer=True), hopper.PAIRED, 64)


@pytest.mark.skipif(not SIMULATOR, reason="the GPU cases above cover it")
@pytest.mark.parametrize("feature_axis, stack, splits, producer", [(1, 2, 1, False), (0, 4, 2, False),
                                                                   (1, 4, 1, True), (0, 2, 2, True)])
def test_stacked_weight_grad_runs_in_the_simulator(monkeypatch, feature_axis, stack, splits, producer):
    """``v7_wgrad_stacks`` at block 32: a block-column's blocks stacked down one warpgroup's tile
    (2 blocks: a 64-row tile; 4: two), dy's columns read once for them all, a column of three
    blocks leaving a slot empty (not stored); into an ``out`` with beta, in place or through the
    N-splits' combine; on the barrier ring, or (``producer``) warp-specialized, a copying
    warpgroup's cp.async on mbarriers."""
    cfg = replace(bsmm.DEFAULT, v7_wgrad_stacks={32: stack}, v7_wgrad_groups={32: 1}, v7_wgrad_stack_stages=3,
                  v7_wgrad_stack_producer=producer)
    weight_grad_into_out(monkeypatch, cfg, BlockLayout(np.array([[1, 1], [1, 0], [1, 1]]), 32), feature_axis,
                         splits, 11)
