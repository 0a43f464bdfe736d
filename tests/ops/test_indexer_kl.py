"""The op ``indexer_kl`` (the indexer loss's per-row KL) and its backward: values and gradients
against float64 written here from the definition, empty slots and rows, non-finite logits,
bitwise run-to-run equality, opcheck, fullgraph compile with a dynamic row count, backend
selection (float32 stays on the sm90 kernels), the kernels' compile for sm_90a on the CPU, and
on a GPU the kernels against float64 at a real size."""

from __future__ import annotations

import math

import pytest
import torch

import mla_inductor
from mla_inductor import backends, indexer_kl_loss
from mla_inductor.ops.indexer_kl import indexer_kl, indexer_kl_bwd
from mla_inductor.kernels import reference, reference_kl, sm90

CUDA = torch.device("cuda", 0)


def _inputs(R=9, K=37, S=50, seed=0, device="cpu"):
    """Random rows: indices in [-3, S + 3) (some empty), per-row ``hi`` (some -1) and ``length``
    (some 0, some past K), targets normalised over the valid slots with some zeros, NaN logits on
    the empty slots (never to be read)."""
    g = torch.Generator().manual_seed(seed)
    indices = torch.randint(-3, S + 3, (R, K), generator=g, dtype=torch.int32)
    hi = torch.randint(-1, S, (R,), generator=g, dtype=torch.int32)
    hi[0] = S - 1
    length = torch.randint(0, K + 5, (R,), generator=g, dtype=torch.int32)
    length[0] = K
    valid = _valid(indices, hi, length)
    target = torch.rand(R, K, generator=g) * (torch.rand(R, K, generator=g) > 0.2)
    target = torch.where(valid, target, 0.0)
    target = target / target.sum(-1, keepdim=True).clamp_min(1e-30)
    logits = torch.where(valid, 3 * torch.randn(R, K, generator=g), math.nan)
    return tuple(t.to(device) for t in (logits, target, indices, hi, length))


def _valid(indices, hi, length):
    slots = torch.arange(indices.shape[1], device=indices.device)
    return (indices >= 0) & (indices.long() <= hi.long()[:, None]) & (slots < length[:, None])


def kl_rows_fp64(logits, target, valid):
    """Per row ``sum_{valid, t > 0} t (log t - log_softmax_valid(l))`` in float64 (0 for a row
    without a valid slot), differentiable in logits; each row on its own."""
    rows = []
    for lg, tg, v in zip(logits.double(), target.double(), valid):
        if not v.any():
            rows.append(lg.sum() * 0.0 if lg.requires_grad else torch.zeros((), dtype=torch.float64))
            continue
        lp = torch.log_softmax(lg[v], -1)
        tv = tg[v]
        pos = tv > 0
        rows.append((tv[pos] * (tv[pos].log() - lp[pos])).sum())
    return torch.stack(rows)


def _run(logits, target, indices, hi, length):
    leaf = logits.clone().requires_grad_()
    kl, lse, tsum, count = indexer_kl(leaf, target, indices, hi, length)
    dkl = torch.linspace(0.5, 1.5, kl.shape[0], device=kl.device)
    (grad,) = torch.autograd.grad(kl, leaf, dkl)
    return kl, lse, tsum, count, grad, dkl


