"""CPU-only: the SM90 kernels of ``lightning_indexer_scores`` (forward, backward, deterministic
backward) compile for sm_90a without a GPU, through ``mla_inductor.precompile``; their static
configuration fits the GPU; the sm90 backend takes both directions for the sizes it supports;
the deterministic backward's fixed-point scale keeps every sum inside 64 bits."""

from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("cutlass.cute")

import mla_inductor  # noqa: E402
from mla_inductor.kernels import sm90  # noqa: E402
from mla_inductor.kernels.sm90 import host  # noqa: E402
from mla_inductor.kernels.sm90.common import SMEM_LIMIT  # noqa: E402
from mla_inductor.kernels.sm90 import lightning_selected_slots as lightning_scores  # noqa: E402
from mla_inductor.kernels.sm90 import (  # noqa: E402
    lightning_selected_slots_host as lightning_scores_host)

DIRECTIONS = ("lightning_indexer_scores", "lightning_indexer_scores_bwd")


def test_precompile_compiles_the_forward_and_both_backwards(tmp_path):
    compiled = mla_inductor.precompile(
        arch="sm_90a", thresholds=(), backward_heads=(), indexer_heads=(), lightning_scores=True,
    )
    assert sorted(compiled, key=repr) == sorted([
        ("forward", "bfloat16", "sm_90a"),
        ("backward", "bfloat16", False, "sm_90a"),
        ("backward", "bfloat16", True, "sm_90a"),
    ], key=repr)
    for key in compiled:
        path = tmp_path / f"{key[0]}_{key[-2]}.o"
        compiled[key].export_to_c(object_file_path=str(path), function_name="scores")
        assert path.stat().st_size > 0
    again = lightning_scores_host.precompile_scores("sm_90a", deterministic=(True,))
    key = lightning_scores_host.backward_key(torch.bfloat16, True)
    assert again[key] is compiled[key]  # served from the cache


def test_fp16_compiles():
    compiled = lightning_scores_host.precompile_scores("sm_90a", dtypes=(torch.float16,),
                                                       deterministic=(False,))
    assert sorted(compiled, key=repr) == sorted(
        [("forward", "float16", "sm_90a"), ("backward", "float16", False, "sm_90a")], key=repr)


def test_default_precompile_skips_these_kernels():
    compiled = sm90.precompile("sm_90a", thresholds=(), backward_heads=(), indexer_heads=())
    assert not any(key[0] in ("forward", "backward") for key in compiled)


def test_rejected_configurations():
    from cutlass import BFloat16, Float32

    with pytest.raises(ValueError, match="^lightning_indexer_scores: .*sm_90a"):
        lightning_scores_host.precompile_scores("sm_100a")
    with pytest.raises(TypeError, match="^lightning_indexer_scores: .*bf16/fp16"):
        lightning_scores.LightningScoresForwardSm90(Float32)
    with pytest.raises(TypeError, match="^lightning_indexer_scores: .*bf16/fp16"):
        lightning_scores.LightningScoresBackwardSm90(Float32, False)
    assert lightning_scores.LightningScoresBackwardSm90(BFloat16, True).deterministic
    q = torch.zeros(1, 2, 4, 128, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="^lightning_indexer_scores: .*CUDA"):
        lightning_scores_host.check(q)


def test_two_ctas_fit_one_sm():
    from cutlass import BFloat16

    per_sm = 228 * 1024  # shared memory of one SM90 multiprocessor
    for config in (lightning_scores.LightningScoresForwardSm90(BFloat16),
                   lightning_scores.LightningScoresBackwardSm90(BFloat16, False)):
        assert config.smem_bytes() <= SMEM_LIMIT
        assert 2 * (config.smem_bytes() + 1024) <= per_sm  # + the per-CTA reservation
    assert lightning_scores.HEAD_TILE == host.LIGHTNING_MAX_HEADS
    assert lightning_scores.D == host.LIGHTNING_D


@pytest.mark.parametrize("direction", DIRECTIONS)
def test_supports(direction):
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
    dscores, q, w, idx, S = _scale_inputs()
    scale, inverse = lightning_scores_host.fixed_point_scale(dscores, q, w, idx, S)
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
    base = lightning_scores_host.fixed_point_scale(dscores, q, w, idx, S)
    poisoned = torch.where((idx >= 0) & (idx < S), dscores, math.nan)
    again = lightning_scores_host.fixed_point_scale(poisoned, q, w, idx, S)
    assert torch.equal(base[0], again[0]) and torch.equal(base[1], again[1])
    zero = lightning_scores_host.fixed_point_scale(torch.zeros_like(dscores), q, w, idx, S)
    assert float(zero[0]) == 2.0**126 and float(zero[1]) == 2.0**-126
    q[0, 0, 0] = math.inf
    _, inverse = lightning_scores_host.fixed_point_scale(dscores, q, w, idx, S)
    assert math.isnan(float(inverse))
