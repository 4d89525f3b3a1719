"""Quantize and pack: float values in, K bit planes out, and no float written back.

Each warp takes ``pack_words`` runs of 32 consecutive values of a row (coalesced reads, all
issued before the first vote), finds each value's level by a branch-free binary search over the
sorted thresholds (K compares and selects: the search steps 2^(K-1), ..., 1 from the bottom),
looks up that level's code, and for each bit k votes it into one word a run with
``ballot_sync``: lane s keeps run s's word, so the warp's words of plane k go out in one store of
consecutive lanes. Values past the row's end vote 0, so the padding words are zeros. A row has
its own thresholds (weights: a basis per output channel) or all rows share one set
(activations). Unpack is the inverse, one thread a value.

Rows of whole words may instead take a word a thread (`make_pack_words`, ``pack_vector``): a
thread reads its 32 values by 16-byte loads (fp16 as words, two values each), finds each
level by compares against thresholds held in registers (``2^K - 1`` compares and selects, which
also pick the code: no table is read per value), and sets the code bits into K words itself.

Images (`make_pack_image`, for convolutions) pack along the channels instead, a pixel's
channels 32 a word: a thread takes one word of one pixel, reads its 32 channels (in NCHW the
warp's 32 pixels of a channel are one coalesced read, in channels-last a thread's channels are),
and sets each value's code bits into K words itself; no vote is needed.
"""

from numba import cuda, float32, int32, int64, uint32, uint64

from ..ptx.half2 import floats_of_half2, greater_mask_half2, half2_down
from ..ptx.vector import load4
from ..runtime.compile import inlined

FULL_MASK = 0xFFFFFFFF


def make_code_of(levels):
    """``code_of(value, thresholds, order, t)``: the code of ``value``'s level under row t's sorted
    thresholds, by the branch-free binary search (compares and selects; a NaN compares false: the
    lowest level)."""

    @cuda.jit(device=True, inline=True)
    def code_of(value, thresholds, order, t):
        index = int32(0)
        half = levels // 2
        while half > 0:
            index += half if value > thresholds[t, index + half - 1] else 0
            half //= 2
        return order[t, index]

    return code_of


