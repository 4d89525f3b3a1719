"""Block-sparse attention as OpenAI wrote it, three kernels a thread a value, for reading and for
checking the fused ones: scores of the present blocks (sdd), their softmax along each query row
(with the row's log-sum-exp), and the weighted sum of the values (dsd).

The blocks of every head, one list: block g is head ``blk_head[g]``'s (query block
``blk_row[g]``, key block ``blk_col[g]``); ``row_ptr`` a CSR over (head, query block) of the block
ids, whose rows are consecutive. Scores live in fp32 (batch, blocks, bs, bs).

* ``scores(s, q, k, ...)``: s[b, g, i, j] = scale · q[b, h, r·bs + i] · k[b, h, c·bs + j], -inf
  where ``causal`` and the key comes after the query;
* ``softmax(s, lse, ...)``: each query row of s, over its blocks, in place: exp(s - max) / sum,
  lse = max + log(sum); a row that sees nothing gets zeros and lse -inf (a thread a row);
* ``weighted(out, s, v, ..., factor)``: out[b, h, r·bs + i, d] = factor · Σ over the row's
  blocks and j of s[b, g, i, j] · v[b, h, c·bs + j, d].

The backward, from the forward's output and log-sum-exp (nothing of size seq x seq kept):

* ``probabilities(p, q, k, lse, ...)``: p = exp(scores - lse) on the present blocks again;
* ``deltas(delta, dout, out, ...)``: delta[b, h, i] = dout · out along the head dim;
* ``score_grads(ds, p, dout, v, delta, ...)``: ds = p · (dout · v - delta), in place over p's copy;
* ``weighted`` (dq = scale · ds · k) and ``column_weighted(out, s, x, ..., factor)``, a key row's
  sum over the blocks of its block-column (``col_ptr`` over (head, key block), ``col_block`` the
  ids): dk = scale · dsᵀ · q, dv = pᵀ · dout.

Dropout: ``dropped(s, ..., rule, factor)`` multiplies the stored probabilities by keep · factor
(factor 1 / (1 - dropout_p)), pair (query i, key j) of head b·H + h kept where
`dropout.kept_score` says under ``rule`` (threshold, seed's two words, offset): after the softmax in
the forward, after the score gradients in the backward (dv from the dropped p); ``score_grads``
with ``dropout`` takes dout · v through the same mask.
"""

import math

from numba import cuda

from ..bsmm.device import converters
from .dropout import kept_score
from ..runtime.compile import inlined


@inlined
def score_of(e, blk_head, blk_row, blk_col, bs):
    """(batch, head, query, key) of stored score e: (batch, block, row, column) of (B, G, bs, bs)."""
    G = blk_head.shape[0]
    b, g, i, j = e // (G * bs * bs), (e // (bs * bs)) % G, (e // bs) % bs, e % bs
    return b, blk_head[g], blk_row[g] * bs + i, blk_col[g] * bs + j


def make_rows_dot(storage, acc_type):
    """``dot(x, y, b, h, i, j, H, S, D)``: row i of x's head h against row j of y's, in acc_type
    (x and y (batch, heads, seq, head_dim), flat)."""
    to_acc, _ = converters(storage, acc_type)

    @inlined
    def dot(x, y, b, h, i, j, H, S, D):
        acc = acc_type(0)
        xa, ya = ((b * H + h) * S + i) * D, ((b * H + h) * S + j) * D
        for d in range(D):
            acc += to_acc(x[xa + d]) * to_acc(y[ya + d])
        return acc

    return dot


def make_scores(storage, acc_type):
    dot = make_rows_dot(storage, acc_type)

    @cuda.jit
    def scores(s, q, k, blk_head, blk_row, blk_col, B, H, S, D, bs, scale, causal):
        G = blk_head.shape[0]
        start, step = cuda.grid(1), cuda.gridsize(1)
        for e in range(start, B * G * bs * bs, step):
            b, h, qi, kj = score_of(e, blk_head, blk_row, blk_col, bs)
            if causal and kj > qi:
                s[e] = -math.inf
                continue
            s[e] = dot(q, k, b, h, qi, kj, H, S, D) * acc_type(scale)

    return scores


def make_softmax(acc_type):
    @cuda.jit
    def softmax(s, lse, row_ptr, B, H, S, bs):
        rows = S // bs
        G = s.shape[0] // (B * bs * bs)
        start, step = cuda.grid(1), cuda.gridsize(1)
        for e in range(start, B * H * S, step):
            b, h, qi = e // (H * S), (e // S) % H, e % S
            r, i = qi // bs, qi % bs
            first, last = row_ptr[h * rows + r], row_ptr[h * rows + r + 1]
            top = -math.inf
            for g in range(first, last):
                for j in range(bs):
                    top = max(top, s[((b * G + g) * bs + i) * bs + j])
            total = acc_type(0)
            if top != -math.inf:
                for g in range(first, last):
                    for j in range(bs):
                        total += math.exp(s[((b * G + g) * bs + i) * bs + j] - top)
            for g in range(first, last):
                for j in range(bs):
                    at = ((b * G + g) * bs + i) * bs + j
                    s[at] = math.exp(s[at] - top) / total if top != -math.inf else acc_type(0)
            lse[e] = top + math.log(total) if top != -math.inf else -math.inf

    return softmax


