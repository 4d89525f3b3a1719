"""Settings of the NCHW fp16 pair kernels side by side on the GPU (a developer's script).

    python3 scripts/pair_variants.py [--block-only] [--scatters] [--profile] ["PAIR_HALVES=2" ...]

Each argument is one variant: settings of `sparseblocks.kernels.sbnet`, `;`-separated (default:
words of two halves against words of four). For each variant and each configuration (N x C x 400
x 700 fp16 NCHW at a fraction of SparseResBlock's windows active) it checks the gather of the
block's input windows (18 every 16 from -1), of its output windows (16 every 16), the in-place
adding scatter of the latter and the atomic add of the former (the block's backward) against the
reference, then times their CUDA-graph replays beside a device
copy of as many bytes (as benchmarks/bench_sbnet.py's NCHW rows), and the block itself on that
NCHW input (fp16, 256 -> 64, graph). Prints µs and copy / ours. ``--block-only``: the block
alone; ``--scatters``: no gathers timed; ``--profile``: each variant's kernels in the block at half
the windows (torch's profiler, µs a call). The block is timed in place (forward) and in a training
step (into a copy, the input's gradient too).
"""

import ast
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench_sbnet import block_mask  # noqa: E402
from benchmarks.common import copy_ms, device_name, graph_ms  # noqa: E402

CONFIGS = [(1, 256, 0.1), (1, 256, 0.25), (1, 256, 0.5), (1, 64, 0.05), (8, 64, 0.5), (8, 256, 0.1)]
GATHER_AT = {"bsize": 18, "bstride": 16, "boffset": -1, "data_format": "NCHW"}
SCATTER_AT = {"bsize": 16, "bstride": 16, "boffset": 0, "data_format": "NCHW"}


def settings_of(text):
    return {name: ast.literal_eval(value) for name, value in (part.split("=") for part in text.split(";") if part)}


def use(sbnet, settings):
    """Set the module's settings and drop the kernels and plans made under others."""
    for name, value in settings.items():
        setattr(sbnet, name, value)
    sbnet._kernels.clear()
    sbnet._plans.clear()


