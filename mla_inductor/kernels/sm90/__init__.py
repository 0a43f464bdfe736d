"""Our Hopper (SM90a) sparse-MLA kernels, written in CuTe DSL (backend protocol of
:mod:`mla_inductor.kernels`). The forward is in :mod:`.fwd`."""

from __future__ import annotations

import torch


def available() -> tuple[bool, str]:
    """True only on a CUDA device of capability (9, 0) with nvidia-cutlass-dsl importable."""
    if not torch.cuda.is_available():
        return False, "sm90: no CUDA device"
    cap = torch.cuda.get_device_capability()
    if cap != (9, 0):
        return False, f"sm90: device capability {cap}, need (9, 0)"
    try:
        import cutlass.cute  # noqa: F401
    except ImportError as e:
        return False, f"sm90: nvidia-cutlass-dsl not importable ({e})"
    return True, ""


SUPPORTED_DIMS = ((576, 512), (512, 512))  # (d_qk, d_v)


def supports(dtype, direction, T, H, S, d_qk, d_v) -> tuple[bool, str]:
    """Whether the kernels handle this problem (``auto`` falls back to the reference if not):
    bf16/fp16 and ``(d_qk, d_v)`` in :data:`SUPPORTED_DIMS`. Every T, S, H and topk is supported
    (64-bit offsets wherever a product of sizes can pass 2**31), limited only by GPU memory."""
    if dtype not in (torch.bfloat16, torch.float16):
        return False, f"sm90 kernels take bfloat16 or float16, got {dtype}"
    if (d_qk, d_v) not in SUPPORTED_DIMS:
        return False, f"sm90 kernels support (d_qk, d_v) in {SUPPORTED_DIMS}, got {(d_qk, d_v)}"
    return True, ""


def forward(q, kv, indices, topk_length, sm_scale, d_v, rescale_threshold, return_o_lo):
    """See :func:`mla_inductor.kernels.sm90.fwd.forward`."""
    from . import fwd

    return fwd.forward(q, kv, indices, topk_length, sm_scale, d_v, rescale_threshold, return_o_lo)[:3]


def precompile(arch: str = "sm_90a", *, dtypes=(torch.bfloat16,), d_qk: int = 576, d_v: int = 512,
               thresholds=(0.0, 8.0), o_lo=(False, True), topk_length=(False, True),
               backward_heads=(128,), backward_o_lo=(True,)) -> dict:
    """Compiles the kernels for ``arch`` without a GPU; returns ``{compile_key: fn}``.

    Forward: every combination of ``dtypes`` x ``thresholds`` x ``o_lo`` x ``topk_length``.
    Backward (its head count is static): ``dtypes`` x ``backward_heads`` x ``topk_length`` x
    ``backward_o_lo`` (whether the forward's o_lo is passed; a training forward always returns
    it); pass ``backward_heads=()`` to skip it. Everything is cached, so later calls on a GPU do not
    compile again.

    Raises:
        ValueError: for an arch other than ``sm_90a``.
    """
    if arch != "sm_90a":
        raise ValueError(f"sm90 backend: cannot compile for {arch!r}; use 'sm_90a'")
    from . import bwd, fwd

    compiled = {}
    with fwd.target_arch(arch):
        for dtype in dtypes:
            for threshold in thresholds:
                for with_o_lo in o_lo:
                    for with_len in topk_length:
                        key = fwd.compile_key(dtype, d_qk, d_v, threshold, with_o_lo, with_len, arch)
                        compiled[key] = fwd.get_kernel(key)
    if backward_heads:
        compiled.update(bwd.precompile_backward(
            arch, dtypes=dtypes, heads=backward_heads, d_qk=d_qk, d_v=d_v, topk_length=topk_length,
            o_lo=backward_o_lo))
    return compiled


def backward(dout, q, kv, indices, topk_length, out, lse, o_lo, sm_scale, d_v):
    """See :func:`mla_inductor.kernels.sm90.bwd.backward`."""
    from . import bwd

    return bwd.backward(dout, q, kv, indices, topk_length, out, lse, o_lo, sm_scale, d_v)[:2]
