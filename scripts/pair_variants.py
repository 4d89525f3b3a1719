"""Settings of the NCHW fp16 pair kernels side by side on the GPU (a developer's script).

    python3 scripts/pair_variants.py ["PAIR_HALVES=2" "PAIR_HALVES=4;PAIR_MAX_REGISTERS=64" ...]

Each argument is one variant: settings of `sparseblocks.kernels.sbnet`, `;`-separated (default:
words of two halves against words of four). For each variant and each configuration (N x C x 400
x 700 fp16 NCHW at a fraction of SparseResBlock's windows active) it checks the gather of the
block's input windows (18 every 16 from -1) and the in-place adding scatter of its output
windows (16 every 16) against the reference, then times their CUDA-graph replays beside a device
copy of as many bytes (as benchmarks/bench_sbnet.py's NCHW rows), and the block itself on that
NCHW input (fp16, 256 -> 64, graph). Prints µs and copy / ours.
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


def main():
    import torch

    from sparseblocks import sbnet_torch
    from sparseblocks.kernels import sbnet
    from sparseblocks.reference import sbnet as reference

    variants = sys.argv[1:] or ["PAIR_HALVES=2", "PAIR_HALVES=4"]
    defaults = {name: getattr(sbnet, name) for v in variants for name in settings_of(v)}
    rng = np.random.default_rng(0)
    rows = {}
    print(f"{device_name()}: NCHW fp16 pair kernels, graph µs (copy / ours)")
    for n, C, fraction in CONFIGS:
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
            got = sbnet.sparse_scatter(outputs, idx, y, add=True, **SCATTER_AT)
            np.testing.assert_array_equal(got.cpu().numpy(), reference.sparse_scatter(
                outputs.cpu().numpy(), want, y.cpu().numpy(), add=True, **SCATTER_AT))
            for op, window_bytes, passes, fn in (
                    ("gather 18/16", stack.nbytes, 2, lambda: sbnet.sparse_gather(x, idx, **GATHER_AT)),
                    ("add scatter 16/16", outputs.nbytes, 3, lambda: sbnet.sparse_scatter(
                        outputs, idx, y, add=True, inplace=True, **SCATTER_AT))):
                ms = graph_ms(fn)
                copy = copy_ms(passes * window_bytes // 2, graph=True)
                rows.setdefault((n, C, fraction, op), []).append(f"{ms * 1000:.1f} ({copy / ms:.2f})")
    torch.manual_seed(0)
    block = sbnet_torch.SparseResBlock(256, 64, block_size=16).to("cuda", torch.float16)
    x = torch.randn(1, 256, 400, 700, device="cuda", dtype=torch.float16)
    p = block.geometry(x.shape)
    with torch.no_grad():
        for fraction in (0.1, 0.25, 0.5):
            chosen = np.argwhere(rng.random(p.bcount) < fraction)
            mask = np.zeros((1, 400, 700), np.float32)
            mask[0, p.boffset[0] + chosen[:, 0] * p.bstride[0] + p.bsize[0] // 2,
                 p.boffset[1] + chosen[:, 1] * p.bstride[1] + p.bsize[1] // 2] = 1
            indices, count = block.active_blocks(torch.as_tensor(mask, device="cuda"), tol=0.5)
            first = None
            for variant in variants:
                use(sbnet, {**defaults, **settings_of(variant)})
                out = block(x, indices, count)
                if first is None:
                    first = out
                assert torch.equal(out, first)  # (every variant: the same bits)
                work = x.clone()
                ms = graph_ms(lambda: block(work, indices, count, inplace=True))
                rows.setdefault((1, 256, round(len(chosen) / (p.bcount[0] * p.bcount[1]), 3), "NCHW-input block"),
                                []).append(f"{ms * 1000:.1f}")
    use(sbnet, defaults)
    print("| N | C | active | op | " + " | ".join(variants) + " |")
    print("|---" * (4 + len(variants)) + "|")
    for (n, C, fraction, op), cells in rows.items():
        print(f"| {n} | {C} | {fraction} | {op} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
