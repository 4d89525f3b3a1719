"""One NCHW gather and adding scatter of the sparse block's geometry, for Nsight Compute
(a developer's script): 1 x 256 x 400 x 700 at half the windows of 16 active, fp16 (or the
dtype named first on the command line).

    ncu --metrics dram__bytes_read.sum,dram__bytes_write.sum,... python3 scripts/ncu_nchw_copies.py [float32]

Each op runs twice (the first call compiles and keeps its plan); profile the last launches.
"""

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench_sbnet import block_mask  # noqa: E402


def main():
    import torch

    from sparseblocks.kernels import sbnet
    from sparseblocks.reference import sbnet as reference

    rng = np.random.default_rng(0)
    mask = block_mask(rng, 1, 400, 700, 16, 0.5)
    idx = torch.as_tensor(reference.reduce_mask(mask, tol=0.5, bsize=16, bstride=16), device="cuda")
    dtype = getattr(torch, sys.argv[1] if len(sys.argv) > 1 else "float16")
    x = torch.randn(1, 256, 400, 700, device="cuda").to(dtype)
    g = {"bsize": 16, "bstride": 16, "boffset": 0, "data_format": "NCHW"}
    for _ in range(2):
        blocks = sbnet.sparse_gather(x, idx, **g)
        sbnet.sparse_scatter(blocks, idx, x, add=True, inplace=True, **g)
    torch.cuda.synchronize()
    print(f"{len(idx)} windows, stack {blocks.nbytes / 1e6:.1f} MB")


if __name__ == "__main__":
    main()
