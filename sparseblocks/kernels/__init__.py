"""Numba-CUDA kernels. Each module here has a NumPy twin in `sparseblocks.reference`.

Importing this package under Numba's CUDA simulator (``NUMBA_ENABLE_CUDASIM=1``)
adds the warp intrinsics the simulator lacks (see `_simulator`).
"""

from .._backend import SIMULATOR

if SIMULATOR:
    from . import _simulator

    _simulator.install()
