"""The sparse-MLA ops in ``torch.ops.mla_inductor``: schemas, fake kernels, autograd wiring.

- ``sparse_mla(q, kv, indices, topk_length, q_positions, attn_sink, causal, sm_scale, d_v,
  rescale_threshold, return_max_logits) -> (out, lse, max_logits)``: the entry op,
  CompositeImplicitAutograd, in any layout of :mod:`mla_inductor.layout`. Dynamo
  keeps it as one node (its checks, :mod:`mla_inductor.validation`, raise while Dynamo
  propagates FakeTensors through it); AOTAutograd (and eager) decompose it, flattening the layout
  and resolving ``rescale_threshold=None`` through :mod:`mla_inductor.threshold_policy` while the training
  or the inference graph is traced, into
- ``sparse_mla_fwd(q, kv, indices, topk_length, q_positions, attn_sink, sm_scale, d_v,
  rescale_threshold, return_o_lo, return_max_logits) -> (out, lse, o_lo, max_logits)`` and its
  autograd partner
- ``sparse_mla_bwd(dout, dlse, q, kv, indices, topk_length, q_positions, attn_sink, out, lse, o_lo,
  sm_scale, d_v) -> (dq, dkv, d_sink)``.

Canonical layouts (the public :func:`mla_inductor.sparse_mla` converts to them): ``q [T, H, d_qk]``,
``kv [S, d_qk]``, ``indices [T, topk]`` int32, ``topk_length [T]`` int32 or None,
``q_positions [T]`` int32 or None (causal), ``attn_sink [H]`` float32 or None; outputs are
contiguous: ``out [T, H, d_v]`` (q's dtype), ``lse [T, H]`` float32 natural log (the sink
included), ``o_lo [T, H, d_v]`` in out's dtype or empty, ``max_logits [T, H]`` float32 or empty,
``dq`` like q, ``dkv [S, d_qk]`` in kv's dtype, ``d_sink [H]`` float32 or empty. ``out`` and
``lse`` are differentiable (in q, kv and attn_sink); ``o_lo`` and ``max_logits`` are not.

The bodies dispatch through :mod:`mla_inductor.backends`; this module holds no kernel code.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from .. import backends, layout, lowering, threshold_policy
from .registry import custom_op, entry_op
from ..validation import (
    check_backward_inputs,
    check_dlse,
    check_features,
    check_forward_inputs,
    check_no_forward_ad,
    check_no_func_transform,
    check_rescale_threshold,
    check_sm_scale,
    sink_in_float32,
)


def _dims(q: Tensor, kv: Tensor, d_v: int, **features: bool) -> tuple:
    """``(T, H, S, d_qk, d_v, features)`` for :func:`mla_inductor.backends.select`."""
    used = frozenset(name for name, on in features.items() if on)
    return q.shape[0], q.shape[1], kv.shape[0], q.shape[2], d_v, used


def _contiguous(t: Optional[Tensor]) -> Optional[Tensor]:
    return None if t is None else t.contiguous()


def _fwd_outputs(q, return_o_lo: bool, return_max_logits: bool, d_v: int):
    T, H = q.shape[0], q.shape[1]
    out = q.new_empty((T, H, d_v))
    lse = q.new_empty((T, H), dtype=torch.float32)
    o_lo = q.new_empty((T, H, d_v) if return_o_lo else (0,))
    max_logits = q.new_empty((T, H) if return_max_logits else (0,), dtype=torch.float32)
    return out, lse, o_lo, max_logits


@custom_op("sparse_mla_fwd")
def sparse_mla_fwd(
    q: Tensor,
    kv: Tensor,
    indices: Tensor,
    topk_length: Optional[Tensor],
    q_positions: Optional[Tensor],
    attn_sink: Optional[Tensor],
    sm_scale: float,
    d_v: int,
    rescale_threshold: float,
    return_o_lo: bool,
    return_max_logits: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Sparse-MLA forward on the backend :mod:`mla_inductor.backends` selects.

    ``q [T, H, d_qk]`` bf16/fp16 (fp32 on the reference backend), ``kv [S, d_qk]`` same dtype,
    ``indices [T, topk]`` int32 (< 0 or >= S: empty slot), ``topk_length [T]`` int32 or None,
    ``q_positions [T]`` int32 or None (causal: a slot whose index is past ``q_positions[t]`` is
    empty), ``attn_sink [H]`` float32 or None (one logit per head in the denominator),
    ``sm_scale`` (natural-log domain), ``d_v <= d_qk``, ``rescale_threshold`` in log2 units (0.0
    exact running max, > 0 lazy rescale; finite and below 15 for float16, 64 for bfloat16 and
    float32). Returns ``out [T, H, d_v]`` in q's dtype, ``lse [T, H]`` float32 natural log (the
    sink included; a row without a valid slot: out 0, lse = its sink or -inf), ``o_lo``:
    ``float32(O) - out`` rounded to q's dtype, ``[T, H, d_v]``, when ``return_o_lo``, else an
    empty tensor of q's dtype, and ``max_logits [T, H]`` float32 (the maximum valid score, -inf
    for none) when ``return_max_logits``, else an empty float32 tensor.

    Raises:
        RuntimeError: the input checks of :mod:`mla_inductor.validation`, the rescale_threshold
            included (the same messages from the fake kernel at trace time), forward-mode AD
            (at run time), or a forced backend that cannot run here.
    """
    check_forward_inputs(q, kv, indices, topk_length, d_v)
    check_features(q, q_positions, attn_sink)
    check_rescale_threshold(rescale_threshold, q.dtype)
    check_sm_scale(sm_scale)
    check_no_forward_ad(q, kv, attn_sink)
    dims = _dims(q, kv, d_v, causal=q_positions is not None, sink=attn_sink is not None,
                 max_logits=return_max_logits)
    backend = backends.select(q.device, q.dtype, "forward", dims)
    return backend.forward(
        q.contiguous(),
        kv.contiguous(),
        indices.contiguous(),
        _contiguous(topk_length),
        _contiguous(q_positions),
        _contiguous(attn_sink),
        sm_scale,
        d_v,
        rescale_threshold,
        return_o_lo,
        return_max_logits,
    )


