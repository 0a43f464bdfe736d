"""torch.ops.mla_inductor.head_matmul (mla_inductor.integrations.transformers.head_matmul): the absorbed form's
per-head GEMMs written token-major, against the einsum + cat they replace (float64 values and
gradients), without a copy of the query or of the gradients, under torch.compile and opcheck."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from mla_inductor.integrations.transformers.head_matmul import head_matmul

N, H, NOPE, ROPE, RANK, V = 24, 3, 8, 4, 16, 6
ROOT = Path(__file__).resolve().parents[2]


def _operands(dtype=torch.float64, seed=0, n=N):
    """As the layer passes them: q_nope and q_rope split from one ``[N, H, NOPE + ROPE]`` tensor,
    W_uk and W_uv views of one ``[H, NOPE + V, RANK]`` weight (W_uv transposed)."""
    gen = torch.Generator().manual_seed(seed)
    q_b = torch.randn(n, H, NOPE + ROPE, generator=gen, dtype=dtype).requires_grad_()
    weight = torch.randn(H, NOPE + V, RANK, generator=gen, dtype=dtype).requires_grad_()
    o_lat = torch.randn(n, H, RANK, generator=gen, dtype=dtype).requires_grad_()
    return q_b, weight, o_lat


def _layer(q_b, weight, o_lat, matmul):
    """The query and the output as the absorbed layer computes them, by ``matmul``."""
    q_nope, q_rope = q_b.split([NOPE, ROPE], -1)
    return (matmul(q_nope, weight[:, :NOPE], q_rope),
            matmul(o_lat, weight[:, NOPE:].transpose(1, 2), None))


def _einsum_cat(x, w, tail):
    y = torch.einsum("nhk,hkm->nhm", x, w)
    return y if tail is None else torch.cat((y, tail), -1)


def test_values_and_gradients_match_einsum_and_cat_in_float64():
    q_b, weight, o_lat = _operands()
    q, out = _layer(q_b, weight, o_lat, head_matmul)
    assert q.shape == (N, H, RANK + ROPE) and out.shape == (N, H, V)
    assert q.is_contiguous() and out.is_contiguous()
    gen = torch.Generator().manual_seed(1)
    dq, d_out = torch.randn(q.shape, generator=gen, dtype=q.dtype), torch.randn(
        out.shape, generator=gen, dtype=out.dtype)
    grads = torch.autograd.grad((q, out), (q_b, weight, o_lat), (dq, d_out))
    q_ref, out_ref = _layer(q_b, weight, o_lat, _einsum_cat)
    refs = torch.autograd.grad((q_ref, out_ref), (q_b, weight, o_lat), (dq, d_out))
    torch.testing.assert_close(q, q_ref, rtol=1e-14, atol=1e-14)
    torch.testing.assert_close(out, out_ref, rtol=1e-14, atol=1e-14)
    for g, r in zip(grads, refs):
        torch.testing.assert_close(g, r, rtol=1e-13, atol=1e-13)
    # d o_lat reaches the attention's backward token-major, as it takes it (no copy there)
    assert grads[2].is_contiguous() and not refs[2].is_contiguous()


def test_gradcheck_and_gradgradcheck():
    q_b, weight, o_lat = _operands()
    args = (q_b, weight, o_lat)
    assert torch.autograd.gradcheck(lambda *a: _layer(*a, head_matmul), args)
    assert torch.autograd.gradgradcheck(lambda *a: _layer(*a, head_matmul), args)


def test_only_the_frozen_operand_gets_no_gradient():
    q_b, weight, o_lat = _operands()
    weight.requires_grad_(False)
    q, _ = _layer(q_b, weight, o_lat, head_matmul)
    (dq_b,) = torch.autograd.grad(q.sum(), q_b)
    torch.testing.assert_close(dq_b, torch.autograd.grad(
        _layer(q_b, weight, o_lat, _einsum_cat)[0].sum(), q_b)[0])


def _allocated(fn) -> list[int]:
    """The sizes of the CPU allocations ``fn()`` makes, in bytes: the profiler's memory events,
    each counted for the innermost op that made it."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    return sorted(e.self_cpu_memory_usage for e in prof.events() if e.self_cpu_memory_usage > 0)


