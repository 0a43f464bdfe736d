"""PyTorch's deterministic mode (``torch.use_deterministic_algorithms(True)``): which backends
have a deterministic backward and which raise PyTorch's error, the choice captured into the
compiled backward graph, the deterministic path's fixed-point scale and column order, bitwise
equal runs on the CPU backends and of the training demo. The SM90 kernel's own tests (bitwise
over runs, streams and graph replays; values against float64) are in ``test_sm90_bwd.py``."""

from __future__ import annotations

import pytest
import torch
from conftest import CPU_BACKENDS, random_inputs

from mla_inductor import backends, demo, lightning_indexer_scores, sparse_mla, use_backend
from mla_inductor.kernels.sm90 import bwd_host


@pytest.fixture
def deterministic():
    def set_mode(on, warn_only=False):
        torch.use_deterministic_algorithms(on, warn_only=warn_only)

    before = (torch.are_deterministic_algorithms_enabled(),
              torch.is_deterministic_algorithms_warn_only_enabled())
    yield set_mode
    torch.use_deterministic_algorithms(before[0], warn_only=before[1])


STANDARD = (r"^sparse_mla: the {} backward does not have a deterministic implementation .*but "
            r"you set 'torch.use_deterministic_algorithms\(True\)'")


def test_only_the_sm100_backward_raises_under_deterministic_mode(deterministic):
    backends.check_deterministic("sm100", "backward")  # mode off: nothing
    deterministic(True)
    with pytest.raises(RuntimeError, match=STANDARD.format("sm100")):
        backends.check_deterministic("sm100", "backward")
    for name, direction in (("sm90", "backward"), ("sm100", "forward"), ("reference", "backward"),
                            ("emulate", "backward")):
        backends.check_deterministic(name, direction)
    deterministic(True, warn_only=True)
    with pytest.warns(UserWarning, match=STANDARD.format("sm100")):
        backends.check_deterministic("sm100", "backward")


def test_an_explicit_choice_overrides_the_mode(deterministic):
    """The op passes the mode as it was at capture: that value decides, not the mode at run
    time."""
    with pytest.raises(RuntimeError, match=STANDARD.format("sm100")):
        backends.check_deterministic("sm100", "backward", True)
    deterministic(True)
    backends.check_deterministic("sm100", "backward", False)


def test_auto_keeps_sm90_and_refuses_sm100_under_deterministic_mode(fake_gpu, monkeypatch,
                                                                    deterministic):
    from mla_inductor.kernels import sm90, sm100

    monkeypatch.setattr(sm90, "available", lambda: (True, ""))
    monkeypatch.setattr(sm100, "available", lambda: (True, ""))
    monkeypatch.setattr(sm100, "supports", lambda *a, **k: (True, ""), raising=False)
    dims = (4, 16, 8, 576, 512, frozenset())
    cuda = torch.device("cuda", 0)
    deterministic(True)
    fake_gpu((9, 0))
    assert backends.select(cuda, torch.bfloat16, "backward", dims) is sm90
    fake_gpu((10, 0))
    assert backends.select(cuda, torch.bfloat16, "forward", dims) is sm100
    with pytest.raises(RuntimeError, match=STANDARD.format("sm100")):
        backends.select(cuda, torch.bfloat16, "backward", dims)


def _backward_flags(mode_on: bool, loss, leaf, op, position: int) -> list:
    """The ``deterministic`` argument (positional ``position``) of every ``op`` call in the
    backward graph that torch.compile captures of ``loss(leaf)`` with the mode ``mode_on``."""
    from torch._dynamo.testing import AotEagerAndRecordGraphs

    torch._dynamo.reset()
    backend = AotEagerAndRecordGraphs()
    fn = torch.compile(loss, backend=backend, fullgraph=True)
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(mode_on)
    try:
        fn(leaf.detach().clone().requires_grad_()).backward()
    finally:
        torch.use_deterministic_algorithms(before)
    return [n.args[position] if len(n.args) > position else n.kwargs.get("deterministic", False)
            for graph in backend.bw_graphs for n in graph.graph.nodes if n.target == op]


def test_the_choice_is_captured_into_the_backward_graph():
    q, kv, idx = random_inputs(4, 2, 16, 12, 5, dtype=torch.float32, seed=3)
    args = (lambda x: sparse_mla(x, kv, idx, d_v=8).sum(), q,
            torch.ops.mla_inductor.sparse_mla_bwd.default, 13)
    assert _backward_flags(True, *args) == [True]
    assert _backward_flags(False, *args) == [False]


def test_the_scores_choice_is_captured_into_the_backward_graph():
    g = torch.Generator().manual_seed(5)
    q, k = torch.randn(1, 4, 2, 8, generator=g), torch.randn(1, 6, 8, generator=g)
    w = torch.randn(1, 4, 2, generator=g)
    idx = torch.randint(-1, 7, (1, 4, 3), generator=g, dtype=torch.int32)
    args = (lambda x: lightning_indexer_scores(x, k, w, idx).sum(), q,
            torch.ops.mla_inductor.lightning_indexer_scores_bwd.default, 5)
    assert _backward_flags(True, *args) == [True]
    assert _backward_flags(False, *args) == [False]


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_the_cpu_backends_are_deterministic(backend, deterministic):
    """Under the switch the CPU backward runs, and two runs are bitwise equal (duplicated
    indices included: dkv's index_add_ is deterministic on a CPU)."""
    deterministic(True)
    q, kv, idx = random_inputs(8, 4, 32, 6, 12, dtype=torch.float32, seed=2)
    sink = torch.randn(4)

    def run():
        args = [t.clone().requires_grad_() for t in (q, kv, sink)]
        with use_backend(backend):
            out, lse = sparse_mla(args[0], args[1], idx, d_v=16, attn_sink=args[2],
                                  return_lse=True)
            (out.square().sum() + lse.sum()).backward()
        return [out.detach(), lse.detach()] + [a.grad for a in args]

    first, second = run(), run()
    for a, b in zip(first, second):
        assert torch.equal(a, b)


