"""The small PTX intrinsics against NumPy: paired fp16 adds and atomics, relaxed loads,
NaN-propagating max, the flushing exp2, fp8 pair conversions, and the timeline clocks. Each runs
on the GPU and, through its twin, in the simulator."""

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from numba import cuda

from sparseblocks.ptx.clock import globaltimer, smid
from sparseblocks.ptx.exp2 import exp2_ftz
from sparseblocks.ptx.fp8 import e4m3x2_of_floats, e5m2x2_of_floats
from sparseblocks.ptx.half2 import add_half2, atomic_add_half, atomic_add_half2, greater_mask_half2, half2_down
from sparseblocks.ptx.nanmax import max_nan, max_nan_select
from sparseblocks.ptx.relaxed import load_relaxed

finite_halves = st.floats(-1000, 1000, width=16, allow_subnormal=False)


def words(halves):
    """int32 words of pairs of fp16 values."""
    return np.ascontiguousarray(np.asarray(halves, np.float16)).reshape(-1).view(np.int32)


@cuda.jit
def _add_words(out, a, b):
    i = cuda.grid(1)
    if i < out.shape[0]:
        out[i] = add_half2(a[i], b[i])


@given(st.lists(finite_halves, min_size=8, max_size=8), st.lists(finite_halves, min_size=8, max_size=8))
def test_half2_adds_round_each_half_once(a, b):
    """add_half2 adds the two halves of two words, each sum rounded to fp16 once."""
    out = np.zeros(4, np.int32)
    _add_words[1, 4](out, words(a), words(b))
    want = (np.float16(a).astype(np.float64) + np.float16(b).astype(np.float64)).astype(np.float16)
    np.testing.assert_array_equal(out.view(np.float16), want)


@cuda.jit
def _compare_words(masks, down, a, b, values):
    i = cuda.grid(1)
    if i < masks.shape[0]:
        masks[i] = greater_mask_half2(a[i], b[i])
    if i < down.shape[0]:
        down[i] = half2_down(values[i])


EDGES = [0.0, -0.0, 1.0, 1.0004883, 0.99975586, 65504.0, 65520.0, 70000.0, -70000.0, 6e-8, -6e-8, 3.0e-5,
         float("inf"), float("-inf")]


@given(st.lists(st.one_of(finite_halves, st.sampled_from([float("nan"), float("inf"), float("-inf")])),
                min_size=16, max_size=16),
       st.lists(st.one_of(st.floats(-1e5, 1e5, width=32), st.sampled_from(EDGES)), min_size=8, max_size=8))
def test_half2_compares_and_rounds_down(halves, values):
    """greater_mask_half2: 0xFFFF in each half where a's is greater (NaN: 0);
    half2_down: the largest fp16 at or below a float32 in both halves, so that an fp16 x exceeds
    the float32 exactly when it exceeds the rounded half."""
    a, b = np.float16(halves[:8]), np.float16(halves[8:])
    masks, down = np.zeros(4, np.uint32), np.zeros(8, np.uint32)
    values = np.float32(values)
    _compare_words[1, 8](masks, down, words(a).view(np.uint32), words(b).view(np.uint32), values)
    np.testing.assert_array_equal(masks.view(np.uint16), np.where(a > b, 0xFFFF, 0).astype(np.uint16))
    low, high = (down & 0xFFFF).astype(np.uint16).view(np.float16), (down >> 16).astype(np.uint16).view(np.float16)
    np.testing.assert_array_equal(low.view(np.uint16), high.view(np.uint16))
    every = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(np.float16)  # (every fp16, NaNs too)
    for value, h in zip(values, low):
        np.testing.assert_array_equal(every > h, every.astype(np.float32) > value)


@cuda.jit
def _atomic_halves(array, index, values):
    i = cuda.grid(1)
    if i < values.shape[0]:
        atomic_add_half(array, (index[i],), values[i])


@cuda.jit
def _atomic_words(array, index, values):
    i = cuda.grid(1)
    if i < values.shape[0]:
        atomic_add_half2(array, (index[i],), values[i])


def test_atomic_half_adds_land_every_value():
    """Every thread's fp16 add lands (small integers: exact in any order)."""
    index = np.array([0, 1, 0, 2, 0, 1, 3, 0], np.int64)
    values = np.arange(1, 9, dtype=np.float16)
    array = cuda.to_device(np.zeros(4, np.float16))
    _atomic_halves[1, 8](array, index, values)
    want = np.zeros(4)
    np.add.at(want, index, values.astype(np.float64))
    np.testing.assert_array_equal(array.copy_to_host(), want.astype(np.float16))


