"""Autograd of SBNet's gather and scatter, and the sparse ResNet block (needs torch)."""

from dataclasses import replace
import numpy as np
import pytest

torch = pytest.importorskip("torch")

import sparseblocks.torch as sbnet_torch  # noqa: E402
from sparseblocks import fused as fused_kernels  # noqa: E402
from sparseblocks import sbnet as sbnet_kernels  # noqa: E402
from sparseblocks.torch import bottleneck, graphs  # noqa: E402
from sparseblocks.runtime.backend import SIMULATOR  # noqa: E402
from sparseblocks.reference import sbnet as reference  # noqa: E402
from strategies import gpu_only_case  # noqa: E402

DEVICE = "cpu" if SIMULATOR else "cuda"
OVERLAPPING = {"bsize": (3, 3), "bstride": (2, 2), "boffset": (-1, 0)}
TILING = {"bsize": (2, 3), "bstride": (2, 3), "boffset": (0, -1)}


@pytest.fixture(autouse=True)
def one_warp_fused_tiles(configure):
    """In the simulator the fused kernels take one-warp tiles (its Python threads and mma
    rendezvous cost by the tile, and these blocks have a few channels); the GPU keeps the
    default tiles, which `tests/fused` checks in the simulator too."""
    if SIMULATOR:
        configure(fused_kernels, gather_tile=(32, 16, 16, 2, 1, None), nchw_gather_tile=(32, 16, 16, 2, 1, None),
                  scatter_tiles={"float16": (32, 64, 16, 2, 1, None), "float32": (32, 32, 16, 2, 1, None)},
                  nchw_scatter_tiles={"float16": (32, 64, 16, 2, 1, None), "float32": (32, 32, 16, 2, 1, None)})


# Tests of the differentiable gather and scatter themselves, and of the compiled block (the same
# ops traced): on CPU tensors they take the CPU path, which tests/torch/test_cpu_sbnet.py checks
# against the kernels, forward and backward.
CPU_PATH = ("gather_gradcheck", "scatter_gradcheck", "gather_then_scatter", "inplace_scatter", "compiled_",
            "custom_ops")


@pytest.fixture(autouse=True)
def kernel_path(request):
    """The block's tests check its kernels (the written-out backward, the fused kernels, graphs):
    in the simulator, CPU tensors run them too."""
    from sparseblocks.torch import cpu

    previous = cpu.kernels_on_cpu(not any(part in request.node.name for part in CPU_PATH))
    yield
    cpu.kernels_on_cpu(previous)


def tensor(array, requires_grad=False):
    return torch.tensor(np.asarray(array), device=DEVICE, requires_grad=requires_grad)


def indices_for(shape, g, every=1):
    count = reference.block_count(shape[1:3], g["bstride"], g["boffset"])
    grid = [(n, a, b) for n in range(shape[0]) for a in range(count[0]) for b in range(count[1])]
    return tensor(np.array(grid[::every], np.int32).reshape(-1, 3))


@pytest.mark.parametrize("transpose", [False, True])
def test_gather_gradcheck(transpose):
    x = torch.randn(1, 4, 5, 2, dtype=torch.float64, device=DEVICE, requires_grad=True)
    idx = indices_for(x.shape, OVERLAPPING, every=2)
    torch.autograd.gradcheck(
        lambda x: sbnet_torch.sparse_gather(x, idx, transpose=transpose, **OVERLAPPING), (x,), fast_mode=True)


@pytest.mark.parametrize("add", [False, True])
@pytest.mark.parametrize("data_format", ["NHWC", "NCHW"])
def test_scatter_gradcheck(add, data_format):
    shape = (1, 4, 5, 2) if data_format == "NHWC" else (1, 2, 4, 5)
    y = torch.randn(*shape, dtype=torch.float64, device=DEVICE, requires_grad=True)
    idx = indices_for((1, 4, 5, 2), TILING, every=2)
    block_shape = (len(idx), 2, 3, 2) if data_format == "NHWC" else (len(idx), 2, 2, 3)
    blocks = torch.randn(*block_shape, dtype=torch.float64, device=DEVICE, requires_grad=True)
    torch.autograd.gradcheck(
        lambda b, y: sbnet_torch.sparse_scatter(b, idx, y, add=add, data_format=data_format, **TILING),
        (blocks, y), fast_mode=True)


def test_gather_then_scatter_add_matches_the_dense_masked_computation():
    """scatter_add(2 · gather(x)) is x times twice the number of windows covering each pixel."""
    x = torch.randn(1, 5, 6, 3, dtype=torch.float64, device=DEVICE, requires_grad=True)
    idx = indices_for(x.shape, OVERLAPPING)
    sparse = sbnet_torch.sparse_scatter(2 * sbnet_torch.sparse_gather(x, idx, **OVERLAPPING), idx,
                                        torch.zeros_like(x), add=True, atomic=True, **OVERLAPPING)
    cover = reference.sparse_scatter(np.ones((len(idx), 3, 3, 1)), idx.cpu().numpy(), np.zeros((1, 5, 6, 1)),
                                     add=True, **OVERLAPPING)
    x_dense = x.detach().clone().requires_grad_(True)
    dense = 2 * tensor(cover) * x_dense
    torch.testing.assert_close(sparse, dense)
    weights = torch.randn_like(dense)
    (sparse * weights).sum().backward()
    (dense * weights).sum().backward()
    torch.testing.assert_close(x.grad, x_dense.grad)


def test_inplace_scatter_trains():
    x = torch.randn(1, 4, 6, 2, dtype=torch.float64, device=DEVICE, requires_grad=True)
    idx = indices_for(x.shape, TILING, every=2)
    blocks = torch.randn(len(idx), 2, 3, 2, dtype=torch.float64, device=DEVICE, requires_grad=True)
    y = x * 1.0
    out = sbnet_torch.sparse_scatter(blocks, idx, y, inplace=True, **TILING)
    assert out is y
    out.sum().backward()
    written = reference.sparse_scatter(np.ones((len(idx), 2, 3, 1)), idx.cpu().numpy(), np.zeros((1, 4, 6, 1)),
                                       **TILING)
    torch.testing.assert_close(x.grad, tensor(1 - written).expand_as(x).contiguous())  # stamped out
    # Block pixels that fall outside the image (column -1 here) are dropped: no gradient.
    inside = reference.sparse_gather(np.ones(x.shape), idx.cpu().numpy(), **TILING)
    torch.testing.assert_close(blocks.grad, tensor(inside))


def test_inplace_scatter_into_a_view_trains():
    """Written in place, a view of a tensor that needs a gradient hands its history to autograd's
    CopySlices: the base's gradient has the written windows stamped out, the blocks theirs."""
    x = torch.randn(2, 4, 6, 2, dtype=torch.float64, device=DEVICE, requires_grad=True)
    idx = indices_for((1, 4, 6, 2), TILING, every=2)
    blocks = torch.randn(len(idx), 2, 3, 2, dtype=torch.float64, device=DEVICE, requires_grad=True)
    base = x * 1.0
    out = sbnet_torch.sparse_scatter(blocks, idx, base[1:], inplace=True, **TILING)  # image 1 of 2
    assert out.data_ptr() == base[1:].data_ptr()
    base.sum().backward()
    written = reference.sparse_scatter(np.ones((len(idx), 2, 3, 1)), idx.cpu().numpy(), np.zeros((1, 4, 6, 1)),
                                       **TILING)
    want = torch.ones_like(x)
    want[1:] = tensor(1 - written).expand(1, 4, 6, 2)
    torch.testing.assert_close(x.grad, want)
    inside = reference.sparse_gather(np.ones((1, 4, 6, 2)), idx.cpu().numpy(), **TILING)
    torch.testing.assert_close(blocks.grad, tensor(inside))