def test_the_reference_backward_turns_the_mode_on_when_asked():
    """A backward captured with the mode on (sparse_mla's and the indexer scores') runs its
    index_add_ under the mode even when the mode is off at run time, and leaves the mode as it
    found it."""
    from mla_inductor.kernels import reference

    seen = []
    real = torch.Tensor.index_add_

    def spy(self, *args, **kwargs):
        seen.append(torch.are_deterministic_algorithms_enabled())
        return real(self, *args, **kwargs)

    q, kv, idx = random_inputs(3, 2, 16, 10, 4, dtype=torch.float32, seed=4)
    dout = torch.randn(3, 2, 8)
    qi, ki, wi = torch.randn(1, 3, 2, 8), torch.randn(1, 10, 8), torch.randn(1, 3, 2)
    torch.Tensor.index_add_ = spy
    try:
        assert not torch.are_deterministic_algorithms_enabled()
        for flag in (True, False):
            reference.backward(dout, None, q, kv, idx, None, None, None, None, None, None,
                               0.25, 8, deterministic=flag)
            reference.lightning_indexer_scores_bwd(torch.randn(1, 3, 4), qi, ki, wi, idx[None],
                                                   flag)
    finally:
        torch.Tensor.index_add_ = real
    assert seen == [True, True, False, False]
    assert not torch.are_deterministic_algorithms_enabled()


# -- the sm90 fixed-point path's host side (no GPU needed) -------------------------------------


def _scale_inputs(T=5, H=3, d_qk=16, d_v=8, S=7, seed=0, dlse=True):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(T, H, d_v, generator=g), torch.randn(T, H, d_qk, generator=g) * 3,
            torch.randn(S, d_qk, generator=g), torch.randn(T, H, generator=g) if dlse else None)


def test_fixed_point_scale_is_the_bound_written_out():
    dout, q, kv, dlse = _scale_inputs()
    sm_scale, d_v = 0.3, 8
    scale, inverse = bwd_host.fixed_point_scale(dout, q, kv, dlse, sm_scale, d_v)
    m = [float(x.abs().max()) for x in (dout, q, kv, dlse)]
    bound = 5 * 3 * (m[0] + sm_scale * m[1] * (2 * d_v * m[0] * m[2] + m[3]))
    k = 61 - torch.tensor(bound, dtype=torch.float64).log2().ceil()
    assert scale.dtype == torch.float32 and scale.shape == (1,)
    assert scale.item() == 2.0 ** k.item() and inverse.item() == 2.0 ** -k.item()
    assert 2**60 < bound * scale.item() <= 2**61


def test_fixed_point_scale_edges():
    dout, q, kv, _ = _scale_inputs(dlse=False)
    zero = bwd_host.fixed_point_scale(torch.zeros_like(dout), q, kv, None, 0.3, 8)
    assert zero[0].item() == 2.0**126  # the clamp: every term is 0
    big = bwd_host.fixed_point_scale(dout * 1e30, q * 1e4, kv * 1e30, None, 0.3, 8)
    assert big[0].item() == 2.0**-126 and torch.isfinite(big[1])
    for bad in (float("nan"), float("inf")):
        d = dout.clone()
        d[0, 0, 0] = bad
        scale, inverse = bwd_host.fixed_point_scale(d, q, kv, None, 0.3, 8)
        assert torch.isfinite(scale).all() and torch.isnan(inverse)


def test_fixed_point_postprocess_round_trips_the_column_order():
    """dkv_from_fixed(dkv_fixed_interleave(x)) * 2**-k is x * 2**-k for int64 x, and the order
    is the one the kernel's scatter writes: column 8 jh + 2 q + e at 8 jh + 4 e + q."""
    x = torch.arange(3 * 32, dtype=torch.int64).reshape(3, 32) - 40
    stored = bwd_host.dkv_fixed_interleave(x)
    for col in range(32):
        group, c = divmod(col, 16)
        jh, rem = divmod(c, 8)
        q, e = divmod(rem, 2)
        assert torch.equal(stored[:, group * 16 + 8 * jh + 4 * e + q], x[:, col])
    inverse = torch.tensor(2.0**-3, dtype=torch.float64)
    got = bwd_host.dkv_from_fixed(stored, inverse, torch.float32)
    assert torch.equal(got, x.double().mul(2.0**-3).float())


def test_the_demo_gives_bitwise_equal_losses_twice():
    """The training demo (compiled, the indexer loss on) run twice under the mode: the same
    loss at every step, bit for bit."""
    tiny = dict(steps=4, batch=2, seq_len=32, d_model=32, d_latent=16, d_rope=8, heads=2,
                layers=1, topk=8, d_index=8, lr=1e-2, val_batches=1, sample_tokens=4,
                device="cpu", deterministic=True)
    first = demo.run(demo.Config(**tiny), out=lambda line: None)
    second = demo.run(demo.Config(**tiny), out=lambda line: None)
    assert len(first.losses) == 4
    assert first.losses == second.losses
    assert not torch.are_deterministic_algorithms_enabled()
