"""`BlockSparseLinear`'s products on CPU tensors, with torch's own operations.

A layer on CPU tensors computes what the kernels compute on the GPU, as torch's CPU kernels do
it: the blocks a product needs are gathered from the activations (``index_select`` over the
feature blocks), multiplied by their weight blocks in one batched matmul, and added into the
output's blocks (``index_add_``). Sums run in fp32 (fp64 for fp64), as the kernels', and the
result is rounded to the storage once. The same semantics, dtypes, autograd and
``torch.compile`` as the kernel path; not bitwise the GPU's sums (another order).

``y = x · W``, ``dx = dy · Wᵀ`` and ``dW = xᵀ · dy`` take the layout as ``coords`` (the layer's
``block_coords``, ``(n_blocks, 2)`` long: block b maps input block ``coords[b, 0]`` to output
block ``coords[b, 1]``) and ``grid`` ``(in_features / bs, out_features / bs)``.

CPU tensors take this path unless ``SPARSEBLOCKS_CPU_KERNELS=1`` is set before the import (or
`kernels_on_cpu` says so): then they run the kernels in Numba's CUDA simulator, for kernel work.
"""

import os

import torch

KERNELS_VARIABLE = "SPARSEBLOCKS_CPU_KERNELS"
KERNELS_ON_CPU = os.environ.get(KERNELS_VARIABLE, "0") not in ("", "0")


def kernels_on_cpu(on=None):
    """Whether CPU tensors run the kernels (in the simulator) instead of torch's operations; with
    ``on``, set it (returns the previous setting)."""
    global KERNELS_ON_CPU
    previous = KERNELS_ON_CPU
    if on is not None:
        KERNELS_ON_CPU = bool(on)
    return previous


def takes(x):
    """Whether a call with ``x`` computes here: a CPU tensor, unless the kernels were asked for."""
    return x.device.type == "cpu" and not KERNELS_ON_CPU


def _sum_dtype(dtype):
    return torch.float64 if dtype == torch.float64 else torch.float32


def _blocks(a, blocks, bs, index):
    """The feature blocks ``index`` of ``a`` (N, blocks * bs), in the sums' dtype: (n_blocks, N, bs)."""
    return a.reshape(a.shape[0], blocks, bs).transpose(0, 1).index_select(0, index).to(_sum_dtype(a.dtype))


def _added(parts, blocks, index, dtype):
    """The (n_blocks, N, bs) products ``parts`` added into output blocks ``index`` of (N, blocks * bs)."""
    n, bs = parts.shape[1], parts.shape[2]
    out = parts.new_zeros((blocks, n, bs))
    out.index_add_(0, index, parts)
    return out.transpose(0, 1).reshape(n, blocks * bs).to(dtype)


def forward(x, w, coords, grid):
    """``y = x · W``: x (N, C) -> (N, K)."""
    parts = torch.bmm(_blocks(x, grid[0], w.shape[-1], coords[:, 0]), w.to(_sum_dtype(w.dtype)))
    return _added(parts, grid[1], coords[:, 1], x.dtype)


def input_grad(dy, w, coords, grid, dys=None):
    """``dx = dy · Wᵀ``: dy (N, K) -> (N, C) (``dys``: dy's blocks, where gathered already)."""
    dys = _blocks(dy, grid[1], w.shape[-1], coords[:, 1]) if dys is None else dys
    parts = torch.bmm(dys, w.to(_sum_dtype(w.dtype)).transpose(1, 2))
    return _added(parts, grid[0], coords[:, 0], dy.dtype)


def weight_grad(x, dy, coords, grid, dys=None):
    """``dW = xᵀ · dy`` on the layout's blocks: (n_blocks, bs, bs)."""
    bs = x.shape[1] // grid[0]
    dys = _blocks(dy, grid[1], bs, coords[:, 1]) if dys is None else dys
    return torch.bmm(_blocks(x, grid[0], bs, coords[:, 0]).transpose(1, 2), dys).to(x.dtype)


class _Product(torch.autograd.Function):
    """``x · W`` with its gradients from `input_grad` and `weight_grad` (x and w saved, not the
    gathered blocks)."""

    @staticmethod
    def forward(ctx, x, w, coords, grid):
        ctx.save_for_backward(x, w, coords)
        ctx.grid = grid
        return forward(x, w, coords, grid)

    @staticmethod
    def backward(ctx, dy):
        x, w, coords = ctx.saved_tensors
        dys = _blocks(dy, ctx.grid[1], w.shape[-1], coords[:, 1])  # (gathered once for both)
        dx = input_grad(dy, w, coords, ctx.grid, dys) if ctx.needs_input_grad[0] else None
        dw = weight_grad(x, dy, coords, ctx.grid, dys) if ctx.needs_input_grad[1] else None
        return dx, dw, None, None


