"""PyTorch reference backend: sparse-MLA forward and backward on any device.

The arithmetic is the textbook one (not a kernel emulation; see ``kernels/emulate.py`` for that):
scores and softmax in fp32 (exact max via ``logsumexp``), fp32 accumulation, one rounding of the
outputs to the input dtype. Tokens are processed in chunks so that the gathered rows of at most
``_CHUNK_ELEMENTS`` elements are alive at once; no ``[T, topk, d_qk]`` gather of the whole problem
is ever materialised.

Empty slots (index < 0, index >= S, or position >= ``topk_length[t]``) are masked before the
gather: their index is redirected to row 0 (never an out-of-range address), their score is -inf
and their gradient is never scattered. A row with no valid slot gets out = 0, lse = -inf and
zero gradients.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

_CHUNK_ELEMENTS = 1 << 22  # fp32 elements of gathered rows per chunk (16 MiB)


def available() -> tuple[bool, str]:
    """Always ``(True, "")``: plain PyTorch runs on every device."""
    return True, ""


def _chunks(T: int, topk: int, d_qk: int, heads: int):
    per_token = topk * (d_qk + heads)
    step = max(1, _CHUNK_ELEMENTS // max(per_token, 1))
    for t0 in range(0, T, step):
        yield t0, min(T, t0 + step)


def valid_slots(
    indices: torch.Tensor, topk_length: Optional[torch.Tensor], S: int
) -> torch.Tensor:
    """Boolean mask ``[T, topk]`` of the slots that hold a row (``0 <= index < S`` and position
    ``< topk_length[t]`` when given)."""
    valid = (indices >= 0) & (indices < S)
    if topk_length is not None:
        pos = torch.arange(indices.shape[-1], device=indices.device)
        valid &= pos < topk_length[..., None]
    return valid


def _gather(kv: torch.Tensor, indices: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Rows ``kv[indices]`` in fp32 as ``[c, topk, d_qk]``; empty slots read row 0 and are masked."""
    safe = torch.where(valid, indices, torch.zeros_like(indices)).long()
    rows = kv.index_select(0, safe.reshape(-1)).reshape(*indices.shape, kv.shape[-1])
    return rows.float()


def _scores(q_c, rows, valid, sm_scale):
    s = torch.bmm(q_c.float(), rows.transpose(1, 2)) * sm_scale  # [c, H, topk]
    return s.masked_fill(~valid[:, None, :], -math.inf)


def forward(q, kv, indices, topk_length, sm_scale, d_v, rescale_threshold, return_o_lo):
    """Reference forward; see the backend protocol in :mod:`mla_inductor.kernels`.

    ``rescale_threshold`` does not change the arithmetic here: the softmax always uses the exact
    maximum (``logsumexp``), which is what ``0.0`` asks a kernel to do.
    """
    T, H, d_qk = q.shape
    S = kv.shape[0]
    out = q.new_empty((T, H, d_v))
    lse = q.new_empty((T, H), dtype=torch.float32)
    o_lo = q.new_empty((T, H, d_v) if return_o_lo else (0,))
    if S == 0:
        out.zero_()
        lse.fill_(-math.inf)
        o_lo.zero_()
        return out, lse, o_lo
    for t0, t1 in _chunks(T, indices.shape[1], d_qk, H):
        valid = valid_slots(indices[t0:t1], None if topk_length is None else topk_length[t0:t1], S)
        rows = _gather(kv, indices[t0:t1], valid)
        s = _scores(q[t0:t1], rows, valid, sm_scale)
        lse_c = torch.logsumexp(s, dim=-1)
        p = torch.exp(s - torch.where(torch.isinf(lse_c), 0.0, lse_c)[..., None])
        o = torch.bmm(p, rows[..., :d_v])
        out[t0:t1] = o.to(q.dtype)
        lse[t0:t1] = lse_c
        if return_o_lo:
            o_lo[t0:t1] = (o - out[t0:t1].float()).to(q.dtype)
    return out, lse, o_lo


def backward(dout, q, kv, indices, topk_length, out, lse, o_lo, sm_scale, d_v):
    """Reference backward; see the backend protocol in :mod:`mla_inductor.kernels`.

    ``dpsum = rowsum(dout * (out + o_lo))`` in fp32 when ``o_lo`` is non-empty (the precise form
    of the seed notes), ``rowsum(dout * out)`` otherwise. P is recomputed from ``lse``;
    ``dS = P * (dP - dpsum) * sm_scale``; dkv is accumulated in fp32 with ``index_add_`` over the
    valid slots only (duplicated indices accumulate once per occurrence).
    """
    T, H, d_qk = q.shape
    S = kv.shape[0]
    dq = torch.zeros_like(q, memory_format=torch.contiguous_format)
    dkv_acc = torch.zeros((S, d_qk), dtype=torch.float32, device=kv.device)
    if S == 0 or T == 0:
        return dq, dkv_acc.to(kv.dtype)
    o_full = out.float() + o_lo.float() if o_lo.numel() else out.float()
    dpsum = (dout.float() * o_full).sum(-1)  # [T, H]
    lse_safe = torch.where(torch.isinf(lse), 0.0, lse)
    for t0, t1 in _chunks(T, indices.shape[1], d_qk, H):
        idx = indices[t0:t1]
        valid = valid_slots(idx, None if topk_length is None else topk_length[t0:t1], S)
        rows = _gather(kv, idx, valid)
        s = _scores(q[t0:t1], rows, valid, sm_scale)
        p = torch.exp(s - lse_safe[t0:t1, :, None])  # exactly 0 on empty slots
        do = dout[t0:t1].float()
        dp = torch.bmm(do, rows[..., :d_v].transpose(1, 2))
        ds = p * (dp - dpsum[t0:t1, :, None]) * sm_scale
        dq[t0:t1] = torch.bmm(ds, rows).to(q.dtype)
        drows = torch.bmm(ds.transpose(1, 2), q[t0:t1].float())  # [c, topk, d_qk]
        drows[..., :d_v] += torch.bmm(p.transpose(1, 2), do)
        dkv_acc.index_add_(0, idx[valid].long(), drows[valid])
    return dq, dkv_acc.to(kv.dtype)
