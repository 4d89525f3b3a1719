"""Shared benchmark plumbing: CUDA-event timing, one table, one JSON format.

Every benchmark checks its output against the reference first, then times
with `time_ms` (median of CUDA-event timings after warm-up), collects
`Record`s whose baselines were measured in the same run, prints them with
`print_table` and saves them with `write_results`:

    benchmarks/results/<bench>.json = {"device": ..., "date": ..., "records": [
        {"name": ..., "params": {...}, "ms": ..., "baselines": {"<name>": ms, ...}}, ...]}
    benchmarks/results/<bench>.md   = the printed table

A baseline that fails is recorded as NaN (`baseline_ms`), never a crash.
Absolute times mean something only on a GPU; on the simulator run nothing here.
"""

import datetime
import json
import math
import statistics
import sys
import traceback
from dataclasses import dataclass, field
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


@dataclass
class Record:
    name: str
    params: dict
    ms: float
    baselines: dict = field(default_factory=dict)
    flops: float = None  # useful work, for TFLOP/s; not written to JSON
    bytes: float = None  # bytes moved, for GB/s; not written to JSON

    def to_json(self):
        return {"name": self.name, "params": self.params, "ms": _finite(self.ms),
                "baselines": {k: _finite(v) for k, v in self.baselines.items()}}


def _finite(value):
    return None if value is None or not math.isfinite(value) else round(float(value), 6)


def _events():
    """Start/stop event factory: torch's when torch has CUDA, else Numba's."""
    try:
        import torch

        if torch.cuda.is_available():
            return lambda: torch.cuda.Event(enable_timing=True), lambda start, stop: start.elapsed_time(stop)
    except ImportError:
        pass
    from numba import cuda

    return lambda: cuda.event(timing=True), lambda start, stop: cuda.event_elapsed_time(start, stop)


def time_ms(fn, warmup=10, repeat=50, setup=None, budget_ms=600.0):
    """Median milliseconds of ``fn()`` over up to `repeat` CUDA-event timings after warm-up.

    Events are recorded on the current stream (torch's when torch is present).
    ``setup(i)``, if given, runs before the i-th call outside the timed region
    (for example to rotate among input sets so the L2 cache does not flatter).
    Slow calls get fewer repeats (at least 5), so one figure costs about
    `budget_ms` of GPU time.
    """
    make_event, elapsed = _events()

    def once(i):
        if setup:
            setup(i)
        start, stop = make_event(), make_event()
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        return elapsed(start, stop)

    for i in range(warmup):
        last = once(i)
        if last * (i + 1) > budget_ms / 4:
            break  # slow enough: the rest of the warm-up adds nothing
    repeat = max(5, min(repeat, int(budget_ms / max(last, 1e-3))))
    return statistics.median(once(i) for i in range(repeat))


def baseline_ms(fn, timer=None, **kwargs):
    """``timer(fn)`` (`time_ms` by default), or NaN when the baseline cannot run (reported on stderr)."""
    try:
        return (timer or time_ms)(fn, **kwargs)
    except Exception:  # a missing or failing baseline must not stop the benchmark
        traceback.print_exc(file=sys.stderr)
        return float("nan")


def warmed(fn, runs=3):
    """``fn()`` `runs` times on a side stream, joined back to the current one: what a CUDA-graph
    capture of fn needs first (compiles, caches streams and buffers where the capture will find
    them)."""
    import torch

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(runs):
            fn()
    torch.cuda.current_stream().wait_stream(side)


def captured(fn, calls=20):
    """A torch CUDA graph of `calls` calls of ``fn()``, after `warmed`."""
    import torch

    warmed(fn)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    return graph


def graph_ms(fn, calls=20, **kwargs):
    """Device time of one ``fn()``: `calls` calls captured in one torch CUDA graph, replays timed.

    Replaying a graph leaves out the host's launch costs, so small kernels are
    timed for what they do on the device. NaN (reported) if capture fails.
    """

    try:
        return time_ms(captured(fn, calls).replay, **kwargs) / calls
    except Exception:  # a capture failure must not stop the benchmark
        traceback.print_exc(file=sys.stderr)
        return float("nan")


