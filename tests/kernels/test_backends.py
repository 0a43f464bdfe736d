"""Backend selection: environment variable, context manager, clear errors, auto fallback."""

from __future__ import annotations

import sys
import warnings

import pytest
import torch
from conftest import fallback_warnings, random_inputs

from mla_inductor import backends, sparse_mla, use_backend
from mla_inductor.kernels import reference, sm90


def test_auto_on_cpu_is_reference(monkeypatch):
    monkeypatch.delenv(backends.ENV_VAR, raising=False)
    assert backends.requested() == "auto"
    assert backends.select(torch.device("cpu"), torch.bfloat16, "forward") is reference
    assert backends.select(torch.device("cpu"), torch.bfloat16, "backward") is reference


def test_env_var_and_context_manager(monkeypatch):
    monkeypatch.setenv(backends.ENV_VAR, "reference")
    assert backends.requested() == "reference"
    with use_backend("auto"):
        assert backends.requested() == "auto"
        with use_backend("reference"):
            assert backends.requested() == "reference"
        assert backends.requested() == "auto"
    assert backends.requested() == "reference"


def test_unknown_name_is_rejected_by_its_source(monkeypatch):
    """``use_backend("cuda")`` raises when called, before any block is entered, and names
    ``use_backend``; a bad environment variable is named when an op reads it."""
    with pytest.raises(ValueError) as info:
        use_backend("cuda")
    assert str(info.value) == ("use_backend: unknown mla_inductor backend 'cuda'; choose one of "
                               "auto, reference, emulate, sm90, sm100")
    monkeypatch.setenv(backends.ENV_VAR, "triton")
    with pytest.raises(ValueError, match="^MLA_INDUCTOR_BACKEND: unknown mla_inductor backend "
                                         "'triton'"):
        backends.requested()
    with use_backend("reference"):  # a use_backend in force: the environment is not read
        assert backends.requested() == "reference"


@pytest.mark.parametrize("name", ["sm90", "sm100"])
def test_gpu_backend_on_cpu_raises_naming_what_is_missing(name):
    q, kv, idx = random_inputs(4, 2, 16, 8, 3)
    with use_backend(name), pytest.raises(RuntimeError, match=f"backend '{name}' cannot run here: .+"):
        sparse_mla(q, kv, idx, d_v=8)


def test_selection_happens_when_the_compiled_code_runs(monkeypatch):
    """A compiled function follows use_backend at run time (no recompile needed)."""
    calls = []
    real = reference.forward
    monkeypatch.setattr(reference, "forward", lambda *a: calls.append(1) or real(*a))
    q, kv, idx = random_inputs(4, 2, 16, 8, 3)
    torch._dynamo.reset()
    fn = torch.compile(lambda q, kv, idx: sparse_mla(q, kv, idx, d_v=8), backend="aot_eager", fullgraph=True)
    fn(q, kv, idx)
    with use_backend("sm90"), pytest.raises(RuntimeError, match="backend 'sm90' cannot run here"):
        fn(q, kv, idx)
    assert calls == [1]


CUDA = torch.device("cuda", 0)
DIMS = (4, 2, 16, 576, 512)  # (T, H, S, d_qk, d_v): a shape both kernel backends cover


def test_unknown_cuda_architecture_falls_back_with_one_warning_per_direction(fake_gpu):
    fake_gpu((8, 0))
    fwd, bwd = (CUDA, torch.bfloat16, "forward", DIMS), (CUDA, torch.bfloat16, "backward", DIMS)
    messages = fallback_warnings(fwd, fwd, bwd, bwd)
    assert messages == [
        "mla_inductor: sparse-MLA forward falls back to the PyTorch reference backend, which is "
        "much slower (often 50-100x): no sparse-MLA kernel for compute capability 8.0",
        "mla_inductor: sparse-MLA backward falls back to the PyTorch reference backend, which is "
        "much slower (often 50-100x): no sparse-MLA kernel for compute capability 8.0",
    ]


def test_unsupported_shape_warns_once_per_reason(fake_gpu, monkeypatch):
    fake_gpu((9, 0))
    monkeypatch.setattr(sm90, "available", lambda: (True, ""))
    narrow = (CUDA, torch.bfloat16, "forward", (4, 2, 16, 128, 128))
    wide = (CUDA, torch.bfloat16, "forward", (4, 2, 16, 1024, 512))
    messages = fallback_warnings(narrow, narrow, wide, narrow)
    assert len(messages) == 2
    assert all("falls back to the PyTorch reference backend, which is much slower" in m for m in messages)
    assert messages[0].endswith("got (128, 128)") and messages[1].endswith("got (1024, 512)")
    assert "sm90 kernels support (d_qk, d_v)" in messages[0]


