"""`float_cast` (sparseblocks/cast) against ml_dtypes bit for bit: every pair of formats, every
float32 bit pattern class (zeros, subnormals, overflow, ties, inf, NaN), saturation, and the
stochastic rounding against its written-out twin, unbiased and repeatable."""

from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sparseblocks.cast import DTYPES, CastConfig, float_cast
from sparseblocks.reference import cast as reference
from sparseblocks.runtime.backend import SIMULATOR

SMALL = CastConfig(threads=32, waves=2) if SIMULATOR else CastConfig()


def bits(a, dtype):
    """The stored bits, a NaN's payload set to the quiet NaN's (its sign kept): payloads are not
    carried through a cast (the one place the kernel and ml_dtypes may differ)."""
    a = np.asarray(a)
    words = a.view(reference._bits_dtype(dtype)).astype(np.int64)
    quiet = np.asarray(reference.float_cast(np.float32(np.nan), dtype)).view(reference._bits_dtype(dtype))
    sign = 1 << (8 * a.dtype.itemsize - 1)
    nan = np.isnan(a.astype(np.float32))
    return np.where(nan, (words & sign) | int(quiet), words)


EDGES = np.array([0.0, -0.0, 1.0, -3.3, 448, 449, 464, 465, 480, 57344, 61440, 61441, 65504, 65520, 3.4e38, np.inf,
                  -np.inf, np.nan, -np.nan, 2 ** -9, 2 ** -10, 3 * 2 ** -11, 2 ** -16, 2 ** -17, 6e-8, 3e-8, 1e-30,
                  1e-39, -1e-40, 1.0000001, 2 ** -133, 2 ** -134], np.float32)


@st.composite
def float32_patterns(draw):
    words = draw(st.lists(st.integers(0, 2 ** 32 - 1), min_size=1, max_size=40))
    return np.concatenate([EDGES, np.array(words, np.uint32).view(np.float32)])


@settings(max_examples=20 if SIMULATOR else 100, deadline=None)
@given(x=float32_patterns(), src=st.sampled_from(DTYPES), dst=st.sampled_from(DTYPES), saturate=st.booleans())
def test_round_to_nearest_even_is_ml_dtypes_bit_for_bit(x, src, dst, saturate):
    xs = reference.float_cast(x, src)  # (the source values: x rounded into src)
    got = float_cast(xs, dst, saturate=saturate, config=SMALL)
    want = reference.float_cast(xs, dst, saturate=saturate)
    assert got.dtype == want.dtype
    np.testing.assert_array_equal(bits(got, dst), bits(want, dst))


@settings(max_examples=15 if SIMULATOR else 60, deadline=None)
@given(x=float32_patterns(), src=st.sampled_from(DTYPES), dst=st.sampled_from(DTYPES), saturate=st.booleans(),
       seed=st.integers(0, 2 ** 64 - 1), offset=st.integers(0, 2 ** 40))
def test_stochastic_rounding_matches_its_twin(x, src, dst, saturate, seed, offset):
    xs = reference.float_cast(x, src)
    got = float_cast(xs, dst, stochastic=True, saturate=saturate, seed=seed, offset=offset, config=SMALL)
    want = reference.float_cast(xs, dst, stochastic=True, saturate=saturate, seed=seed, offset=offset)
    np.testing.assert_array_equal(bits(got, dst), bits(want, dst))


@pytest.mark.parametrize("dst", ["float8_e4m3fn", "float8_e5m2", "bfloat16"])
def test_stochastic_rounding_is_unbiased_and_repeatable(dst):
    x = np.full(2000 if SIMULATOR else 100_000, 1.3, np.float32)
    one = float_cast(x, dst, stochastic=True, seed=7, config=SMALL)
    again = float_cast(x, dst, stochastic=True, seed=7, config=SMALL)
    np.testing.assert_array_equal(bits(one, dst), bits(again, dst))
    other = float_cast(x, dst, stochastic=True, seed=7, offset=len(x), config=SMALL)
    assert not np.array_equal(bits(one, dst), bits(other, dst))
    values = np.asarray(one).astype(np.float64)
    below, above = values.min(), values.max()
    assert below < 1.3 < above and set(np.unique(values)) == {below, above}  # the two neighbours only
    spread = (above - below) * 3 / np.sqrt(len(x))
    assert abs(values.mean() - 1.3) < spread


@pytest.mark.parametrize("call, error, match", [
    (lambda: float_cast(np.ones(3, np.float32), "float8"), ValueError, "dtype: expected one of"),
    (lambda: float_cast(np.ones(3, np.int32), "float16"), TypeError, "x: expected dtype in"),
    (lambda: float_cast(np.ones(3, np.float64), "float16"), TypeError, "x: expected dtype in"),
    (lambda: float_cast(np.ones(3, np.float32), "float16", seed=-1), ValueError, "seed: expected an int"),
    (lambda: float_cast(np.ones(3, np.float32), "float16", offset=2 ** 64), ValueError, "offset: expected an int"),
    (lambda: float_cast(np.ones(3, np.float32), "float16", config=CastConfig(groups=4)), ValueError,
     "groups: expected 1 or 2"),
])
def test_bad_input_is_refused_before_any_launch(call, error, match):
    with pytest.raises(error, match=match):
        call()


@pytest.mark.parametrize("src, dst", [("float32", "float8_e4m3fn"), ("float16", "float8_e5m2"),
                                      ("float32", "bfloat16")])
def test_arrays_off_a_4_element_boundary_take_the_scalar_path(src, dst):
    """A view one element into its buffer is converted a value at a time, with the same bits."""
    xs = reference.float_cast(np.concatenate([EDGES, EDGES[:3]]), src)[1:]
    got = float_cast(xs, dst, config=SMALL)
    np.testing.assert_array_equal(bits(got, dst), bits(reference.float_cast(xs, dst), dst))


@pytest.mark.parametrize("groups", [1, 2])
@pytest.mark.parametrize("src, dst", [("float16", "float8_e4m3fn"), ("bfloat16", "float8_e5m2"),
                                      ("float32", "float16")])
def test_one_or_two_groups_a_thread_give_the_same_bits(groups, src, dst):
    """The vector path's groups of 4 values a thread (``groups``), with a tail of 1 to 3 values
    cast one at a time: ml_dtypes' bits at every length."""
    for extra in (0, 3, 4, 7):
        xs = reference.float_cast(np.concatenate([EDGES, EDGES[:extra]]), src)
        got = float_cast(xs, dst, config=replace(SMALL, groups=groups))
        np.testing.assert_array_equal(bits(got, dst), bits(reference.float_cast(xs, dst), dst))
    # (pairs of groups a grid's stride apart, a last group alone, a tail: 101 groups and 3 values
    # over one thread block of 32 threads in the simulator)
    n = 407 if SIMULATOR else 1_000_003
    ramp = np.linspace(-500, 500, n - len(EDGES), dtype=np.float32)  # (no two groups alike)
    xs = reference.float_cast(np.concatenate([EDGES, ramp]), src)
    got = float_cast(xs, dst, config=replace(SMALL, groups=groups, waves=1))
    np.testing.assert_array_equal(bits(got, dst), bits(reference.float_cast(xs, dst), dst))
