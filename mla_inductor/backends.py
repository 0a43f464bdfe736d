"""Backend table and selection.

Names: ``auto`` (default: the fastest backend that runs on the tensors' device), ``reference``
(PyTorch, any device), ``emulate`` (the GPU kernels' online-softmax arithmetic in PyTorch, any
device), ``sm90`` (our Hopper CuTe DSL kernels), ``sm100`` (FlashAttention-4's Blackwell kernels).

The choice comes from :func:`use_backend` (innermost wins) or else the environment variable
``MLA_INDUCTOR_BACKEND``, read at call time. Under ``torch.compile`` the choice is made when the
compiled code runs, not when it is traced.

``auto`` on a CUDA device that no kernel backend covers for the problem (compute capability,
float32, shape, a package that is missing or cannot run, an op the backend has no kernel for)
uses the reference and warns, once per
distinct direction and reason, that it does so and that the reference is much slower. On any
other device the reference is the right backend and ``auto`` picks it without a warning.
"""

from __future__ import annotations

import contextlib
import contextvars
import importlib
import os
import warnings
from types import ModuleType

import torch

NAMES = ("auto", "reference", "emulate", "sm90", "sm100")
ENV_VAR = "MLA_INDUCTOR_BACKEND"

_override: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "mla_inductor_backend", default=None
)
_warned: set[tuple[str, str]] = set()  # (direction, reason) pairs already warned about
# The directions whose kernels take float32 tensors (the indexer loss's KL of float32 logits).
FLOAT32_DIRECTIONS = frozenset(("indexer_kl", "indexer_kl_bwd"))


def _check_name(name: str, where: str) -> str:
    """``name`` if it is one of :data:`NAMES`; ``where`` (what named it) leads the error."""
    if name not in NAMES:
        raise ValueError(
            f"{where}: unknown mla_inductor backend {name!r}; choose one of {', '.join(NAMES)}"
        )
    return name


def use_backend(name: str):
    """Context manager selecting the backend for the sparse-MLA ops run inside it.

    Enter it around a call, compiled or not: ``with use_backend("reference"): compiled(x)``.
    Under ``torch.compile`` the backend is chosen each time the compiled code runs, so one
    compiled function follows whatever ``use_backend`` is in force around it, without a
    recompile. Inside a compiled function it cannot be entered (Dynamo does not trace
    ``ContextVar.set``).

    Args:
        name: one of ``auto``, ``reference``, ``emulate``, ``sm90``, ``sm100``.

    Raises:
        ValueError: for an unknown name, when ``use_backend(name)`` is called (before its block
            is entered); the message starts ``use_backend:``. RuntimeError: when entered inside
            a function that ``torch.compile`` traces. A known backend that cannot run on the
            tensors' device raises ``RuntimeError`` (naming what is missing) when an op runs.
    """
    return _use_backend(_check_name(name, "use_backend"))


@contextlib.contextmanager
def _use_backend(name: str):
    """:func:`use_backend`'s context manager, for a checked ``name``."""
    if torch.compiler.is_compiling():
        raise RuntimeError(
            "sparse_mla: use_backend() cannot be entered inside a compiled function; enter it "
            "around the call of the compiled function (the backend is chosen when the compiled "
            "code runs)"
        )
    token = _override.set(name)
    try:
        yield
    finally:
        _override.reset(token)


def requested() -> str:
    """The backend name in force: the innermost :func:`use_backend`, else the environment.

    Raises:
        ValueError: when ``MLA_INDUCTOR_BACKEND`` names no backend (the message starts with the
            variable's name).
    """
    name = _override.get()
    if name is not None:
        return name
    return _check_name(os.environ.get(ENV_VAR, "auto").strip() or "auto", ENV_VAR)


def module(name: str) -> ModuleType:
    """The kernel module of a backend (``mla_inductor.kernels.<name>``).

    Raises:
        ValueError: for an unknown name; ImportError when the module cannot be imported.
    """
    return importlib.import_module(
        f"mla_inductor.kernels.{_check_name(name, 'mla_inductor.backends.module')}")


def _supports(candidate: ModuleType, dtype, direction: str, dims) -> tuple[bool, str]:
    if dims is None or not hasattr(candidate, "supports"):
        return True, ""
    return candidate.supports(dtype, direction, *dims)


def _fall_back(direction: str, reason: str) -> ModuleType:
    """The reference backend, with one ``UserWarning`` per distinct ``(direction, reason)``."""
    if (direction, reason) not in _warned:
        _warned.add((direction, reason))
        warnings.warn(
            f"mla_inductor: sparse-MLA {direction} falls back to the PyTorch reference backend, "
            f"which is much slower (often 50-100x): {reason}",
            stacklevel=4,
        )
    return module("reference")


def _auto(device: torch.device, dtype: torch.dtype, direction: str, dims,
          deterministic=None) -> ModuleType:
    if device.type != "cuda":
        return module("reference")
    if dtype == torch.float32 and direction not in FLOAT32_DIRECTIONS:
        return _fall_back(direction, "float32 input; the GPU kernels take bfloat16 or float16")
    major, minor = torch.cuda.get_device_capability(device)
    arch = "sm90" if (major, minor) == (9, 0) else "sm100" if major == 10 else None
    if arch is None:
        return _fall_back(direction, f"no sparse-MLA kernel for compute capability {major}.{minor}")
    try:
        candidate = module(arch)
    except ImportError as error:
        return _fall_back(direction, f"the {arch} backend cannot be imported ({error})")
    ok, reason = candidate.available()
    if ok and not hasattr(candidate, direction):
        ok, reason = False, f"the {arch} backend has no {direction} kernel yet"
    if ok:
        ok, reason = _supports(candidate, dtype, direction, dims)
    if not ok:
        return _fall_back(direction, reason)
    check_deterministic(arch, direction, deterministic)
    return candidate


