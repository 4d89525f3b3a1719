"""Block-sparse matmul kernels against their NumPy reference, with algebraic properties."""

from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from numba import cuda

from sparseblocks.runtime.arrays import poisoned_outputs
from sparseblocks.runtime.backend import SIMULATOR
from sparseblocks import bsmm
from sparseblocks.runtime import compile as compile_cache
from sparseblocks.runtime import plans
from sparseblocks.layout import BlockLayout
from sparseblocks.reference import bsmm as reference
from strategies import DTYPE_NAMES, VALUE_STYLES, arrays, assert_close, gpu_only_case, layouts, values

# The simulator runs a Python thread per CUDA thread: fewer, smaller cases there.
MAX_BLOCKS = {8: 3, 16: 3, 32: 2, 64: 2, 128: 1} if SIMULATOR else {8: 8, 16: 6, 32: 4, 64: 3, 128: 2}
BLOCKS = [8, 16, 32, 64] + ([] if SIMULATOR else [128])  # (block 128 in the simulator: test_block_128_...)
MAX_N = 20 if SIMULATOR else 300
few = settings(max_examples=2) if SIMULATOR else settings()


def to_axis(a, feature_axis):
    return a if feature_axis == 1 else np.ascontiguousarray(a.T)


@st.composite
def problems(draw, block_size, dtype, styles=("normal", "uniform", "small_integers", "sparse"), kinds=None):
    """A layout of `block_size`, then N, then x, dy and w as (N, features) arrays."""
    layout_kwargs = {} if kinds is None else {"kinds": kinds}
    layout = draw(layouts(block_sizes=(block_size,), max_blocks=MAX_BLOCKS[block_size], **layout_kwargs))
    n = draw(st.integers(1, MAX_N), label="N")
    C, K = layout.dense_shape
    x = draw(arrays((n, C), dtype, styles), label="x")
    dy = draw(arrays((n, K), dtype, styles), label="dy")
    w = draw(arrays(layout.w_shape, dtype, styles), label="w")
    return layout, x, dy, w


def assert_products(y, dx, dw, x, dy, w, layout, feature_axis, dtype):
    """The three products against the reference, each element bounded by the size of its terms
    (the reference on the inputs' absolute values): cancellation cannot fail a correct kernel."""
    ax, ady, aw = (np.abs(np.asarray(a, np.float64)) for a in (x, dy, w))
    C, K = layout.dense_shape
    n = x.shape[1 - feature_axis]
    assert_close(y, reference.forward(x, w, layout, feature_axis), dtype, "forward",
                 magnitude=reference.forward(ax, aw, layout, feature_axis), terms=C)
    assert_close(dx, reference.input_grad(dy, w, layout, feature_axis), dtype, "input_grad",
                 magnitude=reference.input_grad(ady, aw, layout, feature_axis), terms=K)
    assert_close(dw, reference.weight_grad(x, dy, layout, feature_axis), dtype, "weight_grad",
                 magnitude=reference.weight_grad(ax, ady, layout, feature_axis), terms=n)


def check_all_products(data, block_size, dtype, feature_axis, version):
    layout, x, dy, w = data.draw(problems(block_size, dtype))
    x, dy = to_axis(x, feature_axis), to_axis(dy, feature_axis)
    with poisoned_outputs():
        y = bsmm.forward(x, w, layout, feature_axis, version=version)
        dx = bsmm.input_grad(dy, w, layout, feature_axis, version=version)
        dw = bsmm.weight_grad(x, dy, layout, feature_axis, version=version)
    assert y.dtype == dx.dtype == dw.dtype == x.dtype
    assert_products(y, dx, dw, x, dy, w, layout, feature_axis, dtype)


@pytest.mark.parametrize("feature_axis", [1, 0])
@pytest.mark.parametrize("dtype", DTYPE_NAMES)
@pytest.mark.parametrize("block_size", BLOCKS)
@few
@given(data=st.data())
def test_products_match_reference(data, block_size, dtype, feature_axis):
    check_all_products(data, block_size, dtype, feature_axis, version=4)


@pytest.mark.parametrize("version", [1, 3])
@pytest.mark.parametrize("feature_axis", [1, 0])
@pytest.mark.parametrize("block_size", BLOCKS)
@few
@given(data=st.data())
def test_earlier_versions_match_reference(data, block_size, feature_axis, version):
    dtype = data.draw(st.sampled_from(["float32", "bfloat16"]), label="dtype")
    check_all_products(data, block_size, dtype, feature_axis, version=version)


@pytest.mark.parametrize("version, dtype, feature_axis", [(1, "float64", 0), (3, "float32", 1)])
def test_block_128_products_match_reference(version, dtype, feature_axis):
    """Block 128 on the SIMT families (fp64 runs them, and fp32's weight gradient): the teaching
    product's W strips and the chunks that fit static shared memory, one block in the simulator."""
    rng = np.random.default_rng(version)
    layout = BlockLayout(np.array([[1, 0], [1, 1]]) if not SIMULATOR else np.ones((1, 1)), 128)
    n = 3 if SIMULATOR else 150
    C, K = layout.dense_shape
    x, dy = to_axis(values(rng, (n, C), dtype), feature_axis), to_axis(values(rng, (n, K), dtype), feature_axis)
    w = values(rng, layout.w_shape, dtype)
    with poisoned_outputs():
        y = bsmm.forward(x, w, layout, feature_axis, version=version)
        dx = bsmm.input_grad(dy, w, layout, feature_axis, version=version)
        dw = bsmm.weight_grad(x, dy, layout, feature_axis, version=version)
    assert_products(y, dx, dw, x, dy, w, layout, feature_axis, dtype)


# The simulator meets 32 Python threads at every mma: a few cases there (block 64 in
# test_tensor_core_load_paths), every pair on the GPU.
TENSOR_CORE_CASES = ([(16, "float32"), (32, "float16")] if SIMULATOR  # (bf16's mma: test_tiles.py)
                     else [(bs, dtype) for bs in (16, 32, 64, 128) for dtype in ("float16", "bfloat16", "float32")])


@pytest.mark.parametrize("block_size, dtype", TENSOR_CORE_CASES)
@few
@given(data=st.data(), feature_axis=st.sampled_from([1, 0]))
def test_tensor_core_products_match_reference(data, block_size, dtype, feature_axis):
    """Version 5: products on tensor cores (mma.sync; fp32 as 3xTF32), weight gradient of version 4."""
    check_all_products(data, block_size, dtype, feature_axis, version=5)


def check_split_lines(data, block_size, feature_axis, max_segment, version):
    dtype = "float16" if version == 5 else "float32"
    layout, x, dy, w = data.draw(problems(block_size, dtype, kinds=("skewed", "full", "random")))
    x, dy = to_axis(x, feature_axis), to_axis(dy, feature_axis)
    splits = data.draw(st.integers(2, 4), label="splits")
    with poisoned_outputs():
        y = bsmm.api._product(bsmm.DEFAULT, x, w, layout, feature_axis, False, version, max_segment=max_segment)
        dx = bsmm.api._product(bsmm.DEFAULT, dy, w, layout, feature_axis, True, version, max_segment=max_segment)
        dw = bsmm.weight_grad(x, dy, layout, feature_axis, splits=splits)
    assert_products(y, dx, dw, x, dy, w, layout, feature_axis, dtype)


@pytest.mark.parametrize("version", [1, 3, 4] if SIMULATOR else [None, 4])
@few
@given(data=st.data(), block_size=st.sampled_from([8, 16] if SIMULATOR else BLOCKS),
       dtype=st.sampled_from(DTYPE_NAMES), feature_axis=st.sampled_from([1, 0]), split=st.booleans(),
       fp32_bias=st.sampled_from([False, True, None]), relu=st.booleans(), seed=st.integers(0, 2**16))
