"""GPU: the integrations' switched attention layers at real sizes on the Hopper kernels, compiled
with ``dynamic=True`` and with ``mode="reduce-overhead"`` (CUDA graphs), forward and backward at
two token counts: the same outputs and gradients as the switched layer in eager (the same
kernels; inductor's fusions round the elementwise code around them differently, so bf16
tolerances, and in a CSA layer that rounding can flip the indexer's pick of a near-tied entry:
2.2% of a weight gradient's norm at T 3072 on an H100, 2026-12-07), no recompile for the second T under ``dynamic=True``, and no CUDA-graph skip. Every op runs on sm90
(``use_backend("sm90")``: a fallback raises)."""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters

from mla_inductor import use_backend
from mla_inductor.kernels import sm90

from conftest import rel_l2

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not sm90.available()[0], reason=sm90.available()[1] or "no sm90"),
]
pytest.importorskip("transformers.models.deepseek_v4")

TS = (2048, 3072)


def _v32():
    from mla_inductor.bench import hf

    attn, rotary = hf.build_layer(hf.REAL, 2048, torch.device("cuda"), torch.bfloat16)
    return attn, lambda T: hf.make_inputs(attn, rotary, T), lambda inputs: hf.visibility(inputs)


def _v4(layer_type: str):
    from mla_inductor.bench import hf_v4

    attn, rotary = hf_v4.build_layer(layer_type, hf_v4.REAL, torch.device("cuda"), torch.bfloat16)
    return (attn, lambda T: hf_v4.make_inputs(attn, rotary, T),
            lambda inputs: hf_v4.layer_mask(attn, inputs, "patched"))


LAYERS = {
    "deepseek_v32": _v32,
    "deepseek_v4_sliding": lambda: _v4("sliding_attention"),
    "deepseek_v4_csa": lambda: _v4("compressed_sparse_attention"),
    "deepseek_v4_hca": lambda: _v4("heavily_compressed_attention"),
}


def _step(fn, attn, inputs, mask) -> list:
    out, _ = fn(hidden_states=inputs.hidden_states, position_embeddings=inputs.position_embeddings,
                attention_mask=mask, position_ids=inputs.position_ids)
    params = [inputs.hidden_states, *(p for p in attn.parameters() if p.requires_grad)]
    grads = torch.autograd.grad(out, params, inputs.grad_output, allow_unused=True)
    return [out.detach().clone(), *(None if g is None else g.clone() for g in grads)]


@pytest.mark.parametrize("mode", ["dynamic", "reduce-overhead"])
@pytest.mark.parametrize("name", list(LAYERS))
def test_compiled_switched_layer_matches_eager(name, mode):
    from mla_inductor.integrations import transformers as hf

    attn, make_inputs, make_mask = LAYERS[name]()
    torch._dynamo.reset()
    skips = counters["inductor"]["cudagraph_skips"]
    kwargs = dict(dynamic=True) if mode == "dynamic" else dict(mode="reduce-overhead")
    with hf.switched(attn), use_backend("sm90"):
        compiled = torch.compile(attn, fullgraph=True, **kwargs)
        for i, T in enumerate(TS):
            inputs = make_inputs(T)
            want = _step(attn, attn, inputs, make_mask(inputs))
            # dynamic=True: the second T runs the first T's graph (a recompile raises)
            with torch._dynamo.config.patch(error_on_recompile=mode == "dynamic" and i > 0):
                for _ in range(2):  # reduce-overhead records on a later call, then replays
                    got = _step(compiled, attn, inputs, make_mask(inputs))
            for g, w in zip(got, want):
                assert (g is None) == (w is None)
                if w is not None:
                    assert torch.isfinite(g).all() and rel_l2(g, w) <= 5e-2, (name, T)
    assert counters["inductor"]["cudagraph_skips"] == skips
