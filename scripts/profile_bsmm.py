"""One bsmm product on the GPU, for a profiler to look at (a developer's script, no checks).

    ncu --clock-control none --kernel-name regex:product --launch-skip 3 --launch-count 1 \
        python3 scripts/profile_bsmm.py [--version 3] [--product forward] [--dtype float32]

Sizes by default are the issue's headline case: N = C = K = 4096, block 32, 10 % density.
"""

import argparse

import numpy as np
from numba import cuda

from sparseblocks import BlockLayout
from sparseblocks.kernels import bsmm


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--version", type=int, default=3)
    parser.add_argument("--product", default="forward", choices=("forward", "input_grad", "weight_grad"))
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--block-size", type=int, default=32)
    parser.add_argument("--density", type=float, default=0.10)
    parser.add_argument("--n", type=int, default=4096)
    parser.add_argument("--calls", type=int, default=5)
    parser.add_argument("--group", type=int, default=None, help="bsmm.PRODUCT_GROUP (default: the module's)")
    args = parser.parse_args()
    if args.group is not None:
        bsmm.PRODUCT_GROUP = args.group

    bs = args.block_size
    layout = BlockLayout.random((4096 // bs, 4096 // bs), args.density, seed=1, block_size=bs)
    rng = np.random.default_rng(0)
    x = cuda.to_device(rng.standard_normal((args.n, 4096)).astype(args.dtype))
    w = cuda.to_device(rng.standard_normal(layout.w_shape).astype(args.dtype))
    for _ in range(args.calls):
        if args.product == "forward":
            bsmm.forward(x, w, layout, version=args.version)
        elif args.product == "input_grad":
            bsmm.input_grad(x, w, layout, version=args.version)
        else:
            bsmm.weight_grad(x, x, layout, version=args.version)
    cuda.synchronize()


if __name__ == "__main__":
    main()
