"""Tensor-core products (version 5): ``mma.sync`` through inline PTX (`ptx.mma`).

Blocks 16-64, storage fp16, bf16 (m16n8k16) and fp32 (3xTF32: three m16n8k8, each
step's result added in round-to-nearest fp32). A thread block of
``v5_warps[bs]`` warps owns a 128-row output tile, handed out in groups of row
tiles (`device.grouped_tile`); stages of 32-bit words go through a ring of
``v5_stages`` shared buffers fed by cp.async where activation rows are 16-byte
aligned, else double-buffered through registers. `make_transpose_blocks` copies
W's blocks transposed into the forward's order (`BsmmConfig.v5_transposed_forward`).
"""

from numba import cuda, float32, int32, uint32, uint64

from ..ptx.cp_async import commit, copy16_to, global_address, shared_address, waiter
from ..ptx.mma import MMA_M, MMA_N, pack
from ..ptx.vector import load4
from ..runtime.launch import dynamic_shared
from .device import (
    SHARED_ALIGN,
    activation_io,
    chunk_position,
    grouped_tile,
    interleave,
    mma_accumulate,
    product_output,
)

V5_BLOCKS = (16, 32, 64, 128)  # products; the weight gradient's: V5_WGRAD_BLOCKS
V5_WGRAD_BLOCKS = (16, 32, 64, 128)


V5_STORAGE = ("float16", "bfloat16", "float32")


