"""Layer norm over feature axis 1 (OpenAI's ``layer_norm``): the row kernels, forward and
backward, and the parameter gradients' row-chunk sums (axis 0's kernels: `columns`).

Each of N rows of C features is normalized: ``y = (x - mean)·rstd·g + b`` (then max(y, 0) with
``relu``), ``rstd = 1/sqrt(var + epsilon)``. The mean is found first and the variance summed from
``x - mean`` (two passes over the row, held in registers or in L1/L2), so a large mean costs no
accuracy. Sums run in fp32 (fp64 for fp64), in a fixed order: results repeat bitwise.

x (N, C): ``T`` threads a row, ``RB`` rows a thread block (`row_shape`). A row's threads stride
over it (consecutive threads, consecutive groups of 4 features, each group one vector load where C
is a multiple of 4 and the arrays aligned) and reduce by warp shuffles, then across the row's
warps in shared memory (`blocks.make_block_sum`); a row of one warp needs no barrier.

The backward recomputes ``xhat = (x - mean)·rstd`` from the forward's kept mean and rstd:
``dx = rstd·(dxhat - mean(dxhat) - xhat·mean(dxhat·xhat))`` with ``dxhat = dy·g`` (dy zeroed
where the forward's ReLU cut), ``dg = Σ_rows dy·xhat``, ``db = Σ_rows dy``. The parameter
gradients sum row chunks of ``grad_rows`` into a workspace, which a second kernel adds in a fixed
order (`make_param_grads`); that kernel also adds axis 0's column blocks.
"""

import math

from numba import cuda

from ..bsmm.device import converters
from ..runtime.compile import bounded
from .blocks import block_slots, make_block_sum
from .groups import make_group_io, make_normalized, make_param_io, make_passed, make_whole_io


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


def make_row_io(storage, param_storage, acc_type, vector):
    """The row kernels' group reads and writes: `make_group_io`'s (read, write), `make_whole_io`'s
    (read_whole, write_whole, params_whole) and `make_param_io`'s params, for x's and the
    parameters' storages."""
    x_conv, p_conv = converters(storage, acc_type), converters(param_storage, acc_type)
    return (*make_group_io(x_conv, acc_type, vector), *make_whole_io(x_conv, p_conv),
            make_param_io(p_conv, acc_type, vector))


def make_forward(cfg, storage, param_storage, acc_type, relu, vector, shape):
    """``forward(y, mean, rstd, x, g, b, epsilon)``, launched with blocks of ``shape[2]`` rows of
    ``shape[0]`` threads (`row_shape`: ``(T, RB)`` threads), each holding ``shape[1]`` groups of 4
    values in registers (0: reading the row in each pass instead). ``vector``: C a multiple of 4
    and every array aligned to 4 elements."""
    read, write, read_whole, write_whole, params_whole, params = make_row_io(storage, param_storage, acc_type, vector)
    normalized = make_normalized(acc_type, relu)

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


def make_backward(cfg, storage, param_storage, acc_type, relu, vector, shape):
    """``backward(dx, dy, x, g, b, mean, rstd)``, dx, launched as the forward (``shape``)."""
    read, write, read_whole, write_whole, params_whole, params = make_row_io(storage, param_storage, acc_type, vector)
    passed = make_passed(acc_type, relu)

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


def make_param_grads(cfg, storage, param_storage, acc_type, relu, vector=False):
    """Axis 1's dg and db: ``partials(work, dy, x, g, b, mean, rstd)`` over grid
    (`param_grid`: features / 4 threads, row chunks) into work (chunks, 2, C), a thread 4
    neighbouring features (one load of each of dy's and x's rows where ``vector``), two rows an
    iteration; then ``finish(dg, db, work)`` (`finish_launch`), which also adds axis 0's column
    blocks (`make_backward`'s gwork): a warp 32 features, the ``grad_finish_warps`` warps of a
    thread block every W-th chunk each (two chunks' loads in flight), their sums then added in
    warp order. Each feature's partial sums run in row order, as one feature a thread would; the
    finish's order is fixed too, so results repeat bitwise."""
    read, _, read_whole, _, _, params = make_row_io(storage, param_storage, acc_type, vector)
    p_out = converters(param_storage, acc_type)[1]

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
