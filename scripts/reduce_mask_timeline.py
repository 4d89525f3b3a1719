"""Where reduce_mask's pass kernel spends its time, chunk by chunk (a developer's script, GPU).

    python3 scripts/reduce_mask_timeline.py [--out DIR] [--replays 30] [--setting NAME=VALUE ...]

Builds the pass kernel with `PASS_TRACE` (thread 0 of each chunk stamps %globaltimer at its
start, once its columns are pooled, once it has published its own count, once its look-back is
done and once its rows are written), captures 20 calls in a CUDA graph as the benchmark does,
replays it and reads the last call's stamps. For each mask it prints the medians over replays of:
when chunks start, pool, publish, finish looking back and finish writing (ns from the first
start); each chunk's wait = its look-back's end minus the latest publication before it (what
the look-back costs beyond waiting for its predecessors); which chunk published last; and graph
µs a call with and without the stamps (what they cost). `--setting` sets one of kernels.sbnet's
settings (a Python literal) first; `--no-look-back` times the pass with a stub in place of the
look-backs (wrong indices: timing only).
"""

import argparse
import json
import statistics
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench_sbnet import block_mask  # noqa: E402
from benchmarks.common import captured, device_name, graph_ms  # noqa: E402
from scripts.reduce_mask_variants import configure  # noqa: E402

CALLS = 20  # calls a graph, as graph_ms captures


def timer_step_ns():
    """The smallest step %globaltimer takes between two reads (its resolution here)."""
    from numba import cuda

    from sparseblocks.kernels._clock import globaltimer

    @cuda.jit
    def ticks(out):
        for i in range(out.size):
            out[i] = globaltimer()

    out = cuda.device_array(4096, np.uint64)
    ticks[1, 1](out)
    steps = np.diff(out.copy_to_host().astype(np.int64))
    return int(steps[steps > 0].min()) if (steps > 0).any() else None


def timeline(torch, sbnet, mask_t, g, replays):
    """Per replay, the last call's stamps: an [n_chunks, events + 1] int64 array."""
    before = set(sbnet._status_buffers)
    graph = captured(lambda: sbnet.reduce_mask(mask_t, **g), CALLS)
    (key,) = [k for k in set(sbnet._status_buffers) - before if isinstance(k[0], tuple)]
    status = sbnet._status_buffers[key]
    events = len(sbnet.TRACE_EVENTS) + 1
    runs = []
    for _ in range(replays):
        graph.replay()
        torch.cuda.synchronize()
        words = status.copy_to_host().reshape(-1, 16)[1:]
        runs.append(words[:, 1:1 + events].copy())
    return runs


def summarize(runs):
    """Medians over replays of the timeline's figures (ns)."""
    figures = []
    for stamps in runs:
        start, pooled, published, looked, written, sm = (stamps[:, e] for e in range(6))
        t0 = start.min()
        latest_before = np.maximum.accumulate(np.concatenate([[t0], published[:-1]]))
        wait = looked - np.maximum(latest_before, published)  # beyond the predecessors' and its own
        figures.append({
            "chunks": len(start),
            "start spread": start.max() - t0,
            "pooling (median chunk)": np.median(pooled - start),
            "pooling (slowest chunk)": (pooled - start).max(),
            "last pooled": pooled.max() - t0,
            "last published": published.max() - t0,
            "last published chunk": int(np.argmax(published)),
            "ballots to publish (median)": np.median(published - pooled),
            "look-back beyond the latest publication (median)": np.median(wait[1:]) if len(wait) > 1 else 0,
            "look-back beyond the latest publication (max)": wait[1:].max() if len(wait) > 1 else 0,
            "last looked back": looked.max() - t0,
            "writes (median)": np.median(written - looked),
            "last written": written.max() - t0,
            "multiprocessors": len(set(sm.tolist())),
        })
    return {k: float(statistics.median(f[k] for f in figures)) for k in figures[0]}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=None)
    parser.add_argument("--replays", type=int, default=30)
    parser.add_argument("--setting", action="append", default=[])
    parser.add_argument("--fraction", type=float, default=0.1)
    parser.add_argument("--no-look-back", action="store_true")
    args = parser.parse_args()

    import torch

    from sparseblocks.kernels import sbnet

    configure(sbnet, args.setting, args.no_look_back)
    print(f"{device_name()}: %globaltimer steps by {timer_step_ns()} ns", flush=True)
    rng = np.random.default_rng(0)
    rows = []
    for n, block in [(8, 32), (8, 16), (1, 16), (8, 8)]:
        mask_t = torch.as_tensor(block_mask(rng, n, 400, 700, block, args.fraction), device="cuda")
        g = {"bsize": block, "bstride": block, "tol": 0.5}
        row = {"N": n, "window": block}
        for trace in (False, True):
            sbnet.PASS_TRACE = trace
            sbnet._plans.clear()
            row["graph µs, traced" if trace else "graph µs"] = graph_ms(lambda: sbnet.reduce_mask(mask_t, **g)) * 1e3
        sbnet._plans.clear()
        row.update(summarize(timeline(torch, sbnet, mask_t, g, args.replays)))
        sbnet.PASS_TRACE = False
        rows.append(row)
        print(json.dumps(row), flush=True)
    names = [k for k in rows[0] if k not in ("N", "window")]
    print("\n| figure | " + " | ".join(f"{r['N']} x 400 x 700, windows of {r['window']}" for r in rows) + " |")
    print("|---|" + "---|" * len(rows))
    for name in names:
        print(f"| {name} | " + " | ".join(f"{r[name]:.2f}" if isinstance(r[name], float) else str(r[name])
                                         for r in rows) + " |")
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        Path(args.out, "reduce_mask_timeline.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
