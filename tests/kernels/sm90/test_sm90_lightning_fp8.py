"""GPU tests of the Hopper lightning indexer in fp8: the score kernel's float8_e4m3fn variant
(mla_inductor.kernels.sm90.lightning_every_key) and its composition with the top-k select
(kernels.sm90.lightning_indexer_host), with the test helpers of test_sm90_lightning.

Every check compares against float64 scores of the definition on the fp8 values and their
float32 scales, ``sum_h weights[t, h] * relu(q_scale[t, h] * k_scale[s] * (q[t, h] . k[s]))``,
within ``test_sm90_lightning.FP8_REL_TOL`` of ``sum_h |weights[t, h]| |q_scale[t, h] k_scale[s]|
(|q[t, h]| . |k[s]|)``: the e4m3 products are exact, and Hopper's fp8 tensor cores sum them with
about 14 bits (cuDNN frontend's fp8 indexer is off float64 by the same amount).
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch

from mla_inductor import lightning_indexer, quantize_fp8, use_backend
from mla_inductor.kernels import sm90
from test_sm90_lightning import D, _check_chunk, _check_selection, _row_len, _run_scores

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not sm90.available()[0], reason=sm90.available()[1] or "no sm90"),
]

FP8 = torch.float8_e4m3fn


def _inputs(B, T, S, H, positions="none", seed=0):
    """``(q8, k8, weights, q_positions, (q_scale, k_scale))``: normal q and k quantised per row
    by quantize_fp8 (scales about 2**-7), weights ``H**-0.5``-scaled normals; positions as in
    test_sm90_lightning (``"random"``: from -3 to S + 2, some rows seeing no key)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(B, T, H, D, device="cuda", generator=g)
    k = torch.randn(B, S, D, device="cuda", generator=g)
    w = torch.randn(B, T, H, device="cuda", generator=g) * H ** -0.5
    q8, q_scale = quantize_fp8(q)
    k8, k_scale = quantize_fp8(k)
    if positions == "none":
        pos = None
    elif positions == "bottom_right":
        pos = (S - T + torch.arange(T, device="cuda", dtype=torch.int32)).expand(B, T).contiguous()
    else:
        pos = torch.randint(-3, S + 3, (B, T), device="cuda", dtype=torch.int32, generator=g)
    return q8, k8, w, pos, (q_scale, k_scale)


def _visible(pos, B, T, S):
    return torch.arange(S, device="cuda")[None] < _row_len(pos, B, T, S)[:, None]


@pytest.mark.parametrize("B,T,S,H,positions", [
    (1, 4096, 4096, 64, "random"),  # DeepSeek-V3.2's heads, negative positions included
    (1, 3000, 4096, 64, "bottom_right"),
    (2, 2048, 2048, 32, "none"),
    (2, 129, 200, 13, "random"),  # T not a multiple of the tile, padded heads
    (1, 1, 20000, 16, "bottom_right"),  # one token: the keys are split
])
def test_scores_match_float64(B, T, S, H, positions):
    q8, k8, w, pos, scales = _inputs(B, T, S, H, positions)
    buf = _run_scores(q8, k8, w, pos, extra_ld=4 if S % 4 else 0, scales=scales)
    _check_chunk(q8, k8, w, pos, buf, 0, 0, T, B, scales=scales)


def test_chunks_of_rows():
    """A chunk of whole batch elements and a token range of one batch element."""
    q8, k8, w, pos, scales = _inputs(3, 50, 70, 64, "bottom_right", seed=1)
    buf = _run_scores(q8, k8, w, pos, b0=1, scales=scales)
    _check_chunk(q8, k8, w, pos, buf, 1, 0, 50, 2, scales=scales)
    q8, k8, w, pos, scales = _inputs(2, 1000, 1000, 64, "bottom_right", seed=2)
    buf = _run_scores(q8, k8, w, pos, b0=1, t0=300, n_tok=500, n_batch=1, scales=scales)
    _check_chunk(q8, k8, w, pos, buf, 1, 300, 500, 1, scales=scales)


def test_the_scales_apply_before_the_relu():
    """Negative scales (a third of q_scale, a quarter of k_scale) flip which dots the relu
    keeps: a kernel that scaled after the relu, or dropped a scale, is off by whole terms."""
    q8, k8, w, pos, (qs, ks) = _inputs(1, 600, 900, 64, "bottom_right", seed=3)
    g = torch.Generator(device="cuda").manual_seed(4)
    qs = torch.where(torch.rand(qs.shape, device="cuda", generator=g) < 1 / 3, -qs, qs)
    ks = torch.where(torch.rand(ks.shape, device="cuda", generator=g) < 1 / 4, -ks, ks)
    buf = _run_scores(q8, k8, w, pos, scales=(qs, ks))
    _check_chunk(q8, k8, w, pos, buf, 0, 0, 600, 1, scales=(qs, ks))


def test_reruns_are_bitwise_identical_and_nan_shows():
    B, T, S = 1, 700, 900
    q8, k8, w, pos, (qs, ks) = _inputs(B, T, S, 64, "bottom_right", seed=5)
    visible = _visible(pos, B, T, S)
    a = _run_scores(q8, k8, w, pos, scales=(qs, ks)).masked_fill(~visible, 0)
    b = _run_scores(q8, k8, w, pos, scales=(qs, ks)).masked_fill(~visible, 0)
    assert torch.equal(a, b)
    qs, ks = qs.clone(), ks.clone()
    qs[0, 5, 3] = math.nan  # row 5: every key
    ks[0, 7] = math.nan  # key 7: every row that sees it
    c = _run_scores(q8, k8, w, pos, scales=(qs, ks))
    assert torch.isnan(c[5][visible[5]]).all()
    assert torch.isnan(c[:, 7][visible[:, 7]]).all()
    clean = visible.clone()
    clean[5], clean[:, 7] = False, False
    assert not torch.isnan(c[clean]).any()


