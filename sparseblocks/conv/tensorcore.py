"""The block-sparse convolution's products on the tensor cores by gathering (``mma.sync``
m16n8k16, fp16 and bf16, fp32 sums): the readable form, and what runs where `implicit.py`'s
patch does not fit shared memory and for strided input gradients. No im2col buffer in global
memory.

It takes layouts of channel groups (`grouped`): every block joins an aligned group of G input
channels (G = 16, 32 or 64) to an aligned group of G output channels, as a `BlockLayout` of the
(input group, output group) grid would; any other layout runs the direct kernels (`simple.py`).
A thread block computes one output group's G channels at 64 output positions of one image: for
each block of that group, each 16 of its input channels and each tap, it stages the filter's
G x 16 slice (A: k along its rows) and the 16 x 64 input values the tap reads (B: the positions
along its rows, zeros where the tap lands in the padding or past the last position) in shared
memory, and its four warps multiply them (each 16 output channels by G positions). So every
stride, dilation and padding is one loop; the input is gathered a value a thread, which L1 serves
across the taps that reread it.

``forward(out, x, f, f_off, grp_ptr, grp_blk, blk_c0, geo, N, K, C, bias, edge, has_bias)``: the
arrays as `simple.make_forward` takes them, with ``grp_ptr``/``grp_blk`` the blocks of each output
group (a CSR over groups) and ``blk_c0`` each block's first input channel. Built ``transposed``, the
same kernel is the input gradient (the deconvolution's forward): groups of input channels, each
block's first output channel, the output gradient as ``x``.
"""

from numba import cuda, float32, int16, types

from ..bsmm.device import SHARED_ALIGN, converters
from ..ptx.cp_async import shared_address
from ..ptx.half2 import stored_as
from ..ptx.ldmatrix import ldmatrix_x4_at, ldmatrix_x4_trans_at
from ..ptx.mma import mma_bf16, mma_f16
from ..runtime.compile import inlined

POSITIONS = 64  # output positions a thread block
THREADS = 128
GROUPS = (64, 32, 16)
A_ROW = 16 + 8  # a staged filter row: 16 values and 16 bytes of padding (eight rows, eight bank groups)
B_ROW = POSITIONS + 8


@inlined
def source_of(o, t, r, s, geo):
    """Where tap (t, r, s) of output position ``o`` reads the input: its flat position d·H·W + h·W +
    w, or -1 where it lands in the padding (``geo`` as `simple.py` holds it)."""
    P, Q = geo[4], geo[5]
    m, p, q = o // (P * Q), (o // Q) % P, o % Q
    d = m * geo[9] - geo[12] + t * geo[15]
    h = p * geo[10] - geo[13] + r * geo[16]
    w = q * geo[11] - geo[14] + s * geo[17]
    if 0 <= d < geo[0] and 0 <= h < geo[1] and 0 <= w < geo[2]:
        return (d * geo[1] + h) * geo[2] + w
    return -1


def make_mma_pair(storage):
    """``mma_pair(acc, fa, fb, p2)``: acc's n-tiles 2 p2 and 2 p2 + 1 += A (fragments fa) times the
    two B fragments of one ldmatrix.x4 (fb)."""
    mma = mma_bf16 if storage == "bfloat16" else mma_f16

    @inlined
    def mma_pair(acc, fa, fb, p2):
        for h2 in range(2):
            nt = 2 * p2 + h2
            d4 = mma(fa[0], fa[1], fa[2], fa[3], fb[2 * h2], fb[2 * h2 + 1], acc[nt, 0], acc[nt, 1], acc[nt, 2],
                     acc[nt, 3])
            for j in range(4):
                acc[nt, j] = d4[j]

    return mma_pair


def grouped(blocks, C, K):
    """G where every block of ``blocks`` ((input channels, output channels) lists) is an aligned
    group of G input and G output channels, the largest of `GROUPS` that fits; else 0."""
    for G in GROUPS:
        if C % G or K % G:
            continue
        if all(len(cs) == G and len(ks) == G and cs[0] % G == 0 and ks[0] % G == 0
               and list(cs) == list(range(cs[0], cs[0] + G)) and list(ks) == list(range(ks[0], ks[0] + G))
               for cs, ks in blocks):
            return G
    return 0


