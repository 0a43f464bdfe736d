"""Non-finite values, on every backend this machine runs: a kv row that no valid slot names is
never read (its NaN or inf reaches no output and no gradient), and a NaN or inf that a valid slot
does read propagates the same way everywhere (out and lse NaN on the rows it reaches)."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import CPU_BACKENDS, backend_device, backend_params, random_inputs

from mla_inductor import sparse_mla, use_backend

# DeepSeek's widths, which every backend runs; topk 70 is not a multiple of the kernels' 64-key
# blocks, so the last block is padded with empty slots.
T, H, D_QK, D_V, S, TOPK = 6, 4, 576, 512, 40, 70
UNNAMED = range(0, 6)  # rows no valid slot names: row 0 is where empty slots are redirected


def _indices():
    """Indices naming only rows >= 6, with every kind of empty slot: -1, S, 2**31 - 1, slots past
    ``topk_length`` that hold row 0, and one token with no valid slot at all."""
    g = torch.Generator().manual_seed(3)
    idx = torch.randint(6, S, (T, TOPK), generator=g, dtype=torch.int32)
    idx[:, 1], idx[:, 2], idx[:, 3] = -1, S, 2**31 - 1
    idx[:, 60:] = 0  # past topk_length below: empty, although they look like row 0
    idx[4] = -1
    return idx, torch.tensor([60, 60, 5, 60, 70, 60], dtype=torch.int32)


def _run(backend, q, kv, idx, lengths, dout):
    """Public forward and backward through ``backend``; ``(out, lse, dq, dkv)`` on the CPU."""
    dev = backend_device(backend)
    q = q.detach().to(dev).requires_grad_(True)
    kv = kv.detach().to(dev).requires_grad_(True)
    with use_backend(backend):
        out, lse = sparse_mla(q, kv, idx.to(dev), topk_length=lengths.to(dev), d_v=D_V,
                              return_lse=True)
        out.backward(dout.to(dev))
    return tuple(t.detach().cpu() for t in (out, lse, q.grad, kv.grad))


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
@pytest.mark.parametrize("backend", backend_params())
def test_rows_no_valid_slot_names_never_reach_a_result(backend, value):
    q, kv, _ = random_inputs(T, H, D_QK, S, TOPK)
    idx, lengths = _indices()
    dout = torch.randn(T, H, D_V, generator=torch.Generator().manual_seed(4)).bfloat16()
    clean = _run(backend, q, kv, idx, lengths, dout)
    poisoned = kv.clone()
    poisoned[UNNAMED.start:UNNAMED.stop] = value
    dirty = _run(backend, q, poisoned, idx, lengths, dout)
    for name, a, b in zip(("out", "lse", "dq", "dkv"), clean, dirty):
        finite = torch.isfinite(a) | (a == -math.inf)  # lse is -inf on the token with no slot
        assert finite.all(), name
        if backend in CPU_BACKENDS:
            assert torch.equal(a, b), name  # the values are never read: bitwise the same
        else:  # the GPU backward sums dkv with atomics: not bitwise reproducible
            torch.testing.assert_close(b, a, rtol=1e-2, atol=1e-2, msg=name)
    assert torch.all(dirty[3][UNNAMED.start:UNNAMED.stop] == 0)
    assert torch.all(dirty[1][4] == -math.inf) and torch.all(dirty[0][4] == 0)


# (value put into kv[7, 0], value put into q[0, :, 0]); column 0 of q and kv is made positive, so
# that an inf there gives a +inf score (a -inf score would only drop the key).
CASES = {
    "nan in kv": (math.nan, None),
    "inf in kv": (math.inf, None),
    "nan in q": (None, math.nan),
    "inf in q": (None, math.inf),
    "score overflows fp32": (1e30, 1e30),
}


def _named(case):
    """Inputs in which token 0 names row 7 and no other token does, with ``CASES[case]``."""
    q, kv, _ = random_inputs(T, H, D_QK, S, TOPK)
    q[..., 0], kv[:, 0] = q[..., 0].abs() + 0.5, kv[:, 0].abs() + 0.5
    idx, lengths = _indices()
    idx[1:] = torch.where(idx[1:] == 7, 8, idx[1:])
    idx[0, 0] = 7
    in_kv, in_q = CASES.get(case, (None, None))
    if in_kv is not None:
        kv[7, 0] = in_kv
    if in_q is not None:
        q[0, :, 0] = in_q
    return q, kv, idx, lengths


DOUT = torch.ones(T, H, D_V, dtype=torch.bfloat16)


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("backend", backend_params())
def test_a_named_nonfinite_value_makes_that_output_row_nan(backend, case):
    """out is NaN on every head of token 0 and only there; the other tokens are unchanged."""
    out, lse, _, _ = _run(backend, *_named(case), DOUT)
    clean_out, clean_lse, _, _ = _run(backend, *_named("finite"), DOUT)
    assert torch.isnan(out[0]).all()
    assert torch.isfinite(out[1:]).all()
    torch.testing.assert_close(out[1:], clean_out[1:], rtol=0, atol=0)
    torch.testing.assert_close(lse[1:], clean_lse[1:], rtol=0, atol=0)


_EPILOGUE = ("FA4's epilogue reports lse -inf (empty) when the row sum is NaN "
             "(row_sum == 0 or row_sum != row_sum)")


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize(
    "backend",
    [p if p.values[0] in CPU_BACKENDS + ("sm90",) else
     pytest.param(*p.values, id=p.id, marks=[*p.marks, pytest.mark.xfail(reason=_EPILOGUE,
                                                                          strict=True)])
     for p in backend_params()],
)
def test_a_named_nonfinite_value_makes_lse_nan(backend, case):
    """lse is NaN (not the -inf of a row with no valid slot) where a score is NaN or +inf."""
    _, lse, _, _ = _run(backend, *_named(case), DOUT)
    assert torch.isnan(lse[0]).all()