def product(x, w, coords, grid):
    """``x · W`` with autograd."""
    if torch.is_grad_enabled() and (x.requires_grad or w.requires_grad):
        return _Product.apply(x, w, coords, tuple(grid))
    return forward(x, w, coords, grid)


# -- SBNet's gather and scatter (`sparseblocks.sbnet`'s semantics, with torch's indexing) --------

def _check_indices(indices, count):
    if indices.dim() != 2 or indices.shape[1] != 3:
        raise ValueError(f"indices: expected [n_blocks, 3] of (n, bh, bw), got shape {tuple(indices.shape)}")
    if indices.dtype != torch.int32:
        raise TypeError(f"indices: expected int32, got {indices.dtype}")
    if count is None:
        return indices.shape[0]
    if count.shape != (1,) or count.dtype != torch.int32:
        raise ValueError(f"count: expected a one-element int32 array, got {tuple(count.shape)} {count.dtype}")
    n = int(count[0])
    if not 0 <= n <= indices.shape[0]:
        raise ValueError(f"count: expected 0..{indices.shape[0]}, got {n}")
    return n


def _image(name, t, data_format):
    """``t`` as an NHWC view (an NCHW tensor permuted), after the checks the kernels' API makes."""
    from ..sbnet.api import DATA_DTYPES, check_format

    channels_last = check_format(data_format)
    if t.dim() != 4:
        raise ValueError(f"{name}: expected {data_format}, got shape {tuple(t.shape)}")
    dtype = str(t.dtype).replace("torch.", "")
    if dtype not in DATA_DTYPES:
        raise TypeError(f"{name}: expected dtype in {list(DATA_DTYPES)}, got {dtype}")
    return t if channels_last else t.permute(0, 2, 3, 1)


def _window_pixels(indices, n_kept, geometry, image):
    """The pixels of the first ``n_kept`` windows: (inside (B, bh, bw) bool, and the image's
    n, row and column of each, clamped into the image)."""
    (sh, sw), (th, tw), (oh, ow) = geometry
    N, H, W = image
    index = indices.long()
    B = index.shape[0]
    rows = oh + index[:, 1:2] * th + torch.arange(sh)
    cols = ow + index[:, 2:3] * tw + torch.arange(sw)
    kept = (torch.arange(B) < n_kept) & (index[:, 0] >= 0) & (index[:, 0] < N)
    inside = (kept[:, None, None] & ((rows >= 0) & (rows < H))[:, :, None]
              & ((cols >= 0) & (cols < W))[:, None, :])
    shape = (B, sh, sw)
    n = index[:, 0].clamp(0, max(N - 1, 0))[:, None, None].expand(shape)
    return inside, n, rows.clamp(0, max(H - 1, 0))[:, :, None].expand(shape), \
        cols.clamp(0, max(W - 1, 0))[:, None, :].expand(shape)


def sparse_gather(x, indices, bsize, bstride, boffset=0, transpose=False, count=None, data_format="NHWC"):
    """`sparseblocks.sbnet.sparse_gather` on CPU tensors: the windows' pixels read by one
    advanced index, zeros off the image and from ``count`` on."""
    from ..windows import check_geometry

    image = _image("x", x, data_format)
    n_kept = _check_indices(indices, count)
    geometry = check_geometry(bsize, bstride, boffset)
    inside, n, rows, cols = _window_pixels(indices, n_kept, geometry, image.shape[:3])
    blocks = image[n, rows, cols] if image.numel() else image.new_zeros((*inside.shape, image.shape[3]))
    blocks = torch.where(inside[..., None], blocks, blocks.new_zeros(()))  # (B, bh, bw, C)
    channels_last = (data_format == "NHWC") != transpose
    return blocks.contiguous() if channels_last else blocks.permute(0, 3, 1, 2).contiguous()


