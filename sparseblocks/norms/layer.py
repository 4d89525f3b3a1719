"""Layer norm kernels: forward and backward over either feature axis (OpenAI's ``layer_norm``).

Each of N rows of C features is normalized: ``y = (x - mean)·rstd·g + b`` (then max(y, 0) with
``relu``), ``rstd = 1/sqrt(var + epsilon)``. The mean is found first and the variance summed from
``x - mean`` (two passes over the row, held in registers or in L1/L2), so a large mean costs no
accuracy.
Sums run in fp32 (fp64 for fp64), in a fixed order: results repeat bitwise.

* Feature axis 1, x (N, C): ``T`` threads a row, ``RB`` rows a thread block (`row_shape`). A
  row's threads stride over it (consecutive threads, consecutive groups of 4 features, each group
  one vector load where C is a multiple of 4 and the arrays aligned) and reduce by warp shuffles,
  then across the row's warps in shared memory (`blocks.make_block_sum`); a row of one warp needs no
  barrier.
* Feature axis 0, x (C, N): a thread 4 neighbouring columns of x (4 rows of the normalization),
  a warp 128 columns, the block's warps a row of features each in turn, ``column_unroll`` rows'
  loads in flight before the first is used (`make_column_loads`). Three launches: the
  column sums over chunks of ``column_rows`` features into a workspace (from a shift, each
  column's first value, so that a large mean costs no accuracy: ``Σ(x - x₀)`` and
  ``Σ(x - x₀)²``), the mean and rstd from the chunks' sums in order, then y.

The backward recomputes ``xhat = (x - mean)·rstd`` from the forward's kept mean and rstd:
``dx = rstd·(dxhat - mean(dxhat) - xhat·mean(dxhat·xhat))`` with ``dxhat = dy·g`` (dy zeroed
where the forward's ReLU cut), ``dg = Σ_rows dy·xhat``, ``db = Σ_rows dy``. On axis 1 the
parameter gradients sum row chunks of ``grad_rows`` into a workspace, which a second kernel adds
in a fixed order (`make_param_grads`). On axis 0 the column sums of ``dxhat`` and ``dxhat·xhat`` take the forward's
three launches, and the kernel that writes dx also sums dg's and db's terms over its 128
columns (a workspace of column blocks, added in order).
"""

import math

from numba import cuda

from ..bsmm.device import converters
from ..ptx.vector import load4, store4
from ..runtime.compile import bounded
from .blocks import FULL_MASK, block_slots, make_block_sum

COLUMNS = 128  # feature axis 0: columns of x a warp covers (4 a lane)


