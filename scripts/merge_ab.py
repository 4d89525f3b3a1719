"""Scatters into a copy of y, merged in one pass (`sbnet.MERGE`, version 2) against y copied and then
scattered into (version 1), interleaved in one process (a developer's script, GPU).

    python3 scripts/merge_ab.py [--rounds 5] [--out DIR]

The sparse ResNet block's two scatters into a copy, on its shape (1 x 400 x 700 x 256, fp16 and
fp32): the forward's (output windows of 14, every 14, adding) and the input gradient's (windows of
16 every 14 from -1, overlapping by their halo: atomic adds), at 5-50 % of the windows. Each
version's output is checked against the reference first; then both, and a device copy of y, are
timed in turns (graph replays and eager calls, medians over rounds).
"""

import argparse
import json
import statistics
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import device_name, graph_ms, time_ms  # noqa: E402


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    import torch

    from sparseblocks.kernels import sbnet
    from sparseblocks.reference import sbnet as reference

    rng = np.random.default_rng(0)
    rows = []
    for dtype_name in ("float16", "float32"):
        dtype = getattr(torch, dtype_name)
        y = torch.randn(1, 400, 700, 256, device="cuda", dtype=dtype)
        for name, g, atomic in [("forward 14/14", {"bsize": 14, "bstride": 14, "boffset": 0}, False),
                                ("input grad 16/14", {"bsize": 16, "bstride": 14, "boffset": -1}, True)]:
            grid = reference.block_count((400, 700), (14, 14), (g["boffset"],) * 2)
            for fraction in (0.05, 0.1, 0.25, 0.5):
                chosen = np.argwhere(rng.random(grid) < fraction)
                indices = np.ascontiguousarray(np.concatenate([np.zeros((len(chosen), 1), np.int64), chosen], axis=1),
                                               np.int32)
                idx = torch.as_tensor(indices, device="cuda")
                blocks = torch.randn(len(indices), g["bsize"], g["bsize"], 256, device="cuda", dtype=dtype)
                want = reference.sparse_scatter(blocks.double().cpu().numpy(), indices, y.double().cpu().numpy(),
                                                add=True, **g)
                calls = {}
                for merge in (True, False):
                    def call(merge=merge):
                        sbnet.MERGE, sbnet.MERGE_MIN_COVER = merge, 0  # (read by the general path; each
                        # version keeps its own plan)
                        return sbnet.sparse_scatter(blocks, idx, y, add=True, atomic=atomic, **g)
                    sbnet._plans.clear()
                    for _ in range(2):  # the general path, then the kept plan
                        got = call().double().cpu().numpy()
                        error = np.abs(got - want).max()
                        assert error < (2e-2 if dtype_name == "float16" else 1e-5), (merge, error)
                    calls["merged" if merge else "copy, then scatter"] = call
                out = torch.empty_like(y)
                calls["copy of y"] = lambda: out.copy_(y)
                times = {key: {"graph": [], "eager": []} for key in calls}
                keys = list(calls)
                for r in range(args.rounds):
                    for key in keys[r % len(keys):] + keys[:r % len(keys)]:
                        sbnet._plans.clear()  # (a plan is kept per version: MERGE is read once)
                        calls[key]()
                        times[key]["graph"].append(graph_ms(calls[key], repeat=20))
                        times[key]["eager"].append(time_ms(calls[key], warmup=3, repeat=20))
                copy = statistics.median(times["copy of y"]["graph"])
                for key in keys:
                    row = {"dtype": dtype_name, "scatter": name, "active": fraction, "windows": len(indices),
                           "call": key, **{t: statistics.median(v) for t, v in times[key].items()}}
                    rows.append(row)
                    print(f"{dtype_name} {name:17s} {fraction:4.2f} {key:20s} graph {row['graph'] * 1e3:8.1f} us "
                          f"eager {row['eager'] * 1e3:8.1f} us  copy/this {copy / row['graph']:.2f}", flush=True)
    sbnet.MERGE = True
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "merge_ab.json").write_text(json.dumps({"device": device_name(), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
