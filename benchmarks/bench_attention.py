"""Block-sparse attention (`sparseblocks.attention`, fused) against FlexAttention on the same block
mask, dense SDPA (flash; causal where the layout is) and the three-kernel version.

    python -m benchmarks.bench_attention [--quick] [--seqs 4096,16384,65536] [--out-dir DIR]
    python -m benchmarks.bench_attention --merge A.json B.json ...   (runs split by --seqs)

bf16, batch 4, 16 heads, head_dim 128, blocks of 128; layouts: ``local`` (a window of 512 keys
each side), ``strided`` (the Sparse Transformer's, stride 8 blocks, causal), ``bigbird`` (one
global block and a window of one block each side) and ``causal``; each one's density is in its
record. Each configuration is checked first (against SDPA with the layout as a dense mask at 4096,
against FlexAttention above), then timed: ``forward`` (the output alone) and ``forward_backward``
(the output, then the gradients of q, k and v through autograd), every baseline in the same run.
Each record also gives the peak memory of a forward and backward (``peak_mb``) beside SDPA's
(``sdpa_peak_mb``). The three kernels run at 4096 only (they store the present blocks' scores).
The causal layout's forward and backward also runs with dropout (``dropout`` 0.1 in the record:
FlexAttention has none), beside SDPA's with the same dropout and ours without (``no_dropout``);
its check: finite, and as far from the undropped output as dropout puts it.
Writes results/attention.json and results/attention.md, after each length.
"""

import argparse
import math

from benchmarks.common import Record, baseline_ms, device_name, merged_records, print_table, time_ms, write_results

BATCH, HEADS, HEAD_DIM, BLOCK = 4, 16, 128, 128
DROPOUT = 0.1  # the causal layout's dropout record
SEQS = (4096, 16384, 65536)


def layouts(n):
    """(name, BlockLayout, causal) of each benchmarked pattern on an n x n grid of blocks."""
    from sparseblocks.layout import BlockLayout

    window = 512 // BLOCK
    return [("local", BlockLayout.global_window(n, 0, window, block_size=BLOCK), False),
            ("strided", BlockLayout.strided(n, 8, block_size=BLOCK), True),
            ("bigbird", BlockLayout.global_window(n, 1, 1, block_size=BLOCK), False),
            ("causal", BlockLayout.causal(n, block_size=BLOCK), True)]


