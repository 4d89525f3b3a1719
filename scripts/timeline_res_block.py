"""Where the device waits inside one eager training step of the sparse ResNet block (a developer's
script, GPU).

    python3 scripts/timeline_res_block.py [--dtype float16] [--active 0.5] [--graphs] [--steps 5]
                                          [--sleep-ms 3] [--out DIR]

The benchmark's shape and step (forward and backward, not in place). Three readings:

1. The eager step as the benchmark times it (CUDA events around one call from an idle device).
2. The same step queued behind `--sleep-ms` of device sleep (``torch.cuda._sleep``): the host
   runs ahead, so the step's device time alone is what follows the sleep. If (1) is far above
   (2), the device waits for the host somewhere.
3. torch's profiler over `--steps` steps, each from an idle device (or behind `--profile-sleep-ms`): per step, the device's busy
   time and every gap over 5 µs between its kernels, with the host call that launched the kernel
   after the gap and any synchronizing runtime call (``*Synchronize``, ``cudaMemcpy``, ``cudaMalloc``,
   ``cudaFree``) on the host in that step. The profiler slows the host, so gaps are larger than
   without it; where they fall is the point. Each step's kernels are listed too (name, gap before,
   duration).
"""

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from benchmarks.common import time_ms  # noqa: E402
from res_block_ab import sleep_cycles_per_ms, training_case  # noqa: E402

SYNCING = ("Synchronize", "cudaMemcpy", "cudaMalloc", "cudaFree", "cuMemAlloc", "cuMemFree", "cuCtxSynchronize",
           "cuStreamSynchronize", "cudaEventSynchronize", "cuMemcpy")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--dtype", default="float16")
    parser.add_argument("--active", type=float, default=0.5)
    parser.add_argument("--graphs", action="store_true")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--sleep-ms", type=float, default=3.0)
    parser.add_argument("--profile-sleep-ms", type=float, default=0.0,
                        help="queue each profiled step behind this much device sleep (device-bound gaps)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    import torch

    torch.backends.cudnn.allow_tf32 = False
    block, indices, count, step, xg = training_case(torch, getattr(torch, args.dtype), args.active, graphs=args.graphs)

    sparse = lambda: step(lambda t: block(t, indices, count))  # noqa: E731
    dense = lambda: step(block.dense)  # noqa: E731
    cycles_per_ms = sleep_cycles_per_ms(torch)
    sleep_cycles = int(args.sleep_ms * cycles_per_ms)

    def behind_sleep(fn):
        def timed():
            torch.cuda._sleep(sleep_cycles)
            fn()
        return time_ms(timed) - time_ms(lambda: torch.cuda._sleep(sleep_cycles))

    report = {"windows": len(indices), "graphs": args.graphs, "dtype": args.dtype,
              "pieces_us": host_pieces(torch, block, xg, indices, count, step)}
    print(report["pieces_us"], flush=True)
    for name, fn in (("sparse", sparse), ("dense", dense)):
        for _ in range(5):
            fn()
        torch.cuda.synchronize()
        report[name] = {"eager_ms": time_ms(fn), "behind_sleep_ms": behind_sleep(fn)}
        print(name, report[name], flush=True)

    from torch.profiler import ProfilerActivity, profile

    for name, fn in (("sparse", sparse), ("dense", dense)):
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], with_stack=True) as prof:
            for i in range(args.steps):
                torch.cuda.synchronize()
                if args.profile_sleep_ms:
                    torch.cuda._sleep(int(args.profile_sleep_ms * cycles_per_ms))
                with torch.profiler.record_function(f"step{i}"):
                    fn()
                torch.cuda.synchronize()
        path = Path(args.out or ".") / f"trace_{name}.json"
        prof.export_chrome_trace(str(path))
        report[name]["steps"] = analyse(json.loads(path.read_text()), args.steps)
        for s in report[name]["steps"]:
            print(name, json.dumps(s), flush=True)
    if args.out:
        (Path(args.out) / "timeline.json").write_text(json.dumps(report, indent=1))


