"""Every public op under ``torch.compile(fullgraph=True)``: a static compile, ``dynamic=True``,
automatic dynamic over three T and ``mark_dynamic``; ``aot_eager`` and ``inductor``; the op's
Python numbers passed as constants, call arguments or module attributes. Each cell's outputs and
gradients equal eager bitwise on the reference backend (inductor: see :func:`_matches`), and the number of graphs Dynamo keeps is
the one PyTorch's shape rules give. ``torch.export`` with dynamic T and S for each op.

The cases are keyed by public function (and the transformers integration's own op); :func:`test_every_registered_op_is_in_the_matrix` lists
the ops the package registers (``mla_inductor::*``) and fails on one that no case reaches, so a
new op cannot land outside the matrix.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch._dynamo.eval_frame import _debug_get_cache_entry_list
from torch._dynamo.testing import CompileCounterWithBackend
from torch._dynamo.utils import counters
from torch.export import Dim

import mla_inductor
from mla_inductor.integrations.transformers import head_matmul  # registers its op

TS = (5, 7, 9)  # the token counts each cell runs, in order
S = 12  # the key count (export varies it too)
H, D, D_V, TOPK = 4, 32, 16, 6


@dataclasses.dataclass(frozen=True)
class Case:
    """One public function: ``inputs(T, S)`` builds its tensors (fresh leaves, seeded by T),
    ``numbers`` are the Python numbers a model passes, ``fixed`` the other keyword arguments,
    ``dynamic`` names each tensor's dimension that follows T (for ``mark_dynamic``),
    ``keys`` the tensors whose first dimension is S (for export)."""

    fn: Callable
    inputs: Callable[[int, int], dict]
    numbers: dict
    fixed: dict
    dynamic: dict
    keys: tuple = ()


def _gen(T: int) -> torch.Generator:
    return torch.Generator().manual_seed(T)


def _attention_inputs(T: int, S: int = S) -> dict:
    g = _gen(T)
    return dict(
        q=torch.randn(T, H, D, generator=g).requires_grad_(),
        kv=torch.randn(S, D, generator=g).requires_grad_(),
        indices=torch.randint(-1, S + 1, (T, TOPK), generator=g, dtype=torch.int32),
        attn_sink=torch.randn(H, generator=g).requires_grad_(),
    )


def _target_inputs(T: int, S: int = S) -> dict:
    x = {k: v.detach() for k, v in _attention_inputs(T, S).items()}
    _, x["lse"] = mla_inductor.sparse_mla(**x, sm_scale=0.3, d_v=D_V, causal=True,
                                          return_lse=True)
    return x


def _kl_inputs(T: int, S: int = S) -> dict:
    x = _target_inputs(T, S)
    target = mla_inductor.indexer_target(**x, sm_scale=0.3, causal=True)
    logits = torch.randn(T, TOPK, generator=_gen(T + 100)).requires_grad_()
    return dict(indexer_logits=logits, target=target, indices=x["indices"])


def _indexer_inputs(T: int, S: int = S, fp8: bool = False) -> dict:
    g = _gen(T)
    q, k = torch.randn(T, H, D, generator=g), torch.randn(S, D, generator=g)
    weights = torch.randn(T, H, generator=g).requires_grad_()
    if not fp8:
        return dict(q=q.requires_grad_(), k=k.requires_grad_(), weights=weights)
    (q, q_scale), (k, k_scale) = mla_inductor.quantize_fp8(q), mla_inductor.quantize_fp8(k)
    return dict(q=q, k=k, weights=weights, q_scale=q_scale.requires_grad_(),
                k_scale=k_scale.requires_grad_())


def _scores_inputs(T: int, S: int = S) -> dict:
    x = _indexer_inputs(T, S)
    x["indices"] = torch.randint(-1, S + 1, (T, TOPK), generator=_gen(T + 7), dtype=torch.int32)
    return x


def _head_matmul_inputs(T: int, S: int = S) -> dict:
    g = _gen(T)
    return dict(x=torch.randn(T, H, D, generator=g).requires_grad_(),
                w=torch.randn(H, D, D_V, generator=g).requires_grad_(),
                tail=torch.randn(T, H, 8, generator=g).requires_grad_())


CASES = {
    "sparse_mla": Case(
        mla_inductor.sparse_mla, _attention_inputs,
        numbers=dict(sm_scale=0.3, d_v=D_V, rescale_threshold=4.0),
        fixed=dict(causal=True, return_lse=True, return_max_logits=True),
        dynamic=dict(q=0, indices=0), keys=("kv",)),
    "indexer_target": Case(
        mla_inductor.indexer_target, _target_inputs, numbers=dict(sm_scale=0.3),
        fixed=dict(causal=True), dynamic=dict(q=0, indices=0, lse=0), keys=("kv",)),
    "indexer_kl_loss": Case(
        mla_inductor.indexer_kl_loss, _kl_inputs, numbers=dict(kv_len=S), fixed={},
        dynamic=dict(indexer_logits=0, target=0, indices=0)),
    "lightning_indexer": Case(
        mla_inductor.lightning_indexer, _indexer_inputs, numbers=dict(topk=TOPK),
        fixed=dict(causal=True, return_scores=True), dynamic=dict(q=0, weights=0),
        keys=("k",)),
    "lightning_indexer_fp8": Case(
        mla_inductor.lightning_indexer, lambda T, S=S: _indexer_inputs(T, S, fp8=True),
        numbers=dict(topk=TOPK), fixed=dict(causal=True, return_scores=True),
        dynamic=dict(q=0, weights=0, q_scale=0), keys=("k", "k_scale")),
    "lightning_indexer_scores": Case(
        mla_inductor.lightning_indexer_scores, _scores_inputs, numbers={}, fixed={},
        dynamic=dict(q=0, weights=0, indices=0), keys=("k",)),
    # the transformers integration's absorbed per-head products (an op it registers)
    "head_matmul": Case(
        head_matmul.head_matmul, _head_matmul_inputs, numbers={}, fixed={},
        dynamic=dict(x=0, tail=0)),
    "quantize_fp8": Case(
        mla_inductor.quantize_fp8, lambda T, S=S: dict(x=torch.randn(T, H, D, generator=_gen(T))),
        numbers={}, fixed={}, dynamic=dict(x=0)),
}


class _Attributes(nn.Module):
    """The numbers as module attributes (a model's ``self.scaling``)."""

    def __init__(self, case: Case, numbers: dict):
        super().__init__()
        self.fn, self.fixed, self.names = case.fn, case.fixed, list(numbers)
        for k, v in numbers.items():
            setattr(self, k, v)

    def forward(self, tensors: dict):
        return self.fn(**tensors, **{k: getattr(self, k) for k in self.names}, **self.fixed)


def _callers(case: Case, form: str):
    """``(compile_target, call(fn, tensors))`` for one way of passing the numbers."""
    if form == "constant":
        constants = dict(case.numbers)  # baked into the traced code

        def by_constant(tensors):
            return case.fn(**tensors, **constants, **case.fixed)

        return by_constant, lambda c, tensors: c(tensors)
    if form == "argument":
        def by_argument(tensors, numbers):
            return case.fn(**tensors, **numbers, **case.fixed)

        return by_argument, lambda c, tensors: c(tensors, dict(case.numbers))
    return _Attributes(case, case.numbers), lambda c, tensors: c(tensors)


def _bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same dtype, shape and bits (NaNs included)."""
    bits = lambda t: t.detach().contiguous().flatten().view(torch.uint8)  # noqa: E731
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(bits(a), bits(b))


def _matches(got: torch.Tensor, want: torch.Tensor, backend: str) -> bool:
    """Bitwise under aot_eager. Inductor compiles the PyTorch ops around the kernels (the KL's
    mean over tokens, the fp8 scales' gradients) and may reorder their float32 sums: bitwise or
    within rel-L2 1e-6 there."""
    if _bitwise_equal(got, want) or backend != "inductor" or not want.is_floating_point():
        return _bitwise_equal(got, want)
    err = (got.double() - want.double()).norm() / want.double().norm().clamp_min(1e-30)
    return got.dtype == want.dtype and got.shape == want.shape and err.item() <= 1e-6


def _flat(out) -> list:
    return list(out) if isinstance(out, (tuple, list)) else [out]


def _run(call, fn, tensors: dict) -> list:
    """The outputs, then the gradient of their float sum in every input that requires grad."""
    outs = _flat(call(fn, tensors))
    leaves = [t for t in tensors.values() if t.requires_grad]
    graded = [o.sum() for o in outs if o.requires_grad]
    if leaves and graded:
        outs += list(torch.autograd.grad(sum(graded), leaves, allow_unused=True,
                                         materialize_grads=True))
    return outs


# Graphs Dynamo keeps over TS: one per T when static, one when every T dimension is symbolic
# from the start, and a static graph followed by one dynamic one under automatic dynamic.
MODES = {"static": 3, "dynamic": 1, "automatic": 2, "mark_dynamic": 1}


@pytest.mark.parametrize("form", ["constant", "argument", "attribute"])
@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("name", list(CASES))
def test_matrix(name, mode, backend, form):
    case = CASES[name]
    if not case.numbers and form != "argument":
        pytest.skip("no Python number to pass")
    target, call = _callers(case, form)
    torch._dynamo.reset()
    counter = CompileCounterWithBackend(backend)
    dynamic = {"static": False, "dynamic": True}.get(mode)
    compiled = torch.compile(target, backend=counter, fullgraph=True, dynamic=dynamic)
    for T in TS:
        tensors = case.inputs(T, S)
        if mode == "mark_dynamic":
            for k, dim in case.dynamic.items():
                torch._dynamo.mark_dynamic(tensors[k], dim)
        got = _run(call, compiled, tensors)
        want = _run(call, target, case.inputs(T, S))
        assert len(got) == len(want)
        assert all(_matches(g, w, backend) for g, w in zip(got, want)), (name, T)
    code = (target.forward if isinstance(target, nn.Module) else target).__code__
    graphs = len(_debug_get_cache_entry_list(code))
    assert graphs == MODES[mode], f"{graphs} graphs over T {TS}, expected {MODES[mode]}"


def test_every_registered_op_is_in_the_matrix():
    """Every ``mla_inductor::`` op appears in a graph that the matrix's cases trace (Dynamo's
    graph holds the entry ops, AOTAutograd's forward and backward graphs the ops below them)."""
    from torch._dynamo.backends.common import aot_autograd

    seen = set()

    def record(gm, *_):
        seen.update(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return gm

    def backend(gm, example_inputs):
        record(gm)
        return aot_autograd(fw_compiler=record, bw_compiler=record)(gm, example_inputs)

    for name, case in CASES.items():
        target, call = _callers(case, "argument")
        torch._dynamo.reset()
        _run(call, torch.compile(target, backend=backend, fullgraph=True), case.inputs(TS[0], S))
    registered = {n.replace("::", ".") for n in torch._C._dispatch_get_all_op_names()
                  if n.startswith("mla_inductor::")}
    reached = {r for r in registered if any(s.startswith(r + ".") or s == r for s in seen)}
    assert registered and reached == registered, sorted(registered - reached)


def test_int_numbers_stay_symbolic_under_dynamic():
    """topk, d_v and kv_len that change from call to call keep one graph under dynamic=True."""
    calls = [
        (lambda x, n: mla_inductor.lightning_indexer(x["q"], x["k"], x["weights"], n),
         _indexer_inputs),
        (lambda x, n: mla_inductor.sparse_mla(x["q"], x["kv"], x["indices"], d_v=n),
         _attention_inputs),
        (lambda x, n: mla_inductor.indexer_kl_loss(**x, kv_len=n + 6), _kl_inputs),
    ]
    for fn, inputs in calls:
        torch._dynamo.reset()
        counter = CompileCounterWithBackend("aot_eager")
        compiled = torch.compile(fn, backend=counter, fullgraph=True, dynamic=True)
        for T, n in zip(TS, (3, 4, 5)):
            x = inputs(T)
            got = _run(lambda f, t: f(t, n), compiled, x)
            want = _run(lambda f, t: f(t, n), fn, inputs(T))
            assert all(_bitwise_equal(g, w) for g, w in zip(got, want))
        assert len(_debug_get_cache_entry_list(fn.__code__)) == 1


def test_a_float_argument_guards_as_it_does_for_sdpa():
    """A float call argument (sm_scale) that changes value: PyTorch specialises a float argument
    of an op (``F.scaled_dot_product_attention``'s ``scale`` alike) and recompiles once per
    value, under dynamic=True and automatic dynamic; never a graph break, and each value reaches
    the op (the outputs equal eager's)."""
    scales = (0.1, 0.2, 0.3)

    def ours(x, s):
        return mla_inductor.sparse_mla(x["q"], x["kv"], x["indices"], d_v=D_V, sm_scale=s)

    def sdpa(x, s):
        q = x["q"].transpose(0, 1)[None]
        return F.scaled_dot_product_attention(q, q, q, scale=s)

    for dynamic in (True, None):
        counts = []
        for fn in (ours, sdpa):
            torch._dynamo.reset()
            compiled = torch.compile(fn, backend="aot_eager", fullgraph=True, dynamic=dynamic)
            x = {k: v.detach() for k, v in _attention_inputs(TS[0]).items()}
            for s in scales:
                assert _bitwise_equal(compiled(x, s), fn(x, s))
            counts.append(len(_debug_get_cache_entry_list(fn.__code__)))
        assert counts[0] == counts[1] == len(scales), counts


@pytest.mark.parametrize("name", list(CASES))
def test_export_with_dynamic_token_and_key_counts(name):
    """torch.export of a module calling the op, with T and S (the key count) dynamic: the
    exported program runs at other T and S and equals eager. ``kv_len`` is read off a tensor of
    S rows, as a model reads it off its keys."""
    case = CASES[name]

    class Call(nn.Module):
        def forward(self, tensors, keys):
            numbers = {k: (keys.shape[0] if k == "kv_len" else v) for k, v in case.numbers.items()}
            return case.fn(**tensors, **numbers, **case.fixed)

    def inputs(T, S):
        return {k: v.detach() for k, v in case.inputs(T, S).items()}, torch.empty(S, 0)

    t, s = Dim("t", min=2, max=64), Dim("s", min=2, max=64)
    shapes = ({k: {0: s} if k in case.keys else ({0: t} if k in case.dynamic else None)
               for k in inputs(TS[0], S)[0]}, {0: s})
    program = torch.export.export(Call(), inputs(TS[0], S), dynamic_shapes=shapes)
    for T, S_ in zip(TS, (S, 17, 9)):
        x = inputs(T, S_)
        got, want = _flat(program.module()(*x)), _flat(Call()(*x))
        assert len(got) == len(want)
        assert all(_bitwise_equal(g, w) for g, w in zip(got, want)), (name, T, S_)



def test_the_graph_break_count_sees_a_break():
    """The suite's graph-break check (conftest's ``no_graph_break``) reads Dynamo's counter: a
    break raises it. The counter is put back so that this test's own break is not charged."""
    saved = dict(counters["graph_break"])

    def broken(x):
        x = x + 1
        torch._dynamo.graph_break()
        return x * 2

    torch._dynamo.reset()
    x = torch.randn(3)
    assert torch.equal(torch.compile(broken, backend="eager")(x), (x + 1) * 2)
    assert sum(counters["graph_break"].values()) > sum(saved.values())
    counters["graph_break"].clear()
    counters["graph_break"].update(saved)
