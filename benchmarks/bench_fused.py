"""The gather fused into a 1x1 convolution (`sparseblocks.fused`) against the gather followed by
cuBLAS, the dense 1x1 convolution over the whole image (cuBLAS), and a device copy of the bytes it
must move.

    python -m benchmarks.bench_fused [--quick] [--out-dir DIR]

SBNet's ResNet-50 stage shapes (the bottleneck's first 1x1: C -> C / 4, windows of 16 every 14 from
-1 as `SparseResBlock` gathers them), fp16 and fp32, 5-50 % of the windows, ReLU fused. Each
configuration is checked against the gather and the product in float64 first, then timed on the
device alone (replays of a captured CUDA graph), every baseline the same way in the same run:
``gather_mm`` (`sbnet.sparse_gather`, then ``torch._addmm_activation``: the two calls apart),
``dense_mm`` (the same product over every pixel of the image, as the dense block's 1x1 runs),
``copy`` (a device copy moving the bytes the fused call must: the windows' pixels read, the
result written).

The other end of the bottleneck, `sparse_matmul_scatter` (its last 1x1: C / 4 -> C, added in place
into the image's output windows, 14 every 14): against ``mm_scatter`` (cuBLAS's product, then
`sbnet.sparse_scatter` adding in place: what the block runs without it), ``dense_mm`` (the product
over every pixel with the image added, one cuBLAS call, as the dense block's last 1x1 and residual
need at least) and ``copy`` (the stack read, the windows' pixels read and written). Writes
results/fused.json and results/fused.md.
"""

import argparse

import numpy as np

from benchmarks.common import Record, copy_ms, device_name, graph_ms, print_table, write_results

SHAPES = [(1, 400, 700, 256, 64), (1, 200, 350, 512, 128), (1, 100, 175, 1024, 256)]
FRACTIONS = (0.05, 0.1, 0.25, 0.5)
GEOMETRY = {"bsize": 16, "bstride": 14, "boffset": -1}
SCATTER_GEOMETRY = {"bsize": 14, "bstride": 14, "boffset": 0}


def windows(rng, height, width, fraction):
    """A random `fraction` of the block grid's windows, as int32 [n, 3] indices."""
    from sparseblocks.windows import block_count

    grid = block_count((height, width), (14, 14), (-1, -1))
    chosen = np.argwhere(rng.random(grid) < fraction)
    return np.ascontiguousarray(np.concatenate([np.zeros((len(chosen), 1), np.int64), chosen], axis=1), np.int32)


