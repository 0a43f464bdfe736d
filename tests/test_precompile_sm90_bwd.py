"""The SM90 backward kernel compiles for sm_90a on a machine without a GPU."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("cutlass")

from mla_inductor.kernels.sm90 import bwd_host  # noqa: E402


@pytest.mark.slow
@pytest.mark.parametrize(
    "heads,d_qk,d_v,has_topk_length,has_o_lo,evict_first,deterministic,sink",
    [(128, 576, 512, False, True, False, False, False), (72, 512, 512, True, False, True, False, True),
     (128, 576, 512, True, True, False, True, True)],
)
def test_backward_compiles_for_sm90a(heads, d_qk, d_v, has_topk_length, has_o_lo, evict_first,
                                     deterministic, sink):
    compiled = bwd_host.precompile_backward(
        "sm_90a", dtypes=(torch.bfloat16,), heads=(heads,), d_qk=d_qk, d_v=d_v,
        topk_length=(has_topk_length,), o_lo=(has_o_lo,), gather_evict_first=(evict_first,),
        deterministic=(deterministic,), attn_sink=(sink,),
    )
    (key,) = compiled
    assert key == ("bfloat16", heads, d_qk, d_v, has_topk_length, has_o_lo, False, False, False,
                   evict_first, deterministic, sink, "sm_90a")
    assert key == bwd_host.compile_key(torch.bfloat16, heads, d_qk, d_v, has_topk_length, has_o_lo,
                                       gather_evict_first=evict_first, deterministic=deterministic,
                                       has_sink=sink)
    assert callable(compiled[key])


def test_other_arch_rejected():
    with pytest.raises(ValueError):
        bwd_host.precompile_backward("sm_100a")


def test_unsupported_dims_rejected():
    q = torch.zeros(1, 1, 256, dtype=torch.bfloat16)
    kv = torch.zeros(4, 256, dtype=torch.bfloat16)
    with pytest.raises(ValueError):
        bwd_host.backward(q[..., :128], None, q, kv, torch.zeros(1, 4, dtype=torch.int32), None,
                          None, None, q[..., :128], torch.zeros(1, 1), torch.zeros(0), 0.1, 128)
