"""GPU tests of the Hopper indexer-target kernel (mla_inductor.kernels.sm90.indexer_target_kernel).

Every check compares against a float64 target written here from the definition (the head-summed
``exp(sm_scale * q . k - lse)`` on valid slots, L1-normalised over the row's valid slots), with
the same fp32 lse the kernel gets.
"""

from __future__ import annotations

import math

import pytest
import torch

import mla_inductor
from mla_inductor.kernels import sm90

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not sm90.available()[0], reason=sm90.available()[1] or "no sm90"),
]

RTOL, ATOL = 1e-4, 1e-7


def _valid(indices, S, topk_length=None, q_positions=None):
    idx = indices.long()
    valid = (idx >= 0) & (idx < S)
    if topk_length is not None:
        valid &= torch.arange(idx.shape[1], device=idx.device)[None] < topk_length.long()[:, None]
    if q_positions is not None:
        valid &= idx <= q_positions.long()[:, None]
    return valid


def _scores_fp64(q, kv, indices, valid, sm_scale):
    """``[T, H, topk]`` float64 scores; empty slots -inf (their rows are never looked at)."""
    rows = torch.where(valid, indices.long(), 0)
    keys = torch.where(valid[..., None], kv.double()[rows], 0.0)
    s = torch.einsum("thd,tkd->thk", q.double(), keys) * sm_scale
    return s.masked_fill(~valid[:, None, :], -math.inf)


def lse_fp64(q, kv, indices, sm_scale, topk_length=None, q_positions=None):
    """The forward's lse in float64 (-inf on a row without a valid slot)."""
    valid = _valid(indices, kv.shape[0], topk_length, q_positions)
    return torch.logsumexp(_scores_fp64(q, kv, indices, valid, sm_scale), dim=-1)


def target_fp64(q, kv, indices, lse, sm_scale, topk_length=None, q_positions=None):
    """The definition in float64: ``w = sum_h exp(s - lse)`` on valid slots, 0 elsewhere;
    ``w / sum(w)`` on valid slots of a row whose sum is not 0, else 0."""
    valid = _valid(indices, kv.shape[0], topk_length, q_positions)
    s = _scores_fp64(q, kv, indices, valid, sm_scale)
    w = torch.where(valid, torch.exp(s - lse.double()[..., None]).sum(1), 0.0)
    total = w.sum(-1, keepdim=True)
    return torch.where(valid & (total != 0), w / total, 0.0)


