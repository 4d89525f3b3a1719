"""Layer norm over feature axis 0 in one pass: a thread block a strip of x's columns, held whole in
shared memory.

`columns`' kernels read x (C, N) twice, once for the columns' sums and once for y, in three
launches, so they move at best 2/3 of a copy's bytes a second. Where a strip of ``S`` columns of
every feature fits the device's shared memory (C x S values of each array held: by default
rows of 32 bytes at least, widened within 32 KB, or up to 64 KB where only the narrowest fits,
so C up to 2048 in 16 bits; `strip_columns`), one kernel does it all from one read
(`make_strip_forward`):

* **load**: the strip's rows, 16 bytes a copy (`ptx.cp_async`: no register holds them), every
  copy of the thread in flight before the first wait. Rows past N land as zeros (never stored).
* **sums**: thread ``t`` sums column ``t % S`` over the features ``t // S``, ``t // S + T/S``, ...
  from the column's first value (``Σ(x - x₀)``, ``Σ(x - x₀)²``: a large mean costs no accuracy),
  then the ``T/S`` partial sums of a column are added in order, so results repeat bitwise.
* **apply**: y from the held strip, 4 neighbouring columns a thread, one store where the arrays
  allow.

The backward (`make_strip_backward`) holds the strips of x and dy: the columns' sums of
``dxhat`` and ``dxhat·xhat``, then dx, and each feature's dg and db terms over the strip's
columns (its 4-column groups' terms added by shuffles, in order) into a workspace of strips that
`layer.make_param_grads`' finish adds in order.

A strip is at least 16 bytes of a row (a copy). N's rows must be whole copies and the arrays
16-byte aligned (`strip_fits`); elsewhere the column kernels run.
"""

import math

from numba import cuda, int64, types, uint32

from ..bsmm.device import converters
from ..ptx.cp_async import commit, copy16_or_zero, shared_address, signed_address, waiter
from ..runtime.launch import data_pointer, dynamic_shared, shared_memory_limit
from .blocks import FULL_MASK
from .groups import make_group_io, make_normalized, make_passed

COPY = 16  # bytes a copy
ELEMENTS = {"float16": (types.float16, 2), "bfloat16": (types.int16, 2), "float32": (types.float32, 4),
            "float64": (types.float64, 8)}


