"""NumPy twin of `sparseblocks.conv`: OpenAI's block-sparse convolution, in float64, written for
reading first.

A layer's channel connectivity is a list of blocks ``BCK``: block b connects the input channels
``BCK[b][0]`` to the output channels ``BCK[b][1]`` through a dense filter ``F[b]`` of shape
``(len(ks), len(cs), T, R, S)``. Images are NCDHW (1-D and 2-D layers are 3-D ones with leading
spatial sizes of 1). An output channel that several blocks reach sums their contributions.

* `geometry(TRS, DHW, MPQ, strides, dilates, padding)`: every size as three dims (the op's own,
  `sparseblocks.conv.geometry`, checked here against torch's convolution);
* `forward(F, I, BCK, g)` (fprop): ``O[n, k, m, p, q] = sum over blocks, c, taps F[b][k, c, t, r, s]
  I[n, c, m·u - pd + t·a, ...]`` (u the stride, a the dilation, pd the padding; taps off the image
  read zeros);
* `input_grad(F, dO, BCK, g)` (bprop): the transposed convolution over the same blocks;
* `filter_grad(dO, I, BCK, g)` (updat): each present block's filter gradient;
* `edge_map(g)` and `edge_bias(O, bias, g)`: the output positions whose taps reach the padding,
  grouped by which taps do (one bias a group and output channel, OpenAI's edge bias).
"""

import numpy as np

from ..conv.geometry import edge_map, geometry  # noqa: F401 (geometry: the twin's callers take it from here)


def _taps(g, axis, tap):
    """(output positions, their input positions) along ``axis`` where tap ``tap`` lands on the image."""
    out = np.arange(g["MPQ"][axis])
    at = out * g["strides"][axis] - g["padding"][axis] + tap * g["dilates"][axis]
    keep = (at >= 0) & (at < g["DHW"][axis])
    return out[keep], at[keep]


def forward(F, I, BCK, g, K=None):
    """O (N, K, M, P, Q) of the input I (N, C, D, H, W), ``F[b]`` (len(ks), len(cs), T, R, S); K
    the output channels (the largest a block names, + 1, by default)."""
    I = np.asarray(I, np.float64)
    K = K if K is not None else 1 + max(max(ks) for _, ks in BCK)
    O = np.zeros((I.shape[0], K) + tuple(g["MPQ"]))
    for (cs, ks), f in zip(BCK, F):
        f = np.asarray(f, np.float64).reshape((len(ks), len(cs)) + tuple(g["TRS"]))
        for t, r, s in np.ndindex(*g["TRS"]):
            (m, d), (p, h), (q, w) = _taps(g, 0, t), _taps(g, 1, r), _taps(g, 2, s)
            x = I[:, list(cs)][:, :, d][:, :, :, h][:, :, :, :, w]  # (N, len(cs), |m|, |p|, |q|)
            y = np.einsum("kc,ncdhw->nkdhw", f[:, :, t, r, s], x)
            for j, k in enumerate(ks):
                O[np.ix_(np.arange(O.shape[0]), [k], m, p, q)] += y[:, j:j + 1]
    return O


def input_grad(F, dO, BCK, g, C=None):
    """dI (N, C, D, H, W) of the output gradient dO (N, K, M, P, Q): the transpose of `forward`."""
    dO = np.asarray(dO, np.float64)
    C = C if C is not None else 1 + max(max(cs) for cs, _ in BCK)
    dI = np.zeros((dO.shape[0], C) + tuple(g["DHW"]))
    for (cs, ks), f in zip(BCK, F):
        f = np.asarray(f, np.float64).reshape((len(ks), len(cs)) + tuple(g["TRS"]))
        for t, r, s in np.ndindex(*g["TRS"]):
            (m, d), (p, h), (q, w) = _taps(g, 0, t), _taps(g, 1, r), _taps(g, 2, s)
            e = dO[:, list(ks)][:, :, m][:, :, :, p][:, :, :, :, q]
            x = np.einsum("kc,nkdhw->ncdhw", f[:, :, t, r, s], e)
            for j, c in enumerate(cs):  # (a tap's input positions are distinct: += is a scatter)
                dI[np.ix_(np.arange(dI.shape[0]), [c], d, h, w)] += x[:, j:j + 1]
    return dI