def test_forward_adds_the_bias(data, version, block_size, dtype, feature_axis, split, fp32_bias, relu, seed):
    """``bias``: one value an output feature, x's dtype or fp32 with 16-bit x (``fp32_bias`` None:
    no bias), added by the product's epilogue (version 7, the GPU's default at fp16/bf16) or a
    pass of its own, also where long lines are cut into segments (``split``: at most one block a
    segment); with ``relu`` the same place takes the max with 0."""
    layout, x, _, w = data.draw(problems(block_size, dtype))
    x = to_axis(x, feature_axis)
    bias_dtype = "float32" if fp32_bias and dtype in ("float16", "bfloat16") else dtype
    bias = None if fp32_bias is None else values(np.random.default_rng(seed), (layout.dense_shape[1],), bias_dtype)
    with poisoned_outputs():
        y = bsmm.api._product(bsmm.DEFAULT, x, w, layout, feature_axis, False, version,
                              max_segment=1 if split else None, bias=bias, relu=relu)
    assert y.dtype == x.dtype
    b64 = np.zeros(layout.dense_shape[1]) if bias is None else np.asarray(bias, np.float64)
    ax, aw = (np.abs(np.asarray(a, np.float64)) for a in (x, w))
    # (stored=1: a pass of its own adds the bias to the product already rounded to x's dtype)
    assert_close(y, reference.forward(x, w, layout, feature_axis, bias=b64, relu=relu), dtype, "forward",
                 magnitude=reference.forward(ax, aw, layout, feature_axis, bias=np.abs(b64)),
                 terms=layout.dense_shape[0] + 1, stored=1)
    if relu:
        assert (np.asarray(y, np.float64) >= 0).all()


@pytest.mark.parametrize("version", [1, 3] if SIMULATOR else [None, 4])
@few
@given(data=st.data(), block_size=st.sampled_from([8, 16] if SIMULATOR else BLOCKS),
       dtype=st.sampled_from(DTYPE_NAMES), feature_axis=st.sampled_from([1, 0]), fp32=st.booleans())
def test_weight_grad_returns_the_bias_gradient(data, version, block_size, dtype, feature_axis, fp32):
    """``dbias_dtype``: dy's sums over N beside dW (x's dtype, or fp32 with 16-bit x), also for
    block-columns with no block and for an empty layout; dW as without it."""
    layout, x, dy, w = data.draw(problems(block_size, dtype, kinds=("skewed", "random", "empty")))
    x, dy = to_axis(x, feature_axis), to_axis(dy, feature_axis)
    db_dtype = "float32" if fp32 and dtype in ("float16", "bfloat16") else dtype
    with poisoned_outputs():
        dw, db = bsmm.weight_grad(x, dy, layout, feature_axis, version=version, dbias_dtype=db_dtype)
    assert db.dtype == dw.dtype if db_dtype == dtype else np.asarray(db).dtype == np.float32
    assert_close(db, reference.bias_grad(dy, feature_axis), db_dtype, "bias_grad",
                 magnitude=reference.bias_grad(np.abs(np.asarray(dy, np.float64)), feature_axis),
                 terms=max(1, np.asarray(dy).shape[0 if feature_axis == 1 else 1]))
    if layout.n_blocks:
        np.testing.assert_array_equal(np.asarray(dw), np.asarray(bsmm.weight_grad(x, dy, layout, feature_axis,
                                                                                 version=version)))
    with pytest.raises(TypeError, match="dbias_dtype: expected one of"):
        bsmm.weight_grad(x, dy, layout, feature_axis, version=version, dbias_dtype="int8")


@pytest.mark.parametrize("version", [3] if SIMULATOR else [None, 4])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_relu_keeps_nan(version, dtype):
    """``relu``: a NaN product stays NaN (as torch's ReLU and the twin's ``np.maximum``), in
    every place that takes the ReLU (version 7's epilogue on the GPU by default)."""
    bs = 16 if SIMULATOR else 64
    layout = BlockLayout(np.array([[1, 0], [1, 1]]), bs)
    rng = np.random.default_rng(11)
    x, w = values(rng, (8, 2 * bs), dtype), values(rng, layout.w_shape, dtype)
    x[2, 0] = np.nan
    y = np.asarray(bsmm.forward(x, w, layout, version=version, relu=True), np.float64)
    want = reference.forward(x, w, layout, relu=True)
    np.testing.assert_array_equal(np.isnan(y), np.isnan(want))
    assert np.isnan(want).any() and (want == 0).any() and (y[~np.isnan(y)] >= 0).all()


@pytest.mark.parametrize("version", [3, 4])
@pytest.mark.parametrize("max_segment", [1, 2])
@few  # (six cases of the earlier versions: two examples each in the simulator)
@given(data=st.data(), block_size=st.sampled_from([8, 16, 32]), feature_axis=st.sampled_from([1, 0]))
def test_split_lines_and_split_rows_match_reference(data, block_size, feature_axis, max_segment, version):
    """Skewed layouts cut long lines into segments, and the weight gradient cuts N; both sum in order."""
    check_split_lines(data, block_size, feature_axis, max_segment, version)


@pytest.mark.parametrize("version", [3, 4] if SIMULATOR else [None, 4])
@few
@given(data=st.data(), block_size=st.sampled_from([8, 16] if SIMULATOR else BLOCKS),
       feature_axis=st.sampled_from([1, 0]), max_segment=st.sampled_from([None, 1, 2]))
def test_segments_launched_longest_first_give_the_same_bits(data, version, block_size, feature_axis, max_segment):
    """``longest_first``: the products' segments in another launch order (each names its line,
    blocks and workspace slot), so the outputs are the same bit for bit."""
    layout, x, dy, w = data.draw(problems(block_size, "float16", kinds=("skewed", "random")))
    x, dy = to_axis(x, feature_axis), to_axis(dy, feature_axis)
    sizes = {8, 16, 32, 64, 128}
    plain, cfg = replace(bsmm.DEFAULT, longest_first=frozenset()), replace(bsmm.DEFAULT, longest_first=sizes)
    for a, transpose_w in ((x, False), (dy, True)):
        want = bsmm.api._product(plain, a, w, layout, feature_axis, transpose_w, version, max_segment=max_segment)
        with poisoned_outputs():
            got = bsmm.api._product(cfg, a, w, layout, feature_axis, transpose_w, version, max_segment=max_segment)
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


# Every mma is a 32-thread rendezvous in the simulator: fewer cases there.
@pytest.mark.parametrize("max_segment", [1] if SIMULATOR else [1, 2])
@few
@given(data=st.data(), block_size=st.sampled_from([16, 32]), feature_axis=st.sampled_from([1, 0]))
def test_tensor_core_split_lines_match_reference(data, block_size, feature_axis, max_segment):
    """Version 5's products over segments of long lines, summed in order."""
    check_split_lines(data, block_size, feature_axis, max_segment, 5)


@pytest.mark.parametrize("version, block_size", [(1, 8), (3, 8), (4, 32)])
@pytest.mark.parametrize("splits", [1, 3])
@given(data=st.data())
def test_weight_grad_accumulates_into_out(data, splits, version, block_size):
    layout, x, dy, w = data.draw(problems(block_size, "float32"))
    beta = data.draw(st.sampled_from([1.0, 0.5, 0.0]), label="beta")
    previous = w.copy()
    out = cuda.to_device(previous)
    returned = bsmm.weight_grad(cuda.to_device(x), cuda.to_device(dy), layout, out=out, beta=beta,
                                version=version, splits=splits)
    assert returned is out
    want = reference.weight_grad(x, dy, layout) + beta * previous
    assert_close(out.copy_to_host(), want, "float32", "weight_grad into out")


@few
@given(data=st.data(), block_size=st.sampled_from([8, 16]))
def test_small_integers_are_exact(data, block_size):
    """Sums of small integers are exact in float32, so the kernels must agree bit for bit."""
    layout, x, dy, w = data.draw(problems(block_size, "float32", styles=("small_integers",)))
    np.testing.assert_array_equal(bsmm.forward(x, w, layout), reference.forward(x, w, layout))
    np.testing.assert_array_equal(bsmm.input_grad(dy, w, layout), reference.input_grad(dy, w, layout))
    np.testing.assert_array_equal(bsmm.weight_grad(x, dy, layout), reference.weight_grad(x, dy, layout))


@given(data=st.data(), block_size=st.sampled_from([8, 16]))
def test_forward_and_input_grad_are_adjoint(data, block_size):
    layout, x, dy, w = data.draw(problems(block_size, "float64"))
    lhs = np.sum(bsmm.forward(x, w, layout) * dy)
    assert lhs == pytest.approx(np.sum(x * bsmm.input_grad(dy, w, layout)), rel=1e-10, abs=1e-10)
    assert lhs == pytest.approx(np.sum(bsmm.weight_grad(x, dy, layout) * w), rel=1e-10, abs=1e-10)


