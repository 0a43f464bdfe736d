"""Values of the public op (reference backend on CPU) against the independent fp64 reference."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import random_inputs, reference_sparse_mla_fp64, rel_l2

from mla_inductor import sparse_mla, use_backend

S = 40


def _index_patterns(T, topk):
    """name -> (indices [T, topk] int32 or int64, topk_length or None)."""
    g = torch.Generator().manual_seed(1)
    base = torch.randint(0, S, (T, topk), generator=g, dtype=torch.int32)
    pats = {"random": (base, None)}
    lead = base.clone()
    lead[:, : topk // 3] = -1
    pats["leading_-1"] = (lead, None)
    inner = base.clone()
    inner[:, topk // 3 : 2 * topk // 3] = -1
    pats["interior_-1"] = (inner, None)
    trail = base.clone()
    trail[:, 2 * topk // 3 :] = -1
    pats["trailing_-1"] = (trail, None)
    empty = base.clone()
    empty[::2] = -1
    pats["all_-1_rows"] = (empty, None)
    oob = base.clone()
    oob[:, 0], oob[:, -1] = S, S + 1
    oob[1::2, 1 % topk] = 2**31 - 1
    pats["out_of_range"] = (oob, None)
    big64 = base.long()
    big64[:, 0] = 2**32 + 3  # would wrap to row 3 if cast to int32 before masking
    pats["int64_beyond_int32"] = (big64, None)
    dup = base.clone()
    dup[:, : topk // 2 + 1] = dup[:, :1]
    pats["duplicates"] = (dup, None)
    lengths = torch.randint(0, topk + 1, (T,), generator=g, dtype=torch.int32)
    beyond = torch.arange(topk)[None, :] >= lengths[:, None]
    pats["topk_length_garbage_-1"] = (torch.where(beyond, -1, base), lengths)
    pats["topk_length_garbage_S"] = (torch.where(beyond, S, base), lengths)
    pats["topk_length_garbage_valid"] = (base, lengths)  # valid-looking rows beyond the length
    return pats


def _check_forward_and_grads(q, kv, indices, topk_length, d_v, tol_out, tol_grad):
    q = q.clone().requires_grad_(True)
    kv = kv.clone().requires_grad_(True)
    out, lse = sparse_mla(q, kv, indices, d_v=d_v, topk_length=topk_length, return_lse=True)
    q64 = q.detach().double().requires_grad_(True)
    kv64 = kv.detach().double().requires_grad_(True)
    ref_out, ref_lse = reference_sparse_mla_fp64(q64, kv64, indices, topk_length, d_v=d_v)
    assert torch.equal(torch.isinf(lse), torch.isinf(ref_lse))
    finite = torch.isfinite(ref_lse)
    torch.testing.assert_close(lse[finite].double(), ref_lse[finite], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out.double(), ref_out, atol=tol_out, rtol=tol_out)
    assert torch.all(out[~finite] == 0)
    dout = torch.randn_like(out)
    out.backward(dout)
    ref_out.backward(dout.double())
    for got, ref in ((q.grad, q64.grad), (kv.grad, kv64.grad)):
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got.double(), ref, atol=tol_grad, rtol=tol_grad)
    return out, lse


@pytest.mark.parametrize("pattern", list(_index_patterns(6, 9)))
def test_index_patterns_fp32(pattern):
    indices, topk_length = _index_patterns(6, 9)[pattern]
    q, kv, _ = random_inputs(6, 3, 24, S, 9, dtype=torch.float32)
    out, lse = _check_forward_and_grads(q, kv, indices, topk_length, 16, 1e-5, 1e-5)
    if pattern == "all_-1_rows":
        assert torch.isinf(lse[::2]).all() and (out[::2] == 0).all()


@pytest.mark.parametrize("heads", [1, 3, 16, 64, 128])
@pytest.mark.parametrize("topk", [1, 63, 65, 256])
def test_heads_and_topk_fp32(heads, topk):
    q, kv, indices = random_inputs(4, heads, 32, 300, topk, dtype=torch.float32, invalid_frac=0.1)
    _check_forward_and_grads(q, kv, indices, None, 24, 1e-5, 1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_error_is_the_rounding_floor(dtype):
    """Out error vs fp64 <= 2x that of rounding the exact result to the dtype (FA4's rule)."""
    q, kv, indices = random_inputs(16, 8, 64, 100, 48, dtype=dtype, invalid_frac=0.2)
    out, lse = sparse_mla(q, kv, indices, d_v=32, return_lse=True)
    ref_out, ref_lse = reference_sparse_mla_fp64(q, kv, indices, d_v=32)
    floor = (ref_out.to(dtype).double() - ref_out).abs().max().item()
    assert out.dtype == dtype and lse.dtype == torch.float32
    assert (out.double() - ref_out).abs().max().item() <= 2 * floor + 1e-6
    torch.testing.assert_close(lse.double(), ref_lse, atol=1e-5, rtol=1e-5)


def test_main_shape_bf16_gradients():
    """d_qk 576 / d_v 512: gradients within 1.5x of an ideal bf16 pipeline's error."""
    q, kv, indices = random_inputs(8, 16, 576, 256, 64, dtype=torch.bfloat16, invalid_frac=0.1)
    q.requires_grad_(True)
    kv.requires_grad_(True)
    out = sparse_mla(q, kv, indices)
    dout = torch.randn_like(out)
    out.backward(dout)
    q64 = q.detach().double().requires_grad_(True)
    kv64 = kv.detach().double().requires_grad_(True)
    ref, _ = reference_sparse_mla_fp64(q64, kv64, indices, d_v=512)
    ref.backward(dout.double())
    for got, exact in ((q.grad, q64.grad), (kv.grad, kv64.grad)):
        ideal = rel_l2(exact.to(torch.bfloat16), exact)
        assert rel_l2(got, exact) <= 1.5 * ideal + 1e-4


def test_default_sm_scale_and_explicit_scale():
    q, kv, indices = random_inputs(3, 2, 20, 10, 4, dtype=torch.float32)
    out = sparse_mla(q, kv, indices, d_v=20)
    ref, _ = reference_sparse_mla_fp64(q, kv, indices, sm_scale=20**-0.5, d_v=20)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
    out = sparse_mla(q, kv, indices, d_v=20, sm_scale=0.3)
    ref, _ = reference_sparse_mla_fp64(q, kv, indices, sm_scale=0.3, d_v=20)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)


