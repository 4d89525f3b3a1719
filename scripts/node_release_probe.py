"""Whether the sparse block's autograd node (and with it the leaves' AccumulateGrad nodes) is freed
once a training step's output is dropped (a developer's probe; GPU for graphs=True): a node kept
alive past its step makes torch's engine wait on a stale stream in a later CUDA-graph capture
(session 26's A/B capture failure).

    python3 scripts/node_release_probe.py
"""

import gc
import sys
import weakref
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sparseblocks import sbnet_torch  # noqa: E402


def main():
    device = "cuda" if torch.cuda.is_available() else "cpu"
    for graphs in (False, True):
        block = sbnet_torch.SparseResBlock(channels=64, bottleneck=16, block_size=16, graphs=graphs).to(device)
        block = block.to(memory_format=torch.channels_last)
        x = torch.randn(1, 64, 60, 70, device=device).to(memory_format=torch.channels_last).requires_grad_(True)
        mask = np.zeros((1, 60, 70), np.float32)
        mask[0, 10:40, 5:50] = 1
        indices, count = block.active_blocks(torch.as_tensor(mask, device=device))
        for step in range(3):  # (the first captures, the later ones replay kept launches)
            y = block(x, indices, count)
            node = y.grad_fn.next_functions[0][0]
            ref = weakref.ref(node)
            del node
            y.sum().backward()
            del y
            alive = ref() is not None
            gc.collect()
            print(f"graphs={graphs} step {step}: the block's node alive after the step: {alive}, after gc: "
                  f"{ref() is not None}", flush=True)


if __name__ == "__main__":
    main()