@given(data=st.data())
def test_weight_grad_is_the_masked_dense_product(data):
    layout, x, dy, _ = data.draw(problems(8, "float64"))
    dense = np.where(layout.element_mask(), x.T @ dy, 0.0)
    np.testing.assert_allclose(layout.to_dense(bsmm.weight_grad(x, dy, layout)), dense, atol=1e-12)


@few  # (the simulator runs thread blocks one after another: repeatability is the GPU's question)
@given(data=st.data())
def test_results_are_bitwise_repeatable(data):
    layout, x, dy, w = data.draw(problems(8, "float32", styles=("normal",), kinds=("skewed", "random")))
    runs = [
        (bsmm.api._product(bsmm.DEFAULT, x, w, layout, 1, False, 3, max_segment=1),
         bsmm.api._product(bsmm.DEFAULT, dy, w, layout, 1, True, 3, max_segment=1),
         bsmm.weight_grad(x, dy, layout, splits=3))
        for _ in range(2)
    ]
    for first, second in zip(*runs):
        assert first.tobytes() == second.tobytes()


def test_empty_layout_and_zero_rows():
    empty = BlockLayout(np.zeros((2, 3)), 8)
    x = np.ones((4, 16), np.float32)
    with poisoned_outputs():
        assert not bsmm.forward(x, np.zeros((0, 8, 8), np.float32), empty).any()
        assert bsmm.weight_grad(x, np.ones((4, 24), np.float32), empty).shape == (0, 8, 8)
        layout = BlockLayout.dense((2, 3), 8)
        w = np.ones(layout.w_shape, np.float32)
        assert bsmm.forward(np.ones((0, 16), np.float32), w, layout).shape == (0, 24)
        assert bsmm.forward(np.ones((16, 0), np.float32), w, layout, feature_axis=0).shape == (24, 0)
        assert not bsmm.weight_grad(np.ones((0, 16), np.float32), np.ones((0, 24), np.float32), layout).any()


def test_device_arrays_in_device_arrays_out():
    layout = BlockLayout.random((2, 2), 0.5, seed=3, block_size=8)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((5, 16)).astype(np.float32)
    w = rng.standard_normal(layout.w_shape).astype(np.float32)
    y = bsmm.forward(cuda.to_device(x), cuda.to_device(w), layout)
    assert not isinstance(y, np.ndarray)
    assert_close(y.copy_to_host(), reference.forward(x, w, layout), np.float32)


def misaligned(array, offset=1):
    """A contiguous device copy of `array` whose data starts `offset` elements past an aligned address."""
    storage = cuda.to_device(np.zeros(array.size + offset, array.dtype))
    view = storage[offset:].reshape(array.shape)
    view.copy_to_device(np.ascontiguousarray(array))
    return view


@pytest.mark.parametrize("feature_axis", [1, 0])
def test_vector_loads_only_where_aligned(feature_axis):
    """Version 4 reads 4 values per load only from aligned pointers (and, on axis 0, N in
    whole vectors); the others take scalar loads, with the same results."""
    layout = BlockLayout.random((2, 2), 0.75, seed=3, block_size=32)
    rng = np.random.default_rng(0)
    C, K = layout.dense_shape
    w = rng.standard_normal(layout.w_shape).astype(np.float32)
    for n in (7, 8):
        x = to_axis(rng.standard_normal((n, C)).astype(np.float32), feature_axis)
        dy = to_axis(rng.standard_normal((n, K)).astype(np.float32), feature_axis)
        aligned = (cuda.to_device(x), cuda.to_device(w))
        assert bsmm.dispatch.vector_loads(bsmm.DEFAULT, aligned, n, feature_axis) == (feature_axis == 1 or n % 4 == 0)
        assert not bsmm.dispatch.vector_loads(bsmm.DEFAULT, (misaligned(x), aligned[1]), n, feature_axis)
        assert not bsmm.dispatch.vector_loads(bsmm.DEFAULT, (aligned[0], misaligned(w, 2)), n, feature_axis, (4, 4))
    # Misaligned operands: every load scalar, the same results (version 5's load paths:
    # test_tensor_core_load_paths).
    xs, ws, dys = misaligned(x), misaligned(w, 2), misaligned(dy)
    y = bsmm.forward(xs, ws, layout, feature_axis, version=4).copy_to_host()
    dx = bsmm.input_grad(dys, ws, layout, feature_axis, version=4).copy_to_host()
    dw = bsmm.weight_grad(xs, dys, layout, feature_axis, version=4).copy_to_host()
    assert_close(y, reference.forward(x, w, layout, feature_axis), "float32", "forward")
    assert_close(dx, reference.input_grad(dy, w, layout, feature_axis), "float32", "input_grad")
    assert_close(dw, reference.weight_grad(x, dy, layout, feature_axis), "float32", "weight_grad")


@pytest.mark.parametrize("block_size, dtype, feature_axis, n, offset, vector", [
    (16, "float16", 1, 9, 0, True),
    (16, "float16", 0, 16, 0, True),  # axis 0: 16-byte loads of 8 rows need N % 8 == 0
    (16, "bfloat16", 0, 9, 0, False),
    (16, "float16", 1, 9, 1, False),  # 2 bytes past an aligned address: one value a load
    (16, "float32", 0, 12, 0, True),  # axis 0, fp32: N % 4 == 0
    (16, "float32", 1, 5, 1, False),
    gpu_only_case(64, "float16", 1, 3, 0, True),  # (the simulator: test_products_match_reference's block 64)
])
def test_tensor_core_load_paths(block_size, dtype, feature_axis, n, offset, vector):
    """Version 5 reads 16 bytes a load only where pointers and N allow, and gives the
    reference's products either way (a fixed, non-empty problem per path)."""
    from strategies import numpy_dtype

    layout = BlockLayout.dense((2, 1) if block_size < 64 else (1, 1), block_size)
    rng = np.random.default_rng(block_size + n)
    C, K = layout.dense_shape
    cast = numpy_dtype(dtype)
    x = to_axis(rng.standard_normal((n, C)).astype(cast), feature_axis)
    dy = to_axis(rng.standard_normal((n, K)).astype(cast), feature_axis)
    w = rng.standard_normal(layout.w_shape).astype(cast)
    # bf16 goes in as host arrays (the launcher's int16 views); the others as device copies,
    # `offset` elements past an aligned address.
    ops = (x, dy, w) if dtype == "bfloat16" else tuple(
        misaligned(a, offset) if offset else cuda.to_device(a) for a in (x, dy, w))
    if dtype != "bfloat16":
        values = 1 if dtype == "float32" else 2
        assert bsmm.dispatch.v5_vector_loads(bsmm.DEFAULT, (ops[0], ops[2]), n, feature_axis, values) == vector
    y = bsmm.forward(ops[0], ops[2], layout, feature_axis, version=5)
    dx = bsmm.input_grad(ops[1], ops[2], layout, feature_axis, version=5)
    y, dx = (r if isinstance(r, np.ndarray) else r.copy_to_host() for r in (y, dx))
    assert_close(y, reference.forward(x, w, layout, feature_axis), dtype, "forward")
    assert_close(dx, reference.input_grad(dy, w, layout, feature_axis), dtype, "input_grad")


@pytest.mark.parametrize("stages, words, dtype, weight_rows", [
    (2, None, "float32", True), (2, None, "float16", True), (4, None, "float16", True), (3, 8, "float32", True),
    (3, None, "float16", False),
])
def test_tensor_core_stage_counts(configure, monkeypatch, stages, words, dtype, weight_rows):
    """Version 5 with two stages (every load through registers), or a deeper cp.async ring, or
    half a block a stage (the ring wraps inside a block), or input_grad's weights through
    registers in the ring, gives the reference's products; N = 9 leaves most of the 128-row
    tile past the end."""
    configure(bsmm, v5_stages=stages)
    configure(bsmm, v5_weight_registers=set() if weight_rows else {(16, dtype)})
    configure(bsmm, v5_stage_words={} if words is None else {(16, dtype): words})
    layout = BlockLayout.dense((2, 1), 16)
    rng = np.random.default_rng(9)
    x = rng.standard_normal((9, 32)).astype(dtype)
    dy = rng.standard_normal((9, 16)).astype(dtype)
    w = rng.standard_normal(layout.w_shape).astype(dtype)
    xs, dys, ws = (cuda.to_device(a) for a in (x, dy, w))
    assert bsmm.dispatch.v5_vector_loads(bsmm.DEFAULT, (xs, ws), 9, 1, 1)
    y = bsmm.forward(xs, ws, layout, version=5).copy_to_host()
    dx = bsmm.input_grad(dys, ws, layout, version=5).copy_to_host()
    assert_close(y, reference.forward(x, w, layout), dtype, "forward")
    assert_close(dx, reference.input_grad(dy, w, layout), dtype, "input_grad")


