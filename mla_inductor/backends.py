"""The backend protocol (:class:`Backend`, the surface of every module of
:mod:`mla_inductor.kernels`) and the selection of a backend.

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
from typing import Optional, Protocol

import torch
from torch import Tensor

NAMES = ("auto", "reference", "emulate", "sm90", "sm100")
ENV_VAR = "MLA_INDUCTOR_BACKEND"

_override: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "mla_inductor_backend", default=None
)
_warned: set[tuple[str, str]] = set()  # (direction, reason) pairs already warned about
# The directions whose kernels take float32 tensors (the indexer loss's KL of float32 logits).
FLOAT32_DIRECTIONS = frozenset(("indexer_kl", "indexer_kl_bwd"))

# The members every backend module of this package has; the others of :class:`Backend` are
# optional.
REQUIRED = ("available", "forward", "backward")


class Backend(Protocol):
    """What a backend module (``mla_inductor.kernels.<name>``: ``reference``, ``emulate``,
    ``sm90``, ``sm100``) provides, each member a module-level function with this signature, so
    that :func:`select` dispatches by name and tests parametrise over backends. Every backend has
    :data:`REQUIRED`; the others are optional: :func:`select` falls back to the reference where a
    backend has no function for a direction (see its docstring), and ``supports`` missing means
    every problem is supported.
    """

    def available(self) -> tuple[bool, str]:
        """Whether the backend can run here; the string says what is missing when it cannot."""

    def supports(self, dtype: torch.dtype, direction: str, T: int, H: int, S: int, d_qk: int,
                 d_v: int, features: frozenset = frozenset()) -> tuple[bool, str]:
        """Whether the backend handles this problem (``auto`` falls back to the reference when
        not, a forced backend raises the reason). ``direction``: the member that would run it
        (``"forward"``, ``"backward"``, ``"indexer_target"``, ``"lightning_indexer"``,
        ``"lightning_indexer_scores"``, ...); ``T``, ``H``, ``S``: tokens, heads and keys (per
        batch element for the lightning indexer and its scores); ``d_qk``: the head width (the
        index head width D for the lightning indexer and its scores); ``d_v``: the value width, 0
        for the directions that read no values (the indexer target, the lightning indexer);
        ``features``: a frozenset of ``"causal"``, ``"sink"``, ``"max_logits"``, ``"dlse"``."""

    def forward(self, q: Tensor, kv: Tensor, indices: Tensor, topk_length: Optional[Tensor],
                q_positions: Optional[Tensor], attn_sink: Optional[Tensor], sm_scale: float,
                d_v: int, rescale_threshold: float, return_o_lo: bool,
                return_max_logits: bool) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """``q [T, H, d_qk]`` (bf16/fp16; fp32 on the reference path), last dim contiguous; ``kv
        [S, d_qk]`` same dtype, last dim contiguous; ``indices [T, topk]`` int32 contiguous (any
        value < 0 or >= S is an empty slot); ``topk_length [T]`` int32 or ``None`` (slots at
        positions >= topk_length[t] are empty); ``q_positions [T]`` int32 or ``None`` (causal: a
        slot whose index is greater than ``q_positions[t]`` is empty); ``attn_sink [H]`` float32
        or ``None`` (one logit per head, natural-log units, in the softmax denominator, no
        value). An empty slot is never read: no value of the row its index would name (NaN
        included) may reach a result. ``sm_scale`` float, ``d_v <= d_qk`` int,
        ``rescale_threshold`` float in log2 units (0.0 = exact running max; the op has checked it
        against :data:`mla_inductor.thresholds.MAX_RESCALE_THRESHOLD`), ``return_o_lo`` and
        ``return_max_logits`` bool. Returns contiguous ``out [T, H, d_v]`` in q's dtype, ``lse
        [T, H]`` float32 natural log, the sink included (a row with no valid slot: out 0, lse =
        its head's sink, -inf without one; NaN where a score is NaN or +inf), ``o_lo = float32(O)
        - out`` rounded to q's dtype, ``[T, H, d_v]``, when ``return_o_lo`` else
        ``q.new_empty(0)`` (the residual is about 2**-9 of ``out`` in bf16 and its own rounding
        about 2**-9 of the residual, so ``out + o_lo`` carries O to about 2**-17), and
        ``max_logits [T, H]`` float32 (the maximum of ``sm_scale * q.k`` over the valid slots,
        -inf for none; the true maximum under any threshold) when ``return_max_logits`` else an
        empty float32 tensor."""

    def backward(self, dout: Tensor, dlse: Optional[Tensor], q: Tensor, kv: Tensor,
                 indices: Tensor, topk_length: Optional[Tensor], q_positions: Optional[Tensor],
                 attn_sink: Optional[Tensor], out: Tensor, lse: Tensor, o_lo: Tensor,
                 sm_scale: float, d_v: int,
                 deterministic: bool = False) -> tuple[Tensor, Tensor, Optional[Tensor]]:
        """``dout [T, H, d_v]``, ``dlse [T, H]`` float32 or ``None`` (the gradient reaching lse),
        the rest as the forward's arguments and outputs (``o_lo`` may be empty). The kernel
        backends (and ``emulate``) form ``dpsum = rowsum(dout * (out + o_lo))`` in fp32
        (``rowsum(dout * out)`` without o_lo); ``reference`` recomputes P and uses the textbook
        ``rowsum(P * dP)``, reading none of out, lse, o_lo. ``dS = P (dP - dpsum + dlse)``.
        Returns contiguous ``dq [T, H, d_qk]`` in q's dtype, ``dkv [S, d_qk]`` in kv's dtype
        (fp32 accumulation; empty slots never written) and ``d_sink [H]`` float32 ``= -sum_t
        P_sink (dpsum - dlse)`` with a sink, else ``None``. ``deterministic``: bitwise the same
        results in every run (sm90: dkv in 64-bit fixed point; reference and emulate: under
        PyTorch's deterministic mode)."""

    def indexer_target(self, q: Tensor, kv: Tensor, indices: Tensor,
                       topk_length: Optional[Tensor], q_positions: Optional[Tensor],
                       attn_sink: Optional[Tensor], lse: Tensor, sm_scale: float) -> Tensor:
        """The indexer's training target (:mod:`mla_inductor.ops.indexer_target`): ``q``, ``kv``,
        ``indices``, ``topk_length``, ``q_positions``, ``attn_sink``, ``sm_scale`` as the
        forward's, ``lse [T, H]`` float32 the forward's lse for them (the sink included). Returns
        contiguous ``target [T, topk]`` float32: ``sum_h exp(sm_scale * q[t, h] . k_j - lse[t,
        h])`` on the valid slots, divided by its sum over the row's valid slots; exactly 0 on
        empty slots and on rows without a valid slot (or whose sum is 0). Empty slots are never
        read, as in the forward. ``reference``, ``emulate`` and ``sm90`` have it; ``auto`` falls
        back to the reference (with the warning) on a CUDA backend without it, and a forced one
        does the same."""

    def lightning_indexer(self, q: Tensor, k: Tensor, weights: Tensor,
                          q_positions: Optional[Tensor], topk: int, *,
                          q_scale: Optional[Tensor] = None,
                          k_scale: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
        """The lightning indexer's top-k (:mod:`mla_inductor.ops.lightning_indexer`): ``q [B, T, H,
        D]`` (bf16/fp16; fp32 on the reference path), ``k [B, S, D]`` of q's dtype, ``weights [B,
        T, H]`` float32, ``q_positions [B, T]`` int32 or ``None`` (causal: key ``s`` is seen by
        token ``t`` when ``s <= q_positions[b, t]``; None: every key seen), all contiguous,
        ``topk >= 0`` int. ``score[t, s] = sum_h weights[t, h] * relu(q[t, h] . k[s])`` with
        float32 accumulation; per row the ``min(topk, n_seen)`` seen keys of largest score, exact
        ties to the smaller key index (``-0.0`` equals ``+0.0``), a NaN score above +inf. Returns
        contiguous ``indices [B, T, topk]`` int32, the selected keys in ascending key index and
        then -1, and ``scores [B, T, topk]`` float32, each slot's score, 0 on -1 slots. No host
        synchronisation, no ``[T, S]`` tensor beyond a bounded chunk. With float8_e4m3fn q and k
        (dispatched with that dtype) the call adds the keywords ``q_scale=`` (``[B, T, H]``
        float32; the op passes ones for none) and ``k_scale=`` (``[B, S]`` float32), contiguous,
        and ``score[t, s] = sum_h weights[t, h] * relu(q_scale[t, h] * k_scale[s] * (q[t, h] .
        k[s]))``, the fp8 dot accumulated in float32; only a backend whose ``supports()`` accepts that dtype gets
        them. ``reference`` has it, fp8 included (``emulate`` runs the reference's), and so has
        sm90 (fp8 too, for D = 128 and 1 to 64 heads); ``auto`` on a CUDA backend without it (or
        whose ``supports()`` says no: sm90 for another D or head count) falls back to the
        reference with the warning."""

    def lightning_indexer_scores(self, q: Tensor, k: Tensor, weights: Tensor,
                                 indices: Tensor) -> Tensor:
        """The lightning indexer's scores at the selected slots
        (:mod:`mla_inductor.ops.lightning_indexer_scores`): ``q [B, T, H, D]`` (bf16/fp16; fp32
        on the reference path), ``k [B, S, D]`` q's dtype, ``weights [B, T, H]`` float32,
        ``indices [B, T, topk]`` int32 local to each batch element (any value < 0 or >= S is an
        empty slot, never read), all contiguous. Returns contiguous ``scores [B, T, topk]``
        float32, ``sum_h weights[b, t, h] * relu(q[b, t, h] . k[b, indices[b, t, j]])`` with fp32
        products and accumulation, exactly 0 on empty slots. Dispatched as
        ``"lightning_indexer_scores"`` with dims ``(T, H, S, D, 0, frozenset())``."""

    def lightning_indexer_scores_bwd(self, dscores: Tensor, q: Tensor, k: Tensor, weights: Tensor,
                                     indices: Tensor, deterministic: bool = False
                                     ) -> tuple[Tensor, Tensor, Tensor]:
        """Its backward: ``dscores [B, T, topk]`` float32, the rest as the forward's;
        ``deterministic``: bitwise the same results in every run (the op's autograd formula
        passes the mode as traced, as for ``backward``). Returns contiguous ``dq [B, T, H, D]``
        in q's dtype, ``dk [B, S, D]`` in k's dtype (fp32 accumulation over the valid slots, once
        per occurrence of a duplicated index, as the attention backward's dkv; rows no valid slot
        names get exact zeros) and ``dweights [B, T, H]`` float32; relu's gradient is 0 where ``q
        . k <= 0`` (0 at exactly 0, as ``torch.relu``'s). Empty slots contribute nothing,
        whatever their ``dscores``. Dispatched as ``"lightning_indexer_scores_bwd"`` with the
        forward's dims. ``reference`` has both; ``auto`` on a CUDA backend without one falls back
        to the reference with the warning, and a forced backend does the same."""

    def indexer_kl(self, logits: Tensor, target: Tensor, indices: Tensor, hi: Tensor,
                   length: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """The indexer loss's per-row KL (:mod:`mla_inductor.ops.indexer_kl`): ``logits`` and
        ``target`` ``[R, K]`` float32, ``indices [R, K]`` int32, ``hi`` and ``length`` ``[R]``
        int32; slot ``j`` of row ``r`` is valid iff ``0 <= indices[r, j] <= hi[r]`` and ``j <
        length[r]``. Returns ``[R]`` tensors ``(kl, lse, tsum, count)``: float32, float32,
        float32, int32 (the op's module docstring gives each). Deterministic. ``reference`` and
        ``sm90`` have it; ``auto`` on a CUDA backend without it falls back to the reference with
        the warning."""

    def indexer_kl_bwd(self, dkl: Tensor, logits: Tensor, target: Tensor, indices: Tensor,
                       hi: Tensor, length: Tensor, lse: Tensor, tsum: Tensor) -> Tensor:
        """Its backward: ``dlogits [R, K]`` float32, ``dkl[r] (exp(logits - lse[r]) tsum[r] -
        target)`` on the valid slots, 0 elsewhere (``dkl``, ``lse``, ``tsum`` ``[R]`` float32,
        the rest as the forward's)."""

    def precompile(self, arch: str, **static_config) -> dict:
        """Compiles kernels without a GPU (``CUTE_DSL_ARCH``) and returns the compiled artefacts."""


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
    if direction in ("lightning_indexer", "indexer_target"):
        return direction
    if direction.startswith("lightning_indexer_scores"):
        return "lightning_indexer_scores"
    return "sparse_mla"


def select(device: torch.device, dtype: torch.dtype, direction: str, dims=None, *,
           deterministic=None) -> ModuleType:
    """The backend module that runs ``direction``: the name of the :class:`Backend` member it
    calls (``"forward"``, ``"backward"``, ``"indexer_target"``, ...).

    ``dims = (T, H, S, d_qk, d_v, features)`` (as :meth:`Backend.supports` takes them) lets
    ``auto`` skip a kernel backend that does not support the problem (its ``supports()`` says
    why) in favour of the reference; a forced backend raises.
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
