"""fwd: the SM90 forward kernel against a chunked PyTorch forward.

For every T x H x index pattern (``random``: uniform over the S = 2T keys; ``causal``: token t
sits at position T + t and draws its keys from positions <= its own, its own key in slot 0) x
mode (``exact`` = threshold 0.0, ``train`` = 0.0 with o_lo, ``lazy`` = 8.0), next to a chunked
PyTorch implementation measured in the same run (at the smallest T only: it is slow).
TFLOPS = 2·T·H·topk·(d_qk + d_v) / time; the three modes are timed in interleaved rounds
(:func:`mla_inductor.bench.timing.time_ms_interleaved`: median over rounds of
``triton.testing.do_bench`` medians, CUDA events), or with ``--protocol cooled`` as FlashMLA's
benchmark times kernels (:func:`mla_inductor.bench.timing.time_ms_cooled`, at the clock of a GPU
that is not under sustained load). Prints a markdown table.
"""

from __future__ import annotations

import argparse
import datetime
import math

import torch

from .problems import D_QK, D_V, PATTERNS, add_shape_arguments, make_indices, require_sm90
from .timing import PROTOCOLS, add_protocol_argument

MODES = {"exact": (0.0, False), "train": (0.0, True), "lazy": (8.0, False)}


def torch_forward(q, kv, indices, sm_scale, d_v=D_V, chunk=256):
    """Chunked PyTorch sparse-MLA forward (bf16 matmuls, fp32 softmax): the baseline."""
    out = torch.empty(q.shape[0], q.shape[1], d_v, dtype=q.dtype, device=q.device)
    S = kv.shape[0]
    for t0 in range(0, q.shape[0], chunk):
        idx = indices[t0:t0 + chunk].long()
        valid = (idx >= 0) & (idx < S)
        keys = kv[torch.where(valid, idx, 0)]
        s = torch.einsum("thd,tkd->thk", q[t0:t0 + chunk], keys).float() * sm_scale
        s.masked_fill_(~valid[:, None, :], -math.inf)
        p = torch.softmax(s, dim=-1).to(q.dtype)
        out[t0:t0 + chunk] = torch.einsum("thk,tkd->thd", p, keys[..., :d_v])
    return out


def bench_fwd(Ts, Hs, topk, patterns=PATTERNS, protocol="sustained"):
    """Prints the forward table (module docstring) for token counts ``Ts`` (S = 2T) and head
    counts ``Hs`` at d_qk 576 / d_v 512, bf16, timed under ``protocol`` (a key of
    :data:`mla_inductor.bench.timing.PROTOCOLS`). Exits with a message when sm90 cannot run here."""
    from mla_inductor.kernels import sm90

    require_sm90("forward")
    gen = torch.Generator(device="cuda").manual_seed(0)
    print(f"# sparse-MLA forward, {datetime.date.today()}, {torch.cuda.get_device_name()}, "
          f"torch {torch.__version__}, d_qk {D_QK}, d_v {D_V}, topk {topk}, S = 2T, bf16, "
          f"{protocol} timing")
    print("| T | H | indices | mode | ms | TFLOPS | exact/lazy time |")
    print("|---|---|---|---|---|---|---|")
    for T in Ts:
        S = 2 * T
        kv = torch.randn(S, D_QK, device="cuda", generator=gen).bfloat16()
        for H in Hs:
            q = torch.randn(T, H, D_QK, device="cuda", generator=gen).bfloat16()
            flops = 2 * T * H * topk * (D_QK + D_V)
            sm_scale = D_QK**-0.5
            for pattern in patterns:
                indices = make_indices(T, S, topk, pattern, gen)
                times = PROTOCOLS[protocol]({
                    mode: (lambda thr=thr, o_lo=o_lo:
                           sm90.forward(q, kv, indices, None, sm_scale, D_V, thr, o_lo))
                    for mode, (thr, o_lo) in MODES.items()
                })
                for mode, ms in times.items():
                    ratio = f"{times['exact'] / times['lazy']:.3f}" if mode == "exact" else ""
                    print(f"| {T} | {H} | {pattern} | {mode} | {ms:.3f} | "
                          f"{flops / ms / 1e9:.0f} | {ratio} |")
                if T == min(Ts):
                    ref = lambda: torch_forward(q, kv, indices, sm_scale)  # noqa: E731
                    ms = PROTOCOLS[protocol]({"torch": ref})["torch"]
                    print(f"| {T} | {H} | {pattern} | torch (chunked) | {ms:.3f} | "
                          f"{flops / ms / 1e9:.0f} | |")
            del q
        del kv


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``fwd`` subcommand's flags: the shapes and ``--protocol``."""
    add_shape_arguments(parser)
    add_protocol_argument(parser)


def run(args: argparse.Namespace) -> None:
    """Runs the subcommand for parsed flags (:func:`add_arguments`)."""
    bench_fwd(args.T, args.H, args.topk, protocol=args.protocol)
