"""The sparse block's input and weight gradients against the dense block's (where(active, dense(x), x)),
in float64, float32 and float16, each against float64's dense (a developer's script; needs a GPU).

    python3 scripts/check_res_block_grads.py [--height 100] [--width 140] [--channels 256] [--active 0.1]
"""

import argparse

import numpy as np


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--height", type=int, default=100)
    parser.add_argument("--width", type=int, default=140)
    parser.add_argument("--channels", type=int, default=256)
    parser.add_argument("--active", type=float, default=0.1)
    args = parser.parse_args()
    import torch

    from sparseblocks.sbnet_torch import SparseResBlock

    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.manual_seed(0)
    H, W, C = args.height, args.width, args.channels
    base = SparseResBlock(C, 64, block_size=16).to("cuda", torch.float64).to(memory_format=torch.channels_last)
    x = torch.randn(1, C, H, W, device="cuda", dtype=torch.float64).to(memory_format=torch.channels_last)
    p = base.geometry(x.shape)
    chosen = np.argwhere(np.random.default_rng(1).random(p.bcount) < args.active)
    centres = np.array(p.boffset) + chosen * np.array(p.bstride) + np.array(p.bsize) // 2
    chosen = chosen[(centres < (H, W)).all(axis=1)]  # the last windows' centres may lie outside
    mask = np.zeros((1, H, W), np.float32)
    mask[0, p.boffset[0] + chosen[:, 0] * p.bstride[0] + p.bsize[0] // 2,
         p.boffset[1] + chosen[:, 1] * p.bstride[1] + p.bsize[1] // 2] = 1
    indices, count = base.active_blocks(torch.as_tensor(mask, device="cuda"), tol=0.5)
    with torch.no_grad():
        active = (base(x, indices, count) != x).any(dim=1, keepdim=True)
    grad_y = torch.randn_like(x)

    def grads(block, x, forward):
        block.zero_grad()
        x = x.detach().clone().requires_grad_(True)
        forward(block, x).backward(grad_y.to(x.dtype))
        return [x.grad.double()] + [c.weight.grad.double() for c in (block.conv1, block.conv2, block.conv3)]

    want = grads(base, x, lambda b, x: torch.where(active, b.dense(x), x))
    for dtype in (torch.float64, torch.float32, torch.float16):
        block = SparseResBlock(C, 64, block_size=16).to("cuda", dtype).to(memory_format=torch.channels_last)
        block.load_state_dict(base.state_dict())
        for name, forward in (("sparse", lambda b, x: b(x, indices, count)),
                              ("dense", lambda b, x: torch.where(active, b.dense(x), x))):
            got = grads(block, x.to(dtype), forward)
            errors = [((g - w).abs().max() / w.abs().max()).item() for g, w in zip(got, want)]
            print(f"{str(dtype):14} {name:6} relative max error x, conv1-3: " + " ".join(f"{e:.2e}" for e in errors))


if __name__ == "__main__":
    main()
