"""CPU-only: the SM90 top-k select kernel compiles for sm_90a without a GPU (one kernel for
every R, ld and topk), exports, and is served from the cache; bad configurations are refused."""

from __future__ import annotations

import pytest

pytest.importorskip("cutlass.cute")

from mla_inductor.kernels.sm90 import topk, topk_host  # noqa: E402


def test_precompile_select_compiles_and_caches(tmp_path):
    compiled = topk_host.precompile_select("sm_90a")
    key = topk_host.compile_key()
    short = topk_host.compile_key(*topk_host.SHORT_CONFIG)
    assert list(compiled) == [key, short]
    assert key == (topk_host.NUM_THREADS, topk_host.CACHE_ELEMS, topk_host.CAND_ELEMS,
                   topk_host.MIN_BLOCKS, "sm_90a")
    path = tmp_path / "select.o"
    compiled[key].export_to_c(object_file_path=str(path), function_name="topk_select")
    assert path.stat().st_size > 0
    again = topk_host.precompile_select("sm_90a")
    assert again[key] is compiled[key]  # served from the cache


def test_rejected_configurations():
    with pytest.raises(ValueError, match="sm_90a"):
        topk_host.precompile_select("sm_100a")
    with pytest.raises(ValueError, match="lightning_indexer: .*threads"):
        topk.TopkSelectSm90(384, 16384, 1024, 1)
    with pytest.raises(ValueError, match="lightning_indexer: .*threads"):
        topk.TopkSelectSm90(256, 1000, 1024, 1)  # the cache is not whole tiles
    with pytest.raises(ValueError, match="lightning_indexer: .*shared memory"):
        topk.TopkSelectSm90(512, 65536, 1024, 1)


@pytest.mark.parametrize("config", topk_host.TUNED_CONFIGS)
def test_configurations_fit_their_occupancy(config):
    """Each configuration's shared memory lets ``min_blocks`` CTAs share an SM (228 KiB, 1 KiB
    reserved per CTA), and its threads' registers fit the SM's 65536 at 64 a thread."""
    threads, _, _, min_blocks = config
    assert min_blocks * (topk.TopkSelectSm90(*config)._smem_bytes() + 1024) <= 228 * 1024
    assert min_blocks * threads * 64 <= 65536


def test_default_key_by_row_length():
    short = topk_host.compile_key(*topk_host.SHORT_CONFIG)
    assert topk_host.default_key(1) == topk_host.default_key(topk_host.SHORT_MAX_LEN) == short
    assert topk_host.default_key(topk_host.SHORT_MAX_LEN + 4) == topk_host.compile_key()
