"""The sparse ResNet block's eager calls, arm against arm, interleaved in one process (a developer's
script, GPU).

    python3 scripts/res_block_ab.py --arm NAME=PACKAGE ... [--rounds 7] [--dtypes float16,float32]
                                    [--fractions 0.05,0.1,0.25,0.5] [--profile] [--out DIR]

An arm is a copy of the package (`sparseblocks`, and say `sparseblocks_prev` made by
`git archive <commit> | tar -x -C prev && cp -r prev/sparseblocks sparseblocks_prev`). The
benchmark's shape (1 x 256 x 400 x 700 -> 64, windows of 16, channels_last), per dtype and active
fraction: each arm's training step (forward and backward, not in place) is checked against the
dense block's masked gradients, then every arm and the dense block are timed in turns, round after
round in rotated order: an eager step as the benchmark times it (CUDA events around one call,
median) and the host's time alone (`profile_host.host_us`), and the in-place forward both ways.
Eager calls of this block are host-bound and the host's speed drifts; compare within a run.
``--profile``: cProfile's top functions of each arm's fp16 training step at 10 %. ``--graph``: each
call's device time too (10 calls captured in one CUDA graph, replays timed in the same rounds; arms
with graphs=True are left out: in a caller's capture they launch their kernels as the others do).
"""

import argparse
import importlib
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from benchmarks.common import captured, device_name, time_ms  # noqa: E402
from profile_host import host_us, top_functions  # noqa: E402


