"""The compile cache: every kernel maker runs once per config and compile-time key.

A maker is a Python function that builds a ``@cuda.jit`` kernel from its
arguments (a config object, a block size, a dtype, flags); its results are kept
here under ``(maker, *arguments)``. Configs are frozen and hashable
(`runtime.tuning`), so a kernel made under one config is never handed out under
another. On a GPU their compiled code is kept on disk too, for the next process
(`disk_cache`).
"""

import numpy as np
from numba import uint32

_kernels = {}


def cached(maker, *key):
    """``maker(*key)``, made once and kept; its kernels compiled once a machine (`disk_cache`),
    where the key's ``repr`` names it (not an object's address, not an array's elided values).
    NumPy integers in the key reach the maker as ints: a kernel sizes its local arrays from them,
    which the compiler takes only as Python ints (the simulator takes either). (They hash and
    compare as the ints do, so a lookup needs no conversion.)"""
    kernel = _kernels.get((maker, *key))
    if kernel is None:
        key = tuple(int(k) if isinstance(k, np.integer) else k for k in key)
        kernel = maker(*key)
        name = f"{maker.__module__}.{maker.__qualname__}{key!r}"
        if " at 0x" not in name and "..." not in name:
            from .disk_cache import attach, key_modules

            attach(kernel, name, (maker.__module__, *sorted(key_modules(key))))
        _kernels[(maker, *key)] = kernel
    return kernel


def inlined(function):
    """``function`` as a device function inlined into its callers: by LLVM (``forceinline``) with
    the real compiler, since Numba's own inliner (``inline=True``) deep-copies the callee's IR at
    every call site, which made an unrolled Hopper kernel take minutes to compile; as a plain
    device function in the simulator (whose ``jit`` has no such option)."""
    from numba import cuda

    from .backend import SIMULATOR

    if SIMULATOR:
        return cuda.jit(device=True)(function)
    return cuda.jit(device=True, forceinline=True)(function)


def unrolled(count, body, start=0, inline=None):
    """A device function ``run(*args)`` that calls ``body(i, *args)`` for i = start .. count - 1,
    written out one call after another, so that ``i`` is a constant in each (Numba's compiler
    leaves a loop whose body is large rolled, and a register array indexed by its counter then
    lives in local memory). ``run`` takes ``body``'s parameters after the first, by name: it is
    generated as source because Numba inlines no function of ``*args``. ``inline``: how ``run`` is
    made a device function (`inlined`; Numba's IR inliner where None)."""
    import inspect

    from numba import cuda

    function = getattr(body, "py_func", None) or body.fn  # (a dispatcher, or the simulator's kernel)
    names = ", ".join(list(inspect.signature(function).parameters)[1:])
    lines = [f"    body({i}, {names})" for i in range(start, count)] or ["    return None"]
    namespace = {"body": body}
    exec(f"def run({names}):\n" + "\n".join(lines) + "\n", namespace)
    return (inline or cuda.jit(device=True, inline=True))(namespace["run"])


def bounded(threads, blocks=1):
    """The kernel decorator for thread blocks of ``threads`` threads, ``blocks`` a multiprocessor:
    the real compiler caps the registers at what that leaves each thread (launch bounds), which
    ``setmaxnreg`` (`ptx.mbarrier.registers`) needs to hand registers from one warpgroup to
    another; the simulator's ``jit`` takes no bounds."""
    from numba import cuda

    from .backend import SIMULATOR

    if SIMULATOR:
        return cuda.jit
    return cuda.jit(launch_bounds=(int(threads), int(blocks)))


def _divmod32(a, b):
    """(a // b, a % b) as uint32, for 0 <= a < 2**31 and 0 < b, in 32-bit unsigned arithmetic:
    Python's signed 64-bit floor division compiles to a call with branches, a few hundred
    instructions where a walk divides by a runtime count on every step (a walk's block and tile
    within it, a convolution's tile and stage). Divisors of 1 and 2 (a uniform branch) shift."""
    u, d = uint32(a), uint32(b)
    if d == 1:
        return u, uint32(0)
    if d == 2:
        return uint32(u >> uint32(1)), uint32(u & uint32(1))
    q = uint32(u // d)  # (uint32, not the uint64 Numba types u // d as: compared with a signed
    return q, uint32(u - q * d)  # integer, a uint64 is converted to fp64 with it)


divmod32 = inlined(_divmod32)
