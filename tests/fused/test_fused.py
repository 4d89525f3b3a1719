"""The gather fused into a 1x1 convolution, and a 1x1 convolution fused into the adding scatter
(kernels/gather_matmul.py), against their NumPy references."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from numba import cuda

from sparseblocks.runtime.arrays import poisoned_outputs
from sparseblocks.runtime.backend import SIMULATOR
from sparseblocks import fused as gather_matmul
from sparseblocks.runtime import plans
from sparseblocks.reference import fused as reference
from sparseblocks.reference.sbnet import sparse_gather, sparse_scatter
from strategies import assert_close, block_indices, geometries, gpu_only_case, values

# The simulator runs a Python thread per CUDA thread and a collective per mma (128 threads, a
# few seconds a thread block): one tile of 128 stack pixels and a few channels there.
few = settings(max_examples=2) if SIMULATOR else settings(max_examples=25)  # (the simulator: CI's time)
MAX_BLOCKS = 6 if SIMULATOR else 60
MAX_SIDE = 9 if SIMULATOR else 40


@st.composite
def problems(draw, dtype, data_format="NHWC"):
    """(x, indices, weight, geometry, count): an NHWC image with whole 16-byte pixels (or an NCHW one
    with as many channels, W even in fp16, windows of an even width), block indices (some off the
    image or out of range), a weight [C_out, C] and maybe a count."""
    step = 16 // np.dtype(dtype).itemsize
    nchw = data_format == "NCHW"
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    shape = (draw(st.integers(1, 2)), draw(st.integers(1, MAX_SIDE)), draw(st.integers(1, MAX_SIDE)),
             step * draw(st.integers(1, 3 if SIMULATOR else 40)))
    g = draw(geometries(max_size=4, max_stride=5, offsets=(-3, 2)))
    if nchw:
        g["bsize"] = (g["bsize"][0], 2 * -(-g["bsize"][1] // 2))
        if step == 8:
            shape = (*shape[:2], 2 * -(-shape[2] // 2), shape[3])
    x = values(rng, shape, dtype, draw(st.sampled_from(["normal", "small_integers", "sparse"])))
    indices = block_indices(rng, shape, g, max_blocks=MAX_BLOCKS)
    if nchw:
        x = np.ascontiguousarray(x.transpose(0, 3, 1, 2))
    n_out = draw(st.integers(1, 20 if SIMULATOR else 150))
    weight = values(rng, (n_out, shape[3]), dtype, "normal")
    count = None
    if len(indices) and draw(st.booleans()):
        count = np.array([rng.integers(0, len(indices) + 1)], np.int32)
    return x, indices, weight, g, count


@pytest.mark.parametrize("dtype", ["float16", "float32"])
@few
@given(data=st.data(), relu=st.booleans())
def test_equals_reference(data, relu, dtype):
    x, indices, weight, g, count = data.draw(problems(dtype))
    want = reference.sparse_gather_matmul(x, indices, weight, count=count, relu=relu, **g)
    with poisoned_outputs():  # every element written, rows past the count included
        got = gather_matmul.sparse_gather_matmul(x, indices, weight, count=count, relu=relu, **g)
    assert got.shape == want.shape == (len(indices), *g["bsize"], len(weight)) and got.dtype == x.dtype
    if count is not None:
        assert not got[int(count[0]):].any()
    # fp16 products on tensor cores sum in fp32 (3xTF32 for fp32), rounded once: bounded by the
    # size of each element's terms.
    magnitude = reference.sparse_gather_matmul(np.abs(x), indices, np.abs(weight), count=count, **g)
    assert_close(got, want, dtype, magnitude=magnitude, terms=weight.shape[1])


@pytest.mark.parametrize("dtype", ["float16", "float32"])
@few
@given(data=st.data())
def test_nchw_equals_reference(data, dtype):
    """An NCHW image's windows (fp16 pairs at even and odd columns, off both edges) through the
    product: the NHWC result of its gather through the transpose and the product."""
    x, indices, weight, g, count = data.draw(problems(dtype, "NCHW"))
    want = reference.sparse_gather_matmul(x, indices, weight, count=count, relu=True, data_format="NCHW", **g)
    with poisoned_outputs():
        got = gather_matmul.sparse_gather_matmul(x, indices, weight, count=count, relu=True, data_format="NCHW", **g)
    assert got.shape == want.shape == (len(indices), *g["bsize"], len(weight))
    assert_close(got, want, dtype)


SIMULATOR_GATHER_TILE = (32, 16, 16, 2, 1, None)  # one warp, 2 mma columns: a quarter of the default's mmas a thread


@pytest.fixture
def small_gather_tiles(configure):
    """In the simulator, one-warp gather tiles of 16 outputs, so that a test of several tiles
    takes seconds (its problem then spans more, smaller tiles); the GPU keeps the defaults."""
    if SIMULATOR:
        configure(gather_matmul, gather_tile=SIMULATOR_GATHER_TILE, nchw_gather_tile=SIMULATOR_GATHER_TILE)


@pytest.mark.parametrize("dtype", ["float16", gpu_only_case("float32")])
def test_nchw_several_tiles_stages_and_odd_columns(dtype, small_gather_tiles):
    """NCHW: two output-channel tiles, input channels past a stage (fp16 40: 32 and 8), more stack
    pixels than a tile, windows at odd and even columns reaching past both sides of the image."""
    rng = np.random.default_rng(6)
    cols, rows = gather_matmul.config.DEFAULT.nchw_gather_tile[1], gather_matmul.config.DEFAULT.nchw_gather_tile[0]
    channels = 40 if dtype == "float16" else 20
    x = rng.standard_normal((2, channels, 11, 14)).astype(dtype)
    w = rng.standard_normal((cols + 8, channels)).astype(dtype)
    g = {"bsize": (7, 6), "bstride": (4, 5), "boffset": (-2, -1)}
    indices = np.array([[0, 0, 0], [1, 2, 2], [7, 0, 0], [0, 1, 1]], np.int32)  # columns -1, 9, 4: odd, even
    assert len(indices) * 42 > rows
    want = reference.sparse_gather_matmul(x, indices, w, relu=False, data_format="NCHW", **g)
    got = gather_matmul.sparse_gather_matmul(x, indices, w, data_format="NCHW", **g)
    assert_close(got, want, dtype)


def test_is_the_gather_then_the_product():
    """The identity the fusion rests on, in float64 on the host: gather, then a 1x1 convolution."""
    rng = np.random.default_rng(1)
    x = rng.standard_normal((2, 7, 8, 5))
    w = rng.standard_normal((3, 5, 1, 1))
    g = {"bsize": (3, 4), "bstride": (2, 3), "boffset": (-1, 1)}
    indices = np.array([[0, 0, 0], [1, 2, 1], [0, 3, 2]], np.int32)
    stack = sparse_gather(x, indices, **g)
    want = np.einsum("bhwc,oc->bhwo", stack, w[:, :, 0, 0])
    np.testing.assert_allclose(reference.sparse_gather_matmul(x, indices, w, **g), want)


def test_several_tiles_and_channels_past_a_stage(small_gather_tiles):
    """Two output-channel tiles (C_out > COLS), input channels ending inside a stage, rows of
    more than one tile of pixels, on a device array kept by the caller (out=)."""
    rng = np.random.default_rng(2)
    cols, rows = gather_matmul.config.DEFAULT.gather_tile[1], gather_matmul.config.DEFAULT.gather_tile[0]
    x = rng.standard_normal((1, 12, 13, 40)).astype(np.float16)
    w = rng.standard_normal((cols + 8, 40)).astype(np.float16)
    g = {"bsize": (8, 9), "bstride": (4, 4), "boffset": (-2, -3)}
    indices = np.array([[0, 0, 0], [0, 1, 2], [0, 2, 1]], np.int32)
    assert len(indices) * 72 > rows
    want = reference.sparse_gather_matmul(x, indices, w, relu=True, **g)
    out = cuda.to_device(np.full(want.shape, np.nan, np.float16))
    got = gather_matmul.sparse_gather_matmul(cuda.to_device(x), cuda.to_device(indices), cuda.to_device(w),
                                             relu=True, out=out, **g)
    assert got is out
    assert_close(out.copy_to_host(), want, "float16")


@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_relu_keeps_a_nan(dtype):
    """A NaN pixel's outputs stay NaN through the ReLU, as numpy's maximum and torch's ReLU keep
    them (max.f32, what Numba's max of floats becomes, made them 0 on a GPU: a diverging block
    would have hidden its NaNs); the other pixels' are the reference's."""
    rng = np.random.default_rng(4)
    x = rng.standard_normal((1, 4, 4, 8)).astype(dtype)
    x[0, 1, 2, 3] = np.nan
    w = rng.standard_normal((3, 8)).astype(dtype)
    g = {"bsize": 2, "bstride": 2}
    indices = np.array([[0, 0, 1], [0, 1, 0]], np.int32)
    want = reference.sparse_gather_matmul(x, indices, w, relu=True, **g)
    got = gather_matmul.sparse_gather_matmul(x, indices, w, relu=True, **g)
    assert np.isnan(want[0, 1, 0]).all() and np.isnan(want).sum() == 3
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    assert_close(np.nan_to_num(got), np.nan_to_num(want), dtype)


def test_no_blocks_and_no_output_channels():
    x = np.ones((1, 4, 4, 8), np.float16)
    w = np.ones((3, 8), np.float16)
    g = {"bsize": 2, "bstride": 2}
    assert gather_matmul.sparse_gather_matmul(x, np.zeros((0, 3), np.int32), w, **g).shape == (0, 2, 2, 3)
    got = gather_matmul.sparse_gather_matmul(x, np.zeros((1, 3), np.int32), np.ones((0, 8), np.float16), **g)
    assert got.shape == (1, 2, 2, 0)


def test_a_convolution_weight_goes_as_it_is():
    rng = np.random.default_rng(3)
    x = rng.standard_normal((1, 5, 5, 8)).astype(np.float32)
    w = rng.standard_normal((4, 8, 1, 1)).astype(np.float32)
    g = {"bsize": 3, "bstride": 2, "boffset": -1}
    indices = np.array([[0, 1, 1]], np.int32)
    assert_close(gather_matmul.sparse_gather_matmul(x, indices, w, **g),
                 reference.sparse_gather_matmul(x, indices, w, **g), "float32")


@pytest.mark.parametrize("case, error, match", [
    ("float64", TypeError, "x: expected dtype"),
    ("weight dtype", TypeError, "weight: expected float16"),
    ("channels", ValueError, "16-byte vectors"),
    ("weight shape", ValueError, "weight: expected"),
    ("x shape", ValueError, "x: expected NHWC"),
    ("indices shape", ValueError, "indices: expected"),
    ("count", ValueError, "count: expected"),
    ("out shape", ValueError, "out: expected shape"),
    ("numpy out", TypeError, "out: expected a device array"),
    ("geometry", ValueError, "bsize"),
    ("out inside x", ValueError, "out: shares memory with x"),
    ("out over the indices", ValueError, "out: shares memory with indices"),
    ("nchw odd window width", ValueError, "bsize: an NCHW image's windows"),
    ("nchw fp16 odd W", ValueError, "x: an NCHW fp16 image's rows"),
    ("nchw misaligned", ValueError, "x: expected a 4-byte aligned pointer"),
    ("nchw channels", ValueError, "weight: a pixel's 12 channels"),
    ("data_format", ValueError, "data_format: expected"),
])
def test_bad_input_raises_before_any_launch(case, error, match, monkeypatch):
    x = np.ones((1, 4, 4, 8), np.float16)
    w = np.ones((3, 8), np.float16)
    indices = np.zeros((1, 3), np.int32)
    kwargs = {"bsize": 2, "bstride": 2}
    if case == "float64":
        x, w = x.astype(np.float64), w.astype(np.float64)
    elif case == "weight dtype":
        w = w.astype(np.float32)
    elif case == "channels":
        x, w = np.ones((1, 4, 4, 12), np.float16), np.ones((3, 12), np.float16)
    elif case == "weight shape":
        w = np.ones((3, 9), np.float16)
    elif case == "x shape":
        x = x[0]
    elif case == "indices shape":
        indices = np.zeros((1, 2), np.int32)
    elif case == "count":
        kwargs["count"] = np.array([2], np.int32)
    elif case == "out shape":
        kwargs["out"] = cuda.to_device(np.zeros((1, 2, 2, 4), np.float16))
    elif case == "numpy out":
        kwargs["out"] = np.zeros((1, 2, 2, 3), np.float16)
    elif case == "geometry":
        kwargs["bsize"] = 0
    elif case == "out inside x":
        buffer = cuda.to_device(np.ones(128, np.float16))
        x, w, indices = buffer.reshape(1, 4, 4, 8), cuda.to_device(w), cuda.to_device(indices)
        kwargs["out"] = buffer[64:76].reshape(1, 2, 2, 3)
    elif case == "out over the indices":
        buffer = cuda.to_device(np.zeros(12, np.float16))
        x, w, kwargs["out"] = cuda.to_device(x), cuda.to_device(w), buffer.reshape(1, 2, 2, 3)
        indices = buffer.view(np.int32)[:3].reshape(1, 3)
    elif case.startswith("nchw"):
        kwargs["data_format"] = "NCHW"
        x = np.ones((1, 8, 4, 4), np.float16)
        if case == "nchw odd window width":
            kwargs["bsize"] = (2, 3)
        elif case == "nchw fp16 odd W":
            x = np.ones((1, 8, 4, 5), np.float16)
        elif case == "nchw misaligned":
            x = cuda.to_device(np.ones(1 + 8 * 16, np.float16))[1:].reshape(1, 8, 4, 4)
            w, indices = cuda.to_device(w), cuda.to_device(indices)
        else:
            x, w = np.ones((1, 12, 4, 4), np.float16), np.ones((3, 12), np.float16)
    elif case == "data_format":
        kwargs["data_format"] = "NWHC"
    monkeypatch.setattr(gather_matmul.api, "launch", _no_launch)
    with pytest.raises(error, match=match):
        gather_matmul.sparse_gather_matmul(x, indices, w, **kwargs)


def _no_launch(*args, **kwargs):
    raise AssertionError("launched")


@pytest.mark.gpu
def test_misaligned_torch_tensors_raise():
    torch = pytest.importorskip("torch")
    storage = torch.ones(1 + 4 * 4 * 8, dtype=torch.float16, device="cuda")
    x = storage[1:].view(1, 4, 4, 8)
    w = torch.ones(3, 8, dtype=torch.float16, device="cuda")
    indices = torch.zeros(1, 3, dtype=torch.int32, device="cuda")
    with pytest.raises(ValueError, match="x: expected a 16-byte aligned pointer"):
        gather_matmul.sparse_gather_matmul(x, indices, w, bsize=2, bstride=2)


@pytest.mark.gpu
@pytest.mark.parametrize("data_format", ["NHWC", "NCHW"])
def test_kept_launch_replays_with_new_tensors(data_format):
    """A repeated call of torch tensors replays its kept launch: new pointers, the same result
    as the general path, into a new tensor or an aligned out=. Each format's plan has its own key
    (NCHW windows at odd columns): a call of the other format on tensors of the same shapes in
    between takes neither's."""
    torch = pytest.importorskip("torch")

    rng = np.random.default_rng(5)
    g = {"bsize": (5, 6), "bstride": (4, 5), "boffset": (-1, -1)}
    other = "NCHW" if data_format == "NHWC" else "NHWC"
    indices = torch.tensor([[0, 0, 0], [1, 2, 1], [0, 1, 3], [2, 0, 0]], dtype=torch.int32, device="cuda")
    count = torch.tensor([3], dtype=torch.int32, device="cuda")
    plans.clear()
    for step in range(3):
        x = torch.tensor(rng.standard_normal((2, 24, 10, 24)), dtype=torch.float16, device="cuda")
        w = torch.tensor(rng.standard_normal((72, 24)), dtype=torch.float16, device="cuda")
        want = reference.sparse_gather_matmul(x.cpu().numpy(), indices.cpu().numpy(), w.cpu().numpy(),
                                              count=count.cpu().numpy(), relu=True, data_format=data_format, **g)
        if step == 1:
            gather_matmul.sparse_gather_matmul(x, indices, w, count=count, relu=True, data_format=other, **g)
        out = torch.full(want.shape, float("nan"), dtype=torch.float16, device="cuda") if step == 2 else None
        got = gather_matmul.sparse_gather_matmul(x, indices, w, count=count, relu=True, out=out,
                                                 data_format=data_format, **g)
        assert out is None or got is out
        assert_close(got.cpu().numpy(), want, "float16")
        assert gather_matmul.kept_launch(x, indices, w, count, relu=True, data_format=data_format, **g) is not None


