"""Layer norm kernels: forward and backward over either feature axis (OpenAI's ``layer_norm``).

Each of N rows of C features is normalized: ``y = (x - mean)·rstd·g + b`` (then max(y, 0) with
``relu``), ``rstd = 1/sqrt(var + epsilon)``. The mean is found first and the variance summed from
``x - mean`` (two passes over the row, which stay in L1/L2), so a large mean costs no accuracy.
Sums run in fp32 (fp64 for fp64), in a fixed order: results repeat bitwise.

* Feature axis 1, x (N, C): a thread block a row. Its threads stride over the row (consecutive
  threads, consecutive features) and reduce by warp shuffles, then across warps in shared memory
  (`make_block_sum`).
* Feature axis 0, x (C, N): a thread a row of the normalization (a column of x), walking its C
  features; neighbouring threads read neighbouring columns, so every load is coalesced and no
  reduction crosses threads.

The backward recomputes ``xhat = (x - mean)·rstd`` from the forward's kept mean and rstd:
``dx = rstd·(dxhat - mean(dxhat) - xhat·mean(dxhat·xhat))`` with ``dxhat = dy·g`` (dy zeroed
where the forward's ReLU cut), ``dg = Σ_rows dy·xhat``, ``db = Σ_rows dy``. On axis 1 the
parameter gradients sum row chunks of ``grad_rows`` into a workspace, which a second kernel adds
in chunk order; on axis 0 a thread block sums each feature's contiguous row.
"""

import math

from numba import cuda

from ..bsmm.device import converters

FULL_MASK = 0xFFFFFFFF


def make_block_sum(threads, acc_type):
    """``block_sum(value, shared, t)``: the sum of every thread's ``value``, returned to all of them;
    ``shared`` an ``acc_type`` array of threads / 32 + 1 slots (free again when it returns)."""
    WARPS = threads // 32

    @cuda.jit(device=True, inline=True)
    def block_sum(value, shared, t):
        for offset in (16, 8, 4, 2, 1):
            value += cuda.shfl_down_sync(FULL_MASK, value, offset)
        lane, warp = t % 32, t // 32
        if lane == 0:
            shared[warp] = value
        cuda.syncthreads()
        if warp == 0:
            total = shared[lane] if lane < WARPS else acc_type(0)
            for offset in (16, 8, 4, 2, 1):
                total += cuda.shfl_down_sync(FULL_MASK, total, offset)
            if lane == 0:
                shared[WARPS] = total
        cuda.syncthreads()
        total = shared[WARPS]
        cuda.syncthreads()  # (every thread has read it before the next call writes the slots)
        return total

    return block_sum


def _normalized(acc_type, relu):
    @cuda.jit(device=True, inline=True)
    def normalized(xhat, g, b):
        v = xhat * g + b
        if relu and v < acc_type(0):  # (a NaN stays NaN)
            return acc_type(0)
        return v

    return normalized


def make_forward(cfg, storage, param_storage, acc_type, axis, relu):
    """``forward(y, mean, rstd, x, g, b, epsilon)``: launched with `forward_launch`'s grid."""
    x_in, x_out = converters(storage, acc_type)
    p_in, _ = converters(param_storage, acc_type)
    normalized = _normalized(acc_type, relu)

    if axis == 1:
        T = cfg.row_threads
        SLOTS = T // 32 + 1  # (a shared array's size: a name, not an expression)
        block_sum = make_block_sum(T, acc_type)

        @cuda.jit
        def forward_rows(y, mean_out, rstd_out, x, g, b, epsilon):
            row, t = cuda.blockIdx.x, cuda.threadIdx.x
            shared = cuda.shared.array(SLOTS, acc_type)
            C = x.shape[1]
            s = acc_type(0)
            for c in range(t, C, T):
                s += x_in(x[row, c])
            mean = block_sum(s, shared, t) / C
            q = acc_type(0)
            for c in range(t, C, T):
                d = x_in(x[row, c]) - mean
                q += d * d
            r = acc_type(1) / math.sqrt(block_sum(q, shared, t) / C + acc_type(epsilon))
            for c in range(t, C, T):
                y[row, c] = x_out(normalized((x_in(x[row, c]) - mean) * r, p_in(g[c]), p_in(b[c])))
            if t == 0:
                mean_out[row], rstd_out[row] = mean, r

        return forward_rows

    @cuda.jit
    def forward_columns(y, mean_out, rstd_out, x, g, b, epsilon):
        n = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
        C, N = x.shape
        if n >= N:
            return
        s = acc_type(0)
        for c in range(C):
            s += x_in(x[c, n])
        mean = s / C
        q = acc_type(0)
        for c in range(C):
            d = x_in(x[c, n]) - mean
            q += d * d
        r = acc_type(1) / math.sqrt(q / C + acc_type(epsilon))
        for c in range(C):
            y[c, n] = x_out(normalized((x_in(x[c, n]) - mean) * r, p_in(g[c]), p_in(b[c])))
        mean_out[n], rstd_out[n] = mean, r

    return forward_columns


