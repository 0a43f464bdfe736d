"""GPU tests of the Hopper lightning indexer: the score kernel (mla_inductor.kernels.sm90.
lightning) and its composition with the top-k select (kernels.sm90.lightning_indexer_host).

Every check compares against float64 scores written here from the definition,
``sum_h weights[t, h] * relu(q[t, h] . k[s])`` over the keys a row sees, with an error bound
relative to ``sum_h |weights[t, h]| |q[t, h] . k[s]|`` (fp32 accumulation of exact bf16/fp16
products: a wrong head, weight or key is off by far more). In fp8 the bound is the products'
magnitudes, ``sum_h |weights[t, h]| |q_scale[t, h] k_scale[s]| (|q[t, h]| . |k[s]|)``, and the
tolerance :data:`FP8_REL_TOL`.
"""

from __future__ import annotations

import math

import pytest
import torch

from mla_inductor.kernels import sm90

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not sm90.available()[0], reason=sm90.available()[1] or "no sm90"),
]

D = 128
REL_TOL = 2e-5
# Hopper's fp8 tensor cores keep about 14 bits of the running sum (DeepSeek-AI, "DeepSeek-V3
# Technical Report", 2024, section 3.3.2): 2**-13 of the products' magnitudes. Measured on an H100
# (2026-12-06): 2.2e-5 and 3.2e-5 of it at 64 and 32 heads for this kernel and cuDNN frontend's fp8
# indexer alike (1.8e-4 and 2.6e-4 of the |dot| bound that bf16 meets within 2e-5).
FP8_REL_TOL = 2**-13


def rel_tol(q):
    """The tolerance for q's dtype, relative to :func:`scores_fp64`'s bound."""
    return FP8_REL_TOL if q.dtype == torch.float8_e4m3fn else REL_TOL


