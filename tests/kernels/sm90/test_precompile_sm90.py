"""CPU-only: every SM90 kernel compiles for sm_90a without a GPU, and its static configuration
fits the GPU.

One parametrised test compiles each kernel family through ``mla_inductor.precompile`` (or its
launcher's ``precompile_*``): the compile keys are the ones asked for, one kernel exports to an
object file, and a second call is served from the cache (the very same objects). The rest, per
kernel, runs no compiler: the choice of tiles and configurations, what is refused, the shared
memory each configuration takes, the row sort's network and the fixed-point scales. The fp8
score kernels' PTX is also assembled by ptxas for sm_90a when ptxas is on PATH.
"""

from __future__ import annotations

import glob
import math
import re
import shutil
import subprocess
from typing import Callable, NamedTuple, Optional

import pytest
import torch

pytest.importorskip("cutlass.cute")

import mla_inductor  # noqa: E402
from mla_inductor.kernels import sm90  # noqa: E402
from mla_inductor.kernels.sm90 import (  # noqa: E402
    bwd_host, fwd_host, host, indexer_target_host, indexer_target_kernel, lightning_every_key,
    lightning_every_key_host, lightning_selected_slots, lightning_selected_slots_host, rowsort,
    rowsort_host, topk, topk_host)
from mla_inductor.kernels.sm90.common import SMEM_LIMIT, TORCH_TO_CUTE  # noqa: E402

ARCH = "sm_90a"
SELECT_KEYS = list(topk_host.tuned_keys())
FP8 = torch.float8_e4m3fn
NOTHING_ELSE = dict(thresholds=(), backward_heads=(), indexer_heads=())  # of the defaults


class Family(NamedTuple):
    """One compile case: ``compile()`` returns ``{key: fn}``; ``keys``, the keys it must hold
    (``exact``: and no other; ``ordered``: in this order); ``export``, keys whose kernels export
    to object files; ``again()``, a second call whose kernels must be the first call's objects
    (from the cache), one of ``export``'s among them."""

    compile: Callable[[], dict]
    keys: list
    exact: bool = True
    ordered: bool = False
    export: tuple = ()
    again: Optional[Callable[[], dict]] = None


def _backward(heads, d_qk, d_v, with_len, o_lo, evict, det, sink):
    return Family(
        lambda: bwd_host.precompile_backward(
            ARCH, dtypes=(torch.bfloat16,), heads=(heads,), d_qk=d_qk, d_v=d_v,
            topk_length=(with_len,), o_lo=(o_lo,), gather_evict_first=(evict,),
            deterministic=(det,), attn_sink=(sink,)),
        [("bfloat16", heads, d_qk, d_v, with_len, o_lo, False, False, False, evict, det, sink,
          ARCH),
         bwd_host.compile_key(torch.bfloat16, heads, d_qk, d_v, with_len, o_lo,
                              gather_evict_first=evict, deterministic=det, has_sink=sink)])


_SINK_FWD = fwd_host.compile_key(torch.bfloat16, 576, 512, 0.0, True, True, has_positions=True,
                                 has_sink=True, has_max_logits=True)
_SELECTED_SLOTS_KEYS = [("forward", "bfloat16", ARCH), ("backward", "bfloat16", False, ARCH),
                        ("backward", "bfloat16", True, ARCH)]
_LIGHTNING_KEYS = [(dtype, tile, causal, ARCH) for dtype in ("bfloat16", "float8_e4m3fn")
                   for tile in (16, 32, 64) for causal in (False, True)]
