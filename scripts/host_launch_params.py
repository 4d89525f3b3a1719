"""Host µs of one kept launch, by how its parameters reach the driver (a developer's script, GPU).

    python3 scripts/host_launch_params.py [--calls 200]

A kept gather launch (`_launch.Replay`, NHWC fp16, 1 x 400 x 700 x 256, windows of 16) is timed
as the library makes it (``kernelParams``: one pointer a field, ~80 fields) and through
``cuLaunchKernel``'s ``extra`` (CU_LAUNCH_PARAM_BUFFER_POINTER: the packed buffer in one piece),
after checking with ``cuFuncGetParamInfo`` that every field lies in its own 8-byte slot and that
both give the reference's blocks. Calls are queued behind a device sleep so the host's clock
reads the host alone.
"""

import argparse
import ctypes
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from res_block_ab import queued_host_us, sleep_cycles_per_ms  # noqa: E402


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--calls", type=int, default=200)
    args = parser.parse_args()

    import numpy as np
    import torch

    from sparseblocks.kernels import sbnet
    from sparseblocks.reference import sbnet as ref

    cycles_per_ms = sleep_cycles_per_ms(torch)
    libcuda = ctypes.PyDLL("libcuda.so.1")
    info = libcuda.cuFuncGetParamInfo
    info.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_size_t),
                     ctypes.POINTER(ctypes.c_size_t)]
    info.restype = ctypes.c_int
    raw = libcuda.cuLaunchKernel
    raw.argtypes = [ctypes.c_void_p] + [ctypes.c_uint] * 7 + [ctypes.c_void_p] * 3
    raw.restype = ctypes.c_int

    version = libcuda.cuDriverGetVersion
    version.argtypes = [ctypes.c_void_p]
    version.restype = ctypes.c_int
    v = ctypes.c_int()

    def host_us(fn):
        return queued_host_us(torch, fn, args.calls, cycles_per_ms, rounds=7, sleep_ms_a_call=0.2)

    x = torch.randn(1, 400, 700, 256, device="cuda", dtype=torch.float16)
    windows = [(0, i, j) for i in range(0, 25, 3) for j in range(0, 44, 2)]
    idx = torch.tensor(windows, dtype=torch.int32, device="cuda")
    count = torch.tensor([len(windows)], dtype=torch.int32, device="cuda")
    geometry = ((18, 18), (16, 16), (-1, -1))
    for _ in range(3):
        blocks = sbnet.sparse_gather(x, idx, *geometry, count=count)
    torch.cuda.synchronize()
    want = ref.sparse_gather(x.cpu().numpy(), np.array(windows, np.int32), *geometry)
    assert np.array_equal(blocks.cpu().numpy(), want)
    (plan,) = sbnet._plans.values()
    kept = plan.launch[0]
    n = len(kept.slots)
    offset, size = ctypes.c_size_t(), ctypes.c_size_t()
    layout = []
    for i in range(n + 1):
        error = info(kept.function, i, ctypes.byref(offset), ctypes.byref(size))
        layout.append((error, offset.value, size.value))
    slotted = all(e == 0 and o == 8 * i and s == 8 for i, (e, o, s) in enumerate(layout[:n]))
    print(f"fields {n}; every field in its 8-byte slot: {slotted}; past the last: error {layout[n][0]}")

    buffer_size = ctypes.c_size_t(8 * n)
    extra = (ctypes.c_void_p * 5)(1, ctypes.addressof(kept.buffer), 2, ctypes.addressof(buffer_size), 0)
    stream = torch.cuda.current_stream().cuda_stream
    pointers = (x.data_ptr(), blocks.data_ptr(), idx.data_ptr(), count.data_ptr())

    def by_extra():
        words = kept.words
        for index, k in kept.live:
            words[index] = pointers[k]
        error = raw(kept.function, *kept.grid, *kept.block, 0, stream, None, extra)
        if error:
            raise RuntimeError(error)

    blocks.zero_()
    by_extra()
    torch.cuda.synchronize()
    assert np.array_equal(blocks.cpu().numpy(), want), "extra: wrong blocks"
    rows = {
        "kept launch (kernelParams)": lambda: kept(stream, *pointers),
        "kept launch (extra buffer)": by_extra,
        "bare cuLaunchKernel (kernelParams)": lambda: raw(kept.function, *kept.grid, *kept.block, 0, stream,
                                                          kept.slots, None),
        "bare cuLaunchKernel (extra buffer)": lambda: raw(kept.function, *kept.grid, *kept.block, 0, stream,
                                                          None, extra),
        "sparse_gather through its plan": lambda: sbnet.sparse_gather(x, idx, *geometry, count=count),
    }
    side = torch.cuda.Stream()
    for handle, label in ((side.cuda_stream, "a side stream"), (2, "the per-thread default stream")):
        rows[f"bare, kernelParams, on {label}"] = (
            lambda handle=handle: raw(kept.function, *kept.grid, *kept.block, 0, handle, kept.slots, None))
    rows["torch.cuda._sleep(1) (torch's own launch)"] = lambda: torch.cuda._sleep(1)
    rows["empty ctypes call (cuCtxSynchronize-free: cuDriverGetVersion)"] = lambda: version(ctypes.byref(v))
    for _ in range(2):
        for name, fn in rows.items():
            print(f"{name:60s} {host_us(fn):7.2f} us")


if __name__ == "__main__":
    main()
