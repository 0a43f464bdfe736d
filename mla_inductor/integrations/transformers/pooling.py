"""Entries pooled from consecutive tokens, as DeepSeek-V4's compressors (:mod:`.deepseek_v4`) and
GLM-5.3-Flash's k-pool indexer (:mod:`.glm5_next`) form them, and which entries a token sees.

- :func:`softmax_pool`: each entry is its ``m`` tokens' values weighted, channel by channel, by a
  softmax over the tokens of a learned gate plus a per-position bias (DeepSeek-V4's ``gate_proj``
  + ``position_bias``; GLM-5.3-Flash's ``index_kpool_compress_gate`` +
  ``index_kpool_compress_ape``), the softmax in float32;
- :func:`last_entry_seen`: an entry is visible to a token once its last token is, so a token
  ``p`` tokens after the first token of entry 0 sees entries ``0 .. (p + 1) // m - 1``: the
  ``q_positions`` of :func:`mla_inductor.lightning_indexer` over the entries.
"""

from __future__ import annotations

import torch
from torch import Tensor


def softmax_pool(values: Tensor, logits: Tensor, dim: int = -2) -> Tensor:
    """``[..., n, D]`` in ``values``' dtype: ``sum_i softmax_i(logits)[i] · values[..., i, :]``
    over the ``m`` tokens of each of the ``n`` entries, as transformers' DeepSeek-V4 compressor
    and GLM-5.3-Flash indexer compute it: the softmax of ``logits`` (cast to float32 first) over
    the tokens, its weights cast to ``values``' dtype, the products summed in that dtype.

    Args:
        values: ``[..., n, m, D]``, the tokens' values (keys) grouped by entry; with ``dim=-1``
            ``[..., n, D, m]`` (windows taken by ``unfold``, whose views of a token slice
            compile without a guard on the token count).
        logits: ``values``' layout (or broadcastable to it), any float dtype: the gate scores
            plus the per-position bias, per token and channel.
        dim: the tokens' dimension, -2 or -1.

    Differentiable in both. Raises torch's own error for shapes that do not broadcast.
    """
    weights = logits.softmax(dim=dim, dtype=torch.float32).to(values.dtype)
    return (values * weights).sum(dim=dim)


def last_entry_seen(positions: Tensor, m: int) -> Tensor:
    """``(positions + 1) // m - 1`` (floor division): the index of the last complete entry of
    ``m`` consecutive tokens that a token sees, entry ``j`` holding tokens ``j·m .. j·m + m - 1``
    and seen once its last token is (``j·m + m - 1 <= p``). ``positions``: any integer tensor,
    each token's position counted from the first token of entry 0 (DeepSeek-V4's
    ``position_ids``; GLM-5.3-Flash's position after the first real token); below ``m - 1`` the
    result is negative: no entry seen."""
    return (positions + 1) // m - 1
