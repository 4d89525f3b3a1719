"""Whether a CUDA-graph capture of the dense block's training step fails after the sparse block's
forward without gradients (a developer's probe, GPU): session 25's A/B (`res_block_ab.py --graph`,
fp32) saw "operation would make the legacy stream depend on a capturing blocking stream" there
once the fused gather had run.

    python3 scripts/capture_after_fused.py DTYPE [fused|apart|none] [train|graphs]

`train` adds, between the forward and the capture, a training step of the sparse block as the
A/B script checks it; `graphs` one of a ``graphs=True`` copy too.
"""

import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import captured  # noqa: E402
from sparseblocks import sbnet_torch  # noqa: E402


def main():
    dtype = getattr(torch, sys.argv[1])
    mode = sys.argv[2] if len(sys.argv) > 2 else "fused"
    sbnet_torch.FUSED_GATHER = mode == "fused"
    block = sbnet_torch.SparseResBlock(256, 64, block_size=16).to("cuda", dtype).to(memory_format=torch.channels_last)
    x = torch.randn(1, 256, 400, 700, device="cuda", dtype=dtype).to(memory_format=torch.channels_last)
    xg = x.detach().clone().requires_grad_(True)
    grad_y = torch.randn_like(x)
    p = block.geometry(x.shape)
    chosen = np.argwhere(np.random.default_rng(1).random(p.bcount) < 0.25)
    mask = np.zeros((1, 400, 700), np.float32)
    for a, b in chosen:
        mask[0, min(a * 14 + 7, 399), min(b * 14 + 7, 699)] = 1
    indices, count = block.active_blocks(torch.as_tensor(mask, device="cuda"), tol=0.5)
    if mode != "none":
        with torch.no_grad():
            block(x, indices, count)
    extra = sys.argv[3] if len(sys.argv) > 3 else ""
    sparse = [block]
    if extra == "graphs":
        graphed = sbnet_torch.SparseResBlock(256, 64, block_size=16, graphs=True).to("cuda", dtype).to(
            memory_format=torch.channels_last)
        graphed.load_state_dict(block.state_dict())
        sparse.append(graphed)
    if extra:
        for b in sparse:
            xg.grad = None
            b(xg, indices, count).backward(grad_y)

    def step():
        xg.grad = None
        block.zero_grad(set_to_none=True)
        block.dense(xg).backward(grad_y)

    try:
        captured(step, calls=1)  # (as the A/B script captures: three runs on a side stream first)
        print(sys.argv[1], mode, extra, "capture ok")
    except Exception as error:  # noqa: BLE001 (the probe reports)
        print(sys.argv[1], mode, extra, "capture FAILED:", str(error).splitlines()[0])


if __name__ == "__main__":
    main()
