"""Compiled kernels kept on disk between processes.

Numba compiles a kernel on its first launch in each process, and the big unrolled ones take
long: the wgmma attention forward at head_dim 128 spends some 30 s in Numba's typing of its
few hundred specialized device functions, before NVVM and ptxas. Numba's own disk cache
(``cache=True``) cannot serve kernels made by makers: they are closures over configs, and the
unrolled steps are generated source with no file.

`attach(dispatcher, name)` gives a maker's dispatcher a cache of its own, which Numba's
``Dispatcher.compile`` consults before compiling and fills after (the same hooks as Numba's
cache: ``load_overload``, ``save_overload``), one file a kernel and signature. A file is named by
a hash of:

* ``name``: the maker's module and qualified name and the ``repr`` of its key (`compile.cached`:
  configs are frozen dataclasses, whose ``repr`` lists every field);
* the argument types, the device's compute capability;
* the Numba and numba-cuda versions and their settings that change the code (optimization
  level, debug info), and every source file of this package, so that an edit anywhere (a device
  function, a PTX wrapper) misses rather than loading stale code.

A file holds Numba's own reduction of the kernel (`_Kernel._reduce_states`: the PTX and cubin),
so a hit skips typing, NVVM and ptxas. The directory is ``$SPARSEBLOCKS_CACHE_DIR``, else
``$XDG_CACHE_HOME/sparseblocks`` (``~/.cache/sparseblocks``); ``SPARSEBLOCKS_CACHE_DIR=off``
turns it off. Writes are atomic (a temporary file renamed), so processes sharing the directory
(DDP ranks) never read half a file; an unreadable file is a miss. Kernels Numba cannot reduce
(one referencing a device array) are not kept.
"""

import hashlib
import os
import pickle
import tempfile

_source_digest = None


def directory():
    """The cache's directory, or None where it is turned off."""
    chosen = os.environ.get("SPARSEBLOCKS_CACHE_DIR", "")
    if chosen.lower() in ("off", "0", "none", "false"):
        return None
    if chosen:
        return chosen
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "sparseblocks")


def source_digest():
    """A hash of this package's source files and of the compiler's versions (computed once)."""
    global _source_digest
    if _source_digest is None:
        import numba

        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        digest = hashlib.sha256()
        from importlib.metadata import PackageNotFoundError, version

        try:
            compiler = version("numba-cuda")
        except PackageNotFoundError:
            compiler = "unknown"
        digest.update(f"numba {numba.__version__} numba-cuda {compiler}".encode())
        # (settings that change the code Numba emits: optimization level, debug info)
        names = ("OPT", "CUDA_DEBUGINFO_DEFAULT", "DEBUGINFO_DEFAULT")
        settings = [getattr(numba.config, name, None) for name in names]
        digest.update(repr(settings).encode())
        for folder, subfolders, files in sorted(os.walk(root)):
            subfolders.sort()
            for name in sorted(files):
                if name.endswith(".py"):
                    path = os.path.join(folder, name)
                    digest.update(os.path.relpath(path, root).encode())
                    with open(path, "rb") as f:
                        digest.update(f.read())
        _source_digest = digest.hexdigest()
    return _source_digest


class KernelCache:
    """A dispatcher's cache (Numba's ``_cache`` protocol) under ``name`` in ``folder``;
    ``rebuild(**payload)`` makes a kernel of a file's payload (Numba's ``_Kernel._rebuild``)."""

    def __init__(self, name, folder, rebuild=None):
        self.name, self.folder, self.rebuild = name, folder, rebuild

    def path(self, sig):
        from numba import cuda

        cc = cuda.get_current_device().compute_capability
        key = "\n".join((self.name, str(sig), f"cc {cc}", source_digest()))
        return os.path.join(self.folder, hashlib.sha256(key.encode()).hexdigest()[:32] + ".kernel")

    def load_overload(self, sig, target_context):
        try:
            with open(self.path(sig), "rb") as f:
                payload = pickle.load(f)
            if self.rebuild is None:
                from numba.cuda.dispatcher import _Kernel

                self.rebuild = _Kernel._rebuild
            return self.rebuild(**payload)
        except Exception:  # (absent, half-written by a crashed process, or of another build: a miss)
            return None

    def save_overload(self, sig, kernel):
        try:
            payload = pickle.dumps(kernel._reduce_states(), protocol=pickle.HIGHEST_PROTOCOL)
        except Exception:  # (Numba cannot reduce it: compile it again next time)
            return
        temporary = None
        try:
            os.makedirs(self.folder, exist_ok=True)
            handle, temporary = tempfile.mkstemp(dir=self.folder, suffix=".part")
            with os.fdopen(handle, "wb") as f:
                f.write(payload)
            os.replace(temporary, self.path(sig))
        except OSError:  # (a read-only or full disk: the cache is an optimization)
            if temporary is not None and os.path.exists(temporary):
                os.unlink(temporary)

    def flush(self):  # (Numba's cache protocol)
        return None


def attach(result, name):
    """Give every Numba dispatcher in ``result`` (a maker's: a kernel, or a tuple of them) a
    `KernelCache` under ``name`` (and its place in the tuple); returns ``result``. Does nothing in
    the simulator, where the cache is off, or to what is not a dispatcher."""
    from .backend import SIMULATOR

    folder = directory()
    if SIMULATOR or folder is None:
        return result
    from numba.cuda.dispatcher import CUDADispatcher

    if isinstance(result, CUDADispatcher):
        result._cache = KernelCache(name, folder)
    elif isinstance(result, (tuple, list)):
        for i, item in enumerate(result):
            attach(item, f"{name}[{i}]")
    return result
