"""``python -m sparseblocks demo``: a block-sparse MLP trained beside the same MLP dense.

The data are scikit-learn's handwritten digits (8 x 8 images, 10 classes; they ship with it).
Both models: ``Linear(64, H)``, two hidden ``H x H`` layers, ``Linear(H, 10)``, ReLUs between;
in the sparse one the hidden layers are `BlockSparseLinear` at ``density``, their layouts moved
by `BlockRegrowth` as it trains. Prints test accuracy, time per step and each layer's density,
and writes a PNG with both loss curves and the layouts before and after regrowth. On a GPU it
runs full size; without one, a laptop size on the CPU path (torch's operations,
`sparseblocks.torch.cpu`), or a small version on the kernels in the CUDA simulator where
``SPARSEBLOCKS_CPU_KERNELS=1`` asks for them.

The digits model is too small for block sparsity to pay: its steps are host time. So on a GPU the
demo then times where it does pay (`timed_steps`): an AdamW training step of a bf16 transformer
FFN (``4096 -> 16384 -> 4096``, 8192 tokens) dense and with `BlockSparseLinear` layers at 10 % and
25 % (blocks of 128), eager and under `torch.compile`, and prints each beside the dense step.
"""

import sys
import time

import numpy as np
import torch
from torch import nn

from .linear import BlockSparseLinear
from .regrow import BlockRegrowth

FULL = {"hidden": 1024, "block_size": 32, "steps": 600, "batch": 128, "every": 50, "fraction": 0.3}
LAPTOP = {"hidden": 256, "block_size": 16, "steps": 600, "batch": 64, "every": 50, "fraction": 0.3}
SMALL = {"hidden": 32, "block_size": 8, "steps": 12, "batch": 32, "every": 4, "fraction": 0.5}


def digits(seed=0):
    """(x_train, y_train, x_test, y_test) as tensors: 80 % / 20 %, features scaled to [0, 1]."""
    from sklearn.datasets import load_digits

    data = load_digits()
    x = data.data.astype(np.float32) / 16
    order = np.random.default_rng(seed).permutation(len(x))
    split = int(0.8 * len(x))
    train, test = order[:split], order[split:]
    as_tensor = torch.from_numpy
    return (as_tensor(x[train]), as_tensor(data.target[train]), as_tensor(x[test]),
            as_tensor(data.target[test]))


def mlp(hidden, block_size=None, density=None, device="cpu"):
    """The MLP; with ``density`` its hidden layers are block-sparse."""
    def hidden_layer():
        if density is None:
            return nn.Linear(hidden, hidden, device=device)
        return BlockSparseLinear(hidden, hidden, density=density, block_size=block_size, device=device)

    return nn.Sequential(nn.Linear(64, hidden, device=device), nn.ReLU(), hidden_layer(), nn.ReLU(),
                         hidden_layer(), nn.ReLU(), nn.Linear(hidden, 10, device=device))


def train(model, optimizer, data, steps, batch, device, progress=None, seed=0):
    """``steps`` AdamW steps on random batches; returns (losses, seconds a step)."""
    x, y = data[0].to(device), data[1].to(device)
    generator = torch.Generator().manual_seed(seed)
    losses = []
    synchronize = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    start = None
    for step in range(steps):
        if step == 1:  # the first step compiles the kernels: time the rest
            synchronize()
            start = time.perf_counter()
        rows = torch.randint(0, len(x), (batch,), generator=generator).to(device)
        loss = nn.functional.cross_entropy(model(x[rows]), y[rows])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
        if progress:
            progress(step + 1, steps, losses[-1])
    synchronize()
    per_step = (time.perf_counter() - start) / max(1, steps - 1) if start else float("nan")
    return losses, per_step


def accuracy(model, data, device):
    with torch.no_grad():
        return float((model(data[2].to(device)).argmax(1).cpu() == data[3]).float().mean())


