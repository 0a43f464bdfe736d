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
lse = -inf (its head's sink with an attention sink) and zero gradients. A NaN or +inf score (from
a NaN or inf in q or in a row a valid slot names) propagates: that row's out and lse are NaN.

DSA features: causal positions (a slot naming a key past ``q_positions[t]`` is empty), an
attention sink (one logit per head in the softmax denominator, no value:
``lse = log(exp(sink) + sum_j exp(s_j))``), ``max_logits`` (the maximum valid score, the sink
not included) and a gradient reaching lse (``dS_j = P_j (dP_j - dpsum + dlse)``,
``d_sink = -sum_t P_sink (dpsum - dlse)``).

The lightning indexer's reference (scores and an exact top-k selection, chunked) is
:mod:`mla_inductor.kernels.reference_lightning`; its scores at the selected slots and their
gradients are in :mod:`mla_inductor.kernels.reference_lightning_indexer_scores`, the indexer loss's
per-row KL in :mod:`mla_inductor.kernels.reference_kl` (all exposed here).
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from .determinism import deterministic_mode
from .reference_lightning import lightning_indexer  # noqa: F401  (the protocol function)
from .reference_kl import indexer_kl, indexer_kl_bwd  # noqa: F401  (protocol functions)
from .reference_lightning_indexer_scores import (  # noqa: F401  (this backend's protocol functions)
    lightning_indexer_scores,
    lightning_indexer_scores_bwd,
)

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
    indices: torch.Tensor,
    topk_length: Optional[torch.Tensor],
    S: int,
    q_positions: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Boolean mask ``[T, topk]`` of the slots that hold a row (``0 <= index < S``, position
    ``< topk_length[t]`` when given, and ``index <= q_positions[t]`` when given)."""
    valid = (indices >= 0) & (indices < S)
    if topk_length is not None:
        pos = torch.arange(indices.shape[-1], device=indices.device)
        valid &= pos < topk_length[..., None]
    if q_positions is not None:
        valid &= indices <= q_positions[..., None]
    return valid


def _chunk(t: Optional[torch.Tensor], t0: int, t1: int) -> Optional[torch.Tensor]:
    return None if t is None else t[t0:t1]


def _gather(kv: torch.Tensor, indices: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Rows ``kv[indices]`` in fp32 as ``[c, topk, d_qk]``; zeros on empty slots (which read row
    0, whose values are then dropped)."""
    safe = torch.where(valid, indices, torch.zeros_like(indices)).long()
    rows = kv.index_select(0, safe.reshape(-1)).reshape(*indices.shape, kv.shape[-1])
    return torch.where(valid[..., None], rows.float(), 0.0)


def _scores(q_c, rows, valid, sm_scale):
    s = torch.bmm(q_c.float(), rows.transpose(1, 2)) * sm_scale  # [c, H, topk]
    return s.masked_fill(~valid[:, None, :], -math.inf)


def _softmax(s: torch.Tensor, sink: Optional[torch.Tensor] = None):
    """``(p, lse, p_sink)`` of scores ``s [c, H, topk]`` and an optional sink ``[H]``:
    ``p = exp(s - m) / total`` with ``m`` the row max (the sink included) and ``total`` the sum
    of ``exp(s - m)`` and ``exp(sink - m)``; 0 on rows whose scores (and sink) are all -inf.
    ``lse = m + log(total)`` ``[c, H]`` (-inf on those rows; NaN where a score is NaN or +inf,
    or the sink is NaN; +inf for a +inf sink, whose rows get ``p = 0`` and ``p_sink = 1``);
    ``p_sink [c, H]`` the sink's probability (None without a sink)."""
    m = s.amax(dim=-1, keepdim=True)
    if sink is not None:
        sink = sink.float().view(1, -1, 1)
        m = torch.maximum(m, sink)
    m = torch.where(m == -math.inf, 0.0, m)
    e = torch.exp(s - m)
    total = e.sum(dim=-1, keepdim=True)
    e_sink = None
    if sink is not None:
        # A +inf sink is the max: exp(sink - m) is exp(inf - inf) = NaN, its value 1 (P_sink 1,
        # every slot's P 0, lse +inf); a NaN sink stays NaN (in m: every output of the row).
        e_sink = torch.where(sink == math.inf, 1.0, torch.exp(sink - m))
        total = total + e_sink
    safe = torch.where(total == 0, 1.0, total)
    p_sink = None if sink is None else (e_sink / safe).squeeze(-1)
    return e / safe, (m + torch.log(total)).squeeze(-1), p_sink


