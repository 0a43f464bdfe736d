"""opcheck, torch.compile (aot_eager / inductor), dynamic token counts and the generated code."""

from __future__ import annotations

import logging
import math

import pytest
import torch
from conftest import random_inputs
from torch._dynamo.testing import CompileCounterWithBackend
from torch._inductor.utils import run_and_get_code
from torch.testing import FileCheck

from mla_inductor import lowering, sparse_mla

fwd = torch.ops.mla_inductor.sparse_mla_fwd
bwd = torch.ops.mla_inductor.sparse_mla_bwd
UTILS = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_static", "test_aot_dispatch_dynamic")


@pytest.mark.parametrize("grad", ["none", "q_and_kv", "kv_only"])
@pytest.mark.parametrize("with_topk_length", [False, True])
@pytest.mark.parametrize("features", ["none", "causal_sink_max_logits"])
def test_opcheck_forward(grad, with_topk_length, features):
    q, kv, idx = random_inputs(6, 4, 32, 12, 5, dtype=torch.float32, invalid_frac=0.2)
    q.requires_grad_(grad == "q_and_kv")
    kv.requires_grad_(grad != "none")
    lengths = torch.tensor([5, 0, 3, 5, 1, 4], dtype=torch.int32) if with_topk_length else None
    pos = sink = None
    if features != "none":
        pos = torch.tensor([3, -1, 11, 6, 0, 9], dtype=torch.int32)
        sink = torch.tensor([0.5, -math.inf, 2.0, -1.0]).requires_grad_(grad != "none")
    for return_o_lo in (False, True):
        args = (q, kv, idx, lengths, pos, sink, 0.2, 16, 0.0, return_o_lo, features != "none")
        torch.library.opcheck(fwd, args, test_utils=UTILS)


@pytest.mark.parametrize("features", ["none", "causal_sink_dlse"])
def test_opcheck_backward(features):
    q, kv, idx = random_inputs(6, 4, 32, 12, 5, dtype=torch.float32, invalid_frac=0.2)
    pos = sink = dlse = None
    if features != "none":
        pos = torch.tensor([3, -1, 11, 6, 0, 9], dtype=torch.int32)
        sink = torch.tensor([0.5, -math.inf, 2.0, -1.0])
        dlse = torch.randn(6, 4)
    for return_o_lo in (False, True):
        out, lse, o_lo, _ = fwd(q, kv, idx, None, pos, sink, 0.2, 16, 0.0, return_o_lo, False)
        args = (torch.randn_like(out), dlse, q, kv, idx, None, pos, sink, out, lse, o_lo, 0.2, 16)
        torch.library.opcheck(bwd, args, test_utils=UTILS)


class TinyAttention(torch.nn.Module):
    def __init__(self, d=32, heads=4, d_v=16):
        super().__init__()
        self.heads, self.d, self.d_v = heads, d, d_v
        self.wq = torch.nn.Linear(d, heads * d)
        self.wkv = torch.nn.Linear(d, d)
        self.wo = torch.nn.Linear(heads * d_v, d)

    def forward(self, x, idx):
        q = self.wq(x).view(x.shape[0], self.heads, self.d)
        out = sparse_mla(q, self.wkv(x), idx, d_v=self.d_v)
        return self.wo(out.flatten(1))


