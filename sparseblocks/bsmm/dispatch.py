"""Which kernel runs, and its launch: version x dtype x block size -> kernel family.

`product_family` and `weight_grad_family` are the dispatch table. Every launcher takes the config, the
operands and the layout, looks the kernel up in the compile cache
(`runtime.compile`), and launches it; it returns what a kept plan repeats.
"""

import functools
from dataclasses import replace

import numpy as np
from numba import cuda

from ..ptx.vector import aligned
from ..runtime.compile import cached
from ..runtime.devices import active
from ..runtime.launch import compute_capability, data_pointer, launch, multiprocessors, stream_of
from ..runtime.tensormap import check as map_check
from ..runtime.tensormap import map_pointer, no_map, tensor_map
from .config import DEFAULT, short_lines_apply, short_lines_config
from .device import acc_type
from .simple import make_product_v1, make_weight_grad_v1
from .simt import (
    ADD_BIAS_THREADS,
    COLUMN_SUM_ROWS,
    COLUMN_SUM_THREADS,
    make_add_bias,
    make_column_sums,
    make_combine_lines,
    make_finish_column_sums,
    make_product_v3,
    make_product_v4,
    v4_threads,
    v4_weight_width,
)
from .tensorcore import (
    V5_BLOCKS,
    V5_WGRAD_BLOCKS,
    V5_STORAGE,
    make_product_v5,
    make_transpose_blocks,
    transpose_threads,
    v5_ring,
    v5_shape,
    v5_values,
)
from .weight_grad_simt import (
    make_combine_wgrad,
    make_weight_grad_v3,
    make_weight_grad_v4,
)
from .hopper import PAIRED, STACKED, V7_STORAGE, V7_WGRAD_BLOCKS, make_product_v7, persistent, v7_shape
from .hopper import v7_threads
from .hopper_wgrad import make_weight_grad_v7
from .hopper_shapes import SUM_PHASES, pair_width, producing, resident
from .tiles import V6_STORAGE, make_product_v6, make_weight_grad_v6, v6_shape, v6_threads
from .weight_grad_tensorcore import make_weight_grad_v5, v5_wgrad_blocks, v5_wgrad_spread, v5_wgrad_warps

VERSIONS = (1, 3, 4, 5, 6, 7)


def hopper():
    """Whether the current GPU runs version 7 (wgmma: sm_90, compiled for sm_90a). Not in the
    simulator: its kernels would take minutes of Python threads there (tests may still ask)."""
    return compute_capability() == (9, 0)


def product_family(cfg, version, bs, storage, tiles_fit=True):
    """The product kernels a call runs (the dispatch table of the products): 7 Hopper tiles (on
    sm_90, where ``tiles_fit``), 6 tensor-core tiles (where ``tiles_fit``: `tiles_fit`), 5 tensor
    cores, 4 SIMT 8 x 8 patches, 3 SIMT register tiles, 1 the teaching kernel."""
    if version == 7 and tiles_fit and bs in cfg.v7_groups and storage in V7_STORAGE and hopper():
        return 7
    if version >= 6 and tiles_fit and bs in cfg.v6_tiles and storage in V6_STORAGE:
        return 6
    if version >= 5 and bs in V5_BLOCKS and storage in V5_STORAGE:
        return 5
    if version >= 4 and bs in cfg.v4_rows:
        return 4
    return 3 if version >= 3 else 1


def weight_grad_family(cfg, version, bs, storage, feature_axis, tiles_fit=True):
    """The weight-gradient kernels a call runs (the dispatch table of the weight gradients)."""
    if version == 7 and tiles_fit and (bs in V7_WGRAD_BLOCKS or bs in cfg.v7_wgrad_stacks) \
            and storage in V7_STORAGE and hopper():
        return 7
    if version >= 6 and tiles_fit and bs in cfg.v6_wgrad_warps and storage in V6_STORAGE:
        return 6
    if version >= 5 and cfg.v5_wgrad and bs in V5_WGRAD_BLOCKS and storage in V5_STORAGE:
        return 5
    if version >= 4 and bs in cfg.v4_wgrad_rows and feature_axis == 1:
        return 4
    return 3 if version >= 3 else 1


def default_version(dtype, cfg=DEFAULT):
    """The version a call without ``version=`` runs: 6 (tensor-core tiles) for the storage in
    ``cfg.tiles_default``, 5 (tensor cores; fp32 as 3xTF32 with round-to-nearest sums) for that
    in ``cfg.tensor_core_default``, else 4. A version a call's block size or operands do not
    fit runs the next one down (`product_family`)."""
    if dtype in cfg.tiles_default:
        return 7 if cfg.hopper_default and hopper() else 6
    return 5 if dtype in cfg.tensor_core_default else 4


def tiles_fit(arrays, n_rows, feature_axis):
    """Whether version 6 may take these operands: every pointer 16-byte aligned (its copies are
    16-byte cp.async), and N a multiple of 8 where N runs along rows (feature_axis 0), so that
    an 8-row chunk is wholly in or past the end."""
    return (feature_axis == 1 or n_rows % 8 == 0) and all(aligned(data_pointer(a), 16, 1) for a in arrays)


