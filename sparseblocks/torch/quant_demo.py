"""``python -m sparseblocks quant-demo``: an MLP and a CNN on scikit-learn's digits, in float and low-bit.

The same MLP (``64 -> H -> H -> 10``, ReLUs) three times: with ``nn.Linear`` layers, and with
`LQLinear` layers whose weights and activations are quantized to 2 bits and to 1 bit (the input
layer stays float, as in LQ-Nets; the hidden activations are post-ReLU, 0/1 codes). Then a small
CNN on the 8 x 8 images (a float 3 x 3 convolution, two 3 x 3 convolutions each followed by a
2 x 2 max-pool, a float linear classifier) with ``nn.Conv2d`` and with W2A2 `QuantConv2d` in the
middle. Prints each model's test accuracy beside its float twin's, evaluated without gradients:
on a GPU the quantized models then run the packed bit-plane products and convolutions. Without a
GPU it trains fewer steps on the CPU (the quantizers are torch operations there).
"""

import numpy as np
import torch
from torch import nn

from .demo import accuracy, progress_bar, setup, train
from .quant import LQLinear, QuantConv2d

FULL = {"hidden": 512, "channels": 64, "steps": 1500, "batch": 128}
SMALL = {"hidden": 64, "channels": 16, "steps": 300, "batch": 64}
MODELS = {"float": None, "W2A2": (2, 2), "W1A1": (1, 1), "CNN float": None, "CNN W2A2": (2, 2)}


def mlp(hidden, bits, device):
    def layer(inputs, outputs):
        if bits is None:
            return nn.Linear(inputs, outputs, device=device)
        return LQLinear(inputs, outputs, w_bits=bits[0], a_bits=bits[1], device=device)

    return nn.Sequential(nn.Linear(64, hidden, device=device), nn.ReLU(), layer(hidden, hidden), nn.ReLU(),
                         layer(hidden, 10))


def cnn(channels, bits, device):
    """8 x 8 digits -> 3 x 3 float conv -> two 3 x 3 convs (W2A2 with ``bits``), each pooled 2 x 2
    -> a float linear classifier."""
    def conv(inputs, outputs):
        if bits is None:
            return nn.Conv2d(inputs, outputs, 3, padding=1, device=device)
        return QuantConv2d(inputs, outputs, 3, padding=1, w_bits=bits[0], a_bits=bits[1], device=device)

    return nn.Sequential(nn.Unflatten(1, (1, 8, 8)), nn.Conv2d(1, channels, 3, padding=1, device=device), nn.ReLU(),
                         conv(channels, 2 * channels), nn.ReLU(), nn.MaxPool2d(2),
                         conv(2 * channels, 2 * channels), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(),
                         nn.Linear(8 * channels, 10, device=device))


def main(size=None):
    from ..runtime.backend import SIMULATOR

    ready = setup("quant-demo", size, SMALL, FULL, "fewer steps, on the CPU")
    if ready is None:
        return 1
    data, size, device = ready
    print(f"digits: MLP 64 -> {size['hidden']} -> {size['hidden']} -> 10 and a CNN of {size['channels']}, "
          f"{2 * size['channels']} and {2 * size['channels']} channels, {size['steps']} steps of {size['batch']}")
    results = {}
    for name, bits in MODELS.items():
        torch.manual_seed(0)
        model = cnn(size["channels"], bits, device) if name.startswith("CNN") else mlp(size["hidden"], bits, device)
        optimizer = torch.optim.AdamW(model.parameters(), lr=2e-3)
        losses, per_step = train(model, optimizer, data, size["steps"], size["batch"], device, progress_bar(name))
        model.eval()
        results[name] = (accuracy(model, data, device), per_step, losses)
    for name, (acc, per_step, _) in results.items():
        gap = results["CNN float" if name.startswith("CNN") else "float"][0] - acc
        print(f"{name:>9}: test accuracy {acc:.1%} ({100 * gap:+.1f} points below float), "
              f"{per_step * 1e3:.2f} ms a training step")
    pairs = (("float", "W2A2"), ("CNN float", "CNN W2A2"))
    close = all(results[base][0] - results[low][0] <= 0.02 for base, low in pairs)
    ok = all(np.isfinite(r[2]).all() for r in results.values()) and (SIMULATOR or close)
    print("quant-demo passed" if ok else "quant-demo failed")
    return 0 if ok else 1
