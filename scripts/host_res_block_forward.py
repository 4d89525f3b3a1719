"""Where the host's time of one eager call of the sparse block goes (a developer's script, GPU).

    python3 scripts/host_res_block_forward.py [--fraction 0.1] [--dtypes float16,float32] [--train]

The benchmark's shape (1 x 256 x 400 x 700 -> 64, windows of 16), in place without gradients
(``--train``: a training step), with and without ``graphs=True``: the eager time as the benchmark
takes it, the host's time alone, torch's profiler's CPU-side table (runtime and driver calls,
synchronizing ones included) and cProfile's top functions.
"""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from benchmarks.common import time_ms  # noqa: E402
from profile_host import host_us, top_functions  # noqa: E402
from res_block_ab import windows_of  # noqa: E402


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--fraction", type=float, default=0.1)
    parser.add_argument("--dtypes", default="float16,float32")
    parser.add_argument("--train", action="store_true")
    args = parser.parse_args()

    import torch

    from sparseblocks.sbnet_torch import SparseResBlock

    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cuda.matmul.allow_tf32 = False
    for dtype_name in args.dtypes.split(","):
        dtype = getattr(torch, dtype_name)
        torch.manual_seed(0)
        x = torch.randn(1, 256, 400, 700, device="cuda", dtype=dtype).to(memory_format=torch.channels_last)
        xg = x.detach().clone().requires_grad_(True)
        grad_y = torch.randn_like(x)
        for graphs in (True, False):
            block = SparseResBlock(256, 64, block_size=16, graphs=graphs).to("cuda", dtype).to(
                memory_format=torch.channels_last)
            mask = torch.as_tensor(windows_of(block, args.fraction), device="cuda")
            indices, count = block.active_blocks(mask, tol=0.5)
            work = x.clone()
            if args.train:
                def call():
                    xg.grad = None
                    block.zero_grad(set_to_none=True)
                    block(xg, indices, count).backward(grad_y)
            else:
                def call():
                    block(work, indices, count, inplace=True)
            with torch.set_grad_enabled(args.train):
                for _ in range(5):
                    call()
                torch.cuda.synchronize()
                eager = time_ms(call, warmup=5, repeat=40)
                host = host_us(torch, call, calls=20 if args.train else 100)
                print(f"==== {dtype_name} {args.fraction} graphs={graphs} train={args.train} windows {len(indices)}: "
                      f"eager {eager * 1e3:.1f} µs, host {host:.1f} µs", flush=True)
                with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                        torch.profiler.ProfilerActivity.CUDA]) as prof:
                    for _ in range(20):
                        call()
                    torch.cuda.synchronize()
                print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=22,
                                                max_name_column_width=50))
                print(top_functions(torch, call, calls=50, rows=16))


if __name__ == "__main__":
    main()
