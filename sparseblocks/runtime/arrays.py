"""Array interop for the public functions: NumPy, Numba device arrays, CuPy, torch.

A public function turns each input into an `Operand` (its kind, dtype name and
device view), validates, allocates its outputs with `Operand.empty` in the
caller's kind, launches on `launch_stream`, and returns `Operand.result`.
NumPy inputs are copied to the device and results copied back; GPU inputs
never leave the device and share their memory. Torch tensors cross through
``__cuda_array_interface__``; torch exports no stream there, so the launch
goes on torch's current stream.

bfloat16 does not cross ``__cuda_array_interface__``: torch bf16 tensors and
NumPy arrays of ``ml_dtypes.bfloat16`` reach kernels as int16 views of their
bits (`Operand.dtype` is then ``"bfloat16"``).
"""

from typing import Any

import numpy as np
from numba import cuda

from .backend import SIMULATOR
from .devices import active

FLOAT_DTYPES = ("float16", "float32", "float64", "bfloat16")
Array = Any  # a NumPy array, Numba device array, CuPy array or torch tensor (what an `Operand` takes)

# Tests set this (through `poisoned_outputs`) so that every output is filled
# with NaN (or -1) before a launch and an element no kernel wrote shows up.
_poison_outputs = False


class poisoned_outputs:
    """Context manager: fill every new output with NaN before its kernel runs."""

    def __enter__(self):
        global _poison_outputs
        self._previous, _poison_outputs = _poison_outputs, True

    def __exit__(self, *exc):
        global _poison_outputs
        _poison_outputs = self._previous


def _kind(array):
    module = type(array).__module__.split(".")[0]
    if isinstance(array, np.ndarray):
        return "numpy"
    if module == "torch":
        return "torch"
    if module == "cupy":
        return "cupy"
    if hasattr(array, "copy_to_host"):
        return "numba"
    return None


_dtype_names = {}


def _dtype_name(array):
    """'float32', 'bfloat16', ... for NumPy, CuPy, Numba and torch dtypes (cached: ``str`` is slow)."""
    name = _dtype_names.get(array.dtype)
    if name is None:
        name = _dtype_names[array.dtype] = str(array.dtype).replace("torch.", "")
    return name


def _bf16_numpy():
    import ml_dtypes

    return ml_dtypes.bfloat16


class Operand:
    """One array argument: kind, shape, dtype name and (lazily) its device view."""

    def __init__(self, array, name):
        kind = _kind(array)
        if kind is None:
            raise TypeError(
                f"{name}: expected a NumPy array, Numba device array, CuPy array or torch "
                f"tensor, got {type(array).__name__}"
            )
        if kind == "torch":
            if not SIMULATOR:
                if not array.is_cuda:
                    raise ValueError(f"{name}: expected a CUDA tensor, got one on {array.device}")
                if array.device.index != active():
                    raise ValueError(f"{name}: expected a tensor on cuda:{active()} (the call's device, its first "
                                     f"GPU array's), got one on {array.device}: move them to one device")
            array = array.detach()
        elif kind == "cupy" and not SIMULATOR and array.device.id != active():
            raise ValueError(f"{name}: expected an array on device {active()} (the call's device, its first "
                             f"GPU array's), got one on device {array.device.id}: move them to one device")
        self.name = name
        self.kind = kind
        self.native = array
        self.shape = tuple(array.shape)
        self.dtype = _dtype_name(array)
        self._device = None

    def device(self, stream=0):
        """The array as kernels take it: on the device, bf16 as int16 bits.

        NumPy arrays are copied to a Numba device array; Numba, CuPy and torch
        arrays are passed as they are (a kernel launch reads their pointers).
        """
        if self._device is None:
            native = self.native
            if self.dtype == "bfloat16":
                native = native.view(np.int16) if self.kind == "numpy" else self._torch_bits(native)
            if self.kind == "numpy":
                self._device = cuda.to_device(np.ascontiguousarray(native), stream=stream)
            elif self.kind == "torch" and SIMULATOR:
                self._device = cuda.to_device(native.numpy())
            else:
                self._device = native
        return self._device

    @staticmethod
    def _torch_bits(tensor):
        import torch

        return tensor.view(torch.int16)

    def require_contiguous(self):
        if self.kind == "numpy":
            return  # copied contiguously on its way to the device
        native = self.native
        if self.kind == "torch":
            ok = native.is_contiguous()
        elif self.kind == "cupy":
            ok = native.flags.c_contiguous
        else:
            ok = native.is_c_contiguous()
        if not ok:
            raise ValueError(f"{self.name}: expected a C-contiguous array")

    def empty(self, shape, stream=0, dtype=None):
        """Uninitialised output of the caller's kind and this operand's dtype (or ``dtype``):
        (native, device view)."""
        native, device = self._allocate(shape, dtype or self.dtype, stream)
        if _poison_outputs and int(np.prod(shape)):
            if self.kind == "torch" and not SIMULATOR:
                native.fill_(float("nan"))
            elif self.kind == "cupy":
                native.fill(np.nan)
            else:
                poison = np.full(shape, 0x7FC0, np.int16) if (dtype or self.dtype) == "bfloat16" \
                    else np.full(shape, np.nan, device.dtype)  # bf16's NaN is 0x7FC0
                device.copy_to_device(poison, stream=stream)
        return native, device

    def scratch(self, shape, dtype, stream=0):
        """A temporary device array from the caller's allocator (torch's caching allocator for torch);
        ``dtype`` a NumPy dtype or a name ("bfloat16": its int16 bits)."""
        return self._allocate(shape, dtype if isinstance(dtype, str) else np.dtype(dtype).name, stream)[1]

    def _allocate(self, shape, dtype, stream):
        bf16 = dtype == "bfloat16"
        if self.kind == "torch" and not SIMULATOR:
            import torch

            native = self.native.new_empty(shape, dtype=getattr(torch, dtype))
            return native, (native.view(torch.int16) if bf16 else native)
        if self.kind == "cupy":
            import cupy

            with self.native.device:
                native = cupy.empty(shape, np.int16 if bf16 else dtype)
            return native, native
        device = cuda.device_array(shape, np.int16 if bf16 else dtype, stream=stream)
        return device, device

    def result(self, native, device, stream=0):
        """What the caller gets back: host copy for NumPy, the native array otherwise."""
        if self.kind == "numpy":
            host = device.copy_to_host(stream=stream)
            return host.view(_bf16_numpy()) if self.dtype == "bfloat16" and host.dtype == np.int16 else host
        if self.kind == "torch" and SIMULATOR:
            import torch

            host = device.copy_to_host()
            bf16 = self.dtype == "bfloat16" and host.dtype == np.int16  # (not an fp32 result of bf16 input)
            host = torch.from_numpy(host)
            return host.view(torch.bfloat16) if bf16 else host
        return native