def strip_columns(cfg, C, storage, limit, held=1):
    """Columns of x a strip takes (a power of two up to the thread block's threads and 128), for
    ``held`` arrays (1: x, the forward; 2: x and dy, the backward): the narrowest strip (a copy's
    worth, 4, ``column_strip_row_bytes`` of a row and, backward, ``column_strip_grad_columns``)
    where its C x S values of an array fit ``column_strip_max_bytes``, widened while they fit
    ``column_strip_bytes``; all the arrays held within ``limit`` (the device's shared memory, less
    the kernel's static arrays). 0 where none fits, or the strip is off."""
    _, size = ELEMENTS[storage]
    threads = 32 * cfg.column_warps
    room = limit - 2 * threads * 8  # (less the static sums; the statistics, 4 x S, below)
    s = max(COPY // size, 4, cfg.column_strip_row_bytes // size)  # (the apply's groups of 4 stay in the strip)
    if held > 1:
        s = max(s, cfg.column_strip_grad_columns)
    fits = lambda s, most: s <= min(threads, 128) and C * s * size <= most and held * C * s * size + 4 * s * 8 <= room
    if not (cfg.column_strip_bytes and fits(s, max(cfg.column_strip_bytes, cfg.column_strip_max_bytes))):
        return 0
    while fits(2 * s, cfg.column_strip_bytes):
        s *= 2
    return s


def strip_fits(N, storage, pointers):
    """Whether x's rows are whole 16-byte copies and every pointer (x's and y's) 16-byte aligned."""
    _, size = ELEMENTS[storage]
    return (N * size) % COPY == 0 and all(p % COPY == 0 for p in pointers)


def strip_width(cfg, C, N, storage, arrays, held=1):
    """The columns a strip of a call's kernel (`strip_columns`, the first ``held`` of ``arrays``
    held: x, or x and dy), or 0 where the column kernels run instead: strips off, no columns, rows
    not whole copies, an array not 16-byte aligned, or no strip fitting."""
    if not (cfg.column_strip_bytes and N and strip_fits(N, storage, map(data_pointer, arrays))):
        return 0
    return strip_columns(cfg, C, storage, shared_memory_limit(), held)


def make_strip_parts(cfg, storage, param_storage, acc_type, vector, C, S):
    """What both strip kernels share: (``x_in``, ``p_in``: x's and the parameters' reads to
    accumulators; ``write``: y's or dx's 4 values, `groups.make_group_io`; ``load(at, array,
    n0)``: this thread's 16-byte copies of ``array``'s strip from column n0 into the shared window
    at ``at``, rows past N zero-filled, their source kept inside the array; ``column_totals(sums,
    t, s, q) -> (Σ sums[0], Σ sums[1])``: every thread's partial sums (s, q) into ``sums``, a
    barrier, then column t's ``T/S`` of them, thread t + k·S's, added in that order (where t < S;
    other threads get their own back))."""
    _, size = ELEMENTS[storage]
    T = 32 * cfg.column_warps
    PER = T // S
    WIDTH = COPY // size  # values a copy
    PARTS = S // WIDTH  # copies a strip row
    COPIES = -(-C * PARTS // T)  # a thread's copies of an array

    @cuda.jit(device=True, inline=True)
    def load(at, array, n0):
        t = cuda.threadIdx.x
        N = array.shape[1]
        source = signed_address(array, (0, 0))
        for i in range(COPIES):
            q = t + i * T
            if q < C * PARTS:
                row, part = q // PARTS, q % PARTS
                column = n0 + part * WIDTH
                offset = int64(row) * N + min(column, N - WIDTH)
                copy16_or_zero(at + q * COPY, source + offset * size, column < N)

    @cuda.jit(device=True, inline=True)
    def column_totals(sums, t, s, q):
        sums[0, t] = s
        sums[1, t] = q
        cuda.syncthreads()
        if t < S:
            s = acc_type(0)
            q = acc_type(0)
            for k in range(PER):
                s += sums[0, t + k * S]
                q += sums[1, t + k * S]
        return s, q

    x_in = converters(storage, acc_type)[0]
    p_in = converters(param_storage, acc_type)[0]
    _, write = make_group_io(converters(storage, acc_type), acc_type, vector)
    return x_in, p_in, write, load, column_totals


def make_strip_forward(cfg, storage, param_storage, acc_type, relu, vector, C, S):
    """``strip(y, mean, rstd, x, g, b, epsilon)``: x (C, N) -> y, and each column's mean and rstd;
    grid ceil(N / S) thread blocks of ``32 * column_warps`` threads, ``S`` columns each (`strip_columns`),
    C x S values of dynamic shared memory."""
    element, size = ELEMENTS[storage]
    x_in, p_in, write, load, column_totals = make_strip_parts(cfg, storage, param_storage, acc_type, vector, C, S)
    normalized = make_normalized(acc_type, relu)
    T = 32 * cfg.column_warps
    PER = T // S  # threads a column's sums
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
        load(shared_address(tile, (0,)), x, n0)
        commit()
        wait_all()
        cuda.syncthreads()
        # each column's sums from its first value, over T/S threads, then added in their order
        j, sub = t % S, t // S
        first = x_in(tile[j])
        s = acc_type(0)
        q2 = acc_type(0)
        at = uint32(sub * S + j)  # (unsigned indices: no negative-index wrapping a load)
        while at < uint32(C * S):  # (rows sub, sub + PER, ...)
            d = x_in(tile[at]) - first
            s += d
            q2 += d * d
            at += uint32(PER * S)
        s, q2 = column_totals(sums, t, s, q2)
        if t < S:
            shift = s / acc_type(C)
            mean = first + shift
            rstd = acc_type(1) / math.sqrt(max(q2 / acc_type(C) - shift * shift, acc_type(0)) + acc_type(epsilon))
            stats[0, t] = mean
            stats[1, t] = rstd
            if n0 + t < N:
                mean_out[n0 + t] = mean
                rstd_out[n0 + t] = rstd
        cuda.syncthreads()
        # y: the same 4 neighbouring columns a thread (their statistics held), every (T/GROUPS)-th row
        c4, first_row = (t % GROUPS) * 4, t // GROUPS
        held = cuda.local.array((2, 4), acc_type)
        for i in range(4):
            held[0, i] = stats[0, c4 + i]
            held[1, i] = stats[1, c4 + i]
        v = cuda.local.array(4, acc_type)
        at = uint32(first_row * S + c4)
        row = uint32(first_row)
        while row < uint32(C):
            gc, bc = p_in(g[row]), p_in(b[row])
            for i in range(4):
                v[i] = normalized((x_in(tile[at + uint32(i)]) - held[0, i]) * held[1, i], gc, bc)
            write(y, row, n0 + c4, v[0], v[1], v[2], v[3])
            at += uint32(T // GROUPS * S)
            row += uint32(T // GROUPS)

    return dynamic_shared(strip, C * S * size)


def make_strip_backward(cfg, storage, param_storage, acc_type, relu, vector, C, S):
    """``strip(dx, gwork, dy, x, g, b, mean, rstd)``: dx, and gwork (strips, 2, C) the features'
    dg and db terms summed over each strip's columns; grid ceil(N / S) thread blocks of ``32 *
    column_warps`` threads (`strip_columns` with two arrays), 2 x C x S values of dynamic shared
    memory."""
    element, size = ELEMENTS[storage]
    x_in, p_in, write, load, column_totals = make_strip_parts(cfg, storage, param_storage, acc_type, vector, C, S)
    passed = make_passed(acc_type, relu)
    T = 32 * cfg.column_warps
    PER = T // S
    GROUPS = S // 4  # 4-column groups a strip row: neighbouring lanes (at most 32)
    ROUNDS = -(-C * GROUPS // T)  # (every thread in every round, for the shuffles)
    wait_all = waiter(0)

    @cuda.jit(device=True, inline=True)
    def terms(tile, at, gc, bc, m, r):
        """(dy where the ReLU passed, xhat) of the held value ``at`` (row · S + column; unsigned)."""
        xhat = (x_in(tile[at]) - m) * r
        return passed(x_in(tile[at + uint32(C * S)]), xhat, gc, bc), xhat

    @cuda.jit
    def strip(dx, gwork, dy, x, g, b, mean_in, rstd_in):
        tile = cuda.shared.array(0, element)  # (dynamic: x's strip, then dy's)
        sums = cuda.shared.array((2, T), acc_type)
        stats = cuda.shared.array((4, S), acc_type)  # (mean, rstd, mean(dxhat), mean(dxhat·xhat))
        t = cuda.threadIdx.x
        N = x.shape[1]
        n0 = cuda.blockIdx.x * S
        base = shared_address(tile, (0,))
        load(base, x, n0)
        load(base + C * S * size, dy, n0)
        if t < S:
            inside = n0 + t < N  # (columns past N: finite stand-ins; their dy is 0, so no terms)
            stats[0, t] = acc_type(mean_in[n0 + t]) if inside else acc_type(0)
            stats[1, t] = acc_type(rstd_in[n0 + t]) if inside else acc_type(1)
        commit()
        wait_all()
        cuda.syncthreads()
        # each column's sums of dxhat and dxhat·xhat over T/S threads, then added in their order
        j, sub = t % S, t // S
        m, r = stats[0, j], stats[1, j]
        s = acc_type(0)
        q2 = acc_type(0)
        row, at = uint32(sub), uint32(sub * S + j)  # (unsigned: no negative-index wrapping a load)
        while row < uint32(C):
            gc, bc = p_in(g[row]), p_in(b[row])
            d, h = terms(tile, at, gc, bc, m, r)
            s += d * gc
            q2 += d * gc * h
            row += uint32(PER)
            at += uint32(PER * S)
        s, q2 = column_totals(sums, t, s, q2)
        if t < S:
            stats[2, t] = s / acc_type(C)
            stats[3, t] = q2 / acc_type(C)
        cuda.syncthreads()
        # dx: 4 neighbouring columns a thread; the row's dg and db terms over the strip by shuffles
        o = cuda.local.array(4, acc_type)
        c4, first_row = (t % GROUPS) * 4, t // GROUPS  # (the same 4 columns every round: their statistics held)
        held = cuda.local.array((4, 4), acc_type)
        for k in range(4):
            for i in range(4):
                held[i, k] = stats[i, c4 + k]
        for i in range(ROUNDS):
            row = uint32(first_row + i * (T // GROUPS))
            active = row < uint32(C)
            row = min(row, uint32(C - 1))
            gc, bc = p_in(g[row]), p_in(b[row])
            tg = acc_type(0)
            tb = acc_type(0)
            at = row * uint32(S) + uint32(c4)
            for k in range(4):
                d, h = terms(tile, at + uint32(k), gc, bc, held[0, k], held[1, k])
                o[k] = held[1, k] * (d * gc - held[2, k] - h * held[3, k])
                tg += d * h
                tb += d
            if active:
                write(dx, row, n0 + c4, o[0], o[1], o[2], o[3])
            step = GROUPS // 2
            while step > 0:
                tg += cuda.shfl_down_sync(FULL_MASK, tg, step)
                tb += cuda.shfl_down_sync(FULL_MASK, tb, step)
                step //= 2
            if active and c4 == 0:
                gwork[cuda.blockIdx.x, 0, row] = tg
                gwork[cuda.blockIdx.x, 1, row] = tb

    return dynamic_shared(strip, 2 * C * S * size)
