"""NumPy twin of `sparseblocks.proj.SparseProj`, on (N, H) activations (feature axis 1)."""

import numpy as np


def gather(x, lut):
    return np.asarray(x, np.float64)[:, lut]


def scatter(x, lut, nhidden):
    out = np.zeros((np.shape(x)[0], nhidden))
    out[:, lut] = x
    return out


def scatter_add(x, y, lut):
    out = np.array(y, np.float64)
    out[:, lut] += x
    return out


def scatter_mul(x, y, lut):
    out = np.array(y, np.float64)
    out[:, lut] *= x
    return out


def scatter_mul_grad(dout, x, y, lut):
    """(dx, dy) of scatter_mul(x, y)."""
    dout = np.asarray(dout, np.float64)
    return dout[:, lut] * np.asarray(y, np.float64)[:, lut], scatter_mul(x, dout, lut)
