"""The benchmark plumbing's table and JSON format (no timing: that needs a GPU)."""

import json
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import Record, baseline_ms, format_table, merge_runs, write_results  # noqa: E402


def test_results_file_format(tmp_path):
    records = [
        Record("forward", {"dtype": "float32", "N": 4096}, 0.5, {"torch_dense": 2.0, "torch_bsr": float("nan")},
               flops=1e12),
        Record("launch_overhead", {"N": 8}, 0.02, {"torch_tiny_op": 0.01}),
    ]
    path = write_results("example", records, device="Test GPU", directory=tmp_path)
    document = json.loads(path.read_text())
    assert document["device"] == "Test GPU" and document["date"]
    assert document["records"][0] == {"name": "forward", "params": {"dtype": "float32", "N": 4096}, "ms": 0.5,
                                      "baselines": {"torch_dense": 2.0, "torch_bsr": None}}
    table = (tmp_path / "example.md").read_text()
    assert "| forward | float32 | 4096 | 0.5 | 2e+03 |" in table  # 1e12 FLOP in 0.5 ms = 2000 TFLOP/s
    assert "| torch_dense ms | torch_dense/ours |" in format_table(records)
    assert "| 2 | 4 |" in table  # the baseline beside its ratio


def test_failing_baseline_is_nan():
    def broken():
        raise RuntimeError("no such library")

    assert math.isnan(baseline_ms(broken, warmup=1, repeat=1))


def test_merged_runs_replace_cases_and_restore_rates(tmp_path):
    """``--merge``: a later run's record of a case (its name and params) replaces the earlier one's,
    other cases stay, and the rates come back from the params (the JSON keeps times only)."""
    first = [Record("copy", {"MB": 64, "op": "a"}, 1.0, {"torch": 2.0}), Record("copy", {"MB": 64, "op": "b"}, 4.0, {})]
    second = [Record("copy", {"MB": 64, "op": "a"}, 0.5, {"torch": 2.0})]
    paths = [write_results(name, records, device="Test GPU", directory=tmp_path / name)
             for name, records in (("one", first), ("two", second))]
    out = merge_runs("both", paths, tmp_path, moved=lambda name, p: p["MB"] * 1e6)
    document = json.loads(out.read_text())
    assert [(r["params"]["op"], r["ms"]) for r in document["records"]] == [("a", 0.5), ("b", 4.0)]
    table = (tmp_path / "both.md").read_text()
    assert "| copy | 64 | a | 0.5 |  | 128 | 2 | 4 |" in table  # (64 MB in 0.5 ms: 128 GB/s; torch 2 ms: 4x)
