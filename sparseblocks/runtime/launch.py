"""Launch a compiled kernel without Numba's dispatcher.

A call through the dispatcher types every argument, looks up the overload,
and converts every array (a torch tensor through ``__cuda_array_interface__``
costs ~15 µs): ~100 µs for a kernel with a dozen arguments, far more than
the kernel on a small problem. `launch` goes through the dispatcher once per
kernel and argument types and keeps the compiled kernel. Afterwards it lays
the arguments out itself, in Numba's ABI (an array is meminfo, parent, size,
itemsize, data pointer, shape, strides in bytes; an integer an int64; a float
a double), every field in an 8-byte slot of one buffer per kernel, packed by
one ``struct.pack_into``, and hands the buffer's slot addresses to the
driver's ``cuLaunchKernel`` (through ctypes; cuda.core's launch, the
fallback, converts each of a kernel's ~80 fields separately). The fields of
Numba device arrays (the layouts' index arrays) are computed once per array.

`Replay` goes one step further for calls that repeat: it keeps a packed
parameter buffer of its own for one launch and rewrites only the data
pointers of the arrays that change from call to call.

Kernels that take dynamic shared memory (``cuda.shared.array(0, ...)``) are registered once by
their maker with `dynamic_shared`; every launch of them, replays included, passes that size, and
a size over the 48 KB a block gets by default raises the function's limit first.

Under the simulator every launch goes through the dispatcher.
"""

import ctypes
import struct
import threading

import numpy as np
from numba import cuda

from .backend import SIMULATOR
from .devices import activate, active

_compiled = {}
_streams = {}
_stream_handles = {}
_core_streams = {}
_configs = {}
_device_fields = {}
_multiprocessors = {}
_cuda_core = None
_driver_launch = None
_buffer_lock = threading.Lock()
_dynamic_shared = {}
MAX_CACHED_ARRAYS = 4096  # Numba device arrays whose fields are kept (with a reference to each)
CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES = 8


def dynamic_shared(dispatcher, nbytes):
    """Record that ``dispatcher``'s kernel takes ``nbytes`` of dynamic shared memory a block;
    returns the dispatcher (kernel makers end with ``return dynamic_shared(kernel, size)``)."""
    _dynamic_shared[dispatcher] = int(nbytes)
    return dispatcher


def _per_device(cache, read, simulated):
    """``read(device)`` of the GPU calls run on (`devices.active`), kept per device in ``cache``;
    ``simulated`` in the simulator, whose fake device has no such attributes."""
    ordinal = active()
    value = cache.get(ordinal)
    if value is None:
        try:
            value = read(cuda.gpus[ordinal])
        except Exception:  # the simulator's fake device
            value = simulated
        cache[ordinal] = value
    return value


def multiprocessors():
    """The multiprocessor count of the GPU calls run on (1 in the simulator)."""
    return _per_device(_multiprocessors, lambda device: device.MULTIPROCESSOR_COUNT, 1)


_shared_limit = {}
SM_90_SHARED = 228 * 1024  # shared memory of an sm_90 multiprocessor, its thread blocks' together


def shared_memory_limit():
    """The dynamic shared memory a thread block may opt into on the GPU calls run on (bytes;
    sm_80 164 KB, sm_86 and sm_89 99 KB, sm_90 227 KB); sm_90's in the simulator, so that its
    tests take the kernels the H100 takes."""
    return _per_device(_shared_limit, lambda device: int(device.MAX_SHARED_MEMORY_PER_BLOCK_OPTIN), 227 * 1024)


_capability = {}


def compute_capability():
    """The (major, minor) compute capability of the GPU calls run on; (0, 0) in the simulator,
    where no architecture-specific family is picked by default."""
    return _per_device(_capability, lambda device: tuple(device.compute_capability), (0, 0))


def data_pointer(arg):
    """Device address of a torch tensor, Numba device array or CuPy array."""
    if hasattr(arg, "data_ptr"):  # torch
        return arg.data_ptr()
    if hasattr(arg, "device_ctypes_pointer"):  # Numba
        return arg.device_ctypes_pointer.value or 0
    if SIMULATOR and hasattr(arg, "_ary"):  # the simulator's stand-in for a Numba device array
        return arg._ary.ctypes.data
    return arg.data.ptr  # CuPy


