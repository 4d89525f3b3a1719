"""NumPy twins of `sparseblocks.ew`, in float64: the element-wise ops and their gradients."""

import numpy as np

def _f(a):
    return np.asarray(a, np.float64)


def _sigmoid(x):
    with np.errstate(over="ignore"):
        return 1.0 / (1.0 + np.exp(-x))


UNARY = {
    "negative": (lambda x, a: -x, lambda dy, x, y, a: -dy),
    "reciprocal": (lambda x, a: 1.0 / x, lambda dy, x, y, a: -dy * y * y),
    "square": (lambda x, a: x * x, lambda dy, x, y, a: 2.0 * x * dy),
    "sqrt": (lambda x, a: np.sqrt(x), lambda dy, x, y, a: dy * 0.5 / y),
    "exp": (lambda x, a: np.exp(x), lambda dy, x, y, a: dy * y),
    "log": (lambda x, a: np.log(x), lambda dy, x, y, a: dy / x),
    "sigmoid": (lambda x, a: _sigmoid(x), lambda dy, x, y, a: dy * y * (1.0 - y)),
    "tanh": (lambda x, a: np.tanh(x), lambda dy, x, y, a: dy * (1.0 - y * y)),
    "relu": (lambda x, a: np.where(x < 0, 0.0, x), lambda dy, x, y, a: np.where(x > 0, dy, 0.0)),
    "elu": (lambda x, a: np.where(x > 0, x, a * np.expm1(np.minimum(x, 0))),
            lambda dy, x, y, a: np.where(x > 0, dy, dy * (y + a))),
}

BINARY = {
    "add": (np.add, lambda dy, a, b: (dy, dy)),
    "subtract": (np.subtract, lambda dy, a, b: (dy, -dy)),
    "multiply": (np.multiply, lambda dy, a, b: (dy * b, dy * a)),
    "divide": (np.divide, lambda dy, a, b: (dy / b, -dy * a / (b * b))),
    "maximum": (np.maximum, lambda dy, a, b: (np.where(a == b, dy / 2, np.where(a > b, dy, 0.0)),
                                              np.where(a == b, dy / 2, np.where(a > b, 0.0, dy)))),
    "minimum": (np.minimum, lambda dy, a, b: (np.where(a == b, dy / 2, np.where(a < b, dy, 0.0)),
                                              np.where(a == b, dy / 2, np.where(a < b, 0.0, dy)))),
}


def unary(op, x, alpha=1.0):
    with np.errstate(all="ignore"):
        return UNARY[op][0](_f(x), alpha)


def unary_grad(op, dy, x, alpha=1.0):
    with np.errstate(all="ignore"):
        x = _f(x)
        return UNARY[op][1](_f(dy), x, UNARY[op][0](x, alpha), alpha)


def _sum_to(g, shape):
    """``g`` summed over the dimensions broadcasting added or stretched, to ``shape``."""
    g = g.sum(axis=tuple(range(g.ndim - len(shape)))) if g.ndim > len(shape) else g
    return g.sum(axis=tuple(k for k, n in enumerate(shape) if n == 1 and g.shape[k] != 1), keepdims=True) \
        .reshape(shape)


def binary(op, a, b):
    with np.errstate(all="ignore"):
        return BINARY[op][0](_f(a), _f(b))


def binary_grad(op, dy, a, b):
    a, b = _f(a), _f(b)
    shape = np.broadcast_shapes(a.shape, b.shape)
    with np.errstate(all="ignore"):
        da, db = BINARY[op][1](_f(dy), np.broadcast_to(a, shape), np.broadcast_to(b, shape))
    return _sum_to(np.broadcast_to(da, shape), a.shape), _sum_to(np.broadcast_to(db, shape), b.shape)


def add_n(xs):
    return sum(_f(x) for x in xs)


def cwise_linear(x, a=None, b=None):
    x = _f(x)
    shape = (1, -1) + (1,) * (x.ndim - 2)
    y = x * _f(a).reshape(shape) if a is not None else x
    return y + _f(b).reshape(shape) if b is not None else y


def cwise_linear_grad(dy, x, a=None):
    dy, x = _f(dy), _f(x)
    axes = (0,) + tuple(range(2, x.ndim))
    dx = dy * _f(a).reshape((1, -1) + (1,) * (x.ndim - 2)) if a is not None else dy
    return dx, (dy * x).sum(axis=axes), dy.sum(axis=axes)


def _gates(gates):
    return [_f(g) for g in gates] if len(gates) == 4 else np.split(_f(gates[0]), 4, axis=1)


def fused_lstm_gates(c, *gates):
    i, f, o, u = _gates(gates)
    c_next = _sigmoid(f) * _f(c) + _sigmoid(i) * np.tanh(u)
    return c_next, _sigmoid(o) * np.tanh(c_next)


def fused_lstm_gates_grad(c, *gates, dc_next, dh):
    i, f, o, u = _gates(gates)
    c = _f(c)
    si, sf, so, tu = _sigmoid(i), _sigmoid(f), _sigmoid(o), np.tanh(u)
    tc = np.tanh(sf * c + si * tu)
    dc_total = _f(dc_next) + _f(dh) * so * (1 - tc * tc)
    grads = [dc_total * tu * si * (1 - si), dc_total * c * sf * (1 - sf), _f(dh) * tc * so * (1 - so),
             dc_total * si * (1 - tu * tu)]
    return (dc_total * sf, *(grads if len(gates) == 4 else [np.concatenate(grads, axis=1)]))


def split4(x):
    return tuple(np.split(_f(x), 4, axis=-1))


def concat4(*parts):
    return np.concatenate([_f(p) for p in parts], axis=-1)


def dropout_keep(n, keep_prob, seed=0, offset=0):
    """The keep bits of `sparseblocks.ew.dropout` for n elements: word e % 4 of Philox((e // 4,
    offset); seed) below keep_prob · 2³²."""
    from .philox import philox

    g = np.arange(-(-n // 4), dtype=np.int64)
    words = np.stack(philox(g & 0xFFFFFFFF, g >> 32, offset & 0xFFFFFFFF, offset >> 32, seed & 0xFFFFFFFF, seed >> 32),
                     axis=1).reshape(-1)[:n]
    return words.astype(np.uint64) < np.uint64(min(int(keep_prob * 2.0 ** 32), 2 ** 32))


def pack_bits(keep):
    """Bit e % 32 of uint32 word e // 32: the packed mask."""
    keep = np.asarray(keep, bool).reshape(-1)
    padded = np.zeros(-(-keep.size // 32) * 32, bool)
    padded[:keep.size] = keep
    return (padded.reshape(-1, 32).astype(np.uint64) << np.arange(32, dtype=np.uint64)).sum(axis=1).astype(np.uint32)


def dropout(x, keep_prob, seed=0, offset=0, keep=None):
    """(y, keep): x·keep / keep_prob, with the keep bits of `dropout_keep` (or ``keep`` given)."""
    x = _f(x)
    keep = dropout_keep(x.size, keep_prob, seed, offset) if keep is None else np.asarray(keep, bool).reshape(-1)
    return np.where(keep.reshape(x.shape), x / keep_prob, 0.0), keep
