"""Differentiation modes beyond reverse-mode autograd: refused with a ``sparse_mla:`` error
instead of a zero tangent or an error about code the user never wrote; ``torch.func.vmap``
works."""

from __future__ import annotations

import pytest
import torch
import torch.autograd.forward_ad as fwAD
from conftest import random_inputs, reference_sparse_mla_fp64

from mla_inductor import sparse_mla

T, H, D, S, K, DV = 5, 2, 16, 12, 4, 8


def _inputs():
    return random_inputs(T, H, D, S, K, dtype=torch.float32, invalid_frac=0.2)


def _attend(q, kv, idx):
    return sparse_mla(q, kv, idx, d_v=DV)


FUNC_TRANSFORMS = {
    "jvp": lambda f, q, kv: torch.func.jvp(f, (q, kv), (torch.ones_like(q), torch.ones_like(kv))),
    "jacfwd": lambda f, q, kv: torch.func.jacfwd(f)(q, kv),
    "grad": lambda f, q, kv: torch.func.grad(lambda q, kv: f(q, kv).sum())(q, kv),
    "vjp": lambda f, q, kv: torch.func.vjp(f, q, kv),
    "jacrev": lambda f, q, kv: torch.func.jacrev(f)(q, kv),
}


@pytest.mark.parametrize("transform", list(FUNC_TRANSFORMS))
def test_differentiating_func_transforms_are_refused(transform):
    q, kv, idx = _inputs()
    with pytest.raises(RuntimeError, match=r"^sparse_mla: torch.func transforms that differentiate"):
        FUNC_TRANSFORMS[transform](lambda q, kv: _attend(q, kv, idx), q, kv)


@pytest.mark.parametrize("op", ["sparse_mla", "sparse_mla_fwd"])
@pytest.mark.parametrize("dual", ["q", "kv", "attn_sink"])
def test_forward_mode_ad_is_refused(op, dual):
    q, kv, idx = _inputs()
    sink = torch.zeros(q.shape[1])
    call = {
        "sparse_mla": lambda q, kv, sink: sparse_mla(q, kv, idx, d_v=DV, attn_sink=sink),
        "sparse_mla_fwd": lambda q, kv, sink: torch.ops.mla_inductor.sparse_mla_fwd(
            q, kv, idx, None, None, sink, 0.25, DV, 0.0, False, False),
    }[op]
    args = {"q": q, "kv": kv, "attn_sink": sink}
    with fwAD.dual_level(), pytest.raises(RuntimeError, match=r"^sparse_mla: forward-mode AD"):
        args[dual] = fwAD.make_dual(args[dual], torch.ones_like(args[dual]))
        call(args["q"], args["kv"], args["attn_sink"])


def test_vmap_over_a_leading_dimension_matches_the_fp64_reference():
    q, kv, idx = _inputs()
    qs = torch.stack([q, 2 * q, -q])
    out = torch.func.vmap(lambda q: _attend(q, kv, idx))(qs)
    for i in range(3):
        ref, _ = reference_sparse_mla_fp64(qs[i], kv, idx, d_v=DV)
        torch.testing.assert_close(out[i].double(), ref, atol=1e-5, rtol=1e-5)


def test_reverse_mode_still_works_next_to_the_checks():
    q, kv, idx = _inputs()
    q.requires_grad_(True)
    (grad,) = torch.autograd.grad(_attend(q, kv, idx).sum(), q)
    q64 = q.detach().double().requires_grad_(True)
    (ref,) = torch.autograd.grad(reference_sparse_mla_fp64(q64, kv, idx, d_v=DV)[0].sum(), q64)
    torch.testing.assert_close(grad.double(), ref, atol=1e-5, rtol=1e-5)
