"""The fused gather/scatter products' knobs: one frozen `FusedConfig`, passed as ``config=``.

A tile is ``(rows, cols, words, stages, warps, registers)``: stack pixels and
output channels a thread block, 32-bit words of input channels a stage, shared
buffers in the cp.async ring, warps, and a cap on a thread's registers (ptxas;
None: uncapped). Timings behind the defaults: docs/performance.md.
"""

from ..runtime.tuning import config_checker, default_field, tuning


@tuning
class FusedConfig:
    gather_tile: tuple = (128, 64, 16, 3, 4, None)  # NHWC gather + product: a ring of 3 stages
    nchw_gather_tile: tuple = (128, 64, 16, 2, 4, 168)  # NCHW: pixels a stage ahead in registers; 168 keeps 3 blocks an SM
    scatter_tiles: dict = default_field({  # product + NHWC scatter by dtype: 2 stages leave room for the image's pixels
        "float16": (128, 64, 16, 2, 4, 128), "float32": (64, 64, 16, 2, 2, None)})
    nchw_scatter_tiles: dict = default_field({  # product + NCHW scatter: fp16 uncapped (capped, its image words spill)
        "float16": (128, 64, 16, 2, 4, None), "float32": (64, 64, 16, 2, 2, None)})

    def check(self):
        tiles = [self.gather_tile, self.nchw_gather_tile, *self.scatter_tiles.values(),
                 *self.nchw_scatter_tiles.values()]
        for tile in tiles:
            if len(tile) != 6:
                raise ValueError(f"tile {tile}: expected (rows, cols, words, stages, warps, registers)")
        for dtype, tile in self.scatter_tiles.items():
            # The scatter's staged rows of out are XOR-swizzled over 8 units of 16 bytes.
            if tile[1] * (2 if dtype == "float16" else 4) % 128:
                raise ValueError(f"scatter_tiles[{dtype!r}]: a tile row of out must be whole 128 bytes "
                                 f"(cols a multiple of {64 if dtype == 'float16' else 32}), got {tile[1]} cols")


DEFAULT = FusedConfig()
as_config = config_checker(FusedConfig)
