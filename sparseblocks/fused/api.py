"""``sparse_gather_matmul`` and ``sparse_matmul_scatter``: checks, launches and kept plans.

`sparse_gather_matmul(x, indices, weight, ...)` is ``sparse_gather(x, ...) @ weight.T`` (then
ReLU with ``relu``); `sparse_matmul_scatter(blocks, indices, weight, y, ...)` is ``y +=
sparse_scatter(blocks @ weight.T, add=True)`` in place. Where they pay: where the stack's memory
bounds the product, as in SBNet's bottleneck (256 -> 64 and 64 -> 256 channels); not with few
windows nor for wide products, where cuBLAS's own tensor-core product wins (docs/performance.md).

Limits (the functions raise otherwise): float16 or float32; ``x`` NHWC, C-contiguous, 16-byte
aligned, whole 16-byte vectors a pixel, or NCHW, 4-byte aligned, W even in fp16, windows of an
even width; ``weight`` ``[C_out, C]`` or ``[C_out, C, 1, 1]``, C-contiguous, 16-byte aligned;
fewer than 2^31 stack pixels. The scatter: windows that do not overlap (repeated indices are not
checked: they would race); an NCHW fp16 ``y`` an even W, windows of an even width every even
number of columns from an even offset. Calls repeated with torch tensors replay kept launches.
"""

from typing import Any, Optional

import numpy as np

from ..ptx.vector import aligned
from ..runtime import arrays as _arrays
from ..runtime import plans
from ..runtime.arrays import Array, Operand, _dtype_name, check_dtype, check_shape, launch_stream, torch_stream_handle
from ..runtime.backend import SIMULATOR
from ..runtime.compile import cached
from ..runtime.devices import on_arrays_device
from ..runtime.launch import data_pointer, launch
from ..sbnet.api import check_format, prepare_indices
from ..sbnet.device import magic
from ..sbnet.dispatch import as_words
from ..sbnet.plans import find_plan, keep_plan
from ..windows import check_geometry
from .config import FusedConfig, as_config
from .kernel import DTYPES, MAX_PIXELS, UNIT, WARP, make_kernel


def compiled(storage, relu, vector_out, shape, scatter=False, nchw=False):
    """The kernel for a storage, epilogue and tile shape, compiled once."""
    return cached(make_kernel, storage, relu, vector_out, *shape, scatter, nchw)


