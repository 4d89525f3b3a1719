"""Weight initialization and normalization on the device, over a layout's blocks (OpenAI's
``identity_init``, ``ortho_init`` and ``l2_normalize``).

* ``identity(w, coords, scale)``: every block zero but the diagonal blocks' diagonals, ``scale``;
  a thread an element.
* ``ortho(w, work, col_ptr, col_block, seed_lo, seed_hi, scale)``: each block-column's stacked
  blocks (its m = blocks·bs inputs by bs outputs) get orthonormal columns, times ``scale``: the Q
  of a Gaussian matrix's QR (R's diagonal positive). Element (b, r, j) of the Gaussian is
  Box-Muller's of the first two Philox words of counter (b·bs² + r·bs + j, 0, 0, 0) under the
  seed. A warp a block-column, in fp32 in ``work`` (w's shape): classical Gram-Schmidt twice
  (each column's projections on the ones before summed by all lanes at once, then taken off,
  then again), the lanes splitting the m rows and adding by shuffles in a fixed order.
* ``l2_normalize``: each output feature k (a column of the dense W) divided by its l2 norm over the
  C inputs (``rsqrt(max(Σ W[:, k]², epsilon))``, as TensorFlow's ``l2_normalize``), times
  ``gain[k]`` where given. A thread block a block-column of the layout, a thread a column of its
  blocks, walking the column's blocks and their rows: consecutive threads read consecutive
  addresses, and the sum runs in a fixed order.
* ``l2_normalize_grad``: ``dw = g·r·(dy - w·r²·Σ dy·w)`` (or ``g·r·dy`` where the norm is
  clamped at epsilon) and ``dg[k] = Σ dy·w·r``, from the same walk.
"""

import math

from numba import cuda, float32, int64, uint32

from ..philox import philox
from .device import converters

FULL_MASK = 0xFFFFFFFF


def make_identity(cfg, bs, storage, acc_type):
    _, from_acc = converters(storage, acc_type)

    @cuda.jit
    def identity(w, coords, scale):
        bs = w.shape[1]
        start, step = cuda.grid(1), cuda.gridsize(1)
        for e in range(start, w.shape[0] * bs * bs, step):
            b, r, c = e // (bs * bs), (e // bs) % bs, e % bs
            diagonal = coords[b, 0] == coords[b, 1] and r == c
            w[b, r, c] = from_acc(acc_type(scale) if diagonal else acc_type(0))

    return identity


