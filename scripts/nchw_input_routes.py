"""Where the sparse block's time goes on an NCHW fp16 input, and what an NHWC stack would cost there
(a developer's script, GPU): graph µs of the block's pieces on 1 x 256 x 400 x 700 -> 64.

    python3 scripts/nchw_input_routes.py [--fractions 0.1,0.25,0.5] [--dtype float16]

Pieces, each graph-timed alone on the block's own windows (gather 16 x 16 every 14 from -1, scatter
14 x 14 every 14): the NCHW input's gather (NCHW stack) and adding scatter, the NCHW stack's
residual; the gather through the transpose (NCHW image -> NHWC stack), the NHWC stack's residual,
the adding scatter through the transpose; the NHWC input's fused forward for scale.
"""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from benchmarks.common import graph_ms  # noqa: E402
from pair_variants import kernel_times  # noqa: E402
from res_block_ab import windows_of  # noqa: E402


def block_and_images(dtype_name):
    """(SparseResBlock(256, 64, block_size=16) channels_last on the GPU, a
    channels_last 1 x 256 x 400 x 700 input, the same input contiguous (NCHW), the dense block's
    graph ms on the first), TF32 off; prints the dense time."""
    import torch

    from sparseblocks import sbnet_torch as st

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    dtype = getattr(torch, dtype_name)
    torch.manual_seed(0)
    block = st.SparseResBlock(256, 64, block_size=16).to("cuda", dtype).to(memory_format=torch.channels_last)
    x_cl = torch.randn(1, 256, 400, 700, device="cuda", dtype=dtype).to(memory_format=torch.channels_last)
    with torch.no_grad():
        dense = graph_ms(lambda: block.dense(x_cl))
    print(f"{torch.cuda.get_device_name()} {dtype_name}: dense block, channels_last, {dense * 1e3:.1f} µs")
    return block, x_cl, x_cl.contiguous(), dense


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--fractions", default="0.1,0.25,0.5")
    parser.add_argument("--dtype", default="float16")
    parser.add_argument("--profile", action="store_true", help="the two residuals' kernels (torch's profiler)")
    args = parser.parse_args()

    import torch

    from sparseblocks import sbnet_torch as st
    from sparseblocks.kernels import sbnet as k

    block, x_cl, x, dense = block_and_images(args.dtype)
    w = block.weights()
    p = block.geometry(x.shape)
    g, s = (p.bsize, p.bstride, p.boffset), (p.bsize_out, p.bsize_out, 0)
    for fraction in map(float, args.fractions.split(",")):
        indices, count = block.active_blocks(torch.as_tensor(windows_of(block, fraction), device="cuda"), tol=0.5)
        n = len(indices)
        with torch.no_grad():
            nchw_stack = k.sparse_gather(x, indices, *g, count=count, data_format="NCHW")
            nhwc_stack = k.sparse_gather(x, indices, *g, transpose=True, count=count, data_format="NCHW")
            assert torch.equal(nhwc_stack, nchw_stack.permute(0, 2, 3, 1))
            out_nchw = st._bottleneck_nchw(nchw_stack, *w)[0]
            out_nhwc = st._bottleneck_nhwc(nhwc_stack, *w)[0]
            err = (out_nhwc.float() - out_nchw.permute(0, 2, 3, 1).float()).abs().max().item()
            xi = x.clone()
            xc = x_cl.clone()
            times = {
                "block, NCHW input": graph_ms(lambda: block(xi, indices, count, inplace=True)),
                "block, NHWC input": graph_ms(lambda: block(xc, indices, count, inplace=True)),
                "gather NCHW -> NCHW stack": graph_ms(
                    lambda: k.sparse_gather(x, indices, *g, count=count, data_format="NCHW")),
                "residual, NCHW stack": graph_ms(lambda: st._bottleneck_nchw(nchw_stack, *w)),
                "residual, NCHW stack, NHWC out": graph_ms(lambda: st._bottleneck_nchw_nhwc_out(nchw_stack, *w)),
                "add NCHW stack -> NCHW": graph_ms(
                    lambda: k.sparse_scatter(out_nchw, indices, xi, *s, add=True, inplace=True, count=count,
                                             data_format="NCHW")),
                "gather NCHW -> NHWC stack": graph_ms(
                    lambda: k.sparse_gather(x, indices, *g, transpose=True, count=count, data_format="NCHW")),
                "residual, NHWC stack": graph_ms(lambda: st._bottleneck_nhwc(nhwc_stack, *w)),
                "add NHWC stack -> NCHW": graph_ms(
                    lambda: k.sparse_scatter(out_nhwc, indices, xi, *s, add=True, inplace=True, transpose=True,
                                             count=count, data_format="NCHW")),
                "copy of the gathered bytes": graph_ms(lambda: nchw_stack.clone()),
            }
        print(f"--- {fraction:.2f}: {n} windows; NHWC-stack output against NCHW-stack output: max |diff| {err:.3g}")
        for name, ms in times.items():
            print(f"  {name:32s} {ms * 1e3:8.1f} µs  ({dense / ms:5.2f}x of dense)")
        if args.profile:
            for name, fn in (("NCHW", lambda: st._bottleneck_nchw(nchw_stack, *w)),
                             ("NHWC", lambda: st._bottleneck_nhwc(nhwc_stack, *w))):
                with torch.no_grad():
                    rows = kernel_times(torch, fn, 5, top=8)
                print(f"  residual, {name} stack: kernels, µs a call")
                for us, calls, key in rows:
                    print(f"    {us:8.1f} x{calls:<3d} {key[:100]}")


if __name__ == "__main__":
    main()
