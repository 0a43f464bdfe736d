"""CPU-only: the SM90 row sort compiles for sm_90a without a GPU (one kernel per padded row width
and topk_length, every R and slot count), exports, and is served from the cache; its bitonic
network (the kernel's stages and pairing, run here with torch) sorts; the backward's choice to
sort; bad widths are refused."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("cutlass.cute")

import mla_inductor  # noqa: E402
from mla_inductor.kernels.sm90 import bwd_host, rowsort, rowsort_host  # noqa: E402


def test_precompile_sort_compiles_and_caches(tmp_path):
    compiled = rowsort_host.precompile_sort("sm_90a", topks=(640, 2048, 8192),
                                            topk_length=(False, True))
    assert sorted(compiled) == sorted((n, with_len, "sm_90a") for n in (1024, 2048, 8192)
                                      for with_len in (False, True))
    path = tmp_path / "rowsort.o"
    compiled[(2048, True, "sm_90a")].export_to_c(object_file_path=str(path),
                                                 function_name="rowsort")
    assert path.stat().st_size > 0
    again = rowsort_host.precompile_sort("sm_90a", topks=(2000,), topk_length=(True,))
    assert again[(2048, True, "sm_90a")] is compiled[(2048, True, "sm_90a")]


def test_precompile_with_the_backward_includes_the_sort():
    compiled = mla_inductor.precompile(arch="sm_90a", thresholds=(), backward_heads=(64,),
                                       topk_length=(True,), indexer_heads=(),
                                       backward_topk=(512,))
    assert (512, True, "sm_90a") in compiled


def test_padded_widths():
    assert [rowsort_host.padded(k) for k in (1, 256, 257, 640, 2048, 2049, 8192)] == \
        [256, 256, 512, 1024, 2048, 4096, 8192]
    assert rowsort_host.MAX_SLOTS == rowsort.MAX_N and rowsort_host.MIN_N == rowsort.MIN_N


@pytest.mark.parametrize("n", [2, 256, 2048, 8192])  # 2: the network alone
def test_bitonic_network_sorts(n):
    """The kernel's stages, pairs and directions, applied to tensors: every arrangement tried
    comes out ascending (with repeats and the empty slots' INT32_MAX)."""
    g = torch.Generator().manual_seed(n)
    q = torch.arange(n // 2)
    for trial in range(4):
        x = torch.randint(0, 50 if trial % 2 else 2**31 - 1, (n,), generator=g)
        if trial == 3:
            x = torch.sort(x, descending=True).values
        want = torch.sort(x).values
        for k, j in rowsort.bitonic_stages(n):
            lo = rowsort.pair_low(q, j)
            hi = lo + j
            a, b = x[lo], x[hi]
            up = (lo & k) == 0
            x[lo] = torch.where(up, torch.minimum(a, b), torch.maximum(a, b))
            x[hi] = torch.where(up, torch.maximum(a, b), torch.minimum(a, b))
        assert torch.equal(x, want)
    # every element takes part in exactly one pair per stage
    for k, j in rowsort.bitonic_stages(n):
        lo = rowsort.pair_low(q, j)
        assert torch.equal(torch.sort(torch.cat([lo, lo + j])).values, torch.arange(n))


def test_the_backward_sorts_rows_where_the_gathers_evict_first(monkeypatch):
    """The choice follows kv and its accumulator against the L2 (8 bytes an element for the
    deterministic one) and the kernel's longest row."""
    monkeypatch.setattr(bwd_host, "_l2_bytes", lambda device: 40 * 10**6)
    kv = torch.empty(8192, 576, dtype=torch.bfloat16)
    assert not bwd_host.sorts_rows(kv, 2048)  # 28 MB with a float32 accumulator
    assert bwd_host.sorts_rows(kv, 2048, accum_bytes=8)  # 47 MB with an int64 one
    long_kv = torch.empty(32768, 576, dtype=torch.bfloat16)
    assert bwd_host.sorts_rows(long_kv, 2048) and bwd_host.sorts_rows(long_kv, 8192)
    assert not bwd_host.sorts_rows(long_kv, 8193)


def test_rejected():
    with pytest.raises(ValueError, match="sparse_mla: .*power of two"):
        rowsort.RowSortSm90(3000, False)
    with pytest.raises(ValueError, match="sparse_mla: .*power of two"):
        rowsort.RowSortSm90(16384, False)
    with pytest.raises(ValueError, match="sparse_mla: .*power of two"):
        rowsort.RowSortSm90(128, False)  # fewer than two slots a thread
    with pytest.raises(ValueError, match="sm_90a"):
        rowsort_host.precompile_sort("sm_100a")
    with pytest.raises(ValueError, match="sparse_mla: .*8192"):
        rowsort_host.precompile_sort("sm_90a", topks=(8193,))
