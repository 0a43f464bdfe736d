"""Host side of the SM90 indexer-KL kernels (the kernels are :mod:`.kl`): argument checks, the
compile keys, the kernel cache and the launches on torch's current stream. No host
synchronisation, so every call can be captured in a CUDA graph once its kernel is compiled. It
imports the CuTe DSL only to compile a kernel that the cache (memory, then disk) does not have
(see :mod:`mla_inductor.kernels.cache`).
"""

from __future__ import annotations

import torch

from ..cache import KernelCache
from .host import compile_for_arch

_CACHE = KernelCache("mla_sm90_indexer_kl")


def compile_key(backward: bool, arch: str = "sm_90a") -> tuple:
    """The static compile key (R and K are symbolic); the arch is last."""
    return (bool(backward), arch)


def get_kernel(key: tuple):
    """Compiled kernel for ``key`` (:func:`compile_key`), from the cache or compiled now for the
    key's arch (no GPU needed: :func:`.host.compile_for_arch`).

    Raises:
        CompileDuringCaptureError: on a cache miss during CUDA-graph capture.
    """
    return _CACHE.get(key, lambda: compile_for_arch("kl", "compile_kl", key))


def precompile_kl(arch: str = "sm_90a") -> dict:
    """Compiles the forward and the backward kernel for ``arch`` without a GPU; returns
    ``{compile_key: fn}`` (also cached).

    Raises:
        ValueError: for an arch other than ``sm_90a``.
    """
    if arch != "sm_90a":
        raise ValueError(f"sparse_mla: the sm90 indexer-KL kernels cannot compile for {arch!r}; "
                         f"use 'sm_90a'")
    return {key: get_kernel(key) for key in (compile_key(False, arch), compile_key(True, arch))}


def _check(logits, target, indices, hi, length) -> None:
    """Asserts what the op checked (:mod:`mla_inductor.ops.indexer_kl`) and the backend's
    selection ensured (a CUDA device)."""
    assert logits.dim() == 2 and target.shape == logits.shape == indices.shape
    assert hi.shape == logits.shape[:1] == length.shape
    assert logits.dtype == target.dtype == torch.float32
    assert indices.dtype == hi.dtype == length.dtype == torch.int32
    assert logits.is_cuda and all(t.device == logits.device for t in (target, indices, hi, length))


def forward(logits: torch.Tensor, target: torch.Tensor, indices: torch.Tensor, hi: torch.Tensor,
            length: torch.Tensor):
    """Per-row ``(kl, lse, tsum, count)`` (the module docstring of :mod:`.kl`): ``[R]`` float32,
    float32, float32, int32, contiguous.

    Args:
        logits, target: ``[R, K]`` float32 CUDA tensors.
        indices: ``[R, K]`` int32; slot ``j`` of row ``r`` is valid iff ``0 <= indices[r, j] <=
            hi[r]`` and ``j < length[r]``.
        hi, length: ``[R]`` int32.

    Raises:
        CompileDuringCaptureError: first use inside CUDA-graph capture.
    """
    _check(logits, target, indices, hi, length)
    R = logits.shape[0]
    kl, lse, tsum = (torch.empty(R, dtype=torch.float32, device=logits.device) for _ in range(3))
    count = torch.empty(R, dtype=torch.int32, device=logits.device)
    if R == 0:
        return kl, lse, tsum, count
    if logits.shape[1] == 0:
        return kl.zero_(), lse.fill_(-torch.inf), tsum.zero_(), count.zero_()
    get_kernel(compile_key(False))(logits.contiguous(), target.contiguous(), indices.contiguous(),
                                   hi.contiguous(), length.contiguous(), kl, lse, tsum, count)
    return kl, lse, tsum, count


def backward(dkl: torch.Tensor, logits: torch.Tensor, target: torch.Tensor,
             indices: torch.Tensor, hi: torch.Tensor, length: torch.Tensor, lse: torch.Tensor,
             tsum: torch.Tensor) -> torch.Tensor:
    """``dlogits [R, K]`` float32, contiguous: ``dkl[r] (exp(logits - lse[r]) tsum[r] - target)``
    on the valid slots, 0 elsewhere (arguments as :func:`forward`'s; ``dkl``, ``lse``, ``tsum``
    ``[R]`` float32).

    Raises:
        CompileDuringCaptureError: first use inside CUDA-graph capture.
    """
    _check(logits, target, indices, hi, length)
    assert all(t.shape == logits.shape[:1] and t.dtype == torch.float32 for t in (dkl, lse, tsum))
    dlogits = torch.empty_like(logits, memory_format=torch.contiguous_format)
    if dlogits.numel() == 0:
        return dlogits
    get_kernel(compile_key(True))(logits.contiguous(), target.contiguous(), indices.contiguous(),
                                  hi.contiguous(), length.contiguous(), dkl.contiguous(),
                                  lse.contiguous(), tsum.contiguous(), dlogits)
    return dlogits
