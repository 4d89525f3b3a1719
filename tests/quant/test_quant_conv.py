"""Image packing and the convolutions from bit planes against their NumPy twins."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sparseblocks import quant
from sparseblocks.reference import quant as reference
from sparseblocks.runtime.backend import SIMULATOR
from strategies import assert_close

few = settings(max_examples=2, deadline=None) if SIMULATOR else settings(max_examples=25, deadline=None)
# (each convolution's geometry is compiled in: about 7 s of compiling an example on a GPU)
compiled_few = settings(max_examples=2 if SIMULATOR else 8, deadline=None)


@pytest.fixture(autouse=True)
def small_tiles(configure):
    """The simulator's tiles: one warp of 2 x 2 mma tiles, chunks of one mma step (as in `test_quant`)."""
    if SIMULATOR:
        configure(quant, warps_m=1, warps_n=1, warp_rows=32, dense_cols=16, chunk_words=8, simt_rows=4, simt_cols=8)


MAX_SIDE = 5 if SIMULATOR else 12
MAX_CHANNELS = 70 if SIMULATOR else 300


def images(rng, shape, bits, signed, dtype="float32", channels_last=False):
    """(x as NCHW, basis, its QuantImage): a basis a row for ±1 codes (filters), else one."""
    x = rng.standard_normal(shape).astype(dtype)
    if not signed:
        x = np.abs(x)
    basis = (rng.uniform(0.1, 1.0, (shape[0] if signed else 1, bits)) * 2.0 ** np.arange(bits)).astype(np.float32)
    given_x = np.ascontiguousarray(x.transpose(0, 2, 3, 1)) if channels_last else x
    return x, basis, quant.quantize_image(given_x, basis if signed else basis[0], signed, channels_last=channels_last)


def codes_of(x, basis, signed):
    """The twin's codes of a batch (N, C, H, W), thresholds in fp32 as the kernel compares."""
    N, C, H, W = x.shape
    rows = x.astype(np.float32).transpose(0, 2, 3, 1).reshape(N, H * W * C) if signed else \
        x.astype(np.float32).transpose(0, 2, 3, 1)
    codes, _ = reference.encode(rows, basis if signed else basis[0], signed, threshold_dtype=np.float32)
    return codes.reshape(N, H, W, C).transpose(0, 3, 1, 2)


@few
@given(seed=st.integers(0, 2**32 - 1), n=st.integers(1, 3), channels=st.integers(1, MAX_CHANNELS),
       side=st.integers(1, MAX_SIDE), bits=st.integers(1, 4), signed=st.booleans(), channels_last=st.booleans(),
       dtype=st.sampled_from(["float32", "float16"]))
