"""The block-sparse convolution's direct kernels: a thread a value of the result, the sum written
out as the twin's (`reference.conv`). Readable first; `tensorcore.py` has the fast forms.

Arrays are flat: images (N, channels, D, H, W), the filters one buffer, block b's
(len(ks), len(cs), T, R, S) from ``f_off[b]``. ``geo`` holds, as int32, (D, H, W, M, P, Q, T, R, S,
the strides, the paddings, the dilations), each three dims. The channel lookup tables:

* ``k_ptr``/``k_blk``/``k_pos``: for output channel k, the blocks that reach it and its row in each
  (a CSR over k); ``c_ptr``/``c_blk``/``c_pos`` the same for input channels;
* ``cs``/``ks`` with ``cs_off``/``ks_off`` (b + 1 entries): each block's channels.

* ``forward(out, x, f, ...)``: out[n, k, m, p, q] = the sum over the blocks reaching k, their input
  channels and the taps that land on the image, plus ``bias[k, edge[mpq]]`` where ``edge`` >= 0
  (the edge bias, `reference.conv.edge_map`) and ``has_bias``;
* ``input_grad(out, dy, f, ...)``: out[n, c, d, h, w] from the output positions each tap of each
  block reaching c maps there (d = m·u - pad + t·a, so m = (d + pad - t·a) / u where that divides);
* ``filter_grad(out, dy, x, ...)``: out[f_off[b] + e] over the batch and the output positions,
  a thread a filter value (blockIdx.y: the block);
* ``l2_normalize`` (and its gradient), a thread a filter row; ``edge_bias_grad``, a thread an
  (output channel, edge group).
"""

from numba import cuda

from ..bsmm.device import converters


def make_forward(storage, acc_type):
    to_acc, from_acc = converters(storage, acc_type)

    @cuda.jit
    def forward(out, x, f, f_off, k_ptr, k_blk, k_pos, cs, cs_off, geo, N, K, C, bias, edge, has_bias):
        D, H, W, M, P, Q = geo[0], geo[1], geo[2], geo[3], geo[4], geo[5]
        T, R, S = geo[6], geo[7], geo[8]
        MPQ, DHW, TRS = M * P * Q, D * H * W, T * R * S
        start, step = cuda.grid(1), cuda.gridsize(1)
        for e in range(start, N * K * MPQ, step):
            n, k, o = e // (K * MPQ), (e // MPQ) % K, e % MPQ
            m, p, q = o // (P * Q), (o // Q) % P, o % Q
            acc = acc_type(0)
            for j in range(k_ptr[k], k_ptr[k + 1]):
                b, row = k_blk[j], k_pos[j]
                width = cs_off[b + 1] - cs_off[b]
                for i in range(width):
                    c = cs[cs_off[b] + i]
                    base = f_off[b] + (row * width + i) * TRS
                    for t in range(T):
                        d = m * geo[9] - geo[12] + t * geo[15]
                        if 0 <= d < D:
                            for r in range(R):
                                h = p * geo[10] - geo[13] + r * geo[16]
                                if 0 <= h < H:
                                    for s in range(S):
                                        w = q * geo[11] - geo[14] + s * geo[17]
                                        if 0 <= w < W:
                                            acc += to_acc(f[base + (t * R + r) * S + s]) * \
                                                to_acc(x[(n * C + c) * DHW + (d * H + h) * W + w])
            if has_bias and edge[o] >= 0:
                acc += to_acc(bias[k, edge[o]])
            out[e] = from_acc(acc)

    return forward


def make_input_grad(storage, acc_type):
    to_acc, from_acc = converters(storage, acc_type)

    @cuda.jit
    def input_grad(out, dy, f, f_off, c_ptr, c_blk, c_pos, ks, ks_off, cs_off, geo, N, K, C):
        D, H, W, M, P, Q = geo[0], geo[1], geo[2], geo[3], geo[4], geo[5]
        T, R, S = geo[6], geo[7], geo[8]
        MPQ, DHW, TRS = M * P * Q, D * H * W, T * R * S
        start, step = cuda.grid(1), cuda.gridsize(1)
        for e in range(start, N * C * DHW, step):
            n, c, o = e // (C * DHW), (e // DHW) % C, e % DHW
            d, h, w = o // (H * W), (o // W) % H, o % W
            acc = acc_type(0)
            for j in range(c_ptr[c], c_ptr[c + 1]):
                b, col = c_blk[j], c_pos[j]
                width = cs_off[b + 1] - cs_off[b]
                for i in range(ks_off[b + 1] - ks_off[b]):
                    k = ks[ks_off[b] + i]
                    base = f_off[b] + (i * width + col) * TRS
                    for t in range(T):
                        a = d + geo[12] - t * geo[15]
                        if a >= 0 and a % geo[9] == 0 and a // geo[9] < M:
                            m = a // geo[9]
                            for r in range(R):
                                bb = h + geo[13] - r * geo[16]
                                if bb >= 0 and bb % geo[10] == 0 and bb // geo[10] < P:
                                    p = bb // geo[10]
                                    for s in range(S):
                                        cc = w + geo[14] - s * geo[17]
                                        if cc >= 0 and cc % geo[11] == 0 and cc // geo[11] < Q:
                                            q = cc // geo[11]
                                            acc += to_acc(f[base + (t * R + r) * S + s]) * \
                                                to_acc(dy[(n * K + k) * MPQ + (m * P + p) * Q + q])
            out[e] = from_acc(acc)

    return input_grad


