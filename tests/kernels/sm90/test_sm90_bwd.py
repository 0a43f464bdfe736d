"""The Hopper sparse-MLA backward kernel (mla_inductor.kernels.sm90.bwd) against fp64 autograd.

GPU only (SM90); every test skips cleanly elsewhere.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.cuda

if not (torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)):
    pytest.skip("needs an SM90 GPU", allow_module_level=True)

from conftest import reference_sparse_mla_fp64, rel_l2  # noqa: E402

from mla_inductor.kernels.sm90 import bwd_host  # noqa: E402


def _valid(indices, topk_length, S):
    valid = (indices >= 0) & (indices < S)
    if topk_length is not None:
        pos = torch.arange(indices.shape[1], device=indices.device)
        valid &= pos[None, :] < topk_length[:, None]
    return valid


def _case(T, H, d_qk, d_v, S, topk, seed=0, invalid_frac=0.1, with_topk_length=False):
    g = torch.Generator(device="cpu").manual_seed(seed)
    q = torch.randn(T, H, d_qk, generator=g).bfloat16()
    kv = torch.randn(S, d_qk, generator=g).bfloat16()
    dout = torch.randn(T, H, d_v, generator=g).bfloat16()
    indices = torch.randint(0, S, (T, topk), generator=g, dtype=torch.int32)
    drop = torch.rand(T, topk, generator=g) < invalid_frac
    indices = torch.where(drop, -1, indices)
    indices[0, 0] = S  # out of range
    indices[-1, -1] = 2**31 - 1
    if T > 2:
        indices[1] = -1  # a row with no valid slot
    if topk > 3:
        indices[-1, 1] = indices[-1, 2]  # a duplicate
    topk_length = None
    if with_topk_length:
        topk_length = torch.randint(0, topk + 1, (T,), generator=g, dtype=torch.int32)
        topk_length[0] = topk
    dev = "cuda"
    return [t.to(dev) if t is not None else None for t in (q, kv, dout, indices, topk_length)]


def _reference(q, kv, dout, indices, topk_length, sm_scale, d_v):
    """fp64 gradients, and the forward outputs (bf16 out, fp32 lse, bf16 o_lo) they come from."""
    q64 = q.double().requires_grad_()
    kv64 = kv.double().requires_grad_()
    out64, lse64 = reference_sparse_mla_fp64(q64, kv64, indices, topk_length, sm_scale, d_v)
    (out64 * dout.double()).sum().backward()
    out = out64.detach().to(q.dtype)
    o_lo = (out64.detach() - out.double()).to(q.dtype)
    return q64.grad, kv64.grad, out, lse64.detach().float(), o_lo


CASES = [
    # T, H, d_qk, d_v, S, topk, topk_length
    (6, 16, 576, 512, 300, 100, False),
    (5, 72, 576, 512, 200, 130, True),
    (4, 64, 512, 512, 150, 64, False),
    (3, 128, 576, 512, 4096, 2048, False),
]


@pytest.mark.parametrize("T,H,d_qk,d_v,S,topk,with_len", CASES)
def test_gradients_vs_fp64(T, H, d_qk, d_v, S, topk, with_len):
    q, kv, dout, indices, topk_length = _case(T, H, d_qk, d_v, S, topk, with_topk_length=with_len)
    sm_scale = d_qk**-0.5
    dq64, dkv64, out, lse, o_lo = _reference(q, kv, dout, indices, topk_length, sm_scale, d_v)
    dq, dkv, _ = bwd_host.backward(dout, None, q, kv, indices, topk_length, None, None, out, lse,
                                   o_lo, sm_scale, d_v)
    torch.cuda.synchronize()
    assert dq.dtype == q.dtype and dq.shape == q.shape
    assert dkv.dtype == kv.dtype and dkv.shape == kv.shape
    assert torch.isfinite(dq).all() and torch.isfinite(dkv).all()
    # ideal bf16 pipeline: fp64 math from the bf16 inputs, one rounding of the outputs
    floor_dq = rel_l2(dq64.to(q.dtype), dq64)
    floor_dkv = rel_l2(dkv64.to(kv.dtype), dkv64)
    err_dq, err_dkv = rel_l2(dq, dq64), rel_l2(dkv, dkv64)
    print(f"T={T} H={H} d={d_qk}/{d_v} topk={topk}: dq {err_dq:.3e} (floor {floor_dq:.3e}), "
          f"dkv {err_dkv:.3e} (floor {floor_dkv:.3e})")
    assert err_dq <= 1.5 * floor_dq
    assert err_dkv <= 1.5 * floor_dkv
    # rows with no valid slot: exact zeros
    valid = _valid(indices.long(), topk_length, kv.shape[0])
    empty_rows = ~valid.any(dim=1)
    assert (dq[empty_rows] == 0).all()
    # kv rows that no valid slot references: exact zeros
    touched = torch.zeros(kv.shape[0], dtype=torch.bool, device=kv.device)
    touched[indices.long()[valid]] = True
    assert (dkv[~touched] == 0).all()


@pytest.mark.parametrize("with_len", [False, True])
def test_gathers_evict_first_same_gradients(monkeypatch, with_len):
    """The kernel whose gathers carry the L2 evict_first policy (chosen when kv and its fp32
    accumulator do not fit in L2) computes what the plain one does: dq bitwise, dkv to the
    atomics' order, both against fp64."""
    T, H, d_qk, d_v, S, topk = 3, 128, 576, 512, 4096, 2048
    q, kv, dout, indices, topk_length = _case(T, H, d_qk, d_v, S, topk, seed=11,
                                              with_topk_length=with_len)
    sm_scale = d_qk**-0.5
    dq64, dkv64, out, lse, o_lo = _reference(q, kv, dout, indices, topk_length, sm_scale, d_v)
    assert not bwd_host.gathers_evict_first(kv)  # 14 MB of kv + accumulator fit in L2
    plain = bwd_host.backward(dout, None, q, kv, indices, topk_length, None, None, out, lse, o_lo,
                              sm_scale, d_v)
    monkeypatch.setattr(bwd_host, "_l2_bytes", lambda device: 0)
    assert bwd_host.gathers_evict_first(kv)
    # the rows as given: dq's sums in plain's order
    streamed = bwd_host.backward(dout, None, q, kv, indices, topk_length, None, None, out, lse,
                                 o_lo, sm_scale, d_v, sort_rows=False)
    torch.cuda.synchronize()
    assert torch.equal(streamed[0], plain[0])
    assert rel_l2(streamed[1], plain[1]) < 1e-3
    assert rel_l2(streamed[0], dq64) <= 1.5 * rel_l2(dq64.to(q.dtype), dq64)
    assert rel_l2(streamed[1], dkv64) <= 1.5 * rel_l2(dkv64.to(kv.dtype), dkv64)