@few
@given(data=st.data(), block_size=st.sampled_from([8, 16]), dtype=st.sampled_from(["float32", "float16", "bfloat16"]))
def test_transposed_blocks_match_reference(data, block_size, dtype):
    """W's blocks transposed into column order, bit for bit, empty layouts included."""
    layout = data.draw(layouts(block_sizes=(block_size,), max_blocks=MAX_BLOCKS[block_size]))
    w = data.draw(arrays(layout.w_shape, dtype, ("normal",)), label="w")
    with poisoned_outputs():
        wt = bsmm.transpose_blocks(w, layout)
    want = reference.transpose_blocks(w, layout)
    assert wt.dtype == want.dtype and wt.shape == want.shape
    assert np.array_equal(wt.view(np.uint8), want.view(np.uint8))


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("mask", [[[1, 1], [1, 0]], [[1, 0], [1, 0]]])
def test_forward_through_transposed_blocks(configure, monkeypatch, dtype, mask):
    """The forward that first transposes W's blocks into column order (V5_TRANSPOSED_FORWARD)
    gives the reference's product: blocks out of row order, and an output column with none."""
    from strategies import numpy_dtype

    configure(bsmm, v5_transposed_forward={(16, dtype): 1})
    layout = BlockLayout(np.array(mask, bool), 16)
    rng = np.random.default_rng(4)
    x = rng.standard_normal((9, 32)).astype(numpy_dtype(dtype))
    w = rng.standard_normal(layout.w_shape).astype(numpy_dtype(dtype))
    made = []
    original = bsmm.dispatch.launch_transpose_blocks
    monkeypatch.setattr(bsmm.dispatch, "launch_transpose_blocks", lambda *args: made.append(1) or original(*args))
    with poisoned_outputs():
        y = bsmm.forward(x, w, layout, version=5)
    assert made, "the forward did not take the transposed copy"
    assert_close(y, reference.forward(x, w, layout), dtype, "forward")


@pytest.mark.parametrize("warps, warp_rows, dtype", [(2, 64, "float16")])
def test_tensor_core_warp_patches(configure, monkeypatch, warps, warp_rows, dtype):
    """Version 5 products with other warp patches (V5_WARP_ROWS rows a warp: four mma rows, as
    the ring's block 64 has) and warps a thread block give the reference's products, over two
    tiles and part of a third."""
    configure(bsmm, v5_warps={**bsmm.DEFAULT.v5_warps, 16: warps})
    configure(bsmm, v5_warp_rows={**bsmm.DEFAULT.v5_warp_rows, 16: warp_rows})
    layout = BlockLayout(np.array([[1, 0], [1, 1]], bool), 16)
    n = 2 * bsmm.tensorcore.v5_shape(bsmm.config.DEFAULT, 16, dtype)[1] + 3
    rng = np.random.default_rng(5)
    x = rng.standard_normal((n, 32)).astype(dtype)
    w = rng.standard_normal(layout.w_shape).astype(dtype)
    assert_close(bsmm.forward(x, w, layout, version=5), reference.forward(x, w, layout), dtype, "forward")
    assert_close(bsmm.input_grad(x, w, layout, version=5), reference.input_grad(x, w, layout),
                 dtype, "input_grad")


@cuda.jit
def _record_grouped_tiles(seen, group):
    """seen[launch order id] = (row tile, segment) of each thread block."""
    tile, seg = bsmm.device.grouped_tile(group)
    i = cuda.blockIdx.x + cuda.blockIdx.y * cuda.gridDim.x
    seen[i, 0] = tile
    seen[i, 1] = seg


@pytest.mark.parametrize("tiles, segments, group", [(5, 3, 2), (7, 4, 3), (4, 2, 8), (6, 1, 4), (3, 5, 0)])
def test_grouped_tiles_cover_every_tile_once(tiles, segments, group):
    """The products' grouped launch order hands every (row tile, segment) pair to exactly one
    thread block, group row tiles at a time."""
    seen = cuda.to_device(np.full((tiles * segments, 2), -1, np.int32))
    _record_grouped_tiles[(tiles, segments), 1](seen, group)
    order = [tuple(pair) for pair in seen.copy_to_host()]
    assert sorted(order) == [(t, s) for t in range(tiles) for s in range(segments)]
    if 0 < group < tiles:  # the first thread blocks stay within the first group's row tiles
        assert {t for t, _ in order[:group * segments]} == set(range(group))


@pytest.mark.parametrize("version, dtype", [(4, "float32"), gpu_only_case(5, "float16")])
def test_grouped_products_match_reference(configure, monkeypatch, version, dtype):
    """Products over three row tiles in groups of two (the last group short) give the
    reference's products."""
    configure(bsmm, product_group=2)
    layout = BlockLayout(np.array([[1, 1], [0, 1]], bool), 16)
    tile = bsmm.DEFAULT.v4_rows[16] if version == 4 else bsmm.tensorcore.v5_shape(bsmm.config.DEFAULT, 16, dtype)[1]
    n = 2 * tile + 5
    rng = np.random.default_rng(3)
    x = rng.standard_normal((n, 32)).astype(dtype)
    w = rng.standard_normal(layout.w_shape).astype(dtype)
    assert_close(bsmm.forward(x, w, layout, version=version), reference.forward(x, w, layout), dtype, "forward")
    assert_close(bsmm.input_grad(x, w, layout, version=version), reference.input_grad(x, w, layout),
                 dtype, "input_grad")


def test_tensor_core_rounded_sums(configure, monkeypatch):
    """fp32 on version 5 with V5_ROUNDED_SUMS (each mma from zero, added in fp32) gives the
    reference's products too."""
    configure(bsmm, v5_rounded_sums=True)
    layout = BlockLayout.dense((2, 1), 16)
    rng = np.random.default_rng(5)
    x = rng.standard_normal((6, 32)).astype(np.float32)
    w = rng.standard_normal(layout.w_shape).astype(np.float32)
    assert_close(bsmm.forward(x, w, layout, version=5), reference.forward(x, w, layout), "float32", "forward")


@pytest.mark.parametrize("dtype, bits", [  # (the simulator's 3xTF32 is float64 products: one pattern there)
    ("float32", 0x7FFFFFFF), pytest.param("float32", 0xFFFFFFFF, marks=pytest.mark.gpu),
    pytest.param("float32", 0x7FC00000, marks=pytest.mark.gpu), ("float16", None)])
def test_tensor_core_products_keep_a_nan(dtype, bits):
    """A NaN in x and one in dy come out of the three products where the reference's do. The
    GPU's own NaN (0x7FFFFFFF) once left 3xTF32's split by the bits as -0 and a finite product."""
    layout = BlockLayout(np.array([[1, 0], [1, 1]], bool), 16)
    rng = np.random.default_rng(8)
    x = rng.standard_normal((24, 32)).astype(dtype)
    dy = rng.standard_normal((24, 32)).astype(dtype)
    w = rng.standard_normal(layout.w_shape).astype(dtype)
    nan = np.array([bits], np.uint32).view(np.float32)[0] if bits is not None else np.nan
    x[5, 20], dy[9, 3] = nan, nan
    for got, want in ((bsmm.forward(x, w, layout, version=5), reference.forward(x, w, layout)),
                      (bsmm.input_grad(dy, w, layout, version=5), reference.input_grad(dy, w, layout)),
                      (bsmm.weight_grad(x, dy, layout, version=5), reference.weight_grad(x, dy, layout))):
        assert np.isnan(want).any() and not np.isnan(want).all()
        np.testing.assert_array_equal(np.isnan(got), np.isnan(want))


ROW_GROUPS = ((1, 1, 1), (0, 0, 0), (1, 0, 1))  # rows of 3, 0 and 2 blocks: full, empty and short groups


