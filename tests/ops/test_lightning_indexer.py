"""mla_inductor.lightning_indexer against a float64 computation of its definition, written here:
``score[t, s] = sum_h weights[t, h] * relu(q[t, h] . k[s])``, the ``min(topk, seen)`` seen keys
of largest score in ascending key index, then -1.

Float32 scores can order two keys whose float64 scores are within rounding of each other either
way, so a selection is checked by what stays true (:func:`problems`): a selected key's float64
score is at least the float64 ``n``-th largest (``n = min(topk, keys seen)``) minus
:func:`tolerance`, and no seen key left out scores more than it plus the tolerance. Inputs of
small integers make every score exact in float32 and float64 alike: there the selection must be
exactly the float64 one with ties to the smaller key index (:func:`exact_selection`). Also:
NaN and -0.0, rows that see fewer than topk keys, topk > S, T, S, topk = 0, layouts, the
chunking and its memory bound, no host synchronisation, opcheck, fullgraph compile with dynamic
T and S, backend selection, and each bad input's error in eager and at trace time.

Tests that run a backend are parametrised over :func:`conftest.backend_params` (the GPU ones
on bfloat16, D 128: the widths the sm90 kernel takes).
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from conftest import backend_device, backend_params, fallback_warnings
from hypothesis import given
from hypothesis import strategies as st
from torch._dynamo.testing import CompileCounterWithBackend
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

from test_properties import PROFILE  # noqa: F401  (registers and loads the hypothesis profiles)
from mla_inductor import (backends, lightning_indexer, lightning_indexer_seen, quantize_fp8,
                          use_backend)
from mla_inductor.kernels import reference, reference_lightning, sm90

op = torch.ops.mla_inductor.lightning_indexer
CUDA = torch.device("cuda", 0)
BACKENDS = backend_params(("reference", "emulate", "sm90"))
EPS32 = 2.0**-24


def _dtype(backend: str) -> torch.dtype:
    return torch.float32 if backend_device(backend) == "cpu" else torch.bfloat16


def _d(backend: str, cpu_d: int = 24) -> int:
    return cpu_d if backend_device(backend) == "cpu" else 128


def inputs(B, T, S, H, D, *, seed=0, dtype=torch.float32, device="cpu", integers=False):
    """``q [B, T, H, D]``, ``k [B, S, D]`` in ``dtype``, ``weights [B, T, H]`` float32; with
    ``integers``, small integers (every score exact in float32) with many exact ties."""
    g = torch.Generator().manual_seed(seed)
    if integers:
        q = torch.randint(-2, 3, (B, T, H, D), generator=g).float()
        k = torch.randint(-1, 2, (B, S, D), generator=g).float()
        w = torch.randint(-2, 3, (B, T, H), generator=g).float()
    else:
        q = torch.randn(B, T, H, D, generator=g)
        k = torch.randn(B, S, D, generator=g)
        w = torch.randn(B, T, H, generator=g)
    return q.to(device, dtype), k.to(device, dtype), w.to(device)


def seen_mask(B, T, S, positions) -> torch.Tensor:
    """``[B, T, S]`` bool: key ``s`` seen by token ``t`` (``positions [B, T]`` or None)."""
    if positions is None:
        return torch.ones(B, T, S, dtype=torch.bool)
    return torch.arange(S) <= positions.long().cpu()[..., None]


def scores_fp64(q, k, w, q_scale=None, k_scale=None):
    """``(score [B, T, S], bound [B, T])`` in float64: the definition, and the largest
    ``sum_h |w[t, h]| sum_d |q[t, h, d] k[s, d]|`` over the keys (the row's magnitude); with the
    fp8 form's scales ``q_scale [B, T, H]`` and ``k_scale [B, S]`` (either None: 1), each dot
    ``q . k`` (and its magnitude) times ``q_scale[t, h] * k_scale[s]``."""
    q, k, w = q.double().cpu(), k.double().cpu(), w.double().cpu()
    B, T, H, _ = q.shape
    S = k.shape[1]
    scale = torch.ones(B, T, H, S, dtype=torch.float64)
    if q_scale is not None:
        scale = scale * q_scale.double().cpu()[..., None]
    if k_scale is not None:
        scale = scale * k_scale.double().cpu()[:, None, None, :]
    dots = torch.einsum("bthd,bsd->bths", q, k) * scale
    score = torch.einsum("bth,bths->bts", w, dots.relu())
    mags = torch.einsum("bthd,bsd->bths", q.abs(), k.abs()) * scale.abs()
    bound = torch.einsum("bth,bths->bts", w.abs(), mags).amax(-1) if S else w[..., 0] * 0
    return score, bound


def tolerance(bound, D: int, H: int, scaled: bool = False):
    """The float32 rounding of a score: ``(D + H)`` roundings of ``2**-24`` of its terms'
    magnitudes at most (``D`` products summed per head, ``H`` weighted heads; with ``scaled``,
    2 more: the dot times q_scale, then times k_scale); twice that between two scores."""
    return 2 * (D + H + 2 * scaled) * EPS32 * bound


def problems(indices, values, q, k, w, positions, topk, q_scale=None, k_scale=None) -> list[str]:
    """What is wrong with ``(indices, values)`` as the lightning indexer's output for the
    canonical inputs (module docstring; with the fp8 form's scales: :func:`scores_fp64`): an
    empty list if nothing."""
    B, T, H, D = q.shape
    S = k.shape[1]
    if indices.shape != (B, T, topk) or indices.dtype != torch.int32:
        return [f"indices {tuple(indices.shape)} {indices.dtype}"]
    if values.shape != (B, T, topk) or values.dtype != torch.float32:
        return [f"scores {tuple(values.shape)} {values.dtype}"]
    indices, values = indices.cpu().long(), values.cpu().double()
    seen = seen_mask(B, T, S, positions)
    n = seen.sum(-1).clamp(max=topk)  # [B, T]
    filled = torch.arange(topk) < n[..., None]
    found = []
    if not torch.equal(indices >= 0, filled):
        return ["not n selected keys then -1"]
    if not torch.all(indices[~filled] == -1) or not torch.all(values[~filled] == 0):
        found.append("empty slots are not -1 with score 0")
    idx = indices.clamp(min=0)
    if topk > 1 and not torch.all((idx[..., 1:] > idx[..., :-1]) | ~filled[..., 1:]):
        found.append("selected keys not in ascending key index")
    if S == 0 or topk == 0:
        return found
    if not torch.all(idx[filled] < S) or not torch.all(seen.gather(-1, idx)[filled]):
        return found + ["a selected key outside [0, S) or not seen"]
    score, bound = scores_fp64(q, k, w, q_scale, k_scale)
    scaled = q_scale is not None or k_scale is not None
    tol = tolerance(bound, D, H, scaled)[..., None]
    ranked = score.masked_fill(~seen, -math.inf).sort(-1, descending=True).values
    kth = ranked.gather(-1, (n - 1).clamp(min=0)[..., None])  # [B, T, 1]
    picked = score.gather(-1, idx)
    if not torch.all((picked >= kth - tol) | ~filled):
        found.append("a selected key scores below the n-th largest beyond the tolerance")
    chosen = torch.zeros(B, T, S + 1, dtype=torch.bool)  # column S: the -1 slots
    chosen = chosen.scatter_(-1, torch.where(filled, idx, S), True)[..., :S]
    left = score.masked_fill(chosen | ~seen, -math.inf).amax(-1, keepdim=True)
    if not torch.all((left <= kth + tol) | (n[..., None] == 0)):
        found.append("a key left out scores above the n-th largest beyond the tolerance")
    if not torch.all(((values - picked).abs() <= tol) | ~filled):
        found.append("a slot's score is not its key's score")
    return found


def exact_selection(q, k, w, positions, topk):
    """The selection from float64 scores with ties to the smaller key index (a stable sort),
    for inputs whose scores are exact: ``[B, T, topk]`` int64, ascending, then -1."""
    B, T, _, _ = q.shape
    S = k.shape[1]
    score, _ = scores_fp64(q, k, w)
    seen = seen_mask(B, T, S, positions)
    order = score.masked_fill(~seen, -math.inf).sort(dim=-1, descending=True, stable=True).indices
    n = seen.sum(-1).clamp(max=topk)
    out = torch.full((B, T, topk), -1, dtype=torch.int64)
    for b in range(B):
        for t in range(T):
            keep = order[b, t, : int(n[b, t])].sort().values
            out[b, t, : len(keep)] = keep
    return out


def _positions(B, T, S, mode, seed=0):
    """``(causal, q_positions for the call, canonical [B, T] positions or None)``."""
    if mode == "none":
        return False, None, None
    if mode == "default":
        return True, None, (torch.arange(T) + S - T).expand(B, T)
    g = torch.Generator().manual_seed(seed)
    pos = torch.randint(-2, S + 3, (B, T), generator=g)
    return True, pos, pos.clamp(-1, S)


def _run(backend, q, k, w, topk, **kw):
    with use_backend(backend):
        return lightning_indexer(q, k, w, topk, return_scores=True, **kw)


@pytest.mark.parametrize("mode", ["none", "default", "positions"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_matches_the_float64_definition(backend, mode):
    """A batch of 3, T 37, S 53 (with the default causal rule the first 16 rows see fewer than
    topk 32 keys; with positions, some rows see none or every key)."""
    B, T, S, H, D, topk = 3, 37, 53, 4, _d(backend), 32
    dev = backend_device(backend)
    q, k, w = inputs(B, T, S, H, D, seed=1, dtype=_dtype(backend), device=dev)
    causal, pos, canonical = _positions(B, T, S, mode, seed=2)
    idx, val = _run(backend, q, k, w, topk, causal=causal,
                    q_positions=None if pos is None else pos.to(dev))
    assert problems(idx, val, q, k, w, canonical, topk) == []
    if mode == "default":
        assert (idx[:, 0] >= 0).sum().item() == B * min(topk, S - T + 1)


@pytest.mark.parametrize("mode", ["none", "default", "positions"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_exact_scores_select_exactly_with_ties_to_the_smaller_index(backend, mode):
    """Small-integer inputs: every score exact (many keys tie, many score exactly 0); the
    selection is exactly the float64 stable one, and so are the scores."""
    B, T, S, H, D, topk = 2, 29, 41, 3, _d(backend, 8), 12
    dev = backend_device(backend)
    q, k, w = inputs(B, T, S, H, D, seed=3, dtype=_dtype(backend), device=dev, integers=True)
    causal, pos, canonical = _positions(B, T, S, mode, seed=4)
    idx, val = _run(backend, q, k, w, topk, causal=causal,
                    q_positions=None if pos is None else pos.to(dev))
    want = exact_selection(q, k, w, canonical, topk)
    assert torch.equal(idx.cpu().long(), want)
    score, _ = scores_fp64(q, k, w)
    expected = torch.where(want >= 0, score.gather(-1, want.clamp(min=0)), 0.0)
    assert torch.equal(val.cpu().double(), expected)


@pytest.mark.parametrize("backend", BACKENDS)
def test_identical_keys_keep_the_smallest_indices(backend):
    """Keys 3, 5, 8 and 11 are the same row, scoring above every other key: top-2 is (3, 5),
    top-3 (3, 5, 8); every key equal: top-4 is (0, 1, 2, 3)."""
    dev = backend_device(backend)
    q, k, w = inputs(1, 6, 16, 2, _d(backend), seed=5, dtype=_dtype(backend), device=dev)
    q = q[:, :1, :1].expand_as(q).contiguous()  # one query vector v for every token and head
    w = w.abs()
    k = k * 0.1
    k[0, [3, 5, 8, 11]] = q[0, 0, 0] * 4  # score 4 |v|^2 sum_h w: far above the others
    same = k[:, :1].expand(1, 16, -1).contiguous()
    with use_backend(backend):
        assert lightning_indexer(q, k, w, 2).tolist() == [[[3, 5]] * 6]
        assert lightning_indexer(q, k, w, 3).tolist() == [[[3, 5, 8]] * 6]
        assert all({3, 5, 8, 11} < set(row) for row in lightning_indexer(q, k, w, 5)[0].tolist())
        assert lightning_indexer(q, same, w, 4).tolist() == [[[0, 1, 2, 3]] * 6]


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_nan_score_ranks_above_every_number(backend):
    """Key 6 of batch element 0 is NaN (its score is NaN for every token): selected by every
    token that sees it, with a NaN score. A NaN query token scores NaN everywhere: its first
    topk seen keys."""
    dev = backend_device(backend)
    q, k, w = inputs(2, 10, 12, 2, _d(backend), seed=6, dtype=_dtype(backend), device=dev)
    k[0, 6] = math.nan
    q[1, 4, 1, 0] = math.nan
    idx, val = _run(backend, q, k, w, 3, causal=True)  # token t sees keys <= t + 2
    idx, val = idx.cpu(), val.cpu()
    for t in range(10):
        assert (6 in idx[0, t].tolist()) == (t + 2 >= 6)
        if t + 2 >= 6:
            assert math.isnan(val[0, t][idx[0, t] == 6].item())
    assert idx[1, 4].tolist() == [0, 1, 2] and val[1, 4].isnan().all()
    # the other rows as without NaN: batch element 0 before key 6, element 1 but token 4
    assert problems(idx[:1, :4], val[:1, :4], q[:1, :4], k[:1, :6], w[:1, :4],
                    (torch.arange(4) + 2)[None], 3) == []
    rows = [0, 1, 2, 3, 5, 6, 7, 8, 9]
    assert problems(idx[1:, rows], val[1:, rows], q[1:, rows], k[1:], w[1:, rows],
                    (torch.tensor(rows) + 2)[None], 3) == []


def test_select_orders_nan_above_inf_and_ties_minus_zero():
    """The reference's selection on given scores: NaN > +inf > 1 > +0.0 == -0.0 > -inf, ties to
    the smaller index; an unseen key is never taken, even when fewer than topk are seen."""
    nan, inf = math.nan, math.inf
    scores = torch.tensor([[1.0, -0.0, nan, inf, 0.0, -inf, nan],
                           [-0.0, 0.0, -0.0, 0.0, -1.0, -inf, 5.0]])
    idx, val = reference_lightning.select(scores, None, 4)
    assert idx.tolist() == [[0, 2, 3, 6], [0, 1, 2, 6]]
    assert val[0].isnan().tolist() == [False, True, False, True] and val[1, 3] == 5
    seen = torch.tensor([[True, False, False, True, False, True, False]] * 2)
    idx, val = reference_lightning.select(scores, seen, 4)
    assert idx.tolist() == [[0, 3, 5, -1], [0, 3, 5, -1]]
    assert val[:, 3].tolist() == [0.0, 0.0]


@pytest.mark.parametrize("backend", BACKENDS)
def test_empty_problems(backend):
    """T = 0, S = 0 (all -1, scores 0), topk = 0, topk > S (the rest -1), B = 0."""
    dev, dt = backend_device(backend), _dtype(backend)
    D = _d(backend)
    for B, T, S, topk in ((2, 0, 9, 4), (2, 5, 0, 4), (2, 5, 9, 0), (1, 4, 3, 7), (0, 3, 5, 2)):
        q, k, w = inputs(B, T, S, 2, D, seed=7, dtype=dt, device=dev)
        idx, val = _run(backend, q, k, w, topk)
        assert idx.shape == val.shape == (B, T, topk)
        assert problems(idx, val, q, k, w, None, topk) == []
    q, k, w = inputs(1, 4, 3, 2, D, seed=8, dtype=dt, device=dev)
    assert _run(backend, q, k, w, 7)[0].tolist() == [[[0, 1, 2, -1, -1, -1, -1]] * 4]
    flat = _run(backend, q[0, :0], k[0], w[0, :0], 3)
    assert flat[0].shape == (0, 3) and flat[0].dtype == torch.int32


@pytest.mark.parametrize("backend", BACKENDS)
def test_layouts_agree(backend):
    """Flat ``[T, H, D]`` with ``k [S, D]`` or ``[S, 1, D]`` equals batch element by batch
    element of the batched call (``k [B, S, D]`` or ``[B, S, 1, D]``); ``q_positions [T]`` in a
    batched call is every element's; int64 positions beyond int32 see every key."""
    dev = backend_device(backend)
    B, T, S, topk = 3, 11, 17, 5
    q, k, w = inputs(B, T, S, 2, _d(backend), seed=9, dtype=_dtype(backend), device=dev)
    pos = torch.tensor([0, 3, -1, 16, 9, 2**40, 5, -2**40, 8, 1, 12], device=dev)
    with use_backend(backend):
        batched = lightning_indexer(q, k, w, topk, causal=True, q_positions=pos,
                                    return_scores=True)
        heads = lightning_indexer(q, k[:, :, None], w, topk, causal=True,
                                  q_positions=pos.expand(B, T), return_scores=True)
        for b in range(B):
            flat = lightning_indexer(q[b], k[b], w[b], topk, causal=True, q_positions=pos,
                                     return_scores=True)
            flat1 = lightning_indexer(q[b], k[b, :, None], w[b], topk, causal=True,
                                      q_positions=pos.clamp(-5, 99).int(),
                                      return_scores=True)
            for got in (flat, flat1, (heads[0][b], heads[1][b])):
                assert torch.equal(got[0], batched[0][b]) and torch.equal(got[1], batched[1][b])
    assert problems(*batched, q, k, w, pos.clamp(-1, S).expand(B, T).cpu(), topk) == []
    assert (batched[0][:, 7] == -1).all() and (batched[0][:, 5] >= 0).all()


def test_chunking_is_invisible_and_bounded(monkeypatch):
    """Chunks of 3 rows (one batch element at a time) and of 2 whole batch elements give the
    one-chunk result bitwise; no tensor the op makes is larger than its budget (or its outputs)."""
    B, T, S, H, D, topk = 4, 10, 40, 4, 16, 6
    q, k, w = inputs(B, T, S, H, D, seed=10)
    pos = torch.randint(-1, S, (B, T), generator=torch.Generator().manual_seed(11)).int()
    one = op(q, k, w, pos, topk)
    per_row = S * (4 * H + 48)
    for rows in (3, 2 * T):
        monkeypatch.setattr(reference_lightning, "SCORE_BYTES", rows * per_row)
        assert reference_lightning.chunk_rows(H, S, rows * per_row) == rows
        with _Largest() as seen:  # the op is one call for a dispatch mode: its body directly
            got = reference_lightning.lightning_indexer(q, k, w, pos, topk)
        assert torch.equal(got[0], one[0]) and torch.equal(got[1], one[1])
        assert seen.gemm_rows == (([3 * H] * 3 + [H]) * B if rows == 3 else [T * H] * B)
        assert 0 < seen.largest <= rows * per_row


class _Largest(TorchDispatchMode):
    """The size in bytes of the largest tensor an op returns (the op's outputs and inputs
    excluded), the row counts of the score GEMMs (``bmm`` of ``[n, rows, D]`` queries), and
    whether anything read a tensor's value on the host (``aten._local_scalar_dense``: ``.item()``,
    ``.tolist()``, ``bool(t)``) or made a tensor of data-dependent size (``nonzero``)."""

    def __init__(self):
        super().__init__()
        self.largest, self.gemm_rows, self.synced = 0, [], []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in (torch.ops.aten._local_scalar_dense.default, torch.ops.aten.nonzero.default):
            self.synced.append(func)
        if func is torch.ops.aten.bmm.default and args[0].shape[1] != 1:  # not the head sum
            self.gemm_rows += [args[0].shape[1]] * args[0].shape[0]
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and func is not torch.ops.aten.full.default:
                self.largest = max(self.largest, t.numel() * t.element_size())
        return out


@pytest.mark.parametrize("causal", [False, True])
def test_no_host_synchronisation(causal):
    """Nothing in the op (the entry's layout code, the reference's body) reads a tensor's
    value on the host: the checks read shapes, dtypes and devices only."""
    q, k, w = inputs(2, 9, 14, 3, 8, seed=12)
    pos = torch.arange(9, dtype=torch.int32).expand(2, 9)
    with _Largest() as seen:
        lightning_indexer(q, k, w, 5, causal=causal)
        lightning_indexer(q[0], k[0], w[0], 5, causal=causal,
                          q_positions=torch.arange(9) if causal else None)
        reference_lightning.lightning_indexer(q, k, w, pos if causal else None, 5)
    assert seen.gemm_rows == [9 * 3] * 2 and seen.synced == []  # the body ran in the mode


def test_fake_outputs_match_real_metadata():
    q, k, w = inputs(2, 7, 11, 3, 8, seed=13, dtype=torch.bfloat16)
    pos = torch.arange(7, dtype=torch.int32).expand(2, 7).contiguous()
    real = op(q, k, w, pos, 5)
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        fake = op(*(mode.from_tensor(t) for t in (q, k, w, pos)), 5)
    for r, f in zip(real, fake):
        assert (r.shape, r.stride(), r.dtype) == (f.shape, f.stride(), f.dtype)


def test_opcheck():
    q, k, w = inputs(2, 6, 9, 3, 8, seed=14)
    pos = torch.tensor([[3, -1, 8, 5, 0, 9], [0, 1, 2, 3, 4, 5]], dtype=torch.int32)
    torch.library.opcheck(op, (q, k, w, None, 4))
    torch.library.opcheck(op, (q, k, w, pos, 12))
    torch.library.opcheck(op, (q.bfloat16(), k.bfloat16(), w, pos, 0))


def _graph_breaks() -> int:
    return sum(torch._dynamo.utils.counters["graph_break"].values())


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_fullgraph_with_dynamic_tokens_and_keys(backend):
    """One graph for every T and S (topk a SymInt from S), no graph break, the same indices and
    scores as eager; the projections around the op compile with it."""
    proj = torch.randn(16, 2 * 8, generator=torch.Generator().manual_seed(15))

    def f(x, keys, w, pos):
        q = (x @ proj).view(x.shape[0], x.shape[1], 2, 8)
        topk = keys.shape[1] // 3
        idx, val = lightning_indexer(q, keys * 2, w, topk, causal=True, q_positions=pos,
                                     return_scores=True)
        return idx, val * 1.5, lightning_indexer(q, keys, w, 4)

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    counter = CompileCounterWithBackend(backend)
    fn = torch.compile(f, backend=counter, fullgraph=True)
    g = torch.Generator().manual_seed(16)
    for i, (T, S) in enumerate(((12, 30), (20, 45), (7, 19), (33, 33))):
        x, keys = torch.randn(2, T, 16, generator=g), torch.randn(2, S, 8, generator=g)
        w, pos = torch.randn(2, T, 2, generator=g), torch.randint(-1, S, (2, T), generator=g)
        for t, dim in ((x, 1), (keys, 1), (w, 1), (pos, 1)):
            torch._dynamo.mark_dynamic(t, dim)
        with torch.compiler.set_stance("fail_on_recompile" if i else "default"):
            got = fn(x, keys, w, pos)
        want = f(x, keys, w, pos)
        assert all(torch.equal(a, b) for a, b in zip(got, want))
        assert got[0].shape == (2, T, S // 3)
    assert counter.frame_count == 1 and _graph_breaks() == 0


def test_inductor_without_implicit_fallbacks():
    """The op is an explicit fallback of inductor (mla_inductor.lowering)."""
    q, k, w = inputs(1, 8, 12, 2, 8, seed=17)

    def f(q, k, w):
        return lightning_indexer(q * 1.0, k, w, 5, causal=True)

    torch._dynamo.reset()
    with torch._inductor.config.patch(implicit_fallbacks=False, fx_graph_cache=False):
        got = torch.compile(f, fullgraph=True)(q, k, w)
    assert torch.equal(got, f(q, k, w))


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_selected_scores_are_differentiable_and_the_indices_are_not(backend):
    """``return_scores``' scores carry the gradient of the definition at the selected slots:
    against float64 autograd of ``sum_h w relu(q . k)`` at the same indices, in q, k and weights,
    causal with rows that see fewer keys than topk (their -1 slots get and give nothing); the
    indices are those of the call without grad. On sm90 (bf16, D 128, 64 heads) the backward is
    the sm90 scores kernel; bf16 gradients within 1e-2 of the float64 ones (rel-L2)."""
    dev, dtype = backend_device(backend), _dtype(backend)
    H, D, T, S, topk = (3, 8, 6, 9, 4) if dev == "cpu" else (64, 128, 70, 300, 128)
    q, k, w = inputs(2, T, S, H, D, seed=18, dtype=dtype, device=dev)
    positions = torch.stack([torch.arange(T) * (S // T) - 1, torch.arange(T) + S - T]).to(dev)
    leaves = [t.clone().requires_grad_() for t in (q, k, w)]
    with use_backend(backend):
        idx, val = lightning_indexer(*leaves, topk, causal=True, q_positions=positions,
                                     return_scores=True)
        assert not idx.requires_grad and val.requires_grad
        assert torch.equal(idx, lightning_indexer(q, k, w, topk, causal=True,
                                                  q_positions=positions))
        assert (idx[0, 0] == -1).all() and (idx[0, 1] == -1).sum() == topk - S // T
        g = torch.Generator().manual_seed(3)
        dval = torch.randn(val.shape, generator=g).to(dev)
        got = torch.autograd.grad(val, leaves, dval)

    ref = [t.detach().double().cpu().requires_grad_() for t in (q, k, w)]
    idx = idx.cpu()
    valid = idx >= 0
    keys = torch.stack([ref[1][b][idx[b].clamp(min=0).long()] for b in range(2)])  # [B, T, k, D]
    logits = torch.einsum("bthd,btjd->bthj", ref[0], keys).relu()
    want_val = torch.where(valid, torch.einsum("bth,bthj->btj", ref[2], logits), 0.0)
    want = torch.autograd.grad(want_val, ref, dval.double().cpu())
    def rel(a, b):
        return ((a.double().cpu() - b).norm() / b.norm()).item()

    assert rel(val, want_val) <= 1e-5  # float32 accumulation
    tol = 1e-5 if dev == "cpu" else 1e-2  # sm90: dS, dq and dk rounded to bf16
    for name, a, b in zip(("dq", "dk", "dweights"), got, want):
        assert rel(a, b) <= tol, name
    assert got[0][0, 0].abs().sum() == 0 and got[2][0, 0].abs().sum() == 0  # a row sees no key


def test_the_selected_scores_backward_compiles_fullgraph():
    """The scores' gradient through ``torch.compile(fullgraph=True)`` (inductor) is the eager
    one, with one graph."""
    q, k, w = inputs(1, 7, 10, 2, 8, seed=21)

    def loss(q, k, w):
        _, val = lightning_indexer(q, k, w, 3, causal=True, return_scores=True)
        return val.square().sum()

    assert_compiled_gradients_match(loss, (q, k, w))


def assert_compiled_gradients_match(loss, inputs) -> None:
    """``loss(*inputs)``'s gradients in every input through ``torch.compile(fullgraph=True)``
    (inductor, one graph) equal the eager ones to float32's tolerance."""
    eager = [t.clone().requires_grad_() for t in inputs]
    want = torch.autograd.grad(loss(*eager), eager)
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("inductor")
    compiled = [t.clone().requires_grad_() for t in inputs]
    got = torch.autograd.grad(torch.compile(loss, backend=counter, fullgraph=True)(*compiled),
                              compiled)
    assert counter.frame_count == 1
    for a, b in zip(got, want):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-6)


# -- bad input --------------------------------------------------------------------------------

def _bad_cases():
    q, k, w = inputs(1, 6, 10, 3, 8, seed=19)
    q, k, w = q[0], k[0], w[0]  # flat: q [6, 3, 8], k [10, 8], w [6, 3]
    qb, kb, wb = q[None].expand(2, -1, -1, -1), k[None].expand(2, -1, -1), w[None].expand(2, -1, -1)
    pos = torch.arange(6)
    return {
        "q_rank": ((q[0], k, w), {}, r"q must be \[T, H, D\] or batched \[B, T, H, D\], got "
                                     r"shape \(3, 8\)"),
        "k_rank": ((q, k[None, None], w), {}, r"k must be \[S, D\] or \[S, 1, D\] with q "
                                              r"\[T, H, D\] .*got shape \(1, 1, 10, 8\)"),
        "k_heads": ((q, k[:, None].expand(10, 2, 8), w), {}, r"k must be \[S, D\] or \[S, 1, D\]"),
        "k_batched": ((qb, k, wb), {}, r"k must be \[B, S, D\] or \[B, S, 1, D\] with q "
                                       r"\[B, T, H, D\]"),
        "w_rank": ((q, k, wb), {}, r"weights must be \[T, H\] with q \[T, H, D\], got shape "
                                   r"\(2, 6, 3\)"),
        "w_shape": ((q, k, w[:, :2]), {}, r"weights must be \[T, H\] = \[6, 3\] per batch "
                                          r"element .*got shape \(6, 2\)"),
        "w_dtype": ((q, k, w.double()), {}, "weights must be float32 .*got torch.float64"),
        "q_dtype": ((q.double(), k.double(), w), {}, "q has unsupported dtype torch.float64"),
        "k_dtype": ((q, k.bfloat16(), w), {}, "k dtype torch.bfloat16 differs from q dtype "
                                              "torch.float32"),
        "d": ((q, k[:, :4], w), {}, r"mismatched D: q \[.., H, D\] has D=8, k \[.., S, D\] has 4"),
        "batch": ((qb, kb[:1], wb), {}, r"batch size differs: q \[B, T, H, D\] has B=2, k "
                                        r"\[B, S, D\] has 1, weights \[B, T, H\] has 2"),
        "device": ((q, k.to("meta"), w), {}, "tensors on different devices: q cpu, k meta"),
        "negative_topk": ((q, k, w, -1), {}, "topk must be >= 0, got -1"),
        "float_topk": ((q, k, w, 2.0), {}, "topk must be a Python int, got 2.0"),
        "bool_topk": ((q, k, w, True), {}, "topk must be a Python int, got True"),
        "tensor_topk": ((q, k, w, torch.tensor(3)), {}, "topk must be a Python int, got a 0-d "
                                                        "tensor"),
        "not_a_tensor": ((q, k.tolist(), w), {}, "k must be a torch.Tensor, got list"),
        "positions_type": ((q, k, w), dict(causal=True, q_positions=[1, 2]),
                           "q_positions must be a torch.Tensor or None, got list"),
        "positions_without_causal": ((q, k, w), dict(q_positions=pos),
                                     "q_positions is only read with causal=True"),
        "positions_dtype": ((q, k, w), dict(causal=True, q_positions=pos.float()),
                            "q_positions must be an integer tensor .*got torch.float32"),
        "positions_shape": ((q, k, w), dict(causal=True, q_positions=pos[:4]),
                            r"q_positions must be \[T\] = \[6\], got shape \(4,\)"),
        "positions_batched": ((qb, kb, wb), dict(causal=True, q_positions=pos[None].expand(3, 6)),
                              r"q_positions must be \[T\] = \[6\] or \[B, T\] = \[2, 6\], got "
                              r"shape \(3, 6\)"),
    }


BAD = _bad_cases()
TRACEABLE = [name for name in BAD if name not in ("float_topk", "bool_topk", "tensor_topk",
                                                  "not_a_tensor", "positions_type", "device")]


def _call(args, kwargs):
    topk = args[3] if len(args) > 3 else 4
    return lightning_indexer(*args[:3], topk, **kwargs)


@pytest.mark.parametrize("name", BAD)
def test_bad_input_raises_in_eager(name):
    args, kwargs, message = BAD[name]
    with pytest.raises(RuntimeError, match="^lightning_indexer: " + message):
        _call(args, kwargs)


@pytest.mark.parametrize("name", TRACEABLE)
def test_bad_input_raises_at_trace_time(name):
    """The same message from the entry op's checks or the fake kernel while Dynamo traces."""
    args, kwargs, message = BAD[name]
    torch._dynamo.reset()
    compiled = torch.compile(lambda *a: _call(a, kwargs), backend="aot_eager", fullgraph=True)
    with pytest.raises(Exception, match="lightning_indexer: " + message):
        compiled(*args)


def test_the_op_checks_its_canonical_inputs():
    """Called directly (the fake at trace time, the op at run time): int64 positions and
    flat layouts are the entry's to convert, the op refuses them."""
    q, k, w = inputs(1, 6, 10, 3, 8, seed=20)
    pos = torch.arange(6)[None]
    cases = (((q, k, w, pos, 3), "q_positions must be int32 .*got torch.int64"),
             ((q, k, w, pos[:, :4].int(), 3), r"q_positions must be \[B, T\] = \[1, 6\]"),
             ((q[0], k, w, None, 3), r"q must be \[B, T, H, D\]"),
             ((q, k[0], w, None, 3), r"k must be \[B, S, D\]"),
             ((q, k, w[0], None, 3), r"weights must be \[B, T, H\]"))
    assert_op_and_fake_raise(cases)


def assert_op_and_fake_raise(cases) -> None:
    """Each ``(op arguments, message)`` raises ``lightning_indexer: <message>`` from the op on
    real tensors and from its fake kernel on FakeTensors."""
    for args, message in cases:
        with pytest.raises(RuntimeError, match="^lightning_indexer: " + message):
            op(*args)
        with FakeTensorMode(allow_non_fake_inputs=True) as mode:
            fake = [mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args]
            with pytest.raises(RuntimeError, match="^lightning_indexer: " + message):
                op(*fake)


# -- a dense visibility ---------------------------------------------------------------------------

def test_a_dense_mask_selects_as_the_positions_it_stands_for():
    """``lightning_indexer_seen`` under the mask of causal positions (``[B, T, S]``, and ``[1, T,
    S]`` for every batch element) selects bitwise as the op with those positions, in fp8 too;
    under any mask, the float64 definition's selection of the keys it shows."""
    B, T, S, H, D, topk = 3, 9, 14, 2, 8, 5
    q, k, w = inputs(B, T, S, H, D, seed=21)
    pos = torch.randint(-2, S + 2, (B, T), generator=torch.Generator().manual_seed(22))
    want = lightning_indexer(q, k, w, topk, causal=True, q_positions=pos)
    assert torch.equal(lightning_indexer_seen(q, k, w, seen_mask(B, T, S, pos), topk), want)
    shared = lightning_indexer(q, k, w, topk, causal=True, q_positions=pos[0])
    assert torch.equal(lightning_indexer_seen(q, k, w, seen_mask(1, T, S, pos[:1]), topk),
                       shared)
    (q8, q_scale), (k8, k_scale) = quantize_fp8(q), quantize_fp8(k)
    scales = dict(q_scale=q_scale, k_scale=k_scale)
    assert torch.equal(
        lightning_indexer_seen(q8, k8, w, seen_mask(B, T, S, pos), topk, **scales),
        lightning_indexer(q8, k8, w, topk, causal=True, q_positions=pos, **scales))
    qi, ki, wi = inputs(B, T, S, H, D, seed=23, integers=True)
    seen = torch.rand(B, T, S, generator=torch.Generator().manual_seed(24)) < 0.5
    score, _ = scores_fp64(qi, ki, wi)
    order = score.masked_fill(~seen, -math.inf).sort(dim=-1, descending=True, stable=True).indices
    got = lightning_indexer_seen(qi, ki, wi, seen, topk)
    for b in range(B):
        for t in range(T):
            n = min(topk, int(seen[b, t].sum()))
            assert got[b, t, :n].tolist() == order[b, t, :n].sort().values.tolist()
            assert (got[b, t, n:] == -1).all()


def test_a_dense_mask_is_checked_with_its_own_name():
    q, k, w = inputs(2, 6, 10, 3, 8, seed=25)
    seen = torch.ones(2, 6, 10, dtype=torch.bool)
    cases = {
        "seen must be a torch.Tensor, got list": (q, k, w, seen.tolist(), 3),
        "seen must be bool .*got torch.float32": (q, k, w, seen.float(), 3),
        r"seen must be \[B or 1, T, S\] = \[2 or 1, 6, 10\], got shape \(2, 6, 9\)":
            (q, k, w, seen[..., :9], 3),
        r"seen must be \[B or 1, T, S\].*got shape \(6, 10\)": (q, k, w, seen[0], 3),
        "seen on meta, q on cpu": (q, k, w, seen.to("meta"), 3),
        "weights must be float32 .*got torch.float64": (q, k, w.double(), seen, 3),
        r"q must be \[B, T, H, D\]": (q[0], k, w, seen, 3),
        "topk must be >= 0, got -1": (q, k, w, seen, -1),
        "topk must be a Python int, got 2.0": (q, k, w, seen, 2.0),
    }
    for message, args in cases.items():
        with pytest.raises(RuntimeError, match="^lightning_indexer_seen: " + message):
            lightning_indexer_seen(*args)
    q8, k8 = q.to(torch.float8_e4m3fn), k.to(torch.float8_e4m3fn)
    with pytest.raises(RuntimeError, match="^lightning_indexer_seen: .* need k_scale"):
        lightning_indexer_seen(q8, k8, w, seen, 3)


# -- backend selection --------------------------------------------------------------------------

DIMS = (64, 16, 256, 128, 0, frozenset({"causal"}))


def test_forced_emulate_runs_the_reference_without_a_warning(monkeypatch):
    calls = []
    real = reference.lightning_indexer
    monkeypatch.setattr(reference, "lightning_indexer", lambda *a: calls.append(1) or real(*a))
    q, k, w = inputs(1, 5, 8, 2, 8, seed=21)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with use_backend("emulate"):
            got = lightning_indexer(q, k, w, 3)
    assert calls == [1] and torch.equal(got, lightning_indexer(q, k, w, 3))


@pytest.mark.parametrize("name", ["sm90", "sm100"])
def test_a_forced_gpu_backend_on_cpu_raises_with_the_op_name(name):
    q, k, w = inputs(1, 5, 8, 2, 8, seed=22, dtype=torch.bfloat16)
    with use_backend(name), pytest.raises(
            RuntimeError, match=f"^lightning_indexer: mla_inductor backend '{name}' cannot run "
                                "here: .+"):
        lightning_indexer(q, k, w, 3)


def test_auto_on_sm90_without_the_function_warns_and_runs_the_reference(fake_gpu, monkeypatch):
    fake_gpu((9, 0))
    monkeypatch.setattr(sm90, "available", lambda: (True, ""))
    monkeypatch.delattr(sm90, "lightning_indexer", raising=False)
    call = (CUDA, torch.bfloat16, "lightning_indexer", DIMS)
    assert fallback_warnings(call, call) == [
        "mla_inductor: sparse-MLA lightning_indexer falls back to the PyTorch reference backend, "
        "which is much slower (often 50-100x): the sm90 backend has no lightning_indexer kernel "
        "yet"
    ]


def test_auto_on_sm90_follows_its_supports(fake_gpu, monkeypatch):
    """With the function: sm90 where its supports() says yes, else the reference with its
    reason in the warning."""
    fake_gpu((9, 0))
    monkeypatch.setattr(sm90, "available", lambda: (True, ""))
    monkeypatch.setattr(sm90, "lightning_indexer", lambda *a: None, raising=False)
    asked = []

    def supports(dtype, direction, T, H, S, D, d_v, features):
        asked.append((direction, T, H, S, D, d_v, features))
        return (H <= 64, "" if H <= 64 else f"at most 64 heads, got {H}")

    monkeypatch.setattr(sm90, "supports", supports)
    assert backends.select(CUDA, torch.bfloat16, "lightning_indexer", DIMS) is sm90
    wide = (CUDA, torch.bfloat16, "lightning_indexer", (64, 65, 256, 128, 0, frozenset()))
    [message] = fallback_warnings(wide)
    assert message.endswith("(often 50-100x): at most 64 heads, got 65")
    assert asked[0] == ("lightning_indexer", *DIMS)


@pytest.mark.parametrize("capability", [(8, 0), (10, 0)])
def test_auto_on_other_gpus_warns_and_runs_the_reference(fake_gpu, monkeypatch, capability):
    from mla_inductor.kernels import sm100

    fake_gpu(capability)
    monkeypatch.setattr(sm100, "available", lambda: (True, ""))
    [message] = fallback_warnings((CUDA, torch.bfloat16, "lightning_indexer", DIMS))
    assert message.startswith("mla_inductor: sparse-MLA lightning_indexer falls back to the "
                              "PyTorch reference backend")
    assert message.endswith("no sparse-MLA kernel for compute capability 8.0" if capability[0] == 8
                            else "the sm100 backend has no lightning_indexer kernel yet")


def test_the_op_passes_its_dims_to_select(monkeypatch):
    seen = []
    real = backends.select
    monkeypatch.setattr(backends, "select", lambda *a: seen.append(a[2:]) or real(*a))
    q, k, w = inputs(2, 5, 9, 3, 8, seed=23)
    lightning_indexer(q, k, w, 4)
    lightning_indexer(q, k, w, 4, causal=True)
    assert seen == [("lightning_indexer", (5, 3, 9, 8, 0, frozenset())),
                    ("lightning_indexer", (5, 3, 9, 8, 0, frozenset({"causal"})))]


# -- property -------------------------------------------------------------------------------------

@pytest.mark.parametrize("backend", BACKENDS[:1] + BACKENDS[2:])
@given(data=st.data())
def test_property_matches_the_float64_definition(backend, data):
    """Drawn sizes (B or flat, T and S from 0, H, topk from 0 to past S), dtype, the causal
    rule (none, default, positions beyond both ends), small-integer inputs (exact, many ties:
    the float64 stable selection exactly) or normal ones (within the tolerance), repeated keys."""
    dev = backend_device(backend)
    flat = data.draw(st.booleans(), "flat")
    B = 1 if flat else data.draw(st.integers(1, 3), "B")
    T, S = data.draw(st.integers(0, 12), "T"), data.draw(st.integers(0, 24), "S")
    H = data.draw(st.integers(1, 4 if dev == "cpu" else 64), "H")
    D = data.draw(st.sampled_from((1, 4, 16)), "D") if dev == "cpu" else 128
    topk = data.draw(st.integers(0, S + 3), "topk")
    dtype = data.draw(st.sampled_from((torch.float32, torch.bfloat16)), "dtype") \
        if dev == "cpu" else torch.bfloat16
    integers = data.draw(st.booleans(), "integers")
    mode = data.draw(st.sampled_from(("none", "default", "positions")), "mode")
    seed = data.draw(st.integers(0, 2**16), "seed")
    q, k, w = inputs(B, T, S, H, D, seed=seed, dtype=dtype, device=dev, integers=integers)
    if S > 1 and data.draw(st.booleans(), "repeat"):
        k[:, 1::2] = k[:, :1]  # every odd key ties key 0
    causal, pos, canonical = _positions(B, T, S, mode, seed=seed)
    args = (q[0], k[0], w[0]) if flat else (q, k, w)
    if flat and pos is not None:
        pos = pos[0]
    idx, val = _run(backend, *args, topk, causal=causal,
                    q_positions=None if pos is None else pos.to(dev))
    if flat:
        idx, val = idx[None], val[None]
    assert problems(idx, val, q, k, w, canonical, topk) == []
    if integers:
        assert torch.equal(idx.cpu().long(), exact_selection(q, k, w, canonical, topk))
