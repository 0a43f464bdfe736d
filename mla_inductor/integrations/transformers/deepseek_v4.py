"""Hugging Face transformers' DeepSeek-V4 attention (``models/deepseek_v4``) on
:func:`mla_inductor.sparse_mla`.

transformers 5.24's ``DeepseekV4Attention`` has three layer types (DeepSeek-AI, "DeepSeek-V4",
2026, section 2.3). Each attends over one shared key-and-value row per token (``head_dim`` 512,
RoPE on its last 64 channels, one learnable sink per head):

- ``sliding_attention``: the last ``sliding_window`` tokens (128);
- ``compressed_sparse_attention`` (CSA): the window plus the ``index_topk`` (512) compressed
  entries a lightning indexer picks; an entry pools ``2·m`` tokens (``m = 4``, overlapping by
  ``m``) with a softmax gate;
- ``heavily_compressed_attention`` (HCA): the window plus every visible entry of ``m' = 128``
  tokens.

transformers computes it as dense attention over ``cat(window keys, compressed entries)`` under an
additive mask ``[B, 1, T, S + C]`` and float32 logits ``[B, H, T, S + C]`` (21 GiB per layer at T
8192 with 64 heads), and its CSA indexer scores ``[B, T, index_n_heads, C]``. :func:`forward`
computes the same attention as the op's slots instead:

    sparse_mla(q [B, T, H, D], cat(kv, compressed) [B, S + C, D], indices, sm_scale=layer.scaling,
               d_v=D, topk_length=..., attn_sink=layer.sinks)

with, per token, the window's keys ``pos - W + 1 .. pos`` (-1 below 0 or where the padding mask
hides them), then ``S + j`` for the compressed entries ``j`` the layer uses: the indexer's picks
(CSA, :func:`mla_inductor.lightning_indexer` with the indexer's causal rule ``j < (p + 1) // m``,
``p`` the token's ``position_ids``), or every entry with ``j < (p + 1) // m'`` (HCA; every entry
for a single token, as transformers' decoding step). The used entries come first in their part,
and ``topk_length`` (the window's width plus the used entries) makes the op's kernels skip the
unused ones. The
compressors and the indexer run the layer's own modules and parameters (projections, gates,
position biases, norms, rotary embeddings) and the model's cache (sliding keys, compressor
buffers, compressed entries, overlap state) exactly as transformers' forward does, so gradients
reach them as there. The indexer's selection is its own definition in float32 on the op, not
bitwise transformers' (at a near-tie it may keep the other entry; exact ties go to the smaller
entry index). No dense mask, no ``[T, S]`` or ``[T, S + C]`` tensor and no indexer scores are
formed; the slots are ``[B, T, W + index_topk]`` (CSA) or ``[B, T, W + C]`` (HCA, ``C = T/128``).

Under a dense mask (packed sequences, or another attention implementation set after ``apply``)
every window key is a slot (-1 where the mask hides it): the same attention, O(T·S) like the
mask itself. The compressed entries follow transformers there too: its compressors pool across
the packed sequences' boundaries and its causal rule reads ``position_ids``, so a packed
sequence's token sees the entries of the tokens before it in the pack.

DeepSeek-V4's indexer is not trained by a loss of its own here: transformers' V4 selects under no
gradient path and ships no indexer loss, and the V4 report's training recipe for the CSA indexer
is not what the V3.2 KL loss computes over compressed entries (see :data:`NO_INDEXER_LOSS`).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor, nn
from transformers.models.deepseek_v4 import modeling_deepseek_v4 as _v4

from ...api import lightning_indexer, sparse_mla
from .arguments import check_call, the_cache
from .indexer import quantized, selects_in_fp8
from .pooling import last_entry_seen, softmax_pool
from .visibility import Visibility, dense_seen

LAYERS = (_v4.DeepseekV4Attention,)
INDEXER_LOSS = False
VISIBILITY = True  # apply sets ATTN_IMPLEMENTATION: the model builds no dense mask
NO_INDEXER_LOSS = (
    "DeepSeek-V4's indexer picks compressed entries, and the indexer loss implemented here is "
    "DeepSeek-V3.2's KL over selected tokens; transformers' V4 trains no indexer loss either. "
    "Call apply(model) without it"
)
_CSA = "compressed_sparse_attention"


def _pool(module: nn.Module, name: str, hidden_states: Tensor, cache_layer, head_dim: int,
          overlap: bool) -> Tensor:
    """The compressed entries ``[B, C, head_dim]`` of ``module`` (a V4 compressor or indexer: its
    ``kv_proj``, ``gate_proj``, ``position_bias``, ``kv_norm``, ``rotary_emb`` and
    ``compress_rate`` m), as its transformers forward computes them: each window of m tokens pooled
    by a softmax gate over the tokens (float32 softmax), RMS-normed, RoPE'd at the window's first
    position; with ``overlap`` (CSA) over ``2·m`` tokens, window ``w``'s second half (``[...,
    head_dim:]`` of the projections) with window ``w - 1``'s first half. With ``cache_layer`` (the
    model's ``DeepseekV4CSACache`` / ``DeepseekV4HCACache``) the tokens of an unfinished window
    wait in its buffer, the overlap state carries over, and every entry so far is returned;
    without, the tokens past the last full window are dropped."""
    B = hidden_states.shape[0]
    m = module.compress_rate
    kv, gate = module.kv_proj(hidden_states), module.gate_proj(hidden_states)
    if cache_layer is None:  # the tokens past the last full window are left out below
        chunk_kv, chunk_gate, first = kv, gate, 0
    else:
        chunk_kv, chunk_gate, first = cache_layer.store_compression_weights(name, kv, gate)
    n = chunk_kv.shape[1] // m
    if n == 0:
        compressed = chunk_kv.new_zeros((B, 0, head_dim))
    else:
        # windows as [B, n, D, m] views (unfold: the tokens past the last full window left
        # out), reduced over their last dimension: a view of a token slice, or its transpose,
        # would make torch.compile guard on T being a multiple of m
        chunk_kv = chunk_kv.unfold(1, m, m)
        chunk_gate = chunk_gate.unfold(1, m, m) + module.position_bias.t()
        if overlap:
            pooled_kv = chunk_kv.new_zeros((B, n, head_dim, 2 * m))
            pooled_gate = chunk_gate.new_full((B, n, head_dim, 2 * m), float("-inf"))
            pooled_kv[..., m:] = chunk_kv[:, :, head_dim:]
            pooled_gate[..., m:] = chunk_gate[:, :, head_dim:]
            pooled_kv[:, 1:, :, :m] = chunk_kv[:, :-1, :head_dim]
            pooled_gate[:, 1:, :, :m] = chunk_gate[:, :-1, :head_dim]
            if cache_layer is not None:  # it keeps [B, m, head_dim] windows
                prior_kv, prior_gate = cache_layer.update_overlap_state(
                    name, chunk_kv.transpose(-1, -2), chunk_gate.transpose(-1, -2), head_dim)
                if prior_kv is not None:
                    pooled_kv[:, 0, :, :m] = prior_kv.transpose(-1, -2).to(pooled_kv.dtype)
                    pooled_gate[:, 0, :, :m] = prior_gate.transpose(-1, -2).to(pooled_gate.dtype)
            chunk_kv, chunk_gate = pooled_kv, pooled_gate
        compressed = module.kv_norm(softmax_pool(chunk_kv, chunk_gate, dim=-1))
        positions = (torch.arange(n, device=compressed.device) * m + first).expand(B, n)
        cos, sin = module.rotary_emb(compressed, position_ids=positions,
                                     layer_type=module.rope_layer_type)
        compressed = _v4.apply_rotary_pos_emb(compressed.unsqueeze(1), cos, sin).squeeze(1)
    if cache_layer is not None:
        compressed = cache_layer.update_compressor_states(name, compressed)
    return compressed


def _indexer_topk(indexer: nn.Module, hidden_states: Tensor, q_residual: Tensor,
                  position_ids: Tensor, cache_layer, fp8: bool) -> Tensor:
    """The CSA indexer's picks ``[B, T, min(index_topk, C)]`` int32 (ascending entry index, then
    -1), on :func:`mla_inductor.lightning_indexer`: ``sum_h w[t, h] · relu(q[t, h] · k[j])``
    with ``w = weights_proj(x) · index_n_heads**-0.5 · softmax_scale`` (the scale folded into the
    head weights: ``relu(a·x) = a·relu(x)`` for ``a > 0``), over the entries ``j < (p + 1) //
    m`` (``p`` the token's ``position_ids``); with ``fp8`` on the queries and keys quantised per
    row (:func:`.indexer.quantized`). All of it runs without grad: in transformers no gradient
    reaches the indexer either (its top-k has none), so only its memory differs."""
    B, T, _ = hidden_states.shape
    with torch.no_grad():
        keys = _pool(indexer, "indexer", hidden_states, cache_layer, indexer.head_dim,
                     overlap=True)
        cos, sin = indexer.rotary_emb(hidden_states, position_ids=position_ids,
                                      layer_type=indexer.rope_layer_type)
        q = indexer.q_b_proj(q_residual).view(B, T, indexer.num_heads, indexer.head_dim)
        q = _v4.apply_rotary_pos_emb(q, cos, sin, unsqueeze_dim=2)
        scorer = indexer.scorer
        w = scorer.weights_proj(hidden_states).float() * (scorer.weights_scaling
                                                          * scorer.softmax_scale)
        seen_last = last_entry_seen(position_ids, indexer.compress_rate)
        keys, scales = keys.to(q.dtype), {}
        if fp8:
            q, keys, scales = quantized(q, keys)
        return lightning_indexer(q, keys, w, min(indexer.index_topk, keys.shape[1]), causal=True,
                                 q_positions=seen_last.expand(B, T), **scales)


def _window_slots(mask, B: int, T: int, S: int) -> Tensor:
    """The window's slots ``[B, T, n]`` int64 (-1 = empty) from the model's mask over the ``S``
    window keys: a :class:`Visibility` (keys ``pos - W + 1 .. pos``, n = W, or every key up to
    ``pos`` without a window) or a dense mask ``[B or 1, 1, T, S]`` (every key a slot, -1 where
    hidden: n = S)."""
    if not isinstance(mask, Visibility):
        seen = dense_seen(mask[:, 0]).expand(B, T, S)
        return torch.where(seen, torch.arange(S, device=seen.device), -1)
    n = S if mask.window is None else mask.window
    pos = mask.positions.long().expand(B, T)
    slots = pos[..., None] - (n - 1) + torch.arange(n, device=pos.device)
    valid = (slots >= 0) & (slots < S)
    if mask.keys is not None:
        valid &= mask.keys.gather(1, slots.clamp(0, S - 1).view(B, T * n)).view(B, T, n)
    return torch.where(valid, slots, -1)


def _compressed_slots(attn: nn.Module, compressed: Tensor, hidden_states: Tensor,
                      q_residual: Tensor, position_ids: Tensor, cache_layer
                      ) -> tuple[Optional[Tensor], Optional[Tensor]]:
    """The compressed entries' slots ``[B, T, n]`` (entry indices, -1 = empty, used ones first)
    and their count of used ones ``[B, T]``, or ``(None, None)`` without entries."""
    B, T, _ = hidden_states.shape
    C = compressed.shape[1]
    if attn.layer_type == _CSA:
        picked = _indexer_topk(attn.compressor.indexer, hidden_states, q_residual, position_ids,
                               cache_layer, selects_in_fp8(attn))
        return (picked, (picked >= 0).sum(-1)) if C else (None, None)
    if C == 0:
        return None, None
    entries = torch.arange(C, device=compressed.device).expand(B, T, C)
    if T == 1:  # transformers' decoding step: every entry so far is complete
        return entries, torch.full((B, T), C, device=compressed.device)
    visible = ((position_ids + 1) // attn.compressor.compress_rate).expand(B, T).clamp(0, C)
    return torch.where(entries < visible[..., None], entries, -1), visible


def _attention(attn: nn.Module, hidden_states: Tensor, position_embeddings, position_ids: Tensor,
               attention_mask, cache, kwargs) -> Tensor:
    """One V4 layer's attention and output projection on the op (module docstring); returns
    ``[B, T, hidden_size]``."""
    check_call(attn, attention_mask)
    B, T, _ = hidden_states.shape
    H, D = attn.num_heads, attn.head_dim
    cos, sin = position_embeddings[attn.rope_layer_type]

    q_residual = attn.q_a_norm(attn.q_a_proj(hidden_states))
    q = attn.q_b_norm(attn.q_b_proj(q_residual).view(B, T, H, D))
    q = _v4.apply_rotary_pos_emb(q, cos, sin, unsqueeze_dim=2)
    kv = attn.kv_norm(attn.kv_proj(hidden_states)).view(B, T, 1, D).transpose(1, 2)
    kv = _v4.apply_rotary_pos_emb(kv, cos, sin)  # [B, 1, T, D]: the cache's layout
    if cache is not None:
        kv = cache.update(kv, kv, attn.layer_idx, kwargs=kwargs)[0]
    kv = kv[:, 0]  # [B, S, D]
    S = kv.shape[1]
    position_ids = position_ids.expand(B, T)

    indices = _window_slots(attention_mask, B, T, S)
    length = torch.full((B, T), indices.shape[-1], device=kv.device)
    if attn.compressor is not None:
        cache_layer = cache.layers[attn.layer_idx] if cache is not None else None
        compressed = _pool(attn.compressor, "compressor", hidden_states, cache_layer, D,
                           overlap=attn.layer_type == _CSA)
        entries, used = _compressed_slots(attn, compressed, hidden_states, q_residual,
                                          position_ids, cache_layer)
        if entries is not None:
            # the window's slots, then the used entries' (slots past length are empty)
            kv = torch.cat((kv, compressed), 1)
            indices = torch.cat((indices, torch.where(entries >= 0, entries + S, -1)), -1)
            length = length + used
    out = sparse_mla(q, kv, indices.to(torch.int32), sm_scale=attn.scaling, d_v=D,
                     topk_length=length.to(torch.int32), attn_sink=attn.sinks)
    # K = V: the values carry RoPE on their last channels; rotate the output back at the query
    out = _v4.apply_rotary_pos_emb(out, cos, -sin, unsqueeze_dim=2)
    grouped = attn.o_a_proj(out.reshape(B, T, attn.config.o_groups, -1)).flatten(2)
    return attn.o_b_proj(grouped)


def forward(attn, hidden_states, position_embeddings, position_ids, attention_mask, cache=None,
            past_key_values=None, **kwargs):
    """The switched ``DeepseekV4Attention`` forward, bound to the layer as a method. Takes what
    transformers' forward takes (``position_embeddings`` the model's ``{"main", "compress"}``
    dict of ``(cos, sin)``, ``position_ids [B or 1, T]``, the mask the model built, the cache as
    ``cache=`` or ``past_key_values=``) and returns ``(output [B, T, hidden_size], None)``."""
    cache = the_cache(cache, past_key_values)
    return _attention(attn, hidden_states, position_embeddings, position_ids, attention_mask,
                      cache, kwargs), None
