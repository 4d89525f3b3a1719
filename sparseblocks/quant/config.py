"""The quantized products' knobs: one frozen `QuantConfig`, passed as ``config=``."""

from ..runtime.tuning import config_checker, tuning


@tuning
class QuantConfig:
    pack_warps: int = 8  # warps a quantize-and-pack thread block; a warp packs 32 values of a row a step
    pack_words: int = 4  # words of a row a warp packs (so a thread block covers pack_warps * pack_words words)
    simt_rows: int = 8  # teaching product: rows of a thread block (one thread an output) ...
    simt_cols: int = 32  # ... and outputs
    warps: int = 4  # tensor-core product: warps a thread block, stacked along the rows
    warp_rows: int = 32  # rows a warp (16 an mma)
    dense_cols: int = 64  # outputs a warp in a dense product (8 an mma); a block-sparse one takes a block's

    def check(self):
        if self.warp_rows % 16 or not 16 <= self.warp_rows <= 64:
            raise ValueError(f"warp_rows: expected 16, 32, 48 or 64, got {self.warp_rows}")
        if self.dense_cols % 8 or not 8 <= self.dense_cols <= 64:
            raise ValueError(f"dense_cols: expected a multiple of 8 up to 64, got {self.dense_cols}")


DEFAULT = QuantConfig()
as_config = config_checker(QuantConfig)