@pytest.mark.parametrize("layout", ["NHWC stack", "NCHW stack (SBNet's fused transpose)", "NCHW input"])
def test_sparse_res_block_equals_the_dense_block_on_active_blocks(layout):
    torch.manual_seed(0)
    block = sbnet_torch.SparseResBlock(channels=4, bottleneck=2, block_size=6,
                                       transpose=layout.startswith("NCHW stack")).double().to(DEVICE)
    x = torch.randn(1, 4, 9, 10, dtype=torch.float64, device=DEVICE)
    if layout != "NCHW input":
        x = x.to(memory_format=torch.channels_last)
    mask = np.zeros((1, 9, 10), np.float32)
    mask[0, 2, 7] = 1
    indices, count = block.active_blocks(tensor(mask))
    y = block(x, indices, count)
    torch.testing.assert_close(block(x, indices), y)  # rows past the count are inert without it
    dense = block.dense(x)
    p = block.geometry(x.shape)
    indices = indices[:int(count[0])]
    active = reference.sparse_scatter(np.ones((len(indices), *p.bsize_out, 1)), indices.cpu().numpy(),
                                      np.zeros((1, 9, 10, 1)), p.bsize_out, p.bsize_out, 0)[..., 0] > 0
    active = torch.as_tensor(active, device=DEVICE)[:, None].expand_as(x)
    assert active.any() and not active.all()
    torch.testing.assert_close(y[active], dense[active])
    torch.testing.assert_close(y[~active], x[~active])
    y.sum().backward()  # gradients reach the convolutions
    assert block.conv2.weight.grad is not None
    with torch.no_grad():  # in place: into x itself, no copy of the input
        x_inplace = x.clone()
        out = block(x_inplace, indices, count, inplace=True)
    assert out.data_ptr() == x_inplace.data_ptr()
    torch.testing.assert_close(x_inplace, y.detach())
    with pytest.raises(ValueError, match="channels_last"):
        block(x[..., ::2], indices, count, inplace=True)


@pytest.mark.parametrize("case, error, match", [
    ("3-D x", ValueError, r"x: expected \[N, C, H, W\]"),
    ("channels", ValueError, "x: expected 4 channels"),
    ("dtype", TypeError, "x: expected the block's dtype torch.float64"),
    ("numpy x", TypeError, "x: expected a torch tensor"),
    ("2-D mask", ValueError, r"mask: expected \[N, H, W\]"),
    ("block_size 2", ValueError, "block_size: expected at least 3"),
    ("block_size (6, 0)", ValueError, "block_size: expected at least 3"),
    ("block_size 6.0", TypeError, "block_size: expected an int or a pair"),
    pytest.param("device", ValueError, "x: expected the block's device cuda",
                 marks=pytest.mark.skipif(SIMULATOR, reason="the block on a GPU, x on the CPU")),
])
def test_sparse_res_block_refuses_bad_input_before_any_launch(case, error, match, monkeypatch):
    block, x, indices, count, _ = three_windows()
    launched = []
    for module, name in ((sbnet_kernels, "sparse_gather"), (sbnet_kernels, "sparse_scatter"),
                         (sbnet_kernels, "reduce_mask"), (fused_kernels, "sparse_gather_matmul"),
                         (fused_kernels, "sparse_matmul_scatter")):
        monkeypatch.setattr(module, name, lambda *a, **k: launched.append(a))
    calls = {
        "3-D x": lambda: block(x[0], indices, count),
        "channels": lambda: block(x[:, :3], indices, count),
        "dtype": lambda: block(x.float(), indices, count),
        "numpy x": lambda: block(x.cpu().numpy(), indices, count),
        "2-D mask": lambda: block.active_blocks(torch.zeros(9, 10, device=DEVICE)),
        "block_size 2": lambda: sbnet_torch.SparseResBlock(4, 2, block_size=2),
        "block_size (6, 0)": lambda: sbnet_torch.SparseResBlock(4, 2, block_size=(6, 0)),
        "block_size 6.0": lambda: sbnet_torch.SparseResBlock(4, 2, block_size=6.0),
        "device": lambda: block(x.cpu(), indices.cpu(), count.cpu()),
    }
    with pytest.raises(error, match=match):
        calls[case]()
    assert not launched


class OwnResidual(sbnet_torch.SparseResBlock):
    """The same residual written anew through the modules, as a researcher changing the block
    would: the block falls back to autograd's backward of it."""

    def residual(self, x):
        return self.conv3(torch.relu(self.conv2(torch.relu(self.conv1(x)))))

    def residual_nhwc(self, stack):
        return self.residual(stack.permute(0, 3, 1, 2)).permute(0, 2, 3, 1)


def three_windows(dtype=torch.float64, channels_last=True):
    """A 4-channel 9 x 10 input, a block of windows of 6 and the indices of three neighbouring
    windows (halos overlapping), with the pixels those windows change."""
    block = sbnet_torch.SparseResBlock(channels=4, bottleneck=2, block_size=6).double().to(DEVICE)
    x = torch.randn(1, 4, 9, 10, dtype=torch.float64, device=DEVICE)
    x = x.to(memory_format=torch.channels_last) if channels_last else x
    mask = np.zeros((1, 9, 10), np.float32)
    mask[0, 2:4, 2:8] = 1
    indices, count = block.active_blocks(tensor(mask))
    assert len(indices) >= 2
    p = block.geometry(x.shape)
    active = reference.sparse_scatter(np.ones((len(indices), *p.bsize_out, 1)), indices.cpu().numpy(),
                                      np.zeros((1, 9, 10, 1)), p.bsize_out, p.bsize_out, 0)[..., 0] > 0
    active = torch.as_tensor(active, device=DEVICE)[:, None].expand_as(x)
    assert active.any() and not active.all()
    return block, x, indices, count, active


@pytest.mark.parametrize("dtype, inplace, layout", [
    (torch.float64, False, "NHWC stack"), (torch.float64, True, "NHWC stack"), (torch.float16, False, "NHWC stack"),
    (torch.float64, False, "NCHW stack"), (torch.float16, True, "NCHW stack"), (torch.float64, True, "NCHW input"),
    (torch.float16, False, "NCHW input"), (torch.float16, True, "NCHW input"),
    (torch.float64, False, "a subclass's residual"), (torch.float64, True, "a subclass's residual, NCHW stack")])
