"""Fake kernels: output metadata, and the readable error for each bad input, at trace time."""

from __future__ import annotations

import math
import re

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import mla_inductor  # noqa: F401
from mla_inductor import sparse_mla

fwd = torch.ops.mla_inductor.sparse_mla_fwd
bwd = torch.ops.mla_inductor.sparse_mla_bwd


def _good(T=6, H=4, d_qk=32, S=10, topk=5, dtype=torch.bfloat16):
    return (
        torch.randn(T, H, d_qk, dtype=dtype),
        torch.randn(S, d_qk, dtype=dtype),
        torch.randint(-1, S, (T, topk), dtype=torch.int32),
    )


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("return_o_lo", [False, True])
def test_fake_outputs_match_real_metadata(return_o_lo, dtype):
    q, kv, idx = _good(dtype=dtype)
    pos = torch.arange(6, dtype=torch.int32) + 4
    sink = torch.randn(4)
    real = fwd(q, kv, idx, None, pos, sink, 0.2, 16, 0.0, return_o_lo, True)
    dreal = bwd(torch.randn_like(real[0]), torch.randn(6, 4), q, kv, idx, None, pos, sink,
                *real[:3], 0.2, 16)
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        fq, fkv, fidx, fpos, fsink = (mode.from_tensor(t) for t in (q, kv, idx, pos, sink))
        fake = fwd(fq, fkv, fidx, None, fpos, fsink, 0.2, 16, 0.0, return_o_lo, True)
        dfake = bwd(torch.empty_like(fake[0]), torch.empty(6, 4), fq, fkv, fidx, None, fpos,
                    fsink, *fake[:3], 0.2, 16)
    for r, f in zip(real + dreal, fake + dfake):
        assert (r.shape, r.stride(), r.dtype) == (f.shape, f.stride(), f.dtype)
    assert fake[2].shape == ((6, 4, 16) if return_o_lo else (0,))
    assert fake[2].dtype == real[2].dtype == dtype  # o_lo in the output's dtype


