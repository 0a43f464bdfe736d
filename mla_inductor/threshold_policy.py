"""The rescale-threshold policy: exact running max for training, lazy rescale for inference.

Rule (docs/design.md; FlashAttention-4 ``interface.py`` makes the same choice at call time):
``rescale_threshold = 0.0`` (exact running max) when a backward will consume the forward, ``8.0``
(lazy rescale, log2 units) otherwise. With a stale max the dominant key's probability is
``exp2(delta)`` rounded to bf16: a coherent ~2^-9 gain error on the whole output row, which a
gradient then inherits.

"A backward will consume it" is decided where graph capture knows it: the public entry op
``mla_inductor::sparse_mla`` is CompositeImplicitAutograd, so AOTAutograd decomposes it while
tracing either the joint (training) graph, with grad mode on and inputs requiring grad, or the
inference graph. In eager the same rule runs at call time. ``model.eval()`` with parameters that
require grad and grad mode on still counts as training (a backward may follow); evaluate under
``torch.no_grad()`` or ``torch.inference_mode()`` to get the lazy kernel.
"""

from __future__ import annotations

import weakref
from typing import NamedTuple, Optional

import torch
from torch.fx.experimental.proxy_tensor import get_proxy_mode

from .logs import log
from .thresholds import EXACT_THRESHOLD, LAZY_THRESHOLD

_warned_override = False
_logged: "weakref.WeakKeyDictionary[object, set]" = weakref.WeakKeyDictionary()


class Decision(NamedTuple):
    """``rescale_threshold`` (log2 units) for one forward, whether a backward consumes it, and why."""

    rescale_threshold: float
    needs_backward: bool
    reason: str


def decide(q: torch.Tensor, kv: torch.Tensor, rescale_threshold: Optional[float],
           attn_sink: Optional[torch.Tensor] = None) -> Decision:
    """Resolves the forward's ``rescale_threshold`` (log2 units) for one call or one capture.

    Args:
        q, kv: the attention inputs (real, fake or functional tensors).
        rescale_threshold: an explicit value to respect, or ``None`` for the policy.
        attn_sink: the optional sink logits; one that requires grad also means a backward.

    Returns:
        The threshold, whether a backward will consume the forward (the forward then also
        writes ``o_lo``), and the reason in words.
    """
    needs_backward = torch.is_grad_enabled() and (
        q.requires_grad or kv.requires_grad or (attn_sink is not None and attn_sink.requires_grad)
    )
    if rescale_threshold is not None:
        decision = Decision(float(rescale_threshold), needs_backward, "explicit rescale_threshold")
        if needs_backward and decision.rescale_threshold != EXACT_THRESHOLD:
            _warn_override(decision.rescale_threshold)
    elif needs_backward:
        decision = Decision(EXACT_THRESHOLD, True, "a backward graph consumes this forward")
    else:
        why = "grad mode is off" if not torch.is_grad_enabled() else "no input requires grad"
        decision = Decision(LAZY_THRESHOLD, False, f"inference: {why}")
    _log_capture(decision)
    return decision


def _warn_override(threshold: float) -> None:
    global _warned_override
    if not _warned_override:
        _warned_override = True
        log.warning(
            "sparse_mla: rescale_threshold=%s forced on a forward that feeds a backward; the lazy "
            "rescale leaves a coherent bf16 gain error on peaked rows (0.0 is the training default)",
            threshold,
        )


def _log_capture(decision: Decision) -> None:
    """One INFO line per graph that records the decision: a trace with a proxy mode (AOTAutograd's
    training or inference graph, ``make_fx``, ``ExportedProgram.run_decompositions()``). When
    FakeTensors only propagate through the entry op (Dynamo, ``torch.export``), the op stays
    in that graph undecided: one DEBUG line, as for an eager call."""
    recorder = get_proxy_mode()
    ctx = torch._guards.TracingContext.try_get()
    if recorder is None:
        where = "eager call" if ctx is None else "FakeTensor propagation (the entry op stays in " \
            "this graph, decided when it is decomposed or run)"
        log.debug("sparse_mla %s: rescale_threshold=%s (%s)", where, decision.rescale_threshold,
                  decision.reason)
        return
    kind = "training graph" if decision.needs_backward else "inference graph"
    seen = _logged.setdefault(recorder if ctx is None else ctx, set())
    if decision not in seen:
        seen.add(decision)
        log.info(
            "sparse_mla capture: %s, rescale_threshold=%s (%s)",
            kind,
            decision.rescale_threshold,
            decision.reason,
            extra={"graph": kind, "rescale_threshold": decision.rescale_threshold, "reason": decision.reason},
        )
