"""Input checks shared by the fake kernels and the real implementations of the ops.

Every check is a ``torch._check`` (through :func:`require`) with a readable message, so the
same error appears at trace time under ``torch.compile`` (raised while the entry op's
decomposition or a fake kernel runs on FakeTensors, which puts the message on the second line of
Dynamo's error) and at run time (raised by the op body). The checks read only shapes, dtypes,
devices and Python scalars, never tensor data, so they work on FakeTensors and symbolic sizes
without specialising them. A check's keyword ``op`` (``"sparse_mla"`` by default;
``"indexer_target"`` for the indexer target, which shares these checks) is the public name its
messages start with.
"""

from __future__ import annotations

import math
from typing import Callable, Optional

import torch
import torch.autograd.forward_ad as fwAD
from torch._C._functorch import TransformType
from torch._functorch.pyfunctorch import retrieve_all_functorch_interpreters

from .thresholds import EXACT_THRESHOLD, LAZY_THRESHOLD, MAX_RESCALE_THRESHOLD

SUPPORTED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# The lightning indexer also takes q and k in fp8 (e4m3, with per-row scales: the indexer of
# DeepSeek-V3.2-Exp's inference code).
FP8 = torch.float8_e4m3fn
INDEX_DTYPES = (torch.int32, torch.int64)
# attn_sink may come in the model's dtype (a model cast with ``.to(torch.bfloat16)``); the entry
# ops bring it to float32 (:func:`sink_in_float32`), in which the softmax runs.
SINK_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# what the int32 inputs' messages add: the public function converts int64 itself
_TAKES_INT64 = " (the sparse_mla API also takes int64)"


def require(cond, message: Callable[[], str]) -> None:
    """``torch._check(cond, message)``, returning at once for a plain ``True``.

    ``torch._check`` imports torch's symbolic-shapes module (and sympy) on its first call: 0.4 s
    of a fresh process's first step on our 2-core CPU machine when every check passes on concrete
    sizes. Symbolic conditions (under tracing, where that module is loaded already) and failures
    go through it.

    Args:
        cond: a Python ``bool`` or a ``SymBool``.
        message: called only on failure; returns the error text.

    Raises:
        RuntimeError: ``message()`` when ``cond`` is false (``torch._check``'s error).
    """
    if cond is True:
        return
    torch._check(cond, message)


def check_for(op: str, cond, message: str) -> None:
    """:func:`require` with ``message`` prefixed by the op's public name (``sparse_mla``,
    ``lightning_indexer``, ``lightning_indexer_scores``).

    Raises:
        RuntimeError: ``"<op>: <message>"`` when ``cond`` is false."""
    require(cond, lambda: f"{op}: {message}")


def _check(cond, message: str) -> None:
    check_for("sparse_mla", cond, message)


def check_forward_inputs(
    q: torch.Tensor,
    kv: torch.Tensor,
    indices: torch.Tensor,
    topk_length: Optional[torch.Tensor],
    d_v: int,
    *,
    op: str = "sparse_mla",
) -> None:
    """Checks the canonical op inputs ``q [T, H, d_qk]``, ``kv [S, d_qk]``, ``indices [T, topk]``.

    Raises:
        RuntimeError: on a wrong rank, mismatched d_qk, ``d_v > d_qk`` or ``d_v < 1``, a token
            count that differs between q and indices, non-int32 indices, a bad ``topk_length``,
            an unsupported dtype, or tensors on different devices.
    """
    check_for(
        op,
        q.dim() == 3,
        f"q must be [T, H, d_qk] (or [B, T, H, d_qk]), got shape {tuple(q.shape)}",
    )
    check_for(
        op,
        kv.dim() == 2,
        f"kv must be [S, d_qk] (or [S, 1, d_qk]), got shape {tuple(kv.shape)}",
    )
    check_for(
        op,
        indices.dim() == 2,
        f"indices must be [T, topk] (or [T, 1, topk]), got shape {tuple(indices.shape)}",
    )
    check_for(
        op,
        q.dtype in SUPPORTED_DTYPES,
        f"q has unsupported dtype {q.dtype}; use bfloat16, float16 (or float32 on the reference path)",
    )
    check_for(op, kv.dtype == q.dtype, f"kv dtype {kv.dtype} differs from q dtype {q.dtype}")
    check_for(
        op,
        indices.dtype == torch.int32,
        f"indices must be an integer tensor: int32 (int64 is accepted by mla_inductor.sparse_mla), "
        f"got {indices.dtype}",
    )
    check_for(
        op,
        q.shape[-1] == kv.shape[-1],
        f"mismatched d_qk: q has {q.shape[-1]}, kv has {kv.shape[-1]}",
    )
    check_for(op, 1 <= d_v, f"d_v must be >= 1, got {d_v}")
    check_for(
        op,
        d_v <= q.shape[-1],
        f"d_v ({d_v}) must be <= d_qk ({q.shape[-1]}); d_v defaults to 512, pass d_v= for other widths",
    )
    check_for(
        op,
        indices.shape[0] == q.shape[0],
        f"token count mismatch: q has T={q.shape[0]}, indices has T={indices.shape[0]}",
    )
    check_for(
        op,
        kv.device == q.device and indices.device == q.device,
        f"tensors on different devices: q {q.device}, kv {kv.device}, indices {indices.device}",
    )
    if topk_length is not None:
        _check_vector(op, "topk_length", topk_length, q, q.shape[0], "[T]", torch.int32,
                      _TAKES_INT64)


