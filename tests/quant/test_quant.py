"""Quantize-and-pack, unpack and the bit-plane products against their NumPy twins."""

from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from numba import cuda

from sparseblocks import quant
from sparseblocks.layout import BlockLayout
from sparseblocks.reference import quant as reference
from sparseblocks.runtime.backend import SIMULATOR
from strategies import assert_close, gpu_only_case

few = settings(max_examples=2) if SIMULATOR else settings(max_examples=25)


@pytest.fixture(autouse=True)
def small_tiles(configure):
    """The simulator runs a Python thread a CUDA thread and a collective an mma: one warp of 2 x 2
    mma tiles, chunks of one mma step and one-warp packing there (the block-sparse groups are a
    block wide), the default tiles on a GPU."""
    if SIMULATOR:
        configure(quant, warps_m=1, warps_n=1, warp_rows=32, dense_cols=16, chunk_words=8, simt_rows=4, simt_cols=8,
                  pack_warps=1)
MAX_ROWS = 5 if SIMULATOR else 70
MAX_COLUMNS = 80 if SIMULATOR else 700


def quantized(rng, rows, columns, bits, signed, dtype="float32", per_row=None):
    """(x, basis, its QuantArray): a basis of distinct positive values, a row each (``per_row``,
    by default for ±1 codes: weights) or one shared."""
    per_row = signed if per_row is None else per_row
    x = rng.standard_normal((rows, columns)).astype(dtype)
    if not signed:
        x = np.abs(x)
    basis = (rng.uniform(0.1, 1.0, (rows if per_row else 1, bits)) * 2.0 ** np.arange(bits)).astype(np.float32)
    return x, basis, quant.quantize(x, basis if per_row else basis[0], signed)


@few
@given(seed=st.integers(0, 2**32 - 1), rows=st.integers(1, MAX_ROWS), columns=st.integers(1, MAX_COLUMNS),
       bits=st.integers(1, 4), signed=st.booleans(), dtype=st.sampled_from(["float32", "float16"]))
def test_pack_is_the_twins_encode_bit_exact(seed, rows, columns, bits, signed, dtype):
    rng = np.random.default_rng(seed)
    x, basis, q = quantized(rng, rows, columns, bits, signed, dtype)
    codes, values = reference.encode(x.astype(np.float32), basis if len(basis) > 1 or signed else basis[0], signed,
                                     threshold_dtype=np.float32)
    assert q.planes.dtype == np.uint32 and q.planes.shape == (bits, rows, reference.packed_words(columns))
    np.testing.assert_array_equal(q.planes, reference.pack(codes, bits))
    np.testing.assert_array_equal(reference.unpack(q.planes, columns), codes)
    np.testing.assert_allclose(quant.dequantize(q), values, rtol=1e-6, atol=1e-6)


@few
@given(seed=st.integers(0, 2**32 - 1), rows=st.integers(1, MAX_ROWS), words=st.integers(1, 3), ragged=st.booleans(),
       bits=st.integers(1, 4), signed=st.booleans(), dtype=st.sampled_from(["float32", "float16"]))
def test_packing_a_word_a_thread_is_the_twins_bit_exact(seed, rows, words, ragged, bits, signed, dtype):
    """``pack_vector``: rows of whole words take a word a thread and 16-byte loads (other rows the
    ballot kernel), NaNs included: the same planes (fp16 rows compared a value at a time here)."""
    from dataclasses import replace

    cfg = replace(quant.config.DEFAULT, pack_vector=True, pack_half2=False)
    rng = np.random.default_rng(seed)
    columns = 32 * words - (7 if ragged else 0)
    x, basis, q = quantized(rng, rows, columns, bits, signed, dtype)
    x[0, 0] = np.nan
    q = quant.quantize(x, basis if len(basis) > 1 else basis[0], signed, config=cfg)
    codes, _ = reference.encode(x.astype(np.float32), basis if len(basis) > 1 or signed else basis[0], signed,
                                threshold_dtype=np.float32)
    np.testing.assert_array_equal(q.planes, reference.pack(codes, bits))


