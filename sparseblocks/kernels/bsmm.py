"""Block-sparse weight matmul on the GPU (twin of `reference/bsmm.py`).

Over a `BlockLayout` of ``(C/bs, K/bs)`` blocks with weights ``w[n_blocks, bs, bs]``:

* ``forward``:     ``y  = x · W``     (N, C) -> (N, K), over the layout's block-columns (CSC);
* ``input_grad``:  ``dx = dy · Wᵀ``   (N, K) -> (N, C), over its block-rows (CSR), reading
  each block transposed into shared memory (no transposed copy of ``w``);
* ``weight_grad``: ``dW = xᵀ · dy``   -> (n_blocks, bs, bs) on the layout's blocks only,
  optionally into ``out`` as ``out = xᵀ·dy + beta·out``.

``feature_axis=1`` activations are ``(N, features)``, ``feature_axis=0``
``(features, N)``; a compile-time flag swaps the indices (a transposed Numba
device array would be a copy). Storage float16, bfloat16 (int16 bits),
float32 or float64; all but float64 accumulate in float32. Any ``N >= 0``;
output features with no block are zero. Every sum runs in a fixed order (no
atomics), so results are bitwise repeatable.

Versions (``version=`` on every public function; by default 5 for fp16, bf16 and fp32, 4 for
fp64, see `default_version`; tests sweep all five):
  1. shared-memory tiles, one output element per thread. Simple; the
     baseline the others are checked against.
  2. register-blocked tiles: each thread owns an R x Q patch of the output
     and reads R + Q shared values per R*Q multiply-adds. Long block-lines
     are cut into segments (`BlockLayout.line_segments`) whose partial sums a
     second kernel adds in order, so a skewed layout does not leave one SM
     working alone; the weight gradient splits N when there are few blocks.
  3. version 2's products with batched, branch-free activation loads: eight
     independent loads in flight per thread instead of one. (A first try
     that pipelined chunks through register arrays ran 2x slower than
     version 2: see benchmarks/NOTES.md.) The weight gradient loads two rows
     of x and dy per step, branch-free, likewise.
  4. products with an 8 x 8 patch per thread (blocks 16, 32 and 64; block 8
     keeps version 3's kernel), 16-byte shared-memory reads from k-major
     tiles, chunks double-buffered through registers with one barrier per
     chunk, and 16-byte global loads (`_vector.py`) where the pointers are
     aligned. Unsigned indices keep Numba's negative-index wrap out of the
     address arithmetic. Its weight gradient (feature_axis 1, blocks 16-64;
     otherwise version 3's) gives each thread an 8 x 8 patch of one W block,
     sub-groups of threads one block each.
  5. tensor cores (blocks 16-64; otherwise version 4): ``mma.sync`` through
     inline PTX (`_mma.py`), m16n8k16 for fp16 and bf16, 3xTF32 (three
     m16n8k8) for fp32 with each step's result added in round-to-nearest
     fp32 (the tensor cores' own fp32 sums drift over long sums); 128-row
     product tiles handed out in groups of row tiles (`_grouped_tile`), a ring
     of three shared stages of 32-bit words fed by cp.async (activation rows)
     where loads are 16-byte rows, else two through registers, 16-byte global
     loads where aligned; the weight gradient on tensor cores too, each warp
     one patch of one block. Checked on an H100 against float64 and under
     memcheck (benchmarks/NOTES.md).
"""

import numpy as np
from numba import cuda, float32, float64, int16, int32, int64, uint32, uint64
from numba.cuda import libdevice

from .. import _arrays
from .._backend import SIMULATOR
from .._arrays import (
    Operand, check_dtype, check_same_dtype, check_same_kind, check_shape, launch_stream,
)
from ._async import commit, copy16_or_zero, copy16_to, global_address, shared_address, waiter
from ._launch import data_pointer, launch, multiprocessors, replay
from ._mma import MMA_M, MMA_N, make_mma_3xtf32, mma_3xtf32, mma_bf16, mma_f16, pack
from ._vector import aligned, load2, load4

# -- constants -----------------------------------------------------------------

VERSIONS = (1, 2, 3, 4, 5)

# Version 1: one thread per output element of ROWS_PER_TILE[bs] rows x bs features.
ROWS_PER_TILE = {8: 16, 16: 16, 32: 8, 64: 4}
# Version 1 weight gradient: bs columns x WGRAD_ROWS[bs] threads, bs / WGRAD_ROWS[bs] rows each.
WGRAD_ROWS = {8: 8, 16: 16, 32: 8, 64: 4}

# Version 2 products: a thread block owns TM rows x bs features of the output and
# walks the line's blocks KC features at a time; each of its 128 threads owns
# R rows x Q features. (TM, R, Q, KC) by block size:
PRODUCT_TILES = {8: (256, 8, 2, 8), 16: (256, 8, 4, 16), 32: (128, 8, 4, 32), 64: (128, 8, 8, 32)}
PRODUCT_THREADS = 128  # version 3 loads eight at a time: TM * KC is a multiple of 8 * 128
# Lines longer than SEGMENT_FACTOR x the mean line (and MIN_SEGMENT blocks) are cut.
SEGMENT_FACTOR = 2
MIN_SEGMENT = 4

# Version 2 weight gradient: 256 threads in G groups of (bs/Q)^2 threads, each
# thread an R x Q patch of the block; groups take interleaved rows of N
# chunks of WGRAD_CHUNK rows and are summed in order at the end.
WGRAD_THREADS = 256
WGRAD_PATCH = {8: 2, 16: 4, 32: 4, 64: 4}
WGRAD_CHUNK = 64
COMBINE_THREADS = 256
TRANSPOSE_THREADS = 256  # threads of `transpose_blocks`'s thread blocks (fewer for a small block)

# Version 4 products: each thread owns an 8 x 8 patch (two 4-row by two 4-column
# quarters, TM/2 rows and bs/2 features apart, so a warp's 16-byte shared reads
# fall in distinct banks); the tile is TM rows x bs features, so TM * bs / 64
# threads. Chunks of V4_KC features are double-buffered in shared memory.
V4_ROWS = {16: 256, 32: 256, 64: 128}  # block 8 runs version 3's kernel (too few outputs per load)
V4_KC = 8
# 16-byte alignment lets the compiler merge four shared loads into one; the
# simulator does not take an alignment.
SHARED_ALIGN = None if SIMULATOR else 16
V4_OPTIONS = {}  # extra cuda.jit options for version 4 (benchmarks try register caps)
# Version 4 weight gradient (feature_axis 1, blocks 16, 32 and 64; otherwise version 3's):
# sub-groups of (bs/8)^2 threads, each thread an 8 x 8 patch of one block, 128 threads
# a thread block (so 128 / (bs/8)^2 blocks each), V4_WGRAD_ROWS rows of N a chunk.
V4_WGRAD_THREADS = 128
V4_WGRAD_ROWS = {16: 16, 32: 16, 64: 32}
V4_WGRAD_BATCH = 32  # values of x (and of dy) each thread has in flight before storing them
# Version 4 reads 4 activations (and 2-4 weights) per instruction where pointers
# allow (kernels/_vector.py); False keeps every kernel on scalar loads.
V4_VECTOR = True
V4_WIDTH = 4  # activations per vector load (product and weight gradient)
# Shared tiles by block size: "swizzle" (row index XOR 4·kk) or "pad" (rows 4 floats
# longer); both free of bank conflicts. Whether the product's 8-step inner loop is
# written out (more registers, more shared loads in flight; the padded layout's
# offsets then fold into the instructions). Each the fastest measured on an H100
# with vector loads (scripts/bsmm_variants.py; benchmarks/NOTES.md).
V4_LAYOUT = {16: "pad", 32: "pad", 64: "pad"}
V4_UNROLL = {16: True, 32: True, 64: True}
# Version 5 (tensor cores; fp16, bf16 and fp32 storage, blocks 16-64; otherwise version
# 4): products with V5_WARPS warps, each a V5_WARP_ROWS x min(bs, V5_WARP_TILE) patch of the
# output: 128-row tiles.
V5_WARPS = {16: 4, 32: 4, 64: 8}
V5_WARP_TILE = 32  # the most output features a warp owns (and weight-gradient patches' side)
V5_WARP_ROWS = {16: 32, 32: 32, 64: 32}  # multiples of 16 (the mma's rows)
# (warps, rows a warp) of the cp.async ring's products (V5_STAGES > 2, 16-byte activation rows)
# where they differ: at block 64, 4 warps of 64 x 32 (each fragment read feeds twice the mma)
# rather than 8 of 32 x 32. H100, forward / input_grad ms, 4 against 8 warps (tenth session):
# N = 16384 fp16 25 % 0.899 / 0.764 against 0.926 / 0.870, 50 % 1.630 / 1.373 against 1.644 /
# 1.535 (torch BSR 1.000 and 1.523 there); N = 4096, 10 % and 50 %: fp32 0.394 / 0.334 against
# 0.410 / 0.390 and 1.637 / 1.435 against 1.682 / 1.655; fp16 0.147 / 0.134 against 0.152 /
# 0.144 and 0.451 / 0.386 against 0.452 / 0.410. 256-row tiles (16 warps of 32 rows, or 8 of
# 64) were slower (fp16, N = 16384, 50 %: 1.875 / 1.565 and 1.631 / 1.577). Register-staged
# kernels keep 8 warps: with half the threads each holds twice the next stage (ptxas: 204-235
# registers at feature_axis 0, local memory on the one-value loads); bf16's ring is left out
# too (a 256-byte stack frame with 4 warps; not timed).
V5_RING_WARPS = {(64, "float16"): (4, 64), (64, "float32"): (4, 64)}
# 32-bit words of k a product stage holds where not a whole block's, by (block size, storage).
# H100, N = C = K = 4096, forward ms at 10 % / 50 % (seventh session): a whole block a stage
# against 16 words, fp32 block 32 (three stages) 0.361 / 1.499 against 0.381 / 1.553, fp16
# block 64 0.159 / 0.453 against 0.163 / 0.560; but fp32 block 64 (two stages) 0.446 / 1.832
# against 0.403 / 1.682.
V5_STAGE_WORDS = {(64, "float32"): 16}
V5_BLOCKS = (16, 32, 64)
V5_STORAGE = ("float16", "bfloat16", "float32")
V5_VECTOR = True  # False keeps version 5 on one-value global loads
# Stages of a version 5 product in shared memory. 2: every load through registers, double-
# buffered. More (up to 5): where activation loads are 16-byte rows (feature_axis 1, vector
# loads) these, and fp32 weights read untransposed, go straight to shared memory through
# cp.async (kernels/_async.py), STAGES - 1 stages in flight; the other weights pass through
# registers. H100, N = C = K = 4096, forward ms at 10 % / 50 %, three stages against two
# (seventh session; the sixth session's comparison had replayed one kernel for both): fp32
# block 16 0.494 / 2.193 against 0.554 / 2.496, block 32 0.381 / 1.553 against 0.425 /
# 1.825, block 64 0.403 / 1.680 against 0.403 / 1.682; fp16 block 16 0.303 / 1.232 against
# 0.336 / 1.437, block 32 0.171 / 0.640 against 0.197 / 0.720. Four stages: no better.
V5_STAGES = 3
# In that ring, input_grad's weights go by cp.async too, as shared rows of k words (see
# `_make_product_v5`), except at the (block size, storage) named here, where they pass through
# registers, k-major, as with two stages. H100, N = 4096, input_grad ms at 10 % / 50 %, rows
# against registers: fp32 block 32 0.376 / 1.470 against 0.417 / 1.763, block 64 0.398 /
# 1.682 against 0.394 / 1.759; fp16 block 64 0.134 / 0.428 against 0.158 / 0.483 (N = 16384,
# 25 % / 50 %: 0.857 / 1.481 against 1.000 / 1.755); but fp16 block 32 0.195 / 0.638 against
# 0.174 / 0.566.
V5_WEIGHT_REGISTERS = {(32, "float16"), (32, "bfloat16")}
# Forward products in that ring at the (block size, storage) named here, with at least the
# given rows N, first copy W's blocks, transposed, into the forward's (column) order
# (`transpose_blocks`, into a scratch array the size of w), and then run input_grad's kernel
# over that copy with the forward's schedule: W's units then go by cp.async as shared rows of
# k words rather than (16-bit) through registers and k-major. Only where input_grad's weights
# go as rows (not V5_WEIGHT_REGISTERS). Measured (H100, twelfth session, C = K = 4096,
# densities 10 / 50 %, forward ms direct -> through the copy): fp32 block 64 N = 16384
# 1.320 -> 1.195, 5.799 -> 5.320; N = 4096 0.397 -> 0.391, 1.594 -> 1.489; N = 1024 0.155 ->
# 0.150, 0.595 -> 0.539. fp16 block 64 N = 16384 0.471 -> 0.448, 1.612 -> 1.440 (the one
# forward that was slower than torch BSR, now 1.16x faster); but N = 4096 0.136 -> 0.175
# (0.132 -> 0.138 in a second run), 0.464 -> 0.442, and N = 1024 0.062 -> 0.078, 0.135 ->
# 0.166: the copy's own ~15-30 us (a second launch; 2 x w's bytes) outweighs the gain
# below ~8192 rows. Blocks 16 and 32: within +-5 % either way, fp16 block 16 10-40 % slower.
V5_TRANSPOSED_FORWARD = {(64, "float32"): 1, (64, "float16"): 8192, (64, "bfloat16"): 8192}
# fp32 on version 5 (3xTF32): the tensor cores' own fp32 sums drift (relative error 3.2e-6
# over 410-term sums, 1.5e-5 over 2048, H100). True starts each mma from zero and adds its
# 8-term result in round-to-nearest fp32: 6.6e-7 as version 4, forward 0.448-0.488 ms against
# 0.448-0.456 without over two runs (block 32, 10 %, N = C = K = 4096; benchmarks/NOTES.md).
V5_ROUNDED_SUMS = True
# fp32's 3xTF32 split keeps a NaN operand a NaN (`_mma.make_mma_3xtf32`): the GPU's NaN is
# 0x7FFFFFFF, whose rounding by the bits carried into the sign and gave a finite product. One
# more instruction a split; False: the split of sessions 6-29 (timed beside it: NOTES.md, session 30).
V5_NAN_SAFE = True
# Version 5's weight gradient on tensor cores (`_make_weight_grad_v5`): four warps a thread
# block. H100, 10 %, N = 4096, blocks 32 / 64 / 16: fp16 0.260 / 0.266 / 0.575 ms against
# version 4's 0.774 / 0.654 / 1.084; fp32 0.615 / 0.626 / 0.904 against 0.807 / 0.667 /
# 1.230. False: version 5 takes version 4's weight gradient.
V5_WGRAD = True
V5_WGRAD_WARPS = 4
# fp32 with feature_axis 1 and vector loads: the weight gradient's rows of x and dy go
# straight to shared memory by cp.async (rows past the end as zeros), not through registers.
V5_WGRAD_ASYNC = True
V5_WGRAD_STAGES = 2  # buffers of that cp.async ring a warp (2 to 4): STAGES - 1 steps in flight
# Blocks of one block-row a warp of that weight gradient takes together, sharing x's slice
# (`_make_weight_grad_v5`'s group), by block size (blocks 16 and 32 only; absent: 1).
V5_WGRAD_GROUP = {16: 4}
V5_WGRAD_GROUP_WARPS = 4  # warps (segments) a thread block of the grouped weight gradient
V5_WGRAD_ROWS = 32  # N-splits are cut at multiples of it (whole steps of every storage)
# Thread blocks of a product (versions 4 and 5) are handed out in groups of PRODUCT_GROUP
# row tiles: within a group, every segment of the first row tile's neighbours before the
# next segment, so the thread blocks running at once share a few row tiles of activations
# (which stay in L2) instead of each segment streaming all N rows from DRAM in turn. 0 keeps
# the launch order (row tiles fastest). See `_grouped_tile`.
PRODUCT_GROUP = 8
# Storage that runs version 5 when a call names no version (see default_version).
TENSOR_CORE_DEFAULT = ("float16", "bfloat16", "float32")

