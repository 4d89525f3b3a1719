"""reduce_mask version 2: one pass, a decoupled look-back across chunks.

A thread block pools a chunk of consecutive windows (row-major, across rows and
images), its threads along the chunk's columns with several rows' loads in
flight (vector loads where windows and pointer allow), ranks the chunk's
active windows by a ballot, publishes their count in its status word and
finds the count before it by looking back over its predecessors' statuses
(read with ``ld.relaxed.gpu``, tagged with a launch count so a buffer zeroed
once serves every later launch). Then it writes its rows: active windows at
their ranks, inactive ones as n = -1 rows from the back.
"""

import math

import numpy as np
from numba import cuda, float32, float64, int32, int64, uint32, uint64

from ..ptx.clock import globaltimer, smid
from ..ptx.nanmax import max_nan, max_nan_select
from ..ptx.relaxed import load_relaxed
from ..ptx.vector import load2, load4
from .device import FULL_MASK, WARP, quotient

TRACE_EVENTS = ("start", "pooled", "published", "looked back", "written")


# A chunk's status word (int64): tag (30 bits, the launch's), flag (1 bit: prefix or only the
# chunk's own aggregate), active count (32 bits). status[0] counts launches: a status is the
# current launch's when its tag is (that count + 1) mod 2^30, so a status buffer serves
# call after call without a reset; reduce_mask keeps one a stream (`statuses`). Statuses lie `stride` words apart.
STATUS_TAG_SHIFT = 33


STATUS_PREFIX = 1 << 32


STATUS_TAG_MASK = (1 << 30) - 1


STATUS_VALUE_MASK = (1 << 32) - 1


MAX_PASS_WINDOWS = 1 << 30  # windows version 2 takes (counts in 32 bits, int32 rows)


MAX_PASS_EXTENT = 1 << 30  # rows, columns and window reaches version 2 takes (32-bit geometry)


@cuda.jit(device=True, inline=True)
def warp_sum(value):
    """The sum of value over the warp, for every lane."""
    offset = 16
    while offset > 0:
        value += cuda.shfl_xor_sync(FULL_MASK, value, offset)
        offset //= 2
    return value


@cuda.jit(device=True, inline=True)
def status_of(status, j, tag, stride):
    """Chunk j's status (word (1 + j) x stride) once it carries this launch's tag (a prefix of
    nothing before chunk 0).
    Chunks are thread blocks in launch order, and the GPU starts thread blocks in that order
    (as CUB's single-pass scans assume), so a predecessor runs or has run: the wait ends."""
    if j < 0:
        return int64(STATUS_PREFIX)
    at = uint64(1 + j) * uint64(stride)
    s = load_relaxed(status, (at,))  # from L2: never a value cached earlier
    while (s >> STATUS_TAG_SHIFT) != tag:
        s = load_relaxed(status, (at,))
    return s


@cuda.jit(device=True, inline=True)
def look_back_warp(status, chunk, tag, lane, stride):
    """Active windows of the chunks before `chunk` (decoupled look-back by one whole warp): 32
    predecessors' statuses a step, nearest first, summed back to the nearest one whose
    inclusive prefix is out."""
    exclusive = int64(0)
    end = chunk
    while end > 0:  # the same for every lane
        s = status_of(status, end - 1 - lane, tag, stride)
        prefixed = cuda.ballot_sync(FULL_MASK, (s & STATUS_PREFIX) != 0)
        contribution = s & STATUS_VALUE_MASK
        if prefixed != 0:
            nearest = prefixed ^ (prefixed - 1)  # lanes up to the nearest prefix
            if (nearest >> lane) & 1 == 0:
                contribution = 0
            end = 0
        else:
            end -= WARP
        exclusive += warp_sum(contribution)
    return exclusive


