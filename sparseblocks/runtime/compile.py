"""The compile cache: every kernel maker runs once per config and compile-time key.

A maker is a Python function that builds a ``@cuda.jit`` kernel from its
arguments (a config object, a block size, a dtype, flags); its results are kept
here under ``(maker, *arguments)``. Configs are frozen and hashable
(`runtime.tuning`), so a kernel made under one config is never handed out under
another.
"""

_kernels = {}


def cached(maker, *key):
    """``maker(*key)``, made once and kept."""
    kernel = _kernels.get((maker, *key))
    if kernel is None:
        kernel = _kernels[(maker, *key)] = maker(*key)
    return kernel
