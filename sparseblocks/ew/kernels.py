"""The element-wise template: each maker wraps an op's formulas (`ops`) in a grid-stride kernel.

Arrays reach these kernels flat (1-D, C-contiguous). A binary op's operands broadcast as NumPy's
do, over up to 4 dimensions: the output's flat index is split into (i0, i1, i2, i3) and each
operand is read at its own strides, 0 along a broadcast dimension. A binary gradient is written
at the output's shape in the sums' precision, and `make_reduce_to` adds it back to an operand's
shape (a thread an operand element, summing the positions that read it, in a fixed order).
Values are converted to fp32 (fp64 for fp64) on the way in and rounded once on the way out.

Flat maps (unary ops and their gradients, binary ops of operands of one shape, ``add_n``, the
LSTM gates) have a ``vector`` variant: a thread moves 4 or 8 consecutive elements by 8- to
32-byte loads and stores (`ptx.vector`), then the last few elements one at a time. Launchers pick
it when every array's address is a multiple of 4 elements.
"""

from numba import cuda, int32, int64

from ..bsmm.device import converters
from ..norms.blocks import block_slots, make_block_sum
from ..ptx.vector import load4, store4
from .ops import make_binary, make_lstm, make_unary


@cuda.jit(device=True, inline=True)
def bounds():
    """(this thread's first element, the grid's stride) of a grid-stride loop."""
    return cuda.grid(1), cuda.gridsize(1)