def make_look_back_block(cfg):
    """`look_back` by the whole thread block: a device function for the pass kernel."""
    PASS_THREADS = cfg.pass_threads
    PASS_WARPS = cfg.pass_warps
    @cuda.jit(device=True, inline=True)
    def _look_back_block(status, chunk, tag, nearest_s, sums_s, stride):
        """`look_back` by the whole thread block, PASS_THREADS predecessors a step (nearest_s,
        sums_s: PASS_WARPS-long shared scratch). Every thread gets the sum."""
        tid = cuda.threadIdx.x
        lane = tid % WARP
        warp = tid // WARP
        exclusive = int64(0)
        end = chunk
        while end > 0:  # the same for every thread
            s = status_of(status, end - 1 - tid, tag, stride)
            prefixed = cuda.ballot_sync(FULL_MASK, (s & STATUS_PREFIX) != 0)
            if lane == 0:
                lowest = prefixed & -prefixed  # the warp's nearest prefix, as a bit
                nearest_s[warp] = warp * WARP + 31 - cuda.clz(int32(lowest)) if prefixed != 0 else PASS_THREADS
            cuda.syncthreads()  # every warp's nearest prefix is in nearest_s
            nearest = PASS_THREADS
            for k in range(PASS_WARPS):
                nearest = min(nearest, nearest_s[k])
            contribution = warp_sum(s & STATUS_VALUE_MASK if tid <= nearest else int64(0))
            if lane == 0:
                sums_s[warp] = contribution
            cuda.syncthreads()  # every warp's sum is in sums_s
            for k in range(PASS_WARPS):
                exclusive += sums_s[k]
            end = 0 if nearest < PASS_THREADS else end - PASS_THREADS
            cuda.syncthreads()  # nearest_s and sums_s are read before the next step overwrites them
        return exclusive

    return _look_back_block


@cuda.jit(device=True, inline=True)
def window_of(window, count_h, count_w, magic_h, magic_w):
    """(n, bh, bw) of a row-major window number (windows < 2^30; magic_h, magic_w: magic of the
    counts)."""
    row = quotient(window, magic_w)
    n = quotient(row, magic_h)
    return n, int32(row - n * count_h), int32(window - row * count_w)


