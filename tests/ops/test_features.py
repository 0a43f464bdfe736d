"""DSA features of the public op on the CPU backends (reference, emulate) against the fp64
reference: causal masking (default and given positions, batched and packed), the attention sink
(-inf, 0, large; its gradient), gradients through lse, max_logits under both thresholds, and one
fullgraph-compiled graph over several token counts. Small widths in float32, which only these
backends take; the SM90 kernels' features are tested at their widths in
``tests/kernels/sm90/test_sm90_features.py``.
"""

from __future__ import annotations

import math

import pytest
import torch
from conftest import CPU_BACKENDS, backend_device, backend_params, reference_sparse_mla_fp64, rel_l2
from torch._dynamo.testing import CompileCounterWithBackend

from mla_inductor import sparse_mla, use_backend

D, DV = 80, 64  # d_qk (latent 64 + rope 16), d_v


def _inputs(T, H, S, topk, seed, dtype=torch.float32, peaked=False):
    g = torch.Generator().manual_seed(seed)
    kv = torch.randn(S, D, generator=g)
    idx = torch.randint(-2, S + 2, (T, topk), generator=g)  # future, past, and invalid slots
    idx[:, 1] = idx[:, 0]  # duplicates
    q = torch.randn(T, H, D, generator=g)
    if peaked:  # slot 0's key dominates; walked last, it makes the lazy running max stale
        q = 0.1 * q + 0.6 * kv[idx[:, 0].clamp(0, S - 1)][:, None, :]
    return q.to(dtype), kv.to(dtype), idx.int()


def _grads(loss, tensors):
    return torch.autograd.grad(loss, [t for t in tensors if t is not None and t.requires_grad])


def _check_against_fp64(backend, q, kv, idx, *, topk_length=None, causal=False, q_positions=None,
                        attn_sink=None, dtype_tol=None):
    """Values (out, lse, max_logits) and gradients (q, kv, sink, through out and lse) of the
    public op on ``backend`` vs the fp64 reference on the same masked problem."""
    dev = backend_device(backend)
    T, S = q.shape[0], kv.shape[0]
    pos = None
    if causal:
        pos = q_positions if q_positions is not None else torch.arange(T) + (S - T)
    leaves = [t.to(dev).detach().requires_grad_() for t in (q, kv)]
    sink = None if attn_sink is None else attn_sink.to(dev).detach().requires_grad_()
    with use_backend(backend):
        out, lse, max_logits = sparse_mla(
            *leaves, idx.to(dev), d_v=DV, sm_scale=0.3, causal=causal,
            q_positions=None if q_positions is None else q_positions.to(dev),
            topk_length=None if topk_length is None else topk_length.to(dev),
            attn_sink=sink, return_lse=True, return_max_logits=True,
        )
    g = torch.Generator().manual_seed(1)
    w = torch.randn(out.shape, generator=g)
    u = torch.randn(lse.shape, generator=g)
    finite = torch.isfinite(lse.detach().cpu())
    loss = (out.float().cpu() * w).sum() + (torch.where(finite, lse.cpu(), 0.0) * u).sum()
    got = _grads(loss, leaves + [sink])

    q64, kv64 = q.double().requires_grad_(), kv.double().requires_grad_()
    sink64 = None if attn_sink is None else attn_sink.double().requires_grad_()
    out64, lse64, max64 = reference_sparse_mla_fp64(
        q64, kv64, idx, topk_length, 0.3, DV, q_positions=pos, attn_sink=sink64,
        return_max_logits=True,
    )
    loss64 = (out64 * w.double()).sum() + (torch.where(finite, lse64, 0.0) * u.double()).sum()
    want = _grads(loss64, [q64, kv64, sink64])

    tol = dtype_tol or 1e-5
    assert rel_l2(out.cpu(), out64) < tol
    assert torch.equal(finite, torch.isfinite(lse64))
    torch.testing.assert_close(lse.cpu().double(), lse64.detach(), rtol=tol, atol=tol)
    torch.testing.assert_close(max_logits.cpu().double(), max64, rtol=tol, atol=tol)
    for a, b in zip(got, want):
        b = torch.nan_to_num(b, nan=0.0)  # fp64 autograd of a -inf sink on an empty row: NaN
        assert rel_l2(a.cpu(), b) < 10 * tol, (a, b)
    return out, lse


@pytest.mark.parametrize("backend", backend_params(CPU_BACKENDS))
def test_causal_default_positions_are_bottom_right(backend):
    q, kv, idx = _inputs(T=12, H=4, S=20, topk=16, seed=0)
    _check_against_fp64(backend, q, kv, idx, causal=True)


