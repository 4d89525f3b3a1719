"""The first 1x1 product fused with the gather of an NCHW image (`gather_matmul`'s NCHW kernel), against
the gather and the product apart, and the blocks that take it (a developer's script, GPU): graph µs
on 1 x 256 x 400 x 700 -> 64, the block's windows (16 x 16 every 14 from -1).

    python3 scripts/nchw_fused_gather.py [--fractions 0.05,0.1,0.25,0.5] [--dtype float16]
        [--caps 168,128]

Each fused output is first checked against the gather and the product apart (max |diff|). Rows:
the NCHW image's gather (NCHW stack) and the NCHW stack's first product; the fused NCHW kernel (at
each register cap of --caps too); the NHWC image's fused kernel for scale; whole blocks without
gradients (inplace) on the NCHW input and on a channels_last input with ``transpose=True``, with and
without the fused gather; the dense channels_last block.
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
    parser.add_argument("--caps", default="168")
    args = parser.parse_args()

    import torch

    from sparseblocks import sbnet_torch as st
    from sparseblocks.kernels import gather_matmul as gm
    from sparseblocks.kernels import sbnet as k

    block, x_cl, x, dense = block_and_images(args.dtype)
    flipped = st.SparseResBlock(256, 64, block_size=16, transpose=True).to(x.device, x.dtype).to(
        memory_format=torch.channels_last)
    flipped.load_state_dict(block.state_dict())
    x_nhwc = x_cl.permute(0, 2, 3, 1)
    w1 = block.weights()[0]
    p = block.geometry(x.shape)
    g = (p.bsize, p.bstride, p.boffset)
    base_shape = gm.NCHW_TILE_SHAPE
    layouts = set(st.FUSED_GATHER_LAYOUTS)
    for fraction in map(float, args.fractions.split(",")):
        indices, count = block.active_blocks(torch.as_tensor(windows_of(block, fraction), device="cuda"), tol=0.5)
        n = len(indices)
        times = {}
        with torch.no_grad():
            stack = k.sparse_gather(x, indices, *g, count=count, data_format="NCHW")
            want = st._nchw_first_relu(stack, w1)
            for cap in [None, *(int(c) for c in args.caps.split(",") if c)]:
                gm.NCHW_TILE_SHAPE = (*base_shape[:5], cap)
                gm._sbnet._plans.clear()
                got = gm.sparse_gather_matmul(x, indices, w1, *g, count=count, relu=True, data_format="NCHW")
                err = (got.float() - want.float()).abs().max().item()
                nan = bool(got.isnan().any())
                print(f"  check {fraction:.2f} cap {cap}: max |diff| {err:.3g} (NaN {nan})")
                times[f"fused NCHW, cap {cap}"] = graph_ms(lambda: gm.sparse_gather_matmul(
                    x, indices, w1, *g, count=count, relu=True, data_format="NCHW"))
            gm.NCHW_TILE_SHAPE = base_shape
            gm._sbnet._plans.clear()
            times["gather NCHW -> NCHW stack"] = graph_ms(
                lambda: k.sparse_gather(x, indices, *g, count=count, data_format="NCHW"))
            times["first product, NCHW stack"] = graph_ms(lambda: st._nchw_first_relu(stack, w1))
            times["fused NHWC image"] = graph_ms(lambda: gm.sparse_gather_matmul(
                x_nhwc, indices, w1, *g, count=count, relu=True))
            for name, model, image in (("NCHW input", block, x), ("channels_last, transpose", flipped, x_cl)):
                for fused in (False, True):
                    st.FUSED_GATHER_LAYOUTS = layouts if fused else {("NHWC", False)}
                    xi = image.clone()
                    ref = image.clone()
                    st.FUSED_GATHER_LAYOUTS = {("NHWC", False)}
                    want_y = model(ref, indices, count, inplace=False)
                    st.FUSED_GATHER_LAYOUTS = layouts if fused else {("NHWC", False)}
                    got_y = model(image.clone(), indices, count, inplace=False)
                    err = (got_y.float() - want_y.float()).abs().max().item()
                    times[f"block, {name}, fused {fused}"] = graph_ms(lambda: model(xi, indices, count, inplace=True))
                    print(f"  check block {name} fused {fused}: max |diff| against unfused {err:.3g}")
            st.FUSED_GATHER_LAYOUTS = layouts
        print(f"--- {fraction:.2f}: {n} windows")
        for name, ms in times.items():
            print(f"  {name:40s} {ms * 1e3:8.1f} µs  ({dense / ms:5.2f}x of dense)")


if __name__ == "__main__":
    main()