def _array_fields(arg):
    """(what decides the overload, Numba's ABI fields) of a device array.

    The dtype object itself goes into the key, not its name: ``str`` of a
    NumPy dtype costs microseconds, and this runs for every array argument.
    """
    if hasattr(arg, "data_ptr"):  # torch
        itemsize = arg.element_size()
        return (arg.dtype, arg.dim()), (0, 0, arg.numel(), itemsize, arg.data_ptr(), *arg.shape,
                                        *[s * itemsize for s in arg.stride()])
    if hasattr(arg, "device_ctypes_pointer"):  # Numba: fixed for the array's life, so kept
        known = _device_fields.get(id(arg))
        if known is not None and known[0] is arg:
            return known[1]
        if len(_device_fields) >= MAX_CACHED_ARRAYS:
            _device_fields.clear()
        fields = (arg.dtype, arg.ndim), (0, 0, arg.size, arg.dtype.itemsize, data_pointer(arg),
                                         *arg.shape, *arg.strides)
        _device_fields[id(arg)] = (arg, fields)  # the reference keeps id(arg) from being reused
        return fields
    return (arg.dtype, arg.ndim), (0, 0, arg.size, arg.dtype.itemsize, data_pointer(arg), *arg.shape, *arg.strides)


def _fields(args):
    """(overload key, flat field values) of a launch's arguments."""
    key, values = [], []
    for arg in args:
        if isinstance(arg, (int, float)):
            key.append(type(arg))
            values.append(arg)
        else:
            signature, fields = _array_fields(arg)
            key.append(signature)
            values.extend(fields)
    return tuple(key), values


def _format(values):
    """Struct format of the fields: a double for a Python float, an int64 for anything else."""
    return "<" + "".join("d" if isinstance(value, float) else "q" for value in values)


