"""mla_inductor.integrations.transformers.indexer: the indexer's top-k on the lightning_indexer op
against a float64 computation of transformers 5.24's ``DeepseekV32Indexer`` / ``GlmMoeDsaIndexer``
definition (from a float64 copy of the same module's submodules and the model's RoPE function),
tiny random-init configs, float32, CPU.

The op is not bitwise transformers' (its GEMMs differ), so at a near-tie it may keep the other
key, and many keys tie exactly at score 0 (every head's relu 0): each row's selection is checked
by what stays true (:func:`_problems`): ``n = min(index_topk, keys seen)`` seen keys in ascending
key index, then -1; no selected key scores below the float64 n-th largest, and no key left out
above it, beyond a tight tolerance. transformers' own indices pass the same check (brought to
that form), and a wrong RoPE fails it. Both kinds of visibility are checked: a dense mask (bool
or additive) and :class:`~mla_inductor.integrations.transformers.visibility.Visibility` (positions
and a key padding mask), which must select exactly as the equivalent dense mask.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import DeepseekV32Config, DynamicCache, GlmMoeDsaConfig
from transformers.models.deepseek_v32 import modeling_deepseek_v32 as dsv32
from transformers.models.glm_moe_dsa import modeling_glm_moe_dsa as glm

from mla_inductor.integrations.transformers import indexer as ti
from mla_inductor.kernels import reference_lightning

# The indexer's widths of tests/integrations/test_transformers.py's TINY (index_topk 16, 2 heads
# of 16, rope 8).
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
    min(topk, S)`` slots; the first ``n = min(topk, keys seen)`` name seen keys in ascending
    order, the others are -1; no selected key's score is below the float64 n-th largest, and no
    seen key left out scores above it, by more than ``TOL · bound``."""
    B, T, S = score.shape
    found = []
    if indices.shape != (B, T, min(topk, S)) or indices.dtype != torch.int32:
        return [f"shape {tuple(indices.shape)} dtype {indices.dtype}"]
    idx = indices.long()
    for b in range(B):
        for t in range(T):
            row, n = idx[b, t], min(topk, int(seen[b, t].sum()))
            if not ((row[n:] == -1).all() and (row[:n] >= 0).all() and (row[:n] < S).all()):
                found.append(f"row {b, t}: not {n} keys then -1")
                continue
            keys = row[:n]
            if not (seen[b, t, keys].all() and (keys[1:] > keys[:-1]).all()):
                found.append(f"row {b, t}: a key not seen, or not in ascending order")
                continue
            if n == 0:
                continue
            kth = score[b, t].topk(n).values[-1]
            left = score[b, t].clone()
            left[keys] = float("-inf")
            tol = TOL * bound[b, t].item()
            if score[b, t, keys].min() < kth - tol or left.max() > kth + tol:
                found.append(f"row {b, t}: not the top {n} within {tol:.3g}")
    return found


def _theirs(indices, seen):
    """transformers' indices in the op's form: the seen keys in ascending order, then -1."""
    shown = torch.where(seen.gather(-1, indices.long()), indices.long(), S_BIG)
    shown = shown.sort(-1).values
    return torch.where(shown == S_BIG, -1, shown).to(torch.int32)


S_BIG = 2**31


def _visibility(mask, pad: int):
    """The :class:`Visibility` of :func:`_inputs`' mask: positions 0..T-1 and, with padding, the
    key padding mask (rows 1.. hide their first ``pad`` keys)."""
    B, T = mask.shape[0], mask.shape[1]
    keys = None
    if pad:
        keys = torch.ones(B, T, dtype=torch.bool)
        keys[1:, :pad] = False
    return ti.Visibility(torch.arange(T), keys)


MASKS = ["bool", "float", "visibility"]


def _as_given(kind, mask, pad):
    return _visibility(mask, pad) if kind == "visibility" else mask


