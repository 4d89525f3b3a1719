"""OpenAI blocksparse's other ops against torch: layer norm, the LSTM gates, element-wise ops,
float_cast, dropout, and the grouped weight gradient.

    python -m benchmarks.bench_ops [--quick] [--out-dir DIR]

Each op is checked against torch first (the same computation in float64 where it rounds), then
timed on the device alone (replays of a captured CUDA graph), every baseline the same way in the
same run:

* ``layer_norm_forward`` / ``layer_norm_backward`` at (4096, 4096) and (16384, 1024), fp32, fp16
  and bf16, both feature axes. ``torch`` is ``F.layer_norm`` (its backward,
  ``aten.native_layer_norm_backward``) on the (N, C) rows, its best layout, whichever axis ours
  reads; for axis 0 also ``torch_transposed``, the same on x's (and dy's) transpose as it lies
  (``x.t()`` of a (C, N) array: torch makes the rows contiguous first); ``copy`` is a device copy
  of the bytes the op must move (x read and y written; dy and x read, dx written).
* ``fused_lstm_gates`` forward and backward, (N, H) = (4096, 4096) and four separate gates:
  ``torch`` the same formulas in eager ops, ``torch_compiled`` them under ``torch.compile``.
* Element-wise ops (``relu``, ``sigmoid``, ``add``, ``multiply``, ``add_n`` of 8) and
  ``float_cast`` (fp16 and fp32 to both fp8 formats, and fp32 to bf16) over 64 MB of input:
  ``torch`` the same torch op, ``copy`` the bytes moved.
* ``dropout`` (keep 0.8) over 64 MB: ``torch`` is ``F.dropout``, ``copy`` the bytes moved.
* ``grouped_weight_grad``: dW summed over T = 8 steps of N = 256 rows (blocks of 32 and 64,
  4096 x 4096, 25 %), one call of (T, N, C) stacks against ``separate`` (8 calls accumulating with ``beta=1``)
  and ``dense_mm`` (cuBLAS's xᵀ·dy over the 2048 rows, the whole dense gradient).

Writes results/ops.json and results/ops.md.
"""

import argparse

import numpy as np

from benchmarks.common import Record, copy_ms, device_name, graph_ms, merge_runs, print_table, write_results

LN_SHAPES = ((4096, 4096), (16384, 1024))
MEGABYTES = 64


def ratios(label, ms, baselines):
    text = ", ".join(f"{k} x{v / ms:.2f}" for k, v in baselines.items())
    print(f"{label}: {ms * 1e3:8.1f} us, {text}", flush=True)


def close(got, want, tol, what):
    error = ((got.double() - want.double()).norm() / max(want.double().norm().item(), 1e-30)).item()
    assert error < tol, f"{what}: relative error {error}"


def tolerance(dtype, torch):
    return {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}[dtype]


