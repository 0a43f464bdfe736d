"""``lightning_indexer_scores``: the lightning indexer's scores at the selected slots and their
gradients in q, k and weights, against a float64 computation written here from the definition
(autograd of dense one-hot products); finite differences of the reference's backward; empty
slots and rows; duplicated indices; relu's gradient at exactly 0; every layout; the reference's
chunking; bad input at run and trace time; opcheck; fullgraph compile with a dynamic T, forward
and backward; backend selection on a CUDA device (the reference with a warning until a kernel
backend has the op); on a GPU, bfloat16 values and a deterministic dk."""

from __future__ import annotations

import contextlib
import math

import pytest
import torch
from conftest import fallback_warnings, rel_l2
from torch._dynamo.testing import CompileCounterWithBackend

from mla_inductor import backends, lightning_indexer_scores, use_backend
from mla_inductor.kernels import reference, reference_lightning_indexer_scores, sm90

CUDA = torch.device("cuda", 0)


def scores_fp64(q, k, weights, indices):
    """float64 ``[.., T, topk]`` from the definition, differentiable in q, k and weights:
    ``sum_h w[t, h] relu(q[t, h] . k[idx[t, j]])`` on valid slots (0 <= idx < S), 0 elsewhere.
    Any layout of the op; keys through a one-hot product (no gather), from which the keys no
    valid slot names are zeroed first (0 * NaN would reach every slot)."""
    batched = q.dim() == 4
    if not batched:
        q, k, weights, indices = q[None], k[None], weights[None], indices[None]
    if k.dim() == 4:
        k = k[:, :, 0]
    B, S = k.shape[:2]
    idx = indices.long()
    valid = (idx >= 0) & (idx < S)
    onehot = torch.zeros(*idx.shape, S, dtype=torch.float64)
    onehot.scatter_(-1, torch.where(valid, idx, 0)[..., None], valid[..., None].double())
    named = onehot.sum((1, 2)) > 0  # [B, S]
    k64 = torch.where(named[..., None], k.double(), 0.0)
    keys = torch.einsum("btjs,bsd->btjd", onehot, k64)
    dots = torch.einsum("bthd,btjd->bthj", q.double(), keys)
    s = torch.einsum("bth,bthj->btj", weights.double(), dots.relu())
    s = torch.where(valid, s, 0.0)
    return s if batched else s[0]


def _inputs(B, T, H, D, S, topk, seed=0, dtype=torch.float32, empty=True):
    """``(q, k, weights, indices)`` batched (``B`` None: unbatched), indices int32 with some
    empty slots (-1, -7, S, S + 5) and some duplicates."""
    g = torch.Generator().manual_seed(seed)
    lead = () if B is None else (B,)
    q = torch.randn(*lead, T, H, D, generator=g).to(dtype)
    k = torch.randn(*lead, S, D, generator=g).to(dtype)
    w = torch.randn(*lead, T, H, generator=g)
    idx = torch.randint(0, S, (*lead, T, topk), generator=g, dtype=torch.int32)
    if empty:
        bad = torch.tensor([-1, -7, S, S + 5], dtype=torch.int32)
        drop = torch.rand(*lead, T, topk, generator=g) < 0.25
        idx = torch.where(drop, bad[torch.randint(0, 4, idx.shape, generator=g)], idx)
    return q, k, w, idx


def _grads(fn, q, k, w, idx, dscores):
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, w)]
    out = fn(*leaves, idx)
    grads = torch.autograd.grad(out, leaves, dscores)
    return out, *grads


def _check_against_fp64(q, k, w, idx, seed=1, tol=2e-6):
    dscores = torch.randn(idx.shape, generator=torch.Generator().manual_seed(seed))
    ours = _grads(lightning_indexer_scores, q, k, w, idx, dscores)
    ref = _grads(scores_fp64, q.double(), k.double(), w.double(), idx, dscores.double())
    assert ours[0].dtype == torch.float32 and ours[0].shape == idx.shape
    for name, a, b, like in zip(("scores", "dq", "dk", "dweights"), ours, ref, (w, q, k, w)):
        assert a.dtype == like.dtype and a.shape == b.shape, name
        assert rel_l2(a, b) <= tol, (name, rel_l2(a, b))
    return ours, ref


LAYOUTS = {
    "T,S": lambda q, k, w, i: (q[0], k[0], w[0], i[0]),
    "T,S1": lambda q, k, w, i: (q[0], k[0, :, None], w[0], i[0]),
    "B,BS": lambda q, k, w, i: (q, k, w, i),
    "B,BS1": lambda q, k, w, i: (q, k[:, :, None], w, i),
}


