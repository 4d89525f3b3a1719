"""reduce_mask version 1: pool every window, then compact the active ones in order.

A pooling kernel (1 to 8 warps a window, shuffle reductions) sets a flag per
window and counts each compaction chunk's active windows with an integer
atomic add (the sums do not depend on the order); a compaction kernel ranks
the flags by ballots and prefix sums (past ``prefix_chunks`` chunks a scan
kernel sums the counts first). Windows wider than ``pass_columns`` run here.
"""

import math

import numpy as np
from numba import cuda, float64

from ..ptx.nanmax import max_nan_select
from .device import FULL_MASK, WARP


@cuda.jit(device=True, inline=True)
def _mask_value(mask, n, h, w, height, width, empty):
    """mask[n, h, w] as float64, or `empty` off the image."""
    if 0 <= h < height and 0 <= w < width:
        return float64(mask[n, h, w])
    return empty


@cuda.jit(device=True, inline=True)
def _pool(acc, v, avgpool):
    # (NaN-propagating, as the reference's numpy max: on a GPU plain max drops a NaN, and the
    # simulator's Python max keeps one only in first place, so a window's flag hung on where in
    # it, and in which lane of a vector, its NaN pixel lay)
    return acc + v if avgpool else max_nan_select(acc, v)


@cuda.jit(device=True, inline=True)
def _next_pixel(r, c, step_r, step_c, size_w):
    """The pixel `step_r * size_w + step_c` further on in the window (step_c < size_w)."""
    r += step_r
    c += step_c
    if c >= size_w:
        c -= size_w
        r += 1
    return r, c


