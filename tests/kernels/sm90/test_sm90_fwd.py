"""GPU tests of the Hopper sparse-MLA forward kernel (mla_inductor.kernels.sm90.fwd).

Every check compares against the independent fp64 reference of conftest.py. Error budget
(FlashAttention-4's rule): the kernel's max error may be at most twice that of a plain PyTorch
bf16 implementation of the same math, plus a small atol.
"""

from __future__ import annotations

import math

import pytest
import torch

from mla_inductor.kernels import sm90
from tests.conftest import reference_sparse_mla_fp64

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not sm90.available()[0], reason=sm90.available()[1] or "no sm90"),
]

D_QK, D_V = 576, 512
ATOL = 1e-5


def _inputs(T, H, S, topk, d_qk=D_QK, seed=0, dtype=torch.bfloat16):
    g = torch.Generator(device="cpu").manual_seed(seed)
    q = torch.randn(T, H, d_qk, generator=g).to("cuda", dtype)
    kv = torch.randn(S, d_qk, generator=g).to("cuda", dtype)
    indices = torch.randint(0, S, (T, topk), generator=g, dtype=torch.int32).cuda()
    return q, kv, indices


def _torch_lowp(q, kv, indices, topk_length, sm_scale, d_v=D_V):
    """Plain PyTorch implementation in the input dtype (the error yardstick)."""
    S = kv.shape[0]
    idx = indices.long()
    valid = (idx >= 0) & (idx < S)
    if topk_length is not None:
        valid &= torch.arange(idx.shape[1], device=idx.device)[None] < topk_length.long()[:, None]
    keys = kv[torch.where(valid, idx, 0)]  # [T, topk, d_qk]
    s = torch.einsum("thd,tkd->thk", q, keys).float() * sm_scale
    s = s.masked_fill(~valid[:, None, :], -math.inf)
    p = torch.softmax(s, dim=-1).nan_to_num(0.0).to(q.dtype)
    return torch.einsum("thk,tkd->thd", p, keys[..., :d_v])


def _run(q, kv, indices, topk_length=None, threshold=0.0, o_lo=False, sm_scale=None, d_v=D_V):
    sm_scale = q.shape[-1] ** -0.5 if sm_scale is None else sm_scale
    return sm90.forward(q, kv, indices, topk_length, None, None, sm_scale, d_v, threshold, o_lo,
                        False)[:3]


def _check(q, kv, indices, topk_length=None, threshold=0.0, d_v=D_V):
    sm_scale = q.shape[-1] ** -0.5
    out, lse, _ = _run(q, kv, indices, topk_length, threshold, sm_scale=sm_scale, d_v=d_v)
    torch.cuda.synchronize()
    ref_out, ref_lse = reference_sparse_mla_fp64(q, kv, indices, topk_length, sm_scale, d_v)
    lowp = _torch_lowp(q, kv, indices, topk_length, sm_scale, d_v)
    assert out.dtype == q.dtype and lse.dtype == torch.float32
    assert torch.isfinite(out).all()
    err = (out.double() - ref_out).abs().max().item()
    err_lowp = (lowp.double() - ref_out).abs().max().item()
    assert err <= 2 * err_lowp + ATOL, f"max err {err} vs torch low-precision {err_lowp}"
    inf = torch.isinf(ref_lse)
    assert torch.equal(torch.isinf(lse), inf) and (lse[inf] < 0).all()
    torch.testing.assert_close(lse[~inf].double(), ref_lse[~inf], rtol=1e-5, atol=1e-4)
    assert (out[inf] == 0).all()
    return out, lse


@pytest.mark.parametrize("H", [1, 16, 64, 100, 128])
@pytest.mark.parametrize("topk", [1, 64, 100, 2048])
def test_heads_and_topk(H, topk):
    q, kv, indices = _inputs(T=5, H=H, S=3000, topk=topk, seed=H * 7 + topk)
    _check(q, kv, indices)


@pytest.mark.parametrize("d_qk", [576, 512])
@pytest.mark.parametrize("threshold", [0.0, 8.0])
def test_head_dims_and_thresholds(d_qk, threshold):
    q, kv, indices = _inputs(T=9, H=128, S=5000, topk=300, d_qk=d_qk, seed=d_qk)
    _check(q, kv, indices, threshold=threshold)


def test_fp16():
    q, kv, indices = _inputs(T=6, H=64, S=2000, topk=200, seed=3, dtype=torch.float16)
    _check(q, kv, indices)


def test_index_patterns():
    """Leading / interior / trailing empty slots, all-empty rows, out-of-range values,
    duplicates, and topk_length with garbage past it."""
    T, H, S, topk = 10, 64, 1000, 200
    q, kv, indices = _inputs(T, H, S, topk, seed=11)
    indices[0, :70] = -1  # leading (more than one block)
    indices[1, 80:150] = -7  # interior
    indices[2, 130:] = -1  # trailing
    indices[3, :] = -1  # all empty
    indices[4, ::3] = S  # == S
    indices[4, 1::3] = S + 1
    indices[5, :] = 2**31 - 1  # all out of range
    indices[6, 1::2] = -(2**31)
    indices[7, :] = indices[7, 0]  # one key, duplicated
    indices[8, 100:] = indices[8, :100]  # duplicates of a block
    topk_length = torch.full((T,), topk, dtype=torch.int32, device="cuda")
    _, lse = _check(q, kv, indices)
    assert torch.isinf(lse[3]).all() and torch.isinf(lse[5]).all()
    # topk_length: garbage (out-of-range, negative, valid-looking) past the length is ignored
    topk_length[0] = 150
    topk_length[1] = 1
    topk_length[2] = 0
    topk_length[6] = 65
    topk_length[9] = 5000  # larger than topk: clamped
    garbage = indices.clone()
    for t in range(T):
        n = int(topk_length[t].clamp(0, topk))
        garbage[t, n:] = torch.tensor([2**31 - 1, -3, 5, S], dtype=torch.int32).repeat(topk)[: topk - n]
    out_len, lse_len = _check(q, kv, garbage, topk_length)
    assert torch.isinf(lse_len[2]).all() and (out_len[2] == 0).all()


