"""mla_inductor.integrations.transformers: tiny random-init DeepSeek-V3.2 and GLM-5 (transformers
5.24) switched to the op, against the same model unswitched on transformers' eager attention (the
independent reference: per-head expanded keys and values under the dense top-k mask). float32,
CPU (the reference backend)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from mla_inductor.integrations import transformers as hf
from mla_inductor.integrations.transformers.visibility import Visibility
from mla_inductor.kernels import reference_lightning
from transformers import (
    DeepseekV32Config,
    DynamicCache,
    DeepseekV32ForCausalLM,
    GlmMoeDsaConfig,
    GlmMoeDsaForCausalLM,
)

from conftest import (ReturnedShapes, assert_compiled_matches_eager, assert_same_gradients, rel_l2,
                      switched_and_back, switched_gradients)

VOCAB = 128
# 2 layers, H 4, topk 16 over T 64-128; layer 1 is a mixture of experts. 8 index heads: with 2, a
# quarter of the keys score exactly 0 (both heads' relu 0) and rows whose head weights are all
# negative rank those zeros first, so which of the tied keys is kept (torch.topk's tie order in
# the unswitched model, the smaller key index on the op) changes the logits by 4-5% without
# either choice being wrong; tests/integrations/test_transformers_indexer.py checks 2-head selections against
# their float64 definition, ties allowed.
TINY = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
    num_hidden_layers=2, first_k_dense_replace=1, n_routed_experts=4, num_experts_per_tok=2,
    n_group=1, topk_group=1, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=32,
    kv_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16, index_topk=16,
    index_head_dim=16, index_n_heads=8, max_position_embeddings=256, attn_implementation="eager",
)
YARN = dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=64,
            beta_fast=32.0, beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0)
MODELS = {
    "deepseek_v32": lambda: DeepseekV32ForCausalLM(DeepseekV32Config(**TINY)),
    "deepseek_v32_yarn": lambda: DeepseekV32ForCausalLM(DeepseekV32Config(**TINY, rope_parameters=YARN)),
    # layer 1 reuses layer 0's top-k (a "shared" indexer layer, no indexer of its own)
    "glm_moe_dsa": lambda: GlmMoeDsaForCausalLM(GlmMoeDsaConfig(**TINY, indexer_types=["full", "shared"])),
}


def _model(name: str, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    model = MODELS[name]().eval()
    if name == "glm_moe_dsa":
        assert model.model.layers[1].self_attn.indexer is None
    if name == "deepseek_v32_yarn":
        assert model.model.layers[0].self_attn.scaling != model.config.qk_head_dim**-0.5
    return model


def _ids(B: int, T: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (B, T), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("name", MODELS)
def test_logits_match_eager_and_remove_restores_bitwise(name):
    model = _model(name)
    ids = _ids(2, 128 if name == "deepseek_v32_yarn" else 64)
    ref, out, back = switched_and_back(model, ids, 2)
    assert rel_l2(out, ref) <= 1e-5
    assert torch.equal(back, ref)


@pytest.mark.parametrize("name", ["deepseek_v32", "glm_moe_dsa"])
def test_gradients_match_eager(name):
    model = _model(name).train()
    ids = _ids(2, 64)
    ours, ref = switched_gradients(model, ids, 2)
    assert any("kv_b_proj" in k for k, g in ours.items() if g is not None)
    assert_same_gradients(ours, ref, 1e-4)


@pytest.mark.parametrize("name", ["deepseek_v32", "glm_moe_dsa"])
def test_batch_with_left_padding(name):
    """Row 1 is left-padded by 10 tokens; the switched model also runs on the sdpa mask (bool), the
    reference on the eager one (additive float). Pad positions themselves are not compared."""
    model = _model(name)
    ids = _ids(2, 64)
    mask = torch.ones_like(ids)
    mask[1, :10] = 0
    with torch.no_grad():
        ref = model(ids, attention_mask=mask, use_cache=False).logits
        hf.apply(model)
        out = model(ids, attention_mask=mask, use_cache=False).logits
        model.set_attn_implementation("sdpa")
        out_bool = model(ids, attention_mask=mask, use_cache=False).logits
    keep = mask.bool()
    assert rel_l2(out[keep], ref[keep]) <= 1e-5
    assert rel_l2(out_bool[keep], ref[keep]) <= 1e-5


@pytest.mark.parametrize("name", ["deepseek_v32", "glm_moe_dsa"])
def test_logits_with_one_token_indexer_chunks_match_eager(name, monkeypatch):
    """The switched model's indexer top-k in chunks of one query token against the unswitched
    model on eager attention."""
    model = _model(name)
    ids = _ids(2, 64)
    with torch.no_grad():
        ref = model(ids, use_cache=False).logits
        hf.apply(model)
        monkeypatch.setattr(reference_lightning, "SCORE_BYTES", 1)
        chunked = model(ids, use_cache=False).logits
    assert rel_l2(chunked, ref) <= 1e-5


@pytest.mark.parametrize("name", ["deepseek_v32", "glm_moe_dsa"])
def test_padding_with_holes_and_packed_sequences_match_eager(name):
    """A 2D mask that hides keys in the middle of a row (not only a prefix), and packed
    sequences (position_ids restarting, no mask: transformers' block-diagonal mask, which the
    switched model takes dense). Hidden and padded positions themselves are not compared."""
    model = _model(name)
    ids = _ids(2, 64)
    mask = torch.ones_like(ids)
    mask[0, 20:30] = 0
    mask[1, :5] = mask[1, 40] = 0
    packed = torch.cat((torch.arange(30), torch.arange(34)))[None].expand(2, 64)
    with torch.no_grad():
        ref = model(ids, attention_mask=mask, use_cache=False).logits
        ref_packed = model(ids, position_ids=packed, use_cache=False).logits
        hf.apply(model)
        out = model(ids, attention_mask=mask, use_cache=False).logits
        out_packed = model(ids, position_ids=packed, use_cache=False).logits
    keep = mask.bool()
    assert rel_l2(out[keep], ref[keep]) <= 1e-5
    assert rel_l2(out_packed, ref_packed) <= 1e-5
    assert rel_l2(ref_packed[:, 30:], model(ids, use_cache=False).logits[:, 30:]) > 1e-2


@pytest.mark.parametrize("padded", [False, True], ids=["no_mask", "padding_mask"])
@pytest.mark.parametrize("name", ["deepseek_v32", "glm_moe_dsa"])
def test_the_switched_model_holds_no_tokens_by_keys_tensor(name, padded):
    """T = S = 80 (no other size of the model is 80): the unswitched model makes ``[B, 1, T,
    S]`` masks and scores; the switched one, which makes the model build positions and the key
    padding instead of its mask (and sets, then on remove restores, the attention
    implementation), makes no tensor with two sizes of 80."""
    model = _model(name)
    ids = _ids(2, 80)
    kwargs = dict(attention_mask=torch.ones_like(ids)) if padded else {}

    def square(shape):  # two sizes of T: a [.., T, S] tensor, T = S
        return shape.count(80) >= 2

    with torch.no_grad(), ReturnedShapes(square) as theirs:
        model(ids, use_cache=False, **kwargs)
    assert any(shape[-2:] == (80, 80) for _, shape in theirs.found)
    hf.apply(model)
    assert model.config._attn_implementation == hf.ATTN_IMPLEMENTATION
    with torch.no_grad(), ReturnedShapes(square) as ours:
        model(ids, use_cache=False, **kwargs)
    assert ours.found == set()
    hf.remove(model)
    assert model.config._attn_implementation == "eager"


@pytest.mark.parametrize("chunked", [False, True], ids=["one_chunk", "chunk1"])
@pytest.mark.parametrize("cache", ["dynamic", "static"])
@pytest.mark.parametrize("name", ["deepseek_v32", "glm_moe_dsa"])
def test_greedy_generation_with_cache(name, cache, chunked, monkeypatch):
    """8 greedy tokens from 40-token prompts (topk 16 < the context); the prefill and every decode
    step read the model's cache through the op. The static cache's run is a batch of 2, one row
    left-padded by 7 tokens (its unfilled rows and the padding are hidden by the mask). ``chunk1``:
    the switched indexer scores one query token at a time."""
    if chunked:
        monkeypatch.setattr(reference_lightning, "SCORE_BYTES", 1)
    model = _model(name)
    B = 1 if cache == "dynamic" else 2
    ids = _ids(B, 40)
    mask = torch.ones_like(ids)
    mask[1:, :7] = 0
    kwargs = dict(attention_mask=mask, max_new_tokens=8, min_new_tokens=8, do_sample=False,
                  pad_token_id=0, cache_implementation=cache)
    with torch.no_grad():
        ref = model.generate(ids, **kwargs)
        calls, op = [], hf.deepseek_v32.sparse_mla

        def counted(q, *args, **kwargs):
            calls.append(q.shape[1])
            return op(q, *args, **kwargs)

        monkeypatch.setattr(hf.deepseek_v32, "sparse_mla", counted)
        hf.apply(model)
        out = model.generate(ids, **kwargs)
    assert out.shape == (B, 48)
    assert torch.equal(out, ref)
    assert calls == [40, 40] + [1, 1] * 7  # prefill, then one token per layer and step


def _layer_kwargs(model: nn.Module, x: torch.Tensor) -> dict:
    """What a decoder layer of ``model`` takes besides hidden states ``x [B, T, hidden_size]``:
    positions 0..T-1, the model's RoPE of them and the additive causal mask ``[B, 1, T, T]``."""
    B, T = x.shape[:2]
    pos = torch.arange(T)[None]
    future = torch.ones(T, T, dtype=torch.bool).triu(1)
    mask = torch.zeros(B, 1, T, T).masked_fill(future, torch.finfo(torch.float32).min)
    return dict(attention_mask=mask, position_ids=pos,
                position_embeddings=model.model.rotary_emb(x, pos))


