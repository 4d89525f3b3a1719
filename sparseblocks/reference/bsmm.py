"""NumPy reference for block-sparse weight matmul (twin of `kernels/bsmm.py`).

Over a `BlockLayout` of ``(C/bs, K/bs)`` blocks with weights ``w[n_blocks, bs, bs]``:

* ``forward``:     ``y  = x · W``     (N, C) -> (N, K)
* ``input_grad``:  ``dx = dy · Wᵀ``   (N, K) -> (N, C)
* ``weight_grad``: ``dW = xᵀ · dy`` on the layout's blocks only -> (n_blocks, bs, bs)

``feature_axis=1`` means activations are ``(N, features)``; ``feature_axis=0``
means ``(features, N)`` (OpenAI blocksparse's two layouts). Output features
with no block are zero. With ``upcast=True`` (default) the arithmetic and the
result are float64; otherwise the result is cast back to the inputs' dtype.
"""

import numpy as np


def _as_rows(a, feature_axis, name):
    a = np.asarray(a)
    if a.ndim != 2:
        raise ValueError(f"{name}: expected a 2-D array, got {a.ndim} dimensions")
    if feature_axis not in (0, 1):
        raise ValueError(f"feature_axis: expected 0 or 1, got {feature_axis!r}")
    return a if feature_axis == 1 else a.T


def _result(out, feature_axis, dtype, upcast):
    out = out if feature_axis == 1 else out.T
    return out if upcast else out.astype(dtype)


def forward(x, w, layout, feature_axis=1, upcast=True, bias=None, relu=False):
    """``y = x · W`` for block-sparse ``W``; plus ``bias`` (one value an output feature) if given;
    with ``relu``, ``max(y, 0)``."""
    x = _as_rows(x, feature_axis, "x")
    bs = layout.block_size
    y = np.zeros((x.shape[0], layout.dense_shape[1]), np.float64)
    for block, (c, k) in enumerate(layout.coords):
        y[:, k * bs:(k + 1) * bs] += x[:, c * bs:(c + 1) * bs].astype(np.float64) @ w[block]
    if bias is not None:
        y += np.asarray(bias, np.float64)[None, :]
    if relu:
        y = np.maximum(y, 0.0)
    return _result(y, feature_axis, np.result_type(x, w), upcast)


def input_grad(dy, w, layout, feature_axis=1, upcast=True):
    """``dx = dy · Wᵀ`` for block-sparse ``W``."""
    dy = _as_rows(dy, feature_axis, "dy")
    bs = layout.block_size
    dx = np.zeros((dy.shape[0], layout.dense_shape[0]), np.float64)
    for block, (c, k) in enumerate(layout.coords):
        dx[:, c * bs:(c + 1) * bs] += dy[:, k * bs:(k + 1) * bs].astype(np.float64) @ w[block].T
    return _result(dx, feature_axis, np.result_type(dy, w), upcast)


def weight_grad(x, dy, layout, feature_axis=1, upcast=True):
    """``dW = xᵀ · dy`` restricted to the layout's blocks, as ``(n_blocks, bs, bs)``."""
    x = _as_rows(x, feature_axis, "x")
    dy = _as_rows(dy, feature_axis, "dy")
    bs = layout.block_size
    dw = np.zeros(layout.w_shape, np.float64)
    for block, (c, k) in enumerate(layout.coords):
        dw[block] = x[:, c * bs:(c + 1) * bs].T.astype(np.float64) @ dy[:, k * bs:(k + 1) * bs]
    return dw if upcast else dw.astype(np.result_type(x, dy))


def bias_grad(dy, feature_axis=1):
    """The bias gradient: dy's sums over N, a value an output feature (float64)."""
    return _as_rows(dy, feature_axis, "dy").astype(np.float64).sum(axis=0)


def transpose_blocks(w, layout):
    """W's blocks transposed into the layout's column order: ``wt[p] = w[layout.col_block[p]]ᵀ``."""
    return np.ascontiguousarray(np.asarray(w)[layout.col_block].transpose(0, 2, 1))


def block_norms(a, block_size, criterion="l2"):
    """Norms of the ``block_size``-square blocks of a dense 2-D ``a``: ``"l2"``, ``"l1"`` or ``"max"``
    of the magnitudes (float64)."""
    a = np.abs(np.asarray(a, np.float64))
    R, S = a.shape
    blocks = a.reshape(R // block_size, block_size, S // block_size, block_size)
    if criterion == "l2":
        return np.sqrt((blocks * blocks).sum(axis=(1, 3)))
    if criterion == "l1":
        return blocks.sum(axis=(1, 3))
    return blocks.max(axis=(1, 3))


def l2_normalize(w, layout, gain=None, epsilon=1e-6):
    """Each output column of the dense W over its C inputs: W[:, k]·rsqrt(max(Σ W[:, k]², eps))·g[k]."""
    W = layout.to_dense(np.asarray(w, np.float64))
    scale = 1 / np.sqrt(np.maximum((W * W).sum(axis=0), epsilon))
    if gain is not None:
        scale = scale * np.asarray(gain, np.float64)
    return layout.from_dense(W * scale)


def l2_normalize_grad(dy, w, layout, gain=None, epsilon=1e-6):
    """(dw, dgain) of `l2_normalize`."""
    W, D = layout.to_dense(np.asarray(w, np.float64)), layout.to_dense(np.asarray(dy, np.float64))
    total = (W * W).sum(axis=0)
    r = 1 / np.sqrt(np.maximum(total, epsilon))
    g = np.ones(W.shape[1]) if gain is None else np.asarray(gain, np.float64)
    dot = (D * W).sum(axis=0)
    dW = g * r * (D - np.where(total > epsilon, W * r * r * dot, 0.0))
    return layout.from_dense(dW), (None if gain is None else dot * r)


def ortho_init(layout, seed=0, scale=1.0):
    """Twin of `sparseblocks.bsmm.ortho_init`, in float64: element (b, r, j) of the Gaussian is
    Box-Muller's of the first two Philox words of counter b·bs² + r·bs + j under ``seed``; each
    block-column's stacked blocks are replaced by the Q of their QR, signed so that R's diagonal is
    positive (what Gram-Schmidt gives), times ``scale``."""
    from .philox import philox

    bs = layout.block_size
    e = np.arange(layout.n_blocks * bs * bs, dtype=np.uint64)
    w0, w1, _, _ = philox(e & np.uint64(0xFFFFFFFF), e >> np.uint64(32), 0, 0, seed & 0xFFFFFFFF, seed >> 32)
    u1, u2 = (w0 + 0.5) * 2.0 ** -32, (w1 + 0.5) * 2.0 ** -32
    w = (np.sqrt(-2 * np.log(u1)) * np.cos(2 * np.pi * u2)).reshape(layout.w_shape)
    for k in range(layout.shape[1]):
        blocks = layout.col_block[layout.col_ptr[k]:layout.col_ptr[k + 1]]
        if len(blocks):
            q, r = np.linalg.qr(w[blocks].reshape(-1, bs))
            w[blocks] = (q * np.sign(np.diag(r))).reshape(len(blocks), bs, bs)
    return w * scale
