"""The element-wise template: each maker wraps an op's formulas (`ops`) in a grid-stride kernel.

Arrays reach these kernels flat (1-D, C-contiguous). A binary op's operands broadcast as NumPy's
do, over up to 4 dimensions: the output's flat index is split into (i0, i1, i2, i3) and each
operand is read at its own strides, 0 along a broadcast dimension. A binary gradient is written
at the output's shape in the sums' precision, and `make_reduce_to` adds it back to an operand's
shape (a thread an operand element, summing the positions that read it, in a fixed order).
Values are converted to fp32 (fp64 for fp64) on the way in and rounded once on the way out.
"""

from numba import cuda

from ..bsmm.device import converters
from ..norms.layer import make_block_sum
from .ops import make_binary, make_lstm, make_unary


@cuda.jit(device=True, inline=True)
def bounds():
    """(this thread's first element, the grid's stride) of a grid-stride loop."""
    return cuda.grid(1), cuda.gridsize(1)


def make_unary_kernel(storage, acc_type, op):
    """``unary(y, x, alpha)`` and ``unary_grad(dx, dy, x, y, alpha)``."""
    to_acc, from_acc = converters(storage, acc_type)
    forward, grad = make_unary(op, acc_type)

    @cuda.jit
    def unary(y, x, alpha):
        start, step = bounds()
        for e in range(start, x.shape[0], step):
            y[e] = from_acc(forward(to_acc(x[e]), acc_type(alpha)))

    @cuda.jit
    def unary_grad(dx, dy, x, y, alpha):
        start, step = bounds()
        for e in range(start, x.shape[0], step):
            dx[e] = from_acc(grad(to_acc(dy[e]), to_acc(x[e]), to_acc(y[e]), acc_type(alpha)))

    return unary, unary_grad


@cuda.jit(device=True, inline=True)
def _split(e, d1, d2, d3):
    i3 = e % d3
    r = e // d3
    i2 = r % d2
    r //= d2
    return r // d1, r % d1, i2, i3


def make_binary_kernel(storage, acc_type, op):
    """``binary(out, a, b, d1, d2, d3, sa0..sa3, sb0..sb3)`` and
    ``binary_grad(da, db, dy, a, b, d1, d2, d3, sa0..sa3, sb0..sb3)`` (da, db at the output's shape,
    in the sums' precision)."""
    to_acc, from_acc = converters(storage, acc_type)
    forward, grad = make_binary(op, acc_type)

    @cuda.jit
    def binary(out, a, b, d1, d2, d3, sa0, sa1, sa2, sa3, sb0, sb1, sb2, sb3):
        start, step = bounds()
        for e in range(start, out.shape[0], step):
            i0, i1, i2, i3 = _split(e, d1, d2, d3)
            x = to_acc(a[i0 * sa0 + i1 * sa1 + i2 * sa2 + i3 * sa3])
            y = to_acc(b[i0 * sb0 + i1 * sb1 + i2 * sb2 + i3 * sb3])
            out[e] = from_acc(forward(x, y))

    @cuda.jit
    def binary_grad(da, db, dy, a, b, d1, d2, d3, sa0, sa1, sa2, sa3, sb0, sb1, sb2, sb3):
        start, step = bounds()
        for e in range(start, dy.shape[0], step):
            i0, i1, i2, i3 = _split(e, d1, d2, d3)
            x = to_acc(a[i0 * sa0 + i1 * sa1 + i2 * sa2 + i3 * sa3])
            y = to_acc(b[i0 * sb0 + i1 * sb1 + i2 * sb2 + i3 * sb3])
            ga, gb = grad(to_acc(dy[e]), x, y)
            da[e] = ga
            db[e] = gb

    return binary, binary_grad


def make_reduce_to(storage, acc_type):
    """``reduce_to(out, full, s1, s2, s3, r0, r1, r2, r3, d1, d2, d3)``: out (an operand's padded
    4-D shape s0..s3, flat) = the sum of ``full`` (the output's shape d0..d3, flat) over the
    dimensions the operand was broadcast along (r_k: their extents, else 1)."""
    _, from_acc = converters(storage, acc_type)

    @cuda.jit
    def reduce_to(out, full, s1, s2, s3, r0, r1, r2, r3, d1, d2, d3):
        start, step = bounds()
        for e in range(start, out.shape[0], step):
            j0, j1, j2, j3 = _split(e, s1, s2, s3)
            total = acc_type(0)
            for k0 in range(r0):
                for k1 in range(r1):
                    for k2 in range(r2):
                        for k3 in range(r3):
                            i0, i1, i2, i3 = j0 + k0, j1 + k1, j2 + k2, j3 + k3
                            total += full[((i0 * d1 + i1) * d2 + i2) * d3 + i3]
            out[e] = from_acc(total)

    return reduce_to


