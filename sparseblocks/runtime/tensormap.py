"""Tensor maps for Hopper's bulk tensor copies (`ptx.tma`): made on the host, kept on the device.

A tensor map is 128 opaque bytes that the driver encodes (``cuTensorMapEncodeTiled``): a 2-D
tensor of 16-bit values at a device address, its dims (inner, outer), the bytes from one outer
row to the next, the box a copy moves (inner, outer) and the 128-byte swizzle; elements past the
dims read as zeros. A kernel reads it from global memory, so `tensor_map` keeps each map the
calls ask for in a slot of a device slab, uploaded once on the call's stream from a pinned
mirror (a captured graph records that copy, and its replays find the map in place). A map only
depends on what it describes, so a slot never changes and is never reused: maps stay for the
process's life, up to `MAX_MAPS` a device; past that `tensor_map` returns None and the caller
takes a kernel without bulk copies. Slabs are allocated a slab ahead, outside graph captures
(no allocation may run inside one): a capture that would need one gets None too.

In the CUDA simulator a map holds the description in fields of its own (`simulated_fields`
reads them), which `ptx.tma`'s twin copies by.
"""

import ctypes
import threading

import numpy as np

from .backend import SIMULATOR
from .devices import active
from .launch import capture_of, stream_handle

MAP_BYTES = 128
SLAB = 1024  # maps a device allocation holds
HEADROOM = 256  # free slots under which the next slab is allocated (outside a capture)
MAX_MAPS = 64 * SLAB  # maps kept a device (8 MB of device memory and as much pinned)
MAX_BOX = 256
_MAGIC = 0x544D4150  # "TMAP": a simulated map's first field

# CUtensorMap enums
_UINT16, _INTERLEAVE_NONE, _SWIZZLE_128B, _L2_256B, _FILL_ZEROS = 1, 0, 3, 3, 0

_lock = threading.Lock()
_maps = {}  # (device, address, item, dims, row bytes, box) -> the map's device array (128 bytes)
_slabs = {}  # device -> [(device slab, pinned mirror)], the slots used in the last
_used = {}  # device -> slots handed out
_encode = None


def check(address, item, dims, row_bytes, box):
    """Why these cannot make a map ('' where they can): 16-bit values, addresses and row strides
    in whole 16 bytes, box rows of 128 bytes (the swizzle's) and at most 256 of them."""
    if item != 2:
        return f"elements of {item} bytes, expected 2"
    if address % 16 or row_bytes % 16:
        return f"address {address:#x} and row stride {row_bytes} must be multiples of 16 bytes"
    if not (1 <= dims[0] < 1 << 32 and 1 <= dims[1] < 1 << 32) or row_bytes >= 1 << 40:
        return f"dims {dims} outside 1 .. 2^32 - 1"
    if box[0] * item != 128 or not 1 <= box[1] <= MAX_BOX:
        return f"box {box}: expected rows of 128 bytes, 1 to {MAX_BOX} of them"
    return ""


def _driver_encode():
    global _encode
    if _encode is None:
        function = ctypes.CDLL("libcuda.so.1").cuTensorMapEncodeTiled
        u32, u64p, u32p = ctypes.c_uint32, ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_uint32)
        function.argtypes = [ctypes.c_void_p, ctypes.c_int, u32, ctypes.c_void_p, u64p, u64p, u32p, u32p,
                             ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int]
        function.restype = ctypes.c_int
        _encode = function
    return _encode


def encode_into(into, address, item, dims, row_bytes, box):
    """Write the map into ``into`` (a NumPy uint8 array of 128, 64-byte aligned in host memory)."""
    why = check(address, item, dims, row_bytes, box)
    if why:
        raise ValueError(f"tensor map: {why}")
    if SIMULATOR:
        into[:] = np.array([_MAGIC, item, *dims, row_bytes, *box] + [0] * 9, np.int64).view(np.uint8)
        return
    U64, U32 = ctypes.c_uint64, ctypes.c_uint32
    error = _driver_encode()(into.ctypes.data, _UINT16, 2, address, (U64 * 2)(*dims), (U64 * 1)(row_bytes),
                             (U32 * 2)(*box), (U32 * 2)(1, 1), _INTERLEAVE_NONE, _SWIZZLE_128B, _L2_256B, _FILL_ZEROS)
    if error:
        raise RuntimeError(f"cuTensorMapEncodeTiled failed with CUDA error {error} (address {address:#x}, dims "
                           f"{dims}, row stride {row_bytes}, box {box})")


def simulated_fields(raw):
    """(bytes an element, dims, bytes a row, box) of a simulated map's 128 bytes."""
    fields = np.frombuffer(np.ascontiguousarray(raw).tobytes(), np.int64)
    if fields[0] != _MAGIC:
        raise ValueError("cp.async.bulk.tensor: the address holds no tensor map")
    return int(fields[1]), (int(fields[2]), int(fields[3])), int(fields[4]), (int(fields[5]), int(fields[6]))


def tensor_map(address, item, dims, row_bytes, box, stream=None):
    """The device array (128 bytes) of the map of a tensor at device ``address`` (see `check`),
    made and uploaded on ``stream`` (a Numba stream) the first time; None once `MAX_MAPS` are
    kept on this device."""
    key = (active(), int(address), item, tuple(dims), int(row_bytes), tuple(box))
    found = _maps.get(key)
    if found is not None:
        return found
    from numba import cuda

    with _lock:
        found = _maps.get(key)
        if found is not None:
            return found
        if SIMULATOR:
            host = np.zeros(MAP_BYTES, np.uint8)
            encode_into(host, *key[1:])
            found = _maps[key] = cuda.to_device(host)
            return found
        device = key[0]
        used = _used.get(device, 0)
        slabs = _slabs.setdefault(device, [])
        capturing = capture_of(stream_handle(stream) if stream else 0) is not None
        while len(slabs) * SLAB - used < HEADROOM and len(slabs) * SLAB < MAX_MAPS and not capturing:
            slabs.append((cuda.device_array((SLAB, MAP_BYTES), np.uint8),
                          cuda.pinned_array((SLAB, MAP_BYTES), np.uint8)))
        if used >= len(slabs) * SLAB:
            return None  # (at MAX_MAPS, or a capture that would allocate)
        slab, pinned = slabs[used // SLAB]
        slot = used % SLAB
        encode_into(pinned[slot], *key[1:])
        found = slab[slot]
        found.copy_to_device(pinned[slot], stream=stream or 0)
        _used[device] = used + 1
        _maps[key] = found
        return found


def map_pointer(address, item, dims, row_bytes, box, stream=None):
    """`tensor_map`'s device address, or None."""
    found = tensor_map(address, item, dims, row_bytes, box, stream)
    return None if found is None else found.device_ctypes_pointer.value


_dummy = {}


def no_map():
    """A 128-byte device array of zeros, per device: what a kernel built without bulk copies is
    given for its map arguments."""
    device = active()
    found = _dummy.get(device)
    if found is None:
        from numba import cuda

        found = _dummy[device] = cuda.to_device(np.zeros(MAP_BYTES, np.uint8))
    return found
