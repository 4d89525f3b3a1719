"""The quantized products' knobs: one frozen `QuantConfig`, passed as ``config=``."""

from ..runtime.tuning import config_checker, tuning


@tuning
class QuantConfig:
    pack_warps: int = 8  # warps a quantize-and-pack thread block; a warp packs 32 values of a row a step
    pack_words: int = 4  # words of a row a warp packs (so a thread block covers pack_warps * pack_words words)
    pack_vector: bool = True  # rows of whole 16-byte-aligned words: a word a thread, 16-byte loads (make_pack_words)
    pack_half2: bool = True  # ... fp16 rows: a binary search over the thresholds two values an instruction
    simt_rows: int = 8  # teaching product: rows of a thread block (one thread an output) ...
    simt_cols: int = 32  # ... and outputs
    warps_m: int = 4  # tensor-core product: warps of a thread block along the rows ...
    warps_n: int = 2  # ... and along its group of outputs
    warp_rows: int = 32  # rows a warp for 1-bit activations (16 an mma; divided among the planes of more bits)
    dense_cols: int = 64  # outputs a thread block in a dense product; a block-sparse one takes a block's
    chunk_words: int = 16  # words of the word list staged in shared memory at a time (8 a b1 mma step)
    max_registers: int = None  # a cap on the tensor-core product's registers (ptxas), None for none
    fused_acc: int = 64  # registers a thread the accumulators of all weight planes may take in one pass (0: a pass a plane)
    # dense products (every weight plane in one pass): stages of a cp.async ring (`ring`; 2 to 4, in
    # dynamic shared memory up to 227 KiB), the rows' bit counts from a kernel of their own; 0: none
    ring_stages: int = 3
    ring_lists: bool = False  # ... block-sparse products too, a block a 4- or 8-byte copy (layouts' word lists)

    def check(self):
        if not 1 <= self.pack_words <= 32:
            raise ValueError(f"pack_words: expected 1 to 32 (a lane keeps a word), got {self.pack_words}")
        if self.warp_rows % 16 or not 16 <= self.warp_rows <= 64:
            raise ValueError(f"warp_rows: expected 16, 32, 48 or 64, got {self.warp_rows}")
        if self.warps_n not in (1, 2, 4):
            raise ValueError(f"warps_n: expected 1, 2 or 4, got {self.warps_n}")
        if self.dense_cols % (8 * self.warps_n) or not 8 <= self.dense_cols <= 256:
            raise ValueError(f"dense_cols: expected a multiple of 8 * warps_n up to 256, got {self.dense_cols}")
        if self.fused_acc < 0:
            raise ValueError(f"fused_acc: expected 0 or more registers, got {self.fused_acc}")
        if self.ring_stages == 1 or not 0 <= self.ring_stages <= 4:
            raise ValueError(f"ring_stages: expected 0 (no ring) or 2 to 4, got {self.ring_stages}")
        if self.chunk_words not in (8, 16, 32):
            raise ValueError(f"chunk_words: expected 8, 16 or 32, got {self.chunk_words}")
        tile = (self.warps_m * self.warp_rows + self.dense_cols) * (self.chunk_words + 4) * 4
        if tile > 48 * 1024:  # (activation rows of every plane, about warps_m * warp_rows, then the outputs)
            raise ValueError(f"warps_m, warp_rows, dense_cols, chunk_words: expected a shared tile of at most 48 KiB, "
                             f"got {tile} bytes")


DEFAULT = QuantConfig()
as_config = config_checker(QuantConfig)
