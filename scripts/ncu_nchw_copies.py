"""One NCHW gather and adding scatter of the sparse block's geometry, for Nsight Compute
(a developer's script): 1 x 256 x 400 x 700 at half the windows of 16 active, fp16 (or the
dtype named on the command line).

    ncu --metrics dram__bytes_read.sum,dram__bytes_write.sum,... python3 scripts/ncu_nchw_copies.py \
        [float32] [--block] [SETTING=VALUE ...]

Each op runs twice (the first call compiles and keeps its plan); profile the last launches.
``--block``: the sparse block's forward on that NCHW input instead (fp16, 256 -> 64, in place),
whose gather and scatter run between its products (profile with ``--cache-control none`` to
keep what they leave in L2). SETTING=VALUE: settings of `sparseblocks.kernels.sbnet`.
"""

import ast
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench_sbnet import block_mask  # noqa: E402


def main():
    import torch

    from sparseblocks import sbnet_torch
    from sparseblocks.kernels import sbnet
    from sparseblocks.reference import sbnet as reference

    args = sys.argv[1:]
    for setting in (a for a in args if "=" in a):
        name, value = setting.split("=")
        setattr(sbnet, name, ast.literal_eval(value))
    names = [a for a in args if "=" not in a and not a.startswith("--")]
    dtype = getattr(torch, names[0] if names else "float16")
    rng = np.random.default_rng(0)
    x = torch.randn(1, 256, 400, 700, device="cuda").to(dtype)
    if "--block" in args:
        torch.manual_seed(0)
        block = sbnet_torch.SparseResBlock(256, 64, block_size=16).to("cuda", dtype)
        p = block.geometry(x.shape)
        chosen = np.argwhere(rng.random(p.bcount) < 0.5)
        mask = np.zeros((1, 400, 700), np.float32)
        mask[0, p.boffset[0] + chosen[:, 0] * p.bstride[0] + p.bsize[0] // 2,
             p.boffset[1] + chosen[:, 1] * p.bstride[1] + p.bsize[1] // 2] = 1
        indices, count = block.active_blocks(torch.as_tensor(mask, device="cuda"), tol=0.5)
        with torch.no_grad():
            for _ in range(2):
                block(x, indices, count, inplace=True)
        torch.cuda.synchronize()
        print(f"{len(indices)} windows, the block's forward")
        return
    mask = block_mask(rng, 1, 400, 700, 16, 0.5)
    idx = torch.as_tensor(reference.reduce_mask(mask, tol=0.5, bsize=16, bstride=16), device="cuda")
    g = {"bsize": 16, "bstride": 16, "boffset": 0, "data_format": "NCHW"}
    for _ in range(2):
        blocks = sbnet.sparse_gather(x, idx, **g)
        sbnet.sparse_scatter(blocks, idx, x, add=True, inplace=True, **g)
    torch.cuda.synchronize()
    print(f"{len(idx)} windows, stack {blocks.nbytes / 1e6:.1f} MB")


if __name__ == "__main__":
    main()
