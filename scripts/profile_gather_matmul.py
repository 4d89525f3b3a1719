"""Run the fused gather and 1x1 product (`kernels/gather_matmul.py`) on the sparse block's shape a few
times, for a profiler to pick one launch (a developer's script, GPU; see scripts/ncu_gather_matmul.sh).

    python3 scripts/profile_gather_matmul.py [--dtype float16] [--active 0.5] [--tile 128,64,16,3,4]
        [--format NCHW]

``--format NCHW``: the image NCHW (its kernel's tile: ``--tile`` sets NCHW_TILE_SHAPE).
"""

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--dtype", default="float16")
    parser.add_argument("--active", type=float, default=0.5)
    parser.add_argument("--tile", default=None)
    parser.add_argument("--calls", type=int, default=5)
    parser.add_argument("--format", default="NHWC")
    parser.add_argument("--host", action="store_true", help="host time of a call, and cProfile's top functions")
    args = parser.parse_args()

    import torch

    from sparseblocks.kernels import gather_matmul, sbnet

    if args.tile:
        values = tuple(map(int, args.tile.split(",")))
        setattr(gather_matmul, "TILE_SHAPE" if args.format == "NHWC" else "NCHW_TILE_SHAPE",
                values if len(values) == 6 else values + (None,))
    dtype = getattr(torch, args.dtype)
    g = {"bsize": 16, "bstride": 14, "boffset": -1}
    x = torch.randn(1, 400, 700, 256, device="cuda", dtype=dtype)
    w = torch.randn(64, 256, device="cuda", dtype=dtype) / 16
    grid = sbnet.block_count((400, 700), (14, 14), (-1, -1))
    chosen = np.argwhere(np.random.default_rng(0).random(grid) < args.active)
    indices = np.ascontiguousarray(np.concatenate([np.zeros((len(chosen), 1), np.int64), chosen], axis=1), np.int32)
    idx = torch.as_tensor(indices, device="cuda")
    count = torch.tensor([len(indices)], dtype=torch.int32, device="cuda")
    if args.format == "NCHW":
        x = x.permute(0, 3, 1, 2).contiguous()

    def call():
        return gather_matmul.sparse_gather_matmul(x, idx, w, relu=True, count=count, data_format=args.format, **g)

    for _ in range(args.calls):
        call()
    torch.cuda.synchronize()
    if args.host:
        import cProfile
        import pstats
        import time

        gather = lambda: sbnet.sparse_gather(x, idx, count=count, data_format=args.format, **g)  # noqa: E731
        for name, fn in (("fused", call), ("gather", gather)):
            for _ in range(20):
                fn()
            torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(200):
                fn()
            print(f"{name}: {(time.perf_counter() - start) / 200 * 1e6:.1f} us a call (host)")
            torch.cuda.synchronize()
        profile = cProfile.Profile()
        profile.enable()
        for _ in range(200):
            call()
        profile.disable()
        torch.cuda.synchronize()
        pstats.Stats(profile).sort_stats("tottime").print_stats(18)


if __name__ == "__main__":
    main()
