"""mla_inductor.integrations.transformers with ``indexer_loss=True``: DeepSeek-V3.2's indexer KL loss
of tiny random-init DeepSeek-V3.2 and GLM-5 models (transformers 5.24) against an independent
float64 computation of its definition (DeepSeek-V3.2-Exp report, section 2.1): the target from the
dense softmax of the attention's scores over each token's selected keys (transformers' per-head
expanded keys, which the absorbed form equals), summed over heads and L1-normalised; the logits
from a float64 copy of the indexer's modules; the KL over the valid slots averaged over the tokens
that have one, then over the layers with their own indexer. float32, CPU (the reference backend).

The models are initialised with weights of std 0.2 (transformers' default 0.02 makes both
distributions nearly uniform and the loss about 6e-5, mostly float32 cancellation)."""

from __future__ import annotations

import contextlib

import copy
import importlib
import math

import pytest
import torch
from torch import nn
from transformers import (
    DeepseekV32Config,
    DeepseekV32ForCausalLM,
    DynamicCache,
    GlmMoeDsaConfig,
    GlmMoeDsaForCausalLM,
)
from transformers.models.deepseek_v32 import modeling_deepseek_v32 as dsv32
from transformers.models.glm_moe_dsa import modeling_glm_moe_dsa as glm

from mla_inductor.integrations import transformers as hf
from mla_inductor.integrations.transformers import loss as loss_mod
from mla_inductor.integrations.transformers.visibility import Visibility
from mla_inductor.kernels import reference_lightning_indexer_scores

from conftest import rel_l2
from test_transformers import TINY, _ids, _layer_kwargs

MODELS = {
    "deepseek_v32": lambda **kw: DeepseekV32ForCausalLM(
        DeepseekV32Config(**{**TINY, **kw}, initializer_range=0.2)),
    # layer 1 reuses layer 0's top-k (a "shared" indexer layer: no indexer, no loss)
    "glm_moe_dsa": lambda **kw: GlmMoeDsaForCausalLM(
        GlmMoeDsaConfig(**{**TINY, **kw}, initializer_range=0.2, indexer_types=["full", "shared"])),
}
# Per model: the attention's RoPE (interleaved pairs) and the indexer's.
ROPES = {
    "deepseek_v32": (dsv32.apply_rotary_pos_emb_interleave, dsv32.apply_rotary_pos_emb),
    "glm_moe_dsa": (glm.apply_rotary_pos_emb_interleave, glm.apply_rotary_pos_emb_interleave),
}


def _model(name: str, **kw) -> nn.Module:
    torch.manual_seed(0)
    return MODELS[name](**kw).train()


def _batch(B: int = 2, T: int = 64):
    """``(ids, attention_mask)``: row 1 left-padded by 10 tokens."""
    ids = _ids(B, T)
    mask = torch.ones_like(ids)
    mask[1:, :10] = 0
    return ids, mask


def _record_calls(model, monkeypatch) -> list[dict]:
    """Records, for every call of a DSA attention layer of ``model``, its inputs (``hidden_states``,
    ``position_embeddings``, the 4D ``attention_mask``) and the top-k its indexer computed (None
    for a shared-top-k layer)."""
    calls = []
    for attn in (m for m in model.modules() if type(m) in hf.deepseek_v32.LAYERS):
        def pre(module, args, kwargs):
            calls.append(dict(attn=module, topk=None, **{
                k: kwargs[k] for k in ("hidden_states", "position_embeddings", "attention_mask")}))
        attn.register_forward_pre_hook(pre, with_kwargs=True)
    topk = hf.deepseek_v32.indexer_topk

    def recorded(*args, **kwargs):
        out = topk(*args, **kwargs)
        calls[-1]["topk"] = out[0] if kwargs.get("scores") else out  # (indices, logits)
        return out

    monkeypatch.setattr(hf.deepseek_v32, "indexer_topk", recorded)
    return calls