@sparse_mla_fwd.register_fake
def _(q, kv, indices, topk_length, q_positions, attn_sink, sm_scale, d_v, rescale_threshold,
      return_o_lo, return_max_logits):
    check_forward_inputs(q, kv, indices, topk_length, d_v)
    check_features(q, q_positions, attn_sink)
    check_rescale_threshold(rescale_threshold, q.dtype)
    check_sm_scale(sm_scale)
    lowering.install()
    return _fwd_outputs(q, return_o_lo, return_max_logits, d_v)


@custom_op("sparse_mla_bwd")
def sparse_mla_bwd(
    dout: Tensor,
    dlse: Optional[Tensor],
    q: Tensor,
    kv: Tensor,
    indices: Tensor,
    topk_length: Optional[Tensor],
    q_positions: Optional[Tensor],
    attn_sink: Optional[Tensor],
    out: Tensor,
    lse: Tensor,
    o_lo: Tensor,
    sm_scale: float,
    d_v: int,
    deterministic: bool = False,
) -> tuple[Tensor, Tensor, Tensor]:
    """Sparse-MLA backward on the backend :mod:`mla_inductor.backends` selects.

    ``dout [T, H, d_v]`` in q's dtype, ``dlse [T, H]`` float32 or None (the gradient reaching
    lse); ``q``, ``kv``, ``indices``, ``topk_length``, ``q_positions``, ``attn_sink``,
    ``sm_scale``, ``d_v`` as for :func:`sparse_mla_fwd`; ``out``, ``lse``, ``o_lo`` that
    forward's outputs (``o_lo`` empty: dpsum from ``out`` alone). Returns ``dq [T, H, d_qk]`` in
    q's dtype, ``dkv [S, d_qk]`` in kv's dtype (empty slots contribute nothing and rows of kv
    that no valid slot references get exact zeros) and ``d_sink [H]`` float32 ``= -sum_t
    P_sink (dpsum - dlse)`` with a sink, else an empty float32 tensor.

    ``deterministic``: results bitwise identical from run to run (dkv accumulated in 64-bit
    fixed point on sm90; the reference and emulate backends run under PyTorch's deterministic
    mode). The autograd formula passes ``torch.are_deterministic_algorithms_enabled()`` as it
    is when the backward is traced, so under ``torch.compile`` the choice is made at capture
    (Dynamo guards on the mode: switching it recompiles).

    Raises:
        RuntimeError: the input checks of :mod:`mla_inductor.validation` (also from the fake
            kernel at trace time), a forced backend that cannot run here, or ``deterministic``
            on a backend without a deterministic backward (sm100; PyTorch's wording, a warning
            under ``warn_only=True``).
    """
    check_backward_inputs(dout, q, kv, indices, topk_length, out, lse, o_lo, d_v)
    check_features(q, q_positions, attn_sink)
    check_dlse(dlse, lse)
    check_sm_scale(sm_scale)
    dims = _dims(q, kv, d_v, causal=q_positions is not None, sink=attn_sink is not None,
                 dlse=dlse is not None)
    backend = backends.select(q.device, q.dtype, "backward", dims, deterministic=deterministic)
    dq, dkv, d_sink = backend.backward(
        dout.contiguous(),
        _contiguous(dlse),
        q.contiguous(),
        kv.contiguous(),
        indices.contiguous(),
        _contiguous(topk_length),
        _contiguous(q_positions),
        _contiguous(attn_sink),
        out.contiguous(),
        lse.contiguous(),
        o_lo.contiguous(),
        sm_scale,
        d_v,
        deterministic=deterministic,
    )
    return dq, dkv, q.new_empty(0, dtype=torch.float32) if d_sink is None else d_sink


