"""Device helpers the matmul's kernel families share.

Activation loads and stores for either feature axis, bf16 <-> fp32 conversion,
the products' and weight gradients' output stages (into the output, or into a
workspace slot that a combining kernel sums in order), the tensor-core
accumulate step, and the grouped order in which product tiles are handed out.
"""

from numba import cuda, float32, float64, int16, int32, int64, uint32
from numba.cuda import libdevice

from ..ptx.half2 import floats_of_half2
from ..ptx.mma import mma_3xtf32, mma_bf16, mma_f16
from ..ptx.vector import load2, load4
from ..runtime.backend import SIMULATOR

# 16-byte alignment lets the compiler merge four shared loads into one; the
# simulator does not take an alignment.
SHARED_ALIGN = None if SIMULATOR else 16
STATIC_SHARED = 48 * 1024  # the most static shared memory a thread block may declare


def fitted(chunk, unit_bytes, limit=STATIC_SHARED):
    """``chunk``, halved until ``chunk`` units of ``unit_bytes`` of shared tiles fit in ``limit``
    bytes (fp64 and block 128 tiles of the SIMT kernels take smaller chunks)."""
    while chunk > 1 and chunk * unit_bytes > limit:
        chunk //= 2
    return chunk


def activation_io(feature_axis):
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


def activation_vector_load(feature_axis, width):
    """load(a, row, feature) -> tuple of ``width`` activations from (row, feature) on,
    along the contiguous axis (features with feature_axis 1, rows with 0)."""
    vector = {2: load2, 4: load4}.get(width)
    if width == 1:
        scalar, _ = activation_io(feature_axis)

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


def weight_vector_load(transpose_w, width):
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


def converters(storage, acc_type):
    """to_acc(stored) -> accumulator value, from_acc(value) -> what is stored."""
    if storage == "bfloat16":

        @cuda.jit(device=True, inline=True)
        def to_acc(bits):
            return libdevice.int_as_float(int32(bits) << 16)

        @cuda.jit(device=True, inline=True)
        def from_acc(value):
            # Round to nearest even on the upper 16 bits of the float32; a NaN stays a quiet NaN
            # (rounding its bits could carry into the sign: 0x7FFFFFFF would become -0).
            u = int64(libdevice.float_as_int(float32(value))) & 0xFFFFFFFF
            r = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16) & 0xFFFF
            if value != value:
                r = (u >> 16) | 0x40
            return int16(r - 0x10000 if r >= 0x8000 else r)
    else:

        @cuda.jit(device=True, inline=True)
        def to_acc(value):
            return acc_type(value)

        @cuda.jit(device=True, inline=True)
        def from_acc(value):
            return value

    return to_acc, from_acc


def pair_reader(storage):
    """``halves(word)``: the two 16-bit values (fp16 or bf16 ``storage``) of a 32-bit word as fp32,
    (low, high): the first element of a pair in memory, then the second."""
    if storage == "bfloat16":

        @cuda.jit(device=True, inline=True)
        def halves(word):
            return libdevice.int_as_float(int32(word << 16)), libdevice.int_as_float(int32(word & -65536))
    else:

        @cuda.jit(device=True, inline=True)
        def halves(word):
            return floats_of_half2(word)

    return halves


def bias_reader(kind, acc_type):
    """``bias_at(bias, i)``: bias[i] as an ``acc_type`` value, ``kind`` the bias's dtype name (bf16
    as its int16 bits). With ``kind`` None (no bias, ``bias`` a stand-in) it gives 0, for typing
    only: a kernel made without a bias adds nothing."""
    if kind is None:

        @cuda.jit(device=True, inline=True)
        def bias_at(bias, i):
            return acc_type(0)
    else:
        to_acc = converters(kind, acc_type)[0]

        @cuda.jit(device=True, inline=True)
        def bias_at(bias, i):
            return acc_type(to_acc(bias[i]))

    return bias_at


def chunk_position(feature_axis, rows, features):
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


