"""The lightning indexer: the op ``torch.ops.mla_inductor.lightning_indexer``, its fake, and its
entry op; and :func:`lightning_indexer_seen`, its selection under a dense mask (no op: the
reference's code, checked here).

DeepSeek-V3.2's lightning indexer (DeepSeek-AI, "DeepSeek-V3.2-Exp: Boosting Long-Context
Efficiency with DeepSeek Sparse Attention", 2025, section 2.1) picks the keys each query token
attends to: ``score[t, s] = sum_h weights[t, h] * relu(q[t, h] . k[s])`` over ``H`` index heads
(float32 accumulation), and the ``topk`` keys of largest score among those the token sees
(GLM-5 uses the same indexer).

``lightning_indexer(q, k, weights, q_positions, topk, q_scale=None, k_scale=None) -> (indices,
scores)`` in the canonical batched layout: ``q [B, T, H, D]`` bfloat16 / float16 (float32 on the
reference backend), ``k [B, S, D]`` of q's dtype, ``weights [B, T, H]`` float32, ``q_positions
[B, T]`` int32 or None (None: every key seen; else key ``s`` is seen by token ``t`` when ``s <=
q_positions[b, t]``), ``topk >= 0`` (a SymInt under compile); returns contiguous ``indices [B,
T, topk]`` int32 and ``scores [B, T, topk]`` float32. With q and k in float8_e4m3fn (the fp8
indexer of DeepSeek-V3.2-Exp's inference code), ``k_scale [B, S]`` float32 is required and
``q_scale [B, T, H]`` float32 optional (None: 1), and ``score[t, s] = sum_h weights[t, h] *
relu(q_scale[t, h] * k_scale[s] * (q[t, h] . k[s]))``, the dot of the fp8 values accumulated in
float32. Per row: the ``min(topk, keys seen)`` seen keys of largest
score, exact ties to the smaller key index, a NaN score above +inf (``-0.0`` ties ``+0.0``), in
ascending key index, then -1 (an empty slot of :func:`mla_inductor.sparse_mla`); ``scores`` holds
each slot's score, 0 on -1 slots. ``scores`` is differentiable in q, k and weights: its
backward is ``lightning_indexer_scores_bwd`` at the selected indices
(:mod:`.lightning_indexer_scores`: the same definition at the same slots), so that a training
loss on the indexer's logits (the KL loss of DeepSeek-V3.2's sparse stage) needs no second
scoring of its slots; the indices carry no gradient. With fp8 q and k the scores are
differentiable in weights, q_scale and k_scale, not in the fp8 q and k (their gradient is None):
the same backward on the float32 products ``q_scale * q`` and ``k_scale * k`` (``[B, T, H, D]``
and ``[B, S, D]`` float32 temporaries), then ``dq_scale[t, h] = sum_d dq[t, h, d] q[t, h, d]``
and ``dk_scale[s] = sum_d dk[s, d] k[s, d]``.

Its entry op ``lightning_indexer_entry(q, k, weights, q_positions, causal, topk, q_scale=None,
k_scale=None)`` takes the layouts of :func:`mla_inductor.lightning_indexer` (flat ``q [T, H,
D]``, ``k [S, D]`` or ``[S, 1, D]``, ``weights [T, H]``, ``q_scale [T, H]``, ``k_scale [S]``, or
batched with a leading ``B``) and forms the canonical inputs: int64
positions (``[T]`` shared by every batch element, or ``[B, T]``) clamped to ``[-1, S]`` and cast
to int32, and with ``causal`` and no positions the bottom-right default ``S - T + t`` (the rule
of :func:`mla_inductor.sparse_mla`). Dynamo keeps it as one node: its checks raise at trace
time on FakeTensors and its layout code lands in the traced graph. No step reads tensor data on
the host, so the op never synchronises and is CUDA-graph safe wherever the backend is.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from .. import backends, layout, lowering
from ..kernels import reference_lightning
from .registry import custom_op, entry_op
from .lightning_indexer_scores import lightning_indexer_scores_bwd
from ..validation import FP8, SUPPORTED_DTYPES, check_for


def _lightning_check(cond, message: str) -> None:
    check_for("lightning_indexer", cond, message)


def check_lightning_layout(
    q: Tensor,
    k: Tensor,
    weights: Tensor,
    causal: bool,
    q_positions: Optional[Tensor],
    q_scale: Optional[Tensor] = None,
    k_scale: Optional[Tensor] = None,
) -> None:
    """Checks the ranks of a :func:`mla_inductor.lightning_indexer` call before it is brought
    to the canonical layout: ``q [T, H, D]`` with ``k [S, D]`` or ``[S, 1, D]`` and ``weights
    [T, H]``; batched ``q [B, T, H, D]`` with ``k [B, S, D]`` or ``[B, S, 1, D]`` and ``weights
    [B, T, H]``; ``q_positions`` (only with ``causal``) an integer ``[T]`` or, batched, ``[B, T]``;
    with fp8 q and k, the scales' presence and shapes in the call's layout
    (:func:`check_lightning_scale_layout`). Sizes, dtypes and devices, the scales' among them,
    are checked on the canonical tensors (:func:`check_lightning_inputs`).

    Raises:
        RuntimeError: naming the layout expected and the shape found, or a missing k_scale.
    """
    _lightning_check(
        q.dim() in (3, 4),
        f"q must be [T, H, D] or batched [B, T, H, D], got shape {tuple(q.shape)}",
    )
    batched = q.dim() == 4
    k_ranks = (3, 4) if batched else (2, 3)
    k_layout = "[B, S, D] or [B, S, 1, D]" if batched else "[S, D] or [S, 1, D]"
    q_layout = "[B, T, H, D]" if batched else "[T, H, D]"
    _lightning_check(
        k.dim() in k_ranks and (k.dim() == k_ranks[0] or k.shape[-2] == 1),
        f"k must be {k_layout} with q {q_layout} (one key row per token, shared by all index "
        f"heads), got shape {tuple(k.shape)}",
    )
    _lightning_check(
        weights.dim() == q.dim() - 1,
        f"weights must be {'[B, T, H]' if batched else '[T, H]'} with q {q_layout}, got shape "
        f"{tuple(weights.shape)}",
    )
    _lightning_check(
        causal or q_positions is None,
        "q_positions is only read with causal=True (it gives each token's position for the "
        "causal rule); pass causal=True or drop q_positions",
    )
    if q_positions is not None:
        dtype = q_positions.dtype
        _lightning_check(
            not q_positions.is_floating_point() and not q_positions.is_complex()
            and dtype != torch.bool,
            f"q_positions must be an integer tensor (int32 or int64), got {dtype}",
        )
        T = q.shape[-3]
        ok = q_positions.dim() == 1 and q_positions.shape[0] == T
        if batched:
            ok = ok or (q_positions.dim() == 2 and q_positions.shape[0] == q.shape[0]
                        and q_positions.shape[1] == T)
        _lightning_check(
            ok,
            f"q_positions must be [T] = [{T}]"
            + (f" or [B, T] = [{q.shape[0]}, {T}]" if batched else "")
            + f", got shape {tuple(q_positions.shape)}",
        )
        _lightning_check(q_positions.device == q.device,
                         f"q_positions on {q_positions.device}, q on {q.device}")
    if q.dtype == FP8 and k.dtype == FP8:
        check_lightning_scale_layout(q, k, q_scale, k_scale)


def check_lightning_scale_layout(
    q: Tensor,
    k: Tensor,
    q_scale: Optional[Tensor],
    k_scale: Optional[Tensor],
    op: str = "lightning_indexer",
) -> None:
    """Checks, for float8_e4m3fn q and k, the scales in the layout of ``q [T, H, D]`` and ``k
    [S, D]`` or ``[S, 1, D]`` (batched: ``q [B, T, H, D]``, ``k [B, S, D]`` or ``[B, S, 1, D]``;
    the canonical layout is the batched one): ``k_scale`` given, ``[S]`` (batched ``[B, S]``),
    and ``q_scale``, if given, ``[T, H]`` (batched ``[B, T, H]``). The entry op checks these in
    the call's layout, so that the messages name it; :func:`check_lightning_scales` checks them
    with the rest on the canonical tensors. ``op`` names the function whose arguments these are
    (each message starts with it).

    Raises:
        RuntimeError: a missing ``k_scale`` or a scale of the wrong shape.
    """
    batched = q.dim() == 4
    check_for(
        op,
        k_scale is not None,
        f"{FP8} q and k need k_scale, float32 {'[B, S]' if batched else '[S]'}: one scale per "
        "key row (mla_inductor.quantize_fp8 returns it)",
    )
    lead = "[B, T, H]" if batched else "[T, H]"
    expected = {"q_scale": (lead, tuple(q.shape[:-1])),
                "k_scale": ("[B, S]" if batched else "[S]",
                            (k.shape[0], k.shape[1]) if batched else (k.shape[0],))}
    for name, scale in (("q_scale", q_scale), ("k_scale", k_scale)):
        if scale is None:
            continue
        layout, shape = expected[name]
        check_for(
            op,
            scale.dim() == len(shape) and all(a == b for a, b in zip(scale.shape, shape)),
            f"{name} must be {layout} = {list(shape)}, got shape {tuple(scale.shape)}",
        )


def check_lightning_scales(
    q: Tensor,
    k: Tensor,
    q_scale: Optional[Tensor],
    k_scale: Optional[Tensor],
    op: str = "lightning_indexer",
) -> None:
    """Checks the lightning indexer's fp8 scales against the canonical ``q [B, T, H, D]`` and
    ``k [B, S, D]``: q and k both float8_e4m3fn or neither; with fp8, ``k_scale [B, S]``
    required and ``q_scale [B, T, H]`` optional (:func:`check_lightning_scale_layout`), both
    float32 on q's device; without fp8, no scale. Ranks of q and k are checked before
    (:func:`check_lightning_inputs`). ``op`` names the function whose arguments these are (each
    message starts with it).

    Raises:
        RuntimeError: a mixed fp8 / non-fp8 pair, a missing ``k_scale``, a scale given with
            non-fp8 q and k, or a scale of the wrong shape, dtype or device.
    """
    fp8 = q.dtype == FP8
    check_for(
        op,
        fp8 == (k.dtype == FP8),
        f"q and k must both be {FP8} (with k_scale) or neither, got q {q.dtype} and k "
        f"{k.dtype}; quantize both with mla_inductor.quantize_fp8",
    )
    if not fp8:
        check_for(
            op,
            q_scale is None and k_scale is None,
            f"q_scale and k_scale are read only with {FP8} q and k, got q {q.dtype} with "
            + ("q_scale" if k_scale is None else "k_scale"),
        )
        return
    check_lightning_scale_layout(q, k, q_scale, k_scale, op)
    for name, scale in (("q_scale", q_scale), ("k_scale", k_scale)):
        if scale is None:
            continue
        check_for(op, scale.dtype == torch.float32, f"{name} must be float32, got {scale.dtype}")
        check_for(op, scale.device == q.device, f"{name} on {scale.device}, q on {q.device}")


def check_lightning_inputs(
    q: Tensor,
    k: Tensor,
    weights: Tensor,
    q_positions: Optional[Tensor],
    topk,
    q_scale: Optional[Tensor] = None,
    k_scale: Optional[Tensor] = None,
    op: str = "lightning_indexer",
) -> None:
    """Checks the canonical inputs of ``torch.ops.mla_inductor.lightning_indexer``: ``q [B, T,
    H, D]`` bfloat16 / float16 / float32 / float8_e4m3fn, ``k [B, S, D]`` of q's dtype,
    ``weights [B, T, H]`` float32, ``q_positions [B, T]`` int32 or None, ``topk >= 0`` (an int
    or a SymInt), with fp8 ``k_scale [B, S]`` and optionally ``q_scale [B, T, H]`` float32
    (:func:`check_lightning_scales`), all on q's device. ``op`` names the function whose
    arguments these are (each message starts with it; :func:`lightning_indexer_seen` takes the
    same inputs).

    Raises:
        RuntimeError: a wrong rank, size, dtype or device, a negative topk, or a scale's error.
    """
    check_for(op, q.dim() == 4, f"q must be [B, T, H, D], got shape {tuple(q.shape)}")
    check_for(op, k.dim() == 3, f"k must be [B, S, D], got shape {tuple(k.shape)}")
    check_for(
        op,
        weights.dim() == 3, f"weights must be [B, T, H], got shape {tuple(weights.shape)}"
    )
    check_for(
        op,
        q.dtype in SUPPORTED_DTYPES or q.dtype == FP8,
        f"q has unsupported dtype {q.dtype}; use bfloat16, float16, {FP8} with its scales (or "
        "float32 on the reference backend)",
    )
    check_lightning_scales(q, k, q_scale, k_scale, op)
    check_for(op, k.dtype == q.dtype, f"k dtype {k.dtype} differs from q dtype {q.dtype}")
    check_for(
        op,
        weights.dtype == torch.float32,
        f"weights must be float32 (the head weights, any scale folded in), got {weights.dtype}",
    )
    B, T, H, D = q.shape
    check_for(
        op,
        k.shape[0] == B and weights.shape[0] == B,
        f"batch size differs: q [B, T, H, D] has B={B}, k [B, S, D] has {k.shape[0]}, weights "
        f"[B, T, H] has {weights.shape[0]}",
    )
    check_for(
        op,
        k.shape[2] == D, f"mismatched D: q [.., H, D] has D={D}, k [.., S, D] has {k.shape[2]}"
    )
    check_for(
        op,
        weights.shape[1] == T and weights.shape[2] == H,
        f"weights must be [T, H] = [{T}, {H}] per batch element (q's tokens and index heads), "
        f"got shape {tuple(weights.shape[1:])}",
    )
    check_for(
        op,
        k.device == q.device and weights.device == q.device,
        f"tensors on different devices: q {q.device}, k {k.device}, weights {weights.device}",
    )
    check_for(op, topk >= 0, f"topk must be >= 0, got {topk}")
    if q_positions is not None:
        check_for(
            op,
            q_positions.dim() == 2 and q_positions.shape[0] == B and q_positions.shape[1] == T,
            f"q_positions must be [B, T] = [{B}, {T}], got shape {tuple(q_positions.shape)}",
        )
        check_for(
            op,
            q_positions.dtype == torch.int32,
            f"q_positions must be int32 (the lightning_indexer API also takes int64), got "
            f"{q_positions.dtype}",
        )
        check_for(op, q_positions.device == q.device,
                  f"q_positions on {q_positions.device}, q on {q.device}")


def _outputs(q: Tensor, topk):
    B, T = q.shape[0], q.shape[1]
    return (q.new_empty((B, T, topk), dtype=torch.int32),
            q.new_empty((B, T, topk), dtype=torch.float32))


@custom_op("lightning_indexer")
def lightning_indexer(
    q: Tensor,
    k: Tensor,
    weights: Tensor,
    q_positions: Optional[Tensor],
    topk: int,
    q_scale: Optional[Tensor] = None,
    k_scale: Optional[Tensor] = None,
) -> tuple[Tensor, Tensor]:
    """The lightning indexer's top-k on the backend :mod:`mla_inductor.backends` selects.

    Canonical layout, dtypes and selection rules: the module docstring. The scales reach the
    backend as the keywords ``q_scale`` and ``k_scale`` with fp8 q and k only (a backend takes
    them where its ``supports()`` accepts fp8), ``q_scale=None`` resolved here to ones ``[B, T,
    H]`` float32.

    Raises:
        RuntimeError: the checks of
            :func:`check_lightning_inputs` (also from the fake kernel
            at trace time), or a forced backend that cannot run here.
    """
    check_lightning_inputs(q, k, weights, q_positions, topk, q_scale, k_scale)
    features = frozenset(("causal",)) if q_positions is not None else frozenset()
    dims = (q.shape[1], q.shape[2], k.shape[1], q.shape[3], 0, features)
    backend = backends.select(q.device, q.dtype, "lightning_indexer", dims)
    scales = {}
    if q.dtype == FP8:
        if q_scale is None:  # no query scale: 1
            q_scale = q.new_ones(q.shape[:-1], dtype=torch.float32)
        scales = dict(q_scale=q_scale.contiguous(), k_scale=k_scale.contiguous())
    return backend.lightning_indexer(
        q.contiguous(), k.contiguous(), weights.contiguous(),
        None if q_positions is None else q_positions.contiguous(), topk, **scales,
    )


@lightning_indexer.register_fake
def _(q, k, weights, q_positions, topk, q_scale=None, k_scale=None):
    check_lightning_inputs(q, k, weights, q_positions, topk, q_scale, k_scale)
    lowering.install()
    return _outputs(q, topk)


def _setup_context(ctx, inputs, output):
    q, k, weights, _, _, q_scale, k_scale = inputs
    ctx.save_for_backward(q, k, weights, output[0], q_scale, k_scale)


def _scaled(x: Tensor, scale: Optional[Tensor]) -> Tensor:
    """fp8 ``x [.., D]`` as float32 times its per-row ``scale [..]`` (None: 1)."""
    return x.float() if scale is None else x.float() * scale.unsqueeze(-1)


def _backward(ctx, dindices, dscores):
    """The scores' gradients (module docstring); the mode of
    ``torch.use_deterministic_algorithms`` as the backward is traced picks the deterministic
    variant, as for
    :func:`mla_inductor.ops.lightning_indexer_scores.lightning_indexer_scores_bwd`."""
    del dindices  # integer outputs get no gradient
    q, k, weights, indices, q_scale, k_scale = ctx.saved_tensors
    deterministic = torch.are_deterministic_algorithms_enabled()
    if q.dtype != FP8:
        dq, dk, dweights = lightning_indexer_scores_bwd(
            dscores.contiguous(), q, k, weights, indices, deterministic)
        return dq, dk, dweights, None, None, None, None
    dq, dk, dweights = lightning_indexer_scores_bwd(
        dscores.contiguous(), _scaled(q, q_scale), _scaled(k, k_scale), weights, indices,
        deterministic)
    dq_scale = (dq * q.float()).sum(-1) if ctx.needs_input_grad[5] else None
    dk_scale = (dk * k.float()).sum(-1) if ctx.needs_input_grad[6] else None
    return None, None, dweights, None, None, dq_scale, dk_scale


lightning_indexer.register_autograd(_backward, setup_context=_setup_context)


def _positions(q_positions: Optional[Tensor], B, T, S, like: Tensor) -> Tensor:
    """``[B, T]`` int32 positions: the given ones (``[T]`` or ``[B, T]``) clamped to ``[-1, S]``
    (so that an int64 position cannot wrap in int32), else ``S - T + t`` (on ``like``'s mesh
    for a DTensor ``like``: :func:`mla_inductor.layout.token_positions`)."""
    return layout.token_positions(T, S, like, q_positions).expand(B, T).to(torch.int32)


def _lightning_indexer_entry(q, k, weights, q_positions, causal, topk, q_scale=None,
                             k_scale=None):
    check_lightning_layout(q, k, weights, causal, q_positions, q_scale, k_scale)
    batched = q.dim() == 4
    if k.dim() == q.dim():  # [S, 1, D] / [B, S, 1, D]
        k = k.squeeze(-2)
    if not batched:
        q, k, weights = q.unsqueeze(0), k.unsqueeze(0), weights.unsqueeze(0)
        q_scale, k_scale = (None if t is None else t.unsqueeze(0) for t in (q_scale, k_scale))
    positions = None
    if causal:
        positions = _positions(q_positions, q.shape[0], q.shape[1], k.shape[1], q)
    indices, scores = torch.ops.mla_inductor.lightning_indexer(q, k, weights, positions, topk,
                                                               q_scale, k_scale)
    if not batched:
        indices, scores = indices[0], scores[0]
    return indices, scores


entry_op(
    "lightning_indexer_entry(Tensor q, Tensor k, Tensor weights, Tensor? q_positions, "
    "bool causal, SymInt topk, Tensor? q_scale=None, Tensor? k_scale=None) -> (Tensor, Tensor)",
    _lightning_indexer_entry,
)


def lightning_indexer_seen(
    q: Tensor,
    k: Tensor,
    weights: Tensor,
    seen: Tensor,
    topk: int,
    q_scale: Optional[Tensor] = None,
    k_scale: Optional[Tensor] = None,
) -> Tensor:
    """The lightning indexer's selection under a dense visibility (the reference's arithmetic
    and selection on any device; no kernel takes a dense mask): the inputs of
    ``torch.ops.mla_inductor.lightning_indexer`` (:func:`check_lightning_inputs`) without
    positions, and ``seen [B or 1, T, S]`` bool on q's device (True: token ``t`` sees key
    ``s``). Returns ``indices [B, T, topk]`` int32, selected as the op selects (module
    docstring), in the reference's chunks of rows.

    Raises:
        RuntimeError (every message starts ``lightning_indexer_seen:``): the checks of
            :func:`check_lightning_inputs`; ``seen`` not bool, of another shape or on another
            device.
    """
    op = "lightning_indexer_seen"
    check_lightning_inputs(q, k, weights, None, topk, q_scale, k_scale, op)
    B, T, S = q.shape[0], q.shape[1], k.shape[1]
    check_for(op, seen.dtype == torch.bool,
              f"seen must be bool (True: the token sees the key), got {seen.dtype}")
    check_for(
        op,
        seen.dim() == 3 and (seen.shape[0] == 1 or seen.shape[0] == B) and seen.shape[1] == T
        and seen.shape[2] == S,
        f"seen must be [B or 1, T, S] = [{B} or 1, {T}, {S}], got shape {tuple(seen.shape)}",
    )
    check_for(op, seen.device == q.device, f"seen on {seen.device}, q on {q.device}")
    return reference_lightning.lightning_indexer_seen(q, k, weights, seen, topk, q_scale,
                                                      k_scale)[0]