@pytest.mark.parametrize("kind", MASKS)
@pytest.mark.parametrize("chunk", [1, 7, None], ids=["chunk1", "chunk7", "one_chunk"])
@pytest.mark.parametrize("name", MODELS)
def test_topk_matches_the_float64_definition(name, chunk, kind, monkeypatch):
    """A batch of 2 over T 100 (row 1 left-padded by 10 tokens, so its first 10 query rows see
    nothing; rows 0-14 see fewer keys than index_topk 16), and T 8 < index_topk (top-8 of 8
    keys), in chunks of 1, 7 (not dividing T) or all query tokens. transformers' own indices
    pass the same check."""
    indexer, rope, rotary = _indexer(name)
    for B, T in ((2, 100), (1, 8)):
        pad = 10 if B > 1 else 0
        x, q_resid, pe, mask, pos = _inputs(indexer, rotary, B, T, pad=pad,
                                            bool_mask=kind != "float")
        if chunk is not None:
            per_row = T * (4 * indexer.n_heads + 48)
            monkeypatch.setattr(reference_lightning, "SCORE_BYTES", chunk * per_row)
        ours = ti.indexer_topk(indexer, rope, x, q_resid, pe, _as_given(kind, mask, pad))
        ref = _reference(indexer, rope, x, q_resid, pe, mask)
        assert _problems(ours, *ref, topk=16) == []
        theirs = _theirs(indexer(x, q_resid, pe, mask, pos), ref[1])
        assert _problems(theirs, *ref, topk=16) == []


@pytest.mark.parametrize("name", MODELS)
def test_visibility_selects_exactly_as_its_dense_mask(name):
    """Positions with a key padding mask that has holes (not only a prefix: row 0 hides keys
    20-29 and 50, row 1 its first 7) and positions beyond both ends: the same indices as the
    dense mask they stand for (causal AND padding)."""
    indexer, rope, rotary = _indexer(name)
    B, T = 2, 64
    x, q_resid, pe, _, _ = _inputs(indexer, rotary, B, T, pad=0, bool_mask=True)
    keys = torch.ones(B, T, dtype=torch.bool)
    keys[0, 20:30] = keys[0, 50] = keys[1, :7] = False
    positions = torch.arange(T)[None].repeat(B, 1)
    positions[1, :3] = torch.tensor([-5, -1, 200])
    dense = (torch.arange(T) <= positions[..., None]) & keys[:, None, :]
    got = ti.indexer_topk(indexer, rope, x, q_resid, pe, ti.Visibility(positions, keys))
    want = ti.indexer_topk(indexer, rope, x, q_resid, pe, dense)
    assert torch.equal(got, want)
    assert (got[1, :2] == -1).all() and (got[1, 2] >= 7).all()
    assert not torch.isin(got[0], torch.tensor([20, 21, 25, 29, 50])).any()


@pytest.mark.parametrize("name", MODELS)
def test_topk_with_a_cache(name, monkeypatch):
    """A 40-token prefill then 4 single-token steps over a left-padded batch of 2, each side with
    its own ``DynamicCache``, the op's side on positions and key padding in chunks of 7 tokens:
    at every step the float64 check over every cached key, and the same cached indexer keys as
    the model's indexer writes."""
    indexer, rope, rotary = _indexer(name)
    x, q_resid, pe, mask, pos = _inputs(indexer, rotary, 2, 44, pad=7, bool_mask=False)
    score, seen, bound = _reference(indexer, rope, x, q_resid, pe, mask)
    caches = [DynamicCache(config=indexer.config) for _ in range(2)]
    monkeypatch.setattr(reference_lightning, "SCORE_BYTES", 7 * 44 * (4 * 2 + 48))
    keys = torch.ones(2, 44, dtype=torch.bool)
    keys[1:, :7] = False
    for t0, t1 in ((0, 40), (40, 41), (41, 42), (42, 43), (43, 44)):
        step = (x[:, t0:t1], q_resid[:, t0:t1], tuple(r[:, t0:t1] for r in pe))
        indexer(*step, mask[:, t0:t1, :t1], pos[:, t0:t1], cache=caches[0])
        ours = ti.indexer_topk(indexer, rope, *step,
                               ti.Visibility(torch.arange(t0, t1), keys[:, :t1]), caches[1])
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