FAMILIES = {
    # the forward at both thresholds of the policy (the exact and the lazy max)
    "forward": Family(
        lambda: mla_inductor.precompile(arch=ARCH, thresholds=(0.0, 8.0), o_lo=(False,),
                                        topk_length=(False,), backward_heads=(), indexer_heads=()),
        [("bfloat16", 576, 512, t, False, False, False, False, False, ARCH) for t in (0.0, 8.0)],
        export=(("bfloat16", 576, 512, 8.0, False, False, False, False, False, ARCH),),
        again=lambda: sm90.precompile(ARCH, thresholds=(0.0, 8.0), o_lo=(False,),
                                      topk_length=(False,), backward_heads=(), indexer_heads=())),
    # causal, with a sink and max_logits: the epilogue's edge values (a +inf or NaN sink)
    "forward-sink": Family(lambda: {_SINK_FWD: fwd_host.get_kernel(_SINK_FWD)}, [_SINK_FWD],
                           again=lambda: {_SINK_FWD: fwd_host.get_kernel(_SINK_FWD)},
                           export=(_SINK_FWD,)),
    "backward": _backward(128, 576, 512, False, True, False, False, False),
    "backward-evict-first-sink-d512": _backward(72, 512, 512, True, False, True, False, True),
    "backward-deterministic-sink": _backward(128, 576, 512, True, True, False, True, True),
    # one kernel per padded row width and topk_length, every R and slot count
    "row-sort": Family(
        lambda: rowsort_host.precompile_sort(ARCH, topks=(640, 2048, 8192),
                                             topk_length=(False, True)),
        [(n, with_len, ARCH) for n in (1024, 2048, 8192) for with_len in (False, True)],
        export=((2048, True, ARCH),),
        again=lambda: rowsort_host.precompile_sort(ARCH, topks=(2000,), topk_length=(True,))),
    # the backward's precompile includes the sort its rows may need
    "backward-with-its-row-sort": Family(
        lambda: mla_inductor.precompile(arch=ARCH, thresholds=(), backward_heads=(64,),
                                        topk_length=(True,), indexer_heads=(),
                                        backward_topk=(512,)),
        [(512, True, ARCH)], exact=False),
    # one kernel per head tile x topk_length x positions
    "indexer-target": Family(
        lambda: mla_inductor.precompile(arch=ARCH, thresholds=(), backward_heads=(),
                                        indexer_heads=(16, 64, 128), topk_length=(False, True),
                                        indexer_positions=(True,)),
        [("bfloat16", 576, tile, with_len, True, ARCH) for tile in (64, 128)
         for with_len in (False, True)],
        export=(("bfloat16", 576, 128, True, True, ARCH),),
        again=lambda: indexer_target_host.precompile_target(ARCH, heads=(128,),
                                                            topk_length=(True,),
                                                            positions=(True,))),
    **{f"indexer-target-d512-{name}": Family(
        lambda dtype=dtype: indexer_target_host.precompile_target(
            ARCH, dtypes=(dtype,), d_qk=512, heads=(100,), topk_length=(False,),
            positions=(False,)),
        [(name, 512, 128, False, False, ARCH)])
       for name, dtype in (("bfloat16", torch.bfloat16), ("float16", torch.float16))},
    # the scores for every key: one kernel per dtype x head tile x causal, and the top-k
    # select's configurations with them
    "lightning-every-key": Family(
        lambda: mla_inductor.precompile(arch=ARCH, **NOTHING_ELSE, lightning_heads=(8, 32, 64),
                                        lightning_causal=(False, True)),
        _LIGHTNING_KEYS[:6] + SELECT_KEYS,
        export=(("bfloat16", 64, True, ARCH),),
        again=lambda: lightning_every_key_host.precompile_scores(ARCH, heads=(64,),
                                                                 causal=(True,))),
    "lightning-every-key-float16": Family(
        lambda: lightning_every_key_host.precompile_scores(ARCH, dtypes=(torch.float16,),
                                                           heads=(20,), causal=(False,)),
        [("float16", 32, False, ARCH)]),
    "lightning-every-key-float8_e4m3fn": Family(
        lambda: mla_inductor.precompile(arch=ARCH, **NOTHING_ELSE, lightning_heads=(8, 32, 64),
                                        lightning_causal=(False, True), lightning_dtypes=(FP8,)),
        _LIGHTNING_KEYS[6:] + SELECT_KEYS),
    # the scores at the selected slots: the forward and both backwards
    "lightning-selected-slots": Family(
        lambda: mla_inductor.precompile(arch=ARCH, **NOTHING_ELSE, lightning_scores=True),
        _SELECTED_SLOTS_KEYS, export=tuple(_SELECTED_SLOTS_KEYS),
        again=lambda: lightning_selected_slots_host.precompile_scores(ARCH,
                                                                      deterministic=(True,))),
    "lightning-selected-slots-float16": Family(
        lambda: lightning_selected_slots_host.precompile_scores(ARCH, dtypes=(torch.float16,),
                                                                deterministic=(False,)),
        [("forward", "float16", ARCH), ("backward", "float16", False, ARCH)]),
    # one kernel for every R, ld and topk, per tuned configuration (the default, then the
    # short rows')
    "top-k-select": Family(
        lambda: topk_host.precompile_select(ARCH), SELECT_KEYS, ordered=True,
        export=(topk_host.compile_key(),),
        again=lambda: topk_host.precompile_select(ARCH)),
}
SLOW = {"backward", "backward-evict-first-sink-d512", "backward-deterministic-sink"}


