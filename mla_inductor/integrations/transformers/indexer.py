"""transformers' DSA indexer (DeepSeek-V3.2, GLM-5) on :func:`mla_inductor.lightning_indexer`.

transformers 5.24's ``DeepseekV32Indexer`` / ``GlmMoeDsaIndexer`` score every query against every
key at once: float32 ``[B, T, index_n_heads, S]`` (64 GiB at T = S = 16384 with 64 heads), and
its broadcast ``matmul`` also copies the float32 keys once per query token (``[B·T, head_dim,
S]``, 128 GiB there). :func:`indexer_topk` computes the top-k from the same module's parameters
and functions (its queries, keys, RoPE and head weights) with the op, which scores in bounded
chunks (the reference backend) or on the GPU kernels.

Per query token ``t`` and key ``s`` (the indexer's own definition):
``score[t, s] = sum_h w[t, h] · relu(softmax_scale · q[t, h] · k[s])`` with ``w =
weights_proj(x) · n_heads**-0.5``, then the model's mask, then the ``min(index_topk, S)`` largest.
The op computes it as ``sum_h (softmax_scale · w[t, h]) · relu(q[t, h] · k[s])`` (equal in exact
arithmetic, as ``relu(a·x) = a·relu(x)`` for ``a > 0``): the scale is folded into the head
weights (:func:`head_weights`).

Which keys a token sees (:class:`Visibility`, or a dense mask):

- positions and key padding (what :mod:`.visibility` makes the model build instead of its
  ``[B, 1, T, S]`` mask): the op's causal rule from each token's position, and, where the model
  has a 2D padding mask, the keys it hides moved out of reach: per batch element the seen keys
  are gathered to the front in their order (a stable partition, O(B·S·head_dim)) and each
  position becomes the count of seen keys up to it, minus 1, so that the op's causal rule over
  the gathered keys is exactly the padding mask and the causal rule over the keys, its
  tie-breaking (smaller key index) included; the indices are mapped back;
- a dense mask ``[B or 1, T, S]`` (the model's own, with packed sequences or an attention
  implementation other than the one :mod:`.visibility` sets): the op's reference arithmetic
  and selection with that visibility, on any device (:func:`mla_inductor.lightning_indexer_seen`).

Either way a row's selected keys come in ascending key index, then -1 where it sees fewer than
``min(index_topk, S)`` (transformers' indexer names hidden keys there, which its attention then
masks: the attention is the same). Not bitwise transformers': other GEMMs and the scale applied
to the head weights change the scores' last bits, so at a near-tie (scores within a few float32
ulps) the other key may be kept; exact ties (keys at which every head's relu is 0 score exactly
0) go to the smaller key index, where ``torch.topk``'s choice depends on the width scored. The
selected keys' scores agree with a float64 computation of the same definition to float32
rounding (``tests/integrations/test_transformers_indexer.py``).
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
from torch import Tensor, nn

from ...api import lightning_indexer, lightning_indexer_scores, lightning_indexer_seen
from ...quantize import quantize_fp8
from .visibility import Visibility, dense_seen, gather_seen, scatter_back


# The attribute of a switched attention layer present while its indexer selects in fp8.
_FP8 = "_mla_inductor_indexer_fp8"
PRECISIONS = ("bf16", "fp8")


def check_precision(precision: str) -> None:
    """Raises a ``ValueError`` for a ``precision`` not in :data:`PRECISIONS`."""
    if precision not in PRECISIONS:
        raise ValueError(f"mla_inductor: indexer_precision must be one of {PRECISIONS}, got "
                         f"{precision!r}")


def set_precision(attn: nn.Module, precision: str) -> None:
    """Makes ``attn``'s indexer select in ``precision`` (:data:`PRECISIONS`): ``"bf16"``, the
    layer's own dtype (float32 on the CPU), or ``"fp8"``.

    Raises:
        ValueError: another precision.
    """
    check_precision(precision)
    if precision == "fp8":
        attn.__dict__[_FP8] = True
    else:
        attn.__dict__.pop(_FP8, None)


def selects_in_fp8(attn: nn.Module) -> bool:
    """Whether ``attn``'s indexer selects in fp8 (:func:`set_precision`)."""
    return _FP8 in attn.__dict__


def quantized(q: Tensor, k: Tensor) -> tuple[Tensor, Tensor, dict]:
    """``(q_fp8, k_fp8, {"q_scale", "k_scale"})``: the indexer's queries ``[B, T, H, D]`` and keys
    ``[B, S, D]`` quantised per row to float8_e4m3fn (:func:`mla_inductor.quantize_fp8`, as
    DeepSeek-V3.2-Exp's inference code quantises them), with the scales as
    :func:`mla_inductor.lightning_indexer` takes them."""
    q8, q_scale = quantize_fp8(q)
    k8, k_scale = quantize_fp8(k)
    return q8, k8, {"q_scale": q_scale, "k_scale": k_scale}


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
    with ``softmax_scale`` folded in (module docstring). Differentiable where grad is enabled;
    the models keep ``weights_proj`` in float32 (``_keep_in_fp32_modules``), and its input's
    float32 copy (``[B, T, hidden_size]``, 1.75 GiB at T 65536) is not kept for the backward,
    which casts ``hidden_states`` again (:class:`_UpcastLinear`; the same values)."""
    proj = indexer.weights_proj
    scale = indexer.n_heads**-0.5 * indexer.softmax_scale
    if (hidden_states.dtype != proj.weight.dtype and torch.is_grad_enabled()
            and proj.weight.requires_grad):
        out = _UpcastLinear.apply(hidden_states, proj.weight, proj.bias)
    else:
        out = proj(hidden_states.to(proj.weight.dtype))
    return out.float() * scale


class _UpcastLinear(torch.autograd.Function):
    """``F.linear(x.to(weight.dtype), weight, bias)``, keeping ``x`` (which its caller keeps
    anyway) rather than its upcast copy for the backward."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, bias: Optional[Tensor]) -> Tensor:
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        return torch.nn.functional.linear(x.to(weight.dtype), weight, bias)

    @staticmethod
    def backward(ctx, grad: Tensor):
        x, weight = ctx.saved_tensors
        dx = dw = db = None
        if ctx.needs_input_grad[0]:
            dx = (grad @ weight).to(x.dtype)
        if ctx.needs_input_grad[1]:
            dw = grad.reshape(-1, grad.shape[-1]).T @ x.reshape(-1, x.shape[-1]).to(weight.dtype)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            db = grad.reshape(-1, grad.shape[-1]).sum(0)
        return dx, dw, db