def torch_stream_handle():
    """torch's current stream on the call's device as a raw handle: its private getter (what Triton uses) costs ~1 µs,
    ``torch.cuda.current_stream()`` several."""
    import torch

    ordinal = active()  # (the call's device: torch's current device may be another)
    try:
        return torch._C._cuda_getCurrentRawStream(ordinal)
    except AttributeError:  # a torch without the private getter
        return torch.cuda.current_stream(ordinal).cuda_stream


def launch_stream(operands):
    """The stream of the callers' framework: torch's or CuPy's current stream, else 0."""
    if SIMULATOR:
        return 0
    from .launch import stream_of

    kinds = {op.kind for op in operands}
    if "torch" in kinds:
        return stream_of(torch_stream_handle())
    if "cupy" in kinds:
        import cupy

        return stream_of(cupy.cuda.get_current_stream().ptr)
    return 0


def span(array):
    """The device bytes [lo, hi) that `array`'s elements lie in, or None where nothing else can share
    them (a NumPy array, copied to the device; no elements). Torch tensors under the simulator
    give their host bytes: tensors that share memory there would share it on a GPU."""
    if isinstance(array, np.ndarray):
        return None
    if hasattr(array, "data_ptr"):  # torch (first, and contiguous apart: kept plans' replays ask)
        n = array.numel()
        if n == 0:
            return None
        item, start = array.element_size(), array.data_ptr()
        if array.is_contiguous():
            return start, start + n * item
        strides = [s * item for s in array.stride()]
    else:
        if 0 in tuple(array.shape):
            return None
        from .launch import data_pointer

        item, start, strides = array.dtype.itemsize, data_pointer(array), array.strides
    reach = [(n - 1) * s for n, s in zip(array.shape, strides)]
    return start + sum(r for r in reach if r < 0), start + sum(r for r in reach if r > 0) + item


def first_shared(written, read):
    """The index in `read` (arrays of any kind, None skipped) of the first that may share device
    bytes with `written` (their spans meet), or None (also where `written` is None)."""
    w = None if written is None else span(written)
    if w is not None:
        for k, array in enumerate(read):
            r = None if array is None else span(array)
            if r is not None and r[0] < w[1] and w[0] < r[1]:
                return k
    return None


def tensors_overlap(written, read):
    """Whether C-contiguous torch tensor `written` shares bytes with any of `read` (C-contiguous
    torch tensors, None skipped): `first_shared` for kept plans' replays, in a fifth of its time."""
    start = written.data_ptr()
    end = start + written.nbytes
    for tensor in read:
        if tensor is not None:
            at = tensor.data_ptr()
            if at < end and start < at + tensor.nbytes:
                return True
    return False


def check_disjoint(written, read):
    """ValueError where the operand a call writes shares memory with one it reads (`read`: operands,
    None skipped): threads would read what others have already overwritten, in no set order."""
    read = [op for op in read if op is not None]
    k = first_shared(written.native, [op.native for op in read])
    if k is not None:
        raise ValueError(f"{written.name}: shares memory with {read[k].name}, which the call reads while it "
                         f"writes {written.name}; pass arrays that do not overlap")


def checked_operands(named, dtypes, same_dtype=True):
    """Operands of ``(name, array)`` pairs, checked: one kind, each of ``dtypes`` and C-contiguous,
    and (``same_dtype``) one dtype."""
    ops = [Operand(a, name) for name, a in named]
    check_same_kind(ops)
    for op in ops:
        check_dtype(op, dtypes)
        op.require_contiguous()
    if same_dtype:
        check_same_dtype(ops)
    return ops


def check_same_kind(operands):
    kinds = {op.kind for op in operands}
    if len(kinds) > 1:
        names = ", ".join(f"{op.name} ({op.kind})" for op in operands)
        raise TypeError(f"arrays of one kind expected, got {names}")


def check_dtype(op, dtypes=FLOAT_DTYPES):
    if op.dtype not in dtypes:
        raise TypeError(f"{op.name}: expected dtype in {list(dtypes)}, got {op.dtype}")


def check_same_dtype(operands):
    if len({op.dtype for op in operands}) > 1:
        raise TypeError("dtype mismatch: " + ", ".join(f"{op.name} {op.dtype}" for op in operands))


def check_shape(op, shape):
    if op.shape != tuple(shape):
        raise ValueError(f"{op.name}: expected shape {tuple(shape)}, got {op.shape}")
