"""Compiled-kernel cache for our CuTe DSL kernels (each launcher of :mod:`mla_inductor.kernels.sm90`
keeps one; the sm100 backend uses FlashAttention-4's own cache).

A :class:`KernelCache` maps a static compile key (a tuple of dtype names, head dims, threshold,
flags, arch: never a dynamic size) to a compiled TVM-FFI function. A miss compiles through the
caller's ``build`` function, except while the current CUDA stream is capturing a graph: then
it raises, because compiling (and module loading) inside a capture is not capturable; run the
op once eagerly (or call ``mla_inductor.precompile``) before capturing.

On-disk cache, on by default: a compiled kernel is exported as an object file,
``<dir>/<fingerprint>/<fn>.o`` with ``<fn> = <name>_<sha256(name, key)>``, and linked from it
into a shared library, ``<dir>/<fingerprint>/<fn>.<tag>.so`` (:mod:`.sharedlib`: the system C
compiler, ``cc -shared``, against the CuTe DSL's runtime library and libtvm_ffi, their folders
as its run path; ``<tag>`` hashes where this environment's CuTe DSL package and libtvm_ffi
live, so environments sharing a folder each link their own). ``<dir>`` is :func:`cache_dir`:
``$XDG_CACHE_HOME/mla_inductor`` (or ``~/.cache/mla_inductor``); the environment variable
``MLA_INDUCTOR_KERNEL_CACHE`` names another folder, and an empty value or ``0`` turns the disk
cache off. The fingerprint hashes this package's kernel sources and the CuTe DSL version (read
from the package metadata), so an edit or an upgrade never loads a stale binary.

A miss in memory then loads, in this order: (1) the shared library, with ``tvm_ffi.load_module``
alone: no ``import cutlass`` (1-2 s of a warm start), no JIT link; this is the warm path, and
nothing on it imports the CuTe DSL (the launchers import it only to compile, the fingerprint
reads its version from the metadata, :func:`mla_inductor.kernels.sm90.available` uses
``find_spec``); (2) else the object file, through ``cutlass.cute.runtime.load_module`` (the CuTe
DSL and its JIT linker), after which the shared library is linked from it for the next process;
(3) else it compiles (``build()``) and writes both files. Without a C compiler or the runtime
libraries, or when linking fails (logged at INFO on the ``mla_inductor`` logger), only the object
file is written and loaded, as before the shared libraries; the op never fails for it.

Each file is written under a temporary name unique to the process and thread, then renamed over
the final name, so processes filling one folder at once never see a partial file. A file that
fails to load (corrupt, or a library linked against files that are gone) is rebuilt and
overwritten. A folder that cannot be written (read-only, full, a path through a regular file)
gives one warning per folder; kernels are then compiled in memory and that folder is no longer
written by this process.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.metadata
import os
import pathlib
import threading
import warnings
from typing import Callable, Hashable

import torch

from ..logs import log
from . import sharedlib

DISK_CACHE_ENV = "MLA_INDUCTOR_KERNEL_CACHE"

_unwritable: set[pathlib.Path] = set()
_unwritable_lock = threading.Lock()


class CompileDuringCaptureError(RuntimeError):
    """A kernel would have been compiled while a CUDA graph was being captured."""


def cache_dir() -> pathlib.Path | None:
    """The on-disk kernel cache folder, or ``None`` when the disk cache is off.

    ``MLA_INDUCTOR_KERNEL_CACHE`` unset: ``$XDG_CACHE_HOME/mla_inductor`` when
    ``XDG_CACHE_HOME`` is an absolute path, else ``~/.cache/mla_inductor``. Set to ``""`` or
    ``"0"`` (surrounding spaces ignored): ``None``. Set to anything else: that folder (``~``
    expanded). Read on every call; nothing is created here.
    """
    value = os.environ.get(DISK_CACHE_ENV)
    if value is not None:
        value = value.strip()
        return None if value in ("", "0") else pathlib.Path(value).expanduser()
    base = os.environ.get("XDG_CACHE_HOME", "")
    if not os.path.isabs(base):
        base = os.path.join(os.path.expanduser("~"), ".cache")
    return pathlib.Path(base) / "mla_inductor"


def _fingerprint() -> str:
    """Hash of the kernel sources and the CuTe DSL version (from the package metadata: reading
    it does not import the DSL)."""
    try:
        version = importlib.metadata.version("nvidia-cutlass-dsl")
    except importlib.metadata.PackageNotFoundError:
        version = "unknown"
    h = hashlib.sha256(version.encode())
    for path in sorted(pathlib.Path(__file__).parent.rglob("*.py")):
        h.update(path.read_bytes())
    return h.hexdigest()[:16]


def _load(path: pathlib.Path, fn_name: str) -> Callable:
    """The function ``fn_name`` of the object file at ``path``, through the CuTe DSL (which
    this imports); raises if it cannot be loaded."""
    import cutlass.cute as cute

    return cute.runtime.load_module(str(path), enable_tvm_ffi=True)[fn_name]


def _temporary(path: pathlib.Path) -> pathlib.Path:
    """A name next to ``path`` unique to this process and thread."""
    return path.with_name(f"{path.name}.{os.getpid()}-{threading.get_ident()}.tmp")


def _link(obj: pathlib.Path, lib: pathlib.Path) -> bool:
    """Links the object file ``obj`` into the shared library ``lib`` through a temporary file;
    on failure (no C compiler, a compiler error, a full disk) logs why and returns False."""
    tmp = _temporary(lib)
    try:
        sharedlib.link(obj, tmp)
        os.replace(tmp, lib)
        return True
    except Exception as error:
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
        log.info("kernel cache: no shared library %s (%s); its kernel loads from the object "
                 "file, through the CuTe DSL", lib, error)
        return False


def _write(root: pathlib.Path, obj: pathlib.Path, lib: pathlib.Path | None, fn,
           fn_name: str) -> None:
    """Exports ``fn`` to the object file ``obj`` and, when ``lib`` is given, links it into that
    shared library, each through a temporary file; a failure to write the object file warns once
    per ``root``, a failure to link only logs (see :func:`_link`)."""
    tmp = _temporary(obj)
    try:
        obj.parent.mkdir(parents=True, exist_ok=True)
        fn.export_to_c(object_file_path=str(tmp), function_name=fn_name)
        if lib is not None:
            _link(tmp, lib)
        os.replace(tmp, obj)
    except Exception as error:  # a full or read-only disk must not fail the op
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
        with _unwritable_lock:
            first = root not in _unwritable
            _unwritable.add(root)
        if first:
            warnings.warn(
                f"mla_inductor: cannot write the kernel cache in {root} ({error}); compiling "
                f"kernels in memory only (set {DISK_CACHE_ENV} to another folder, or to 0 to "
                "turn the disk cache off)",
                stacklevel=2,
            )


class KernelCache:
    """In-memory and on-disk map from static compile key to compiled function."""

    def __init__(self, name: str):
        self.name = name
        self._mem: dict[Hashable, Callable] = {}
        self._lock = threading.Lock()

    def __contains__(self, key: Hashable) -> bool:
        return key in self._mem

    def __len__(self) -> int:
        return len(self._mem)

    def items(self):
        """The in-memory ``(key, compiled function)`` pairs."""
        return self._mem.items()

    def get(self, key: Hashable, build: Callable[[], Callable]) -> Callable:
        """Returns the compiled function for ``key``: from memory, else from disk, else ``build()``.

        A built function is exported to the disk cache (see the module docstring); a failure to
        write it warns once per folder and is otherwise ignored.

        Raises:
            CompileDuringCaptureError: on a miss while a CUDA graph is being captured.
        """
        fn = self._mem.get(key)
        if fn is not None:
            return fn
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            raise CompileDuringCaptureError(
                f"{self.name}: kernel {key} is not compiled yet and a CUDA graph is being "
                "captured; run the op once outside the capture (or call "
                "mla_inductor.precompile) first"
            )
        with self._lock:
            fn = self._mem.get(key)
            if fn is None:
                fn = self._load_or_build(key, build)
                self._mem[key] = fn
        return fn

    def _load_or_build(self, key: Hashable, build: Callable[[], Callable]) -> Callable:
        root = cache_dir()
        if root is None:
            return build()
        digest = hashlib.sha256(repr((self.name, key)).encode()).hexdigest()[:24]
        fn_name = f"{self.name}_{digest}"
        folder = root / _fingerprint()
        obj = folder / f"{fn_name}.o"
        tag = sharedlib.environment_tag()
        lib = None if tag is None else folder / f"{fn_name}.{tag}.so"
        if lib is not None and lib.exists():
            try:
                return sharedlib.load(lib, fn_name)  # the warm path: no CuTe DSL
            except Exception:  # corrupt, or its runtime libraries are gone: relinked below
                pass
        if obj.exists():
            try:
                fn = _load(obj, fn_name)
            except Exception:  # corrupt or incompatible file: rebuilt and overwritten below
                pass
            else:
                if lib is not None and root not in _unwritable:
                    _link(obj, lib)  # so that the next process need not import the CuTe DSL
                return fn
        fn = build()
        if root not in _unwritable:
            _write(root, obj, lib, fn, fn_name)
        return fn
