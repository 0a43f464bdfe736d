"""The indexer's training signal on the CPU backends: ``indexer_target`` against an fp64 target
written here from its definition (the attention's softmax over the valid slots with the sink,
summed over heads, L1-normalised) for every index pattern, batched and unbatched; rows that sum
to 1; the reference's chunking; opcheck; one fullgraph graph with the attention, the target and
the loss; backend selection on a CUDA device (sm90's kernel, the fallback warning);
``indexer_kl_loss`` against fp64 autograd."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import CPU_BACKENDS, fallback_warnings
from torch._dynamo.testing import CompileCounterWithBackend

from mla_inductor import backends, indexer_kl_loss, indexer_target, sparse_mla, use_backend
from mla_inductor.kernels import reference, sm90, sm100

D, DV, SCALE = 40, 32, 0.3
CUDA = torch.device("cuda", 0)


def _valid64(idx, S, topk_length=None, positions=None):
    idx = idx.long()
    valid = (idx >= 0) & (idx < S)
    if topk_length is not None:
        valid &= torch.arange(idx.shape[-1]) < topk_length.long()[..., None]
    if positions is not None:
        valid &= idx <= positions.long()[..., None]
    return valid


def target_fp64(q, kv, idx, topk_length=None, positions=None, sink=None):
    """``[T, topk]`` float64 from the definition: the softmax over the valid slots (and the sink)
    per head, summed over heads, divided by its sum over the row's valid slots."""
    T, H, _ = q.shape
    S = kv.shape[0]
    valid = _valid64(idx, S, topk_length, positions)
    keys = kv.double()[torch.where(valid, idx.long(), 0)]  # [T, topk, d]
    s = torch.einsum("thd,tkd->thk", q.double(), keys) * SCALE
    s = s.masked_fill(~valid[:, None, :], -math.inf)
    sink_col = torch.full((T, H, 1), -math.inf, dtype=torch.float64)
    if sink is not None:
        sink_col = sink.double()[None, :, None].expand(T, H, 1)
    full = torch.cat((s, sink_col), dim=-1)
    m = full.amax(-1, keepdim=True).clamp_min(-1e300)  # rows of -inf only: p = 0
    p = torch.exp(full - m)
    p = p / p.sum(-1, keepdim=True).clamp_min(1e-300)
    w = p[..., :-1].sum(1)
    return w / w.sum(-1, keepdim=True).clamp_min(1e-300)


