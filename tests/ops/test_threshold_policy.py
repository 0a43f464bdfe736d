"""The threshold policy, decided at graph capture, pinned for eager, aot_eager and inductor."""

from __future__ import annotations

import logging
import os
import pathlib
import subprocess
import sys

import pytest
import torch
from expecttest import assert_expected_inline
from torch._dynamo.testing import AotEagerAndRecordGraphs, CompileCounterWithBackend, normalize_gm
from torch.utils.checkpoint import checkpoint

from mla_inductor import logs, sparse_mla
from mla_inductor import threshold_policy as policy
from mla_inductor.kernels import reference

T, H, D, S, K, DV = 8, 4, 32, 16, 6, 16


@pytest.fixture
def seen(monkeypatch):
    """The rescale_threshold each forward kernel call received, in order."""
    calls = []
    real = reference.forward

    def spy(q, kv, indices, topk_length, q_positions, attn_sink, sm_scale, d_v, rescale_threshold,
            return_o_lo, return_max_logits):
        calls.append(rescale_threshold)
        return real(q, kv, indices, topk_length, q_positions, attn_sink, sm_scale, d_v,
                    rescale_threshold, return_o_lo, return_max_logits)

    monkeypatch.setattr(reference, "forward", spy)
    torch._dynamo.reset()
    return calls


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.wq = torch.nn.Linear(D, H * D)
        self.wkv = torch.nn.Linear(D, D)

    def forward(self, x, idx):
        q = self.wq(x).view(-1, H, D)
        return sparse_mla(q, self.wkv(x), idx, d_v=DV).sum()


def _inputs():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(T, D, generator=g)
    idx = torch.randint(-1, T, (T, K), generator=g, dtype=torch.int32)
    return x, idx


def _run(scenario, fn, model, x, idx):
    if scenario == "train":
        fn(x, idx).backward()
    elif scenario == "no_grad":
        with torch.no_grad():
            fn(x, idx)
    elif scenario == "inference_mode":
        with torch.inference_mode():
            fn(x, idx)
    elif scenario == "nothing_requires_grad":
        model.requires_grad_(False)
        fn(x, idx)
    elif scenario == "only_kv_requires_grad":
        model.wq.requires_grad_(False)
        fn(x, idx).backward()
        assert model.wq.weight.grad is None and model.wkv.weight.grad is not None
    elif scenario == "eval_with_grad":
        model.eval()
        fn(x, idx)
    elif scenario == "checkpoint_non_reentrant":
        checkpointed = lambda x, idx: checkpoint(model, x, idx, use_reentrant=False)  # noqa: E731
        (torch.compile(checkpointed, backend=fn.backend, fullgraph=True) if fn.backend else checkpointed)(x, idx).backward()


EXPECTED = {
    "train": [0.0],
    "no_grad": [8.0],
    "inference_mode": [8.0],
    "nothing_requires_grad": [8.0],
    "only_kv_requires_grad": [0.0],
    "eval_with_grad": [0.0],
    "checkpoint_non_reentrant": [0.0, 0.0],  # the forward, then the recompute in the backward
}


@pytest.mark.parametrize("backend", [None, "aot_eager", "inductor"])
@pytest.mark.parametrize("scenario", list(EXPECTED))
def test_policy_table(scenario, backend, seen):
    torch.manual_seed(0)
    model = Block()
    x, idx = _inputs()
    fn = model if backend is None else torch.compile(model, backend=backend, fullgraph=True)
    fn.backend = backend
    _run(scenario, fn, model, x, idx)
    assert seen == EXPECTED[scenario]


def test_explicit_threshold_is_respected_and_warns_once(seen, caplog, monkeypatch):
    monkeypatch.setattr(policy, "_warned_override", False)
    model = Block()
    x, idx = _inputs()
    with caplog.at_level(logging.WARNING, logger="mla_inductor"):
        for _ in range(2):
            q = model.wq(x).view(-1, H, D)
            sparse_mla(q, model.wkv(x), idx, d_v=DV, rescale_threshold=8.0).sum().backward()
    with torch.no_grad():
        sparse_mla(model.wq(x).view(-1, H, D), model.wkv(x), idx, d_v=DV, rescale_threshold=0.0)
    assert seen == [8.0, 8.0, 0.0]
    warnings = [r for r in caplog.records if "rescale_threshold=8.0 forced" in r.getMessage()]
    assert len(warnings) == 1


def test_capture_logs_one_info_line_per_graph(seen, caplog):
    model = Block()
    x, idx = _inputs()
    fn = torch.compile(model, backend="aot_eager", fullgraph=True)
    with caplog.at_level(logging.INFO, logger="mla_inductor"):
        fn(x, idx).backward()
        with torch.no_grad():
            fn(x, idx)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("sparse_mla capture")]
    assert lines == [
        "sparse_mla capture: training graph, rescale_threshold=0.0 (a backward graph consumes this forward)",
        "sparse_mla capture: inference graph, rescale_threshold=8.0 (inference: grad mode is off)",
    ]


