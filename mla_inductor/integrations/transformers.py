"""Hugging Face transformers' DSA models (DeepSeek-V3.2, GLM-5) on :func:`mla_inductor.sparse_mla`.

transformers 5.24's ``DeepseekV32Attention`` (``models/deepseek_v32``) and ``GlmMoeDsaAttention``
(``models/glm_moe_dsa``) expand the latent kv into per-head keys (``qk_nope + qk_rope`` wide) and
values (``v_head_dim``) and fold the indexer's top-k into a dense ``[B, 1, S, T]`` mask over full
attention: O(S·T) memory and time per head. :func:`apply` makes each such layer compute the same
attention in the absorbed MLA form instead (DeepSeek-V2, arXiv:2405.04434, section 2.1.2: W^UK
absorbed into the query, W^UV into the output; DSA on MLA's MQA mode, DeepSeek-V3.2-Exp, 2025):

- ``q_lat[h] = q_nope[h] @ W_uk[h]`` (``[B, T, H, kv_lora_rank]``), query ``cat(q_lat, q_rope)``,
  the GEMM writing into the query (:func:`~mla_inductor.integrations.head_matmul.head_matmul`: no
  copy of it, nor of the output or of their gradients);
- one latent row per token, ``kv = cat(kv_a_layernorm(c), k_rope)`` (``[B, S, kv_lora_rank +
  qk_rope]``): the tensors the model's cache already holds;
- ``o_lat = sparse_mla(q, kv, top-k, sm_scale=layer.scaling, d_v=kv_lora_rank)``, then
  ``out[h] = o_lat[h] @ W_uv[h]ᵀ`` and the layer's ``o_proj``.

``W_uk`` / ``W_uv`` are views of ``kv_b_proj.weight`` taken at every call: no copies, so training
updates the model's own parameters. The RoPE and every projection are the layer's own modules and
functions. The indexer's top-k comes from its own parameters and functions too, computed on
:func:`mla_inductor.lightning_indexer` by
:func:`~mla_inductor.integrations.transformers_indexer.indexer_topk` (the same definition in
float32, not bitwise: at near-ties it may keep the other key, exact ties go to the smaller key
index; bounded chunks instead of ``[B, T, index_n_heads, S]``). The model builds no dense mask:
:func:`apply` sets the attention implementation :data:`ATTN_IMPLEMENTATION`, under which
transformers' mask creation returns each token's position and the 2D padding mask
(:func:`_visibility`; a dense mask only for packed sequences). ``apply(model, indexer_loss=True)``
also trains the indexers with DeepSeek-V3.2's KL loss, which :func:`indexer_loss` returns
(:mod:`~mla_inductor.integrations.transformers_indexer_loss`).
"""

from __future__ import annotations

import contextlib
import types
from typing import Iterator

import torch
from torch import Tensor, nn
from transformers.models.deepseek_v32 import modeling_deepseek_v32 as _dsv32
from transformers.models.glm_moe_dsa import modeling_glm_moe_dsa as _glm

from transformers import masking_utils as _masking
from transformers.modeling_utils import AttentionInterface

from ..api import sparse_mla
from . import transformers_indexer_loss as _loss
from .head_matmul import head_matmul
from .transformers_indexer import Visibility, indexer_topk

# The attention classes switched, each with its model's RoPE for the attention (interleaved pairs),
# the RoPE its indexer applies (DeepSeek-V3.2: half-split; GLM-5: interleaved pairs) and whether
# its forward also returns the top-k (GLM passes it to the next layer, whose "shared" indexer
# reuses it).
_LAYERS = {
    _dsv32.DeepseekV32Attention: (_dsv32.apply_rotary_pos_emb_interleave,
                                  _dsv32.apply_rotary_pos_emb, False),
    _glm.GlmMoeDsaAttention: (_glm.apply_rotary_pos_emb_interleave,
                              _glm.apply_rotary_pos_emb_interleave, True),
}


# The attention implementation :func:`apply` sets on the model's config: the model then builds,
# instead of its dense [B, 1, T, S] mask, what the switched layers read (:func:`_visibility`).
ATTN_IMPLEMENTATION = "mla_inductor_dsa"
# The attribute of a switched layer holding its config's attention implementation before apply.
_PREVIOUS = "_mla_inductor_attn_implementation"