def make_add_n(storage, acc_type, n):
    """``add_n(out, x0, ..., x7)``: the sum of the first ``n`` inputs (the rest unread), in order."""
    to_acc, from_acc = converters(storage, acc_type)

    @cuda.jit
    def add_n(out, x0, x1, x2, x3, x4, x5, x6, x7):
        start, step = bounds()
        for e in range(start, out.shape[0], step):
            total = to_acc(x0[e])
            if n > 1:
                total += to_acc(x1[e])
            if n > 2:
                total += to_acc(x2[e])
            if n > 3:
                total += to_acc(x3[e])
            if n > 4:
                total += to_acc(x4[e])
            if n > 5:
                total += to_acc(x5[e])
            if n > 6:
                total += to_acc(x6[e])
            if n > 7:
                total += to_acc(x7[e])
            out[e] = from_acc(total)

    return add_n


def make_cwise_linear(storage, acc_type, has_a, has_b, threads):
    """``linear(y, x, a, b, C, S)``: y = a[c]·x + b[c] for x (N, C, S) flat; and
    ``linear_grad(dx, da, db, dy, x, a, C, S)``: dx = a[c]·dy, and a thread block a channel for
    ``da[c] = Σ dy·x``, ``db[c] = Σ dy`` (a fixed order)."""
    to_acc, from_acc = converters(storage, acc_type)
    SLOTS = threads // 32 + 1  # (a shared array's size: a name, not an expression)
    block_sum = make_block_sum(threads, acc_type)

    @cuda.jit
    def linear(y, x, a, b, C, S):
        start, step = bounds()
        for e in range(start, x.shape[0], step):
            c = (e // S) % C
            v = to_acc(x[e])
            if has_a:
                v *= to_acc(a[c])
            if has_b:
                v += to_acc(b[c])
            y[e] = from_acc(v)

    @cuda.jit
    def linear_grad(dx, da, db, dy, x, a, C, S):
        c, t = cuda.blockIdx.x, cuda.threadIdx.x
        shared = cuda.shared.array(SLOTS, acc_type)
        N = x.shape[0] // (C * S)
        scale = to_acc(a[c]) if has_a else acc_type(1)
        sa = acc_type(0)
        sb = acc_type(0)
        for e in range(t, N * S, threads):
            at = (e // S) * C * S + c * S + e % S
            g = to_acc(dy[at])
            dx[at] = from_acc(g * scale)
            sa += g * to_acc(x[at])
            sb += g
        sa = block_sum(sa, shared, t)
        sb = block_sum(sb, shared, t)
        if t == 0:
            da[c] = from_acc(sa)
            db[c] = from_acc(sb)

    return linear, linear_grad


def make_lstm_kernels(storage, acc_type):
    """``gates(c_next, h, c, i, f, o, u, H, gs)`` and ``gates_grad(dc, di, df, do, du, c, i, f, o, u,
    dc_next, dh, H, gs)``: c (N, H) flat; each gate read at row·gs + column (gs = H for four gate
    tensors, 4H for one merged (N, 4H) tensor whose gates are its column quarters, already offset)."""
    to_acc, from_acc = converters(storage, acc_type)
    forward, grad = make_lstm(acc_type)

    @cuda.jit
    def gates(c_next, h, c, i, f, o, u, H, gs):
        start, step = bounds()
        for e in range(start, c.shape[0], step):
            g = (e // H) * gs + e % H
            cn, hn = forward(to_acc(c[e]), to_acc(i[g]), to_acc(f[g]), to_acc(o[g]), to_acc(u[g]))
            c_next[e] = from_acc(cn)
            h[e] = from_acc(hn)

    @cuda.jit
    def gates_grad(dc, di, df, do, du, c, i, f, o, u, dc_next, dh, H, gs):
        start, step = bounds()
        for e in range(start, c.shape[0], step):
            g = (e // H) * gs + e % H
            gc, gi, gf, go, gu = grad(to_acc(c[e]), to_acc(i[g]), to_acc(f[g]), to_acc(o[g]), to_acc(u[g]),
                                      to_acc(dc_next[e]), to_acc(dh[e]))
            dc[e] = from_acc(gc)
            di[g] = from_acc(gi)
            df[g] = from_acc(gf)
            do[g] = from_acc(go)
            du[g] = from_acc(gu)

    return gates, gates_grad


def make_split4(storage):
    """``split4(p0, p1, p2, p3, x, K)`` and ``concat4(x, p0, p1, p2, p3, K)``: x (R, 4K) flat and
    its four column quarters (R, K)."""

    @cuda.jit
    def split4(p0, p1, p2, p3, x, K):
        start, step = bounds()
        for e in range(start, x.shape[0], step):
            row, col = e // (4 * K), e % (4 * K)
            part, at = col // K, row * K + col % K
            if part == 0:
                p0[at] = x[e]
            elif part == 1:
                p1[at] = x[e]
            elif part == 2:
                p2[at] = x[e]
            else:
                p3[at] = x[e]

    @cuda.jit
    def concat4(x, p0, p1, p2, p3, K):
        start, step = bounds()
        for e in range(start, x.shape[0], step):
            row, col = e // (4 * K), e % (4 * K)
            part, at = col // K, row * K + col % K
            if part == 0:
                x[e] = p0[at]
            elif part == 1:
                x[e] = p1[at]
            elif part == 2:
                x[e] = p2[at]
            else:
                x[e] = p3[at]

    return split4, concat4
