"""GPU tests of the Hopper top-k select (mla_inductor.kernels.sm90.topk): bit-for-bit against a
reference of the selection rules written here with stable sorts (a NaN above +inf, -0.0 equal
to +0.0, exact ties to the smaller key index, ascending key index then -1, the slot's score then
0), reruns bitwise identical, CUDA-graph replay, and the launcher's checks."""

from __future__ import annotations

import pytest
import torch


def reference_select(buf, row_len, topk):
    """``(indices [R, topk] int32, scores [R, topk] float32)`` of the rules, from three stable
    sorts (lowest priority first): score descending (NaN and -0.0 read as 0 and +0.0 here),
    NaN first, in-row first; then the first ``min(topk, n)`` keys in ascending index order.
    Works on any device; rows are independent."""
    R, ld = buf.shape
    n = row_len.long().clamp(0, ld)
    col = torch.arange(ld, device=buf.device)
    valid = col[None, :] < n[:, None]
    nan = torch.isnan(buf) & valid
    value = torch.where(valid & ~nan, buf, 0.0).double()
    value = torch.where(value == 0, 0.0, value)  # -0.0 == +0.0
    order = torch.sort(value, dim=1, descending=True, stable=True).indices
    for flag in (nan, valid):
        perm = torch.sort(flag.gather(1, order).int(), dim=1, descending=True, stable=True).indices
        order = order.gather(1, perm)
    width = min(topk, ld)
    take = order[:, :width]
    slots = torch.arange(width, device=buf.device)[None, :] < torch.clamp(n, max=topk)[:, None]
    big = torch.iinfo(torch.int64).max
    take = torch.sort(torch.where(slots, take, big), dim=1).values
    idx = torch.full((R, topk), -1, dtype=torch.int64, device=buf.device)
    idx[:, :width] = torch.where(take == big, -1, take)
    if ld == 0:
        return idx.int(), torch.zeros(R, topk, device=buf.device)
    scores = torch.where(idx >= 0, buf.gather(1, idx.clamp(min=0)), 0.0)
    return idx.int(), scores


