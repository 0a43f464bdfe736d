"""GPU tests of the Hopper kernels of ``lightning_indexer_scores`` (mla_inductor.kernels.sm90.
lightning_scores): the forward and the gradients dq, dk, dweights against float64 computed here
from the definition, at the sizes of DeepSeek-V3.2's indexer (H 64, D 128, topk 2048, S 8192)
and at odd ones; empty slots (-1, < 0, S, > S), duplicates, keys no slot names holding NaN,
batches, topk not a multiple of the 64-key block, float16 with a KL loss's small gradients;
bitwise reruns, the deterministic dk, CUDA-graph replay, 64-bit offsets, dispatch, opcheck and
torch.compile.

Error bounds, per element, relative to sums of absolute terms (``|q| |k|`` is
``sum_d |q_d| |k_d|``, an upper bound of ``|q . k|``):

- scores, from ``bound = sum_h |w_h| (|q_h| |k_j|)``: products of bf16/fp16 values are exact in
  float32 and the wgmma sums 128 of them in float32; the head sum is 64 float32 adds.
  :data:`SCORE_TOL` = 2e-5 of the bound (64 + 128 adds of relative rounding 2**-24 each, far
  more than seen).
- dweights, from ``sum_j |g_j| (|q_h| |k_j|)``: the same logits, summed over topk slots in float32
  (2048 adds): :data:`DWEIGHTS_TOL` = 1e-4.
- dq and dk: ``dS = w g [L > 0]`` is rounded once to q's dtype (unit roundoff u = 2**-8 in bf16,
  2**-11 in fp16), the products with k (or q) are exact in float32, the sums are float32, and the
  result is rounded to q's dtype (u of its value, itself at most the bound). So ``|err| <= u
  sum |dS| |k| + u |dq| + float32 sums <= 2 u bound`` (:data:`GRAD_TOL`: 2**-7 in bf16, 2**-10 in
  fp16, which has float32 products and sums to spare) with ``bound = sum_j |dS_hj| |k_jd|``
  (dk: ``sum |dS_hj| |q_hd|`` over every occurrence of the key), plus, in fp16, half its
  smallest subnormal (2**-25, :data:`GRAD_ATOL`) where the result rounds to a subnormal. A slot
  whose logit is so close to 0 that float32 may see the other sign (``|L| <= 1e-4 |q| |k|``) may
  or may not pass its gradient: its whole term ``|w g| |k|`` (``|w g| |q|``) is allowed on top.
"""

from __future__ import annotations

import math

import pytest
import torch

from mla_inductor import backends, lightning_indexer_scores, use_backend
from mla_inductor.kernels import sm90

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not sm90.available()[0], reason=sm90.available()[1] or "no sm90"),
]

D = 128
SCORE_TOL = 2e-5
DWEIGHTS_TOL = 1e-4
GRAD_TOL = {torch.bfloat16: 2.0**-7, torch.float16: 2.0**-10}
GRAD_ATOL = {torch.bfloat16: 0.0, torch.float16: 2.0**-25}
BF16_TOL = GRAD_TOL[torch.bfloat16]
AMBIGUOUS = 1e-4  # |L| <= AMBIGUOUS * (|q| |k|): float32 may give either sign
ROWS_PER_REF = 64  # rows of one float64 reference chunk ([64, 2048, 128] float64: 128 MiB)


def _host():
    from mla_inductor.kernels.sm90 import lightning_selected_slots_host

    return lightning_selected_slots_host


