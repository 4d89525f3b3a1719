"""Weight gradient against the forward on the GPU, over N-split counts (a developer's script).

    python3 scripts/wgrad_check.py [--rows 4096] [--block-sizes 16,32,64] [--densities 0.1,0.5]
                                   [--dtypes float32] [--splits 1,2,3,4] [--version 5]

C = K = 4096. For each case: the error of the library's choice against a float64 product of
the dense matrices, then CUDA-event medians of the forward, of the weight gradient with the
library's split count (`bsmm.wgrad_splits`), and with each count of --splits, as ratios to
the forward (the issue asks for at most 1.3x).
"""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench_bsmm import block_gather, relative_error  # noqa: E402
from benchmarks.common import time_ms  # noqa: E402


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=4096)
    parser.add_argument("--block-sizes", default="16,32,64")
    parser.add_argument("--densities", default="0.1,0.5")
    parser.add_argument("--dtypes", default="float32")
    parser.add_argument("--splits", default="1,2,3,4")
    parser.add_argument("--version", type=int, default=5)
    args = parser.parse_args()

    import torch

    from sparseblocks import BlockLayout
    from sparseblocks.kernels import bsmm

    N, version = args.rows, args.version
    for bs in (int(b) for b in args.block_sizes.split(",")):
        for density in (float(d) for d in args.densities.split(",")):
            layout = BlockLayout.random((4096 // bs, 4096 // bs), density, seed=1, block_size=bs)
            for dtype in (getattr(torch, name) for name in args.dtypes.split(",")):
                x = torch.randn(N, 4096, device="cuda", dtype=dtype)
                dy = torch.randn(N, 4096, device="cuda", dtype=dtype)
                w = torch.randn(layout.w_shape, device="cuda", dtype=dtype)
                want = block_gather(torch, x.double().T @ dy.double(), layout)
                error = relative_error(bsmm.weight_grad(x, dy, layout, version=version), want)
                fwd = time_ms(lambda: bsmm.forward(x, w, layout, version=version))
                line = [f"bs {bs} {density} {str(dtype)[6:]} N {N}: error {error:.1e}, forward {fwd:.3f} ms"]
                for splits in [None] + [int(s) for s in args.splits.split(",")]:
                    ms = time_ms(lambda: bsmm.weight_grad(x, dy, layout, version=version, splits=splits))
                    line.append(f"{'default' if splits is None else splits}: {ms:.3f} ({ms / fwd:.2f}x)")
                print(", ".join(line), flush=True)


if __name__ == "__main__":
    main()
