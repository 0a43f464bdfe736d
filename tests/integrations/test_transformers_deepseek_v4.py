"""mla_inductor.integrations.transformers on DeepSeek-V4: a tiny random-init
``DeepseekV4ForCausalLM`` (transformers 5.24) with all three layer types (sliding window, CSA,
HCA) switched to the op, against the same model unswitched on transformers' eager attention (the
independent reference: dense attention over the window keys and every compressed entry under
its additive mask and block bias). float32, CPU (the reference backend)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from mla_inductor.integrations import transformers as hf
from mla_inductor.integrations.transformers import deepseek_v4
from mla_inductor.integrations.transformers.visibility import Visibility
from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

from conftest import (ReturnedShapes, assert_chunked_prefill_matches,
                      assert_compiled_matches_eager, assert_same_gradients,
                      indexer_dtypes_seen, rel_l2, switched_and_back, switched_gradients,
                      tokens_by_at_least)

VOCAB = 128
LAYER_TYPES = ["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"]
ROPE = {"rope_type": "default", "partial_rotary_factor": 0.25}
# Window 8, CSA entries of m = 4 tokens (index_topk 6 of them), HCA entries of 16. 32 index heads:
# with few heads many entries score exactly 0 (every head's relu 0) and which of the tied entries
# is kept (torch.topk's order unswitched, the smaller entry index on the op) changes the logits
# without either choice being wrong.
TINY = dict(
    vocab_size=VOCAB, hidden_size=64, moe_intermediate_size=32, num_hidden_layers=3,
    num_attention_heads=4, head_dim=64, q_lora_rank=32, n_routed_experts=4, num_experts_per_tok=2,
    layer_types=LAYER_TYPES, mlp_layer_types=["moe"] * 3,
    compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 16},
    sliding_window=8, o_groups=2, o_lora_rank=16, index_n_heads=32, index_head_dim=32,
    index_topk=6, hc_mult=2, max_position_embeddings=512, attn_implementation="eager",
    rope_parameters={"main": dict(ROPE, rope_theta=10000.0),
                     "compress": dict(ROPE, rope_theta=160000.0)},
)


def _model(seed: int = 0) -> nn.Module:
    """The tiny model, its sinks and the compressors' position biases (zero at init) random, so
    that they take part."""
    torch.manual_seed(seed)
    model = DeepseekV4ForCausalLM(DeepseekV4Config(**TINY)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("sinks", "position_bias")):
                p.normal_(0, 0.5)
    assert [layer.self_attn.layer_type for layer in model.model.layers] == LAYER_TYPES
    return model


def _ids(B: int, T: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (B, T), generator=torch.Generator().manual_seed(seed))


def test_logits_match_eager_and_remove_restores_bitwise():
    """T 70: 17 CSA entries (more than index_topk 6, so the indexer selects), 4 HCA entries and a
    partial last window of each."""
    model = _model()
    ids = _ids(2, 70)
    ref, out, back = switched_and_back(model, ids, 3)
    assert rel_l2(out, ref) <= 1e-5
    assert torch.equal(back, ref)


def test_gradients_match_eager():
    """Every parameter's gradient, the compressors', the sinks' and the indexer's (which the LM
    loss does not reach, as unswitched: None) included."""
    model = _model().train()
    ids = _ids(2, 70)
    ours, ref = switched_gradients(model, ids, 3)
    assert_same_gradients(ours, ref, 1e-4)
    for part in ("compressor.kv_proj", "compressor.gate_proj", "compressor.position_bias",
                 "sinks"):
        assert sum(part in k for k, g in ours.items() if g is not None) >= 2, part
    assert all(ours[k] is None for k in ours if ".indexer." in k)


def test_batch_with_left_padding():
    """Row 1 is left-padded by 11 tokens, on the positions and key padding the switched model
    builds, and on the model's dense additive mask (its attention implementation set back to
    eager after apply: every window key a slot). Padded positions are not compared."""
    model = _model()
    ids = _ids(2, 70)
    mask = torch.ones_like(ids)
    mask[1, :11] = 0
    with torch.no_grad():
        ref = model(ids, attention_mask=mask, use_cache=False).logits
        hf.apply(model)
        out = model(ids, attention_mask=mask, use_cache=False).logits
        model.set_attn_implementation("eager")
        out_dense = model(ids, attention_mask=mask, use_cache=False).logits
    keep = mask.bool()
    assert rel_l2(out[keep], ref[keep]) <= 1e-5
    assert rel_l2(out_dense[keep], ref[keep]) <= 1e-5
    assert rel_l2(out[1, 11:], ref[0, 11:]) > 1e-2  # the padding decides


def test_packed_sequences_and_holes_match_eager():
    """Packed sequences (position_ids restarting, no mask: transformers' dense mask, which the
    switched model takes as it is; the compressed entries follow transformers' rule) and a 2D mask
    with a hole in the middle of a row. Hidden positions are not compared."""
    model = _model()
    ids = _ids(2, 70)
    packed = torch.cat((torch.arange(30), torch.arange(40)))[None].expand(2, 70)
    mask = torch.ones_like(ids)
    mask[0, 20:30] = 0
    with torch.no_grad():
        ref_packed = model(ids, position_ids=packed, use_cache=False).logits
        ref = model(ids, attention_mask=mask, use_cache=False).logits
        hf.apply(model)
        out_packed = model(ids, position_ids=packed, use_cache=False).logits
        out = model(ids, attention_mask=mask, use_cache=False).logits
        plain = model(ids, use_cache=False).logits
    assert rel_l2(out_packed, ref_packed) <= 1e-5
    assert rel_l2(out_packed[:, 30:], plain[:, 30:]) > 1e-2
    keep = mask.bool()
    assert rel_l2(out[keep], ref[keep]) <= 1e-5


def test_no_tensor_of_tokens_by_keys():
    """T = 600, C = 150 CSA entries (every other size of the model is at most 128, but the query
    projections' widths, 4 heads x 64 and 32 index heads x 32): the unswitched
    model makes ``[B, 1, T, T]`` masks, ``[B, 1, T, C]`` biases and ``[B, T, C]`` indexer scores;
    the switched one makes no tensor with T in one size and C or more in another (the op's own
    chunks are not seen: it is one call here). Its slots are ``[B, T, W + index_topk]`` (CSA) and
    ``[B, T, W + T/16]`` (HCA)."""
    model = _model()
    T = 600
    ids = _ids(1, T)
    keep = tokens_by_at_least(T, T // 4, {4 * 64, 32 * 32})
    with torch.no_grad(), ReturnedShapes(keep) as theirs:
        model(ids, use_cache=False)
    shapes = {shape for _, shape in theirs.found}
    assert {(1, 1, T, T), (1, 1, T, T // 4), (1, T, T // 4)} <= shapes, shapes
    hf.apply(model)
    with torch.no_grad(), ReturnedShapes(keep) as ours:
        model(ids, use_cache=False)
    assert ours.found == set()


@pytest.mark.parametrize("prompt", [40, 63], ids=["prompt40", "prompt63"])
def test_greedy_generation_with_cache(prompt, monkeypatch):
    """12 greedy tokens from a prompt of a batch of 2 (row 1 left-padded by 5): the prefill writes
    the sliding keys, the compressors' buffers, entries and overlap state into the model's cache,
    and every decode step reads them through the op; windows close during decoding (CSA every 4
    tokens, HCA at 48 and 64)."""
    model = _model()
    ids = _ids(2, prompt)
    mask = torch.ones_like(ids)
    mask[1, :5] = 0
    kwargs = dict(attention_mask=mask, max_new_tokens=12, min_new_tokens=12, do_sample=False,
                  pad_token_id=0)
    with torch.no_grad():
        ref = model.generate(ids, **kwargs)
        calls, op = [], deepseek_v4.sparse_mla
        monkeypatch.setattr(deepseek_v4, "sparse_mla",
                            lambda q, *a, **k: calls.append(q.shape[1]) or op(q, *a, **k))
        hf.apply(model)
        out = model.generate(ids, **kwargs)
    assert out.shape == (2, prompt + 12)
    assert torch.equal(out, ref)
    assert calls == [prompt] * 3 + [1] * 3 * 11  # prefill, then one token per layer and step


def test_chunked_prefill_with_cache_matches_one_prefill():
    """A prompt of 50 tokens as chunks of 21, 3 and 26 tokens through the model's cache (the
    compressors' buffers and overlap state carry over between the chunks), against the
    unswitched model on the same chunks."""
    model = _model()
    assert_chunked_prefill_matches(model, _ids(1, 50), model.config)


@pytest.mark.parametrize("layer", [0, 1, 2], ids=LAYER_TYPES)
def test_decoder_layer_compiles_fullgraph(layer):
    """A switched decoder layer under torch.compile(fullgraph=True) (a graph break raises), forward
    and backward, matches the same layer in eager, on positions with the sliding window and a key
    padding mask (row 1 hides its first 9 keys)."""
    model = _model().train()
    hf.apply(model)
    block = model.model.layers[layer]
    B, T = 2, 64
    x = torch.randn(B, T, model.config.hc_mult, model.config.hidden_size, requires_grad=True)
    pos = torch.arange(T)[None]
    keys = torch.ones(B, T, dtype=torch.bool)
    keys[1, :9] = False
    emb = {kind: model.model.rotary_emb(x, pos, layer_type=kind) for kind in ("main", "compress")}
    kwargs = dict(position_embeddings=emb, position_ids=pos,
                  attention_mask=Visibility(torch.arange(T), keys, model.config.sliding_window))

    def run(fn):
        out = fn(x, **kwargs)
        params = [x, *block.parameters()]
        return [out, *torch.autograd.grad(out.square().sum(), params, allow_unused=True)]

    assert_compiled_matches_eager(block, run)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_model_cast_to_half_precision_runs_switched(dtype):
    """``model.to(bfloat16)`` / ``.half()`` (the sinks in that dtype too) runs switched: its logits
    and each layer's sink gradient (in the sinks' dtype) as close to the float32 model's as the
    unswitched half model's own (within 1.5x its error, plus 1e-3), and two SGD steps with a
    finite loss. T 24: 6 CSA entries, all within index_topk, so that the comparison is of the
    attention's arithmetic in half precision (at T 40 the fp16 indexer's near-tied entries fall
    either way: a 9.6e-3 logits error against the unswitched model's 1.1e-3, measured
    2026-12-07)."""
    ids = _ids(2, 24)

    def step_of(model):
        out = model(ids, labels=ids, use_cache=False)
        out.loss.backward()
        return out, [layer.self_attn.sinks.grad for layer in model.model.layers]

    ref, ref_sinks = step_of(_model().train())
    unswitched, unswitched_sinks = step_of(_model().to(dtype).train())
    model = _model().to(dtype).train()
    assert hf.apply(model) == 3
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)  # AdamW's eps 1e-8 is 0 in fp16
    for step in range(2):
        out, sinks = step_of(model)
        assert torch.isfinite(out.loss) and out.logits.dtype == dtype
        if step == 0:
            assert (rel_l2(out.logits, ref.logits)
                    <= 1.5 * rel_l2(unswitched.logits, ref.logits) + 1e-3)
            for grad, own, want in zip(sinks, unswitched_sinks, ref_sinks):
                assert grad.dtype == dtype
                assert rel_l2(grad, want) <= 1.5 * rel_l2(own, want) + 1e-3
        optimizer.step()
        optimizer.zero_grad()


def test_the_indexer_loss_is_not_offered():
    model = _model()
    with pytest.raises(ValueError, match=r"^mla_inductor: indexer_loss=True is not offered for "
                                         r"model.layers.0.self_attn \(DeepseekV4Attention\)"):
        hf.apply(model, indexer_loss=True)
    assert not any(deepseek_v4.forward is getattr(m.__dict__.get("forward"), "__func__", None)
                   for m in model.modules())


def test_errors():
    model = _model().train()
    hf.apply(model)
    model.model.layers[1].self_attn.attention_dropout = 0.1
    with pytest.raises(RuntimeError, match="^mla_inductor: attention_dropout=0.1 is not supported"):
        model(_ids(1, 8), use_cache=False)


def test_indexer_precision_fp8(monkeypatch):
    """``indexer_precision="fp8"``: the CSA indexer selects on float8_e4m3fn queries and keys
    with their per-row scales; the logits stay near the default selection's; the HCA and sliding
    layers have no indexer and are unchanged."""
    model = _model()
    ids = _ids(1, 70)
    calls = indexer_dtypes_seen(monkeypatch, deepseek_v4)
    with torch.no_grad():
        hf.apply(model)
        default = model(ids, use_cache=False).logits
        hf.apply(model, indexer_precision="fp8")
        fp8 = model(ids, use_cache=False).logits
    assert calls == [(torch.float32, torch.float32, ["causal", "q_positions"]),
                     (torch.float8_e4m3fn, torch.float8_e4m3fn,
                      ["causal", "k_scale", "q_positions", "q_scale"])]
    assert 0 < rel_l2(fp8, default) <= 0.2
