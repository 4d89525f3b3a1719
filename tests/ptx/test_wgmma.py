"""wgmma (ptx/wgmma.py): one warpgroup's m64nNk16 (N from 24 to 128) from shared tiles in the
canonical layouts (128-, 64- and 32-byte swizzled and interleaved, K-major and MN-major operands),
fp16 and bf16, with and without the accumulators' old values, against NumPy; the simulator's twin
and the GPU agree.
The tiles are laid out here by the layouts' definitions, written out independently of the twin."""

import numpy as np
import pytest
from numba import cuda, float32, int16, int32

from sparseblocks.bsmm.dispatch import hopper
from sparseblocks.ptx.cp_async import shared_address
from sparseblocks.ptx.wgmma import (
    SWIZZLE_32,
    SWIZZLE_64,
    SWIZZLE_128,
    WARPGROUP,
    a_position,
    acc_position,
    align_up,
    commit,
    descriptor,
    fence,
    make_mma,
    make_mma_rs,
    make_settle,
    waiter,
)
from sparseblocks.runtime.backend import SIMULATOR

pytestmark = pytest.mark.skipif(not SIMULATOR and not hopper(), reason="wgmma: an sm_90 GPU or the simulator")

K = 16
SHARED = 16384  # int16 values of the shared image (32 KB), after the 1024-byte alignment
B_AT = 8192  # B's byte offset in it (A's is 0)
ALLOCATED = SHARED + 512  # with room to start it at a multiple of 1024 bytes


MODES = {128: SWIZZLE_128, 64: SWIZZLE_64, 32: SWIZZLE_32}  # a swizzle's row bytes: its descriptor mode