def _reference_loss(name: str, call: dict) -> tuple[torch.Tensor, nn.Module]:
    """One layer's indexer loss in float64 from the definition, written independently of the
    package from a float64 copy of the layer (autograd reaches the copy's indexer only: the
    target and the indexer's inputs are constants). Returns ``(loss, the copy's indexer)``."""
    rope, index_rope = ROPES[name]
    a = copy.deepcopy(call["attn"]).double()
    x = call["hidden_states"].detach().double()
    cos, sin = (p.double() for p in call["position_embeddings"])
    mask, topk = call["attention_mask"], call["topk"].long()
    B, T, _ = x.shape
    if isinstance(mask, Visibility):  # what the switched model builds: positions, key padding
        keys = torch.ones(B, T, dtype=torch.bool) if mask.keys is None else mask.keys
        mask = (torch.arange(T) <= mask.positions[..., None]) & keys[:, None, :]
    else:
        mask = mask[:, 0]
    H, nope, rot, v = a.num_heads, a.qk_nope_head_dim, a.qk_rope_head_dim, a.v_head_dim
    with torch.no_grad():
        q_resid = a.q_a_layernorm(a.q_a_proj(x))
        q_nope, q_rope = a.q_b_proj(q_resid).view(B, T, H, nope + rot).split([nope, rot], -1)
        latent, k_rope = a.kv_a_proj_with_mqa(x).split([a.kv_lora_rank, rot], -1)
        q_rope, k_rope = rope(q_rope, k_rope[:, :, None], cos, sin, unsqueeze_dim=2)
        k_nope = a.kv_b_proj(a.kv_a_layernorm(latent)).view(B, T, H, nope + v)[..., :nope]
        scores = (torch.einsum("bthd,bshd->bhts", q_nope, k_nope)
                  + torch.einsum("bthr,bsr->bhts", q_rope, k_rope[:, :, 0])) * a.scaling
        # the selected set: the top-k keys the mask lets the token see
        seen = mask if mask.dtype == torch.bool else mask > torch.finfo(mask.dtype).min
        selected = torch.zeros(B, T, T + 1, dtype=torch.bool)  # column T: the -1 slots
        selected = selected.scatter(-1, torch.where(topk >= 0, topk, T), True)[..., :T]
        selected &= seen.expand(B, T, T)
        probs = scores.masked_fill(~selected[:, None], -math.inf).softmax(-1).nan_to_num()
        target = probs.sum(1)
        target = target / target.sum(-1, keepdim=True).clamp_min(1e-300)  # [B, T, S]
    m = a.indexer
    Hi, D, rot_i = m.n_heads, m.head_dim, m.qk_rope_head_dim
    q_i = m.wq_b(q_resid).view(B, T, Hi, D)
    k_i = m.k_norm(m.wk(x))[:, :, None]
    q_rot, k_rot = index_rope(q_i[..., :rot_i], k_i[..., :rot_i], cos, sin, unsqueeze_dim=2)
    q_i, k_i = torch.cat((q_rot, q_i[..., rot_i:]), -1), torch.cat((k_rot, k_i[..., rot_i:]), -1)
    w = m.weights_proj(x) * Hi**-0.5
    dots = torch.einsum("bthd,bsd->bths", q_i, k_i[:, :, 0]) * m.softmax_scale
    logits = torch.einsum("bth,bths->bts", w, dots.relu())  # [B, T, S]
    log_p = logits.masked_fill(~selected, -math.inf).log_softmax(-1)
    kl = torch.where(selected, torch.xlogy(target, target) - target * log_p, 0.0).sum(-1)
    rows = selected.any(-1)
    return kl[rows].sum() / rows.sum(), m


def _reference(name: str, calls: list[dict]) -> tuple[torch.Tensor, list]:
    """The model's indexer loss: the mean over the calls of layers with their own indexer, and
    ``[(layer's indexer, its float64 copy)]``."""
    found = [(_reference_loss(name, c), c["attn"].indexer) for c in calls if c["topk"] is not None]
    loss = torch.stack([r[0] for r, _ in found]).mean()
    return loss, [(ours, r[1]) for r, ours in found]


@pytest.mark.parametrize("implementation", [None, "eager", "sdpa"],
                         ids=["positions", "float_mask", "bool_mask"])
@pytest.mark.parametrize("name", MODELS)
def test_loss_and_its_gradient_match_the_float64_definition(name, implementation, monkeypatch):
    """Batch 2, row 1 left-padded (its first 10 query rows see no key and count for nothing); the
    indexer loss and every indexer parameter's gradient from it against float64. Its gradient
    reaches nothing else; GLM's shared layer records no loss of its own. The switched model on
    the positions and key padding it makes the model build, or (the attention implementation
    set again after apply) on the model's dense float or bool mask."""
    model = _model(name)
    assert hf.apply(model, indexer_loss=True) == 2
    if implementation is not None:
        model.set_attn_implementation(implementation)
    calls = _record_calls(model, monkeypatch)
    ids, mask = _batch()
    model(ids, attention_mask=mask, use_cache=False)
    ours = hf.indexer_loss(model)
    assert len(calls) == 2 and [c["topk"] is None for c in calls] == [False, name == "glm_moe_dsa"]
    ref, indexers = _reference(name, calls)
    assert ours.dtype == torch.float32 and ours.dim() == 0
    assert 0.1 < ref.item() < 10  # not a nearly uniform pair of distributions
    assert abs(ours.item() - ref.item()) <= 1e-5 * ref.item()
    ours.backward()
    ref.backward()
    names = set()
    for indexer, copy64 in indexers:
        for (k, p), (_, p64) in zip(indexer.named_parameters(), copy64.named_parameters()):
            assert rel_l2(p.grad, p64.grad) <= 1e-5, k
            names.add(p)
    assert len(names) == 5 * len(indexers)  # wq_b, wk, k_norm weight and bias, weights_proj
    for k, p in model.named_parameters():
        if p not in names:
            assert p.grad is None or not p.grad.any(), k


