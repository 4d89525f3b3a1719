"""The element-wise ops' formulas: one line each, forward and gradient, in the sums' precision.

Every op is a pair of device functions of accumulator values (fp32; fp64 for fp64), which the
one template in `kernels.py` wraps in a kernel: the table below is the whole of an op. The
functions of values the simulator evaluates with Python's ``math`` (which raises where the GPU
returns inf or NaN) go through `exp`, `log` and `sqrt` here, which give the GPU's answers.
"""

import math

from numba import cuda, float32, float64
from numba.cuda import libdevice

UNARY = ("negative", "reciprocal", "square", "sqrt", "exp", "log", "sigmoid", "tanh", "relu", "elu")
BINARY = ("add", "subtract", "multiply", "divide", "maximum", "minimum")
EXP_LIMIT = {float32: 88.72283, float64: 709.782712893384}  # the largest x with a finite exp(x)


def make_math(acc_type, fast=False):
    """(exp, log, sqrt) of acc values, inf and NaN where IEEE arithmetic gives them."""
    LIMIT = EXP_LIMIT[acc_type]

    @cuda.jit(device=True, inline=True)
    def exp(x):
        if x > acc_type(LIMIT):
            return acc_type(math.inf)
        if fast:
            return acc_type(libdevice.fast_expf(float32(x)))
        return acc_type(math.exp(x))

    @cuda.jit(device=True, inline=True)
    def log(x):
        if x > 0:
            return acc_type(math.log(x))
        if x == 0:
            return acc_type(-math.inf)
        return acc_type(math.nan)  # (negative, or NaN)

    @cuda.jit(device=True, inline=True)
    def sqrt(x):
        if x >= 0:
            return acc_type(math.sqrt(x))
        return acc_type(math.nan)

    return exp, log, sqrt


def make_curves(acc_type, fast=False):
    """(sigmoid, tanh) of acc values; approximate with ``fast`` (see the module's note). Both run
    one path for every value, the cases chosen by a select after it, so that a warp whose values
    differ in sign (or size) does not run two paths one after the other (the LSTM gates take five
    curves a value)."""
    exp, _, _ = make_math(acc_type, fast)
    one, two, small, third, cap = acc_type(1), acc_type(2), acc_type(2.0 ** -5), acc_type(1 / 3), acc_type(20)

    @cuda.jit(device=True, inline=True)
    def ratio(a, b):
        if fast:
            return acc_type(libdevice.fast_fdividef(float32(a), float32(b)))
        return a / b

    @cuda.jit(device=True, inline=True)
    def sigmoid(x):  # (exp of a non-positive value only: no overflow)
        e = exp(-abs(x))
        s = ratio(one, one + e)
        return s if x >= 0 else e * s

    @cuda.jit(device=True, inline=True)
    def tanh(x):
        if not fast:
            return acc_type(math.tanh(x))
        # (e^{2x} capped at e^20: 1 - 2 / (1 + e^20) rounds to 1 in every 16-bit format and fp32;
        # a compare and select, so that NaN stays NaN)
        twice = two * x
        t = one - ratio(two, one + exp(cap if twice > cap else twice))
        return x - x * x * x * third if abs(x) < small else t

    return sigmoid, tanh


