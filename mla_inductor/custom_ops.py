"""The sparse-MLA ops in ``torch.ops.mla_inductor``: schemas, fake kernels, autograd wiring.

- ``sparse_mla(q, kv, indices, topk_length, sm_scale, d_v, rescale_threshold) -> (out, lse)``:
  the entry op, CompositeImplicitAutograd, in any layout of :mod:`mla_inductor.layout`. Dynamo
  keeps it as one node (its checks, :mod:`mla_inductor.validation`, raise while Dynamo
  propagates FakeTensors through it); AOTAutograd (and eager) decompose it, flattening the layout
  and resolving ``rescale_threshold=None`` through :mod:`mla_inductor.policy` while the training
  or the inference graph is traced, into
- ``sparse_mla_fwd(q, kv, indices, topk_length, sm_scale, d_v, rescale_threshold, return_o_lo)
  -> (out, lse, o_lo)`` and its autograd partner
- ``sparse_mla_bwd(dout, q, kv, indices, topk_length, out, lse, o_lo, sm_scale, d_v) -> (dq, dkv)``.

Canonical layouts (the public :func:`mla_inductor.sparse_mla` converts to them): ``q [T, H, d_qk]``,
``kv [S, d_qk]``, ``indices [T, topk]`` int32, ``topk_length [T]`` int32 or None; outputs are
contiguous: ``out [T, H, d_v]`` (q's dtype), ``lse [T, H]`` float32 natural log,
``o_lo [T, H, d_v]`` in out's dtype or empty, ``dq`` like q, ``dkv [S, d_qk]`` in kv's dtype.
``lse`` and ``o_lo`` are not differentiable.

The bodies dispatch through :mod:`mla_inductor.backends`; this module holds no kernel code.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from . import backends, layout, lowering, policy
from .validation import (
    check_backward_inputs,
    check_forward_inputs,
    check_no_forward_ad,
    check_no_func_transform,
    check_rescale_threshold,
)

_LAYOUT = (torch.Tag.needs_contiguous_strides,)


def _dims(q: Tensor, kv: Tensor, d_v: int) -> tuple[int, int, int, int, int]:
    return q.shape[0], q.shape[1], kv.shape[0], q.shape[2], d_v


def _empty_o_lo(q: Tensor, return_o_lo: bool, d_v: int) -> Tensor:
    shape = (q.shape[0], q.shape[1], d_v) if return_o_lo else (0,)
    return q.new_empty(shape)


@torch.library.custom_op("mla_inductor::sparse_mla_fwd", mutates_args=(), tags=_LAYOUT)
def sparse_mla_fwd(
    q: Tensor,
    kv: Tensor,
    indices: Tensor,
    topk_length: Optional[Tensor],
    sm_scale: float,
    d_v: int,
    rescale_threshold: float,
    return_o_lo: bool,
) -> tuple[Tensor, Tensor, Tensor]:
    """Sparse-MLA forward on the backend :mod:`mla_inductor.backends` selects.

    ``q [T, H, d_qk]`` bf16/fp16 (fp32 on the reference backend), ``kv [S, d_qk]`` same dtype,
    ``indices [T, topk]`` int32 (< 0 or >= S: empty slot), ``topk_length [T]`` int32 or None,
    ``sm_scale`` (natural-log domain), ``d_v <= d_qk``, ``rescale_threshold`` in log2 units (0.0
    exact running max, > 0 lazy rescale; finite and below 15 for float16, 64 for bfloat16 and
    float32). Returns ``out [T, H, d_v]`` in q's dtype,
    ``lse [T, H]`` float32 natural log (-inf on rows without a valid slot) and ``o_lo``:
    ``float32(O) - out`` rounded to q's dtype, ``[T, H, d_v]``, when ``return_o_lo``, else an
    empty tensor of q's dtype.

    Raises:
        RuntimeError: the input checks of :mod:`mla_inductor.validation`, the rescale_threshold
            included (the same messages from the fake kernel at trace time), forward-mode AD
            (at run time), or a forced backend that cannot run here.
    """
    check_forward_inputs(q, kv, indices, topk_length, d_v)
    check_rescale_threshold(rescale_threshold, q.dtype)
    check_no_forward_ad(q, kv)
    backend = backends.select(q.device, q.dtype, "forward", _dims(q, kv, d_v))
    return backend.forward(
        q.contiguous(),
        kv.contiguous(),
        indices.contiguous(),
        None if topk_length is None else topk_length.contiguous(),
        sm_scale,
        d_v,
        rescale_threshold,
        return_o_lo,
    )


@sparse_mla_fwd.register_fake
def _(q, kv, indices, topk_length, sm_scale, d_v, rescale_threshold, return_o_lo):
    check_forward_inputs(q, kv, indices, topk_length, d_v)
    check_rescale_threshold(rescale_threshold, q.dtype)
    lowering.install()
    out = q.new_empty((q.shape[0], q.shape[1], d_v))
    lse = q.new_empty((q.shape[0], q.shape[1]), dtype=torch.float32)
    return out, lse, _empty_o_lo(q, return_o_lo, d_v)


@torch.library.custom_op("mla_inductor::sparse_mla_bwd", mutates_args=(), tags=_LAYOUT)
def sparse_mla_bwd(
    dout: Tensor,
    q: Tensor,
    kv: Tensor,
    indices: Tensor,
    topk_length: Optional[Tensor],
    out: Tensor,
    lse: Tensor,
    o_lo: Tensor,
    sm_scale: float,
    d_v: int,
) -> tuple[Tensor, Tensor]:
    """Sparse-MLA backward on the backend :mod:`mla_inductor.backends` selects.

    ``dout [T, H, d_v]`` in q's dtype; ``q``, ``kv``, ``indices``, ``topk_length``, ``sm_scale``,
    ``d_v`` as for :func:`sparse_mla_fwd`; ``out``, ``lse``, ``o_lo`` that forward's outputs
    (``o_lo`` empty: dpsum from ``out`` alone). Returns ``dq [T, H, d_qk]`` in q's dtype and
    ``dkv [S, d_qk]`` in kv's dtype; empty slots contribute nothing and rows of kv that no valid
    slot references get exact zeros.

    Raises:
        RuntimeError: the input checks of :mod:`mla_inductor.validation` (also from the fake
            kernel at trace time), or a forced backend that cannot run here.
    """
    check_backward_inputs(dout, q, kv, indices, topk_length, out, lse, o_lo, d_v)
    backend = backends.select(q.device, q.dtype, "backward", _dims(q, kv, d_v))
    return backend.backward(
        dout.contiguous(),
        q.contiguous(),
        kv.contiguous(),
        indices.contiguous(),
        None if topk_length is None else topk_length.contiguous(),
        out.contiguous(),
        lse.contiguous(),
        o_lo.contiguous(),
        sm_scale,
        d_v,
    )


@sparse_mla_bwd.register_fake
def _(dout, q, kv, indices, topk_length, out, lse, o_lo, sm_scale, d_v):
    check_backward_inputs(dout, q, kv, indices, topk_length, out, lse, o_lo, d_v)
    lowering.install()
    dq = q.new_empty(q.shape)
    dkv = kv.new_empty(kv.shape)
    return dq, dkv


def _setup_context(ctx, inputs, output):
    q, kv, indices, topk_length, sm_scale, d_v, _threshold, _return_o_lo = inputs
    out, lse, o_lo = output
    ctx.mark_non_differentiable(lse, o_lo)
    ctx.save_for_backward(q, kv, indices, topk_length, out, lse, o_lo)
    ctx.sm_scale = sm_scale
    ctx.d_v = d_v


def _backward(ctx, dout, _dlse, _do_lo):
    q, kv, indices, topk_length, out, lse, o_lo = ctx.saved_tensors
    dq, dkv = sparse_mla_bwd(
        dout.contiguous(), q, kv, indices, topk_length, out, lse, o_lo, ctx.sm_scale, ctx.d_v
    )
    return dq, dkv, None, None, None, None, None, None


sparse_mla_fwd.register_autograd(_backward, setup_context=_setup_context)


# The entry op. Its CompositeImplicitAutograd body runs in eager and while AOTAutograd traces,
# which is where the threshold policy can see whether a backward graph exists.
_lib = torch.library.Library("mla_inductor", "FRAGMENT")
_lib.define(
    "sparse_mla(Tensor q, Tensor kv, Tensor indices, Tensor? topk_length, float sm_scale, "
    "int d_v, float? rescale_threshold) -> (Tensor, Tensor)"
)


def _sparse_mla(q, kv, indices, topk_length, sm_scale, d_v, rescale_threshold):
    check_no_func_transform()
    check_no_forward_ad(q, kv)
    if rescale_threshold is not None:
        check_rescale_threshold(rescale_threshold, q.dtype)
    flat = layout.flatten(q, kv, indices, topk_length)
    decision = policy.decide(q, kv, rescale_threshold)
    out, lse, _ = torch.ops.mla_inductor.sparse_mla_fwd(
        flat.q,
        flat.kv,
        flat.indices,
        flat.topk_length,
        sm_scale,
        d_v,
        decision.rescale_threshold,
        decision.needs_backward,
    )
    return layout.unflatten(out, lse, flat.batch)


_lib.impl("sparse_mla", _sparse_mla, "CompositeImplicitAutograd")
