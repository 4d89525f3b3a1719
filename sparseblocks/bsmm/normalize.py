"""Weight initialization and normalization on the device, over a layout's blocks (OpenAI's
``identity_init`` and ``l2_normalize``).

* ``identity(w, coords, scale)``: every block zero but the diagonal blocks' diagonals, ``scale``;
  a thread an element.
* ``l2_normalize``: each output feature k (a column of the dense W) divided by its l2 norm over the
  C inputs (``rsqrt(max(Σ W[:, k]², epsilon))``, as TensorFlow's ``l2_normalize``), times
  ``gain[k]`` where given. A thread block a block-column of the layout, a thread a column of its
  blocks, walking the column's blocks and their rows: consecutive threads read consecutive
  addresses, and the sum runs in a fixed order.
* ``l2_normalize_grad``: ``dw = g·r·(dy - w·r²·Σ dy·w)`` (or ``g·r·dy`` where the norm is
  clamped at epsilon) and ``dg[k] = Σ dy·w·r``, from the same walk.
"""

import math

from numba import cuda

from .device import converters


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
