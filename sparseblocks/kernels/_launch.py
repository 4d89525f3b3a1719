"""Launch a compiled kernel without Numba's dispatcher.

A call through the dispatcher types every argument, looks up the overload,
and converts every array (a torch tensor through ``__cuda_array_interface__``
costs ~15 µs): ~100 µs for a kernel with a dozen arguments, far more than
the kernel on a small problem. `launch` goes through the dispatcher once per
kernel and argument types, keeps the compiled kernel, and afterwards packs
the arguments itself, in Numba's ABI (an array is meminfo, parent, size,
itemsize, data pointer, shape, strides in bytes; an integer an int64; a float
a double), and hands them to ``cuda.core.launch``.

Under the simulator every launch goes through the dispatcher.
"""

import ctypes

from numba import cuda

from .._backend import SIMULATOR

_compiled = {}
_streams = {}
_core_streams = {}
_configs = {}
_multiprocessors = None
_cuda_core = None


def multiprocessors():
    """The current GPU's multiprocessor count (1 in the simulator), cached."""
    global _multiprocessors
    if _multiprocessors is None:
        try:
            _multiprocessors = cuda.get_current_device().MULTIPROCESSOR_COUNT
        except Exception:  # the simulator's fake device has no such attribute
            _multiprocessors = 1
    return _multiprocessors


def _signature(arg):
    """What decides the compiled overload: dtype and rank of arrays, type of scalars.

    The dtype object itself, not its name: ``str`` of a NumPy dtype costs
    microseconds, and this runs for every argument of every launch.
    """
    if isinstance(arg, (int, float)):
        return type(arg)
    return (arg.dtype, len(arg.shape))


def data_pointer(arg):
    """Device address of a torch tensor, Numba device array or CuPy array."""
    if hasattr(arg, "data_ptr"):  # torch
        return arg.data_ptr()
    if hasattr(arg, "device_ctypes_pointer"):  # Numba
        return arg.device_ctypes_pointer.value or 0
    if SIMULATOR and hasattr(arg, "_ary"):  # the simulator's stand-in for a Numba device array
        return arg._ary.ctypes.data
    return arg.data.ptr  # CuPy


def _raw_array(arg):
    if hasattr(arg, "data_ptr"):  # torch
        itemsize = arg.element_size()
        return (0, 0, arg.numel(), itemsize, arg.data_ptr(), *arg.shape, *(s * itemsize for s in arg.stride()))
    return (0, 0, arg.size, arg.dtype.itemsize, data_pointer(arg), *arg.shape, *arg.strides)


def _raw(args):
    raw = []
    for arg in args:
        if isinstance(arg, int):
            raw.append(ctypes.c_int64(arg))
        elif isinstance(arg, float):
            raw.append(ctypes.c_double(arg))
        else:
            raw.extend(_raw_array(arg))
    return raw


def stream_of(handle):
    """A Numba stream for a raw CUDA stream handle, cached (0: the default stream)."""
    if handle not in _streams:
        _streams[handle] = cuda.default_stream() if handle == 0 else cuda.external_stream(handle)
    return _streams[handle]


def _core():
    """The cuda.core module, imported on the first compiled launch (the simulator never needs it)."""
    global _cuda_core
    if _cuda_core is None:
        import cuda.core

        _cuda_core = cuda.core
    return _cuda_core


def _core_stream(stream):
    """cuda.core's view of a Numba stream, cached (cuda.core deprecates taking foreign objects)."""
    core = _core_streams.get(stream)
    if core is None:
        core = _core_streams[stream] = _core().Stream.from_handle(int(stream.__cuda_stream__()[1]))
    return core


def launch(dispatcher, grid, block, stream, args):
    """``dispatcher[grid, block, stream](*args)``, through the dispatcher only the first time.

    Arrays must be C-contiguous device arrays (Numba, CuPy or torch); scalars
    Python ints or floats.
    """
    if SIMULATOR:
        dispatcher[grid, block, stream](*args)
        return
    key = (dispatcher, tuple(_signature(arg) for arg in args))
    kernel = _compiled.get(key)
    if kernel is None:
        dispatcher[grid, block, stream](*args)
        compiled = dispatcher.compile(tuple(dispatcher.typeof_pyval(arg) for arg in args))
        _compiled[key] = compiled._codelibrary.get_cufunc().kernel
        return
    config = _configs.get((grid, block))
    if config is None:
        config = _configs[(grid, block)] = _core().LaunchConfig(
            grid=grid if isinstance(grid, tuple) else (grid,), block=block if isinstance(block, tuple) else (block,))
    _core().launch(_core_stream(stream if stream else stream_of(0)), config, kernel, *_raw(args))
