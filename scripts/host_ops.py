"""Host µs of each torch call the sparse block's eager training step makes, alone (a developer's
script, GPU).

    python3 scripts/host_ops.py [--pixels 35000] [--dtype float16]

Each call is queued behind a long device sleep, so the host's clock reads the host alone. The
shapes are the NHWC stack's of 1 x 400 x 700 x 256 -> 64 at ~10 % of windows of 16. Matrix
products are timed with each of torch's BLAS back ends (``preferred_blas_library``).
"""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from res_block_ab import queued_host_us, sleep_cycles_per_ms  # noqa: E402


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--pixels", type=int, default=35000)
    parser.add_argument("--dtype", default="float16")
    parser.add_argument("--calls", type=int, default=100)
    args = parser.parse_args()

    import torch

    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cuda.matmul.allow_tf32 = False
    dtype = getattr(torch, args.dtype)
    dev = "cuda"
    cycles_per_ms = sleep_cycles_per_ms(torch)

    def host_us(fn):
        return queued_host_us(torch, fn, args.calls, cycles_per_ms)

    n = args.pixels
    windows = max(1, n // 324)
    stack = torch.randn(n, 256, device=dev, dtype=dtype)
    h1 = torch.randn(windows, 18, 18, 64, device=dev, dtype=dtype)
    h2 = torch.randn(windows, 16, 16, 64, device=dev, dtype=dtype)
    g_out = torch.randn(windows, 16, 16, 256, device=dev, dtype=dtype)
    w1 = torch.randn(64, 256, 1, 1, device=dev, dtype=dtype)
    w2 = torch.randn(64, 64, 3, 3, device=dev, dtype=dtype).to(memory_format=torch.channels_last)
    w3 = torch.randn(256, 64, 1, 1, device=dev, dtype=dtype)
    bias = torch.zeros(64, device=dev, dtype=dtype)
    image = torch.randn(1, 400, 700, 256, device=dev, dtype=dtype)
    small = torch.randn(8, 8, device=dev, dtype=dtype)
    g2 = torch.randn(windows, 64, 16, 16, device=dev, dtype=dtype).to(memory_format=torch.channels_last)
    h1c = h1.permute(0, 3, 1, 2)
    ops = {
        "torch.mm 8x8 (tiny)": lambda: torch.mm(small, small),
        "torch.add 8x8 (tiny)": lambda: small + small,
        "mm stack @ w1^T (n x 256 x 64)": lambda: torch.mm(stack, w1.flatten(1).t()),
        "_addmm_activation (first 1x1 + relu)": lambda: torch._addmm_activation(bias, stack, w1.flatten(1).t()),
        "mm + relu_": lambda: torch.mm(stack, w1.flatten(1).t()).relu_(),
        "h2 @ w3^T (matmul 4-d)": lambda: h2 @ w3.flatten(1).t(),
        "weight grad g^T @ h2": lambda: g_out.reshape(-1, 256).t() @ h2.reshape(-1, 64),
        "conv2d 3x3 on h1": lambda: torch.nn.functional.conv2d(h1c, w2),
        "convolution_backward 3x3": lambda: torch.ops.aten.convolution_backward.default(
            g2, h1c, w2, None, [1, 1], [0, 0], [1, 1], False, [0, 0], 1, [True, True, False]),
        "threshold_backward": lambda: torch.ops.aten.threshold_backward.default(h2, h2, 0),
        "clone image": lambda: image.clone(),
        "empty_like image": lambda: torch.empty_like(image),
        "permute": lambda: image.permute(0, 3, 1, 2),
    }
    results = {}
    for library in ("default", "cublas", "cublaslt"):
        if library != "default":
            torch.backends.cuda.preferred_blas_library(library)
        for name, fn in ops.items():
            if library != "default" and "mm" not in name and "@" not in name and "grad g" not in name:
                continue
            results[(library, name)] = host_us(fn)
            print(f"{library:9s} {results[(library, name)]:8.1f} µs  {name}", flush=True)


if __name__ == "__main__":
    main()