def make_filter_grad(storage, acc_type):
    to_acc, from_acc = converters(storage, acc_type)

    @cuda.jit
    def filter_grad(out, dy, x, f_off, cs, cs_off, ks, ks_off, geo, N, K, C):
        D, H, W, M, P, Q = geo[0], geo[1], geo[2], geo[3], geo[4], geo[5]
        T, R, S = geo[6], geo[7], geo[8]
        MPQ, DHW, TRS = M * P * Q, D * H * W, T * R * S
        b = cuda.blockIdx.y
        width = cs_off[b + 1] - cs_off[b]
        size = (ks_off[b + 1] - ks_off[b]) * width * TRS
        start, step = cuda.grid(1), cuda.gridDim.x * cuda.blockDim.x
        for e in range(start, size, step):
            row, i, tap = e // (width * TRS), (e // TRS) % width, e % TRS
            t, r, s = tap // (R * S), (tap // S) % R, tap % S
            k, c = ks[ks_off[b] + row], cs[cs_off[b] + i]
            acc = acc_type(0)
            for n in range(N):
                for m in range(M):
                    d = m * geo[9] - geo[12] + t * geo[15]
                    if 0 <= d < D:
                        for p in range(P):
                            h = p * geo[10] - geo[13] + r * geo[16]
                            if 0 <= h < H:
                                for q in range(Q):
                                    w = q * geo[11] - geo[14] + s * geo[17]
                                    if 0 <= w < W:
                                        acc += to_acc(dy[(n * K + k) * MPQ + (m * P + p) * Q + q]) * \
                                            to_acc(x[(n * C + c) * DHW + (d * H + h) * W + w])
            out[f_off[b] + e] = from_acc(acc)

    return filter_grad


def make_l2_normalize(storage, acc_type, gradient, with_gain):
    """OpenAI's filter normalization, a thread a filter row (block b's output channel j: its
    ``row_len`` values from ``row_start``): out = g·f / sqrt(max(Σf², ε)) (g 1 without a gain).
    ``gradient``: from the normalized filter's gradient u, the filter's: (u·g + f·[Σf² ≥ ε]·Σ(-u·f·g)
    / max(Σf², ε)) / sqrt(max(Σf², ε)), and with a gain its gradient Σ(u·f) / sqrt(max(Σf², ε))
    into ``dgain[row]``."""
    to_acc, from_acc = converters(storage, acc_type)

    @cuda.jit
    def l2_normalize(out, f, u, gain, dgain, row_start, row_len, epsilon):
        start, step = cuda.grid(1), cuda.gridsize(1)
        for row in range(start, row_start.shape[0], step):
            a, n = row_start[row], row_len[row]
            squares = acc_type(0)
            for i in range(n):
                v = to_acc(f[a + i])
                squares += v * v
            floor = max(squares, acc_type(epsilon))
            scale = acc_type(1) / floor ** acc_type(0.5)
            g = to_acc(gain[row]) if with_gain else acc_type(1)
            if not gradient:
                for i in range(n):
                    out[a + i] = from_acc(g * to_acc(f[a + i]) * scale)
            else:
                dot = acc_type(0)
                for i in range(n):
                    dot += to_acc(u[a + i]) * to_acc(f[a + i])
                if with_gain:
                    dgain[row] = from_acc(dot * scale)
                keep = acc_type(1) if squares >= acc_type(epsilon) else acc_type(0)
                for i in range(n):
                    out[a + i] = from_acc((to_acc(u[a + i]) * g - to_acc(f[a + i]) * keep * dot * g / floor) * scale)

    return l2_normalize


def make_edge_bias_grad(storage, acc_type):
    """``edge_bias_grad(out, dy, grp_ptr, grp_pos, N, K, MPQ)``: out[k, e] = Σ over the batch and
    edge group e's output positions (``grp_pos[grp_ptr[e]:grp_ptr[e + 1]]``) of dy[n, k, position],
    a thread a (k, e)."""
    to_acc, from_acc = converters(storage, acc_type)

    @cuda.jit
    def edge_bias_grad(out, dy, grp_ptr, grp_pos, N, K, MPQ):
        groups = grp_ptr.shape[0] - 1
        start, step = cuda.grid(1), cuda.gridsize(1)
        for e in range(start, K * groups, step):
            k, g = e // groups, e % groups
            acc = acc_type(0)
            for n in range(N):
                for at in range(grp_ptr[g], grp_ptr[g + 1]):
                    acc += to_acc(dy[(n * K + k) * MPQ + grp_pos[at]])
            out[e] = from_acc(acc)

    return edge_bias_grad
