"""CPU-only: the SM90 indexer-target kernel compiles for sm_90a without a GPU, through
``mla_inductor.precompile`` (one kernel per head tile x topk_length x positions)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("cutlass.cute")

import mla_inductor  # noqa: E402
from mla_inductor.kernels.sm90.common import SMEM_LIMIT  # noqa: E402
from mla_inductor.kernels.sm90 import indexer_target_kernel as indexer  # noqa: E402
from mla_inductor.kernels.sm90 import indexer_target_host as indexer_host  # noqa: E402


def test_precompile_compiles_one_kernel_per_head_tile_and_feature(tmp_path):
    compiled = mla_inductor.precompile(
        arch="sm_90a", thresholds=(), backward_heads=(), indexer_heads=(16, 64, 128),
        topk_length=(False, True), indexer_positions=(True,),
    )
    assert sorted(compiled) == sorted(
        ("bfloat16", 576, tile, with_len, True, "sm_90a")
        for tile in (64, 128) for with_len in (False, True)
    )
    key = indexer_host.compile_key(torch.bfloat16, 576, 128, True, True)
    path = tmp_path / "target.o"
    compiled[key].export_to_c(object_file_path=str(path), function_name="indexer_target")
    assert path.stat().st_size > 0
    again = indexer_host.precompile_target("sm_90a", heads=(128,), topk_length=(True,),
                                           positions=(True,))
    assert again[key] is compiled[key]  # served from the cache


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_d_qk_512_compiles(dtype):
    (key,) = indexer_host.precompile_target("sm_90a", dtypes=(dtype,), d_qk=512, heads=(100,),
                                            topk_length=(False,), positions=(False,))
    assert key == (str(dtype).removeprefix("torch."), 512, 128, False, False, "sm_90a")


@pytest.mark.parametrize("heads,tile", [(1, 64), (64, 64), (65, 128), (128, 128)])
def test_head_tiles(heads, tile):
    assert indexer_host.tile_heads_for(heads) == tile


def test_rejected_configurations():
    from cutlass import BFloat16, Float32

    with pytest.raises(ValueError, match="sparse_mla: the sm90 indexer target supports 1 to 128"):
        indexer_host.tile_heads_for(129)
    with pytest.raises(ValueError, match="sm_90a"):
        indexer_host.precompile_target("sm_100a")
    with pytest.raises(ValueError, match="d_qk in"):
        indexer.IndexerTargetSm90(BFloat16, 256, 128, False, False)
    with pytest.raises(TypeError, match="bf16/fp16"):
        indexer.IndexerTargetSm90(Float32, 576, 128, False, False)


def test_ring_fits_next_to_q():
    """The key ring holds at most two blocks and fits the 227 KiB of shared memory with Q."""
    from cutlass import BFloat16

    for d_qk, tile, ring in ((576, 128, 10), (576, 64, 18), (512, 128, 12), (512, 64, 16)):
        config = indexer.IndexerTargetSm90(BFloat16, d_qk, tile, False, False)
        assert config.ring == ring
        assert config._smem_bytes() <= SMEM_LIMIT