def make_inputs(B, T, S, H, topk, dtype=torch.bfloat16, seed=0, empty=0.2, nan_keys=True,
                g_scale=1.0):
    """``(q, k, weights, indices, dscores)``: normal q, k; weights ``N(0, 1) H**-0.5``; indices
    uniform in [0, S) (many duplicates) with a fraction ``empty`` replaced by -1, -7, S, S + 5;
    dscores ``N(0, 1) g_scale``, NaN on empty slots (never read). With ``nan_keys`` the keys no
    slot names are NaN (never read either)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(B, T, H, D, device="cuda", generator=g).to(dtype)
    k = torch.randn(B, S, D, device="cuda", generator=g).to(dtype)
    w = torch.randn(B, T, H, device="cuda", generator=g) * H**-0.5
    idx = torch.randint(0, S, (B, T, topk), device="cuda", generator=g, dtype=torch.int32)
    bad = torch.tensor([-1, -7, S, S + 5], device="cuda", dtype=torch.int32)
    drop = torch.rand(B, T, topk, device="cuda", generator=g) < empty
    pick = torch.randint(0, 4, (B, T, topk), device="cuda", generator=g)
    idx = torch.where(drop, bad[pick], idx)
    valid = (idx >= 0) & (idx < S)
    dscores = torch.randn(B, T, topk, device="cuda", generator=g) * g_scale
    dscores = torch.where(valid, dscores, math.nan)
    if nan_keys:
        named = torch.zeros(B, S, dtype=torch.bool, device="cuda")
        for b in range(B):
            named[b, idx[b][valid[b]].long()] = True
        k = torch.where(named[..., None], k, math.nan)
    return q, k, w, idx, dscores


def reference(q, k, w, idx, dscores, rows=None, keys_from=0):
    """float64 ``{scores, dq, dk, dweights}`` and their error bounds (``*_bound``, module
    docstring) from the definition, rows flattened (``b T + t``). ``rows``: the rows to compute
    (default all; dk then holds only their contributions); ``keys_from``: dk is computed for
    the flattened keys ``b S + s >= keys_from`` only (``[B S - keys_from, D]``; 0: ``[B, S,
    D]``). Keys are gathered per chunk of rows (empty slots read a zero key, never the
    tensor)."""
    B, T, H, _ = q.shape
    S, topk = k.shape[1], idx.shape[-1]
    R = B * T
    rows = torch.arange(R, device=q.device) if rows is None else rows
    q2, w2 = q.reshape(R, H, D), w.reshape(R, H).double()
    i2, g2 = idx.reshape(R, topk), dscores.reshape(R, topk)
    k2 = k.reshape(B * S, D)
    out = {name: [] for name in ("scores", "scores_bound", "dq", "dq_bound", "dq_flip", "dweights",
                                 "dweights_bound")}
    dk = torch.zeros(B * S - keys_from, D, dtype=torch.float64, device=q.device)
    dk_bound = torch.zeros_like(dk)
    dk_flip = torch.zeros_like(dk)
    for c in range(0, rows.numel(), ROWS_PER_REF):
        r = rows[c:c + ROWS_PER_REF]
        ix = i2[r].long()
        valid = (ix >= 0) & (ix < S)
        at = torch.where(valid, ix + (r // T * S)[:, None], 0)
        keys = torch.where(valid[..., None], k2[at].double(), 0.0)  # [c, topk, D]
        qc = q2[r].double()
        L = torch.einsum("chd,cjd->chj", qc, keys)
        absL = torch.einsum("chd,cjd->chj", qc.abs(), keys.abs())
        L, absL = torch.where(valid[:, None], L, 0.0), torch.where(valid[:, None], absL, 0.0)
        wc = w2[r]
        g = torch.where(valid, g2[r].double(), 0.0)
        out["scores"].append(torch.einsum("ch,chj->cj", wc, L.relu()))
        out["scores_bound"].append(torch.einsum("ch,chj->cj", wc.abs(), absL))
        out["dweights"].append(torch.einsum("chj,cj->ch", L.relu(), g))
        out["dweights_bound"].append(torch.einsum("chj,cj->ch", absL, g.abs()))
        wg = wc[:, :, None] * g[:, None, :]  # [c, H, topk]
        dS = torch.where(L > 0, wg, 0.0)
        ambiguous = valid[:, None] & (L.abs() <= AMBIGUOUS * absL)
        dS_abs = torch.where((L > 0) | ambiguous, wg.abs(), 0.0)
        dS_flip = torch.where(ambiguous, wg.abs(), 0.0)  # a whole term either way
        out["dq"].append(torch.einsum("chj,cjd->chd", dS, keys))
        out["dq_bound"].append(torch.einsum("chj,cjd->chd", dS_abs, keys.abs()))
        out["dq_flip"].append(torch.einsum("chj,cjd->chd", dS_flip, keys.abs()))
        take = valid & (at >= keys_from)
        flat = at[take] - keys_from
        dk.index_add_(0, flat, torch.einsum("chj,chd->cjd", dS, qc)[take])
        dk_bound.index_add_(0, flat, torch.einsum("chj,chd->cjd", dS_abs, qc.abs())[take])
        dk_flip.index_add_(0, flat, torch.einsum("chj,chd->cjd", dS_flip, qc.abs())[take])
    ref = {name: torch.cat(v) for name, v in out.items()}
    ref["dk"], ref["dk_bound"], ref["dk_flip"] = dk, dk_bound, dk_flip
    if keys_from == 0:
        ref["dk"], ref["dk_bound"], ref["dk_flip"] = (x.view(B, S, D) for x in (dk, dk_bound, dk_flip))
    return ref


def assert_within(name, got, want, bound, tol, atol=0.0, slack=0.0):
    """Every element of ``got`` within ``tol * bound + slack + atol`` of ``want`` (NaN fails);
    ``slack``: the terms of slots whose relu float32 may see either way, at full weight."""
    err = (got.double() - want).abs()
    excess = err - tol * bound - slack - atol
    worst = excess.argmax() if excess.numel() else None
    assert not torch.isnan(err).any(), f"{name}: NaN"
    assert worst is None or excess.flatten()[worst] <= 1e-30, (
        f"{name}: error {err.flatten()[worst].item():.3e} at {worst.item()} over "
        f"{tol:.1e} x bound {bound.flatten()[worst].item():.3e}")


def check_all(q, k, w, idx, dscores, deterministic=False):
    """Runs the sm90 forward and backward and checks all four results against float64."""
    host = _host()
    B, T, H, _ = q.shape
    S = k.shape[1]
    scores = host.forward(q, k, w, idx)
    dq, dk, dw = host.backward(dscores, q, k, w, idx, deterministic=deterministic)
    assert scores.shape == idx.shape and scores.dtype == torch.float32
    assert dq.shape == q.shape and dq.dtype == q.dtype
    assert dk.shape == k.shape and dk.dtype == k.dtype
    assert dw.shape == w.shape and dw.dtype == torch.float32
    ref = reference(q, k, w, idx, dscores)
    valid = (idx >= 0) & (idx < S)
    empty = scores[~valid]
    assert (empty == 0).all() and not empty.signbit().any()  # exactly +0.0
    assert_within("scores", scores.reshape(B * T, -1), ref["scores"], ref["scores_bound"],
                  SCORE_TOL)
    assert_within("dweights", dw.reshape(B * T, H), ref["dweights"], ref["dweights_bound"],
                  DWEIGHTS_TOL)
    tol, atol = GRAD_TOL[q.dtype], GRAD_ATOL[q.dtype]
    assert_within("dq", dq.reshape(B * T, H, D), ref["dq"], ref["dq_bound"], tol, atol,
                  slack=ref["dq_flip"])
    assert_within("dk", dk, ref["dk"], ref["dk_bound"], tol, atol, slack=ref["dk_flip"])
    named = torch.zeros(B, S, dtype=torch.bool, device="cuda")
    for b in range(B):
        named[b, idx[b][valid[b]].long()] = True
    assert not dk[~named].any(), "a key no slot names got a gradient"
    return scores, dq, dk, dw


@pytest.mark.parametrize("B,T,S,H,topk,dtype", [
    (1, 1024, 8192, 64, 2048, torch.bfloat16),  # DeepSeek-V3.2's indexer
    (2, 256, 8192, 64, 2048, torch.bfloat16),  # batched: indices local to each element
    (1, 512, 8192, 32, 2048, torch.float16),
    (2, 300, 4000, 20, 1000, torch.bfloat16),  # topk not a multiple of 64, H not of 8
    (1, 40, 100, 1, 65, torch.float16),  # one head, one key past a block
    (3, 7, 50, 64, 5, torch.bfloat16),  # topk < one block, topk > S / 10
])
def test_matches_float64(B, T, S, H, topk, dtype):
    q, k, w, idx, dscores = make_inputs(B, T, S, H, topk, dtype, seed=T + H)
    check_all(q, k, w, idx, dscores)


def test_float16_small_gradients_are_scaled_not_flushed():
    """dS = w g of about 4e-8 (dscores 3e-7, as small as a KL loss's, times weights of 0.125)
    is below float16's smallest normal (6e-5) and around its smallest subnormal (6e-8), while
    dq and dk (sums over many slots) are representable: the per-row scale keeps them within
    the bounds (unscaled, most dS would round to 0 or 6e-8)."""
    q, k, w, idx, dscores = make_inputs(1, 256, 8192, 64, 2048, torch.float16, seed=3,
                                        g_scale=3e-7)
    _, dq, dk, _ = check_all(q, k, w, idx, dscores)
    assert dq.abs().amax() > 0 and dk.abs().amax() > 0


def test_duplicates_and_rows_without_a_valid_slot():
    q, k, w, idx, dscores = make_inputs(1, 200, 300, 64, 130, seed=4, nan_keys=False)
    idx[0, :50] = 7  # every slot of these rows names key 7
    idx[0, 50:60] = -1  # no valid slot
    idx[0, 60:70] = 300  # = S: empty
    dscores = torch.where((idx >= 0) & (idx < 300), dscores.nan_to_num(), math.nan)
    scores, dq, _, dw = check_all(q, k, w, idx, dscores)
    assert not scores[0, 50:70].any() and not dq[0, 50:70].any() and not dw[0, 50:70].any()


def test_nan_in_a_named_key_shows_where_it_is_read():
    q, k, w, idx, _ = make_inputs(1, 64, 500, 64, 128, seed=5, nan_keys=False)
    idx[0, 3, 10] = 42
    idx[0, :3][idx[0, :3] == 42] = 41
    k[0, 42, 0] = math.nan
    scores = _host().forward(q, k, w, idx)
    slots = idx[0] == 42
    assert torch.isnan(scores[0][slots]).all() and not torch.isnan(scores[0][~slots]).any()


def test_reruns_are_bitwise_identical():
    """The forward, dq and dweights always; dk under the deterministic variant, which agrees
    with the float32-atomic one within the bounds."""
    host = _host()
    q, k, w, idx, dscores = make_inputs(1, 512, 8192, 64, 2048, seed=6)
    first, second = host.forward(q, k, w, idx), host.forward(q, k, w, idx)
    assert torch.equal(first, second)
    a = host.backward(dscores, q, k, w, idx, deterministic=True)
    b = host.backward(dscores, q, k, w, idx, deterministic=True)
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    c = host.backward(dscores, q, k, w, idx)
    assert torch.equal(a[0], c[0]) and torch.equal(a[2], c[2])
    ref = reference(q, k, w, idx, dscores)
    assert_within("dk deterministic", a[1], ref["dk"], ref["dk_bound"], BF16_TOL,
                  slack=ref["dk_flip"])


def test_deterministic_mode_runs_the_fixed_point_backward():
    q, k, w, idx, dscores = make_inputs(2, 64, 256, 16, 100, seed=7)
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, w)]
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        runs = []
        for _ in range(2):
            out = lightning_indexer_scores(*leaves, idx)
            runs.append(torch.autograd.grad(out, leaves, dscores.nan_to_num()))
    finally:
        torch.use_deterministic_algorithms(before)
    assert all(torch.equal(x, y) for x, y in zip(*runs))
    want = _host().backward(dscores, q, k, w, idx, deterministic=True)
    assert all(torch.equal(x, y) for x, y in zip(runs[0], want))


def test_cuda_graph_replay():
    host = _host()
    q, k, w, idx, dscores = make_inputs(2, 128, 1000, 64, 300, seed=8, nan_keys=False)
    q2, k2, w2, idx2, dscores2 = make_inputs(2, 128, 1000, 64, 300, seed=9, nan_keys=False)
    host.forward(q, k, w, idx)  # compile outside the capture
    for det in (False, True):
        host.backward(dscores, q, k, w, idx, deterministic=det)
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        scores = host.forward(q, k, w, idx)
        grads = host.backward(dscores, q, k, w, idx)
        fixed = host.backward(dscores, q, k, w, idx, deterministic=True)
    torch.cuda.current_stream().wait_stream(stream)
    for dst, src in ((q, q2), (k, k2), (w, w2), (idx, idx2), (dscores, dscores2)):
        dst.copy_(src)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(scores, host.forward(q2, k2, w2, idx2))
    want = host.backward(dscores2, q2, k2, w2, idx2)
    assert torch.equal(grads[0], want[0]) and torch.equal(grads[2], want[2])
    ref = reference(q2, k2, w2, idx2, dscores2)
    assert_within("dk replayed", grads[1], ref["dk"], ref["dk_bound"], BF16_TOL,
                  slack=ref["dk_flip"])
    want_fixed = host.backward(dscores2, q2, k2, w2, idx2, deterministic=True)
    assert all(torch.equal(x, y) for x, y in zip(fixed, want_fixed))


def test_offsets_past_2_31():
    """q's and dq's element offsets (R H D) and the dk accumulator's ((b S + index) D) pass
    2**31: the last rows of batch element 1 name keys near its end, which no other row names."""
    host = _host()
    B, T, H, topk = 2, 140_000, 64, 64
    S = 2**24 + 1000
    g = torch.Generator(device="cuda").manual_seed(10)
    q = torch.randn(B, T, H, D, device="cuda", generator=g).to(torch.bfloat16)
    k = torch.randn(B, S, D, device="cuda", generator=g).to(torch.bfloat16)
    w = torch.randn(B, T, H, device="cuda", generator=g) * H**-0.5
    idx = torch.randint(0, 1000, (B, T, topk), device="cuda", generator=g, dtype=torch.int32)
    last = 4
    idx[1, -last:] = torch.randint(S - 200, S, (last, topk), device="cuda", generator=g,
                                   dtype=torch.int32)
    dscores = torch.randn(B, T, topk, device="cuda", generator=g)
    scores = host.forward(q, k, w, idx)
    dq, dk, dw = host.backward(dscores, q, k, w, idx)
    rows = torch.arange(B * T - last, B * T, device="cuda")
    ref = reference(q, k, w, idx, dscores, rows=rows, keys_from=2 * S - 200)
    assert_within("scores", scores.reshape(B * T, -1)[rows], ref["scores"], ref["scores_bound"],
                  SCORE_TOL)
    assert_within("dq", dq.reshape(B * T, H, D)[rows], ref["dq"], ref["dq_bound"], BF16_TOL,
                  slack=ref["dq_flip"])
    assert_within("dweights", dw.reshape(B * T, H)[rows], ref["dweights"],
                  ref["dweights_bound"], DWEIGHTS_TOL)
    assert_within("dk", dk[1, S - 200:], ref["dk"], ref["dk_bound"], BF16_TOL, slack=ref["dk_flip"])


def test_edge_sizes():
    host = _host()
    q, k, w, idx, dscores = make_inputs(2, 5, 30, 8, 4, seed=11, nan_keys=False)
    assert host.forward(q, k, w, idx[..., :0]).shape == (2, 5, 0)
    dq, dk, dw = host.backward(dscores[..., :0], q, k, w, idx[..., :0])
    assert not dq.any() and not dk.any() and not dw.any()
    assert host.forward(q[:, :0], k, w[:, :0], idx[:, :0]).shape == (2, 0, 4)
    empty_k = k[:, :0]
    assert not host.forward(q, empty_k, w, idx).any()
    with use_backend("sm90"), pytest.raises(
            RuntimeError, match="^lightning_indexer_scores: mla_inductor backend 'sm90' cannot "
                                "run here: sm90 lightning_indexer_scores supports D = 128, got 64"):
        lightning_indexer_scores(q[..., :64].contiguous(), k[..., :64].contiguous(), w, idx)


def test_the_op_dispatches_to_sm90_and_passes_opcheck():
    dims = (16, 64, 64, 128, 0, frozenset())
    for direction in ("lightning_indexer_scores", "lightning_indexer_scores_bwd"):
        assert backends.select(torch.device("cuda"), torch.bfloat16, direction, dims) is sm90
    q, k, w, idx, dscores = make_inputs(2, 16, 64, 64, 70, seed=12, nan_keys=False)
    dscores = dscores.nan_to_num()
    torch.library.opcheck(torch.ops.mla_inductor.lightning_indexer_scores, (q, k, w, idx))
    torch.library.opcheck(torch.ops.mla_inductor.lightning_indexer_scores_bwd,
                          (dscores, q, k, w, idx), test_utils=("test_schema", "test_faketensor"))


def test_compiled_forward_and_backward_match_eager():
    q, k, w, idx, dscores = make_inputs(2, 64, 512, 64, 200, seed=13, nan_keys=False)
    dscores = dscores.nan_to_num()

    def grads(fn):
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, w)]
        out = fn(*leaves, idx)
        return (out, *torch.autograd.grad(out, leaves, dscores))

    eager = grads(lightning_indexer_scores)
    compiled = grads(torch.compile(lightning_indexer_scores, fullgraph=True))
    for name, a, b in zip(("scores", "dq", "dk", "dweights"), eager, compiled):
        if name == "dk":  # float32 atomics: the same up to the order of additions
            torch.testing.assert_close(a, b, rtol=2**-7, atol=1e-3)
        else:
            assert torch.equal(a, b), name