def outputs_without_slots(q, attn_sink, d_v, return_o_lo, return_max_logits):
    """The forward's outputs ``(out, lse, o_lo, max_logits)`` (the backend protocol's shapes and
    dtypes for ``q [T, H, d_qk]``) of rows without a valid slot: out and o_lo 0, lse its head's
    sink (``attn_sink [H]`` or None: -inf), max_logits -inf."""
    T, H = q.shape[0], q.shape[1]
    out = q.new_zeros((T, H, d_v))
    lse = q.new_full((T, H), -math.inf, dtype=torch.float32)
    if attn_sink is not None:
        lse.copy_(attn_sink.float().expand(T, H))
    o_lo = q.new_zeros((T, H, d_v) if return_o_lo else (0,))
    max_logits = q.new_full((T, H) if return_max_logits else (0,), -math.inf, dtype=torch.float32)
    return out, lse, o_lo, max_logits


def forward(q, kv, indices, topk_length, q_positions, attn_sink, sm_scale, d_v, rescale_threshold,
            return_o_lo, return_max_logits):
    """Reference forward; see the backend protocol, :class:`mla_inductor.backends.Backend`.

    ``rescale_threshold`` does not change the arithmetic here: the softmax always uses the exact
    maximum, which is what ``0.0`` asks a kernel to do.
    """
    T, H, d_qk = q.shape
    S = kv.shape[0]
    out, lse, o_lo, max_logits = outputs_without_slots(q, attn_sink, d_v, return_o_lo,
                                                       return_max_logits)
    if S == 0 or indices.shape[1] == 0:
        return out, lse, o_lo, max_logits
    for t0, t1 in _chunks(T, indices.shape[1], d_qk, H):
        valid = valid_slots(indices[t0:t1], _chunk(topk_length, t0, t1), S,
                            _chunk(q_positions, t0, t1))
        rows = _gather(kv, indices[t0:t1], valid)
        s = _scores(q[t0:t1], rows, valid, sm_scale)
        p, lse_c, _ = _softmax(s, attn_sink)
        o = torch.bmm(p, rows[..., :d_v])
        out[t0:t1] = o.to(q.dtype)
        lse[t0:t1] = lse_c
        if return_o_lo:
            o_lo[t0:t1] = (o - out[t0:t1].float()).to(q.dtype)
        if return_max_logits:
            max_logits[t0:t1] = s.amax(dim=-1)
    return out, lse, o_lo, max_logits


def backward(dout, dlse, q, kv, indices, topk_length, q_positions, attn_sink, out, lse, o_lo,
             sm_scale, d_v, deterministic=False):
    """Reference backward; see the backend protocol, :class:`mla_inductor.backends.Backend`.

    The textbook fp32 gradients of the softmax (:func:`gradients` with ``dpsum = None``): P is
    recomputed from the scores as the forward computes it, and ``dpsum = rowsum(P * dP)`` from
    that P. ``out``, ``lse`` and ``o_lo`` are not read: lse's fp32 rounding (about
    ``|lse| * 2**-24``) would be a gain error on P, and ``rowsum(dout * out)`` cancels against
    ``dP`` of the dominant key on peaked rows (the kernels' form, see
    :func:`mla_inductor.kernels.emulate.backward`). With ``deterministic`` it runs under
    PyTorch's deterministic mode (:func:`.determinism.deterministic_mode`).
    """
    with deterministic_mode(deterministic):
        return gradients(dout, q, kv, indices, topk_length, sm_scale, d_v,
                         q_positions=q_positions, attn_sink=attn_sink, dlse=dlse)