def _visibility(batch_size, q_length, kv_length, q_offset=0, kv_offset=0,
                mask_function=_masking.causal_mask_function, attention_mask=None, device="cpu",
                **_):
    """The model's mask under :data:`ATTN_IMPLEMENTATION` (transformers' mask interface: the
    arguments of its ``sdpa_mask``). A plain causal mask becomes a :class:`Visibility`: each
    token's cache position (``q_offset + t - kv_offset``: a static cache's unfilled rows lie past
    it) and, where the model has a 2D padding mask, that mask over the ``kv_length`` keys (rows
    past it hidden): O(B·S + T). Anything else (packed sequences, an overlay) is
    not a causal rule over positions: the dense bool mask ``[B, 1, T, S]`` of ``sdpa_mask``."""
    if mask_function is not _masking.causal_mask_function:
        return _masking.sdpa_mask(
            batch_size=batch_size, q_length=q_length, kv_length=kv_length, q_offset=q_offset,
            kv_offset=kv_offset, mask_function=mask_function, attention_mask=attention_mask,
            allow_is_causal_skip=False, device=device,
        )
    positions = torch.arange(q_length, device=device) + (q_offset - kv_offset)
    keys = None
    if attention_mask is not None:
        padded = _masking.prepare_padding_mask(attention_mask, kv_length, kv_offset)
        keys = padded[:, kv_offset:kv_offset + kv_length].to(torch.bool)
    return Visibility(positions, keys)


def _not_an_attention_function(module, *args, **kwargs):
    raise RuntimeError(
        f"mla_inductor: {type(module).__name__} (layer {getattr(module, 'layer_idx', '?')}) was "
        f"called on the attention implementation {ATTN_IMPLEMENTATION!r} without being switched; "
        "call mla_inductor.integrations.transformers.apply(model) on the model that holds it"
    )


_masking.AttentionMaskInterface.register(ATTN_IMPLEMENTATION, _visibility)
AttentionInterface.register(ATTN_IMPLEMENTATION, _not_an_attention_function)


def _absorbed_attention(attn, rope, index_rope, hidden_states, position_embeddings, attention_mask,
                        cache, prev_topk_indices, kwargs) -> tuple[Tensor, Tensor]:
    """One layer's attention in the absorbed form (the module docstring); returns the layer's
    output ``[B, T, hidden_size]`` and the indexer's top-k ``[B, T, topk]`` int32."""
    if attention_mask is None:
        raise RuntimeError(
            "mla_inductor: the switched DSA attention needs the model's attention mask (its "
            "4D mask [B, 1, T, S], or what the model builds under apply()); call the layer as "
            "the model does (the model always builds one)"
        )
    if attn.training and attn.attention_dropout:
        raise RuntimeError(
            f"mla_inductor: attention_dropout={attn.attention_dropout} is not supported on "
            "sparse_mla; set model.config.attention_dropout = 0.0 and every layer's "
            "attention_dropout to 0.0, or mla_inductor.integrations.transformers.remove(model)"
        )
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
                            visibility, cache, scores=loss_on)
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


def _forward(attn, hidden_states, position_embeddings, attention_mask, cache=None,
             position_ids=None, prev_topk_indices=None, past_key_values=None, **kwargs):
    """The switched layer's forward, bound to the layer as a method (so that ``copy.deepcopy`` of a
    switched model binds the copy's own layer). Takes what transformers' forward takes, the cache
    as ``cache=`` (5.24) or ``past_key_values=`` (its older name: 5.17's layers pass it so, and
    5.24's forward still accepts it). ``position_ids`` is unused (transformers' indexer takes it
    only for backward compatibility; RoPE comes in ``position_embeddings``)."""
    if past_key_values is not None:
        if cache is not None:
            raise RuntimeError(
                "mla_inductor: the switched DSA attention got both cache= and past_key_values= "
                "(two names for the same argument); pass one"
            )
        cache = past_key_values
    rope, index_rope, returns_topk = _LAYERS[type(attn)]
    out, topk = _absorbed_attention(attn, rope, index_rope, hidden_states, position_embeddings,
                                    attention_mask, cache, prev_topk_indices, kwargs)
    return (out, None, topk) if returns_topk else (out, None)


def _is_switched(attn: nn.Module) -> bool:
    return getattr(attn.__dict__.get("forward"), "__func__", None) is _forward


