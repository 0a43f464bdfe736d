"""transformers' DSA indexer (DeepSeek-V3.2, GLM-5) computed in query chunks.

transformers 5.24's ``DeepseekV32Indexer`` / ``GlmMoeDsaIndexer`` score every query against every
key at once: float32 ``[B, T, index_n_heads, S]`` (64 GiB at T = S = 16384 with 64 heads), and
its broadcast ``matmul`` also copies the float32 keys once per query token (``[B·T, head_dim,
S]``, 128 GiB there). :func:`indexer_topk` computes the same top-k from the same module's
parameters and functions, one chunk of query tokens at a time, so that the float32 scores alive
at once are ``[chunk, index_n_heads, S]``, at most :data:`SCORE_BYTES`.

Per query token ``t`` and key ``s`` (the indexer's own definition):
``score[t, s] = sum_h w[t, h] · relu(softmax_scale · q[t, h] · k[s])`` with
``w = weights_proj(x) · n_heads**-0.5``, then the model's mask, then the ``min(index_topk, S)``
largest. Each chunk computes it as ``softmax_scale · sum_h w[t, h] · relu(q[t, h] · k[s])`` (equal
in exact arithmetic, as ``relu(a·x) = a·relu(x)`` for ``a > 0``; the scale goes into the ``[c, H]``
weights): one float32 GEMM of the chunk's ``[c·H, D]`` queries by the keys ``[D, s_hi]``, ``relu``
in place, and a batched ``[1, H] x [H, s_hi]`` product for the weighted head sum (four passes over
the ``[c, H, s_hi]`` scores: the GEMM's write, relu's read and write, the sum's read).

Key truncation: ``s_hi`` is one past the last key that any row of the chunk sees (from the mask:
bool True, or additive above the dtype's minimum), so with a causal mask a chunk scores only the
keys up to its last token (about half the work of ``[T, S]`` at T = S, given several chunks: at
the default budget, T = S = 16384 with 64 heads makes 256 chunks of 64 tokens). A row that sees
fewer keys than ``index_topk`` gets its visible keys first (by score), then keys the mask hides
from it: hidden keys below ``s_hi`` (masked to -inf, or to about the dtype's minimum by an
additive mask), then ``s_hi, s_hi + 1, ...``, which no row of the chunk sees. transformers'
indexer names other hidden keys there (its choice among equal masked scores); the switched
attention empties every slot the mask hides, so the attention is the same. Under
``torch.compile`` the chunks score every key (``s_hi`` would be a data-dependent size).

Not bitwise transformers': a different GEMM (one per chunk instead of one per token) and the scale
applied after the head sum change the scores' last bits, and so, where two keys' scores are
within a few float32 ulps (a near-tie), which of them is kept; where scores are exactly equal
(keys at which every head's relu is 0 score exactly 0), topk's choice among them depends on the
width scored, so it can differ from transformers' and between chunk sizes. The selected keys'
scores agree with a float64 computation of the same definition to float32 rounding
(``tests/test_transformers_indexer.py``). On a GPU with a bfloat16 or float16 layer the score
GEMM multiplies the layer's own q and k into float32 (tensor cores: the same exact products,
float32 accumulation; :func:`_on_tensor_cores`); otherwise it is a float32 GEMM of the upcast
operands, which PyTorch's ``torch.backends.cuda.matmul.allow_tf32 = True`` makes TF32 on a GPU,
as it does transformers' ``matmul``.
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


def _rotate(rope: Callable, x: Tensor, position_embeddings: tuple[Tensor, Tensor]) -> Tensor:
    """``rope`` applied to ``x [B, T, n, qk_rope_head_dim]`` alone. The models' RoPE functions
    rotate a (q, k) pair, each tensor on its own; ``x``'s first head goes in as the k (1/n of the
    work, discarded), so the result is bitwise what the pair's call gives ``x``."""
    return rope(x, x[:, :, :1], *position_embeddings, unsqueeze_dim=2)[0]


