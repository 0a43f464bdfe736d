"""DTensor inputs through sparse_mla (:mod:`mla_inductor.distributed`): spawned gloo process groups
of 2 and 4 ranks on CPU, every result equal to the single-process one on the full tensors.

One group per world size runs every check (spawning is slow) and writes, per rank, the error of
each check or ``None``; the tests below read them. Checks: each placement of the sharding rules
(forward values out, lse, max_logits and the gradients of q, kv and the sink, with a loss that
reaches lse); redistributions (kv sharded on tokens, q sharded on d_qk); uneven token shards;
(4 ranks) a 2 x 2 mesh sharding tokens and heads at once; a 2-layer DSA model
trained 3 steps under ``parallelize_module`` (tensor parallel over heads) and under
``fully_shard`` (FSDP2), losses equal to one process's; and (2 ranks) ``torch.compile`` with
``fullgraph=True`` on DTensor inputs, forward and backward.
"""

from __future__ import annotations

import datetime
import json
import os
import socket
import subprocess
import sys
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from mla_inductor import indexer_target, sparse_mla

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")

T, H, D_QK, D_V, S, TOPK, BATCH, DIM = 8, 4, 16, 8, 12, 6, 4, 32
PLACEMENTS = ("replicated", "heads", "tokens", "tokens_kv_sharded", "batch", "q_sharded_on_d_qk",
              "tokens_uneven")
CHECKS = (*PLACEMENTS, "tp_training", "fsdp2_training", "indexer_target")


def _inputs(batched: bool):
    """q, kv, indices, topk_length, q_positions, attn_sink (float32, seeded, some empty slots and
    future keys)."""
    g = torch.Generator().manual_seed(0)
    lead = (BATCH,) if batched else ()
    q = torch.randn(*lead, T, H, D_QK, generator=g)
    kv = torch.randn(*lead, S, D_QK, generator=g)
    indices = torch.randint(-1, S, (*lead, T, TOPK), generator=g, dtype=torch.int32)
    topk_length = torch.randint(1, TOPK + 1, (*lead, T), generator=g, dtype=torch.int32)
    q_positions = torch.randint(S // 2, S, (*lead, T), generator=g, dtype=torch.int32)
    return q, kv, indices, topk_length, q_positions, torch.randn(H, generator=g)


def _run(q, kv, indices, topk_length, q_positions, sink):
    """out, lse, max_logits and the gradients of q, kv and the sink for a loss through out and lse."""
    q, kv, sink = (t.detach().requires_grad_() for t in (q, kv, sink))
    out, lse, max_logits = sparse_mla(
        q, kv, indices, d_v=D_V, topk_length=topk_length, causal=True, q_positions=q_positions,
        attn_sink=sink, return_lse=True, return_max_logits=True,
    )
    (out.square().sum() + (0.5 * lse).sum()).backward()
    return out, lse, max_logits, q.grad, kv.grad, sink.grad


def _check_placement(mesh, name: str) -> None:
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
    full = list(_inputs(batched))
    if name == "tokens_uneven":  # T = 7 tokens: shards of 4 and 3 (2, 2, 2, 1 on 4 ranks)
        full = [t if i in (1, 5) else t[:7] for i, t in enumerate(full)]
    if placements[4] is None:
        full[4] = None
    expected = _run(*full)
    shards = [None if t is None else distribute_tensor(t, mesh, [p])
              for t, p in zip(full, placements)]
    got = _run(*shards)
    for what, a, b in zip(("out", "lse", "max_logits", "dq", "dkv", "d_sink"), got, expected):
        torch.testing.assert_close(a.full_tensor(), b, msg=lambda m: f"{name} {what}: {m}")
    for what, grad, placement in (("dq", got[3], placements[0]), ("dkv", got[4], placements[1]),
                                  ("d_sink", got[5], placements[5])):
        assert grad.placements == (placement,), f"{name} {what}: {grad.placements}"


def _check_indexer_target(mesh) -> None:
    """indexer_target with its inputs sharded on tokens, and with q and lse sharded on heads
    (gathered: the target normalises over heads), equal to the single-process target."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    q, kv, indices, topk_length, q_positions, sink = _inputs(False)
    _, lse = sparse_mla(q, kv, indices, d_v=D_V, topk_length=topk_length, causal=True,
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
        torch.testing.assert_close(got.full_tensor(), expected, msg=lambda m: f"{name}: {m}")


def _check_mesh_2d(mesh) -> None:
    """A 2 x 2 mesh, context parallel x tensor parallel: q sharded on tokens and on heads, the
    per-token tensors on tokens, the sink on heads, kv replicated; values and gradients equal to
    the single-process ones."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    R = Replicate()
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("cp", "tp"))
    full = _inputs(batched=False)
    expected = _run(*full)
    placements = ((Shard(0), Shard(1)), (R, R), (Shard(0), R), (Shard(0), R), (Shard(0), R),
                  (R, Shard(0)))
    got = _run(*[distribute_tensor(t, mesh, p) for t, p in zip(full, placements)])
    for what, a, b in zip(("out", "lse", "max_logits", "dq", "dkv", "d_sink"), got, expected):
        torch.testing.assert_close(a.full_tensor(), b, msg=lambda m: f"2-D mesh {what}: {m}")


