"""SBNet's ops on the GPU against a device copy of the same bytes, and the sparse ResNet block
against the dense one (cuDNN, channels_last, same dtype).

    python -m benchmarks.bench_sbnet [--quick] [--out-dir DIR]

Each configuration is checked against the NumPy reference (or, for the
block, against the dense block on the active region) before it is timed,
two ways: per call from the host (``timing: eager``, launch costs included)
and on the device alone (``timing: graph``, replays of a captured CUDA
graph); each baseline is timed the same way; ``compiled`` rows call the block compiled by
``torch.compile(mode="reduce-overhead")``. The sparse block runs in place,
as SBNet runs it, and gets its indices cut to the active windows.
Effective bandwidth counts the bytes each op must move: gather reads and
writes the windows; an in-place scatter reads the blocks and writes (adding:
reads and writes) the windows; a scatter into a copy of y reads y and the
blocks and writes the whole copy; reduce_mask reads the mask. NCHW images
(``format: NCHW``, fp16 and fp32) are timed at the sparse block's geometry,
on the device alone. Writes results/sbnet.json and results/sbnet.md.
"""

import argparse

import numpy as np

from benchmarks.common import (Record, copy_ms, device_name, graph_ms, print_table, queued_ms, time_ms,
                               write_results)


DEPTH = 4  # blocks in the compiled network