# -- device helpers ---------------------------------------------------------------


def _activation_io(feature_axis):
    """load(a, row, feature) and store(a, row, feature, value) for activations of either axis."""
    if feature_axis == 1:

        @cuda.jit(device=True, inline=True)
        def load(a, row, feature):
            return a[row, feature]

        @cuda.jit(device=True, inline=True)
        def store(a, row, feature, value):
            a[row, feature] = value
    else:

        @cuda.jit(device=True, inline=True)
        def load(a, row, feature):
            return a[feature, row]

        @cuda.jit(device=True, inline=True)
        def store(a, row, feature, value):
            a[feature, row] = value

    return load, store


def _activation_vector_load(feature_axis, width):
    """load(a, row, feature) -> tuple of ``width`` activations from (row, feature) on,
    along the contiguous axis (features with feature_axis 1, rows with 0)."""
    vector = {2: load2, 4: load4}.get(width)
    if width == 1:
        scalar, _ = _activation_io(feature_axis)

        @cuda.jit(device=True, inline=True)
        def load(a, row, feature):
            return (scalar(a, row, feature),)
    elif feature_axis == 1:

        @cuda.jit(device=True, inline=True)
        def load(a, row, feature):
            return vector(a, (row, feature))
    else:

        @cuda.jit(device=True, inline=True)
        def load(a, row, feature):
            return vector(a, (feature, row))

    return load


def _weight_vector_load(transpose_w, width):
    """load(w, block, k, col) -> tuple of ``width`` weights of W (or Wᵀ) from (k, col) on,
    along the block's contiguous axis (col of W; k of Wᵀ)."""
    vector = {2: load2, 4: load4}.get(width)
    if width == 1:

        @cuda.jit(device=True, inline=True)
        def load(w, block, k, col):
            return (w[block, col, k] if transpose_w else w[block, k, col],)
    elif transpose_w:

        @cuda.jit(device=True, inline=True)
        def load(w, block, k, col):
            return vector(w, (block, col, k))
    else:

        @cuda.jit(device=True, inline=True)
        def load(w, block, k, col):
            return vector(w, (block, k, col))

    return load


def _converters(storage, acc_type):
    """to_acc(stored) -> accumulator value, from_acc(value) -> what is stored."""
    if storage == "bfloat16":

        @cuda.jit(device=True, inline=True)
        def to_acc(bits):
            return libdevice.int_as_float(int32(bits) << 16)

        @cuda.jit(device=True, inline=True)
        def from_acc(value):
            # Round to nearest even on the upper 16 bits of the float32.
            u = int64(libdevice.float_as_int(float32(value))) & 0xFFFFFFFF
            r = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16) & 0xFFFF
            return int16(r - 0x10000 if r >= 0x8000 else r)
    else:

        @cuda.jit(device=True, inline=True)
        def to_acc(value):
            return acc_type(value)

        @cuda.jit(device=True, inline=True)
        def from_acc(value):
            return value

    return to_acc, from_acc


def _chunk_position(feature_axis, rows, features):
    """position(e) -> (row, feature) of element e of a rows x features chunk of activations,
    numbered so that consecutive e are consecutive addresses in either layout."""
    if feature_axis == 1:

        @cuda.jit(device=True, inline=True)
        def position(e):
            return e // features, e % features
    else:

        @cuda.jit(device=True, inline=True)
        def position(e):
            return e % rows, e // rows

    return position


def _product_output(bs, storage, acc_type, feature_axis):
    """emit(out, workspace, slot, line, row, col, value): one result of a product, for feature
    col of block-line `line`, into out, or (slot >= 0: a segment of a split line) into its
    workspace slot, which the combine kernel sums in order."""
    _, store = _activation_io(feature_axis)
    _, from_acc = _converters(storage, acc_type)

    @cuda.jit(device=True, inline=True)
    def emit(out, workspace, slot, line, row, col, value):
        if slot < 0:
            store(out, row, line * bs + col, from_acc(value))
        else:
            workspace[slot, row, col] = value

    return emit


def _weight_grad_output(bs, storage, acc_type):
    """finish(dw, workspace, block, split, r, col, total, beta): one element of a weight
    gradient's block, into dw (+ beta·dw), or with several N-splits into the workspace slot
    of its split, which the combine kernel sums in order."""
    to_acc, from_acc = _converters(storage, acc_type)

    @cuda.jit(device=True, inline=True)
    def finish(dw, workspace, block, split, r, col, total, beta):
        if workspace.shape[0] > 1:
            workspace[split, block, r * bs + col] = total
        else:
            if beta != 0:
                total += acc_type(beta) * to_acc(dw[block, r, col])
            dw[block, r, col] = from_acc(total)

    return finish


def _mma_accumulate(storage):
    """accumulate(acc, i, nt, fa, mt, b0, b1): acc[i, nt] += A·B for one version 5 mma tile, A
    the fragment words fa[mt], B the words b0, b1. fp32 (3xTF32) with V5_ROUNDED_SUMS starts
    the mma from zero and adds its result in round-to-nearest fp32: the tensor cores' own fp32
    sums drift over long sums (benchmarks/NOTES.md)."""
    mma = (mma_3xtf32 if V5_NAN_SAFE else make_mma_3xtf32(nan_safe=False)) if storage == "float32" \
        else (mma_bf16 if storage == "bfloat16" else mma_f16)
    ROUNDED_SUMS = V5_ROUNDED_SUMS and storage == "float32"

    @cuda.jit(device=True, inline=True)
    def accumulate(acc, i, nt, fa, mt, b0, b1):
        if ROUNDED_SUMS:
            d = mma(fa[mt, 0], fa[mt, 1], fa[mt, 2], fa[mt, 3], b0, b1,
                    float32(0), float32(0), float32(0), float32(0))
            for q in range(4):
                acc[i, nt, q] += d[q]
        else:
            d = mma(fa[mt, 0], fa[mt, 1], fa[mt, 2], fa[mt, 3], b0, b1,
                    acc[i, nt, 0], acc[i, nt, 1], acc[i, nt, 2], acc[i, nt, 3])
            for q in range(4):
                acc[i, nt, q] = d[q]

    return accumulate