@pytest.mark.parametrize("block_size, dtype, feature_axis, n, offset, splits, beta, stages, group", [
    (16, "float16", 1, 37, 0, None, 0.0, 2, 1),  # 16-byte loads, an odd N: the last pair half empty
    (16, "float16", 0, 40, 0, None, 0.0, 2, 1),  # axis 0: 8-row vectors
    (16, "bfloat16", 0, 9, 0, None, 0.0, 2, 1),  # axis 0, N % 8 != 0: one value a load
    (16, "float16", 1, 9, 1, None, 0.0, 2, 1),  # misaligned: one value a load
    (32, "float16", 1, 70, 0, 2, 0.5, 2, 1),  # two N-splits (cut at whole steps), summed in order, + beta·out
    (16, "float32", 1, 21, 0, None, 0.0, 2, 1),  # 3xTF32: 16-byte loads of one row
    (16, "float32", 0, 20, 0, None, 0.0, 2, 1),  # axis 0: 4-row vectors
    (16, "float32", 0, 9, 0, None, 0.0, 2, 1),  # axis 0, N % 4 != 0: one value a load
    (32, "float32", 1, 40, 0, 2, 0.5, 3, 1),  # two N-splits of fp32 steps, + beta·out; a ring of 3
    (16, "float32", 1, 70, 0, None, 0.0, 4, 1),  # five steps through a ring of four cp.async buffers
    (128, "float32", 1, 20, 0, None, 0.0, 2, 1),  # block 128: a block's 16 patches on four thread blocks
    # Row segments of 2 blocks a warp (V5_WGRAD_GROUP) over rows of 3, 0 and 2 blocks:
    (16, "float16", 1, 37, 0, None, 0.0, 2, 2),
    (16, "float16", 0, 40, 0, None, 0.0, 2, 2),
    (32, "float16", 1, 70, 0, 2, 0.5, 2, 2),
    (16, "float32", 1, 70, 0, None, 0.0, 4, 2),
    (16, "float32", 0, 20, 0, None, 0.0, 2, 2),
])
def test_tensor_core_weight_grad(configure, monkeypatch, block_size, dtype, feature_axis, n, offset, splits, beta, stages,
                                 group):
    """Version 5's weight gradient on tensor cores (V5_WGRAD) against the reference (stages:
    the fp32 cp.async ring's buffers; group: blocks of a row a warp takes, over rows of 3, 0
    and 2 blocks)."""
    from strategies import numpy_dtype

    configure(bsmm, v5_wgrad=True)
    configure(bsmm, v5_wgrad_stages=stages)
    configure(bsmm, v5_wgrad_group={16: group, 32: group})
    if group > 1:
        layout = BlockLayout(ROW_GROUPS, block_size)
    else:
        layout = BlockLayout.dense((2, 1) if block_size < 32 else (1, 2) if block_size == 128 else (1, 1), block_size)
    rng = np.random.default_rng(n)
    C, K = layout.dense_shape
    cast = numpy_dtype(dtype)
    x = to_axis(rng.standard_normal((n, C)).astype(cast), feature_axis)
    dy = to_axis(rng.standard_normal((n, K)).astype(cast), feature_axis)
    previous = rng.standard_normal(layout.w_shape).astype(cast)
    want = reference.weight_grad(x, dy, layout, feature_axis) + beta * previous.astype(np.float64)
    if dtype == "bfloat16":
        dw = bsmm.weight_grad(x, dy, layout, feature_axis, version=5, splits=splits)
    else:
        ops = [misaligned(a, offset) if offset else cuda.to_device(a) for a in (x, dy)]
        out = cuda.to_device(previous)
        dw = bsmm.weight_grad(*ops, layout, feature_axis, out=out, beta=beta, version=5,
                              splits=splits).copy_to_host()
    assert_close(dw, want, dtype, "weight_grad")
    assert any(key[0] is bsmm.weight_grad_tensorcore.make_weight_grad_v5 for key in compile_cache._kernels)


@pytest.mark.parametrize("version, block_size", [(1, 8), (3, 8), (4, 32), (5, 16), (6, 16), (7, 64)])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_weight_grad_in_fp32_from_16_bit_inputs(version, block_size, dtype):
    """``out_dtype="float32"`` (OpenAI's dw_dtype): dW stored from the fp32 sums, within fp32's
    rounding of the exact sums of the 16-bit products (a 16-bit dW would be 2⁸-2¹⁶ times coarser);
    an fp32 ``out`` with ``beta`` the same. Version 7 runs on Hopper (else the next one down)."""
    from strategies import numpy_dtype

    if SIMULATOR and version == 7 and dtype == "bfloat16":
        pytest.skip("the fp16 case covers version 7's path in the simulator; runs on the GPU")
    layout = BlockLayout(np.array([[1, 0], [1, 1]]), block_size)
    rng = np.random.default_rng(version)
    C, K = layout.dense_shape
    n = 24
    x = rng.standard_normal((n, C)).astype(numpy_dtype(dtype))
    dy = rng.standard_normal((n, K)).astype(numpy_dtype(dtype))
    want = reference.weight_grad(x, dy, layout)
    splits = 2 if version >= 3 else None  # (the combine kernel's store as well)
    dw = bsmm.weight_grad(x, dy, layout, version=version, splits=splits, out_dtype="float32")
    assert dw.dtype == np.float32
    assert_close(dw, want, "float32", "fp32 weight_grad", terms=n)
    if dtype == "bfloat16":
        return  # (device arrays of ml_dtypes' bf16 are not made here: out= takes fp16's)
    previous = rng.standard_normal(layout.w_shape).astype(np.float32)
    out = cuda.to_device(previous)
    bsmm.weight_grad(cuda.to_device(x), cuda.to_device(dy), layout, out=out, beta=0.5, version=version)
    assert_close(out.copy_to_host(), want + 0.5 * previous, "float32", "fp32 weight_grad into out", terms=n)


LAYOUT = BlockLayout.dense((2, 3), 8)
X = np.ones((4, 16), np.float32)
W = np.ones(LAYOUT.w_shape, np.float32)
DY = np.ones((4, 24), np.float32)


def _weight_grad_over(shared):
    """weight_grad into an out= that shares memory with x or dy (`shared`)."""
    buffer = cuda.to_device(np.ones(LAYOUT.w_shape[0] * 64 + 96, np.float32))
    out = buffer[:W.size].reshape(LAYOUT.w_shape)
    x = buffer[W.size - 64:W.size].reshape(X.shape) if shared == "x" else cuda.to_device(X)
    dy = buffer[W.size - 8:W.size + 88].reshape(DY.shape) if shared == "dy" else cuda.to_device(DY)
    return bsmm.weight_grad(x, dy, LAYOUT, out=out)


