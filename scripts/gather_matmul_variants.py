"""The fused gather and 1x1 product (`kernels/gather_matmul.py`) in several tile shapes, against the
gather followed by cuBLAS (what `SparseResBlock` runs without it): a developer's script, GPU.

    python3 scripts/gather_matmul_variants.py [--out DIR] [--shapes "128,64,16,3,4 ..."]

Checks every variant against the reference on a small awkward case (windows off the image,
indices out of range, a count short of the rows, channels that end mid-stage, odd output
channels) and against the unfused path on the block's shape (1 x 400 x 700 x 256 -> 64, windows
of 16 every 14 from -1, fp16 and fp32, 5-50 % of the windows), then times each with graph
replays, beside the gather alone, the gather and the product, and a copy of the stack's bytes.
"""

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import copy_ms, device_name, graph_ms  # noqa: E402

# rows, cols, words, stages, warps[, a register cap]
DEFAULT_SHAPES = ["128,64,16,3,4", "128,64,16,3,4,128", "256,64,16,3,8,128", "128,64,16,4,4,128", "128,64,32,3,4,128",
                  "64,64,16,3,4", "64,64,16,4,4,128", "128,64,16,2,4,128"]


def parse_tiles(text):
    shapes = []
    for item in text.split():
        values = tuple(map(int, item.split(",")))
        shapes.append(values if len(values) == 6 else values + (None,))
    return shapes


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=None)
    parser.add_argument("--shapes", default=" ".join(DEFAULT_SHAPES))
    parser.add_argument("--image", default="1,400,700,256,64", help="N,H,W,C,C_out")
    parser.add_argument("--fractions", default="0.05,0.1,0.25,0.5")
    parser.add_argument("--fp32-shapes", default="128,64,16,3,4 128,64,16,3,4,128 64,64,16,3,4,128 256,64,16,3,8,128")
    args = parser.parse_args()

    import torch

    from sparseblocks.kernels import gather_matmul as fused
    from sparseblocks.kernels import sbnet
    from sparseblocks.reference import gather_matmul as reference

    rng = np.random.default_rng(0)
    records = []
    shapes = {"float16": parse_tiles(args.shapes), "float32": parse_tiles(args.fp32_shapes)}
    for dtype_name, tile_shapes in shapes.items():
        dtype = getattr(torch, dtype_name)
        # The small awkward case against the reference.
        x_small = torch.randn(2, 13, 11, 40, device="cuda", dtype=dtype)
        w_small = torch.randn(37, 40, device="cuda", dtype=dtype)
        idx_small = np.array([[0, 0, 0], [1, 1, 2], [0, 2, -1], [5, 0, 0], [1, 3, 1], [0, -1, 0], [1, 0, 0]], np.int32)
        g_small = {"bsize": (6, 7), "bstride": (4, 5), "boffset": (-1, -2)}
        count_small = torch.tensor([6], dtype=torch.int32, device="cuda")
        want_small = reference.sparse_gather_matmul(x_small.cpu().numpy(), idx_small, w_small.cpu().numpy(),
                                                    count=np.array([6]), relu=True, **g_small)
        g = {"bsize": 16, "bstride": 14, "boffset": -1}
        N, H, W, C, C_out = map(int, args.image.split(","))
        x = torch.randn(N, H, W, C, device="cuda", dtype=dtype)
        w = torch.randn(C_out, C, device="cuda", dtype=dtype) / C ** 0.5
        grid = sbnet.block_count((H, W), (14, 14), (-1, -1))
        for fraction in map(float, args.fractions.split(",")):
            chosen = np.argwhere(rng.random((N, *grid)) < fraction)
            indices = np.ascontiguousarray(chosen,
                                           np.int32)
            idx = torch.as_tensor(indices, device="cuda")
            stack = sbnet.sparse_gather(x, idx, **g)
            bias = torch.zeros(C_out, device="cuda", dtype=dtype)
            want = torch.relu(stack.reshape(-1, C).double() @ w.double().t()).reshape(*stack.shape[:3], C_out)
            pixels = stack.numel() // C
            item = x.element_size()

            def unfused():
                s = sbnet.sparse_gather(x, idx, **g)
                return torch._addmm_activation(bias, s.view(-1, C), w.t())

            base = {"gather": graph_ms(lambda: sbnet.sparse_gather(x, idx, **g)),
                    "gather+mm": graph_ms(unfused),
                    # (a copy reads and writes: as many bytes as the fused call reads and writes)
                    "copy": copy_ms(pixels * (C + C_out) * item // 2, graph=True)}
            for tile in tile_shapes:
                fused.TILE_SHAPE = tile
                name = ",".join(map(str, tile[:5])) + (f" r{tile[5]}" if tile[5] else "")
                try:
                    small = fused.sparse_gather_matmul(x_small, torch.as_tensor(idx_small, device="cuda"), w_small,
                                                       count=count_small, relu=True, **g_small)
                    small_err = float((small.double().cpu() - torch.as_tensor(want_small).double()).abs().max())
                    got = fused.sparse_gather_matmul(x, idx, w, relu=True, **g)
                    torch.cuda.synchronize()
                    err = float((got.double() - want).abs().max() / want.abs().max())
                    ms = graph_ms(lambda: fused.sparse_gather_matmul(x, idx, w, relu=True, **g))
                    kernel = fused._kernel(dtype_name, True, True, tile)
                    resources = {}
                    for what in ("regs_per_thread", "shared_mem_per_block", "local_mem_per_thread"):
                        try:
                            resources[what] = list(getattr(kernel, "get_" + what)().values())[0]
                        except Exception as e:  # noqa: BLE001 (a report, not a check)
                            resources[what] = repr(e)[:60]
                except Exception as e:  # noqa: BLE001
                    print(dtype_name, fraction, name, "failed:", repr(e)[:300], flush=True)
                    continue
                record = {"dtype": dtype_name, "active": fraction, "windows": len(indices), "tile": name,
                          "ms": ms, "small_err": small_err, "rel_err": err, **base, **resources}
                records.append(record)
                print(f"{dtype_name} {fraction:4} {name:16} fused {ms * 1e3:7.1f} us"
                      f"  gather {base['gather'] * 1e3:7.1f}"
                      f"  gather+mm {base['gather+mm'] * 1e3:7.1f}  copy {base['copy'] * 1e3:7.1f}"
                      f"  x{base['gather+mm'] / ms:5.2f}  copy/fused {base['copy'] / ms:4.2f}"
                      f"  err {small_err:.2g} {err:.2g}  {resources}", flush=True)
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        Path(args.out, "gather_matmul_variants.json").write_text(
            json.dumps({"device": device_name(), "records": records}, indent=1))


if __name__ == "__main__":
    main()
