"""Host side of the SM90 sparse-MLA forward (the kernel is :mod:`.fwd`): its preconditions
(asserted: the op checks the arguments and the backend's selection the kernel's limits),
output allocation, the static compile key, the kernel cache and the launch on torch's current
stream. It imports the CuTe DSL only to compile a kernel that the cache (memory, then disk)
does not have, so a process whose disk cache is warm never imports it (see
:mod:`mla_inductor.kernels.cache`).
"""

from __future__ import annotations

import functools
import itertools

import torch

from ...thresholds import EXACT_THRESHOLD, LAZY_THRESHOLD
from ..cache import KernelCache
from .host import (FWD_TILE_H, LOG2E, SUPPORTED_DIMS, compile_for_arch, contiguous_aligned,
                   int32_contiguous)

_CACHE = KernelCache("mla_sm90_fwd")


def compile_key(dtype: torch.dtype, d_qk: int, d_v: int, rescale_threshold: float,
                has_o_lo: bool, has_topk_length: bool, arch: str = "sm_90a", *,
                has_positions: bool = False, has_sink: bool = False,
                has_max_logits: bool = False) -> tuple:
    """The static compile key: everything else (T, H, S, topk) is symbolic. The arch is last."""
    return (str(dtype).removeprefix("torch."), int(d_qk), int(d_v), float(rescale_threshold),
            bool(has_o_lo), bool(has_topk_length), bool(has_positions), bool(has_sink),
            bool(has_max_logits), arch)


def get_kernel(key: tuple):
    """Compiled kernel for ``key`` (see :func:`compile_key`), from the cache or compiled now
    for the key's arch (no GPU needed; only compiling imports the CuTe DSL:
    :func:`.host.compile_for_arch`)."""
    return _CACHE.get(key, lambda: compile_for_arch("fwd", "compile_forward", key))


def precompile_forward(arch: str = "sm_90a", *, dtypes=(torch.bfloat16,), d_qk: int = 576,
                       d_v: int = 512, thresholds=(EXACT_THRESHOLD, LAZY_THRESHOLD),
                       o_lo=(False, True), topk_length=(False, True)) -> dict:
    """Compiles the forward kernel for ``arch`` without a GPU, for every combination of
    ``dtypes`` x ``thresholds`` x ``o_lo`` x ``topk_length``; returns ``{compile_key: fn}``
    (also cached).

    Raises:
        ValueError: for an arch other than ``sm_90a``.
    """
    if arch != "sm_90a":
        raise ValueError(f"sm90 forward: cannot compile for {arch!r}; use 'sm_90a'")
    compiled = {}
    for dtype, threshold, with_o_lo, with_len in itertools.product(dtypes, thresholds, o_lo,
                                                                   topk_length):
        key = compile_key(dtype, d_qk, d_v, threshold, with_o_lo, with_len, arch)
        compiled[key] = get_kernel(key)
    return compiled


def forward(q, kv, indices, topk_length, q_positions, attn_sink, sm_scale, d_v, rescale_threshold,
            return_o_lo, return_max_logits=False):
    """Sparse-MLA forward on SM90, in the backend protocol's argument order.

    Args:
        q: ``[T, H, d_qk]`` bf16/fp16 CUDA tensor, 1 <= H (any; padded to 64 inside).
        kv: ``[S, d_qk]`` (or ``[S, 1, d_qk]``), q's dtype.
        indices: ``[T, topk]`` int32; values < 0 or >= S are empty slots (never read).
        topk_length: ``[T]`` int32 or None; slots at positions >= topk_length[t] are empty.
        q_positions: ``[T]`` int32 or None; when given (causal masking), a slot whose index is
            greater than ``q_positions[t]`` is empty.
        attn_sink: ``[H]`` float32 or None: one logit per head (natural-log units, like
            ``sm_scale * q.k``) that joins the softmax denominator and has no value.
        sm_scale: softmax scale (float). d_v: 512. rescale_threshold: 0.0 (exact running max)
            or a lazy threshold in log2 units, below q's dtype's bound in
            :data:`mla_inductor.thresholds.MAX_RESCALE_THRESHOLD`.
        return_o_lo: also return ``o_lo = float32(O) - out`` rounded to q's dtype.
        return_max_logits: also return the true maximum of ``sm_scale * q.k`` over each row's
            valid slots (the sink not included; -inf for a row without one).

    Returns:
        ``(out [T, H, d_v] q.dtype, lse [T, H] fp32 natural log, o_lo [T, H, d_v] q.dtype or
        empty, max_logits [T, H] fp32 or empty)``. A row without a valid slot has out 0 and lse
        equal to its head's sink (-inf without a sink).

    Raises:
        CompileDuringCaptureError: first use of a configuration inside CUDA-graph capture.
    """
    if kv.dim() == 3:
        kv = kv.squeeze(1)
    assert q.dim() == 3 and kv.dim() == 2 and indices.dim() == 2
    assert q.dtype in (torch.bfloat16, torch.float16) and kv.dtype == q.dtype
    T, H, d_qk = q.shape
    assert (d_qk, d_v) in SUPPORTED_DIMS
    assert q.is_cuda
    assert kv.shape[1] == d_qk and indices.shape[0] == T
    out = torch.empty(T, H, d_v, dtype=q.dtype, device=q.device)
    lse = torch.empty(T, H, dtype=torch.float32, device=q.device)
    o_lo = torch.empty(T, H, d_v, dtype=q.dtype, device=q.device) if return_o_lo else q.new_empty(0)
    max_logits = (torch.empty(T, H, dtype=torch.float32, device=q.device) if return_max_logits
                  else q.new_empty(0, dtype=torch.float32))
    if T == 0 or H == 0:
        return out, lse, o_lo, max_logits
    if indices.shape[1] == 0:
        out.zero_()
        lse.copy_(attn_sink.float().expand(T, H) if attn_sink is not None
                  else torch.full_like(lse, float("-inf")))
        o_lo.zero_()
        max_logits.fill_(float("-inf"))
        return out, lse, o_lo, max_logits
    q, kv = contiguous_aligned(q), contiguous_aligned(kv)
    indices = int32_contiguous(indices)
    topk_length, q_positions = int32_contiguous(topk_length), int32_contiguous(q_positions)
    if attn_sink is not None:
        attn_sink = attn_sink.to(torch.float32).contiguous()
    key = compile_key(q.dtype, d_qk, d_v, rescale_threshold, return_o_lo, topk_length is not None,
                      has_positions=q_positions is not None, has_sink=attn_sink is not None,
                      has_max_logits=return_max_logits)
    kernel = get_kernel(key)
    n_tiles = T * ((H + FWD_TILE_H - 1) // FWD_TILE_H)
    kernel(q, kv, indices, topk_length, out, lse, o_lo if return_o_lo else None, q_positions,
           attn_sink, max_logits if return_max_logits else None, float(sm_scale) * LOG2E,
           min(n_tiles, _sm_count(q.device)))
    return out, lse, o_lo, max_logits


@functools.cache
def _sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of ``device``: the persistent grid (one CTA per SM)."""
    return torch.cuda.get_device_properties(device).multi_processor_count