@pytest.mark.parametrize("with_len,sink", [(False, False), (True, True)])
def test_sorted_rows_same_gradients(monkeypatch, with_len, sink):
    """The backward over each row's slots sorted first (chosen with the evict_first gathers)
    sees the same valid slots: dq and dkv against fp64 within 1.5x the bf16 floor, close to the
    unsorted run's, d_sink the unsorted run's to float32's rounding; the policy's choice and an
    explicit ``sort_rows=True`` give the same dq bitwise."""
    T, H, d_qk, d_v, S, topk = 3, 128, 576, 512, 4096, 2048
    q, kv, dout, indices, topk_length = _case(T, H, d_qk, d_v, S, topk, seed=12,
                                              with_topk_length=with_len)
    sm_scale = d_qk**-0.5
    dq64, dkv64, out, lse, o_lo = _reference(q, kv, dout, indices, topk_length, sm_scale, d_v)
    attn_sink = torch.full((H,), -1.5, device="cuda") if sink else None
    args = (dout, None, q, kv, indices, topk_length, None, attn_sink, out, lse, o_lo, sm_scale, d_v)
    assert not bwd_host.sorts_rows(kv, topk)
    plain = bwd_host.backward(*args)
    monkeypatch.setattr(bwd_host, "_l2_bytes", lambda device: 0)
    assert bwd_host.sorts_rows(kv, topk) and not bwd_host.sorts_rows(kv, 8193)
    ordered = bwd_host.backward(*args)
    forced = bwd_host.backward(*args, sort_rows=True)
    torch.cuda.synchronize()
    assert torch.equal(ordered[0], forced[0])  # dq: no atomics
    assert rel_l2(ordered[0], plain[0]) < 1e-3 and rel_l2(ordered[1], plain[1]) < 1e-3
    assert rel_l2(ordered[0], dq64) <= 1.5 * rel_l2(dq64.to(q.dtype), dq64)
    assert rel_l2(ordered[1], dkv64) <= 1.5 * rel_l2(dkv64.to(kv.dtype), dkv64)
    if sink:
        torch.testing.assert_close(ordered[2], plain[2], rtol=1e-5, atol=1e-6)


