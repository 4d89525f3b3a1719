"""Layer norm over feature axis 0 (OpenAI's ``layer_norm`` on x (C, N), the activations' layout
of `bsmm` with ``feature_axis=0``): the column kernels, forward and backward.

A thread takes 4 neighbouring columns of x (4 rows of the normalization), a warp 128 columns, the
block's warps a row of features each in turn, ``column_unroll`` rows' loads in flight before the
first is used (`make_column_loads`). Three launches: the column sums over chunks of
``column_rows`` features into a workspace (from a shift, each column's first value, so that a
large mean costs no accuracy: ``Σ(x - x₀)`` and ``Σ(x - x₀)²``), the mean and rstd from the
chunks' sums in order, then y. The backward's column sums of ``dxhat`` and ``dxhat·xhat`` take
the same three launches, and the kernel that writes dx also sums dg's and db's terms over its 128
columns (a workspace of column blocks, which `layer.make_param_grads`' finish adds in order).
"""

import math

from numba import cuda

from ..bsmm.device import converters
from ..runtime.compile import bounded
from .blocks import FULL_MASK
from .groups import make_group_io, make_normalized, make_param_io, make_passed

COLUMNS = 128  # columns of x a warp covers (4 a lane)


def column_blocks(cfg, acc_type):
    """Thread blocks of ``column_warps`` warps a multiprocessor axis 0's sums and apply kernels are
    bounded for: ``column_blocks``, at most 2048 threads' worth; 0, no bound (and for fp64 sums)."""
    return min(cfg.column_blocks, 64 // cfg.column_warps) if acc_type.bitwidth == 32 else 0


def column_kernel(cfg, acc_type):
    """Axis 0's column kernels' decorator: launch bounds of `column_blocks`, as `row_kernel`'s."""
    blocks = column_blocks(cfg, acc_type)
    return bounded(32 * cfg.column_warps, blocks) if blocks else cuda.jit


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


def make_tile_of(reverse):
    """``tile_of() -> (column block, feature chunk)`` of an apply kernel's thread block: the sums'
    launch order, or with ``reverse`` (``column_reverse``) the last of it first, so that the x an
    apply reads first is the x the sums read last, the likeliest still in L2."""

    @cuda.jit(device=True, inline=True)
    def tile_of():
        if reverse:
            return cuda.gridDim.x - 1 - cuda.blockIdx.x, cuda.gridDim.y - 1 - cuda.blockIdx.y
        return cuda.blockIdx.x, cuda.blockIdx.y

    return tile_of


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


def stats_io(acc_type, vector):
    """`make_param_io` for the fp32 (fp64) per-column statistics."""
    return make_param_io(converters("float64" if acc_type.bitwidth == 64 else "float32", acc_type), acc_type, vector)


def column_parts(cfg, acc_type, read, vector):
    """What both makers' kernels share: (`make_column_sums`, the statistics' reads (`stats_io`),
    `make_chunk_sums`, `make_column_loads`, `make_tile_of`), for ``cfg``'s warps, rows in flight
    and apply order."""
    W = cfg.column_warps
    return (make_column_sums(W, acc_type), stats_io(acc_type, vector), make_chunk_sums(acc_type),
            make_column_loads(cfg.column_unroll, W, read), make_tile_of(cfg.column_reverse))


def make_forward(cfg, storage, param_storage, acc_type, relu, vector):
    """(``sums(work, x)``, ``stats(mean, rstd, work, x, epsilon)``, ``apply(y, x, g, b, mean,
    rstd)``), launched with `column_launch`'s grids. ``vector``: N a multiple of 4 and every array
    aligned to 4 elements."""
    x_conv = converters(storage, acc_type)
    x_in = x_conv[0]
    p_in = converters(param_storage, acc_type)[0]
    read, write = make_group_io(x_conv, acc_type, vector)
    normalized = make_normalized(acc_type, relu)

    W, R, U = cfg.column_warps, cfg.column_rows, cfg.column_unroll
    column_sums, column_params, chunk_sums, load_rows, tile_of = column_parts(cfg, acc_type, read, vector)

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
        strip, chunk = tile_of()
        held = cuda.local.array((U, 4), acc_type)
        C, N = x.shape
        n0 = 4 * (strip * 32 + lane)
        m0, m1, m2, m3 = column_params(mean_in, n0)
        r0, r1, r2, r3 = column_params(rstd_in, n0)
        first = chunk * R
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


def column_launch(cfg, C, N):
    """x (C, N): (grid, block) of the column kernels (sums, apply), and (grid, threads) of the
    stats kernel."""
    return ((-(-N // COLUMNS), -(-C // cfg.column_rows)), (32, cfg.column_warps)), (-(-N // 256), 256)


def make_backward(cfg, storage, param_storage, acc_type, relu, vector):
    """(``sums(work, dy, x, g, b, mean, rstd)``, ``means(m, work)``, ``apply(dx, gwork, dy, x, g,
    b, mean, rstd, m)``), with `column_launch`'s grids (means: the stats kernel's); apply's gwork
    (column blocks, 2, C) takes dg's and db's terms summed over each block's columns."""
    p_in = converters(param_storage, acc_type)[0]
    read, write = make_group_io(converters(storage, acc_type), acc_type, vector)
    passed = make_passed(acc_type, relu)

    W, R, U = cfg.column_warps, cfg.column_rows, cfg.column_unroll
    column_sums, column_params, chunk_sums, load_rows, tile_of = column_parts(cfg, acc_type, read, vector)

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
        strip, chunk = tile_of()
        xs = cuda.local.array((U, 4), acc_type)
        es = cuda.local.array((U, 4), acc_type)
        C, N = x.shape
        n0 = 4 * (strip * 32 + lane)
        m0, m1, m2, m3 = column_params(mean_in, n0)
        r0, r1, r2, r3 = column_params(rstd_in, n0)
        a0, a1, a2, a3 = column_params(sums_in[0], n0)
        c0, c1, c2, c3 = column_params(sums_in[1], n0)
        a0, a1, a2, a3 = a0 / acc_type(C), a1 / acc_type(C), a2 / acc_type(C), a3 / acc_type(C)  # mean(dxhat)
        c0, c1, c2, c3 = c0 / acc_type(C), c1 / acc_type(C), c2 / acc_type(C), c3 / acc_type(C)  # mean(dxhat·xhat)
        first = chunk * R
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
                    gwork[strip, 0, row] = tg
                    gwork[strip, 1, row] = tb

    return sums, means, apply
