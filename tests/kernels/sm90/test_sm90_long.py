"""Long context on the Hopper kernels: T = S past 2**31 elements of q, out and dq.

Every product of sizes that can pass 2**31 (``T * H * d_qk``, ``T * H * d_v``, ``S * d_qk``,
``T * topk``, the fp32 dkv accumulator) must be addressed in 64 bits. Each case checks:

- values against an fp64 reference (written here, independent of the package) on a random
  sample of tokens: out, lse, and dq rows; and the whole dkv of a few kv rows, summed in fp64 over
  every (token, slot) that names them;
- the whole of out, lse, dq and dkv against the same kernels run on token chunks small enough
  that no offset passes 2**31 (the regime the short tests cover): a wrapped offset in the long
  run would differ there;
- canary rows around the fp32 dkv accumulator stay untouched.

Each case sizes itself to the card: where its tensors do not fit the free GPU memory, T (= S) is
cut, in whole 32-bit-safe chunks, to what fits, as long as q still passes 2**31 elements; where
even that does not fit, the case is skipped with the memory it needs. The two larger cases fit an
H200 (141 GB) whole and run cut on an 80 GB H100.

GPU only (SM90); marked ``slow`` too (about a minute on an H200).
"""

from __future__ import annotations

import gc
import math

import pytest
import torch

pytestmark = [pytest.mark.cuda, pytest.mark.slow]

if not (torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)):
    pytest.skip("needs an SM90 GPU", allow_module_level=True)

from conftest import rel_l2  # noqa: E402

from mla_inductor.kernels.sm90 import bwd_host, fwd_host  # noqa: E402

D_QK, D_V = 576, 512
SAMPLE_TOKENS = 256
CANARY_ROWS = 64
# a token chunk whose [T_c, H, d_qk] tensors stay below 2**31 elements for any H <= 128
SAFE_CHUNK = 16384
# GPU memory beyond the case's long tensors (:func:`_case_bytes`): the fp64 references of the
# sampled tokens, the chunked runs' outputs (up to 4.3 GB at H 128) and the allocator's slack
WORKSPACE = 6 * 2**30


def _case_bytes(T, S, H, topk):
    """The bytes a case holds at once, at its peak (the backward): q and dq ``[T, H, d_qk]``,
    dout, out and o_lo ``[T, H, d_v]`` in bf16, lse ``[T, H]`` float32, indices ``[T, topk]``
    int32 and the backward's sorted copy, kv ``[S, d_qk]`` bf16 and up to three float32
    ``[S, d_qk]`` (the canaried accumulator, dkv, the chunked run's accumulator)."""
    per_token = H * (2 * D_QK * 2 + 3 * D_V * 2 + 4) + 2 * topk * 4
    per_key = D_QK * 2 + 3 * D_QK * 4
    return T * per_token + S * per_key


def _fit(T, H, topk):
    """``(T, why)``: the case's T (= S), cut in whole :data:`SAFE_CHUNK` steps to the free
    memory of this GPU; T is None (and ``why`` says what it needs) when the cut T would leave
    q below 2**31 elements, the point of the case."""
    gc.collect()  # an earlier case's tensors, still cached by torch's allocator, count as free
    torch.cuda.empty_cache()
    free, _ = torch.cuda.mem_get_info()
    fit = T
    while fit > 0 and _case_bytes(fit, fit, H, topk) + WORKSPACE > free:
        fit -= SAFE_CHUNK
    if fit * H * D_QK <= 2**31:
        need = (_case_bytes(T, T, H, topk) + WORKSPACE) / 2**30
        return None, (f"needs {need:.0f} GiB of GPU memory for T {T}, H {H}, topk {topk}, and "
                      f"{free / 2**30:.0f} GiB are free; cut to fit, q stays below 2**31 "
                      f"elements")
    return fit, ""


def _inputs(T, S, H, topk, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(T, H, D_QK, device="cuda", dtype=torch.bfloat16, generator=g)
    kv = torch.randn(S, D_QK, device="cuda", dtype=torch.bfloat16, generator=g)
    indices = torch.randint(0, S, (T, topk), device="cuda", dtype=torch.int32, generator=g)
    # empty slots of every kind, and a row with none valid, near the far end of the tensors
    indices[-1, :3] = torch.tensor([-1, S, 2**31 - 1], dtype=torch.int32)
    indices[-2] = -1
    dout = torch.randn(T, H, D_V, device="cuda", dtype=torch.bfloat16, generator=g)
    return q, kv, indices, dout


def _fp64_rows(q, kv, indices, tokens, sm_scale):
    """fp64 out ``[n, H, d_v]``, lse ``[n, H]`` of the given tokens (gathers, no package code)."""
    S = kv.shape[0]
    idx = indices[tokens].long()
    valid = (idx >= 0) & (idx < S)
    keys = kv[torch.where(valid, idx, 0)].double()  # [n, topk, d_qk]
    s = torch.einsum("nhd,nkd->nhk", q[tokens].double(), keys) * sm_scale
    s = s.masked_fill(~valid[:, None, :], -math.inf)
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - torch.where(torch.isinf(lse), 0.0, lse)[..., None])
    return torch.einsum("nhk,nkd->nhd", p, keys[..., :D_V]), lse, p, keys


def _fp64_dq(q, kv, indices, dout, tokens, sm_scale):
    out, _, p, keys = _fp64_rows(q, kv, indices, tokens, sm_scale)
    do = dout[tokens].double()
    dp = torch.einsum("nhd,nkd->nhk", do, keys[..., :D_V])
    ds = p * (dp - (do * out).sum(-1, keepdim=True)) * sm_scale
    return torch.einsum("nhk,nkd->nhd", ds, keys)


