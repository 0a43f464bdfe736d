"""The benchmark command: ``--help`` at every level, usage errors, and on a machine without an
SM90 GPU each subcommand exits with a message naming why (the benchmarks themselves run on the
H200, see README); on a GPU, the timers."""

import subprocess
import sys

import pytest
import torch

from mla_inductor.bench import cli, timing


@pytest.mark.parametrize("argv", [[], ["fwd"], ["bwd"], ["train"], ["indexer"]])
def test_help_at_every_level(argv, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main([*argv, "--help"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    assert text.startswith(f"usage: python -m mla_inductor.bench {' '.join(argv)}".rstrip())
    if argv:
        assert "--topk" in text
    else:
        assert all(name in text for name in cli.SUBCOMMANDS)


def test_indexer_parser_defaults_and_flags():
    """``indexer`` defaults to the issue's shapes (T 4096 16384, H 128 64, topk 2048, S = T,
    random indices) and takes the shared shape flags and the protocol."""
    from mla_inductor.bench import indexer

    args = cli.build_parser().parse_args(["indexer"])
    assert (args.T, args.H, args.topk, args.S, args.indices, args.protocol) == (
        [4096, 16384], [128, 64], 2048, "T", ["random"], "sustained")
    assert args.run is indexer.run
    args = cli.build_parser().parse_args(
        ["indexer", "--T", "128", "--H", "16", "--topk", "64", "--S", "2T", "--indices",
         "random", "causal", "--protocol", "cooled"])
    assert (args.T, args.H, args.topk, args.S, args.indices, args.protocol) == (
        [128], [16], 64, "2T", ["random", "causal"], "cooled")
    # the other subcommands keep their defaults
    fwd_args = cli.build_parser().parse_args(["fwd"])
    assert fwd_args.S == "2T" and fwd_args.indices == ["random", "causal"]


def test_module_runs_as_a_command_and_rejects_unknown_subcommands():
    run = [sys.executable, "-m", "mla_inductor.bench"]
    shown = subprocess.run([*run, "--help"], capture_output=True, text=True, timeout=120)
    assert shown.returncode == 0 and "{fwd,bwd,train,indexer}" in shown.stdout
    wrong = subprocess.run([*run, "fw"], capture_output=True, text=True, timeout=120)
    assert wrong.returncode == 2 and "invalid choice: 'fw'" in wrong.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU this would run the benchmark")
@pytest.mark.parametrize("what", list(cli.SUBCOMMANDS))
def test_cli_exits_with_reason_without_sm90(what):
    with pytest.raises(SystemExit, match="not available here: sm90: no CUDA device"):
        cli.main([what, "--T", "128", "--H", "64"])


@pytest.mark.cuda
@pytest.mark.parametrize("protocol", list(timing.PROTOCOLS))
def test_timer_measures_twice_the_work(protocol):
    """Each protocol's timer times each function on its own: a function doing the same matmul
    twice takes about twice as long as one doing it once (checked against a wide band, since the
    two share the GPU's clock drift but not its noise)."""
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    once = lambda: a @ a  # noqa: E731
    twice = lambda: (a @ a, a @ a)  # noqa: E731
    times = timing.PROTOCOLS[protocol]({"once": once, "twice": twice})
    assert set(times) == {"once", "twice"}
    assert times["once"] > 0
    assert 1.6 < times["twice"] / times["once"] < 2.4
