"""DTensor inputs through sparse_mla (:mod:`mla_inductor.distributed`): spawned process groups,
every result equal to the single-process one on the full tensors.

One set of checks, two variants (:class:`Setup`):

- ``GLOO``: CPU, gloo, groups of 2 and 4 ranks, float32 tiny shapes, the reference backend; every
  result equal to the single process's to float32's tolerance (``torch.testing.assert_close``'s
  defaults: only the order of sums differs).
- ``NCCL``: 2 CUDA GPUs of capability (9, 0), NCCL, one GPU per rank, bf16 at the kernels'
  widths (T 256, H 128: 64 heads, one whole head tile, per rank under head sharding; d_qk 576,
  d_v 512, S 512, topk 256 with empty slots and future keys), the sm90 backend; marked ``cuda``
  and skipped, with the reason, elsewhere. Each single-process result is computed on the rank's
  own GPU. out, lse, max_logits, dq and the indexer target must be **bitwise** equal: in the
  sm90 kernels one CTA computes each tile (one token x 64 heads) from that token's q, indices and
  positions and the whole kv (``kernels/sm90/fwd.py``, ``bwd.py``: dq leaves the CTA from registers;
  ``indexer_target_kernel.py``: one CTA per token with all its heads), the forward's compile key has
  no head count, the backward's static head count only masks heads >= H, so sharding heads in whole
  tiles or tokens (kv replicated or all-gathered, a bitwise copy) gives every CTA the same work. dkv
  sums fp32 atomics (their order varies from run to run) and is rounded to bf16
  per rank before the sum over the ranks: see :func:`_assert_dkv`; d_sink sums float32 terms in
  another order: :func:`_assert_d_sink`; training losses: :func:`_assert_losses`.

One group per variant and world size runs every check (spawning is slow;
:func:`mla_inductor.bench.ranks.spawn`) and returns, per rank, the error of each check or ``None``;
the tests below read them. Checks: each placement of the sharding rules (forward values out, lse,
max_logits and the gradients of q, kv and the sink, with a loss that reaches lse); redistributions
(kv sharded on tokens, q sharded on d_qk); uneven token shards; (4 ranks) a 2 x 2 mesh sharding
tokens and heads at once; a 2-layer DSA model (:class:`mla_inductor.bench.dist_train.Model`) trained
3 steps under ``parallelize_module`` (tensor parallel over heads) and under ``fully_shard`` (FSDP2),
losses equal to one process's; the indexer target's rules; the lightning indexer ops' rules, in
float32 and in fp8 (CPU only); and (2 ranks) ``torch.compile`` with ``fullgraph=True`` on
DTensor inputs, forward and backward. The GPU variant runs the checks of :data:`GPU_CHECKS`.
"""

from __future__ import annotations

import os
import subprocess
import sys
import traceback
from typing import NamedTuple

import pytest
import torch
import torch.distributed as dist

from conftest import kernel_available
from mla_inductor import (backends, indexer_target, lightning_indexer, lightning_indexer_scores,
                          quantize_fp8, sparse_mla)
from mla_inductor.bench.dist_train import Model, Widths, parallelize_heads, train
from mla_inductor.bench.ranks import spawn

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")


class Setup(NamedTuple):
    """One variant of the checks: where they run, the backend and element type, the sizes
    (``batch`` sequences of the batched checks, ``dim`` the trained model's width), whether the
    placements marked batched take batched inputs (else flat ones: on the GPUs, where q
    ``Shard(1)`` must shard the heads and :func:`_dkv_parts` splits the flat layout) and the
    group's collective timeout."""

    device_type: str  # "cpu" (gloo) or "cuda" (NCCL, one GPU per rank)
    backend: str  # MLA_INDUCTOR_BACKEND in the ranks
    dtype: str  # of q and kv (the sink is float32)
    T: int
    H: int
    d_qk: int
    d_v: int
    S: int
    topk: int
    batch: int
    dim: int
    batched: bool
    timeout_s: float


GLOO = Setup("cpu", "reference", "float32", T=8, H=4, d_qk=16, d_v=8, S=12, topk=6, batch=4,
             dim=32, batched=True, timeout_s=120)
