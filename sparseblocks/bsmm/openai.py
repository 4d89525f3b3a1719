"""`BlocksparseMatMul`: OpenAI blocksparse's block-sparse weight matmul, on Numba-CUDA.

    bsmm = BlocksparseMatMul(layout_mask, block_size=32, feature_axis=1)
    y  = bsmm(x, w)                   # x · W
    dx = bsmm.input_grad(dy, w)       # dy · Wᵀ
    dw = bsmm.weight_grad(x, dy)      # xᵀ · dy on the layout's blocks

A thin, stateless front to `sparseblocks.bsmm`'s functions over one `BlockLayout`.
"""

import numpy as np

from ..layout import BlockLayout
from . import api
from .config import as_config
from .dispatch import VERSIONS


class BlocksparseMatMul:
    """Block-sparse ``y = x · W`` over a block layout, with both gradient products.

    ``layout`` is a `BlockLayout` or a 2-D 0/1 block mask ``(C/bs, K/bs)``
    (then ``block_size`` applies). ``feature_axis=1``: activations are
    ``(N, features)``; ``feature_axis=0``: ``(features, N)``.
    """

    def __init__(self, layout, block_size=32, feature_axis=1, version=None, config=None):
        if isinstance(layout, BlockLayout):
            if block_size not in (32, layout.block_size):
                raise ValueError(
                    f"block_size: the layout's block size is {layout.block_size}, got {block_size}"
                )
        else:
            layout = BlockLayout(layout, block_size)
        if feature_axis not in (0, 1):
            raise ValueError(f"feature_axis: expected 0 or 1, got {feature_axis!r}")
        if version is not None and version not in VERSIONS:
            raise ValueError(f"version: expected one of {VERSIONS} or None, got {version!r}")
        self.layout = layout
        self.feature_axis = feature_axis
        self.version = version
        self.config = as_config(config)

    # -- shapes and sizes (OpenAI's names) -----------------------------------------

    @property
    def block_size(self):
        return self.layout.block_size

    @property
    def blocks(self):
        return self.layout.n_blocks

    @property
    def C(self):
        return self.layout.dense_shape[0]

    @property
    def K(self):
        return self.layout.dense_shape[1]

    @property
    def w_shape(self):
        return self.layout.w_shape

    @property
    def sparsity(self):
        """Fraction of blocks present, rounded to 3 digits, as OpenAI blocksparse reports it."""
        return round(self.layout.density, 3)

    def i_shape(self, N):
        return (N, self.C) if self.feature_axis else (self.C, N)

    def o_shape(self, N):
        return (N, self.K) if self.feature_axis else (self.K, N)

    def block_coord(self, block):
        """``(c, k)`` of block number ``block``."""
        return self.layout.block_coord(block)

    def flops(self, N):
        """Multiply-adds x 2 of one product over N rows, on the present blocks only."""
        return 2 * N * self.blocks * self.block_size ** 2

    # -- products -----------------------------------------------------------------

    def __call__(self, x, w):
        """``y = x · W``."""
        return api.forward(x, w, self.layout, self.feature_axis, self.version, self.config)

    forward = __call__

    def input_grad(self, dy, w):
        """``dx = dy · Wᵀ``."""
        return api.input_grad(dy, w, self.layout, self.feature_axis, self.version, self.config)

    def weight_grad(self, x, dy, out=None, beta=0.0):
        """``dW = xᵀ · dy`` on the layout's blocks; with ``out``: ``out = xᵀ·dy + beta·out``."""
        return api.weight_grad(x, dy, self.layout, self.feature_axis, out=out, beta=beta,
                               version=self.version, config=self.config)

    # -- initialisers (NumPy arrays) ---------------------------------------------------

    def identity_init(self, scale=1.0, dtype=np.float32):
        """Weights that are ``scale`` x the identity on diagonal blocks and zero elsewhere."""
        w = np.zeros(self.w_shape, dtype)
        diagonal = self.layout.coords[:, 0] == self.layout.coords[:, 1]
        w[diagonal] = np.eye(self.block_size, dtype=dtype) * scale
        return w

    def ortho_init(self, seed=0, dtype=np.float32):
        """Weights whose columns are orthonormal within each output block-column (OpenAI's scheme):
        each block-column's stacked blocks ``(len(col) * bs, bs)`` are the Q of a Gaussian
        matrix's QR, made on the device (`bsmm.ortho_init`) and returned as a NumPy array."""
        return api.ortho_init(self.layout, np.zeros(self.w_shape, dtype), seed, config=self.config)

    def __repr__(self):
        return f"BlocksparseMatMul({self.layout!r}, feature_axis={self.feature_axis})"
