"""Find out, without importing Numba, whether this machine has a CUDA GPU.

Numba reads ``NUMBA_ENABLE_CUDASIM`` once, when ``numba.cuda`` is first
imported, so the choice of simulator must be made before that import.
"""

import ctypes
import os

SIMULATOR_VARIABLE = "NUMBA_ENABLE_CUDASIM"


def gpu_count():
    """Number of CUDA devices the driver reports; 0 without a driver or device."""
    for name in ("libcuda.so.1", "libcuda.so", "nvcuda.dll"):
        try:
            driver = ctypes.CDLL(name)
        except OSError:
            continue
        count = ctypes.c_int(0)
        if driver.cuInit(0) != 0 or driver.cuDeviceGetCount(ctypes.byref(count)) != 0:
            return 0
        return count.value
    return 0


def simulator_requested():
    return os.environ.get(SIMULATOR_VARIABLE, "0") not in ("", "0")


def use_simulator_without_gpu():
    """Turn on Numba's CUDA simulator when no GPU is present and the user chose nothing.

    Returns True when kernels will run in the simulator.
    """
    if SIMULATOR_VARIABLE in os.environ:
        return simulator_requested()
    if gpu_count() > 0:
        return False
    os.environ[SIMULATOR_VARIABLE] = "1"
    return True
