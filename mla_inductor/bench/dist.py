"""dist: one DSA attention layer over several ranks with DTensor: tensor and context parallel.

One causal ``sparse_mla`` layer at DeepSeek-V3.2's sizes (H 128, d_qk 576, d_v 512, topk 2048,
S = T: ``q [T, H, d_qk]`` and the latent ``kv [T, d_qk]`` requiring grad, causal top-k indices
``[T, topk]`` int32 (:func:`mla_inductor.bench.problems.make_indices`, pattern ``causal``), a
random ``dout [T, H, d_v]``; bf16 on CUDA), forward ``sparse_mla(q, kv, indices, d_v=d_v,
causal=True)`` and ``out.backward(dout)``, in three modes per T:

- ``single``: rank 0 alone on plain tensors (the other ranks wait): the one-GPU reference;
- ``tp`` (tensor parallel over heads): q and dout ``Shard(1)`` on a 1-D mesh of every rank, kv
  and indices ``Replicate``; the op's heads rule runs with no forward collective and dkv
  (``Partial``) is all-reduced back to kv's ``Replicate``;
- ``cp`` (context parallel over tokens): q, indices and dout ``Shard(0)``, kv ``Shard(0)``; the
  op's tokens rule all-gathers the latent kv (in the forward and again in the backward, which
  gets kv as the forward got it) and reduce-scatters dkv back to ``Shard(0)``.

The sharded modes are plain DTensor inputs to the public op: every collective is DTensor's
redistribution under :mod:`mla_inductor.distributed`'s rules, none is written here.

Columns: ``ms``, the slowest rank's median of ``--iters`` steps (forward + backward) after
``--warmup`` untimed ones, each step started after a barrier across the ranks (CUDA events on
CUDA, ``time.perf_counter`` on the CPU; :func:`mla_inductor.bench.timing.time_ms_calls`);
``peak GiB/rank``, ``torch.cuda.max_memory_allocated`` over those steps on the rank that used
the most (the mode's inputs, outputs, gradients and temporaries: the full tensors the shards
are cut from are freed before; ``-`` on the CPU); ``collectives/step``, the count of each
collective in one more step, from ``torch.distributed.tensor.debug.CommDebugMode``;
``collective bytes/step``, the size of each of those collectives' full tensor, summed (the
all-gather's output, the reduce-scatter's input, the all-reduce's tensor: ``nccl-tests``'
"size"; CommDebugMode counts calls only, so :func:`count_collectives` reads the sizes of the
tensors each collective takes and returns; a ring moves ``(n - 1) / n`` of the size per rank for an
all-gather or a reduce-scatter, ``2 (n - 1) / n`` for an all-reduce); ``speedup vs single``,
single's ms over the mode's; ``rel-L2 vs single``, the largest ``||x - ref|| / ||ref||`` of out,
dq and dkv of that step gathered to full tensors (``DTensor.full_tensor``) against single's.

``--train STEPS`` prints another table instead: a small DSA model (``Config.dim`` wide, two
layers of this layer's heads and widths) trained ``STEPS`` SGD steps at each T (default 4096,
with ``--tiny`` 64) in the same three modes, each step's loss and the largest relative difference
from single's (:mod:`mla_inductor.bench.dist_train`).

Launch: the command spawns ``--ranks`` processes itself (:func:`mla_inductor.bench.ranks.spawn`:
a free local port, NCCL and one GPU per rank on CUDA, gloo on the CPU) and prints the table from
rank 0's results; it is not meant to run under ``torchrun`` and says so. ``--tiny``: H 8, d_qk
80, d_v 64, topk 16, T 64 128, float32, with ``--train`` a model of width 32 (on the CPU by
default: a smoke run in seconds, ``tests/tools/test_bench.py`` runs both on 2 ranks).
"""

from __future__ import annotations

import argparse
import datetime
import math
import os
from typing import NamedTuple, Optional

import torch
import torch.distributed as dist

from ..api import sparse_mla
from .dist_train import MODES, Widths, train_dist
from .problems import D_QK, D_V, make_indices, require_sm90
from .ranks import device_name, spawn
from .timing import time_ms_calls


class Config(NamedTuple):
    """The layer's widths and element type (``dtype`` a ``torch`` dtype's name), and the width
    ``dim`` of ``--train``'s model."""

    H: int
    d_qk: int
    d_v: int
    topk: int
    dtype: str
    dim: int