def test_a_forced_sm90_refuses_what_its_launchers_assert(fake_gpu, monkeypatch):
    """The sm90 launchers assert their kernels' limits: the selection refuses a problem outside
    them first, with the op's name."""
    fake_gpu((9, 0))
    monkeypatch.setattr(sm90, "available", lambda: (True, ""))
    refused = [
        ("sparse_mla", CUDA, torch.bfloat16, "forward", (4, 2, 16, 256, 256),
         r"sm90 kernels support \(d_qk, d_v\) in .*got \(256, 256\)"),
        ("sparse_mla", CUDA, torch.float32, "backward", DIMS, "float32 runs on the reference"),
        ("sparse_mla", torch.device("cpu"), torch.bfloat16, "forward", DIMS,
         "the tensors are on cpu, not on a CUDA device"),
        ("indexer_target", CUDA, torch.bfloat16, "indexer_target", (4, 2, 16, 256, 0),
         r"sm90 indexer target supports d_qk in \(576, 512\), got 256"),
        ("indexer_target", CUDA, torch.bfloat16, "indexer_target", (4, 129, 16, 576, 0),
         "sm90 indexer target supports at most 128 heads, got 129"),
        ("lightning_indexer", CUDA, torch.bfloat16, "lightning_indexer", (4, 0, 16, 128, 0),
         "sm90 lightning indexer supports 1 to 64 index heads, got 0"),
        ("lightning_indexer_scores", CUDA, torch.float16, "lightning_indexer_scores_bwd",
         (4, 2, 16, 64, 0), "sm90 lightning_indexer_scores_bwd supports D = 128, got 64"),
    ]
    with use_backend("sm90"):
        for op, device, dtype, direction, dims, reason in refused:
            with pytest.raises(RuntimeError, match=f"^{op}: mla_inductor backend 'sm90' cannot "
                                                   f"run here: {reason}"):
                backends.select(device, dtype, direction, dims)


def test_backend_that_cannot_run_warns_with_its_reason(fake_gpu, monkeypatch):
    fake_gpu((9, 0))
    monkeypatch.setattr(sm90, "available", lambda: (False, "sm90: nvidia-cutlass-dsl not importable (x)"))
    [message] = fallback_warnings((CUDA, torch.float16, "forward", DIMS), (CUDA, torch.float16, "forward", DIMS))
    assert message.endswith("much slower (often 50-100x): sm90: nvidia-cutlass-dsl not importable (x)")


def test_backend_that_cannot_be_imported_warns(fake_gpu, monkeypatch):
    fake_gpu((10, 0))
    monkeypatch.setitem(sys.modules, "mla_inductor.kernels.sm100", None)  # import raises ImportError
    [message] = fallback_warnings((CUDA, torch.bfloat16, "backward", DIMS))
    assert "sparse-MLA backward falls back" in message and "much slower" in message
    assert "the sm100 backend cannot be imported (" in message


def test_float32_on_a_gpu_warns(fake_gpu):
    fake_gpu((9, 0))
    [message] = fallback_warnings((CUDA, torch.float32, "forward", DIMS), (CUDA, torch.float32, "forward", None))
    assert message.endswith("much slower (often 50-100x): float32 input; the GPU kernels take bfloat16 or float16")


def test_cpu_never_warns(fake_gpu):
    fake_gpu((8, 0))
    cpu = torch.device("cpu")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for dtype in (torch.float32, torch.bfloat16):
            for direction in ("forward", "backward"):
                assert backends.select(cpu, dtype, direction, (4, 2, 16, 128, 128)) is reference
        q, kv, idx = random_inputs(4, 2, 16, 8, 3)
        sparse_mla(q.float().requires_grad_(), kv.float(), idx, d_v=8).sum().backward()


def test_use_backend_inside_a_compiled_function_is_refused_by_name():
    """use_backend belongs around the compiled call (see the test above); inside, under
    fullgraph, the error names it and says where it goes."""
    q, kv, idx = random_inputs(4, 2, 16, 8, 3)

    def f(q, kv, idx):
        with use_backend("reference"):
            return sparse_mla(q, kv, idx, d_v=8)

    torch._dynamo.reset()
    with pytest.raises(Exception, match=r"sparse_mla: use_backend\(\) cannot be entered inside a "
                                        r"compiled function; enter it around the call"):
        torch.compile(f, backend="eager", fullgraph=True)(q, kv, idx)


@pytest.mark.parametrize("name", ["reference", "emulate", "sm90", "sm100"])
def test_every_backend_meets_the_protocol(name):
    """Each backend module has :data:`backends.REQUIRED`, and each member of
    :class:`backends.Backend` it has takes the protocol's arguments in the protocol's order (more
    only as keywords with defaults)."""
    import inspect

    try:
        module = backends.module(name)
    except ImportError as error:
        pytest.skip(f"the {name} backend cannot be imported here: {error}")
    assert all(callable(getattr(module, member, None)) for member in backends.REQUIRED)
    members = [m for m in vars(backends.Backend) if not m.startswith("_")]
    assert set(backends.REQUIRED) < set(members)
    for member in members:
        if not hasattr(module, member):
            continue
        want = [p for p in inspect.signature(getattr(backends.Backend, member)).parameters.values()
                if p.name != "self" and p.kind != p.VAR_KEYWORD]  # **static_config: keywords
        got = list(inspect.signature(getattr(module, member)).parameters.values())
        assert [p.name for p in got[:len(want)]] == [p.name for p in want], (name, member)
        assert [p.kind for p in got[:len(want)]] == [p.kind for p in want], (name, member)
        assert all(p.kind == p.KEYWORD_ONLY and p.default is not p.empty for p in got[len(want):]
                   if p.kind != p.VAR_KEYWORD), (name, member)