def _check_against_fp64(logits, target, indices, hi, length, got):
    kl, lse, tsum, count, grad, dkl = (t.cpu() for t in got)
    logits, target, indices, hi, length = (t.cpu() for t in (logits, target, indices, hi, length))
    valid = _valid(indices, hi, length)
    leaf = torch.where(valid, logits, 0.0).double().requires_grad_()
    ref = kl_rows_fp64(leaf, target, valid)
    (ref_grad,) = torch.autograd.grad(ref, leaf, dkl.double())
    assert torch.equal(count, valid.sum(-1, dtype=torch.int32))
    torch.testing.assert_close(kl.double(), ref.detach(), rtol=1e-5, atol=1e-5)
    ref_lse = torch.logsumexp(torch.where(valid, logits.double(), -math.inf), -1)
    torch.testing.assert_close(lse.double(), ref_lse, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(tsum.double(), torch.where(valid, target.double(), 0.0).sum(-1),
                               rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(grad.double(), ref_grad, rtol=1e-5, atol=1e-7)
    assert torch.all(grad[~valid] == 0)
    assert torch.all(kl[count == 0] == 0) and torch.all(lse[count == 0] == -math.inf)


def test_values_and_gradient_match_float64():
    inputs = _inputs()
    _check_against_fp64(*inputs, _run(*inputs))


def test_runs_are_bitwise_equal():
    inputs = _inputs(seed=1)
    first, second = _run(*inputs), _run(*inputs)
    assert all(torch.equal(a, b) for a, b in zip(first, second))


def test_non_finite_logits_follow_the_pytorch_formula():
    # row 0: a -inf logit under a target of 0 adds nothing; row 1: a -inf logit under a target
    # > 0 makes the KL +inf; row 2: a NaN logit on a valid slot makes lse and the KL NaN; row 3:
    # +inf makes lse NaN; row 4: every valid logit -inf, targets 0: lse -inf, KL 0
    inf, nan = math.inf, math.nan
    logits = torch.tensor([[-inf, 0.3, 1.0], [-inf, 0.3, 1.0], [nan, 0.3, 1.0], [inf, 0.3, 1.0],
                           [-inf, -inf, 5.0]])
    target = torch.tensor([[0.0, 0.5, 0.5], [0.2, 0.3, 0.5], [0.2, 0.3, 0.5], [0.2, 0.3, 0.5],
                           [0.0, 0.0, 0.0]])
    indices = torch.tensor([[0, 1, 2]] * 4 + [[0, 1, 9]], dtype=torch.int32)  # 9 > hi: empty
    hi = torch.full((5,), 5, dtype=torch.int32)
    length = torch.full((5,), 3, dtype=torch.int32)
    kl, lse, _, count = indexer_kl(logits, target, indices, hi, length)
    lp = torch.log_softmax(torch.tensor([0.3, 1.0], dtype=torch.float64), -1)
    assert kl[0].item() == pytest.approx(float((0.5 * (math.log(0.5) - lp)).sum()), rel=1e-6)
    assert kl[1].item() == inf
    assert math.isnan(kl[2].item()) and math.isnan(lse[2].item())
    assert math.isnan(lse[3].item())
    assert lse[4].item() == -inf and kl[4].item() == 0 and count[4].item() == 2


def test_opcheck():
    logits, target, indices, hi, length = _inputs(R=5, K=11, S=20, seed=2)
    logits = torch.where(torch.isnan(logits), 0.0, logits).requires_grad_()
    torch.library.opcheck(torch.ops.mla_inductor.indexer_kl, (logits, target, indices, hi, length))
    kl, lse, tsum, _ = indexer_kl(logits.detach(), target, indices, hi, length)
    torch.library.opcheck(torch.ops.mla_inductor.indexer_kl_bwd,
                          (torch.ones_like(kl), logits.detach(), target, indices, hi, length, lse,
                           tsum))


def test_fullgraph_compile_with_a_dynamic_row_count():
    def loss(logits, target, indices, hi, length):
        kl, _, _, count = indexer_kl(logits, target, indices, hi, length)
        return kl.sum() / (count > 0).sum().clamp_min(1)

    compiled = torch.compile(loss, backend="aot_eager", fullgraph=True, dynamic=True)
    for R in (6, 10):
        logits, target, indices, hi, length = _inputs(R=R, seed=R)
        logits = torch.where(torch.isnan(logits), 0.0, logits)
        a, b = logits.clone().requires_grad_(), logits.clone().requires_grad_()
        got, want = compiled(a, target, indices, hi, length), loss(b, target, indices, hi, length)
        got.backward()
        want.backward()
        assert torch.equal(got, want) and torch.equal(a.grad, b.grad)


@pytest.mark.parametrize(("args", "message"), [
    (lambda i: (i[0][:, :-1],) + i[1:], r"^indexer_kl: needs logits, target and indices"),
    (lambda i: (i[0], i[1], i[2].long()) + i[3:], r"^indexer_kl: takes float32 logits"),
    (lambda i: i[:3] + (i[3][:-1], i[4]), r"^indexer_kl: needs hi and length \[R\]"),
    (lambda i: (i[0].double(),) + i[1:], r"^indexer_kl: takes float32 logits"),
])
def test_bad_input_is_refused_at_run_and_trace_time(args, message):
    bad = args(_inputs(R=4, K=6, S=8))
    with pytest.raises(RuntimeError, match=message):
        indexer_kl(*bad)
    # at trace time the message stands inside Dynamo's own
    with pytest.raises(RuntimeError, match=message.removeprefix("^")):
        torch.compile(indexer_kl, backend="eager", fullgraph=True)(*bad)


def test_backward_checks_its_row_tensors():
    logits, target, indices, hi, length = _inputs(R=4, K=6, S=8)
    rows = torch.zeros(4)
    with pytest.raises(RuntimeError, match=r"^indexer_kl_bwd: needs dkl \[R\] float32"):
        indexer_kl_bwd(torch.zeros(3), logits, target, indices, hi, length, rows, rows)


def test_the_loss_is_the_mean_of_the_rows_with_a_valid_slot():
    logits, target, indices, hi, length = _inputs(R=12, K=9, S=15, seed=3)
    logits = torch.where(torch.isnan(logits), 0.0, logits)
    # the loss's own validity rule: kv_len 15, no causal, topk_length = length
    got = indexer_kl_loss(logits, target, indices, kv_len=15, topk_length=length)
    valid = _valid(indices, torch.full((12,), 14, dtype=torch.int32), length)
    rows = kl_rows_fp64(logits, target, valid)
    assert got.item() == pytest.approx(float(rows.sum() / valid.any(-1).sum()), rel=1e-5)


def test_reference_backend_exposes_the_protocol_functions():
    assert reference.indexer_kl is reference_kl.indexer_kl
    assert reference.indexer_kl_bwd is reference_kl.indexer_kl_bwd


@pytest.mark.parametrize("direction", ["indexer_kl", "indexer_kl_bwd"])
def test_float32_stays_on_the_sm90_kernels(direction, fake_gpu, monkeypatch):
    fake_gpu((9, 0))
    monkeypatch.setattr(sm90, "available", lambda: (True, ""))
    assert backends.select(CUDA, torch.float32, direction) is sm90
    with mla_inductor.use_backend("sm90"):
        assert backends.select(CUDA, torch.float32, direction) is sm90
    # the other ops' float32 still falls back
    with pytest.warns(UserWarning, match="float32 input"):
        assert backends.select(CUDA, torch.float32, "forward") is reference


def test_kernels_compile_for_sm90_on_the_cpu():
    pytest.importorskip("cutlass.cute")
    from mla_inductor.kernels.sm90 import kl_host

    compiled = mla_inductor.precompile(arch="sm_90a", thresholds=(), backward_heads=(),
                                       indexer_heads=(), indexer_kl=True)
    assert sorted(compiled) == [(False, "sm_90a"), (True, "sm_90a")]
    with pytest.raises(ValueError, match="^sparse_mla: .*sm_90a"):
        kl_host.precompile_kl("sm_100a")


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@pytest.mark.parametrize(("R", "K"), [(64, 2048), (37, 130), (5, 1)])
def test_on_the_gpu_against_float64_and_bitwise_repeatable(R, K):
    inputs = _inputs(R=R, K=K, S=4 * K, seed=K, device="cuda")
    first, second = _run(*inputs), _run(*inputs)
    assert all(torch.equal(a, b) for a, b in zip(first, second))
    _check_against_fp64(*inputs, first)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_on_the_gpu_at_a_real_size_matches_the_reference():
    """16384 rows of 2048 slots (the indexer loss of one T 16384 layer): the kernels against the
    reference backend on the same inputs, and sampled rows against float64."""
    inputs = _inputs(R=16384, K=2048, S=16384, seed=5, device="cuda")
    got = _run(*inputs)
    with mla_inductor.use_backend("reference"):
        want = _run(*inputs)
    for a, b in zip(got[:4], want[:4]):
        torch.testing.assert_close(a, b, rtol=2e-5, atol=2e-5, equal_nan=True)
    # the two lse differ in their last bits, so p tsum - t does too (the gradient is up to 0.1)
    torch.testing.assert_close(got[4], want[4], rtol=1e-5, atol=1e-7)
    rows = torch.arange(0, 16384, 1021, device="cuda")
    sample = [t[rows] for t in inputs]
    _check_against_fp64(*sample, [t[rows] for t in got[:5]] + [got[5][rows]])