def test_takes_says_what_the_launcher_takes():
    """`takes` (for callers choosing the fused kernel or the two calls) agrees with the launcher:
    fp16 and fp32, whole 16-byte pixels, contiguous, aligned; nothing else."""
    torch = pytest.importorskip("torch")
    x = torch.ones(1, 4, 4, 16, dtype=torch.float16)
    w = torch.ones(3, 16, dtype=torch.float16)
    assert gather_matmul.takes(x, w) and gather_matmul.takes(x.float(), w.float())
    assert not gather_matmul.takes(x.double(), w.double())  # fp64
    assert not gather_matmul.takes(x, w.float())  # dtypes differ
    assert not gather_matmul.takes(x[..., :12].contiguous(), w[:, :12].contiguous())  # 24-byte pixels
    assert not gather_matmul.takes(x.transpose(1, 2), w)  # not contiguous
    storage = torch.ones(8 + 4 * 4 * 16, dtype=torch.float16)
    assert not gather_matmul.takes(storage[1:1 + 256].view(1, 4, 4, 16), w)  # 2 bytes past an aligned start
    nchw = x.permute(0, 3, 1, 2).contiguous()  # NCHW: windows of an even width, fp16 rows of whole words
    assert gather_matmul.takes(nchw, w, "NCHW", (3, 2)) and gather_matmul.takes(nchw.float(), w.float(), "NCHW", (3, 2))
    assert not gather_matmul.takes(nchw, w, "NCHW", (3, 3))
    assert not gather_matmul.takes(torch.ones(1, 16, 4, 5, dtype=torch.float16), w, "NCHW", (2, 2))
    assert gather_matmul.takes(torch.ones(1, 16, 4, 5), w.float(), "NCHW", (2, 2))
    assert not gather_matmul.takes(storage[1:1 + 256].view(1, 16, 4, 4), w, "NCHW", (2, 2))  # half a word on