@pytest.mark.parametrize("family", [
    pytest.param(name, marks=[pytest.mark.slow] if name in SLOW else []) for name in FAMILIES])
def test_precompile(family, tmp_path):
    case = FAMILIES[family]
    compiled = case.compile()
    if case.ordered:
        assert list(compiled) == case.keys
    elif case.exact:
        assert sorted(compiled, key=repr) == sorted(set(case.keys), key=repr)
    else:
        assert set(case.keys) <= set(compiled)
    assert all(callable(fn) for fn in compiled.values())
    for n, key in enumerate(case.export):
        path = tmp_path / f"kernel{n}.o"
        compiled[key].export_to_c(object_file_path=str(path), function_name=f"kernel{n}")
        assert path.stat().st_size > 0
    if case.again is not None:
        again = case.again()
        assert set(case.export) & set(again)
        assert all(again[key] is compiled[key] for key in again)  # served from the cache


def test_the_two_thresholds_are_two_kernels(tmp_path):
    compiled = FAMILIES["forward"].compile()
    (key_exact, exact), (key_lazy, lazy) = sorted(compiled.items(), key=lambda kv: kv[0][3])
    assert exact is not lazy
    objects = []
    for name, fn in (("exact", exact), ("lazy", lazy)):
        path = tmp_path / f"{name}.o"
        fn.export_to_c(object_file_path=str(path), function_name=f"fwd_{name}")
        objects.append(path.read_bytes())
    assert objects[0] != objects[1]


def test_the_default_precompile_skips_the_optional_kernels():
    compiled = sm90.precompile(ARCH, **NOTHING_ELSE)
    assert not any(key[0] in ("forward", "backward") for key in compiled)  # selected slots
    assert not any(lightning_every_key_host.compile_key(torch.bfloat16, tile, causal) in compiled
                   for tile in (16, 32, 64) for causal in (False, True))


def test_other_archs_are_refused():
    for precompile in (sm90.precompile, fwd_host.precompile_forward, bwd_host.precompile_backward,
                       indexer_target_host.precompile_target,
                       lightning_every_key_host.precompile_scores, rowsort_host.precompile_sort,
                       topk_host.precompile_select):
        with pytest.raises(ValueError, match="sm_90a"):
            precompile("sm_100a")
    with pytest.raises(ValueError, match="^lightning_indexer_scores: .*sm_90a"):
        lightning_selected_slots_host.precompile_scores("sm_100a")


def test_disk_cache_round_trip(tmp_path, monkeypatch):
    """A compiled kernel is exported to the disk cache and loaded back, also without a GPU."""
    from mla_inductor.kernels.cache import DISK_CACHE_ENV, KernelCache
    from mla_inductor.kernels.sm90 import common, fwd

    monkeypatch.setenv(DISK_CACHE_ENV, str(tmp_path))
    key = fwd_host.compile_key(torch.bfloat16, 512, 512, 8.0, False, False)
    with common.target_arch(ARCH):
        built = KernelCache("t").get(key, lambda: fwd.compile_forward(*key[:-1]))
        files = list(tmp_path.rglob("*.o"))
        assert len(files) == 1 and files[0].stat().st_size > 0
        loaded = KernelCache("t").get(key, lambda: pytest.fail("should load from disk"))
    assert loaded is not built and callable(loaded)


# -------------------------------------------------------------------------------------- the forward


@pytest.mark.parametrize("dtype,bound", [("float16", 15.0), ("bfloat16", 64.0)])
def test_threshold_that_overflows_p_is_rejected(dtype, bound):
    """The kernel takes the op's bounds (below 15 in float16, 64 in bfloat16), no wider."""
    from mla_inductor.kernels.sm90.fwd import SparseMlaFwdSm90

    cute_dtype = TORCH_TO_CUTE[dtype]
    below = SparseMlaFwdSm90(cute_dtype, 576, 512, bound - 0.5, False, False)
    assert below.threshold == bound - 0.5
    for threshold in (bound, bound + 1.0, -1.0):
        with pytest.raises(ValueError, match="overflow"):
            SparseMlaFwdSm90(cute_dtype, 576, 512, threshold, False, False)


# ------------------------------------------------------------------------------------- the backward


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


# ------------------------------------------------------------------------------------- the row sort


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