def _dsa_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    layers = [(name, m) for name, m in model.named_modules() if type(m) in _LAYERS]
    if not layers:
        raise ValueError(
            f"mla_inductor: {type(model).__name__} has no DSA attention layer (transformers' "
            f"{' or '.join(cls.__name__ for cls in _LAYERS)}); pass a model of "
            "models/deepseek_v32 or models/glm_moe_dsa (DeepSeek-V3.2, GLM-5)"
        )
    return layers


def _apply(model: nn.Module) -> list[nn.Module]:
    switched = []
    for name, attn in _dsa_layers(model):
        if _is_switched(attn):
            continue
        if "forward" in attn.__dict__:
            raise RuntimeError(
                f"mla_inductor: {name}.forward is already replaced on the instance (for example "
                "by accelerate's device_map or offloading hooks); switching it would drop that "
                "wrapper. Apply to a model without such hooks"
            )
        attn.forward = types.MethodType(_forward, attn)
        switched.append(attn)
    return switched


def _use_visibility(layers) -> None:
    """Sets :data:`ATTN_IMPLEMENTATION` on the configs of ``layers``, keeping the one before in
    the first layer of each config (for :func:`_drop_visibility`)."""
    for attn in layers:
        if attn.config._attn_implementation != ATTN_IMPLEMENTATION:
            attn.__dict__[_PREVIOUS] = attn.config._attn_implementation
            attn.config._attn_implementation = ATTN_IMPLEMENTATION


def _drop_visibility(layers) -> None:
    """Puts back the attention implementation that :func:`_use_visibility` replaced, unless it
    was changed since (e.g. ``model.set_attn_implementation("sdpa")``)."""
    for attn in layers:
        if _PREVIOUS in attn.__dict__:
            previous = attn.__dict__.pop(_PREVIOUS)
            if attn.config._attn_implementation == ATTN_IMPLEMENTATION:
                attn.config._attn_implementation = previous


def apply(model: nn.Module, *, indexer_loss: bool = False) -> int:
    """Switches every ``DeepseekV32Attention`` and ``GlmMoeDsaAttention`` of ``model`` (any module
    tree containing them, e.g. a ``*ForCausalLM``) to the absorbed form on :func:`sparse_mla`.

    Each layer keeps its own parameters and submodules (nothing is copied or added to the state
    dict); its softmax scale (``layer.scaling``, YaRN's mscale included), its indexer (GLM's
    "shared" layers keep reusing the previous layer's top-k) and the model's attention mask
    (causality, padding, packed sequences) decide what each token attends to. Prefill, training
    and generation all run on the op: with a cache, the layer writes and reads the model's own
    cache, which already holds the latent rows (``kv_a_layernorm(c)`` and the roped ``k_rope``).
    Inputs as the model takes them: float32 on the CPU (the op's reference backend); on a GPU,
    bf16 runs on the op's kernels where they cover ``(d_qk, d_v) = (kv_lora_rank +
    qk_rope_head_dim, kv_lora_rank)``: (576, 512) for both released models (other shapes fall back
    to the reference with a warning). The layer returns no attention weights (``None``). Each
    layer's indexer top-k is computed from the indexer's own parameters and functions on
    :func:`mla_inductor.lightning_indexer`
    (:func:`~mla_inductor.integrations.transformers_indexer.indexer_topk`): transformers'
    definition in float32 (not bitwise: at a near-tie or an exact tie it may keep another key than
    transformers' indexer; exact ties go to the smaller key index), the causal rule from each
    token's cache position, without a host synchronisation; time O(T·S·index_n_heads·
    index_head_dim) (the sm90 kernel skips causal key blocks past a chunk's last token, the
    reference scores every key), memory O(T·index_topk) plus the op's bounded chunks.

    The model's dense mask ``[B, 1, T, S]`` (1 byte per entry, 256 MiB at T = S = 16384) is not
    built: ``apply`` sets the config's attention implementation to :data:`ATTN_IMPLEMENTATION`
    (``remove`` puts the previous one back), whose mask function returns each token's position
    and the model's 2D padding mask over the keys (O(B·S + T)). With padding, the keys the mask
    hides are moved out of the op's reach by a stable partition of each batch element's indexer
    keys (one gather of ``[B, S, index_head_dim]`` per layer and call; the same selection as with
    the mask). Packed sequences (position_ids that restart, no mask, no cache) get
    transformers' dense bool mask and the op's reference arithmetic on it, as does a model whose
    attention implementation is set to another one after ``apply`` (sdpa, eager). The attention
    reads only the top-k rows.

    ``indexer_loss=True`` also trains the indexers (off by default; off, the forward is exactly the
    one without the option): each forward of a layer with its own indexer, in training mode with
    grad enabled, records DeepSeek-V3.2's indexer KL loss
    (:mod:`~mla_inductor.integrations.transformers_indexer_loss`: the indexer's logits of the
    selected keys, from its own modules on detached inputs, against the attention's head-summed
    probabilities of them), which :func:`indexer_loss` returns for the training loop to add. The
    option is set on every switched layer of ``model`` by each call (a later ``apply(model)`` turns
    it off again).

    Returns:
        The number of layers this call switched (layers already switched keep their forward).

    Raises:
        ValueError: ``model`` has no such layer.
        RuntimeError: a layer's ``forward`` is already replaced on the instance (accelerate's
            hooks), which switching would drop. At call time: ``attention_dropout > 0`` while
            training, a missing attention mask (``None``), a shared-top-k layer called without
            ``prev_topk_indices``, :func:`sparse_mla`'s own checks, and with ``indexer_loss``
            a training forward with grad over a cache that held earlier tokens.
    """
    switched = len(_apply(model))
    layers = [attn for _, attn in _dsa_layers(model) if _is_switched(attn)]
    for attn in layers:
        _loss.enable(attn, indexer_loss)
    _use_visibility(layers)
    return switched


