"""SparseProj's kernels: a one-to-one map between the P projected features and P of the H hidden
ones (``lut[j]``), over N rows: x (N, H) or (H, N) flat, a thread an element of the P-wide side.

* ``gather(y, x, lut, N, H, P, axis, b)``: y[., j] = x[., lut[j]] (times b[., lut[j]] where
  ``product``, the gradient of scatter_mul);
* ``scatter(out, x, lut, N, H, P, axis)``: out[., lut[j]] = x[., j], + that (``add``) or · that
  (``multiply``); out arrives as zeros or as a copy of y.

No two threads touch one element (the map is one-to-one), so no atomics, and every gradient is
another of these maps.
"""

from numba import cuda

from ..bsmm.device import converters


@cuda.jit(device=True, inline=True)
def _at(row, feature, width, rows, axis):
    return row * width + feature if axis == 1 else feature * rows + row


def make_gather(storage, acc_type, product):
    to_acc, from_acc = converters(storage, acc_type)

    @cuda.jit
    def gather(y, x, lut, N, H, P, axis, b):
        start, step = cuda.grid(1), cuda.gridsize(1)
        for e in range(start, N * P, step):
            row, j = (e // P, e % P) if axis == 1 else (e % N, e // N)
            source = _at(row, lut[j], H, N, axis)
            value = to_acc(x[source])
            if product:
                value *= to_acc(b[source])
            y[_at(row, j, P, N, axis)] = from_acc(value)

    return gather


def make_scatter(storage, acc_type, mode):
    """mode: 0 write, 1 add, 2 multiply."""
    to_acc, from_acc = converters(storage, acc_type)

    @cuda.jit
    def scatter(out, x, lut, N, H, P, axis):
        start, step = cuda.grid(1), cuda.gridsize(1)
        for e in range(start, N * P, step):
            row, j = (e // P, e % P) if axis == 1 else (e % N, e // N)
            target = _at(row, lut[j], H, N, axis)
            value = to_acc(x[_at(row, j, P, N, axis)])
            if mode == 1:
                value += to_acc(out[target])
            elif mode == 2:
                value *= to_acc(out[target])
            out[target] = from_acc(value)

    return scatter
