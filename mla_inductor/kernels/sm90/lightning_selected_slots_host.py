"""Host side of the SM90 lightning-indexer scores at the selected slots (the kernels are
:mod:`.lightning_selected_slots`): its preconditions (asserted: the op checks the arguments and
the backend's selection the kernels' limits), the static compile keys, the kernel cache, the
launches on torch's current stream, the dk accumulator (float32 with interleaved columns, or
int64 fixed point under deterministic algorithms) and its conversion to k's dtype. No host
synchronisation anywhere, so every call can be captured in a CUDA graph once its kernel is
compiled. It imports the CuTe DSL only to compile a kernel that the cache (memory, then disk)
does not have (see :mod:`mla_inductor.kernels.cache`).
"""

from __future__ import annotations

import torch

from ..cache import KernelCache
from .host import LIGHTNING_D as D
from .host import LIGHTNING_MAX_HEADS as MAX_HEADS
from .bwd_host import dkv_from_accum
from .host import compile_for_arch, contiguous_aligned, fixed_point_scale_for

_CACHE = KernelCache("mla_sm90_lightning_indexer_scores")
INT32_MAX = 2**31 - 1


def forward_key(dtype: torch.dtype, arch: str = "sm_90a") -> tuple:
    """The forward's static compile key (B, T, H, S and topk are symbolic); the arch is last."""
    return ("forward", str(dtype).removeprefix("torch."), arch)


def backward_key(dtype: torch.dtype, deterministic: bool, arch: str = "sm_90a") -> tuple:
    """The backward's static compile key: the dtype and whether dk is accumulated in 64-bit
    fixed point; the arch is last."""
    return ("backward", str(dtype).removeprefix("torch."), bool(deterministic), arch)


def get_kernel(key: tuple):
    """Compiled kernel for ``key`` (:func:`forward_key` or :func:`backward_key`), from the cache
    or compiled now for the key's arch (no GPU needed: :func:`.host.compile_for_arch`).

    Raises:
        CompileDuringCaptureError: on a cache miss during CUDA-graph capture.
    """
    fn_name = "compile_forward" if key[0] == "forward" else "compile_backward"
    return _CACHE.get(key, lambda: compile_for_arch("lightning_selected_slots", fn_name, key[1:]))


def precompile_scores(arch: str = "sm_90a", *, dtypes=(torch.bfloat16,),
                      deterministic=(False, True)) -> dict:
    """Compiles the forward for every dtype of ``dtypes`` and the backward for every
    combination of ``dtypes`` x ``deterministic``, for ``arch`` without a GPU; returns
    ``{compile_key: fn}`` (also cached).

    Raises:
        ValueError: for an arch other than ``sm_90a``.
    """
    if arch != "sm_90a":
        raise ValueError(f"lightning_indexer_scores: sm90 kernels cannot compile for {arch!r}; "
                         f"use 'sm_90a'")
    compiled = {}
    for dtype in dtypes:
        keys = [forward_key(dtype, arch)] + [backward_key(dtype, det, arch)
                                             for det in deterministic]
        for key in keys:
            compiled[key] = get_kernel(key)
    return compiled


def _assert_limits(q: torch.Tensor) -> None:
    """Asserts the kernels' own limits on ``q [B, T, H, D]``, which the backend's selection
    ensured (:func:`mla_inductor.kernels.sm90.supports`; the op checked the inputs,
    :func:`mla_inductor.ops.lightning_indexer_scores.check_inputs`): a CUDA tensor, bf16/fp16,
    D = 128, 1 to 64 index heads, at most 2**31 - 1 rows ``B T`` (one CTA each; 2**31 rows of q
    alone would take 512 GiB)."""
    B, T, H, d = q.shape
    assert q.is_cuda and q.dtype in (torch.bfloat16, torch.float16)
    assert d == D and 1 <= H <= MAX_HEADS
    assert B * T <= INT32_MAX


def _flat(q, k, weights, indices):
    """Row-flattened, contiguous, 16-byte aligned views: ``q [R, H, D]``, ``k [B S, D]``,
    ``weights [R, H]``, ``indices [R, topk]`` (R = B T)."""
    B, T, H, _ = q.shape
    S, topk = k.shape[1], indices.shape[-1]
    return (contiguous_aligned(q).view(B * T, H, D), contiguous_aligned(k).view(B * S, D),
            weights.contiguous().view(B * T, H), indices.contiguous().view(B * T, topk))