@pytest.mark.parametrize("name", MODELS)
def test_the_language_model_gradients_are_unchanged(name):
    """With the option on, the LM loss's logits and gradients are bitwise those with it off, and
    ``lm_loss + coef * indexer_loss`` gives every parameter outside the indexers exactly the LM
    loss's gradient (the indexers get none from the LM loss)."""
    model = _model(name)
    ids, mask = _batch()

    def run(indexer_loss: bool, coef: float | None):
        hf.apply(model, indexer_loss=indexer_loss)
        model.zero_grad(set_to_none=True)
        out = model(ids, attention_mask=mask, labels=ids, use_cache=False)
        loss = out.loss if coef is None else out.loss + coef * hf.indexer_loss(model)
        loss.backward()
        return out.logits, {k: p.grad for k, p in model.named_parameters()}

    logits_off, off = run(False, None)
    logits_on, on = run(True, None)
    hf.indexer_loss(model)  # drop the loss recorded by that forward
    _, both = run(True, 0.5)
    assert torch.equal(logits_on, logits_off)
    assert all((g is None and on[k] is None) or torch.equal(g, on[k]) for k, g in off.items())
    assert all(g is None for k, g in off.items() if ".indexer." in k)
    for k, g in off.items():
        if ".indexer." in k:
            assert both[k] is not None and both[k].any(), k
        else:
            assert (g is None and both[k] is None) or torch.equal(g, both[k]), k


def test_off_by_default_and_where_no_loss_is_computed(monkeypatch):
    """Off: the layer calls sparse_mla as without the option (no lse) and computes no loss, and
    ``indexer_loss`` refuses; on: eval mode and ``no_grad`` compute none (0 without grad);
    ``apply(model)`` turns it off again and ``remove`` drops recorded losses."""
    model = _model("deepseek_v32")
    ids, mask = _batch()
    calls, losses, op = [], [], hf.deepseek_v32.sparse_mla
    monkeypatch.setattr(hf.deepseek_v32, "sparse_mla", lambda *a, **kw: calls.append(sorted(kw)) or op(*a, **kw))
    layer_loss = loss_mod.layer_loss
    monkeypatch.setattr(loss_mod, "layer_loss",
                        lambda *a, **kw: losses.append(1) or layer_loss(*a, **kw))
    hf.apply(model)
    model(ids, attention_mask=mask, labels=ids, use_cache=False).loss.backward()
    assert calls == [["d_v", "sm_scale"]] * 2 and losses == []
    with pytest.raises(RuntimeError, match=r"^mla_inductor: indexer_loss\(model\) needs the indexer "
                                           "loss enabled: no DSA layer of this DeepseekV32ForCausal"):
        hf.indexer_loss(model)
    with pytest.raises(ValueError, match="^mla_inductor: Linear has no DSA attention layer"):
        hf.indexer_loss(nn.Linear(2, 2))

    assert hf.apply(model, indexer_loss=True) == 0  # already switched: the option is set
    calls.clear()
    model(ids, attention_mask=mask, use_cache=False)
    assert calls == [["d_v", "return_lse", "sm_scale"]] * 2 and len(losses) == 2
    with torch.no_grad():
        model(ids, attention_mask=mask, use_cache=False)
    model.eval()
    model(ids, attention_mask=mask, use_cache=False)
    assert len(losses) == 2
    first = hf.indexer_loss(model)
    assert first.requires_grad and first > 0
    with pytest.warns(UserWarning, match=r"^mla_inductor: indexer_loss\(model\) is 0 and has no "
                      r"gradient: the model is in eval mode .*call model.train\(\)"):
        none = hf.indexer_loss(model)  # cleared by the call before
    assert none.dim() == 0 and none.item() == 0 and not none.requires_grad
    model.train()
    with torch.no_grad():
        model(ids, attention_mask=mask, use_cache=False)
    with pytest.warns(UserWarning, match=r"is 0 and has no gradient: no forward in training mode "
                      r"with grad enabled ran since the last call \(a forward under "
                      r"torch.no_grad\(\)"):
        assert hf.indexer_loss(model).item() == 0

    model.train()
    hf.apply(model)
    model(ids, attention_mask=mask, use_cache=False)
    assert len(losses) == 2
    with pytest.raises(RuntimeError, match="^mla_inductor: indexer_loss"):
        hf.indexer_loss(model)
    hf.apply(model, indexer_loss=True)
    model(ids, attention_mask=mask, use_cache=False)
    assert hf.remove(model) == 2
    assert not any(loss_mod.enabled(m) for m in model.modules())
    with pytest.raises(RuntimeError, match="^mla_inductor: indexer_loss"):
        hf.indexer_loss(model)