def test_an_infinite_weight_scores_as_the_definition():
    """A token with an infinite weight at 64 heads: +inf where that head's dot is positive and
    NaN where it is not (``inf * relu(x)``), as the definition gives; the kernel's split of the
    relu (its linear term) would make the whole row NaN, so such a tile takes the definition's
    order. The other rows stay finite."""
    B, T, S = 1, 700, 900
    q8, k8, w, pos, (qs, ks) = _inputs(B, T, S, 64, "bottom_right", seed=6)
    visible = _visible(pos, B, T, S)
    w = w.clone()
    w[0, 5, 3] = math.inf
    c = _run_scores(q8, k8, w, pos, scales=(qs, ks))
    dot = (k8[0].double() @ q8[0, 5, 3].double()) * qs[0, 5, 3].double() * ks[0].double()
    row, positive = c[5][visible[5]], (dot > 0)[visible[5]]
    assert positive.any() and (~positive).any()
    assert torch.equal(row[positive], torch.full_like(row[positive], math.inf))
    assert torch.isnan(row[~positive]).all()
    clean = visible.clone()
    clean[5] = False
    assert torch.isfinite(c[clean]).all()


@pytest.mark.parametrize("positions", ["random", "none", "bottom_right"])
def test_indexer_matches_definition(positions):
    from mla_inductor.kernels.sm90 import lightning_indexer_host as host

    q8, k8, w, pos, (qs, ks) = _inputs(2, 2048, 2048, 64, positions, seed=6)
    # a budget of 300 rows: several chunks per batch element
    indices, scores = host.lightning_indexer(q8, k8, w, pos, 256, q_scale=qs, k_scale=ks,
                                             buffer_bytes=300 * 2048 * 4)
    _check_selection(q8, k8, w, pos, 256, indices, scores, scales=(qs, ks))
    again = sm90.lightning_indexer(q8, k8, w, pos, 256, q_scale=qs, k_scale=ks)  # one chunk
    assert torch.equal(again[0], indices) and torch.equal(again[1], scores)


def test_indexer_without_q_scale_is_q_scale_one():
    """The op resolves ``q_scale=None`` to ones (the kernel always takes a scale): on the kernel,
    bitwise the selection and scores of explicit ones, and the definition's."""
    q8, k8, w, pos, (_, ks) = _inputs(1, 500, 700, 40, "bottom_right", seed=7)
    ones = torch.ones(q8.shape[:3], device="cuda")
    with use_backend("sm90"):
        got = lightning_indexer(q8, k8, w, 64, causal=True, q_positions=pos, return_scores=True,
                                k_scale=ks)
        want = lightning_indexer(q8, k8, w, 64, causal=True, q_positions=pos,
                                 return_scores=True, q_scale=ones, k_scale=ks)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    _check_selection(q8, k8, w, pos, 64, *got, scales=(None, ks))


def test_indexer_cuda_graph_replay():
    from mla_inductor.kernels.sm90 import lightning_indexer_host as host

    q8, k8, w, pos, (qs, ks) = _inputs(2, 1000, 1200, 32, "bottom_right", seed=8)
    q2, k2, w2, _, (qs2, ks2) = _inputs(2, 1000, 1200, 32, seed=9)
    budget = 300 * 1200 * 4
    host.lightning_indexer(q8, k8, w, pos, 256, q_scale=qs, k_scale=ks,
                           buffer_bytes=budget)  # compiles outside capture
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        out = host.lightning_indexer(q8, k8, w, pos, 256, q_scale=qs, k_scale=ks,
                                     buffer_bytes=budget)
    torch.cuda.current_stream().wait_stream(stream)
    for dst, src in ((q8, q2), (k8, k2), (w, w2), (qs, qs2), (ks, ks2)):
        dst.copy_(src)
    graph.replay()
    expect = host.lightning_indexer(q2, k2, w2, pos, 256, q_scale=qs2, k_scale=ks2,
                                    buffer_bytes=budget)
    assert torch.equal(out[0], expect[0]) and torch.equal(out[1], expect[1])


@pytest.mark.parametrize("backend,with_q_scale", [("sm90", True), ("sm90", False),
                                                   ("auto", True)])
def test_the_op_runs_fp8_on_the_kernel(backend, with_q_scale):
    """The public op under ``use_backend(backend)`` (``auto`` chooses the kernel): no error, no
    fallback warning, the definition's selection (flat layout, causal with the default
    bottom-right positions)."""
    q8, k8, w, _, (qs, ks) = _inputs(1, 1500, 1800, 64, seed=10)
    qs = qs if with_q_scale else None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with use_backend(backend):
            indices, scores = lightning_indexer(q8[0], k8[0], w[0], 512, causal=True,
                                                return_scores=True, q_scale=None if qs is None
                                                else qs[0], k_scale=ks[0])
    pos = (1800 - 1500 + torch.arange(1500, device="cuda", dtype=torch.int32))[None]
    _check_selection(q8, k8, w, pos, 512, indices[None], scores[None], scales=(qs, ks))
