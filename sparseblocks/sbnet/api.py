"""``sparse_gather`` and ``sparse_scatter``: windows of an image to a block stack and back.

``sparse_gather``: NHWC ``x`` -> ``[n_blocks, bh, bw, C]`` (``transpose``:
``[n_blocks, C, bh, bw]``; ``data_format="NCHW"`` the reverse layouts); rows
past the count come out as zeros. ``sparse_scatter``: a block stack back into a
copy of ``y`` (``inplace``: into ``y``): overwrite, add, or atomic add. Adding
windows that can overlap without ``atomic`` raises, and so do repeated indices
given on the host; where overwritten windows overlap, which block lands is
unspecified. Reads outside the image give zeros, writes there are dropped.
Storage fp16, fp32, fp64.
"""

from typing import Any, Optional

import numpy as np
from numba import cuda

from ..runtime import plans
from ..runtime.arrays import Array, Operand, check_disjoint, check_dtype, check_same_kind, check_shape, launch_stream
from ..runtime.backend import SIMULATOR
from ..runtime.devices import active, on_arrays_device
from ..runtime.launch import data_pointer
from ..windows import check_geometry
from .config import SbnetConfig, as_config
from .dispatch import int_output, launch_copy, launch_merge, merge_path
from .plans import gather_settings, keep_plan, replayed, scatter_settings

DATA_DTYPES = ("float16", "float32", "float64")


_counts: dict = {}


def constant_count(n):
    """A device int32 [n], made once per n (kernels only read it): no copy to the device per call."""
    key = (n, active())
    if key not in _counts:
        _counts[key] = cuda.to_device(np.array([n], np.int32))
    return _counts[key]


def prepare_indices(indices, count, ops, stream, written=None):
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
        count_device = constant_count(n_blocks)
    else:
        if cnt.shape != (1,) or cnt.dtype != "int32":
            raise ValueError(f"count: expected a one-element int32 array, got {cnt.shape} {cnt.dtype}")
        if cnt.kind == "numpy":
            if not 0 <= int(count[0]) <= idx.shape[0]:
                raise ValueError(f"count: expected 0..{idx.shape[0]}, got {int(count[0])}")
        n_blocks = idx.shape[0]  # the kernel skips blocks at and past count
        count_device = cnt.device(stream)
    return idx, count_device, n_blocks


def check_format(data_format):
    if data_format not in ("NHWC", "NCHW"):
        raise ValueError(f"data_format: expected 'NHWC' or 'NCHW', got {data_format!r}")
    return data_format == "NHWC"


def block_shape(n_blocks, size, channels, channels_last, transpose):
    return (n_blocks, *size, channels) if channels_last != transpose else (n_blocks, channels, *size)


@on_arrays_device
def sparse_gather(x: Array, indices: Array, bsize: Any, bstride: Any, boffset: Any = 0, transpose: bool = False,
                  count: Optional[Array] = None, data_format: str = "NHWC", out: Optional[Array] = None,
                  config: Optional[SbnetConfig] = None) -> Array:
    """Windows of ``x`` as a block stack in x's layout (``transpose``: in the other one).

    NHWC ``x`` gives ``[n_blocks, bh, bw, C]`` (``transpose``: ``[n_blocks, C, bh, bw]``);
    NCHW ``x`` the reverse. With a device ``count``, ``n_blocks`` is the indices' rows, and
    rows from the count on are zeros (as a window off the image gives): a stack that feeds
    convolutions and their weight gradients sees nothing there. ``out``: a C-contiguous
    device array of that shape and x's dtype to write into, returned (ValueError where it
    shares memory with x, the indices or the count); as with bsmm's ``out=``, under the
    simulator a torch ``out`` comes back as a new tensor.
    """
    cfg = as_config(config)
    settings = gather_settings(cfg, bsize, bstride, boffset, transpose, data_format)
    if plans.kept:
        blocks = replayed("gather", (x, indices), count, settings, out=out)
        if blocks is not None:
            return blocks
    channels_last = check_format(data_format)
    x_op = Operand(x, "x")
    if len(x_op.shape) != 4:
        raise ValueError(f"x: expected {data_format}, got shape {x_op.shape}")
    check_dtype(x_op, DATA_DTYPES)
    x_op.require_contiguous()
    geometry = check_geometry(bsize, bstride, boffset)
    out_op = None if out is None else Operand(out, "out")
    stream = launch_stream((x_op,) if out is None else (x_op, out_op))
    idx, count_device, n_blocks = prepare_indices(indices, count, (x_op,), stream, out_op)
    C = x_op.shape[3 if channels_last else 1]
    shape = block_shape(n_blocks, geometry[0], C, channels_last, transpose)
    if out_op is None:
        native, blocks = x_op.empty(shape, stream)
    else:
        _check_out(out_op, x_op, shape)
        native, blocks = out_op.native, out_op.device(stream)
    if n_blocks and C:
        launched = launch_copy(cfg, False, x_op.device(stream), blocks, idx.device(stream), count_device, n_blocks,
                                geometry, transpose, False, False, channels_last, stream)
        keep_plan("gather", (x, indices), count, settings, tuple(shape), [launched], data_pointer(count_device))
    if out_op is not None and not (SIMULATOR and out_op.kind == "torch"):
        return out  # the caller's own array (an Operand holds a detached torch view of it)
    return (x_op if out_op is None else out_op).result(native, blocks, stream)


