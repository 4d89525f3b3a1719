"""The block-sparse matmul's knobs: one frozen `BsmmConfig`, passed as ``config=``.

Kernel makers read these at compile time; the compile cache and the kept plans
are keyed on the whole config, so a variant made with `dataclasses.replace`
compiles its own kernels. Timings behind the defaults: docs/performance.md.
"""

from dataclasses import replace

from ..runtime.tuning import config_checker, default_field, tuning


@tuning
class BsmmConfig:
    # -- dispatch ---------------------------------------------------------------------------
    tensor_core_default: frozenset = frozenset({"float16", "bfloat16", "float32"})  # storage run on version 5 by default
    tiles_default: frozenset = frozenset({"float16", "bfloat16"})  # storage run on version 6 by default (where it applies)
    hopper_default: bool = True  # version 7 instead of 6 by default on sm_90 (where it applies)
    product_group: int = 8  # row tiles a product hands out together, so concurrent blocks share activations in L2 (0: launch order)

    # -- version 1 (teaching kernels) ------------------------------------------------------
    rows_per_tile: dict = default_field({8: 16, 16: 16, 32: 8, 64: 4, 128: 2})  # product rows a thread block, one thread an output
    wgrad_rows: dict = default_field({8: 8, 16: 16, 32: 8, 64: 4, 128: 4})  # weight-gradient threads along a block's rows

    # -- version 3 (SIMT, register-blocked) ------------------------------------------------
    product_tiles: dict = default_field(  # (rows TM, patch rows R, patch features Q, features a chunk KC)
        {8: (256, 8, 2, 8), 16: (256, 8, 4, 16), 32: (128, 8, 4, 32), 64: (128, 8, 8, 32), 128: (64, 8, 8, 16)})
    product_threads: int = 128  # threads of a version 3 product; TM * KC must be a multiple of 8 of them
    segment_factor: int = 2  # lines longer than this many mean lines are cut into segments ...
    # ... of at least this many blocks, so one long line does not run alone: {bs: blocks}. Block 128
    # cuts only lines over 32 blocks (the combining pass costs more than a 5-block line alone)
    min_segment: dict = default_field({8: 4, 16: 4, 32: 4, 64: 4, 128: 32})
    longest_first: frozenset = frozenset({128})  # block sizes whose products launch their segments longest first
    wgrad_threads: int = 256  # threads of a version 3 weight gradient's block
    wgrad_patch: dict = default_field({8: 2, 16: 4, 32: 4, 64: 4, 128: 8})  # side of a weight-gradient thread's patch
    wgrad_chunk: int = 64  # rows of N a weight-gradient step loads
    combine_threads: int = 256  # threads of the kernels that add split sums in order
    transpose_threads: int = 256  # most threads of `transpose_blocks`' thread blocks
    norm_threads: int = 256  # most threads of `block_norms`' thread blocks (one a block), a power of two

    # -- version 4 (SIMT, 8 x 8 patches) ---------------------------------------------------
    v4_rows: dict = default_field({16: 256, 32: 256, 64: 128})  # product rows a thread block (block 8 runs version 3)
    v4_kc: int = 8  # features a double-buffered chunk
    v4_jit_options: dict = default_field({})  # extra cuda.jit options (e.g. max_registers) for version 4
    v4_wgrad_threads: int = 128  # threads of a version 4 weight gradient's block
    v4_wgrad_rows: dict = default_field({16: 16, 32: 16, 64: 32})  # rows of N a weight-gradient chunk
    v4_wgrad_batch: int = 32  # values of x and dy a thread has in flight before storing them
    v4_vector: bool = True  # 16-byte global loads where pointers allow
    v4_width: int = 4  # activations a vector load
    v4_layout: dict = default_field({16: "pad", 32: "pad", 64: "pad"})  # shared tiles "pad"ded or "swizzle"d: no bank conflicts
    v4_unroll: dict = default_field({16: True, 32: True, 64: True})  # the 8-step inner loop written out

    # -- version 5 (tensor cores, mma.sync) ------------------------------------------------
    v5_warps: dict = default_field({16: 4, 32: 4, 64: 8, 128: 8})  # warps of a product's thread block
    v5_warp_tile: int = 32  # most output features a warp owns (and a weight-gradient patch's side)
    v5_warp_rows: dict = default_field({16: 32, 32: 32, 64: 32, 128: 32})  # rows a warp, multiples of the mma's 16
    v5_ring_warps: dict = default_field(  # (warps, rows a warp) of the cp.async ring where they differ
        {(64, "float16"): (4, 64), (64, "float32"): (4, 64), (128, "float32"): (8, 64)})
    v5_stage_words: dict = default_field(  # 32-bit words of k a stage, where not a block's
        {(64, "float32"): 16, (128, "float32"): 16, (128, "float16"): 16, (128, "bfloat16"): 16})
    v5_vector: bool = True  # 16-byte global loads where pointers allow
    v5_stages: int = 3  # shared stages: 2 through registers; more feed 16-byte rows by cp.async, stages - 1 ahead
    v5_weight_registers: frozenset = frozenset({(32, "float16"), (32, "bfloat16")})  # input_grad weights through registers
    v5_transposed_forward: dict = default_field(  # forward copies W transposed first at these rows N or more
        {(64, "float32"): 1, (64, "float16"): 8192, (64, "bfloat16"): 8192})
    v5_rounded_sums: bool = True  # fp32: each mma from zero, added in round-to-nearest fp32 (the tensor cores' sums drift)
    v5_wgrad: bool = True  # the weight gradient on tensor cores too (False: version 4's)
    v5_wgrad_warps: int = 4  # warps of a weight-gradient thread block (block 128: a block's 16 patches on 4 of them)
    v5_wgrad_async: bool = True  # fp32 rows of x and dy to shared memory by cp.async
    v5_wgrad_stages: int = 2  # buffers of that ring (2-4)
    v5_wgrad_group: dict = default_field({16: 4})  # blocks of a block-row one warp takes, sharing x's slice
    v5_wgrad_group_warps: int = 4  # warps of a grouped weight-gradient thread block
    v5_wgrad_rows: int = 32  # N-splits are cut at multiples of this (whole steps of every storage)

    # -- version 6 (tensor cores: ldmatrix tiles from a cp.async ring; fp16, bf16) -------
    v6_tiles: dict = default_field(  # (rows BM, warps along rows, warps along features) of a product's tile
        {16: (128, 4, 1), 32: (256, 4, 1), 64: (256, 4, 1), 128: (128, 2, 2)})
    v6_k: int = 32  # k values a stage (at most a block): two k16 mma steps a barrier
    v6_stages: int = 4  # shared buffers of the ring, stages - 1 in flight while one is multiplied
    v6_copy_step: int = 0  # k16 steps of a stage multiplied before the next stage's copies are issued
    v6_wgrad_warps: dict = default_field(  # (warps along dW's rows, along its columns) of a block's tile
        {32: (1, 1), 64: (2, 2), 128: (2, 2)})  # (block 16: version 5, 1.2x version 6's (1, 1) at 50 %)
    v6_wgrad_k: int = 32  # rows of N a weight-gradient stage
    v6_wgrad_stages: int = 4  # buffers of the weight gradient's ring
    v6_max_shared: int = 227 * 1024  # a thread block's shared memory on sm_90
    # False: version 6's loops copy every stage and multiply none (zeros out): the floor of their data
    # movement, timed by `tools/sweep.py --unchecked`; never a product.
    v6_multiply: bool = True

    # -- version 7 (Hopper: wgmma from a cp.async ring; fp16, bf16; sm_90) ----------------
    v7_groups: dict = default_field({32: 1, 64: 2, 128: 2})  # warpgroups of a product's tile
    v7_tiles: dict = default_field({32: 2, 64: 2, 128: 2})  # 64-row wgmma tiles a warpgroup of a product owns (1, 2)
    v7_k: int = 64  # k values a stage (64: one 128-byte row of the shared tiles' swizzle)
    v7_stages: dict = default_field({32: 4, 64: 5, 128: 4})  # the product's ring: stages - 2 in flight ahead of the one multiplied
    # Warpgroups of a weight-gradient block's tile; absent: one a 64-row tile, or one of two tiles at
    # a block size of v7_wgrad_blocks (paired tiles: always one a tile)
    v7_wgrad_groups: dict = default_field({32: 1})
    v7_wgrad_stages: int = 6  # the weight gradient's ring
    v7_wgrad_fill: int = 1  # weight-gradient thread blocks a multiprocessor the N-splits aim for
    # ... or the N-splits that a model of rounds of thread blocks, their stages and the combining pass
    # says are fastest (`dispatch.wave_splits`): whole rounds of resident thread blocks, not a fill
    v7_wgrad_waves: bool = False
    v7_wgrad_k: int = 64  # rows of N a weight-gradient stage
    # Weight gradients of two blocks of one block-row a thread block, x's columns read once for both
    # (a tile of bs x 2 bs): {bs: stages of the ring}; absent: a block a thread block
    v7_wgrad_pairs: dict = default_field({64: 4})
    v7_wgrad_pairs_fill: int = 1  # ... where the pairs alone give this many thread blocks a multiprocessor (0: always)
    v7_wgrad_pair_width: dict = default_field({64: 2})  # ... blocks of the block-row a tile takes: {bs: 2 or 4}
    # ... warp-specialized: a copying warpgroup fills the ring on mbarriers (with v7_tma one thread's
    # bulk copies, a box of x and one of dy a block; else cp.async), the multiplying warps only wait
    # and multiply; built for v7_wgrad_pair_blocks[bs] thread blocks a multiprocessor (1 where absent)
    v7_wgrad_pair_producer: bool = True
    v7_wgrad_pair_blocks: dict = default_field({})
    # Weight gradients of n blocks of one block-column a thread block, stacked down a tile of n bs x bs
    # (dy's columns read once for all; n of 2, 4 or 8), at block 32, where wgmma's 64 rows need two
    # blocks at least: {bs: n}; warpgroups from v7_wgrad_groups, the ring v7_wgrad_stack_stages; absent:
    # version 6. Block 32: four blocks on one warpgroup (two 64-row tiles), four stages
    v7_wgrad_stacks: dict = default_field({32: 4})
    v7_wgrad_stack_stages: int = 4
    # ... warp-specialized: a copying warpgroup's cp.async (a stack's blocks are not one box of a
    # tensor map) fills the ring on mbarriers, the multiplying warps only wait and multiply
    v7_wgrad_stack_producer: bool = True
    # Products whose output lines are short (mean blocks a line <= "mean_blocks") on other tiles:
    # {bs: {"mean_blocks": m, field: value, ...}}, fields of SHORT_LINE_FIELDS (a table's value for bs,
    # v7_producer_registers itself); `dispatch.v7_config`. Block 128: one warpgroup of two 64-row
    # tiles, 3 stages, two thread blocks a multiprocessor, where a line sums up to 8 blocks (25 % at 4096)
    v7_short_lines: dict = default_field({128: {"mean_blocks": 8, "v7_groups": 1, "v7_stages": 3, "v7_blocks": 2,
                                                "v7_producer_registers": 40}})
    # Warp-specialized thread blocks: one more warpgroup copies the stages (cp.async, completing on
    # mbarriers) while the others only multiply, each stage handed over by a barrier pair instead of
    # a barrier of the block (products; v7_wgrad_producer: weight gradients). Where the launch leaves
    # fewer than 224 registers a thread, the copying warpgroup keeps v7_producer_registers and
    # leaves the rest to the others (setmaxnreg)
    v7_producer: bool = True
    v7_wgrad_producer: bool = False
    v7_producer_registers: int = 160
    # Thread blocks a multiprocessor the warp-specialized kernels are built for, {bs: count} (1 where
    # absent): the register cap at entry and the setmaxnreg split leave room for that many, and their
    # shared memory must fit as many (products, whose stages must fit). Weight gradients of a block
    # size in v7_wgrad_blocks run warp-specialized, on the most stages up to v7_wgrad_stages that fit,
    # the copying warpgroup keeping v7_wgrad_producer_registers (bulk copies need few), or
    # v7_wgrad_sum_registers where two of its warps also sum the bias gradient's columns
    v7_blocks: dict = default_field({})
    v7_wgrad_blocks: dict = default_field({128: 2})
    v7_wgrad_producer_registers: int = 40
    v7_wgrad_sum_registers: int = 56
    # The warp-specialized kernels' copies as bulk tensor copies (TMA, `ptx.tma`): one thread
    # issues a stage's few boxes, described by tensor maps made on the host (`runtime.tensormap`),
    # instead of a warpgroup's 16-byte cp.async copies
    v7_tma: bool = True
    # Persistent products (feature_axis 1, warp-specialized): {bs: stages of the ring}. One thread
    # block a multiprocessor walks the tiles, its copying warpgroup filling the next tile's stages
    # while the others store the last one's, staged in 16 bits beside the ring
    v7_persistent: dict = default_field({64: 4})

    def check(self):
        if self.norm_threads < 1 or self.norm_threads & (self.norm_threads - 1):
            raise ValueError(f"norm_threads: expected a power of two, got {self.norm_threads}")
        if not 2 <= self.v5_stages <= 5:
            raise ValueError(f"v5_stages: expected 2 to 5, got {self.v5_stages}")
        if not 2 <= self.v5_wgrad_stages <= 4:
            raise ValueError(f"v5_wgrad_stages: expected 2 to 4, got {self.v5_wgrad_stages}")
        for name in ("v5_wgrad_warps", "v5_wgrad_group_warps"):  # (a block's patches split evenly among them)
            warps = getattr(self, name)
            if warps not in (1, 2, 4, 8, 16, 32):
                raise ValueError(f"{name}: expected a power of two from 1 to 32, got {warps!r}")
        from .tiles import v6_check

        for bs in self.v6_tiles:
            if v6_check(self, bs):
                raise ValueError(f"v6_tiles[{bs}]: {v6_check(self, bs)}")
        for bs in self.v6_wgrad_warps:
            if v6_check(self, bs, weight_grad=True):
                raise ValueError(f"v6_wgrad_warps[{bs}]: {v6_check(self, bs, weight_grad=True)}")
        from .hopper import V7_BLOCKS, V7_WGRAD_BLOCKS, v7_check

        for bs in self.v7_groups:
            if v7_check(self, bs):
                raise ValueError(f"v7_groups[{bs}]: {v7_check(self, bs)}")
        if not isinstance(self.v7_wgrad_pairs_fill, int) or self.v7_wgrad_pairs_fill < 0:
            raise ValueError(f"v7_wgrad_pairs_fill: expected an int >= 0, got {self.v7_wgrad_pairs_fill!r}")
        for bs, width in self.v7_wgrad_pair_width.items():
            if width not in (2, 4):
                raise ValueError(f"v7_wgrad_pair_width[{bs}]: expected 2 or 4 blocks a tile, got {width!r}")
        for bs in self.v7_wgrad_pairs:
            from .hopper_shapes import PAIRED

            if v7_check(self, bs, PAIRED):
                raise ValueError(f"v7_wgrad_pairs[{bs}]: {v7_check(self, bs, PAIRED)}")
        for bs in self.v7_wgrad_stacks:
            from .hopper_shapes import STACKED

            if v7_check(self, bs, STACKED):
                raise ValueError(f"v7_wgrad_stacks[{bs}]: {v7_check(self, bs, STACKED)}")
        for bs, rule in self.v7_short_lines.items():
            if (not isinstance(rule, dict) or not rule.get("mean_blocks", 0) > 0
                    or not set(rule) - {"mean_blocks"} <= set(SHORT_LINE_FIELDS)):
                raise ValueError(f"v7_short_lines[{bs}]: expected {{'mean_blocks': m > 0, field: value, ...}} with "
                                 f"fields of {SHORT_LINE_FIELDS}, got {rule!r}")
            if short_lines_apply(self, bs):
                try:
                    short_lines_config(self, bs)  # (checked as it is made)
                except ValueError as error:
                    raise ValueError(f"v7_short_lines[{bs}]: {error}") from None
        for name, sizes in (("v7_blocks", V7_BLOCKS), ("v7_wgrad_blocks", V7_WGRAD_BLOCKS),
                            ("v7_wgrad_pair_blocks", V7_WGRAD_BLOCKS)):
            if not set(getattr(self, name)) <= set(sizes):
                raise ValueError(f"{name}: expected block sizes of {sizes}, got {sorted(getattr(self, name))}")
        for bs in V7_WGRAD_BLOCKS:
            if v7_check(self, bs, weight_grad=True):
                raise ValueError(f"version 7 weight gradient: {v7_check(self, bs, weight_grad=True)}")
        for bs, (rows, _, _, chunk) in self.product_tiles.items():
            if rows * chunk % (8 * self.product_threads):
                raise ValueError(f"product_tiles[{bs}]: TM * KC must be a multiple of 8 * product_threads")


SHORT_LINE_FIELDS = ("v7_groups", "v7_tiles", "v7_stages", "v7_blocks", "v7_producer_registers")


def short_lines_apply(cfg, bs):
    """Whether block ``bs``'s `v7_short_lines` rule can apply under ``cfg``: version 7 products of
    that block size, warp-specialized where the rule sets a residency."""
    rule = cfg.v7_short_lines.get(bs)
    return rule is not None and bs in cfg.v7_groups and (cfg.v7_producer or "v7_blocks" not in rule)


def short_lines_config(cfg, bs):
    """``cfg`` with block ``bs``'s `v7_short_lines` rule applied (and no rule left)."""
    fields = {}
    for name, value in cfg.v7_short_lines[bs].items():
        if name != "mean_blocks":
            old = getattr(cfg, name)
            fields[name] = {**old, bs: value} if isinstance(old, dict) else value
    if "v7_blocks" in fields:  # (a persistent product is one thread block a multiprocessor)
        fields["v7_persistent"] = {k: stages for k, stages in cfg.v7_persistent.items() if k != bs}
    return replace(cfg, v7_short_lines={}, **fields)


DEFAULT = BsmmConfig()
as_config = config_checker(BsmmConfig)