def index_queries(indexer: nn.Module, rope: Callable, q_resid: Tensor,
                  position_embeddings: tuple[Tensor, Tensor]) -> Tensor:
    """The indexer's queries ``[B, T, n_heads, head_dim]`` in the layer's dtype, from ``q_resid
    [B, T, q_lora_rank]`` through ``indexer.wq_b``, RoPE (``rope``, as for :func:`indexer_topk`)
    on their first ``qk_rope_head_dim`` channels. Differentiable where grad is enabled."""
    B, T, _ = q_resid.shape
    H, D, rot = indexer.n_heads, indexer.head_dim, indexer.qk_rope_head_dim
    q_rot, q_pass = indexer.wq_b(q_resid).view(B, T, H, D).split([rot, D - rot], -1)
    return torch.cat((_rotate(rope, q_rot, position_embeddings), q_pass), -1)


def index_keys(indexer: nn.Module, rope: Callable, hidden_states: Tensor,
               position_embeddings: tuple[Tensor, Tensor]) -> Tensor:
    """This call's indexer keys ``[B, T, head_dim]`` in the layer's dtype, from ``hidden_states
    [B, T, hidden_size]`` through ``indexer.wk`` and ``indexer.k_norm``, RoPE on their first
    ``qk_rope_head_dim`` channels. Differentiable where grad is enabled."""
    D, rot = indexer.head_dim, indexer.qk_rope_head_dim
    k_rot, k_pass = indexer.k_norm(indexer.wk(hidden_states)).unsqueeze(2).split([rot, D - rot], -1)
    return torch.cat((_rotate(rope, k_rot, position_embeddings), k_pass), -1).squeeze(2)


def head_weights(indexer: nn.Module, hidden_states: Tensor) -> Tensor:
    """``[B, T, n_heads]`` float32: the model's head weights ``weights_proj(x) · n_heads**-0.5``
    with ``softmax_scale`` folded in (module docstring). Differentiable where grad is enabled."""
    proj = indexer.weights_proj
    scale = indexer.n_heads**-0.5 * indexer.softmax_scale
    return proj(hidden_states.to(proj.weight.dtype)).float() * scale