def _causal_indices(T, topk, seed=0):
    g = torch.Generator().manual_seed(seed)
    pos = torch.arange(T)[:, None]
    idx = (pos - torch.randint(0, 2 * topk, (T, topk), generator=g)).clamp_min(-1)
    idx[:, 0] = pos[:, 0]
    return idx  # int64, -1 padding for early tokens


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compiled_training_matches_eager(backend):
    torch.manual_seed(0)
    model = TinyAttention()
    x = torch.randn(24, 32)
    idx = _causal_indices(24, 6)
    ref = model(x, idx)
    ref.square().mean().backward()
    ref_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    out = torch.compile(model, backend=backend, fullgraph=True)(x, idx)
    out.square().mean().backward()
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    for p, g in zip(model.parameters(), ref_grads):
        torch.testing.assert_close(p.grad, g, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_dynamic_token_count_compiles_once(backend):
    torch.manual_seed(0)
    model = TinyAttention()
    counter = CompileCounterWithBackend(backend)
    fn = torch.compile(model, backend=counter, fullgraph=True)
    for i, T in enumerate((16, 24, 40, 33)):
        x, idx = torch.randn(T, 32), _causal_indices(T, 6, seed=T)
        torch._dynamo.mark_dynamic(x, 0)
        torch._dynamo.mark_dynamic(idx, 0)
        with torch.compiler.set_stance("fail_on_recompile" if i else "default"):
            out = fn(x, idx)
            out.sum().backward()
        torch.testing.assert_close(out, model(x, idx), atol=1e-5, rtol=1e-5)
    assert counter.frame_count == 1


def test_inductor_fuses_producers_and_calls_the_ops_directly():
    q_proj = torch.randn(32, 128)
    x = torch.randn(8, 32)
    kv = torch.randn(16, 32)
    idx = torch.randint(-1, 16, (8, 6))  # int64: cast + invalid-slot mask happen before the op

    def f(x, kv, idx):
        q = (x @ q_proj).view(8, 4, 32).transpose(0, 1).contiguous().transpose(0, 1) * 2
        return sparse_mla(q, kv * 3, idx, d_v=16)

    torch._dynamo.reset()
    with torch.no_grad():
        out, (code, *_) = run_and_get_code(torch.compile(f, fullgraph=True), x, kv, idx)
    torch.testing.assert_close(out, f(x, kv, idx))
    assert lowering.install()  # inductor is loaded and this torch version is tested
    # One generated kernel produces q, kv and the int32 indices; then our op is called directly
    # on those buffers, with the inference threshold baked in.
    call = code[code.index("def call(") :]
    FileCheck().check_count("cpp_fused", 1, exactly=True).check(
        "torch.ops.mla_inductor.sparse_mla_fwd.default(buf"
    ).check_same("8.0, False, False)").run(call)


def test_explicit_fallback_works_without_implicit_fallbacks():
    model = TinyAttention()
    x, idx = torch.randn(12, 32), _causal_indices(12, 4)
    torch._dynamo.reset()
    with torch._inductor.config.patch(implicit_fallbacks=False, fx_graph_cache=False):
        out = torch.compile(model, fullgraph=True)(x, idx)
        out.sum().backward()
    torch.testing.assert_close(out, model(x, idx), atol=1e-5, rtol=1e-5)


def test_lowering_gate_logs_its_decision_once(monkeypatch, caplog):
    """install() logs the torch-version gate once per process (INFO on ``mla_inductor``), for
    a tested version and, here by a patched version, for one outside the range."""
    import torch._inductor.lowering  # noqa: F401  (install() needs inductor loaded)

    for version, admitted in ((lowering.TESTED_TORCH[1], True), ((2, 99), False)):
        monkeypatch.setattr(lowering, "_installed", False)
        monkeypatch.setattr(lowering, "_gate_logged", False)
        monkeypatch.setattr(lowering, "_torch_version", lambda v=version: v)
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="mla_inductor"):
            assert lowering.install() is admitted
            assert lowering.install() is admitted
        lines = [r for r in caplog.records if r.getMessage().startswith("lowering: torch")]
        assert len(lines) == 1, [r.getMessage() for r in lines]
        assert lines[0].admitted is admitted
        assert ("not registered" in lines[0].getMessage()) is not admitted


def test_the_registry_lists_every_op_that_reaches_inductor():
    """The lowering's list is the registry's: every op of ``torch.ops.mla_inductor`` but the entry
    ops (decomposed before inductor) and the transformers integration's ``head_matmul`` (its own
    layout rule), each with the contiguous-strides tag; after ``install()`` each has a lowering."""
    import torch._inductor.lowering as inductor_lowering

    from mla_inductor import custom_ops

    names = {name.split("::")[1] for name in torch._C._dispatch_get_all_op_names()
             if name.startswith("mla_inductor::")}
    entry = {name for name in names if name == "sparse_mla" or name.endswith("_entry")}
    lowered = custom_ops.lowered_ops()
    assert {op._opname for op in lowered} == names - entry - {"head_matmul"}
    assert len(lowered) == 8
    assert all(torch.Tag.needs_contiguous_strides in op.tags for op in lowered)
    assert lowering.install()
    assert all(op in inductor_lowering.lowerings for op in lowered)