def block_mask(rng, n, height, width, block, fraction):
    """A mask whose active blocks (of a stride-`block` grid) are a random `fraction` of all."""
    grid = (n, -(-height // block), -(-width // block))
    chosen = rng.random(grid) < fraction
    mask = np.kron(chosen, np.ones((block, block)))[:, :height, :width]
    return mask.astype(np.float32)


def timed(fn):
    """{timing: ms}: per call from the host (eager), and on the device alone (graph replays)."""
    return {"eager": time_ms(fn), "graph": graph_ms(fn)}


def bench_ops(torch, sbnet, reference, records, shapes, channels, blocks, fractions):
    rng = np.random.default_rng(0)
    copies = {}

    def add(name, params, fn, moved):
        """Records of `fn` both ways, each against a copy moving as many bytes, timed the same way."""
        size = max(moved // 2, 4)  # a copy reads and writes
        if size not in copies:
            copies[size] = {"eager": copy_ms(size), "graph": copy_ms(size, graph=True)}
        copy = copies[size]
        for timing, ms in timed(fn).items():
            records.append(Record(name, dict(params, timing=timing), ms, {"copy": copy[timing]}, bytes=moved))

    for n, height, width in shapes:
        for block in blocks:
            for fraction in fractions:
                mask = block_mask(rng, n, height, width, block, fraction)
                mask_t = torch.as_tensor(mask, device="cuda")
                g = {"bsize": block, "bstride": block, "boffset": 0}
                want = reference.reduce_mask(mask, tol=0.5, **g)
                indices, count = sbnet.reduce_mask(mask_t, tol=0.5, **g)
                n_active = int(count[0])
                assert n_active == len(want) and np.array_equal(indices[:n_active].cpu().numpy(), want)
                params = {"N": n, "H": height, "W": width, "block": block, "active": fraction}
                add("reduce_mask", params, lambda: sbnet.reduce_mask(mask_t, tol=0.5, **g), mask.nbytes)
                idx = indices[:n_active].contiguous()
                for C in channels:
                    x = torch.randn(n, height, width, C, device="cuda")
                    y = torch.zeros_like(x)
                    window_bytes = n_active * block * block * C * 4
                    for transpose in (False, True):
                        blocks_t = sbnet.sparse_gather(x, idx, transpose=transpose, **g)
                        if n == 1 and C == 64:  # check against the reference once per geometry
                            ref = reference.sparse_gather(x.cpu().numpy(), want, transpose=transpose, **g)
                            assert np.array_equal(blocks_t.cpu().numpy(), ref)
                        p = dict(params, C=C, transpose=transpose)
                        add("sparse_gather", p, lambda: sbnet.sparse_gather(x, idx, transpose=transpose, **g),
                            2 * window_bytes)
                        for plus in (False, True):
                            if n == 1 and C == 64:
                                got = sbnet.sparse_scatter(blocks_t, idx, y, add=plus, transpose=transpose, **g)
                                ref = reference.sparse_scatter(blocks_t.cpu().numpy(), want, y.cpu().numpy(),
                                                               add=plus, transpose=transpose, **g)
                                assert np.array_equal(got.cpu().numpy(), ref)
                            add("sparse_scatter", dict(p, add=plus, into="y"), lambda: sbnet.sparse_scatter(
                                blocks_t, idx, y, add=plus, transpose=transpose, inplace=True, **g),
                                (3 if plus else 2) * window_bytes)
                        if not transpose:  # into a copy of y (one pass, `SbnetConfig.merge`): reads y, writes all
                            add("sparse_scatter", dict(p, add=True, into="copy"), lambda: sbnet.sparse_scatter(
                                blocks_t, idx, y, add=True, **g), 2 * x.numel() * 4 + window_bytes)


def bench_nchw_ops(torch, sbnet, reference, records, shapes, channels, fractions):
    """Gathers and scatters of NCHW images (``data_format="NCHW"``), fp16 and fp32, at the sparse
    block's geometry (its windows of 16 every 16 active): gathers of its input windows (18 every
    16 from -1, the stack NCHW or with ``transpose`` NHWC), adding scatters of its output windows
    (16 every 16) in place, and atomic adds of the input windows (the gather's gradient); on the
    device alone (graph), against a copy moving as many bytes (as `bench_ops`'s rows: an adding
    scatter reads the blocks and the windows and writes the windows, three passes)."""
    rng = np.random.default_rng(2)
    copies = {}
    gather_at = {"bsize": 18, "bstride": 16, "boffset": -1, "data_format": "NCHW"}
    scatter_at = {"bsize": 16, "bstride": 16, "boffset": 0, "data_format": "NCHW"}
    for n, height, width in shapes:
        for fraction in fractions:
            mask = block_mask(rng, n, height, width, 16, fraction)
            want = reference.reduce_mask(mask, tol=0.5, bsize=16, bstride=16)
            idx = torch.as_tensor(want, device="cuda")
            for C in channels:
                for dtype_name in ("float16", "float32"):
                    x = torch.randn(n, C, height, width, device="cuda").to(getattr(torch, dtype_name))
                    y = torch.zeros_like(x)
                    host = x.cpu().numpy() if n == 1 else None  # (checked against the reference once a shape)
                    p = {"N": n, "H": height, "W": width, "block": 16, "active": fraction, "timing": "graph",
                         "C": C, "dtype": dtype_name, "format": "NCHW"}
                    for transpose in (False, True):
                        stack = sbnet.sparse_gather(x, idx, transpose=transpose, **gather_at)
                        outputs = sbnet.sparse_gather(x, idx, transpose=transpose, **scatter_at)
                        if host is not None:
                            np.testing.assert_array_equal(stack.cpu().numpy(), reference.sparse_gather(
                                host, want, transpose=transpose, **gather_at))
                            out = sbnet.sparse_scatter(stack, idx, y, add=True, atomic=True, transpose=transpose,
                                                       **gather_at)
                            exact = reference.sparse_scatter(stack.cpu().double().numpy(), want,
                                                             y.cpu().double().numpy(), add=True,
                                                             transpose=transpose, **gather_at)
                            np.testing.assert_allclose(out.cpu().double().numpy(), exact, rtol=4e-3, atol=4e-3)
                            np.testing.assert_array_equal(
                                sbnet.sparse_scatter(outputs, idx, y, add=True, transpose=transpose,
                                                     **scatter_at).cpu().numpy(),
                                reference.sparse_scatter(outputs.cpu().numpy(), want, y.cpu().numpy(), add=True,
                                                         transpose=transpose, **scatter_at))
                        rows = [("sparse_gather", {"window": 18}, stack.nbytes, 2,
                                 lambda t=transpose: sbnet.sparse_gather(x, idx, transpose=t, **gather_at)),
                                ("sparse_scatter", {"window": 16, "add": True, "into": "y"}, outputs.nbytes, 3,
                                 lambda t=transpose, b=outputs: sbnet.sparse_scatter(
                                     b, idx, y, add=True, transpose=t, inplace=True, **scatter_at))]
                        if not transpose:
                            rows.append(("sparse_scatter", {"window": 18, "add": "atomic", "into": "y"}, stack.nbytes,
                                         3, lambda b=stack: sbnet.sparse_scatter(
                                             b, idx, y, add=True, atomic=True, inplace=True, **gather_at)))
                        for name, extra, window_bytes, passes, fn in rows:
                            size = passes * window_bytes // 2  # (a copy reads and writes: as many bytes moved)
                            if size not in copies:
                                copies[size] = copy_ms(size, graph=True)
                            records.append(Record(name, dict(p, transpose=transpose, **extra), graph_ms(fn),
                                                  {"copy": copies[size]}, bytes=passes * window_bytes))


def chain(torch, block, depth, dense=False):
    """A network of `depth` SparseResBlocks (``block`` each time) on one image, each adding into it
    in place, all sharing one mask's windows (as SBNet's networks share a mask's indices);
    ``dense``: the dense blocks."""

    class Chain(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = torch.nn.ModuleList([block] * depth)

        def forward(self, x, indices=None, count=None):
            for b in self.blocks:
                x = b.dense(x) if dense else b(x, indices, count, inplace=True)
            return x

    return Chain()


def compiled_timings(torch, compiled, x, args, check=None):
    """{eager: host calls, queued: device time (`queued_ms`)} of ``compiled(image, *args)``, a model
    compiled with ``mode="reduce-overhead"``, the image a static input (a graph may add into it
    in place), after ``check(output)``; raises where inductor skipped its CUDA graphs."""
    from torch._dynamo.utils import counters

    counters.clear()
    work = x.clone()
    torch._dynamo.mark_static_address(work)
    for _ in range(3):  # (compile, record, replay)
        work.copy_(x)
        out = compiled(work, *args)
    if check is not None:
        check(out.clone(), "compiled block")
    assert counters["inductor"]["cudagraph_skips"] == 0, "inductor skipped its CUDA graphs"
    return {"eager": time_ms(lambda: compiled(work, *args)), "queued": queued_ms(lambda: compiled(work, *args))}


def compiled_chain(torch, block, depth, dense=False):
    """`chain` compiled with ``mode="reduce-overhead"`` (fullgraph)."""
    return torch.compile(chain(torch, block, depth, dense), mode="reduce-overhead", fullgraph=True)


def bench_res_block(torch, sbnet_torch, records, fractions, dtype_name):
    """The sparse block (in place, as SBNet runs it) against the dense one, and a training step
    (forward and backward) of each, all timed both ways.

    Both stack layouts: NHWC (the default, straight into channels_last convolutions)
    and SBNet's NCHW stack through the fused transpose.
    """
    dtype = getattr(torch, dtype_name)
    torch.backends.cudnn.allow_tf32 = False  # fp32 means fp32 on both paths (TF32 would differ by ~1e-3)
    torch.manual_seed(0)
    block = sbnet_torch.SparseResBlock(256, 64, block_size=16).to("cuda", dtype).to(memory_format=torch.channels_last)
    x = torch.randn(1, 256, 400, 700, device="cuda", dtype=dtype).to(memory_format=torch.channels_last)
    rng = np.random.default_rng(1)
    shape = {"N": 1, "H": 400, "W": 700, "C": 256, "bottleneck": 64}
    p = block.geometry(x.shape)

    def active_fraction(chosen):
        return round(chosen / (p.bcount[0] * p.bcount[1]), 3)

    training = []
    x_nchw = x.contiguous()  # (an NCHW input: the NCHW stack, no transpose)
    with torch.no_grad():
        dense = timed(lambda: block.dense(x))
        dense_nchw = graph_ms(lambda: block.dense(x_nchw))  # (the dense block on that NCHW input)
        want = block.dense(x)
        dense_compiled = {depth: compiled_timings(torch, compiled_chain(torch, block, depth, dense=True), x, ())
                          for depth in (1, DEPTH)}
        # one compiled network a depth for every fraction: the indices' rows are a dynamic size
        compiled = {depth: compiled_chain(torch, block, depth) for depth in (1, DEPTH)}
        for fraction in fractions:
            # One mask pixel at the centre of each chosen window: it lies in that window alone
            # (windows overlap by their halo), so `fraction` of the windows are active.
            chosen = np.argwhere(rng.random(p.bcount) < fraction)
            mask = np.zeros((1, 400, 700), np.float32)
            mask[0, p.boffset[0] + chosen[:, 0] * p.bstride[0] + p.bsize[0] // 2,
                 p.boffset[1] + chosen[:, 1] * p.bstride[1] + p.bsize[1] // 2] = 1
            indices, count = block.active_blocks(torch.as_tensor(mask, device="cuda"), tol=0.5)
            assert len(indices) == len(chosen)
            def check(y, what):
                """y against the dense block's output on the pixels the sparse block changes."""
                error = ((y - want).abs() * changed[:, None]).max().item()
                assert error < (1e-2 if dtype_name == "float16" else 1e-4), f"{what} differs: {error}"

            for transpose in (False, True):
                block.transpose = transpose
                y = block(x, indices, count)
                changed = (y != x).any(dim=1)
                check(y, "sparse block")
                # (in place, the last product may go straight into the image: checked too)
                check(block(x.clone(), indices, count, inplace=True), "in-place sparse block")
                work = x.clone()  # the in-place runs add into this copy, again and again
                ours = timed(lambda: block(work, indices, count, inplace=True))
                for timing in ("eager", "graph"):
                    records.append(Record("sparse_res_block", dict(
                        shape, dtype=dtype_name, active=active_fraction(len(chosen)),
                        stack="NCHW" if transpose else "NHWC", timing=timing, step="forward"),
                        ours[timing], {"dense_block": dense[timing]}))
            block.transpose = False
            # An NCHW input, on the device alone; against the dense block on channels_last input
            # (as every row) and on the same NCHW input.
            check(block(x_nchw, indices, count), "sparse block on NCHW input")
            work = x_nchw.clone()
            records.append(Record("sparse_res_block", dict(
                shape, dtype=dtype_name, active=active_fraction(len(chosen)), stack="NCHW", timing="graph",
                step="forward", input="NCHW"), graph_ms(lambda: block(work, indices, count, inplace=True)),
                {"dense_block": dense["graph"], "dense_block_nchw_input": dense_nchw}))
            # Eager calls replaying a CUDA graph of the residual per capacity of windows
            # (graphs=True; in a caller's graph the block launches its kernels, as timed above).
            block.graphs = True
            check(block(x, indices, count), "graphed sparse block")
            for _ in range(2):  # (the second call replays the kept launches)
                check(block(x.clone(), indices, count, inplace=True), "graphed in-place block")
            work = x.clone()
            records.append(Record("sparse_res_block", dict(
                shape, dtype=dtype_name, active=active_fraction(len(chosen)), stack="NHWC", timing="eager",
                step="forward", graphs=True), time_ms(lambda: block(work, indices, count, inplace=True)),
                {"dense_block": dense["eager"]}))
            block.graphs = False
            block.release_graphs()
            # torch.compile(mode="reduce-overhead"): the gather and scatter custom ops and the
            # residual's torch operations in inductor's CUDA graphs, for one block and for a
            # network of DEPTH, against the dense ones compiled the same way.
            for depth in (1, DEPTH):
                torch._dynamo.mark_dynamic(indices, 0)
                ours = compiled_timings(torch, compiled[depth], x, (indices, count), check if depth == 1 else None)
                for timing in ("eager", "queued"):
                    records.append(Record("sparse_res_block", dict(
                        shape, dtype=dtype_name, active=active_fraction(len(chosen)), stack="NHWC", timing=timing,
                        step="forward", compiled=True, depth=depth), ours[timing],
                        {"dense_block": dense_compiled[depth][timing]}))
            active = (block(x, indices, count) != x).any(dim=1, keepdim=True)  # the pixels it changes
            training.append((len(chosen), indices, count, active))
    # Training steps (forward and backward, NHWC stack, both ways: a graph captures the backward
    # too, our launches from torch's autograd thread among them): the input needs a gradient, so
    # the block adds into a copy; the gather's gradient adds overlapping windows atomically.
    grad_y = torch.randn_like(x)
    xg = x.detach().clone().requires_grad_(True)

    def step(forward):
        xg.grad = None
        block.zero_grad(set_to_none=True)
        forward(xg).backward(grad_y)

    def check_grad(want, what):
        """The last step's input gradient against ``want`` (the dense block's where the windows are active),
        relative to its largest value."""
        error = ((xg.grad - want).abs().max() / want.abs().max()).item()
        assert error < 2e-2, f"{what} input gradient differs: {error}"

    dense_step = timed(lambda: step(block.dense))
    for chosen, indices, count, active in training:
        step(lambda x: torch.where(active, block.dense(x), x))
        want = xg.grad.clone()
        step(lambda x: block(x, indices, count))
        # (fp32 too: the dense block's own fp32 input gradient is 4e-3 from float64's here, and the
        # sparse one's as far: scripts/check_res_block_grads.py)
        check_grad(want, "sparse block's")
        ours = timed(lambda: step(lambda x: block(x, indices, count)))
        for timing in ("eager", "graph"):
            records.append(Record("sparse_res_block", dict(shape, dtype=dtype_name, active=active_fraction(chosen),
                                                           stack="NHWC", timing=timing, step="training"),
                                  ours[timing], {"dense_block": dense_step[timing]}))
        # SBNet's NCHW stack (the fused transpose), on the device alone.
        block.transpose = True
        step(lambda x: block(x, indices, count))
        check_grad(want, "sparse block's (NCHW stack)")
        records.append(Record("sparse_res_block", dict(
            shape, dtype=dtype_name, active=active_fraction(chosen), stack="NCHW", timing="graph", step="training"),
            graph_ms(lambda: step(lambda x: block(x, indices, count))), {"dense_block": dense_step["graph"]}))
        block.transpose = False
        # Eager training steps replaying CUDA graphs of the residual and of its backward.
        block.graphs = True
        step(lambda x: block(x, indices, count))
        check_grad(want, "graphed sparse block's")
        records.append(Record("sparse_res_block", dict(
            shape, dtype=dtype_name, active=active_fraction(chosen), stack="NHWC", timing="eager",
            step="training", graphs=True), time_ms(lambda: step(lambda x: block(x, indices, count))),
            {"dense_block": dense_step["eager"]}))
        block.graphs = False
        block.release_graphs()


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out-dir", default=None)
    args = parser.parse_args()

    import torch

    import sparseblocks.torch as sbnet_torch
    from sparseblocks import sbnet
    from sparseblocks.reference import sbnet as reference

    shapes = [(1, 400, 700)] if args.quick else [(1, 400, 700), (8, 400, 700)]
    channels = [64] if args.quick else [64, 256]
    blocks = [16] if args.quick else [16, 32]
    fractions = [0.05, 0.10, 0.25, 0.50]
    records = []
    bench_ops(torch, sbnet, reference, records, shapes, channels, blocks, fractions)
    bench_nchw_ops(torch, sbnet, reference, records, shapes, channels, [0.10] if args.quick else [0.10, 0.50])
    for dtype in ("float16",) if args.quick else ("float16", "float32"):
        bench_res_block(torch, sbnet_torch, records, fractions, dtype)
    kwargs = {} if args.out_dir is None else {"directory": args.out_dir}
    write_results("sbnet" + ("_quick" if args.quick else ""), records, **kwargs)
    print_table(records, f"sbnet on {device_name()}")


if __name__ == "__main__":
    main()