def _seen_widths(mask: Tensor, chunk: int) -> list[list[int]]:
    """``widths[b][i]``: one past the last key column that any row of chunk ``i`` (rows ``i·chunk``
    to ``(i + 1)·chunk``) of ``mask[b]`` sees, 0 where none does. ``mask [Bm, T, S]``, bool (True
    = seen) or additive float (seen where above the dtype's minimum; -inf and the minimum are
    hidden). One pass over the mask, temporaries ``[Bm, chunks, S]``, one synchronisation."""
    Bm, T, S = mask.shape
    full = T // chunk * chunk
    reduce = torch.any if mask.dtype == torch.bool else torch.amax
    parts = [reduce(mask[:, :full].unflatten(1, (T // chunk, chunk)), 2)] if full else []
    if full < T:
        parts.append(reduce(mask[:, full:], 1, keepdim=True))
    cols = torch.cat(parts, 1)  # [Bm, chunks, S]
    if mask.dtype != torch.bool:
        cols = cols > torch.finfo(mask.dtype).min
    ends = torch.arange(1, S + 1, dtype=torch.int32, device=mask.device)
    return torch.where(cols, ends, 0).amax(-1).tolist()


@torch.no_grad()
def indexer_topk(indexer: nn.Module, rope: Callable, hidden_states: Tensor, q_resid: Tensor,
                 position_embeddings: tuple[Tensor, Tensor], attention_mask: Tensor,
                 cache=None, *, score_bytes: int | None = None) -> Tensor:
    """The top-k keys of each query token, as ``indexer(hidden_states, q_resid,
    position_embeddings, attention_mask, position_ids, cache=cache)`` selects them, in query chunks
    (module docstring: the same definition, float32, not bitwise; hidden keys as filler).

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
        attention_mask: ``[B or 1, T, S]``, bool (True = seen) or additive float (the dtype's
            minimum or -inf = hidden), the model's 4D mask without its head axis.
        cache: the model's cache or None; with one, this call's indexer keys are appended
            through ``cache.update_indexer`` (exactly once, as the model's indexer does) and the
            scores cover every cached key.
        score_bytes: the budget of one chunk's float32 scores (:func:`chunk_tokens`); None:
            :data:`SCORE_BYTES`, read at each call.

    Returns:
        ``[B, T, min(index_topk, S)]`` int32, key positions in ``[0, S)``, distinct within a row:
        the keys the row sees in descending score order, then (where it sees fewer than
        ``index_topk``) keys its mask hides.
    """
    B, T, _ = hidden_states.shape
    H = indexer.n_heads
    q = index_queries(indexer, rope, q_resid, position_embeddings)
    k = index_keys(indexer, rope, hidden_states, position_embeddings)
    if cache is not None:
        k = cache.update_indexer(k, indexer.layer_idx)  # [B, S, D]
    S = k.shape[1]
    w = head_weights(indexer, hidden_states)
    topk = min(indexer.index_topk, S)
    out = torch.empty(B, T, topk, dtype=torch.int32, device=hidden_states.device)
    chunk = chunk_tokens(H, S, SCORE_BYTES if score_bytes is None else score_bytes)
    mask = attention_mask.expand(attention_mask.shape[0], T, S)  # [B or 1, T, S]
    starts = range(0, T, chunk)
    if torch.compiler.is_compiling():
        widths = [[S] * len(starts)]
    else:
        widths = _seen_widths(mask, chunk)
    for b in range(B):
        keys = k[b] if _on_tensor_cores(k) else k[b].float()  # [S, D]
        seen, row_widths = mask[min(b, mask.shape[0] - 1)], widths[min(b, len(widths) - 1)]
        for t0, width in zip(starts, row_widths):
            t1 = min(t0 + chunk, T)
            out[b, t0:t1] = _chunk_topk(q[b, t0:t1], keys[:width], w[b, t0:t1],
                                        seen[t0:t1, :width], topk)
    return out


def _on_tensor_cores(k: Tensor) -> bool:
    """Whether the score GEMMs take the layer's bfloat16 / float16 queries and keys as they are,
    with float32 output (CUDA only: ``torch.mm(..., out_dtype=torch.float32)``). Their products
    are exact in float32 either way (8- or 11-bit significands), so only the float32 accumulation
    differs from the float32 GEMM of the upcast operands. On the H200 (T = S = 16384, 64 index
    heads of 128, bf16, causal): the whole indexer 70 ms against 121 ms, and both keep the keys
    of the per-token float32 path in 99.99% of the rows."""
    return k.is_cuda and k.dtype in (torch.bfloat16, torch.float16)


def _chunk_topk(q: Tensor, keys: Tensor, w: Tensor, seen: Tensor, topk: int) -> Tensor:
    """One chunk of ``c`` query tokens: ``q [c, H, D]`` (the layer's dtype), ``keys [W, D]``
    (the first ``W`` keys: every key a row of the chunk sees is among them), in q's dtype where
    :func:`_on_tensor_cores`, else float32, ``w [c, H]`` float32 (scale included), ``seen [c,
    W]`` bool or additive; returns ``[c, topk]`` int32: the top ``min(topk, W)`` of the ``W``
    keys, then keys ``W, W + 1, ...``. Its float32 scores ``[c, H, W]`` are freed on return,
    before the next chunk's are made."""
    c, H, D = q.shape
    W = keys.shape[0]
    if keys.dtype == torch.float32:
        scores = torch.mm(q.reshape(c * H, D).float(), keys.T)
    else:
        scores = torch.mm(q.reshape(c * H, D), keys.T, out_dtype=torch.float32)
    scores = scores.relu_().view(c, H, W)
    summed = torch.bmm(w.unsqueeze(1), scores).squeeze(1)  # [c, W]
    del scores
    if seen.dtype == torch.bool:
        summed.masked_fill_(~seen, float("-inf"))
    else:
        summed.add_(seen)
    picked = summed.topk(min(topk, W), dim=-1).indices.to(torch.int32)
    if W >= topk:
        return picked
    rest = torch.arange(W, topk, dtype=torch.int32, device=q.device).expand(c, topk - W)
    return torch.cat((picked, rest), 1)
