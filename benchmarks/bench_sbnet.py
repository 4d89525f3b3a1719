"""SBNet's ops on the GPU against a device copy of the same bytes, and the sparse ResNet block
against the dense one (cuDNN, channels_last, same dtype).

    python -m benchmarks.bench_sbnet [--quick] [--out-dir DIR]

Each configuration is checked against the NumPy reference (or, for the
block, against the dense block on the active region) before it is timed.
Effective bandwidth counts the bytes each op must move: gather reads and
writes the windows; an in-place scatter reads the blocks and writes (adding:
reads and writes) the windows; reduce_mask reads the mask. Writes
results/sbnet.json and results/sbnet.md.
"""

import argparse

import numpy as np

from benchmarks.common import Record, baseline_ms, copy_ms, device_name, print_table, time_ms, write_results


def block_mask(rng, n, height, width, block, fraction):
    """A mask whose active blocks (of a stride-`block` grid) are a random `fraction` of all."""
    grid = (n, -(-height // block), -(-width // block))
    chosen = rng.random(grid) < fraction
    mask = np.kron(chosen, np.ones((block, block)))[:, :height, :width]
    return mask.astype(np.float32)


def bench_ops(torch, sbnet, reference, records, shapes, channels, blocks, fractions):
    rng = np.random.default_rng(0)
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
                records.append(Record("reduce_mask", dict(params), time_ms(lambda: sbnet.reduce_mask(mask_t, tol=0.5, **g)),
                                      {"copy": copy_ms(mask.nbytes)}, bytes=mask.nbytes))
                idx = indices[:n_active].contiguous()
                for C in channels:
                    x = torch.randn(n, height, width, C, device="cuda")
                    window_bytes = n_active * block * block * C * 4
                    copy = copy_ms(max(window_bytes, 4))
                    for transpose in (False, True):
                        blocks_t = sbnet.sparse_gather(x, idx, transpose=transpose, **g)
                        if n == 1 and C == 64:  # check against the reference once per geometry
                            ref = reference.sparse_gather(x.cpu().numpy(), want, transpose=transpose, **g)
                            assert np.array_equal(blocks_t.cpu().numpy(), ref)
                        p = dict(params, C=C, transpose=transpose)
                        records.append(Record("sparse_gather", p, time_ms(
                            lambda: sbnet.sparse_gather(x, idx, transpose=transpose, **g)), {"copy": copy},
                            bytes=2 * window_bytes))
                        y = torch.zeros_like(x)
                        for add in (False, True):
                            moved = (3 if add else 2) * window_bytes
                            records.append(Record("sparse_scatter", dict(p, add=add), time_ms(
                                lambda: sbnet.sparse_scatter(blocks_t, idx, y, add=add, transpose=transpose,
                                                             inplace=True, **g)),
                                {"copy": copy_ms(max(moved // 2, 4))}, bytes=moved))
                    del x


def bench_res_block(torch, sbnet_torch, records, fractions, dtype_name):
    dtype = getattr(torch, dtype_name)
    torch.backends.cudnn.allow_tf32 = False  # fp32 means fp32 on both paths (TF32 would differ by ~1e-3)
    torch.manual_seed(0)
    block = sbnet_torch.SparseResBlock(256, 64, block_size=16).to("cuda", dtype).to(memory_format=torch.channels_last)
    x = torch.randn(1, 256, 400, 700, device="cuda", dtype=dtype).to(memory_format=torch.channels_last)
    rng = np.random.default_rng(1)
    with torch.no_grad():
        dense_ms = baseline_ms(lambda: block.dense(x))
        for fraction in fractions:
            mask = torch.as_tensor(block_mask(rng, 1, 400, 700, 14, fraction), device="cuda")
            indices, count = block.active_blocks(mask, tol=0.5)
            y = block(x, indices, count)
            dense = block.dense(x)
            changed = (y != x).any(dim=1)
            error = ((y - dense).abs() * changed[:, None]).max().item()
            assert error < (1e-2 if dtype_name == "float16" else 1e-4), f"sparse block differs: {error}"
            records.append(Record("sparse_res_block", {"dtype": dtype_name, "active": fraction, "N": 1,
                                                       "H": 400, "W": 700, "C": 256, "bottleneck": 64},
                                  time_ms(lambda: block(x, indices, count)), {"dense_block": dense_ms}))


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out-dir", default=None)
    args = parser.parse_args()

    import torch

    from sparseblocks import sbnet_torch
    from sparseblocks.kernels import sbnet
    from sparseblocks.reference import sbnet as reference

    shapes = [(1, 400, 700)] if args.quick else [(1, 400, 700), (8, 400, 700)]
    channels = [64] if args.quick else [64, 256]
    blocks = [16] if args.quick else [16, 32]
    fractions = [0.05, 0.10, 0.25, 0.50]
    records = []
    bench_ops(torch, sbnet, reference, records, shapes, channels, blocks, fractions)
    for dtype in ("float16",) if args.quick else ("float16", "float32"):
        bench_res_block(torch, sbnet_torch, records, fractions, dtype)
    kwargs = {} if args.out_dir is None else {"directory": args.out_dir}
    write_results("sbnet" + ("_quick" if args.quick else ""), records, **kwargs)
    print_table(records, f"sbnet on {device_name()}")


if __name__ == "__main__":
    main()
