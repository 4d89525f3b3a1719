"""``reduce_mask``: the active windows of a mask ``[N, H, W]``, in row-major order.

A window is active when its pool (max, or the average over its full area) is
above ``tol``; a NaN pixel makes the pool NaN, never above: inactive. Returns
``(indices, count)``: for a NumPy mask the ``[count, 3]`` int32 indices and an
int; for a device mask an ``[N*bcount_h*bcount_w, 3]`` buffer whose first
``count`` rows are valid (the rest n = -1, which every kernel skips) and the
count as a one-element device array, so no host sync is forced. Version 2
(`reduce_pass`) where windows fit a chunk, else version 1 (`reduce_pool`).
"""

import functools

import numpy as np
from numba import cuda

from ..ptx.vector import aligned
from ..runtime import plans
from ..runtime.arrays import Operand, check_dtype, launch_stream
from ..runtime.backend import SIMULATOR
from ..runtime.compile import cached
from ..runtime.devices import on_arrays_device
from ..runtime.launch import data_pointer, launch, multiprocessors
from ..windows import block_count, check_geometry, check_tol, pair
from .config import as_config
from .device import WARP, magic
from .dispatch import as_dtype, int_output, zero
from .plans import keep_plan, replayed_reduce
from .reduce_pass import MAX_PASS_EXTENT, MAX_PASS_WINDOWS, make_pass_kernel
from .reduce_pool import make_reduce_kernels
from .statuses import _statuses

PASS_VECTOR_DTYPES = ("float32", "float16", "uint8", "bool")  # (bool read as its uint8 bytes)


MASK_DTYPES = ("bool", "uint8", "float16", "float32", "float64")


def _reduce_group_warps(cfg, size, total):
    """Warps pooling one window: enough for REDUCE_LOADS pixels a lane, at most a thread block,
    and no more than it takes to fill the GPU's warp slots once (more windows than that: the
    windows themselves fill it, and groups only add barriers)."""
    REDUCE_FILL = cfg.reduce_fill
    REDUCE_LOADS = cfg.reduce_loads
    REDUCE_WARPS = cfg.reduce_warps
    warps = 1
    while (warps < REDUCE_WARPS and warps * WARP * REDUCE_LOADS < size[0] * size[1]
           and total * warps < REDUCE_FILL * multiprocessors()):
        warps *= 2
    return warps