def test_the_gemm_writes_into_the_query_and_no_copy_is_made():
    """float32 (the CPU GEMM takes every operand in place): the forward allocates the query alone
    (the GEMM's output lands in it), the backward its two gradients alone (no contiguous copy of
    the query's gradient, of its W_uk part or of a head-major product)."""
    q_b, weight, _ = _operands(torch.float32)
    q_nope, q_rope = q_b.detach().split([NOPE, ROPE], -1)
    w_uk = weight.detach()[:, :NOPE]
    q_bytes = N * H * (RANK + ROPE) * 4
    assert _allocated(lambda: head_matmul(q_nope, w_uk, q_rope)) == [q_bytes]

    q_nope.requires_grad_(), w_uk.requires_grad_()
    q = head_matmul(q_nope, w_uk, q_rope)
    dq = torch.randn_like(q)
    sizes = _allocated(lambda: torch.autograd.grad(q, (q_nope, w_uk), dq, retain_graph=True))
    assert sizes == sorted([N * H * NOPE * 4, H * NOPE * RANK * 4])


def test_compiles_fullgraph_with_dynamic_shapes():
    def step(q_b, weight, o_lat):
        q, out = _layer(q_b, weight, o_lat, head_matmul)
        return q.square().sum() + out.square().sum()

    compiled = torch.compile(step, fullgraph=True, dynamic=True, backend="aot_eager")
    for n in (N, N + 5):
        args = _operands(torch.float32, n=n)
        eager_args = [a.detach().clone().requires_grad_() for a in args]
        got, want = compiled(*args), step(*eager_args)
        torch.testing.assert_close(got, want)
        for g, w in zip(torch.autograd.grad(got, args),
                        torch.autograd.grad(want, eager_args)):
            torch.testing.assert_close(g, w)


@pytest.mark.parametrize("tail", [True, False])
def test_opcheck(tail):
    q_b, weight, _ = _operands(torch.float32)
    q_nope, q_rope = q_b.split([NOPE, ROPE], -1)
    torch.library.opcheck(head_matmul, (q_nope, weight[:, :NOPE], q_rope if tail else None))


_COMPILE_THE_LAYER = """
import json, re, sys, torch
sys.path.insert(0, "tests/integrations")
from test_head_matmul import _layer, _operands, head_matmul
from torch._inductor.utils import run_and_get_code

def loss(q_b, weight, o_lat):
    q, out = _layer(q_b, weight, o_lat, head_matmul)
    return q.square().sum() + out.square().sum()

def step(fn, args):
    value = fn(*args)
    return value, torch.autograd.grad(value, args)

args = _operands(torch.float32)
want = step(loss, args)
with torch._inductor.config.patch(implicit_fallbacks=sys.argv[1] == "1", fx_graph_cache=False):
    got, code = run_and_get_code(step, torch.compile(loss, fullgraph=True), args)
torch.testing.assert_close(got, want)
print(json.dumps([re.sub(r"^# AOT ID: .*\\n", "", c) for c in code]))
"""


def test_inductor_without_implicit_fallbacks_generates_the_same_code():
    """The op's explicit fallback (registered from its fake kernel) keeps the layout rule of the
    implicit one: with ``implicit_fallbacks=False`` inductor compiles the layer's forward and
    backward to the same code as with implicit fallbacks (each in a fresh process: a fallback,
    once made, stays registered), and the values and gradients match eager."""
    codes = []
    for implicit in ("1", "0"):
        done = subprocess.run([sys.executable, "-c", _COMPILE_THE_LAYER, implicit], cwd=ROOT,
                              capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-4000:]
        codes.append(json.loads(done.stdout.splitlines()[-1]))
    assert len(codes[1]) == 2  # the forward's and the backward's
    assert "torch.ops.mla_inductor.head_matmul.default" in "".join(codes[1])
    assert codes[0] == codes[1]