def progress_bar(name):
    def show(step, steps, loss):
        filled = 30 * step // steps
        sys.stderr.write(f"\r{name:>6} [{'#' * filled}{'.' * (30 - filled)}] {step}/{steps} loss {loss:.3f}")
        if step == steps:
            sys.stderr.write("\n")
        sys.stderr.flush()

    return show


def plot(path, dense_losses, sparse_losses, layouts_before, layouts_after):
    """Loss curves and the hidden layers' layouts before and after regrowth, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = len(layouts_before)
    figure, axes = plt.subplots(1, 1 + 2 * n, figsize=(4 + 3 * 2 * n, 3.6),
                                gridspec_kw={"width_ratios": [2] + [1] * 2 * n})
    axes[0].plot(dense_losses, label="dense", lw=1)
    axes[0].plot(sparse_losses, label="block-sparse", lw=1)
    axes[0].set(xlabel="step", ylabel="training loss", yscale="log", title="loss")
    axes[0].legend()
    for i, (before, after) in enumerate(zip(layouts_before, layouts_after)):
        for ax, mask, when in ((axes[1 + 2 * i], before, "start"), (axes[2 + 2 * i], after, "end")):
            ax.imshow(mask, cmap="Greys", interpolation="nearest")
            ax.set(title=f"hidden {i + 1}, {when}", xticks=[], yticks=[])
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def setup(name, size, small, full, simulated, laptop=None):
    """(digits data, size, device) for a demo, after saying where it runs; None (said why)
    without scikit-learn. Without a GPU: ``laptop`` (a size for the CPU path, where the demo's
    layers have one and it is not turned off), else ``small`` (the kernels in the simulator)."""
    from ..runtime.backend import SIMULATOR, backend_name
    from .cpu import takes

    try:
        data = digits()
    except ImportError:
        print(f"{name} needs scikit-learn (its digits data set): pip install 'sparseblocks[demo]'")
        return None
    if not SIMULATOR:
        print(f"backend: {backend_name()}")
        return data, size or full, "cuda"
    if laptop is not None and takes(torch.empty(0)):
        print("backend: CPU, torch's operations (no CUDA GPU; SPARSEBLOCKS_CPU_KERNELS=1 runs the kernels "
              "in the simulator instead)")
        return data, size or laptop, "cpu"
    print(f"backend: {backend_name()} ({simulated})")
    return data, size or small, "cpu"


FFN = {"width": 4096, "hidden": 16384, "tokens": 8192, "block_size": 128, "densities": (0.1, 0.25)}


def step_ms(step, device, steps=10, warmup=3):
    """Median milliseconds of ``step()`` over ``steps`` calls after ``warmup`` (CUDA events where
    ``device`` is a GPU, the host's clock otherwise)."""
    for _ in range(warmup):
        step()
    times = []
    for _ in range(steps):
        if torch.device(device).type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            step()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            begin = time.perf_counter()
            step()
            times.append(1e3 * (time.perf_counter() - begin))
    return float(np.median(times))


def ffn(width, hidden, density, block_size, device, dtype):
    """``width -> hidden -> width`` with a GELU, dense (``density`` None) or block-sparse."""
    def layer(inputs, outputs):
        if density is None:
            return nn.Linear(inputs, outputs, device=device, dtype=dtype)
        return BlockSparseLinear(inputs, outputs, density=density, block_size=block_size, device=device, dtype=dtype)

    return nn.Sequential(layer(width, hidden), nn.GELU(), layer(hidden, width))


def timed_steps(size=FFN, device="cuda", dtype=torch.bfloat16, compiled=True, steps=10):
    """{(name, "eager" | "compiled"): ms} of an AdamW step (forward, backward, update) of the FFN
    dense and at each of ``size["densities"]``, the same tokens and target for all."""
    generator = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(size["tokens"], size["width"], device=device, dtype=dtype, generator=generator)
    target = torch.randn(size["tokens"], size["width"], device=device, dtype=dtype, generator=generator)
    results = {}
    for density in (None, *size["densities"]):
        name = "dense" if density is None else f"{density:.0%}"
        torch.manual_seed(0)
        model = ffn(size["width"], size["hidden"], density, size["block_size"], device, dtype)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        for mode in ("eager", "compiled") if compiled else ("eager",):
            forward = torch.compile(model, fullgraph=True) if mode == "compiled" else model
            results[name, mode] = step_ms(training_step(forward, optimizer, x, target), device, steps)
        del model, optimizer
    return results


def training_step(forward, optimizer, x, target):
    def step():
        loss = nn.functional.mse_loss(forward(x), target)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def print_steps(results, size=FFN):
    print(f"where block sparsity pays: an AdamW step of a bf16 FFN {size['width']} -> {size['hidden']} -> "
          f"{size['width']}, {size['tokens']} tokens, blocks of {size['block_size']} (median of 10 steps)")
    for (name, mode), ms in results.items():
        dense = results["dense", mode]
        print(f"{name:>6} {mode:>8}: {ms:8.2f} ms" + ("" if name == "dense" else f"  {dense / ms:.2f}x dense's"))


def main(density=0.25, png="demo.png", size=None):
    from ..runtime.backend import SIMULATOR

    ready = setup("demo", size, SMALL, FULL, "a small model: the simulator is slow", LAPTOP)
    if ready is None:
        return 1
    data, size, device = ready
    print(f"digits: {len(data[0])} training and {len(data[2])} test images; MLP 64 -> {size['hidden']} -> "
          f"{size['hidden']} -> {size['hidden']} -> 10, hidden layers at {density:.0%} in blocks of "
          f"{size['block_size']}, {size['steps']} steps of {size['batch']}")
    results = {}
    for name in ("dense", "sparse"):
        torch.manual_seed(0)
        model = mlp(size["hidden"], size["block_size"], None if name == "dense" else density, device)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        layers = [m for m in model if isinstance(m, BlockSparseLinear)]
        before = [layer.block_mask.cpu().numpy().copy() for layer in layers]  # (a CPU mask changes in place)
        if layers:
            optimizer = BlockRegrowth(optimizer, model, every=size["every"], fraction=size["fraction"],
                                      until=int(0.75 * size["steps"]))
        losses, per_step = train(model, optimizer, data, size["steps"], size["batch"], device, progress_bar(name))
        results[name] = (model, losses, per_step, accuracy(model, data, device), before,
                         [layer.block_mask.cpu().numpy() for layer in layers])
    for name, (model, losses, per_step, acc, before, after) in results.items():
        densities = ", ".join(f"{getattr(m, 'density', 1.0):.0%}" for m in model if hasattr(m, "weight"))
        print(f"{name:>6}: test accuracy {acc:.1%}, {per_step * 1e3:.2f} ms a step, layer densities {densities}")
    moved = [int((b != a).sum()) // 2 for b, a in zip(results["sparse"][4], results["sparse"][5])]
    print(f"blocks moved by regrowth (start -> end), per hidden layer: {moved}")
    gap = results["dense"][3] - results["sparse"][3]
    print(f"accuracy gap to dense: {100 * gap:.1f} points")
    try:
        plot(png, results["dense"][1], results["sparse"][1], results["sparse"][4], results["sparse"][5])
        print(f"wrote {png}")
    except ImportError:
        print("no PNG: matplotlib is not installed (pip install 'sparseblocks[demo]')")
    if device == "cuda":
        print_steps(timed_steps())
    simulated = SIMULATOR and device == "cpu" and size["hidden"] <= SMALL["hidden"]  # (too few steps to judge)
    ok = all(np.isfinite(r[1]).all() for r in results.values()) and (simulated or gap <= (0.01 if device == "cuda" else 0.02))
    print("demo passed" if ok else "demo failed")
    return 0 if ok else 1