# timeout: a rank may wait in a collective while the other compiles a kernel (seconds each)
NCCL = Setup("cuda", "sm90", "bfloat16", T=256, H=128, d_qk=576, d_v=512, S=512, topk=256,
             batch=2, dim=256, batched=False, timeout_s=900)
PLACEMENTS = ("replicated", "heads", "tokens", "tokens_kv_sharded", "batch", "q_sharded_on_d_qk",
              "tokens_uneven")
CHECKS = (*PLACEMENTS, "tp_training", "fsdp2_training", "indexer_target", "lightning",
          "lightning_fp8", "head_matmul")
GPU_CHECKS = ("replicated", "heads", "tokens", "tokens_kv_sharded", "tp_training",
              "fsdp2_training", "indexer_target", "compile")
OUTPUTS = ("out", "lse", "max_logits", "dq", "dkv", "d_sink")
BF16_UNIT_ROUNDOFF = 2.0**-8
FP32_UNIT_ROUNDOFF = 2.0**-24


def _inputs(setup: Setup, batched: bool):
    """q, kv, indices, topk_length, q_positions, attn_sink (seeded, drawn in float32 on the CPU,
    some empty slots and future keys), on ``setup``'s device, q and kv in its dtype."""
    g = torch.Generator().manual_seed(0)
    lead = (setup.batch,) if batched else ()
    T, S, topk = setup.T, setup.S, setup.topk
    q = torch.randn(*lead, T, setup.H, setup.d_qk, generator=g)
    kv = torch.randn(*lead, S, setup.d_qk, generator=g)
    indices = torch.randint(-1, S, (*lead, T, topk), generator=g, dtype=torch.int32)
    topk_length = torch.randint(1, topk + 1, (*lead, T), generator=g, dtype=torch.int32)
    q_positions = torch.randint(S // 2, S, (*lead, T), generator=g, dtype=torch.int32)
    sink = torch.randn(setup.H, generator=g)
    dtype, device = getattr(torch, setup.dtype), setup.device_type
    return (q.to(device, dtype), kv.to(device, dtype), indices.to(device),
            topk_length.to(device), q_positions.to(device), sink.to(device))


def _attend(setup: Setup, with_max_logits: bool):
    """``f(q, kv, indices, topk_length, q_positions, sink) -> (out, lse, max_logits or None,
    loss)``: causal sparse_mla and a loss through out and lse; only the loss carries a gradient
    (a compiled function's other outputs must not: no tangent would reach them)."""

    def f(q, kv, indices, topk_length, q_positions, sink):
        out, lse, *max_logits = sparse_mla(
            q, kv, indices, d_v=setup.d_v, topk_length=topk_length, causal=True,
            q_positions=q_positions, attn_sink=sink, return_lse=True,
            return_max_logits=with_max_logits,
        )
        loss = out.square().sum() + (0.5 * lse).sum()
        return out.detach(), lse.detach(), (max_logits or [None])[0], loss

    return f


def _run(f, q, kv, indices, topk_length, q_positions, sink):
    """``f``'s (:func:`_attend`) out, lse, max_logits and the gradients of q, kv and the sink."""
    q, kv, sink = (t.detach().requires_grad_() for t in (q, kv, sink))
    out, lse, max_logits, loss = f(q, kv, indices, topk_length, q_positions, sink)
    loss.backward()
    return out, lse, max_logits, q.grad, kv.grad, sink.grad


def _dkv_parts(setup: Setup, f, full, q_placement, ranks: int):
    """The dkv of each rank's share of the work, computed by one process (flat layout): the
    rank's heads (q ``Shard(1)``), its tokens with their global causal positions (q
    ``Shard(0)``), or the whole problem (q gathered: each rank computes every term)."""
    from torch.distributed.tensor import Shard

    q, kv, indices, topk_length, q_positions, sink = full

    def rows(n):
        return [slice(int(c[0]), int(c[-1]) + 1) for c in torch.arange(n).chunk(ranks)]

    if q_placement == Shard(1):
        shares = [(q[:, h], kv, indices, topk_length, q_positions, sink[h]) for h in rows(setup.H)]
    elif q_placement == Shard(0):
        if q_positions is None:  # the default: S - T + t
            q_positions = torch.arange(setup.S - setup.T, setup.S, device=q.device,
                                       dtype=torch.int32)
        shares = [(q[t], kv, indices[t], None if topk_length is None else topk_length[t],
                   q_positions[t], sink) for t in rows(setup.T)]
    else:
        shares = [full]
    return [_run(f, *share)[4] for share in shares]


def _assert_dkv(got, expected, parts, msg: str) -> None:
    """dkv on the GPUs: ``got = bf16(sum_r bf16(A_r))`` (each rank's fp32 atomics ``A_r`` rounded
    to kv's dtype, then summed over the ranks by the collective), ``expected = bf16(sum_r A_r)``
    up to the atomics' order. With u = 2**-8 (bf16's unit roundoff) the three roundings bound the
    difference by ``3u (1 + u) sum_r |A_r|`` <= ``4u sum_r |parts_r|`` (``parts``: each rank's
    share computed on one GPU, :func:`_dkv_parts`); the atomics' order adds at most
    ``n 2**-24 sum |terms|`` for an element's n (about 100 here) fp32 additions, below
    ``2**-16 max |expected|`` for these inputs."""
    bound = 4 * BF16_UNIT_ROUNDOFF * sum(p.float().abs() for p in parts)
    bound += 2.0**-16 * expected.float().abs().max()
    err = (got.float() - expected.float()).abs()
    bad = err > bound
    assert not bad.any(), (f"{msg}: {int(bad.sum())} of {bad.numel()} elements past the bound, "
                           f"the worst {float((err - bound).max()):.3g} over it")


def _assert_d_sink(setup: Setup, got, expected, single, sink, msg: str) -> None:
    """d_sink on the GPUs: ``-sum_t exp(sink - lse) (dpsum - dlse)`` in float32 from the
    kernel's per-row dpsum (bitwise the same per row, see the module docstring) summed over the
    T tokens in another order (one sum, or a sum per rank and then over the ranks): at most
    ``2 T 2**-24 sum_t |term_t|``. Here ``dout = 2 out`` and ``dlse = 0.5`` (the loss), so
    ``|dpsum - dlse| <= 2 sum_d out^2 + 0.5`` (out + o_lo ~ out), taken twice for margin."""
    out, lse = single[0].double(), single[1].double()
    terms = (sink.double()[None, :] - lse).exp() * (2 * out.square().sum(-1) + 0.5)
    bound = 4 * setup.T * FP32_UNIT_ROUNDOFF * terms.sum(0)
    err = (got.double() - expected.double()).abs()
    assert bool((err <= bound).all()), f"{msg}: {err.tolist()} past {bound.tolist()}"


def _same(setup: Setup, got, expected, msg: str) -> None:
    """float32's tolerance on gloo, bitwise on the GPUs (module docstring)."""
    if setup.backend == "reference":
        torch.testing.assert_close(got, expected, msg=lambda m: f"{msg}: {m}")
    else:
        worst = float((got.float() - expected.float()).abs().max())
        assert torch.equal(got, expected), f"{msg}: not bitwise equal, largest difference {worst:.3g}"


def _assert_results(setup: Setup, name: str, got, expected, parts, sink) -> None:
    """``got`` (DTensors, :func:`_run`'s order) against the single-process ``expected``
    (:func:`_same`; on the GPUs dkv and d_sink within their bounds)."""
    gpu = setup.backend != "reference"
    for what, a, b in zip(OUTPUTS, got, expected):
        if b is None:
            continue
        a, msg = a.full_tensor(), f"{name} {what}"
        if gpu and what == "dkv":
            _assert_dkv(a, b, parts, msg)
        elif gpu and what == "d_sink":
            _assert_d_sink(setup, a, b, expected, sink, msg)
        else:
            _same(setup, a, b, msg)


def _check_placement(mesh, setup: Setup, name: str) -> None:
    """Placement ``name`` (see PLACEMENTS) against the single-process result: every output equal
    to it, and every gradient in its input's placement."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    R = Replicate()
    # q, kv, indices, topk_length, q_positions, sink; positions None: the causal default.
    cases = {
        "replicated": ((R, R, R, R, R, R), True),
        "heads": ((Shard(1), R, R, R, R, Shard(0)), True),
        "tokens": ((Shard(0), R, Shard(0), Shard(0), Shard(0), R), True),
        "tokens_kv_sharded": ((Shard(0), Shard(0), Shard(0), Shard(0), None, R), False),
        "batch": ((Shard(0),) * 5 + (R,), True),
        "q_sharded_on_d_qk": ((Shard(2), R, R, R, R, R), False),
        "tokens_uneven": ((Shard(0), R, Shard(0), Shard(0), Shard(0), R), False),
    }
    placements, batched = cases[name]
    full = list(_inputs(setup, batched and setup.batched))
    if name == "tokens_uneven":  # T = 7 tokens: shards of 4 and 3 (2, 2, 2, 1 on 4 ranks)
        full = [t if i in (1, 5) else t[:7] for i, t in enumerate(full)]
    if placements[4] is None:
        full[4] = None
    f = _attend(setup, with_max_logits=True)
    expected = _run(f, *full)
    parts = (None if setup.backend == "reference"
             else _dkv_parts(setup, f, full, placements[0], mesh.size()))
    shards = [None if t is None else distribute_tensor(t, mesh, [p])
              for t, p in zip(full, placements)]
    got = _run(f, *shards)
    _assert_results(setup, name, got, expected, parts, full[5])
    for what, grad, placement in (("dq", got[3], placements[0]), ("dkv", got[4], placements[1]),
                                  ("d_sink", got[5], placements[5])):
        assert grad.placements == (placement,), f"{name} {what}: {grad.placements}"


def _check_indexer_target(mesh, setup: Setup) -> None:
    """indexer_target with its inputs sharded on tokens, and with q and lse sharded on heads
    (gathered: the target normalises over heads), equal to the single-process target."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    q, kv, indices, topk_length, q_positions, sink = _inputs(setup, False)
    _, lse = sparse_mla(q, kv, indices, d_v=setup.d_v, topk_length=topk_length, causal=True,
                        q_positions=q_positions, attn_sink=sink, return_lse=True)
    expected = indexer_target(q, kv, indices, lse, topk_length=topk_length, causal=True,
                              q_positions=q_positions, attn_sink=sink)
    R = Replicate()
    for name, (row, token, sink_p) in {"tokens": (Shard(0), Shard(0), R),
                                       "heads": (Shard(1), R, Shard(0))}.items():
        args = [distribute_tensor(t, mesh, [p]) for t, p in
                zip((q, kv, indices, lse), (row, R, token, row))]
        got = indexer_target(*args, topk_length=distribute_tensor(topk_length, mesh, [token]),
                             causal=True, q_positions=distribute_tensor(q_positions, mesh, [token]),
                             attn_sink=distribute_tensor(sink, mesh, [sink_p]))
        _same(setup, got.full_tensor(), expected, name)


def _lightning(q, k, w, q_positions, topk):
    """The selection (given positions, and the default ones) and a loss through its scores and
    ``lightning_indexer_scores`` at its slots: ``([indices, default-position indices, scores,
    dq, dk, dweights]`` with DTensors gathered, the collectives the first selection issued)."""
    from torch.distributed.tensor.debug import CommDebugMode

    q, k, w = (t.detach().requires_grad_() for t in (q, k, w))
    with CommDebugMode() as comms:
        indices, scores = lightning_indexer(q, k, w, topk, causal=True, q_positions=q_positions,
                                            return_scores=True)
    default = lightning_indexer(q.detach(), k.detach(), w.detach(), topk, causal=True)
    (scores.square().sum() + lightning_indexer_scores(q, k, w, indices).sum()).backward()
    found = [indices, default, scores.detach(), q.grad, k.grad, w.grad]
    return ([t.full_tensor() if hasattr(t, "full_tensor") else t for t in found],
            comms.get_total_counts())


def _lightning_inputs(mesh, setup: Setup, seed: int):
    """``([q [B, T, H, 16], k [B, S, 16], weights [B, T, H], q_positions [B, T] int32], topk)``
    on the setup's device, ``B`` the mesh's size (one batch element per rank under the batch
    rule), positions in the second half of the keys."""
    g = torch.Generator().manual_seed(seed)
    B, T, S, H = mesh.size(), setup.T, setup.S, setup.H
    full = (torch.randn(B, T, H, 16, generator=g), torch.randn(B, S, 16, generator=g),
            torch.randn(B, T, H, generator=g),
            torch.randint(S // 2, S, (B, T), generator=g, dtype=torch.int32))
    return [t.to(setup.device_type) for t in full], setup.topk


def _check_lightning(mesh, setup: Setup) -> None:
    """The lightning indexer ops, batched, causal, on the tokens, batch, heads (the scores'
    rule; the selection gathers q's heads) and replicated placements: the same indices as one
    process, scores and gradients equal to its to float32's tolerance; on tokens and batch the
    selection runs on the shards with no collective."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    full, topk = _lightning_inputs(mesh, setup, seed=1)
    expected, _ = _lightning(*full, topk)
    R = Replicate()
    for name, placements in {"tokens": (Shard(1), R, Shard(1), Shard(1)),
                             "batch": (Shard(0),) * 4, "heads": (Shard(2), R, Shard(2), R),
                             "replicated": (R,) * 4}.items():
        got, comms = _lightning(*[distribute_tensor(t, mesh, [p]) for t, p in
                                  zip(full, placements)], topk)
        assert name not in ("tokens", "batch") or comms == 0, f"{name}: {comms} collectives"
        for what, a, b in zip(("indices", "default-position indices"), got[:2], expected[:2]):
            assert torch.equal(a, b), f"{name}: {what}"
        for what, a, b in zip(("scores", "dq", "dk", "dweights"), got[2:], expected[2:]):
            torch.testing.assert_close(a, b, msg=lambda m: f"{name}: {what}: {m}")


def _lightning_fp8(q, k, w, q_positions, topk):
    """The fp8 selection of :func:`mla_inductor.quantize_fp8`'s q and k (quantised where they
    lie: on DTensors, per row of the local shard) and a loss through its scores: ``([indices,
    scores, dweights, dq_scale, dk_scale], the collectives of quantisation and selection)``."""
    from torch.distributed.tensor.debug import CommDebugMode

    w = w.detach().requires_grad_()
    with CommDebugMode() as comms:
        (q8, q_scale), (k8, k_scale) = quantize_fp8(q), quantize_fp8(k)
        q_scale, k_scale = q_scale.requires_grad_(), k_scale.requires_grad_()
        indices, scores = lightning_indexer(q8, k8, w, topk, causal=True, q_positions=q_positions,
                                            return_scores=True, q_scale=q_scale, k_scale=k_scale)
    scores.square().sum().backward()
    found = [indices, scores.detach(), w.grad, q_scale.grad, k_scale.grad]
    return ([t.full_tensor() if hasattr(t, "full_tensor") else t for t in found],
            comms.get_total_counts())


def _check_lightning_fp8(mesh, setup: Setup) -> None:
    """The fp8 selection on the tokens, batch and replicated placements (q_scale placed as q,
    k_scale as k): the same indices as one process, scores and the gradients of weights,
    q_scale and k_scale equal to its to float32's tolerance; on tokens and batch no collective
    in the quantisation or the selection."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    full, topk = _lightning_inputs(mesh, setup, seed=3)
    expected, _ = _lightning_fp8(*full, topk)
    R = Replicate()
    for name, placements in {"tokens": (Shard(1), R, Shard(1), Shard(1)),
                             "batch": (Shard(0),) * 4, "replicated": (R,) * 4}.items():
        got, comms = _lightning_fp8(*[distribute_tensor(t, mesh, [p]) for t, p in
                                      zip(full, placements)], topk)
        assert name == "replicated" or comms == 0, f"{name}: {comms} collectives"
        assert torch.equal(got[0], expected[0]), f"{name}: indices"
        for what, a, b in zip(("scores", "dweights", "dq_scale", "dk_scale"), got[1:],
                              expected[1:]):
            torch.testing.assert_close(a, b, msg=lambda m: f"{name}: {what}: {m}")


def _check_head_matmul(mesh, setup: Setup) -> None:
    """The transformers integration's head_matmul, with and without a tail, on heads (w sharded
    on its heads) and on tokens: the product and the gradients of x, w and tail equal to one
    process's (float32's tolerance), with no collective in the forward."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.debug import CommDebugMode

    from mla_inductor.integrations.transformers.head_matmul import head_matmul

    g = torch.Generator().manual_seed(2)
    N, H, k, m, e = 2 * mesh.size(), 2 * mesh.size(), 6, 5, 3
    full = [torch.randn(N, H, k, generator=g), torch.randn(H, k, m, generator=g),
            torch.randn(N, H, e, generator=g)]
    full = [t.to(setup.device_type) for t in full]

    def run(x, w, tail):
        x, w, tail = (None if t is None else t.detach().requires_grad_() for t in (x, w, tail))
        with CommDebugMode() as comms:
            y = head_matmul(x, w, tail)
        dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(3)).to(y.device)
        if hasattr(y, "device_mesh"):
            dy = distribute_tensor(dy, mesh, y.placements)
        (y * dy).sum().backward()
        found = [y.detach(), x.grad, w.grad] + ([] if tail is None else [tail.grad])
        return ([t.full_tensor() if hasattr(t, "full_tensor") else t for t in found],
                comms.get_total_counts())

    R = Replicate()
    for with_tail in (True, False):
        args = full if with_tail else full[:2] + [None]
        expected, _ = run(*args)
        for name, placements in {"heads": (Shard(1), Shard(0), Shard(1)),
                                 "tokens": (Shard(0), R, Shard(0))}.items():
            got, comms = run(*[None if t is None else distribute_tensor(t, mesh, [p])
                               for t, p in zip(args, placements)])
            assert comms == 0, f"{name}: {comms} collectives"
            for a, b in zip(got, expected):
                torch.testing.assert_close(a, b, msg=lambda m: f"{name}, tail {with_tail}: {m}")


def _check_mesh_2d(mesh, setup: Setup) -> None:
    """A 2 x 2 mesh, context parallel x tensor parallel: q sharded on tokens and on heads, the
    per-token tensors on tokens, the sink on heads, kv replicated; values and gradients equal to
    the single-process ones."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    R = Replicate()
    mesh = init_device_mesh(setup.device_type, (2, 2), mesh_dim_names=("cp", "tp"))
    full = _inputs(setup, batched=False)
    f = _attend(setup, with_max_logits=True)
    expected = _run(f, *full)
    placements = ((Shard(0), Shard(1)), (R, R), (Shard(0), R), (Shard(0), R), (Shard(0), R),
                  (R, Shard(0)))
    got = _run(f, *[distribute_tensor(t, mesh, p) for t, p in zip(full, placements)])
    _assert_results(setup, "2-D mesh", got, expected, None, full[5])


def _widths(setup: Setup) -> Widths:
    """The trained model's widths: ``setup``'s heads and attention widths, ``dim`` wide."""
    return Widths(dim=setup.dim, heads=setup.H, d_qk=setup.d_qk, d_v=setup.d_v,
                  dtype=setup.dtype)


def _batch(setup: Setup):
    """``x [batch, T, dim]`` float32 and ``indices [batch, T, topk]`` int32 (-1 and future keys
    among them), seeded, on ``setup``'s device."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(setup.batch, setup.T, setup.dim, generator=g)
    indices = torch.randint(-1, setup.T, (setup.batch, setup.T, setup.topk), generator=g,
                            dtype=torch.int32)
    return x.to(setup.device_type), indices.to(setup.device_type)


def _assert_losses(setup: Setup, got, expected) -> None:
    """3 SGD steps' losses: float32's tolerance on gloo. On the GPUs the runs differ only by
    roundings: a split float32 matmul can round an element of q or kv to the other neighbouring
    bf16 value, and dkv is rounded to bf16 per rank before the sum. Each moves the values it
    touches by at most u = 2**-8 relative, and those are only part of what the loss sums (the
    residual x is never rounded), and a gradient changed so moves the next step's parameters by
    lr times that change: so the losses agree to within u relative."""
    if setup.backend == "reference":
        torch.testing.assert_close(got, expected)
    else:
        torch.testing.assert_close(got, expected, rtol=BF16_UNIT_ROUNDOFF, atol=0)


def _check_tp_training(mesh, setup: Setup) -> None:
    """Tensor parallel over heads (:func:`parallelize_heads`): q column-parallel (a DTensor
    sharded on heads), the latent kv and the indices replicated DTensors, the sink sharded with
    the heads, wo row-parallel."""
    x, indices = _batch(setup)
    w, device = _widths(setup), setup.device_type
    expected = train(Model(w).to(device), [(x, indices)] * 3, lr=0.5)
    got = train(parallelize_heads(Model(w).to(device), mesh), [(x, indices)] * 3, lr=0.5)
    _assert_losses(setup, got, expected)


def _check_fsdp2_training(mesh, setup: Setup) -> None:
    """FSDP2 over the whole model, the batch split over the ranks: the op sees plain tensors."""
    from torch.distributed.fsdp import fully_shard

    x, indices = _batch(setup)
    w, device = _widths(setup), setup.device_type
    expected = train(Model(w).to(device), [(x, indices)] * 3, lr=0.5)
    model = Model(w).to(device)
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    rank, n = dist.get_rank(), dist.get_world_size()
    local = slice(rank * setup.batch // n, (rank + 1) * setup.batch // n)

    def mean_over_ranks(loss):
        loss = loss.detach().clone()
        dist.all_reduce(loss, op=dist.ReduceOp.AVG)
        return loss

    _assert_losses(setup, train(model, [(x[local], indices[local])] * 3, lr=0.5,
                                reduce=mean_over_ranks), expected)


def _check_compile(mesh, setup: Setup) -> None:
    """The context-parallel call (q, indices sharded on tokens, kv all-gathered, causal default
    positions) and the tensor-parallel one (a replicated sink sliced to the heads) under
    torch.compile(fullgraph=True): no graph break, values and gradients equal to the eager
    single-process ones."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    # torch 2.13 keys the AOTAutograd cache of a DTensor graph without the rank, so a rank can load
    # another rank's graph, with that rank's slice of a replicated input baked in
    # (pytorch/pytorch#188390): the workaround docs/integrations.md gives.
    from torch._functorch import config as functorch_config

    functorch_config.enable_autograd_cache = False

    f = _attend(setup, with_max_logits=False)
    compiled = torch.compile(f, fullgraph=True)
    q, kv, indices, _, _, sink = _inputs(setup, batched=False)
    full = (q, kv, indices, None, None, sink)
    expected = _run(f, *full)
    R = Replicate()
    for name, placements in (("tokens", (Shard(0), Shard(0), Shard(0), R)),
                             ("heads", (Shard(1), R, R, R))):
        parts = (None if setup.backend == "reference"
                 else _dkv_parts(setup, f, full, placements[0], mesh.size()))
        q_d, kv_d, indices_d, sink_d = (distribute_tensor(t, mesh, [p])
                                        for t, p in zip((q, kv, indices, sink), placements))
        got = _run(compiled, q_d, kv_d, indices_d, None, None, sink_d)
        _assert_results(setup, f"compiled {name}", got, expected, parts, sink)


def _run_checks(mesh, device, setup: Setup, checks: tuple) -> dict:
    """One rank's part (:func:`mla_inductor.bench.ranks.spawn` runs it on every rank): every
    check on ``setup``'s backend; returns ``{check: None or the traceback of its error}``."""
    os.environ[backends.ENV_VAR] = setup.backend
    results = {}
    for name in checks:
        try:
            if name in PLACEMENTS:
                _check_placement(mesh, setup, name)
            else:
                globals()[f"_check_{name}"](mesh, setup)
            results[name] = None
        except Exception:  # recorded for the test of that check
            results[name] = traceback.format_exc()
    return results


def _spawn(setup: Setup, ranks: int, checks: tuple) -> list[dict]:
    return spawn(_run_checks, ranks, setup.device_type, (setup, checks),
                 timeout_s=setup.timeout_s)


def _two_sm90_gpus() -> tuple[bool, str]:
    """Whether 2 CUDA GPUs of capability (9, 0) are visible and the sm90 kernels run, and why
    not."""
    if not torch.cuda.is_available():
        return False, "needs 2 CUDA GPUs of capability (9, 0): no CUDA device"
    caps = [torch.cuda.get_device_capability(i) for i in range(torch.cuda.device_count())]
    if sum(cap == (9, 0) for cap in caps) < 2:
        return False, f"needs 2 CUDA GPUs of capability (9, 0), found {caps}"
    ok, why = kernel_available("sm90")
    return ok, why


TWO_SM90_GPUS = _two_sm90_gpus()


@pytest.fixture(scope="module")
def two_ranks():
    return _spawn(GLOO, 2, (*CHECKS, "compile"))


@pytest.fixture(scope="module")
def four_ranks():
    return _spawn(GLOO, 4, (*CHECKS, "mesh_2d"))


@pytest.fixture(scope="module")
def two_gpus():
    return _spawn(NCCL, 2, GPU_CHECKS)


def _assert_passed(results: list[dict], name: str) -> None:
    failed = {rank: r[name] for rank, r in enumerate(results) if r[name] is not None}
    assert not failed, "\n".join(f"rank {rank}:\n{err}" for rank, err in failed.items())


@pytest.mark.parametrize("name", (*CHECKS, "compile"))
def test_two_ranks(two_ranks, name):
    _assert_passed(two_ranks, name)


@pytest.mark.parametrize("name", (*CHECKS, "mesh_2d"))
def test_four_ranks(four_ranks, name):
    _assert_passed(four_ranks, name)


@pytest.mark.cuda
@pytest.mark.skipif(not TWO_SM90_GPUS[0], reason=TWO_SM90_GPUS[1])
@pytest.mark.parametrize("name", GPU_CHECKS)
def test_two_gpus(two_gpus, name):
    _assert_passed(two_gpus, name)


def _ranks_in_order(mesh, device):
    """A rank's function for :func:`spawn`: its rank."""
    return mesh.get_rank()


def _refuse(mesh, device):
    """A rank's function for :func:`spawn` that raises on every rank (before any collective, so
    that no rank's error is a peer's lost connection)."""
    raise ValueError(f"rank {mesh.get_rank()} refuses")


def test_spawn_returns_every_rank_and_reports_a_rank_that_raised():
    """Every rank's result in rank order, each rank leaving through ``os._exit(0)``; a rank's
    exception reaches the caller with its message."""
    import torch.multiprocessing as mp

    assert spawn(_ranks_in_order, 2, "cpu") == [0, 1]
    with pytest.raises(mp.ProcessRaisedException, match="rank [01] refuses"):
        spawn(_refuse, 2, "cpu")


def test_the_package_imports_without_torch_distributed():
    code = ("import sys, torch; torch.distributed.is_available = lambda: False; "
            "import mla_inductor; print('torch.distributed.tensor' in sys.modules)")
    found = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert found.stdout.strip() == "False"


def test_rules_are_registered_when_dtensor_is_imported_after_the_package():
    """``import mla_inductor`` leaves DTensor unimported; importing it afterwards (or before)
    registers the rules of every leaf op with DTensor's sharding propagator."""
    code = ("import sys, torch, mla_inductor; print('torch.distributed.tensor' in sys.modules); "
            "from torch.distributed.tensor import DTensor; "
            "funcs = DTensor._op_dispatcher.sharding_propagator.op_strategy_funcs; "
            "ops = torch.ops.mla_inductor; "
            "print(all(op.default in funcs for op in "
            "(ops.sparse_mla_fwd, ops.sparse_mla_bwd, ops.indexer_target)))")
    for first in ("", "import torch.distributed.tensor; "):
        found = subprocess.run([sys.executable, "-c", first + code], capture_output=True,
                               text=True, check=True)
        assert found.stdout.split() == [str(bool(first)), "True"], (first, found.stdout)
