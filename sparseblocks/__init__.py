"""sparseblocks: block-sparse GPU kernels in Numba-CUDA, each with a NumPy twin.

    from sparseblocks import BlockLayout
    from sparseblocks.kernels import bsmm
    layout = BlockLayout.random((4, 4), density=0.5, block_size=32)

Kernels live in `sparseblocks.kernels`, their NumPy references in
`sparseblocks.reference`. Without a GPU, set ``NUMBA_ENABLE_CUDASIM=1``
to run every kernel in Numba's CUDA simulator.
"""

__version__ = "0.1.0"

from .layout import BlockLayout  # noqa: E402

__all__ = ["BlockLayout", "BlocksparseMatMul", "__version__"]


def __getattr__(name):
    # Imported lazily: it imports numba.cuda, and whether that runs the CUDA
    # simulator must be decided first (see `_probe`).
    if name == "BlocksparseMatMul":
        from .matmul import BlocksparseMatMul

        return BlocksparseMatMul
    raise AttributeError(f"module 'sparseblocks' has no attribute {name!r}")