def _check_out(out_op, like, shape):
    """A gather's ``out``: a device array of the stack's shape, the input's dtype, C-contiguous."""
    if out_op.kind == "numpy":
        raise TypeError("out: expected a device array (a NumPy out= would be a copy)")
    check_same_kind((like, out_op))
    if out_op.dtype != like.dtype:
        raise TypeError(f"out: expected {like.dtype} (x's dtype), got {out_op.dtype}")
    check_shape(out_op, shape)
    out_op.require_contiguous()


@on_arrays_device
def sparse_scatter(blocks: Array, indices: Array, y: Array, bsize: Any, bstride: Any, boffset: Any = 0,
                   add: bool = False, atomic: bool = False, transpose: bool = False, inplace: bool = False,
                   count: Optional[Array] = None, data_format: str = "NHWC",
                   config: Optional[SbnetConfig] = None) -> Array:
    """Write (``add``: add) a block stack into ``y``: into a copy, or into ``y`` with ``inplace``.

    The blocks are in y's layout, or with ``transpose`` in the other one. ``add``
    without ``atomic`` raises where windows can overlap (a stride below the
    block) or where host indices repeat a window. Device indices are not read
    on the host (that would be a sync), so a window repeated in them is the
    caller's to avoid (`reduce_mask` never repeats one): pass ``atomic=True``
    for device indices that may repeat. With ``inplace``, ``y`` must not share
    memory with ``blocks``, the indices or the count (ValueError).
    """
    cfg = as_config(config)
    settings = scatter_settings(cfg, bsize, bstride, boffset, add, atomic, transpose, inplace, data_format)
    if plans.kept:
        out = replayed("scatter", (blocks, indices, y), count, settings, inplace)
        if out is not None:
            return out
    channels_last = check_format(data_format)
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
    idx, count_device, n_blocks = prepare_indices(indices, count, (b_op, y_op), stream,
                                                   y_op if inplace else None)
    expected = block_shape(n_blocks, size, C, channels_last, transpose)
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
        path = merge_path(cfg, out, y_op, b_op.device(stream), n_blocks, geometry, channels_last, transpose, stream)
    if path is not None:  # one pass: every pixel of the copy written once
        windows = y_op.shape[0] * path[2][0] * path[2][1]
        _, scratch = int_output(y_op, (windows + n_blocks,), stream, None)  # the map, then the chain
        launched = launch_merge(cfg, out, y_op.device(stream), b_op.device(stream), scratch[:windows], scratch[windows:],
                                 idx.device(stream), count_device, n_blocks, geometry, add, path, stream)
        keep_plan("scatter", (blocks, indices, y), count, settings, tuple(y_op.shape),
                   list(zip(launched, [(0,), (0, 1, 2, 3), (0, 1, 2, 3, 4)][-len(launched):])),
                   data_pointer(count_device), (windows, n_blocks))
        return y_op.result(native, out, stream)
    if not inplace:
        device_copy(out, y_op, stream)
    if n_blocks and C:
        launched = launch_copy(cfg, True, out, b_op.device(stream), idx.device(stream), count_device, n_blocks,
                                geometry, transpose, add, atomic, channels_last, stream)
        keep_plan("scatter", (blocks, indices, y), count, settings, tuple(y_op.shape), [launched],
                   data_pointer(count_device))
    return y_op.result(native, out, stream)


def device_copy(destination, source_op, stream):
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
