"""The lightning indexer's fp8 form and :func:`mla_inductor.quantize_fp8`, against a float64
evaluation of the definition on the fp8 values and scales: ``score[t, s] = sum_h weights[t, h] *
relu(q_scale[t, h] * k_scale[s] * (q[t, h] . k[s]))``.

The fp8 values are exact in float64 and their products exact in float32, so the float32 scores
differ from the float64 ones by the rounding of the sums and of the two scalings only; a selected
key may differ from the float64 selection only at a near-tie, which :func:`problems` checks (a
selected key's float64 score within :func:`tolerance` of the ``n``-th largest, no key left out
above it). Small-integer fp8 values with power-of-two scales make every score exact: there the
selection must be exactly the float64 one with ties to the smaller key index. Also: quantize_fp8's
round trip and edge rows, the scales' gradients, the errors (eager and at trace time), fullgraph
compile with dynamic T, the fake kernel and opcheck, backend selection, a property test, and the
same check on a CUDA device (marked ``cuda``).
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from conftest import fallback_warnings
from hypothesis import given
from hypothesis import strategies as st
from torch._dynamo.testing import CompileCounterWithBackend
from torch._subclasses.fake_tensor import FakeTensorMode

from test_lightning_indexer import (CUDA, DIMS, _graph_breaks, _positions,
                                    assert_compiled_gradients_match, assert_op_and_fake_raise,
                                    exact_selection, inputs, problems)
from test_properties import PROFILE  # noqa: F401  (registers and loads the hypothesis profiles)
from mla_inductor import backends, lightning_indexer, quantize_fp8, use_backend
from mla_inductor.kernels import sm90

FP8 = torch.float8_e4m3fn
op = torch.ops.mla_inductor.lightning_indexer


def fp8_inputs(B, T, S, H, D, *, seed=0, device="cpu", q_scaled=True):
    """``(q8 [B, T, H, D], k8 [B, S, D], weights [B, T, H], q_scale [B, T, H] or None, k_scale
    [B, S])``: normal q and k quantised per row by :func:`quantize_fp8` (scales of each row's
    magnitude, about 2**-7)."""
    q, k, w = inputs(B, T, S, H, D, seed=seed)
    q8, q_scale = quantize_fp8(q)
    k8, k_scale = quantize_fp8(k)
    if not q_scaled:
        q8, q_scale = q.to(FP8), None
    return tuple(None if t is None else t.to(device) for t in (q8, k8, w, q_scale, k_scale))


def exact_fp8_inputs(B, T, S, H, D, *, seed=0):
    """Small-integer fp8 values and power-of-two scales: every score exact in float32 (many ties)."""
    q, k, w = inputs(B, T, S, H, D, seed=seed, integers=True)
    g = torch.Generator().manual_seed(seed + 1)
    q_scale = 2.0 ** torch.randint(-3, 4, (B, T, H), generator=g).float()
    k_scale = 2.0 ** torch.randint(-3, 4, (B, S), generator=g).float()
    return q.to(FP8), k.to(FP8), w, q_scale, k_scale


def _run(q8, k8, w, topk, q_scale, k_scale, **kw):
    return lightning_indexer(q8, k8, w, topk, return_scores=True, q_scale=q_scale,
                             k_scale=k_scale, **kw)


# -- the definition ------------------------------------------------------------------------------

@pytest.mark.parametrize("q_scaled", [True, False])
@pytest.mark.parametrize("mode", ["none", "default", "positions"])
def test_matches_the_float64_definition(mode, q_scaled):
    """A batch of 3, T 37, S 53, H 4, D 32, topk 32 (causal rows that see fewer keys, none, or
    all), with and without q_scale; the flat layout gives the same on each batch element."""
    B, T, S, H, D, topk = 3, 37, 53, 4, 32, 32
    q8, k8, w, qs, ks = fp8_inputs(B, T, S, H, D, seed=1, q_scaled=q_scaled)
    causal, pos, canonical = _positions(B, T, S, mode, seed=2)
    idx, val = _run(q8, k8, w, topk, qs, ks, causal=causal, q_positions=pos)
    assert problems(idx, val, q8.float(), k8.float(), w, canonical, topk, qs, ks) == []
    assert (idx >= 0).sum() > B * T * topk // 2  # the rows select keys
    for b in range(B):
        flat = _run(q8[b], k8[b], w[b], topk, None if qs is None else qs[b], ks[b],
                    causal=causal, q_positions=None if pos is None else pos[b])
        assert torch.equal(flat[0], idx[b]) and torch.equal(flat[1], val[b])


@pytest.mark.parametrize("mode", ["none", "default", "positions"])
def test_exact_scores_select_exactly_with_ties_to_the_smaller_index(mode):
    B, T, S, H, D, topk = 2, 23, 31, 3, 8, 9
    q8, k8, w, qs, ks = exact_fp8_inputs(B, T, S, H, D, seed=3)
    causal, pos, canonical = _positions(B, T, S, mode, seed=4)
    idx, val = _run(q8, k8, w, topk, qs, ks, causal=causal, q_positions=pos)
    q, k = q8.double() * qs.double()[..., None], k8.double() * ks.double()[..., None]
    assert torch.equal(idx.long(), exact_selection(q, k, w, canonical, topk))
    assert problems(idx, val, q8.float(), k8.float(), w, canonical, topk, qs, ks) == []


def test_the_scales_scale_each_dot_before_the_relu():
    """A negative scale flips a dot's sign before the relu (the definition, not ``relu(dot)``
    times the scale): one head, one key, hand-made values."""
    q8 = torch.tensor([[[[1.0, 2.0]]]]).to(FP8)  # [1, 1, 1, 2]
    k8 = torch.tensor([[[3.0, -1.0], [-2.0, 0.5]]]).to(FP8)  # dots 1 and -1
    w = torch.tensor([[[2.0]]])
    for k_scale, want in (([0.5, 4.0], [1.0, 0.0]), ([-0.5, 4.0], [0.0, 0.0]),
                          ([0.5, -4.0], [1.0, 8.0])):
        _, val = _run(q8, k8, w, 2, torch.tensor([[[1.0]]]), torch.tensor([k_scale]))
        assert val.tolist() == [[want]]


# -- gradients -----------------------------------------------------------------------------------

def test_the_scores_are_differentiable_in_weights_and_scales_not_in_fp8_q_and_k():
    """Against float64 autograd of the definition at the same indices (causal, rows with fewer
    keys than topk); the fp8 q and k, even marked as requiring grad, get None."""
    B, T, S, H, D, topk = 2, 6, 9, 3, 8, 4
    q8, k8, w, qs, ks = fp8_inputs(B, T, S, H, D, seed=5)
    positions = torch.stack([torch.arange(T) * (S // T) - 1, torch.arange(T) + S - T])
    leaves = [w.clone().requires_grad_(), qs.clone().requires_grad_(), ks.clone().requires_grad_()]
    q8g, k8g = q8.clone().requires_grad_(), k8.clone().requires_grad_()
    idx, val = _run(q8g, k8g, leaves[0], topk, leaves[1], leaves[2], causal=True,
                    q_positions=positions)
    assert not idx.requires_grad and val.requires_grad
    dval = torch.randn(val.shape, generator=torch.Generator().manual_seed(6))
    got = torch.autograd.grad(val, [q8g, k8g, *leaves], dval, allow_unused=True)
    assert got[0] is None and got[1] is None

    w64, qs64, ks64 = (t.detach().double().requires_grad_() for t in (w, qs, ks))
    valid = idx >= 0
    slot = idx.clamp(min=0).long()
    keys = torch.stack([k8[b].double()[slot[b]] for b in range(B)])  # [B, T, topk, D]
    k_sc = torch.stack([ks64[b][slot[b]] for b in range(B)])  # [B, T, topk]
    dots = torch.einsum("bthd,btjd->bthj", q8.double(), keys)
    logits = (qs64[..., None] * k_sc[:, :, None, :] * dots).relu()
    want_val = torch.where(valid, torch.einsum("bth,bthj->btj", w64, logits), 0.0)
    want = torch.autograd.grad(want_val, (w64, qs64, ks64), dval.double())

    def rel(a, b):
        return ((a.double() - b).norm() / b.norm()).item()

    assert rel(val, want_val) <= 1e-6
    for name, a, b in zip(("dweights", "dq_scale", "dk_scale"), got[2:], want):
        assert rel(a, b) <= 1e-5, name
    assert got[2][0, 0].abs().sum() == 0 and got[3][0, 0].abs().sum() == 0  # a row sees no key


def test_the_backward_compiles_fullgraph():
    """The gradients of weights, q_scale and k_scale through inductor equal the eager ones."""
    q8, k8, w, qs, ks = fp8_inputs(1, 7, 10, 2, 8, seed=7)

    def loss(w, qs, ks):
        _, val = _run(q8, k8, w, 3, qs, ks, causal=True)
        return val.square().sum()

    assert_compiled_gradients_match(loss, (w, qs, ks))


# -- quantize_fp8 --------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_quantize_round_trip(dtype):
    """Each element within e4m3's half-ulp of its row's scale: ``2**-4`` of the element in e4m3's
    normal range (``|x / scale| >= 2**-6``), ``2**-10 * scale`` below it (float64 check); the
    row's largest magnitude maps to 448; shapes and dtypes."""
    g = torch.Generator().manual_seed(8)
    x = (torch.randn(3, 5, 64, generator=g) * torch.logspace(-3, 3, 5)[:, None]).to(dtype)
    x8, scale = quantize_fp8(x)
    assert x8.shape == x.shape and x8.dtype == FP8 and x8.is_contiguous()
    assert scale.shape == (3, 5) and scale.dtype == torch.float32
    x64, back = x.double(), x8.double() * scale.double()[..., None]
    bound = torch.maximum(2.0**-4 * x64.abs(), 2.0**-10 * scale.double()[..., None])
    assert torch.all((back - x64).abs() <= bound)
    assert torch.allclose(scale.double(), x64.abs().amax(-1) / 448, rtol=2**-23, atol=0)
    assert torch.all(x8.float().abs().amax(-1) == 448)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantize_of_a_non_contiguous_input_is_contiguous(dtype):
    """A transposed or sliced input (a head slice of a projection): both outputs contiguous, the
    same values as for the contiguous copy."""
    g = torch.Generator().manual_seed(9)
    base = torch.randn(6, 4, 64, generator=g).to(dtype)
    for x in (base.transpose(0, 1), base[:, :, ::2], base[::2]):
        assert not x.is_contiguous() or x.data_ptr() != base.data_ptr()
        x8, scale = quantize_fp8(x)
        want8, want_scale = quantize_fp8(x.contiguous())
        assert x8.is_contiguous() and scale.is_contiguous()
        assert torch.equal(x8.view(torch.uint8), want8.view(torch.uint8))
        assert torch.equal(scale, want_scale)


