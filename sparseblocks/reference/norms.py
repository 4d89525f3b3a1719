"""NumPy twins of `sparseblocks.norms`: layer norm over either feature axis, in float64."""

import numpy as np


def _rows(a, axis):
    """``a`` as (N, C) rows of features: axis 1 as it is, axis 0 transposed."""
    return np.asarray(a, np.float64) if axis == 1 else np.asarray(a, np.float64).T


def layer_norm(x, g, b, axis=1, epsilon=1e-6, relu=False):
    """(y, mean, rstd): ``y = (x - mean)·rstd·g + b`` over the C features of each of N rows
    (x (N, C) with ``axis`` 1, (C, N) with 0; y in x's layout), ``rstd = 1/sqrt(var + epsilon)``
    with the biased variance; with ``relu`` y is max(y, 0) (NaN kept). mean and rstd are (N,)."""
    xr = _rows(x, axis)
    mean = xr.mean(axis=1)
    var = ((xr - mean[:, None]) ** 2).mean(axis=1)
    rstd = 1.0 / np.sqrt(var + epsilon)
    y = (xr - mean[:, None]) * rstd[:, None] * np.asarray(g, np.float64) + np.asarray(b, np.float64)
    if relu:
        y = np.where(y < 0, 0.0, y)
    return (y if axis == 1 else y.T), mean, rstd


def layer_norm_grad(dy, x, g, b, axis=1, epsilon=1e-6, relu=False):
    """(dx, dg, db) of `layer_norm` for the output gradient ``dy`` (x's layout): with ``relu`` the
    gradient passes where the normalized value is above 0."""
    xr, dyr, g = _rows(x, axis), _rows(dy, axis), np.asarray(g, np.float64)
    _, mean, rstd = layer_norm(x, g, b, axis, epsilon)
    xhat = (xr - mean[:, None]) * rstd[:, None]
    if relu:
        dyr = np.where(xhat * g + np.asarray(b, np.float64) > 0, dyr, 0.0)
    dxhat = dyr * g
    C = xr.shape[1]
    dx = rstd[:, None] * (dxhat - dxhat.sum(axis=1, keepdims=True) / C
                          - xhat * (dxhat * xhat).sum(axis=1, keepdims=True) / C)
    return (dx if axis == 1 else dx.T), (dyr * xhat).sum(axis=0), dyr.sum(axis=0)


def _channel_axes(x):
    return (0,) + tuple(range(2, np.ndim(x)))


def _per_channel(v, ndim):
    return np.asarray(v, np.float64).reshape((1, -1) + (1,) * (ndim - 2))


def batch_norm(x, g, b, epsilon=1e-5):
    """(y, mean, var) of NCHW batch norm: each channel over its batch and positions, biased var."""
    x = np.asarray(x, np.float64)
    axes = _channel_axes(x)
    mean, var = x.mean(axis=axes), x.var(axis=axes)
    return batch_norm_inference(x, g, b, mean, var, epsilon), mean, var


def batch_norm_inference(x, g, b, mean, var, epsilon=1e-5):
    x = np.asarray(x, np.float64)
    n = x.ndim
    return ((x - _per_channel(mean, n)) / np.sqrt(_per_channel(var, n) + epsilon) * _per_channel(g, n)
            + _per_channel(b, n))


def batch_norm_grad(dy, x, g, epsilon=1e-5):
    """(dx, dg, db) of `batch_norm` for dy."""
    x, dy = np.asarray(x, np.float64), np.asarray(dy, np.float64)
    axes, n = _channel_axes(x), x.ndim
    mean, var = x.mean(axis=axes), x.var(axis=axes)
    rstd = 1 / np.sqrt(var + epsilon)
    xhat = (x - _per_channel(mean, n)) * _per_channel(rstd, n)
    s1, s2 = dy.mean(axis=axes), (dy * xhat).mean(axis=axes)
    dx = _per_channel(np.asarray(g, np.float64) * rstd, n) * (dy - _per_channel(s1, n) - xhat * _per_channel(s2, n))
    return dx, (dy * xhat).sum(axis=axes), dy.sum(axis=axes)