REAL = Config(H=128, d_qk=D_QK, d_v=D_V, topk=2048, dtype="bfloat16", dim=256)
TINY = Config(H=8, d_qk=80, d_v=64, topk=16, dtype="float32", dim=32)


def make_problem(cfg: Config, T: int, device: torch.device) -> dict:
    """The full (unsharded) inputs at ``T`` tokens, seeded by ``T`` (the same on every rank):
    ``q [T, H, d_qk]``, ``kv [T, d_qk]`` and ``dout [T, H, d_v]`` ``N(0, 1)`` in ``cfg.dtype``,
    ``indices [T, topk]`` int32 (the causal pattern, S = T)."""
    gen = torch.Generator(device=device).manual_seed(T)
    dtype = getattr(torch, cfg.dtype)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, device=device, dtype=dtype)

    return dict(q=randn(T, cfg.H, cfg.d_qk), kv=randn(T, cfg.d_qk),
                indices=make_indices(T, T, cfg.topk, "causal", gen), dout=randn(T, cfg.H, cfg.d_v))


def placements(mode: str) -> dict:
    """Each input's DTensor placement on the 1-D mesh in the sharded ``mode`` (``tp`` or ``cp``)."""
    from torch.distributed.tensor import Replicate, Shard

    if mode == "tp":
        return dict(q=Shard(1), kv=Replicate(), indices=Replicate(), dout=Shard(1))
    return dict(q=Shard(0), kv=Shard(0), indices=Shard(0), dout=Shard(0))


