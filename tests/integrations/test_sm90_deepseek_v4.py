"""GPU tests of DeepSeek-V4's attention on the Hopper kernels: one real-size DeepSeek-V4-Flash CSA
and HCA layer (transformers 5.24's ``DeepseekV4Attention``, switched by the integration, bf16),
its ``sparse_mla`` call (d_qk = d_v = 512, H 64, a sink, slots of the window and the compressed
entries with ``topk_length``) against float64 on sampled rows, and the CSA indexer's selection
(64 index heads of 128 over compressed keys, topk 512, compressed positions) against its float64
definition. Every op runs on the sm90 kernels (``use_backend("sm90")``: a fallback raises)."""

from __future__ import annotations

import math

import pytest
import torch

from mla_inductor import sparse_mla, use_backend
from mla_inductor.kernels import sm90

from conftest import rel_l2

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not sm90.available()[0], reason=sm90.available()[1] or "no sm90"),
]
deepseek_v4 = pytest.importorskip("transformers.models.deepseek_v4")

T = 4096
ROWS = 128  # sampled tokens, the last ones (their slots are full) and spread ones


def _captured_call(layer: str):
    """The switched layer's ``sparse_mla`` call at T tokens (its arguments, detached), after a
    forward + backward of the whole layer on the kernels."""
    from mla_inductor.bench.hf_v4 import LAYER_TYPES, REAL, build_layer, layer_mask, make_inputs
    from mla_inductor.integrations import transformers as hf
    from mla_inductor.integrations.transformers import deepseek_v4 as v4

    attn, rotary = build_layer(LAYER_TYPES[layer], REAL, torch.device("cuda"), torch.bfloat16)
    inputs = make_inputs(attn, rotary, T)
    calls, op = [], v4.sparse_mla
    v4.sparse_mla = lambda *a, **k: calls.append((a, k)) or op(*a, **k)
    try:
        with hf.switched(attn), use_backend("sm90"):
            out, _ = attn(hidden_states=inputs.hidden_states,
                          position_embeddings=inputs.position_embeddings,
                          position_ids=inputs.position_ids,
                          attention_mask=layer_mask(attn, inputs, "patched"))
            out.backward(inputs.grad_output)
    finally:
        v4.sparse_mla = op
    assert torch.isfinite(out).all() and torch.isfinite(inputs.hidden_states.grad).all()
    assert all(p.grad is not None for n, p in attn.named_parameters() if ".indexer." not in n)
    (q, kv, indices), kwargs = calls[0]
    return q.detach(), kv.detach(), indices, kwargs


def _reference(q, kv, indices, length, sink, sm_scale):
    """float64 out [n, H, D] with autograd through q, kv and the sink, from the definition with
    gathers: slots past ``length`` or < 0 empty, the sink in the softmax's denominator."""
    S = kv.shape[0]
    slot = torch.arange(indices.shape[1], device=indices.device)
    valid = (indices >= 0) & (indices < S) & (slot < length[:, None])
    keys = kv[torch.where(valid, indices, 0).long()] * valid[..., None]  # [n, topk, D]
    s = torch.einsum("nhd,nkd->nhk", q, keys) * sm_scale
    s = s.masked_fill(~valid[:, None, :], -math.inf)
    full = torch.cat((s, sink[None, :, None].expand(*s.shape[:2], 1)), -1)
    p = torch.exp(s - torch.logsumexp(full, -1, keepdim=True))
    return torch.einsum("nhk,nkd->nhd", p, keys)


@pytest.mark.parametrize("layer", ["csa", "hca"])
def test_layer_attention_matches_float64_on_sampled_rows(layer):
    q, kv, indices, kwargs = _captured_call(layer)
    B, _, H, D = q.shape
    assert (B, H, D) == (1, 64, 512) and kwargs["d_v"] == 512
    length, sink = kwargs["topk_length"][0], kwargs["attn_sink"].detach()
    width = indices.shape[-1]
    assert width == 128 + (512 if layer == "csa" else T // 128)
    assert length.max().item() == width and length.min().item() < width  # some slots unused
    g = torch.Generator(device="cuda").manual_seed(0)
    rows = torch.cat((torch.arange(T - ROWS // 2, T, device="cuda"),
                      torch.randint(0, T, (ROWS // 2,), device="cuda", generator=g)))
    dout = torch.randn(1, ROWS, H, D, device="cuda", generator=g, dtype=torch.bfloat16)

    q_, kv_ = q.clone().requires_grad_(), kv.clone().requires_grad_()
    sink_ = sink.clone().requires_grad_()
    with use_backend("sm90"):
        out = sparse_mla(q_, kv_, indices, sm_scale=kwargs["sm_scale"], d_v=D,
                         topk_length=kwargs["topk_length"], attn_sink=sink_)
    (out[:, rows] * dout).sum().backward()

    q64, kv64 = q[0, rows].double().requires_grad_(), kv[0].double().requires_grad_()
    sink64 = sink.double().requires_grad_()
    ref = _reference(q64, kv64, indices[0, rows], length[rows], sink64, kwargs["sm_scale"])
    (ref * dout[0].double()).sum().backward()
    for name, got, want in (("out", out[0, rows], ref.detach()), ("dq", q_.grad[0, rows], q64.grad),
                            ("dkv", kv_.grad[0], kv64.grad)):
        err, floor = rel_l2(got, want), rel_l2(want.to(torch.bfloat16), want)
        print(f"{layer} {name}: rel-L2 {err:.3e}, bf16 floor {floor:.3e}")
        assert err <= 1.5 * floor, (name, err, floor)
    d_sink_err = rel_l2(sink_.grad, sink64.grad)
    print(f"{layer} d_sink: rel-L2 {d_sink_err:.3e}")
    assert d_sink_err <= 1e-2


@pytest.mark.parametrize("fp8", [False, True])
def test_csa_indexer_selection_matches_float64(fp8):
    """The V4 CSA indexer's call: T 8192 tokens over C = T/4 compressed keys, 64 index heads of
    128, topk 512, token t seeing entries j < (t + 1) // 4, in bf16 or on q and k quantised per
    row (``apply(model, indexer_precision="fp8")``); the selected entries are the top ones of the
    float64 scores up to the rounding the indexer's own tests allow."""
    from test_sm90_lightning import _check_selection, _inputs

    from mla_inductor import lightning_indexer, quantize_fp8

    T_, C, topk = 8192, 2048, 512
    q, k, w, _ = _inputs(1, T_, C, 64, seed=3)
    scales = {}
    if fp8:
        (q, q_scale), (k, k_scale) = quantize_fp8(q), quantize_fp8(k)
        scales = dict(q_scale=q_scale, k_scale=k_scale)
    pos = ((torch.arange(T_, device="cuda") + 1) // 4 - 1).to(torch.int32)[None]
    with use_backend("sm90"):
        indices, scores = lightning_indexer(q, k, w, topk, causal=True, q_positions=pos,
                                            return_scores=True, **scales)
    _check_selection(q, k, w, pos, topk, indices, scores,
                     scales=(scales.get("q_scale"), scales.get("k_scale")))
