"""BlocksparseConv and BlocksparseDeconv (sparseblocks/conv) against their NumPy twin
(reference/conv.py): the three products over random blocks (overlapping, uneven, channels in no
block), 1-3 spatial dims, strides, dilations, padding and the edge bias, in every dtype; filters as
a list or flat; and the errors bad input gets before any launch."""

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from sparseblocks.conv import BlocksparseConv, BlocksparseDeconv, ConvConfig
from sparseblocks.conv.tensorcore import grouped
from sparseblocks.reference import conv as reference
from sparseblocks.runtime.backend import SIMULATOR
from strategies import assert_close, values


@st.composite
def layers(draw):
    dims = draw(st.integers(1, 3))
    C, K = draw(st.integers(1, 4)), draw(st.integers(1, 4))
    BCK = [(draw(st.lists(st.integers(0, C - 1), min_size=1, max_size=C, unique=True)),
            draw(st.lists(st.integers(0, K - 1), min_size=1, max_size=K, unique=True)))
           for _ in range(draw(st.integers(1, 3)))]
    small = dims == 3  # (3-D layers stay tiny: the simulator runs a thread a value)
    TRS = [draw(st.integers(1, 2 if small else 3)) for _ in range(dims)]
    DHW = [draw(st.integers(2, 3 if small else 5)) for _ in range(dims)]
    strides = [draw(st.integers(1, 2)) for _ in range(dims)]
    dilates = [draw(st.integers(1, 2)) for _ in range(dims)]
    padding = draw(st.sampled_from(["SAME", "VALID", [1] * dims]))
    g = reference.geometry(TRS, DHW, strides=strides, dilates=dilates, padding=padding)
    if min(g["MPQ"]) < 1:
        padding = "SAME"
    return dict(BCK=BCK, TRS=TRS, DHW=DHW, strides=strides, dilates=dilates, padding=padding)


def as3(a, g, key):
    return np.asarray(a, np.float64).reshape(a.shape[:2] + tuple(g[key]))


@settings(max_examples=12, deadline=None)
@given(layer=layers(), dtype=st.sampled_from(["float32", "float16", "bfloat16", "float64"]),
       flat=st.booleans(), bias=st.booleans(), seed=st.integers(0, 2**16))
def test_conv_products_match_the_twin(layer, dtype, flat, bias, seed):
    op = BlocksparseConv(**layer, edge_bias=bias)
    rng = np.random.default_rng(seed)
    N = 2
    F = [values(rng, op.f_shape(b), dtype) for b in range(len(layer["BCK"]))]
    I, dO = values(rng, op.i_shape(N), dtype), values(rng, op.o_shape(N), dtype)
    edge = values(rng, op.edge_bias_shape(), dtype) if bias and op.edge_bias_shape()[1] else None
    if bias and edge is None:
        edge = np.zeros(op.edge_bias_shape(), I.dtype)
    g = op._g
    filters = np.concatenate([f.reshape(-1) for f in F]) if flat else F
    want = reference.forward(F, as3(I, g, "DHW"), op.BCK, g, op.K)
    if bias:
        want = reference.edge_bias(want, edge, g)
    terms = max(1, int(np.prod(g["TRS"])) * op.C)
    assert_close(as3(op(filters, I, edge_bias=edge), g, "MPQ"), want, dtype, "forward", terms=terms)
    assert_close(as3(op.input_grad(filters, dO), g, "DHW"), reference.input_grad(F, as3(dO, g, "MPQ"), op.BCK, g, op.C),
                 dtype, "input_grad", terms=terms)
    for b, (got, want_f) in enumerate(zip(op.filter_grad(dO, I), reference.filter_grad(as3(dO, g, "MPQ"),
                                                                                        as3(I, g, "DHW"), op.BCK, g))):
        assert_close(np.asarray(got, np.float64).reshape(want_f.shape), want_f, dtype, f"filter_grad[{b}]",
                     terms=N * int(np.prod(g["MPQ"])))
    if bias and op.edge_bias_shape()[1]:
        assert_close(op.edge_bias_grad(dO), reference.edge_bias_grad(as3(dO, g, "MPQ"), g), dtype, "edge_bias_grad",
                     terms=N * int(np.prod(g["MPQ"])))


def grouped_layer(rng, G, groups):
    """Blocks of aligned groups of G channels: each output group joined to a random set of input
    groups (one output group none: its channels get zeros)."""
    BCK = [(list(range(c * G, c * G + G)), list(range(k * G, k * G + G)))
           for k in range(1, groups) for c in range(groups) if rng.random() < 0.6 or c == k]
    return BCK