def check_features(
    q: torch.Tensor,
    q_positions: Optional[torch.Tensor],
    attn_sink: Optional[torch.Tensor],
    *,
    op: str = "sparse_mla",
) -> None:
    """Checks the canonical ``q_positions [T]`` int32 and ``attn_sink [H]`` float32 (each
    optional) against ``q [T, H, d_qk]``.

    Raises:
        RuntimeError: a wrong shape, dtype or device.
    """
    if q_positions is not None:
        _check_vector(op, "q_positions", q_positions, q, q.shape[0], "[T]", torch.int32,
                      _TAKES_INT64, shape_note=" (batched: [B, T])")
    if attn_sink is not None:
        _check_vector(op, "attn_sink", attn_sink, q, q.shape[1], "[H]", torch.float32,
                      shape_note=" (one logit per head)")


def _check_vector(op: str, name: str, t: torch.Tensor, q: torch.Tensor, length: int,
                  layout: str, dtype: torch.dtype, dtype_note: str = "", *,
                  shape_note: str = "") -> None:
    """Checks an optional per-token or per-head input ``t`` of the canonical layout: ``[length]``
    (``layout`` names it, ``shape_note`` follows), of ``dtype`` (``dtype_note`` follows its
    name), on q's device, in that order.

    Raises:
        RuntimeError: ``"<op>: <name> ..."`` for the first of these that fails.
    """
    check_for(op, t.dim() == 1 and t.shape[0] == length,
              f"{name} must be {layout} = [{length}]{shape_note}, got shape {tuple(t.shape)}")
    check_for(op, t.dtype == dtype,
              f"{name} must be {str(dtype).removeprefix('torch.')}{dtype_note}, got {t.dtype}")
    check_for(op, t.device == q.device, f"{name} on {t.device}, q on {q.device}")


def sink_in_float32(attn_sink: Optional[torch.Tensor], *,
                    op: str = "sparse_mla") -> Optional[torch.Tensor]:
    """``attn_sink [H]`` as the float32 tensor the kernels take: the entry ops call it, so a sink
    in bfloat16 or float16 (the model's dtype) is accepted on every backend. The cast is
    differentiable, so ``d_sink`` reaches the caller in the sink's own dtype.

    Raises:
        RuntimeError: a sink of another dtype (``<op>: attn_sink must be ...``).
    """
    if attn_sink is None:
        return None
    check_for(
        op,
        attn_sink.dtype in SINK_DTYPES,
        f"attn_sink must be float32, bfloat16 or float16 (the softmax runs in float32), got "
        f"{attn_sink.dtype}",
    )
    return attn_sink.float()


