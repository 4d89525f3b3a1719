"""SBNet's activation-sparsity ops on the GPU (twin of `reference/sbnet.py`).

Block geometry as in the reference: block ``(n, bh, bw)`` is the window of
image ``n`` starting at row ``boffset_h + bh*bstride_h`` and column
``boffset_w + bw*bstride_w``, ``bsize`` large; reads outside the image give
zeros, writes there are dropped, and so are blocks whose ``n`` is out of range.

* `reduce_mask` pools a mask ``[N, H, W]`` over every window and lists the
  active ones in row-major order (the reference's). A NaN pixel makes its
  window's pool NaN, never above ``tol``: the window is inactive, for max and
  average pooling alike (`_nanmax.py`). Version 2 (the default)
  does it in one pass over a status word a chunk, zeroed once a stream or
  graph capture, not per call (`_statuses`), in one kernel
  (`_make_pass_kernel`): a thread block pools a chunk of consecutive windows
  (row-major, across rows and images), its threads along the chunk's
  columns (eight rows' loads in flight, 4 columns a vector load where the
  windows and the mask's pointer are aligned to it: `PASS_VECTOR`), ranks
  the chunk's active
  windows by a ballot, publishes their count and finds the count before it
  by a decoupled look-back (statuses read with ``ld.relaxed.gpu``, tagged
  with a launch count; a warp's, or where the chunks are many the whole
  block's over statuses a 128-byte line apart), then
  writes its rows: active windows at their ranks, inactive ones as n = -1
  rows from the back. Windows wider than PASS_COLUMNS take version 1: a
  pooling kernel (1 to 8 warps a window, shuffle reductions) that counts
  each chunk's active windows with an integer atomic add (the sums do not
  depend on the order), then a compaction by ballots and prefix sums (past
  PREFIX_CHUNKS chunks a scan kernel sums the counts first). Returns
  ``(indices, count)``: for a NumPy mask the ``[count, 3]`` int32 indices
  and an int; for a device mask an
  ``[N*bcount_h*bcount_w, 3]`` buffer of which the first ``count`` rows are
  valid (the rest hold n = -1, which every kernel skips), and ``count`` as a
  one-element int32 device array, so no host sync is forced. Pass that
  ``count`` on to `sparse_gather` / `sparse_scatter` to skip the rest.
* `sparse_gather`: NHWC ``x`` -> ``[n_blocks, bh, bw, C]``, or with
  ``transpose`` ``[n_blocks, C, bh, bw]`` through a shared-memory tile so that
  reads run along C and writes along the block's pixels. ``data_format="NCHW"``
  takes an NCHW ``x`` and gives the reverse layouts. Rows past the count come
  out as zeros (not left unwritten: garbage there would reach the weight
  gradients of convolutions run on the whole stack).
* `sparse_scatter`: a block stack back into (a copy of, or with ``inplace``)
  ``y``: overwrite, add, or atomic add; blocks in y's layout, or in the other
  with ``transpose``.
  Adding windows that can overlap (a stride smaller than the block) without
  ``atomic`` raises, and so do repeated indices given on the host. Where
  overwritten windows overlap, which block lands is unspecified. With
  ``inplace``, a ``y`` that shares memory with the blocks, the indices or the
  count raises (as a gather's ``out`` sharing x's, the indices' or the
  count's): threads would read what others had already written. Into a copy,
  channels-last blocks covering MERGE_MIN_COVER of the image or more go in one
  pass (version 2, `_make_merge_kernels`): the blocks' rows are linked into a
  map of the windows (`link_windows`), then each pixel of the copy is written
  once, y's value plus (or replaced by) the values of the windows over it,
  read through the map; version 1 copies y, then scatters into the copy.

Storage float16, float32, float64 (fp16 atomic adds: `_half2.py`). Channels-last
(NHWC) copies go a window row at a time in 16-byte vectors where a pixel is
whole vectors and the pointers are 16-byte aligned (`_make_row_kernels`:
plain, adds, fp16 adds two halves a word by `_half2.py`, fp32 and fp16
transposes through a shared tile of a run of the window's pixels);
otherwise element kernels, with 8-byte words for overwrites and int32 words
of two halves for fp16 adds where rows allow. Plain NCHW fp16 copies go two
halves a word where rows start on words, odd first columns included, or four
(int64 words) where widths are multiples of 4 (`_make_pair_kernels`; scatters
of quads and atomic adds a strip of windows side by side in each warp:
`PAIR_STRIPS`), and so do adding scatters of NHWC blocks into NCHW fp16
images (`_make_pair_tile_kernels`, two a word) and gathers of NHWC blocks
from them (`_make_pair_tile_gathers`). A call (gather, scatter, or
reduce_mask's launches) repeated with torch tensors of the same shapes,
dtypes, geometry, flags and alignment replays kept launches (`_plans`, as
bsmm's products).

The pair kernels, the pair tiles and their gathers index arrays by unsigned
values: Numba wraps a signed index round the array's end (a test and an add
every access; gather_matmul's loads, session 36).

Versions: reduce_mask 1 (pool, then compact) and 2 (one pass, the default;
benchmarks/NOTES.md has both measured); sparse_scatter into a copy 1 (copy,
then scatter) and 2 (merged in one pass where it applies: `MERGE`).
"""

import functools
import math

import numpy as np
from numba import cuda, float32, float64, from_dtype, int32, int64, uint32, uint64

from .. import _arrays as _arrays_module
from .._arrays import Operand, check_disjoint, check_dtype, check_same_kind, check_shape, launch_stream
from .._backend import SIMULATOR
from ..reference.sbnet import block_count, check_geometry, check_tol, pair
from ._half2 import add_half2, atomic_add_half, atomic_add_half2, floats_of_half2
from ._nanmax import max_nan, max_nan_select
from ._vector import aligned, load2, load4, load4_words, store2, store4
from ._launch import capture_of, data_pointer, launch, multiprocessors, replay, stream_handle, stream_of
from ._clock import globaltimer, smid
from ._relaxed import load_relaxed

# -- constants -----------------------------------------------------------------

FULL_MASK = 0xFFFFFFFF
WARP = 32
REDUCE_WARPS = 8  # warps of a pooling thread block (a literal: shared-array shapes are constants)
REDUCE_LOADS = 4  # mask values a lane loads before it pools any
REDUCE_FILL = 64  # warps a multiprocessor holds: pooling groups grow until windows x group fill them
COMPACT_THREADS = 256  # flags per thread block of the compaction
COMPACT_WARPS = COMPACT_THREADS // WARP  # a literal: shared-array shapes must be compile-time constants
PREFIX_CHUNKS = 4 * COMPACT_THREADS  # chunk counts a compaction block sums itself (4 a thread), else a scan
# reduce_mask version 2 (one pass): a thread block pools a chunk of up to PASS_WINDOWS consecutive
# windows (row-major, across window rows and images), PASS_THREADS threads over the chunk's
# columns (and rows, when its columns are fewer than the threads), then looks back for the
# active windows before it.
PASS_THREADS = 256
PASS_WARPS = PASS_THREADS // WARP  # a literal: shared-array shapes must be compile-time constants
PASS_WINDOWS = 2 * WARP  # windows a chunk: one thread each for the ballots that rank them (<= PASS_THREADS)
PASS_COLUMNS = 1024  # columns a chunk (a window's width, times its windows); wider windows: version 1
PASS_PIXELS = 8 * PASS_THREADS  # pixels a chunk takes at least: 8 loads a thread, or ...
# ... 16 where that still leaves a chunk for every other multiprocessor: fewer, larger chunks
# have fewer statuses to look back over (H100, graph µs, 8 x 400 x 700, windows of 8 / 16 / 32:
# 14.00 / 6.92 / 7.49 with 8 loads, 9.52 / 6.60 / 7.00 with 16; 1 x 400 x 700, windows of 16:
# 4.51 with 8 loads, 5.21 with 16 in 18 chunks; `results/sbnet_reduce_mask_h100.md`).
PASS_PIXELS_LARGE = 16 * PASS_THREADS
# ... and windows enough that the chunks fit in one wave of PASS_WAVE thread blocks a
# multiprocessor (0: no such rule), so no chunk's look-back waits on a later wave.
PASS_WAVE = 4
PASS_LOADS = 8  # rows a thread loads before it pools any (4, 8 or 16)
# Chunks even across the multiprocessors (None: as chosen above): "rounds" keeps the rounds of
# chunks a multiprocessor runs (chunks / multiprocessors, rounded up) and shrinks the chunks so
# that every round is full; "one round" takes a chunk a multiprocessor where such chunks fit in
# PASS_WINDOWS and PASS_COLUMNS, else as "rounds". Tried against 138 chunks of 64 windows on 132
# multiprocessors (6 of them with two): no faster without the look-back, slower with it (more
# statuses; H100, `results/sbnet_reduce_mask_h100.md`, session 19), so not the default.
PASS_BALANCE = None
# Chunks run on across window rows and images: every chunk but the last is full (8 x 400 x 700,
# windows of 16: 275 chunks of 32, where chunks within a window row were 400 of 32 and 12, more
# than the 396 thread blocks of a wave).
# A window of at most PASS_LANE_ENTRIES values in shared memory is pooled by one lane (no
# shuffles, no barrier before the ballot), larger ones by a warp (H100, graph µs, one lane against
# warps: 1 x 400 x 700 windows of 16 (8 entries) 5.54 / 7.07, 8 x 400 x 700 8.78 / 9.47; windows
# of 32 (32 entries) 6.67 / 6.45 and 9.69 / 9.42).
PASS_LANE_ENTRIES = 16
# Masks read PASS_VECTOR (1, 2 or 4) columns a load (4: 16 bytes of fp32 in one vector load)
# where every window's columns are whole aligned vectors (widths, strides, offsets and W
# multiples of it, the mask's pointer aligned): 4x fewer loads, 4x the bytes a load in flight.
PASS_VECTOR = 4
PASS_VECTOR_DTYPES = ("float32", "float16", "uint8", "bool")  # (bool read as its uint8 bytes)
PASS_MAX_REGISTERS = None  # a cap on the pass kernel's registers (ptxas, sm_90: 48-56 uncapped, 32-bit geometry)
# A developer's timeline (`scripts/reduce_mask_timeline.py`): with PASS_TRACE, thread 0 of each
# chunk stamps %globaltimer into the spare words of its status line (statuses then lie 16 words
# apart): TRACE_EVENTS in that order, then its multiprocessor (%smid). Off, the kernel is unchanged.
PASS_TRACE = False
# Max pooling's NaN-propagating max of float32 values: "ptx" (max.NaN.f32, one instruction, as
# plain max; sm_80 on) or "select" (compare and select, three); None: by the device.
PASS_NAN_MAX = None
TRACE_EVENTS = ("start", "pooled", "published", "looked back", "written")
# A chunk's status word (int64): tag (30 bits, the launch's), flag (1 bit: prefix or only the
# chunk's own aggregate), active count (32 bits). status[0] counts launches: a status is the
# current launch's when its tag is (that count + 1) mod 2^30, so a status buffer could serve
# call after call without a reset (1.3-1.9 µs a call saved: scripts/reduce_mask_variants.py);
# reduce_mask keeps one a stream (`_statuses`). Statuses lie `stride` words apart.
STATUS_TAG_SHIFT = 33
STATUS_PREFIX = 1 << 32
STATUS_TAG_MASK = (1 << 30) - 1
STATUS_VALUE_MASK = (1 << 32) - 1
# int64 words from one chunk's status to the next (None: as PASS_LOOK_BACK says; 1; 16: one a
# 128-byte line, so that reads and spins on one status do not queue behind the others').
STATUS_STRIDE = None
MAX_PASS_WINDOWS = 1 << 30  # windows version 2 takes (counts in 32 bits, int32 rows)
MAX_PASS_EXTENT = 1 << 30  # rows, columns and window reaches version 2 takes (32-bit geometry)
REDUCE_VERSION = 2  # reduce_mask's default version
# Who reads predecessors' statuses: "warp" (32 a step), "block" (PASS_THREADS a step), or None:
# the block where a launch has PASS_BLOCK_LOOK_BACK chunks or more, else a warp. A block's step
# reads PASS_THREADS statuses at once: packed 16 to a 128-byte line, every thread block's reads
# queue on the same few lines of L2, so the block look-back spreads them a line apart (STATUS_STRIDE
# None: 16 words where that keeps the statuses within STATUS_SPREAD_WORDS, else 1). H100, the
# pass kernel alone, µs, warp / block a line apart: 8 x 400 x 700, windows of 16 / 32 / 8: 6.05 /
# 5.53, 6.41 / 6.00, 8.60 / 8.45; 1 x 400 x 700: 4.46 / 4.29, 4.64 / 4.46, 4.11 / 3.80. Graph µs a
# call the same but for 1 x 400 x 700 windows of 16 (35 chunks), where the block was 0.3-0.4
# slower. Statuses a line apart made the warp's look-back no faster; packed, the block's was
# slower than the warp's (session 15); a warp reading 128 a step (four loads a lane in flight) was
# slower too: 8.78 against 6.86 µs on 8 x 400 x 700, windows of 16.
PASS_LOOK_BACK = None
PASS_BLOCK_LOOK_BACK = 64
STATUS_SPREAD_WORDS = 1 << 20  # (8 MB: 65535 chunks a line apart)
COPY_THREADS = 256  # threads of a gather/scatter block (one thread block a window)
COPY_UNROLL = 4  # elements a thread loads before it stores any
WAVES = 4  # thread blocks per multiprocessor a gather/scatter aims for
TILE = 32  # transposing gather/scatter: 32 pixels x 32 channels through shared memory
TILE_ROWS = 8  # ... by 32 x 8 threads
TILE_SHAPE = (TILE, TILE + 1)  # +1 column: reading a column hits 32 distinct banks
TILE_STEPS = TILE // TILE_ROWS  # tile rows each thread moves (a literal: local-array shapes are constants)
ROW_UNROLL = 4  # 16-byte vectors a thread of a row copy loads before it stores any
ROW_THREADS = 256  # most threads of a plain row copy (fewer for short rows)
ROW_TILE_C = 64  # channels of a transposing row copy's tile ...
# ... by this many pixels of the window, its rows read as one run (a channel's run of the block:
# whole 128-byte lines and more on the block's side, every tile full but a window's last).
# Session 17 (tiles of whole rows), H100, copy bandwidth / ours (graph), 16 / 32 / 64
# (`results/sbnet_row_tile_pixels_h100.md`): 8 x 400 x 700 x 64, windows of 16, 50 %: gather
# 0.65 / 0.90 / 0.94, scatter 0.75 / 0.89 / 0.94; but 1 x 400 x 700 x 64, 5 %: gather 0.61 /
# 0.61 / 0.49 (fewer, longer thread blocks).
ROW_TILE_PIXELS = 32
# ... or this many for fp32 copies of overlapping windows (SparseResBlock's NCHW gathers of 18,
# every 16): session 18, H100, window order, 1 x 400 x 700 x 256 at 10 / 25 / 50 %, graph µs,
# 32 / 64: 198.7 / 171.5, 289.6 / 247.9, 318.1 / 273.1; fp16 and windows that do not overlap do
# as well or better with 32 (small images 5-18 % better: more thread blocks).
ROW_TILE_PIXELS_WIDE = 64
# The tile is moved by this many threads. Session 8 (tiles of 16 or 32 pixels of one row), H100,
# copy bandwidth / ours (graph), 64 / 128 / 256 threads (`scripts/sbnet_variants.py`): 1 x 400
# x 700 x 256, windows of 16, 5 %, gather 0.71 / 0.63 / 0.53, scatter 0.64 / 0.60 / 0.50; 8 x 400
# x 700 x 256, 10 %, scatter 0.76 / 0.74 / 0.69; but adding windows of 32: 0.66 / 0.76 / 0.80
# (1 x 400 x 700 x 64, 10 %).
ROW_TILE_THREADS = 128
# A transposing row copy's thread blocks go window by window (every tile of window 0, then of
# window 1, ...) where windows overlap or the data are fp32, else tile by tile (tile 0 of every
# window, then tile 1, ...; `_tiles`). Session 18, H100, graph µs, tile / window order
# (`results/sbnet_row_tile_order_h100.md`): gathers of 18 every 16, 1 x 400 x 700 x 256, 25 %:
# fp16 287.0 / 149.8, fp32 394.3 / 289.6; 8 x 400 x 700 x 64, windows of 16, 50 %, fp32 gather
# 211.7 / 197.5; but fp16, 1 x 400 x 700 x 256, windows of 16, 25 %: gather 33.4 / 35.4, adding
# scatter 50.6 / 53.6.
ROW_TILE_WINDOW_MAJOR = None  # None: that rule; True or False: always or never (timings)
# A scatter into a copy of y (not ``inplace``) of blocks in y's channels-last layout goes in one
# pass where it can (`_make_merge_kernels`): every pixel of the copy is written once, y's value
# plus (or overwritten by) those of the windows over it, found through a map of the windows
# (version 2). False: y copied, then the blocks scattered into the copy (version 1: the copy
# and the windows' read-modify-writes, ~1.5-2x the bytes at half the windows active).
MERGE = True
# ... where the blocks' pixels are at least this fraction of the image's (rows given, not the
# count's): below it the pass reads and writes as many bytes as the copy, and its two launches
# (link, merge) and map cost more host time than the copy's one and the scatter's (H100, fp16
# block training step with graphs at 5-10 % of windows, eager: 0.94-0.97 ms copying, 1.03-1.10
# merging; at 50 %: 1.32 copying, 1.22 merging; `benchmarks/NOTES.md`, session 23).
MERGE_MIN_COVER = 0.15
MERGE_THREADS = 256  # most threads of a merging thread block
MERGE_UNROLL = 4  # 16-byte vectors a merging thread loads before it stores any
MERGE_VECTORS = MERGE_THREADS * MERGE_UNROLL  # vectors of a thread block's run of a row (whole pixels, >= 1)
MERGE_SPAN = MERGE_VECTORS + 2  # windows such a run reaches along the row at most (a stride of 1)
CHAINED = 1 << 30  # a window map entry's flag: more blocks of the same window follow in the chain
LINK_THREADS = 256  # threads of a thread block linking the blocks into the map ...
# ... or, where the map and the rows are at most LINK_ALONE each, of the one thread block that
# also empties the map first (a launch fewer: the eager block is bound by its launches).
LINK_ALONE = 16384
LINK_ALONE_THREADS = 1024
MAX_GRID_YZ = 65535  # CUDA's limit on a grid's y and z
MAX_GRID_X = 2**31 - 1
MASK_DTYPES = ("bool", "uint8", "float16", "float32", "float64")
DATA_DTYPES = ("float16", "float32", "float64")

# -- kernel bodies: reduce_mask ----------------------------------------------------


@cuda.jit(device=True, inline=True)
def _mask_value(mask, n, h, w, height, width, empty):
    """mask[n, h, w] as float64, or `empty` off the image."""
    if 0 <= h < height and 0 <= w < width:
        return float64(mask[n, h, w])
    return empty


@cuda.jit(device=True, inline=True)
def _pool(acc, v, avgpool):
    # (NaN-propagating, as the reference's numpy max: on a GPU plain max drops a NaN, and the
    # simulator's Python max keeps one only in first place, so a window's flag hung on where in
    # it, and in which lane of a vector, its NaN pixel lay)
    return acc + v if avgpool else max_nan_select(acc, v)


@cuda.jit(device=True, inline=True)
def _next_pixel(r, c, step_r, step_c, size_w):
    """The pixel `step_r * size_w + step_c` further on in the window (step_c < size_w)."""
    r += step_r
    c += step_c
    if c >= size_w:
        c -= size_w
        r += 1
    return r, c