class Attention(nn.Module):
    """A DSA attention layer: q and the latent kv projected from x, a learnable sink, causal."""

    def __init__(self):
        super().__init__()
        self.wq = nn.Linear(DIM, H * D_QK, bias=False)
        self.wkv = nn.Linear(DIM, D_QK, bias=False)
        self.wo = nn.Linear(H * D_V, DIM, bias=False)
        self.sink = nn.Parameter(torch.randn(H))

    def forward(self, x, indices):  # x [B, T, DIM], indices [B, T, TOPK]
        q = self.wq(x).view(*x.shape[:-1], -1, D_QK)  # -1: the local heads on plain tensors
        out = sparse_mla(q, self.wkv(x), indices, d_v=D_V, causal=True, attn_sink=self.sink)
        return self.wo(out.flatten(-2))


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList([Attention(), Attention()])

    def forward(self, x, indices):
        for layer in self.layers:
            x = x + layer(x, indices)
        return x


def _batch():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(BATCH, T, DIM, generator=g)
    return x, torch.randint(-1, T, (BATCH, T, TOPK), generator=g, dtype=torch.int32)


def _train(model, x, indices, reduce=None) -> torch.Tensor:
    """The float32 losses of 3 SGD steps on ``mean(model(x)^2)``; ``reduce`` turns the local loss
    into the global one."""
    opt = torch.optim.SGD(model.parameters(), lr=0.5, foreach=False)
    losses = []
    for _ in range(3):
        loss = model(x, indices).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append((reduce(loss) if reduce else loss).detach())
    return torch.stack(losses)