def host_pieces(torch, block, xg, indices, count, step):
    """Host µs of the pieces of a training step's host work (`profile_host.host_us`)."""
    from profile_host import host_us

    from sparseblocks.kernels import sbnet as kernels
    from sparseblocks.sbnet_torch import _Windows

    p = block.geometry(xg.shape)
    image = xg.detach().permute(0, 2, 3, 1)
    windows = _Windows(indices, count, False, "NHWC", (p.bsize, p.bstride, p.boffset), (p.bsize_out, p.bsize_out, 0))
    stack = windows.gather(image)
    out = torch.zeros((len(indices), *p.bsize_out, image.shape[-1]), dtype=image.dtype, device=image.device)
    windows.scatter(out, image, False, atomic=False)
    windows.scatter(stack, image, False, atomic=True, at=windows.gather_at)
    kept = kernels.kept_launches(image, indices, out, count, p.bsize, p.bstride, p.boffset, False, "NHWC", False,
                                 (p.bsize_out, p.bsize_out, 0))
    stream = torch.cuda.current_stream().cuda_stream
    gather, scatter = kept[0], kept[1]
    pieces = {
        "gather (public, kept plan)": lambda: windows.gather(image, out=stack),
        "gather (kept launch)": lambda: gather(stream, image.data_ptr(), stack.data_ptr(), indices.data_ptr(),
                                               count.data_ptr()),
        "scatter into copy (public, kept plan)": lambda: windows.scatter(out, image, False, atomic=False),
        "scatter into copy (kept launch)": lambda: scatter(stream, image, out.data_ptr(), indices.data_ptr(),
                                                           count.data_ptr()),
        "atomic scatter into copy (public)": lambda: windows.scatter(stack, image, False, atomic=True,
                                                                     at=windows.gather_at),
        "torch.empty_like(image)": lambda: torch.empty_like(image),
        "zero_grad + grad None": lambda: (block.zero_grad(set_to_none=True), setattr(xg, "grad", None)),
        "forward with grad": lambda: block(xg, indices, count),
        "training step": lambda: step(lambda t: block(t, indices, count)),
        "dense forward with grad": lambda: block.dense(xg),
        "dense training step": lambda: step(block.dense),
    }
    return {name: round(host_us(torch, fn, calls=20), 1) for name, fn in pieces.items()}


def analyse(trace, steps):
    events = [e for e in trace["traceEvents"] if e.get("ph") == "X"]
    device = sorted((e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")),
                    key=lambda e: e["ts"])
    runtime = {e["args"].get("correlation"): e for e in events if e.get("cat") in ("cuda_runtime", "cuda_driver")}
    python = [e for e in events if e.get("cat") == "python_function"]
    out = []
    for i in range(steps):
        marker = next(e for e in events if e.get("name") == f"step{i}" and e.get("cat") == "user_annotation")
        t0, t1 = marker["ts"], marker["ts"] + marker["dur"]
        launched = [runtime.get(k["args"].get("correlation")) for k in device]
        mine = [(k, r) for k, r in zip(device, launched) if r is not None and t0 <= r["ts"] <= t1]
        busy = sum(k["dur"] for k, _ in mine)
        gaps, listing = [], []
        end = mine[0][0]["ts"] if mine else t0
        for k, r in mine:
            listing.append((k["name"][:50], round(k["ts"] - end, 1), round(k["dur"], 1)))
            if k["ts"] - end > 5:
                gaps.append({"gap_us": round(k["ts"] - end, 1), "kernel": k["name"][:60],
                             "launch": r["name"], "host_lead_us": round(k["ts"] - r["ts"] - r["dur"], 1),
                             "from": innermost(python, r["ts"])})
            end = max(end, k["ts"] + k["dur"])
        syncs = [{"call": e["name"], "dur_us": e["dur"], "from": innermost(python, e["ts"])} for e in events
                 if e.get("cat") in ("cuda_runtime", "cuda_driver") and t0 <= e["ts"] <= t1
                 and any(s in e["name"] for s in SYNCING)]
        out.append({"host_us": marker["dur"], "first_kernel_after_us": round(mine[0][0]["ts"] - t0, 1) if mine else None,
                    "device_span_us": round(end - mine[0][0]["ts"], 1) if mine else 0, "busy_us": round(busy, 1),
                    "kernels": len(mine), "gaps": gaps, "syncs": syncs, "listing": listing})
    return out


def innermost(python, ts):
    """The innermost profiled Python frames around `ts` (our own code's, if any)."""
    around = [e for e in python if e["ts"] <= ts <= e["ts"] + e["dur"]]
    around.sort(key=lambda e: e["ts"])
    names = [e["name"] for e in around if "sparseblocks" in e["name"] or "scripts" in e["name"]]
    return names[-3:] if names else [e["name"] for e in around[-2:]]


if __name__ == "__main__":
    main()
