"""Hugging Face transformers' DSA models (DeepSeek-V3.2, GLM-5) on :func:`mla_inductor.sparse_mla`.

transformers 5.24's ``DeepseekV32Attention`` (``models/deepseek_v32``) and ``GlmMoeDsaAttention``
(``models/glm_moe_dsa``) expand the latent kv into per-head keys (``qk_nope + qk_rope`` wide) and
values (``v_head_dim``) and fold the indexer's top-k into a dense ``[B, 1, S, T]`` mask over full
attention: O(S·T) memory and time per head. :func:`forward` (the switched layer's forward, which
:func:`mla_inductor.integrations.transformers.apply` binds to each such layer) computes the same
attention in the absorbed MLA form instead (DeepSeek-V2, arXiv:2405.04434, section 2.1.2: W^UK
absorbed into the query, W^UV into the output; DSA on MLA's MQA mode, DeepSeek-V3.2-Exp, 2025):

- ``q_lat[h] = q_nope[h] @ W_uk[h]`` (``[B, T, H, kv_lora_rank]``), query ``cat(q_lat, q_rope)``,
  the GEMM writing into the query (:func:`.head_matmul.head_matmul`: no copy of it, nor of the
  output or of their gradients);
- one latent row per token, ``kv = cat(kv_a_layernorm(c), k_rope)`` (``[B, S, kv_lora_rank +
  qk_rope]``): the tensors the model's cache already holds;
- ``o_lat = sparse_mla(q, kv, top-k, sm_scale=layer.scaling, d_v=kv_lora_rank)``, then
  ``out[h] = o_lat[h] @ W_uv[h]ᵀ`` and the layer's ``o_proj``.

``W_uk`` / ``W_uv`` are views of ``kv_b_proj.weight`` taken at every call: no copies, so training
updates the model's own parameters. The RoPE and every projection are the layer's own modules and
functions. The indexer's top-k comes from its own parameters and functions too, computed on
:func:`mla_inductor.lightning_indexer` by
:func:`~mla_inductor.integrations.transformers.indexer.indexer_topk` (the same definition in
float32, not bitwise: at near-ties it may keep the other key, exact ties go to the smaller key
index; bounded chunks instead of ``[B, T, index_n_heads, S]``). The model builds no dense mask:
``apply`` sets the attention implementation of :mod:`.visibility`, under which transformers'
mask creation returns each token's position and the 2D padding mask (a dense mask only for packed
sequences). ``apply(model, indexer_loss=True)`` also trains the indexers with DeepSeek-V3.2's KL
loss (:mod:`.loss`).
"""

from __future__ import annotations

import torch
from torch import Tensor
from transformers.models.deepseek_v32 import modeling_deepseek_v32 as _dsv32
from transformers.models.glm_moe_dsa import modeling_glm_moe_dsa as _glm

from ...api import sparse_mla
from . import loss as _loss
from .arguments import check_call, the_cache
from .head_matmul import head_matmul
from .indexer import indexer_topk, selects_in_fp8
from .visibility import Visibility

INDEXER_LOSS = True  # apply(model, indexer_loss=True) covers these layers (:mod:`.loss`)
VISIBILITY = True  # apply sets ATTN_IMPLEMENTATION: the model builds no dense mask

# The attention classes switched, each with its model's RoPE for the attention (interleaved pairs),
# the RoPE its indexer applies (DeepSeek-V3.2: half-split; GLM-5: interleaved pairs) and whether
# its forward also returns the top-k (GLM passes it to the next layer, whose "shared" indexer
# reuses it).
LAYERS = {
    _dsv32.DeepseekV32Attention: (_dsv32.apply_rotary_pos_emb_interleave,
                                  _dsv32.apply_rotary_pos_emb, False),
    _glm.GlmMoeDsaAttention: (_glm.apply_rotary_pos_emb_interleave,
                              _glm.apply_rotary_pos_emb_interleave, True),
}