@cuda.jit(device=True, inline=True)
def _flag(flags, chunk_counts, window, pooled, tol, avgpool, pixels):
    """The window's flag from its pooled value (a sum with avgpool), counted in its chunk."""
    if avgpool:
        pooled /= pixels
    active = pooled > tol
    flags[window] = 1 if active else 0
    if active:
        cuda.atomic.add(chunk_counts, window // COMPACT_THREADS, 1)


@cuda.jit
def pool_kernel(flags, chunk_counts, mask, n_images, height, width, count_h, count_w,
                size_h, size_w, stride_h, stride_w, offset_h, offset_w, tol, avgpool, group_warps):
    """flags[window] = 1 where the pooled mask exceeds tol, and chunk_counts[window //
    COMPACT_THREADS] counts them (zeroed before; an integer atomic add, so the sums do not
    depend on the order). A thread block pools REDUCE_WARPS // group_warps windows,
    group_warps warps a window, REDUCE_LOADS loads a lane in flight."""
    tid = cuda.threadIdx.x
    warp = tid // WARP
    lane = tid % WARP
    per_block = REDUCE_WARPS // group_warps
    total = n_images * count_h * count_w
    partial = cuda.shared.array(REDUCE_WARPS, np.float64)
    slot = warp // group_warps
    window = cuda.blockIdx.x * per_block + slot
    # float64 sums so the avg test agrees with the float64 reference
    empty = float64(0) if avgpool else float64(-math.inf)
    acc = empty
    if window < total:  # the same for every lane of a warp
        n = window // (count_h * count_w)
        rest = window - n * count_h * count_w
        bh = rest // count_w
        h0 = offset_h + bh * stride_h
        w0 = offset_w + (rest - bh * count_w) * stride_w
        # Pixel p = t + T·k of the window (t: the thread's place in its group of T), stepped
        # without a division a pixel; REDUCE_LOADS loads issued before any is used.
        threads = group_warps * WARP
        t = tid - slot * threads
        step_r = threads // size_w
        step_c = threads - step_r * size_w
        r = t // size_w
        c = t - r * size_w
        while r < size_h:
            r1, c1 = _next_pixel(r, c, step_r, step_c, size_w)
            r2, c2 = _next_pixel(r1, c1, step_r, step_c, size_w)
            r3, c3 = _next_pixel(r2, c2, step_r, step_c, size_w)
            v0 = _mask_value(mask, n, h0 + r, w0 + c, height, width, empty)
            v1 = _mask_value(mask, n, h0 + r1, w0 + c1, height, width, empty) if r1 < size_h else empty
            v2 = _mask_value(mask, n, h0 + r2, w0 + c2, height, width, empty) if r2 < size_h else empty
            v3 = _mask_value(mask, n, h0 + r3, w0 + c3, height, width, empty) if r3 < size_h else empty
            acc = _pool(_pool(acc, v0, avgpool), _pool(v1, _pool(v2, v3, avgpool), avgpool), avgpool)
            r, c = _next_pixel(r3, c3, step_r, step_c, size_w)
    offset = 16
    while offset > 0:
        acc = _pool(acc, cuda.shfl_xor_sync(FULL_MASK, acc, offset), avgpool)
        offset //= 2
    if lane == 0:
        partial[warp] = acc
    cuda.syncthreads()  # every warp's pooled value is in partial
    window = cuda.blockIdx.x * per_block + tid
    if tid < per_block and window < total:
        pooled = partial[tid * group_warps]
        for k in range(1, group_warps):
            pooled = _pool(pooled, partial[tid * group_warps + k], avgpool)
        _flag(flags, chunk_counts, window, pooled, tol, avgpool, size_h * size_w)


@cuda.jit(device=True, inline=True)
def _warp_counts_and_offset(ballot, warp_counts):
    """Store this warp's popcount; after the barrier, the count of the warps before it."""
    lane = cuda.threadIdx.x % WARP
    warp = cuda.threadIdx.x // WARP
    if lane == 0:
        warp_counts[warp] = cuda.popc(ballot)
    cuda.syncthreads()  # every warp's count is in warp_counts
    before = 0
    for k in range(warp):
        before += warp_counts[k]
    return before


@cuda.jit(device=True, inline=True)
def _block_sum(value, partial):
    """The sum of value over the thread block, for every thread (partial: COMPACT_WARPS ints)."""
    offset = 16
    while offset > 0:
        value += cuda.shfl_xor_sync(FULL_MASK, value, offset)
        offset //= 2
    if cuda.threadIdx.x % WARP == 0:
        partial[cuda.threadIdx.x // WARP] = value
    cuda.syncthreads()  # every warp's sum is in partial
    total = 0
    for k in range(COMPACT_WARPS):
        total += partial[k]
    cuda.syncthreads()  # partial is read before a later call overwrites it
    return total


@cuda.jit
def scan_kernel(block_offsets, count, block_counts, n_blocks):
    """Exclusive prefix sum of block_counts by one warp (shuffle scans of 32 at a time): for more
    than PREFIX_CHUNKS chunks."""
    lane = cuda.threadIdx.x
    carry = 0
    for base in range(0, n_blocks, WARP):
        i = base + lane
        value = block_counts[i] if i < n_blocks else 0
        inclusive = value
        offset = 1
        while offset < WARP:
            up = cuda.shfl_up_sync(FULL_MASK, inclusive, offset)
            if lane >= offset:
                inclusive += up
            offset *= 2
        if i < n_blocks:
            block_offsets[i] = carry + inclusive - value
        carry += cuda.shfl_sync(FULL_MASK, inclusive, WARP - 1)
    if lane == 0:
        count[0] = carry


def _make_write_kernel(summed):
    """The compaction: each active flag's (n, bh, bw) at its row-major rank (chunk offset +
    warps before + lanes before), and n = -1 in rows from the active count on. The chunk's
    offset and the count come from chunk_counts (the block sums them: `summed`), or from the
    scan kernel's block_offsets and count."""

    @cuda.jit
    def write_kernel(indices, count, flags, chunk_counts, block_offsets, total, count_h, count_w):
        chunk = cuda.blockIdx.x
        tid = cuda.threadIdx.x
        i = chunk * COMPACT_THREADS + tid
        warp_counts = cuda.shared.array(COMPACT_WARPS, np.int32)
        if summed:
            n_chunks = chunk_counts.shape[0]
            earlier = 0
            everything = 0
            for k in range(tid, n_chunks, COMPACT_THREADS):
                c = chunk_counts[k]
                everything += c
                if k < chunk:
                    earlier += c
            offset = _block_sum(earlier, warp_counts)
            n_active = _block_sum(everything, warp_counts)
            if chunk == 0 and tid == 0:
                count[0] = n_active
        else:
            offset = block_offsets[chunk]
            n_active = count[0]
        active = i < total and flags[min(i, total - 1)] != 0
        ballot = cuda.ballot_sync(FULL_MASK, active)
        before = _warp_counts_and_offset(ballot, warp_counts)
        if active:
            rank = offset + before + cuda.popc(ballot & cuda.lanemask_lt())
            n = i // (count_h * count_w)
            rest = i - n * count_h * count_w
            indices[rank, 0] = n
            indices[rank, 1] = rest // count_w
            indices[rank, 2] = rest % count_w
        if n_active <= i < total:  # this chunk's share of the rows past the count
            indices[i, 0] = -1
            indices[i, 1] = -1
            indices[i, 2] = -1

    return write_kernel


write_summed = _make_write_kernel(True)
write_scanned = _make_write_kernel(False)


@cuda.jit(device=True, inline=True)
def _warp_sum(value):
    """The sum of value over the warp, for every lane."""
    offset = 16
    while offset > 0:
        value += cuda.shfl_xor_sync(FULL_MASK, value, offset)
        offset //= 2
    return value


@cuda.jit(device=True, inline=True)
def _status(status, j, tag, stride):
    """Chunk j's status (word (1 + j) x stride) once it carries this launch's tag (a prefix of
    nothing before chunk 0).
    Chunks are thread blocks in launch order, and the GPU starts thread blocks in that order
    (as CUB's single-pass scans assume), so a predecessor runs or has run: the wait ends."""
    if j < 0:
        return int64(STATUS_PREFIX)
    at = uint64(1 + j) * uint64(stride)
    s = load_relaxed(status, (at,))  # from L2: never a value cached earlier
    while (s >> STATUS_TAG_SHIFT) != tag:
        s = load_relaxed(status, (at,))
    return s


@cuda.jit(device=True, inline=True)
def _look_back(status, chunk, tag, lane, stride):
    """Active windows of the chunks before `chunk` (decoupled look-back by one whole warp): 32
    predecessors' statuses a step, nearest first, summed back to the nearest one whose
    inclusive prefix is out."""
    exclusive = int64(0)
    end = chunk
    while end > 0:  # the same for every lane
        s = _status(status, end - 1 - lane, tag, stride)
        prefixed = cuda.ballot_sync(FULL_MASK, (s & STATUS_PREFIX) != 0)
        contribution = s & STATUS_VALUE_MASK
        if prefixed != 0:
            nearest = prefixed ^ (prefixed - 1)  # lanes up to the nearest prefix
            if (nearest >> lane) & 1 == 0:
                contribution = 0
            end = 0
        else:
            end -= WARP
        exclusive += _warp_sum(contribution)
    return exclusive


@cuda.jit(device=True, inline=True)
def _look_back_block(status, chunk, tag, nearest_s, sums_s, stride):
    """`_look_back` by the whole thread block, PASS_THREADS predecessors a step (nearest_s,
    sums_s: PASS_WARPS-long shared scratch). Every thread gets the sum."""
    tid = cuda.threadIdx.x
    lane = tid % WARP
    warp = tid // WARP
    exclusive = int64(0)
    end = chunk
    while end > 0:  # the same for every thread
        s = _status(status, end - 1 - tid, tag, stride)
        prefixed = cuda.ballot_sync(FULL_MASK, (s & STATUS_PREFIX) != 0)
        if lane == 0:
            lowest = prefixed & -prefixed  # the warp's nearest prefix, as a bit
            nearest_s[warp] = warp * WARP + 31 - cuda.clz(int32(lowest)) if prefixed != 0 else PASS_THREADS
        cuda.syncthreads()  # every warp's nearest prefix is in nearest_s
        nearest = PASS_THREADS
        for k in range(PASS_WARPS):
            nearest = min(nearest, nearest_s[k])
        contribution = _warp_sum(s & STATUS_VALUE_MASK if tid <= nearest else int64(0))
        if lane == 0:
            sums_s[warp] = contribution
        cuda.syncthreads()  # every warp's sum is in sums_s
        for k in range(PASS_WARPS):
            exclusive += sums_s[k]
        end = 0 if nearest < PASS_THREADS else end - PASS_THREADS
        cuda.syncthreads()  # nearest_s and sums_s are read before the next step overwrites them
    return exclusive


@cuda.jit(device=True, inline=True)
def _quotient(x, magic):
    """x // d for 0 <= x < 2^31, `magic` = _magic(d): a multiply and a shift where a division by
    a value known only at run time is ~15 dependent instructions."""
    m = uint64(magic) & uint64(0xFFFFFFFF)
    return int32((uint64(x) * m) >> (uint64(magic) >> uint64(32)))


@cuda.jit(device=True, inline=True)
def _window(window, count_h, count_w, magic_h, magic_w):
    """(n, bh, bw) of a row-major window number (windows < 2^30; magic_h, magic_w: _magic of the
    counts)."""
    row = _quotient(window, magic_w)
    n = _quotient(row, magic_h)
    return n, int32(row - n * count_h), int32(window - row * count_w)


def _make_pass_kernel(avgpool, wide, vector, look_back, stride, nan_max_ptx=False):
    """reduce_mask in one pass (version 2): pooling, ranks and compaction in one kernel.

    Thread block `chunk` takes `windows` (<= PASS_WINDOWS) consecutive windows, row-major
    across window rows and images. Its threads walk the chunk's columns (windows x size_w of
    them, at most PASS_COLUMNS; with overlapping windows a column is read once per window; with `vector` > 1, a "column"
    is that many adjacent ones, read by one vector load and pooled) and, when the columns are fewer
    than the threads, split the rows into `phases`: each thread pools one column over its rows
    on the image (rows off it are skipped), PASS_LOADS loads in flight without a test, then
    the rest four at a time (rows past the last read it and are dropped by a select), and
    leaves the value in shared memory, a window's entries together. Thread j then pools
    window j's entries (or, past PASS_LANE_ENTRIES of them, each warp pools whole windows,
    lanes over entries, shuffles), the warps holding windows rank the active ones by ballots
    (counts summed through shared memory where the chunk has more than a warp's 32), thread 0
    publishes their count, warp 0 finds the count before the chunk by `_look_back` (or, with
    `look_back` "block", the whole block by `_look_back_block`; statuses `stride` words apart), and each
    window's thread writes its row: (n, bh, bw) at its row-major rank if active,
    else n = -1 from the back (rows count.. hold those). The last chunk writes the count and
    advances status[0], the launch count the tags come from. Accumulates in float64 with
    `wide` (sums, float64 masks), else float32 (exact for the max of other masks), its max NaN
    where a value is (`nan_max_ptx`: by max.NaN.f32, else `max_nan_select`). Geometry is 32-bit and
    divisions go by the launcher's magic numbers (`_quotient`); the mask comes flat."""
    acc_type = float64 if wide else float32
    RANKERS = -(-PASS_WINDOWS // WARP)  # warps whose ballots rank a chunk's windows
    assert PASS_WINDOWS <= PASS_THREADS
    LOADS = PASS_LOADS
    BLOCK_LOOK_BACK = look_back == "block"
    STRIDE = stride
    VECTOR = vector
    TRACE = PASS_TRACE
    assert not TRACE or STRIDE > len(TRACE_EVENTS) + 1
    # Shared entries of a chunk's column values: its windows x (entries a window + 1 of
    # padding), at most max(threads, columns) + windows (phases x columns <= threads).
    SHARED = max(PASS_THREADS, PASS_COLUMNS) + PASS_WINDOWS

    nan_max = max_nan if nan_max_ptx and not wide else max_nan_select

    @cuda.jit(device=True, inline=True)
    def pool(acc, v):
        return acc + v if avgpool else nan_max(acc, v)

    # The mask comes flat: a pixel is one int64 element index, a column's next row `width` on
    # (3-D indices were three 64-bit products a load, with strides read from the array).
    @cuda.jit(device=True, inline=True)
    def row(mask, at):
        if VECTOR == 4:
            a, b, c, d = load4(mask, (uint64(at),))
            return pool(pool(acc_type(a), acc_type(b)), pool(acc_type(c), acc_type(d)))
        if VECTOR == 2:
            a, b = load2(mask, (uint64(at),))
            return pool(acc_type(a), acc_type(b))
        return acc_type(mask[uint64(at)])

    @cuda.jit(device=True, inline=True)
    def four_rows(mask, at, step):
        """The pixels at, at + step, at + 2 step, at + 3 step (all on the image), pooled."""
        return pool(pool(row(mask, at), row(mask, at + step)), pool(row(mask, at + 2 * step), row(mask, at + 3 * step)))

    @cuda.jit(device=True, inline=True)
    def last_rows(mask, top, width, r, step, r_end, empty):
        """Rows r, r + step, r + 2 step, r + 3 step of the column whose row 0 is at `top`, pooled:
        those at r_end or past it read the row before r_end (so that every load is valid) and give
        empty."""
        last = r_end - 1
        v0 = row(mask, top + min(r, last) * width)
        v1 = row(mask, top + min(r + step, last) * width)
        v2 = row(mask, top + min(r + 2 * step, last) * width)
        v3 = row(mask, top + min(r + 3 * step, last) * width)
        return pool(pool(v0 if r < r_end else empty, v1 if r + step < r_end else empty),
                    pool(v2 if r + 2 * step < r_end else empty, v3 if r + 3 * step < r_end else empty))

    @cuda.jit(device=True, inline=True)
    def stamp(status, chunk, event):
        """PASS_TRACE's stamp of TRACE_EVENTS[event] (len(TRACE_EVENTS): the multiprocessor)."""
        if TRACE:
            value = int64(smid()) if event == len(TRACE_EVENTS) else int64(globaltimer())
            status[uint64(1 + chunk) * uint64(STRIDE) + uint64(1 + event)] = value

    @cuda.jit(**({} if PASS_MAX_REGISTERS is None else {"max_registers": PASS_MAX_REGISTERS}))
    def pass_kernel(indices, count, status, mask, n_images, height, width, count_h, count_w,
                    size_h, size_w, stride_h, stride_w, offset_h, offset_w, tol, per_chunk, lanes, phases,
                    magic_h, magic_w, magic_units, magic_lanes):
        # lanes x phases: threads across a full chunk's columns x across its rows (the launcher's,
        # as are the magic numbers of the divisions: a division by a value known only at run time
        # is a chain of dependent instructions before the first load).
        tid = cuda.threadIdx.x
        lane = tid % WARP
        warp = tid // WARP
        chunk = cuda.blockIdx.x
        n_chunks = cuda.gridDim.x
        values = cuda.shared.array(SHARED, acc_type)
        active_s = cuda.shared.array(PASS_WINDOWS, np.int32)
        tag_s = cuda.shared.array(1, np.int64)
        nearest_s = cuda.shared.array(PASS_WARPS, np.int32)
        sums_s = cuda.shared.array(PASS_WARPS, np.int64)
        counts_s = cuda.shared.array(PASS_WARPS, np.int32)
        exclusive_s = cuda.shared.array(1, np.int64)
        if tid == 0:  # the launch count's read is on its way while the chunk is pooled
            stamp(status, chunk, 0)
            stamp(status, chunk, len(TRACE_EVENTS))
            tag_s[0] = (load_relaxed(status, (uint64(0),)) + 1) & STATUS_TAG_MASK
        # Geometry in 32 bits (the launcher's bounds: below 2^30), so that the index arithmetic
        # before the first load is 32-bit (int64 arguments made it 64-bit products: ~140 of the
        # ~290 instructions a thread ran before its first load); only pixel indices are 64-bit.
        height32, width32, size_h32 = int32(height), int32(width), int32(size_h)
        count_h32, count_w32 = int32(count_h), int32(count_w)
        total = n_images * count_h * count_w
        first = int32(chunk * int32(per_chunk))  # the chunk's first window, row-major
        windows = int32(min(per_chunk, total - first))  # (fewer in the last chunk: its threads past them idle)
        units = int32(size_w // VECTOR)  # a window's columns, a vector each (a multiple: the launcher's check)
        columns = int32(windows * units)
        entries = int32(int32(phases) * units)  # values a window leaves in shared memory
        empty = acc_type(0) if avgpool else acc_type(-math.inf)
        phase = _quotient(tid, magic_lanes)
        q = int32(tid - phase * int32(lanes))
        step = int64(phases) * width  # from a thread's row to its next
        if phase < phases:
            while q < columns:
                j = _quotient(q, magic_units)
                c = int32(q - j * units)
                n, bh, bw = _window(first + j, count_h32, count_w32, magic_h, magic_w)
                h0 = int32(int32(offset_h) + bh * int32(stride_h))
                r_begin = int32(max(0, -h0))  # the window's rows on the image
                r_end = int32(min(size_h32, height32 - h0))
                w = int32(int32(offset_w) + bw * int32(stride_w) + c * VECTOR)
                acc = empty
                if 0 <= w < width32:  # (a vector's first column and width are multiples of VECTOR)
                    # Only the window's rows on the image, r_begin <= r < r_end, are read: the
                    # others would give `empty`. This thread's first is the first of its phase.
                    r = phase
                    if r < r_begin:  # (only windows over the top edge)
                        r += int32(uint32(r_begin - phase + phases - 1) // uint32(phases)) * phases
                    top = (int64(n) * height + h0) * width + w  # (row 0 may be off the image)
                    while r + (LOADS - 1) * phases < r_end:  # LOADS loads in flight, none tested
                        at = top + r * width
                        if LOADS == 16:
                            acc = pool(acc, pool(pool(four_rows(mask, at, step), four_rows(mask, at + 4 * step, step)),
                                                 pool(four_rows(mask, at + 8 * step, step),
                                                      four_rows(mask, at + 12 * step, step))))
                        elif LOADS == 8:
                            acc = pool(acc, pool(four_rows(mask, at, step), four_rows(mask, at + 4 * step, step)))
                        else:
                            acc = pool(acc, four_rows(mask, at, step))
                        r += LOADS * phases
                    while r < r_end:  # the rest, four loads at a time
                        acc = pool(acc, last_rows(mask, top, width, r, phases, r_end, empty))
                        r += 4 * phases
                values[j * (entries + 1) + phase * units + c] = acc
                q += lanes
        cuda.syncthreads()  # every column's value (and the tag) is in shared memory
        if tid == 0:
            stamp(status, chunk, 1)
        # A window's flag: with few entries, lane j of warp 0 pools window j's alone (four loads
        # in flight; the padded pitch puts the lanes' reads in distinct banks), no barrier after;
        # else warps pool whole windows, lanes over the entries, and leave flags in active_s.
        active = False
        if entries <= PASS_LANE_ENTRIES:  # (the same for the whole block)
            if tid < windows:
                base = tid * (entries + 1)
                a0, a1, a2, a3 = empty, empty, empty, empty
                e = 0
                while e + 4 <= entries:
                    a0 = pool(a0, values[base + e])
                    a1 = pool(a1, values[base + e + 1])
                    a2 = pool(a2, values[base + e + 2])
                    a3 = pool(a3, values[base + e + 3])
                    e += 4
                while e < entries:
                    a0 = pool(a0, values[base + e])
                    e += 1
                acc = pool(pool(a0, a1), pool(a2, a3))
                active = (float64(acc) / (size_h * size_w) if avgpool else float64(acc)) > tol
        else:
            j = warp
            while j < windows:  # the same for every lane: warps pool whole windows
                acc = empty
                e = lane
                while e < entries:
                    acc = pool(acc, values[j * (entries + 1) + e])
                    e += WARP
                offset = 16
                while offset > 0:
                    acc = pool(acc, cuda.shfl_xor_sync(FULL_MASK, acc, offset))
                    offset //= 2
                if lane == 0:
                    pooled = float64(acc) / (size_h * size_w) if avgpool else float64(acc)
                    active_s[j] = 1 if pooled > tol else 0
                j += PASS_WARPS
            cuda.syncthreads()  # every window's flag is in active_s
            active = tid < windows and active_s[tid] != 0
        tag = tag_s[0]
        ballot = cuda.ballot_sync(FULL_MASK, active)  # (thread t's window is first + t)
        aggregate = int64(cuda.popc(ballot))
        before_warp = int64(0)  # active windows of the chunk's earlier warps
        if RANKERS > 1:
            if lane == 0 and warp < RANKERS:
                counts_s[warp] = cuda.popc(ballot)
            cuda.syncthreads()  # every ranking warp's count is in counts_s
            aggregate = 0
            for k in range(RANKERS):
                if k < warp:
                    before_warp += counts_s[k]
                aggregate += counts_s[k]
        if tid == 0:  # the chunk's own count out first: successors need not wait for its prefix
            cuda.atomic.exch(status, (1 + chunk) * STRIDE, (tag << STATUS_TAG_SHIFT) | aggregate
                             | (STATUS_PREFIX if chunk == 0 else 0))
            stamp(status, chunk, 2)
        exclusive = int64(0)
        if BLOCK_LOOK_BACK:
            exclusive = _look_back_block(status, chunk, tag, nearest_s, sums_s, STRIDE)
        elif warp == 0:
            exclusive = _look_back(status, chunk, tag, lane, STRIDE)
        if tid == 0:
            stamp(status, chunk, 3)
        if tid == 0 and chunk > 0:
            cuda.atomic.exch(status, (1 + chunk) * STRIDE,
                             (tag << STATUS_TAG_SHIFT) | STATUS_PREFIX | (exclusive + aggregate))
        if RANKERS > 1 and not BLOCK_LOOK_BACK:
            if tid == 0:
                exclusive_s[0] = exclusive
            cuda.syncthreads()  # warp 0's look-back is in exclusive_s
            exclusive = exclusive_s[0]
        if tid < windows:
            before = before_warp + cuda.popc(ballot & cuda.lanemask_lt())
            window = first + tid
            if (ballot >> lane) & 1:
                row = exclusive + before
                n, bh, bw = _window(window, count_h32, count_w32, magic_h, magic_w)
                indices[row, 0] = n
                indices[row, 1] = bh
                indices[row, 2] = bw
            else:  # inactive windows fill rows total-1, total-2, ... in row-major order
                row = total - 1 - (window - exclusive - before)
                indices[row, 0] = -1
                indices[row, 1] = -1
                indices[row, 2] = -1
        if tid == 0:
            stamp(status, chunk, 4)
        if tid == 0 and chunk == n_chunks - 1:
            count[0] = exclusive + aggregate
            # Every chunk has published (this look-back saw them all), so every one has read
            # the launch count: the next launch's statuses get the next tag.
            cuda.atomic.add(status, 0, 1)

    return pass_kernel


# -- kernel bodies: gather and scatter ----------------------------------------------


@cuda.jit(device=True, inline=True)
def _split(p, d, inv):
    """(p // d, p % d) for 0 <= p < 2**24 through a float reciprocal (64-bit division is slow)."""
    q = int64(float32(p) * inv)
    rest = p - q * d
    if rest < 0:
        q -= 1
        rest += d
    elif rest >= d:
        q += 1
        rest -= d
    return q, rest


def _make_copy_kernels(scatter, transpose, add, atomic, dtype, channels_last):
    """Gather (image -> blocks) or scatter (blocks -> image), plain or through a transposing tile.

    The image is NHWC when `channels_last`, else NCHW; the blocks share its
    layout unless `transpose`. Every kernel walks its arrays along their
    contiguous axis: channels for channels-last data, pixels otherwise. A
    thread block takes one window: its (n, h0, w0) is read once, and out-of-
    image elements read a clamped (valid) address and are zeroed by a select,
    so each thread keeps COPY_UNROLL loads in flight without branches.
    """
    HALF2 = dtype == "half2"  # int32 words of two fp16 values, added by add_half2
    FP16 = dtype == "float16"  # (Numba's atomic add takes no fp16: atomic_add_half)
    element = from_dtype(np.dtype("int32" if HALF2 else dtype))
    blocks_last = channels_last != transpose  # are the blocks [nb, bh, bw, C]?
    source_last = blocks_last if scatter else channels_last  # the side a transposing tile reads

    @cuda.jit(device=True, inline=True)
    def image_shape(image):
        """(N, H, W, C) of the image in either layout."""
        if channels_last:
            return image.shape[0], image.shape[1], image.shape[2], image.shape[3]
        return image.shape[0], image.shape[2], image.shape[3], image.shape[1]

    @cuda.jit(device=True, inline=True)
    def image_index(n, h, w, c):
        """Unsigned (no negative-index wrap): callers pass coordinates inside the image."""
        if channels_last:
            return uint64(n), uint64(h), uint64(w), uint64(c)
        return uint64(n), uint64(c), uint64(h), uint64(w)

    # A plain add reads the old values in the load phase (with the blocks), so
    # its read-modify-writes do not wait out one load latency each.
    prefetch_old = add and not atomic

    @cuda.jit(device=True, inline=True)
    def image_clamped(image, n, h, w, c):
        """The pixel at (h, w) moved into the image: a valid address for a read whose value
        the caller drops (or zeroes) when (h, w) is outside."""
        _, H, W, _ = image_shape(image)
        return image[image_index(n, min(max(h, 0), H - 1), min(max(w, 0), W - 1), c)]

    @cuda.jit(device=True, inline=True)
    def image_put(image, index, value, old):
        if add:
            if atomic and HALF2:
                atomic_add_half2(image, index, value)
            elif atomic and FP16:
                atomic_add_half(image, index, value)
            elif atomic:
                cuda.atomic.add(image, index, value)
            elif HALF2:
                image[index] = add_half2(old, value)
            else:
                image[index] = old + value
        else:
            image[index] = value

    @cuda.jit(device=True, inline=True)
    def block_index(i, r, s, c):
        if blocks_last:
            return uint64(i), uint64(r), uint64(s), uint64(c)
        return uint64(i), uint64(c), uint64(r), uint64(s)

    @cuda.jit(device=True, inline=True)
    def window(indices, i, stride_h, stride_w, offset_h, offset_w):
        return indices[i, 0], offset_h + indices[i, 1] * stride_h, offset_w + indices[i, 2] * stride_w

    @cuda.jit
    def copy_plain(image, blocks, indices, count, size_h, size_w, stride_h, stride_w, offset_h, offset_w):
        i = cuda.blockIdx.x
        live = i < count[0]  # a gather's row past the count: zeros, as a window off the image
        if scatter and not live:
            return
        N, H, W, C = image_shape(image)
        n, h0, w0 = window(indices, i, stride_h, stride_w, offset_h, offset_w)
        n_ok = live and 0 <= n < N
        if scatter and not n_ok:
            return
        nc = min(max(n, 0), N - 1)
        # Elements in the arrays' shared order (a, b, d), d contiguous: (r, s, c)
        # channels-last, (c, r, s) otherwise. Thread block (i, part) takes the
        # part-th slice of window i's elements; each thread steps COPY_THREADS
        # elements at a time, carrying (a, b, d) along without a division.
        if channels_last:
            B, D, A = size_w, C, size_h
        else:
            B, D, A = size_h, size_w, C
        total = A * B * D
        per_part = -(-total // cuda.gridDim.y)
        e_end = min(total, (cuda.blockIdx.y + 1) * per_part)
        td = COPY_THREADS % D
        tb = (COPY_THREADS // D) % B
        ta = COPY_THREADS // (B * D)
        e = cuda.blockIdx.y * per_part + cuda.threadIdx.x
        d = e % D
        b = (e // D) % B
        a = e // (B * D)
        ev = cuda.local.array(COPY_UNROLL, int64)
        av = cuda.local.array(COPY_UNROLL, int64)
        bv = cuda.local.array(COPY_UNROLL, int64)
        dv = cuda.local.array(COPY_UNROLL, int64)
        values = cuda.local.array(COPY_UNROLL, element)
        olds = cuda.local.array(COPY_UNROLL, element)
        while e < e_end:
            for u in range(COPY_UNROLL):
                ev[u] = e
                av[u] = a
                bv[u] = b
                dv[u] = d
                e += COPY_THREADS
                d += td
                b += tb
                a += ta
                if d >= D:
                    d -= D
                    b += 1
                if b >= B:
                    b -= B
                    a += 1
            for u in range(COPY_UNROLL):  # all loads first: COPY_UNROLL in flight
                ac = min(av[u], A - 1)  # the last group may run past the window: read a valid address
                r, c, sw = (ac, dv[u], bv[u]) if channels_last else (bv[u], ac, dv[u])
                h = h0 + r
                w = w0 + sw
                if scatter:
                    values[u] = blocks[block_index(i, r, sw, c)]
                    if prefetch_old:
                        olds[u] = image_clamped(image, n, h, w, c)
                else:
                    inside = n_ok and 0 <= h < H and 0 <= w < W
                    value = image_clamped(image, nc, h, w, c)
                    values[u] = value if inside else element(0)
            for u in range(COPY_UNROLL):
                if ev[u] < e_end:
                    r, c, sw = (av[u], dv[u], bv[u]) if channels_last else (bv[u], av[u], dv[u])
                    if scatter:
                        h = h0 + r
                        w = w0 + sw
                        if 0 <= h < H and 0 <= w < W:
                            image_put(image, image_index(n, h, w, c), values[u], olds[u])
                    else:
                        blocks[block_index(i, r, sw, c)] = values[u]

    @cuda.jit
    def copy_transposed(image, blocks, indices, count, size_h, size_w, stride_h, stride_w, offset_h, offset_w):
        i = cuda.blockIdx.x
        live = i < count[0]  # a gather's row past the count: zeros, as a window off the image
        if scatter and not live:
            return  # the same for the whole thread block, before any barrier
        N, H, W, C = image_shape(image)
        n, h0, w0 = window(indices, i, stride_h, stride_w, offset_h, offset_w)
        n_ok = live and 0 <= n < N
        if scatter and not n_ok:
            return  # the same for the whole thread block, before any barrier
        nc = min(max(n, 0), N - 1)
        tx = cuda.threadIdx.x
        ty = cuda.threadIdx.y
        tile = cuda.shared.array(TILE_SHAPE, element)
        pixels = size_h * size_w
        inv_w = float32(1) / float32(size_w)
        c_tiles = -(-C // TILE)
        values = cuda.local.array(TILE_STEPS, element)
        olds = cuda.local.array(TILE_STEPS, element)
        # Thread block (i, part) takes every parts-th tile of window i.
        for t in range(cuda.blockIdx.y, -(-pixels // TILE) * c_tiles, cuda.gridDim.y):
            p0 = (t // c_tiles) * TILE
            c0 = (t - (t // c_tiles) * c_tiles) * TILE
            for k in range(TILE_STEPS):  # read the source along its contiguous axis
                j = ty + k * TILE_ROWS
                p = p0 + (j if source_last else tx)
                c = c0 + (tx if source_last else j)
                ok = p < pixels and c < C
                r, sw = _split(min(p, pixels - 1), size_w, inv_w)
                cc = min(c, C - 1)
                if scatter:
                    value = blocks[block_index(i, r, sw, cc)]
                else:
                    h = h0 + r
                    w = w0 + sw
                    ok = ok and n_ok and 0 <= h < H and 0 <= w < W
                    value = image_clamped(image, nc, h, w, cc)
                values[k] = value if ok else element(0)
            for k in range(TILE_STEPS):
                tile[ty + k * TILE_ROWS, tx] = values[k]
            cuda.syncthreads()  # the tile is loaded
            if prefetch_old:
                for k in range(TILE_STEPS):  # the old values, all loads in flight at once
                    j = ty + k * TILE_ROWS
                    r, sw = _split(min(p0 + (tx if source_last else j), pixels - 1), size_w, inv_w)
                    cc = min(c0 + (j if source_last else tx), C - 1)
                    olds[k] = image_clamped(image, n, h0 + r, w0 + sw, cc)
            for k in range(TILE_STEPS):  # write the destination along its own
                j = ty + k * TILE_ROWS
                p = p0 + (tx if source_last else j)
                c = c0 + (j if source_last else tx)
                if p < pixels and c < C:
                    r, sw = _split(p, size_w, inv_w)
                    if scatter:
                        h = h0 + r
                        w = w0 + sw
                        if 0 <= h < H and 0 <= w < W:
                            image_put(image, image_index(n, h, w, c), tile[tx, j], olds[k])
                    else:
                        blocks[block_index(i, r, sw, c)] = tile[tx, j]
            cuda.syncthreads()  # the tile is read before the next one is loaded

    return copy_transposed if transpose else copy_plain


@cuda.jit(device=True, inline=True)
def _joined(low, high, odd):
    """The int32 word of the high half of ``low`` and the low half of ``high`` where ``odd``
    (two halves that straddle an aligned word), else ``low``."""
    if odd:
        return int32((uint32(low) >> uint32(16)) | (uint32(high) << uint32(16)))
    return low


@cuda.jit(device=True, inline=True)
def _joined_quad(low, high, phase):
    """The int64 word of four halves that start ``phase`` halves into the aligned word ``low``
    and run on into ``high`` (``low`` itself where ``phase`` is 0)."""
    if phase != 0:
        shift = uint64(16 * phase)
        return int64((uint64(low) >> shift) | (uint64(high) << (uint64(64) - shift)))
    return low


@cuda.jit(device=True, inline=True)
def _add_quad(a, b):
    """The int64 word of the four fp16 sums of the halves of ``a`` and ``b`` (two add.rn.f16x2)."""
    low = add_half2(int32(a), int32(b))
    high = add_half2(int32(a >> 32), int32(b >> 32))
    return (int64(high) << 32) | int64(uint32(low))


_HALF = from_dtype(np.dtype("float16"))


@cuda.jit(device=True, inline=True)
def _put_word(image, halves, at, value, old, low_ok, high_ok, add, atomic):
    """A scatter's int32 word ``value`` into image word ``at`` where both its halves are the
    window's: written, added to ``old`` (the word read before) or added atomically; where one
    half is (a row's end in an atomic scatter: no other is sent such words), that half added
    alone (``halves``: the image as float16), the word's other half being a neighbour's."""
    if low_ok and high_ok:
        if atomic:
            atomic_add_half2(image, (at,), value)
        elif add:
            image[uint64(at)] = add_half2(old, value)
        else:
            image[uint64(at)] = value
    elif atomic:
        low, high = floats_of_half2(value)
        atomic_add_half(halves, (2 * at + (0 if low_ok else 1),), _HALF(low if low_ok else high))


@cuda.jit(device=True, inline=True)
def _put_quad(image, at, value, old, add):
    """A scatter's int64 word of four halves into image word ``at``, all four the window's:
    written, or added to ``old`` (the word read before)."""
    image[uint64(at)] = _add_quad(old, value) if add else value


@cuda.jit(device=True, inline=True)
def _swapped(a, b):
    """The 2 x 2 transpose of fp16 pairs: words of pixels p (a) and p + 1 (b), two channels each ->
    words of channels c and c + 1, two pixels each (low half: pixel p), and back the same way.
    (uint32(...): Numba computes uint32 shifts in 64 bits, where the simulator's NumPy wraps them at
    32: the high bits must not reach a caller.)"""
    return uint32((a & uint32(0xFFFF)) | (b << uint32(16))), uint32((a >> uint32(16)) | (b & uint32(0xFFFF0000)))


@cuda.jit(device=True, inline=True)
def _first_line(t, threads, D, rows, groups):
    """Thread t's place among a thread block's ``groups`` x ``rows`` lines of D words each, taken
    word t % D of lines t // D, + per_pass, ... (per_pass = threads // D): one division a thread,
    the line's group and row carried by `_next_line` (divisions by run-time values cost tens of
    instructions each: session 34's gathers by words). Returns (word, line, group, row, per_pass,
    group step, row step, lines: none for the threads past the last whole pass)."""
    per_pass = threads // D
    d = t % D
    line = t // D
    group = line // rows
    row = line - group * rows
    dg = per_pass // rows
    dr = per_pass - dg * rows
    return d, line, group, row, per_pass, dg, dr, groups * rows if t < per_pass * D else 0


@cuda.jit(device=True, inline=True)
def _next_line(line, group, row, per_pass, dg, dr, rows):
    """`_first_line`'s carried (line, group, row), one pass on."""
    group += dg
    row += dr
    if row >= rows:
        row -= rows
        group += 1
    return line + per_pass, group, row


def _make_pair_kernels(scatter, add, atomic, halves=2, strip=False):
    """Plain copies between an NCHW fp16 image and NCHW blocks, ``halves`` (2 or 4) halves a word.

    A window row of channel c is size_w contiguous halves on both sides, but a
    window may start at an odd column (every window does at SparseResBlock's
    offset of -1), where the element kernel's 2-byte accesses ran at about half
    the copy bandwidth (session 27). The launcher checked that every row of both
    sides starts on a word: W and size_w multiples of ``halves``, both pointers
    aligned to a word.

    A thread writes one aligned word of its destination (a block row's for a
    gather, an image row's for a scatter) from the one or two aligned source
    words that hold its halves (`_joined`, `_joined_quad`). So nothing moves at
    a half's offset but, in an atomic scatter (words of two halves only), the
    image words at a window row's two ends, which it shares with the
    neighbouring windows: there the window's half is added alone. Other
    scatters take windows that start on a word only (`_pair_path`: with their
    ends' halves apart they ran 10-20 % slower than the element kernel), so
    they write whole words. Words of four halves (int64: `PAIR_HALVES`) move
    twice the bytes a load of the same count of loads and registers. Thread t
    takes word t % D of rows t // D, t // D + per_pass, ... of the window's
    C * size_h rows (D words a row): a division once a thread, the row's channel
    and row carried along.

    With ``strip`` a thread block takes G = 32 // L consecutive windows (L
    lanes a window: `_strip_lanes`) instead of one: lane l of a warp takes
    word l % L of window l // L, and warp w rows w, w + 8, ... of the block's
    part, so one warp instruction moves one row of G windows. Where those lie
    side by side (consecutive active windows of a window row) that is one run
    of the image row, whose sectors shared at the windows' seams go in one
    request; one window a thread block asks for 8 image rows of 32-36 bytes,
    three in four of them straddling two sectors (1400-byte image rows). The
    DRAM bytes stay the same (ncu, session 33); scatters gain by fewer, fuller
    L2 requests, gathers lose by writing their block rows a window apart.
    """
    prefetch_old = add and not atomic
    quad = halves == 4
    word = int64 if quad else int32
    shift = 2 if quad else 1  # log2(halves)

    @cuda.jit(**({} if PAIR_MAX_REGISTERS is None or SIMULATOR else {"max_registers": PAIR_MAX_REGISTERS}))
    def copy_pairs(image, blocks, indices, count, halves_, N, C, H, W, size_h, size_w, stride_h, stride_w,
                   offset_h, offset_w, lanes_):
        """image, blocks: words, flat; halves_: the image as float16 (an atomic add's ends);
        lanes_: with ``strip``, the lanes a window's row takes (`_strip_lanes`)."""
        t = cuda.threadIdx.x
        if strip:
            lane = t % WARP
            slot = lane // lanes_
            i = cuda.blockIdx.x * (WARP // lanes_) + slot
            if slot >= WARP // lanes_ or i >= indices.shape[0]:
                return  # (no barrier in this kernel)
        else:
            i = cuda.blockIdx.x
        live = i < count[0]  # a gather's row past the count: zeros, as a window off the image
        if scatter and not live:
            return
        n = indices[i, 0]
        h0 = offset_h + indices[i, 1] * stride_h
        w0 = offset_w + indices[i, 2] * stride_w
        n_ok = live and 0 <= n < N
        if scatter and not n_ok:
            return
        phase = w0 & (halves - 1)  # halves into the first source word the window starts
        odd = phase != 0
        row_words = size_w >> shift  # a block row's
        image_words = W >> shift  # an image row's
        D = row_words + (1 if odd and scatter else 0)  # destination words a row
        if strip:
            d = lane % lanes_
            if d >= D:
                return  # (an atomic scatter's window at an even column: one word fewer)
            per_pass = COPY_THREADS // WARP
            first_row = t // WARP
        else:
            per_pass = COPY_THREADS // D
            if t >= per_pass * D:
                return
            d = t % D
            first_row = t // D
        rows = C * size_h
        per_part = -(-rows // cuda.gridDim.y)
        row = cuda.blockIdx.y * per_part + first_row
        row_end = min(rows, (cuda.blockIdx.y + 1) * per_part)
        c = row // size_h
        r = row - c * size_h
        dc = per_pass // size_h
        dr = per_pass - dc * size_h
        k = (w0 >> shift) + d  # the image word: a gather's first source, a scatter's destination
        if scatter:
            col = k << shift  # the image column of the destination's first half ...
            p = col - w0  # ... and its half of the block row
            low_ok = 0 <= p and 0 <= k < image_words
            high_ok = p + 1 < size_w and 0 <= k < image_words
            m = d - (1 if odd else 0)  # the block word holding half p
            first = min(max(m, 0), row_words - 1)
            second = min(m + 1, row_words - 1)
        else:
            col = w0 + (d << shift)  # the image column of the destination's first half
            first = min(max(k, 0), image_words - 1)
            second = min(max(k + 1, 0), image_words - 1)
            bits = uint64(0)
            for h_ in range(halves):
                if 0 <= col + h_ < W:
                    bits |= uint64(0xFFFF) << uint64(16 * h_)
            keep = word(bits)
        nc = min(max(n, 0), N - 1)
        rv = cuda.local.array(PAIR_UNROLL, int64)
        cv = cuda.local.array(PAIR_UNROLL, int64)
        hv = cuda.local.array(PAIR_UNROLL, int64)
        values = cuda.local.array(PAIR_UNROLL, word)
        olds = cuda.local.array(PAIR_UNROLL, word)
        while row < row_end:
            for u in range(PAIR_UNROLL):
                rv[u] = row
                cv[u] = c
                hv[u] = h0 + r
                row += per_pass
                c += dc
                r += dr
                if r >= size_h:
                    r -= size_h
                    c += 1
            for u in range(PAIR_UNROLL):  # all loads first: PAIR_UNROLL in flight
                cu = min(cv[u], C - 1)  # the last pass may run past the window: read a valid address
                h = hv[u]
                if scatter:
                    at = (int64(i) * rows + min(rv[u], rows - 1)) * row_words
                    low = blocks[uint64(at + first)]
                    if quad:
                        values[u] = low  # (a quad scatter's windows start on words)
                    else:
                        values[u] = _joined(low, blocks[uint64(at + second)] if odd else low, odd)
                    if prefetch_old:
                        at = ((int64(n) * C + cu) * H + min(max(h, 0), H - 1)) * image_words
                        olds[u] = image[uint64(at + min(max(k, 0), image_words - 1))]
                else:
                    at = ((int64(nc) * C + cu) * H + min(max(h, 0), H - 1)) * image_words
                    low = image[uint64(at + first)]
                    high = image[uint64(at + second)] if odd else low
                    value = _joined_quad(low, high, phase) if quad else _joined(low, high, odd)
                    values[u] = value & keep if n_ok and 0 <= h < H else word(0)
            for u in range(PAIR_UNROLL):
                if rv[u] < row_end:
                    if not scatter:
                        blocks[uint64((int64(i) * rows + rv[u]) * row_words + d)] = values[u]
                    elif (low_ok or high_ok) and 0 <= hv[u] < H:
                        at = ((int64(n) * C + cv[u]) * H + hv[u]) * image_words + k
                        if quad:
                            _put_quad(image, at, values[u], olds[u], add)
                        else:
                            _put_word(image, halves_, at, values[u], olds[u], low_ok, high_ok, add, atomic)

    return copy_pairs


def _make_pair_tile_kernels(atomic):
    """Adding scatters of NHWC blocks into an NCHW fp16 image, two halves a word on both sides.

    The block side moves a pixel's channels in pairs, the image side a
    channel's pixels in pairs (a window row's words, as `_make_pair_kernels`):
    a thread takes pixel p's and p + 1's words of channels c and c + 1 from the
    shared tile and swaps their halves (a 2 x 2 transpose in registers) into
    channel c's and c + 1's words of the two pixels. The tile holds
    PAIR_TILE_PAIRS channel pairs of whole window rows (at most
    PAIR_TILE_PIXELS pixels), so both sides' accesses are 4 bytes where the
    generic tile moved 2. Thread block (i, y, z) takes window i's rows y * R...
    (R whole rows a tile) and channel pairs z * PAIR_TILE_PAIRS.... The launcher
    checked what `_pair_path` does (even widths, 4-byte alignment, a scatter
    that is not atomic only at even columns, an even C). An atomic scatter's
    image words at a window row's ends get the window's half alone, as the pair
    kernels'. (A gather the same way, the swap before the tile, was slower than
    the generic tile, session 28; gathers swap after it: `_make_pair_tile_gathers`.)

    The tile's pixels are one run of the blocks, read with no division,
    PAIR_TILE_LOADS loads a thread in flight. On the image's side a thread
    keeps its word of the row and carries its line's channel pair and row (one
    division a thread); its first PAIR_TILE_UNROLL items' old words, which do
    not depend on the tile, are loaded before the tile is filled, so both
    phases' reads are in flight at once. Session 35 (H100, graph,
    `scripts/pair_tile_variants.py`, windows of 14 and 16, 1 x 256 and 8 x 64 x
    400 x 700 at 5-50 %): the first version, dividing each item's index by
    run-time counts (64-bit, tens of instructions each) and reading the blocks
    one load at a time, was 11-34 % slower than carried coordinates; loading
    the old words before the tile gained 12-25 % more at 25-50 % of the
    windows, 0-14 % at 5-10 % (`results/sbnet_pair_tile_scatter_session35_h100.md`).
    """
    CP = PAIR_TILE_PAIRS
    TP = PAIR_TILE_PIXELS
    T = PAIR_TILE_THREADS
    U = PAIR_TILE_UNROLL
    TILE_WORDS = TP * (CP + 1)  # [tile pixel][channel pair], flat; +1: an odd row stride (banks)
    LOADS = min(-(-TP * CP // T), PAIR_TILE_LOADS)  # phase 1's loads a thread in flight ...
    PASSES = -(-TP * CP // (T * LOADS))  # ... in this many passes
    if T % CP or T < TP // 2 + 1:
        raise ValueError("PAIR_TILE_THREADS: expected a multiple of PAIR_TILE_PAIRS, no fewer than a window "
                         "row's image words (PAIR_TILE_PIXELS // 2 + 1)")

    @cuda.jit(device=True, inline=True)
    def next_items(image, items, olds, line, qq, rr, lines, per_pass, dq, dr, rows, h, H, k_ok, at, plane,
                   image_words):
        """Phase 2's next U items from line ``line`` (pair qq, tile row rr; h: the tile's first image
        row, at: channel 2 q0's word there): ``items`` (rr + 65536 qq: rr < TP, qq < CP; -1: none) and, not atomic,
        the two channels' old image words loaded; the carried (line, qq, rr) after them."""
        for u in range(U):
            items[u] = -1
            if line < lines:
                if k_ok and 0 <= h + rr < H:
                    items[u] = rr | (qq << 16)
                    if not atomic:
                        spot = at + (int64(2 * qq) * H + rr) * image_words
                        olds[u, 0] = image[uint64(spot)]
                        olds[u, 1] = image[uint64(spot + plane)]
                # (written out, not `_next_line`: with it, ptxas's allocation at PAIR_TILE_MAX_REGISTERS
                # gave wrong sums on an H100, every window, though correct uncapped; session 36)
                line += per_pass
                qq += dq
                rr += dr
                if rr >= rows:
                    rr -= rows
                    qq += 1
        return line, qq, rr

    @cuda.jit(**({} if PAIR_TILE_MAX_REGISTERS is None or SIMULATOR else {"max_registers": PAIR_TILE_MAX_REGISTERS}))
    def copy_pair_tiles(image, blocks, indices, count, halves, N, C, H, W, size_h, size_w, stride_h, stride_w,
                        offset_h, offset_w):
        """image, blocks: int32 words, flat; halves: the image as float16 (an atomic add's ends)."""
        i = cuda.blockIdx.x
        if i >= count[0]:
            return  # the same for the whole thread block, before the barrier
        n = indices[i, 0]
        h0 = offset_h + indices[i, 1] * stride_h  # (64-bit: a far window's start must not wrap)
        w0 = offset_w + indices[i, 2] * stride_w
        if not 0 <= n < N:
            return  # the same for the whole thread block, before the barrier
        tile = cuda.shared.array(TILE_WORDS, uint32)
        size_w = int32(size_w)  # (at most PAIR_TILE_PIXELS)
        R = TP // size_w  # window rows a tile
        r0 = int32(cuda.blockIdx.y * R)
        rows = min(R, int32(size_h) - r0)
        q0 = int32(cuda.blockIdx.z * CP)
        pairs = min(CP, int32(C >> 1) - q0)
        t = int32(cuda.threadIdx.x)
        # Phase 2 (the image's side) is placed first: thread t takes image word t % D of the
        # (channel pair, tile row) lines t // D, + T // D, ... (as `_first_line` does, written out:
        # see `next_items`). Its first items' old words do not depend on the tile: they are loaded
        # before it, so both phases' reads are in flight at once.
        odd = int32(w0 & 1)
        D = (size_w >> 1) + odd  # image-side words a row
        per_pass = T // D
        d = t % D
        line = t // D
        qq = line // rows
        rr = line - qq * rows
        dq = per_pass // rows
        dr = per_pass - dq * rows
        lines = pairs * rows if t < per_pass * D else 0  # (the threads past the last whole pass: none)
        image_words = W >> 1
        k = (w0 >> 1) + d  # the image word: columns 2k, 2k + 1, window pixels p, p + 1
        p = 2 * d - odd
        low_in = p >= 0
        high_in = p + 1 < size_w
        plane = int64(H) * image_words  # words of a channel's plane
        at = ((int64(n) * C + 2 * q0) * H + h0 + r0) * image_words + k  # channel 2 q0's, row r0's word k
        items = cuda.local.array(U, int32)
        olds = cuda.local.array((U, 2), int32)
        k_ok = 0 <= k < image_words
        line, qq, rr = next_items(image, items, olds, line, qq, rr, lines, per_pass, dq, dr, rows, h0 + r0, H, k_ok,
                                  at, plane, image_words)
        # Phase 1: the tile's pixels are whole window rows, one run of the blocks: thread t takes
        # channel pair t % CP of pixels t // CP, + T // CP, ... (CP a constant: no division).
        q = t % CP
        step = T // CP
        pixels = rows * size_w
        first = (int64(i) * size_h + r0) * size_w * (C >> 1) + q0 + q  # the tile's pixel 0, pair q
        values = cuda.local.array(LOADS, uint32)
        for pass_ in range(0, PASSES * LOADS, LOADS):
            for u in range(LOADS):  # LOADS in flight
                pu = t // CP + (pass_ + u) * step
                if q < pairs and pu < pixels:
                    values[u] = uint32(blocks[uint64(first + int64(pu) * (C >> 1))])
            for u in range(LOADS):
                pu = t // CP + (pass_ + u) * step
                if q < pairs and pu < pixels:
                    tile[uint32(pu * (CP + 1) + q)] = values[u]
        cuda.syncthreads()  # the tile holds the blocks' words
        while True:
            for u in range(U):
                if items[u] >= 0:
                    item_r = items[u] & 0xFFFF
                    item_q = items[u] >> 16
                    place = (item_r * size_w + p) * (CP + 1) + item_q  # (the low half's pixel)
                    low = tile[uint32(place)] if low_in else uint32(0)
                    high = tile[uint32(place + CP + 1)] if high_in else uint32(0)
                    firsts = _swapped(low, high)  # (channel c's word, channel c + 1's)
                    spot = at + (int64(2 * item_q) * H + item_r) * image_words
                    for j in range(2):
                        _put_word(image, halves, spot + j * plane, int32(firsts[j]), olds[u, j], low_in, high_in,
                                  True, atomic)
            if line >= lines:
                break
            line, qq, rr = next_items(image, items, olds, line, qq, rr, lines, per_pass, dq, dr, rows, h0 + r0, H,
                                      k_ok, at, plane, image_words)

    return copy_pair_tiles


def _make_pair_tile_gathers():
    """Gathers of an NCHW fp16 image into NHWC blocks (through the transpose), two halves a word.

    Thread block (i, y, z) takes window i's channels y * CG... (CG = 2 *
    PAIR_GATHER_PAIRS) and rows z * R... (R a launch argument: the rows whose
    words fit PAIR_GATHER_WORDS). First the image words that cover each
    (channel, row) line of that piece (D a line: the window's row from the
    word holding its first half; windows at odd columns read a word more) go
    into a shared tile ``raw[channel][row][word]``, PAIR_TILE_UNROLL loads a
    thread in flight, zero off the image, for a window of no image and for
    rows past the count: thread t takes word t % D of lines t // D, + T // D,
    ..., the line's channel and row carried. Then a thread takes a block word,
    pixel p's halves of channels c and c + 1: two shared words, the halves
    picked by the column's parity. Consecutive threads take consecutive
    channel pairs of a pixel, so a warp writes two pixels' runs of 2 * CG
    bytes; one channel's lines start an odd count of words after the previous
    channel's in the tile (``stride``), so those 16 reads hit 16 banks and the
    next pixel's the others (or the same words). One division a thread: the first version,
    dividing every item's index by run-time counts (64-bit, tens of
    instructions each), was 1.5-2.8x slower than the generic tile, which
    moves a half an access on both sides; this one 1.1-2.3x faster (session
    34, `PAIR_TILE_GATHERS`). The launcher checked what `_pair_gather_rows`
    does (W and C even, 4-byte aligned pointers, window rows of at most
    PAIR_TILE_PIXELS pixels).
    """
    CG = 2 * PAIR_GATHER_PAIRS
    T = PAIR_TILE_THREADS
    U = PAIR_TILE_UNROLL

    @cuda.jit
    def gather_pair_tiles(image, blocks, indices, count, N, C, H, W, size_h, size_w, stride_h, stride_w,
                          offset_h, offset_w, R):
        """image, blocks: int32 words, flat; R: window rows a thread block."""
        i = cuda.blockIdx.x
        raw = cuda.shared.array(PAIR_GATHER_WORDS, uint32)
        n = indices[i, 0]
        h0 = offset_h + indices[i, 1] * stride_h
        w0 = offset_w + indices[i, 2] * stride_w
        ok = i < count[0] and 0 <= n < N
        nc = min(max(n, 0), N - 1)
        c0 = cuda.blockIdx.y * CG
        channels = min(CG, C - c0)
        r0 = cuda.blockIdx.z * R
        rows = min(R, size_h - r0)
        odd = w0 & 1
        D = (odd + size_w + 1) >> 1  # image words a row
        stride = (rows * D) | 1  # words from a channel's lines in the tile to the next's (odd: see above)
        image_words = W >> 1
        k0 = w0 >> 1  # the image word holding the window row's first half
        t = cuda.threadIdx.x
        # Phase 1: thread t takes word t % D of the tile's (channel, row) lines t // D, + T // D,
        # ... (`_first_line`).
        d, line, c, rr, per_pass, dc, dr, lines = _first_line(t, T, D, rows, channels)
        k = k0 + d
        k_ok = ok and 0 <= k < image_words
        plane = ((int64(nc) * C + c0) * H + h0 + r0) * image_words + k  # channel c0's, row r0's word k
        values = cuda.local.array(U, uint32)
        spots = cuda.local.array(U, int32)  # a word's place in the tile (-1: none)
        while line < lines:
            for u in range(U):  # all loads first: U in flight
                spots[u] = -1
                if line < lines:
                    h = h0 + r0 + rr
                    values[u] = uint32(0)
                    if k_ok and 0 <= h < H:
                        values[u] = uint32(image[uint64(plane + (int64(c) * H + rr) * image_words)])
                    spots[u] = c * stride + rr * D + d
                line, c, rr = _next_line(line, c, rr, per_pass, dc, dr, rows)
            for u in range(U):
                if spots[u] >= 0:
                    raw[uint32(spots[u])] = values[u]
        cuda.syncthreads()  # the tile holds the piece's image words
        # Phase 2: thread t takes channel pair t % P of pixels t // P, + T // P, ... (P a constant:
        # no division), the pixel's row and column carried.
        P = PAIR_GATHER_PAIRS
        q = t % P
        step = T // P
        j = t // P
        rr = 0
        while j >= size_w:
            j -= size_w
            rr += 1
        dj = step % size_w
        drr = step // size_w
        pairs = channels >> 1
        out = (int64(i) * size_h + r0) * size_w * (C >> 1) + (c0 >> 1) + q
        while rr < rows:
            if q < pairs:
                s_ = odd + j
                at = 2 * q * stride + rr * D + (s_ >> 1)
                a = raw[uint32(at)]  # channel c's word holding the pixel's half ...
                b = raw[uint32(at + stride)]  # ... and channel c + 1's
                if s_ & 1:
                    word = (a >> uint32(16)) | (b & uint32(0xFFFF0000))
                else:
                    word = (a & uint32(0xFFFF)) | (b << uint32(16))
                blocks[uint64(out + (int64(rr) * size_w + j) * (C >> 1))] = int32(word)
            j += dj
            rr += drr
            if j >= size_w:
                j -= size_w
                rr += 1

    return gather_pair_tiles


def _vector_ops(vector_dtype, half2):
    """(WIDTH, load, store, zeros, plus): device functions on 16-byte vectors of WIDTH elements
    of ``vector_dtype`` at a flat element offset of a 1-D array (the caller checked alignment);
    ``plus`` adds two vectors, element by element, or with ``half2`` the fp16 pairs of int32
    words (add.rn.f16x2)."""
    element = from_dtype(np.dtype(vector_dtype))
    WIDTH = 16 // np.dtype(vector_dtype).itemsize

    @cuda.jit(device=True, inline=True)
    def load(array, offset):
        if WIDTH == 4:
            return load4(array, (offset,))
        return load2(array, (offset,))

    @cuda.jit(device=True, inline=True)
    def store(array, offset, values):
        if WIDTH == 4:
            store4(array, (offset,), values)
        else:
            store2(array, (offset,), values)

    @cuda.jit(device=True, inline=True)
    def zeros():
        if WIDTH == 4:
            return element(0), element(0), element(0), element(0)
        return element(0), element(0)

    @cuda.jit(device=True, inline=True)
    def plus(a, b):
        if WIDTH == 4:
            if half2:
                return add_half2(a[0], b[0]), add_half2(a[1], b[1]), add_half2(a[2], b[2]), add_half2(a[3], b[3])
            return a[0] + b[0], a[1] + b[1], a[2] + b[2], a[3] + b[3]
        return a[0] + b[0], a[1] + b[1]

    return WIDTH, load, store, zeros, plus


def _make_row_kernels(scatter, transpose, add, vector_dtype, half2, pixels, block_width=4, window_major=False):
    """Gather/scatter of a channels-last (NHWC) image a window row at a time, 16 bytes a thread-step.

    A window's row r is bw contiguous pixels of the image (bw * C elements in a
    row), so thread block (i, r) moves it with 16-byte vector loads and stores
    (`_vector.py`), no per-element index arithmetic: the row's vectors left and
    right of the image are a range [lo, hi) computed once. The arrays are flat
    views of ``vector_dtype`` elements (WIDTH of them 16 bytes): float32 or
    float64 data, or int32 words of fp16 pairs (``half2``: adds by add_half2).
    The launcher checked that a pixel is whole vectors and the pointers are
    16-byte aligned.

    With ``transpose`` (float32 or float16; blocks [n_blocks, C, bh, bw]) thread
    block (i, y, z) moves a `pixels` x ROW_TILE_C tile through a float32 shared
    tile (pixels y * pixels... of the window, its rows one run; with
    ``window_major`` the three are one grid axis, tile fastest, then chunk z,
    then window i): read along C from the image (or along the block's pixels),
    written along the other, four values (16 or 8 bytes) a step on the image's
    side and `block_width` (4 where bh * bw is a multiple of 4, else 1) on the
    block's; adds in float32, rounded once (for fp16 the same as an fp16 add).
    A thread loads all its vectors before it uses any, and fp16
    vectors wait in registers as the two words they came in (`load4_words`),
    widened to float32 only where used: widened, or kept as halves, next to
    their load, each load waited in its branch for the one before (session 18's
    SASS; the fp16 adding scatter took 1.4-1.7x its session-16 time).
    """
    element = from_dtype(np.dtype(vector_dtype))
    WIDTH, load, store, zeros, plus = _vector_ops(vector_dtype, half2)
    CT = ROW_TILE_C
    PT = pixels
    CQ = CT // 4  # 16-byte vectors of a tile's pixel
    BV = block_width
    SQ = PT // BV  # block-side steps along a tile's channel (a block row's pixels)
    PER = PT * CQ // ROW_TILE_THREADS  # image-side vectors a thread moves (a literal: local shapes)
    PER_B = PT * CT // BV // ROW_TILE_THREADS  # block-side steps a thread moves
    PER_MOST = max(PER, PER_B)
    STEP = ROW_TILE_THREADS // CQ  # tile pixels between a thread's image-side vectors
    TILE_SHAPE_ROWS = (PT, CT + 1)  # +1: a column read (4 pixels of a channel) hits distinct banks
    HALF = vector_dtype == "float16"
    WORDS = 2 if HALF else 4  # what a staged vector of 4 values holds: fp16, 2 words of 2 halves
    staged = uint32 if HALF else float32

    @cuda.jit(device=True, inline=True)
    def row_of(indices, count, N, H, stride_h, stride_w, offset_h, offset_w):
        """(whether this thread block's window is below the count, its n, h, w0, whether its row
        is inside the image): the count and the window's indices are read together (the
        compiler may still sink the column's load past the count's test: session 14's SASS; a
        test that forced it out with the others timed the same, `benchmarks/NOTES.md`)."""
        i = cuda.blockIdx.x
        active = count[0]
        n = indices[i, 0]  # i < the indices' rows: a valid read even past the count
        h = offset_h + indices[i, 1] * stride_h + cuda.blockIdx.y
        w0 = offset_w + indices[i, 2] * stride_w
        return i < active, n, h, w0, 0 <= n < N and 0 <= h < H

    @cuda.jit
    def copy_rows(image, blocks, indices, count, N, H, W, CV, size_h, size_w, stride_h, stride_w,
                  offset_h, offset_w):
        """Plain: blocks [n_blocks, bh, bw, C]; CV vectors a pixel."""
        live, n, h, w0, row_ok = row_of(indices, count, N, H, stride_h, stride_w, offset_h, offset_w)
        row_ok = row_ok and live  # a gather's row past the count: zeros, as a window off the image
        if scatter and not row_ok:
            return
        total = size_w * CV
        lo = (min(max(w0, 0), w0 + size_w) - w0) * CV  # vectors left of the image
        hi = (max(min(w0 + size_w, W), w0) - w0) * CV
        if not row_ok:
            hi = lo  # a gather writes zeros
        image_row = ((int64(n) * H + h) * W + w0) * CV * WIDTH  # (off the image left of lo: not read)
        block_row = ((int64(cuda.blockIdx.x) * size_h + cuda.blockIdx.y) * size_w) * CV * WIDTH
        threads = cuda.blockDim.x
        values = cuda.local.array((ROW_UNROLL, WIDTH), element)
        olds = cuda.local.array((ROW_UNROLL, WIDTH), element)
        for start in range(cuda.threadIdx.x, total, threads * ROW_UNROLL):
            for u in range(ROW_UNROLL):  # every load first: ROW_UNROLL in flight
                v = start + u * threads
                inside = lo <= v < hi
                if scatter:
                    got = load(blocks, uint64(block_row + v * WIDTH)) if inside else zeros()
                    old = load(image, uint64(image_row + v * WIDTH)) if inside and add else zeros()
                    for k in range(WIDTH):
                        olds[u, k] = old[k]
                else:
                    got = load(image, uint64(image_row + v * WIDTH)) if inside else zeros()
                for k in range(WIDTH):
                    values[u, k] = got[k]
            for u in range(ROW_UNROLL):
                v = start + u * threads
                if WIDTH == 4:
                    got = values[u, 0], values[u, 1], values[u, 2], values[u, 3]
                    old = olds[u, 0], olds[u, 1], olds[u, 2], olds[u, 3]
                else:
                    got = values[u, 0], values[u, 1]
                    old = olds[u, 0], olds[u, 1]
                if scatter:
                    if lo <= v < hi:
                        store(image, uint64(image_row + v * WIDTH), plus(got, old) if add else got)
                elif v < total:
                    store(blocks, uint64(block_row + v * WIDTH), got)

    @cuda.jit(device=True, inline=True)
    def tile_vector(u):
        """This thread's image-side vector u of a transposing tile: (s, q), tile pixel s,
        channels 4q... of the tile's."""
        return cuda.threadIdx.x // CQ + STEP * u, cuda.threadIdx.x % CQ

    @cuda.jit(device=True, inline=True)
    def image_vector(u, n, h0, w0, p0, c0, N, H, W, C, size_w, area):
        """`tile_vector(u)`'s (s, q), its flat offset in the image (channels c0 + 4q...), and
        whether it lies in the window and the image. Tile pixel s is pixel p0 + s of the
        window's rows read as one run: row (p0 + s) // size_w."""
        s, q = tile_vector(u)
        p = p0 + s
        r = int32(uint32(p) // uint32(size_w))  # (32-bit: a 64-bit division is a call)
        h = h0 + r
        w = w0 + (p - r * size_w)
        inside = p < area and c0 + 4 * q < C and 0 <= n < N and 0 <= h < H and 0 <= w < W
        return s, q, uint64(((n * H + h) * W + w) * C + c0 + 4 * q), inside

    @cuda.jit(device=True, inline=True)
    def block_step(u, p0, c0, C, area):
        """This thread's block-side step u of a transposing tile: (k, c), channel c0 + c, tile
        pixels BV k..., and whether it lies in the window and its channels."""
        e = cuda.threadIdx.x + u * ROW_TILE_THREADS
        k, c = e % SQ, e // SQ
        return k, c, c0 + c < C and p0 + BV * k < area

    @cuda.jit(device=True, inline=True)
    def load_staged(array, offset, inside):
        """array[offset:offset + 4] as staged (fp16: its 2 words), or zeros where not `inside`."""
        if HALF:
            if inside:
                return load4_words(array, (offset,))
            return uint32(0), uint32(0)
        if inside:
            return load4(array, (offset,))
        return float32(0), float32(0), float32(0), float32(0)

    @cuda.jit(device=True, inline=True)
    def widened(staging, u, j):
        """Value j of staged vector u, as float32."""
        if HALF:
            low, high = floats_of_half2(staging[u, j // 2])
            return high if j % 2 else low
        return staging[u, j]

    @cuda.jit
    def copy_rows_transposed(image, blocks, indices, count, N, H, W, C, size_h, size_w, stride_h, stride_w,
                             offset_h, offset_w):
        """blocks [n_blocks, C, bh, bw]; C a multiple of 4; ROW_TILE_THREADS threads. Thread block
        (i, y, z) takes pixels y * PT... of window i, its rows read one after another as one
        run (tiles cross rows), and channels z * CT...: for a channel, the tile's pixels are
        one run of the block, written or read as one. Every loop loads all its values before
        it stores any: stored as they came, each load waited for the one before (the loop is
        not unrolled)."""
        if window_major:
            tiles = uint32((size_h * size_w + PT - 1) // PT)
            chunks = uint32((C + CT - 1) // CT)
            b = uint32(cuda.blockIdx.x)
            iz = b // tiles
            y = int32(b - iz * tiles)
            i = int32(iz // chunks)
            z = int32(iz - uint32(i) * chunks)
        else:
            i, y, z = cuda.blockIdx.x, cuda.blockIdx.y, cuda.blockIdx.z
        active = count[0]  # read with the window's indices (i < their rows: valid past the count)
        n = int64(indices[i, 0])
        h0 = offset_h + indices[i, 1] * stride_h
        w0 = offset_w + indices[i, 2] * stride_w
        if i >= active:
            n = int64(-1)  # a gather's row past the count: zeros, as a window of no image
        if scatter and not 0 <= n < N:
            return  # the same for the whole thread block, before the barrier (a scatter's window
            # of no image lands nowhere)
        p0 = int32(y) * PT
        c0 = int32(z) * CT
        area = size_h * size_w  # the window's pixels: a channel's run in the block
        tile = cuda.shared.array(TILE_SHAPE_ROWS, float32)
        block_run = int64(i) * C * area + p0  # channel 0's first tile pixel
        # Arithmetic in float32: fp16 operators are calls, and arrays live across calls go to
        # local memory.
        values = cuda.local.array((PER_MOST, WORDS), staged)
        olds = cuda.local.array((PER, WORDS), staged)
        singles = cuda.local.array(PER_B, float32)  # block_width 1 (a fallback: widened as loaded)
        # The image side: vector (s, q) is tile pixel s, channels c0 + 4q...; the block side:
        # step (k, c) is channel c0 + c, tile pixels BV k...
        if scatter:
            for u in range(PER_B):
                k, c, inside = block_step(u, p0, c0, C, area)
                at = uint64(block_run + (c0 + c) * area + BV * k)
                if BV == 4:
                    got = load_staged(blocks, at, inside)
                    for j in range(WORDS):
                        values[u, j] = got[j]
                elif inside:
                    singles[u] = float32(blocks[at])
            if add:  # the old values of what this thread writes below, loaded with the blocks
                for u in range(PER):
                    _, _, at, inside = image_vector(u, n, h0, w0, p0, c0, N, H, W, C, size_w, area)
                    old = load_staged(image, at, inside)
                    for j in range(WORDS):
                        olds[u, j] = old[j]
            for u in range(PER_B):
                k, c, _ = block_step(u, p0, c0, C, area)  # (past the window: unused)
                if BV == 4:
                    for j in range(4):
                        tile[4 * k + j, c] = widened(values, u, j)
                else:
                    tile[k, c] = singles[u]
            cuda.syncthreads()  # the tile holds the blocks' values
            for u in range(PER):
                s, q, at, inside = image_vector(u, n, h0, w0, p0, c0, N, H, W, C, size_w, area)
                if inside:
                    # An add in float32 rounded once to `element` is the element's own sum (fp16:
                    # float32's 24 bits >= 2 x 11 + 2, so the double rounding is exact); element()
                    # of a tile value alone is exact (it came from an `element`).
                    a, b, c, d = tile[s, 4 * q], tile[s, 4 * q + 1], tile[s, 4 * q + 2], tile[s, 4 * q + 3]
                    if add:
                        a, b = a + widened(olds, u, 0), b + widened(olds, u, 1)
                        c, d = c + widened(olds, u, 2), d + widened(olds, u, 3)
                    store4(image, (at,), (element(a), element(b), element(c), element(d)))
        else:
            for u in range(PER):
                _, _, at, inside = image_vector(u, n, h0, w0, p0, c0, N, H, W, C, size_w, area)
                got = load_staged(image, at, inside)
                for j in range(WORDS):
                    values[u, j] = got[j]
            for u in range(PER):
                s, q = tile_vector(u)
                for j in range(4):
                    tile[s, 4 * q + j] = widened(values, u, j)  # (zeros outside)
            cuda.syncthreads()  # the tile holds the image's values
            for u in range(PER_B):
                k, c, inside = block_step(u, p0, c0, C, area)
                if inside:
                    s = BV * k
                    at = uint64(block_run + (c0 + c) * area + s)
                    if BV == 4:
                        store4(blocks, (at,), (element(tile[s, c]), element(tile[s + 1, c]),
                                               element(tile[s + 2, c]), element(tile[s + 3, c])))
                    else:
                        blocks[at] = element(tile[s, c])

    return copy_rows_transposed if transpose else copy_rows


@cuda.jit
def fill_int32(array, value):
    i = cuda.grid(1)
    if i < array.size:
        array[i] = value


@cuda.jit
def link_windows(slots, chain, indices, count, n_blocks, N, count_h, count_w, first_h, first_w, fill):
    """The window map of a merging scatter: ``slots`` [N, count_h, count_w] (every window whose
    rows and columns reach the image; -1: none) gets each block's row i, below the count, at its
    window; a window given more than once keeps one row there, flagged CHAINED, and the others
    in ``chain`` (row -> next row of the same window, or -1). Windows of no image or off it are
    left out: they write nothing. With ``fill`` the launch is one thread block, which empties
    the map itself first (one launch fewer where the map is small), else it was filled with -1
    before."""
    if fill:
        for k in range(cuda.threadIdx.x, slots.size, cuda.blockDim.x):
            slots[k] = -1
        cuda.syncthreads()  # the map is empty before any row is linked into it
    for i in range(cuda.grid(1), min(n_blocks, count[0]), cuda.gridsize(1)):
        n = indices[i, 0]
        r = int64(indices[i, 1]) - first_h
        c = int64(indices[i, 2]) - first_w
        if 0 <= n < N and 0 <= r < count_h and 0 <= c < count_w:
            at = (int64(n) * count_h + r) * count_w + c
            before = cuda.atomic.exch(slots, at, int32(i))
            if before == -1:
                chain[i] = -1
            else:  # (the last row exchanged in sees a row before it, so the flag is set at the end)
                chain[i] = before & (CHAINED - 1)
                cuda.atomic.or_(slots, at, int32(CHAINED))


def _make_merge_kernels(add, vector_dtype, half2):
    """A scatter into a copy of an NHWC image in one pass: thread block (row, k) writes pixels
    k * P... of image row ``row`` (n * H + h), every 16-byte vector of each, as y's value plus
    (``add``) or replaced by (else) the block values of the windows over it.

    The arrays are flat views of ``vector_dtype`` elements, as the row copies'. A pixel lies
    in at most two windows along each axis (the launcher checked 2 * stride >= size), so the
    windows over image row h are found once per thread block and those over a pixel by one
    division. Their map entries for the thread block's run (the two window rows, the windows
    the run reaches) are read once into shared memory. A window repeated in the indices adds
    every block of it (its chain); overwriting, the first window found lands. Sums go in the
    order of the windows' positions, not of their rows: one pixel's result does not depend on
    how the blocks were listed (unless a window repeats)."""
    WIDTH, load, store, zeros, plus = _vector_ops(vector_dtype, half2)
    element = from_dtype(np.dtype(vector_dtype))

    @cuda.jit(device=True, inline=True)
    def window_of(x, stride, size, count):
        """The windows over coordinate x (relative to the first window's start) along one axis:
        (the later one or -1, its offset in it, the earlier one or -1, its offset)."""
        later, earlier, d = -1, -1, 0
        if x >= 0:
            j = int32(uint32(x) // uint32(stride))
            d = x - j * stride
            if j < count and d < size:
                later = j
            if 1 <= j <= count and d + stride < size:
                earlier = j - 1
        return later, d, earlier, d + stride

    @cuda.jit(device=True, inline=True)
    def take(acc, found, entry, blocks, chain, d, e, q, size_h, size_w, CV):
        """acc plus (or replaced by, where none was found yet) the values at window row d,
        column e, vector q of the blocks of map entry ``entry`` (-1: none)."""
        if entry == -1:
            return acc, found
        slot = entry & (CHAINED - 1)
        while slot >= 0:
            got = load(blocks, uint64((((int64(slot) * size_h + d) * size_w + e) * CV + q) * WIDTH))
            if add:
                acc = plus(acc, got)
            elif not found:
                acc = got
            found = True
            slot = chain[slot] if add and entry & CHAINED else -1  # (overwriting: one block lands)
        return acc, found

    @cuda.jit(device=True, inline=True)
    def load_run(olds, y, row_start, start, total, threads):
        """y's vectors start, start + threads, ... (MERGE_UNROLL of them, zeros past the run's
        total) into ``olds``: all loads in flight before any is used."""
        for u in range(MERGE_UNROLL):
            v = start + u * threads
            got = load(y, uint64((row_start + v) * WIDTH)) if v < total else zeros()
            for k in range(WIDTH):
                olds[u, k] = got[k]

    @cuda.jit
    def merge_rows(out, y, blocks, slots, chain, N, H, W, CV, size_h, size_w, stride_h, stride_w,
                   start_h, start_w, count_h, count_w, P):
        """out, y: [N, H, W, C] as CV vectors a pixel; blocks [n_blocks, bh, bw, C]; slots: the
        window map (`link_windows`), whose first window starts at image row start_h, column
        start_w; P pixels a thread block."""
        row = uint32(cuda.blockIdx.x)
        n = int32(row // uint32(H))
        h = int32(row - uint32(n) * uint32(H))
        w0 = int32(cuda.blockIdx.y) * P
        pixels = min(P, W - w0)
        total = pixels * CV
        threads = cuda.blockDim.x
        r_late, d_late, r_early, d_early = window_of(h - start_h, stride_h, size_h, count_h)
        # The windows the run's pixels lie in: columns lo..hi of the map.
        x_lo = w0 - start_w
        x_hi = x_lo + pixels - 1
        lo = 0
        if x_lo >= 0:
            lo = max(int32(uint32(x_lo) // uint32(stride_w)) - 1, 0)
        hi = -1
        if x_hi >= 0:
            hi = min(int32(uint32(x_hi) // uint32(stride_w)), count_w - 1)
        span = max(hi - lo + 1, 0)
        row_start = (int64(row) * W + w0) * CV  # the run's first vector
        olds = cuda.local.array((MERGE_UNROLL, WIDTH), element)
        start = cuda.threadIdx.x
        load_run(olds, y, row_start, start, total, threads)  # (in flight while the map is read)
        entries = cuda.shared.array((2, MERGE_SPAN), int32)
        map_row = int64(n) * count_h
        for k in range(cuda.threadIdx.x, 2 * span, threads):
            which = 1 if k >= span else 0
            c = k - which * span
            r = r_early if which else r_late
            entries[which, c] = slots[(map_row + r) * count_w + lo + c] if r >= 0 else -1
        cuda.syncthreads()  # the run's window map entries are in shared memory
        while start < total:
            if start > cuda.threadIdx.x:
                load_run(olds, y, row_start, start, total, threads)
            for u in range(MERGE_UNROLL):
                v = start + u * threads
                if v < total:
                    if WIDTH == 4:
                        acc = olds[u, 0], olds[u, 1], olds[u, 2], olds[u, 3]
                    else:
                        acc = olds[u, 0], olds[u, 1]
                    p = int32(uint32(v) // uint32(CV))
                    q = v - p * CV
                    c_late, e_late, c_early, e_early = window_of(w0 + p - start_w, stride_w, size_w, count_w)
                    found = False
                    if r_late >= 0:
                        if c_late >= 0:
                            acc, found = take(acc, found, entries[0, c_late - lo], blocks, chain, d_late, e_late,
                                              q, size_h, size_w, CV)
                        if c_early >= 0:
                            acc, found = take(acc, found, entries[0, c_early - lo], blocks, chain, d_late,
                                              e_early, q, size_h, size_w, CV)
                    if r_early >= 0:
                        if c_late >= 0:
                            acc, found = take(acc, found, entries[1, c_late - lo], blocks, chain, d_early,
                                              e_late, q, size_h, size_w, CV)
                        if c_early >= 0:
                            acc, found = take(acc, found, entries[1, c_early - lo], blocks, chain, d_early,
                                              e_early, q, size_h, size_w, CV)
                    store(out, uint64((row_start + v) * WIDTH), acc)
            start += threads * MERGE_UNROLL

    return merge_rows


# -- launch configuration -----------------------------------------------------------

_kernels = {}


def _copy_kernel(scatter, transpose, add, atomic, dtype, channels_last):
    key = (scatter, transpose, add, atomic, dtype, channels_last)
    if key not in _kernels:
        _kernels[key] = _make_copy_kernels(*key)
    return _kernels[key]


# Channels-last copies a window row at a time, 16 bytes a thread-step, where a pixel is whole
# 16-byte vectors and the pointers allow (`_make_row_kernels`); False keeps the element kernels.
ROW_COPIES = True
# Plain NCHW fp16 copies two halves a word where rows start on words (`_make_pair_kernels`);
# False keeps the element kernels.
PAIRS = True
# Rows a thread of a pair kernel loads before it stores any. Session 28, H100, graph, copy / ours,
# NCHW fp16 at even columns, 4 / 8 / 16: 8 x 64 x 400 x 700 at 50 %: gather 0.57 / 0.57 / 0.32,
# adding scatter 0.38 / 0.40 / 0.42; 1 x 256, 5 %: gather 0.30 / 0.25 / 0.17. Windows cut into more
# parts (WAVES 16 or 64 instead of 4) were up to 40 % slower on the small images, within 10 % on the large.
PAIR_UNROLL = 4
# Halves a word of the plain pair kernels where rows allow (4: int64 words where W, the window's
# width and, for scatters, its columns are multiples of 4 and the pointers 8-byte aligned; else 2).
# Session 32, H100, graph µs, 2 -> 4 halves, in-place adding scatters of windows of 16 (fp16 NCHW):
# 1 x 256 x 400 x 700 at 25 / 50 %: 128 -> 112, 228 -> 189; 8 x 64 at 50 %: 381 -> 327; 1 x 64 at
# 5 %: 8.5 -> 5.9 (`results/sbnet_pair_variants_session32_h100.md`; a cap of 64 registers was slower).
PAIR_HALVES = 4
PAIR_MAX_REGISTERS = None  # a cap on the plain pair kernels' registers (ptxas, sm_90: 52-74 uncapped)
# The plain pair copies that go a thread block of consecutive windows side by side in each warp
# (`_make_pair_kernels`' ``strip``) where a window row takes at most half a warp's lanes; the others a
# window a thread block. Kinds: "gather", "scatter quads" and "scatter pairs" (overwrites and adds,
# four or two halves a word), "atomic" (atomic adds). Session 33, H100, graph µs, a window a thread
# block -> strips (`results/sbnet_pair_strips_session33_h100.md`): adding scatters of quads, windows
# of 16, 1 x 256 x 400 x 700 at 25 / 50 %: 111 -> 98, 188 -> 148; 8 x 64 at 50 %: 326 -> 281; atomic
# adds of 18 every 16 from -1 at 50 %: 541 -> 429 (5 % of 1 x 64: 14.8 -> 16.1). Gathers were
# 1.0-2.4x slower (their block rows written a window apart), the sparse block's scatter of pairs
# (14 every 14) 5 % slower; the block's training step on NCHW input at 49 %: 1692 -> 1604.
PAIR_STRIP_KINDS = ("gather", "scatter quads", "scatter pairs", "atomic")
PAIR_STRIPS = ("scatter quads", "atomic")
# Transposing NCHW fp16 copies (NHWC blocks) by words (`_make_pair_tile_kernels`): a tile of this
# many channel pairs by whole window rows of at most PAIR_TILE_PIXELS pixels, PAIR_TILE_THREADS
# threads, PAIR_TILE_UNROLL image-side items a thread in flight, PAIR_TILE_LOADS block-side loads, at
# most PAIR_TILE_MAX_REGISTERS registers. Session 35, H100, graph, the sparse block's output windows
# (14 every 14) and 16 every 16, 1 x 256 and 8 x 64 x 400 x 700 at 5-50 %
# (`results/sbnet_pair_tile_scatter_session35_h100.md`): with the old words loaded ahead of the tile
# (72 registers uncapped: 3 thread blocks a multiprocessor), the cap of 64 (4, a few words spilled)
# 0-11 % faster at 25-50 %, 2 % slower to 9 % faster below; 8 loads (88 registers) 2-25 % slower
# than 4, and 24-53 % capped; 2 loads up to 7 % slower at 5-25 %, 1-6 % faster at 50 %. On the final
# kernel, at 10 / 50 %: PAIR_TILE_UNROLL 8 1.7-2.0x slower (uncapped 1-20 %), 2 2-41 %;
# PAIR_TILE_PIXELS 128 6-19 %; PAIR_TILE_PAIRS 16 3-8 % faster at 10 %, 24-31 % slower at 50 %. Image
# words of four halves where rows allow (int64, a word at either end where a row starts or ends two
# halves into one) were 5-20 % slower everywhere (2 items a thread in flight, capped), more with 4
# or uncapped: not kept.
PAIR_TILE_PAIRS = 32
PAIR_TILE_PIXELS = 64
PAIR_TILE_THREADS = 256
PAIR_TILE_UNROLL = 4
PAIR_TILE_LOADS = 4
PAIR_TILE_MAX_REGISTERS = 64
# Gathers of an NCHW fp16 image through the transpose (NHWC blocks) by words
# (`_make_pair_tile_gathers`): thread blocks of PAIR_GATHER_PAIRS channel pairs and the window rows
# whose image words fit a tile of PAIR_GATHER_WORDS words; False keeps the generic tile. Session 34,
# H100, graph, copy / ours, generic -> by words (`scripts/sbnet_variants.py --nchw --dtype float16
# --setting PAIR_TILE_GATHERS=False,True`, `results/sbnet_pair_tile_gathers_session34_h100.md`):
# windows of 16 every 16, 1 x 64 x 400 x 700 at 5 / 25 %: 0.21 -> 0.24, 0.13 -> 0.23; 8 x 64 at
# 50 %: 0.24 -> 0.45; 8 x 256, windows of 32 at 25 %: 0.20 -> 0.45; 18 every 16 from -1, 1 x 256 at
# 10 / 25 %: 0.20 -> 0.43, 0.22 -> 0.44.
PAIR_TILE_GATHERS = True
PAIR_GATHER_PAIRS = 16
PAIR_GATHER_WORDS = 6144  # (24 KB of shared memory)
WORD = 8  # bytes an overwriting channels-last copy moves per element when it can
HALF2 = 4  # bytes a channels-last fp16 add moves per element when it can (two values)


def _as_words(array, size=WORD):
    """The same memory as int64 (size 8) or int32 (size 4) words along the last axis (a view)."""
    if hasattr(array, "data_ptr"):  # torch
        import torch

        return array.view(torch.int64 if size == 8 else torch.int32)
    return array.view(np.int64 if size == 8 else np.int32)  # Numba and CuPy


def _row_path(image, blocks, n_blocks, channels_last, transpose, atomic, dtype, size, pixels):
    """The row kernels' (vector dtype, half2) where they apply, else None: channels-last
    images, pixels of whole 16-byte vectors, 16-byte aligned pointers, a grid's y and z
    within CUDA's limit (`_launch_copy`'s grids; a transposing tile of `pixels`); a
    transposing copy also needs float32 or float16."""
    itemsize = np.dtype(dtype).itemsize
    C = image.shape[3]
    size_h, size_w = size
    y, z = (-(-size_h * size_w // pixels), -(-C // ROW_TILE_C)) if transpose else (size_h, 1)
    if not (ROW_COPIES and channels_last and not atomic and C * itemsize % 16 == 0
            and data_pointer(image) % 16 == 0 and data_pointer(blocks) % 16 == 0
            and max(y, z) <= MAX_GRID_YZ and n_blocks * y * z <= MAX_GRID_X):
        return None
    if transpose:
        return (dtype, False) if dtype in ("float32", "float16") else None
    if dtype == "float16":
        return "int32", True
    return dtype, False


def _pair_path(scatter, add, atomic, image, blocks, channels_last, transpose, dtype, geometry):
    """Whether the pair kernels take a copy: `PAIRS`, NCHW fp16 image and blocks, rows of whole
    words on both sides (W and the window's width even, 4-byte aligned pointers), a row's words
    within a thread block, and for a scatter that is not atomic windows at even columns (even
    offset and stride: no half words at the rows' ends). With ``transpose`` (NHWC blocks: the
    pair tiles) adding scatters only, an even C and window rows of at most PAIR_TILE_PIXELS
    (session 28, H100, graph, copy / ours, generic tile -> pair tiles, 1 and 8 x C x 400 x 700:
    adding scatters 0.15-0.26 -> 0.19-0.36, atomic adds of 18 every 16 0.13-0.19 -> 0.19-0.23;
    overwrites even; gathers 0.12-0.29 -> 0.11-0.22, slower). Session 28, H100, graph, copy
    bandwidth / ours, element kernel -> pairs, 1 and 8 x C x 400 x 700: gathers 0.15-0.39 ->
    0.26-0.69; scatters at even columns 0.16-0.29 -> 0.22-0.37; atomic adds of 18 every 16 at -1
    0.15-0.19 -> 0.25-0.30; other scatters at odd columns 0.16-0.32 -> 0.15-0.31, mostly slower."""
    return (pair_shapes(scatter, add, atomic, image.shape, channels_last, transpose, dtype, geometry)
            and data_pointer(image) % 4 == 0 and data_pointer(blocks) % 4 == 0)


def pair_shapes(scatter, add, atomic, shape, channels_last, transpose, dtype, geometry):
    """`_pair_path` but for the pointers' alignment: whether the pair kernels would take a copy of
    an image of this shape and dtype (also `sbnet_torch`'s choice of an NCHW input's output layout)."""
    (size_h, size_w), (_, stride_w), (_, offset_w) = geometry
    if transpose and not (scatter and add and shape[1] % 2 == 0 and size_w <= PAIR_TILE_PIXELS
                          and -(-size_h // (PAIR_TILE_PIXELS // size_w)) <= MAX_GRID_YZ
                          and -(-shape[1] // (2 * PAIR_TILE_PAIRS)) <= MAX_GRID_YZ):
        return False
    return (PAIRS and not channels_last and dtype == "float16" and size_w % 2 == 0
            and shape[3] % 2 == 0 and size_w // 2 + 1 <= COPY_THREADS
            and (not scatter or atomic or (offset_w % 2 == 0 and stride_w % 2 == 0)))


def _pair_gather_rows(image, blocks, channels_last, dtype, geometry):
    """The window rows a thread block of `_make_pair_tile_gathers` takes where it takes a gather
    through the transpose, else None: `PAIR_TILE_GATHERS`, an NCHW fp16 image, W and C even, 4-byte
    aligned pointers, window rows of at most PAIR_TILE_PIXELS pixels and a grid within CUDA's
    limits."""
    (size_h, size_w), _, _ = geometry
    if not (PAIR_TILE_GATHERS and not channels_last and dtype == "float16" and image.shape[1] % 2 == 0
            and image.shape[3] % 2 == 0 and size_w <= PAIR_TILE_PIXELS
            and data_pointer(image) % 4 == 0 and data_pointer(blocks) % 4 == 0):
        return None
    words = (size_w + 2) >> 1  # a row's at most (a window at an odd column)
    rows = min(size_h, (PAIR_GATHER_WORDS // (2 * PAIR_GATHER_PAIRS) - 1) // words)
    if max(-(-image.shape[1] // (2 * PAIR_GATHER_PAIRS)), -(-size_h // rows)) > MAX_GRID_YZ:
        return None
    return rows


def _pair_halves(scatter, atomic, image, blocks, geometry):
    """Halves a word of a plain pair copy `_pair_path` took: 4 (int64 words) where
    `PAIR_HALVES` is 4, W and the window's width are multiples of 4, both pointers 8-byte
    aligned, and a scatter is not atomic and its windows start on such words (offset and
    stride multiples of 4); else 2."""
    (_, size_w), (_, stride_w), (_, offset_w) = geometry
    quad = (PAIR_HALVES == 4 and size_w % 4 == 0 and image.shape[3] % 4 == 0
            and data_pointer(image) % 8 == 0 and data_pointer(blocks) % 8 == 0
            and (not scatter or (not atomic and offset_w % 4 == 0 and stride_w % 4 == 0)))
    return 4 if quad else 2


def _strip_lanes(scatter, atomic, size_w, halves):
    """Lanes a window's row takes in a plain pair copy by strips (its destination words, one more
    for an atomic scatter, whose windows may start mid-word), or None where strips are off for the
    copy's kind (`PAIR_STRIPS`) or a warp would hold fewer than two windows."""
    lanes = size_w // halves + (1 if scatter and atomic else 0)
    if not scatter:
        kind = "gather"
    elif atomic:
        kind = "atomic"
    else:
        kind = "scatter quads" if halves == 4 else "scatter pairs"
    return lanes if kind in PAIR_STRIPS and 2 * lanes <= WARP else None


def _tiles(dtype, size, stride):
    """A transposing row copy's (tile pixels, whether its thread blocks go window by window):
    ROW_TILE_PIXELS_WIDE for fp32 where windows overlap, else ROW_TILE_PIXELS; window by
    window where windows overlap or the data are fp32 (ROW_TILE_WINDOW_MAJOR)."""
    overlap = stride[0] < size[0] or stride[1] < size[1]
    pixels = ROW_TILE_PIXELS_WIDE if overlap and dtype == "float32" else ROW_TILE_PIXELS
    if ROW_TILE_WINDOW_MAJOR is not None:
        return pixels, ROW_TILE_WINDOW_MAJOR
    return pixels, overlap or dtype == "float32"


def _flat(array, dtype):
    """The array's memory as a 1-D array of `dtype` (a view)."""
    return _as_dtype(array.reshape(-1) if hasattr(array, "data_ptr") else array.reshape(array.size), dtype)


def _as_dtype(array, dtype):
    """The array's memory as elements of `dtype` (a view; torch, Numba or CuPy)."""
    if hasattr(array, "data_ptr"):  # torch
        import torch

        return array.view(getattr(torch, dtype))
    return array.view(np.dtype(dtype))


def _launch_copy(scatter, image, blocks, indices, count, n_blocks, geometry, transpose, add, atomic,
                 channels_last, stream):
    (size_h, size_w), (stride_h, stride_w), (offset_h, offset_w) = geometry
    dtype = str(image.dtype).replace("torch.", "")
    itemsize = np.dtype(dtype).itemsize
    pixels, window_major = _tiles(dtype, (size_h, size_w), (stride_h, stride_w)) if transpose else (16, False)
    rows = _row_path(image, blocks, n_blocks, channels_last, transpose, atomic, dtype, (size_h, size_w), pixels)
    if rows is not None:
        vector_dtype, half2 = rows
        N, H, W, C = image.shape
        # A transposing copy's block side goes 4 values a step where every one starts aligned:
        # tiles start at multiples of 4 pixels of the window, channels at multiples of bh * bw.
        block_width = 4 if not transpose or size_h * size_w % 4 == 0 else 1
        key = ("rows", scatter, transpose, add, vector_dtype, half2, pixels, block_width, window_major)
        if key not in _kernels:
            _kernels[key] = _make_row_kernels(*key[1:])
        if transpose:
            grid, threads = (n_blocks, -(-size_h * size_w // pixels), -(-C // ROW_TILE_C)), ROW_TILE_THREADS
            if window_major:
                grid = (grid[0] * grid[1] * grid[2], 1, 1)
            per_pixel = C
        else:
            per_pixel = C * itemsize // 16  # vectors
            wanted = -(-size_w * per_pixel // ROW_UNROLL)
            grid, threads = (n_blocks, size_h), min(ROW_THREADS, max(WARP, -(-wanted // WARP) * WARP))
        args = (_flat(image, vector_dtype), _flat(blocks, vector_dtype), indices, count, N, H, W, per_pixel,
                size_h, size_w, stride_h, stride_w, offset_h, offset_w)
        launch(_kernels[key], grid, threads, stream, args)
        return (_kernels[key], grid, threads, args), (0, 1, 2, 3)
    rows = None if scatter or not transpose else _pair_gather_rows(image, blocks, channels_last, dtype, geometry)
    if rows is not None:
        key = ("pair gathers",)
        if key not in _kernels:
            _kernels[key] = _make_pair_tile_gathers()
        N, C, H, W = image.shape
        grid = (n_blocks, -(-C // (2 * PAIR_GATHER_PAIRS)), -(-size_h // rows))
        args = (_flat(image, "int32"), _flat(blocks, "int32"), indices, count, N, C, H, W, size_h, size_w,
                stride_h, stride_w, offset_h, offset_w, rows)
        launch(_kernels[key], grid, PAIR_TILE_THREADS, stream, args)
        return (_kernels[key], grid, PAIR_TILE_THREADS, args), (0, 1, 2, 3)
    if _pair_path(scatter, add, atomic, image, blocks, channels_last, transpose, dtype, geometry):
        halves = 2 if transpose else _pair_halves(scatter, atomic, image, blocks, geometry)
        lanes = None if transpose else _strip_lanes(scatter, atomic, size_w, halves)
        key = ("pairs", scatter, transpose, add, atomic, halves, lanes is not None)
        if key not in _kernels:
            _kernels[key] = (_make_pair_tile_kernels(atomic) if transpose
                             else _make_pair_kernels(scatter, add, atomic, halves, lanes is not None))
        N, C, H, W = image.shape
        if transpose:
            grid = (n_blocks, -(-size_h // (PAIR_TILE_PIXELS // size_w)), -(-C // (2 * PAIR_TILE_PAIRS)))
            threads = PAIR_TILE_THREADS
        else:
            if lanes is None:
                per_pass, groups = COPY_THREADS // (size_w // halves + 1), n_blocks  # rows a pass, at least
            else:
                per_pass, groups = COPY_THREADS // WARP, -(-n_blocks // (WARP // lanes))
            most = -(-C * size_h // (per_pass * PAIR_UNROLL))
            grid = (groups, max(1, min(most, -(-WAVES * multiprocessors() // max(groups, 1)))))
            threads = COPY_THREADS
        words = "int64" if halves == 4 else "int32"
        args = (_flat(image, words), _flat(blocks, words), indices, count,
                _flat(image, "float16"), N, C, H, W, size_h, size_w, stride_h, stride_w,
                offset_h, offset_w) + (() if transpose else (lanes or 0,))
        launch(_kernels[key], grid, threads, stream, args)
        return (_kernels[key], grid, threads, args), ((0, 4), 1, 2, 3)  # (args 0 and 4: one image)
    if (channels_last and not transpose and not add and image.shape[3] * itemsize % WORD == 0
            and data_pointer(image) % WORD == 0 and data_pointer(blocks) % WORD == 0):
        # An overwrite moves bits: channels-last rows go as 8-byte words, fewer and wider accesses.
        image, blocks, dtype = _as_words(image), _as_words(blocks), "int64"
    elif (channels_last and not transpose and add and dtype == "float16"
            and image.shape[3] * itemsize % HALF2 == 0
            and data_pointer(image) % HALF2 == 0 and data_pointer(blocks) % HALF2 == 0):
        # An fp16 add goes two channels a word: half the accesses, one add.rn.f16x2 for two
        # (atomic: one red.global.add.noftz.f16x2).
        image, blocks, dtype = _as_words(image, HALF2), _as_words(blocks, HALF2), "half2"
    kernel = _copy_kernel(scatter, transpose, add, atomic, dtype, channels_last)
    threads = (TILE, TILE_ROWS) if transpose else COPY_THREADS
    channels = image.shape[3 if channels_last else 1]
    # Enough thread blocks to fill the GPU a few times over, however few the windows:
    # each window is cut into parts (tiles, or slices of COPY_THREADS * COPY_UNROLL elements).
    if transpose:
        most = -(-size_h * size_w // TILE) * -(-channels // TILE)
    else:
        most = -(-size_h * size_w * channels // (COPY_THREADS * COPY_UNROLL))
    parts = max(1, min(most, -(-WAVES * multiprocessors() // max(n_blocks, 1))))
    args = (image, blocks, indices, count, size_h, size_w, stride_h, stride_w, offset_h, offset_w)
    launch(kernel, (n_blocks, parts), threads, stream, args)
    return (kernel, (n_blocks, parts), threads, args), (0, 1, 2, 3)



def _merge_path(out, y_op, blocks, n_blocks, geometry, channels_last, transpose, stream):
    """A merging scatter's (vector dtype, half2, first window, window counts, vectors a pixel,
    pixels a thread block) where it applies, else None: `MERGE`, blocks covering
    MERGE_MIN_COVER of the image, NHWC blocks and image, pixels of whole 16-byte vectors and
    16-byte aligned pointers, at most two windows over a pixel along each axis (2 * stride >=
    size), some window on the image, and the map, rows and grid within 32 bits and CUDA's
    limits. (y on the device only where the rest holds: a NumPy y is copied there once.)"""
    N, H, W, C = y_op.shape
    (size_h, size_w), (stride_h, stride_w), (offset_h, offset_w) = geometry
    itemsize = np.dtype(y_op.dtype).itemsize
    if not (MERGE and channels_last and not transpose and n_blocks < CHAINED
            and n_blocks * size_h * size_w >= MERGE_MIN_COVER * N * H * W
            and C * itemsize % 16 == 0 and 2 * stride_h >= size_h and 2 * stride_w >= size_w):
        return None
    # The windows that reach the image: start < H and start + size > 0.
    first = ((-offset_h - size_h) // stride_h + 1, (-offset_w - size_w) // stride_w + 1)
    counts = ((H - offset_h - 1) // stride_h - first[0] + 1, (W - offset_w - 1) // stride_w - first[1] + 1)
    vectors = C * itemsize // 16
    pixels = max(1, MERGE_VECTORS // vectors)
    if (min(counts) <= 0 or N * counts[0] * counts[1] >= 2**31 or N * H > MAX_GRID_X
            or -(-W // pixels) > MAX_GRID_YZ or max(abs(offset_h), abs(offset_w), H, W) >= 2**30
            or any(data_pointer(a) % 16 for a in (out, y_op.device(stream), blocks))):
        return None
    return ("int32", True) if y_op.dtype == "float16" else (y_op.dtype, False), first, counts, vectors, pixels


def _launch_merge(out, y, blocks, slots, chain, indices, count, n_blocks, geometry, add, path, stream):
    """The merging scatter's launches (empty the window map, link the blocks into it, merge each
    pixel; the first two one where the map and the rows are small), each as `launch` took it."""
    (vector_dtype, half2), first, counts, vectors, pixels = path
    (size_h, size_w), (stride_h, stride_w), (offset_h, offset_w) = geometry
    N, H, W, C = y.shape
    key = ("merge", add, vector_dtype, half2)
    if key not in _kernels:
        _kernels[key] = _make_merge_kernels(*key[1:])
    alone = max(slots.shape[0], n_blocks) <= LINK_ALONE
    most = -(-max(slots.shape[0], n_blocks) // WARP) * WARP
    link = (link_windows, 1, min(LINK_ALONE_THREADS, most)) if alone else \
        (link_windows, -(-n_blocks // LINK_THREADS), LINK_THREADS)
    launches = [] if alone else [(fill_int32, -(-slots.shape[0] // LINK_THREADS), LINK_THREADS, (slots, -1))]
    launched = []
    for kernel, grid, threads, args in (
            *launches,
            (*link, (slots, chain, indices, count, n_blocks, N, *counts, *first, int(alone))),
            (_kernels[key], (N * H, -(-W // pixels)),
             min(MERGE_THREADS, max(WARP, -(-min(pixels, W) * vectors // MERGE_UNROLL // WARP) * WARP)),
             (_flat(out, vector_dtype), _flat(y, vector_dtype), _flat(blocks, vector_dtype), slots, chain, N, H, W,
              vectors, size_h, size_w, stride_h, stride_w, offset_h + first[0] * stride_h,
              offset_w + first[1] * stride_w, *counts, pixels))):
        launch(kernel, grid, threads, stream, args)
        launched.append((kernel, grid, threads, args))
    return launched


# Gathers, scatters and reduce_mask called again with torch tensors of the same shapes,
# dtypes, device, geometry, flags and pointer alignment skip the general path (Operands,
# checks, kernel choice, argument fields: ~100 µs of Python a call, most of an SBNet block's
# host time): a kept plan allocates the outputs and rewrites the four pointers of the
# recorded launch (`_launch.Replay`), as bsmm's products do.
_plans = {}
MAX_PLANS = 256
_tensor_class = None  # torch.Tensor, once a plan exists (torch is imported by then)


class _Plan:
    """out_shape: the output's; extra: the device count's pointer (gathers and scatters without
    a count), or reduce_mask's (windows, chunks); launch: the replays, in order; buffers: a
    merging scatter's (window map, chain) sizes (int32 entries, one buffer), else None."""
    __slots__ = ("out_shape", "extra", "launch", "buffers")

    def __init__(self, out_shape, extra, launch, buffers=None):
        self.out_shape, self.extra, self.launch, self.buffers = out_shape, extra, launch, buffers


def _plan_key(call, tensors, count, settings):
    """Everything a call's checks and launch depend on, or None (not torch tensors, or settings
    that are not hashable)."""
    if not all(isinstance(t, _tensor_class) for t in tensors) or not (
            count is None or isinstance(count, _tensor_class)) or _arrays_module._poison_outputs:
        return None
    try:
        hash(settings)
    except TypeError:  # e.g. a list for bsize
        return None
    key = [call, settings, tensors[0].device, count is None or (count.shape, count.dtype)]
    for t in tensors:
        key += (t.shape, t.dtype, t.data_ptr() % 16)
    return tuple(key)


def _kept(call, tensors, count, settings):
    """The kept plan for a call of contiguous torch tensors, or None."""
    key = _plan_key(call, tensors, count, settings)
    plan = _plans.get(key) if key is not None else None
    if plan is None or not all(t.is_contiguous() for t in tensors):
        return None
    return plan


def _replayed(call, tensors, count, settings, inplace=False, out=None):
    """The call through its kept plan: a gather into a new tensor (or ``out``), a scatter into y
    itself (``inplace``) or into a copy of it; None where no plan fits (the general path runs
    and checks)."""
    plan = _kept(call, tensors, count, settings)
    if plan is None:
        return None
    # (the general path raises where what the call writes shares memory with what it reads)
    if call != "gather":
        if inplace and _arrays_module.tensors_overlap(tensors[2], (*tensors[:2], count)):
            return None
    elif out is not None and not (
            isinstance(out, _tensor_class) and out.shape == plan.out_shape and out.dtype == tensors[0].dtype
            and out.device == tensors[0].device and out.is_contiguous()
            and not _arrays_module.tensors_overlap(out, (*tensors, count))):
        return None
    stream = _arrays_module.torch_stream_handle()
    count = plan.extra if count is None else count.data_ptr()
    if call != "gather":
        return _scatter_replay(plan, stream, tensors[2], tensors[0].data_ptr(), tensors[1].data_ptr(), count, inplace)
    if out is None:
        out = tensors[0].new_empty(plan.out_shape)
    plan.launch[0](stream, tensors[0].data_ptr(), out.data_ptr(), tensors[1].data_ptr(), count)
    return out


def _scatter_replay(plan, stream, y, blocks, indices, count, inplace):
    """A scatter through its kept plan: into ``y`` (``inplace``), into a copy of it, or merged
    into a new tensor (the plan's buffers); ``blocks``, ``indices``, ``count``: pointers."""
    if plan.buffers is None:
        out = y if inplace else y.clone()
        plan.launch[0](stream, out.data_ptr(), blocks, indices, count)
        return out
    import torch

    out = torch.empty_like(y)
    windows, rows = plan.buffers
    # (freed once the launches are queued: stream order keeps it until they have run)
    scratch = torch.empty(windows + rows, dtype=torch.int32, device=y.device)
    slots = scratch.data_ptr()
    chain = slots + 4 * windows
    if len(plan.launch) == 3:
        plan.launch[0](stream, slots)
    plan.launch[-2](stream, slots, chain, indices, count)
    plan.launch[-1](stream, out.data_ptr(), y.data_ptr(), blocks, slots, chain)
    return out


def _replayed_reduce(mask, settings):
    """reduce_mask through its kept plan: (indices, count) as new tensors; None where no plan fits."""
    plan = _kept("reduce", (mask,), None, settings)
    if plan is None:
        return None
    import torch

    device = mask.device
    indices = torch.empty(plan.out_shape, dtype=torch.int32, device=device)
    count = torch.empty(1, dtype=torch.int32, device=device)
    stream = _arrays_module.torch_stream_handle()
    if plan.extra[0] == "pass":  # version 2: one launch on zeroed statuses
        status = _statuses(plan.extra[1], stream)
        status = data_pointer(status) if status is not None else \
            torch.zeros(plan.extra[1], dtype=torch.int64, device=device).data_ptr()
        plan.launch[0](stream, indices.data_ptr(), count.data_ptr(), status, mask.data_ptr())
        return indices, count
    _, total, n_chunks = plan.extra
    flags = torch.empty(total, dtype=torch.int8, device=device)
    chunk_counts = torch.zeros(n_chunks, dtype=torch.int32, device=device)
    pool, write = plan.launch
    pool(stream, flags.data_ptr(), chunk_counts.data_ptr(), mask.data_ptr())
    write(stream, indices.data_ptr(), count.data_ptr(), flags.data_ptr(), chunk_counts.data_ptr(),
          chunk_counts.data_ptr())
    return indices, count


def _gather_settings(bsize, bstride, boffset, transpose, data_format):
    return bsize, bstride, boffset, bool(transpose), data_format


def _scatter_settings(bsize, bstride, boffset, add, atomic, transpose, inplace, data_format):
    return bsize, bstride, boffset, bool(add), bool(atomic), bool(transpose), bool(inplace), data_format


def kept_launches(x, indices, blocks, count, bsize, bstride, boffset, transpose, data_format, inplace,
                  scatter_at=None, atomic=False, gather=True, scatter=True, scatter_transpose=None):
    """The kept launches of a gather of ``x`` and an adding scatter back into it (atomic or not;
    at the same geometry, or at ``scatter_at`` = (bsize, bstride, boffset); through the transpose
    as the gather, or as ``scatter_transpose`` says where given), both called once
    before with these tensors (``blocks``: the scatter's; the gather's ``out`` is of the same
    rows), or None. For a caller that repeats such a pair many times with its own buffers
    (`sbnet_torch`'s CUDA graphs): ``gather(stream handle, image, blocks, indices, count)``,
    pointers all, and ``scatter(stream handle, image, blocks, indices, count)``, the image a
    tensor, the rest pointers, returning the output (the image itself where ``inplace``), skip
    even the kept plans' lookups. Returns (gather, scatter, gather's count pointer, scatter's
    count pointer); a count pointer is None where the caller's ``count`` is to be passed.
    Without ``gather`` (a caller that gathers otherwise) the gather's launch and count pointer
    are None and only the scatter need have been called; without ``scatter`` likewise."""
    if not _plans:
        return None
    kept = added = None
    if gather:
        kept = _kept("gather", (x, indices), count, _gather_settings(bsize, bstride, boffset, transpose, data_format))
    if scatter:
        at = scatter_at or (bsize, bstride, boffset)
        added = _kept("scatter", (blocks, indices, x), count,
                      _scatter_settings(*at, True, atomic,
                                        transpose if scatter_transpose is None else scatter_transpose,
                                        inplace, data_format))
    if (gather and kept is None) or (scatter and added is None):
        return None
    extra = (kept and kept.extra, added and added.extra) if count is None else (None, None)
    return kept and kept.launch[0], added and functools.partial(_scatter_replay, added, inplace=inplace), *extra


def _keep_plan(call, tensors, count, settings, out_shape, launches, extra, buffers=None):
    """After a general-path call of torch tensors: keep its launches for `_replayed` (launches:
    (a launch as `_launch.replay` takes it, the positions of its pointer arguments) pairs;
    extra, buffers: see `_Plan`)."""
    global _tensor_class
    if _arrays_module._poison_outputs or not hasattr(tensors[0], "data_ptr"):
        return  # (data_ptr: a torch tensor; callers of other kinds need not have torch installed)
    import torch

    _tensor_class = torch.Tensor
    key = _plan_key(call, tensors, count, settings)
    kept = [replay(*launched, live=live) for launched, live in launches] if key is not None else [None]
    if None in kept:
        return
    if len(_plans) >= MAX_PLANS:
        _plans.clear()
    _plans[key] = _Plan(out_shape, extra, kept, buffers)


# -- public functions -------------------------------------------------------------


def _reduce_group_warps(size, total):
    """Warps pooling one window: enough for REDUCE_LOADS pixels a lane, at most a thread block,
    and no more than it takes to fill the GPU's warp slots once (more windows than that: the
    windows themselves fill it, and groups only add barriers). H100, graph µs, groups 1 / 2 / 4
    / 8 (`results/sbnet_reduce_mask_h100.md`): 1 x 400 x 700, windows of 32: 14.7 / 10.7 / 8.8
    / 8.5; 8 x 400 x 700, windows of 16 (8800): 19.5 / 22.9 / 36.2 / 62.4."""
    warps = 1
    while (warps < REDUCE_WARPS and warps * WARP * REDUCE_LOADS < size[0] * size[1]
           and total * warps < REDUCE_FILL * multiprocessors()):
        warps *= 2
    return warps


def _pass_chunks(size, total, vector=1):
    """(windows a chunk, lanes, phases) of reduce_mask's version 2: at least PASS_PIXELS_LARGE
    loads a chunk (`vector` pixels each) where that leaves at least half as many chunks as
    multiprocessors, else PASS_PIXELS, and at most a wave of chunks (PASS_WAVE), within
    PASS_WINDOWS windows and PASS_COLUMNS columns; a full chunk's threads across its columns
    (lanes) and rows (phases)."""
    sms = multiprocessors()
    wave = -(-total // (PASS_WAVE * sms)) if PASS_WAVE else 1
    most = max(1, min(PASS_WINDOWS, PASS_COLUMNS // size[1], total))
    for pixels in (PASS_PIXELS_LARGE, PASS_PIXELS):
        wanted = max(pixels * vector // (size[0] * size[1]), wave)
        per_chunk = max(1, min(most, wanted))
        if 2 * -(-total // per_chunk) >= sms:
            break
    if PASS_BALANCE == "one round" and -(-total // sms) <= most:
        per_chunk = -(-total // sms)
    elif PASS_BALANCE:
        rounds = -(-total // (per_chunk * sms))
        per_chunk = -(-total // (rounds * sms))
    lanes = min(per_chunk * (size[1] // vector), PASS_THREADS)
    return per_chunk, lanes, PASS_THREADS // lanes


def _fits_32_bits(H, W, count_hw, size, stride, offset):
    """Whether every row and column version 2 computes (image extents, window starts and ends,
    in 32 bits) stays below MAX_PASS_EXTENT in magnitude; else version 1 (64-bit) runs."""
    reach = [abs(o) + max(c - 1, 0) * abs(t) + z for c, t, o, z in zip(count_hw, stride, offset, size)]
    return max(H, W, *reach) < MAX_PASS_EXTENT


def _magic(d):
    """`_quotient`'s magic number of a divisor 1 <= d < 2^31: m = ceil(2^(31 + l) / d) with
    2^l >= d (m < 2^32), and the shift 31 + l above it. x * m / 2^(31 + l) exceeds x / d by
    less than x / 2^(31 + l) < 1 / d for x < 2^31, so its floor is x // d."""
    bits = (d - 1).bit_length()
    return (-(-(1 << (31 + bits)) // d)) | ((31 + bits) << 32)


def _pass_vector(dtype, mask, width, size, stride, offset):
    """PASS_VECTOR where every window's columns are whole aligned vectors of the mask (`mask`: its
    device array, of `dtype`), else 1."""
    v = PASS_VECTOR
    if v == 1 or dtype not in PASS_VECTOR_DTYPES:
        return 1
    fits = width % v == 0 and size[1] % v == 0 and stride[1] % v == 0 and offset[1] % v == 0
    return v if fits and aligned(data_pointer(mask), np.dtype(dtype).itemsize, v) else 1


def _pass_look_back(n_chunks):
    """(who looks back, words from one status to the next) for a launch of `n_chunks` chunks
    (16 words under PASS_TRACE, whose stamps take the spare ones)."""
    who = PASS_LOOK_BACK or ("block" if n_chunks >= PASS_BLOCK_LOOK_BACK else "warp")
    stride = 16 if PASS_TRACE else STATUS_STRIDE
    if stride is None:
        stride = 16 if who == "block" and (n_chunks + 1) * 16 <= STATUS_SPREAD_WORDS else 1
    return who, stride


def _pass_kernel(avgpool, wide, vector, look_back, stride):
    # The settings a kernel is built with are in its key: the launcher reads them at each call.
    ptx = _nan_max_ptx() if PASS_NAN_MAX is None else PASS_NAN_MAX == "ptx"
    key = ("pass", avgpool, wide, vector, look_back, stride, PASS_THREADS, PASS_WINDOWS, PASS_COLUMNS, PASS_LOADS,
           PASS_MAX_REGISTERS, PASS_LANE_ENTRIES, PASS_TRACE, ptx)
    if key not in _kernels:
        _kernels[key] = _make_pass_kernel(avgpool, wide, vector, look_back, stride, ptx)
    return _kernels[key]


@functools.cache
def _nan_max_ptx():
    """Whether this device has max.NaN.f32 (sm_80 on; the simulator runs the select)."""
    return not SIMULATOR and cuda.get_current_device().compute_capability >= (8, 0)


# Version 2's statuses carry their launch's tag (status[0] + 1; each launch's last chunk advances
# status[0]), so a buffer zeroed once serves every later launch that cannot run beside another
# on it: one buffer a stream (a stream's launches run in order), and one a stream of a graph
# capture (a graph's replays run in order). No zero fill a call: that fill, a second node of a
# replayed graph, was 1.3-2.3 µs of reduce_mask's 7-9 on an H100 (`benchmarks/NOTES.md`). A
# capture cannot zero a buffer without putting the fill in the graph, so it takes one zeroed and
# synchronized by an earlier call outside any capture (a spare); where none is left, the call
# zeroes scratch statuses as before. Buffers are kept for the process: a graph may be replayed at any time. (A
# stream destroyed with a launch still pending, whose handle a new stream gets before that launch
# ends, would share a buffer with it: torch never destroys its pooled streams.)
_status_buffers = {}  # (stream handle or (capture id, handle), words) -> statuses (on kernel_device)
_status_spares = {}  # words -> [zeroed statuses for the next capture]


def _zeroed_statuses(words, stream):
    statuses = cuda.device_array(words, np.int64, stream=stream)
    _zero(statuses, stream)
    return statuses


def _statuses(words, stream):
    """Kept statuses (`words` of them) for a version-2 launch on `stream` (a Numba stream or a
    raw handle), or None: zero scratch ones (a capture with no spare left)."""
    handle = stream if isinstance(stream, int) else stream_handle(stream)
    capture = capture_of(handle)
    if capture is None:
        numba_stream = stream_of(handle) if isinstance(stream, int) and not SIMULATOR else stream
        if not _status_spares.get(words):  # one for a capture to come, zeroed by then
            _status_spares[words] = [_zeroed_statuses(words, numba_stream)]
            if not SIMULATOR:
                numba_stream.synchronize()  # (the capture may go on another stream)
        key = (handle, words)
        if key not in _status_buffers:  # zeroed on the stream itself: before this launch, once
            _status_buffers[key] = _zeroed_statuses(words, numba_stream)
        return _status_buffers[key]
    key = ((capture, handle), words)
    if key not in _status_buffers:
        spares = _status_spares.get(words)
        if capture == -1 or not spares:
            return None
        _status_buffers[key] = spares.pop()
    return _status_buffers[key]


def reduce_mask(mask, bsize, bstride, boffset=0, tol=0.0, avgpool=False, bcount=None, version=None):
    """Active windows of a mask ``[N, H, W]``, row-major: ``(indices, count)`` (see the module
    docstring). ``version``: 1 (pooling, then compaction) or 2 (one pass; the default where
    windows are at most PASS_COLUMNS wide, else 1)."""
    settings = (bsize, bstride, boffset, tol, avgpool, bcount, version)
    if _plans:
        kept = _replayed_reduce(mask, settings)
        if kept is not None:
            return kept
    if version not in (None, 1, 2):
        raise ValueError(f"version: expected 1, 2 or None, got {version!r}")
    tol = check_tol(tol)
    mask_op = Operand(mask, "mask")
    if len(mask_op.shape) != 3:
        raise ValueError(f"mask: expected [N, H, W], got shape {mask_op.shape}")
    check_dtype(mask_op, MASK_DTYPES)
    mask_op.require_contiguous()
    size, stride, offset = check_geometry(bsize, bstride, boffset)
    N, H, W = mask_op.shape
    count_hw = block_count((H, W), stride, offset) if bcount is None else pair(bcount, "bcount")
    if min(count_hw) < 0:
        raise ValueError(f"bcount: expected non-negative counts, got {count_hw}")
    total = N * count_hw[0] * count_hw[1]
    stream = launch_stream((mask_op,))
    # Rows past the count hold n = -1 (the compaction writes them), a block every kernel skips,
    # should the count be forgotten.
    indices_native, indices = _int_output(mask_op, (max(total, 1), 3), stream, fill=None if total else -1)
    count_native, count = _int_output(mask_op, (1,), stream, fill=None if total else 0)
    one_pass = (REDUCE_VERSION if version is None else version) == 2 and size[1] <= PASS_COLUMNS \
        and total <= MAX_PASS_WINDOWS and _fits_32_bits(H, W, count_hw, size, stride, offset)
    if total and one_pass:
        mask_device = mask_op.device(stream)
        vector = _pass_vector(mask_op.dtype, mask_device, W, size, stride, offset)
        if vector > 1 and mask_op.dtype == "bool":
            mask_device = _as_dtype(mask_device, "uint8")  # (a vector of bools would load as bits)
        per_chunk, lanes, phases = _pass_chunks(size, total, vector)
        mask_device = mask_device.reshape(N * H * W)  # (the kernel indexes it flat)
        n_chunks = -(-total // per_chunk)
        # Zeroed statuses (tags start at 1): kept ones, else from the caller's allocator;
        # status[0] counts launches.
        look_back, spread = _pass_look_back(n_chunks)
        words = (n_chunks + 1) * spread
        status = _statuses(words, stream)
        if status is None:
            status = mask_op.scratch(words, "int64", stream)
            _zero(status, stream)
        kernel = _pass_kernel(bool(avgpool), bool(avgpool) or mask_op.dtype == "float64", vector, look_back, spread)
        one = (kernel, n_chunks, PASS_THREADS, (
            indices, count, status, mask_device, N, H, W, count_hw[0], count_hw[1], size[0], size[1],
            stride[0], stride[1], offset[0], offset[1], tol, per_chunk, lanes, phases,
            _magic(count_hw[0]), _magic(count_hw[1]), _magic(size[1] // vector), _magic(lanes)))
        launch(one[0], one[1], one[2], stream, one[3])
        _keep_plan("reduce", (mask,), None, settings, tuple(indices_native.shape), [(one, (0, 1, 2, 3))],
                   ("pass", words))
    elif total:
        # Temporaries from the caller's allocator (torch's cache): no cudaMalloc per call.
        group_warps = _reduce_group_warps(size, total)
        n_chunks = -(-total // COMPACT_THREADS)
        flags = mask_op.scratch(total, "int8", stream)
        chunk_counts = mask_op.scratch(n_chunks, "int32", stream)
        _zero(chunk_counts, stream)
        pool = (pool_kernel, -(-total // (REDUCE_WARPS // group_warps)), REDUCE_WARPS * WARP, (
            flags, chunk_counts, mask_op.device(stream), N, H, W, count_hw[0], count_hw[1], size[0], size[1],
            stride[0], stride[1], offset[0], offset[1], tol, bool(avgpool), group_warps))
        launch(pool[0], pool[1], pool[2], stream, pool[3])
        if n_chunks <= PREFIX_CHUNKS:
            write, block_offsets = write_summed, chunk_counts  # (block_offsets unread)
        else:
            block_offsets = mask_op.scratch(n_chunks, "int32", stream)
            launch(scan_kernel, 1, WARP, stream, (block_offsets, count, chunk_counts, n_chunks))
            write = write_scanned
        compact = (write, n_chunks, COMPACT_THREADS,
                   (indices, count, flags, chunk_counts, block_offsets, total, count_hw[0], count_hw[1]))
        launch(compact[0], compact[1], compact[2], stream, compact[3])
        if write is write_summed:  # (a plan of two launches; the scanned path has three)
            _keep_plan("reduce", (mask,), None, settings, tuple(indices_native.shape),
                       [(pool, (0, 1, 2)), (compact, (0, 1, 2, 3, 4))], ("two", total, n_chunks))
    if mask_op.kind == "numpy":
        n_active = int(count.copy_to_host(stream=stream)[0])
        return indices.copy_to_host(stream=stream)[:n_active], n_active
    return mask_op.result(indices_native, indices, stream), mask_op.result(count_native, count, stream)


def _int_output(op, shape, stream, fill):
    """An int32 output in the caller's kind, filled with `fill` (None: left as allocated):
    (native, device)."""
    if op.kind == "torch" and not SIMULATOR:
        import torch

        device = op.native.device
        native = torch.empty(shape, dtype=torch.int32, device=device) if fill is None \
            else torch.full(shape, fill, dtype=torch.int32, device=device)
        return native, native
    if op.kind == "cupy":
        import cupy

        native = cupy.empty(shape, np.int32) if fill is None else cupy.full(shape, fill, np.int32)
        return native, native
    if fill is None:
        device = cuda.device_array(shape, np.int32, stream=stream)
    else:
        device = cuda.to_device(np.full(shape, fill, np.int32), stream=stream)
    return device, device


def _zero(array, stream):
    """array[...] = 0 on the device, as a memset where the array's kind has one."""
    if hasattr(array, "zero_"):  # torch
        array.zero_()
    elif hasattr(array, "fill"):  # CuPy
        array.fill(0)
    elif SIMULATOR:
        array.copy_to_device(np.zeros(array.shape, array.dtype), stream=stream)
    else:  # Numba
        from numba.cuda.cudadrv.driver import device_memset

        device_memset(array, 0, array.nbytes, stream=stream)


_counts = {}


def _constant_count(n):
    """A device int32 [n], made once per n (kernels only read it): no copy to the device per call."""
    if n not in _counts:
        _counts[n] = cuda.to_device(np.array([n], np.int32))
    return _counts[n]


def _prepare_indices(indices, count, ops, stream, written=None):
    """Device indices and count, validated: (indices, count, n_blocks launched). ``written``: the
    operand the call writes, checked apart from the other ``ops``, the indices and the count."""
    idx = Operand(indices, "indices")
    if len(idx.shape) != 2 or idx.shape[1] != 3:
        raise ValueError(f"indices: expected [n_blocks, 3] of (n, bh, bw), got shape {idx.shape}")
    if idx.dtype != "int32":
        raise TypeError(f"indices: expected int32, got {idx.dtype}")
    check_same_kind((idx, *ops))
    idx.require_contiguous()
    cnt = None if count is None else Operand(count, "count")
    if written is not None:
        check_disjoint(written, (*(op for op in ops if op is not written), idx, cnt))
    if count is None:
        n_blocks = idx.shape[0]
        count_device = _constant_count(n_blocks)
    else:
        if cnt.shape != (1,) or cnt.dtype != "int32":
            raise ValueError(f"count: expected a one-element int32 array, got {cnt.shape} {cnt.dtype}")
        if cnt.kind == "numpy":
            if not 0 <= int(count[0]) <= idx.shape[0]:
                raise ValueError(f"count: expected 0..{idx.shape[0]}, got {int(count[0])}")
        n_blocks = idx.shape[0]  # the kernel skips blocks at and past count
        count_device = cnt.device(stream)
    return idx, count_device, n_blocks


def _check_format(data_format):
    if data_format not in ("NHWC", "NCHW"):
        raise ValueError(f"data_format: expected 'NHWC' or 'NCHW', got {data_format!r}")
    return data_format == "NHWC"


def _block_shape(n_blocks, size, channels, channels_last, transpose):
    return (n_blocks, *size, channels) if channels_last != transpose else (n_blocks, channels, *size)


def sparse_gather(x, indices, bsize, bstride, boffset=0, transpose=False, count=None, data_format="NHWC",
                  out=None):
    """Windows of ``x`` as a block stack in x's layout (``transpose``: in the other one).

    NHWC ``x`` gives ``[n_blocks, bh, bw, C]`` (``transpose``: ``[n_blocks, C, bh, bw]``);
    NCHW ``x`` the reverse. With a device ``count``, ``n_blocks`` is the indices' rows, and
    rows from the count on are zeros (as a window off the image gives): a stack that feeds
    convolutions and their weight gradients sees nothing there. ``out``: a C-contiguous
    device array of that shape and x's dtype to write into, returned (ValueError where it
    shares memory with x, the indices or the count); as with bsmm's ``out=``, under the
    simulator a torch ``out`` comes back as a new tensor.
    """
    settings = _gather_settings(bsize, bstride, boffset, transpose, data_format)
    if _plans:
        blocks = _replayed("gather", (x, indices), count, settings, out=out)
        if blocks is not None:
            return blocks
    channels_last = _check_format(data_format)
    x_op = Operand(x, "x")
    if len(x_op.shape) != 4:
        raise ValueError(f"x: expected {data_format}, got shape {x_op.shape}")
    check_dtype(x_op, DATA_DTYPES)
    x_op.require_contiguous()
    geometry = check_geometry(bsize, bstride, boffset)
    out_op = None if out is None else Operand(out, "out")
    stream = launch_stream((x_op,) if out is None else (x_op, out_op))
    idx, count_device, n_blocks = _prepare_indices(indices, count, (x_op,), stream, out_op)
    C = x_op.shape[3 if channels_last else 1]
    shape = _block_shape(n_blocks, geometry[0], C, channels_last, transpose)
    if out is None:
        native, blocks = x_op.empty(shape, stream)
    else:
        _check_out(out_op, x_op, shape)
        native, blocks = out_op.native, out_op.device(stream)
    if n_blocks and C:
        launched = _launch_copy(False, x_op.device(stream), blocks, idx.device(stream), count_device, n_blocks,
                                geometry, transpose, False, False, channels_last, stream)
        _keep_plan("gather", (x, indices), count, settings, tuple(shape), [launched], data_pointer(count_device))
    if out is not None and not (SIMULATOR and out_op.kind == "torch"):
        return out  # the caller's own array (an Operand holds a detached torch view of it)
    return (x_op if out is None else out_op).result(native, blocks, stream)


def _check_out(out_op, like, shape):
    """A gather's ``out``: a device array of the stack's shape, the input's dtype, C-contiguous."""
    if out_op.kind == "numpy":
        raise TypeError("out: expected a device array (a NumPy out= would be a copy)")
    check_same_kind((like, out_op))
    if out_op.dtype != like.dtype:
        raise TypeError(f"out: expected {like.dtype} (x's dtype), got {out_op.dtype}")
    check_shape(out_op, shape)
    out_op.require_contiguous()


def sparse_scatter(blocks, indices, y, bsize, bstride, boffset=0, add=False, atomic=False,
                   transpose=False, inplace=False, count=None, data_format="NHWC"):
    """Write (``add``: add) a block stack into ``y``: into a copy, or into ``y`` with ``inplace``.

    The blocks are in y's layout, or with ``transpose`` in the other one. ``add``
    without ``atomic`` raises where windows can overlap (a stride below the
    block) or where host indices repeat a window. Device indices are not read
    on the host (that would be a sync), so a window repeated in them is the
    caller's to avoid (`reduce_mask` never repeats one): pass ``atomic=True``
    for device indices that may repeat. With ``inplace``, ``y`` must not share
    memory with ``blocks``, the indices or the count (ValueError).
    """
    settings = _scatter_settings(bsize, bstride, boffset, add, atomic, transpose, inplace, data_format)
    if _plans:
        out = _replayed("scatter", (blocks, indices, y), count, settings, inplace)
        if out is not None:
            return out
    channels_last = _check_format(data_format)
    b_op, y_op = Operand(blocks, "blocks"), Operand(y, "y")
    if len(y_op.shape) != 4:
        raise ValueError(f"y: expected {data_format}, got shape {y_op.shape}")
    for op in (b_op, y_op):
        check_dtype(op, DATA_DTYPES)
        op.require_contiguous()
    if b_op.dtype != y_op.dtype:
        raise TypeError(f"dtype mismatch: blocks {b_op.dtype}, y {y_op.dtype}")
    geometry = check_geometry(bsize, bstride, boffset)
    size, stride, _ = geometry
    C = y_op.shape[3 if channels_last else 1]
    stream = launch_stream((b_op, y_op))
    idx, count_device, n_blocks = _prepare_indices(indices, count, (b_op, y_op), stream,
                                                   y_op if inplace else None)
    expected = _block_shape(n_blocks, size, C, channels_last, transpose)
    if b_op.shape != expected:
        raise ValueError(f"blocks: expected shape {expected} for {n_blocks} indices, got {b_op.shape}")
    if add and not atomic:
        if stride[0] < size[0] or stride[1] < size[1]:
            raise ValueError(
                f"add: windows of bsize {size} every bstride {stride} overlap; adding them needs atomic=True"
            )
        if idx.kind == "numpy" and len(np.unique(np.asarray(indices), axis=0)) != len(indices):
            raise ValueError("indices: repeated blocks would be added concurrently; pass atomic=True")
    if inplace:
        if y_op.kind == "numpy":
            raise TypeError("y: inplace needs a device array (a NumPy y is copied to the device)")
        native, out = y, y_op.device(stream)  # the caller's own object back (torch: not a detached alias)
    else:
        native, out = y_op.empty(y_op.shape, stream)
    path = None
    if not inplace and n_blocks and C:
        path = _merge_path(out, y_op, b_op.device(stream), n_blocks, geometry, channels_last, transpose, stream)
    if path is not None:  # one pass: every pixel of the copy written once
        windows = y_op.shape[0] * path[2][0] * path[2][1]
        _, scratch = _int_output(y_op, (windows + n_blocks,), stream, None)  # the map, then the chain
        launched = _launch_merge(out, y_op.device(stream), b_op.device(stream), scratch[:windows], scratch[windows:],
                                 idx.device(stream), count_device, n_blocks, geometry, add, path, stream)
        _keep_plan("scatter", (blocks, indices, y), count, settings, tuple(y_op.shape),
                   list(zip(launched, [(0,), (0, 1, 2, 3), (0, 1, 2, 3, 4)][-len(launched):])),
                   data_pointer(count_device), (windows, n_blocks))
        return y_op.result(native, out, stream)
    if not inplace:
        _device_copy(out, y_op, stream)
    if n_blocks and C:
        launched = _launch_copy(True, out, b_op.device(stream), idx.device(stream), count_device, n_blocks,
                                geometry, transpose, add, atomic, channels_last, stream)
        _keep_plan("scatter", (blocks, indices, y), count, settings, tuple(y_op.shape), [launched],
                   data_pointer(count_device))
    return y_op.result(native, out, stream)


def _device_copy(destination, source_op, stream):
    """destination[...] = the source operand's data, on the device."""
    if hasattr(destination, "copy_"):  # torch
        import torch

        destination.copy_(torch.as_tensor(source_op.native, device=destination.device))
    elif hasattr(destination, "copy_to_device"):  # Numba: from the host or the device
        source = source_op.native if source_op.kind == "numpy" else source_op.device(stream)
        destination.copy_to_device(source, stream=stream)
    else:  # CuPy
        import cupy

        destination[...] = cupy.asarray(source_op.native)
