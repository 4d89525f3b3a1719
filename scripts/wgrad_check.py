"""Weight gradient, versions 3 and 4 side by side on the GPU (a developer's script).

    python3 scripts/wgrad_check.py

N = C = K = 4096, 10 % density, blocks 32 and 64, fp32 and fp16: error against
a float64 product of the dense matrices, then CUDA-event medians.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench_bsmm import block_gather, relative_error  # noqa: E402
from benchmarks.common import time_ms  # noqa: E402


def main():
    import torch

    from sparseblocks import BlockLayout
    from sparseblocks.kernels import bsmm

    for bs in (32, 64):
        layout = BlockLayout.random((4096 // bs, 4096 // bs), 0.10, seed=1, block_size=bs)
        flops = 2.0 * 4096 * layout.n_blocks * bs * bs
        for dtype in (torch.float32, torch.float16):
            x = torch.randn(4096, 4096, device="cuda", dtype=dtype)
            dy = torch.randn(4096, 4096, device="cuda", dtype=dtype)
            want = block_gather(torch, x.double().T @ dy.double(), layout)
            w = torch.randn(layout.w_shape, device="cuda", dtype=dtype)
            fwd = time_ms(lambda: bsmm.forward(x, w, layout))
            for version in (3, 4):
                error = relative_error(bsmm.weight_grad(x, dy, layout, version=version), want)
                ms = time_ms(lambda: bsmm.weight_grad(x, dy, layout, version=version))
                print(f"bs {bs} {str(dtype)[6:]} weight_grad v{version}: error {error:.1e}, {ms:.3f} ms, "
                      f"{flops / ms / 1e9:.1f} TFLOP/s, {ms / fwd:.2f}x the forward ({fwd:.3f} ms)", flush=True)
    for key, kernel in bsmm._kernels.items():
        for compiled in kernel.overloads.values():
            if "weight_grad" in key[0]:
                print(key, compiled.regs_per_thread, "registers", compiled.local_mem_per_thread, "B local")


if __name__ == "__main__":
    main()
