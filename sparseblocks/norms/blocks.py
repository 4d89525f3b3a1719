"""Sums across a thread block's row of threads, shared by the normalizations and the element-wise
ops' per-channel gradients: `make_block_sum` (one or two sums), in a fixed order, so results
repeat bitwise."""

from numba import cuda

FULL_MASK = 0xFFFFFFFF


def block_slots(threads):
    """The slots a thread-block row's shared sums take (`make_block_sum`): two regions of a slot a
    warp and one for the total."""
    return 2 * (threads // 32 + 1)


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