def make_weighted(storage, acc_type):
    to_acc, from_acc = converters(storage, acc_type)

    @cuda.jit
    def weighted(out, s, v, row_ptr, blk_col, B, H, S, D, bs, factor):
        rows = S // bs
        G = s.shape[0] // (B * bs * bs)
        start, step = cuda.grid(1), cuda.gridsize(1)
        for e in range(start, B * H * S * D, step):
            b, h, qi, d = e // (H * S * D), (e // (S * D)) % H, (e // D) % S, e % D
            r, i = qi // bs, qi % bs
            acc = acc_type(0)
            for g in range(row_ptr[h * rows + r], row_ptr[h * rows + r + 1]):
                base = ((b * H + h) * S + blk_col[g] * bs) * D + d
                for j in range(bs):
                    acc += s[((b * G + g) * bs + i) * bs + j] * to_acc(v[base + j * D])
            out[e] = from_acc(acc * acc_type(factor))

    return weighted


def make_column_weighted(storage, acc_type):
    to_acc, from_acc = converters(storage, acc_type)

    @cuda.jit
    def column_weighted(out, s, x, col_ptr, col_block, blk_row, B, H, S, D, bs, factor):
        cols = S // bs
        G = s.shape[0] // (B * bs * bs)
        start, step = cuda.grid(1), cuda.gridsize(1)
        for e in range(start, B * H * S * D, step):
            b, h, kj, d = e // (H * S * D), (e // (S * D)) % H, (e // D) % S, e % D
            c, j = kj // bs, kj % bs
            acc = acc_type(0)
            for at in range(col_ptr[h * cols + c], col_ptr[h * cols + c + 1]):
                g = col_block[at]
                base = ((b * H + h) * S + blk_row[g] * bs) * D + d
                for i in range(bs):
                    acc += s[((b * G + g) * bs + i) * bs + j] * to_acc(x[base + i * D])
            out[e] = from_acc(acc * acc_type(factor))

    return column_weighted


def make_probabilities(storage, acc_type):
    dot = make_rows_dot(storage, acc_type)

    @cuda.jit
    def probabilities(p, q, k, lse, blk_head, blk_row, blk_col, B, H, S, D, bs, scale, causal):
        G = blk_head.shape[0]
        start, step = cuda.grid(1), cuda.gridsize(1)
        for e in range(start, B * G * bs * bs, step):
            b, h, qi, kj = score_of(e, blk_head, blk_row, blk_col, bs)
            top = lse[(b * H + h) * S + qi]
            if (causal and kj > qi) or top == -math.inf:
                p[e] = acc_type(0)
                continue
            p[e] = math.exp(dot(q, k, b, h, qi, kj, H, S, D) * acc_type(scale) - top)

    return probabilities


def make_deltas(storage, acc_type):
    to_acc, _ = converters(storage, acc_type)

    @cuda.jit
    def deltas(delta, dout, out, B, H, S, D):
        start, step = cuda.grid(1), cuda.gridsize(1)
        for e in range(start, B * H * S, step):
            acc = acc_type(0)
            for d in range(D):
                acc += to_acc(dout[e * D + d]) * to_acc(out[e * D + d])
            delta[e] = acc

    return deltas


def make_dropped(acc_type):
    @cuda.jit
    def dropped(s, blk_head, blk_row, blk_col, B, H, S, bs, threshold, seed_lo, seed_hi, offset, factor):
        G = blk_head.shape[0]
        start, step = cuda.grid(1), cuda.gridsize(1)
        for e in range(start, B * G * bs * bs, step):
            b, h, qi, kj = score_of(e, blk_head, blk_row, blk_col, bs)
            keep = kept_score(b * H + h, S, qi, kj, threshold, seed_lo, seed_hi, offset)
            s[e] = s[e] * acc_type(factor) if keep else acc_type(0)

    return dropped


def make_score_grads(storage, acc_type, dropout=False):
    dot = make_rows_dot(storage, acc_type)

    @cuda.jit
    def score_grads(ds, p, dout, v, delta, blk_head, blk_row, blk_col, B, H, S, D, bs, threshold, seed_lo, seed_hi,
                    offset, factor):
        G = blk_head.shape[0]
        start, step = cuda.grid(1), cuda.gridsize(1)
        for e in range(start, B * G * bs * bs, step):
            b, h, qi, kj = score_of(e, blk_head, blk_row, blk_col, bs)
            if p[e] == 0:
                ds[e] = acc_type(0)
                continue
            dp = dot(dout, v, b, h, qi, kj, H, S, D)
            if dropout:
                keep = kept_score(b * H + h, S, qi, kj, threshold, seed_lo, seed_hi, offset)
                dp = dp * acc_type(factor) if keep else acc_type(0)
            ds[e] = p[e] * (dp - delta[(b * H + h) * S + qi])

    return score_grads
