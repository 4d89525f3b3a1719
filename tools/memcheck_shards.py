"""The GPU test suite under compute-sanitizer memcheck, in parallel shards (a developer's tool).

    python3 tools/memcheck_shards.py [--shards 10] [--timeout 500] [--out DIR] [--no-memcheck] [--by-case] [--exclude ID] [paths]

pytest-xdist's workers do not come up under compute-sanitizer, and one
process takes longer than a device call allows (every test compiles its own
kernels), so this collects the suite's test functions, deals them out to
``--shards`` pytest processes, each under its own sanitizer, and prints each
shard's summary and error count. Logs: DIR/shard_K.log.
"""

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shards", type=int, default=10)
    parser.add_argument("--timeout", type=float, default=500)
    parser.add_argument("--out", default=os.environ.get("OUT", "/tmp"))
    parser.add_argument("--no-memcheck", action="store_true")
    parser.add_argument("--by-case", action="store_true",
                        help="deal out single parametrized cases, not test functions (one slow test over many shards)")
    parser.add_argument("--exclude", action="append", default=[],
                        help="leave out test ids containing this (repeatable): run them elsewhere, --by-case")
    parser.add_argument("paths", nargs="*", default=["tests"])
    args = parser.parse_args()
    listed = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", *args.paths],
                            capture_output=True, text=True).stdout
    functions = list(dict.fromkeys(line if args.by_case else line.split("[")[0]
                                   for line in listed.splitlines()
                                   if "::" in line and not any(x in line for x in args.exclude)))
    shards = [functions[k::args.shards] for k in range(args.shards)]
    env = dict(os.environ, SPARSEBLOCKS_HYPOTHESIS_PROFILE="ci")
    sanitizer = [] if args.no_memcheck else [
        "compute-sanitizer", "--tool", "memcheck", "--report-api-errors", "no", "--error-exitcode", "1"]
    running = []
    for k, shard in enumerate(shards):
        if not shard:
            continue
        log = open(Path(args.out) / f"shard_{k}.log", "w")
        command = sanitizer + [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *shard]
        running.append((k, subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env), log))
    deadline = time.time() + args.timeout
    for k, process, log in running:
        try:
            process.wait(timeout=max(1, deadline - time.time()))
        except subprocess.TimeoutExpired:
            process.kill()
        log.close()
        lines = (Path(args.out) / f"shard_{k}.log").read_text().splitlines()
        summary = [line for line in lines if " passed" in line or " failed" in line or "ERROR SUMMARY" in line
                   or line.startswith("FAILED")]
        print(f"shard {k} rc={process.returncode}: " + " | ".join(summary[-6:] or lines[-2:]), flush=True)
    print(f"{len(functions)} test functions in {len(running)} shards")


if __name__ == "__main__":
    main()
