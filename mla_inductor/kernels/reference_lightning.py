"""PyTorch reference of the lightning indexer (the protocol function ``lightning_indexer`` of
:mod:`mla_inductor.kernels.reference`), on any device.

DeepSeek-V3.2's lightning indexer (DeepSeek-AI, "DeepSeek-V3.2-Exp: Boosting Long-Context
Efficiency with DeepSeek Sparse Attention", 2025, section 2.1): per token ``t`` and key ``s``,
``score[t, s] = sum_h weights[t, h] * relu(q[t, h] . k[s])``, and each token keeps the keys of
largest score among those it sees. Its fp8 form (the indexer of DeepSeek-V3.2-Exp's inference
code; DeepGEMM's fp8 MQA logits): q and k in float8_e4m3fn with per-row float32 scales,
``score[t, s] = sum_h weights[t, h] * relu(q_scale[t, h] * k_scale[s] * (q[t, h] . k[s]))``.

Arithmetic: float32 scores, one GEMM per chunk of rows (``[c·H, D]`` queries by the ``[D, S]``
keys: float32 GEMM of the upcast operands; on a CUDA device with bfloat16 / float16 inputs the
inputs' own GEMM with float32 output, whose products are exact in float32 either way), ``relu``
in place, the weighted head sum as a batched ``[1, H] x [H, S]`` product. fp8 inputs are upcast
to float32 on every device (exact: an e4m3 value has 4 significant bits, so its products are
exact in float32, and in TF32 too) and each dot is scaled in place, ``(dot * q_scale) *
k_scale`` in float32, before the ``relu``.

Selection, exact and deterministic (no sort of the row, no data-dependent size, no host
synchronisation): each score becomes an int32 key whose order is the scores' order (the IEEE
bit pattern of the score plus ``+0.0``, which makes ``-0.0`` the key of ``+0.0``: an exact tie;
negative values' magnitude bits flipped), every NaN the largest key (a NaN ranks above +inf) and
a key the row does not see the smallest, below -inf's. With ``k = min(topk, S)``:
the ``k``-th largest key per row (``torch.topk`` of the keys, then its minimum), every key above
it, and of the keys equal to it the first ones (smallest key index, by a cumulative count) up to
``k`` in all; of those, the keys the row sees. The selected keys are then compacted in ascending
key index by a scatter through a permutation (selected keys to slots ``0, 1, ...``, the others
after them), so no two writes meet. Slots past the row's selection hold -1 and score 0.

Memory: rows are processed in chunks (whole batch elements at once where a batch element's rows
fit), so that a chunk's temporaries (its float32 scores ``[c, H, S]`` and the selection's ``[c, S]``
tensors: about ``S · (4·H + 48)`` bytes per row) stay within :data:`SCORE_BYTES`; no ``[T, S]``
tensor of the whole problem is formed. Causal rows still score every key of their batch element
(which keys a chunk sees is data, the positions, and a width read from it would need a host
synchronisation).
"""

from __future__ import annotations

from typing import Iterator, Optional

import torch
from torch import Tensor

# The temporaries one chunk may hold: 256 MiB (read at each call).
SCORE_BYTES = 2**28

_KEY_MAX = 2**31 - 1  # NaN: above +inf (bits 0x7F800000)
_KEY_MIN = -(2**31)  # not seen: below -inf (key 0x807FFFFF)
_FLIP = 0x7FFFFFFF


