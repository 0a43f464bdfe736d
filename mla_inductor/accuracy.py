"""How accurate a sparse-MLA kernel is: float64 references of the attention forward and backward,
and error metrics against them (the package's numerics tool, :mod:`mla_inductor.numerics`, and
the tests share them).

References: :func:`reference_forward` / :func:`reference_backward` compute attention in float64
from the *same* low-precision inputs a kernel gets, so every difference measured against them is
the kernel's own arithmetic.

Metrics (all returned in float64 / Python floats):

- :func:`rel_l2` ``||x - ref|| / ||ref||``.
- :func:`row_gain` per (token, head) row ``<out - ref, ref> / <ref, ref>``: the component of the
  error along the row itself, i.e. how far the effective attention weights are from summing to 1.
  :func:`gain_stats` summarises it by rms, p99 and max of ``|gain|``.
- :func:`output_floor`: what rounding the fp64 output to bf16 alone costs (rel-L2 and row-gain
  rms of ``bf16(ref)`` vs ``ref``), the best any bf16-output kernel can do.
- :func:`noise_floor` of the row gain of a difference ``a - b``: ``elem_rms * sqrt(3 / d_v)``,
  the row gain that independent per-element relative errors of rms ``elem_rms`` produce on rows
  of Gaussian-like entries (the row gain averages ``d_v`` terms weighted by ``ref**2``, whose
  fourth moment is 3x the squared second). ``elem_rms`` is the rms over rows of each row's
  relative rms difference ``||a - b|| / ||ref||``.
- :func:`compare_orders`: the coherent component of the difference between two outputs (the rms of
  ``row_gain(a) - row_gain(b)``) and its ratio to the noise floor; ~1 means no coherent error.
- :func:`self_weight`: the softmax weight of each token's own key.
"""

from __future__ import annotations

import math
from typing import NamedTuple, Optional

import torch

_CHUNK_ELEMENTS = 1 << 23  # float64 elements alive per token chunk in the references


# ----------------------------------------------------------------------------- fp64 references


