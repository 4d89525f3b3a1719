"""Version 5 (tensor cores) on the GPU in one call (a developer's script).

    python3 scripts/v5_check.py [--out DIR] [--deadline SECONDS]

1. One mma tile per kind (fp16, bf16, tf32, 3xTF32) against NumPy; the raw
   tiles go to DIR/mma_tiles.npz so a wrong fragment layout can be read off
   without another GPU run.
2. N = C = K = 4096, blocks 16/32/64, fp16 and fp32, densities 5-50 %:
   version 5's forward and input_grad checked against float64 products, then
   timed with CUDA events beside torch dense (TF32 off) and torch BSR measured
   in the same run; version 4's forward at 10 % as an anchor.
3. Smaller problems through the other paths: feature_axis 0 with vector
   loads, one-value loads (V5_VECTOR off), bf16.
Each result is a JSON line on stdout and in DIR/v5.jsonl as soon as it exists;
sections stop early at the deadline.
"""

import argparse
import json
import sys
import time
import traceback
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from benchmarks.bench_bsmm import relative_error  # noqa: E402
from benchmarks.common import baseline_ms, device_name, time_ms  # noqa: E402
from sparseblocks._backend import SIMULATOR  # noqa: E402

START = time.time()
SIZE = 4096
DEVICE = "cuda"
if SIMULATOR:  # a dry run of the script itself: small CPU tensors, nothing timed
    DEVICE = "cpu"

    def time_ms(fn, **kwargs):
        fn()
        return float("nan")

    def baseline_ms(fn, **kwargs):  # torch's CPU build lacks some baselines (BSR in fp16)
        try:
            fn()
        except (NotImplementedError, RuntimeError):
            pass
        return float("nan")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="/tmp")
    parser.add_argument("--deadline", type=float, default=280.0)
    parser.add_argument("--block-sizes", default="32,64,16")
    parser.add_argument("--densities", default="0.1,0.05,0.25,0.5")
    parser.add_argument("--size", type=int, default=SIZE, help="N = C = K")
    parser.add_argument("--results", default=None, metavar="NAME",
                        help="only turn DIR/v5.jsonl (from an earlier run) into benchmarks/results/NAME.json/.md")
    args = parser.parse_args()
    if args.results:
        return write_records(Path(args.out) / "v5.jsonl", args.results)
    n = args.size
    out = Path(args.out)
    log = open(out / "v5.jsonl", "a")

    def record(**row):
        row["t"] = round(time.time() - START, 1)
        line = json.dumps(row)
        print(line, flush=True)
        log.write(line + "\n")
        log.flush()

    def late():
        return time.time() - START > args.deadline

    import torch

    from sparseblocks import BlockLayout
    from sparseblocks.kernels import bsmm

    record(device=device_name())
    try:
        tiles(out, record)
    except Exception:
        traceback.print_exc()

    torch.backends.cuda.matmul.allow_tf32 = False
    densities = [float(d) for d in args.densities.split(",")]
    block_sizes = [int(b) for b in args.block_sizes.split(",")]
    operands = {}

    def inputs(dtype_name):
        """x, dy, a generator and dense cuBLAS time of one dtype, made once."""
        if dtype_name not in operands:
            dtype = getattr(torch, dtype_name)
            gen = torch.Generator(device=DEVICE).manual_seed(0)
            x = torch.randn(n, n, device=DEVICE, dtype=dtype, generator=gen)
            dy = torch.randn(n, n, device=DEVICE, dtype=dtype, generator=gen)
            Wd = torch.randn(n, n, device=DEVICE, dtype=dtype, generator=gen)
            dense = baseline_ms(lambda: x @ Wd)
            record(what="dense", dtype=dtype_name, ms=dense)
            operands[dtype_name] = (x, dy, gen, dense)
        return operands[dtype_name]

    def product_row(dtype_name, bs, density):
        dtype = getattr(torch, dtype_name)
        x, dy, gen, dense = inputs(dtype_name)
        layout = BlockLayout.random((n // bs, n // bs), density, seed=1, block_size=bs)
        w = torch.randn(layout.w_shape, device=DEVICE, dtype=dtype, generator=gen) / np.sqrt(n * density)
        W = torch.as_tensor(layout.to_dense(w.float().cpu().numpy()), device=DEVICE)
        flops = 2.0 * n * layout.n_blocks * bs * bs
        row = {"what": "v5", "dtype": dtype_name, "bs": bs, "density": density, "dense_ms": dense}
        row["fwd_error"] = relative_error(bsmm.forward(x, w, layout, version=5), x.double() @ W.double())
        row["ig_error"] = relative_error(bsmm.input_grad(dy, w, layout, version=5), dy.double() @ W.double().T)
        if dtype_name != "float32" and density == 0.1:  # the weight gradient, and on tensor cores
            want_dw = x.double().T @ dy.double()
            blocks = torch.as_tensor(layout.coords, device=want_dw.device, dtype=torch.long)
            want_dw = want_dw.reshape(n // bs, bs, n // bs, bs).permute(0, 2, 1, 3)[blocks[:, 0], blocks[:, 1]]
            row["weight_grad_ms"] = time_ms(lambda: bsmm.weight_grad(x, dy, layout, version=5))
            bsmm.V5_WGRAD = True
            try:
                row["v5_wgrad_error"] = relative_error(bsmm.weight_grad(x, dy, layout, version=5), want_dw)
                row["v5_weight_grad_ms"] = time_ms(lambda: bsmm.weight_grad(x, dy, layout, version=5))
            finally:
                bsmm.V5_WGRAD = False
        row["forward_ms"] = time_ms(lambda: bsmm.forward(x, w, layout, version=5))
        row["input_grad_ms"] = time_ms(lambda: bsmm.input_grad(dy, w, layout, version=5))
        row["tflops"] = flops / row["forward_ms"] / 1e9
        Wt_bsr = W.to(dtype).T.contiguous().to_sparse_bsr((bs, bs))
        xt = x.T.contiguous()
        row["bsr_ms"] = baseline_ms(lambda: Wt_bsr @ xt)
        if density == 0.1 and bs == 32:
            row["v4_forward_ms"] = time_ms(lambda: bsmm.forward(x, w, layout, version=4))
            row["v4_input_grad_ms"] = time_ms(lambda: bsmm.input_grad(dy, w, layout, version=4))
        row["vs_dense"] = dense / row["forward_ms"]
        row["vs_bsr"] = row["bsr_ms"] / row["forward_ms"]
        record(**row)

    # The headline cases first, then other densities on the kernels already compiled, the
    # other paths next, the remaining block sizes while time lasts (compiling costs most).
    first = [(d, bs, 0.1) for d in ("float16", "float32") for bs in block_sizes[:2]]
    more = [(d, bs, density) for density in densities for bs in block_sizes[:2] for d in ("float16", "float32")
            if (d, bs, density) not in first]
    rest = [(d, bs, density) for bs in block_sizes[2:] for density in densities for d in ("float16", "float32")]

    def run(cases):
        for case in cases:
            if late():
                break
            try:
                product_row(*case)
            except Exception:
                traceback.print_exc()

    run(first + more)
    paths(record, late)
    run(rest)

    for key, kernel in bsmm._kernels.items():
        for compiled in getattr(kernel, "overloads", {}).values():
            record(what="kernel", key=str(key), regs=compiled.regs_per_thread,
                   local=compiled.local_mem_per_thread, shared=compiled.shared_mem_per_block)
    record(what="done")


def write_records(jsonl, name):
    """benchmarks/results/<name>.json/.md from a run's JSON lines: one record per product and
    case, the torch baselines of the same run beside it (BSR for the forward only)."""
    from benchmarks.common import Record, print_table, write_results

    rows = [json.loads(line) for line in open(jsonl)]
    device = next(r["device"] for r in rows if "device" in r)
    records = []
    for r in rows:
        if r.get("what") != "v5":
            continue
        params = {"dtype": r["dtype"], "block_size": r["bs"], "density": r["density"], "N": 4096, "C": 4096,
                  "K": 4096, "version": 5, "error": float(f"{max(r['fwd_error'], r['ig_error']):.2g}")}
        flops = r["tflops"] * r["forward_ms"] * 1e9
        records.append(Record("forward", params, r["forward_ms"],
                              {"torch_dense": r["dense_ms"], "torch_bsr": r["bsr_ms"]}, flops=flops))
        records.append(Record("input_grad", params, r["input_grad_ms"], {"torch_dense": r["dense_ms"]}, flops=flops))
        if "v4_forward_ms" in r:
            records.append(Record("forward", dict(params, version=4), r["v4_forward_ms"],
                                  {"torch_dense": r["dense_ms"], "torch_bsr": r["bsr_ms"]}, flops=flops))
            records.append(Record("input_grad", dict(params, version=4), r["v4_input_grad_ms"],
                                  {"torch_dense": r["dense_ms"]}, flops=flops))
    print_table(records, device)
    write_results(name, records, device=device)


def paths(record, late):
    """Smaller problems through version 5's other paths: feature_axis 0, one-value loads, bf16."""
    import torch

    from sparseblocks import BlockLayout
    from sparseblocks.kernels import bsmm

    for dtype_name, bs, axis, vector in (("float16", 32, 0, True), ("float32", 64, 0, True),
                                         ("bfloat16", 32, 1, True), ("float16", 64, 1, False),
                                         ("float32", 32, 0, False), ("bfloat16", 64, 0, True)):
        if late():
            break
        try:
            bsmm.V5_VECTOR = vector
            dtype = getattr(torch, dtype_name)
            n = (24 if SIMULATOR else 1000) - (0 if vector else 3)
            C, K = (128, 128) if SIMULATOR else (512, 384)
            layout = BlockLayout.random((C // bs, K // bs), 0.4, seed=2, block_size=bs)
            gen = torch.Generator(device=DEVICE).manual_seed(1)
            x = torch.randn(n, C, device=DEVICE, generator=gen).to(dtype)
            dy = torch.randn(n, K, device=DEVICE, generator=gen).to(dtype)
            w = torch.randn(layout.w_shape, device=DEVICE, generator=gen).to(dtype)
            W = torch.as_tensor(layout.to_dense(w.float().cpu().numpy()), device=DEVICE).double()
            xa, dya = (x, dy) if axis == 1 else (x.T.contiguous(), dy.T.contiguous())
            y = bsmm.forward(xa, w, layout, feature_axis=axis, version=5)
            dx = bsmm.input_grad(dya, w, layout, feature_axis=axis, version=5)
            y, dx = (y, dx) if axis == 1 else (y.T, dx.T)
            record(what="path", dtype=dtype_name, bs=bs, axis=axis, vector=vector, n=n,
                   fwd_error=relative_error(y.float(), x.double() @ W),
                   ig_error=relative_error(dx.float(), dy.double() @ W.T))
        except Exception:
            traceback.print_exc()
        finally:
            bsmm.V5_VECTOR = True


def tiles(out, record):
    """One m16n8k16 (fp16, bf16) and one m16n8k8 (tf32, 3xTF32) tile per kind against NumPy."""
    from numba import cuda

    import test_mma

    saved = {}
    rng = np.random.default_rng(7)
    for kind, kernel in test_mma.KERNELS.items():
        A, B, c, want, run = test_mma.tile_problem(kind, rng)
        d = run()
        saved[kind] = np.stack([np.pad(m.astype(np.float64), ((0, 0), (0, 16 - m.shape[1])))
                                for m in (A, np.pad(B, ((0, 16 - B.shape[0]), (0, 0))), c, want, d)])
        record(what="tile", kind=kind, max_error=float(np.abs(d - want).max()),
               scale=float(np.abs(want).max()))
    np.savez(out / "mma_tiles.npz", **saved)
    cuda.synchronize()


if __name__ == "__main__":
    main()