@pytest.mark.parametrize("bits", [1, 2, 3, 4])
@few
@given(seed=st.integers(0, 2**32 - 1), rows=st.integers(1, 3), words=st.integers(1, 3), signed=st.booleans(),
       basis_order=st.sampled_from(["drawn", "powers", "shuffled"]))
def test_packing_fp16_two_values_an_instruction_is_the_twins_bit_exact(bits, seed, rows, words, signed, basis_order):
    """``pack_half2``: fp16 rows compared with the thresholds two values at a time (thresholds
    rounded down to fp16), the levels counted in fp16: the same planes as the twin's fp32
    compares, for values at each threshold and one fp16 step either side, NaN and infinities,
    and bases whose codes are in level order (powers of two) or not (shuffled)."""
    from dataclasses import replace

    from sparseblocks.quant.api import levels

    cfg = replace(quant.config.DEFAULT, pack_vector=True, pack_half2=True)
    rng = np.random.default_rng(seed)
    x, basis, _ = quantized(rng, rows, 32 * words, bits, signed, "float16")
    if basis_order == "powers":
        basis = np.broadcast_to(np.float32(2.0 ** np.arange(bits) / 8), basis.shape).copy()
    elif basis_order == "shuffled":
        basis = basis[:, rng.permutation(bits)]
    edges = np.float16(levels(basis, signed)[2].astype(np.float32)).reshape(-1)
    near = np.concatenate([edges, np.nextafter(edges, np.float16(np.inf)), np.nextafter(edges, np.float16(-np.inf)),
                           np.float16([np.nan, np.inf, -np.inf, 0.0])])
    flat = x.reshape(-1)
    flat[rng.choice(flat.size, min(flat.size, near.size), replace=False)] = near[:flat.size]
    q = quant.quantize(x, basis if len(basis) > 1 else basis[0], signed, config=cfg)
    codes, _ = reference.encode(x.astype(np.float32), basis if len(basis) > 1 or signed else basis[0], signed,
                                threshold_dtype=np.float32)
    np.testing.assert_array_equal(q.planes, reference.pack(codes, bits))


def test_pack_votes_each_bit_of_32_values_into_one_word():
    """Value c of a row is bit c % 32 of word c // 32 of each plane; the padding is zeros."""
    x = np.zeros((1, 40), np.float32)
    x[0, [0, 5, 31, 33]] = 1.0  # level 1 of a 1-bit 0/1 basis of 1: code 1
    q = quant.quantize(x, np.array([1.0], np.float32), signed=False)
    assert q.planes[0, 0, 0] == (1 << 0) | (1 << 5) | (1 << 31)
    assert q.planes[0, 0, 1] == 1 << 1
    assert (q.planes[0, 0, 2:] == 0).all()


def test_nan_takes_the_lowest_level_and_ties_the_lower():
    x = np.array([[np.nan, 0.5, 0.75, -3.0]], np.float32)
    q = quant.quantize(x, np.array([0.5, 1.0], np.float32), signed=False)  # levels 0, .5, 1, 1.5
    np.testing.assert_array_equal(quant.dequantize(q)[0], [0.0, 0.5, 0.5, 0.0])


def values_of(q):
    """A QuantArray's values by the twin (the unpack kernel, one simulated thread a value, is
    tested on its own above)."""
    return reference.decode(reference.unpack(q.planes, q.columns), np.asarray(q.basis), q.signed)


def products(a, w, layout=None, **kwargs):
    """Every kernel's product: the teaching and tensor-core versions, and the cp.async ring (which
    takes dense W1A1 only; elsewhere the same tensor-core kernel again)."""
    got = {version: quant.matmul(a, w, layout=layout, version=version, **kwargs) for version in quant.VERSIONS}
    ring = replace(quant.config.DEFAULT, ring_stages=2)
    got["ring"] = quant.matmul(a, w, layout=layout, config=ring, **kwargs)
    return got


