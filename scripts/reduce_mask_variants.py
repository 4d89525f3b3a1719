"""reduce_mask's versions side by side on the GPU (a developer's script).

    python3 scripts/reduce_mask_variants.py [--out DIR]

For each mask (N x 400 x 700 float32, windows = strides of 8, 16 or 32, a fraction of them
active): check versions 1 and 2 against the reference (the general path, then a kept plan's
replay), then time CUDA-graph replays of each beside a device copy of half the mask's bytes
(read + write = the mask's bytes), version 2's settings among them (e.g. statuses zeroed in
each call, not kept: what the fill costs); and floors: an empty kernel, a kernel that only
reads the mask, that read after a zero fill. torch.profiler splits each version's graph into
its kernels (µs a call). `--variants` picks some of VARIANTS by name.
"""

import argparse
import ast
import json
import sys
from collections import defaultdict
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench_sbnet import block_mask  # noqa: E402
from benchmarks.common import copy_ms, device_name, graph_ms  # noqa: E402


# name -> (version, settings of kernels.sbnet for it)
VARIANTS = {
    "v1": (1, {}),
    "v2": (2, {}),
    "v2 4 loads": (2, {"PASS_LOADS": 4}),
    "v2 16 loads": (2, {"PASS_LOADS": 16}),  # a 64-window chunk's 16 rows of a column in flight at once
    "v2 no wave rule": (2, {"PASS_WAVE": 0}),
    "v2 warp look-back": (2, {"PASS_LOOK_BACK": "warp"}),  # (the default before session 19)
    "v2 block look-back": (2, {"PASS_LOOK_BACK": "block"}),  # (statuses a line apart)
    "v2 block look-back packed": (2, {"PASS_LOOK_BACK": "block", "STATUS_STRIDE": 1}),
    "v2 zeroed a call": (2, {"_statuses": lambda words, stream: None}),  # scratch statuses, a fill node a call
    "v2 waves of 2": (2, {"PASS_WAVE": 2}),
    # (the stub below, in place of the warp's look-back: timing only, wrong indices)
    "v2 no look-back": (2, {"PASS_LOOK_BACK": "warp", "_look_back": None}),
    "v2 scalar loads": (2, {"PASS_VECTOR": 1}),  # one column a load where vectors would do
    "v2 64 registers": (2, {"PASS_MAX_REGISTERS": 64}),  # 4 thread blocks an SM (spills ~90 bytes)
    "v2 warp pools": (2, {"PASS_LANE_ENTRIES": 0}),  # warps pool whole windows, then a barrier
    "v2 16 a chunk": (2, {"PASS_WINDOWS": 16}),  # chunks of at most 16 windows (kernels rebuilt per variant)
    # session 14's chunks: at most 32 windows (one warp's ballot), 8 loads a thread
    "v2 32 a chunk": (2, {"PASS_WINDOWS": 32, "PASS_PIXELS_LARGE": 2048}),
    # session 19, against the warp's look-back (then the default): chunks even across the
    # multiprocessors; statuses a sector or a line apart; 512 threads a chunk
    "v2 rounds": (2, {"PASS_BALANCE": "rounds", "PASS_LOOK_BACK": "warp"}),
    "v2 rounds no look-back": (2, {"PASS_BALANCE": "rounds", "PASS_LOOK_BACK": "warp", "_look_back": None}),
    "v2 one round": (2, {"PASS_BALANCE": "one round", "PASS_LOOK_BACK": "warp"}),
    "v2 one round 512": (2, {"PASS_BALANCE": "one round", "PASS_LOOK_BACK": "warp", "PASS_THREADS": 512,
                             "PASS_WARPS": 16, "PASS_WINDOWS": 96, "PASS_COLUMNS": 2048}),
    "v2 warp look-back a sector apart": (2, {"PASS_LOOK_BACK": "warp", "STATUS_STRIDE": 4}),
    "v2 warp look-back a line apart": (2, {"PASS_LOOK_BACK": "warp", "STATUS_STRIDE": 16}),
    "v2 rounds a line apart": (2, {"PASS_BALANCE": "rounds", "PASS_LOOK_BACK": "block"}),
    # (512 threads: a column's rows split in two, 8 loads a thread, one round trip)
    "v2 512 threads": (2, {"PASS_THREADS": 512, "PASS_WARPS": 16, "PASS_LOOK_BACK": "warp"}),
    "v2 512 threads 64 registers": (2, {"PASS_THREADS": 512, "PASS_WARPS": 16, "PASS_MAX_REGISTERS": 64,
                                        "PASS_LOOK_BACK": "warp"}),
}
TIMING_ONLY = ("v2 no look-back", "v2 rounds no look-back")


