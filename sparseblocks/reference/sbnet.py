"""NumPy reference for SBNet's activation-sparsity ops (twin of `sparseblocks.sbnet`).

Block geometry. A block index ``(n, bh, bw)`` names the window of image ``n``
whose rows are ``boffset_h + bh*bstride_h`` up to (excluding)
``+ bsize_h``, and likewise for columns. Windows may reach outside the image
(negative offsets for padding, the last row of blocks past the edge):
reads there give zeros and writes there are dropped. Every size, stride and
offset argument takes an int (both axes) or an ``(h, w)`` pair.

* `reduce_mask`: pools a mask ``[N, H, W]`` over every window of the block
  grid; a block is active when the pooled value exceeds ``tol`` (max mode: any
  in-bounds value > tol; avg mode: sum of in-bounds values / (bsize_h*bsize_w)
  > tol). Returns the active ``(n, bh, bw)`` as int32 ``[n_active, 3]`` in
  row-major order; an empty mask gives ``[0, 3]`` (not SBNet's dummy block).
* `sparse_gather`: copies the windows of an NHWC tensor into a block stack
  ``[n_blocks, bsize_h, bsize_w, C]`` (``transpose=True``: ``[n_blocks, C,
  bsize_h, bsize_w]``, i.e. NCHW blocks).
* `sparse_scatter`: writes (or with ``add=True`` adds) such a stack back into
  a copy of ``y`` (``inplace=True``: into ``y`` itself), blocks in index
  order, so with overlapping windows and ``add=False`` the last block wins.
  ``atomic`` only changes how a kernel adds; the result is the same.
* `calc_block_params`, `calc_block_params_res_block`: the block geometry that
  makes a sparse convolution (gather, VALID convolution, scatter) equal the
  dense one on the active blocks, as SBNet's functions of the same names.
"""

import numpy as np

from ..windows import (  # noqa: F401  (the geometry is the product's; tests read it here too)
    BlockParams,
    block_count,
    calc_block_params,
    calc_block_params_res_block,
    check_geometry,
    check_tol,
    conv_output_size,
    conv_padding,
    pair,
    window,
)


def _overlap(start, length, size):
    """Clip ``[start, start+length)`` to ``[0, size)``: (begin, end) in image and block coordinates."""
    begin = min(max(start, 0), size)
    end = max(begin, min(start + length, size))
    return begin, end, begin - start, end - start


def reduce_mask(mask, bsize, bstride, boffset=0, tol=0.0, avgpool=False, bcount=None):
    """Active block indices ``[n_active, 3]`` (int32, row-major) of a mask ``[N, H, W]``: the
    windows whose max (``avgpool``: sum over the window's full area, pixels off the image
    counting zero) is above ``tol``. A NaN pixel makes the pool NaN, so its window is inactive."""
    mask = np.asarray(mask)
    if mask.ndim != 3:
        raise ValueError(f"mask: expected [N, H, W], got {mask.ndim} dimensions")
    bsize, bstride, boffset = check_geometry(bsize, bstride, boffset)
    tol = check_tol(tol)
    N, H, W = mask.shape
    bcount = block_count((H, W), bstride, boffset) if bcount is None \
        else pair(bcount, "bcount")
    active = []
    for n in range(N):
        for bh in range(bcount[0]):
            for bw in range(bcount[1]):
                h0, w0 = window((n, bh, bw), bsize, bstride, boffset)
                hb, he, _, _ = _overlap(h0, bsize[0], H)
                wb, we, _, _ = _overlap(w0, bsize[1], W)
                values = mask[n, hb:he, wb:we].astype(np.float64)
                if avgpool:
                    pooled = values.sum() / (bsize[0] * bsize[1])
                else:
                    pooled = values.max() if values.size else -np.inf
                if pooled > tol:
                    active.append((n, bh, bw))
    return np.array(active, np.int32).reshape(-1, 3)


def _check_indices(indices):
    indices = np.asarray(indices)
    if indices.ndim != 2 or indices.shape[1] != 3:
        raise ValueError(f"indices: expected [n_blocks, 3] of (n, bh, bw), got shape {indices.shape}")
    return indices


def _channels_last(data_format):
    if data_format not in ("NHWC", "NCHW"):
        raise ValueError(f"data_format: expected 'NHWC' or 'NCHW', got {data_format!r}")
    return data_format == "NHWC"


