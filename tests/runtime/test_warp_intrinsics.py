"""Warp intrinsics: the same kernels give the same answers in the simulator and on a GPU.

Every kernel here uses one family of intrinsics; the expected answer is built
in NumPy from the PTX semantics. `simulator`-marked tests check that misuse,
which would hang or be undefined on a GPU, raises in the simulator.
"""

import numpy as np
import pytest
from numba import cuda, uint32
from numba.cuda import libdevice

import sparseblocks  # noqa: F401  (installs the intrinsics under the simulator)
from sparseblocks.runtime.backend import SIMULATOR

FULL = 0xFFFFFFFF
WARP = 32


def lanes(n_threads):
    return np.arange(n_threads) % WARP


def warp_base(n_threads):
    return np.arange(n_threads) // WARP * WARP


# -- shuffles -------------------------------------------------------------------


@cuda.jit
def shuffle_kernel(out_idx, out_up, out_down, out_xor, values, arg):
    i = cuda.threadIdx.x
    v = values[i]
    a = arg[i]
    out_idx[i] = cuda.shfl_sync(FULL, v, a)
    out_up[i] = cuda.shfl_up_sync(FULL, v, a)
    out_down[i] = cuda.shfl_down_sync(FULL, v, a)
    out_xor[i] = cuda.shfl_xor_sync(FULL, v, a)


@pytest.mark.parametrize("dtype", [np.int32, np.int64, np.float32, np.float64])
def test_shuffles_read_the_peer_value_at_the_call(dtype):
    n = 64
    rng = np.random.default_rng(1)
    values = (rng.standard_normal(n) * 1000).astype(dtype)
    # Per-lane arguments, some past 31 (only their low five bits count).
    arg = rng.integers(0, 40, n).astype(np.int32)
    outs = [np.zeros(n, dtype) for _ in range(4)]
    shuffle_kernel[1, n](*outs, values, arg)

    lane, base, a = lanes(n), warp_base(n), arg & 31
    up = np.where(lane - a >= 0, lane - a, lane)
    down = np.where(lane + a <= 31, lane + a, lane)
    for got, source in zip(outs, [a, up, down, lane ^ a]):
        np.testing.assert_array_equal(got, values[base + source])


