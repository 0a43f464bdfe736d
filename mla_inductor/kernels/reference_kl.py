"""The reference backend's indexer KL (:mod:`mla_inductor.ops.indexer_kl`): the per-row values and
their gradient in PyTorch, on any device, with the SM90 kernels' arithmetic (the expansion
``kl = sum t log t - sum t l + tsum lse`` over the valid slots with ``t != 0``, ``lse`` from the
row's maximum) and their rules for non-finite values (:mod:`mla_inductor.kernels.sm90.kl`)."""

from __future__ import annotations

import torch


def _valid(indices, hi, length):
    """``[R, K]`` bool: ``0 <= indices <= hi[r]`` and slot ``j < length[r]``."""
    slots = torch.arange(indices.shape[1], device=indices.device)
    return (indices >= 0) & (indices <= hi[:, None]) & (slots < length[:, None])


def _lse(logits, valid):
    """``log sum_{valid} exp(l)`` per row from the row's maximum: -inf for a row without a valid
    slot or whose valid logits are all -inf, NaN where one is NaN or +inf."""
    masked = logits.masked_fill(~valid, -torch.inf)
    if masked.shape[-1] == 0:  # no slot (amax needs one)
        return masked.new_full(masked.shape[:-1], -torch.inf)
    m = masked.amax(-1, keepdim=True)
    safe = torch.where(m == -torch.inf, 0.0, m)
    return (safe + (masked - safe).exp().sum(-1, keepdim=True).log()).squeeze(-1)


def indexer_kl(logits, target, indices, hi, length):
    """``(kl, lse, tsum, count)`` per row (:mod:`mla_inductor.ops.indexer_kl`)."""
    valid = _valid(indices, hi, length)
    count = valid.sum(-1, dtype=torch.int32)
    lse = _lse(logits, valid)
    kept = valid & (target != 0)
    a = torch.where(kept, torch.xlogy(target, target) - target * logits, 0.0).sum(-1)
    tsum = torch.where(kept, target, 0.0).sum(-1)
    kl = a + torch.where(tsum != 0, tsum * lse, 0.0)
    return torch.where(count > 0, kl, 0.0), lse, tsum, count


def indexer_kl_bwd(dkl, logits, target, indices, hi, length, lse, tsum):
    """``dlogits [R, K]``: ``dkl (exp(l - lse) tsum - t)`` on the valid slots, else 0."""
    valid = _valid(indices, hi, length)
    grad = dkl[:, None] * ((logits - lse[:, None]).exp() * tsum[:, None] - target)
    return torch.where(valid, grad, 0.0)