def kernel_times(torch, fn, calls=5, top=10):
    """[(µs a call, launches a call, kernel)] of ``fn``'s kernels, longest first (torch's profiler)."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    rows = [(e.device_time_total / calls, e.count // calls, e.key) for e in prof.key_averages()
            if e.device_time_total > 0]
    return sorted(rows, reverse=True)[:top]


def main():
    import torch

    from sparseblocks import sbnet_torch
    from sparseblocks.kernels import sbnet
    from sparseblocks.reference import sbnet as reference

    flags = {a for a in sys.argv[1:] if a.startswith("--")}
    variants = [a for a in sys.argv[1:] if not a.startswith("--")] or ["PAIR_HALVES=2", "PAIR_HALVES=4"]
    defaults = {name: getattr(sbnet, name) for v in variants for name in settings_of(v)}
    rng = np.random.default_rng(0)
    rows, profiles = {}, {}
    print(f"{device_name()}: NCHW fp16 pair kernels, graph µs (copy / ours)")
    for n, C, fraction in [] if "--block-only" in flags else CONFIGS:
        mask = block_mask(rng, n, 400, 700, 16, fraction)
        want = reference.reduce_mask(mask, tol=0.5, bsize=16, bstride=16)
        idx = torch.as_tensor(want, device="cuda")
        x = torch.randn(n, C, 400, 700, device="cuda").half()
        y = torch.zeros_like(x)
        host = x.cpu().numpy()
        for variant in variants:
            use(sbnet, {**defaults, **settings_of(variant)})
            stack = sbnet.sparse_gather(x, idx, **GATHER_AT)
            np.testing.assert_array_equal(stack.cpu().numpy(), reference.sparse_gather(host, want, **GATHER_AT))
            outputs = sbnet.sparse_gather(x, idx, **SCATTER_AT)
            np.testing.assert_array_equal(outputs.cpu().numpy(), reference.sparse_gather(host, want, **SCATTER_AT))
            got = sbnet.sparse_scatter(outputs, idx, y, add=True, **SCATTER_AT)
            np.testing.assert_array_equal(got.cpu().numpy(), reference.sparse_scatter(
                outputs.cpu().numpy(), want, y.cpu().numpy(), add=True, **SCATTER_AT))
            atomic = sbnet.sparse_scatter(stack, idx, y, add=True, atomic=True, **GATHER_AT)
            np.testing.assert_allclose(atomic.cpu().numpy().astype(np.float64), reference.sparse_scatter(
                stack.cpu().numpy().astype(np.float64), want, y.cpu().numpy().astype(np.float64), add=True,
                **GATHER_AT), rtol=4e-3, atol=4e-3)
            for op, window_bytes, passes, fn in (
                    ("gather 18/16", stack.nbytes, 2, lambda: sbnet.sparse_gather(x, idx, **GATHER_AT)),
                    ("gather 16/16", outputs.nbytes, 2, lambda: sbnet.sparse_gather(x, idx, **SCATTER_AT)),
                    ("add scatter 16/16", outputs.nbytes, 3, lambda: sbnet.sparse_scatter(
                        outputs, idx, y, add=True, inplace=True, **SCATTER_AT)),
                    ("atomic add 18/16", stack.nbytes, 3, lambda: sbnet.sparse_scatter(
                        stack, idx, y, add=True, atomic=True, inplace=True, **GATHER_AT))):
                if "--scatters" in flags and "scatter" not in op and "atomic" not in op:
                    continue
                ms = graph_ms(fn)
                copy = copy_ms(passes * window_bytes // 2, graph=True)
                rows.setdefault((n, C, fraction, op), []).append(f"{ms * 1000:.1f} ({copy / ms:.2f})")
    torch.manual_seed(0)
    block = sbnet_torch.SparseResBlock(256, 64, block_size=16).to("cuda", torch.float16)
    x = torch.randn(1, 256, 400, 700, device="cuda", dtype=torch.float16)
    p = block.geometry(x.shape)
    xg, grad_y = x.clone().requires_grad_(True), torch.randn_like(x)

    def step(block, indices, count):
        xg.grad = None
        block.zero_grad(set_to_none=True)
        block(xg, indices, count).backward(grad_y)

    with torch.no_grad():
        for fraction in (0.1, 0.25, 0.5):
            chosen = np.argwhere(rng.random(p.bcount) < fraction)
            mask = np.zeros((1, 400, 700), np.float32)
            mask[0, p.boffset[0] + chosen[:, 0] * p.bstride[0] + p.bsize[0] // 2,
                 p.boffset[1] + chosen[:, 1] * p.bstride[1] + p.bsize[1] // 2] = 1
            indices, count = block.active_blocks(torch.as_tensor(mask, device="cuda"), tol=0.5)
            first = first_grad = None
            active = round(len(chosen) / (p.bcount[0] * p.bcount[1]), 3)
            for variant in variants:
                use(sbnet, {**defaults, **settings_of(variant)})
                out = block(x, indices, count)
                if first is None:
                    first = out
                assert torch.equal(out, first)  # (every variant: the same bits)
                work = x.clone()
                ms = graph_ms(lambda: block(work, indices, count, inplace=True))
                if "--profile" in flags and fraction == 0.5:
                    profiles[variant] = kernel_times(torch, lambda: block(work, indices, count, inplace=True))
                with torch.enable_grad():
                    step(block, indices, count)  # (atomic adds: the same gradient up to fp16's rounding)
                    if first_grad is None:
                        first_grad = xg.grad.clone()
                    assert ((xg.grad - first_grad).abs().max() / first_grad.abs().max()).item() < 1e-2
                    train_ms = graph_ms(lambda: step(block, indices, count))
                rows.setdefault((1, 256, active, "NCHW-input block"), []).append(f"{ms * 1000:.1f}")
                rows.setdefault((1, 256, active, "... training step"), []).append(f"{train_ms * 1000:.1f}")
    use(sbnet, defaults)
    for variant, kernels in profiles.items():
        print(f"--- {variant}: the NCHW-input block's kernels at half the windows, µs a call")
        for us, n, key in kernels:
            print(f"  {us:8.1f} x{n:<3d} {key[:100]}")
    print("| N | C | active | op | " + " | ".join(variants) + " |")
    print("|---" * (4 + len(variants)) + "|")
    for (n, C, fraction, op), cells in rows.items():
        print(f"| {n} | {C} | {fraction} | {op} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