def make_read_kernel():
    """read_kernel(out, data, n4, per_thread): reads the float32 `data` in 16-byte loads (n4 of
    them, `per_thread` a thread, grid-strided) and writes nothing (`out` only if a value passed
    1e30, never: the loads must not be dropped)."""
    import math

    from numba import cuda, float32, uint64

    from sparseblocks.kernels._vector import load4

    @cuda.jit
    def read_kernel(out, data, n4, per_thread):
        i = cuda.grid(1)
        step = cuda.gridsize(1)
        acc = float32(-math.inf)
        for k in range(per_thread):
            v = i + k * step
            if v < n4:
                a, b, c, d = load4(data, (uint64(4 * v),))
                acc = max(acc, max(max(a, b), max(c, d)))
        if acc > 1e30:
            out[0] = acc

    return read_kernel


def make_no_look_back():
    """A stub for kernels.sbnet's `_look_back`: every chunk first, what the pass costs without
    waiting on predecessors (timing only: wrong indices)."""
    from numba import cuda, int64

    @cuda.jit(device=True, inline=True)
    def no_look_back(status, chunk, tag, lane, stride):
        return int64(0)

    return no_look_back


def configure(sbnet, settings, no_look_back=False):
    """Set kernels.sbnet's settings from NAME=VALUE strings (Python literals), then, with
    `no_look_back`, stub the warp's look-back and take it (whatever the settings said)."""
    for setting in settings:
        name, value = setting.split("=", 1)
        setattr(sbnet, name, ast.literal_eval(value))
    if no_look_back:
        sbnet._look_back = make_no_look_back()
        sbnet.PASS_LOOK_BACK = "warp"  # (the one stubbed)


