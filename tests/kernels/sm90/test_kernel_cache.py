"""The on-disk kernel cache: where it lives, turning it off, unwritable folders, corrupt files and
processes filling it at once. Kernels here are stand-ins that export a few bytes; the real
export/load round trip is in ``tests/kernels/sm90/test_precompile_sm90.py``."""

from __future__ import annotations

import errno
import os
import pathlib
import subprocess
import sys
import time
import warnings

import pytest

pytest.importorskip("cutlass.cute")

from mla_inductor.kernels import cache  # noqa: E402
from mla_inductor.kernels.cache import DISK_CACHE_ENV, KernelCache, cache_dir  # noqa: E402

MAGIC = b"fake kernel "


class FakeKernel:
    """A compiled function stand-in: ``export_to_c`` writes ``MAGIC + function_name``, pausing
    ``pause`` seconds halfway (a slow disk), or raising ``fail_with`` there (a disk that fills)."""

    def __init__(self, fail_with: OSError | None = None, pause: float = 0.0):
        self.exports: list[str] = []
        self.fail_with = fail_with
        self.pause = pause

    def export_to_c(self, object_file_path: str, function_name: str) -> None:
        self.exports.append(object_file_path)
        with open(object_file_path, "wb") as f:
            f.write(MAGIC)
            f.flush()
            if self.fail_with is not None:
                raise self.fail_with
            time.sleep(self.pause)
            f.write(function_name.encode())


def fake_load(path: pathlib.Path, fn_name: str):
    """The loader's contract for FakeKernel files: raises on anything but a complete file."""
    data = path.read_bytes()
    if data != MAGIC + fn_name.encode():
        raise RuntimeError(f"not a valid object file: {data[:20]!r}")
    return ("loaded", fn_name)


class Builds:
    """A ``build`` callable that counts its calls and returns a fresh FakeKernel each time."""

    def __init__(self, **kernel_kwargs):
        self.kernels: list[FakeKernel] = []
        self.kernel_kwargs = kernel_kwargs

    def __call__(self) -> FakeKernel:
        self.kernels.append(FakeKernel(**self.kernel_kwargs))
        return self.kernels[-1]


@pytest.fixture
def disk(tmp_path, monkeypatch):
    """The disk cache in ``tmp_path/cache``, no folder marked unwritable."""
    monkeypatch.setenv(DISK_CACHE_ENV, str(tmp_path / "cache"))
    monkeypatch.setattr(cache, "_unwritable", set())
    return tmp_path / "cache"


def files(root: pathlib.Path) -> list[pathlib.Path]:
    return sorted(p for p in root.rglob("*") if p.is_file()) if root.exists() else []


