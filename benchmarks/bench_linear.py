"""One training step of a block-sparse MLP, and of a transformer's FFN, against the same model
dense, with stk's layers and with torch BSR weights.

The models: ``mlp``, 4 `BlockSparseLinear` layers of width 4096 (bias, ReLU between) on 4096 rows;
``ffn``, a transformer FFN 4096 -> 16384 -> 4096 (ReLU between) on 8192 rows; ``mlp_relu`` and
``ffn_relu``, the same with each ReLU taken by the layer before it (``activation="relu"``: in the
product's epilogue), against the same baselines (which keep their ``nn.ReLU``). AdamW. A step is
forward, backward and the optimizer, in fp32 (TF32 off) or bf16, eager or ``torch.compile``d; the
baselines run the same step in the same run: ``dense`` (``nn.Linear``, the same mode), ``stk``
(the same model on stk's autograd ops, ``dds`` forward and ``sdd`` weight gradient, at block 128
and the same density: MegaBlocks' layers; eager, bf16; NaN where stk is not importable) and
``torch_bsr`` (weights as torch BSR tensors, eager; NaN where torch cannot train them). Each step
is checked first: its loss against the dense masked model's.

Records: ``train_step`` (params model, dtype, block_size, density, mode), and per configuration
``layer_overhead``: one layer's forward and backward as device time (a CUDA graph's replay)
against the sum of its three products' kernel times (baseline ``kernels``), and ``host_overhead``:
an eager layer call's host time (64 rows of a 1024-wide layer, queued behind a sleeping kernel so
that only the host is timed; baseline ``nn_linear``'s).

    python benchmarks/bench_linear.py [--quick] [--models mlp,ffn] [--modes eager,compiled] [--out-dir DIR]
"""

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import (Record, baseline_ms, device_name, graph_ms, merge_runs, print_table, time_ms,  # noqa: E402
                               write_results)


MODELS = {  # widths from input to output, rows
    "mlp": ((4096, 4096, 4096, 4096, 4096), 4096),
    "ffn": ((4096, 16384, 4096), 8192),
}
MODELS.update({f"{name}_relu": shape for name, shape in MODELS.items()})  # (our layers take the ReLU)
STK_BLOCK = 128


def mlp(torch, layer, widths, fused=False):
    """Linear layers ``layer(i, in, out)`` between consecutive widths, ReLU between them (with
    ``fused``, ``layer(i, in, out, relu)`` takes it)."""
    parts = []
    for i in range(len(widths) - 1):
        relu = i < len(widths) - 2
        if fused:
            parts.append(layer(i, widths[i], widths[i + 1], relu))
        else:
            parts += [layer(i, widths[i], widths[i + 1])] + ([torch.nn.ReLU()] if relu else [])
    return torch.nn.Sequential(*parts)


