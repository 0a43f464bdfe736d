"""DeepSeek-V3.2's indexer loss for the DSA layers that :mod:`.deepseek_v32` switches, and its
form over pools for GLM-5.3-Flash's k-pool indexer (:mod:`.glm5_next`, :func:`pooled_loss`)
(opt-in: ``apply(model, indexer_loss=True)``; the sum a training loop adds:
``indexer_loss(model)``).

transformers 5.24 runs the indexer under ``no_grad``: nothing trains it. DeepSeek-V3.2's sparse
training stage (DeepSeek-AI, "DeepSeek-V3.2-Exp: Boosting Long-Context Efficiency with DeepSeek
Sparse Attention", 2025, section 2.1) trains it with, per query token ``t`` and its selected set
``S_t``, ``KL(p_t || softmax(I_t))``: ``p_t`` the main attention's probabilities of the keys of
``S_t``, summed over heads and L1-normalised, ``I_t`` the indexer's logits of those keys; the
indexer's input is detached, so this loss trains the indexer only (and the language-model loss
does not reach the indexer). Per layer with its own indexer, training forward by training
forward:

- ``target = indexer_target(q, kv, indices, lse, sm_scale=layer.scaling)`` on exactly the latent
  ``q``, ``kv``, ``indices`` of the layer's ``sparse_mla`` call and the ``lse`` it returned
  (:func:`mla_inductor.indexer_target`; the slots the model's mask hides are empty there);
- ``logits[t, j] = sum_h w[t, h] · relu(softmax_scale · q_I[t, h] · k_I[indices[t, j]])``,
  ``w = weights_proj(x) · n_heads**-0.5``, from the indexer's own ``wq_b``, ``wk``, ``k_norm``,
  ``weights_proj`` and RoPE (:mod:`.indexer`'s definitions), with autograd, on
  ``hidden_states.detach()`` and ``q_resid.detach()``: the selection's own scores
  (:func:`.indexer.indexer_topk` with ``scores=True``, i.e.
  :func:`mla_inductor.lightning_indexer` with ``return_scores``, ``softmax_scale`` folded into
  the weights), whose backward is the :func:`mla_inductor.lightning_indexer_scores` backward at
  the selected indices (under a dense mask, packed sequences or another attention
  implementation, the scores op on the same projections, as the reference's selection forms no
  scores);
- ``loss = indexer_kl_loss(logits, target, indices, kv_len=S)``
  (:func:`mla_inductor.indexer_kl_loss`): the KL over each token's valid slots, averaged over the
  tokens that have one; empty slots get zero gradient.

Composition (measured in one DeepSeek-V3.2 layer, ``bench hf --modes patched patched+loss``, H200,
2026-12-02; docs/performance.md has the table): the indexer's projections and its scores are
computed once, by the selection, with grad; the loss adds the target (one
:func:`~mla_inductor.indexer_target`), the KL, and the scores' backward (the gradients of
queries, keys and weights from one recomputation of the slots' products). Recomputing the
logits in the backward under a checkpoint instead (non-reentrant) was slower (1.22x against
1.19x the layer without the loss at T 32768, when the logits were still scored a second time)
and saved no peak memory: the layer's peak is the attention's backward.

Memory: no ``[B, T, topk, head_dim]`` gather and no ``[B, T, n_heads, topk]`` scores are kept
(nor formed for the whole problem). What each layer keeps for the backward
(``tests/integrations/test_transformers_indexer_loss.py`` counts it): 12 bytes per selected slot (the int32
indices, the float32 logits and target, which the KL keeps; with a padding mask 4 more, the
selection's own indices), 384 MiB at B 1, T 16384, topk 2048, plus the indexer's queries ``[B,
T, n_heads, head_dim]`` in the layer's dtype (256 MiB there with 64 heads of 128 in bfloat16),
its keys up to three times (``[B, T, head_dim]``; with a padding mask the selection's gathered
keys too), its float32 head weights and O(B·T); the layer's ``hidden_states`` and ``q_resid``,
which the model keeps for its own backward anyway, are read too (not the float32 copy of
``hidden_states`` that the float32 ``weights_proj`` reads:
:func:`.indexer.head_weights`).

Transformers' gradient checkpointing (``model.activation_checkpointing_enable()``, non-reentrant
by default) works: the recomputation inside the backward computes the loss again (its backward
needs that) without recording it a second time. With ``use_reentrant=True`` the layers' forward
runs without grad, so no loss is recorded (:func:`take` gives 0).
"""

from __future__ import annotations

import warnings
from typing import Callable

import torch
from torch import Tensor, nn

from ...api import indexer_kl_loss, indexer_target, lightning_indexer_scores
from .indexer import head_weights, index_keys, index_queries

# The attribute of an attention module holding its recorded losses (a list of 0-d float32
# tensors); present exactly while the layer's indexer loss is enabled.
_LOSSES = "_mla_inductor_indexer_losses"