def test_o_lo():
    q, kv, indices = _inputs(T=8, H=100, S=4000, topk=500, seed=5)
    sm_scale = D_QK**-0.5
    out, lse, o_lo = _run(q, kv, indices, o_lo=True, sm_scale=sm_scale)
    out2, lse2, empty = _run(q, kv, indices, o_lo=False, sm_scale=sm_scale)
    assert empty.numel() == 0 and o_lo.shape == out.shape and o_lo.dtype == out.dtype
    assert torch.equal(out, out2) and torch.equal(lse, lse2)
    ref, _ = reference_sparse_mla_fp64(q, kv, indices, None, sm_scale, D_V)
    # o_lo is the rounding residual: at most half an ulp of out
    ulp = torch.finfo(torch.bfloat16).eps * out.float().abs().clamp_min(1e-30)
    assert (o_lo.abs() <= ulp).all()
    err_out = (out.double() - ref).norm() / ref.norm()
    err_hi = (out.double() + o_lo.double() - ref).norm() / ref.norm()
    assert err_hi < 0.85 * err_out, (err_hi, err_out)


def test_deterministic():
    q, kv, indices = _inputs(T=64, H=128, S=8192, topk=2048, seed=9)
    first = _run(q, kv, indices, o_lo=True)
    for _ in range(9):
        again = _run(q, kv, indices, o_lo=True)
        for a, b in zip(first, again):
            assert torch.equal(a, b)


def _peaked(T, H, S, topk, seed=0):
    """Each token's own key dominates (self weight ~0.2)."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    kv = torch.randn(S, D_QK, generator=g)
    self_idx = torch.randperm(S, generator=g)[:T]
    q = 0.25 * kv[self_idx][:, None, :] + 0.05 * torch.randn(T, H, D_QK, generator=g)
    others = torch.stack([torch.randperm(S, generator=g)[: topk + 1] for _ in range(T)])
    others = torch.where(others == self_idx[:, None], others[:, -1:], others)[:, :topk - 1]
    first = torch.cat([self_idx[:, None], others], 1).int()  # self in slot 0 (processed last)
    last = torch.cat([others, self_idx[:, None]], 1).int()  # self in the last slot
    return q.bfloat16().cuda(), kv.bfloat16().cuda(), first.cuda(), last.cuda()


def _row_gain_rms(x, ref):
    gain = ((x - ref) * ref).sum(-1) / (ref * ref).sum(-1)
    return gain.pow(2).mean().sqrt().item()


def test_thresholds_peaked_and_order_invariance():
    q, kv, first, last = _peaked(T=48, H=64, S=4096, topk=2048)
    sm_scale = D_QK**-0.5
    ref, _ = reference_sparse_mla_fp64(q, kv, first, None, sm_scale, D_V)
    floor = _row_gain_rms(ref.bfloat16().double(), ref)
    outs = {}
    for thr in (0.0, 8.0):
        _check(q, kv, first, threshold=thr)
        a = _run(q, kv, first, threshold=thr)[0].double()
        b = _run(q, kv, last, threshold=thr)[0].double()
        outs[thr] = a
        outs[thr, "gain"] = _row_gain_rms(a, ref), _row_gain_rms(a - b + ref, ref)
    assert not torch.equal(outs[0.0], outs[8.0])
    gain_exact, diff_exact = outs[0.0, "gain"]
    gain_lazy, diff_lazy = outs[8.0, "gain"]
    print(f"row-gain rms: floor {floor:.3g}; exact {gain_exact:.3g} (order diff {diff_exact:.3g}); "
          f"lazy {gain_lazy:.3g} (order diff {diff_lazy:.3g})")
    assert diff_lazy > 3 * diff_exact
    assert gain_exact < gain_lazy


def test_topk_length_none_equals_full_length():
    q, kv, indices = _inputs(T=7, H=128, S=3000, topk=130, seed=21)
    full = torch.full((7,), 130, dtype=torch.int32, device="cuda")
    a = _run(q, kv, indices)
    b = _run(q, kv, indices, full)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_cuda_graph_capture_and_side_stream():
    q, kv, indices = _inputs(T=16, H=128, S=4096, topk=512, seed=4)
    expected = _run(q, kv, indices)[0]
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        on_side = _run(q, kv, indices)[0]
    side.synchronize()
    assert torch.equal(on_side, expected)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = _run(q, kv, indices)[0]
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, expected)


def test_compile_during_capture_raises():
    from mla_inductor.kernels.cache import CompileDuringCaptureError
    from mla_inductor.kernels.sm90 import fwd_host

    q, kv, indices = _inputs(T=4, H=64, S=1000, topk=64, seed=1)
    key = fwd_host.compile_key(q.dtype, D_QK, D_V, 3.0, False, False)
    assert key not in fwd_host._CACHE
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(CompileDuringCaptureError):
        with torch.cuda.graph(graph):
            _run(q, kv, indices, threshold=3.0)
