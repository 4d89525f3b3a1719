"""OpenAI's block-sparse convolution: ``BlocksparseConv`` and ``BlocksparseDeconv``, whose channel
connectivity is a list of blocks, each a dense convolution between a group of input channels and a
group of output channels. Files: ``geometry.py`` (sizes, padding, edge-bias groups), ``simple.py``
(the direct kernels, a thread a value), ``tensorcore.py`` (the three products of aligned channel groups
on the tensor cores, fp16 and bf16), ``api.py``, ``config.py``; the NumPy twin is
`sparseblocks.reference.conv`."""

from .api import DTYPES, BlocksparseConv, BlocksparseDeconv
from .config import DEFAULT, ConvConfig

__all__ = ["BlocksparseConv", "BlocksparseDeconv", "ConvConfig", "DEFAULT", "DTYPES"]
