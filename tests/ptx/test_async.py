"""Asynchronous global-to-shared copies (kernels/_async.py), on the GPU and in the simulator."""

import numpy as np
import pytest
from numba import cuda, float32, int32

from sparseblocks.runtime.backend import SIMULATOR
from sparseblocks.ptx.cp_async import (
    commit, copy4_or_zero, copy8_or_zero, copy16, copy16_to, global_address, make_ring, shared_address, wait_all,
    wait_but_one, waiter,
)

ROWS, WIDTH = 8, 4  # a thread block of 8 threads, each one 16-byte row of fp32


@cuda.jit
def _two_stages(out, source):
    """Stage s (rows of source[s]) copied asynchronously, both in flight, read back in order."""
    t = cuda.threadIdx.x
    stages = cuda.shared.array((2, ROWS, WIDTH), float32)
    copy16(stages, (0, t, 0), source, (0, t, 0))
    commit()
    copy16(stages, (1, t, 0), source, (1, t, 0))
    commit()
    wait_but_one()  # stage 0 has landed, stage 1 may not have
    cuda.syncthreads()  # every thread's stage 0 rows are visible
    j = (t + 1) % ROWS  # read another thread's row: the barrier is what makes it visible
    for c in range(WIDTH):
        out[0, t, c] = stages[0, j, c]
    wait_all()
    cuda.syncthreads()  # stage 1 likewise
    for c in range(WIDTH):
        out[1, t, c] = stages[1, j, c]


@cuda.jit
def _read_before_wait(out, source):
    t = cuda.threadIdx.x
    stage = cuda.shared.array((ROWS, WIDTH), float32)
    for c in range(WIDTH):
        stage[t, c] = 0
    cuda.syncthreads()  # the zeros are in place before any copy starts
    copy16(stage, (t, 0), source, (t, 0))
    commit()
    for c in range(WIDTH):
        out[0, t, c] = stage[t, c]
    wait_all()
    for c in range(WIDTH):
        out[1, t, c] = stage[t, c]


_wait_but_one = waiter(1)  # device functions are taken outside kernels


@cuda.jit
def _addressed_stages(out, source, stride_bytes):
    """_two_stages through addresses taken once and byte offsets, a ring of three buffers,
    stage s of source into buffer s % 3, waited on with waiter(1)."""
    t = cuda.threadIdx.x
    stages = cuda.shared.array((3, ROWS, WIDTH), float32)
    to = shared_address(stages, (0, t, 0))
    origin = global_address(source, (0, t, 0))
    for s in range(2):
        copy16_to(to + s * ROWS * WIDTH * 4, origin + s * stride_bytes)
        commit()
    for s in range(2):
        _wait_but_one()  # stage s has landed, the one after it may not have
        cuda.syncthreads()  # every thread's rows of stage s are visible
        j = (t + 1) % ROWS
        for c in range(WIDTH):
            out[s, t, c] = stages[s % 3, j, c]
        commit()  # an empty group: the wait above counts one group a stage


@cuda.jit(device=True)
def _issue_row(s, at, args):
    origin, stride_bytes = args
    copy16_to(at, origin + s * stride_bytes)


RING_WORDS = 3 * ROWS * WIDTH  # (a constant: shared.array's size must be one on a GPU)