def test_quantize_edge_rows():
    """A zero row: the floor scale and zeros (no 0/0); a NaN row: NaN; an infinite element:
    scale +inf, NaN there and 0 elsewhere; a 1-element row; a tiny row keeps its precision."""
    x = torch.tensor([[0.0, 0.0, -0.0], [1.0, math.nan, 2.0], [1.0, math.inf, 2.0],
                      [3e-39, -1e-38, 2e-38]])
    x8, scale = quantize_fp8(x)
    assert scale[0] == torch.finfo(torch.float32).tiny and torch.all(x8[0].float() == 0)
    assert scale[1].isnan() and x8[1].float().isnan().all()
    assert scale[2] == math.inf and x8[2].float().isnan().tolist() == [False, True, False]
    assert x8[2].float()[[0, 2]].tolist() == [0.0, 0.0]
    back = x8[3].double() * scale[3].double()
    assert torch.all((back - x[3].double()).abs() <= 2.0**-4 * x[3].double().abs())
    one8, one = quantize_fp8(torch.tensor([-5.0]))
    assert one8.float().item() == -448 and one.item() == pytest.approx(5 / 448, rel=2**-23)


@pytest.mark.parametrize("x, message", [
    ([1.0, 2.0], "x must be a torch.Tensor, got list"),
    (torch.ones(3, dtype=torch.int32), "x must be float32, bfloat16 or float16, got torch.int32"),
    (torch.ones(3, dtype=torch.float64), "x must be .*got torch.float64"),
    (torch.tensor(1.0), r"x must be \[..., D\] with D >= 1, got shape \(\)"),
    (torch.ones(4, 0), r"x must be .*got shape \(4, 0\)"),
])
def test_quantize_bad_input(x, message):
    with pytest.raises(RuntimeError, match="^quantize_fp8: " + message):
        quantize_fp8(x)


