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


# -- the indexer target with a sink that takes nearly all the mass ---------------------------


@pytest.mark.parametrize("sink_value", [100.0, 300.0])
@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_indexer_target_with_a_large_sink_matches_fp64(backend, sink_value):
    """Every ``exp(s - lse)`` is near ``exp(-sink)``, below float32's normal range; the target
    is normalised, so it must still be exact to float32 rounding."""
    from test_indexer_target import SCALE, target_fp64

    g = torch.Generator().manual_seed(3)
    q, kv = torch.randn(5, 3, 16, generator=g), torch.randn(9, 16, generator=g)
    idx = torch.randint(-1, 10, (5, 6), generator=g, dtype=torch.int32)
    sink = torch.tensor([sink_value, sink_value - 3.0, 0.5])
    with use_backend(backend):
        _, lse = sparse_mla(q, kv, idx, d_v=8, sm_scale=SCALE, attn_sink=sink, return_lse=True)
        target = mla_inductor.indexer_target(q, kv, idx, lse, sm_scale=SCALE, attn_sink=sink)
    ref = target_fp64(q, kv, idx, sink=sink)
    torch.testing.assert_close(target.double(), ref, atol=1e-6, rtol=1e-5)
    # without the third head every head's terms are subnormal in float32
    sink2 = sink[:2]
    with use_backend(backend):
        _, lse = sparse_mla(q[:, :2], kv, idx, d_v=8, sm_scale=SCALE, attn_sink=sink2,
                            return_lse=True)
        target = mla_inductor.indexer_target(q[:, :2], kv, idx, lse, sm_scale=SCALE,
                                             attn_sink=sink2)
    torch.testing.assert_close(target.double(), target_fp64(q[:, :2], kv, idx, sink=sink2),
                               atol=1e-6, rtol=1e-5)


def test_sm90_indexer_shift_keeps_the_kernels_terms_normal():
    """The SM90 launcher's lse shift (``indexer_target_host.shifted_lse``) with the kernel's arithmetic
    written out in float32 (``exp2(s * scale * log2 e - lse' * log2 e)``, summed over heads,
    divided by the row sum) gives the fp64 target for a sink of 100, where the unshifted lse
    loses bits to subnormals; the terms cannot overflow (each at most ``2**(126 - log2(topk
    * tile_heads))``)."""
    from test_indexer_target import SCALE, target_fp64

    from mla_inductor.kernels.sm90.indexer_target_host import shifted_lse

    g = torch.Generator().manual_seed(4)
    q, kv = torch.randn(5, 2, 16, generator=g), torch.randn(9, 16, generator=g)
    idx = torch.randint(0, 9, (5, 6), generator=g, dtype=torch.int32)
    sink = torch.tensor([100.0, 97.0])
    _, lse = sparse_mla(q, kv, idx, d_v=8, sm_scale=SCALE, attn_sink=sink, return_lse=True)
    log2e = math.log2(math.e)
    s = torch.einsum("thd,tkd->thk", q, kv[idx.long()]) * (SCALE * log2e)

    def kernel_target(lse_in):
        w = torch.exp2(s - (lse_in * log2e)[..., None]).sum(1)
        return w / w.sum(-1, keepdim=True)

    ref = target_fp64(q, kv, idx, sink=sink)
    shifted = shifted_lse(lse, idx.shape[1], 64)
    torch.testing.assert_close(kernel_target(shifted).double(), ref, atol=1e-6, rtol=1e-5)
    assert (kernel_target(lse).double() - ref).abs().max() > 1e-5  # the flaw it removes
    bound = 2.0 ** (126 - math.ceil(math.log2(6 * 64)))
    huge = torch.full_like(lse, 1e4)  # lse far above every score: no overflow either
    assert torch.isfinite(torch.exp2(s - (shifted_lse(huge, 6, 64) * log2e)[..., None])).all()
    assert (torch.exp2(s - (shifted.clamp_min(0) * log2e)[..., None]) <= bound).all()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_sm90_indexer_target_with_a_large_sink_matches_fp64():
    from test_indexer_target import SCALE, target_fp64

    g = torch.Generator().manual_seed(5)
    q = torch.randn(8, 16, 576, generator=g).bfloat16()
    kv = torch.randn(40, 576, generator=g).bfloat16()
    idx = torch.randint(-1, 41, (8, 64), generator=g, dtype=torch.int32)
    sink = torch.full((16,), 100.0)
    lse_ref = None
    with use_backend("reference"):
        _, lse_ref = sparse_mla(q.cuda(), kv.cuda(), idx.cuda(), sm_scale=SCALE,
                                attn_sink=sink.cuda(), return_lse=True)
    with use_backend("sm90"):
        target = mla_inductor.indexer_target(q.cuda(), kv.cuda(), idx.cuda(), lse_ref,
                                             sm_scale=SCALE, attn_sink=sink.cuda())
    ref = target_fp64(q.float(), kv.float(), idx, sink=sink)
    torch.testing.assert_close(target.double().cpu(), ref, atol=1e-4, rtol=1e-3)


