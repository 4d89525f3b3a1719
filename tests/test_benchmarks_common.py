"""The benchmark plumbing's table and JSON format (no timing: that needs a GPU)."""

import json
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import Record, baseline_ms, format_table, write_results  # noqa: E402


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
