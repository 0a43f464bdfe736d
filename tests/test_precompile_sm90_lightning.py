"""CPU-only: the SM90 lightning-indexer score kernel compiles for sm_90a without a GPU, through
``mla_inductor.precompile`` (one kernel per dtype x head tile x causal; bf16, fp16 and
float8_e4m3fn; the top-k select's configurations with them), and its static configuration fits
the GPU. The fp8 kernels' PTX is also assembled by ptxas for sm_90a (when ptxas is on PATH): no
register spills, and the wgmmas are e4m3 m64n128k32 (each block's product in two pieces), with
m64n144k32 for the second piece at head tile 64 (the linear term's columns)."""

from __future__ import annotations

import glob
import re
import shutil
import subprocess

import pytest
import torch

pytest.importorskip("cutlass.cute")

import mla_inductor  # noqa: E402
from mla_inductor.kernels import sm90  # noqa: E402
from mla_inductor.kernels.sm90.common import SMEM_LIMIT  # noqa: E402
from mla_inductor.kernels.sm90 import lightning_every_key as lightning  # noqa: E402
from mla_inductor.kernels.sm90 import lightning_every_key_host as lightning_host  # noqa: E402
from mla_inductor.kernels.sm90 import topk_host  # noqa: E402

SELECT_KEYS = list(topk_host.tuned_keys())


def test_precompile_compiles_one_kernel_per_head_tile_and_causal(tmp_path):
    compiled = mla_inductor.precompile(
        arch="sm_90a", thresholds=(), backward_heads=(), indexer_heads=(),
        lightning_heads=(8, 32, 64), lightning_causal=(False, True),
    )
    assert sorted(compiled, key=str) == sorted(
        [("bfloat16", tile, causal, "sm_90a") for tile in (16, 32, 64) for causal in (False, True)]
        + SELECT_KEYS, key=str)
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


def test_fp8_compiles_one_kernel_per_head_tile_and_causal():
    compiled = mla_inductor.precompile(
        arch="sm_90a", thresholds=(), backward_heads=(), indexer_heads=(),
        lightning_heads=(8, 32, 64), lightning_causal=(False, True),
        lightning_dtypes=(torch.float8_e4m3fn,),
    )
    assert sorted(compiled, key=str) == sorted(
        [("float8_e4m3fn", tile, causal, "sm_90a") for tile in (16, 32, 64)
         for causal in (False, True)] + SELECT_KEYS, key=str)


def _ptx(dtype_name: str, head_tile: int, causal: bool, folder) -> str:
    """The PTX of one score kernel, compiled now (not from the kernel cache) for sm_90a."""
    from cutlass.cutlass_dsl import CuTeDSL

    from mla_inductor.kernels.sm90.common import target_arch

    envar = CuTeDSL._get_dsl().envar
    previous = envar.keep_ptx, envar.dump_dir
    envar.keep_ptx, envar.dump_dir = True, str(folder)
    try:
        with target_arch("sm_90a"):
            lightning.compile_scores(dtype_name, head_tile, causal)
    finally:
        envar.keep_ptx, envar.dump_dir = previous
    (path,) = glob.glob(str(folder / "*.ptx"))
    with open(path) as f:
        return f.read()


@pytest.mark.skipif(shutil.which("ptxas") is None, reason="ptxas not on PATH")
@pytest.mark.parametrize("tile,causal", [(64, True), (16, False)])
def test_fp8_ptx_assembles_without_spills(tmp_path, tile, causal):
    """The most weights per thread (head tile 64: 16 per token, and the linear term's 8 more
    accumulators) and the most partial sums (16: 16 tokens x 2 rows) next to the 128
    accumulators."""
    ptx = _ptx("float8_e4m3fn", tile, causal, tmp_path)
    wgmmas = set(re.findall(r"wgmma\.mma_async\S*", ptx))
    relus = len(re.findall(r"max\.NaN\.f32 [^,]+, [^,]+, 0f00000000;", ptx))
    if tile == 64:
        # the second piece carries the linear term's 16 columns; the scales-folded epilogue
        # takes |x| (abs folded into the FMA), the definition's order relu, NaN kept
        assert wgmmas == {"wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3",
                          "wgmma.mma_async.sync.aligned.m64n144k32.f32.e4m3.e4m3"}
        assert relus == 128
        assert ptx.count("abs.f32") >= 128
    else:
        assert wgmmas == {"wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3"}
        # relu on every accumulator, NaN kept, in both epilogues (scales folded, and the
        # definition's order for a negative, infinite or NaN scale)
        assert relus == 2 * 128
    path = tmp_path / "scores.ptx"
    path.write_text(ptx)
    out = subprocess.run(["ptxas", "-arch=sm_90a", "-v", str(path), "-o",
                          str(tmp_path / "scores.cubin")], capture_output=True, text=True,
                         check=True)
    info = out.stdout + out.stderr
    spills = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", info)
    assert spills and all(a == "0" and b == "0" for a, b in spills), info


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
    with pytest.raises(TypeError, match="bf16/fp16 and float8_e4m3fn"):
        lightning.LightningScoresSm90(Float32, 64, False)


def test_shared_memory_fits():
    from cutlass import BFloat16, Float8E4M3FN

    for dtype in (BFloat16, Float8E4M3FN):
        for tile in (16, 32, 64):
            config = lightning.LightningScoresSm90(dtype, tile, True)
            assert config.tokens * tile == 256
            assert config._smem_bytes() <= SMEM_LIMIT
    fp8 = lightning.LightningScoresSm90(Float8E4M3FN, 64, True)
    assert (fp8.q_bytes, fp8.block_bytes, fp8.n_chunks, fp8.mma_k) == (32768, 8192, 1, 32)


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
    fp8 = torch.float8_e4m3fn
    assert sm90.supports(fp8, "lightning_indexer", 100, 64, 100, 128, 0, frozenset({"causal"}))[0]
    assert sm90.supports(fp8, "lightning_indexer", 100, 1, 100, 128, 0)[0]
    ok, why = sm90.supports(fp8, "lightning_indexer", 100, 65, 100, 128, 0)
    assert not ok and "1 to 64 index heads" in why
    ok, why = sm90.supports(fp8, "lightning_indexer", 100, 64, 100, 64, 0)
    assert not ok and "D = 128" in why
    for direction in ("lightning_indexer_scores", "lightning_indexer_scores_bwd", "forward"):
        ok, why = sm90.supports(fp8, direction, 100, 64, 100, 128, 0)
        assert not ok and "bfloat16 or float16" in why


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
