"""Inputs a training loop can produce at the edges of the ops' domain: symbolic sizes under
torch.compile, every differentiable input under forward-mode AD, extreme and non-finite
attention sinks, large sinks in the indexer target, zero-width selections, non-finite
sm_scale, tensor flags, checks of the indexer loss's optional inputs, the indexer loss in eval
mode and PyTorch's deterministic mode. Numbers are checked against independent float64
references (``conftest.py``'s, or the definition written out here), errors by their message."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import CPU_BACKENDS, backend_params, random_inputs
from torch._dynamo.testing import CompileCounterWithBackend

import mla_inductor
from mla_inductor import indexer_kl_loss, sparse_mla, use_backend


def _kl_fp64(logits, target, valid):
    """``sum_t KL(target_t || softmax_{valid}(logits_t))`` / tokens with a valid slot, in
    float64, written from the definition (``0 * log 0 = 0`` and ``0 * log q = 0``)."""
    logits, target = logits.double(), target.double()
    total, rows = 0.0, 0
    for t in range(logits.shape[0]):
        v = valid[t]
        if not v.any():
            continue
        rows += 1
        lp = torch.log_softmax(logits[t][v], -1)
        p = target[t][v]
        total += sum(float(pj) * (math.log(pj) - float(lq)) for pj, lq in zip(p, lp) if pj > 0)
    return total / max(rows, 1)


def _causal_valid(indices, S):
    T = indices.shape[0]
    pos = torch.arange(T)[:, None] + (S - T)
    return (indices >= 0) & (indices < S) & (indices <= pos)


# -- symbolic sizes under torch.compile -------------------------------------------------------


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_kv_len_as_an_int_argument_stays_symbolic(backend):
    counter = CompileCounterWithBackend(backend)

    def loss(logits, target, indices, S):
        return indexer_kl_loss(logits, target, indices, kv_len=S, causal=True)

    fn = torch.compile(loss, backend=counter, dynamic=True, fullgraph=True)
    for i, S in enumerate((12, 13, 21)):
        g = torch.Generator().manual_seed(S)
        logits = torch.randn(4, 5, generator=g, requires_grad=True)
        target = torch.rand(4, 5, generator=g)
        target /= target.sum(-1, keepdim=True)
        indices = torch.randint(-1, S + 2, (4, 5), generator=g)
        with torch.compiler.set_stance("fail_on_recompile" if i else "default"):
            got = fn(logits, target, indices, S)
            got.backward()
        ref = _kl_fp64(logits.detach(), target, _causal_valid(indices, S))
        assert got.item() == pytest.approx(ref, rel=1e-5, abs=1e-6)
    assert counter.frame_count == 1


def test_kv_len_from_a_dynamic_dimension_stays_symbolic():
    counter = CompileCounterWithBackend("aot_eager")

    def loss(logits, target, indices, kv):
        return indexer_kl_loss(logits, target, indices, kv_len=kv.shape[0], causal=True)

    fn = torch.compile(loss, backend=counter, fullgraph=True)
    for S in (12, 13, 17):
        g = torch.Generator().manual_seed(S)
        logits, target = torch.randn(4, 5, generator=g), torch.rand(4, 5, generator=g)
        indices = torch.randint(0, S, (4, 5), generator=g)
        kv = torch.randn(S, 8)
        torch._dynamo.mark_dynamic(kv, 0)
        got = fn(logits, target, indices, kv)
        ref = _kl_fp64(logits, target, _causal_valid(indices, S))
        assert got.item() == pytest.approx(ref, rel=1e-5, abs=1e-6)
    assert counter.frame_count == 1


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_d_v_as_an_int_argument_stays_symbolic(backend, fp64_reference):
    counter = CompileCounterWithBackend(backend)

    def step(q, kv, indices, d_v):
        return sparse_mla(q, kv, indices, d_v=d_v)

    fn = torch.compile(step, backend=counter, dynamic=True, fullgraph=True)
    for i, d_v in enumerate((8, 9, 16)):
        q, kv, idx = random_inputs(4, 2, 16, 12, 5, dtype=torch.float32, seed=d_v)
        q.requires_grad_()
        with torch.compiler.set_stance("fail_on_recompile" if i else "default"):
            out = fn(q, kv, idx, d_v)
            out.square().sum().backward()
        ref, _ = fp64_reference(q.detach(), kv, idx, d_v=d_v)
        torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
        q64 = q.detach().double().requires_grad_()
        fp64_reference(q64, kv, idx, d_v=d_v)[0].square().sum().backward()
        torch.testing.assert_close(q.grad.double(), q64.grad, atol=1e-4, rtol=1e-4)
    assert counter.frame_count == 1


# -- attention-sink edge values ----------------------------------------------------------------

SINK_BACKENDS = backend_params(CPU_BACKENDS + ("sm90",))


def _sink_problem(backend, edge, seed=0):
    """Four heads whose sinks are ``[0.5, edge, -inf, 1.0]``, some rows without a valid slot;
    float32 on the CPU backends, bf16 at DeepSeek's widths on sm90."""
    gpu = backend == "sm90"
    d_qk, d_v = (576, 512) if gpu else (16, 8)
    dtype, device = (torch.bfloat16, "cuda") if gpu else (torch.float32, "cpu")
    q, kv, idx = random_inputs(6, 4, d_qk, 10, 5, dtype=dtype, device=device, seed=seed,
                               invalid_frac=0.3)
    idx[0] = -1  # a row without a valid slot
    sink = torch.tensor([0.5, edge, -math.inf, 1.0], device=device)
    return q, kv, idx, sink, d_v