def test_scatter_takes_says_what_the_launcher_takes():
    """`scatter_takes` as the launcher: one dtype, whole 16-byte stack pixels, contiguous, aligned;
    an NCHW fp16 y also whole words a window row (even W, windows, strides and offsets)."""
    torch = pytest.importorskip("torch")
    blocks, w = torch.ones(2, 2, 4, 8, dtype=torch.float16), torch.ones(6, 8, dtype=torch.float16)
    y = torch.ones(1, 8, 6, 6, dtype=torch.float16)
    assert gather_matmul.scatter_takes(blocks, w, y.permute(0, 2, 3, 1).contiguous())
    assert gather_matmul.scatter_takes(blocks, w, y, "NCHW", (2, 4), (2, 4), (0, -2))
    assert not gather_matmul.scatter_takes(blocks, w, y, "NCHW", (2, 4), (2, 4), (0, -1))  # odd offset
    assert not gather_matmul.scatter_takes(blocks, w, y, "NCHW", (2, 4), (2, 5))  # odd stride
    assert not gather_matmul.scatter_takes(blocks, w, y[..., :5].contiguous(), "NCHW", (2, 4), (2, 4))  # odd W
    assert not gather_matmul.scatter_takes(blocks, w, y, "NCHW", (2, 3), (2, 4))  # odd width
    assert gather_matmul.scatter_takes(blocks.float()[..., :4].contiguous(), w.float()[:, :4].contiguous(),
                                       y.float()[..., :5].contiguous(), "NCHW", (2, 3), (2, 5), 1)  # fp32: any
    assert not gather_matmul.scatter_takes(blocks, w.float(), y)  # dtypes differ
    assert not gather_matmul.scatter_takes(blocks[..., :4].contiguous(), w[:, :4].contiguous(), y)  # 8-byte pixels