def _bad_inputs():
    q, kv, idx = _good()
    qb, kvb, idxb = q.view(2, 3, 4, 32), kv[None].expand(2, -1, -1), idx.view(2, 3, 5)
    i32 = torch.int32
    return {
        "q rank": ((q[0], kv, idx), {}, "q must be"),
        "kv rank": ((q, kv[None, None], idx), {}, "kv must be"),
        "indices rank": ((q, kv, idx[None, None]), {}, "indices must be"),
        "kv heads": ((q, torch.stack([kv, kv], 1), idx), {}, "kv must have a head dimension of 1"),
        "batched kv, unbatched q": ((q, torch.stack([kv, kv]), idx), {}, "a batched kv or indices needs a batched q"),
        "q not a tensor": ((q.tolist(), kv, idx), {}, "q must be a torch.Tensor, got list"),
        "index heads": ((q, kv, idx[:, None].expand(6, 4, 5)), {}, "indices must have a head dimension of 1"),
        "d_qk": ((q, kv[:, :16], idx), {}, "mismatched d_qk"),
        "d_v > d_qk": ((q, kv, idx), {"d_v": 64}, "d_v (64) must be <= d_qk (32)"),
        "T mismatch": ((q, kv, idx[:4]), {}, "token count mismatch"),
        "float indices": ((q, kv, idx.float()), {}, "indices must be an integer tensor"),
        "int16 indices": ((q, kv, idx.short()), {}, "indices must be an integer tensor"),
        "dtype": ((q.to(torch.float64), kv.to(torch.float64), idx), {}, "unsupported dtype"),
        "kv dtype": ((q, kv.half(), idx), {}, "kv dtype"),
        "topk_length shape": ((q, kv, idx), {"topk_length": torch.zeros(5, dtype=i32)}, "topk_length must be [T]"),
        "topk_length dtype": ((q, kv, idx), {"topk_length": torch.zeros(6)}, "topk_length must be int32"),
        "devices": ((q, kv.to("meta"), idx), {}, "different devices"),
        "batched kv rank": ((qb, kv, idxb), {}, "batched kv must be [B, S, d_qk] or [B, S, 1, d_qk], got shape (10, 32)"),
        "batched indices rank": ((qb, kvb, idx), {}, "batched indices must be [B, T, topk] or [B, T, 1, topk], got shape (6, 5)"),
        "batch size": ((qb, kvb[:1], idxb), {}, "batch size differs: q [B, T, H, d_qk] has B=2, kv [B, S, d_qk] has 1, indices [B, T, topk] has 2"),
        "batched T": ((qb, kvb, idxb[:, :2]), {}, "token count mismatch: q [B, T, H, d_qk] has T=3, indices [B, T, topk] has T=2"),
        "batched topk_length [T, B]": ((qb, kvb, idxb), {"topk_length": torch.zeros(3, 2, dtype=i32)}, "batched topk_length must be [B, T] = [2, 3], got shape (3, 2)"),
        "batched topk_length [B*T]": ((qb, kvb, idxb), {"topk_length": torch.zeros(6, dtype=i32)}, "batched topk_length must be [B, T] = [2, 3], got shape (6,)"),
        "threshold nan": ((q, kv, idx), {"rescale_threshold": math.nan}, "rescale_threshold must be finite, >= 0 and < 64 for torch.bfloat16"),
        "threshold inf": ((q, kv, idx), {"rescale_threshold": math.inf}, "rescale_threshold must be finite"),
        "threshold negative": ((q, kv, idx), {"rescale_threshold": -1.0}, "rescale_threshold must be finite, >= 0"),
        "threshold 1e9": ((q, kv, idx), {"rescale_threshold": 1e9}, "got 1000000000.0"),
        "threshold 15 in fp16": ((q.half(), kv.half(), idx), {"rescale_threshold": 15.0}, "< 15 for torch.float16"),
        "sm_scale tensor": ((q, kv, idx), {"sm_scale": torch.tensor(0.1)}, "sm_scale must be a Python float, got a 0-d tensor"),
        "d_v tensor": ((q, kv, idx), {"d_v": torch.tensor(16)}, "d_v must be a Python int, got a 0-d tensor"),
        "threshold tensor": ((q, kv, idx), {"rescale_threshold": torch.tensor(8.0)}, "rescale_threshold must be a Python float"),
        "d_v float": ((q, kv, idx), {"d_v": 16.0}, "d_v must be a Python int, got 16.0"),
    }


@pytest.mark.parametrize("case", list(_bad_inputs()))
def test_bad_input_raises_in_eager(case):
    args, kwargs, message = _bad_inputs()[case]
    with pytest.raises(RuntimeError, match=re.escape(message)) as info:
        sparse_mla(*args, **{"d_v": 16, **kwargs})
    assert str(info.value).startswith("sparse_mla: ")


# The message ends the second line of Dynamo's error (its "Explanation"), raised while Dynamo
# runs the entry op on FakeTensors; the argument-type checks of the Python wrapper come out of
# Dynamo's "observed exception" report, further down.
_WRAPPER_CHECKS = ("q not a tensor", "sm_scale tensor", "d_v tensor", "threshold tensor", "d_v float")


@pytest.mark.parametrize("case", [c for c in _bad_inputs() if c != "devices"])
def test_bad_input_raises_at_trace_time(case):
    """Under torch.compile the same message surfaces while tracing, before any kernel runs."""
    args, kwargs, message = _bad_inputs()[case]
    torch._dynamo.reset()
    compiled = torch.compile(lambda *a: sparse_mla(*a, **{"d_v": 16, **kwargs}), backend="eager",
                             fullgraph=True)
    with pytest.raises(Exception, match=re.escape(message)) as info:
        compiled(*args)
    if case not in _WRAPPER_CHECKS:
        assert "sparse_mla:" in str(info.value).splitlines()[1]