def windows_of(block, fraction, seed=1):
    """A mask with one pixel at the centre of `fraction` of the windows, as the benchmark makes."""
    p = block.geometry((1, 256, 400, 700))
    chosen = np.argwhere(np.random.default_rng(seed).random(p.bcount) < fraction)
    mask = np.zeros((1, 400, 700), np.float32)
    mask[0, p.boffset[0] + chosen[:, 0] * p.bstride[0] + p.bsize[0] // 2,
         p.boffset[1] + chosen[:, 1] * p.bstride[1] + p.bsize[1] // 2] = 1
    return mask


def training_case(torch, dtype, fraction, graphs=False):
    """The benchmark's block (channels_last, seeded), its windows at `fraction`, and its training
    step: ``step(forward)`` runs ``forward`` on a copy of the input that needs a gradient (xg),
    then the backward of a fixed output gradient. Returns (block, indices, count, step, xg)."""
    from sparseblocks.sbnet_torch import SparseResBlock

    torch.manual_seed(0)
    block = SparseResBlock(256, 64, block_size=16, graphs=graphs).to("cuda", dtype).to(
        memory_format=torch.channels_last)
    x = torch.randn(1, 256, 400, 700, device="cuda", dtype=dtype).to(memory_format=torch.channels_last)
    indices, count = block.active_blocks(torch.as_tensor(windows_of(block, fraction), device="cuda"), tol=0.5)
    xg = x.detach().clone().requires_grad_(True)
    grad_y = torch.randn_like(x)

    def step(forward):
        xg.grad = None
        block.zero_grad(set_to_none=True)
        forward(xg).backward(grad_y)

    return block, indices, count, step, xg


def sleep_cycles_per_ms(torch):
    """Cycles of ``torch.cuda._sleep`` a millisecond, measured (the first call also loads the kernel)."""
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(2):
        start.record()
        torch.cuda._sleep(1_000_000)
        stop.record()
        stop.synchronize()
    return 1_000_000 / start.elapsed_time(stop)


def queued_host_us(torch, fn, calls, cycles_per_ms, rounds=5, sleep_ms_a_call=1.0):
    """Median host µs of one ``fn()`` over `rounds` runs of `calls` calls, each run queued behind
    a device sleep of `sleep_ms_a_call` a call, so that the host's clock reads the host alone."""
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    runs = []
    for _ in range(rounds):
        torch.cuda._sleep(int(calls * cycles_per_ms * sleep_ms_a_call))
        begin = time.perf_counter()
        for _ in range(calls):
            fn()
        runs.append((time.perf_counter() - begin) / calls * 1e6)
        assert not torch.cuda.current_stream().query(), "the sleep ran out: raise it"
        torch.cuda.synchronize()
    return statistics.median(runs)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--arm", action="append", required=True)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--dtypes", default="float16,float32")
    parser.add_argument("--fractions", default="0.05,0.1,0.25,0.5")
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--graph", action="store_true")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    import torch

    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cuda.matmul.allow_tf32 = False
    arms = [(name, importlib.import_module(package + ".sbnet_torch"))
            for name, package in (a.split("=", 1) for a in args.arm)]
    rows = []
    for dtype_name in args.dtypes.split(","):
        dtype = getattr(torch, dtype_name)
        torch.manual_seed(0)
        blocks = {}
        for name, module in arms:
            blocks[name] = module.SparseResBlock(256, 64, block_size=16).to("cuda", dtype).to(
                memory_format=torch.channels_last)
            blocks[name].load_state_dict(blocks[arms[0][0]].state_dict())
        dense = blocks[arms[0][0]]
        x = torch.randn(1, 256, 400, 700, device="cuda", dtype=dtype).to(memory_format=torch.channels_last)
        xg = x.detach().clone().requires_grad_(True)
        grad_y = torch.randn_like(x)

        def step(block, forward):
            xg.grad = None
            block.zero_grad(set_to_none=True)
            forward(xg).backward(grad_y)

        for fraction in (float(f) for f in args.fractions.split(",")):
            mask = torch.as_tensor(windows_of(dense, fraction), device="cuda")
            indices, count = dense.active_blocks(mask, tol=0.5)
            with torch.no_grad():
                active = (dense(x, indices, count) != x).any(dim=1, keepdim=True)
            step(dense, lambda x: torch.where(active, dense.dense(x), x))
            want = [xg.grad.clone()] + [c.weight.grad.clone() for c in (dense.conv1, dense.conv2, dense.conv3)]
            calls = {"dense training": lambda: step(dense, dense.dense),
                     "dense forward": lambda: dense.dense(x)}
            work = x.clone()

            def check_training(name, block):
                """One training step of `block`, its gradients checked against the dense block's."""
                step(block, lambda x: block(x, indices, count))
                got = [xg.grad] + [c.weight.grad for c in (block.conv1, block.conv2, block.conv3)]
                for g, w in zip(got, want):
                    error = ((g - w).abs().max() / w.abs().max()).item()
                    assert error < 2e-2, f"{name}: gradient differs by {error}"

            for name, module in arms:
                block = blocks[name]
                check_training(name, block)
                calls[f"{name} training"] = lambda block=block: step(block, lambda x: block(x, indices, count))
                calls[f"{name} forward"] = lambda block=block: block(work, indices, count, inplace=True)
                if hasattr(block, "release_graphs"):  # (graphs=True: a CUDA graph of the residual)
                    graphed = module.SparseResBlock(256, 64, block_size=16, graphs=True).to("cuda", dtype).to(
                        memory_format=torch.channels_last)
                    graphed.load_state_dict(block.state_dict())
                    calls[f"{name} forward graphs"] = lambda g=graphed: g(work, indices, count, inplace=True)
                    if hasattr(module, "_Lease"):  # (graphs for training calls too)
                        check_training(f"{name} with graphs", graphed)
                        calls[f"{name} training graphs"] = lambda g=graphed: step(g, lambda x: g(x, indices, count))
            eager = {key: [] for key in calls}
            host = {key: [] for key in calls}
            keys = list(calls)
            graphs, device = {}, {key: [] for key in calls}
            if args.graph:
                for key in keys:
                    if "graphs" not in key:
                        with torch.set_grad_enabled("training" in key):
                            graphs[key] = captured(calls[key], calls=10)
            for r in range(args.rounds):
                for key in keys[r % len(keys):] + keys[:r % len(keys)]:
                    with torch.set_grad_enabled("training" in key):
                        eager[key].append(time_ms(calls[key], warmup=3, repeat=15))
                        host[key].append(host_us(torch, calls[key], calls=20) / 1e3)
                        if key in graphs:
                            device[key].append(time_ms(graphs[key].replay, warmup=2, repeat=10) / 10)
            del graphs
            for key in keys:
                rows.append({"dtype": dtype_name, "active": fraction, "windows": len(indices), "call": key,
                             "eager_ms": statistics.median(eager[key]), "host_ms": statistics.median(host[key]),
                             "graph_ms": statistics.median(device[key]) if device[key] else None})
                r = rows[-1]
                kind = "training" if "training" in key else "forward"
                base = statistics.median(eager["dense " + kind])
                graphed = "" if r["graph_ms"] is None else (
                    f"  graph {r['graph_ms']:.3f} ms, dense/this "
                    f"{statistics.median(device['dense ' + kind]) / r['graph_ms']:.2f}x")
                print(f"{dtype_name} {fraction:5.2f} {key:24s} eager {r['eager_ms']:.3f} ms host "
                      f"{r['host_ms']:.3f} ms  dense/this {base / r['eager_ms']:.2f}x{graphed}", flush=True)
            if args.profile and dtype_name == "float16" and abs(fraction - 0.1) < 1e-9:
                for name, _ in arms:
                    print(f"==== cProfile: {name} training step, fp16, 10 %")
                    print(top_functions(torch, calls[f"{name} training"], calls=50, rows=30))
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "res_block_ab.json").write_text(json.dumps({"device": device_name(), "rows": rows},
                                                                     indent=1))


if __name__ == "__main__":
    main()
