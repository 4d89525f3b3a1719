"""Vector loads and stores (kernels/_vector.py): the values of 2 or 4 neighbours, and the alignment promise."""

import numpy as np
import pytest
from numba import cuda

from sparseblocks.ptx.half2 import bf16_of_float, floats_of_half2, half2_of_floats
from sparseblocks.ptx.vector import aligned, load2, load4, load4_words, store2, store4


@cuda.jit
def _copy_quads(out, a):
    i = cuda.threadIdx.x
    if i < out.shape[1] // 4:
        for r in range(out.shape[0]):
            q = load4(a, (r, 4 * i))
            for k in range(4):
                out[r, 4 * i + k] = q[k]


@cuda.jit
def _copy_pairs(out, w):
    i = cuda.threadIdx.x
    if i < out.shape[2] // 2:
        p = load2(w, (1, 2, 2 * i))
        out[0, 0, 2 * i] = p[0]
        out[0, 0, 2 * i + 1] = p[1]


@cuda.jit
def _store_quads(quads, a):
    i = cuda.threadIdx.x
    if i < a.shape[0] // 4:
        store4(quads, (4 * i,), load4(a, (4 * i,)))


@cuda.jit
def _store_pairs(pairs, a):
    i = cuda.threadIdx.x
    if i < a.shape[0] // 2:
        store2(pairs, (2 * i,), (a[2 * i], a[2 * i + 1]))


@pytest.mark.parametrize("dtype", [np.float32, np.int32, np.float64])
def test_vector_stores_write_neighbours(dtype):
    """16-byte stores as the SBNet row copies make them: 4 of 4 bytes, 2 of 8 bytes."""
    a = (np.arange(16) % 13 - 6).astype(dtype)
    out = cuda.to_device(np.zeros(16, dtype))
    (_store_pairs if a.itemsize == 8 else _store_quads)[1, 8](out, cuda.to_device(a))
    np.testing.assert_array_equal(out.copy_to_host(), a)


@pytest.mark.parametrize("dtype", [np.float32, np.float16, np.int16])
def test_vector_loads_read_neighbours(dtype):
    a = (np.arange(3 * 16) % 251).astype(dtype).reshape(3, 16)
    out = cuda.device_array_like(a)
    _copy_quads[1, 4](out, cuda.to_device(a))
    np.testing.assert_array_equal(out.copy_to_host(), a)
    w = (np.arange(2 * 3 * 8) % 127).astype(dtype).reshape(2, 3, 8)
    pairs = cuda.to_device(np.zeros((1, 1, 8), dtype))
    _copy_pairs[1, 4](pairs, cuda.to_device(w))
    np.testing.assert_array_equal(pairs.copy_to_host()[0, 0], w[1, 2])


@cuda.jit
def _word_quads(out, a):
    i = cuda.threadIdx.x
    if i < a.shape[0] // 4:
        words = load4_words(a, (4 * i,))
        for k in range(len(words)):
            out[len(words) * i + k] = words[k]


@cuda.jit
def _widen_words(out, words):
    i = cuda.threadIdx.x
    if i < words.shape[0]:
        out[2 * i], out[2 * i + 1] = floats_of_half2(words[i])


@pytest.mark.parametrize("dtype", [np.float16, np.float32])
def test_words_are_their_bits(dtype):
    """load4_words: the bits of 4 neighbours, as 2 (fp16) or 4 (fp32) uint32 words."""
    a = np.array([1.0, -0.0, np.inf, 6e-8, -3.0, 7.25, 1e4, -1e-3], dtype)
    out = cuda.to_device(np.zeros(a.nbytes // 4, np.uint32))
    _word_quads[1, 2](out, cuda.to_device(a))
    np.testing.assert_array_equal(out.copy_to_host(), a.view(np.uint32))


def test_half_pairs_widen_to_their_values():
    """floats_of_half2 widens a word's two halves (low first), exactly: signed zeros,
    subnormals, infinities and the largest half included."""
    a = np.array([1.5, -2.0, 0.0, -0.0, 6e-8, -6.1e-5, np.inf, -np.inf, 65504, -1e-3, 3.14, 7], np.float16)
    out = cuda.to_device(np.full(a.size, np.nan, np.float32))
    _widen_words[1, 8](out, cuda.to_device(a.view(np.uint32)))
    got = out.copy_to_host()
    np.testing.assert_array_equal(got, a.astype(np.float32))
    assert np.array_equal(np.signbit(got), np.signbit(a))


@cuda.jit
def _narrow_pairs(out, a):
    i = cuda.threadIdx.x
    if 2 * i + 1 < a.shape[0]:
        out[i] = half2_of_floats(a[2 * i], a[2 * i + 1])


def test_float_pairs_narrow_to_a_word_of_halves():
    """half2_of_floats rounds two floats to the halves of one word (low first), to nearest:
    signed zeros, subnormals and overflow to infinity included."""
    a = np.array([1.5, -2.0, 0.0, -0.0, 6e-8, 70000.0, 3.14159, -1e-3, 2049.0, -65520.0], np.float32)
    out = cuda.to_device(np.zeros(a.size // 2, np.int32))
    _narrow_pairs[1, 8](out, cuda.to_device(a))
    got = out.copy_to_host().view(np.float16)
    np.testing.assert_array_equal(got, a.astype(np.float16))
    assert np.array_equal(np.signbit(got), np.signbit(a))


@cuda.jit
def _to_bf16(out, a):
    i = cuda.threadIdx.x
    if i < a.shape[0]:
        out[i] = bf16_of_float(a[i])


def test_floats_round_to_bf16_bits():
    """bf16_of_float rounds to nearest even, as ml_dtypes does: ties, signed zeros, subnormals,
    overflow to infinity; a NaN stays a NaN."""
    import ml_dtypes

    a = np.array([1.0, 1.00390625, 1.01171875, -0.0, 3e-39, 3.4e38, -3.4e38, 1e-45, np.inf, -2.5, np.nan],
                 np.float32)
    out = cuda.to_device(np.zeros(a.size, np.int16))
    _to_bf16[1, 16](out, cuda.to_device(a))
    got = out.copy_to_host().view(ml_dtypes.bfloat16)
    want = a.astype(ml_dtypes.bfloat16)
    assert np.isnan(got[-1].astype(np.float32))
    np.testing.assert_array_equal(got[:-1].view(np.int16), want[:-1].view(np.int16))


def test_alignment_rule():
    assert aligned(64, 4, 4) and aligned(16, 4, 4) and aligned(8, 4, 2) and aligned(8, 2, 4)
    assert not aligned(8, 4, 4) and not aligned(4, 4, 2) and not aligned(2, 2, 2)


@pytest.mark.simulator
def test_unaligned_vector_load_fails_in_the_simulator():
    storage = cuda.to_device(np.zeros(3 * 16 + 1, np.float32))
    a = storage[1:].reshape(3, 16)
    with pytest.raises(Exception, match="not aligned"):
        _copy_quads[1, 4](cuda.device_array((3, 16), np.float32), a)
    with pytest.raises(Exception, match="not aligned"):
        _store_quads[1, 4](storage[1:17], cuda.to_device(np.zeros(16, np.float32)))
