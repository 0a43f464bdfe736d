"""The Hopper kernels' DSA features against fp64 autograd: causal positions, an attention sink,
max_logits (under both thresholds) and a gradient reaching lse.

Kernel level (``mla_inductor.kernels.sm90.fwd_host.forward`` / ``bwd_host.backward``); the
op-level API is tested on every backend elsewhere. GPU only (SM90).
"""

from __future__ import annotations

import math

import pytest
import torch

pytestmark = pytest.mark.cuda

if not (torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)):
    pytest.skip("needs an SM90 GPU", allow_module_level=True)

from conftest import rel_l2  # noqa: E402

from mla_inductor.kernels.sm90 import bwd_host, fwd_host  # noqa: E402

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
    out, lse, o_lo, max_logits = fwd_host.forward(q, kv, indices, None, positions, sink, sm_scale,
                                                  D_V, threshold, True, return_max_logits=True)
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
    dq, dkv, d_sink = bwd_host.backward(dout, dlse, q, kv, indices, None, positions, sink, out, lse,
                                        o_lo, sm_scale, D_V)
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
    none = fwd_host.forward(q, kv, indices, None, positions, None, sm_scale, D_V, 0.0, True)
    minus_inf = torch.full((64,), -math.inf, device="cuda")
    with_sink = fwd_host.forward(q, kv, indices, None, positions, minus_inf, sm_scale, D_V, 0.0,
                                 True)
    # out and o_lo bitwise; lse to one float32 ulp: the two compiled variants contract
    # ``m * ln2 + log(rs)`` into FMAs differently (H200, 2026-12-02: 427 of 2048 lse values 1 ulp
    # apart, out and o_lo identical)
    assert torch.equal(none[0], with_sink[0]) and torch.equal(none[2], with_sink[2])
    torch.testing.assert_close(with_sink[1], none[1], rtol=2**-23, atol=0)


def test_sink_view_with_a_partial_head_tile():
    """The sink as a view 4 bytes into its storage (the kernel gathers it with 4-byte copies)
    and H = 80: the second head tile has 16 heads, its other 48 rows read no sink."""
    H = 80
    q, kv, indices, positions, sink = _case(24, H, 512, 128, seed=5)
    storage = torch.empty(H + 1, device="cuda")
    storage[1:] = sink
    sink = storage[1:]
    assert sink.data_ptr() % 16 == 4
    sm_scale = D_QK**-0.5
    out, lse, _, _ = fwd_host.forward(q, kv, indices, None, positions, sink, sm_scale, D_V, 0.0,
                                      False)
    out64, lse64, _ = _reference(q.double(), kv.double(), indices, sm_scale, positions,
                                 sink.double())
    assert rel_l2(out, out64) <= 1.5 * rel_l2(out64.to(q.dtype), out64)
    finite = torch.isfinite(lse64)
    assert torch.equal(torch.isfinite(lse), finite)
    assert (lse[finite].double() - lse64[finite]).abs().max().item() < 1e-3
    torch.testing.assert_close(lse[1], sink, rtol=1e-6, atol=1e-6)  # token 1: no valid key


# ----------------------------------------------------------------------------- through the public op


@pytest.mark.parametrize("threshold", [0.0, 8.0])
def test_persistent_grid_walks_many_tiles(monkeypatch, threshold):
    """The forward walks tiles ``b, b + num_ctas, ...`` per CTA: with 1, 3 and 7 CTAs (the host
    launches one per SM) every CTA computes many tiles, among them tiles without a valid slot
    (topk_length 0) and the partial head tile of H = 80, with a sink, causal positions and
    max_logits. The result must be bitwise the one-CTA-per-tile result, and that must match
    fp64."""
    T, H, S, topk = 40, 80, 512, 300
    q, kv, indices, positions, sink = _case(T, H, S, topk, seed=11, peaked=threshold > 0)
    topk_length = torch.randint(0, topk + 1, (T,), device="cuda", dtype=torch.int32)
    topk_length[::5] = 0
    sm_scale = D_QK**-0.5

    def run():
        return fwd_host.forward(q, kv, indices, topk_length, positions, sink, sm_scale, D_V,
                                threshold, True, return_max_logits=True)

    monkeypatch.setattr(fwd_host, "_sm_count", lambda device: 2 * T)  # one CTA per tile
    per_tile = run()
    for ctas in (1, 3, 7):
        monkeypatch.setattr(fwd_host, "_sm_count", lambda device, ctas=ctas: ctas)
        for a, b in zip(per_tile, run()):
            assert torch.equal(a, b), ctas

    keep = torch.arange(topk, device="cuda")[None, :] < topk_length[:, None].long()
    out, lse, _, max_logits = per_tile
    out64, lse64, max64 = _reference(q.double(), kv.double(), torch.where(keep, indices, -1),
                                     sm_scale, positions, sink.double())
    assert rel_l2(out, out64) <= 1.5 * rel_l2(out64.to(q.dtype), out64)
    assert (out[::5] == 0).all()  # topk_length 0: no valid slot
    finite = torch.isfinite(lse64)
    assert torch.equal(torch.isfinite(lse), finite)
    assert (lse[finite].double() - lse64[finite]).abs().max().item() < 1e-3
    has = torch.isfinite(max64)
    assert torch.equal(torch.isfinite(max_logits), has)
    assert (max_logits[has].double() - max64[has]).abs().max().item() < 1e-4 * (
        1 + max64[has].abs().max().item())