def _parameter_buffer(size):
    """A parameter buffer of ``size`` bytes in 8-byte slots, and the array of the slots'
    addresses that ``cuLaunchKernel`` takes (at least one slot)."""
    buffer = ctypes.create_string_buffer(max(8, size))
    base = ctypes.addressof(buffer)
    return buffer, (ctypes.c_void_p * max(1, size // 8))(*[base + 8 * i for i in range(max(1, size // 8))])


class _Kernel:
    """A compiled kernel and its parameter buffer: one 8-byte slot per field."""

    __slots__ = ("function", "handle", "core_kernel", "packer", "buffer", "slots", "shared", "resident")

    def __init__(self, cufunc, values, shared=0):
        self.core_kernel = cufunc.kernel
        self.function = None
        self.shared = shared
        self.resident = {}  # (thread blocks a multiprocessor holds, by block size)
        self.packer = struct.Struct(_format(values))
        self.buffer, self.slots = _parameter_buffer(self.packer.size)
        from cuda.bindings import driver

        handle = cufunc.handle
        if isinstance(handle, driver.CUfunction):  # loaded through the module API
            function = handle
        else:  # a library's CUkernel: its function in the current context
            error, function = driver.cuKernelGetFunction(handle)
            function = function if int(error) == 0 else None
        self.handle = function
        if shared:  # (static and dynamic past 48 KB together need it: raised for any dynamic size)
            attribute = driver.CUfunction_attribute(CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES)
            if function is not None:
                (error,) = driver.cuFuncSetAttribute(function, attribute, shared)
            if not isinstance(handle, driver.CUfunction):  # (and the kernel's, which Numba launches)
                error, device = driver.cuCtxGetDevice()
                if int(error) == 0:
                    (error,) = driver.cuKernelSetAttribute(attribute, shared, handle, device)
            if int(error) != 0:
                raise RuntimeError(f"raising the dynamic shared memory limit to {shared} bytes failed: {error}")
        if _driver() is not None and function is not None:
            self.function = int(function)


def _driver():
    """The driver's cuLaunchKernel through ctypes, or None (then cuda.core launches)."""
    global _driver_launch
    if _driver_launch is None:
        try:
            function = ctypes.PyDLL("libcuda.so.1").cuLaunchKernel  # as run on the GPU; keeps the GIL
            function.argtypes = [ctypes.c_void_p] + [ctypes.c_uint] * 7 + [ctypes.c_void_p] * 3
            function.restype = ctypes.c_int
            _driver_launch = function
        except (OSError, AttributeError):
            _driver_launch = False
    return _driver_launch or None


def stream_of(handle):
    """A Numba stream for a raw CUDA stream handle, cached (0: the default stream of the device
    calls run on)."""
    key = (handle, active()) if handle == 0 else handle
    if key not in _streams:
        _streams[key] = cuda.default_stream() if handle == 0 else cuda.external_stream(handle)
    return _streams[key]


def capture_of(handle):
    """The graph capture running on the stream of raw handle `handle`: its id (unique in the
    process), None when none runs (always under the simulator), -1 when the driver cannot say
    (e.g. the legacy stream while another stream captures)."""
    if SIMULATOR:
        return None
    from cuda.bindings import driver

    error, status, ident = driver.cuStreamGetCaptureInfo(driver.CUstream(handle))[:3]
    if int(error) != 0:
        return -1
    return None if int(status) == 0 else int(ident)


def stream_handle(stream):
    handle = _stream_handles.get(stream)
    if handle is None:
        handle = _stream_handles[stream] = int(stream.__cuda_stream__()[1])
    return handle


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
        core = _core_streams[stream] = _core().Stream.from_handle(stream_handle(stream))
    return core


def _dim3(dims):
    dims = dims if isinstance(dims, tuple) else (dims,)
    return dims + (1,) * (3 - len(dims))


CUDA_ERROR_INVALID_CONTEXT = 201


def _checked_launch(function, grid, block, handle, slots, shared=0):
    """cuLaunchKernel, raising on failure. A thread with no current context (torch's autograd
    engine runs backward functions on threads of its own, where no driver call may have been
    made yet) gets the call's device's primary context, and the launch is retried once."""
    error = _driver_launch(function, *grid, *block, shared, handle, slots, None)
    if error == CUDA_ERROR_INVALID_CONTEXT:
        activate(active())
        error = _driver_launch(function, *grid, *block, shared, handle, slots, None)
    if error:
        raise RuntimeError(f"cuLaunchKernel failed with CUDA error {error}")


def _check_shared(dispatcher, shared):
    """A kernel's dynamic shared memory past what a thread block may opt into is the library's
    bug (its makers size their rings to fit): refused here, on the simulator as on the GPU."""
    limit = shared_memory_limit()
    if shared > limit:  # (dispatchers, the simulator's too, carry their function's __name__)
        raise RuntimeError(f"{getattr(dispatcher, '__name__', 'a kernel')}: {shared} bytes of dynamic shared memory, "
                           f"over the device's {limit} a thread block")


def _compile(dispatcher, key, args, values, shared):
    """The kernel `launch` keeps for ``key``, compiled for ``args`` (made before the first launch:
    it raises the function's shared-memory limit)."""
    _check_shared(dispatcher, shared)
    # (torch refuses __cuda_array_interface__ on tensors that require grad: ``args`` detached)
    compiled = dispatcher.compile(tuple(dispatcher.typeof_pyval(arg) for arg in args))
    kernel = _compiled[key] = _Kernel(compiled._codelibrary.get_cufunc(), values, shared)
    return kernel


def resident_blocks(dispatcher, block, args):
    """Thread blocks of ``block`` threads of this kernel, compiled for ``args`` as `launch` takes
    them, that a multiprocessor holds at once with its dynamic shared memory (the driver's
    occupancy; compiled here where not yet), 1 where the driver cannot say. In the simulator what
    threads and dynamic shared memory allow on sm_90 (2,048 threads, 32 blocks, 228 KB, 1 KB
    reserved a block), so that its tests split work as the H100 does."""
    shared = _dynamic_shared.get(dispatcher, 0)
    if SIMULATOR:
        return max(1, min(2048 // block, 32, SM_90_SHARED // (shared + 1024)))
    key, values = _fields(args)
    key = (dispatcher, key, active())
    kernel = _compiled.get(key)
    if kernel is None:
        kernel = _compile(dispatcher, key, [arg.detach() if hasattr(arg, "detach") else arg for arg in args],
                          values, shared)
    count = kernel.resident.get(block)
    if count is None:
        count = 1
        if kernel.handle is not None:
            from cuda.bindings import driver

            error, blocks = driver.cuOccupancyMaxActiveBlocksPerMultiprocessor(kernel.handle, block, shared)
            count = max(1, int(blocks)) if int(error) == 0 else 1
        kernel.resident[block] = count
    return count


def fullest_waves(work, slots, low, high):
    """Of ``low`` to ``high`` shares (at least 1), the count for ``work`` rows of alike thread
    blocks, each row split into that many shares, whose waves on ``slots`` thread blocks at once
    take the least time for a row's worth: waves / shares least, the fewest among equals. 45
    rows of 6 shares on 132 slots run three waves, the last of 6 thread blocks; 11 shares run
    four, the last three quarters full (a share's time 27 % less)."""
    low = max(1, low)
    best = low
    for shares in range(low + 1, max(low, high) + 1):
        if -(-work * shares // slots) * best < -(-work * best // slots) * shares:
            best = shares
    return best


def launch(dispatcher, grid, block, stream, args):
    """``dispatcher[grid, block, stream](*args)``, through the dispatcher only the first time.

    Arrays must be C-contiguous device arrays (Numba, CuPy or torch); scalars
    Python ints or floats. A kernel registered with `dynamic_shared` gets its size.
    """
    shared = _dynamic_shared.get(dispatcher, 0)
    if SIMULATOR:
        _check_shared(dispatcher, shared)  # (the GPU's launch refuses it; the simulator would not)
        # Numba types a Python int argument int64; the simulator would keep it a Python int, and
        # under NumPy 2's promotion an int32 array element times it stays int32 and wraps (a
        # window's start, index * stride, would land where the GPU's int64 does not put it).
        dispatcher[grid, block, stream, shared](*(np.int64(a) if type(a) is int else a for a in args))
        return
    stream = stream if stream else stream_of(0)
    key, values = _fields(args)
    key = (dispatcher, key, active())  # (a compiled function is loaded into each device's context)
    kernel = _compiled.get(key)
    if kernel is None:
        args = [arg.detach() if hasattr(arg, "detach") else arg for arg in args]
        _compile(dispatcher, key, args, values, shared)
        dispatcher[grid, block, stream, shared](*args)
        return
    if kernel.function is not None:
        # The lock: no other thread refills this kernel's parameter buffer
        # between the packing and the driver's copy of it.
        with _buffer_lock:
            kernel.packer.pack_into(kernel.buffer, 0, *values)
            _checked_launch(kernel.function, _dim3(grid), _dim3(block), stream_handle(stream), kernel.slots, shared)
        return
    config = _configs.get((grid, block, shared))
    if config is None:
        config = _configs[(grid, block, shared)] = _core().LaunchConfig(grid=_dim3(grid), block=_dim3(block),
                                                                        shmem_size=shared)
    raw = [ctypes.c_double(v) if isinstance(v, float) else v for v in values]
    _core().launch(_core_stream(stream), config, kernel.core_kernel, *raw)


def _data_field(args, position):
    """Index of argument ``position``'s data pointer among the launch's flat fields."""
    index = 0
    for arg in args[:position]:
        index += 1 if isinstance(arg, (int, float)) else len(_array_fields(arg)[1])
    return index + 4  # meminfo, parent, size, itemsize, then the data pointer


class Replay:
    """One launch, kept: the same kernel, grid, block and arguments but for the data pointers
    of the arguments at ``live`` (what changes between two calls of a public function with
    arrays of the same shapes and dtypes). Calling it rewrites those pointers in its own
    parameter buffer and launches on the given raw stream handle. An entry of ``live`` may be a
    tuple of positions: arguments that are views of one array (one pointer written into each).

    ``derived``: (position, source position, function) for arguments whose data pointer follows
    from a live argument's (a tensor map's, `runtime.tensormap`): ``function(pointer, stream
    handle)`` gives it, or None where it cannot, and then the call launches nothing and returns
    False (the caller takes the general path); else it returns True.
    """

    __slots__ = ("function", "grid", "block", "buffer", "words", "slots", "live", "lock", "shared", "derived")

    def __init__(self, kernel, grid, block, args, values, live, derived=()):
        self.function = kernel.function
        self.shared = kernel.shared
        self.grid, self.block = _dim3(grid), _dim3(block)
        self.buffer, self.slots = _parameter_buffer(kernel.packer.size)
        kernel.packer.pack_into(self.buffer, 0, *values)
        self.words = (ctypes.c_int64 * len(self.slots)).from_buffer(self.buffer)
        self.live = tuple((_data_field(args, at), k) for k, position in enumerate(live)
                          for at in (position if isinstance(position, tuple) else (position,)))
        source = {at: k for k, position in enumerate(live)
                  for at in (position if isinstance(position, tuple) else (position,))}
        self.derived = tuple((_data_field(args, position), source[of], function) for position, of, function in derived)
        self.lock = threading.Lock()

    def __call__(self, stream_handle, *pointers):
        # The lock: no other thread rewrites the pointers before the driver has copied them.
        with self.lock:
            words = self.words
            for index, k in self.live:
                words[index] = pointers[k]
            for index, k, function in self.derived:
                pointer = function(pointers[k], stream_handle)
                if pointer is None:
                    return False
                words[index] = pointer
            _checked_launch(self.function, self.grid, self.block, stream_handle, self.slots, self.shared)
        return True


def replay(dispatcher, grid, block, args, derived=(), *, live):
    """A `Replay` of a launch `launch` has made (same arguments; ``derived`` as `Replay`'s), or
    None where launches do not go through the driver here (the simulator; cuda.core's fallback)."""
    if SIMULATOR:
        return None
    key, values = _fields(args)
    kernel = _compiled.get((dispatcher, key, active()))
    if kernel is None or kernel.function is None:
        return None
    return Replay(kernel, grid, block, args, values, live, derived)