def forward(q: torch.Tensor, k: torch.Tensor, weights: torch.Tensor,
            indices: torch.Tensor) -> torch.Tensor:
    """``scores [B, T, topk]`` float32, contiguous (the module docstring of
    :mod:`.lightning_selected_slots`; exactly 0 on empty slots).

    Args:
        q: ``[B, T, H, D]`` bf16/fp16 CUDA tensor, D = 128, 1 <= H <= 64.
        k: ``[B, S, D]`` in q's dtype.
        weights: ``[B, T, H]`` float32.
        indices: ``[B, T, topk]`` int32, local to each batch element (< 0 or >= S: empty).

    Raises:
        CompileDuringCaptureError: first use of the dtype inside CUDA-graph capture.
    """
    _assert_limits(q)
    B, T, _, _ = q.shape
    S, topk = k.shape[1], indices.shape[-1]
    if B * T == 0 or topk == 0 or S == 0:
        return torch.zeros(B, T, topk, dtype=torch.float32, device=q.device)
    scores = torch.empty(B * T, topk, dtype=torch.float32, device=q.device)
    q2, k2, w2, i2 = _flat(q, k, weights, indices)
    get_kernel(forward_key(q.dtype))(q2, k2, w2, i2, scores, T, S)
    return scores.view(B, T, topk)


def backward(dscores: torch.Tensor, q: torch.Tensor, k: torch.Tensor, weights: torch.Tensor,
             indices: torch.Tensor, deterministic: bool = False):
    """``(dq [B, T, H, D] in q's dtype, dk [B, S, D] in k's dtype, dweights [B, T, H] float32)``,
    contiguous, for ``dscores [B, T, topk]`` float32 and the forward's inputs (as
    :func:`forward`'s). dk is accumulated in float32 with atomic adds (its last bits may differ
    from run to run) or, with ``deterministic``, in 64-bit fixed point (:func:`fixed_point_scale`;
    bitwise the same in every run; the accumulator takes ``B S D`` x 8 bytes instead of 4). dq
    and dweights are always deterministic (no atomics). Empty slots' ``dscores`` are ignored.

    Raises:
        CompileDuringCaptureError: first use of the configuration inside CUDA-graph capture.
    """
    _assert_limits(q)
    B, T, H, _ = q.shape
    S, topk = k.shape[1], indices.shape[-1]
    if B * T == 0 or topk == 0 or S == 0:
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(weights)
    q2, k2, w2, i2 = _flat(q, k, weights, indices)
    g2 = dscores.contiguous().view(B * T, topk)
    dq = torch.empty(B * T, H, D, dtype=q.dtype, device=q.device)
    dweights = torch.empty(B * T, H, dtype=torch.float32, device=q.device)
    accum = torch.zeros(B * S, D, dtype=torch.int64 if deterministic else torch.float32,
                        device=q.device)
    scale = inverse = None
    if deterministic:
        scale, inverse = fixed_point_scale(g2, q2, w2, i2, S)
    get_kernel(backward_key(q.dtype, deterministic))(g2, q2, k2, w2, i2, dq, accum, dweights,
                                                      scale, T, S)
    if deterministic:
        dk = (accum.to(torch.float64) * inverse).to(k.dtype)
    else:
        dk = dkv_from_accum(accum, k.dtype)
    return dq.view(B, T, H, D), dk.view(B, S, D), dweights.view(B, T, H)


def fixed_point_scale(dscores: torch.Tensor, q: torch.Tensor, weights: torch.Tensor,
                      indices: torch.Tensor, S: int):
    """The deterministic backward's fixed-point scale, computed on the device (no host
    synchronisation): ``(scale [1] float32, inverse [] float64)``, ``scale = 2**e`` with ``e``
    the largest integer such that ``bound * scale <= 2**(63 - 2)``, for

        bound = R * topk * H * max|weights| * max|dscores over valid slots| * max|q|

    (``R`` rows of ``topk`` slots: at most ``R topk`` slots name one dk row, and each adds, per
    column, ``sum_h dS[h, j] q[h, d]``: H terms of at most ``max|w| max|g| max|q|``; so every dk
    entry and every partial sum of its additions, in any order, is within the bound; the
    kernel's rounding of dS to q's dtype adds at most 2**-8 of it, inside the 2 bits of
    headroom). ``e`` is clamped to [-126, 126], float32's normal range. Each addition is rounded
    to an integer, an error of at most ``2**-(e + 1)``, about ``2**-62 * bound`` per slot: far
    below the float32 rounding of the float32 path. A non-finite bound (inf or NaN in q, the
    weights or a valid slot's dscores) makes ``inverse`` NaN, so that dk is NaN rather than a
    silently wrong number. Raises nothing.

    Args: the row-flattened ``dscores [R, topk]`` float32, ``q [R, H, D]``, ``weights [R, H]``
        float32, ``indices [R, topk]`` int32, and S (the keys per batch element).
    """
    R, H = weights.shape
    topk = indices.shape[1]
    valid = (indices >= 0) & (indices < S)
    m_g = torch.where(valid, dscores.abs(), 0.0).amax().to(torch.float64)
    m_w = weights.abs().amax().to(torch.float64)
    m_q = q.abs().amax().to(torch.float64)
    bound = float(R * topk * H) * m_g * m_w * m_q
    return fixed_point_scale_for(bound)
