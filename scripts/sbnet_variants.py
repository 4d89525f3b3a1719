"""Settings of the SBNet row copies side by side on the GPU (a developer's script).

    python3 scripts/sbnet_variants.py [--threads 64,128,256]

For each setting of ROW_TILE_THREADS (threads of a transposing row copy) and each
configuration (N x 400 x 700 x C fp32, windows of `block`, a fraction active): check the
transposed gather and scatters against the reference, then time their CUDA-graph replays
beside a device copy of the same bytes (as benchmarks/bench_sbnet.py does).
"""

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench_sbnet import block_mask  # noqa: E402
from benchmarks.common import copy_ms, device_name, graph_ms  # noqa: E402


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--threads", default="64,128,256")
    args = parser.parse_args()

    import torch

    from sparseblocks.kernels import sbnet
    from sparseblocks.reference import sbnet as reference

    default = sbnet.ROW_TILE_THREADS
    rng = np.random.default_rng(0)
    print(f"{device_name()}: transposed row copies, graph timings, copy / ours")
    print("| N | C | block | active | op | " + " | ".join(f"{t} threads" for t in args.threads.split(",")) + " |")
    for n, C, block, active in [(1, 64, 16, 0.05), (1, 64, 16, 0.25), (1, 256, 16, 0.05), (1, 64, 32, 0.1),
                                (8, 64, 16, 0.5), (8, 256, 16, 0.1), (8, 256, 32, 0.25)]:
        mask = block_mask(rng, n, 400, 700, block, active)
        g = {"bsize": block, "bstride": block, "boffset": 0}
        want_idx = reference.reduce_mask(mask, tol=0.5, **g)
        idx = torch.as_tensor(want_idx, device="cuda")
        x = torch.randn(n, 400, 700, C, device="cuda")
        y = torch.zeros_like(x)
        moved = len(want_idx) * block * block * C * 4
        copy = copy_ms(moved, graph=True)
        rows = {}
        for threads in args.threads.split(","):
            sbnet.ROW_TILE_THREADS = int(threads)
            sbnet._kernels.clear()
            sbnet._plans.clear()
            blocks = sbnet.sparse_gather(x, idx, transpose=True, **g)
            ref = reference.sparse_gather(x.cpu().numpy(), want_idx, transpose=True, **g)
            assert np.array_equal(blocks.cpu().numpy(), ref)
            ops = {"gather": (lambda: sbnet.sparse_gather(x, idx, transpose=True, **g), 2 * moved)}
            for add in (False, True):
                got = sbnet.sparse_scatter(blocks, idx, y, add=add, transpose=True, **g)
                ref = reference.sparse_scatter(blocks.cpu().numpy(), want_idx, y.cpu().numpy(), add=add,
                                               transpose=True, **g)
                assert np.array_equal(got.cpu().numpy(), ref)
                ops[f"scatter add={add}"] = (lambda add=add: sbnet.sparse_scatter(
                    blocks, idx, y, add=add, transpose=True, inplace=True, **g), (3 if add else 2) * moved)
            for name, (fn, size) in ops.items():
                base = copy if size == 2 * moved else copy_ms(size // 2, graph=True)
                rows.setdefault(name, []).append(base / graph_ms(fn))
        for name, ratios in rows.items():
            print(f"| {n} | {C} | {block} | {active} | {name} | " + " | ".join(f"{r:.2f}" for r in ratios) + " |",
                  flush=True)
    sbnet.ROW_TILE_THREADS = default


if __name__ == "__main__":
    main()
