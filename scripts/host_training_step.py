"""Host time of one eager training step of the sparse ResNet block, beside the dense block's (a
developer's script, GPU).

    python3 scripts/host_training_step.py [--fraction 0.1] [--dtype float16] [--steps 30]

The benchmark's step (forward into a copy, backward with a fixed output gradient). Steps are
queued behind a long device sleep, so the host's clock reads the host's time alone (the queue
never fills). Prints, for the sparse block (with and without ``graphs=True``) and the dense one:
host µs a step, the step from an idle device as the benchmark times it; then cProfile's top
functions of the sparse step without graphs, and torch's profiler's ops by self CPU time.
"""

import argparse
import cProfile
import io
import pstats
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from benchmarks.common import time_ms  # noqa: E402
from res_block_ab import sleep_cycles_per_ms, training_case  # noqa: E402


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--fraction", type=float, default=0.1)
    parser.add_argument("--dtype", default="float16")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--top", type=int, default=40)
    args = parser.parse_args()

    import torch

    torch.backends.cudnn.allow_tf32 = False
    block, indices, count, step, _ = training_case(torch, getattr(torch, args.dtype), args.fraction)

    def sparse_graphs():
        block.graphs = True
        try:
            step(lambda t: block(t, indices, count))
        finally:
            block.graphs = False

    calls = {"sparse": lambda: step(lambda t: block(t, indices, count)), "sparse, graphs=True": sparse_graphs,
             "dense": lambda: step(block.dense)}
    cycles_per_ms = sleep_cycles_per_ms(torch)

    def behind_sleep(fn, steps):
        """Host µs a step with the device busy sleeping (ms of sleep: ~3 a step, enough to cover)."""
        torch.cuda.synchronize()
        torch.cuda._sleep(int(3 * steps * cycles_per_ms))
        begin = time.perf_counter()
        for _ in range(steps):
            fn()
        host = (time.perf_counter() - begin) / steps * 1e6
        pending = not torch.cuda.current_stream().query()
        torch.cuda.synchronize()
        return host, pending

    for name, fn in calls.items():
        for _ in range(10):
            fn()
        torch.cuda.synchronize()
        hosts, pendings = zip(*(behind_sleep(fn, args.steps) for _ in range(5)))
        print(f"{name:22s} host {statistics.median(hosts):8.1f} µs a step (still sleeping at the end: "
              f"{all(pendings)}); from idle {time_ms(fn) * 1e3:8.1f} µs")

    sparse = calls["sparse"]
    profiler = cProfile.Profile()
    torch.cuda.synchronize()
    torch.cuda._sleep(int(3 * args.steps * cycles_per_ms))
    profiler.enable()
    for _ in range(args.steps):
        sparse()
    profiler.disable()
    torch.cuda.synchronize()
    out = io.StringIO()
    pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(args.top)
    print(out.getvalue())
    out = io.StringIO()
    pstats.Stats(profiler, stream=out).sort_stats("cumtime").print_stats(args.top)
    print(out.getvalue())

    from torch.profiler import ProfilerActivity, profile

    torch.cuda._sleep(int(3 * args.steps * cycles_per_ms))
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(args.steps):
            sparse()
    torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.top))


if __name__ == "__main__":
    main()
