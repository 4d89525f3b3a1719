"""Which gather/scatter kernel runs, and its launch.

The path functions (`row_path`, `pair_gather_rows`, `pair_path`, `merge_path`)
are the dispatch table: layout x dtype x geometry x pointer alignment -> kernel
family. `launch_copy` and `launch_merge` launch the chosen one and return what
a kept plan repeats.
"""

import numpy as np
from numba import cuda

from ..runtime.backend import SIMULATOR
from ..runtime.compile import cached
from ..runtime.launch import data_pointer, launch, multiprocessors
from .copy_element import TILE, TILE_ROWS, make_copy_kernels
from .copy_pair_tiles import make_pair_tile_gathers, make_pair_tile_kernels
from .copy_pairs import make_pair_kernels
from .copy_rows import make_row_kernels
from .device import WARP
from .merge import CHAINED, fill_int32, link_windows, make_merge_kernels

MAX_GRID_X = 2**31 - 1


def copy_kernel(cfg, scatter, transpose, add, atomic, dtype, channels_last):
    return cached(make_copy_kernels, cfg, scatter, transpose, add, atomic, dtype, channels_last)


# Kinds of plain pair copies that may go a strip of windows a thread block (`SbnetConfig.pair_strips`):
# gathers, scatters of four or two halves a word (overwrites and adds), atomic adds.
PAIR_STRIP_KINDS = ("gather", "scatter quads", "scatter pairs", "atomic")


WORD = 8  # bytes an overwriting channels-last copy moves per element when it can


HALF2 = 4  # bytes a channels-last fp16 add moves per element when it can (two values)


def as_words(array, size=WORD):
    """The same memory as int64 (size 8) or int32 (size 4) words along the last axis (a view)."""
    if hasattr(array, "data_ptr"):  # torch
        import torch

        return array.view(torch.int64 if size == 8 else torch.int32)
    return array.view(np.int64 if size == 8 else np.int32)  # Numba and CuPy


def row_path(cfg, image, blocks, n_blocks, channels_last, transpose, atomic, dtype, size, pixels):
    """The row kernels' (vector dtype, half2) where they apply, else None: channels-last
    images, pixels of whole 16-byte vectors, 16-byte aligned pointers, a grid's y and z
    within CUDA's limit (`launch_copy`'s grids; a transposing tile of `pixels`); a
    transposing copy also needs float32 or float16."""
    MAX_GRID_YZ = cfg.max_grid_yz
    ROW_COPIES = cfg.row_copies
    ROW_TILE_C = cfg.row_tile_c
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


def pair_path(cfg, scatter, add, atomic, image, blocks, channels_last, transpose, dtype, geometry):
    """Whether the pair kernels take a copy: ``cfg.pairs``, NCHW fp16 image and blocks, rows of whole
    words on both sides (W and the window's width even, 4-byte aligned pointers), a row's words
    within a thread block, and for a scatter that is not atomic windows at even columns (even
    offset and stride: no half words at the rows' ends). With ``transpose`` (NHWC blocks: the
    pair tiles) adding scatters only, an even C and window rows of at most PAIR_TILE_PIXELS
    (gathers through the transpose go by `pair_gather_rows`)."""
    return (pair_shapes(cfg, scatter, add, atomic, image.shape, channels_last, transpose, dtype, geometry)
            and data_pointer(image) % 4 == 0 and data_pointer(blocks) % 4 == 0)


