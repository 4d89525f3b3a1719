"""The sparse block's NCHW stack (SBNet's fused transpose, and NCHW inputs) computed other ways
(a developer's script, GPU): graph-timed forward (in place) and training step, beside the dense
block on channels_last and on contiguous NCHW input.

    python3 scripts/nchw_stack_variants.py [--dtypes float16,float32] [--fractions 0.1,0.25,0.5]

Variants of the residual on an NCHW stack (`sbnet_torch._WRITTEN_OUT[True]`):
- ``matmul``: the package's (since session 27): the first 1x1 as batched matrix products reading
  the stack transposed, the 3x3 on an NHWC first-ReLU output (channels_last), and where the stack
  came through the transpose (since session 34) the last 1x1 one product with its output NHWC,
  added back without the transpose;
- ``nchw out``: session 27-33's: the last 1x1 batched too, its output NCHW, added back through
  the transpose (on an NCHW input: without it; the package's takes fp16 NCHW inputs' output NHWC
  too, `sbnet_torch.NCHW_INPUT_NHWC_OUT`);
- ``cudnn``: the package's before session 27 (cuDNN convolutions on the NCHW stack, written out
  below).
"""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from benchmarks.common import graph_ms  # noqa: E402
from pair_variants import kernel_times  # noqa: E402
from res_block_ab import windows_of  # noqa: E402


def cudnn_residual(st):
    """The NCHW stack's residual through cuDNN's convolutions (the package's before session 27)."""
    import torch

    def forward(stack, w1, w2, w3, into=st.NOWHERE):
        conv2d = torch.nn.functional.conv2d
        h1 = st._relu(conv2d(stack, w1), into[0])
        h2 = st._relu(conv2d(h1, w2), into[1])
        out = conv2d(h2, w3)
        return (out if into[2] is None else into[2].copy_(out)), (stack, h1, h2)

    def backward(saved, weights, grad_out, needs, into=None):
        stack, h1, h2 = saved
        w1, w2, w3 = weights
        need_h1 = needs[0] or needs[1]
        need_h2 = need_h1 or needs[2]
        grad_h2, grad_w3 = st._conv_backward(grad_out, h2, w3, (need_h2, needs[3]))
        grad_h1 = grad_w2 = grad_stack = grad_w1 = None
        if need_h2:
            grad_h1, grad_w2 = st._conv_backward(st._relu_backward(grad_h2, h2), h1, w2, (need_h1, needs[2]))
        if need_h1:
            grad_stack, grad_w1 = st._conv_backward(st._relu_backward(grad_h1, h1), stack, w1, needs[:2])
        if into is not None and grad_stack is not None:
            grad_stack = into.copy_(grad_stack)
        return grad_stack, grad_w1, grad_w2, grad_w3

    def first(stack, w1, into=None):
        return st._relu(torch.nn.functional.conv2d(stack, w1), into)

    return st._WrittenOut(forward, backward, first)


def nchw_out_residual(st):
    """The NCHW stack's residual with its output NCHW however the stack came (sessions 27-33)."""
    return st._WrittenOut(st._bottleneck_nchw, st._bottleneck_nchw_backward, st._nchw_first_relu, None,
                          st._bottleneck_nchw_image_backward)


def profile(torch, name, forward, step, calls=5):
    for what, fn in (("forward", forward), ("training", step)):
        with torch.no_grad() if what == "forward" else torch.enable_grad():
            kernels = kernel_times(torch, fn, calls, top=14)
        print(f"--- {name}, {what}: kernels, µs a call")
        for us, n, key in kernels:
            print(f"  {us:8.1f} x{n:<3d} {key[:110]}")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--dtypes", default="float16,float32")
    parser.add_argument("--fractions", default="0.1,0.25,0.5")
    parser.add_argument("--profile", action="store_true", help="each case's kernels (torch's profiler)")
    parser.add_argument("--ways", default="nchw out,matmul", help="of cudnn, nchw out, matmul")
    args = parser.parse_args()

    import torch

    from sparseblocks import sbnet_torch as st

    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cuda.matmul.allow_tf32 = False
    matmul_way = st._WRITTEN_OUT[True]
    all_ways = {"cudnn": cudnn_residual(st), "nchw out": nchw_out_residual(st), "matmul": matmul_way}
    ways = {name: all_ways[name] for name in args.ways.split(",")}
    for dtype_name in args.dtypes.split(","):
        dtype = getattr(torch, dtype_name)
        torch.manual_seed(0)
        block = st.SparseResBlock(256, 64, block_size=16).to("cuda", dtype).to(memory_format=torch.channels_last)
        x_cl = torch.randn(1, 256, 400, 700, device="cuda", dtype=dtype).to(memory_format=torch.channels_last)
        x_nchw = x_cl.contiguous()
        grad_y = torch.randn_like(x_cl)
        with torch.no_grad():
            dense_cl = graph_ms(lambda: block.dense(x_cl))
            dense_nchw = graph_ms(lambda: block.dense(x_nchw))

        def train(forward, x):
            xg = x.detach().clone().requires_grad_(True)

            def step():
                xg.grad = None
                block.zero_grad(set_to_none=True)
                forward(xg).backward(grad_y if x is x_cl else grad_y.contiguous())
            return step

        dense_train_cl = graph_ms(train(block.dense, x_cl))
        dense_train_nchw = graph_ms(train(block.dense, x_nchw))
        print(f"{dtype_name} dense forward: channels_last {dense_cl * 1e3:.1f} µs, NCHW {dense_nchw * 1e3:.1f} µs; "
              f"training {dense_train_cl * 1e3:.1f} / {dense_train_nchw * 1e3:.1f} µs", flush=True)
        for fraction in map(float, args.fractions.split(",")):
            indices, count = block.active_blocks(torch.as_tensor(windows_of(block, fraction), device="cuda"), tol=0.5)
            with torch.no_grad():
                want = block.dense(x_cl)
            rows = {}
            cases = [("NHWC stack (default)", x_cl, False, matmul_way, dense_cl, dense_train_cl)]
            for name, way in ways.items():
                cases += [(f"transpose, {name}", x_cl, True, way, dense_cl, dense_train_cl),
                          (f"NCHW input, {name}", x_nchw, False, way, dense_nchw, dense_train_nchw)]
            for name, x, transpose, way, dense_fwd, dense_train in cases:
                st._WRITTEN_OUT[True] = way
                block.transpose = transpose
                try:
                    with torch.no_grad():
                        y = block(x.clone(), indices, count)
                        active = (y != x).any(dim=1, keepdim=True)
                        err = ((y - want).abs() * active).max().item()
                        xi = x.clone()
                        fwd = graph_ms(lambda: block(xi, indices, count, inplace=True))
                    trn = graph_ms(train(lambda t: block(t, indices, count), x))
                    rows[name] = (fwd, trn)
                    if args.profile and "matmul" in name:
                        profile(torch, name, lambda: block(xi, indices, count, inplace=True),
                                train(lambda t: block(t, indices, count), x))
                    print(f"{dtype_name} {fraction:.2f} {name:28s} forward {fwd * 1e3:8.1f} µs "
                          f"({dense_fwd / fwd:5.2f}x of dense)  training {trn * 1e3:8.1f} µs "
                          f"({dense_train / trn:5.2f}x)  max error on the active pixels {err:.3g}", flush=True)
                finally:
                    st._WRITTEN_OUT[True] = matmul_way
                    block.transpose = False


if __name__ == "__main__":
    main()