def _inputs(T, H, S, topk, d_qk=576, dtype=torch.bfloat16, seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    q = torch.randn(T, H, d_qk, generator=g).to("cuda", dtype)
    kv = torch.randn(S, d_qk, generator=g).to("cuda", dtype)
    indices = torch.randint(0, S, (T, topk), generator=g, dtype=torch.int32).cuda()
    return q, kv, indices


def _check(q, kv, indices, topk_length=None, q_positions=None, sm_scale=None, lse=None):
    sm_scale = q.shape[-1] ** -0.5 if sm_scale is None else sm_scale
    if lse is None:
        lse = lse_fp64(q, kv, indices, sm_scale, topk_length, q_positions).float()
    got = sm90.indexer_target(q, kv, indices, topk_length, q_positions, None, lse, sm_scale)
    torch.cuda.synchronize()
    want = target_fp64(q, kv, indices, lse, sm_scale, topk_length, q_positions)
    assert got.dtype == torch.float32 and got.shape == indices.shape and got.is_contiguous()
    torch.testing.assert_close(got.double(), want, rtol=RTOL, atol=ATOL, equal_nan=True)
    empty = ~_valid(indices, kv.shape[0], topk_length, q_positions)
    assert (got[empty] == 0).all() and not torch.signbit(got[empty]).any()
    return got, want


@pytest.mark.parametrize("H", [16, 64, 100, 128])
@pytest.mark.parametrize("topk", [1, 64, 200, 1000])
def test_heads_and_topk(H, topk):
    q, kv, indices = _inputs(T=6, H=H, S=3000, topk=topk, seed=H + topk)
    got, _ = _check(q, kv, indices)
    torch.testing.assert_close(got.sum(-1), torch.ones(6, device="cuda"), rtol=0, atol=1e-5)


@pytest.mark.parametrize("d_qk,dtype", [(576, torch.float16), (512, torch.bfloat16),
                                        (512, torch.float16)])
def test_widths_and_dtypes(d_qk, dtype):
    q, kv, indices = _inputs(T=5, H=64, S=500, topk=300, d_qk=d_qk, dtype=dtype, seed=d_qk)
    _check(q, kv, indices)


def test_invalid_and_duplicate_indices_are_never_read():
    """-1, S and 2**31 - 1 are empty slots: their rows (NaN where they exist) reach nothing;
    a duplicated index gets one entry per slot, each the same value."""
    T, H, S, topk = 4, 128, 256, 300
    q, kv, indices = _inputs(T, H, S, topk, seed=3)
    indices[:, 0:40:4] = -1
    indices[:, 1:40:4] = S
    indices[:, 2:40:4] = 2**31 - 1
    indices[:, 50:60] = 7  # duplicates
    kv[S - 1] = float("nan")  # named only by empty slots below
    indices = torch.where(indices == S - 1, -1, indices)
    indices[:, 70] = S - 1
    topk_length = torch.full((T,), 70, dtype=torch.int32, device="cuda")
    got, _ = _check(q, kv, indices, topk_length=topk_length)
    assert torch.isfinite(got).all()
    assert (got[:, 50:60] == got[:, 50:51]).all() and (got[:, 50] > 0).all()
    assert (got[:, 0:40:4] == 0).all() and (got[:, 70:] == 0).all()


def test_topk_length():
    T, H, S, topk = 8, 64, 1000, 257
    q, kv, indices = _inputs(T, H, S, topk, seed=4)
    topk_length = torch.tensor([0, 1, 63, 64, 65, 257, 10**6, -5], dtype=torch.int32,
                               device="cuda")
    got, _ = _check(q, kv, indices, topk_length=topk_length)
    assert (got[0] == 0).all() and (got[7] == 0).all()
    assert got[1, 0] == 1 and (got[1, 1:] == 0).all()
    torch.testing.assert_close(got[1:7].sum(-1), torch.ones(6, device="cuda"), rtol=0, atol=1e-5)


def test_causal_positions_and_poisoned_future_rows():
    """A slot naming a key past the token's position is empty and never read: every future
    key row is NaN here."""
    T, H, S, topk = 16, 128, 512, 150
    q, kv, indices = _inputs(T, H, S, topk, seed=5)
    q_positions = torch.arange(T, dtype=torch.int32, device="cuda") * 20 + 100
    future = torch.arange(S, device="cuda") > q_positions.max()
    kv[future] = float("nan")
    got, _ = _check(q, kv, indices, q_positions=q_positions)
    assert torch.isfinite(got).all()


def test_all_empty_rows_and_a_zero_sum_row():
    T, H, S, topk = 3, 16, 100, 130
    q, kv, indices = _inputs(T, H, S, topk, seed=6)
    indices[0] = -1
    lse = lse_fp64(q, kv, indices, 576**-0.5).float()
    lse[2] = float("inf")  # every w of row 2 is exactly 0
    got, _ = _check(q, kv, indices, lse=lse)
    assert (got[0] == 0).all() and (got[2] == 0).all()
    assert abs(got[1].sum().item() - 1) < 1e-5


def test_nan_propagates_to_the_valid_slots_of_its_row():
    """A NaN in q (row 1) or in lse (row 2, one head) makes the row's valid slots NaN, as the
    reference; empty slots stay 0 and the other rows are untouched."""
    T, H, S, topk = 4, 64, 300, 100
    q, kv, indices = _inputs(T, H, S, topk, seed=7)
    indices[:, :10] = -1
    lse = lse_fp64(q, kv, indices, 576**-0.5).float()
    q[1, 3, 17] = float("nan")
    lse[2, 5] = float("nan")
    got, _ = _check(q, kv, indices, lse=lse)
    assert got[1:3, 10:].isnan().all() and (got[1:3, :10] == 0).all()
    assert torch.isfinite(got[[0, 3]]).all()


def test_through_the_op_on_auto():
    """``mla_inductor.indexer_target`` picks the kernel on auto (no fallback warning) with the
    lse of the sm90 forward, causal and with a sink."""
    import warnings

    T, H, S, topk = 32, 128, 400, 192
    q, kv, indices = _inputs(T, H, S, topk, seed=8)
    sink = torch.randn(H, device="cuda")
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # the fallback warning
        _, lse = mla_inductor.sparse_mla(q, kv, indices, causal=True, attn_sink=sink,
                                         return_lse=True)
        got = mla_inductor.indexer_target(q, kv, indices, lse, causal=True, attn_sink=sink)
    positions = torch.arange(T, dtype=torch.int32, device="cuda") + (S - T)
    want = target_fp64(q, kv, indices, lse, 576**-0.5, q_positions=positions)
    torch.testing.assert_close(got.double(), want, rtol=RTOL, atol=ATOL)


def test_more_heads_than_the_kernel_takes():
    """A forced sm90 refuses them by the op's name (auto runs the reference)."""
    q, kv, indices = _inputs(T=2, H=129, S=64, topk=64)
    lse = torch.zeros(2, 129, device="cuda")
    with mla_inductor.use_backend("sm90"), pytest.raises(
            RuntimeError, match="^indexer_target: mla_inductor backend 'sm90' cannot run here: "
                                "sm90 indexer target supports at most 128 heads, got 129"):
        mla_inductor.indexer_target(q, kv, indices, lse)


def test_deepseek_size_against_fp64_on_sampled_tokens():
    """T = S = 4096, H 128, topk 2048 with the forward's lse: fp64 on 48 sampled tokens, and
    every row sums to 1."""
    T = S = 4096
    H, topk, sm_scale = 128, 2048, 576**-0.5
    q, kv, indices = _inputs(T, H, S, topk, seed=9)
    _, lse, _, _ = sm90.forward(q, kv, indices, None, None, None, sm_scale, 512, 0.0, False,
                                False)
    got = sm90.indexer_target(q, kv, indices, None, None, None, lse, sm_scale)
    torch.cuda.synchronize()
    torch.testing.assert_close(got.sum(-1), torch.ones(T, device="cuda"), rtol=0, atol=1e-4)
    rows = torch.randperm(T, generator=torch.Generator().manual_seed(0))[:48].cuda()
    want = target_fp64(q[rows], kv, indices[rows], lse[rows], sm_scale)
    torch.testing.assert_close(got[rows].double(), want, rtol=RTOL, atol=ATOL)
