"""Element gathers and scatters: any layout, dtype and geometry.

One thread block a window (or part of one), ``copy_unroll`` elements a thread
in flight; the transposing copies go through a 32 x 33 shared tile so that
reads run along one layout's contiguous axis and writes along the other's.
Scatters overwrite, add, or add atomically (fp16 atomics: `ptx.half2`). The
other families are faster where their conditions hold (`dispatch`).
"""

import numpy as np
from numba import cuda, float32, from_dtype, int64, uint64

from ..ptx.half2 import add_half2, atomic_add_half, atomic_add_half2
from .device import split

TILE = 32  # transposing gather/scatter: 32 pixels x 32 channels through shared memory


TILE_ROWS = 8  # ... by 32 x 8 threads


TILE_SHAPE = (TILE, TILE + 1)  # +1 column: reading a column hits 32 distinct banks


TILE_STEPS = TILE // TILE_ROWS  # tile rows each thread moves (a literal: local-array shapes are constants)


def make_copy_kernels(cfg, scatter, transpose, add, atomic, dtype, channels_last):
    """Gather (image -> blocks) or scatter (blocks -> image), plain or through a transposing tile.

    The image is NHWC when `channels_last`, else NCHW; the blocks share its
    layout unless `transpose`. Every kernel walks its arrays along their
    contiguous axis: channels for channels-last data, pixels otherwise. A
    thread block takes one window: its (n, h0, w0) is read once, and out-of-
    image elements read a clamped (valid) address and are zeroed by a select,
    so each thread keeps COPY_UNROLL loads in flight without branches.
    """
    COPY_THREADS = cfg.copy_threads
    COPY_UNROLL = cfg.copy_unroll
    HALF2 = dtype == "half2"  # int32 words of two fp16 values, added by add_half2
    FP16 = dtype == "float16"  # (Numba's atomic add takes no fp16: atomic_add_half)
    element = from_dtype(np.dtype("int32" if HALF2 else dtype))
    blocks_last = channels_last != transpose  # are the blocks [nb, bh, bw, C]?
    source_last = blocks_last if scatter else channels_last  # the side a transposing tile reads

    @cuda.jit(device=True, inline=True)
    def image_shape(image):
        """(N, H, W, C) of the image in either layout."""
        if channels_last:
            return image.shape[0], image.shape[1], image.shape[2], image.shape[3]
        return image.shape[0], image.shape[2], image.shape[3], image.shape[1]

    @cuda.jit(device=True, inline=True)
    def image_index(n, h, w, c):
        """Unsigned (no negative-index wrap): callers pass coordinates inside the image."""
        if channels_last:
            return uint64(n), uint64(h), uint64(w), uint64(c)
        return uint64(n), uint64(c), uint64(h), uint64(w)

    # A plain add reads the old values in the load phase (with the blocks), so
    # its read-modify-writes do not wait out one load latency each.
    prefetch_old = add and not atomic

    @cuda.jit(device=True, inline=True)
    def image_clamped(image, n, h, w, c):
        """The pixel at (h, w) moved into the image: a valid address for a read whose value
        the caller drops (or zeroes) when (h, w) is outside."""
        _, H, W, _ = image_shape(image)
        return image[image_index(n, min(max(h, 0), H - 1), min(max(w, 0), W - 1), c)]

    @cuda.jit(device=True, inline=True)
    def image_put(image, index, value, old):
        if add:
            if atomic and HALF2:
                atomic_add_half2(image, index, value)
            elif atomic and FP16:
                atomic_add_half(image, index, value)
            elif atomic:
                cuda.atomic.add(image, index, value)
            elif HALF2:
                image[index] = add_half2(old, value)
            else:
                image[index] = old + value
        else:
            image[index] = value

    @cuda.jit(device=True, inline=True)
    def block_index(i, r, s, c):
        if blocks_last:
            return uint64(i), uint64(r), uint64(s), uint64(c)
        return uint64(i), uint64(c), uint64(r), uint64(s)

    @cuda.jit(device=True, inline=True)
    def window(indices, i, stride_h, stride_w, offset_h, offset_w):
        return indices[i, 0], offset_h + indices[i, 1] * stride_h, offset_w + indices[i, 2] * stride_w

    @cuda.jit
    def copy_plain(image, blocks, indices, count, size_h, size_w, stride_h, stride_w, offset_h, offset_w):
        i = cuda.blockIdx.x
        live = i < count[0]  # a gather's row past the count: zeros, as a window off the image
        if scatter and not live:
            return
        N, H, W, C = image_shape(image)
        n, h0, w0 = window(indices, i, stride_h, stride_w, offset_h, offset_w)
        n_ok = live and 0 <= n < N
        if scatter and not n_ok:
            return
        nc = min(max(n, 0), N - 1)
        # Elements in the arrays' shared order (a, b, d), d contiguous: (r, s, c)
        # channels-last, (c, r, s) otherwise. Thread block (i, part) takes the
        # part-th slice of window i's elements; each thread steps COPY_THREADS
        # elements at a time, carrying (a, b, d) along without a division.
        if channels_last:
            B, D, A = size_w, C, size_h
        else:
            B, D, A = size_h, size_w, C
        total = A * B * D
        per_part = -(-total // cuda.gridDim.y)
        e_end = min(total, (cuda.blockIdx.y + 1) * per_part)
        td = COPY_THREADS % D
        tb = (COPY_THREADS // D) % B
        ta = COPY_THREADS // (B * D)
        e = cuda.blockIdx.y * per_part + cuda.threadIdx.x
        d = e % D
        b = (e // D) % B
        a = e // (B * D)
        ev = cuda.local.array(COPY_UNROLL, int64)
        av = cuda.local.array(COPY_UNROLL, int64)
        bv = cuda.local.array(COPY_UNROLL, int64)
        dv = cuda.local.array(COPY_UNROLL, int64)
        values = cuda.local.array(COPY_UNROLL, element)
        olds = cuda.local.array(COPY_UNROLL, element)
        while e < e_end:
            for u in range(COPY_UNROLL):
                ev[u] = e
                av[u] = a
                bv[u] = b
                dv[u] = d
                e += COPY_THREADS
                d += td
                b += tb
                a += ta
                if d >= D:
                    d -= D
                    b += 1
                if b >= B:
                    b -= B
                    a += 1
            for u in range(COPY_UNROLL):  # all loads first: COPY_UNROLL in flight
                ac = min(av[u], A - 1)  # the last group may run past the window: read a valid address
                r, c, sw = (ac, dv[u], bv[u]) if channels_last else (bv[u], ac, dv[u])
                h = h0 + r
                w = w0 + sw
                if scatter:
                    values[u] = blocks[block_index(i, r, sw, c)]
                    if prefetch_old:
                        olds[u] = image_clamped(image, n, h, w, c)
                else:
                    inside = n_ok and 0 <= h < H and 0 <= w < W
                    value = image_clamped(image, nc, h, w, c)
                    values[u] = value if inside else element(0)
            for u in range(COPY_UNROLL):
                if ev[u] < e_end:
                    r, c, sw = (av[u], dv[u], bv[u]) if channels_last else (bv[u], av[u], dv[u])
                    if scatter:
                        h = h0 + r
                        w = w0 + sw
                        if 0 <= h < H and 0 <= w < W:
                            image_put(image, image_index(n, h, w, c), values[u], olds[u])
                    else:
                        blocks[block_index(i, r, sw, c)] = values[u]

    @cuda.jit
    def copy_transposed(image, blocks, indices, count, size_h, size_w, stride_h, stride_w, offset_h, offset_w):
        i = cuda.blockIdx.x
        live = i < count[0]  # a gather's row past the count: zeros, as a window off the image
        if scatter and not live:
            return  # the same for the whole thread block, before any barrier
        N, H, W, C = image_shape(image)
        n, h0, w0 = window(indices, i, stride_h, stride_w, offset_h, offset_w)
        n_ok = live and 0 <= n < N
        if scatter and not n_ok:
            return  # the same for the whole thread block, before any barrier
        nc = min(max(n, 0), N - 1)
        tx = cuda.threadIdx.x
        ty = cuda.threadIdx.y
        tile = cuda.shared.array(TILE_SHAPE, element)
        pixels = size_h * size_w
        inv_w = float32(1) / float32(size_w)
        c_tiles = -(-C // TILE)
        values = cuda.local.array(TILE_STEPS, element)
        olds = cuda.local.array(TILE_STEPS, element)
        # Thread block (i, part) takes every parts-th tile of window i.
        for t in range(cuda.blockIdx.y, -(-pixels // TILE) * c_tiles, cuda.gridDim.y):
            p0 = (t // c_tiles) * TILE
            c0 = (t - (t // c_tiles) * c_tiles) * TILE
            for k in range(TILE_STEPS):  # read the source along its contiguous axis
                j = ty + k * TILE_ROWS
                p = p0 + (j if source_last else tx)
                c = c0 + (tx if source_last else j)
                ok = p < pixels and c < C
                r, sw = split(min(p, pixels - 1), size_w, inv_w)
                cc = min(c, C - 1)
                if scatter:
                    value = blocks[block_index(i, r, sw, cc)]
                else:
                    h = h0 + r
                    w = w0 + sw
                    ok = ok and n_ok and 0 <= h < H and 0 <= w < W
                    value = image_clamped(image, nc, h, w, cc)
                values[k] = value if ok else element(0)
            for k in range(TILE_STEPS):
                tile[ty + k * TILE_ROWS, tx] = values[k]
            cuda.syncthreads()  # the tile is loaded
            if prefetch_old:
                for k in range(TILE_STEPS):  # the old values, all loads in flight at once
                    j = ty + k * TILE_ROWS
                    r, sw = split(min(p0 + (tx if source_last else j), pixels - 1), size_w, inv_w)
                    cc = min(c0 + (j if source_last else tx), C - 1)
                    olds[k] = image_clamped(image, n, h0 + r, w0 + sw, cc)
            for k in range(TILE_STEPS):  # write the destination along its own
                j = ty + k * TILE_ROWS
                p = p0 + (tx if source_last else j)
                c = c0 + (j if source_last else tx)
                if p < pixels and c < C:
                    r, sw = split(p, size_w, inv_w)
                    if scatter:
                        h = h0 + r
                        w = w0 + sw
                        if 0 <= h < H and 0 <= w < W:
                            image_put(image, image_index(n, h, w, c), tile[tx, j], olds[k])
                    else:
                        blocks[block_index(i, r, sw, c)] = tile[tx, j]
            cuda.syncthreads()  # the tile is read before the next one is loaded

    return copy_transposed if transpose else copy_plain
