"""mla_inductor.integrations.transformers on GLM-5.3-Flash: a tiny random-init
``Glm5NextForConditionalGeneration`` (transformers 5.24) whose text model has two linear-attention
(KDA, transformers' PyTorch path) and three DSA layers (two with their own pooled indexer, one
``shared``), its DSA layers switched to the ops, against the same model unswitched on
transformers' eager attention (the independent reference: its own indexer's dense pool scores and
top-k, per-head expanded keys and values under the additive mask built from the selection); the
indexer loss against a float64 computation of its definition. float32, CPU (the reference
backend)."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn

from mla_inductor.integrations import transformers as hf
from mla_inductor.integrations.transformers import glm5_next
from transformers import Glm5NextConfig, Glm5NextForConditionalGeneration

from conftest import (ReturnedShapes, assert_chunked_prefill_matches,
                      assert_compiled_matches_eager, assert_same_gradients,
                      indexer_dtypes_seen, rel_l2, switched_and_back, switched_gradients,
                      tokens_by_at_least)

VOCAB = 128
LAYER_TYPES = ["linear_attention", "indexed_attention", "indexed_attention", "linear_attention",
               "indexed_attention"]
# Layer 2 reuses layer 1's selection (transformers passes it on to the next layer only).
INDEXER_TYPES = ["full", "full", "shared", "full", "full"]
# 4 heads of nope = v = 16 over a latent of 32 (no RoPE), 32 index heads of 16 (with few heads many
# pools score exactly 0 and which of the tied pools is kept changes the logits without either
# choice being wrong), index_topk 16: 4 pools of 4 keys or 1 of 16, of the 17 (4) pools of T 70.
TEXT = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
    num_hidden_layers=5, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4,
    num_experts_per_tok=2, q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16, v_head_dim=16,
    index_n_heads=32, index_head_dim=16, layer_types=LAYER_TYPES, indexer_types=INDEXER_TYPES,
    mlp_layer_types=["sparse", "dense", "dense", "sparse", "dense"], linear_num_heads=2,
    linear_head_dim=16, hc_mult=2, hc_sinkhorn_iters=4, max_position_embeddings=512,
    pad_token_id=0,
)
VISION = dict(depth=1, hidden_size=32, num_heads=2, intermediate_size=32, out_hidden_size=64,
              projection_intermediate_size=32)
KPOOLS = {"kpool4": dict(index_kpool=4, index_topk=16), "kpool16": dict(index_kpool=16,
                                                                        index_topk=16)}
T = 70  # not a multiple of either pool size


def _model(kpool: str = "kpool4", seed: int = 0, **text) -> nn.Module:
    """The tiny model, its pools' gates and position biases (ones and zeros at init) random, so
    that the pooling's softmax takes part."""
    torch.manual_seed(seed)
    config = Glm5NextConfig(text_config={**TEXT, **KPOOLS[kpool], **text}, vision_config=VISION,
                            attn_implementation="eager")
    model = Glm5NextForConditionalGeneration(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("index_kpool_compress_gate", "index_kpool_compress_ape")):
                p.normal_(0, 0.5)
    layers = model.model.language_model.layers
    assert [layer.self_attn.indexer is None for layer in layers[1:3]] == [False, True]
    return model


def _ids(B: int, T: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (B, T), generator=torch.Generator().manual_seed(seed))


def _calls(monkeypatch) -> list:
    """Records every ``sparse_mla`` call of the switched layers: ``(args, kwargs)``."""
    calls, op = [], glm5_next.sparse_mla
    monkeypatch.setattr(glm5_next, "sparse_mla",
                        lambda *a, **k: calls.append((a, k)) or op(*a, **k))
    return calls


@pytest.mark.parametrize("kpool", KPOOLS)
def test_logits_match_eager_and_remove_restores_bitwise(kpool, monkeypatch):
    """T 70, batch 2: every DSA layer switched (the linear-attention layers not), no parameter
    copied, the attention implementation left as it was; the last token attends to
    ``index_topk`` keys of pools plus the tail's (T % kpool), not to all 70; with every pool
    selected instead (index_topk 256) transformers' logits differ: the selection decides."""
    model = _model(kpool)
    ids = _ids(2, T)
    calls = _calls(monkeypatch)
    ref, out, back = switched_and_back(model, ids, 3)
    with hf.switched(model):
        assert model.config.text_config._attn_implementation == "eager"
    with torch.no_grad():
        for layer in model.model.language_model.layers:
            if getattr(layer.self_attn, "indexer", None) is not None:
                layer.self_attn.indexer.index_topk = 256
        dense = model(ids, use_cache=False).logits
    assert rel_l2(out, ref) <= 1e-5
    assert torch.equal(back, ref)
    assert rel_l2(dense, ref) > 1e-2
    (q, kv, slots), kwargs = calls[0]
    m = KPOOLS[kpool]["index_kpool"]
    assert q.shape == (2, T, 4, 32) and kv.shape == (2, T, 32) and kwargs["d_v"] == 32
    assert slots.shape == (2, T, 16 + m - 1) and slots.dtype == torch.int32
    last = slots[0, -1][slots[0, -1] >= 0]
    assert len(last) == 16 + T % m and last.tolist()[-(T % m):] == list(range(T - T % m, T))
    assert kwargs["topk_length"][0, -1] == len(last)
    assert len(calls) == 3 and calls[1][0][2] is slots  # the shared layer's are layer 1's


