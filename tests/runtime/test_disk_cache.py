"""The disk cache of compiled kernels (runtime/disk_cache.py): its directory, its file names
(every part of the key counts, the source of the package among them), atomic writes, misses on
absent or unreadable files; on a GPU, a kernel made again in a fresh maker cache loads its
compiled code from disk instead of compiling, and computes the same."""

import os
import pickle

import numpy as np
import pytest
from numba import cuda

from sparseblocks.runtime import compile as compile_cache
from sparseblocks.runtime import disk_cache
from sparseblocks.runtime.backend import SIMULATOR


class _Reducible:
    """A stand-in for Numba's compiled kernel: what it reduces to, and what rebuilds it."""

    def __init__(self, payload):
        self.payload = payload

    def _reduce_states(self):
        return self.payload


def test_directory_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("SPARSEBLOCKS_CACHE_DIR", str(tmp_path))
    assert disk_cache.directory() == str(tmp_path)
    monkeypatch.setenv("SPARSEBLOCKS_CACHE_DIR", "off")
    assert disk_cache.directory() is None
    monkeypatch.delenv("SPARSEBLOCKS_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert disk_cache.directory() == os.path.join(str(tmp_path), "sparseblocks")


def test_a_saved_kernel_loads_and_a_missing_one_misses(tmp_path):
    cache = disk_cache.KernelCache("maker(1, 2)", str(tmp_path), rebuild=lambda **payload: payload)
    assert cache.load_overload(("int64",), None) is None
    cache.save_overload(("int64",), _Reducible({"name": "k", "code": b"\x00\x01"}))
    assert cache.load_overload(("int64",), None) == {"name": "k", "code": b"\x00\x01"}
    assert cache.load_overload(("float32",), None) is None  # another signature
    other = disk_cache.KernelCache("maker(1, 3)", str(tmp_path), rebuild=lambda **payload: payload)
    assert other.load_overload(("int64",), None) is None  # another key
    assert [name for name in os.listdir(tmp_path) if name.endswith(".part")] == []  # renamed into place


def test_the_source_is_part_of_the_name(monkeypatch, tmp_path):
    cache = disk_cache.KernelCache("maker()", str(tmp_path))
    first = cache.path(("int64",))
    monkeypatch.setattr(disk_cache, "_source_digest", "an edited build")
    assert cache.path(("int64",)) != first


def _package(root, files):
    """A package ``pkg`` of ``files`` (name -> source) under ``root``, as the digest's world."""
    for name, source in files.items():
        path = root / "pkg" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(source)


def _as_root(monkeypatch, root):
    monkeypatch.setattr(disk_cache, "_ROOT", str(root / "pkg"))
    monkeypatch.setattr(disk_cache, "_PACKAGE", "pkg")
    for name, empty in (("_modules", None), ("_imports", {}), ("_digests", {}), ("_source_digest", None)):
        monkeypatch.setattr(disk_cache, name, empty)


def _edited(monkeypatch, root, name, line):
    path = root / "pkg" / name
    path.write_text(path.read_text() + line)
    monkeypatch.setattr(disk_cache, "_digests", {})
    monkeypatch.setattr(disk_cache, "_imports", {})


def test_a_kernels_name_counts_the_sources_it_reaches_and_no_others(monkeypatch, tmp_path):
    """A kernel made in ``pkg.ops.kernels`` names the files its imports reach (followed through
    modules, a package's own ``__init__`` on the way, an imported package's imports); an edit of
    another file keeps its name, an edit of a reached one changes it."""
    _package(tmp_path, {
        "__init__.py": "from .layout import Layout\n",
        "layout.py": "",
        "ptx/__init__.py": "from . import mma\n",
        "ptx/mma.py": "",
        "ptx/wgmma.py": "",
        "ops/__init__.py": "from .api import call\n",
        "ops/api.py": "from .kernels import make\n",
        "ops/kernels.py": "import pkg.ptx.wgmma\nfrom .device import helper\n\ndef make():\n    from .. import ptx\n",
        "ptx/tma.py": "",
        "ops/device.py": "from ..runtime import flag\n",
        "runtime.py": "",
        "other/__init__.py": "",
        "other/kernels.py": "from ..ops.device import helper\n",
    })
    _as_root(monkeypatch, tmp_path)
    assert disk_cache.reach("pkg.ops.kernels") == {
        "pkg", "pkg.ops", "pkg.ops.kernels", "pkg.ops.device", "pkg.runtime", "pkg.ptx", "pkg.ptx.mma",
        "pkg.ptx.wgmma", "pkg.ptx.tma"}  # (``ptx`` bound as a name: any of its modules an attribute away)
    assert disk_cache.reach("pkg.other.kernels") == {"pkg", "pkg.other", "pkg.other.kernels", "pkg.ops",
                                                       "pkg.ops.device", "pkg.runtime"}
    first = disk_cache.source_digest("pkg.ops.kernels")
    for name in ("ops/api.py", "other/kernels.py", "layout.py"):
        _edited(monkeypatch, tmp_path, name, "x = 1\n")
        assert disk_cache.source_digest("pkg.ops.kernels") == first, name
    for name in ("ops/device.py", "ptx/mma.py", "ops/__init__.py", "runtime.py"):
        _edited(monkeypatch, tmp_path, name, "y = 2\n")
        assert disk_cache.source_digest("pkg.ops.kernels") != first, name
        first = disk_cache.source_digest("pkg.ops.kernels")


def test_reach_covers_every_name_a_module_holds():
    """What the imports' reading finds against what each module of the package really holds:
    every module, function, class and kernel of the package among a module's names comes from
    a module `reach` finds (so no edit of a kernel's source can keep its old name)."""
    import importlib
    import types

    for module in sorted(disk_cache.modules()):
        if module.endswith("__main__") or (module.startswith("sparseblocks.torch") and
                                           importlib.util.find_spec("torch") is None):
            continue
        names = vars(importlib.import_module(module))
        reached = disk_cache.reach(module)
        for name, value in names.items():
            if isinstance(value, types.ModuleType):
                owner = value.__name__
                if owner.startswith(module + "."):  # (a package's submodules, set by whoever imported them)
                    continue
            else:
                owner = getattr(getattr(value, "py_func", value), "__module__", None)
                if not (isinstance(value, (types.FunctionType, type)) or hasattr(value, "py_func")):
                    continue
            if owner and owner.split(".")[0] == "sparseblocks" and owner in disk_cache.modules():
                assert owner in reached, f"{module}.{name} comes from {owner}, which reach({module}) misses"


def test_a_keys_functions_and_configs_count_their_modules():
    from sparseblocks.bsmm.config import DEFAULT
    from sparseblocks.ptx import wgmma

    found = disk_cache.key_modules((DEFAULT, "float16", [(wgmma.fence, 2)], {"f": len}))
    assert found == {type(DEFAULT).__module__, wgmma.fence.__module__} or found == {
        type(DEFAULT).__module__, getattr(wgmma.fence, "py_func", wgmma.fence).__module__}


def test_an_unreadable_file_misses(tmp_path):
    cache = disk_cache.KernelCache("maker()", str(tmp_path), rebuild=lambda **payload: payload)
    with open(cache.path(("int64",)), "wb") as f:
        f.write(pickle.dumps({"name": "k"})[:5])  # (a crashed writer's half file)
    assert cache.load_overload(("int64",), None) is None


def test_what_numba_cannot_reduce_is_not_kept(tmp_path):
    class Unreducible:
        def _reduce_states(self):
            raise pickle.PicklingError("a global device array")

    cache = disk_cache.KernelCache("maker()", str(tmp_path))
    cache.save_overload(("int64",), Unreducible())
    assert os.listdir(tmp_path) == []


def test_an_unwritable_directory_is_no_error(tmp_path):
    blocked = tmp_path / "file"
    blocked.write_text("")
    cache = disk_cache.KernelCache("maker()", str(blocked / "below"))
    cache.save_overload(("int64",), _Reducible({"name": "k"}))  # (no directory can be made there)


def _make_scaler(factor):
    @cuda.jit
    def scale(out, x):
        i = cuda.grid(1)
        if i < x.shape[0]:
            out[i] = x[i] * factor

    return scale


@pytest.mark.gpu
@pytest.mark.skipif(SIMULATOR, reason="the cache is off in the simulator, which compiles nothing")
def test_a_fresh_process_loads_the_compiled_kernel(monkeypatch, tmp_path):
    monkeypatch.setenv("SPARSEBLOCKS_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(compile_cache, "_kernels", {})
    x = cuda.to_device(np.arange(100, dtype=np.float32))
    out = cuda.device_array(100, np.float32)
    first = compile_cache.cached(_make_scaler, 3.0)
    first[1, 128](out, x)
    assert np.array_equal(out.copy_to_host(), 3 * np.arange(100, dtype=np.float32))
    assert len([name for name in os.listdir(tmp_path) if name.endswith(".kernel")]) == 1
    monkeypatch.setattr(compile_cache, "_kernels", {})  # (as a new process finds it)
    again = compile_cache.cached(_make_scaler, 3.0)
    assert again is not first
    out = cuda.device_array(100, np.float32)
    again[1, 128](out, x)
    assert np.array_equal(out.copy_to_host(), 3 * np.arange(100, dtype=np.float32))
    assert sum(again._cache_hits.values()) == 1 and sum(again._cache_misses.values()) == 0
    other = compile_cache.cached(_make_scaler, 2.0)  # another key: compiled, not loaded
    other[1, 128](out, x)
    assert np.array_equal(out.copy_to_host(), 2 * np.arange(100, dtype=np.float32))
    assert sum(other._cache_hits.values()) == 0