def product_output(bs, storage, acc_type, feature_axis):
    """emit(out, workspace, slot, line, row, col, value): one result of a product, for feature
    col of block-line `line`, into out, or (slot >= 0: a segment of a split line) into its
    workspace slot, which the combine kernel sums in order."""
    _, store = activation_io(feature_axis)
    _, from_acc = converters(storage, acc_type)

    @cuda.jit(device=True, inline=True)
    def emit(out, workspace, slot, line, row, col, value):
        if slot < 0:
            store(out, row, line * bs + col, from_acc(value))
        else:
            workspace[slot, row, col] = value

    return emit


def weight_grad_output(bs, storage, acc_type):
    """finish(dw, workspace, block, split, r, col, total, beta): one element of a weight
    gradient's block, into dw (+ beta·dw), or with several N-splits into the workspace slot
    of its split, which the combine kernel sums in order."""
    to_acc, from_acc = converters(storage, acc_type)

    @cuda.jit(device=True, inline=True)
    def finish(dw, workspace, block, split, r, col, total, beta):
        if workspace.shape[0] > 1:
            workspace[split, block, r * bs + col] = total
        else:
            if beta != 0:
                total += acc_type(beta) * to_acc(dw[block, r, col])
            dw[block, r, col] = from_acc(total)

    return finish


def mma_accumulate(cfg, storage):
    """accumulate(acc, i, nt, fa, mt, b0, b1): acc[i, nt] += A·B for one version 5 mma tile, A
    the fragment words fa[mt], B the words b0, b1. fp32 (3xTF32) with ``cfg.v5_rounded_sums`` starts
    the mma from zero and adds its result in round-to-nearest fp32: the tensor cores' own fp32
    sums drift over long sums."""
    V5_ROUNDED_SUMS = cfg.v5_rounded_sums
    mma = mma_3xtf32 if storage == "float32" else (mma_bf16 if storage == "bfloat16" else mma_f16)
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
def grouped_tile(group):
    """(row tile, segment) of this thread block of a (row tiles, segments) product grid, handed
    out `group` row tiles at a time: launch order id = x + y * tiles walks the group's tiles
    fastest, then its segments, then the next group. Every (tile, segment) pair once."""
    tiles = uint32(cuda.gridDim.x)
    if group == 0 or group >= tiles:
        return cuda.blockIdx.x, cuda.blockIdx.y
    return tile_of(uint32(cuda.blockIdx.x) + uint32(cuda.blockIdx.y) * tiles, tiles, cuda.gridDim.y, group)


@cuda.jit(device=True, inline=True)
def tile_of(pid, tiles, segments, group):
    """(row tile, segment) of work item ``pid`` of ``tiles`` x ``segments`` in `grouped_tile`'s
    order (a persistent thread block walks pid = its index, + the grid, ...)."""
    if group == 0 or group >= tiles:
        return int32(uint32(pid) % uint32(tiles)), int32(uint32(pid) // uint32(tiles))
    span = uint32(group) * uint32(segments)
    first = (uint32(pid) // span) * uint32(group)
    local = uint32(pid) % span
    rows = min(uint32(tiles) - first, uint32(group))
    return int32(first + local % rows), int32(local // rows)


@cuda.jit(device=True, inline=True)
def interleave(x0, x1, c):
    """Word c (0-7) of the 16-bit pairs (k, k + 1) of eight neighbours, from x0, four words of
    eight values at k, and x1, the same eight at k + 1 (version 5's loads across k)."""
    lo = uint32(x0[c // 2])
    hi = uint32(x1[c // 2])
    if c % 2 == 0:
        return uint32((lo & uint32(0xFFFF)) | (hi << uint32(16)))
    return uint32((lo >> uint32(16)) | (hi & uint32(0xFFFF0000)))


@cuda.jit(device=True, inline=True)
def add_outer_8x8(acc, u, v):
    """acc += u ⊗ v for version 4's 8 x 8 patch (both kernels)."""
    for i in range(8):
        for q in range(8):
            acc[i, q] += u[i] * v[q]


def acc_type(storage):
    return float64 if storage == "float64" else float32
