"""Host side of the SM90 row sort (the kernel is :mod:`.rowsort`): its preconditions (asserted: its
caller, :mod:`.bwd_host`, passes the op's checked indices), the static compile key, the kernel cache
and the launch on torch's current stream. It imports the CuTe DSL only to compile a kernel that the
cache (memory, then disk) does not have (see :mod:`mla_inductor.kernels.cache`).
"""

from __future__ import annotations

import torch

from ..cache import KernelCache
from .host import compile_for_arch

_CACHE = KernelCache("mla_sm90_rowsort")

MAX_SLOTS = 8192  # the kernel's longest row (:data:`.rowsort.MAX_N`, kept here without the DSL)
MIN_N = 256  # rows are padded to a power of two, at least this (:data:`.rowsort.MIN_N`)


def padded(topk: int) -> int:
    """The kernel's row width for ``topk`` slots: the next power of two, at least
    :data:`MIN_N`."""
    return max(MIN_N, 1 << max(0, int(topk) - 1).bit_length())


def compile_key(topk: int, has_len: bool, arch: str = "sm_90a") -> tuple:
    """The static compile key: the padded row width (:func:`padded`) and whether a
    ``topk_length`` is read; R and the slot count are symbolic. The arch is last."""
    return (padded(topk), bool(has_len), arch)


def get_kernel(key: tuple):
    """Compiled kernel for ``key`` (see :func:`compile_key`), from the cache or compiled now for
    the key's arch (no GPU needed; only compiling imports the CuTe DSL)."""
    return _CACHE.get(key, lambda: compile_for_arch("rowsort", "compile_sort", key))


def precompile_sort(arch: str = "sm_90a", *, topks=(2048,), topk_length=(False, True)) -> dict:
    """Compiles the row sort for ``arch`` without a GPU, for every ``topks`` (slots a row, at
    most :data:`MAX_SLOTS`) x ``topk_length``; returns ``{compile_key: fn}`` (also cached).

    Raises:
        ValueError: for an arch other than ``sm_90a`` or a topk above :data:`MAX_SLOTS`.
    """
    if arch != "sm_90a":
        raise ValueError(f"sparse_mla: the sm90 row sort cannot compile for {arch!r}; use "
                         f"'sm_90a'")
    compiled = {}
    for topk in topks:
        if not 0 < topk <= MAX_SLOTS:
            raise ValueError(f"sparse_mla: the sm90 row sort takes 1 to {MAX_SLOTS} slots a "
                             f"row, got {topk}")
        for with_len in topk_length:
            key = compile_key(topk, with_len, arch)
            compiled[key] = get_kernel(key)
    return compiled


def sorted_rows(indices: torch.Tensor, topk_length: torch.Tensor | None, S: int) -> torch.Tensor:
    """Each row's valid slots in ascending index order, duplicates kept, then -1 (the kernel's
    module docstring): ``out [T, topk]`` int32, a new contiguous tensor.

    Args:
        indices: ``[T, topk]`` int32 CUDA tensor, contiguous, ``topk <= MAX_SLOTS``; a slot is
            valid where ``0 <= index < S`` (and its position is below ``topk_length[t]``).
        topk_length: ``[T]`` int32 on the same device, contiguous, or None (every position).
        S: the key count (a Python int >= 0).

    Raises:
        CompileDuringCaptureError: first use of a configuration inside CUDA-graph capture.
    """
    assert indices.dim() == 2 and indices.dtype == torch.int32 and indices.is_contiguous()
    T, topk = indices.shape
    assert topk <= MAX_SLOTS and indices.is_cuda
    assert topk_length is None or (
        topk_length.dtype == torch.int32 and topk_length.shape == (T,)
        and topk_length.is_contiguous() and topk_length.device == indices.device)
    out = torch.empty_like(indices)
    if T == 0 or topk == 0:
        return out
    fn = get_kernel(compile_key(topk, topk_length is not None))
    fn(indices, topk_length, out, min(int(S), 2**31 - 1))
    return out