def check_tensor_core_products(dtype, G, groups, TRS, DHW, strides, dilates, padding, bias, seed, N=2,
                               implicit=True, channels_last=False, stage_bytes=32, hopper=False, hopper_groups=1,
                               hopper_keep=True, hopper_filter_grad=False, hopper_filter_taps=0,
                               hopper_filter_overlap=False, fp32_filter_taps=5, hopper_filter_dy_a=False,
                               hopper_stages=3, hopper_blocks=0, hopper_rows=1, diagonal=False):
    rng = np.random.default_rng(seed)
    BCK = grouped_layer(rng, G, groups)
    if diagonal:  # (block-diagonal: each output group one block, of its own input group)
        BCK = [(list(range(c * G, c * G + G)), list(range(c * G, c * G + G))) for c in range(groups)]
    op = BlocksparseConv(BCK, TRS, DHW, strides=strides, dilates=dilates, padding=padding, edge_bias=bias,
                         config=ConvConfig(implicit=implicit, stage_bytes=stage_bytes, hopper=hopper,
                                           hopper_groups=hopper_groups,
                                           hopper_keep={True: "always", False: "never"}.get(hopper_keep, hopper_keep),
                                           hopper_filter_grad=hopper_filter_grad,
                                           hopper_filter_taps=hopper_filter_taps,
                                           hopper_filter_overlap=hopper_filter_overlap,
                                           fp32_filter_taps=fp32_filter_taps, hopper_filter_dy_a=hopper_filter_dy_a,
                                           hopper_stages=hopper_stages, hopper_blocks=hopper_blocks,
                                           hopper_rows=hopper_rows))
    assert op._group == G
    F = [values(rng, op.f_shape(b), dtype) for b in range(len(BCK))]
    I = values(rng, op.i_shape(N), dtype)
    edge = values(rng, op.edge_bias_shape(), dtype) if bias and op.edge_bias_shape()[1] else None
    if bias and edge is None:  # (a layer with no edges still takes its empty bias)
        edge = np.zeros(op.edge_bias_shape(), I.dtype)
    g = op._g
    # each element within the bound of its sum's terms (the twin on absolute values: its magnitude), so
    # that fp32's 3xTF32 over a tensor core's accumulator, rounding each step, passes where it is right
    A = [np.abs(f) for f in F]
    want = reference.forward(F, as3(I, g, "DHW"), op.BCK, g, op.K)
    size = reference.forward(A, as3(np.abs(I), g, "DHW"), op.BCK, g, op.K)
    if bias:
        want = reference.edge_bias(want, edge, g)
        size = reference.edge_bias(size, np.abs(edge), g)
    # channels_last: the activations go in and come out (N, *spatial, channels)
    last, first = (lambda a: np.moveaxis(a, 1, -1), lambda a: np.moveaxis(a, -1, 1)) if channels_last else \
        (lambda a: a, lambda a: a)
    assert_close(as3(first(op(F, last(I), edge_bias=edge, channels_last=channels_last)), g, "MPQ"), want, dtype,
                 "forward", magnitude=size, terms=int(np.prod(g["TRS"])) * op.C)
    dO = values(rng, op.o_shape(N), dtype)
    assert_close(as3(first(op.input_grad(F, last(dO), channels_last=channels_last)), g, "DHW"),
                 reference.input_grad(F, as3(dO, g, "MPQ"), op.BCK, g, op.C), dtype, "input_grad",
                 magnitude=reference.input_grad(A, as3(np.abs(dO), g, "MPQ"), op.BCK, g, op.C),
                 terms=int(np.prod(g["TRS"])) * op.K)
    wants = reference.filter_grad(as3(dO, g, "MPQ"), as3(I, g, "DHW"), op.BCK, g)
    sizes = reference.filter_grad(as3(np.abs(dO), g, "MPQ"), as3(np.abs(I), g, "DHW"), op.BCK, g)
    for b, (got, want_f) in enumerate(zip(op.filter_grad(last(dO), last(I), channels_last=channels_last), wants)):
        assert_close(np.asarray(got, np.float64).reshape(want_f.shape), want_f, dtype, f"filter_grad[{b}]",
                     magnitude=sizes[b], terms=N * int(np.prod(g["MPQ"])))


def test_implicit_products_match_the_twin():
    """The implicit-GEMM products (`conv/implicit.py`) in the simulator: 2-D, stride 1 (the input
    gradient too), an even filter (uneven SAME padding), channel groups of 16, one block (every
    mma is a warp rendezvous of Python threads there: a few seconds each tap)."""
    op = BlocksparseConv(grouped_layer(np.random.default_rng(0), 16, 2), (2, 2), (3, 4))
    assert set(op._plans) == {"forward", "input_grad", "filter_grad"} and len(op.BCK) == 1
    check_tensor_core_products("float16", 16, 2, (2, 2), (3, 4), 1, 1, "SAME", True, 0, N=1)


def test_implicit_products_add_the_edge_bias():
    """The implicit forward with an edge bias where a 3 x 3 SAME layer has edge columns (its
    border positions'; calls with no edge bias take kernels with no bias code: the other tests)."""
    op = BlocksparseConv(grouped_layer(np.random.default_rng(3), 16, 2), (3, 3), (4, 5), padding="SAME",
                         edge_bias=True)
    assert op.edge_bias_shape()[1] > 0 and "forward" in op._plans
    check_tensor_core_products("float16", 16, 2, (3, 3), (4, 5), 1, 1, "SAME", True, 3, N=1)


