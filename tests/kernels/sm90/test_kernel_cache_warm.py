"""The disk cache's warm path: a compiled kernel is also linked into a shared library, which a
fresh process loads with TVM-FFI alone, never importing the CuTe DSL (``cutlass``); without a C
compiler the object file is written and loaded through the DSL, as before. CPU only: the kernel
compiles for sm_90a without a GPU, and the DSL's runtime library opens libcuda only at a
kernel's first call, so loading works here too. The directory rules, concurrent writers and
unwritable folders are in ``tests/kernels/sm90/test_kernel_cache.py``. On an SM90 GPU one more test runs the
kernels a fresh process loaded from their libraries: on a side stream and in a CUDA graph."""

from __future__ import annotations

import os
import pathlib
import shutil
import subprocess
import sys
import warnings

import pytest
import torch

pytest.importorskip("cutlass.cute")

from mla_inductor.kernels import cache, sharedlib  # noqa: E402
from mla_inductor.kernels.cache import DISK_CACHE_ENV, KernelCache  # noqa: E402
from mla_inductor.kernels.sm90 import fwd_host  # noqa: E402
from mla_inductor.kernels.sm90.host import compile_for_arch  # noqa: E402

KEY = fwd_host.compile_key(torch.bfloat16, 512, 512, 8.0, False, False)  # a small forward
REPO = pathlib.Path(__file__).parents[3]

needs_linker = pytest.mark.skipif(
    sharedlib.compiler() is None or sharedlib.runtime_libraries() is None,
    reason="no C compiler (cc, gcc) or CuTe DSL runtime libraries: no shared libraries",
)

# In a fresh interpreter: the forward launcher's kernel for KEY from the disk cache, what it is,
# whether it takes our kernel's 12 arguments, and which CuTe DSL modules got imported.
WARM_START = f"""
import sys
import torch
from mla_inductor.kernels.sm90 import fwd_host

fn = fwd_host.get_kernel({KEY!r})
print(type(fn).__module__, type(fn).__name__)
try:
    fn()
except TypeError as error:
    print("Expects 12 parameters" in str(error))
print(sorted(m for m in sys.modules if m.split(".")[0] == "cutlass"))
"""


def run_fresh(code: str, **env: str) -> list[str]:
    """Runs ``code`` in a fresh interpreter (this repository as its working folder); returns
    its output lines."""
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, env={**os.environ, **env},
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout.splitlines()


@pytest.fixture(scope="module")
def compiled():
    """The forward kernel of KEY, compiled once for this module (for sm_90a, the key's arch)."""
    return compile_for_arch("fwd", "compile_forward", KEY)


@pytest.fixture
def disk(tmp_path, monkeypatch):
    """The disk cache in ``tmp_path/cache``, no folder marked unwritable."""
    monkeypatch.setenv(DISK_CACHE_ENV, str(tmp_path / "cache"))
    monkeypatch.setattr(cache, "_unwritable", set())
    return tmp_path / "cache"


