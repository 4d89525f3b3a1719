"""One reduce_mask (N x 400 x 700, windows of W, 10 % active) called a few times, for ncu:

    ncu --kernel-name regex:pass_kernel --launch-skip 3 --launch-count 1 \
        python3 scripts/ncu_reduce_mask.py [--n 8] [--window 16] [--setting NAME=VALUE ...] [--read] \
        [--no-look-back]

`--setting` sets one of kernels.sbnet's settings (a Python literal) first; `--read` calls, after
reduce_mask, a kernel that only reads the mask (16-byte loads, four a thread: `read_kernel`).
"""

import argparse
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench_sbnet import block_mask  # noqa: E402
from scripts.reduce_mask_variants import configure  # noqa: E402
from sparseblocks.kernels import sbnet  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("--n", type=int, default=8)
parser.add_argument("--window", type=int, default=16)
parser.add_argument("--setting", action="append", default=[])
parser.add_argument("--read", action="store_true")
parser.add_argument("--no-look-back", action="store_true", help="every chunk first (timing only: wrong indices)")
args = parser.parse_args()
configure(sbnet, args.setting, args.no_look_back)
mask = torch.as_tensor(block_mask(np.random.default_rng(0), args.n, 400, 700, args.window, 0.1), device="cuda")
for _ in range(5):
    sbnet.reduce_mask(mask, args.window, args.window, tol=0.5)
torch.cuda.synchronize()
if args.read:
    from scripts.reduce_mask_variants import make_read_kernel
    from sparseblocks.kernels._launch import launch, stream_of

    read_kernel = make_read_kernel()
    flat = mask.reshape(-1)
    out = torch.zeros(2, dtype=torch.float32, device="cuda")
    n4 = flat.numel() // 4
    for _ in range(5):
        launch(read_kernel, -(-n4 // 1024), 256, stream_of(torch.cuda.current_stream().cuda_stream),
               (out, flat, n4, 4))
    torch.cuda.synchronize()