@pytest.mark.parametrize("kpool", KPOOLS)
def test_gradients_match_eager(kpool):
    """Every parameter's gradient of the LM loss (the indexer's, which it does not reach, None
    as unswitched; the pools' gates and position biases among them)."""
    model = _model(kpool).train()
    ids = _ids(2, T)
    ours, ref = switched_gradients(model, ids, 3)
    assert_same_gradients(ours, ref, 1e-4)
    assert sum("kv_b_proj" in k for k, g in ours.items() if g is not None) == 3
    assert all(ours[k] is None for k in ours if ".indexer." in k)


@pytest.mark.parametrize("kpool", KPOOLS)
def test_left_padding_and_padding_inside_a_row(kpool):
    """Row 1 left-padded by 11 tokens (its pools counted from its first real token); then padding
    inside the rows (row 0 hides 20..26, row 1 its first 5 and token 40), where transformers'
    tail can name a key of a selected pool (counted once). Padded positions are not compared."""
    model = _model(kpool)
    ids = _ids(2, T)
    left = torch.ones_like(ids)
    left[1, :11] = 0
    holes = torch.ones_like(ids)
    holes[0, 20:27] = holes[1, :5] = holes[1, 40] = 0
    with torch.no_grad():
        refs = [model(ids, attention_mask=mask, use_cache=False).logits for mask in (left, holes)]
        hf.apply(model)
        outs = [model(ids, attention_mask=mask, use_cache=False).logits for mask in (left, holes)]
    for mask, out, ref in zip((left, holes), outs, refs):
        keep = mask.bool()
        assert rel_l2(out[keep], ref[keep]) <= 1e-5
    assert rel_l2(outs[0][1, 11:], refs[0][0, 11:]) > 1e-2  # the padding decides


@pytest.mark.parametrize("kpool, cache", [("kpool4", "dynamic"), ("kpool16", "static")])
def test_greedy_generation_with_cache(kpool, cache, monkeypatch):
    """10 greedy tokens from a 40-token prompt, batch 2 (row 1 left-padded by 5): the prefill
    writes the latent rows and the indexer's state into the model's cache, every decoding step
    reads them through the ops (pools close during decoding); the same tokens as unswitched."""
    model = _model(kpool)
    ids = _ids(2, 40)
    mask = torch.ones_like(ids)
    mask[1, :5] = 0
    kwargs = dict(attention_mask=mask, max_new_tokens=10, min_new_tokens=10, do_sample=False,
                  pad_token_id=0, cache_implementation=cache)
    with torch.no_grad():
        ref = model.generate(ids, **kwargs)
        calls = _calls(monkeypatch)
        hf.apply(model)
        out = model.generate(ids, **kwargs)
    assert out.shape == (2, 50)
    assert torch.equal(out, ref)
    assert [a[0].shape[1] for a, _ in calls] == [40] * 3 + [1] * 3 * 9


def test_chunked_prefill_with_cache_matches_one_prefill():
    """A prompt of 50 tokens as chunks of 21, 3 and 26 tokens through the model's cache (the
    pools are formed from the cached indexer state), against the unswitched model on the same
    chunks."""
    model = _model()
    assert_chunked_prefill_matches(model, _ids(1, 50), model.config.text_config)


