"""`SparseProj`: validation, the lookup table on the device, launches."""

from typing import Any, Optional, Tuple

import numpy as np
from numba import cuda

from ..runtime.arrays import Array, checked_operands, launch_stream
from ..runtime.compile import cached
from ..runtime.devices import active, on_arrays_device
from ..runtime.launch import launch, multiprocessors
from .kernels import make_gather, make_scatter

DTYPES = ("float16", "bfloat16", "float32", "float64")
WRITE, ADD, MULTIPLY = 0, 1, 2


def _acc(dtype):
    from numba import float32, float64

    return float64 if dtype == "float64" else float32


class SparseProj:
    """OpenAI's ``SparseProj``: P projected features that are P of ``nhidden`` hidden features,
    one to one (``gather_lut[j]``, distinct), for activations (N, nhidden) with ``feature_axis`` 1
    or (nhidden, N) with 0.

    ``gather_lut`` defaults to every ``proj_stride``-th feature, ``nproj`` of them (``proj_stride``
    defaulting to nhidden // nproj, ``nproj`` to nhidden // proj_stride). Methods, each with its
    gradient method (``*_grad``): `gather` (hidden -> projected), `scatter` (projected -> hidden,
    zeros elsewhere), `scatter_add` and `scatter_mul` (into a copy of a hidden ``y``). ``block_size``:
    threads a thread block."""

    def __init__(self, nhidden: int, nproj: Optional[int] = None, proj_stride: Optional[int] = None,
                 block_size: int = 32, gather_lut: Optional[Any] = None, feature_axis: int = 1) -> None:
        for name, value in (("nhidden", nhidden), ("block_size", block_size)):
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
                raise ValueError(f"{name}: expected a positive int, got {value!r}")
        if block_size % 32:
            raise ValueError(f"block_size: expected a multiple of 32 (whole warps), got {block_size}")
        if feature_axis not in (0, 1):
            raise ValueError(f"feature_axis: expected 0 or 1, got {feature_axis!r}")
        if gather_lut is None:
            if nproj is None and proj_stride is None:
                raise ValueError("SparseProj: expected nproj, proj_stride or gather_lut")
            proj_stride = int(proj_stride) if proj_stride is not None else max(1, nhidden // max(1, int(nproj or 0)))
            nproj = int(nproj) if nproj is not None else nhidden // proj_stride
            if proj_stride < 1 or not 1 <= nproj or (nproj - 1) * proj_stride >= nhidden:
                raise ValueError(f"nproj, proj_stride: {nproj} features every {proj_stride} do not fit in {nhidden}")
            gather_lut = np.arange(nproj) * proj_stride
        lut = np.asarray(gather_lut)
        if lut.ndim != 1 or not lut.size or not np.issubdtype(lut.dtype, np.integer):
            raise ValueError(f"gather_lut: expected a 1-D array of feature indices, got {lut.dtype} {lut.shape}")
        if lut.min() < 0 or lut.max() >= nhidden or len(np.unique(lut)) != lut.size:
            raise ValueError(f"gather_lut: expected distinct indices in [0, {nhidden})")
        self.nhidden, self.nproj, self.block_size, self.feature_axis = int(nhidden), int(lut.size), int(block_size), \
            feature_axis
        self.gather_lut = lut.astype(np.int32)
        self._luts: dict = {}

    def _lut(self, stream):
        ordinal = active()
        if ordinal not in self._luts:
            self._luts[ordinal] = cuda.to_device(self.gather_lut, stream=stream)
        return self._luts[ordinal]

    def _ops(self, named, widths):
        ops = checked_operands(named, DTYPES)
        axis = self.feature_axis
        rows = None
        for op, width in zip(ops, widths):
            if len(op.shape) != 2 or op.shape[axis] != width:
                want = f"(N, {width})" if axis == 1 else f"({width}, N)"
                raise ValueError(f"{op.name}: expected {want}, got shape {op.shape}")
            if rows is not None and op.shape[1 - axis] != rows:
                raise ValueError(f"{op.name}: expected {rows} rows (as {ops[0].name}), got shape {op.shape}")
            rows = op.shape[1 - axis]
        return ops, rows

    def _shape(self, rows, width):
        return (rows, width) if self.feature_axis == 1 else (width, rows)

    def _launch(self, kernel, stream, n, args):
        if n:
            grid = max(1, min(-(-n // self.block_size), 16 * multiprocessors()))
            launch(kernel, grid, self.block_size, stream, args)

    def _gather(self, x, b=None):
        named = [("x", x)] + ([("b", b)] if b is not None else [])
        ops, rows = self._ops(named, [self.nhidden] * len(named))
        stream = launch_stream(ops)
        native, y = ops[0].empty(self._shape(rows, self.nproj), stream)
        x_dev = ops[0].device(stream).reshape(-1)
        kernel = cached(make_gather, ops[0].dtype, _acc(ops[0].dtype), b is not None)
        self._launch(kernel, stream, rows * self.nproj, (y.reshape(-1), x_dev, self._lut(stream), rows, self.nhidden,
                                                         self.nproj, self.feature_axis,
                                                         ops[1].device(stream).reshape(-1) if b is not None else x_dev))
        return ops[0].result(native, y, stream)

    def _scatter(self, x, y, mode):
        named = [("x", x)] + ([("y", y)] if y is not None else [])
        ops, rows = self._ops(named, [self.nproj, self.nhidden][:len(named)])
        stream = launch_stream(ops)
        native, out = ops[0].empty(self._shape(rows, self.nhidden), stream)
        flat = out.reshape(-1)
        if y is None:
            from ..sbnet.dispatch import zero

            zero(flat, stream)
        else:
            _copy(ops[1].device(stream).reshape(-1), flat, stream)
        kernel = cached(make_scatter, ops[0].dtype, _acc(ops[0].dtype), mode)
        self._launch(kernel, stream, rows * self.nproj, (flat, ops[0].device(stream).reshape(-1), self._lut(stream),
                                                         rows, self.nhidden, self.nproj, self.feature_axis))
        return ops[0].result(native, out, stream)

    @on_arrays_device
    def gather(self, x: Array) -> Array:
        """x's projected features: (N, nproj) from (N, nhidden) (or transposed with axis 0)."""
        return self._gather(x)

    @on_arrays_device
    def scatter(self, x: Array) -> Array:
        """x (N, nproj) placed at its features of a hidden (N, nhidden), zeros elsewhere."""
        return self._scatter(x, None, WRITE)

    @on_arrays_device
    def scatter_add(self, x: Array, y: Array) -> Array:
        """A copy of y (N, nhidden) with x (N, nproj) added at the projected features."""
        return self._scatter(x, y, ADD)

    @on_arrays_device
    def scatter_mul(self, x: Array, y: Array) -> Array:
        """A copy of y (N, nhidden) with its projected features multiplied by x (N, nproj)."""
        return self._scatter(x, y, MULTIPLY)

    def gather_grad(self, dy: Array) -> Array:
        """dx of `gather`: dy scattered."""
        return self.scatter(dy)

    def scatter_grad(self, dy: Array) -> Array:
        """dx of `scatter`: dy gathered."""
        return self.gather(dy)

    def scatter_add_grad(self, dout: Array) -> Tuple[Array, Array]:
        """(dx, dy) of `scatter_add`: dout gathered, and dout itself."""
        return self.gather(dout), dout

    @on_arrays_device
    def scatter_mul_grad(self, dout: Array, x: Array, y: Array) -> Tuple[Array, Array]:
        """(dx, dy) of `scatter_mul(x, y)`: (dout · y) gathered, and dout with its projected
        features multiplied by x."""
        return self._gather(dout, y), self._scatter(x, dout, MULTIPLY)


def _copy(source, target, stream):
    """target[:] = source on the stream (device to device)."""
    if hasattr(target, "copy_"):  # torch
        target.copy_(source)
    elif hasattr(target, "copy_to_device"):  # Numba
        target.copy_to_device(source, stream=stream)
    else:  # CuPy
        target[...] = source
