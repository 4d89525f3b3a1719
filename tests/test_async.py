"""Asynchronous global-to-shared copies (kernels/_async.py), on the GPU and in the simulator."""

import numpy as np
import pytest
from numba import cuda, float32

from sparseblocks._backend import SIMULATOR
from sparseblocks.kernels._async import commit, copy16, wait_all, wait_but_one

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


def test_stages_land_in_order():
    source = np.arange(2 * ROWS * WIDTH, dtype=np.float32).reshape(2, ROWS, WIDTH)
    out = cuda.to_device(np.full_like(source, np.nan))
    _two_stages[1, ROWS](out, cuda.to_device(source))
    np.testing.assert_array_equal(out.copy_to_host(), np.roll(source, -1, axis=1))


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


@pytest.mark.skipif(SIMULATOR, reason="compiles PTX")
def test_ptx_has_the_async_copies():
    from numba import types

    array = types.float32[:, :, ::1]
    ptx, _ = cuda.compile_ptx(_two_stages.py_func, (array, array))
    assert ptx.count("cp.async.cg.shared.global") == 2
    assert "cp.async.wait_group 1" in ptx and "cp.async.commit_group" in ptx