@pytest.mark.parametrize("mask", ["dense", "positions", "padding"])
@pytest.mark.parametrize("name", ["deepseek_v32", "glm_moe_dsa"])
def test_decoder_layer_compiles_fullgraph(name, mask):
    """A switched decoder layer under torch.compile(fullgraph=True) (a graph break raises), forward
    and backward, matches the same layer in eager: on the model's dense additive mask, on
    positions, and on positions with a key padding mask (row 1 hides its first 9 keys)."""
    model = _model(name).train()
    hf.apply(model)
    layer = model.model.layers[0]
    B, T = 2, 64
    x = torch.randn(B, T, model.config.hidden_size, requires_grad=True)
    kwargs = _layer_kwargs(model, x)
    if mask != "dense":
        keys = None
        if mask == "padding":
            keys = torch.ones(B, T, dtype=torch.bool)
            keys[1, :9] = False
        kwargs["attention_mask"] = Visibility(torch.arange(T), keys)

    def run(fn):
        out = fn(x, **kwargs)
        out = out[0] if isinstance(out, tuple) else out  # GLM's layer also returns its top-k
        params = [x, *layer.parameters()]
        return [out, *torch.autograd.grad(out.square().sum(), params, allow_unused=True)]

    assert_compiled_matches_eager(layer, run)