def indexer_loss(model: nn.Module) -> Tensor:
    """The indexer loss of ``model``'s DSA layers since the last call, for a training loop to add
    (``loss = lm_loss + coef * indexer_loss(model)``), after :func:`apply` with
    ``indexer_loss=True``.

    Each recorded loss holds its graph (about 12 bytes per selected slot and layer) until it is
    taken, so call this once per forward: after several forwards (gradient accumulation without a
    call in between) it gives the mean over all of them. With transformers' gradient
    checkpointing (non-reentrant, its default) each forward records once; reentrant
    checkpointing runs the layers without grad, so nothing is recorded.

    Returns:
        A 0-d float32 tensor on the model's device: the mean of the losses recorded since the last
        call, one per forward of each layer that has its own indexer (GLM-5's "shared" layers
        have none) in training mode with grad enabled, each
        :func:`~mla_inductor.integrations.transformers_indexer_loss.layer_loss`; its gradient
        reaches the indexers' parameters only. The record is then cleared. 0 (without grad)
        where none was recorded (eval mode, ``torch.no_grad()``, no forward since), with a
        ``UserWarning`` saying which.

    Raises:
        ValueError: ``model`` has no DSA attention layer.
        RuntimeError: none of its layers has the indexer loss enabled.
    """
    layers = [attn for _, attn in _dsa_layers(model) if _loss.enabled(attn)]
    if not layers:
        raise RuntimeError(
            f"mla_inductor: indexer_loss(model) needs the indexer loss enabled: no DSA layer of "
            f"this {type(model).__name__} has it; call "
            "mla_inductor.integrations.transformers.apply(model, indexer_loss=True) first"
        )
    return _loss.take(layers)


def _remove(layers) -> None:
    _drop_visibility(layers)
    for attn in layers:
        if _is_switched(attn):
            del attn.forward
        _loss.enable(attn, False)


def remove(model: nn.Module) -> int:
    """Puts every switched DSA attention layer of ``model`` back on transformers' own forward
    (bitwise the model's outputs before :func:`apply`), its indexer loss off and its recorded
    losses dropped.

    Returns:
        The number of layers switched back.

    Raises:
        ValueError: ``model`` has no DSA attention layer.
    """
    layers = [attn for _, attn in _dsa_layers(model) if _is_switched(attn)]
    _remove(layers)
    return len(layers)


@contextlib.contextmanager
def switched(model: nn.Module, *, indexer_loss: bool = False) -> Iterator[int]:
    """``with switched(model) as n:`` runs the block with :func:`apply` in effect (``n`` layers
    switched) and switches exactly those layers back on exit, also on an exception; with
    ``indexer_loss`` those layers record their indexer loss (:func:`apply`'s option) inside the
    block, dropped on exit. Raises as :func:`apply`."""
    layers = _apply(model)
    for attn in layers:
        _loss.enable(attn, indexer_loss)
    _use_visibility(layers)
    try:
        yield len(layers)
    finally:
        _remove(layers)