def queued_ms(fn, calls=20):
    """Device time of one ``fn()``: `calls` calls queued behind a sleeping kernel, so that the host
    has launched them all before the device starts, timed by events around them. For calls that
    replay CUDA graphs of their own (``torch.compile(mode="reduce-overhead")``), which `graph_ms`
    cannot capture in another."""
    import torch

    for _ in range(3):
        fn()
    make_event, elapsed = _events()
    times = []
    for _ in range(5):
        torch.cuda.synchronize()
        torch.cuda._sleep(200_000_000)  # ~0.1 s of device time ahead of the calls
        start, stop = make_event(), make_event()
        start.record()
        for _ in range(calls):
            fn()
        stop.record()
        stop.synchronize()
        times.append(elapsed(start, stop) / calls)
    return statistics.median(times)


def copy_ms(n_bytes, graph=False):
    """Device-to-device copy of `n_bytes` through torch: the bandwidth baseline (`graph`: replayed)."""
    import torch

    src = torch.empty(max(n_bytes // 4, 1), dtype=torch.float32, device="cuda").uniform_()
    dst = torch.empty_like(src)
    return graph_ms(lambda: dst.copy_(src)) if graph else baseline_ms(lambda: dst.copy_(src))


def device_name():
    try:
        import torch

        if torch.cuda.is_available():
            return torch.cuda.get_device_name()
    except ImportError:
        pass
    from sparseblocks.runtime.backend import backend_name

    return backend_name()


def _cell(value, digits=3):
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "nan"
    return f"{value:.{digits}g}" if isinstance(value, float) else str(value)


def format_table(records):
    """Markdown table: params, ms, TFLOP/s or GB/s, then each baseline's ms and ratio (baseline / ours)."""
    baseline_names = sorted({b for r in records for b in r.baselines})
    param_names = list(dict.fromkeys(p for r in records for p in r.params))
    header = ["name", *param_names, "ms", "TFLOP/s", "GB/s"]
    for b in baseline_names:
        header += [f"{b} ms", f"{b}/ours"]
    rows = [header, ["---"] * len(header)]
    for r in records:
        row = [r.name, *[_cell(r.params.get(p, "")) for p in param_names], _cell(r.ms, 4)]
        row.append(_cell(r.flops / r.ms / 1e9) if r.flops and r.ms else "")
        row.append(_cell(r.bytes / r.ms / 1e6) if r.bytes and r.ms else "")
        for b in baseline_names:
            base = r.baselines.get(b)
            row += [_cell(base, 4), _cell(base / r.ms if base is not None and r.ms else None)]
        rows.append(row)
    return "\n".join("| " + " | ".join(row) + " |" for row in rows)


def print_table(records, title=""):
    if title:
        print(f"\n{title}")
    print(format_table(records))


def merged_records(paths, case, flops=None, moved=None):
    """(records, device) of several runs' JSON files: a later file's record of a case
    (``case(name, params)``, a tuple) replaces an earlier one's, so that a re-run of some cases
    updates results in place; ``flops(name, params)`` restores TFLOP/s and ``moved(name, params)``
    GB/s (None: none); the device is the first file's."""
    records, device = {}, None
    for path in paths:
        document = json.loads(Path(path).read_text())
        device = device or document["device"]
        for r in document["records"]:
            name, params = r["name"], r["params"]
            baselines = {k: float("nan") if v is None else v for k, v in r["baselines"].items()}
            records[case(name, params)] = Record(name, params, float("nan") if r["ms"] is None else r["ms"],
                                                 baselines, flops=flops(name, params) if flops else None,
                                                 bytes=moved(name, params) if moved else None)
    return list(records.values()), device


def merge_runs(bench, paths, out_dir=None, flops=None, moved=None):
    """Merge runs' JSON files into `<bench>.json` and `.md` (a later file's record of a case, its
    name and every param, replaces an earlier one's): the ``--merge`` of benchmarks whose runs
    are split by their options (``flops``, ``moved``: as `merged_records`')."""
    records, device = merged_records(paths, lambda name, params: (name, *sorted(params.items())), flops, moved)
    print_table(records, f"{bench} (merged)")
    return write_results(bench, records, device, **({"directory": out_dir} if out_dir else {}))


def write_results(bench, records, device=None, directory=RESULTS):
    """Write `<bench>.json` and `<bench>.md` under `directory`; returns the JSON path."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    device = device or device_name()
    date = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    document = {"device": device, "date": date, "records": [r.to_json() for r in records]}
    path = directory / f"{bench}.json"
    path.write_text(json.dumps(document, indent=1) + "\n")
    (directory / f"{bench}.md").write_text(
        f"# {bench}\n\nDevice: {device}; {date}. Ratios are baseline time / ours (> 1: ours is faster).\n\n"
        + format_table(records) + "\n"
    )
    return path