def _fp64_dkv_rows(q, kv, indices, dout, rows, sm_scale, chunk=128):
    """fp64 dkv of kv rows ``rows`` over every (token, slot) that names them."""
    S = kv.shape[0]
    dkv = torch.zeros(len(rows), D_QK, dtype=torch.float64, device="cuda")
    hits = torch.isin(indices, rows)
    tokens = hits.any(dim=1).nonzero().flatten()
    for c in range(0, len(tokens), chunk):
        tok = tokens[c:c + chunk]
        out, _, p, keys = _fp64_rows(q, kv, indices, tok, sm_scale)
        do = dout[tok].double()
        dp = torch.einsum("nhd,nkd->nhk", do, keys[..., :D_V])
        ds = p * (dp - (do * out).sum(-1, keepdim=True)) * sm_scale
        idx = indices[tok].long()
        for i, r in enumerate(rows.tolist()):
            sel = (idx == r).double()  # [n, topk]; r < S, so a hit is a valid slot
            dkv[i] += torch.einsum("nk,nhk,nhd->d", sel, ds, q[tok].double())
            dkv[i, :D_V] += torch.einsum("nk,nhk,nhd->d", sel, p, do)
    assert S > int(rows.max())
    return dkv


def _forward(q, kv, indices, sm_scale):
    return fwd_host.forward(q, kv, indices, None, None, None, sm_scale, D_V, 0.0, True)[:3]


def _near_floor(x, ref):
    """x within 1.5x the bf16 rounding floor of the fp64 ``ref`` (an ideal bf16 pipeline)."""
    err, floor = rel_l2(x, ref), rel_l2(ref.to(torch.bfloat16), ref)
    assert err <= 1.5 * floor, (err, floor)


@pytest.mark.parametrize(
    "T,H,topk",
    [
        (32768, 128, 2048),  # T*H*d_qk = 2.4e9: past 2**31 from token 29128 on
        (131072, 128, 256),  # 9.7e9 elements, about 90 GB at the peak; topk cut short
        (2**20, 16, 512),  # the largest H whose forward + backward fit in the H200's memory
    ],
)
def test_long_context_forward_and_backward(T, H, topk):
    fit, why = _fit(T, H, topk)
    if fit is None:
        pytest.skip(why)
    if fit < T:
        print(f"T {T} cut to {fit} to fit this GPU's free memory")
        T = fit
    S = T
    sm_scale = D_QK**-0.5
    q, kv, indices, dout = _inputs(T, S, H, topk, seed=T + H)
    out, lse, o_lo = _forward(q, kv, indices, sm_scale)

    g = torch.Generator(device="cuda").manual_seed(1)
    tokens = torch.randperm(T, device="cuda", generator=g)[:SAMPLE_TOKENS]
    tokens[:2] = torch.tensor([T - 1, T - 2], device="cuda")  # the far end, with empty slots
    out64, lse64, _, _ = _fp64_rows(q, kv, indices, tokens, sm_scale)
    _near_floor(out[tokens], out64)
    finite = torch.isfinite(lse64)
    assert torch.equal(torch.isfinite(lse[tokens]), finite)
    assert (lse[tokens][finite].double() - lse64[finite]).abs().max().item() < 1e-3
    assert (out[T - 2] == 0).all() and torch.isinf(lse[T - 2]).all()

    # the whole forward against the kernel on 32-bit-safe chunks
    for t0 in range(0, T, SAFE_CHUNK):
        s = slice(t0, min(T, t0 + SAFE_CHUNK))
        o_c, l_c, lo_c = _forward(q[s], kv, indices[s], sm_scale)
        assert torch.equal(out[s], o_c) and torch.equal(lse[s], l_c) and torch.equal(o_lo[s], lo_c)
        del o_c, l_c, lo_c

    # backward, with canary rows around the fp32 dkv accumulator
    canary = torch.full((CANARY_ROWS, D_QK), 1234.5, device="cuda")
    buf = torch.cat((canary, torch.zeros(S, D_QK, device="cuda"), canary))
    accum = buf[CANARY_ROWS:CANARY_ROWS + S]
    dq = bwd_host.backward_into(dout, q, kv, indices, None, out, lse, o_lo, sm_scale, D_V, accum)
    assert torch.equal(buf[:CANARY_ROWS], canary) and torch.equal(buf[-CANARY_ROWS:], canary)
    dkv = bwd_host.dkv_from_accum(accum, torch.float32)
    del buf, accum

    _near_floor(dq[tokens], _fp64_dq(q, kv, indices, dout, tokens, sm_scale))
    assert (dq[T - 2] == 0).all()
    rows = torch.unique(indices[T - 1, 3:6].long())  # rows the far end's token reads
    _near_floor(dkv[rows], _fp64_dkv_rows(q, kv, indices, dout, rows, sm_scale))

    # the same kernels over 32-bit-safe token chunks, last chunk first: dq bitwise (no atomics),
    # dkv up to the order of its fp32 atomics
    accum = torch.zeros(S, D_QK, device="cuda")
    for t0 in reversed(range(0, T, SAFE_CHUNK)):
        s = slice(t0, min(T, t0 + SAFE_CHUNK))
        dq_c = bwd_host.backward_into(dout[s], q[s], kv, indices[s], None, out[s], lse[s], o_lo[s],
                                      sm_scale, D_V, accum)
        assert torch.equal(dq[s], dq_c)
    # the token-long tensors make room for the float64 copies of the [S, d_qk] comparison
    del q, dout, out, lse, o_lo, dq, dq_c
    assert rel_l2(dkv, bwd_host.dkv_from_accum(accum, torch.float32)) < 1e-5
