"""SM100 backend (FlashAttention-4's kernels).

Without a Blackwell GPU: the kernels compile for sm_100a (CuTe DSL cross-compilation) and the
backend's host code runs on fake ``cuda`` tensors up to the launch. Values are checked only by the
``cuda`` tests at the end, which need an SM100 GPU.
"""

from __future__ import annotations

import math
import os
import tempfile

import pytest
import torch
from conftest import reference_sparse_mla_fp64, rel_l2

from mla_inductor.kernels import sm100

D_QK, D_V = 576, 512


def _need_fa4():
    return pytest.importorskip(
        "flash_attn.cute.interface",
        reason="needs flash-attn-4 and triton (imported by its quack dependency)",
    )


def _object_code(compiled) -> bytes:
    """The exported host+device object of a compiled CuTe DSL function."""
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "kernel.o")
        compiled.export_to_c(object_file_path=path, function_name="kernel")
        with open(path, "rb") as f:
            return f.read()


# ---- pure host logic, real tensors ----------------------------------------------------------


def test_gather_indices_marks_every_empty_slot_and_pads_to_128():
    S, T, topk = 10, 3, 130
    g = torch.Generator().manual_seed(0)
    indices = torch.randint(-3, S + 4, (T, topk), generator=g, dtype=torch.int32)
    topk_length = torch.tensor([130, 7, 0], dtype=torch.int32)
    gather = sm100._gather_indices(indices, topk_length, S)
    assert gather.shape == (1, T, 256) and gather.dtype == torch.int32 and gather.is_contiguous()
    for t in range(T):
        for j in range(256):
            i = indices[t, j].item() if j < topk else -1
            valid = j < topk and j < topk_length[t].item() and 0 <= i < S
            assert gather[0, t, j].item() == (i if valid else -1), (t, j)


def test_gather_indices_drop_future_keys_of_a_causal_call():
    indices = torch.tensor([[0, 3, 4, 9, -1] + [2] * 123, [7] * 128], dtype=torch.int32)
    positions = torch.tensor([3, -1], dtype=torch.int32)
    gather = sm100._gather_indices(indices, None, 10, positions)
    assert gather[0, 0, :6].tolist() == [0, 3, -1, -1, -1, 2]
    assert (gather[0, 1] == -1).all()  # position -1: every key is in the future


def test_gather_indices_without_topk_length_keeps_multiple_of_128():
    indices = torch.tensor([[0, 5, -1] + [1] * 125], dtype=torch.int32)
    gather = sm100._gather_indices(indices, None, 5)
    assert gather.shape == (1, 1, 128)
    assert gather[0, 0, :4].tolist() == [0, -1, -1, 1]


def test_layout_split_is_views_of_the_packed_tensors():
    _need_fa4()
    q = torch.randn(4, 3, D_QK, dtype=torch.bfloat16)
    kv = torch.randn(7, D_QK, dtype=torch.bfloat16)
    qv, q_pe = sm100._split_q(q, True)
    v, k_pe = sm100._split_kv(kv, True)
    assert qv.shape == (1, 4, 3, 512) and q_pe.shape == (1, 4, 3, 64)
    assert v.shape == (1, 7, 1, 512) and k_pe.shape == (1, 7, 1, 64)
    assert qv.data_ptr() == q.data_ptr() and v.data_ptr() == kv.data_ptr()
    assert q_pe.data_ptr() == q.data_ptr() + 512 * q.element_size()
    assert k_pe.data_ptr() == kv.data_ptr() + 512 * kv.element_size()
    assert torch.equal(q_pe[0], q[..., 512:]) and torch.equal(k_pe[0, :, 0], kv[:, 512:])
    assert torch.equal(qv[0], q[..., :512]) and torch.equal(v[0, :, 0], kv[:, :512])


