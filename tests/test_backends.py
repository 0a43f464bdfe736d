"""Backend selection: environment variable, context manager, clear errors, auto fallback."""

from __future__ import annotations

import pytest
import torch
from conftest import random_inputs

from mla_inductor import backends, sparse_mla, use_backend
from mla_inductor.kernels import reference


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


def test_unknown_name_is_rejected(monkeypatch):
    with pytest.raises(ValueError, match="unknown mla_inductor backend 'fast'"):
        with use_backend("fast"):
            pass
    monkeypatch.setenv(backends.ENV_VAR, "triton")
    with pytest.raises(ValueError, match="unknown mla_inductor backend 'triton'"):
        backends.requested()


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


def test_unknown_cuda_architecture_falls_back_with_one_warning(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(backends, "_warned", set())
    device = torch.device("cuda", 0)
    with pytest.warns(UserWarning, match="compute capability 8.0; falling back to the PyTorch reference"):
        assert backends.select(device, torch.bfloat16, "forward") is reference
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert backends.select(device, torch.bfloat16, "backward") is reference