def test_default_folder_follows_xdg_cache_home_then_home(tmp_path, monkeypatch):
    monkeypatch.delenv(DISK_CACHE_ENV, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_dir() == tmp_path / "xdg" / "mla_inductor"
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    for xdg in ("", "relative/path"):  # the XDG spec ignores a relative path
        monkeypatch.setenv("XDG_CACHE_HOME", xdg)
        assert cache_dir() == tmp_path / "home" / ".cache" / "mla_inductor"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert cache_dir() == tmp_path / "home" / ".cache" / "mla_inductor"


def test_env_var_names_another_folder_or_turns_it_off(tmp_path, monkeypatch):
    monkeypatch.setenv(DISK_CACHE_ENV, str(tmp_path / "elsewhere"))
    assert cache_dir() == tmp_path / "elsewhere"
    for off in ("", "0", " 0 "):
        monkeypatch.setenv(DISK_CACHE_ENV, off)
        assert cache_dir() is None


def test_disabled_cache_builds_every_time_and_writes_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv(DISK_CACHE_ENV, "0")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setenv("HOME", str(tmp_path))
    build = Builds()
    for _ in range(2):
        assert KernelCache("off").get(("k",), build) is build.kernels[-1]
    assert len(build.kernels) == 2 and build.kernels[0].exports == []
    assert files(tmp_path) == []


def test_a_built_kernel_is_written_once_and_loaded_by_a_later_cache(disk, monkeypatch):
    monkeypatch.setattr(cache, "_load", fake_load)
    build = Builds()
    first = KernelCache("k").get(("bf16", 576), build)
    assert first is build.kernels[0]
    [path] = files(disk)
    assert path.parent.parent == disk and path.name.startswith("k_") and path.suffix == ".o"
    assert path.parent.name == cache._fingerprint()
    assert KernelCache("k").get(("bf16", 576), build) == ("loaded", path.stem)
    assert len(build.kernels) == 1
    KernelCache("k").get(("fp16", 576), build)  # another key: another file
    assert len(build.kernels) == 2 and len(files(disk)) == 2


def test_corrupt_file_is_rebuilt_and_overwritten(disk):
    build = Builds()
    KernelCache("k").get(("key",), build)
    [path] = files(disk)
    path.write_bytes(b"\x7fELF truncated")
    rebuilt = KernelCache("k").get(("key",), build)  # the real CuTe DSL loader rejects the file
    assert rebuilt is build.kernels[1]
    assert fake_load(path, path.stem) == ("loaded", path.stem)  # overwritten with a whole file
    assert files(disk) == [path]


def test_unwritable_folder_warns_once_and_compiles_in_memory(tmp_path, monkeypatch):
    blocker = tmp_path / "a-file"
    blocker.write_bytes(b"")
    root = blocker / "cache"  # its parent is a regular file: mkdir fails even for root
    monkeypatch.setenv(DISK_CACHE_ENV, str(root))
    monkeypatch.setattr(cache, "_unwritable", set())
    build = Builds()
    with pytest.warns(UserWarning, match="cannot write the kernel cache in .*a-file/cache") as caught:
        assert KernelCache("k").get(("one",), build) is build.kernels[0]
    assert len(caught) == 1 and "Not a directory" in str(caught[0].message)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert KernelCache("k").get(("two",), build) is build.kernels[1]
    assert build.kernels[1].exports == []  # no second attempt to write that folder
    assert blocker.read_bytes() == b""


def test_full_disk_leaves_no_partial_file(disk):
    build = Builds(fail_with=OSError(errno.ENOSPC, "No space left on device"))
    with pytest.warns(UserWarning, match=f"cannot write the kernel cache in {disk}.*No space left"):
        assert KernelCache("k").get(("key",), build) is build.kernels[0]
    assert build.kernels[0].exports and files(disk) == []


CHILD = """
import pathlib, sys, threading, time, warnings
from mla_inductor.kernels import cache

sys.path.insert(0, {tests!r})
from test_kernel_cache import FakeKernel, fake_load

loads, corrupt = [], []
def load(path, fn_name):
    try:
        loads.append(fake_load(path, fn_name))
        return loads[-1]
    except RuntimeError:
        corrupt.append(path)
        raise
cache._load = load
warnings.simplefilter("error", UserWarning)  # a failed write would warn

ready = pathlib.Path({ready!r})
(ready / str({index})).touch()
while len(list(ready.iterdir())) < {children}:
    time.sleep(0.01)
results = []
def fill():
    kernels = cache.KernelCache("race")  # one per thread: no sharing in memory
    for key in range({keys}):
        results.append(kernels.get((key,), lambda: FakeKernel(pause=0.002)))
threads = [threading.Thread(target=fill) for _ in range(2)]
for t in threads:
    t.start()
for t in threads:
    t.join()
assert len(results) == 2 * {keys} and not corrupt, (results, corrupt)
print("loaded", len(loads))
"""


@pytest.mark.slow
def test_processes_filling_the_cache_at_once(tmp_path):
    root, ready = tmp_path / "cache", tmp_path / "ready"
    ready.mkdir()
    children, keys = 3, 10
    env = {**os.environ, DISK_CACHE_ENV: str(root)}
    tests = str(pathlib.Path(__file__).parent)
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", CHILD.format(tests=tests, ready=str(ready), index=i, children=children, keys=keys)],
            cwd=pathlib.Path(__file__).parents[3], env=env, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, text=True,
        )
        for i in range(children)
    ]
    outputs = [p.communicate(timeout=120)[0] for p in procs]
    assert [p.returncode for p in procs] == [0] * children, outputs
    written = files(root)  # one intact file per key, no temporary left behind
    assert len(written) == keys and all(p.suffix == ".o" for p in written)
    for path in written:
        assert fake_load(path, path.stem) == ("loaded", path.stem)
