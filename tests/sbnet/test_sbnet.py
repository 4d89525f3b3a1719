"""SBNet kernels (reduce_mask, sparse_gather, sparse_scatter) against their NumPy reference."""

from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from numba import cuda

from sparseblocks.runtime.arrays import poisoned_outputs
from sparseblocks.runtime.backend import SIMULATOR
from sparseblocks import sbnet
from sparseblocks.runtime import plans
from sparseblocks.reference import sbnet as reference
from strategies import block_indices, geometries, gpu_only_case, images, values

# The simulator runs a Python thread per CUDA thread (256 a window here): keep it small.
few = settings(max_examples=2) if SIMULATOR else settings()
MAX_SIDE = 9 if SIMULATOR else 40

geometry = geometries(max_size=4, max_stride=5, offsets=(-3, 2))


def sbnet_images(channels=True):
    return images(channels, max_side=MAX_SIDE, max_channels=5 if SIMULATOR else 70, dtype="float32",
                  styles=("normal", "sparse", "small_integers"))


def some_indices(rng, shape, g, unique=False):
    return block_indices(rng, shape, g, max_blocks=4 if SIMULATOR else 40, unique=unique)


@pytest.mark.parametrize("version", [1, 2])
@pytest.mark.parametrize("avgpool", [False, True])
@few
@given(image=sbnet_images(channels=False), g=geometry, tol=st.sampled_from([0.0, 0.1, 0.5]))
def test_reduce_mask_equals_reference(image, g, tol, avgpool, version):
    _, mask = image
    mask = np.abs(mask)
    want = reference.reduce_mask(mask, tol=tol, avgpool=avgpool, **g)
    got, count = sbnet.reduce_mask(mask, tol=tol, avgpool=avgpool, version=version, **g)
    assert count == len(want) and got.dtype == np.int32
    np.testing.assert_array_equal(got, want)  # the same blocks, in the same (row-major) order


@pytest.mark.parametrize("version", [1, 2])
@pytest.mark.parametrize("avgpool", [False, True])
@few
@given(image=sbnet_images(channels=False), g=geometry, tol=st.sampled_from([0.0, 0.5]),
       dtype=st.sampled_from(["float16", "float32", "float64"]), spots=st.integers(1, 6))
def test_reduce_mask_of_nonfinite_masks_equals_reference(image, g, tol, dtype, spots, avgpool, version):
    """NaN and infinite pixels strewn over a mask: the reference's indices (a window with a NaN
    is inactive; +inf makes one active, -inf counts in a sum)."""
    rng, mask = image
    mask = np.abs(mask).astype(dtype)
    flat = mask.reshape(-1)
    flat[rng.choice(flat.size, size=min(spots, flat.size), replace=False)] = \
        rng.choice([np.nan, np.inf, -np.inf], size=min(spots, flat.size))
    want = reference.reduce_mask(mask, tol=tol, avgpool=avgpool, **g)
    got, count = sbnet.reduce_mask(mask, tol=tol, avgpool=avgpool, version=version, **g)
    assert count == len(want)
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("version, lane_entries, nan_max", [(1, 16, None), (2, 16, "ptx"), (2, 0, "ptx"),
                                                            (2, 16, "select")])
@pytest.mark.parametrize("avgpool", [False, True])
def test_reduce_mask_nan_makes_its_window_inactive_wherever_it_lies(configure, version, lane_entries, nan_max, avgpool,
                                                                    monkeypatch):
    """Windows of 2 x 8 (two vector loads of 4 a row), each with one pixel of 1 and one NaN: the
    NaN at each of the 16 places, its neighbour in the same vector set (before it or after it
    in the pool's order) or the pixel below; then 16 windows with the 1 alone. Only those are
    active, pooled by one lane or (PASS_LANE_ENTRIES 0) a warp, by max.NaN.f32 or the select.
    Python's max kept a NaN only in first place, so in the simulator every other window with a
    NaN came out active; on a GPU, max.f32 dropped the NaN: every such window came out active."""
    configure(sbnet, pass_lane_entries=lane_entries)
    configure(sbnet, pass_nan_max=nan_max)
    monkeypatch.setattr(plans, "kept", {})
    mask = np.zeros((1, 2, 48 * 8), np.float32)
    for k in range(16):
        r, c = divmod(k, 8)
        mask[0, r, 8 * k + c] = np.nan
        mask[0, r, 8 * k + (c ^ 1)] = 1
        mask[0, r, 8 * (16 + k) + c] = np.nan
        mask[0, 1 - r, 8 * (16 + k) + c] = 1
        mask[0, r, 8 * (32 + k) + c] = 1
    g = {"bsize": (2, 8), "bstride": (2, 8)}
    want = reference.reduce_mask(mask, tol=0.0, avgpool=avgpool, **g)
    np.testing.assert_array_equal(want, [(0, 0, 32 + k) for k in range(16)])
    indices, count = sbnet.reduce_mask(cuda.to_device(mask), tol=0.0, avgpool=avgpool, version=version, **g)
    n = int(count.copy_to_host()[0])
    np.testing.assert_array_equal(indices.copy_to_host()[:n], want)


@pytest.mark.parametrize("dtype, avgpool", [("bool", False), ("uint8", True), ("float16", False), ("float64", True)])
def test_reduce_mask_of_every_mask_dtype(dtype, avgpool):
    """Version 2 pools bool, uint8 and fp16 masks in float32 (exact for their max), float64
    masks and sums in float64; the indices are the reference's, rows past the count -1."""
    rng = np.random.default_rng(2)
    mask = (rng.random((1, 5, 9)) ** 4).astype(dtype) if dtype.startswith("float") \
        else (rng.random((1, 5, 9)) < 0.15).astype(dtype)
    g = {"bsize": (3, 4), "bstride": (2, 3), "boffset": (-1, 0)}
    tol = 0.1 if avgpool else 0.3
    want = reference.reduce_mask(mask, tol=tol, avgpool=avgpool, **g)
    indices, count = sbnet.reduce_mask(cuda.to_device(mask), tol=tol, avgpool=avgpool, version=2, **g)
    n, got = int(count.copy_to_host()[0]), indices.copy_to_host()
    assert n == len(want) > 0
    np.testing.assert_array_equal(got[:n], want)
    assert (got[n:] == -1).all()


PASS_WARPS = sbnet.DEFAULT.pass_warps  # (a global: shared-array shapes must be compile-time constants)
_look_back_block = sbnet.reduce_pass.make_look_back_block(sbnet.DEFAULT)


def _look_back_kernel(who):
    """A kernel that runs one look-back (`who`: as PASS_LOOK_BACK) for each of `chunks`."""

    @cuda.jit
    def run(out, status, chunks, tag):
        nearest_s = cuda.shared.array(PASS_WARPS, np.int32)
        sums_s = cuda.shared.array(PASS_WARPS, np.int64)
        for i in range(chunks.shape[0]):
            exclusive = 0
            if who == "block":
                exclusive = _look_back_block(status, chunks[i], tag, nearest_s, sums_s, 1)
            elif cuda.threadIdx.x < 32:
                exclusive = sbnet.reduce_pass.look_back_warp(status, chunks[i], tag, cuda.threadIdx.x, 1)
            if cuda.threadIdx.x == 0:
                out[i] = exclusive

    return run


@pytest.mark.parametrize("who", ["warp", "block"])
def test_look_back_sums_aggregates_back_to_the_nearest_prefix(who):
    """Hand-made statuses of 300 chunks (the simulator runs thread blocks one after another, so a
    real launch never shows a look-back anything but finished predecessors): aggregates only,
    with inclusive prefixes at chunks 0 and 40; a look-back from chunk c sums the aggregates
    before it back to the nearest prefix, across steps of 32 or 256 statuses."""
    tag = 3
    rng = np.random.default_rng(6)
    counts = rng.integers(0, 40, 300)
    inclusive = np.cumsum(counts)
    words = (tag << sbnet.reduce_pass.STATUS_TAG_SHIFT) | counts
    for prefixed in (0, 40):
        words[prefixed] = (tag << sbnet.reduce_pass.STATUS_TAG_SHIFT) | sbnet.reduce_pass.STATUS_PREFIX | inclusive[prefixed]
    status = np.concatenate([[tag - 1], words]).astype(np.int64)  # status[0]: the launch count
    # (the block's 256 simulated threads meet at every step: fewer queries)
    chunks = np.array([0, 41, 299] if who == "block" else [0, 1, 33, 40, 41, 169, 299, 297], np.int64)
    out = np.zeros(len(chunks), np.int64)
    _look_back_kernel(who)[1, sbnet.config.DEFAULT.pass_threads if who == "block" else 32](out, status, chunks, tag)
    np.testing.assert_array_equal(out, [0] + [inclusive[c - 1] for c in chunks[1:]])


@cuda.jit
def _quotients(out, xs, magics):
    i = cuda.grid(1)
    if i < xs.shape[0]:
        out[i] = sbnet.device.quotient(xs[i], magics[i])