@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_values_and_gradients_match_float64(layout, index_dtype):
    """float32 scores and the gradients of q, k and weights against float64 autograd, with empty
    slots and duplicates, in every layout (batched: indices local to each batch element)."""
    q, k, w, idx = LAYOUTS[layout](*_inputs(3, 9, 4, 24, 13, 10, seed=2))
    ours, _ = _check_against_fp64(q, k, w, idx.to(index_dtype))
    valid = (idx >= 0) & (idx < 13)
    assert not ours[0][~valid].any() and ours[0][valid].ne(0).float().mean() > 0.5


def test_a_batch_element_reads_only_its_own_keys():
    """Batched indices are local: the same index names a different key in each batch element,
    and an index >= S never reaches the next element's keys."""
    q, k, w, idx = _inputs(2, 5, 3, 8, 6, 4, seed=3, empty=False)
    idx[:, :, 0] = 2
    idx[0, :, 1] = 6  # would be row 0 of batch element 1 if offsets leaked
    out = lightning_indexer_scores(q, k, w, idx)
    for b in range(2):
        one = lightning_indexer_scores(q[b], k[b], w[b], idx[b])
        torch.testing.assert_close(out[b], one, rtol=0, atol=0)
    assert not out[0, :, 1].any()
    _check_against_fp64(q, k, w, idx)


def test_reference_backward_is_the_derivative_of_its_forward():
    """Finite differences (torch.autograd.gradcheck, float64) of the reference's forward against
    its backward, called directly (the op itself takes bf16, fp16 and fp32)."""
    fwd = reference_lightning_indexer_scores.lightning_indexer_scores
    bwd = reference_lightning_indexer_scores.lightning_indexer_scores_bwd

    class Scores(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, w, idx):
            ctx.save_for_backward(q, k, w, idx)
            return fwd(q, k, w, idx)

        @staticmethod
        def backward(ctx, g):
            return (*bwd(g.contiguous(), *ctx.saved_tensors), None)

    q, k, w, idx = _inputs(2, 4, 3, 5, 6, 5, seed=4, dtype=torch.float64)
    idx[0, 1, 2] = idx[0, 1, 3]  # a duplicate
    leaves = [t.requires_grad_() for t in (q, k, w.double())]
    assert torch.autograd.gradcheck(lambda *a: Scores.apply(*a, idx), leaves)


def test_empty_slots_and_rows_give_zero_and_no_gradient():
    """Empty slots (< 0, >= S) score exactly 0 and pass no gradient, whatever their dscores (NaN
    included); an all-empty row gives 0 and zero gradients of its q and weights; a NaN in a key
    no valid slot names (row 0, which empty slots are redirected to) and an inf in the q of an
    all-empty row reach nothing."""
    q, k, w, idx = _inputs(None, 6, 3, 8, 10, 5, seed=5, empty=False)
    idx[1] = torch.tensor([-1, 10, -3, 11, -1])  # all empty
    idx[idx == 0] = 4
    idx[3, :2] = torch.tensor([-1, 12])
    k[0] = math.nan
    q[1, 0, 0] = math.inf
    dscores = torch.randn(idx.shape)
    empty = (idx < 0) | (idx >= 10)
    dscores[empty] = math.nan
    out, dq, dk, dw = _grads(lightning_indexer_scores, q, k, w, idx, dscores)
    assert torch.equal(out[empty], torch.zeros(int(empty.sum())))
    assert not dq[1].any() and not dw[1].any() and not dk[0].any()
    assert all(torch.isfinite(t).all() for t in (out, dq, dk, dw))
    k[0] = 0.0
    q[1, 0, 0] = 0.0
    dscores[empty] = 0.0
    ref = _grads(scores_fp64, q.double(), k.double(), w.double(), idx, dscores.double())
    for a, b in zip((out, dq, dk, dw), ref):
        assert rel_l2(a, b) <= 2e-6


def test_a_nan_reaches_only_the_slots_it_names():
    """A NaN in a key that valid slots name gives NaN on those slots only (and on the gradients
    of the queries that read it); other tokens' scores stay finite and equal."""
    q, k, w, idx = _inputs(None, 5, 2, 8, 7, 3, seed=6, empty=False)
    idx[:, 0] = torch.tensor([1, 2, 3, 2, 4])
    idx[:, 1:] = torch.tensor([5, 6])
    k[2] = math.nan
    out = lightning_indexer_scores(q, k, w, idx)
    names = idx == 2
    assert out[names].isnan().all() and not out[~names].isnan().any()


