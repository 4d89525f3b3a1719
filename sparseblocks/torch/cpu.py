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
