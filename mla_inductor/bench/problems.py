"""The benchmarks' problems: DeepSeek V3.2's widths, the index patterns, the shape flags, the
checks that the SM90 kernels and transformers are here, and the CPU thread count of a run."""

from __future__ import annotations

import argparse

import torch

from ..threads import cpu_threads, default_threads

D_QK, D_V = 576, 512
PATTERNS = ("random", "causal")


def make_indices(
    T: int, S: int, topk: int, pattern: str, generator: torch.Generator
) -> torch.Tensor:
    """``indices [T, topk]`` int32 on ``generator``'s device: ``random`` (uniform over S) or
    ``causal`` (token t at position S - T + t, its own key in slot 0, -1 past its position)."""
    device = generator.device
    if pattern == "random":
        return torch.randint(0, S, (T, topk), device=device, dtype=torch.int32, generator=generator)
    pos = (S - T) + torch.arange(T, device=device)
    idx = (torch.rand(T, topk, device=device, generator=generator) * (pos[:, None] + 1)).long()
    idx[:, 0] = pos
    idx = torch.where(torch.arange(topk, device=device)[None] <= pos[:, None], idx, -1)
    return idx.int()


KV_LENGTHS = {"2T": 2, "T": 1}  # --S: kv rows per token


def add_shape_arguments(parser: argparse.ArgumentParser, *, kv_length: str = "2T",
                        patterns: tuple = PATTERNS) -> None:
    """Adds the shape flags every subcommand shares: ``--T`` (token counts), ``--S`` (kv length,
    ``2T`` or ``T``; default ``kv_length``), ``--H`` (head counts), ``--topk`` and ``--indices``
    (index patterns; default ``patterns``)."""
    parser.add_argument("--T", type=int, nargs="+", default=[4096, 16384],
                        help="token counts T; default: 4096 16384")
    parser.add_argument("--S", choices=list(KV_LENGTHS), default=kv_length,
                        help=f"kv length S: 2T or T (the long-context rows); default: {kv_length}")
    parser.add_argument("--H", type=int, nargs="+", default=[128, 64],
                        help="head counts; default: 128 64")
    parser.add_argument("--topk", type=int, default=2048, help="slots per token; default: 2048")
    parser.add_argument("--indices", choices=PATTERNS, nargs="+", default=list(patterns),
                        help=f"index patterns; default: {' '.join(patterns)}")


def run_threads(tiny: bool):
    """The CPU thread count a subcommand runs under, as a context manager: one thread for a
    ``--tiny`` run on the CPU (:mod:`mla_inductor.threads` says why), torch's own count
    otherwise."""
    return cpu_threads(default_threads("cpu" if tiny else "cuda"))


def require_sm90(what: str, tiny: bool = False) -> None:
    """Raises ``SystemExit("sm90 <what> not available here: <reason>")`` unless the SM90 kernels
    can run on this machine; with ``tiny`` (a subcommand that has ``--tiny``) the message adds
    that ``--tiny`` runs a small smoke test on the CPU."""
    from mla_inductor.kernels import sm90

    ok, why = sm90.available()
    if not ok:
        hint = "; --tiny runs a small smoke test on the CPU" if tiny else ""
        raise SystemExit(f"sm90 {what} not available here: {why}{hint}")


def require_transformers(command: str, module: str = "transformers") -> None:
    """Raises ``SystemExit("<command> needs transformers ...")`` unless ``module`` (transformers,
    or one of its model modules) imports."""
    import importlib

    try:
        importlib.import_module(module)
    except ImportError as e:
        raise SystemExit(f"{command} needs transformers 5.24 (pip install "
                         f"'mla-inductor[transformers]'): {e}")
