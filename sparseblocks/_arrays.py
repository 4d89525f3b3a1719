"""Array interop for the public functions: NumPy, Numba device arrays, CuPy, torch.

A public function turns each input into an `Operand` (its device view, the
caller's kind and its stream), validates, allocates its output with
`Operand.empty` in the caller's kind, launches on `launch_stream`, and
returns `Operand.result`. NumPy inputs are copied to the device and the
result copied back; GPU inputs never leave the device and share their memory.
Torch tensors cross through ``__cuda_array_interface__``; torch exports no
stream there, so the launch goes on torch's current stream.
"""

import numpy as np
from numba import cuda

from ._backend import SIMULATOR

FLOAT_DTYPES = (np.dtype(np.float16), np.dtype(np.float32), np.dtype(np.float64))

# Tests set this (through `poisoned_outputs`) so that every output is filled
# with NaN (or -1) before a launch and an element no kernel wrote shows up.
_poison_outputs = False


class poisoned_outputs:
    """Context manager: fill every output with NaN (integers: -1) before its kernel runs."""

    def __enter__(self):
        global _poison_outputs
        self._previous, _poison_outputs = _poison_outputs, True

    def __exit__(self, *exc):
        global _poison_outputs
        _poison_outputs = self._previous


def _poison_value(dtype):
    return np.nan if dtype.kind == "f" else -1


def _kind(array):
    module = type(array).__module__.split(".")[0]
    if isinstance(array, np.ndarray):
        return "numpy"
    if module == "torch":
        return "torch"
    if module == "cupy":
        return "cupy"
    if module == "numba" or hasattr(array, "copy_to_host"):
        return "numba"
    if hasattr(array, "__cuda_array_interface__"):
        return "cuda"
    return None


class Operand:
    """One input array: its kind, device view, shape and dtype."""

    def __init__(self, array, name):
        kind = _kind(array)
        if kind is None:
            raise TypeError(
                f"{name}: expected a NumPy array, Numba device array, CuPy array or torch "
                f"tensor, got {type(array).__name__}"
            )
        if kind == "torch":
            if not array.is_cuda and not SIMULATOR:
                raise ValueError(f"{name}: expected a CUDA tensor, got one on {array.device}")
            if array.requires_grad:
                array = array.detach()
        self.name = name
        self.kind = kind
        self.native = array
        self.shape = tuple(array.shape)
        self.dtype = np.dtype(str(array.dtype).replace("torch.", ""))
        self._device = None

    def device(self, stream=0):
        """The array as a Numba device array (copied to the device for NumPy)."""
        if self._device is None:
            if self.kind == "numpy":
                self._device = cuda.to_device(np.ascontiguousarray(self.native), stream=stream)
            elif self.kind == "numba":
                self._device = self.native
            elif self.kind == "torch" and SIMULATOR:
                self._device = cuda.to_device(self.native.numpy())
            else:
                self._device = cuda.as_cuda_array(self.native)
        return self._device

    def require_contiguous(self):
        if self.kind == "numpy":
            return  # copied contiguously on its way to the device
        native = self.native
        if self.kind == "torch":
            ok = native.is_contiguous()
        elif self.kind == "cupy":
            ok = native.flags.c_contiguous
        else:
            ok = self.device().is_c_contiguous()
        if not ok:
            raise ValueError(f"{self.name}: expected a C-contiguous array")

    def empty(self, shape, dtype=None, stream=0):
        """Uninitialised output of the caller's kind: (native, device view)."""
        dtype = np.dtype(dtype or self.dtype)
        native, device = self._allocate(shape, dtype, stream)
        if _poison_outputs and device.size:
            value = _poison_value(dtype)
            if native is device:
                device.copy_to_device(np.full(shape, value, dtype), stream=stream)
            elif self.kind == "torch":
                native.fill_(value)
            else:
                native.fill(value)
        return native, device

    def _allocate(self, shape, dtype, stream):
        if self.kind == "torch" and not SIMULATOR:
            import torch

            native = torch.empty(shape, dtype=getattr(torch, dtype.name), device=self.native.device)
            return native, cuda.as_cuda_array(native)
        if self.kind == "cupy":
            import cupy

            native = cupy.empty(shape, dtype)
            return native, cuda.as_cuda_array(native)
        device = cuda.device_array(shape, dtype, stream=stream)
        return device, device

    def result(self, native, device, stream=0):
        """What the caller gets back: host copy for NumPy, the native array otherwise."""
        if self.kind == "numpy":
            return device.copy_to_host(stream=stream)
        if self.kind == "torch" and SIMULATOR:
            import torch

            return torch.from_numpy(device.copy_to_host())
        return native


def launch_stream(operands):
    """The stream of the callers' framework: torch's or CuPy's current stream, else 0."""
    if SIMULATOR:
        return 0
    kinds = {op.kind for op in operands}
    if "torch" in kinds:
        import torch

        return cuda.external_stream(torch.cuda.current_stream().cuda_stream)
    if "cupy" in kinds:
        import cupy

        return cuda.external_stream(cupy.cuda.get_current_stream().ptr)
    return 0


def check_same_kind(operands):
    kinds = {op.kind for op in operands}
    if len(kinds) > 1:
        names = ", ".join(f"{op.name} ({op.kind})" for op in operands)
        raise TypeError(f"arrays of one kind expected, got {names}")


def check_float(op, dtypes=FLOAT_DTYPES):
    if op.dtype not in dtypes:
        raise TypeError(f"{op.name}: expected dtype in {[d.name for d in dtypes]}, got {op.dtype}")


def check_shape(op, shape):
    if op.shape != tuple(shape):
        raise ValueError(f"{op.name}: expected shape {tuple(shape)}, got {op.shape}")
