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
  level, debug info);
* the source files the kernel can reach (`reach`): the maker's module and every module of this
  package it imports, followed through their imports (a package's ``__init__`` where the package
  itself is imported), and those of any function or class of this package in the key. An edit
  to any of them (a device function, a PTX wrapper) misses rather than loading stale code; an
  edit elsewhere (another op's kernels) keeps these.

A file holds Numba's own reduction of the kernel (`_Kernel._reduce_states`: the PTX and cubin),
so a hit skips typing, NVVM and ptxas. The directory is ``$SPARSEBLOCKS_CACHE_DIR``, else
``$XDG_CACHE_HOME/sparseblocks`` (``~/.cache/sparseblocks``); ``SPARSEBLOCKS_CACHE_DIR=off``
turns it off. Writes are atomic (a temporary file renamed), so processes sharing the directory
(DDP ranks) never read half a file; an unreadable file is a miss. Kernels Numba cannot reduce
(one referencing a device array) are not kept.
"""

import ast
import hashlib
import os
import pickle
import tempfile

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_PACKAGE = os.path.basename(_ROOT)
_source_digest = None
_compiler_digest = None
_modules = None  # module name -> its file, for every module of this package
_imports = {}  # module name -> the package's modules it imports
_digests = {}  # the modules a digest starts from -> the digest of the files they reach


def directory():
    """The cache's directory, or None where it is turned off."""
    chosen = os.environ.get("SPARSEBLOCKS_CACHE_DIR", "")
    if chosen.lower() in ("off", "0", "none", "false"):
        return None
    if chosen:
        return chosen
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "sparseblocks")


def compiler_digest():
    """A hash of the compiler's versions and of its settings that change the code it emits."""
    global _compiler_digest
    if _compiler_digest is None:
        import numba
        from importlib.metadata import PackageNotFoundError, version

        try:
            compiler = version("numba-cuda")
        except PackageNotFoundError:
            compiler = "unknown"
        # (settings that change the code Numba emits: optimization level, debug info)
        names = ("OPT", "CUDA_DEBUGINFO_DEFAULT", "DEBUGINFO_DEFAULT")
        settings = [getattr(numba.config, name, None) for name in names]
        _compiler_digest = hashlib.sha256(
            f"numba {numba.__version__} numba-cuda {compiler} {settings!r}".encode()).hexdigest()
    return _compiler_digest


def modules():
    """Every module of this package: name -> file (a package's is its ``__init__.py``)."""
    global _modules
    if _modules is None:
        _modules = {}
        for folder, subfolders, files in os.walk(_ROOT):
            subfolders.sort()
            parts = [_PACKAGE] + [p for p in os.path.relpath(folder, _ROOT).split(os.sep) if p != "."]
            for name in sorted(files):
                if name.endswith(".py"):
                    module = ".".join(parts if name == "__init__.py" else parts + [name[:-3]])
                    _modules[module] = os.path.join(folder, name)
    return _modules


def imports(module):
    """The package's modules that ``module``'s source imports, anywhere in it (functions'
    imports too): ``from .x import f`` gives ``x``, ``from . import x`` gives ``x`` where it is
    a module (else the package, whose name it is), ``import a.b`` gives ``a.b``. A package bound
    as a name (``from .. import bsmm``) gives every module under it: any of them is an attribute
    away once imported anywhere."""
    if module not in _imports:
        known = modules()
        path = known[module]
        package = module if path.endswith("__init__.py") else module.rpartition(".")[0]
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read(), path)
        found = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parent = package
                    for _ in range(node.level - 1):
                        parent = parent.rpartition(".")[0]
                    base = f"{parent}.{node.module}" if node.module else parent
                for alias in node.names:
                    name = f"{base}.{alias.name}"
                    found.add(name if name in known else base)
                    if name in known and known[name].endswith("__init__.py"):
                        found.update(m for m in known if m.startswith(name + "."))
            elif isinstance(node, ast.Import):
                found.update(alias.name for alias in node.names)
        _imports[module] = {name for name in found if name in known}
    return _imports[module]


def reach(*starts):
    """The package's modules reachable from ``starts`` through their imports, and the
    ``__init__`` of every package on the way (run by an import of one of its modules)."""
    known, followed, parents = modules(), set(), set()
    todo = [m for m in starts if m in known]
    while todo:
        module = todo.pop()
        if module in followed:
            continue
        followed.add(module)
        todo.extend(imports(module))
        parent = module.rpartition(".")[0]
        while parent in known:  # (its own source; what it imports is not the kernel's, unless
            parents.add(parent)  # the package itself is imported)
            parent = parent.rpartition(".")[0]
    return followed | parents


def key_modules(key):
    """The modules of this package's functions and classes in a maker's ``key`` (a device
    function passed in, a config's class), looked for in tuples, lists and dicts."""
    found, todo = set(), [key]
    while todo:
        item = todo.pop()
        if isinstance(item, (tuple, list)):
            todo.extend(item)
        elif isinstance(item, dict):
            todo.extend(item.values())
        else:
            owner = getattr(item if callable(item) else type(item), "__module__", None) or ""
            if owner == _PACKAGE or owner.startswith(_PACKAGE + "."):
                found.add(owner)
    return found


def source_digest(*starts):
    """A hash of the compiler's versions and of the sources ``reach(*starts)`` finds; without
    ``starts``, of every source file of the package."""
    if not starts:
        global _source_digest
        if _source_digest is None:
            _source_digest = _files_digest(frozenset(modules()))
        return _source_digest
    if starts not in _digests:
        _digests[starts] = _files_digest(reach(*starts))
    return _digests[starts]


def _files_digest(names):
    digest = hashlib.sha256(compiler_digest().encode())
    for name in sorted(names):
        path = modules()[name]
        digest.update(os.path.relpath(path, _ROOT).encode())
        with open(path, "rb") as f:
            digest.update(f.read())
    return digest.hexdigest()


class KernelCache:
    """A dispatcher's cache (Numba's ``_cache`` protocol) under ``name`` in ``folder``;
    ``rebuild(**payload)`` makes a kernel of a file's payload (Numba's ``_Kernel._rebuild``);
    ``sources``: the modules whose files count (`source_digest`; None: every file)."""

    def __init__(self, name, folder, rebuild=None, sources=None):
        self.name, self.folder, self.rebuild, self.sources = name, folder, rebuild, tuple(sources or ())

    def path(self, sig):
        from numba import cuda

        cc = cuda.get_current_device().compute_capability
        key = "\n".join((self.name, str(sig), f"cc {cc}", source_digest(*self.sources)))
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


def attach(result, name, sources=None):
    """Give every Numba dispatcher in ``result`` (a maker's: a kernel, or a tuple of them) a
    `KernelCache` under ``name`` (and its place in the tuple), its files named by ``sources``
    (modules, for `source_digest`); returns ``result``. Does nothing in the simulator, where the
    cache is off, or to what is not a dispatcher."""
    from .backend import SIMULATOR

    folder = directory()
    if SIMULATOR or folder is None:
        return result
    from numba.cuda.dispatcher import CUDADispatcher

    if isinstance(result, CUDADispatcher):
        result._cache = KernelCache(name, folder, sources=sources)
    elif isinstance(result, (tuple, list)):
        for i, item in enumerate(result):
            attach(item, f"{name}[{i}]", sources)
    return result