def make_unary(op, acc_type, fast=False):
    """(forward(x, alpha) -> y, grad(dy, x, y, alpha) -> dx) of a unary op."""
    exp, log, sqrt = make_math(acc_type, fast)
    sigmoid, tanh = make_curves(acc_type, fast)
    one, zero, half = acc_type(1), acc_type(0), acc_type(0.5)

    forward_of = {
        "negative": lambda x, a: -x,
        "reciprocal": lambda x, a: one / x,
        "square": lambda x, a: x * x,
        "sqrt": lambda x, a: sqrt(x),
        "exp": lambda x, a: exp(x),
        "log": lambda x, a: log(x),
        "sigmoid": lambda x, a: sigmoid(x),
        "tanh": lambda x, a: tanh(x),
        "relu": lambda x, a: zero if x < zero else x,  # (NaN kept)
        "elu": lambda x, a: x if x > zero else a * (exp(x) - one),
    }
    grad_of = {
        "negative": lambda dy, x, y, a: -dy,
        "reciprocal": lambda dy, x, y, a: -dy * y * y,
        "square": lambda dy, x, y, a: acc_type(2) * x * dy,
        "sqrt": lambda dy, x, y, a: dy * half / y,
        "exp": lambda dy, x, y, a: dy * y,
        "log": lambda dy, x, y, a: dy / x,
        "sigmoid": lambda dy, x, y, a: dy * y * (one - y),
        "tanh": lambda dy, x, y, a: dy * (one - y * y),
        "relu": lambda dy, x, y, a: dy if x > zero else zero,
        "elu": lambda dy, x, y, a: dy if x > zero else dy * (y + a),
    }
    return cuda.jit(device=True, inline=True)(forward_of[op]), cuda.jit(device=True, inline=True)(grad_of[op])


def make_binary(op, acc_type):
    """(forward(a, b) -> y, grad(dy, a, b) -> (da, db)) of a binary op. maximum and minimum
    propagate NaN and split the gradient of a tie evenly, as torch does."""
    zero, half = acc_type(0), acc_type(0.5)

    @cuda.jit(device=True, inline=True)
    def larger(a, b):
        if a != a or b != b:
            return a + b  # (NaN)
        return a if a >= b else b

    @cuda.jit(device=True, inline=True)
    def smaller(a, b):
        if a != a or b != b:
            return a + b
        return a if a <= b else b

    @cuda.jit(device=True, inline=True)
    def pick(dy, a, b, first_wins):
        if a == b:
            return dy * half, dy * half
        if first_wins:
            return dy, zero
        return zero, dy

    forward_of = {
        "add": lambda a, b: a + b,
        "subtract": lambda a, b: a - b,
        "multiply": lambda a, b: a * b,
        "divide": lambda a, b: a / b,
        "maximum": lambda a, b: larger(a, b),
        "minimum": lambda a, b: smaller(a, b),
    }
    grad_of = {
        "add": lambda dy, a, b: (dy, dy),
        "subtract": lambda dy, a, b: (dy, -dy),
        "multiply": lambda dy, a, b: (dy * b, dy * a),
        "divide": lambda dy, a, b: (dy / b, -dy * a / (b * b)),
        "maximum": lambda dy, a, b: pick(dy, a, b, a > b),
        "minimum": lambda dy, a, b: pick(dy, a, b, a < b),
    }
    return cuda.jit(device=True, inline=True)(forward_of[op]), cuda.jit(device=True, inline=True)(grad_of[op])


def make_lstm(acc_type, fast=False):
    """(forward(c, i, f, o, u) -> (c_next, h), grad(c, i, f, o, u, dc_next, dh) -> (dc, di, df, do,
    du)) of OpenAI's ``fused_lstm_gates``: ``c_next = σ(f)·c + σ(i)·tanh(u)``, ``h = σ(o)·tanh(c_next)``
    (i, f, o, u the gates' pre-activations)."""
    sigmoid, tanh = make_curves(acc_type, fast)
    one = acc_type(1)

    @cuda.jit(device=True, inline=True)
    def forward(c, i, f, o, u):
        c_next = sigmoid(f) * c + sigmoid(i) * tanh(u)
        return c_next, sigmoid(o) * tanh(c_next)

    @cuda.jit(device=True, inline=True)
    def grad(c, i, f, o, u, dc_next, dh):
        si, sf, so, tu = sigmoid(i), sigmoid(f), sigmoid(o), tanh(u)
        c_next = sf * c + si * tu
        tc = tanh(c_next)
        dc_total = dc_next + dh * so * (one - tc * tc)
        return (dc_total * sf, dc_total * tu * si * (one - si), dc_total * c * sf * (one - sf),
                dh * tc * so * (one - so), dc_total * si * (one - tu * tu))

    return forward, grad