@pytest.mark.parametrize("call, error, message", [
    (lambda: bsmm.forward(X, W, LAYOUT, feature_axis=2), ValueError, "feature_axis"),
    (lambda: bsmm.forward(X[:, :8], W, LAYOUT), ValueError, "x: expected 16 features"),
    (lambda: bsmm.forward(X, W, LAYOUT, feature_axis=0), ValueError, "x: expected 16 features on axis 0"),
    (lambda: bsmm.forward(X.ravel(), W, LAYOUT), ValueError, "x: expected a 2-D"),
    (lambda: bsmm.forward(X, W[:5], LAYOUT), ValueError, "w: expected shape"),
    (lambda: bsmm.forward(X, W.astype(np.float64), LAYOUT), TypeError, "dtype mismatch"),
    (lambda: bsmm.forward(X.astype(np.int32), W, LAYOUT), TypeError, "x: expected dtype"),
    (lambda: bsmm.forward(X.tolist(), W, LAYOUT), TypeError, "x: expected a NumPy array"),
    (lambda: bsmm.input_grad(X, W, LAYOUT), ValueError, "dy: expected 24 features"),
    (lambda: bsmm.weight_grad(X, DY[:3], LAYOUT), ValueError, "same N"),
    (lambda: bsmm.weight_grad(X, X, LAYOUT), ValueError, "dy: expected 24 features"),
    (lambda: bsmm.weight_grad(X, DY, LAYOUT, beta=1.0), ValueError, "beta"),
    (lambda: bsmm.weight_grad(X, DY, LAYOUT, beta="one"), TypeError, "beta"),
    (lambda: bsmm.weight_grad(X, DY, LAYOUT, out=W.copy()), TypeError, "out: expected a device array"),
    (lambda: bsmm.weight_grad(X, DY, LAYOUT, out=W[:2]), ValueError, "out: expected shape"),
    (lambda: bsmm.weight_grad(X, DY, LAYOUT, out_dtype="float16"), TypeError,
     r"out_dtype: expected dtype in \['float32'\]"),
    (lambda: bsmm.weight_grad(cuda.to_device(X), cuda.to_device(DY), LAYOUT, out=cuda.to_device(W),
                              out_dtype="float64"), ValueError, "out: expected out_dtype float64"),
    (lambda: _weight_grad_over("x"), ValueError, "out: shares memory with x"),
    (lambda: _weight_grad_over("dy"), ValueError, "out: shares memory with dy"),
    (lambda: bsmm.forward(X, W, LAYOUT, version=8), ValueError, "version"),
    (lambda: bsmm.forward(X, W, LAYOUT, bias=np.ones(23, np.float32)), ValueError, r"bias: expected shape \(24,\)"),
    (lambda: bsmm.forward(X, W, LAYOUT, bias=np.ones((1, 24), np.float32)), ValueError, "bias: expected shape"),
    (lambda: bsmm.forward(X, W, LAYOUT, bias=np.ones(24)), TypeError, r"bias: expected dtype in \['float32'\]"),
    (lambda: bsmm.forward(X.astype(np.float16), W.astype(np.float16), LAYOUT, bias=np.ones(24)), TypeError,
     r"bias: expected dtype in \['float16', 'float32'\]"),
    (lambda: bsmm.forward(X, W, LAYOUT, bias=cuda.to_device(np.ones(24, np.float32))), TypeError, "one kind"),
    (lambda: bsmm.forward(X, W, LAYOUT, bias=[1.0] * 24), TypeError, "bias: expected a NumPy array"),
    (lambda: bsmm.transpose_blocks(W.astype(np.float64), LAYOUT), TypeError, "w: expected dtype"),
    (lambda: bsmm.transpose_blocks(W[:5], LAYOUT), ValueError, "w: expected shape"),
    (lambda: bsmm.transpose_blocks(misaligned(W.astype(np.float16)), LAYOUT), ValueError, "4-byte aligned"),
    (lambda: bsmm.forward(X, W, LAYOUT.mask), TypeError, "layout: expected a BlockLayout, got ndarray"),
    (lambda: bsmm.input_grad(X, W, "causal"), TypeError, "layout: expected a BlockLayout, got str"),
    (lambda: bsmm.weight_grad(X, X, None), TypeError, "layout: expected a BlockLayout, got NoneType"),
    (lambda: bsmm.transpose_blocks(W, LAYOUT.mask), TypeError, "layout: expected a BlockLayout"),
    (lambda: bsmm.identity_init(LAYOUT.mask, W), TypeError, "layout: expected a BlockLayout"),
    (lambda: bsmm.ortho_init(LAYOUT.mask, W), TypeError, "layout: expected a BlockLayout"),
    (lambda: bsmm.l2_normalize(W, LAYOUT.mask), TypeError, "layout: expected a BlockLayout"),
    (lambda: bsmm.l2_normalize_grad(W, W, LAYOUT.mask), TypeError, "layout: expected a BlockLayout"),
])
def test_bad_input_raises_before_launch(call, error, message):
    with pytest.raises(error, match=message):
        call()


def test_mixed_kinds_are_refused():
    with pytest.raises(TypeError, match="one kind"):
        bsmm.forward(X, cuda.to_device(W), LAYOUT)


def test_non_contiguous_device_array_is_refused():
    wide = cuda.to_device(np.ones((4, 32), np.float32))
    with pytest.raises(ValueError, match="C-contiguous"):
        bsmm.forward(wide[:, :16], cuda.to_device(W), LAYOUT)


@pytest.mark.gpu
def test_torch_tensors_in_torch_tensors_out():
    torch = pytest.importorskip("torch")
    layout = BlockLayout.random((4, 4), 0.5, seed=1, block_size=16)
    x = torch.randn(33, 64, device="cuda")
    w = torch.randn(layout.w_shape, device="cuda")
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        y = bsmm.forward(x, w, layout)
        dw = bsmm.weight_grad(x, y, layout)
    stream.synchronize()
    assert isinstance(y, torch.Tensor) and y.device == x.device
    assert_close(y.cpu().numpy(), reference.forward(x.cpu().numpy(), w.cpu().numpy(), layout), np.float32)
    want = reference.weight_grad(x.cpu().numpy(), y.cpu().numpy(), layout)
    assert_close(dw.cpu().numpy(), want, np.float32)