def _make_ring_stages(counter, lag):
    prime, advance = make_ring(_issue_row, 3, ROWS * WIDTH * 4, counter, lag=lag)

    @cuda.jit
    def ring_stages(out, before, source, stride_bytes, count):
        """``count`` stages of source through `make_ring`'s ring of three buffers, each read back
        (another thread's row) from the buffer ``advance`` names, as it lands; with ``lag`` 2, the
        stage before it read back again, after that barrier, from its buffer."""
        t = cuda.threadIdx.x
        stages = cuda.shared.array(RING_WORDS, float32)
        base = shared_address(stages, (t * WIDTH,))
        args = (global_address(source, (0, t, 0)), stride_bytes)
        prime(base, count, args)
        buf = 0
        last = int32(0)  # (the word offset of the buffer read before)
        for s in range(count):
            at, buf = advance(s, buf, base, count, args)
            here = int32((at - base) // 4)
            first = here + ((t + 1) % ROWS) * WIDTH  # (another thread's row of the buffer)
            kept = last + ((t + 1) % ROWS) * WIDTH
            for c in range(WIDTH):
                out[s, t, c] = stages[first + c]
                if lag == 2 and s > 0:
                    before[s - 1, t, c] = stages[kept + c]
            cuda.syncthreads()  # (lag 1: every read of the buffer done before the next stage refills it)
            last = here

    return ring_stages


@pytest.mark.parametrize("counter, lag", [(True, 1), (False, 1), (True, 2), (False, 2)])
def test_ring_stages_land_in_order(counter, lag):
    source = np.arange(5 * ROWS * WIDTH, dtype=np.float32).reshape(5, ROWS, WIDTH)
    out = cuda.to_device(np.full_like(source, np.nan))
    before = cuda.to_device(np.full_like(source, np.nan))
    _make_ring_stages(counter, lag)[1, ROWS](out, before, cuda.to_device(source), ROWS * WIDTH * 4, 5)
    np.testing.assert_array_equal(out.copy_to_host(), np.roll(source, -1, axis=1))
    if lag == 2:
        np.testing.assert_array_equal(before.copy_to_host()[:4], np.roll(source, -1, axis=1)[:4])


def test_ring_lag_is_checked():
    with pytest.raises(ValueError, match="lag"):
        make_ring(_issue_row, 3, 64, lag=3)


def test_stages_land_in_order():
    source = np.arange(2 * ROWS * WIDTH, dtype=np.float32).reshape(2, ROWS, WIDTH)
    out = cuda.to_device(np.full_like(source, np.nan))
    _two_stages[1, ROWS](out, cuda.to_device(source))
    np.testing.assert_array_equal(out.copy_to_host(), np.roll(source, -1, axis=1))


def test_addressed_copies_land_in_order():
    source = np.arange(2 * ROWS * WIDTH, dtype=np.float32).reshape(2, ROWS, WIDTH)
    out = cuda.to_device(np.full_like(source, np.nan))
    _addressed_stages[1, ROWS](out, cuda.to_device(source), ROWS * WIDTH * 4)
    np.testing.assert_array_equal(out.copy_to_host(), np.roll(source, -1, axis=1))


@pytest.mark.skipif(not SIMULATOR, reason="the simulator's check; a GPU would fault")
def test_addressed_copy_past_the_end_raises():
    source = cuda.to_device(np.zeros((2, ROWS, WIDTH), np.float32))
    out = cuda.to_device(np.zeros((2, ROWS, WIDTH), np.float32))
    with pytest.raises(IndexError, match="outside the array"):
        _addressed_stages[1, ROWS](out, source, 2 * ROWS * WIDTH * 4)  # stage 1 starts at the end


def test_waiter_refuses_what_it_cannot_wait_for():
    with pytest.raises(ValueError, match="keep"):
        waiter(4)


@pytest.mark.skipif(not SIMULATOR, reason="on a GPU a copy may land any time before its wait")
def test_simulated_copies_land_at_the_wait_not_before():
    """A kernel that reads a stage before waiting for it reads stale data in the simulator."""
    source = np.arange(1, ROWS * WIDTH + 1, dtype=np.float32).reshape(ROWS, WIDTH)
    out = cuda.to_device(np.full((2, ROWS, WIDTH), np.nan, np.float32))
    _read_before_wait[1, ROWS](out, cuda.to_device(source))
    got = out.copy_to_host()
    np.testing.assert_array_equal(got[0], 0)
    np.testing.assert_array_equal(got[1], source)


@pytest.mark.skipif(not SIMULATOR, reason="the simulator's check; a GPU would fault")
def test_unaligned_copy_raises():
    wide = cuda.to_device(np.zeros((2, ROWS, WIDTH + 1), np.float32))
    out = cuda.to_device(np.zeros((2, ROWS, WIDTH), np.float32))
    with pytest.raises(ValueError, match="not aligned to 16 bytes"):
        _two_stages[1, ROWS](out, wide[:, :, 1:])  # rows start 4 bytes past a 16-byte boundary


@cuda.jit
def _narrow_copies(out, source):
    """Thread t: 8 bytes (2 words) from word 2·(7 - t) and 4 bytes (1 word) from word t of
    source into its row of 3 words, the second pair zero-filled where t is odd; read back by the
    thread after it, past the barrier."""
    t = cuda.threadIdx.x
    rows = cuda.shared.array((ROWS, 4), int32)
    to = shared_address(rows, (t, 0))
    origin = global_address(source, (0,))
    copy8_or_zero(to, origin + 8 * (ROWS - 1 - t), True)
    copy4_or_zero(to + 8, origin + 4 * t, t % 2 == 0)
    commit()
    wait_all()
    cuda.syncthreads()
    j = (t + 1) % ROWS
    for c in range(3):
        out[t, c] = rows[j, c]


def test_narrow_copies_land_and_zero_fill():
    """``copy8_or_zero`` and ``copy4_or_zero``: a block-sparse list's 2- and 1-word blocks."""
    source = np.arange(1, 2 * ROWS + 1, dtype=np.int32)
    out = cuda.to_device(np.full((ROWS, 3), -1, np.int32))
    _narrow_copies[1, ROWS](out, cuda.to_device(source))
    want = np.zeros((ROWS, 3), np.int32)
    for t in range(ROWS):
        j = (t + 1) % ROWS
        want[t, :2] = source[2 * (ROWS - 1 - j):2 * (ROWS - 1 - j) + 2]
        want[t, 2] = source[j] if j % 2 == 0 else 0
    np.testing.assert_array_equal(out.copy_to_host(), want)


@pytest.mark.skipif(not SIMULATOR, reason="the simulator's check; a GPU would fault")
def test_narrow_copy_unaligned_raises():
    source = cuda.to_device(np.arange(2 * ROWS + 1, dtype=np.int32))
    out = cuda.to_device(np.zeros((ROWS, 3), np.int32))
    with pytest.raises(ValueError, match="not aligned to 8 bytes"):
        _narrow_copies[1, ROWS](out, source[1:])


@pytest.mark.skipif(SIMULATOR, reason="compiles PTX")
def test_ptx_has_the_narrow_copies():
    from numba import types

    ptx, _ = cuda.compile_ptx(_narrow_copies.py_func, (types.int32[:, ::1], types.int32[::1]))
    assert ptx.count("cp.async.ca.shared.global") == 2 and ", 8, " in ptx and ", 4, " in ptx


@pytest.mark.skipif(SIMULATOR, reason="compiles PTX")
def test_ptx_has_the_async_copies():
    from numba import types

    array = types.float32[:, :, ::1]
    ptx, _ = cuda.compile_ptx(_two_stages.py_func, (array, array))
    assert ptx.count("cp.async.cg.shared.global") == 2
    assert "cp.async.wait_group 1" in ptx and "cp.async.commit_group" in ptx
    ptx, _ = cuda.compile_ptx(_addressed_stages.py_func, (array, array, types.int64))
    assert ptx.count("cp.async.cg.shared.global") == 2 and "cvta.to.shared" in ptx
