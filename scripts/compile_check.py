"""Compile every SBNet kernel to PTX for sm_90 without a GPU, to catch typing errors early.

The CUDA simulator runs kernels as plain Python and accepts code the real
compiler rejects (a computed shared-array shape, say). This compiles each
kernel variant through NVVM instead. Needs libnvvm and NVRTC (for example
CUDA_HOME=/usr/local/cuda-13.0 and `pip install nvidia-cuda-nvrtc`); it is a
developer's check, not part of the test suite.

    CUDA_HOME=/usr/local/cuda-13.0 python scripts/compile_check.py
"""

import itertools
import os
import re
import shutil
import subprocess
import sys
import tempfile

from numba import cuda, types

from sparseblocks.kernels import sbnet

i64 = types.int64
CC = (9, 0)


PTXAS = shutil.which("ptxas") or os.path.join(os.environ.get("CUDA_HOME", "/usr/local/cuda"), "bin", "ptxas")


def resources(ptx):
    """ptxas's report (registers, stack frame, spills) where ptxas is installed, else ''."""
    if not os.path.exists(PTXAS):
        return ""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "k.ptx")
        with open(path, "w") as f:
            f.write(ptx)
        report = subprocess.run([PTXAS, f"-arch=sm_{CC[0]}{CC[1]}", "-v", path, "-o", path + ".cubin"],
                                capture_output=True, text=True).stderr
    used = re.search(r"Used (\d+) registers", report)
    stack = re.search(r"(\d+) bytes stack frame", report)
    return f"  [{used.group(1) if used else '?'} registers, {stack.group(1) if stack else 0} B stack]"


def check(name, function, signature):
    try:
        ptx, _ = cuda.compile_ptx(function, signature, cc=CC)
        print(f"ok    {name}{resources(ptx)}")
        return True
    except Exception as error:  # report every failure, not just the first
        print(f"FAIL  {name}: {type(error).__name__}: {str(error).splitlines()[0]}")
        return False


def main():
    results = [
        check("pool_kernel", sbnet.pool_kernel.py_func,
              (types.int8[::1], types.float32[:, :, ::1]) + (i64,) * 11 + (types.float64, types.boolean)),
        check("count_kernel", sbnet.count_kernel.py_func, (types.int32[::1], types.int8[::1], i64)),
        check("scan_kernel", sbnet.scan_kernel.py_func,
              (types.int32[::1], types.int32[::1], types.int32[::1], i64)),
        check("write_kernel", sbnet.write_kernel.py_func,
              (types.int32[:, ::1], types.int8[::1], types.int32[::1], i64, i64, i64)),
    ]
    for scatter, transpose, (add, atomic), dtype, channels_last in itertools.product(
            (False, True), (False, True), ((False, False), (True, False), (True, True)),
            ("float16", "float32", "float64"), (True, False)):
        if (add and not scatter) or (atomic and dtype == "float16"):
            continue
        element = getattr(types, dtype)
        kernel = sbnet._make_copy_kernels(scatter, transpose, add, atomic, dtype, channels_last)
        array4 = element[:, :, :, ::1]
        signature = (array4, array4, types.int32[:, ::1], types.int32[::1]) + (i64,) * 6
        name = (f"{'scatter' if scatter else 'gather'} {'NHWC' if channels_last else 'NCHW'} "
                f"transpose={transpose} add={add} atomic={atomic} {dtype}")
        results.append(check(name, kernel.py_func, signature))
    print(f"{sum(results)} of {len(results)} kernels compiled")
    return 0 if all(results) else 1


if __name__ == "__main__":
    sys.exit(main())
