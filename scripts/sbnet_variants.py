"""Settings of the SBNet gathers and scatters side by side on the GPU (a developer's script).

    python3 scripts/sbnet_variants.py [--setting ROW_TILE_THREADS=64,128,256] [--plain]
        [--dtype float32] [--overlap] [--nchw] [--offset O]

For each value of one module setting of `sparseblocks.kernels.sbnet` (default: ROW_TILE_THREADS,
threads of a transposing row copy; e.g. ROW_UNROLL=2,4, ROW_TILE_WINDOW_MAJOR=False,True) and
each configuration (N x 400 x 700 x C of --dtype, windows of `block`, a fraction active): check
the transposed (with --plain, also the plain) gather and scatters against the reference, then
time their CUDA-graph replays beside a device copy of the same bytes (as
benchmarks/bench_sbnet.py does). Prints copy / ours. With --overlap, the configurations are
gathers of windows that overlap their neighbours instead (18 every 16, 10 every 8, as
SparseResBlock's), whose copy moves each window's bytes, and their atomic adding scatters (the
gathers' gradients). With --nchw the image is NCHW (``data_format="NCHW"``); --offset sets every
window's offset (default: (stride - block) // 2).
"""

import argparse
import ast
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench_sbnet import block_mask  # noqa: E402
from benchmarks.common import copy_ms, device_name, graph_ms  # noqa: E402


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--setting", default="ROW_TILE_THREADS=64,128,256")
    parser.add_argument("--plain", action="store_true", help="time the plain (untransposed) copies too")
    parser.add_argument("--dtype", default="float32", choices=["float32", "float16"])
    parser.add_argument("--overlap", action="store_true", help="gathers of overlapping windows instead")
    parser.add_argument("--nchw", action="store_true", help="NCHW images")
    parser.add_argument("--offset", type=int, default=None)
    args = parser.parse_args()
    name, values = args.setting.split("=")
    values = [ast.literal_eval(v) for v in values.split(",")]

    import torch

    from sparseblocks.kernels import sbnet
    from sparseblocks.reference import sbnet as reference

    default = getattr(sbnet, name)
    rng = np.random.default_rng(0)
    data_format = "NCHW" if args.nchw else "NHWC"
    print(f"{device_name()}: gathers and scatters, {data_format} {args.dtype}, graph timings, copy / ours, by {name}")
    print("| N | C | block / stride | active | op | " + " | ".join(f"{name}={v}" for v in values) + " |")
    print("|---" * (5 + len(values)) + "|")
    configurations = [(1, 64, 16, 16, 0.05), (1, 64, 16, 16, 0.25), (1, 256, 16, 16, 0.05), (1, 64, 32, 32, 0.1),
                      (8, 64, 16, 16, 0.5), (8, 256, 16, 16, 0.1), (8, 256, 32, 32, 0.25)]
    if args.overlap:
        configurations = [(1, 256, 18, 16, 0.1), (1, 256, 18, 16, 0.25), (8, 64, 18, 16, 0.05), (1, 256, 10, 8, 0.1)]
    dtype = getattr(torch, args.dtype)
    for n, C, block, stride, active in configurations:
        mask = block_mask(rng, n, 400, 700, stride, active)
        offset = (stride - block) // 2 if args.offset is None else args.offset
        g = {"bsize": block, "bstride": stride, "boffset": offset}
        want_idx = reference.reduce_mask(mask, tol=0.5, **g)
        idx = torch.as_tensor(want_idx, device="cuda")
        x = torch.randn(n, 400, 700, C, device="cuda").to(dtype)
        if args.nchw:
            x = x.permute(0, 3, 1, 2).contiguous()
        g["data_format"] = data_format
        y = torch.zeros_like(x)
        moved = len(want_idx) * block * block * C * x.element_size()
        copy = copy_ms(moved, graph=True)
        rows = {}
        for value in values:
            setattr(sbnet, name, value)
            sbnet._kernels.clear()
            sbnet._plans.clear()
            for transpose in (True, False) if args.plain else (True,):
                kind = "transposed" if transpose else "plain"
                blocks = sbnet.sparse_gather(x, idx, transpose=transpose, **g)
                ref = reference.sparse_gather(x.cpu().numpy(), want_idx, transpose=transpose, **g)
                assert np.array_equal(blocks.cpu().numpy(), ref)
                ops = {f"{kind} gather": (lambda t=transpose: sbnet.sparse_gather(x, idx, transpose=t, **g),
                                          2 * moved)}
                for add in ("atomic",) if args.overlap else (False, True):
                    atomic = add == "atomic"
                    got = sbnet.sparse_scatter(blocks, idx, y, add=bool(add), atomic=atomic, transpose=transpose, **g)
                    exact = (lambda t: t.cpu().double().numpy()) if atomic else (lambda t: t.cpu().numpy())
                    ref = reference.sparse_scatter(exact(blocks), want_idx, exact(y), add=bool(add),
                                                   transpose=transpose, **g)
                    if atomic:  # (the order of the adds is not fixed: the exact sum, to fp16's rounding)
                        np.testing.assert_allclose(exact(got), ref, rtol=4e-3, atol=4e-3)
                    else:
                        assert np.array_equal(got.cpu().numpy(), ref)
                    ops[f"{kind} scatter add={add}"] = (lambda add=add, t=transpose, b=blocks: sbnet.sparse_scatter(
                        b, idx, y, add=bool(add), atomic=add == "atomic", transpose=t, inplace=True, **g),
                        (3 if add else 2) * moved)
                for op, (fn, size) in ops.items():
                    base = copy if size == 2 * moved else copy_ms(size // 2, graph=True)
                    rows.setdefault(op, []).append(base / graph_ms(fn))
        for op, ratios in rows.items():
            print(f"| {n} | {C} | {block} / {stride} | {active} | {op} | "
                  + " | ".join(f"{r:.2f}" for r in ratios) + " |", flush=True)
    setattr(sbnet, name, default)


if __name__ == "__main__":
    main()