def make_pass_kernel(cfg, avgpool, wide, vector, look_back, stride, nan_max_ptx=False):
    """reduce_mask in one pass (version 2): pooling, ranks and compaction in one kernel.

    Thread block `chunk` takes `windows` (<= PASS_WINDOWS) consecutive windows, row-major
    across window rows and images. Its threads walk the chunk's columns (windows x size_w of
    them, at most PASS_COLUMNS; with overlapping windows a column is read once per window; with `vector` > 1, a "column"
    is that many adjacent ones, read by one vector load and pooled) and, when the columns are fewer
    than the threads, split the rows into `phases`: each thread pools one column over its rows
    on the image (rows off it are skipped), PASS_LOADS loads in flight without a test, then
    the rest four at a time (rows past the last read it and are dropped by a select), and
    leaves the value in shared memory, a window's entries together. Thread j then pools
    window j's entries (or, past PASS_LANE_ENTRIES of them, each warp pools whole windows,
    lanes over entries, shuffles), the warps holding windows rank the active ones by ballots
    (counts summed through shared memory where the chunk has more than a warp's 32), thread 0
    publishes their count, warp 0 finds the count before the chunk by `look_back` (or, with
    `look_back` "block", the whole block by `_look_back_block`; statuses `stride` words apart), and each
    window's thread writes its row: (n, bh, bw) at its row-major rank if active,
    else n = -1 from the back (rows count.. hold those). The last chunk writes the count and
    advances status[0], the launch count the tags come from. Accumulates in float64 with
    `wide` (sums, float64 masks), else float32 (exact for the max of other masks), its max NaN
    where a value is (`nan_max_ptx`: by max.NaN.f32, else `max_nan_select`). Geometry is 32-bit and
    divisions go by the launcher's magic numbers (`quotient`); the mask comes flat."""
    PASS_COLUMNS = cfg.pass_columns
    PASS_LANE_ENTRIES = cfg.pass_lane_entries
    PASS_LOADS = cfg.pass_loads
    PASS_MAX_REGISTERS = cfg.pass_max_registers
    PASS_THREADS = cfg.pass_threads
    PASS_TRACE = cfg.pass_trace
    PASS_WARPS = cfg.pass_warps
    PASS_WINDOWS = cfg.pass_windows
    _look_back_block = make_look_back_block(cfg)
    acc_type = float64 if wide else float32
    RANKERS = -(-PASS_WINDOWS // WARP)  # warps whose ballots rank a chunk's windows
    assert PASS_WINDOWS <= PASS_THREADS
    LOADS = PASS_LOADS
    BLOCK_LOOK_BACK = look_back == "block"
    STRIDE = stride
    VECTOR = vector
    TRACE = PASS_TRACE
    assert not TRACE or STRIDE > len(TRACE_EVENTS) + 1
    # Shared entries of a chunk's column values: its windows x (entries a window + 1 of
    # padding), at most max(threads, columns) + windows (phases x columns <= threads).
    SHARED = max(PASS_THREADS, PASS_COLUMNS) + PASS_WINDOWS

    nan_max = max_nan if nan_max_ptx and not wide else max_nan_select

    @cuda.jit(device=True, inline=True)
    def pool(acc, v):
        return acc + v if avgpool else nan_max(acc, v)

    # The mask comes flat: a pixel is one int64 element index, a column's next row `width` on
    # (3-D indices were three 64-bit products a load, with strides read from the array).
    @cuda.jit(device=True, inline=True)
    def row(mask, at):
        if VECTOR == 4:
            a, b, c, d = load4(mask, (uint64(at),))
            return pool(pool(acc_type(a), acc_type(b)), pool(acc_type(c), acc_type(d)))
        if VECTOR == 2:
            a, b = load2(mask, (uint64(at),))
            return pool(acc_type(a), acc_type(b))
        return acc_type(mask[uint64(at)])

    @cuda.jit(device=True, inline=True)
    def four_rows(mask, at, step):
        """The pixels at, at + step, at + 2 step, at + 3 step (all on the image), pooled."""
        return pool(pool(row(mask, at), row(mask, at + step)), pool(row(mask, at + 2 * step), row(mask, at + 3 * step)))

    @cuda.jit(device=True, inline=True)
    def last_rows(mask, top, width, r, step, r_end, empty):
        """Rows r, r + step, r + 2 step, r + 3 step of the column whose row 0 is at `top`, pooled:
        those at r_end or past it read the row before r_end (so that every load is valid) and give
        empty."""
        last = r_end - 1
        v0 = row(mask, top + min(r, last) * width)
        v1 = row(mask, top + min(r + step, last) * width)
        v2 = row(mask, top + min(r + 2 * step, last) * width)
        v3 = row(mask, top + min(r + 3 * step, last) * width)
        return pool(pool(v0 if r < r_end else empty, v1 if r + step < r_end else empty),
                    pool(v2 if r + 2 * step < r_end else empty, v3 if r + 3 * step < r_end else empty))

    @cuda.jit(device=True, inline=True)
    def stamp(status, chunk, event):
        """PASS_TRACE's stamp of TRACE_EVENTS[event] (len(TRACE_EVENTS): the multiprocessor)."""
        if TRACE:
            value = int64(smid()) if event == len(TRACE_EVENTS) else int64(globaltimer())
            status[uint64(1 + chunk) * uint64(STRIDE) + uint64(1 + event)] = value

    @cuda.jit(**({} if PASS_MAX_REGISTERS is None else {"max_registers": PASS_MAX_REGISTERS}))
    def pass_kernel(indices, count, status, mask, n_images, height, width, count_h, count_w,
                    size_h, size_w, stride_h, stride_w, offset_h, offset_w, tol, per_chunk, lanes, phases,
                    magic_h, magic_w, magic_units, magic_lanes):
        # lanes x phases: threads across a full chunk's columns x across its rows (the launcher's,
        # as are the magic numbers of the divisions: a division by a value known only at run time
        # is a chain of dependent instructions before the first load).
        tid = cuda.threadIdx.x
        lane = tid % WARP
        warp = tid // WARP
        chunk = cuda.blockIdx.x
        n_chunks = cuda.gridDim.x
        values = cuda.shared.array(SHARED, acc_type)
        active_s = cuda.shared.array(PASS_WINDOWS, np.int32)
        tag_s = cuda.shared.array(1, np.int64)
        nearest_s = cuda.shared.array(PASS_WARPS, np.int32)
        sums_s = cuda.shared.array(PASS_WARPS, np.int64)
        counts_s = cuda.shared.array(PASS_WARPS, np.int32)
        exclusive_s = cuda.shared.array(1, np.int64)
        if tid == 0:  # the launch count's read is on its way while the chunk is pooled
            stamp(status, chunk, 0)
            stamp(status, chunk, len(TRACE_EVENTS))
            tag_s[0] = (load_relaxed(status, (uint64(0),)) + 1) & STATUS_TAG_MASK
        # Geometry in 32 bits (the launcher's bounds: below 2^30), so that the index arithmetic
        # before the first load is 32-bit (int64 arguments made it 64-bit products: ~140 of the
        # ~290 instructions a thread ran before its first load); only pixel indices are 64-bit.
        height32, width32, size_h32 = int32(height), int32(width), int32(size_h)
        count_h32, count_w32 = int32(count_h), int32(count_w)
        total = n_images * count_h * count_w
        first = int32(chunk * int32(per_chunk))  # the chunk's first window, row-major
        windows = int32(min(per_chunk, total - first))  # (fewer in the last chunk: its threads past them idle)
        units = int32(size_w // VECTOR)  # a window's columns, a vector each (a multiple: the launcher's check)
        columns = int32(windows * units)
        entries = int32(int32(phases) * units)  # values a window leaves in shared memory
        empty = acc_type(0) if avgpool else acc_type(-math.inf)
        phase = quotient(tid, magic_lanes)
        q = int32(tid - phase * int32(lanes))
        step = int64(phases) * width  # from a thread's row to its next
        if phase < phases:
            while q < columns:
                j = quotient(q, magic_units)
                c = int32(q - j * units)
                n, bh, bw = window_of(first + j, count_h32, count_w32, magic_h, magic_w)
                h0 = int32(int32(offset_h) + bh * int32(stride_h))
                r_begin = int32(max(0, -h0))  # the window's rows on the image
                r_end = int32(min(size_h32, height32 - h0))
                w = int32(int32(offset_w) + bw * int32(stride_w) + c * VECTOR)
                acc = empty
                if 0 <= w < width32:  # (a vector's first column and width are multiples of VECTOR)
                    # Only the window's rows on the image, r_begin <= r < r_end, are read: the
                    # others would give `empty`. This thread's first is the first of its phase.
                    r = phase
                    if r < r_begin:  # (only windows over the top edge)
                        r += int32(uint32(r_begin - phase + phases - 1) // uint32(phases)) * phases
                    top = (int64(n) * height + h0) * width + w  # (row 0 may be off the image)
                    while r + (LOADS - 1) * phases < r_end:  # LOADS loads in flight, none tested
                        at = top + r * width
                        if LOADS == 16:
                            acc = pool(acc, pool(pool(four_rows(mask, at, step), four_rows(mask, at + 4 * step, step)),
                                                 pool(four_rows(mask, at + 8 * step, step),
                                                      four_rows(mask, at + 12 * step, step))))
                        elif LOADS == 8:
                            acc = pool(acc, pool(four_rows(mask, at, step), four_rows(mask, at + 4 * step, step)))
                        else:
                            acc = pool(acc, four_rows(mask, at, step))
                        r += LOADS * phases
                    while r < r_end:  # the rest, four loads at a time
                        acc = pool(acc, last_rows(mask, top, width, r, phases, r_end, empty))
                        r += 4 * phases
                values[j * (entries + 1) + phase * units + c] = acc
                q += lanes
        cuda.syncthreads()  # every column's value (and the tag) is in shared memory
        if tid == 0:
            stamp(status, chunk, 1)
        # A window's flag: with few entries, lane j of warp 0 pools window j's alone (four loads
        # in flight; the padded pitch puts the lanes' reads in distinct banks), no barrier after;
        # else warps pool whole windows, lanes over the entries, and leave flags in active_s.
        active = False
        if entries <= PASS_LANE_ENTRIES:  # (the same for the whole block)
            if tid < windows:
                base = tid * (entries + 1)
                a0, a1, a2, a3 = empty, empty, empty, empty
                e = 0
                while e + 4 <= entries:
                    a0 = pool(a0, values[base + e])
                    a1 = pool(a1, values[base + e + 1])
                    a2 = pool(a2, values[base + e + 2])
                    a3 = pool(a3, values[base + e + 3])
                    e += 4
                while e < entries:
                    a0 = pool(a0, values[base + e])
                    e += 1
                acc = pool(pool(a0, a1), pool(a2, a3))
                active = (float64(acc) / (size_h * size_w) if avgpool else float64(acc)) > tol
        else:
            j = warp
            while j < windows:  # the same for every lane: warps pool whole windows
                acc = empty
                e = lane
                while e < entries:
                    acc = pool(acc, values[j * (entries + 1) + e])
                    e += WARP
                offset = 16
                while offset > 0:
                    acc = pool(acc, cuda.shfl_xor_sync(FULL_MASK, acc, offset))
                    offset //= 2
                if lane == 0:
                    pooled = float64(acc) / (size_h * size_w) if avgpool else float64(acc)
                    active_s[j] = 1 if pooled > tol else 0
                j += PASS_WARPS
            cuda.syncthreads()  # every window's flag is in active_s
            active = tid < windows and active_s[tid] != 0
        tag = tag_s[0]
        ballot = cuda.ballot_sync(FULL_MASK, active)  # (thread t's window is first + t)
        aggregate = int64(cuda.popc(ballot))
        before_warp = int64(0)  # active windows of the chunk's earlier warps
        if RANKERS > 1:
            if lane == 0 and warp < RANKERS:
                counts_s[warp] = cuda.popc(ballot)
            cuda.syncthreads()  # every ranking warp's count is in counts_s
            aggregate = 0
            for k in range(RANKERS):
                if k < warp:
                    before_warp += counts_s[k]
                aggregate += counts_s[k]
        if tid == 0:  # the chunk's own count out first: successors need not wait for its prefix
            cuda.atomic.exch(status, (1 + chunk) * STRIDE, (tag << STATUS_TAG_SHIFT) | aggregate
                             | (STATUS_PREFIX if chunk == 0 else 0))
            stamp(status, chunk, 2)
        exclusive = int64(0)
        if BLOCK_LOOK_BACK:
            exclusive = _look_back_block(status, chunk, tag, nearest_s, sums_s, STRIDE)
        elif warp == 0:
            exclusive = look_back_warp(status, chunk, tag, lane, STRIDE)
        if tid == 0:
            stamp(status, chunk, 3)
        if tid == 0 and chunk > 0:
            cuda.atomic.exch(status, (1 + chunk) * STRIDE,
                             (tag << STATUS_TAG_SHIFT) | STATUS_PREFIX | (exclusive + aggregate))
        if RANKERS > 1 and not BLOCK_LOOK_BACK:
            if tid == 0:
                exclusive_s[0] = exclusive
            cuda.syncthreads()  # warp 0's look-back is in exclusive_s
            exclusive = exclusive_s[0]
        if tid < windows:
            before = before_warp + cuda.popc(ballot & cuda.lanemask_lt())
            window = first + tid
            if (ballot >> lane) & 1:
                row = exclusive + before
                n, bh, bw = window_of(window, count_h32, count_w32, magic_h, magic_w)
                indices[row, 0] = n
                indices[row, 1] = bh
                indices[row, 2] = bw
            else:  # inactive windows fill rows total-1, total-2, ... in row-major order
                row = total - 1 - (window - exclusive - before)
                indices[row, 0] = -1
                indices[row, 1] = -1
                indices[row, 2] = -1
        if tid == 0:
            stamp(status, chunk, 4)
        if tid == 0 and chunk == n_chunks - 1:
            count[0] = exclusive + aggregate
            # Every chunk has published (this look-back saw them all), so every one has read
            # the launch count: the next launch's statuses get the next tag.
            cuda.atomic.add(status, 0, 1)

    return pass_kernel
