"""dist --train: a short training run of a small DSA model on one process, tensor parallel over
heads and context parallel over tokens, the losses compared step by step.

The model (:class:`Model`): ``layers`` residual DSA attention layers (:class:`Attention`), each
``x + wo(sparse_mla(wq(x), wkv(x), indices, causal=True, attn_sink=sink))``: bias-free linears
``wq [dim -> H * d_qk]`` (q ``[..., T, H, d_qk]``), ``wkv [dim -> d_qk]`` (the latent kv
``[..., T, d_qk]``, one kv head: MLA's absorbed form), ``wo [H * d_v -> dim]``, a learnable sink
``[H]``; parameters float32, seeded (every rank builds the same); q and kv cast to
``Widths.dtype`` for the op (bf16 for the GPU kernels) and its output back to float32. The
objective is ``mean(model(x)^2)``, trained by plain SGD. ``tests/distributed/test_distributed.py`` trains the
same model under tensor parallelism and FSDP2.

Three modes on the same batches (``x [T, dim]`` float32 ``N(0, 1)`` and ``indices [T, topk]``
int32, the causal pattern of :func:`mla_inductor.bench.problems.make_indices` with S = T, drawn
per step from a generator seeded by the step):

- ``single``: rank 0 alone, plain tensors (the other ranks wait): the one-GPU reference;
- ``tp``: :func:`parallelize_heads`, ``parallelize_module`` over heads (wq column-parallel: q a
  DTensor sharded on heads; wkv's output, the latent kv, and the indices replicated; wo
  row-parallel; the sinks sharded with the heads): the op's heads rule, dkv all-reduced;
- ``cp``: :func:`replicate` (every parameter a replicated DTensor), x and the indices
  ``Shard(0)`` on tokens: the op's tokens rule all-gathers the latent kv, dkv is
  reduce-scattered, and the parameters' gradients (``Partial``) are all-reduced by the
  optimizer's in-place update.

No collective is written here: all are DTensor's. Printed: each step's loss per mode and the
largest ``|loss - single's| / single's`` over the steps per mode. On CUDA with the kernels the
sharded modes are not bitwise one GPU's: dkv's fp32 atomics sum in another order, each rank
rounds its partial dkv to bf16 before the collective sums them, and the linears' split matmuls
round differently.
"""

from __future__ import annotations

import datetime
from typing import Callable, NamedTuple, Optional

import torch
import torch.distributed as dist
from torch import nn

from ..api import sparse_mla
from .problems import make_indices
from .ranks import device_name, spawn

MODES = ("single", "tp", "cp")


class Widths(NamedTuple):
    """The model's sizes and the attention's element type (a ``torch`` dtype's name)."""

    dim: int
    heads: int
    d_qk: int
    d_v: int
    dtype: str
    layers: int = 2


class Attention(nn.Module):
    """A DSA attention layer: ``x [..., T, dim]`` float32 and ``indices [..., T, topk]`` int32
    (key positions in the same sequence, -1 empty) -> ``[..., T, dim]`` float32 (module
    docstring)."""

    def __init__(self, w: Widths):
        super().__init__()
        self.d_qk, self.d_v, self.dtype = w.d_qk, w.d_v, getattr(torch, w.dtype)
        self.wq = nn.Linear(w.dim, w.heads * w.d_qk, bias=False)
        self.wkv = nn.Linear(w.dim, w.d_qk, bias=False)
        self.wo = nn.Linear(w.heads * w.d_v, w.dim, bias=False)
        self.sink = nn.Parameter(torch.randn(w.heads))

    def forward(self, x, indices):
        # -1: the local heads on plain tensors, the global ones on a DTensor
        q = self.wq(x).view(*x.shape[:-1], -1, self.d_qk).to(self.dtype)
        out = sparse_mla(q, self.wkv(x).to(self.dtype), indices, d_v=self.d_v, causal=True,
                         attn_sink=self.sink)
        return self.wo(out.flatten(-2).to(x.dtype))


class Model(nn.Module):
    """``w.layers`` residual :class:`Attention` layers, built after ``torch.manual_seed(0)``."""

    def __init__(self, w: Widths):
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList([Attention(w) for _ in range(w.layers)])

    def forward(self, x, indices):
        for layer in self.layers:
            x = x + layer(x, indices)
        return x