def make_transpose_blocks(cfg, bs, storage, acc_type):
    """``wt[p] = w[col_block[p]]ᵀ`` over 32-bit words (pairs of 16-bit values along a row,
    or fp32 values): W's blocks transposed into the forward's order, for V5_TRANSPOSED_FORWARD.
    A block a thread block, through a shared tile padded by a word a row. Each thread's
    words are a fixed count (`transpose_threads`), so its loads are all issued before the
    first is stored (in a loop of unknown trip count each load would wait on the last)."""
    VALUES = v5_values(storage)
    WORDS = bs // VALUES  # words a row, in w and in wt
    STRIDE = WORDS + 1
    SIZE = bs * WORDS
    TILE = bs * STRIDE
    THREADS = transpose_threads(cfg, bs, storage)
    EACH = SIZE // THREADS

    @cuda.jit
    def transpose_blocks(wt, w, col_block):
        p = cuda.blockIdx.x
        block = col_block[p]
        tile = cuda.shared.array(0, uint32)  # TILE words (dynamic: fp32 blocks of 128 take 66 KB)
        held = cuda.local.array(EACH, uint32)
        for i in range(EACH):
            e = cuda.threadIdx.x + i * THREADS
            held[i] = uint32(w[block, e // WORDS, e % WORDS])
        for i in range(EACH):
            e = cuda.threadIdx.x + i * THREADS
            tile[(e // WORDS) * STRIDE + e % WORDS] = held[i]
        cuda.syncthreads()  # the whole block is in the tile before any thread reads a column
        for i in range(EACH):
            e = cuda.threadIdx.x + i * THREADS
            c, q = e // WORDS, e % WORDS  # wt's row c (w's column), word q (w's rows VALUES q...)
            if VALUES == 2:
                lo = tile[2 * q * STRIDE + c // 2]
                hi = tile[(2 * q + 1) * STRIDE + c // 2]
                if c % 2 == 0:
                    v = (lo & uint32(0xFFFF)) | (hi << uint32(16))
                else:
                    v = (lo >> uint32(16)) | (hi & uint32(0xFFFF0000))
            else:
                v = tile[q * STRIDE + c]
            wt[p, c, q] = int32(v)

    return dynamic_shared(transpose_blocks, 4 * TILE)


def v5_values(storage):
    """Values a 32-bit word of version 5's shared tiles holds: two 16-bit ones or one fp32."""
    return 1 if storage == "float32" else 2


def v5_ring(cfg, vector, feature_axis):
    """Whether a version 5 product stages through the cp.async ring (see V5_STAGES)."""
    V5_STAGES = cfg.v5_stages
    return V5_STAGES > 2 and vector and feature_axis == 1


def v5_shape(cfg, bs, storage, ring=False):
    """(threads, rows a tile, warps across the features, 32-bit words of a row a stage, values
    a word, rows a warp) of a version 5 product (`ring`: one that stages through the ring)."""
    V5_RING_WARPS = cfg.v5_ring_warps
    V5_STAGE_WORDS = cfg.v5_stage_words
    V5_WARPS = cfg.v5_warps
    V5_WARP_ROWS = cfg.v5_warp_rows
    V5_WARP_TILE = cfg.v5_warp_tile
    values = v5_values(storage)
    warps, rows = V5_RING_WARPS.get((bs, storage), (V5_WARPS[bs], V5_WARP_ROWS[bs])) if ring \
        else (V5_WARPS[bs], V5_WARP_ROWS[bs])
    col_warps = bs // min(bs, V5_WARP_TILE)
    words = min(bs // values, V5_STAGE_WORDS.get((bs, storage), bs // values))
    return 32 * warps, rows * warps // col_warps, col_warps, words, values, rows


def make_product_v5(cfg, bs, storage, acc_type, transpose_w, feature_axis, vector=False):
    """Products on tensor cores: ``mma.sync`` m16n8k16 (fp16, bf16) or 3 x m16n8k8 (fp32, 3xTF32).

    Warps own V5_WARP_ROWS x min(bs, 32) patches of a 128-row tile (32 rows, or 64 for the
    ring's block 64, V5_RING_WARPS: two or four 16-row by up to four 8-column mma tiles each,
    fp32 accumulators). Shared memory holds a
    stage of the tile's activations and of the block's weights as 32-bit
    words along the feature (k) axis: pairs of 16-bit values, or single fp32
    values, as the fragments take them (`_mma.py`), so every fragment register
    is one 32-bit shared load; rows are padded (A by 4 words, W by 8) so that
    the fragment reads of a warp hit 32 distinct banks. A stage is a whole
    block's k, or V5_STAGE_WORDS words of it. With two stages (V5_STAGES = 2,
    or loads that are not 16-byte activation rows) they are double-buffered
    through registers: the next one's global loads are in flight while this
    one is multiplied, then stored to the other buffer, one barrier a stage. With
    ``vector`` (the launcher checked alignment; the arrays are then int32 word
    views) every global load reads 16 bytes: four words of one activation row
    (feature_axis 1), eight rows of two features (axis 0, 16-bit storage), or
    their weight counterparts; otherwise each value is read alone. Rows past
    N read the last row: a row's outputs depend on that row alone, and they are
    not written. W is read transposed for input_grad.

    With V5_STAGES > 2 (the default, 3) and 16-byte activation rows
    (feature_axis 1), stages form a ring of V5_STAGES buffers instead (up to
    81 KB of shared memory a thread block: fp16 block 64, whole blocks a
    stage): activation units (and fp32 weight units of the forward product,
    also plain 16-byte rows in shared memory, and the input gradient's weights,
    kept there as rows of k words, one per output feature, outside
    V5_WEIGHT_REGISTERS) are copied by cp.async without passing through
    registers, V5_STAGES - 1 stages ahead of the multiply; the rest of the
    weights (16-bit forward weights, interleaved into k pairs) still pass
    through registers, deposited after the multiply into the buffer the
    barrier just freed. Each thread takes its copies' addresses once, before
    the loop, and adds a stage's offset to them.
    """
    PRODUCT_GROUP = cfg.product_group
    V5_STAGES = cfg.v5_stages
    V5_WEIGHT_REGISTERS = cfg.v5_weight_registers
    STAGES = V5_STAGES if v5_ring(cfg, vector, feature_axis) else 2
    T, TM, CW, KW, VALUES, ROWS = v5_shape(cfg, bs, storage, STAGES > 2)
    WN = bs // CW  # output features a warp owns
    MT = ROWS // MMA_M
    NT = WN // MMA_N
    SPB = bs // (KW * VALUES)  # stages a block
    STEPS = KW // 8  # mma steps a stage: 8 words of k each (k16 of 16-bit values, k8 of fp32)
    A_ASYNC = STAGES > 2  # activation units copied straight into shared memory
    # input_grad in the ring: W's stored rows (one per output feature, k along them) are shared
    # rows of k words as the activations' are, so that they too go by cp.async; otherwise W is
    # k-major in shared memory, and copied so only where its rows are that already (fp32 forward).
    W_ROWS = A_ASYNC and transpose_w and (bs, storage) not in V5_WEIGHT_REGISTERS
    W_ASYNC = W_ROWS or (A_ASYNC and VALUES == 1 and not transpose_w)
    A_STRIDE = KW + 4
    W_STRIDE = KW + 4 if W_ROWS else bs + 8
    A_TILE = TM * A_STRIDE
    W_TILE = bs * W_STRIDE if W_ROWS else KW * W_STRIDE
    A_SIZE = STAGES * A_TILE
    W_SIZE = STAGES * W_TILE
    wait = waiter(max(STAGES - 2, 0))
    PAIRS = VALUES == 2
    # Words a global load unit leaves in shared memory, and units a stage.
    if not vector:
        A_UNIT = W_UNIT = 1
    else:
        A_UNIT = 4 if feature_axis == 1 else 4 * VALUES
        W_UNIT = 4 if transpose_w else 4 * VALUES
    A_UNITS = TM * KW // A_UNIT
    W_UNITS = KW * bs // W_UNIT
    A_PER = -(-A_UNITS // T)
    W_PER = -(-W_UNITS // T)
    A_HELD = 1 if A_ASYNC else A_PER * A_UNIT  # words of the next stage a thread holds in registers
    W_HELD = 1 if W_ASYNC else W_PER * W_UNIT
    A_ALL = A_UNITS % T == 0  # every thread has A_PER units (no bound test)
    W_ALL = W_UNITS % T == 0
    accumulate = mma_accumulate(cfg, storage)
    load, _ = activation_io(feature_axis)
    emit = product_output(bs, storage, acc_type, feature_axis)
    a_position = chunk_position(feature_axis, TM, KW)  # scalar loads: (row, word)

    @cuda.jit(device=True, inline=True)
    def word(lo, hi):
        """One shared word from 16-bit values lo and hi (k and k + 1), or from one fp32 value."""
        if PAIRS:
            return pack(lo, hi)
        return uint32(lo)

    @cuda.jit(device=True, inline=True)
    def hold_across(held, i, array, index, index_next):
        """The words of unit i from a 16-byte load at index that runs across k (activation rows
        with feature_axis 0, weight columns of W): as they are (fp32), or paired with the load at
        index_next (value k + 1, 16-bit) into eight words."""
        x0 = load4(array, index)
        if PAIRS:
            x1 = load4(array, index_next)
            for c in range(8):
                held[i * 8 + c] = interleave(x0, x1, c)
        else:
            for c in range(4):
                held[i * 4 + c] = uint32(x0[c])

    @cuda.jit(device=True, inline=True)
    def a_row_source(e, row0, n_rows, base):
        """(row, word) of the 16 bytes of vector activation unit e with feature_axis 1."""
        row = uint64(min(row0 + e // (KW // 4), n_rows - 1))
        return row, uint64(base // VALUES + 4 * (e % (KW // 4)))

    @cuda.jit(device=True, inline=True)
    def w_row_source(e, block, k0):
        """(block, k, column) of the 4 * VALUES columns of one k of vector weight unit e, untransposed."""
        return block, uint64(k0 + VALUES * (e // (bs // W_UNIT))), uint64((e % (bs // W_UNIT)) * (W_UNIT // VALUES))

    @cuda.jit(device=True, inline=True)
    def fetch_a(a, pa, e, i, row0, n_rows, base):
        """Unit e of a stage of activations (features base...) into pa[i * A_UNIT...]."""
        if not vector:
            r, p = a_position(e)
            row = uint64(min(row0 + r, n_rows - 1))
            k = uint64(base + VALUES * p)
            pa[i] = word(load(a, row, k), load(a, row, k + uint64(1)) if PAIRS else 0)
        elif feature_axis == 1:
            v = load4(a, a_row_source(e, row0, n_rows, base))
            for c in range(4):
                pa[i * 4 + c] = uint32(v[c])
        else:
            # Rows in whole vectors (n_rows is a multiple of 4 * VALUES): a unit is wholly
            # in or past the end, and one past it reads the last vector instead.
            p = e % KW
            n0 = uint64(min(row0 + (e // KW) * A_UNIT, n_rows - A_UNIT) // VALUES)
            k = uint64(base + VALUES * p)
            hold_across(pa, i, a, (k, n0), (k + uint64(1), n0))

    @cuda.jit(device=True, inline=True)
    def a_slots(e):
        """(row, word) of the first shared word of activation unit e, and the step between its
        words (1 along a row, A_STRIDE down rows)."""
        if not vector:
            r, p = a_position(e)
            return r, p, 1
        if feature_axis == 1:
            return e // (KW // 4), 4 * (e % (KW // 4)), 1
        return (e // KW) * A_UNIT, e % KW, A_STRIDE

    @cuda.jit(device=True, inline=True)
    def fetch_w(w, pw, e, i, block, k0):
        """Unit e of a stage of weights (features k0... of the block's k axis) into pw[i * W_UNIT...]."""
        if not vector:
            if transpose_w:
                p, col = e % KW, e // KW
                k = uint64(k0 + VALUES * p)
                pw[i] = word(w[block, uint64(col), k], w[block, uint64(col), k + uint64(1)] if PAIRS else 0)
            else:
                p, col = e // bs, e % bs
                k = uint64(k0 + VALUES * p)
                pw[i] = word(w[block, k, uint64(col)], w[block, k + uint64(1), uint64(col)] if PAIRS else 0)
        elif transpose_w:
            # Four words along k of one column of W (a row of the stored block).
            col = uint64(e // (KW // 4))
            v = load4(w, (block, col, uint64(k0 // VALUES + 4 * (e % (KW // 4)))))
            for c in range(4):
                pw[i * 4 + c] = uint32(v[c])
        else:
            # 4 * VALUES columns of one k word: one (fp32) or two (16-bit) rows of the block.
            _, k, cols = w_row_source(e, block, k0)
            hold_across(pw, i, w, (block, k, cols), (block, k + uint64(1), cols))

    @cuda.jit(device=True, inline=True)
    def w_slots(e):
        """(word, col) of the first shared word of weight unit e, and the step between its words."""
        if not vector:
            if transpose_w:
                return e % KW, e // KW, 1
            return e // bs, e % bs, 1
        if transpose_w:
            return 4 * (e % (KW // 4)), e // (KW // 4), W_STRIDE
        return e // (bs // W_UNIT), (e % (bs // W_UNIT)) * W_UNIT, 1

    @cuda.jit(device=True, inline=True)
    def a_slot(e, buf):
        r, p, step = a_slots(e)
        return uint64(buf * A_TILE + r * A_STRIDE + p), step

    @cuda.jit(device=True, inline=True)
    def w_slot(e, buf):
        p, col, step = w_slots(e)
        if W_ROWS:
            return uint64(buf * W_TILE + col * W_STRIDE + p), 1
        return uint64(buf * W_TILE + p * W_STRIDE + col), step

    @cuda.jit(device=True, inline=True)
    def w_stage_offset(block, k0):
        """Bytes from w's start to the stage of block at k0, for the copy_offsets of block 0 at 0."""
        if W_ROWS:
            return (block * uint64(bs * (bs // VALUES)) + uint64(k0 // VALUES)) * uint64(4)
        return (block * uint64(bs) + uint64(k0)) * uint64(bs * 4)

    @cuda.jit(device=True, inline=True)
    def copy_offsets(a, a_from, a_to, w_from, w_to, tid, row0, n_rows):
        """Byte offsets of this thread's cp.async units in the first stage: from a (features
        0...) and w (block 0, k 0...), to buffer 0."""
        for i in range(A_PER):
            e = tid + i * T
            if A_ALL or e < A_UNITS:
                row, word = a_row_source(e, row0, n_rows, 0)
                a_from[i] = (row * uint64(a.shape[1]) + word) * uint64(4)
                a_to[i] = a_slot(e, 0)[0] * uint64(4)
        if W_ASYNC:
            for i in range(W_PER):
                e = tid + i * T
                if W_ALL or e < W_UNITS:
                    if W_ROWS:  # four words along k (from word p) of stored row (output feature) col
                        p, col, _ = w_slots(e)
                        w_from[i] = (uint64(col) * uint64(bs // VALUES) + uint64(p)) * uint64(4)
                    else:
                        _, k, col = w_row_source(e, uint64(0), 0)
                        w_from[i] = (k * uint64(bs) + col) * uint64(4)
                    w_to[i] = w_slot(e, 0)[0] * uint64(4)

    @cuda.jit(device=True, inline=True)
    def fetch(a, w, pa, pw, tid, row0, n_rows, j, k0, other_idx, line_block, copies, buf):
        """This thread's share of one stage (block j, features k0...) into registers, or with
        cp.async, on its way to buffer buf: copies = (shared addresses of a_s and w_s, global
        addresses of a and w, then the byte offsets of copy_offsets)."""
        block = uint64(j if transpose_w else line_block[j])
        base = other_idx[j] * bs + k0
        a_shared, w_shared, a_global, w_global, a_from, a_to, w_from, w_to = copies
        for i in range(A_PER):
            e = tid + i * T
            if A_ALL or e < A_UNITS:
                if A_ASYNC:
                    copy16_to(a_shared + (a_to[i] + uint64(buf * A_TILE * 4)),
                              a_global + (a_from[i] + uint64(base // VALUES) * uint64(4)))
                else:
                    fetch_a(a, pa, e, i, row0, n_rows, base)
        for i in range(W_PER):
            e = tid + i * T
            if W_ALL or e < W_UNITS:
                if W_ASYNC:
                    copy16_to(w_shared + (w_to[i] + uint64(buf * W_TILE * 4)),
                              w_global + (w_from[i] + w_stage_offset(block, k0)))
                else:
                    fetch_w(w, pw, e, i, block, k0)

    @cuda.jit(device=True, inline=True)
    def deposit(a_s, w_s, pa, pw, tid, buf):
        """The register-held part of a stage (if any) into buffer buf."""
        if not A_ASYNC:
            for i in range(A_PER):
                e = tid + i * T
                if A_ALL or e < A_UNITS:
                    at, step = a_slot(e, buf)
                    for c in range(A_UNIT):
                        a_s[at + uint64(c * step)] = pa[i * A_UNIT + c]
        if not W_ASYNC:
            for i in range(W_PER):
                e = tid + i * T
                if W_ALL or e < W_UNITS:
                    at, step = w_slot(e, buf)
                    for c in range(W_UNIT):
                        w_s[at + uint64(c * step)] = pw[i * W_UNIT + c]

    @cuda.jit(device=True, inline=True)
    def multiply(a_s, w_s, acc, fa, buf, s, ar, t, bc):
        """acc += step s of the stage in buffer buf (8 words of k) for this lane's fragments:
        A rows ar, ar + 8 (and 16 below), words t, t + 4; B words t, t + 4, columns bc + 8 nt."""
        for mt in range(MT):
            at = uint64(buf * A_TILE + (ar + mt * MMA_M) * A_STRIDE + s * 8 + t)
            fa[mt, 0] = a_s[at]
            fa[mt, 1] = a_s[at + uint64(8 * A_STRIDE)]
            fa[mt, 2] = a_s[at + uint64(4)]
            fa[mt, 3] = a_s[at + uint64(8 * A_STRIDE + 4)]
        for nt in range(NT):
            if W_ROWS:  # column bc + 8 nt is a row of words along k
                at = uint64(buf * W_TILE + (bc + nt * MMA_N) * W_STRIDE + s * 8 + t)
                b0 = w_s[at]
                b1 = w_s[at + uint64(4)]
            else:
                at = uint64(buf * W_TILE + (s * 8 + t) * W_STRIDE + bc + nt * MMA_N)
                b0 = w_s[at]
                b1 = w_s[at + uint64(4 * W_STRIDE)]
            for mt in range(MT):
                accumulate(acc, mt, nt, fa, mt, b0, b1)

    @cuda.jit
    def product_v5(out, workspace, a, w, seg_line, seg_begin, seg_end, seg_slot,
                   other_idx, line_block, n_rows):
        tid = cuda.threadIdx.x
        lane = tid % 32
        warp = tid // 32
        g = lane >> 2
        t = lane % 4
        wr = (warp // CW) * (MT * MMA_M)  # the warp's first row and feature in the tile
        wc = (warp % CW) * WN
        tile, seg = grouped_tile(PRODUCT_GROUP)
        row0 = tile * TM
        begin = seg_begin[seg]
        a_s = cuda.shared.array(A_SIZE, uint32, alignment=SHARED_ALIGN)
        w_s = cuda.shared.array(W_SIZE, uint32, alignment=SHARED_ALIGN)
        acc = cuda.local.array((MT, NT, 4), float32)
        fa = cuda.local.array((MT, 4), uint32)
        pa = cuda.local.array(A_HELD, uint32)
        pw = cuda.local.array(W_HELD, uint32)
        a_from = cuda.local.array(A_PER, uint64)
        a_to = cuda.local.array(A_PER, uint64)
        w_from = cuda.local.array(W_PER, uint64)
        w_to = cuda.local.array(W_PER, uint64)
        if A_ASYNC:
            copy_offsets(a, a_from, a_to, w_from, w_to, tid, row0, n_rows)
        copies = (shared_address(a_s, (0,)), shared_address(w_s, (0,)), global_address(a, (0, 0)),
                  global_address(w, (0, 0, 0)), a_from, a_to, w_from, w_to)
        for mt in range(MT):
            for nt in range(NT):
                for q in range(4):
                    acc[mt, nt, q] = float32(0)
        n_stages = (seg_end[seg] - begin) * SPB
        # Stage s goes to buffer s % STAGES; stages 0 .. STAGES - 2 before the loop.
        for s in range(STAGES - 1):
            if s < n_stages:
                fetch(a, w, pa, pw, tid, row0, n_rows, begin + s // SPB, (s % SPB) * KW * VALUES,
                      other_idx, line_block, copies, s)
                deposit(a_s, w_s, pa, pw, tid, s)
            if A_ASYNC:
                commit()  # one group a stage, empty or not, so that the wait below counts stages
        buf = 0
        for stage in range(n_stages):
            if A_ASYNC:
                wait()  # this thread's copies of this stage have landed
            # This stage is in buffer buf (every thread's share), and every warp is done
            # multiplying the previous stage, whose buffer the fetch below refills.
            cuda.syncthreads()
            nxt = stage + STAGES - 1
            nbuf = buf - 1 if buf > 0 else STAGES - 1
            more = nxt < n_stages
            if more:  # its loads land while this stage is multiplied
                fetch(a, w, pa, pw, tid, row0, n_rows, begin + nxt // SPB, (nxt % SPB) * KW * VALUES,
                      other_idx, line_block, copies, nbuf)
            if A_ASYNC:
                commit()
            for s in range(STEPS):
                multiply(a_s, w_s, acc, fa, buf, s, wr + g, t, wc + g)
            if more:
                deposit(a_s, w_s, pa, pw, tid, nbuf)
            buf = buf + 1 if buf < STAGES - 1 else 0
        line = seg_line[seg]
        slot = seg_slot[seg]
        for mt in range(MT):
            for q in range(4):
                row = row0 + wr + mt * MMA_M + g + 8 * (q // 2)
                if row < n_rows:
                    for nt in range(NT):
                        col = wc + nt * MMA_N + 2 * t + q % 2
                        emit(out, workspace, slot, line, row, col, acc[mt, nt, q])

    return product_v5


def transpose_threads(cfg, bs, storage):
    """Threads of a `transpose_blocks` thread block: TRANSPOSE_THREADS, or one a word of a
    block with fewer words (block sizes are powers of two, so each thread takes a whole count)."""
    TRANSPOSE_THREADS = cfg.transpose_threads
    return min(TRANSPOSE_THREADS, bs * bs // v5_values(storage))
