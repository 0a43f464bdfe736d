"""The command ``python -m mla_inductor.bench
{fwd,bwd,train,indexer,lightning,lightning-scores,hf,hf-v4,hf-glm5-next,dist,start} [flags]``: one
argument parser with a subcommand per benchmark module (:data:`SUBCOMMANDS`); ``--help`` works at
every level."""

from __future__ import annotations

import argparse
from typing import Optional

from . import (bwd, dist, fwd, hf, hf_glm5_next, hf_v4, indexer_target, lightning, lightning_scores,
               start, train)

SUBCOMMANDS = {"fwd": fwd, "bwd": bwd, "train": train, "indexer-target": indexer_target,
               "lightning": lightning, "lightning-scores": lightning_scores, "hf": hf, "hf-v4": hf_v4,
               "hf-glm5-next": hf_glm5_next, "dist": dist, "start": start}


_MORE = (" The measured tables and the command of each: docs/performance.md in the repository.")


def build_parser() -> argparse.ArgumentParser:
    """The parser: each subcommand's help is the first line of its module's docstring, its
    description that line and a pointer to docs/performance.md (the measured tables and how each
    is reproduced; the module's docstring says what its columns measure), its flags the module's ``add_arguments``."""
    parser = argparse.ArgumentParser(
        prog="python -m mla_inductor.bench",
        description="Benchmarks of the sparse-MLA kernels on the current GPU (SM90); lightning, "
        "hf, hf-v4, hf-glm5-next, dist and start also run a small smoke test on the CPU with "
        "--tiny. Each subcommand prints a markdown table; `<subcommand> --help` lists its flags.",
    )
    sub = parser.add_subparsers(dest="command", required=True,
                                metavar="{" + ",".join(SUBCOMMANDS) + "}")
    for name, module in SUBCOMMANDS.items():
        summary = module.__doc__.split("\n\n", 1)[0].split(": ", 1)[1]
        p = sub.add_parser(name, help=summary,
                           description=summary[:1].upper() + summary[1:].rstrip(".") + "." + _MORE)
        module.add_arguments(p)
        p.set_defaults(run=module.run)
    return parser


def main(argv: Optional[list[str]] = None) -> None:
    """Parses ``argv`` (default: the command line) and runs the subcommand.

    Raises:
        SystemExit: 2 with a usage message for a missing or unknown subcommand or flag, 0 after
            ``--help``; with a message naming the reason when the SM90 kernels cannot run here.
    """
    args = build_parser().parse_args(argv)
    args.run(args)