def test_cache_also_under_its_older_name_past_key_values():
    """transformers 5.17's decoder layers pass the cache as ``past_key_values=`` (5.24's
    ``cache=``): a prefill of 24 tokens and one decode step give bitwise the same outputs and
    cache lengths under either name; both names at once are refused."""
    model = _model("deepseek_v32")
    hf.apply(model)
    attn = model.model.layers[0].self_attn
    x = torch.randn(1, 25, model.config.hidden_size, generator=torch.Generator().manual_seed(2))
    pos = torch.arange(25)[None]
    rope = model.model.rotary_emb(x, pos)
    seen = torch.ones(25, 25, dtype=torch.bool).tril()[None, None]
    runs = []
    for name in ("cache", "past_key_values"):
        cache, outs = DynamicCache(config=model.config), []
        with torch.no_grad():
            for t0, t1 in ((0, 24), (24, 25)):
                out, _ = attn(x[:, t0:t1], tuple(r[:, t0:t1] for r in rope), seen[..., t0:t1, :t1],
                              position_ids=pos[:, t0:t1], **{name: cache})
                outs.append((out, cache.get_seq_length()))
        runs.append(outs)
    assert [n for _, n in runs[0]] == [24, 25]
    assert all(torch.equal(a, b) and m == n for (a, m), (b, n) in zip(*runs))
    with pytest.raises(RuntimeError, match="^mla_inductor: the switched attention got both"):
        attn(x, rope, seen, cache=DynamicCache(config=model.config),
             past_key_values=DynamicCache(config=model.config))


def test_errors():
    with pytest.raises(ValueError, match="^mla_inductor: Sequential has no DSA attention layer"):
        hf.apply(nn.Sequential(nn.Linear(2, 2)))
    with pytest.raises(ValueError, match="^mla_inductor: Linear has no DSA attention layer"):
        hf.remove(nn.Linear(2, 2))
    model = _model("deepseek_v32").train()
    attn = model.model.layers[0].self_attn
    attn.forward = attn.forward  # an instance-level wrapper, as accelerate's hooks install
    with pytest.raises(RuntimeError, match="^mla_inductor: model.layers.0.self_attn.forward is already"):
        hf.apply(model)
    del attn.forward
    hf.apply(model)
    attn.attention_dropout = 0.1
    with pytest.raises(RuntimeError, match="^mla_inductor: attention_dropout=0.1 is not supported"):
        model(_ids(1, 8), use_cache=False)


