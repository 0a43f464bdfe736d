"""Each integrated model family's switched decoder layer under ``torch.compile(fullgraph=True,
dynamic=True)``, forward and backward, over three token counts (one of them not a multiple of
DeepSeek-V4's compression rates 4 and 16, nor of GLM-5.3-Flash's pool size 4): the same values as the layer in eager, and one graph
for every T. A family added to ``integrations.transformers`` adds its layers to ``LAYERS``.

The models are the tiny random ones of the families' own tests (float32, CPU, the reference
backend)."""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.eval_frame import _debug_get_cache_entry_list
from torch._dynamo.testing import CompileCounterWithBackend

import test_transformers as v32_glm5
import test_transformers_deepseek_v4 as v4
import test_transformers_glm5_next as glm5_next
from mla_inductor.integrations import transformers as hf
from mla_inductor.integrations.transformers.visibility import Visibility

from conftest import rel_l2

TS = (40, 64, 77)


def _v32_glm5_layer(name: str):
    """Layer 0 of a tiny DeepSeek-V3.2 or GLM-5 model (its own indexer), and its inputs at T."""
    model = v32_glm5._model(name).train()
    hf.apply(model)

    def inputs(T: int, seed: int):
        x = torch.randn(2, T, model.config.hidden_size, generator=torch.Generator().manual_seed(seed))
        kwargs = v32_glm5._layer_kwargs(model, x)
        kwargs["attention_mask"] = Visibility(torch.arange(T), None)
        return x.requires_grad_(), kwargs

    return model.model.layers[0], inputs


def _v4_layer(index: int):
    """Layer ``index`` of the tiny DeepSeek-V4 model (sliding, CSA, HCA), and its inputs at T."""
    model = v4._model().train()
    hf.apply(model)

    def inputs(T: int, seed: int):
        x = torch.randn(2, T, model.config.hc_mult, model.config.hidden_size,
                        generator=torch.Generator().manual_seed(seed))
        pos = torch.arange(T)[None]
        emb = {k: model.model.rotary_emb(x, pos, layer_type=k) for k in ("main", "compress")}
        keys = torch.ones(2, T, dtype=torch.bool)
        keys[1, :9] = False  # row 1: left padding
        return x.requires_grad_(), dict(
            position_embeddings=emb, position_ids=pos,
            attention_mask=Visibility(torch.arange(T), keys, model.config.sliding_window))

    return model.model.layers[index], inputs


def _glm5_next_layer(index: int):
    """Decoder layer ``index`` of the tiny GLM-5.3-Flash model (1: a full indexer layer, 2: a
    shared one, given the previous layer's slots), and its inputs at T (row 1 left-padded)."""
    model = glm5_next._model().train()
    hf.apply(model)
    layers = model.model.language_model.layers

    def inputs(T: int, seed: int):
        x = torch.randn(2, T, 2, 64, generator=torch.Generator().manual_seed(seed))
        mask = torch.ones(2, T, dtype=torch.bool)
        mask[1, :9] = False
        kwargs = dict(attention_mask=mask)
        if layers[index].self_attn.indexer is None:
            with torch.no_grad():
                kwargs["prev_topk_indices"] = layers[index - 1](x, attention_mask=mask)[1]
        return x.requires_grad_(), kwargs

    return layers[index], inputs


LAYERS = {
    "deepseek_v32": lambda: _v32_glm5_layer("deepseek_v32"),
    "glm_moe_dsa": lambda: _v32_glm5_layer("glm_moe_dsa"),
    "deepseek_v4_sliding": lambda: _v4_layer(0),
    "deepseek_v4_csa": lambda: _v4_layer(1),
    "deepseek_v4_hca": lambda: _v4_layer(2),
    "glm5_next_full": lambda: _glm5_next_layer(1),
    "glm5_next_shared": lambda: _glm5_next_layer(2),
}


def _forward_backward(fn, layer, x, kwargs) -> list:
    out = fn(x, **kwargs)
    out = out[0] if isinstance(out, tuple) else out  # GLM's layers also return their top-k
    params = [x, *layer.parameters()]
    grads = torch.autograd.grad(out.square().sum(), params, allow_unused=True)
    return [out, *grads]


@pytest.mark.parametrize("name", list(LAYERS))
def test_switched_layer_compiles_once_under_dynamic(name):
    layer, inputs = LAYERS[name]()
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(layer, backend=counter, fullgraph=True, dynamic=True)
    for T in TS:
        got = _forward_backward(compiled, layer, *inputs(T, seed=T))
        want = _forward_backward(layer, layer, *inputs(T, seed=T))
        assert len(got) == len(want)
        for g, w in zip(got, want):
            assert (g is None) == (w is None)
            if w is not None:
                assert rel_l2(g, w) <= 1e-6, (name, T)
    assert len(_debug_get_cache_entry_list(type(layer).forward.__code__)) == 1