def indexer_topk(indexer: nn.Module, rope: Callable, hidden_states: Tensor, q_resid: Tensor,
                 position_embeddings: tuple[Tensor, Tensor], visibility: Visibility | Tensor,
                 cache=None, *, scores: bool = False, fp8: bool = False):
    """The top-k keys of each query token, as ``indexer(hidden_states, q_resid,
    position_embeddings, attention_mask, position_ids, cache=cache)`` selects them, on
    :func:`mla_inductor.lightning_indexer` (module docstring: the same definition, float32, not
    bitwise; -1 instead of hidden keys). Runs without grad, unless ``scores``.

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
        visibility: a :class:`Visibility` over the ``S`` keys, or a dense mask ``[B or 1, T,
            S]``, bool (True = seen) or additive float (the dtype's minimum or -inf = hidden),
            the model's 4D mask without its head axis.
        cache: the model's cache or None; with one, this call's indexer keys are appended
            through ``cache.update_indexer`` (exactly once, as the model's indexer does; without
            grad) and the scores cover every cached key.
        scores: also return the selected slots' scores (the indexer's logits of DeepSeek-V3.2's
            indexer loss), computed with grad where grad is enabled, on ``hidden_states`` and
            ``q_resid`` detached: differentiable in the indexer's parameters only.
        fp8: select on the queries and keys quantised per row (:func:`quantized`); the
            scores are still those of the unquantised queries and keys.

    Returns:
        ``[B, T, min(index_topk, S)]`` int32: per row the selected keys (in ``[0, S)``) in
        ascending key index, then -1 where the row sees fewer keys. With ``scores``, ``(indices,
        scores)``: ``scores [B, T, min(index_topk, S)]`` float32, each slot's score (0 on -1
        slots), or None with a cache that held keys before this call.
    """
    with torch.set_grad_enabled(scores and torch.is_grad_enabled()):
        hidden_states, q_resid = hidden_states.detach(), q_resid.detach()
        q = index_queries(indexer, rope, q_resid, position_embeddings)
        k = index_keys(indexer, rope, hidden_states, position_embeddings)
        own_keys = True  # the keys are this call's tokens alone
        if cache is not None:
            k_all = cache.update_indexer(k.detach(), indexer.layer_idx)  # [B, S, D]
            own_keys = k_all.shape[1] == k.shape[1]
            k = k if own_keys else k_all
        w = head_weights(indexer, hidden_states)
        picked, values = _select(q, k, w, min(indexer.index_topk, k.shape[1]), visibility,
                                 scores, fp8)
    if not scores:
        return picked
    return picked, values if own_keys else None


def _select(q: Tensor, k: Tensor, w: Tensor, topk: int, visibility: Visibility | Tensor,
            scores: bool, fp8: bool):
    """``(indices, scores)`` of :func:`indexer_topk` for the indexer's queries, keys and head
    weights (under a dense mask or in fp8, the scores only when asked: those selections form
    none of the unquantised scores, so :func:`mla_inductor.lightning_indexer_scores` scores the
    selected slots)."""
    if fp8 or not isinstance(visibility, Visibility):
        picked = _selection(q.detach(), k.detach(), w.detach(), topk, visibility, fp8)
        return picked, lightning_indexer_scores(q, k, w, picked) if scores else None
    if visibility.keys is None:
        return lightning_indexer(q, k, w, topk, causal=True, q_positions=visibility.positions,
                                 return_scores=True)
    gathered, positions, order = gather_seen(k, visibility.keys.to(torch.bool),
                                              visibility.positions)
    picked, values = lightning_indexer(q, gathered, w, topk, causal=True, q_positions=positions,
                                       return_scores=True)
    return scatter_back(picked, order), values


def _selection(q: Tensor, k: Tensor, w: Tensor, topk: int, visibility: Visibility | Tensor,
               fp8: bool) -> Tensor:
    """The indices of :func:`_select` without scores, quantised per row first with ``fp8``."""
    if not isinstance(visibility, Visibility):
        q, k, scales = quantized(q, k) if fp8 else (q, k, {})
        return lightning_indexer_seen(q, k, w, dense_seen(visibility), topk, **scales)
    keys, positions, order = k, visibility.positions, None
    if visibility.keys is not None:
        keys, positions, order = gather_seen(k, visibility.keys.to(torch.bool), positions)
    q, keys, scales = quantized(q, keys) if fp8 else (q, keys, {})
    picked = lightning_indexer(q, keys, w, topk, causal=True, q_positions=positions, **scales)
    return picked if order is None else scatter_back(picked, order)