@pytest.mark.parametrize("kind", MASKS)
@pytest.mark.parametrize("name", MODELS)
def test_scores_stay_within_the_budget(name, kind, monkeypatch):
    """16 index heads, T = S = 256: the model's indexer makes float32 tensors of ``[1, T, 16, S]``
    (4 MiB) and more; ours (on a dense mask, at a budget of 4 tokens per chunk) none larger than
    a chunk's scores ``[4·16, S]`` (64 KiB), and on positions none larger than its queries
    ``[1, T, 16, 16]`` (256 KiB; the op's own chunks are bounded the same way, within it)."""
    indexer, rope, rotary = _indexer(name, index_n_heads=16)
    T = 256
    x, q_resid, pe, mask, pos = _inputs(indexer, rotary, 1, T, pad=0, bool_mask=True)
    monkeypatch.setattr(reference_lightning, "SCORE_BYTES", 4 * T * (4 * 16 + 48))
    with _Record() as theirs:
        indexer(x, q_resid, pe, mask, pos)
    with _Record() as ours:
        got = ti.indexer_topk(indexer, rope, x, q_resid, pe, _as_given(kind, mask, 0))
    assert _problems(got, *_reference(indexer, rope, x, q_resid, pe, mask), topk=16) == []
    assert theirs.largest >= T * 16 * T * 4
    assert ours.largest == T * 16 * 16 * 4


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("name", MODELS)
def test_half_precision_layer_on_cuda(name, dtype):
    """A bfloat16 / float16 layer on CUDA scores the layer's own q and k on tensor cores into
    float32 (on a dense mask and on positions): the selections against a float64 computation
    from those same (rounded) q, k and the module's head weights, as the float32 path is checked
    above."""
    indexer, rope, rotary = _indexer(name)
    indexer = indexer.to("cuda", dtype)
    x, q_resid, pe, mask, _ = _inputs(indexer, rotary, 2, 100, pad=10, bool_mask=True)
    x, q_resid, mask = x.to("cuda", dtype), q_resid.to("cuda", dtype), mask.cuda()
    pe = tuple(p.to("cuda", dtype) for p in pe)
    ours = ti.indexer_topk(indexer, rope, x, q_resid, pe, mask)
    vis = _visibility(mask, 10)
    on_positions = ti.indexer_topk(indexer, rope, x, q_resid, pe,
                                   ti.Visibility(vis.positions.cuda(), vis.keys.cuda()))
    with torch.no_grad():
        q, k = ti.index_queries(indexer, rope, q_resid, pe), ti.index_keys(indexer, rope, x, pe)
        w = indexer.weights_proj(x).double() * indexer.n_heads**-0.5
    dots = torch.einsum("bthd,bsd->bths", q.double(), k.double()) * indexer.softmax_scale
    score = torch.einsum("bth,bths->bts", w, dots.relu()).masked_fill(~mask, float("-inf"))
    bound = torch.einsum("bth,bths->bts", w.abs(), dots.abs()).amax(-1)
    for got in (ours, on_positions):
        assert _problems(got.cpu(), score.cpu(), mask.cpu(), bound.cpu(), topk=16) == []


@pytest.mark.parametrize("name", MODELS)
def test_head_weights_keep_no_upcast_copy_for_the_backward(name):
    """With the layer in bfloat16 and ``weights_proj`` in float32 (as the models keep it), the
    head weights and their gradient are the plain module's (bitwise the same forward), and the
    float32 copy of the hidden states is not among the tensors saved for the backward."""
    indexer, _, _ = _indexer(name)
    indexer = indexer.to(torch.bfloat16)
    indexer.weights_proj.float()
    x = torch.randn(2, 5, indexer.hidden_size, generator=torch.Generator().manual_seed(1))
    x = x.to(torch.bfloat16)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        got = ti.head_weights(indexer, x)
    (dw,) = torch.autograd.grad(got.square().sum(), [indexer.weights_proj.weight])
    plain = copy.deepcopy(indexer)
    want = plain.weights_proj(x.float()).float() * indexer.n_heads**-0.5 * indexer.softmax_scale
    (dw_want,) = torch.autograd.grad(want.square().sum(), [plain.weights_proj.weight])
    assert torch.equal(got, want)
    torch.testing.assert_close(dw, dw_want, rtol=1e-6, atol=1e-7)
    assert not any(t.dtype == torch.float32 and t.shape == x.shape for t in saved)
    assert any(t is x for t in saved)
