"""PyTorch reference of the lightning indexer's scores at the selected slots, forward and backward
(backend protocol functions ``lightning_indexer_scores`` and ``lightning_indexer_scores_bwd`` of
:class:`mla_inductor.backends.Backend`, exposed by :mod:`mla_inductor.kernels.reference`).

``scores[b, t, j] = sum_h weights[b, t, h] * relu(q[b, t, h] . k[b, indices[b, t, j]])`` (the
lightning indexer's definition, DeepSeek-V3.2-Exp technical report, section 2.1), float32
products and accumulation. The backward, with ``g = dscores`` and ``L[h, j] = q[h] . k_j``:
``dweights[h] = sum_j g[j] * relu(L[h, j])``, ``dL[h, j] = g[j] * weights[h] * [L[h, j] > 0]``
(relu's gradient is 0 at exactly 0, as ``torch.relu``'s), ``dq[h] = sum_j dL[h, j] * k_j`` and
``dk[indices[j]] += sum_h dL[h, j] * q[h]``, accumulated in float32 with ``index_add_`` (once per
occurrence of a duplicated index; deterministic on the CPU, and on CUDA with ``deterministic``
or under ``torch.use_deterministic_algorithms(True)``).

Rows ``r = b * T + t`` are processed in chunks, so that the chunk's gathered keys ``[c, topk, D]``
and logits ``[c, H, topk]`` (float32) stay within :data:`_CHUNK_ELEMENTS` elements; no
``[T, topk, D]`` gather of the whole problem is formed. An empty slot (index < 0 or >= S) reads
a zero row appended to the keys (never a key: nothing of the keys, NaN included, reaches a result
through it), its logits are set to 0 and its ``dscores`` ignored: its score is exactly 0 and it
gives and gets no gradient.
"""

from __future__ import annotations

import torch

from .determinism import deterministic_mode

_CHUNK_ELEMENTS = 1 << 22  # float32 elements of one chunk's gathered keys and logits (16 MiB)


def _chunks(R: int, topk: int, D: int, H: int):
    step = max(1, _CHUNK_ELEMENTS // max(topk * (D + H), 1))
    for r0 in range(0, R, step):
        yield r0, min(R, r0 + step)


def _slots(indices: torch.Tensor, r0: int, r1: int, T: int, S: int, B: int):
    """``(valid [c, topk] bool, rows [c, topk] int64)`` of flattened rows ``r0 .. r1``: whether
    each slot names a key, and the row of the padded keys ``[B * S + 1, D]`` it reads: its batch
    element's key, or the zero row ``B * S`` for an empty slot."""
    idx = indices[r0:r1]
    valid = (idx >= 0) & (idx < S)
    batch = torch.arange(r0, r1, device=idx.device) // max(T, 1)
    rows = torch.where(valid, idx.long() + (batch * S)[:, None], B * S)
    return valid, rows


def _padded(k: torch.Tensor, acc: torch.dtype) -> torch.Tensor:
    """``k [B, S, D]`` as ``[B * S + 1, D]`` of dtype ``acc`` with a zero last row, which the
    empty slots read (one copy of the keys, instead of a mask over every gathered row)."""
    B, S, D = k.shape
    padded = k.new_zeros((B * S + 1, D), dtype=acc)
    padded[:-1] = k.reshape(B * S, D)
    return padded


def _gather(k: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """The padded keys ``k [B * S + 1, D]`` at ``rows [c, topk]``: ``[c, topk, D]``."""
    return k.index_select(0, rows.reshape(-1)).reshape(*rows.shape, k.shape[-1])


def _accumulator(q: torch.Tensor) -> torch.dtype:
    """float32; float64 for float64 inputs (which only a direct call passes: the op takes
    bf16, fp16 or fp32), so that the backward can be checked against finite differences."""
    return torch.float64 if q.dtype == torch.float64 else torch.float32


def lightning_indexer_scores(q, k, weights, indices):
    """Reference forward; see the backend protocol, :class:`mla_inductor.backends.Backend`.

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
    k2, out = _padded(k, acc), scores.view(R, topk)
    for r0, r1 in _chunks(R, topk, D, H):
        valid, rows = _slots(i2, r0, r1, T, S, B)
        logits = torch.bmm(q2[r0:r1].to(acc), _gather(k2, rows).transpose(1, 2))  # [c, H, topk]
        s = torch.bmm(w2[r0:r1].to(acc), logits.relu_()).squeeze(1)  # [c, topk]
        out[r0:r1] = torch.where(valid, s, 0.0)
    return scores


def lightning_indexer_scores_bwd(dscores, q, k, weights, indices, deterministic=False):
    """Reference backward; see the backend protocol, :class:`mla_inductor.backends.Backend`.

    ``dscores [B, T, topk]`` float32, the rest as :func:`lightning_indexer_scores`'s, all
    contiguous. Returns contiguous ``dq [B, T, H, D]`` in q's dtype, ``dk [B, S, D]`` in k's dtype
    (rows no valid slot names get exact zeros) and ``dweights [B, T, H]`` float32 (module
    docstring; float64 for float64 inputs). Empty slots contribute nothing, whatever their
    ``dscores`` (NaN included). With ``deterministic`` dk's ``index_add_`` runs under PyTorch's
    deterministic mode (:func:`.determinism.deterministic_mode`).
    """
    B, T, H, D = q.shape
    S, topk = k.shape[1], indices.shape[-1]
    R = B * T
    acc = _accumulator(q)
    dq = torch.zeros((R, H, D), dtype=q.dtype, device=q.device)
    dk = torch.zeros((B * S + 1, D), dtype=acc, device=k.device)  # the last row: empty slots'
    dweights = torch.zeros((R, H), dtype=acc, device=q.device)
    if R and topk and S:
        q2, w2, i2 = q.reshape(R, H, D), weights.reshape(R, H), indices.reshape(R, topk)
        g2, k2 = dscores.reshape(R, topk), _padded(k, acc)
        for r0, r1 in _chunks(R, topk, D, H):
            valid, rows = _slots(i2, r0, r1, T, S, B)
            keys = _gather(k2, rows)
            qc = q2[r0:r1].to(acc)
            logits = torch.bmm(qc, keys.transpose(1, 2))  # [c, H, topk]
            # an empty slot's logit (0, or NaN for an inf in q) must reach nothing
            logits.masked_fill_(~valid[:, None, :], 0.0)
            g = torch.where(valid, g2[r0:r1].to(acc), 0.0)[..., None]  # [c, topk, 1]
            dweights[r0:r1] = torch.bmm(logits.clamp_min(0.0), g).squeeze(-1)
            dlogits = torch.where(logits > 0, g.transpose(1, 2) * w2[r0:r1].to(acc)[..., None],
                                  0.0)
            dq[r0:r1] = torch.bmm(dlogits, keys).to(q.dtype)
            dkeys = torch.bmm(dlogits.transpose(1, 2), qc)  # [c, topk, D]; 0 on empty slots
            with deterministic_mode(deterministic):
                dk.index_add_(0, rows.reshape(-1), dkeys.reshape(-1, D))
    return dq.view(B, T, H, D), dk[:-1].view(B, S, D).to(k.dtype), dweights.view(B, T, H)