def test_row_sort_refuses_bad_widths():
    with pytest.raises(ValueError, match="sparse_mla: .*power of two"):
        rowsort.RowSortSm90(3000, False)
    with pytest.raises(ValueError, match="sparse_mla: .*power of two"):
        rowsort.RowSortSm90(16384, False)
    with pytest.raises(ValueError, match="sparse_mla: .*power of two"):
        rowsort.RowSortSm90(128, False)  # fewer than two slots a thread
    with pytest.raises(ValueError, match="sparse_mla: .*8192"):
        rowsort_host.precompile_sort(ARCH, topks=(8193,))


# ------------------------------------------------------------------------------- the indexer target


@pytest.mark.parametrize("heads,tile", [(1, 64), (64, 64), (65, 128), (128, 128)])
def test_indexer_target_head_tiles(heads, tile):
    assert indexer_target_host.tile_heads_for(heads) == tile


def test_indexer_target_refuses():
    from cutlass import BFloat16, Float32

    with pytest.raises(ValueError,
                       match="indexer_target: the sm90 indexer target supports 1 to 128"):
        indexer_target_host.tile_heads_for(129)
    with pytest.raises(ValueError, match="d_qk in"):
        indexer_target_kernel.IndexerTargetSm90(BFloat16, 256, 128, False, False)
    with pytest.raises(TypeError, match="bf16/fp16"):
        indexer_target_kernel.IndexerTargetSm90(Float32, 576, 128, False, False)


def test_indexer_target_ring_fits_next_to_q():
    """The key ring holds at most two blocks and fits the 227 KiB of shared memory with Q."""
    from cutlass import BFloat16

    for d_qk, tile, ring in ((576, 128, 10), (576, 64, 18), (512, 128, 12), (512, 64, 16)):
        config = indexer_target_kernel.IndexerTargetSm90(BFloat16, d_qk, tile, False, False)
        assert config.ring == ring
        assert config._smem_bytes() <= SMEM_LIMIT


# ---------------------------------------------------------------------------- the lightning indexer


def _ptx(dtype_name: str, head_tile: int, causal: bool, folder) -> str:
    """The PTX of one score kernel, compiled now (not from the kernel cache) for sm_90a."""
    from cutlass.cutlass_dsl import CuTeDSL

    from mla_inductor.kernels.sm90.common import target_arch

    envar = CuTeDSL._get_dsl().envar
    previous = envar.keep_ptx, envar.dump_dir
    envar.keep_ptx, envar.dump_dir = True, str(folder)
    try:
        with target_arch(ARCH):
            lightning_every_key.compile_scores(dtype_name, head_tile, causal)
    finally:
        envar.keep_ptx, envar.dump_dir = previous
    (path,) = glob.glob(str(folder / "*.ptx"))
    with open(path) as f:
        return f.read()


@pytest.mark.skipif(shutil.which("ptxas") is None, reason="ptxas not on PATH")
@pytest.mark.parametrize("tile,causal", [(64, True), (16, False)])
def test_fp8_ptx_assembles_without_spills(tmp_path, tile, causal):
    """The fp8 score kernel's PTX is assembled by ptxas for sm_90a: no register spills, and the
    wgmmas are e4m3 m64n128k32 (each block's product in two pieces), with m64n144k32 for the
    second piece at head tile 64 (the linear term's columns). The cases: the most weights per
    thread (head tile 64: 16 per token, and the linear term's 8 more accumulators) and the most
    partial sums (16: 16 tokens x 2 rows) next to the 128 accumulators."""
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


@pytest.mark.parametrize("heads,tile,tokens", [(1, 16, 16), (16, 16, 16), (17, 32, 8),
                                               (32, 32, 8), (33, 64, 4), (64, 64, 4)])
def test_lightning_head_tiles(heads, tile, tokens):
    assert lightning_every_key_host.head_tile_for(heads) == tile
    assert lightning_every_key_host.tokens_per_tile(heads) == tokens


def test_lightning_refuses():
    from cutlass import BFloat16, Float32

    for heads in (0, 65):
        with pytest.raises(ValueError, match="lightning_indexer: the sm90 kernel supports 1 to "):
            lightning_every_key_host.head_tile_for(heads)
    with pytest.raises(ValueError, match="head tile in"):
        lightning_every_key.LightningScoresSm90(BFloat16, 128, False)
    with pytest.raises(TypeError, match="bf16/fp16 and float8_e4m3fn"):
        lightning_every_key.LightningScoresSm90(Float32, 64, False)


