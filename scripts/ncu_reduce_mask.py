"""One reduce_mask (N x 400 x 700, windows of W, 10 % active) called a few times, for ncu:

    ncu --kernel-name regex:pass_kernel --launch-skip 3 --launch-count 1 \
        python3 scripts/ncu_reduce_mask.py [--n 8] [--window 16]
"""

import argparse
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench_sbnet import block_mask  # noqa: E402
from sparseblocks.kernels import sbnet  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("--n", type=int, default=8)
parser.add_argument("--window", type=int, default=16)
args = parser.parse_args()
mask = torch.as_tensor(block_mask(np.random.default_rng(0), args.n, 400, 700, args.window, 0.1), device="cuda")
for _ in range(5):
    sbnet.reduce_mask(mask, args.window, args.window, tol=0.5)
torch.cuda.synchronize()