@pytest.mark.gpu
def test_torch_bfloat16_crosses_as_bits():
    torch = pytest.importorskip("torch")
    layout = BlockLayout.random((3, 2), 0.5, seed=2, block_size=32)
    x = torch.randn(70, 96, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(layout.w_shape, device="cuda", dtype=torch.bfloat16)
    y = bsmm.forward(x, w, layout)
    assert y.dtype == torch.bfloat16
    want = reference.forward(x.float().cpu().numpy(), w.float().cpu().numpy(), layout)
    assert_close(y.float().cpu().numpy(), want, "bfloat16")


@pytest.mark.gpu
@pytest.mark.skipif(SIMULATOR, reason="kept plans replay through the driver")
@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_repeated_torch_calls_replay_a_kept_plan(configure, dtype, transposed, monkeypatch):
    """The second product call with tensors like the first goes through a kept plan (new
    pointers, new output; with `transposed`, the forward's copy of W replayed too); anything
    a check or the kernel's choice depends on does not."""
    torch = pytest.importorskip("torch")
    monkeypatch.setattr(plans, "kept", {})
    # (the transposed copy is version 5's: with it, calls default to version 5)
    configure(bsmm, v5_transposed_forward={(32, dtype): 1} if transposed else {},
              **({"tiles_default": frozenset()} if transposed else {}))
    layout = BlockLayout.random((3, 2), 0.5, seed=4, block_size=32)
    tdtype = getattr(torch, dtype)

    def check(y, x, w, transpose_w=False):
        x64, w64 = x.double().cpu().numpy(), w.double().cpu().numpy()
        want = reference.input_grad(x64, w64, layout) if transpose_w else reference.forward(x64, w64, layout)
        assert y.dtype == tdtype
        assert_close(y.double().cpu().numpy(), want, dtype)

    w = torch.randn(layout.w_shape, device="cuda", dtype=tdtype)
    for _ in range(2):  # the first call keeps a plan, the second replays it
        x = torch.randn(70, 96, device="cuda", dtype=tdtype)
        check(bsmm.forward(x, w, layout), x, w)
        dy = torch.randn(70, 64, device="cuda", dtype=tdtype)
        check(bsmm.input_grad(dy, w, layout), dy, w, transpose_w=True)
    assert len(plans.kept) == 2
    assert sum(plan.pre is not None for plan in plans.kept.values()) == transposed
    replayed = []
    original = bsmm.api.replayed_product
    monkeypatch.setattr(bsmm.api, "replayed_product", lambda *a: replayed.append(original(*a)) or replayed[-1])
    x = torch.randn(70, 96, device="cuda", dtype=tdtype)
    check(bsmm.forward(x, w, layout), x, w)
    assert replayed[-1] is not None
    # A pointer of another alignment, another N, a weight that requires grad: all right results.
    wide = torch.randn(71 * 96 + 1, device="cuda", dtype=tdtype)
    shifted = wide[1:70 * 96 + 1].view(70, 96)
    check(bsmm.forward(shifted, w, layout), shifted, w)
    assert replayed[-1] is None
    x = torch.randn(5, 96, device="cuda", dtype=tdtype)
    check(bsmm.forward(x, torch.nn.Parameter(w), layout), x, w)
    # The checks still run: a transposed view is refused, not replayed.
    x = torch.randn(96, 70, device="cuda", dtype=tdtype).T
    with pytest.raises(ValueError, match="C-contiguous"):
        bsmm.forward(x, w, layout)


# A layout whose first block-column and first block-row are long against the mean: the forward
# cuts that output line into segments (a workspace and a combining launch), the input gradient that row.
SEGMENTED = BlockLayout(np.eye(8, dtype=bool)[0][:, None] | np.eye(8, dtype=bool)[0][None, :], 32)


@pytest.mark.gpu
@pytest.mark.skipif(SIMULATOR, reason="kept plans replay through the driver")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_segmented_products_replay_a_kept_plan(dtype, monkeypatch):
    """Products whose lines are cut into segments keep a plan too (the segments' workspace and the
    combining launch with it; the forward with an fp32 bias too), and its replays give the
    reference's results."""
    torch = pytest.importorskip("torch")
    from sparseblocks.bsmm.dispatch import product_schedule

    monkeypatch.setattr(plans, "kept", {})
    assert all(product_schedule(bsmm.DEFAULT, SEGMENTED, t, None, 0)[0] > 0 for t in (False, True))
    tdtype = getattr(torch, dtype)
    replayed = []
    original = bsmm.api.replayed_product
    monkeypatch.setattr(bsmm.api, "replayed_product", lambda *a: replayed.append(original(*a)) or replayed[-1])
    w = torch.randn(SEGMENTED.w_shape, device="cuda", dtype=tdtype)
    bias = torch.randn(256, device="cuda", dtype=torch.float32)
    for _ in range(3):
        x = torch.randn(130, 256, device="cuda", dtype=tdtype)
        x64, w64 = x.double().cpu().numpy(), w.double().cpu().numpy()
        assert_close(bsmm.forward(x, w, SEGMENTED).double().cpu().numpy(), reference.forward(x64, w64, SEGMENTED),
                     dtype)
        assert_close(bsmm.forward(x, w, SEGMENTED, bias=bias).double().cpu().numpy(),
                     reference.forward(x64, w64, SEGMENTED, bias=bias.double().cpu().numpy()), dtype)
        dy = torch.randn(130, 256, device="cuda", dtype=tdtype)
        dy64 = dy.double().cpu().numpy()
        assert_close(bsmm.input_grad(dy, w, SEGMENTED).double().cpu().numpy(),
                     reference.input_grad(dy64, w64, SEGMENTED), dtype)
    assert len(plans.kept) == 3 and all(plan.combine is not None for plan in plans.kept.values())
    assert sum(r is not None for r in replayed) == 6


@pytest.mark.gpu
@pytest.mark.skipif(SIMULATOR, reason="kept plans replay through the driver")
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_repeated_weight_grads_replay_a_kept_plan(dtype, monkeypatch):
    """Weight gradients repeated with torch tensors like the first replay a kept plan: a new
    dW, or into out= with beta, over one slice of N (one launch) or three (and the combining
    launch); each result is the reference's."""
    torch = pytest.importorskip("torch")
    monkeypatch.setattr(plans, "kept", {})
    layout = BlockLayout.random((3, 2), 0.5, seed=4, block_size=32)
    tdtype = getattr(torch, dtype)
    replayed = []
    original = bsmm.api.replayed_weight_grad
    monkeypatch.setattr(bsmm.api, "replayed_weight_grad", lambda *a: replayed.append(original(*a)) or replayed[-1])
    for splits in (1, 3):
        for _ in range(3):  # the first call of each kind keeps a plan, the next two replay it
            x = torch.randn(200, 96, device="cuda", dtype=tdtype)
            dy = torch.randn(200, 64, device="cuda", dtype=tdtype)
            want = reference.weight_grad(x.double().cpu().numpy(), dy.double().cpu().numpy(), layout)
            assert_close(bsmm.weight_grad(x, dy, layout, splits=splits).double().cpu().numpy(), want, dtype)
            out = torch.randn(layout.w_shape, device="cuda", dtype=tdtype)
            before = out.double().cpu().numpy()
            assert bsmm.weight_grad(x, dy, layout, out=out, beta=0.5, splits=splits) is out
            assert_close(out.double().cpu().numpy(), want + 0.5 * before, dtype)
    assert len(plans.kept) == 4 and sum(r is not None for r in replayed) == 8
    # Another N is another plan's: still the right result.
    x, dy = (torch.randn(33, f, device="cuda", dtype=tdtype) for f in (96, 64))
    want = reference.weight_grad(x.double().cpu().numpy(), dy.double().cpu().numpy(), layout)
    assert_close(bsmm.weight_grad(x, dy, layout, splits=3).double().cpu().numpy(), want, dtype)
    assert replayed[-1] is None


@pytest.mark.gpu
@pytest.mark.skipif(SIMULATOR, reason="kept plans replay through the driver")
@pytest.mark.parametrize("dtype, block_size", [("bfloat16", 128), ("float16", 64), ("float32", 32)])
def test_repeated_bias_gradients_replay_a_kept_plan(dtype, block_size, monkeypatch):
    """The weight gradient with the bias gradient, repeated: replays give the reference's dW and
    db (block 128 at 16-bit: summed by version 7's weight gradient, a block-column without blocks
    by the column-sum pass; the others by that pass alone)."""
    torch = pytest.importorskip("torch")
    monkeypatch.setattr(plans, "kept", {})
    layout = BlockLayout(np.array([[1, 0, 1], [1, 0, 0]]), block_size)
    tdtype = getattr(torch, dtype)
    replayed = []
    original = bsmm.api.replayed_weight_grad
    monkeypatch.setattr(bsmm.api, "replayed_weight_grad", lambda *a: replayed.append(original(*a)) or replayed[-1])
    C, K = layout.dense_shape
    for _ in range(3):
        x = torch.randn(1000, C, device="cuda", dtype=tdtype)
        dy = torch.randn(1000, K, device="cuda", dtype=tdtype)
        dw, db = bsmm.weight_grad(x, dy, layout, dbias_dtype="float32")
        x64, dy64 = x.double().cpu().numpy(), dy.double().cpu().numpy()
        assert_close(dw.double().cpu().numpy(), reference.weight_grad(x64, dy64, layout), dtype)
        assert_close(db.double().cpu().numpy(), reference.bias_grad(dy64), "float32", "bias_grad",
                     magnitude=reference.bias_grad(np.abs(dy64)), terms=1000)
    assert len(plans.kept) == 1 and sum(r is not None for r in replayed) == 2


@pytest.mark.gpu
@pytest.mark.skipif(SIMULATOR, reason="the simulator has one fake device")
def test_tensors_on_another_device_are_refused(monkeypatch):
    """A call runs on its first GPU array's device; a tensor elsewhere is refused before any launch
    (faked here by claiming the call runs on the next device; tests/test_devices.py has two)."""
    torch = pytest.importorskip("torch")
    from sparseblocks.runtime import arrays as _arrays

    x = torch.randn(4, 16, device="cuda")
    monkeypatch.setattr(_arrays, "active", lambda: x.device.index + 1)
    with pytest.raises(ValueError, match=r"x: expected a tensor on cuda:\d+ \(the call's device"):
        bsmm.forward(x, torch.randn(LAYOUT.w_shape, device="cuda"), LAYOUT)


@pytest.fixture
def faked_launches(monkeypatch):
    """Kept plans whose replays record the pointers each launch gets (in a list, returned) instead
    of launching, as the driver would: empty plans to start with."""
    from sparseblocks.runtime import arrays as _arrays

    launches = []
    monkeypatch.setattr(plans, "kept", {})
    monkeypatch.setattr(bsmm.plans, "replay",  # (a replay that launched says so: True)
                        lambda *args, live: lambda stream, *pointers: launches.append(pointers) or True)
    monkeypatch.setattr(_arrays, "torch_stream_handle", lambda: 0)
    return launches


@pytest.mark.skipif(not SIMULATOR, reason="fakes the driver launch; the GPU test above runs the real one")
@pytest.mark.parametrize("transposed", [False, True])
def test_kept_plans_are_keyed_by_what_the_checks_see(configure, faked_launches, transposed):
    """Plan bookkeeping with the launch faked: a call like the first replays with the new
    pointers (`transposed`: the copy of W into a fresh scratch array first, then the product
    over it); another shape, alignment, layout or a non-contiguous view does not."""
    torch = pytest.importorskip("torch")
    launches = faked_launches
    configure(bsmm, v5_transposed_forward={(16, "float32"): 1} if transposed else {})
    layout = BlockLayout.random((2, 2), 0.5, seed=3, block_size=16)
    w = torch.randn(layout.w_shape)
    bsmm.forward(torch.randn(6, 32), w, layout)  # the general path keeps a plan
    assert len(plans.kept) == 1 and not launches
    x = torch.randn(6, 32)
    y = bsmm.forward(x, w, layout)
    if transposed:  # (wt, w), then (out, x, wt)
        assert len(launches) == 2 and launches[0][1] == w.data_ptr()
        assert launches[1][1:] == (x.data_ptr(), launches[0][0]) and launches[1][0] == y.data_ptr()
    else:
        assert launches[-1][1:] == (x.data_ptr(), w.data_ptr()) and launches[-1][0] == y.data_ptr()
    assert y.shape == (6, 32) and y.dtype == x.dtype
    replayed = len(launches)
    others = [torch.randn(7, 32), torch.randn(6 * 32 + 1)[1:].view(6, 32)]
    for other in others:
        bsmm.forward(other, w, layout)
    bsmm.forward(x, w, BlockLayout.random((2, 2), 0.5, seed=4, block_size=16))
    assert len(launches) == replayed and len(plans.kept) == 4
    with pytest.raises(ValueError, match="C-contiguous"):
        bsmm.forward(torch.randn(32, 6).T, w, layout)
    assert len(launches) == replayed


@pytest.mark.skipif(not SIMULATOR, reason="fakes the driver launch; the GPU test above runs the real one")
def test_segmented_plans_replay_the_workspace_and_the_combining_launch(faked_launches):
    """Plan bookkeeping with the launch faked, lines cut into segments: a replay launches the
    product with (out, a fresh workspace, x, w), then the combining launch with (out, that
    workspace)."""
    torch = pytest.importorskip("torch")
    launches = faked_launches
    w = torch.randn(SEGMENTED.w_shape)
    bsmm.forward(torch.randn(6, 256), w, SEGMENTED)  # the general path keeps a plan
    (plan,) = plans.kept.values()
    assert plan.combine is not None and plan.workspace[1] == torch.float32 and plan.workspace[0][1:] == (6, 32)
    x = torch.randn(6, 256)
    y = bsmm.forward(x, w, SEGMENTED)
    (product, combine) = launches
    assert product[0] == combine[0] == y.data_ptr() and product[1] == combine[1]
    assert product[2:] == (x.data_ptr(), w.data_ptr()) and y.shape == (6, 256)


@pytest.mark.skipif(not SIMULATOR, reason="fakes the driver launch; the GPU test above runs the real one")
def test_plans_replay_the_bias_where_it_is_added(faked_launches):
    """Plan bookkeeping with the launch faked, a bias the product does not add itself (the
    simulator's versions): a replay launches the product with (out, x, w), then the bias's pass
    with (out, bias); lines cut into segments put the combining pass between. Another bias dtype
    is refused by the checks; a call without a bias takes a plan of its own."""
    torch = pytest.importorskip("torch")
    launches = faked_launches
    for layout, features in ((BlockLayout.random((2, 2), 0.5, seed=3, block_size=16), 32), (SEGMENTED, 256)):
        launches.clear()
        w = torch.randn(layout.w_shape)
        bias = torch.randn(layout.dense_shape[1])
        bsmm.forward(torch.randn(6, features), w, layout, bias=bias)  # the general path keeps a plan
        assert not launches
        x = torch.randn(6, features)
        y = bsmm.forward(x, w, layout, bias=bias)
        assert launches[0][0] == y.data_ptr() and launches[0][-2:] == (x.data_ptr(), w.data_ptr())
        assert launches[-1] == (y.data_ptr(), bias.data_ptr()) and len(launches) == (3 if layout is SEGMENTED else 2)
    kept = len(plans.kept)
    with pytest.raises(TypeError, match="bias: expected dtype"):  # (the checks still run: no plan takes it)
        bsmm.forward(x, w, SEGMENTED, bias=bias.double())
    bsmm.forward(x, w, SEGMENTED)
    assert len(plans.kept) == kept + 1
    bsmm.forward(x, w, SEGMENTED, relu=True)  # a ReLU alone: a plan of its own, its pass with out only
    launches.clear()
    y = bsmm.forward(x, w, SEGMENTED, relu=True)
    assert len(plans.kept) == kept + 2 and len(launches) == 3 and launches[-1] == (y.data_ptr(),)
    with pytest.raises(TypeError, match="relu: expected a bool"):
        bsmm.forward(x, w, SEGMENTED, relu=1)


@pytest.mark.skipif(not SIMULATOR, reason="fakes the driver launch; the GPU test above runs the real one")
def test_plans_replay_the_bias_gradient_beside_the_weight_gradient(faked_launches):
    """Plan bookkeeping with the launch faked, ``dbias_dtype`` where the weight gradient does not
    sum dy itself (the simulator's versions): a replay launches the weight gradient with (dw, x,
    dy), the column sums with (their parts, dy), then the finishing pass with (db, the parts), and
    returns (dw, db); a call without the bias gradient, or another dtype of it, keeps its own plan."""
    torch = pytest.importorskip("torch")
    launches = faked_launches
    layout = BlockLayout(np.array([[1, 0], [1, 1]]), 16)
    x, dy = torch.randn(20, 32), torch.randn(20, 32)
    bsmm.weight_grad(x, dy, layout, dbias_dtype="float32")  # the general path keeps a plan
    assert len(plans.kept) == 1 and not launches
    x, dy = torch.randn(20, 32), torch.randn(20, 32)
    dw, db = bsmm.weight_grad(x, dy, layout, dbias_dtype="float32")
    assert len(launches) == 3 and launches[0] == (dw.data_ptr(), x.data_ptr(), dy.data_ptr())
    assert launches[1][1] == dy.data_ptr() and launches[2] == (db.data_ptr(), launches[1][0])
    assert db.shape == (32,) and db.dtype == torch.float32
    bsmm.weight_grad(x, dy, layout)
    bsmm.weight_grad(x.double(), dy.double(), layout, dbias_dtype="float64")
    assert len(plans.kept) == 3


@pytest.mark.gpu
def test_cupy_arrays_in_cupy_arrays_out():
    cupy = pytest.importorskip("cupy")
    layout = BlockLayout.random((2, 2), 0.5, seed=1, block_size=32)
    x = cupy.random.standard_normal((7, 64)).astype(cupy.float32)
    w = cupy.random.standard_normal(layout.w_shape).astype(cupy.float32)
    y = bsmm.forward(x, w, layout)
    assert isinstance(y, cupy.ndarray)
    assert_close(y.get(), reference.forward(x.get(), w.get(), layout), np.float32)


@given(grid=st.tuples(st.integers(1, 3), st.integers(1, 3)), bs=st.sampled_from([8, 16]),
       dtype=st.sampled_from(DTYPE_NAMES), criterion=st.sampled_from(["l2", "l1", "max"]),
       style=st.sampled_from(VALUE_STYLES), seed=st.integers(0, 2**16))
def test_block_norms_match_the_reference(grid, bs, dtype, criterion, style, seed):
    a = values(np.random.default_rng(seed), (grid[0] * bs, grid[1] * bs), dtype, style)
    got = bsmm.block_norms(a, bs, criterion)
    want = reference.block_norms(a.astype(np.float64), bs, criterion)
    assert got.shape == grid and got.dtype == (np.float64 if dtype == "float64" else np.float32)
    rtol = 1e-12 if dtype == "float64" else 1e-6 * bs
    np.testing.assert_allclose(got, want, rtol=rtol, atol=0)


def test_block_norms_propagate_nan_and_name_bad_input():
    a = np.ones((16, 16), np.float32)
    a[9, 3] = np.nan
    for criterion in ("l2", "l1", "max"):
        got = bsmm.block_norms(a, 8, criterion)
        assert np.isnan(got[1, 0]) and not np.isnan(got[[0, 0, 1], [0, 1, 1]]).any()
    with pytest.raises(ValueError, match="criterion"):
        bsmm.block_norms(a, 8, "l3")
    with pytest.raises(ValueError, match="multiples of block_size"):
        bsmm.block_norms(a[:12], 8)
    with pytest.raises(ValueError, match="block_size"):
        bsmm.block_norms(a, 12)


@pytest.mark.parametrize("feature_axis", [1, 0])
def test_grouped_weight_grad_sums_the_steps_in_one_call(feature_axis):
    """x and dy stacked over T steps give the sum of the steps' weight gradients."""
    layout = BlockLayout(np.array([[1, 0], [1, 1]]), 16)
    rng = np.random.default_rng(9)
    T, N = 3, 20
    x, dy = rng.standard_normal((T, N, 32)).astype(np.float32), rng.standard_normal((T, N, 32)).astype(np.float32)
    want = sum(reference.weight_grad(x[t], dy[t], layout) for t in range(T))
    stack = (lambda a: a) if feature_axis == 1 else (lambda a: np.ascontiguousarray(a.transpose(0, 2, 1)))
    got = bsmm.weight_grad(stack(x), stack(dy), layout, feature_axis)
    assert_close(got, want, "float32", "grouped weight_grad", terms=T * N)
    with pytest.raises(ValueError, match="stacks of the same T steps"):
        bsmm.weight_grad(x, dy[:2], layout)
