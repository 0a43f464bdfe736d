"""train: one layer's forward + backward, and a compiled training step of the demo model.

Two measurements, each with the SM90 kernels (backend ``sm90``) next to the PyTorch reference
backend (``reference``) in the same run:

1. **One layer, forward + backward**: ``sparse_mla(q, kv, indices)`` with q and kv requiring
   grad (so the forward is a training forward: threshold 0.0 and o_lo), then ``out.backward(dout)``,
   eager and under ``torch.compile(fullgraph=True)``. TFLOPS = 2·T·H·topk·(4·d_qk + 3·d_v) / time,
   the forward's ``d_qk + d_v`` plus the backward's ``3·d_qk + 2·d_v``; time = median of
   ``triton.testing.do_bench`` (CUDA events). Same index patterns as ``bench fwd``.
2. **A compiled training step of the demo model** (:mod:`mla_inductor.demo`'s ``ByteLM``, at a
   larger size than the demo's default: AdamW step, forward, backward, fullgraph compile): ms per
   step and tokens per second, median of timed steps after warm-up steps that compile.
"""

from __future__ import annotations

import argparse
import datetime
import time

import torch
import torch.nn.functional as F

from .. import backends, demo
from ..api import sparse_mla
from .problems import (D_QK, D_V, KV_LENGTHS, PATTERNS, add_shape_arguments, make_indices,
                       require_sm90)
from .timing import time_ms


def layer_flops(T: int, H: int, topk: int, d_qk: int = D_QK, d_v: int = D_V) -> int:
    """FLOPs of one forward + backward (the forward's and the backward's conventions summed)."""
    return 2 * T * H * topk * (4 * d_qk + 3 * d_v)


def bench_layer(Ts, Hs, topk, patterns=PATTERNS, kv_per_token=2):
    """Prints the one-layer forward + backward table (module docstring) for token counts ``Ts``
    (S = ``kv_per_token`` x T), head counts ``Hs``, d_qk 576 / d_v 512, bf16. Needs a CUDA device where the sm90
    kernels run (:func:`mla_inductor.bench.problems.require_sm90`)."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    print(f"# sparse-MLA layer forward + backward, {datetime.date.today()}, "
          f"{torch.cuda.get_device_name()}, torch {torch.__version__}, d_qk {D_QK}, d_v {D_V}, "
          f"topk {topk}, S = {kv_per_token}T, bf16; TFLOPS = 2·T·H·topk·(4·d_qk + 3·d_v) / time")
    print("| T | H | indices | backend | mode | ms | TFLOPS |")
    print("|---|---|---|---|---|---|---|")
    for T in Ts:
        S = kv_per_token * T
        kv = torch.randn(S, D_QK, device="cuda", generator=gen).bfloat16().requires_grad_()
        for H in Hs:
            q = torch.randn(T, H, D_QK, device="cuda", generator=gen).bfloat16().requires_grad_()
            dout = torch.randn(T, H, D_V, device="cuda", generator=gen).bfloat16()

            def step(attn):
                attn(q, kv, indices).backward(dout)

            def attn(q_, kv_, idx):
                return sparse_mla(q_, kv_, idx, d_v=D_V)

            compiled = torch.compile(attn, fullgraph=True)
            for pattern in patterns:
                indices = make_indices(T, S, topk, pattern, gen)
                rows = [("sm90", "eager", attn), ("sm90", "compiled", compiled)]
                if T == min(Ts):
                    rows.append(("reference", "eager", attn))
                for backend, mode, fn in rows:
                    with backends.use_backend(backend):
                        ms = time_ms(lambda: step(fn), grad_to_none=(q, kv))
                    print(f"| {T} | {H} | {pattern} | {backend} | {mode} | {ms:.3f} | "
                          f"{layer_flops(T, H, topk) / ms / 1e9:.0f} |", flush=True)
            del q, dout
        del kv


def bench_model(cfg: demo.Config, warmup: int = 3, steps: int = 10):
    """Prints ms per compiled training step (median of ``steps`` after ``warmup`` steps) of the demo
    model configured by ``cfg`` for the sm90 and reference backends (the same seed and batches for
    both). Needs a CUDA device where the sm90 kernels run."""
    cfg = cfg.resolved()
    dtype = getattr(torch, cfg.dtype)
    data = demo.load_corpus()
    print(f"# demo model training step (fullgraph compile, AdamW), {cfg.layers} layers, d_model "
          f"{cfg.d_model}, {cfg.heads} heads, d_qk {cfg.d_latent + cfg.d_rope}, d_v "
          f"{cfg.d_latent}, topk {cfg.topk}, batch {cfg.batch} x seq_len {cfg.seq_len}, {cfg.dtype}")
    print("| backend | ms / step | tokens / s | loss after the timed steps |")
    print("|---|---|---|---|")
    for backend in ("sm90", "reference"):
        torch._dynamo.reset()
        torch.manual_seed(cfg.seed)
        g = torch.Generator().manual_seed(cfg.seed)
        model = demo.ByteLM(cfg, dtype).to(cfg.device)
        compiled = torch.compile(model, fullgraph=True)
        opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
        times = []
        with backends.use_backend(backend):
            for i in range(warmup + steps):
                starts = torch.randint(0, len(data) - cfg.seq_len - 1, (cfg.batch,), generator=g)
                x, y = demo.batch_at(data, starts, cfg.seq_len, torch.device(cfg.device))
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                loss = F.cross_entropy(compiled(x).reshape(-1, demo.VOCAB), y.reshape(-1))
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                torch.cuda.synchronize()
                if i >= warmup:
                    times.append(time.perf_counter() - t0)
        ms = sorted(times)[len(times) // 2] * 1e3
        print(f"| {backend} | {ms:.1f} | {cfg.batch * cfg.seq_len / ms * 1e3:,.0f} | "
              f"{loss.item():.3f} |", flush=True)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``train`` subcommand's flags: the shapes, ``--skip-layer`` and ``--skip-model``."""
    add_shape_arguments(parser)
    parser.add_argument("--skip-layer", action="store_true", help="skip the one-layer table")
    parser.add_argument("--skip-model", action="store_true",
                        help="skip the demo-model training step")


def run(args: argparse.Namespace) -> None:
    """Runs the subcommand for parsed flags (:func:`add_arguments`). Exits with a message when
    the sm90 kernels cannot run here."""
    require_sm90("kernels")
    if not args.skip_layer:
        bench_layer(args.T, args.H, args.topk, patterns=args.indices,
                    kv_per_token=KV_LENGTHS[args.S])
    if not args.skip_model:
        bench_model(demo.Config(batch=4, seq_len=2048, d_model=1024, heads=64, layers=2,
                                topk=512, d_index=64))
