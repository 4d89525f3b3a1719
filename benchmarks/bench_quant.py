"""Bit-plane products and quantize-and-pack on the GPU, against dense fp16 cuBLAS, int8
(``torch._int_mm``) and a device copy, all timed in the same run (graph replays: device time).

Records: ``matmul`` (params bits W1A1 | W2A2 | W4A4, packing: whether the activations' quantize-
and-pack is inside the timed call, density: 1.0 or the layout's), baselines ``dense_fp16`` and
``int8`` (and ``dense_binary``, the same bits dense, for the block-sparse rows); ``pack`` (an fp16
input quantized to 1, 2 and 4 bits), baseline ``copy`` (a device copy of the input);
``lqlinear_inference`` (an `LQLinear` call without gradients, fp16 in and out: the activations
quantized and packed, the product, the bias; the weight's planes kept, ``keep_packed``), baseline
``nn_linear`` (a dense fp16 ``nn.Linear``); ``quant_conv2d`` (a `QuantConv2d` call the same way
on a ResNet-like 3 x 3 layer, both memory formats), baseline ``cudnn_fp16`` (``nn.Conv2d`` in
fp16, the same memory format). Every product is checked first against the dequantized operands'
float product, every layer against its float path (the quantizers in torch).

    python -m benchmarks.bench_quant [--quick] [--out-dir DIR]
"""

import argparse

import numpy as np

from benchmarks.common import Record, copy_ms, device_name, graph_ms, merge_runs, print_table, write_results

SIZE = 4096
BITS = {"W1A1": (1, 1), "W2A2": (2, 2), "W4A4": (4, 4)}


def operands(torch, quant, n, bits, rng):
    """(x fp16 (n, n), activation basis, weight QuantArray)."""
    x = torch.rand(n, n, device="cuda", dtype=torch.float16)
    w = torch.randn(n, n, device="cuda", dtype=torch.float16)
    a_basis = (2.0 ** np.arange(bits[1]) / 2 ** bits[1]).astype(np.float32)
    w_basis = (rng.uniform(0.5, 1.0, (n, bits[0])) * 2.0 ** np.arange(bits[0]) * 0.02).astype(np.float32)
    return x, a_basis, quant.quantize(w, w_basis, True)


def packer(torch, quant, x, a_basis):
    """Quantize-and-pack of x as the torch layer runs it: thresholds and codes made on the device
    once, so that a call launches the kernel alone (and a CUDA graph can capture it)."""
    from sparseblocks.runtime.arrays import Operand
    from sparseblocks.torch.quant import levels

    basis = torch.tensor(a_basis[None], device="cuda")
    _, order, thresholds = levels(basis, False)
    order, thresholds = order.contiguous(), thresholds.contiguous()
    return lambda: quant.api.pack(Operand(x, "x"), thresholds, order, basis, False, quant.DEFAULT)


def check(torch, quant, a, w, y, layout=None):
    """y against the float product of the dequantized operands (masked by the layout)."""
    xa, wa = torch.as_tensor(quant.dequantize(a)), torch.as_tensor(quant.dequantize(w))
    if layout is not None:
        wa = wa * torch.as_tensor(layout.element_mask().T.copy(), device="cuda", dtype=torch.float32)
    want = xa @ wa.T
    error = ((y.float() - want).abs().max() / want.abs().max()).item()
    assert error < 2e-3, f"product differs from the dequantized one: {error}"


def layer_error(torch, layer, x):
    """The packed call's largest error against the layer's float path, relative to its largest value."""
    with torch.no_grad():
        packed = layer(x).float()
    floats = layer(x.clone().requires_grad_(True)).detach().float()
    return ((packed - floats).abs().max() / floats.abs().max()).item()