def filter_grad(dO, I, BCK, g):
    """Each block's filter gradient, ``dF[b]`` (len(ks), len(cs), T, R, S)."""
    dO, I = np.asarray(dO, np.float64), np.asarray(I, np.float64)
    out = []
    for cs, ks in BCK:
        df = np.zeros((len(ks), len(cs)) + tuple(g["TRS"]))
        for t, r, s in np.ndindex(*g["TRS"]):
            (m, d), (p, h), (q, w) = _taps(g, 0, t), _taps(g, 1, r), _taps(g, 2, s)
            x = I[:, list(cs)][:, :, d][:, :, :, h][:, :, :, :, w]
            e = dO[:, list(ks)][:, :, m][:, :, :, p][:, :, :, :, q]
            df[:, :, t, r, s] = np.einsum("nkdhw,ncdhw->kc", e, x)
        out.append(df)
    return out


def edge_bias(O, bias, g):
    """O plus ``bias[k, e]`` at the positions of edge group e (`edge_map`), bias (K, groups)."""
    O = np.array(O, np.float64)
    flat = O.reshape(O.shape[0], O.shape[1], -1)
    for e, positions in enumerate(edge_map(g)):
        flat[:, :, positions] += np.asarray(bias, np.float64)[None, :, e, None]
    return flat.reshape(O.shape)


def edge_bias_grad(dO, g):
    """The bias's gradient: dO summed over the batch and each group's positions, (K, groups)."""
    flat = np.asarray(dO, np.float64).reshape(dO.shape[0], dO.shape[1], -1)
    groups = edge_map(g)
    out = np.zeros((dO.shape[1], len(groups)))
    for e, positions in enumerate(groups):
        out[:, e] = flat[:, :, positions].sum(axis=(0, 2))
    return out


def dense_filter(F, BCK, g, C, K):
    """The layer as one dense filter (K, C, T, R, S): the blocks' filters added where they sit."""
    W = np.zeros((K, C) + tuple(g["TRS"]))
    for (cs, ks), f in zip(BCK, F):
        f = np.asarray(f, np.float64).reshape((len(ks), len(cs)) + tuple(g["TRS"]))
        for j, k in enumerate(ks):
            for i, c in enumerate(cs):
                W[k, c] += f[j, i]
    return W


def l2_normalize(F, gain=None, epsilon=1e-12):
    """Each block's filter over each output channel's (C, T, R, S), to unit L2 norm, times
    ``gain`` (one value a block's output channel, blocks in order) where given."""
    out, at = [], 0
    for f in F:
        f = np.asarray(f, np.float64)
        norm = np.sqrt(np.maximum(np.sum(f * f, axis=tuple(range(1, f.ndim)), keepdims=True), epsilon))
        g = 1.0 if gain is None else np.asarray(gain, np.float64)[at:at + f.shape[0]].reshape((-1,) + (1,) * (f.ndim - 1))
        out.append(g * f / norm)
        at += f.shape[0]
    return out


def l2_normalize_grad(F, U, gain=None, epsilon=1e-12):
    """(the filters' gradients, the gain's or None) from the normalized filters' gradients U."""
    out, dgain, at = [], [], 0
    for f, u in zip(F, U):
        f, u = np.asarray(f, np.float64), np.asarray(u, np.float64)
        axes = tuple(range(1, f.ndim))
        squares = np.sum(f * f, axis=axes, keepdims=True)
        floor = np.maximum(squares, epsilon)
        g = 1.0 if gain is None else np.asarray(gain, np.float64)[at:at + f.shape[0]].reshape((-1,) + (1,) * (f.ndim - 1))
        dot = np.sum(u * f, axis=axes, keepdims=True)
        dgain.append((dot / np.sqrt(floor)).reshape(-1))
        out.append((u * g - f * (squares >= epsilon) * dot * g / floor) / np.sqrt(floor))
        at += f.shape[0]
    return out, (np.concatenate(dgain) if gain is not None else None)
