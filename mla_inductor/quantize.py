"""Per-row fp8 quantisation for the lightning indexer's fp8 form: :func:`quantize_fp8`."""

from __future__ import annotations

import torch
from torch import Tensor

E4M3_MAX = 448.0  # the largest finite float8_e4m3fn value
# The smallest scale: float32's smallest normal, so that a zero row (amax 0) never divides 0 by 0.
SCALE_FLOOR = torch.finfo(torch.float32).tiny


def quantize_fp8(x: Tensor) -> tuple[Tensor, Tensor]:
    """Quantises each row (the last dimension) of ``x`` to float8_e4m3fn with one float32 scale.

    DeepSeek-V3.2-Exp's inference code quantises the indexer's q and k this way (``act_quant``
    with one block per row of the index head width): ``scale = amax / 448`` (448 the largest
    e4m3 value, ``amax`` the row's largest magnitude, in float32) and ``x_fp8 = x / scale``
    rounded to e4m3 (to nearest, ties to even), so that ``x ≈ x_fp8 * scale`` with an error of at
    most e4m3's half-ulp, ``2**-4`` of the element (``2**-10 * scale`` below e4m3's normal range).
    The scale has a floor of :data:`SCALE_FLOOR` (float32's smallest normal, ``2**-126``): a zero
    row gets that scale and exact zeros, never ``0 / 0`` (DeepSeek's ``act_quant`` floors ``amax``
    at ``1e-4`` instead, which would coarsen rows below it). A row holding a NaN gets scale NaN and
    NaN values; one holding an infinity gets scale +inf, NaN at its infinities and zeros
    elsewhere (the indexer ranks a NaN score above every number). Not differentiable: the
    outputs carry no graph.

    Args:
        x: ``[..., D]`` float32, bfloat16 or float16, ``D >= 1``; any device.

    Returns:
        ``(x_fp8, scale)``: ``x_fp8 [..., D]`` float8_e4m3fn and ``scale [...]`` float32, both
        contiguous, on x's device. For the indexer: ``q [.., T, H, D]`` gives ``q_scale [.., T,
        H]`` and ``k [.., S, D]`` gives ``k_scale [.., S]``, the arguments of
        :func:`mla_inductor.lightning_indexer`.

    Raises:
        RuntimeError (every message starts ``quantize_fp8:``): x not a tensor, a dtype other than
            those above, or no last dimension (0-d) or an empty one.
    """
    if not isinstance(x, Tensor):
        raise RuntimeError(f"quantize_fp8: x must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise RuntimeError(f"quantize_fp8: x must be float32, bfloat16 or float16, got {x.dtype}")
    if x.dim() == 0 or x.shape[-1] == 0:
        raise RuntimeError(f"quantize_fp8: x must be [..., D] with D >= 1, got shape "
                           f"{tuple(x.shape)}")
    x = x.detach().float().contiguous()
    scale = (x.abs().amax(-1) / E4M3_MAX).clamp_min(SCALE_FLOOR)
    return (x / scale.unsqueeze(-1)).to(torch.float8_e4m3fn), scale