def flex_call(torch, layout, causal, seq):
    """FlexAttention, compiled, over a BlockMask of the same blocks (and the causal mask)."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    blocks = torch.as_tensor(layout.mask, device="cuda")

    def mask_mod(b, h, q, kv):
        inside = blocks[q // BLOCK, kv // BLOCK]
        return inside & (q >= kv) if causal else inside

    # (a fresh compile for each mask: past dynamo's recompile limit flex_attention would run
    # eagerly, storing every score)
    torch._dynamo.reset()
    block_mask = create_block_mask(mask_mod, None, None, seq, seq, device="cuda", BLOCK_SIZE=BLOCK, _compile=True)
    compiled = torch.compile(flex_attention)
    return lambda q, k, v: compiled(q, k, v, block_mask=block_mask)


def peak_mb(torch, fn):
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - before) / 2**20


BACKWARD = 3.5  # forward + backward over the forward's flops: 5 products and the recomputed scores


def forward_flops(params):
    """Present blocks x bs^2 scores, 2 products of head_dim each (4 flops a score and dim), less
    the causal diagonal blocks' upper halves, which are not computed."""
    bs, D = params["block_size"], params["head_dim"]
    flops = 4.0 * BATCH * HEADS * params["blocks"] * bs * bs * D
    if params["causal"]:
        flops -= 2.0 * BATCH * HEADS * (params["seq"] // bs) * bs * bs * D
    return flops


def merged(paths):
    """(records, device) of several runs' JSON files (runs split by --seqs), TFLOP/s restored; a
    later file's record of a case (name, layout, length, dropout) replaces an earlier one's."""
    def flops(name, p):
        if "blocks" not in p:
            return None
        return forward_flops(p) * (BACKWARD if name == "forward_backward" else 1)

    return merged_records(paths, lambda name, p: (name, p["layout"], p["seq"], p.get("dropout", 0)), flops)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--seqs", default=None)
    parser.add_argument("--layouts", default=None, help="comma-separated names (local, strided, bigbird, causal)")
    parser.add_argument("--merge", nargs="+", metavar="JSON",
                        help="only merge these runs' JSON files into results/attention.json and .md")
    parser.add_argument("--out-dir", default=None)
    args = parser.parse_args()
    if args.merge:
        records, device = merged(args.merge)
        write_results("attention", records, device, **({"directory": args.out_dir} if args.out_dir else {}))
        print_table(records, f"block-sparse attention on {device} (merged)")
        return

    import torch
    import torch.nn.functional as F

    from sparseblocks.attention import AttentionConfig
    from sparseblocks.attention import attention as attention_op
    from sparseblocks.torch.attention import block_sparse_attention, layout_key

    seqs = [int(s) for s in args.seqs.split(",")] if args.seqs else (SEQS[:1] if args.quick else SEQS)
    torch.manual_seed(0)
    records = []
    dense = {}  # (seq, causal) -> SDPA's forward, forward_backward and peak: the same for every layout
    dtype = torch.bfloat16
    for seq in seqs:
        shape = (BATCH, HEADS, seq, HEAD_DIM)
        q, k, v, dout = (torch.randn(shape, device="cuda", dtype=dtype) for _ in range(4))
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        cases = layouts(seq // BLOCK)[:1] if args.quick else layouts(seq // BLOCK)
        for name, layout, causal in [c for c in cases if not args.layouts or c[0] in args.layouts.split(",")]:
            key = layout_key(layout, HEADS)
            density = float(layout.mask.mean())
            present = int(layout.mask.sum())
            ours = lambda a, b, c: block_sparse_attention(a, b, c, layout, causal=causal, key=key)  # noqa: E731
            flex = flex_call(torch, layout, causal, seq)
            sdpa = lambda a, b, c: F.scaled_dot_product_attention(a, b, c, is_causal=causal)  # noqa: E731
            got = ours(q, k, v)
            if seq <= 4096:
                dense_mask = torch.as_tensor(layout.mask, device="cuda").repeat_interleave(BLOCK, 0)
                dense_mask = dense_mask.repeat_interleave(BLOCK, 1)
                if causal:
                    dense_mask &= torch.ones(seq, seq, dtype=torch.bool, device="cuda").tril()
                want = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=dense_mask)
            else:
                want = flex(q, k, v).float()
            error = ((got.float() - want).norm() / want.norm()).item()
            assert error < 2e-2, f"{name} {seq}: relative error {error}"

            def forward_backward(fn):
                def run():
                    for t in leaves:
                        t.grad = None
                    fn(*leaves).backward(dout)
                return run

            params = dict(layout=name, seq=seq, density=round(density, 4), block_size=BLOCK, head_dim=HEAD_DIM,
                          dtype="bfloat16", blocks=present, causal=causal)
            flops = forward_flops(params)
            three = None
            if seq <= 4096:
                config = AttentionConfig(fused=False)
                three = lambda a, b, c: attention_op(a, b, c, layout, causal=causal, config=config)  # noqa: E731
            if (seq, causal) not in dense:
                with torch.no_grad():
                    dense_ms = baseline_ms(lambda: sdpa(q, k, v))
                dense[seq, causal] = (dense_ms, baseline_ms(forward_backward(sdpa)),
                                      peak_mb(torch, forward_backward(sdpa)))
            sdpa_ms, sdpa_both_ms, sdpa_peak = dense[seq, causal]
            with torch.no_grad():
                ms = time_ms(lambda: ours(q, k, v))
                base = {"flex_attention": baseline_ms(lambda: flex(q, k, v)), "sdpa": sdpa_ms}
                if three is not None:
                    base["three_kernels"] = baseline_ms(lambda: three(q, k, v))
            records.append(Record("forward", dict(params), ms, base, flops=flops))
            ms = time_ms(forward_backward(ours))
            base = {"flex_attention": baseline_ms(forward_backward(flex)), "sdpa": sdpa_both_ms}
            mine = peak_mb(torch, forward_backward(ours))
            records.append(Record("forward_backward", dict(params, peak_mb=round(mine, 1),
                                                           sdpa_peak_mb=round(sdpa_peak, 1)), ms, base,
                                  flops=flops * BACKWARD))
            if name == "causal":
                drop = DROPOUT
                dropped = lambda a, b, c: block_sparse_attention(a, b, c, layout, causal=True, key=key,  # noqa: E731
                                                                 dropout_p=drop)
                with torch.no_grad():
                    far = ((dropped(q, k, v).float() - got.float()).norm() / got.float().norm()).item()
                assert math.isfinite(far) and 0.01 < far < 1.0, f"dropout {seq}: relative distance {far}"
                sdpa_drop = lambda a, b, c: F.scaled_dot_product_attention(  # noqa: E731
                    a, b, c, is_causal=True, dropout_p=drop)
                base = {"sdpa": baseline_ms(forward_backward(sdpa_drop)), "no_dropout": ms}
                records.append(Record("forward_backward", dict(params, dropout=drop),
                                      time_ms(forward_backward(dropped)), base, flops=flops * BACKWARD))
            for r in records[-3 if name == "causal" else -2:]:
                print(f"{r.name:16} {name:8} {seq:6} d {density:.3f}: {r.ms:.3f} ms "
                      f"({r.flops / r.ms / 1e9:.0f} TFLOP/s) "
                      + " ".join(f"{b} x{t / r.ms:.2f}" for b, t in r.baselines.items() if math.isfinite(t)),
                      flush=True)
        del q, k, v, dout, leaves
        torch.cuda.empty_cache()
        # (after each length, so that a run cut short keeps what it measured)
        write_results("attention", records, **({"directory": args.out_dir} if args.out_dir else {}))
    print_table(records, f"block-sparse attention on {device_name()}")


if __name__ == "__main__":
    main()