# -- the indexer KL loss: a -inf logit under a target of 0; its optional inputs' checks --------


def test_kl_term_of_a_zero_target_and_a_minus_inf_logit_is_zero():
    logits = torch.tensor([[-math.inf, 0.3, -1.0, 2.0], [0.1, -math.inf, -math.inf, 0.0]],
                          requires_grad=True)
    target = torch.tensor([[0.0, 0.2, 0.3, 0.5], [0.6, 0.0, 0.0, 0.4]])
    indices = torch.tensor([[0, 1, 2, 3], [1, 2, 3, 0]])
    loss = indexer_kl_loss(logits, target, indices, kv_len=4)
    valid = torch.ones(2, 4, dtype=torch.bool)
    assert loss.item() == pytest.approx(_kl_fp64(logits.detach(), target, valid), rel=1e-6)
    (grad,) = torch.autograd.grad(loss, logits)
    assert torch.isfinite(grad).all()
    # d/dlogit_j = (softmax_j - target_j) / rows, 0 on the -inf slots (softmax and target 0)
    expected = (torch.softmax(logits.detach().double(), -1) - target.double()) / 2
    torch.testing.assert_close(grad.double(), expected, atol=1e-7, rtol=1e-6)


def _kl_inputs(lead):
    g = torch.Generator().manual_seed(0)
    return (torch.randn(*lead, 4, generator=g), torch.rand(*lead, 4, generator=g),
            torch.randint(0, 6, (*lead, 4), generator=g))


@pytest.mark.parametrize(("lead", "name", "value", "message"), [
    ((5,), "topk_length", torch.full((1,), 2), r"topk_length must be \[T\] = \[5\], got shape \(1,\)"),
    ((5,), "topk_length", torch.full((4,), 2), r"topk_length must be \[T\] = \[5\], got shape \(4,\)"),
    ((2, 5), "topk_length", torch.full((5,), 2), r"batched topk_length must be \[B, T\] = \[2, 5\]"),
    ((2, 5), "topk_length", torch.full((2, 1), 2), r"batched topk_length must be \[B, T\] = \[2, 5\]"),
    ((5,), "topk_length", torch.full((5,), 2, dtype=torch.int16), r"topk_length must be int32"),
    ((5,), "topk_length", torch.full((5,), 2.0), r"topk_length must be int32"),
    ((5,), "q_positions", torch.arange(1), r"q_positions must be \[T\] = \[5\] \(batched: \[B, T\]\)"),
    ((5,), "q_positions", torch.arange(6), r"q_positions must be \[T\] = \[5\]"),
    ((2, 5), "q_positions", torch.zeros(2, 1, dtype=torch.long), r"batched q_positions must be \[B, T\] = \[2, 5\] or \[T\]"),
    ((2, 5), "q_positions", torch.zeros(1, dtype=torch.long), r"batched q_positions must be"),
    ((5,), "q_positions", torch.zeros(5), r"q_positions must be an integer tensor"),
])
def test_kl_loss_checks_topk_length_and_q_positions_as_sparse_mla(lead, name, value, message):
    logits, target, indices = _kl_inputs(lead)
    kw = {name: value, "causal": name == "q_positions"}
    with pytest.raises(RuntimeError, match=r"^indexer_kl_loss: " + message):
        indexer_kl_loss(logits, target, indices, kv_len=6, **kw)
    fn = torch.compile(indexer_kl_loss, backend="eager", fullgraph=True)
    with pytest.raises(Exception, match=message.split(" = ")[0]):  # sizes may be symbols
        fn(logits, target, indices, kv_len=6, **kw)


