"""`BlockRegrowth`: prune and regrow a model's block-sparse layers while it trains.

    optimizer = BlockRegrowth(torch.optim.AdamW(model.parameters()), model, every=100, fraction=0.3)
    for x, target in data:
        loss_fn(model(x), target).backward()
        optimizer.step()          # the wrapped optimizer's step, and every `every` steps a regrowth
        optimizer.zero_grad()

A regrowth, in each `BlockSparseLinear` of the model: drop the ``fraction`` of its blocks of
lowest weight norm, and grow as many among the blocks absent before it: where the dense gradient's
block norm is largest (``grow="gradient"``, RigL; the dense gradient ``xᵀ·dy`` of the step before
is reduced to block norms by `block_norms`, then dropped), or at random (``grow="random"``). The
block count stays, so the weight keeps its shape and the optimizer keeps its parameters. Kept
blocks move with their weights and optimizer state (Adam's moments, momentum: every state tensor
of the weight's shape); grown blocks start at zero, with zero state. The choice is made on the
device; only the block mask (``(in/bs, out/bs)`` booleans) goes to the host to build the layout.
``fraction`` decays to zero along a cosine by step ``until`` (None: constant). Under
`torch.distributed`, every rank adds up its gradient scores first, so all make the same choice.
"""

import math

import torch

from ..layout import BlockLayout
from .linear import BlockSparseLinear, top_blocks

GROW = ("gradient", "random")


class BlockRegrowth:
    def __init__(self, optimizer, model, every=100, fraction=0.3, grow="gradient", until=None,
                 criterion="l2", seed=0):
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"optimizer: expected a torch.optim.Optimizer, got {type(optimizer).__name__}")
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ValueError(f"every: expected a positive int, got {every!r}")
        if not 0 <= float(fraction) <= 1:
            raise ValueError(f"fraction: expected a number in [0, 1], got {fraction!r}")
        if grow not in GROW:
            raise ValueError(f"grow: expected one of {GROW}, got {grow!r}")
        self.optimizer, self.every, self.fraction, self.grow = optimizer, every, float(fraction), grow
        self.until, self.criterion = until, criterion
        self.layers = [m for m in model.modules() if isinstance(m, BlockSparseLinear)]
        if not self.layers:
            raise ValueError("model: expected at least one BlockSparseLinear")
        self.steps = 0
        self._generator = torch.Generator().manual_seed(seed)
        self._arm()

    # the wrapped optimizer's interface
    @property
    def param_groups(self):
        return self.optimizer.param_groups

    @property
    def state(self):
        return self.optimizer.state

    def zero_grad(self, set_to_none=True):
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def state_dict(self):
        return {"optimizer": self.optimizer.state_dict(), "steps": self.steps}

    def load_state_dict(self, state):
        self.optimizer.load_state_dict(state["optimizer"])
        self.steps = state["steps"]

    def current_fraction(self):
        """The fraction of blocks the next regrowth moves."""
        if self.until is None:
            return self.fraction
        if self.steps >= self.until:
            return 0.0
        return self.fraction * 0.5 * (1 + math.cos(math.pi * self.steps / self.until))

    def step(self, closure=None):
        loss = self.optimizer.step(closure)
        self.steps += 1
        if self.steps % self.every == 0:
            fraction = self.current_fraction()
            for layer in self.layers:
                self.regrow(layer, fraction)
        self._arm()
        return loss

    def _arm(self):
        """Have the layers keep the next backward's dense-gradient block norms before a regrowth."""
        wanted = self.grow == "gradient" and (self.steps + 1) % self.every == 0
        for layer in self.layers:
            layer._grow_scores_wanted = wanted
            if not wanted:
                layer._grow_scores = None

    @torch.no_grad()
    def regrow(self, layer, fraction):
        """Move ``round(fraction x n_blocks)`` of ``layer``'s blocks; returns how many moved."""
        weight = layer.weight
        n_blocks = layer.n_blocks
        absent = ~layer.block_mask
        moved = min(int(round(fraction * n_blocks)), int(absent.sum()))
        if moved == 0:
            return 0
        if self.grow == "gradient":
            scores = layer._grow_scores
            if scores is None:
                raise RuntimeError("BlockRegrowth: no gradient scores; call step() after each backward")
            if torch.distributed.is_available() and torch.distributed.is_initialized():
                torch.distributed.all_reduce(scores)
        else:
            scores = torch.rand(absent.shape, generator=self._generator).to(absent.device)
        scores = scores.float().masked_fill(~absent, -math.inf)
        grown = top_blocks(scores, moved)
        kept_norms = weight.detach().float().abs()
        kept_norms = (kept_norms * kept_norms).sum(dim=(1, 2))
        dropped = ~top_blocks(kept_norms, n_blocks - moved)  # the `moved` blocks of lowest norm
        mask = layer.block_mask.clone()
        mask[layer.block_coords[dropped, 0], layer.block_coords[dropped, 1]] = False
        mask |= grown
        # Where each block of the new layout comes from: its old block number, or -1 (grown).
        source = torch.full(mask.shape, -1, dtype=torch.long, device=mask.device)
        kept = ~dropped
        source[layer.block_coords[kept, 0], layer.block_coords[kept, 1]] = torch.nonzero(kept).flatten()
        layout = BlockLayout(mask.cpu().numpy(), layer.block_size)  # (the only copy to the host)
        layer.set_layout(layout)
        source = source[layer.block_coords[:, 0], layer.block_coords[:, 1]]
        for tensor in (weight, weight.grad, *self.optimizer.state.get(weight, {}).values()):
            if isinstance(tensor, torch.Tensor) and tensor.shape == weight.shape:
                tensor.copy_(_moved(tensor, source))
        layer._grow_scores = None
        return moved


def _moved(tensor, source):
    """``tensor``'s blocks in a new order (``source[b]``: the old block of new block b, or -1: zeros)."""
    picked = tensor[source.clamp(min=0)]
    return torch.where((source >= 0).view(-1, 1, 1), picked, torch.zeros_like(picked))
