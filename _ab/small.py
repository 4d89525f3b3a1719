import sys
import numpy as np, torch
from sparseblocks.reference import sbnet as reference
from sparseblocks.kernels import sbnet as k
if len(sys.argv) > 1:
    k.PAIR_TILE_MAX_REGISTERS = None if sys.argv[1] == "none" else int(sys.argv[1])
torch.manual_seed(0)
x = torch.randn(1, 32, 56, 70, device="cuda", dtype=torch.float16)
idx = torch.tensor([[0, 0, 0], [0, 1, 2], [0, 2, 4], [0, 3, 1]], dtype=torch.int32, device="cuda")
count = torch.tensor([4], dtype=torch.int32, device="cuda")
blocks = torch.randn(4, 14, 14, 32, device="cuda", dtype=torch.float16)
want = reference.sparse_scatter(blocks.cpu().numpy(), idx.cpu().numpy(), x.cpu().numpy(), 14, 14, 0, add=True,
                                transpose=True, data_format="NCHW")
got = x.clone()
k.sparse_scatter(blocks, idx, got, 14, 14, 0, add=True, inplace=True, transpose=True, count=count, data_format="NCHW")
g = got.cpu().numpy()
bad = np.argwhere(g != want)
xs = x.cpu().numpy()
print("cap", k.PAIR_TILE_MAX_REGISTERS, "bad", len(bad), "unchanged among bad", int((g[tuple(bad.T)] == xs[tuple(bad.T)]).sum()) if len(bad) else 0)