def test_layout_split_copies_a_misaligned_input():
    _need_fa4()
    storage = torch.randn(1 + 4 * 3 * D_QK, dtype=torch.bfloat16)
    q = storage[1:].view(4, 3, D_QK)  # 2-byte offset: not 16-byte aligned
    qv, q_pe = sm100._split_q(q, True)
    assert qv.data_ptr() % 16 == 0 and q_pe.data_ptr() % 16 == 0
    assert torch.equal(qv[0], q[..., :512]) and torch.equal(q_pe[0], q[..., 512:])


@pytest.mark.parametrize(
    "index",
    [
        (Ellipsis, slice(None, 5)),
        (slice(1, 3), Ellipsis, 2),
        1,
        (Ellipsis,),
        (0, slice(2, None), Ellipsis),
    ],
)
def test_basic_index_equals_python_indexing(index):
    t = torch.arange(4 * 6 * 8).view(4, 6, 8)
    assert torch.equal(sm100._basic_index(t, index), t[index])


def test_basic_index_declines_advanced_indexing():
    t = torch.arange(24).view(4, 6)
    assert sm100._basic_index(t, (slice(None, None, 2),)) is None
    assert sm100._basic_index(t, torch.tensor([0, 1])) is None
    assert sm100._basic_index(t, (None, 0)) is None


# ---- compile checks for sm_100a (no GPU) -----------------------------------------------------


@pytest.fixture(scope="module")
def precompiled():
    _need_fa4()
    import mla_inductor

    return mla_inductor.precompile(arch="sm_100a", heads=(128,), topk=(256,))


@pytest.mark.slow
def test_precompile_compiles_both_thresholds_and_the_backward(precompiled):
    fwd = {
        key: fn
        for key, fn in precompiled["forward"].items()
        if key[:5] == ("sm_100a", "torch.bfloat16", 128, 256, True)
    }
    assert sorted((key[5], key[6]) for key in fwd) == [(0.0, True), (8.0, False)]
    training, inference = sorted(fwd.items(), key=lambda kv: kv[0][5])
    assert _object_code(training[1]) != _object_code(inference[1])
    for name in ("preprocess", "main", "dq_dqv_gemm", "dk_gemm"):
        assert precompiled["backward"][name], name
    main_keys = list(precompiled["backward"]["main"])
    # FA4's key: (dtype, hdim, hdim_v, heads, ..., topk, bitmask off, recompute_p)
    assert any(key[3] == 128 and key[10] == 256 and key[-1] is True for key in main_keys)


needs_cuda_build = pytest.mark.skipif(
    not torch.backends.cuda.is_built(),
    reason="FA4 picks its training kernel from requires_grad; autograd metadata on fake cuda "
    "tensors needs a CUDA build of torch",
)


@pytest.mark.slow
@pytest.mark.parametrize(
    "training,H",
    [
        (False, 128),  # 2-CTA kernel
        (False, 20),  # <= 64 heads past one wave: FA4's 1-CTA 64-key kernel
        pytest.param(True, 128, marks=needs_cuda_build),
        pytest.param(True, 20, marks=needs_cuda_build),
    ],
)
def test_forward_kernel_is_fa4s_own(training, H):
    """Our forward compiles the very kernel FA4's interface picks, byte for byte: threshold 8.0
    without o_lo (inference), 0.0 with o_lo (training, FA4's recompute-P mode)."""
    fa4 = _need_fa4()
    T, S, topk = 256, 512, 256
    theirs_before = set(fa4._flash_attn_fwd.compile_cache.cache)
    with sm100.cross_compile("sm_100a"):
        like = dict(dtype=torch.bfloat16, device="cuda")
        q = torch.empty(T, H, D_QK, **like)
        kv = torch.empty(S, D_QK, **like)
        idx = torch.empty(T, topk, dtype=torch.int32, device="cuda")
        sm100.forward(q, kv, idx, None, None, None, D_QK**-0.5, D_V, 0.0 if training else 8.0,
                      training, False)
        q4 = q.unsqueeze(0).requires_grad_(training)
        kv4 = kv.view(1, S, 1, D_QK).requires_grad_(training)
        fa4._flash_attn_fwd(
            q4.narrow(-1, 512, 64), kv4.narrow(-1, 512, 64), kv4.narrow(-1, 0, 512),
            qv=q4.narrow(-1, 0, 512), gather_kv_indices=idx.unsqueeze(0), return_lse=True,
            gather_bwd_recompute_p=True,
        )  # fmt: skip
    threshold, one_cta = (0.0 if training else 8.0), H <= 64  # 2 * T > 148 SMs: past one wave
    want = ("sm_100a", "torch.bfloat16", H, topk, True, threshold, training, one_cta)
    ours = [fn for k, fn in sm100._forward_cache().cache.items() if k[:8] == want]
    cache = fa4._flash_attn_fwd.compile_cache.cache
    theirs = [fn for k, fn in cache.items() if k not in theirs_before]
    assert len(ours) == 1 and len(theirs) == 1
    assert _object_code(ours[0]) == _object_code(theirs[0])