def test_image_packing_is_the_twins_bit_exact(seed, n, channels, side, bits, signed, channels_last, dtype):
    """Each pixel's channels 32 a word, from NCHW or channels-last batches, one basis or one an image."""
    rng = np.random.default_rng(seed)
    x, basis, q = images(rng, (n, channels, side, side + 1), bits, signed, dtype, channels_last)
    assert q.planes.shape == (bits, n, side, side + 1, -(-channels // 32)) and q.shape == x.shape
    np.testing.assert_array_equal(q.planes, reference.pack_image(codes_of(x, basis, signed), bits))


def test_twin_is_torchs_convolution_of_the_decoded_values():
    """Cross-correlation with zero padding, strides and dilations: `torch.nn.functional.conv2d`."""
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(0)
    x, a_basis, a = images(rng, (2, 40, 6, 7), 2, False)
    w, w_basis, f = images(rng, (5, 40, 3, 2), 2, True)
    a_values = reference.decode(codes_of(x, a_basis, False), a_basis[0], False)
    w_values = np.einsum("ocrsk,ok->ocrs", 2 * ((codes_of(w, w_basis, True)[..., None] >> np.arange(2)) & 1) - 1,
                         w_basis.astype(np.float64))
    want = torch.nn.functional.conv2d(torch.tensor(a_values), torch.tensor(w_values), stride=(2, 1), padding=(1, 2),
                                      dilation=(1, 2)).numpy().transpose(0, 2, 3, 1)
    got = reference.conv2d(a.planes, a_basis[0], f.planes, w_basis, 40, (2, 1), (1, 2), (1, 2))
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)


def magnitude_of(a, a_basis, f, w_basis, args):
    """Each output's sum of its terms' magnitudes: the twin's convolution with every filter bit
    set (each value Σ|v_k|); the activations are not negative."""
    ones = np.full_like(f.planes, 0xFFFFFFFF)
    return reference.conv2d(a.planes, a_basis[0], ones, np.abs(w_basis), a.channels, *args)


@compiled_few
@given(seed=st.integers(0, 2**32 - 1), n=st.integers(1, 2), channels=st.integers(1, MAX_CHANNELS),
       side=st.integers(1, MAX_SIDE), outputs=st.integers(1, 20), taps=st.sampled_from([(1, 1), (3, 3), (2, 3)]),
       stride=st.integers(1, 2), padding=st.integers(0, 2), dilation=st.integers(1, 2), a_bits=st.integers(1, 3),
       w_bits=st.integers(1, 3), bias=st.booleans(), relu=st.booleans(), out_dtype=st.sampled_from(quant.OUT_DTYPES))
def test_convolutions_match_the_twin(seed, n, channels, side, outputs, taps, stride, padding, dilation, a_bits,
                                     w_bits, bias, relu, out_dtype):
    """WkAm convolutions, both kernels, against the twin: taps past the image's edge, strides,
    dilations, partial channel words, bias and ReLU, fp32 or fp16 out."""
    rng = np.random.default_rng(seed)
    R, S = taps
    H, W = side + dilation * (R - 1), side + 1 + dilation * (S - 1)  # (at least one output)
    x, a_basis, a = images(rng, (n, channels, H, W), a_bits, False)
    _, w_basis, f = images(rng, (outputs, channels, R, S), w_bits, True)
    b = rng.standard_normal(outputs).astype(np.float32) if bias else None
    args = ((stride,) * 2, (padding,) * 2, (dilation,) * 2)
    want = reference.conv2d(a.planes, a_basis[0], f.planes, w_basis, channels, *args, bias=b, relu=relu)
    magnitude = magnitude_of(a, a_basis, f, w_basis, args) + (np.abs(b) if bias else 0)
    for version in quant.VERSIONS:
        got = quant.conv2d(a, f, stride, padding, dilation, bias=b, relu=relu, out_dtype=out_dtype, version=version)
        assert got.shape == want.shape and got.dtype == np.dtype(out_dtype)
        assert_close(got.astype(np.float64), want, out_dtype, version, magnitude=magnitude, terms=a_bits * w_bits)


def test_tensor_core_convolution_spans_chunks_warps_groups_and_passes(configure):
    """Two warps across the outputs and a partial second group of them, a partial row block of
    pixels, a tap list of several chunks (3 words a tap: 1-word staging loads), two activation
    planes and two weight passes: the twin's values."""
    configure(quant, warps_m=1, warps_n=2, warp_rows=32, dense_cols=16, chunk_words=8)
    rng = np.random.default_rng(7)
    x, a_basis, a = images(rng, (1, 70, 6, 5), 2, False)
    _, w_basis, f = images(rng, (24, 70, 3, 3), 2, True)
    want = reference.conv2d(a.planes, a_basis[0], f.planes, w_basis, 70, (1, 1), (1, 1), (1, 1))
    got = quant.conv2d(a, f, 1, 1)
    magnitude = magnitude_of(a, a_basis, f, w_basis, ((1, 1),) * 3)
    assert_close(got.astype(np.float64), want, "float32", "tensorcore", magnitude=magnitude, terms=4)


@pytest.mark.parametrize("case, error, match", [
    ("3-D x", ValueError, "x: expected a 4-D array"),
    ("float64 x", TypeError, "x: expected dtype"),
    ("not quantized", TypeError, "a: expected a QuantImage"),
    ("signed activations", ValueError, "a: expected activations"),
    ("shared filter basis", ValueError, "w: expected filters"),
    ("channels", ValueError, "w: expected 40 channels"),
    ("too large a filter", ValueError, "do not fit"),
    ("stride", ValueError, "stride: expected an int or two ints of at least 1"),
    ("padding", ValueError, "padding: expected"),
    ("bias shape", ValueError, "bias: expected shape"),
    ("out dtype", ValueError, "out_dtype"),
])
def test_bad_input_is_refused_before_any_launch(case, error, match):
    x = np.ones((1, 40, 4, 4), np.float32)
    a = quant.quantize_image(x, [1.0])
    f = quant.quantize_filters(np.ones((8, 40, 3, 3), np.float32), np.ones((8, 1), np.float32))
    calls = {
        "3-D x": lambda: quant.quantize_image(x[0], [1.0]),
        "float64 x": lambda: quant.quantize_image(x.astype(np.float64), [1.0]),
        "not quantized": lambda: quant.conv2d(x, f),
        "signed activations": lambda: quant.conv2d(quant.quantize_image(x, [1.0], signed=True), f),
        "shared filter basis": lambda: quant.conv2d(a, quant.quantize_image(np.ones((8, 40, 3, 3), np.float32),
                                                                            [1.0], signed=True)),
        "channels": lambda: quant.conv2d(a, quant.quantize_filters(np.ones((8, 41, 3, 3), np.float32),
                                                                   np.ones((8, 1)))),
        "too large a filter": lambda: quant.conv2d(a, f, dilation=3),
        "stride": lambda: quant.conv2d(a, f, stride=0),
        "padding": lambda: quant.conv2d(a, f, padding=(1, -1)),
        "bias shape": lambda: quant.conv2d(a, f, bias=np.ones(7, np.float32)),
        "out dtype": lambda: quant.conv2d(a, f, out_dtype="int8"),
    }
    with pytest.raises(error, match=match):
        calls[case]()