def _absorbed_attention(attn, rope, index_rope, hidden_states, position_embeddings, attention_mask,
                        cache, prev_topk_indices, kwargs) -> tuple[Tensor, Tensor]:
    """One layer's attention in the absorbed form (the module docstring); returns the layer's
    output ``[B, T, hidden_size]`` and the indexer's top-k ``[B, T, topk]`` int32."""
    check_call(attn, attention_mask)
    B, T = hidden_states.shape[:-1]
    H, nope, rope_dim = attn.num_heads, attn.qk_nope_head_dim, attn.qk_rope_head_dim
    rank, v_dim = attn.kv_lora_rank, attn.v_head_dim

    q_resid = attn.q_a_layernorm(attn.q_a_proj(hidden_states))
    q_nope, q_rope = attn.q_b_proj(q_resid).view(B, T, H, nope + rope_dim).split([nope, rope_dim], -1)
    latent, k_rope = attn.kv_a_proj_with_mqa(hidden_states).split([rank, rope_dim], -1)
    cos, sin = position_embeddings
    q_rope, k_rope = rope(q_rope, k_rope.unsqueeze(2), cos, sin, unsqueeze_dim=2)
    # [B, 1, T, .]: the layout the model's cache stores (and the original forward writes).
    latent = attn.kv_a_layernorm(latent).unsqueeze(1)
    k_rope = k_rope.transpose(1, 2)
    if cache is not None:
        latent, k_rope = cache.update(latent, k_rope, attn.layer_idx, kwargs=kwargs)
    kv = torch.cat((latent, k_rope), -1)[:, 0]  # [B, S, rank + rope_dim]

    loss_on, logits = _loss.active(attn), None
    if attn.indexer is not None:
        visibility = (attention_mask if isinstance(attention_mask, Visibility)
                      else attention_mask[:, 0])
        # with the indexer loss on, the selection's own scores are the loss's logits
        topk = indexer_topk(attn.indexer, index_rope, hidden_states, q_resid, position_embeddings,
                            visibility, cache, scores=loss_on, fp8=selects_in_fp8(attn))
        if loss_on:
            topk, logits = topk
    elif prev_topk_indices is None:
        raise RuntimeError(
            f"mla_inductor: layer {attn.layer_idx} reuses the previous layer's top-k (a 'shared' "
            "indexer layer) but got prev_topk_indices=None; run it inside its model, after a "
            "'full' indexer layer"
        )
    else:
        topk = prev_topk_indices

    w = attn.kv_b_proj.weight.view(H, nope + v_dim, rank)
    # q = cat(q_nope @ W_uk, q_rope) [B, T, H, rank + rope_dim], the GEMM writing into q
    q = head_matmul(q_nope.reshape(B * T, H, nope), w[:, :nope],
                    q_rope.reshape(B * T, H, rope_dim)).view(B, T, H, rank + rope_dim)
    indices = topk  # the keys the mask hides are never named (-1 where a row sees fewer)
    if loss_on:
        o_lat, lse = sparse_mla(q, kv, indices, sm_scale=attn.scaling, d_v=rank, return_lse=True)
        _loss.record(attn, index_rope, hidden_states, q_resid, position_embeddings, q, kv,
                     indices, lse, logits)
    else:
        o_lat = sparse_mla(q, kv, indices, sm_scale=attn.scaling, d_v=rank)
    out = head_matmul(o_lat.reshape(B * T, H, rank), w[:, nope:].transpose(1, 2), None)
    out = out.view(B, T, H * v_dim)
    return attn.o_proj(out), topk


def forward(attn, hidden_states, position_embeddings, attention_mask, cache=None,
            position_ids=None, prev_topk_indices=None, past_key_values=None, **kwargs):
    """The switched layer's forward, bound to the layer as a method (so that ``copy.deepcopy`` of a
    switched model binds the copy's own layer). Takes what transformers' forward takes, the cache
    as ``cache=`` (5.24) or ``past_key_values=`` (its older name: 5.17's layers pass it so, and
    5.24's forward still accepts it). ``position_ids`` is unused (transformers' indexer takes it
    only for backward compatibility; RoPE comes in ``position_embeddings``)."""
    cache = the_cache(cache, past_key_values)
    rope, index_rope, returns_topk = LAYERS[type(attn)]
    out, topk = _absorbed_attention(attn, rope, index_rope, hidden_states, position_embeddings,
                                    attention_mask, cache, prev_topk_indices, kwargs)
    return (out, None, topk) if returns_topk else (out, None)
