"""PyTorch reference backend: sparse-MLA forward and backward on any device.

The arithmetic is the textbook one (not a kernel emulation; see ``kernels/emulate.py`` for that):
scores in fp32, a softmax normalised by the row max and the row sum (``exp(s - max) / sum``, so
its precision does not depend on the size of the scores or of lse), fp32 accumulation, one
rounding of the outputs to the input dtype. The backward recomputes the softmax the same way
(it does not read ``lse``). Tokens are processed in chunks so that the gathered rows of at most
``_CHUNK_ELEMENTS`` elements are alive at once; no ``[T, topk, d_qk]`` gather of the whole problem
is ever materialised.

Empty slots (index < 0, index >= S, or position >= ``topk_length[t]``) are never read: their
index is redirected to row 0 (never an out-of-range address) and the gathered row is replaced by
zeros, so no value of row 0 (NaN included) reaches a score, an output or a gradient; their score
is -inf and their gradient is never scattered. A row with no valid slot gets out = 0,
lse = -inf and zero gradients. A NaN or +inf score (from a NaN or inf in q or in a row a valid
slot names) propagates: that row's out and lse are NaN.
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
    """Rows ``kv[indices]`` in fp32 as ``[c, topk, d_qk]``; zeros on empty slots (which read row
    0, whose values are then dropped)."""
    safe = torch.where(valid, indices, torch.zeros_like(indices)).long()
    rows = kv.index_select(0, safe.reshape(-1)).reshape(*indices.shape, kv.shape[-1])
    return torch.where(valid[..., None], rows.float(), 0.0)


def _scores(q_c, rows, valid, sm_scale):
    s = torch.bmm(q_c.float(), rows.transpose(1, 2)) * sm_scale  # [c, H, topk]
    return s.masked_fill(~valid[:, None, :], -math.inf)


def _softmax(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(p, lse)`` of scores ``s [c, H, topk]``: ``p = exp(s - max) / sum`` (0 on rows whose
    scores are all -inf) and ``lse = max + log(sum)`` ``[c, H]`` (-inf on those rows; NaN where a
    score is NaN or +inf)."""
    m = s.amax(dim=-1, keepdim=True)
    m = torch.where(m == -math.inf, 0.0, m)
    e = torch.exp(s - m)
    total = e.sum(dim=-1, keepdim=True)
    p = e / torch.where(total == 0, 1.0, total)
    return p, (m + torch.log(total)).squeeze(-1)


def forward(q, kv, indices, topk_length, sm_scale, d_v, rescale_threshold, return_o_lo):
    """Reference forward; see the backend protocol in :mod:`mla_inductor.kernels`.

    ``rescale_threshold`` does not change the arithmetic here: the softmax always uses the exact
    maximum, which is what ``0.0`` asks a kernel to do.
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
        p, lse_c = _softmax(s)
        o = torch.bmm(p, rows[..., :d_v])
        out[t0:t1] = o.to(q.dtype)
        lse[t0:t1] = lse_c
        if return_o_lo:
            o_lo[t0:t1] = (o - out[t0:t1].float()).to(q.dtype)
    return out, lse, o_lo


def backward(dout, q, kv, indices, topk_length, out, lse, o_lo, sm_scale, d_v):
    """Reference backward; see the backend protocol in :mod:`mla_inductor.kernels`.

    The textbook fp32 gradients of the softmax (:func:`gradients` with ``dpsum = None``): P is
    recomputed from the scores as the forward computes it, and ``dpsum = rowsum(P * dP)`` from
    that P. ``out``, ``lse`` and ``o_lo`` are not read: lse's fp32 rounding (about
    ``|lse| * 2**-24``) would be a gain error on P, and ``rowsum(dout * out)`` cancels against
    ``dP`` of the dominant key on peaked rows (the kernels' form, see
    :func:`mla_inductor.kernels.emulate.backward`).
    """
    return gradients(dout, q, kv, indices, topk_length, sm_scale, d_v)


def gradients(dout, q, kv, indices, topk_length, sm_scale, d_v, dpsum=None):
    """``(dq, dkv)`` for the upstream gradient ``dout [T, H, d_v]``, with P recomputed from the
    scores in fp32 and ``dS = P * (dP - dpsum) * sm_scale``.

    Args:
        dpsum: ``[T, H]`` float32, the row sums ``rowsum(dout * O)`` as a kernel forms them; or
            ``None`` for ``rowsum(P * dP)`` from the recomputed P (the textbook form).

    Returns:
        ``dq [T, H, d_qk]`` in q's dtype and ``dkv [S, d_qk]`` in kv's dtype; dkv is accumulated
        in fp32 with ``index_add_`` over the valid slots only (duplicated indices accumulate
        once per occurrence; rows no valid slot names get exact zeros).
    """
    T, H, d_qk = q.shape
    S = kv.shape[0]
    dq = torch.zeros_like(q, memory_format=torch.contiguous_format)
    dkv_acc = torch.zeros((S, d_qk), dtype=torch.float32, device=kv.device)
    if S == 0 or T == 0:
        return dq, dkv_acc.to(kv.dtype)
    for t0, t1 in _chunks(T, indices.shape[1], d_qk, H):
        idx = indices[t0:t1]
        valid = valid_slots(idx, None if topk_length is None else topk_length[t0:t1], S)
        rows = _gather(kv, idx, valid)
        s = _scores(q[t0:t1], rows, valid, sm_scale)
        p, _ = _softmax(s)  # exactly 0 on empty slots
        do = dout[t0:t1].float()
        dp = torch.bmm(do, rows[..., :d_v].transpose(1, 2))
        dpsum_c = (p * dp).sum(-1) if dpsum is None else dpsum[t0:t1]
        ds = p * (dp - dpsum_c[..., None]) * sm_scale
        dq[t0:t1] = torch.bmm(ds, rows).to(q.dtype)
        drows = torch.bmm(ds.transpose(1, 2), q[t0:t1].float())  # [c, topk, d_qk]
        drows[..., :d_v] += torch.bmm(p.transpose(1, 2), do)
        dkv_acc.index_add_(0, idx[valid].long(), drows[valid])
    return dq, dkv_acc.to(kv.dtype)
