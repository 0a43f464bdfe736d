"""mla_inductor.integrations.transformers_indexer: the indexer's top-k in query chunks against
transformers 5.24's own ``DeepseekV32Indexer`` / ``GlmMoeDsaIndexer`` (the same module, called as
the model calls it), tiny random-init configs, float32, CPU.

On the CPU each chunk multiplies the same per-token matrices as the model's indexer (``q[t]``
``[H, D]`` by the keys ``[D, S]``), with the same kernels, so the scores are bitwise the model's
and the indices are compared exactly: order and ties included (many keys tie at score 0, where
every head's relu is 0, and fully masked rows tie at -inf; equal rows break ties alike)."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import DeepseekV32Config, DynamicCache, GlmMoeDsaConfig
from transformers.models.deepseek_v32 import modeling_deepseek_v32 as dsv32
from transformers.models.glm_moe_dsa import modeling_glm_moe_dsa as glm

from mla_inductor.integrations import transformers_indexer as ti

# The indexer's widths of tests/test_transformers.py's TINY (index_topk 16, 2 heads of 16, rope 8).
SIZES = dict(hidden_size=64, q_lora_rank=32, qk_rope_head_dim=8, index_topk=16, index_head_dim=16,
             index_n_heads=2, num_hidden_layers=1, max_position_embeddings=256)
# Per model: its config, indexer and rotary classes and the RoPE its indexer applies.
MODELS = {
    "deepseek_v32": (DeepseekV32Config, dsv32.DeepseekV32Indexer, dsv32.DeepseekV32RotaryEmbedding,
                     dsv32.apply_rotary_pos_emb),
    "glm_moe_dsa": (GlmMoeDsaConfig, glm.GlmMoeDsaIndexer, glm.GlmMoeDsaRotaryEmbedding,
                    glm.apply_rotary_pos_emb_interleave),
}


def _indexer(name: str, **sizes):
    """``(indexer, rope, rotary)`` for ``name``: a seeded random-init indexer of layer 0."""
    config_cls, indexer_cls, rotary_cls, rope = MODELS[name]
    config = config_cls(**{**SIZES, **sizes})
    torch.manual_seed(0)
    return indexer_cls(config, layer_idx=0), rope, rotary_cls(config)


def _inputs(indexer, rotary, B: int, T: int, pad: int, bool_mask: bool):
    """``(hidden_states, q_resid, position_embeddings, mask [B, T, T], position_ids)``: seeded
    N(0, 1) inputs at positions 0..T-1, the causal mask with row 1 left-padded by ``pad`` tokens,
    bool (True = seen) or additive float32 (0 / the dtype's minimum) as the models build them."""
    gen = torch.Generator().manual_seed(T)
    x = torch.randn(B, T, indexer.hidden_size, generator=gen)
    q_resid = torch.randn(B, T, indexer.q_lora_rank, generator=gen)
    pos = torch.arange(T)[None].expand(B, T)
    seen = torch.ones(T, T, dtype=torch.bool).tril().repeat(B, 1, 1)
    seen[1:, :, :pad] = False
    hidden = torch.zeros(B, T, T).masked_fill(~seen, torch.finfo(torch.float32).min)
    return x, q_resid, rotary(x, pos), seen if bool_mask else hidden, pos


@pytest.mark.parametrize("bool_mask", [True, False], ids=["bool", "float"])
@pytest.mark.parametrize("chunk", [1, 7, None], ids=["chunk1", "chunk7", "one_chunk"])
@pytest.mark.parametrize("name", MODELS)
def test_topk_equals_the_models_indexer(name, chunk, bool_mask):
    """A batch of 2 over T 100 (7 does not divide it; row 1 left-padded by 10 tokens), and T 8 <
    index_topk (top-8 of 8 keys)."""
    indexer, rope, rotary = _indexer(name)
    for B, T in ((2, 100), (1, 8)):
        x, q_resid, pe, mask, pos = _inputs(indexer, rotary, B, T, pad=10, bool_mask=bool_mask)
        budget = None if chunk is None else chunk * indexer.n_heads * T * 4
        per_chunk = ti.chunk_tokens(indexer.n_heads, T, budget or ti.SCORE_BYTES)
        assert per_chunk == chunk if chunk else per_chunk >= T
        ours = ti.indexer_topk(indexer, rope, x, q_resid, pe, mask, score_bytes=budget)
        ref = indexer(x, q_resid, pe, mask, pos)
        assert ours.dtype == torch.int32 and ours.shape == (B, T, min(16, T))
        assert torch.equal(ours, ref)


@pytest.mark.parametrize("chunk", [1, 7], ids=["chunk1", "chunk7"])
@pytest.mark.parametrize("name", MODELS)
def test_topk_with_a_cache_equals_the_models_indexer(name, chunk):
    """A 40-token prefill then 4 single-token steps over a left-padded batch of 2, each side with
    its own ``DynamicCache``: at every step the same indices, and the same cached indexer keys."""
    indexer, rope, rotary = _indexer(name)
    x, q_resid, pe, mask, pos = _inputs(indexer, rotary, 2, 44, pad=7, bool_mask=False)
    caches = [DynamicCache(config=indexer.config) for _ in range(2)]
    for t0, t1 in ((0, 40), (40, 41), (41, 42), (42, 43), (43, 44)):
        step = (x[:, t0:t1], q_resid[:, t0:t1], tuple(r[:, t0:t1] for r in pe), mask[:, t0:t1, :t1])
        ref = indexer(*step, pos[:, t0:t1], cache=caches[0])
        ours = ti.indexer_topk(indexer, rope, *step, caches[1], score_bytes=chunk * 2 * t1 * 4)
        assert ours.shape == (2, t1 - t0, 16)
        assert torch.equal(ours, ref)
    assert torch.equal(caches[1].layers[0].indexer_keys, caches[0].layers[0].indexer_keys)
    assert caches[1].layers[0].indexer_keys.shape == (2, 44, 16)


def test_the_indexers_rope_decides():
    """GLM's indexer rotates interleaved pairs, DeepSeek's the two halves: with the other model's
    RoPE the top-k differs (the comparison above can tell them apart)."""
    indexer, rope, rotary = _indexer("glm_moe_dsa")
    x, q_resid, pe, mask, pos = _inputs(indexer, rotary, 2, 100, pad=10, bool_mask=True)
    ref = indexer(x, q_resid, pe, mask, pos)
    assert torch.equal(ti.indexer_topk(indexer, rope, x, q_resid, pe, mask), ref)
    other = ti.indexer_topk(indexer, dsv32.apply_rotary_pos_emb, x, q_resid, pe, mask)
    assert not torch.equal(other, ref)


class _LargestFloat32(TorchDispatchMode):
    """Records the size in bytes of the largest float32 tensor any op returns."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.dtype == torch.float32:
                self.largest = max(self.largest, t.numel() * 4)
        return out


@pytest.mark.parametrize("name", MODELS)
def test_scores_stay_within_the_budget(name):
    """16 index heads, T = S = 256, a 64 KiB budget (4 tokens per chunk): the model's indexer
    makes float32 tensors of ``[1, T, 16, S]`` (4 MiB) and more; ours none larger than its
    queries ``[1, T, 16, 16]`` (256 KiB), and the same top-k."""
    indexer, rope, rotary = _indexer(name, index_n_heads=16)
    T = 256
    x, q_resid, pe, mask, pos = _inputs(indexer, rotary, 1, T, pad=0, bool_mask=True)
    with _LargestFloat32() as theirs:
        ref = indexer(x, q_resid, pe, mask, pos)
    with _LargestFloat32() as ours:
        got = ti.indexer_topk(indexer, rope, x, q_resid, pe, mask, score_bytes=2**16)
    assert torch.equal(got, ref)
    assert theirs.largest >= T * 16 * T * 4
    assert ours.largest == T * 16 * 16 * 4

