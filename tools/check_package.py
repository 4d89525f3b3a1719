"""Build the package as a user installs it, and check it from a fresh virtual environment.

    python tools/check_package.py [--keep DIR]

1. ``python -m build`` makes a wheel and an sdist (in a temporary directory, or ``--keep DIR``);
2. ``twine check`` reads their metadata and long description;
3. a new venv (no system packages) installs the wheel with its dependencies from the index;
4. from outside the source tree, that venv runs ``python -m sparseblocks info`` and the README's
   first Python example (in Numba's CUDA simulator where there is no GPU), and checks that
   ``sparseblocks`` was imported from the venv, not from this checkout.

Needs ``build`` and ``twine`` (``pip install build twine``) and the package index. CI runs it
after the tests (`.ci/run`). Exits non-zero, naming the step, on the first failure.
"""

import argparse
import os
import re
import subprocess
import sys
import tempfile
import venv
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run(step, command, **kwargs):
    print(f"[{step}] {' '.join(str(c) for c in command)}", flush=True)
    result = subprocess.run([str(c) for c in command], **kwargs)
    if result.returncode:
        sys.exit(f"{step}: failed with exit status {result.returncode}")


def first_example():
    blocks = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), flags=re.S)
    if not blocks:
        sys.exit("README: no Python example")
    return blocks[0]


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--keep", default=None, help="build into this directory and keep it")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        dist = Path(args.keep or Path(scratch) / "dist")
        run("build", [sys.executable, "-m", "build", "--outdir", dist, ROOT])
        built = sorted(dist.glob("sparseblocks-*"))
        wheels = [p for p in built if p.suffix == ".whl"]
        if not wheels or not any(p.name.endswith(".tar.gz") for p in built):
            sys.exit(f"build: expected a wheel and an sdist in {dist}, got {[p.name for p in built]}")
        run("twine check", [sys.executable, "-m", "twine", "check", "--strict", *built])
        env_dir = Path(scratch) / "venv"
        venv.create(env_dir, with_pip=True)
        python = env_dir / "bin" / "python"
        run("install", [python, "-m", "pip", "install", "-q", "--disable-pip-version-check", wheels[-1]])
        outside = Path(scratch) / "elsewhere"
        outside.mkdir()
        env = {key: value for key, value in os.environ.items() if key not in ("PYTHONPATH", "PYTHONHOME")}
        env.setdefault("NUMBA_ENABLE_CUDASIM", "0" if _has_gpu() else "1")
        run("info", [python, "-m", "sparseblocks", "info"], cwd=outside, env=env)
        check = ("import sparseblocks, sys\n"
                 f"assert sparseblocks.__file__.startswith({str(env_dir)!r}), sparseblocks.__file__\n"
                 + first_example())
        run("README example", [python, "-c", check], cwd=outside, env=env)
    print("package: built, checked, installed and run from a fresh venv")


def _has_gpu():
    return Path("/dev/nvidiactl").exists()


if __name__ == "__main__":
    main()