def forward_launch(cfg, axis, n_rows):
    """(grid, threads) of a forward or a dx backward over ``n_rows`` rows."""
    if axis == 1:
        return n_rows, cfg.row_threads
    return -(-n_rows // cfg.column_threads), cfg.column_threads


def make_backward(cfg, storage, param_storage, acc_type, axis, relu):
    """``backward(dx, dy, x, g, b, mean, rstd)``: dx, launched with `forward_launch`'s grid."""
    x_in, x_out = converters(storage, acc_type)
    p_in, _ = converters(param_storage, acc_type)

    @cuda.jit(device=True, inline=True)
    def passed(dy, xhat, g, b):
        """dy where the forward's ReLU let the value through."""
        if relu and not xhat * g + b > acc_type(0):
            return acc_type(0)
        return dy

    if axis == 1:
        T = cfg.row_threads
        SLOTS = T // 32 + 1  # (a shared array's size: a name, not an expression)
        block_sum = make_block_sum(T, acc_type)

        @cuda.jit
        def backward_rows(dx, dy, x, g, b, mean_in, rstd_in):
            row, t = cuda.blockIdx.x, cuda.threadIdx.x
            shared = cuda.shared.array(SLOTS, acc_type)
            C = x.shape[1]
            mean, r = acc_type(mean_in[row]), acc_type(rstd_in[row])
            s1 = acc_type(0)
            s2 = acc_type(0)
            for c in range(t, C, T):
                xhat = (x_in(x[row, c]) - mean) * r
                gc = p_in(g[c])
                d = passed(x_in(dy[row, c]), xhat, gc, p_in(b[c])) * gc
                s1 += d
                s2 += d * xhat
            m1 = block_sum(s1, shared, t) / C
            m2 = block_sum(s2, shared, t) / C
            for c in range(t, C, T):
                xhat = (x_in(x[row, c]) - mean) * r
                gc = p_in(g[c])
                d = passed(x_in(dy[row, c]), xhat, gc, p_in(b[c])) * gc
                dx[row, c] = x_out(r * (d - m1 - xhat * m2))

        return backward_rows

    @cuda.jit
    def backward_columns(dx, dy, x, g, b, mean_in, rstd_in):
        n = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
        C, N = x.shape
        if n >= N:
            return
        mean, r = acc_type(mean_in[n]), acc_type(rstd_in[n])
        s1 = acc_type(0)
        s2 = acc_type(0)
        for c in range(C):
            xhat = (x_in(x[c, n]) - mean) * r
            gc = p_in(g[c])
            d = passed(x_in(dy[c, n]), xhat, gc, p_in(b[c])) * gc
            s1 += d
            s2 += d * xhat
        m1, m2 = s1 / C, s2 / C
        for c in range(C):
            xhat = (x_in(x[c, n]) - mean) * r
            gc = p_in(g[c])
            d = passed(x_in(dy[c, n]), xhat, gc, p_in(b[c])) * gc
            dx[c, n] = x_out(r * (d - m1 - xhat * m2))

    return backward_columns


def make_param_grads(cfg, storage, param_storage, acc_type, axis, relu):
    """The sums of dg and db.

    * axis 1: ``partials(work, dy, x, g, b, mean, rstd)`` over grid (features / threads, row
      chunks) into work (chunks, 2, C); then ``finish(dg, db, work)`` over features.
    * axis 0: ``partials(dg, db, dy, x, g, b, mean, rstd)``, a thread block a feature; finish None.
    """
    x_in, _ = converters(storage, acc_type)
    p_in, p_out = converters(param_storage, acc_type)

    @cuda.jit(device=True, inline=True)
    def terms(dy, x, mean, r, g, b):
        xhat = (x - mean) * r
        if relu and not xhat * g + b > acc_type(0):
            return acc_type(0), acc_type(0)
        return dy * xhat, dy

    if axis == 1:
        T, R = cfg.row_threads, cfg.grad_rows

        @cuda.jit
        def partials_rows(work, dy, x, g, b, mean_in, rstd_in):
            c = cuda.blockIdx.x * T + cuda.threadIdx.x
            chunk = cuda.blockIdx.y
            N, C = x.shape
            if c >= C:
                return
            gc, bc = p_in(g[c]), p_in(b[c])
            sg = acc_type(0)
            sb = acc_type(0)
            for row in range(chunk * R, min(N, chunk * R + R)):
                tg, tb = terms(x_in(dy[row, c]), x_in(x[row, c]), acc_type(mean_in[row]), acc_type(rstd_in[row]),
                               gc, bc)
                sg += tg
                sb += tb
            work[chunk, 0, c] = sg
            work[chunk, 1, c] = sb

        @cuda.jit
        def finish_rows(dg, db, work):
            c = cuda.blockIdx.x * T + cuda.threadIdx.x
            if c >= dg.shape[0]:
                return
            sg = acc_type(0)
            sb = acc_type(0)
            for chunk in range(work.shape[0]):  # (in chunk order: the sums repeat bitwise)
                sg += work[chunk, 0, c]
                sb += work[chunk, 1, c]
            dg[c] = p_out(sg)
            db[c] = p_out(sb)

        return partials_rows, finish_rows

    T = cfg.row_threads
    SLOTS = T // 32 + 1
    block_sum = make_block_sum(T, acc_type)

    @cuda.jit
    def partials_columns(dg, db, dy, x, g, b, mean_in, rstd_in):
        c, t = cuda.blockIdx.x, cuda.threadIdx.x
        shared = cuda.shared.array(SLOTS, acc_type)
        N = x.shape[1]
        gc, bc = p_in(g[c]), p_in(b[c])
        sg = acc_type(0)
        sb = acc_type(0)
        for n in range(t, N, T):
            tg, tb = terms(x_in(dy[c, n]), x_in(x[c, n]), acc_type(mean_in[n]), acc_type(rstd_in[n]), gc, bc)
            sg += tg
            sb += tb
        sg = block_sum(sg, shared, t)
        sb = block_sum(sb, shared, t)
        if t == 0:
            dg[c] = p_out(sg)
            db[c] = p_out(sb)

    return partials_columns, None
