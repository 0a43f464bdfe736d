"""Host side of the SM90 indexer target (the kernel is :mod:`.indexer_target_kernel`): its
preconditions (asserted: the op checks the arguments and the backend's selection the kernel's
limits), the head tile, output allocation, the static compile key, the kernel cache and the launch
on torch's current stream. It imports the CuTe DSL only to compile a kernel that the cache (memory,
then disk) does not have, so a process whose disk cache is warm never imports it (see
:mod:`mla_inductor.kernels.cache`).
"""

from __future__ import annotations

import math

import torch

from ..cache import KernelCache
from .host import INDEXER_D_QK as D_QK
from .host import INDEXER_TILE_HEADS as TILE_HEADS
from .host import LOG2E, compile_for_arch, contiguous_aligned, int32_contiguous

_CACHE = KernelCache("mla_sm90_indexer_target")


def tile_heads_for(num_heads: int) -> int:
    """The head tile (wgmma N) for ``num_heads``: 64 up to 64 heads, else 128.

    Raises:
        ValueError: outside 1..128 heads (a head count given to :func:`precompile_target`).
    """
    if not 1 <= num_heads <= TILE_HEADS[-1]:
        raise ValueError(f"indexer_target: the sm90 indexer target supports 1 to {TILE_HEADS[-1]} "
                         f"heads, got {num_heads}")
    return next(n for n in TILE_HEADS if num_heads <= n)


def compile_key(dtype: torch.dtype, d_qk: int, tile_heads: int, has_topk_length: bool,
                has_positions: bool, arch: str = "sm_90a") -> tuple:
    """The static compile key: everything else (T, H, S, topk) is symbolic. The arch is last."""
    return (str(dtype).removeprefix("torch."), int(d_qk), int(tile_heads), bool(has_topk_length),
            bool(has_positions), arch)


def get_kernel(key: tuple):
    """Compiled kernel for ``key`` (see :func:`compile_key`), from the cache or compiled now
    for the key's arch (no GPU needed; only compiling imports the CuTe DSL:
    :func:`.host.compile_for_arch`)."""
    return _CACHE.get(key, lambda: compile_for_arch("indexer_target_kernel", "compile_target", key))


def precompile_target(arch: str = "sm_90a", *, dtypes=(torch.bfloat16,), d_qk: int = 576,
                      heads=(128,), topk_length=(False, True), positions=(False, True)) -> dict:
    """Compiles the indexer-target kernels for ``arch`` without a GPU, for every combination of
    ``dtypes`` x ``heads`` (their head tiles) x ``topk_length`` x ``positions``; returns
    ``{compile_key: fn}`` (also cached).

    Raises:
        ValueError: for an arch other than ``sm_90a``, or a head count above 128.
    """
    if arch != "sm_90a":
        raise ValueError(f"sm90 indexer target: cannot compile for {arch!r}; use 'sm_90a'")
    compiled = {}
    for dtype in dtypes:
        for tile in sorted({tile_heads_for(h) for h in heads}):
            for with_len in topk_length:
                for with_pos in positions:
                    key = compile_key(dtype, d_qk, tile, with_len, with_pos, arch)
                    compiled[key] = get_kernel(key)
    return compiled


def indexer_target(q, kv, indices, topk_length, q_positions, attn_sink, lse, sm_scale):
    """The indexer's training target on SM90 (the module docstring of
    :mod:`.indexer_target_kernel`), in the backend protocol's argument order.

    Args:
        q: ``[T, H, d_qk]`` bf16/fp16 CUDA tensor, 1 <= H <= 128, d_qk 576 or 512.
        kv: ``[S, d_qk]``, q's dtype.
        indices: ``[T, topk]`` int32; values < 0 or >= S are empty slots (never read).
        topk_length: ``[T]`` int32 or None; slots at positions >= topk_length[t] are empty.
        q_positions: ``[T]`` int32 or None; a slot whose index is greater than
            ``q_positions[t]`` is empty.
        attn_sink: not read: the sink is inside ``lse``.
        lse: ``[T, H]`` float32, the forward's natural-log lse (the sink included).
        sm_scale: the forward's softmax scale (float).

    Returns:
        ``target [T, topk]`` float32, contiguous.

    Raises:
        CompileDuringCaptureError: first use of a configuration inside CUDA-graph capture.
    """
    del attn_sink
    assert q.dim() == 3 and kv.dim() == 2 and indices.dim() == 2 and lse.dim() == 2
    assert q.dtype in (torch.bfloat16, torch.float16) and kv.dtype == q.dtype
    T, H, d_qk = q.shape
    assert d_qk in D_QK and kv.shape[1] == d_qk
    assert indices.shape[0] == T and lse.shape == (T, H)
    assert q.is_cuda
    tile = tile_heads_for(H)
    if T == 0 or indices.shape[1] == 0 or kv.shape[0] == 0:
        return torch.zeros(indices.shape, dtype=torch.float32, device=q.device)
    target = torch.empty(indices.shape, dtype=torch.float32, device=q.device)
    q, kv = contiguous_aligned(q), contiguous_aligned(kv)
    indices = int32_contiguous(indices)
    topk_length, q_positions = int32_contiguous(topk_length), int32_contiguous(q_positions)
    key = compile_key(q.dtype, d_qk, tile, topk_length is not None, q_positions is not None)
    get_kernel(key)(q, kv, indices, topk_length, q_positions,
                    shifted_lse(lse.float(), indices.shape[1], tile), target,
                    float(sm_scale) * LOG2E)
    return target


def shifted_lse(lse: torch.Tensor, topk: int, tile_heads: int) -> torch.Tensor:
    """``lse [T, H]`` float32 less a per-token constant ``c_t = min(min_h lse[t, h], K)``
    (0 where that is not finite), contiguous: the kernel's ``exp2((s - lse) * log2(e))`` terms
    are then ``exp(s - lse + c_t)``, whose normalised target is the same, but whose terms stay
    out of float32's subnormals when a sink takes nearly all of each head's mass (a sink of 100
    puts them near ``exp(-100)``, 2**-144). ``K = (126 - log2(topk * tile_heads)) * ln 2`` bounds
    every term by ``2**(126 - log2(topk * tile_heads))`` (``s <= lse``), so their sum cannot
    overflow. Exact for sinks up to about ``K`` + 70 above the scores (natural log; K 75 at topk
    2048 and 128 heads); the reference is exact for any sink."""
    k = (126 - math.ceil(math.log2(max(topk * tile_heads, 1)))) * math.log(2.0)
    c = lse.amin(dim=1, keepdim=True).clamp_max(k)
    c = torch.where(torch.isfinite(c), c, 0.0)
    return (lse - c).contiguous()
