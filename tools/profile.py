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
    import argparse

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sweep.add_case_arguments(parser)
    parser.add_argument("--calls", type=int, default=5, help="calls after the warm-up")
    cases = sweep.each_case(parser.parse_args())
    if len(cases) != 1:
        parser.error("a profile takes one block size and one density")
    args = cases[0]

    import torch

    default, call = sweep.CASES[args.op](torch, args)
    config = replace(default, **{name: values[0] for name, values in map(sweep.parse_values, args.set)})
    call(config)
    torch.cuda.synchronize()
    for _ in range(args.calls):
        call(config)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