def test_gathers_evict_first_threshold():
    """Decided by kv's size: S = 8192 (28 MB with the accumulator) fits in an SM90 L2 of 50 MB
    or more; S = 32768 (113 MB) does not."""
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    assert 50 * 10**6 <= l2 < 113 * 10**6
    assert not bwd_host.gathers_evict_first(torch.empty(8192, 576, dtype=torch.bfloat16,
                                                        device="cuda"))
    assert bwd_host.gathers_evict_first(torch.empty(32768, 576, dtype=torch.bfloat16,
                                                    device="cuda"))


def test_dominated_rows_dq_with_and_without_o_lo():
    """Rows dominated by one key (P about 0.99): dq within 1.5x of the bf16 floor against fp64
    with o_lo and without it, since the dominant key's dS comes from its row's P and dP rather
    than from dpsum (the dpsum form's ``dP - dpsum`` cancels there unless O is near-fp32)."""
    T, H, d_qk, d_v, S, topk = 8, 64, 576, 512, 64, 64
    g = torch.Generator(device="cpu").manual_seed(3)
    kv = torch.randn(S, d_qk, generator=g).bfloat16()
    idx = torch.stack([torch.randperm(S, generator=g)[:topk] for _ in range(T)]).int()
    # peaked attention: each head's query is aligned with its token's first key
    q = (0.4 * kv[idx[:, 0].long()][:, None, :] + 0.05 * torch.randn(T, H, d_qk, generator=g)).bfloat16()
    dout = torch.randn(T, H, d_v, generator=g).bfloat16()
    q, kv, dout, idx = (t.cuda() for t in (q, kv, dout, idx))
    sm_scale = d_qk**-0.5
    dq64, _, out, lse, o_lo = _reference(q, kv, dout, idx, None, sm_scale, d_v)
    dq_lo = bwd_host.backward(dout, None, q, kv, idx, None, None, None, out, lse, o_lo, sm_scale,
                              d_v)[0]
    dq_no = bwd_host.backward(dout, None, q, kv, idx, None, None, None, out, lse, o_lo.new_empty(0),
                              sm_scale, d_v)[0]
    e_lo, e_no, floor = rel_l2(dq_lo, dq64), rel_l2(dq_no, dq64), rel_l2(dq64.to(q.dtype), dq64)
    print(f"dq rel-L2 with o_lo {e_lo:.3e}, without {e_no:.3e}, bf16 floor {floor:.3e}")
    assert e_lo <= 1.5 * floor and e_no <= 1.5 * floor


def test_canaries_and_untouched_rows():
    """dkv's fp32 accumulator (interleaved column order, see ``bwd_host.dkv_interleave``) sits
    inside a larger buffer filled with subnormal fp32 bit patterns (which a stray atomic add of
    +0.0 would flush to zero): the canaries before and after it, and every accumulator row that
    no valid slot references, keep their exact bits."""
    T, H, d_qk, d_v, S, topk = 4, 64, 576, 512, 96, 80
    q, kv, dout, indices, _ = _case(T, H, d_qk, d_v, S, topk, seed=5, invalid_frac=0.3)
    indices[2, :3] = torch.tensor([-1, S, 2**31 - 1], dtype=torch.int32)
    sm_scale = d_qk**-0.5
    _, _, out, lse, o_lo = _reference(q, kv, dout, indices, None, sm_scale, d_v)
    pad = 4 * d_qk  # canary elements on each side (keeps 16-byte alignment)
    pattern = torch.arange(1, (S * d_qk + 2 * pad) + 1, dtype=torch.int32, device="cuda") % 0x7FFFFF
    buf = pattern.view(torch.float32).clone()  # positive subnormals (exponent bits zero)
    assert (buf.abs() < torch.finfo(torch.float32).tiny).all() and (buf != 0).all()
    accum = buf[pad : pad + S * d_qk].view(S, d_qk)
    bwd_host.backward_into(dout, q, kv, indices, None, out, lse, o_lo, sm_scale, d_v, accum)
    torch.cuda.synchronize()
    bits, ref_bits = buf.view(torch.int32), pattern
    assert torch.equal(bits[:pad], ref_bits[:pad])
    assert torch.equal(bits[-pad:], ref_bits[-pad:])
    valid = _valid(indices.long(), None, S)
    touched = torch.zeros(S, dtype=torch.bool, device="cuda")
    touched[indices.long()[valid]] = True
    assert (~touched).any()
    rows = bits[pad : pad + S * d_qk].view(S, d_qk)
    assert torch.equal(rows[~touched], ref_bits[pad : pad + S * d_qk].view(S, d_qk)[~touched])
    assert torch.isfinite(accum).all()


