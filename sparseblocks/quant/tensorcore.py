"""The fast product: bit-plane products on ``mma.sync`` m16n8k256 b1 ``and.popc`` tensor cores.

The same sums as the teaching kernel (`simple`): a warp owns ``warp_rows`` rows and a group of
``group_cols`` outputs (a block-column of the layout, or ``dense_cols`` of a dense product), and
for each pair of planes (j, k) runs over the words its outputs see, 8 words (256 k-slots) a step.
Slot s of a step is word ``s`` of the group's word list (its present blocks' words, in order);
lane t of a quad takes slots 2t and 2t + 1 (its registers of k from 32t and from 128 + 32t),
for A (its rows g and g + 8) and B (its column g) alike, so the two operands agree on every
slot whatever words they hold. Where blocks are whole word pairs (a dense row, blocks of 64) the
two slots are neighbouring words, read by one 8-byte load. Words past the list's end, rows past
N and outputs past O load as zeros.

``P`` comes from the mma in the accumulator layout. ``pa`` (activation popcount a row) and ``pb``
(weight popcount a column, signed activations only) are SIMT ``popc`` of the fragments a lane
already holds, summed over the quad's four lanes at the end of the pair; ``pb`` is then moved to
the lanes whose accumulators hold that column. Each pair's integers are scaled by ``u_j · v[o, k]``
into fp32 accumulators; bias, ReLU and the conversion to the output's dtype close.
"""

from numba import cuda, float32, int32, uint32

from ..ptx.mma import B1_WORDS, mma_b1_and
from ..ptx.vector import load2
from .simple import make_epilogue, make_plane_dot

FULL_MASK = 0xFFFFFFFF


