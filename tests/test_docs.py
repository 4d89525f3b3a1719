"""The README's commands and examples run: docs that cannot drift."""

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()


def code_blocks(language):
    return re.findall(rf"```{language}\n(.*?)```", README, flags=re.S)


def test_ci_runs_the_readme_test_command_verbatim():
    install_demo, test_command = code_blocks("bash")[:2]
    assert "python -m sparseblocks demo" in install_demo
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert test_command.strip() in ci


def test_readme_python_examples_run():
    blocks = code_blocks("python")
    assert blocks
    namespace = {}  # the examples read as one story: later ones use earlier names
    for block in blocks:
        exec(compile(block, "README.md", "exec"), namespace)


def run_module(*args):
    env = dict(os.environ)
    return subprocess.run([sys.executable, "-m", "sparseblocks", *args], capture_output=True,
                          text=True, env=env, cwd=ROOT, timeout=600)


def test_demo_passes_and_says_where_it_runs():
    from sparseblocks._backend import SIMULATOR

    result = run_module("demo")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "demo passed" in result.stdout
    assert ("CUDA simulator" in result.stdout) == SIMULATOR


def test_info_lists_backend_and_versions():
    result = run_module("info")
    assert result.returncode == 0, result.stderr
    for name in ("backend:", "numba:", "numba-cuda:", "numpy:", "torch:", "cupy:"):
        assert name in result.stdout


def test_sbnet_demo_runs_on_a_real_image():
    import pytest

    pytest.importorskip("torch")
    pytest.importorskip("skimage")
    result = run_module("sbnet-demo")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "sbnet-demo passed" in result.stdout
