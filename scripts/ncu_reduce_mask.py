"""One large reduce_mask (8 x 400 x 700, windows of 16, 10 % active) called a few times, for ncu:

    ncu --kernel-name regex:pass_kernel --launch-skip 3 --launch-count 1 python3 scripts/ncu_reduce_mask.py
"""

import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench_sbnet import block_mask  # noqa: E402
from sparseblocks.kernels import sbnet  # noqa: E402

mask = torch.as_tensor(block_mask(np.random.default_rng(0), 8, 400, 700, 16, 0.1), device="cuda")
for _ in range(5):
    sbnet.reduce_mask(mask, 16, 16, tol=0.5)
torch.cuda.synchronize()