# -- compile, fake, opcheck ----------------------------------------------------------------------

@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_fullgraph_with_dynamic_tokens(backend):
    """Quantisation and selection in one graph for every T (topk from T), no graph break, the
    same indices and scores as eager."""

    def f(q, k, w):
        q8, q_scale = quantize_fp8(q)
        k8, k_scale = quantize_fp8(k)
        return _run(q8, k8, w, q.shape[1] // 2, q_scale, k_scale, causal=True)

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    counter = CompileCounterWithBackend(backend)
    fn = torch.compile(f, backend=counter, fullgraph=True)
    for i, T in enumerate((12, 20, 7, 33)):
        q, k, w = inputs(2, T, T, 3, 16, seed=9 + i)
        for t in (q, k, w):
            torch._dynamo.mark_dynamic(t, 1)
        with torch.compiler.set_stance("fail_on_recompile" if i else "default"):
            got = fn(q, k, w)
        want = f(q, k, w)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
        assert got[0].shape == (2, T, T // 2)
    assert counter.frame_count == 1 and _graph_breaks() == 0


def test_fake_outputs_match_real_metadata_and_opcheck():
    q8, k8, w, qs, ks = fp8_inputs(2, 7, 11, 3, 8, seed=13)
    pos = torch.arange(7, dtype=torch.int32).expand(2, 7).contiguous()
    real = op(q8, k8, w, pos, 5, qs, ks)
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        fake = op(*(mode.from_tensor(t) for t in (q8, k8, w, pos)), 5,
                  *(mode.from_tensor(t) for t in (qs, ks)))
    for r, f in zip(real, fake):
        assert (r.shape, r.stride(), r.dtype) == (f.shape, f.stride(), f.dtype)
    # test_schema is left out: it multiplies every input, which float8_e4m3fn has no CPU kernel for.
    checks = ("test_faketensor", "test_autograd_registration", "test_aot_dispatch_dynamic")
    torch.library.opcheck(op, (q8, k8, w, pos, 5, qs, ks), test_utils=checks)
    torch.library.opcheck(op, (q8, k8, w, None, 12, None, ks), test_utils=checks)


# -- bad input -----------------------------------------------------------------------------------

def _bad_cases():
    q8, k8, w, qs, ks = fp8_inputs(1, 6, 10, 3, 8, seed=14)
    q8, k8, w, qs, ks = q8[0], k8[0], w[0], qs[0], ks[0]  # flat
    qb, kb, wb = q8[None].expand(2, -1, -1, -1), k8[None].expand(2, -1, -1), w[None].expand(2, -1, -1)
    qsb, ksb = qs[None].expand(2, -1, -1), ks[None].expand(2, -1)
    bf = q8.to(torch.bfloat16), k8.to(torch.bfloat16)
    return {
        "q_fp8_k_bf16": ((q8, bf[1], w), dict(k_scale=ks), "q and k must both be "
                         "torch.float8_e4m3fn .*got q torch.float8_e4m3fn and k torch.bfloat16"),
        "q_bf16_k_fp8": ((bf[0], k8, w), dict(k_scale=ks), "q and k must both be "
                         "torch.float8_e4m3fn .*got q torch.bfloat16 and k torch.float8_e4m3fn"),
        "no_k_scale": ((q8, k8, w), dict(q_scale=qs), r"torch.float8_e4m3fn q and k need "
                       r"k_scale, float32 \[S\]"),
        "no_k_scale_batched": ((qb, kb, wb), {}, r".* need k_scale, float32 \[B, S\]"),
        "k_scale_with_bf16": ((*bf, w), dict(k_scale=ks), "q_scale and k_scale are read only "
                              "with torch.float8_e4m3fn q and k, got q torch.bfloat16 with "
                              "k_scale"),
        "q_scale_with_float32": ((q8.float(), k8.float(), w), dict(q_scale=qs),
                                 "q_scale and k_scale are read only .*got q torch.float32 with "
                                 "q_scale"),
        "k_scale_shape": ((q8, k8, w), dict(k_scale=ks[:9]), r"k_scale must be \[S\] = \[10\], "
                          r"got shape \(9,\)"),
        "k_scale_rank": ((q8, k8, w), dict(k_scale=ks[None]), r"k_scale must be \[S\] = \[10\], "
                         r"got shape \(1, 10\)"),
        "k_scale_batched": ((qb, kb, wb), dict(k_scale=ks), r"k_scale must be \[B, S\] = "
                            r"\[2, 10\], got shape \(10,\)"),
        "q_scale_shape": ((q8, k8, w), dict(q_scale=qs[:, :2], k_scale=ks),
                          r"q_scale must be \[T, H\] = \[6, 3\], got shape \(6, 2\)"),
        "q_scale_batched": ((qb, kb, wb), dict(q_scale=qs, k_scale=ksb),
                            r"q_scale must be \[B, T, H\] = \[2, 6, 3\], got shape \(6, 3\)"),
        "k_scale_dtype": ((q8, k8, w), dict(k_scale=ks.bfloat16()),
                          "k_scale must be float32, got torch.bfloat16"),
        "q_scale_dtype": ((qb, kb, wb), dict(q_scale=qsb.double(), k_scale=ksb),
                          "q_scale must be float32, got torch.float64"),
        "k_scale_device": ((q8, k8, w), dict(k_scale=ks.to("meta")), "k_scale on meta, q on cpu"),
        "k_scale_type": ((q8, k8, w), dict(k_scale=ks.tolist()),
                         "k_scale must be a torch.Tensor or None, got list"),
    }


BAD = _bad_cases()
TRACEABLE = [name for name in BAD if name not in ("k_scale_device", "k_scale_type")]


@pytest.mark.parametrize("name", BAD)
def test_bad_input_raises_in_eager(name):
    args, kwargs, message = BAD[name]
    with pytest.raises(RuntimeError, match="^lightning_indexer: " + message):
        lightning_indexer(*args, 4, **kwargs)


@pytest.mark.parametrize("name", TRACEABLE)
def test_bad_input_raises_at_trace_time(name):
    """The same message from the entry op's checks while Dynamo traces."""
    args, kwargs, message = BAD[name]
    torch._dynamo.reset()
    compiled = torch.compile(lambda *a: lightning_indexer(*a, 4, **kwargs), backend="aot_eager",
                             fullgraph=True)
    with pytest.raises(Exception, match="lightning_indexer: " + message):
        compiled(*args)


def test_the_scales_dtypes_and_devices_are_checked_once(monkeypatch):
    """On the op's canonical tensors alone; the entry op checks only what names the call's
    layout (a missing k_scale, the shapes)."""
    from mla_inductor.ops import lightning_indexer as ops

    checked = []
    real = ops.check_lightning_scales
    monkeypatch.setattr(ops, "check_lightning_scales", lambda *a: checked.append(a) or real(*a))
    q8, k8, w, qs, ks = fp8_inputs(1, 6, 10, 3, 8, seed=17)
    lightning_indexer(q8[0], k8[0], w[0], 4, q_scale=qs[0], k_scale=ks[0])
    assert len(checked) == 1 and checked[0][0].dim() == 4


def test_the_op_and_its_fake_check_the_canonical_scales():
    """Called directly (the fake at trace time, the op at run time) with canonical-layout
    errors: flat scales, a missing k_scale, a mixed pair."""
    q8, k8, w, qs, ks = fp8_inputs(1, 6, 10, 3, 8, seed=15)
    cases = (((q8, k8, w, None, 3, qs, ks[0]), r"k_scale must be \[B, S\] = \[1, 10\]"),
             ((q8, k8, w, None, 3, qs[0], ks), r"q_scale must be \[B, T, H\] = \[1, 6, 3\]"),
             ((q8, k8, w, None, 3, qs, None), ".* need k_scale"),
             ((q8, k8.float(), w, None, 3, None, ks), "q and k must both be"),
             ((q8.float(), k8.float(), w, None, 3, None, ks), "q_scale and k_scale are read "
                                                              "only with"))
    assert_op_and_fake_raise(cases)


# -- backend selection ---------------------------------------------------------------------------

def test_auto_on_sm90_runs_fp8_on_its_kernel_and_other_widths_on_the_reference(
        fake_gpu, monkeypatch):
    """sm90 has an fp8 score kernel for D = 128 and 1 to 64 heads: auto picks it for fp8 as for
    bf16, and falls back for another D (its reason in the warning)."""
    fake_gpu((9, 0))
    monkeypatch.setattr(sm90, "available", lambda: (True, ""))
    assert backends.select(CUDA, torch.bfloat16, "lightning_indexer", DIMS) is sm90
    assert backends.select(CUDA, FP8, "lightning_indexer", DIMS) is sm90
    narrow = (CUDA, FP8, "lightning_indexer", DIMS[:3] + (64,) + DIMS[4:])
    assert fallback_warnings(narrow) == [
        "mla_inductor: sparse-MLA lightning_indexer falls back to the PyTorch reference backend, "
        "which is much slower (often 50-100x): sm90 lightning indexer supports D = 128, got 64"
    ]


def test_a_forced_sm90_takes_fp8_and_refuses_other_widths(fake_gpu, monkeypatch):
    fake_gpu((9, 0))
    monkeypatch.setattr(sm90, "available", lambda: (True, ""))
    with use_backend("sm90"):
        assert backends.select(CUDA, FP8, "lightning_indexer", DIMS) is sm90
        wide = DIMS[:1] + (65,) + DIMS[2:]
        with pytest.raises(RuntimeError, match="^lightning_indexer: mla_inductor backend 'sm90' "
                                               "cannot run here: sm90 lightning indexer "
                                               "supports 1 to 64 index heads, got 65"):
            backends.select(CUDA, FP8, "lightning_indexer", wide)


@pytest.mark.parametrize("name", ["reference", "emulate"])
def test_the_cpu_backends_run_fp8_without_a_warning(name):
    q8, k8, w, qs, ks = fp8_inputs(1, 5, 8, 2, 8, seed=16)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with use_backend(name):
            got = _run(q8, k8, w, 3, qs, ks)
    want = _run(q8, k8, w, 3, qs, ks)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert problems(*got, q8.float(), k8.float(), w, None, 3, qs, ks) == []


# -- property and CUDA ---------------------------------------------------------------------------

@given(data=st.data())
def test_property_matches_the_float64_definition(data):
    """Drawn sizes (B or flat, T and S from 0, H, D, topk from 0 to past S), the causal rule,
    q_scale or not, exact small-integer inputs (the float64 stable selection exactly) or
    quantised normal ones (within the tolerance), repeated keys."""
    flat = data.draw(st.booleans(), "flat")
    B = 1 if flat else data.draw(st.integers(1, 3), "B")
    T, S = data.draw(st.integers(0, 12), "T"), data.draw(st.integers(0, 24), "S")
    H, D = data.draw(st.integers(1, 4), "H"), data.draw(st.sampled_from((1, 4, 16)), "D")
    topk = data.draw(st.integers(0, S + 3), "topk")
    exact = data.draw(st.booleans(), "exact")
    mode = data.draw(st.sampled_from(("none", "default", "positions")), "mode")
    seed = data.draw(st.integers(0, 2**16), "seed")
    make = exact_fp8_inputs if exact else fp8_inputs
    q8, k8, w, qs, ks = make(B, T, S, H, D, seed=seed)
    if data.draw(st.booleans(), "no q_scale"):
        qs = None
    if S > 1 and data.draw(st.booleans(), "repeat"):
        k8[:, 1::2], ks[:, 1::2] = k8[:, :1], ks[:, :1]  # every odd key ties key 0
    causal, pos, canonical = _positions(B, T, S, mode, seed=seed)
    if flat:
        idx, val = _run(q8[0], k8[0], w[0], topk, None if qs is None else qs[0], ks[0],
                        causal=causal, q_positions=None if pos is None else pos[0])
        idx, val = idx[None], val[None]
    else:
        idx, val = _run(q8, k8, w, topk, qs, ks, causal=causal, q_positions=pos)
    assert problems(idx, val, q8.float(), k8.float(), w, canonical, topk, qs, ks) == []
    if exact:
        q = q8.double() * (1 if qs is None else qs.double()[..., None])
        assert torch.equal(idx.long(), exact_selection(q, k8.double() * ks.double()[..., None],
                                                       w, canonical, topk))


@pytest.mark.cuda
@pytest.mark.parametrize("mode", ["none", "default", "positions"])
def test_cuda_matches_the_float64_definition(mode):
    """DeepSeek-V3.2's widths (64 index heads of 128) on a CUDA device under ``auto`` (the sm90
    fp8 kernel on Hopper, else the reference with a warning): the same checks as on the CPU."""
    B, T, S, H, D, topk = 2, 300, 700, 64, 128, 256
    q8, k8, w, qs, ks = fp8_inputs(B, T, S, H, D, seed=17, device="cuda")
    causal, pos, canonical = _positions(B, T, S, mode, seed=18)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        idx, val = _run(q8, k8, w, topk, qs, ks, causal=causal,
                        q_positions=None if pos is None else pos.cuda())
    assert idx.is_cuda
    assert problems(idx, val, q8.cpu().float(), k8.cpu().float(), w, canonical, topk, qs,
                    ks) == []
