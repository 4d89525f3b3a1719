"""NumPy twin of `sparseblocks.conv`: OpenAI's block-sparse convolution, in float64, written for
reading first.

A layer's channel connectivity is a list of blocks ``BCK``: block b connects the input channels
``BCK[b][0]`` to the output channels ``BCK[b][1]`` through a dense filter ``F[b]`` of shape
``(len(ks), len(cs), T, R, S)``. Images are NCDHW (1-D and 2-D layers are 3-D ones with leading
spatial sizes of 1). An output channel that several blocks reach sums their contributions.

* `geometry(TRS, DHW, MPQ, strides, dilates, padding)`: every size as three dims;
* `forward(F, I, BCK, g)` (fprop): ``O[n, k, m, p, q] = sum over blocks, c, taps F[b][k, c, t, r, s]
  I[n, c, m·u - pd + t·a, ...]`` (u the stride, a the dilation, pd the padding; taps off the image
  read zeros);
* `input_grad(F, dO, BCK, g)` (bprop): the transposed convolution over the same blocks;
* `filter_grad(dO, I, BCK, g)` (updat): each present block's filter gradient;
* `edge_map(g)` and `edge_bias(O, bias, g)`: the output positions whose taps reach the padding,
  grouped by which taps do (one bias a group and output channel, OpenAI's edge bias).
"""

import numpy as np


def expand_dims(values, name="dims"):
    """1-3 sizes (or one int) as three, padded in front with 1s: (S,) -> (1, 1, S)."""
    values = [values] if np.isscalar(values) else list(values)
    if not 1 <= len(values) <= 3:
        raise ValueError(f"{name}: expected 1 to 3 values, got {len(values)}")
    return (1,) * (3 - len(values)) + tuple(int(v) for v in values)


def out_dim(S, X, pad, stride, dilate):
    """Outputs along a dim: positions of a filter of S taps ``dilate`` apart, every ``stride``."""
    return (X + 2 * pad - dilate * (S - 1) - 1) // stride + 1


def in_dim(S, X, pad, stride, dilate):
    """The input size whose convolution has X outputs (a transposed convolution's output size,
    the smallest where stride > 1 leaves a choice)."""
    return (X - 1) * stride + dilate * (S - 1) + 1 - 2 * pad


def padding_of(padding, TRS, dilates, dims):
    """Padding as three dims: "SAME" (half the dilated filter, floor), "VALID" (none), or ints."""
    if isinstance(padding, str):
        if padding.upper() == "SAME":
            return tuple((d * (S - 1)) // 2 for S, d in zip(TRS, dilates))
        if padding.upper() == "VALID":
            return (0, 0, 0)
        raise ValueError(f"padding: expected 'SAME', 'VALID' or ints, got {padding!r}")
    pads = [padding] if np.isscalar(padding) else list(padding)
    if len(pads) != dims and len(pads) != 1:
        raise ValueError(f"padding: expected {dims} values (one a spatial dim), got {len(pads)}")
    return expand_dims(pads * dims if len(pads) == 1 else pads, "padding")


def geometry(TRS, DHW, MPQ=None, strides=1, dilates=1, padding="SAME", deconv=False):
    """Every size as three dims: dict(TRS, DHW, MPQ, strides, dilates, padding, dims). DHW is the
    convolution's input, MPQ its output; for a deconvolution (``deconv``) DHW is the given input
    and MPQ, when None, the output size `in_dim` gives."""
    dims = 1 if np.isscalar(TRS) else len(TRS)
    TRS, DHW = expand_dims(TRS, "TRS"), expand_dims(DHW, "DHW")
    as3 = lambda v, name: expand_dims([v] * dims if np.isscalar(v) else v, name)  # noqa: E731
    strides, dilates = as3(strides, "strides"), as3(dilates, "dilates")
    pad = padding_of(padding, TRS, dilates, dims)
    if deconv:  # the convolution runs from the (larger) output back to this input
        small = DHW
        big = expand_dims(MPQ, "MPQ") if MPQ is not None else tuple(
            in_dim(*a) for a in zip(TRS, small, pad, strides, dilates))
        return dict(TRS=TRS, DHW=big, MPQ=small, strides=strides, dilates=dilates, padding=pad, dims=dims)
    MPQ = expand_dims(MPQ, "MPQ") if MPQ is not None else tuple(
        out_dim(*a) for a in zip(TRS, DHW, pad, strides, dilates))
    return dict(TRS=TRS, DHW=DHW, MPQ=MPQ, strides=strides, dilates=dilates, padding=pad, dims=dims)


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


def edge_map(g):
    """The output positions (flat m·P·Q + p·Q + q) whose filter reaches the padding, grouped by
    which taps do: a list of position lists, ordered by their first position (OpenAI's edge
    bias groups)."""
    groups = {}
    for m, p, q in np.ndindex(*g["MPQ"]):
        off = []
        for t, r, s in np.ndindex(*g["TRS"]):
            at = [o * u - pd + k * a for o, u, pd, k, a in
                  zip((m, p, q), g["strides"], g["padding"], (t, r, s), g["dilates"])]
            if any(not 0 <= x < X for x, X in zip(at, g["DHW"])):
                off.append((t, r, s))
        if off:
            groups.setdefault(tuple(off), []).append((m * g["MPQ"][1] + p) * g["MPQ"][2] + q)
    return sorted(groups.values(), key=lambda positions: positions[0])


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


def l2_normalize(F, epsilon=1e-12):
    """Each block's filter over each output channel's (C, T, R, S), to unit L2 norm."""
    out = []
    for f in F:
        f = np.asarray(f, np.float64)
        norm = np.sqrt(np.maximum(np.sum(f * f, axis=tuple(range(1, f.ndim)), keepdims=True), epsilon))
        out.append(f / norm)
    return out