def sparse_scatter(blocks, indices, y, bsize, bstride, boffset=0, add=False, atomic=False, transpose=False,
                   inplace=False, count=None, data_format="NHWC"):
    """`sparseblocks.sbnet.sparse_scatter` on CPU tensors: the windows' pixels written (the last
    block in index order where windows overlap) or added, by one indexed put."""
    from ..sbnet.api import block_shape
    from ..windows import check_geometry

    _image("y", y, data_format)
    n_kept = _check_indices(indices, count)
    if blocks.dtype != y.dtype:
        raise TypeError(f"dtype mismatch: blocks {blocks.dtype}, y {y.dtype}")
    geometry = check_geometry(bsize, bstride, boffset)
    (sh, sw), (th, tw), _ = geometry
    channels_last = (data_format == "NHWC") != transpose
    expected = block_shape(indices.shape[0], (sh, sw), y.shape[3 if data_format == "NHWC" else 1],
                           data_format == "NHWC", transpose)
    if tuple(blocks.shape) != expected:
        raise ValueError(f"blocks: expected shape {expected} for {indices.shape[0]} indices, "
                         f"got {tuple(blocks.shape)}")
    if add and not atomic and (th < sh or tw < sw):
        raise ValueError(f"add: windows of bsize {(sh, sw)} every bstride {(th, tw)} overlap; "
                         "adding them needs atomic=True")
    out = y if inplace else y.clone(memory_format=torch.contiguous_format)  # (once the checks pass)
    image = _image("y", out, data_format)
    inside, n, rows, cols = _window_pixels(indices, n_kept, geometry, image.shape[:3])
    values = (blocks if channels_last else blocks.permute(0, 2, 3, 1))[inside]
    n, rows, cols = n[inside], rows[inside], cols[inside]
    if add:
        image.index_put_((n, rows, cols), values, accumulate=True)
    else:  # of the pixels written more than once, the last block's (blocks in index order)
        flat = (n * image.shape[1] + rows) * image.shape[2] + cols
        unique, inverse = torch.unique(flat, return_inverse=True)
        last = torch.full_like(unique, -1).scatter_reduce_(0, inverse, torch.arange(flat.numel()), "amax")
        image.index_put_((n[last], rows[last], cols[last]), values[last])
    return out


def reduce_mask(mask, bsize, bstride, boffset=0, tol=0.0, avgpool=False, bcount=None):
    """`sparseblocks.sbnet.reduce_mask` on a CPU tensor ``[N, H, W]``: each window's max (with
    ``avgpool`` its sum over the full window, off-image pixels zero, over the window's area) by
    torch's pooling in fp64, on the mask padded past its edges (-inf for the max, 0 for the
    average); a NaN pixel makes its pool NaN, never above ``tol``. Returns the kernels' device
    form: ``[windows, 3]`` int32 indices, the first ``count`` the active windows in row-major
    order and the rest ``n = -1``, and ``count`` as a ``(1,)`` int32 tensor."""
    from ..sbnet.reduce import MASK_DTYPES
    from ..windows import block_count, check_geometry, check_tol, pair

    tol = check_tol(tol)
    if mask.dim() != 3:
        raise ValueError(f"mask: expected [N, H, W], got shape {tuple(mask.shape)}")
    dtype = str(mask.dtype).replace("torch.", "")
    if dtype not in MASK_DTYPES:
        raise TypeError(f"mask: expected dtype in {list(MASK_DTYPES)}, got {dtype}")
    (sh, sw), (th, tw), (oh, ow) = check_geometry(bsize, bstride, boffset)
    N, H, W = mask.shape
    ch, cw = block_count((H, W), (th, tw), (oh, ow)) if bcount is None else pair(bcount, "bcount")
    if min(ch, cw) < 0:
        raise ValueError(f"bcount: expected non-negative counts, got {(ch, cw)}")
    total = N * ch * cw
    indices = torch.full((max(total, 1), 3), -1, dtype=torch.int32)
    if total == 0:
        return indices, torch.zeros(1, dtype=torch.int32)
    # The rows oh .. oh + (ch - 1)·th + sh (and columns alike) that the windows cover, padded
    # where they run off the image.
    h_end, w_end = oh + (ch - 1) * th + sh, ow + (cw - 1) * tw + sw
    top, left = max(0, -oh), max(0, -ow)
    padded = torch.nn.functional.pad(mask.to(torch.float64), (left, max(0, w_end - W), top, max(0, h_end - H)),
                                     value=0.0 if avgpool else float("-inf"))
    region = padded[:, oh + top:h_end + top, ow + left:w_end + left][:, None]
    pool = torch.nn.functional.avg_pool2d if avgpool else torch.nn.functional.max_pool2d
    active = torch.nonzero(pool(region, (sh, sw), (th, tw))[:, 0] > tol).to(torch.int32)
    indices[:active.shape[0]] = active
    return indices, torch.tensor([active.shape[0]], dtype=torch.int32)
