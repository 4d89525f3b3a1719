"""NumPy reference for the gather fused into a 1x1 convolution, and for a 1x1 convolution fused
into the adding scatter (twin of `sparseblocks.fused`).

`sparse_gather_matmul(x, indices, weight, bsize, bstride, boffset, count, relu,
data_format)` is ``sparse_gather(x, indices, ...) @ weight.T`` (then ReLU with
``relu``): each window of an NHWC image (or an NCHW one, gathered through the
transpose), as `reference.sbnet.sparse_gather` gives it, through a
1x1 convolution of weight ``[C_out, C]`` (a convolution's ``[C_out, C, 1, 1]``
also goes), without the block stack in between. The result is
``[n_blocks, bsize_h, bsize_w, C_out]`` in x's dtype: one row an index, and
rows from ``count`` on zeros (what the gathered zeros give). Products and
sums in float64, rounded once.

`sparse_matmul_scatter(blocks, indices, weight, y, ...)` is the other end of
the bottleneck: ``y`` plus ``sparse_scatter(blocks @ weight.T, ..., add=True)``,
the product rounded to y's dtype before the add (an NCHW ``y`` takes the NHWC
product through the transpose).
"""

import numpy as np

from .sbnet import sparse_gather, sparse_scatter


def _rows(weight):
    """A weight as [C_out, C]: a 1x1 convolution's [C_out, C, 1, 1] viewed so."""
    weight = np.asarray(weight)
    return weight[:, :, 0, 0] if weight.ndim == 4 and weight.shape[2:] == (1, 1) else weight


def sparse_gather_matmul(x, indices, weight, bsize, bstride, boffset=0, count=None, relu=False,
                         data_format="NHWC"):
    """``relu?(sparse_gather(x, indices, ...) @ weight.T)`` for NHWC ``x`` (or NCHW with
    ``data_format``: its windows gathered through the transpose), weight ``[C_out, C]``; the result
    NHWC either way."""
    x = np.asarray(x)
    weight = _rows(weight)
    channels = x.shape[3 if data_format == "NHWC" else 1] if x.ndim == 4 else None
    if weight.ndim != 2 or x.ndim != 4 or weight.shape[1] != channels:
        raise ValueError(f"weight: expected [C_out, {channels}] for {data_format} x of shape {x.shape}, "
                         f"got {weight.shape}")
    n_blocks = len(np.asarray(indices))
    blocks = sparse_gather(x, indices, bsize, bstride, boffset, count=count, transpose=data_format == "NCHW",
                           data_format=data_format)  # (NHWC blocks: the count's rows)
    result = blocks.astype(np.float64) @ weight.astype(np.float64).T
    if relu:
        result = np.maximum(result, 0)
    out = np.zeros((n_blocks, *blocks.shape[1:3], weight.shape[0]), x.dtype)
    out[:len(result)] = result
    return out


def sparse_matmul_scatter(blocks, indices, weight, y, bsize, bstride, boffset=0, count=None, data_format="NHWC"):
    """``y + sparse_scatter(blocks @ weight.T, indices, ..., add=True)`` for an NHWC stack ``blocks``
    and NHWC ``y`` (or NCHW with ``data_format``: the product scattered through the transpose),
    weight ``[C, K]``: the product rounded to y's dtype, then added (a new array)."""
    blocks = np.asarray(blocks)
    y = np.asarray(y)
    weight = _rows(weight)
    channels = y.shape[3 if data_format == "NHWC" else 1] if y.ndim == 4 else None
    if weight.ndim != 2 or blocks.ndim != 4 or weight.shape[1] != blocks.shape[3] or weight.shape[0] != channels:
        raise ValueError(f"weight: expected [{channels}, {blocks.shape[-1]}], got {weight.shape}")
    product = (blocks.astype(np.float64) @ weight.astype(np.float64).T).astype(y.dtype)
    return sparse_scatter(product, indices, y, bsize, bstride, boffset, add=True, count=count,
                          transpose=data_format == "NCHW", data_format=data_format)
