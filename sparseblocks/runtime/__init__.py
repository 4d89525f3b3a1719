"""What every op shares: launching, array interop, the caches, configs and the simulator.

`launch` (compiled kernels launched through the driver, and kept `Replay`s), `arrays` (NumPy,
Numba, CuPy and torch operands, the caller's stream), `compile` (the compile cache, keyed on
configs), `plans` (the one kept-plan cache), `tuning` (frozen config objects), `backend` and
`probe` (simulator or GPU), `simulator` (the warp intrinsics Numba's simulator lacks).
"""
