"""Shared libraries of exported CuTe DSL kernels, which TVM-FFI loads without the CuTe DSL.

A compiled kernel exported with ``export_to_c`` is an object file whose entry point
``__tvm_ffi_<name>`` calls into two runtime libraries: ``libcute_dsl_runtime.so`` (CUDA module
loading and launches, shipped in the ``nvidia-cutlass-dsl`` wheels; it opens libcuda itself, at
the first call) and ``libtvm_ffi.so`` (errors, the caller's stream). Loading the object file
back through ``cutlass.cute.runtime.load_module`` imports the CuTe DSL and links it in memory
with the DSL's JIT. :func:`link` turns the object file into a shared library instead, with the
system C compiler (``cc -shared``), linked against both runtime libraries with their folders
as its run path, so that :func:`load` opens it with ``tvm_ffi.load_module`` alone (the DSL's
documented AOT route: ``python -m cutlass.cute.export.aot_config``). Nothing here imports
``cutlass``.
"""

from __future__ import annotations

import functools
import glob
import hashlib
import importlib.util
import os
import pathlib
import shutil
import subprocess
import sys
from typing import Callable

RUNTIME_ENV = "CUTE_DSL_LIBS"  # the CuTe DSL's own override of its runtime library
RUNTIME_NAME = "libcute_dsl_runtime.so"
LINK_TIMEOUT_S = 120


class LinkError(RuntimeError):
    """No C compiler, no runtime library, or the compiler failed."""


def _package_folders() -> list[str]:
    """The folders of the ``nvidia_cutlass_dsl`` package (found without importing anything)."""
    try:
        spec = importlib.util.find_spec("nvidia_cutlass_dsl")
    except (ImportError, ValueError):
        return []
    if spec is None or not spec.submodule_search_locations:
        return []
    return sorted({os.path.realpath(folder) for folder in spec.submodule_search_locations})


def _libtvm_ffi() -> str | None:
    try:
        from tvm_ffi.libinfo import find_libtvm_ffi

        return os.path.realpath(find_libtvm_ffi())
    except Exception:  # not installed or not found
        return None


def _cute_dsl_runtime() -> str | None:
    """``libcute_dsl_runtime.so`` as the CuTe DSL finds it: the entry of ``$CUTE_DSL_LIBS`` with
    that name; else, when the DSL is already imported (it always is once a kernel was compiled
    or loaded from its object file), the one its JIT links against (it picks a toolkit flavour
    by the driver's version); else the one ``cu<N>/lib`` folder of the ``nvidia_cutlass_dsl``
    package that has it (None if several do). Never imports the DSL."""
    env = os.environ.get(RUNTIME_ENV, "")
    if env:
        named = [p for p in env.split(os.pathsep) if os.path.basename(p) == RUNTIME_NAME]
        return os.path.realpath(named[0]) if named and os.path.isfile(named[0]) else None
    runtime = sys.modules.get("cutlass.runtime")
    if runtime is not None:
        try:
            named = [p for p in runtime.find_runtime_libraries(enable_tvm_ffi=False)
                     if os.path.basename(p) == RUNTIME_NAME and os.path.isfile(p)]
        except Exception:
            named = []
        if named:
            return os.path.realpath(named[0])
    found = {os.path.realpath(p) for folder in _package_folders()
             for p in glob.glob(os.path.join(folder, "cu*", "lib", RUNTIME_NAME))}
    return found.pop() if len(found) == 1 else None


def runtime_libraries() -> tuple[str, str] | None:
    """The absolute paths of the runtime libraries a linked kernel needs
    (``libcute_dsl_runtime.so``, ``libtvm_ffi.so``), or None when one cannot be found."""
    runtime, tvm_ffi = _cute_dsl_runtime(), _libtvm_ffi()
    return None if runtime is None or tvm_ffi is None else (runtime, tvm_ffi)


@functools.lru_cache(maxsize=1)
def environment_tag() -> str | None:
    """A short hash of where this environment's CuTe DSL package and libtvm_ffi live (None
    without them), found without importing the DSL: part of a linked library's file name, so
    that environments sharing one kernel cache folder (same kernel sources, same CuTe DSL
    version, other installations) each link and load their own. Computed once per process."""
    folders, tvm_ffi = _package_folders(), _libtvm_ffi()
    if not folders or tvm_ffi is None:
        return None
    return hashlib.sha256("\0".join([*folders, tvm_ffi]).encode()).hexdigest()[:8]


def compiler() -> str | None:
    """The system C compiler driver (``cc``, else ``gcc``), or None."""
    return shutil.which("cc") or shutil.which("gcc")


def link(obj: pathlib.Path, out: pathlib.Path) -> None:
    """Links the exported object file ``obj`` into the shared library ``out`` (written in
    place: the caller gives a temporary name and renames it).

    Raises:
        LinkError: no C compiler or runtime library, or the compiler failed (its output in the
            message); every symbol must resolve against the runtime libraries (``-z defs``).
    """
    cc = compiler()
    libs = runtime_libraries()
    if cc is None or libs is None:
        raise LinkError("no C compiler" if cc is None else "CuTe DSL runtime libraries not found")
    folders = list(dict.fromkeys(os.path.dirname(lib) for lib in libs))
    command = [cc, "-shared", "-o", str(out), str(obj), *libs, "-Wl,-z,defs",
               *(f"-Wl,-rpath,{folder}" for folder in folders)]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=LINK_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as error:
        raise LinkError(f"{cc}: {error}") from error
    if done.returncode != 0:
        raise LinkError(f"{cc} exited with {done.returncode}: "
                        f"{(done.stderr or done.stdout).strip()[-1000:]}")


def load(path: pathlib.Path, fn_name: str) -> Callable:
    """The function ``fn_name`` (symbol ``__tvm_ffi_<fn_name>``) of the shared library at
    ``path``, which stays loaded for the rest of the process; raises if it cannot be loaded."""
    import tvm_ffi

    return tvm_ffi.load_module(str(path))[fn_name]
