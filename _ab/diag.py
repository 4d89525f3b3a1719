import sys
import numpy as np, torch
sys.path.insert(0, "scripts")
from res_block_ab import windows_of
from sparseblocks.reference import sbnet as reference
from sparseblocks import sbnet_torch as st
from sparseblocks.kernels import sbnet as k
torch.manual_seed(0)
cap = k.PAIR_TILE_MAX_REGISTERS
for (N, C, bsz, frac, extra) in [(1, 256, 16, 0.1, {}), (1, 256, 16, 0.1, {"PAIR_TILE_MAX_REGISTERS": None}),
                                  (1, 256, 16, 0.5, {}), (1, 256, 16, 0.5, {"PAIR_TILE_MAX_REGISTERS": None}),
                                  (8, 64, 16, 0.5, {}), (1, 256, 16, 0.05, {})]:
    k.PAIR_TILE_MAX_REGISTERS = cap
    for name, v in extra.items():
        setattr(k, name, v)
    k._kernels.clear(); k._plans.clear()
    x = torch.randn(N, C, 400, 700, device="cuda", dtype=torch.float16)
    block = st.SparseResBlock(C, 64, block_size=bsz).to("cuda", torch.float16)
    p = block.geometry(x.shape)
    s = (p.bsize_out, p.bsize_out, 0)
    mask = windows_of(block, frac)
    indices, count = block.active_blocks(torch.as_tensor(np.concatenate([mask] * N), device="cuda"), tol=0.5)
    blocks = torch.randn(len(indices), *p.bsize_out, C, device="cuda", dtype=torch.float16)
    want = reference.sparse_scatter(blocks.cpu().numpy(), indices.cpu().numpy(), x.cpu().numpy(), *s, add=True,
                                    transpose=True, data_format="NCHW")
    got = x.clone()
    k.sparse_scatter(blocks, indices, got, *s, add=True, inplace=True, transpose=True, count=count, data_format="NCHW")
    got = got.cpu().numpy()
    bad = np.argwhere(got != want)
    print(N, C, frac, extra, "count", int(count[0]), "of", len(indices), "bad", len(bad), end=" ")
    if len(bad):
        print("channels", np.unique(bad[:, 1])[:10], "rows", np.unique(bad[:, 2] % 14)[:14], "cols%14",
              np.unique(bad[:, 3] % 14)[:14], "first", bad[:3].tolist())
    else:
        print()
    for name in extra:
        pass