def test_deepcopy_of_a_switched_model_runs_its_own_weights():
    model = _model("deepseek_v32")
    hf.apply(model)
    twin = copy.deepcopy(model)
    attn = twin.model.layers[0].self_attn
    assert attn.forward.__self__ is attn
    ids = _ids(1, 32)
    with torch.no_grad():
        before = model(ids, use_cache=False).logits
        attn.kv_b_proj.weight.mul_(2)
        assert torch.equal(model(ids, use_cache=False).logits, before)
        assert not torch.equal(twin(ids, use_cache=False).logits, before)


@pytest.mark.parametrize("name", ["deepseek_v32", "glm_moe_dsa"])
def test_indexer_precision_fp8(name, monkeypatch):
    """``indexer_precision="fp8"``: every indexer selects on float8_e4m3fn queries and keys with
    their per-row scales (``quantize_fp8`` of the unquantised ones), the logits stay near the
    bf16 selection's (the fp8 selection differs at near-ties only), ``remove`` and a later
    ``apply`` without it put the default back, and another precision is refused."""
    from mla_inductor import quantize_fp8
    from mla_inductor.integrations.transformers import indexer as ti

    model = _model(name)
    ids = _ids(2, 64)
    calls, op = [], ti.lightning_indexer
    monkeypatch.setattr(ti, "lightning_indexer",
                        lambda q, k, *a, **kw: calls.append((q, k, kw)) or op(q, k, *a, **kw))
    n = sum(layer.self_attn.indexer is not None for layer in model.model.layers)
    assert n == (1 if name == "glm_moe_dsa" else 2)  # GLM's shared layer reuses the top-k
    with torch.no_grad():
        hf.apply(model)
        bf16 = model(ids, use_cache=False).logits
        assert [c[0].dtype for c in calls] == [torch.float32] * n
        calls.clear()
        hf.apply(model, indexer_precision="fp8")
        fp8 = model(ids, use_cache=False).logits
        assert len(calls) == n
        assert all(q.dtype == k.dtype == torch.float8_e4m3fn for q, k, _ in calls)
        q8, k8, kw = calls[0]
        calls.clear()
        hf.apply(model)  # the option is set by each call
        assert torch.equal(model(ids, use_cache=False).logits, bf16)
        assert calls[0][0].dtype == torch.float32
        hf.apply(model, indexer_precision="fp8")
        hf.remove(model)
        hf.apply(model)
        assert torch.equal(model(ids, use_cache=False).logits, bf16)
    # the scales are the per-row quantisation's: the dequantised values are q and k to e4m3
    assert torch.equal(kw["q_scale"], quantize_fp8(q8.float() * kw["q_scale"][..., None])[1])
    assert 0 < rel_l2(fp8, bf16) <= 0.2
    with pytest.raises(ValueError, match=r"^mla_inductor: indexer_precision must be one of "
                                         r"\('bf16', 'fp8'\), got 'fp16'"):
        hf.apply(model, indexer_precision="fp16")


def test_indexer_precision_fp8_with_the_indexer_loss(monkeypatch):
    """With the loss on, the fp8 selection's slots are scored on the unquantised queries and keys
    (the loss's logits stay in the layer's dtype) and the loss trains the indexer."""
    from mla_inductor.integrations.transformers import indexer as ti

    model = _model("deepseek_v32").train()
    ids = _ids(2, 64)
    scored, op = [], ti.lightning_indexer_scores
    monkeypatch.setattr(ti, "lightning_indexer_scores",
                        lambda q, k, *a: scored.append((q.dtype, k.dtype)) or op(q, k, *a))
    hf.apply(model, indexer_loss=True, indexer_precision="fp8")
    out = model(ids, labels=ids, use_cache=False)
    (out.loss + hf.indexer_loss(model)).backward()
    assert scored == [(torch.float32, torch.float32)] * 2
    grads = [layer.self_attn.indexer.wq_b.weight.grad for layer in model.model.layers]
    assert all(g is not None and torch.isfinite(g).all() and g.abs().sum() > 0 for g in grads)
