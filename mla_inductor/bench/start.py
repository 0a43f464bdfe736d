"""start: seconds from ``import mla_inductor`` to a first training step's end, fresh processes.

Every run is a new Python interpreter (``subprocess``) timing, in order: CUDA start-up (``import
torch`` and a first tensor on the device), ``import mla_inductor``, the inputs (q and kv as
parameters, the indices), a ``torch.optim.SGD`` over them (constructing a torch optimizer
imports ``torch._dynamo``: 1.1-1.4 s on a 2-core CPU machine, 3.6-5.7 s on an H200 host, in any
training program), then the first training step: ``sparse_mla(q, kv, indices)`` (a training
forward), ``backward`` and ``optimizer.step()``, synchronised. Three runs share one new kernel
cache folder (``MLA_INDUCTOR_KERNEL_CACHE``, a temporary folder, removed afterwards): **cold**
(the cache is empty: the step compiles the training forward and the backward), then **warm**
twice (the kernels come from the cache as shared libraries, without importing the CuTe DSL:
:mod:`mla_inductor.kernels.cache`).

"after CUDA" = import + inputs + optimizer + first step; "ours" = import + first step, what this
package adds to a training program's start. Sizes: d_qk 576, d_v 512, topk 2048, S = 2T, bf16
on the SM90 kernels; ``--tiny``: T 64, H 16, topk 32, float32 on the CPU with the reference
backend (a smoke test of this command; no kernels, no cache).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile

from .problems import D_QK, D_V, require_sm90

# One fresh process: prints a JSON object of its timings (seconds) and what it imported.
CHILD = """
import json, sys, time
t0 = time.perf_counter()
import torch
device = torch.device({device!r})
torch.zeros(1, device=device)
if device.type == "cuda":
    torch.cuda.synchronize()
t1 = time.perf_counter()
import mla_inductor
t2 = time.perf_counter()
T, H, topk, dtype = {T}, {H}, {topk}, getattr(torch, {dtype!r})
g = torch.Generator(device=device).manual_seed(0)
q = torch.nn.Parameter(torch.randn(T, H, {d_qk}, device=device, generator=g).to(dtype))
kv = torch.nn.Parameter(torch.randn(2 * T, {d_qk}, device=device, generator=g).to(dtype))
indices = torch.randint(0, 2 * T, (T, topk), device=device, generator=g, dtype=torch.int32)
if device.type == "cuda":
    torch.cuda.synchronize()
t_inputs = time.perf_counter()
dynamo_before = "torch._dynamo" in sys.modules
optimizer = torch.optim.SGD([q, kv], lr=1e-3)
t3 = time.perf_counter()
dynamo = "torch._dynamo" in sys.modules and not dynamo_before
out = mla_inductor.sparse_mla(q, kv, indices, d_v={d_v})
out.float().square().mean().backward()
optimizer.step()
if device.type == "cuda":
    torch.cuda.synchronize()
t4 = time.perf_counter()
print(json.dumps({{"cuda": t1 - t0, "import": t2 - t1, "inputs": t_inputs - t2,
                  "optimizer": t3 - t_inputs, "step": t4 - t3, "dynamo_in_optimizer": dynamo,
                  "cute_dsl": any(m.split(".")[0] == "cutlass" for m in sys.modules)}}))
"""

RUNS = ("cold", "warm", "warm again")


def child_code(T: int, H: int, topk: int, tiny: bool) -> str:
    """The fresh process's program (see :data:`CHILD`) for these sizes."""
    return CHILD.format(device="cpu" if tiny else "cuda", dtype="float32" if tiny else "bfloat16",
                        T=T, H=H, topk=topk, d_qk=D_QK, d_v=D_V)


def run_fresh(code: str, env: dict) -> dict:
    """Runs ``code`` in a new interpreter with ``env``; returns its JSON line as a dict.

    Raises:
        RuntimeError: the process failed (its output in the message).
    """
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          timeout=900)
    if done.returncode != 0:
        raise RuntimeError(f"bench start: a fresh process failed:\n{done.stdout}{done.stderr}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def bench_start(T: int, H: int, topk: int, tiny: bool = False) -> None:
    """Prints the table of the module docstring (seconds): one row per run of :data:`RUNS`, a
    ``T``-token, ``H``-head layer with ``topk`` slots (S = 2T), bf16 on the SM90 kernels or, with
    ``tiny``, float32 on the CPU with the reference backend.

    Raises:
        SystemExit: without ``tiny``, when the SM90 kernels cannot run here (the message says
            why and that ``--tiny`` runs on the CPU).
        RuntimeError: a fresh process failed (its output in the message).
    """
    if not tiny:
        require_sm90("start-up", tiny=True)
    with tempfile.TemporaryDirectory(prefix="mla_inductor_start_") as folder:
        env = {**os.environ, "MLA_INDUCTOR_KERNEL_CACHE": folder}
        if tiny:
            env["MLA_INDUCTOR_BACKEND"] = "reference"
        where = "CPU, reference backend" if tiny else "SM90 kernels"
        print(f"# start-up, {datetime.date.today()}, {where}, T {T}, H {H}, topk {topk}, S = 2T, "
              f"d_qk {D_QK}, d_v {D_V}; seconds")
        print("| run | CUDA start-up | import mla_inductor | inputs | optimizer (torch imports "
              "torch._dynamo) | first step | after CUDA | ours (import + step) "
              "| CuTe DSL imported |")
        print("|---|---|---|---|---|---|---|---|---|")
        for name in RUNS:
            r = run_fresh(child_code(T, H, topk, tiny), env)
            optimizer = f"{r['optimizer']:.2f}" + (
                "" if r["dynamo_in_optimizer"] else " (no torch._dynamo)")
            after = r["import"] + r["inputs"] + r["optimizer"] + r["step"]
            print(f"| {name} | {r['cuda']:.2f} | {r['import']:.2f} | {r['inputs']:.2f} "
                  f"| {optimizer} | {r['step']:.2f} | {after:.2f} | {r['import'] + r['step']:.2f} "
                  f"| {'yes' if r['cute_dsl'] else 'no'} |", flush=True)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``start`` subcommand's flags: ``--T``, ``--H``, ``--topk``, ``--tiny``."""
    parser.add_argument("--T", type=int, default=None,
                        help="tokens; default: 4096 (with --tiny: 64)")
    parser.add_argument("--H", type=int, default=None, help="heads; default: 128 (--tiny: 16)")
    parser.add_argument("--topk", type=int, default=None,
                        help="slots per token; default: 2048 (--tiny: 32)")
    parser.add_argument("--tiny", action="store_true",
                        help="T 64, H 16, topk 32, float32 on the CPU with the reference backend")


def run(args: argparse.Namespace) -> None:
    """Runs the ``start`` subcommand."""
    tiny = args.tiny
    bench_start(args.T or (64 if tiny else 4096), args.H or (16 if tiny else 128),
                args.topk or (32 if tiny else 2048), tiny=tiny)
