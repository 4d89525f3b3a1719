"""Test tiers and hypothesis profiles.

Without a GPU (and without NUMBA_ENABLE_CUDASIM set) the suite runs in Numba's
CUDA simulator; with one, on the GPU. `gpu`-marked tests need the real device,
`simulator`-marked ones test the simulator itself.

Hypothesis profiles, chosen by SPARSEBLOCKS_HYPOTHESIS_PROFILE (default: `ci`
in the simulator, `gpu` on a GPU):
  ci  — derandomized, few examples, no deadline: reproducible and fast on CI;
  gpu — randomized, several times more examples;
  dev — randomized, few examples, for quick local runs.
"""

import os
import sys

from sparseblocks.runtime.probe import use_simulator_without_gpu

# Decide before anything imports numba.cuda.
SIMULATOR = use_simulator_without_gpu()
if SIMULATOR:
    # The simulator runs a Python thread per CUDA thread; those that wait block, so the GIL's
    # forced switches between running ones only cost: switch less often (13-20 % faster tests).
    sys.setswitchinterval(0.05)

import pytest  # noqa: E402
from hypothesis import HealthCheck, settings  # noqa: E402

_common = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.register_profile("ci", derandomize=True, max_examples=3, print_blob=True, **_common)
settings.register_profile("gpu", max_examples=60, **_common)
settings.register_profile("dev", max_examples=6, **_common)
PROFILE = os.environ.get("SPARSEBLOCKS_HYPOTHESIS_PROFILE") or ("ci" if SIMULATOR else "gpu")
settings.load_profile(PROFILE)


def pytest_report_header(config):
    from sparseblocks.runtime.backend import backend_name

    return f"sparseblocks backend: {backend_name()}; hypothesis profile: {PROFILE}"


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs a real GPU (running in the CUDA simulator)")
    skip_sim = pytest.mark.skip(reason="tests the CUDA simulator (running on a real GPU)")
    for item in items:
        if SIMULATOR and "gpu" in item.keywords:
            item.add_marker(skip_gpu)
        if not SIMULATOR and "simulator" in item.keywords:
            item.add_marker(skip_sim)


@pytest.fixture
def poisoned():
    """Every kernel output starts as NaN (integers: -1), so unwritten elements fail."""
    from sparseblocks.runtime.arrays import poisoned_outputs

    with poisoned_outputs():
        yield


@pytest.fixture
def configure(monkeypatch):
    """``configure(op, **fields)``: the op's default config (``op.config.DEFAULT``, what calls
    without ``config=`` run) replaced by a copy with these fields, for this test."""
    from dataclasses import replace

    def configure(op, **fields):
        config = replace(op.config.DEFAULT, **fields)
        monkeypatch.setattr(op.config, "DEFAULT", config)
        return config

    return configure
