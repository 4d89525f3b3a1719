"""SBNet's gather and scatter on CPU tensors (sparseblocks/torch/cpu.py) against the NumPy twins,
and the differentiable functions on CPU tensors against the kernels in the simulator."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch")

import sparseblocks.torch as sbt  # noqa: E402
from sparseblocks.reference import sbnet as reference  # noqa: E402
from sparseblocks.torch import cpu  # noqa: E402


@st.composite
def cases(draw):
    """An image, a geometry whose windows may overlap and reach off the image, and indices
    (repeats and images past N included) with a count."""
    N, H, W, C = draw(st.integers(1, 2)), draw(st.integers(1, 9)), draw(st.integers(1, 9)), draw(st.integers(1, 3))
    size = (draw(st.integers(1, 4)), draw(st.integers(1, 4)))
    stride = (draw(st.integers(1, 4)), draw(st.integers(1, 4)))
    offset = (draw(st.integers(-2, 1)), draw(st.integers(-2, 1)))
    B = draw(st.integers(0, 6))
    indices = np.array([[draw(st.integers(0, N)), draw(st.integers(-1, 3)), draw(st.integers(-1, 3))]
                        for _ in range(B)], np.int32).reshape(-1, 3)
    count = draw(st.none() | st.integers(0, B))
    return (N, H, W, C), (size, stride, offset), indices, count


@settings(max_examples=60)
@given(case=cases(), nchw=st.booleans(), transpose=st.booleans(), add=st.booleans(), seed=st.integers(0, 99))
def test_gather_and_scatter_match_the_numpy_twins(case, nchw, transpose, add, seed):
    (N, H, W, C), geometry, indices, count = case
    data_format = "NCHW" if nchw else "NHWC"
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((N, C, H, W) if nchw else (N, H, W, C))
    kept = None if count is None else np.array([count], np.int32)
    kwargs = dict(transpose=transpose, count=kept, data_format=data_format)
    count_t = None if kept is None else torch.from_numpy(kept)
    got = cpu.sparse_gather(torch.from_numpy(x), torch.from_numpy(indices), *geometry, transpose=transpose,
                            count=count_t, data_format=data_format)
    want = reference.sparse_gather(x, indices, *geometry, **kwargs)
    np.testing.assert_array_equal(got.numpy()[:len(want)], want)
    assert not got[len(want):].any()  # rows from the count on: zeros
    blocks = rng.standard_normal(got.shape)
    y = rng.standard_normal(x.shape)
    out = cpu.sparse_scatter(torch.from_numpy(blocks), torch.from_numpy(indices), torch.from_numpy(y), *geometry,
                             add=add, atomic=True, transpose=transpose, count=count_t, data_format=data_format)
    want = reference.sparse_scatter(blocks, indices, y, *geometry, add=add, atomic=True, **kwargs)
    np.testing.assert_allclose(out.numpy(), want, rtol=1e-12, atol=1e-12)


def test_inplace_scatter_writes_into_y_and_errors_match_the_kernels():
    y = torch.zeros(1, 4, 4, 2)
    blocks = torch.ones(1, 2, 2, 2)
    indices = torch.tensor([[0, 1, 1]], dtype=torch.int32)
    out = cpu.sparse_scatter(blocks, indices, y, 2, 2, inplace=True)
    assert out is y and y[0, 2:4, 2:4].eq(1).all() and y.sum() == 8
    with pytest.raises(ValueError, match="needs atomic=True"):
        cpu.sparse_scatter(torch.ones(1, 3, 3, 2), indices, y, 3, 2, add=True)
    with pytest.raises(TypeError, match="indices: expected int32"):
        cpu.sparse_gather(y, indices.long(), 2, 2)
    with pytest.raises(ValueError, match="blocks: expected shape"):
        cpu.sparse_scatter(torch.ones(2, 2, 2, 2), indices, y, 2, 2)
    with pytest.raises(TypeError, match="x: expected dtype in"):
        cpu.sparse_gather(y.bfloat16(), indices, 2, 2)
    with pytest.raises(ValueError, match="count: expected 0..1"):
        cpu.sparse_gather(y, indices, 2, 2, count=torch.tensor([2], dtype=torch.int32))


@pytest.mark.simulator  # (CPU tensors run the kernels only in the simulator)
@pytest.mark.parametrize("transpose", [False, True])
def test_the_cpu_path_and_the_kernels_agree_with_their_gradients(transpose):
    """The differentiable gather (overlapping windows, off the image) and scatter, forward and
    backward, on CPU tensors: torch's ops against the kernels in the simulator."""
    rng = np.random.default_rng(5)
    x0 = torch.from_numpy(rng.standard_normal((1, 6, 5, 3)))
    indices = torch.tensor([[0, 0, 0], [0, 1, 1], [0, 0, 1]], dtype=torch.int32)
    geometry = dict(bsize=3, bstride=2, boffset=-1)
    results = []
    for kernels in (False, True):
        previous = cpu.kernels_on_cpu(kernels)
        try:
            x = x0.clone().requires_grad_(True)
            blocks = sbt.sparse_gather(x, indices, transpose=transpose, **geometry)
            y = sbt.sparse_scatter(blocks * 2, indices, x * 3, add=True, atomic=True, transpose=transpose, **geometry)
            (y * torch.arange(y.numel(), dtype=y.dtype).reshape(y.shape)).sum().backward()
            results.append((blocks.detach(), y.detach(), x.grad))
        finally:
            cpu.kernels_on_cpu(previous)
    for got, want in zip(*results):
        torch.testing.assert_close(got, want)