def fill(compiled) -> None:
    """Writes ``compiled`` to the disk cache where the forward launcher looks for KEY."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a failed write would warn
        assert KernelCache(fwd_host._CACHE.name).get(KEY, lambda: compiled) is compiled


def cached(disk: pathlib.Path) -> tuple[pathlib.Path, pathlib.Path | None, str]:
    """The object file, the shared library (None if absent) and the function name for KEY."""
    [obj] = disk.rglob("*.o")
    libs = list(disk.rglob("*.so"))
    assert len(libs) <= 1 and not list(disk.rglob("*.tmp"))
    return obj, (libs[0] if libs else None), obj.stem


@needs_linker
def test_a_fresh_process_loads_the_shared_library_without_the_cute_dsl(compiled, disk):
    fill(compiled)
    obj, lib, fn_name = cached(disk)
    assert lib is not None and lib.name == f"{fn_name}.{sharedlib.environment_tag()}.so"
    assert lib.parent == obj.parent == disk / cache._fingerprint()
    assert run_fresh(WARM_START, **{DISK_CACHE_ENV: str(disk)}) == [
        "tvm_ffi.core Function", "True", "[]"]


@needs_linker
def test_the_shared_library_exports_the_entry_point_and_names_its_runtime(compiled, disk):
    fill(compiled)
    _, lib, fn_name = cached(disk)
    nm, readelf = shutil.which("nm"), shutil.which("readelf")
    if nm is None or readelf is None:
        pytest.skip("needs nm and readelf (binutils)")
    symbols = subprocess.run([nm, "-D", "--defined-only", str(lib)], capture_output=True,
                             text=True, check=True).stdout.split()
    assert f"__tvm_ffi_{fn_name}" in symbols  # what tvm_ffi.load_module(lib)[fn_name] looks up
    dynamic = subprocess.run([readelf, "-d", str(lib)], capture_output=True, text=True,
                             check=True).stdout
    for path in sharedlib.runtime_libraries():
        assert f"[{os.path.basename(path)}]" in dynamic  # NEEDED
        assert os.path.dirname(path) in dynamic  # RUNPATH: no LD_LIBRARY_PATH needed
    assert "libcuda" not in dynamic  # opened by the runtime library at the first launch


def test_without_a_c_compiler_the_object_file_is_written_and_loaded(compiled, disk,
                                                                     monkeypatch):
    monkeypatch.setattr(shutil, "which", lambda *args, **kwargs: None)
    assert sharedlib.compiler() is None
    fill(compiled)
    obj, lib, fn_name = cached(disk)
    assert lib is None and obj.stat().st_size > 0
    loaded = KernelCache(fwd_host._CACHE.name).get(KEY, lambda: pytest.fail("should load"))
    assert loaded is not compiled and callable(loaded)
    assert list(disk.rglob("*.so")) == []


@needs_linker
def test_an_object_file_without_its_library_is_linked_when_loaded(compiled, disk, monkeypatch):
    """A cache filled without a compiler (or by an environment whose runtime libraries live
    elsewhere) gets its shared library from the first process that loads the object file."""
    with monkeypatch.context() as without_cc:
        without_cc.setattr(shutil, "which", lambda *args, **kwargs: None)
        fill(compiled)
    loaded = KernelCache(fwd_host._CACHE.name).get(KEY, lambda: pytest.fail("should load"))
    assert callable(loaded)
    _, lib, fn_name = cached(disk)
    assert lib is not None and callable(sharedlib.load(lib, fn_name))
    assert run_fresh(WARM_START, **{DISK_CACHE_ENV: str(disk)})[-1] == "[]"


@needs_linker
def test_a_corrupt_library_is_relinked(compiled, disk):
    fill(compiled)
    _, lib, fn_name = cached(disk)
    lib.write_bytes(b"\x7fELF truncated")
    loaded = KernelCache(fwd_host._CACHE.name).get(KEY, lambda: pytest.fail("should load"))
    assert callable(loaded)  # from the object file
    assert callable(sharedlib.load(lib, fn_name))  # and the library linked again


def test_launchers_and_availability_do_not_import_the_cute_dsl():
    code = """
import sys
from unittest import mock
import torch
from mla_inductor.kernels import cache, sm90
from mla_inductor.kernels.sm90 import bwd_host, fwd_host, host, indexer_target_host
with mock.patch.object(torch.cuda, "is_available", lambda: True), \\
        mock.patch.object(torch.cuda, "get_device_capability", lambda device=None: (9, 0)):
    print(sm90.available())
print(cache._fingerprint() != "")
print(sorted(m for m in sys.modules if m.split(".")[0] == "cutlass"))
"""
    assert run_fresh(code) == ["(True, '')", "True", "[]"]


def test_the_runtime_library_is_the_one_the_cute_dsl_uses(tmp_path, monkeypatch):
    """$CUTE_DSL_LIBS first; else, with the DSL imported, what it links its JIT code against;
    else the package's only toolkit flavour, and none when there are several (the DSL picks one
    by the driver's version)."""
    import cutlass.runtime

    monkeypatch.delenv(sharedlib.RUNTIME_ENV, raising=False)
    [theirs] = [p for p in cutlass.runtime.find_runtime_libraries(enable_tvm_ffi=False)
                if p.endswith(sharedlib.RUNTIME_NAME)]
    assert sharedlib._cute_dsl_runtime() == os.path.realpath(theirs)
    package = tmp_path / "nvidia_cutlass_dsl"
    flavours = [package / f"cu{n}" / "lib" / sharedlib.RUNTIME_NAME for n in (12, 13)]
    for path in flavours:
        path.parent.mkdir(parents=True)
        path.write_bytes(b"")
    monkeypatch.setattr(sharedlib, "_package_folders", lambda: [str(package)])
    monkeypatch.delitem(sys.modules, "cutlass.runtime")  # as in a process that did not import it
    assert sharedlib._cute_dsl_runtime() is None
    flavours[1].unlink()
    assert sharedlib._cute_dsl_runtime() == os.path.realpath(flavours[0])
    monkeypatch.setenv(sharedlib.RUNTIME_ENV, os.pathsep.join(["/elsewhere/libfoo.so", theirs]))
    assert sharedlib._cute_dsl_runtime() == os.path.realpath(theirs)


