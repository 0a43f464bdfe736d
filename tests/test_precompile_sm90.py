"""CPU-only: the SM90 forward compiles for sm_90a without a GPU, one artefact per threshold."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("cutlass.cute")

import mla_inductor  # noqa: E402
from mla_inductor.kernels import sm90  # noqa: E402


def test_precompile_two_thresholds_are_two_kernels(tmp_path):
    compiled = mla_inductor.precompile(
        arch="sm_90a", thresholds=(0.0, 8.0), o_lo=(False,), topk_length=(False,), backward_heads=(),
        indexer_heads=()
    )
    assert len(compiled) == 2
    (key_exact, exact), (key_lazy, lazy) = sorted(compiled.items(), key=lambda kv: kv[0][3])
    assert key_exact[3] == 0.0 and key_lazy[3] == 8.0
    assert key_exact[:3] == ("bfloat16", 576, 512) and key_exact[-1] == "sm_90a"
    assert exact is not lazy
    paths = []
    for name, fn in (("exact", exact), ("lazy", lazy)):
        path = tmp_path / f"{name}.o"
        fn.export_to_c(object_file_path=str(path), function_name=f"fwd_{name}")
        paths.append(path.read_bytes())
    assert paths[0] != paths[1]
    # a second call is served from the cache: the very same objects
    again = sm90.precompile(
        "sm_90a", thresholds=(0.0, 8.0), o_lo=(False,), topk_length=(False,), backward_heads=(),
        indexer_heads=()
    )
    assert again[key_exact] is exact and again[key_lazy] is lazy


def test_precompile_rejects_other_arch():
    with pytest.raises(ValueError, match="sm_90a"):
        sm90.precompile("sm_100a")


@pytest.mark.parametrize("dtype,bound", [("float16", 15.0), ("bfloat16", 64.0)])
def test_threshold_that_overflows_p_is_rejected(dtype, bound):
    """The kernel takes the op's bounds (below 15 in float16, 64 in bfloat16), no wider."""
    from mla_inductor.kernels.sm90.common import TORCH_TO_CUTE
    from mla_inductor.kernels.sm90.fwd import SparseMlaFwdSm90

    cute_dtype = TORCH_TO_CUTE[dtype]
    below = SparseMlaFwdSm90(cute_dtype, 576, 512, bound - 0.5, False, False)
    assert below.threshold == bound - 0.5
    for threshold in (bound, bound + 1.0, -1.0):
        with pytest.raises(ValueError, match="overflow"):
            SparseMlaFwdSm90(cute_dtype, 576, 512, threshold, False, False)


def test_disk_cache_round_trip(tmp_path, monkeypatch):
    """A compiled kernel is exported to the disk cache and loaded back, also without a GPU."""
    from mla_inductor.kernels.cache import DISK_CACHE_ENV, KernelCache
    from mla_inductor.kernels.sm90 import common, fwd, fwd_host

    monkeypatch.setenv(DISK_CACHE_ENV, str(tmp_path))
    key = fwd_host.compile_key(torch.bfloat16, 512, 512, 8.0, False, False)
    with common.target_arch("sm_90a"):
        built = KernelCache("t").get(key, lambda: fwd.compile_forward(*key[:-1]))
        files = list(tmp_path.rglob("*.o"))
        assert len(files) == 1 and files[0].stat().st_size > 0
        loaded = KernelCache("t").get(key, lambda: pytest.fail("should load from disk"))
    assert loaded is not built and callable(loaded)


def test_the_sink_variant_compiles():
    """The forward with an attention sink (causal, max_logits) compiles for sm_90a: its
    epilogue's edge-value handling (a +inf or NaN sink, one whose log2 overflows)."""
    from mla_inductor.kernels.sm90 import fwd_host

    key = fwd_host.compile_key(torch.bfloat16, 576, 512, 0.0, True, True, has_positions=True,
                               has_sink=True, has_max_logits=True)
    fn = fwd_host.get_kernel(key)
    assert fn is fwd_host.get_kernel(key)
