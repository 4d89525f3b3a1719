"""Which Python code runs, on which thread, while `res_block_ab.py --graph` captures (a developer's
probe, GPU): session 25's fp32 capture failure ("operation would make the legacy stream depend on a
capturing blocking stream").

    python3 scripts/diag_capture.py [global|thread_local|relaxed] -- RES_BLOCK_AB_ARGS...

Every capture of the A/B script is made with the given capture_error_mode; while one is open,
sys.monitoring records each Python function started (any thread) outside torch, and gc's runs.
A failed capture prints them and the traceback.
"""

import gc
import sys
import threading
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

import benchmarks.common as common  # noqa: E402

MODE = sys.argv[1]
LOG = []
ON = [False]
TOOL = 3


def started(code, offset):
    if ON[0]:
        name = code.co_filename
        if "torch" not in name or "autograd" in name:
            LOG.append((threading.get_ident(), name.rsplit("site-packages/", 1)[-1], code.co_name))


def collected(phase, info):
    if ON[0]:
        LOG.append((threading.get_ident(), "gc", f"{phase} gen {info.get('generation')}"))


def captured(fn, calls=20):
    common.warmed(fn)
    gc.collect()
    held = {}
    for obj in gc.get_objects():  # live tensors with an autograd history: what keeps graph nodes alive
        try:
            if isinstance(obj, torch.Tensor) and obj.grad_fn is not None:
                name = f"{type(obj.grad_fn).__name__} {tuple(obj.shape)} {obj.dtype}"
                held[name] = held.get(name, 0) + 1
            elif type(obj).__name__.endswith("Backward") and hasattr(obj, "saved_tensors"):
                name = f"ctx {type(obj).__name__}"
                held[name] = held.get(name, 0) + 1
        except Exception:
            pass
    print(f"==== before capture: live tensors with a history / contexts: {held or 'none'}", flush=True)
    graph = torch.cuda.CUDAGraph()
    LOG.clear()
    me = threading.get_ident()
    try:
        with torch.cuda.graph(graph, capture_error_mode=MODE):
            ON[0] = True
            sys.monitoring.set_events(TOOL, sys.monitoring.events.PY_START)
            for _ in range(calls):
                fn()
            ON[0] = False
            sys.monitoring.set_events(TOOL, 0)
    except Exception:
        ON[0] = False
        sys.monitoring.set_events(TOOL, 0)
        print(f"==== capture FAILED (mode {MODE}); capturing thread {me}; {len(LOG)} Python calls in it:")
        seen = {}
        for entry in LOG:
            seen[entry] = seen.get(entry, 0) + 1
        for (thread, name, fn_name), n in list(seen.items())[:80]:
            print(f"  {'main ' if thread == me else 'other'} {n:4d} {name}:{fn_name}")
        traceback.print_exc()
        print("override available:", hasattr(torch.autograd.graph, "set_override_stale_capture_stream"), flush=True)
        raise
    print(f"==== capture ok (mode {MODE}); {len(LOG)} Python calls, "
          f"{len({e for e in LOG if e[0] != me})} distinct on other threads")
    return graph


def main():
    sys.monitoring.use_tool_id(TOOL, "diag")
    sys.monitoring.register_callback(TOOL, sys.monitoring.events.PY_START, started)
    gc.callbacks.append(collected)
    common.captured = captured
    import res_block_ab

    res_block_ab.captured = captured
    sys.argv = ["res_block_ab.py", *sys.argv[sys.argv.index("--") + 1:]]
    res_block_ab.main()


if __name__ == "__main__":
    main()