# In a fresh interpreter, with the disk cache the parent filled: the training forward and the
# backward from their shared libraries, on a side stream and replayed from a CUDA graph.
GPU_WARM_START = """
import sys
import torch
from mla_inductor.kernels.sm90 import bwd_host, fwd_host

q, kv, indices, dout, out, lse, o_lo, dq, dkv = torch.load(sys.argv[1])
side = torch.cuda.Stream()
side.wait_stream(torch.cuda.current_stream())
with torch.cuda.stream(side):
    got = fwd_host.forward(q, kv, indices, None, None, None, 576**-0.5, 512, 0.0, True)
    got_dq, got_dkv, _ = bwd_host.backward(dout, None, q, kv, indices, None, None, None, out, lse,
                                           o_lo, 576**-0.5, 512)
torch.cuda.current_stream().wait_stream(side)
graph = torch.cuda.CUDAGraph()
with torch.cuda.graph(graph):
    in_graph = fwd_host.forward(q, kv, indices, None, None, None, 576**-0.5, 512, 0.0, True)
graph.replay()
torch.cuda.synchronize()
print(all(torch.equal(a, b) for a, b in zip((out, lse, o_lo), got[:3])))
print(all(torch.equal(a, b) for a, b in zip((out, lse, o_lo), in_graph[:3])))
print(torch.equal(dq, got_dq))
print(((got_dkv.float() - dkv.float()).norm() / dkv.float().norm()).item() < 1e-3)
print(sorted(m for m in sys.modules if m.split(".")[0] == "cutlass"))
"""


@pytest.mark.cuda
@pytest.mark.skipif(not (torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)),
                    reason="needs an SM90 GPU")
@needs_linker
def test_kernels_loaded_from_their_libraries_run_on_the_current_stream_and_in_a_graph(
        disk, tmp_path, monkeypatch):
    """The parent compiles (filling the disk cache) and computes a training forward and a
    backward; a fresh process loads both kernels from their shared libraries (no CuTe DSL) and
    must get the forward bitwise on a side stream and from a replayed CUDA graph, dq bitwise,
    and dkv (fp32 atomics: order-dependent) within 1e-3."""
    from mla_inductor.kernels.sm90 import bwd_host

    # fresh caches: kernels that earlier tests of this process compiled would be served from
    # memory and never reach this test's disk cache
    for launcher in (fwd_host, bwd_host):
        monkeypatch.setattr(launcher, "_CACHE", KernelCache(launcher._CACHE.name))
    g = torch.Generator(device="cuda").manual_seed(0)
    T, H, S, topk = 300, 128, 1024, 512
    q = torch.randn(T, H, 576, device="cuda", generator=g).bfloat16()
    kv = torch.randn(S, 576, device="cuda", generator=g).bfloat16()
    indices = torch.randint(0, S, (T, topk), device="cuda", generator=g, dtype=torch.int32)
    dout = torch.randn(T, H, 512, device="cuda", generator=g).bfloat16()
    out, lse, o_lo, _ = fwd_host.forward(q, kv, indices, None, None, None, 576**-0.5, 512, 0.0,
                                         True)
    dq, dkv, _ = bwd_host.backward(dout, None, q, kv, indices, None, None, None, out, lse, o_lo,
                                   576**-0.5, 512)
    assert len(list(disk.rglob("*.so"))) == 2  # the forward's and the backward's
    saved = tmp_path / "case.pt"
    torch.save((q, kv, indices, dout, out, lse, o_lo, dq, dkv), saved)
    done = subprocess.run([sys.executable, "-c", GPU_WARM_START, str(saved)], cwd=REPO,
                          env={**os.environ, DISK_CACHE_ENV: str(disk)}, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr  # also: a clean exit
    assert done.stdout.splitlines() == ["True", "True", "True", "True", "[]"]
