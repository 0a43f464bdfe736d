"""The indexer's training signal: the op ``torch.ops.mla_inductor.indexer_target`` and its fake.

DeepSeek-V3.2's sparse training stage (DeepSeek-AI, "DeepSeek-V3.2-Exp: Boosting Long-Context
Efficiency with DeepSeek Sparse Attention", 2025, section 2.1, continued pre-training, sparse
training stage) trains the lightning indexer with ``KL(p_t || softmax(indexer logits over
S_t))``, where ``p_t`` is the main attention's distribution over the selected set ``S_t``, summed
over heads and L1-normalised, and the indexer's input is detached from the main model. This op
forms ``p_t`` from the ``lse`` that :func:`mla_inductor.sparse_mla` returned for the same inputs,
so no second softmax pass runs and no ``[T, H, topk]`` tensor of the whole problem is formed (the
reference processes tokens in chunks).

``indexer_target(q, kv, indices, topk_length, q_positions, attn_sink, lse, sm_scale) -> target``
in the canonical layout of ``sparse_mla_fwd`` (:mod:`mla_inductor.ops.sparse_mla`): ``q [T, H, d_qk]``,
``kv [S, d_qk]``, ``indices [T, topk]`` int32, ``topk_length [T]`` int32 or None,
``q_positions [T]`` int32 or None (causal), ``attn_sink [H]`` float32 or None, ``lse [T, H]``
float32; returns ``target [T, topk]`` float32; and its entry op ``indexer_target_entry(q, kv,
indices, lse, topk_length, q_positions, attn_sink, causal, sm_scale)`` in any layout of
:mod:`mla_inductor.layout` (lse ``[B, T, H]`` batched). Not differentiable: the target is a
constant of the indexer loss (the entry op detaches its inputs; called directly, this op must not
get inputs that require grad if a gradient is then asked through its output).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from .. import backends, layout, lowering
from .registry import custom_op, entry_op
from ..validation import (check_features, check_for, check_forward_inputs, check_lse,
                          check_sm_scale, require, sink_in_float32)


OP = "indexer_target"  # the public name its errors start with


def _check(q, kv, indices, topk_length, q_positions, attn_sink, lse, sm_scale) -> None:
    # no values are read: any d_v >= 1
    check_forward_inputs(q, kv, indices, topk_length, 1, op=OP)
    check_for(OP, q.shape[1] >= 1, f"the indexer target sums over at least one head, got q "
              f"[T, H, d_qk] of shape {tuple(q.shape)}")
    check_features(q, q_positions, attn_sink, op=OP)
    check_lse(lse, q, op=OP)
    check_sm_scale(sm_scale, op=OP)


@custom_op("indexer_target")
def indexer_target(
    q: Tensor,
    kv: Tensor,
    indices: Tensor,
    topk_length: Optional[Tensor],
    q_positions: Optional[Tensor],
    attn_sink: Optional[Tensor],
    lse: Tensor,
    sm_scale: float,
) -> Tensor:
    """The head-summed, L1-normalised attention probability of each selected slot.

    ``target[t, j] = w[t, j] / sum_{valid i} w[t, i]`` with ``w[t, j] = sum_h exp(sm_scale *
    q[t, h] . kv[indices[t, j]] - lse[t, h])`` on valid slots (the same rules as
    ``sparse_mla_fwd``: index in ``[0, S)``, position below ``topk_length[t]``, index at most
    ``q_positions[t]``); empty slots get exactly 0, a row with no valid slot (or whose ``w`` is 0
    everywhere) is all 0. ``lse`` includes the sink, so the sink's mass is left out of ``w``.
    Duplicated indices get one entry per slot. A NaN in q or in a named kv row (or a NaN lse)
    gives NaN on that row's valid slots. Shapes and dtypes: module docstring; float32 target.

    Raises:
        RuntimeError: the input checks of :mod:`mla_inductor.validation` and q without a head
            (also from the fake kernel at trace time), or a forced backend that cannot run here.
    """
    _check(q, kv, indices, topk_length, q_positions, attn_sink, lse, sm_scale)
    # d_v 0: the target reads no values
    features = frozenset(name for name, on in (("causal", q_positions is not None),
                                               ("sink", attn_sink is not None)) if on)
    dims = (q.shape[0], q.shape[1], kv.shape[0], q.shape[2], 0, features)
    backend = backends.select(q.device, q.dtype, "indexer_target", dims)
    return backend.indexer_target(
        q.contiguous(),
        kv.contiguous(),
        indices.contiguous(),
        None if topk_length is None else topk_length.contiguous(),
        None if q_positions is None else q_positions.contiguous(),
        None if attn_sink is None else attn_sink.contiguous(),
        lse.contiguous(),
        sm_scale,
    )


@indexer_target.register_fake
def _(q, kv, indices, topk_length, q_positions, attn_sink, lse, sm_scale):
    _check(q, kv, indices, topk_length, q_positions, attn_sink, lse, sm_scale)
    lowering.install()
    return q.new_empty(indices.shape, dtype=torch.float32)


# The entry op of :func:`mla_inductor.indexer_target`, as ``sparse_mla`` is that of
# :func:`mla_inductor.sparse_mla`: Dynamo keeps it as one node, so the layout code (whose checks
# Dynamo cannot trace) runs in its CompositeImplicitAutograd decomposition, on FakeTensors at
# trace time, and leaves ``indexer_target`` in the graph.
def _indexer_target_entry(q, kv, indices, lse, topk_length, q_positions, attn_sink, causal,
                          sm_scale):
    flat = layout.flatten(q.detach(), kv.detach(), indices, topk_length, causal, q_positions,
                          op=OP)
    lse = lse.detach()
    if flat.batch is not None:
        B, T = flat.batch
        require(
            lse.dim() == 3 and lse.shape[0] == B and lse.shape[1] == T,
            lambda: f"{OP}: batched lse must be [B, T, H] = [{B}, {T}, H], got shape "
            f"{tuple(lse.shape)}",
        )
        lse = lse.reshape(B * T, lse.shape[-1])
    target = indexer_target(
        flat.q, flat.kv, flat.indices, flat.topk_length, flat.q_positions,
        None if attn_sink is None else sink_in_float32(attn_sink.detach(), op=OP), lse, sm_scale,
    )
    return target if flat.batch is None else target.view(*flat.batch, target.shape[-1])


entry_op(
    "indexer_target_entry(Tensor q, Tensor kv, Tensor indices, Tensor lse, Tensor? topk_length, "
    "Tensor? q_positions, Tensor? attn_sink, bool causal, float sm_scale) -> Tensor",
    _indexer_target_entry,
)