def _rows(kind, R, ld, seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    if kind == "randn":
        x = torch.randn(R, ld, generator=g)
    elif kind == "zeros":
        x = torch.zeros(R, ld)
    elif kind == "small_set":  # many exact ties
        x = torch.randint(-3, 4, (R, ld), generator=g).float() * 0.5
    elif kind == "signed_zeros":
        x = torch.where(torch.rand(R, ld, generator=g) < 0.5, -0.0, 0.0)
    elif kind == "relu":
        x = torch.relu(torch.randn(R, ld, generator=g))
    elif kind == "narrow":  # one exponent: only the low digits separate the scores
        x = 1.0 + torch.randint(0, 4096, (R, ld), generator=g).float() * 2.0**-23
    elif kind == "nonfinite":
        x = torch.randn(R, ld, generator=g)
        x[:, ::7] = float("inf")
        x[:, ::11] = float("nan")
        x[:, ::13] = -float("inf")
        bits = x.view(torch.int32)
        bits[:, 5::17] = -0x400001  # a negative NaN with a payload
        x[:, 3::19] = -0.0
    else:
        raise AssertionError(kind)
    return x.to(device)


def _check(buf, row_len, topk, reruns=1):
    from mla_inductor.kernels.sm90 import topk_host

    R = buf.shape[0]
    idx = torch.full((R, topk), 12345, dtype=torch.int32, device=buf.device)
    scores = torch.full((R, topk), 7.0, device=buf.device)
    topk_host.select(buf, row_len, topk, idx, scores)
    ref_idx, ref_scores = reference_select(buf, row_len, topk)
    assert torch.equal(idx, ref_idx)
    assert torch.equal(scores.view(torch.int32), ref_scores.view(torch.int32))
    for _ in range(reruns):
        idx2, scores2 = torch.empty_like(idx), torch.empty_like(scores)
        topk_host.select(buf, row_len, topk, idx2, scores2)
        assert torch.equal(idx2, idx)
        assert torch.equal(scores2.view(torch.int32), scores.view(torch.int32))


def test_reference_rules_by_hand():
    buf = torch.tensor([[1.0, float("nan"), 3.0, 3.0, float("inf"), -0.0, 0.0, 2.0]])
    idx, scores = reference_select(buf, torch.tensor([8], dtype=torch.int32), 4)
    assert idx.tolist() == [[1, 2, 3, 4]]  # NaN, inf, the two 3.0s
    idx, _ = reference_select(buf, torch.tensor([8], dtype=torch.int32), 3)
    assert idx.tolist() == [[1, 2, 4]]  # the 3.0 at the smaller index
    buf = torch.tensor([[0.0, -0.0, 0.0, -1.0]])
    idx, scores = reference_select(buf, torch.tensor([4], dtype=torch.int32), 2)
    assert idx.tolist() == [[0, 1]] and scores.view(torch.int32).tolist() == [[0, -2**31]]
    idx, scores = reference_select(buf, torch.tensor([2], dtype=torch.int32), 3)
    assert idx.tolist() == [[0, 1, -1]] and scores.tolist() == [[0.0, 0.0, 0.0]]


cuda = pytest.mark.cuda


@pytest.fixture(params=["default", "short rows"])
def config(request, monkeypatch):
    """The select's two tuned configurations ``(num_threads, cache_elems, cand_elems,
    min_blocks)``, the launcher's choice pinned to one of them (it picks by row length)."""
    from mla_inductor.kernels.sm90 import topk_host

    cfg = topk_host.TUNED_CONFIGS[0 if request.param == "default" else 1]
    monkeypatch.setattr(topk_host, "default_key",
                        lambda ld, arch="sm_90a": topk_host.compile_key(*cfg, arch=arch))
    return cfg


def _sm90_or_skip():
    from mla_inductor.kernels import sm90

    ok, why = sm90.available()
    if not ok:
        pytest.skip(why)


@cuda
@pytest.mark.parametrize("kind", ["randn", "zeros", "small_set", "signed_zeros", "relu",
                                  "narrow", "nonfinite"])
@pytest.mark.parametrize("topk", [1, 5, 300, 2048, 4096])
def test_select_matches_reference(kind, topk, config):
    _sm90_or_skip()
    R, ld = 40, 3000
    buf = _rows(kind, R, ld, seed=topk, device="cuda")
    g = torch.Generator().manual_seed(topk + 1)
    row_len = torch.randint(0, ld + 1, (R,), generator=g, dtype=torch.int32)
    row_len[:8] = torch.tensor([0, 1, topk - 1, topk, topk + 1, ld, -5, ld + 100])
    _check(buf, row_len.cuda(), topk, reruns=1)


@cuda
@pytest.mark.parametrize("kind", ["randn", "small_set", "narrow", "nonfinite"])
def test_long_rows(kind, config):
    """Rows re-read from global memory, with their bitmaps in the row cache (up to 16 x its
    length) and without, next to rows that fit shared memory."""
    _sm90_or_skip()
    cache = config[1]
    R, ld = 7, 16 * cache + 8000
    buf = _rows(kind, R, ld, seed=3, device="cuda")
    row_len = torch.tensor([ld, 16 * cache, 16 * cache - 1, cache, cache + 1, 20000, 4097],
                           dtype=torch.int32)
    _check(buf, row_len.cuda(), 2048, reruns=2)


def threshold_tie_rows(R, ld, topk, seed=0):
    """randn rows in which 7 more keys take the value of the topk-th largest, so that exact
    ties straddle the selection's boundary while its threshold bin stays small."""
    g = torch.Generator().manual_seed(seed)
    buf = torch.randn(R, ld, generator=g)
    kth = torch.topk(buf, topk, dim=1).values[:, -1:]
    at = torch.randint(0, ld, (R, 7), generator=g)
    return buf.scatter_(1, at, kth.expand(R, 7))


@cuda
@pytest.mark.parametrize("where", ["cached", "bitmaps in the row cache", "no bitmaps"])
def test_ties_at_the_threshold(where, config):
    """Rows that fit shared memory, rows whose bitmaps fit the row cache, and longer rows."""
    _sm90_or_skip()
    cache = config[1]
    ld = {"cached": cache - 400, "bitmaps in the row cache": 4 * cache,
          "no bitmaps": 16 * cache + 4000}[where]
    buf = threshold_tie_rows(4, ld, 2048, seed=ld).cuda()
    _check(buf, torch.tensor([ld, ld, ld - 1, ld - 3], dtype=torch.int32, device="cuda"), 2048,
           reruns=1)


@cuda
def test_causal_rows(config):
    """Row r sees r + 1 keys (the causal layout), topk 2048."""
    _sm90_or_skip()
    T = 4500
    buf = _rows("randn", T, T + 4 - T % 4, seed=5, device="cuda")
    row_len = torch.arange(1, T + 1, dtype=torch.int32, device="cuda")
    _check(buf, row_len, 2048)


@cuda
def test_topk_wider_than_buffer_and_zero(config):
    from mla_inductor.kernels.sm90 import topk_host

    _sm90_or_skip()
    buf = _rows("randn", 3, 8, device="cuda")
    _check(buf, torch.tensor([8, 3, 0], dtype=torch.int32, device="cuda"), 20)
    idx = torch.empty(3, 0, dtype=torch.int32, device="cuda")
    topk_host.select(buf, torch.ones(3, dtype=torch.int32, device="cuda"), 0, idx,
                     torch.empty(3, 0, device="cuda"))
    _check(torch.empty(3, 0, device="cuda"), torch.tensor([0, 4, -1], dtype=torch.int32,
                                                          device="cuda"), 5)


@cuda
def test_topk_wider_than_the_output_staging(config):
    """topk over the shared-memory staging of the output: the slots go out in several rounds."""
    _sm90_or_skip()
    topk = 2 * config[2] + 5
    buf = _rows("randn", 4, 20000, seed=9, device="cuda")
    _check(buf, torch.tensor([20000, 9000, topk + 1, topk - 1], dtype=torch.int32,
                             device="cuda"), topk)


def bin_boundary_rows(R, ld, seed=0):
    """Rows of 2.0, 1.0 + 2**-13 and 1.0 (a third each, shuffled) and the topk values at which
    the selection ends exactly at the first digit (the 2.0s) and at the second (2.0s and the
    1.0 + 2**-13s): ``(buf, [topk_first, topk_second])``."""
    third = ld // 3
    row = torch.cat([torch.full((third,), 2.0), torch.full((third,), 1.0 + 2.0**-13),
                     torch.full((ld - 2 * third,), 1.0)])
    g = torch.Generator().manual_seed(seed)
    buf = torch.stack([row[torch.randperm(ld, generator=g)] for _ in range(R)])
    return buf, [third, 2 * third]


@cuda
@pytest.mark.parametrize("ld", [3000, 60000])
def test_selection_ending_at_a_digit(ld, config):
    _sm90_or_skip()
    buf, topks = bin_boundary_rows(4, ld)
    for topk in topks + [topks[0] + 1, topks[1] - 1]:
        _check(buf.cuda(), torch.full((4,), ld, dtype=torch.int32, device="cuda"), topk)


@cuda
def test_cuda_graph_replay(config):
    from mla_inductor.kernels.sm90 import topk_host

    _sm90_or_skip()
    R, ld, topk = 64, 6000, 512
    buf = _rows("randn", R, ld, seed=1, device="cuda")
    row_len = torch.randint(0, ld, (R,), dtype=torch.int32, device="cuda")
    idx = torch.empty(R, topk, dtype=torch.int32, device="cuda")
    scores = torch.empty(R, topk, device="cuda")
    topk_host.select(buf, row_len, topk, idx, scores)  # compiles outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        topk_host.select(buf, row_len, topk, idx, scores)
    for seed in (2, 3):
        buf.copy_(_rows("small_set", R, ld, seed=seed, device="cuda"))
        row_len.random_(0, ld)
        graph.replay()
        torch.cuda.synchronize()
        ref_idx, ref_scores = reference_select(buf, row_len, topk)
        assert torch.equal(idx, ref_idx)
        assert torch.equal(scores, ref_scores)


@cuda
def test_capture_at_another_row_length(monkeypatch):
    """Both tuned configurations compile on the first call, so a CUDA graph captured at a row
    length that takes the other one (after a call at a short one) needs no compile."""
    from mla_inductor.kernels.cache import KernelCache
    from mla_inductor.kernels.sm90 import topk_host

    _sm90_or_skip()
    monkeypatch.setattr(topk_host, "_CACHE", KernelCache("mla_sm90_topk_select"))
    short, long_ = 3000, topk_host.SHORT_MAX_LEN + 4000
    _check(_rows("randn", 4, short, seed=7, device="cuda"),
           torch.full((4,), short, dtype=torch.int32, device="cuda"), 512)
    buf = _rows("randn", 4, long_, seed=8, device="cuda")
    row_len = torch.full((4,), long_, dtype=torch.int32, device="cuda")
    idx = torch.empty(4, 512, dtype=torch.int32, device="cuda")
    scores = torch.empty(4, 512, device="cuda")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        topk_host.select(buf, row_len, 512, idx, scores)
    graph.replay()
    torch.cuda.synchronize()
    ref_idx, ref_scores = reference_select(buf, row_len, 512)
    assert torch.equal(idx, ref_idx)
    assert torch.equal(scores, ref_scores)


@cuda
def test_launcher_asserts():
    from mla_inductor.kernels.sm90 import topk_host

    _sm90_or_skip()
    buf = torch.zeros(4, 8, device="cuda")
    n = torch.full((4,), 8, dtype=torch.int32, device="cuda")
    idx = torch.empty(4, 2, dtype=torch.int32, device="cuda")
    sc = torch.empty(4, 2, device="cuda")
    for args in ((buf, n, -1, idx, sc), (buf, n, 3, idx, sc), (buf.double(), n, 2, idx, sc),
                 (torch.zeros(4, 6, device="cuda"), n, 2, idx, sc),
                 (buf.cpu(), n.cpu(), 2, idx.cpu(), sc.cpu()),
                 (torch.zeros(8, 4, device="cuda").t(), n, 2, idx, sc)):
        with pytest.raises(AssertionError):
            topk_host.select(*args)


def guess_rows(kind, R, ld, seed=0):
    """Rows for the select from a sampled guess (the kernel samples one 16-byte vector in 8):
    randn rows whose sampled elements sit far below the others (the guess lets too many
    candidates in) or far above them (too few), an ascending row, and a cluster of large
    scores."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(R, ld, generator=g)
    sampled = (torch.arange(ld) // 4) % 8 == 0
    if kind == "sample_low":
        x[:, sampled] -= 100.0
    elif kind == "sample_high":
        x[:, sampled] += 100.0
    elif kind == "ascending":
        x = torch.arange(ld, dtype=torch.float32).expand(R, ld).clone()
    elif kind == "cluster":
        x[:, ld // 3:ld // 3 + 3000] += 4.0
    else:
        raise AssertionError(kind)
    return x


@cuda
@pytest.mark.parametrize("ld,topk", [(8200, 2048), (65536, 2048), (131072, 2048),
                                     (70004, 512)])
@pytest.mark.parametrize("kind", ["randn", "relu", "nonfinite", "narrow", "small_set",
                                  "sample_low", "sample_high", "ascending", "cluster"])
def test_guessed_threshold(kind, ld, topk, config):
    """Rows up to 8 x the row cache: the select from a sampled guess, rows short enough for
    every element to be a candidate, and the radix select where a guess fails (ties across
    the guess, a sample far from the rest of the row)."""
    _sm90_or_skip()
    cache = config[1]
    lens = [ld, ld - 1, ld - 3, min(ld, 7700), min(ld, cache), min(ld, cache + 1),
            min(ld, 4 * cache + 1), topk + 1]
    R = len(lens)
    if kind in ("sample_low", "sample_high", "ascending", "cluster"):
        buf = guess_rows(kind, R, ld, seed=ld + topk).cuda()
    else:
        buf = _rows(kind, R, ld, seed=ld + topk, device="cuda")
    _check(buf, torch.tensor(lens, dtype=torch.int32, device="cuda"), topk, reruns=1)