@pytest.mark.parametrize("G, taps", [(16, 5), (32, 3)])
def test_fp32_implicit_products_match_the_twin(G, taps):
    """fp32's three products through the implicit GEMM in 3xTF32, on channels-last arrays: the
    forward and stride-1 input gradient on slices of 8 channels (one 32-byte shared row, as
    fp16's 16), the filter gradient on rows twice fp16's bytes, its fragments read a word at a
    time, A split once a step for all the taps; at G = 32 in passes of ``fp32_filter_taps``
    (3 of the 4 taps, then the last)."""
    from sparseblocks.conv import implicit
    from sparseblocks.runtime import compile as compile_cache

    op = BlocksparseConv(grouped_layer(np.random.default_rng(1), G, 2), (2, 2), (3, 4))
    assert all(op._implicit_for(kind, "float32") for kind in ("forward", "input_grad", "filter_grad"))
    check_tensor_core_products("float32", G, 2, (2, 2), (3, 4), 1, 1, "SAME", False, 1, N=1, channels_last=True,
                               fp32_filter_taps=taps)
    for maker in (implicit.make_forward, implicit.make_filter_grad):
        assert any(key[0] is maker and key[1] == "float32" for key in compile_cache._kernels)
    if G == 32:
        assert any(key[0] is implicit.make_filter_grad and key[1:3] == ("float32", 32) and key[-1] == taps
                   for key in compile_cache._kernels)


@pytest.mark.parametrize("dtype, G", [("float16", 32), ("float32", 16)])
def test_wide_stage_implicit_products_match_the_twin(dtype, G):
    """``stage_bytes=64``: the forward and stride-1 input gradient stage 64 bytes of a position's
    channels (32 of fp16, 16 of fp32: two k-steps a tap), where the groups are whole slices."""
    op = BlocksparseConv(grouped_layer(np.random.default_rng(2), G, 2), (2, 2), (3, 4),
                         config=ConvConfig(stage_bytes=64))
    assert op._row_bytes("forward", dtype) == op._row_bytes("input_grad", dtype) == 64
    if G == 16:  # (fp16's 32 channels a row are no slice of a group of 16)
        assert op._row_bytes("forward", "float16") == 32
    check_tensor_core_products(dtype, G, 2, (2, 2), (3, 4), 1, 1, "SAME", False, 2, N=1, stage_bytes=64)


@pytest.mark.parametrize("channels_last, groups, keep, N, TRS, bias, rows", [
    (False, 1, False, 1, (2, 2), True, 1), (True, 2, True, 1, (2, 2), True, 1), (False, 1, True, 2, (2, 2), False, 1),
    (True, 1, False, 2, (2, 2), True, 1), (False, 1, False, 1, (3, 3), True, 1), (True, 1, False, 1, (3, 3), False, 1),
    (False, 1, False, 1, (3, 3), True, 2), (True, 2, True, 1, (2, 2), True, 2)])
def test_hopper_products_match_the_twin(monkeypatch, channels_last, groups, keep, N, TRS, bias, rows):
    """``ConvConfig.hopper``: the forward and the stride-1 input gradient on wgmma (`conv/hopper.py`,
    here the simulator's twin): tiles of 8 x 8 positions a warpgroup, a tap a descriptor into the
    patch's no-swizzle layout, an output group no block reaches, and with 3 x 3 filters an edge
    bias (SAME padding: its border positions' columns, a value a channel); a thread block a
    tile, or walking several tiles across images with its filters kept (``keep``); without an
    edge bias, kernels with no bias code; with ``rows`` 2 (``hopper_rows``), two tiles a warpgroup
    down 12 output rows (the second's last rows past the output); the filter gradient as before."""
    from sparseblocks.conv import api, hopper
    from sparseblocks.runtime import compile as compile_cache

    monkeypatch.setattr(api, "compute_capability", lambda: (9, 0))
    made = lambda: sum(key[0] is hopper.make_forward and key[-1] == rows for key in compile_cache._kernels)
    before = made()
    check_tensor_core_products("float16", 16, 2, TRS, (8 if rows == 1 else 12, 9), 1, 1, "SAME", bias, 3, N=N,
                               channels_last=channels_last, hopper=True, hopper_groups=groups, hopper_keep=keep,
                               hopper_rows=rows)
    assert made() > before


