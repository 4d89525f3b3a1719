"""Which CUDA backend this process runs on: a real GPU or Numba's simulator."""

import importlib.metadata

from numba import cuda

SIMULATOR = bool(cuda.config.ENABLE_CUDASIM) if hasattr(cuda, "config") else False


def backend_name():
    """'CUDA simulator', the GPU's name and compute capability, or 'no CUDA device'."""
    if SIMULATOR:
        return "CUDA simulator"
    if not cuda.is_available():
        return "no CUDA device (set NUMBA_ENABLE_CUDASIM=1 to use the simulator)"
    device = cuda.get_current_device()
    name = device.name.decode() if isinstance(device.name, bytes) else device.name
    major, minor = device.compute_capability
    return f"{name} (compute capability {major}.{minor})"


def versions():
    """Installed versions of the packages sparseblocks uses, None where absent."""
    found = {}
    for package in ("numba", "numba-cuda", "numpy", "torch", "cupy"):
        try:
            found[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            found[package] = None
    if found["cupy"] is None:
        for dist in importlib.metadata.distributions():
            name = dist.metadata["Name"] or ""
            if name.lower().startswith("cupy-cuda"):
                found["cupy"] = f"{dist.version} ({name})"
                break
    return found