def _sink_grads(backend, q, kv, idx, sink, d_v, dout, dlse):
    q, kv, sink = (t.detach().clone().requires_grad_() for t in (q, kv, sink))
    with use_backend(backend):
        out, lse = sparse_mla(q, kv, idx, d_v=d_v, attn_sink=sink, return_lse=True)
        grads = torch.autograd.grad((out, lse), (q, kv, sink), (dout, dlse))
    return out.detach(), lse.detach(), grads


def _close(x, ref, gpu):
    tol = 2e-2 if gpu else 1e-5
    torch.testing.assert_close(x.double().cpu(), ref.double().cpu(), atol=tol, rtol=tol)


@pytest.mark.parametrize("edge", [math.inf, 3.4e38])
@pytest.mark.parametrize("backend", SINK_BACKENDS)
def test_a_sink_that_takes_all_the_mass(backend, edge, fp64_reference):
    """A +inf sink (or one whose log2 overflows fp32): lse is the sink, out 0, every slot's P 0,
    so dq and dkv get nothing from that head and ``d_sink = -sum_t P_sink (dpsum - dlse) =
    sum_t dlse`` (P_sink 1, dpsum = dout . out = 0). The other heads are the fp64 reference's."""
    gpu = backend == "sm90"
    q, kv, idx, sink, d_v = _sink_problem(backend, edge)
    g = torch.Generator().manual_seed(1)
    dout = torch.randn(*q.shape[:2], d_v, generator=g).to(q)
    dlse = torch.randn(*q.shape[:2], generator=g).to(q.device)
    out, lse, (dq, dkv, d_sink) = _sink_grads(backend, q, kv, idx, sink, d_v, dout, dlse)

    assert torch.all(out[:, 1] == 0)
    assert torch.all(lse[:, 1] == torch.tensor(edge, dtype=torch.float32))
    assert torch.all(dq[:, 1] == 0)
    assert d_sink[1].item() == pytest.approx(dlse[:, 1].double().sum().item(), rel=1e-5, abs=1e-5)

    heads = [0, 2, 3]  # the fp64 reference of the other heads alone
    q64 = q[:, heads].detach().double().requires_grad_()
    kv64 = kv.detach().double().requires_grad_()
    sink64 = sink[heads].double().requires_grad_()
    ref_out, ref_lse = fp64_reference(q64, kv64, idx, d_v=d_v, attn_sink=sink64)
    ref_dq, ref_dkv, ref_dsink = torch.autograd.grad(
        (ref_out, ref_lse), (q64, kv64, sink64),
        (dout[:, heads].double(), dlse[:, heads].double()), allow_unused=True)
    _close(out[:, heads], ref_out, gpu)
    _close(lse[:, heads], ref_lse, gpu)
    _close(dq[:, heads], ref_dq, gpu)
    _close(dkv, ref_dkv, gpu)
    _close(d_sink[[0, 3]], ref_dsink[[0, 2]], gpu)


@pytest.mark.parametrize("backend", SINK_BACKENDS)
def test_a_nan_sink_is_not_hidden(backend, fp64_reference):
    """A diverged (NaN) sink gives NaN out and lse on every row of its head, and a NaN
    gradient for it; the other heads are unchanged."""
    gpu = backend == "sm90"
    q, kv, idx, sink, d_v = _sink_problem(backend, math.nan)
    dout = torch.ones(*q.shape[:2], d_v).to(q)
    dlse = torch.ones(q.shape[:2], device=q.device)
    out, lse, (_, _, d_sink) = _sink_grads(backend, q, kv, idx, sink, d_v, dout, dlse)
    assert torch.isnan(out[:, 1]).all() and torch.isnan(lse[:, 1]).all()
    assert torch.isnan(d_sink[1])
    heads = [0, 2, 3]
    ref_out, ref_lse = fp64_reference(q[:, heads], kv, idx, d_v=d_v, attn_sink=sink[heads])
    _close(out[:, heads], ref_out, gpu)
    _close(lse[:, heads], ref_lse, gpu)
