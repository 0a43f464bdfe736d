"""GPU tests of GLM-5.3-Flash's DSA layer on the Hopper kernels: one real-size layer
(transformers 5.24's ``Glm5NextTextAttention``: 64 heads, kv_lora 512, no RoPE, an indexer of 32
heads x 128 over pools of 4 keys, index_topk 2048), switched by the integration, bf16, forward +
backward at T 4096; its ``sparse_mla`` call (d_qk = d_v = 512, H 64, no sink, 2051 slots a token
with ``topk_length``) against float64 on sampled rows, within 1.5x the bf16 floor (the error of
the float64 result rounded to bf16) for the output and both gradients; the pooled indexer's
selection (the layer's own ``lightning_indexer`` call over T/4 pooled keys, topk 512, token t
seeing the pools up to ``(t + 1) // 4 - 1``), in bf16 and with ``indexer_precision="fp8"``,
against its float64 definition. Every op runs on the sm90 kernels (``use_backend("sm90")``: a
fallback raises)."""

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
pytest.importorskip("transformers.models.glm5_next")

T = 4096
KPOOL = 4
ROWS = 128  # sampled tokens, the last ones (their slots are full) and spread ones


def _captured_calls(precision: str = "bf16") -> dict:
    """The switched layer's ``sparse_mla`` and ``lightning_indexer`` calls at T tokens (their
    arguments), after a forward + backward of the whole layer on the kernels, with every
    parameter but the indexer's (which the output does not reach) given a finite gradient."""
    from mla_inductor.bench.hf_glm5_next import REAL, build_layer, captured_calls, make_inputs
    from mla_inductor.integrations import transformers as hf

    attn = build_layer(REAL, KPOOL, torch.device("cuda"), torch.bfloat16)
    inputs = make_inputs(attn, T)

    def step():
        out = attn(hidden_states=inputs.hidden_states, attention_mask=inputs.attention_mask)[0]
        out.backward(inputs.grad_output)
        assert torch.isfinite(out).all()

    with hf.switched(attn, indexer_precision=precision), use_backend("sm90"):
        calls = captured_calls(step)
    assert torch.isfinite(inputs.hidden_states.grad).all()
    for name, p in attn.named_parameters():
        assert (p.grad is None) == name.startswith("indexer."), name
        assert p.grad is None or torch.isfinite(p.grad).all(), name
    return calls


def _reference(q, kv, indices, length, sm_scale):
    """float64 out [n, H, D] with autograd through q and kv, from the definition with gathers:
    slots past ``length`` or < 0 empty."""
    S = kv.shape[0]
    slot = torch.arange(indices.shape[1], device=indices.device)
    valid = (indices >= 0) & (indices < S) & (slot < length[:, None])
    keys = kv[torch.where(valid, indices, 0).long()] * valid[..., None]  # [n, topk, D]
    s = torch.einsum("nhd,nkd->nhk", q, keys) * sm_scale
    s = s.masked_fill(~valid[:, None, :], -math.inf)
    return torch.einsum("nhk,nkd->nhd", s.softmax(-1), keys)


def test_layer_attention_matches_float64_on_sampled_rows():
    calls = _captured_calls()
    (q, kv, indices), kwargs = calls["sparse_mla"]
    q, kv = q.detach(), kv.detach()
    B, _, H, D = q.shape
    assert (B, H, D) == (1, 64, 512) and kwargs["d_v"] == 512 and "attn_sink" not in kwargs
    length = kwargs["topk_length"][0]
    assert indices.shape[-1] == 2048 + KPOOL - 1
    assert length.max().item() <= indices.shape[-1] and length[-1].item() >= 2048
    g = torch.Generator(device="cuda").manual_seed(0)
    rows = torch.cat((torch.arange(T - ROWS // 2, T, device="cuda"),
                      torch.randint(0, T, (ROWS // 2,), device="cuda", generator=g)))
    dout = torch.randn(1, ROWS, H, D, device="cuda", generator=g, dtype=torch.bfloat16)

    q_, kv_ = q.clone().requires_grad_(), kv.clone().requires_grad_()
    with use_backend("sm90"):
        out = sparse_mla(q_, kv_, indices, sm_scale=kwargs["sm_scale"], d_v=D,
                         topk_length=kwargs["topk_length"])
    (out[:, rows] * dout).sum().backward()

    q64, kv64 = q[0, rows].double().requires_grad_(), kv[0].double().requires_grad_()
    ref = _reference(q64, kv64, indices[0, rows], length[rows], kwargs["sm_scale"])
    (ref * dout[0].double()).sum().backward()
    for name, got, want in (("out", out[0, rows], ref.detach()), ("dq", q_.grad[0, rows], q64.grad),
                            ("dkv", kv_.grad[0], kv64.grad)):
        err, floor = rel_l2(got, want), rel_l2(want.to(torch.bfloat16), want)
        print(f"{name}: rel-L2 {err:.3e}, bf16 floor {floor:.3e}")
        assert err <= 1.5 * floor, (name, err, floor)


@pytest.mark.parametrize("precision", ["bf16", "fp8"])
def test_pooled_indexer_selection_matches_float64(precision):
    """The layer's own ``lightning_indexer`` call (32 heads over T/4 pooled keys, topk 512,
    each token's pools up to ``(t + 1) // 4 - 1``): the selected pools are the top ones of the
    float64 scores up to the rounding the indexer's own tests allow; in fp8, the scores of the
    per-row quantised queries and keys with their scales."""
    from test_sm90_lightning import _check_selection

    from mla_inductor import lightning_indexer

    (q, k, w, topk), kwargs = _captured_calls(precision)["lightning_indexer"]
    pos = kwargs["q_positions"]
    assert q.shape == (1, T, 32, 128) and k.shape == (1, T // KPOOL, 128) and topk == 512
    assert torch.equal(pos[0].cpu(), (torch.arange(T) + 1) // KPOOL - 1)
    scales = {name: kwargs[name] for name in ("q_scale", "k_scale") if name in kwargs}
    assert (q.dtype == torch.float8_e4m3fn) == (precision == "fp8") == bool(scales)
    with use_backend("sm90"):
        indices, scores = lightning_indexer(q, k, w, topk, causal=True, q_positions=pos,
                                            return_scores=True, **scales)
    _check_selection(q, k, w, pos, topk, indices, scores,
                     scales=(scales.get("q_scale"), scales.get("k_scale")))