def offset(r, k, mn_major, swizzle, groups):
    """Byte offset of element (r, k) of an operand tile (r: its m or n) in a layout.

    Swizzled (``swizzle``: 128, 64 or 32 bytes a row, W): atoms of 8 rows of W bytes; 16-byte
    chunk c of row j at chunk c ^ j (128), c ^ (j // 2) (64), c ^ (j // 4) (32). K-major: a row
    per r, k along it, atoms of 8 r 8 W bytes apart. MN-major: a row per k, W / 2 of r along it,
    atoms of 8 k 8 W apart, W/2-wide groups of r ``groups`` bytes apart. Interleaved (0): 8 x 8
    core matrices of 128 bytes, k-adjacent ones 128 apart, r-adjacent 256 apart (two along k)."""
    if swizzle:
        W = swizzle
        V, shift = W // 2, {128: 0, 64: 1, 32: 2}[W]
        if mn_major:
            row, along = k % 8, r % V
            return ((r // V) * groups + (k // 8) * 8 * W + row * W + (((along // 8) ^ (row >> shift)) * 16)
                    + 2 * (along % 8))
        row = r % 8
        return (r // 8) * 8 * W + row * W + (((k // 8) ^ (row >> shift)) * 16) + 2 * (k % 8)
    if mn_major:
        return (r // 8) * 256 + (k // 8) * 128 + (k % 8) * 16 + 2 * (r % 8)
    return (r // 8) * 256 + (k // 8) * 128 + (r % 8) * 16 + 2 * (k % 8)


def image(a, b, a_mn, b_mn, swizzle, kind):
    """The shared bytes: A (64 x 16) at 0, B (as n x 16, its n by k) at B_AT."""
    raw = np.zeros(2 * SHARED, np.uint8)
    for tile, at, mn in ((a, 0, a_mn), (b.T, B_AT, b_mn)):
        bits = tile.astype(np.float16).view(np.uint16) if kind == "f16" else \
            (tile.astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
        for r in range(tile.shape[0]):
            for k in range(K):
                o = at + offset(r, k, mn, swizzle, 2048)
                raw[o:o + 2] = np.array([bits[r, k]], np.uint16).view(np.uint8)
    return raw.view(np.int16)


def registers_of(a, kind):
    """Each warpgroup thread's four A registers (two 16-bit values each, `a_position`) of a 64 x 16 A."""
    bits = a.astype(np.float16).view(np.uint16) if kind == "f16" else \
        (a.astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
    words = np.zeros((WARPGROUP, 4), np.uint32)
    for t in range(WARPGROUP):
        for i in range(4):
            lo, hi = bits[a_position(t, i, 0)], bits[a_position(t, i, 1)]
            words[t, i] = int(lo) | (int(hi) << 16)
    return words


def run(n, kind, a_mn, b_mn, swizzle, scale_d, seed, registers=False, overwrite=False):
    """One warpgroup's wgmma of a random A (64 x 16) and B (16 x n) plus C (``scale_d``), A from
    shared memory (``a_mn``: MN-major) or, with ``registers``, from the threads' registers
    (`make_mma_rs`); ``overwrite``: the product alone, whatever scale_d; returns (each thread's
    accumulators, what they should hold)."""
    rng = np.random.default_rng(seed)
    a = rng.integers(-4, 5, (64, K)).astype(np.float32) / 4  # exact in fp16 and bf16, and their sums
    b = rng.integers(-4, 5, (K, n)).astype(np.float32) / 4
    c = rng.integers(-8, 9, (64, n)).astype(np.float32)
    held = np.array([[c[acc_position(t, i)] for i in range(n // 2)] for t in range(WARPGROUP)], np.float32)
    settle, wait = make_settle(n), waiter(0)
    ACC, LBO_A, LBO_B = n // 2, (2048 if a_mn else 16) if swizzle else 128, (2048 if b_mn else 16) if swizzle else 128
    SBO, MODE = (8 * swizzle, MODES[swizzle]) if swizzle else (256, 0)
    if registers:
        mma_rs = make_mma_rs(n, kind, b_mn)

        @cuda.jit(device=True)
        def multiply(acc, base, regs, t, scale_d):
            mma_rs(acc, regs[t, 0], regs[t, 1], regs[t, 2], regs[t, 3], descriptor(base + B_AT, LBO_B, SBO, MODE),
                   scale_d)
    else:
        mma = make_mma(n, kind, a_mn, b_mn, overwrite=overwrite)

        @cuda.jit(device=True)
        def multiply(acc, base, regs, t, scale_d):
            mma(acc, descriptor(base, LBO_A, SBO, MODE), descriptor(base + B_AT, LBO_B, SBO, MODE), scale_d)

    @cuda.jit
    def kernel(out, raw, regs, held, scale_d):
        shared = cuda.shared.array(ALLOCATED, int16)
        t = cuda.threadIdx.x
        start = shared_address(shared, (0,))
        base = align_up(start, 1024)
        skip = (base - start) // 2
        for i in range(t, SHARED, WARPGROUP):
            shared[skip + i] = raw[i]
        cuda.syncthreads()
        acc = cuda.local.array(ACC, float32)
        for i in range(ACC):
            acc[i] = held[t, i]
        fence()
        multiply(acc, base, regs, t, int32(scale_d))
        commit()
        wait()
        settle(acc)
        for i in range(ACC):
            out[t, i] = acc[i]

    out = cuda.to_device(np.zeros((WARPGROUP, n // 2), np.float32))
    kernel[1, WARPGROUP](out, cuda.to_device(image(a, b, a_mn, b_mn, swizzle, kind)),
                         cuda.to_device(registers_of(a, kind)), cuda.to_device(held), scale_d)
    got, want = out.copy_to_host(), a @ b + (c if scale_d and not overwrite else 0)
    return got, np.array([[want[acc_position(t, i)] for i in range(n // 2)] for t in range(WARPGROUP)])


CASES = [(64, "f16", a_mn, b_mn, 128, 1) for a_mn in (False, True) for b_mn in (False, True)] + [
    (128, "bf16", False, True, 128, 0),
    (128, "f16", True, False, 128, 1),
    (64, "bf16", False, True, 0, 1),
    (64, "f16", True, False, 0, 0),
    (32, "f16", False, True, 64, 1),  # (a block of 32 as an MN-major B: 64-byte rows)
    (32, "bf16", True, False, 64, 0),
    (64, "f16", False, True, 32, 1),
    (32, "f16", True, True, 32, 1),
    (24, "bf16", False, False, 128, 1),
]


@pytest.mark.parametrize("n, kind, a_mn, b_mn, swizzle, scale_d", CASES)
def test_wgmma_multiplies_the_tiles_its_descriptors_point_at(n, kind, a_mn, b_mn, swizzle, scale_d):
    got, want = run(n, kind, a_mn, b_mn, swizzle, scale_d, seed=n + 2 * a_mn + b_mn)
    assert np.array_equal(got, want)


@pytest.mark.parametrize("n, kind, a_mn, b_mn", [(64, "f16", False, False), (128, "bf16", True, True)])
def test_overwriting_wgmma_drops_the_old_values(n, kind, a_mn, b_mn):
    """``make_mma(..., overwrite=True)``: acc = A·B even where scale_d asks for C."""
    got, want = run(n, kind, a_mn, b_mn, 128, 1, seed=7 + n, overwrite=True)
    assert np.array_equal(got, want)


@pytest.mark.parametrize("n, kind, b_mn, scale_d", [(64, "f16", False, 1), (64, "bf16", True, 0),
                                                    (128, "f16", True, 1)])
def test_wgmma_takes_a_from_registers(n, kind, b_mn, scale_d):
    """``make_mma_rs``: A as each warp's mma.sync-style A fragments, B from a swizzled shared tile."""
    got, want = run(n, kind, False, b_mn, 128, scale_d, seed=n + b_mn, registers=True)
    assert np.array_equal(got, want)


@pytest.mark.skipif(not SIMULATOR, reason="the simulator's check; on a GPU the kernel would be undefined")
def test_a_fence_some_warps_skip_raises():
    """fence, commit and the waits are .aligned (all of a warpgroup's threads or none): the twin's
    product finds a warp that ran a fence the others skipped (a GPU may hang there)."""
    from sparseblocks.runtime.simulator import WarpCollectiveError

    mma = make_mma(64, "f16", False, False)

    @cuda.jit
    def kernel(extra_warp):
        shared = cuda.shared.array(ALLOCATED, int16)
        base = align_up(shared_address(shared, (0,)), 1024)
        acc = cuda.local.array(32, float32)
        for i in range(32):
            acc[i] = float32(0)
        fence()
        if cuda.threadIdx.x // 32 == extra_warp:  # (a warp's vote: uniform in the warp, not the group)
            fence()
        mma(acc, descriptor(base, 16, 1024, SWIZZLE_128), descriptor(base + B_AT, 16, 1024, SWIZZLE_128), int32(0))
        commit()

    kernel[1, WARPGROUP](4)  # no warp 4: every thread fences once
    with pytest.raises(WarpCollectiveError, match="aligned"):
        kernel[1, WARPGROUP](1)


def test_a_position_covers_the_tile_once():
    seen = {a_position(t, i, h) for t in range(WARPGROUP) for i in range(4) for h in range(2)}
    assert seen == {(r, k) for r in range(64) for k in range(K)}


def test_wgmma_shapes_are_checked():
    with pytest.raises(ValueError, match="n: expected"):
        make_mma(100, "f16", False, False)
    with pytest.raises(ValueError, match="kind"):
        make_mma(64, "tf32", False, False)
    with pytest.raises(ValueError, match="n: expected"):
        make_mma_rs(264, "f16", False)
    with pytest.raises(ValueError, match="keep"):
        waiter(4)


def test_acc_position_covers_the_tile_once():
    seen = {acc_position(t, i) for t in range(WARPGROUP) for i in range(64)}
    assert seen == {(r, c) for r in range(64) for c in range(128)}


def test_descriptor_packs_its_fields():
    if SIMULATOR:
        pytest.skip("the simulator's descriptors are objects; the bits are the compiled path's")

    @cuda.jit
    def kernel(out):
        out[0] = descriptor(0x12340, 2048, 1024, SWIZZLE_128)

    out = cuda.to_device(np.zeros(1, np.uint64))
    kernel[1, 1](out)
    want = (0x12340 >> 4) | ((2048 >> 4) << 16) | ((1024 >> 4) << 32) | (1 << 62)
    assert int(out.copy_to_host()[0]) == want
