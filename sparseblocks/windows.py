"""Window geometry of SBNet's ops, shared by the kernels, the torch layer and the NumPy twins.

A block index ``(n, bh, bw)`` names the window of image ``n`` whose rows are
``boffset_h + bh*bstride_h`` up to (excluding) ``+ bsize_h``, and likewise for
columns. Windows may reach outside the image (negative offsets for padding,
the last row of blocks past the edge). Every size, stride and offset argument
takes an int (both axes) or an ``(h, w)`` pair. `calc_block_params` gives the
geometry that makes a sparse convolution (gather, VALID convolution, scatter)
equal the dense one on the active blocks, as SBNet's function of that name.
"""

from dataclasses import dataclass

import numpy as np


def pair(value, name):
    """``(h, w)`` from an int or a pair of ints."""
    if isinstance(value, (int, np.integer)) and not isinstance(value, bool):
        return int(value), int(value)
    try:
        h, w = value
        if any(isinstance(v, bool) or not isinstance(v, (int, np.integer)) for v in (h, w)):
            raise TypeError
    except (TypeError, ValueError):
        raise TypeError(f"{name}: expected an int or a pair of ints (h, w), got {value!r}") from None
    return int(h), int(w)


def block_count(size, bstride, boffset):
    """Blocks per axis whose window starts inside ``[0, size)`` or before it: ``(count_h, count_w)``."""
    return tuple(
        max(0, (s - 1 - o) // st + 1) for s, st, o in zip(size, bstride, boffset)
    )


def window(index, bsize, bstride, boffset):
    """First row and column of the window of block index ``(n, bh, bw)``."""
    _, bh, bw = (int(i) for i in index)
    return boffset[0] + bh * bstride[0], boffset[1] + bw * bstride[1]


GEOMETRY_LIMIT = 2**31  # sizes, strides and |offsets| below it: a window's start fits 63 bits


def check_geometry(bsize, bstride, boffset):
    """Validated ``(bsize, bstride, boffset)`` as ``(h, w)`` pairs, each value within 32 bits, so
    that ``boffset + index * bstride`` of any int32 index is exact in the kernels' int64."""
    bsize, bstride, boffset = pair(bsize, "bsize"), pair(bstride, "bstride"), pair(boffset, "boffset")
    if min(bsize) < 1 or max(bsize) >= GEOMETRY_LIMIT:
        raise ValueError(f"bsize: expected sizes from 1 to 2**31 - 1, got {bsize}")
    if min(bstride) < 1 or max(bstride) >= GEOMETRY_LIMIT:
        raise ValueError(f"bstride: expected strides from 1 to 2**31 - 1, got {bstride}")
    if max(abs(o) for o in boffset) >= GEOMETRY_LIMIT:
        raise ValueError(f"boffset: expected offsets from -(2**31 - 1) to 2**31 - 1, got {boffset}")
    return bsize, bstride, boffset


def check_tol(tol):
    """reduce_mask's threshold as a float (a number, not a string float() would parse, nor NaN:
    no pool exceeds it, so a NaN would leave every block inactive without a word)."""
    try:
        if isinstance(tol, (str, bytes)):
            raise TypeError
        value = float(tol)
    except (TypeError, ValueError):
        raise TypeError(f"tol: expected a number, got {tol!r}") from None
    if value != value:
        raise ValueError("tol: expected a number, not NaN")
    return value


@dataclass(frozen=True)
class BlockParams:
    """Block geometry of a sparse convolution (all pairs are ``(h, w)``).

    Gather input windows of ``bsize`` every ``bstride`` from ``boffset``
    (``bcount`` of them per axis, covering the whole output), convolve them
    VALID, and scatter the ``bsize_out`` results with stride ``bsize_out``
    and offset 0.
    """

    bsize: tuple
    bsize_out: tuple
    boffset: tuple
    bcount: tuple
    bstride: tuple


def conv_padding(in_hw, ksize, strides, padding):
    """TensorFlow's padding ``(top, bottom, left, right)`` for a 2-D convolution."""
    if padding == "VALID":
        return 0, 0, 0, 0
    if padding != "SAME":
        raise ValueError(f"padding: expected 'SAME' or 'VALID', got {padding!r}")
    pads = []
    for size, k, s in zip(in_hw, ksize, strides):
        out = -(-size // s)
        total = max((out - 1) * s + k - size, 0)
        pads += [total // 2, total - total // 2]
    return tuple(pads)


def conv_output_size(in_hw, ksize, strides, padding):
    """TensorFlow's output ``(h, w)`` of a 2-D convolution."""
    conv_padding(in_hw, ksize, strides, padding)  # validates `padding`
    if padding == "SAME":
        return tuple(-(-size // s) for size, s in zip(in_hw, strides))
    return tuple(max(0, -(-(size - k + 1) // s)) for size, k, s in zip(in_hw, ksize, strides))


def calc_block_params(in_size, bsize, ksize, strides=1, padding="SAME"):
    """Block geometry for one convolution of kernel ``ksize`` on an input of ``in_size``.

    ``in_size`` is ``(N, H, W, C)`` or ``(H, W)``. Requires ``(bsize - ksize)``
    divisible by ``strides`` on each axis, so output blocks tile exactly.
    """
    in_hw = tuple(in_size[1:3]) if len(in_size) == 4 else tuple(in_size)
    bsize, ksize, strides = pair(bsize, "bsize"), pair(ksize, "ksize"), pair(strides, "strides")
    for b, k, s, axis in zip(bsize, ksize, strides, "hw"):
        if b < k:
            raise ValueError(f"bsize: block {b} is smaller than the kernel {k} on axis {axis}")
        if (b - k) % s:
            raise ValueError(f"strides: {s} must divide bsize - ksize = {b - k} on axis {axis}")
    bstride = tuple(b - k + s for b, k, s in zip(bsize, ksize, strides))
    top, _, left, _ = conv_padding(in_hw, ksize, strides, padding)
    bsize_out = tuple((b - k) // s + 1 for b, k, s in zip(bsize, ksize, strides))
    out_hw = conv_output_size(in_hw, ksize, strides, padding)
    # Enough blocks to cover the whole output. (SBNet pads the input to a
    # whole number of block strides instead, which leaves the last output rows
    # uncovered when ksize - 1 is not a multiple of the block stride.)
    bcount = tuple(-(-o // b) for o, b in zip(out_hw, bsize_out))
    return BlockParams(bsize=bsize, bsize_out=bsize_out, boffset=(-top, -left),
                       bcount=bcount, bstride=bstride)


def calc_block_params_res_block(in_size, bsize, ksize_list, strides=1, padding="SAME"):
    """Block geometry for a chain of convolutions (a residual block): the receptive field is the kernel."""
    ksizes = [pair(k, "ksize_list") for k in ksize_list]
    receptive = (1 + sum(k[0] - 1 for k in ksizes), 1 + sum(k[1] - 1 for k in ksizes))
    return calc_block_params(in_size, bsize, receptive, strides, padding)