@cuda.jit
def reduce_kernel(out, values):
    i = cuda.threadIdx.x
    total = values[i]
    offset = 16
    while offset > 0:
        total += cuda.shfl_down_sync(FULL, total, offset)
        offset //= 2
    butterfly = values[i]
    offset = 16
    while offset > 0:
        butterfly += cuda.shfl_xor_sync(FULL, butterfly, offset)
        offset //= 2
    if i % WARP == 0:
        out[i // WARP, 0] = total
    out[i // WARP, 1 + i % WARP] = butterfly


def test_warp_sum_reductions():
    values = np.random.default_rng(2).integers(-50, 50, 96).astype(np.float32)
    out = np.zeros((3, 33), np.float32)
    reduce_kernel[1, 96](out, values)
    sums = values.reshape(3, WARP).sum(axis=1)
    np.testing.assert_array_equal(out[:, 0], sums)
    np.testing.assert_array_equal(out[:, 1:], np.repeat(sums[:, None], WARP, axis=1))


# -- votes ------------------------------------------------------------------------


@cuda.jit
def vote_kernel(out, predicate):
    i = cuda.threadIdx.x
    lane = i % WARP
    p = predicate[i] != 0
    # Two half-warp groups with their own masks, in divergent branches.
    if lane < 16:
        mask = 0x0000FFFF
        out[i, 0] = cuda.ballot_sync(mask, p)
        out[i, 1] = cuda.all_sync(mask, p)
        out[i, 2] = cuda.any_sync(mask, p)
        out[i, 3] = cuda.eq_sync(mask, p)
    else:
        mask = 0xFFFF0000
        out[i, 0] = cuda.ballot_sync(mask, p)
        out[i, 1] = cuda.all_sync(mask, p)
        out[i, 2] = cuda.any_sync(mask, p)
        out[i, 3] = cuda.eq_sync(mask, p)
    out[i, 4] = cuda.ballot_sync(FULL, p)


def test_votes_respect_masks():
    n = 64
    rng = np.random.default_rng(3)
    predicate = (rng.random(n) < 0.5).astype(np.int32)
    predicate[32:48] = 1  # a half-warp where all and eq hold
    predicate[48:64] = 0  # and one where none is set
    out = np.zeros((n, 5), np.int64)
    vote_kernel[1, n](out, predicate)
    for i in range(n):
        lane, base = i % WARP, i // WARP * WARP
        group = range(0, 16) if lane < 16 else range(16, 32)
        p = {j: bool(predicate[base + j]) for j in group}
        ballot = sum(1 << j for j, v in p.items() if v)
        expected = [np.int64(np.uint32(ballot).view(np.int32)), all(p.values()), any(p.values()),
                    len(set(p.values())) == 1]
        full = sum(1 << j for j in range(WARP) if predicate[base + j])
        expected.append(np.int64(np.uint32(full).view(np.int32)))
        assert list(out[i]) == [int(e) for e in expected], f"thread {i}"


@cuda.jit
def match_kernel(out, keys, fkeys):
    i = cuda.threadIdx.x
    out[i, 0] = cuda.match_any_sync(FULL, keys[i])
    out[i, 1] = cuda.match_any_sync(FULL, fkeys[i])
    mask, same = cuda.match_all_sync(FULL, keys[i] // 100)
    out[i, 2] = mask
    out[i, 3] = same


def test_match_groups_lanes_by_value():
    n = 64
    keys = np.random.default_rng(4).integers(0, 4, n).astype(np.int32)
    fkeys = keys.astype(np.float64) * 0.5
    out = np.zeros((n, 4), np.int64)
    match_kernel[1, n](out, keys, fkeys)
    for i in range(n):
        base = i // WARP * WARP
        same = sum(1 << j for j in range(WARP) if keys[base + j] == keys[i])
        same = int(np.uint32(same).view(np.int32))
        assert out[i, 0] == same and out[i, 1] == same
        assert out[i, 2] == -1 and out[i, 3] == 1  # keys // 100 are all 0: every lane matches


# -- activemask, syncwarp, lanemask_lt ------------------------------------------------


@cuda.jit
def activemask_kernel(out):
    i = cuda.threadIdx.x
    out[i, 0] = cuda.activemask()
    if i % WARP < 10:
        out[i, 1] = cuda.activemask()
    else:
        out[i, 1] = 0


def test_activemask_sees_the_converged_lanes():
    n = 40  # a full warp and a partial one of 8 lanes
    out = np.zeros((n, 2), np.uint32)
    activemask_kernel[1, n](out)
    assert [hex(v) for v in out[:32, 0]] == [hex(FULL)] * 32
    assert [hex(v) for v in out[32:, 0]] == ["0xff"] * 8
    assert list(out[lanes(n) < 10, 1]) == [0x3FF] * 10 + [0xFF] * 8


@cuda.jit
def syncwarp_kernel(out, values):
    i = cuda.threadIdx.x
    lane = i % WARP
    staged = cuda.shared.array(64, np.float32)
    staged[i] = values[i]
    cuda.syncwarp()  # the warp's staged values are written
    out[i, 0] = staged[i - lane + (lane + 1) % WARP]
    cuda.syncwarp()  # reads are done before half-warps overwrite
    half = 0x0000FFFF if lane < 16 else 0xFFFF0000
    staged[i] = values[i] * 2
    cuda.syncwarp(half)  # this half-warp's values are written
    out[i, 1] = staged[i - lane % 16 + (lane % 16 + 1) % 16]


def test_syncwarp_orders_shared_memory_within_the_mask():
    values = np.arange(64, dtype=np.float32)
    out = np.zeros((64, 2), np.float32)
    syncwarp_kernel[1, 64](out, values)
    lane, base = lanes(64), warp_base(64)
    np.testing.assert_array_equal(out[:, 0], values[base + (lane + 1) % WARP])
    half = base + lane // 16 * 16
    np.testing.assert_array_equal(out[:, 1], 2 * values[half + (lane % 16 + 1) % 16])


@cuda.jit
def compact_kernel(out, counts, values, keep):
    i = cuda.threadIdx.x
    warp = i // WARP
    k = keep[i] != 0
    ballot = cuda.ballot_sync(FULL, k)
    position = cuda.popc(ballot & cuda.lanemask_lt())
    if k:
        out[warp, position] = values[i]
    if i % WARP == 0:
        counts[warp] = cuda.popc(ballot)
    out[warp, WARP + i % WARP] = cuda.lanemask_lt()


def test_ballot_and_lanemask_lt_compact_in_order():
    n = 64
    rng = np.random.default_rng(5)
    values = rng.integers(0, 1000, n).astype(np.int64)
    keep = (rng.random(n) < 0.4).astype(np.int32)
    keep[31] = keep[63] = 1  # the sign bit of the ballot is set
    out = np.full((2, 64), -1, np.int64)
    counts = np.zeros(2, np.int32)
    compact_kernel[1, n](out, counts, values, keep)
    for warp in range(2):
        kept = values[warp * WARP:(warp + 1) * WARP][keep[warp * WARP:(warp + 1) * WARP] == 1]
        assert counts[warp] == len(kept)
        np.testing.assert_array_equal(out[warp, :len(kept)], kept)
        np.testing.assert_array_equal(out[warp, WARP:], (1 << np.arange(WARP)) - 1)


# -- misuse raises in the simulator -------------------------------------------------


@cuda.jit
def lane_outside_mask_kernel(out):
    out[cuda.threadIdx.x] = cuda.shfl_sync(0x1, 1.0, 0)


@cuda.jit
def exited_lane_kernel(out):
    i = cuda.threadIdx.x
    if i == 3:
        return
    out[i] = cuda.shfl_sync(FULL, 1.0, 0)


@cuda.jit
def mismatched_kernel(out):
    i = cuda.threadIdx.x
    if i < 16:
        out[i] = cuda.ballot_sync(FULL, True)
    else:
        out[i] = cuda.shfl_sync(FULL, 1.0, 0)


@cuda.jit
def read_outside_mask_kernel(out):
    i = cuda.threadIdx.x
    if i < 16:
        out[i] = cuda.shfl_down_sync(0x0000FFFF, 1.0, 8)


@cuda.jit
def skipped_barrier_kernel(out):
    i = cuda.threadIdx.x
    if i != 5:
        cuda.syncthreads()
    out[i] = cuda.shfl_sync(FULL, 1.0, 0)
    if i == 5:
        cuda.syncthreads()


@cuda.jit
def barrier_then_shuffle_kernel(out):
    """Collectives right after barriers, with many threads: the simulator releases a barrier's
    threads one at a time, so early lanes meet peers not yet released."""
    i = cuda.threadIdx.x
    v = float(i)
    for _ in range(4):
        cuda.syncthreads()
        v = cuda.shfl_sync(FULL, v, (i + 1) % 32)
    out[i] = v


def test_collectives_right_after_barriers():
    import sys

    out = np.zeros(256)
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # thread switches inside the simulator's release loop
    try:
        barrier_then_shuffle_kernel[1, 256](out)
    finally:
        sys.setswitchinterval(interval)
    i = np.arange(256)
    np.testing.assert_array_equal(out, (i // 32) * 32 + (i + 4) % 32)


@pytest.mark.simulator
@pytest.mark.parametrize("kernel, message", [
    (lane_outside_mask_kernel, "does not contain it"),
    (exited_lane_kernel, "exited"),
    # The mismatch, or the wait on the lane that raised it, whichever is seen first.
    (mismatched_kernel, "while lanes|exited"),
    (skipped_barrier_kernel, "waits in syncthreads"),
])
def test_misuse_raises_in_the_simulator(kernel, message):
    from sparseblocks.runtime.simulator import WarpCollectiveError

    with pytest.raises(WarpCollectiveError, match=message):
        kernel[1, 32](np.zeros(32))


@cuda.jit
def unsigned_shuffle_kernel(out):
    i = cuda.threadIdx.x
    out[i] = cuda.shfl_xor_sync(FULL, uint32(i), 4)


@pytest.mark.simulator
def test_shuffles_take_what_numba_types_on_the_gpu():
    """A uint32 shuffle compiles nowhere (Numba's typing takes 32- and 64-bit signed ints and
    floats only), so the simulator refuses it as well."""
    with pytest.raises(TypeError, match="shfl_xor_sync: a value of uint32"):
        unsigned_shuffle_kernel[1, 32](np.zeros(32, np.uint32))


@pytest.mark.simulator
def test_reading_a_lane_outside_the_mask_is_poison():
    out = np.zeros(32)
    read_outside_mask_kernel[1, 32](out)
    assert (out[:8] == 1).all() and np.isnan(out[8:16]).all()


@pytest.mark.simulator
def test_simulator_popc_counts_two_complement_bits():
    from numba.cuda.simulator.kernelapi import FakeCUDAModule

    popc = FakeCUDAModule.popc
    assert popc(None, np.int32(-1)) == 32 and popc(None, np.int64(-1)) == 64
    assert popc(None, -2) == 31 and popc(None, 0xFF) == 8


def test_runs_on_the_expected_backend():
    from sparseblocks.runtime.backend import backend_name

    assert (backend_name() == "CUDA simulator") == SIMULATOR


@cuda.jit
def _fast_math(e, q, x, y):
    i = cuda.grid(1)
    if i < x.shape[0]:
        e[i] = libdevice.fast_expf(x[i])
        q[i] = libdevice.fast_fdividef(x[i], y[i])


def test_fast_exp_and_division_are_within_cudas_bounds():
    """libdevice's fast_expf and fast_fdividef (the simulator's float32 twins) against NumPy: exp
    within CUDA's bound of 2 + 1.173·|x| ulp, with inf where it overflows; the division within 4
    ulp, and 0 for a finite value over inf."""
    x = np.array([0.0, 1.0, -3.5, 10.0, -20.0, 0.001, 80.0, 100.0, -200.0, 2.5], np.float32)
    y = np.array([1.0, 3.0, 7.0, -2.0, 0.5, 1e-3, 1e30, np.inf, 9.0, 3.0], np.float32)
    e, q = np.zeros_like(x), np.zeros_like(x)
    _fast_math[1, 32](e, q, x, y)
    with np.errstate(all="ignore"):
        want_e, want_q = np.exp(x), x / y
    finite = np.isfinite(want_e)
    ulps = 2 + np.floor(1.173 * np.abs(x[finite]))
    assert np.all(np.abs(e[finite] - want_e[finite]) <= ulps * np.spacing(want_e[finite]) + 1e-38)
    assert np.isinf(e[~finite]).all()
    assert np.all(np.abs(q - want_q) <= 4 * np.spacing(np.abs(want_q)) + 1e-38)
