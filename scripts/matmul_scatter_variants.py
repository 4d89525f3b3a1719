"""`sparse_matmul_scatter` (`kernels/gather_matmul.py`) in several tile shapes, against cuBLAS's
product followed by the adding scatter (what `SparseResBlock` runs without it): a developer's
script, GPU.

    python3 scripts/matmul_scatter_variants.py [--shapes "128,64,16,2,4 ..."] [--fp32-shapes ...]

Each variant (rows, cols, words, stages, warps[, a register cap]; set as `SCATTER_TILES`) is
checked against the reference on a small awkward case (windows off the image, indices out of
range, a count short of the rows, output channels ending inside a tile), then timed with graph
replays on the block's last 1x1 (1 x 400 x 700, 64 -> 256, windows of 14 every 14, 5-50 %),
beside the product and scatter apart.
"""

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench_gather_matmul import SCATTER_GEOMETRY, windows  # noqa: E402
from benchmarks.common import graph_ms  # noqa: E402
from gather_matmul_variants import parse_tiles  # noqa: E402


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--shapes", default="128,64,16,2,4 128,64,16,2,4,128 64,64,16,2,4 64,64,16,2,2 "
                                            "64,64,16,3,4 128,64,16,2,4,96")
    parser.add_argument("--fp32-shapes", default="64,64,16,2,4 64,64,16,2,4,80 32,64,16,2,2 64,64,16,2,2")
    parser.add_argument("--fractions", default="0.05,0.1,0.25,0.5")
    args = parser.parse_args()

    import torch

    from sparseblocks.kernels import gather_matmul as fused
    from sparseblocks.kernels import sbnet
    from sparseblocks.reference import gather_matmul as reference

    rng = np.random.default_rng(0)
    for dtype_name, text in (("float16", args.shapes), ("float32", args.fp32_shapes)):
        dtype = getattr(torch, dtype_name)
        default = fused.SCATTER_TILES[dtype_name]
        g_small = {"bsize": (5, 4), "bstride": (5, 4), "boffset": (-2, 1)}
        y_small = torch.randn(2, 13, 11, 72, device="cuda", dtype=dtype)
        b_small = torch.randn(7, 5, 4, 24, device="cuda", dtype=dtype)
        w_small = torch.randn(72, 24, device="cuda", dtype=dtype)
        idx_small = torch.tensor([[0, 0, 0], [1, 1, 2], [0, 2, -1], [5, 0, 0], [1, 3, 1], [0, -1, 0], [1, 0, 0]],
                                 dtype=torch.int32, device="cuda")
        count = torch.tensor([6], dtype=torch.int32, device="cuda")
        want = reference.sparse_matmul_scatter(b_small.cpu().numpy(), idx_small.cpu().numpy(), w_small.cpu().numpy(),
                                               y_small.cpu().numpy(), count=count.cpu().numpy(), **g_small)
        y = torch.randn(1, 400, 700, 256, device="cuda", dtype=dtype)
        w = torch.randn(256, 64, device="cuda", dtype=dtype) / 8
        cases = []
        for fraction in map(float, args.fractions.split(",")):
            idx = torch.as_tensor(windows(rng, 400, 700, fraction), device="cuda")
            cases.append((fraction, idx, torch.randn(len(idx), 14, 14, 64, device="cuda", dtype=dtype)))
        into = y.clone()
        line = f"{dtype_name} apart:"
        for fraction, idx, blocks in cases:
            def apart():
                rows = torch.mm(blocks.view(-1, 64), w.t()).view(*blocks.shape[:3], 256)
                return sbnet.sparse_scatter(rows, idx, into, add=True, inplace=True, **SCATTER_GEOMETRY)
            line += f"  {fraction}: {graph_ms(apart) * 1e3:6.1f} us"
        print(line, flush=True)
        for tile in parse_tiles(text):
            fused.SCATTER_TILES[dtype_name] = tile
            sbnet._plans.clear()
            got = y_small.clone()
            fused.sparse_matmul_scatter(b_small, idx_small, w_small, got, count=count, **g_small)
            error = np.abs(got.double().cpu().numpy() - want).max()
            line = f"{dtype_name} {tile}: small error {error:.2g}"
            for fraction, idx, blocks in cases:
                first, second = y.clone(), y.clone()
                fused.sparse_matmul_scatter(blocks, idx, w, first, **SCATTER_GEOMETRY)
                fused.SCATTER_TILES[dtype_name] = default
                sbnet._plans.clear()
                fused.sparse_matmul_scatter(blocks, idx, w, second, **SCATTER_GEOMETRY)
                fused.SCATTER_TILES[dtype_name] = tile
                sbnet._plans.clear()
                assert torch.equal(first, second) or (first.double() - second.double()).abs().max() < 1e-2
                ms = graph_ms(lambda: fused.sparse_matmul_scatter(blocks, idx, w, into, **SCATTER_GEOMETRY))
                line += f"  {fraction}: {ms * 1e3:6.1f} us"
            print(line, flush=True)
        fused.SCATTER_TILES[dtype_name] = default


if __name__ == "__main__":
    main()
