"""NumPy twin of `sparseblocks.attention`: dense attention under the block layout's mask, in
float64, written for reading first.

``q``, ``k``, ``v``: (batch, heads, seq, head_dim). ``layouts``: one `BlockLayout` over the
(query block, key block) grid, shared by the heads, or a list of one a head. Query i sees key j
where block (i // bs, j // bs) is present, and with ``causal`` only j <= i. ``scale``: 1/sqrt(head_dim)
by default. A query that sees no key gets zeros (and a log-sum-exp of -inf): no NaN.

* `mask(layouts, heads, seq, causal)`: the (heads, seq, seq) boolean mask;
* `forward(q, k, v, layouts, causal, scale, dropout_p, seed, offset)`: (out, lse), lse the
  (batch, heads, seq) log-sum-exp of each query's scaled scores, which the backward uses;
* `backward(q, k, v, out, lse, dout, layouts, causal, scale, dropout_p, seed, offset)`: (dq, dk, dv).

Dropout (``dropout_p`` > 0) drops probabilities after the softmax: P is multiplied by keep / (1 -
dropout_p), `dropout_keep`'s bits; lse is the undropped softmax's.
"""

import numpy as np


def _per_head(layouts, heads):
    layouts = list(layouts) if isinstance(layouts, (list, tuple)) else [layouts] * heads
    if len(layouts) != heads:
        raise ValueError(f"layouts: expected one or {heads} (one a head), got {len(layouts)}")
    return layouts


def mask(layouts, heads, seq, causal=False):
    out = np.zeros((heads, seq, seq), bool)
    for h, layout in enumerate(_per_head(layouts, heads)):
        bs = layout.block_size
        out[h] = np.repeat(np.repeat(np.asarray(layout.mask, bool), bs, 0), bs, 1)[:seq, :seq]
    if causal:
        out &= np.tril(np.ones((seq, seq), bool))[None]
    return out


def dropout_keep(shape, dropout_p, seed=0, offset=0):
    """The (batch, heads, seq, seq) keep bits of attention's dropout. Philox's block for counter
    (g, offset) under seed gives eight 16-bit halves, one for each pair of a set of eight of head
    n = b·H + h: queries 16u + r and 16u + r + 8 (r < 8) against keys 16w + 2s, 16w + 2s + 1,
    16w + 2s + 8 and 16w + 2s + 9 (s < 4), with g = (n·8T + 8u + r)·4T + 4w + s (T = ⌈seq / 16⌉).
    Query 16u + r + 8a and key 16w + 2s + 8b + c take half c (0 the low one) of word 2a + b; a
    pair is kept where its half is below keep·2¹⁶."""
    from .philox import philox

    B, H, S = shape[:3]
    T = (S + 15) // 16
    keep = np.zeros((B, H, S, S), bool)
    threshold = min(int((1.0 - dropout_p) * 2.0 ** 16), 2 ** 16)
    i, j = np.arange(S)[:, None], np.arange(S)[None, :]
    u, r, a = i // 16, i % 8, (i // 8) % 2
    w, s, b, c = j // 16, (j % 8) // 2, (j // 8) % 2, j % 2
    for n in range(B * H):
        g = (n * 8 * T + 8 * u + r) * 4 * T + 4 * w + s
        words = philox(g & 0xFFFFFFFF, g >> 32, offset & 0xFFFFFFFF, offset >> 32, seed & 0xFFFFFFFF, seed >> 32)
        word = np.choose(2 * a + b, words).astype(np.uint64)
        half = (word >> (16 * c).astype(np.uint64)) & np.uint64(0xFFFF)
        keep[n // H, n % H] = half < np.uint64(threshold)
    return keep


def _dropped(p, dropout_p, seed, offset):
    """p times keep / (1 - dropout_p) (p itself without dropout)."""
    if not dropout_p:
        return p
    return np.where(dropout_keep(p.shape, dropout_p, seed, offset), p / (1.0 - dropout_p), 0.0)


def forward(q, k, v, layouts, causal=False, scale=None, dropout_p=0.0, seed=0, offset=0):
    q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
    B, H, S, D = q.shape
    scale = 1 / np.sqrt(D) if scale is None else scale
    m = mask(layouts, H, S, causal)[None]
    scores = np.where(m, np.einsum("bhid,bhjd->bhij", q, k) * scale, -np.inf)
    top = scores.max(-1, keepdims=True)
    seen = np.isfinite(top)
    weights = np.where(m, np.exp(scores - np.where(seen, top, 0)), 0.0)
    total = weights.sum(-1, keepdims=True)
    p = np.where(seen, weights / np.where(seen, total, 1), 0.0)
    lse = np.where(seen, top + np.log(np.where(seen, total, 1)), -np.inf)[..., 0]
    return np.einsum("bhij,bhjd->bhid", _dropped(p, dropout_p, seed, offset), v), lse


def backward(q, k, v, out, lse, dout, layouts, causal=False, scale=None, dropout_p=0.0, seed=0, offset=0):
    q, k, v, out, dout = (np.asarray(a, np.float64) for a in (q, k, v, out, dout))
    B, H, S, D = q.shape
    scale = 1 / np.sqrt(D) if scale is None else scale
    m = mask(layouts, H, S, causal)[None]
    seen = np.isfinite(lse)[..., None]
    p = np.where(m & seen, np.exp(np.einsum("bhid,bhjd->bhij", q, k) * scale - np.where(seen, lse[..., None], 0)),
                 0.0)
    dv = np.einsum("bhij,bhid->bhjd", _dropped(p, dropout_p, seed, offset), dout)
    dp = _dropped(np.einsum("bhid,bhjd->bhij", dout, v), dropout_p, seed, offset)
    ds = p * (dp - np.sum(dout * out, -1, keepdims=True))
    return np.einsum("bhij,bhjd->bhid", ds, k) * scale, np.einsum("bhij,bhid->bhjd", ds, q) * scale, dv
