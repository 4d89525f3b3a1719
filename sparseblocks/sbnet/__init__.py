"""SBNet's activation-sparsity ops: ``reduce_mask``, ``sparse_gather``, ``sparse_scatter``.

    from sparseblocks import sbnet
    indices, count = sbnet.reduce_mask(mask, bsize=16, bstride=14, boffset=-1)
    blocks = sbnet.sparse_gather(x, indices, 16, 14, -1, count=count)
    y = sbnet.sparse_scatter(out_blocks, indices, y, 14, 14, 0, add=True, count=count)

Window geometry: `sparseblocks.windows`. Files: `reduce` (reduce_mask, with `reduce_pool` and
`reduce_pass`), `api` (gather and scatter), `dispatch` (which copy kernel runs),
the copy families `copy_element`, `copy_rows`, `copy_pairs`, `copy_pair_tiles`,
`merge`, and `plans` (kept launches for repeated torch calls).
"""

from .api import sparse_gather, sparse_scatter
from .config import DEFAULT, SbnetConfig
from .plans import kept_launches
from .reduce import reduce_mask

__all__ = ["reduce_mask", "sparse_gather", "sparse_scatter", "SbnetConfig", "DEFAULT", "kept_launches"]
