"""Where the host time of one small call goes (a developer's script; needs a GPU and torch).

    python3 scripts/profile_host.py [--calls 2000]

Times a tiny bsmm forward, sparse_gather and reduce_mask from torch tensors
per call (host clock, the GPU has nothing to do), then prints cProfile's top
functions for each.
"""

import argparse
import cProfile
import io
import pstats
import time


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--calls", type=int, default=2000)
    args = parser.parse_args()

    import torch

    from sparseblocks import BlockLayout
    from sparseblocks.kernels import bsmm, sbnet

    layout = BlockLayout.dense((2, 2), 32)
    x = torch.randn(8, 64, device="cuda")
    w = torch.randn(layout.w_shape, device="cuda")
    image = torch.randn(1, 32, 32, 8, device="cuda")
    mask = (torch.rand(1, 32, 32, device="cuda") > 0.5).float()
    indices, count = sbnet.reduce_mask(mask, 8, 8)
    small = torch.randn(8, 64, device="cuda")
    calls = {
        "torch.mm (tiny op)": lambda: torch.mm(small, small.T),
        "bsmm.forward": lambda: bsmm.forward(x, w, layout),
        "sparse_gather": lambda: sbnet.sparse_gather(image, indices, 8, 8, count=count),
        "sparse_gather count=None": lambda: sbnet.sparse_gather(image, indices[:4].contiguous(), 8, 8),
        "reduce_mask": lambda: sbnet.reduce_mask(mask, 8, 8),
    }
    for name, fn in calls.items():
        for _ in range(50):
            fn()
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(args.calls):
            fn()
        torch.cuda.synchronize()
        print(f"{name}: {(time.perf_counter() - start) / args.calls * 1e6:.1f} us a call")
    for name, fn in calls.items():
        profile = cProfile.Profile()
        profile.enable()
        for _ in range(500):
            fn()
        profile.disable()
        torch.cuda.synchronize()
        text = io.StringIO()
        pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(14)
        print(f"==== {name}\n" + "\n".join(text.getvalue().splitlines()[6:24]))


if __name__ == "__main__":
    main()