def test_a_given_rescale_threshold_is_checked_once(monkeypatch):
    """By sparse_mla_fwd alone (its body in eager; its fake at trace time), which the entry op
    passes it to unchanged."""
    from mla_inductor.ops import sparse_mla as ops

    checked = []
    real = ops.check_rescale_threshold
    monkeypatch.setattr(ops, "check_rescale_threshold", lambda *a: checked.append(a) or real(*a))
    q, kv, idx = _good()
    sparse_mla(q, kv, idx, d_v=16, rescale_threshold=4.0)
    assert checked == [(4.0, torch.bfloat16)]


def test_what_a_compiled_caller_sees():
    """docs/api.md's account: a RuntimeError whose first line is Dynamo's and whose second ends
    with our message; under ``set_stance("force_eager")`` our RuntimeError alone."""
    q, kv, idx = _good()
    message = "sparse_mla: mismatched d_qk: q has 32, kv has 16"
    torch._dynamo.reset()
    compiled = torch.compile(lambda *a: sparse_mla(*a, d_v=16), backend="eager", fullgraph=True)
    with pytest.raises(RuntimeError) as info:
        compiled(q, kv[:, :16], idx)
    lines = str(info.value).splitlines()
    assert type(info.value).__name__ == "TorchRuntimeError"
    assert lines[0] == "RuntimeError when making fake tensor call"
    assert lines[1].startswith("  Explanation: Dynamo failed to run FX node with fake tensors: "
                               "call_function mla_inductor.sparse_mla(*(FakeTensor(")
    assert lines[1].endswith(f"got RuntimeError({message!r})")
    assert "from user code:" in lines
    with torch.compiler.set_stance("force_eager"), pytest.raises(RuntimeError) as info:
        compiled(q, kv[:, :16], idx)
    assert type(info.value) is RuntimeError and str(info.value) == message


def test_fake_kernel_checks_the_op_directly():
    q, kv, idx = _good()
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        fq, fkv = mode.from_tensor(q), mode.from_tensor(kv)
        with pytest.raises(RuntimeError, match="indices must be an integer tensor"):
            fwd(fq, fkv, mode.from_tensor(idx.long()), None, None, None, 0.1, 16, 0.0, False, False)
        with pytest.raises(RuntimeError, match=r"attn_sink must be \[H\] = \[4\]"):
            fwd(fq, fkv, mode.from_tensor(idx), None, None, torch.zeros(3), 0.1, 16, 0.0, False,
                False)
        with pytest.raises(RuntimeError, match="q_positions must be int32"):
            fwd(fq, fkv, mode.from_tensor(idx), None, torch.zeros(6, dtype=torch.int64), None, 0.1,
                16, 0.0, False, False)
        with pytest.raises(RuntimeError, match="lse must be float32"):
            out = torch.empty(6, 4, 16, dtype=torch.bfloat16)
            lse = torch.empty(6, 4, dtype=torch.bfloat16)
            bwd(out, None, fq, fkv, mode.from_tensor(idx), None, None, None, out, lse,
                torch.empty(0), 0.1, 16)
        with pytest.raises(RuntimeError, match="dlse must be float32"):
            out = torch.empty(6, 4, 16, dtype=torch.bfloat16)
            bwd(out, torch.empty(6, 5), fq, fkv, mode.from_tensor(idx), None, None, None, out,
                torch.empty(6, 4), torch.empty(0, dtype=torch.bfloat16), 0.1, 16)
        with pytest.raises(RuntimeError, match="o_lo must be empty or"):
            out = torch.empty(6, 4, 16, dtype=torch.bfloat16)
            bwd(out, None, fq, fkv, mode.from_tensor(idx), None, None, None, out, torch.empty(6, 4),
                torch.empty(6, 4, 3, dtype=torch.bfloat16), 0.1, 16)