@pytest.mark.parametrize("backend", backend_params(CPU_BACKENDS))
def test_causal_with_positions_packed_sequences(backend):
    """Two sequences packed into one kv: global indices, global positions."""
    q, kv, idx = _inputs(T=14, H=2, S=14, topk=10, seed=1)
    positions = torch.tensor([0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13], dtype=torch.int64)
    positions[0] = -1  # a token that sees nothing: out 0, lse -inf
    _, lse = _check_against_fp64(backend, q, kv, idx, causal=True, q_positions=positions)
    assert torch.isinf(lse[0].cpu()).all()


@pytest.mark.parametrize("backend", backend_params(CPU_BACKENDS))
@pytest.mark.parametrize("layout", ["batched_default", "batched_positions", "batched_default_kv_head"])
def test_causal_batched_matches_each_batch_element(backend, layout):
    B, T, H, S, topk = 2, 5, 3, 9, 8
    dev = backend_device(backend)
    g = torch.Generator().manual_seed(2)
    q = torch.randn(B, T, H, D, generator=g)
    kv = torch.randn(B, S, D, generator=g)
    idx = torch.randint(-1, S + 1, (B, T, topk), generator=g)
    pos = None if "default" in layout else torch.randint(-1, S, (B, T), generator=g)
    kv_in = kv.unsqueeze(2) if layout.endswith("kv_head") else kv  # [B, S, 1, d]: S is at -3
    with use_backend(backend):
        out, lse = sparse_mla(q.to(dev), kv_in.to(dev), idx.to(dev), d_v=DV, causal=True,
                              q_positions=None if pos is None else pos.to(dev), return_lse=True)
    for b in range(B):
        p = torch.arange(T) + (S - T) if pos is None else pos[b]
        out64, lse64 = reference_sparse_mla_fp64(q[b], kv[b], idx[b], None, D**-0.5, DV,
                                                 q_positions=p)
        assert rel_l2(out[b].cpu(), out64) < 1e-5
        torch.testing.assert_close(lse[b].cpu().double(), lse64, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend", backend_params(CPU_BACKENDS))
@pytest.mark.parametrize("sink", ["minus_inf", "zero", "large", "mixed"])
def test_attention_sink_values_and_gradients(backend, sink):
    q, kv, idx = _inputs(T=10, H=4, S=16, topk=12, seed=3)
    idx[2] = -1  # a row with no valid slot: out 0, lse = sink
    topk_length = torch.tensor([12, 5, 12, 0, 7, 12, 3, 12, 12, 1], dtype=torch.int32)
    values = {
        "minus_inf": torch.full((4,), -math.inf),
        "zero": torch.zeros(4),
        "large": torch.full((4,), 40.0),  # the sink takes (almost) all the mass
        "mixed": torch.tensor([-math.inf, 0.0, 3.0, -2.0]),
    }[sink]
    out, lse = _check_against_fp64(backend, q, kv, idx, topk_length=topk_length, attn_sink=values)
    assert (out[2] == 0).all()
    torch.testing.assert_close(lse[2].cpu(), values)


@pytest.mark.parametrize("backend", backend_params(CPU_BACKENDS))
def test_gradient_through_lse_alone(backend):
    """Merging partial results uses lse only: its gradient reaches q and kv."""
    dev = backend_device(backend)
    q, kv, idx = _inputs(T=6, H=2, S=12, topk=8, seed=4)
    q_, kv_ = q.to(dev).requires_grad_(), kv.to(dev).requires_grad_()
    with use_backend(backend):
        _, lse = sparse_mla(q_, kv_, idx.to(dev), d_v=DV, return_lse=True)
    finite = torch.isfinite(lse)
    dq, dkv = torch.autograd.grad(torch.where(finite, lse, 0.0).sum(), (q_, kv_))
    q64, kv64 = q.double().requires_grad_(), kv.double().requires_grad_()
    _, lse64 = reference_sparse_mla_fp64(q64, kv64, idx, None, D**-0.5, DV)
    dq64, dkv64 = torch.autograd.grad(torch.where(finite.cpu(), lse64, 0.0).sum(), (q64, kv64))
    assert rel_l2(dq.cpu(), dq64) < 1e-5 and rel_l2(dkv.cpu(), dkv64) < 1e-5


@pytest.mark.parametrize("backend", backend_params(CPU_BACKENDS))
@pytest.mark.parametrize("threshold", [0.0, 8.0])
def test_max_logits_is_the_true_max_under_either_threshold(backend, threshold):
    """On peaked rows walked with the lazy rescale the running max is stale; max_logits is not."""
    dev = backend_device(backend)
    dtype = torch.float32 if backend == "reference" else torch.bfloat16
    q, kv, idx = _inputs(T=8, H=4, S=300, topk=256, seed=5, dtype=dtype, peaked=True)
    with use_backend(backend):
        out, max_logits = sparse_mla(q.to(dev), kv.to(dev), idx.to(dev), d_v=DV, sm_scale=0.3,
                                     rescale_threshold=threshold, return_max_logits=True)
    _, _, max64 = reference_sparse_mla_fp64(q, kv, idx, None, 0.3, DV, return_max_logits=True)
    torch.testing.assert_close(max_logits.cpu().double(), max64, rtol=1e-5, atol=1e-4)
    assert max_logits.dtype == torch.float32 and max_logits.shape == (8, 4)


@pytest.mark.parametrize("sink_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("backend", backend_params())
def test_a_sink_in_the_models_dtype(backend, sink_dtype):
    """A bfloat16 or float16 sink (a model cast with ``.to()``): the same out, lse and gradients
    as its float32 value (the softmax runs in float32), and ``d_sink`` in the sink's dtype: the
    float32 gradient rounded once."""
    device = backend_device(backend)
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    d_qk, d_v = (D, DV) if device == "cpu" else (576, 512)
    g = torch.Generator().manual_seed(11)
    q = torch.randn(12, 4, d_qk, generator=g).to(device, dtype)
    kv = torch.randn(20, d_qk, generator=g).to(device, dtype)
    idx = torch.randint(-1, 21, (12, 8), generator=g, dtype=torch.int32).to(device)
    sink = torch.randn(4, generator=g).to(device, sink_dtype)
    results = []
    for s in (sink, sink.float()):
        s = s.clone().requires_grad_()
        qq = q.clone().requires_grad_()
        with use_backend(backend):
            out, lse = sparse_mla(qq, kv, idx, d_v=d_v, causal=True, attn_sink=s,
                                  return_lse=True)
            (out.float().square().sum() + lse.sum()).backward()
        results.append((out, lse, qq.grad, s.grad))
    (out, lse, dq, d_sink), (out32, lse32, dq32, d_sink32) = results
    assert torch.equal(out, out32) and torch.equal(lse, lse32) and torch.equal(dq, dq32)
    assert d_sink.dtype == sink_dtype and torch.equal(d_sink, d_sink32.to(sink_dtype))


def test_return_order_and_errors():
    q, kv, idx = _inputs(T=4, H=2, S=6, topk=3, seed=6)
    out = sparse_mla(q, kv, idx, d_v=DV)
    a = sparse_mla(q, kv, idx, d_v=DV, return_lse=True, return_max_logits=True)
    b = sparse_mla(q, kv, idx, d_v=DV, return_max_logits=True)
    assert len(a) == 3 and len(b) == 2 and torch.equal(a[0], out) and torch.equal(a[2], b[1])
    with pytest.raises(RuntimeError, match="^sparse_mla: q_positions is only read with causal=True"):
        sparse_mla(q, kv, idx, d_v=DV, q_positions=torch.arange(4))
    with pytest.raises(RuntimeError, match=r"^sparse_mla: attn_sink must be \[H\] = \[2\]"):
        sparse_mla(q, kv, idx, d_v=DV, attn_sink=torch.zeros(3))
    with pytest.raises(RuntimeError, match="^sparse_mla: attn_sink must be float32, bfloat16 or "
                       "float16 .the softmax runs in float32., got torch.float64"):
        sparse_mla(q, kv, idx, d_v=DV, attn_sink=torch.zeros(2, dtype=torch.float64))
    with pytest.raises(RuntimeError, match="^sparse_mla: q_positions must be an integer tensor"):
        sparse_mla(q, kv, idx, d_v=DV, causal=True, q_positions=torch.zeros(4))
    with pytest.raises(RuntimeError, match=r"batched q_positions must be \[B, T\]"):
        sparse_mla(q[None], kv[None], idx[None], d_v=DV, causal=True,
                   q_positions=torch.zeros(3, 4, dtype=torch.int32))


def test_fullgraph_compile_one_graph_over_token_counts():
    """causal + sink + lse + max_logits under torch.compile(fullgraph=True): no graph break, one
    graph for every T (dynamic), the same values and gradients as eager."""
    sink = torch.tensor([0.5, -1.0, 2.0, -math.inf], requires_grad=True)

    def f(q, kv, idx):
        out, lse, m = sparse_mla(q, kv, idx, d_v=DV, causal=True, attn_sink=sink,
                                 return_lse=True, return_max_logits=True)
        return out.sum() + torch.where(torch.isfinite(lse), lse, 0.0).sum(), m

    counter = CompileCounterWithBackend("aot_eager")
    torch._dynamo.reset()
    compiled = torch.compile(f, backend=counter, fullgraph=True, dynamic=True)
    for T in (5, 9, 17):
        q, kv, idx = _inputs(T=T, H=4, S=T + 3, topk=6, seed=T)
        q.requires_grad_()
        loss_c, m_c = compiled(q, kv, idx)
        g_c = torch.autograd.grad(loss_c, (q, sink))
        loss_e, m_e = f(q, kv, idx)
        g_e = torch.autograd.grad(loss_e, (q, sink))
        torch.testing.assert_close(loss_c, loss_e)
        torch.testing.assert_close(m_c, m_e)
        for a, b in zip(g_c, g_e):
            torch.testing.assert_close(a, b)
    assert counter.frame_count == 1