def test_magic_division_is_exact():
    """`_quotient` by `_magic(d)` equals x // d over the range the pass kernel divides: divisors
    from 1 to 2^30 (powers of two, their neighbours, random ones), numerators from 0 to 2^31 - 1
    (the largest multiples of d and their neighbours among them)."""
    rng = np.random.default_rng(9)
    powers = [1 << k for k in range(31)]
    divisors = sorted({d + e for d in powers for e in (-1, 0, 1) if 1 <= d + e <= 1 << 30}
                      | set(rng.integers(1, 1 << 30, 40).tolist()) | {3, 5, 7, 44, 25, 350, 1000})
    xs, ds = [], []
    for d in divisors:
        top = (1 << 31) - 1
        for x in {0, 1, d - 1, d, d + 1, top, top - top % d, top - top % d - 1,
                  *rng.integers(0, 1 << 31, 6).tolist()}:
            if 0 <= x <= top:
                xs.append(x)
                ds.append(d)
    xs, ds = np.array(xs, np.int64), np.array(ds, np.int64)
    magics = np.array([sbnet.device.magic(int(d)) for d in ds], np.int64)
    out = np.zeros(len(xs), np.int32)
    _quotients[-(-len(xs) // 128), 128](out, xs, magics)
    np.testing.assert_array_equal(out, xs // ds)


def test_reduce_mask_of_windows_reaching_past_32_bits():
    """Windows whose reach (offset + (count - 1) x stride + size) passes MAX_PASS_EXTENT take version
    1 (64-bit geometry), version 2 asked for or not, and give the reference's indices."""
    mask = np.ones((1, 6, 6), np.float32)
    g = {"bsize": 2, "bstride": (1 << 29, 2), "boffset": (0, 0), "bcount": (3, 3)}
    assert not sbnet.reduce._fits_32_bits(6, 6, (3, 3), (2, 2), g["bstride"], (0, 0))
    assert sbnet.reduce._fits_32_bits(6, 6, (3, 3), (2, 2), (2, 2), (0, 0))
    want = reference.reduce_mask(mask, **g)
    assert len(want) == 3  # the first window row only: the others lie far below the image
    for version in (None, 2):
        got, count = sbnet.reduce_mask(mask, version=version, **g)
        assert count == len(want)
        np.testing.assert_array_equal(got, want)


def test_reduce_mask_on_the_device_keeps_the_count_there():
    rng = np.random.default_rng(1)
    mask = (rng.random((2, 7, 9)) < 0.2).astype(np.float32)
    g = {"bsize": 3, "bstride": 2, "boffset": -1}
    indices, count = sbnet.reduce_mask(cuda.to_device(mask), **g)
    want = reference.reduce_mask(mask, **g)
    n = int(count.copy_to_host()[0])
    assert n == len(want)
    np.testing.assert_array_equal(indices.copy_to_host()[:n], want)
    assert (indices.copy_to_host()[n:, 0] == -1).all()  # the rest name no image: kernels skip them
    # The device count feeds gather directly: rows past it come out as zeros.
    x = rng.standard_normal((2, 7, 9, 3)).astype(np.float32)
    with poisoned_outputs():
        blocks = sbnet.sparse_gather(cuda.to_device(x), indices, count=count, **g).copy_to_host()
    np.testing.assert_array_equal(blocks[:n], reference.sparse_gather(x, want, **g))
    assert not blocks[n:].any()


def test_reduce_mask_of_large_windows():
    """Windows of 144, 400 and 529 pixels: pooled by groups of 2, 4 and 8 warps."""
    rng = np.random.default_rng(5)
    mask = rng.random((1, 26, 30)).astype(np.float32) ** 8
    for g, avgpool in (({"bsize": 12, "bstride": 10}, True), ({"bsize": 20, "bstride": 16, "boffset": -4}, False),
                       ({"bsize": 23, "bstride": 23}, True)):
        assert sbnet.reduce._reduce_group_warps(sbnet.config.DEFAULT, (g["bsize"],) * 2, 10) == {12: 2, 20: 4, 23: 8}[g["bsize"]]
        tol = 0.05 if avgpool else 0.9
        want = reference.reduce_mask(mask, tol=tol, avgpool=avgpool, **g)
        count_h, count_w = reference.block_count((26, 30), (g["bstride"],) * 2, (g.get("boffset", 0),) * 2)
        assert 0 < len(want) < count_h * count_w  # some windows active, some not
        for version in (1, 2):
            got, count = sbnet.reduce_mask(mask, tol=tol, avgpool=avgpool, version=version, **g)
            assert count == len(want)
            np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("vector, loads", [(1, 8), (4, 8), (4, 16)])
@pytest.mark.parametrize("avgpool", [False, True])
@pytest.mark.parametrize("top", [0, -4])
def test_reduce_mask_of_tall_windows(configure, avgpool, top, vector, loads, monkeypatch):
    """Version 2 with windows tall enough that a thread has PASS_LOADS rows of its column in
    flight at once (the untested loads) and then the rest, windows over the top edge (`top`:
    the rows above skipped) and the bottom one; columns read one at a time or 4 a load. Most
    windows hold one nonzero pixel, at a random place on the image, and are active only if it
    is read (tol 0)."""
    configure(sbnet, pass_vector=vector)
    configure(sbnet, pass_loads=loads)
    # The chunks as the simulator's one multiprocessor makes them, on a GPU too (with more, the
    # chunks hold fewer windows and the rows split into more phases than 48 rows take).
    monkeypatch.setattr(sbnet.reduce, "multiprocessors", lambda: 1)
    rng = np.random.default_rng(12 - top)
    width = 48 if vector == 1 else 192  # (columns enough that a thread's rows are PASS_LOADS or more)
    g = {"bsize": (48, 8), "bstride": (48, 8), "boffset": (top, 0)}
    count_hw = reference.block_count((96, width), g["bstride"], g["boffset"])
    _, _, phases = sbnet.reduce._pass_chunks(sbnet.config.DEFAULT, g["bsize"], count_hw[0] * count_hw[1], vector)
    assert 48 >= sbnet.config.DEFAULT.pass_loads * phases  # (so that the untested loads run: rows r, r + phases, ...)
    mask = np.zeros((1, 96, width), np.float32)
    for bh in range(count_hw[0]):
        for bw in range(count_hw[1]):
            rows = range(max(0, top + 48 * bh), min(96, top + 48 * bh + 48))
            if len(rows) and rng.random() < 0.8:
                mask[0, rng.choice(rows), 8 * bw + rng.integers(8)] = 1
    want = reference.reduce_mask(mask, tol=0.0, avgpool=avgpool, **g)
    assert 0 < len(want) < count_hw[0] * count_hw[1]
    got, count = sbnet.reduce_mask(mask, tol=0.0, avgpool=avgpool, version=2, **g)
    assert count == len(want)
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("dtype, avgpool, vector", [("float32", False, 4), ("float16", True, 4), ("bool", False, 4),
                                                    ("float32", True, 2)])
def test_reduce_mask_in_vector_loads(configure, dtype, avgpool, vector, monkeypatch):
    """Version 2 reads PASS_VECTOR columns a load where the windows' widths, strides and offsets,
    the mask's width and its pointer allow (over the left and right edges: offsets -4 and a
    last window past W); where the pointer does not (a mask one element into its buffer) or a
    window does not, one column a load. Every case gives the reference's indices; the
    simulator's vector load raises on an unaligned address, so a wrong pick fails here."""
    configure(sbnet, pass_vector=vector)
    monkeypatch.setattr(plans, "kept", {})  # (a kept plan would skip the launcher's choice)
    launched = []
    original = sbnet.reduce._pass_kernel
    monkeypatch.setattr(sbnet.reduce, "_pass_kernel", lambda *a: launched.append(a[3]) or original(*a))
    rng = np.random.default_rng(7)
    buffer = rng.random(12 * 28 + 1) ** 6
    buffer = (buffer > 0.9).astype(dtype) if dtype in ("uint8", "bool") else buffer.astype(dtype)
    device = cuda.to_device(buffer)  # (to_device of a shifted view would copy it to an aligned buffer)
    aligned, shifted = device[:-1].reshape(1, 12, 28), device[1:].reshape(1, 12, 28)
    tol = 0.02 if avgpool else 0.5
    for mask, g, expected in ((aligned, {"bsize": (5, 8), "bstride": (4, 8), "boffset": (-1, -4)}, vector),
                              (aligned, {"bsize": (3, 4), "bstride": (3, 12), "boffset": (0, 0)}, vector),
                              (shifted, {"bsize": (5, 8), "bstride": (4, 8), "boffset": (-1, -4)}, 1),
                              (aligned, {"bsize": (5, 6), "bstride": (4, 8), "boffset": (-1, -4)},
                               vector if 6 % vector == 0 else 1)):
        want = reference.reduce_mask(mask.copy_to_host(), tol=tol, avgpool=avgpool, **g)
        indices, count = sbnet.reduce_mask(mask, tol=tol, avgpool=avgpool, version=2, **g)
        n, got = int(count.copy_to_host()[0]), indices.copy_to_host()
        assert launched[-1] == expected and n == len(want)
        np.testing.assert_array_equal(got[:n], want)
        assert (got[n:] == -1).all()
    if not SIMULATOR:  # torch tensors (dtypes named torch's way, bool viewed as bytes), aligned or not
        torch = pytest.importorskip("torch")
        wide = torch.as_tensor(buffer, device="cuda")
        for tensor, expected in ((wide[:-1].view(1, 12, 28), vector), (wide[1:].view(1, 12, 28), 1)):
            g = {"bsize": (5, 8), "bstride": (4, 8), "boffset": (-1, -4)}
            want = reference.reduce_mask(tensor.cpu().numpy(), tol=tol, avgpool=avgpool, **g)
            indices, count = sbnet.reduce_mask(tensor, tol=tol, avgpool=avgpool, version=2, **g)
            assert launched[-1] == expected and int(count[0]) == len(want)
            np.testing.assert_array_equal(indices[:len(want)].cpu().numpy(), want)


def test_reduce_mask_of_windows_wider_than_a_chunk_takes_version_1(configure, monkeypatch):
    """Windows wider than ``pass_columns`` go to version 1 (whichever version was asked for)."""
    configure(sbnet, pass_columns=2)
    rng = np.random.default_rng(8)
    mask = (rng.random((1, 6, 9)) < 0.2).astype(np.float32)
    g = {"bsize": 3, "bstride": 3}
    launched = []
    original = sbnet.reduce.launch
    monkeypatch.setattr(sbnet.reduce, "launch", lambda kernel, *args: launched.append(kernel) or original(kernel, *args))
    got, count = sbnet.reduce_mask(mask, version=2, **g)
    np.testing.assert_array_equal(got, reference.reduce_mask(mask, **g))
    assert sbnet.reduce.cached(sbnet.reduce_pool.make_reduce_kernels, sbnet.config.DEFAULT)[0] in launched


@pytest.mark.skipif(not SIMULATOR, reason="resizes compiled kernels' thread blocks (GPU: the large-mask test)")
@pytest.mark.parametrize("prefix_chunks", [4, 1])
def test_reduce_mask_over_several_chunks(configure, monkeypatch, prefix_chunks):
    """Windows in several chunks of the compaction: their offsets summed by each compaction
    block, or (past PREFIX_CHUNKS chunks) by the scan kernel; rows past the count hold -1.
    Chunks of 32 windows and pooling blocks of two warps keep the simulator's threads down."""
    configure(sbnet, compact_threads=32)
    configure(sbnet, reduce_warps=2)
    configure(sbnet, prefix_chunks=prefix_chunks)
    rng = np.random.default_rng(3)
    mask = (rng.random((1, 6, 15)) < 0.3).astype(np.float32)  # 90 windows of 1: three chunks
    indices, count = sbnet.reduce_mask(cuda.to_device(mask), bsize=1, bstride=1, version=1)
    want = reference.reduce_mask(mask, bsize=1, bstride=1)
    n = int(count.copy_to_host()[0])
    assert n == len(want)
    got = indices.copy_to_host()
    np.testing.assert_array_equal(got[:n], want)
    assert (got[n:] == -1).all()


def _check_fixed_chunks(monkeypatch, lane_entries, windows, shape, density, seed, active_rows):
    """reduce_mask (version 2, windows of 2) of a random mask of `shape` (`density` of it set) in
    chunks of `windows` windows (2 columns each, one a load) equals the reference; `active_rows`: the bounds the
    active windows' count must fall in (so that the case is not trivial)."""
    monkeypatch.setattr(sbnet.config, "DEFAULT", replace(sbnet.config.DEFAULT, pass_lane_entries=lane_entries))
    monkeypatch.setattr(plans, "kept", {})
    lanes = windows * 2
    monkeypatch.setattr(sbnet.reduce, "_pass_chunks",
                        lambda cfg, size, total, vector=1: (windows, lanes, sbnet.config.DEFAULT.pass_threads // lanes))
    rng = np.random.default_rng(seed)
    mask = (rng.random(shape) < density).astype(np.float32)
    g = {"bsize": 2, "bstride": 2}
    want = reference.reduce_mask(mask, **g)
    assert active_rows[0] < len(want) < active_rows[1]
    got, count = sbnet.reduce_mask(mask, version=2, **g)
    assert count == len(want)
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("lane_entries", [16, 0])
def test_reduce_mask_chunks_run_across_window_rows_and_images(lane_entries, monkeypatch):
    """Chunks of 5 windows over rows of 3 windows and two images of 4 rows of windows: they run on
    across window rows (chunk 0 ends on the second row) and images (chunk 2); a window's entries
    pooled by one lane, or (PASS_LANE_ENTRIES 0) by a warp. (W = 6: no multiple of 4, one column
    a load.)"""
    _check_fixed_chunks(monkeypatch, lane_entries, 5, (2, 8, 6), 0.15, 13, (0, 24))


@pytest.mark.parametrize("lane_entries", [16, 0])
def test_reduce_mask_chunks_of_more_windows_than_a_warp(configure, lane_entries, monkeypatch):
    """Chunks of 64 windows (PASS_WINDOWS 64: two warps' ballots rank them, their counts summed
    through shared memory, warp 0's look-back shared with the other) over 144 windows: two full
    chunks and one of 16."""
    configure(sbnet, pass_windows=64)
    _check_fixed_chunks(monkeypatch, lane_entries, 64, (1, 8, 72), 0.1, 25, (20, 120))


@pytest.mark.parametrize("look_back, stride", [("block", 16), gpu_only_case("block", 1), ("warp", 16)])
def test_reduce_mask_looks_back_over_spread_statuses(configure, look_back, stride, monkeypatch):
    """The pass kernel with either look-back over statuses `stride` words apart (a block's look-back
    gets them a line apart by the rule): 24 chunks of 3 windows, so that the block's steps reach
    back over several statuses."""
    configure(sbnet, pass_look_back=None)
    configure(sbnet, pass_block_look_back=20 if look_back == "block" else 25)
    configure(sbnet, status_stride=None if (look_back, stride) == ("block", 16) else stride)
    assert sbnet.reduce._pass_look_back(sbnet.config.DEFAULT, 24) == (look_back, stride)
    _check_fixed_chunks(monkeypatch, 16, 3, (1, 12, 24), 0.2, 31, (5, 60))


def test_reduce_mask_trace_stamps_every_chunk_in_order(configure, monkeypatch):
    """PASS_TRACE (`scripts/reduce_mask_timeline.py`'s timeline) leaves the indices as they were
    and stamps each chunk's events in order into the spare words of its status line (16 words
    apart): 24 windows in chunks of 5."""
    configure(sbnet, pass_trace=True)
    monkeypatch.setattr(sbnet.statuses, "_status_buffers", {})
    monkeypatch.setattr(sbnet.statuses, "_status_spares", {})
    _check_fixed_chunks(monkeypatch, 16, 5, (2, 8, 6), 0.15, 13, (0, 24))
    (status,) = sbnet.statuses._status_buffers.values()
    words = status.copy_to_host().reshape(-1, 16)[1:]
    assert words.shape[0] == 5
    stamps = words[:, 1:1 + len(sbnet.reduce_pass.TRACE_EVENTS)]
    assert (stamps > 0).all() and (np.diff(stamps, axis=1) >= 0).all()


def test_statuses_stay_packed_past_their_spread_limit(configure, monkeypatch):
    """Statuses a line apart only while they fit in STATUS_SPREAD_WORDS."""
    configure(sbnet, pass_look_back=None)
    configure(sbnet, status_stride=None)
    limit = sbnet.DEFAULT.status_spread_words // 16 - 1
    assert sbnet.reduce._pass_look_back(sbnet.config.DEFAULT, sbnet.DEFAULT.pass_block_look_back - 1) == ("warp", 1)
    assert sbnet.reduce._pass_look_back(sbnet.config.DEFAULT, limit) == ("block", 16)
    assert sbnet.reduce._pass_look_back(sbnet.config.DEFAULT, limit + 1) == ("block", 1)


@pytest.mark.gpu
@pytest.mark.parametrize("version, look_back, lane_entries, windows", [
    (1, "warp", 16, 32), (2, "warp", 16, 32), (2, "block", 16, 32), (2, None, 16, 64), (2, "warp", 0, 32),
    (2, "warp", 16, 64)])
@pytest.mark.parametrize("avgpool", [False, True])
def test_reduce_mask_of_large_masks(configure, avgpool, version, look_back, lane_entries, windows, monkeypatch):
    """Masks of 8 x 400 x 700 (version 1: the scan kernel's path; version 2: 17500 chunks whose
    look-backs wait on each other), large windows, negative offsets; repeated calls give the same
    indices."""
    configure(sbnet, pass_look_back=look_back)
    configure(sbnet, pass_lane_entries=lane_entries)
    configure(sbnet, pass_windows=windows)
    monkeypatch.setattr(plans, "kept", {})
    rng = np.random.default_rng(4)
    for shape, g in (((8, 400, 700), {"bsize": 2, "bstride": 2}), ((2, 300, 500), {"bsize": 32, "bstride": 8}),
                     ((3, 200, 333), {"bsize": 5, "bstride": 3, "boffset": -2})):
        mask = (rng.random(shape) < 0.1).astype(np.float32)
        want = reference.reduce_mask(mask, tol=0.05, avgpool=avgpool, **g)
        device_mask = cuda.to_device(mask)
        for _ in range(3):
            got, count = sbnet.reduce_mask(device_mask, tol=0.05, avgpool=avgpool, version=version, **g)
            n = int(count.copy_to_host()[0])
            assert n == len(want)
            got = got.copy_to_host()
            np.testing.assert_array_equal(got[:n], want)
            assert (got[n:] == -1).all()


def test_reduce_mask_of_an_empty_mask_and_of_no_blocks():
    indices, count = sbnet.reduce_mask(np.zeros((1, 5, 5), np.float32), bsize=2, bstride=2)
    assert count == 0 and indices.shape == (0, 3)
    indices, count = sbnet.reduce_mask(np.ones((1, 5, 5), np.float32), bsize=2, bstride=2, bcount=(0, 3))
    assert count == 0 and indices.shape == (0, 3)


def as_format(image, data_format):
    return image if data_format == "NHWC" else np.ascontiguousarray(image.transpose(0, 3, 1, 2))


@pytest.mark.parametrize("data_format", ["NHWC", "NCHW"])
@pytest.mark.parametrize("transpose", [False, True])
@few
@given(image=sbnet_images(), g=geometry)
def test_gather_equals_reference(image, g, transpose, data_format):
    rng, x = image
    indices = some_indices(rng, x.shape, g)
    x = as_format(x, data_format)
    got = sbnet.sparse_gather(x, indices, transpose=transpose, data_format=data_format, **g)
    want = reference.sparse_gather(x, indices, transpose=transpose, data_format=data_format, **g)
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("data_format", ["NHWC", "NCHW"])
@pytest.mark.parametrize("transpose", [False, True])
@pytest.mark.parametrize("add, atomic", [(False, False), (True, False), (True, True)])
@few
@given(image=sbnet_images(), g=geometry, data=st.data())
def test_scatter_equals_reference(image, g, data, add, atomic, transpose, data_format):
    rng, y = image
    if not atomic:  # without atomics, windows must not overlap (nor, overwriting, race)
        g = dict(g, bstride=tuple(max(s, b) for s, b in zip(g["bstride"], g["bsize"])))
    indices = some_indices(rng, y.shape, g, unique=not atomic)
    if not atomic:
        indices = np.unique(indices, axis=0)
    blocks = values(rng, (len(indices), *g["bsize"], y.shape[3]), "float32", "normal")
    if (data_format == "NHWC") == transpose:  # the blocks are NCHW
        blocks = np.ascontiguousarray(blocks.transpose(0, 3, 1, 2))
    y = as_format(y, data_format)
    kwargs = dict(g, add=add, transpose=transpose, data_format=data_format)
    want = reference.sparse_scatter(blocks, indices, y, **kwargs)
    got = sbnet.sparse_scatter(blocks, indices, y, atomic=atomic, **kwargs)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


@few
@given(image=sbnet_images(), g=geometry)
def test_gather_and_atomic_scatter_add_are_adjoint(image, g):
    rng, x = image
    x = x.astype(np.float64)
    indices = some_indices(rng, x.shape, g)
    b = rng.standard_normal((len(indices), *g["bsize"], x.shape[3]))
    lhs = np.sum(sbnet.sparse_gather(x, indices, **g) * b)
    rhs = np.sum(x * sbnet.sparse_scatter(b, indices, np.zeros_like(x), add=True, atomic=True, **g))
    assert lhs == pytest.approx(rhs, rel=1e-10, abs=1e-10)


def test_gather_then_scatter_restores_the_input_and_inplace_writes_y():
    rng = np.random.default_rng(3)
    x = rng.standard_normal((1, 6, 8, 3)).astype(np.float32)
    g = {"bsize": (3, 4), "bstride": (3, 4), "boffset": 0}
    indices = reference.reduce_mask(np.ones((1, 6, 8)), **g)
    blocks = sbnet.sparse_gather(cuda.to_device(x), cuda.to_device(indices), **g)
    y = cuda.to_device(np.full_like(x, np.nan))
    returned = sbnet.sparse_scatter(blocks, cuda.to_device(indices), y, inplace=True, **g)
    assert returned is y
    np.testing.assert_array_equal(y.copy_to_host(), x)


@pytest.mark.parametrize("dtype, channels", [("float16", 4), ("float32", 2), ("float64", 3), ("float32", 3)])
def test_overwrites_move_whole_words_where_rows_allow(dtype, channels):
    """Channels-last overwrites go as 8-byte words when a pixel's bytes are a multiple of 8
    (the first three cases), element by element otherwise; both equal the reference."""
    rng = np.random.default_rng(5)
    x = rng.standard_normal((2, 7, 9, channels)).astype(dtype)
    indices = np.array([[0, 0, 0], [1, 1, 2], [0, -1, 1], [1, 2, -1], [2, 0, 0]], np.int32)
    g = {"bsize": 4, "bstride": 4, "boffset": -1}
    blocks = sbnet.sparse_gather(x, indices, **g)
    np.testing.assert_array_equal(blocks, reference.sparse_gather(x, indices, **g))
    y = rng.standard_normal(x.shape).astype(dtype)
    np.testing.assert_array_equal(sbnet.sparse_scatter(blocks[:2], indices[:2], y, **g),
                                  reference.sparse_scatter(blocks[:2], indices[:2], y, **g))


def copy_kernel_dtypes(monkeypatch):
    """The list each element copy kernel's dtype (or ``half2``, ``int64`` words) is appended to
    as the launcher picks it."""
    dtypes = []
    copy_kernel = sbnet.dispatch.copy_kernel

    def spy(cfg, scatter, transpose, add, atomic, dtype, channels_last):
        dtypes.append(dtype)
        return copy_kernel(cfg, scatter, transpose, add, atomic, dtype, channels_last)

    monkeypatch.setattr(sbnet.dispatch, "copy_kernel", spy)
    return dtypes


@pytest.mark.parametrize("channels", [4, 3])
def test_fp16_adds_go_two_channels_a_word_where_rows_allow(channels, monkeypatch):
    """A channels-last fp16 add goes through int32 words of two halves (add.rn.f16x2) when a
    pixel's channels are even (4), element by element otherwise (3); both equal the reference
    (each sum rounded once to fp16, as the reference's float16 addition)."""
    words = copy_kernel_dtypes(monkeypatch)
    rng = np.random.default_rng(6)
    g = {"bsize": 3, "bstride": 3, "boffset": -1}
    indices = np.array([[0, 0, 0], [1, 1, 2], [0, 2, 1], [1, 0, 3]], np.int32)
    y = rng.standard_normal((2, 7, 9, channels)).astype(np.float16)
    blocks = rng.standard_normal((4, 3, 3, channels)).astype(np.float16)
    got = sbnet.sparse_scatter(blocks, indices, y, add=True, **g)
    np.testing.assert_array_equal(got, reference.sparse_scatter(blocks, indices, y, add=True, **g))
    assert words == (["half2"] if channels % 2 == 0 else ["float16"])


@pytest.mark.parametrize("channels, transpose, data_format, kernel_dtype", [
    (4, False, "NHWC", "half2"), (3, False, "NHWC", "float16"), (4, True, "NHWC", "float16"),
    (2, False, "NCHW", "float16"),
])
def test_fp16_atomic_adds_of_overlapping_windows(channels, transpose, data_format, kernel_dtype, monkeypatch):
    """fp16 scatter-adds of overlapping and repeated windows, atomically (red.global.add.noftz.f16,
    or .f16x2 on words of two channels where rows allow), equal the float64 sum rounded to fp16
    up to the rounding of each partial sum (the order of the adds is not fixed)."""
    kernels = copy_kernel_dtypes(monkeypatch)
    rng = np.random.default_rng(7)
    g = {"bsize": 3, "bstride": 2, "boffset": -1}
    indices = np.array([[0, 0, 0], [0, 1, 1], [0, 1, 2], [0, 1, 1], [0, 2, 2]], np.int32)
    y = rng.standard_normal((1, 6, 7, channels)).astype(np.float16)
    blocks = rng.standard_normal((len(indices), 3, 3, channels)).astype(np.float16)
    if (data_format == "NHWC") == transpose:  # the blocks are NCHW
        blocks = np.ascontiguousarray(blocks.transpose(0, 3, 1, 2))
    y = as_format(y, data_format)
    kwargs = dict(g, add=True, transpose=transpose, data_format=data_format)
    got = sbnet.sparse_scatter(blocks, indices, y, atomic=True, **kwargs)
    want = reference.sparse_scatter(blocks.astype(np.float64), indices, y.astype(np.float64), **kwargs)
    assert got.dtype == np.float16
    # Each pixel is the sum of y and up to 5 windows' values, rounded after every add.
    np.testing.assert_allclose(got.astype(np.float64), want, rtol=4e-3, atol=4e-3)
    assert kernels == [kernel_dtype]


def pair_kernel_keys(monkeypatch):
    """The list the pair kernels' keys, (transpose, scatter, add, atomic[, halves, strip]), are appended to as made
    (`make_pair_kernels`, `make_pair_tile_kernels` with transpose; `make_pair_tile_gathers`:
    ``(True, "gathers")``), and the element kernels' dtypes (`copy_kernel_dtypes`): both start empty."""
    made = []
    monkeypatch.setattr(sbnet.dispatch, "make_pair_tile_gathers",
                        lambda cfg, make=sbnet.dispatch.make_pair_tile_gathers: made.append((True, "gathers")) or make(cfg))
    for name, transpose in (("make_pair_kernels", False), ("make_pair_tile_kernels", True)):
        def spy(cfg, *key, make=getattr(sbnet.dispatch, name), transpose=transpose):
            made.append((transpose, *key))
            return make(cfg, *key)

        monkeypatch.setattr(sbnet.dispatch, name, spy)
    return made, copy_kernel_dtypes(monkeypatch)


def small_pair_tiles(patch):
    """Pair tiles (adding scatters through the transpose) whose loops run more than once, as wide
    windows' do on the GPU: tiles of two channel pairs by 14 pixels, read in passes of a load a
    thread, image items in batches of one, 8 threads (no fewer than a window row's words)."""
    patch.setattr(sbnet.config, "DEFAULT", replace(sbnet.config.DEFAULT, pair_tile_pairs=2))
    patch.setattr(sbnet.config, "DEFAULT", replace(sbnet.config.DEFAULT, pair_tile_pixels=14))
    patch.setattr(sbnet.config, "DEFAULT", replace(sbnet.config.DEFAULT, pair_tile_threads=8))
    patch.setattr(sbnet.config, "DEFAULT", replace(sbnet.config.DEFAULT, pair_tile_loads=1))
    patch.setattr(sbnet.config, "DEFAULT", replace(sbnet.config.DEFAULT, pair_tile_unroll=1))


# NCHW fp16 images with an even width and windows of an even width: the pair kernels' cases.
pair_geometry = st.fixed_dictionaries({
    "bsize": st.tuples(st.integers(1, 4), st.sampled_from([2, 4, 6])),
    "bstride": st.tuples(st.integers(1, 5), st.integers(1, 7)),
    "boffset": st.tuples(st.integers(-3, 2), st.integers(-3, 2)),
})


@pytest.mark.parametrize("transpose, halves", [(False, 2), (False, 4), (True, 2)])
@pytest.mark.parametrize("add, atomic", [(False, False), (True, False), (True, True)])
@few
@given(seed=st.integers(0, 2**32 - 1), g=pair_geometry, width=st.sampled_from([2, 4, 6, 8, 12]),
       strip=st.booleans())
def test_nchw_fp16_copies_go_two_halves_a_word(seed, g, width, strip, add, atomic, transpose, halves):
    """NCHW fp16 gathers and scatters with rows of whole words go two halves a word (scatters
    that are not atomic only at even columns; through the transpose, adding scatters of NHWC
    blocks only, where C is even, in tiles cut here by `small_pair_tiles`; gathers where C is
    even, in pieces of a channel pair and one or two rows), or with
    `PAIR_HALVES` 4 four a word where W and the window's width are multiples of 4 (scatters: not
    atomic, at columns that are), windows at odd columns, off the image and past a device count
    included: the gather, an overwrite and an add equal the reference bit for bit; an atomic add
    of windows that may overlap or repeat equals it up to fp16's rounding of each partial sum.
    Plain copies (no transpose) go a window a thread block, or by strips (``strip``: several
    windows side by side in each warp)."""
    with pytest.MonkeyPatch.context() as patch:
        small_pair_tiles(patch)
        # (gathers through the transpose: pieces of a window's channel pairs and of its rows)
        patch.setattr(sbnet.config, "DEFAULT", replace(
            sbnet.config.DEFAULT, pair_strips=sbnet.dispatch.PAIR_STRIP_KINDS if strip else (), pair_gather_pairs=1,
            pair_gather_words=24, pair_halves=halves))
        made, elements = pair_kernel_keys(patch)
        if halves == 4:  # widths of multiples of 4 (quad gathers), half the time at such columns too
            width, g = -(-width // 4) * 4, dict(g, bsize=(g["bsize"][0], -(-g["bsize"][1] // 4) * 4))
            if seed % 2:
                g = dict(g, bstride=(g["bstride"][0], 4 * g["bstride"][1]), boffset=(g["boffset"][0], -4))
        pair_copies(seed, g, width, add, atomic, transpose, made, elements, halves, strip)


@pytest.mark.parametrize("offset", [-3, -2, -1, 0, 1, 2, 3, 4])
def test_nchw_fp16_quads_at_every_column_phase(offset, monkeypatch):
    """Words of four halves: a gather's windows starting at each of a word's four halves (and off
    the image's edges: windows 4 wide every 4 over a 12-wide image, a row of blocks past it) equal
    the reference bit for bit, and so do overwriting and adding scatters, as quads where the
    windows start on words, as pairs (even columns) or element by element (odd) elsewhere."""
    made, _ = pair_kernel_keys(monkeypatch)
    rng = np.random.default_rng(offset + 3)
    x = values(rng, (2, 3, 5, 12), "float16", "small_integers")
    g = {"bsize": (3, 4), "bstride": (3, 4), "boffset": (1, offset), "data_format": "NCHW"}
    indices = np.array([[0, 0, 0], [1, 1, 2], [0, 0, 3], [1, 0, 1], [0, 1, -1], [1, 2, 0]], np.int32)
    blocks = sbnet.sparse_gather(x, indices, **g)
    np.testing.assert_array_equal(blocks, reference.sparse_gather(x, indices, **g))
    blocks = values(rng, blocks.shape, "float16", "small_integers")
    for add in (False, True):
        got = sbnet.sparse_scatter(blocks, indices, x, add=add, **g)
        np.testing.assert_array_equal(got.view(np.int16), reference.sparse_scatter(blocks, indices, x, add=add,
                                                                                   **g).view(np.int16))
    quad = offset % 4 == 0  # (by strips: the default `PAIR_STRIPS`' scatters of quads, not of pairs)
    scatters = {(False, True, add, False, 4 if quad else 2, quad) for add in (False, True)}
    assert set(made) == {(False, False, False, False, 4, False), *(scatters if offset % 2 == 0 else ())}


@pytest.mark.parametrize("width, offset, stride", [(18, -1, 16), (16, -1, 14), (6, 0, 6), (5, -2, 7), (7, 1, 3)])
def test_nchw_fp16_gathers_through_the_transpose_by_words(configure, width, offset, stride, monkeypatch):
    """NCHW fp16 gathers into NHWC blocks two halves a word (`_make_pair_tile_gathers`): windows at
    odd and even columns, of odd and even widths, overlapping or not, off the image's edges, in
    pieces of two channels (three a window) and of rows (the words of 19 rows of 18 halves do not
    fit a tile of 512), a device count short of the rows: equal to the reference bit for bit, no
    element kernel."""
    configure(sbnet, pair_gather_pairs=1)
    configure(sbnet, pair_gather_words=512)
    configure(sbnet, pair_tile_threads=64)  # (the simulator's time: a thread a Python thread)
    made, elements = pair_kernel_keys(monkeypatch)
    rng = np.random.default_rng(width)
    x = values(rng, (2, 6, 23, 40), "float16", "small_integers")
    g = {"bsize": (19, width), "bstride": (8, stride), "boffset": (-3, offset), "data_format": "NCHW",
         "transpose": True}
    bcount = reference.block_count((23, 40), g["bstride"], g["boffset"])
    every = np.argwhere(np.ones((2, *bcount), bool))
    indices = every[np.sort(rng.choice(len(every), 8, replace=False))]  # (the first and last columns among them)
    indices = np.concatenate([indices, every[[0, -1]], [[1, bcount[0] + 1, 0], [0, 1, -2], [2, 0, 0]]])
    indices = indices.astype(np.int32)
    blocks = sbnet.sparse_gather(x, indices, **g)
    np.testing.assert_array_equal(blocks, reference.sparse_gather(x, indices, **g))
    count = cuda.to_device(np.array([len(indices) - 4], np.int32))
    past = sbnet.sparse_gather(cuda.to_device(x), cuda.to_device(indices), count=count, **g).copy_to_host()
    np.testing.assert_array_equal(past[:-4], blocks[:-4])
    assert not past[-4:].any()
    assert made == [(True, "gathers")] and not elements


@pytest.mark.parametrize("width, offset, stride, atomic, image_width", [
    (14, 0, 14, False, 32), (6, 2, 8, False, 32), (6, 0, 6, False, 30), (4, 0, 4, False, 30), (14, -1, 12, True, 32),
    (6, 1, 3, True, 30)])
def test_nchw_fp16_adds_through_the_transpose_by_words(width, offset, stride, atomic, image_width, monkeypatch):
    """Adding scatters of NHWC blocks into an NCHW fp16 image by words (`_make_pair_tile_kernels`),
    its loops run more than once (`small_pair_tiles`; the old words loaded before the tile is
    filled): windows at even columns (not atomic) and overlapping windows at odd ones (atomic),
    in images of widths of 30 and 32, off the image's edges, a partial last channel piece (3
    pairs), a device count short of the rows: equal to the reference bit for bit (atomic: up to
    fp16's rounding of each partial sum), no element kernel."""
    small_pair_tiles(monkeypatch)
    made, elements = pair_kernel_keys(monkeypatch)
    rng = np.random.default_rng(width + stride)
    x = values(rng, (2, 6, 11, image_width), "float16", "small_integers")
    g = {"bsize": (5, width), "bstride": (5 if not atomic else 4, stride), "boffset": (-2, offset),
         "data_format": "NCHW", "transpose": True}
    bcount = reference.block_count((11, image_width), g["bstride"], g["boffset"])
    every = np.argwhere(np.ones((2, *bcount), bool))
    indices = every[np.sort(rng.choice(len(every), min(6, len(every)), replace=False))]
    indices = np.concatenate([indices, every[[0, -1]], [[1, bcount[0] + 1, 0], [0, 1, -2]]])
    indices = np.unique(indices, axis=0).astype(np.int32)  # (not atomic: no window twice)
    blocks = values(rng, (len(indices), *g["bsize"], 6), "float16", "small_integers")
    for count in (None, len(indices) - 3):
        used = len(indices) if count is None else count
        want = reference.sparse_scatter(blocks[:used].astype(np.float64), indices[:used], x.astype(np.float64),
                                        add=True, **g)
        y = cuda.to_device(x)
        sbnet.sparse_scatter(cuda.to_device(blocks), cuda.to_device(indices), y, add=True, atomic=atomic,
                             inplace=True, count=None if count is None else cuda.to_device(np.array([count], np.int32)),
                             **g)
        got = y.copy_to_host()
        if atomic:
            np.testing.assert_allclose(got.astype(np.float64), want, rtol=4e-3, atol=4e-3)
        else:
            np.testing.assert_array_equal(got, want.astype(np.float16))
    assert set(made) == {(True, atomic)} and not elements


@pytest.mark.parametrize("width, offset", [(4, 0), (6, -2), (18, -1)])
def test_nchw_fp16_strips_of_many_windows_and_rows(configure, width, offset, monkeypatch):
    """Pair copies by strips (several windows side by side in each warp: `_strip_lanes`) over more
    windows than a warp holds (34 windows, 32, 10 or 3 a warp: the last group part full) and more
    rows than a pass takes (5 channels x 8 rows), windows off the image, repeated, a device count
    short of the rows: the gather, an overwrite and an add equal the reference bit for bit, an
    atomic add up to fp16's rounding."""
    configure(sbnet, pair_strips=sbnet.dispatch.PAIR_STRIP_KINDS)
    made, elements = pair_kernel_keys(monkeypatch)
    rng = np.random.default_rng(width)
    x = values(rng, (2, 5, 19, 40), "float16", "small_integers")
    g = {"bsize": (8, width), "bstride": (8, max(width, 4) if offset % 2 == 0 else 16), "boffset": (-3, offset),
         "data_format": "NCHW"}
    bcount = reference.block_count((19, 40), g["bstride"], g["boffset"])
    every = np.argwhere(np.ones((2, *bcount), bool)).astype(np.int32)
    indices = np.ascontiguousarray(np.tile(every, (-(-34 // len(every)), 1))[:34])  # (repeats: atomic adds)
    indices[-2:] = [[1, bcount[0] + 1, 0], [0, 1, -2]]  # (off the image: read as zeros, written nowhere)
    blocks = sbnet.sparse_gather(x, indices, **g)
    np.testing.assert_array_equal(blocks, reference.sparse_gather(x, indices, **g))
    count = cuda.to_device(np.array([30], np.int32))
    past = sbnet.sparse_gather(cuda.to_device(x), cuda.to_device(indices), count=count, **g).copy_to_host()
    np.testing.assert_array_equal(past[:30], blocks[:30])
    assert not past[30:].any()
    blocks = values(rng, blocks.shape, "float16", "small_integers")
    unique = np.unique(indices, axis=0)
    scattered = blocks[:len(unique)]
    if offset % 2 == 0:  # (odd columns: only atomic scatters go by words)
        for add in (False, True):
            got = sbnet.sparse_scatter(scattered, unique, x, add=add, **g)
            want = reference.sparse_scatter(scattered, unique, x, add=add, **g)
            np.testing.assert_array_equal(got.view(np.int16), want.view(np.int16))
    got = sbnet.sparse_scatter(blocks, indices, x, add=True, atomic=True, **g)
    want = reference.sparse_scatter(blocks.astype(np.float64), indices, x.astype(np.float64), add=True, **g)
    np.testing.assert_allclose(got.astype(np.float64), want, rtol=4e-3, atol=4e-3)
    halves = 4 if width % 4 == 0 else 2
    assert (False, False, False, False, halves, True) in made and not elements
    assert (False, True, True, True, 2, True) in made


def pair_copies(seed, g, width, add, atomic, transpose, made, elements, halves=2, strip=True):
    rng = np.random.default_rng(seed)
    channels = int(rng.integers(1, 5))
    x = values(rng, (2, channels, int(rng.integers(1, 8)), width), "float16", "small_integers")
    shape = (x.shape[0], x.shape[2], x.shape[3], x.shape[1])  # (N, H, W, C): the indices' image
    if not atomic:  # without atomics, windows must not overlap (nor, overwriting, race)
        g = dict(g, bstride=tuple(max(s, b) for s, b in zip(g["bstride"], g["bsize"])))
    indices = some_indices(rng, shape, g, unique=not atomic)
    if not atomic:
        indices = np.unique(indices, axis=0)
    g = dict(g, data_format="NCHW", transpose=transpose)
    blocks = sbnet.sparse_gather(x, indices, **g)
    np.testing.assert_array_equal(blocks, reference.sparse_gather(x, indices, **g))
    if len(indices):  # rows past a device count: zeros
        count = cuda.to_device(np.array([len(indices) - 1], np.int32))
        past = sbnet.sparse_gather(cuda.to_device(x), cuda.to_device(indices), count=count, **g).copy_to_host()
        np.testing.assert_array_equal(past[:-1], blocks[:-1])
        assert not past[-1].any()
    y = values(rng, x.shape, "float16", "small_integers")
    blocks = values(rng, blocks.shape, "float16", "small_integers" if add else "normal")
    kwargs = dict(g, add=add)
    got = sbnet.sparse_scatter(blocks, indices, y, atomic=atomic, **kwargs)
    if atomic:
        want = reference.sparse_scatter(blocks.astype(np.float64), indices, y.astype(np.float64), **kwargs)
        np.testing.assert_allclose(got.astype(np.float64), want, rtol=4e-3, atol=4e-3)
    else:
        want = reference.sparse_scatter(blocks, indices, y, **kwargs)
        np.testing.assert_array_equal(got.view(np.int16), want.view(np.int16))
    if len(indices):
        gathered = not transpose or channels % 2 == 0  # (through the transpose: pairs of channels)
        words = (atomic or (g["boffset"][1] % 2 == 0 and g["bstride"][1] % 2 == 0)) and (
            not transpose or (add and channels % 2 == 0))
        quad = halves == 4 and g["bsize"][1] % 4 == 0 and width % 4 == 0  # (device arrays: 8-byte aligned)
        quad_scatter = quad and not atomic and g["boffset"][1] % 4 == 0 and g["bstride"][1] % 4 == 0
        scattered = (True, atomic) if transpose else (False, True, add, atomic, 4 if quad_scatter else 2, strip)
        gathers = [(True, "gathers") if transpose else (False, False, False, False, 4 if quad else 2, strip)]
        assert set(made) == {*(gathers if gathered else []), *([scattered] if words else [])}
        assert len(elements) == 2 * (not gathered) + (not words)  # (two gathers: with and without a count)


@pytest.mark.parametrize("dtype, channels, transpose, widths, settings", [
    ("float32", 4, False, [1, 3, 4], {}), ("float32", 8, False, [1, 3, 4], {}),
    ("float16", 8, False, [1, 3, 4], {}), ("float64", 2, False, [1, 3, 4], {}),
    ("float32", 4, True, [4, 8], {}), ("float32", 8, True, [4, 8], {}), ("float16", 8, True, [4, 8], {}),
    ("float32", 4, True, [3, 6], {}), ("float16", 8, True, [5, 6], {}),
    ("float32", 4, True, [3, 4, 12], {"ROW_TILE_PIXELS": 8, "ROW_TILE_PIXELS_WIDE": 16}),
    ("float16", 8, True, [5, 8, 11], {"ROW_TILE_PIXELS": 8}),
    ("float32", 4, True, [3, 5, 12], {"ROW_TILE_PIXELS": 16, "ROW_TILE_WINDOW_MAJOR": False}),
    ("float16", 8, True, [3, 4, 12], {"ROW_TILE_PIXELS": 8, "ROW_TILE_WINDOW_MAJOR": True}),
    ("float32", 68, True, [3, 4], {"ROW_TILE_PIXELS": 8, "ROW_TILE_WINDOW_MAJOR": True}),
    ("float16", 136, True, [4, 5], {"ROW_TILE_PIXELS": 16, "ROW_TILE_WINDOW_MAJOR": False}),
])
@pytest.mark.parametrize("add", [False, True])
@few
@given(data=st.data())
def test_row_copies_equal_reference(dtype, channels, transpose, widths, settings, add, data):
    """Channels-last gathers and (adding) scatters a window row at a time, 16 bytes a step, where
    a pixel is whole 16-byte vectors (transposing: float32 or float16; block rows 4 values a step
    where bh * bw is a multiple of 4, else 1): windows over the image's edges, negative offsets,
    out-of-range indices, a count short of the rows, gathers of overlapping windows. A
    transposing tile holds a run of a window's pixels, its rows one after another (the whole
    window at the default sizes); tiles of 8 and 16 pixels end and begin within rows and
    windows (steps of 4 across rows: 3 x 4, 3 x 12), pieces of a row (12), a window's last
    tile short; thread blocks window by window and tile by tile, both dtypes, with several
    chunks of channels (68, 136)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(sbnet.config, "DEFAULT", replace(sbnet.config.DEFAULT, **{k.lower(): v for k, v in settings.items()}))
        check_row_copies(dtype, channels, transpose, widths, add, data)


def row_kernel_keys(patch):
    """The list each row kernel's key is appended to as the launcher makes it (from an emptied
    kernel cache: every kernel a call takes)."""
    keys = []
    make = sbnet.dispatch.make_row_kernels
    patch.setattr(sbnet.dispatch, "make_row_kernels", lambda cfg, *key: keys.append(key) or make(cfg, *key))
    return keys


def check_row_copies(dtype, channels, transpose, widths, add, data):
    draw = data.draw
    size = (draw(st.integers(1, 3)), draw(st.sampled_from(widths)))
    # (gathers: windows may overlap; scatters: not, an overlapping scatter is not a row copy's)
    g = {"bsize": size, "bstride": tuple(max(1, s + draw(st.integers(-1, 2))) for s in size),
         "boffset": (draw(st.integers(-3, 2)), draw(st.integers(-5, 2)))}
    g_scatter = dict(g, bstride=tuple(max(s, t) for s, t in zip(size, g["bstride"])))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    shape = (draw(st.integers(1, 2)), draw(st.integers(1, 7)), draw(st.integers(1, 11)), channels)
    x = values(rng, shape, dtype, "normal")
    indices = np.unique(some_indices(rng, shape, g, unique=True), axis=0)
    count = np.array([draw(st.integers(0, len(indices)))], np.int32)
    with pytest.MonkeyPatch.context() as patch, poisoned_outputs():  # (a fixture would span examples)
        made = row_kernel_keys(patch)
        got = sbnet.sparse_gather(x, indices, transpose=transpose, count=count, **g)
    want = reference.sparse_gather(x, indices, transpose=transpose, **g)
    np.testing.assert_array_equal(got[:count[0]], want[:count[0]])
    assert not got[count[0]:].any()  # rows past the count: zeros
    blocks = values(rng, want.shape, dtype, "normal")
    y = values(rng, shape, dtype, "normal")
    with pytest.MonkeyPatch.context() as patch:
        made_scatter = row_kernel_keys(patch)
        patch.setattr(sbnet.config, "DEFAULT", replace(sbnet.config.DEFAULT, merge=False))  # (a scatter into a copy would merge in one pass)
        got = sbnet.sparse_scatter(blocks, indices, y, add=add, transpose=transpose, count=count, **g_scatter)
    want = reference.sparse_scatter(blocks[:count[0]], indices[:count[0]], y, add=add, transpose=transpose,
                                    **g_scatter)
    np.testing.assert_array_equal(got, want)
    assert len(made) + len(made_scatter) == 2 or len(indices) == 0  # (no indices: nothing launched)


@pytest.mark.parametrize("transpose", [False, True])
def test_row_copies_fall_back_past_the_grid_limit(configure, transpose, monkeypatch):
    """A window with more tiles (or rows) than a grid's y takes the element kernels, whose grid
    does not grow with the window (the limit made 1 here: CUDA's is 65535)."""
    made = row_kernel_keys(monkeypatch)
    configure(sbnet, max_grid_yz=1)
    rng = np.random.default_rng(9)
    x = rng.standard_normal((1, 6, 7, 4)).astype(np.float32)
    indices = np.array([[0, 0, 0], [0, 1, 1]], np.int32)
    g = {"bsize": (9, 8), "bstride": (3, 4), "boffset": (-1, -1)}  # 72 pixels: 2 tiles of 64
    got = sbnet.sparse_gather(x, indices, transpose=transpose, **g)
    np.testing.assert_array_equal(got, reference.sparse_gather(x, indices, transpose=transpose, **g))
    assert made == []


def test_row_copies_fall_back_where_pointers_are_misaligned():
    """A pixel of whole vectors but an image 4 bytes off 16-byte alignment: the element kernels."""
    rng = np.random.default_rng(8)
    storage = cuda.to_device(rng.standard_normal(2 * 5 * 6 * 4 + 1).astype(np.float32))
    x = storage[1:].reshape((2, 5, 6, 4))
    assert sbnet.dispatch.data_pointer(x) % 16 != 0
    indices = np.array([[0, 0, 0], [1, 1, 1]], np.int32)
    g = {"bsize": 4, "bstride": 4, "boffset": -1}
    got = sbnet.sparse_gather(x, cuda.to_device(indices), transpose=True, **g).copy_to_host()
    np.testing.assert_array_equal(got, reference.sparse_gather(x.copy_to_host(), indices, transpose=True, **g))


def merge_kernel_keys(patch):
    """The list each merging scatter's kernel key is appended to as the launcher makes it."""
    keys = []
    make = sbnet.dispatch.make_merge_kernels
    patch.setattr(sbnet.dispatch, "make_merge_kernels", lambda cfg, *key: keys.append(key) or make(cfg, *key))
    return keys


@pytest.mark.parametrize("dtype, channels, link_alone", [
    ("float32", 4, 16384), ("float16", 8, 16384), ("float64", 2, 16384), ("float32", 12, 0)])
@pytest.mark.parametrize("add, atomic", [(False, False), (True, False), (True, True)])
@few
@given(data=st.data())
def test_merging_scatter_equals_reference(dtype, channels, link_alone, add, atomic, data):
    """A scatter into a copy of an NHWC image in one pass (every pixel written once, from a map
    of the windows): windows overlapping by up to half (atomic adds), with holes between them,
    off every edge, negative and uneven offsets, a window's rows and columns of 1, out-of-range
    indices (n past N, windows wholly off the image, and ones just off the grid that still
    reach it), repeated windows (atomic adds: each block counts), a count short of the rows;
    the output poisoned first. The map emptied and linked by one thread block, or (LINK_ALONE
    0) emptied by a launch of its own and linked by a grid."""
    draw = data.draw
    size = (draw(st.integers(1, 4)), draw(st.integers(1, 4)))
    least = [-(-s // 2) if atomic else s for s in size]  # overlapping by at most half a window
    g = {"bsize": size, "bstride": tuple(draw(st.integers(m, s + 2)) for m, s in zip(least, size)),
         "boffset": (draw(st.integers(-4, 3)), draw(st.integers(-4, 3)))}
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    shape = (draw(st.integers(1, 2)), draw(st.integers(1, 7)), draw(st.integers(1, 9)), channels)
    count_h, count_w = reference.block_count(shape[1:3], g["bstride"], g["boffset"])
    pool = np.array([(n, a, b) for n in range(shape[0] + 1) for a in range(-2, count_h + 2)
                     for b in range(-2, count_w + 2)], np.int32)
    indices = pool[rng.choice(len(pool), size=rng.integers(1, 7), replace=atomic)]
    count = np.array([draw(st.integers(0, len(indices)))], np.int32)
    blocks = values(rng, (len(indices), *size, channels), dtype, "normal")
    y = values(rng, shape, dtype, "normal")
    with pytest.MonkeyPatch.context() as patch, poisoned_outputs():
        made = merge_kernel_keys(patch)
        patch.setattr(sbnet.config, "DEFAULT", replace(sbnet.config.DEFAULT, link_alone=link_alone))
        patch.setattr(sbnet.config, "DEFAULT", replace(sbnet.config.DEFAULT, merge_min_cover=0))  # (however few the windows)
        got = sbnet.sparse_scatter(blocks, indices, y, add=add, atomic=atomic, count=count, **g)
    want = reference.sparse_scatter(blocks[:count[0]].astype(np.float64), indices[:count[0]],
                                    y.astype(np.float64), add=add, **g)
    # fp16: each add rounded, up to 4 windows and repeats over a pixel (float64 sums)
    tolerance = {"float16": 4e-3, "float32": 1e-6, "float64": 1e-12}[dtype]
    np.testing.assert_allclose(got.astype(np.float64), want, rtol=tolerance, atol=tolerance)
    # (where no window reaches the image, y is copied)
    reaches = any(reference._inside([(0, a, b) for a in range(-9, 12) for b in range(-9, 12)], (1, *shape[1:3]),
                                    *reference.check_geometry(**g)))
    assert made == ([(add, "int32" if dtype == "float16" else dtype, dtype == "float16")] if reaches else [])


@pytest.mark.parametrize("case", ["overlap past half", "inplace", "transpose", "misaligned", "few windows"])
def test_scatters_that_cannot_merge_copy_first(case):
    """Windows over a pixel more than twice along an axis, an in-place scatter, blocks in the
    other layout, an image off 16-byte alignment, blocks covering less of the image than
    MERGE_MIN_COVER: y copied (or not, in place), then scattered; equal to the reference."""
    rng = np.random.default_rng(11)
    g = {"bsize": 3, "bstride": 1 if case == "overlap past half" else 2, "boffset": -1}
    x = rng.standard_normal((1, 5, 6, 4)).astype(np.float32)
    indices = np.array([[0, 0, 0], [0, 1, 1], [0, 2, 1]], np.int32)
    blocks = rng.standard_normal((3, 3, 3, 4)).astype(np.float32)
    transpose = case == "transpose"
    if transpose:
        blocks = np.ascontiguousarray(blocks.transpose(0, 3, 1, 2))
    y = cuda.to_device(x)
    if case == "misaligned":
        y = cuda.to_device(np.concatenate([[0], x.ravel()]).astype(np.float32))[1:].reshape(x.shape)
    with pytest.MonkeyPatch.context() as patch:
        made = merge_kernel_keys(patch)
        patch.setattr(sbnet.config, "DEFAULT", replace(sbnet.config.DEFAULT, merge_min_cover=0.95 if case == "few windows" else 0))  # (27 of 30 pixels)
        got = sbnet.sparse_scatter(cuda.to_device(blocks), cuda.to_device(indices), y, add=True, atomic=True,
                                   transpose=transpose,
                                   inplace=case == "inplace", **g).copy_to_host()
    np.testing.assert_allclose(got, reference.sparse_scatter(blocks, indices, x, add=True, transpose=transpose, **g),
                               rtol=1e-6, atol=1e-6)
    assert made == []

@pytest.mark.gpu
@pytest.mark.skipif(SIMULATOR, reason="kept plans replay through the driver")
@pytest.mark.parametrize("transpose, link_alone", [(False, 16384), (True, 16384), (False, 0)])
def test_repeated_torch_calls_replay_a_kept_plan(configure, transpose, link_alone, monkeypatch):
    """The second gather or scatter with tensors like the first goes through a kept plan (new
    pointers, new output, or y itself in place; a merging scatter's map emptied in its link or
    by a launch of its own); other alignments take the general path."""
    torch = pytest.importorskip("torch")
    monkeypatch.setattr(plans, "kept", {})
    configure(sbnet, link_alone=link_alone)
    configure(sbnet, merge_min_cover=0)
    g = {"bsize": (3, 4), "bstride": (3, 4), "boffset": (-1, -2)}
    indices = torch.tensor([[0, 0, 0], [1, 1, 2], [0, 2, 1], [1, 0, 3]], dtype=torch.int32, device="cuda")
    count = torch.tensor([3], dtype=torch.int32, device="cuda")
    host_indices = indices[:3].cpu().numpy()
    for _ in range(2):  # the first call of each kind keeps a plan, the second replays it
        x = torch.randn(2, 7, 9, 8, device="cuda")
        got = sbnet.sparse_gather(x, indices, transpose=transpose, count=count, **g)
        want = reference.sparse_gather(x.cpu().numpy(), host_indices, transpose=transpose, **g)
        np.testing.assert_array_equal(got[:3].cpu().numpy(), want)
        assert not got[3:].any()  # past the count: zeros, replayed or not
        for add, inplace in [(False, False), (True, False), (True, True)]:
            y = torch.randn(2, 7, 9, 8, device="cuda")
            want = reference.sparse_scatter(got[:3].cpu().numpy(), host_indices, y.cpu().numpy(), add=add,
                                            transpose=transpose, **g)
            out = sbnet.sparse_scatter(got, indices, y, add=add, transpose=transpose, inplace=inplace,
                                       count=count, **g)
            assert (out is y) == inplace
            np.testing.assert_allclose(out.cpu().numpy(), want, rtol=1e-6, atol=1e-6)
    assert len(plans.kept) == 4
    wide = torch.randn(2 * 7 * 9 * 8 + 1, device="cuda")
    shifted = wide[1:].view(2, 7, 9, 8)  # 4 bytes off: the element kernels
    got = sbnet.sparse_gather(shifted, indices, transpose=transpose, count=count, **g)
    want = reference.sparse_gather(shifted.cpu().numpy(), host_indices, transpose=transpose, **g)
    np.testing.assert_array_equal(got[:3].cpu().numpy(), want)
    assert not got[3:].any()
    assert len(plans.kept) == 5


@pytest.mark.gpu
@pytest.mark.skipif(SIMULATOR, reason="kept plans replay through the driver")
def test_kept_plans_of_the_pair_kernels_write_the_image_through_both_views(monkeypatch):
    """The NCHW fp16 pair kernels take the image twice (words, and halves for an atomic add's
    window row ends): a kept plan's replay writes both pointers, so the ends of the second
    call's rows land in the second call's image, not the first's (the gather: four halves a word;
    and the gather through the transpose by words replays onto the second call's image, and so
    does the pair tiles' adding scatter)."""
    torch = pytest.importorskip("torch")
    monkeypatch.setattr(plans, "kept", {})
    made, _ = pair_kernel_keys(monkeypatch)
    g = {"bsize": (3, 4), "bstride": (3, 4), "boffset": (-1, -1)}  # odd first columns: ends go alone
    indices = torch.tensor([[0, 0, 0], [1, 1, 2], [0, 2, 1], [1, 0, 3]], dtype=torch.int32, device="cuda")
    count = torch.tensor([3], dtype=torch.int32, device="cuda")
    host_indices = indices[:3].cpu().numpy()
    earlier = []  # (an output of the first round, a copy of it)
    for round in range(2):  # the first call of each kind keeps a plan, the second replays it
        x = torch.randn(2, 3, 7, 12, device="cuda").half()
        got = sbnet.sparse_gather(x, indices, count=count, data_format="NCHW", **g)
        want = reference.sparse_gather(x.cpu().numpy(), host_indices, data_format="NCHW", **g)
        np.testing.assert_array_equal(got[:3].cpu().numpy(), want)
        assert not got[3:].any()
        x4 = torch.randn(2, 4, 7, 12, device="cuda").half()  # (by words through the transpose: C even)
        nhwc = sbnet.sparse_gather(x4, indices, count=count, data_format="NCHW", transpose=True, **g)
        want = reference.sparse_gather(x4.cpu().numpy(), host_indices, data_format="NCHW", transpose=True, **g)
        np.testing.assert_array_equal(nhwc[:3].cpu().numpy(), want)
        assert not nhwc[3:].any()
        for add, atomic, inplace in [(False, False, True), (True, False, True), (True, True, True),
                                     (True, True, False)]:
            y = torch.randn(2, 3, 7, 12, device="cuda").half()
            want = reference.sparse_scatter(got[:3].cpu().numpy(), host_indices, y.cpu().numpy(), add=add,
                                            data_format="NCHW", **g)
            out = sbnet.sparse_scatter(got, indices, y, add=add, atomic=atomic, inplace=inplace, count=count,
                                       data_format="NCHW", **g)
            assert (out is y) == inplace
            np.testing.assert_array_equal(out.cpu().numpy(), want)
            if round == 0:
                earlier.append((out, out.clone()))
        g_even = dict(g, boffset=(-1, 0))  # (even columns: the pair tiles' adds that are not atomic)
        blocks = torch.randn(4, 3, 4, 4, device="cuda").half()
        y = torch.randn(2, 4, 7, 12, device="cuda").half()
        want = reference.sparse_scatter(blocks[:3].cpu().numpy(), host_indices, y.cpu().numpy(), add=True,
                                        transpose=True, data_format="NCHW", **g_even)
        out = sbnet.sparse_scatter(blocks, indices, y, add=True, inplace=True, transpose=True, count=count,
                                   data_format="NCHW", **g_even)
        np.testing.assert_array_equal(out.cpu().numpy(), want)
        if round == 0:
            earlier.append((out, out.clone()))
    assert len(plans.kept) == 7 and set(made) == {(False, False, False, False, 4, False),
                                                    (False, True, True, True, 2, True), (True, "gathers"),
                                                    (True, False)}
    for out, copy in earlier:  # no replay wrote into the first round's images
        assert torch.equal(out, copy)


@pytest.mark.gpu
@pytest.mark.skipif(SIMULATOR, reason="kept plans replay through the driver")
def test_repeated_reduce_mask_replays_a_kept_plan(monkeypatch):
    """reduce_mask's kept plan: new masks of the same shape give their own indices and count."""
    torch = pytest.importorskip("torch")
    monkeypatch.setattr(plans, "kept", {})
    rng = np.random.default_rng(9)
    g = {"bsize": 3, "bstride": 2, "boffset": -1}
    for _ in range(3):
        mask = (rng.random((2, 30, 41)) < 0.05).astype(np.float32)
        indices, count = sbnet.reduce_mask(torch.as_tensor(mask, device="cuda"), **g)
        want = reference.reduce_mask(mask, **g)
        n = int(count[0])
        assert n == len(want) and len(plans.kept) == 1
        np.testing.assert_array_equal(indices[:n].cpu().numpy(), want)
        assert (indices[n:, 0] == -1).all()


def test_reduce_mask_zeroes_statuses_once_a_stream_and_a_capture(monkeypatch):
    """Version 2 zeroes a stream's statuses once and later calls on it reuse them (the launch
    count in status[0] advances); a call under a graph capture (faked here) takes the spare
    zeroed outside it, the capture's later calls reuse that, and a capture with no spare left
    zeroes scratch statuses in the call. Every call's indices equal the reference's."""
    monkeypatch.setattr(sbnet.statuses, "_status_buffers", {})
    monkeypatch.setattr(sbnet.statuses, "_status_spares", {})
    capture = [None]
    monkeypatch.setattr(sbnet.statuses, "capture_of", lambda handle: capture[0])
    rng = np.random.default_rng(23)
    g = {"bsize": 2, "bstride": 2}

    def check():
        mask = (rng.random((1, 6, 10)) < 0.3).astype(np.float32)
        got, count = sbnet.reduce_mask(mask, version=2, **g)
        np.testing.assert_array_equal(got, reference.reduce_mask(mask, **g))

    def launches():
        return {key[0]: int(buffer.copy_to_host()[0]) for key, buffer in sbnet.statuses._status_buffers.items()}

    check()
    check()
    stream = next(iter(launches()))
    assert launches() == {stream: 2} and len(next(iter(sbnet.statuses._status_spares.values()))) == 1
    capture[0] = 7
    check()
    check()
    assert launches() == {stream: 2, (7, stream): 2} and not next(iter(sbnet.statuses._status_spares.values()))
    capture[0] = 8  # no spare left
    check()
    assert launches() == {stream: 2, (7, stream): 2}
    capture[0] = None  # a call outside captures makes a new spare
    check()
    assert launches() == {stream: 3, (7, stream): 2} and len(next(iter(sbnet.statuses._status_spares.values()))) == 1


@pytest.mark.gpu
@pytest.mark.skipif(SIMULATOR, reason="captures a CUDA graph")
def test_reduce_mask_in_a_captured_graph_replays_beside_eager_calls(monkeypatch):
    """A torch CUDA graph of two reduce_mask calls (kept statuses, no fill node), replayed on new
    mask contents, between eager calls on the capture's stream and on another: each call's
    indices and count are the mask's."""
    torch = pytest.importorskip("torch")
    monkeypatch.setattr(plans, "kept", {})
    rng = np.random.default_rng(24)
    g = {"bsize": 4, "bstride": 4, "boffset": -1}
    shape = (2, 60, 90)
    mask = torch.zeros(shape, device="cuda")

    def expect(indices, count, host_mask):
        want = reference.reduce_mask(host_mask, **g)
        n = int(count[0])
        assert n == len(want)
        np.testing.assert_array_equal(indices[:n].cpu().numpy(), want)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # eager calls first: a spare for the capture
        for _ in range(2):
            host = (rng.random(shape) < 0.1).astype(np.float32)
            mask.copy_(torch.as_tensor(host))
            expect(*sbnet.reduce_mask(mask, **g), host)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        first = sbnet.reduce_mask(mask, **g)
        second = sbnet.reduce_mask(mask, **g)
    other = torch.cuda.Stream()
    for step in range(4):
        host = (rng.random(shape) < 0.05 * (step + 1)).astype(np.float32)
        mask.copy_(torch.as_tensor(host))
        graph.replay()
        expect(*first, host)
        expect(*second, host)
        expect(*sbnet.reduce_mask(mask, **g), host)
        other.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(other):
            expect(*sbnet.reduce_mask(mask, **g), host)
        torch.cuda.current_stream().wait_stream(other)


@pytest.mark.skipif(not SIMULATOR, reason="fakes the driver launch; the GPU test above runs the real one")
def test_kept_plans_are_keyed_by_what_the_checks_see(monkeypatch):
    """Plan bookkeeping with the launch faked: a call like the first replays with the new
    pointers; another shape, alignment, geometry, flag or a non-contiguous view does not."""
    torch = pytest.importorskip("torch")
    from sparseblocks.runtime import arrays as _arrays

    launches = []
    monkeypatch.setattr(plans, "kept", {})
    monkeypatch.setattr(sbnet.plans, "replay", lambda *args, live: lambda stream, *pointers: launches.append(pointers))
    monkeypatch.setattr(_arrays, "torch_stream_handle", lambda: 0)
    g = {"bsize": 2, "bstride": 2, "boffset": 0}
    indices = torch.tensor([[0, 0, 0], [0, 1, 1]], dtype=torch.int32)
    sbnet.sparse_gather(torch.randn(1, 4, 4, 4), indices, **g)  # the general path keeps a plan
    assert len(plans.kept) == 1 and not launches
    x = torch.randn(1, 4, 4, 4)
    blocks = sbnet.sparse_gather(x, indices, **g)
    assert blocks.shape == (2, 2, 2, 4) and launches[-1][0] == x.data_ptr()
    assert launches[-1][1:3] == (blocks.data_ptr(), indices.data_ptr())
    for other in (torch.randn(1, 4, 6, 4), torch.randn(65)[1:].view(1, 4, 4, 4)):
        sbnet.sparse_gather(other, indices, **g)
    sbnet.sparse_gather(x, indices, transpose=True, **g)
    sbnet.sparse_gather(x, indices, **dict(g, boffset=-1))
    assert len(launches) == 1 and len(plans.kept) == 5
    with pytest.raises(ValueError, match="contiguous"):
        sbnet.sparse_gather(torch.randn(1, 4, 4, 4).permute(0, 2, 1, 3), indices, **g)
    y = torch.randn(1, 4, 4, 4)
    blocks = torch.randn(blocks.shape)  # (the faked replay left the gathered blocks uninitialized)
    sbnet.sparse_scatter(blocks, indices, y, add=True, inplace=True, **g)  # (the simulator works on copies)
    sbnet.sparse_scatter(blocks, indices, y, add=True, inplace=True, **g)
    assert launches[-1][:3] == (y.data_ptr(), blocks.data_ptr(), indices.data_ptr())
    assert len(launches) == 2
    mask = torch.zeros(1, 4, 6)
    sbnet.reduce_mask(mask, 2, 2, tol=0.5)  # keeps a plan
    again = torch.ones(1, 4, 6)
    active, count = sbnet.reduce_mask(again, 2, 2, tol=0.5)
    assert active.shape == (6, 3) and count.shape == (1,) and active.dtype == count.dtype == torch.int32
    one = launches[-1]  # version 2's one launch: (indices, count, statuses, mask)
    assert one[3] == again.data_ptr() and one[:2] == (active.data_ptr(), count.data_ptr()) and len(launches) == 3
    sbnet.reduce_mask(mask, 2, 2, tol=0.5, version=1)  # keeps a plan of two launches
    active, count = sbnet.reduce_mask(again, 2, 2, tol=0.5, version=1)
    pool, compact = launches[-2:]  # (flags, chunk counts, mask), (indices, count, flags, ...)
    assert pool[2] == again.data_ptr() and compact[:2] == (active.data_ptr(), count.data_ptr())
    assert compact[2] == pool[0] and compact[3] == compact[4] == pool[1] and len(launches) == 5
    sbnet.reduce_mask(again, 2, 2, tol=0.25)  # another threshold: the general path
    assert len(launches) == 5 and len(plans.kept) == 9


# Windows 2**30 apart from -(2**31 - 1): window (2, 2) starts at (1, 1). Rows 6 and -2 start
# 2**32 from it, and so do columns -2 and 6: in 32-bit arithmetic they would land on it too.
FAR = {"bsize": (2, 3), "bstride": (2**30, 2**30), "boffset": (-(2**31 - 1), -(2**31 - 1))}
# The same at columns of multiples of 4 (window (2, 2) starts at (1, 4)), 4 wide: the NCHW fp16 pair
# kernels' and pair tiles' windows, adding scatters that are not atomic included (plain: four halves a word).
FAR_EVEN = dict(FAR, bsize=(2, 4), boffset=(-(2**31 - 1), -(2**31 - 4)))
FAR_INDICES = np.array([[0, 2, 2], [0, 6, 2], [0, 2, -2], [0, -2, 6], [0, 2**31 - 1, 2], [0, -2**31, 2],
                        [0, 2, -2**31]], np.int32)


@pytest.mark.parametrize("dtype, channels, data_format, transpose, even", [
    ("float32", 4, "NHWC", False, False), ("float32", 4, "NHWC", True, False), ("float16", 8, "NHWC", True, False),
    ("float32", 3, "NHWC", False, False), ("float16", 2, "NCHW", False, False), ("float32", 3, "NCHW", True, False),
    ("float16", 2, "NCHW", False, True), ("float16", 2, "NCHW", True, True)])
@pytest.mark.parametrize("add, atomic", [(False, False), (True, False), (True, True)])
@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # (offsets of rows off the image: unused)
def test_far_windows_land_where_64_bit_arithmetic_puts_them(dtype, channels, data_format, transpose, even, add,
                                                            atomic):
    """Window starts of int32 indices times strides and offsets near 2**31 (the bounds the
    geometry check allows), each kernel family (row copies, transposing tiles, element kernels,
    NCHW fp16 pairs, pair tiles and gathers by words: ``even``, windows 4 wide at columns of
    multiples of 4 of an image 8 wide): only window (2, 2) touches the image, gathered and
    scattered (into a copy and in place) as the reference does. The simulator's Python ints
    once multiplied NumPy int32 indices in 32 bits there."""
    rng = np.random.default_rng(5)
    width = 8 if even else 5
    shape = (1, 4, width, channels) if data_format == "NHWC" else (1, channels, 4, width)
    x = rng.standard_normal(shape).astype(dtype)
    g = dict(FAR_EVEN if even else FAR, transpose=transpose, data_format=data_format)
    want = reference.sparse_gather(x, FAR_INDICES, **g)
    assert np.abs(want[0]).sum() > 0 and not want[1:].any()
    np.testing.assert_array_equal(sbnet.sparse_gather(x, FAR_INDICES, **g), want)
    blocks = rng.standard_normal(want.shape).astype(dtype)
    y = rng.standard_normal(shape).astype(dtype)
    want_y = reference.sparse_scatter(blocks, FAR_INDICES, y, add=add, **g)
    rtol = 1e-3 if dtype == "float16" else 1e-6
    np.testing.assert_allclose(sbnet.sparse_scatter(blocks, FAR_INDICES, y, add=add, atomic=atomic, **g), want_y,
                               rtol=rtol)
    y_device = cuda.to_device(y)
    sbnet.sparse_scatter(cuda.to_device(blocks), cuda.to_device(FAR_INDICES), y_device, add=add, atomic=atomic,
                         inplace=True, **g)
    np.testing.assert_allclose(y_device.copy_to_host(), want_y, rtol=rtol)


def test_zero_blocks():
    x = np.ones((1, 4, 4, 2), np.float32)
    none = np.zeros((0, 3), np.int32)
    assert sbnet.sparse_gather(x, none, bsize=2, bstride=2).shape == (0, 2, 2, 2)
    np.testing.assert_array_equal(sbnet.sparse_scatter(np.zeros((0, 2, 2, 2), np.float32), none, x,
                                                       bsize=2, bstride=2, add=True), x)


@pytest.mark.parametrize("transpose", [False, True])
def test_gather_into_out_writes_zeros_past_the_count(transpose):
    """``out=``: the rows below the count are the reference's, the rest zeros (whatever they
    held); the same call again (a kept plan, torch) writes into another out; the reference's
    twin agrees."""
    rng = np.random.default_rng(4)
    g = {"bsize": (3, 2), "bstride": 2, "boffset": (-1, 0)}
    x = rng.standard_normal((2, 5, 6, 4)).astype(np.float32)
    indices = np.array([[0, 0, 0], [1, 2, 1], [0, 1, 2], [1, 0, 0]], np.int32)
    count = np.array([3], np.int32)
    want = reference.sparse_gather(x, indices, transpose=transpose, count=count, **g)
    shape = (4, *want.shape[1:])
    sentinel = np.full(shape, 7.0, np.float32)
    expected = np.zeros(shape, np.float32)
    expected[:3] = want
    out = cuda.to_device(sentinel)
    got = sbnet.sparse_gather(cuda.to_device(x), cuda.to_device(indices), transpose=transpose, count=count,
                              out=out, **g)
    np.testing.assert_array_equal(got.copy_to_host(), expected)
    assert reference.sparse_gather(x, indices, transpose=transpose, count=count, out=sentinel.copy(),
                                   **g).tolist() == expected.tolist()
    torch = pytest.importorskip("torch")
    device = "cpu" if SIMULATOR else "cuda"
    xt, it, ct = (torch.as_tensor(a, device=device) for a in (x, indices, count))
    for _ in range(2):  # the second call replays the first's kept plan (on the GPU)
        out = torch.full(shape, 7.0, device=device)
        got = sbnet.sparse_gather(xt, it, transpose=transpose, count=ct, out=out, **g)
        assert SIMULATOR or got is out
        np.testing.assert_array_equal(got.cpu().numpy(), expected)
    for bad, error, message in ((torch.zeros(shape, dtype=torch.float64, device=device), TypeError, "float32"),
                                (torch.zeros((3, *shape[1:]), device=device), ValueError, "out: expected shape"),
                                (torch.zeros((shape[0], *shape[1:-1], 2 * shape[-1]), device=device)[..., ::2],
                                 ValueError, "contiguous")):
        with pytest.raises(error, match=message):  # (after a kept plan: the general path says why)
            sbnet.sparse_gather(xt, it, transpose=transpose, count=ct, out=bad, **g)


X = np.ones((1, 4, 4, 2), np.float32)
IDX = np.array([[0, 0, 0], [0, 1, 1]], np.int32)
B = np.ones((2, 2, 2, 2), np.float32)


@pytest.mark.parametrize("call, error, message", [
    (lambda: sbnet.sparse_scatter(np.ones((2, 3, 3, 2), np.float32), IDX, X, bsize=3, bstride=2, add=True),
     ValueError, "overlap"),
    (lambda: sbnet.sparse_scatter(B, np.array([[0, 0, 0], [0, 0, 0]], np.int32), X, bsize=2, bstride=2,
                                  add=True), ValueError, "repeated"),
    (lambda: sbnet.sparse_scatter(B, IDX, X, bsize=2, bstride=2, inplace=True), TypeError, "inplace"),
    (lambda: sbnet.sparse_scatter(B[:1], IDX, X, bsize=2, bstride=2), ValueError, "blocks: expected shape"),
    (lambda: sbnet.sparse_scatter(B, IDX, X.astype(np.float64), bsize=2, bstride=2), TypeError, "mismatch"),
    (lambda: sbnet.sparse_gather(X[0], IDX, bsize=2, bstride=2), ValueError, "x: expected NHWC"),
    (lambda: sbnet.sparse_gather(X, IDX.astype(np.int64), bsize=2, bstride=2), TypeError, "indices"),
    (lambda: sbnet.sparse_gather(X, IDX[:, :2], bsize=2, bstride=2), ValueError, "indices"),
    (lambda: sbnet.sparse_gather(X, IDX, bsize=0, bstride=2), ValueError, "bsize"),
    (lambda: sbnet.sparse_gather(X, IDX, bsize=2**31, bstride=2), ValueError, "bsize"),
    (lambda: sbnet.sparse_gather(X, IDX, bsize=2, bstride=(2, 2**31)), ValueError, "bstride"),
    (lambda: sbnet.sparse_scatter(B, IDX, X, bsize=2, bstride=2, boffset=(-2**31, 0)), ValueError, "boffset"),
    (lambda: sbnet.reduce_mask(np.ones((1, 4, 4), np.float32), 2, 2, boffset=2**31), ValueError, "boffset"),
    (lambda: sbnet.sparse_gather(X, IDX, bsize=2, bstride=2, count=np.array([3], np.int32)), ValueError,
     "count"),
    (lambda: sbnet.sparse_gather(X.astype(np.int32), IDX, bsize=2, bstride=2), TypeError, "x: expected dtype"),
    (lambda: sbnet.reduce_mask(np.ones((4, 4), np.float32), 2, 2), ValueError, "mask"),
    (lambda: sbnet.sparse_gather(X, IDX, bsize=2, bstride=2, data_format="CHWN"), ValueError, "data_format"),
    (lambda: sbnet.reduce_mask(np.ones((1, 4, 4), np.int64), 2, 2), TypeError, "mask"),
    (lambda: sbnet.reduce_mask(np.ones((1, 4, 4), np.float32), 2, 2, tol="high"), TypeError, "tol: expected a number"),
    (lambda: sbnet.reduce_mask(np.ones((1, 4, 4), np.float32), 2, 2, tol="0.5"), TypeError, "tol: expected a number"),
    (lambda: reference.reduce_mask(np.ones((1, 4, 4), np.float32), 2, 2, tol="0.5"), TypeError, "tol: expected"),
    (lambda: sbnet.reduce_mask(np.ones((1, 4, 4), np.float32), 2, 2, tol=float("nan")), ValueError, "not NaN"),
    (lambda: reference.reduce_mask(np.ones((1, 4, 4), np.float32), 2, 2, tol=np.nan), ValueError, "tol: .* not NaN"),
    (lambda: sbnet.sparse_gather(X, IDX, bsize=2, bstride=2, out=B.copy()), TypeError, "out: expected a device"),
    (lambda: sbnet.sparse_gather(cuda.to_device(X), cuda.to_device(IDX), bsize=2, bstride=2,
                                 out=cuda.to_device(B[:1])),
     ValueError, "out: expected shape"),
])
def test_bad_input_raises_before_launch(call, error, message):
    with pytest.raises(error, match=message):
        call()


def _shared_buffer(kind, size):
    """Zeros of `size` float32 and a way to view part of them: (buffer, view(start, stop, shape,
    dtype)), Numba device arrays or torch tensors (on the GPU; host tensors in the simulator)."""
    if kind == "numba":
        buffer = cuda.to_device(np.zeros(size, np.float32))
        return buffer, lambda start, stop, shape, dtype=np.float32: \
            buffer.view(dtype)[start:stop].reshape(shape)
    torch = pytest.importorskip("torch")
    buffer = torch.zeros(size, device="cpu" if SIMULATOR else "cuda")
    return buffer, lambda start, stop, shape, dtype=np.float32: \
        buffer.view(getattr(torch, np.dtype(dtype).name))[start:stop].reshape(shape)


@pytest.mark.parametrize("kind", ["numba", "torch"])
@pytest.mark.parametrize("call, shared", [("gather", "x"), ("gather", "indices"), ("gather", "count"),
                                          ("scatter", "blocks"), ("scatter", "indices"), ("scatter", "count")])
def test_a_written_array_sharing_memory_with_a_read_one_raises(kind, call, shared, monkeypatch):
    # One buffer: the blocks (or a gather's out) in elements 0-15, the image in 16-47, indices in
    # 48-53, the count in 54. The call runs first with those disjoint (adjacent, not shared: no
    # false alarm, and on a GPU a kept plan for the second call to find), then with `shared` moved
    # into what it writes, where it must raise before any launch (replayed or not).
    buffer, view = _shared_buffer(kind, 64)
    image = view(16, 48, (1, 4, 4, 2))
    image_host = np.arange(32, dtype=np.float32).reshape(1, 4, 4, 2)
    want_indices = np.array([[0, 0, 0], [0, 1, 1]], np.int32)
    indices, count = view(48, 54, (2, 3), np.int32), view(54, 55, (1,), np.int32)
    if kind == "numba":
        image.copy_to_device(image_host)
        indices.copy_to_device(want_indices)
        count.copy_to_device(np.array([2], np.int32))
    else:
        torch = pytest.importorskip("torch")
        image.copy_(torch.as_tensor(image_host))
        indices.copy_(torch.as_tensor(want_indices))
        count.fill_(2)
    blocks = view(0, 16, (2, 2, 2, 2))
    g = {"bsize": 2, "bstride": 2}

    def host(array):
        return array.copy_to_host() if kind == "numba" else array.cpu().numpy()

    def run(blocks, indices, count):
        if call == "gather":
            return sbnet.sparse_gather(image, indices, count=count, out=blocks, **g)
        return sbnet.sparse_scatter(blocks, indices, image, count=count, add=True, inplace=True, **g)

    stack = reference.sparse_gather(image_host, want_indices, **g)
    if call == "scatter":
        blocks_host = np.arange(16, dtype=np.float32).reshape(2, 2, 2, 2) + 100
        blocks.copy_to_device(blocks_host) if kind == "numba" else blocks.copy_(torch.as_tensor(blocks_host))
        got = run(blocks, indices, count)  # (image itself, but for torch in the simulator: a copy)
        np.testing.assert_array_equal(host(got), reference.sparse_scatter(
            blocks_host, want_indices, image_host, add=True, **g))
    else:
        for _ in range(2):  # (a GPU keeps the first call's plan and replays it)
            np.testing.assert_array_equal(host(run(blocks, indices, count)), stack)
    before = host(buffer)

    def no_launch(*args, **kwargs):
        raise AssertionError("launched")

    monkeypatch.setattr(sbnet.reduce, "launch", no_launch)
    at = 20 if call == "scatter" else 4  # an element inside what the call writes (image, or out)
    moved = {"x": (view(20, 36, (2, 2, 2, 2)), indices, count),  # (the gather's out inside its image)
             "blocks": (view(at, at + 16, (2, 2, 2, 2)), indices, count),
             "indices": (blocks, view(at, at + 6, (2, 3), np.int32), count),
             "count": (blocks, indices, view(at, at + 1, (1,), np.int32))}[shared]
    written_name = "out" if call == "gather" else "y"
    with pytest.raises(ValueError, match=f"{written_name}: shares memory with {shared}"):
        run(*moved)
    np.testing.assert_array_equal(host(buffer), before)
