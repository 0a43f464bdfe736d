"""Emulate backend: the online softmax of a flash-style sparse-MLA kernel, on any device.

This module reproduces the *arithmetic* (not the speed) of the GPU forward kernels, so that their
rounding behaviour can be measured and tested on a CPU (see :mod:`mla_inductor.numerics`):

1. The gathered top-k slots are cut into blocks of ``block_n`` (default 64) keys; ``topk`` is
   padded up to a multiple of ``block_n`` with empty slots. Blocks are processed from the
   **last to the first**, as the kernels walk them (FA4 ``flash_fwd_mla_sm100.py``:
   ``n_block = n_block_max - 1; ... n_block -= 1``), so slot 0 is processed last.
2. Scores ``s = q · k`` are accumulated in fp32 from the low-precision inputs and scaled into the
   exp2 domain: ``s * sm_scale * log2(e)``. Empty slots score ``-inf``.
3. Running row max ``m`` per (token, head) with FA4's lazy-rescale rule (FA4
   ``flash_attn/cute/softmax.py``, ``SoftmaxSm100.update_row_max``): with
   ``m_new = max(m_old, block max)``, the max is moved and O / row_sum are rescaled by
   ``acc_scale = exp2(m_old - m_new)`` only when
   ``m_new - m_old > rescale_threshold`` (log2 units); otherwise the stale ``m_old`` is kept and
   the block's ``p`` can reach ``2**rescale_threshold``. ``rescale_threshold = 0.0`` is the exact
   running max: any growth rescales and the row's largest key gets ``p = 1.0`` exactly.
4. ``p = exp2(s - m)`` in fp32; ``row_sum = row_sum * acc_scale + sum(p)`` from the fp32 ``p``;
   ``p`` is rounded to q's dtype (the P·V MMA operand) and ``O = O * acc_scale + p · V`` is
   accumulated in fp32.
5. ``out = O * (1 / row_sum)`` rounded to q's dtype; ``lse = (m + log2(row_sum)) * ln(2)``
   (natural log); ``o_lo = float32(O / row_sum) - out`` rounded to q's dtype. An attention sink
   joins the denominator at the end, as the SM90 kernel adds it in its epilogue: with
   ``s2 = sink * log2(e)`` and ``m_e = max(m, s2)``, ``row_sum = row_sum * exp2(m - m_e) +
   exp2(s2 - m_e)`` and O is scaled by ``exp2(m - m_e)``. ``max_logits`` is the true maximum of
   the valid scores, tracked apart from the (possibly stale) running max.

Initial running max: ``-inf`` (FlashMLA starts at ``-1e30``, FA4 sets the first block's max
directly). Where the max is still ``-inf`` (no valid slot seen yet) the exponent is taken against
0 instead, as FA4's ``row_max_safe`` does, so ``p = exp2(-inf) = 0`` and no NaN arises; a row with
no valid slot at all ends with ``row_sum = 0``, ``out = 0`` and ``lse = -inf``.

Empty slots (index < 0, index >= S, or position >= ``topk_length[t]``, and the padding up to a
multiple of ``block_n``) are never read: they are redirected to row 0 before the gather (never an
out-of-range read), the gathered row is replaced by zeros (as a kernel's zero-filled copy; no
value of row 0, NaN included, reaches the output) and their score is ``-inf``.

Non-finite scores: a NaN or +inf score (a NaN or inf in q or in a row a valid slot names) makes
the row sum NaN; that row's out and lse are NaN (not the ``-inf`` of an empty row). So does a
NaN sink, on every row of its head. A sink whose ``s2`` is +inf (the sink +inf, or finite above
``2**128 * ln 2``) is the row's max with ``exp2(s2 - m_e) = 1`` (not ``exp2(inf - inf)``): out
0 and lse the sink (+inf for a +inf sink), as the definition gives. Tokens and heads are
vectorised; tokens are processed in chunks to bound memory.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from mla_inductor.kernels import reference
from mla_inductor.kernels.determinism import deterministic_mode

BLOCK_N = 64
_CHUNK_ELEMENTS = 1 << 23  # fp32 elements alive per token chunk (32 MiB)
_LOG2E = math.log2(math.e)
_LN2 = math.log(2.0)


def available() -> tuple[bool, str]:
    """Always ``(True, "")``: plain PyTorch runs on every device."""
    return True, ""


def _valid_padded(
    indices: torch.Tensor,
    topk_length: Optional[torch.Tensor],
    q_positions: Optional[torch.Tensor],
    S: int,
    block_n: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Indices with empty slots redirected to row 0 and the validity mask, both padded with empty
    slots up to a multiple of ``block_n``: ``([T, n_blocks * block_n] int64, same shape bool)``."""
    topk = indices.shape[1]
    valid = reference.valid_slots(indices, topk_length, S, q_positions)
    pad = -topk % block_n
    valid = torch.nn.functional.pad(valid, (0, pad), value=False)
    safe = torch.nn.functional.pad(indices.long(), (0, pad), value=0)
    return torch.where(valid, safe, torch.zeros_like(safe)), valid


