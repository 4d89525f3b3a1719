"""runtime/compile.py's device helpers: `divmod32`, a walk's 32-bit unsigned division."""

import numpy as np
from numba import cuda

from sparseblocks.runtime.compile import divmod32


@cuda.jit
def _divmods(out, divisors):
    e = cuda.threadIdx.x
    for i in range(divisors.shape[0]):
        q, r = divmod32(e, divisors[i])
        out[i, e, 0] = q
        out[i, e, 1] = r


def test_divmod32_is_floor_division():
    """Python's divmod, by shifts for 1 and 2, a 32-bit division else (the walks of attention's
    and the convolution's kernels)."""
    divisors = np.array([1, 2, 3, 4, 7], np.int64)
    out = np.zeros((len(divisors), 40, 2), np.int64)
    _divmods[1, 40](out, divisors)
    e = np.arange(40)
    for i, d in enumerate(divisors):
        np.testing.assert_array_equal(out[i], np.stack([e // d, e % d], axis=1))


def test_cached_keys_take_numpy_integers_as_ints():
    """A NumPy integer in a maker's key reaches the maker as an int (the compiler sizes local
    arrays only from Python ints) and names the same kernel as the int."""
    from sparseblocks.runtime.compile import _kernels, cached

    seen = []

    def maker(n):
        seen.append(type(n))
        return object()

    try:
        assert cached(maker, np.int32(3)) is cached(maker, 3)
        assert seen == [int]
    finally:
        for key in [key for key in _kernels if key[0] is maker]:
            del _kernels[key]
