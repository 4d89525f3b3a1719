"""Where the host time of one small call goes (a developer's script; needs a GPU and torch).

    python3 scripts/profile_host.py [--calls 2000]

Times a tiny bsmm forward, sparse_gather and reduce_mask from torch tensors
two ways: calls per second with the queue kept full (what a loop of small
calls gets: the larger of host and device time) and the host's time alone
(200 calls timed before the queue fills, synchronized after the clock
stops). Then the pieces of one bsmm forward call, each timed alone, and
cProfile's top functions for each call.
"""

import argparse
import cProfile
import io
import pstats
import time


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--calls", type=int, default=2000)
    args = parser.parse_args()

    import torch

    from sparseblocks import BlockLayout
    from sparseblocks.kernels import bsmm, sbnet

    layout = BlockLayout.dense((2, 2), 32)
    x = torch.randn(8, 64, device="cuda")
    w = torch.randn(layout.w_shape, device="cuda")
    image = torch.randn(1, 32, 32, 8, device="cuda")
    mask = (torch.rand(1, 32, 32, device="cuda") > 0.5).float()
    indices, count = sbnet.reduce_mask(mask, 8, 8)
    small = torch.randn(8, 64, device="cuda")
    calls = {
        "torch.mm (tiny op)": lambda: torch.mm(small, small.T),
        "bsmm.forward": lambda: bsmm.forward(x, w, layout),
        "sparse_gather": lambda: sbnet.sparse_gather(image, indices, 8, 8, count=count),
        "sparse_gather count=None": lambda: sbnet.sparse_gather(image, indices[:4].contiguous(), 8, 8),
        "reduce_mask": lambda: sbnet.reduce_mask(mask, 8, 8),
    }
    for name, fn in calls.items():
        host = host_us(torch, fn)
        for _ in range(50):
            fn()
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(args.calls):
            fn()
        torch.cuda.synchronize()
        throughput = (time.perf_counter() - start) / args.calls * 1e6
        print(f"{name}: {throughput:.1f} us a call in a loop, {host:.1f} us of host time")
    pieces(torch, bsmm, layout, x, w)
    for name, fn in calls.items():
        print(f"==== {name}\n" + top_functions(torch, fn))


def top_functions(torch, fn, calls=500, rows=14):
    """cProfile's functions with the most own time over `calls` calls of fn (the table's lines)."""
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(calls):
        fn()
    profile.disable()
    torch.cuda.synchronize()
    text = io.StringIO()
    pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(rows)
    return "\n".join(text.getvalue().splitlines()[6:rows + 10])


def host_us(torch, fn, calls=200):
    """Host time of one call of fn: `calls` calls timed before the GPU's queue fills, after warm-up."""
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    elapsed = (time.perf_counter() - start) / calls * 1e6
    torch.cuda.synchronize()
    return elapsed


def pieces(torch, bsmm, layout, x, w):
    """Host time of each step of one bsmm.forward call from torch tensors."""
    from sparseblocks import _arrays
    from sparseblocks.kernels import _launch

    a, wo = _arrays.Operand(x, "x"), _arrays.Operand(w, "w")
    stream = _arrays.launch_stream((a, wo))
    native, out = a.empty((8, 64), stream)
    bsmm.forward(x, w, layout)
    kernel_args = None
    original = _launch.launch

    def capture(dispatcher, grid, block, stream, args):
        nonlocal kernel_args
        kernel_args = (dispatcher, grid, block, stream, args)
        original(dispatcher, grid, block, stream, args)

    def general_forward():
        bsmm._plans.clear()  # no kept plan: the call checks, launches and keeps one again
        bsmm.forward(x, w, layout)

    bsmm.launch, plans = capture, bsmm._plans
    bsmm._plans = {}  # the general path, not a kept plan's replay
    bsmm.forward(x, w, layout)
    bsmm.launch, bsmm._plans = original, plans
    steps = {
        "Operand(x) x2": lambda: (_arrays.Operand(x, "x"), _arrays.Operand(w, "w")),
        "checks": lambda: bsmm._check_common((a, wo), 1, 4),
        "launch_stream": lambda: _arrays.launch_stream((a, wo)),
        "torch.cuda.current_device": lambda: torch.cuda.current_device(),
        "empty (torch.empty)": lambda: a.empty((8, 64), stream),
        "_product_schedule": lambda: bsmm._product_schedule(layout, False, None, stream),
        "_fields of the product's args": lambda: _launch._fields(kernel_args[4]),
        "launch (fields, pack, cuLaunchKernel)": lambda: original(*kernel_args),
        "whole forward (a kept plan)": lambda: bsmm.forward(x, w, layout),
        "whole forward (general path)": general_forward,
    }
    for name, step in steps.items():
        print(f"  {name}: {host_us(torch, step):.1f} us")


if __name__ == "__main__":
    main()