def check_backward_inputs(
    dout: torch.Tensor,
    q: torch.Tensor,
    kv: torch.Tensor,
    indices: torch.Tensor,
    topk_length: Optional[torch.Tensor],
    out: torch.Tensor,
    lse: torch.Tensor,
    o_lo: torch.Tensor,
    d_v: int,
) -> None:
    """Checks the backward op's inputs: the forward's inputs plus ``dout``/``out`` ``[T, H, d_v]``,
    ``lse [T, H]`` float32 and ``o_lo`` (``[T, H, d_v]`` in q's dtype, or empty).

    Raises:
        RuntimeError: as :func:`check_forward_inputs`, or when dout/out/lse/o_lo do not match.
    """
    check_forward_inputs(q, kv, indices, topk_length, d_v)
    expected = (q.shape[0], q.shape[1], d_v)
    for name, t in (("dout", dout), ("out", out)):
        _check(
            t.dim() == 3 and t.shape == expected,
            f"{name} must be [T, H, d_v] = {expected}, got shape {tuple(t.shape)}",
        )
        _check(t.dtype == q.dtype, f"{name} dtype {t.dtype} differs from q dtype {q.dtype}")
        _check(t.device == q.device, f"{name} on {t.device}, q on {q.device}")
    _check(
        lse.dim() == 2 and lse.shape == expected[:2],
        f"lse must be [T, H] = {expected[:2]}, got shape {tuple(lse.shape)}",
    )
    _check(lse.dtype == torch.float32, f"lse must be float32, got {lse.dtype}")
    _check(o_lo.dtype == q.dtype, f"o_lo dtype {o_lo.dtype} differs from q dtype {q.dtype}")
    _check(
        o_lo.numel() == 0 or (o_lo.dim() == 3 and o_lo.shape == expected),
        f"o_lo must be empty or [T, H, d_v] = {expected}, got shape {tuple(o_lo.shape)}",
    )


def check_dlse(dlse: Optional[torch.Tensor], lse: torch.Tensor) -> None:
    """Checks the backward's optional ``dlse``: float32, lse's shape.

    Raises:
        RuntimeError: a wrong shape or dtype.
    """
    if dlse is not None:
        _check(
            dlse.shape == lse.shape and dlse.dtype == torch.float32,
            f"dlse must be float32 {tuple(lse.shape)} (lse's shape), got {dlse.dtype} "
            f"{tuple(dlse.shape)}",
        )


def check_lse(lse: torch.Tensor, q: torch.Tensor, *, op: str = "sparse_mla") -> None:
    """Checks an ``lse`` passed back in (the indexer target's): float32 ``[T, H]`` of
    ``q [T, H, d_qk]``, on q's device.

    Raises:
        RuntimeError: a wrong shape, dtype or device.
    """
    expected = (q.shape[0], q.shape[1])
    check_for(
        op,
        lse.dim() == 2 and lse.shape[0] == expected[0] and lse.shape[1] == expected[1],
        f"lse must be [T, H] = {expected} (batched: [B, T, H]), the lse sparse_mla returned for "
        f"the same inputs, got shape {tuple(lse.shape)}",
    )
    check_for(op, lse.dtype == torch.float32, f"lse must be float32, got {lse.dtype}")
    check_for(op, lse.device == q.device, f"lse on {lse.device}, q on {q.device}")


def check_rescale_threshold(rescale_threshold: float, dtype: torch.dtype) -> None:
    """Checks ``rescale_threshold`` (log2 units) for q's ``dtype``: finite, ``>= 0`` and below
    :data:`mla_inductor.thresholds.MAX_RESCALE_THRESHOLD` (``0.0`` is the exact running max).

    Raises:
        RuntimeError: for NaN, inf, a negative value or one at or above the dtype's bound.
    """
    bound = MAX_RESCALE_THRESHOLD.get(dtype, math.inf)
    _check(
        math.isfinite(rescale_threshold) and 0.0 <= rescale_threshold < bound,
        f"rescale_threshold must be finite, >= 0 and < {bound:g} for {dtype} (log2 units: the "
        f"lazy rescale lets p reach 2**rescale_threshold; {EXACT_THRESHOLD} is the exact running "
        f"max, {LAZY_THRESHOLD} the inference default), got {rescale_threshold}",
    )


