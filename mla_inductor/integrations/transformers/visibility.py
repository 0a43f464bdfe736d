"""Which keys each query token sees, as the switched models build it instead of a dense mask.

transformers' models turn their attention mask (causality, sliding window, padding, packed
sequences) into a dense ``[B, 1, T, S]`` mask through the mask function of the attention
implementation in their config. :data:`ATTN_IMPLEMENTATION` registers one whose mask function
(:func:`visibility_mask`) returns a :class:`Visibility` instead wherever the rule is causal over
positions (with or without a sliding window): each token's cache position and the 2D padding mask
over the keys, O(B·S + T). Anything else (packed sequences, an overlay) gets the dense bool mask
of transformers' ``sdpa_mask``. The switched layers read either. :func:`gather_seen` and
:func:`scatter_back` turn a padding mask over keys (or pooled keys) into a causal rule over
positions among the seen ones, the form :func:`mla_inductor.lightning_indexer` takes.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch
from torch import Tensor

from transformers import masking_utils as _masking
from transformers.modeling_utils import AttentionInterface

# The attention implementation the integration sets on a switched model's config: the model then
# builds, instead of its dense [B, 1, T, S] mask, what the switched layers read.
ATTN_IMPLEMENTATION = "mla_inductor_dsa"
# The attribute of a switched layer holding its config's attention implementation before apply.
_PREVIOUS = "_mla_inductor_attn_implementation"


class Visibility(NamedTuple):
    """Which keys each query token sees, without a ``[T, S]`` tensor: key ``s`` is seen by token
    ``t`` of batch element ``b`` when ``s <= positions[t]`` (``positions [T]`` or ``[B, T]``,
    integer, in key coordinates: the token's cache position), where ``window`` is set also ``s >
    positions[t] - window`` (a sliding window of ``window`` keys, the token's own included), and,
    where ``keys`` is given (``[B, S]`` bool, the model's 2D padding mask over the keys),
    ``keys[b, s]``."""

    positions: Tensor
    keys: Optional[Tensor]
    window: Optional[int] = None


def _sliding_window_of(mask_function) -> Optional[int]:
    """``W`` where ``mask_function`` is exactly transformers' ``sliding_window_causal_mask_function(W)``
    (``and_masks(sliding_window_overlay(W), causal_mask_function)``, as
    ``create_sliding_window_causal_mask`` builds it without packed sequences or overlays), else
    None. Read from the closures, which the tested transformers range defines."""
    probe = _masking.sliding_window_causal_mask_function(1)
    if getattr(mask_function, "__code__", None) is not probe.__code__:
        return None
    (parts,) = [cell.cell_contents for cell in mask_function.__closure__]
    if len(parts) != 2 or parts[1] is not _masking.causal_mask_function:
        return None
    overlay = _masking.sliding_window_overlay(1)
    if getattr(parts[0], "__code__", None) is not overlay.__code__:
        return None
    (window,) = [cell.cell_contents for cell in parts[0].__closure__]
    return window if isinstance(window, int) else None


def visibility_mask(batch_size, q_length, kv_length, q_offset=0, kv_offset=0,
                    mask_function=_masking.causal_mask_function, attention_mask=None, device="cpu",
                    **_):
    """The model's mask under :data:`ATTN_IMPLEMENTATION` (transformers' mask interface: the
    arguments of its ``sdpa_mask``). A plain causal mask, or a causal sliding window of ``W``
    keys, becomes a :class:`Visibility`: each token's cache position (``q_offset + t -
    kv_offset``: a static cache's unfilled rows lie past it), the window, and, where the model
    has a 2D padding mask, that mask over the ``kv_length`` keys (rows past it hidden):
    O(B·S + T). Anything else (packed sequences, an overlay) is not such a rule over positions:
    the dense bool mask ``[B, 1, T, S]`` of ``sdpa_mask``."""
    window = None
    if mask_function is not _masking.causal_mask_function:
        window = _sliding_window_of(mask_function)
        if window is None:
            return _masking.sdpa_mask(
                batch_size=batch_size, q_length=q_length, kv_length=kv_length,
                q_offset=q_offset, kv_offset=kv_offset, mask_function=mask_function,
                attention_mask=attention_mask, allow_is_causal_skip=False, device=device,
            )
    positions = torch.arange(q_length, device=device) + (q_offset - kv_offset)
    keys = None
    if attention_mask is not None:
        padded = _masking.prepare_padding_mask(attention_mask, kv_length, kv_offset)
        keys = padded[:, kv_offset:kv_offset + kv_length].to(torch.bool)
    return Visibility(positions, keys, window)


def dense_seen(mask: Tensor) -> Tensor:
    """``[B or 1, T, S]`` bool (True = seen) from a model's 4D mask without its head axis: bool,
    or additive float (the dtype's minimum or -inf = hidden)."""
    return mask if mask.dtype == torch.bool else mask > torch.finfo(mask.dtype).min


def gather_seen(k: Tensor, keys: Tensor, positions: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """The seen keys of each batch element first, in their order (a stable partition,
    O(B·S·D)), so that a causal rule over positions among them is exactly a padding mask and a
    causal rule over the keys (its tie-breaking, the smaller key index, included).

    Args:
        k: ``[B, S, D]`` keys (or pooled keys), any dtype.
        keys: ``[B, S]`` bool, the keys that can be seen at all (the model's 2D padding mask).
        positions: ``[T]`` or ``[B, T]`` integer, each token's last visible key in key
            coordinates (below 0: none).

    Returns:
        ``(gathered k [B, S, D], positions [B, T] int64 among the gathered keys (the count of
        seen keys up to the token's position, minus 1), order [B, S] int64: the key index of
        each gathered row)``; :func:`scatter_back` maps a selection back.
    """
    B, S, D = k.shape
    before = keys.cumsum(-1)  # seen keys up to and including s
    column = torch.arange(S, device=k.device)
    slot = torch.where(keys, before - 1, before[:, -1:] + column - before)  # a permutation
    order = torch.empty((B, S), dtype=torch.int64, device=k.device)
    order.scatter_(1, slot, column.expand(B, S))
    pos = positions.long().expand(B, positions.shape[-1])
    count = before.gather(1, pos.clamp(0, S - 1))
    return k.gather(1, order[..., None].expand(B, S, D)), torch.where(pos < 0, 0, count) - 1, order


def scatter_back(picked: Tensor, order: Tensor) -> Tensor:
    """The key indices ``[B, T, topk]`` int32 of a selection ``picked`` over the keys gathered
    in ``order [B, S]`` (:func:`gather_seen`), -1 kept."""
    B, T, topk = picked.shape
    back = order.gather(1, picked.clamp(min=0).view(B, T * topk).long()).view(B, T, topk)
    return torch.where(picked >= 0, back, -1).to(torch.int32)


def _not_an_attention_function(module, *args, **kwargs):
    raise RuntimeError(
        f"mla_inductor: {type(module).__name__} (layer {getattr(module, 'layer_idx', '?')}) was "
        f"called on the attention implementation {ATTN_IMPLEMENTATION!r} without being switched; "
        "call mla_inductor.integrations.transformers.apply(model) on the model that holds it"
    )


_masking.AttentionMaskInterface.register(ATTN_IMPLEMENTATION, visibility_mask)
AttentionInterface.register(ATTN_IMPLEMENTATION, _not_an_attention_function)


def use_visibility(layers) -> None:
    """Sets :data:`ATTN_IMPLEMENTATION` on the configs of ``layers``, keeping the one before in
    the first layer of each config (for :func:`drop_visibility`)."""
    for attn in layers:
        if attn.config._attn_implementation != ATTN_IMPLEMENTATION:
            attn.__dict__[_PREVIOUS] = attn.config._attn_implementation
            attn.config._attn_implementation = ATTN_IMPLEMENTATION


def drop_visibility(layers) -> None:
    """Puts back the attention implementation that :func:`use_visibility` replaced, unless it
    was changed since (e.g. ``model.set_attn_implementation("sdpa")``)."""
    for attn in layers:
        if _PREVIOUS in attn.__dict__:
            previous = attn.__dict__.pop(_PREVIOUS)
            if attn.config._attn_implementation == ATTN_IMPLEMENTATION:
                attn.config._attn_implementation = previous