def layers(torch, args):
    """The `LQLinear` and `QuantConv2d` records: a layer's call without gradients, fp16, beside the
    dense fp16 layer of the same shape."""
    from sparseblocks.torch import LQLinear, QuantConv2d

    records = []
    for name, (w_bits, a_bits) in BITS.items():
        if name == "W4A4":
            continue
        torch.manual_seed(0)
        layer = LQLinear(SIZE, SIZE, w_bits=w_bits, a_bits=a_bits, keep_packed=True).to("cuda", torch.float16).eval()
        dense = torch.nn.Linear(SIZE, SIZE).to("cuda", torch.float16)
        x = torch.rand(SIZE, SIZE, device="cuda", dtype=torch.float16)
        assert layer_error(torch, layer, x) < 1e-2
        with torch.no_grad():
            ms, base = graph_ms(lambda: layer(x)), graph_ms(lambda: dense(x))
        records.append(Record("lqlinear_inference", dict(N=SIZE, C=SIZE, O=SIZE, bits=name), ms, {"nn_linear": base}))
        for memory in ("channels_first",) if args.quick else ("channels_first", "channels_last"):
            layer = QuantConv2d(256, 256, 3, padding=1, w_bits=w_bits, a_bits=a_bits,
                                keep_packed=True).to("cuda", torch.float16).eval()
            dense = torch.nn.Conv2d(256, 256, 3, padding=1).to("cuda", torch.float16)
            x = torch.rand(32, 256, 56, 56, device="cuda", dtype=torch.float16)
            if memory == "channels_last":
                x, dense = x.to(memory_format=torch.channels_last), dense.to(memory_format=torch.channels_last)
            assert layer_error(torch, layer, x[:4]) < 1e-2
            with torch.no_grad():
                ms, base = graph_ms(lambda: layer(x)), graph_ms(lambda: dense(x))
            records.append(Record("quant_conv2d", dict(N=32, C=256, K=256, H=56, W=56, R=3, bits=name, memory=memory),
                                  ms, {"cudnn_fp16": base}))
    return records


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="W1A1 and W2A2 only, one density")
    parser.add_argument("--merge", nargs="+", metavar="JSON",
                        help="only merge these runs' JSON files (a later one's case replaces an earlier one's)")
    parser.add_argument("--out-dir", default=None)
    args = parser.parse_args()
    if args.merge:
        merge_runs("quant", args.merge, args.out_dir)
        return

    import torch

    from sparseblocks import quant
    from sparseblocks.layout import BlockLayout

    rng = np.random.default_rng(0)
    n = SIZE
    records = []
    a16, b16 = torch.randn(n, n, device="cuda", dtype=torch.float16), torch.randn(n, n, device="cuda",
                                                                                      dtype=torch.float16)
    a8, b8 = (torch.randint(-8, 8, (n, n), device="cuda", dtype=torch.int8) for _ in range(2))
    dense_fp16 = graph_ms(lambda: a16 @ b16)
    int8 = graph_ms(lambda: torch._int_mm(a8, b8.T))
    baselines = {"dense_fp16": dense_fp16, "int8": int8}
    shape = {"N": n, "C": n, "O": n}
    dense_binary = {}
    for name, bits in BITS.items():
        if args.quick and name == "W4A4":
            continue
        x, a_basis, w = operands(torch, quant, n, bits, rng)
        pack = packer(torch, quant, x, a_basis)
        a = pack()
        np.testing.assert_array_equal(a.planes.cpu().numpy(), quant.quantize(x, a_basis, False).planes.cpu().numpy())
        check(torch, quant, a, w, quant.matmul(a, w, out_dtype="float16"))
        ms = graph_ms(lambda: quant.matmul(a, w, out_dtype="float16"))
        dense_binary[name] = ms
        records.append(Record("matmul", dict(shape, bits=name, packing=False, density=1.0), ms, baselines))
        ms = graph_ms(lambda: quant.matmul(pack(), w, out_dtype="float16"))
        records.append(Record("matmul", dict(shape, bits=name, packing=True, density=1.0), ms, baselines))
        # quantize-and-pack of the fp16 input against a copy of it
        records.append(Record("pack", dict(N=n, C=n, bits=bits[1], dtype="float16"),
                              graph_ms(pack),
                              {"copy": copy_ms(x.numel() * x.element_size(), graph=True)}))
    x, a_basis, w = operands(torch, quant, n, BITS["W1A1"], rng)
    a = packer(torch, quant, x, a_basis)()
    for density in (0.1,) if args.quick else (0.1, 0.25, 0.5):
        for bs in (32, 64):
            layout = BlockLayout.random((n // bs, n // bs), density, seed=1, block_size=bs)
            check(torch, quant, a, w, quant.matmul(a, w, layout=layout, out_dtype="float16"), layout)
            ms = graph_ms(lambda: quant.matmul(a, w, layout=layout, out_dtype="float16"))
            records.append(Record("matmul", dict(shape, bits="W1A1", packing=False, density=density, block_size=bs),
                                  ms, dict(baselines, dense_binary=dense_binary["W1A1"])))
    records += layers(torch, args)
    kwargs = {} if args.out_dir is None else {"directory": args.out_dir}
    write_results("quant" + ("_quick" if args.quick else ""), records, **kwargs)
    print_table(records, f"quant on {device_name()}")


if __name__ == "__main__":
    main()
