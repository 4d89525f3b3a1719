"""Layer norm over feature axis 0 in one pass: a thread block a strip of x's columns, held whole in
shared memory.

`columns`' kernels read x (C, N) twice, once for the columns' sums and once for y, in three
launches, so they move at best 2/3 of a copy's bytes a second. Where a strip of ``S`` columns of
every feature fits the device's shared memory (C x S values, ``column_strip_bytes`` at most), one
kernel does it all from one read (`make_strip_forward`):

* **load**: the strip's rows, 16 bytes a copy (`ptx.cp_async`: no register holds them), every
  copy of the thread in flight before the first wait. Rows past N land as zeros (never stored).
* **sums**: thread ``t`` sums column ``t % S`` over the features ``t // S``, ``t // S + T/S``, ...
  from the column's first value (``Σ(x - x₀)``, ``Σ(x - x₀)²``: a large mean costs no accuracy),
  then the ``T/S`` partial sums of a column are added in order, so results repeat bitwise.
* **apply**: y from the held strip, 4 neighbouring columns a thread, one store where the arrays
  allow.

A strip is at least 16 bytes of a row (a copy). N's rows must be whole copies and x 16-byte
aligned (`strip_fits`); elsewhere the column kernels run.
"""

import math

from numba import cuda, int64, types

from ..bsmm.device import converters
from ..ptx.cp_async import commit, copy16_or_zero, shared_address, signed_address, waiter
from ..runtime.launch import dynamic_shared
from .groups import make_group_io, make_normalized

COPY = 16  # bytes a copy
ELEMENTS = {"float16": (types.float16, 2), "bfloat16": (types.int16, 2), "float32": (types.float32, 4),
            "float64": (types.float64, 8)}


def strip_columns(cfg, C, storage, limit):
    """Columns of x a strip takes: the most (a power of two from a copy's worth, and 4, up to the
    thread block's threads) whose C x S values fit ``column_strip_bytes`` and ``limit`` (the device's
    shared memory, less the kernel's static arrays); 0 where none does, or the strip is off."""
    _, size = ELEMENTS[storage]
    threads = 32 * cfg.column_warps
    budget = min(cfg.column_strip_bytes, limit - 2 * threads * 8 - 1024)
    columns = 0
    s = max(COPY // size, 4)  # (the apply's groups of 4 columns stay in the strip)
    while s <= threads and C * s * size <= budget:
        columns = s
        s *= 2
    return columns


def strip_fits(N, storage, pointers):
    """Whether x's rows are whole 16-byte copies and every pointer (x's and y's) 16-byte aligned."""
    _, size = ELEMENTS[storage]
    return (N * size) % COPY == 0 and all(p % COPY == 0 for p in pointers)


def make_strip_forward(cfg, storage, param_storage, acc_type, relu, vector, C, S):
    """``strip(y, mean, rstd, x, g, b, epsilon)``: x (C, N) -> y, and each column's mean and rstd;
    grid ceil(N / S) thread blocks of ``32 * column_warps`` threads, ``S`` columns each (`strip_columns`),
    C x S values of dynamic shared memory."""
    element, size = ELEMENTS[storage]
    x_in = converters(storage, acc_type)[0]
    p_in = converters(param_storage, acc_type)[0]
    _, write = make_group_io(converters(storage, acc_type), acc_type, vector)
    normalized = make_normalized(acc_type, relu)
    T = 32 * cfg.column_warps
    PER = T // S  # threads a column's sums
    WIDTH = COPY // size  # values a copy
    PARTS = S // WIDTH  # copies a strip row
    COPIES = -(-C * PARTS // T)  # a thread's copies
    GROUPS = S // 4  # 4-column groups a strip row
    wait_all = waiter(0)

    @cuda.jit
    def strip(y, mean_out, rstd_out, x, g, b, epsilon):
        tile = cuda.shared.array(0, element)  # (dynamic: the strip, C rows of S values)
        sums = cuda.shared.array((2, T), acc_type)
        stats = cuda.shared.array((2, S), acc_type)
        t = cuda.threadIdx.x
        N = x.shape[1]
        n0 = cuda.blockIdx.x * S
        base = shared_address(tile, (0,))
        source = signed_address(x, (0, 0))
        for i in range(COPIES):
            q = t + i * T
            if q < C * PARTS:
                row, part = q // PARTS, q % PARTS
                column = n0 + part * WIDTH
                inside = column < N
                at = int64(row) * N + min(column, N - WIDTH)
                copy16_or_zero(base + q * COPY, source + at * size, inside)
        commit()
        wait_all()
        cuda.syncthreads()
        # each column's sums from its first value, over T/S threads, then added in their order
        j, sub = t % S, t // S
        first = x_in(tile[j])
        s = acc_type(0)
        q2 = acc_type(0)
        for row in range(sub, C, PER):
            d = x_in(tile[row * S + j]) - first
            s += d
            q2 += d * d
        sums[0, t] = s
        sums[1, t] = q2
        cuda.syncthreads()
        if t < S:
            s = acc_type(0)
            q2 = acc_type(0)
            for k in range(PER):
                s += sums[0, t + k * S]
                q2 += sums[1, t + k * S]
            shift = s / acc_type(C)
            mean = first + shift
            rstd = acc_type(1) / math.sqrt(max(q2 / acc_type(C) - shift * shift, acc_type(0)) + acc_type(epsilon))
            stats[0, t] = mean
            stats[1, t] = rstd
            if n0 + t < N:
                mean_out[n0 + t] = mean
                rstd_out[n0 + t] = rstd
        cuda.syncthreads()
        # y: 4 neighbouring columns a thread, a row of groups after another
        v = cuda.local.array(4, acc_type)
        for q in range(t, C * GROUPS, T):
            row, c4 = q // GROUPS, (q % GROUPS) * 4
            gc, bc = p_in(g[row]), p_in(b[row])
            for i in range(4):
                v[i] = normalized((x_in(tile[row * S + c4 + i]) - stats[0, c4 + i]) * stats[1, c4 + i], gc, bc)
            write(y, row, n0 + c4, v[0], v[1], v[2], v[3])

    return dynamic_shared(strip, C * S * size)