def compiled(cfg, maker, bs, storage, *key):
    """``maker(cfg, bs, storage, accumulator type, *key)``, compiled once per config and key."""
    return cached(maker, cfg, bs, storage, acc_type(storage), *key)


def _on_device(layout, key, array, stream):
    """A layout index (or schedule) array on the device, cached in the layout's schedule cache."""
    cache = layout._schedules
    key = ("device", key, active())
    if key not in cache:
        cache[key] = cuda.to_device(np.ascontiguousarray(array), stream=stream)
    return cache[key]


def _index(layout, name, stream):
    return _on_device(layout, name, getattr(layout, name), stream)


_stand_ins = {}


def _stand_in(shape, dtype):
    """A small array for an argument a launch does not use (a workspace without segments, a bias
    without one): shared, read and written by no one."""
    key = (shape, dtype, active())
    if key not in _stand_ins:
        _stand_ins[key] = cuda.device_array(shape, dtype)
    return _stand_ins[key]


def segment_limit(layout, axis, cfg=DEFAULT):
    """Longest segment (in blocks) a thread block of a SIMT or tensor-core product takes on."""
    MIN_SEGMENT = cfg.min_segment
    SEGMENT_FACTOR = cfg.segment_factor
    bs = layout.block_size
    ptr = layout.col_ptr if axis == "col" else layout.row_ptr
    mean = layout.n_blocks / max(1, len(ptr) - 1)
    return max(MIN_SEGMENT.get(bs, 4), int(np.ceil(SEGMENT_FACTOR * mean)))


def vector_loads(cfg, arrays, n_rows, feature_axis, widths=None):
    """Whether version 4 may read each of ``arrays`` ``widths`` elements at a time:
    4-byte (or smaller) elements, aligned pointers, and with feature_axis 0 rows
    in whole vectors (the feature axis holds whole blocks anyway)."""
    V4_VECTOR = cfg.v4_vector
    V4_WIDTH = cfg.v4_width
    widths = (V4_WIDTH, V4_WIDTH) if widths is None else widths
    itemsize = arrays[0].dtype.itemsize
    return (V4_VECTOR and itemsize <= 4 and (feature_axis == 1 or n_rows % V4_WIDTH == 0)
            and all(aligned(data_pointer(a), itemsize, width) for a, width in zip(arrays, widths)))


def v5_vector_loads(cfg, arrays, n_rows, feature_axis, values):
    """Whether version 5 may read 16 bytes at a time: aligned pointers, and with feature_axis 0
    rows in whole vectors (4 words: 4 fp32 rows, or 8 rows of 16-bit values)."""
    V5_VECTOR = cfg.v5_vector
    return (V5_VECTOR and (feature_axis == 1 or n_rows % (4 * values) == 0)
            and all(aligned(data_pointer(a), 16, 1) for a in arrays))


def words(array):
    """A device array's 32-bit words along its last axis (int32), for version 5's loads."""
    if hasattr(array, "data_ptr"):  # torch
        import torch

        return array.view(torch.int32)
    return array.view(np.int32)


def bits(array):
    """The 16-bit patterns of an fp16 device array (a bf16 one is int16 already: a no-op)."""
    if hasattr(array, "data_ptr"):  # torch
        import torch

        return array.view(torch.int16)
    return array.view(np.int16)


def launch_product_v1(cfg, out, a, w, layout, n_rows, transpose_w, feature_axis, stream):
    ROWS_PER_TILE = cfg.rows_per_tile
    bs = layout.block_size
    rows = ROWS_PER_TILE[bs]
    line_ptr, other_idx, line_block = (("row_ptr", "col_idx", "col_idx") if transpose_w
                                       else ("col_ptr", "row_idx", "col_block"))
    kernel = compiled(cfg, make_product_v1, bs, a.dtype, transpose_w, feature_axis)
    lines = layout.shape[0] if transpose_w else layout.shape[1]
    launch(kernel, ((n_rows + rows - 1) // rows, lines), (bs, rows), stream, (
        out, a.device(stream), w.device(stream), _index(layout, line_ptr, stream),
        _index(layout, other_idx, stream), _index(layout, line_block, stream), n_rows,
    ))