def forward(
    q: torch.Tensor,
    kv: torch.Tensor,
    indices: torch.Tensor,
    topk_length: Optional[torch.Tensor],
    q_positions: Optional[torch.Tensor],
    attn_sink: Optional[torch.Tensor],
    sm_scale: float,
    d_v: int,
    rescale_threshold: float,
    return_o_lo: bool,
    return_max_logits: bool,
    *,
    block_n: int = BLOCK_N,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Kernel-faithful sparse-MLA forward; see the module docstring for the arithmetic and
    :class:`mla_inductor.backends.Backend` for the protocol (shapes, dtypes, outputs).

    Args:
        block_n: keys per block of the online softmax (64 for the SM90 kernels; FA4's SM100
            kernel uses 128).

    Raises:
        ValueError: if ``block_n < 1``, or ``rescale_threshold`` is negative, NaN or inf (the op
            checks it before, with the bound for the dtype).
    """
    if block_n < 1:
        raise ValueError(f"block_n must be >= 1, got {block_n}")
    if not 0.0 <= rescale_threshold < math.inf:
        raise ValueError(
            f"rescale_threshold must be finite and >= 0 (log2 units), got {rescale_threshold}"
        )
    T, H, d_qk = q.shape
    S = kv.shape[0]
    out, lse, o_lo, max_logits = reference.outputs_without_slots(q, attn_sink, d_v, return_o_lo,
                                                                 return_max_logits)
    sink2 = None if attn_sink is None else attn_sink.float() * _LOG2E  # [H], log2 units
    if S == 0 or T == 0 or indices.shape[1] == 0:
        return out, lse, o_lo, max_logits
    safe, valid = _valid_padded(indices, topk_length, q_positions, S, block_n)
    n_blocks = safe.shape[1] // block_n
    scale_log2 = sm_scale * _LOG2E
    per_token = H * (d_v + 3 * block_n) + block_n * d_qk
    step = max(1, _CHUNK_ELEMENTS // per_token)
    for t0 in range(0, T, step):
        t1 = min(T, t0 + step)
        q_c = q[t0:t1].float()
        m = q_c.new_full((t1 - t0, H), -math.inf)
        row_sum = q_c.new_zeros((t1 - t0, H))
        acc = q_c.new_zeros((t1 - t0, H, d_v))
        true_max = q_c.new_full((t1 - t0, H), -math.inf)
        for b in reversed(range(n_blocks)):
            cols = slice(b * block_n, (b + 1) * block_n)
            idx_b, valid_b = safe[t0:t1, cols], valid[t0:t1, cols]
            rows = kv.index_select(0, idx_b.reshape(-1)).reshape(t1 - t0, block_n, d_qk)
            rows = torch.where(valid_b[..., None], rows.float(), 0.0)  # empty slots: never read
            s = torch.bmm(q_c, rows.transpose(1, 2)) * scale_log2
            s.masked_fill_(~valid_b[:, None, :], -math.inf)
            block_max = s.amax(dim=-1)
            true_max = torch.maximum(true_max, block_max)
            m_cand = torch.maximum(m, block_max)
            # NaN (both -inf) compares False: the max stays -inf.
            moved = (m_cand - m) > rescale_threshold
            m_new = torch.where(moved, m_cand, m)
            m_safe = torch.where(m_new == -math.inf, 0.0, m_new)
            acc_scale = torch.exp2(m - m_safe)  # 1 when kept; 0 while nothing was accumulated
            p = torch.exp2(s - m_safe[..., None])
            row_sum = row_sum * acc_scale + p.sum(dim=-1)
            p_lp = p.to(q.dtype).float()
            acc = acc * acc_scale[..., None] + torch.bmm(p_lp, rows[..., :d_v])
            m = m_new
        scale = torch.ones_like(row_sum)
        if sink2 is not None:
            m_e = torch.maximum(m, sink2)
            m_e_safe = torch.where(m_e == -math.inf, 0.0, m_e)
            scale = torch.exp2(m - m_e_safe)
            # a +inf s2 (a +inf sink, or a finite one above 2**128 * ln 2) is the max: its
            # exp2(s2 - m_e) = exp2(inf - inf) is 1, not NaN
            row_sum = row_sum * scale + torch.where(sink2 == math.inf, 1.0,
                                                    torch.exp2(sink2 - m_e_safe))
            m = m_e
        # 0 only for a row sum of exactly 0 (no valid slot, no sink): a NaN row sum (a NaN or
        # +inf score, a NaN sink) gives NaN out and lse, never a hidden 0
        inv = torch.where(row_sum == 0, 0.0, scale / row_sum)
        o = acc * inv[..., None]
        out[t0:t1] = o.to(q.dtype)
        row_lse = (m + torch.log2(row_sum)) * _LN2
        if sink2 is not None:  # s2 overflowed: lse from the natural-log sink (row_sum is 1)
            row_lse = torch.where(sink2 == math.inf, attn_sink.float() + torch.log(row_sum),
                                  row_lse)
        lse[t0:t1] = torch.where(row_sum == 0, -math.inf, row_lse)
        if return_o_lo:
            o_lo[t0:t1] = (o - out[t0:t1].float()).to(q.dtype)
        if return_max_logits:
            max_logits[t0:t1] = true_max * _LN2
    return out, lse, o_lo, max_logits


def backward(dout, dlse, q, kv, indices, topk_length, q_positions, attn_sink, out, lse, o_lo,
             sm_scale, d_v, deterministic=False):
    """The kernels' backward arithmetic where it differs from the textbook: ``dpsum`` is formed
    from the forward's output, ``rowsum(dout * (out + o_lo))`` in fp32 (``rowsum(dout * out)``
    when ``o_lo`` is empty), as the SM90 and SM100 kernels form it; the rest is
    :func:`mla_inductor.kernels.reference.gradients` (P recomputed from the scores in fp32,
    ``dpsum - dlse`` for the gradient through lse, the sink's gradient), with the dpsum form on
    every key but each row's dominant key (P above 1/2), whose dS comes from the row's other
    keys, as the SM90 kernel forms it (its ``dP - dpsum`` would cancel on very peaked rows: the
    peakedness ladder of :mod:`mla_inductor.numerics`). ``deterministic`` as the reference's
    (:func:`mla_inductor.kernels.determinism.deterministic_mode`)."""
    o_full = out.float() + o_lo.float() if o_lo.numel() else out.float()
    dpsum = (dout.float() * o_full).sum(-1)  # [T, H]
    with deterministic_mode(deterministic):
        return reference.gradients(dout, q, kv, indices, topk_length, sm_scale, d_v, dpsum,
                                   q_positions=q_positions, attn_sink=attn_sink, dlse=dlse)


def indexer_target(q, kv, indices, topk_length, q_positions, attn_sink, lse, sm_scale):
    """The reference's indexer target (:func:`mla_inductor.kernels.reference.indexer_target`).

    There is no online softmax to emulate here: the target divides ``exp(s - lse)`` by its row
    sum with the forward's lse given, so a kernel's arithmetic is the reference's (fp32 scores
    from the low-precision inputs, one exponential per score, fp32 sums) up to the order of its
    fp32 additions.
    """
    return reference.indexer_target(q, kv, indices, topk_length, q_positions, attn_sink, lse,
                                    sm_scale)
