"""Version 7's shapes and what a config may ask of them (`hopper.py` builds the kernels): a tile's
rows, columns, warpgroups, stages and threads, its shared memory (the ring, the staged tile, the
mbarriers of the warp-specialized kernels), the register split between the copying and the
multiplying warpgroups, and which products run persistent."""

from dataclasses import replace

from numba import cuda

from ..ptx.mbarrier import BYTES as BAR_BYTES
from ..ptx.mbarrier import registers
from ..ptx.wgmma import SWIZZLE_64, SWIZZLE_128, WARPGROUP, WGMMA_M
from ..runtime.compile import bounded, inlined
from ..runtime.launch import SM_90_SHARED

V7_STORAGE = ("float16", "bfloat16")
V7_BLOCKS = (32, 64, 128)  # a product's block side: 64 values of k a stage, or a block of 32 (64-byte swizzle rows)
V7_WGRAD_BLOCKS = (64, 128)  # a weight gradient's: whole 64-row warpgroups
V7_STACK_BLOCKS = (32,)  # a weight gradient's of blocks stacked down a tile (``v7_wgrad_stacks``)
CHUNK = 8  # 16-bit values a 16-byte chunk
SWIZZLE_K = 64  # values of k a stage: one 128-byte row of a swizzle atom
ATOM = 1024  # a 128-byte-swizzled atom: 8 rows of 128 bytes
SUM_PHASES = 4  # rows of a weight gradient's column sums an N-split (`hopper.make_split`'s column_sums)


PAIRED = "pairs"  # weight_grad's value for a weight gradient of 2 or 4 blocks of a block-row a tile
# (``v7_wgrad_pairs``, ``v7_wgrad_pair_width``)
STACKED = "stacks"  # ... of blocks of one block-column stacked down a tile (``v7_wgrad_stacks``)