def parallelize_heads(model: Model, mesh) -> Model:
    """Tensor parallel over heads on the 1-D ``mesh`` (the recipe of docs/integrations.md): wq
    column-parallel (q a DTensor sharded on heads), the latent kv and the indices replicated
    DTensors, wo row-parallel (its output a plain tensor, the sum over the ranks), each sink
    sharded with the heads. Returns ``model``, changed in place."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        PrepareModuleOutput,
        RowwiseParallel,
        parallelize_module,
    )

    parallelize_module(model, mesh, {
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
    return model


def replicate(model: Model, mesh) -> Model:
    """Every parameter a replicated DTensor on ``mesh`` (``distribute_module``), for inputs
    sharded on tokens (context parallel). Returns ``model``, changed in place."""
    from torch.distributed.tensor import distribute_module

    return distribute_module(model, mesh)


def train(model: nn.Module, batches, lr: float,
          reduce: Optional[Callable] = None) -> torch.Tensor:
    """One SGD step (``foreach=False``, learning rate ``lr``) on ``mean(model(x, indices)^2)``
    per ``(x, indices)`` of ``batches``; returns the steps' losses ``[len(batches)]`` float32,
    each taken before its step. ``reduce`` turns the loss a rank holds into the global one (e.g.
    ``DTensor.full_tensor``)."""
    opt = torch.optim.SGD(model.parameters(), lr=lr, foreach=False)
    losses = []
    for x, indices in batches:
        loss = model(x, indices).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append((reduce(loss) if reduce else loss).detach())
    return torch.stack(losses)


def make_batches(dim: int, T: int, topk: int, steps: int, device: torch.device) -> list:
    """``steps`` pairs ``(x [T, dim] float32 N(0, 1), indices [T, topk] int32)`` on ``device``,
    step ``i`` drawn from a generator seeded by ``i`` (the same on every rank); the indices are
    :func:`make_indices`' causal pattern with S = T (token t's own key in slot 0, -1 past it)."""
    found = []
    for step in range(steps):
        gen = torch.Generator(device=device).manual_seed(step)
        x = torch.randn(T, dim, generator=gen, device=device)
        found.append((x, make_indices(T, T, topk, "causal", gen)))
    return found


def _train_ranks(mesh, device: torch.device, w: Widths, T: int, topk: int, steps: int,
                 lr: float) -> Optional[dict]:
    """One rank's part (:func:`spawn` runs it on every rank): the three modes in turn; rank 0
    returns ``{"device": ..., "losses": {mode: [loss per step]}}``, the others None."""
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    rank = dist.get_rank()
    batches = make_batches(w.dim, T, topk, steps, device)
    losses = {}
    if rank == 0:
        losses["single"] = train(Model(w).to(device), batches, lr).tolist()
    dist.barrier()
    losses["tp"] = train(parallelize_heads(Model(w).to(device), mesh), batches, lr).tolist()
    sharded = [tuple(distribute_tensor(t, mesh, [Shard(0)]) for t in batch) for batch in batches]
    losses["cp"] = train(replicate(Model(w).to(device), mesh), sharded, lr,
                         reduce=DTensor.full_tensor).tolist()
    return dict(device=device_name(device), losses=losses) if rank == 0 else None


def train_dist(w: Widths, T: int, topk: int, steps: int, ranks: int, device_type: str,
               lr: float) -> dict:
    """Spawns ``ranks`` processes, trains :class:`Model` ``steps`` steps in each mode (module
    docstring), prints the per-step losses and the largest relative difference from single's,
    and returns ``{mode: [loss per step]}``."""
    found = spawn(_train_ranks, ranks, device_type, (w, T, topk, steps, lr))[0]
    losses = found["losses"]
    backend = "NCCL" if device_type == "cuda" else "gloo"
    print(f"# A {w.layers}-layer DSA model (dim {w.dim}, H {w.heads}, d_qk {w.d_qk}, d_v {w.d_v}, "
          f"topk {topk}, T {T}; attention in {w.dtype}, parameters float32), {steps} SGD steps "
          f"(lr {lr:g}) on mean(model(x)^2), the same batches in every mode: one process vs "
          f"tensor parallel (heads) vs context parallel (tokens) over {ranks} ranks ({backend}), "
          f"{datetime.date.today()}, {found['device']}, torch {torch.__version__}")
    print("| step | " + " | ".join(MODES) + " |")
    print("|---" * (len(MODES) + 1) + "|")
    for step in range(steps):
        print(f"| {step + 1} | " + " | ".join(f"{losses[m][step]:.7g}" for m in MODES) + " |")
    single = losses["single"]
    worst = {m: max(abs(a - b) / abs(b) for a, b in zip(losses[m], single)) for m in MODES[1:]}
    print("largest |loss - single| / single over the steps: "
          + ", ".join(f"{m} {worst[m]:.1e}" for m in MODES[1:]), flush=True)
    return losses
