"""The benchmark's sparse-block rows (fp16) in a fresh process, after the benchmark's gather and
scatter rows, and with the garbage collector frozen: does the process's state move the eager
rows? (a developer's script, GPU)

    python3 scripts/res_block_state.py {fresh,after-ops,after-ops-frozen}
"""

import gc
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import bench_sbnet  # noqa: E402


def main():
    import torch

    from sparseblocks import sbnet_torch
    from sparseblocks.kernels import sbnet
    from sparseblocks.reference import sbnet as reference

    mode = sys.argv[1]
    records = []
    if mode != "fresh":
        bench_sbnet.bench_ops(torch, sbnet, reference, records, [(1, 400, 700), (8, 400, 700)], [64, 256], [16, 32],
                              [0.05, 0.1, 0.25, 0.5])
        print("objects tracked by gc:", len(gc.get_objects()), "counts", gc.get_count(), flush=True)
    if mode.endswith("frozen"):
        gc.collect()
        gc.freeze()
    collections = []
    gc.callbacks.append(lambda phase, info: collections.append((phase, info["generation"], time.perf_counter())))
    records = []
    bench_sbnet.bench_res_block(torch, sbnet_torch, records, [0.05, 0.1, 0.25, 0.5], "float16")
    print("gc collections during the block's rows:",
          {g: sum(1 for p, gen, _ in collections if p == "start" and gen == g) for g in range(3)})
    for r in records:
        d = r.to_json()
        if d["params"].get("timing") == "eager":
            print(mode, d["params"].get("step"), d["params"].get("stack"), d["params"].get("graphs", ""),
                  d["params"]["active"], f"{d['ms']:.3f}", {k: round(v, 3) for k, v in d["baselines"].items()})


if __name__ == "__main__":
    main()
