"""Host µs of each piece of a graphed call of the sparse block without gradients (a developer's
script, GPU): the Python and torch calls the block makes before and around its launches, each
timed alone in a loop, beside the whole call.

    python3 scripts/host_pieces_res_block.py [--fraction 0.1] [--dtype float16]
"""

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from res_block_ab import windows_of  # noqa: E402


def per_call_us(torch, fn, calls=2000, sync_every=100):
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    total = 0.0
    for _ in range(calls // sync_every):
        start = time.perf_counter()
        for _ in range(sync_every):
            fn()
        total += time.perf_counter() - start
        torch.cuda.synchronize()
    return total / calls * 1e6


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--fraction", type=float, default=0.1)
    parser.add_argument("--dtype", default="float16")
    args = parser.parse_args()

    import torch

    from sparseblocks import sbnet_torch as st
    from sparseblocks._arrays import torch_stream_handle

    dtype = getattr(torch, args.dtype)
    block = st.SparseResBlock(256, 64, block_size=16, graphs=True).to("cuda", dtype).to(
        memory_format=torch.channels_last)
    x = torch.randn(1, 256, 400, 700, device="cuda", dtype=dtype).to(memory_format=torch.channels_last)
    mask = torch.as_tensor(windows_of(block, args.fraction), device="cuda")
    indices, count = block.active_blocks(mask, tol=0.5)
    torch.set_grad_enabled(False)
    image = x.permute(0, 2, 3, 1)
    p = block.geometry(x.shape)
    windows = st._Windows(indices, count, False, "NHWC", (p.bsize, p.bstride, p.boffset),
                          (p.bsize_out, p.bsize_out, 0))
    weights = block.weights()
    residual = st._WRITTEN_OUT[False]
    stack_shape = (*p.bsize, 256)
    block(x, indices, count, inplace=True)
    slot, capacity = block._graphs._acquire(residual, weights, image, stack_shape, False, len(indices))
    slot.busy = False
    key = (st._signature(windows, image, True), False, False, st.FUSED_GATHER)
    kept = slot.launches[key]
    stream = torch_stream_handle()
    graph = slot.forward(capacity, True)

    def release_after(fn):
        def run():
            fn()
            slot.busy = False
        return run

    pieces = {
        "whole call": lambda: block(x, indices, count, inplace=True),
        "Module.__call__ overhead (forward=no-op)": None,
        "is_autocast_enabled(x.device.type)": lambda: torch.is_autocast_enabled(x.device.type),
        "geometry(x.shape)": lambda: block.geometry(x.shape),
        "x.is_contiguous(channels_last)": lambda: x.is_contiguous(memory_format=torch.channels_last),
        "x.permute(0, 2, 3, 1)": lambda: x.permute(0, 2, 3, 1),
        "_Windows(...)": lambda: st._Windows(indices, count, False, "NHWC", (p.bsize, p.bstride, p.boffset),
                                             (p.bsize_out, p.bsize_out, 0)),
        "block.weights()": block.weights,
        "is_current_stream_capturing()": torch.cuda.is_current_stream_capturing,
        "is_grad_enabled + requires_grad": lambda: torch.is_grad_enabled() and (
            image.requires_grad or any(w.requires_grad for w in weights)),
        "torch_stream_handle()": torch_stream_handle,
        "_signature(...)": lambda: st._signature(windows, image, True),
        "_acquire(...)": release_after(lambda: block._graphs._acquire(residual, weights, image, stack_shape, False,
                                                                      len(indices))),
        "fused kept launch": lambda: kept[0](stream, slot.h1.data_ptr(), image.data_ptr(), weights[0].data_ptr(),
                                             indices.data_ptr(), kept[2] or count.data_ptr()),
        "graph.replay()": graph.replay,
        "scatter kept launch": lambda: kept[1](stream, image, slot.out.data_ptr(), indices.data_ptr(),
                                               kept[3] or count.data_ptr()),
        "round_trip(...)": lambda: slot.round_trip(windows, image, True, capacity, zero_rest=False),
        "graphs.run(...)": lambda: block._graphs.run(residual, weights, windows, image, True, stack_shape, False),
        "y.permute(0, 3, 1, 2)": lambda: image.permute(0, 3, 1, 2),
    }
    pieces["Module.__call__ overhead (forward=no-op)"] = lambda: block(x, indices, count, inplace=True)
    timings = {}
    for name, fn in pieces.items():
        if name.startswith("Module"):
            block.forward = lambda *a, **k: None
            timings[name] = per_call_us(torch, fn)
            del block.forward
        else:
            timings[name] = per_call_us(torch, fn)
    for name, us in timings.items():
        print(f"{us:8.2f} µs  {name}")


if __name__ == "__main__":
    main()
