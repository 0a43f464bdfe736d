"""Property-based tests (hypothesis): every backend this machine runs, on drawn problems, against
the independent float64 reference of ``conftest.py``: outputs, lse and gradients.

Each example draws the sizes (T, S, H, topk, d_qk / d_v; the GPU backends take only their
widths and dtypes), the dtype, packed or batched inputs, the index pattern (random or causal,
with -1, -2**31, S, S + 7, 2**31 - 1 and int64 indices beyond 2**32 as empty slots, duplicates,
a ``topk_length`` with garbage past it that names any row, the poisoned ones too), whether the
call is ``causal`` (future keys, those past position ``S - T + t``, become empty: poisoned when
nothing else names them, and the reference sees them as -1), the layout of
each input (contiguous, transposed or sliced views, ``[S, 1, d_qk]`` / ``[T, 1, topk]`` head
dimensions, every other row of a larger buffer, kv aliasing q's storage), NaN or inf in every kv
row that no valid slot names, which inputs require grad, sm_scale and rescale_threshold.

Tolerances are relative to the rounding floor of the dtype: every entry may be off by
``C * eps`` times the sum of the magnitudes of the terms that make it (:func:`_scales`: for
``out``, ``sum_j P_j |v_j|``; for dq and dkv the same for their products), where eps is the
dtype's machine epsilon plus the fp32 rounding of the scores and sums
(``eps32 * (16 + the largest magnitude of a score's terms)``), with the spacing of subnormal
results as the absolute floor. Rows without a valid slot must be exact zeros (lse -inf), and
kv rows that no valid slot names must get exact zero gradients.

Profiles (``HYPOTHESIS_PROFILE``): ``ci`` (the default: small problems, 50 examples per
backend, a few seconds on 2 CPU cores) and ``h200`` (DeepSeek's 576 / 512 widths with up to
128 heads on the GPU backends, larger T, S and topk, 100 examples per backend:
``HYPOTHESIS_PROFILE=h200 python -m pytest tests/ops/test_properties.py`` on the H200).
"""

from __future__ import annotations

import dataclasses
import math
import os

import pytest
import torch
from conftest import (
    CPU_BACKENDS,
    backend_device,
    backend_params,
    reference_sparse_mla_fp64,
)
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from torch._dynamo.testing import CompileCounterWithBackend

from mla_inductor import backends, indexer_kl_loss, sparse_mla, use_backend

_SLOW = [HealthCheck.too_slow, HealthCheck.data_too_large]
settings.register_profile("ci", max_examples=50, deadline=20_000, suppress_health_check=_SLOW)
# HYPOTHESIS_MAX_EXAMPLES overrides the profile's example count (e.g. a first timed run on a GPU).
settings.register_profile("h200", max_examples=int(os.environ.get("HYPOTHESIS_MAX_EXAMPLES", 100)),
                          deadline=120_000, suppress_health_check=_SLOW)
PROFILE = os.environ.get("HYPOTHESIS_PROFILE", "ci")
settings.load_profile(PROFILE)


@dataclasses.dataclass(frozen=True)
class Bounds:
    """The largest sizes drawn (B of a batched call, tokens, rows, heads, slots)."""

    B: int
    T: int
    S: int
    H: int
    topk: int


BOUNDS = {"ci": Bounds(B=3, T=8, S=48, H=4, topk=70),
          "h200": Bounds(B=3, T=32, S=512, H=128, topk=260)}[PROFILE]
CPU_DIMS = [(8, 8), (16, 5), (40, 32), (64, 64)]
GPU_DIMS = [(576, 512), (512, 512)]
# Allowed error, in units of eps times the magnitude of the terms of each entry. The kernels
# round P (and dS) to the dtype once, and the output once: at most 1 eps (half an ulp each).
C = 2.0
EPS32 = torch.finfo(torch.float32).eps


@dataclasses.dataclass(frozen=True)
class Problem:
    backend: str
    dtype: torch.dtype
    B: int  # 0: packed [T, ...] inputs; else a batched call
    T: int
    S: int
    H: int
    d_qk: int
    d_v: int
    topk: int
    sm_scale: float | None
    threshold: float | None
    indices: torch.Tensor  # [T, topk] or [B, T, topk], int32 or int64, CPU
    topk_length: torch.Tensor | None  # [T] or [B, T] int32, CPU
    q_layout: str
    kv_layout: str
    idx_layout: str
    poison: float | None  # put into every kv row no valid slot names
    grads: tuple  # which of "q", "kv" require grad
    seed: int
    causal: bool = False  # the op drops future keys; the reference sees them as -1 (_as_seen)


