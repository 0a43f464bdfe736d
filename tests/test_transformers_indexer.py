"""mla_inductor.integrations.transformers_indexer: the indexer's top-k in query chunks against a
float64 computation of transformers 5.24's ``DeepseekV32Indexer`` / ``GlmMoeDsaIndexer`` definition
(from a float64 copy of the same module's submodules and the model's RoPE function), tiny
random-init configs, float32, CPU.

The chunked indexer is not bitwise transformers' (its GEMMs differ), so at a near-tie it may keep
the other key, and many keys tie exactly at score 0 (every head's relu 0): each row's selection is
checked by what stays true (:func:`_problems`): the selected keys the row sees, in the order
returned, have the float64 scores of the float64 top-k within a tight tolerance; exactly
``min(index_topk, visible)`` of them, first; the rest of the row names distinct keys the mask
hides. transformers' own indices pass the same check, and a wrong RoPE fails it."""

from __future__ import annotations

import copy

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
# A selected key's float64 score may differ from the float64 top-k's at its rank by this much,
# relative to the row's largest head-weighted term (float32 rounding is about 1e-7 of it).
TOL = 1e-6


def _indexer(name: str, **sizes):
    """``(indexer, rope, rotary)`` for ``name``: a seeded random-init indexer of layer 0."""
    config_cls, indexer_cls, rotary_cls, rope = MODELS[name]
    config = config_cls(**{**SIZES, **sizes})
    torch.manual_seed(0)
    return indexer_cls(config, layer_idx=0), rope, rotary_cls(config)


def _inputs(indexer, rotary, B: int, T: int, pad: int, bool_mask: bool):
    """``(hidden_states, q_resid, position_embeddings, mask [B, T, T], position_ids)``: seeded
    N(0, 1) inputs at positions 0..T-1, the causal mask with rows 1.. left-padded by ``pad``
    tokens (their first ``pad`` query rows see nothing), bool (True = seen) or additive float32
    (0 / the dtype's minimum) as the models build them."""
    gen = torch.Generator().manual_seed(T)
    x = torch.randn(B, T, indexer.hidden_size, generator=gen)
    q_resid = torch.randn(B, T, indexer.q_lora_rank, generator=gen)
    pos = torch.arange(T)[None].expand(B, T)
    seen = torch.ones(T, T, dtype=torch.bool).tril().repeat(B, 1, 1)
    seen[1:, :, :pad] = False
    hidden = torch.zeros(B, T, T).masked_fill(~seen, torch.finfo(torch.float32).min)
    return x, q_resid, rotary(x, pos), seen if bool_mask else hidden, pos


def _reference(indexer, rope, x, q_resid, pe, mask):
    """The indexer's definition in float64, written independently of the package from a float64
    copy of ``indexer``'s own submodules: ``(score [B, T, S] (-inf where the mask hides the key),
    seen [B, T, S] bool, bound [B, T])``, ``score[t, s] = sum_h w[t, h] · relu(softmax_scale ·
    q[t, h] · k[s])``, ``bound[t]`` the largest ``sum_h |w[t, h] · softmax_scale · q[t, h] · k[s]|``
    over the keys (the scale of the row's float32 rounding). Keys of all ``T`` positions
    (``S = T``)."""
    m = copy.deepcopy(indexer).double()
    B, T, _ = x.shape
    H, D, rot = m.n_heads, m.head_dim, m.qk_rope_head_dim
    q = m.wq_b(q_resid.double()).view(B, T, H, D)
    k = m.k_norm(m.wk(x.double()))[:, :, None]
    q_rot, k_rot = rope(q[..., :rot], k[..., :rot], *(p.double() for p in pe), unsqueeze_dim=2)
    q, k = torch.cat((q_rot, q[..., rot:]), -1), torch.cat((k_rot, k[..., rot:]), -1)[:, :, 0]
    w = m.weights_proj(x.double()) * H**-0.5
    dots = torch.einsum("bthd,bsd->bths", q, k) * m.softmax_scale
    score = torch.einsum("bth,bths->bts", w, dots.relu())
    bound = torch.einsum("bth,bths->bts", w.abs(), dots.abs()).amax(-1)
    seen = mask if mask.dtype == torch.bool else mask > torch.finfo(mask.dtype).min
    seen = seen.expand(B, T, T)
    return score.masked_fill(~seen, float("-inf")), seen, bound


