"""GPU benchmarks: run as ``python -m benchmarks.bench_<name>`` from the repository root."""
