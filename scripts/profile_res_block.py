"""Device time of each kernel of the sparse ResNet block, from torch's profiler (a developer's script).

    python3 scripts/profile_res_block.py [--dtype float16] [--active 0.1] [--host] [--train] [--graphs]

The benchmark's shape (1 x 256 x 400 x 700, bottleneck 64, windows of 16),
`active` of the windows chosen, the block run in place; prints the kernels
sorted by total device time over 20 calls, beside the dense block's. With
``--host``: the host's time of one eager call instead (200 calls before the
queue fills, no sync inside), and cProfile's top functions. With ``--train``: the
kernels of a training step (forward and backward, not in place) instead. With ``--graphs``:
the block with ``graphs=True`` (the kernels its graphs replay are listed one by one).
"""

import argparse

import numpy as np


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--dtype", default="float16")
    parser.add_argument("--active", type=float, default=0.10)
    parser.add_argument("--host", action="store_true")
    parser.add_argument("--train", action="store_true")
    parser.add_argument("--graphs", action="store_true")
    args = parser.parse_args()

    import torch

    from sparseblocks.sbnet_torch import SparseResBlock

    dtype = getattr(torch, args.dtype)
    torch.backends.cudnn.allow_tf32 = False
    block = SparseResBlock(256, 64, block_size=16, graphs=args.graphs).to("cuda", dtype).to(memory_format=torch.channels_last)
    x = torch.randn(1, 256, 400, 700, device="cuda", dtype=dtype).to(memory_format=torch.channels_last)
    p = block.geometry(x.shape)
    chosen = np.argwhere(np.random.default_rng(1).random(p.bcount) < args.active)
    mask = np.zeros((1, 400, 700), np.float32)
    mask[0, p.boffset[0] + chosen[:, 0] * p.bstride[0] + p.bsize[0] // 2,
         p.boffset[1] + chosen[:, 1] * p.bstride[1] + p.bsize[1] // 2] = 1
    indices, count = block.active_blocks(torch.as_tensor(mask, device="cuda"), tol=0.5)
    steps = (("sparse", lambda: block(x, indices, count, inplace=True)), ("dense", lambda: block.dense(x)))
    if args.train:
        x.requires_grad_(True)
        grad_y = torch.randn_like(x)

        def step(forward):
            x.grad = None
            forward(x).backward(grad_y)

        steps = (("sparse training", lambda: step(lambda x: block(x, indices, count))),
                 ("dense training", lambda: step(block.dense)))
    if args.host:
        host_profile(torch, steps, args.train)
        return
    with torch.set_grad_enabled(args.train):
        for name, fn in steps:
            for _ in range(5):
                fn()
            torch.cuda.synchronize()
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                for _ in range(20):
                    fn()
                torch.cuda.synchronize()
            print(f"==== {name} block, {len(indices)} windows active")
            print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=12, max_name_column_width=60))


def host_profile(torch, steps, train):
    from profile_host import host_us, top_functions  # (scripts/ is on the path: run as a script)

    with torch.set_grad_enabled(train):
        for name, fn in steps:
            calls = 20 if train else 200  # (a training step is ~30 launches: keep the queue from filling)
            print(f"==== {name} block: host {host_us(torch, fn, calls=calls) / 1e3:.3f} ms a call")
            print(top_functions(torch, fn, calls=calls, rows=25))


if __name__ == "__main__":
    main()
