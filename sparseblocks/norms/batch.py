"""Batch norm kernels (OpenAI's ``batch_norm`` and ``batch_norm_inference``), for NCHW: x (N, C, S)
flat, each channel normalized over its N·S values.

* ``stats``: a thread block a channel, two passes (the mean, then the variance summed from
  x - mean) over the channel's N runs of S contiguous values, reduced as layer norm's rows are
  (`blocks.make_block_sum`): a fixed order, so results repeat bitwise.
* ``normalize``: ``y = (x - mean[c])·rstd[c]·g[c] + b[c]``, grid-stride over every element; the
  inference form takes running mean and variance instead of the batch's.
* ``backward``: a thread block a channel: the sums of dy and dy·xhat, then
  ``dx = g·rstd·(dy - mean(dy) - xhat·mean(dy·xhat))`` in a second pass; dg and db are the sums.
"""

import math

from numba import cuda

from ..bsmm.device import converters
from .blocks import block_slots, make_block_sum


def make_batch_norm(cfg, storage, param_storage, acc_type):
    """(stats(mean, var, x, C, S), normalize(y, x, g, b, mean, var, epsilon, C, S),
    backward(dx, dg, db, dy, x, g, mean, var, epsilon, C, S))."""
    x_in, x_out = converters(storage, acc_type)
    p_in, p_out = converters(param_storage, acc_type)
    T = cfg.row_threads
    SLOTS = block_slots(T)  # (a shared array's size: a name, not an expression)
    block_sum, block_sums = make_block_sum(T, acc_type)

    @cuda.jit(device=True, inline=True)
    def at(e, c, C, S):
        """The flat index of the channel's e-th value (sample e // S, position e % S)."""
        return (e // S) * C * S + c * S + e % S

    @cuda.jit
    def stats(mean_out, var_out, x, C, S):
        c, t = cuda.blockIdx.x, cuda.threadIdx.x
        shared = cuda.shared.array((1, SLOTS), acc_type)
        count = x.shape[0] // C
        s = acc_type(0)
        for e in range(t, count, T):
            s += x_in(x[at(e, c, C, S)])
        mean = block_sum(s, shared, 0, t, 0) / acc_type(count)
        q = acc_type(0)
        for e in range(t, count, T):
            d = x_in(x[at(e, c, C, S)]) - mean
            q += d * d
        var = block_sum(q, shared, 0, t, 1) / acc_type(count)
        if t == 0:
            mean_out[c], var_out[c] = mean, var

    @cuda.jit
    def normalize(y, x, g, b, mean, var, epsilon, C, S):
        start, step = cuda.grid(1), cuda.gridsize(1)
        for e in range(start, x.shape[0], step):
            c = (e // S) % C
            r = acc_type(1) / math.sqrt(acc_type(var[c]) + acc_type(epsilon))
            y[e] = x_out((x_in(x[e]) - acc_type(mean[c])) * r * p_in(g[c]) + p_in(b[c]))

    @cuda.jit
    def backward(dx, dg, db, dy, x, g, mean_in, var_in, epsilon, C, S):
        c, t = cuda.blockIdx.x, cuda.threadIdx.x
        shared = cuda.shared.array((1, SLOTS), acc_type)
        count = x.shape[0] // C
        mean = acc_type(mean_in[c])
        r = acc_type(1) / math.sqrt(acc_type(var_in[c]) + acc_type(epsilon))
        s1 = acc_type(0)
        s2 = acc_type(0)
        for e in range(t, count, T):
            i = at(e, c, C, S)
            d = x_in(dy[i])
            s1 += d
            s2 += d * (x_in(x[i]) - mean) * r
        s1, s2 = block_sums(s1, s2, shared, 0, t)
        scale = p_in(g[c]) * r
        for e in range(t, count, T):
            i = at(e, c, C, S)
            xhat = (x_in(x[i]) - mean) * r
            dx[i] = x_out(scale * (x_in(dy[i]) - s1 / acc_type(count) - xhat * s2 / acc_type(count)))
        if t == 0:
            dg[c], db[c] = p_out(s2), p_out(s1)

    return stats, normalize, backward
