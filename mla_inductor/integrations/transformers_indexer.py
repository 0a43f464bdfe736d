"""transformers' DSA indexer (DeepSeek-V3.2, GLM-5) computed in query chunks.

transformers 5.24's ``DeepseekV32Indexer`` / ``GlmMoeDsaIndexer`` score every query against every
key at once: float32 ``[B, T, index_n_heads, S]`` (64 GiB at T = S = 16384 with 64 heads), and
its broadcast ``matmul`` also copies the float32 keys once per query token (``[B·T, head_dim,
S]``, 128 GiB there). :func:`indexer_topk` returns the same top-k from the same module's
parameters and functions, one chunk of query tokens at a time, so that the float32 scores alive
at once are ``[chunk, index_n_heads, S]``, at most :data:`SCORE_BYTES`.

Per query token ``t`` and key ``s`` (the indexer's own definition):
``score[t, s] = sum_h w[t, h] · relu(softmax_scale · q[t, h] · k[s])`` with
``w = weights_proj(x) · n_heads**-0.5``, then the model's mask, then the ``min(index_topk, S)``
largest. Each chunk multiplies the same matrices the model multiplies (per token, ``q[t]`` ``[H,
D]`` by the keys ``[D, S]`` laid out as the model's ``matmul`` lays them out), so on the CPU the
scores and the indices are bitwise the model's for any chunk size; a GPU library may pick other
kernels for other batch counts, which can change a score's last bit and, at a tie, which of two
equal-scored keys is kept.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor, nn

# The largest float32 score tensor one chunk may hold: 256 MiB.
SCORE_BYTES = 2**28


def chunk_tokens(n_heads: int, S: int, score_bytes: int) -> int:
    """Query tokens per chunk: as many as keep ``[chunk, n_heads, S]`` float32 (4 bytes each)
    within ``score_bytes``; at least 1."""
    return max(1, score_bytes // (n_heads * S * 4))


def _queries_and_keys(indexer, rope, hidden_states, q_resid, position_embeddings):
    """The indexer's queries ``[B, T, n_heads, head_dim]`` and this call's keys ``[B, T,
    head_dim]``, in the layer's dtype, RoPE on their first ``qk_rope_head_dim`` channels (the
    intermediates are freed on return)."""
    B, T, _ = hidden_states.shape
    H, D, rot = indexer.n_heads, indexer.head_dim, indexer.qk_rope_head_dim
    q_rot, q_pass = indexer.wq_b(q_resid).view(B, T, H, D).split([rot, D - rot], -1)
    k_rot, k_pass = indexer.k_norm(indexer.wk(hidden_states)).unsqueeze(2).split([rot, D - rot], -1)
    q_rot, k_rot = rope(q_rot, k_rot, *position_embeddings, unsqueeze_dim=2)
    return torch.cat((q_rot, q_pass), -1), torch.cat((k_rot, k_pass), -1).squeeze(2)


@torch.no_grad()
def indexer_topk(indexer: nn.Module, rope: Callable, hidden_states: Tensor, q_resid: Tensor,
                 position_embeddings: tuple[Tensor, Tensor], attention_mask: Tensor,
                 cache=None, *, score_bytes: int | None = None) -> Tensor:
    """The top-k keys of each query token, as ``indexer(hidden_states, q_resid,
    position_embeddings, attention_mask, position_ids, cache=cache)`` returns them, in query chunks
    (module docstring).

    Args:
        indexer: the layer's ``DeepseekV32Indexer`` or ``GlmMoeDsaIndexer``; its ``wq_b``, ``wk``,
            ``k_norm``, ``weights_proj``, ``softmax_scale``, ``n_heads``, ``head_dim``,
            ``qk_rope_head_dim``, ``index_topk`` and ``layer_idx`` are used.
        rope: the RoPE the model's indexer applies to its first ``qk_rope_head_dim`` channels,
            called as ``rope(q, k, cos, sin, unsqueeze_dim=2)``: DeepSeek-V3.2's
            ``apply_rotary_pos_emb`` (half-split), GLM-5's ``apply_rotary_pos_emb_interleave``.
        hidden_states: ``[B, T, hidden_size]``, the layer's input.
        q_resid: ``[B, T, q_lora_rank]``, ``q_a_layernorm(q_a_proj(hidden_states))``.
        position_embeddings: ``(cos, sin)``, each ``[B, T, qk_rope_head_dim]``.
        attention_mask: ``[B or 1, T, S]``, bool (True = seen) or additive float, the model's
            4D mask without its head axis.
        cache: the model's cache or None; with one, this call's indexer keys are appended
            through ``cache.update_indexer`` (exactly once, as the model's indexer does) and the
            scores cover every cached key.
        score_bytes: the budget of one chunk's float32 scores (:func:`chunk_tokens`); None:
            :data:`SCORE_BYTES`, read at each call.

    Returns:
        ``[B, T, min(index_topk, S)]`` int32, key positions in ``[0, S)``, in descending score
        order.
    """
    B, T, _ = hidden_states.shape
    H = indexer.n_heads
    q, k = _queries_and_keys(indexer, rope, hidden_states, q_resid, position_embeddings)
    if cache is not None:
        k = cache.update_indexer(k, indexer.layer_idx)  # [B, S, D]
    S = k.shape[1]
    proj = indexer.weights_proj
    w = proj(hidden_states.to(proj.weight.dtype)).float() * H**-0.5  # [B, T, H]
    mask = attention_mask.expand(B, T, S)
    topk = min(indexer.index_topk, S)
    out = torch.empty(B, T, topk, dtype=torch.int32, device=hidden_states.device)
    chunk = chunk_tokens(H, S, SCORE_BYTES if score_bytes is None else score_bytes)
    for b in range(B):
        keys = k[b].float().T.contiguous()  # [D, S], S fastest: as the model's matmul reads them
        for t0 in range(0, T, chunk):
            t1 = min(t0 + chunk, T)
            out[b, t0:t1] = _chunk_topk(q[b, t0:t1], keys, w[b, t0:t1], mask[b, t0:t1],
                                        indexer.softmax_scale, topk)
    return out


def _chunk_topk(q: Tensor, keys: Tensor, w: Tensor, seen: Tensor, scale: float,
                topk: int) -> Tensor:
    """One chunk of ``c`` query tokens: ``q [c, H, D]`` (the layer's dtype), ``keys [D, S]``
    float32, ``w [c, H]`` float32, ``seen [c, S]`` bool or additive; returns the ``topk`` indices
    ``[c, topk]`` int64. Its float32 scores ``[c, H, S]`` are freed on return, before the next
    chunk's are made."""
    c, H, D = q.shape
    scores = torch.bmm(q.float(), keys.expand(c, D, keys.shape[1]))  # [c, H, S], q[t] @ keys
    scores.mul_(scale).relu_()
    summed = torch.bmm(w.unsqueeze(1), scores).squeeze(1)  # [c, S]
    if seen.dtype == torch.bool:
        summed.masked_fill_(~seen, float("-inf"))
    else:
        summed.add_(seen)
    return summed.topk(topk, dim=-1).indices