def test_lightning_shared_memory_fits():
    from cutlass import BFloat16, Float8E4M3FN

    for dtype in (BFloat16, Float8E4M3FN):
        for tile in (16, 32, 64):
            config = lightning_every_key.LightningScoresSm90(dtype, tile, True)
            assert config.tokens * tile == 256
            assert config._smem_bytes() <= SMEM_LIMIT
    fp8 = lightning_every_key.LightningScoresSm90(Float8E4M3FN, 64, True)
    assert (fp8.q_bytes, fp8.block_bytes, fp8.n_chunks, fp8.mma_k) == (32768, 8192, 1, 32)


def test_lightning_supports():
    ok, _ = sm90.supports(torch.bfloat16, "lightning_indexer", 100, 64, 100, 128, 0,
                          frozenset({"causal"}))
    assert ok
    ok, why = sm90.supports(torch.float16, "lightning_indexer", 100, 65, 100, 128, 0)
    assert not ok and "1 to 64 index heads" in why
    ok, why = sm90.supports(torch.bfloat16, "lightning_indexer", 100, 64, 100, 64, 0)
    assert not ok and "D = 128" in why
    ok, why = sm90.supports(torch.float32, "lightning_indexer", 100, 64, 100, 128, 0)
    assert not ok
    assert sm90.supports(FP8, "lightning_indexer", 100, 64, 100, 128, 0, frozenset({"causal"}))[0]
    assert sm90.supports(FP8, "lightning_indexer", 100, 1, 100, 128, 0)[0]
    ok, why = sm90.supports(FP8, "lightning_indexer", 100, 65, 100, 128, 0)
    assert not ok and "1 to 64 index heads" in why
    ok, why = sm90.supports(FP8, "lightning_indexer", 100, 64, 100, 64, 0)
    assert not ok and "D = 128" in why
    for direction in ("lightning_indexer_scores", "lightning_indexer_scores_bwd", "forward"):
        ok, why = sm90.supports(FP8, direction, 100, 64, 100, 128, 0)
        assert not ok and "bfloat16 or float16" in why