def make_tensorcore_product(cfg, a_bits, w_bits, signed_a, signed_w, bias, relu, block_words,
                            group_cols, warps):
    plane_dot = make_plane_dot(signed_a, signed_w)
    store = make_epilogue(bias, relu)
    MT = cfg.warp_rows // 16
    NT = group_cols // 8
    WARPS = warps  # (cfg.warps, fewer where N has fewer rows)
    need_pb = signed_a
    PAIRED = block_words % 2 == 0  # slots 2t, 2t + 1 are neighbouring words, 8-byte aligned

    @cuda.jit(device=True, inline=True)
    def word_of(blocks, first, slot, total):
        """The word index of list slot `slot` (-1 past the list's end)."""
        if slot >= total:
            return int32(-1)
        i = slot // block_words
        return blocks[first + i] * block_words + (slot - i * block_words)

    @cuda.jit(device=True, inline=True)
    def load(planes, plane, row, rows, word):
        if row < rows and word >= 0:
            return uint32(planes[plane, row, word])
        return uint32(0)

    @cuda.jit(device=True, inline=True)
    def load_pair(planes, plane, row, rows, word):
        if row < rows and word >= 0:
            return load2(planes, (plane, row, word))
        return uint32(0), uint32(0)

    @cuda.jit(device=True, inline=True)
    def fragments(planes, plane, row, rows, w0, w1):
        """The words of list slots 2t and 2t + 1 of a row."""
        if PAIRED:
            return load_pair(planes, plane, row, rows, w0)
        return load(planes, plane, row, rows, w0), load(planes, plane, row, rows, w1)

    @cuda.jit
    def product(y, a_planes, w_planes, a_basis, w_basis, bias_values, ptr, blocks, seen_a_block):
        lane = cuda.threadIdx.x % 32
        warp = cuda.threadIdx.x // 32
        g = lane >> 2
        t = lane % 4
        N = y.shape[0]
        O = y.shape[1]
        row0 = (cuda.blockIdx.y * WARPS + warp) * (MT * 16)
        group = cuda.blockIdx.x
        col0 = group * group_cols
        first = ptr[group]
        count = ptr[group + 1] - first
        total = count * block_words
        seen = count * seen_a_block
        steps = (total + B1_WORDS - 1) // B1_WORDS

        out = cuda.local.array((MT, NT, 4), float32)
        for mt in range(MT):
            for nt in range(NT):
                for i in range(4):
                    out[mt, nt, i] = float32(0)
        acc = cuda.local.array((MT, NT, 4), int32)
        pa = cuda.local.array((MT, 2), int32)
        pb = cuda.local.array(NT, int32)
        af = cuda.local.array((MT, 4), uint32)
        bf = cuda.local.array((NT, 2), uint32)
        for j in range(a_bits):
            for k in range(w_bits):
                for mt in range(MT):
                    pa[mt, 0] = 0
                    pa[mt, 1] = 0
                    for nt in range(NT):
                        for i in range(4):
                            acc[mt, nt, i] = 0
                for nt in range(NT):
                    pb[nt] = 0
                for step in range(steps):
                    w0 = word_of(blocks, first, step * B1_WORDS + 2 * t, total)
                    w1 = word_of(blocks, first, step * B1_WORDS + 2 * t + 1, total)
                    for mt in range(MT):
                        r = row0 + mt * 16 + g
                        lo = fragments(a_planes, j, r, N, w0, w1)
                        hi = fragments(a_planes, j, r + 8, N, w0, w1)
                        af[mt, 0] = lo[0]
                        af[mt, 2] = lo[1]
                        af[mt, 1] = hi[0]
                        af[mt, 3] = hi[1]
                        pa[mt, 0] += cuda.popc(lo[0]) + cuda.popc(lo[1])
                        pa[mt, 1] += cuda.popc(hi[0]) + cuda.popc(hi[1])
                    for nt in range(NT):
                        column = fragments(w_planes, k, col0 + nt * 8 + g, O, w0, w1)
                        bf[nt, 0] = column[0]
                        bf[nt, 1] = column[1]
                        if need_pb:
                            pb[nt] += cuda.popc(column[0]) + cuda.popc(column[1])
                    for mt in range(MT):
                        for nt in range(NT):
                            d = mma_b1_and(af[mt, 0], af[mt, 1], af[mt, 2], af[mt, 3], bf[nt, 0], bf[nt, 1],
                                           acc[mt, nt, 0], acc[mt, nt, 1], acc[mt, nt, 2], acc[mt, nt, 3])
                            acc[mt, nt, 0] = d[0]
                            acc[mt, nt, 1] = d[1]
                            acc[mt, nt, 2] = d[2]
                            acc[mt, nt, 3] = d[3]
                # the quad's sums: pa of rows g and g + 8, pb of column g
                for mt in range(MT):
                    for h in range(2):
                        pa[mt, h] += cuda.shfl_xor_sync(FULL_MASK, pa[mt, h], 1)
                        pa[mt, h] += cuda.shfl_xor_sync(FULL_MASK, pa[mt, h], 2)
                uj = a_basis[j]
                for nt in range(NT):
                    pb_lo = int32(0)
                    pb_hi = int32(0)
                    if need_pb:
                        pb[nt] += cuda.shfl_xor_sync(FULL_MASK, pb[nt], 1)
                        pb[nt] += cuda.shfl_xor_sync(FULL_MASK, pb[nt], 2)
                        pb_lo = cuda.shfl_sync(FULL_MASK, pb[nt], 8 * t)  # column 2t's quad
                        pb_hi = cuda.shfl_sync(FULL_MASK, pb[nt], 8 * t + 4)  # column 2t + 1's
                    c = col0 + nt * 8 + 2 * t
                    v_lo = w_basis[c, k] if c < O else float32(0)
                    v_hi = w_basis[c + 1, k] if c + 1 < O else float32(0)
                    for mt in range(MT):
                        out[mt, nt, 0] += uj * v_lo * float32(plane_dot(acc[mt, nt, 0], pa[mt, 0], pb_lo, seen))
                        out[mt, nt, 1] += uj * v_hi * float32(plane_dot(acc[mt, nt, 1], pa[mt, 0], pb_hi, seen))
                        out[mt, nt, 2] += uj * v_lo * float32(plane_dot(acc[mt, nt, 2], pa[mt, 1], pb_lo, seen))
                        out[mt, nt, 3] += uj * v_hi * float32(plane_dot(acc[mt, nt, 3], pa[mt, 1], pb_hi, seen))
        for mt in range(MT):
            for nt in range(NT):
                for i in range(4):
                    r = row0 + mt * 16 + g + 8 * (i // 2)
                    c = col0 + nt * 8 + 2 * t + i % 2
                    if r < N and c < O:
                        store(y, r, c, out[mt, nt, i], bias_values)

    return product
