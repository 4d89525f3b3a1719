"""The teaching product: one thread an output, SIMT ``popc`` on 32-bit words.

``y[n, o] = Σ_j Σ_k u_j · v[o, k] · dot_jk[n, o] (+ bias[o], ReLU)`` where ``dot_jk`` is the
product of activation plane j and weight plane k over the inputs the output sees, from three
popcounts over those words (`plane_dot`): ``P = popc(a & b)``, ``pa = popc(a)``, ``pb = popc(b)``.
The inputs an output sees are a list of blocks of ``block_words`` words (`words_of`): all the
words of the row for a dense product, the layout's present blocks of its block-column for a
block-sparse one. The tensor-core kernel (`tensorcore`) computes the same sums on ``mma.sync``
b1 tiles. The convolution (`make_simt_conv`) is the same sum over each tap's channel words.
"""

from numba import cuda, float32, int32


def make_plane_dot(signed_a, signed_w):
    sa, oa = (2, -1) if signed_a else (1, 0)
    sb, ob = (2, -1) if signed_w else (1, 0)

    @cuda.jit(device=True, inline=True)
    def plane_dot(P, pa, pb, seen):
        """Σ e_a e_b of two planes over `seen` values, from their popcounts."""
        return sa * sb * P + sa * ob * pa + oa * sb * pb + oa * ob * seen

    return plane_dot


def make_finish_value(bias, relu):
    """``finish(value, bias_value)``: an output's value with the epilogue's bias (its value read
    already) and ReLU (the store converts it to y's dtype)."""

    @cuda.jit(device=True, inline=True)
    def finish(value, bias_value):
        if bias:
            value += bias_value
        if relu:
            value = max(value, float32(0))
        return value

    return finish


def make_finish(bias, relu):
    finish_value = make_finish_value(bias, relu)

    @cuda.jit(device=True, inline=True)
    def finish(value, o, bias_values):
        """Output o's value with the epilogue's bias (``bias_values[o]``) and ReLU."""
        return finish_value(value, bias_values[o] if bias else float32(0))

    return finish


def make_simt_product(cfg, a_bits, w_bits, signed_a, signed_w, bias, relu, block_words, group_cols):
    plane_dot = make_plane_dot(signed_a, signed_w)
    finish = make_finish(bias, relu)

    @cuda.jit
    def product(y, a_planes, w_planes, a_basis, w_basis, bias_values, ptr, blocks, seen_a_block):
        # a_planes (J, N, words), w_planes (Kb, O, words) uint32; a_basis (J,), w_basis (O, Kb),
        # bias_values (O,) fp32; ptr / blocks: the input blocks of each group of group_cols outputs
        n = cuda.blockIdx.y * cuda.blockDim.y + cuda.threadIdx.y
        o = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
        if n >= y.shape[0] or o >= y.shape[1]:
            return
        group = o // group_cols
        first, last = ptr[group], ptr[group + 1]
        seen = (last - first) * seen_a_block
        acc = float32(0)
        for j in range(a_bits):
            for k in range(w_bits):
                P = int32(0)
                pa = int32(0)
                pb = int32(0)
                for i in range(first, last):
                    for w in range(blocks[i] * block_words, blocks[i] * block_words + block_words):
                        a = a_planes[j, n, w]
                        b = w_planes[k, o, w]
                        P += cuda.popc(a & b)
                        pa += cuda.popc(a)
                        pb += cuda.popc(b)
                acc += a_basis[j] * w_basis[o, k] * float32(plane_dot(P, pa, pb, seen))
        y[n, o] = finish(acc, o, bias_values)

    return product



def make_simt_conv(cfg, a_bits, w_bits, bias, relu, geometry):
    """The teaching convolution: one thread an output ``y[n, p, q, o]``, walking the taps inside
    the image and each tap's channel words. Activations have 0/1 codes and filters ±1 codes, so a
    tap outside the image (zero padding) contributes nothing: its words are simply skipped."""
    H, W, P, Q, R, S, SH, SW, PH, PW, DH, DW, WC = geometry
    plane_dot = make_plane_dot(False, True)
    finish = make_finish(bias, relu)

    @cuda.jit
    def conv(y, a_planes, w_planes, a_basis, w_basis, bias_values):
        # a_planes (J, images, H, W, WC), w_planes (Kb, O, R, S, WC) uint32; y (images, P, Q, O)
        o = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
        pixel = cuda.blockIdx.y * cuda.blockDim.y + cuda.threadIdx.y
        if pixel >= y.shape[0] * P * Q or o >= y.shape[3]:
            return
        n = pixel // (P * Q)
        oh = (pixel // Q) % P
        ow = pixel % Q
        acc = float32(0)
        for j in range(a_bits):
            for k in range(w_bits):
                both = int32(0)
                ones = int32(0)
                for r in range(R):
                    ih = oh * SH - PH + r * DH
                    for s in range(S):
                        iw = ow * SW - PW + s * DW
                        if 0 <= ih < H and 0 <= iw < W:
                            for w in range(WC):
                                a = a_planes[j, n, ih, iw, w]
                                both += cuda.popc(a & w_planes[k, o, r, s, w])
                                ones += cuda.popc(a)
                acc += a_basis[j] * w_basis[o, k] * float32(plane_dot(both, ones, 0, 0))
        y[n, oh, ow, o] = finish(acc, o, bias_values)

    return conv
