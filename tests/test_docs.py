"""The README's commands and examples run, and the tree keeps its shape: docs that cannot drift."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()


def code_blocks(language):
    return re.findall(rf"```{language}\n(.*?)```", README, flags=re.S)


def tracked_files():
    """The repository's files: git's list where there is one, else every file under the root."""
    try:
        listed = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
        return [ROOT / line for line in listed.splitlines() if (ROOT / line).exists()]
    except (OSError, subprocess.CalledProcessError):
        return [p for p in ROOT.rglob("*") if p.is_file() and ".git" not in p.parts]


def test_ci_runs_the_readme_test_command_verbatim():
    install_demo, test_command = code_blocks("bash")[:2]
    assert "python -m sparseblocks demo" in install_demo
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert test_command.strip() in ci


def test_readme_python_examples_run():
    pytest.importorskip("torch")  # (the sparse block's example)
    blocks = code_blocks("python")
    assert blocks
    namespace = {}  # the examples read as one story: later ones use earlier names
    for block in blocks:
        exec(compile(block, "README.md", "exec"), namespace)


# A work diary belongs to git: no numbered work periods, no references to tracked work items.
# (The patterns are built from pieces so that this file does not match itself.)
DIARY = [re.compile(p, re.I) for p in (
    r"\bsess" + r"ions?\s*[-_]?\d+", r"\b(first|second|third|[a-z]+t[hy]-?[a-z]*|[a-z]+th)\s+sess" + r"ion\b",
    r"sess" + r"ion\d+", r"\biss" + r"ue\s*#?\d+", r"\bthe iss" + r"ue'?s?\b", r"NOTES" + r"\.md")]


def test_no_diary_in_the_tree():
    found = []
    for path in tracked_files():
        relative = path.relative_to(ROOT).as_posix()
        if any(p.search(relative) for p in DIARY):
            found.append(f"{relative}: its name")
        if path.suffix not in (".py", ".md", ".sh", ".cfg", ".toml", ".txt", ".json") and path.name != "run":
            continue
        for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            if any(p.search(line) for p in DIARY):
                found.append(f"{relative}:{number}: {line.strip()[:80]}")
    assert not found, "\n".join(found[:20])


def test_the_tree_keeps_its_shape():
    """Product files stay readable, the tools few, one results pair per benchmark, and only tests,
    benchmarks and demos import the NumPy twins."""
    product = [p for p in (ROOT / "sparseblocks").rglob("*.py") if "reference" not in p.parts]
    long = [f"{p.relative_to(ROOT)}: {n}" for p in product if (n := len(p.read_text().splitlines())) > 800]
    assert not long, long
    twins = [str(p.relative_to(ROOT)) for p in product if p.name != "__main__.py"
             and re.search(r"^\s*from \.+reference|^\s*from sparseblocks\.reference|import reference",
                           p.read_text(), re.M)]
    assert not twins, twins
    assert len([p for p in (ROOT / "tools").iterdir() if p.is_file()]) <= 8
    results = sorted(p.name for p in (ROOT / "benchmarks" / "results").iterdir())
    benches = sorted(p.stem.removeprefix("bench_") for p in (ROOT / "benchmarks").glob("bench_*.py"))
    assert results == sorted(f"{b}.{ext}" for b in benches for ext in ("json", "md"))
    assert len(README.splitlines()) <= 220
    assert len((ROOT / "docs" / "performance.md").read_text().splitlines()) <= 400


def test_tools_explain_themselves():
    for path in sorted((ROOT / "tools").iterdir()):
        command = ["bash", str(path)] if path.suffix == ".sh" else [sys.executable, str(path)]
        result = subprocess.run([*command, "--help"], capture_output=True, text=True, timeout=120,
                                env=dict(os.environ, NUMBA_ENABLE_CUDASIM="1"))
        assert result.returncode == 0 and len(result.stdout) > 100, f"{path.name}: {result.stderr[-300:]}"


def run_module(*args):
    env = dict(os.environ)
    return subprocess.run([sys.executable, "-m", "sparseblocks", *args], capture_output=True,
                          text=True, env=env, cwd=ROOT, timeout=600)


def test_matmul_demo_passes_and_says_where_it_runs():
    from sparseblocks.runtime.backend import SIMULATOR

    result = run_module("matmul-demo")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "matmul-demo passed" in result.stdout
    assert ("CUDA simulator" in result.stdout) == SIMULATOR


def test_info_lists_backend_and_versions():
    result = run_module("info")
    assert result.returncode == 0, result.stderr
    for name in ("backend:", "numba:", "numba-cuda:", "numpy:", "torch:", "cupy:"):
        assert name in result.stdout


def test_demo_trains_both_models_and_draws_them(tmp_path):
    pytest.importorskip("torch")
    pytest.importorskip("sklearn")
    pytest.importorskip("matplotlib")
    from sparseblocks.torch import demo

    size = dict(demo.SMALL, steps=3, every=2, batch=8)
    assert demo.main(png=str(tmp_path / "demo.png"), size=size) == 0
    assert (tmp_path / "demo.png").stat().st_size > 0


def test_demo_times_a_training_step_dense_and_block_sparse():
    """The demo's timed part (run on a GPU at FFN size), here tiny and eager on the CPU path."""
    torch = pytest.importorskip("torch")
    from sparseblocks.torch import demo

    size = dict(width=64, hidden=128, tokens=32, block_size=16, densities=(0.25,))
    results = demo.timed_steps(size, device="cpu", dtype=torch.float32, compiled=False, steps=2)
    assert set(results) == {("dense", "eager"), ("25%", "eager")} and all(ms > 0 for ms in results.values())


def test_sbnet_demo_times_the_block_at_low_activity():
    """sbnet-demo's timed part (run on a GPU at SBNet's size), here tiny on the CPU path."""
    torch = pytest.importorskip("torch")
    from sparseblocks.__main__ import sbnet_timings
    from sparseblocks.torch import SparseResBlock

    results = sbnet_timings(torch, SparseResBlock, (0.25,), (1, 8, 48, 48), device="cpu", dtype_name="float32")
    assert set(results) == {0.25} and all(ms > 0 for pair in results.values() for ms in pair)


def test_quant_demo_trains_its_mlps_and_cnns():
    pytest.importorskip("torch")
    pytest.importorskip("sklearn")
    from sparseblocks.torch import quant_demo

    assert quant_demo.main(size=dict(quant_demo.SMALL, steps=3, batch=8)) == 0


def test_sbnet_demo_runs_on_a_real_image():
    pytest.importorskip("torch")
    pytest.importorskip("skimage")
    result = run_module("sbnet-demo")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "sbnet-demo passed" in result.stdout