def _inputs(B, T, S, H, dtype=torch.bfloat16, positions="none", seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(B, T, H, D, device="cuda", generator=g).to(dtype)
    k = torch.randn(B, S, D, device="cuda", generator=g).to(dtype)
    w = torch.randn(B, T, H, device="cuda", generator=g) * H ** -0.5
    if positions == "none":
        pos = None
    elif positions == "bottom_right":
        pos = (S - T + torch.arange(T, device="cuda", dtype=torch.int32)).expand(B, T).contiguous()
    else:  # random, some rows seeing nothing and some everything
        pos = torch.randint(-3, S + 3, (B, T), device="cuda", dtype=torch.int32, generator=g)
    return q, k, w, pos


def _row_len(pos, B, T, S):
    from mla_inductor.kernels.sm90.lightning_indexer_host import row_lengths

    return row_lengths(pos, B, T, S, torch.device("cuda"))


def scores_fp64(q, k, w, b, ts, q_scale=None, k_scale=None):
    """``(scores [n, S], bound [n, S])`` in float64 for tokens ``ts`` of batch element b (fp8 q
    and k: each dot times ``q_scale [B, T, H]`` and ``k_scale [B, S]`` before the relu, and the
    bound over the products' magnitudes: the module docstring)."""
    qd, kd = q[b, ts].double(), k[b].double()
    dots = torch.einsum("nhd,sd->nhs", qd, kd)
    magnitudes = (torch.einsum("nhd,sd->nhs", qd.abs(), kd.abs())
                  if q.dtype == torch.float8_e4m3fn else dots.abs())
    scale = 1.0
    if q_scale is not None:
        scale = scale * q_scale[b, ts].double()[..., None]
    if k_scale is not None:
        scale = scale * k_scale[b].double()
    dots = dots * scale
    wd = w[b, ts].double()[..., None]
    bound = (magnitudes * torch.as_tensor(scale, dtype=torch.float64).abs() * wd.abs()).sum(1)
    return (torch.relu(dots) * wd).sum(1), bound


def _check_chunk(q, k, w, pos, buf, b0, t0, n_tok, n_batch, rows_per_ref=256,
                 scales=(None, None)):
    B, T, H, _ = q.shape
    S = k.shape[1]
    row_len = _row_len(pos, B, T, S)
    for bi in range(n_batch):
        b = b0 + bi
        for c in range(t0, t0 + n_tok, rows_per_ref):
            ts = torch.arange(c, min(c + rows_per_ref, t0 + n_tok), device="cuda")
            ref, bound = scores_fp64(q, k, w, b, ts, *scales)
            got = buf[bi * n_tok + ts - t0, :S].double()
            visible = (torch.arange(S, device="cuda")[None]
                       < row_len[b * T + ts].long()[:, None])
            assert not (torch.isnan(got) & visible).any(), "a visible score was not written"
            err = torch.where(visible, (got - ref).abs() / (bound + 1e-30), 0.0)
            assert err.max().item() < rel_tol(q)


def _run_scores(q, k, w, pos, b0=0, t0=0, n_tok=None, n_batch=None, extra_ld=0,
                scales=(None, None)):
    from mla_inductor.kernels.sm90 import lightning_every_key_host

    B, T = q.shape[:2]
    S = k.shape[1]
    n_tok = T - t0 if n_tok is None else n_tok
    n_batch = B - b0 if n_batch is None else n_batch
    buf = torch.full((n_tok * n_batch, -(-S // 4) * 4 + extra_ld), math.nan, device="cuda")
    row_len = _row_len(pos, B, T, S) if pos is not None else None
    lightning_every_key_host.scores(q, k, w, row_len, buf, b0, t0, n_tok, n_batch, *scales)
    return buf


@pytest.mark.parametrize("B,T,S,H,dtype,positions", [
    (1, 4096, 4096, 64, torch.bfloat16, "bottom_right"),  # DeepSeek-V3.2's heads
    (1, 2048, 4096, 32, torch.float16, "none"),  # GLM-5's heads
    (2, 129, 200, 13, torch.bfloat16, "random"),  # T not a multiple of the tile, padded heads
    (2, 77, 333, 64, torch.float16, "none"),
    (1, 1, 20000, 16, torch.bfloat16, "bottom_right"),  # one token: the keys are split
])
def test_scores_match_float64(B, T, S, H, dtype, positions):
    q, k, w, pos = _inputs(B, T, S, H, dtype, positions)
    buf = _run_scores(q, k, w, pos, extra_ld=4 if S % 4 else 0)
    _check_chunk(q, k, w, pos, buf, 0, 0, T, B)


def test_chunks_of_rows():
    """A chunk of whole batch elements and a token range of one batch element."""
    q, k, w, pos = _inputs(3, 50, 70, 64, positions="bottom_right", seed=1)
    _check_chunk(q, k, w, pos, _run_scores(q, k, w, pos, b0=1), 1, 0, 50, 2)
    q, k, w, pos = _inputs(2, 1000, 1000, 64, positions="bottom_right", seed=2)
    buf = _run_scores(q, k, w, pos, b0=1, t0=300, n_tok=500, n_batch=1)
    _check_chunk(q, k, w, pos, buf, 1, 300, 500, 1)


def test_offsets_past_2_31():
    """T = S = 131072, B = 2: q's element offsets of batch element 1 pass 2**31."""
    T = 131072
    q, k, w, pos = _inputs(2, T, T, 64, positions="bottom_right", seed=3)
    buf = _run_scores(q, k, w, pos, b0=1, t0=T - 64, n_tok=64, n_batch=1)
    _check_chunk(q, k, w, pos, buf, 1, T - 64, 64, 1, rows_per_ref=8)


def test_reruns_are_bitwise_identical_and_nan_shows():
    q, k, w, pos = _inputs(1, 700, 900, 64, positions="bottom_right", seed=4)
    visible = torch.arange(900, device="cuda")[None] < _row_len(pos, 1, 700, 900)[:, None]
    a = _run_scores(q, k, w, pos).masked_fill(~visible, 0)
    b = _run_scores(q, k, w, pos).masked_fill(~visible, 0)
    assert torch.equal(a, b)
    q[0, 5, 3, 7] = math.nan
    c = _run_scores(q, k, w, pos)
    assert torch.isnan(c[5][visible[5]]).all()
    assert not torch.isnan(c[6][visible[6]]).any()


def _check_selection(q, k, w, pos, topk, indices, scores, scales=(None, None)):
    B, T, _, _ = q.shape
    S = k.shape[1]
    row_len = _row_len(pos, B, T, S).view(B, T).long()
    slot = torch.arange(topk, device="cuda")[None]
    for b in range(B):
        ref, bound = scores_fp64(q, k, w, b, torch.arange(T, device="cuda"), *scales)
        lens = row_len[b]
        filled = slot < lens.clamp(max=topk)[:, None]
        idx = indices[b].long()
        assert torch.equal(idx >= 0, filled)
        assert ((idx < lens[:, None]) | ~filled).all()
        assert ((idx[:, 1:] > idx[:, :-1]) | ~filled[:, 1:]).all()  # ascending key index
        got = torch.gather(ref, 1, idx.clamp(min=0))
        err = (scores[b].double() - got).abs() / (torch.gather(bound, 1, idx.clamp(min=0)) + 1e-30)
        assert torch.where(filled, err, 0.0).max().item() < rel_tol(q)
        assert (scores[b][~filled] == 0).all()
        if topk > S:
            continue
        # the selected keys are the top ones up to the fp32 rounding of the scores
        visible = torch.arange(S, device="cuda")[None] < lens[:, None]
        kth = torch.topk(ref.masked_fill(~visible, -math.inf), topk, dim=1).values[:, -1]
        lowest = got.masked_fill(~filled, math.inf).min(1).values
        full = lens >= topk
        gap = (kth - lowest)[full] / bound.max(1).values[full]
        assert gap.numel() == 0 or gap.max().item() < rel_tol(q)


@pytest.mark.parametrize("positions", ["bottom_right", "none", "random"])
def test_indexer_matches_definition(positions):
    from mla_inductor.kernels.sm90 import lightning_indexer_host as host

    q, k, w, pos = _inputs(2, 1000, 1200, 64, positions=positions, seed=5)
    # a budget of 300 rows: several chunks per batch element
    indices, scores = host.lightning_indexer(q, k, w, pos, 256, buffer_bytes=300 * 1200 * 4)
    _check_selection(q, k, w, pos, 256, indices, scores)
    again = sm90.lightning_indexer(q, k, w, pos, 256)  # the default budget: one chunk
    assert torch.equal(again[0], indices) and torch.equal(again[1], scores)


def test_indexer_cuda_graph_replay():
    from mla_inductor.kernels.sm90 import lightning_indexer_host as host

    q, k, w, pos = _inputs(2, 1000, 1200, 32, positions="bottom_right", seed=6)
    q2, k2, w2, _ = _inputs(2, 1000, 1200, 32, seed=7)
    budget = 300 * 1200 * 4
    host.lightning_indexer(q, k, w, pos, 256, buffer_bytes=budget)  # compiles outside capture
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        out = host.lightning_indexer(q, k, w, pos, 256, buffer_bytes=budget)
    torch.cuda.current_stream().wait_stream(stream)
    q.copy_(q2), k.copy_(k2), w.copy_(w2)
    graph.replay()
    expect = host.lightning_indexer(q2, k2, w2, pos, 256, buffer_bytes=budget)
    assert torch.equal(out[0], expect[0]) and torch.equal(out[1], expect[1])


def test_indexer_edge_sizes():
    q, k, w, pos = _inputs(1, 5, 3, 8, positions="bottom_right", seed=8)
    indices, scores = sm90.lightning_indexer(q, k, w, pos, 4)  # topk > S
    _check_selection(q, k, w, pos, 4, indices, scores)
    indices, scores = sm90.lightning_indexer(q, k, w, pos, 0)
    assert indices.shape == (1, 5, 0) and scores.shape == (1, 5, 0)
    indices, scores = sm90.lightning_indexer(q, k[:, :0], w, None, 3)
    assert (indices == -1).all() and (scores == 0).all()
