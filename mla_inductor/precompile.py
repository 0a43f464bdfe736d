"""Ahead-of-time compilation of the GPU kernels, with or without a GPU."""

from __future__ import annotations

from . import backends


def precompile(arch: str = "sm_90a", **static_config):
    """Compiles the CuTe DSL kernels for ``arch`` without running them.

    Works on a machine without a GPU: the target comes from ``arch`` (the kernels' modules set
    ``CUTE_DSL_ARCH`` for the duration). Useful to warm the kernel cache before CUDA-graph
    capture and to compile-check kernels in CI.

    Args:
        arch: ``"sm_90a"`` (our Hopper kernels) or ``"sm_100a"`` (FlashAttention-4's Blackwell
            kernels).
        **static_config: the backend's static options (dtypes, d_qk, d_v, thresholds, ...);
            see ``mla_inductor.kernels.sm90.precompile`` and ``mla_inductor.kernels.sm100.precompile``.

    Returns:
        The backend's compiled artefacts (a dict keyed by compile key).

    Raises:
        ValueError: for an unknown arch.
    """
    if arch.startswith("sm_90"):
        return backends.module("sm90").precompile(arch=arch, **static_config)
    if arch.startswith("sm_100"):
        return backends.module("sm100").precompile(arch=arch, **static_config)
    raise ValueError(f"precompile: unknown arch {arch!r}; use 'sm_90a' or 'sm_100a'")
