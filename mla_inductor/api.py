"""The public entry point :func:`sparse_mla`: argument types in, the entry op, outputs out."""

from __future__ import annotations

import numbers
from typing import Optional

import torch
from torch import Tensor

from . import custom_ops  # noqa: F401  (registers torch.ops.mla_inductor.*)


def _require(cond: bool, message: str) -> None:
    """A check of the Python argument types, which the op's schema needs before it can be called
    (a plain raise; under torch.compile Dynamo reports it as an observed exception). Layouts,
    shapes and dtypes are checked by the entry op (:mod:`mla_inductor.validation`), whose
    messages come first in the error at trace time."""
    if not cond:
        raise RuntimeError(f"sparse_mla: {message}")


def _number(name: str, value, integral: bool = False):
    """``value`` as the Python number the op's schema takes (``int`` if ``integral``, else
    ``float``); torch's symbolic numbers pass through. A tensor, even a 0-d one, is refused in
    eager and compiled code alike: under torch.compile its value is not known while tracing, and
    the op needs it then (it is a compile-time constant of the kernels)."""
    kind = "int" if integral else "float"
    if isinstance(value, Tensor):
        raise RuntimeError(
            f"sparse_mla: {name} must be a Python {kind}, got a {value.dim()}-d tensor; pass "
            f"{name}={kind}(t) (or t.item()) outside the compiled region"
        )
    if isinstance(value, (torch.SymInt, torch.SymFloat)):
        return value
    ok = isinstance(value, numbers.Integral if integral else numbers.Real)
    _require(ok and not isinstance(value, bool), f"{name} must be a Python {kind}, got {value!r}")
    return int(value) if integral else float(value)


