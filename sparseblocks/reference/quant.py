"""NumPy reference for learned quantization (LQ-Nets) and bit-plane products (twin of `quant`).

A quantizer of ``K`` bits has a basis ``v`` of K values; its 2^K levels are ``vᵀe`` over the
codes ``e``: ``e ∈ {-1, +1}^K`` (``signed``, weights: one basis per output channel) or
``e ∈ {0, 1}^K`` (activations: one shared basis). A value is encoded as its nearest level, by
thresholds at the midpoints of the sorted levels. Bit ``k`` of a code is 1 where ``e_k`` is +1
(signed) or 1; the packed form holds, for each bit, a plane of 32 values a ``uint32`` word
(value ``c`` of a row in word ``c // 32``, bit ``c % 32``), rows padded with zero bits to whole
`WORD_ALIGN` words.

A product of an activation plane ``a`` and a weight plane ``b`` over ``C`` values is a sum of
popcounts: with ``P = popc(a & b)``, ``pa = popc(a)``, ``pb = popc(b)`` and codes
``s·bit + o`` (signed: s = 2, o = -1; else s = 1, o = 0),
``Σ e_a e_b = s_a s_b P + s_a o_b pa + o_a s_b pb + o_a o_b C`` (`plane_dot`). For ±1 codes
this is ``C - 2·popc(a xor b)``, since ``popc(a xor b) = pa + pb - 2P``.
"""

import numpy as np

WORD = 32
WORD_ALIGN = 8  # words a packed row is padded to: one 256-bit k-step of the b1 tensor-core mma
MOVING_AVERAGE = 0.9  # LQ-Nets' moving average of the basis
RIDGE = 1e-4  # the ridge term of the weights' basis update
NORM_PPF_0_75 = 0.6745  # the 75th percentile of N(0, 1): LQ-Nets' initial scale


def code_values(bits, signed):
    """The codes ``e`` as a (2^K, K) array, row ``i`` the code whose bit ``k`` is bit k of i."""
    i = np.arange(2 ** bits)[:, None]
    e = (i >> np.arange(bits)[None, :]) & 1
    return (2 * e - 1) if signed else e


def levels(basis, signed):
    """(sorted levels, the code index of each): ``basis`` (..., K) -> two (..., 2^K) arrays."""
    basis = np.asarray(basis, np.float64)
    values = basis @ code_values(basis.shape[-1], signed).T
    order = np.argsort(values, axis=-1, kind="stable")
    return np.take_along_axis(values, order, -1), order


def thresholds(basis, signed):
    """Midpoints of the sorted levels: (..., 2^K - 1)."""
    lv, _ = levels(basis, signed)
    return (lv[..., 1:] + lv[..., :-1]) / 2


def encode(x, basis, signed, threshold_dtype=np.float64):
    """(codes, values) of ``x`` (..., C): codes the integer code of each value (bit k = bit k of
    the code), values its level. ``basis`` is (K,) or (..., K) broadcast over x's last axis:
    one basis a row (weights: a row is an output channel's). ``threshold_dtype``: the thresholds
    rounded to it first (the kernels compare in fp32). A value on a threshold takes the lower
    level, a NaN the lowest."""
    x = np.asarray(x, np.float64)
    basis = np.asarray(basis, np.float64)
    lv, order = levels(basis, signed)
    th = ((lv[..., 1:] + lv[..., :-1]) / 2).astype(threshold_dtype).astype(np.float64)
    x = np.where(np.isnan(x), -np.inf, x)
    if basis.ndim == 1:
        index = np.searchsorted(th, x, side="left")
        return order[index], lv[index]
    index = np.stack([np.searchsorted(t, row, side="left") for t, row in zip(th.reshape(-1, th.shape[-1]),
                                                                             x.reshape(-1, x.shape[-1]))])
    index = index.reshape(x.shape)
    return np.take_along_axis(order, index, -1), np.take_along_axis(lv, index, -1)


def decode(codes, basis, signed):
    """The values of integer codes: ``Σ_k v_k e_k``."""
    basis = np.asarray(basis, np.float64)
    e = (np.asarray(codes)[..., None] >> np.arange(basis.shape[-1])) & 1
    e = (2 * e - 1) if signed else e
    if basis.ndim == 1:
        return e @ basis
    return np.einsum("...ck,...k->...c", e, basis)