def v7_shape(cfg, bs, weight_grad=False):
    """(BM, BN, warpgroups, 64-row tiles a warpgroup, BK, stages) of a version 7 tile
    (``weight_grad``: False, True, `PAIRED` for two blocks of one block-row a tile, or `STACKED`
    for ``v7_wgrad_stacks[bs]`` blocks of one block-column, their rows of x stacked)."""
    if weight_grad == STACKED:  # (by default a warpgroup a 64-row tile)
        BM = cfg.v7_wgrad_stacks.get(bs, 0) * bs
        groups = cfg.v7_wgrad_groups.get(bs, max(BM // WGMMA_M, 1))
        return BM, bs, groups, BM // WGMMA_M // max(groups, 1), cfg.v7_wgrad_k, cfg.v7_wgrad_stack_stages
    if weight_grad:
        paired = weight_grad == PAIRED
        # (by default a warpgroup a 64-row tile; one of two tiles where two thread blocks share a
        # multiprocessor; paired tiles, 2 or 4 bs wide, always a warpgroup a tile)
        groups = bs // WGMMA_M if paired else cfg.v7_wgrad_groups.get(
            bs, 1 if resident(cfg, bs, weight_grad) > 1 else bs // WGMMA_M)
        stages = cfg.v7_wgrad_pairs.get(bs, 0) if paired else cfg.v7_wgrad_stages
        BN, BK = (pair_width(cfg, bs) if paired else 1) * bs, cfg.v7_wgrad_k
        blocks = resident(cfg, bs, weight_grad)
        if blocks > 1:  # the most stages (and their barriers) that fit beside the other thread blocks
            stages = min(stages, (SM_SHARED // blocks - 1024 - ATOM) // (2 * BK * (bs + BN) + 2 * BAR_BYTES))
        return bs, BN, groups, bs // WGMMA_M // max(groups, 1), BK, stages
    groups, tiles = cfg.v7_groups[bs], cfg.v7_tiles.get(bs, 1)
    return groups * tiles * WGMMA_M, bs, groups, tiles, min(bs, cfg.v7_k), cfg.v7_stages.get(bs, 0)


def pair_width(cfg, bs):
    """Blocks of one block-row a paired weight-gradient tile takes (``v7_wgrad_pair_width``, 2
    where it names no width for ``bs``)."""
    return cfg.v7_wgrad_pair_width.get(bs, 2)


def swizzle_of(mn_major, side, BK):
    """(row bytes, descriptor mode) of an operand's shared tile: its stored rows, up to 128 bytes
    (a K-major operand's BK values of k; an MN-major one's ``side`` of m or n, in groups of 64),
    in the 128-byte swizzle, or the 64-byte one where they are 32 values (blocks of 32)."""
    row = 2 * (min(side, 64) if mn_major else BK)
    if row not in (64, 128):
        raise ValueError(f"version 7: a shared operand row of {row} bytes (expected 64 or 128)")
    return row, SWIZZLE_128 if row == 128 else SWIZZLE_64


def make_place(mn_major, W, atom, group):
    """``place(e, cpr)``: (stored row, first value along it, shared offset) of chunk e of an
    operand's stage whose stored rows are ``cpr`` chunks, in its swizzle of ``W``-byte rows
    (`swizzle_of`), atoms ``atom`` bytes apart, an MN-major tile's groups ``group`` apart."""
    V = W // 16  # chunks a swizzle row
    SHIFT = {128: 0, 64: 1}[W]  # (the row bits the swizzle XORs into the chunk's: `ptx.wgmma.swizzled`)

    @inlined
    def place(e, cpr):
        row, chunk = e // cpr, e % cpr
        r = row % 8
        if mn_major:  # stored row: a k; along it: m or n, W / 2 values (V chunks) an atom row
            offset = (chunk // V) * group + (row // 8) * atom + r * W + ((chunk % V) ^ (r >> SHIFT)) * 16
        else:  # stored row: an m or n; along it: k, one atom row
            offset = (row // 8) * atom + r * W + (chunk ^ (r >> SHIFT)) * 16
        return row, chunk * CHUNK, offset

    return place


def v7_threads(cfg, bs, weight_grad=False):
    """The thread block's threads: its multiplying warpgroups, and the copying one where
    ``producing``."""
    return WARPGROUP * (v7_shape(cfg, bs, weight_grad)[2] + int(producing(cfg, weight_grad, bs)))


def producing(cfg, weight_grad, bs):
    """Whether the kernel is warp-specialized: products with ``v7_producer``; weight gradients of
    one block a tile with ``v7_wgrad_producer`` or at a block size of ``v7_wgrad_blocks``; stacked
    tiles with ``v7_wgrad_stack_producer``, paired ones with ``v7_wgrad_pair_producer``."""
    if not weight_grad:
        return cfg.v7_producer
    if weight_grad == STACKED:
        return cfg.v7_wgrad_stack_producer
    if weight_grad == PAIRED:
        return cfg.v7_wgrad_pair_producer
    return cfg.v7_wgrad_producer or bs in cfg.v7_wgrad_blocks


def resident(cfg, bs, weight_grad):
    """Thread blocks a multiprocessor a warp-specialized kernel is built for (``v7_blocks``,
    ``v7_wgrad_blocks``, ``v7_wgrad_pair_blocks`` for paired tiles; 1 where the config names none,
    and for stacked weight-gradient tiles)."""
    if weight_grad == PAIRED:
        return cfg.v7_wgrad_pair_blocks.get(bs, 1)
    if weight_grad == STACKED:
        return 1
    return (cfg.v7_wgrad_blocks if weight_grad else cfg.v7_blocks).get(bs, 1)


def blocks_field(weight_grad):
    """The config field that sets `resident`'s count for a kernel of this kind."""
    return "v7_wgrad_pair_blocks" if weight_grad == PAIRED else "v7_wgrad_blocks" if weight_grad else "v7_blocks"


SM_SHARED = SM_90_SHARED  # a multiprocessor's shared memory on sm_90 (each thread block reserves 1 KB)


def split_registers(cfg, groups, blocks=1, weight_grad=False, kept=None):
    """(the copying warpgroup's, each multiplying warpgroup's) registers a thread, which the
    warp-specialized kernel sets with setmaxnreg, or None where the launch's registers a thread
    (the register file over ``blocks`` thread blocks' threads) are already 224 or more and nothing
    need move."""
    at_entry = 65536 // (blocks * WARPGROUP * (groups + 1)) // 8 * 8  # the launch's registers a thread
    if at_entry >= 224:
        return None
    # The thread block's registers are what its launch allocated: what one warpgroup gives back
    # is all the others can take (setmaxnreg.inc would wait for more forever).
    if kept is None:
        kept = cfg.v7_wgrad_producer_registers if weight_grad else cfg.v7_producer_registers
    taken = ((groups + 1) * at_entry - kept) // groups // 8 * 8
    return kept, min(taken, 256)


def staged_shape(cfg, bs, weight_grad, transposed):
    """(rows, columns, pitch) of the fp32 tile the epilogue stages the accumulators in: the
    thread block's BM x BN, or BN x BM ``transposed`` (feature_axis 0: out's rows run along the
    tile's columns). Pitches of BN + 8 and BM + 4 words put a warp's stores of its accumulators
    on distinct banks (`make_staging`)."""
    BM, BN = v7_shape(cfg, bs, weight_grad)[:2]
    return (BN, BM, BM + 4) if transposed else (BM, BN, BN + 8)


def barriers_at(cfg, bs, weight_grad=False):
    """The ring's bytes, plus an atom's slack to start it on a multiple of 1024, or the staged
    tile's where that is larger (the epilogue reuses the ring's memory): where the mbarriers of a
    warp-specialized kernel start, from the start of shared memory."""
    BM, BN, _, _, BK, STAGES = v7_shape(cfg, bs, weight_grad)
    staged = max(4 * rows * pitch for rows, _, pitch in
                 (staged_shape(cfg, bs, weight_grad, transposed) for transposed in (False, True)))
    return max(STAGES * 2 * BK * (BM + BN) + ATOM, staged)


def persistent(cfg, bs, weight_grad, feature_axis):
    """Whether a kernel is persistent (`make_product_v7`): warp-specialized products with
    feature_axis 1 at the block sizes of ``cfg.v7_persistent``."""
    return cfg.v7_producer and bs in cfg.v7_persistent and not weight_grad and feature_axis == 1


def persistent_config(cfg, bs):
    """``cfg`` with a persistent product's ring (``v7_persistent[bs]`` stages) as ``v7_stages``."""
    if cfg.v7_stages.get(bs) == cfg.v7_persistent[bs]:
        return cfg
    return replace(cfg, v7_stages={**cfg.v7_stages, bs: cfg.v7_persistent[bs]})


def staged16_at(cfg, bs):
    """Where a persistent product's 16-bit staged tile starts (after the ring and its alignment
    slack), its pitch in values, and the bytes to its end."""
    BM, BN, _, _, BK, STAGES = v7_shape(cfg, bs)
    at = STAGES * 2 * BK * (BM + BN) + ATOM
    pitch = BN + 8
    return at, pitch, at + 2 * BM * pitch


def shared_bytes(cfg, bs, weight_grad=False, feature_axis=1):
    """A thread block's dynamic shared memory: `barriers_at`, and with ``cfg.v7_producer`` a full
    and an empty mbarrier a stage after it; a persistent product's ring, its own 16-bit staged
    tile and the barriers."""
    if persistent(cfg, bs, weight_grad, feature_axis):
        cfg = persistent_config(cfg, bs)
        return staged16_at(cfg, bs)[2] + 2 * cfg.v7_stages[bs] * BAR_BYTES
    STAGES = v7_shape(cfg, bs, weight_grad)[5]
    return barriers_at(cfg, bs, weight_grad) + (2 * STAGES * BAR_BYTES if producing(cfg, weight_grad, bs) else 0)


def v7_check(cfg, bs, weight_grad=False):
    """Why a block size's version 7 tiles cannot be built under ``cfg`` ('' where they can)."""
    if not weight_grad and bs not in cfg.v7_groups:
        return f"no version 7 tile for block {bs}"
    sizes = V7_STACK_BLOCKS if weight_grad == STACKED else V7_WGRAD_BLOCKS if weight_grad else V7_BLOCKS
    if bs not in sizes:
        return f"block {bs}: version 7 takes blocks of {sizes}"
    if weight_grad == STACKED and cfg.v7_wgrad_stacks.get(bs) not in (2, 4, 8):
        return f"v7_wgrad_stacks[{bs}]: expected 2, 4 or 8 blocks a tile, got {cfg.v7_wgrad_stacks.get(bs)!r}"
    BM, BN, GROUPS, TILES, BK, STAGES = v7_shape(cfg, bs, weight_grad)
    k = SWIZZLE_K if weight_grad == STACKED else min(bs, SWIZZLE_K)
    if BK != k:
        return f"k {BK}: version 7 stages {k} values of k (a swizzle row, or a block of 32)"
    if not 3 <= STAGES <= 6:
        name = {PAIRED: f"v7_wgrad_pairs[{bs}]", STACKED: "v7_wgrad_stack_stages"}.get(
            weight_grad, "v7_wgrad_stages") if weight_grad else f"v7_stages[{bs}]"
        blocks = resident(cfg, bs, weight_grad) if weight_grad else 1
        fit = f" (the most that fit {blocks_field(weight_grad)}[{bs}] = {blocks})" if blocks > 1 else ""
        return f"{name}: expected 3 to 6 stages, got {STAGES}{fit}"
    if not 1 <= GROUPS <= 4:
        return f"block {bs}: {GROUPS} warpgroups, expected 1 to 4"
    if TILES not in (1, 2) or (weight_grad and GROUPS * TILES * WGMMA_M != BM):
        what = f"{GROUPS} warpgroups of {TILES} 64-row tiles"
        return f"block {bs}: {what}, expected 1 or 2 tiles a warpgroup" + (
            f" and {BM} rows in all" if weight_grad else "")
    if shared_bytes(cfg, bs, weight_grad, 0) > cfg.v6_max_shared:  # (feature_axis 0: never persistent)
        return f"block {bs}: {shared_bytes(cfg, bs, weight_grad, 0)} bytes of shared memory over v6_max_shared"
    if not weight_grad and bs in cfg.v7_persistent:
        if not 3 <= cfg.v7_persistent[bs] <= 6:
            return f"v7_persistent[{bs}]: expected 3 to 6 stages, got {cfg.v7_persistent[bs]}"
        if shared_bytes(cfg, bs, False, 1) > cfg.v6_max_shared:
            return (f"v7_persistent[{bs}]: the ring and the staged tile take {shared_bytes(cfg, bs, False, 1)} "
                    f"bytes of shared memory, over v6_max_shared (fewer stages)")
    blocks = resident(cfg, bs, weight_grad)
    if blocks != 1:
        name = f"{blocks_field(weight_grad)}[{bs}]"
        if blocks not in (2, 3) or not producing(cfg, weight_grad, bs):
            return f"{name}: expected 2 or 3 thread blocks a multiprocessor, of warp-specialized kernels"
        shared = shared_bytes(cfg, bs, weight_grad, 1)
        if blocks * (shared + 1024) > SM_SHARED:
            return f"{name}: {blocks} thread blocks of {shared} bytes of shared memory do not fit a multiprocessor"
    if producing(cfg, weight_grad, bs):
        for name in ("v7_wgrad_producer_registers", "v7_wgrad_sum_registers") if weight_grad else \
                ("v7_producer_registers",):
            if not (24 <= getattr(cfg, name) <= 256 and getattr(cfg, name) % 8 == 0):
                return f"{name}: expected a multiple of 8 from 24 to 256, got {getattr(cfg, name)}"
        kept = max(cfg.v7_wgrad_producer_registers, cfg.v7_wgrad_sum_registers) if weight_grad is True else None
        split = split_registers(cfg, GROUPS, blocks, weight_grad, kept)
        if split is not None and split[1] < 128:
            field = {STACKED: "v7_wgrad_stack_producer", PAIRED: "v7_wgrad_pair_producer"}.get(
                weight_grad, "v7_wgrad_producer" if weight_grad else "v7_producer")
            return (f"block {bs}: {GROUPS} multiplying warpgroups would keep {split[1]} registers a thread beside "
                    f"a copying warpgroup (fewer warpgroups, or {field}=False)")
    return ""


def launch_bounds(cfg, bs, groups, weight_grad):
    """(threads, thread blocks a multiprocessor) a kernel is built with where `hand_over` moves
    registers (setmaxnreg needs a cap at entry), else None (the tools compile with the same)."""
    blocks = resident(cfg, bs, weight_grad)
    if producing(cfg, weight_grad, bs) and split_registers(cfg, groups, blocks, weight_grad) is not None:
        return WARPGROUP * (groups + 1), blocks
    return None


def jit_for(cfg, bs, groups, weight_grad):
    """The kernel decorator: with a register cap at entry (`launch_bounds`), else Numba's plain
    ``jit``, which leaves ptxas its own count (a cap of one thread block a multiprocessor would let
    a kernel that fits two grow past it)."""
    bounds = launch_bounds(cfg, bs, groups, weight_grad)
    return bounded(*bounds) if bounds else cuda.jit


def hand_over(cfg, bs, groups, weight_grad, kept=None):
    """(give, take): the setmaxnreg calls with which the copying warpgroup hands registers to the
    multiplying ones (`split_registers`; ``kept``: the copying warpgroup's registers, the config's
    where None), or calls that do nothing where none need move."""
    blocks = resident(cfg, bs, weight_grad)
    split = split_registers(cfg, groups, blocks, weight_grad, kept) if producing(cfg, weight_grad, bs) else None
    if split is None:
        @inlined
        def nothing():
            return None

        return nothing, nothing
    return registers(split[0], False), registers(split[1], True)
