"""The kept plans: calls that repeat skip the general path.

A public function called with torch tensors runs the general path once
(operands, checks, kernel choice, argument fields: 30-100 µs of Python) and
keeps what it launched, as `launch.Replay` objects, under a key of everything
those checks depended on (op, config, shapes, dtypes, device, pointer
alignment, geometry). A later call with the same key allocates its outputs and
rewrites only the data pointers of the kept launches. Every op keeps its plans
in this one cache, under keys that start with the op's name.
"""

MAX_PLANS = 512  # past this many, the cache starts afresh

kept = {}


class _NoTensor:
    """Stands in for torch.Tensor until a plan exists (no call without torch finds a plan)."""


tensor = _NoTensor  # torch.Tensor once a plan is kept (torch is imported by then)


def watch_torch():
    """From now on, tell torch tensors by `tensor` (called as a first plan is made: torch is
    imported by then)."""
    global tensor
    import torch

    tensor = torch.Tensor


def keep(key, plan):
    """Keep `plan` under `key`."""
    watch_torch()
    if len(kept) >= MAX_PLANS:
        kept.clear()
    kept[key] = plan


def clear():
    """Forget every kept plan."""
    kept.clear()