def bench_layer_norm(torch, records, quick):
    from sparseblocks import norms

    F = torch.nn.functional
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        for N, C in LN_SHAPES[:1] if quick else LN_SHAPES:
            rows = torch.randn(N, C, device="cuda", dtype=dtype) * 3 + 1
            g = torch.rand(C, device="cuda", dtype=dtype) + 0.5
            b = torch.randn(C, device="cuda", dtype=dtype)
            dy_rows = torch.randn(N, C, device="cuda", dtype=dtype)
            want = F.layer_norm(rows.double(), (C,), g.double(), b.double(), 1e-6)
            torch_fwd = graph_ms(lambda: F.layer_norm(rows, (C,), g, b, 1e-6))
            _, t_mean, t_rstd = torch.ops.aten.native_layer_norm(rows, (C,), g, b, 1e-6)
            torch_bwd = graph_ms(lambda: torch.ops.aten.native_layer_norm_backward(
                dy_rows, rows, (C,), t_mean, t_rstd, g, b, [True, True, True]))
            size = rows.element_size() * N * C
            copy2, copy3 = copy_ms(size, graph=True), copy_ms(3 * size // 2, graph=True)
            for axis in (1, 0):
                x = rows if axis == 1 else rows.t().contiguous()
                dy = dy_rows if axis == 1 else dy_rows.t().contiguous()
                y, mean, rstd = norms.layer_norm(x, g, b, axis=axis, stats=True)
                close(y if axis == 1 else y.t(), want, tolerance(dtype, torch), f"layer_norm {dtype} axis {axis}")
                dx, dg, db = norms.layer_norm_grad(dy, x, g, b, mean, rstd, axis=axis)
                ref = rows.double().requires_grad_()
                gd, bd = g.double().requires_grad_(), b.double().requires_grad_()
                F.layer_norm(ref, (C,), gd, bd, 1e-6).backward(dy_rows.double())
                close(dx if axis == 1 else dx.t(), ref.grad, 5 * tolerance(dtype, torch), f"layer_norm dx {dtype}")
                close(dg, gd.grad, 5 * tolerance(dtype, torch), f"layer_norm dg {dtype}")
                params = dict(dtype=str(dtype)[6:], N=N, C=C, axis=axis)
                fwd = graph_ms(lambda: norms.layer_norm(x, g, b, axis=axis))
                bwd = graph_ms(lambda: norms.layer_norm_grad(dy, x, g, b, mean, rstd, axis=axis))
                transposed = (None, None)
                if axis == 0:  # (torch on x's transpose as it lies, (C, N): it makes the rows contiguous first)
                    transposed = (graph_ms(lambda: F.layer_norm(x.t(), (C,), g, b, 1e-6)),
                                  graph_ms(lambda: torch.ops.aten.native_layer_norm_backward(
                                      dy.t(), x.t(), (C,), t_mean, t_rstd, g, b, [True, True, True])))
                for name, ms, base, moved, copy, other in (
                        ("layer_norm_forward", fwd, torch_fwd, 2 * size, copy2, transposed[0]),
                        ("layer_norm_backward", bwd, torch_bwd, 3 * size, copy3, transposed[1])):
                    baselines = {"torch": base, "copy": copy}
                    if other is not None:
                        baselines["torch_transposed"] = other
                    records.append(Record(name, params, ms, baselines, bytes=moved))
                    ratios(f"{name} {params}", ms, baselines)


def lstm_torch(torch):
    def forward(c, i, f, o, u):
        c_next = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(u)
        return c_next, torch.sigmoid(o) * torch.tanh(c_next)

    def backward(c, i, f, o, u, dc_next, dh):
        si, sf, so, tu = torch.sigmoid(i), torch.sigmoid(f), torch.sigmoid(o), torch.tanh(u)
        c_next = sf * c + si * tu
        tc = torch.tanh(c_next)
        dc_total = dc_next + dh * so * (1 - tc * tc)
        return (dc_total * sf, dc_total * tu * si * (1 - si), dc_total * c * sf * (1 - sf),
                dh * tc * so * (1 - so), dc_total * si * (1 - tu * tu))

    return forward, backward


def bench_lstm(torch, records, quick):
    from sparseblocks import ew

    forward, backward = lstm_torch(torch)
    compiled_fwd, compiled_bwd = torch.compile(forward), torch.compile(backward)
    N, H = 4096, 4096
    for dtype in (torch.float32, torch.float16):
        c, i, f, o, u, dc_next, dh = (torch.randn(N, H, device="cuda", dtype=dtype) for _ in range(7))
        got = ew.fused_lstm_gates(c, i, f, o, u)
        for a, b, what in zip(got, forward(*(t.double() for t in (c, i, f, o, u))), ("c_next", "h")):
            close(a, b, tolerance(dtype, torch), f"lstm {what} {dtype}")
        got = ew.fused_lstm_gates_grad(c, i, f, o, u, dc_next=dc_next, dh=dh)
        for a, b in zip(got, backward(*(t.double() for t in (c, i, f, o, u, dc_next, dh)))):
            close(a, b, 2 * tolerance(dtype, torch), f"lstm grad {dtype}")
        params = dict(dtype=str(dtype)[6:], N=N, H=H)
        size = c.element_size() * N * H
        for name, ours, eager, comp, moved in (
                ("fused_lstm_gates", lambda: ew.fused_lstm_gates(c, i, f, o, u), lambda: forward(c, i, f, o, u),
                 lambda: compiled_fwd(c, i, f, o, u), 7 * size),
                ("fused_lstm_gates_backward", lambda: ew.fused_lstm_gates_grad(c, i, f, o, u, dc_next=dc_next, dh=dh),
                 lambda: backward(c, i, f, o, u, dc_next, dh), lambda: compiled_bwd(c, i, f, o, u, dc_next, dh),
                 12 * size)):
            ms = graph_ms(ours)
            baselines = {"torch": graph_ms(eager), "torch_compiled": graph_ms(comp),
                         "copy": copy_ms(moved // 2, graph=True)}
            records.append(Record(name, params, ms, baselines, bytes=moved))
            ratios(f"{name} {params}", ms, baselines)


def bench_elementwise(torch, records, quick):
    from sparseblocks import cast, ew

    F = torch.nn.functional
    for dtype in (torch.float16, torch.float32):
        n = MEGABYTES * 2 ** 20 // torch.tensor([], dtype=dtype).element_size()
        xs = [torch.randn(n, device="cuda", dtype=dtype) for _ in range(8)]
        x, y = xs[0], xs[1]
        size = x.element_size() * n
        cases = [
            ("relu", lambda: ew.relu(x), lambda: torch.relu(x), 2 * size, torch.relu(x.double())),
            ("sigmoid", lambda: ew.sigmoid(x), lambda: torch.sigmoid(x), 2 * size, torch.sigmoid(x.double())),
            ("add", lambda: ew.add(x, y), lambda: torch.add(x, y), 3 * size, x.double() + y.double()),
            ("multiply", lambda: ew.multiply(x, y), lambda: torch.mul(x, y), 3 * size, x.double() * y.double()),
            ("add_n", lambda: ew.add_n(xs), lambda: torch.stack(xs).sum(0), 9 * size, torch.stack(xs).double().sum(0)),
        ]
        for op, ours, theirs, moved, want in cases:
            close(ours(), want, tolerance(dtype, torch), f"{op} {dtype}")
            params = dict(op=op, dtype=str(dtype)[6:], MB=MEGABYTES)
            ms = graph_ms(ours)
            baselines = {"torch": graph_ms(theirs), "copy": copy_ms(moved // 2, graph=True)}
            records.append(Record("elementwise", params, ms, baselines, bytes=moved))
            ratios(f"elementwise {params}", ms, baselines)

        targets = ("float8_e4m3fn", "float8_e5m2") + (("bfloat16",) if dtype == torch.float32 else ())
        for target in targets:
            to = getattr(torch, target)
            got = cast.float_cast(x, target, saturate=target == "float8_e4m3fn")
            want = x.clamp(-448, 448).to(to) if target == "float8_e4m3fn" else x.to(to)
            assert torch.equal(got.view(torch.uint8 if "8" in target else torch.int16),
                               want.view(torch.uint8 if "8" in target else torch.int16)), f"float_cast {target}"
            params = dict(op=target, dtype=str(dtype)[6:], MB=MEGABYTES)
            moved = size + n * torch.tensor([], dtype=to).element_size()
            ms = graph_ms(lambda: cast.float_cast(x, target))
            baselines = {"torch": graph_ms(lambda: x.to(to)), "copy": copy_ms(moved // 2, graph=True)}
            records.append(Record("float_cast", params, ms, baselines, bytes=moved))
            ratios(f"float_cast {params}", ms, baselines)

        kept = ew.dropout(x, 0.8, seed=1)
        share = (kept != 0).double().mean().item()
        on = kept != 0
        exact = torch.equal(kept[on], (x[on].double() * 1.25).to(dtype))  # (x·1.25 exact in double: one rounding)
        assert abs(share - 0.8) < 1e-3 and exact, f"dropout: kept {share}, values exact: {exact}"
        params = dict(op="keep 0.8", dtype=str(dtype)[6:], MB=MEGABYTES)
        ms = graph_ms(lambda: ew.dropout(x, 0.8, seed=1))
        baselines = {"torch": graph_ms(lambda: F.dropout(x, 0.2, training=True)), "copy": copy_ms(size, graph=True)}
        records.append(Record("dropout", params, ms, baselines, bytes=2 * size))
        ratios(f"dropout {params}", ms, baselines)


def grouped_layout(C, bs, density):
    """The grouped weight gradient's layout (C x C features, a fixed seed), as `bench_grouped` times
    it and `grouped_flops` counts it."""
    from sparseblocks import BlockLayout

    return BlockLayout.random((C // bs, C // bs), density, seed=0, block_size=bs)


def bench_grouped(torch, records, quick):
    from sparseblocks import bsmm

    T, N, C = 8, 256, 4096
    for dtype, bs in ((torch.float16, 32), (torch.float16, 64), (torch.float32, 32)):
        layout = grouped_layout(C, bs, 0.25)
        x = torch.randn(T, N, C, device="cuda", dtype=dtype)
        dy = torch.randn(T, N, C, device="cuda", dtype=dtype)
        got = bsmm.weight_grad(x, dy, layout)
        dense = x.reshape(-1, C).double().t() @ dy.reshape(-1, C).double()
        coords = torch.as_tensor(layout.coords, device="cuda").long()
        want = dense.view(C // bs, bs, C // bs, bs).permute(0, 2, 1, 3)[coords[:, 0], coords[:, 1]]
        close(got, want, tolerance(dtype, torch), f"grouped weight_grad {dtype}")
        out = torch.empty(layout.w_shape, device="cuda", dtype=dtype)

        def separate():
            for t in range(T):
                bsmm.weight_grad(x[t], dy[t], layout, out=out, beta=0.0 if t == 0 else 1.0)

        x_rows, dy_rows = x.reshape(-1, C), dy.reshape(-1, C)
        params = dict(dtype=str(dtype)[6:], T=T, N=N, C=C, block_size=bs, density=0.25)
        ms = graph_ms(lambda: bsmm.weight_grad(x, dy, layout))
        baselines = {"separate": graph_ms(separate), "dense_mm": graph_ms(lambda: x_rows.t() @ dy_rows)}
        records.append(Record("grouped_weight_grad", params, ms, baselines,
                              flops=2 * T * N * layout.n_blocks * bs * bs))
        ratios(f"grouped_weight_grad {params}", ms, baselines)


def itemsize(dtype):
    """Bytes a value of a float format (`cast.formats.FORMATS`: sign, exponent and mantissa bits)."""
    from sparseblocks.cast.formats import FORMATS

    E, M, _, _ = FORMATS[dtype]
    return (1 + E + M) // 8


def moved_bytes(name, p):
    """The bytes a record's call moved, from its params (what its ``copy`` baseline moves; `--merge`
    restores GB/s from it): the layer norm's and LSTM's arrays, the flat ops' 64 MB operands."""
    if name.startswith("layer_norm"):
        return (2 if name.endswith("forward") else 3) * p["N"] * p["C"] * itemsize(p["dtype"])
    if name.startswith("fused_lstm_gates"):
        return (12 if name.endswith("backward") else 7) * p["N"] * p["H"] * itemsize(p["dtype"])
    size = p.get("MB", 0) * 2 ** 20
    if name == "elementwise":
        return {"add": 3, "multiply": 3, "add_n": 9}.get(p["op"], 2) * size
    if name == "float_cast":
        return size + size // itemsize(p["dtype"]) * itemsize(p["op"])
    return 2 * size if name == "dropout" else None


def grouped_flops(name, p):
    """The grouped weight gradient's useful FLOPs, from its params (its layout rebuilt by seed), for
    `--merge`'s TFLOP/s; None for the other records."""
    if name != "grouped_weight_grad":
        return None
    bs = p["block_size"]
    return 2 * p["T"] * p["N"] * grouped_layout(p["C"], bs, p["density"]).n_blocks * bs * bs


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out-dir", default=None)
    parser.add_argument("--only", default=None, help="comma-separated: layer_norm,lstm,elementwise,grouped "
                        "(written as ops_only, for --merge)")
    parser.add_argument("--merge", nargs="+", metavar="JSON",
                        help="only merge these runs' JSON files (a later one's case replaces an earlier one's)")
    args = parser.parse_args()
    if args.merge:
        merge_runs("ops", args.merge, args.out_dir, flops=grouped_flops, moved=moved_bytes)
        return

    import torch

    torch.backends.cuda.matmul.allow_tf32 = False
    np.random.seed(0)
    torch.manual_seed(0)
    records = []
    parts = {"layer_norm": bench_layer_norm, "lstm": bench_lstm, "elementwise": bench_elementwise,
             "grouped": bench_grouped}
    for name in args.only.split(",") if args.only else parts:
        parts[name](torch, records, args.quick)
    print_table(records, f"OpenAI blocksparse's other ops on {device_name()}")
    write_results("ops_only" if args.only else "ops", records, **({"directory": args.out_dir} if args.out_dir else {}))


if __name__ == "__main__":
    main()