def gradients(dout, q, kv, indices, topk_length, sm_scale, d_v, dpsum=None, *, q_positions=None,
              attn_sink=None, dlse=None, dominant_from_row=True):
    """``(dq, dkv, d_sink)`` for the upstream gradients ``dout [T, H, d_v]`` and ``dlse [T, H]``
    (float32 or None), with P recomputed from the scores in fp32 and
    ``dS = P * (dP - dpsum + dlse) * sm_scale``, except (with ``dominant_from_row``) for each
    row's dominant key (P above 1/2), whose dS comes from the row's other keys without the
    cancellation of ``dP - dpsum`` (:func:`_dominant_from_row`).

    Args:
        dpsum: ``[T, H]`` float32, the row sums ``rowsum(dout * O)`` as a kernel forms them; or
            ``None`` for ``rowsum(P * dP)`` from the recomputed P (the textbook form).
        q_positions, attn_sink: as the forward's (``[T]`` int32, ``[H]`` float32, or None).
        dominant_from_row: the dominant key's dS from the row's other keys (default); False
            keeps the dpsum form on every key, as the kernels compute it.

    Returns:
        ``dq [T, H, d_qk]`` in q's dtype, ``dkv [S, d_qk]`` in kv's dtype (accumulated in fp32
        with ``index_add_`` over the valid slots only: duplicated indices accumulate once per
        occurrence; rows no valid slot names get exact zeros) and, with a sink, ``d_sink [H]``
        float32 ``= -sum_t P_sink (dpsum - dlse)`` (else None).
    """
    T, H, d_qk = q.shape
    S = kv.shape[0]
    dq = torch.zeros_like(q, memory_format=torch.contiguous_format)
    dkv_acc = torch.zeros((S, d_qk), dtype=torch.float32, device=kv.device)
    d_sink = None if attn_sink is None else torch.zeros(H, dtype=torch.float32, device=q.device)
    if S == 0 or T == 0 or indices.shape[1] == 0:
        if d_sink is not None and dlse is not None:  # lse = sink on every row
            d_sink += dlse.float().sum(0)
        return dq, dkv_acc.to(kv.dtype), d_sink
    for t0, t1 in _chunks(T, indices.shape[1], d_qk, H):
        idx = indices[t0:t1]
        valid = valid_slots(idx, _chunk(topk_length, t0, t1), S, _chunk(q_positions, t0, t1))
        rows = _gather(kv, idx, valid)
        s = _scores(q[t0:t1], rows, valid, sm_scale)
        p, _, p_sink = _softmax(s, attn_sink)  # p exactly 0 on empty slots
        do = dout[t0:t1].float()
        dp = torch.bmm(do, rows[..., :d_v].transpose(1, 2))
        dpsum_c = (p * dp).sum(-1) if dpsum is None else dpsum[t0:t1]
        if dlse is not None:
            dpsum_c = dpsum_c - dlse[t0:t1].float()
        ds = p * (dp - dpsum_c[..., None]) * sm_scale
        if dominant_from_row:
            ds = _dominant_from_row(ds, p, dp, p_sink, _chunk(dlse, t0, t1), sm_scale)
        dq[t0:t1] = torch.bmm(ds, rows).to(q.dtype)
        drows = torch.bmm(ds.transpose(1, 2), q[t0:t1].float())  # [c, topk, d_qk]
        drows[..., :d_v] += torch.bmm(p.transpose(1, 2), do)
        dkv_acc.index_add_(0, idx[valid].long(), drows[valid])
        if d_sink is not None:
            d_sink -= (p_sink * dpsum_c).sum(0)
    return dq, dkv_acc.to(kv.dtype), d_sink


