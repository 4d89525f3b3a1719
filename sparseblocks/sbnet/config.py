"""SBNet's knobs: one frozen `SbnetConfig`, passed as ``config=``.

Kernel makers and path choices read these; the compile cache and the kept
plans are keyed on the whole config. Timings behind the defaults:
docs/performance.md.
"""

from ..runtime.tuning import config_checker, tuning

WARP = 32


@tuning
class SbnetConfig:
    # -- reduce_mask --------------------------------------------------------------------------
    reduce_version: int = 2  # 2: one pass with a look-back; 1: pool, scan, write (wide windows always)
    reduce_warps: int = 8  # version 1: warps of a pooling thread block
    reduce_loads: int = 4  # version 1: mask values a lane loads before it pools any
    reduce_fill: int = 64  # version 1: warps a multiprocessor holds; pooling groups grow until windows fill them
    compact_threads: int = 256  # version 1: flags a compaction thread block
    prefix_chunks: int = 1024  # version 1: chunk counts a compaction block sums itself; more take a scan
    pass_threads: int = 256  # version 2: threads of a chunk's thread block
    pass_windows: int = 64  # version 2: most windows a chunk (one thread each ranks them)
    pass_columns: int = 1024  # version 2: most columns a chunk; wider windows run version 1
    pass_pixels: int = 2048  # version 2: pixels a chunk takes at least (8 loads a thread) ...
    pass_pixels_large: int = 4096  # ... or 16 loads, where that still leaves a chunk a multiprocessor
    pass_wave: int = 4  # chunks fit one wave of this many thread blocks a multiprocessor (0: no such rule)
    pass_loads: int = 8  # rows a thread loads before it pools any (4, 8 or 16)
    pass_lane_entries: int = 16  # windows of at most this many shared values are pooled by one lane, not a warp
    pass_vector: int = 4  # mask columns a load where windows are whole aligned vectors (1, 2 or 4)
    pass_max_registers: int = None  # a cap on the pass kernel's registers (ptxas)
    pass_trace: bool = False  # thread 0 of each chunk stamps %globaltimer into its status line (a timeline)
    pass_nan_max: str = None  # float32 NaN-propagating max: "ptx", "select", or None (by the device)
    pass_look_back: str = None  # "warp", "block", or None: the block from pass_block_look_back chunks on
    pass_block_look_back: int = 64  # chunks from which the thread block reads predecessors' statuses
    status_stride: int = None  # int64 words between chunk statuses (None: 16 for the block look-back, else 1)
    status_spread_words: int = 1 << 20  # most words statuses spread a line apart may take

    # -- gathers and scatters -------------------------------------------------------------
    copy_threads: int = 256  # threads of an element copy's thread block (one window)
    copy_unroll: int = 4  # elements a thread loads before it stores any
    waves: int = 4  # thread blocks a multiprocessor a copy aims for
    row_copies: bool = True  # channels-last copies a window row at a time, 16 bytes a thread-step
    row_unroll: int = 4  # 16-byte vectors a row-copy thread loads before it stores any
    row_threads: int = 256  # most threads of a plain row copy
    row_tile_c: int = 64  # channels of a transposing row copy's tile ...
    row_tile_pixels: int = 32  # ... by this many window pixels ...
    row_tile_pixels_wide: int = 64  # ... or this many for fp32 copies of overlapping windows
    row_tile_threads: int = 128  # threads moving such a tile
    row_tile_window_major: bool = None  # tiles window by window (None: where windows overlap or data are fp32)
    pairs: bool = True  # plain NCHW fp16 copies two halves a word where rows start on words
    pair_unroll: int = 4  # rows a pair-copy thread loads before it stores any
    pair_halves: int = 4  # halves a word where rows allow (4: int64 words; else 2)
    pair_max_registers: int = None  # a cap on the plain pair kernels' registers
    pair_strips: frozenset = frozenset({"scatter quads", "atomic"})  # pair copies laid out in strips of windows
    pair_tile_pairs: int = 32  # transposing fp16 copies: channel pairs a tile ...
    pair_tile_pixels: int = 64  # ... by whole window rows of at most this many pixels
    pair_tile_threads: int = 256  # threads of such a tile
    pair_tile_unroll: int = 4  # image-side items a thread has in flight
    pair_tile_loads: int = 4  # block-side loads a thread has in flight
    pair_tile_max_registers: int = 64  # a cap on the pair tiles' registers (4 thread blocks a multiprocessor)
    pair_tile_gathers: bool = True  # NCHW fp16 gathers through the transpose by words
    pair_gather_pairs: int = 16  # channel pairs of such a gather's thread block
    pair_gather_words: int = 6144  # image words of its shared tile (24 KB)
    max_grid_yz: int = 65535  # CUDA's limit on a grid's y and z (smaller values reach the split grids)

    # -- merged scatter into a copy -----------------------------------------------------------
    merge: bool = True  # a scatter into a copy of y writes each pixel once, through a map of the windows
    merge_min_cover: float = 0.15  # ... where the windows cover at least this fraction of the image
    merge_threads: int = 256  # most threads of a merging thread block
    merge_unroll: int = 4  # 16-byte vectors a merging thread loads before it stores any
    link_threads: int = 256  # threads linking the blocks into the map ...
    link_alone: int = 16384  # ... or, where map and rows are at most this many, one thread block that also empties it
    link_alone_threads: int = 1024  # threads of that one block

    @property
    def compact_warps(self):
        return self.compact_threads // WARP

    @property
    def pass_warps(self):
        return self.pass_threads // WARP

    @property
    def merge_vectors(self):
        """16-byte vectors of a merging thread block's run of a row."""
        return self.merge_threads * self.merge_unroll

    @property
    def merge_span(self):
        """Windows such a run reaches along a row at most (a stride of 1)."""
        return self.merge_vectors + 2

    def check(self):
        if self.reduce_version not in (1, 2):
            raise ValueError(f"reduce_version: expected 1 or 2, got {self.reduce_version!r}")
        if self.pass_loads not in (4, 8, 16):
            raise ValueError(f"pass_loads: expected 4, 8 or 16, got {self.pass_loads!r}")
        if self.pass_vector not in (1, 2, 4):
            raise ValueError(f"pass_vector: expected 1, 2 or 4, got {self.pass_vector!r}")
        if self.pair_halves not in (2, 4):
            raise ValueError(f"pair_halves: expected 2 or 4, got {self.pair_halves!r}")
        if self.pass_windows > self.pass_threads:
            raise ValueError("pass_windows: at most pass_threads (a thread ranks each window)")


DEFAULT = SbnetConfig()
as_config = config_checker(SbnetConfig)
