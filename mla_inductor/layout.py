"""The layouts :func:`mla_inductor.sparse_mla` accepts, flattened to the canonical one of the ops,
and the outputs shaped back.

Accepted: ``q [T, H, d_qk]`` with ``kv [S, d_qk]`` or ``[S, 1, d_qk]`` and ``indices [T, topk]``
or ``[T, 1, topk]``; batched ``q [B, T, H, d_qk]`` with ``kv [B, S, (1,) d_qk]``, ``indices
[B, T, (1,) topk]`` (local to each batch element), ``topk_length [B, T]`` and ``q_positions
[B, T]`` or ``[T]``. Canonical (what ``sparse_mla_fwd`` takes): ``q [B*T, H, d_qk]``,
``kv [B*S, d_qk]``, ``indices [B*T, topk]`` int32 with per-batch row offsets, ``topk_length
[B*T]`` int32 and, for a causal call, ``q_positions [B*T]`` int32 with the same offsets (the
default position of token t is ``S - T + t`` within its batch element: bottom-right aligned, as
flash-attn's causal mask when T <= S).

This runs inside the entry op's decomposition (:mod:`mla_inductor.ops.sparse_mla`): its checks
raise while Dynamo propagates FakeTensors through the entry op, and its few ops (offsets, the
invalid-slot mask, casts) land in the traced graph, where inductor fuses them into the kernel
that produces the op's inputs.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch
from torch import Tensor

from .validation import check_batched_inputs, require


class Flat(NamedTuple):
    """The canonical inputs, and ``(B, T)`` of a batched call (``None`` for an unbatched one)."""

    q: Tensor
    kv: Tensor
    indices: Tensor
    topk_length: Optional[Tensor]
    q_positions: Optional[Tensor]
    batch: Optional[tuple]


def _squeeze_heads(t: Tensor, rank: int, what: str, op: str) -> Tensor:
    """``[.., 1, D]`` -> ``[.., D]`` for kv and indices; any other rank passes through unchanged
    so that the checks report it."""
    if t.dim() != rank + 1:
        return t
    require(
        t.shape[-2] == 1,
        lambda: f"{op}: {what} must have a head dimension of 1 (MQA: one latent row and one "
        f"index set per token, shared by all query heads), got shape {tuple(t.shape)}; a batched "
        "kv or indices needs a batched q [B, T, H, d_qk]",
    )
    return t.squeeze(-2)


def int32_indices(indices: Tensor, S) -> Tensor:
    """``indices`` (any shape, any integer dtype) as an int32 tensor of the same shape, every
    slot outside ``[0, S)`` (``S`` the key count, an int or SymInt) set to -1 before the
    cast, so that an int64 index >= 2**31 cannot wrap into a valid row. Raises nothing."""
    return torch.where((indices >= 0) & (indices < S), indices, -1).to(torch.int32)


def _arange(n, like: Tensor, dtype: torch.dtype = torch.int64) -> Tensor:
    """``arange(n)`` of ``dtype`` on ``like``'s device; for a DTensor ``like`` a DTensor
    replicated on its mesh (the global positions or batch offsets, of which each shard of an op reads its own
    slice: :mod:`mla_inductor.distributed`), as DTensor refuses to mix it with a plain tensor."""
    r = torch.arange(n, device=like.device, dtype=dtype)
    mesh = getattr(like, "device_mesh", None)
    if mesh is None:
        return r
    from torch.distributed.tensor import DTensor, Replicate

    return DTensor.from_local(r, mesh, [Replicate()] * mesh.ndim, run_check=False)


def token_positions(T, S, like: Tensor, q_positions: Optional[Tensor] = None,
                    op: str = "sparse_mla") -> Tensor:
    """Token positions ``[B, T]`` (batched) or ``[T]``, int64, on ``like``'s device (and mesh),
    clamped to ``[-1, S]`` (so that an int64 position cannot wrap in int32, and offsets cannot
    reach another batch element): the
    given ones, else ``S - T + t`` (``T`` tokens, ``S`` keys per batch element).

    Raises:
        RuntimeError: for ``q_positions`` of a non-integer dtype.
    """
    if q_positions is None:
        return _arange(T, like) + (S - T)
    dtype = q_positions.dtype  # the message may capture no tensor (Dynamo traces it in the loss)
    require(
        not q_positions.is_floating_point() and not q_positions.is_complex()
        and dtype != torch.bool,
        lambda: f"{op}: q_positions must be an integer tensor (int32 or int64), got {dtype}",
    )
    return q_positions.to(torch.int64).clamp(-1, S)


def flatten(q: Tensor, kv: Tensor, indices: Tensor, topk_length: Optional[Tensor],
            causal: bool = False, q_positions: Optional[Tensor] = None,
            op: str = "sparse_mla") -> Flat:
    """The canonical inputs of a call in any accepted layout (module docstring). int64 indices
    become int32 after their invalid slots are mapped to -1, and so do batched indices before
    their offsets; int32 indices of one batch element (or unbatched) pass unchanged, as every
    backend reads an index < 0 or >= S as an empty slot; an int64 ``topk_length`` is clamped
    to ``[0, topk]`` and cast to int32; with ``causal``, the positions (``q_positions`` or the
    bottom-right default) become int32 global positions.

    Raises:
        RuntimeError: for a batched call whose layout does not match
            (:func:`mla_inductor.validation.check_batched_inputs`), a head dimension of kv or
            indices other than 1, or ``q_positions`` without ``causal`` or of a non-integer
            dtype, the message starting with ``op`` (the public op's name). Everything else is
            checked by the ops on the result.
    """
    require(
        causal or q_positions is None,
        lambda: f"{op}: q_positions is only read with causal=True (it gives each token's "
        "position for the causal mask); pass causal=True or drop q_positions",
    )
    batched = q.dim() == 4
    rank = 3 if batched else 2
    kv = _squeeze_heads(kv, rank, "kv", op)
    indices = _squeeze_heads(indices, rank, "indices", op)
    positions = None
    if causal and q.dim() == 3 and kv.dim() >= 1:
        positions = token_positions(q.shape[0], kv.shape[0], q, q_positions, op)
    batch = None
    if batched:
        check_batched_inputs(q, kv, indices, topk_length, op=op)
        B, T, S = q.shape[0], q.shape[1], kv.shape[1]
        if causal:  # S of a [B, S, 1, d_qk] kv is known after the squeeze and the checks
            positions = token_positions(T, S, q, q_positions, op)
        if B != 1:
            offsets = (_arange(B, indices, indices.dtype) * S).view(B, 1, 1)
            valid = (indices >= 0) & (indices < S)
            indices = torch.where(valid, indices + offsets, -1).to(torch.int32)
        elif indices.dtype != torch.int32:  # one element: its invalid slots stay invalid
            indices = int32_indices(indices, S)
        q = q.reshape(B * T, q.shape[2], q.shape[3])
        kv = kv.reshape(B * S, kv.shape[2])
        indices = indices.reshape(B * T, indices.shape[-1])
        if topk_length is not None:
            topk_length = topk_length.reshape(B * T)
        if positions is not None:
            require(
                positions.dim() in (1, 2) and positions.shape[-1] == T
                and (positions.dim() == 1 or positions.shape[0] == B),
                lambda: f"{op}: batched q_positions must be [B, T] = [{B}, {T}] or [T], "
                f"got shape {tuple(positions.shape)}",
            )
            offsets = _arange(B, positions).view(B, 1) * S
            positions = (positions.expand(B, T) + offsets).reshape(B * T)
        batch = (B, T)
    elif indices.dtype == torch.int64 and kv.dim() == 2:
        indices = int32_indices(indices, kv.shape[0])
    if topk_length is not None and topk_length.dtype == torch.int64:
        topk_length = topk_length.clamp(0, indices.shape[-1]).to(torch.int32)
    if positions is not None:
        positions = positions.to(torch.int32)
    return Flat(q, kv, indices, topk_length, positions, batch)


def unflatten(out: Tensor, lse: Tensor, max_logits: Tensor, batch: Optional[tuple]):
    """``out [B*T, H, d_v]``, ``lse [B*T, H]`` and ``max_logits [B*T, H]`` (or empty) as
    ``[B, T, H, d_v]``, ``[B, T, H]`` and ``[B, T, H]`` for a batched call (``batch = (B, T)``),
    unchanged otherwise."""
    if batch is None:
        return out, lse, max_logits
    if max_logits.dim() == 2:  # requested (else an empty [0])
        max_logits = max_logits.view(*batch, max_logits.shape[-1])
    return out.view(*batch, *out.shape[1:]), lse.view(*batch, lse.shape[-1]), max_logits
