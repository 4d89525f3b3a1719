"""Layer norm over feature axis 0 in one pass: a thread block a strip of x's columns, held whole in
shared memory.

`columns`' kernels read x (C, N) twice, once for the columns' sums and once for y, in three
launches, so they move at best 2/3 of a copy's bytes a second. Where a strip of ``S`` columns of
every feature fits the device's shared memory (C x S values of each array held,
``column_strip_bytes`` at most, rows of ``column_strip_row_bytes`` at least: by default 32 KB
and 32 bytes, so C up to 1024), one kernel does it all from one read
(`make_strip_forward`):

* **load**: the strip's rows, 16 bytes a copy (`ptx.cp_async`: no register holds them), every
  copy of the thread in flight before the first wait. Rows past N land as zeros (never stored).
* **sums**: thread ``t`` sums column ``t % S`` over the features ``t // S``, ``t // S + T/S``, ...
  from the column's first value (``Σ(x - x₀)``, ``Σ(x - x₀)²``: a large mean costs no accuracy),
  then the ``T/S`` partial sums of a column are added in order, so results repeat bitwise.
* **apply**: y from the held strip, 4 neighbouring columns a thread, one store where the arrays
  allow.

With ``column_strip_phases`` (off until timed) a strip's rows land in up to 4 parts and the
sums start on each as it lands; with ``column_strip_walk`` a wave of thread blocks walks the
strips, each putting the next strip's part in flight once it has written y (dx) from this one's,
so that where a strip is so large that one thread block fills a multiprocessor (C = 4096: 128 KB)
its loads still run under arithmetic. Both directions.

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
from ..runtime.compile import inlined
from ..runtime.launch import data_pointer, dynamic_shared, multiprocessors, shared_memory_limit
from .blocks import FULL_MASK
from .groups import make_group_io, make_normalized, make_passed

COPY = 16  # bytes a copy
ELEMENTS = {"float16": (types.float16, 2), "bfloat16": (types.int16, 2), "float32": (types.float32, 4),
            "float64": (types.float64, 8)}


def static_bytes(threads):
    """Shared memory a strip kernel's static arrays may take (its sums and statistics), and slack."""
    return 2 * threads * 8 + 1024


@cuda.jit(device=True, inline=True)
def first_from(r0, start, step):
    """The first row from ``r0`` on of a thread's rows ``start``, ``start + step``, ... (start < step;
    uint32)."""
    return r0 + (uint32(start) + uint32(step) - r0 % uint32(step)) % uint32(step)