def _op(direction: str) -> str:
    """The name an error of ``direction`` starts with: the op's."""
    if direction == "lightning_indexer":
        return "lightning_indexer"
    if direction.startswith("lightning_indexer_scores"):
        return "lightning_indexer_scores"
    return "sparse_mla"


def select(device: torch.device, dtype: torch.dtype, direction: str, dims=None, *,
           deterministic=None) -> ModuleType:
    """The backend module that runs ``direction`` (``"forward"``, ``"backward"``,
    ``"indexer_target"`` or ``"lightning_indexer"``: the protocol function of
    :mod:`mla_inductor.kernels` it calls).

    ``dims = (T, H, S, d_qk, d_v, features)`` (features: a frozenset of ``causal``, ``sink``,
    ``max_logits``, ``dlse``; ``d_v`` 0 for the indexer target and the lightning indexer, which
    read no values; the lightning indexer's T and S are per batch element and its d_qk is the
    index head width D) lets ``auto`` skip a kernel backend that does not support the
    problem (its ``supports()`` says why) in favour of the reference; a forced backend raises.
    Every such fallback of ``auto`` on a CUDA device warns (see the module docstring), and so
    does a forced backend without the function (the indexer target on sm100), which
    runs the reference; a forced backend without a backward pairs with the reference backward
    silently, and so does a forced ``emulate`` without the function (the lightning indexer,
    whose kernels' arithmetic, float32 scores and an exact selection, is the reference's): both
    are PyTorch on any device, so there is nothing to warn about. ``deterministic`` (None:
    ``torch.are_deterministic_algorithms_enabled()`` now) is what :func:`check_deterministic`
    checks.

    Raises:
        RuntimeError: when the requested backend cannot run here; the message names what is
            missing; or when it is not deterministic for ``direction`` and
            ``torch.use_deterministic_algorithms(True)`` is set (:func:`check_deterministic`).
    """
    name = requested()
    if name == "auto":
        return _auto(device, dtype, direction, dims, deterministic)
    try:
        chosen = module(name)
    except ImportError as error:
        raise RuntimeError(
            f"{_op(direction)}: mla_inductor backend {name!r} cannot run here: {error}"
        ) from error
    ok, reason = chosen.available()
    if ok and name in ("sm90", "sm100") and device.type != "cuda":
        ok, reason = False, f"the tensors are on {device.type}, not on a CUDA device"
    if (ok and name in ("sm90", "sm100") and dtype == torch.float32
            and direction not in FLOAT32_DIRECTIONS):
        ok, reason = False, "float32 runs on the reference backend only; use bfloat16 or float16"
    if ok and hasattr(chosen, direction):
        ok, reason = _supports(chosen, dtype, direction, dims)
    if not ok:
        raise RuntimeError(
            f"{_op(direction)}: mla_inductor backend {name!r} cannot run here: {reason}"
        )
    if not hasattr(chosen, direction) and name == "emulate":
        return module("reference")
    if direction == "backward" and not hasattr(chosen, direction):
        # A kernel backend without its own backward pairs with the reference backward, which
        # consumes the same (out, lse, o_lo).
        return module("reference")
    if not hasattr(chosen, direction):
        return _fall_back(direction, f"the {name} backend has no {direction} kernel yet")
    check_deterministic(name, direction, deterministic)
    return chosen


# The (backend, direction) pairs whose results may differ from run to run, and why. A
# deterministic path for one of them removes its entry.
NONDETERMINISTIC = {
    ("sm100", "backward"): "FlashAttention-4's sparse backward accumulates dkv with float32 "
                           "atomic adds",
}


def check_deterministic(name: str, direction: str, deterministic=None) -> None:
    """PyTorch's rule for an op without a deterministic implementation, for the backend ``name``
    running ``direction``: when ``deterministic`` (None: under
    ``torch.use_deterministic_algorithms(True)``) it raises (with ``warn_only=True`` it warns)
    in PyTorch's wording; otherwise, or for a pair that is not in :data:`NONDETERMINISTIC`
    (every backend but sm100's backward: the reference and emulate backends, sm90's
    fixed-point backwards, every forward, the indexer target), it does nothing.

    Raises:
        RuntimeError: the pair is non-deterministic and deterministic algorithms are on (not
            warn-only).
    """
    reason = NONDETERMINISTIC.get((name, direction))
    if deterministic is None:
        deterministic = torch.are_deterministic_algorithms_enabled()
    if reason is None or not deterministic:
        return
    message = (
        f"sparse_mla: the {name} {direction} does not have a deterministic implementation "
        f"({reason}), but you set 'torch.use_deterministic_algorithms(True)'. You can turn off "
        "determinism just for this operation, or you can use the 'warn_only=True' option, if "
        "that's acceptable for your application. The reference backend "
        "(mla_inductor.use_backend('reference')) is deterministic."
    )
    if torch.is_deterministic_algorithms_warn_only_enabled():
        warnings.warn(message, stacklevel=3)
        return
    raise RuntimeError(message)
