"""Host side of the SM90 top-k select (the kernel is :mod:`.topk`): its preconditions (asserted: its
caller, :mod:`.lightning_indexer_host`, makes the buffers), the static compile key, the kernel cache
and the launch on torch's current stream. It imports the CuTe DSL only to compile a kernel that the
cache (memory, then disk) does not have (see :mod:`mla_inductor.kernels.cache`).
"""

from __future__ import annotations

import torch

from ..cache import KernelCache
from .host import compile_for_arch

_CACHE = KernelCache("mla_sm90_topk_select")

NUM_THREADS = 512  # threads per CTA (one CTA per row)
CACHE_ELEMS = 16384  # rows up to this length keep their radix keys in shared memory
CAND_ELEMS = 2048  # capacity of the candidate buffer (key, index pairs)
MIN_BLOCKS = 2  # CTAs per SM the register allocation leaves room for

# Buffers of rows up to SHORT_MAX_LEN keys take SHORT_CONFIG (num_threads, cache_elems,
# cand_elems, min_blocks): 3 CTAs of 256 threads per SM with an 8192-key row cache. Measured on
# the fp8 score kernel's chunks (H100, 2026-12-06, T = S causal, 64 heads, topk 2048, the select
# summed over the chunks, bitwise the same): 0.630 / 1.955 ms against the default's 0.679 /
# 2.153 at T 16384 / 32768, but 8.967 against 6.669 at 65536, whose rows past 32768 keys do not
# fit the guessed threshold's candidates next to their bitmaps in the smaller cache.
SHORT_CONFIG = (256, 8192, 2048, 3)
SHORT_MAX_LEN = 32768
# the tuned configurations: the default, then the short rows'
TUNED_CONFIGS = ((NUM_THREADS, CACHE_ELEMS, CAND_ELEMS, MIN_BLOCKS), SHORT_CONFIG)


def compile_key(num_threads: int = NUM_THREADS, cache_elems: int = CACHE_ELEMS,
                cand_elems: int = CAND_ELEMS, min_blocks: int = MIN_BLOCKS,
                arch: str = "sm_90a") -> tuple:
    """The static compile key: R, ld and topk are symbolic. The arch is last."""
    return (int(num_threads), int(cache_elems), int(cand_elems), int(min_blocks), arch)


def tuned_keys(arch: str = "sm_90a") -> tuple:
    """The compile keys of :data:`TUNED_CONFIGS` (the default, then :data:`SHORT_CONFIG`), a tuple
    of two :func:`compile_key` tuples."""
    return tuple(compile_key(*config, arch=arch) for config in TUNED_CONFIGS)


def default_key(ld: int, arch: str = "sm_90a") -> tuple:
    """The tuned compile key for a buffer of ``ld`` (int, keys a row) float32 scores a row:
    :data:`SHORT_CONFIG`'s up to :data:`SHORT_MAX_LEN`, else the default configuration's."""
    long_key, short_key = tuned_keys(arch)
    return short_key if ld <= SHORT_MAX_LEN else long_key


def get_kernel(key: tuple):
    """Compiled kernel for ``key`` (see :func:`compile_key`), from the cache or compiled now for
    the key's arch (no GPU needed; only compiling imports the CuTe DSL)."""
    return _CACHE.get(key, lambda: compile_for_arch("topk", "compile_select", key))


def precompile_select(arch: str = "sm_90a", configs=TUNED_CONFIGS) -> dict:
    """Compiles the select kernel for ``arch`` without a GPU, one per ``(num_threads,
    cache_elems, cand_elems, min_blocks)`` of ``configs``; returns ``{compile_key: fn}`` (also
    cached).

    Raises:
        ValueError: for an arch other than ``sm_90a``, or a configuration the kernel does not
            support (:class:`.topk.TopkSelectSm90`).
    """
    if arch != "sm_90a":
        raise ValueError(f"lightning_indexer: the sm90 top-k cannot compile for {arch!r}; use "
                         f"'sm_90a'")
    compiled = {}
    for config in configs:
        key = compile_key(*config, arch=arch)
        compiled[key] = get_kernel(key)
    return compiled


def select(buf: torch.Tensor, row_len: torch.Tensor, topk: int, out_indices: torch.Tensor,
           out_scores: torch.Tensor, *, key: tuple | None = None) -> None:
    """Per-row top-k of a score buffer on SM90 (the selection rules are :mod:`.topk`'s).

    For each row ``r``, among ``buf[r, :row_len[r]]`` (``row_len`` clamped to ``[0, ld]``) the
    ``min(topk, row_len[r])`` largest scores (a NaN above +inf, -0.0 equal to +0.0, exact ties
    to the smaller key index) go to ``out_indices[r]`` as key indices in ascending order, then -1
    in the remaining slots; ``out_scores[r]`` holds each slot's score (bit for bit), 0 on -1
    slots. Writes the outputs on torch's current stream and returns nothing; ``topk == 0`` or
    ``R == 0`` launches nothing.

    Args:
        buf: ``[R, ld]`` float32 CUDA tensor, contiguous, 16-byte aligned, ``ld`` a multiple of
            4 (entries at ``s >= row_len[r]`` are never used).
        row_len: ``[R]`` int32, buf's device, contiguous.
        topk: Python int >= 0.
        out_indices: ``[R, topk]`` int32, contiguous, buf's device.
        out_scores: ``[R, topk]`` float32, contiguous, buf's device.
        key: the compile key (:func:`compile_key`; default :func:`default_key` of ``ld``, and
            then both tuned configurations are compiled on first use, so that a CUDA-graph
            capture at another row length finds its kernel).

    Raises:
        CompileDuringCaptureError: first use inside CUDA-graph capture.
    """
    assert isinstance(topk, int) and topk >= 0  # the op checked it
    assert buf.dim() == 2 and row_len.dim() == 1
    R, ld = buf.shape
    assert row_len.shape == (R,) and out_indices.shape == out_scores.shape == (R, topk)
    assert buf.dtype == out_scores.dtype == torch.float32
    assert row_len.dtype == out_indices.dtype == torch.int32
    tensors = (buf, row_len, out_indices, out_scores)
    assert buf.is_cuda and all(t.device == buf.device for t in tensors)
    assert all(t.is_contiguous() for t in tensors)
    assert ld % 4 == 0 and buf.data_ptr() % 16 == 0
    if topk == 0 or R == 0:
        return
    if ld == 0:  # no keys: every slot is empty
        out_indices.fill_(-1)
        out_scores.zero_()
        return
    if key is None:
        for tuned in tuned_keys():
            get_kernel(tuned)
        key = default_key(ld)
    get_kernel(key)(buf, row_len, out_indices, out_scores)
