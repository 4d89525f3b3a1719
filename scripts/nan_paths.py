"""Where a NaN survives the sparse block's products on a GPU (a developer's check, session 30):
cuBLASLt's ReLU epilogue, the fused gather's products in fp16 and fp32 (3xTF32), and which path
the block takes."""

import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sparseblocks import sbnet_torch  # noqa: E402
from sparseblocks.kernels import gather_matmul  # noqa: E402

for dtype in (torch.float32, torch.float16):
    rows = torch.randn(64, 8, device="cuda", dtype=dtype)
    rows[3, 2] = float("nan")
    w = torch.randn(8, 4, device="cuda", dtype=dtype)
    bias = torch.zeros(4, device="cuda", dtype=dtype)
    fused = torch._addmm_activation(bias, rows, w)
    print(dtype, "addmm_activation NaN rows:", torch.isnan(fused).any(1).nonzero().flatten().tolist(),
          "relu(mm):", torch.isnan((rows @ w).relu()).any(1).nonzero().flatten().tolist())
    x = torch.randn(1, 6, 6, 8, device="cuda", dtype=dtype)
    x[0, 1, 2, 5] = float("nan")
    idx = torch.tensor([[0, 0, 0]], dtype=torch.int32, device="cuda")
    for relu in (False, True):
        out = gather_matmul.sparse_gather_matmul(x, idx, w.t().contiguous(), bsize=4, bstride=4, relu=relu)
        print(dtype, f"gather_matmul relu={relu} NaN pixels:", torch.isnan(out).any(-1).nonzero().tolist())
    for bits in (0x7FC00000, 0x7FFFFFFF, 0xFFC00000, 0x7F800001):
        y = x.clone()
        if dtype == torch.float32:
            y[0, 1, 2, 5] = torch.tensor([bits], dtype=torch.int64).to(torch.int32).view(torch.float32)[0]
        out = gather_matmul.sparse_gather_matmul(y, idx, w.t().contiguous(), bsize=4, bstride=4)
        print(dtype, f"NaN {bits:#x}: NaN pixels", torch.isnan(out).any(-1).nonzero().tolist())
    calls = []
    for name in ("sparse_gather_matmul", "sparse_matmul_scatter"):
        original = getattr(sbnet_torch.fused_kernels, name)
        setattr(sbnet_torch.fused_kernels, name, lambda *a, _o=original, _n=name, **k: calls.append(_n) or _o(*a, **k))
    sbnet_torch.FUSED_GATHER_MIN_PIXELS = 0
    torch.manual_seed(6)
    block = sbnet_torch.SparseResBlock(channels=8, bottleneck=4, block_size=6).to("cuda", dtype)
    xb = torch.randn(1, 8, 9, 10, dtype=dtype, device="cuda").to(memory_format=torch.channels_last)
    xb[0, 3, 4, 5] = float("nan")
    mask = np.zeros((1, 9, 10), np.float32)
    mask[0, 2:6, 2:8] = 1
    indices, count = block.active_blocks(torch.as_tensor(mask, device="cuda"))
    with torch.no_grad():
        yb = block(xb, indices, count)
    print(dtype, "block calls", calls, "NaN pixels", torch.isnan(yb).any(1).nonzero().tolist())
