"""Block-sparse convolution (`sparseblocks.conv`) against the dense cuDNN convolution with the
masked filter, and cuDNN's grouped convolution where the layout is block-diagonal.

    python -m benchmarks.bench_conv [--quick] [--dtypes float16,bfloat16,float32] [--out-dir DIR]
    python -m benchmarks.bench_conv --merge A.json B.json ...   (runs split by --dtypes)

A ResNet-50-like 3x3 layer: 256 -> 256 channels, 56 x 56, batch 32, channels in groups of 32, at
10, 25 and 50 % of the (input group, output group) blocks (``random``) and ``block_diagonal``
(12.5 %: groups=8),
in fp16, bf16 and fp32. Each product is checked against the dense convolution (float32) first,
then timed: ``forward``, ``input_grad`` and ``filter_grad``, with baselines ``cudnn_dense`` (the
same product of the dense filter with the absent blocks zeroed) and, block-diagonal,
``cudnn_grouped``. Times are the device's: 20 calls queued behind a sleeping kernel
(`common.queued_ms`), ours and cuDNN's alike, so that neither host's launch costs count; the
column ``eager_call`` is our call timed alone with the device waiting on the host (Python's checks,
plans and launches included), what a loop that does not run ahead of the device sees. Filters are
passed flat, as the torch layer passes them. fp16 and bf16 are timed twice: on NCHW tensors, and on channels-last ones
(``memory``: the op's ``channels_last=True`` calls, cuDNN on ``torch.channels_last`` tensors).
Writes results/conv.json and results/conv.md.
"""

import argparse

import numpy as np

from benchmarks.common import (Record, baseline_ms, device_name, merge_runs, print_table, queued_ms, time_ms,
                               write_results)

N, C, HW, G = 32, 256, 56, 32


def layouts(rng, quick):
    """(layout, mask of the (input group, output group) grid): block-diagonal, and random
    layouts with the nearest whole number of blocks to each density."""
    groups = C // G
    out = [("block_diagonal", np.eye(groups, dtype=bool))]
    for density in ((0.25,) if quick else (0.1, 0.25, 0.5)):
        mask = np.zeros(groups * groups, bool)  # (the last block present: the layer spans all C and K)
        mask[np.concatenate([[groups * groups - 1], rng.permutation(groups * groups - 1)])[
            :round(density * groups * groups)]] = True
        out.append(("random", mask.reshape(groups, groups)))
    return out


def timed(name, params, call, base, flops):
    """The record of our ``call``: the device's time (`queued_ms`), and the call's alone with the
    device waiting on the host (the baseline column ``eager_call``)."""
    return Record(name, dict(params), queued_ms(call), {**base, "eager_call": time_ms(call)}, flops=flops)


