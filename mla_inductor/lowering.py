"""Inductor integration of the sparse-MLA ops: explicit fallback lowerings with a layout rule.

What inductor does with our ops (torch 2.9 to 2.14):
- The entry op ``sparse_mla`` never reaches inductor: AOTAutograd decomposes it (that is where the
  threshold policy runs), leaving ``sparse_mla_fwd`` / ``sparse_mla_bwd`` in the graphs (and
  likewise ``indexer_target_entry`` leaves ``indexer_target``,
  :mod:`mla_inductor.ops.indexer_target`, and ``lightning_indexer_scores_entry`` the scores op
  and its backward, :mod:`mla_inductor.ops.lightning_indexer_scores`).
- These ops carry ``torch.Tag.needs_contiguous_strides`` (a public tag, set for every op by
  :mod:`mla_inductor.ops.registry`, which also lists them for this module): inductor then
  writes their tensor operands contiguously, fusing pointwise producers (a scale, a
  transpose-copy, the int64 -> int32 index cast and the invalid-slot mask of
  :func:`mla_inductor.sparse_mla`) into the one kernel it generates before the call, instead of
  copying afterwards. The op body's ``.contiguous()`` is then a no-op.
- The generated wrapper calls ``torch.ops.mla_inductor.sparse_mla_fwd.default(...)`` and
  ``...sparse_mla_bwd.default(...)`` directly (an ``ExternKernel`` fallback), so our kernels run
  unchanged inside compiled graphs and CUDA graphs.

This module adds one thing on top, on the torch versions of :data:`TESTED_TORCH`: it registers those
fallbacks explicitly (``make_fallback`` with ``require_contiguous``), so compiled graphs keep
working when a user sets ``torch._inductor.config.implicit_fallbacks = False``; and, for the
transformers integration's ``head_matmul``, whose strided operands are its design, the fallback
with the layout rule the implicit one would give it (:func:`install_like_implicit`; tested on torch
2.13, CPU). It is installed lazily, from the fake kernels, once inductor is already imported
(importing inductor costs seconds, which eager users should not pay). Without it (other torch
versions), the tag above gives the same generated code through inductor's implicit fallback. The
gate's decision is logged once per process on the ``mla_inductor`` log (INFO;
``TORCH_LOGS="mla_inductor"``): the torch version, the tested range and whether the lowerings were
registered.

Run on torch 2.13.0 and 2.14.1 (CPU; 2.14.1 a CUDA build run on the CPU) and 2.11.0 (CUDA, H100
and H200); :data:`TESTED_TORCH` is the range of releases written for (2.9 to 2.14).
"""

from __future__ import annotations

import sys

import torch

from .logs import log
from .ops import registry

TESTED_TORCH = ((2, 9), (2, 14))  # inclusive range of (major, minor) the registration is made on
_installed = False
_gate_logged = False


def _torch_version() -> tuple[int, int]:
    major, minor = torch.__version__.split(".")[:2]
    return int(major), int(minor)


def _admitted() -> bool:
    """Whether inductor is loaded and this torch is in :data:`TESTED_TORCH` (the decision is
    logged once, the first time inductor is found loaded)."""
    if "torch._inductor.lowering" not in sys.modules:
        return False
    low, high = TESTED_TORCH
    admitted = low <= _torch_version() <= high
    _log_gate(admitted)
    return admitted


def install() -> bool:
    """Registers the explicit fallback lowerings if inductor is loaded and this torch was tested.

    Returns:
        Whether the lowerings are registered (now or earlier).
    """
    global _installed
    if _installed:
        return True
    if not _admitted():
        return False
    from torch._inductor.lowering import lowerings, make_fallback, require_contiguous

    for op in registry.lowered_ops():
        if op not in lowerings:
            make_fallback(op, layout_constraint=require_contiguous, warn=False)
    _installed = True
    return True


def install_like_implicit(op: torch._ops.OpOverload) -> bool:
    """Registers ``op``'s explicit fallback lowering with the layout rule inductor's implicit
    fallback gives it (the rule of the op's layout tag, else of
    ``torch._functorch.config.custom_op_default_layout_constraint``), if inductor is loaded and
    this torch was tested: for ops outside the core list whose strides are part of their design
    (the transformers integration's ``head_matmul``), so that the generated code is the same
    with ``implicit_fallbacks=False``.

    Args:
        op: a custom op's overload, e.g. ``torch.ops.mla_inductor.head_matmul.default``.

    Returns:
        Whether ``op`` has a lowering (now or earlier). Raises nothing of its own.
    """
    if not _admitted():
        return False
    from torch._inductor.lowering import lowerings, make_fallback, tag_to_layout_constraint
    from torch._library.utils import get_layout_constraint_tag

    if op not in lowerings:
        rule = tag_to_layout_constraint(get_layout_constraint_tag(op, with_default=True))
        make_fallback(op, layout_constraint=rule, warn=False)
    return True


def _log_gate(admitted: bool) -> None:
    """One INFO line per process: this torch's version against :data:`TESTED_TORCH` and whether
    the explicit fallbacks are registered (without them ``implicit_fallbacks=False`` fails to
    compile graphs holding the ops)."""
    global _gate_logged
    if _gate_logged:
        return
    _gate_logged = True
    (lo_major, lo_minor), (hi_major, hi_minor) = TESTED_TORCH
    log.info(
        "lowering: torch %s %s the tested range %d.%d-%d.%d: explicit fallback lowerings %s",
        torch.__version__, "is in" if admitted else "is outside", lo_major, lo_minor, hi_major,
        hi_minor, "registered" if admitted else "not registered (inductor's implicit fallback "
        "still calls the ops; implicit_fallbacks=False would fail)",
        extra={"torch_version": torch.__version__, "admitted": admitted},
    )
