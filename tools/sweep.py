"""A/B sweep over config fields: every variant checked against the default, then timed beside it.

    python tools/sweep.py bsmm forward --set v5_stages=2,3,4 [--set product_group=0,8]
           [--dtype float16] [--n 4096] [--c 4096] [--k 4096] [--block-size 32,64] [--density 0.1,0.5]
    python tools/sweep.py sbnet sparse_gather --set row_tile_pixels=16,32,64 [--channels 64] [--fraction 0.1]
    python tools/sweep.py fused sparse_gather_matmul --set gather_tile="(128,64,16,2,4,None)"
    python tools/sweep.py torch res_block --set fused_gather=False,True [--fraction 0.1]
    python tools/sweep.py quant matmul --set warp_rows=32,64 [--bits W2A2] [--density 1]
    python tools/sweep.py norms layer_norm --set row_threads=128,256 [--axis 0] [--n 4096] [--c 4096]
    python tools/sweep.py attention forward --set warp_rows=16,32 [--layout causal] [--n 16384] [--dtype bfloat16]
    python tools/sweep.py conv forward --set implicit=False [--block-size 32] [--density 0.25] [--images 32]
           [--channels 256] [--height 56] [--width 56]
    python tools/sweep.py quant conv2d --set chunk_words=8,16,32 [--images 32] [--channels 256] [--height 56]
    python tools/sweep.py linear ffn --set v7_wgrad_waves=True --dtype bfloat16 --block-size 128 --n 8192 --k 16384
    python tools/sweep.py ew lstm --set lstm_quads16=1,2 [--n 4096] [--c 4096]; ew unary --unary sigmoid
    python tools/sweep.py cast float_cast --set groups=1,2 [--target float8_e5m2] [--dtype float32]

Each variant is the op's default config with the given fields replaced (the cartesian
product of every ``--set``). Its output is compared with the default's first (it must agree
within the dtype's tolerance; ``--unchecked`` skips that, for variants that compute something
else on purpose, such as ``v6_multiply=False``, the data movement's floor), then the default and the variants are timed in interleaved
rounds (CUDA events, median of each round's calls), so that a drift of the GPU's clocks
lands on all of them. Prints one table: variant, ms, default ms / variant ms; a combination the
config refuses is skipped with its reason. Needs a GPU and torch.
"""

import argparse
import ast
import itertools
import statistics
from dataclasses import replace


def parse_values(text):
    """``name=v1,v2`` -> (name, [v1, v2]), values read as Python literals (else strings)."""
    name, _, values = text.partition("=")
    out = []
    for item in split_top_level(values):
        try:
            out.append(ast.literal_eval(item))
        except (ValueError, SyntaxError):
            out.append(item)
    return name.strip(), out


def split_top_level(text):
    """Split on commas outside brackets: "(1,2),3" -> ["(1,2)", "3"]."""
    parts, depth, current = [], 0, ""
    for ch in text:
        depth += ch in "([{"
        depth -= ch in ")]}"
        if ch == "," and depth == 0:
            parts.append(current)
            current = ""
        else:
            current += ch
    return parts + [current] if current else parts


