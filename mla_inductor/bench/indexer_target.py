"""indexer-target: the SM90 indexer-target kernel against our exact forward at the same shape.

For every T x H x index pattern (S = T by default, ``--S 2T`` for twice as many keys; the
patterns of :mod:`mla_inductor.bench.fwd`), times ``indexer_target`` (with the exact forward's
lse) and the exact forward (threshold 0.0, no o_lo) in the same interleaved rounds
(:func:`mla_inductor.bench.timing.time_ms_interleaved`, or ``--protocol cooled``), and measures
the target call's peak memory: the bytes it allocates on top of its inputs (q, kv, indices,
lse), against its output ``[T, topk]`` float32 (the bound it is held to: inputs plus peak within
10% of inputs plus output, i.e. no ``[T, H, topk]`` tensor). TFLOPS = 2·T·H·topk·d_qk / time
(the target computes only Q K^T). Prints a markdown table.
"""

from __future__ import annotations

import argparse
import datetime

import torch

from .problems import D_QK, D_V, KV_LENGTHS, add_shape_arguments, make_indices, require_sm90
from .timing import PROTOCOLS, add_protocol_argument, peak_bytes


def bench_indexer(Ts, Hs, topk, patterns=("random",), protocol="sustained", kv_per_token=1):
    """Prints the table of the module docstring for token counts ``Ts`` (S = ``kv_per_token``
    x T) and head counts ``Hs`` at d_qk 576, bf16, timed under ``protocol`` (a key of
    :data:`mla_inductor.bench.timing.PROTOCOLS`). Exits with a message when sm90 cannot run
    here."""
    from mla_inductor.kernels import sm90

    require_sm90("indexer target")
    gen = torch.Generator(device="cuda").manual_seed(0)
    print(f"# indexer target, {datetime.date.today()}, {torch.cuda.get_device_name()}, "
          f"torch {torch.__version__}, d_qk {D_QK}, topk {topk}, "
          f"S = {kv_per_token if kv_per_token > 1 else ''}T, bf16, {protocol} timing")
    print("| T | H | indices | target ms | exact forward ms | target / forward | target TFLOPS "
          "| peak MiB over inputs | output MiB | (inputs + peak) / (inputs + output) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    sm_scale = D_QK**-0.5
    for T in Ts:
        S = kv_per_token * T
        kv = torch.randn(S, D_QK, device="cuda", generator=gen).bfloat16()
        for H in Hs:
            q = torch.randn(T, H, D_QK, device="cuda", generator=gen).bfloat16()
            for pattern in patterns:
                indices = make_indices(T, S, topk, pattern, gen)
                lse = sm90.forward(q, kv, indices, None, None, None, sm_scale, D_V, 0.0, False,
                                   False)[1]
                target = lambda: sm90.indexer_target(  # noqa: E731
                    q, kv, indices, None, None, None, lse, sm_scale)
                forward = lambda: sm90.forward(  # noqa: E731
                    q, kv, indices, None, None, None, sm_scale, D_V, 0.0, False, False)
                times = PROTOCOLS[protocol]({"target": target, "forward": forward})
                peak = peak_bytes(target)
                inputs = sum(x.numel() * x.element_size() for x in (q, kv, indices, lse))
                output = T * topk * 4
                ms, fwd_ms = times["target"], times["forward"]
                print(f"| {T} | {H} | {pattern} | {ms:.3f} | {fwd_ms:.3f} | {ms / fwd_ms:.3f} | "
                      f"{2 * T * H * topk * D_QK / ms / 1e9:.0f} | {peak / 2**20:.1f} | "
                      f"{output / 2**20:.1f} | {(inputs + peak) / (inputs + output):.3f} |")
                del indices, lse
            del q
        del kv


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``indexer`` subcommand's flags: the shapes (here S = T and random indices by default)
    and ``--protocol``."""
    add_shape_arguments(parser, kv_length="T", patterns=("random",))
    add_protocol_argument(parser)


def run(args: argparse.Namespace) -> None:
    """Runs the subcommand for parsed flags (:func:`add_arguments`)."""
    bench_indexer(args.T, args.H, args.topk, patterns=args.indices, protocol=args.protocol,
                  kv_per_token=KV_LENGTHS[args.S])