def token_chunks(T: int, per_token: int):
    """``(t0, t1)`` ranges covering ``[0, T)`` in order, each of at most
    ``_CHUNK_ELEMENTS // per_token`` tokens (at least one): the float64 temporaries of a chunk
    stay below :data:`_CHUNK_ELEMENTS` elements."""
    step = max(1, _CHUNK_ELEMENTS // max(per_token, 1))
    for t0 in range(0, T, step):
        yield t0, min(T, t0 + step)


def _gather64(kv, indices, topk_length):
    """fp64 rows ``[c, topk, d_qk]`` (zeros on empty slots: row 0's values never reach a result)
    and the validity mask ``[c, topk]``."""
    S = kv.shape[0]
    valid = (indices >= 0) & (indices < S)
    if topk_length is not None:
        valid &= torch.arange(indices.shape[1], device=indices.device) < topk_length[:, None]
    safe = torch.where(valid, indices, torch.zeros_like(indices)).long()
    rows = kv.index_select(0, safe.reshape(-1)).reshape(*indices.shape, kv.shape[1])
    return torch.where(valid[..., None], rows.double(), 0.0), valid


def _probs64(q_c, rows, valid, sm_scale, attn_sink=None):
    """fp64 softmax ``[c, H, topk]`` (zero on empty slots and on rows without a valid slot) and
    the natural-log lse ``[c, H]`` (-inf on rows without a valid slot and no sink). With
    ``attn_sink [H]`` the sink's logit joins the denominator (lse includes it) and has no value."""
    s = torch.bmm(q_c.double(), rows.transpose(1, 2)) * sm_scale
    s = s.masked_fill(~valid[:, None, :], -math.inf)
    lse = torch.logsumexp(s, dim=-1)
    if attn_sink is not None:
        lse = torch.logaddexp(lse, attn_sink.double()[None, :])
    p = torch.exp(s - torch.where(torch.isinf(lse), 0.0, lse)[..., None])
    return p, lse


def reference_forward(
    q: torch.Tensor,
    kv: torch.Tensor,
    indices: torch.Tensor,
    topk_length: Optional[torch.Tensor] = None,
    *,
    sm_scale: float,
    d_v: int,
    attn_sink: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sparse-MLA forward in float64 from the given (low-precision) inputs.

    Args:
        q: ``[T, H, d_qk]``; kv: ``[S, d_qk]`` (key = ``kv[:, :d_qk]``, value = ``kv[:, :d_v]``);
        indices: ``[T, topk]`` integer, any value < 0 or >= S is an empty slot;
        topk_length: optional ``[T]``, slots at positions >= ``topk_length[t]`` are empty.
        sm_scale: softmax scale (natural-log domain); d_v: value width.
        attn_sink: optional ``[H]`` logits (natural log) that join each row's softmax
            denominator without a value (as ``sparse_mla``'s ``attn_sink``).

    Returns:
        ``out [T, H, d_v]`` float64 (0 on rows without a valid slot) and ``lse [T, H]`` float64,
        natural log, the sink included (-inf on rows without a valid slot and no sink).
    """
    T, H, d_qk = q.shape
    out = torch.zeros((T, H, d_v), dtype=torch.float64, device=q.device)
    lse = torch.full((T, H), -math.inf, dtype=torch.float64, device=q.device)
    if kv.shape[0] == 0:
        return out, lse
    topk = indices.shape[1]
    for t0, t1 in token_chunks(T, topk * (d_qk + 2 * H)):
        tl = None if topk_length is None else topk_length[t0:t1]
        rows, valid = _gather64(kv, indices[t0:t1], tl)
        p, lse[t0:t1] = _probs64(q[t0:t1], rows, valid, sm_scale, attn_sink)
        out[t0:t1] = torch.bmm(p, rows[..., :d_v])
    return out, lse


def reference_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    kv: torch.Tensor,
    indices: torch.Tensor,
    topk_length: Optional[torch.Tensor] = None,
    *,
    sm_scale: float,
    d_v: int,
    attn_sink: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gradients of :func:`reference_forward` in float64 for the upstream gradient ``dout``.

    Args: as :func:`reference_forward`, plus ``dout [T, H, d_v]``.

    Returns:
        ``dq [T, H, d_qk]`` and ``dkv [S, d_qk]``, float64 (duplicate indices accumulate once per
        occurrence; empty slots contribute nothing). The softmax and ``dpsum = rowsum(dout * out)``
        are recomputed in float64, ``dP - dpsum`` taken relative to each row's top key (so that
        it does not cancel on rows whose top probability is within 2**-53 of 1), so this is the
        exact gradient of the given inputs at any peakedness. A sink
        (no value) enters only through the softmax's normalisation; its own gradient is not
        returned.
    """
    T, H, d_qk = q.shape
    S = kv.shape[0]
    dq = torch.zeros(q.shape, dtype=torch.float64, device=q.device)
    dkv = torch.zeros((S, d_qk), dtype=torch.float64, device=q.device)
    if S == 0:
        return dq, dkv
    topk = indices.shape[1]
    for t0, t1 in token_chunks(T, topk * (2 * d_qk + 3 * H)):
        tl = None if topk_length is None else topk_length[t0:t1]
        rows, valid = _gather64(kv, indices[t0:t1], tl)
        p, lse_c = _probs64(q[t0:t1], rows, valid, sm_scale, attn_sink)
        do = dout[t0:t1].double()
        dp = torch.bmm(do, rows[..., :d_v].transpose(1, 2))
        # dP - dpsum relative to each row's top key j: (dP - dP_j) - sum_k P_k (dP_k - dP_j)
        # (+ dP_j P_sink), which does not cancel when P_j is within 2**-53 of 1.
        dp_j = dp.gather(-1, p.argmax(dim=-1, keepdim=True))
        centred = torch.where(p > 0, dp - dp_j, 0.0)
        shifted = centred - (p * centred).sum(-1, keepdim=True)
        if attn_sink is not None:
            p_sink = torch.exp(attn_sink.double()[None, :] - lse_c)
            p_sink = torch.where(torch.isneginf(lse_c), 0.0, p_sink)  # no slot and no sink
            shifted = shifted + dp_j * p_sink[..., None]
        ds = p * shifted * sm_scale
        dq[t0:t1] = torch.bmm(ds, rows)
        drows = torch.bmm(ds.transpose(1, 2), q[t0:t1].double())
        drows[..., :d_v] += torch.bmm(p.transpose(1, 2), do)
        idx = indices[t0:t1]
        dkv.index_add_(0, idx[valid].long(), drows[valid])
    return dq, dkv


# ----------------------------------------------------------------------------- metrics


class GainStats(NamedTuple):
    """Summary of per-row gains: rms, 99th percentile and maximum of ``|gain|``."""

    rms: float
    p99: float
    max: float


class Floor(NamedTuple):
    """Error of rounding the fp64 output to a low-precision dtype: rel-L2 and row-gain rms."""

    rel_l2: float
    row_gain_rms: float


class OrderDiff(NamedTuple):
    """Difference between two outputs of the same attention: ``rel_l2`` of ``a - b`` against the
    reference, rms of its coherent component (row gain), the noise floor, and their ratio."""

    rel_l2: float
    coherent_rms: float
    floor: float
    ratio: float


def rel_l2(x: torch.Tensor, ref: torch.Tensor) -> float:
    """``||x - ref|| / ||ref||`` over all elements, computed in float64 (any shapes that
    broadcast): 0.0 when ``x`` equals an all-zero ``ref``, inf when ``ref`` alone is all zero,
    NaN when a NaN reaches the norms."""
    ref = ref.double()
    num = torch.linalg.vector_norm(x.double() - ref)
    den = torch.linalg.vector_norm(ref)
    if den == 0:
        return 0.0 if num == 0 else math.inf
    return (num / den).item()


def _rows_with_output(ref: torch.Tensor) -> torch.Tensor:
    return (ref.double() * ref.double()).sum(-1) > 0


def _project(diff: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """``<diff, ref> / <ref, ref>`` per row (float64; 0 where ``ref`` is all zero)."""
    ref = ref.double()
    num = (diff * ref).sum(-1)
    den = (ref * ref).sum(-1)
    return torch.where(den > 0, num / torch.where(den > 0, den, 1.0), 0.0)


def row_gain(out: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """Per-row gain ``<out - ref, ref> / <ref, ref>`` over the last dimension, float64, shape
    ``ref.shape[:-1]``. Rows whose reference is all zero (no valid slot) have gain 0."""
    return _project(out.double() - ref.double(), ref)


def gain_stats(gain: torch.Tensor) -> GainStats:
    """rms, p99 and max of ``|gain|`` over all the rows given (:func:`row_gain` puts 0 on rows
    without output; drop them first where they are many)."""
    a = gain.double().abs().flatten()
    return GainStats(
        a.square().mean().sqrt().item(), torch.quantile(a, 0.99).item(), a.max().item()
    )


def _row_gain_rms(out: torch.Tensor, ref: torch.Tensor) -> float:
    return row_gain(out, ref)[_rows_with_output(ref)].square().mean().sqrt().item()


def output_floor(ref: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> Floor:
    """The floor of a ``dtype``-output kernel: rel-L2 and row-gain rms of ``ref.to(dtype)`` vs
    ``ref`` (rows without output excluded from the rms)."""
    rounded = ref.to(dtype)
    return Floor(rel_l2(rounded, ref), _row_gain_rms(rounded, ref))


def noise_floor(a: torch.Tensor, b: torch.Tensor, ref: torch.Tensor) -> float:
    """Row-gain rms that independent per-element errors of the size of ``a - b`` would give:
    ``elem_rms * sqrt(3 / d_v)`` with ``elem_rms`` the rms over rows (with output) of
    ``||a_row - b_row|| / ||ref_row||`` and ``d_v = ref.shape[-1]``."""
    keep = _rows_with_output(ref)
    ref = ref.double()[keep]
    diff = (a.double() - b.double())[keep]
    per_row = diff.square().sum(-1) / ref.square().sum(-1)
    return math.sqrt(per_row.mean().item() * 3.0 / ref.shape[-1])


def coherent_component(a: torch.Tensor, b: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """Per-row coherent component of ``a - b``: ``<a - b, ref> / <ref, ref>`` (float64,
    ``ref.shape[:-1]``; 0 on rows without output), i.e. ``row_gain(a, ref) - row_gain(b, ref)``."""
    return _project(a.double() - b.double(), ref)


def compare_orders(a: torch.Tensor, b: torch.Tensor, ref: torch.Tensor) -> OrderDiff:
    """The difference between two outputs of the same attention (e.g. two index orders); the
    ratio is 0 when ``a`` and ``b`` agree on every row with output."""
    keep = _rows_with_output(ref)
    coherent = coherent_component(a, b, ref)[keep].square().mean().sqrt().item()
    floor = noise_floor(a, b, ref)
    norm = torch.linalg.vector_norm
    diff = (norm(a.double() - b.double()) / norm(ref.double())).item()
    return OrderDiff(diff, coherent, floor, coherent / floor if floor > 0 else 0.0)


def self_weight(
    q: torch.Tensor, kv: torch.Tensor, lse: torch.Tensor, sm_scale: float
) -> torch.Tensor:
    """Softmax weight of each token's own key (``kv[t]`` for token ``t``), ``[T, H]`` float64,
    from the fp64 ``lse`` of :func:`reference_forward` (causal inputs, ``S >= T``)."""
    s = (q.double() * kv[: q.shape[0], None, :].double()).sum(-1) * sm_scale
    return torch.exp(s - lse)
