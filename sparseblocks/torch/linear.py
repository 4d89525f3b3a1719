"""`BlockSparseLinear`: a drop-in for ``nn.Linear`` whose weight is block-sparse.

    layer = BlockSparseLinear(1024, 4096, density=0.1, block_size=32, device="cuda")
    layer = BlockSparseLinear.from_dense(trained_linear, density=0.25)   # keep the heaviest blocks

``y = x · W + b`` over any leading batch dimensions, with ``W`` (in_features, out_features) cut
into ``block_size``-square blocks, of which the layout's are stored as one ``Parameter``
``weight`` of shape ``(n_blocks, bs, bs)`` (``weight[b]`` maps inputs ``c*bs:(c+1)*bs`` to outputs
``k*bs:(k+1)*bs`` for block ``b = (c, k)``; `sparseblocks.layout`). The layout is the buffer
``block_mask`` (``(in/bs, out/bs)`` booleans, saved in the state dict) and ``block_coords``.
Forward and backward are the three bsmm products (`ops`), in fp32, fp16 or bf16 (and fp64), under
autocast too; on CPU tensors, the same products in torch's operations (`cpu`). Loading a state
dict takes the saved layout with its weights.
"""

import math
from typing import Any, Dict, Optional, Union

import numpy as np
import torch
from torch import nn

from ..layout import BlockLayout, check_block_size, check_layout
from . import cpu, ops