def make_unary_kernel(storage, acc_type, op, vector):
    """``unary(y, x, alpha)`` and ``unary_grad(dx, dy, x, y, alpha)``."""
    to_acc, from_acc = converters(storage, acc_type)
    forward, grad = make_unary(op, acc_type, storage in ("float16", "bfloat16"))

    @cuda.jit(device=True, inline=True)
    def f(x, a):
        return from_acc(forward(to_acc(x), a))

    @cuda.jit(device=True, inline=True)
    def df(dy, x, y, a):
        return from_acc(grad(to_acc(dy), to_acc(x), to_acc(y), a))

    @cuda.jit
    def unary(y, x, alpha):
        start, step = bounds()
        n, a, first = x.shape[0], acc_type(alpha), 0
        if vector:
            quads, q = n // 4, start
            while q + step < quads:  # (two groups a thread, a grid's stride apart: both loads first)
                e, e2 = 4 * q, 4 * (q + step)
                u, v = load4(x, (e,)), load4(x, (e2,))
                store4(y, (e,), (f(u[0], a), f(u[1], a), f(u[2], a), f(u[3], a)))
                store4(y, (e2,), (f(v[0], a), f(v[1], a), f(v[2], a), f(v[3], a)))
                q += 2 * step
            if q < quads:
                u = load4(x, (4 * q,))
                store4(y, (4 * q,), (f(u[0], a), f(u[1], a), f(u[2], a), f(u[3], a)))
            first = quads * 4
        for e in range(first + start, n, step):
            y[e] = f(x[e], a)

    @cuda.jit
    def unary_grad(dx, dy, x, y, alpha):
        start, step = bounds()
        n, a, first = x.shape[0], acc_type(alpha), 0
        if vector:
            for q in range(start, n // 4, step):
                e = 4 * q
                g, u, v = load4(dy, (e,)), load4(x, (e,)), load4(y, (e,))
                store4(dx, (e,), (df(g[0], u[0], v[0], a), df(g[1], u[1], v[1], a), df(g[2], u[2], v[2], a),
                                  df(g[3], u[3], v[3], a)))
            first = n // 4 * 4
        for e in range(first + start, n, step):
            dx[e] = df(dy[e], x[e], y[e], a)

    return unary, unary_grad


@cuda.jit(device=True, inline=True)
def _split(e, d1, d2, d3):
    i3 = e % d3
    r = e // d3
    i2 = r % d2
    r //= d2
    return r // d1, r % d1, i2, i3


def make_binary_kernel(storage, acc_type, op, narrow):
    """``binary(out, a, b, d1, d2, d3, sa0..sa3, sb0..sb3)`` and
    ``binary_grad(da, db, dy, a, b, d1, d2, d3, sa0..sa3, sb0..sb3)`` (da, db at the output's shape,
    in the sums' precision). ``narrow``: every index fits 31 bits, so the index arithmetic runs in
    int32 (a 64-bit division costs several times a 32-bit one)."""
    to_acc, from_acc = converters(storage, acc_type)
    forward, grad = make_binary(op, acc_type)
    index = int32 if narrow else int64

    @cuda.jit(device=True, inline=True)
    def offsets(e, d1, d2, d3, sa0, sa1, sa2, sa3, sb0, sb1, sb2, sb3):
        i0, i1, i2, i3 = _split(index(e), index(d1), index(d2), index(d3))
        return (i0 * index(sa0) + i1 * index(sa1) + i2 * index(sa2) + i3 * index(sa3),
                i0 * index(sb0) + i1 * index(sb1) + i2 * index(sb2) + i3 * index(sb3))

    @cuda.jit
    def binary(out, a, b, d1, d2, d3, sa0, sa1, sa2, sa3, sb0, sb1, sb2, sb3):
        start, step = bounds()
        for e in range(start, out.shape[0], step):
            ia, ib = offsets(e, d1, d2, d3, sa0, sa1, sa2, sa3, sb0, sb1, sb2, sb3)
            out[e] = from_acc(forward(to_acc(a[ia]), to_acc(b[ib])))

    @cuda.jit
    def binary_grad(da, db, dy, a, b, d1, d2, d3, sa0, sa1, sa2, sa3, sb0, sb1, sb2, sb3):
        start, step = bounds()
        for e in range(start, dy.shape[0], step):
            ia, ib = offsets(e, d1, d2, d3, sa0, sa1, sa2, sa3, sb0, sb1, sb2, sb3)
            ga, gb = grad(to_acc(dy[e]), to_acc(a[ia]), to_acc(b[ib]))
            da[e] = ga
            db[e] = gb

    return binary, binary_grad


def make_binary_flat(storage, acc_type, op, vector):
    """``binary(out, a, b)`` and ``binary_grad(da, db, dy, a, b)`` of operands of the output's
    shape: flat maps, the gradients in the operands' dtype."""
    to_acc, from_acc = converters(storage, acc_type)
    forward, grad = make_binary(op, acc_type)

    @cuda.jit(device=True, inline=True)
    def f(x, y):
        return from_acc(forward(to_acc(x), to_acc(y)))

    @cuda.jit(device=True, inline=True)
    def df(dy, x, y):
        ga, gb = grad(to_acc(dy), to_acc(x), to_acc(y))
        return from_acc(ga), from_acc(gb)

    @cuda.jit
    def binary(out, a, b):
        start, step = bounds()
        n, first = out.shape[0], 0
        if vector:
            quads, q = n // 4, start
            while q + step < quads:  # (two groups a thread, a grid's stride apart: all loads first)
                e, e2 = 4 * q, 4 * (q + step)
                u, v = load4(a, (e,)), load4(b, (e,))
                w, z = load4(a, (e2,)), load4(b, (e2,))
                store4(out, (e,), (f(u[0], v[0]), f(u[1], v[1]), f(u[2], v[2]), f(u[3], v[3])))
                store4(out, (e2,), (f(w[0], z[0]), f(w[1], z[1]), f(w[2], z[2]), f(w[3], z[3])))
                q += 2 * step
            if q < quads:
                u, v = load4(a, (4 * q,)), load4(b, (4 * q,))
                store4(out, (4 * q,), (f(u[0], v[0]), f(u[1], v[1]), f(u[2], v[2]), f(u[3], v[3])))
            first = quads * 4
        for e in range(first + start, n, step):
            out[e] = f(a[e], b[e])

    @cuda.jit
    def binary_grad(da, db, dy, a, b):
        start, step = bounds()
        n, first = dy.shape[0], 0
        if vector:
            for q in range(start, n // 4, step):
                e = 4 * q
                g, u, v = load4(dy, (e,)), load4(a, (e,)), load4(b, (e,))
                r0, r1, r2, r3 = df(g[0], u[0], v[0]), df(g[1], u[1], v[1]), df(g[2], u[2], v[2]), df(g[3], u[3], v[3])
                store4(da, (e,), (r0[0], r1[0], r2[0], r3[0]))
                store4(db, (e,), (r0[1], r1[1], r2[1], r3[1]))
            first = n // 4 * 4
        for e in range(first + start, n, step):
            da[e], db[e] = df(dy[e], a[e], b[e])

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


def make_add_n(storage, acc_type, n, vector):
    """``add_n(out, x0, ..., x7)``: the sum of the first ``n`` inputs (the rest unread), in order."""
    to_acc, from_acc = converters(storage, acc_type)

    @cuda.jit(device=True, inline=True)
    def total(v0, v1, v2, v3, v4, v5, v6, v7):
        s = to_acc(v0)
        if n > 1:
            s += to_acc(v1)
        if n > 2:
            s += to_acc(v2)
        if n > 3:
            s += to_acc(v3)
        if n > 4:
            s += to_acc(v4)
        if n > 5:
            s += to_acc(v5)
        if n > 6:
            s += to_acc(v6)
        if n > 7:
            s += to_acc(v7)
        return from_acc(s)

    @cuda.jit
    def add_n(out, x0, x1, x2, x3, x4, x5, x6, x7):
        start, step = bounds()
        size, first = out.shape[0], 0
        if vector:
            for q in range(start, size // 4, step):
                e = 4 * q
                # (inputs past n are x0 again, and their loads dead code)
                v0, v1, v2, v3 = load4(x0, (e,)), load4(x1, (e,)), load4(x2, (e,)), load4(x3, (e,))
                v4, v5, v6, v7 = load4(x4, (e,)), load4(x5, (e,)), load4(x6, (e,)), load4(x7, (e,))
                store4(out, (e,), (total(v0[0], v1[0], v2[0], v3[0], v4[0], v5[0], v6[0], v7[0]),
                                   total(v0[1], v1[1], v2[1], v3[1], v4[1], v5[1], v6[1], v7[1]),
                                   total(v0[2], v1[2], v2[2], v3[2], v4[2], v5[2], v6[2], v7[2]),
                                   total(v0[3], v1[3], v2[3], v3[3], v4[3], v5[3], v6[3], v7[3])))
            first = size // 4 * 4
        for e in range(first + start, size, step):
            out[e] = total(x0[e], x1[e], x2[e], x3[e], x4[e], x5[e], x6[e], x7[e])

    return add_n


def make_cwise_linear(storage, acc_type, has_a, has_b, threads):
    """``linear(y, x, a, b, C, S)``: y = a[c]·x + b[c] for x (N, C, S) flat; and
    ``linear_grad(dx, da, db, dy, x, a, C, S)``: dx = a[c]·dy, and a thread block a channel for
    ``da[c] = Σ dy·x``, ``db[c] = Σ dy`` (a fixed order)."""
    to_acc, from_acc = converters(storage, acc_type)
    SLOTS = block_slots(threads)  # (a shared array's size: a name, not an expression)
    _, block_sums = make_block_sum(threads, acc_type)

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
        shared = cuda.shared.array((1, SLOTS), acc_type)
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
        sa, sb = block_sums(sa, sb, shared, 0, t)
        if t == 0:
            da[c] = from_acc(sa)
            db[c] = from_acc(sb)

    return linear, linear_grad


def make_lstm_kernels(storage, acc_type, vector, quads=1):
    """``gates(c_next, h, c, i, f, o, u, H, gs)`` and ``gates_grad(dc, di, df, do, du, c, i, f, o, u,
    dc_next, dh, H, gs)``: c (N, H) flat; each gate read at row·gs + column (gs = H for four gate
    tensors, 4H for one merged (N, 4H) tensor whose gates are its column quarters, already offset).
    ``vector`` (H a multiple of 4): a thread ``quads`` (1 or 2) groups of 4 consecutive columns of
    a row an iteration, two a grid's stride apart (each vector load a warp's contiguous bytes),
    both groups' loads issued before the first group's stores."""
    to_acc, from_acc = converters(storage, acc_type)
    forward, grad = make_lstm(acc_type, storage in ("float16", "bfloat16"))
    WIDE = quads == 2

    @cuda.jit(device=True, inline=True)
    def step_one(c_next, h, c, i, f, o, u, e, g):
        cn, hn = forward(to_acc(c[e]), to_acc(i[g]), to_acc(f[g]), to_acc(o[g]), to_acc(u[g]))
        c_next[e] = from_acc(cn)
        h[e] = from_acc(hn)

    @cuda.jit(device=True, inline=True)
    def gate_quad(c, i, f, o, u, e, g):
        return load4(c, (e,)), load4(i, (g,)), load4(f, (g,)), load4(o, (g,)), load4(u, (g,))

    @cuda.jit(device=True, inline=True)
    def gate_at(e, H, gs):
        """A gate's place of c's element e (its row's gates gs apart)."""
        return e if gs == H else (e // H) * gs + e % H

    @cuda.jit(device=True, inline=True)
    def forward_quad(q, c_next, h, e):
        vc, vi, vf, vo, vu = q
        r0 = forward(to_acc(vc[0]), to_acc(vi[0]), to_acc(vf[0]), to_acc(vo[0]), to_acc(vu[0]))
        r1 = forward(to_acc(vc[1]), to_acc(vi[1]), to_acc(vf[1]), to_acc(vo[1]), to_acc(vu[1]))
        r2 = forward(to_acc(vc[2]), to_acc(vi[2]), to_acc(vf[2]), to_acc(vo[2]), to_acc(vu[2]))
        r3 = forward(to_acc(vc[3]), to_acc(vi[3]), to_acc(vf[3]), to_acc(vo[3]), to_acc(vu[3]))
        store4(c_next, (e,), (from_acc(r0[0]), from_acc(r1[0]), from_acc(r2[0]), from_acc(r3[0])))
        store4(h, (e,), (from_acc(r0[1]), from_acc(r1[1]), from_acc(r2[1]), from_acc(r3[1])))

    @cuda.jit
    def gates(c_next, h, c, i, f, o, u, H, gs):
        start, step = bounds()
        if vector:
            total, q = c.shape[0] // 4, start
            if WIDE:
                while q + step < total:
                    e, e2 = 4 * q, 4 * (q + step)
                    g, g2 = gate_at(e, H, gs), gate_at(e2, H, gs)
                    first, second = gate_quad(c, i, f, o, u, e, g), gate_quad(c, i, f, o, u, e2, g2)
                    forward_quad(first, c_next, h, e)
                    forward_quad(second, c_next, h, e2)
                    q += 2 * step
            while q < total:
                e = 4 * q
                g = gate_at(e, H, gs)
                forward_quad(gate_quad(c, i, f, o, u, e, g), c_next, h, e)
                q += step
        else:
            for e in range(start, c.shape[0], step):
                step_one(c_next, h, c, i, f, o, u, e, (e // H) * gs + e % H)

    @cuda.jit(device=True, inline=True)
    def grad_quad(q, vn, vh, dc, di, df, do, du, e, g):
        vc, vi, vf, vo, vu = q
        r0 = grad(to_acc(vc[0]), to_acc(vi[0]), to_acc(vf[0]), to_acc(vo[0]), to_acc(vu[0]), to_acc(vn[0]),
                  to_acc(vh[0]))
        r1 = grad(to_acc(vc[1]), to_acc(vi[1]), to_acc(vf[1]), to_acc(vo[1]), to_acc(vu[1]), to_acc(vn[1]),
                  to_acc(vh[1]))
        r2 = grad(to_acc(vc[2]), to_acc(vi[2]), to_acc(vf[2]), to_acc(vo[2]), to_acc(vu[2]), to_acc(vn[2]),
                  to_acc(vh[2]))
        r3 = grad(to_acc(vc[3]), to_acc(vi[3]), to_acc(vf[3]), to_acc(vo[3]), to_acc(vu[3]), to_acc(vn[3]),
                  to_acc(vh[3]))
        store4(dc, (e,), (from_acc(r0[0]), from_acc(r1[0]), from_acc(r2[0]), from_acc(r3[0])))
        store4(di, (g,), (from_acc(r0[1]), from_acc(r1[1]), from_acc(r2[1]), from_acc(r3[1])))
        store4(df, (g,), (from_acc(r0[2]), from_acc(r1[2]), from_acc(r2[2]), from_acc(r3[2])))
        store4(do, (g,), (from_acc(r0[3]), from_acc(r1[3]), from_acc(r2[3]), from_acc(r3[3])))
        store4(du, (g,), (from_acc(r0[4]), from_acc(r1[4]), from_acc(r2[4]), from_acc(r3[4])))

    @cuda.jit
    def gates_grad(dc, di, df, do, du, c, i, f, o, u, dc_next, dh, H, gs):
        start, step = bounds()
        if vector:
            total, q = c.shape[0] // 4, start
            if WIDE:
                while q + step < total:
                    e, e2 = 4 * q, 4 * (q + step)
                    g, g2 = gate_at(e, H, gs), gate_at(e2, H, gs)
                    first, n1, h1 = gate_quad(c, i, f, o, u, e, g), load4(dc_next, (e,)), load4(dh, (e,))
                    second, n2, h2 = gate_quad(c, i, f, o, u, e2, g2), load4(dc_next, (e2,)), load4(dh, (e2,))
                    grad_quad(first, n1, h1, dc, di, df, do, du, e, g)
                    grad_quad(second, n2, h2, dc, di, df, do, du, e2, g2)
                    q += 2 * step
            while q < total:
                e = 4 * q
                g = gate_at(e, H, gs)
                grad_quad(gate_quad(c, i, f, o, u, e, g), load4(dc_next, (e,)), load4(dh, (e,)), dc, di, df, do,
                          du, e, g)
                q += step
        else:
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


@cuda.jit(device=True, inline=True)
def quarter(e, K):
    """(which quarter, the index in it) of element e of an (R, 4K) array's flat order."""
    row, col = e // (4 * K), e % (4 * K)
    return col // K, row * K + col % K


def make_split4(storage):
    """``split4(p0, p1, p2, p3, x, K)`` and ``concat4(x, p0, p1, p2, p3, K)``: x (R, 4K) flat and
    its four column quarters (R, K)."""

    @cuda.jit
    def split4(p0, p1, p2, p3, x, K):
        start, step = bounds()
        for e in range(start, x.shape[0], step):
            part, at = quarter(e, K)
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
            part, at = quarter(e, K)
            if part == 0:
                x[e] = p0[at]
            elif part == 1:
                x[e] = p1[at]
            elif part == 2:
                x[e] = p2[at]
            else:
                x[e] = p3[at]

    return split4, concat4