def make_ortho(cfg, bs, storage, acc_type):
    """``ortho(w, work, col_ptr, col_block, seed_lo, seed_hi, scale)``, a warp (32 threads) a
    block-column."""
    _, from_acc = converters(storage, acc_type)
    TWO_PI = 2 * math.pi
    BS = bs

    @cuda.jit(device=True, inline=True)
    def gaussian(e, seed_lo, seed_hi):
        w0, w1, _, _ = philox(uint32(e & 0xFFFFFFFF), uint32(e >> 32), uint32(0), uint32(0), uint32(seed_lo),
                              uint32(seed_hi))
        u1 = (float32(w0) + float32(0.5)) * float32(2.0 ** -32)  # (in (0, 1): the log is finite)
        u2 = (float32(w1) + float32(0.5)) * float32(2.0 ** -32)
        return math.sqrt(float32(-2) * math.log(u1)) * math.cos(float32(TWO_PI) * u2)

    @cuda.jit(device=True, inline=True)
    def warp_sum(v):
        for offset in (16, 8, 4, 2, 1):
            v += cuda.shfl_xor_sync(FULL_MASK, v, offset)
        return v

    @cuda.jit
    def ortho(w, work, col_ptr, col_block, seed_lo, seed_hi, scale):
        kb, lane = cuda.blockIdx.x, cuda.threadIdx.x
        first, count = col_ptr[kb], col_ptr[kb + 1] - col_ptr[kb]
        m = count * BS
        dots = cuda.local.array(BS, float32)
        for row in range(lane, m, 32):  # (a row of the stack: block first + row // bs, its row row % bs)
            b, r = col_block[first + row // BS], row % BS
            for j in range(BS):
                work[b, r, j] = gaussian(int64(b) * BS * BS + r * BS + j, seed_lo, seed_hi)
        cuda.syncwarp()
        for j in range(BS):
            for _ in range(2):  # (twice: the second pass takes off what the first's rounding left)
                for i in range(j):
                    dots[i] = float32(0)
                for row in range(lane, m, 32):
                    b, r = col_block[first + row // BS], row % BS
                    v = work[b, r, j]
                    for i in range(j):
                        dots[i] += work[b, r, i] * v
                for i in range(j):
                    dots[i] = warp_sum(dots[i])
                for row in range(lane, m, 32):
                    b, r = col_block[first + row // BS], row % BS
                    v = work[b, r, j]
                    for i in range(j):
                        v -= dots[i] * work[b, r, i]
                    work[b, r, j] = v
                cuda.syncwarp()
            total = float32(0)
            for row in range(lane, m, 32):
                b, r = col_block[first + row // BS], row % BS
                total += work[b, r, j] * work[b, r, j]
            inverse = float32(1) / math.sqrt(warp_sum(total))
            for row in range(lane, m, 32):
                b, r = col_block[first + row // BS], row % BS
                work[b, r, j] *= inverse
            cuda.syncwarp()
        for row in range(lane, m, 32):
            b, r = col_block[first + row // BS], row % BS
            for j in range(BS):
                w[b, r, j] = from_acc(acc_type(work[b, r, j] * float32(scale)))

    return ortho


def make_l2_normalize(cfg, bs, storage, acc_type, gain_storage, has_gain):
    """(normalize(out, w, gain, col_ptr, col_block, epsilon), grad(dw, dgain, dy, w, gain, col_ptr,
    col_block, epsilon)), launched a thread block a block-column with bs threads."""
    to_acc, from_acc = converters(storage, acc_type)
    g_in, g_out = converters(gain_storage, acc_type)

    @cuda.jit(device=True, inline=True)
    def column_norm(w, col_ptr, col_block, kb, j, epsilon):
        bs = w.shape[1]
        total = acc_type(0)
        for entry in range(col_ptr[kb], col_ptr[kb + 1]):
            b = col_block[entry]
            for r in range(bs):
                v = to_acc(w[b, r, j])
                total += v * v
        clamped = total <= acc_type(epsilon)
        return acc_type(1) / math.sqrt(acc_type(epsilon) if clamped else total), clamped

    @cuda.jit
    def normalize(out, w, gain, col_ptr, col_block, epsilon):
        kb, j = cuda.blockIdx.x, cuda.threadIdx.x
        bs = w.shape[1]
        r_norm, _ = column_norm(w, col_ptr, col_block, kb, j, epsilon)
        scale = r_norm * (g_in(gain[kb * bs + j]) if has_gain else acc_type(1))
        for entry in range(col_ptr[kb], col_ptr[kb + 1]):
            b = col_block[entry]
            for r in range(bs):
                out[b, r, j] = from_acc(to_acc(w[b, r, j]) * scale)

    @cuda.jit
    def grad(dw, dgain, dy, w, gain, col_ptr, col_block, epsilon):
        kb, j = cuda.blockIdx.x, cuda.threadIdx.x
        bs = w.shape[1]
        r_norm, clamped = column_norm(w, col_ptr, col_block, kb, j, epsilon)
        dot = acc_type(0)
        for entry in range(col_ptr[kb], col_ptr[kb + 1]):
            b = col_block[entry]
            for r in range(bs):
                dot += to_acc(dy[b, r, j]) * to_acc(w[b, r, j])
        g = g_in(gain[kb * bs + j]) if has_gain else acc_type(1)
        if has_gain:
            dgain[kb * bs + j] = g_out(dot * r_norm)
        for entry in range(col_ptr[kb], col_ptr[kb + 1]):
            b = col_block[entry]
            for r in range(bs):
                d = to_acc(dy[b, r, j])
                if not clamped:
                    d -= to_acc(w[b, r, j]) * r_norm * r_norm * dot
                dw[b, r, j] = from_acc(g * r_norm * d)

    return normalize, grad