@cuda.jit(device=True, inline=True)
def _grouped_tile(group):
    """(row tile, segment) of this thread block of a (row tiles, segments) product grid, handed
    out `group` row tiles at a time: launch order id = x + y * tiles walks the group's tiles
    fastest, then its segments, then the next group. Every (tile, segment) pair once."""
    tiles = uint32(cuda.gridDim.x)
    if group == 0 or group >= tiles:
        return cuda.blockIdx.x, cuda.blockIdx.y
    span = uint32(group) * uint32(cuda.gridDim.y)
    pid = uint32(cuda.blockIdx.x) + uint32(cuda.blockIdx.y) * tiles
    first = (pid // span) * uint32(group)
    local = pid % span
    rows = min(tiles - first, uint32(group))
    return int32(first + local % rows), int32(local // rows)


@cuda.jit(device=True, inline=True)
def _interleave(x0, x1, c):
    """Word c (0-7) of the 16-bit pairs (k, k + 1) of eight neighbours, from x0, four words of
    eight values at k, and x1, the same eight at k + 1 (version 5's loads across k)."""
    lo = uint32(x0[c // 2])
    hi = uint32(x1[c // 2])
    if c % 2 == 0:
        return uint32((lo & uint32(0xFFFF)) | (hi << uint32(16)))
    return uint32((lo >> uint32(16)) | (hi & uint32(0xFFFF0000)))


@cuda.jit(device=True, inline=True)
def _add_outer_8x8(acc, u, v):
    """acc += u ⊗ v for version 4's 8 x 8 patch (both kernels)."""
    for i in range(8):
        for q in range(8):
            acc[i, q] += u[i] * v[q]


# -- kernel bodies: version 1 --------------------------------------------------------


def _make_product_v1(bs, storage, acc_type, transpose_w, feature_axis):
    """out[:, line-block] = sum over the line's blocks: a[:, other-block] · w[b] (or w[b]ᵀ)."""
    rows = ROWS_PER_TILE[bs]
    load, store = _activation_io(feature_axis)
    to_acc, from_acc = _converters(storage, acc_type)

    @cuda.jit
    def product_v1(out, a, w, line_ptr, other_idx, line_block, n_rows):
        tx = cuda.threadIdx.x
        ty = cuda.threadIdx.y
        line = cuda.blockIdx.y
        row = cuda.blockIdx.x * rows + ty
        a_tile = cuda.shared.array((rows, bs), acc_type)
        w_tile = cuda.shared.array((bs, bs), acc_type)
        acc = acc_type(0)
        for j in range(line_ptr[line], line_ptr[line + 1]):
            other = other_idx[j]
            block = j if transpose_w else line_block[j]
            a_tile[ty, tx] = to_acc(load(a, row, other * bs + tx)) if row < n_rows else acc_type(0)
            for e in range(ty * bs + tx, bs * bs, rows * bs):
                r = e // bs
                c = e - r * bs
                if transpose_w:
                    w_tile[c, r] = to_acc(w[block, r, c])
                else:
                    w_tile[r, c] = to_acc(w[block, r, c])
            cuda.syncthreads()  # a_tile and w_tile are loaded
            for i in range(bs):
                acc += a_tile[ty, i] * w_tile[i, tx]
            cuda.syncthreads()  # every thread is done reading before the next load
        if row < n_rows:
            store(out, row, line * bs + tx, from_acc(acc))

    return product_v1


def _make_weight_grad_v1(bs, storage, acc_type, feature_axis):
    """dw[b] = x[:, c-block]ᵀ · dy[:, k-block] (+ beta·dw[b]), reducing over all N rows."""
    rows = WGRAD_ROWS[bs]
    per_thread = bs // rows
    load, _ = _activation_io(feature_axis)
    to_acc, from_acc = _converters(storage, acc_type)

    @cuda.jit
    def weight_grad_v1(dw, x, dy, coords, n_rows, beta):
        tx = cuda.threadIdx.x
        ty = cuda.threadIdx.y
        block = cuda.blockIdx.x
        c = coords[block, 0]
        k = coords[block, 1]
        x_tile = cuda.shared.array((rows, bs), acc_type)
        dy_tile = cuda.shared.array((rows, bs), acc_type)
        acc = cuda.local.array(per_thread, acc_type)
        for m in range(per_thread):
            acc[m] = acc_type(0)
        for n0 in range(0, n_rows, rows):
            n = n0 + ty
            x_tile[ty, tx] = to_acc(load(x, n, c * bs + tx)) if n < n_rows else acc_type(0)
            dy_tile[ty, tx] = to_acc(load(dy, n, k * bs + tx)) if n < n_rows else acc_type(0)
            cuda.syncthreads()  # both tiles are loaded
            for r in range(rows):
                d = dy_tile[r, tx]
                for m in range(per_thread):
                    acc[m] += x_tile[r, ty + m * rows] * d
            cuda.syncthreads()  # every thread is done reading before the next load
        for m in range(per_thread):
            value = acc[m]
            if beta != 0:
                value += acc_type(beta) * to_acc(dw[block, ty + m * rows, tx])
            dw[block, ty + m * rows, tx] = from_acc(value)

    return weight_grad_v1


# -- kernel bodies: version 2 --------------------------------------------------------


def _make_product_v2(bs, storage, acc_type, transpose_w, feature_axis):
    """Register-blocked product over line segments; split lines go to a workspace."""
    TM, R, Q, KC = PRODUCT_TILES[bs]
    T = PRODUCT_THREADS
    QX = bs // Q  # threads across the features of the tile
    # +1 column: the transposed stores of one warp land in distinct banks.
    A_SHAPE = (KC, TM + 1)
    W_SHAPE = (KC, bs + 1)
    load, _ = _activation_io(feature_axis)
    to_acc, _ = _converters(storage, acc_type)
    emit = _product_output(bs, storage, acc_type, feature_axis)

    @cuda.jit
    def product_v2(out, workspace, a, w, seg_line, seg_begin, seg_end, seg_slot,
                   other_idx, line_block, n_rows):
        tid = cuda.threadIdx.x
        tx = tid % QX
        ty = tid // QX
        seg = cuda.blockIdx.y
        row0 = cuda.blockIdx.x * TM
        line = seg_line[seg]
        a_s = cuda.shared.array(A_SHAPE, acc_type)
        w_s = cuda.shared.array(W_SHAPE, acc_type)
        acc = cuda.local.array((R, Q), acc_type)
        a_frag = cuda.local.array(R, acc_type)
        w_frag = cuda.local.array(Q, acc_type)
        for i in range(R):
            for q in range(Q):
                acc[i, q] = acc_type(0)
        for j in range(seg_begin[seg], seg_end[seg]):
            other = other_idx[j]
            block = j if transpose_w else line_block[j]
            for k0 in range(0, bs, KC):
                for e0 in range(0, TM * KC, T):
                    e = e0 + tid
                    # Consecutive threads read consecutive addresses of `a`.
                    if feature_axis == 1:
                        r = e // KC
                        kk = e - r * KC
                    else:
                        kk = e // TM
                        r = e - kk * TM
                    value = acc_type(0)
                    if row0 + r < n_rows:
                        value = to_acc(load(a, row0 + r, other * bs + k0 + kk))
                    a_s[kk, r] = value
                for e0 in range(0, KC * bs, T):
                    e = e0 + tid
                    if e < KC * bs:
                        if transpose_w:
                            col = e // KC
                            kk = e - col * KC
                            w_s[kk, col] = to_acc(w[block, col, k0 + kk])
                        else:
                            kk = e // bs
                            col = e - kk * bs
                            w_s[kk, col] = to_acc(w[block, k0 + kk, col])
                cuda.syncthreads()  # a_s and w_s hold this chunk
                for kk in range(KC):
                    for i in range(R):
                        a_frag[i] = a_s[kk, ty * R + i]
                    for q in range(Q):
                        w_frag[q] = w_s[kk, tx * Q + q]
                    for i in range(R):
                        for q in range(Q):
                            acc[i, q] += a_frag[i] * w_frag[q]
                cuda.syncthreads()  # everyone is done with this chunk before it is overwritten
        slot = seg_slot[seg]
        for i in range(R):
            row = row0 + ty * R + i
            if row < n_rows:
                for q in range(Q):
                    col = tx * Q + q
                    emit(out, workspace, slot, line, row, col, acc[i, q])

    return product_v2


def _make_product_v3(bs, storage, acc_type, transpose_w, feature_axis):
    """Version 2's product with batched, branch-free activation loads.

    Version 2 loads each activation value and stores it to shared memory in
    a loop the compiler does not unroll, so a thread waits out the latency of
    every load in turn. Here each thread issues eight independent loads before
    its eight stores, and out-of-range rows read a clamped (valid) row and are
    zeroed by a select instead of a branch.
    """
    TM, R, Q, KC = PRODUCT_TILES[bs]
    T = PRODUCT_THREADS
    QX = bs // Q
    A_SHAPE = (KC, TM + 1)  # +1 column: transposed stores hit distinct banks
    W_SHAPE = (KC, bs + 1)
    load, _ = _activation_io(feature_axis)
    to_acc, _ = _converters(storage, acc_type)
    emit = _product_output(bs, storage, acc_type, feature_axis)

    position = _chunk_position(feature_axis, TM, KC)

    @cuda.jit(device=True, inline=True)
    def a_value(a, row, n_rows, feature):
        value = to_acc(load(a, min(row, n_rows - 1), feature))
        return value if row < n_rows else acc_type(0)

    @cuda.jit
    def product_v3(out, workspace, a, w, seg_line, seg_begin, seg_end, seg_slot,
                   other_idx, line_block, n_rows):
        tid = cuda.threadIdx.x
        tx = tid % QX
        ty = tid // QX
        seg = cuda.blockIdx.y
        row0 = cuda.blockIdx.x * TM
        line = seg_line[seg]
        a_s = cuda.shared.array(A_SHAPE, acc_type)
        w_s = cuda.shared.array(W_SHAPE, acc_type)
        acc = cuda.local.array((R, Q), acc_type)
        a_frag = cuda.local.array(R, acc_type)
        w_frag = cuda.local.array(Q, acc_type)
        for i in range(R):
            for q in range(Q):
                acc[i, q] = acc_type(0)
        for j in range(seg_begin[seg], seg_end[seg]):
            block = j if transpose_w else line_block[j]
            for k0 in range(0, bs, KC):
                base = other_idx[j] * bs + k0
                for e0 in range(tid, TM * KC, 8 * T):
                    r0, c0 = position(e0)
                    r1, c1 = position(e0 + T)
                    r2, c2 = position(e0 + 2 * T)
                    r3, c3 = position(e0 + 3 * T)
                    r4, c4 = position(e0 + 4 * T)
                    r5, c5 = position(e0 + 5 * T)
                    r6, c6 = position(e0 + 6 * T)
                    r7, c7 = position(e0 + 7 * T)
                    v0 = a_value(a, row0 + r0, n_rows, base + c0)
                    v1 = a_value(a, row0 + r1, n_rows, base + c1)
                    v2 = a_value(a, row0 + r2, n_rows, base + c2)
                    v3 = a_value(a, row0 + r3, n_rows, base + c3)
                    v4 = a_value(a, row0 + r4, n_rows, base + c4)
                    v5 = a_value(a, row0 + r5, n_rows, base + c5)
                    v6 = a_value(a, row0 + r6, n_rows, base + c6)
                    v7 = a_value(a, row0 + r7, n_rows, base + c7)
                    a_s[c0, r0] = v0
                    a_s[c1, r1] = v1
                    a_s[c2, r2] = v2
                    a_s[c3, r3] = v3
                    a_s[c4, r4] = v4
                    a_s[c5, r5] = v5
                    a_s[c6, r6] = v6
                    a_s[c7, r7] = v7
                for e in range(tid, KC * bs, T):
                    if transpose_w:
                        col = e // KC
                        kk = e - col * KC
                        w_s[kk, col] = to_acc(w[block, col, k0 + kk])
                    else:
                        kk = e // bs
                        col = e - kk * bs
                        w_s[kk, col] = to_acc(w[block, k0 + kk, col])
                cuda.syncthreads()  # a_s and w_s hold this chunk
                for kk in range(KC):
                    for i in range(R):
                        a_frag[i] = a_s[kk, ty * R + i]
                    for q in range(Q):
                        w_frag[q] = w_s[kk, tx * Q + q]
                    for i in range(R):
                        for q in range(Q):
                            acc[i, q] += a_frag[i] * w_frag[q]
                cuda.syncthreads()  # everyone is done with this chunk before it is overwritten
        slot = seg_slot[seg]
        for i in range(R):
            row = row0 + ty * R + i
            if row < n_rows:
                for q in range(Q):
                    col = tx * Q + q
                    emit(out, workspace, slot, line, row, col, acc[i, q])

    return product_v3


def _v4_threads(bs):
    """Threads of a version 4 product's thread block: an 8 x 8 patch each over V4_ROWS[bs] x bs."""
    return V4_ROWS[bs] * bs // 64


def _v4_weight_width(bs):
    """Weights per vector load of a version 4 product: its V4_KC x bs chunk shared by the
    threads, at most V4_WIDTH each."""
    return min(V4_WIDTH, V4_KC * bs // _v4_threads(bs))


def _make_product_v4(bs, storage, acc_type, transpose_w, feature_axis, vector=False):
    """Register-blocked 8 x 8 per thread, 16-byte shared reads, double-buffered chunks.

    Each chunk of V4_KC features is loaded from global memory into registers
    while the previous chunk is multiplied out of shared memory, then stored
    to the other shared buffer: one barrier per chunk. Shared tiles are
    stored k-major, swizzled (the row index XOR 4·kk) or padded (rows 4
    floats longer), so the transposing stores of a warp (8 features x 4
    rows) and its 16-byte reads (8 distinct row quads) are both free of bank
    conflicts. With ``vector`` (the launcher checked alignment) the global
    loads read 4 activations and 2-4 weights at a time.
    """
    TM = V4_ROWS[bs]
    KC = V4_KC
    UNROLL = V4_UNROLL[bs]
    T = _v4_threads(bs)
    TX = bs // 8  # threads across the tile's features
    HALF_M = TM // 2
    HALF_N = bs // 2
    CPB = bs // KC  # chunks per block
    A_LOADS = TM * KC // T
    W_LOADS = KC * bs // T
    PAD = 4 if V4_LAYOUT[bs] == "pad" else 0  # floats: rows stay 16-byte aligned
    A_STRIDE = TM + PAD
    W_STRIDE = bs + PAD
    A_TILE = KC * A_STRIDE
    W_TILE = KC * W_STRIDE
    A_SIZE = 2 * A_TILE
    W_SIZE = 2 * W_TILE
    W_SWIZZLE = 0 if PAD else min(8, bs // 4) - 1  # feature quads a w row holds, less one
    A_SWIZZLE = 0 if PAD else 7
    # Elements per global load, and how a load's elements step through the tile:
    # along features (rows of x with feature_axis 1, rows of w) or along rows.
    VA = V4_WIDTH if vector else 1
    VW = _v4_weight_width(bs) if vector else 1
    A_ALONG_ROWS = feature_axis == 0
    W_ALONG_K = transpose_w
    load_a = _activation_vector_load(feature_axis, VA)
    load_w = _weight_vector_load(transpose_w, VW)
    to_acc, _ = _converters(storage, acc_type)
    emit = _product_output(bs, storage, acc_type, feature_axis)

    a_vector_position = _chunk_position(feature_axis, TM // VA if A_ALONG_ROWS else TM,
                                        KC if A_ALONG_ROWS else KC // VA)

    @cuda.jit(device=True, inline=True)
    def a_position(e):
        """(row, kk) of the first element of load e of an activation chunk."""
        r, kk = a_vector_position(e)
        if A_ALONG_ROWS:
            return r * VA, kk
        return r, kk * VA

    @cuda.jit(device=True, inline=True)
    def w_position(e):
        """(kk, col) of the first element of load e of a weight chunk; consecutive e are
        consecutive addresses."""
        if W_ALONG_K:
            return (e % (KC // VW)) * VW, e // (KC // VW)
        return e // (bs // VW), (e % (bs // VW)) * VW

    @cuda.jit(device=True, inline=True)
    def a_slot(kk, r):
        return kk * A_STRIDE + (r ^ ((kk & A_SWIZZLE) << 2))

    @cuda.jit(device=True, inline=True)
    def w_slot(kk, col):
        return kk * W_STRIDE + (col ^ ((kk & W_SWIZZLE) << 2))

    @cuda.jit(device=True, inline=True)
    def fetch(a, w, pa, pw, tid, row0, n_rows, j, k0, other_idx, line_block):
        """This thread's share of chunk (block j, features k0...) into registers."""
        block = uint64(j if transpose_w else line_block[j])
        base = other_idx[j] * bs + k0
        # A load of rows row...row+VA-1 (feature_axis 0; n_rows is then a multiple
        # of VA) is wholly in or out; rows past the end read the last valid
        # address and are zeroed.
        last = n_rows - (VA if A_ALONG_ROWS else 1)
        for i in range(A_LOADS // VA):
            r, kk = a_position(tid + i * T)
            row = row0 + r
            values = load_a(a, uint64(min(row, last)), uint64(base + kk))
            for c in range(VA):
                pa[i * VA + c] = to_acc(values[c]) if row <= last else acc_type(0)
        for i in range(W_LOADS // VW):
            kk, col = w_position(tid + i * T)
            values = load_w(w, block, uint64(k0 + kk), uint64(col))
            for c in range(VW):
                pw[i * VW + c] = to_acc(values[c])

    @cuda.jit(device=True, inline=True)
    def deposit(a_s, w_s, pa, pw, tid, buf):
        # The swizzle leaves the two low bits alone, so the elements of a load
        # along rows (or along w's columns) stay adjacent in shared memory.
        for i in range(A_LOADS // VA):
            r, kk = a_position(tid + i * T)
            for c in range(VA):
                if A_ALONG_ROWS:
                    slot = a_slot(kk, r) + c
                else:
                    slot = a_slot(kk + c, r)
                a_s[uint64(buf * A_TILE + slot)] = pa[i * VA + c]
        for i in range(W_LOADS // VW):
            kk, col = w_position(tid + i * T)
            for c in range(VW):
                if W_ALONG_K:
                    slot = w_slot(kk + c, col)
                else:
                    slot = w_slot(kk, col) + c
                w_s[uint64(buf * W_TILE + slot)] = pw[i * VW + c]

    @cuda.jit(device=True, inline=True)
    def multiply(a_s, w_s, acc, fa, fw, buf, kk, tx, ty):
        """acc += (feature kk of the chunk in buffer buf): 16 shared reads, 64 multiply-adds."""
        # Offsets built as (quad index) * 4 in unsigned integers: the compiler
        # then sees 16-byte alignment and merges each four loads into one (a
        # signed index also gets Numba's negative-index wrap, which costs
        # instructions and hides adjacency).
        ra = uint64(buf * (A_TILE // 4) + kk * (A_STRIDE // 4) + (ty ^ (kk & A_SWIZZLE))) * uint64(4)
        rw = uint64(buf * (W_TILE // 4) + kk * (W_STRIDE // 4) + (tx ^ (kk & W_SWIZZLE))) * uint64(4)
        # The swizzle may flip the bit that HALF_N sets: a second slot for w.
        rw2 = uint64(buf * (W_TILE // 4) + kk * (W_STRIDE // 4)
                     + ((tx + HALF_N // 4) ^ (kk & W_SWIZZLE))) * uint64(4)
        for i in range(4):
            fa[i] = a_s[ra + uint64(i)]
            fa[4 + i] = a_s[ra + uint64(HALF_M + i)]
            fw[i] = w_s[rw + uint64(i)]
            fw[4 + i] = w_s[rw2 + uint64(i)]
        _add_outer_8x8(acc, fa, fw)

    @cuda.jit(**V4_OPTIONS)
    def product_v4(out, workspace, a, w, seg_line, seg_begin, seg_end, seg_slot,
                   other_idx, line_block, n_rows):
        tid = cuda.threadIdx.x
        tx = tid % TX
        ty = tid // TX
        tile, seg = _grouped_tile(PRODUCT_GROUP)
        row0 = tile * TM
        line = seg_line[seg]
        begin = seg_begin[seg]
        a_s = cuda.shared.array(A_SIZE, acc_type, alignment=SHARED_ALIGN)
        w_s = cuda.shared.array(W_SIZE, acc_type, alignment=SHARED_ALIGN)
        acc = cuda.local.array((8, 8), acc_type)
        fa = cuda.local.array(8, acc_type)
        fw = cuda.local.array(8, acc_type)
        pa = cuda.local.array(A_LOADS, acc_type)
        pw = cuda.local.array(W_LOADS, acc_type)
        for i in range(8):
            for q in range(8):
                acc[i, q] = acc_type(0)
        n_chunks = (seg_end[seg] - begin) * CPB
        if n_chunks > 0:
            fetch(a, w, pa, pw, tid, row0, n_rows, begin, 0, other_idx, line_block)
            deposit(a_s, w_s, pa, pw, tid, 0)
        cuda.syncthreads()  # chunk 0 is in buffer 0
        for t in range(n_chunks):
            buf = t & 1
            more = t + 1 < n_chunks
            if more:  # issue the next chunk's loads; they land while this chunk is multiplied
                nxt = t + 1
                fetch(a, w, pa, pw, tid, row0, n_rows, begin + nxt // CPB, (nxt % CPB) * KC,
                      other_idx, line_block)
            if UNROLL:  # written out: LLVM does not unroll a loop this long
                multiply(a_s, w_s, acc, fa, fw, buf, 0, tx, ty)
                multiply(a_s, w_s, acc, fa, fw, buf, 1, tx, ty)
                multiply(a_s, w_s, acc, fa, fw, buf, 2, tx, ty)
                multiply(a_s, w_s, acc, fa, fw, buf, 3, tx, ty)
                multiply(a_s, w_s, acc, fa, fw, buf, 4, tx, ty)
                multiply(a_s, w_s, acc, fa, fw, buf, 5, tx, ty)
                multiply(a_s, w_s, acc, fa, fw, buf, 6, tx, ty)
                multiply(a_s, w_s, acc, fa, fw, buf, 7, tx, ty)
            else:
                for kk in range(KC):
                    multiply(a_s, w_s, acc, fa, fw, buf, kk, tx, ty)
            if more:
                deposit(a_s, w_s, pa, pw, tid, 1 - buf)
            # The next chunk is in the other buffer, and every thread is done
            # reading this one before the iteration after next overwrites it.
            cuda.syncthreads()
        slot = seg_slot[seg]
        for i in range(8):
            row = row0 + ty * 4 + (i % 4) + (i // 4) * HALF_M
            if row < n_rows:
                for q in range(8):
                    col = tx * 4 + (q % 4) + (q // 4) * HALF_N
                    emit(out, workspace, slot, line, row, col, acc[i, q])

    return product_v4


# -- kernel bodies: version 5 (tensor cores) ---------------------------------------------


def _make_transpose_blocks(bs, storage, acc_type):
    """``wt[p] = w[col_block[p]]ᵀ`` over 32-bit words (pairs of 16-bit values along a row,
    or fp32 values): W's blocks transposed into the forward's order, for V5_TRANSPOSED_FORWARD.
    A block a thread block, through a shared tile padded by a word a row. Each thread's
    words are a fixed count (`_transpose_threads`), so its loads are all issued before the
    first is stored: in a loop of unknown trip count each load waited on the last (the
    copy ran at a fifth of copy bandwidth, twelfth session)."""
    VALUES = _v5_values(storage)
    WORDS = bs // VALUES  # words a row, in w and in wt
    STRIDE = WORDS + 1
    SIZE = bs * WORDS
    TILE = bs * STRIDE
    THREADS = _transpose_threads(bs, storage)
    EACH = SIZE // THREADS

    @cuda.jit
    def transpose_blocks(wt, w, col_block):
        p = cuda.blockIdx.x
        block = col_block[p]
        tile = cuda.shared.array(TILE, uint32)
        held = cuda.local.array(EACH, uint32)
        for i in range(EACH):
            e = cuda.threadIdx.x + i * THREADS
            held[i] = uint32(w[block, e // WORDS, e % WORDS])
        for i in range(EACH):
            e = cuda.threadIdx.x + i * THREADS
            tile[(e // WORDS) * STRIDE + e % WORDS] = held[i]
        cuda.syncthreads()  # the whole block is in the tile before any thread reads a column
        for i in range(EACH):
            e = cuda.threadIdx.x + i * THREADS
            c, q = e // WORDS, e % WORDS  # wt's row c (w's column), word q (w's rows VALUES q...)
            if VALUES == 2:
                lo = tile[2 * q * STRIDE + c // 2]
                hi = tile[(2 * q + 1) * STRIDE + c // 2]
                if c % 2 == 0:
                    v = (lo & uint32(0xFFFF)) | (hi << uint32(16))
                else:
                    v = (lo >> uint32(16)) | (hi & uint32(0xFFFF0000))
            else:
                v = tile[q * STRIDE + c]
            wt[p, c, q] = int32(v)

    return transpose_blocks


def _v5_values(storage):
    """Values a 32-bit word of version 5's shared tiles holds: two 16-bit ones or one fp32."""
    return 1 if storage == "float32" else 2


def _v5_ring(vector, feature_axis):
    """Whether a version 5 product stages through the cp.async ring (see V5_STAGES)."""
    return V5_STAGES > 2 and vector and feature_axis == 1


def _v5_shape(bs, storage, ring=False):
    """(threads, rows a tile, warps across the features, 32-bit words of a row a stage, values
    a word, rows a warp) of a version 5 product (`ring`: one that stages through the ring)."""
    values = _v5_values(storage)
    warps, rows = V5_RING_WARPS.get((bs, storage), (V5_WARPS[bs], V5_WARP_ROWS[bs])) if ring \
        else (V5_WARPS[bs], V5_WARP_ROWS[bs])
    col_warps = bs // min(bs, V5_WARP_TILE)
    words = min(bs // values, V5_STAGE_WORDS.get((bs, storage), bs // values))
    return 32 * warps, rows * warps // col_warps, col_warps, words, values, rows


def _make_product_v5(bs, storage, acc_type, transpose_w, feature_axis, vector=False):
    """Products on tensor cores: ``mma.sync`` m16n8k16 (fp16, bf16) or 3 x m16n8k8 (fp32, 3xTF32).

    Warps own V5_WARP_ROWS x min(bs, 32) patches of a 128-row tile (32 rows, or 64 for the
    ring's block 64, V5_RING_WARPS: two or four 16-row by up to four 8-column mma tiles each,
    fp32 accumulators). Shared memory holds a
    stage of the tile's activations and of the block's weights as 32-bit
    words along the feature (k) axis: pairs of 16-bit values, or single fp32
    values, as the fragments take them (`_mma.py`), so every fragment register
    is one 32-bit shared load; rows are padded (A by 4 words, W by 8) so that
    the fragment reads of a warp hit 32 distinct banks. A stage is a whole
    block's k, or V5_STAGE_WORDS words of it. With two stages (V5_STAGES = 2,
    or loads that are not 16-byte activation rows) they are double-buffered
    through registers: the next one's global loads are in flight while this
    one is multiplied, then stored to the other buffer, one barrier a stage. With
    ``vector`` (the launcher checked alignment; the arrays are then int32 word
    views) every global load reads 16 bytes: four words of one activation row
    (feature_axis 1), eight rows of two features (axis 0, 16-bit storage), or
    their weight counterparts; otherwise each value is read alone. Rows past
    N read the last row: a row's outputs depend on that row alone, and they are
    not written. W is read transposed for input_grad.

    With V5_STAGES > 2 (the default, 3) and 16-byte activation rows
    (feature_axis 1), stages form a ring of V5_STAGES buffers instead (up to
    81 KB of shared memory a thread block: fp16 block 64, whole blocks a
    stage): activation units (and fp32 weight units of the forward product,
    also plain 16-byte rows in shared memory, and the input gradient's weights,
    kept there as rows of k words, one per output feature, outside
    V5_WEIGHT_REGISTERS) are copied by cp.async without passing through
    registers, V5_STAGES - 1 stages ahead of the multiply; the rest of the
    weights (16-bit forward weights, interleaved into k pairs) still pass
    through registers, deposited after the multiply into the buffer the
    barrier just freed. Each thread takes its copies' addresses once, before
    the loop, and adds a stage's offset to them.
    """
    STAGES = V5_STAGES if _v5_ring(vector, feature_axis) else 2
    T, TM, CW, KW, VALUES, ROWS = _v5_shape(bs, storage, STAGES > 2)
    WN = bs // CW  # output features a warp owns
    MT = ROWS // MMA_M
    NT = WN // MMA_N
    SPB = bs // (KW * VALUES)  # stages a block
    STEPS = KW // 8  # mma steps a stage: 8 words of k each (k16 of 16-bit values, k8 of fp32)
    A_ASYNC = STAGES > 2  # activation units copied straight into shared memory
    # input_grad in the ring: W's stored rows (one per output feature, k along them) are shared
    # rows of k words as the activations' are, so that they too go by cp.async; otherwise W is
    # k-major in shared memory, and copied so only where its rows are that already (fp32 forward).
    W_ROWS = A_ASYNC and transpose_w and (bs, storage) not in V5_WEIGHT_REGISTERS
    W_ASYNC = W_ROWS or (A_ASYNC and VALUES == 1 and not transpose_w)
    A_STRIDE = KW + 4
    W_STRIDE = KW + 4 if W_ROWS else bs + 8
    A_TILE = TM * A_STRIDE
    W_TILE = bs * W_STRIDE if W_ROWS else KW * W_STRIDE
    A_SIZE = STAGES * A_TILE
    W_SIZE = STAGES * W_TILE
    wait = waiter(max(STAGES - 2, 0))
    PAIRS = VALUES == 2
    # Words a global load unit leaves in shared memory, and units a stage.
    if not vector:
        A_UNIT = W_UNIT = 1
    else:
        A_UNIT = 4 if feature_axis == 1 else 4 * VALUES
        W_UNIT = 4 if transpose_w else 4 * VALUES
    A_UNITS = TM * KW // A_UNIT
    W_UNITS = KW * bs // W_UNIT
    A_PER = -(-A_UNITS // T)
    W_PER = -(-W_UNITS // T)
    A_HELD = 1 if A_ASYNC else A_PER * A_UNIT  # words of the next stage a thread holds in registers
    W_HELD = 1 if W_ASYNC else W_PER * W_UNIT
    A_ALL = A_UNITS % T == 0  # every thread has A_PER units (no bound test)
    W_ALL = W_UNITS % T == 0
    accumulate = _mma_accumulate(storage)
    load, _ = _activation_io(feature_axis)
    emit = _product_output(bs, storage, acc_type, feature_axis)
    a_position = _chunk_position(feature_axis, TM, KW)  # scalar loads: (row, word)

    @cuda.jit(device=True, inline=True)
    def word(lo, hi):
        """One shared word from 16-bit values lo and hi (k and k + 1), or from one fp32 value."""
        if PAIRS:
            return pack(lo, hi)
        return uint32(lo)

    @cuda.jit(device=True, inline=True)
    def hold_across(held, i, array, index, index_next):
        """The words of unit i from a 16-byte load at index that runs across k (activation rows
        with feature_axis 0, weight columns of W): as they are (fp32), or paired with the load at
        index_next (value k + 1, 16-bit) into eight words."""
        x0 = load4(array, index)
        if PAIRS:
            x1 = load4(array, index_next)
            for c in range(8):
                held[i * 8 + c] = _interleave(x0, x1, c)
        else:
            for c in range(4):
                held[i * 4 + c] = uint32(x0[c])

    @cuda.jit(device=True, inline=True)
    def a_row_source(e, row0, n_rows, base):
        """(row, word) of the 16 bytes of vector activation unit e with feature_axis 1."""
        row = uint64(min(row0 + e // (KW // 4), n_rows - 1))
        return row, uint64(base // VALUES + 4 * (e % (KW // 4)))

    @cuda.jit(device=True, inline=True)
    def w_row_source(e, block, k0):
        """(block, k, column) of the 4 * VALUES columns of one k of vector weight unit e, untransposed."""
        return block, uint64(k0 + VALUES * (e // (bs // W_UNIT))), uint64((e % (bs // W_UNIT)) * (W_UNIT // VALUES))

    @cuda.jit(device=True, inline=True)
    def fetch_a(a, pa, e, i, row0, n_rows, base):
        """Unit e of a stage of activations (features base...) into pa[i * A_UNIT...]."""
        if not vector:
            r, p = a_position(e)
            row = uint64(min(row0 + r, n_rows - 1))
            k = uint64(base + VALUES * p)
            pa[i] = word(load(a, row, k), load(a, row, k + uint64(1)) if PAIRS else 0)
        elif feature_axis == 1:
            v = load4(a, a_row_source(e, row0, n_rows, base))
            for c in range(4):
                pa[i * 4 + c] = uint32(v[c])
        else:
            # Rows in whole vectors (n_rows is a multiple of 4 * VALUES): a unit is wholly
            # in or past the end, and one past it reads the last vector instead.
            p = e % KW
            n0 = uint64(min(row0 + (e // KW) * A_UNIT, n_rows - A_UNIT) // VALUES)
            k = uint64(base + VALUES * p)
            hold_across(pa, i, a, (k, n0), (k + uint64(1), n0))

    @cuda.jit(device=True, inline=True)
    def a_slots(e):
        """(row, word) of the first shared word of activation unit e, and the step between its
        words (1 along a row, A_STRIDE down rows)."""
        if not vector:
            r, p = a_position(e)
            return r, p, 1
        if feature_axis == 1:
            return e // (KW // 4), 4 * (e % (KW // 4)), 1
        return (e // KW) * A_UNIT, e % KW, A_STRIDE

    @cuda.jit(device=True, inline=True)
    def fetch_w(w, pw, e, i, block, k0):
        """Unit e of a stage of weights (features k0... of the block's k axis) into pw[i * W_UNIT...]."""
        if not vector:
            if transpose_w:
                p, col = e % KW, e // KW
                k = uint64(k0 + VALUES * p)
                pw[i] = word(w[block, uint64(col), k], w[block, uint64(col), k + uint64(1)] if PAIRS else 0)
            else:
                p, col = e // bs, e % bs
                k = uint64(k0 + VALUES * p)
                pw[i] = word(w[block, k, uint64(col)], w[block, k + uint64(1), uint64(col)] if PAIRS else 0)
        elif transpose_w:
            # Four words along k of one column of W (a row of the stored block).
            col = uint64(e // (KW // 4))
            v = load4(w, (block, col, uint64(k0 // VALUES + 4 * (e % (KW // 4)))))
            for c in range(4):
                pw[i * 4 + c] = uint32(v[c])
        else:
            # 4 * VALUES columns of one k word: one (fp32) or two (16-bit) rows of the block.
            _, k, cols = w_row_source(e, block, k0)
            hold_across(pw, i, w, (block, k, cols), (block, k + uint64(1), cols))

    @cuda.jit(device=True, inline=True)
    def w_slots(e):
        """(word, col) of the first shared word of weight unit e, and the step between its words."""
        if not vector:
            if transpose_w:
                return e % KW, e // KW, 1
            return e // bs, e % bs, 1
        if transpose_w:
            return 4 * (e % (KW // 4)), e // (KW // 4), W_STRIDE
        return e // (bs // W_UNIT), (e % (bs // W_UNIT)) * W_UNIT, 1

    @cuda.jit(device=True, inline=True)
    def a_slot(e, buf):
        r, p, step = a_slots(e)
        return uint64(buf * A_TILE + r * A_STRIDE + p), step

    @cuda.jit(device=True, inline=True)
    def w_slot(e, buf):
        p, col, step = w_slots(e)
        if W_ROWS:
            return uint64(buf * W_TILE + col * W_STRIDE + p), 1
        return uint64(buf * W_TILE + p * W_STRIDE + col), step

    @cuda.jit(device=True, inline=True)
    def w_stage_offset(block, k0):
        """Bytes from w's start to the stage of block at k0, for the copy_offsets of block 0 at 0."""
        if W_ROWS:
            return (block * uint64(bs * (bs // VALUES)) + uint64(k0 // VALUES)) * uint64(4)
        return (block * uint64(bs) + uint64(k0)) * uint64(bs * 4)

    @cuda.jit(device=True, inline=True)
    def copy_offsets(a, a_from, a_to, w_from, w_to, tid, row0, n_rows):
        """Byte offsets of this thread's cp.async units in the first stage: from a (features
        0...) and w (block 0, k 0...), to buffer 0."""
        for i in range(A_PER):
            e = tid + i * T
            if A_ALL or e < A_UNITS:
                row, word = a_row_source(e, row0, n_rows, 0)
                a_from[i] = (row * uint64(a.shape[1]) + word) * uint64(4)
                a_to[i] = a_slot(e, 0)[0] * uint64(4)
        if W_ASYNC:
            for i in range(W_PER):
                e = tid + i * T
                if W_ALL or e < W_UNITS:
                    if W_ROWS:  # four words along k (from word p) of stored row (output feature) col
                        p, col, _ = w_slots(e)
                        w_from[i] = (uint64(col) * uint64(bs // VALUES) + uint64(p)) * uint64(4)
                    else:
                        _, k, col = w_row_source(e, uint64(0), 0)
                        w_from[i] = (k * uint64(bs) + col) * uint64(4)
                    w_to[i] = w_slot(e, 0)[0] * uint64(4)

    @cuda.jit(device=True, inline=True)
    def fetch(a, w, pa, pw, tid, row0, n_rows, j, k0, other_idx, line_block, copies, buf):
        """This thread's share of one stage (block j, features k0...) into registers, or with
        cp.async, on its way to buffer buf: copies = (shared addresses of a_s and w_s, global
        addresses of a and w, then the byte offsets of copy_offsets)."""
        block = uint64(j if transpose_w else line_block[j])
        base = other_idx[j] * bs + k0
        a_shared, w_shared, a_global, w_global, a_from, a_to, w_from, w_to = copies
        for i in range(A_PER):
            e = tid + i * T
            if A_ALL or e < A_UNITS:
                if A_ASYNC:
                    copy16_to(a_shared + (a_to[i] + uint64(buf * A_TILE * 4)),
                              a_global + (a_from[i] + uint64(base // VALUES) * uint64(4)))
                else:
                    fetch_a(a, pa, e, i, row0, n_rows, base)
        for i in range(W_PER):
            e = tid + i * T
            if W_ALL or e < W_UNITS:
                if W_ASYNC:
                    copy16_to(w_shared + (w_to[i] + uint64(buf * W_TILE * 4)),
                              w_global + (w_from[i] + w_stage_offset(block, k0)))
                else:
                    fetch_w(w, pw, e, i, block, k0)

    @cuda.jit(device=True, inline=True)
    def deposit(a_s, w_s, pa, pw, tid, buf):
        """The register-held part of a stage (if any) into buffer buf."""
        if not A_ASYNC:
            for i in range(A_PER):
                e = tid + i * T
                if A_ALL or e < A_UNITS:
                    at, step = a_slot(e, buf)
                    for c in range(A_UNIT):
                        a_s[at + uint64(c * step)] = pa[i * A_UNIT + c]
        if not W_ASYNC:
            for i in range(W_PER):
                e = tid + i * T
                if W_ALL or e < W_UNITS:
                    at, step = w_slot(e, buf)
                    for c in range(W_UNIT):
                        w_s[at + uint64(c * step)] = pw[i * W_UNIT + c]

    @cuda.jit(device=True, inline=True)
    def multiply(a_s, w_s, acc, fa, buf, s, ar, t, bc):
        """acc += step s of the stage in buffer buf (8 words of k) for this lane's fragments:
        A rows ar, ar + 8 (and 16 below), words t, t + 4; B words t, t + 4, columns bc + 8 nt."""
        for mt in range(MT):
            at = uint64(buf * A_TILE + (ar + mt * MMA_M) * A_STRIDE + s * 8 + t)
            fa[mt, 0] = a_s[at]
            fa[mt, 1] = a_s[at + uint64(8 * A_STRIDE)]
            fa[mt, 2] = a_s[at + uint64(4)]
            fa[mt, 3] = a_s[at + uint64(8 * A_STRIDE + 4)]
        for nt in range(NT):
            if W_ROWS:  # column bc + 8 nt is a row of words along k
                at = uint64(buf * W_TILE + (bc + nt * MMA_N) * W_STRIDE + s * 8 + t)
                b0 = w_s[at]
                b1 = w_s[at + uint64(4)]
            else:
                at = uint64(buf * W_TILE + (s * 8 + t) * W_STRIDE + bc + nt * MMA_N)
                b0 = w_s[at]
                b1 = w_s[at + uint64(4 * W_STRIDE)]
            for mt in range(MT):
                accumulate(acc, mt, nt, fa, mt, b0, b1)

    @cuda.jit
    def product_v5(out, workspace, a, w, seg_line, seg_begin, seg_end, seg_slot,
                   other_idx, line_block, n_rows):
        tid = cuda.threadIdx.x
        lane = tid % 32
        warp = tid // 32
        g = lane >> 2
        t = lane % 4
        wr = (warp // CW) * (MT * MMA_M)  # the warp's first row and feature in the tile
        wc = (warp % CW) * WN
        tile, seg = _grouped_tile(PRODUCT_GROUP)
        row0 = tile * TM
        begin = seg_begin[seg]
        a_s = cuda.shared.array(A_SIZE, uint32, alignment=SHARED_ALIGN)
        w_s = cuda.shared.array(W_SIZE, uint32, alignment=SHARED_ALIGN)
        acc = cuda.local.array((MT, NT, 4), float32)
        fa = cuda.local.array((MT, 4), uint32)
        pa = cuda.local.array(A_HELD, uint32)
        pw = cuda.local.array(W_HELD, uint32)
        a_from = cuda.local.array(A_PER, uint64)
        a_to = cuda.local.array(A_PER, uint64)
        w_from = cuda.local.array(W_PER, uint64)
        w_to = cuda.local.array(W_PER, uint64)
        if A_ASYNC:
            copy_offsets(a, a_from, a_to, w_from, w_to, tid, row0, n_rows)
        copies = (shared_address(a_s, (0,)), shared_address(w_s, (0,)), global_address(a, (0, 0)),
                  global_address(w, (0, 0, 0)), a_from, a_to, w_from, w_to)
        for mt in range(MT):
            for nt in range(NT):
                for q in range(4):
                    acc[mt, nt, q] = float32(0)
        n_stages = (seg_end[seg] - begin) * SPB
        # Stage s goes to buffer s % STAGES; stages 0 .. STAGES - 2 before the loop.
        for s in range(STAGES - 1):
            if s < n_stages:
                fetch(a, w, pa, pw, tid, row0, n_rows, begin + s // SPB, (s % SPB) * KW * VALUES,
                      other_idx, line_block, copies, s)
                deposit(a_s, w_s, pa, pw, tid, s)
            if A_ASYNC:
                commit()  # one group a stage, empty or not, so that the wait below counts stages
        buf = 0
        for stage in range(n_stages):
            if A_ASYNC:
                wait()  # this thread's copies of this stage have landed
            # This stage is in buffer buf (every thread's share), and every warp is done
            # multiplying the previous stage, whose buffer the fetch below refills.
            cuda.syncthreads()
            nxt = stage + STAGES - 1
            nbuf = buf - 1 if buf > 0 else STAGES - 1
            more = nxt < n_stages
            if more:  # its loads land while this stage is multiplied
                fetch(a, w, pa, pw, tid, row0, n_rows, begin + nxt // SPB, (nxt % SPB) * KW * VALUES,
                      other_idx, line_block, copies, nbuf)
            if A_ASYNC:
                commit()
            for s in range(STEPS):
                multiply(a_s, w_s, acc, fa, buf, s, wr + g, t, wc + g)
            if more:
                deposit(a_s, w_s, pa, pw, tid, nbuf)
            buf = buf + 1 if buf < STAGES - 1 else 0
        line = seg_line[seg]
        slot = seg_slot[seg]
        for mt in range(MT):
            for q in range(4):
                row = row0 + wr + mt * MMA_M + g + 8 * (q // 2)
                if row < n_rows:
                    for nt in range(NT):
                        col = wc + nt * MMA_N + 2 * t + q % 2
                        emit(out, workspace, slot, line, row, col, acc[mt, nt, q])

    return product_v5


def _make_combine_lines(bs, storage, acc_type, feature_axis):
    """out[:, line-block] = sum of the line's workspace rows, in order."""
    _, store = _activation_io(feature_axis)
    _, from_acc = _converters(storage, acc_type)

    @cuda.jit
    def combine_lines(out, workspace, split_line, split_begin, split_end, n_rows):
        i = cuda.blockIdx.y
        e = cuda.blockIdx.x * COMBINE_THREADS + cuda.threadIdx.x
        if e < n_rows * bs:
            row = e // bs
            col = e - row * bs
            total = acc_type(0)
            for slot in range(split_begin[i], split_end[i]):
                total += workspace[slot, row, col]
            store(out, row, split_line[i] * bs + col, from_acc(total))

    return combine_lines


def _make_weight_grad_v3(bs, storage, acc_type, feature_axis):
    """Version 2's weight gradient with two rows of x and dy in flight per load step, branch-free."""
    return _make_weight_grad_v2(bs, storage, acc_type, feature_axis, batched=True)


def _make_weight_grad_v2(bs, storage, acc_type, feature_axis, batched=False):
    """dw[b] (+ beta·dw[b]) over this thread block's share of N; splits go to a workspace."""
    P = WGRAD_PATCH[bs]
    PX = bs // P  # threads across the block's columns (and rows) within a group
    GT = PX * PX  # threads per group
    T = WGRAD_THREADS
    G = T // GT  # groups, each taking every G-th row of a chunk
    NC = WGRAD_CHUNK
    RED = G * bs * bs if G > 1 else 1
    TILE_SHAPE = (NC, bs + 1)  # +1 column against bank conflicts of the transposed stores
    load, _ = _activation_io(feature_axis)
    to_acc, from_acc = _converters(storage, acc_type)

    position = _chunk_position(feature_axis, NC, bs)

    finish = _weight_grad_output(bs, storage, acc_type)

    @cuda.jit
    def weight_grad_v2(dw, workspace, x, dy, coords, n_rows, rows_per_split, beta):
        tid = cuda.threadIdx.x
        g = tid // GT
        gtid = tid - g * GT
        gx = gtid % PX
        gy = gtid // PX
        block = cuda.blockIdx.x
        split = cuda.blockIdx.y
        c = coords[block, 0]
        k = coords[block, 1]
        n_begin = split * rows_per_split
        n_end = min(n_rows, n_begin + rows_per_split)
        x_s = cuda.shared.array(TILE_SHAPE, acc_type)
        dy_s = cuda.shared.array(TILE_SHAPE, acc_type)
        reduce_s = cuda.shared.array(RED, acc_type)
        acc = cuda.local.array((P, P), acc_type)
        x_frag = cuda.local.array(P, acc_type)
        dy_frag = cuda.local.array(P, acc_type)
        for i in range(P):
            for q in range(P):
                acc[i, q] = acc_type(0)
        for n0 in range(n_begin, n_end, NC):
            if batched:
                last = n_end - 1
                for e0 in range(tid, NC * bs, 2 * T):
                    r0, f0 = position(e0)
                    r1, f1 = position(e0 + T)
                    # Rows past the end read the last row (a valid address) and are zeroed.
                    x0 = to_acc(load(x, min(n0 + r0, last), c * bs + f0))
                    d0 = to_acc(load(dy, min(n0 + r0, last), k * bs + f0))
                    x1 = to_acc(load(x, min(n0 + r1, last), c * bs + f1))
                    d1 = to_acc(load(dy, min(n0 + r1, last), k * bs + f1))
                    x_s[r0, f0] = x0 if n0 + r0 <= last else acc_type(0)
                    dy_s[r0, f0] = d0 if n0 + r0 <= last else acc_type(0)
                    x_s[r1, f1] = x1 if n0 + r1 <= last else acc_type(0)
                    dy_s[r1, f1] = d1 if n0 + r1 <= last else acc_type(0)
            else:
                for e0 in range(0, NC * bs, T):
                    e = e0 + tid
                    if e < NC * bs:
                        if feature_axis == 1:
                            r = e // bs
                            f = e - r * bs
                        else:
                            f = e // NC
                            r = e - f * NC
                        n = n0 + r
                        xv = acc_type(0)
                        dv = acc_type(0)
                        if n < n_end:
                            xv = to_acc(load(x, n, c * bs + f))
                            dv = to_acc(load(dy, n, k * bs + f))
                        x_s[r, f] = xv
                        dy_s[r, f] = dv
            cuda.syncthreads()  # x_s and dy_s hold this chunk of rows
            for rr in range(NC // G):
                r = rr * G + g
                for i in range(P):
                    x_frag[i] = x_s[r, gy * P + i]
                for q in range(P):
                    dy_frag[q] = dy_s[r, gx * P + q]
                for i in range(P):
                    for q in range(P):
                        acc[i, q] += x_frag[i] * dy_frag[q]
            cuda.syncthreads()  # everyone is done with this chunk before it is overwritten
        if G > 1:
            for i in range(P):
                for q in range(P):
                    reduce_s[g * bs * bs + (gy * P + i) * bs + gx * P + q] = acc[i, q]
            cuda.syncthreads()  # every group's partial block is in reduce_s
            for e0 in range(0, bs * bs, T):
                e = e0 + tid
                if e < bs * bs:
                    total = acc_type(0)
                    for group in range(G):
                        total += reduce_s[group * bs * bs + e]
                    finish(dw, workspace, block, split, e // bs, e % bs, total, beta)
        else:
            for i in range(P):
                for q in range(P):
                    finish(dw, workspace, block, split, gy * P + i, gx * P + q, acc[i, q], beta)

    return weight_grad_v2


def _make_weight_grad_v4(bs, storage, acc_type, feature_axis, vector=False):
    """dw[b] (+ beta·dw[b]) with an 8 x 8 patch per thread and 16-byte shared reads (feature_axis 1).

    A thread block holds S sub-groups, each computing one block of W over this
    thread block's slice of N: per row of a chunk, a thread reads 8 values of
    x and 8 of dy (four 16-byte shared loads) for 64 multiply-adds. Each
    sub-group's tiles start 16 floats past a multiple of 32, so the two
    sub-groups of a warp (block 32) read distinct banks. With ``vector`` (the
    launcher checked alignment) x and dy are read 4 values at a time.
    """
    GT = (bs // 8) ** 2  # threads per sub-group
    T = V4_WGRAD_THREADS
    S = T // GT
    NC = V4_WGRAD_ROWS[bs]
    GX = bs // 8
    HALF = bs // 2
    TILE = NC * bs
    SUB = 2 * TILE + 16  # one sub-group's x and dy tiles (+16: the next one's banks are shifted)
    SIZE = S * SUB
    V = V4_WIDTH if vector else 1  # values per load
    LOADS = TILE // GT // V  # of x, and as many of dy, per thread and chunk
    BATCH = min(LOADS, V4_WGRAD_BATCH // V)  # loads of each in flight before their stores (divides LOADS)
    IN_FLIGHT = BATCH * V
    load = _activation_vector_load(feature_axis, V)
    to_acc, from_acc = _converters(storage, acc_type)

    @cuda.jit(**V4_OPTIONS)
    def weight_grad_v4(dw, workspace, x, dy, coords, n_rows, rows_per_split, beta):
        tid = cuda.threadIdx.x
        g = tid // GT
        t = tid - g * GT
        gx = t % GX
        gy = t // GX
        n_blocks = dw.shape[0]
        block = cuda.blockIdx.x * S + g
        bc = min(block, n_blocks - 1)  # idle sub-groups past the last block read a valid one
        c0 = coords[bc, 0] * bs
        k0 = coords[bc, 1] * bs
        split = cuda.blockIdx.y
        n_begin = split * rows_per_split
        n_end = min(n_rows, n_begin + rows_per_split)
        last = n_end - 1
        tiles = cuda.shared.array(SIZE, acc_type, alignment=SHARED_ALIGN)
        acc = cuda.local.array((8, 8), acc_type)
        fx = cuda.local.array(8, acc_type)
        fd = cuda.local.array(8, acc_type)
        vx = cuda.local.array(IN_FLIGHT, acc_type)
        vd = cuda.local.array(IN_FLIGHT, acc_type)
        for i in range(8):
            for q in range(8):
                acc[i, q] = acc_type(0)
        base = g * SUB
        for n0 in range(n_begin, n_end, NC):
            for i0 in range(0, LOADS, BATCH):  # BATCH loads of x and of dy in flight, then their stores
                for u in range(BATCH):
                    e = (t + (i0 + u) * GT) * V  # element of the chunk: rows of bs values
                    row = n0 + e // bs
                    r = uint64(min(row, last))
                    xs = load(x, r, uint64(c0 + e % bs))
                    ds = load(dy, r, uint64(k0 + e % bs))
                    for c in range(V):  # rows past the slice are zero
                        vx[u * V + c] = to_acc(xs[c]) if row <= last else acc_type(0)
                        vd[u * V + c] = to_acc(ds[c]) if row <= last else acc_type(0)
                for u in range(BATCH):
                    e = (t + (i0 + u) * GT) * V
                    for c in range(V):
                        tiles[uint64(base + e + c)] = vx[u * V + c]
                        tiles[uint64(base + TILE + e + c)] = vd[u * V + c]
            cuda.syncthreads()  # every sub-group's x and dy tiles hold this chunk
            for rr in range(NC):
                # Offsets as (quad index) * 4, unsigned: the compiler merges each four loads.
                ox = uint64((base + rr * bs) // 4 + gy) * uint64(4)
                od = uint64((base + TILE + rr * bs) // 4 + gx) * uint64(4)
                for i in range(4):
                    fx[i] = tiles[ox + uint64(i)]
                    fx[4 + i] = tiles[ox + uint64(HALF + i)]
                    fd[i] = tiles[od + uint64(i)]
                    fd[4 + i] = tiles[od + uint64(HALF + i)]
                _add_outer_8x8(acc, fx, fd)
            cuda.syncthreads()  # every thread is done with this chunk before it is overwritten
        # Through shared memory (the chunk tiles, free now, hold one block per
        # sub-group), so that acc is only indexed by unrolled loops: the
        # epilogue's branches would otherwise keep it out of registers.
        for i in range(8):
            for q in range(8):
                r = gy * 4 + (i % 4) + (i // 4) * HALF
                tiles[uint64(base + r * bs + gx * 4 + (q % 4) + (q // 4) * HALF)] = acc[i, q]
        cuda.syncthreads()  # each sub-group's block is in its tiles
        if block < n_blocks:
            for e in range(t, bs * bs, GT):
                total = tiles[uint64(base + e)]
                if workspace.shape[0] > 1:
                    workspace[split, block, e] = total
                else:
                    r = e // bs
                    col = e - r * bs
                    if beta != 0:
                        total += acc_type(beta) * to_acc(dw[block, r, col])
                    dw[block, r, col] = from_acc(total)

    return weight_grad_v4


def _v5_wgrad_blocks(bs):
    """W blocks a thread block of version 5's weight gradient computes: one per warp, or one
    for all four warps (block 64: a 32-square patch each)."""
    return max(1, V5_WGRAD_WARPS // (bs // min(bs, V5_WARP_TILE)) ** 2)


def _v5_wgrad_warps(group):
    """Warps a thread block of version 5's weight gradient."""
    return V5_WGRAD_GROUP_WARPS if group > 1 else V5_WGRAD_WARPS


def _v5_wgrad_step(storage):
    """(rows of N, 32-bit words of a column) a step of version 5's weight gradient stages:
    32 rows as 16 words of pairs (16-bit storage), or 16 fp32 rows (the same shared memory)."""
    return 16 * _v5_values(storage), 16


def _make_weight_grad_v5(bs, storage, acc_type, feature_axis, vector=False, group=1):
    """dw[b] (+ beta·dw[b]) on tensor cores: D = xᵀ·dy, k running along N.

    Each warp owns a min(bs, 32)-square patch of one block of W (two 16-row by
    four 8-column mma tiles at block 32), a thread block four warps: four
    blocks (block 16 and 32) or the four patches of one (block 64). Warps
    work alone: each stages its own slices of x and dy in its own shared
    memory, a step of rows of N at a time (`_v5_wgrad_step`), as 32-bit words
    along N: pairs of rows (16-bit storage, the k pairs the fragments take) or
    single fp32 rows (3xTF32, `_mma_accumulate`), double-buffered through
    registers, `syncwarp` between steps. With ``vector`` (the launcher checked
    alignment and, for feature_axis 0, that N is a multiple of 4 words' rows)
    loads read 16 bytes: two rows of 8 features paired up, or one row of 4 fp32
    features (feature_axis 1), or 4 words' rows of one feature (feature_axis 0).
    Rows past this split's end are zero. fp32 with feature_axis 1 and
    ``vector`` (and V5_WGRAD_ASYNC): each 16-byte piece of a row goes to shared
    memory by cp.async instead, from addresses taken once, through a ring of
    V5_WGRAD_STAGES buffers a warp.

    With ``group`` G > 1 (one patch a block: blocks 16 and 32) a warp takes a
    segment of up to G consecutive blocks of one block-row
    (`BlockLayout.line_segments` over rows: CSR order is block order) instead
    of one block: it stages x's slice once a step for all of them and each
    block's slice of dy, and reuses x's A fragments for every block, so a
    block costs (1 + 1/G) slices of loads instead of 2. Warps with an empty
    row's segment leave at once.
    """
    WT = min(bs, V5_WARP_TILE)  # side of a warp's patch
    SIDE = bs // WT
    PATCHES = SIDE * SIDE  # warps on one block
    WARPS = _v5_wgrad_warps(group)
    PER = WARPS if group > 1 else _v5_wgrad_blocks(bs)  # blocks (segments) a thread block
    MT = WT // MMA_M
    NT = WT // MMA_N
    ROWS, KW = _v5_wgrad_step(storage)  # rows of N and words a step
    VALUES = ROWS // KW
    PAIRS = VALUES == 2
    STRIDE = WT + 8  # words: conflict-free fragment reads (as version 5's weight tiles)
    TILE = KW * STRIDE
    if not vector:
        UNIT = 1
    else:  # words a load unit leaves in shared memory: 8 (two rows of 8 features) or 4
        UNIT = 8 if feature_axis == 1 and PAIRS else 4
    UNITS = KW * WT // UNIT
    PER_LANE = UNITS // 32
    ASYNC = V5_WGRAD_ASYNC and vector and feature_axis == 1 and not PAIRS
    STAGES = V5_WGRAD_STAGES if ASYNC else 2
    wait = waiter(STAGES - 1)  # groups a lane leaves in flight: those committed after a step's
    G = group  # blocks a warp takes: 1 (by coords), or a row segment of up to G blocks
    OPERANDS = 1 + G  # tiles of a stage: x's slice, then each block's slice of dy
    WARP_WORDS = OPERANDS * STAGES * TILE
    SIZE = WARPS * WARP_WORDS
    HELD = 1 if ASYNC else PER_LANE * UNIT  # words a lane holds per operand
    HELD_ALL = OPERANDS * HELD  # (local-array shapes must be literals, not expressions)
    ACC_ROWS = G * MT
    accumulate = _mma_accumulate(storage)
    load, _ = _activation_io(feature_axis)
    finish = _weight_grad_output(bs, storage, acc_type)

    @cuda.jit(device=True, inline=True)
    def fetch(a, held, h0, lane, col0, n0, n_end):
        """This lane's share of a step's rows n0... of features col0...col0 + WT - 1 of a, into
        held[h0...]."""
        last = n_end - 1
        for i in range(PER_LANE):
            e = lane + 32 * i
            if not vector:
                p, c = e // WT, e % WT
                n = n0 + VALUES * p
                col = uint64(col0 + c)
                lo = load(a, uint64(min(n, last)), col) if n <= last else 0
                if PAIRS:
                    hi = load(a, uint64(min(n + 1, last)), col) if n + 1 <= last else 0
                    held[h0 + i] = pack(lo, hi)
                else:
                    held[h0 + i] = uint32(lo)
            elif feature_axis == 1:
                p, cg = e // (WT // UNIT), e % (WT // UNIT)
                n = n0 + VALUES * p
                col = uint64((col0 + UNIT * cg) // VALUES)
                x0 = load4(a, (uint64(min(n, last)), col))
                if PAIRS:
                    x1 = load4(a, (uint64(min(n + 1, last)), col))
                    for c in range(8):
                        word = _interleave(x0, x1, c)
                        if n + 1 > last:  # the second row is past the end
                            word = uint32(word & uint32(0xFFFF))
                        held[h0 + i * 8 + c] = word if n <= last else uint32(0)
                else:
                    for c in range(4):
                        held[h0 + i * 4 + c] = uint32(x0[c]) if n <= last else uint32(0)
            else:
                # 4 words' rows of one feature; the end is a multiple of them, so a unit is
                # all in or out.
                c, q = e // (KW // 4), e % (KW // 4)
                n = n0 + 4 * VALUES * q
                v = load4(a, (uint64(col0 + c), uint64(min(n, n_end - 4 * VALUES) // VALUES)))
                for w in range(4):
                    held[h0 + i * 4 + w] = uint32(v[w]) if n < n_end else uint32(0)

    @cuda.jit(device=True, inline=True)
    def deposit(tiles, held, h0, lane, at):
        for i in range(PER_LANE):
            e = lane + 32 * i
            if not vector:
                tiles[uint64(at + (e // WT) * STRIDE + e % WT)] = held[h0 + i]
            elif feature_axis == 1:
                slot = uint64(at + (e // (WT // UNIT)) * STRIDE + UNIT * (e % (WT // UNIT)))
                for c in range(UNIT):
                    tiles[slot + uint64(c)] = held[h0 + i * UNIT + c]
            else:
                slot = uint64(at + 4 * (e % (KW // 4)) * STRIDE + e // (KW // 4))
                for w in range(4):
                    tiles[slot + uint64(w * STRIDE)] = held[h0 + i * 4 + w]

    @cuda.jit(device=True, inline=True)
    def issue(shared, source, row_words, lane, col0, n0, n_end, at):
        """cp.async of this lane's share of a step's rows n0... of features col0... of an fp32
        source (feature_axis 1) into shared words at...; rows past n_end become zeros."""
        for i in range(PER_LANE):
            e = lane + 32 * i
            p, cg = e // (WT // 4), e % (WT // 4)
            n = n0 + p
            row = uint64(min(n, n_end - 1))
            copy16_or_zero(shared + uint64((at + p * STRIDE + 4 * cg) * 4),
                           source + (row * uint64(row_words) + uint64(col0 + 4 * cg)) * uint64(4), n < n_end)

    @cuda.jit(device=True, inline=True)
    def issue_step(shared, x_global, dy_global, x_words, dy_words, lane, c0, cols, count, n0, n_end, at):
        """cp.async of a step's tiles into the buffer at word at: x's rows, then each block's dy."""
        issue(shared, x_global, x_words, lane, c0, n0, n_end, at)
        for j in range(G):
            if j < count:  # the same for the whole warp
                issue(shared, dy_global, dy_words, lane, cols[j], n0, n_end, at + (1 + j) * TILE)

    @cuda.jit(device=True, inline=True)
    def fetch_step(x, dy, held, lane, c0, cols, count, n0, n_end):
        """A step's tiles into registers: x's rows, then each block's dy (HELD words apart)."""
        fetch(x, held, 0, lane, c0, n0, n_end)
        for j in range(G):
            if j < count:
                fetch(dy, held, (1 + j) * HELD, lane, cols[j], n0, n_end)

    @cuda.jit(device=True, inline=True)
    def deposit_step(tiles, held, lane, count, at):
        """fetch_step's registers into the buffer at word at (TILE words a tile)."""
        for o in range(OPERANDS):
            if o <= count:
                deposit(tiles, held, o * HELD, lane, at + o * TILE)

    @cuda.jit(device=True, inline=True)
    def multiply(tiles, acc, fa, ax, g, t, count):
        """acc += the step in the buffer at word ax: x's rows, then each block's rows of dy
        (TILE words apart); the A fragments of x serve every block."""
        for s in range(KW // 8):
            for mt in range(MT):
                at = uint64(ax + (s * 8 + t) * STRIDE + mt * MMA_M + g)
                fa[mt, 0] = tiles[at]
                fa[mt, 1] = tiles[at + uint64(8)]
                fa[mt, 2] = tiles[at + uint64(4 * STRIDE)]
                fa[mt, 3] = tiles[at + uint64(4 * STRIDE + 8)]
            for j in range(G):
                if j < count:  # the same for the whole warp
                    for nt in range(NT):
                        at = uint64(ax + (1 + j) * TILE + (s * 8 + t) * STRIDE + nt * MMA_N + g)
                        b0 = tiles[at]
                        b1 = tiles[at + uint64(4 * STRIDE)]
                        for mt in range(MT):
                            accumulate(acc, j * MT + mt, nt, fa, mt, b0, b1)

    @cuda.jit
    def weight_grad_v5(dw, workspace, x, dy, coords, seg_begin, seg_end, n_rows, rows_per_split, beta):
        lane = cuda.threadIdx.x % 32
        warp = cuda.threadIdx.x // 32
        g = lane >> 2
        t = lane % 4
        item = cuda.blockIdx.x * PER + warp // PATCHES  # a block, or a segment (G > 1)
        patch = warp % PATCHES
        pm = (patch // SIDE) * WT  # the patch's first row (x feature) and column (dy feature) in the block
        pn = (patch % SIDE) * WT
        split = cuda.blockIdx.y
        n_begin = split * rows_per_split
        n_end = min(n_rows, n_begin + rows_per_split)
        tiles = cuda.shared.array(SIZE, uint32, alignment=SHARED_ALIGN)
        acc = cuda.local.array((ACC_ROWS, NT, 4), float32)
        held = cuda.local.array(HELD_ALL, uint32)
        fa = cuda.local.array((MT, 4), uint32)
        cols = cuda.local.array(G, int64)
        # Whole warps leave here; no thread-block barrier follows.
        if G == 1:
            if item >= dw.shape[0]:
                return
            first, count = item, 1
        else:
            if item >= seg_begin.shape[0]:
                return
            first = seg_begin[item]  # the segment's blocks are consecutive: CSR order is block order
            count = seg_end[item] - first
            if count == 0:  # an empty block-row
                return
        c0 = coords[first, 0] * bs + pm
        for j in range(G):
            cols[j] = coords[first + min(j, count - 1), 1] * bs + pn
        base = warp * WARP_WORDS
        for i in range(ACC_ROWS):
            for nt in range(NT):
                for q in range(4):
                    acc[i, nt, q] = float32(0)
        steps = (n_end - n_begin + ROWS - 1) // ROWS
        if ASYNC:  # a ring of STAGES buffers, STAGES - 1 steps of copies in flight
            shared, x_global, dy_global = shared_address(tiles, (0,)), global_address(x, (0, 0)), \
                global_address(dy, (0, 0))
            for s in range(STAGES - 1):  # step s goes to buffer s % STAGES
                if s < steps:
                    issue_step(shared, x_global, dy_global, x.shape[1], dy.shape[1], lane, c0, cols, count,
                               n_begin + s * ROWS, n_end, base + s * OPERANDS * TILE)
                commit()  # one group a step, empty or not, so that the wait below counts steps
            for step in range(steps):
                buf = step % STAGES
                nxt = step + STAGES - 1
                if nxt < steps:  # its copies land while this step is multiplied
                    issue_step(shared, x_global, dy_global, x.shape[1], dy.shape[1], lane, c0, cols, count,
                               n_begin + nxt * ROWS, n_end, base + ((buf + STAGES - 1) % STAGES) * OPERANDS * TILE)
                commit()
                wait()  # this lane's copies of this step have landed
                cuda.syncwarp()  # ... and every lane's
                multiply(tiles, acc, fa, base + buf * OPERANDS * TILE, g, t, count)
                cuda.syncwarp()  # the warp is done with this buffer before an issue refills it
        else:  # through registers
            if steps > 0:
                fetch_step(x, dy, held, lane, c0, cols, count, n_begin, n_end)
                deposit_step(tiles, held, lane, count, base)
            cuda.syncwarp()  # step 0 is in buffer 0
            for step in range(steps):
                buf = step & 1
                more = step + 1 < steps
                if more:  # the next step's loads land while this one is multiplied
                    fetch_step(x, dy, held, lane, c0, cols, count, n_begin + (step + 1) * ROWS, n_end)
                multiply(tiles, acc, fa, base + buf * OPERANDS * TILE, g, t, count)
                if more:
                    deposit_step(tiles, held, lane, count, base + (1 - buf) * OPERANDS * TILE)
                # The next step is in the other buffer, and the warp is done reading this one
                # before the step after next overwrites it.
                cuda.syncwarp()
        for j in range(G):
            if j < count:
                for mt in range(MT):
                    for nt in range(NT):
                        for q in range(4):
                            finish(dw, workspace, first + j, split, pm + mt * MMA_M + g + 8 * (q // 2),
                                   pn + nt * MMA_N + 2 * t + q % 2, acc[j * MT + mt, nt, q], beta)

    return weight_grad_v5


def _make_combine_wgrad(bs, storage, acc_type):
    """dw = sum of the N-splits of the workspace, in order (+ beta·dw)."""
    to_acc, from_acc = _converters(storage, acc_type)

    @cuda.jit
    def combine_wgrad(dw, workspace, beta):
        block = cuda.blockIdx.y
        e = cuda.blockIdx.x * COMBINE_THREADS + cuda.threadIdx.x
        if e < bs * bs:
            total = acc_type(0)
            for split in range(workspace.shape[0]):
                total += workspace[split, block, e]
            r = e // bs
            col = e - r * bs
            if beta != 0:
                total += acc_type(beta) * to_acc(dw[block, r, col])
            dw[block, r, col] = from_acc(total)

    return combine_wgrad


# -- launch configuration -------------------------------------------------------------

_kernels = {}


def _acc_type(storage):
    return float64 if storage == "float64" else float32


def _kernel(maker, *key):
    """Compile-once cache of kernels by maker and compile-time parameters."""
    full_key = (maker.__name__, *key)
    if full_key not in _kernels:
        storage = key[1]
        _kernels[full_key] = maker(key[0], storage, _acc_type(storage), *key[2:])
    return _kernels[full_key]


def _on_device(layout, key, array, stream):
    """A layout index (or schedule) array on the device, cached in the layout's schedule cache."""
    cache = layout._schedules
    key = ("device", key)
    if key not in cache:
        cache[key] = cuda.to_device(np.ascontiguousarray(array), stream=stream)
    return cache[key]


def _index(layout, name, stream):
    return _on_device(layout, name, getattr(layout, name), stream)


_unused = {}


def _unused_workspace(dtype):
    """A one-element stand-in for a workspace a launch does not write (shared, read by no one)."""
    if dtype not in _unused:
        _unused[dtype] = cuda.device_array((1, 1, 1), dtype)
    return _unused[dtype]


def segment_limit(layout, axis):
    """Longest segment (in blocks) a thread block of the version 2 product takes on."""
    ptr = layout.col_ptr if axis == "col" else layout.row_ptr
    mean = layout.n_blocks / max(1, len(ptr) - 1)
    return max(MIN_SEGMENT, int(np.ceil(SEGMENT_FACTOR * mean)))


def _vector_loads(arrays, n_rows, feature_axis, widths=(V4_WIDTH, V4_WIDTH)):
    """Whether version 4 may read each of ``arrays`` ``widths`` elements at a time:
    4-byte (or smaller) elements, aligned pointers, and with feature_axis 0 rows
    in whole vectors (the feature axis holds whole blocks anyway)."""
    itemsize = arrays[0].dtype.itemsize
    return (V4_VECTOR and itemsize <= 4 and (feature_axis == 1 or n_rows % V4_WIDTH == 0)
            and all(aligned(data_pointer(a), itemsize, width) for a, width in zip(arrays, widths)))


def _v5_vector_loads(arrays, n_rows, feature_axis, values):
    """Whether version 5 may read 16 bytes at a time: aligned pointers, and with feature_axis 0
    rows in whole vectors (4 words: 4 fp32 rows, or 8 rows of 16-bit values)."""
    return (V5_VECTOR and (feature_axis == 1 or n_rows % (4 * values) == 0)
            and all(aligned(data_pointer(a), 16, 1) for a in arrays))


def _words(array):
    """A device array's 32-bit words along its last axis (int32), for version 5's loads."""
    if hasattr(array, "data_ptr"):  # torch
        import torch

        return array.view(torch.int32)
    return array.view(np.int32)


def _bits(array):
    """The 16-bit patterns of an fp16 device array (a bf16 one is int16 already: a no-op)."""
    if hasattr(array, "data_ptr"):  # torch
        import torch

        return array.view(torch.int16)
    return array.view(np.int16)


def _launch_product_v1(out, a, w, layout, n_rows, transpose_w, feature_axis, stream):
    bs = layout.block_size
    rows = ROWS_PER_TILE[bs]
    line_ptr, other_idx, line_block = (("row_ptr", "col_idx", "col_idx") if transpose_w
                                       else ("col_ptr", "row_idx", "col_block"))
    kernel = _kernel(_make_product_v1, bs, a.dtype, transpose_w, feature_axis)
    lines = layout.shape[0] if transpose_w else layout.shape[1]
    launch(kernel, ((n_rows + rows - 1) // rows, lines), (bs, rows), stream, (
        out, a.device(stream), w.device(stream), _index(layout, line_ptr, stream),
        _index(layout, other_idx, stream), _index(layout, line_block, stream), n_rows,
    ))


def _product_schedule(layout, transpose_w, max_segment, stream):
    """What the products launch with over a layout, whatever the activations:
    (slots, product index arrays, combine index arrays), cached in the layout
    so that a call looks it up once instead of rebuilding keys for each array."""
    key = ("product schedule", transpose_w, max_segment)
    cached = layout._schedules.get(key)
    if cached is not None:
        return cached
    axis = "row" if transpose_w else "col"
    limit = segment_limit(layout, axis) if max_segment is None else max_segment
    schedule = layout.line_segments(axis, limit)
    other_idx, line_block = ("col_idx", "col_idx") if transpose_w else ("row_idx", "col_block")
    on_device = {
        name: _on_device(layout, (axis, limit, name), schedule[name], stream)
        for name in ("seg_line", "seg_begin", "seg_end", "seg_slot", "split_line", "split_begin", "split_end")
    }
    product = (on_device["seg_line"], on_device["seg_begin"], on_device["seg_end"], on_device["seg_slot"],
               _index(layout, other_idx, stream), _index(layout, line_block, stream))
    combine = (on_device["split_line"], on_device["split_begin"], on_device["split_end"])
    cached = layout._schedules[key] = (schedule["n_slots"], product, combine)
    return cached


def _launch_product_v2(out, a, w, layout, n_rows, transpose_w, feature_axis, stream, max_segment, version):
    bs = layout.block_size
    TM = PRODUCT_TILES[bs][0]
    slots, indices, combine_indices = _product_schedule(layout, transpose_w, max_segment, stream)
    acc = "float64" if a.dtype == "float64" else "float32"
    workspace = a.scratch((slots, n_rows, bs), acc, stream) if slots else _unused_workspace(acc)
    a_device, w_device = a.device(stream), w.device(stream)
    pre = None  # a launch before the product's (V5_TRANSPOSED_FORWARD's copy)
    if version == 5 and bs in V5_BLOCKS and a.dtype in V5_STORAGE:
        values = _v5_values(a.dtype)
        vector = _v5_vector_loads((a_device, w_device), n_rows, feature_axis, values)
        ring = _v5_ring(vector, feature_axis)
        threads, TM, _, _, _, _ = _v5_shape(bs, a.dtype, ring)
        copied = ring and not transpose_w and n_rows >= V5_TRANSPOSED_FORWARD.get((bs, a.dtype), n_rows + 1)
        kernel = _kernel(_make_product_v5, bs, a.dtype, transpose_w or copied, feature_axis, vector)
        a_device, w_device = (_words(a_device), _words(w_device)) if vector or values == 1 \
            else (_bits(a_device), _bits(w_device))
        if copied:  # the transposed copy's blocks are in the forward's order: block j is wt[j]
            wt = w.scratch(tuple(w_device.shape), "int32", stream)  # (w_device: w's words)
            pre = _launch_transpose_blocks(wt, w_device, layout, a.dtype, stream)
            w_device = wt
    elif version >= 4 and bs in V4_ROWS:
        TM, threads = V4_ROWS[bs], _v4_threads(bs)
        vector = _vector_loads((a_device, w_device), n_rows, feature_axis, (V4_WIDTH, _v4_weight_width(bs)))
        kernel = _kernel(_make_product_v4, bs, a.dtype, transpose_w, feature_axis, vector)
    else:
        maker, threads = (_make_product_v2 if version == 2 else _make_product_v3), PRODUCT_THREADS
        kernel = _kernel(maker, bs, a.dtype, transpose_w, feature_axis)
    grid = ((n_rows + TM - 1) // TM, len(indices[0]))
    args = (out, workspace, a_device, w_device, *indices, n_rows)
    launch(kernel, grid, threads, stream, args)
    if slots:
        combine = _kernel(_make_combine_lines, bs, a.dtype, feature_axis)
        grid = ((n_rows * bs + COMBINE_THREADS - 1) // COMBINE_THREADS, len(combine_indices[0]))
        launch(combine, grid, COMBINE_THREADS, stream, (out, workspace, *combine_indices, n_rows))
        return None
    return pre, (kernel, grid, threads, args)  # the call's launches: what a kept plan repeats


def _launch_transpose_blocks(wt, w_words, layout, storage, stream):
    """Launch `_make_transpose_blocks` (w_words and wt: int32 word views); return the launch,
    or None where the layout has no block."""
    if not layout.n_blocks:
        return None
    kernel = _kernel(_make_transpose_blocks, layout.block_size, storage)
    args = (wt, w_words, _index(layout, "col_block", stream))
    threads = _transpose_threads(layout.block_size, storage)
    launch(kernel, layout.n_blocks, threads, stream, args)
    return kernel, layout.n_blocks, threads, args


def _transpose_threads(bs, storage):
    """Threads of a `transpose_blocks` thread block: TRANSPOSE_THREADS, or one a word of a
    block with fewer words (block sizes are powers of two, so each thread takes a whole count)."""
    return min(TRANSPOSE_THREADS, bs * bs // _v5_values(storage))


def wgrad_splits(layout, n_rows, thread_blocks=None):
    """How many slices of N the weight gradient (versions 2-4) cuts each block's sum into."""
    thread_blocks = layout.n_blocks if thread_blocks is None else thread_blocks
    wanted = -(-4 * multiprocessors() // max(1, thread_blocks))
    return int(max(1, min(wanted, n_rows // (4 * WGRAD_CHUNK))))


def _launch_weight_grad(dw, x, dy, layout, n_rows, feature_axis, beta, stream, version, splits):
    bs = layout.block_size
    if version == 1:
        kernel = _kernel(_make_weight_grad_v1, bs, x.dtype, feature_axis)
        launch(kernel, layout.n_blocks, (bs, WGRAD_ROWS[bs]), stream, (
            dw, x.device(stream), dy.device(stream), _index(layout, "coords", stream), n_rows, beta,
        ))
        return None
    v5 = version == 5 and V5_WGRAD and bs in V5_BLOCKS and x.dtype in V5_STORAGE
    v4 = not v5 and version >= 4 and bs in V4_WGRAD_ROWS and feature_axis == 1
    group = V5_WGRAD_GROUP.get(bs, 1) if v5 and bs <= V5_WARP_TILE else 1
    coords = _index(layout, "coords", stream)
    if group > 1:  # a warp per row segment of up to `group` blocks
        segments = layout.line_segments("row", group)
        seg_begin, seg_end = (_on_device(layout, ("row", group, name), segments[name], stream)
                              for name in ("seg_begin", "seg_end"))
        thread_blocks = -(-len(segments["seg_begin"]) // _v5_wgrad_warps(group))
    else:
        seg_begin = seg_end = coords  # (unread)
        if v5:  # W blocks a thread block computes
            per_block = _v5_wgrad_blocks(bs)
        else:
            per_block = V4_WGRAD_THREADS // (bs // 8) ** 2 if v4 else 1
        thread_blocks = -(-layout.n_blocks // per_block)
    splits = wgrad_splits(layout, n_rows, thread_blocks) if splits is None else max(1, int(splits))
    rows_per_split = -(-max(n_rows, 1) // splits)
    if v5:  # whole steps a split, so that feature_axis 0's 8-row vectors never straddle an end
        rows_per_split = -(-rows_per_split // V5_WGRAD_ROWS) * V5_WGRAD_ROWS
        splits = -(-max(n_rows, 1) // rows_per_split)
    acc = "float64" if x.dtype == "float64" else "float32"
    # A workspace of one split tells the kernel to finish in place (no combine pass).
    workspace = x.scratch((splits, layout.n_blocks, bs * bs), acc, stream) if splits > 1 \
        else _unused_workspace(acc)
    x_device, dy_device = x.device(stream), dy.device(stream)
    if v5:
        values = _v5_values(x.dtype)
        vector = _v5_vector_loads((x_device, dy_device), n_rows, feature_axis, values)
        kernel = _kernel(_make_weight_grad_v5, bs, x.dtype, feature_axis, vector, group)
        x_device, dy_device = (_words(x_device), _words(dy_device)) if vector or values == 1 \
            else (_bits(x_device), _bits(dy_device))
        threads = 32 * _v5_wgrad_warps(group)
        args = (dw, workspace, x_device, dy_device, coords, seg_begin, seg_end, n_rows, rows_per_split, beta)
    else:
        if v4:
            vector = _vector_loads((x_device, dy_device), n_rows, feature_axis)
            kernel = _kernel(_make_weight_grad_v4, bs, x.dtype, feature_axis, vector)
            threads = V4_WGRAD_THREADS
        else:
            kernel = _kernel(_make_weight_grad_v3 if version >= 3 else _make_weight_grad_v2, bs, x.dtype,
                             feature_axis)
            threads = WGRAD_THREADS
        args = (dw, workspace, x_device, dy_device, coords, n_rows, rows_per_split, beta)
    main = (kernel, (thread_blocks, splits), threads, args)
    launch(main[0], main[1], main[2], stream, main[3])
    if splits == 1:
        return main, None, None
    combine = (_kernel(_make_combine_wgrad, bs, x.dtype),
               ((bs * bs + COMBINE_THREADS - 1) // COMBINE_THREADS, layout.n_blocks), COMBINE_THREADS,
               (dw, workspace, beta))
    launch(combine[0], combine[1], combine[2], stream, combine[3])
    return main, combine, (splits, layout.n_blocks, bs * bs)  # what a kept plan repeats


# Products called again with torch tensors of the same shapes, dtypes, device and pointer
# alignment on the same layout skip the general path (Operands, checks, schedule lookup,
# argument fields: ~30 µs of Python): a kept plan allocates the output and rewrites three
# pointers of the recorded launch (`_launch.Replay`), after replaying V5_TRANSPOSED_FORWARD's
# copy of W into a fresh scratch array where the call made one.
_plans = {}
MAX_PLANS = 256
_tensor_class = None  # torch.Tensor, once a plan exists (torch is imported by then)


class _Plan:
    """pre: the copy's launch (wt, w live) and scratch its (shape, torch dtype), or both None."""
    __slots__ = ("layout", "out_shape", "launch", "pre", "scratch")

    def __init__(self, layout, out_shape, launch, pre, scratch):
        self.layout, self.out_shape, self.launch, self.pre, self.scratch = layout, out_shape, launch, pre, scratch


def _plan_key(a, w, a_pointer, w_pointer, layout, feature_axis, transpose_w, version):
    """Everything a product call's checks and launch depend on, for torch tensors a and w."""
    return (id(layout), feature_axis, transpose_w, version, a.dtype, w.dtype, a.shape, w.shape, a.device,
            a_pointer % 16, w_pointer % 16)


def _replayed_product(a, w, layout, feature_axis, transpose_w, version):
    """The product through a kept plan, or None: no plan fits (the general path runs)."""
    if not (isinstance(a, _tensor_class) and isinstance(w, _tensor_class)) or _arrays._poison_outputs:
        return None
    a_pointer, w_pointer = a.data_ptr(), w.data_ptr()
    plan = _plans.get(_plan_key(a, w, a_pointer, w_pointer, layout, feature_axis, transpose_w, version))
    if plan is None or plan.layout is not layout or not (a.is_contiguous() and w.is_contiguous()):
        return None
    out = a.new_empty(plan.out_shape)
    stream = _arrays.torch_stream_handle()
    if plan.pre is not None:
        wt = a.new_empty(plan.scratch[0], dtype=plan.scratch[1])
        plan.pre(stream, wt.data_ptr(), w_pointer)
        w_pointer = wt.data_ptr()
    plan.launch(stream, out.data_ptr(), a_pointer, w_pointer)
    return out


def _store_plan(key, plan):
    """Keep `plan` under `key` (past MAX_PLANS plans, start afresh); from the first plan on,
    the replays tell torch tensors by `_tensor_class`."""
    global _tensor_class
    import torch

    _tensor_class = torch.Tensor
    if len(_plans) >= MAX_PLANS:
        _plans.clear()
    _plans[key] = plan


def _keep_plan(a, w, layout, feature_axis, transpose_w, version, out_shape, launched):
    """After a general-path product of torch tensors without a combining launch: keep it for
    `_replayed_product`."""
    if launched is None or a.kind != "torch" or _arrays._poison_outputs:
        return
    pre, main = launched
    plan = replay(*main, live=(0, 2, 3))  # out, a, w
    pre_plan = None if pre is None else replay(*pre, live=(0, 1))  # wt, w
    if plan is None or (pre is not None and pre_plan is None):
        return
    import torch

    a_native, w_native = a.native, w.native
    key = _plan_key(a_native, w_native, a_native.data_ptr(), w_native.data_ptr(), layout, feature_axis,
                    transpose_w, version)
    scratch = None if pre is None else (tuple(pre[3][0].shape), torch.int32)
    _store_plan(key, _Plan(layout, out_shape, plan, pre_plan, scratch))


# Weight gradients likewise (the same `_plans`, keys that start with "weight_grad"): a kept
# plan allocates dW (or takes out=) and the N-splits' workspace, and replays the gradient's
# launch and, with splits, the combining one. The general path costs ~60-90 µs of Python a
# call, which eager timings of the gradient counted on top of the kernels.
class _WeightGradPlan:
    """workspace: the N-splits' (shape, torch dtype), or None (one split, one launch)."""
    __slots__ = ("layout", "workspace", "main", "combine")

    def __init__(self, layout, workspace, main, combine):
        self.layout, self.workspace, self.main, self.combine = layout, workspace, main, combine


def _weight_grad_key(x, dy, out, layout, feature_axis, beta, version, splits):
    """Everything a weight-gradient call's checks and launches depend on (torch tensors), or None."""
    if not isinstance(beta, (int, float)) or not (splits is None or isinstance(splits, int)):
        return None
    return ("weight_grad", id(layout), feature_axis, float(beta), version, splits, x.dtype, dy.dtype, x.shape,
            dy.shape, x.device, x.data_ptr() % 16, dy.data_ptr() % 16,
            None if out is None else (out.dtype, out.shape, out.device, out.data_ptr() % 16))


def _replayed_weight_grad(x, dy, layout, feature_axis, out, beta, version, splits):
    """The weight gradient through a kept plan, or None: no plan fits (the general path runs)."""
    if not (isinstance(x, _tensor_class) and isinstance(dy, _tensor_class)
            and (out is None or isinstance(out, _tensor_class))) or _arrays._poison_outputs:
        return None
    key = _weight_grad_key(x, dy, out, layout, feature_axis, beta, version, splits)
    plan = _plans.get(key) if key is not None else None
    if plan is None or plan.layout is not layout or not (
            x.is_contiguous() and dy.is_contiguous() and (out is None or out.is_contiguous())) or (
            out is not None and _arrays.tensors_overlap(out, (x, dy))):
        return None  # (the general path checks an out= sharing memory with x or dy, and raises)
    dw = x.new_empty(layout.w_shape) if out is None else out
    stream = _arrays.torch_stream_handle()
    if plan.combine is None:
        plan.main(stream, dw.data_ptr(), x.data_ptr(), dy.data_ptr())
    else:
        workspace = x.new_empty(plan.workspace[0], dtype=plan.workspace[1])
        plan.main(stream, dw.data_ptr(), workspace.data_ptr(), x.data_ptr(), dy.data_ptr())
        plan.combine(stream, dw.data_ptr(), workspace.data_ptr())
    return dw


def _keep_weight_grad_plan(x, dy, out, layout, feature_axis, beta, version, splits, launched):
    """After a general-path weight gradient of torch tensors: keep its launches."""
    if launched is None or x.kind != "torch" or _arrays._poison_outputs:
        return
    main, combine, workspace = launched
    import torch

    key = _weight_grad_key(x.native, dy.native, None if out is None else out.native, layout, feature_axis, beta,
                           version, splits)
    if key is None:
        return
    kept = (replay(*main, live=(0, 2, 3) if combine is None else (0, 1, 2, 3)),
            None if combine is None else replay(*combine, live=(0, 1)))
    if kept[0] is None or (combine is not None and kept[1] is None):
        return
    workspace = None if workspace is None else (workspace, torch.float64 if x.dtype == "float64" else torch.float32)
    _store_plan(key, _WeightGradPlan(layout, workspace, *kept))


# -- public functions ----------------------------------------------------------------


def default_version(dtype):
    """The version a call without ``version=`` runs: 5 (tensor cores; fp32 as 3xTF32 with
    round-to-nearest sums) for fp16, bf16 and fp32, 4 for fp64."""
    return 5 if dtype in TENSOR_CORE_DEFAULT else 4


def _check_common(ops, feature_axis, version):
    """Validate; return the version to run (`default_version` where ``version`` is None)."""
    if feature_axis not in (0, 1):
        raise ValueError(f"feature_axis: expected 0 or 1, got {feature_axis!r}")
    if version is not None and version not in VERSIONS:
        raise ValueError(f"version: expected one of {VERSIONS} or None, got {version!r}")
    check_same_kind(ops)
    for op in ops:
        check_dtype(op)
        op.require_contiguous()
    check_same_dtype(ops)
    return default_version(ops[0].dtype) if version is None else version


def _check_activation(op, features, feature_axis, what):
    if len(op.shape) != 2:
        raise ValueError(f"{op.name}: expected a 2-D array {what}, got shape {op.shape}")
    if op.shape[feature_axis] != features:
        raise ValueError(
            f"{op.name}: expected {features} features on axis {feature_axis} {what}, got shape {op.shape}"
        )
    return op.shape[1 - feature_axis]


def _product(a, w, layout, feature_axis, transpose_w, version, max_segment=None):
    if _plans and max_segment is None:
        out = _replayed_product(a, w, layout, feature_axis, transpose_w, version)
        if out is not None:
            return out
    given = version
    a, w = Operand(a, "dy" if transpose_w else "x"), Operand(w, "w")
    version = _check_common((a, w), feature_axis, version)
    check_shape(w, layout.w_shape)
    C, K = layout.dense_shape
    in_features, out_features = (K, C) if transpose_w else (C, K)
    n_rows = _check_activation(a, in_features, feature_axis, f"(layout has {C} inputs, {K} outputs)")

    stream = launch_stream((a, w))
    out_shape = (n_rows, out_features) if feature_axis == 1 else (out_features, n_rows)
    native, out = a.empty(out_shape, stream)
    if n_rows:
        if version == 1:
            _launch_product_v1(out, a, w, layout, n_rows, transpose_w, feature_axis, stream)
        else:
            launched = _launch_product_v2(out, a, w, layout, n_rows, transpose_w, feature_axis, stream,
                                          max_segment, version)
            if max_segment is None:
                _keep_plan(a, w, layout, feature_axis, transpose_w, given, out_shape, launched)
    return a.result(native, out, stream)


def forward(x, w, layout, feature_axis=1, version=None):
    """``y = x · W`` for block-sparse ``W`` given as ``w[n_blocks, bs, bs]`` over ``layout``."""
    return _product(x, w, layout, feature_axis, False, version)


def input_grad(dy, w, layout, feature_axis=1, version=None):
    """``dx = dy · Wᵀ`` for block-sparse ``W``."""
    return _product(dy, w, layout, feature_axis, True, version)


def weight_grad(x, dy, layout, feature_axis=1, out=None, beta=0.0, version=None, splits=None):
    """``dW = xᵀ · dy`` on the layout's blocks, as ``(n_blocks, bs, bs)``.

    With ``out`` the result goes there, as ``out = xᵀ·dy + beta·out`` (so the
    gradients of a weight shared across steps add up without a copy); ``out``
    is then returned, and must not share memory with ``x`` or ``dy``
    (ValueError). ``splits`` (version 2) overrides how many slices of N are
    summed separately and then combined in order.
    """
    if _plans:
        dw = _replayed_weight_grad(x, dy, layout, feature_axis, out, beta, version, splits)
        if dw is not None:
            return dw
    given = version
    x, dy = Operand(x, "x"), Operand(dy, "dy")
    ops = (x, dy) if out is None else (x, dy, Operand(out, "out"))
    version = _check_common(ops, feature_axis, version)
    C, K = layout.dense_shape
    n_x = _check_activation(x, C, feature_axis, f"(layout has {C} inputs)")
    n_dy = _check_activation(dy, K, feature_axis, f"(layout has {K} outputs)")
    if n_x != n_dy:
        raise ValueError(f"x and dy: expected the same N, got {n_x} and {n_dy}")
    try:
        beta = float(beta)
    except (TypeError, ValueError):
        raise TypeError(f"beta: expected a number, got {beta!r}") from None
    if out is None and beta != 0:
        raise ValueError("beta: accumulating (beta != 0) needs out=")
    if out is not None:
        check_shape(ops[2], layout.w_shape)
        if ops[2].kind == "numpy":
            raise TypeError("out: expected a device array (a NumPy out= would be a copy)")
        _arrays.check_disjoint(ops[2], (x, dy))

    stream = launch_stream(ops)
    if out is None:
        native, dw = x.empty(layout.w_shape, stream)
    else:
        native, dw = ops[2].native, ops[2].device(stream)
    if layout.n_blocks:
        launched = _launch_weight_grad(dw, x, dy, layout, n_x, feature_axis, beta, stream, version, splits)
        _keep_weight_grad_plan(x, dy, None if out is None else ops[2], layout, feature_axis, beta, given, splits,
                               launched)
    if out is not None and not (SIMULATOR and ops[2].kind == "torch"):
        return out  # the caller's own array (an Operand holds a detached torch view of it)
    return (x if out is None else ops[2]).result(native, dw, stream)


def transpose_blocks(w, layout):
    """W's blocks transposed into the layout's column order: ``wt[p] = w[layout.col_block[p]]ᵀ``
    (fp32, fp16 or bf16, ``w`` 4-byte aligned), as the forward makes for itself where
    V5_TRANSPOSED_FORWARD names its block size and storage, at its rows or more."""
    w = Operand(w, "w")
    check_dtype(w, V5_STORAGE)
    w.require_contiguous()
    check_shape(w, layout.w_shape)
    stream = launch_stream((w,))
    native, wt = w.empty(layout.w_shape, stream)
    w_device = w.device(stream)
    if not aligned(data_pointer(w_device), 4, 1):
        raise ValueError("w: expected a 4-byte aligned array (its blocks are read as 32-bit words)")
    _launch_transpose_blocks(_words(wt), _words(w_device), layout, w.dtype, stream)
    return w.result(native, wt, stream)