def test_layout_variants_agree():
    """[S,1,D] kv, [T,1,topk] indices, int64 indices and a non-contiguous q give the same result."""
    q, kv, indices = random_inputs(5, 4, 32, 30, 7, dtype=torch.float32, invalid_frac=0.2)
    base = sparse_mla(q, kv, indices, d_v=16)
    q_t = q.transpose(0, 1).contiguous().transpose(0, 1)  # a transposed view
    assert not q_t.is_contiguous()
    for args in (
        (q_t, kv, indices),
        (q, kv[:, None, :], indices[:, None, :]),
        (q, kv, indices.long()),
    ):
        torch.testing.assert_close(sparse_mla(*args, d_v=16), base, atol=0, rtol=0)


def test_batched_equals_flattened():
    B, T, H, D, Sb, k = 3, 5, 2, 16, 12, 6
    g = torch.Generator().manual_seed(2)
    q = torch.randn(B, T, H, D, generator=g, requires_grad=True)
    kv = torch.randn(B, Sb, 1, D, generator=g, requires_grad=True)
    indices = torch.randint(-2, Sb + 2, (B, T, k), generator=g, dtype=torch.int32)
    lengths = torch.randint(0, k + 1, (B, T), generator=g, dtype=torch.int32)
    out, lse = sparse_mla(q, kv, indices, d_v=8, topk_length=lengths, return_lse=True)
    assert out.shape == (B, T, H, 8) and lse.shape == (B, T, H)
    out.square().sum().backward()
    for b in range(B):
        qb = q[b].detach().requires_grad_(True)
        kvb = kv[b, :, 0].detach().requires_grad_(True)
        ob, lb = sparse_mla(qb, kvb, indices[b], d_v=8, topk_length=lengths[b], return_lse=True)
        ob.square().sum().backward()
        torch.testing.assert_close(out[b], ob)
        torch.testing.assert_close(lse[b], lb)
        torch.testing.assert_close(q.grad[b], qb.grad)
        torch.testing.assert_close(kv.grad[b, :, 0], kvb.grad)