@pytest.mark.parametrize("stages, blocks, diagonal", [(3, 0, True), (2, 3, False), (4, 0, False)])
def test_hopper_forward_ring_fits_the_layer(monkeypatch, stages, blocks, diagonal):
    """``ConvConfig.hopper_stages``: the wgmma forward's ring holds no more stages than put all of a
    tile's blocks in flight (a block-diagonal layer: 2, `hopper.forward_stages`), nor more than the
    config's; ``hopper_blocks``: its registers capped for that many thread blocks a multiprocessor
    (no cap in the simulator). The products still match the twin."""
    from sparseblocks.conv import api, hopper
    from sparseblocks.runtime import compile as compile_cache

    monkeypatch.setattr(api, "compute_capability", lambda: (9, 0))
    assert [hopper.forward_stages(most, 3) for most in (0, 1, 2, 3, 9)] == [2, 2, 3, 3, 3]
    check_tensor_core_products("float16", 16, 2, (2, 2), (8, 9), 1, 1, "SAME", False, 5, N=1, hopper=True,
                               hopper_keep=False, hopper_stages=stages, hopper_blocks=blocks, diagonal=diagonal)
    layer = grouped_layer(np.random.default_rng(5), 16, 2)  # (the layer it drew, unless diagonal)
    most = 1 if diagonal else max(sum(ks[0] == k for _, ks in layer) for k in (0, 16))
    made = hopper.forward_stages(most, stages)
    assert made == (2 if diagonal or stages == 2 else min(stages, most + 1))
    assert any(key[0] is hopper.make_forward and key[-3:-1] == (made, blocks) for key in compile_cache._kernels)