@sparse_mla_bwd.register_fake
def _(dout, dlse, q, kv, indices, topk_length, q_positions, attn_sink, out, lse, o_lo, sm_scale,
      d_v, deterministic=False):
    check_backward_inputs(dout, q, kv, indices, topk_length, out, lse, o_lo, d_v)
    check_features(q, q_positions, attn_sink)
    check_dlse(dlse, lse)
    check_sm_scale(sm_scale)
    lowering.install()
    d_sink = q.new_empty((q.shape[1],) if attn_sink is not None else (0,), dtype=torch.float32)
    return q.new_empty(q.shape), kv.new_empty(kv.shape), d_sink


def _setup_context(ctx, inputs, output):
    q, kv, indices, topk_length, q_positions, attn_sink, sm_scale, d_v = inputs[:8]
    out, lse, o_lo, max_logits = output
    ctx.mark_non_differentiable(o_lo, max_logits)
    ctx.set_materialize_grads(False)  # an unused lse passes no dlse (the kernels' common case)
    ctx.save_for_backward(q, kv, indices, topk_length, q_positions, attn_sink, out, lse, o_lo)
    ctx.sm_scale = sm_scale
    ctx.d_v = d_v


def _placed_like(grad: Tensor, t: Tensor) -> Tensor:
    """A DTensor gradient redistributed to its input's placements: the sharding rules of
    :mod:`mla_inductor.distributed` leave dkv (and under token sharding d_sink) Partial(sum), and
    an input may have been redistributed to a rule (a kv sharded on tokens all-gathered); this sums
    or reshards the gradient back (reduce-scatters dkv for that kv). A plain tensor as it is."""
    mesh = getattr(t, "device_mesh", None)
    return grad if mesh is None else grad.redistribute(mesh, t.placements)


def _backward(ctx, dout, dlse, _do_lo, _dmax_logits):
    q, kv, indices, topk_length, q_positions, attn_sink, out, lse, o_lo = ctx.saved_tensors
    if dout is None:  # only lse was used
        dout = torch.zeros_like(out)
    dq, dkv, d_sink = sparse_mla_bwd(
        dout.contiguous(), None if dlse is None else dlse.contiguous(), q, kv, indices,
        topk_length, q_positions, attn_sink, out, lse, o_lo, ctx.sm_scale, ctx.d_v,
        torch.are_deterministic_algorithms_enabled(),
    )
    return (_placed_like(dq, q), _placed_like(dkv, kv), None, None, None,
            None if attn_sink is None else _placed_like(d_sink, attn_sink),
            None, None, None, None, None)


sparse_mla_fwd.register_autograd(_backward, setup_context=_setup_context)


# The entry op. Its CompositeImplicitAutograd body runs in eager and while AOTAutograd traces,
# which is where the threshold policy can see whether a backward graph exists. A given
# rescale_threshold reaches sparse_mla_fwd unchanged, whose checks (its fake at trace time, its
# body at run time) are the only ones on the op's path.
def _sparse_mla(q, kv, indices, topk_length, q_positions, attn_sink, causal, sm_scale, d_v,
                rescale_threshold, return_max_logits):
    check_no_func_transform()
    check_no_forward_ad(q, kv, attn_sink)
    attn_sink = sink_in_float32(attn_sink)
    flat = layout.flatten(q, kv, indices, topk_length, causal, q_positions)
    decision = threshold_policy.decide(q, kv, rescale_threshold, attn_sink)
    out, lse, _, max_logits = torch.ops.mla_inductor.sparse_mla_fwd(
        flat.q,
        flat.kv,
        flat.indices,
        flat.topk_length,
        flat.q_positions,
        attn_sink,
        sm_scale,
        d_v,
        decision.rescale_threshold,
        decision.needs_backward,
        return_max_logits,
    )
    return layout.unflatten(out, lse, max_logits, flat.batch)


entry_op(
    "sparse_mla(Tensor q, Tensor kv, Tensor indices, Tensor? topk_length, Tensor? q_positions, "
    "Tensor? attn_sink, bool causal, float sm_scale, SymInt d_v, float? rescale_threshold, "
    "bool return_max_logits) -> (Tensor, Tensor, Tensor)",
    _sparse_mla,
)
