"""reduce_mask's version 2 arm against arm, interleaved in one process (a developer's script, GPU).

    python3 scripts/reduce_mask_ab.py --arm NAME=PACKAGE[:SETTING=VALUE,...] ... [--rounds 15] [--out DIR]

An arm is a copy of the package (say `sparseblocks`, and `sparseblocks_prev` made by
`git archive <commit> | tar -x -C prev && cp -r prev/sparseblocks sparseblocks_prev`) with some of
its kernels.sbnet settings (Python literals). Differences of 5 % are below the spread of graph
timings taken one after another in separate runs (0.3-0.7 µs on a 5-6 µs call), so here every arm
(and a device copy of the mask's bytes) is captured once as a CUDA graph of 20 calls, and the
graphs are replayed in turns, round after round, each round in a rotated order: drift in clocks
or caches falls on every arm alike (two copies of one kernel came within 1.4 % of each other;
the same pair on another machine can differ by up to 5 %: compare within a run). Each arm is
checked against the reference first. Prints median µs a call over the rounds and each arm's
ratio to the first arm and to the copy.
"""

import argparse
import ast
import importlib
import json
import statistics
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench_sbnet import block_mask  # noqa: E402
from benchmarks.common import captured, device_name  # noqa: E402

CALLS = 20  # calls a graph
MASKS = [(8, 32), (8, 16), (1, 16), (1, 32), (8, 8)]


def parse_arm(text):
    name, spec = text.split("=", 1)
    package, _, settings = spec.partition(":")
    values = {}
    for item in filter(None, settings.split(",")):
        key, value = item.split("=", 1)
        values[key] = ast.literal_eval(value)
    return name, package, values


def replay_us(torch, graph, replays=5):
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    graph.replay()  # (warm: the graph's first replay of a round)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / (replays * CALLS)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--arm", action="append", required=True)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--fraction", type=float, default=0.1)
    parser.add_argument("--masks", default=None, help="e.g. 8x32,1x16 (N x window)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    masks = MASKS if not args.masks else [tuple(int(v) for v in m.split("x")) for m in args.masks.split(",")]

    import torch

    from sparseblocks.reference import sbnet as reference

    arms = [parse_arm(a) for a in args.arm]
    rng = np.random.default_rng(0)
    rows = []
    for n, window in masks:
        mask = block_mask(rng, n, 400, 700, window, args.fraction)
        mask_t = torch.as_tensor(mask, device="cuda")
        g = {"bsize": window, "bstride": window, "tol": 0.5}
        want = reference.reduce_mask(mask, **g)
        graphs = {}
        for name, package, settings in arms:
            sbnet = importlib.import_module(f"{package}.kernels.sbnet")
            defaults = {key: getattr(sbnet, key) for key in settings}
            for key, value in settings.items():
                setattr(sbnet, key, value)
            sbnet._plans.clear()
            indices, count = sbnet.reduce_mask(mask_t, **g)
            k = int(count[0])
            assert k == len(want) and np.array_equal(indices[:k].cpu().numpy(), want), (name, n, window)
            assert (indices[k:] == -1).all(), (name, n, window)
            graphs[name] = captured(lambda sbnet=sbnet: sbnet.reduce_mask(mask_t, **g), CALLS)
            for key, value in defaults.items():
                setattr(sbnet, key, value)
            sbnet._plans.clear()
        source = torch.empty(mask.nbytes // 8, dtype=torch.float32, device="cuda")  # reads + writes = the mask's bytes
        target = torch.empty_like(source)
        graphs["copy"] = captured(lambda: target.copy_(source), CALLS)
        for graph in graphs.values():
            graph.replay()
        times = {name: [] for name in graphs}
        names = list(graphs)
        for r in range(args.rounds):
            for name in names[r % len(names):] + names[:r % len(names)]:
                times[name].append(replay_us(torch, graphs[name]))
        row = {"N": n, "window": window, **{name: statistics.median(t) for name, t in times.items()},
               "spread": {name: [min(t), max(t)] for name, t in times.items()}}
        rows.append(row)
        print(json.dumps(row), flush=True)
    first = arms[0][0]
    print(f"\n{device_name()}: reduce_mask, µs a call (median of {args.rounds} interleaved rounds), "
          f"{args.fraction:.0%} of windows active; (copy / arm, arm / {first})")
    print("| N | window | copy | " + " | ".join(name for name, _, _ in arms) + " |")
    print("|---|---|---|" + "---|" * len(arms))
    for r in rows:
        print(f"| {r['N']} | {r['window']} | {r['copy']:.2f} | " + " | ".join(
            f"{r[name]:.2f} ({r['copy'] / r[name]:.3f}, {r[name] / r[first]:.3f})" for name, _, _ in arms) + " |")
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        Path(args.out, "reduce_mask_ab.json").write_text(json.dumps({"arms": args.arm, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
