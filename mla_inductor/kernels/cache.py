"""Compiled-kernel cache for our CuTe DSL kernels (shared by the sm90 and sm100 modules).

A :class:`KernelCache` maps a static compile key (a tuple of dtype names, head dims, threshold,
flags, arch: never a dynamic size) to a compiled TVM-FFI function. A miss compiles through the
caller's ``build`` function, except while the current CUDA stream is capturing a graph: then
it raises, because compiling (and module loading) inside a capture is not capturable; run the
op once eagerly (or call ``mla_inductor.precompile``) before capturing.

Optional disk cache: when the environment variable ``MLA_INDUCTOR_KERNEL_CACHE`` names a
directory, compiled kernels are exported there as object files
(``<dir>/<fingerprint>/<name>-<sha256(key)>.o``) and loaded back on a later miss. The
fingerprint hashes this package's kernel sources and the CuTe DSL version, so an edit or an
upgrade never loads a stale binary. A file that fails to load is treated as a miss.
"""

from __future__ import annotations

import hashlib
import os
import pathlib
import threading
from typing import Callable, Hashable

import torch

DISK_CACHE_ENV = "MLA_INDUCTOR_KERNEL_CACHE"


class CompileDuringCaptureError(RuntimeError):
    """A kernel would have been compiled while a CUDA graph was being captured."""


def _fingerprint() -> str:
    import cutlass

    h = hashlib.sha256(getattr(cutlass, "__version__", "unknown").encode())
    for path in sorted(pathlib.Path(__file__).parent.rglob("*.py")):
        h.update(path.read_bytes())
    return h.hexdigest()[:16]


class KernelCache:
    """In-memory (and optionally on-disk) map from static compile key to compiled function."""

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
        """Returns the compiled function for ``key``, compiling it with ``build()`` on a miss.

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
        root = os.environ.get(DISK_CACHE_ENV)
        if not root:
            return build()
        import cutlass.cute as cute

        digest = hashlib.sha256(repr((self.name, key)).encode()).hexdigest()[:24]
        fn_name = f"{self.name}_{digest}"
        path = pathlib.Path(root) / _fingerprint() / f"{fn_name}.o"
        if path.exists():
            try:
                return cute.runtime.load_module(str(path), enable_tvm_ffi=True)[fn_name]
            except Exception:  # corrupt or incompatible file: rebuild below
                pass
        fn = build()
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        fn.export_to_c(object_file_path=str(tmp), function_name=fn_name)
        os.replace(tmp, path)
        return fn