def test_no_tensor_of_tokens_by_pools():
    """T 600, kpool 4: P = 150 pools (every size of the model is below 150 but the index
    queries' width, 32 heads x 16): the unswitched model makes ``[B, T, T]`` visibility and
    masks, ``[B, T, 32, P]`` and ``[B, T, P]`` scores; the switched one no tensor with T in one
    size and P or more in another (the op's own chunks are not seen: one call each)."""
    model = _model()
    n = 600
    ids = _ids(1, n)
    keep = tokens_by_at_least(n, n // 4, {32 * 16})
    with torch.no_grad(), ReturnedShapes(keep) as theirs:
        model(ids, use_cache=False)
    shapes = {shape for _, shape in theirs.found}
    assert {(1, n, n), (1, n, 32, n // 4), (1, n, n // 4)} <= shapes, shapes
    hf.apply(model)
    with torch.no_grad(), ReturnedShapes(keep) as ours:
        model(ids, use_cache=False)
    assert ours.found == set()


def _layer_call(model, layer: int):
    """``(block, x, kwargs)``: decoder layer ``layer`` of the switched ``model``, hidden streams
    ``x [2, 64, hc_mult, hidden]`` requiring grad and what the model passes it (row 1's first 9
    tokens padded; a shared layer also the previous layer's slots)."""
    layers = model.model.language_model.layers
    x = torch.randn(2, 64, 2, 64, generator=torch.Generator().manual_seed(2), requires_grad=True)
    mask = torch.ones(2, 64, dtype=torch.bool)
    mask[1, :9] = False
    kwargs = dict(attention_mask=mask)
    if layers[layer].self_attn.indexer is None:
        with torch.no_grad():
            kwargs["prev_topk_indices"] = layers[layer - 1](x, attention_mask=mask)[1]
    return layers[layer], x, kwargs


@pytest.mark.slow
@pytest.mark.parametrize("layer", [1, 2], ids=["full", "shared"])
def test_decoder_layer_compiles_fullgraph(layer):
    """A switched decoder layer under torch.compile(fullgraph=True) (a graph break raises),
    forward and backward, matches the same layer in eager, with a padding mask."""
    model = _model().train()
    hf.apply(model)
    block, x, kwargs = _layer_call(model, layer)

    def run(fn):
        out = fn(x, **kwargs)[0]
        params = [x, *block.parameters()]
        return [out, *torch.autograd.grad(out.square().sum(), params, allow_unused=True)]

    assert_compiled_matches_eager(block, run)


def _reference_loss(call: dict) -> tuple[torch.Tensor, nn.Module]:
    """One full layer's indexer loss in float64 from its definition (module docstring of
    :mod:`mla_inductor.integrations.transformers.glm5_next`), written without the package from a
    float64 copy of the layer, no padding: dense pool scores, the top ``index_topk // kpool``
    pools a token sees, the tail's keys, the softmax of the per-head expanded attention over
    them, its mass per selected pool summed over heads and normalised over the pools, and the KL
    against the softmax of the pools' scores, averaged over the tokens with a pool. Returns
    ``(loss, the copy's indexer)``: autograd reaches the copy's indexer only."""
    a = copy.deepcopy(call["attn"]).double()
    m = a.indexer
    x = call["hidden_states"].detach().double()
    B, n, _ = x.shape
    kpool, H, D = m.index_kpool, a.num_heads, a.qk_nope_head_dim
    P = n // kpool
    t = torch.arange(n)
    with torch.no_grad():
        q_resid = a.q_a_layernorm(a.q_a_proj(x))
        q = a.q_b_proj(q_resid).view(B, n, H, D)
        k = a.kv_b_proj(a.kv_a_layernorm(a.kv_a_proj_with_mqa(x))).view(B, n, H, 2 * D)[..., :D]
        attn_scores = torch.einsum("bthd,bshd->bhts", q, k) * a.scaling
    keys = m.k_norm(m.wk(x))[:, :P * kpool].view(B, P, kpool, -1)
    gates = (x @ m.index_kpool_compress_gate.T)[:, :P * kpool].view(B, P, kpool, -1)
    pooled = ((gates + m.index_kpool_compress_ape).softmax(2) * keys).sum(2)  # [B, P, Di]
    q_i = m.wq_b(q_resid).view(B, n, m.n_heads, m.head_dim)
    w = m.weights_proj(x) * m.n_heads**-0.5
    logits = torch.einsum("bth,bthp->btp", w,
                          (torch.einsum("bthd,bpd->bthp", q_i, pooled) * m.softmax_scale).relu())
    seen = (torch.arange(P) + 1) * kpool - 1 <= t[:, None]  # [T, P]: the pool's last key seen
    top = logits.detach().masked_fill(~seen, -math.inf).topk(min(m.index_topk // kpool, P)).indices
    chosen = torch.zeros(B, n, P, dtype=torch.bool).scatter(-1, top, True) & seen
    pool_of = torch.arange(n) // kpool  # key -> its pool (P for the unfinished one)
    keys_chosen = chosen.gather(-1, pool_of.clamp(max=P - 1).expand(B, n, n)) & (pool_of < P)
    tail = (pool_of[None] == (t[:, None] + 1) // kpool) & (torch.arange(n) <= t[:, None])
    attended = keys_chosen | tail  # [B, T, S]
    probs = attn_scores.masked_fill(~attended[:, None], -math.inf).softmax(-1).sum(1)
    mass = torch.zeros(B, n, P + 1, dtype=torch.float64).scatter_add(
        -1, pool_of.expand(B, n, n), probs)[..., :P].masked_fill(~chosen, 0)
    target = mass / mass.sum(-1, keepdim=True).clamp_min(1e-300)
    log_p = logits.masked_fill(~chosen, -math.inf).log_softmax(-1)
    kl = torch.where(chosen, torch.xlogy(target, target) - target * log_p, 0.0).sum(-1)
    rows = chosen.any(-1)
    return kl[rows].sum() / rows.sum(), m


def test_indexer_loss_and_its_gradient_match_the_float64_definition(monkeypatch):
    """``apply(model, indexer_loss=True)``, weights of std 0.2 (at 0.02 both distributions are
    nearly uniform): the loss of a forward, the mean over the two full layers (the shared layer
    has no indexer), and every indexer parameter's gradient from it (the pools' gates and
    position biases included) against float64; its gradient reaches nothing else, and the LM
    loss's logits are bitwise those without the option."""
    model = _model(initializer_range=0.2).train()
    ids = _ids(2, T)
    with torch.no_grad():
        hf.apply(model)
        plain = model(ids, use_cache=False).logits
    calls = []
    for layer in model.model.language_model.layers:
        if getattr(layer.self_attn, "indexer", None) is not None:
            layer.self_attn.register_forward_pre_hook(
                lambda mod, args, kw: calls.append(dict(attn=mod, **kw)), with_kwargs=True)
    assert hf.apply(model, indexer_loss=True) == 0
    out = model(ids, use_cache=False).logits
    ours = hf.indexer_loss(model)
    assert torch.equal(out, plain) and len(calls) == 2
    found = [_reference_loss(call) for call in calls]
    ref = torch.stack([loss for loss, _ in found]).mean()
    assert 0.05 < ref.item() < 10  # not a nearly uniform pair of distributions
    assert abs(ours.item() - ref.item()) <= 1e-5 * ref.item()
    ours.backward()
    ref.backward()
    trained = set()
    for call, (_, copy64) in zip(calls, found):
        for (k, p), (_, p64) in zip(call["attn"].indexer.named_parameters(),
                                    copy64.named_parameters()):
            assert rel_l2(p.grad, p64.grad) <= 1e-4, k
            trained.add(p)
    assert len(trained) == 2 * 7  # wq_b, wk, k_norm (2), weights_proj, gate, ape
    for k, p in model.named_parameters():
        if p not in trained:
            assert p.grad is None or not p.grad.any(), k


def test_indexer_precision_fp8(monkeypatch):
    """``indexer_precision="fp8"``: each full layer selects its pools on float8_e4m3fn queries and
    pooled keys with their per-row scales; the logits stay near the default selection's."""
    model = _model()
    ids = _ids(1, T)
    calls = indexer_dtypes_seen(monkeypatch, glm5_next)
    with torch.no_grad():
        hf.apply(model)
        default = model(ids, use_cache=False).logits
        hf.apply(model, indexer_precision="fp8")
        fp8 = model(ids, use_cache=False).logits
    plain, quantised = (torch.float32,) * 2, (torch.float8_e4m3fn,) * 2
    assert calls == [(*plain, ["causal", "q_positions"])] * 2 + [
        (*quantised, ["causal", "k_scale", "q_positions", "q_scale"])] * 2
    assert 0 < rel_l2(fp8, default) <= 0.2


def test_errors():
    model = _model().train()
    hf.apply(model)
    block, x, kwargs = _layer_call(model, 2)
    attn = block.self_attn
    with pytest.raises(RuntimeError, match=r"^mla_inductor: layer 2 reuses the previous layer's "
                                           r"selection \(a 'shared' indexer layer\)"):
        attn(x[:, :, 0], attention_mask=kwargs["attention_mask"])
    with pytest.raises(RuntimeError, match=r"^mla_inductor: the switched attention needs the "
                                           r"model's attention mask \(the 2D padding mask"):
        attn(x[:, :, 0], attention_mask=None, prev_topk_indices=kwargs["prev_topk_indices"])
    with pytest.raises(RuntimeError, match=r"^mla_inductor: the switched Glm5NextTextAttention "
                                           r"takes the 2D padding mask .*got a mask of shape "
                                           r"\(2, 1, 64, 64\)"):
        attn(x[:, :, 0], attention_mask=torch.ones(2, 1, 64, 64, dtype=torch.bool))
    attn.attention_dropout = 0.1
    with pytest.raises(RuntimeError, match="^mla_inductor: attention_dropout=0.1 is not supported"):
        model(_ids(1, 8), use_cache=False)
