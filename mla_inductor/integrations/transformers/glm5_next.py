"""Hugging Face transformers' GLM-5.3-Flash DSA layers (``models/glm5_next``) on the ops.

transformers 5.24's ``Glm5NextTextAttention`` (the ``indexed_attention`` layers of
``Glm5NextTextModel``; the others are Kimi-style linear attention, left as they are) is MLA
without RoPE (``qk_rope_head_dim`` 0; GLM-5.3-Flash: 64 heads, ``qk_nope_head_dim`` =
``v_head_dim`` = 256, ``kv_lora_rank`` 512) selecting its keys with a DSA indexer that pools
them (``Glm5NextTextIndexer``; 32 index heads of 128, ``index_topk`` 2048, ``index_kpool``):

- keys ``k = k_norm(wk(x))`` and gate scores ``g = x @ index_kpool_compress_gateᵀ``, both
  ``[B, S, index_head_dim]``; counted from each row's first real (not padded) key, every run of
  ``kpool`` keys is one pool, whose pooled key is ``sum_i softmax_i(g + ape)·k`` channel by
  channel (``ape = index_kpool_compress_ape [kpool, index_head_dim]``, the softmax in float32);
  a pool with a padded key cannot be selected;
- pool ``p``'s score for token ``t``: ``sum_h w[t, h]·relu(softmax_scale·q[t, h]·pk[p])``, ``q =
  wq_b(q_resid)``, ``w = weights_proj(x)·n_heads**-0.5``; a pool can be selected once its last
  key is visible to the token;
- the ``index_topk // kpool`` pools of largest score are expanded back to their keys, followed,
  with ``index_kpool_always_select_tail``, by the visible keys of the unfinished last pool (at
  most ``kpool - 1``): ``[B, T, index_topk + kpool - 1]`` key indices, -1 where empty; a padded
  query token selects nothing;
- a ``shared`` layer (``indexer_types``) has no indexer and attends over the previous layer's
  selection (transformers passes it on as ``prev_topk_indices``).

transformers forms the indexer's scores in float32 as ``[B, T, index_n_heads, S/kpool]`` and
``[B, T, S/kpool]`` (8 GiB and 256 MiB at T = S = 16384, 32 heads, kpool 4), the keys each token
sees as ``[B, T, S]``, and runs the attention densely over per-head keys and values (``[B, H, S,
256]`` each) under a ``[B, 1, T, S]`` mask built from the selection (additive on eager, bool on
SDPA). :func:`forward` (the switched layer's forward, which
:func:`mla_inductor.integrations.transformers.apply` binds to each such layer) computes the same
layer on the ops instead, with the layer's own modules and parameters:

- the pooled keys ``[B, S/kpool, index_head_dim]``: plain torch ops on the layer's parameters
  (:func:`.pooling.softmax_pool`), differentiable (the indexer loss trains them);
- the pools' scores and top ``index_topk // kpool``: :func:`mla_inductor.lightning_indexer` over
  the pooled keys (causal: a token at position ``t`` sees the pools ``p <= (t - first + 1) //
  kpool - 1``, :func:`.pooling.last_entry_seen`, DeepSeek-V4 CSA's rule, ``first`` its row's first
  real key; the softmax scale folded into the head weights, :func:`.indexer.head_weights`); pools
  with a padded key are moved out of reach by :func:`.visibility.gather_seen` (with left padding
  only, the identity);
- the expansion back to keys and the tail: index arithmetic on ``[B, T, index_topk // kpool]``
  and ``[B, T]`` (:func:`expand_pools`);
- the attention in the absorbed MLA form, as :mod:`.deepseek_v32` computes GLM-5's, without a
  RoPE part: ``q[h] = q_nope[h] @ W_uk[h]`` (``[B, T, H, kv_lora_rank]``), one latent row per key
  ``kv = kv_a_layernorm(c)`` (``[B, S, kv_lora_rank]``, what the model's cache holds), ``o =
  sparse_mla(q, kv, slots, sm_scale=layer.scaling, d_v=kv_lora_rank, topk_length=...)`` (``d_qk
  = d_v = kv_lora_rank``, no sink), ``out[h] = o[h] @ W_uv[h]ᵀ`` and the layer's ``o_proj``;
  ``W_uk`` / ``W_uv`` are views of ``kv_b_proj.weight``
  (:func:`.head_matmul.head_matmul`).

No tensor of ``T × S``, ``T × S/kpool`` or ``T × index_n_heads × S/kpool`` elements is formed:
the largest index tensor is the slots, ``[B, T, index_topk + kpool - 1]`` int32. transformers'
rules are kept where they matter: pools are counted from each row's first real key (the padding
mask the model passes, cached with the indexer's state), the tail is the ``visible % kpool``
keys from ``first + visible - visible % kpool`` (``visible``: the real keys up to the token,
transformers' own formula, also with padding in the middle of a row, where a tail key can lie
in a selected pool: it is named once, as transformers' mask counts it once), and padded query
tokens select nothing (their output is 0 where transformers' is an average over every key; no real
token reads it). The selection is the same definition in float32, not bitwise: at a near-tie
(scores within a few float32 ulps) the other pool may be kept, and exact ties go to the smaller
pool index, where ``torch.topk``'s choice depends on the width scored. The attention sums the
same keys in another order.

The slots of a token: its selected pools' keys in ascending key order (:func:`expand_pools`), the
tail right after them, then -1; ``topk_length`` counts up to the tail's end, so the kernels skip
the empty blocks of early tokens (fewer than ``index_topk // kpool`` pools visible). Rows are
ascending, which the sm90 backward's row sort passes through unsorted. The next ``shared`` layer
gets these slots.

The model's cache (``DynamicIndexedLayer`` / ``StaticIndexedLayer`` for the DSA layers): the
latent rows through ``cache.update`` and the indexer's state ``cat(k, g, real)`` (``[B, S, 2 ·
index_head_dim + 1]``) through ``cache.update_indexer``, exactly as transformers writes them, so
prefill, chunked prefill and generation run on the ops. The pools are formed again from the
cached state at every call, as transformers does (O(S·index_head_dim)).

``apply(model, indexer_loss=True)`` also trains the indexers (:func:`.loss.pooled_loss`): per
token the KL of the selected pools' scores against the main attention's mass on each selected
pool (summed over heads and over the pool's keys, L1-normalised over the selected pools; the
tail, which the indexer does not choose, left out), on the indexer's input detached (as
DeepSeek-V3.2's indexer loss); transformers trains no indexer (its indexer runs under
``no_grad``).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers.models.glm5_next import modeling_glm5_next as _glm5_next

from ...api import lightning_indexer, lightning_indexer_scores, sparse_mla
from . import loss as _loss
from .arguments import check_call, the_cache
from .head_matmul import head_matmul
from .indexer import head_weights, quantized, selects_in_fp8
from .pooling import last_entry_seen, softmax_pool
from .visibility import gather_seen, scatter_back

LAYERS = (_glm5_next.Glm5NextTextAttention,)
INDEXER_LOSS = True  # apply(model, indexer_loss=True) covers these layers (:func:`.loss.pooled_loss`)
# The model passes these layers its 2D padding mask [B, T], not a dense mask built from the
# config's attention implementation: apply leaves that implementation as it is.
VISIBILITY = False
_MASK = "the 2D padding mask [B, T] (bool) the model passes its indexed_attention layers"


class IndexerKeys(NamedTuple):
    """An indexer's keys over the ``S`` keys the layer attends to (this call's tokens, or the
    cache's), and where this call's tokens lie among them."""

    keys: Tensor  # [B, S, index_head_dim], k_norm(wk(x)), the layer's dtype
    gates: Tensor  # [B, S, index_head_dim], the gate scores x @ index_kpool_compress_gateᵀ
    real: Tensor  # [B, S] bool: not padding (the model's padding mask, cached)
    positions: Tensor  # [T] int64: each of this call's tokens' key index


class Selection(NamedTuple):
    """The pools each token selects and its slots."""

    slots: Tensor  # [B, T, W] int32 key indices, -1 = empty (module docstring)
    length: Tensor  # [B, T] int32: the slots up to the tail's end (sparse_mla's topk_length)
    pools: Tensor  # [B, T, K] int32: the selected pools, ascending, then -1
    pool_slots: Tensor  # [B, T] int32: the slots of the selected pools, kpool per pool
    logits: Tensor | None  # [B, T, K] float32 scores of the pools, with their graph, or None
    n_pools: int  # the pools P = S // kpool a row can have


def indexer_keys(indexer: nn.Module, hidden_states: Tensor, real: Tensor, cache) -> IndexerKeys:
    """The indexer's keys and gate scores of this call's tokens, appended with the padding mask
    ``real [B, T]`` to the cache's indexer state (``cache.update_indexer``, once, detached, as
    transformers packs it) when there is a cache; then the cache's, unless it held nothing before
    (this call's own, with their graph). ``hidden_states [B, T, hidden_size]``."""
    T = hidden_states.shape[1]
    keys = indexer.k_norm(indexer.wk(hidden_states))
    gates = F.linear(hidden_states, indexer.index_kpool_compress_gate)
    if cache is None:
        return IndexerKeys(keys, gates, real, torch.arange(T, device=keys.device))
    packed = torch.cat((keys.detach(), gates.detach(), real.to(keys.dtype)[..., None]), -1)
    packed = cache.update_indexer(packed, indexer.layer_idx)
    # the model's own rule: its cache positions end at the cache's length (a static cache's
    # buffer is longer)
    current = cache.layers[indexer.layer_idx].get_seq_length()
    positions = torch.arange(T, device=keys.device) + (current - T)
    if packed.shape[1] == T:  # the cache held nothing before: this call's keys, with grad
        return IndexerKeys(keys, gates, real, positions)
    D = indexer.head_dim
    keys, gates, flag = packed.split([D, D, 1], -1)
    return IndexerKeys(keys, gates, flag[..., 0].bool(), positions)


def select(indexer: nn.Module, hidden_states: Tensor, q_resid: Tensor, real_queries: Tensor,
           cache, *, scores: bool = False, fp8: bool = False) -> Selection:
    """The selection of ``indexer`` (a ``Glm5NextTextIndexer``) for this call's tokens on
    :func:`mla_inductor.lightning_indexer` (module docstring). Runs without grad, unless
    ``scores``: then the pools' scores (the indexer loss's logits) are computed with grad on
    ``hidden_states`` and ``q_resid`` detached, differentiable in the indexer's parameters
    (its projections, norm, gate and ``ape``). ``fp8``: the pools are selected on the queries
    and pooled keys quantised per row (:func:`.indexer.quantized`); the scores stay the
    unquantised ones.

    Args:
        hidden_states: ``[B, T, hidden_size]``, the layer's input.
        q_resid: ``[B, T, q_lora_rank]``, ``q_a_layernorm(q_a_proj(hidden_states))``.
        real_queries: ``[B, T]`` bool, the model's padding mask of this call's tokens.
        cache: the model's cache or None (:func:`indexer_keys`).
    """
    with torch.set_grad_enabled(scores and torch.is_grad_enabled()):
        hidden_states, q_resid = hidden_states.detach(), q_resid.detach()
        found = indexer_keys(indexer, hidden_states, real_queries, cache)
        B, T = q_resid.shape[:2]
        S, D = found.keys.shape[1:]
        kpool = indexer.index_kpool
        P = S // kpool
        real = found.real
        first = torch.where(real.any(-1), real.long().argmax(-1), S)  # [B]
        # every pool's keys, from the row's first real key (pools past S are never selectable)
        tokens = first[:, None] + torch.arange(P * kpool, device=real.device)
        rows = torch.arange(B, device=real.device)[:, None]
        at = tokens.clamp(max=S - 1)
        whole = (real[rows, at] & (tokens < S)).view(B, P, kpool).all(-1)  # [B, P]
        pooled = softmax_pool(found.keys[rows, at].view(B, P, kpool, D),
                              found.gates[rows, at].view(B, P, kpool, D).float()
                              + indexer.index_kpool_compress_ape.float())
        # real keys up to each token (transformers' visible count) and its last pool
        pos = found.positions
        # (the count runs over S + 1 entries, 0 first: inductor then keeps its scan apart from
        # the reductions over the S keys above, which torch 2.11's split-scan kernel cannot hold)
        counts = torch.nn.functional.pad(real.long(), (1, 0)).cumsum(-1)  # [B, S + 1]
        visible = counts.gather(1, pos.expand(B, T) + 1)
        last_pool = last_entry_seen(pos - first[:, None], kpool)
        K = min(indexer.index_topk // kpool, P)
        pools, logits = _top_pools(indexer, hidden_states, q_resid, pooled, whole, last_pool, K,
                                   scores, fp8)
    slots, length, pool_slots = expand_pools(
        pools, first, visible, pos, real, real_queries, kpool,
        tail=indexer.index_kpool_always_select_tail)
    return Selection(slots, length, pools, pool_slots, logits, P)


def _top_pools(indexer: nn.Module, hidden_states: Tensor, q_resid: Tensor, pooled: Tensor,
               whole: Tensor, last_pool: Tensor, K: int, scores: bool, fp8: bool):
    """``(pools [B, T, K] int32, logits [B, T, K] float32 or None)``: each token's ``K`` pools of
    largest score among the whole pools (``whole [B, P]``) up to ``last_pool [B, T]``, ascending,
    then -1."""
    B, T = q_resid.shape[:2]
    if K == 0:  # no complete pool fits in the keys
        empty = torch.full((B, T, 0), -1, dtype=torch.int32, device=q_resid.device)
        return empty, (empty.float() if scores else None)
    q = indexer.wq_b(q_resid).view(B, T, indexer.n_heads, indexer.head_dim)
    w = head_weights(indexer, hidden_states)
    keys, positions, order = gather_seen(pooled.to(q.dtype), whole, last_pool)
    logits = None
    if fp8:
        q8, keys8, scales = quantized(q.detach(), keys.detach())
        picked = lightning_indexer(q8, keys8, w.detach(), K, causal=True, q_positions=positions,
                                   **scales)
        if scores:
            logits = lightning_indexer_scores(q, keys, w, picked)
    elif scores:
        picked, logits = lightning_indexer(q, keys, w, K, causal=True, q_positions=positions,
                                           return_scores=True)
    else:
        picked = lightning_indexer(q, keys, w, K, causal=True, q_positions=positions)
    return scatter_back(picked, order), logits


def expand_pools(pools: Tensor, first: Tensor, visible: Tensor, positions: Tensor, real: Tensor,
                 real_queries: Tensor, kpool: int, tail: bool) -> tuple[Tensor, Tensor, Tensor]:
    """The slots of the selected pools and the tail, by index arithmetic on the pools (no gather
    of ``[B, T, slots]`` elements; under ``torch.compile`` one fused kernel).

    Per token: the keys ``first + p·kpool + i`` (``i < kpool``) of each selected pool ``p`` in
    order, then, with ``tail``, the unfinished pool's keys ``first + visible - r + i`` for ``i <
    r = visible % kpool`` (transformers' formula; a tail key that is padded, past the token, past
    the keys or in a selected pool is -1), then -1. A padded query token's slots are all -1.

    Args:
        pools: ``[B, T, K]`` int32, the selected pools ascending, then -1.
        first: ``[B]`` integer, each row's first real key (``S`` for none).
        visible: ``[B, T]`` integer, the real keys up to each token.
        positions: ``[T]`` integer, each token's key index.
        real: ``[B, S]`` bool, the keys that are not padding.
        real_queries: ``[B, T]`` bool, the tokens that are not padding.
        kpool: keys per pool.
        tail: whether the unfinished pool's keys follow (``index_kpool_always_select_tail``).

    Returns:
        ``(slots [B, T, K·kpool + kpool - 1] int32 (``K·kpool`` without the tail), length [B, T]
        int32: the slots up to the tail's end, pool_slots [B, T] int32: the selected pools'
        slots)``.
    """
    B, T, K = pools.shape
    S = real.shape[1]
    device = pools.device
    n = (pools >= 0).sum(-1, dtype=torch.int32)  # selected pools, first in their row
    i = torch.arange(kpool, dtype=torch.int32, device=device)
    first = first.to(torch.int32)[:, None, None]
    base = first + pools * kpool  # [B, T, K]: each pool's first key
    taken = (torch.arange(K, dtype=torch.int32, device=device) < n[..., None])[..., None]
    if tail and kpool > 1:
        rest = (visible % kpool).to(torch.int32)  # the unfinished pool's keys
        start = first[..., 0] + visible.to(torch.int32) - rest  # [B, T]
        keys = start[..., None] + i  # [B, T, kpool]: the tail pool, its last key never taken
        fits = (i < rest[..., None]) & (keys < S) & (keys <= positions[:, None])
        fits &= real.gather(1, keys.clamp(max=S - 1).view(B, T * kpool)).view(B, T, kpool)
        if K:  # with padding inside a row a tail key can lie in a selected pool: named once
            fits &= ~_in_pools((keys - first) // kpool, pools)
        # the tail goes in pool column n: the row's slots stay ascending and without gaps
        column = torch.arange(K + 1, dtype=torch.int32, device=device)
        at_tail = (column == n[..., None])[..., None]  # [B, T, K + 1, 1]
        base = torch.where(at_tail[..., 0], start[..., None], F.pad(base, (0, 1)))
        taken = (column < n[..., None])[..., None] | (at_tail & fits[:, :, None, :])
        width = (K + 1) * kpool - 1
        length = n * kpool + rest
    else:
        width = K * kpool
        length = n * kpool
    slots = torch.where(taken & real_queries[:, :, None, None], base[..., None] + i, -1)
    slots = slots.flatten(-2)[..., :width]
    length = torch.where(real_queries, length, 0)
    return slots, length, torch.where(real_queries, n * kpool, 0)


def _in_pools(pool: Tensor, pools: Tensor) -> Tensor:
    """``[B, T, n]`` bool: whether ``pool [B, T, n]`` is one of the row's selected ``pools [B, T,
    K]`` (ascending, then -1; K > 0), by binary search (O(n log K) a row)."""
    ascending = torch.where(pools >= 0, pools, torch.iinfo(torch.int32).max)
    at = torch.searchsorted(ascending, pool.to(ascending.dtype)).clamp(max=pools.shape[-1] - 1)
    return ascending.gather(-1, at) == pool


def _slots_length(slots: Tensor) -> Tensor:
    """``[B, T]`` int32: each row's last non-empty slot, plus 1 (a shared layer's
    ``topk_length`` over the previous layer's slots)."""
    at = torch.arange(1, slots.shape[-1] + 1, dtype=torch.int32, device=slots.device)
    return torch.where(slots >= 0, at, 0).amax(-1)


def _attention(attn: nn.Module, hidden_states: Tensor, attention_mask: Tensor, cache,
               prev_topk_indices, kwargs) -> tuple[Tensor, Tensor]:
    """One layer's attention on the ops (module docstring); returns the layer's output ``[B, T,
    hidden_size]`` and its slots."""
    check_call(attn, attention_mask, _MASK)
    B, T = hidden_states.shape[:-1]
    if tuple(attention_mask.shape) != (B, T):
        raise RuntimeError(
            f"mla_inductor: the switched {type(attn).__name__} takes {_MASK}, got a mask of "
            f"shape {tuple(attention_mask.shape)} for {B} x {T} tokens"
        )
    real_queries = attention_mask.to(torch.bool)
    H, nope, v_dim, rank = attn.num_heads, attn.qk_nope_head_dim, attn.v_head_dim, attn.kv_lora_rank

    q_resid = attn.q_a_layernorm(attn.q_a_proj(hidden_states))
    q_nope = attn.q_b_proj(q_resid).view(B * T, H, nope)
    latent, k_rot = attn.kv_a_proj_with_mqa(hidden_states).split(
        [rank, attn.qk_rope_head_dim], -1)
    # [B, 1, T, .]: the layout the model's cache stores (and its forward writes)
    latent = attn.kv_a_layernorm(latent).view(B, 1, T, rank)
    k_rot = k_rot.view(B, 1, T, attn.qk_rope_head_dim)
    if cache is not None:
        latent, k_rot = cache.update(latent, k_rot, attn.layer_idx, kwargs=kwargs)
    kv = latent[:, 0]  # [B, S, rank]

    loss_on, chosen = _loss.active(attn), None
    if attn.indexer is not None:
        chosen = select(attn.indexer, hidden_states, q_resid, real_queries, cache,
                        scores=loss_on, fp8=selects_in_fp8(attn))
        slots, length = chosen.slots, chosen.length
    elif prev_topk_indices is None:
        raise RuntimeError(
            f"mla_inductor: layer {attn.layer_idx} reuses the previous layer's selection (a "
            "'shared' indexer layer) but got prev_topk_indices=None; run it inside its model, "
            "right after a 'full' indexed_attention layer"
        )
    else:
        slots = prev_topk_indices
        length = _slots_length(slots)

    w = attn.kv_b_proj.weight.view(H, nope + v_dim, rank)
    q = head_matmul(q_nope, w[:, :nope], None).view(B, T, H, rank)  # q_nope @ W_uk
    if loss_on:
        o_lat, lse = sparse_mla(q, kv, slots, sm_scale=attn.scaling, d_v=rank,
                                topk_length=length, return_lse=True)
        _loss.keep(attn, _loss.pooled_loss(q, kv, slots, lse, attn.scaling, chosen.pool_slots,
                                           chosen.logits, chosen.pools, chosen.n_pools,
                                           attn.indexer.index_kpool))
    else:
        o_lat = sparse_mla(q, kv, slots, sm_scale=attn.scaling, d_v=rank, topk_length=length)
    out = head_matmul(o_lat.reshape(B * T, H, rank), w[:, nope:].transpose(1, 2), None)
    return attn.o_proj(out.view(B, T, H * v_dim)), slots


def forward(attn, hidden_states, attention_mask, cache=None, prev_topk_indices=None,
            past_key_values=None, **kwargs):
    """The switched ``Glm5NextTextAttention`` forward, bound to the layer as a method. Takes what
    transformers' forward takes (the 2D padding mask ``[B, T]`` the model passes, the cache as
    ``cache=`` or ``past_key_values=``, ``prev_topk_indices`` for a ``shared`` layer; the rest,
    ``position_ids``, ``position_embeddings`` (None: no RoPE), is unused, as there) and returns
    ``(output [B, T, hidden_size], None, slots [B, T, W] int32 where the next layer is a shared
    one, else None)``."""
    cache = the_cache(cache, past_key_values)
    out, slots = _attention(attn, hidden_states, attention_mask, cache, prev_topk_indices, kwargs)
    return out, None, slots if attn.next_skip_topk else None
