"""SIMT product kernels: register-blocked tiles (version 3) and 8 x 8 patches (version 4).

Version 3: each of 128 threads owns an R x Q patch of a TM x bs output tile and
reads R + Q shared values per R·Q multiply-adds; eight independent,
branch-free activation loads per thread are in flight (rows past the end read
a clamped row and are zeroed by a select). Long block-lines are cut into
segments whose partial sums `make_combine_lines` adds in order, so a skewed
layout does not leave one SM working alone.

Version 4 (blocks 16-64): each thread owns an 8 x 8 patch, reads shared memory
16 bytes at a time from k-major tiles, double-buffers chunks through registers
(one barrier a chunk) and reads global memory 16 bytes at a time where the
pointers are aligned (`ptx.vector`).
"""

from numba import cuda, uint64

from .device import (
    SHARED_ALIGN,
    activation_io,
    activation_vector_load,
    add_outer_8x8,
    bias_reader,
    chunk_position,
    converters,
    fitted,
    grouped_tile,
    pair_reader,
    product_output,
    weight_vector_load,
)


def make_product_v3(cfg, bs, storage, acc_type, transpose_w, feature_axis):
    """Version 2's product with batched, branch-free activation loads.

    Version 2 loads each activation value and stores it to shared memory in
    a loop the compiler does not unroll, so a thread waits out the latency of
    every load in turn. Here each thread issues eight independent loads before
    its eight stores, and out-of-range rows read a clamped (valid) row and are
    zeroed by a select instead of a branch.
    """
    PRODUCT_THREADS = cfg.product_threads
    PRODUCT_TILES = cfg.product_tiles
    TM, R, Q, KC = PRODUCT_TILES[bs]
    KC = fitted(KC, (TM + 1 + bs + 1) * (acc_type.bitwidth // 8))  # (the two tiles below in static shared memory)
    T = PRODUCT_THREADS
    QX = bs // Q
    A_SHAPE = (KC, TM + 1)  # +1 column: transposed stores hit distinct banks
    W_SHAPE = (KC, bs + 1)
    load, _ = activation_io(feature_axis)
    to_acc, _ = converters(storage, acc_type)
    emit = product_output(bs, storage, acc_type, feature_axis)

    position = chunk_position(feature_axis, TM, KC)

    @cuda.jit(device=True, inline=True)
    def a_value(a, row, n_rows, feature):
        value = to_acc(load(a, min(row, n_rows - 1), feature))
        return value if row < n_rows else acc_type(0)

    @cuda.jit
    def product_v3(out, workspace, a, w, seg_line, seg_begin, seg_end, seg_slot,
                   other_idx, line_block, n_rows):
        tid = cuda.threadIdx.x
        tx = tid % QX
        ty = tid // QX
        seg = cuda.blockIdx.y
        row0 = cuda.blockIdx.x * TM
        line = seg_line[seg]
        a_s = cuda.shared.array(A_SHAPE, acc_type)
        w_s = cuda.shared.array(W_SHAPE, acc_type)
        acc = cuda.local.array((R, Q), acc_type)
        a_frag = cuda.local.array(R, acc_type)
        w_frag = cuda.local.array(Q, acc_type)
        for i in range(R):
            for q in range(Q):
                acc[i, q] = acc_type(0)
        for j in range(seg_begin[seg], seg_end[seg]):
            block = j if transpose_w else line_block[j]
            for k0 in range(0, bs, KC):
                base = other_idx[j] * bs + k0
                for e0 in range(tid, TM * KC, 8 * T):
                    r0, c0 = position(e0)
                    r1, c1 = position(e0 + T)
                    r2, c2 = position(e0 + 2 * T)
                    r3, c3 = position(e0 + 3 * T)
                    r4, c4 = position(e0 + 4 * T)
                    r5, c5 = position(e0 + 5 * T)
                    r6, c6 = position(e0 + 6 * T)
                    r7, c7 = position(e0 + 7 * T)
                    v0 = a_value(a, row0 + r0, n_rows, base + c0)
                    v1 = a_value(a, row0 + r1, n_rows, base + c1)
                    v2 = a_value(a, row0 + r2, n_rows, base + c2)
                    v3 = a_value(a, row0 + r3, n_rows, base + c3)
                    v4 = a_value(a, row0 + r4, n_rows, base + c4)
                    v5 = a_value(a, row0 + r5, n_rows, base + c5)
                    v6 = a_value(a, row0 + r6, n_rows, base + c6)
                    v7 = a_value(a, row0 + r7, n_rows, base + c7)
                    a_s[c0, r0] = v0
                    a_s[c1, r1] = v1
                    a_s[c2, r2] = v2
                    a_s[c3, r3] = v3
                    a_s[c4, r4] = v4
                    a_s[c5, r5] = v5
                    a_s[c6, r6] = v6
                    a_s[c7, r7] = v7
                for e in range(tid, KC * bs, T):
                    if transpose_w:
                        col = e // KC
                        kk = e - col * KC
                        w_s[kk, col] = to_acc(w[block, col, k0 + kk])
                    else:
                        kk = e // bs
                        col = e - kk * bs
                        w_s[kk, col] = to_acc(w[block, k0 + kk, col])
                cuda.syncthreads()  # a_s and w_s hold this chunk
                for kk in range(KC):
                    for i in range(R):
                        a_frag[i] = a_s[kk, ty * R + i]
                    for q in range(Q):
                        w_frag[q] = w_s[kk, tx * Q + q]
                    for i in range(R):
                        for q in range(Q):
                            acc[i, q] += a_frag[i] * w_frag[q]
                cuda.syncthreads()  # everyone is done with this chunk before it is overwritten
        slot = seg_slot[seg]
        for i in range(R):
            row = row0 + ty * R + i
            if row < n_rows:
                for q in range(Q):
                    col = tx * Q + q
                    emit(out, workspace, slot, line, row, col, acc[i, q])

    return product_v3


def v4_threads(cfg, bs):
    """Threads of a version 4 product's thread block: an 8 x 8 patch each over V4_ROWS[bs] x bs."""
    V4_ROWS = cfg.v4_rows
    return V4_ROWS[bs] * bs // 64


def v4_weight_width(cfg, bs):
    """Weights per vector load of a version 4 product: its V4_KC x bs chunk shared by the
    threads, at most V4_WIDTH each."""
    V4_KC = cfg.v4_kc
    V4_WIDTH = cfg.v4_width
    return min(V4_WIDTH, V4_KC * bs // v4_threads(cfg, bs))


def make_product_v4(cfg, bs, storage, acc_type, transpose_w, feature_axis, vector=False):
    """Register-blocked 8 x 8 per thread, 16-byte shared reads, double-buffered chunks.

    Each chunk of V4_KC features is loaded from global memory into registers
    while the previous chunk is multiplied out of shared memory, then stored
    to the other shared buffer: one barrier per chunk. Shared tiles are
    stored k-major, swizzled (the row index XOR 4·kk) or padded (rows 4
    floats longer), so the transposing stores of a warp (8 features x 4
    rows) and its 16-byte reads (8 distinct row quads) are both free of bank
    conflicts. With ``vector`` (the launcher checked alignment) the global
    loads read 4 activations and 2-4 weights at a time.
    """
    PRODUCT_GROUP = cfg.product_group
    V4_KC = cfg.v4_kc
    V4_LAYOUT = cfg.v4_layout
    V4_OPTIONS = cfg.v4_jit_options
    V4_ROWS = cfg.v4_rows
    V4_UNROLL = cfg.v4_unroll
    V4_WIDTH = cfg.v4_width
    TM = V4_ROWS[bs]
    KC = V4_KC
    UNROLL = V4_UNROLL[bs]
    T = v4_threads(cfg, bs)
    TX = bs // 8  # threads across the tile's features
    HALF_M = TM // 2
    HALF_N = bs // 2
    CPB = bs // KC  # chunks per block
    A_LOADS = TM * KC // T
    W_LOADS = KC * bs // T
    PAD = 4 if V4_LAYOUT[bs] == "pad" else 0  # floats: rows stay 16-byte aligned
    A_STRIDE = TM + PAD
    W_STRIDE = bs + PAD
    A_TILE = KC * A_STRIDE
    W_TILE = KC * W_STRIDE
    A_SIZE = 2 * A_TILE
    W_SIZE = 2 * W_TILE
    W_SWIZZLE = 0 if PAD else min(8, bs // 4) - 1  # feature quads a w row holds, less one
    A_SWIZZLE = 0 if PAD else 7
    # Elements per global load, and how a load's elements step through the tile:
    # along features (rows of x with feature_axis 1, rows of w) or along rows.
    VA = V4_WIDTH if vector else 1
    VW = v4_weight_width(cfg, bs) if vector else 1
    A_ALONG_ROWS = feature_axis == 0
    W_ALONG_K = transpose_w
    load_a = activation_vector_load(feature_axis, VA)
    load_w = weight_vector_load(transpose_w, VW)
    to_acc, _ = converters(storage, acc_type)
    emit = product_output(bs, storage, acc_type, feature_axis)

    a_vector_position = chunk_position(feature_axis, TM // VA if A_ALONG_ROWS else TM,
                                        KC if A_ALONG_ROWS else KC // VA)

    @cuda.jit(device=True, inline=True)
    def a_position(e):
        """(row, kk) of the first element of load e of an activation chunk."""
        r, kk = a_vector_position(e)
        if A_ALONG_ROWS:
            return r * VA, kk
        return r, kk * VA

    @cuda.jit(device=True, inline=True)
    def w_position(e):
        """(kk, col) of the first element of load e of a weight chunk; consecutive e are
        consecutive addresses."""
        if W_ALONG_K:
            return (e % (KC // VW)) * VW, e // (KC // VW)
        return e // (bs // VW), (e % (bs // VW)) * VW

    @cuda.jit(device=True, inline=True)
    def a_slot(kk, r):
        return kk * A_STRIDE + (r ^ ((kk & A_SWIZZLE) << 2))

    @cuda.jit(device=True, inline=True)
    def w_slot(kk, col):
        return kk * W_STRIDE + (col ^ ((kk & W_SWIZZLE) << 2))

    @cuda.jit(device=True, inline=True)
    def fetch(a, w, pa, pw, tid, row0, n_rows, j, k0, other_idx, line_block):
        """This thread's share of chunk (block j, features k0...) into registers."""
        block = uint64(j if transpose_w else line_block[j])
        base = other_idx[j] * bs + k0
        # A load of rows row...row+VA-1 (feature_axis 0; n_rows is then a multiple
        # of VA) is wholly in or out; rows past the end read the last valid
        # address and are zeroed.
        last = n_rows - (VA if A_ALONG_ROWS else 1)
        for i in range(A_LOADS // VA):
            r, kk = a_position(tid + i * T)
            row = row0 + r
            values = load_a(a, uint64(min(row, last)), uint64(base + kk))
            for c in range(VA):
                pa[i * VA + c] = to_acc(values[c]) if row <= last else acc_type(0)
        for i in range(W_LOADS // VW):
            kk, col = w_position(tid + i * T)
            values = load_w(w, block, uint64(k0 + kk), uint64(col))
            for c in range(VW):
                pw[i * VW + c] = to_acc(values[c])

    @cuda.jit(device=True, inline=True)
    def deposit(a_s, w_s, pa, pw, tid, buf):
        # The swizzle leaves the two low bits alone, so the elements of a load
        # along rows (or along w's columns) stay adjacent in shared memory.
        for i in range(A_LOADS // VA):
            r, kk = a_position(tid + i * T)
            for c in range(VA):
                if A_ALONG_ROWS:
                    slot = a_slot(kk, r) + c
                else:
                    slot = a_slot(kk + c, r)
                a_s[uint64(buf * A_TILE + slot)] = pa[i * VA + c]
        for i in range(W_LOADS // VW):
            kk, col = w_position(tid + i * T)
            for c in range(VW):
                if W_ALONG_K:
                    slot = w_slot(kk + c, col)
                else:
                    slot = w_slot(kk, col) + c
                w_s[uint64(buf * W_TILE + slot)] = pw[i * VW + c]

    @cuda.jit(device=True, inline=True)
    def multiply(a_s, w_s, acc, fa, fw, buf, kk, tx, ty):
        """acc += (feature kk of the chunk in buffer buf): 16 shared reads, 64 multiply-adds."""
        # Offsets built as (quad index) * 4 in unsigned integers: the compiler
        # then sees 16-byte alignment and merges each four loads into one (a
        # signed index also gets Numba's negative-index wrap, which costs
        # instructions and hides adjacency).
        ra = uint64(buf * (A_TILE // 4) + kk * (A_STRIDE // 4) + (ty ^ (kk & A_SWIZZLE))) * uint64(4)
        rw = uint64(buf * (W_TILE // 4) + kk * (W_STRIDE // 4) + (tx ^ (kk & W_SWIZZLE))) * uint64(4)
        # The swizzle may flip the bit that HALF_N sets: a second slot for w.
        rw2 = uint64(buf * (W_TILE // 4) + kk * (W_STRIDE // 4)
                     + ((tx + HALF_N // 4) ^ (kk & W_SWIZZLE))) * uint64(4)
        for i in range(4):
            fa[i] = a_s[ra + uint64(i)]
            fa[4 + i] = a_s[ra + uint64(HALF_M + i)]
            fw[i] = w_s[rw + uint64(i)]
            fw[4 + i] = w_s[rw2 + uint64(i)]
        add_outer_8x8(acc, fa, fw)

    @cuda.jit(**V4_OPTIONS)
    def product_v4(out, workspace, a, w, seg_line, seg_begin, seg_end, seg_slot,
                   other_idx, line_block, n_rows):
        tid = cuda.threadIdx.x
        tx = tid % TX
        ty = tid // TX
        tile, seg = grouped_tile(PRODUCT_GROUP)
        row0 = tile * TM
        line = seg_line[seg]
        begin = seg_begin[seg]
        a_s = cuda.shared.array(A_SIZE, acc_type, alignment=SHARED_ALIGN)
        w_s = cuda.shared.array(W_SIZE, acc_type, alignment=SHARED_ALIGN)
        acc = cuda.local.array((8, 8), acc_type)
        fa = cuda.local.array(8, acc_type)
        fw = cuda.local.array(8, acc_type)
        pa = cuda.local.array(A_LOADS, acc_type)
        pw = cuda.local.array(W_LOADS, acc_type)
        for i in range(8):
            for q in range(8):
                acc[i, q] = acc_type(0)
        n_chunks = (seg_end[seg] - begin) * CPB
        if n_chunks > 0:
            fetch(a, w, pa, pw, tid, row0, n_rows, begin, 0, other_idx, line_block)
            deposit(a_s, w_s, pa, pw, tid, 0)
        cuda.syncthreads()  # chunk 0 is in buffer 0
        for t in range(n_chunks):
            buf = t & 1
            more = t + 1 < n_chunks
            if more:  # issue the next chunk's loads; they land while this chunk is multiplied
                nxt = t + 1
                fetch(a, w, pa, pw, tid, row0, n_rows, begin + nxt // CPB, (nxt % CPB) * KC,
                      other_idx, line_block)
            if UNROLL:  # written out: LLVM does not unroll a loop this long
                multiply(a_s, w_s, acc, fa, fw, buf, 0, tx, ty)
                multiply(a_s, w_s, acc, fa, fw, buf, 1, tx, ty)
                multiply(a_s, w_s, acc, fa, fw, buf, 2, tx, ty)
                multiply(a_s, w_s, acc, fa, fw, buf, 3, tx, ty)
                multiply(a_s, w_s, acc, fa, fw, buf, 4, tx, ty)
                multiply(a_s, w_s, acc, fa, fw, buf, 5, tx, ty)
                multiply(a_s, w_s, acc, fa, fw, buf, 6, tx, ty)
                multiply(a_s, w_s, acc, fa, fw, buf, 7, tx, ty)
            else:
                for kk in range(KC):
                    multiply(a_s, w_s, acc, fa, fw, buf, kk, tx, ty)
            if more:
                deposit(a_s, w_s, pa, pw, tid, 1 - buf)
            # The next chunk is in the other buffer, and every thread is done
            # reading this one before the iteration after next overwrites it.
            cuda.syncthreads()
        slot = seg_slot[seg]
        for i in range(8):
            row = row0 + ty * 4 + (i % 4) + (i // 4) * HALF_M
            if row < n_rows:
                for q in range(8):
                    col = tx * 4 + (q % 4) + (q // 4) * HALF_N
                    emit(out, workspace, slot, line, row, col, acc[i, q])

    return product_v4


def make_combine_lines(cfg, bs, storage, acc_type, feature_axis, bias_kind=None, relu=False):
    """out[:, line-block] = sum of the line's workspace rows, in order (plus the bias's values for
    the line's outputs, ``bias_kind`` its dtype, and with ``relu`` the max with 0, where the
    product's epilogue does so: version 7)."""
    COMBINE_THREADS = cfg.combine_threads
    _, store = activation_io(feature_axis)
    _, from_acc = converters(storage, acc_type)
    bias_at = bias_reader(bias_kind, acc_type)
    BIAS = bias_kind is not None

    @cuda.jit
    def combine_lines(out, workspace, bias, split_line, split_begin, split_end, n_rows):
        i = cuda.blockIdx.y
        e = cuda.blockIdx.x * COMBINE_THREADS + cuda.threadIdx.x
        if e < n_rows * bs:
            row = e // bs
            col = e - row * bs
            total = acc_type(0)
            for slot in range(split_begin[i], split_end[i]):
                total += workspace[slot, row, col]
            if BIAS:
                total += bias_at(bias, split_line[i] * bs + col)
            if relu:
                total = acc_type(0) if total < acc_type(0) else total  # (NaN kept, as torch's ReLU)
            store(out, row, split_line[i] * bs + col, from_acc(total))

    return combine_lines


ADD_BIAS_THREADS = 256


def make_add_bias(storage, acc_type, feature_axis, bias_kind, relu=False):
    """out += bias along the features (``bias_kind`` None: no bias, ``bias`` a stand-in), and with
    ``relu`` out = max(out, 0), for the products whose epilogue does not: one value a thread and
    step of a grid-stride loop, in the order of out's addresses; the sum rounded once from
    ``acc_type``."""
    load, store = activation_io(feature_axis)
    to_acc, from_acc = converters(storage, acc_type)
    bias_at = bias_reader(bias_kind, acc_type)

    @cuda.jit
    def add_bias(out, bias, n_rows, features):
        start, step = cuda.grid(1), cuda.gridsize(1)
        for e in range(start, n_rows * features, step):
            if feature_axis == 1:
                row, k = e // features, e % features
            else:
                k, row = e // n_rows, e % n_rows
            v = to_acc(load(out, row, k)) + bias_at(bias, k)
            if relu:
                v = acc_type(0) if v < acc_type(0) else v  # (NaN kept)
            store(out, row, k, from_acc(v))

    return add_bias


COLUMN_SUM_THREADS = 256
COLUMN_SUM_ROWS = 256  # rows of N a partial column sum takes


def make_column_sums(bs, storage, acc_type, feature_axis, pairs=False):
    """The bias gradient's partial sums where the weight gradient does not take them: ``parts[p,
    k]`` = the sum of dy's rows p R .. (p + 1) R - 1 (R = ``rows_per_part``) of feature k, for the
    features of the block-columns ``columns`` lists; a thread a feature and part, its rows in order.
    ``pairs`` (fp16 or bf16, feature_axis 1, dy as its 32-bit words): a thread two neighbouring
    features from one word a row (a warp's 128 contiguous bytes), four rows' loads issued at once."""
    load, _ = activation_io(feature_axis)
    to_acc, _ = converters(storage, acc_type)
    halves = pair_reader(storage) if pairs else None
    HALF = bs // 2

    if pairs:

        @cuda.jit(device=True, inline=True)
        def add_word(t0, t1, word):
            lo, hi = halves(word)
            return t0 + lo, t1 + hi

        @cuda.jit
        def column_sums(parts, dy, columns, n_rows, rows_per_part):
            j = cuda.blockIdx.x * COLUMN_SUM_THREADS + cuda.threadIdx.x
            p = cuda.blockIdx.y
            if j < columns.shape[0] * HALF:
                w = columns[j // HALF] * HALF + j % HALF  # (dy's word: features 2w, 2w + 1)
                t0, t1 = acc_type(0), acc_type(0)
                n, end = p * rows_per_part, min((p + 1) * rows_per_part, n_rows)
                while n + 4 <= end:
                    w0, w1, w2, w3 = dy[n, w], dy[n + 1, w], dy[n + 2, w], dy[n + 3, w]
                    t0, t1 = add_word(t0, t1, w0)
                    t0, t1 = add_word(t0, t1, w1)
                    t0, t1 = add_word(t0, t1, w2)
                    t0, t1 = add_word(t0, t1, w3)
                    n += 4
                while n < end:
                    t0, t1 = add_word(t0, t1, dy[n, w])
                    n += 1
                parts[p, 2 * w] = t0
                parts[p, 2 * w + 1] = t1
    else:

        @cuda.jit
        def column_sums(parts, dy, columns, n_rows, rows_per_part):
            j = cuda.blockIdx.x * COLUMN_SUM_THREADS + cuda.threadIdx.x
            p = cuda.blockIdx.y
            if j < columns.shape[0] * bs:
                k = columns[j // bs] * bs + j % bs
                total = acc_type(0)
                for n in range(p * rows_per_part, min((p + 1) * rows_per_part, n_rows)):
                    total += to_acc(load(dy, n, k))
                parts[p, k] = total

    return column_sums


def make_finish_column_sums(bs, out_storage, acc_type):
    """db[k] = the sum of feature k's partial sums in order: the weight gradient's (``fused``, rows
    by N-split) where ``fused_columns`` marks k's block-column, else `make_column_sums`'; rounded once."""
    _, from_acc = converters(out_storage, acc_type)

    @cuda.jit
    def finish_column_sums(db, fused, n_fused, parts, n_parts, fused_columns):
        k = cuda.grid(1)
        if k < db.shape[0]:
            total = acc_type(0)
            if fused_columns[k // bs] != 0:
                for s in range(n_fused):
                    total += fused[s, k]
            else:
                for s in range(n_parts):
                    total += parts[s, k]
            db[k] = from_acc(total)

    return finish_column_sums