def random_layout(rng, columns, outputs, bs):
    mask = rng.random((columns // bs, outputs // bs)) < 0.5
    return BlockLayout(mask.astype(np.uint8), bs)


@few
@given(seed=st.integers(0, 2**32 - 1), rows=st.integers(1, MAX_ROWS), blocks=st.integers(1, 3),
       outputs=st.integers(1, 2), bs=st.sampled_from([32, 64]), signed_a=st.booleans(), sparse=st.booleans())
def test_one_bit_products_are_exact_integers(seed, rows, blocks, outputs, bs, signed_a, sparse):
    """With unit bases the product is the integer plane product itself: exact, dense or over a
    layout's present blocks (the weight masked by the layout), from either kernel."""
    rng = np.random.default_rng(seed)
    columns, O = blocks * bs, outputs * bs
    a = quant.quantize(rng.standard_normal((rows, columns)).astype(np.float32), [1.0], signed_a)
    w = quant.quantize(rng.standard_normal((O, columns)).astype(np.float32), np.ones((O, 1), np.float32), True)
    layout = random_layout(rng, columns, O, bs) if sparse else None
    want, sums = reference.matmul(a.planes, [1.0], w.planes, np.ones((O, 1)), columns, signed_a, True, layout)
    np.testing.assert_array_equal(want, sums[0, 0])
    for version, got in products(a, w, layout).items():
        np.testing.assert_array_equal(got, want, err_msg=version)


@few
@given(seed=st.integers(0, 2**32 - 1), rows=st.integers(1, MAX_ROWS), columns=st.integers(1, MAX_COLUMNS),
       outputs=st.integers(1, 20), a_bits=st.integers(1, 4), w_bits=st.integers(1, 4), signed_a=st.booleans(),
       bias=st.booleans(), relu=st.booleans(), out_dtype=st.sampled_from(quant.OUT_DTYPES))
def test_products_match_the_twin(seed, rows, columns, outputs, a_bits, w_bits, signed_a, bias, relu, out_dtype):
    """WkAm products (k, m in 1..4): the plane products scaled by the bases, bias and ReLU in the
    epilogue, fp32 or fp16 out, against the twin (and the twin against its decoded values' float product)."""
    rng = np.random.default_rng(seed)
    _, _, a = quantized(rng, rows, columns, a_bits, signed_a, per_row=False)
    _, _, w = quantized(rng, outputs, columns, w_bits, True)
    b = rng.standard_normal(outputs).astype(np.float32) if bias else None
    want, _ = reference.matmul(a.planes, a.basis[0], w.planes, w.basis, columns, signed_a, True, bias=b, relu=relu)
    dense = values_of(a) @ values_of(w).T
    magnitude = np.abs(values_of(a)) @ np.abs(values_of(w)).T + (np.abs(b) if bias else 0)
    np.testing.assert_allclose(np.maximum(dense + (b if bias else 0), 0) if relu else dense + (b if bias else 0),
                               want, rtol=0, atol=1e-6 * magnitude.max() + 1e-12)
    for version, got in products(a, w, bias=b, relu=relu, out_dtype=out_dtype).items():
        assert got.dtype == np.dtype(out_dtype)
        assert_close(got.astype(np.float64), want, out_dtype, version, magnitude=magnitude, terms=a_bits * w_bits)


# (blocks of 32: the masked-layout test's)
@pytest.mark.parametrize("bs, fused", [gpu_only_case(None, False), gpu_only_case(32, False), (64, False),
                                       gpu_only_case(None, True), (64, True)])
def test_tensor_core_tiles_span_chunks_warps_and_passes(configure, bs, fused):
    """Two warps across a thread block's outputs (one mma column each, an odd count, where dense),
    row blocks and groups that end inside, two staged chunks of the word list (4-, 1- and 2-word
    staging loads), two activation planes a warp and two weight passes, or with ``fused`` both
    weight planes in one pass (`fused_acc`), signed activations (both popcounts): the twin's values."""
    configure(quant, warps_m=1, warps_n=2, warp_rows=32, dense_cols=16, chunk_words=8, fused_acc=64 if fused else 0)
    rng = np.random.default_rng(5)
    rows, columns, O = (12, 320, 64) if bs else (20, 300, 24)  # (dense: two row blocks and groups, last partial)
    _, _, a = quantized(rng, rows, columns, 2, True, per_row=False)
    _, _, w = quantized(rng, O, columns, 2, True)
    layout = random_layout(rng, columns, O, bs) if bs else None
    want, _ = reference.matmul(a.planes, a.basis[0], w.planes, w.basis, columns, True, True, layout)
    magnitude = np.abs(values_of(a)) @ np.abs(values_of(w)).T
    got = quant.matmul(a, w, layout=layout)
    assert_close(got.astype(np.float64), want, "float32", "tensorcore", magnitude=magnitude, terms=4)


@pytest.mark.parametrize("bits, signed_a, signed_w, stages, tall", [
    (1, True, True, 2, False), (1, False, True, 3, False), (1, True, False, 2, False), (1, True, True, 3, True),
    (2, True, True, 2, False), (2, False, True, 3, True), (3, False, True, 2, False)])
def test_the_cp_async_ring_gives_the_register_staged_products_bits(configure, bits, signed_a, signed_w, stages,
                                                                   tall):
    """``ring_stages``: dense products through a cp.async ring (W1A1's C = 700: rows of 24 words,
    stages of 16, the last half past the row's end, so zero-filled), two warps across the outputs (one
    mma column each: an odd last one), a row tile and an output group that end inside (N = 20,
    O = 23: odd, so single stores), bias and ReLU, the planes' rows' bit counts where the other
    side is signed; W1A1 to W3A3, every weight plane in the ring's one pass (the staged kernel
    takes them in passes where ``fused_acc`` is 0, or in one): bit for bit the register-staged
    kernel's, and the twin's values. ``tall``: one warp of 64 rows (4 mma rows a plane at one
    bit, 2 at two) by 16 outputs."""
    warps_n, rows_a_warp = (1, 64) if tall else (2, 32)
    cfg = configure(quant, warps_m=1, warps_n=warps_n, warp_rows=rows_a_warp, dense_cols=16, chunk_words=16,
                    fused_acc=128)
    rng = np.random.default_rng(9)
    rows, columns, O = 20, {1: 700, 2: 300, 3: 160}[bits], 23  # (more bits: one stage, a shorter row)
    _, _, a = quantized(rng, rows, columns, bits, signed_a, per_row=False)
    _, _, w = quantized(rng, O, columns, bits, signed_w, per_row=True)
    b = rng.standard_normal(O).astype(np.float32)
    staged = quant.matmul(a, w, bias=b, relu=True, config=replace(cfg, fused_acc=0 if bits == 2 else 128))
    ring = quant.matmul(a, w, bias=b, relu=True, config=replace(cfg, ring_stages=stages))
    np.testing.assert_array_equal(ring, staged)
    want, _ = reference.matmul(a.planes, a.basis[0], w.planes, w.basis, columns, signed_a, signed_w, bias=b, relu=True)
    magnitude = np.abs(values_of(a)) @ np.abs(values_of(w)).T + np.abs(b)
    assert_close(ring.astype(np.float64), want, "float32", "ring", magnitude=magnitude, terms=bits * bits)


def walk_problem(rng, rows, bits, bs, signed_a=True, signed_w=True, columns=700, outputs=23):
    """(a, w, bias, layout, columns) of the walking and list tests: a layout of blocks of ``bs`` over
    16 block-rows and 3 block-columns (column 0 whole: a list of several stages; column 1 empty:
    its outputs the bias alone), or dense ``columns`` x ``outputs`` where ``bs`` is None."""
    columns, O = (16 * bs, 3 * bs) if bs else (columns, outputs)
    _, _, a = quantized(rng, rows, columns, bits, signed_a, per_row=False)
    _, _, w = quantized(rng, O, columns, bits, signed_w, per_row=True)
    b = rng.standard_normal(O).astype(np.float32)
    layout = None
    if bs:
        mask = (rng.random((16, 3)) < 0.4).astype(np.uint8)
        mask[:, 0], mask[:, 1] = 1, 0
        layout = BlockLayout(mask, bs)
    return a, w, b, layout, columns


def assert_the_twins(got, a, w, b, layout, columns, bits, what):
    """``got`` (with bias and ReLU) within the fp32 roundings of the twin's values."""
    want, _ = reference.matmul(a.planes, a.basis[0], w.planes, w.basis, columns, a.signed, w.signed, layout, bias=b,
                               relu=True)
    magnitude = np.abs(values_of(a)) @ np.abs(values_of(w)).T + np.abs(b)
    assert_close(got.astype(np.float64), want, "float32", what, magnitude=magnitude, terms=bits * bits)


@pytest.mark.parametrize("bits, bs, signed_a, signed_w, stages", [
    (1, 64, True, True, 2), (1, 32, True, True, 3), (1, 64, False, True, 3), (1, 32, True, False, 2),
    (2, 64, True, True, 2), (2, 32, False, True, 3)])
def test_the_ring_over_a_layouts_word_lists_gives_the_staged_bits(configure, monkeypatch, bits, bs, signed_a,
                                                                 signed_w, stages):
    """``ring_lists``: block-sparse products through the ring, a block of 32 or 64 bits a 4- or
    8-byte copy from its list entry: a block-column of 16 blocks (stages of 16 words: 2 of 64-bit
    blocks, 1 of 32-bit ones), an empty one (its outputs the bias alone), a partial row tile;
    the rows' and outputs' bit counts over the present blocks from the copied words. Bit for bit
    the register-staged kernel's values, and the twin's."""
    from sparseblocks.quant import api
    cfg = configure(quant, warps_m=1, warps_n=2, warp_rows=32, chunk_words=16, fused_acc=128, ring_stages=stages,
                    ring_lists=True)
    taken = []
    plain = api.make_ring_product
    monkeypatch.setattr(api, "make_ring_product", lambda *args: taken.append(args) or plain(*args))
    a, w, b, layout, columns = walk_problem(np.random.default_rng(13), 20, bits, bs, signed_a, signed_w)
    ring = quant.matmul(a, w, bias=b, relu=True, layout=layout)
    assert taken
    staged = quant.matmul(a, w, bias=b, relu=True, layout=layout, config=replace(cfg, ring_lists=False))
    np.testing.assert_array_equal(ring, staged)
    assert_the_twins(ring, a, w, b, layout, columns, bits, "ring lists")


@pytest.mark.parametrize("room", [True, False])
def test_the_ring_is_taken_only_where_its_stages_fit_the_devices_shared_memory(configure, monkeypatch, room):
    """The ring's stages live in dynamic shared memory, which devices bound differently (sm_90
    227 KB, sm_86 99 KB): `matmul` takes the ring where `runtime.launch.shared_memory_limit` holds
    its stages, the register-staged kernel otherwise, with the same bits."""
    from sparseblocks.quant import api, ring
    cfg = configure(quant, warps_m=1, warps_n=2, warp_rows=32, dense_cols=16, chunk_words=16, ring_stages=2)
    need = ring.ring_bytes(cfg, 2, 2, 16, 1)
    monkeypatch.setattr(api, "shared_memory_limit", lambda: need if room else need - 1)
    taken = []
    plain = api.make_ring_product
    monkeypatch.setattr(api, "make_ring_product", lambda *args: taken.append(args) or plain(*args))
    rng = np.random.default_rng(10)
    _, _, a = quantized(rng, 20, 128, 2, True, per_row=False)
    _, _, w = quantized(rng, 23, 128, 2, True, per_row=True)
    got = quant.matmul(a, w)
    assert bool(taken) == room
    np.testing.assert_array_equal(got, quant.matmul(a, w, config=replace(cfg, ring_stages=0)))


def test_block_sparse_product_is_the_dense_one_masked_by_the_layout():
    rng = np.random.default_rng(3)
    columns, O, bs = 96, 64, 32  # a 3 x 2 grid of blocks
    _, _, a = quantized(rng, 3, columns, 1, False)
    x, _, w = quantized(rng, O, columns, 2, True)
    layout = random_layout(rng, columns, O, bs)
    masked = np.where(layout.element_mask().T.astype(bool), x, 0.0).astype(np.float32)
    w_masked = quant.quantize(masked, w.basis, True)  # (zeros of a ±1 code: its lowest level, not 0)
    want = values_of(a) @ (values_of(w) * layout.element_mask().T).T
    for version, got in products(a, w, layout).items():
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5, err_msg=version)
    assert w_masked.shape == w.shape


@pytest.mark.parametrize("case, error, match", [
    ("float64 x", TypeError, "x: expected dtype"),
    ("3-D x", ValueError, "x: expected a 2-D array"),
    ("5 bits", ValueError, "basis: expected"),
    ("NaN basis", ValueError, "basis: expected finite"),
    ("columns", ValueError, "w: expected 40 columns"),
    ("shared weight basis", ValueError, "w: expected a basis a row"),
    ("out dtype", ValueError, "out_dtype"),
    ("version", ValueError, "version"),
    ("layout grid", ValueError, "layout: expected a \\(40, 8\\) grid"),
    ("layout block", ValueError, "layout: expected a block size of 32 or 64"),
    ("bias shape", ValueError, "bias: expected shape"),
    ("not quantized", TypeError, "a: expected a QuantArray"),
])
def test_bad_input_is_refused_before_any_launch(case, error, match):
    x = np.ones((3, 40), np.float32)
    a = quant.quantize(x, [1.0], False)
    w = quant.quantize(np.ones((8, 40), np.float32), np.ones((8, 1), np.float32), True)
    calls = {
        "float64 x": lambda: quant.quantize(x.astype(np.float64), [1.0], False),
        "3-D x": lambda: quant.quantize(x[None], [1.0], False),
        "5 bits": lambda: quant.quantize(x, np.ones(5), False),
        "NaN basis": lambda: quant.quantize(x, [np.nan], False),
        "columns": lambda: quant.matmul(a, quant.quantize(np.ones((8, 41), np.float32), np.ones((8, 1)), True)),
        "shared weight basis": lambda: quant.matmul(a, quant.quantize(np.ones((8, 40), np.float32), [1.0], True)),
        "out dtype": lambda: quant.matmul(a, w, out_dtype="int8"),
        "version": lambda: quant.matmul(a, w, version="fast"),
        "layout grid": lambda: quant.matmul(a, w, layout=BlockLayout(np.ones((1, 1)), 32)),
        "layout block": lambda: quant.matmul(a, w, layout=BlockLayout(np.ones((5, 1)), 8)),
        "bias shape": lambda: quant.matmul(a, w, bias=np.ones(7, np.float32)),
        "not quantized": lambda: quant.matmul(x, w),
    }
    with pytest.raises(error, match=match):
        calls[case]()


def test_quant_array_passes_its_planes_on():
    q = quant.quantize(np.ones((2, 3), np.float32), [1.0], False)
    assert q.shape == (2, 3) and q.bits == 1 and not q.signed
    if not SIMULATOR:
        dq = quant.quantize(cuda.to_device(np.ones((2, 3), np.float32)), [1.0], False)
        assert dq.__cuda_array_interface__["shape"] == (1, 2, 8)


@pytest.mark.parametrize("fields, match", [
    ({"chunk_words": 12}, "chunk_words: expected 8, 16 or 32"),
    ({"pack_words": 33}, "pack_words: expected 1 to 32"),
    ({"warps_n": 3}, "warps_n: expected 1, 2 or 4"),
    ({"dense_cols": 256, "chunk_words": 32}, "expected a shared tile of at most 48 KiB"),
    ({"fused_acc": -1}, "fused_acc: expected 0 or more"),
    ({"ring_stages": 1}, "ring_stages: expected 0 \\(no ring\\) or 2 to 4"),
])
def test_config_refuses_tiles_the_kernels_cannot_take(fields, match):
    with pytest.raises(ValueError, match=match):
        quant.QuantConfig(**fields)


def test_weight_planes_share_a_pass_where_their_accumulators_fit():
    """`plane_passes`: every weight plane in one pass where w_bits x (mma tiles) x 4 registers fit
    ``fused_acc`` (W2A2 on 4 x 2 warps of 64 outputs: 64, the default), else a pass a plane; one
    plane, one pass."""
    from sparseblocks.quant.tensorcore import plane_passes

    cfg = quant.QuantConfig(fused_acc=64)
    assert plane_passes(cfg, 2, 2, 64, 4, 2) == (2, 1)
    assert plane_passes(cfg, 4, 4, 64, 4, 2) == (1, 4)  # (256 registers)
    assert plane_passes(cfg, 1, 1, 64, 4, 2) == (1, 1)
    assert plane_passes(quant.QuantConfig(), 2, 2, 64, 4, 2) == (2, 1)
    assert plane_passes(quant.QuantConfig(fused_acc=0), 2, 2, 64, 4, 2) == (1, 2)