def block_norms(matrix, block_size, criterion="l2"):
    """Norms of a dense 2-D tensor's ``block_size``-square blocks (fp32, on its device): the
    `sparseblocks.bsmm.block_norms` kernel, or the same reduction in torch for a CPU tensor
    (`cpu.takes`)."""
    from .. import bsmm

    matrix = matrix.detach().contiguous()
    if not cpu.takes(matrix):
        return bsmm.block_norms(matrix, block_size, criterion).float()
    if criterion not in ("l2", "l1", "max"):
        raise ValueError(f"criterion: expected one of ('l2', 'l1', 'max'), got {criterion!r}")
    R, S = matrix.shape
    blocks = matrix.double().abs().reshape(R // block_size, block_size, S // block_size, block_size)
    if criterion == "max":
        return blocks.amax(dim=(1, 3)).float()
    return (blocks.square().sum(dim=(1, 3)).sqrt() if criterion == "l2" else blocks.sum(dim=(1, 3))).float()


def top_blocks(scores, count):
    """A boolean mask of the ``count`` largest of ``scores`` (ties to the lower index)."""
    flat = scores.flatten().double()
    # Stable order: a descending sort, ties kept in index order.
    order = torch.sort(-flat, stable=True).indices[:count]
    mask = torch.zeros_like(flat, dtype=torch.bool)
    mask[order] = True
    return mask.view(scores.shape)


class BlockSparseLinear(nn.Module):
    """``nn.Linear`` with a block-sparse weight: give ``density`` (a random layout of that share of
    blocks; ``seed`` picks it) or ``layout`` (a `BlockLayout` or a 0/1 mask of
    ``(in_features/bs, out_features/bs)`` blocks). ``activation="relu"``: the layer returns
    ``relu(x · W + b)``, the ReLU taken in the product's epilogue (version 7) or the bias's pass, so
    that the pre-activation output is never written (it is ``nn.Sequential(layer, nn.ReLU())``
    in one module)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *, density: Optional[float] = None,
                 layout: Optional[BlockLayout] = None, block_size: int = 32, seed: int = 0,
                 device: Optional[Union[str, torch.device]] = None, dtype: Optional[torch.dtype] = None,
                 activation: Optional[str] = None) -> None:
        super().__init__()
        if activation not in (None, "relu"):
            raise ValueError(f"activation: expected None or 'relu', got {activation!r}")
        self.activation = activation
        factory: Dict[str, Any] = {"device": device, "dtype": dtype}
        for name, value in (("in_features", in_features), ("out_features", out_features)):
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
                raise TypeError(f"{name}: expected a positive int, got {value!r}")
        self.in_features, self.out_features = int(in_features), int(out_features)
        layout = self._resolve_layout(density, layout, block_size, seed)
        self.block_size = layout.block_size
        self.weight = nn.Parameter(torch.empty(layout.w_shape, **factory))
        self.bias = nn.Parameter(torch.empty(self.out_features, **factory)) if bias else None
        self.register_buffer("block_mask", torch.empty(layout.shape, dtype=torch.bool, device=device))
        self.register_buffer("block_coords", torch.empty((0, 2), dtype=torch.long, device=device),
                             persistent=False)
        self.set_layout(layout)
        self.reset_parameters()
        self._grow_scores_wanted = False  # set by `BlockRegrowth` for the backward before a regrowth
        self._grow_scores = None  # then the dense gradient's block norms, (in/bs, out/bs)

    def _resolve_layout(self, density, layout, block_size, seed):
        if (density is None) == (layout is None):
            raise ValueError("density, layout: expected exactly one of them")
        grid_of = lambda bs: (self.in_features // bs, self.out_features // bs)  # noqa: E731
        if layout is None:
            bs = check_block_size(block_size)
            self._check_divisible(bs)
            if not 0 < float(density) <= 1:
                raise ValueError(f"density: expected a number in (0, 1], got {density!r}")
            return BlockLayout.random(grid_of(bs), float(density), seed=seed, block_size=bs)
        if not isinstance(layout, BlockLayout):
            layout = BlockLayout(np.asarray(torch.as_tensor(layout).cpu()), block_size)
        self._check_divisible(layout.block_size)
        if layout.shape != grid_of(layout.block_size):
            raise ValueError(f"layout: expected a grid of {grid_of(layout.block_size)} blocks of "
                             f"{layout.block_size} for {self.in_features} -> {self.out_features}, got {layout.shape}")
        return layout

    def _check_divisible(self, bs):
        if self.in_features % bs or self.out_features % bs:
            raise ValueError(f"in_features, out_features: expected multiples of block_size {bs}, "
                             f"got {self.in_features} and {self.out_features}")

    # -- layout ------------------------------------------------------------------------------

    @property
    def layout(self):
        return self._layout

    @property
    def n_blocks(self):
        return self._layout.n_blocks

    @property
    def density(self):
        return self._layout.density

    def set_layout(self, layout):
        """Take ``layout`` (same grid and block size; `BlockRegrowth` moves the weights). If its block
        count differs, ``weight`` is resized in place (its values are then undefined)."""
        check_layout(layout)
        if layout.block_size != self.block_size or layout.shape != tuple(self.block_mask.shape):
            raise ValueError(f"layout: expected a grid of {tuple(self.block_mask.shape)} blocks of "
                             f"{self.block_size}, got {layout.shape} blocks of {layout.block_size}")
        device = self.block_mask.device
        self._layout = layout
        self._layout_key = ops.layout_key(layout)
        self.block_mask.copy_(torch.tensor(layout.mask))
        self.block_coords = torch.tensor(layout.coords, dtype=torch.long, device=device)
        if self.weight.shape != layout.w_shape:
            with torch.no_grad():
                self.weight.data = self.weight.new_empty(layout.w_shape)

    # -- nn.Linear -----------------------------------------------------------------------------

    def reset_parameters(self):
        """``nn.Linear``'s uniform init with the fan-in an output has: ``in_features`` x density."""
        fan_in = max(1.0, self.n_blocks * self.block_size * self.block_size / self.out_features)
        bound = 1.0 / math.sqrt(fan_in)
        with torch.no_grad():
            self.weight.uniform_(-bound, bound)
            if self.bias is not None:
                self.bias.uniform_(-bound, bound)

    def forward(self, input):
        if input.shape[-1] != self.in_features:
            raise ValueError(f"input: expected {self.in_features} features on the last axis, "
                             f"got shape {tuple(input.shape)}")
        rows = input.dim() == 2  # (the common case: no reshape either way)
        x = input if rows else input.reshape(-1, self.in_features)
        w, bias = self.weight, self.bias
        on_cpu = cpu.takes(x)
        kind = x.device.type
        if torch.is_autocast_enabled(kind):
            dtype = torch.get_autocast_dtype(kind)
            x = x.to(dtype)
            # (the kernels take an fp32 weight and bias as they are: their gradients come back fp32)
            if w.dtype != torch.float32 or on_cpu:
                w = w.to(dtype)
            if bias is not None and (bias.dtype != torch.float32 or on_cpu):
                bias = bias.to(dtype)
        elif x.dtype != w.dtype:
            raise TypeError(f"input: expected dtype {w.dtype} (the weight's), got {x.dtype}")
        x = x.contiguous()
        relu = self.activation == "relu"
        if on_cpu:
            y = cpu.product(x, w, self.block_coords, tuple(self.block_mask.shape))
            y = y if bias is None else y + bias
            y = torch.relu(y) if relu else y
        else:  # (the kernels add the bias and take the ReLU: version 7 before rounding its output)
            y = ops.product(x, w, self._layout_key, bias, relu)
        if self._grow_scores_wanted and y.requires_grad:
            y.register_hook(self._keep_grow_scores(x, y if relu else None))
        return y if rows else y.reshape(*input.shape[:-1], self.out_features)

    def _keep_grow_scores(self, x, relu_out=None):
        """A hook on the product's gradient dy: add the block norms of the dense gradient xᵀ·dy
        (with a fused ReLU, dy through the ReLU's backward first: ``relu_out``, its output)."""
        def hook(dy):
            if relu_out is not None:
                dy = torch.ops.aten.threshold_backward(dy, relu_out.detach(), 0)
            dense = x.detach().t().float() @ dy.detach().float()
            scores = block_norms(dense, self.block_size)
            self._grow_scores = scores if self._grow_scores is None else self._grow_scores + scores

        return hook

    def extra_repr(self):
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, block_size={self.block_size}, "
                f"n_blocks={self.n_blocks}, density={self.density:.3g}"
                + ("" if self.activation is None else f", activation={self.activation!r}"))

    def to_dense(self):
        """The dense weight as ``nn.Linear`` holds it: (out_features, in_features), zeros outside
        the layout."""
        bs = self.block_size
        Cb, Kb = self.block_mask.shape
        blocks = self.weight.new_zeros((Cb, Kb, bs, bs))
        blocks[self.block_coords[:, 0], self.block_coords[:, 1]] = self.weight.detach()
        return blocks.permute(0, 2, 1, 3).reshape(self.in_features, self.out_features).t().contiguous()

    @classmethod
    def from_dense(cls, linear, density, block_size=32, criterion="l2", rescale=False, activation=None):
        """A `BlockSparseLinear` holding the ``round(density x blocks)`` blocks of ``linear``'s
        weight of largest norm (`block_norms`' ``criterion``; ties to the lower block), with its
        bias (and ``activation``, the constructor's). ``rescale=True`` scales the kept weights so
        that their Frobenius norm is the whole weight's."""
        if not isinstance(linear, nn.Linear):
            raise TypeError(f"linear: expected an nn.Linear, got {type(linear).__name__}")
        if not 0 < float(density) <= 1:
            raise ValueError(f"density: expected a number in (0, 1], got {density!r}")
        bs = check_block_size(block_size)
        weight = linear.weight.detach()
        out_features, in_features = weight.shape
        if in_features % bs or out_features % bs:
            raise ValueError(f"linear: expected features that are multiples of block_size {bs}, "
                             f"got {in_features} -> {out_features}")
        scores = block_norms(weight, bs, criterion).t()  # (in/bs, out/bs), the layout's grid
        count = max(1, int(round(float(density) * scores.numel())))
        layout = BlockLayout(top_blocks(scores, count).cpu().numpy(), bs)
        layer = cls(in_features, out_features, bias=linear.bias is not None, layout=layout,
                    device=weight.device, dtype=weight.dtype, activation=activation)
        with torch.no_grad():
            dense = weight.t().reshape(in_features // bs, bs, out_features // bs, bs).permute(0, 2, 1, 3)
            kept = dense[layer.block_coords[:, 0], layer.block_coords[:, 1]]
            if rescale:
                kept = kept * (weight.norm() / kept.norm().clamp_min(torch.finfo(kept.dtype).tiny))
            layer.weight.copy_(kept)
            if linear.bias is not None:
                layer.bias.copy_(linear.bias)
        return layer

    # -- state dict ----------------------------------------------------------------------------

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                              unexpected_keys, error_msgs):
        mask = state_dict.get(prefix + "block_mask")
        weight = state_dict.get(prefix + "weight")
        if mask is not None:
            mask = torch.as_tensor(mask).bool()
            expected = tuple(self.block_mask.shape)
            if tuple(mask.shape) != expected:
                error_msgs.append(f"{prefix}block_mask: expected a layout of {expected} blocks of "
                                  f"{self.block_size} ({self.in_features} -> {self.out_features}), "
                                  f"got {tuple(mask.shape)}")
                return
            n_blocks = int(mask.sum())
            if weight is not None and tuple(weight.shape) != (n_blocks, self.block_size, self.block_size):
                error_msgs.append(f"{prefix}weight: expected shape {(n_blocks, self.block_size, self.block_size)} "
                                  f"for its block_mask's {n_blocks} blocks, got {tuple(weight.shape)}")
                return
            self.set_layout(BlockLayout(mask.cpu().numpy(), self.block_size))
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys,
                                      unexpected_keys, error_msgs)