def _inside(indices, image_shape, bsize, bstride, boffset):
    """(block i, image n, image slices, block slices) of each window's part inside the image."""
    N, H, W = image_shape
    for i, index in enumerate(indices):
        n = int(index[0])
        if not 0 <= n < N:
            continue
        h0, w0 = window(index, bsize, bstride, boffset)
        hb, he, bhb, bhe = _overlap(h0, bsize[0], H)
        wb, we, bwb, bwe = _overlap(w0, bsize[1], W)
        if hb < he and wb < we:
            yield i, n, (slice(hb, he), slice(wb, we)), (slice(bhb, bhe), slice(bwb, bwe))


def sparse_gather(x, indices, bsize, bstride, boffset=0, transpose=False, count=None, data_format="NHWC",
                  out=None):
    """Windows of ``x`` as a block stack in x's layout (``transpose``: the other one).

    NHWC ``x`` gives ``[n_blocks, bh, bw, C]`` (``transpose``: ``[n_blocks, C, bh, bw]``),
    NCHW ``x`` the reverse. ``count`` keeps only the first ``count`` indices. ``out``: an
    array of the full stack's shape (one row an index, the count or not) and x's dtype,
    written from its first row to the count, zeros after (as the kernel writes them), and
    returned.
    """
    if out is not None:
        n = len(np.asarray(indices))
        blocks = sparse_gather(x, indices, bsize, bstride, boffset, transpose, count, data_format)
        if out.dtype != blocks.dtype or out.shape != (n, *blocks.shape[1:]):
            raise ValueError(f"out: expected {blocks.dtype} of shape {(n, *blocks.shape[1:])}, "
                             f"got {out.dtype} {out.shape}")
        out[:len(blocks)] = blocks
        out[len(blocks):] = 0
        return out
    x = np.asarray(x)
    if x.ndim != 4:
        raise ValueError(f"x: expected {data_format}, got {x.ndim} dimensions")
    if not _channels_last(data_format):
        return sparse_gather(x.transpose(0, 2, 3, 1), indices, bsize, bstride, boffset, not transpose, count)
    if count is not None:
        indices = np.asarray(indices)[:int(np.asarray(count).reshape(-1)[0])]
    indices = _check_indices(indices)
    bsize, bstride, boffset = check_geometry(bsize, bstride, boffset)
    N, H, W, C = x.shape
    blocks = np.zeros((len(indices), bsize[0], bsize[1], C), x.dtype)
    for i, n, image_part, block_part in _inside(indices, (N, H, W), bsize, bstride, boffset):
        blocks[(i, *block_part)] = x[(n, *image_part)]
    return blocks.transpose(0, 3, 1, 2).copy() if transpose else blocks


def sparse_scatter(blocks, indices, y, bsize, bstride, boffset=0, add=False, atomic=False,
                   transpose=False, inplace=False, count=None, data_format="NHWC"):
    """Write (or add) a block stack into ``y`` (blocks in y's layout, or the other with
    ``transpose``); a copy unless ``inplace``. ``count`` keeps the first ``count`` blocks."""
    if not _channels_last(data_format):
        y = np.asarray(y)
        out = y if inplace else np.array(y, copy=True)
        sparse_scatter(blocks, indices, out.transpose(0, 2, 3, 1), bsize, bstride, boffset, add, atomic,
                       not transpose, True, count)  # writes through the NHWC view into out
        return out
    if count is not None:
        n = int(np.asarray(count).reshape(-1)[0])
        blocks, indices = np.asarray(blocks)[:n], np.asarray(indices)[:n]
    blocks = np.asarray(blocks)
    if blocks.ndim != 4:
        raise ValueError(f"blocks: expected a 4-D block stack, got {blocks.ndim} dimensions")
    if transpose:
        blocks = blocks.transpose(0, 2, 3, 1)
    indices = _check_indices(indices)
    if blocks.shape[0] != len(indices):
        raise ValueError(f"blocks: expected {len(indices)} blocks (one per index), got {blocks.shape[0]}")
    bsize, bstride, boffset = check_geometry(bsize, bstride, boffset)
    y = np.asarray(y)
    if y.ndim != 4:
        raise ValueError(f"y: expected NHWC, got {y.ndim} dimensions")
    N, H, W, C = y.shape
    if blocks.shape[1:] != (bsize[0], bsize[1], C):
        raise ValueError(f"blocks: expected blocks of {(bsize[0], bsize[1], C)} (h, w, C), got {blocks.shape[1:]}")
    out = y if inplace else np.array(y, copy=True)
    for i, n, image_part, block_part in _inside(indices, (N, H, W), bsize, bstride, boffset):
        if add:
            out[(n, *image_part)] += blocks[(i, *block_part)]
        else:
            out[(n, *image_part)] = blocks[(i, *block_part)]
    return out


# -- block geometry for convolutions ------------------------------------------