def enable(attn: nn.Module, on: bool) -> None:
    """Turns ``attn``'s indexer loss on (keeping losses already recorded) or off (dropping
    them)."""
    if on:
        attn.__dict__.setdefault(_LOSSES, [])
    else:
        attn.__dict__.pop(_LOSSES, None)


def enabled(attn: nn.Module) -> bool:
    """Whether ``attn``'s indexer loss is on (:func:`enable`)."""
    return _LOSSES in attn.__dict__


def active(attn: nn.Module) -> bool:
    """Whether this forward of ``attn`` computes its indexer loss: enabled, the layer has its own
    indexer (GLM-5's "shared" layers reuse the previous layer's top-k and have none), training,
    and grad enabled."""
    return (getattr(attn, _LOSSES, None) is not None and attn.indexer is not None
            and attn.training and torch.is_grad_enabled())


def record(attn: nn.Module, rope: Callable, hidden_states: Tensor, q_resid: Tensor,
           position_embeddings: tuple[Tensor, Tensor], q: Tensor, kv: Tensor, indices: Tensor,
           lse: Tensor, logits: Tensor | None = None) -> None:
    """Computes this forward's indexer loss of ``attn`` (:func:`layer_loss`) and keeps it
    (:func:`keep`)."""
    keep(attn, layer_loss(attn, rope, hidden_states, q_resid, position_embeddings, q, kv, indices,
                          lse, logits))


def keep(attn: nn.Module, loss: Tensor) -> None:
    """Appends this forward's indexer ``loss`` (0-d float32) to ``attn``'s recorded losses,
    unless this forward runs inside a backward pass: that is a checkpoint's recomputation
    (transformers' gradient checkpointing, non-reentrant), whose loss was recorded by the
    original forward and whose backward needs this computation's saved tensors, so it is
    computed and not recorded again. Compiled code never runs there (``torch.utils.checkpoint``
    recomputes with dynamo disabled), so it needs no check."""
    if torch.compiler.is_compiling() or torch._C._current_graph_task_id() == -1:
        getattr(attn, _LOSSES).append(loss)


def take(layers: list[nn.Module]) -> Tensor:
    """The mean of the losses ``layers`` recorded (0-d float32), which are then cleared; 0,
    without grad, where none recorded one, with a ``UserWarning`` that says why (shown once per
    calling line by Python's default warning filter): a training loop that adds a 0 would
    otherwise never learn that its indexers are not trained."""
    losses = [loss for attn in layers for loss in getattr(attn, _LOSSES)]
    for attn in layers:
        getattr(attn, _LOSSES).clear()
    if not losses:
        if any(not attn.training for attn in layers):
            why = ("the model is in eval mode (the loss is computed in training forwards only); "
                   "call model.train() before the forward")
        else:
            why = ("no forward in training mode with grad enabled ran since the last call (a "
                   "forward under torch.no_grad() or torch.inference_mode(), reentrant "
                   "gradient checkpointing, or no forward at all)")
        warnings.warn(f"mla_inductor: indexer_loss(model) is 0 and has no gradient: {why}",
                      stacklevel=3)
        return torch.zeros((), device=next(layers[0].parameters()).device)
    return torch.stack(losses).mean()


def layer_loss(attn: nn.Module, rope: Callable, hidden_states: Tensor, q_resid: Tensor,
               position_embeddings: tuple[Tensor, Tensor], q: Tensor, kv: Tensor,
               indices: Tensor, lse: Tensor, logits: Tensor | None = None) -> Tensor:
    """One layer's indexer loss for one forward (module docstring), a 0-d float32 tensor whose
    gradient reaches the indexer's parameters only.

    Args:
        attn: the switched ``DeepseekV32Attention`` / ``GlmMoeDsaAttention``, with an indexer.
        rope: the RoPE its indexer applies (as for
            :func:`~mla_inductor.integrations.transformers.indexer.indexer_topk`).
        hidden_states: ``[B, T, hidden_size]``, the layer's input (read detached).
        q_resid: ``[B, T, q_lora_rank]``, ``q_a_layernorm(q_a_proj(hidden_states))`` (read
            detached).
        position_embeddings: ``(cos, sin)``, each ``[B or 1, T, qk_rope_head_dim]``.
        q, kv, indices, lse: the layer's ``sparse_mla`` call: ``q [B, T, H, kv_lora_rank +
            qk_rope_head_dim]``, ``kv [B, S, kv_lora_rank + qk_rope_head_dim]``, ``indices [B,
            T, topk]`` int32 (-1 where the model's mask hides the key), and the ``lse [B, T, H]``
            float32 it returned (all read detached by the target).
        logits: ``[B, T, topk]`` float32, the indexer's logits of ``indices`` with their graph
            (the selection's own scores, :func:`.indexer.indexer_topk` with
            ``scores=True``), or None: then they are computed here (:func:`indexer_logits`).

    Raises:
        RuntimeError: ``S != T``: a cache that held earlier tokens (or a static cache's unfilled
            rows) before this forward; the loss covers forwards whose keys are their own tokens
            (no cache, or a fresh dynamic one, as a training forward has).
    """
    S = kv.shape[1]
    check_own_keys(hidden_states.shape[1], S)
    target = indexer_target(q, kv, indices, lse, sm_scale=attn.scaling)
    if logits is None:
        logits = indexer_logits(attn.indexer, rope, hidden_states.detach(), q_resid.detach(),
                                position_embeddings, indices)
    return indexer_kl_loss(logits, target, indices, kv_len=S)


