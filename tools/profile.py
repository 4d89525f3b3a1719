"""One op call, repeated, for a profiler to look at (no timing of its own).

    ncu --clock-control none --launch-skip 3 --launch-count 1 \\
        python3 tools/profile.py bsmm forward [--set v5_stages=2] [--dtype float16] [--calls 5]
    nsys profile -o block python3 tools/profile.py torch res_block --fraction 0.1

Takes the cases and options of `tools/sweep.py` (op, call, sizes, ``--set FIELD=VALUE`` for a
config other than the default) and runs that call ``--calls`` times after one warm-up call,
then synchronizes. Needs a GPU and torch.
"""

import sys
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import sweep  # noqa: E402


def main():
    calls = 5
    if "--calls" in sys.argv:
        at = sys.argv.index("--calls")
        calls = int(sys.argv[at + 1])
        del sys.argv[at:at + 2]
    if any(a in ("-h", "--help") for a in sys.argv[1:]):
        print(__doc__)
        return
    import argparse

    import torch

    parser = argparse.ArgumentParser()
    parser.add_argument("op", choices=sorted(sweep.CASES))
    parser.add_argument("call")
    parser.add_argument("--set", action="append", default=[])
    for name, default in (("dtype", "float16"), ("n", 4096), ("c", 4096), ("k", 4096), ("block-size", 32),
                          ("density", 0.1), ("images", 1), ("height", 400), ("width", 700), ("channels", 256),
                          ("window", 16), ("fraction", 0.1)):
        parser.add_argument(f"--{name}", type=type(default), default=default)
    args = parser.parse_args()
    default, call = sweep.CASES[args.op](torch, args)
    config = replace(default, **{name: values[0] for name, values in map(sweep.parse_values, args.set)})
    call(config)
    torch.cuda.synchronize()
    for _ in range(calls):
        call(config)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
