"""The public entry point :func:`sparse_mla`."""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from . import custom_ops  # noqa: F401  (registers torch.ops.mla_inductor.*)
from .validation import INDEX_DTYPES


def _require(cond: bool, message: str) -> None:
    """A static check of the batched layout, needed before reshaping (a plain raise, which Dynamo
    reports as an observed exception). Every other check is left to the ops' fake kernels
    (:mod:`mla_inductor.validation`), whose messages head the error at trace time."""
    if not cond:
        raise RuntimeError(f"sparse_mla: {message}")


def _squeeze_heads(t: Tensor, rank: int, what: str) -> Tensor:
    """``[.., 1, D]`` -> ``[.., D]`` for kv and indices; any other rank passes through unchanged
    so that the op's check reports it."""
    if t.dim() != rank + 1:
        return t
    torch._check(
        t.shape[-2] == 1,
        lambda: f"sparse_mla: {what} must have a head dimension of 1 (MQA: one latent row and one "
        "index set per token, shared by all query heads); a batched kv or indices needs a batched "
        "q [B, T, H, d_qk]",
    )
    return t.squeeze(-2)


def _mask_invalid(indices: Tensor, S) -> Tensor:
    """Invalid slots -> -1 before any cast or offset: an int64 index >= 2**31 must not wrap into
    a valid row, and a batch element's index >= S must not land in the next element."""
    return torch.where((indices >= 0) & (indices < S), indices, -1)


def sparse_mla(
    q: Tensor,
    kv: Tensor,
    indices: Tensor,
    *,
    sm_scale: Optional[float] = None,
    d_v: int = 512,
    topk_length: Optional[Tensor] = None,
    rescale_threshold: Optional[float] = None,
    return_lse: bool = False,
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
        sm_scale: softmax scale; defaults to ``d_qk ** -0.5``.
        d_v: value width, ``<= d_qk``; default 512 (DeepSeek V3.2, d_qk = 576).
        topk_length: optional int32 ``[T]`` (batched ``[B, T]``; int64 accepted); slots at
            positions ``>= topk_length[t]`` are empty.
        rescale_threshold: online-softmax lazy-rescale threshold in log2 units. ``None`` (the
            default) lets :mod:`mla_inductor.policy` decide at graph capture: 0.0 (exact running
            max) when a backward consumes the forward, 8.0 otherwise.
        return_lse: also return the log-sum-exp.

    Returns:
        ``out [.., T, H, d_v]`` in q's dtype; with ``return_lse`` also ``lse [.., T, H]`` float32,
        natural log of the softmax denominator of ``sm_scale * q.k`` (not differentiable). A row
        with no valid slot gives ``out = 0``, ``lse = -inf`` and zero gradients.

    Raises:
        RuntimeError: q, kv or indices not a tensor, wrong ranks, mismatched d_qk,
            ``d_v > d_qk``, a T or head mismatch between q and indices, non-integer indices,
            mixed devices or an unsupported dtype (the same messages at trace time under
            ``torch.compile``); a forced backend that cannot run here.
    """
    for name, t in (("q", q), ("kv", kv), ("indices", indices)):
        _require(isinstance(t, Tensor), f"{name} must be a torch.Tensor, got {type(t).__name__}")
    d_qk = q.shape[-1]
    if sm_scale is None:
        sm_scale = d_qk**-0.5
    batched = q.dim() == 4
    rank = 3 if batched else 2
    kv = _squeeze_heads(kv, rank, "kv")
    indices = _squeeze_heads(indices, rank, "indices")
    if batched:
        _require(kv.dim() == 3, f"batched kv must be [B, S, d_qk] or [B, S, 1, d_qk], got rank {kv.dim()}")
        _require(indices.dim() == 3, f"batched indices must be [B, T, topk], got rank {indices.dim()}")
        _require(
            indices.dtype in INDEX_DTYPES,
            f"indices must be an integer tensor (int32 or int64), got {indices.dtype}",
        )
        B, T, S = q.shape[0], q.shape[1], kv.shape[1]
        torch._check(
            indices.shape[0] == B and kv.shape[0] == B,
            lambda: "sparse_mla: batch size differs between q [B, T, H, d_qk], kv [B, S, (1,) d_qk] "
            "and indices [B, T, (1,) topk]",
        )
        torch._check(
            indices.shape[1] == T,
            lambda: "sparse_mla: token count mismatch between q [B, T, H, d_qk] and indices [B, T, topk]",
        )
        offsets = (torch.arange(B, device=indices.device, dtype=indices.dtype) * S).view(B, 1, 1)
        indices = _mask_invalid(indices, S)
        indices = torch.where(indices >= 0, indices + offsets, -1).to(torch.int32)
        q = q.reshape(B * T, q.shape[2], d_qk)
        kv = kv.reshape(B * S, d_qk)
        indices = indices.reshape(B * T, indices.shape[-1])
        if topk_length is not None:
            topk_length = topk_length.reshape(B * T)
    elif indices.dtype == torch.int64 and kv.dim() == 2:
        indices = _mask_invalid(indices, kv.shape[0]).to(torch.int32)
    if topk_length is not None and topk_length.dtype == torch.int64:
        topk_length = topk_length.clamp(0, indices.shape[-1]).to(torch.int32)
    out, lse = torch.ops.mla_inductor.sparse_mla(
        q, kv, indices, topk_length, float(sm_scale), d_v, rescale_threshold
    )
    if batched:
        out = out.view(B, T, *out.shape[1:])
        lse = lse.view(B, T, lse.shape[-1])
    return (out, lse) if return_lse else out
