"""The comparison path of the DeepSeek-V4 layer benchmark: the same sparse attention as
:func:`mla_inductor.sparse_mla`, on torch's FlexAttention (``torch.nn.attention.flex_attention``,
compiled), the path torchtitan's DeepSeek-V4 runs.

:func:`flex_sparse_mla` takes the op's batched arguments and computes over every key with a
``BlockMask`` that admits exactly the slots' keys: ``mask_mod(b, h, t, s)`` reads a bitmap of
each token's selected keys, ``[B, T, ceil(S / 32)]`` int32 (``S / 8`` bytes per token: 0.5 GiB
at T 131072 with ``S`` = T + T/4); FlexAttention then skips the key blocks no token of a query
block names. The attention sink (one logit per head with no value) is applied from FlexAttention's
``lse``: ``out · sigmoid(lse - sink)``, the softmax with the sink in its denominator. The single
key-and-value head is broadcast to every query head (``enable_gqa``).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor


def selection_bitmap(indices: Tensor, topk_length: Optional[Tensor], S: int) -> Tensor:
    """``[B, T, ceil(S / 32)]`` int32: bit ``s % 32`` of word ``s // 32`` set where a valid slot
    of ``indices [B, T, topk]`` (in ``[0, S)``, before ``topk_length [B, T]``) names key ``s``."""
    B, T, K = indices.shape
    valid = (indices >= 0) & (indices < S)
    if topk_length is not None:
        valid &= torch.arange(K, device=indices.device) < topk_length[..., None]
    key = torch.where(valid, indices, 0).long()
    bits = torch.where(valid, torch.ones_like(key) << (key % 32), 0)
    words = torch.zeros(B, T, (S + 31) // 32, dtype=torch.int64, device=indices.device)
    # distinct keys of a row set distinct bits, so the sum of a word's bits is their OR
    words.scatter_add_(2, key // 32, bits)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def flex_sparse_mla(q: Tensor, kv: Tensor, indices: Tensor, *, sm_scale: float, d_v: int,
                    topk_length: Optional[Tensor] = None,
                    attn_sink: Optional[Tensor] = None) -> Tensor:
    """The batched :func:`mla_inductor.sparse_mla` (``q [B, T, H, D]``, ``kv [B, S, D]``,
    ``indices [B, T, topk]`` with distinct keys per row, ``topk_length [B, T]`` or None,
    ``attn_sink [H]`` float32 or None) on FlexAttention with ``d_v = D`` (the key row is the
    value). Returns ``out [B, T, H, D]`` in q's dtype, differentiable in q, kv and the sink (on
    CUDA: FlexAttention has no CPU backward, nor an ``lse`` for the sink there). A row with no
    valid slot gives 0 (as the op).

    Raises:
        ValueError: ``d_v`` other than the key width D.
    """
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    B, T, H, D = q.shape
    S = kv.shape[1]
    if d_v != D:
        raise ValueError(f"flex_sparse_mla: d_v {d_v} must equal the key width {D} (K = V)")
    bitmap = selection_bitmap(indices, topk_length, S)

    def mask_mod(b, h, t, s):
        return ((bitmap[b, t, s // 32] >> (s % 32)) & 1) == 1

    block_mask = torch.compile(create_block_mask)(mask_mod, B, None, T, S, device=q.device)
    attend = torch.compile(flex_attention, fullgraph=True)
    key = kv[:, None]  # [B, 1, S, D]: one head for every query head
    sink = attn_sink is not None
    out = attend(q.transpose(1, 2), key, key, block_mask=block_mask, scale=sm_scale,
                 enable_gqa=True, return_lse=sink)
    if not sink:
        return out.transpose(1, 2)
    out, lse = out
    gate = torch.sigmoid(lse - attn_sink.float()[:, None])  # [B, H, T]; lse -inf: gate 0
    return (out * gate[..., None].to(out.dtype)).transpose(1, 2)


def failure(e: BaseException) -> str:
    """``"<type>: <first line of the message>"``, cut to 160 characters of message: how a table
    cell reports a FlexAttention call that failed (its compile may refuse a shape)."""
    return f"{type(e).__name__}: " + (str(e).strip().splitlines() or [""])[0][:160]