def add_row(records, name, label, ms, apart, dense, moved, flops, **params):
    """One graph-timed row, recorded and printed: `ms` beside the two calls it fuses (`apart`: their
    name and ms), the dense product, and a copy of the `moved` bytes."""
    baselines = {apart[0]: apart[1], "dense_mm": dense, "copy": copy_ms(moved // 2, graph=True)}
    records.append(Record(name, dict(params, timing="graph"), ms, baselines, flops=flops, bytes=moved))
    print(f"{label} {params['active']:4}: {ms * 1e3:7.1f} us, {apart[0]} x{apart[1] / ms:.2f}, dense x{dense / ms:.2f}, "
          f"copy x{baselines['copy'] / ms:.2f}", flush=True)


def bench_scatter(torch, gather_matmul, sbnet, rng, records, dtype_name, y, bottleneck):
    """`sparse_matmul_scatter` rows: bottleneck -> y's channels into y's output windows."""
    n, height, width, channels = y.shape
    w = torch.randn(channels, bottleneck, device="cuda", dtype=y.dtype) / bottleneck ** 0.5
    h = torch.randn(n * height * width, bottleneck, device="cuda", dtype=y.dtype)
    y_rows = y.view(-1, channels)
    dense = graph_ms(lambda: torch.addmm(y_rows, h, w.t()))
    for fraction in FRACTIONS:
        idx = torch.as_tensor(windows(rng, height, width, fraction), device="cuda")
        blocks = torch.randn(len(idx), 14, 14, bottleneck, device="cuda", dtype=y.dtype)
        got = gather_matmul.sparse_matmul_scatter(blocks, idx, w, y.clone(), **SCATTER_GEOMETRY)
        product = (blocks.reshape(-1, bottleneck).double() @ w.double().t()).to(y.dtype).view(*blocks.shape[:3], -1)
        want = sbnet.sparse_scatter(product.double(), idx, y.double(), add=True, **SCATTER_GEOMETRY)
        error = ((got.double() - want).norm() / (want - y.double()).norm()).item()
        assert error < (2e-3 if y.dtype == torch.float16 else 1e-5), f"{dtype_name} scatter {fraction}: error {error}"
        into = y.clone()

        def apart():
            rows = torch.mm(blocks.view(-1, bottleneck), w.t())
            return sbnet.sparse_scatter(rows.view(*blocks.shape[:3], channels), idx, into, add=True, inplace=True,
                                        **SCATTER_GEOMETRY)

        pixels = blocks.numel() // bottleneck
        ms = graph_ms(lambda: gather_matmul.sparse_matmul_scatter(blocks, idx, w, into, **SCATTER_GEOMETRY))
        add_row(records, "sparse_matmul_scatter", f"{dtype_name} scatter {bottleneck}->{channels}", ms,
                ("mm_scatter", graph_ms(apart)), dense, pixels * (bottleneck + 2 * channels) * y.element_size(),
                2 * pixels * channels * bottleneck, dtype=dtype_name, N=n, H=height, W=width, C=bottleneck,
                C_out=channels, active=fraction, windows=len(idx))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out-dir", default=None)
    args = parser.parse_args()

    import torch

    from sparseblocks import fused as gather_matmul
    from sparseblocks import sbnet

    torch.backends.cuda.matmul.allow_tf32 = False
    rng = np.random.default_rng(0)
    records = []
    shapes = SHAPES[:1] if args.quick else SHAPES
    for dtype_name in ("float16", "float32"):
        dtype = getattr(torch, dtype_name)
        for n, height, width, channels, out_channels in shapes:
            x = torch.randn(n, height, width, channels, device="cuda", dtype=dtype)
            w = torch.randn(out_channels, channels, device="cuda", dtype=dtype) / channels ** 0.5
            bias = torch.zeros(out_channels, device="cuda", dtype=dtype)
            image_rows = x.view(-1, channels)
            dense = graph_ms(lambda: torch._addmm_activation(bias, image_rows, w.t()))  # (NaN if it fails)
            for fraction in FRACTIONS:
                idx = torch.as_tensor(windows(rng, height, width, fraction), device="cuda")
                got = gather_matmul.sparse_gather_matmul(x, idx, w, relu=True, **GEOMETRY)
                stack = sbnet.sparse_gather(x, idx, **GEOMETRY)
                want = torch.relu(stack.reshape(-1, channels).double() @ w.double().t()).view(got.shape)
                error = ((got.double() - want).norm() / want.norm()).item()
                assert error < (2e-3 if dtype == torch.float16 else 1e-5), f"{dtype_name} {fraction}: error {error}"

                def apart():
                    s = sbnet.sparse_gather(x, idx, **GEOMETRY)
                    return torch._addmm_activation(bias, s.view(-1, channels), w.t())

                pixels = got.numel() // out_channels
                ms = graph_ms(lambda: gather_matmul.sparse_gather_matmul(x, idx, w, relu=True, **GEOMETRY))
                add_row(records, "sparse_gather_matmul", f"{dtype_name} {channels}->{out_channels}", ms,
                        ("gather_mm", graph_ms(apart)), dense, pixels * (channels + out_channels) * x.element_size(),
                        2 * pixels * channels * out_channels, dtype=dtype_name, N=n, H=height, W=width, C=channels,
                        C_out=out_channels, active=fraction, windows=len(idx))
            bench_scatter(torch, gather_matmul, sbnet, rng, records, dtype_name, x, out_channels)
    print_table(records, f"sparse_gather_matmul and sparse_matmul_scatter on {device_name()}")
    write_results("fused", records, **({"directory": args.out_dir} if args.out_dir else {}))


if __name__ == "__main__":
    main()