def make_forward_tc(storage, G, transposed=False):
    """``transposed``: the input gradient (the deconvolution's forward) instead: output rows the
    input channels, the filter's slice read transposed, the output gradient gathered where a tap
    of an input position lands on an output position (d = m u - pad + t a: m = (d + pad - t a) / u
    where that divides)."""
    WK = G // 16  # warps along the output channels
    WIDTH = POSITIONS * WK // 4  # positions a warp
    NT = WIDTH // 8
    SMEM_T = int16 if storage == "bfloat16" else types.float16
    mma_pair = make_mma_pair(storage)
    widen, _ = converters(storage, float32)
    narrow = stored_as(storage)

    @cuda.jit
    def forward(out, x, f, f_off, grp_ptr, grp_blk, blk_c0, geo, N, K, C, bias, edge, has_bias):
        D, H, W, M, P, Q = geo[0], geo[1], geo[2], geo[3], geo[4], geo[5]
        T, R, S = geo[6], geo[7], geo[8]
        MPQ, DHW, TRS = M * P * Q, D * H * W, T * R * S
        # (transposed: out is the input gradient over DHW, rows C; x the output gradient, K rows)
        OUT_POS, OUT_ROWS, IN_ROWS = (DHW, C, K) if transposed else (MPQ, K, C)
        tid = cuda.threadIdx.x
        lane, warp = tid % 32, tid // 32
        wk, wp = warp % WK, warp // WK
        pos0, g, n = cuda.blockIdx.x * POSITIONS, cuda.blockIdx.y, cuda.blockIdx.z
        a_tile = cuda.shared.array((G, A_ROW), SMEM_T, alignment=SHARED_ALIGN)
        b_tile = cuda.shared.array((16, B_ROW), SMEM_T, alignment=SHARED_ALIGN)
        acc = cuda.local.array((NT, 4), float32)
        for i in range(NT):
            for j in range(4):
                acc[i, j] = float32(0)
        q8, r8 = lane // 8, lane % 8
        a_at = shared_address(a_tile, (wk * 16 + (q8 % 2) * 8 + r8, (q8 // 2) * 8))
        b_at = shared_address(b_tile, ((q8 % 2) * 8 + r8, wp * WIDTH + (q8 // 2) * 8))
        for e in range(grp_ptr[g], grp_ptr[g + 1]):
            b = grp_blk[e]
            for c16 in range(0, G, 16):
                c_first = blk_c0[b] + c16
                for tap in range(TRS):
                    t, r, s = tap // (R * S), (tap // S) % R, tap % S
                    for i in range(tid, G * 16, THREADS):  # the filter's slice: k along A's rows
                        row, c = i // 16, i % 16
                        if transposed:  # (block b's filter is (G outputs, G inputs, taps): rows are inputs)
                            a_tile[row, c] = f[f_off[b] + (((c16 + c) * G + row) * TRS + tap)]
                        else:
                            a_tile[row, c] = f[f_off[b] + ((row * G + c16 + c) * TRS + tap)]
                    for i in range(tid, 16 * POSITIONS, THREADS):  # the values this tap reads
                        c, o = i // POSITIONS, pos0 + i % POSITIONS
                        value = SMEM_T(0)
                        if o < OUT_POS:
                            if transposed:
                                d, h, w = o // (H * W), (o // W) % H, o % W
                                m = d + geo[12] - t * geo[15]
                                p = h + geo[13] - r * geo[16]
                                q = w + geo[14] - s * geo[17]
                                if (m >= 0 and p >= 0 and q >= 0 and m % geo[9] == 0 and p % geo[10] == 0
                                        and q % geo[11] == 0):
                                    m, p, q = m // geo[9], p // geo[10], q // geo[11]
                                    if m < M and p < P and q < Q:
                                        value = x[(n * IN_ROWS + c_first + c) * MPQ + (m * P + p) * Q + q]
                            else:
                                at = source_of(o, t, r, s, geo)
                                if at >= 0:
                                    value = x[(n * IN_ROWS + c_first + c) * DHW + at]
                        b_tile[c, i % POSITIONS] = value
                    cuda.syncthreads()
                    fa = ldmatrix_x4_at(a_at)
                    for p2 in range(NT // 2):
                        mma_pair(acc, fa, ldmatrix_x4_trans_at(b_at + 32 * p2), p2)
                    cuda.syncthreads()  # (every warp done with the tiles before the next are staged)
        gid, t4 = lane // 4, lane % 4
        for nt in range(NT):
            for j in range(4):
                k = g * G + wk * 16 + gid + 8 * (j // 2)
                o = pos0 + wp * WIDTH + 8 * nt + 2 * t4 + j % 2
                if o < OUT_POS:
                    value = acc[nt, j]
                    if not transposed and has_bias and edge[o] >= 0:
                        value += widen(bias[k, edge[o]])
                    out[(n * OUT_ROWS + k) * OUT_POS + o] = narrow(value)

    return forward


def make_filter_grad_tc(storage, G):
    """The filter gradient of aligned channel groups: a thread block a (block, tap), dF[k, c] = the
    sum over images and output positions of dy[n, k, o] x[n, c, where tap t of o lands], as
    A (G x positions, dy: k along A's rows) times B (positions x G, x gathered as rows of c). Its
    warps split the G x G tile into 16-row strips and, where G < 64, the positions too (``WS`` ways,
    summed through shared memory at the end): every sum in the same order on every run.

    ``filter_grad(out, dy, x, f_off, blk_c0, blk_k0, geo, N, K, C)``."""
    WK = G // 16
    WS = 4 // WK  # ways the positions split across warps
    CHUNK = 16 * WS  # positions staged a step
    NT = G // 8
    PARTS = 4 * NT  # a lane's accumulators
    A_W = CHUNK + 8  # a staged row: CHUNK values and 16 bytes of padding
    SMEM_T = int16 if storage == "bfloat16" else types.float16
    mma_pair = make_mma_pair(storage)
    narrow = stored_as(storage)

    @cuda.jit
    def filter_grad(out, dy, x, f_off, blk_c0, blk_k0, geo, N, K, C):
        D, H, W, M, P, Q = geo[0], geo[1], geo[2], geo[3], geo[4], geo[5]
        T, R, S = geo[6], geo[7], geo[8]
        MPQ, DHW, TRS = M * P * Q, D * H * W, T * R * S
        tid = cuda.threadIdx.x
        lane, warp = tid % 32, tid // 32
        wk, ws = warp % WK, warp // WK
        b, tap = cuda.blockIdx.y, cuda.blockIdx.x
        t, r, s = tap // (R * S), (tap // S) % R, tap % S
        k0, c0 = blk_k0[b], blk_c0[b]
        a_tile = cuda.shared.array((G, A_W), SMEM_T, alignment=SHARED_ALIGN)  # dy: rows k
        b_tile = cuda.shared.array((G, A_W), SMEM_T, alignment=SHARED_ALIGN)  # x: rows c
        sums = cuda.shared.array((4, 32, PARTS), float32)  # (the k-split warps' partial sums)
        acc = cuda.local.array((NT, 4), float32)
        for i in range(NT):
            for j in range(4):
                acc[i, j] = float32(0)
        q8, r8 = lane // 8, lane % 8
        a_at = shared_address(a_tile, (wk * 16 + (q8 % 2) * 8 + r8, ws * 16 + (q8 // 2) * 8))
        b_at = shared_address(b_tile, ((q8 // 2) * 8 + r8, ws * 16 + (q8 % 2) * 8))
        for n in range(N):
            for start in range(0, MPQ, CHUNK):
                for i in range(tid, G * CHUNK, THREADS):
                    row, j = i // CHUNK, i % CHUNK
                    o = start + j
                    da = SMEM_T(0)
                    xb = SMEM_T(0)
                    if o < MPQ:
                        da = dy[(n * K + k0 + row) * MPQ + o]
                        at = source_of(o, t, r, s, geo)
                        if at >= 0:
                            xb = x[(n * C + c0 + row) * DHW + at]
                    a_tile[row, j] = da
                    b_tile[row, j] = xb
                cuda.syncthreads()
                fa = ldmatrix_x4_at(a_at)
                for p2 in range(NT // 2):
                    mma_pair(acc, fa, ldmatrix_x4_at(b_at + 16 * A_W * 2 * p2), p2)
                cuda.syncthreads()
        if WS > 1:  # the k-split warps' sums, added in the order of their warps
            for nt in range(NT):
                for j in range(4):
                    sums[warp, lane, nt * 4 + j] = acc[nt, j]
            cuda.syncthreads()
            if ws == 0:
                for other in range(1, WS):
                    for nt in range(NT):
                        for j in range(4):
                            acc[nt, j] += sums[wk + WK * other, lane, nt * 4 + j]
        gid, t4 = lane // 4, lane % 4
        if ws == 0:
            for nt in range(NT):
                for j in range(4):
                    k = wk * 16 + gid + 8 * (j // 2)
                    c = 8 * nt + 2 * t4 + j % 2
                    out[f_off[b] + ((k * G + c) * TRS + tap)] = narrow(acc[nt, j])

    return filter_grad
