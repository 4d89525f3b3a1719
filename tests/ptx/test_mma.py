"""Tensor-core multiply-add (kernels/_mma.py): one tile per warp against NumPy (m16n8k16 for
fp16 and bf16, m16n8k8 for tf32 and 3xTF32)."""

import numpy as np
import pytest
from numba import cuda, int32, uint32
from numba.cuda import libdevice

from sparseblocks.runtime.backend import SIMULATOR

from sparseblocks.ptx.mma import (
    MMA_K, MMA_M, MMA_N, TF32_K, TF32_MASK, a_fragment, b_fragment, c_fragment, make_3xtf32_parts, mma_3xtf32,
    mma_bf16, mma_f16, mma_tf32, pack, tf32_a_fragment, tf32_b_fragment, to_tf32,
)

split_tf32, mma_3xtf32_split = make_3xtf32_parts()


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


def _tf32_tile_kernel(three, parts=False):
    @cuda.jit
    def tile(d, a, b, c):
        """d = a·b + c for one warp, a (16 x 8) and b (8 x 8) fp32 given as their bits (int32):
        rounded to tf32, or (three) as 3xTF32, A split apart first where ``parts``."""
        lane = cuda.threadIdx.x
        g = lane >> 2
        t = lane % 4
        a0, a1, a2, a3 = uint32(a[g, t]), uint32(a[g + 8, t]), uint32(a[g, t + 4]), uint32(a[g + 8, t + 4])
        b0, b1 = uint32(b[t, g]), uint32(b[t + 4, g])
        c0, c1, c2, c3 = c[g, 2 * t], c[g, 2 * t + 1], c[g + 8, 2 * t], c[g + 8, 2 * t + 1]
        if parts:
            a0h, a0t = split_tf32(a0)
            a1h, a1t = split_tf32(a1)
            a2h, a2t = split_tf32(a2)
            a3h, a3t = split_tf32(a3)
            out = mma_3xtf32_split(a0h, a1h, a2h, a3h, a0t, a1t, a2t, a3t, b0, b1, c0, c1, c2, c3)
        elif three:
            out = mma_3xtf32(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3)
        else:
            out = mma_tf32(_round(a0), _round(a1), _round(a2), _round(a3), _round(b0), _round(b1),
                           c0, c1, c2, c3)
        d[g, 2 * t] = out[0]
        d[g, 2 * t + 1] = out[1]
        d[g + 8, 2 * t] = out[2]
        d[g + 8, 2 * t + 1] = out[3]

    return tile


@cuda.jit(device=True)
def _round(bits):
    return to_tf32(libdevice.int_as_float(int32(bits)))


KERNELS = {"float16": _tile_kernel(mma_f16), "bfloat16": _tile_kernel(mma_bf16),
           "tfloat32": _tf32_tile_kernel(False), "3xtf32": _tf32_tile_kernel(True),
           "3xtf32 parts": _tf32_tile_kernel(True, parts=True)}


def _bits(values, kind):
    """16-bit patterns (int16) of float values in fp16 or bf16 (rounded to nearest even), and the
    values they stand for."""
    if kind == "float16":
        half = values.astype(np.float16)
        return half.view(np.int16), half.astype(np.float64)
    u = values.astype(np.float32).view(np.uint32).astype(np.uint64)
    rounded = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
    return rounded.view(np.int16), (rounded.astype(np.uint32) << 16).view(np.float32).astype(np.float64)


def _tf32(values):
    """fp32 values rounded to tf32 as cvt.rna does (nearest, ties away from zero)."""
    u = values.astype(np.float32).view(np.uint32).astype(np.uint64)
    return (((u + 0x1000) & 0xFFFFE000).astype(np.uint32)).view(np.float32).astype(np.float64)


def tile_problem(kind, rng):
    """(A, B, c, the expected d, run) of one tile of `kind`; run() launches and returns d."""
    k = MMA_K if kind in ("float16", "bfloat16") else TF32_K
    a, b = rng.standard_normal((MMA_M, k)), rng.standard_normal((k, MMA_N))
    c = rng.standard_normal((MMA_M, MMA_N)).astype(np.float32)
    if kind in ("float16", "bfloat16"):
        (a_in, A), (b_in, B) = _bits(a, kind), _bits(b, kind)
    else:
        a_in, b_in = a.astype(np.float32).view(np.int32), b.astype(np.float32).view(np.int32)
        A, B = (_tf32(a), _tf32(b)) if kind == "tfloat32" else (a.astype(np.float32), b.astype(np.float32))

    def run():
        d = cuda.device_array((MMA_M, MMA_N), np.float32)
        KERNELS[kind][1, 32](d, cuda.to_device(a_in), cuda.to_device(b_in), cuda.to_device(c))
        return d.copy_to_host()

    return A, B, c, A.astype(np.float64) @ B + c, run


@pytest.mark.parametrize("kind", sorted(KERNELS))
def test_one_tile_matches_numpy(kind):
    A, B, c, want, run = tile_problem(kind, np.random.default_rng(7))
    # fp32 accumulation of exact products (tf32 inputs rounded as the reference rounds them);
    # 3xTF32 leaves out the tail·tail term, about 2^-22 of each product.
    np.testing.assert_allclose(run(), want, rtol=1e-5, atol=1e-5)