def test_atomic_half_pairs_add_both_halves():
    index = np.array([0, 1, 0, 1, 0], np.int64)
    pairs = np.arange(1, 11, dtype=np.float16).reshape(5, 2)
    array = cuda.to_device(np.zeros(2, np.int32))
    _atomic_words[1, 5](array, index, words(pairs))
    want = np.zeros((2, 2))
    np.add.at(want, index, pairs.astype(np.float64))
    np.testing.assert_array_equal(array.copy_to_host().view(np.float16).reshape(2, 2), want.astype(np.float16))


@cuda.jit
def _relaxed(out, array):
    i = cuda.grid(1)
    if i < out.shape[0]:
        out[i] = load_relaxed(array, (i,))


@pytest.mark.parametrize("dtype", [np.int32, np.int64])
def test_relaxed_loads_read_the_words(dtype):
    array = (np.arange(6, dtype=dtype) - 3) * (1 << 20)
    out = np.zeros(6, dtype)
    _relaxed[1, 6](out, array)
    np.testing.assert_array_equal(out, array)


@cuda.jit
def _maxima(out, a, b):
    i = cuda.grid(1)
    if i < a.shape[0]:
        out[0, i] = max_nan(a[i], b[i])
        out[1, i] = max_nan_select(a[i], b[i])


def test_nan_max_keeps_a_nan_in_either_place():
    """Both NaN-propagating maxima are numpy's maximum: NaN where either operand is."""
    a = np.array([1, np.nan, 3, -np.inf, np.nan, -0.5], np.float32)
    b = np.array([2, 1, np.nan, -1, np.nan, -0.25], np.float32)
    out = np.zeros((2, 6), np.float32)
    _maxima[1, 6](out, a, b)
    want = np.maximum(a, b)
    for row in out:
        np.testing.assert_array_equal(row, want)


@cuda.jit
def _exp2s(out, x):
    i = cuda.grid(1)
    if i < x.shape[0]:
        out[i] = exp2_ftz(x[i])


@given(st.lists(st.floats(-125, 127, width=32), min_size=16, max_size=16))
def test_flushing_exp2_is_exp2_where_normal(values):
    """exp2_ftz is 2 ** x to 2**-22 relative where the result is a normal float32."""
    x = np.array(values, np.float32)
    out = np.zeros_like(x)
    _exp2s[1, 16](out, x)
    np.testing.assert_allclose(out, np.exp2(x.astype(np.float64)), rtol=2.0**-21)


def test_flushing_exp2_flushes_and_keeps_the_specials():
    """Below 2**-126 the result is 0 (no subnormals); -inf gives 0, +inf +inf, NaN NaN."""
    x = np.array([-127.5, -140, -np.inf, np.inf, np.nan, -130.25], np.float32)
    out = np.full_like(x, 7)
    _exp2s[1, 6](out, x)
    np.testing.assert_array_equal(out, [0, 0, 0, np.inf, np.nan, 0])


@cuda.jit
def _clocks(out):
    out[cuda.threadIdx.x, 0] = globaltimer()
    out[cuda.threadIdx.x, 1] = smid()


def test_clocks_give_a_time_and_a_multiprocessor():
    out = np.zeros((2, 2), np.int64)
    _clocks[1, 2](out)
    assert (out[:, 0] > 0).all() and (out[:, 1] >= 0).all()


@cuda.jit
def _fp8_pairs(out4, out5, values):
    i = cuda.grid(1)
    if 2 * i + 1 < values.shape[0]:
        out4[i] = e4m3x2_of_floats(values[2 * i], values[2 * i + 1])
        out5[i] = e5m2x2_of_floats(values[2 * i], values[2 * i + 1])


@pytest.mark.parametrize("kind", ["e4m3", "e5m2"])
def test_fp8_pairs_round_to_nearest_even_and_saturate(kind):
    """cvt.rn.satfinite to fp8 pairs: ml_dtypes' rounding of each value, clamped to the largest finite
    value first (what satfinite means), NaN a NaN; the first value in the low byte."""
    import ml_dtypes

    values = np.array([0.0, -0.0, 1.0, -3.3, 448, 449, 464, 465, 1e6, -np.inf, 57344, 61440, 2 ** -9, 2 ** -10,
                       3 * 2 ** -11, 2 ** -16, 2 ** -17, 1e-30, -1e-30, 0.1, np.nan, 7.0], np.float32)
    out4, out5 = np.zeros(len(values) // 2, np.uint16), np.zeros(len(values) // 2, np.uint16)
    _fp8_pairs[1, 32](out4, out5, values)
    got = (out4 if kind == "e4m3" else out5).view(np.uint8)
    dtype = ml_dtypes.float8_e4m3fn if kind == "e4m3" else ml_dtypes.float8_e5m2
    largest = {"e4m3": 448.0, "e5m2": 57344.0}[kind]
    want = np.clip(values, -largest, largest).astype(dtype)
    nan = np.isnan(values)
    np.testing.assert_array_equal(got[~nan], want.view(np.uint8)[~nan])
    assert np.isnan(got[nan].view(dtype).astype(np.float32)).all()
