"""Kernel variants of the bsmm products side by side on the GPU (a developer's script).

    python3 scripts/bsmm_variants.py [--out DIR]

For each variant (a kernel version, and for version 4 vector loads, the
shared layout, an unrolled inner loop, a register cap, the weight gradient's
loads in flight): check forward, input_grad and weight_grad against float64
products, then time them with CUDA events at C = K = 4096 (by default N = 4096, 10 % density,
blocks 32 and 64, fp32 and fp16: see --help), beside torch dense and torch BSR measured in
the same run. Prints one table and each kernel's registers, local and shared
memory.
"""

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench_bsmm import block_gather, relative_error  # noqa: E402
from benchmarks.common import baseline_ms, device_name, time_ms  # noqa: E402

# (block size, storage) pairs of the settings keyed by them.
KINDS = [(bs, storage) for bs in (16, 32, 64) for storage in ("float32", "float16")]
# name -> (version, settings of kernels.bsmm); unnamed settings keep the module's defaults.
VARIANTS = {
    "v4": (4, {}),
    "v4 scalar loads": (4, {"V4_VECTOR": False}),
    "v4 swizzle": (4, {"V4_LAYOUT": {16: "swizzle", 32: "swizzle", 64: "swizzle"}}),
    "v4 not unrolled": (4, {"V4_UNROLL": {16: False, 32: False, 64: False}}),
    "v4 regs<=168": (4, {"V4_OPTIONS": {"max_registers": 168}}),
    "v4 wgrad batch 8": (4, {"V4_WGRAD_BATCH": 8}),
    # Block 16 on version 4's kernels (by default it runs version 3's):
    "v4 bs16 rows 512": (4, {"V4_ROWS": {16: 512, 32: 256, 64: 128}, "V4_WGRAD_ROWS": {16: 16, 32: 16, 64: 32}}),
    "v4 bs16 rows 512 not unrolled": (4, {"V4_ROWS": {16: 512, 32: 256, 64: 128},
                                          "V4_UNROLL": {16: False, 32: True, 64: True}}),
    "v4 bs16 rows 256": (4, {"V4_ROWS": {16: 256, 32: 256, 64: 128}, "V4_WGRAD_ROWS": {16: 32, 32: 16, 64: 32}}),
    "v5": (5, {}),  # tensor cores: fp16, and fp32 as 3xTF32 with round-to-nearest sums
    "v5 tensor-core sums": (5, {"V5_ROUNDED_SUMS": False}),  # fp32: the mma accumulates
    "v5 split dropping NaN": (5, {"V5_NAN_SAFE": False}),  # fp32: sessions 6-29's split, one instruction fewer
    "v5 v4 wgrad": (5, {"V5_WGRAD": False}),  # version 4's weight gradient
    "v5 stage 16 words": (5, {"V5_STAGE_WORDS": {kind: 16 for kind in KINDS}}),
    "v5 whole blocks": (5, {"V5_STAGE_WORDS": {}}),  # a whole block's k a stage (also fp32 block 64)
    "v5 two stages": (5, {"V5_STAGES": 2}),  # every load through registers, double-buffered
    "v5 three stages": (5, {"V5_STAGES": 3}),  # a ring of three, activation rows by cp.async
    "v5 wgrad through registers": (5, {"V5_WGRAD_ASYNC": False}),  # fp32 axis 1 without cp.async
    "v5 four stages": (5, {"V5_STAGES": 4}),
    "v5 weights through registers": (5, {"V5_WEIGHT_REGISTERS": set(KINDS)}),  # input_grad's W in the ring
    "v5 weights as rows": (5, {"V5_WEIGHT_REGISTERS": set()}),  # input_grad's W by cp.async in the ring
    # The forward through a transposed copy of W's blocks, wherever input_grad's weights go as rows:
    "v5 transposed forward": (5, {"V5_TRANSPOSED_FORWARD": {(16, "float16"): 1, (64, "float16"): 1, (16, "float32"): 1,
                                                             (32, "float32"): 1, (64, "float32"): 1}}),
    "v5 direct forward": (5, {"V5_TRANSPOSED_FORWARD": {}}),  # the forward reads W's blocks as they are
    "v5 wgrad ring 3": (5, {"V5_WGRAD_STAGES": 3}),  # fp32 axis 1 weight gradient: 2 steps in flight
    "v5 wgrad ring 4": (5, {"V5_WGRAD_STAGES": 4}),
    "v5 launch order": (5, {"PRODUCT_GROUP": 0}),  # row tiles fastest, each segment over all N
    "v5 group 4": (5, {"PRODUCT_GROUP": 4}),
    "v5 group 16": (5, {"PRODUCT_GROUP": 16}),
    # Blocks of one block-row a weight-gradient warp takes together (default {16: 4}):
    "v5 wgrad group 1": (5, {"V5_WGRAD_GROUP": {}}),
    "v5 wgrad group 2": (5, {"V5_WGRAD_GROUP": {16: 2}}),
    "v5 wgrad group 8": (5, {"V5_WGRAD_GROUP": {16: 8}}),
    "v5 wgrad bs32 group 2": (5, {"V5_WGRAD_GROUP": {16: 4, 32: 2}}),
    "v5 wgrad group 3": (5, {"V5_WGRAD_GROUP": {16: 3}}),
    "v5 wgrad group 4 of 2 warps": (5, {"V5_WGRAD_GROUP_WARPS": 2}),
    "v5 wgrad group 4 of 1 warp": (5, {"V5_WGRAD_GROUP_WARPS": 1}),
    # Block 64's ring product tiles (default since the tenth session: 4 warps of 64 x 32, 128
    # rows). 256 rows read a W block once for twice the rows: 1/64 + 1/256 instead of 1/64 +
    # 1/128 values of L2 traffic a MAC.
    "v5 bs64 128 rows 8 warps of 32 rows": (5, {"V5_RING_WARPS": {}}),
    "v5 bs64 256 rows 16 warps": (5, {"V5_RING_WARPS": {(64, s): (16, 32) for s in ("float16", "float32")}}),
    "v5 bs64 256 rows warps of 64 rows": (5, {"V5_RING_WARPS": {(64, s): (8, 64) for s in ("float16", "float32")}}),
}
# Variants that change only fp32 kernels (or that earlier sessions timed in fp32 only).
FP32_ONLY = ("v4 scalar loads", "v4 not unrolled", "v4 regs<=168", "v4 wgrad batch 8", "v4 bs16 rows 512 not unrolled",
             "v4 bs16 rows 256", "v5 tensor-core sums", "v5 wgrad through registers", "v5 wgrad ring 3",
             "v5 wgrad ring 4")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=None)
    parser.add_argument("--densities", default="0.10", help="comma-separated")
    parser.add_argument("--rows", type=int, default=4096, help="N (C = K = 4096)")
    parser.add_argument("--dtypes", default="float32,float16")
    parser.add_argument("--block-sizes", default="32,64")
    parser.add_argument("--variants", default=None, help="comma-separated names (default: all)")
    parser.add_argument("--products", default="forward,input_grad,weight_grad",
                        help="comma-separated: the products to check and time (others show nan)")
    args = parser.parse_args()

    import torch

    from sparseblocks import BlockLayout
    from sparseblocks.kernels import bsmm

    DEFAULTS = {key: getattr(bsmm, key) for key in
                {key for _, settings in VARIANTS.values() for key in settings}}

    rows = []
    resources = []
    chosen = VARIANTS if args.variants is None else {k: VARIANTS[k] for k in args.variants.split(",")}
    N = args.rows
    configs = [(int(b), float(d)) for b in args.block_sizes.split(",") for d in args.densities.split(",")]
    for bs, density in configs:
        layout = BlockLayout.random((4096 // bs, 4096 // bs), density, seed=1, block_size=bs)
        flops = 2.0 * N * layout.n_blocks * bs * bs
        for dtype_name in args.dtypes.split(","):
            dtype = getattr(torch, dtype_name)
            gen = torch.Generator(device="cuda").manual_seed(0)
            x = torch.randn(N, 4096, device="cuda", dtype=dtype, generator=gen)
            w = torch.randn(layout.w_shape, device="cuda", dtype=dtype, generator=gen) / np.sqrt(410)
            W = torch.as_tensor(layout.to_dense(w.float().cpu().numpy()), device="cuda")
            dy = torch.randn(N, 4096, device="cuda", dtype=dtype, generator=gen)
            want_y, want_dx = x.double() @ W.double(), x.double() @ W.double().T
            want_dw = block_gather(torch, x.double().T @ dy.double(), layout)
            torch.backends.cuda.matmul.allow_tf32 = False
            Wd = W.to(dtype)
            dense = baseline_ms(lambda: x @ Wd)
            W_t_bsr = Wd.T.contiguous().to_sparse_bsr((bs, bs))
            xt = x.T.contiguous()
            bsr = baseline_ms(lambda: W_t_bsr @ xt)
            for name, (version, settings) in chosen.items():
                if dtype_name == "float16" and name in FP32_ONLY:
                    continue
                for key, value in {**DEFAULTS, **settings}.items():
                    setattr(bsmm, key, value)
                # Kernels and kept launch plans are made with the settings: start both afresh (a kept
                # plan would replay the previous variant's kernel; before the seventh session it
                # did, so earlier product comparisons between settings of one version are void).
                bsmm._kernels.clear()
                bsmm._plans.clear()
                calls = {
                    "forward": (lambda: bsmm.forward(x, w, layout, version=version), want_y),
                    "input_grad": (lambda: bsmm.input_grad(x, w, layout, version=version), want_dx),
                    "weight_grad": (lambda: bsmm.weight_grad(x, dy, layout, version=version), want_dw),
                }
                times = {name: float("nan") for name in calls}
                errors = [0.0]
                try:
                    for product in args.products.split(","):
                        call, want = calls[product]
                        errors.append(relative_error(call(), want))
                        times[product] = time_ms(call)
                except Exception as exc:  # a variant that does not build or launch: a row of nan
                    print(f"{name}, bs {bs}, {dtype_name}: {type(exc).__name__}: {exc}", flush=True)
                    errors.append(float("nan"))
                ok = max(errors) < (1e-5 if dtype_name == "float32" else 3e-3)
                fwd, bwd, wgt = times["forward"], times["input_grad"], times["weight_grad"]
                rows.append({"variant": name, "bs": bs, "density": density, "N": N, "dtype": dtype_name,
                             "ok": ok, "error": max(errors),
                             "forward_ms": fwd, "input_grad_ms": bwd, "weight_grad_ms": wgt,
                             "tflops": flops / fwd / 1e9, "dense_ms": dense, "bsr_ms": bsr})
                print(json.dumps(rows[-1]), flush=True)
                for key, kernel in bsmm._kernels.items():
                    for compiled in kernel.overloads.values():
                        resources.append(f"{name} {key}: {compiled.regs_per_thread} regs, "
                                         f"{compiled.local_mem_per_thread} B local, {compiled.shared_mem_per_block} B shared")
            for key, value in DEFAULTS.items():
                setattr(bsmm, key, value)
    print(f"\n{device_name()}, N = {N}, C = K = 4096")
    print("| variant | bs | density | dtype | ok | forward ms | TFLOP/s | input_grad ms | weight_grad ms | dense ms "
          "| bsr ms | vs dense | vs bsr |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['variant']} | {r['bs']} | {r['density']} | {r['dtype']} | {r['ok']} | {r['forward_ms']:.3f} | "
              f"{r['tflops']:.1f} | "
              f"{r['input_grad_ms']:.3f} | {r['weight_grad_ms']:.3f} | {r['dense_ms']:.3f} | {r['bsr_ms']:.3f} | "
              f"{r['dense_ms'] / r['forward_ms']:.2f}x | {r['bsr_ms'] / r['forward_ms']:.2f}x |")
    print("\n".join(sorted(set(resources))))
    if args.out:
        Path(args.out, "variants.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