def chunk_rows(n_heads: int, S: int, budget: int) -> int:
    """Rows (query tokens) per chunk: as many as keep about ``S · (4·n_heads + 48)`` bytes each
    (the float32 scores and the selection's temporaries) within ``budget``; at least 1."""
    return max(1, budget // max(1, S * (4 * n_heads + 48)))


def _blocks(B: int, T: int, rows: int) -> Iterator[tuple[int, int, int, int]]:
    """``(b0, b1, t0, t1)`` blocks of at most ``rows`` rows: whole batch elements where ``T <=
    rows``, else ``rows`` tokens of one batch element."""
    if rows >= T:
        step = max(1, rows // max(T, 1))
        for b0 in range(0, B, step):
            yield b0, min(B, b0 + step), 0, T
        return
    for b in range(B):
        for t0 in range(0, T, rows):
            yield b, b + 1, t0, min(T, t0 + rows)


def _scores(q: Tensor, k: Tensor, weights: Tensor, q_scale: Optional[Tensor] = None,
            k_scale: Optional[Tensor] = None) -> Tensor:
    """``q [n, c, H, D]``, ``k [n, S, D]``, ``weights [n, c, H]`` float32 (fp8 q and k: with
    ``q_scale [n, c, H]`` or None and ``k_scale [n, S]`` float32) -> ``[n, c, S]`` float32
    scores."""
    n, c, H, D = q.shape
    S = k.shape[1]
    rows = q.reshape(n, c * H, D)
    if q.is_cuda and q.dtype in (torch.bfloat16, torch.float16):
        dots = torch.bmm(rows, k.transpose(1, 2), out_dtype=torch.float32)
    else:
        dots = torch.bmm(rows.float(), k.float().transpose(1, 2))
    dots = dots.view(n, c, H, S)
    if q_scale is not None:
        dots.mul_(q_scale.unsqueeze(-1))
    if k_scale is not None:
        dots.mul_(k_scale.view(n, 1, 1, S))
    dots = dots.relu_().view(n * c, H, S)
    return torch.bmm(weights.reshape(n * c, 1, H), dots).view(n, c, S)


def _keys(scores: Tensor, seen: Optional[Tensor]) -> Tensor:
    """int32 keys in the scores' order (module docstring): ``-0.0`` as ``+0.0``, NaN largest,
    unseen smallest."""
    bits = (scores + 0.0).view(torch.int32)
    keys = torch.where(bits < 0, bits ^ _FLIP, bits)
    keys = keys.masked_fill(torch.isnan(scores), _KEY_MAX)
    return keys if seen is None else keys.masked_fill(~seen, _KEY_MIN)


def select(scores: Tensor, seen: Optional[Tensor], topk: int) -> tuple[Tensor, Tensor]:
    """The lightning indexer's selection of each row of ``scores [R, S]`` float32 (``seen [R, S]``
    bool, or None for every key seen): the ``min(topk, n_seen)`` seen keys of largest score, ties
    to the smaller key index, NaN above +inf, in ascending key index, then -1.

    Returns:
        ``(indices [R, topk] int32, selected scores [R, topk] float32, 0 on -1 slots)``.
    """
    R, S = scores.shape
    kk = min(topk, S)
    indices = torch.full((R, topk), -1, dtype=torch.int32, device=scores.device)
    values = scores.new_zeros((R, topk))
    if kk == 0 or R == 0:
        return indices, values
    keys = _keys(scores, seen)
    kth = keys.topk(kk, dim=-1, sorted=False).values.amin(-1, keepdim=True)
    above = keys > kth
    tied = keys == kth
    room = kk - above.sum(-1, keepdim=True)
    taken = above | (tied & (tied.cumsum(-1) <= room))
    if seen is not None:
        taken &= seen
    before = taken.cumsum(-1)  # taken keys up to and including s
    n_taken = before[:, -1:]
    column = torch.arange(S, device=scores.device)
    slot = torch.where(taken, before - 1, n_taken + column - before)  # a permutation of [0, S)
    order = torch.empty((R, S), dtype=torch.int64, device=scores.device)
    order.scatter_(1, slot, column.expand(R, S))
    picked = order[:, :kk]
    filled = column[:kk] < n_taken
    indices[:, :kk] = torch.where(filled, picked, -1).to(torch.int32)
    values[:, :kk] = torch.where(filled, scores.gather(1, picked), 0.0)
    return indices, values


def lightning_indexer(q: Tensor, k: Tensor, weights: Tensor, q_positions: Optional[Tensor],
                      topk: int, *, q_scale: Optional[Tensor] = None,
                      k_scale: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
    """Reference lightning indexer; see the backend protocol,
    :class:`mla_inductor.backends.Backend`.

    ``q [B, T, H, D]``, ``k [B, S, D]`` (q's dtype), ``weights [B, T, H]`` float32,
    ``q_positions [B, T]`` int32 or None (causal: key ``s`` is seen by token ``t`` when ``s <=
    q_positions[b, t]``), ``topk >= 0``; with float8_e4m3fn q and k, ``q_scale [B, T, H]``
    float32 or None (1) and ``k_scale [B, S]`` float32 (module docstring). Returns contiguous
    ``indices [B, T, topk]`` int32 (the selected keys in ascending key index, then -1) and
    ``scores [B, T, topk]`` float32 (each slot's score, 0 on -1 slots). Chunked as the module
    docstring says.
    """
    column = torch.arange(k.shape[1], device=q.device)

    def seen(b0, b1, t0, t1):
        return None if q_positions is None else column <= q_positions[b0:b1, t0:t1, None]

    return _run(q, k, weights, topk, seen, q_scale, k_scale)


def lightning_indexer_seen(q: Tensor, k: Tensor, weights: Tensor, seen: Tensor, topk: int,
                           q_scale: Optional[Tensor] = None,
                           k_scale: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
    """:func:`lightning_indexer` with any visibility: ``seen [B or 1, T, S]`` bool (True: token
    ``t`` sees key ``s``), for callers whose visibility is a dense mask that positions cannot
    express (padding, packed sequences). Same arithmetic (fp8 q and k with their scales too),
    selection, outputs and chunking; the mask itself is the caller's O(T·S) tensor."""

    def block(b0, b1, t0, t1):
        rows = seen[b0:b1] if seen.shape[0] > 1 else seen
        return rows[:, t0:t1].expand(b1 - b0, t1 - t0, seen.shape[-1])

    return _run(q, k, weights, topk, block, q_scale, k_scale)


def _run(q: Tensor, k: Tensor, weights: Tensor, topk: int, seen,
         q_scale: Optional[Tensor] = None,
         k_scale: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
    """The chunk loop: ``seen(b0, b1, t0, t1)`` gives a block's ``[b1 - b0, t1 - t0, S]`` bool
    visibility, or None (every key seen); the fp8 scales as :func:`lightning_indexer`'s."""
    B, T, H, _ = q.shape
    S = k.shape[1]
    indices = torch.full((B, T, topk), -1, dtype=torch.int32, device=q.device)
    values = torch.zeros((B, T, topk), dtype=torch.float32, device=q.device)
    if min(topk, S) == 0:
        return indices, values
    for b0, b1, t0, t1 in _blocks(B, T, chunk_rows(H, S, SCORE_BYTES)):
        scores = _scores(q[b0:b1, t0:t1], k[b0:b1], weights[b0:b1, t0:t1],
                         None if q_scale is None else q_scale[b0:b1, t0:t1],
                         None if k_scale is None else k_scale[b0:b1])
        visible = seen(b0, b1, t0, t1)
        idx, val = select(scores.view(-1, S), None if visible is None else visible.reshape(-1, S),
                          topk)
        indices[b0:b1, t0:t1] = idx.view(b1 - b0, t1 - t0, topk)
        values[b0:b1, t0:t1] = val.view(b1 - b0, t1 - t0, topk)
    return indices, values