def _batch(p: Problem) -> tuple:
    return (p.B,) if p.B else ()


def _valid(indices, topk_length, S):
    valid = (indices >= 0) & (indices < S)
    if topk_length is not None:
        valid &= torch.arange(indices.shape[-1], device=indices.device) < topk_length[..., None]
    return valid


def _draw_indices(draw, gen, T, S, topk, B):
    """Indices ``[*B, T, topk]`` (int32, or int64 when drawn or needed) and a topk_length
    ``[*B, T]`` or None, with every kind of empty slot the problem draws. Valid slots avoid the
    first ``reserved`` rows, which then only garbage past topk_length names (so the poison
    reaches them)."""
    batch = (B,) if B else ()
    reserved = draw(st.integers(0, min(2, S - 1)))
    if draw(st.sampled_from(["random", "causal"])) == "random":
        idx = torch.randint(0, S, (*batch, T, topk), generator=gen)
    else:  # token t sits at position S - T + t, its own key in slot 0, -1 past its position
        pos = (S - T + torch.arange(T)).clamp(0, S - 1)
        idx = (torch.rand(*batch, T, topk, generator=gen) * (pos[:, None] + 1)).long()
        idx[..., 0] = pos
        idx = torch.where(torch.arange(topk) <= pos[:, None], idx, -1)
    if reserved:
        idx = torch.where(idx >= 0, reserved + idx % (S - reserved), idx)
    if draw(st.booleans()):  # duplicates: the first half repeats slot 0
        idx[..., : topk // 2 + 1] = idx[..., :1]
    sentinels = draw(st.sets(st.sampled_from(
        ["-1", "-2**31", "S", "S+7", "2**31-1", "2**32+row"]), max_size=6))
    empty = draw(st.sampled_from([0.0, 0.1, 0.5, 1.0])) if sentinels else 0.0
    values = {"-1": -1, "-2**31": -(2**31), "S": S, "S+7": S + 7, "2**31-1": 2**31 - 1,
              "2**32+row": 2**32 + reserved}  # would wrap to a valid row if cast first
    for name in sorted(sentinels):
        drop = torch.rand(idx.shape, generator=gen) < empty / len(sentinels)
        idx = torch.where(drop, values[name], idx)
    wide = "2**32+row" in sentinels or draw(st.booleans())
    topk_length = None
    if draw(st.booleans()):
        topk_length = torch.randint(0, topk + 1, (*batch, T), generator=gen, dtype=torch.int32)
        past = torch.arange(topk) >= topk_length[..., None]
        garbage = torch.randint(0, S, idx.shape, generator=gen)  # any row, reserved ones too
        idx = torch.where(past, garbage, idx)
    return idx.to(torch.int64 if wide else torch.int32), topk_length


@st.composite
def problems(draw, backend: str) -> Problem:
    cpu = backend in CPU_BACKENDS
    d_qk, d_v = draw(st.sampled_from(CPU_DIMS if cpu else GPU_DIMS))
    dtypes = [torch.bfloat16, torch.float16] + ([torch.float32] if cpu else [])
    dtype = draw(st.sampled_from(dtypes))
    B = draw(st.sampled_from([0, 0, 1, 2, BOUNDS.B]))
    T = draw(st.integers(0 if not B else 1, BOUNDS.T))
    S = draw(st.integers(1, BOUNDS.S))
    H = draw(st.sampled_from(sorted({1, 2, 3, BOUNDS.H // 2 + 1, BOUNDS.H})))
    topk = draw(st.integers(1, BOUNDS.topk))
    grads = draw(st.sampled_from([(), ("q",), ("kv",), ("q", "kv")]))
    if not cpu:
        module = backends.module(backend)
        for direction in ("forward", "backward") if grads else ("forward",):
            assume(module.supports(dtype, direction, max(T, 1) * max(B, 1), H, S, d_qk, d_v)[0])
    seed = draw(st.integers(0, 2**31 - 1))
    gen = torch.Generator().manual_seed(seed)
    indices, topk_length = _draw_indices(draw, gen, T, S, topk, B)
    kv_layouts = ["contiguous", "head1", "strided", "sliced"]
    q_layout = draw(st.sampled_from(["contiguous", "transposed", "sliced"]))
    poison = draw(st.sampled_from([None, math.nan, math.inf, -math.inf]))
    if not B and q_layout == "contiguous" and T * H >= S and poison is None:
        kv_layouts.append("alias")
    kv_layout = draw(st.sampled_from(kv_layouts))
    if kv_layout == "alias":
        grads = ("q", "kv") if grads else ()
    return Problem(
        backend=backend, dtype=dtype, B=B, T=T, S=S, H=H, d_qk=d_qk, d_v=d_v, topk=topk,
        sm_scale=draw(st.sampled_from([None, 0.05, 0.3])),
        threshold=draw(st.sampled_from([None, 0.0, 8.0])),
        indices=indices, topk_length=topk_length, q_layout=q_layout, kv_layout=kv_layout,
        idx_layout=draw(st.sampled_from(["contiguous", "head1", "transposed"])),
        poison=poison, grads=grads, seed=seed, causal=draw(st.booleans()),
    )


def _as_seen(p: Problem) -> Problem:
    """``p`` as the reference sees it: for a causal call every slot naming a key past the
    token's position ``S - T + t`` (within its batch element) set to -1, and causal off."""
    if not p.causal:
        return p
    positions = torch.arange(p.T) + (p.S - p.T)
    kept = torch.where(p.indices <= positions[:, None], p.indices, torch.full_like(p.indices, -1))
    return dataclasses.replace(p, indices=kept, causal=False)


def _leaves(p: Problem) -> dict:
    """The storage each input is a view of, in p.dtype on the CPU (the draws are float64)."""
    gen = torch.Generator().manual_seed(p.seed + 1)
    b = _batch(p)
    shapes = {
        "q": {"contiguous": (*b, p.T, p.H, p.d_qk), "transposed": (*b, p.H, p.T, p.d_qk),
              "sliced": (*b, p.T, p.H, p.d_qk + 3)}[p.q_layout],
        "kv": {"contiguous": (*b, p.S, p.d_qk), "head1": (*b, p.S, 1, p.d_qk),
               "strided": (*b, 2 * p.S, p.d_qk), "sliced": (*b, p.S, p.d_qk + 5),
               "alias": None}[p.kv_layout],
    }
    return {name: torch.randn(shape, generator=gen, dtype=torch.float64).to(p.dtype)
            for name, shape in shapes.items() if shape is not None}


def _views(p: Problem, leaves: dict) -> tuple:
    """q ``[*B, T, H, d_qk]`` and kv (``[*B, S, (1,) d_qk]``) as the op gets them: views of the
    leaves, in the drawn layouts."""
    # contiguous: a view too, so that kv aliasing the same storage is not a function of q
    q = {"contiguous": lambda t: t.view(t.shape), "transposed": lambda t: t.transpose(-3, -2),
         "sliced": lambda t: t[..., : p.d_qk]}[p.q_layout](leaves["q"])
    if p.kv_layout == "alias":
        return q, leaves["q"].view(-1, p.d_qk)[: p.S]
    kv = {"contiguous": lambda t: t, "head1": lambda t: t, "strided": lambda t: t[..., ::2, :],
          "sliced": lambda t: t[..., : p.d_qk]}[p.kv_layout](leaves["kv"])
    return q, kv


def _index_view(p: Problem, indices: torch.Tensor) -> torch.Tensor:
    if p.idx_layout == "head1":
        return indices.unsqueeze(-2)
    if p.idx_layout == "transposed":
        return indices.transpose(-1, -2).contiguous().transpose(-1, -2)
    return indices


def _named(p: Problem) -> torch.Tensor:
    """``[*B, S]``: whether a valid slot names each kv row."""
    valid = _valid(p.indices, p.topk_length, p.S)
    named = torch.zeros(*_batch(p), p.S, dtype=torch.bool)
    if p.B:
        for b in range(p.B):
            named[b, p.indices[b][valid[b]].long()] = True
    else:
        named[p.indices[valid].long()] = True
    return named


def _rows(p: Problem, kv: torch.Tensor) -> torch.Tensor:
    """kv as ``[*B, S, d_qk]`` (a view)."""
    return kv.squeeze(-2) if p.kv_layout == "head1" else kv


def _poison(p: Problem, leaves: dict) -> None:
    """NaN / inf into every kv row that no valid slot names (written through the kv view)."""
    if p.poison is not None:
        _rows(p, _views(p, leaves)[1])[~_named(p)] = p.poison


def _scales(q, kv, idx, topk_length, dout, sm_scale, d_v):
    """float64 magnitudes of the terms of each entry of out ``[T, H, d_v]``, dq ``[T, H, d_qk]``
    and dkv ``[S, d_qk]``; (0-d) the largest magnitude of the terms of a score, which the fp32
    rounding of the scores scales with; and the floors of out, dq and dkv: their terms'
    magnitudes with each factor P or dS replaced by 1. P and dS are rounded to q's dtype as MMA
    operands, and a value below that dtype's smallest normal (2**-14 for float16) is rounded to
    a fixed spacing (``tiny * eps``) rather than relatively, an absolute error that the floor
    multiplies."""
    S, d_qk = kv.shape
    valid = _valid(idx, topk_length, S)
    rows = torch.where(valid[..., None], kv[torch.where(valid, idx, 0).long()], 0.0)
    s = torch.einsum("thd,tkd->thk", q, rows) * sm_scale
    p = torch.softmax(s.masked_fill(~valid[:, None], -math.inf), -1).nan_to_num(0.0)
    s_terms = torch.einsum("thd,tkd->thk", q.abs(), rows.abs()) * sm_scale
    out = torch.einsum("thk,tkd->thd", p, rows[..., :d_v].abs())
    dp_terms = torch.einsum("thd,tkd->thk", dout.abs(), rows[..., :d_v].abs())  # of dP, dpsum
    a = p * (dp_terms + (p * dp_terms).sum(-1, keepdim=True)) * sm_scale  # of dS
    dq = torch.einsum("thk,tkd->thd", a, rows.abs())
    drows = torch.einsum("thk,thd->tkd", a, q.abs())
    drows[..., :d_v] += torch.einsum("thk,thd->tkd", p, dout.abs())
    dkv = torch.zeros(S, d_qk, dtype=torch.float64, device=kv.device)
    dkv.index_add_(0, idx[valid].long(), drows[valid])
    one = valid[:, None].expand_as(p).to(torch.float64)  # P or dS replaced by 1 where valid
    out_floor = torch.einsum("thk,tkd->thd", one, rows[..., :d_v].abs())
    dq_floor = torch.einsum("thk,tkd->thd", one, rows.abs()) * sm_scale
    drows_floor = torch.einsum("thk,thd->tkd", one, q.abs()) * sm_scale
    drows_floor[..., :d_v] += torch.einsum("thk,thd->tkd", one, dout.abs())
    dkv_floor = torch.zeros_like(dkv).index_add_(0, idx[valid].long(), drows_floor[valid])
    s_max = s_terms.amax() if s_terms.numel() else s_terms.new_zeros(())
    return out, dq, dkv, s_max, out_floor, dq_floor, dkv_floor


def _per_batch(p: Problem, fn, *tensors):
    """``fn`` on each batch element (or once for packed inputs), results stacked."""
    if not p.B:
        return fn(*tensors)
    parts = [fn(*(None if t is None else t[b] for t in tensors)) for b in range(p.B)]
    return tuple(torch.stack(x) for x in zip(*parts))


def _close(name, got, exact, scale, floor, eps):
    """Every entry within ``C * eps`` of its terms' magnitude, plus the subnormal spacing of the
    result and of its P / dS operands times their ``floor`` (:func:`_scales`); NaN nowhere."""
    assert torch.isfinite(got).all(), name
    err = (got.double() - exact).abs()
    info = torch.finfo(got.dtype)
    bound = C * eps * scale + info.tiny * info.eps * (1 + floor)
    bad = err > bound
    assert not bad.any(), (f"{name}: {int(bad.sum())} entries off, worst error "
                           f"{(err / bound).max().item():.2f}x the bound")


def _check(p: Problem):
    device = backend_device(p.backend)
    causal, op_indices = p.causal, p.indices  # what the op gets
    p = _as_seen(p)  # everything below (poison, reference, checks) sees the future slots empty
    leaves = _leaves(p)
    _poison(p, leaves)
    sm_scale = p.d_qk**-0.5 if p.sm_scale is None else p.sm_scale
    gen = torch.Generator().manual_seed(p.seed + 2)
    dout = torch.randn(*_batch(p), p.T, p.H, p.d_v, generator=gen).to(p.dtype)

    # the op, on the backend's device
    dev_leaves = {k: v.detach().to(device).requires_grad_(bool(p.grads))
                  for k, v in leaves.items()}
    q, kv = _views(p, dev_leaves)
    tl = None if p.topk_length is None else p.topk_length.to(device)
    with use_backend(p.backend):
        out, lse = sparse_mla(q, kv, _index_view(p, op_indices).to(device), sm_scale=p.sm_scale,
                              d_v=p.d_v, topk_length=tl, rescale_threshold=p.threshold,
                              causal=causal, return_lse=True)
        inputs = [t for name, t in (("q", q), ("kv", kv)) if name in p.grads]
        grads = torch.autograd.grad(out, inputs, dout.to(device)) if inputs else ()
    out, lse = out.detach().cpu(), lse.cpu()
    got = {name: g.cpu() for name, g in zip(p.grads, grads)}

    # the float64 reference on the same (rounded) values, on the same device; results on the CPU
    ref_leaves = {k: v.detach().to(device, torch.float64).requires_grad_(bool(p.grads))
                  for k, v in leaves.items()}
    q64, kv64 = _views(p, ref_leaves)
    idx = p.indices.to(device)
    dout64 = dout.to(device, torch.float64)

    def reference(q, kv, idx, tl):
        return reference_sparse_mla_fp64(q, kv, idx, tl, sm_scale=sm_scale, d_v=p.d_v)

    out64, lse64 = _per_batch(p, reference, q64, _rows(p, kv64), idx, tl)
    inputs64 = [t for name, t in (("q", q64), ("kv", kv64)) if name in p.grads]
    grads64 = torch.autograd.grad(out64, inputs64, dout64) if inputs64 else ()
    exact = {name: g.cpu() for name, g in zip(p.grads, grads64)}
    out64, lse64 = out64.detach().cpu(), lse64.detach().cpu()
    scale_out, scale_dq, scale_dkv, s_max, floor_out, floor_dq, floor_dkv = (
        t.cpu() for t in _per_batch(p, lambda *t: _scales(*t, sm_scale, p.d_v), q64.detach(),
                                    _rows(p, kv64).detach(), idx, tl, dout64))
    s_max = float(s_max.max()) if s_max.numel() else 0.0
    eps = torch.finfo(p.dtype).eps + EPS32 * (16 + s_max)

    # rows without a valid slot: exact zeros and lse -inf; the rest within the rounding floor
    assert out.dtype == p.dtype and lse.dtype == torch.float32
    assert out.shape == (*_batch(p), p.T, p.H, p.d_v) and lse.shape == out.shape[:-1]
    empty = ~_valid(p.indices, p.topk_length, p.S).any(-1)
    assert (out[empty] == 0).all() and (lse[empty] == -math.inf).all()
    _close("out", out, out64, scale_out, floor_out, eps)
    lse_err = (lse[~empty].double() - lse64[~empty]).abs()
    assert (lse_err <= C * EPS32 * (16 + s_max + lse64[~empty].abs())).all(), "lse"
    if "q" in got:
        assert (got["q"][empty] == 0).all()
        _close("dq", got["q"], exact["q"], scale_dq, floor_dq, eps)
    if "kv" in got:
        dkv, dkv64 = _rows(p, got["kv"]), _rows(p, exact["kv"])
        assert (dkv[~_named(p)] == 0).all()
        _close("dkv", dkv, dkv64, scale_dkv, floor_dkv, eps)


@pytest.mark.parametrize("backend", backend_params())
@given(data=st.data())
def test_backends_match_float64(backend, data):
    _check(data.draw(problems(backend)))


@pytest.mark.parametrize("backend", backend_params())
def test_float16_subnormal_p(backend):
    """Found by the h200 profile on sm90: a float16 row whose second probability is 5.1e-7, a
    float16 subnormal, so the P operand of dkv's P^T·dout rounds to a fixed spacing (the floor
    term of the bound, :func:`_scales`)."""
    _check(Problem(backend=backend, dtype=torch.float16, B=0, T=1, S=3, H=1, d_qk=576, d_v=512,
                   topk=2, sm_scale=0.3, threshold=None,
                   indices=torch.tensor([[2, 0]], dtype=torch.int32), topk_length=None,
                   q_layout="contiguous", kv_layout="contiguous", idx_layout="contiguous",
                   poison=None, grads=("kv",), seed=0))


# -- attention-sink edge values ----------------------------------------------------------------

SINK_EDGES = [math.inf, -math.inf, math.nan, 3.4e38, 1e30, 100.0, -1e30]


def _sink_definition_fp64(q, kv, indices, sink, sm_scale, d_v):
    """``(out, lse)`` float64 from the definition with every sink value allowed: ``lse =
    log(exp(sink) + sum_j exp(s_j))`` (+inf for a +inf sink, NaN for a NaN one), ``P_j =
    exp(s_j - lse)`` (0 when lse is +inf)."""
    S = kv.shape[0]
    valid = (indices >= 0) & (indices < S)
    keys = kv.double()[torch.where(valid, indices, 0).long()]
    s = torch.einsum("thd,tkd->thk", q.double(), keys) * sm_scale
    s = s.masked_fill(~valid[:, None, :], -math.inf)
    col = sink.double()[None, :, None].expand(s.shape[0], -1, 1)
    lse = torch.logsumexp(torch.cat((s, col), -1), -1)
    lse = torch.where(torch.isnan(col[..., 0]), math.nan, lse)  # logsumexp may drop a NaN
    p = torch.exp(s - torch.where(lse == -math.inf, 0.0, lse)[..., None])
    return torch.einsum("thk,tkd->thd", p, keys[..., :d_v]), lse


@pytest.mark.parametrize("backend", backend_params(CPU_BACKENDS))
@given(data=st.data())
def test_sink_edge_values_match_the_definition(backend, data):
    """Each head's sink drawn from the edges (+-inf, NaN, 3.4e38 whose log2 overflows float32,
    1e30, 100, -1e30) and finite values; out and lse against the float64 definition, NaN where
    it is NaN (a diverged sink is never hidden)."""
    T, S, H, topk = (data.draw(st.integers(1, n), label=x) for n, x in
                     ((6, "T"), (12, "S"), (4, "H"), (9, "topk")))
    seed = data.draw(st.integers(0, 2**16), label="seed")
    sinks = data.draw(st.lists(st.one_of(st.sampled_from(SINK_EDGES),
                                         st.floats(-40, 40, width=32)),
                               min_size=H, max_size=H), label="sinks")
    g = torch.Generator().manual_seed(seed)
    q, kv = torch.randn(T, H, 16, generator=g), torch.randn(S, 16, generator=g)
    idx = torch.randint(-1, S + 1, (T, topk), generator=g, dtype=torch.int32)
    sink = torch.tensor(sinks, dtype=torch.float32)
    with use_backend(backend):
        out, lse = sparse_mla(q, kv, idx, d_v=8, sm_scale=0.25, attn_sink=sink, return_lse=True)
    ref_out, ref_lse = _sink_definition_fp64(q, kv, idx, sink, 0.25, 8)
    torch.testing.assert_close(out.double(), ref_out, atol=1e-5, rtol=1e-5, equal_nan=True)
    torch.testing.assert_close(lse.double(), ref_lse, atol=1e-5, rtol=1e-5, equal_nan=True)


# -- symbolic sizes under torch.compile ----------------------------------------------------------

_COUNTER = CompileCounterWithBackend("aot_eager")


def _attention_and_loss(q, kv, indices, target, S, d_v):
    out, lse = sparse_mla(q, kv, indices, d_v=d_v, return_lse=True)
    loss = indexer_kl_loss(indices.float(), target, indices, kv_len=S, causal=True)
    return out, lse, loss


_COMPILED = torch.compile(_attention_and_loss, backend=_COUNTER, dynamic=True, fullgraph=True)


@settings(max_examples=min(settings().max_examples, 15))
@given(T=st.integers(2, 6), S=st.integers(2, 20), topk=st.integers(2, 7), d_v=st.integers(2, 16),
       seed=st.integers(0, 2**16))
def test_python_int_sizes_stay_symbolic(T, S, topk, d_v, seed):
    """``kv_len`` and ``d_v`` passed as Python ints under ``torch.compile(dynamic=True)``: every
    drawn size runs the one graph (no recompile, no error), and gives the eager results. The
    graph is traced first at sizes that differ from each other (Dynamo's duck sizing would
    otherwise tie sizes that happen to be equal in the first call)."""
    if _COUNTER.frame_count == 0:
        _COMPILED(torch.randn(5, 3, 16), torch.randn(11, 16), torch.randint(0, 11, (5, 7)),
                  torch.rand(5, 7), 11, 13)
    g = torch.Generator().manual_seed(seed)
    q, kv = torch.randn(T, 3, 16, generator=g), torch.randn(S, 16, generator=g)
    indices = torch.randint(-1, S + 1, (T, topk), generator=g)
    target = torch.rand(T, topk, generator=g)
    got = _COMPILED(q, kv, indices, target, S, d_v)
    for a, b in zip(got, _attention_and_loss(q, kv, indices, target, S, d_v)):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)
    assert _COUNTER.frame_count == 1