def check_sm_scale(sm_scale: float, *, op: str = "sparse_mla") -> None:
    """Checks that ``sm_scale`` is finite (a NaN or infinite scale turns every score into NaN or
    +-inf). A symbolic value is not checked.

    Raises:
        RuntimeError: for NaN or +-inf.
    """
    if isinstance(sm_scale, float):
        check_for(op, math.isfinite(sm_scale), f"sm_scale must be finite, got {sm_scale}")


def check_batched_inputs(
    q: torch.Tensor,
    kv: torch.Tensor,
    indices: torch.Tensor,
    topk_length: Optional[torch.Tensor],
    *,
    op: str = "sparse_mla",
) -> None:
    """Checks a batched call, ``q [B, T, H, d_qk]``, against ``kv [B, S, d_qk]``, ``indices
    [B, T, topk]`` (head dimensions of 1 already squeezed) and ``topk_length [B, T]``; the rest
    is checked on the flattened tensors by :func:`check_forward_inputs`.

    Raises:
        RuntimeError: naming the expected layout and the sizes found.
    """
    check_for(
        op,
        kv.dim() == 3,
        f"batched kv must be [B, S, d_qk] or [B, S, 1, d_qk], got shape {tuple(kv.shape)}",
    )
    check_for(
        op,
        indices.dim() == 3,
        f"batched indices must be [B, T, topk] or [B, T, 1, topk], got shape "
        f"{tuple(indices.shape)}",
    )
    check_for(
        op,
        indices.dtype in INDEX_DTYPES,
        f"indices must be an integer tensor (int32 or int64), got {indices.dtype}",
    )
    B, T = q.shape[0], q.shape[1]
    check_for(
        op,
        kv.shape[0] == B and indices.shape[0] == B,
        f"batch size differs: q [B, T, H, d_qk] has B={B}, kv [B, S, d_qk] has "
        f"{kv.shape[0]}, indices [B, T, topk] has {indices.shape[0]}",
    )
    check_for(
        op,
        indices.shape[1] == T,
        f"token count mismatch: q [B, T, H, d_qk] has T={T}, indices [B, T, topk] has "
        f"T={indices.shape[1]}",
    )
    if topk_length is not None:
        check_for(
            op,
            topk_length.dim() == 2 and topk_length.shape[0] == B and topk_length.shape[1] == T,
            f"batched topk_length must be [B, T] = [{B}, {T}], got shape "
            f"{tuple(topk_length.shape)}",
        )


def check_no_func_transform() -> None:
    """Refuses the ``torch.func`` transforms that differentiate (``grad``, ``vjp``, ``jacrev``,
    ``jacfwd``, ``jvp``, ``hessian``): the op's autograd is reverse-mode only and is not written
    for functorch, which would otherwise fail inside torch or return zero tangents.
    ``torch.func.vmap`` is allowed. Visible only above the op's autograd (in the entry op), where
    the transform's interpreter is still on the stack.

    Raises:
        RuntimeError: naming the transforms and what to use instead.
    """
    if torch._C._functorch.peek_interpreter_stack() is None:
        return  # no transform at all: the common case, 0.1 us instead of 20
    transforms = {i.key() for i in retrieve_all_functorch_interpreters()}
    _check(
        not transforms & {TransformType.Grad, TransformType.Jvp},
        "torch.func transforms that differentiate (grad, vjp, jacrev, jacfwd, jvp, hessian) are "
        "not supported; use torch.autograd (loss.backward(), torch.autograd.grad). "
        "torch.func.vmap works",
    )


def check_no_forward_ad(*tensors: Optional[torch.Tensor]) -> None:
    """Refuses forward-mode AD (``torch.autograd.forward_ad`` dual tensors), which would
    otherwise return no tangent (read as zero): the op has a reverse-mode gradient only.

    Args:
        tensors: every differentiable input of the op (q, kv and attn_sink); None for an input
            not given.

    Raises:
        RuntimeError: when any of them carries a tangent.
    """
    if getattr(fwAD, "_current_level", 0) < 0:
        return  # no dual level is open (the common case)
    _check(
        all(t is None or fwAD.unpack_dual(t).tangent is None for t in tensors),
        "forward-mode AD (torch.autograd.forward_ad dual tensors) is not supported: the op has "
        "a reverse-mode gradient only (a tangent on q, kv or attn_sink); use torch.autograd "
        "(loss.backward(), torch.autograd.grad)",
    )