def make_pack(cfg, bits, per_row):
    code_of = make_code_of(1 << bits)
    words_a_warp = cfg.pack_words

    @cuda.jit
    def pack(planes, x, thresholds, order, columns):
        # planes (bits, R, words) uint32; x (R, C); thresholds (T, levels - 1) fp32 and order (T,
        # levels) int32 (the code of each sorted level), T = R (per_row) or 1.
        lane = cuda.threadIdx.x % 32
        warp = cuda.blockIdx.x * (cuda.blockDim.x // 32) + cuda.threadIdx.x // 32
        row = cuda.blockIdx.y
        t = row if per_row else 0
        first = warp * words_a_warp
        values = cuda.local.array(words_a_warp, float32)
        for step in range(words_a_warp):  # (every load issued before the first vote)
            c = (first + step) * 32 + lane
            values[step] = float32(x[row, c]) if c < columns else float32(0)
        codes = cuda.local.array(words_a_warp, int32)
        for step in range(words_a_warp):
            codes[step] = code_of(values[step], thresholds, order, t)
        for k in range(bits):
            mine = uint32(0)  # lane s keeps the vote of word first + s: the warp's words, one store
            for step in range(words_a_warp):
                inside = (first + step) * 32 + lane < columns
                vote = cuda.ballot_sync(FULL_MASK, inside and (codes[step] >> k) & 1)
                if lane == step:
                    mine = uint32(vote)
            if lane < words_a_warp and first + lane < planes.shape[2]:
                planes[k, row, first + lane] = mine

    return pack


def make_unpack(cfg, bits, signed, per_row):
    @cuda.jit
    def unpack(out, planes, basis, columns):
        # out (R, columns) fp32: Σ_k basis[t, k] e_k, e_k the bit's ±1 (signed) or 0/1
        c = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
        row = cuda.blockIdx.y
        if c >= columns:
            return
        t = row if per_row else 0
        value = float32(0)
        for k in range(bits):
            bit = (planes[k, row, c // 32] >> uint32(c % 32)) & uint32(1)
            e = float32(2 * int32(bit) - 1) if signed else float32(bit)
            value += basis[t, k] * e
        out[row, c] = value

    return unpack


def make_pack_words(cfg, bits, per_row, half):
    """``pack_words(planes, x, thresholds, order, columns)``: x (R, C) fp32, or fp16 as uint32 words
    (R, C / 2) (``half``), C a multiple of 32 and rows 16-byte aligned; a thread a (row, word) of
    the planes (zeros past C), rows along y.

    A value's code is the code of the highest level whose threshold it exceeds. fp32 compares each
    value with each threshold and selects the level's code (two instructions a threshold). With
    ``half`` and ``cfg.pack_half2`` the fp16 values are compared two at a time with the thresholds
    rounded down to fp16 (`ptx.half2.half2_down`: the same outcomes), by a binary search over the
    sorted thresholds (`_make_pack_half2`)."""
    if half and cfg.pack_half2:
        return _make_pack_half2(bits, per_row)
    levels = 1 << bits
    LOADS = 4 if half else 8  # 16-byte loads a thread: 32 values
    STRIDE = 16 if half else 32  # a thread's first element (a word of x's fp16 pairs, or a value)

    word_of = _make_word_of(bits)

    @cuda.jit
    def pack_words(planes, x, thresholds, order, columns):
        word, row, done = word_of(planes, columns)
        if done:
            return
        t = row if per_row else 0
        bound = cuda.local.array(levels, float32)  # (constant indices: registers)
        level_code = cuda.local.array(levels, int32)
        for i in range(levels - 1):
            bound[i] = thresholds[t, i]
        for i in range(levels):
            level_code[i] = order[t, i]
        values = cuda.local.array(32, float32)
        for j in range(LOADS):  # (every load issued before the first compare)
            v = load4(x, (row, word * STRIDE + 4 * j))
            for k in range(4):
                if half:
                    lo, hi = floats_of_half2(uint32(v[k]))
                    values[8 * j + 2 * k] = lo
                    values[8 * j + 2 * k + 1] = hi
                else:
                    values[4 * j + k] = v[k]
        words = cuda.local.array(bits, uint32)
        for k in range(bits):
            words[k] = uint32(0)
        for i in range(32):
            code = level_code[0]
            for level in range(1, levels):  # (a NaN compares false: the lowest level)
                code = level_code[level] if values[i] > bound[level - 1] else code
            for k in range(bits):
                words[k] |= uint32((code >> k) & 1) << uint32(i)
        for k in range(bits):
            planes[k, row, word] = words[k]

    return pack_words


def _make_word_of(bits):
    """``word_of(planes, columns) -> (word, row, done)``: a word-a-thread kernel's word of the planes
    and row; ``done`` where the word is past the planes, or a padding word past the row's values
    (its zeros written)."""

    @inlined
    def word_of(planes, columns):
        word = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
        row = cuda.blockIdx.y
        if word >= planes.shape[2]:
            return word, row, True
        if word * 32 >= columns:  # (the row's padding words)
            for k in range(bits):
                planes[k, row, word] = uint32(0)
            return word, row, True
        return word, row, False

    return word_of


def _make_count_pair(bits):
    """``count_pair(w, bound)``: the number of the 2^bits - 1 sorted thresholds (fp16 pairs, both
    halves one threshold) that each half of ``w`` exceeds, its level's index, in bits 0-3 (low
    half) and 16-19 (high half). A binary search: the index's bits from the top, each one compare
    (``greater_mask_half2``) with the threshold that the bits above it select (a mask select a
    level of the tree). Written out as source so that every index is a constant (registers)."""
    levels = 1 << bits
    lines = ["def count_pair(w, bound):"]
    for level in range(bits):
        step = levels >> (level + 1)
        picks = [f"bound[{(2 * p + 1) * step - 1}]" for p in range(1 << level)]
        for j in range(level):  # (the lowest of the bits above first)
            m = f"m{level - 1 - j}"
            merged = []
            for p in range(len(picks) // 2):
                name = f"s{level}_{j}_{p}"
                high, low = picks[2 * p + 1], picks[2 * p]
                lines.append(f"    {name} = uint32({low} ^ (({high} ^ {low}) & {m}))")  # (high where m, else low)
                merged.append(name)
            picks = merged
        lines.append(f"    m{level} = greater_mask_half2(w, {picks[0]})")
    bits_of = " | ".join(f"(m{level} & uint32({0x00010001 << (bits - 1 - level)}))" for level in range(bits))
    lines.append(f"    return uint32({bits_of})")
    namespace = {"greater_mask_half2": greater_mask_half2, "uint32": uint32}
    exec("\n".join(lines) + "\n", namespace)
    return inlined(namespace["count_pair"])


def _make_pack_half2(bits, per_row):
    """`make_pack_words`' fp16 kernel with ``pack_half2``: a pair of values' level indices found by
    a binary search (`count_pair`: a compare a bit), each index mapped to its level's code through a
    table of 4-bit codes (one 64-bit shift; none where the codes are in level order), the codes
    gathered 8 a register as nibbles, and each plane's 8 bits pulled out of a register's nibbles
    by three shift-and-mask steps."""
    levels = 1 << bits

    count_pair = _make_count_pair(bits)

    def make_codes(by_table):
        @inlined
        def codes(pairs, g, bound, table):
            """The codes of values 8g .. 8g + 7, value 8g + i's in nibble i."""
            nibbles = uint32(0)
            for q in range(4):
                count = count_pair(pairs[4 * g + q], bound)
                if by_table:
                    lo, hi = (count & uint32(15)) << uint32(2), (count >> uint32(14)) & uint32(60)
                    nibbles |= (uint32((table >> uint64(lo)) & uint64(15)) << uint32(8 * q)) \
                        | (uint32((table >> uint64(hi)) & uint64(15)) << uint32(8 * q + 4))
                else:
                    nibbles |= ((count & uint32(15)) | ((count >> uint32(12)) & uint32(0xF0))) << uint32(8 * q)
            return nibbles

        return codes

    coded, counted = make_codes(True), make_codes(False)

    @inlined
    def spread(words, nibbles, g):
        """Bit k of each of the 8 nibbles into bits 8g .. 8g + 7 of plane k's word."""
        for k in range(bits):
            b = (nibbles >> uint32(k)) & uint32(0x11111111)
            b = (b | (b >> uint32(3))) & uint32(0x03030303)
            b = (b | (b >> uint32(6))) & uint32(0x000F000F)
            b = (b | (b >> uint32(12))) & uint32(0xFF)
            words[k] |= b << uint32(8 * g)

    word_of = _make_word_of(bits)

    @cuda.jit
    def pack_half2(planes, x, thresholds, order, columns):
        word, row, done = word_of(planes, columns)
        if done:
            return
        t = row if per_row else 0
        bound = cuda.local.array(levels, uint32)  # (constant indices: registers)
        for i in range(levels - 1):
            bound[i] = half2_down(thresholds[t, i])
        table = uint64(0)  # nibble L: level L's code
        in_order = True  # (codes in level order: a level's index is its code)
        for level in range(levels):
            code = order[t, level]
            table |= uint64(code) << uint64(4 * level)
            in_order = in_order and code == level
        pairs = cuda.local.array(16, uint32)
        for j in range(4):  # (every load issued before the first compare)
            v = load4(x, (row, word * 16 + 4 * j))
            for k in range(4):
                pairs[4 * j + k] = uint32(v[k])
        words = cuda.local.array(bits, uint32)
        for k in range(bits):
            words[k] = uint32(0)
        if in_order:  # (the same branch for the whole row)
            for g in range(4):
                spread(words, counted(pairs, g, bound, table), g)
        else:
            for g in range(4):
                spread(words, coded(pairs, g, bound, table), g)
        for k in range(bits):
            planes[k, row, word] = words[k]

    return pack_half2


def make_pack_image(cfg, bits, per_image):
    code_of = make_code_of(1 << bits)

    @cuda.jit
    def pack_image(planes, x, thresholds, order, channels, pixels, image_stride, channel_stride, pixel_stride):
        # planes (bits, images * pixels, words) uint32; x flat, value (image i, channel c, pixel p)
        # at i * image_stride + c * channel_stride + p * pixel_stride; thresholds (T, levels - 1),
        # order (T, levels), T = images (per_image: a filter bank's output channels) or 1
        row = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
        word = cuda.blockIdx.y
        if row >= planes.shape[1]:
            return
        image = row // pixels
        t = image if per_image else 0
        at = int64(image) * image_stride + int64(row - image * pixels) * pixel_stride
        words = cuda.local.array(bits, uint32)
        for k in range(bits):
            words[k] = uint32(0)
        for i in range(32):
            c = word * 32 + i
            if c < channels:
                value = float32(x[at + int64(c) * channel_stride])
                code = code_of(value, thresholds, order, t)
                for k in range(bits):
                    words[k] |= uint32((code >> k) & 1) << uint32(i)
        for k in range(bits):
            planes[k, row, word] = words[k]

    return pack_image