def test_a_cache_with_earlier_tokens_is_refused():
    """A training forward's fresh cache (transformers makes one unless ``use_cache=False``) holds
    only the forward's own tokens: the loss is computed; a second forward on that cache would
    score earlier tokens' keys, which the loss does not cover: refused."""
    model = _model("deepseek_v32")
    hf.apply(model, indexer_loss=True)
    ids = _ids(1, 48)
    cache = DynamicCache(config=model.config)
    model(ids[:, :40], cache=cache, use_cache=True)
    assert hf.indexer_loss(model).item() > 0
    with pytest.raises(RuntimeError, match="^mla_inductor: the indexer loss needs a training "
                                           "forward over its own tokens only, got 8 tokens "
                                           "attending to 48 keys"):
        model(ids[:, 40:], cache=cache, use_cache=True)


@pytest.mark.parametrize("name", MODELS)
def test_the_logits_are_the_selections_scores_in_any_chunking(name, monkeypatch):
    """The logits are the selection's own scores (``lightning_indexer(..., return_scores=True)``
    on the indexer's queries, keys and head weights): the scores op's forward never runs, and
    their backward is one ``lightning_indexer_scores_bwd`` per layer with an indexer, at the
    selected indices; its reference in chunks of one token gives the one-chunk indexer
    gradients within float32 rounding."""
    selection_mod = importlib.import_module("mla_inductor.ops.lightning_indexer")  # the ops module
    model = _model(name)
    hf.apply(model, indexer_loss=True)
    ids, mask = _batch()
    forwards, calls, op = [], [], selection_mod.lightning_indexer_scores_bwd
    monkeypatch.setattr(loss_mod, "lightning_indexer_scores",
                        lambda *a: forwards.append(a) or pytest.fail("scored twice"))

    def counted(dscores, q, k, w, idx, deterministic):
        calls.append((tuple(q.shape), tuple(k.shape), tuple(w.shape), tuple(idx.shape)))
        return op(dscores, q, k, w, idx, deterministic)

    monkeypatch.setattr(selection_mod, "lightning_indexer_scores_bwd", counted)

    def run():
        model.zero_grad(set_to_none=True)
        model(ids, attention_mask=mask, use_cache=False)
        loss = hf.indexer_loss(model)
        loss.backward()
        return loss, {k: p.grad for k, p in model.named_parameters() if p.grad is not None}

    one, one_grads = run()
    cfg = model.config
    B, T = ids.shape
    layers = 2 if name == "deepseek_v32" else 1
    assert forwards == []
    assert calls == [((B, T, cfg.index_n_heads, cfg.index_head_dim), (B, T, cfg.index_head_dim),
                      (B, T, cfg.index_n_heads), (B, T, cfg.index_topk))] * layers
    rows = []
    gather = reference_lightning_indexer_scores._gather
    monkeypatch.setattr(reference_lightning_indexer_scores, "_gather",
                        lambda k, r, *a: rows.append(r.shape[0]) or gather(k, r, *a))
    monkeypatch.setattr(reference_lightning_indexer_scores, "_CHUNK_ELEMENTS", 1)
    many, many_grads = run()
    assert set(rows) == {1} and len(rows) == B * T * layers  # the backward's chunks
    assert many.item() == one.item()  # the forward does not depend on the backward's chunks
    assert many_grads.keys() == one_grads.keys()
    assert all(rel_l2(many_grads[k], g) <= 1e-5 for k, g in one_grads.items())