def layer_blocks(params):
    """A record's nonzero blocks: the density's share of the (C / G) x (K / G) grid."""
    G = params["group"]
    return round(params["density"] * (params["C"] // G) * (params["K"] // G))


def layer_flops(name, params):
    """A record's FLOPs from its params (a 3 x 3 filter, `layer_blocks`): what a merge restores
    TFLOP/s from."""
    G = params["group"]
    return 2.0 * params["N"] * params["H"] * params["W"] * 9 * G * G * layer_blocks(params)


def check(got, want, what):
    error = ((got.float() - want).norm() / want.norm()).item()
    assert error < 2e-2, f"{what}: relative error {error}"


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--dtypes", default="float16,bfloat16,float32", help="comma-separated")
    parser.add_argument("--merge", nargs="+", metavar="JSON",
                        help="only merge these runs' JSON files (a later one's case replaces an earlier one's)")
    parser.add_argument("--out-dir", default=None)
    args = parser.parse_args()
    if args.merge:
        merge_runs("conv", args.merge, args.out_dir, flops=layer_flops)
        return

    import torch
    import torch.nn.functional as F

    from sparseblocks.conv import BlocksparseConv

    torch.backends.cudnn.benchmark = True
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    rng = np.random.default_rng(0)
    records = []
    for dtype_name in (("float16",) if args.quick else args.dtypes.split(",")):
        dtype = getattr(torch, dtype_name)
        x = torch.randn(N, C, HW, HW, device="cuda", dtype=dtype)
        dy = torch.randn(N, C, HW, HW, device="cuda", dtype=dtype)
        for name, mask in layouts(rng, args.quick):
            BCK = [(list(range(c * G, c * G + G)), list(range(k * G, k * G + G))) for c, k in zip(*np.nonzero(mask))]
            op = BlocksparseConv(BCK, (3, 3), (HW, HW), padding="SAME")
            filters = [torch.randn(op.f_shape(b), device="cuda", dtype=dtype) / (3 * G ** 0.5) for b in range(len(BCK))]
            flat = torch.cat([f.reshape(-1) for f in filters])  # (as the torch layer keeps them)
            dense = torch.zeros(C, C, 3, 3, device="cuda", dtype=dtype)
            for (cs, ks), f in zip(BCK, filters):
                dense[ks[0]:ks[0] + G, cs[0]:cs[0] + G] = f
            want = F.conv2d(x.float(), dense.float(), padding=1)
            want_dx = torch.nn.grad.conv2d_input(x.shape, dense.float(), dy.float(), padding=1)
            dF = torch.nn.grad.conv2d_weight(x.float(), dense.shape, dy.float(), padding=1)
            density = float(mask.mean())
            for memory in (("channels_first",) if dtype_name == "float32" else ("channels_first", "channels_last")):
                last = memory == "channels_last"
                fmt = torch.channels_last if last else torch.contiguous_format
                xs, dys, dense_m = (t.contiguous(memory_format=fmt) for t in (x, dy, dense))
                # channels-last arrays as the op takes them: (N, H, W, C), the tensors' own storage
                xa, dya = (t.permute(0, 2, 3, 1) if last else t for t in (xs, dys))
                back = (lambda t: t.permute(0, 3, 1, 2)) if last else (lambda t: t)
                what = f"{dtype_name} {name} {memory}"
                check(back(op(filters, xa, channels_last=last)), want, f"{what}: forward")
                check(back(op.input_grad(filters, dya, channels_last=last)), want_dx, f"{what}: input_grad")
                for (cs, ks), got_f in zip(BCK, op.filter_grad(dya, xa, channels_last=last)):
                    check(got_f, dF[ks[0]:ks[0] + G, cs[0]:cs[0] + G], f"{what}: filter_grad")
                params = dict(layout=name, density=round(density, 3), dtype=dtype_name, memory=memory, N=N, C=C,
                              K=C, H=HW, W=HW, group=G)
                assert layer_blocks(params) == len(BCK)  # (the params say the layer: a merge's TFLOP/s)
                flops = layer_flops("forward", params)
                base = {"cudnn_dense": baseline_ms(lambda: F.conv2d(xs, dense_m, padding=1), queued_ms)}
                if name == "block_diagonal":  # (C, G, 3, 3), block i is group i
                    grouped = torch.cat([filters[i] for i in range(len(BCK))]).contiguous(memory_format=fmt)
                    base["cudnn_grouped"] = baseline_ms(lambda: F.conv2d(xs, grouped, padding=1, groups=C // G),
                                                        queued_ms)
                records.append(timed("forward", params, lambda: op(flat, xa, channels_last=last), base, flops))
                base = {"cudnn_dense": baseline_ms(
                    lambda: torch.nn.grad.conv2d_input(xs.shape, dense_m, dys, padding=1), queued_ms)}
                records.append(timed("input_grad", params, lambda: op.input_grad(flat, dya, channels_last=last), base,
                                     flops))
                base = {"cudnn_dense": baseline_ms(
                    lambda: torch.nn.grad.conv2d_weight(xs, dense_m.shape, dys, padding=1), queued_ms)}
                records.append(timed("filter_grad", params, lambda: op.filter_grad(dya, xa, channels_last=last), base,
                                     flops))
                for r in records[-3:]:
                    print(f"{r.name:12} {dtype_name:9} {name:14} {memory:14} {density:5.3f}: {r.ms:.3f} ms "
                          f"({r.flops / r.ms / 1e9:.0f} TFLOP/s) "
                          + " ".join(f"{b} x{t / r.ms:.2f}" for b, t in r.baselines.items()), flush=True)
    print_table(records, f"block-sparse convolution on {device_name()}")
    write_results("conv", records, **({"directory": args.out_dir} if args.out_dir else {}))


if __name__ == "__main__":
    main()
