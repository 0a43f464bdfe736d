"""The SM90 lightning indexer: the score kernel (:mod:`.lightning_every_key_host`; bf16, fp16, or
float8_e4m3fn with q_scale and k_scale) and the top-k select (:mod:`.topk_host`, the same for
every dtype: it reads the fp32 scores) composed over chunks of rows with one bounded score
buffer.

For the flattened rows ``r = b T + t`` taken in chunks, each chunk's fp32 scores are written to
a buffer ``[rows, ld]`` (``ld`` = S rounded up to a multiple of 4) and the select reads them back
into the chunk's slice of the outputs; no ``[T, S]`` tensor exists. A chunk is either several
whole batch elements or a range of tokens of one batch element (its rows are contiguous either
way), as many rows as :data:`BUFFER_BYTES` holds.

Why 1 GiB: the buffer's traffic (the scores written once, read by the select) is the same per
row whatever the chunk, so the budget only has to keep the chunks long enough that the score
kernel fills the GPU and its tail (the last wave of CTAs) stays small: at S = 131072 a chunk is
2048 rows, 512 CTAs at 64 heads (about 4 waves of 132 SMs), and at S <= 16384 a chunk holds
16384 rows and more. A smaller budget (to stay in the 50 MB L2) would leave a chunk a few dozen
CTAs and the GPU mostly idle. The buffer's size depends on the shapes only, so the call is
CUDA-graph safe; nothing on the host waits for the GPU.
"""

from __future__ import annotations

import torch

from .host import LIGHTNING_D as D
from .host import contiguous_aligned
from .lightning_every_key_host import scores as score_chunk
from .lightning_every_key_host import tokens_per_tile

BUFFER_BYTES = 1 << 30


def row_lengths(q_positions: torch.Tensor | None, B: int, T: int, S: int,
                device: torch.device) -> torch.Tensor:
    """``[B T]`` int32: the keys each flattened row sees, S when not causal, else
    ``clamp(q_positions + 1, 0, S)`` (on the device, no host sync)."""
    if q_positions is None:
        return torch.full((B * T,), S, dtype=torch.int32, device=device)
    return (q_positions.reshape(B * T).to(torch.int64) + 1).clamp_(0, S).to(torch.int32)


def chunks(B: int, T: int, rows_cap: int):
    """The chunks ``(b0, t0, n_tok, n_batch)`` covering the ``B T`` rows in order, each of at
    most ``rows_cap`` rows: ``n_batch`` whole batch elements when ``rows_cap >= T``, else token
    ranges of one batch element."""
    if rows_cap >= T:
        per = rows_cap // T
        for b0 in range(0, B, per):
            yield b0, 0, T, min(per, B - b0)
    else:
        for b0 in range(B):
            for t0 in range(0, T, rows_cap):
                yield b0, t0, min(rows_cap, T - t0), 1


def lightning_indexer(q, k, weights, q_positions, topk, *, q_scale=None, k_scale=None,
                      buffer_bytes: int = BUFFER_BYTES):
    """The lightning indexer's top-k on SM90 (backend protocol; the definition and selection
    rules are :func:`mla_inductor.lightning_indexer`'s).

    Args:
        q: ``[B, T, H, D]`` bf16/fp16/float8_e4m3fn CUDA tensor, D = 128, 1 <= H <= 64.
        k: ``[B, S, D]``, q's dtype.
        weights: ``[B, T, H]`` float32.
        q_positions: ``[B, T]`` int32 (causal: key s visible to row (b, t) iff
            ``s <= q_positions[b, t]``) or None (not causal).
        topk: int >= 0.
        q_scale: with float8_e4m3fn q and k only (the op resolves None to ones): ``[B, T, H]``
            float32.
        k_scale: with float8_e4m3fn q and k only: ``[B, S]`` float32.
        buffer_bytes: the score buffer's budget (at least one tile of rows is always used).

    Returns:
        ``(indices [B, T, topk] int32, scores [B, T, topk] float32)``, contiguous: the selected
        keys in ascending index, then -1 (score 0).

    Raises:
        ValueError: a score buffer past the kernel's 32-bit offsets
            (:func:`.lightning_every_key_host.scores`).
        CompileDuringCaptureError: first use of a configuration inside CUDA-graph capture.
    """
    from . import topk_host

    # the op checked ranks, dtypes, shapes, the scales and topk; the backend's supports() D,
    # the head count and the device
    fp8 = q.dtype == torch.float8_e4m3fn
    assert q.dim() == 4 and k.dim() == 3 and weights.dim() == 3 and k.dtype == q.dtype
    assert fp8 == (q_scale is not None) == (k_scale is not None)
    B, T, H, d = q.shape
    S = k.shape[1]
    assert d == D and q.is_cuda and topk >= 0
    topk = int(topk)
    tokens = tokens_per_tile(H)  # also checks H
    indices = torch.empty((B, T, topk), dtype=torch.int32, device=q.device)
    out_scores = torch.empty((B, T, topk), dtype=torch.float32, device=q.device)
    if B * T == 0 or topk == 0:
        return indices, out_scores
    if S == 0:
        return indices.fill_(-1), out_scores.zero_()
    q, k = contiguous_aligned(q), contiguous_aligned(k)
    weights = weights.to(torch.float32).contiguous()
    if fp8:
        q_scale, k_scale = q_scale.contiguous(), k_scale.contiguous()
    row_len = row_lengths(q_positions, B, T, S, q.device)
    ld = -(-S // 4) * 4
    rows_cap = max(tokens, buffer_bytes // (ld * 4) // tokens * tokens)
    rows_cap = min(rows_cap, B * T)
    buf = torch.empty((rows_cap, ld), dtype=torch.float32, device=q.device)
    flat_idx = indices.view(B * T, topk)
    flat_scores = out_scores.view(B * T, topk)
    causal_len = row_len if q_positions is not None else None
    for b0, t0, n_tok, n_batch in chunks(B, T, rows_cap):
        r0, rows = b0 * T + t0, n_tok * n_batch
        score_chunk(q, k, weights, causal_len, buf, b0, t0, n_tok, n_batch, q_scale, k_scale)
        topk_host.select(buf[:rows], row_len[r0:r0 + rows], topk, flat_idx[r0:r0 + rows],
                         flat_scores[r0:r0 + rows])
    return indices, out_scores