def test_the_backward_keeps_no_gathered_keys(monkeypatch):
    """What the loss keeps for the backward (tensors autograd saves while a layer computes it,
    other than those the model saves anyway): 12 bytes per selected slot (int32 indices, float32
    logits and target, which the KL keeps), and with the batch's padding 4 more (the selection's
    own indices, which its scores keep, apart from the masked ones the attention reads), the
    indexer's queries ``[B, T, n_heads, head_dim]`` (which the selection's scores keep), its keys
    up to three times, its head weights and O(B·T); not the gathered keys ``[B, T, topk,
    head_dim]`` (64 bytes per slot here)."""
    model = _model("deepseek_v32", index_topk=24)  # topk != head_dim, so their shapes differ
    hf.apply(model, indexer_loss=True)
    ids, mask = _batch()
    B, T, topk = 2, 64, 24
    H, D = model.config.index_n_heads, model.config.index_head_dim
    inside, kept, elsewhere = [False], {}, set()

    def flagged(fn):
        def run(*args, **kwargs):
            inside[0] = True
            try:
                return fn(*args, **kwargs)
            finally:
                inside[0] = False
        return run

    def pack(t):
        storage = t.untyped_storage()
        if inside[0]:
            kept[storage.data_ptr()] = storage.nbytes()
        else:
            elsewhere.add(storage.data_ptr())
        return t

    # the loss's saved tensors: its logits, from the selection with grad, and the rest
    monkeypatch.setattr(hf.deepseek_v32, "indexer_topk", flagged(hf.deepseek_v32.indexer_topk))
    monkeypatch.setattr(loss_mod, "layer_loss", flagged(loss_mod.layer_loss))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model(ids, attention_mask=mask, use_cache=False)  # held: no storage reused
    total = sum(n for ptr, n in kept.items() if ptr not in elsewhere)
    floor = 12 * B * T * topk + 4 * B * T * H * D
    # the selection's own indices, keys three times (with the batch's padding the selection
    # keeps its gathered keys and their int64 order too), head weights, O(B T)
    per_layer = (floor + 4 * B * T * topk + 3 * 4 * B * T * D + 8 * B * T + 4 * B * T * H
                 + 32 * B * T + 256)
    assert 2 * floor < total <= 2 * per_layer, total
    assert total < 2 * 4 * B * T * topk * D  # the gathered keys alone would be more
    hf.indexer_loss(model)
    del out


@pytest.mark.parametrize("name", MODELS)
def test_decoder_layer_compiles_fullgraph_with_the_loss(name):
    """A switched decoder layer with the option on under ``torch.compile(fullgraph=True)`` (a
    graph break raises): its output, the recorded loss and the indexer's gradients from it equal
    eager's."""
    model = _model(name)
    hf.apply(model, indexer_loss=True)
    layer = model.model.layers[0]
    B, T = 2, 64
    x = torch.randn(B, T, model.config.hidden_size, generator=torch.Generator().manual_seed(3))
    kwargs = _layer_kwargs(model, x)

    def run(fn):
        out = fn(x, **kwargs)
        out = out[0] if isinstance(out, tuple) else out  # GLM's layer also returns its top-k
        loss = hf.indexer_loss(model)
        return [out, loss, *torch.autograd.grad(loss, list(layer.self_attn.indexer.parameters()))]

    eager = run(layer)
    torch._dynamo.reset()
    compiled = run(torch.compile(layer, fullgraph=True, backend="aot_eager"))
    assert eager[1] > 0
    for c, e in zip(compiled, eager):
        assert rel_l2(c, e) <= 1e-6


@pytest.mark.parametrize("reentrant", [False, True], ids=["non_reentrant", "reentrant"])
def test_with_transformers_gradient_checkpointing(reentrant):
    """transformers' gradient checkpointing recomputes each layer's forward inside the backward.
    Non-reentrant (transformers' default): the loss and all gradients as without it, and the
    recomputation records no second loss. Reentrant: the layers' forward runs without grad, so
    no loss is recorded (0), as documented."""
    model = _model("deepseek_v32")
    hf.apply(model, indexer_loss=True)
    ids, mask = _batch()

    def step():
        model.zero_grad(set_to_none=True)
        out = model(ids, attention_mask=mask, labels=ids, use_cache=False)
        loss = hf.indexer_loss(model)
        (out.loss + loss).backward()
        return loss, {k: p.grad for k, p in model.named_parameters()}

    ref, ref_grads = step()
    assert ref > 0
    model.activation_checkpointing_enable({"use_reentrant": reentrant})
    nothing = pytest.warns(UserWarning, match=r"^mla_inductor: indexer_loss\(model\) is 0")
    with nothing if reentrant else contextlib.nullcontext():
        ours, grads = step()
    with nothing:
        assert hf.indexer_loss(model).item() == 0  # nothing recorded by the backward
    if reentrant:
        assert ours.item() == 0
        return
    assert torch.equal(ours, ref)
    assert all((g is None and grads[k] is None) or torch.equal(g, grads[k])
               for k, g in ref_grads.items())