def floors(torch, mask_t):
    """Graph µs a call of what any one-kernel reduce_mask costs at least: an empty kernel, a
    kernel that only reads the mask (16-byte loads, one or four a thread, nothing written), and
    that read after an 8-byte zero fill (version 2's status fill is one such node)."""
    from numba import cuda

    from benchmarks.common import graph_ms
    from sparseblocks.kernels._launch import launch, stream_of

    @cuda.jit
    def empty_kernel(out):
        pass

    read_kernel = make_read_kernel()
    flat = mask_t.reshape(-1)
    out = torch.zeros(2, dtype=torch.float32, device="cuda")
    n4 = flat.numel() // 4

    def stream():  # (torch's current one: the capture's, when graph_ms captures)
        return stream_of(torch.cuda.current_stream().cuda_stream)

    result = {"empty kernel": graph_ms(lambda: launch(empty_kernel, 1, 32, stream(), (out,))) * 1e3}
    for per_thread in (1, 4):
        grid = -(-n4 // (256 * per_thread))
        result[f"read, {per_thread} a thread"] = graph_ms(
            lambda: launch(read_kernel, grid, 256, stream(), (out, flat, n4, per_thread))) * 1e3

    def fill_then_read():
        out.zero_()
        launch(read_kernel, -(-n4 // 256), 256, stream(), (out, flat, n4, 1))

    result["zero fill + read"] = graph_ms(fill_then_read) * 1e3
    return result


def kernel_us(torch, fn, calls=20):
    """µs a call of each kernel (and memset) that fn launches, from torch.profiler ({} if it fails)."""
    try:
        return _kernel_us(torch, fn, calls)
    except Exception as exc:  # the profile is a side figure: never stop the script for it
        print(f"profiler: {type(exc).__name__}: {exc}", flush=True)
        return {}


def _kernel_us(torch, fn, calls):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    totals = defaultdict(float)
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            totals[event.name[:60]] += event.device_time / calls
    return dict(totals)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=None)
    parser.add_argument("--fraction", type=float, default=0.1)
    parser.add_argument("--variants", default=None, help="comma-separated names of VARIANTS to time (default: all)")
    args = parser.parse_args()
    if args.variants:
        for name in set(VARIANTS) - set(args.variants.split(",")):
            del VARIANTS[name]

    import torch

    from sparseblocks.kernels import sbnet
    from sparseblocks.reference import sbnet as reference

    no_look_back = make_no_look_back()
    for name in TIMING_ONLY:
        if name in VARIANTS:
            VARIANTS[name][1]["_look_back"] = no_look_back
    defaults = {key: getattr(sbnet, key) for _, settings in VARIANTS.values() for key in settings}
    rng = np.random.default_rng(0)
    rows = []
    for n, block in [(1, 16), (1, 32), (8, 16), (8, 32), (1, 8), (8, 8)]:
        mask = block_mask(rng, n, 400, 700, block, args.fraction)
        mask_t = torch.as_tensor(mask, device="cuda")
        g = {"bsize": block, "bstride": block, "tol": 0.5}
        want = reference.reduce_mask(mask, **g)
        row = {"N": n, "window": block, "windows": int(np.prod(reference.block_count((400, 700), (block,) * 2, (0, 0)))) * n,
               "copy": copy_ms(mask.nbytes // 2, graph=True) * 1e3}  # reads + writes = the mask's bytes
        row.update(floors(torch, mask_t))
        for name, (version, settings) in VARIANTS.items():
            for key, value in {**defaults, **settings}.items():
                setattr(sbnet, key, value)
            sbnet._plans.clear()
            sbnet._kernels.clear()
            for _ in range(0 if name in TIMING_ONLY else 3):  # the general path, then the kept plan twice
                other = block_mask(rng, n, 400, 700, block, args.fraction)  # (a new mask each time)
                other_t = torch.as_tensor(other, device="cuda")
                indices, count = sbnet.reduce_mask(other_t, version=version, **g)
                expected = reference.reduce_mask(other, **g)
                k = int(count[0])
                assert k == len(expected) and np.array_equal(indices[:k].cpu().numpy(), expected), (version, n, block)
                assert (indices[k:] == -1).all()
            indices, count = sbnet.reduce_mask(mask_t, version=version, **g)
            assert int(count[0]) == len(want) or name in TIMING_ONLY
            call = lambda: sbnet.reduce_mask(mask_t, version=version, **g)  # noqa: E731
            row[name] = graph_ms(call) * 1e3
            row[f"{name} kernels"] = kernel_us(torch, call)
        for key, value in defaults.items():
            setattr(sbnet, key, value)
        rows.append(row)
        print(json.dumps(row), flush=True)
    print(f"\n{device_name()}: reduce_mask, graph µs a call, {args.fraction:.0%} of windows active; "
          "ratio = copy / ours")
    names = ["empty kernel", "read, 1 a thread", "read, 4 a thread", "zero fill + read", *VARIANTS]
    print("| N | window | windows | copy | " + " | ".join(names) + " |")
    print("|---|---|---|---|" + "---|" * len(names))
    for r in rows:
        print(f"| {r['N']} | {r['window']} | {r['windows']} | {r['copy']:.2f} | "
              + " | ".join(f"{r[name]:.2f} ({r['copy'] / r[name]:.2f})" for name in names) + " |")
    print("\nkernels (µs a call, torch.profiler):")
    for r in rows:
        for name in VARIANTS:
            print(f"  N {r['N']} window {r['window']} {name}: "
                  + ", ".join(f"{kernel[-30:]} {us:.2f}" for kernel, us in r[f"{name} kernels"].items()))
    if args.out:
        Path(args.out, "reduce_mask_variants.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
