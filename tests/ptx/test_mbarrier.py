"""mbarriers and named barriers (ptx/mbarrier.py): a producer warp copies stages into a ring of
two buffers with cp.async, completing on full barriers; a consumer warp waits on them, reads
each stage and hands its buffer back through an empty barrier. Four stages go round the ring
twice, so each barrier completes phases of both parities; named barriers sync a subset of warps.
The simulator's twins and an sm_90 GPU run the same kernels."""

import numpy as np
import pytest
from numba import cuda, float32, int64

from sparseblocks.bsmm.dispatch import hopper
from sparseblocks.ptx.cp_async import copy16_to, global_address, shared_address
from sparseblocks.ptx.mbarrier import BYTES, arrive, copy_arrive, init, named_barrier, registers, wait
from sparseblocks.runtime.backend import SIMULATOR
from sparseblocks.runtime.compile import bounded

pytestmark = pytest.mark.skipif(not SIMULATOR and not hopper(), reason="mbarrier waits: an sm_90 GPU or the simulator")

WIDTH = 4  # fp32 values of a 16-byte chunk: a stage is one chunk a producer lane
STAGES, BUFFERS = 4, 2
BARRIERS = 2 * BUFFERS  # full ones, then empty ones


@cuda.jit
def _ring(out, source):
    """Warp 1 copies stage s (source[s], 32 chunks) into buffer s % 2; warp 0 reads it back,
    each lane another lane's chunk (visible only through the barrier), into out[s]."""
    t = cuda.threadIdx.x
    warp, lane = t // 32, t % 32
    ring = cuda.shared.array((BUFFERS, 32, WIDTH), float32)
    bars = cuda.shared.array(BARRIERS, int64)
    full, empty = shared_address(bars, (0,)), shared_address(bars, (BUFFERS,))
    if t == 0:
        for b in range(BUFFERS):
            init(full + b * BYTES, 32)  # every producer lane's copy_arrive
            init(empty + b * BYTES, 1)  # the consumer warp's lane 0
    cuda.syncthreads()
    if warp == 1:
        to, origin = shared_address(ring, (0, lane, 0)), global_address(source, (0, lane, 0))
        for s in range(STAGES):
            b = s % BUFFERS
            wait(empty + b * BYTES, ((s // BUFFERS) & 1) ^ 1)  # (passes at once the first time round)
            copy16_to(to + b * 32 * WIDTH * 4, origin + s * 32 * WIDTH * 4)
            copy_arrive(full + b * BYTES)
    else:
        for s in range(STAGES):
            b = s % BUFFERS
            wait(full + b * BYTES, (s // BUFFERS) & 1)
            j = (lane + 1) % 32
            for c in range(WIDTH):
                out[s, lane, c] = ring[b, j, c]
            cuda.syncwarp()
            if lane == 0:
                arrive(empty + b * BYTES)


_give, _take = registers(56, False), registers(200, True)


@bounded(384)
def _hand_over(out):
    """Warpgroup 0 gives registers back, warpgroups 1 and 2 take them (56 + 2 x 200 a thread of
    each warpgroup's 128 fit the 64K register file), and every thread still runs its branch."""
    t = cuda.threadIdx.x
    if t < 128:
        _give()
        out[t] = float32(-t)
    else:
        _take()
        out[t] = float32(t)


@cuda.jit
def _named(out):
    """Warps 0-1 and 2-3 meet at barriers 1 and 2 of 64 threads each; a value written before a
    barrier is read after it by another warp of its pair."""
    t = cuda.threadIdx.x
    shared = cuda.shared.array(128, float32)
    shared[t] = float32(t)
    if t < 64:
        named_barrier(1, 64)
        out[t] = shared[63 - t]
    else:
        named_barrier(2, 64)
        out[t] = shared[191 - t]


def test_ring_of_stages_through_mbarriers():
    source = np.arange(STAGES * 32 * WIDTH, dtype=np.float32).reshape(STAGES, 32, WIDTH)
    out = cuda.to_device(np.full_like(source, np.nan))
    _ring[1, 64](out, cuda.to_device(source))
    np.testing.assert_array_equal(out.copy_to_host(), np.roll(source, -1, axis=1))


def test_named_barriers_sync_their_warps():
    out = cuda.to_device(np.full(128, np.nan, np.float32))
    _named[1, 128](out)
    expected = np.concatenate([np.arange(63, -1, -1), np.arange(127, 63, -1)]).astype(np.float32)
    np.testing.assert_array_equal(out.copy_to_host(), expected)


def test_registers_move_between_warpgroups():
    out = cuda.to_device(np.zeros(384, np.float32))
    _hand_over[1, 384](out)
    t = np.arange(384, dtype=np.float32)
    np.testing.assert_array_equal(out.copy_to_host(), np.where(t < 128, -t, t))


def test_registers_refuses_what_setmaxnreg_cannot_take():
    for count in (20, 100, 264):
        with pytest.raises(ValueError, match="registers"):
            registers(count, True)


@pytest.mark.skipif(not SIMULATOR, reason="the simulator's check; a GPU would hang")
def test_a_wait_on_a_barrier_never_initialized_raises():
    @cuda.jit
    def lost(out):
        bars = cuda.shared.array(1, int64)
        wait(shared_address(bars, (0,)), 0)
        out[0] = 1

    from sparseblocks.runtime.simulator import WarpCollectiveError

    with pytest.raises(WarpCollectiveError, match="no mbarrier"):
        lost[1, 1](cuda.to_device(np.zeros(1, np.float32)))


@pytest.mark.skipif(SIMULATOR, reason="compiles PTX")
def test_ptx_has_the_barriers():
    from numba import types

    array = types.float32[:, :, ::1]
    ptx, _ = cuda.compile_ptx(_ring.py_func, (array, array), cc=(9, 0))
    for instruction in ("mbarrier.init.shared::cta.b64", "mbarrier.try_wait.parity.shared::cta.b64",
                        "cp.async.mbarrier.arrive.noinc.shared::cta.b64", "mbarrier.arrive.shared::cta.b64"):
        assert instruction in ptx
    ptx, _ = cuda.compile_ptx(_named.py_func, (types.float32[::1],), cc=(9, 0))
    assert ptx.count("bar.sync") == 2