def _inputs(T, H, S, topk, seed, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(T, H, D, generator=g).to(dtype)
    kv = torch.randn(S, D, generator=g).to(dtype)
    idx = torch.randint(-2, S + 2, (T, topk), generator=g)  # invalid slots on both sides
    idx[:, 1] = idx[:, 0]  # duplicates
    idx[2] = -1  # a row with no valid slot
    return q, kv, idx.int()


def _run(backend, q, kv, idx, **kw):
    with use_backend(backend):
        _, lse = sparse_mla(q, kv, idx, d_v=DV, sm_scale=SCALE, return_lse=True, **kw)
        return indexer_target(q, kv, idx, lse, sm_scale=SCALE, **kw)


def _check_rows(target, valid):
    """Valid slots sum to 1 on rows that have one; everything else is exactly 0."""
    assert torch.all(target[~valid] == 0)
    has = valid.any(-1)
    torch.testing.assert_close(target.sum(-1)[has], torch.ones(int(has.sum())), rtol=0, atol=1e-5)
    assert torch.all(target[~has] == 0)


PATTERNS = {
    "plain": {},
    "topk_length": {"topk_length": torch.tensor([7, 0, 3, 7, 1, 5, 2, 6], dtype=torch.int32)},
    "causal_default": {"causal": True},
    "causal_positions": {"causal": True,
                         "q_positions": torch.tensor([3, -1, 11, 6, 0, 9, 2, 12], dtype=torch.int32)},
    "sink_mixed": {"attn_sink": torch.tensor([0.5, -math.inf, 3.0])},
    "sink_-inf": {"attn_sink": torch.full((3,), -math.inf)},
    "sink_0": {"attn_sink": torch.zeros(3)},
    "sink_large": {"attn_sink": torch.full((3,), 50.0)},
    "all_features": {"causal": True, "topk_length": torch.tensor([7, 0, 3, 7, 1, 5, 2, 6]),
                     "attn_sink": torch.tensor([1.0, -2.0, 0.0])},
}


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("pattern", list(PATTERNS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_target_matches_fp64(backend, pattern, dtype):
    kw = PATTERNS[pattern]
    T, H, S, topk = 8, 3, 12, 7
    q, kv, idx = _inputs(T, H, S, topk, seed=hash(pattern) % 1000, dtype=dtype)
    target = _run(backend, q, kv, idx, **kw)
    assert target.dtype == torch.float32 and target.shape == (T, topk)
    positions = None
    if kw.get("causal"):
        positions = kw.get("q_positions", torch.arange(T) + (S - T))
    want = target_fp64(q, kv, idx, kw.get("topk_length"), positions, kw.get("attn_sink"))
    torch.testing.assert_close(target.double(), want, rtol=1e-5, atol=1e-6)
    _check_rows(target, _valid64(idx, S, kw.get("topk_length"), positions))


def test_duplicates_get_one_entry_per_slot():
    q, kv, idx = _inputs(8, 3, 12, 7, seed=3)
    target = _run("reference", q, kv, idx)
    both = (idx[:, 0] >= 0) & (idx[:, 0] < 12)
    assert torch.equal(target[both, 0], target[both, 1]) and torch.all(target[both, 0] > 0)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_batched_matches_each_batch_element(backend):
    B, T, H, S, topk = 2, 8, 3, 12, 7
    parts = [_inputs(T, H, S, topk, seed=10 + b) for b in range(2)]
    q, kv, idx = (torch.stack(ts) for ts in zip(*parts))
    lengths = torch.randint(0, topk + 1, (B, T))  # int64, as the API accepts
    sink = torch.tensor([0.5, -1.0, 2.0])
    kw = dict(topk_length=lengths, causal=True, attn_sink=sink)
    target = _run(backend, q, kv.unsqueeze(2), idx.long().unsqueeze(2), **kw)
    assert target.shape == (B, T, topk)
    for b in range(B):
        want = target_fp64(q[b], kv[b], idx[b], lengths[b], torch.arange(T) + (S - T), sink)
        torch.testing.assert_close(target[b].double(), want, rtol=1e-5, atol=1e-6)


def test_inputs_that_require_grad_are_fine_and_the_target_has_no_gradient():
    q, kv, idx = _inputs(8, 3, 12, 7, seed=4)
    q.requires_grad_()
    kv.requires_grad_()
    sink = torch.zeros(3, requires_grad=True)
    out, lse = sparse_mla(q, kv, idx, d_v=DV, sm_scale=SCALE, attn_sink=sink, return_lse=True)
    target = indexer_target(q, kv, idx, lse, sm_scale=SCALE, attn_sink=sink)
    assert not target.requires_grad
    out.sum().backward()  # the attention's graph is untouched
    assert q.grad is not None


def test_reference_chunking_is_invisible_and_bounded(monkeypatch):
    """Tiny chunks give bitwise the same target; no chunk's scores hold more than 2 tokens."""
    q, kv, idx = _inputs(9, 3, 12, 7, seed=5)
    pos = torch.arange(9, dtype=torch.int32) + 2
    sink = torch.tensor([0.5, -math.inf, 2.0])
    _, lse, _, _ = reference.forward(q, kv, idx, None, pos, sink, SCALE, DV, 0.0, False, False)
    args = (q, kv, idx, None, pos, sink, lse, SCALE)
    one = reference.indexer_target(*args)
    tokens = []
    real = reference._scores
    monkeypatch.setattr(reference, "_scores", lambda q_c, *a: tokens.append(q_c.shape[0]) or real(q_c, *a))
    monkeypatch.setattr(reference, "_CHUNK_ELEMENTS", 2 * 7 * (D + 3))  # two tokens per chunk
    many = reference.indexer_target(*args)
    assert torch.equal(one, many)
    assert max(tokens) == 2 and sum(tokens) == 9


def test_opcheck():
    q, kv, idx = _inputs(6, 3, 12, 5, seed=6)
    pos = torch.tensor([3, -1, 11, 6, 0, 9], dtype=torch.int32)
    lengths = torch.tensor([5, 0, 3, 5, 1, 4], dtype=torch.int32)
    sink = torch.tensor([0.5, -math.inf, 2.0])
    lse = torch.randn(6, 3)
    op = torch.ops.mla_inductor.indexer_target
    torch.library.opcheck(op, (q, kv, idx, None, None, None, lse, SCALE))
    torch.library.opcheck(op, (q, kv, idx, lengths, pos, sink, lse, SCALE))


def test_errors_in_eager_and_at_trace_time():
    q, kv, idx = _inputs(6, 3, 12, 5, seed=7)
    bad = torch.zeros(6, 4)
    with pytest.raises(RuntimeError, match=r"indexer_target: lse must be \[T, H\] = \(6, 3\)"):
        indexer_target(q, kv, idx, bad)
    torch._dynamo.reset()
    compiled = torch.compile(indexer_target, backend="aot_eager", fullgraph=True)
    with pytest.raises(Exception, match=r"indexer_target: lse must be \[T, H\] = \(6, 3\)"):
        compiled(q, kv, idx, bad)
    with pytest.raises(RuntimeError, match="indexer_target: lse must be float32"):
        indexer_target(q, kv, idx, bad[:, :3].double())
    with pytest.raises(RuntimeError, match=r"indexer_target: batched lse must be \[B, T, H\]"):
        indexer_target(q[None], kv[None], idx[None], torch.zeros(6, 3))
    headless = r"^indexer_target: the indexer target sums over at least one head, got q .*\(6, 0, "
    with pytest.raises(RuntimeError, match=headless):
        indexer_target(q[:, :0], kv, idx, bad[:, :0])
    with pytest.raises(Exception, match=headless[1:]):
        compiled(q[:, :0], kv, idx, bad[:, :0])
    with pytest.raises(RuntimeError, match="^indexer_kl_loss: indexer_logits, target and indices "
                                           "must have one shape"):
        indexer_kl_loss(torch.zeros(6, 4), torch.zeros(6, 5), idx, kv_len=12)


def test_one_fullgraph_graph_for_attention_target_and_loss():
    """A training step: attention, its lse into the target, the KL into indexer logits; one
    graph, no break, both gradients as in eager."""
    q, kv, idx = _inputs(8, 3, 12, 7, seed=8)
    logits = torch.randn(8, 7)

    def step(q, kv, logits):
        out, lse = sparse_mla(q, kv, idx, d_v=DV, sm_scale=SCALE, causal=True, return_lse=True)
        target = indexer_target(q, kv, idx, lse, sm_scale=SCALE, causal=True)
        return out.square().mean() + indexer_kl_loss(logits, target, idx, kv_len=12, causal=True)

    def grads(fn):
        leaves = [t.clone().requires_grad_() for t in (q, kv, logits)]
        loss = fn(*leaves)
        return (loss, *torch.autograd.grad(loss, leaves))

    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")
    got = grads(torch.compile(step, backend=counter, fullgraph=True))
    assert counter.frame_count == 1
    for a, b in zip(got, grads(step)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_inductor_without_implicit_fallbacks():
    """The op is an explicit fallback of inductor (mla_inductor.lowering), as the attention's."""
    q, kv, idx = _inputs(8, 3, 12, 7, seed=11)

    def f(q, kv):
        _, lse = sparse_mla(q, kv, idx, d_v=DV, sm_scale=SCALE, return_lse=True)
        return indexer_target(q * 1.0, kv, idx, lse, sm_scale=SCALE)

    torch._dynamo.reset()
    with torch._inductor.config.patch(implicit_fallbacks=False, fx_graph_cache=False):
        got = torch.compile(f, fullgraph=True)(q, kv)
    torch.testing.assert_close(got, f(q, kv), rtol=1e-6, atol=1e-7)


def _dims(H, d_qk=576, features=frozenset()):
    """The ``dims`` the op passes to ``backends.select`` (d_v 0: the target reads no values)."""
    return (16, H, 64, d_qk, 0, features)


def test_auto_on_sm100_warns_the_fallback(fake_gpu, monkeypatch):
    fake_gpu((10, 0))
    monkeypatch.setattr(sm100, "available", lambda: (True, ""))
    call = (CUDA, torch.bfloat16, "indexer_target", _dims(128))
    [message] = fallback_warnings(call, call)
    assert message == (
        "mla_inductor: sparse-MLA indexer_target falls back to the PyTorch reference backend, "
        "which is much slower (often 50-100x): the sm100 backend has no indexer_target kernel yet"
    )


@pytest.mark.parametrize("H,d_qk", [(1, 576), (64, 512), (128, 576)])
def test_auto_on_sm90_picks_the_kernel(fake_gpu, monkeypatch, H, d_qk):
    fake_gpu((9, 0))
    monkeypatch.setattr(sm90, "available", lambda: (True, ""))
    dims = _dims(H, d_qk, frozenset({"causal", "sink"}))
    assert backends.select(CUDA, torch.bfloat16, "indexer_target", dims) is sm90


@pytest.mark.parametrize("H,d_qk,reason", [
    (129, 576, "sm90 indexer target supports at most 128 heads, got 129"),
    (64, 128, "sm90 indexer target supports d_qk in (576, 512), got 128"),
])
def test_auto_on_sm90_warns_for_what_the_kernel_does_not_take(fake_gpu, monkeypatch, H, d_qk,
                                                              reason):
    fake_gpu((9, 0))
    monkeypatch.setattr(sm90, "available", lambda: (True, ""))
    [message] = fallback_warnings((CUDA, torch.bfloat16, "indexer_target", _dims(H, d_qk)))
    assert message.endswith(f"(often 50-100x): {reason}")


def test_forced_gpu_backends(fake_gpu, monkeypatch):
    """Forced sm90 runs its kernel and raises what it does not take; forced sm100 (no kernel)
    falls back with the warning."""
    monkeypatch.setattr(sm90, "available", lambda: (True, ""))
    monkeypatch.setattr(sm100, "available", lambda: (True, ""))
    with use_backend("sm90"):
        assert backends.select(CUDA, torch.bfloat16, "indexer_target", _dims(128)) is sm90
        with pytest.raises(RuntimeError, match="sm90 indexer target supports at most 128 heads"):
            backends.select(CUDA, torch.bfloat16, "indexer_target", _dims(256))
    with use_backend("sm100"):
        [message] = fallback_warnings((CUDA, torch.bfloat16, "indexer_target", _dims(128)))
    assert message.endswith("the sm100 backend has no indexer_target kernel yet")


def kl_fp64(logits, target, valid):
    """Mean over rows with a valid slot of ``sum target * (log target - log_softmax)``, the
    softmax over the valid slots; one row at a time."""
    total, rows = 0.0, 0
    for lg, tg, v in zip(logits.reshape(-1, logits.shape[-1]), target.reshape(-1, target.shape[-1]),
                         valid.reshape(-1, valid.shape[-1])):
        if not v.any():
            continue
        lp = torch.log_softmax(lg[v].double(), -1)
        tv = tg[v].double()
        pos = tv > 0
        total = total + (tv[pos] * (tv[pos].log() - lp[pos])).sum()
        rows += 1
    return total / max(rows, 1)


@pytest.mark.parametrize("batched", [False, True])
def test_kl_loss_value_and_gradient_match_fp64(batched):
    B, T, H, S, topk = 2, 8, 3, 12, 7
    parts = [_inputs(T, H, S, topk, seed=20 + b) for b in range(B)]
    q, kv, idx = (torch.stack(ts) for ts in zip(*parts))
    lengths = torch.randint(0, topk + 1, (B, T), generator=torch.Generator().manual_seed(0))
    pos = torch.randint(-1, S, (T,), generator=torch.Generator().manual_seed(1))
    if not batched:
        q, kv, idx, lengths = q[0], kv[0], idx[0], lengths[0]
    kw = dict(topk_length=lengths, causal=True, q_positions=pos)
    target = _run("reference", q, kv, idx, **kw)
    valid = _valid64(idx, S, lengths, pos)
    target[..., 3] = torch.where(valid[..., 3], 0.0, target[..., 3])  # a valid slot of target 0
    logits = torch.randn(target.shape, generator=torch.Generator().manual_seed(2))
    logits = torch.where(valid, logits, math.nan)  # empty slots' logits are never read
    leaf = logits.clone().requires_grad_()
    loss = indexer_kl_loss(leaf, target, idx, kv_len=S, **kw)
    (grad,) = torch.autograd.grad(loss, leaf)
    leaf64 = logits.double().requires_grad_()
    loss64 = kl_fp64(leaf64, target, valid)
    (grad64,) = torch.autograd.grad(loss64, leaf64)
    assert loss.dtype == torch.float32 and loss.dim() == 0
    torch.testing.assert_close(loss.double(), loss64.detach(), rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(grad.double(), torch.nan_to_num(grad64, nan=0.0), rtol=1e-5, atol=1e-8)
    assert torch.all(grad[~valid] == 0)


def test_kl_loss_without_any_valid_slot_is_zero_with_zero_gradient():
    idx = torch.full((4, 3), -1, dtype=torch.int32)
    leaf = torch.randn(4, 3, requires_grad=True)
    loss = indexer_kl_loss(leaf, torch.zeros(4, 3), idx, kv_len=5)
    loss.backward()
    assert loss.item() == 0 and torch.all(leaf.grad == 0)


def test_kl_loss_is_zero_when_the_indexer_matches_the_target():
    q, kv, idx = _inputs(8, 3, 12, 7, seed=9)
    target = _run("reference", q, kv, idx)
    logits = torch.log(target).nan_to_num(neginf=0.0) + 5.0  # softmax over valid slots = target
    assert abs(indexer_kl_loss(logits, target, idx, kv_len=12).item()) < 1e-6


def test_batched_positions_compile_as_one_node():
    """The layout code (batched, given positions, head dimensions of 1) runs in the entry op's
    decomposition: no graph break, the eager values."""
    B, T, H, S, topk = 2, 8, 3, 12, 7
    parts = [_inputs(T, H, S, topk, seed=30 + b) for b in range(B)]
    q, kv, idx = (torch.stack(ts) for ts in zip(*parts))
    kv, idx = kv.unsqueeze(2), idx.long().unsqueeze(2)
    pos = torch.tensor([[3, -1, 11, 6, 0, 9, 2, 12], [0, 1, 2, 3, 4, 5, 6, 7]])

    def g(q, kv, idx, pos, lse):
        return indexer_target(q, kv, idx, lse, sm_scale=SCALE, causal=True, q_positions=pos)

    _, lse = sparse_mla(q, kv, idx, d_v=DV, sm_scale=SCALE, causal=True, q_positions=pos,
                        return_lse=True)
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")
    got = torch.compile(g, backend=counter, fullgraph=True)(q, kv, idx, pos, lse)
    assert counter.frame_count == 1
    assert torch.equal(got, g(q, kv, idx, pos, lse))
    for b in range(B):
        want = target_fp64(q[b], kv[b, :, 0], idx[b, :, 0], positions=pos[b])
        torch.testing.assert_close(got[b].double(), want, rtol=1e-5, atol=1e-6)
