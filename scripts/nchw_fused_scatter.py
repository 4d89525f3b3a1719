"""The last 1x1 product fused with the adding scatter into an NCHW image (`gather_matmul`'s
``sparse_matmul_scatter(..., data_format="NCHW")``), against the product and the pair tiles' scatter
through the transpose, and the NCHW-input block that takes it (a developer's script, GPU): graph µs
on 1 x 256 x 400 x 700, 64 -> 256, the block's output windows (14 x 14 every 14).

    python3 scripts/nchw_fused_scatter.py [--fractions 0.05,0.1,0.25,0.5] [--dtype float16]
        [--caps 128,96]

Checks first: the fused NCHW scatter against the fused NHWC scatter into a channels_last copy of the
image (the same products and adds: bit for bit), and against the product and scatter apart (max
|diff|); the block's output with and without it. Rows: the fused NCHW scatter (at each register cap
of --caps too), the product and the scatter apart (and the scatter of NCHW blocks, fp32's route),
the fused NHWC scatter for scale, whole NCHW-input blocks in place with FUSED_SCATTER_NCHW on and
off, the dense channels_last block.
"""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from benchmarks.common import graph_ms  # noqa: E402
from nchw_input_routes import block_and_images  # noqa: E402
from res_block_ab import windows_of  # noqa: E402


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--fractions", default="0.05,0.1,0.25,0.5")
    parser.add_argument("--dtype", default="float16")
    parser.add_argument("--caps", default="")
    args = parser.parse_args()

    import torch

    from sparseblocks import sbnet_torch as st
    from sparseblocks.kernels import gather_matmul as gm
    from sparseblocks.kernels import sbnet as k

    block, x_cl, x, dense = block_and_images(args.dtype)
    w3 = block.weights()[2]
    p = block.geometry(x.shape)
    s = (p.bsize_out, p.bsize_out, 0)
    base = gm.NCHW_SCATTER_TILES[args.dtype]
    caps = [base[5]] + [int(c) if c != "None" else None for c in args.caps.split(",") if c]
    for fraction in map(float, args.fractions.split(",")):
        indices, count = block.active_blocks(torch.as_tensor(windows_of(block, fraction), device="cuda"), tol=0.5)
        n = len(indices)
        torch.manual_seed(1)
        h2 = (torch.randn(n, *p.bsize_out, 64, device="cuda") * 0.5).to(x.dtype)
        times = {}
        with torch.no_grad():
            for cap in caps:
                gm.NCHW_SCATTER_TILES[args.dtype] = (*base[:5], cap)
                gm._sbnet._plans.clear()
                y, y_cl = x.clone(), x_cl.clone()
                gm.sparse_matmul_scatter(h2, indices, w3, y, *s, count=count, data_format="NCHW")
                gm.sparse_matmul_scatter(h2, indices, w3, y_cl.permute(0, 2, 3, 1), *s, count=count)
                same = torch.equal(y, y_cl.contiguous())
                apart = k.sparse_scatter(st._matmul(h2, w3.flatten(1).t()), indices, x, *s, add=True, count=count,
                                         transpose=True, data_format="NCHW")
                err = (y.float() - apart.float()).abs().max().item()
                name = f"cap {cap}"
                print(f"  check {fraction:.2f} {name}: equal to the NHWC kernel's {same}, max |diff| against "
                      f"apart {err:.3g}, changed {(y != x).float().mean().item():.3f}")
                y = x.clone()
                times[f"fused NCHW scatter, {name}"] = graph_ms(lambda: gm.sparse_matmul_scatter(
                    h2, indices, w3, y, *s, count=count, data_format="NCHW"))
            gm.NCHW_SCATTER_TILES[args.dtype] = base
            gm._sbnet._plans.clear()
            y = x.clone()
            times["product + pair tiles scatter"] = graph_ms(lambda: k.sparse_scatter(
                st._matmul(h2, w3.flatten(1).t()), indices, y, *s, add=True, inplace=True, count=count,
                transpose=True, data_format="NCHW"))
            prod = st._matmul(h2, w3.flatten(1).t())
            times["  of which the scatter"] = graph_ms(lambda: k.sparse_scatter(
                prod, indices, y, *s, add=True, inplace=True, count=count, transpose=True, data_format="NCHW"))
            prod_nchw = prod.permute(0, 3, 1, 2).contiguous()
            times["scatter of NCHW blocks"] = graph_ms(lambda: k.sparse_scatter(
                prod_nchw, indices, y, *s, add=True, inplace=True, count=count, data_format="NCHW"))
            y_cl = x_cl.clone().permute(0, 2, 3, 1)
            times["fused NHWC scatter (channels_last)"] = graph_ms(lambda: gm.sparse_matmul_scatter(
                h2, indices, w3, y_cl, *s, count=count))
            outputs = {}
            for fused in (False, True):
                st.FUSED_SCATTER_NCHW = fused
                outputs[fused] = block(x.clone(), indices, count, inplace=True)  # (fused in place only)
                xi = x.clone()
                times[f"block, NCHW input, fused scatter {fused}"] = graph_ms(
                    lambda: block(xi, indices, count, inplace=True))
            st.FUSED_SCATTER_NCHW = True
            err = (outputs[True].float() - outputs[False].float()).abs().max().item()
            print(f"  check block: max |diff| fused against not {err:.3g}")
            xi = x_cl.clone()
            times["block, channels_last input"] = graph_ms(lambda: block(xi, indices, count, inplace=True))
        print(f"--- {fraction:.2f}: {n} windows")
        for name, ms in times.items():
            print(f"  {name:42s} {ms * 1e3:8.1f} µs  ({dense / ms:5.2f}x of dense)")


if __name__ == "__main__":
    main()
