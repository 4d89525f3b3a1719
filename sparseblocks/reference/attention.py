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
    """The (batch, heads, seq, seq) keep bits of attention's dropout. Pair (query i, key j) of head
    n = b·H + h takes word 2 (i % 2) + j % 2 of Philox's block for counter ((n·R + i // 2)·R + j // 2,
    offset) under seed (R = ⌈seq / 2⌉: a block a 2 x 2 square of pairs), kept below keep·2³²."""
    from .philox import philox

    B, H, S = shape[:3]
    R = (S + 1) // 2
    keep = np.zeros((B, H, S, S), bool)
    threshold = min(int((1.0 - dropout_p) * 2.0 ** 32), 2 ** 32)
    i, j = np.arange(S)[:, None], np.arange(S)[None, :]
    for n in range(B * H):
        counter = (n * R + i // 2) * R + j // 2
        words = philox(counter & 0xFFFFFFFF, counter >> 32, offset & 0xFFFFFFFF, offset >> 32,
                       seed & 0xFFFFFFFF, seed >> 32)
        word = np.choose(2 * (i % 2) + j % 2, words)
        keep[n // H, n % H] = word.astype(np.uint64) < np.uint64(threshold)
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
