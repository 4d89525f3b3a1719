"""Fixtures of the torch layer's tests."""

import pytest


@pytest.fixture(params=[True, False], ids=["kernels", "cpu"])
def path(request):
    """The kernels (in the simulator on CPU tensors, or a GPU's), or torch's CPU ops."""
    from sparseblocks.torch import cpu

    previous = cpu.kernels_on_cpu(request.param)
    yield request.param
    cpu.kernels_on_cpu(previous)