def test_interleaved_accumulator_contract():
    """backward_into adds into the interleaved accumulator: seeded with dkv_interleave(seed) and
    read back with dkv_deinterleave, it equals seed + the dkv gradient (fp64 reference)."""
    T, H, d_qk, d_v, S, topk = 4, 64, 576, 512, 96, 80
    q, kv, dout, indices, _ = _case(T, H, d_qk, d_v, S, topk, seed=9, invalid_frac=0.2)
    sm_scale = d_qk**-0.5
    _, dkv64, out, lse, o_lo = _reference(q, kv, dout, indices, None, sm_scale, d_v)
    seed = torch.randn(S, d_qk, device="cuda")
    x = torch.arange(S * d_qk, device="cuda", dtype=torch.float32).view(S, d_qk)
    assert torch.equal(bwd_host.dkv_deinterleave(bwd_host.dkv_interleave(x)), x)
    assert not torch.equal(bwd_host.dkv_interleave(x), x)
    accum = bwd_host.dkv_interleave(seed)
    bwd_host.backward_into(dout, q, kv, indices, None, out, lse, o_lo, sm_scale, d_v, accum)
    got = bwd_host.dkv_deinterleave(accum) - seed
    assert rel_l2(got, dkv64) < 1e-2
    assert torch.equal(bwd_host.dkv_from_accum(accum, torch.float32),
                       bwd_host.dkv_deinterleave(accum))


def test_misaligned_accumulator_asserted():
    q, kv, dout, indices, _ = _case(2, 16, 576, 512, 32, 16, seed=7)
    lse = torch.zeros(2, 16, device="cuda")
    buf = torch.zeros(32 * 576 + 1, device="cuda")
    with pytest.raises(AssertionError):
        bwd_host.backward_into(dout, q, kv, indices, None, dout, lse, dout.new_empty(0), 0.1, 512,
                               buf[1:].view(32, 576))


# -- the deterministic backward (dkv in 64-bit fixed point) -----------------------------------