def test_train_no_grad_train_reuses_compiled_graphs(seen):
    model = Block()
    x, idx = _inputs()
    counter = CompileCounterWithBackend("aot_eager")
    fn = torch.compile(model, backend=counter, fullgraph=True)
    fn(x, idx).backward()
    with torch.no_grad():
        fn(x, idx)
    with torch.compiler.set_stance("fail_on_recompile"):
        fn(x, idx).backward()
        with torch.no_grad():
            fn(x, idx)
    assert counter.frame_count == 2
    assert seen == [0.0, 8.0, 0.0, 8.0]


def test_dynamo_graph_keeps_the_entry_op_and_aot_graph_carries_the_literal(seen):
    q = torch.randn(T, H, D, requires_grad=True)
    kv = torch.randn(S, D, requires_grad=True)
    idx = torch.randint(-1, S, (T, K), dtype=torch.int32)
    backend = AotEagerAndRecordGraphs()
    out = torch.compile(lambda q, kv, idx: sparse_mla(q, kv, idx, d_v=DV, sm_scale=0.125), backend=backend, fullgraph=True)(q, kv, idx)
    out.sum().backward()
    assert_expected_inline(
        normalize_gm(backend.graphs[0].print_readable(print_output=False)),
        """\
class GraphModule(torch.nn.Module):
    def forward(self, L_q_: "f32[8, 4, 32]", L_kv_: "f32[16, 32]", L_idx_: "i32[8, 6]"):
        l_q_ = L_q_
        l_kv_ = L_kv_
        l_idx_ = L_idx_

        sparse_mla = torch.ops.mla_inductor.sparse_mla(l_q_, l_kv_, l_idx_, None, None, None, False, 0.125, 16, None, False);  l_q_ = l_kv_ = l_idx_ = None
        out: "f32[8, 4, 16]" = sparse_mla[0];  sparse_mla = None
        return (out,)
""",
    )
    # AOT graphs differ in detach chains across torch versions: check structure, not text.
    fw_calls = [n for n in backend.fw_graphs[0].graph.nodes if n.target == torch.ops.mla_inductor.sparse_mla_fwd.default]
    bw_calls = [n for n in backend.bw_graphs[0].graph.nodes if n.target == torch.ops.mla_inductor.sparse_mla_bwd.default]
    assert len(fw_calls) == 1 and len(bw_calls) == 1
    assert fw_calls[0].args[4:] == (None, None, 0.125, DV, 0.0, True, False)


_LOGGED_RUN = """
import torch, mla_inductor
q = torch.randn(8, 4, 32, requires_grad=True)
kv = torch.randn(16, 32)
idx = torch.randint(-1, 16, (8, 6), dtype=torch.int32)
f = torch.compile(lambda q: mla_inductor.sparse_mla(q, kv, idx, d_v=16), backend="aot_eager",
                  fullgraph=True)
f(q).sum().backward()
with torch.no_grad():
    f(q)
mla_inductor.sparse_mla(q, kv, idx, d_v=16)
"""


@pytest.mark.parametrize("setting", ["mla_inductor", "+mla_inductor"])
def test_torch_logs_shows_the_decisions(setting):
    """TORCH_LOGS names the package's logger (registered with torch's logging): INFO shows one
    line per captured graph, + (DEBUG) also the eager calls."""
    env = {**os.environ, "TORCH_LOGS": setting}
    run = subprocess.run([sys.executable, "-c", _LOGGED_RUN], env=env, capture_output=True,
                         text=True, timeout=600, cwd=pathlib.Path(__file__).parents[2])
    assert run.returncode == 0, run.stderr[-2000:]
    captures = [line for line in run.stderr.splitlines() if "sparse_mla capture:" in line]
    assert len(captures) == 2, run.stderr[-2000:]
    assert captures[0].endswith("training graph, rescale_threshold=0.0 (a backward graph "
                                "consumes this forward)")
    assert captures[1].endswith("inference graph, rescale_threshold=8.0 (inference: grad mode "
                                "is off)")
    assert ("sparse_mla eager call: rescale_threshold=0.0" in run.stderr) == setting.startswith("+")
    assert logs.REGISTERED and torch._logging._internal.log_registry.is_log(logs.NAME)


def test_export_logs_what_the_exported_program_does(caplog):
    """torch.export keeps the entry op in the exported graph (no threshold is recorded, no
    capture line); run_decompositions() records the inference threshold, and logs it."""
    model = Block()
    x, idx = _inputs()
    with caplog.at_level(logging.INFO, logger="mla_inductor"):
        exported = torch.export.export(model, (x, idx))
        at_export = [r.getMessage() for r in caplog.records]
        decomposed = exported.run_decompositions()
    ops = [n.target for n in exported.graph.nodes if n.op == "call_function"]
    assert torch.ops.mla_inductor.sparse_mla.default in ops
    assert not [m for m in at_export if m.startswith("sparse_mla capture")]
    fwd = [n for n in decomposed.graph.nodes if n.target == torch.ops.mla_inductor.sparse_mla_fwd.default]
    assert len(fwd) == 1 and fwd[0].args[8] == 8.0
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("sparse_mla capture")]
    assert lines == ["sparse_mla capture: inference graph, rescale_threshold=8.0 (inference: grad mode is off)"]