def stk_linear(torch, stk, in_features, out_features, density, seed, dtype):
    """A layer ``y = x·W + b`` with W an stk block-sparse matrix (blocks of 128) of this density:
    stk's ``dds`` forward, its autograd's ``dds``/``sdd`` backward, as MegaBlocks trains."""
    from sparseblocks import BlockLayout

    class StkLinear(torch.nn.Module):
        def __init__(self):
            super().__init__()
            layout = BlockLayout.random((in_features // STK_BLOCK, out_features // STK_BLOCK), density, seed=seed,
                                        block_size=STK_BLOCK)
            mask = torch.as_tensor(layout.element_mask(), device="cuda")
            dense = torch.randn(in_features, out_features, device="cuda", dtype=dtype) * mask / (in_features * density) ** 0.5
            self.topology = stk.ops.to_sparse(dense, blocking=STK_BLOCK)
            self.data = torch.nn.Parameter(self.topology.data)
            self.bias = torch.nn.Parameter(torch.zeros(out_features, device="cuda", dtype=dtype))

        def forward(self, x):
            t = self.topology
            w = stk.Matrix(t.size(), self.data, t.row_indices, t.column_indices, t.offsets, t.column_indices_t,
                           t.offsets_t, t.block_offsets_t)
            return stk.ops.dds(x, w) + self.bias

    return StkLinear()


class BsrLinear:
    """A linear layer whose weight is a torch BSR tensor: ``y = (W_bsr @ xᵀ)ᵀ + b``."""

    def __new__(cls, torch, dense, block_size):
        class Layer(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.weight = torch.nn.Parameter(dense.weight.detach().to_sparse_bsr((block_size, block_size)))
                self.bias = torch.nn.Parameter(dense.bias.detach().clone())

            def forward(self, x):
                return (self.weight @ x.t()).t() + self.bias

        return Layer()


def step_fn(torch, model, x, target):
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step():
        loss = torch.nn.functional.mse_loss(model(x), target)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)
        return loss

    return step


def stk_step_ms(torch, widths, tokens, density, dtype, cache={}):
    """stk's model's step (eager), NaN where stk is missing or cannot run; one per model and density."""
    key = (widths, tokens, density, dtype)
    if key not in cache:
        try:
            import stk

            torch.manual_seed(0)
            model = mlp(torch, lambda i, a, b: stk_linear(torch, stk, a, b, density, i, dtype), widths)
            x = torch.randn(tokens, widths[0], device="cuda", dtype=dtype)
            target = torch.randn(tokens, widths[-1], device="cuda", dtype=dtype)
            cache[key] = baseline_ms(step_fn(torch, model, x, target), warmup=5, repeat=20)
        except Exception as error:  # stk missing or failing: the baseline is NaN
            print(f"stk: {type(error).__name__}: {error}", file=sys.stderr)
            cache[key] = float("nan")
    return cache[key]


def bench_config(torch, dtype, bs, density, model_name, modes, records, dense_ms):
    from sparseblocks.torch import BlockSparseLinear
    from sparseblocks.torch.ops import bsmm_forward, bsmm_input_grad, bsmm_weight_bias_grad

    widths, tokens = MODELS[model_name]
    fused = model_name.endswith("_relu")
    width = widths[0]
    torch.manual_seed(0)
    sparse = mlp(torch, lambda i, a, b, relu=False: BlockSparseLinear(
        a, b, density=density, block_size=bs, seed=i, device="cuda", dtype=dtype,
        activation="relu" if relu else None), widths, fused)
    x = torch.randn(tokens, width, device="cuda", dtype=dtype)
    target = torch.randn(tokens, widths[-1], device="cuda", dtype=dtype)
    # Check: the sparse model's loss against the dense masked model's.
    dense = mlp(torch, lambda i, a, b: torch.nn.Linear(a, b, device="cuda", dtype=dtype), widths)
    with torch.no_grad():
        for s, d in zip(*([m for m in model if hasattr(m, "weight")] for model in (sparse, dense))):
            d.weight.copy_(s.to_dense())
            d.bias.copy_(s.bias)
        got = torch.nn.functional.mse_loss(sparse(x).float(), target.float())
        want = torch.nn.functional.mse_loss(dense(x).float(), target.float())
    if abs(got.item() - want.item()) > 2e-2 * abs(want.item()):
        raise AssertionError(f"loss {got.item()} against the dense masked model's {want.item()}")
    bsr_ms = float("nan")
    try:
        bsr = mlp(torch, lambda i, a, b: BsrLinear(torch, dense[2 * i], bs), widths)
        step_fn(torch, bsr, x, target)()  # (torch cannot yet train a BSR weight: NaN then)
        bsr_ms = baseline_ms(step_fn(torch, bsr, x, target))
    except Exception as error:
        print(f"torch_bsr: {type(error).__name__}: {error}", file=sys.stderr)
    name = str(dtype).replace("torch.", "")
    stk_ms = stk_step_ms(torch, widths, tokens, density, dtype) if dtype == torch.bfloat16 else float("nan")
    for mode in modes:
        model = torch.compile(sparse) if mode == "compiled" else sparse
        ms = time_ms(step_fn(torch, model, x, target), warmup=5, repeat=20)
        records.append(Record("train_step", {"model": model_name, "dtype": name, "block_size": bs, "density": density,
                                             "mode": mode, "width": width, "tokens": tokens, "layers": len(widths) - 1},
                              ms, {"dense": dense_ms[(model_name, name, mode)], "stk": stk_ms, "torch_bsr": bsr_ms}))
        print(f"done {model_name} {name} bs={bs} density={density} {mode}: {ms:.3f} ms", flush=True)
    if fused:  # (the layer records below are the unfused model's)
        return
    # One layer: device time of forward + backward against its products' kernel times.
    layer = sparse[0]
    xg = x.detach().clone().requires_grad_(True)
    dy = torch.randn(tokens, widths[1], device="cuda", dtype=dtype)

    def layer_step():
        xg.grad = None
        layer.weight.grad = None
        layer(xg).backward(dy)

    key = layer._layout_key

    def products():  # the layer's kernels, in the order its step runs them (the bias's gradient the weight's)
        bsmm_forward(x, layer.weight, key, layer.bias)
        bsmm_input_grad(dy, layer.weight, key)
        bsmm_weight_bias_grad(x, dy, key, layer.weight.dtype, layer.bias.dtype)

    params = {"dtype": name, "block_size": bs, "density": density, "width": width, "tokens": tokens}
    records.append(Record("layer_overhead", params, graph_ms(layer_step), {"kernels": graph_ms(products)}))
    records.append(host_overhead(torch, dtype, bs, density, name))


def host_overhead(torch, dtype, bs, density, name, width=1024, rows=64, calls=200):
    """Host milliseconds of an eager forward call (no grad), beside nn.Linear's: the calls are queued
    behind a sleeping kernel, so the device never holds the host back and only the host is timed."""
    from sparseblocks.torch import BlockSparseLinear

    layer = BlockSparseLinear(width, width, density=density, block_size=bs, device="cuda", dtype=dtype)
    linear = torch.nn.Linear(width, width, device="cuda", dtype=dtype)
    x = torch.randn(rows, width, device="cuda", dtype=dtype)

    def per_call(module):
        with torch.no_grad():
            for _ in range(20):
                module(x)
            torch.cuda.synchronize()
            torch.cuda._sleep(200_000_000)  # ~0.1 s of device time ahead of the calls
            start = time.perf_counter()
            for _ in range(calls):
                module(x)
            elapsed = time.perf_counter() - start
            torch.cuda.synchronize()
        return elapsed / calls * 1e3

    params = {"dtype": name, "block_size": bs, "density": density, "width": width, "tokens": rows}
    return Record("host_overhead", params, per_call(layer), {"nn_linear": per_call(linear)})


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="block 64, densities 10 and 25 %%")
    parser.add_argument("--modes", default="eager,compiled")
    parser.add_argument("--models", default="mlp,ffn")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--block-sizes", default=None, help="comma-separated (default: 32,64,128)")
    parser.add_argument("--densities", default=None, help="comma-separated (default: 0.05,0.1,0.25,0.5)")
    parser.add_argument("--merge", nargs="+", metavar="JSON",
                        help="only merge these runs' JSON files (a later one's case replaces an earlier one's)")
    parser.add_argument("--out-dir", default=None)
    args = parser.parse_args()
    if args.merge:
        merge_runs("linear", args.merge, args.out_dir)
        return

    import torch

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    block_sizes, densities = ([64], [0.1, 0.25]) if args.quick else ([32, 64, 128], [0.05, 0.1, 0.25, 0.5])
    if args.block_sizes:
        block_sizes = [int(b) for b in args.block_sizes.split(",")]
    if args.densities:
        densities = [float(d) for d in args.densities.split(",")]
    modes = args.modes.split(",")
    records = []
    for model_name in args.models.split(","):
        widths, tokens = MODELS[model_name]
        for dtype in (getattr(torch, d) for d in args.dtypes.split(",")):
            name = str(dtype).replace("torch.", "")
            x = torch.randn(tokens, widths[0], device="cuda", dtype=dtype)
            target = torch.randn(tokens, widths[-1], device="cuda", dtype=dtype)
            dense_ms = {}
            for mode in modes:
                torch.manual_seed(0)
                dense = mlp(torch, lambda i, a, b: torch.nn.Linear(a, b, device="cuda", dtype=dtype), widths)
                step = step_fn(torch, torch.compile(dense) if mode == "compiled" else dense, x, target)
                dense_ms[(model_name, name, mode)] = baseline_ms(step, warmup=5, repeat=20)
            for bs in block_sizes:
                for density in densities:
                    bench_config(torch, dtype, bs, density, model_name, modes, records, dense_ms)
                    write_results("linear_partial", records,
                                  **({} if args.out_dir is None else {"directory": args.out_dir}))
    write_results("linear", records, **({} if args.out_dir is None else {"directory": args.out_dir}))
    print_table(records, f"linear on {device_name()}")


if __name__ == "__main__":
    main()