def row_blocks(cfg, threads, acc_type, grad=False):
    """Thread blocks of ``threads`` a multiprocessor axis 1's kernels are bounded for: ``row_blocks``
    (``grad_row_blocks`` for the backward's row kernel), at most 2048 threads' worth (the registers
    capped at what that leaves a thread); 0, no bound, for fp64 sums (two registers a value)."""
    wanted = cfg.grad_row_blocks if grad else cfg.row_blocks
    return min(wanted, 2048 // threads) if acc_type.bitwidth == 32 else 0


def row_kernel(cfg, threads, acc_type, grad=False):
    """Axis 1's kernel decorator: launch bounds of `row_blocks` thread blocks a multiprocessor."""
    blocks = row_blocks(cfg, threads, acc_type, grad)
    return bounded(threads, blocks) if blocks else cuda.jit


def column_blocks(cfg, acc_type):
    """Thread blocks of ``column_warps`` warps a multiprocessor axis 0's sums and apply kernels are
    bounded for: ``column_blocks``, at most 2048 threads' worth; 0, no bound (and for fp64 sums)."""
    return min(cfg.column_blocks, 64 // cfg.column_warps) if acc_type.bitwidth == 32 else 0


def column_kernel(cfg, acc_type):
    """Axis 0's column kernels' decorator: launch bounds of `column_blocks`, as `row_kernel`'s."""
    blocks = column_blocks(cfg, acc_type)
    return bounded(32 * cfg.column_warps, blocks) if blocks else cuda.jit


def make_row_of(RB):
    """``row_of(N) -> (row, inside)``: a thread's row of x, ``RB`` rows a thread block; a row past
    N reads the last one (its threads still reach the block's barriers) and stores nothing."""

    @cuda.jit(device=True, inline=True)
    def row_of(N):
        if RB == 1:
            return cuda.blockIdx.x, True
        row = cuda.blockIdx.x * RB + cuda.threadIdx.y
        return min(row, N - 1), row < N

    return row_of


def _normalized(acc_type, relu):
    @cuda.jit(device=True, inline=True)
    def normalized(xhat, g, b):
        v = xhat * g + b
        if relu and v < acc_type(0):  # (a NaN stays NaN)
            return acc_type(0)
        return v

    return normalized


def _passed(acc_type, relu):
    @cuda.jit(device=True, inline=True)
    def passed(dy, xhat, g, b):
        """dy where the forward's ReLU let the value through."""
        if relu and not xhat * g + b > acc_type(0):
            return acc_type(0)
        return dy

    return passed


def make_group_io(convert, acc_type, vector):
    """``read(a, r, c)``: the 4 values ``a[r, c:c+4]`` as accumulators (0 past the row's end), one
    load where ``vector``; ``write(a, r, c, v0, v1, v2, v3)`` the same 4 places (those in the row)."""
    to_acc, from_acc = convert

    @cuda.jit(device=True, inline=True)
    def read(a, r, c):
        width = a.shape[1]
        if vector and c + 3 < width:
            v = load4(a, (r, c))
            return to_acc(v[0]), to_acc(v[1]), to_acc(v[2]), to_acc(v[3])
        zero = acc_type(0)
        return (to_acc(a[r, c]) if c < width else zero, to_acc(a[r, c + 1]) if c + 1 < width else zero,
                to_acc(a[r, c + 2]) if c + 2 < width else zero, to_acc(a[r, c + 3]) if c + 3 < width else zero)

    @cuda.jit(device=True, inline=True)
    def write(a, r, c, v0, v1, v2, v3):
        width = a.shape[1]
        if vector and c + 3 < width:
            store4(a, (r, c), (from_acc(v0), from_acc(v1), from_acc(v2), from_acc(v3)))
        else:
            if c < width:
                a[r, c] = from_acc(v0)
            if c + 1 < width:
                a[r, c + 1] = from_acc(v1)
            if c + 2 < width:
                a[r, c + 2] = from_acc(v2)
            if c + 3 < width:
                a[r, c + 3] = from_acc(v3)

    return read, write


def make_param_io(convert, acc_type, vector):
    """``params(p, c)``: the 4 values ``p[c:c+4]`` of a 1-D array (0 past its end)."""
    to_acc, _ = convert

    @cuda.jit(device=True, inline=True)
    def params(p, c):
        n = p.shape[0]
        if vector and c + 3 < n:
            v = load4(p, (c,))
            return to_acc(v[0]), to_acc(v[1]), to_acc(v[2]), to_acc(v[3])
        zero = acc_type(0)
        return (to_acc(p[c]) if c < n else zero, to_acc(p[c + 1]) if c + 1 < n else zero,
                to_acc(p[c + 2]) if c + 2 < n else zero, to_acc(p[c + 3]) if c + 3 < n else zero)

    return params


def make_whole_io(convert, p_convert):
    """(``read_whole(a, r, c)``, ``write_whole(a, r, c, v0, v1, v2, v3)``, ``params_whole(p, c)``):
    `make_group_io`'s and `make_param_io`'s vector paths alone, for a caller that knows its groups
    lie whole in the row and the arrays take vector loads: one load or store, no bounds' branch."""
    to_acc, from_acc = convert
    p_acc = p_convert[0]

    @cuda.jit(device=True, inline=True)
    def read_whole(a, r, c):
        v = load4(a, (r, c))
        return to_acc(v[0]), to_acc(v[1]), to_acc(v[2]), to_acc(v[3])

    @cuda.jit(device=True, inline=True)
    def write_whole(a, r, c, v0, v1, v2, v3):
        store4(a, (r, c), (from_acc(v0), from_acc(v1), from_acc(v2), from_acc(v3)))

    @cuda.jit(device=True, inline=True)
    def params_whole(p, c):
        v = load4(p, (c,))
        return p_acc(v[0]), p_acc(v[1]), p_acc(v[2]), p_acc(v[3])

    return read_whole, write_whole, params_whole


def make_column_sums(W, acc_type):
    """``column_sums(work, shared, lane, w, n0, values)``: the block's warps' 8 sums of a lane's
    4 columns (``values``: 4 of one quantity, then 4 of another) added in warp order into
    ``work[chunk, 0:2, n0:n0+4]`` (chunk: the block's y); ``shared`` (W, 8, 32) of acc_type."""

    @cuda.jit(device=True, inline=True)
    def column_sums(work, shared, lane, w, n0, values):
        for j in range(8):
            shared[w, j, lane] = values[j]
        cuda.syncthreads()
        if w == 0:
            N = work.shape[2]
            for j in range(8):
                total = acc_type(0)
                for k in range(W):
                    total += shared[k, j, lane]
                if n0 + j % 4 < N:
                    work[cuda.blockIdx.y, j // 4, n0 + j % 4] = total

    return column_sums


def make_column_loads(U, W, read):
    """``load_rows(held, a, c, end, n0)``: a warp's ``U`` rows of an axis-0 chunk, c, c + W, ...,
    ``a[row, n0:n0+4]`` into ``held[u, 0:4]``, every load issued before any value is used; a row
    at or past ``end`` reads the chunk's last row again (its caller adds no terms of it)."""

    @cuda.jit(device=True, inline=True)
    def load_rows(held, a, c, end, n0):
        for u in range(U):
            held[u, 0], held[u, 1], held[u, 2], held[u, 3] = read(a, min(c + u * W, end - 1), n0)

    return load_rows


def make_chunk_sums(acc_type):
    """``chunk_sums(work, i) -> (Σ work[:, 0, i], Σ work[:, 1, i])``, added in chunk order (the
    results repeat bitwise)."""

    @cuda.jit(device=True, inline=True)
    def chunk_sums(work, i):
        s = acc_type(0)
        q = acc_type(0)
        n = work.shape[0]
        for chunk in range(0, n - 3, 4):  # (four chunks' loads in flight, then added in order)
            s0, s1, s2, s3 = work[chunk, 0, i], work[chunk + 1, 0, i], work[chunk + 2, 0, i], work[chunk + 3, 0, i]
            q0, q1, q2, q3 = work[chunk, 1, i], work[chunk + 1, 1, i], work[chunk + 2, 1, i], work[chunk + 3, 1, i]
            s += s0
            s += s1
            s += s2
            s += s3
            q += q0
            q += q1
            q += q2
            q += q3
        for chunk in range(n - n % 4, n):
            s += work[chunk, 0, i]
            q += work[chunk, 1, i]
        return s, q

    return chunk_sums


def _stats_io(acc_type, vector):
    """`make_param_io` for the fp32 (fp64) per-column statistics."""
    return make_param_io(converters("float64" if acc_type.bitwidth == 64 else "float32", acc_type), acc_type, vector)


def make_forward(cfg, storage, param_storage, acc_type, axis, relu, vector, shape=None):
    """Axis 1: ``forward(y, mean, rstd, x, g, b, epsilon)``, launched with blocks of ``shape[2]``
    rows of ``shape[0]`` threads (`row_shape`: ``(T, RB)`` threads), each holding ``shape[1]``
    groups of 4 values in registers (0: reading the row in each pass instead).
    Axis 0: (``sums(work, x)``, ``stats(mean, rstd, work, x, epsilon)``, ``apply(y, x, g, b, mean,
    rstd)``), launched with `column_launch`'s grids. ``vector``: C (axis 1) or N (axis 0) a
    multiple of 4 and every array aligned to 4 elements."""
    x_conv = converters(storage, acc_type)
    x_in = x_conv[0]
    p_conv = converters(param_storage, acc_type)
    p_in = p_conv[0]
    read, write = make_group_io(x_conv, acc_type, vector)
    read_whole, write_whole, params_whole = make_whole_io(x_conv, p_conv)
    params = make_param_io(p_conv, acc_type, vector)
    normalized = _normalized(acc_type, relu)

    if axis == 1:
        T, K, RB = shape
        SLOTS = block_slots(T)  # (a shared array's size: a name, not an expression)
        HELD = max(4 * K, 1)
        block_sum, _ = make_block_sum(T, acc_type)
        row_of = make_row_of(RB)

        @cuda.jit(device=True, inline=True)
        def squares(c, C, center, v0, v1, v2, v3):
            """The squared deviations of a group's values (at c) from ``center``, summed; values
            past the row's end (read as zeros) are not values."""
            d0, d1, d2, d3 = v0 - center, v1 - center, v2 - center, v3 - center
            if c + 3 >= C:
                d0 = d0 if c < C else acc_type(0)
                d1 = d1 if c + 1 < C else acc_type(0)
                d2 = d2 if c + 2 < C else acc_type(0)
                d3 = d3 if c + 3 < C else acc_type(0)
            return (d0 * d0 + d1 * d1) + (d2 * d2 + d3 * d3)

        @row_kernel(cfg, T * RB, acc_type)
        def forward_rows(y, mean_out, rstd_out, x, g, b, epsilon):
            t, y_ = cuda.threadIdx.x, (cuda.threadIdx.y if RB > 1 else 0)
            row, inside = row_of(x.shape[0])
            shared = cuda.shared.array((RB, SLOTS), acc_type)
            held = cuda.local.array(HELD, acc_type)  # (K groups: the row's values stay in registers)
            C = x.shape[1]
            s = acc_type(0)
            whole = K > 0 and vector and 4 * (t + (K - 1) * T) + 3 < C  # (this thread's groups all in the row)
            if K:
                if whole:  # (every load issued before any sum waits on one)
                    for k in range(K):
                        held[4 * k], held[4 * k + 1], held[4 * k + 2], held[4 * k + 3] = read_whole(x, row,
                                                                                                4 * (t + k * T))
                else:
                    for k in range(K):
                        held[4 * k], held[4 * k + 1], held[4 * k + 2], held[4 * k + 3] = read(x, row, 4 * (t + k * T))
                for k in range(K):
                    s += (held[4 * k] + held[4 * k + 1]) + (held[4 * k + 2] + held[4 * k + 3])
            else:
                for c in range(4 * t, C, 4 * T):
                    v0, v1, v2, v3 = read(x, row, c)
                    s += (v0 + v1) + (v2 + v3)
            mean = block_sum(s, shared, y_, t, 0) / acc_type(C)  # (the row's mean first, the squares about it after)
            q = acc_type(0)
            if K:
                for k in range(K):
                    c = 4 * (t + k * T)
                    q += squares(c, C, mean, held[4 * k], held[4 * k + 1], held[4 * k + 2], held[4 * k + 3])
            else:
                for c in range(4 * t, C, 4 * T):
                    v0, v1, v2, v3 = read(x, row, c)
                    q += squares(c, C, mean, v0, v1, v2, v3)
            r = acc_type(1) / math.sqrt(block_sum(q, shared, y_, t, 1) / acc_type(C) + acc_type(epsilon))
            for k in range(K if K else -(-C // (4 * T))):
                c = 4 * (t + k * T)
                if c < C and inside:
                    if K:
                        v0, v1, v2, v3 = held[4 * k], held[4 * k + 1], held[4 * k + 2], held[4 * k + 3]
                    else:
                        v0, v1, v2, v3 = read(x, row, c)
                    if whole:
                        g0, g1, g2, g3 = params_whole(g, c)
                        b0, b1, b2, b3 = params_whole(b, c)
                    else:
                        g0, g1, g2, g3 = params(g, c)
                        b0, b1, b2, b3 = params(b, c)
                    y0, y1 = normalized((v0 - mean) * r, g0, b0), normalized((v1 - mean) * r, g1, b1)
                    y2, y3 = normalized((v2 - mean) * r, g2, b2), normalized((v3 - mean) * r, g3, b3)
                    if whole:
                        write_whole(y, row, c, y0, y1, y2, y3)
                    else:
                        write(y, row, c, y0, y1, y2, y3)
            if t == 0 and inside:
                mean_out[row], rstd_out[row] = mean, r

        return forward_rows

    W = cfg.column_warps
    R = cfg.column_rows
    U = cfg.column_unroll
    column_sums = make_column_sums(W, acc_type)
    column_params = _stats_io(acc_type, vector)
    chunk_sums = make_chunk_sums(acc_type)
    load_rows = make_column_loads(U, W, read)

    @column_kernel(cfg, acc_type)
    def sums(work, x):
        lane, w = cuda.threadIdx.x, cuda.threadIdx.y
        shared = cuda.shared.array((W, 8, 32), acc_type)
        held = cuda.local.array((U, 4), acc_type)
        C = x.shape[0]
        n0 = 4 * (cuda.blockIdx.x * 32 + lane)
        k0, k1, k2, k3 = read(x, 0, n0)
        s0 = s1 = s2 = s3 = q0 = q1 = q2 = q3 = acc_type(0)
        first = cuda.blockIdx.y * R
        end = min(C, first + R)
        for c in range(first + w, end, U * W):  # (U rows an iteration: all their loads in flight first)
            load_rows(held, x, c, end, n0)
            for u in range(U):
                keep = acc_type(1) if c + u * W < end else acc_type(0)  # (rows past the chunk: no terms)
                d0, d1 = (held[u, 0] - k0) * keep, (held[u, 1] - k1) * keep
                d2, d3 = (held[u, 2] - k2) * keep, (held[u, 3] - k3) * keep
                s0 += d0
                s1 += d1
                s2 += d2
                s3 += d3
                q0 += d0 * d0
                q1 += d1 * d1
                q2 += d2 * d2
                q3 += d3 * d3
        column_sums(work, shared, lane, w, n0, (s0, s1, s2, s3, q0, q1, q2, q3))

    @cuda.jit
    def stats(mean_out, rstd_out, work, x, epsilon):
        n = cuda.grid(1)
        C, N = x.shape
        if n >= N:
            return
        s, q = chunk_sums(work, n)
        shift = s / acc_type(C)
        mean = x_in(x[0, n]) + shift
        mean_out[n] = mean
        rstd_out[n] = acc_type(1) / math.sqrt(max(q / acc_type(C) - shift * shift, acc_type(0)) + acc_type(epsilon))

    @column_kernel(cfg, acc_type)
    def apply(y, x, g, b, mean_in, rstd_in):
        lane, w = cuda.threadIdx.x, cuda.threadIdx.y
        held = cuda.local.array((U, 4), acc_type)
        C, N = x.shape
        n0 = 4 * (cuda.blockIdx.x * 32 + lane)
        m0, m1, m2, m3 = column_params(mean_in, n0)
        r0, r1, r2, r3 = column_params(rstd_in, n0)
        first = cuda.blockIdx.y * R
        end = min(C, first + R)
        for c in range(first + w, end, U * W):  # (U rows an iteration: all loaded first)
            load_rows(held, x, c, end, n0)
            for u in range(U):
                row = c + u * W
                if row < end:
                    gc, bc = p_in(g[row]), p_in(b[row])
                    write(y, row, n0, normalized((held[u, 0] - m0) * r0, gc, bc),
                          normalized((held[u, 1] - m1) * r1, gc, bc), normalized((held[u, 2] - m2) * r2, gc, bc),
                          normalized((held[u, 3] - m3) * r3, gc, bc))

    return sums, stats, apply


def row_shape(cfg, C):
    """Axis 1: (threads a row, groups of 4 values a thread holds in registers, 0 where the row is
    longer than ``row_groups`` groups a thread; rows a thread block). Short rows take fewer
    threads, so that each holds at least 2 groups (loads in flight) where it can; a thread block
    takes as many rows as fit ``row_block`` threads (at least one)."""
    groups = -(-C // 4)
    threads = cfg.row_threads
    while threads > 32 and -(-groups // threads) < 2:
        threads //= 2
    held = -(-groups // threads)
    return threads, held if held <= cfg.row_groups else 0, max(1, cfg.row_block // threads)


def column_launch(cfg, C, N):
    """Axis 0, x (C, N): (grid, block) of the column kernels (sums, apply), and (grid, threads) of
    the stats kernel."""
    return ((-(-N // COLUMNS), -(-C // cfg.column_rows)), (32, cfg.column_warps)), (-(-N // 256), 256)


def make_backward(cfg, storage, param_storage, acc_type, axis, relu, vector, shape=None):
    """Axis 1: ``backward(dx, dy, x, g, b, mean, rstd)``, dx, launched as the forward (``shape``).
    Axis 0: (``sums(work, dy, x, g, b, mean, rstd)``, ``means(m, work)``, ``apply(dx, gwork, dy, x,
    g, b, mean, rstd, m)``), with `column_launch`'s grids (means: the stats kernel's); apply's
    gwork (column blocks, 2, C) takes dg's and db's terms summed over each block's columns."""
    x_conv = converters(storage, acc_type)
    p_conv = converters(param_storage, acc_type)
    p_in = p_conv[0]
    read, write = make_group_io(x_conv, acc_type, vector)
    read_whole, write_whole, params_whole = make_whole_io(x_conv, p_conv)
    params = make_param_io(p_conv, acc_type, vector)
    passed = _passed(acc_type, relu)

    if axis == 1:
        T, K, RB = shape
        SLOTS = block_slots(T)  # (a shared array's size: a name, not an expression)
        HELD = max(4 * K, 1)
        _, block_sums = make_block_sum(T, acc_type)
        row_of = make_row_of(RB)

        @cuda.jit(device=True, inline=True)
        def terms(dy, x, g, b, mean, r):
            xhat = (x - mean) * r
            return passed(dy, xhat, g, b) * g, xhat

        @cuda.jit(device=True, inline=True)
        def group_terms(dy, x, g, b, row, c, mean, r, whole):
            """(dxhat, xhat) of 4 values (dxhat 0 past the row's end, where dy and g read 0);
            ``whole``: the group lies in the row, read without the bounds' branches."""
            if whole:
                v0, v1, v2, v3 = read_whole(x, row, c)
                e0, e1, e2, e3 = read_whole(dy, row, c)
                g0, g1, g2, g3 = params_whole(g, c)
                b0, b1, b2, b3 = params_whole(b, c)
            else:
                v0, v1, v2, v3 = read(x, row, c)
                e0, e1, e2, e3 = read(dy, row, c)
                g0, g1, g2, g3 = params(g, c)
                b0, b1, b2, b3 = params(b, c)
            d0, h0 = terms(e0, v0, g0, b0, mean, r)
            d1, h1 = terms(e1, v1, g1, b1, mean, r)
            d2, h2 = terms(e2, v2, g2, b2, mean, r)
            d3, h3 = terms(e3, v3, g3, b3, mean, r)
            return d0, d1, d2, d3, h0, h1, h2, h3

        @row_kernel(cfg, T * RB, acc_type, grad=True)
        def backward_rows(dx, dy, x, g, b, mean_in, rstd_in):
            t, y_ = cuda.threadIdx.x, (cuda.threadIdx.y if RB > 1 else 0)
            row, inside = row_of(x.shape[0])
            shared = cuda.shared.array((RB, SLOTS), acc_type)
            hd = cuda.local.array(HELD, acc_type)  # (K groups: dxhat and xhat stay in registers)
            hh = cuda.local.array(HELD, acc_type)
            C = x.shape[1]
            mean, r = acc_type(mean_in[row]), acc_type(rstd_in[row])
            s1 = acc_type(0)
            s2 = acc_type(0)
            whole = K > 0 and vector and 4 * (t + (K - 1) * T) + 3 < C  # (this thread's groups all in the row)
            for k in range(K if K else -(-C // (4 * T))):
                c = 4 * (t + k * T)
                if whole:
                    d0, d1, d2, d3, h0, h1, h2, h3 = group_terms(dy, x, g, b, row, c, mean, r, True)
                else:
                    d0, d1, d2, d3, h0, h1, h2, h3 = group_terms(dy, x, g, b, row, c, mean, r, False)
                if K:
                    hd[4 * k], hd[4 * k + 1], hd[4 * k + 2], hd[4 * k + 3] = d0, d1, d2, d3
                    hh[4 * k], hh[4 * k + 1], hh[4 * k + 2], hh[4 * k + 3] = h0, h1, h2, h3
                s1 += (d0 + d1) + (d2 + d3)
                s2 += (d0 * h0 + d1 * h1) + (d2 * h2 + d3 * h3)
            s1, s2 = block_sums(s1, s2, shared, y_, t)
            m1, m2 = s1 / acc_type(C), s2 / acc_type(C)
            for k in range(K if K else -(-C // (4 * T))):
                c = 4 * (t + k * T)
                if c < C and inside:
                    if K:
                        d0, d1, d2, d3 = hd[4 * k], hd[4 * k + 1], hd[4 * k + 2], hd[4 * k + 3]
                        h0, h1, h2, h3 = hh[4 * k], hh[4 * k + 1], hh[4 * k + 2], hh[4 * k + 3]
                    else:
                        d0, d1, d2, d3, h0, h1, h2, h3 = group_terms(dy, x, g, b, row, c, mean, r, False)
                    o0, o1 = r * (d0 - m1 - h0 * m2), r * (d1 - m1 - h1 * m2)
                    o2, o3 = r * (d2 - m1 - h2 * m2), r * (d3 - m1 - h3 * m2)
                    if whole:
                        write_whole(dx, row, c, o0, o1, o2, o3)
                    else:
                        write(dx, row, c, o0, o1, o2, o3)

        return backward_rows

    W = cfg.column_warps
    R = cfg.column_rows
    U = cfg.column_unroll
    column_sums = make_column_sums(W, acc_type)
    column_params = _stats_io(acc_type, vector)
    chunk_sums = make_chunk_sums(acc_type)
    load_rows = make_column_loads(U, W, read)

    @cuda.jit(device=True, inline=True)
    def terms(e, v, gc, bc, m, r):
        xhat = (v - m) * r
        return passed(e, xhat, gc, bc), xhat

    @cuda.jit(device=True, inline=True)
    def row_terms(xs, es, u, g, b, row, m0, m1, m2, m3, r0, r1, r2, r3):
        """(g[row], dy of the 4 columns where the ReLU passed (0 past N's end), their xhat), from
        the row's values held at ``xs[u]`` and ``es[u]`` (`make_column_loads`)."""
        gc, bc = p_in(g[row]), p_in(b[row])
        d0, h0 = terms(es[u, 0], xs[u, 0], gc, bc, m0, r0)
        d1, h1 = terms(es[u, 1], xs[u, 1], gc, bc, m1, r1)
        d2, h2 = terms(es[u, 2], xs[u, 2], gc, bc, m2, r2)
        d3, h3 = terms(es[u, 3], xs[u, 3], gc, bc, m3, r3)
        return gc, d0, d1, d2, d3, h0, h1, h2, h3

    @column_kernel(cfg, acc_type)
    def sums(work, dy, x, g, b, mean_in, rstd_in):
        lane, w = cuda.threadIdx.x, cuda.threadIdx.y
        shared = cuda.shared.array((W, 8, 32), acc_type)
        xs = cuda.local.array((U, 4), acc_type)
        es = cuda.local.array((U, 4), acc_type)
        C, N = x.shape
        n0 = 4 * (cuda.blockIdx.x * 32 + lane)
        m0, m1, m2, m3 = column_params(mean_in, n0)
        r0, r1, r2, r3 = column_params(rstd_in, n0)
        s0 = s1 = s2 = s3 = q0 = q1 = q2 = q3 = acc_type(0)
        first = cuda.blockIdx.y * R
        end = min(C, first + R)
        for c in range(first + w, end, U * W):  # (U rows of x and dy an iteration: all loaded first)
            load_rows(xs, x, c, end, n0)
            load_rows(es, dy, c, end, n0)
            for u in range(U):
                row = c + u * W
                if row >= end:
                    break
                gc, d0, d1, d2, d3, h0, h1, h2, h3 = row_terms(xs, es, u, g, b, row, m0, m1, m2, m3, r0, r1, r2, r3)
                s0 += d0 * gc
                s1 += d1 * gc
                s2 += d2 * gc
                s3 += d3 * gc
                q0 += d0 * gc * h0
                q1 += d1 * gc * h1
                q2 += d2 * gc * h2
                q3 += d3 * gc * h3
        column_sums(work, shared, lane, w, n0, (s0, s1, s2, s3, q0, q1, q2, q3))

    @cuda.jit
    def means(m, work):
        n = cuda.grid(1)
        N = m.shape[1]
        if n >= N:
            return
        m[0, n], m[1, n] = chunk_sums(work, n)

    @column_kernel(cfg, acc_type)
    def apply(dx, gwork, dy, x, g, b, mean_in, rstd_in, sums_in):
        lane, w = cuda.threadIdx.x, cuda.threadIdx.y
        xs = cuda.local.array((U, 4), acc_type)
        es = cuda.local.array((U, 4), acc_type)
        C, N = x.shape
        n0 = 4 * (cuda.blockIdx.x * 32 + lane)
        m0, m1, m2, m3 = column_params(mean_in, n0)
        r0, r1, r2, r3 = column_params(rstd_in, n0)
        a0, a1, a2, a3 = column_params(sums_in[0], n0)
        c0, c1, c2, c3 = column_params(sums_in[1], n0)
        a0, a1, a2, a3 = a0 / acc_type(C), a1 / acc_type(C), a2 / acc_type(C), a3 / acc_type(C)  # mean(dxhat)
        c0, c1, c2, c3 = c0 / acc_type(C), c1 / acc_type(C), c2 / acc_type(C), c3 / acc_type(C)  # mean(dxhat·xhat)
        first = cuda.blockIdx.y * R
        end = min(C, first + R)
        for c in range(first + w, end, U * W):  # (U rows of x and dy an iteration: all loaded first)
            load_rows(xs, x, c, end, n0)
            load_rows(es, dy, c, end, n0)
            for u in range(U):
                row = c + u * W
                if row >= end:
                    break
                gc, d0, d1, d2, d3, h0, h1, h2, h3 = row_terms(xs, es, u, g, b, row, m0, m1, m2, m3, r0, r1, r2, r3)
                write(dx, row, n0, r0 * (d0 * gc - a0 - h0 * c0), r1 * (d1 * gc - a1 - h1 * c1),
                      r2 * (d2 * gc - a2 - h2 * c2), r3 * (d3 * gc - a3 - h3 * c3))
                tg = (d0 * h0 + d1 * h1) + (d2 * h2 + d3 * h3)  # (past the end dy read 0: no term)
                tb = (d0 + d1) + (d2 + d3)
                for offset in (16, 8, 4, 2, 1):
                    tg += cuda.shfl_down_sync(FULL_MASK, tg, offset)
                    tb += cuda.shfl_down_sync(FULL_MASK, tb, offset)
                if lane == 0:
                    gwork[cuda.blockIdx.x, 0, row] = tg
                    gwork[cuda.blockIdx.x, 1, row] = tb

    return sums, means, apply


def make_param_grads(cfg, storage, param_storage, acc_type, relu, vector=False):
    """Axis 1's dg and db: ``partials(work, dy, x, g, b, mean, rstd)`` over grid
    (`param_grid`: features / 4 threads, row chunks) into work (chunks, 2, C), a thread 4
    neighbouring features (one load of each of dy's and x's rows where ``vector``), two rows an
    iteration; then ``finish(dg, db, work)`` (`finish_launch`), which also adds axis 0's column
    blocks (`make_backward`'s gwork): a warp 32 features, the ``grad_finish_warps`` warps of a
    thread block every W-th chunk each (two chunks' loads in flight), their sums then added in
    warp order. Each feature's partial sums run in row order, as one feature a thread would; the
    finish's order is fixed too, so results repeat bitwise."""
    p_conv = converters(param_storage, acc_type)
    x_conv = converters(storage, acc_type)
    read, _ = make_group_io(x_conv, acc_type, vector)
    read_whole, _, _ = make_whole_io(x_conv, p_conv)
    params = make_param_io(p_conv, acc_type, vector)
    p_out = p_conv[1]

    @cuda.jit(device=True, inline=True)
    def terms(dy, x, mean, r, g, b):
        xhat = (x - mean) * r
        if relu and not xhat * g + b > acc_type(0):
            return acc_type(0), acc_type(0)
        return dy * xhat, dy

    T, R, W = cfg.row_threads, cfg.grad_rows, cfg.grad_finish_warps

    @cuda.jit(device=True, inline=True)
    def add_row(sums, dy, x, row, c, mean_in, rstd_in, gs, bs, whole):
        m, r = acc_type(mean_in[row]), acc_type(rstd_in[row])
        if whole:
            e0, e1, e2, e3 = read_whole(dy, row, c)
            v0, v1, v2, v3 = read_whole(x, row, c)
        else:
            e0, e1, e2, e3 = read(dy, row, c)
            v0, v1, v2, v3 = read(x, row, c)
        t0, u0 = terms(e0, v0, m, r, gs[0], bs[0])
        t1, u1 = terms(e1, v1, m, r, gs[1], bs[1])
        t2, u2 = terms(e2, v2, m, r, gs[2], bs[2])
        t3, u3 = terms(e3, v3, m, r, gs[3], bs[3])
        sums[0, 0] += t0
        sums[0, 1] += t1
        sums[0, 2] += t2
        sums[0, 3] += t3
        sums[1, 0] += u0
        sums[1, 1] += u1
        sums[1, 2] += u2
        sums[1, 3] += u3

    @cuda.jit
    def partials_rows(work, dy, x, g, b, mean_in, rstd_in):
        c = 4 * (cuda.blockIdx.x * T + cuda.threadIdx.x)
        chunk = cuda.blockIdx.y
        N, C = x.shape
        if c >= C:
            return
        g0, g1, g2, g3 = params(g, c)
        b0, b1, b2, b3 = params(b, c)
        gs, bs = (g0, g1, g2, g3), (b0, b1, b2, b3)
        sums = cuda.local.array((2, 4), acc_type)
        for j in range(4):
            sums[0, j] = acc_type(0)
            sums[1, j] = acc_type(0)
        end = min(N, chunk * R + R)
        if vector and c + 3 < C:  # (whole groups: the loop without the bounds' branches)
            for row in range(chunk * R, end - 1, 2):  # (two rows' loads in flight, added in row order)
                add_row(sums, dy, x, row, c, mean_in, rstd_in, gs, bs, True)
                add_row(sums, dy, x, row + 1, c, mean_in, rstd_in, gs, bs, True)
        else:
            for row in range(chunk * R, end - 1, 2):
                add_row(sums, dy, x, row, c, mean_in, rstd_in, gs, bs, False)
                add_row(sums, dy, x, row + 1, c, mean_in, rstd_in, gs, bs, False)
        if (end - chunk * R) % 2:
            add_row(sums, dy, x, end - 1, c, mean_in, rstd_in, gs, bs, False)
        for j in range(4):
            if c + j < C:
                work[chunk, 0, c + j] = sums[0, j]
                work[chunk, 1, c + j] = sums[1, j]

    @cuda.jit
    def finish_rows(dg, db, work):
        lane, w = cuda.threadIdx.x, cuda.threadIdx.y
        c = cuda.blockIdx.x * 32 + lane
        shared = cuda.shared.array((W, 2, 32), acc_type)
        C, n = dg.shape[0], work.shape[0]
        sg = acc_type(0)
        sb = acc_type(0)
        if c < C:
            for chunk in range(w, n - W, 2 * W):  # (chunks w, w + W: both loads, then the adds in order)
                g0, b0, g1, b1 = work[chunk, 0, c], work[chunk, 1, c], work[chunk + W, 0, c], work[chunk + W, 1, c]
                sg += g0
                sb += b0
                sg += g1
                sb += b1
            if (n - w + W - 1) // W % 2:  # (an odd count of this warp's chunks: the last alone)
                last = w + ((n - w + W - 1) // W - 1) * W
                sg += work[last, 0, c]
                sb += work[last, 1, c]
        shared[w, 0, lane] = sg
        shared[w, 1, lane] = sb
        cuda.syncthreads()
        if w == 0 and c < C:
            tg = acc_type(0)
            tb = acc_type(0)
            for k in range(W):
                tg += shared[k, 0, lane]
                tb += shared[k, 1, lane]
            dg[c] = p_out(tg)
            db[c] = p_out(tb)

    return partials_rows, finish_rows


def finish_launch(cfg, C):
    """(grid, block) of `make_param_grads`' ``finish``: a warp 32 features, ``grad_finish_warps``
    warps a thread block."""
    return -(-C // 32), (32, cfg.grad_finish_warps)


def param_grid(cfg, C, N):
    """Axis 1's ``partials`` grid (`make_param_grads`): threads of 4 features over C, row chunks."""
    return -(-C // (4 * cfg.row_threads)), max(1, -(-N // cfg.grad_rows))


def make_zeros(acc_type):
    """``zeros(a)``: a 1-D array of acc_type set to 0, a thread an element (axis 0's empty batch)."""

    @cuda.jit
    def zeros(a):
        i = cuda.grid(1)
        if i < a.shape[0]:
            a[i] = acc_type(0)

    return zeros