def _fake_inputs(T, H, d_qk, S, topk, with_topk_length):
    q = torch.empty(T, H, d_qk, dtype=torch.bfloat16, device="cuda")
    kv = torch.empty(S, d_qk, dtype=torch.bfloat16, device="cuda")
    indices = torch.empty(T, topk, dtype=torch.int32, device="cuda")
    topk_length = torch.empty(T, dtype=torch.int32, device="cuda") if with_topk_length else None
    return q, kv, indices, topk_length


def _meta(t):
    return t.shape, t.stride(), t.dtype, t.device


@pytest.mark.slow
@pytest.mark.parametrize(
    "threshold,return_o_lo,H,d_qk,topk,with_topk_length",
    [
        (0.0, True, 128, 576, 200, True),  # training; topk padded to 256: precompiled kernels
        (8.0, False, 128, 576, 200, False),  # inference
        (8.0, True, 128, 576, 200, True),  # training with the lazy threshold forced
        (0.0, True, 20, 576, 64, True),  # <= 64 heads: FA4's 64-row backward kernels
        (0.0, True, 64, 512, 128, False),  # no RoPE part: q_pe = k_pe = None
    ],
)
def test_host_path_on_fake_cuda_matches_the_op_fake_kernel(
    precompiled, threshold, return_o_lo, H, d_qk, topk, with_topk_length
):
    """Forward, and backward when o_lo is returned (a backward will run), on fake cuda tensors:
    all host code and the compiles run; outputs match the op's fake kernel."""
    import mla_inductor  # noqa: F401  (registers torch.ops.mla_inductor)

    T, S, scale = 192, 300, d_qk**-0.5
    args = (scale, D_V, threshold, return_o_lo)
    with sm100.cross_compile("sm_100a"):
        q, kv, indices, topk_length = _fake_inputs(T, H, d_qk, S, topk, with_topk_length)
        got = sm100.forward(q, kv, indices, topk_length, None, None, *args, False)
        want = torch.ops.mla_inductor.sparse_mla_fwd(q, kv, indices, topk_length, None, None,
                                                     *args, False)
        assert [_meta(t) for t in got] == [_meta(t) for t in want]
        assert got[2].shape == ((T, H, D_V) if return_o_lo else (0,))
        if return_o_lo:
            out, lse, o_lo, _ = got
            dout = torch.empty_like(out)
            dgot = sm100.backward(dout, None, q, kv, indices, topk_length, None, None, out, lse,
                                  o_lo, scale, D_V)
            dwant = torch.ops.mla_inductor.sparse_mla_bwd(
                dout, None, q, kv, indices, topk_length, None, None, out, lse, o_lo, scale, D_V
            )
            assert [_meta(t) for t in dgot[:2]] == [_meta(t) for t in dwant[:2]]
            assert [t.is_contiguous() for t in dgot[:2]] == [True, True] and dgot[2] is None
    fwd_keys = [k[2:7] for k in sm100._forward_cache().cache]
    assert (H, -(-topk // 128) * 128, d_qk > D_V, threshold, return_o_lo) in fwd_keys


def test_unsupported_shapes_raise_clear_errors():
    q = torch.empty(2, 4, 256, dtype=torch.bfloat16)
    kv = torch.empty(5, 256, dtype=torch.bfloat16)
    idx = torch.zeros(2, 8, dtype=torch.int32)
    with pytest.raises(NotImplementedError, match="d_v = 512"):
        sm100.forward(q, kv, idx, None, None, None, 0.1, 128, 0.0, False, False)
    q = torch.empty(2, 129, D_QK, dtype=torch.bfloat16)
    kv = torch.empty(5, D_QK, dtype=torch.bfloat16)
    with pytest.raises(NotImplementedError, match="1 to 128 heads"):
        sm100.forward(q, kv, idx, None, None, None, 0.1, D_V, 0.0, False, False)
    q = torch.empty(2, 4, D_QK, dtype=torch.float16)
    with pytest.raises(NotImplementedError, match="bf16-only"):
        sm100.backward(q[..., :D_V], None, q, kv.half(), idx, None, None, None, q[..., :D_V],
                       q[..., 0].float(), q.new_empty(0), 0.1, D_V)  # fmt: skip
    q = torch.empty(2, 4, D_QK, dtype=torch.bfloat16)
    with pytest.raises(NotImplementedError, match="attention sink is not mapped"):
        sm100.forward(q, kv, idx, None, None, torch.zeros(4), 0.1, D_V, 0.0, False, False)
    with pytest.raises(NotImplementedError, match="max_logits is not mapped"):
        sm100.forward(q, kv, idx, None, None, None, 0.1, D_V, 0.0, False, True)


def test_supports_refuses_token_counts_fa4_counts_in_32_bits():
    """FA4 counts a token's 128 head-tile rows in int32: T up to 2**24 - 1 runs, 2**24 falls
    back (with the reason); the 64-bit offsets need no other size limit."""
    for direction in ("forward", "backward"):
        assert sm100.supports(torch.bfloat16, direction, 2**24 - 1, 128, 2**24, D_QK, D_V) == (True, "")
        ok, why = sm100.supports(torch.bfloat16, direction, 2**24, 1, 8, D_QK, D_V)
        assert not ok and "at most 16777215 tokens" in why


def test_empty_problems_return_zeros_without_a_kernel():
    q = torch.randn(3, 4, D_QK, dtype=torch.bfloat16)
    no_kv = torch.empty(0, D_QK, dtype=torch.bfloat16)
    idx = torch.zeros(3, 8, dtype=torch.int32)
    out, lse, o_lo, _ = sm100.forward(q, no_kv, idx, None, None, None, 0.1, D_V, 0.0, True, False)
    assert torch.equal(out, torch.zeros(3, 4, D_V, dtype=torch.bfloat16))
    assert torch.equal(lse, torch.full((3, 4), -math.inf))
    assert torch.equal(o_lo, torch.zeros(3, 4, D_V, dtype=torch.bfloat16))
    dq, dkv, _ = sm100.backward(out, None, q, no_kv, idx, None, None, None, out, lse, o_lo, 0.1,
                                D_V)
    assert torch.equal(dq, torch.zeros_like(q)) and dkv.shape == (0, D_QK)
    out, lse, o_lo, _ = sm100.forward(q[:0], no_kv, idx[:0], None, None, None, 0.1, D_V, 8.0,
                                      False, False)
    assert out.shape == (0, 4, D_V) and lse.shape == (0, 4) and o_lo.shape == (0,)


def test_cross_compile_rejects_other_archs():
    with pytest.raises(ValueError, match="sm_90a"):
        with sm100.cross_compile("sm_90a"):
            pass


def test_available_names_what_is_missing():
    ok, reason = sm100.available()
    if not torch.cuda.is_available():
        assert (ok, reason) == (False, "no CUDA device")
    elif torch.cuda.get_device_capability()[0] != 10:
        assert not ok and "SM100" in reason
    else:
        assert ok or "mla-inductor[sm100]" in reason


# ---- values on an SM100 GPU ------------------------------------------------------------------

sm100_gpu = pytest.mark.skipif(
    not sm100.available()[0], reason="needs an SM100 GPU and flash-attn-4"
)


def _gpu_inputs(T, H, S, topk, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(T, H, D_QK, generator=g).to("cuda", torch.bfloat16)
    kv = torch.randn(S, D_QK, generator=g).to("cuda", torch.bfloat16)
    indices = torch.randint(0, S, (T, topk), generator=g, dtype=torch.int32)
    indices[1::3, ::4] = -1
    indices[2::5, 1::5] = S + 7  # out of range: an empty slot
    indices[0] = -1  # a row with no valid slot
    topk_length = torch.randint(1, topk + 1, (T,), generator=g, dtype=torch.int32)
    return q, kv, indices.cuda(), topk_length.cuda()


@pytest.mark.cuda
@sm100_gpu
@pytest.mark.parametrize("T", [32, 96])  # with 16 heads: FA4's 2-CTA, then its 1-CTA kernel
@pytest.mark.parametrize("H", [16, 128])
@pytest.mark.parametrize(
    "threshold,return_o_lo", [(0.0, True), (8.0, False), (8.0, True), (0.0, False)]
)
def test_forward_values_on_sm100(T, H, threshold, return_o_lo):
    S, topk = 333, 200
    q, kv, indices, topk_length = _gpu_inputs(T, H, S, topk)
    scale = D_QK**-0.5
    out, lse, o_lo, _ = sm100.forward(q, kv, indices, topk_length, None, None, scale, D_V,
                                      threshold, return_o_lo, False)
    ref_out, ref_lse = reference_sparse_mla_fp64(q, kv, indices, topk_length, scale, D_V)
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32
    assert rel_l2(out, ref_out) < 1e-2
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), finite)
    assert (lse[finite].double() - ref_lse[finite]).abs().max().item() < 1e-2
    assert torch.all(out[0] == 0) and torch.all(lse[0] == -math.inf)
    if return_o_lo:
        assert o_lo.shape == out.shape and o_lo.dtype == out.dtype
        assert torch.all(o_lo.abs() <= out.float().abs() * 2**-8)  # a rounding residual of out
        assert rel_l2(out.double() + o_lo.double(), ref_out) < 0.75 * rel_l2(out, ref_out)
    else:
        assert o_lo.numel() == 0


@pytest.mark.cuda
@sm100_gpu
@pytest.mark.parametrize("H", [16, 128])
def test_backward_values_on_sm100(H):
    T, S, topk = 96, 333, 200
    q, kv, indices, topk_length = _gpu_inputs(T, H, S, topk, seed=1)
    scale = D_QK**-0.5
    out, lse, o_lo, _ = sm100.forward(q, kv, indices, topk_length, None, None, scale, D_V, 0.0,
                                      True, False)
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(2)).to("cuda", out.dtype)
    dq, dkv, _ = sm100.backward(dout, None, q, kv, indices, topk_length, None, None, out, lse,
                                o_lo, scale, D_V)
    q64 = q.double().requires_grad_()
    kv64 = kv.double().requires_grad_()
    ref_out, _ = reference_sparse_mla_fp64(q64, kv64, indices, topk_length, scale, D_V)
    ref_dq, ref_dkv = torch.autograd.grad(ref_out, (q64, kv64), dout.double())
    assert dq.shape == q.shape and dq.dtype == q.dtype and dq.is_contiguous()
    assert dkv.shape == kv.shape and dkv.dtype == kv.dtype and dkv.is_contiguous()
    assert rel_l2(dq, ref_dq) < 2e-2
    assert rel_l2(dkv, ref_dkv) < 2e-2
    assert torch.all(dq[0] == 0)  # the row with no valid slot
