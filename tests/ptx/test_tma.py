"""Bulk tensor copies (ptx/tma.py) and their tensor maps (runtime/tensormap.py): one thread
copies two boxes of a 2-D tensor into shared memory, one inside it and one that runs past both of
its dims, completing on an mbarrier that another warp waits on; the shared bytes are the boxes
with the 128-byte swizzle and zeros past the dims. The simulator's twin and an sm_90 GPU run
the same kernel."""

import numpy as np
import pytest
from numba import cuda, uint8

from sparseblocks.bsmm.dispatch import hopper
from sparseblocks.ptx.cp_async import global_address, shared_address, signed_address
from sparseblocks.ptx.mbarrier import init, wait
from sparseblocks.ptx.tma import ALIGN, expect_tx, load_2d
from sparseblocks.ptx.wgmma import align_up
from sparseblocks.runtime import tensormap
from sparseblocks.runtime.backend import SIMULATOR
from sparseblocks.runtime.launch import data_pointer

pytestmark = pytest.mark.skipif(not SIMULATOR and not hopper(),
                                reason="bulk tensor copies: an sm_90 GPU or the simulator")

ROWS, COLS = 20, 80  # the tensor: 16-bit values, rows of 160 bytes
BOX = (64, 8)  # (values along a row: 128 bytes, rows)
BOX_BYTES = 2 * BOX[0] * BOX[1]
CORNERS = ((8, 4), (40, 16))  # (inner, outer): one box inside the tensor, one past both dims
SHARED = ALIGN + 2 * BOX_BYTES + 64  # bytes: the boxes from the first 1024-byte boundary, and the barrier


@cuda.jit
def _boxes(out, source, tmap):
    t = cuda.threadIdx.x
    smem = cuda.shared.array(SHARED, uint8)
    start = shared_address(smem, (0,))
    base = align_up(start, ALIGN)
    bar = base + 2 * BOX_BYTES
    if t == 0:
        init(bar, 1)
    cuda.syncthreads()
    if t == 32:  # warp 1's first lane issues both boxes
        expect_tx(bar, 2 * BOX_BYTES)
        for i in range(2):
            load_2d(base + i * BOX_BYTES, global_address(tmap, (0,)), signed_address(source, (0, 0)),
                    CORNERS[i][0], CORNERS[i][1], bar)
    elif t < 32:  # warp 0 waits for the bytes and reads them out
        wait(bar, 0)
        skip = base - start
        for i in range(t, 2 * BOX_BYTES, 32):
            out[i] = smem[skip + i]
    cuda.syncthreads()


def _expected(source):
    """The two boxes as the copy leaves them: zeros past the dims, then each row's 16-byte chunk
    c at chunk c ^ (row % 8)."""
    out = []
    for inner, outer in CORNERS:
        box = np.zeros((BOX[1], BOX[0]), np.uint16)
        rows, cols = source[outer:outer + BOX[1], inner:inner + BOX[0]].shape
        box[:rows, :cols] = source[outer:outer + rows, inner:inner + cols]
        chunks = box.view(np.uint8).reshape(BOX[1], 8, 16)
        swizzled = np.empty_like(chunks)
        for r in range(BOX[1]):
            for c in range(8):
                swizzled[r, c ^ (r % 8)] = chunks[r, c]
        out.append(swizzled.reshape(-1))
    return np.concatenate(out)


def test_bulk_copies_land_swizzled_and_zero_filled():
    source = np.arange(1, ROWS * COLS + 1, dtype=np.uint16).reshape(ROWS, COLS)
    source_device = cuda.to_device(source)
    address = data_pointer(source_device)
    tmap = tensormap.tensor_map(address, 2, (COLS, ROWS), 2 * COLS, BOX)
    assert tmap is tensormap.tensor_map(address, 2, (COLS, ROWS), 2 * COLS, BOX)  # kept
    out = cuda.to_device(np.full(2 * BOX_BYTES, 0xEE, np.uint8))
    _boxes[1, 64](out, source_device, tmap)
    np.testing.assert_array_equal(out.copy_to_host(), _expected(source))


@pytest.mark.parametrize("args, message", [
    ((0x1008, 2, (80, 20), 160, (64, 8)), "multiples of 16"),
    ((0x1000, 2, (80, 20), 168, (64, 8)), "multiples of 16"),
    ((0x1000, 4, (80, 20), 320, (32, 8)), "2"),
    ((0x1000, 2, (80, 20), 160, (32, 8)), "128 bytes"),
    ((0x1000, 2, (80, 20), 160, (64, 257)), "128 bytes"),
    ((0x1000, 2, (0, 20), 160, (64, 8)), "dims"),
])
def test_tensor_maps_refuse_what_the_copies_cannot_take(args, message):
    assert message in tensormap.check(*args)
    with pytest.raises(ValueError, match="tensor map"):
        tensormap.encode_into(np.zeros(128, np.uint8), *args)


def test_tensor_maps_are_kept_in_slabs_allocated_ahead_and_never_in_a_capture(monkeypatch):
    """The device path's bookkeeping (its driver encoding faked): one slot a map, kept; the next
    slab allocated once fewer than HEADROOM slots are left, never while the stream captures (a
    map that would need one is None then), and None past MAX_MAPS."""
    encoded = []
    monkeypatch.setattr(tensormap, "SIMULATOR", False)
    monkeypatch.setattr(tensormap, "encode_into", lambda into, *key: (encoded.append(key), into.fill(len(encoded))))
    monkeypatch.setattr(tensormap, "SLAB", 4)
    monkeypatch.setattr(tensormap, "HEADROOM", 2)
    monkeypatch.setattr(tensormap, "MAX_MAPS", 8)
    monkeypatch.setattr(tensormap, "_maps", {})
    monkeypatch.setattr(tensormap, "_slabs", {})
    monkeypatch.setattr(tensormap, "_used", {})
    capturing = [False]
    monkeypatch.setattr(tensormap, "capture_of", lambda handle: 1 if capturing[0] else None)
    made = lambda i: tensormap.tensor_map(16 * (i + 1), 2, (64, 8), 128, (64, 8))  # noqa: E731
    slabs = lambda: len(tensormap._slabs[tensormap.active()])  # noqa: E731
    first = made(0)
    assert made(0) is first and len(encoded) == 1 and slabs() == 1
    assert np.all(first.copy_to_host() == 1)  # (uploaded from the pinned mirror)
    made(1)
    made(2)
    assert slabs() == 1
    made(3)
    assert slabs() == 2  # (fewer than 2 free slots were left: the next slab is there)
    capturing[0] = True
    assert all(made(i) is not None for i in range(4, 8)) and slabs() == 2  # (the second slab's slots)
    assert made(8) is None  # (the slabs are full, and a capture allocates none)
    capturing[0] = False
    assert made(8) is None and slabs() == 2  # (MAX_MAPS)
