"""CPU-only: the SM90 lightning-indexer score kernel compiles for sm_90a without a GPU, through
``mla_inductor.precompile`` (one kernel per dtype x head tile x causal), and its static
configuration fits the GPU."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("cutlass.cute")

import mla_inductor  # noqa: E402
from mla_inductor.kernels import sm90  # noqa: E402
from mla_inductor.kernels.sm90 import lightning, lightning_host  # noqa: E402


def test_precompile_compiles_one_kernel_per_head_tile_and_causal(tmp_path):
    compiled = mla_inductor.precompile(
        arch="sm_90a", thresholds=(), backward_heads=(), indexer_heads=(),
        lightning_heads=(8, 32, 64), lightning_causal=(False, True),
    )
    assert sorted(compiled) == sorted(
        ("bfloat16", tile, causal, "sm_90a") for tile in (16, 32, 64) for causal in (False, True)
    )
    key = lightning_host.compile_key(torch.bfloat16, 64, True)
    path = tmp_path / "scores.o"
    compiled[key].export_to_c(object_file_path=str(path), function_name="lightning_scores")
    assert path.stat().st_size > 0
    again = lightning_host.precompile_scores("sm_90a", heads=(64,), causal=(True,))
    assert again[key] is compiled[key]  # served from the cache


def test_fp16_compiles():
    (key,) = lightning_host.precompile_scores("sm_90a", dtypes=(torch.float16,), heads=(20,),
                                              causal=(False,))
    assert key == ("float16", 32, False, "sm_90a")


def test_default_precompile_skips_the_lightning_kernels():
    compiled = sm90.precompile("sm_90a", thresholds=(), backward_heads=(), indexer_heads=())
    assert not any(lightning_host.compile_key(torch.bfloat16, tile, causal) in compiled
                   for tile in (16, 32, 64) for causal in (False, True))


@pytest.mark.parametrize("heads,tile,tokens", [(1, 16, 16), (16, 16, 16), (17, 32, 8),
                                               (32, 32, 8), (33, 64, 4), (64, 64, 4)])
def test_head_tiles(heads, tile, tokens):
    assert lightning_host.head_tile_for(heads) == tile
    assert lightning_host.tokens_per_tile(heads) == tokens


def test_rejected_configurations():
    from cutlass import BFloat16, Float32

    for heads in (0, 65):
        with pytest.raises(ValueError, match="lightning_indexer: the sm90 kernel supports 1 to 64"):
            lightning_host.head_tile_for(heads)
    with pytest.raises(ValueError, match="sm_90a"):
        lightning_host.precompile_scores("sm_100a")
    with pytest.raises(ValueError, match="head tile in"):
        lightning.LightningScoresSm90(BFloat16, 128, False)
    with pytest.raises(TypeError, match="bf16/fp16"):
        lightning.LightningScoresSm90(Float32, 64, False)


def test_shared_memory_fits():
    from cutlass import BFloat16

    for tile in (16, 32, 64):
        config = lightning.LightningScoresSm90(BFloat16, tile, True)
        assert config.tokens * tile == 256
        assert config._smem_bytes() <= lightning.SMEM_LIMIT


def test_supports():
    ok, _ = sm90.supports(torch.bfloat16, "lightning_indexer", 100, 64, 100, 128, 0,
                          frozenset({"causal"}))
    assert ok
    ok, why = sm90.supports(torch.float16, "lightning_indexer", 100, 65, 100, 128, 0)
    assert not ok and "1 to 64 index heads" in why
    ok, why = sm90.supports(torch.bfloat16, "lightning_indexer", 100, 64, 100, 64, 0)
    assert not ok and "D = 128" in why
    ok, why = sm90.supports(torch.float32, "lightning_indexer", 100, 64, 100, 128, 0)
    assert not ok


@pytest.mark.parametrize("n_tiles,S,expect", [
    (4096, 16384, (1, 256)),  # enough token tiles: no split
    (1, 8192, (16, 8)),  # one tile: 128 blocks in 16 ranges of 8 (at most 2 x 132 CTAs)
    (1, 64, (1, 1)),  # fewer than 8 blocks: no split
    (100, 20000, (3, 105)),
])
def test_key_split(n_tiles, S, expect):
    splits, per = lightning_host.key_split(n_tiles, S, 132)
    assert (splits, per) == expect
    n_kb = -(-S // 64)
    assert splits * per >= n_kb > (splits - 1) * per


def test_chunks_cover_rows_in_order():
    from mla_inductor.kernels.sm90.lightning_indexer_host import chunks

    for B, T, cap in ((3, 50, 120), (2, 1000, 300), (1, 7, 4), (4, 5, 5)):
        rows, expect = [], 0
        for b0, t0, n_tok, n_batch in chunks(B, T, cap):
            assert n_tok * n_batch <= cap
            assert n_batch == 1 or (t0 == 0 and n_tok == T)
            assert b0 * T + t0 == expect
            expect += n_tok * n_batch
            rows.append(n_tok * n_batch)
        assert expect == B * T