def _problems(indices, score, seen, bound, topk: int) -> list[str]:
    """What is wrong with ``indices [B, T, k]`` as the top-``topk`` of float64 ``score [B, T, S]``
    (:func:`_reference`, its ``seen`` and ``bound``): an empty list if nothing. Per row: ``k =
    min(topk, S)`` slots of distinct keys in ``[0, S)``; the first ``n = min(topk, keys seen)``
    name seen keys whose scores, in the order given, are the float64 top-n's within ``TOL ·
    bound``; the others name keys the row does not see."""
    B, T, S = score.shape
    found = []
    if indices.shape != (B, T, min(topk, S)) or indices.dtype != torch.int32:
        return [f"shape {tuple(indices.shape)} dtype {indices.dtype}"]
    idx = indices.long()
    if idx.min() < 0 or idx.max() >= S:
        return ["an index outside [0, S)"]
    for b in range(B):
        for t in range(T):
            row, n = idx[b, t], min(topk, int(seen[b, t].sum()))
            if row.unique().numel() != row.numel():
                found.append(f"row {b, t}: a key named twice")
            if not (seen[b, t, row[:n]].all() and not seen[b, t, row[n:]].any()):
                found.append(f"row {b, t}: not {n} seen keys then hidden ones")
                continue
            best = score[b, t].topk(n).values
            worst = (score[b, t, row[:n]] - best).abs().max().item() if n else 0.0
            if worst > TOL * bound[b, t].item():
                found.append(f"row {b, t}: scores off by {worst:.3g} (bound {bound[b, t]:.3g})")
    return found


@pytest.mark.parametrize("bool_mask", [True, False], ids=["bool", "float"])
@pytest.mark.parametrize("chunk", [1, 7, None], ids=["chunk1", "chunk7", "one_chunk"])
@pytest.mark.parametrize("name", MODELS)
def test_topk_matches_the_float64_definition(name, chunk, bool_mask):
    """A batch of 2 over T 100 (7 does not divide it; row 1 left-padded by 10 tokens, so its
    first 10 query rows see nothing and a 7-token chunk there sees no key at all; rows 0-14 see
    fewer keys than index_topk 16), and T 8 < index_topk (top-8 of 8 keys). transformers' own
    indices pass the same check."""
    indexer, rope, rotary = _indexer(name)
    for B, T in ((2, 100), (1, 8)):
        x, q_resid, pe, mask, pos = _inputs(indexer, rotary, B, T, pad=10, bool_mask=bool_mask)
        budget = None if chunk is None else chunk * indexer.n_heads * T * 4
        per_chunk = ti.chunk_tokens(indexer.n_heads, T, budget or ti.SCORE_BYTES)
        assert per_chunk == chunk if chunk else per_chunk >= T
        ours = ti.indexer_topk(indexer, rope, x, q_resid, pe, mask, score_bytes=budget)
        ref = _reference(indexer, rope, x, q_resid, pe, mask)
        assert _problems(ours, *ref, topk=16) == []
        assert _problems(indexer(x, q_resid, pe, mask, pos), *ref, topk=16) == []


@pytest.mark.parametrize("chunk", [1, 7], ids=["chunk1", "chunk7"])
@pytest.mark.parametrize("name", MODELS)
def test_topk_with_a_cache(name, chunk):
    """A 40-token prefill then 4 single-token steps over a left-padded batch of 2, each side with
    its own ``DynamicCache``: at every step the float64 check over every cached key, and the same
    cached indexer keys as the model's indexer writes."""
    indexer, rope, rotary = _indexer(name)
    x, q_resid, pe, mask, pos = _inputs(indexer, rotary, 2, 44, pad=7, bool_mask=False)
    score, seen, bound = _reference(indexer, rope, x, q_resid, pe, mask)
    caches = [DynamicCache(config=indexer.config) for _ in range(2)]
    for t0, t1 in ((0, 40), (40, 41), (41, 42), (42, 43), (43, 44)):
        step = (x[:, t0:t1], q_resid[:, t0:t1], tuple(r[:, t0:t1] for r in pe), mask[:, t0:t1, :t1])
        indexer(*step, pos[:, t0:t1], cache=caches[0])
        ours = ti.indexer_topk(indexer, rope, *step, caches[1], score_bytes=chunk * 2 * t1 * 4)
        rows = (score[:, t0:t1, :t1], seen[:, t0:t1, :t1], bound[:, t0:t1])
        assert ours.shape == (2, t1 - t0, 16)
        assert _problems(ours, *rows, topk=16) == []
    assert torch.equal(caches[1].layers[0].indexer_keys, caches[0].layers[0].indexer_keys)
    assert caches[1].layers[0].indexer_keys.shape == (2, 44, 16)


