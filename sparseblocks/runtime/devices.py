"""Which GPU a call runs on: the device of its arrays, as with torch's own operations.

A public function (`on_arrays_device`) runs where its first torch tensor or CuPy array lives. For
the call it makes that device's primary context current (Numba's, the one torch uses too) and
restores the caller's afterwards, so its allocations, the compiled functions it loads and its
launches land on that device; `active` names it, and the caches that hold device memory or
per-context handles (compiled functions, layouts' index arrays, scratch, the GPU's figures) key
on it. Operands on another device raise a ValueError before anything runs (`Operand`). Calls with
only host arrays or Numba device arrays run on the current device, as before.

Under the simulator there is one device, and nothing here changes it.
"""

import ctypes
import functools
import threading

from .backend import SIMULATOR

_state = threading.local()  # .ordinal: the device of the running call, where one is running
_cu_ctx_get_device = None


def _not_tracing():
    return False


# Whether torch.compile is tracing the call (`torch.compiler.is_compiling`, set by
# `sparseblocks.torch`): a traced call runs as it is, its custom ops choosing the device when run
tracing = _not_tracing


def ordinal_of(array):
    """The CUDA device ordinal of a torch tensor or CuPy array; None for anything else (host
    arrays and CPU tensors; Numba device arrays, which live in the current context)."""
    device = getattr(array, "device", None)
    if device is None or isinstance(device, str):  # (NumPy 2 arrays say "cpu")
        return None
    kind = getattr(device, "type", None)
    if kind is not None:  # torch
        return device.index if kind == "cuda" else None
    ident = getattr(device, "id", None)  # CuPy
    return ident if isinstance(ident, int) else None


def _driver_ordinal():
    """The device of this thread's current CUDA context (``cuCtxGetDevice``), or None: no context
    (or no driver)."""
    global _cu_ctx_get_device
    if _cu_ctx_get_device is None:
        try:
            function = ctypes.CDLL("libcuda.so.1").cuCtxGetDevice
            function.argtypes = [ctypes.POINTER(ctypes.c_int)]
            function.restype = ctypes.c_int
            _cu_ctx_get_device = function
        except (OSError, AttributeError):
            _cu_ctx_get_device = False
    if not _cu_ctx_get_device:
        return None
    device = ctypes.c_int(-1)
    return device.value if _cu_ctx_get_device(ctypes.byref(device)) == 0 else None


def active():
    """The device this thread's launches go to: the running call's, else the current context's
    (device 0 where the thread has none yet, as Numba would pick). 0 in the simulator."""
    if SIMULATOR:
        return 0
    ordinal = getattr(_state, "ordinal", None)
    if ordinal is None:
        ordinal = _driver_ordinal()
    return 0 if ordinal is None else ordinal


def activate(ordinal):
    """Make ``ordinal``'s primary context current on a thread that has none (it stays there, as
    Numba's own first call leaves it)."""
    from numba import cuda

    cuda.gpus[ordinal].get_primary_context().push()


def on_arrays_device(function):
    """Decorator of the public functions: run the call on the device of its first torch tensor or
    CuPy array (positional, then keyword), that device's context current for the call."""

    @functools.wraps(function)
    def call(*args, **kwargs):
        if SIMULATOR or tracing():
            return function(*args, **kwargs)
        ordinal = None
        for value in args:
            ordinal = ordinal_of(value)
            if ordinal is not None:
                break
        else:
            for value in kwargs.values():
                ordinal = ordinal_of(value)
                if ordinal is not None:
                    break
        previous = getattr(_state, "ordinal", None)
        if ordinal is None or ordinal == previous:
            return function(*args, **kwargs)
        _state.ordinal = ordinal
        try:
            if _driver_ordinal() == ordinal:
                return function(*args, **kwargs)
            from numba import cuda

            with cuda.gpus[ordinal]:
                return function(*args, **kwargs)
        finally:
            _state.ordinal = previous

    return call