def sparse_mla(
    q: Tensor,
    kv: Tensor,
    indices: Tensor,
    *,
    sm_scale: Optional[float] = None,
    d_v: int = 512,
    topk_length: Optional[Tensor] = None,
    causal: bool = False,
    q_positions: Optional[Tensor] = None,
    attn_sink: Optional[Tensor] = None,
    rescale_threshold: Optional[float] = None,
    return_lse: bool = False,
    return_max_logits: bool = False,
):
    """Sparse MLA attention (DeepSeek Sparse Attention, absorbed MLA form, MQA).

    For each token ``t`` and head ``h``: ``softmax_j(sm_scale * q[t, h] . kv[indices[t, j], :d_qk])``
    applied to the values ``kv[indices[t, j], :d_v]`` (key and value share the latent row).

    Args:
        q: ``[T, H, d_qk]`` or batched ``[B, T, H, d_qk]``; bfloat16 or float16 (float32 on the
            reference backend).
        kv: ``[S, d_qk]`` or ``[S, 1, d_qk]``; batched ``[B, S, d_qk]`` or ``[B, S, 1, d_qk]``.
            Same dtype as q.
        indices: ``[T, topk]`` or ``[T, 1, topk]``; batched ``[B, T, topk]`` with indices local to
            each batch element. int32 (int64 accepted). An index < 0 or >= S is an empty slot:
            never read, contributes nothing. Duplicates count once per occurrence.
        sm_scale: softmax scale, a Python float (not a tensor); defaults to ``d_qk ** -0.5``.
        d_v: value width, a Python int ``<= d_qk``; default 512 (DeepSeek V3.2, d_qk = 576).
        topk_length: optional int32 ``[T]`` (batched ``[B, T]``; int64 accepted); slots at
            positions ``>= topk_length[t]`` are empty (whatever their index).
        causal: a slot whose index is greater than the query's own position is empty (the
            indexers of DeepSeek-V3.2 and GLM-5 return future keys for early tokens; their
            attention drops them with a causal mask). Masked inside the kernels.
        q_positions: with ``causal``: each token's position, int32 or int64 ``[T]`` (batched
            ``[B, T]`` or ``[T]``), in the same coordinates as the indices (for packed sequences
            with global indices). Default: ``S - T + t`` within each batch element
            (bottom-right aligned, as flash-attn's causal mask when T <= S).
        attn_sink: optional float32 ``[H]`` (a learnable parameter in practice): one logit per
            head, natural-log units like ``sm_scale * q.k``, that joins the softmax denominator
            and has no value: ``P_j = exp(s_j - lse)``, ``lse = log(exp(sink_h) + sum_j
            exp(s_j))``. Its gradient ``-sum_t exp(sink_h - lse) * (dpsum - dlse)`` flows when it
            requires grad. The definition of FlashMLA's and cuDNN's ``attn_sink``.
        rescale_threshold: online-softmax lazy-rescale threshold in log2 units, a Python float:
            finite, ``>= 0`` and below 15 for float16, 64 for bfloat16 / float32. ``None`` (the
            default) lets :mod:`mla_inductor.policy` decide at graph capture: 0.0 (exact running
            max) when a backward consumes the forward, 8.0 otherwise.
        return_lse: also return the log-sum-exp (differentiable: a gradient through it, e.g.
            from merging partial attention results, reaches q, kv and the sink).
        return_max_logits: also return ``max_logits [.., T, H]`` float32: the maximum of
            ``sm_scale * q.k`` over each row's valid slots (natural-log units, the sink not
            included, -inf for a row with none), the true maximum also under the lazy rescale
            (QK-clip / MuonClip need it). Not differentiable.

    Returns:
        ``out [.., T, H, d_v]`` in q's dtype; or a tuple ``(out, lse)``, ``(out, max_logits)`` or
        ``(out, lse, max_logits)`` in that order, as asked for: ``lse [.., T, H]`` float32, the
        natural log of the softmax denominator (the sink included). A row with no valid slot
        gives ``out = 0``, ``lse`` = its head's sink (``-inf`` without a sink) and zero
        gradients for q and kv. A NaN or inf in
        q, or in a kv row that a valid slot names, gives NaN ``out`` (and NaN ``lse`` where a
        score is NaN or +inf) on the rows it reaches; rows of kv that no valid slot names are
        never read.

    Raises:
        RuntimeError (every message starts ``sparse_mla:``): q, kv or indices not a tensor;
            sm_scale, d_v or rescale_threshold not a Python number (a tensor, also 0-d, is
            refused); wrong ranks, a batched layout whose sizes do not match (the message gives
            the expected layout and the sizes found), mismatched d_qk, ``d_v > d_qk``, a T or
            head mismatch between q and indices, a ``topk_length`` that is not ``[T]``
            (``[B, T]``), non-integer indices, mixed devices or an unsupported dtype; a
            rescale_threshold that is not finite, negative or too large for the dtype (all of
            these also at trace time under ``torch.compile``); forward-mode AD or a ``torch.func``
            transform that differentiates (only reverse mode is implemented; ``vmap`` works); a
            forced backend that cannot run here.
    """
    for name, t in (("q", q), ("kv", kv), ("indices", indices)):
        _require(isinstance(t, Tensor), f"{name} must be a torch.Tensor, got {type(t).__name__}")
    for name, t in (("topk_length", topk_length), ("q_positions", q_positions),
                    ("attn_sink", attn_sink)):
        _require(t is None or isinstance(t, Tensor),
                 f"{name} must be a torch.Tensor or None, got {type(t).__name__}")
    if sm_scale is None:
        sm_scale = (q.shape[-1] if q.dim() else 1) ** -0.5
    else:
        sm_scale = _number("sm_scale", sm_scale)
    if rescale_threshold is not None:
        rescale_threshold = _number("rescale_threshold", rescale_threshold)
    out, lse, max_logits = torch.ops.mla_inductor.sparse_mla(
        q, kv, indices, topk_length, q_positions, attn_sink, bool(causal), sm_scale,
        _number("d_v", d_v, integral=True), rescale_threshold, bool(return_max_logits),
    )
    extra = ((lse,) if return_lse else ()) + ((max_logits,) if return_max_logits else ())
    return (out, *extra) if extra else out
