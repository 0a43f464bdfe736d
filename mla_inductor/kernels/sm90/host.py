"""What the SM90 launchers (:mod:`.fwd_host`, :mod:`.bwd_host`, :mod:`.indexer_host`) share
with the kernels without the CuTe DSL: the natural-log / log2 constants, the forward's head
tile, the dkv accumulator's interleave group, and the host-side alignment of inputs. Importing it never imports ``cutlass``.
"""

from __future__ import annotations

import math

import torch

LN2 = math.log(2.0)
LOG2E = math.log2(math.e)
FWD_TILE_H = 64  # heads per forward tile (one wgmma M); the persistent grid walks these tiles
DKV_GROUP = 16  # the backward's dkv_accum columns are interleaved within aligned groups of 16


def contiguous_aligned(x: torch.Tensor) -> torch.Tensor:
    """``x`` (any shape and dtype) if it is contiguous and starts 16-byte aligned, else a
    contiguous copy that does (the kernels read 16-byte vectors). Raises nothing."""
    x = x.contiguous()
    return x if x.data_ptr() % 16 == 0 else x.clone()