@pytest.mark.parametrize(("lead", "name", "value"), [
    ((5,), "topk_length", torch.full((5,), 1, dtype=torch.int32)),
    ((2, 5), "topk_length", torch.full((2, 5), 1, dtype=torch.int64)),
    ((2, 5), "q_positions", torch.arange(5)),
    ((2, 5), "q_positions", torch.arange(10).view(2, 5).int()),
])
def test_kl_loss_takes_what_sparse_mla_takes(lead, name, value):
    logits, target, indices = _kl_inputs(lead)
    kw = {name: value, "causal": name == "q_positions"}
    got = indexer_kl_loss(logits, target, indices, kv_len=6, **kw)
    flat = lambda t: t.reshape(-1, t.shape[-1])  # noqa: E731
    valid = (indices >= 0) & (indices < 6)
    if name == "topk_length":
        valid &= torch.arange(4) < value[..., None]
    else:
        valid &= indices <= value.expand(lead)[..., None]
    assert got.item() == pytest.approx(_kl_fp64(flat(logits), flat(target), flat(valid)),
                                       rel=1e-6)


# -- flags given as tensors; a non-finite sm_scale ----------------------------------------------


def _small():
    q, kv, idx = random_inputs(4, 2, 16, 12, 5, dtype=torch.float32, seed=7)
    _, lse = sparse_mla(q, kv, idx, d_v=8, return_lse=True)
    return q, kv, idx, lse


FLAG_CALLS = {
    "sparse_mla causal": lambda q, kv, idx, lse, f: sparse_mla(q, kv, idx, d_v=8, causal=f),
    "sparse_mla return_lse": lambda q, kv, idx, lse, f: sparse_mla(q, kv, idx, d_v=8,
                                                                   return_lse=f),
    "sparse_mla return_max_logits": lambda q, kv, idx, lse, f: sparse_mla(
        q, kv, idx, d_v=8, return_max_logits=f),
    "indexer_target causal": lambda q, kv, idx, lse, f: mla_inductor.indexer_target(
        q, kv, idx, lse, causal=f),
    "indexer_kl_loss causal": lambda q, kv, idx, lse, f: indexer_kl_loss(
        idx.float(), idx.float(), idx, kv_len=12, causal=f),
}


@pytest.mark.parametrize("call", list(FLAG_CALLS))
@pytest.mark.parametrize("compiled", [False, True])
def test_a_flag_given_as_a_tensor_is_refused(call, compiled):
    op, name = call.split()
    fn = FLAG_CALLS[call]
    if compiled:
        fn = torch.compile(fn, backend="eager", fullgraph=True)
    with pytest.raises(Exception, match=rf"{op}: {name} must be a Python bool, got a "
                                        r"0-d tensor"):
        fn(*_small(), torch.tensor(True))


SCALE_CALLS = {
    "sparse_mla": lambda q, kv, idx, lse, s: sparse_mla(q, kv, idx, d_v=8, sm_scale=s),
    "indexer_target": lambda q, kv, idx, lse, s: mla_inductor.indexer_target(q, kv, idx, lse,
                                                                             sm_scale=s),
    "sparse_mla_fwd": lambda q, kv, idx, lse, s: torch.ops.mla_inductor.sparse_mla_fwd(
        q, kv, idx, None, None, None, s, 8, 0.0, False, False),
    "sparse_mla_bwd": lambda q, kv, idx, lse, s: torch.ops.mla_inductor.sparse_mla_bwd(
        q.new_zeros(4, 2, 8), None, q, kv, idx, None, None, None, q.new_zeros(4, 2, 8), lse,
        q.new_empty(0), s, 8),
    "indexer_target op": lambda q, kv, idx, lse, s: torch.ops.mla_inductor.indexer_target(
        q, kv, idx, None, None, None, lse, s),
}


