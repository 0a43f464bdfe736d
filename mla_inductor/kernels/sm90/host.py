"""What the SM90 launchers (the ``*_host`` modules) and the package's ``supports`` share with
the kernels without the CuTe DSL: the problem sizes the kernels take (d_qk and d_v, the indexer
target's and the lightning indexer's head dims and head tiles), the natural-log / log2
constants, the forward's head tile, the dkv accumulator's interleave group, the host-side
alignment and int32 form of inputs, and the one call through which a launcher compiles (and only
then imports ``cutlass``). Importing it never imports ``cutlass``.
"""

from __future__ import annotations

import importlib
import math

import torch

LN2 = math.log(2.0)
LOG2E = math.log2(math.e)
FWD_TILE_H = 64  # heads per forward tile (one wgmma M); the persistent grid walks these tiles
DKV_GROUP = 16  # the backward's dkv_accum columns are interleaved within aligned groups of 16

# The problem sizes the kernels take (:func:`mla_inductor.kernels.sm90.supports`).
SUPPORTED_DIMS = ((576, 512), (512, 512))  # (d_qk, d_v) of the forward and the backward
INDEXER_D_QK = (576, 512)
INDEXER_TILE_HEADS = (64, 128)  # the indexer kernel's wgmma N: the heads of one token, padded
INDEXER_MAX_HEADS = INDEXER_TILE_HEADS[-1]
LIGHTNING_D = 128  # the lightning indexer's head dim
LIGHTNING_HEAD_TILES = (16, 32, 64)  # its score kernel's heads per token, padded
LIGHTNING_TILE_N = 256  # its wgmma N: tokens x head tile
LIGHTNING_MAX_HEADS = LIGHTNING_HEAD_TILES[-1]


# Bits kept free above a fixed-point bound: the bound covers every partial sum, and a kernel's
# bf16 / fp16 rounding of its terms adds at most 1% to it.
FIXED_HEADROOM = 2


def fixed_point_scale_for(bound: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The power-of-two scale of a 64-bit fixed-point accumulator whose partial sums are at most
    ``bound`` in magnitude (a float64 0-d tensor, on the device: no host synchronisation):
    ``scale = 2**k`` with ``k = 63 - FIXED_HEADROOM - ceil(log2 bound)``, clamped to [-126, 126]
    (a zero bound gives 126), as a ``[1]`` float32 tensor, and its inverse in float64, NaN when
    the bound is not finite (so that a non-finite input gives NaN, never a wrapped integer).
    Raises nothing."""
    finite = torch.isfinite(bound)
    k = (63 - FIXED_HEADROOM) - torch.ceil(torch.log2(torch.where(finite, bound, 1.0)))
    k = k.clamp(-126, 126)
    scale = torch.exp2(k).to(torch.float32).reshape(1)
    inverse = torch.where(finite, torch.exp2(-k), torch.nan)
    return scale, inverse


def contiguous_aligned(x: torch.Tensor) -> torch.Tensor:
    """``x`` (any shape and dtype) if it is contiguous and starts 16-byte aligned, else a
    contiguous copy that does (the kernels read 16-byte vectors). Raises nothing."""
    x = x.contiguous()
    return x if x.data_ptr() % 16 == 0 else x.clone()


def int32_contiguous(x: torch.Tensor | None) -> torch.Tensor | None:
    """``x`` as a contiguous int32 tensor (the kernels' indices, topk_length and q_positions),
    or None for None. Raises nothing."""
    return None if x is None else x.to(torch.int32).contiguous()


def compile_for_arch(kernel_module: str, compile_fn: str, key: tuple):
    """Compiles one kernel: ``compile_fn(*key[:-1])`` of the kernel module ``kernel_module``
    (a module of this package: ``"fwd"``, ``"bwd"``, ...), for the arch ``key[-1]`` (no GPU needed:
    :func:`.common.target_arch`). Importing the kernel module imports the CuTe DSL; a launcher
    calls this only on a kernel cache miss (:class:`..cache.KernelCache`). Returns the compiled
    function (called with the launcher's tensors and a stream).

    Raises:
        ImportError: the CuTe DSL is not installed.
        Exception: the CuTe DSL's own error when the kernel does not compile for that arch
            (passed on unchanged).
    """
    from .common import target_arch

    compile_ = getattr(importlib.import_module(f"{__package__}.{kernel_module}"), compile_fn)
    with target_arch(key[-1]):
        return compile_(*key[:-1])
