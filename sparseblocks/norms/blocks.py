"""Sums across a thread block's row of threads, shared by the normalizations and the element-wise
ops' per-channel gradients: `make_block_sum` (one or two sums) and `make_block_stats` (a row's
mean and variance in one merge), each in a fixed order, so results repeat bitwise."""

from numba import cuda
from numba.cuda import libdevice

FULL_MASK = 0xFFFFFFFF


def block_slots(threads):
    """The slots a thread-block row's shared sums take (`make_block_sum`, `make_block_stats`):
    three regions of a slot a warp and one for the total."""
    return 3 * (threads // 32 + 1)


def make_block_sum(threads, acc_type):
    """(``block_sum(value, shared, y, t, region)``, ``block_sums(a, b, shared, y, t)``): the sum of
    the ``threads`` threads' ``value`` (row ``y``'s of the thread block: ``shared[y]``, an
    ``acc_type`` array of `block_slots` slots), returned to all of them; or two independent sums in
    one pass (each with the same bits as alone). One warp sums by shuffles alone (lane 0's sum,
    broadcast: every lane gets the same bits); more take two barriers of the whole thread block,
    every row's threads reaching them together. A kernel uses each of the two regions (0, 1) once
    (``block_sums`` takes both), so no barrier guards a region's reuse."""
    WARPS = threads // 32
    SLOTS = WARPS + 1

    @cuda.jit(device=True, inline=True)
    def warp_sum(value):
        for offset in (16, 8, 4, 2, 1):
            value += cuda.shfl_down_sync(FULL_MASK, value, offset)
        return value

    @cuda.jit(device=True, inline=True)
    def block_sum(value, shared, y, t, region):
        value = warp_sum(value)
        if WARPS == 1:
            return cuda.shfl_sync(FULL_MASK, value, 0)
        lane, warp, base = t % 32, t // 32, region * SLOTS
        if lane == 0:
            shared[y, base + warp] = value
        cuda.syncthreads()
        if warp == 0:
            total = warp_sum(shared[y, base + lane] if lane < WARPS else acc_type(0))
            if lane == 0:
                shared[y, base + WARPS] = total
        cuda.syncthreads()
        return shared[y, base + WARPS]

    @cuda.jit(device=True, inline=True)
    def block_sums(a, b, shared, y, t):
        a, b = warp_sum(a), warp_sum(b)
        if WARPS == 1:
            return cuda.shfl_sync(FULL_MASK, a, 0), cuda.shfl_sync(FULL_MASK, b, 0)
        lane, warp = t % 32, t // 32
        if lane == 0:
            shared[y, warp] = a
            shared[y, SLOTS + warp] = b
        cuda.syncthreads()
        if warp == 0:
            ta = warp_sum(shared[y, lane] if lane < WARPS else acc_type(0))
            tb = warp_sum(shared[y, SLOTS + lane] if lane < WARPS else acc_type(0))
            if lane == 0:
                shared[y, WARPS] = ta
                shared[y, SLOTS + WARPS] = tb
        cuda.syncthreads()
        return shared[y, WARPS], shared[y, SLOTS + WARPS]

    return block_sum, block_sums


def make_block_stats(threads, acc_type):
    """``block_stats(n, m, q, shared, y, t) -> (mean, M2)`` of the ``threads`` threads' counts
    ``n``, means ``m`` and sums of squared deviations ``q`` (row ``y``'s of the thread block),
    returned to all of them: Chan's merge of two parts' statistics, n = nₐ + n_b, mean = mₐ + δ·n_b/n,
    M2 = qₐ + q_b + δ²·nₐ·n_b/n (δ = m_b - mₐ), by warp shuffles and then across the row's warps
    in shared memory, in a fixed order. One reduction and two barriers for both moments, where a
    mean and then the squares about it take two of each; no cancellation, as each part's q sums
    squares about its own mean."""
    WARPS = threads // 32
    SLOTS = WARPS + 1

    FAST = acc_type.bitwidth == 32  # (the weight nb / n of counts: the approximate division, within 2 ulp)

    @cuda.jit(device=True, inline=True)
    def merge(na, ma, qa, nb, mb, qb):
        n = na + nb
        if FAST:
            w = libdevice.fast_fdividef(nb, n) if n > acc_type(0) else acc_type(0)
        else:
            w = nb / n if n > acc_type(0) else acc_type(0)
        d = mb - ma
        return n, ma + d * w, qa + qb + d * d * na * w

    @cuda.jit(device=True, inline=True)
    def warp_merge(n, m, q):
        for offset in (16, 8, 4, 2, 1):  # (lane 0's is exact; past the warp's end a lane merges itself)
            n, m, q = merge(n, m, q, cuda.shfl_down_sync(FULL_MASK, n, offset),
                            cuda.shfl_down_sync(FULL_MASK, m, offset), cuda.shfl_down_sync(FULL_MASK, q, offset))
        return n, m, q

    @cuda.jit(device=True, inline=True)
    def block_stats(n, m, q, shared, y, t):
        n, m, q = warp_merge(n, m, q)
        if WARPS == 1:
            return cuda.shfl_sync(FULL_MASK, m, 0), cuda.shfl_sync(FULL_MASK, q, 0)
        lane, warp = t % 32, t // 32
        if lane == 0:
            shared[y, warp] = n
            shared[y, SLOTS + warp] = m
            shared[y, 2 * SLOTS + warp] = q
        cuda.syncthreads()
        if warp == 0:
            zero = acc_type(0)
            inside = lane < WARPS
            n, m, q = warp_merge(shared[y, lane] if inside else zero, shared[y, SLOTS + lane] if inside else zero,
                                 shared[y, 2 * SLOTS + lane] if inside else zero)
            if lane == 0:
                shared[y, SLOTS + WARPS] = m
                shared[y, 2 * SLOTS + WARPS] = q
        cuda.syncthreads()
        return shared[y, SLOTS + WARPS], shared[y, 2 * SLOTS + WARPS]

    return block_stats