def test_empty_tokens():
    q = torch.randn(0, 4, 16, requires_grad=True)
    kv = torch.randn(10, 16, requires_grad=True)
    indices = torch.zeros(0, 5, dtype=torch.int32)
    out, lse = sparse_mla(q, kv, indices, d_v=8, return_lse=True)
    assert out.shape == (0, 4, 8) and lse.shape == (0, 4)
    out.sum().backward()
    assert q.grad.shape == q.shape and torch.all(kv.grad == 0)


def test_all_invalid_rows_have_zero_finite_gradients():
    q = torch.randn(3, 2, 16, requires_grad=True)
    kv = torch.randn(10, 16, requires_grad=True)
    indices = torch.tensor([[-1, 10, 2**31 - 1]] * 3, dtype=torch.int32)
    out, lse = sparse_mla(q, kv, indices, d_v=8, return_lse=True)
    assert torch.all(out == 0) and torch.all(lse == -math.inf)
    out.sum().backward()
    assert torch.all(q.grad == 0) and torch.all(kv.grad == 0)


def test_empty_slots_are_never_written_in_dkv():
    """Rows that no valid slot names get exactly zero gradient; -0.0 would also be acceptable,
    but a gradient arriving through an empty slot (e.g. index S clamped to S-1) must not."""
    q, kv, _ = random_inputs(4, 2, 16, 8, 3, dtype=torch.float32)
    kv.requires_grad_(True)
    indices = torch.tensor([[0, 8, -1], [1, 9, 7 + 2**20], [0, 1, -5], [8, 8, 8]], dtype=torch.int32)
    sparse_mla(q, kv, indices, d_v=8).sum().backward()
    assert torch.all(kv.grad[2:] == 0)
    assert torch.all(kv.grad[:2].abs().sum(-1) > 0)


def test_reference_backend_is_selectable_and_fp32_grads_match_gradcheck():
    q, kv, indices = random_inputs(3, 2, 8, 6, 4, dtype=torch.float32, invalid_frac=0.2)
    with use_backend("reference"):
        q64 = q.double()
        # float64 is outside the public dtype set; gradcheck the fp32 op against fp64 finite
        # differences of the independent reference instead.
        q.requires_grad_(True)
        out = sparse_mla(q, kv, indices, d_v=4)
        w = torch.randn_like(out)
        (out * w).sum().backward()
    eps = 1e-6
    num = torch.zeros_like(q64)
    for i in range(q64.numel()):
        d = torch.zeros_like(q64).view(-1)
        d[i] = eps
        d = d.view_as(q64)
        plus = (reference_sparse_mla_fp64(q64 + d, kv, indices, d_v=4)[0] * w.double()).sum()
        minus = (reference_sparse_mla_fp64(q64 - d, kv, indices, d_v=4)[0] * w.double()).sum()
        num.view(-1)[i] = (plus - minus) / (2 * eps)
    torch.testing.assert_close(q.grad.double(), num, atol=1e-5, rtol=1e-4)