def strip_columns(cfg, C, storage, limit, held=1):
    """Columns of x a strip takes: the most (a power of two from ``column_strip_row_bytes`` of a
    row, a copy's worth and 4, up to the thread block's threads and 128) whose C x S values fit
    ``column_strip_bytes`` for each of ``held`` arrays (x; x and dy) and, all of them, ``limit`` (the
    device's shared memory, less the kernel's static arrays); 0 where none does, or the strip is off."""
    _, size = ELEMENTS[storage]
    threads = 32 * cfg.column_warps
    room = limit - static_bytes(threads)
    columns = 0
    s = max(COPY // size, 4, cfg.column_strip_row_bytes // size)  # (the apply's groups of 4 stay in the strip)
    while s <= min(threads, 128) and C * s * size <= cfg.column_strip_bytes and held * C * s * size <= room:
        columns = s
        s *= 2
    return columns


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


def make_strip_parts(cfg, storage, param_storage, acc_type, vector, C, S, RP=None):
    """What both strip kernels share: (``x_in``, ``p_in``: x's and the parameters' reads to
    accumulators; ``write``: y's or dx's 4 values, `groups.make_group_io`; ``load(at, array, n0,
    p)``: this thread's 16-byte copies of phase p's rows of ``array``'s strip (rows p·RP to
    (p + 1)·RP; ``RP`` all C by default) from column n0 into the shared window at ``at``, rows past N
    zero-filled, their source kept inside the array; ``column_totals(sums, t) -> (Σ sums[0], Σ
    sums[1])``: column t's ``T/S`` partial sums, thread t + k·S's, added in that order)."""
    _, size = ELEMENTS[storage]
    T = 32 * cfg.column_warps
    PER = T // S
    WIDTH = COPY // size  # values a copy
    PARTS = S // WIDTH  # copies a strip row
    RP = C if RP is None else RP  # rows a phase
    COPIES = -(-RP * PARTS // T)  # a thread's copies of a phase of an array

    @cuda.jit(device=True, inline=True)
    def load(at, array, n0, p):
        t = cuda.threadIdx.x
        N = array.shape[1]
        source = signed_address(array, (0, 0))
        end = min(C, (p + 1) * RP) * PARTS
        for i in range(COPIES):
            q = p * RP * PARTS + t + i * T
            if q < end:
                row, part = q // PARTS, q % PARTS
                column = n0 + part * WIDTH
                offset = int64(row) * N + min(column, N - WIDTH)
                copy16_or_zero(at + q * COPY, source + offset * size, column < N)

    @cuda.jit(device=True, inline=True)
    def column_totals(sums, t):
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


def make_wait_for(P):
    """``wait_for(p)``: until part p of P (a commit group each, in order) has landed for this thread."""
    w0, w1, w2, w3 = (waiter(keep) for keep in range(4))

    @cuda.jit(device=True, inline=True)
    def wait_for(p):
        keep = P - 1 - p  # (newer parts still in flight)
        if keep >= 3:
            w3()
        elif keep == 2:
            w2()
        elif keep == 1:
            w1()
        else:
            w0()

    return wait_for


def make_strip_forward(cfg, storage, param_storage, acc_type, relu, vector, C, S):
    """``strip(y, mean, rstd, x, g, b, epsilon)``: x (C, N) -> y, and each column's mean and rstd;
    thread blocks of ``32 * column_warps`` threads, ``S`` columns a strip (`strip_columns`), C x S
    values of dynamic shared memory; grid ceil(N / S), a strip a thread block, or with
    ``column_strip_walk`` fewer (`strip_grid`), each walking strips ``gridDim.x`` apart.

    The strip's rows land in ``column_strip_phases`` parts (a commit group each), and the column
    sums start on each part as it lands. Walking, a thread block puts the next strip's part in
    flight as soon as it has written y from this strip's part (the rows' buffer is then free), so
    that one thread block's loads run under its own sums and writes. A thread sums its column's
    rows in the same order either way: the bits do not depend on the phases or the walk."""
    element, size = ELEMENTS[storage]
    P = cfg.column_strip_phases
    WALK = cfg.column_strip_walk
    RP = -(-C // P)  # rows a phase
    x_in, p_in, write, load, column_totals = make_strip_parts(cfg, storage, param_storage, acc_type, vector, C, S, RP)
    normalized = make_normalized(acc_type, relu)
    T = 32 * cfg.column_warps
    PER = T // S  # threads a column's sums
    GROUPS = S // 4  # 4-column groups a strip row
    STEP = T // GROUPS  # rows between a thread's apply rows
    wait_for = make_wait_for(P)

    def apply_part(p, y, g, b, tile, held, v, first_row, c4, n0, following, strips, at0, x):
        """y from phase p's rows of the strip (every STEP-th row from the thread's first); walking,
        then the next strip's phase p in flight into those rows."""
        r0 = uint32(p * RP)
        row = first_from(r0, first_row, STEP)
        at = row * uint32(S) + uint32(c4)
        while row < uint32(min(C, (p + 1) * RP)):
            gc, bc = p_in(g[row]), p_in(b[row])
            for i in range(4):
                v[i] = normalized((x_in(tile[at + uint32(i)]) - held[0, i]) * held[1, i], gc, bc)
            write(y, row, n0 + c4, v[0], v[1], v[2], v[3])
            at += uint32(STEP * S)
            row += uint32(STEP)
        if WALK and following < strips:  # (uniform: the phase's rows are read by every thread first)
            cuda.syncthreads()
            load(at0, x, following * S, p)
            commit()

    apply_part = inlined(apply_part)

    @cuda.jit
    def strip(y, mean_out, rstd_out, x, g, b, epsilon):
        tile = cuda.shared.array(0, element)  # (dynamic: the strip, C rows of S values)
        sums = cuda.shared.array((2, T), acc_type)
        stats = cuda.shared.array((2, S), acc_type)
        t = cuda.threadIdx.x
        N = x.shape[1]
        at0 = shared_address(tile, (0,))
        strips = -(-N // S)
        k = cuda.blockIdx.x
        for p in range(P):
            load(at0, x, k * S, p)
            commit()
        j, sub = t % S, t // S
        c4, first_row = (t % GROUPS) * 4, t // GROUPS
        while True:  # (one strip, unless walking)
            n0 = k * S
            # each column's sums from its first value, over T/S threads (rows sub, sub + PER, ...),
            # a phase at a time as it lands, then added in their order
            s = acc_type(0)
            q2 = acc_type(0)
            first = acc_type(0)
            for p in range(P):
                wait_for(p)
                cuda.syncthreads()
                if p == 0:
                    first = x_in(tile[j])
                r0 = uint32(p * RP)
                row = first_from(r0, sub, PER)
                at = row * uint32(S) + uint32(j)  # (unsigned indices: no negative-index wrapping a load)
                while at < uint32(min(C, (p + 1) * RP) * S):  # (rows to the phase's end)
                    d = x_in(tile[at]) - first
                    s += d
                    q2 += d * d
                    at += uint32(PER * S)
            sums[0, t] = s
            sums[1, t] = q2
            cuda.syncthreads()
            if t < S:
                s, q2 = column_totals(sums, t)
                shift = s / acc_type(C)
                mean = first + shift
                rstd = acc_type(1) / math.sqrt(max(q2 / acc_type(C) - shift * shift, acc_type(0))
                                               + acc_type(epsilon))
                stats[0, t] = mean
                stats[1, t] = rstd
                if n0 + t < N:
                    mean_out[n0 + t] = mean
                    rstd_out[n0 + t] = rstd
            cuda.syncthreads()
            # y: the same 4 neighbouring columns a thread (their statistics held), every STEP-th row,
            # a phase at a time; walking, the next strip's phase goes in flight behind it
            held = cuda.local.array((2, 4), acc_type)
            v = cuda.local.array(4, acc_type)
            for i in range(4):
                held[0, i] = stats[0, c4 + i]
                held[1, i] = stats[1, c4 + i]
            following = k + cuda.gridDim.x
            if P == 1:  # (one part: no loop around it, which left the compiler 8-16 more registers)
                apply_part(0, y, g, b, tile, held, v, first_row, c4, n0, following, strips, at0, x)
            else:
                for p in range(P):
                    apply_part(p, y, g, b, tile, held, v, first_row, c4, n0, following, strips, at0, x)
            k = following
            if not WALK or k >= strips:
                break

    return dynamic_shared(strip, C * S * size)


def strip_grid(cfg, N, S, C, storage, held=1):
    """Thread blocks of a strip kernel over ``N`` columns in strips of ``S`` (``held`` arrays: x;
    x and dy): one a strip, or walking (``column_strip_walk``) as many as the multiprocessors hold
    at once (by threads and by shared memory), at most one a strip."""
    count = -(-N // S)
    if not cfg.column_strip_walk:
        return count
    _, size = ELEMENTS[storage]
    T = 32 * cfg.column_warps
    resident = max(1, min(2048 // T, shared_memory_limit() // (held * C * S * size + static_bytes(T))))
    return min(count, multiprocessors() * resident)


def make_strip_backward(cfg, storage, param_storage, acc_type, relu, vector, C, S):
    """``strip(dx, gwork, dy, x, g, b, mean, rstd)``: dx, and gwork (strips, 2, C) the features'
    dg and db terms summed over each strip's columns; thread blocks of ``32 * column_warps``
    threads (`strip_columns` with two arrays), 2 x C x S values of dynamic shared memory; grid
    `strip_grid` (held=2): a strip a thread block, or walking, as the forward.

    ``column_strip_phases`` and ``column_strip_walk`` as the forward's: a part is x's and dy's
    rows of a whole number of dx rounds (below), so that a round's rows are in one part."""
    element, size = ELEMENTS[storage]
    P = cfg.column_strip_phases
    WALK = cfg.column_strip_walk
    T = 32 * cfg.column_warps
    PER = T // S
    GROUPS = S // 4  # 4-column groups a strip row: neighbouring lanes (at most 32)
    STEP = T // GROUPS  # rows a dx round
    ROUNDS = -(-C * GROUPS // T)  # (every thread in every round, for the shuffles)
    RP = -(-ROUNDS // P) * STEP  # rows a phase: whole rounds
    x_in, p_in, write, load, column_totals = make_strip_parts(cfg, storage, param_storage, acc_type, vector, C, S, RP)
    passed = make_passed(acc_type, relu)
    wait_for = make_wait_for(P)

    @cuda.jit(device=True, inline=True)
    def terms(tile, at, gc, bc, m, r):
        """(dy where the ReLU passed, xhat) of the held value ``at`` (row · S + column; unsigned)."""
        xhat = (x_in(tile[at]) - m) * r
        return passed(x_in(tile[at + uint32(C * S)]), xhat, gc, bc), xhat

    def dx_part(p, dx, gwork, dy, x, g, b, tile, held, o, first_row, c4, n0, k, following, strips, base):
        """dx from phase p's rounds: 4 neighbouring columns a thread, and each row's dg and db terms
        over the strip by shuffles; walking, then the next strip's phase p in flight."""
        for i in range(p * (RP // STEP), min(ROUNDS, (p + 1) * (RP // STEP))):
            row = uint32(first_row + i * STEP)
            active = row < uint32(C)
            row = min(row, uint32(C - 1))
            gc, bc = p_in(g[row]), p_in(b[row])
            tg = acc_type(0)
            tb = acc_type(0)
            at = row * uint32(S) + uint32(c4)
            for q in range(4):
                d, h = terms(tile, at + uint32(q), gc, bc, held[0, q], held[1, q])
                o[q] = held[1, q] * (d * gc - held[2, q] - h * held[3, q])
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
                gwork[k, 0, row] = tg
                gwork[k, 1, row] = tb
        if WALK and following < strips:  # (uniform: the phase's rows are read by every thread first)
            cuda.syncthreads()
            load(base, x, following * S, p)
            load(base + C * S * size, dy, following * S, p)
            commit()

    dx_part = inlined(dx_part)

    @cuda.jit
    def strip(dx, gwork, dy, x, g, b, mean_in, rstd_in):
        tile = cuda.shared.array(0, element)  # (dynamic: x's strip, then dy's)
        sums = cuda.shared.array((2, T), acc_type)
        stats = cuda.shared.array((4, S), acc_type)  # (mean, rstd, mean(dxhat), mean(dxhat·xhat))
        t = cuda.threadIdx.x
        N = x.shape[1]
        base = shared_address(tile, (0,))
        strips = -(-N // S)
        k = cuda.blockIdx.x
        for p in range(P):
            load(base, x, k * S, p)
            load(base + C * S * size, dy, k * S, p)
            commit()
        j, sub = t % S, t // S
        c4, first_row = (t % GROUPS) * 4, t // GROUPS  # (the same 4 columns every round: their statistics held)
        while True:  # (one strip, unless walking)
            n0 = k * S
            if t < S:
                inside = n0 + t < N  # (columns past N: finite stand-ins; their dy is 0, so no terms)
                stats[0, t] = acc_type(mean_in[n0 + t]) if inside else acc_type(0)
                stats[1, t] = acc_type(rstd_in[n0 + t]) if inside else acc_type(1)
            # each column's sums of dxhat and dxhat·xhat over T/S threads, a phase at a time as it
            # lands, then added in their order
            s = acc_type(0)
            q2 = acc_type(0)
            m = acc_type(0)
            r = acc_type(1)
            for p in range(P):
                wait_for(p)
                cuda.syncthreads()
                if p == 0:
                    m, r = stats[0, j], stats[1, j]
                r0 = uint32(p * RP)
                row = first_from(r0, sub, PER)
                at = row * uint32(S) + uint32(j)  # (unsigned: no negative-index wrapping a load)
                while row < uint32(min(C, (p + 1) * RP)):
                    gc, bc = p_in(g[row]), p_in(b[row])
                    d, h = terms(tile, at, gc, bc, m, r)
                    s += d * gc
                    q2 += d * gc * h
                    row += uint32(PER)
                    at += uint32(PER * S)
            sums[0, t] = s
            sums[1, t] = q2
            cuda.syncthreads()
            if t < S:
                s, q2 = column_totals(sums, t)
                stats[2, t] = s / acc_type(C)
                stats[3, t] = q2 / acc_type(C)
            cuda.syncthreads()
            o = cuda.local.array(4, acc_type)
            held = cuda.local.array((4, 4), acc_type)
            for q in range(4):
                for i in range(4):
                    held[i, q] = stats[i, c4 + q]
            following = k + cuda.gridDim.x
            if P == 1:  # (one part: no loop around it, as the forward's)
                dx_part(0, dx, gwork, dy, x, g, b, tile, held, o, first_row, c4, n0, k, following, strips, base)
            else:
                for p in range(P):
                    dx_part(p, dx, gwork, dy, x, g, b, tile, held, o, first_row, c4, n0, k, following, strips, base)
            k = following
            if not WALK or k >= strips:
                break

    return dynamic_shared(strip, 2 * C * S * size)
