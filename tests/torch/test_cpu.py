"""The torch layer's CPU path (sparseblocks/torch/cpu.py): its three products against the NumPy
twins, its autograd, and a compiled layer on CPU tensors with no graph break."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch")

from sparseblocks.reference import bsmm as reference  # noqa: E402
from sparseblocks.torch import BlockSparseLinear, cpu  # noqa: E402
from strategies import assert_close, layouts, values  # noqa: E402
from test_linear import assert_compiles_as_eager  # noqa: E402

DTYPES = {"float64": torch.float64, "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def tensor(array, dtype):
    """A CPU tensor of `dtype` from a NumPy array (bf16 through float32: NumPy holds no bf16 for torch)."""
    return torch.from_numpy(np.asarray(array, np.float64)).to(DTYPES[dtype])


@settings(max_examples=20)
@given(data=st.data(), dtype=st.sampled_from(sorted(DTYPES)))
def test_products_match_the_numpy_twins(data, dtype):
    layout = data.draw(layouts(block_sizes=(8, 16, 32), max_blocks=4))
    n = data.draw(st.integers(0, 40), label="N")
    C, K = layout.dense_shape
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1), label="seed"))
    x64, dy64, w64 = (values(rng, shape, "float64") for shape in ((n, C), (n, K), layout.w_shape))
    x, dy, w = (tensor(a, dtype) for a in (x64, dy64, w64))
    x64, dy64, w64 = (t.double().numpy() for t in (x, dy, w))  # (the values as stored)
    coords, grid = torch.tensor(layout.coords, dtype=torch.long), layout.shape
    got = {"forward": cpu.forward(x, w, coords, grid), "input_grad": cpu.input_grad(dy, w, coords, grid),
           "weight_grad": cpu.weight_grad(x, dy, coords, grid)}
    want = {"forward": (reference.forward(x64, w64, layout), reference.forward(abs(x64), abs(w64), layout), C),
            "input_grad": (reference.input_grad(dy64, w64, layout), reference.input_grad(abs(dy64), abs(w64), layout), K),
            "weight_grad": (reference.weight_grad(x64, dy64, layout), reference.weight_grad(abs(x64), abs(dy64), layout),
                            n)}
    for name, result in got.items():
        assert result.dtype == DTYPES[dtype], name
        expected, magnitude, terms = want[name]
        assert_close(result.double().numpy(), expected, dtype, name, magnitude=magnitude, terms=max(terms, 1))


def test_gradcheck_of_the_cpu_product():
    layer = BlockSparseLinear(24, 16, density=0.5, block_size=8, dtype=torch.float64)
    assert cpu.takes(torch.empty(1))
    x = torch.randn(5, 24, dtype=torch.float64, requires_grad=True)
    torch.autograd.gradcheck(lambda x, w: cpu.product(x, w, layer.block_coords, tuple(layer.block_mask.shape)),
                             (x, layer.weight))


def test_a_compiled_layer_on_cpu_tensors_has_no_graph_break():
    model = torch.nn.Sequential(BlockSparseLinear(16, 24, density=0.5, block_size=8), torch.nn.GELU(),
                                BlockSparseLinear(24, 8, density=0.5, block_size=8))
    assert_compiles_as_eager(model, torch.randn(3, 16), "aot_eager")


def test_kernels_on_cpu_is_a_switch():
    previous = cpu.kernels_on_cpu(True)
    try:
        assert not cpu.takes(torch.empty(1))
    finally:
        cpu.kernels_on_cpu(previous)
    assert cpu.takes(torch.empty(1)) == (not previous)
