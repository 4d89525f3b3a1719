"""The compiled-launch path (kernels/_launch.py) against Numba's dispatcher."""

import numpy as np
import pytest
from numba import cuda, float32

from sparseblocks.runtime.arrays import Operand, launch_stream
from sparseblocks.runtime.backend import SIMULATOR
from sparseblocks.runtime import launch as _launch


@cuda.jit
def _affine(out, a, b, scale, offset, flip):
    i, j = cuda.grid(2)
    if i < out.shape[0] and j < out.shape[1]:
        value = scale * a[i, j] + b[j] + offset
        out[i, j] = -value if flip else value


def host(array):
    return array.copy_to_host() if hasattr(array, "copy_to_host") else array.cpu().numpy()


def _run(out, a, b, stream=0):
    """Launch twice with different scalars; yield what out should hold after each."""
    grid = ((out.shape[0] + 7) // 8, (out.shape[1] + 7) // 8)
    for scale, offset, flip in ((2.0, 3, False), (-0.5, -7, True)):
        _launch.launch(_affine, grid, (8, 8), stream, (out, a, b, scale, offset, flip))
        value = scale * host(a) + host(b) + offset
        yield -value if flip else value


def test_launch_matches_the_kernel_on_numba_arrays():
    """The first launch goes through the dispatcher, the second through the cached kernel
    (on a GPU); ints, floats and booleans land in their parameter slots."""
    rng = np.random.default_rng(0)
    a = cuda.to_device(rng.standard_normal((13, 21)).astype(np.float32))
    b = cuda.to_device(rng.standard_normal(21).astype(np.float32))
    out = cuda.device_array((13, 21), np.float32)
    for want in _run(out, a, b):
        np.testing.assert_allclose(host(out), want, rtol=1e-6, atol=1e-6)


@pytest.mark.gpu
@pytest.mark.skipif(SIMULATOR, reason="the compiled path needs a GPU")
@pytest.mark.parametrize("through", ["driver", "cuda.core"])
def test_compiled_launch_of_torch_tensors(through, monkeypatch):
    torch = pytest.importorskip("torch")
    a = torch.randn(9, 30, device="cuda")
    b = torch.randn(30, device="cuda")
    out = torch.empty(9, 30, device="cuda")
    stream = launch_stream([Operand(a, "a")])
    list(_run(out, a, b, stream))  # compiles and caches the kernel for these types
    if through == "cuda.core":
        for kernel in _launch._compiled.values():
            monkeypatch.setattr(kernel, "function", None)
    for want in _run(out, a, b, stream):
        torch.cuda.synchronize()
        np.testing.assert_allclose(host(out), want, rtol=1e-6, atol=1e-6)


def test_fields_lay_out_numbas_abi():
    """An array is 5 + 2·ndim int64 fields (meminfo, parent, size, itemsize, pointer, shape,
    byte strides); an int (or bool) one int64, a float one double."""
    a = cuda.to_device(np.zeros((3, 5), np.float32))
    key, values = _launch._fields((a, 7, 2.5, True))
    assert values[2:4] == [15, 4] and values[5:9] == [3, 5, 20, 4]
    assert values[9:] == [7, 2.5, True]
    assert _launch._format(values) == "<" + "q" * 9 + "qdq"
    assert key[1:] == (int, float, bool)


def test_data_field_finds_each_arrays_pointer():
    """`_data_field` counts 5 + 2·ndim fields an array and one a scalar before the pointer."""
    a = cuda.to_device(np.zeros((3, 5), np.float32))
    b = cuda.to_device(np.zeros(4, np.float32))
    args = (a, 7, b, 2.5)
    _, values = _launch._fields(args)
    assert _launch._data_field(args, 0) == 4 and values[4] == _launch.data_pointer(a)
    assert _launch._data_field(args, 2) == 9 + 1 + 4 and values[14] == _launch.data_pointer(b)


@pytest.mark.gpu
@pytest.mark.skipif(SIMULATOR, reason="replays go through the driver")
def test_replay_rewrites_only_the_live_pointers():
    torch = pytest.importorskip("torch")
    a = torch.randn(9, 30, device="cuda")
    b = torch.randn(30, device="cuda")
    out = torch.empty(9, 30, device="cuda")
    args = (out, a, b, 2.0, 3, False)
    _launch.launch(_affine, (2, 4), (8, 8), 0, args)
    kept = _launch.replay(_affine, (2, 4), (8, 8), args, live=(0, 1))
    assert kept is not None
    a2, out2 = torch.randn(9, 30, device="cuda"), torch.full((9, 30), float("nan"), device="cuda")
    kept(torch.cuda.current_stream().cuda_stream, out2.data_ptr(), a2.data_ptr())
    torch.cuda.synchronize()
    np.testing.assert_allclose(host(out2), 2.0 * host(a2) + host(b) + 3, rtol=1e-6, atol=1e-6)


@pytest.mark.gpu
@pytest.mark.skipif(SIMULATOR, reason="launches go through the driver")
def test_launches_from_a_thread_without_a_current_context():
    """torch's autograd engine runs backward functions on threads of its own; on one where no
    driver call has made a context current, the compiled launch and a replay find Numba's."""
    import threading

    torch = pytest.importorskip("torch")
    from cuda.bindings import driver

    a = torch.randn(9, 30, device="cuda")
    b = torch.randn(30, device="cuda")
    outs = [torch.full((9, 30), float("nan"), device="cuda") for _ in range(2)]
    args = (outs[0], a, b, 2.0, 3, False)
    _launch.launch(_affine, (2, 4), (8, 8), 0, args)  # compiled and cached here
    kept = _launch.replay(_affine, (2, 4), (8, 8), args, live=(0,))
    torch.cuda.synchronize()
    seen = []

    def worker():
        try:
            seen.append(int(driver.cuCtxGetCurrent()[1]))  # 0: no context on this new thread
            kept(0, outs[1].data_ptr())
            _launch.launch(_affine, (2, 4), (8, 8), 0, args)
        except Exception as error:  # surfaced below, in the test's thread
            seen.append(error)

    outs[0].fill_(float("nan"))
    thread = threading.Thread(target=worker)
    thread.start()
    thread.join()
    assert seen == [0], seen
    torch.cuda.synchronize()
    for out in outs:
        np.testing.assert_allclose(host(out), 2.0 * host(a) + host(b) + 3, rtol=1e-6, atol=1e-6)


def test_shared_memory_limit_is_the_devices_opt_in_bound():
    """`shared_memory_limit`: what a thread block may opt into (sm_90's 227 KB in the simulator),
    at least the 48 KB every device gives without opting in."""
    limit = _launch.shared_memory_limit()
    assert limit == 227 * 1024 if SIMULATOR else limit >= 48 * 1024
    assert _launch.shared_memory_limit() == limit


@cuda.jit
def _static_and_dynamic(out):
    held = cuda.shared.array(10240, float32)  # 40 KB static
    extra = cuda.shared.array(0, float32)  # and 16 KB dynamic: 56 KB together, past 48 KB
    i = cuda.threadIdx.x
    held[10239 - i] = i  # (both arrays' far ends)
    extra[4095 - i] = 2 * i
    cuda.syncthreads()
    out[i] = held[10239 - i] + extra[4095 - i]


def test_static_and_dynamic_shared_memory_past_48_kb_launch_twice():
    """A kernel whose static and dynamic shared memory pass 48 KB only together: its limit is
    raised for the dynamic part, so the second launch (the cached kernel's, on a GPU) runs too."""
    kernel = _launch.dynamic_shared(_static_and_dynamic, 4096 * 4)
    out = cuda.device_array(128, np.float32)
    for _ in range(2):
        out[:] = 0
        _launch.launch(kernel, 1, 128, 0, (out,))
        np.testing.assert_array_equal(host(out), 3 * np.arange(128))


def test_dynamic_shared_memory_past_the_device_limit_is_refused():
    """A ring sized past what a thread block may opt into fails before the launch, in the
    simulator as on the GPU (where the driver's error would name neither kernel nor size)."""
    kernel = _launch.dynamic_shared(cuda.jit(_static_and_dynamic.py_func), _launch.shared_memory_limit() + 16)
    with pytest.raises(RuntimeError, match="bytes of dynamic shared memory, over the device's"):
        _launch.launch(kernel, 1, 128, 0, (cuda.device_array(128, np.float32),))


def test_resident_blocks_counts_what_shares_a_multiprocessor_and_the_kernel_then_launches():
    """`resident_blocks`: on a GPU the driver's count, fewer where each block holds 56 KB of shared
    memory (four fit in sm_90's 228 KB); in the simulator sm_90's count from threads and dynamic
    shared memory only (16 KB and 1 KB reserved: 13). The kernel it compiled is the one `launch`
    then takes, its limit raised before the first launch."""
    kernel = _launch.dynamic_shared(cuda.jit(_static_and_dynamic.py_func), 4096 * 4)
    out = cuda.device_array(128, np.float32)
    count = _launch.resident_blocks(kernel, 128, (out,))
    assert count == 13 if SIMULATOR else 1 <= count <= 4
    assert _launch.resident_blocks(kernel, 128, (out,)) == count
    _launch.launch(kernel, 1, 128, 0, (out,))
    np.testing.assert_array_equal(host(out), 3 * np.arange(128))


def test_fullest_waves_weighs_the_last_wave():
    """`fullest_waves`: of ``low`` to ``high`` shares, the least waves / shares (the fewest among
    equals); 45 rows on 132 slots: 6 shares run three waves, the last of 6 blocks, 11 four."""
    assert _launch.fullest_waves(45, 132, 6, 12) == 11
    assert _launch.fullest_waves(66, 132, 2, 4) == 2 and _launch.fullest_waves(8, 396, 49, 50) == 49
    assert _launch.fullest_waves(5, 264, 52, 53) == 52  # (53: 265 blocks, one in a second wave)
    assert _launch.fullest_waves(7, 132, 0, 0) == 1
    for work, slots, low, high in ((45, 132, 6, 12), (13, 264, 20, 41), (100, 132, 1, 2)):
        best = _launch.fullest_waves(work, slots, low, high)
        cost = [-(-work * s // slots) / s for s in range(low, high + 1)]
        assert -(-work * best // slots) / best == min(cost) and low <= best <= high