def _pass_chunks(cfg, size, total, vector=1):
    """(windows a chunk, lanes, phases) of reduce_mask's version 2: at least ``pass_pixels_large``
    loads a chunk (`vector` pixels each) where that leaves at least half as many chunks as
    multiprocessors, else ``pass_pixels``, and at most a wave of chunks (``pass_wave``), within
    ``pass_windows`` windows and ``pass_columns`` columns; a full chunk's threads across its
    columns (lanes) and rows (phases)."""
    PASS_COLUMNS = cfg.pass_columns
    PASS_PIXELS = cfg.pass_pixels
    PASS_PIXELS_LARGE = cfg.pass_pixels_large
    PASS_THREADS = cfg.pass_threads
    PASS_WAVE = cfg.pass_wave
    PASS_WINDOWS = cfg.pass_windows
    sms = multiprocessors()
    wave = -(-total // (PASS_WAVE * sms)) if PASS_WAVE else 1
    most = max(1, min(PASS_WINDOWS, PASS_COLUMNS // size[1], total))
    for pixels in (PASS_PIXELS_LARGE, PASS_PIXELS):
        wanted = max(pixels * vector // (size[0] * size[1]), wave)
        per_chunk = max(1, min(most, wanted))
        if 2 * -(-total // per_chunk) >= sms:
            break
    lanes = min(per_chunk * (size[1] // vector), PASS_THREADS)
    return per_chunk, lanes, PASS_THREADS // lanes


def _fits_32_bits(H, W, count_hw, size, stride, offset):
    """Whether every row and column version 2 computes (image extents, window starts and ends,
    in 32 bits) stays below MAX_PASS_EXTENT in magnitude; else version 1 (64-bit) runs."""
    reach = [abs(o) + max(c - 1, 0) * abs(t) + z for c, t, o, z in zip(count_hw, stride, offset, size)]
    return max(H, W, *reach) < MAX_PASS_EXTENT


def _pass_vector(cfg, dtype, mask, width, size, stride, offset):
    """PASS_VECTOR where every window's columns are whole aligned vectors of the mask (`mask`: its
    device array, of `dtype`), else 1."""
    PASS_VECTOR = cfg.pass_vector
    v = PASS_VECTOR
    if v == 1 or dtype not in PASS_VECTOR_DTYPES:
        return 1
    fits = width % v == 0 and size[1] % v == 0 and stride[1] % v == 0 and offset[1] % v == 0
    return v if fits and aligned(data_pointer(mask), np.dtype(dtype).itemsize, v) else 1


def _pass_look_back(cfg, n_chunks):
    """(who looks back, words from one status to the next) for a launch of `n_chunks` chunks
    (16 words under PASS_TRACE, whose stamps take the spare ones)."""
    PASS_BLOCK_LOOK_BACK = cfg.pass_block_look_back
    PASS_LOOK_BACK = cfg.pass_look_back
    PASS_TRACE = cfg.pass_trace
    STATUS_SPREAD_WORDS = cfg.status_spread_words
    STATUS_STRIDE = cfg.status_stride
    who = PASS_LOOK_BACK or ("block" if n_chunks >= PASS_BLOCK_LOOK_BACK else "warp")
    stride = 16 if PASS_TRACE else STATUS_STRIDE
    if stride is None:
        stride = 16 if who == "block" and (n_chunks + 1) * 16 <= STATUS_SPREAD_WORDS else 1
    return who, stride


def _pass_kernel(cfg, avgpool, wide, vector, look_back, stride):
    """The pass kernel for these flags, compiled once per config."""
    PASS_NAN_MAX = cfg.pass_nan_max
    ptx = _nan_max_ptx() if PASS_NAN_MAX is None else PASS_NAN_MAX == "ptx"
    return cached(make_pass_kernel, cfg, avgpool, wide, vector, look_back, stride, ptx)


@functools.cache
def _nan_max_ptx():
    """Whether this device has max.NaN.f32 (sm_80 on; the simulator runs the select)."""
    return not SIMULATOR and cuda.get_current_device().compute_capability >= (8, 0)


@on_arrays_device
def reduce_mask(mask, bsize, bstride, boffset=0, tol=0.0, avgpool=False, bcount=None, version=None, config=None):
    """Active windows of a mask ``[N, H, W]``, row-major: ``(indices, count)`` (see the module
    docstring). ``version``: 1 (pooling, then compaction) or 2 (one pass; the default where
    windows are at most PASS_COLUMNS wide, else 1)."""
    cfg = as_config(config)
    COMPACT_THREADS = cfg.compact_threads
    PASS_COLUMNS = cfg.pass_columns
    PASS_THREADS = cfg.pass_threads
    PREFIX_CHUNKS = cfg.prefix_chunks
    REDUCE_VERSION = cfg.reduce_version
    REDUCE_WARPS = cfg.reduce_warps
    settings = (cfg, bsize, bstride, boffset, tol, avgpool, bcount, version)
    if plans.kept:
        kept = replayed_reduce(mask, settings)
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
    indices_native, indices = int_output(mask_op, (max(total, 1), 3), stream, fill=None if total else -1)
    count_native, count = int_output(mask_op, (1,), stream, fill=None if total else 0)
    one_pass = (REDUCE_VERSION if version is None else version) == 2 and size[1] <= PASS_COLUMNS \
        and total <= MAX_PASS_WINDOWS and _fits_32_bits(H, W, count_hw, size, stride, offset)
    if total and one_pass:
        mask_device = mask_op.device(stream)
        vector = _pass_vector(cfg, mask_op.dtype, mask_device, W, size, stride, offset)
        if vector > 1 and mask_op.dtype == "bool":
            mask_device = as_dtype(mask_device, "uint8")  # (a vector of bools would load as bits)
        per_chunk, lanes, phases = _pass_chunks(cfg, size, total, vector)
        mask_device = mask_device.reshape(N * H * W)  # (the kernel indexes it flat)
        n_chunks = -(-total // per_chunk)
        # Zeroed statuses (tags start at 1): kept ones, else from the caller's allocator;
        # status[0] counts launches.
        look_back, spread = _pass_look_back(cfg, n_chunks)
        words = (n_chunks + 1) * spread
        status = _statuses(words, stream)
        if status is None:
            status = mask_op.scratch(words, "int64", stream)
            zero(status, stream)
        kernel = _pass_kernel(cfg, bool(avgpool), bool(avgpool) or mask_op.dtype == "float64", vector, look_back, spread)
        one = (kernel, n_chunks, PASS_THREADS, (
            indices, count, status, mask_device, N, H, W, count_hw[0], count_hw[1], size[0], size[1],
            stride[0], stride[1], offset[0], offset[1], tol, per_chunk, lanes, phases,
            magic(count_hw[0]), magic(count_hw[1]), magic(size[1] // vector), magic(lanes)))
        launch(one[0], one[1], one[2], stream, one[3])
        keep_plan("reduce", (mask,), None, settings, tuple(indices_native.shape), [(one, (0, 1, 2, 3))],
                   ("pass", words))
    elif total:
        # Temporaries from the caller's allocator (torch's cache): no cudaMalloc per call.
        group_warps = _reduce_group_warps(cfg, size, total)
        n_chunks = -(-total // COMPACT_THREADS)
        flags = mask_op.scratch(total, "int8", stream)
        chunk_counts = mask_op.scratch(n_chunks, "int32", stream)
        zero(chunk_counts, stream)
        pool_kernel, scan_kernel, write_summed, write_scanned = cached(make_reduce_kernels, cfg)
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
            keep_plan("reduce", (mask,), None, settings, tuple(indices_native.shape),
                       [(pool, (0, 1, 2)), (compact, (0, 1, 2, 3, 4))], ("two", total, n_chunks))
    if mask_op.kind == "numpy":
        n_active = int(count.copy_to_host(stream=stream)[0])
        return indices.copy_to_host(stream=stream)[:n_active], n_active
    return mask_op.result(indices_native, indices, stream), mask_op.result(count_native, count, stream)