def test_reference_chunking_is_invisible(monkeypatch):
    """Many tiny token chunks give bitwise the same results as one chunk."""
    from mla_inductor.kernels import reference

    q, kv, idx = random_inputs(9, 4, 32, 20, 7, dtype=torch.bfloat16, invalid_frac=0.3)
    pos = torch.arange(9, dtype=torch.int32) + 8
    sink = torch.tensor([0.5, -1.0, 2.0, -math.inf])
    dlse = torch.randn(9, 4)
    args = (q, kv, idx, None, pos, sink, 0.2, 16)

    def run():
        fwd = reference.forward(*args, 0.0, True, True)
        bwd = reference.backward(torch.ones_like(fwd[0]), dlse, q, kv, idx, None, pos, sink,
                                 *fwd[:3], 0.2, 16)
        return fwd + bwd

    one = run()
    monkeypatch.setattr(reference, "_CHUNK_ELEMENTS", 1)  # one token per chunk
    many = run()
    for a, b in zip(one, many):
        torch.testing.assert_close(a, b, rtol=0, atol=0 if a.dim() > 1 else 1e-6)


def test_int64_topk_length_is_accepted():
    q, kv, idx = random_inputs(4, 2, 16, 10, 6, dtype=torch.float32)
    lengths = torch.tensor([0, 3, 6, 2**40])
    out = sparse_mla(q, kv, idx, d_v=8, topk_length=lengths)
    ref = sparse_mla(q, kv, idx, d_v=8, topk_length=torch.tensor([0, 3, 6, 6], dtype=torch.int32))
    assert torch.equal(out, ref)


def _textbook_fp32(q, kv, indices, sm_scale, d_v):
    """torch.softmax in fp32 over the gathered scores, then P @ V: the yardstick of the
    reference backend's precision (autograd gives its gradients)."""
    valid = (indices >= 0) & (indices < kv.shape[0])
    keys = kv[torch.where(valid, indices, 0).long()]
    s = torch.einsum("thd,tkd->thk", q, keys) * sm_scale
    p = torch.softmax(s.masked_fill(~valid[:, None, :], -math.inf), dim=-1)
    return torch.einsum("thk,tkd->thd", p, keys[..., :d_v])


@pytest.mark.parametrize("sm_scale", [1.0, 1e2, 1e4])
def test_reference_is_as_precise_as_a_textbook_fp32_softmax(sm_scale):
    """Large scores (|lse| up to ~1e5 at sm_scale 1e4, nearly one-hot rows): out, dq and dkv of
    the reference backend stay within 1.5x of torch.softmax's fp32 error against fp64. (An lse
    subtracted in fp32 gave a gain error of |lse| * 2**-24 on every row: 1.2e-3 on out, dq off
    by 1e8 relative, where the true dq is tiny.)"""
    q, kv, idx = random_inputs(8, 4, 32, 40, 12, dtype=torch.float32, invalid_frac=0.2)
    dout = torch.randn(8, 4, 16, generator=torch.Generator().manual_seed(1))
    results = {}
    for name, fn in (
        ("ours", lambda q, kv: sparse_mla(q, kv, idx, d_v=16, sm_scale=sm_scale)),
        ("textbook", lambda q, kv: _textbook_fp32(q, kv, idx, sm_scale, 16)),
        ("fp64", lambda q, kv: reference_sparse_mla_fp64(q, kv, idx, sm_scale=sm_scale, d_v=16)[0]),
    ):
        dtype = torch.float64 if name == "fp64" else torch.float32
        q_, kv_ = (t.detach().to(dtype).requires_grad_(True) for t in (q, kv))
        out = fn(q_, kv_)
        out.backward(dout.to(dtype))
        results[name] = (out.detach(), q_.grad, kv_.grad)
    for i, what in enumerate(("out", "dq", "dkv")):
        exact = results["fp64"][i]
        ours, textbook = rel_l2(results["ours"][i], exact), rel_l2(results["textbook"][i], exact)
        assert ours <= 1.5 * textbook + 1e-9, (what, ours, textbook)
