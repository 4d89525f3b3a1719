"""`sparsify`: replace a model's ``nn.Linear`` modules by `BlockSparseLinear` ones, by name.

    replaced = sparsify(model, [r"encoder\\..*\\.linear[12]"], density=0.25, block_size=32)

Each ``nn.Linear`` whose qualified name (``model.named_modules()``) matches one of the patterns
(`re.fullmatch`) becomes `BlockSparseLinear.from_dense` of it: its layout keeps the blocks of the
trained weight with the largest norm, not random ones. ``patterns`` may map each pattern to its
own density. Returns ``{name: the nn.Linear it replaced}``; other modules are left as they are.

``fuse_relu=True``: a replaced layer followed in an ``nn.Sequential`` by an ``nn.ReLU`` takes
the ReLU (``activation="relu"``: in its product's epilogue), and the ``nn.ReLU`` becomes an
``nn.Identity`` (the model computes the same; names and state-dict keys stay).
"""

import re

from torch import nn

from .linear import BlockSparseLinear


def sparsify(model, patterns, density=None, block_size=32, criterion="l2", rescale=False, fuse_relu=False):
    if isinstance(patterns, str):
        patterns = [patterns]
    if isinstance(patterns, dict):
        rules = [(re.compile(p), d) for p, d in patterns.items()]
    else:
        if density is None:
            raise ValueError("density: expected a number in (0, 1] (or patterns as {pattern: density})")
        rules = [(re.compile(p), density) for p in patterns]
    chosen = []
    for name, module in model.named_modules():
        if type(module) is not nn.Linear:  # (subclasses such as attention's out_proj are read by their owners)
            continue
        for pattern, layer_density in rules:
            if pattern.fullmatch(name):
                chosen.append((name, module, layer_density))
                break
    replaced = {}
    for name, module, layer_density in chosen:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        relu = _following_relu(parent, child) if fuse_relu else None
        try:
            sparse = BlockSparseLinear.from_dense(module, layer_density, block_size, criterion, rescale,
                                                  activation=None if relu is None else "relu")
        except ValueError as error:
            raise ValueError(f"{name}: {error}") from None
        setattr(parent, child, sparse)
        if relu is not None:
            setattr(parent, relu, nn.Identity())
        replaced[name] = module
        if isinstance(parent, nn.TransformerEncoderLayer) and not getattr(parent, "_sparse_layers", False):
            # Its inference fast path hands linear1/linear2's weights to one fused kernel as dense
            # matrices; a module with a forward hook never takes it.
            parent.register_forward_pre_hook(_keep_layers_called)
            parent._sparse_layers = True
    return replaced


def _following_relu(parent, child):
    """The name of the ``nn.ReLU`` right after ``child`` in ``parent`` (an ``nn.Sequential``), or None."""
    if not isinstance(parent, nn.Sequential):
        return None
    names = list(parent._modules)
    at = names.index(child) + 1
    return names[at] if at < len(names) and type(parent._modules[names[at]]) is nn.ReLU else None


def _keep_layers_called(module, args):
    return None
