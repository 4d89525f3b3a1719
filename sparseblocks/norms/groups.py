"""The normalizations' groups of 4 values: a row's reads and writes (one vector load or store where
the arrays allow, bounds checked or not), the parameters' reads, and the pieces of y and of the
backward's dy (the affine map and its ReLU), shared by layer norm's row (`layer`) and column
(`columns`) kernels."""

from numba import cuda

from ..ptx.vector import load4, store4


def make_normalized(acc_type, relu):
    @cuda.jit(device=True, inline=True)
    def normalized(xhat, g, b):
        v = xhat * g + b
        if relu and v < acc_type(0):  # (a NaN stays NaN)
            return acc_type(0)
        return v

    return normalized


def make_passed(acc_type, relu):
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