def pair_shapes(cfg, scatter, add, atomic, shape, channels_last, transpose, dtype, geometry):
    """`pair_path` but for the pointers' alignment: whether the pair kernels would take a copy of
    an image of this shape and dtype (also the torch layer's choice of an NCHW input's output layout)."""
    COPY_THREADS = cfg.copy_threads
    MAX_GRID_YZ = cfg.max_grid_yz
    PAIRS = cfg.pairs
    PAIR_TILE_PAIRS = cfg.pair_tile_pairs
    PAIR_TILE_PIXELS = cfg.pair_tile_pixels
    (size_h, size_w), (_, stride_w), (_, offset_w) = geometry
    if transpose and not (scatter and add and shape[1] % 2 == 0 and size_w <= PAIR_TILE_PIXELS
                          and -(-size_h // (PAIR_TILE_PIXELS // size_w)) <= MAX_GRID_YZ
                          and -(-shape[1] // (2 * PAIR_TILE_PAIRS)) <= MAX_GRID_YZ):
        return False
    return (PAIRS and not channels_last and dtype == "float16" and size_w % 2 == 0
            and shape[3] % 2 == 0 and size_w // 2 + 1 <= COPY_THREADS
            and (not scatter or atomic or (offset_w % 2 == 0 and stride_w % 2 == 0)))


def pair_gather_rows(cfg, image, blocks, channels_last, dtype, geometry):
    """The window rows a thread block of `make_pair_tile_gathers` takes where it takes a gather
    through the transpose, else None: `PAIR_TILE_GATHERS`, an NCHW fp16 image, W and C even, 4-byte
    aligned pointers, window rows of at most PAIR_TILE_PIXELS pixels and a grid within CUDA's
    limits."""
    MAX_GRID_YZ = cfg.max_grid_yz
    PAIR_GATHER_PAIRS = cfg.pair_gather_pairs
    PAIR_GATHER_WORDS = cfg.pair_gather_words
    PAIR_TILE_GATHERS = cfg.pair_tile_gathers
    PAIR_TILE_PIXELS = cfg.pair_tile_pixels
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


def pair_halves(cfg, scatter, atomic, image, blocks, geometry):
    """Halves a word of a plain pair copy `pair_path` took: 4 (int64 words) where
    `PAIR_HALVES` is 4, W and the window's width are multiples of 4, both pointers 8-byte
    aligned, and a scatter is not atomic and its windows start on such words (offset and
    stride multiples of 4); else 2."""
    PAIR_HALVES = cfg.pair_halves
    (_, size_w), (_, stride_w), (_, offset_w) = geometry
    quad = (PAIR_HALVES == 4 and size_w % 4 == 0 and image.shape[3] % 4 == 0
            and data_pointer(image) % 8 == 0 and data_pointer(blocks) % 8 == 0
            and (not scatter or (not atomic and offset_w % 4 == 0 and stride_w % 4 == 0)))
    return 4 if quad else 2


def strip_lanes(cfg, scatter, atomic, size_w, halves):
    """Lanes a window's row takes in a plain pair copy by strips (its destination words, one more
    for an atomic scatter, whose windows may start mid-word), or None where strips are off for the
    copy's kind (`PAIR_STRIPS`) or a warp would hold fewer than two windows."""
    PAIR_STRIPS = cfg.pair_strips
    lanes = size_w // halves + (1 if scatter and atomic else 0)
    if not scatter:
        kind = "gather"
    elif atomic:
        kind = "atomic"
    else:
        kind = "scatter quads" if halves == 4 else "scatter pairs"
    return lanes if kind in PAIR_STRIPS and 2 * lanes <= WARP else None


def tiles(cfg, dtype, size, stride):
    """A transposing row copy's (tile pixels, whether its thread blocks go window by window):
    ROW_TILE_PIXELS_WIDE for fp32 where windows overlap, else ROW_TILE_PIXELS; window by
    window where windows overlap or the data are fp32 (ROW_TILE_WINDOW_MAJOR)."""
    ROW_TILE_PIXELS = cfg.row_tile_pixels
    ROW_TILE_PIXELS_WIDE = cfg.row_tile_pixels_wide
    ROW_TILE_WINDOW_MAJOR = cfg.row_tile_window_major
    overlap = stride[0] < size[0] or stride[1] < size[1]
    pixels = ROW_TILE_PIXELS_WIDE if overlap and dtype == "float32" else ROW_TILE_PIXELS
    if ROW_TILE_WINDOW_MAJOR is not None:
        return pixels, ROW_TILE_WINDOW_MAJOR
    return pixels, overlap or dtype == "float32"


def flat(array, dtype):
    """The array's memory as a 1-D array of `dtype` (a view)."""
    return as_dtype(array.reshape(-1) if hasattr(array, "data_ptr") else array.reshape(array.size), dtype)


def as_dtype(array, dtype):
    """The array's memory as elements of `dtype` (a view; torch, Numba or CuPy)."""
    if hasattr(array, "data_ptr"):  # torch
        import torch

        return array.view(getattr(torch, dtype))
    return array.view(np.dtype(dtype))


def launch_copy(cfg, scatter, image, blocks, indices, count, n_blocks, geometry, transpose, add, atomic,
                 channels_last, stream):
    COPY_THREADS = cfg.copy_threads
    COPY_UNROLL = cfg.copy_unroll
    PAIR_GATHER_PAIRS = cfg.pair_gather_pairs
    PAIR_TILE_PAIRS = cfg.pair_tile_pairs
    PAIR_TILE_PIXELS = cfg.pair_tile_pixels
    PAIR_TILE_THREADS = cfg.pair_tile_threads
    PAIR_UNROLL = cfg.pair_unroll
    ROW_THREADS = cfg.row_threads
    ROW_TILE_C = cfg.row_tile_c
    ROW_TILE_THREADS = cfg.row_tile_threads
    ROW_UNROLL = cfg.row_unroll
    WAVES = cfg.waves
    (size_h, size_w), (stride_h, stride_w), (offset_h, offset_w) = geometry
    dtype = str(image.dtype).replace("torch.", "")
    itemsize = np.dtype(dtype).itemsize
    pixels, window_major = tiles(cfg, dtype, (size_h, size_w), (stride_h, stride_w)) if transpose else (16, False)
    rows = row_path(cfg, image, blocks, n_blocks, channels_last, transpose, atomic, dtype, (size_h, size_w), pixels)
    if rows is not None:
        vector_dtype, half2 = rows
        N, H, W, C = image.shape
        # A transposing copy's block side goes 4 values a step where every one starts aligned:
        # tiles start at multiples of 4 pixels of the window, channels at multiples of bh * bw.
        block_width = 4 if not transpose or size_h * size_w % 4 == 0 else 1
        kernel = cached(make_row_kernels, cfg, scatter, transpose, add, vector_dtype, half2, pixels, block_width,
                        window_major)
        if transpose:
            grid, threads = (n_blocks, -(-size_h * size_w // pixels), -(-C // ROW_TILE_C)), ROW_TILE_THREADS
            if window_major:
                grid = (grid[0] * grid[1] * grid[2], 1, 1)
            per_pixel = C
        else:
            per_pixel = C * itemsize // 16  # vectors
            wanted = -(-size_w * per_pixel // ROW_UNROLL)
            grid, threads = (n_blocks, size_h), min(ROW_THREADS, max(WARP, -(-wanted // WARP) * WARP))
        args = (flat(image, vector_dtype), flat(blocks, vector_dtype), indices, count, N, H, W, per_pixel,
                size_h, size_w, stride_h, stride_w, offset_h, offset_w)
        launch(kernel, grid, threads, stream, args)
        return (kernel, grid, threads, args), (0, 1, 2, 3)
    rows = None if scatter or not transpose else pair_gather_rows(cfg, image, blocks, channels_last, dtype, geometry)
    if rows is not None:
        kernel = cached(make_pair_tile_gathers, cfg)
        N, C, H, W = image.shape
        grid = (n_blocks, -(-C // (2 * PAIR_GATHER_PAIRS)), -(-size_h // rows))
        args = (flat(image, "int32"), flat(blocks, "int32"), indices, count, N, C, H, W, size_h, size_w,
                stride_h, stride_w, offset_h, offset_w, rows)
        launch(kernel, grid, PAIR_TILE_THREADS, stream, args)
        return (kernel, grid, PAIR_TILE_THREADS, args), (0, 1, 2, 3)
    if pair_path(cfg, scatter, add, atomic, image, blocks, channels_last, transpose, dtype, geometry):
        halves = 2 if transpose else pair_halves(cfg, scatter, atomic, image, blocks, geometry)
        lanes = None if transpose else strip_lanes(cfg, scatter, atomic, size_w, halves)
        kernel = (cached(make_pair_tile_kernels, cfg, atomic) if transpose
                  else cached(make_pair_kernels, cfg, scatter, add, atomic, halves, lanes is not None))
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
        args = (flat(image, words), flat(blocks, words), indices, count,
                flat(image, "float16"), N, C, H, W, size_h, size_w, stride_h, stride_w,
                offset_h, offset_w) + (() if transpose else (lanes or 0,))
        launch(kernel, grid, threads, stream, args)
        return (kernel, grid, threads, args), ((0, 4), 1, 2, 3)  # (args 0 and 4: one image)
    if (channels_last and not transpose and not add and image.shape[3] * itemsize % WORD == 0
            and data_pointer(image) % WORD == 0 and data_pointer(blocks) % WORD == 0):
        # An overwrite moves bits: channels-last rows go as 8-byte words, fewer and wider accesses.
        image, blocks, dtype = as_words(image), as_words(blocks), "int64"
    elif (channels_last and not transpose and add and dtype == "float16"
            and image.shape[3] * itemsize % HALF2 == 0
            and data_pointer(image) % HALF2 == 0 and data_pointer(blocks) % HALF2 == 0):
        # An fp16 add goes two channels a word: half the accesses, one add.rn.f16x2 for two
        # (atomic: one red.global.add.noftz.f16x2).
        image, blocks, dtype = as_words(image, HALF2), as_words(blocks, HALF2), "half2"
    kernel = copy_kernel(cfg, scatter, transpose, add, atomic, dtype, channels_last)
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


def merge_path(cfg, out, y_op, blocks, n_blocks, geometry, channels_last, transpose, stream):
    """A merging scatter's (vector dtype, half2, first window, window counts, vectors a pixel,
    pixels a thread block) where it applies, else None: `MERGE`, blocks covering
    MERGE_MIN_COVER of the image, NHWC blocks and image, pixels of whole 16-byte vectors and
    16-byte aligned pointers, at most two windows over a pixel along each axis (2 * stride >=
    size), some window on the image, and the map, rows and grid within 32 bits and CUDA's
    limits. (y on the device only where the rest holds: a NumPy y is copied there once.)"""
    MAX_GRID_YZ = cfg.max_grid_yz
    MERGE = cfg.merge
    MERGE_MIN_COVER = cfg.merge_min_cover
    MERGE_VECTORS = cfg.merge_vectors
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


def launch_merge(cfg, out, y, blocks, slots, chain, indices, count, n_blocks, geometry, add, path, stream):
    """The merging scatter's launches (empty the window map, link the blocks into it, merge each
    pixel; the first two one where the map and the rows are small), each as `launch` took it."""
    LINK_ALONE = cfg.link_alone
    LINK_ALONE_THREADS = cfg.link_alone_threads
    LINK_THREADS = cfg.link_threads
    MERGE_THREADS = cfg.merge_threads
    MERGE_UNROLL = cfg.merge_unroll
    (vector_dtype, half2), first, counts, vectors, pixels = path
    (size_h, size_w), (stride_h, stride_w), (offset_h, offset_w) = geometry
    N, H, W, C = y.shape
    merge = cached(make_merge_kernels, cfg, add, vector_dtype, half2)
    alone = max(slots.shape[0], n_blocks) <= LINK_ALONE
    most = -(-max(slots.shape[0], n_blocks) // WARP) * WARP
    link = (link_windows, 1, min(LINK_ALONE_THREADS, most)) if alone else \
        (link_windows, -(-n_blocks // LINK_THREADS), LINK_THREADS)
    launches = [] if alone else [(fill_int32, -(-slots.shape[0] // LINK_THREADS), LINK_THREADS, (slots, -1))]
    launched = []
    for kernel, grid, threads, args in (
            *launches,
            (*link, (slots, chain, indices, count, n_blocks, N, *counts, *first, int(alone))),
            (merge, (N * H, -(-W // pixels)),
             min(MERGE_THREADS, max(WARP, -(-min(pixels, W) * vectors // MERGE_UNROLL // WARP) * WARP)),
             (flat(out, vector_dtype), flat(y, vector_dtype), flat(blocks, vector_dtype), slots, chain, N, H, W,
              vectors, size_h, size_w, stride_h, stride_w, offset_h + first[0] * stride_h,
              offset_w + first[1] * stride_w, *counts, pixels))):
        launch(kernel, grid, threads, stream, args)
        launched.append((kernel, grid, threads, args))
    return launched


def int_output(op, shape, stream, fill):
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


def zero(array, stream):
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
