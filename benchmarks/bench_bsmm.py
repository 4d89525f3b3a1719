"""Block-sparse matmul on the GPU against torch dense (cuBLAS), torch BSR, torch's Triton BSR and stk.

    python -m benchmarks.bench_bsmm [--quick] [--rows N,...] [--block-sizes B,...] [--densities D,...]
                                    [--dtypes T,...] [--baselines B,...] [--out-dir DIR]
    python -m benchmarks.bench_bsmm --merge A.json B.json ...   (runs split by --rows)

For every size, block size, density and dtype: check all three products
against a float64 dense product, then time them and the baselines in the
same run (median of CUDA-graph replays, so that host launch costs, ours and
the baselines', stay out): torch dense ``x @ W`` (TF32 off for fp32), torch
BSR (``W.to_sparse_bsr`` times a dense matrix, the dense-output product),
torch's Triton ``bsr_dense_mm`` on the same BSR tensors, and stk (MegaBlocks'
Triton kernels: ``dds`` for the products, ``sdd`` for the weight gradient) on
a block-128 layout of the same density, where stk can be imported (it is a
baseline, never a dependency: put it on PYTHONPATH). TFLOP/s count the nonzero
work, 2·N·n_blocks·bs². A last record compares the cost of one call from torch
tensors on a tiny problem with a tiny torch op. Writes results/bsmm.json and .md.
"""

import argparse
import time
from pathlib import Path

import numpy as np

from benchmarks.common import Record, device_name, graph_ms, print_table, time_ms, write_results

TOLERANCE = {"float32": 1e-5, "float16": 3e-3, "bfloat16": 2e-2}
BASELINES = ("torch_dense", "torch_bsr", "torch_triton_bsr", "stk")
STK_BLOCK = 128  # the block size stk and MegaBlocks train with


def sizes(quick):
    if quick:
        return [(4096, 4096, 4096)], [64, 128], [0.05, 0.10, 0.25, 0.50], ["float16", "bfloat16"]
    return ([(4096, 4096, 4096), (1024, 4096, 4096), (16384, 4096, 4096)], [16, 32, 64, 128],
            [0.05, 0.10, 0.25, 0.50, 1.0], ["float32", "float16", "bfloat16"])


def device_ms(fn):
    """Device time of fn(): CUDA-graph replays, or CUDA events around calls where capture fails;
    NaN where fn cannot run at all (reported on stderr)."""
    ms = graph_ms(fn)
    if ms != ms:
        try:
            ms = time_ms(fn)
        except Exception:  # a failing baseline must not stop the benchmark
            import traceback

            traceback.print_exc()
    return ms


_stk_cache = {}