def _det_case(T, H, S, topk, seed, causal, sink):
    q, kv, dout, indices, _ = _case(T, H, 576, 512, S, topk, seed=seed)
    pos = torch.randint(S // 2, S, (T,), device="cuda", dtype=torch.int32) if causal else None
    attn_sink = torch.randn(H, device="cuda") if sink else None
    return q, kv, dout, indices, pos, attn_sink


@pytest.mark.parametrize("causal,sink", [(False, False), (True, True)])
def test_deterministic_gradients_vs_fp64(causal, sink):
    """The fixed-point backward against fp64 autograd at H 128, topk 2048: dq, dkv and d_sink
    within the same bound as the default backward (1.5x the bf16 floor; d_sink, float32, to
    1e-5), untouched kv rows exactly 0."""
    T, H, S, topk = 32, 128, 4096, 2048
    q, kv, dout, indices, pos, attn_sink = _det_case(T, H, S, topk, 5, causal, sink)
    sm_scale = 576**-0.5
    q64, kv64 = q.double().requires_grad_(), kv.double().requires_grad_()
    sink64 = attn_sink.double().requires_grad_() if sink else None
    out64, lse64 = reference_sparse_mla_fp64(q64, kv64, indices, None, sm_scale, 512,
                                             q_positions=pos, attn_sink=sink64)
    (out64 * dout.double()).sum().backward()
    out = out64.detach().to(q.dtype)
    o_lo = (out64.detach() - out.double()).to(q.dtype)
    dq, dkv, d_sink = bwd_host.backward(dout, None, q, kv, indices, None, pos, attn_sink, out,
                                        lse64.detach().float(), o_lo, sm_scale, 512,
                                        deterministic=True)
    torch.cuda.synchronize()
    assert dkv.dtype == kv.dtype and torch.isfinite(dkv).all()
    err_dq, err_dkv = rel_l2(dq, q64.grad), rel_l2(dkv, kv64.grad)
    floor_dq, floor_dkv = rel_l2(q64.grad.bfloat16(), q64.grad), rel_l2(kv64.grad.bfloat16(), kv64.grad)
    print(f"deterministic causal={causal} sink={sink}: dq {err_dq:.3e} (floor {floor_dq:.3e}), "
          f"dkv {err_dkv:.3e} (floor {floor_dkv:.3e})")
    assert err_dq <= 1.5 * floor_dq
    assert err_dkv <= 1.5 * floor_dkv
    if sink:
        assert rel_l2(d_sink, sink64.grad) < 1e-5
    valid = _valid(indices.long(), None, S)
    if causal:
        valid &= indices.long() <= pos.long()[:, None]
    touched = torch.zeros(S, dtype=torch.bool, device="cuda")
    touched[indices.long()[valid]] = True
    assert (dkv[~touched] == 0).all()


@pytest.mark.parametrize("causal,sink", [(False, False), (True, True)])
def test_deterministic_bitwise_over_runs_streams_and_graph_replay(causal, sink):
    """At T 4096, S 8192, H 128, topk 2048: dq, dkv and d_sink bitwise identical over 5 runs,
    a run on a second stream and a CUDA-graph replay; dkv equal to the default (float32
    atomics) backward's to its rounding."""
    T, H, S, topk = 4096, 128, 8192, 2048
    q, kv, dout, indices, pos, attn_sink = _det_case(T, H, S, topk, 6, causal, sink)
    sm_scale = 576**-0.5
    from mla_inductor.kernels.sm90 import fwd_host

    out, lse, o_lo, _ = fwd_host.forward(q, kv, indices, None, pos, attn_sink, sm_scale, 512, 0.0,
                                         True)

    def run():
        dq, dkv, d_sink = bwd_host.backward(dout, None, q, kv, indices, None, pos, attn_sink, out,
                                            lse, o_lo, sm_scale, 512, deterministic=True)
        return [dq, dkv] + ([d_sink] if sink else [])

    first = run()
    for _ in range(4):
        assert all(torch.equal(a, b) for a, b in zip(first, run()))
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        on_side = run()
    torch.cuda.current_stream().wait_stream(side)
    assert all(torch.equal(a, b) for a, b in zip(first, on_side))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = run()
    graph.replay()
    torch.cuda.synchronize()
    assert all(torch.equal(a, b) for a, b in zip(first, captured))
    default = bwd_host.backward(dout, None, q, kv, indices, None, pos, attn_sink, out, lse, o_lo,
                                sm_scale, 512)
    assert torch.equal(default[0], first[0])  # dq has no atomics on either path
    assert rel_l2(first[1], default[1]) < 1e-4



def test_deterministic_mode_eager_and_compiled_steps_are_bitwise_equal():
    """Under torch.use_deterministic_algorithms(True), sparse_mla's gradients on sm90 are bitwise
    equal over eager steps and steps of torch.compile (default and reduce-overhead)."""
    import mla_inductor

    T, H, S = 256, 128, 4096
    q, kv, dout, indices, _, _ = _det_case(T, H, S, 2048, 7, False, False)

    def step(fn):
        qq, kk = q.clone().requires_grad_(), kv.clone().requires_grad_()
        fn(qq, kk).backward(dout)
        return qq.grad.clone(), kk.grad.clone()

    def f(a, b):
        return mla_inductor.sparse_mla(a, b, indices)

    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        with mla_inductor.use_backend("sm90"):
            runs = [step(f), step(f)]
            for mode in (None, "reduce-overhead"):
                torch._dynamo.reset()
                compiled = torch.compile(f, mode=mode, fullgraph=True)
                runs += [step(compiled) for _ in range(3)]
    finally:
        torch.use_deterministic_algorithms(before)
    for grads in runs[1:]:
        assert all(torch.equal(a, b) for a, b in zip(runs[0], grads))


@pytest.mark.parametrize("deterministic", [False, True])
def test_dominant_key_with_sink_dlse_and_empty_slots(deterministic):
    """Rows whose top key holds all but about 1e-7 of the mass (ladder gap 20, H 128, topk
    2048, d_qk 576), with a sink per head that holds a share of the mass off the top key,
    a gradient reaching lse, empty slots and a row whose slots are all empty: the dominant key's
    dS comes from its row (the mass off it includes the sink's probability, and dlse enters),
    so dq and dkv are within 1.5x of the bf16 floor against fp64 autograd, and d_sink is too;
    the fixed-point accumulation (deterministic) gives the same dq, bitwise."""
    from mla_inductor import numerics as N

    T, H, d_qk, d_v, S, topk = 6, 128, 576, 512, 4096, 2048
    sm_scale = d_qk**-0.5
    q, kv, indices = N.ladder_inputs(T, H, d_qk, topk=topk, kv_len=S, gap=20.0, seed=4,
                                     device="cuda")
    indices[0, 1000:1100] = -1
    indices[1, 5:9] = S
    indices[2] = -1  # no valid slot
    # a sink about 16 below each head's median top logit (its probability near e**-16)
    s_top = (q.double() * kv.double()[indices[:, 0].clamp(min=0).long()][:, None, :]).sum(-1) * sm_scale
    sink = (s_top.median(0).values - 16.0).float()
    g = torch.Generator(device="cpu").manual_seed(5)
    dout = torch.randn(T, H, d_v, generator=g).bfloat16().cuda()
    dlse = torch.randn(T, H, generator=g).cuda()

    q64, kv64, sink64 = (x.double().requires_grad_() for x in (q, kv, sink))
    out64, lse64 = reference_sparse_mla_fp64(q64, kv64, indices, None, sm_scale, d_v,
                                             attn_sink=sink64)
    ((out64 * dout.double()).sum() + (lse64 * dlse.double()).sum()).backward()
    out = out64.detach().to(q.dtype)
    o_lo = (out64.detach() - out.double()).to(q.dtype)
    lse = lse64.detach().float()
    runs = [bwd_host.backward(dout, dlse, q, kv, indices, None, None, sink, out, lse, o_lo,
                              sm_scale, d_v, deterministic=deterministic)
            for _ in range(2 if deterministic else 1)]
    dq, dkv, d_sink = runs[0]
    torch.cuda.synchronize()
    full = indices[3:].long()  # rows without empty slots
    s = (q.double()[3:, :, None, :] * kv.double()[full][:, None]).sum(-1) * sm_scale
    p = torch.softmax(torch.cat([s, sink.double()[None, :, None].expand(T - 3, H, 1)], -1), -1)
    # peaked: below 2**-17, the precision of dpsum from out + o_lo, the dpsum form is noise
    assert (p[..., 1:].sum(-1) < 1e-6).all()
    # on a quarter of the rows at least, the sink holds a tenth of the mass off the top key
    assert (p[..., -1] > 0.1 * p[..., 1:-1].sum(-1)).float().mean() > 0.25
    assert rel_l2(dq, q64.grad) <= 1.5 * rel_l2(q64.grad.to(q.dtype), q64.grad)
    assert rel_l2(dkv, kv64.grad) <= 1.5 * rel_l2(kv64.grad.to(kv.dtype), kv64.grad)
    assert rel_l2(d_sink, sink64.grad) < 1e-4
    assert (dq[2] == 0).all()
    if deterministic:
        assert torch.equal(runs[1][0], dq) and torch.equal(runs[1][1], dkv)
        plain = bwd_host.backward(dout, dlse, q, kv, indices, None, None, sink, out, lse, o_lo,
                                  sm_scale, d_v)
        assert torch.equal(plain[0], dq)
        assert rel_l2(plain[1], dkv) < 1e-4
