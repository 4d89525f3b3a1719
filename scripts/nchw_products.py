"""The NCHW stack's 1x1 products written other ways (a developer's script, GPU): graph µs of each
formulation of the first product (NCHW stack [n, C, P] -> NHWC [n, P, K]) and of the last (NHWC
[n, P', K] -> NCHW [n, C, P']), checked against the package's, on the block's shapes
(1 x 256 x 400 x 700 -> 64, windows of 16 every 14) at a given window count.

    python3 scripts/nchw_products.py [--windows 136,731] [--dtype float16]
"""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import graph_ms  # noqa: E402


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--windows", default="136,731")
    parser.add_argument("--dtype", default="float16")
    args = parser.parse_args()

    import torch

    torch.backends.cuda.matmul.allow_tf32 = False
    dtype = getattr(torch, args.dtype)
    C, K, P, P2 = 256, 64, 256, 196
    w1 = torch.randn(K, C, device="cuda", dtype=dtype) / 16
    w3 = torch.randn(C, K, device="cuda", dtype=dtype) / 8
    w1t = w1.t().contiguous()
    w3t = w3.t().contiguous()
    print(torch.cuda.get_device_name(), args.dtype)
    for n in map(int, args.windows.split(",")):
        stack = torch.randn(n, C, P, device="cuda", dtype=dtype)
        h2 = torch.randn(n, P2, K, device="cuda", dtype=dtype)
        first = {
            "bmm(S^T, w1 expanded^T) (package)": lambda: torch.bmm(stack.transpose(1, 2),
                                                                    w1.expand(n, K, C).transpose(1, 2)),
            "bmm(S^T, w1^T contiguous expanded)": lambda: torch.bmm(stack.transpose(1, 2), w1t.expand(n, C, K)),
            "matmul(S^T, w1^T)": lambda: torch.matmul(stack.transpose(1, 2), w1.t()),
            "einsum ncp,kc->npk": lambda: torch.einsum("ncp,kc->npk", stack, w1),
            "bmm(w1, S) -> [n, K, P] (NCHW out)": lambda: torch.bmm(w1.expand(n, K, C), stack),
            "bmm(w1, S) -> transposed out=": lambda: torch.bmm(w1.expand(n, K, C), stack,
                                                               out=torch.empty(n, P, K, device="cuda",
                                                                               dtype=dtype).transpose(1, 2)),
        }
        last = {
            "bmm(w3 expanded, h2^T) (package)": lambda: torch.bmm(w3.expand(n, C, K), h2.transpose(1, 2)),
            "matmul(w3, h2^T)": lambda: torch.matmul(w3, h2.transpose(1, 2)),
            "einsum ck,npk->ncp": lambda: torch.einsum("ck,npk->ncp", w3, h2),
            "bmm(h2, w3^T) -> NHWC out (scale)": lambda: torch.bmm(h2, w3t.expand(n, K, C)),
            "h2 -> NCHW copy, bmm(w3, h2c)": lambda: torch.bmm(w3.expand(n, C, K),
                                                                h2.transpose(1, 2).contiguous()),
        }
        for title, ways in (("first product", first), ("last product", last)):
            want = next(iter(ways.values()))().float()
            print(f"--- {n} windows, {title}")
            for name, fn in ways.items():
                got = fn().float()
                if got.shape != want.shape:
                    got = got.transpose(1, 2)
                err = (got - want).abs().max().item() if got.shape == want.shape else float("nan")
                print(f"  {name:40s} {graph_ms(fn) * 1e3:8.1f} µs  max |diff| {err:.3g}", flush=True)


if __name__ == "__main__":
    main()