# -- the product fused into the adding scatter (sparse_matmul_scatter) ------------------------


def _even(n):
    return 2 * -(-n // 2)


@st.composite
def scatter_problems(draw, dtype, data_format="NHWC"):
    """(blocks, indices, weight, y, geometry, count): an NHWC stack of whole 16-byte pixels, windows
    that do not overlap (unique indices, some off the image or out of range), a weight [C, K], an
    NHWC y of C channels (any C; NCHW with `data_format`, fp16 there with an even W and windows of
    an even width every even number of columns from an even offset) and maybe a count."""
    step = 16 // np.dtype(dtype).itemsize
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    channels = draw(st.integers(1, 20 if SIMULATOR else 150))
    shape = (draw(st.integers(1, 2)), draw(st.integers(1, MAX_SIDE)), draw(st.integers(1, MAX_SIDE)), channels)
    g = draw(geometries(max_size=4, max_stride=5, offsets=(-3, 2)))
    g["bstride"] = tuple(max(a, b) for a, b in zip(g["bstride"], g["bsize"]))  # (windows apart)
    words = data_format == "NCHW" and step == 8
    if words:
        shape = (*shape[:2], _even(shape[2]), channels)
        g = {key: (value[0], _even(value[1])) for key, value in g.items()}
    y = values(rng, shape, dtype, draw(st.sampled_from(["normal", "small_integers", "sparse"])))
    indices = block_indices(rng, shape, g, max_blocks=MAX_BLOCKS, unique=True)
    if data_format == "NCHW":
        y = np.ascontiguousarray(y.transpose(0, 3, 1, 2))
    k = step * draw(st.integers(1, 3 if SIMULATOR else 40))
    blocks = values(rng, (len(indices), *g["bsize"], k), dtype, "normal")
    weight = values(rng, (channels, k), dtype, "normal")
    count = None
    if len(indices) and draw(st.booleans()):
        count = np.array([rng.integers(0, len(indices) + 1)], np.int32)
    return blocks, indices, weight, y, g, count


@pytest.mark.parametrize("data_format", ["NHWC", "NCHW"])
@pytest.mark.parametrize("dtype", ["float16", "float32"])
@few
@given(data=st.data())
def test_matmul_scatter_equals_reference(data, dtype, data_format):
    """NCHW: the NHWC product added through the transpose (fp16 by words of two columns)."""
    blocks, indices, weight, y, g, count = data.draw(scatter_problems(dtype, data_format))
    want = reference.sparse_matmul_scatter(blocks, indices, weight, y, count=count, data_format=data_format, **g)
    into = cuda.to_device(y)
    count = None if count is None else cuda.to_device(count)
    got = gather_matmul.sparse_matmul_scatter(cuda.to_device(blocks), cuda.to_device(indices), cuda.to_device(weight),
                                              into, count=count, data_format=data_format, **g)
    assert got is into
    # Bounded by the size of what each element sums (y and the product's terms), not by the
    # result's: an output whose terms cancel is as accurate as the terms allow.
    magnitude = reference.sparse_matmul_scatter(np.abs(blocks), indices, np.abs(weight), np.abs(y), count=count,
                                                data_format=data_format, **g)
    assert_close(into.copy_to_host(), want, dtype, magnitude=magnitude, terms=weight.shape[1] + 1, stored=1)


def test_matmul_scatter_is_the_product_then_the_scatter():
    """The identity the fusion rests on, in float64 on the host; pixels outside every window keep y's
    values exactly."""
    rng = np.random.default_rng(6)
    y = rng.standard_normal((2, 7, 9, 3))
    blocks, w = rng.standard_normal((3, 3, 4, 5)), rng.standard_normal((3, 5, 1, 1))
    g = {"bsize": (3, 4), "bstride": (3, 4), "boffset": (-1, 1)}
    indices = np.array([[0, 0, 0], [1, 2, 1], [0, 1, 2]], np.int32)
    want = sparse_scatter(np.einsum("bhwk,ck->bhwc", blocks, w[:, :, 0, 0]), indices, y, add=True, **g)
    got = reference.sparse_matmul_scatter(blocks, indices, w, y, **g)
    np.testing.assert_allclose(got, want)
    assert (got[0, :, 0] == y[0, :, 0]).all()  # (column 0 is left of every window)


@pytest.mark.parametrize("data_format", ["NHWC", gpu_only_case("NCHW")])
def test_matmul_scatter_several_tiles_in_place(data_format, configure):
    """Two output-channel tiles, the stack's channels ending inside a stage, more than one tile of
    stack pixels, windows partly off the image, and a count; the rest of y untouched. (NCHW fp16:
    windows of an even width from an even column; a tile's rows end mid window row.) In the
    simulator: one-warp tiles of 32 pixels and windows of 4 x 5, several tiles in a quarter of
    the threads."""
    rng = np.random.default_rng(7)
    nhwc = data_format == "NHWC"
    if SIMULATOR:
        configure(gather_matmul, scatter_tiles={"float16": (32, 64, 16, 2, 1, None),
                                                "float32": (32, 32, 16, 2, 1, None)})
        g = {"bsize": (4, 5), "bstride": (4, 5), "boffset": (-2, -3)}
    else:
        g = {"bsize": (8, 9 if nhwc else 10), "bstride": (8, 9 if nhwc else 10), "boffset": (-2, -3 if nhwc else -4)}
    rows, cols = gather_matmul.config.DEFAULT.scatter_tiles["float16"][:2]
    indices = np.array([[0, 0, 0], [0, 1, 2], [0, 2, 1], [0, 1, 1]], np.int32)
    assert 3 * g["bsize"][0] * g["bsize"][1] > rows
    y = rng.standard_normal((1, 17, 20, cols + 8)).astype(np.float16)
    if not nhwc:
        y = np.ascontiguousarray(y.transpose(0, 3, 1, 2))
    blocks = rng.standard_normal((4, *g["bsize"], 40)).astype(np.float16)
    w = rng.standard_normal((cols + 8, 40)).astype(np.float16)
    count = np.array([3], np.int32)
    want = reference.sparse_matmul_scatter(blocks, indices, w, y, count=count, data_format=data_format, **g)
    into = cuda.to_device(y)
    gather_matmul.sparse_matmul_scatter(cuda.to_device(blocks), cuda.to_device(indices), cuda.to_device(w), into,
                                        count=cuda.to_device(count), data_format=data_format, **g)
    got = into.copy_to_host()
    assert_close(got, want, "float16")
    untouched = want == y
    assert (got[untouched] == y[untouched]).all()


def test_matmul_scatter_nothing_to_add():
    y = np.ones((1, 4, 4, 3), np.float32)
    into = cuda.to_device(y)
    g = {"bsize": 2, "bstride": 2}
    w = cuda.to_device(np.ones((3, 4), np.float32))
    gather_matmul.sparse_matmul_scatter(cuda.to_device(np.ones((0, 2, 2, 4), np.float32)),
                                        cuda.to_device(np.zeros((0, 3), np.int32)), w, into, **g)
    gather_matmul.sparse_matmul_scatter(cuda.to_device(np.ones((1, 2, 2, 4), np.float32)),
                                        cuda.to_device(np.zeros((1, 3), np.int32)), w, into,
                                        count=cuda.to_device(np.array([0], np.int32)), **g)
    assert (into.copy_to_host() == y).all()


@pytest.mark.parametrize("case, error, match", [
    ("float64", TypeError, "blocks: expected dtype"),
    ("weight dtype", TypeError, "weight: expected float16"),
    ("y dtype", TypeError, "y: expected float16"),
    ("numpy y", TypeError, "y: expected a device array"),
    ("channels", ValueError, "16-byte vectors"),
    ("weight shape", ValueError, "weight: expected"),
    ("output channels", ValueError, "weight: expected 3 output channels"),
    ("blocks shape", ValueError, "blocks: expected shape"),
    ("y shape", ValueError, "y: expected NHWC"),
    ("overlap", ValueError, "overlap"),
    ("count", ValueError, "count: expected"),
    ("geometry", ValueError, "bsize"),
    ("blocks inside y", ValueError, "y: shares memory with blocks"),
    ("weight inside y", ValueError, "y: shares memory with weight"),
    ("nchw y shape", ValueError, "y: expected NCHW"),
    ("nchw odd offset", ValueError, "words of two columns"),
    ("nchw odd stride", ValueError, "words of two columns"),
    ("nchw odd W", ValueError, "words of two columns"),
    ("nchw misaligned", ValueError, "words of two columns"),
])
def test_matmul_scatter_bad_input_raises_before_any_launch(case, error, match, monkeypatch):
    blocks = np.ones((1, 2, 2, 8), np.float16)
    w = np.ones((3, 8), np.float16)
    y = np.zeros((1, 4, 4, 3), np.float16)
    indices = np.zeros((1, 3), np.int32)
    kwargs = {"bsize": 2, "bstride": 2}
    if case == "float64":
        blocks, w, y = blocks.astype(np.float64), w.astype(np.float64), y.astype(np.float64)
    elif case == "weight dtype":
        w = w.astype(np.float32)
    elif case == "y dtype":
        y = y.astype(np.float32)
    elif case == "channels":
        blocks, w = np.ones((1, 2, 2, 12), np.float16), np.ones((3, 12), np.float16)
    elif case == "weight shape":
        w = np.ones((3, 9), np.float16)
    elif case == "output channels":
        w = np.ones((4, 8), np.float16)
    elif case == "blocks shape":
        blocks = np.ones((1, 3, 2, 8), np.float16)
    elif case == "y shape":
        y = y[0]
    elif case == "overlap":
        kwargs["bstride"] = (2, 1)
    elif case == "count":
        kwargs["count"] = np.array([1, 1], np.int32)
    elif case == "geometry":
        kwargs["bsize"] = 0
    elif case.startswith("nchw"):  # (fp16 NCHW: whole words of y a window row)
        kwargs["data_format"] = "NCHW"
        y = np.zeros((1, 3, 4, 6), np.float16)
        if case == "nchw y shape":
            y = y[0]
        elif case == "nchw odd offset":
            kwargs["boffset"] = (0, 1)
        elif case == "nchw odd stride":
            kwargs["bstride"] = (2, 3)
        elif case == "nchw odd W":
            y = np.zeros((1, 3, 4, 5), np.float16)
    if case == "nchw misaligned":
        blocks, indices, w = (cuda.to_device(a) for a in (blocks, indices, w))
        into = cuda.to_device(np.zeros(1 + y.size, np.float16))[1:].reshape(y.shape)
    elif case == "numpy y":
        into = y
    else:
        blocks, indices, w, into = (cuda.to_device(a) for a in (blocks, indices, w, y))
        if "count" in kwargs:
            kwargs["count"] = cuda.to_device(kwargs["count"])
    if case == "blocks inside y":
        blocks = into.reshape(48)[8:40].reshape(1, 2, 2, 8)
    elif case == "weight inside y":
        w = into.reshape(48)[16:40].reshape(3, 8)
    monkeypatch.setattr(gather_matmul.api, "launch", _no_launch)
    with pytest.raises(error, match=match):
        gather_matmul.sparse_matmul_scatter(blocks, indices, w, into, **kwargs)
    if case != "numpy y":
        assert not into.copy_to_host().any()  # (nothing launched)


@pytest.mark.gpu
def test_matmul_scatter_kept_launch_replays_with_new_tensors():
    """A repeated call of torch tensors replays its kept launch (new pointers), adding as the
    general path does; `kept_scatter_launch` hands the same launch out."""
    torch = pytest.importorskip("torch")

    rng = np.random.default_rng(8)
    g = {"bsize": (5, 6), "bstride": (5, 6), "boffset": (-1, -2)}
    indices = torch.tensor([[0, 0, 0], [1, 2, 1], [0, 1, 2], [1, 0, 0]], dtype=torch.int32, device="cuda")
    count = torch.tensor([3], dtype=torch.int32, device="cuda")
    plans.clear()
    for step in range(3):
        y = torch.tensor(rng.standard_normal((2, 12, 16, 72)), dtype=torch.float16, device="cuda")
        blocks = torch.tensor(rng.standard_normal((4, 5, 6, 24)), dtype=torch.float16, device="cuda")
        w = torch.tensor(rng.standard_normal((72, 24)), dtype=torch.float16, device="cuda")
        want = reference.sparse_matmul_scatter(blocks.cpu().numpy(), indices.cpu().numpy(), w.cpu().numpy(),
                                               y.cpu().numpy(), count=count.cpu().numpy(), **g)
        if step == 2:
            launch, extra = gather_matmul.kept_scatter_launch(blocks, indices, w, y, count, **g)
            assert extra is None
            launch(torch.cuda.current_stream().cuda_stream, y.data_ptr(), blocks.data_ptr(), w.data_ptr(),
                   indices.data_ptr(), count.data_ptr())
        else:
            assert gather_matmul.sparse_matmul_scatter(blocks, indices, w, y, count=count, **g) is y
        assert_close(y.cpu().numpy(), want, "float16")
        assert any(key[0] == "sbnet matmul_scatter" for key in plans.kept)


def test_config_refuses_tiles_the_scatter_cannot_stage():
    """The scatter's staged rows of out are swizzled over 8 units of 16 bytes: narrower tiles would
    write past their row (the simulator's cp.async twin caught it)."""
    from dataclasses import replace

    with pytest.raises(ValueError, match="scatter_tiles"):
        replace(gather_matmul.DEFAULT, scatter_tiles={"float16": (64, 32, 16, 2, 2, None),
                                                      "float32": (64, 64, 16, 2, 2, None)})
