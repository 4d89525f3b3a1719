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
