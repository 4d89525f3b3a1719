"""sparseblocks: block-sparse and low-bit GPU kernels in Numba-CUDA, each with a NumPy twin.

    import sparseblocks as sb
    layout = sb.BlockLayout.random((4, 4), density=0.5, block_size=32)
    y = sb.bsmm.forward(x, w, layout)

One package per op (`bsmm`, `sbnet`, `fused`), its torch layer in
`sparseblocks.torch`, inline-PTX intrinsics in `ptx`, launching and caches in
`runtime`, NumPy twins in `reference`. Without a GPU every kernel runs in
Numba's CUDA simulator, whose missing warp intrinsics this import installs.
"""

__version__ = "0.1.0"

from .runtime.probe import use_simulator_without_gpu as _use_simulator_without_gpu  # noqa: E402

# Numba reads NUMBA_ENABLE_CUDASIM when numba.cuda is first imported: decide before that.
if _use_simulator_without_gpu():
    from .runtime import simulator as _simulator

    _simulator.install()

from .layout import BlockLayout  # noqa: E402

__all__ = [
    "BlockLayout", "BlocksparseMatMul", "bsmm", "sbnet", "fused",
    "reduce_mask", "sparse_gather", "sparse_scatter", "sparse_gather_matmul", "sparse_matmul_scatter",
    "__version__",
]

_LAZY = {
    "BlocksparseMatMul": ("bsmm", "BlocksparseMatMul"),
    "reduce_mask": ("sbnet", "reduce_mask"),
    "sparse_gather": ("sbnet", "sparse_gather"),
    "sparse_scatter": ("sbnet", "sparse_scatter"),
    "sparse_gather_matmul": ("fused", "sparse_gather_matmul"),
    "sparse_matmul_scatter": ("fused", "sparse_matmul_scatter"),
}


def __getattr__(name):
    # Ops import numba.cuda (a second or so): only when first used. `sparseblocks.torch` is
    # imported only by name, since it imports torch.
    import importlib

    if name in ("bsmm", "sbnet", "fused", "torch", "reference"):
        return importlib.import_module(f".{name}", __name__)
    if name in _LAZY:
        module, attribute = _LAZY[name]
        return getattr(importlib.import_module(f".{module}", __name__), attribute)
    raise AttributeError(f"module 'sparseblocks' has no attribute {name!r}")