def _grid(n_pixels, n_out, shape):
    rows, cols = shape[0], shape[1]
    return (-(-n_pixels // rows), -(-n_out // cols)), shape[4] * WARP


def _vector_out(out, n_out, item, scatter=False):
    """Whether results go out as whole 16-byte fp16 units or fp32 pairs (`_make_kernel`); a
    scatter's, whose rows of out are copied in by 16-byte units, needs those in either dtype."""
    size = 16 if item == 2 or scatter else 8
    return n_out * item % size == 0 and aligned(data_pointer(out), size, 1)


def _torch_int32():
    import torch

    return torch.int32


def _weight_rows(w_op, channels):
    """weight as [C_out, C] (a 1x1 convolution's [C_out, C, 1, 1] viewed so), checked."""
    shape = w_op.shape
    if len(shape) == 4 and shape[2:] == (1, 1):
        shape = shape[:2]
    if len(shape) != 2 or shape[1] != channels:
        raise ValueError(f"weight: expected [C_out, {channels}] or [C_out, {channels}, 1, 1], got {w_op.shape}")
    return shape


def _check_vectors(name, channels, item):
    """A pixel's channels must be whole cp.async units."""
    if channels * item % UNIT:
        raise ValueError(f"{name}: a pixel's {channels} channels must be whole 16-byte vectors (a multiple of "
                         f"{UNIT // item})")


def _stack_pixels(n_blocks, size):
    """The stack's pixels, checked against the 32-bit tile arithmetic's bound."""
    area = size[0] * size[1]
    n_pixels = n_blocks * area
    if n_pixels >= MAX_PIXELS:
        raise ValueError(f"indices: {n_blocks} windows of {area} pixels are {n_pixels} stack pixels, "
                         f"expected fewer than {MAX_PIXELS}")
    return n_pixels


def _check_aligned(arrays):
    """The cp.async sources' pointers: {name: device array}, each 16-byte aligned."""
    for name, array in arrays.items():
        if not aligned(data_pointer(array), UNIT, 1):
            raise ValueError(f"{name}: expected a 16-byte aligned pointer (cp.async copies 16 bytes)")


def _settings(cfg, bsize, bstride, boffset, relu, data_format):
    """What a kept launch depends on besides its tensors: the key of both `sparse_gather_matmul`'s
    plans and `kept_launch`'s lookups (one tuple, so the two cannot drift apart)."""
    return bsize, bstride, boffset, bool(relu), data_format, cfg.gather_tile if data_format == "NHWC" else cfg.nchw_gather_tile


def _replayed(x, indices, weight, count, settings, out):
    """The call through its kept launch (`sbnet._plans`, as sbnet's gathers: torch tensors of
    shapes, dtypes, alignment and settings seen before), or None (the general path runs)."""
    plan = find_plan("gather_matmul", (x, indices, weight), count, settings)
    if plan is None:
        return None
    if out is None:
        out = x.new_empty(plan.out_shape)
    elif not (isinstance(out, type(x)) and out.shape == plan.out_shape and out.dtype == x.dtype
              and out.device == x.device and out.is_contiguous() and out.data_ptr() % UNIT == 0) \
            or _arrays.tensors_overlap(out, (x, indices, weight, count)):
        return None  # (an out= the plan's vector stores may not take, or one sharing memory with an
        # input: the general path checks it)
    plan.launch[0](torch_stream_handle(), out.data_ptr(), x.data_ptr(), weight.data_ptr(), indices.data_ptr(),
                   plan.extra if count is None else count.data_ptr())
    return out


def takes(x, weight, data_format="NHWC", bsize=None):
    """Whether `sparse_gather_matmul` takes these torch tensors as they are (dtype, whole 16-byte
    weight rows, C-contiguous, aligned; NCHW: fp16 rows of whole words, and windows ``bsize`` (h, w)
    of an even width): for a caller choosing between it and a gather and a product, which take
    more."""
    nhwc = data_format == "NHWC"
    channels = x.shape[-1 if nhwc else 1]
    if not (_dtype_name(x) in DTYPES and weight.dtype == x.dtype and channels * x.element_size() % UNIT == 0
            and x.is_contiguous() and weight.is_contiguous() and weight.data_ptr() % UNIT == 0):
        return False
    if nhwc:
        return x.data_ptr() % UNIT == 0
    return bsize[1] % 2 == 0 and x.data_ptr() % 4 == 0 and (x.element_size() == 4 or x.shape[3] % 2 == 0)


def scatter_takes(blocks, weight, y, data_format="NHWC", bsize=None, bstride=None, boffset=0):
    """`takes` for `sparse_matmul_scatter`: torch tensors of one dtype it takes, the stack's pixels
    whole 16-byte vectors, all C-contiguous, the stack and weight 16-byte aligned; an NCHW ``y``
    also the windows ``bsize`` every ``bstride`` from ``boffset`` its fp16 words take
    (`nchw_scatter_fits`)."""
    if not (_dtype_name(blocks) in DTYPES and weight.dtype == y.dtype == blocks.dtype
            and blocks.shape[-1] * blocks.element_size() % UNIT == 0 and blocks.is_contiguous()
            and weight.is_contiguous() and y.is_contiguous() and blocks.data_ptr() % UNIT == 0
            and weight.data_ptr() % UNIT == 0):
        return False
    if data_format == "NHWC":
        return True
    return nchw_scatter_fits(y.element_size(), y.shape[3], y.data_ptr(), *check_geometry(bsize, bstride, boffset))


def nchw_scatter_fits(item, width, pointer, size, stride, offset):
    """Whether an NCHW image's fp16 words take these windows whole (fp32: always): W even, the
    image 4-byte aligned, windows of an even width starting at even columns (every stack pixel
    pair then lies on one word a channel, and no word holds two windows' pixels)."""
    return item == 4 or (width % 2 == 0 and pointer % 4 == 0 and size[1] % 2 == 0 and stride[1] % 2 == 0
                         and offset[1] % 2 == 0)


def kept_launch(x, indices, weight, count, bsize, bstride, boffset=0, relu=False, data_format="NHWC", config=None):
    """The kept launch of a call made before with tensors of these shapes, dtypes and alignment
    (and this count's kind), or None: ``(launch, count pointer)``, where ``launch(stream handle,
    out, x, weight, indices, count)`` takes pointers (out C-contiguous and 16-byte aligned) and
    the count pointer is the kept one where the call had no count (else None: pass the
    caller's). For a caller that repeats the call into buffers of its own (`sbnet_torch`'s CUDA
    graphs): it skips even the plan's lookup."""
    if not plans.kept:
        return None
    plan = find_plan("gather_matmul", (x, indices, weight), count,
                        _settings(as_config(config), bsize, bstride, boffset, relu, data_format))
    return None if plan is None else (plan.launch[0], plan.extra if count is None else None)


@on_arrays_device
def sparse_gather_matmul(x: Array, indices: Array, weight: Array, bsize: Any, bstride: Any, boffset: Any = 0,
                         count: Optional[Array] = None, relu: bool = False, out: Optional[Array] = None,
                         data_format: str = "NHWC", config: Optional[FusedConfig] = None) -> Array:
    """``sparse_gather(x, indices, ...) @ weight.T`` (ReLU'd with ``relu``) without the block stack.

    ``x`` NHWC ``[N, H, W, C]``, or with ``data_format="NCHW"`` ``[N, C, H, W]``; ``weight``
    ``[C_out, C]`` or ``[C_out, C, 1, 1]``, x's dtype. Returns the NHWC ``[n_blocks, bh, bw,
    C_out]`` in either format, in x's kind and dtype (``out``: a C-contiguous device array of that
    shape to write into, returned; ValueError where it shares memory with an input). With a
    ``count``, rows from it on are zeros. NCHW takes windows of an even width, and in fp16 an
    even W (the image's rows read by words).
    A call repeated with torch tensors of the same shapes, dtypes, alignment and settings
    replays its kept launch.
    """
    nhwc = check_format(data_format)
    cfg = as_config(config)
    settings = _settings(cfg, bsize, bstride, boffset, relu, data_format)
    if plans.kept:
        replayed = _replayed(x, indices, weight, count, settings, out)
        if replayed is not None:
            return replayed
    x_op, w_op = Operand(x, "x"), Operand(weight, "weight")
    if len(x_op.shape) != 4:
        raise ValueError(f"x: expected {data_format} [N, {'H, W, C' if nhwc else 'C, H, W'}], got shape {x_op.shape}")
    check_dtype(x_op, DTYPES)
    if w_op.dtype != x_op.dtype:
        raise TypeError(f"weight: expected {x_op.dtype} (x's dtype), got {w_op.dtype}")
    x_op.require_contiguous()
    w_op.require_contiguous()
    N, H, W, C = x_op.shape if nhwc else (x_op.shape[0], *x_op.shape[2:], x_op.shape[1])
    n_out, _ = _weight_rows(w_op, C)
    item = np.dtype(x_op.dtype).itemsize
    _check_vectors("x" if nhwc else "weight", C, item)
    size, stride, offset = check_geometry(bsize, bstride, boffset)
    if not nhwc and size[1] % 2:
        raise ValueError(f"bsize: an NCHW image's windows are read by pixel pairs, expected an even width, got {size}")
    if not nhwc and item == 2 and W % 2:
        raise ValueError(f"x: an NCHW fp16 image's rows are read by words of two columns, expected an even W, got {W}")
    out_op = None if out is None else Operand(out, "out")
    stream = launch_stream((x_op, w_op) if out is None else (x_op, w_op, out_op))
    idx, count_device, n_blocks = prepare_indices(indices, count, (x_op, w_op), stream, out_op)
    area = size[0] * size[1]
    n_pixels = _stack_pixels(n_blocks, size)
    shape = (n_blocks, *size, n_out)
    if out_op is None:
        native, result = x_op.empty(shape, stream)
    else:
        if out_op.kind == "numpy":
            raise TypeError("out: expected a device array (a NumPy out= would be a copy)")
        if out_op.dtype != x_op.dtype:
            raise TypeError(f"out: expected {x_op.dtype} (x's dtype), got {out_op.dtype}")
        check_shape(out_op, shape)
        out_op.require_contiguous()
        native, result = out_op.native, out_op.device(stream)
    x_dev, w_dev = x_op.device(stream), w_op.device(stream)
    _check_aligned({"x": x_dev, "weight": w_dev} if nhwc else {"weight": w_dev})
    if not (nhwc or aligned(data_pointer(x_dev), 4, 1)):
        raise ValueError("x: expected a 4-byte aligned pointer (an NCHW image is read by 4-byte words)")
    if n_pixels and n_out:
        tile = cfg.gather_tile if nhwc else cfg.nchw_gather_tile
        grid, block = _grid(n_pixels, n_out, tile)
        vector_out = _vector_out(result, n_out, item)
        rows_out = result.reshape(n_pixels, n_out)
        if vector_out and item == 2:
            rows_out = rows_out.view(np.int32) if x_op.kind != "torch" or SIMULATOR else rows_out.view(_torch_int32())
        flat = x_dev.reshape(N * H * W * C)
        args = (rows_out, flat if nhwc else as_words(flat, 4), w_dev.reshape(n_out, C), idx.device(stream),
                count_device, N, H, W, C, n_out, n_pixels, area, size[1], stride[0], stride[1], offset[0],
                offset[1], magic(area), magic(size[1]))
        kernel = compiled(x_op.dtype, bool(relu), vector_out, tile, nchw=not nhwc)
        launch(kernel, grid, block, stream, args)
        if out is None or data_pointer(result) % UNIT == 0:  # (as the replays' outputs are)
            keep_plan("gather_matmul", (x, indices, weight), count, settings, tuple(shape),
                              [((kernel, grid, block, args), (0, 1, 2, 3, 4))], data_pointer(count_device))
    if out_op is not None and not (SIMULATOR and out_op.kind == "torch"):
        return out  # the caller's own array (an Operand holds a detached torch view of it)
    return (x_op if out_op is None else out_op).result(native, result, stream)


def _scatter_settings(cfg, bsize, bstride, boffset, data_format):
    """`_settings` of `sparse_matmul_scatter` (its plans' key and `kept_scatter_launch`'s)."""
    tiles = cfg.scatter_tiles if data_format == "NHWC" else cfg.nchw_scatter_tiles
    return bsize, bstride, boffset, data_format, tuple(sorted(tiles.items()))


def kept_scatter_launch(blocks, indices, weight, y, count, bsize, bstride, boffset=0, data_format="NHWC",
                        config=None):
    """`kept_launch` of `sparse_matmul_scatter`: ``(launch, count pointer)``, where ``launch(stream
    handle, y, blocks, weight, indices, count)`` takes pointers, or None."""
    if not plans.kept:
        return None
    settings = _scatter_settings(as_config(config), bsize, bstride, boffset, data_format)
    plan = find_plan("matmul_scatter", (blocks, indices, weight, y), count, settings)
    return None if plan is None else (plan.launch[0], plan.extra if count is None else None)


@on_arrays_device
def sparse_matmul_scatter(blocks: Array, indices: Array, weight: Array, y: Array, bsize: Any, bstride: Any,
                          boffset: Any = 0, count: Optional[Array] = None, data_format: str = "NHWC",
                          config: Optional[FusedConfig] = None) -> Array:
    """``y += sparse_scatter(blocks @ weight.T, indices, ...)``, in place, without the product's stack.

    The last 1x1 convolution of SBNet's bottleneck and the scatter that adds it
    into the image, fused: ``blocks`` ``[n_blocks, bh, bw, K]`` (an NHWC stack),
    ``weight`` ``[C, K]`` or ``[C, K, 1, 1]``, ``y`` NHWC ``[N, H, W, C]`` (or with
    ``data_format="NCHW"`` ``[N, C, H, W]``, the results going through the
    transpose; fp16 takes an even W, a 4-byte aligned y, and windows of an even
    width every even number of columns from an even offset), all of
    one dtype. Each window's results are added to y's pixels under it (pixels
    off the image and blocks from ``count`` on are dropped); fp16 products are
    rounded to fp16 before the add, as the product and the scatter apart give.
    The windows must not overlap (``bstride`` >= ``bsize``, checked) and the
    indices must not repeat (not checked: they are on the device, as y is):
    no two windows may add into one pixel. ``y`` must not share memory with
    an input (ValueError). Returns ``y``. A call repeated
    with torch tensors replays its kept launch.
    """
    nhwc = check_format(data_format)
    cfg = as_config(config)
    settings = _scatter_settings(cfg, bsize, bstride, boffset, data_format)
    if plans.kept:
        plan = find_plan("matmul_scatter", (blocks, indices, weight, y), count, settings)
        if plan is not None and not _arrays.tensors_overlap(y, (blocks, indices, weight, count)):
            plan.launch[0](torch_stream_handle(), y.data_ptr(), blocks.data_ptr(), weight.data_ptr(),
                           indices.data_ptr(), plan.extra if count is None else count.data_ptr())
            return y
    b_op, w_op, y_op = Operand(blocks, "blocks"), Operand(weight, "weight"), Operand(y, "y")
    if len(y_op.shape) != 4:
        raise ValueError(f"y: expected {data_format} [N, {'H, W, C' if nhwc else 'C, H, W'}], got shape {y_op.shape}")
    if y_op.kind == "numpy":
        raise TypeError("y: expected a device array (the results are added into y in place)")
    check_dtype(b_op, DTYPES)
    for op in (w_op, y_op):
        if op.dtype != b_op.dtype:
            raise TypeError(f"{op.name}: expected {b_op.dtype} (blocks' dtype), got {op.dtype}")
    for op in (b_op, w_op, y_op):
        op.require_contiguous()
    if len(b_op.shape) != 4:
        raise ValueError(f"blocks: expected an NHWC stack [n_blocks, bh, bw, K], got shape {b_op.shape}")
    N, H, W, C = y_op.shape if nhwc else (y_op.shape[0], *y_op.shape[2:], y_op.shape[1])
    K = b_op.shape[3]
    n_out, _ = _weight_rows(w_op, K)
    if n_out != C:
        raise ValueError(f"weight: expected {C} output channels (y's), got {w_op.shape}")
    item = np.dtype(b_op.dtype).itemsize
    _check_vectors("blocks", K, item)
    size, stride, offset = check_geometry(bsize, bstride, boffset)
    if stride[0] < size[0] or stride[1] < size[1]:
        raise ValueError(f"bstride: windows of bsize {size} every {stride} overlap; their adds would race")
    stream = launch_stream((b_op, w_op, y_op))
    idx, count_device, n_blocks = prepare_indices(indices, count, (b_op, w_op, y_op), stream, y_op)
    expected = (n_blocks, *size, K)
    if b_op.shape != expected:
        raise ValueError(f"blocks: expected shape {expected} for {n_blocks} indices, got {b_op.shape}")
    area = size[0] * size[1]
    n_pixels = _stack_pixels(n_blocks, size)
    b_dev, w_dev, y_dev = b_op.device(stream), w_op.device(stream), y_op.device(stream)
    _check_aligned({"blocks": b_dev, "weight": w_dev})
    if not (nhwc or nchw_scatter_fits(item, W, data_pointer(y_dev), size, stride, offset)):
        raise ValueError(f"y: an NCHW fp16 image is added into by words of two columns: expected an even W and "
                         f"a 4-byte aligned pointer, windows of an even width, an even column stride and offset; "
                         f"got W {W}, pointer {data_pointer(y_dev)} mod 4 = {data_pointer(y_dev) % 4}, bsize "
                         f"{size}, bstride {stride}, boffset {offset}")
    if n_pixels and K and C and N * H * W:
        tile = (cfg.scatter_tiles if nhwc else cfg.nchw_scatter_tiles)[b_op.dtype]
        grid, block = _grid(n_pixels, C, tile)
        if nhwc:
            vector_out = _vector_out(y_dev, C, item, scatter=True)
            rows_out = y_dev.reshape(N * H * W, C)
        else:  # (fp16: by words, through the staged tile)
            vector_out = item == 2
            rows_out = y_dev.reshape(N * C * H * W)
        if vector_out and item == 2:
            rows_out = rows_out.view(np.int32) if y_op.kind != "torch" or SIMULATOR else rows_out.view(_torch_int32())
        args = (rows_out, b_dev.reshape(n_pixels * K), w_dev.reshape(C, K), idx.device(stream), count_device, N, H,
                W, K, C, n_pixels, area, size[1], stride[0], stride[1], offset[0], offset[1], magic(area),
                magic(size[1]))
        kernel = compiled(b_op.dtype, False, vector_out, tile, scatter=True, nchw=not nhwc)
        launch(kernel, grid, block, stream, args)
        # (a plan's key holds y's address modulo 16, so its replays take the same stores)
        keep_plan("matmul_scatter", (blocks, indices, weight, y), count, settings, tuple(y_op.shape),
                          [((kernel, grid, block, args), (0, 1, 2, 3, 4))], data_pointer(count_device))
    if SIMULATOR and y_op.kind == "torch":  # (the simulator's device array is a copy of y)
        y.copy_(y_op.result(y, y_dev, stream))
    return y