def product_schedule(cfg, layout, transpose_w, max_segment, stream):
    """What the products launch with over a layout, whatever the activations:
    (slots, product index arrays, combine index arrays), cached in the layout
    so that a call looks it up once instead of rebuilding keys for each array."""
    LONGEST_FIRST = layout.block_size in cfg.longest_first
    key = ("product schedule", transpose_w, max_segment, cfg.segment_factor, cfg.min_segment.get(layout.block_size),
           LONGEST_FIRST, active())
    cached = layout._schedules.get(key)
    if cached is not None:
        return cached
    axis = "row" if transpose_w else "col"
    limit = segment_limit(layout, axis, cfg) if max_segment is None else max_segment
    schedule = dict(layout.line_segments(axis, limit))
    if LONGEST_FIRST:  # (each segment names its line, blocks and slot: any order computes the same)
        order = np.argsort(schedule["seg_begin"] - schedule["seg_end"], kind="stable")
        for name in ("seg_line", "seg_begin", "seg_end", "seg_slot"):
            schedule[name] = schedule[name][order]
    other_idx, line_block = ("col_idx", "col_idx") if transpose_w else ("row_idx", "col_block")
    on_device = {
        name: _on_device(layout, (axis, limit, LONGEST_FIRST, name), schedule[name], stream)
        for name in ("seg_line", "seg_begin", "seg_end", "seg_slot", "split_line", "split_begin", "split_end")
    }
    product = (on_device["seg_line"], on_device["seg_begin"], on_device["seg_end"], on_device["seg_slot"],
               _index(layout, other_idx, stream), _index(layout, line_block, stream))
    combine = (on_device["split_line"], on_device["split_begin"], on_device["split_end"])
    cached = layout._schedules[key] = (schedule["n_slots"], product, combine)
    return cached