def _check_tp_training(mesh) -> None:
    """Tensor parallel over heads: q column-parallel (a DTensor sharded on heads), the latent kv
    and the indices replicated DTensors, the sink sharded with the heads, wo row-parallel."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        PrepareModuleOutput,
        RowwiseParallel,
        parallelize_module,
    )

    x, indices = _batch()
    expected = _train(Model(), x, indices)
    model = parallelize_module(Model(), mesh, {
        "layers.*": PrepareModuleInput(input_layouts=(None, Replicate()),
                                       desired_input_layouts=(None, Replicate()),
                                       use_local_output=False),
        "layers.*.wq": ColwiseParallel(use_local_output=False),
        "layers.*.wkv": PrepareModuleOutput(output_layouts=Replicate(),
                                            desired_output_layouts=Replicate(),
                                            use_local_output=False),
        "layers.*.wo": RowwiseParallel(),
    })
    for layer in model.layers:
        layer.sink = nn.Parameter(distribute_tensor(layer.sink.data, mesh, [Shard(0)]))
    torch.testing.assert_close(_train(model, x, indices), expected)


def _check_fsdp2_training(mesh) -> None:
    """FSDP2 over the whole model, the batch split over the ranks: the op sees plain tensors."""
    from torch.distributed.fsdp import fully_shard

    x, indices = _batch()
    expected = _train(Model(), x, indices)
    model = Model()
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    rank, n = dist.get_rank(), dist.get_world_size()
    local = slice(rank * BATCH // n, (rank + 1) * BATCH // n)

    def mean_over_ranks(loss):
        loss = loss.detach().clone()
        dist.all_reduce(loss, op=dist.ReduceOp.AVG)
        return loss

    torch.testing.assert_close(_train(model, x[local], indices[local], mean_over_ranks), expected)


def _check_compile(mesh) -> None:
    """The context-parallel call (q, indices sharded on tokens, kv all-gathered, causal default
    positions) and the tensor-parallel one (a replicated sink sliced to the heads) under
    torch.compile(fullgraph=True): no graph break, values and gradients equal to the eager
    single-process ones."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    # torch 2.13 keys the AOTAutograd cache of a DTensor graph without the rank, so a rank can load
    # another rank's graph, with that rank's slice of a replicated input baked in (pytorch/pytorch
    # issue 188390): the README's workaround.
    torch._functorch.config.enable_autograd_cache = False

    def f(q, kv, indices, sink):
        out, lse = sparse_mla(q, kv, indices, d_v=D_V, causal=True, attn_sink=sink,
                              return_lse=True)
        return out.detach(), out.square().sum() + lse.sum()

    compiled = torch.compile(f, fullgraph=True)
    q, kv, indices, _, _, sink = _inputs(batched=False)
    leaves = [t.clone().requires_grad_() for t in (q, kv, sink)]
    out, loss = f(leaves[0], leaves[1], indices, leaves[2])
    loss.backward()
    R = Replicate()
    for placements in ((Shard(0), Shard(0), Shard(0), R), (Shard(1), R, R, R)):
        args = [distribute_tensor(t, mesh, [p]) for t, p in zip((q, kv, indices, sink), placements)]
        for i in (0, 1, 3):
            args[i].requires_grad_()
        got, loss_d = compiled(*args)
        loss_d.backward()
        torch.testing.assert_close(got.full_tensor(), out)
        for a, ref in zip((args[0], args[1], args[3]), leaves):
            torch.testing.assert_close(a.grad.full_tensor(), ref.grad)


def _worker(rank: int, world_size: int, port: int, folder: str, checks: tuple) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=120))
    mesh = init_device_mesh("cpu", (world_size,))
    results = {}
    for name in checks:
        try:
            if name in PLACEMENTS:
                _check_placement(mesh, name)
            else:
                globals()[f"_check_{name}"](mesh)
            results[name] = None
        except Exception:  # recorded for the test of that check
            results[name] = traceback.format_exc()
    with open(os.path.join(folder, f"rank{rank}.json"), "w") as f:
        json.dump(results, f)
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawn(world_size: int, folder, checks: tuple) -> list[dict]:
    mp.spawn(_worker, args=(world_size, _free_port(), str(folder), checks), nprocs=world_size)
    return [json.loads((folder / f"rank{r}.json").read_text()) for r in range(world_size)]


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    return _spawn(2, tmp_path_factory.mktemp("two"), (*CHECKS, "compile"))


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory):
    return _spawn(4, tmp_path_factory.mktemp("four"), (*CHECKS, "mesh_2d"))


def _assert_passed(results: list[dict], name: str) -> None:
    failed = {rank: r[name] for rank, r in enumerate(results) if r[name] is not None}
    assert not failed, "\n".join(f"rank {rank}:\n{err}" for rank, err in failed.items())


@pytest.mark.parametrize("name", (*CHECKS, "compile"))
def test_two_ranks(two_ranks, name):
    _assert_passed(two_ranks, name)


@pytest.mark.parametrize("name", (*CHECKS, "mesh_2d"))
def test_four_ranks(four_ranks, name):
    _assert_passed(four_ranks, name)


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