def test_sparse_res_block_trains_as_the_dense_block_on_active_blocks(dtype, inplace, layout):
    """The block's gradients (input and weights) equal those of ``where(active, dense(x), x)``,
    in place too (into an intermediate tensor), on either stack and from either input layout,
    through the written-out backward or (a subclass's residual) autograd's; its windows overlap
    by their halo, so the input gradient adds them atomically (fp16 too)."""
    torch.manual_seed(1)
    block, x, indices, count, active = three_windows(channels_last=layout != "NCHW input")
    weights = torch.randn_like(x)

    def gradients(model, x, forward):
        model.zero_grad()
        x = x.detach().clone().requires_grad_(True)
        (forward(model, x).double() * weights).sum().backward()
        return [x.grad] + [conv.weight.grad for conv in (model.conv1, model.conv2, model.conv3)]

    want = gradients(block, x, lambda m, x: torch.where(active, m.dense(x), x))
    kind = OwnResidual if layout.startswith("a subclass") else sbnet_torch.SparseResBlock
    sparse = kind(4, 2, block_size=6, transpose=layout.endswith("NCHW stack")).to(DEVICE, dtype)
    sparse.load_state_dict(block.state_dict())
    got = gradients(sparse, x.to(dtype), lambda m, x: m(x * 1 if inplace else x, indices, count, inplace=inplace))
    tolerance = {} if dtype == torch.float64 else {"rtol": 2e-2, "atol": 2e-2}
    for name, g, w in zip(("x", "conv1", "conv2", "conv3"), got, want):
        assert g.dtype == dtype, name
        torch.testing.assert_close(g.double(), w, **tolerance, msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.parametrize("kind, transpose", [(sbnet_torch.SparseResBlock, False), (OwnResidual, False),
                                             (sbnet_torch.SparseResBlock, True), gpu_only_case(OwnResidual, True)])
def test_sparse_res_block_computes_only_the_gradients_asked_for(kind, transpose):
    """Frozen weights get no gradient and the input's is still right; an input that needs none
    gets none while the weights get theirs; a second backward through one forward
    (``retain_graph``) gives the same gradients again; a weight changed in place between the
    forward and the backward makes the backward raise, as torch's own nodes do."""
    torch.manual_seed(3)
    block, x, indices, count, active = three_windows()
    sparse = kind(4, 2, block_size=6, transpose=transpose).double().to(DEVICE)
    sparse.load_state_dict(block.state_dict())
    x = x.requires_grad_(True)
    torch.where(active, block.dense(x), x).sum().backward()
    want = [t.grad.clone() for t in (x, block.conv1.weight, block.conv2.weight, block.conv3.weight)]

    x.grad = None
    sparse.conv2.weight.requires_grad_(False)
    sparse(x, indices, count).sum().backward()
    torch.testing.assert_close(x.grad, want[0])
    assert sparse.conv2.weight.grad is None
    torch.testing.assert_close(sparse.conv3.weight.grad, want[3])

    sparse.zero_grad(set_to_none=True)
    sparse.conv2.weight.requires_grad_(True)
    sparse(x.detach(), indices, count).sum().backward()
    for conv, w in zip((sparse.conv1, sparse.conv2, sparse.conv3), want[1:]):
        torch.testing.assert_close(conv.weight.grad, w)

    x.grad = None
    y = sparse(x, indices, count)
    y.sum().backward(retain_graph=True)
    y.sum().backward()  # (a second backward through the same forward adds the same again)
    torch.testing.assert_close(x.grad, 2 * want[0])

    y = sparse(x, indices, count)
    with torch.no_grad():
        sparse.conv3.weight.mul_(2)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()


def graphed_pair(transpose, seed, dtype=torch.float64):
    """A block without graphs and one with (the same weights, float64 unless ``dtype``), a
    channels_last 2 x 8 x 20 x 22 input and the indices of all its windows, row-major."""
    torch.manual_seed(seed)
    eager = sbnet_torch.SparseResBlock(8, 4, block_size=6, transpose=transpose).to(DEVICE, dtype)
    graphed = sbnet_torch.SparseResBlock(8, 4, block_size=6, transpose=transpose, graphs=True)
    graphed = graphed.to(DEVICE, dtype)
    graphed.load_state_dict(eager.state_dict())
    x = torch.randn(2, 8, 20, 22, dtype=dtype, device=DEVICE).to(memory_format=torch.channels_last)
    every = tensor(np.argwhere(np.ones((2, *eager.geometry(x.shape).bcount))).astype(np.int32))
    return eager, graphed, x, every


@pytest.mark.parametrize("transpose", [False, gpu_only_case(True)])  # (graphs with transpose: the training test)
def test_sparse_res_block_graphs_give_the_eager_output(transpose):
    """``graphs=True`` (on a GPU; elsewhere the kernels run as without): window counts within
    one capacity and across it (new graphs, a buffer grown and its graphs captured anew, then a
    count below those of earlier calls, whose rows linger in the buffer), calls repeated (the
    kept launches, with and without a count), in place, a weight
    changed in place (the graphs read it), a weight replaced (graphs anew, the old dropped), a
    deep copy, and inside a caller's CUDA graph capture (the block launches its kernels)."""
    import copy

    eager, graphed, x, every = graphed_pair(transpose, seed=5)
    assert len(every) >= 60
    rng = np.random.default_rng(5)

    def compare(n=None, inplace=False, model=graphed, indices=None, count=None):
        if indices is None:
            chosen = tensor(np.sort(rng.choice(len(every), n, replace=False)))
            indices = every[chosen.long()].contiguous()
        with torch.no_grad():
            want = eager(x, indices, count)
            got = model(x.clone() if inplace else x, indices, count, inplace=inplace)
        torch.testing.assert_close(got, want)

    compare(7, inplace=True)
    compare(6, model=copy.deepcopy(graphed))
    if SIMULATOR:
        return  # (no graphs there: the rest is the GPU's)
    for n in (3, 5, 9, 20, 60, 2):
        compare(n)
    # A call's signature seen again launches the kept launches directly: in place or not, with
    # a count (below the indices' rows) or without, indices that are another tensor each time.
    indices = every[:9].contiguous()
    for _ in range(3):
        for inplace in (False, True):
            compare(indices=indices.clone(), inplace=inplace)
            compare(indices=indices, count=tensor(np.array([5], np.int32)), inplace=inplace)
    assert len(graphed._graphs._sets[next(iter(graphed._graphs._sets))][0].launches) >= 4
    assert [s.rows for v in graphed._graphs._sets.values() for s in v] == [64]  # 8 -> 16 -> 32 -> 64 rows
    with torch.no_grad():
        for block in (eager, graphed):
            block.conv2.weight.mul_(0.5)
    compare(4)
    graphed.conv1.weight = torch.nn.Parameter(graphed.conv1.weight.detach().clone())
    compare(4)
    (slots,) = graphed._graphs._sets.values()
    assert len(slots) == 1 and len(slots[0].forwards) == 1
    indices = every[:12].contiguous()
    with torch.no_grad():
        want = eager(x, indices)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            graphed(x, indices)  # (warm: kept launch plans and streams, outside the capture)
        torch.cuda.current_stream().wait_stream(side)
        caller = torch.cuda.CUDAGraph()
        with torch.cuda.graph(caller):
            got = graphed(x, indices)
    caller.replay()
    torch.testing.assert_close(got, want)


@pytest.mark.parametrize("nchw_stack, flipped", [(False, False), (True, False), (True, True)])
def test_residual_writes_into_buffers_what_it_returns_without(nchw_stack, flipped):
    """The written-out residual and its backward with ``into`` (the buffers a CUDA graph of them
    writes, `_Slot`) give what they give without, in those buffers (as the block calls them:
    without autograd); ``flipped``: the NCHW stack's forward with its output NHWC."""
    torch.manual_seed(7)
    with torch.no_grad():
        residual = graphs._WRITTEN_OUT[nchw_stack]
        block = sbnet_torch.SparseResBlock(8, 4, block_size=6).double().to(DEVICE)
        weights = block.weights()
        stack = torch.randn(3, 8, 6, 6, dtype=torch.float64, device=DEVICE)
        stack = stack if nchw_stack else stack.permute(0, 2, 3, 1).contiguous()
        out, saved = residual.forward(stack, weights, flipped=flipped)
        into = tuple(torch.full_like(t, float("nan")) for t in (saved[1], saved[2], out.contiguous()))
        got, got_saved = residual.forward(stack, weights, into=into, flipped=flipped)
        assert got is into[2] and got_saved[1] is into[0] and got_saved[2] is into[1]
        for g, w in zip((got, *got_saved[1:]), (out, *saved[1:])):
            torch.testing.assert_close(g, w)
        grad_out = torch.randn_like(out)
        needs = (True, True, False, True)
        want = residual.backward(saved, weights, grad_out, needs, flipped=flipped)
        into = torch.full_like(stack.permute(0, 2, 3, 1).contiguous() if flipped else stack, float("nan"))
        got = residual.backward(got_saved, weights, grad_out, needs, into=into, flipped=flipped)
        assert got[0] is into and got[2] is None
        for g, w in zip(got[:2] + got[3:], want[:2] + want[3:]):
            torch.testing.assert_close(g, w)


@pytest.mark.parametrize("windows", [3, 0])
def test_nchw_residual_is_the_convolutions(windows):
    """The NCHW stack's written-out residual (batched products reading the stack transposed, the
    3x3 on an NHWC intermediate) gives the three convolutions and their gradients, each set of
    gradients asked for alone, with the gradients in the stack's layout or NHWC (``flipped``),
    and nothing for no windows."""
    torch.manual_seed(11)
    block = sbnet_torch.SparseResBlock(8, 4, block_size=6).double().to(DEVICE)
    weights = [w.detach().requires_grad_(True) for w in block.weights()]
    stack = torch.randn(windows, 8, 6, 6, dtype=torch.float64, device=DEVICE, requires_grad=True)
    h = torch.relu(torch.nn.functional.conv2d(stack, weights[0]))
    want = torch.nn.functional.conv2d(torch.relu(torch.nn.functional.conv2d(h, weights[1])), weights[2])
    residual = graphs._WRITTEN_OUT[True]
    with torch.no_grad():
        out, saved = residual.forward(stack, weights)
        flipped_out, flipped_saved = residual.forward(stack, weights, flipped=True)
    torch.testing.assert_close(out, want)
    assert out.is_contiguous()
    # flipped: the output NHWC (the image's layout where the stack came through the transpose)
    torch.testing.assert_close(flipped_out, want.permute(0, 2, 3, 1))
    assert flipped_out.is_contiguous()
    for f, s in zip(flipped_saved, saved):
        torch.testing.assert_close(f, s)
    grad_out = torch.randn_like(want)
    every = torch.autograd.grad(want, (stack, *weights), grad_out)
    nhwc = (lambda t: t.permute(0, 2, 3, 1).contiguous(), lambda t: t.permute(0, 3, 1, 2))
    for flipped, (there, back) in ((False, (lambda t: t, lambda t: t)), (True, nhwc)):
        # flipped: the output's and the stack's gradients NHWC (a stack gathered through the transpose)
        for asked in range(4):
            needs = tuple(i == asked for i in range(4))
            with torch.no_grad():
                got = residual.backward(saved, weights, there(grad_out), needs, flipped=flipped)
            for i, (g, w) in enumerate(zip(got, every)):
                if i == asked:
                    torch.testing.assert_close(back(g) if i == 0 else g, w)
                else:
                    assert g is None


@pytest.mark.parametrize("transpose, graphs", [(False, False), (True, False), (False, True),
                                               gpu_only_case(True, True)])
def test_rows_past_the_count_add_nothing_to_the_gradients(transpose, graphs, poisoned):
    """Indices with more rows than the count (reduce_mask's whole buffer on the device, say): the
    block trains as on the count's rows alone. The convolutions run on every row and the
    weights' gradients sum over them, so the gather must give zeros past the count (outputs
    poisoned here: rows it left unwritten would be NaN)."""
    torch.manual_seed(2)
    block = sbnet_torch.SparseResBlock(8, 4, block_size=6, transpose=transpose, graphs=graphs)
    block = block.to(DEVICE, torch.float64)
    x = torch.randn(1, 8, 12, 14, dtype=torch.float64, device=DEVICE).to(memory_format=torch.channels_last)
    every = tensor(np.argwhere(np.ones((1, *block.geometry(x.shape).bcount))).astype(np.int32))
    indices, count = every[:6].contiguous(), tensor(np.array([4], np.int32))

    def gradients(indices, count):
        block.zero_grad(set_to_none=True)
        xg = x.detach().clone().requires_grad_(True)
        block(xg, indices, count).backward(torch.ones_like(x))
        return [xg.grad] + [w.grad for w in block.weights()]

    want = gradients(every[:4].contiguous(), None)
    for _ in range(2):  # (graphs: the second call replays kept launches)
        for g, w in zip(gradients(indices, count), want):
            torch.testing.assert_close(g, w)


@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_residual_into_buffers_gives_the_residual(dtype):
    """The NHWC residual written into given buffers (a graph's) gives what it gives into new
    tensors; differentiated (a caller's own `residual_nhwc`), the gradients flow."""
    torch.manual_seed(3)
    dtype = getattr(torch, dtype)
    residual = graphs._WRITTEN_OUT[False]
    block = sbnet_torch.SparseResBlock(16, 8, block_size=6).to(DEVICE, dtype)
    weights = block.weights()
    stack = torch.randn(5, 6, 6, 16, dtype=dtype, device=DEVICE)
    with torch.no_grad():
        apart, apart_saved = residual.forward(stack, weights)
        into = tuple(torch.full_like(t, float("nan")) for t in (apart_saved[1], apart_saved[2], apart.contiguous()))
        written, written_saved = residual.forward(stack, weights, into=into)
    for g, w in zip((written, *written_saved[1:]), (apart, *apart_saved[1:])):
        torch.testing.assert_close(g, w)
    stack.requires_grad_(True)
    block.residual_nhwc(stack).float().sum().backward()
    assert stack.grad is not None and all(w.grad is not None for w in weights)


def test_weights_are_the_convolutions():
    """`weights()` gives the convolutions' registered parameters (read directly, for the host's
    time), and through the modules' own lookup a weight that is not one (a parametrization)."""
    block = sbnet_torch.SparseResBlock(channels=8, bottleneck=4, block_size=6)
    assert all(w is c.weight for w, c in zip(block.weights(), (block.conv1, block.conv2, block.conv3)))
    torch.nn.utils.parametrize.register_parametrization(block.conv2, "weight", Doubled())
    w2 = block.weights()[1]
    torch.testing.assert_close(w2, 2 * block.conv2.parametrizations.weight.original)
    assert w2.requires_grad


class Doubled(torch.nn.Module):
    def forward(self, w):
        return 2 * w


def fusion_case(dtype, bottleneck, seed, flag, kernel, monkeypatch, transpose=False, nchw=False):
    """(block, x, indices, count, the output with sbnet_torch.`flag` off, calls): a small block
    (8 channels, windows of 6; ``transpose``: SBNet's NCHW stack) and some of its windows of a
    channels_last input (``nchw``: a contiguous one); `flag` is on afterwards, and `calls` grows
    by one at each call of fused_kernels.`kernel`."""
    torch.manual_seed(seed)
    block = sbnet_torch.SparseResBlock(channels=8, bottleneck=bottleneck, block_size=6, transpose=transpose).to(
        DEVICE, dtype)
    x = torch.randn(1, 8, 9, 10, dtype=dtype, device=DEVICE)
    if not nchw:
        x = x.to(memory_format=torch.channels_last)
    mask = np.zeros((1, 9, 10), np.float32)
    mask[0, 2:4, 2:8] = 1
    indices, count = block.active_blocks(tensor(mask))
    with torch.no_grad():
        monkeypatch.setattr(sbnet_torch.config, "DEFAULT", replace(sbnet_torch.config.DEFAULT, **{flag.lower(): False}))
        apart = block(x, indices, count)
    calls = []
    fused_call = getattr(fused_kernels, kernel)
    monkeypatch.setattr(fused_kernels, kernel,
                        lambda *args, **kwargs: calls.append(1) or fused_call(*args, **kwargs))
    monkeypatch.setattr(sbnet_torch.config, "DEFAULT", replace(sbnet_torch.config.DEFAULT, **{flag.lower(): True}))
    return block, x, indices, count, apart, calls


def as_apart(block, x, indices, count, apart, dtype):
    """The block's output without gradients, into a copy and in place, is `apart` (the two calls'),
    to the fused kernel's rounding; returns that tolerance."""
    tolerance = {"atol": 1e-2, "rtol": 1e-2} if dtype == torch.float16 else {"atol": 1e-5, "rtol": 1e-5}
    with torch.no_grad():
        torch.testing.assert_close(block(x, indices, count), apart, **tolerance)
        torch.testing.assert_close(block(x.clone(), indices, count, inplace=True), apart, **tolerance)
    return tolerance


@pytest.mark.parametrize("dtype", [gpu_only_case(torch.float32), torch.float16])
def test_fused_gather_gives_the_gather_and_product_apart(configure, dtype, monkeypatch):
    """Calls without gradients on an NHWC stack of FUSED_GATHER_MIN_PIXELS pixels or more gather
    the windows straight into the first product (`kernels.gather_matmul`): the block's output is
    the one of the gather and the product apart, in place and through CUDA graphs too; with
    gradients, or past the fused kernel's limits (fp64), the two calls stay."""
    block, x, indices, count, apart, calls = fusion_case(dtype, 4, 4, "FUSED_GATHER", "sparse_gather_matmul",
                                                         monkeypatch)
    configure(sbnet_torch, fused_gather_min_pixels=0)
    tolerance = as_apart(block, x, indices, count, apart, dtype)
    assert len(calls) == 2
    if DEVICE == "cuda":
        graphed = sbnet_torch.SparseResBlock(8, 4, block_size=6, graphs=True).to(DEVICE, dtype)
        graphed.load_state_dict(block.state_dict())
        with torch.no_grad():
            for _ in range(2):  # the first calls keep their launches, the second ones replay them
                torch.testing.assert_close(graphed(x, indices, count), apart, **tolerance)
                torch.testing.assert_close(graphed(x.clone(), indices, count, inplace=True), apart, **tolerance)
        assert len(calls) == 4  # (the replays launch the fused kernel's kept launch directly)
    calls.clear()
    block(x.clone().requires_grad_(True), indices, count).float().sum().backward()  # training: the stack is kept
    if DEVICE == "cuda":  # a training call of a signature the graphs fused without gradients: not fused
        graphed(x.clone().requires_grad_(True), indices, count).float().sum().backward()
        for mine, theirs in zip(graphed.weights(), block.weights()):
            torch.testing.assert_close(mine.grad, theirs.grad, **tolerance)
    with torch.no_grad():
        block.double()(x.detach().double(), indices, count)
    assert not calls


@pytest.mark.parametrize("dtype, transpose, nchw", [(torch.float16, False, True),
                                                    gpu_only_case(torch.float16, True, False)])
def test_fused_gather_takes_the_nchw_stacks(configure, dtype, transpose, nchw, monkeypatch):
    """The NCHW stack's blocks take the fused gather and product too (their first ReLU's output is
    NHWC as the NHWC stack's): an fp16 NCHW input by the kernel's NCHW tile, a channels_last
    input with ``transpose`` by its NHWC one (fp32 takes the same route); the output is the one of
    the gather and the product apart, into a copy and in place."""
    block, x, indices, count, apart, calls = fusion_case(dtype, 4, 7, "FUSED_GATHER", "sparse_gather_matmul",
                                                         monkeypatch, transpose=transpose, nchw=nchw)
    configure(sbnet_torch, fused_gather_min_pixels=0)
    as_apart(block, x, indices, count, apart, dtype)
    assert len(calls) == 2
    configure(sbnet_torch, fused_gather_layouts={("NHWC", False)})  # the layouts' switch
    with torch.no_grad():
        block(x, indices, count)
    assert len(calls) == 2


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_sparse_res_block_keeps_a_nan_where_the_dense_block_does(configure, dtype, monkeypatch):
    """A NaN in an active window (a diverging model's) comes out of the block as out of the dense
    one: on the 3x3 around its pixel at least (past both ReLUs, the fused gather's and scatter's
    included; a Winograd 3x3 may spread it over its whole tile), never off the active windows,
    where the output is the input. (The fused kernel's ReLU once made it 0 on a GPU.)"""
    torch.manual_seed(6)
    block = sbnet_torch.SparseResBlock(channels=8, bottleneck=4, block_size=6).to(DEVICE, dtype)
    x = torch.randn(1, 8, 9, 10, dtype=dtype, device=DEVICE).to(memory_format=torch.channels_last)
    x[0, 3, 4, 5] = float("nan")
    mask = np.zeros((1, 9, 10), np.float32)
    mask[0, 2:6, 2:8] = 1
    indices, count = block.active_blocks(tensor(mask))
    p = block.geometry(x.shape)
    rows = indices[:int(count[0])].cpu().numpy()
    active = reference.sparse_scatter(np.ones((len(rows), *p.bsize_out, 1)), rows, np.zeros((1, 9, 10, 1)),
                                      p.bsize_out, p.bsize_out, 0)[..., 0] > 0
    active = torch.as_tensor(active, device=DEVICE)[:, None].expand_as(x)
    around = torch.zeros_like(active)
    around[0, :, 3:6, 4:7] = True
    assert active[around].all()
    with torch.no_grad():
        assert torch.isnan(block.dense(x)[around]).all()
    # The fused kernels, and cuBLAS's products (whose ReLU epilogue drops NaNs); the CPU has torch's alone.
    for fused in (True, False) if DEVICE == "cuda" else (False,):
        configure(sbnet_torch, fused_gather_min_pixels=0 if fused else 2**40)
        configure(sbnet_torch, fused_scatter_min_pixels={} if fused else {("NHWC", str(dtype).replace("torch.", "")): 2**40})
        configure(sbnet_torch, fused_when_host_bound=fused)
        for inplace, grad in ((False, False), (True, False), (False, True)):
            with torch.set_grad_enabled(grad):
                y = block(x.clone().requires_grad_(grad), indices, count, inplace=inplace)
            assert torch.isnan(y[around]).all() and not torch.isnan(y[~active]).any(), torch.isnan(y).nonzero()
            torch.testing.assert_close(y[~active], x[~active])


@pytest.mark.parametrize("dtype, nchw", [gpu_only_case(torch.float32, False), (torch.float16, False),
                                         gpu_only_case(torch.float16, True), gpu_only_case(torch.float32, True)])
def test_fused_scatter_gives_the_product_and_scatter_apart(configure, dtype, nchw, monkeypatch):
    """In-place calls without gradients whose output is NHWC (of FUSED_SCATTER_MIN_PIXELS output
    pixels or more) add the last product straight into the image (`sparse_matmul_scatter`; ``nchw``:
    an NCHW input, through the transpose, its fp32 output NHWC for it alone): the same output as
    the product and the scatter apart, with the fused gather or without, and through CUDA graphs
    and their kept launches; calls into a copy, training, products wider than
    FUSED_SCATTER_MAX_IN and fp64 keep the two calls."""
    block, x, indices, count, apart, calls = fusion_case(dtype, 8, 5, "FUSED_SCATTER", "sparse_matmul_scatter",
                                                         monkeypatch, nchw=nchw)
    configure(sbnet_torch, fused_scatter_min_pixels={})
    tolerance = {"atol": 1e-2, "rtol": 1e-2} if dtype == torch.float16 else {"atol": 1e-5, "rtol": 1e-5}
    with torch.no_grad():
        torch.testing.assert_close(block(x, indices, count), apart, **tolerance)
        assert not calls  # (into a copy: apart)
        for gather in (False, True):
            configure(sbnet_torch, fused_gather=gather)
            configure(sbnet_torch, fused_gather_min_pixels=0)
            image = x.clone()
            assert block(image, indices, count, inplace=True).data_ptr() == image.data_ptr()
            torch.testing.assert_close(image, apart, **tolerance)
    assert len(calls) == 2
    if DEVICE == "cuda":
        graphed = sbnet_torch.SparseResBlock(8, 8, block_size=6, graphs=True).to(DEVICE, dtype)
        graphed.load_state_dict(block.state_dict())
        with torch.no_grad():
            for gather in (False, True):
                configure(sbnet_torch, fused_gather=gather)
                for _ in range(2):  # the first calls keep their launches, the second ones replay them
                    image = x.clone()
                    graphed(image, indices, count, inplace=True)
                    torch.testing.assert_close(image, apart, **tolerance)
                    torch.testing.assert_close(graphed(x, indices, count), apart, **tolerance)
        assert len(calls) == 4  # (the replays launch the fused kernel's kept launch directly)
    calls.clear()
    block(x.clone().requires_grad_(True), indices, count).float().sum().backward()
    configure(sbnet_torch, fused_scatter_max_in=4)  # (a product wider than the limit)
    with torch.no_grad():
        block(x.clone(), indices, count, inplace=True)
    configure(sbnet_torch, fused_scatter_max_in=64)
    with torch.no_grad():
        block.double()(x.detach().double(), indices, count, inplace=True)
    assert not calls


@pytest.mark.gpu
@pytest.mark.skipif(SIMULATOR, reason="CUDA graphs need a GPU")
def test_host_bound_calls_fuse_at_any_size(configure, monkeypatch):
    """Eager calls without gradients (CUDA tensors, no capture: the host bounds them) take the
    fused gather and product and the fused product and scatter however few the windows' pixels;
    under a caller's graph capture the pixel thresholds decide, as they do with
    FUSED_WHEN_HOST_BOUND off."""
    block, x, indices, count, apart, scatters = fusion_case(torch.float16, 8, 5, "FUSED_SCATTER",
                                                            "sparse_matmul_scatter", monkeypatch)
    gathers = []
    fused_gather = fused_kernels.sparse_gather_matmul
    monkeypatch.setattr(fused_kernels, "sparse_gather_matmul",
                        lambda *args, **kwargs: gathers.append(1) or fused_gather(*args, **kwargs))
    configure(sbnet_torch, fused_gather_min_pixels=2**40)
    configure(sbnet_torch, fused_scatter_min_pixels={("NHWC", "float16"): 2**40})
    tolerance = {"atol": 1e-2, "rtol": 1e-2}
    with torch.no_grad():
        image = x.clone()
        block(image, indices, count, inplace=True)
        assert (len(gathers), len(scatters)) == (1, 1)
        torch.testing.assert_close(image, apart, **tolerance)
        configure(sbnet_torch, fused_when_host_bound=False)
        block(x.clone(), indices, count, inplace=True)  # (also the capture's warm-up: its kernels, outside it)
        assert (len(gathers), len(scatters)) == (1, 1)
        configure(sbnet_torch, fused_when_host_bound=True)
        image = x.clone()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            block(image, indices, count, inplace=True)
        assert (len(gathers), len(scatters)) == (1, 1)
        graph.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(image, apart, **tolerance)


@pytest.mark.parametrize("transpose", [False, True])
def test_sparse_res_block_graphs_train_as_without(transpose):
    """``graphs=True`` training calls (on a GPU: the residual and its backward replayed from
    CUDA graphs) give the eager gradients: window counts within and across capacities (a slot
    grown), a count below earlier calls' with NaN left in the slot's buffers past it, in place,
    frozen weights, weights stepped in place between calls, calls repeated (the kept
    launches of the forward and of the backward), two forwards before their backwards, and more
    held than MAX_SLOTS (the rest run without graphs); a second backward
    through one forward works while its slot is unused and raises once a later call took it."""
    eager, graphed, x, every = graphed_pair(transpose, seed=8)
    rng = np.random.default_rng(8)

    def windows(n):
        return every[tensor(np.sort(rng.choice(len(every), n, replace=False))).long()].contiguous()

    def forward(model, indices, inplace=False, count=None):
        xg = x.detach().clone().requires_grad_(True)
        return xg, model(xg * 1 if inplace else xg, indices, count, inplace=inplace)

    def gradients(model, indices, inplace=False, weights=None, count=None):
        model.zero_grad(set_to_none=True)
        xg, y = forward(model, indices, inplace, count)
        y.backward(weights if weights is not None else torch.ones_like(y))
        return [xg.grad] + [w.grad for w in model.weights()]

    def compare(n=None, indices=None, **kwargs):
        indices = windows(n) if indices is None else indices
        for g, w in zip(gradients(graphed, indices, **kwargs), gradients(eager, indices, **kwargs)):
            torch.testing.assert_close(g, w)

    compare(3, inplace=True)
    if SIMULATOR:
        return  # (no graphs there, and the simulator's kernels are slow: the rest is the GPU's)
    for n in (5, 20, 60):
        compare(n)
    slots = graphed._graphs._sets
    assert [s.rows for v in slots.values() for s in v] == [64]  # 8 -> 16 (20 windows) -> 64
    for slot in (s for v in slots.values() for s in v):
        for buffer in (slot.stack, slot.h1, slot.h2, slot.out, slot.grad_out, slot.grad_stack):
            buffer.fill_(float("nan"))
    compare(3)
    for model in (eager, graphed):
        model.conv2.weight.requires_grad_(False)
    compare(9)
    for model in (eager, graphed):
        model.conv2.weight.requires_grad_(True)
        with torch.no_grad():
            model.conv1.weight.mul_(0.5)  # (an optimizer's step: the graphs read the weights)
    compare(9)
    # A training call's signature seen again launches the kept gathers and scatters of its
    # forward and of its backward directly: in place or not, with a count below the rows or
    # without, other output gradients each time.
    indices = windows(11)
    for _ in range(3):
        for inplace in (False, True):
            for count in (None, tensor(np.array([7], np.int32))):
                compare(indices=indices.clone(), inplace=inplace, count=count,
                        weights=torch.randn_like(x).to(memory_format=torch.channels_last))
    kinds = [key[1] for slot in (s for v in slots.values() for s in v) for key in slot.launches]
    assert kinds.count(False) >= 4 and kinds.count(True) >= 2  # forwards' pairs, backwards' pairs

    # Two forwards, then their backwards in turn; six held at once (MAX_SLOTS 4).
    for held in (2, 6):
        sets = [windows(n) for n in rng.integers(2, 30, held)]
        for model in (eager, graphed):
            model.zero_grad(set_to_none=True)
        calls = {m: [forward(m, i) for i in sets] for m in (eager, graphed)}
        for m in (eager, graphed):
            for _, y in reversed(calls[m]):
                y.sum().backward()
        for (xe, _), (xg, _) in zip(calls[eager], calls[graphed]):
            torch.testing.assert_close(xg.grad, xe.grad)
        for we, wg in zip(eager.weights(), graphed.weights()):
            torch.testing.assert_close(wg.grad, we.grad)
        del calls
    assert len(next(iter(slots.values()))) == graphs._ResidualGraphs.MAX_SLOTS

    indices = windows(10)
    xg, y = forward(graphed, indices)
    y.sum().backward(retain_graph=True)
    once = xg.grad.clone()
    y.sum().backward(retain_graph=True)
    torch.testing.assert_close(xg.grad, 2 * once)
    compare(indices=indices)  # (takes the slot the first forward held)
    with pytest.raises(RuntimeError, match="a later call has overwritten"):
        y.sum().backward()


@pytest.mark.parametrize("graphs", [False, True])
def test_sparse_res_block_under_autocast_runs_in_its_input_dtype(graphs):
    """Under autocast (fp16 on a GPU, bf16 on the CPU) the block computes in its input's dtype,
    forward and backward, with the results it gives without autocast."""
    torch.manual_seed(6)
    block, x, indices, count, active = three_windows()
    block = block.float()
    block.graphs = graphs
    x = x.float().requires_grad_(True)
    want = block(x, indices, count)
    want.sum().backward()
    want_grads = [t.grad.clone() for t in (x, block.conv1.weight)]
    x.grad = None
    block.zero_grad(set_to_none=True)
    with torch.autocast(DEVICE, dtype=torch.bfloat16 if DEVICE == "cpu" else torch.float16):
        got = block(x, indices, count)
        with torch.no_grad():
            inference = block(x, indices, count)
    got.sum().backward()
    assert got.dtype == inference.dtype == torch.float32
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(inference, want.detach())
    for g, w in zip((x.grad, block.conv1.weight.grad), want_grads):
        torch.testing.assert_close(g, w)


@pytest.mark.gpu
@pytest.mark.skipif(SIMULATOR, reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_sparse_res_block_training_step_replays_in_a_cuda_graph(dtype):
    """A training step (forward and backward) captured in a CUDA graph, the window kernels
    launched from torch's autograd thread among its nodes, replays to the eager gradients."""
    torch.manual_seed(2)
    block = sbnet_torch.SparseResBlock(channels=8, bottleneck=4, block_size=6).to(DEVICE, dtype)
    x = torch.randn(1, 8, 13, 14, dtype=dtype, device=DEVICE).to(memory_format=torch.channels_last)
    x.requires_grad_(True)
    mask = np.zeros((1, 13, 14), np.float32)
    mask[0, 2:5, 3:11] = 1
    indices, count = block.active_blocks(tensor(mask))
    grad_y = torch.randn_like(x)

    def step():
        x.grad = None
        block.zero_grad(set_to_none=True)
        block(x, indices, count).backward(grad_y)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(side)
    want = [t.grad.clone() for t in (x, block.conv1.weight, block.conv2.weight, block.conv3.weight)]
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    with torch.no_grad():
        for t in (x, block.conv1.weight, block.conv2.weight, block.conv3.weight):
            t.grad.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    got = [t.grad for t in (x, block.conv1.weight, block.conv2.weight, block.conv3.weight)]
    for g, w in zip(got, want):  # (atomic adds: the same sums, perhaps in another order)
        torch.testing.assert_close(g, w, rtol=1e-2 if dtype == torch.float16 else 1e-5, atol=1e-3)


@pytest.mark.gpu
@pytest.mark.skipif(SIMULATOR, reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("dtype", [torch.float64, torch.float16])
def test_sparse_res_block_graphs_train_on_both_nchw_stacks(dtype):
    """One ``graphs=True`` block with SBNet's transpose, called on a channels_last input (the
    NCHW stack's output and backward's gradients NHWC: a slot that flips both) and on a contiguous
    NCHW input (the backward in the stack's own layout; in fp16 the output NHWC, scattered through
    the transpose) in turn, repeated (kept launches): the outputs and gradients of the same block
    without graphs, each layout in slots of its own."""
    eager, graphed, x, every = graphed_pair(True, seed=9, dtype=dtype)
    rng = np.random.default_rng(9)
    for image in (x, x.contiguous(), x, x.contiguous()):
        indices = every[tensor(np.sort(rng.choice(len(every), 20, replace=False))).long()].contiguous()
        got, want = [], []
        for model, into in ((graphed, got), (eager, want)):
            model.zero_grad(set_to_none=True)
            xg = image.detach().clone().requires_grad_(True)
            y = model(xg, indices)
            y.backward(torch.ones_like(y))
            into += [y.detach(), xg.grad] + [w.grad for w in model.weights()]
        for g, w in zip(got, want):  # (fp16: atomic adds, perhaps in another order)
            torch.testing.assert_close(g, w, **({"rtol": 1e-2, "atol": 1e-2} if dtype == torch.float16 else {}))
    flips = {key[3] for key in graphed._graphs._sets}
    assert flips == {(True, True), (False, dtype == torch.float16)}


@pytest.mark.parametrize("dtype, channels, width, window, nhwc", [
    (torch.float16, 4, 10, (4, 4), True), (torch.float32, 4, 10, (4, 4), False),
    (torch.float16, 3, 10, (4, 4), False), (torch.float16, 4, 9, (4, 4), False),
    (torch.float16, 4, 10, (5, 5), False), (torch.float16, 4, 200, (66, 66), False)])
def test_an_nchw_input_has_its_output_nhwc_only_where_the_pair_tiles_scatter_it(dtype, channels, width, window, nhwc):
    """An fp16 NCHW input's NCHW stack writes its output NHWC (scattered back through the transpose)
    only where that scatter goes by the pair tiles: C, W and the output window's width even, rows of
    at most PAIR_TILE_PIXELS pixels; elsewhere (and in fp32) the generic tile would cost more than
    the product saves, and the output stays NCHW."""
    image = torch.zeros(1, channels, 3, width, dtype=dtype)
    assert bottleneck._nhwc_out_of_nchw(sbnet_torch.config.DEFAULT, image, window) == nhwc


def test_sbnet_custom_ops_pass_torch_library_opcheck():
    from sparseblocks.torch import sbnet as ops

    x = torch.randn(1, 4, 5, 2, dtype=torch.float64, device=DEVICE)
    idx = indices_for(x.shape, TILING, every=2)
    geometry = [list(v) for v in TILING.values()]
    blocks = torch.randn(len(idx), 2, 3, 2, dtype=torch.float64, device=DEVICE)
    checks = {"test_utils": ("test_schema", "test_faketensor")}
    torch.library.opcheck(ops.sbnet_gather, (x, idx, None, *geometry, False, "NHWC"), **checks)
    torch.library.opcheck(ops.sbnet_scatter, (blocks, idx, x, None, *geometry, True, False, False, "NHWC"), **checks)
    torch.library.opcheck(ops.sbnet_scatter_, (blocks, idx, x.clone(), None, *geometry, True, False, False, "NHWC"),
                          **checks)


@pytest.mark.parametrize("inplace", [False, True])
def test_compiled_gather_and_scatter_train_as_eager(inplace):
    """Through torch.compile (fullgraph: the custom ops, no graph break) the functions give
    eager's values and gradients: an overwriting scatter (stamp-out gradient), in place too."""
    idx = indices_for((1, 4, 5, 2), TILING, every=2)

    def f(x, w):
        blocks = sbnet_torch.sparse_gather(x, idx, **TILING) * w
        y = x * 2
        return sbnet_torch.sparse_scatter(blocks, idx, y, inplace=inplace, **TILING)

    x = torch.randn(1, 4, 5, 2, dtype=torch.float64, device=DEVICE)
    w = torch.randn(2, dtype=torch.float64, device=DEVICE)
    explained = torch._dynamo.explain(f)(x, w)
    assert explained.graph_break_count == 0
    compiled = torch.compile(f, fullgraph=True, backend="aot_eager" if SIMULATOR else "inductor")
    results = []
    for fn in (f, compiled):
        xs, ws = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
        out = fn(xs, ws)
        (out * out).sum().backward()
        results.append((out.detach(), xs.grad, ws.grad))
    for got, want in zip(*results[::-1]):
        torch.testing.assert_close(got, want)


@pytest.mark.parametrize("layout, inplace", [("NHWC stack", False), gpu_only_case("NCHW stack", True),
                                            ("NCHW input", False)])
def test_compiled_sparse_res_block_trains_as_eager(layout, inplace):
    """A compiled block (fullgraph) gives the eager block's output and gradients, on every stack."""
    torch.manual_seed(2)
    block, x, indices, count, _ = three_windows(channels_last=layout != "NCHW input")
    block.transpose = layout == "NCHW stack"
    weights = torch.randn_like(x)

    def step(model):
        model.zero_grad()
        xs = x.detach().clone().requires_grad_(True)
        y = model(xs * 1 if inplace else xs, indices, count, inplace=inplace)
        (y * weights).sum().backward()
        return [y.detach(), xs.grad] + [conv.weight.grad for conv in (block.conv1, block.conv2, block.conv3)]

    want = step(block)
    xs = x.clone()
    explained = torch._dynamo.explain(block)(xs, indices, count)
    assert explained.graph_break_count == 0 and explained.graph_count == 1
    got = step(torch.compile(block, fullgraph=True, backend="aot_eager" if SIMULATOR else "inductor"))
    for name, g, w in zip(("y", "x", "conv1", "conv2", "conv3"), got, want):
        torch.testing.assert_close(g, w, msg=lambda m, name=name: f"{name}: {m}")
    with torch.no_grad():  # in place without gradients: the mutating custom op, into x itself
        compiled = torch.compile(block, fullgraph=True, backend="aot_eager" if SIMULATOR else "inductor")
        x_inplace, x_eager = x.clone(), x.clone()
        compiled(x_inplace, indices, count, inplace=True)
        block(x_eager, indices, count, inplace=True)
    torch.testing.assert_close(x_inplace, x_eager)


@pytest.mark.parametrize("kernels, layout", [(True, "NHWC stack"), (False, "NCHW input"), (False, "NCHW stack")])
def test_block_compiles_onto_the_fused_kernels(kernels, layout):
    """Where the eager block would fuse its first product into the gather (here at any size), the
    compiled block (fullgraph) takes the fused custom ops, gather·matmul, and in place without
    gradients matmul·scatter: the traced graph holds them, and outputs and gradients are the
    eager block's. ``kernels``: the kernels (in the simulator, on CPU tensors), else torch's ops."""
    from dataclasses import replace

    from sparseblocks.torch import cpu
    from sparseblocks.torch.config import DEFAULT as BLOCK_DEFAULT

    previous = cpu.kernels_on_cpu(kernels)
    try:
        torch.manual_seed(4)
        block, x, indices, count, _ = three_windows(channels_last=layout != "NCHW input")
        block, x = block.float(), x.float()
        block.transpose = layout == "NCHW stack"
        block.config = replace(BLOCK_DEFAULT, fused_gather_min_pixels=0)
        weights = torch.randn_like(x)
        traced = []

        def backend(gm, example_inputs):
            traced.extend(str(node.target) for node in gm.graph.nodes)
            return gm

        def step(model):
            model.zero_grad()
            xs = x.detach().clone().requires_grad_(True)
            y = model(xs, indices, count)
            (y * weights).sum().backward()
            return [y.detach(), xs.grad] + [conv.weight.grad for conv in (block.conv1, block.conv2, block.conv3)]

        want = step(block)
        got = step(torch.compile(block, fullgraph=True, backend=backend))
        assert any("sbnet_gather_matmul" in target for target in traced)
        for name, g, w in zip(("y", "x", "conv1", "conv2", "conv3"), got, want):
            torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5, msg=lambda m, name=name: f"{name}: {m}")
        traced.clear()
        with torch.no_grad():
            torch._dynamo.reset()
            compiled = torch.compile(block, fullgraph=True, backend=backend)
            x_inplace, x_eager = x.clone(), x.clone()
            compiled(x_inplace, indices, count, inplace=True)
            block(x_eager, indices, count, inplace=True)
        assert any("sbnet_matmul_scatter_" in target for target in traced)
        torch.testing.assert_close(x_inplace, x_eager, rtol=1e-4, atol=1e-5)
    finally:
        cpu.kernels_on_cpu(previous)


def test_fused_custom_ops_pass_opcheck():
    """The fused ops' schemas and fake kernels (torch.library.opcheck)."""
    from sparseblocks.torch import fused as fused_ops

    block, x, indices, count, _ = three_windows(channels_last=True)
    image = x.float().permute(0, 2, 3, 1).contiguous()
    p = block.geometry(x.shape)
    w1, _, w3 = (w.float().detach() for w in block.weights())
    geometry = (list(p.bsize), list(p.bstride), list(p.boffset))
    checks = {"test_utils": ("test_schema", "test_faketensor")}
    torch.library.opcheck(fused_ops.sbnet_gather_matmul, (image, indices, count, w1, *geometry, "NHWC"), **checks)
    h2 = torch.rand(len(indices), *p.bsize_out, w3.shape[1], device=x.device)
    out_at = (list(p.bsize_out), list(p.bsize_out), [0, 0])
    torch.library.opcheck(fused_ops.sbnet_matmul_scatter_, (h2, indices, count, w3, image.clone(), *out_at, "NHWC"),
                          **checks)


@pytest.mark.gpu
@pytest.mark.skipif(SIMULATOR, reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_reduce_overhead_captures_the_block_in_cuda_graphs(dtype):
    """torch.compile(mode="reduce-overhead") runs the block, in place into a static image, in
    inductor's CUDA graphs (none skipped), and gives the eager block's output."""
    from torch._dynamo.utils import counters

    torch.manual_seed(3)
    block = sbnet_torch.SparseResBlock(64, 16, block_size=8).to(DEVICE, dtype).to(memory_format=torch.channels_last)
    x = torch.randn(2, 64, 40, 50, device=DEVICE, dtype=dtype).to(memory_format=torch.channels_last)
    mask = (torch.rand(2, 40, 50, device=DEVICE) < 0.02).float()
    indices, count = block.active_blocks(mask)
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(block, mode="reduce-overhead", fullgraph=True)
    work = x.clone()
    torch._dynamo.mark_static_address(work)
    with torch.no_grad():
        want = block(x.clone(), indices, count, inplace=True)
        for _ in range(3):
            work.copy_(x)
            compiled(work, indices, count, inplace=True)
            torch.testing.assert_close(work, want, rtol=1e-2, atol=1e-2)
    assert counters["inductor"]["cudagraph_skips"] == 0
