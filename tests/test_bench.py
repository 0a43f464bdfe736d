"""The benchmark entry points import and parse on any machine; without an SM90 GPU each exits
with a message naming why (the benchmarks themselves run on the H200, see README)."""

import pytest
import torch

from mla_inductor import bench


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU this would run the benchmark")
@pytest.mark.parametrize("what", ["fwd", "bwd", "train"])
def test_cli_exits_with_reason_without_sm90(what):
    with pytest.raises(SystemExit, match="not available here: sm90: no CUDA device"):
        bench.main([what, "--T", "128", "--H", "64"])


@pytest.mark.cuda
@pytest.mark.parametrize("protocol", list(bench.PROTOCOLS))
def test_timer_measures_twice_the_work(protocol):
    """Each protocol's timer times each function on its own: a function doing the same matmul
    twice takes about twice as long as one doing it once (checked against a wide band, since the
    two share the GPU's clock drift but not its noise)."""
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    once = lambda: a @ a  # noqa: E731
    twice = lambda: (a @ a, a @ a)  # noqa: E731
    times = bench.PROTOCOLS[protocol]({"once": once, "twice": twice})
    assert set(times) == {"once", "twice"}
    assert times["once"] > 0
    assert 1.6 < times["twice"] / times["once"] < 2.4
