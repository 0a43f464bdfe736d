"""The lightning indexer's scores at the selected slots, differentiable: the ops
``torch.ops.mla_inductor.lightning_indexer_scores`` (forward), ``lightning_indexer_scores_bwd``
(its autograd partner) and the entry op ``lightning_indexer_scores_entry`` (the layouts).

DeepSeek-V3.2's sparse training stage (DeepSeek-AI, "DeepSeek-V3.2-Exp: Boosting Long-Context
Efficiency with DeepSeek Sparse Attention", 2025, section 2.1) trains the lightning indexer with a
KL loss towards the main attention over each token's selected keys; that loss needs the indexer's
logits of exactly those keys, with their gradients:
``scores[t, j] = sum_h weights[t, h] * relu(q[t, h] . k[indices[t, j]])``.

- ``lightning_indexer_scores(q, k, weights, indices) -> scores`` in the canonical batched layout
  of the lightning indexer: ``q [B, T, H, D]`` bf16/fp16 (fp32 on the reference backend), ``k
  [B, S, D]`` q's dtype, ``weights [B, T, H]`` float32, ``indices [B, T, topk]`` int32 local to
  each batch element (< 0 or >= S: an empty slot, never read); returns ``scores [B, T, topk]``
  float32, contiguous, exactly 0 on empty slots. Differentiable in q, k and weights.
- ``lightning_indexer_scores_bwd(dscores, q, k, weights, indices, deterministic=False) -> (dq,
  dk, dweights)``:
  ``dscores [B, T, topk]`` float32; ``dq`` like q, ``dk [B, S, D]`` in k's dtype (float32
  accumulation, once per occurrence of a duplicated index), ``dweights [B, T, H]`` float32.
  relu's gradient is 0 where ``q . k <= 0``: at exactly 0 it is 0, as ``torch.relu``'s. Empty
  slots get no gradient and give none.
- ``lightning_indexer_scores_entry(q, k, weights, indices) -> scores``: the layouts of
  :func:`mla_inductor.lightning_indexer_scores` (``q [T, H, D]`` or ``[B, T, H, D]``; ``k [S,
  D]``, ``[S, 1, D]``, ``[B, S, D]`` or ``[B, S, 1, D]``; ``weights [T, H]`` / ``[B, T, H]``;
  ``indices [T, topk]`` / ``[B, T, topk]`` int32 or int64), CompositeImplicitAutograd: Dynamo
  keeps it as one node, its layout checks raise on FakeTensors at trace time, and AOTAutograd
  (and eager) decompose it into the forward op.

Dispatch: :func:`mla_inductor.backends.select` with the directions ``"lightning_indexer_scores"``
and ``"lightning_indexer_scores_bwd"`` and dims ``(T, H, S, D, 0, frozenset())``; the protocol
functions are in :mod:`mla_inductor.kernels`. This module holds no kernel code.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .. import backends, layout, lowering
from .registry import custom_op, entry_op
from ..validation import INDEX_DTYPES, SUPPORTED_DTYPES, check_for


def _check(cond, message: str) -> None:
    check_for("lightning_indexer_scores", cond, message)


def _shape(t: Tensor) -> tuple:
    return tuple(t.shape)


def check_inputs(q: Tensor, k: Tensor, weights: Tensor, indices: Tensor) -> None:
    """Checks the canonical inputs ``q [B, T, H, D]``, ``k [B, S, D]``, ``weights [B, T, H]``
    float32 and ``indices [B, T, topk]`` int32 (shapes, dtypes, devices; never values).

    Raises:
        RuntimeError: starting ``lightning_indexer_scores:``, naming what does not match.
    """
    _check(q.dim() == 4, f"q must be [B, T, H, D] (or [T, H, D]), got shape {_shape(q)}")
    _check(k.dim() == 3, f"k must be [B, S, D] (or [S, D]), got shape {_shape(k)}")
    _check(weights.dim() == 3, f"weights must be [B, T, H] (or [T, H]), got shape "
                               f"{_shape(weights)}")
    _check(indices.dim() == 3, f"indices must be [B, T, topk] (or [T, topk]), got shape "
                               f"{_shape(indices)}")
    B, T, H, D = q.shape
    _check(q.dtype in SUPPORTED_DTYPES, f"q has unsupported dtype {q.dtype}; use bfloat16, "
                                        "float16 (or float32 on the reference backend)")
    _check(k.dtype == q.dtype, f"k dtype {k.dtype} differs from q dtype {q.dtype}")
    _check(weights.dtype == torch.float32, f"weights must be float32, got {weights.dtype}")
    _check(indices.dtype == torch.int32,
           f"indices must be int32 (mla_inductor.lightning_indexer_scores also takes int64), got "
           f"{indices.dtype}")
    _check(k.shape[0] == B, f"batch size differs: q [B, T, H, D] has B={B}, k [B, S, D] has "
                            f"{k.shape[0]}")
    _check(k.shape[2] == D, f"mismatched D: q has {D}, k has {k.shape[2]}")
    _check(weights.shape[0] == B and weights.shape[1] == T and weights.shape[2] == H,
           f"weights must be [B, T, H] = {(B, T, H)} (one weight per token and index head), got "
           f"shape {_shape(weights)}")
    _check(indices.shape[0] == B and indices.shape[1] == T,
           f"indices must be [B, T, topk] with (B, T) = {(B, T)} as q's, got shape "
           f"{_shape(indices)}")
    for name, t in (("k", k), ("weights", weights), ("indices", indices)):
        _check(t.device == q.device, f"tensors on different devices: q on {q.device}, {name} on "
                                     f"{t.device}")


def check_dscores(dscores: Tensor, indices: Tensor) -> None:
    """Checks the backward's ``dscores``: float32, ``indices``' shape, on its device.

    Raises:
        RuntimeError: starting ``lightning_indexer_scores:``.
    """
    _check(dscores.dtype == torch.float32 and dscores.shape == indices.shape,
           f"dscores must be float32 {_shape(indices)} (the scores' shape), got {dscores.dtype} "
           f"{_shape(dscores)}")
    _check(dscores.device == indices.device,
           f"dscores on {dscores.device}, indices on {indices.device}")


def _dims(q: Tensor, k: Tensor) -> tuple:
    """``(T, H, S, D, 0, features)`` for :func:`mla_inductor.backends.select` (no values read)."""
    return q.shape[1], q.shape[2], k.shape[1], q.shape[3], 0, frozenset()


@custom_op("lightning_indexer_scores")
def lightning_indexer_scores(q: Tensor, k: Tensor, weights: Tensor, indices: Tensor) -> Tensor:
    """``scores [B, T, topk]`` float32 on the backend :mod:`mla_inductor.backends` selects
    (module docstring: definition, layouts, empty slots).

    Raises:
        RuntimeError: :func:`check_inputs` (also from the fake kernel at trace time), or a forced
            backend that cannot run here.
    """
    check_inputs(q, k, weights, indices)
    backend = backends.select(q.device, q.dtype, "lightning_indexer_scores", _dims(q, k))
    return backend.lightning_indexer_scores(q.contiguous(), k.contiguous(), weights.contiguous(),
                                            indices.contiguous())


@lightning_indexer_scores.register_fake
def _(q, k, weights, indices):
    check_inputs(q, k, weights, indices)
    lowering.install()
    return q.new_empty(indices.shape, dtype=torch.float32)


@custom_op("lightning_indexer_scores_bwd")
def lightning_indexer_scores_bwd(dscores: Tensor, q: Tensor, k: Tensor, weights: Tensor,
                                 indices: Tensor, deterministic: bool = False
                                 ) -> tuple[Tensor, Tensor, Tensor]:
    """``(dq [B, T, H, D] in q's dtype, dk [B, S, D] in k's dtype, dweights [B, T, H] float32)``
    for ``dscores [B, T, topk]`` float32 on the backend :mod:`mla_inductor.backends` selects
    (module docstring).

    ``deterministic``: results bitwise identical from run to run (dk accumulated in 64-bit fixed
    point on sm90; the reference's ``index_add_`` under PyTorch's deterministic mode). The
    autograd formula passes ``torch.are_deterministic_algorithms_enabled()`` as it is when the
    backward is traced, so a compiled backward keeps the choice it was captured with.

    Raises:
        RuntimeError: :func:`check_inputs` and :func:`check_dscores` (also from the fake kernel
            at trace time), or a forced backend that cannot run here.
    """
    check_inputs(q, k, weights, indices)
    check_dscores(dscores, indices)
    backend = backends.select(q.device, q.dtype, "lightning_indexer_scores_bwd", _dims(q, k),
                              deterministic=deterministic)
    return backend.lightning_indexer_scores_bwd(
        dscores.contiguous(), q.contiguous(), k.contiguous(), weights.contiguous(),
        indices.contiguous(), deterministic,
    )


@lightning_indexer_scores_bwd.register_fake
def _(dscores, q, k, weights, indices, deterministic=False):
    check_inputs(q, k, weights, indices)
    check_dscores(dscores, indices)
    lowering.install()
    return q.new_empty(q.shape), k.new_empty(k.shape), weights.new_empty(weights.shape)


def _setup_context(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _backward(ctx, dscores):
    q, k, weights, indices = ctx.saved_tensors
    dq, dk, dweights = lightning_indexer_scores_bwd(dscores.contiguous(), q, k, weights, indices,
                                                    torch.are_deterministic_algorithms_enabled())
    return dq, dk, dweights, None


lightning_indexer_scores.register_autograd(_backward, setup_context=_setup_context)


def _squeeze_head(k: Tensor, rank: int) -> Tensor:
    """``[.., S, 1, D]`` -> ``[.., S, D]``; any other rank passes through to the checks."""
    if k.dim() != rank + 1:
        return k
    _check(k.shape[-2] == 1, f"k must have a head dimension of 1 (one key per token, shared by "
                             f"the index heads), got shape {_shape(k)}")
    return k.squeeze(-2)


def _lightning_indexer_scores_entry(q, k, weights, indices):
    _check(q.dim() in (3, 4), f"q must be [T, H, D] or [B, T, H, D], got shape {_shape(q)}")
    batched = q.dim() == 4
    rank = 3 if batched else 2
    k = _squeeze_head(k, rank)
    names = (("[B, T, H, D]", "[B, S, D] or [B, S, 1, D]", "[B, T, H]", "[B, T, topk]")
             if batched else ("[T, H, D]", "[S, D] or [S, 1, D]", "[T, H]", "[T, topk]"))
    for name, t, expected in (("k", k, names[1]), ("weights", weights, names[2]),
                              ("indices", indices, names[3])):
        _check(t.dim() == rank, f"with q {names[0]}, {name} must be {expected}, got shape "
                                f"{_shape(t)}")
    dtype = indices.dtype
    _check(dtype in INDEX_DTYPES, f"indices must be an integer tensor (int32 or int64), got "
                                  f"{dtype}")
    if dtype == torch.int64:
        indices = layout.int32_indices(indices, k.shape[-2])
    if not batched:
        q, k, weights, indices = q[None], k[None], weights[None], indices[None]
    scores = lightning_indexer_scores(q, k, weights, indices)
    return scores if batched else scores[0]


entry_op(
    "lightning_indexer_scores_entry(Tensor q, Tensor k, Tensor weights, Tensor indices) -> Tensor",
    _lightning_indexer_scores_entry,
)
