"""Calls run on their arrays' device (runtime/devices.py): the layer, SBNet and the quantized
product on a second GPU, a model split over two, calls alternating between them, and arrays of
one call on two devices refused. The two-GPU cases need two GPUs (the device tool's 2-GPU kind)."""

import numpy as np
import pytest

from sparseblocks.runtime import devices
from sparseblocks.runtime.backend import SIMULATOR


class _Device:
    def __init__(self, **fields):
        self.__dict__.update(fields)


class _Array:
    def __init__(self, device):
        self.device = device


def test_ordinal_of_reads_torch_and_cupy_devices_and_nothing_else():
    assert devices.ordinal_of(_Array(_Device(type="cuda", index=1))) == 1  # a torch tensor's
    assert devices.ordinal_of(_Array(_Device(type="cpu", index=None))) is None
    assert devices.ordinal_of(_Array(_Device(id=2))) == 2  # a CuPy array's
    assert devices.ordinal_of(np.zeros(3)) is None  # (NumPy 2: device "cpu")
    assert devices.ordinal_of(3.0) is None


def test_the_decorator_passes_calls_through():
    @devices.on_arrays_device
    def f(a, *, b=None):
        """doc"""
        return a, b

    assert f(np.zeros(1), b=2)[1] == 2 and f.__doc__ == "doc"
    if SIMULATOR:
        assert devices.active() == 0


torch = pytest.importorskip("torch")
two_gpus = pytest.mark.skipif(SIMULATOR or torch.cuda.device_count() < 2, reason="needs two GPUs")


def _layer(device, seed=0):
    from sparseblocks.torch import BlockSparseLinear

    torch.manual_seed(seed)  # (made on the CPU, then moved: the same layer on either GPU)
    return BlockSparseLinear(256, 128, density=0.5, block_size=64).to(device, torch.float16)


@two_gpus
def test_the_layer_trains_on_the_second_gpu_as_on_the_first():
    results = []
    for device in ("cuda:0", "cuda:1"):
        layer = _layer(device)
        torch.manual_seed(1)
        x = torch.randn(96, 256, dtype=torch.float16).to(device).requires_grad_(True)
        y = layer(x)
        y.float().square().sum().backward()
        assert y.device == torch.device(device) and layer.weight.grad.device == torch.device(device)
        results.append([t.detach().cpu() for t in (y, x.grad, layer.weight.grad)])
    for got, want in zip(*results):
        torch.testing.assert_close(got, want)
    assert torch.cuda.current_device() == 0  # the call left torch's current device as it was


@two_gpus
def test_a_model_split_over_two_gpus_trains():
    first, second = _layer("cuda:0", 0), _layer("cuda:1", 1)
    second_in = torch.nn.Linear(128, 256, device="cuda:1", dtype=torch.float16)
    x = torch.randn(64, 256, device="cuda:0", dtype=torch.float16)
    loss = second(second_in(first(x).to("cuda:1"))).float().square().mean()
    loss.backward()
    assert first.weight.grad.device.index == 0 and second.weight.grad.device.index == 1
    # The same model on one GPU gives the same gradients.
    one = [_layer("cuda:0", 0), _layer("cuda:0", 1)]
    one_in = torch.nn.Linear(128, 256, device="cuda:0", dtype=torch.float16)
    one_in.load_state_dict(second_in.state_dict())
    one[1](one_in(one[0](x))).float().square().mean().backward()
    torch.testing.assert_close(first.weight.grad, one[0].weight.grad)
    torch.testing.assert_close(second.weight.grad.to("cuda:0"), one[1].weight.grad)


@two_gpus
def test_calls_alternate_between_the_gpus():
    from sparseblocks import BlockLayout, bsmm

    layout = BlockLayout.random((4, 4), 0.5, seed=3, block_size=64)
    x0 = torch.randn(200, 256, dtype=torch.float16)
    w0 = torch.randn(layout.w_shape, dtype=torch.float16) / 16
    want = None
    for device in ("cuda:0", "cuda:1", "cuda:0", "cuda:1", "cuda:1", "cuda:0"):
        x, w = x0.to(device), w0.to(device)
        for version in (None, 6, 4):
            y = bsmm.forward(x, w, layout, version=version)
            dw = bsmm.weight_grad(x, y, layout, version=version)
            assert y.device == x.device and dw.device == x.device
            got = (y.float().cpu(), dw.float().cpu())
            if want is None:
                want = got
            torch.testing.assert_close(got[0], want[0], rtol=2e-2, atol=2e-2)
    assert torch.cuda.current_device() == 0


@two_gpus
def test_sbnet_and_the_quantized_product_run_on_the_second_gpu():
    from sparseblocks.torch import LQLinear, SparseResBlock

    results = []
    for device in ("cuda:0", "cuda:1"):
        torch.manual_seed(4)
        block = SparseResBlock(channels=64, bottleneck=32, block_size=8).to(device)
        x = torch.randn(2, 64, 24, 24).to(device).to(memory_format=torch.channels_last)
        mask = (torch.rand(2, 24, 24) > 0.9).float().to(device)
        indices, count = block.active_blocks(mask)
        y = block(x, indices, count)
        torch.manual_seed(5)
        layer = LQLinear(256, 128, w_bits=1, a_bits=1).to(device).eval()
        with torch.no_grad():
            q = layer(torch.randn(64, 256).to(device))
        assert y.device == x.device and q.device == x.device
        results.append((indices[:int(count[0])].cpu(), y.cpu(), q.cpu()))
    for got, want in zip(*results):
        torch.testing.assert_close(got, want)


@two_gpus
def test_arrays_on_two_gpus_in_one_call_are_refused():
    from sparseblocks import BlockLayout, bsmm

    layout = BlockLayout.random((2, 2), 1.0, seed=0, block_size=32)
    x = torch.randn(8, 64, device="cuda:0")
    w = torch.randn(layout.w_shape, device="cuda:1")
    with pytest.raises(ValueError, match=r"w: expected a tensor on cuda:0 \(the call's device"):
        bsmm.forward(x, w, layout)
    with pytest.raises(ValueError, match=r"w: expected a tensor on cuda:1 \(the call's device"):
        bsmm.forward(x.to("cuda:1"), w.to("cuda:0"), layout)