def _dominant_from_row(ds, p, dp, p_sink, dlse, sm_scale):
    """``ds [c, H, topk]`` with the dS of each row's dominant key (its largest P, where above
    1/2) recomputed from the row's other keys: ``dS_j = P_j (dP_j (1 - P_j) - sum_{k != j} P_k
    dP_k + dlse) sm_scale`` with ``1 - P_j`` summed from the small probabilities (the other keys'
    and the sink's). The dpsum form ``P_j (dP_j - dpsum)`` subtracts two numbers that agree to
    ``1 - P_j``: once that is below the precision dpsum is carried in (2**-24 in float32, about
    2**-17 from ``out + o_lo`` in bf16), dS_j, and with it the row's dq and dkv[j], is rounding
    noise (the peakedness ladder of :mod:`mla_inductor.numerics`). The other keys keep the
    dpsum form: their dP_k - dpsum does not cancel."""
    j = p.argmax(dim=-1, keepdim=True)
    p_j, dp_j = p.gather(-1, j), dp.gather(-1, j)
    rest = p.scatter(-1, j, 0.0)
    mass = rest.sum(-1, keepdim=True)
    if p_sink is not None:
        mass = mass + p_sink[..., None]
    ds_j = dp_j * mass - (rest * dp).sum(-1, keepdim=True)
    if dlse is not None:
        ds_j = ds_j + dlse.float()[..., None]
    ds_j = p_j * ds_j * sm_scale
    return torch.where(p_j > 0.5, ds.scatter(-1, j, ds_j), ds)


def indexer_target(q, kv, indices, topk_length, q_positions, attn_sink, lse, sm_scale):
    """Reference indexer target; see the backend protocol, :class:`mla_inductor.backends.Backend`.

    Per chunk of tokens: the scores as the forward forms them (fp32, empty slots -inf),
    ``P = exp(s - lse - m_t)`` with the given lse (0 on empty slots, also where lse is -inf) and
    ``m_t`` the token's largest ``s - lse`` over its heads and valid slots (a constant of the
    row, which the normalisation cancels: no term that matters falls into float32's subnormals,
    however large the sink), summed over heads and divided by its sum over the row's valid
    slots. ``attn_sink`` is not read: the
    sink is inside lse, so its mass is already left out of P. Only the chunk's ``[c, H, topk]``
    scores are alive at once, never those of the whole problem.
    """
    del attn_sink  # part of lse
    T, H, d_qk = q.shape
    S = kv.shape[0]
    target = q.new_zeros(indices.shape, dtype=torch.float32)
    if S == 0 or indices.shape[1] == 0:
        return target
    for t0, t1 in _chunks(T, indices.shape[1], d_qk, H):
        valid = valid_slots(indices[t0:t1], _chunk(topk_length, t0, t1), S,
                            _chunk(q_positions, t0, t1))
        s = _scores(q[t0:t1], _gather(kv, indices[t0:t1], valid), valid, sm_scale)
        x = torch.where(valid[:, None, :], s - lse[t0:t1, :, None], -math.inf)  # [c, H, topk]
        # The target is normalised per token: exp(x - m) with m the token's largest x (over its
        # heads and valid slots) keeps the largest term 1, where exp(x) itself falls into
        # float32's subnormals once a sink takes nearly all the mass (x ~ -100 for a sink of
        # 100). A NaN x makes m NaN (the row's valid slots NaN); m -inf (no valid slot, or every
        # lse +inf) is taken against 0.
        m = x.amax(dim=(1, 2), keepdim=True)
        m = torch.where(m == -math.inf, 0.0, m)
        w = torch.where(valid, torch.exp(x - m).sum(1), 0.0)  # [c, topk]
        total = w.sum(-1, keepdim=True)
        target[t0:t1] = torch.where(valid & (total != 0), w / total, 0.0)
    return target