def _public_case(B, T, S, H, topk, seed):
    """Batched inputs with random indices (about half of them in each token's future, which
    causal masks), empty slots of every kind, a sink per head, and dout / dlse."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(B, T, H, D_QK, device="cuda", generator=g).bfloat16()
    kv = torch.randn(B, S, D_QK, device="cuda", generator=g).bfloat16()
    indices = torch.randint(0, S, (B, T, topk), device="cuda", generator=g, dtype=torch.int32)
    indices[0, -1, :3] = torch.tensor([-1, S, 2**31 - 1], dtype=torch.int32, device="cuda")
    indices[1, 0, :] = S - 1  # the first token of element 1 names only future keys: no valid slot
    sink = torch.randn(H, device="cuda", generator=g) + 6.0  # about a third of each row's mass
    dout = torch.randn(B, T, H, D_V, device="cuda", generator=g).bfloat16()
    dlse = torch.randn(B, T, H, device="cuda", generator=g)
    return q, kv, indices, sink, dout, dlse


def _fp64_token_rows(q, kv, idx, sink, sm_scale):
    """fp64 ``out, lse, max_logits, p, keys`` of the tokens in ``q [n, H, d_qk]`` whose causal
    mask is already applied to ``idx [n, topk]`` (-1 = empty); written from the definitions."""
    S = kv.shape[0]
    valid = (idx >= 0) & (idx < S)
    keys = kv[torch.where(valid, idx, 0).long()].double() * valid[..., None]
    s = torch.einsum("nhd,nkd->nhk", q.double(), keys) * sm_scale
    s = s.masked_fill(~valid[:, None, :], -math.inf)
    max_logits = s.amax(-1)
    lse = torch.logaddexp(torch.logsumexp(s, dim=-1), sink.double()[None, :])
    p = torch.exp(s - lse[..., None])
    return torch.einsum("nhk,nkd->nhd", p, keys[..., :D_V]), lse, max_logits, p, keys


def _fp64_ds(q, kv, idx, sink, dout, dlse, sm_scale):
    out, lse, _, p, keys = _fp64_token_rows(q, kv, idx, sink, sm_scale)
    do = dout.double()
    dp = torch.einsum("nhd,nkd->nhk", do, keys[..., :D_V])
    dpsum = (do * out).sum(-1, keepdim=True)
    return p * (dp - dpsum + dlse.double()[..., None]) * sm_scale, p, keys


@pytest.mark.slow
def test_public_op_features_at_deepseek_size():
    """``sparse_mla`` at DeepSeek-V3.2's sizes (H 128, topk 2048, d_qk 576, d_v 512; B 2 x T 2048
    = 4096 tokens, batched layout) with causal, a sink, return_lse / return_max_logits and a
    gradient through lse, on the sm90 kernels, against fp64 on a sample of tokens (out, lse,
    max_logits, dq) and on the whole dkv of a few kv rows; the sink's gradient against fp64 on
    its own (the kernel's sum over every token, recomputed in fp64 from the fp64 rows)."""
    import mla_inductor

    B, T, H, topk = 2, 2048, 128, 2048
    S = T
    sm_scale = 0.1147  # not d_qk ** -0.5: the caller's scale must reach the kernels
    q, kv, indices, sink, dout, dlse = _public_case(B, T, S, H, topk, seed=11)
    q_, kv_, sink_ = (x.detach().requires_grad_() for x in (q, kv, sink))
    with mla_inductor.use_backend("sm90"):
        out, lse, max_logits = mla_inductor.sparse_mla(
            q_, kv_, indices, sm_scale=sm_scale, causal=True, attn_sink=sink_, return_lse=True,
            return_max_logits=True)
        ((out.float() * dout.float()).sum() + (lse * dlse).sum()).backward()
    assert out.shape == (B, T, H, D_V) and lse.shape == max_logits.shape == (B, T, H)

    # the causal mask, from the definition (default positions S - T + t = t here)
    future = indices.long() > torch.arange(T, device="cuda")[None, :, None]
    masked = torch.where(future, -1, indices)
    g = torch.Generator(device="cuda").manual_seed(5)
    for b in range(B):
        tokens = torch.randperm(T, device="cuda", generator=g)[:128]
        tokens[:2] = torch.tensor([0, T - 1], device="cuda")
        out64, lse64, max64, _, _ = _fp64_token_rows(q[b, tokens], kv[b], masked[b, tokens], sink,
                                                     sm_scale)
        err, floor = rel_l2(out[b, tokens], out64), rel_l2(out64.to(torch.bfloat16), out64)
        assert err <= 1.5 * floor, (err, floor)
        assert (lse[b, tokens].double() - lse64).abs().max().item() < 1e-3
        assert torch.equal(torch.isfinite(max_logits[b, tokens]), torch.isfinite(max64))
        has = torch.isfinite(max64)
        assert (max_logits[b, tokens][has].double() - max64[has]).abs().max().item() < 1e-3
        ds, _, keys = _fp64_ds(q[b, tokens], kv[b], masked[b, tokens], sink, dout[b, tokens],
                               dlse[b, tokens], sm_scale)
        dq64 = torch.einsum("nhk,nkd->nhd", ds, keys)
        err, floor = rel_l2(q_.grad[b, tokens], dq64), rel_l2(dq64.to(torch.bfloat16), dq64)
        assert err <= 1.5 * floor, (err, floor)
    # element 1's token 0 has no valid slot: out 0, lse = the sink, max_logits -inf, dq 0
    assert (out[1, 0] == 0).all() and (q_.grad[1, 0] == 0).all()
    torch.testing.assert_close(lse[1, 0], sink, rtol=1e-6, atol=1e-6)
    assert torch.isneginf(max_logits[1, 0]).all()

    # dkv of a few rows of element 0: every (token, slot) that names them, in fp64
    rows = torch.unique(masked[0, T - 1, 3:8].long())
    rows = rows[rows >= 0]
    dkv64 = torch.zeros(len(rows), D_QK, dtype=torch.float64, device="cuda")
    tokens = torch.isin(masked[0], rows).any(dim=1).nonzero().flatten()
    for c in range(0, len(tokens), 128):
        tok = tokens[c:c + 128]
        ds, p, _ = _fp64_ds(q[0, tok], kv[0], masked[0, tok], sink, dout[0, tok], dlse[0, tok],
                            sm_scale)
        for i, r in enumerate(rows.tolist()):
            sel = (masked[0, tok] == r).double()
            dkv64[i] += torch.einsum("nk,nhk,nhd->d", sel, ds, q[0, tok].double())
            dkv64[i, :D_V] += torch.einsum("nk,nhk,nhd->d", sel, p, dout[0, tok].double())
    err, floor = rel_l2(kv_.grad[0, rows], dkv64), rel_l2(dkv64.to(torch.bfloat16), dkv64)
    assert err <= 1.5 * floor, (err, floor)

    # d_sink = -sum_t exp(sink - lse) (dpsum - dlse), dpsum from fp64 rows of every token
    d_sink64 = torch.zeros(H, dtype=torch.float64, device="cuda")
    for b in range(B):
        for t0 in range(0, T, 256):
            s = slice(t0, t0 + 256)
            out64, lse64, _, _, _ = _fp64_token_rows(q[b, s], kv[b], masked[b, s], sink, sm_scale)
            dpsum = (dout[b, s].double() * out64).sum(-1)
            d_sink64 -= (torch.exp(sink.double() - lse64) * (dpsum - dlse[b, s].double())).sum(0)
    assert rel_l2(sink_.grad, d_sink64) < 1e-3
