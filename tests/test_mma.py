"""Tensor-core multiply-add (kernels/_mma.py): one m16n8k16 tile per warp against NumPy."""

import numpy as np
import pytest
from numba import cuda

from sparseblocks.kernels._mma import (
    MMA_K, MMA_M, MMA_N, a_fragment, b_fragment, c_fragment, mma_bf16, mma_f16, pack,
)


def _tile_kernel(mma):
    @cuda.jit
    def tile(d, a, b, c):
        """d = a·b + c for one warp; a, b hold 16-bit patterns (int16), c and d float32."""
        lane = cuda.threadIdx.x
        g = lane >> 2
        t = lane % 4
        # The layout of _mma's docstring, written out (a_fragment etc. say the same on the host).
        a0 = pack(a[g, 2 * t], a[g, 2 * t + 1])
        a1 = pack(a[g + 8, 2 * t], a[g + 8, 2 * t + 1])
        a2 = pack(a[g, 2 * t + 8], a[g, 2 * t + 9])
        a3 = pack(a[g + 8, 2 * t + 8], a[g + 8, 2 * t + 9])
        b0 = pack(b[2 * t, g], b[2 * t + 1, g])
        b1 = pack(b[2 * t + 8, g], b[2 * t + 9, g])
        out = mma(a0, a1, a2, a3, b0, b1, c[g, 2 * t], c[g, 2 * t + 1], c[g + 8, 2 * t], c[g + 8, 2 * t + 1])
        d[g, 2 * t] = out[0]
        d[g, 2 * t + 1] = out[1]
        d[g + 8, 2 * t] = out[2]
        d[g + 8, 2 * t + 1] = out[3]

    return tile


KERNELS = {"float16": _tile_kernel(mma_f16), "bfloat16": _tile_kernel(mma_bf16)}


def _bits(values, kind):
    """16-bit patterns (int16) of float values in fp16 or bf16 (rounded to nearest even), and the
    values they stand for."""
    if kind == "float16":
        half = values.astype(np.float16)
        return half.view(np.int16), half.astype(np.float64)
    u = values.astype(np.float32).view(np.uint32).astype(np.uint64)
    rounded = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
    return rounded.view(np.int16), (rounded.astype(np.uint32) << 16).view(np.float32).astype(np.float64)


@pytest.mark.parametrize("kind", ["float16", "bfloat16"])
def test_one_tile_matches_numpy(kind):
    rng = np.random.default_rng(7)
    a_bits, A = _bits(rng.standard_normal((MMA_M, MMA_K)), kind)
    b_bits, B = _bits(rng.standard_normal((MMA_K, MMA_N)), kind)
    c = rng.standard_normal((MMA_M, MMA_N)).astype(np.float32)
    d = cuda.device_array((MMA_M, MMA_N), np.float32)
    KERNELS[kind][1, 32](d, cuda.to_device(a_bits), cuda.to_device(b_bits), cuda.to_device(c))
    np.testing.assert_allclose(d.copy_to_host(), A @ B + c, rtol=1e-5, atol=1e-5)


def test_fragment_helpers_cover_each_tile_once():
    """Over the 32 lanes, the fragments name every element of A, B and C exactly once."""
    seen_a, seen_b, seen_c = np.zeros((16, 16), int), np.zeros((16, 8), int), np.zeros((16, 8), int)
    for lane in range(32):
        for r in range(4):
            row, col = a_fragment(lane, r)
            seen_a[row, col:col + 2] += 1
            seen_c[c_fragment(lane, r)] += 1
        for r in range(2):
            row, col = b_fragment(lane, r)
            seen_b[row:row + 2, col] += 1
    assert (seen_a == 1).all() and (seen_b == 1).all() and (seen_c == 1).all()
