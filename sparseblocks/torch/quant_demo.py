"""``python -m sparseblocks quant-demo``: an MLP on scikit-learn's digits in float, W2A2 and W1A1.

The same MLP (``64 -> H -> H -> 10``, ReLUs) three times: with ``nn.Linear`` layers, and with
`LQLinear` layers whose weights and activations are quantized to 2 bits and to 1 bit (the input
layer stays float, as in LQ-Nets; the hidden activations are post-ReLU, 0/1 codes). Prints
each model's test accuracy beside float's, evaluated without gradients: on a GPU the quantized
models then run the packed bit-plane product. Without a GPU it trains fewer steps on the CPU
(the quantizers are torch operations there).
"""

import numpy as np
import torch
from torch import nn

from .demo import accuracy, progress_bar, setup, train
from .quant import LQLinear

FULL = {"hidden": 512, "steps": 1500, "batch": 128}
SMALL = {"hidden": 64, "steps": 300, "batch": 64}
MODELS = {"float": None, "W2A2": (2, 2), "W1A1": (1, 1)}


def mlp(hidden, bits, device):
    def layer(inputs, outputs):
        if bits is None:
            return nn.Linear(inputs, outputs, device=device)
        return LQLinear(inputs, outputs, w_bits=bits[0], a_bits=bits[1], device=device)

    return nn.Sequential(nn.Linear(64, hidden, device=device), nn.ReLU(), layer(hidden, hidden), nn.ReLU(),
                         layer(hidden, 10))


def main(size=None):
    from ..runtime.backend import SIMULATOR

    ready = setup("quant-demo", size, SMALL, FULL, "fewer steps, on the CPU")
    if ready is None:
        return 1
    data, size, device = ready
    print(f"digits: MLP 64 -> {size['hidden']} -> {size['hidden']} -> 10, {size['steps']} steps of {size['batch']}")
    results = {}
    for name, bits in MODELS.items():
        torch.manual_seed(0)
        model = mlp(size["hidden"], bits, device)
        optimizer = torch.optim.AdamW(model.parameters(), lr=2e-3)
        losses, per_step = train(model, optimizer, data, size["steps"], size["batch"], device, progress_bar(name))
        model.eval()
        results[name] = (accuracy(model, data, device), per_step, losses)
    for name, (acc, per_step, _) in results.items():
        gap = results["float"][0] - acc
        print(f"{name:>6}: test accuracy {acc:.1%} ({100 * gap:+.1f} points below float), "
              f"{per_step * 1e3:.2f} ms a training step")
    ok = all(np.isfinite(r[2]).all() for r in results.values()) and (
        SIMULATOR or results["float"][0] - results["W2A2"][0] <= 0.02)
    print("quant-demo passed" if ok else "quant-demo failed")
    return 0 if ok else 1
