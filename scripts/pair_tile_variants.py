"""Settings of the pair tiles (`_make_pair_tile_kernels`: adding scatters of NHWC blocks into an NCHW
fp16 image) side by side on the GPU (a developer's script).

    python3 scripts/pair_tile_variants.py ["PAIR_TILE_UNROLL=8" "PAIR_TILE_PIXELS=128;PAIR_TILE_PAIRS=16" ...]
        [--fractions 0.05,0.1,0.25,0.5] [--images 1x256,8x64] [--blocks 16,18]

Each argument is one variant: settings of `sparseblocks.kernels.sbnet`, `;`-separated ("" is the
package's defaults). For each image (N x C x 400 x 700 fp16), window width (SparseResBlock's
output windows: 14 every 14 for blocks of 16, 16 every 16 for blocks of 18) and fraction of the
block's windows active, every variant's in-place adding scatter through the transpose is checked
bit for bit against the reference's, then graph-timed beside a device copy of the bytes it moves
(the blocks read, the windows read and written: 1.5 copies of the blocks).
Prints µs and copy / ours.
"""

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from benchmarks.common import copy_ms, graph_ms  # noqa: E402
from pair_variants import settings_of, use  # noqa: E402
from res_block_ab import windows_of  # noqa: E402


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("variants", nargs="*", default=["", "PAIR_TILE_PIXELS=128"])
    parser.add_argument("--fractions", default="0.05,0.1,0.25,0.5")
    parser.add_argument("--images", default="1x256,8x64")
    parser.add_argument("--blocks", default="16,18", help="SparseResBlock block sizes (output windows 2 less)")
    args = parser.parse_args()

    import torch

    from sparseblocks.reference import sbnet as reference
    from sparseblocks import sbnet_torch as st
    from sparseblocks.kernels import sbnet as k

    torch.manual_seed(0)
    defaults = {name: getattr(k, name) for v in args.variants for name in settings_of(v)}
    print(torch.cuda.get_device_name())
    for image in args.images.split(","):
        N, C = map(int, image.split("x"))
        x = torch.randn(N, C, 400, 700, device="cuda", dtype=torch.float16)
        for block_size in map(int, args.blocks.split(",")):
            block = st.SparseResBlock(C, 64, block_size=block_size).to("cuda", torch.float16)
            p = block.geometry(x.shape)
            s = (p.bsize_out, p.bsize_out, 0)
            for fraction in map(float, args.fractions.split(",")):
                mask = windows_of(block, fraction)
                indices, count = block.active_blocks(torch.as_tensor(np.concatenate([mask] * N), device="cuda"),
                                                     tol=0.5)
                blocks = torch.randn(len(indices), *p.bsize_out, C, device="cuda", dtype=torch.float16)
                kwargs = dict(add=True, inplace=True, transpose=True, count=count, data_format="NCHW")
                want = torch.as_tensor(reference.sparse_scatter(
                    blocks.cpu().numpy(), indices.cpu().numpy(), x.cpu().numpy(), *s, add=True, transpose=True,
                    data_format="NCHW"), device="cuda")
                copy = copy_ms(int(1.5 * blocks.numel() * 2), graph=True)
                row = []
                for variant in args.variants:
                    use(k, {**defaults, **settings_of(variant)})
                    got = x.clone()
                    k.sparse_scatter(blocks, indices, got, *s, **kwargs)
                    assert torch.equal(got, want), f"{variant}: {(got.float() - want.float()).abs().max()}"
                    xi = x.clone()
                    row.append(graph_ms(lambda: k.sparse_scatter(blocks, indices, xi, *s, **kwargs)))
                cells = (f"[{v or 'defaults'}] {ms * 1e3:.1f} µs {copy / ms:.2f}" for v, ms in zip(args.variants, row))
                print(f"{N} x {C}, windows {p.bsize_out[1]}, {fraction:.2f} ({len(indices)}): "
                      f"copy {copy * 1e3:.1f} µs; " + "; ".join(cells))
    use(k, defaults)


if __name__ == "__main__":
    main()