@pytest.mark.parametrize("n_tiles,S,expect", [
    (4096, 16384, (1, 256)),  # enough token tiles: no split
    (1, 8192, (16, 8)),  # one tile: 128 blocks in 16 ranges of 8 (at most 2 x 132 CTAs)
    (1, 64, (1, 1)),  # fewer than 8 blocks: no split
    (100, 20000, (3, 105)),
])
def test_lightning_key_split(n_tiles, S, expect):
    splits, per = lightning_every_key_host.key_split(n_tiles, S, 132)
    assert (splits, per) == expect
    n_kb = -(-S // 64)
    assert splits * per >= n_kb > (splits - 1) * per


def test_lightning_chunks_cover_rows_in_order():
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


# --------------------------------------------------------------------------------- the top-k select


def test_top_k_select_refuses():
    with pytest.raises(ValueError, match="lightning_indexer: .*threads"):
        topk.TopkSelectSm90(384, 16384, 1024, 1)
    with pytest.raises(ValueError, match="lightning_indexer: .*threads"):
        topk.TopkSelectSm90(256, 1000, 1024, 1)  # the cache is not whole tiles
    with pytest.raises(ValueError, match="lightning_indexer: .*shared memory"):
        topk.TopkSelectSm90(512, 65536, 1024, 1)


@pytest.mark.parametrize("config", topk_host.TUNED_CONFIGS)
def test_top_k_configurations_fit_their_occupancy(config):
    """Each configuration's shared memory lets ``min_blocks`` CTAs share an SM (228 KiB, 1 KiB
    reserved per CTA), and its threads' registers fit the SM's 65536 at 64 a thread."""
    threads, _, _, min_blocks = config
    assert min_blocks * (topk.TopkSelectSm90(*config)._smem_bytes() + 1024) <= 228 * 1024
    assert min_blocks * threads * 64 <= 65536


def test_top_k_default_key_by_row_length():
    short = topk_host.compile_key(*topk_host.SHORT_CONFIG)
    assert topk_host.default_key(1) == topk_host.default_key(topk_host.SHORT_MAX_LEN) == short
    assert topk_host.default_key(topk_host.SHORT_MAX_LEN + 4) == topk_host.compile_key()
    assert topk_host.compile_key() == (topk_host.NUM_THREADS, topk_host.CACHE_ELEMS,
                                       topk_host.CAND_ELEMS, topk_host.MIN_BLOCKS, ARCH)


# ----------------------------------------------------------------- the scores at the selected slots


def test_selected_slots_refuse():
    from cutlass import BFloat16, Float32

    with pytest.raises(TypeError, match="^lightning_indexer_scores: .*bf16/fp16"):
        lightning_selected_slots.LightningScoresForwardSm90(Float32)
    with pytest.raises(TypeError, match="^lightning_indexer_scores: .*bf16/fp16"):
        lightning_selected_slots.LightningScoresBackwardSm90(Float32, False)
    assert lightning_selected_slots.LightningScoresBackwardSm90(BFloat16, True).deterministic


def test_selected_slots_two_ctas_fit_one_sm():
    from cutlass import BFloat16

    per_sm = 228 * 1024  # shared memory of one SM90 multiprocessor
    for config in (lightning_selected_slots.LightningScoresForwardSm90(BFloat16),
                   lightning_selected_slots.LightningScoresBackwardSm90(BFloat16, False)):
        assert config.smem_bytes() <= SMEM_LIMIT
        assert 2 * (config.smem_bytes() + 1024) <= per_sm  # + the per-CTA reservation
    assert lightning_selected_slots.HEAD_TILE == host.LIGHTNING_MAX_HEADS
    assert lightning_selected_slots.D == host.LIGHTNING_D


@pytest.mark.parametrize("direction", ["lightning_indexer_scores", "lightning_indexer_scores_bwd"])
def test_selected_slots_supports(direction):
    assert sm90.supports(torch.bfloat16, direction, 100, 64, 100, 128, 0) == (True, "")
    assert sm90.supports(torch.float16, direction, 0, 1, 0, 128, 0) == (True, "")
    ok, why = sm90.supports(torch.float16, direction, 100, 65, 100, 128, 0)
    assert not ok and why == f"sm90 {direction} supports 1 to 64 index heads, got 65"
    ok, why = sm90.supports(torch.bfloat16, direction, 100, 64, 100, 64, 0)
    assert not ok and "D = 128" in why
    assert not sm90.supports(torch.float32, direction, 100, 64, 100, 128, 0)[0]
    assert callable(getattr(sm90, direction))


def _scale_inputs(R=6, H=5, topk=7, S=9, seed=0):
    g = torch.Generator().manual_seed(seed)
    dscores = torch.randn(R, topk, generator=g)
    q = torch.randn(R, H, 128, generator=g).to(torch.bfloat16)
    w = torch.randn(R, H, generator=g)
    idx = torch.randint(-2, S + 2, (R, topk), generator=g, dtype=torch.int32)
    return dscores, q, w, idx, S


def test_fixed_point_scale_bounds_every_sum():
    """The deterministic backward's fixed-point scale keeps every sum inside 64 bits."""
    dscores, q, w, idx, S = _scale_inputs()
    scale, inverse = lightning_selected_slots_host.fixed_point_scale(dscores, q, w, idx, S)
    assert scale.dtype == torch.float32 and scale.shape == (1,)
    assert inverse.dtype == torch.float64 and float(inverse) * float(scale) == 1.0
    valid = (idx >= 0) & (idx < S)
    R, H = w.shape
    bound = (R * idx.shape[1] * H * dscores[valid].abs().max().double()
             * w.abs().max().double() * q.abs().max().double())
    e = math.log2(float(scale))
    assert e == int(e)
    assert float(bound) * float(scale) <= 2.0**61 < float(bound) * float(scale) * 2


def test_fixed_point_scale_ignores_empty_slots_and_flags_non_finite_inputs():
    dscores, q, w, idx, S = _scale_inputs(seed=1)
    fixed_point_scale = lightning_selected_slots_host.fixed_point_scale
    base = fixed_point_scale(dscores, q, w, idx, S)
    poisoned = torch.where((idx >= 0) & (idx < S), dscores, math.nan)
    again = fixed_point_scale(poisoned, q, w, idx, S)
    assert torch.equal(base[0], again[0]) and torch.equal(base[1], again[1])
    zero = fixed_point_scale(torch.zeros_like(dscores), q, w, idx, S)
    assert float(zero[0]) == 2.0**126 and float(zero[1]) == 2.0**-126
    q[0, 0, 0] = math.inf
    _, inverse = fixed_point_scale(dscores, q, w, idx, S)
    assert math.isnan(float(inverse))
