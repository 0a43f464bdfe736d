"""Compiled-kernel cache for our CuTe DSL kernels (the sm90 forward and backward; the sm100
backend uses FlashAttention-4's own cache).

A :class:`KernelCache` maps a static compile key (a tuple of dtype names, head dims, threshold,
flags, arch: never a dynamic size) to a compiled TVM-FFI function. A miss compiles through the
caller's ``build`` function, except while the current CUDA stream is capturing a graph: then
it raises, because compiling (and module loading) inside a capture is not capturable; run the
op once eagerly (or call ``mla_inductor.precompile``) before capturing.

On-disk cache, on by default: compiled kernels are exported as object files to
``<dir>/<fingerprint>/<name>_<sha256(name, key)>.o`` and loaded back on a later miss, in this
process or another. ``<dir>`` is :func:`cache_dir`: ``$XDG_CACHE_HOME/mla_inductor`` (or
``~/.cache/mla_inductor``); the environment variable ``MLA_INDUCTOR_KERNEL_CACHE`` names another
folder, and an empty value or ``0`` turns the disk cache off. The fingerprint hashes this
package's kernel sources and the CuTe DSL version (read from the package metadata), so an edit
or an upgrade never loads a stale binary. Each file is written under a temporary name unique to the process and thread, then
renamed over the final name, so processes filling one folder at once never see a partial file.
A file that fails to load is rebuilt and overwritten. A folder that cannot be written (read-only,
full, a path through a regular file) gives one warning per folder; kernels are then compiled in
memory and that folder is no longer written by this process.
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
    """The function ``fn_name`` of the object file at ``path``; raises if it cannot be loaded."""
    import cutlass.cute as cute

    return cute.runtime.load_module(str(path), enable_tvm_ffi=True)[fn_name]


def _write(root: pathlib.Path, path: pathlib.Path, fn, fn_name: str) -> None:
    """Exports ``fn`` to ``path`` through a temporary file; on failure warns once per ``root``."""
    tmp = path.with_name(f"{path.name}.{os.getpid()}-{threading.get_ident()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fn.export_to_c(object_file_path=str(tmp), function_name=fn_name)
        os.replace(tmp, path)
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
        path = root / _fingerprint() / f"{fn_name}.o"
        if path.exists():
            try:
                return _load(path, fn_name)
            except Exception:  # corrupt or incompatible file: rebuilt and overwritten below
                pass
        fn = build()
        if root not in _unwritable:
            _write(root, path, fn, fn_name)
        return fn