def _shard(full: torch.Tensor, mesh, placement):
    """``full`` as a DTensor with ``placement``, cut locally (every rank holds the same ``full``:
    no scatter), its local shard a copy so that ``full`` can be freed."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    dt = distribute_tensor(full, mesh, [placement], src_data_rank=None)
    return DTensor.from_local(dt.to_local().clone(), mesh, [placement], run_check=False,
                              shape=dt.shape, stride=dt.stride())


def count_collectives():
    """A context manager (a new instance each call) that counts the collectives run inside it
    and their bytes: DTensor's ``CommDebugMode`` (``get_comm_counts()``: calls per collective),
    subclassed to add up, in ``nbytes``, each collective's full-tensor size: the larger of the
    bytes of the tensors it takes and of those it returns (an all-gather's output, a
    reduce-scatter's input, an all-reduce's tensor). The class is made at the call, so that
    importing this module does not import DTensor."""
    from torch.distributed.tensor.debug import CommDebugMode

    class CommBytes(CommDebugMode):
        def __init__(self):
            super().__init__()
            self.nbytes = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            before = self.get_total_counts()
            out = super().__torch_dispatch__(func, types, args, kwargs)
            if self.get_total_counts() > before:
                self.nbytes += max(_tensor_bytes((args, kwargs)), _tensor_bytes(out))
            return out

    return CommBytes()


def _tensor_bytes(tree) -> int:
    leaves, _ = torch.utils._pytree.tree_flatten(tree)
    return sum(t.numel() * t.element_size() for t in leaves if isinstance(t, torch.Tensor))


def _rel_l2(x: torch.Tensor, ref: torch.Tensor) -> float:
    """``||x - ref|| / ||ref||`` in float64 over all elements, ``x`` on its device, ``ref`` (same
    shape, any device) brought there a chunk of rows at a time: at T 65536 a float64 copy of the
    whole of ``out`` would be 34 GiB."""
    rows = max(1, 2**26 // max(1, x[0].numel()))
    num = den = 0.0
    for xs, rs in zip(x.split(rows), ref.split(rows)):
        rs = rs.to(x.device, torch.float64)
        num += (xs.double() - rs).square().sum().item()
        den += rs.square().sum().item()
    return math.sqrt(num / den)


def _measure(tensors: dict, cfg: Config, device: torch.device, warmup: int, iters: int,
             before) -> dict:
    """Times the step on ``tensors`` (plain or DTensor), then runs one more step under
    :func:`count_collectives`. Returns ``ms``, ``peak_gib`` (None off CUDA), ``counts``
    ({collective name: calls}), ``nbytes`` and ``results`` (out, dq, dkv of the last step)."""
    q, kv = tensors["q"].requires_grad_(), tensors["kv"].requires_grad_()

    def step():
        q.grad = kv.grad = None
        out = sparse_mla(q, kv, tensors["indices"], d_v=cfg.d_v, causal=True)
        out.backward(tensors["dout"])
        return out

    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    ms = time_ms_calls(step, warmup, iters, device, before=before)
    peak = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None
    with count_collectives() as comm:
        out = step()
    counts = {str(op).rsplit(".", 1)[-1]: n for op, n in comm.get_comm_counts().items()}
    return dict(ms=ms, peak_gib=peak, counts=counts, nbytes=comm.nbytes,
                results=(out.detach(), q.grad, kv.grad))


def _bench_T(cfg: Config, T: int, mesh, device: torch.device, warmup: int, iters: int) -> list:
    """The rows of one T (rank 0's list; the other ranks' is empty): single, then tp and cp."""
    rank = dist.get_rank()
    rows, reference = [], None
    for mode in MODES:
        if mode == "single":
            if rank == 0:
                m = _measure(make_problem(cfg, T, device), cfg, device, warmup, iters, before=None)
                reference = [t.cpu() for t in m.pop("results")]  # out, dq, dkv; off the GPU
                rows.append(dict(T=T, mode=mode, **m, rel_l2=None))
            dist.barrier()
            continue
        full = make_problem(cfg, T, device)
        tensors = {name: _shard(full[name], mesh, p) for name, p in placements(mode).items()}
        del full
        if device.type == "cuda":
            torch.cuda.empty_cache()
        m = _measure(tensors, cfg, device, warmup, iters, before=dist.barrier)
        results = m.pop("results")
        errors = []
        for got, ref in zip(results, reference or (None,) * 3):
            got = got.full_tensor()
            if rank == 0:
                errors.append(_rel_l2(got, ref))
            del got
        del results, tensors
        per_rank = [None] * dist.get_world_size()
        dist.all_gather_object(per_rank, (m["ms"], m["peak_gib"]))
        m["ms"] = max(ms for ms, _ in per_rank)
        if device.type == "cuda":
            m["peak_gib"] = max(p for _, p in per_rank)
            torch.cuda.empty_cache()
        rows.append(dict(T=T, mode=mode, **m, rel_l2=max(errors) if errors else None))
    return rows if rank == 0 else []


def _bench_ranks(mesh, device: torch.device, cfg: Config, Ts: list, warmup: int,
                 iters: int) -> Optional[dict]:
    """One rank's part (:func:`mla_inductor.bench.ranks.spawn` runs it on every rank): every T;
    rank 0 returns ``{"device": ..., "rows": [...]}``, the others None."""
    rows = [row for T in Ts for row in _bench_T(cfg, T, mesh, device, warmup, iters)]
    return dict(device=device_name(device), rows=rows) if dist.get_rank() == 0 else None


def bench_dist(Ts, ranks: int, cfg: Config, device_type: str, warmup: int = 2,
               iters: int = 5) -> list:
    """Spawns ``ranks`` processes, prints the table (module docstring) for token counts ``Ts``
    and returns its rows: dicts with ``T``, ``mode``, ``ms``, ``peak_gib``, ``counts``,
    ``nbytes`` and ``rel_l2`` (None for single)."""
    found = spawn(_bench_ranks, ranks, device_type, (cfg, list(Ts), warmup, iters))[0]
    backend = "NCCL" if device_type == "cuda" else "gloo"
    print(f"# One DSA attention layer (sparse_mla, causal), forward + backward, DTensor over "
          f"{ranks} ranks ({backend}), {datetime.date.today()}, {found['device']}, torch "
          f"{torch.__version__}, H {cfg.H}, d_qk {cfg.d_qk}, d_v {cfg.d_v}, topk {cfg.topk}, "
          f"S = T, {cfg.dtype}; ms: the slowest rank's median of {iters} steps after {warmup}, "
          f"each after a barrier; peak: max_memory_allocated on the busiest rank; collective "
          f"bytes: each collective's full-tensor size, summed")
    print("| T | mode | ms | peak GiB/rank | collectives/step | collective bytes/step | "
          "speedup vs single | rel-L2 vs single |")
    print("|---|---|---|---|---|---|---|---|")
    single = {}
    for row in found["rows"]:
        if row["mode"] == "single":
            single[row["T"]] = row["ms"]
        peak = "-" if row["peak_gib"] is None else f"{row['peak_gib']:.2f}"
        counts = ", ".join(f"{name} x{n}" for name, n in sorted(row["counts"].items())) or "none"
        speedup = "" if row["mode"] == "single" else f"{single[row['T']] / row['ms']:.2f}x"
        err = "" if row["rel_l2"] is None else f"{row['rel_l2']:.1e}"
        print(f"| {row['T']} | {row['mode']} | {row['ms']:.1f} | {peak} | {counts} | "
              f"{row['nbytes']:,} | {speedup} | {err} |", flush=True)
    return found["rows"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``dist`` subcommand's flags: ``--ranks``, ``--T``, ``--topk``, ``--device``,
    ``--warmup``, ``--iters``, ``--tiny``, ``--train``, ``--lr``."""
    parser.add_argument("--ranks", type=int, default=2,
                        help="processes to spawn (one GPU each on CUDA); default: 2")
    parser.add_argument("--T", type=int, nargs="+", default=None,
                        help="token counts T (S = T); default: 16384 65536 (with --tiny: 64 "
                             "128); with --train: 4096 (with --tiny: 64)")
    parser.add_argument("--topk", type=int, default=None,
                        help="slots per token; default: 2048 (with --tiny: 16)")
    parser.add_argument("--device", choices=("cuda", "cpu"), default=None,
                        help="cuda (NCCL) or cpu (gloo); default: cuda (with --tiny: cpu)")
    parser.add_argument("--warmup", type=int, default=2,
                        help="untimed steps per T and mode (the first compiles the kernels); "
                             "default: 2")
    parser.add_argument("--iters", type=int, default=5,
                        help="timed steps per T and mode, the median reported; default: 5")
    parser.add_argument("--tiny", action="store_true",
                        help="H 8, d_qk 80, d_v 64, topk 16, float32: a smoke run in seconds")
    parser.add_argument("--train", type=int, default=None, metavar="STEPS",
                        help="train a 2-layer DSA model STEPS SGD steps per T in each mode and "
                             "print the losses instead of the layer table")
    parser.add_argument("--lr", type=float, default=0.5,
                        help="the SGD learning rate of --train; default: 0.5")