def test_the_indexers_rope_decides():
    """GLM's indexer rotates interleaved pairs, DeepSeek's the two halves: with the other model's
    RoPE the float64 check fails (it can tell them apart)."""
    indexer, rope, rotary = _indexer("glm_moe_dsa")
    x, q_resid, pe, mask, pos = _inputs(indexer, rotary, 2, 100, pad=10, bool_mask=True)
    ref = _reference(indexer, rope, x, q_resid, pe, mask)
    assert _problems(ti.indexer_topk(indexer, rope, x, q_resid, pe, mask), *ref, topk=16) == []
    other = ti.indexer_topk(indexer, dsv32.apply_rotary_pos_emb, x, q_resid, pe, mask)
    assert len(_problems(other, *ref, topk=16)) > 100


class _Record(TorchDispatchMode):
    """Records the size in bytes of the largest float32 tensor any op returns, and the shape of
    every ``aten.mm`` output of ``mm_rows`` rows (a chunk's scores; not the projections')."""

    def __init__(self, mm_rows: int = 0):
        super().__init__()
        self.largest, self.mm, self.mm_rows = 0, [], mm_rows

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.aten.mm.default and out.shape[0] == self.mm_rows:
            self.mm.append(tuple(out.shape))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.dtype == torch.float32:
                self.largest = max(self.largest, t.numel() * 4)
        return out


@pytest.mark.parametrize("name", MODELS)
def test_scores_stay_within_the_budget(name):
    """16 index heads, T = S = 256, a 64 KiB budget (4 tokens per chunk): the model's indexer
    makes float32 tensors of ``[1, T, 16, S]`` (4 MiB) and more; ours none larger than its
    queries ``[1, T, 16, 16]`` (256 KiB)."""
    indexer, rope, rotary = _indexer(name, index_n_heads=16)
    T = 256
    x, q_resid, pe, mask, pos = _inputs(indexer, rotary, 1, T, pad=0, bool_mask=True)
    with _Record() as theirs:
        indexer(x, q_resid, pe, mask, pos)
    with _Record() as ours:
        got = ti.indexer_topk(indexer, rope, x, q_resid, pe, mask, score_bytes=2**16)
    assert _problems(got, *_reference(indexer, rope, x, q_resid, pe, mask), topk=16) == []
    assert theirs.largest >= T * 16 * T * 4
    assert ours.largest == T * 16 * 16 * 4


@pytest.mark.parametrize("bool_mask", [True, False], ids=["bool", "float"])
def test_each_chunk_scores_only_the_keys_it_sees(bool_mask):
    """Causal T = S = 96 in chunks of 8 tokens (16 heads): chunk i's single GEMM is ``[8·16,
    8·(i + 1)]``, keys up to its last token. The batch's row 1, left-padded by 20 tokens, scores
    nothing in its first two chunks (they see no key) and the same widths after."""
    indexer, rope, rotary = _indexer("deepseek_v32", index_n_heads=16)
    T = 96
    x, q_resid, pe, mask, pos = _inputs(indexer, rotary, 2, T, pad=20, bool_mask=bool_mask)
    with _Record(mm_rows=8 * 16) as rec:
        got = ti.indexer_topk(indexer, rope, x, q_resid, pe, mask, score_bytes=8 * 16 * T * 4)
    widths = [8 * (i + 1) for i in range(12)]
    assert rec.mm == [(128, w) for w in widths] + [(128, w) for w in [0, 0] + widths[2:]]
    assert _problems(got, *_reference(indexer, rope, x, q_resid, pe, mask), topk=16) == []


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("name", MODELS)
def test_half_precision_layer_on_cuda(name, dtype):
    """A bfloat16 / float16 layer on CUDA scores the layer's own q and k on tensor cores into
    float32: the selections against a float64 computation from those same (rounded) q, k and
    the module's head weights, as the float32 path is checked above."""
    indexer, rope, rotary = _indexer(name)
    indexer = indexer.to("cuda", dtype)
    x, q_resid, pe, mask, _ = _inputs(indexer, rotary, 2, 100, pad=10, bool_mask=True)
    x, q_resid, mask = x.to("cuda", dtype), q_resid.to("cuda", dtype), mask.cuda()
    pe = tuple(p.to("cuda", dtype) for p in pe)
    ours = ti.indexer_topk(indexer, rope, x, q_resid, pe, mask, score_bytes=7 * 2 * 100 * 4)
    with torch.no_grad():
        q, k = ti.index_queries(indexer, rope, q_resid, pe), ti.index_keys(indexer, rope, x, pe)
        w = indexer.weights_proj(x).double() * indexer.n_heads**-0.5
    dots = torch.einsum("bthd,bsd->bths", q.double(), k.double()) * indexer.softmax_scale
    score = torch.einsum("bth,bths->bts", w, dots.relu()).masked_fill(~mask, float("-inf"))
    bound = torch.einsum("bth,bths->bts", w.abs(), dots.abs()).amax(-1)
    assert _problems(ours.cpu(), score.cpu(), mask.cpu(), bound.cpu(), topk=16) == []