def packed_words(columns):
    """Words of a packed row of `columns` values (padded to whole `WORD_ALIGN` words)."""
    words = -(-columns // WORD)
    return -(-words // WORD_ALIGN) * WORD_ALIGN


def pack(codes, bits):
    """Bit planes of integer codes (R, C): uint32 (bits, R, words), zero bits past C."""
    codes = np.asarray(codes, np.int64)
    rows, columns = codes.shape
    words = packed_words(columns)
    planes = np.zeros((bits, rows, words * WORD), np.uint64)
    for k in range(bits):
        planes[k, :, :columns] = (codes >> k) & 1
    weights = np.uint64(1) << np.arange(WORD, dtype=np.uint64)
    return (planes.reshape(bits, rows, words, WORD) * weights).sum(-1).astype(np.uint32)


def unpack(planes, columns):
    """Integer codes (R, columns) of bit planes (bits, R, words)."""
    planes = np.asarray(planes, np.uint32)
    bits = (planes[..., None] >> np.arange(WORD, dtype=np.uint32)) & 1
    bits = bits.reshape(*planes.shape[:2], -1)[..., :columns].astype(np.int64)
    return (bits << np.arange(planes.shape[0])[:, None, None]).sum(0)


def popcount(words):
    """Set bits of each uint32, as int64."""
    words = np.asarray(words, np.uint32)
    return ((words[..., None] >> np.arange(WORD, dtype=np.uint32)) & 1).sum(-1).astype(np.int64)


def plane_dot(P, pa, pb, columns, signed_a, signed_b):
    """``Σ e_a e_b`` of two planes from their popcounts (see the module's docstring)."""
    sa, oa = (2, -1) if signed_a else (1, 0)
    sb, ob = (2, -1) if signed_b else (1, 0)
    return sa * sb * P + sa * ob * pa + oa * sb * pb + oa * ob * columns


def matmul(a_planes, a_basis, w_planes, w_basis, columns, signed_a=False, signed_w=True, layout=None,
           bias=None, relu=False):
    """``y = x̂ · ŵᵀ`` from bit planes, in float64: activations (J, N, words) with a shared basis
    (J,), weights (Kb, O, words) with a basis per output (O, Kb), over ``columns`` input values.

    With a ``layout`` (`BlockLayout` over the (in, out) grid of ``columns`` x O) only its present
    blocks are summed: the dense product of the weight masked by the layout. Also returns the
    exact integer plane products ``{(j, k): (N, O) int64}`` that the result scales.
    """
    a_planes, w_planes = np.asarray(a_planes, np.uint32), np.asarray(w_planes, np.uint32)
    N, O = a_planes.shape[1], w_planes.shape[1]
    if layout is None:
        mask = np.ones((columns, O), bool)
    else:
        mask = layout.element_mask()[:columns, :O].astype(bool)
    a_bits = unpack_bits(a_planes, columns)  # (J, N, C) 0/1
    w_bits = unpack_bits(w_planes, columns)  # (Kb, O, C)
    y = np.zeros((N, O))
    sums = {}
    for j in range(a_planes.shape[0]):
        ea = 2 * a_bits[j] - 1 if signed_a else a_bits[j]
        for k in range(w_planes.shape[0]):
            ew = 2 * w_bits[k] - 1 if signed_w else w_bits[k]
            sums[j, k] = ea @ (ew.T * mask)  # (N, O): only the present blocks' inputs
            y += np.float64(a_basis[j]) * sums[j, k] * np.asarray(w_basis, np.float64)[:, k][None, :]
    if bias is not None:
        y += np.asarray(bias, np.float64)
    return (np.maximum(y, 0) if relu else y), sums


def unpack_bits(planes, columns):
    """The bits of planes (P, R, words) as int64 (P, R, columns)."""
    planes = np.asarray(planes, np.uint32)
    bits = (planes[..., None] >> np.arange(WORD, dtype=np.uint32)) & 1
    return bits.reshape(*planes.shape[:2], -1)[..., :columns].astype(np.int64)


def basis_update(x, codes, basis, signed, ridge=None, momentum=MOVING_AVERAGE):
    """LQ-Nets' QEM step: the least-squares basis ``v = (BᵀB + λI)⁻¹Bᵀx`` for the codes ``B``
    (values × K) of ``x``, blended into ``basis`` as ``momentum·basis + (1 - momentum)·v``.
    One basis a row of ``x`` where ``basis`` is (R, K) (``ridge`` defaults to `RIDGE` there,
    weights), else one for all (0). A direction the codes never vary along keeps its value."""
    x = np.asarray(x, np.float64)
    basis = np.asarray(basis, np.float64)
    K = basis.shape[-1]
    e = (np.asarray(codes)[..., None] >> np.arange(K)) & 1
    e = (2 * e - 1) if signed else e
    ridge = (RIDGE if basis.ndim == 2 else 0.0) if ridge is None else ridge

    def solve(B, target, old):
        gram = B.T @ B + ridge * np.eye(K)
        if abs(np.linalg.det(gram)) < 1e-12:
            return old
        return np.linalg.solve(gram, B.T @ target)

    if basis.ndim == 1:
        new = solve(e.reshape(-1, K).astype(np.float64), x.reshape(-1), basis)
    else:
        new = np.stack([solve(e[r].astype(np.float64), x[r], basis[r]) for r in range(basis.shape[0])])
    return momentum * basis + (1 - momentum) * new


def initial_basis(bits, signed, fan_in=None, channels=None):
    """LQ-Nets' initial basis, ``v_k = 2^k · base``. Weights (``signed``), one row a channel
    (channels, K): ``base = 0.6745·√(2/fan_in) / 2^(K-1)``, levels spread over a He-initialised
    layer's weights; activations (K,): ``base = 2·0.6745 / (2^K - 1)``, levels from 0 to 1.35."""
    powers = 2.0 ** np.arange(bits)
    if signed:
        base = NORM_PPF_0_75 * np.sqrt(2.0 / fan_in) / 2 ** (bits - 1)
        return np.tile(powers * base, (channels, 1))
    return powers * 2 * NORM_PPF_0_75 / (2 ** bits - 1)


def ste_grad(x, grad, basis, signed):
    """The straight-through gradient of the quantizer: ``grad`` itself for weights (``signed``),
    and for activations zero above the largest level (the quantizer clips there)."""
    if signed:
        return np.asarray(grad)
    top = levels(basis, signed)[0][..., -1]
    return np.where(np.asarray(x) <= top, grad, 0.0)


def pack_image(codes, bits):
    """Bit planes of an image batch's integer codes (N, C, H, W): uint32 (bits, N, H, W, words),
    a pixel's channels 32 a word (channel c: bit c % 32 of word c // 32), zero bits past C, and
    no padding to `WORD_ALIGN` (a convolution's list of words runs over taps and channel words)."""
    codes = np.asarray(codes, np.int64)
    N, C, H, W = codes.shape
    words = -(-C // WORD)
    rows = pack(codes.transpose(0, 2, 3, 1).reshape(-1, C), bits)[:, :, :words]
    return rows.reshape(bits, N, H, W, words)


def conv_output_size(size, taps, stride, padding, dilation):
    """An output side: ``(size + 2·padding - dilation·(taps - 1) - 1) // stride + 1``."""
    return (size + 2 * padding - dilation * (taps - 1) - 1) // stride + 1


def conv2d(a_planes, a_basis, w_planes, w_basis, channels, stride=(1, 1), padding=(0, 0), dilation=(1, 1),
           bias=None, relu=False):
    """A 2-D convolution from bit planes, in float64, channels last: activations (J, N, H, W,
    words) with 0/1 codes and a shared basis (J,), filters (Kb, O, R, S, words) with ±1 codes and a
    basis per output channel (O, Kb). Zero padding: a tap outside the image contributes nothing
    (the quantized image padded with zeros). Returns y (N, P, Q, O)."""
    a = decode(unpack(np.asarray(a_planes).reshape(a_planes.shape[0], -1, a_planes.shape[-1]), channels),
               np.asarray(a_basis, np.float64), signed=False)
    J, N, H, W, _ = a_planes.shape
    a = a.reshape(N, H, W, channels)
    Kb, O, R, S, _ = w_planes.shape
    codes = unpack(np.asarray(w_planes).reshape(Kb, -1, w_planes.shape[-1]), channels).reshape(O, R * S, channels)
    e = 2 * ((codes[..., None] >> np.arange(Kb)) & 1) - 1  # (O, R·S, C, Kb) ±1
    w = (e @ np.asarray(w_basis, np.float64)[:, None, :, None])[..., 0].reshape(O, R, S, channels)
    (sh, sw), (ph, pw), (dh, dw) = stride, padding, dilation
    P, Q = conv_output_size(H, R, sh, ph, dh), conv_output_size(W, S, sw, pw, dw)
    padded = np.zeros((N, H + 2 * ph + sh * P + dh * R, W + 2 * pw + sw * Q + dw * S, channels))
    padded[:, ph:ph + H, pw:pw + W] = a
    y = np.zeros((N, P, Q, O))
    for r in range(R):
        for s in range(S):
            window = padded[:, r * dh:r * dh + sh * P:sh, s * dw:s * dw + sw * Q:sw]  # (N, P, Q, C)
            y += window @ w[:, r, s].T
    if bias is not None:
        y += np.asarray(bias, np.float64)
    return np.maximum(y, 0) if relu else y
