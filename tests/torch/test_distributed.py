"""BlockSparseLinear under DistributedDataParallel and FSDP2 (needs two GPUs): examples/distributed.py."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "distributed.py"


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
def test_trains_on_two_gpus(mode):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    env = dict(os.environ, NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1")
    result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", str(EXAMPLE), mode],
                            capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    assert ": ok" in result.stdout
