"""The torch layer: autograd for SBNet's gather and scatter, and the sparse ResNet block.

    from sparseblocks.torch import SparseResBlock, sparse_gather, sparse_scatter

Importing this package imports torch. Tensors reach the kernels through
``__cuda_array_interface__`` and every launch goes on torch's current stream.
"""

from .config import ResBlockConfig
from .res_block import SparseResBlock
from .sbnet import sparse_gather, sparse_scatter

__all__ = ["SparseResBlock", "ResBlockConfig", "sparse_gather", "sparse_scatter"]