@pytest.mark.parametrize("value", [math.inf, -math.inf, math.nan])
@pytest.mark.parametrize("call", list(SCALE_CALLS))
@pytest.mark.parametrize("compiled", [False, True])
def test_a_non_finite_sm_scale_is_refused(call, value, compiled):
    fn = SCALE_CALLS[call]
    if compiled:
        fn = torch.compile(fn, backend="eager", fullgraph=True)
    op = "indexer_target" if call.startswith("indexer_target") else "sparse_mla"
    with pytest.raises(Exception, match=rf"{op}: sm_scale must be finite, got"):
        fn(*_small(), value)


# -- a zero-width selection (topk = 0) ---------------------------------------------------------


@pytest.mark.parametrize("batched", [False, True])
@pytest.mark.parametrize("backend", backend_params())
def test_topk_zero_is_a_row_without_a_valid_slot(backend, batched):
    """``indices [T, 0]``: out 0, lse the sink (-inf without one), zero gradients for q and kv,
    ``d_sink = sum_t dlse`` (P_sink 1, dpsum 0); the target is ``[T, 0]`` and the KL 0 with a
    zero gradient. As for S = 0."""
    gpu = backend in ("sm90", "sm100")
    d_qk, d_v = (576, 512) if gpu else (16, 8)
    dtype, device = (torch.bfloat16, "cuda") if gpu else (torch.float32, "cpu")
    lead = (2, 3) if batched else (3,)
    q = torch.randn(*lead, 4, d_qk, device=device).to(dtype).requires_grad_()
    kv = torch.randn(*lead[:-1], 10, d_qk, device=device).to(dtype).requires_grad_()
    idx = torch.zeros(*lead, 0, dtype=torch.int32, device=device)
    use_sink = backend != "sm100"  # FA4's adapter maps no sink
    sink = torch.randn(4, device=device).requires_grad_() if use_sink else None
    dlse = torch.randn(*lead, 4, device=device)
    with use_backend(backend):
        out, lse = sparse_mla(q, kv, idx, d_v=d_v, attn_sink=sink, return_lse=True)
        grads = torch.autograd.grad(
            (out, lse) if use_sink else (out,), [q, kv] + ([sink] if use_sink else []),
            (torch.ones_like(out), dlse) if use_sink else (torch.ones_like(out),))
    assert out.shape == (*lead, 4, d_v) and torch.all(out == 0)
    expected_lse = sink.detach().expand_as(lse) if use_sink else torch.full_like(lse, -math.inf)
    assert torch.equal(lse, expected_lse)
    assert torch.all(grads[0] == 0) and torch.all(grads[1] == 0)
    if use_sink:
        torch.testing.assert_close(grads[2], dlse.reshape(-1, 4).sum(0))
    with use_backend(backend):
        target = mla_inductor.indexer_target(q, kv, idx, lse, attn_sink=sink)
    assert target.shape == (*lead, 0) and target.dtype == torch.float32
    logits = torch.zeros(*lead, 0, device=device, requires_grad=True)
    loss = indexer_kl_loss(logits, target, idx, kv_len=10, causal=True)
    assert loss.item() == 0.0
    (g,) = torch.autograd.grad(loss, logits)
    assert g.shape == logits.shape


def test_topk_zero_compiles(fp64_reference):
    def step(q, kv, idx, sink):
        out, lse = sparse_mla(q, kv, idx, d_v=8, attn_sink=sink, return_lse=True)
        return out.sum() + lse.sum()

    q = torch.randn(3, 2, 16, requires_grad=True)
    sink = torch.randn(2, requires_grad=True)
    loss = torch.compile(step, backend="aot_eager", fullgraph=True)(
        q, torch.randn(10, 16), torch.zeros(3, 0, dtype=torch.int32), sink)
    loss.backward()
    assert loss.item() == pytest.approx(3 * sink.sum().item(), rel=1e-6)
    assert torch.all(q.grad == 0) and torch.allclose(sink.grad, torch.full((2,), 3.0))