def test_filter_shares_fill_the_last_wave():
    """`implicit.filter_shares` (both filter gradients'): at least two waves' worth of thread
    blocks, and of up to twice as many shares the count with the least time a tile's worth; never
    more shares than tiles."""
    from sparseblocks.conv import implicit

    assert implicit.filter_shares(1000, 45, 132) == 11  # (6: three waves, the last of 6 blocks; 11: four)
    assert implicit.filter_shares(1000, 66, 132) == 4  # (whole waves already)
    assert implicit.filter_shares(3, 45, 132) == 3 and implicit.filter_shares(1000, 500, 132) == 1
    for tiles, work, slots in ((1000, 45, 132), (200, 7, 264), (50, 13, 132)):
        shares = implicit.filter_shares(tiles, work, slots)
        low = min(tiles, -(-2 * slots // work))
        assert low <= shares <= min(tiles, 2 * low)
        cost = [-(-work * s // slots) / s for s in range(low, min(tiles, 2 * low) + 1)]
        assert -(-work * shares // slots) / shares == min(cost)


def test_hopper_keeps_filters_only_where_no_thread_block_is_lost():
    """`hopper.keep_pays` (``hopper_keep="auto"``): on 32 x 56² at G = 32 a ring of three patches
    and k kept filters lets 4, 3, 2, 2, 1 thread blocks share a multiprocessor for k = 1-5; without
    them, 3 (one block a group: two stages) or 2. The op keeps them where that holds, "always"
    wherever they fit, "never" not; anything else is refused."""
    from sparseblocks.conv import ConvConfig, hopper

    wide = hopper.geometry([32, 56, 56, 1, 56, 56, 1, 3, 3, 1, 1, 1, 1, 1, 1, 1, 1, 1], 2)
    assert [hopper.keep_pays(wide, 32, most) for most in (1, 2, 3, 4, 5, 6)] == [True, True, True, True, False, False]
    group = lambda g: list(range(g * 32, g * 32 + 32))
    diagonal = [(group(c), group(c)) for c in range(4)]
    full = lambda groups: [(group(c), group(k)) for c in range(groups) for k in range(groups)]  # (most: groups)
    for BCK, auto, always in ((diagonal, 1, 1), (full(4), 4, 4), (full(6), 0, 6)):
        for mode, want in (("auto", auto), ("always", always), ("never", 0)):
            op = BlocksparseConv(BCK, (3, 3), (56, 56), padding="SAME", config=ConvConfig(hopper_keep=mode))
            assert op._hopper_keep("forward", op._host["hg_forward"], 32) == want, (mode, want)
    with pytest.raises(ValueError, match="hopper_keep"):
        ConvConfig(hopper_keep=True)


def test_hopper_forward_caps_registers_only_for_thread_blocks_whose_rings_fit():
    """`hopper.forward_blocks`: the most thread blocks, up to ``hopper_blocks``, whose rings share a
    multiprocessor's 228 KB (1 KB reserved each); no cap where fewer than two fit, or none asked."""
    from sparseblocks.conv import hopper

    layer = [32, 56, 56, 1, 56, 56, 1, 3, 3, 1, 1, 1, 1, 1, 1, 1, 1, 1]
    wide, tall = hopper.geometry(layer, 2), hopper.geometry(layer, 2, 2)
    assert hopper.stage_bytes(wide, 32) == 4 * (10 * 18 + 9 * 32) * 16  # (a 10 x 18 patch, the filter)
    assert [hopper.forward_blocks(wide, 32, stages, 3) for stages in (2, 3, 4)] == [3, 2, 0]
    assert [hopper.forward_blocks(wide, 16, 3, blocks) for blocks in (0, 2, 8)] == [0, 2, 7]
    assert hopper.forward_blocks(wide, 64, 2, 3) == 0 and hopper.forward_blocks(tall, 32, 2, 3) == 2
    # kept filters: stages of a patch only, the block's filter once (3 x 11.5 KB + 18 KB: four fit)
    assert hopper.ring_bytes(wide, 32, 3, 1) == (3 * 10 * 18 + 9 * 32) * 4 * 16
    assert hopper.forward_blocks(wide, 32, 3, 3, keep=1) == 3 and hopper.forward_blocks(wide, 32, 3, 8, keep=1) == 4


@pytest.mark.parametrize("G, groups, TRS, DHW, channels_last, taps, overlap, dy_a, first", [
    (16, 3, (2, 2), (9, 10), False, 0, False, False, False), (32, 2, (3, 3), (8, 9), True, 2, False, False, False),
    (16, 2, (1, 3), (9, 17), False, 0, True, False, False), (16, 3, (2, 2), (9, 10), False, 0, False, True, False),
    (32, 3, (3, 3), (8, 9), True, 2, True, True, False), (16, 3, (2, 2), (9, 25), False, 0, True, True, True)])
def test_hopper_filter_gradient_matches_the_twin(monkeypatch, G, groups, TRS, DHW, channels_last, taps, overlap,
                                                 dy_a, first):
    """``ConvConfig.hopper_filter_grad``: the filter gradient on wgmma (`hopper.make_filter_grad`,
    here the simulator's twin): units of 64 / G blocks of an output group as m (G = 16: four, some
    missing; G = 32: two), the patch and dy MN-major, tiles of 8 x 16 positions overhanging the
    output, each warpgroup half the taps (an odd count: one computed twice, stored once) or, with
    ``hopper_filter_taps`` 2, three thread blocks of 2 x 2 taps along the grid's z (9 taps: the
    last block's taps past the 9th computed as the 9th, never stored); with ``overlap``, a ring of 4
    whose stages' wgmmas are waited for a stage late (four tiles: two images of 2 x 2); with
    ``dy_a`` (``hopper_filter_dy_a``), units of an input group's blocks, their dy A from registers
    (ldmatrix) and the patch B (G = 16: units of up to four blocks, some missing; G = 32: of two);
    where output rows are whole runs of 8 positions (``first``: 24 columns), a channels-first dy
    read as it lies (``dy_first``), the second tile's second half of columns past the output."""
    from sparseblocks.conv import api, hopper
    from sparseblocks.runtime import compile as compile_cache

    monkeypatch.setattr(api, "compute_capability", lambda: (9, 0))
    before = sum(key[0] is hopper.make_filter_grad for key in compile_cache._kernels)
    check_tensor_core_products("float16", G, groups, TRS, DHW, 1, 1, "SAME", False, 7, N=2,
                               channels_last=channels_last, hopper=True, hopper_filter_grad=True,
                               hopper_filter_taps=taps, hopper_filter_overlap=overlap, hopper_filter_dy_a=dy_a)
    made = [key for key in compile_cache._kernels if key[0] is hopper.make_filter_grad]
    assert len(made) > before and made[-1][-2:] == (dy_a, first)


def test_hopper_filter_units_join_an_output_groups_blocks():
    """`hopper.filter_units`: each output group's blocks in runs of 64 / G, -1 past the last."""
    from sparseblocks.conv import hopper

    blocks = [(0, 0), (16, 0), (32, 16), (48, 0), (64, 0), (0, 16)]
    np.testing.assert_array_equal(hopper.filter_units(blocks, 16), [[0, 1, 3, 4], [2, 5, -1, -1]])
    np.testing.assert_array_equal(hopper.filter_units(blocks, 32), [[0, 1], [3, 4], [2, 5]])
    np.testing.assert_array_equal(hopper.filter_units(blocks, 64), [[0], [1], [3], [4], [2], [5]])
    # (hopper_filter_dy_a: an input group's blocks)
    np.testing.assert_array_equal(hopper.filter_units(blocks, 32, dy_a=True),
                                  [[0, 5], [1, -1], [2, -1], [3, -1], [4, -1]])
    assert hopper.filter_taps(9, 32) == 5 and hopper.filter_taps(27, 64) == 3 and hopper.filter_taps(1, 16) == 1
    assert hopper.filter_taps(9, 32, 2) == 2 and hopper.filter_taps(4, 16, 12) == 2


@pytest.mark.parametrize("fields, message", [
    (dict(hopper_filter_taps=13), "hopper_filter_taps: expected 0 to 12"),
    (dict(hopper_stages=5), "hopper_stages: expected 2 to 4"),
    (dict(hopper_blocks=1), "hopper_blocks: expected 0 \\(no cap\\) or 2 to 8"),
    (dict(hopper_rows=3), "hopper_rows: expected 1 or 2 tiles a warpgroup, got 3"),
    (dict(fp32_filter_taps=0), "fp32_filter_taps: expected 1 to 9"),
])
def test_config_refuses_what_the_kernels_cannot_take(fields, message):
    with pytest.raises(ValueError, match=message):
        ConvConfig(**fields)


def test_strided_tensor_core_products_match_the_twin():
    """1-D, stride 2 and dilation 2, channels-last activations: the implicit forward and filter
    gradient read and write them as they are; the gathering input gradient (`conv/tensorcore.py`),
    which a strided layer's takes, runs on them moved channels-first."""
    op = BlocksparseConv(grouped_layer(np.random.default_rng(5), 16, 2), (3,), (9,), strides=2, dilates=2)
    assert set(op._plans) == {"forward", "filter_grad"}
    check_tensor_core_products("bfloat16", 16, 2, (3,), (9,), 2, 2, "SAME", False, 5, N=1, channels_last=True)


def test_channels_last_calls_give_the_channels_first_values():
    """Any layer takes channels-last activations (the direct kernels, fp32, here: moved first)."""
    op = BlocksparseConv([([0, 1], [0, 2]), ([2], [1])], (3, 2), (4, 3), strides=(1, 2))
    rng = np.random.default_rng(6)
    F = [values(rng, op.f_shape(b), "float32") for b in range(2)]
    I, dO = values(rng, op.i_shape(2), "float32"), values(rng, op.o_shape(2), "float32")
    last = lambda a: np.ascontiguousarray(np.moveaxis(a, 1, -1))  # noqa: E731
    np.testing.assert_array_equal(op(F, last(I), channels_last=True), last(op(F, I)))
    np.testing.assert_array_equal(op.input_grad(F, last(dO), channels_last=True), last(op.input_grad(F, dO)))
    for got, want in zip(op.filter_grad(last(dO), last(I), channels_last=True), op.filter_grad(dO, I)):
        np.testing.assert_array_equal(got, want)
    with pytest.raises(ValueError, match=r"I: expected shape \[2, 4, 3, 3\]"):
        op(F, I, channels_last=True)


@pytest.mark.gpu
@pytest.mark.skipif(SIMULATOR, reason="sizes the simulator would take minutes over")
@settings(max_examples=30, deadline=None)
@given(dtype=st.sampled_from(["float16", "bfloat16", "float32"]), G=st.sampled_from([16, 32, 64]),
       groups=st.integers(1, 3),
       dims=st.integers(1, 3), strides=st.integers(1, 2), dilates=st.integers(1, 2),
       padding=st.sampled_from(["SAME", "VALID"]), bias=st.booleans(), seed=st.integers(0, 2**16),
       implicit=st.booleans(), channels_last=st.booleans())
def test_tensor_core_products_match_the_twin_on_the_gpu(dtype, G, groups, dims, strides, dilates, padding, bias,
                                                         seed, implicit, channels_last):
    """Both families: the implicit GEMM (`implicit.py`; fp32 in 3xTF32) and the gathering kernels
    (`tensorcore.py`; fp32 there: the direct kernels), on channels-first or channels-last activations."""
    TRS, DHW = [3] * dims, [9, 7, 10][:dims]
    check_tensor_core_products(dtype, G, max(groups, 2), TRS, DHW, strides, dilates, padding, bias, seed,
                               implicit=implicit, channels_last=channels_last)


# (dtype, G, spatial dims, dilation, channels_last, warpgroups, kept filters, the filter gradient's dy
# as A): what a wgmma kernel is compiled for (its patch follows from the dims and dilation), one set
# of kernels a case, so that the drawn examples reuse them
HOPPER_CASES = [("float16", 32, 2, 1, False, 2, False, True, 2), ("bfloat16", 16, 3, 2, True, 1, False, True, 1),
                ("float16", 64, 2, 2, True, 2, True, False, 1), ("bfloat16", 32, 2, 1, False, 2, False, False, 1),
                ("float16", 16, 2, 1, True, 1, False, False, 2), ("bfloat16", 64, 3, 1, False, 1, True, True, 1)]


@pytest.mark.gpu
@pytest.mark.skipif(SIMULATOR, reason="sizes the simulator would take minutes over")
@pytest.mark.parametrize("dtype, G, dims, dilates, channels_last, warpgroups, keep, dy_a, rows", HOPPER_CASES)
@settings(max_examples=3, deadline=None)
@given(groups=st.integers(2, 3), padding=st.sampled_from(["SAME", "VALID"]), bias=st.booleans(),
       seed=st.integers(0, 2**16))
def test_hopper_products_match_the_twin_on_the_gpu(dtype, G, dims, dilates, channels_last, warpgroups, keep, dy_a,
                                                   rows, groups, padding, bias, seed):
    """``ConvConfig.hopper`` on an sm_90 GPU (elsewhere the implicit GEMM runs): the wgmma forward and
    stride-1 input gradient, 2-D and 3-D, dilated, on tiles of one or two warpgroups that overhang
    the output's edges, and the wgmma filter gradient (``hopper_filter_grad``; 2 taps a warpgroup
    in the cases with kept filters, the stages overlapped in the others; dy as A from registers,
    ``hopper_filter_dy_a``, in three; two tiles a warpgroup down the rows, ``hopper_rows``, in two);
    the drawn examples vary what the kernels take at run time (layers, padding, edge bias, values)."""
    # (fp16 channels-first: 16 output columns, so that the filter gradient with dy as A reads dy as it lies)
    TRS, DHW = [3] * dims, [5, 13, 16 if dtype == "float16" and not channels_last else 11][-dims:]
    check_tensor_core_products(dtype, G, groups, TRS, DHW, 1, dilates, padding, bias, seed,
                               channels_last=channels_last, hopper=True, hopper_groups=warpgroups, hopper_keep=keep,
                               hopper_filter_grad=True, hopper_filter_taps=2 if keep else 0,
                               hopper_filter_overlap=not keep, hopper_filter_dy_a=dy_a, hopper_rows=rows)


def test_grouped_finds_aligned_channel_groups():
    assert grouped([(list(range(32)), list(range(32, 64)))], 32, 64) == 32
    assert grouped([(list(range(16, 32)), list(range(16)))], 32, 32) == 16
    assert grouped([(list(range(16)), list(range(16))), (list(range(16, 48)), list(range(16, 48)))], 48, 48) == 0
    assert grouped([(list(range(8, 24)), list(range(16)))], 32, 16) == 0  # (not aligned)
    assert grouped([([0, 2], [0, 1])], 3, 2) == 0


def test_deconv_is_the_transposed_convolution():
    """A strided 2-D deconvolution: its forward is the convolution's input gradient over the same
    blocks (channels and sizes swapped), its input gradient the convolution's forward, its filter
    gradient the convolution's with the roles of input and output gradient swapped."""
    BCK = [([0, 1], [0, 2]), ([1], [1])]
    op = BlocksparseDeconv(BCK, (3, 3), (3, 4), strides=2, padding="SAME")
    conv = BlocksparseConv([(ks, cs) for cs, ks in BCK], (3, 3), op.o_shape(1)[2:], strides=2, padding="SAME")
    assert conv.o_shape(1)[2:] == op.i_shape(1)[2:] and op.f_shape(0) == [2, 2, 3, 3]
    rng = np.random.default_rng(1)
    F = [values(rng, op.f_shape(b), "float32") for b in range(2)]
    I, dO = values(rng, op.i_shape(2), "float32"), values(rng, op.o_shape(2), "float32")
    np.testing.assert_allclose(op(F, I), conv.input_grad(F, I), rtol=1e-6)
    np.testing.assert_allclose(op.input_grad(F, dO), conv(F, dO), rtol=1e-6)
    for got, want in zip(op.filter_grad(dO, I), conv.filter_grad(I, dO)):
        np.testing.assert_allclose(got, want, rtol=1e-6)


def test_filters_and_results_keep_torch_tensors():
    torch = pytest.importorskip("torch")
    from sparseblocks.runtime.backend import SIMULATOR

    device = "cpu" if SIMULATOR else "cuda"
    op = BlocksparseConv([([0, 1], [0, 1])], (3,), (6,))
    F = [torch.randn(op.f_shape(0), device=device)]
    I = torch.randn(op.i_shape(2), device=device)
    O = op(F, I)
    assert isinstance(O, torch.Tensor) and list(O.shape) == op.o_shape(2)
    want = torch.nn.functional.conv1d(I, F[0], padding=1)
    torch.testing.assert_close(O, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kwargs, message", [
    (dict(BCK=[]), "BCK"),
    (dict(BCK=[([0, 0], [1])]), "distinct"),
    (dict(BCK=[([0], [-1])]), "non-negative"),
    (dict(BCK=[([0],)]), "BCK\\[0\\]"),
    (dict(TRS=(3, 3, 3, 3), DHW=(5, 5, 5, 5)), "1 to 3"),
    (dict(TRS=(3, 3), DHW=(5,)), "spatial dims"),
    (dict(strides=0), "strides"),
    (dict(dilates=(1, 2, 3)), "dilates"),
    (dict(padding="FULL"), "padding"),
    (dict(TRS=(5, 5), DHW=(3, 3), padding="VALID"), "no output position"),
    (dict(MPQ=(4, 5)), "MPQ: expected the output size \\[5, 5\\]"),
    (dict(MPQ=(5, 5, 5)), "MPQ: .* got \\[5, 5, 5\\]"),
    (dict(strides=2, MPQ=(5, 5)), "output size \\[3, 3\\]"),
])
def test_bad_layers_raise(kwargs, message):
    layer = dict(BCK=[([0], [0])], TRS=(3, 3), DHW=(5, 5))
    with pytest.raises((ValueError, TypeError), match=message):
        BlocksparseConv(**{**layer, **kwargs})


def test_deconv_output_size_is_one_whose_convolution_gives_its_input():
    """A strided deconvolution's MPQ: the smallest size by default, any up to stride - 1 more where
    given (each the transposed convolution of its size), a ValueError past them."""
    BCK = [([0, 1], [0, 2])]
    assert BlocksparseDeconv(BCK, (3, 3), (3, 4), strides=2).o_shape(1)[2:] == [5, 7]
    for MPQ in ((5, 7), (6, 8), (6, 7)):
        op = BlocksparseDeconv(BCK, (3, 3), (3, 4), MPQ=MPQ, strides=2)
        conv = BlocksparseConv([(ks, cs) for cs, ks in BCK], (3, 3), MPQ, strides=2)
        assert op.o_shape(1)[2:] == list(MPQ) and conv.o_shape(1)[2:] == [3, 4]
        rng = np.random.default_rng(2)
        F, I = [values(rng, op.f_shape(0), "float64")], values(rng, op.i_shape(1), "float64")
        np.testing.assert_allclose(op(F, I), conv.input_grad(F, I), rtol=1e-12)
    for MPQ, message in (((7, 7), "5..6, 7..8"), ((5, 9), "got \\[5, 9\\]")):
        with pytest.raises(ValueError, match=message):
            BlocksparseDeconv(BCK, (3, 3), (3, 4), MPQ=MPQ, strides=2)


def test_bad_calls_raise_before_any_launch():
    op = BlocksparseConv([([0, 1], [0])], (3, 3), (4, 4))
    F = [np.ones(op.f_shape(0), np.float32)]
    I = np.ones(op.i_shape(1), np.float32)
    with pytest.raises(ValueError, match="F\\[0\\]: expected shape"):
        op([np.ones((1, 1, 3, 3), np.float32)], I)
    with pytest.raises(ValueError, match="one a block"):
        op(F + F, I)
    with pytest.raises(ValueError, match="flat array"):
        op(np.ones(7, np.float32), I)
    with pytest.raises(ValueError, match="I: expected shape"):
        op(F, np.ones((1, 3, 4, 4), np.float32))
    with pytest.raises(TypeError, match="dtype"):
        op(F, I.astype(np.int32))
    with pytest.raises(TypeError, match="one dtype|float16"):
        op(F, I.astype(np.float16))
    with pytest.raises(ValueError, match="edge_bias=True"):
        op(F, I, edge_bias=np.zeros(op.edge_bias_shape(), np.float32))
    with pytest.raises(ValueError, match="expected a bias"):
        BlocksparseConv([([0, 1], [0])], (3, 3), (4, 4), edge_bias=True)(F, I)


@pytest.mark.parametrize("with_gain", [False, True])
def test_l2_normalize_and_its_gradient_match_the_twin(with_gain):
    """Every block's output channels to unit norm (times a gain), and the gradient through it,
    checked against the twin and, for the twin, against a finite difference."""
    op = BlocksparseConv([([0, 1], [0, 2]), ([2], [1])], (3,), (6,))
    rng = np.random.default_rng(3)
    F = [values(rng, op.f_shape(b), "float64") for b in range(2)]
    U = [values(rng, op.f_shape(b), "float64") for b in range(2)]
    gain = values(rng, (3,), "float64") if with_gain else None
    for got, want in zip(op.l2_normalize(F, gain), reference.l2_normalize(F, gain)):
        np.testing.assert_allclose(got, want, rtol=1e-12)
    got = op.l2_normalize_grad(F, U, gain)
    want, want_gain = reference.l2_normalize_grad(F, U, gain)
    if with_gain:
        got, got_gain = got
        np.testing.assert_allclose(got_gain, want_gain, rtol=1e-12)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=1e-10, atol=1e-14)
    # the twin's gradient against a central difference of Σ U·l2_normalize(F)
    step, (b, index) = 1e-6, (0, (1, 0, 2))
    shifted = [[f.copy() for f in F] for _ in range(2)]
    shifted[0][b][index] += step
    shifted[1][b][index] -= step
    loss = [sum(np.sum(u * n) for u, n in zip(U, reference.l2_normalize(s, gain))) for s in shifted]
    np.testing.assert_allclose((loss[0] - loss[1]) / (2 * step), want[b][index], rtol=1e-6)


@settings(max_examples=8, deadline=None)
@given(dtype=st.sampled_from(["float16", "bfloat16", "float32"]), N=st.integers(1, 2), C=st.integers(1, 70),
       L=st.integers(1, 140), seed=st.integers(0, 2**16))
@example(dtype="float16", N=2, C=70, L=130, seed=1)  # (pairs, past a tile on both sides)
@example(dtype="bfloat16", N=1, C=2, L=2, seed=2)
@example(dtype="float16", N=1, C=6, L=9, seed=3)  # (odd: value by value)
def test_channels_last_copies_transpose_every_value(dtype, N, C, L, seed):
    """The activations' channels-last copy (`BlocksparseConv._rows`): 16-bit values of even C and
    L by pairs of 32-bit words, else value by value; bit for bit a transpose, at the tiles' edges too."""
    from numba import cuda

    from sparseblocks.runtime.arrays import Operand

    rng = np.random.default_rng(seed)
    x = values(rng, (N, C, L), dtype)
    conv = BlocksparseConv([(np.arange(1), np.arange(1))], (1,), (L,))
    out = conv._rows(Operand(x, "x"), C, L, N, cuda.default_stream())
    got = np.asarray(out.copy_to_host() if hasattr(out, "copy_to_host") else out).reshape(N, L, C)
    want = np.asarray(x).transpose(0, 2, 1)
    assert got.itemsize == want.itemsize  # (bf16 crosses as int16: the bits are compared)
    assert np.array_equal(got.view(np.uint8), np.ascontiguousarray(want).view(np.uint8))
