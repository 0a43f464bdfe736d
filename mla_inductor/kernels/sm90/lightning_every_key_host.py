"""Host side of the SM90 lightning-indexer score kernel for every key (the kernel is
:mod:`.lightning_every_key`; bf16, fp16 and float8_e4m3fn, whose q_scale and k_scale it passes on):
its preconditions (asserted: the op checks the arguments and the backend's selection the kernel's
limits), the head tile, the key split, the static compile key, the kernel cache and the launch on
torch's current stream. It imports the CuTe DSL only to compile a kernel that the cache (memory,
then disk) does not have (see :mod:`mla_inductor.kernels.cache`).
"""

from __future__ import annotations

import torch

from ..cache import KernelCache
from .host import LIGHTNING_D as D
from .host import LIGHTNING_HEAD_TILES as HEAD_TILES
from .host import LIGHTNING_TILE_N as TILE_N
from .host import compile_for_arch

_CACHE = KernelCache("mla_sm90_lightning_scores")
TILE_KEYS = 64  # keys per block of the kernel
MIN_BLOCKS_PER_SPLIT = 8  # a key range reloads Q (64 KiB): at least 8 blocks (128 KiB of K) each
INT32_MAX = 2**31 - 1


def head_tile_for(num_heads: int) -> int:
    """The kernel's heads per token for ``num_heads``: 16, 32 or 64 (the smallest that holds
    them; tokens x head tile = 256).

    Raises:
        ValueError: outside 1..64 (a head count given to :func:`precompile_scores`).
    """
    if not 1 <= num_heads <= HEAD_TILES[-1]:
        raise ValueError(f"lightning_indexer: the sm90 kernel supports 1 to {HEAD_TILES[-1]} "
                         f"index heads, got {num_heads}")
    return next(n for n in HEAD_TILES if num_heads <= n)


def tokens_per_tile(num_heads: int) -> int:
    """Tokens of one CTA (256 / head tile)."""
    return TILE_N // head_tile_for(num_heads)


def compile_key(dtype: torch.dtype, head_tile: int, causal: bool, arch: str = "sm_90a") -> tuple:
    """The static compile key (``dtype``: bfloat16, float16 or float8_e4m3fn, whose kernel also
    reads q_scale and k_scale): everything else (B, T, H, S, the chunk, ld) is symbolic. The
    arch is last."""
    return (str(dtype).removeprefix("torch."), int(head_tile), bool(causal), arch)


def get_kernel(key: tuple):
    """Compiled kernel for ``key`` (see :func:`compile_key`), from the cache or compiled now
    for the key's arch (no GPU needed: :func:`.host.compile_for_arch`)."""
    return _CACHE.get(key, lambda: compile_for_arch("lightning_every_key", "compile_scores", key))


def precompile_scores(arch: str = "sm_90a", *, dtypes=(torch.bfloat16,), heads=(64,),
                      causal=(False, True)) -> dict:
    """Compiles the score kernels for ``arch`` without a GPU, for every combination of
    ``dtypes`` (bfloat16, float16, float8_e4m3fn) x the head tiles of ``heads`` x ``causal``;
    returns ``{compile_key: fn}`` (also cached).

    Raises:
        ValueError: for an arch other than ``sm_90a``, or a head count outside 1..64.
    """
    if arch != "sm_90a":
        raise ValueError(f"lightning_indexer: sm90 scores cannot compile for {arch!r}; use "
                         f"'sm_90a'")
    compiled = {}
    for dtype in dtypes:
        for tile in sorted({head_tile_for(h) for h in heads}):
            for with_causal in causal:
                key = compile_key(dtype, tile, with_causal, arch)
                compiled[key] = get_kernel(key)
    return compiled


def key_split(n_tiles: int, S: int, num_sms: int) -> tuple[int, int]:
    """``(n_splits, blocks_per_split)``: the key blocks of every token tile cut into contiguous
    ranges so that ``n_tiles x n_splits`` reaches two CTAs per SM where the keys allow (at least
    :data:`MIN_BLOCKS_PER_SPLIT` blocks per range); ``(1, all blocks)`` once the token tiles
    alone fill the GPU. A function of the sizes only (no data)."""
    n_kb = max(1, -(-S // TILE_KEYS))
    want = -(-2 * num_sms // max(1, n_tiles))
    splits = max(1, min(want, n_kb // MIN_BLOCKS_PER_SPLIT))
    per = -(-n_kb // splits)
    return -(-n_kb // per), per


def scores(q, k, weights, row_len, buf, b0: int, t0: int, n_tok: int, n_batch: int,
           q_scale=None, k_scale=None) -> None:
    """Writes the scores of one chunk of rows into ``buf`` (the module docstring of
    :mod:`.lightning_every_key`): the tokens ``[t0, t0 + n_tok)`` of the batch elements
    ``[b0, b0 + n_batch)`` (so flattened rows ``r0 = b0 T + t0`` on, contiguous: ``n_batch > 1``
    only with ``t0 = 0, n_tok = T``).

    Args:
        q: ``[B, T, H, D]`` bf16/fp16/float8_e4m3fn CUDA tensor, contiguous, 16-byte aligned,
            D = 128, 1 <= H <= 64.
        k: ``[B, S, D]``, q's dtype, contiguous, 16-byte aligned.
        weights: ``[B, T, H]`` float32, contiguous.
        row_len: ``[B T]`` int32 (keys ``s < row_len[r]`` visible, in ``[0, S]``; causal) or
            None (every key visible).
        buf: ``[>= n_batch n_tok, ld]`` float32, contiguous, ``ld >= S`` a multiple of 4; row
            ``r - r0`` receives row r's scores (entries at ``s >= row_len[r]`` unspecified).
        q_scale: with float8_e4m3fn q and k only: ``[B, T, H]`` float32, contiguous (the op
            resolves "no q_scale" to ones).
        k_scale: with float8_e4m3fn q and k only: ``[B, S]`` float32, contiguous.

    Returns nothing. Launched on the current stream; allocates nothing.

    Raises:
        ValueError: a buffer past the kernel's 32-bit offsets (2**31 elements: S above about
            2**31 / :func:`tokens_per_tile` keys).
        CompileDuringCaptureError: first use of a configuration inside CUDA-graph capture.
    """
    B, T, H, d = q.shape
    S = k.shape[1]
    assert d == D and B * T <= INT32_MAX
    assert S <= buf.shape[1] and buf.shape[1] % 4 == 0
    if buf.numel() > INT32_MAX:
        raise ValueError(f"lightning_indexer: the sm90 score buffer {tuple(buf.shape)} for S = "
                         f"{S} keys passes the kernel's 2**31 - 1 elements")
    tile = head_tile_for(H)
    n_tiles = -(-n_tok // (TILE_N // tile)) * n_batch
    num_sms = torch.cuda.get_device_properties(q.device).multi_processor_count
    n_splits, per = key_split(n_tiles, S, num_sms)
    fp8 = q.dtype == torch.float8_e4m3fn
    assert fp8 == (q_scale is not None) == (k_scale is not None)  # the op checked the scales
    if fp8:
        q_scale, k_scale = q_scale.view(B * T, H), k_scale.view(B * S)
    key = compile_key(q.dtype, tile, row_len is not None)
    get_kernel(key)(q.view(B * T, H, D), k.view(B * S, D), weights.view(B * T, H), row_len, buf,
                    q_scale, k_scale, T, S, b0, t0, n_tok, n_batch, n_splits, per)