def run(args: argparse.Namespace) -> list:
    """Runs the subcommand for parsed flags (:func:`add_arguments`); returns the table's rows, or
    with ``--train`` a ``{mode: [loss per step]}`` per T. Exits with a message under ``torchrun``
    (this command spawns its own ranks), for fewer than one rank or ``--train`` steps, and on
    CUDA when the sm90 kernels cannot run here (unless ``--tiny``) or there are fewer GPUs than
    ranks."""
    if "TORCHELASTIC_RUN_ID" in os.environ:
        raise SystemExit("mla_inductor: bench dist spawns its own ranks (--ranks); run it with "
                         "python -m, not under torchrun")
    if args.ranks < 1:
        raise SystemExit(f"mla_inductor: bench dist needs --ranks >= 1, got {args.ranks}")
    if args.train is not None and args.train < 1:
        raise SystemExit(f"mla_inductor: bench dist needs --train >= 1, got {args.train}")
    device_type = args.device or ("cpu" if args.tiny else "cuda")
    if device_type == "cuda":
        if not args.tiny:
            require_sm90("kernels", tiny=True)
        if torch.cuda.device_count() < args.ranks:
            raise SystemExit(f"mla_inductor: bench dist --ranks {args.ranks} needs as many GPUs, "
                             f"found {torch.cuda.device_count()}")
    cfg = TINY if args.tiny else REAL
    if args.topk is not None:
        cfg = cfg._replace(topk=args.topk)
    if args.train is not None:
        widths = Widths(dim=cfg.dim, heads=cfg.H, d_qk=cfg.d_qk, d_v=cfg.d_v, dtype=cfg.dtype)
        return [train_dist(widths, T, cfg.topk, args.train, args.ranks, device_type, args.lr)
                for T in args.T or ([64] if args.tiny else [4096])]
    return bench_dist(args.T or ([64, 128] if args.tiny else [16384, 65536]), args.ranks, cfg,
                      device_type, warmup=args.warmup, iters=args.iters)
