"""PyTorch reference of the lightning indexer's scores at the selected slots, forward and backward
(backend protocol functions ``lightning_indexer_scores`` and ``lightning_indexer_scores_bwd`` of
:mod:`mla_inductor.kernels`, exposed by :mod:`mla_inductor.kernels.reference`).

``scores[b, t, j] = sum_h weights[b, t, h] * relu(q[b, t, h] . k[b, indices[b, t, j]])`` (the
lightning indexer's definition, DeepSeek-V3.2-Exp technical report, section 2.1), float32
products and accumulation. The backward, with ``g = dscores`` and ``L[h, j] = q[h] . k_j``:
``dweights[h] = sum_j g[j] * relu(L[h, j])``, ``dL[h, j] = g[j] * weights[h] * [L[h, j] > 0]``
(relu's gradient is 0 at exactly 0, as ``torch.relu``'s), ``dq[h] = sum_j dL[h, j] * k_j`` and
``dk[indices[j]] += sum_h dL[h, j] * q[h]``, accumulated in float32 with ``index_add_`` (once per
occurrence of a duplicated index; deterministic on the CPU, and on CUDA under
``torch.use_deterministic_algorithms(True)``).

Rows ``r = b * T + t`` are processed in chunks, so that the chunk's gathered keys ``[c, topk, D]``
and logits ``[c, H, topk]`` (float32) stay within :data:`_CHUNK_ELEMENTS` elements; no
``[T, topk, D]`` gather of the whole problem is formed. An empty slot (index < 0 or >= S) reads
row 0 of its batch element's keys, whose value is then replaced by zeros, so that nothing of that
row (NaN included) reaches a result; its score is exactly 0 and it gets no gradient.
"""

from __future__ import annotations

import torch

_CHUNK_ELEMENTS = 1 << 22  # float32 elements of one chunk's gathered keys and logits (16 MiB)


def _chunks(R: int, topk: int, D: int, H: int):
    step = max(1, _CHUNK_ELEMENTS // max(topk * (D + H), 1))
    for r0 in range(0, R, step):
        yield r0, min(R, r0 + step)


def _slots(indices: torch.Tensor, r0: int, r1: int, T: int, S: int):
    """``(valid [c, topk] bool, rows [c, topk] int64)`` of flattened rows ``r0 .. r1``: whether
    each slot names a key, and the row of the flattened keys ``[B * S, D]`` it reads (row 0 of its
    batch element for an empty slot)."""
    idx = indices[r0:r1]
    valid = (idx >= 0) & (idx < S)
    batch = torch.arange(r0, r1, device=idx.device) // max(T, 1)
    rows = torch.where(valid, idx, 0).long() + (batch * S)[:, None]
    return valid, rows


def _gather(k: torch.Tensor, rows: torch.Tensor, valid: torch.Tensor, acc) -> torch.Tensor:
    """``k [B * S, D]`` at ``rows [c, topk]`` as ``[c, topk, D]`` of dtype ``acc``, zeros on empty
    slots."""
    picked = k.index_select(0, rows.reshape(-1)).reshape(*rows.shape, k.shape[-1])
    return torch.where(valid[..., None], picked.to(acc), 0.0)


def _accumulator(q: torch.Tensor) -> torch.dtype:
    """float32; float64 for float64 inputs (which only a direct call passes: the op takes
    bf16, fp16 or fp32), so that the backward can be checked against finite differences."""
    return torch.float64 if q.dtype == torch.float64 else torch.float32


def lightning_indexer_scores(q, k, weights, indices):
    """Reference forward; see the backend protocol in :mod:`mla_inductor.kernels`.

    ``q [B, T, H, D]``, ``k [B, S, D]`` (q's dtype), ``weights [B, T, H]`` float32, ``indices
    [B, T, topk]`` int32, all contiguous; returns contiguous ``scores [B, T, topk]`` float32
    (float64 for float64 inputs: :func:`_accumulator`).
    """
    B, T, H, D = q.shape
    S, topk = k.shape[1], indices.shape[-1]
    R = B * T
    acc = _accumulator(q)
    scores = q.new_zeros((B, T, topk), dtype=acc)
    if R == 0 or topk == 0 or S == 0:
        return scores
    q2, w2, i2 = q.reshape(R, H, D), weights.reshape(R, 1, H), indices.reshape(R, topk)
    k2, out = k.reshape(B * S, D), scores.view(R, topk)
    for r0, r1 in _chunks(R, topk, D, H):
        valid, rows = _slots(i2, r0, r1, T, S)
        keys = _gather(k2, rows, valid, acc)
        logits = torch.bmm(q2[r0:r1].to(acc), keys.transpose(1, 2)).relu_()  # [c, H, topk]
        s = torch.bmm(w2[r0:r1].to(acc), logits).squeeze(1)  # [c, topk]
        out[r0:r1] = torch.where(valid, s, 0.0)
    return scores


def lightning_indexer_scores_bwd(dscores, q, k, weights, indices):
    """Reference backward; see the backend protocol in :mod:`mla_inductor.kernels`.

    ``dscores [B, T, topk]`` float32, the rest as :func:`lightning_indexer_scores`'s, all
    contiguous. Returns contiguous ``dq [B, T, H, D]`` in q's dtype, ``dk [B, S, D]`` in k's dtype
    (rows no valid slot names get exact zeros) and ``dweights [B, T, H]`` float32 (module
    docstring; float64 for float64 inputs). Empty slots contribute nothing, whatever their ``dscores`` (NaN included).
    """
    B, T, H, D = q.shape
    S, topk = k.shape[1], indices.shape[-1]
    R = B * T
    acc = _accumulator(q)
    dq = torch.zeros((R, H, D), dtype=q.dtype, device=q.device)
    dk = torch.zeros((B * S, D), dtype=acc, device=k.device)
    dweights = torch.zeros((R, H), dtype=acc, device=q.device)
    if R and topk and S:
        q2, w2, i2 = q.reshape(R, H, D), weights.reshape(R, H), indices.reshape(R, topk)
        g2, k2 = dscores.reshape(R, topk), k.reshape(B * S, D)
        for r0, r1 in _chunks(R, topk, D, H):
            valid, rows = _slots(i2, r0, r1, T, S)
            keys = _gather(k2, rows, valid, acc)
            qc = q2[r0:r1].to(acc)
            logits = torch.bmm(qc, keys.transpose(1, 2))  # [c, H, topk]
            g = torch.where(valid, g2[r0:r1].to(acc), 0.0)[:, None, :]  # [c, 1, topk]
            # an empty slot's logit (0, or NaN for an inf in q) must not reach dweights
            relu = torch.where(valid[:, None, :], logits.relu(), 0.0)
            dweights[r0:r1] = (relu * g).sum(-1)
            live = valid[:, None, :] & (logits > 0)
            dlogits = torch.where(live, g * w2[r0:r1].to(acc)[..., None], 0.0)
            dq[r0:r1] = torch.bmm(dlogits, keys).to(q.dtype)
            dkeys = torch.bmm(dlogits.transpose(1, 2), qc)  # [c, topk, D]
            dk.index_add_(0, rows[valid], dkeys[valid])
    return (dq.view(B, T, H, D), dk.view(B, S, D).to(k.dtype), dweights.view(B, T, H))
