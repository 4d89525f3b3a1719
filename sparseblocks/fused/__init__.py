"""SBNet's gather fused into the 1x1 convolution after it, and the last one into the adding scatter.

    from sparseblocks import fused
    h = fused.sparse_gather_matmul(x, indices, w1, bsize, bstride, boffset, relu=True)
    fused.sparse_matmul_scatter(h, indices, w3, y, bsize_out, bsize_out)   # y += ... in place

The block stack between the gather and the product (or the product and the
scatter), the largest tensor of SBNet's bottleneck, is never written: pixels go
from the image straight into shared memory and through ``mma.sync``. Files:
`kernel` (the one kernel family), `api` (checks, launches, kept plans), `config`.
"""

from .api import (
    kept_launch,
    kept_scatter_launch,
    nchw_scatter_fits,
    scatter_takes,
    sparse_gather_matmul,
    sparse_matmul_scatter,
    takes,
)
from .config import DEFAULT, FusedConfig

__all__ = ["sparse_gather_matmul", "sparse_matmul_scatter", "FusedConfig", "DEFAULT", "takes", "scatter_takes",
           "kept_launch", "kept_scatter_launch", "nchw_scatter_fits"]
