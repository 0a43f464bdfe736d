"""fwd: the SM90 forward kernel against FlashMLA's and a chunked PyTorch forward.

For every T x H x index pattern (``random``: uniform over the S keys, S = 2T or, with
``--S T``, T; ``causal``: token t sits at position S - T + t and draws its keys from positions
<= its own, its own key in slot 0) x mode (``exact`` = threshold 0.0, ``train`` = 0.0 with
o_lo, ``lazy`` = 8.0), next to FlashMLA's SM90 forward (the anchor, when ``fmla_sm90`` is
importable: H 64 and 128) and a chunked PyTorch implementation (at the smallest T, if <= 4096:
it is slow), all measured in the same run.
TFLOPS = 2·T·H·topk·(d_qk + d_v) / time; the three modes are timed in interleaved rounds
(:func:`mla_inductor.bench.timing.time_ms_interleaved`: median over rounds of
``triton.testing.do_bench`` medians, CUDA events), or with ``--protocol cooled`` as FlashMLA's
benchmark times kernels (:func:`mla_inductor.bench.timing.time_ms_cooled`, at the clock of a GPU
that is not under sustained load). With ``--features``, the exact forward with each DSA feature
(causal positions, a sink, max_logits) joins the rounds, and a row per feature gives its time
over the plain exact forward's from 21 back-to-back pairs (median and quartiles:
:func:`mla_inductor.bench.timing.paired_ratios`), fine enough for costs of a percent. Prints a
markdown table.
"""

from __future__ import annotations

import argparse
import datetime
import math

import torch

from ..thresholds import EXACT_THRESHOLD, LAZY_THRESHOLD
from .problems import (D_QK, D_V, KV_LENGTHS, PATTERNS, add_shape_arguments, make_indices,
                       require_sm90)
from .timing import PROTOCOLS, add_protocol_argument, paired_ratios

MODES = {"exact": (EXACT_THRESHOLD, False), "train": (EXACT_THRESHOLD, True),
         "lazy": (LAZY_THRESHOLD, False)}


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


def _flashmla_forward():
    """FlashMLA's SM90 sparse prefill forward (the ``fmla_sm90`` extension built from
    FlashMLA's sources), or None when it is not importable."""
    try:
        import fmla_sm90
    except ImportError:
        return None
    return fmla_sm90.sparse_prefill_fwd


def feature_arguments(T: int, S: int, H: int) -> dict:
    """The DSA features each timed against the plain call (``--features``): ``{name: (q_positions,
    attn_sink, return_max_logits)}`` with causal positions ``S - T + t`` (int32 ``[T]``) and a
    sink of ``N(0, 1)`` logits (float32 ``[H]``), both on the current CUDA device. Raises what
    torch raises without one."""
    positions = (torch.arange(T, device="cuda") + (S - T)).int()
    sink = torch.randn(H, device="cuda")
    return {"causal": (positions, None, False), "sink": (None, sink, False),
            "max_logits": (None, None, True)}


def bench_fwd(Ts, Hs, topk, patterns=PATTERNS, protocol="sustained", kv_per_token=2,
              features=False):
    """Prints the forward table (module docstring) for token counts ``Ts`` (S = ``kv_per_token``
    x T) and head counts ``Hs`` at d_qk 576 / d_v 512, bf16, timed under ``protocol`` (a key of
    :data:`mla_inductor.bench.timing.PROTOCOLS`), with FlashMLA's forward (H 64 or 128, when
    ``fmla_sm90`` is importable) in the same interleaved rounds; with ``features``, the exact
    forward with each DSA feature of :func:`feature_arguments` too, and each one's paired ratio
    to the plain exact forward. Exits with a message when sm90 cannot run here."""
    from mla_inductor.kernels import sm90

    require_sm90("forward")
    flashmla = _flashmla_forward()
    gen = torch.Generator(device="cuda").manual_seed(0)
    print(f"# sparse-MLA forward, {datetime.date.today()}, {torch.cuda.get_device_name()}, "
          f"torch {torch.__version__}, d_qk {D_QK}, d_v {D_V}, topk {topk}, "
          f"S = {kv_per_token if kv_per_token > 1 else ''}T, bf16, {protocol} timing")
    print("| T | H | indices | mode | ms | TFLOPS | / exact time | FlashMLA time / this |")
    print("|---|---|---|---|---|---|---|---|")
    for T in Ts:
        S = kv_per_token * T
        kv = torch.randn(S, D_QK, device="cuda", generator=gen).bfloat16()
        for H in Hs:
            q = torch.randn(T, H, D_QK, device="cuda", generator=gen).bfloat16()
            flops = 2 * T * H * topk * (D_QK + D_V)
            sm_scale = D_QK**-0.5
            for pattern in patterns:
                indices = make_indices(T, S, topk, pattern, gen)
                fns = {
                    mode: (lambda thr=thr, o_lo=o_lo:
                           sm90.forward(q, kv, indices, None, None, None, sm_scale, D_V, thr,
                                        o_lo, False))
                    for mode, (thr, o_lo) in MODES.items()
                }
                if features:
                    for name, (pos, sink, max_logits) in feature_arguments(T, S, H).items():
                        fns[f"exact + {name}"] = (
                            lambda pos=pos, sink=sink, max_logits=max_logits: sm90.forward(
                                q, kv, indices, None, pos, sink, sm_scale, D_V,
                                EXACT_THRESHOLD, False, max_logits))
                if flashmla is not None and H in (64, 128):
                    fns["FlashMLA"] = lambda: flashmla(q, kv[:, None], indices[:, None], sm_scale,
                                                       D_V, None, None)
                times = PROTOCOLS[protocol](fns)
                for mode, ms in times.items():
                    anchor = times.get("FlashMLA")
                    versus = f"{anchor / ms:.3f}" if anchor is not None else ""
                    print(f"| {T} | {H} | {pattern} | {mode} | {ms:.3f} | "
                          f"{flops / ms / 1e9:.0f} | {ms / times['exact']:.3f} | {versus} |")
                if features:
                    ratios = paired_ratios(fns["exact"], {
                        name: fns[name] for name in fns if name.startswith("exact + ")})
                    for mode, (median, q1, q3) in ratios.items():
                        print(f"| {T} | {H} | {pattern} | {mode}: paired / exact | | | "
                              f"{median:.3f} ({q1:.3f}..{q3:.3f}) | |")
                if T == min(Ts) and T <= 4096:
                    ref = lambda: torch_forward(q, kv, indices, sm_scale)  # noqa: E731
                    ms = PROTOCOLS[protocol]({"torch": ref})["torch"]
                    print(f"| {T} | {H} | {pattern} | torch (chunked) | {ms:.3f} | "
                          f"{flops / ms / 1e9:.0f} | | |")
            del q
        del kv


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``fwd`` subcommand's flags: the shapes and ``--protocol``."""
    add_shape_arguments(parser)
    add_protocol_argument(parser)
    parser.add_argument("--features", action="store_true",
                        help="also time the exact forward with causal positions, a sink, and "
                             "max_logits (each against the plain call)")


def run(args: argparse.Namespace) -> None:
    """Runs the subcommand for parsed flags (:func:`add_arguments`)."""
    bench_fwd(args.T, args.H, args.topk, patterns=args.indices, protocol=args.protocol,
              kv_per_token=KV_LENGTHS[args.S], features=args.features)