@settings(max_examples=80)
@given(data=st.data())
def test_reduce_mask_matches_the_numpy_twin(data):
    """Windows past every edge, gaps between windows, NaN pixels, both pools, any bcount."""
    from sparseblocks.reference import sbnet as reference

    N, H, W = (data.draw(st.integers(1, n), label=name) for n, name in ((2, "N"), (9, "H"), (9, "W")))
    dtype = data.draw(st.sampled_from(["float32", "float16", "uint8", "bool", "float64"]), label="dtype")
    values = data.draw(st.lists(st.sampled_from([0.0, 0.0, 0.0, 1.0, 0.5, float("nan")]), min_size=N * H * W,
                                max_size=N * H * W), label="mask")
    mask = np.array(values).reshape(N, H, W)
    mask = np.nan_to_num(mask) if dtype in ("uint8", "bool") else mask
    mask = mask.astype(dtype)
    geometry = [data.draw(st.tuples(st.integers(lo, hi), st.integers(lo, hi)), label=name)
                for lo, hi, name in ((1, 4, "bsize"), (1, 4, "bstride"), (-3, 2, "boffset"))]
    bcount = data.draw(st.none() | st.tuples(st.integers(0, 4), st.integers(0, 4)), label="bcount")
    tol = data.draw(st.sampled_from([0.0, 0.2, -1.0]), label="tol")
    avgpool = data.draw(st.booleans(), label="avgpool")
    want = reference.reduce_mask(mask, *geometry, tol=tol, avgpool=avgpool, bcount=bcount)
    indices, count = cpu.reduce_mask(torch.from_numpy(mask), *geometry, tol=tol, avgpool=avgpool, bcount=bcount)
    n = int(count[0])
    assert indices.dtype == torch.int32 and count.dtype == torch.int32
    np.testing.assert_array_equal(indices[:n].numpy(), want)
    assert (indices[n:] == -1).all()


def test_reduce_mask_errors_match_the_kernels():
    mask = torch.zeros(1, 4, 4)
    for call, error, match in [
        (lambda: cpu.reduce_mask(mask[0], 2, 2), ValueError, r"mask: expected \[N, H, W\]"),
        (lambda: cpu.reduce_mask(mask.long(), 2, 2), TypeError, "mask: expected dtype in"),
        (lambda: cpu.reduce_mask(mask, 2, 2, tol="0"), TypeError, "tol: expected a number"),
        (lambda: cpu.reduce_mask(mask, 0, 2), ValueError, "bsize"),
        (lambda: cpu.reduce_mask(mask, 2, 2, bcount=(-1, 2)), ValueError, "bcount: expected non-negative"),
    ]:
        with pytest.raises(error, match=match):
            call()


@pytest.mark.simulator  # (CPU tensors run the kernels only in the simulator)
@pytest.mark.parametrize("layout", ["NHWC stack", "NCHW stack", "NCHW input"])
def test_sparse_res_block_on_the_cpu_path_trains_as_the_kernels(layout):
    """`SparseResBlock` on CPU tensors (torch's ops) against the same block on the kernels in the
    simulator: the active windows, the output, and the gradients of x and the convolutions; and
    in place, into x itself."""
    torch.manual_seed(2)
    block = sbt.SparseResBlock(channels=4, bottleneck=2, block_size=6, transpose=layout == "NCHW stack").double()
    x0 = torch.randn(1, 4, 9, 10, dtype=torch.float64)
    if layout != "NCHW input":
        x0 = x0.to(memory_format=torch.channels_last)
    mask = torch.zeros(1, 9, 10)
    mask[0, 2, 7] = mask[0, 8, 1] = 1
    results = []
    for kernels in (False, True):
        previous = cpu.kernels_on_cpu(kernels)
        try:
            indices, count = block.active_blocks(mask)
            block.zero_grad()
            x = x0.clone().requires_grad_(True)
            y = block(x, indices, count)
            (y * torch.arange(y.numel(), dtype=y.dtype).reshape(y.shape)).sum().backward()
            with torch.no_grad():
                into = x0.clone()
                assert block(into, indices, count, inplace=True).data_ptr() == into.data_ptr()
            grads = [conv.weight.grad.clone() for conv in (block.conv1, block.conv2, block.conv3)]
            results.append((indices[:int(count[0])], y.detach(), into, x.grad, *grads))
        finally:
            cpu.kernels_on_cpu(previous)
    assert 2 <= len(results[0][0]) < 9  # (of the 3 x 3 windows)
    for got, want in zip(*results):
        torch.testing.assert_close(got, want)