def test_duplicated_indices_count_once_per_occurrence():
    """A key named by two slots of a token: both slots score the same, and dk gets both
    contributions (the float64 autograd, which counts per occurrence, agrees)."""
    q, k, w, idx = _inputs(None, 4, 3, 8, 6, 4, seed=7, empty=False)
    idx[:] = torch.tensor([2, 2, 5, 2])
    dscores = torch.ones(idx.shape)
    out, dq, dk, dw = _grads(lightning_indexer_scores, q, k, w, idx, dscores)
    assert torch.equal(out[:, 0], out[:, 1]) and torch.equal(out[:, 0], out[:, 3])
    single = torch.tensor([2, -1, 5, -1], dtype=torch.int32).expand(4, 4)
    _, dq1, dk1, dw1 = _grads(lightning_indexer_scores, q, k, w, single,
                              torch.tensor([3.0, 0.0, 1.0, 0.0]).expand(4, 4))
    torch.testing.assert_close(dk, dk1, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(dq, dq1, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(dw, dw1, rtol=1e-6, atol=1e-6)
    _check_against_fp64(q, k, w, idx)


def test_relu_gradient_at_exactly_zero_is_zero():
    """``q . k == 0`` exactly (orthogonal vectors): the score is 0 and relu's gradient there is 0
    (as torch.relu's): no dq, dk or dweights from that slot; a positive product passes."""
    q = torch.tensor([[[1.0, 0.0], [2.0, 1.0]]])  # [T 1, H 2, D 2]
    k = torch.tensor([[0.0, 3.0], [1.0, 0.0]])
    w = torch.tensor([[0.5, 2.0]])
    idx = torch.tensor([[0, -1]], dtype=torch.int32)  # head 0: q.k = 0, head 1: q.k = 3
    out, dq, dk, dw = _grads(lightning_indexer_scores, q, k, w, idx, torch.ones(1, 2))
    assert out.tolist() == [[6.0, 0.0]]
    assert dq.tolist() == [[[0.0, 0.0], [0.0, 6.0]]]
    assert dk.tolist() == [[4.0, 2.0], [0.0, 0.0]]
    assert dw.tolist() == [[0.0, 3.0]]


def test_the_reference_chunks_tokens_across_batch_elements(monkeypatch):
    """Chunks of 2 flattened rows (crossing batch boundaries) give the one-chunk result bitwise,
    forward and backward; no chunk holds more rows."""
    q, k, w, idx = _inputs(2, 5, 3, 8, 7, 4, seed=8)
    dscores = torch.randn(idx.shape)
    one = _grads(lightning_indexer_scores, q, k, w, idx, dscores)
    rows = []
    real = reference_lightning_indexer_scores._gather
    monkeypatch.setattr(reference_lightning_indexer_scores, "_gather",
                        lambda k_, r, *a: rows.append(r.shape[0]) or real(k_, r, *a))
    monkeypatch.setattr(reference_lightning_indexer_scores, "_CHUNK_ELEMENTS", 2 * 4 * (8 + 3))
    many = _grads(lightning_indexer_scores, q, k, w, idx, dscores)
    assert max(rows) == 2 and sum(rows) == 2 * 10
    for a, b in zip(one, many):
        assert torch.equal(a, b)


def test_degenerate_sizes():
    """T 0, topk 0 and S 0 (every slot empty) give the right shapes, zeros and zero gradients."""
    for T, S, topk in ((0, 5, 3), (4, 5, 0), (4, 0, 3)):
        q, k, w, idx = _inputs(2, T, 3, 8, max(S, 1), topk, seed=9, empty=False)
        k = k[:, :S]
        out, dq, dk, dw = _grads(lightning_indexer_scores, q, k, w, idx, torch.ones(idx.shape))
        assert out.shape == (2, T, topk) and not out.any()
        assert dq.shape == q.shape and dk.shape == k.shape and dw.shape == w.shape
        assert not dq.any() and not dk.any() and not dw.any()


@contextlib.contextmanager
def _deterministic():
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before)


def test_runs_under_deterministic_algorithms():
    """Under torch.use_deterministic_algorithms(True) (no op of the reference refuses it) the
    results are bitwise those without, with many slots adding into few keys."""
    q, k, w, idx = _inputs(2, 32, 4, 16, 3, 16, seed=10)
    dscores = torch.randn(idx.shape)
    free = _grads(lightning_indexer_scores, q, k, w, idx, dscores)
    with _deterministic():
        fixed = _grads(lightning_indexer_scores, q, k, w, idx, dscores)
    assert all(torch.equal(a, b) for a, b in zip(free, fixed))


BAD = [
    # (what, args from (q, k, w, idx) unbatched [6, 3, 8], k [10, 8], w [6, 3], idx [6, 4], error)
    ("q rank", lambda q, k, w, i: (q[0], k, w, i),
     r"q must be \[T, H, D\] or \[B, T, H, D\], got shape \(3, 8\)"),
    ("k rank", lambda q, k, w, i: (q, k[0], w, i),
     r"with q \[T, H, D\], k must be \[S, D\] or \[S, 1, D\], got shape \(8,\)"),
    ("k heads", lambda q, k, w, i: (q, k.view(10, 2, 4), w, i),
     r"k must have a head dimension of 1 .*got shape \(10, 2, 4\)"),
    ("batched k", lambda q, k, w, i: (q[None], k, w[None], i[None]),
     r"with q \[B, T, H, D\], k must be \[B, S, D\] or \[B, S, 1, D\], got shape \(10, 8\)"),
    ("weights rank", lambda q, k, w, i: (q, k, w[None], i),
     r"with q \[T, H, D\], weights must be \[T, H\], got shape \(1, 6, 3\)"),
    ("indices rank", lambda q, k, w, i: (q, k, w, i[None]),
     r"with q \[T, H, D\], indices must be \[T, topk\], got shape \(1, 6, 4\)"),
    ("float indices", lambda q, k, w, i: (q, k, w, i.float()),
     r"indices must be an integer tensor \(int32 or int64\), got torch.float32"),
    ("q dtype", lambda q, k, w, i: (q.double(), k.double(), w, i),
     r"q has unsupported dtype torch.float64"),
    ("k dtype", lambda q, k, w, i: (q, k.half(), w, i),
     r"k dtype torch.float16 differs from q dtype torch.float32"),
    ("weights dtype", lambda q, k, w, i: (q, k, w.bfloat16(), i),
     r"weights must be float32, got torch.bfloat16"),
    ("D", lambda q, k, w, i: (q, k[:, :7], w, i), r"mismatched D: q has 8, k has 7"),
    ("weights heads", lambda q, k, w, i: (q, k, w[:, :2], i),
     r"weights must be \[B, T, H\] = \(1, 6, 3\) .*got shape \(1, 6, 2\)"),
    ("indices T", lambda q, k, w, i: (q, k, w, i[:5]),
     r"indices must be \[B, T, topk\] with \(B, T\) = \(1, 6\) as q's, got shape \(1, 5, 4\)"),
    ("batch size", lambda q, k, w, i: (q[None], k[None].expand(2, 10, 8), w[None], i[None]),
     r"batch size differs: q \[B, T, H, D\] has B=1, k \[B, S, D\] has 2"),
    ("device", lambda q, k, w, i: (q, k.to("meta"), w, i),
     r"tensors on different devices: q on cpu, k on meta"),
]


@pytest.mark.parametrize("what, make, error", BAD, ids=[b[0] for b in BAD])
def test_bad_input_is_refused_at_run_and_trace_time(what, make, error):
    args = make(*_inputs(None, 6, 3, 8, 10, 4, seed=11))
    with pytest.raises(RuntimeError, match="^lightning_indexer_scores: " + error):
        lightning_indexer_scores(*args)
    if what == "device":
        return
    torch._dynamo.reset()
    compiled = torch.compile(lightning_indexer_scores, backend="aot_eager", fullgraph=True)
    with pytest.raises(Exception, match="lightning_indexer_scores: " + error):
        compiled(*args)


def test_non_tensor_arguments_are_refused():
    q, k, w, idx = _inputs(None, 6, 3, 8, 10, 4, seed=12)
    with pytest.raises(RuntimeError,
                       match="^lightning_indexer_scores: indices must be a torch.Tensor, got list"):
        lightning_indexer_scores(q, k, w, idx.tolist())


def test_backward_op_checks_dscores():
    q, k, w, idx = _inputs(1, 6, 3, 8, 10, 4, seed=13)
    op = torch.ops.mla_inductor.lightning_indexer_scores_bwd
    with pytest.raises(RuntimeError, match=r"^lightning_indexer_scores: dscores must be float32 "
                                           r"\(1, 6, 4\) \(the scores' shape\), got torch.float64"):
        op(torch.zeros(1, 6, 4, dtype=torch.float64), q, k, w, idx)


def test_opcheck():
    q, k, w, idx = _inputs(2, 6, 3, 8, 10, 4, seed=14)
    q.requires_grad_()
    k.requires_grad_()
    w.requires_grad_()
    torch.library.opcheck(torch.ops.mla_inductor.lightning_indexer_scores, (q, k, w, idx))
    dscores = torch.randn(idx.shape)
    torch.library.opcheck(torch.ops.mla_inductor.lightning_indexer_scores_bwd,
                          (dscores, q.detach(), k.detach(), w.detach(), idx))


@pytest.mark.parametrize("compiler", ["aot_eager", "inductor"])
def test_fullgraph_compile_with_dynamic_tokens_forward_and_backward(compiler):
    """One graph, no break, for a loss on the scores (int64 indices cast inside), recompiled for
    no other T: values and the three gradients as in eager."""
    def loss(q, k, w, idx):
        s = lightning_indexer_scores(q, k, w, idx)
        return (s.log_softmax(-1) * torch.linspace(0, 1, s.shape[-1])).sum()

    torch._dynamo.reset()
    counter = CompileCounterWithBackend(compiler)
    compiled = torch.compile(loss, backend=counter, fullgraph=True, dynamic=True)
    for T in (7, 11, 5):
        q, k, w, idx = _inputs(2, T, 3, 8, 10, 4, seed=T, empty=False)
        idx = idx.long()
        got = _grads(compiled, q, k, w, idx, torch.tensor(1.0))
        want = _grads(loss, q, k, w, idx, torch.tensor(1.0))
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert counter.frame_count == 1


def test_inductor_without_implicit_fallbacks():
    """Both ops are explicit fallbacks of inductor (mla_inductor.lowering)."""
    q, k, w, idx = _inputs(1, 6, 3, 8, 10, 4, seed=15)
    torch._dynamo.reset()
    with torch._inductor.config.patch(implicit_fallbacks=False, fx_graph_cache=False):
        got = _grads(torch.compile(lambda *a: lightning_indexer_scores(a[0] * 2, *a[1:]),
                                   fullgraph=True), q, k, w, idx, torch.ones(idx.shape))
    want = _grads(lambda *a: lightning_indexer_scores(a[0] * 2, *a[1:]), q, k, w, idx,
                  torch.ones(idx.shape))
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


DIMS = (16, 64, 64, 128, 0, frozenset())


@pytest.mark.parametrize("direction", ["lightning_indexer_scores", "lightning_indexer_scores_bwd"])
def test_on_sm90_without_the_kernel_auto_warns_and_runs_the_reference(direction, fake_gpu,
                                                                      monkeypatch):
    fake_gpu((9, 0))
    monkeypatch.setattr(sm90, "available", lambda: (True, ""))
    monkeypatch.delattr(sm90, direction, raising=False)
    call = (CUDA, torch.bfloat16, direction, DIMS)
    [message] = fallback_warnings(call, call)
    assert message == (
        f"mla_inductor: sparse-MLA {direction} falls back to the PyTorch reference backend, which "
        f"is much slower (often 50-100x): the sm90 backend has no {direction} kernel yet"
    )
    with use_backend("sm90"):  # forced: the same fallback
        monkeypatch.setattr(backends, "_warned", set())
        [forced] = fallback_warnings(call)
    assert forced == message


def test_reference_backend_exposes_the_protocol_functions():
    assert (reference.lightning_indexer_scores
            is reference_lightning_indexer_scores.lightning_indexer_scores)
    assert (reference.lightning_indexer_scores_bwd
            is reference_lightning_indexer_scores.lightning_indexer_scores_bwd)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_bfloat16_on_the_gpu_matches_float64_and_is_deterministic():
    """bfloat16 inputs on the GPU (whatever backend ``auto`` picks): scores and gradients against
    float64 of the same bf16 values; dk bitwise the same in two runs under deterministic
    algorithms."""
    q, k, w, idx = _inputs(2, 64, 8, 128, 96, 32, seed=16, dtype=torch.bfloat16)
    q, k, w, idx = (t.cuda() for t in (q, k, w, idx))
    dscores = torch.randn(idx.shape, device="cuda")
    with _deterministic():
        first = _grads(lightning_indexer_scores, q, k, w, idx, dscores)
        second = _grads(lightning_indexer_scores, q, k, w, idx, dscores)
    assert all(torch.equal(a, b) for a, b in zip(first, second))
    ref = _grads(scores_fp64, q.cpu().double(), k.cpu().double(), w.cpu().double(), idx.cpu(),
                 dscores.cpu().double())
    for name, a, b in zip(("scores", "dq", "dk", "dweights"), first, ref):
        assert rel_l2(a.cpu(), b) <= (1e-5 if name in ("scores", "dweights") else 1e-2), name
