"""Block norms of a dense matrix: one number per ``bs x bs`` block (OpenAI's ``reduced_dw``).

``out[i, j] = ‖a[i*bs:(i+1)*bs, j*bs:(j+1)*bs]‖`` under a criterion: ``"l2"`` (Frobenius),
``"l1"`` (sum of magnitudes) or ``"max"`` (largest magnitude; NaN if the block holds one).
What a layout is chosen from: a trained dense weight (`BlockSparseLinear.from_dense`) or a dense
gradient (which blocks to grow). One thread block per block: its threads stride over the
block's elements row by row (consecutive threads, consecutive addresses) and reduce in shared
memory. The result is fp32 (fp64 for fp64 input).
"""

import math

from numba import cuda

from .device import converters

CRITERIA = ("l2", "l1", "max")


def norm_threads(cfg, bs):
    return min(cfg.norm_threads, bs * bs)


def make_block_norms(cfg, bs, storage, acc_type, criterion):
    threads = norm_threads(cfg, bs)
    to_acc, _ = converters(storage, acc_type)
    squares, largest = criterion == "l2", criterion == "max"

    @cuda.jit(device=True, inline=True)
    def combine(acc, value):
        if largest:  # NaN wins: `not value <= acc` holds for a NaN value, `acc != acc` keeps one
            return value if (not value <= acc) and acc == acc else acc
        return acc + value

    @cuda.jit
    def block_norms(out, a):
        col = cuda.blockIdx.x
        row = cuda.blockIdx.y
        t = cuda.threadIdx.x
        partial = cuda.shared.array(threads, acc_type)
        acc = acc_type(0)
        for e in range(t, bs * bs, threads):
            r = e // bs
            value = abs(to_acc(a[row * bs + r, col * bs + e - r * bs]))
            acc = combine(acc, value * value if squares else value)
        partial[t] = acc
        cuda.syncthreads()
        step = threads // 2
        while step > 0:  # a tree over shared memory: a fixed order, so results repeat bitwise
            if t < step:
                partial[t] = combine(partial[t], partial[t + step])
            cuda.syncthreads()
            step //= 2
        if t == 0:
            out[row, col] = math.sqrt(partial[0]) if squares else partial[0]

    return block_norms