def bsmm_case(torch, args):
    import sparseblocks as sb
    from sparseblocks import bsmm

    layout = sb.BlockLayout.random((args.c // args.block_size, args.k // args.block_size), args.density, seed=1,
                                   block_size=args.block_size)
    dtype = getattr(torch, args.dtype)
    x = torch.randn(args.n, args.c, device="cuda", dtype=dtype)
    dy = torch.randn(args.n, args.k, device="cuda", dtype=dtype)
    w = torch.randn(layout.w_shape, device="cuda", dtype=dtype) / (args.c * args.density) ** 0.5
    calls = {"forward": lambda cfg: bsmm.forward(x, w, layout, config=cfg),
             "input_grad": lambda cfg: bsmm.input_grad(dy, w, layout, config=cfg),
             "weight_grad": lambda cfg: bsmm.weight_grad(x, dy, layout, config=cfg)}
    return bsmm.DEFAULT, calls[args.call]


def sbnet_case(torch, args):
    from sparseblocks import sbnet

    dtype = getattr(torch, args.dtype)
    mask = (torch.rand(args.images, args.height, args.width, device="cuda") < args.fraction / 64).float()
    x = torch.randn(args.images, args.height, args.width, args.channels, device="cuda", dtype=dtype)
    geometry = dict(bsize=args.window, bstride=args.window - 2, boffset=-1)
    indices, count = sbnet.reduce_mask(mask, **geometry)
    blocks = sbnet.sparse_gather(x, indices, count=count, **geometry)
    calls = {"reduce_mask": lambda cfg: sbnet.reduce_mask(mask, **geometry, config=cfg)[0],
             "sparse_gather": lambda cfg: sbnet.sparse_gather(x, indices, count=count, **geometry, config=cfg),
             "sparse_scatter": lambda cfg: sbnet.sparse_scatter(blocks, indices, x, add=True, atomic=True,
                                                                count=count, **geometry, config=cfg)}
    return sbnet.DEFAULT, calls[args.call]


def fused_case(torch, args):
    from sparseblocks import fused, sbnet

    dtype = getattr(torch, args.dtype)
    mask = (torch.rand(args.images, args.height, args.width, device="cuda") < args.fraction / 64).float()
    x = torch.randn(args.images, args.height, args.width, args.channels, device="cuda", dtype=dtype)
    w = torch.randn(args.channels // 4, args.channels, device="cuda", dtype=dtype) / args.channels ** 0.5
    w3 = torch.randn(args.channels, args.channels // 4, device="cuda", dtype=dtype)
    geometry = dict(bsize=args.window, bstride=args.window - 2, boffset=-1)
    indices, count = sbnet.reduce_mask(mask, **geometry)
    h = torch.randn(len(indices), args.window - 2, args.window - 2, args.channels // 4, device="cuda", dtype=dtype)
    out = (args.window - 2, args.window - 2, 0)
    calls = {"sparse_gather_matmul": lambda cfg: fused.sparse_gather_matmul(x, indices, w, **geometry, count=count,
                                                                            relu=True, config=cfg),
             "sparse_matmul_scatter": lambda cfg: fused.sparse_matmul_scatter(h, indices, w3, x.clone(), *out,
                                                                              count=count, config=cfg)}
    return fused.DEFAULT, calls[args.call]


def torch_case(torch, args):
    import sparseblocks.torch as sbt

    dtype = getattr(torch, args.dtype)
    block = sbt.SparseResBlock(args.channels, args.channels // 4, block_size=args.window).to("cuda", dtype)
    block = block.to(memory_format=torch.channels_last)
    x = torch.randn(args.images, args.channels, args.height, args.width, device="cuda", dtype=dtype)
    x = x.to(memory_format=torch.channels_last)
    mask = (torch.rand(args.images, args.height, args.width, device="cuda") < args.fraction / 64).float()
    indices, count = block.active_blocks(mask)

    def call(cfg):
        block.config = cfg
        with torch.no_grad():
            return block(x, indices, count)

    return sbt.config.DEFAULT, call


def quant_case(torch, args):
    import numpy as np

    from sparseblocks import quant
    from sparseblocks.layout import BlockLayout

    w_bits, a_bits = (int(b) for b in args.bits[1:].split("A"))
    rng = np.random.default_rng(0)
    x = torch.rand(args.n, args.c, device="cuda", dtype=torch.float16)
    a_basis = (2.0 ** np.arange(a_bits) / 2 ** a_bits).astype(np.float32)
    w_basis = (rng.uniform(0.5, 1.0, (args.k, w_bits)) * 2.0 ** np.arange(w_bits) * 0.02).astype(np.float32)
    w = quant.quantize(torch.randn(args.k, args.c, device="cuda", dtype=torch.float16), w_basis, True)
    a = quant.quantize(x, a_basis, False)
    layout = None
    if args.density < 1:
        grid = (args.c // args.block_size, args.k // args.block_size)
        layout = BlockLayout.random(grid, args.density, seed=1, block_size=args.block_size)
    calls = {"matmul": lambda cfg: quant.matmul(a, w, layout=layout, out_dtype="float16", config=cfg),
             "pack": lambda cfg: torch.as_tensor(quant.quantize(x, a_basis, False, config=cfg).planes).float()}
    if args.call == "conv2d":  # (a 3 x 3 layer of --channels on --images of --height x --width, padding 1)
        shape = (args.images, args.channels, args.height, args.width)
        image = quant.quantize_image(torch.rand(shape, device="cuda", dtype=torch.float16), a_basis)
        filters = quant.quantize_filters(torch.randn(args.channels, args.channels, 3, 3, device="cuda"),
                                         np.repeat(w_basis[:1], args.channels, 0))
        calls["conv2d"] = lambda cfg: quant.conv2d(image, filters, 1, 1, out_dtype="float16", config=cfg).float()
    return quant.DEFAULT, calls[args.call]


def conv_case(torch, args):
    """A 3 x 3 block-sparse convolution (padding 1) of --channels in groups of --block-size, blocks
    present at --density (the last always: the layer spans every channel), or block-diagonal with
    ``--layout block_diagonal``, on --images of --height x --width (``--channels-last``: the
    activations (N, H, W, C)); the op is built once a config."""
    import numpy as np

    from sparseblocks import conv

    G, C = args.block_size, args.channels
    mask = np.random.default_rng(0).random((C // G, C // G)) < args.density
    mask[-1, -1] = True
    if args.layout == "block_diagonal":  # (--layout block_diagonal: a grouped convolution, --density unread)
        mask = np.eye(C // G, dtype=bool)
    BCK = [(list(range(c * G, c * G + G)), list(range(k * G, k * G + G))) for c, k in zip(*np.nonzero(mask))]
    dtype = getattr(torch, args.dtype)
    last = args.channels_last  # (--channels-last: (N, H, W, C) activations)
    shape = (args.images, args.height, args.width, C) if last else (args.images, C, args.height, args.width)
    x, dy = (torch.randn(*shape, device="cuda", dtype=dtype) for _ in range(2))
    ops = {}

    def op_of(cfg):
        if cfg not in ops:
            ops[cfg] = conv.BlocksparseConv(BCK, (3, 3), (args.height, args.width), padding="SAME", config=cfg)
        return ops[cfg]

    filters = [torch.randn(op_of(conv.DEFAULT).f_shape(b), device="cuda", dtype=dtype) / (3 * G ** 0.5)
               for b in range(len(BCK))]
    calls = {"forward": lambda cfg: op_of(cfg)(filters, x, channels_last=last),
             "input_grad": lambda cfg: op_of(cfg).input_grad(filters, dy, channels_last=last),
             "filter_grad": lambda cfg: torch.cat([f.flatten() for f in op_of(cfg).filter_grad(dy, x,
                                                                                              channels_last=last)])}
    return conv.DEFAULT, calls[args.call]


def norms_case(torch, args):
    from sparseblocks import norms

    dtype = getattr(torch, args.dtype)
    shape = (args.n, args.c) if args.axis == 1 else (args.c, args.n)
    x, dy = torch.randn(shape, device="cuda", dtype=dtype), torch.randn(shape, device="cuda", dtype=dtype)
    g, b = torch.rand(args.c, device="cuda", dtype=dtype) + 0.5, torch.randn(args.c, device="cuda", dtype=dtype)
    _, mean, rstd = norms.layer_norm(x, g, b, axis=args.axis, stats=True)
    calls = {"layer_norm": lambda cfg: norms.layer_norm(x, g, b, axis=args.axis, config=cfg),
             "layer_norm_grad": lambda cfg: norms.layer_norm_grad(dy, x, g, b, mean, rstd, axis=args.axis,
                                                                  config=cfg)[0]}
    return norms.DEFAULT, calls[args.call]


def attention_case(torch, args):
    from benchmarks.bench_attention import layouts
    from sparseblocks import attention

    dtype = getattr(torch, args.dtype)
    shape = (args.batch, args.heads, args.n, args.head_dim)
    q, k, v, dout = (torch.randn(shape, device="cuda", dtype=dtype) for _ in range(4))
    (layout, causal), = [(one, c) for name, one, c in layouts(args.n // 128) if name == args.layout]
    out, lse = attention.attention(q, k, v, layout, causal=causal, return_lse=True)
    calls = {"forward": lambda cfg: attention.attention(q, k, v, layout, causal=causal, config=cfg),
             "backward": lambda cfg: torch.cat([g.flatten() for g in attention.attention_grad(
                 q, k, v, out, lse, dout, layout, causal=causal, config=cfg)])}
    return attention.DEFAULT, calls[args.call]


def linear_case(torch, args):
    """`BlockSparseLinear` as a transformer's FFN uses it (--c -> --k -> --c, ReLU between, --n tokens):
    its forward and backward under the variant as bsmm's default config (`bsmm.config.DEFAULT`,
    which the layer's calls read); returns the layers' weight and bias gradients."""
    from sparseblocks.bsmm import config as bsmm_config
    from sparseblocks.torch import BlockSparseLinear

    dtype = getattr(torch, args.dtype)
    torch.manual_seed(0)
    layers = [BlockSparseLinear(a, b, density=args.density, block_size=args.block_size, seed=i, device="cuda",
                                dtype=dtype) for i, (a, b) in enumerate(((args.c, args.k), (args.k, args.c)))]
    params = [p for layer in layers for p in layer.parameters()]
    x = torch.randn(args.n, args.c, device="cuda", dtype=dtype)
    dy = torch.randn(args.n, args.c, device="cuda", dtype=dtype)

    def ffn(cfg):
        default, bsmm_config.DEFAULT = bsmm_config.DEFAULT, cfg
        try:
            for p in params:
                p.grad = None
            layers[1](torch.relu(layers[0](x))).backward(dy)
        finally:
            bsmm_config.DEFAULT = default
        return torch.cat([p.grad.flatten() for p in params])

    return bsmm_config.DEFAULT, {"ffn": ffn}[args.call]


def ew_case(torch, args):
    """The element-wise ops on (--n, --c) tensors: the LSTM gates (four gate tensors) and their
    gradient, or one unary op (--unary)."""
    from sparseblocks import ew

    dtype = getattr(torch, args.dtype)
    c, x, dc, dh, *gates = (torch.randn(args.n, args.c, device="cuda", dtype=dtype) for _ in range(8))
    flat = lambda arrays: torch.cat([a.flatten() for a in arrays])  # noqa: E731
    calls = {"lstm": lambda cfg: flat(ew.fused_lstm_gates(c, *gates, config=cfg)),
             "lstm_grad": lambda cfg: flat(ew.fused_lstm_gates_grad(c, *gates, dc_next=dc, dh=dh, config=cfg)),
             "unary": lambda cfg: ew.unary(args.unary, x, config=cfg)}
    return ew.DEFAULT, calls[args.call]


def cast_case(torch, args):
    """`float_cast` of an (--n, --c) tensor of --dtype to --target (fp8 as its uint8 bits)."""
    from sparseblocks import cast

    x = torch.randn(args.n, args.c, device="cuda", dtype=getattr(torch, args.dtype))
    bits = lambda y: y.view(torch.uint8).float() if y.element_size() == 1 else y.float()  # noqa: E731
    return cast.DEFAULT, {"float_cast": lambda cfg: bits(cast.float_cast(x, args.target, config=cfg))}[args.call]


CASES = {"bsmm": bsmm_case, "norms": norms_case, "sbnet": sbnet_case, "fused": fused_case, "torch": torch_case,
         "quant": quant_case, "attention": attention_case, "conv": conv_case, "linear": linear_case, "ew": ew_case,
         "cast": cast_case}
TOLERANCE = {"float16": 1e-2, "bfloat16": 3e-2, "float32": 1e-4, "float64": 1e-10}


def add_case_arguments(parser):
    """The op, the call, ``--set`` and the problem's sizes (shared with `tools/profile.py`)."""
    parser.add_argument("op", choices=sorted(CASES))
    parser.add_argument("call", help="bsmm: forward, input_grad, weight_grad; sbnet: reduce_mask, sparse_gather, "
                                     "sparse_scatter; fused: sparse_gather_matmul, sparse_matmul_scatter; torch: res_block; "
                                     "quant: matmul, pack, conv2d; norms: layer_norm, layer_norm_grad; "
                                     "attention: forward, backward; conv: forward, input_grad, filter_grad; "
                                     "linear: ffn; ew: lstm, lstm_grad, unary; cast: float_cast")
    parser.add_argument("--set", action="append", default=[], metavar="FIELD=V1,V2",
                        help="a config field and the values to try (repeatable: their cartesian product)")
    parser.add_argument("--dtype", default="float16")
    parser.add_argument("--n", type=int, default=4096)
    parser.add_argument("--c", type=int, default=4096)
    parser.add_argument("--k", type=int, default=4096)
    parser.add_argument("--block-size", type=listed(int), default=[32], help="one or several: 64,128")
    parser.add_argument("--density", type=listed(float), default=[0.1], help="one or several: 0.05,0.25")
    parser.add_argument("--images", type=int, default=1)
    parser.add_argument("--height", type=int, default=400)
    parser.add_argument("--width", type=int, default=700)
    parser.add_argument("--channels", type=int, default=256)
    parser.add_argument("--window", type=int, default=16)
    parser.add_argument("--fraction", type=float, default=0.1, help="sbnet, fused, torch: mask pixels set x 64")
    parser.add_argument("--bits", default="W1A1", help="quant: WkAm (a density of 1 is the dense product)")
    parser.add_argument("--axis", type=int, default=1, help="norms: the feature axis")
    parser.add_argument("--unary", default="sigmoid", help="ew unary: the op")
    parser.add_argument("--target", default="float8_e4m3fn", help="cast: the dtype cast to")
    parser.add_argument("--layout", default="causal", help="attention: local, strided, bigbird or causal (blocks of "
                                                           "128, seq --n); conv: block_diagonal, else random")
    parser.add_argument("--channels-last", action="store_true", help="conv: activations (N, H, W, C), as torch's "
                                                                      "channels_last tensors give them")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--head-dim", type=int, default=128)


def listed(kind):
    """An argument type: comma-separated values of ``kind`` (each case of the sweep runs at each)."""
    return lambda text: [kind(v) for v in text.split(",")]


def time_rounds(torch, calls, rounds, per_round):
    """{name: [median ms of each round]}: the calls interleaved, round by round."""
    times = {name: [] for name in calls}
    for _ in range(rounds):
        for name, call in calls.items():
            samples = []
            for _ in range(per_round):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                torch.cuda._sleep(2_000_000)  # (the host launches the call before the device gets to it)
                start.record()
                call()
                end.record()
                end.synchronize()
                samples.append(start.elapsed_time(end))
            times[name].append(statistics.median(samples))
    return times


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_case_arguments(parser)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--per-round", type=int, default=20)
    parser.add_argument("--unchecked", action="store_true",
                        help="time variants that compute something else on purpose (a floor: v6_multiply=False) "
                             "without comparing their outputs with the default's")
    args = parser.parse_args()

    import torch

    for case in each_case(args):
        sweep(torch, case)


def each_case(args):
    """The parsed options once for each block size and density they list (one value each)."""
    return [argparse.Namespace(**{**vars(args), "block_size": block_size, "density": density})
            for block_size, density in itertools.product(args.block_size, args.density)]


def sweep(torch, args):
    """One case (one block size and density) of the sweep: check, time, print."""
    default, call = CASES[args.op](torch, args)
    fields = [parse_values(text) for text in args.set]
    variants = {"default": default}
    for values in itertools.product(*[v for _, v in fields]):
        changes = {name: value for (name, _), value in zip(fields, values)}
        name = ", ".join(f"{k}={v!r}" for k, v in changes.items())
        try:
            variants[name] = replace(default, **changes)
        except ValueError as error:  # a combination the config refuses: say so, and time the rest
            print(f"skipped {name}: {error}")
    want = call(default).double()
    for name, cfg in variants.items():
        got = call(cfg).double()
        if args.unchecked:  # (a variant that computes something else on purpose: a floor, timed only)
            continue
        error = float((got - want).abs().max() / want.abs().max().clamp_min(1e-30))
        if not error <= TOLERANCE[args.dtype]:
            raise SystemExit(f"{name}: differs from the default (relative error {error:.2e})")
    torch.cuda.synchronize()
    times = time_rounds(torch, {name: (lambda cfg=cfg: call(cfg)) for name, cfg in variants.items()},
                        args.rounds, args.per_round)
    base = statistics.median(times["default"])
    print(f"{args.op} {args.call} on {torch.cuda.get_device_name()}, {args.dtype}, block {args.block_size}, "
          f"density {args.density}" + (" (variants unchecked: floors, not products)" if args.unchecked else ""))
    print(f"{'variant':<60} {'ms':>9} {'default/variant':>16}")
    for name, rounds in times.items():
        ms = statistics.median(rounds)
        print(f"{name:<60} {ms:9.4f} {base / ms:16.3f}")


if __name__ == "__main__":
    main()