def launch_product(cfg, out, a, w, layout, n_rows, transpose_w, feature_axis, stream, max_segment, version,
                   bias=None, relu=False):
    """Launch a product (and its combining pass where lines are cut into segments, and with
    ``bias`` (an Operand) its addition, with ``relu`` the max with 0 after it: in version 7's
    epilogue, else a pass of its own); return
    the launches a kept plan repeats, (pre, main, combine, post): each (kernel, grid, threads,
    args[, derived], live positions) or None."""
    COMBINE_THREADS = cfg.combine_threads
    PRODUCT_THREADS = cfg.product_threads
    PRODUCT_TILES = cfg.product_tiles
    V4_ROWS = cfg.v4_rows
    V4_WIDTH = cfg.v4_width
    V5_TRANSPOSED_FORWARD = cfg.v5_transposed_forward
    bs = layout.block_size
    slots, indices, combine_indices = product_schedule(cfg, layout, transpose_w, max_segment, stream)
    acc = "float64" if a.dtype == "float64" else "float32"
    workspace = a.scratch((slots, n_rows, bs), acc, stream) if slots else _stand_in((1, 1, 1), acc)
    a_device, w_device = a.device(stream), w.device(stream)
    pre = None  # a launch before the product's (V5_TRANSPOSED_FORWARD's copy)
    family = product_family(cfg, version, bs, a.dtype, tiles_fit((a_device, w_device), n_rows, feature_axis))
    maps, makers = (), ()
    bias_kind = None if bias is None else bias.dtype
    bias_device = _stand_in((1,), "float32") if bias is None else bias.device(stream)
    fused = family == 7 and (bias is not None or relu)  # (version 7's epilogue and combining pass do it)
    if family == 7:
        cfg = v7_config(cfg, layout, transpose_w)
        cfg, maps, makers = _v7_maps(
            cfg, tma_maps(cfg, bs, False, a_device, w_device, n_rows, feature_axis, transpose_w, stream))
        TM, threads = v7_shape(cfg, bs)[0], v7_threads(cfg, bs)
        kernel = compiled(cfg, make_product_v7, bs, a.dtype, transpose_w, feature_axis, bias_kind, relu)
    elif family == 6:
        TM, threads = v6_shape(cfg, bs)[0], v6_threads(cfg, bs)
        kernel = compiled(cfg, make_product_v6, bs, a.dtype, transpose_w, feature_axis)
    elif family == 5:
        values = v5_values(a.dtype)
        vector = v5_vector_loads(cfg, (a_device, w_device), n_rows, feature_axis, values)
        ring = v5_ring(cfg, vector, feature_axis)
        threads, TM, _, _, _, _ = v5_shape(cfg, bs, a.dtype, ring)
        copied = ring and not transpose_w and n_rows >= V5_TRANSPOSED_FORWARD.get((bs, a.dtype), n_rows + 1)
        kernel = compiled(cfg, make_product_v5, bs, a.dtype, transpose_w or copied, feature_axis, vector)
        a_device, w_device = (words(a_device), words(w_device)) if vector or values == 1 \
            else (bits(a_device), bits(w_device))
        if copied:  # the transposed copy's blocks are in the forward's order: block j is wt[j]
            wt = w.scratch(tuple(w_device.shape), "int32", stream)  # (w_device: w's words)
            pre = launch_transpose_blocks(cfg, wt, w_device, layout, a.dtype, stream)
            w_device = wt
    elif family == 4:
        TM, threads = V4_ROWS[bs], v4_threads(cfg, bs)
        vector = vector_loads(cfg, (a_device, w_device), n_rows, feature_axis, (V4_WIDTH, v4_weight_width(cfg, bs)))
        kernel = compiled(cfg, make_product_v4, bs, a.dtype, transpose_w, feature_axis, vector)
    else:
        maker, threads, TM = make_product_v3, PRODUCT_THREADS, PRODUCT_TILES[bs][0]
        kernel = compiled(cfg, maker, bs, a.dtype, transpose_w, feature_axis)
    grid = ((n_rows + TM - 1) // TM, len(indices[0]))
    if family == 7 and persistent(cfg, bs, False, feature_axis):  # a thread block a multiprocessor walks the tiles
        grid = (min(grid[0] * grid[1], multiprocessors()), 1)
    operands = (a_device, w_device, bias_device) if family == 7 else (a_device, w_device)
    args = (out, workspace, *operands, *indices, n_rows, *maps)
    launch(kernel, grid, threads, stream, args)
    # the call's launches: what a kept plan repeats (the maps last, made from A's and B's addresses),
    # with the positions of out, [the workspace (lines cut into segments),] A, W [and the bias]
    main = (kernel, grid, threads, args, derived_maps(makers, len(args) - 2),
            (0,) + ((1,) if slots else ()) + (2, 3) + ((4,) if fused and bias is not None else ()))
    combine = None
    if slots:
        kernel = compiled(cfg, make_combine_lines, bs, a.dtype, feature_axis, bias_kind if fused else None,
                          relu and fused)
        grid = ((n_rows * bs + COMBINE_THREADS - 1) // COMBINE_THREADS, len(combine_indices[0]))
        combine_args = (out, workspace, bias_device, *combine_indices, n_rows)
        launch(kernel, grid, COMBINE_THREADS, stream, combine_args)
        combine = (kernel, grid, COMBINE_THREADS, combine_args, (), (0, 1, 2) if fused and bias is not None
                   else (0, 1))
    post = None if (bias is None and not relu) or fused else launch_add_bias(
        out, bias_device, a.dtype, bias_kind, n_rows, feature_axis, stream, relu)
    return pre, main, combine, post


def launch_add_bias(out, bias, storage, bias_kind, n_rows, feature_axis, stream, relu=False):
    """Launch `simt.make_add_bias` (out += bias along the features, ``bias_kind`` None: none;
    with ``relu`` then the max with 0); return the launch, as a plan keeps it (out and a bias
    live)."""
    kernel = cached(make_add_bias, storage, acc_type(storage), feature_axis, bias_kind, relu)
    bias = _stand_in((1,), "float32") if bias is None else bias
    features = out.shape[1 if feature_axis == 1 else 0]
    grid = max(1, min(-(-(n_rows * features) // ADD_BIAS_THREADS), 8 * multiprocessors()))
    args = (out, bias, n_rows, features)
    launch(kernel, grid, ADD_BIAS_THREADS, stream, args)
    return kernel, grid, ADD_BIAS_THREADS, args, (), (0, 1) if bias_kind is not None else (0,)


def tma_maps(cfg, bs, weight_grad, a, b, n_rows, feature_axis, transpose_w, stream):
    """The tensor maps (`runtime.tensormap`) a version 7 kernel's bulk copies read A and B by
    (``v7_tma``, warp-specialized kernels): boxes of 64 values along a stored row by 64 rows
    where the operand is MN-major, by the tile's rows where it is K-major (`hopper.make_split`);
    dims clip N at ``n_rows``. Returns (A's map, B's map) and how a kept plan makes them for
    other addresses (`runtime.launch.Replay`'s ``derived``, positions 0 and 1: A's, B's); () where
    the kernel copies by cp.async anyway (not warp-specialized); None where it must (``v7_tma``
    off, a shape the maps cannot take, or the maps kept are at their limit)."""
    if not producing(cfg, weight_grad, bs):
        return ()
    # (the maps' boxes are 128-byte-swizzled rows of 64 values; a paired tile's blocks of dy are a
    # box each (`hopper_wgrad`'s pair_boxes), a stacked tile's blocks of x are not boxes)
    if not cfg.v7_tma or bs < 64 or weight_grad == STACKED:
        return None
    BM, BN = v7_shape(cfg, bs, weight_grad)[:2]
    if weight_grad:  # x, dy: (N, features) with feature_axis 1, MN-major; (features, N), K-major
        specs = [(t, (t.shape[1], n_rows), (64, 64)) if feature_axis == 1 else (t, (n_rows, t.shape[0]), (64, bs))
                 for t in (a, b)]
    else:
        specs = [(a, (a.shape[1], n_rows), (64, BM)) if feature_axis == 1 else (a, (n_rows, a.shape[0]), (64, 64)),
                 (b, (bs, b.shape[0] * bs), (64, BN) if transpose_w else (64, 64))]  # W's blocks as rows
    maps, makers = [], []
    for i, (array, dims, box) in enumerate(specs):
        row_bytes = 2 * (bs if i == 1 and not weight_grad else array.shape[1])
        if min(dims) < 1 or map_check(data_pointer(array), 2, dims, row_bytes, box):
            return None
        found = tensor_map(data_pointer(array), 2, dims, row_bytes, box, stream)
        if found is None:
            return None
        maps.append(found)
        makers.append((i, _map_maker(dims, row_bytes, box)))
    return tuple(maps), tuple(makers)


def _map_maker(dims, row_bytes, box):
    """``pointer(address, stream handle)``: the device address of the map of these dims and box
    for a tensor at ``address`` (`runtime.tensormap.map_pointer`), or None. A kept plan runs on
    one device, and a map never moves: the addresses it has seen are kept (a few dozen), so that
    a replay's lookup is one dict's."""
    seen = {}

    def pointer(address, handle):
        found = seen.get(address)
        if found is None:
            found = map_pointer(address, 2, dims, row_bytes, box, stream_of(handle))
            if found is not None:
                if len(seen) >= 64:
                    seen.clear()
                seen[address] = found
        return found

    return pointer


def _v7_maps(cfg, found):
    """(config, the kernel's two map arguments, their makers) from `tma_maps`' answer ``found``."""
    if found is None:
        return _without_tma(cfg), (no_map(), no_map()), ()
    if not found:
        return cfg, (no_map(), no_map()), ()
    return (cfg, *found)


def derived_maps(makers, first):
    """A kept plan's ``derived`` (`runtime.launch.Replay`): the maps at argument positions
    ``first`` and ``first + 1``, made from the addresses of A and B (arguments 2 and 3)."""
    return tuple((first + i, 2 + i, maker) for i, maker in makers)


@functools.lru_cache(maxsize=16)
def _without_tma(cfg):
    return replace(cfg, v7_tma=False)


def v7_config(cfg, layout, transpose_w):
    """The config a version 7 product runs on: ``cfg``, or where its lines are short
    (``cfg.v7_short_lines``: the mean of the blocks each output line sums at most the rule's
    ``mean_blocks``) ``cfg`` with the rule's fields."""
    bs = layout.block_size
    lines = layout.shape[0] if transpose_w else layout.shape[1]
    if not short_lines_apply(cfg, bs) or layout.n_blocks > cfg.v7_short_lines[bs]["mean_blocks"] * lines:
        return cfg
    return _short_config(cfg, bs)


@functools.lru_cache(maxsize=16)
def _short_config(cfg, bs):
    return short_lines_config(cfg, bs)


def launch_transpose_blocks(cfg, wt, w_words, layout, storage, stream):
    """Launch `make_transpose_blocks` (w_words and wt: int32 word views); return the launch,
    or None where the layout has no block."""
    if not layout.n_blocks:
        return None
    kernel = compiled(cfg, make_transpose_blocks, layout.block_size, storage)
    args = (wt, w_words, _index(layout, "col_block", stream))
    threads = transpose_threads(cfg, layout.block_size, storage)
    launch(kernel, layout.n_blocks, threads, stream, args)
    return kernel, layout.n_blocks, threads, args


def wgrad_pairs(layout, width=2):
    """Version 7's paired weight-gradient tiles (``v7_wgrad_pairs``): int32 rows (block-row, the
    block-columns of b_0 .. b_{width-1}, then b_0 .. b_{width-1}), ``width`` blocks of one
    block-row each, in block order within the row; a row's last tile takes what is left (a slot
    no block fills: b -1, its column b_0's)."""
    coords = np.asarray(layout.coords, np.int64).reshape(-1, 2)
    rows = []
    for r in np.unique(coords[:, 0]):
        blocks = np.flatnonzero(coords[:, 0] == r)
        for i in range(0, len(blocks), width):
            tile = [int(b) for b in blocks[i:i + width]]
            tile += [-1] * (width - len(tile))
            rows.append((int(r), *(int(coords[b if b >= 0 else tile[0], 1]) for b in tile), *tile))
    return np.array(rows, np.int32).reshape(-1, 1 + 2 * width)


def paired_wgrad(layout, cfg, bs):
    """The rows of `wgrad_pairs` where version 7's weight gradient pairs blocks (``v7_wgrad_pairs``
    names ``bs``, and the pairs alone make ``v7_wgrad_pairs_fill`` thread blocks a multiprocessor:
    with fewer, cutting N to fill the GPU costs more than pairing saves); else None."""
    if bs not in cfg.v7_wgrad_pairs:
        return None
    width = pair_width(cfg, bs)
    key = ("wgrad_pairs", width)
    if key not in layout._schedules:
        layout._schedules[key] = wgrad_pairs(layout, width)
    pairs = layout._schedules[key]
    return pairs if len(pairs) >= cfg.v7_wgrad_pairs_fill * multiprocessors() else None


def wgrad_stacks(layout, n):
    """Version 7's stacked weight-gradient tiles (``v7_wgrad_stacks``): int32 rows (block-column,
    n block-rows, n blocks), n blocks of one block-column each, in block order within the column;
    a column's last tile padded with block -1 (its block-row the tile's first block's)."""
    coords = np.asarray(layout.coords, np.int64).reshape(-1, 2)
    rows = []
    for col in np.unique(coords[:, 1]):
        blocks = np.flatnonzero(coords[:, 1] == col)
        for i in range(0, len(blocks), n):
            tile = [int(b) for b in blocks[i:i + n]]
            pad = n - len(tile)
            rows.append((int(col), *(int(coords[b, 0]) for b in tile), *(int(coords[tile[0], 0]),) * pad,
                         *tile, *(-1,) * pad))
    return np.array(rows, np.int32).reshape(-1, 1 + 2 * n)


def stacked_wgrad(layout, cfg, bs):
    """The rows of `wgrad_stacks` where version 7's weight gradient stacks blocks
    (``v7_wgrad_stacks`` names ``bs``); else None."""
    n = cfg.v7_wgrad_stacks.get(bs)
    if n is None:
        return None
    key = ("wgrad_stacks", n)
    if key not in layout._schedules:
        layout._schedules[key] = wgrad_stacks(layout, n)
    return layout._schedules[key]


def wgrad_splits(layout, n_rows, thread_blocks=None, cfg=DEFAULT, fill=4):
    """How many slices of N the weight gradient cuts each block's sum into (every version but 1):
    enough for ``fill`` thread blocks a multiprocessor, each at least 4 chunks of rows long."""
    WGRAD_CHUNK = cfg.wgrad_chunk
    thread_blocks = layout.n_blocks if thread_blocks is None else thread_blocks
    wanted = -(-fill * multiprocessors() // max(1, thread_blocks))
    return int(max(1, min(wanted, n_rows // (4 * WGRAD_CHUNK))))


# The wave model's rates (an H200's, measured): a multiprocessor's wgmma rate on a weight
# gradient's stages, and the bandwidth the combining pass reads the splits' sums at
SM_FLOPS = 3.8e12
COMBINE_BYTES = 3.0e12


def wave_splits(thread_blocks, n_rows, stage_rows, stage_flops, resident, combine_bytes, overhead=4, most=16):
    """The N-split count (1 to ``most``) with the least modelled time. The ``thread_blocks`` x s
    thread blocks spread over the multiprocessors; the busiest holds ceil(thread_blocks s / its
    count) of them, whose stages (a split's, of ``stage_rows`` rows and ``stage_flops`` each, at
    `SM_FLOPS`) its tensor cores run one after another, and which pay ``overhead`` stages (the
    ring's fill, the epilogue) a round of ``resident`` thread blocks; with s > 1 the combining
    pass reads the splits' sums, ``combine_bytes`` a split (at `COMBINE_BYTES`). A fill
    (`wgrad_splits`) can leave the last round nearly empty: 51 blocks on 132 multiprocessors split
    three ways put two thread blocks of 22 stages on some, split two ways one of 32 on each."""
    sms = max(1, multiprocessors())
    stage = stage_flops / SM_FLOPS
    best, best_time = 1, None
    for s in range(1, max(1, min(most, n_rows // stage_rows)) + 1):
        stages = -(-(-(-n_rows // s)) // stage_rows)
        busiest = -(-thread_blocks * s // sms)
        time = (busiest * stages + -(-busiest // max(1, resident)) * overhead) * stage
        time += s * combine_bytes / COMBINE_BYTES if s > 1 else 0
        if best_time is None or time < best_time:
            best, best_time = s, time
    return best


def launch_weight_grad(cfg, dw, x, dy, layout, n_rows, feature_axis, beta, stream, version, splits, out_dtype=None,
                       db=None):
    """dW into ``dw`` (``out_dtype``: its dtype, x's by default; the kernels' epilogues store in it),
    and with ``db`` (a device array of the output features, and its dtype's name) the bias
    gradient, dy's sums over N, into it (`launch_column_sums`): version 7's warp-specialized
    weight gradients with bulk copies take each block-column's sums in one of its blocks' thread
    blocks, from the stages they copy."""
    COMBINE_THREADS = cfg.combine_threads
    V4_WGRAD_THREADS = cfg.v4_wgrad_threads
    V5_WARP_TILE = cfg.v5_warp_tile
    V5_WGRAD_GROUP = cfg.v5_wgrad_group
    V5_WGRAD_ROWS = cfg.v5_wgrad_rows
    WGRAD_ROWS = cfg.wgrad_rows
    WGRAD_THREADS = cfg.wgrad_threads
    bs = layout.block_size
    out = out_dtype or x.dtype
    if version == 1:
        kernel = compiled(cfg, make_weight_grad_v1, bs, x.dtype, feature_axis, out)
        launch(kernel, layout.n_blocks, (bs, WGRAD_ROWS[bs]), stream, (
            dw, x.device(stream), dy.device(stream), _index(layout, "coords", stream), n_rows, beta,
        ))
        if db is not None:
            launch_column_sums(db[0], db[1], dy, layout, n_rows, feature_axis, stream)
        return None  # (no plan)
    x_device, dy_device = x.device(stream), dy.device(stream)
    # (dw too: version 7 stores runs of 4 values, aligned to their 8 or 16 bytes)
    family = weight_grad_family(cfg, version, bs, x.dtype, feature_axis,
                                tiles_fit((x_device, dy_device), n_rows, feature_axis)
                                and aligned(data_pointer(dw), 4 * dw.dtype.itemsize, 1))
    v7, v6, v5, v4 = family == 7, family == 6, family == 5, family == 4
    group = V5_WGRAD_GROUP.get(bs, 1) if v5 and bs <= V5_WARP_TILE else 1
    coords = _index(layout, "coords", stream)
    if group > 1:  # a warp per row segment of up to `group` blocks
        segments = layout.line_segments("row", group)
        seg_begin, seg_end = (_on_device(layout, ("row", group, name), segments[name], stream)
                              for name in ("seg_begin", "seg_end"))
        thread_blocks = -(-len(segments["seg_begin"]) // v5_wgrad_warps(cfg, group))
    else:
        seg_begin = seg_end = coords  # (unread)
        if v6 or v7:
            per_block = 1
        elif v5:  # W blocks a thread block computes
            per_block = v5_wgrad_blocks(cfg, bs)
        else:
            per_block = V4_WGRAD_THREADS // (bs // 8) ** 2 if v4 else 1
        thread_blocks = -(-layout.n_blocks // per_block) * (v5_wgrad_spread(cfg, bs) if v5 else 1)
    pairs = paired_wgrad(layout, cfg, bs) if v7 and group == 1 else None
    stacks = stacked_wgrad(layout, cfg, bs) if v7 and group == 1 and pairs is None else None
    kind = True if pairs is None and stacks is None else PAIRED if stacks is None else STACKED
    if kind is not True:  # 2 or 4 blocks of a block-row, or a stack of a block-column's, a thread block
        n = pair_width(cfg, bs) if kind == PAIRED else cfg.v7_wgrad_stacks.get(bs)
        coords = _on_device(layout, ("wgrad", kind, n), pairs if stacks is None else stacks, stream)
        thread_blocks = coords.shape[0]
    fill = cfg.v7_wgrad_fill if v7 else 4
    if splits is not None:
        splits = max(1, int(splits))
    elif v7 and cfg.v7_wgrad_waves:
        BM, BN, _, _, BK, _ = v7_shape(cfg, bs, kind)
        splits = wave_splits(thread_blocks, n_rows, BK, 2 * BM * BN * BK, resident(cfg, bs, kind),
                             layout.n_blocks * bs * bs * 4)
    else:
        splits = wgrad_splits(layout, n_rows, thread_blocks, cfg, fill)
    rows_per_split = -(-max(n_rows, 1) // splits)
    maps, makers = (), ()
    if v7:
        cfg, maps, makers = _v7_maps(cfg, tma_maps(cfg, bs, kind, x_device, dy_device, n_rows, feature_axis, False,
                                                   stream))
    bulk = bool(makers)
    if v5 or v6 or v7:  # whole steps a split, so that feature_axis 0's 8-row vectors never straddle an end
        # (and bulk copies whole stages: their boxes stop at N only)
        step = cfg.v7_wgrad_k if bulk else V5_WGRAD_ROWS
        rows_per_split = -(-rows_per_split // step) * step
        splits = -(-max(n_rows, 1) // rows_per_split)
    acc = "float64" if x.dtype == "float64" else "float32"
    # A workspace of one split tells the kernel to finish in place (no combine pass).
    workspace = x.scratch((splits, layout.n_blocks, bs * bs), acc, stream) if splits > 1 \
        else _stand_in((1, 1, 1), acc)
    fused = None  # (the weight gradient's column sums, their summing flags a block), where it takes them
    if v7 and db is not None and bulk and kind is True and feature_axis == 1 and bs % 64 == 0 \
            and producing(cfg, kind, bs):
        fused = (x.scratch((SUM_PHASES * splits, layout.dense_shape[1]), "float32", stream),
                 _on_device(layout, "summing", first_of_columns(layout), stream))
    if v7:
        sums, summing = fused if fused is not None else (_stand_in((1, 1), "float32"), _stand_in((1,), "int32"))
        kernel = compiled(cfg, make_weight_grad_v7, bs, x.dtype, feature_axis, out,
                          *((kind,) if kind is not True or fused is not None else ()),
                          *((True,) if fused is not None else ()))
        threads = v7_threads(cfg, bs, kind)
        args = (dw, workspace, x_device, dy_device, coords, n_rows, rows_per_split, beta, sums, summing, *maps)
    elif v6:
        kernel = compiled(cfg, make_weight_grad_v6, bs, x.dtype, feature_axis, out)
        threads = v6_threads(cfg, bs, weight_grad=True)
        args = (dw, workspace, x_device, dy_device, coords, n_rows, rows_per_split, beta)
    elif v5:
        values = v5_values(x.dtype)
        vector = v5_vector_loads(cfg, (x_device, dy_device), n_rows, feature_axis, values)
        kernel = compiled(cfg, make_weight_grad_v5, bs, x.dtype, feature_axis, vector, group, out)
        x_device, dy_device = (words(x_device), words(dy_device)) if vector or values == 1 \
            else (bits(x_device), bits(dy_device))
        threads = 32 * v5_wgrad_warps(cfg, group)
        args = (dw, workspace, x_device, dy_device, coords, seg_begin, seg_end, n_rows, rows_per_split, beta)
    else:
        if v4:
            vector = vector_loads(cfg, (x_device, dy_device), n_rows, feature_axis)
            kernel = compiled(cfg, make_weight_grad_v4, bs, x.dtype, feature_axis, vector, out)
            threads = V4_WGRAD_THREADS
        else:
            kernel = compiled(cfg, make_weight_grad_v3, bs, x.dtype, feature_axis, out)
            threads = WGRAD_THREADS
        args = (dw, workspace, x_device, dy_device, coords, n_rows, rows_per_split, beta)
    main = (kernel, (thread_blocks, splits), threads, args, derived_maps(makers, len(args) - 2))
    launch(main[0], main[1], main[2], stream, main[3])
    sums = None  # the bias gradient's launches, as a kept plan repeats them (`launch_column_sums`)
    if db is not None:
        sums = (None if fused is None else tuple(fused[0].shape),
                *launch_column_sums(db[0], db[1], dy, layout, n_rows, feature_axis, stream, fused))
    if splits == 1:
        return main, None, None, sums
    combine = (compiled(cfg, make_combine_wgrad, bs, x.dtype, out),
               ((bs * bs + COMBINE_THREADS - 1) // COMBINE_THREADS, layout.n_blocks), COMBINE_THREADS,
               (dw, workspace, beta))
    launch(combine[0], combine[1], combine[2], stream, combine[3])
    return main, combine, (splits, layout.n_blocks, bs * bs), sums  # what a kept plan repeats


def first_of_columns(layout):
    """(n_blocks,) int32: 1 for each block-column's first block (in ``col_block`` order), else 0:
    the thread blocks of version 7's weight gradient that sum dy's block-columns."""
    flags = np.zeros(layout.n_blocks, np.int32)
    starts = layout.col_ptr[:-1][np.diff(layout.col_ptr) > 0]
    flags[layout.col_block[starts]] = 1
    return flags


def launch_column_sums(db, db_dtype, dy, layout, n_rows, feature_axis, stream, fused=None):
    """db (of dtype ``db_dtype``) = dy's sums over N, a value an output feature, each summed in
    fp32 (fp64 for fp64) in a fixed order: where ``fused`` (the weight gradient's sums, `SUM_PHASES`
    rows an N-split; its summing flags) holds a block-column's, from them; the other block-columns' (all,
    without ``fused``) by `simt.make_column_sums`, then `simt.make_finish_column_sums` adds each
    feature's parts in order. Returns what a kept plan repeats: the column-sum launch (parts, dy
    live) and its parts' shape, or both None; the finishing launch (db[, the fused sums][, the
    parts] live)."""
    bs = layout.block_size
    acc = "float64" if dy.dtype == "float64" else "float32"
    Kb = layout.shape[1]
    counts = np.diff(layout.col_ptr)
    columns = np.flatnonzero(counts == 0) if fused is not None else np.arange(Kb)
    flags = (counts > 0).astype(np.int32) if fused is not None else np.zeros(Kb, np.int32)
    n_parts = max(1, -(-n_rows // COLUMN_SUM_ROWS))
    column_launch = None
    if len(columns):
        parts = dy.scratch((n_parts, layout.dense_shape[1]), acc, stream)
        dy_device = dy.device(stream)
        pairs = (dy.dtype in ("float16", "bfloat16") and feature_axis == 1  # (two features a 32-bit word)
                 and aligned(data_pointer(dy_device), 4, 1))
        kernel = cached(make_column_sums, bs, dy.dtype, acc_type(dy.dtype), feature_axis, pairs)
        grid = (-(-len(columns) * (bs // 2 if pairs else bs) // COLUMN_SUM_THREADS), n_parts)
        args = (parts, words(dy_device) if pairs else dy_device,
                _on_device(layout, ("sum columns", fused is not None), columns.astype(np.int32), stream), n_rows,
                COLUMN_SUM_ROWS)
        launch(kernel, grid, COLUMN_SUM_THREADS, stream, args)
        column_launch = (kernel, grid, COLUMN_SUM_THREADS, args, ())
    else:
        parts = _stand_in((1, 1), acc)
    sums = fused[0] if fused is not None else _stand_in((1, 1), "float32")
    kernel = cached(make_finish_column_sums, bs, db_dtype, acc_type(dy.dtype))
    grid = -(-db.shape[0] // COLUMN_SUM_THREADS)
    args = (db, sums, sums.shape[0] if fused is not None else 0, parts, n_parts,
            _on_device(layout, ("fused columns", fused is not None), flags, stream))
    launch(kernel, grid, COLUMN_SUM_THREADS, stream, args)
    live = (0,) + ((1,) if fused is not None else ()) + ((3,) if column_launch is not None else ())
    return (column_launch, None if column_launch is None else (tuple(parts.shape), acc),
            (kernel, grid, COLUMN_SUM_THREADS, args, (), live))