def check_own_keys(T: int, S: int) -> None:
    """Raises the ``RuntimeError`` of :func:`layer_loss` unless the ``S`` keys are this forward's
    ``T`` tokens."""
    if S != T:
        raise RuntimeError(
            f"mla_inductor: the indexer loss needs a training forward over its own tokens only, "
            f"got {T} tokens attending to {S} keys (a cache holding earlier tokens, or a static "
            "cache); pass use_cache=False, or run it in eval mode or under torch.no_grad()"
        )


def pooled_loss(q: Tensor, kv: Tensor, slots: Tensor, lse: Tensor, sm_scale: float,
                pool_slots: Tensor, logits: Tensor, pools: Tensor, n_pools: int,
                pool_size: int) -> Tensor:
    """The indexer loss of an indexer that selects pools of ``pool_size`` consecutive keys
    (GLM-5.3-Flash's k-pool indexer, :mod:`.glm5_next`): ``KL(target || softmax(logits))`` over
    each token's selected pools, the target being the main attention's mass on each selected
    pool (its keys' probabilities summed over heads and over the pool's keys), L1-normalised over
    the selected pools; keys attended that no pool selection chose (GLM-5.3-Flash's tail) are
    left out. With ``pool_size`` 1 it is :func:`layer_loss`'s definition. A 0-d float32 tensor
    whose gradient reaches ``logits`` only.

    Args:
        q, kv, slots, lse, sm_scale: the layer's ``sparse_mla`` call (``q [B, T, H, d_qk]``,
            ``kv [B, S, d_qk]``, ``slots [B, T, W]`` int32 with the selected pools' keys first:
            pool ``j`` of the selection at slots ``j·pool_size .. (j + 1)·pool_size - 1``) and the
            ``lse [B, T, H]`` it returned.
        pool_slots: ``[B, T]`` int32, the slots of the selected pools (``pool_size`` times their
            count): the target is normalised over these.
        logits: ``[B, T, K]`` float32, the indexer's scores of the selected pools, with their
            graph.
        pools: ``[B, T, K]`` int32, the selected pools (in ``[0, n_pools)``, -1 = none), slot
            ``j`` of ``logits``.
        n_pools: the pools a row has (``kv_len`` of the KL).
        pool_size: keys per pool.

    Raises:
        RuntimeError: :func:`check_own_keys`; the ops' own checks.
    """
    B, T, K = pools.shape
    check_own_keys(T, kv.shape[1])
    target = indexer_target(q, kv, slots, lse, sm_scale=sm_scale, topk_length=pool_slots)
    target = target[..., :K * pool_size].reshape(B, T, K, pool_size).sum(-1)
    return indexer_kl_loss(logits, target, pools, kv_len=n_pools)


def indexer_logits(indexer: nn.Module, rope: Callable, hidden_states: Tensor, q_resid: Tensor,
                   position_embeddings: tuple[Tensor, Tensor], indices: Tensor) -> Tensor:
    """The indexer's logits of the selected keys, ``[B, T, topk]`` float32, differentiable in the
    indexer's parameters (and in ``hidden_states`` / ``q_resid`` where those require grad):
    ``logits[b, t, j] = sum_h w[b, t, h] · relu(softmax_scale · q[b, t, h] · k[b, indices[b, t,
    j]])`` with the model's indexer definitions (``w`` its head weights, ``softmax_scale`` folded
    into them: ``relu(a·x) = a·relu(x)`` for ``a > 0``), by
    :func:`mla_inductor.lightning_indexer_scores` (module docstring). Keys are this call's tokens
    (``S = T``); an empty slot (index < 0 or >= T) gets logit 0 and no gradient.

    ``hidden_states [B, T, hidden_size]``, ``q_resid [B, T, q_lora_rank]``, ``(cos, sin)`` each
    ``[B or 1, T, qk_rope_head_dim]``, ``indices [B, T, topk]`` integer.
    """
    keys = index_keys(indexer, rope, hidden_states, position_embeddings)  # [B, T, D]
    queries = index_queries(indexer, rope, q_resid, position_embeddings)  # [B, T, H, D]
    weights = head_weights(indexer, hidden_states)  # [B, T, H] float32
    return lightning_indexer_scores(queries, keys, weights, indices)
