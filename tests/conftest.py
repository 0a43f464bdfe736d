"""Shared test helpers: an independent dense fp64 reference, input builders, and the kernel cache
kept out of the user's cache folder."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch
from torch._dynamo.utils import counters
from torch.utils._python_dispatch import TorchDispatchMode

# The integrations' GPU tests (tests/integrations/test_sm90_*.py) check the indexer's selection
# with functions of tests/kernels/sm90/test_sm90_lightning.py; pytest's default import mode puts
# only a test file's own folder on sys.path.
sys.path.insert(0, str(Path(__file__).resolve().parent / "kernels" / "sm90"))


@pytest.fixture(autouse=True)
def no_graph_break():
    """Every test: no Dynamo graph break. Dynamo counts each break it takes
    (``counters["graph_break"]``); a test that leaves the count higher than it found it fails,
    so the count stays zero across the whole run."""
    before = sum(counters["graph_break"].values())
    yield
    breaks = sum(counters["graph_break"].values()) - before
    assert breaks == 0, f"{breaks} graph break(s): {dict(counters['graph_break'])}"

from mla_inductor.accuracy import rel_l2  # noqa: F401  (the tests' metric, shared with the package)


def reference_sparse_mla_fp64(q, kv, indices, topk_length=None, sm_scale=None, d_v=512, *,
                              q_positions=None, attn_sink=None, return_max_logits=False):
    """Dense fp64 sparse MLA, written independently of the package (autograd-differentiable).

    ``q [T, H, d_qk]``, ``kv [S, d_qk]``, ``indices [T, topk]`` (any integer dtype; < 0 or >= S
    is an empty slot), ``topk_length [T]`` or None, ``q_positions [T]`` or None (a slot naming a
    key past the token's position is empty), ``attn_sink [H]`` or None (a logit per head in the
    denominator, no value). Returns ``(out [T, H, d_v], lse [T, H])`` in float64, lse natural log
    (the sink included), and ``max_logits [T, H]`` (the sink not included) when asked; rows with
    no valid slot give out 0, lse = the sink (-inf without one) and max_logits -inf. Rows of kv that
    no valid slot names may hold anything (NaN, inf): they never reach a result. The rows that
    are named must be finite (the one-hot product would spread a NaN to every token).
    """
    T, H, d_qk = q.shape
    S = kv.shape[0]
    if sm_scale is None:
        sm_scale = d_qk**-0.5
    q64, kv64 = q.double(), kv.double()
    idx = indices.long()
    valid = (idx >= 0) & (idx < S)
    if topk_length is not None:
        valid &= torch.arange(idx.shape[1], device=idx.device)[None, :] < topk_length.long()[:, None]
    if q_positions is not None:
        valid &= idx <= q_positions.long()[:, None]
    # One-hot selection matrix [T, topk, S] keeps the reference free of gathers. Rows no valid
    # slot names are zeroed first: 0 * NaN would otherwise carry their values into every key.
    onehot = torch.zeros(T, idx.shape[1], S, dtype=torch.float64, device=q.device)
    rows = torch.where(valid, idx, 0)
    onehot.scatter_(2, rows[..., None], valid[..., None].double())
    named = onehot.sum((0, 1)) > 0
    keys = onehot @ torch.where(named[:, None], kv64, 0.0)  # [T, topk, d_qk]
    s = torch.einsum("thd,tkd->thk", q64, keys) * sm_scale
    s = s.masked_fill(~valid[:, None, :], -math.inf)
    full = s
    if attn_sink is not None:
        full = torch.cat((s, attn_sink.double()[None, :, None].expand(T, H, 1)), dim=-1)
    lse = torch.logsumexp(full, dim=-1)
    p = torch.exp(s - torch.where(torch.isinf(lse), 0.0, lse)[..., None])
    out = torch.einsum("thk,tkd->thd", p, keys[..., :d_v])
    if return_max_logits:
        return out, lse, s.detach().amax(dim=-1)
    return out, lse


def assert_compiled_matches_eager(module, run, tol=1e-6):
    """``run(fn)`` (a list of tensors or None: outputs and gradients) with ``fn`` the module, then
    with the module under ``torch.compile(fullgraph=True, backend="aot_eager")`` (a graph break
    raises): the same Nones, the tensors within rel-L2 ``tol``."""
    eager = run(module)
    torch._dynamo.reset()
    compiled = run(torch.compile(module, fullgraph=True, backend="aot_eager"))
    assert len(compiled) == len(eager)
    for c, e in zip(compiled, eager):
        assert (c is None) == (e is None)
        if e is not None:
            assert rel_l2(c, e) <= tol


def lm_gradients(model, ids) -> dict:
    """``{name: grad or None}`` of every parameter of the causal LM ``model`` after the backward of
    its loss on ``ids`` (labels = ids, no cache)."""
    model.zero_grad(set_to_none=True)
    model(ids, labels=ids, use_cache=False).loss.backward()
    return {k: p.grad for k, p in model.named_parameters()}


def assert_same_gradients(ours: dict, ref: dict, tol: float) -> None:
    """The same parameters get gradients (None elsewhere), each within rel-L2 ``tol``."""
    assert {k for k, g in ours.items() if g is None} == {k for k, g in ref.items() if g is None}
    worst = max((rel_l2(ours[k], g), k) for k, g in ref.items() if g is not None)
    assert worst[0] <= tol, worst


# The transformers integration's tests: one causal LM unswitched, switched and switched back
# (mla_inductor.integrations.transformers, imported where used: transformers is optional).


def switched_and_back(model, ids, layers: int):
    """``(ref, out, back)``: the logits of ``model`` on ``ids`` (without grad, no cache)
    unswitched, switched (``apply`` switches ``layers`` layers, a second ``apply`` none, and no
    parameter is copied) and after ``remove`` (which switches the ``layers`` back)."""
    from mla_inductor.integrations import transformers as hf

    with torch.no_grad():
        ref = model(ids, use_cache=False).logits
        params = [(k, p.data_ptr()) for k, p in model.named_parameters()]
        assert hf.apply(model) == layers
        assert hf.apply(model) == 0  # already switched
        assert [(k, p.data_ptr()) for k, p in model.named_parameters()] == params  # no copies
        out = model(ids, use_cache=False).logits
        assert hf.remove(model) == layers
        back = model(ids, use_cache=False).logits
    return ref, out, back


def switched_gradients(model, ids, layers: int) -> tuple[dict, dict]:
    """``(ours, ref)``: :func:`lm_gradients` of ``model`` switched (``layers`` layers, switched
    back after) and unswitched."""
    from mla_inductor.integrations import transformers as hf

    ref = lm_gradients(model, ids)
    with hf.switched(model) as n:
        assert n == layers
        ours = lm_gradients(model, ids)
    return ours, ref


def assert_chunked_prefill_matches(model, ids, cache_config, bounds=((0, 21), (21, 24),
                                                                     (24, 50))) -> None:
    """``ids [1, T]`` as the prompt chunks ``bounds`` through a ``DynamicCache(config=
    cache_config)``, switched (``apply``) and not: the logits agree within rel-L2 1e-5."""
    from transformers import DynamicCache

    from mla_inductor.integrations import transformers as hf

    def chunks():
        cache, outs = DynamicCache(config=cache_config), []
        for t0, t1 in bounds:
            outs.append(model(ids[:, t0:t1], cache=cache, use_cache=True).logits)
        return torch.cat(outs, 1)

    with torch.no_grad():
        ref = chunks()
        hf.apply(model)
        out = chunks()
    assert rel_l2(out, ref) <= 1e-5


def indexer_dtypes_seen(monkeypatch, module) -> list:
    """Replaces ``module.lightning_indexer`` by a wrapper that records, per call, ``(q.dtype,
    k.dtype, sorted keyword names)`` into the returned list before calling the op."""
    calls, op = [], module.lightning_indexer
    monkeypatch.setattr(module, "lightning_indexer",
                        lambda q, k, *a, **kw: calls.append((q.dtype, k.dtype, sorted(kw))) or
                        op(q, k, *a, **kw))
    return calls


def tokens_by_at_least(T: int, least: int, widths=frozenset()):
    """A ``keep`` for :class:`ReturnedShapes`: a shape with ``T`` in one size and at least
    ``least`` in another (a ``[T, S]`` mask or score tensor), other than ``widths`` (the
    projections' widths)."""

    def keep(shape: tuple) -> bool:
        if T not in shape:
            return False
        rest = list(shape)
        rest.remove(T)
        return any(n >= least and n not in widths for n in rest)

    return keep


class ReturnedShapes(TorchDispatchMode):
    """Records ``(op, shape)`` of every tensor an op returns whose shape ``keep(shape)`` (a
    tuple) accepts, in ``found`` (a set). An op of the package is one call: what it makes inside
    is not seen."""

    def __init__(self, keep):
        super().__init__()
        self.keep, self.found = keep, set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and self.keep(tuple(t.shape)):
                self.found.add((str(func), tuple(t.shape)))
        return out


@pytest.fixture
def fp64_reference():
    return reference_sparse_mla_fp64


def random_inputs(T, H, d_qk, S, topk, dtype=torch.bfloat16, device="cpu", seed=0, invalid_frac=0.0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    q = torch.randn(T, H, d_qk, generator=g).to(device=device, dtype=dtype)
    kv = torch.randn(S, d_qk, generator=g).to(device=device, dtype=dtype)
    indices = torch.randint(0, S, (T, topk), generator=g, dtype=torch.int32)
    if invalid_frac > 0:
        drop = torch.rand(T, topk, generator=g) < invalid_frac
        indices = torch.where(drop, -1, indices)
    return q, kv, indices.to(device)


@pytest.fixture(autouse=True, scope="session")
def kernel_cache_in_a_temporary_folder(tmp_path_factory):
    """Kernels the tests compile go to a temporary folder of this test run, never the user's
    cache."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("MLA_INDUCTOR_KERNEL_CACHE", str(tmp_path_factory.mktemp("kernel-cache")))
        yield


@pytest.fixture
def fake_gpu(monkeypatch):
    """``auto`` with a CUDA device of a chosen capability on this machine; returns the setter."""
    from mla_inductor import backends

    monkeypatch.delenv(backends.ENV_VAR, raising=False)
    monkeypatch.setattr(backends, "_warned", set())

    def set_capability(cap):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: cap)

    return set_capability


def fallback_warnings(*calls):
    """Runs ``backends.select(*args)`` for each args tuple, checking that it picks the reference;
    returns the messages of the warnings raised."""
    import warnings

    from mla_inductor import backends
    from mla_inductor.kernels import reference

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for args in calls:
            assert backends.select(*args) is reference
    return [str(w.message) for w in caught if issubclass(w.category, UserWarning)]


CPU_BACKENDS = ("reference", "emulate")
GPU_BACKENDS = ("sm90", "sm100")


def kernel_available(name: str) -> tuple[bool, str]:
    """Whether the GPU backend ``name`` can run on this machine, and why not."""
    if not torch.cuda.is_available():
        return False, "no CUDA device"
    from mla_inductor import backends

    try:
        return backends.module(name).available()
    except ImportError as exc:
        return False, f"backend {name} not importable: {exc}"


def backend_params(names=CPU_BACKENDS + GPU_BACKENDS):
    """``pytest.param`` per backend name: the CPU ones always run; a GPU one is marked ``cuda``
    and skipped (with the reason) where it cannot run."""
    params = []
    for name in names:
        marks = []
        if name in GPU_BACKENDS:
            ok, reason = kernel_available(name)
            marks = [pytest.mark.cuda, pytest.mark.skipif(not ok, reason=reason or "unavailable")]
        params.append(pytest.param(name, id=name, marks=marks))
    return params


def backend_device(name: str) -> str:
    """The device a backend's tensors live on: ``cpu`` for the CPU backends, else ``cuda``."""
    return "cpu" if name in CPU_BACKENDS else "cuda"


def pytest_collection_modifyitems(config, items):
    """Tests marked ``cuda`` skip cleanly on a machine without a CUDA GPU."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)
