"""The Hopper kernels' DSA features against fp64 autograd: causal positions, an attention sink,
max_logits (under both thresholds) and a gradient reaching lse.

Kernel level (``mla_inductor.kernels.sm90.fwd.forward`` / ``bwd.backward``); the op-level API is
tested on every backend elsewhere. GPU only (SM90).
"""

from __future__ import annotations

import math

import pytest
import torch

pytestmark = pytest.mark.cuda

if not (torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)):
    pytest.skip("needs an SM90 GPU", allow_module_level=True)

from conftest import rel_l2  # noqa: E402

from mla_inductor.kernels.sm90 import bwd, fwd  # noqa: E402

D_QK, D_V = 576, 512


def _reference(q, kv, indices, sm_scale, q_positions, sink):
    """fp64 out, lse (sink in the denominator), max_logits (sink excluded) with autograd
    through q, kv and the sink; written here from the definitions, with gathers."""
    S = kv.shape[0]
    idx = indices.long()
    valid = (idx >= 0) & (idx < S)
    if q_positions is not None:
        valid &= idx <= q_positions.long()[:, None]
    keys = kv[torch.where(valid, idx, 0)] * valid[..., None]  # [T, topk, d_qk]
    s = torch.einsum("thd,tkd->thk", q, keys) * sm_scale
    s = s.masked_fill(~valid[:, None, :], -math.inf)
    max_logits = s.detach().amax(-1)
    full = s if sink is None else torch.cat((s, sink[None, :, None].expand(*s.shape[:2], 1)), -1)
    lse = torch.logsumexp(full, dim=-1)
    p = torch.exp(s - torch.where(torch.isinf(lse), 0.0, lse)[..., None])
    return torch.einsum("thk,tkd->thd", p, keys[..., :D_V]), lse, max_logits


def _case(T, H, S, topk, seed, peaked=False):
    g = torch.Generator(device="cpu").manual_seed(seed)
    kv = torch.randn(S, D_QK, generator=g)
    indices = torch.randint(0, S, (T, topk), generator=g, dtype=torch.int32)
    indices[:, 0] = torch.arange(T) * (S // T)  # each token's "own" key in slot 0
    indices[0, 1:4] = torch.tensor([-1, S, 2**31 - 1])
    q = torch.randn(T, H, D_QK, generator=g)
    if peaked:  # the own key dominates: with the lazy max its running max is stale
        q = q * 0.1 + 0.5 * kv[indices[:, 0].long()][:, None, :]
    positions = torch.randint(-3, S, (T,), generator=g, dtype=torch.int32)
    positions[1] = -1  # every slot of this token is in the future: a row without a valid key
    sink = torch.randn(H, generator=g) * 2
    sink[0] = -math.inf  # no sink for this head
    sink[1] = 30.0  # a sink that dominates
    to = lambda x: x.cuda()  # noqa: E731
    return (to(q.bfloat16()), to(kv.bfloat16()), to(indices), to(positions), to(sink))


@pytest.mark.parametrize("threshold", [0.0, 8.0])
@pytest.mark.parametrize("H", [16, 128])
@pytest.mark.parametrize("causal,with_sink", [(True, True), (True, False), (False, True)])
def test_features_forward_and_backward_vs_fp64(threshold, H, causal, with_sink):
    T, S, topk = 48, 1024, 200
    q, kv, indices, positions, sink = _case(T, H, S, topk, seed=H, peaked=threshold > 0)
    positions = positions if causal else None
    sink = sink if with_sink else None
    sm_scale = D_QK**-0.5
    out, lse, o_lo, max_logits = fwd.forward(
        q, kv, indices, None, sm_scale, D_V, threshold, True, q_positions=positions,
        attn_sink=sink, return_max_logits=True,
    )
    q64 = q.double().requires_grad_()
    kv64 = kv.double().requires_grad_()
    sink64 = None if sink is None else sink.double().requires_grad_()
    out64, lse64, max64 = _reference(q64, kv64, indices, sm_scale, positions, sink64)

    floor = rel_l2(out64.detach().to(q.dtype), out64.detach())
    assert rel_l2(out, out64.detach()) <= 1.5 * floor
    finite = torch.isfinite(lse64)
    assert torch.equal(torch.isfinite(lse), finite)
    assert (lse[finite].double() - lse64[finite]).abs().max().item() < 1e-3
    assert torch.equal(torch.isfinite(max_logits), torch.isfinite(max64))
    has = torch.isfinite(max64)
    err = (max_logits[has].double() - max64[has]).abs().max().item()
    assert err < 1e-4 * (1 + max64[has].abs().max().item())  # fp32 sums of exact products
    if causal:  # token 1 has no valid key: out 0, lse = its head's sink (or -inf)
        assert (out[1] == 0).all()
        expect = sink if sink is not None else torch.full((H,), -math.inf, device="cuda")
        torch.testing.assert_close(lse[1], expect, rtol=1e-6, atol=1e-6)

    g = torch.Generator(device="cuda").manual_seed(7)
    dout = torch.randn(out.shape, device="cuda", generator=g).bfloat16()
    dlse = torch.randn(lse.shape, device="cuda", generator=g)
    dlse = torch.where(torch.isfinite(lse), dlse, 0.0)
    ((out64 * dout.double()).sum() + (torch.where(finite, lse64, 0.0) * dlse.double()).sum()).backward()
    dq, dkv, d_sink = bwd.backward(dout, q, kv, indices, None, out, lse, o_lo, sm_scale, D_V,
                                   q_positions=positions, attn_sink=sink, dlse=dlse)
    assert rel_l2(dq, q64.grad) <= 1.5 * rel_l2(q64.grad.to(q.dtype), q64.grad)
    assert rel_l2(dkv, kv64.grad) <= 1.5 * rel_l2(kv64.grad.to(kv.dtype), kv64.grad)
    if sink is None:
        assert d_sink is None
    else:
        assert d_sink.dtype == torch.float32 and d_sink.shape == (H,)
        # head 0 has no sink (-inf): its gradient is 0 (fp64 autograd gives NaN on the row
        # whose lse is -inf: exp(-inf - -inf))
        assert d_sink[0] == 0
        assert rel_l2(d_sink[1:], sink64.grad[1:]) < 5e-3


def test_sink_of_minus_inf_is_no_sink():
    q, kv, indices, positions, _ = _case(32, 64, 512, 128, seed=3)
    sm_scale = D_QK**-0.5
    none = fwd.forward(q, kv, indices, None, sm_scale, D_V, 0.0, True, q_positions=positions)
    minus_inf = torch.full((64,), -math.inf, device="cuda")
    with_sink = fwd.forward(q, kv, indices, None, sm_scale, D_V, 0.0, True, q_positions=positions,
                            attn_sink=minus_inf)
    for a, b in zip(none[:3], with_sink[:3]):
        assert torch.equal(a, b)