def make_reduce_kernels(cfg):
    """Version 1 of reduce_mask, three kernels: pool every window into a flag (and count the
    flags of each compaction chunk), scan the chunk counts where they are many, write the
    active windows in order. Returns (pool, scan, write_summed, write_scanned)."""
    COMPACT_THREADS = cfg.compact_threads
    COMPACT_WARPS = cfg.compact_warps
    REDUCE_WARPS = cfg.reduce_warps
    @cuda.jit(device=True, inline=True)
    def _flag(flags, chunk_counts, window, pooled, tol, avgpool, pixels):
        """The window's flag from its pooled value (a sum with avgpool), counted in its chunk."""
        if avgpool:
            pooled /= pixels
        active = pooled > tol
        flags[window] = 1 if active else 0
        if active:
            cuda.atomic.add(chunk_counts, window // COMPACT_THREADS, 1)


    @cuda.jit
    def pool_kernel(flags, chunk_counts, mask, n_images, height, width, count_h, count_w,
                    size_h, size_w, stride_h, stride_w, offset_h, offset_w, tol, avgpool, group_warps):
        """flags[window] = 1 where the pooled mask exceeds tol, and chunk_counts[window //
        COMPACT_THREADS] counts them (zeroed before; an integer atomic add, so the sums do not
        depend on the order). A thread block pools REDUCE_WARPS // group_warps windows,
        group_warps warps a window, REDUCE_LOADS loads a lane in flight."""
        tid = cuda.threadIdx.x
        warp = tid // WARP
        lane = tid % WARP
        per_block = REDUCE_WARPS // group_warps
        total = n_images * count_h * count_w
        partial = cuda.shared.array(REDUCE_WARPS, np.float64)
        slot = warp // group_warps
        window = cuda.blockIdx.x * per_block + slot
        # float64 sums so the avg test agrees with the float64 reference
        empty = float64(0) if avgpool else float64(-math.inf)
        acc = empty
        if window < total:  # the same for every lane of a warp
            n = window // (count_h * count_w)
            rest = window - n * count_h * count_w
            bh = rest // count_w
            h0 = offset_h + bh * stride_h
            w0 = offset_w + (rest - bh * count_w) * stride_w
            # Pixel p = t + T·k of the window (t: the thread's place in its group of T), stepped
            # without a division a pixel; REDUCE_LOADS loads issued before any is used.
            threads = group_warps * WARP
            t = tid - slot * threads
            step_r = threads // size_w
            step_c = threads - step_r * size_w
            r = t // size_w
            c = t - r * size_w
            while r < size_h:
                r1, c1 = _next_pixel(r, c, step_r, step_c, size_w)
                r2, c2 = _next_pixel(r1, c1, step_r, step_c, size_w)
                r3, c3 = _next_pixel(r2, c2, step_r, step_c, size_w)
                v0 = _mask_value(mask, n, h0 + r, w0 + c, height, width, empty)
                v1 = _mask_value(mask, n, h0 + r1, w0 + c1, height, width, empty) if r1 < size_h else empty
                v2 = _mask_value(mask, n, h0 + r2, w0 + c2, height, width, empty) if r2 < size_h else empty
                v3 = _mask_value(mask, n, h0 + r3, w0 + c3, height, width, empty) if r3 < size_h else empty
                acc = _pool(_pool(acc, v0, avgpool), _pool(v1, _pool(v2, v3, avgpool), avgpool), avgpool)
                r, c = _next_pixel(r3, c3, step_r, step_c, size_w)
        offset = 16
        while offset > 0:
            acc = _pool(acc, cuda.shfl_xor_sync(FULL_MASK, acc, offset), avgpool)
            offset //= 2
        if lane == 0:
            partial[warp] = acc
        cuda.syncthreads()  # every warp's pooled value is in partial
        window = cuda.blockIdx.x * per_block + tid
        if tid < per_block and window < total:
            pooled = partial[tid * group_warps]
            for k in range(1, group_warps):
                pooled = _pool(pooled, partial[tid * group_warps + k], avgpool)
            _flag(flags, chunk_counts, window, pooled, tol, avgpool, size_h * size_w)


    @cuda.jit(device=True, inline=True)
    def _warp_counts_and_offset(ballot, warp_counts):
        """Store this warp's popcount; after the barrier, the count of the warps before it."""
        lane = cuda.threadIdx.x % WARP
        warp = cuda.threadIdx.x // WARP
        if lane == 0:
            warp_counts[warp] = cuda.popc(ballot)
        cuda.syncthreads()  # every warp's count is in warp_counts
        before = 0
        for k in range(warp):
            before += warp_counts[k]
        return before


    @cuda.jit(device=True, inline=True)
    def _block_sum(value, partial):
        """The sum of value over the thread block, for every thread (partial: COMPACT_WARPS ints)."""
        offset = 16
        while offset > 0:
            value += cuda.shfl_xor_sync(FULL_MASK, value, offset)
            offset //= 2
        if cuda.threadIdx.x % WARP == 0:
            partial[cuda.threadIdx.x // WARP] = value
        cuda.syncthreads()  # every warp's sum is in partial
        total = 0
        for k in range(COMPACT_WARPS):
            total += partial[k]
        cuda.syncthreads()  # partial is read before a later call overwrites it
        return total


    @cuda.jit
    def scan_kernel(block_offsets, count, block_counts, n_blocks):
        """Exclusive prefix sum of block_counts by one warp (shuffle scans of 32 at a time): for more
        than PREFIX_CHUNKS chunks."""
        lane = cuda.threadIdx.x
        carry = 0
        for base in range(0, n_blocks, WARP):
            i = base + lane
            value = block_counts[i] if i < n_blocks else 0
            inclusive = value
            offset = 1
            while offset < WARP:
                up = cuda.shfl_up_sync(FULL_MASK, inclusive, offset)
                if lane >= offset:
                    inclusive += up
                offset *= 2
            if i < n_blocks:
                block_offsets[i] = carry + inclusive - value
            carry += cuda.shfl_sync(FULL_MASK, inclusive, WARP - 1)
        if lane == 0:
            count[0] = carry


    def _make_write_kernel(summed):
        """The compaction: each active flag's (n, bh, bw) at its row-major rank (chunk offset +
        warps before + lanes before), and n = -1 in rows from the active count on. The chunk's
        offset and the count come from chunk_counts (the block sums them: `summed`), or from the
        scan kernel's block_offsets and count."""

        @cuda.jit
        def write_kernel(indices, count, flags, chunk_counts, block_offsets, total, count_h, count_w):
            chunk = cuda.blockIdx.x
            tid = cuda.threadIdx.x
            i = chunk * COMPACT_THREADS + tid
            warp_counts = cuda.shared.array(COMPACT_WARPS, np.int32)
            if summed:
                n_chunks = chunk_counts.shape[0]
                earlier = 0
                everything = 0
                for k in range(tid, n_chunks, COMPACT_THREADS):
                    c = chunk_counts[k]
                    everything += c
                    if k < chunk:
                        earlier += c
                offset = _block_sum(earlier, warp_counts)
                n_active = _block_sum(everything, warp_counts)
                if chunk == 0 and tid == 0:
                    count[0] = n_active
            else:
                offset = block_offsets[chunk]
                n_active = count[0]
            active = i < total and flags[min(i, total - 1)] != 0
            ballot = cuda.ballot_sync(FULL_MASK, active)
            before = _warp_counts_and_offset(ballot, warp_counts)
            if active:
                rank = offset + before + cuda.popc(ballot & cuda.lanemask_lt())
                n = i // (count_h * count_w)
                rest = i - n * count_h * count_w
                indices[rank, 0] = n
                indices[rank, 1] = rest // count_w
                indices[rank, 2] = rest % count_w
            if n_active <= i < total:  # this chunk's share of the rows past the count
                indices[i, 0] = -1
                indices[i, 1] = -1
                indices[i, 2] = -1

        return write_kernel


    return pool_kernel, scan_kernel, _make_write_kernel(True), _make_write_kernel(False)