def stk_ms(torch, N, C, K, density, dtype):
    """stk's forward (dds), input_grad (dds on the transpose) and weight_grad (sdd), at block 128
    and this density, on inputs of the same shapes; NaN where stk is missing or cannot run."""
    key = (N, C, K, round(density, 4), dtype)
    if key in _stk_cache:
        return _stk_cache[key]
    nan = {"forward": float("nan"), "input_grad": float("nan"), "weight_grad": float("nan")}
    try:
        import stk
    except ImportError:
        print("stk unavailable: not importable (baseline NaN)")
        return _stk_cache.setdefault(key, nan)
    from sparseblocks import BlockLayout

    if C % STK_BLOCK or K % STK_BLOCK or N % STK_BLOCK or density == 0:
        return _stk_cache.setdefault(key, nan)
    layout = BlockLayout.random((C // STK_BLOCK, K // STK_BLOCK), density, seed=2, block_size=STK_BLOCK)
    mask = torch.as_tensor(layout.element_mask(), device="cuda")
    gen = torch.Generator(device="cuda").manual_seed(1)
    W = torch.randn(C, K, device="cuda", dtype=dtype, generator=gen) * mask
    x = torch.randn(N, C, device="cuda", dtype=dtype, generator=gen)
    dy = torch.randn(N, K, device="cuda", dtype=dtype, generator=gen)
    with torch.no_grad():
        Ws = stk.ops.to_sparse(W, blocking=STK_BLOCK)
        Wt = Ws.t()
        error = relative_error(stk.ops.dds(x, Ws), x.double() @ W.double())
        if not error < TOLERANCE[str(dtype).split(".")[-1]]:
            print(f"stk's forward is off ({error:.2e}): baseline NaN")
            return _stk_cache.setdefault(key, nan)
        times = {
            "forward": device_ms(lambda: stk.ops.dds(x, Ws)),
            "input_grad": device_ms(lambda: stk.ops.dds(dy, Wt)),
            "weight_grad": device_ms(lambda: stk.ops.sdd(x.t(), dy, Ws)),
        }
    return _stk_cache.setdefault(key, times)


def relative_error(got, want):
    return float((got.double() - want).norm() / want.norm().clamp_min(1e-30))


def block_gather(torch, dense, layout):
    """Blocks of a dense (C, K) tensor in the layout's storage order."""
    bs = layout.block_size
    cb, kb = layout.shape
    tiles = dense.reshape(cb, bs, kb, bs).permute(0, 2, 1, 3)
    coords = torch.as_tensor(layout.coords, device=dense.device, dtype=torch.long)
    return tiles[coords[:, 0], coords[:, 1]].contiguous()


def bench_config(torch, bsmm, layout, N, dtype_name, records, versions=(None,), baselines=BASELINES):
    dtype = getattr(torch, dtype_name)
    C, K = layout.dense_shape
    bs = layout.block_size
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(N, C, device="cuda", dtype=dtype, generator=gen)
    dy = torch.randn(N, K, device="cuda", dtype=dtype, generator=gen)
    w = torch.randn(layout.w_shape, device="cuda", dtype=dtype, generator=gen) / np.sqrt(C * layout.density)
    W = torch.as_tensor(layout.to_dense(w.float().cpu().numpy()), device="cuda")

    # Check first: every product of every version against a float64 dense product.
    x64, dy64, W64 = x.double(), dy.double(), W.double()
    for version in versions:
        errors = {
            "forward": relative_error(bsmm.forward(x, w, layout, version=version), x64 @ W64),
            "input_grad": relative_error(bsmm.input_grad(dy, w, layout, version=version), dy64 @ W64.T),
            "weight_grad": relative_error(bsmm.weight_grad(x, dy, layout, version=version),
                                          block_gather(torch, x64.T @ dy64, layout)),
        }
        for name, error in errors.items():
            if not error < TOLERANCE[dtype_name]:
                raise AssertionError(f"{name} v{version} N={N} bs={bs} density={layout.density:.2f} "
                                     f"{dtype_name}: error {error:.2e}")
    del x64, dy64, W64

    # Baselines, measured in this run.
    Wd = W.to(dtype)
    torch.backends.cuda.matmul.allow_tf32 = False
    measured = {}
    if "torch_dense" in baselines:
        measured["torch_dense"] = {
            "forward": device_ms(lambda: x @ Wd),
            "input_grad": device_ms(lambda: dy @ Wd.T),
            "weight_grad": device_ms(lambda: x.T @ dy),
        }
    if "torch_bsr" in baselines or "torch_triton_bsr" in baselines:
        bsr, triton = {}, {}
        try:
            W_t_bsr = Wd.T.contiguous().to_sparse_bsr((bs, bs))  # (K, C): W_t_bsr @ xᵀ = (x·W)ᵀ
            W_bsr = Wd.to_sparse_bsr((bs, bs))
            xt, dyt = x.T.contiguous(), dy.T.contiguous()
            bsr["forward"] = device_ms(lambda: W_t_bsr @ xt)
            bsr["input_grad"] = device_ms(lambda: W_bsr @ dyt)
        except Exception as error:  # no BSR kernel for this dtype or block size
            print(f"torch BSR unavailable ({dtype_name}, bs={bs}): {error}")
            bsr = {"forward": float("nan"), "input_grad": float("nan")}
        try:
            from torch.sparse._triton_ops import bsr_dense_mm

            triton["forward"] = device_ms(lambda: bsr_dense_mm(W_t_bsr, xt))
            triton["input_grad"] = device_ms(lambda: bsr_dense_mm(W_bsr, dyt))
        except Exception as error:  # no Triton, or no kernel for this dtype or block size
            print(f"torch Triton BSR unavailable ({dtype_name}, bs={bs}): {error}")
            triton = {"forward": float("nan"), "input_grad": float("nan")}
        measured["torch_bsr"], measured["torch_triton_bsr"] = bsr, triton
    if "stk" in baselines and dtype_name != "float32":
        measured["stk"] = stk_ms(torch, N, C, K, layout.density, dtype)

    flops = 2.0 * N * layout.n_blocks * bs * bs
    params = {"dtype": dtype_name, "block_size": bs, "density": round(layout.density, 3), "N": N, "C": C, "K": K,
              "n_blocks": layout.n_blocks}
    for version in versions:
        calls = {
            "forward": lambda: bsmm.forward(x, w, layout, version=version),
            "input_grad": lambda: bsmm.input_grad(dy, w, layout, version=version),
            "weight_grad": lambda: bsmm.weight_grad(x, dy, layout, version=version),
        }
        for name, call in calls.items():
            timed = {b: times[name] for b, times in measured.items() if name in times}
            ran = bsmm.default_version(dtype_name) if version is None else version
            records.append(Record(name, dict(params, version=ran), device_ms(call), timed, flops=flops))


def launch_overhead(torch, bsmm, BlockLayout):
    """Host time of one call from torch tensors on a tiny problem, beside a tiny torch op."""
    layout = BlockLayout.dense((2, 2), 32)
    x = torch.randn(8, 64, device="cuda")
    w = torch.randn(layout.w_shape, device="cuda")
    small = torch.randn(8, 64, device="cuda")

    def per_call_ms(fn, calls=2000):
        for _ in range(50):
            fn()
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
        return (time.perf_counter() - start) / calls * 1e3

    ours = per_call_ms(lambda: bsmm.forward(x, w, layout))
    tiny = per_call_ms(lambda: torch.mm(small, small.T))
    return Record("launch_overhead", {"dtype": "float32", "block_size": 32, "N": 8, "C": 64, "K": 64}, ours,
                  {"torch_tiny_op": tiny})


def kernel_resources(bsmm):
    """Registers, local memory and shared memory of every kernel compiled so far."""
    lines = []
    from sparseblocks.runtime import compile as compile_cache

    for key, kernel in sorted(compile_cache._kernels.items(), key=str):
        for compiled in getattr(kernel, "overloads", {}).values():
            lines.append(f"{key}: {compiled.regs_per_thread} registers, {compiled.local_mem_per_thread} B local, "
                         f"{compiled.shared_mem_per_block} B shared")
    return "\n".join(lines)


def merged(paths):
    """(records, device) of several runs' JSON files (runs split by --rows or dtypes), TFLOP/s
    restored; a later file's record of a case (name, dtype, block size, density, N, C, K) replaces
    an earlier one's, so that a re-run of some cases updates the results in place."""
    from benchmarks.common import merged_records

    def case(name, p):
        return (name, *(p.get(k) for k in ("dtype", "block_size", "density", "N", "C", "K")))

    def flops(name, p):
        return 2.0 * p["N"] * p["n_blocks"] * p["block_size"] ** 2 if "n_blocks" in p else None

    return merged_records(paths, case, flops)


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="N = C = K = 4096, blocks 64 and 128, fp16 and bf16")
    parser.add_argument("--out-dir", default=None)
    parser.add_argument("--versions", default="default",
                        help="comma-separated kernel versions to time; 'default': the library's choice per dtype")
    parser.add_argument("--block-sizes", default=None, help="comma-separated block sizes (default: all)")
    parser.add_argument("--rows", default=None, help="comma-separated N (default: all)")
    parser.add_argument("--densities", default=None, help="comma-separated densities (default: all)")
    parser.add_argument("--dtypes", default=None, help="comma-separated dtypes (default: all)")
    parser.add_argument("--baselines", default=",".join(BASELINES),
                        help=f"comma-separated baselines to time (default: all of {', '.join(BASELINES)})")
    parser.add_argument("--no-overhead", action="store_true", help="skip the launch-overhead record")
    parser.add_argument("--merge", nargs="+", metavar="JSON",
                        help="only merge these runs' JSON files into results/bsmm.json and .md")
    args = parser.parse_args()
    if args.merge:
        records, device = merged(args.merge)
        write_results("bsmm", records, device=device, **({} if args.out_dir is None else {"directory": args.out_dir}))
        print_table(records, f"bsmm on {device}")
        return

    import torch

    from sparseblocks import BlockLayout
    from sparseblocks import bsmm

    shapes, block_sizes, densities, dtypes = sizes(args.quick)
    if args.block_sizes:
        block_sizes = [int(b) for b in args.block_sizes.split(",")]
    if args.rows:
        shapes = [shape for shape in shapes if str(shape[0]) in args.rows.split(",")]
    if args.densities:
        densities = [float(d) for d in args.densities.split(",")]
    if args.dtypes:
        dtypes = args.dtypes.split(",")
    baselines = tuple(args.baselines.split(",")) if args.baselines else ()
    versions = tuple(None if v == "default" else int(v) for v in args.versions.split(","))
    records = []
    name = "bsmm" + ("_quick" if args.quick else "") + (f"_bs{args.block_sizes.replace(',', '_')}" if args.block_sizes else "") \
        + (f"_n{args.rows.replace(',', '_')}" if args.rows else "") \
        + (f"_d{args.densities.replace(',', '_')}" if args.densities else "")
    kwargs = {} if args.out_dir is None else {"directory": args.out_dir}
    for N, C, K in shapes:
        for bs in block_sizes:
            for density in densities:
                layout = BlockLayout.random((C // bs, K // bs), density, seed=1, block_size=bs)
                for dtype in dtypes:
                    bench_config(torch, bsmm, layout, N, dtype, records, versions, baselines)
                    print(f"done N={N} bs={bs} density={density} {dtype}", flush=True)
                    # Written as it goes: a run cut short by a time limit keeps what it measured.
                    write_results(name + "_partial", records, **kwargs)
    if not args.no_overhead:
        records.append(launch_overhead(torch, bsmm, BlockLayout))
    write_results(name, records, **kwargs)
    resources = kernel_resources(bsmm)
    print(resources)
    if args.out_dir:
        (Path(args.out_dir) / "bsmm_kernels.txt").write_text(resources + "\n")
    print_table(records, f"bsmm on {device_name()}")


if __name__ == "__main__":
    main()
