"""The torch layer: `BlockSparseLinear` (with `sparsify` and `BlockRegrowth`), SBNet's gather and
scatter with autograd, the sparse ResNet block, `LQLinear` (learned low-bit quantization),
`layer_norm` (OpenAI's, over either feature axis) and the block-sparse convolutions
(`BlockSparseConv1d`, `2d`, `3d`, and their `BlockSparseConvTranspose`), and block-sparse
attention (`BlockSparseAttention`, `block_sparse_attention`).

    from sparseblocks.torch import BlockSparseLinear, BlockRegrowth, sparsify, LQLinear
    from sparseblocks.torch import SparseResBlock, sparse_gather, sparse_scatter

Importing this package imports torch. Tensors reach the kernels through
``__cuda_array_interface__`` and every launch goes on torch's current stream.
"""

import torch as _torch

from ..runtime import devices as _devices
from .attention import BlockSparseAttention, block_sparse_attention
from .config import ResBlockConfig
from .conv import BlockSparseConv1d, BlockSparseConv2d, BlockSparseConv3d, BlockSparseConvTranspose1d
from .conv import BlockSparseConvTranspose2d, BlockSparseConvTranspose3d
from .linear import BlockSparseLinear
from .norms import batch_norm, layer_norm
from .quant import LQLinear, QuantConv2d
from .regrow import BlockRegrowth
from .res_block import SparseResBlock
from .sbnet import sparse_gather, sparse_scatter
from .sparsify import sparsify

_devices.tracing = _torch.compiler.is_compiling

__all__ = ["BlockSparseLinear", "BlockRegrowth", "sparsify", "SparseResBlock", "ResBlockConfig", "sparse_gather",
           "sparse_scatter", "LQLinear", "QuantConv2d", "layer_norm", "batch_norm", "BlockSparseConv1d", "BlockSparseConv2d",
           "BlockSparseConv3d", "BlockSparseConvTranspose1d", "BlockSparseConvTranspose2d", "BlockSparseConvTranspose3d",
           "BlockSparseAttention", "block_sparse_attention"]
