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