def test_3xtf32_parts_give_mma_3xtf32s_products():
    """An A split apart (`make_3xtf32_parts`) gives mma_3xtf32's products, a NaN of A's and an
    infinity of B's included: bit for bit on the GPU (the same instructions in the same order)."""
    rng = np.random.default_rng(3)
    a = rng.standard_normal((MMA_M, TF32_K)).astype(np.float32)
    b = rng.standard_normal((TF32_K, MMA_N)).astype(np.float32)
    a[2, 3], b[1, 1] = np.nan, -np.inf
    c = rng.standard_normal((MMA_M, MMA_N)).astype(np.float32)
    got = {}
    for kind in ("3xtf32", "3xtf32 parts"):
        d = cuda.device_array((MMA_M, MMA_N), np.float32)
        KERNELS[kind][1, 32](d, cuda.to_device(a.view(np.int32)), cuda.to_device(b.view(np.int32)), cuda.to_device(c))
        got[kind] = d.copy_to_host()
    if SIMULATOR:  # (float64 products of the joined parts: the values, NaN where the GPU's are)
        np.testing.assert_array_equal(got["3xtf32"], got["3xtf32 parts"])
    else:
        np.testing.assert_array_equal(got["3xtf32"].view(np.uint32), got["3xtf32 parts"].view(np.uint32))
    assert np.isnan(got["3xtf32"][2]).all() and not np.isfinite(got["3xtf32"][:, 1]).any()  # (GPU: NaN)
    assert not np.isnan(got["3xtf32"][0, [0, 2, 3, 4, 5, 6, 7]]).any()


@pytest.mark.parametrize("value", [1.0, 1 + 2.0 ** -11, -3.14159265, 2.5e-30, 65504.0, 0.0, -0.0])
def test_tf32_split_parts_add_up_to_the_value(value):
    """split: a tf32 head (13 low bits clear) and a tail that add up to the fp32 value."""
    @cuda.jit
    def parts(out, x):
        if cuda.grid(1) == 0:
            head, tail = split_tf32(uint32(x[0]))
            out[0], out[1] = head, tail

    out = np.zeros(2, np.uint32)
    parts[1, 1](out, np.array([value], np.float32).view(np.uint32))
    assert out[0] & ~np.uint32(TF32_MASK) == 0
    # The tail comes rounded to tf32 by half a place added (the tensor cores read its top 19 bits).
    head, tail = out.view(np.float32)[0], (out[1:] & np.uint32(TF32_MASK)).view(np.float32)[0]
    assert abs(float(tail)) <= abs(value) * 2.0 ** -11
    assert abs(float(head) + float(tail) - value) <= abs(value) * 2.0 ** -21


def test_tf32_rounding_matches_numpy():
    """to_tf32 (cvt.rna.tf32.f32) rounds as the reference's _tf32 does, halfway cases included."""
    values = np.array([1.0, 1 + 2.0 ** -11, 1 + 2.0 ** -10 + 2.0 ** -11, -(1 + 2.0 ** -11), 3.14159265,
                       -2.5e-3, 65504.0, 1 + 2.0 ** -12], np.float32)

    @cuda.jit
    def rounded(out, x):
        i = cuda.grid(1)
        if i < x.size:
            out[i] = to_tf32(x[i])

    out = np.zeros(values.size, np.uint32)
    rounded[1, 32](out, values)
    np.testing.assert_array_equal(out.view(np.float32).astype(np.float64), _tf32(values))


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
    tf32_a, tf32_b = np.zeros((16, 8), int), np.zeros((8, 8), int)
    for lane in range(32):
        for r in range(4):
            tf32_a[tf32_a_fragment(lane, r)] += 1
        for r in range(2):
            tf32_b[tf32_b_fragment(lane, r)] += 1
    assert (tf32_a == 1).all() and (tf32_b == 1).all()


def test_b1_and_popc_mma_matches_numpy():
    """mma_b1_and: D = popc(A & B) + C over 16 x 256 by 256 x 8 bits, fragments as documented
    (`b1_a_fragment`, `b1_b_fragment`, `c_fragment`); the simulator's twin and the GPU agree."""
    from sparseblocks.ptx.mma import b1_a_fragment, b1_b_fragment, c_fragment, mma_b1_and

    rng = np.random.default_rng(5)
    A = rng.integers(0, 2, (16, 256))
    B = rng.integers(0, 2, (256, 8))
    C = rng.integers(-1000, 1000, (16, 8)).astype(np.int32)
    weights = np.uint64(1) << np.arange(32, dtype=np.uint64)

    def word(bits):
        return np.uint32((bits.astype(np.uint64) * weights).sum())

    a = np.array([[word(A[r, k:k + 32]) for r, k in (b1_a_fragment(lane, i) for i in range(4))]
                  for lane in range(32)], np.uint32)
    b = np.array([[word(B[k:k + 32, c]) for k, c in (b1_b_fragment(lane, i) for i in range(2))]
                  for lane in range(32)], np.uint32)
    c = np.array([[C[c_fragment(lane, i)] for i in range(4)] for lane in range(32)], np.int32)

    @cuda.jit
    def kernel(d, a, b, c):
        lane = cuda.threadIdx.x
        out = mma_b1_and(a[lane, 0], a[lane, 1], a[lane, 2], a[lane, 3], b[lane, 0], b[lane, 1],
                         c[lane, 0], c[lane, 1], c[lane, 2], c[lane, 3])
        for i in range(4):
            d[lane, i] = out[i]

    d = cuda.to_device(np.zeros((32, 4), np.int32))
    kernel[1, 32](d, cuda.to_device(a), cuda.to_device(b), cuda.to_device(c))
    D = d.copy_to_host()
    want = A @ B + C
    for lane in range(32):
        for i in range(4):
            assert D[lane, i] == want[c_fragment(lane, i)], (lane, i)
