"""The indexer loss's per-row KL: the ops ``torch.ops.mla_inductor.indexer_kl`` and
``indexer_kl_bwd`` (its autograd partner), and their fakes.

DSA's indexer loss (DeepSeek-AI, "DeepSeek-V3.2-Exp: Boosting Long-Context Efficiency with
DeepSeek Sparse Attention", 2025, section 2.1; :func:`mla_inductor.indexer_kl_loss`) is, per
row ``r`` of ``K`` slots with its valid set ``V_r``, ``KL(target_r || softmax_{V_r}(logits_r))``.

- ``indexer_kl(logits, target, indices, hi, length) -> (kl, lse, tsum, count)``: ``logits`` and
  ``target`` ``[R, K]`` float32, ``indices [R, K]`` int32, ``hi`` and ``length`` ``[R]`` int32;
  slot ``j`` of row ``r`` is valid iff ``0 <= indices[r, j] <= hi[r]`` and ``j < length[r]``
  (the caller folds ``kv_len``, the causal positions and ``topk_length`` into ``hi`` and
  ``length``). Returns ``[R]`` tensors: ``kl[r] = sum_{j in V_r, target != 0} t_j (log t_j -
  l_j + lse_r)`` float32 (0 for a row without a valid slot), ``lse[r] = log sum_{V_r} exp(l_j)``
  float32 (-inf for none), ``tsum[r] = sum_{V_r, t != 0} t_j`` float32 and ``count[r] = |V_r|``
  int32. Differentiable in ``logits`` through ``kl`` only; empty slots are never read for the
  value and get a zero gradient.
- ``indexer_kl_bwd(dkl, logits, target, indices, hi, length, lse, tsum) -> dlogits [R, K]``
  float32: ``dkl[r] (exp(l - lse[r]) tsum[r] - t)`` on the valid slots, 0 elsewhere.

Both are deterministic on every backend (fixed summation orders). Dispatch:
:func:`mla_inductor.backends.select` with the directions ``"indexer_kl"`` and
``"indexer_kl_bwd"`` (float32 tensors: the kernels' own dtype); the protocol functions are in
:mod:`mla_inductor.kernels`. This module holds no kernel code.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from .. import backends, lowering
from .registry import custom_op
from ..validation import require


def check_inputs(logits: Tensor, target: Tensor, indices: Tensor, hi: Tensor,
                 length: Tensor) -> None:
    """Checks the canonical inputs (shapes, dtypes, devices; never values).

    Raises:
        RuntimeError: starting ``indexer_kl:``, naming what does not match.
    """
    shapes = tuple(logits.shape), tuple(target.shape), tuple(indices.shape)
    require(logits.dim() == 2 and target.shape == logits.shape and indices.shape == logits.shape,
            lambda: f"indexer_kl: needs logits, target and indices [R, K] of one "
            f"shape, got {shapes[0]}, {shapes[1]}, {shapes[2]}")
    rows = (tuple(hi.shape), tuple(length.shape))
    require(hi.dim() == 1 and length.dim() == 1 and hi.shape[0] == logits.shape[0]
            and length.shape[0] == logits.shape[0],
            lambda: f"indexer_kl: needs hi and length [R] with R = logits.shape[0], "
            f"got {rows[0]}, {rows[1]}")
    dtypes = (logits.dtype, target.dtype, indices.dtype, hi.dtype, length.dtype)
    require(dtypes == (torch.float32, torch.float32, torch.int32, torch.int32, torch.int32),
            lambda: f"indexer_kl: takes float32 logits and target, int32 indices, hi "
            f"and length, got {', '.join(str(d) for d in dtypes)}")
    devices = {t.device for t in (logits, target, indices, hi, length)}
    require(len(devices) == 1, lambda: f"indexer_kl: got tensors on different "
                                       f"devices: {sorted(str(d) for d in devices)}")


@custom_op("indexer_kl")
def indexer_kl(logits: Tensor, target: Tensor, indices: Tensor, hi: Tensor,
               length: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(kl, lse, tsum, count)`` per row on the backend :mod:`mla_inductor.backends` selects
    (module docstring).

    Raises:
        RuntimeError: :func:`check_inputs` (also from the fake kernel at trace time), or a forced
            backend that cannot run here.
    """
    check_inputs(logits, target, indices, hi, length)
    backend = backends.select(logits.device, logits.dtype, "indexer_kl")
    return backend.indexer_kl(logits.contiguous(), target.contiguous(), indices.contiguous(),
                              hi.contiguous(), length.contiguous())


@indexer_kl.register_fake
def _(logits, target, indices, hi, length):
    check_inputs(logits, target, indices, hi, length)
    lowering.install()
    R = logits.shape[0]
    return (logits.new_empty(R), logits.new_empty(R), logits.new_empty(R),
            logits.new_empty(R, dtype=torch.int32))


@custom_op("indexer_kl_bwd")
def indexer_kl_bwd(dkl: Tensor, logits: Tensor, target: Tensor, indices: Tensor, hi: Tensor,
                   length: Tensor, lse: Tensor, tsum: Tensor) -> Tensor:
    """``dlogits [R, K]`` float32 on the backend :mod:`mla_inductor.backends` selects (module
    docstring).

    Raises:
        RuntimeError: :func:`check_inputs`, ``dkl``, ``lse`` or ``tsum`` not ``[R]`` float32 (also
            from the fake kernel at trace time), or a forced backend that cannot run here.
    """
    _check_rows(dkl, lse, tsum, logits)
    check_inputs(logits, target, indices, hi, length)
    backend = backends.select(logits.device, logits.dtype, "indexer_kl_bwd")
    return backend.indexer_kl_bwd(dkl.contiguous(), logits.contiguous(), target.contiguous(),
                                  indices.contiguous(), hi.contiguous(), length.contiguous(),
                                  lse.contiguous(), tsum.contiguous())


def _check_rows(dkl: Tensor, lse: Tensor, tsum: Tensor, logits: Tensor) -> None:
    for name, t in (("dkl", dkl), ("lse", lse), ("tsum", tsum)):
        shape, dtype = tuple(t.shape), t.dtype
        require(t.dim() == 1 and t.shape[0] == logits.shape[0] and dtype == torch.float32
                and t.device == logits.device,
                lambda: f"indexer_kl_bwd: needs {name} [R] float32 on logits' device, "
                f"got {dtype} {shape}")


@indexer_kl_bwd.register_fake
def _(dkl, logits, target, indices, hi, length, lse, tsum):
    _check_rows(dkl, lse, tsum, logits)
    check_inputs(logits, target, indices, hi, length)
    lowering.install()
    return logits.new_empty(logits.shape)


def _setup_context(ctx, inputs, output):
    logits, target, indices, hi, length = inputs
    _, lse, tsum, _ = output
    ctx.mark_non_differentiable(*output[1:])
    ctx.save_for_backward(logits, target, indices, hi, length, lse, tsum)


def _backward(ctx, dkl, *_):
    logits, target, indices, hi, length, lse, tsum = ctx.saved_tensors
    dlogits = indexer_kl_bwd(dkl.contiguous(), logits, target, indices, hi, length, lse, tsum)
    return dlogits, None, None, None, None


indexer_kl.register_autograd(_backward, setup_context=_setup_context)


# The public loss, :func:`mla_inductor.indexer_kl_loss`, checks its arguments here before it forms
# the op's rows. Plain raises, as for the other public functions' argument checks: the messages
# are formatted only on failure (sizes may be symbolic under ``torch.compile``).


def _loss_check(cond, message) -> None:
    if not cond:
        raise RuntimeError(f"indexer_kl_loss: {message()}")


def check_loss_inputs(indexer_logits: Tensor, target: Tensor, indices: Tensor) -> None:
    """Checks that ``indexer_logits``, ``target`` and ``indices`` share one shape ``[.., T,
    topk]`` and that ``indices`` is an integer tensor.

    Raises:
        RuntimeError: starting ``indexer_kl_loss:``.
    """
    _loss_check(
        indexer_logits.shape == target.shape and indices.shape == target.shape,
        lambda: f"indexer_logits, target and indices must have one shape [.., T, topk], got "
        f"{tuple(indexer_logits.shape)}, {tuple(target.shape)}, {tuple(indices.shape)}",
    )
    _loss_check(
        not indices.is_floating_point() and indices.dtype != torch.bool and indices.dim() >= 2,
        lambda: f"indices must be an integer tensor [.., T, topk], got {indices.dtype} "
        f"{tuple(indices.shape)}",
    )


def check_loss_lengths(indices: Tensor, causal: bool, topk_length: Optional[Tensor],
                       q_positions: Optional[Tensor]) -> None:
    """The checks and messages of :func:`mla_inductor.sparse_mla` for ``topk_length`` (``[T]``, batched
    ``[B, T]``: ``indices.shape[:-1]``; int32 or int64; on indices' device) and ``q_positions``
    (``[T]``, batched ``[B, T]`` or ``[T]``; an integer dtype; on indices' device), for
    :func:`mla_inductor.indexer_kl_loss`, whose broadcasting would otherwise accept ``[1]`` or ``[B, 1]``
    and turn a wrong length into torch's own error. Messages are formatted only on failure (the
    sizes may be symbolic under ``torch.compile``); and that ``q_positions`` comes with
    ``causal``.

    Raises:
        RuntimeError: starting ``indexer_kl_loss:``, naming what does not match.
    """
    _loss_check(causal or q_positions is None, lambda: "q_positions is only read with "
                "causal=True; pass causal=True or drop q_positions")
    lead = tuple(indices.shape[:-1])
    batched = len(lead) > 1
    if topk_length is not None:
        shape, dtype = tuple(topk_length.shape), topk_length.dtype
        if batched:
            _loss_check(shape == lead, lambda: f"batched topk_length must be [B, T] = "
                     f"{list(lead)}, got shape {shape}")
        else:
            _loss_check(shape == lead, lambda: f"topk_length must be [T] = {list(lead)}, got "
                     f"shape {shape}")
        _loss_check(dtype in (torch.int32, torch.int64), lambda: f"topk_length must be int32 (the "
                 f"sparse_mla API also takes int64), got {dtype}")
        _loss_check(topk_length.device == indices.device, lambda: f"topk_length on "
                 f"{topk_length.device}, indices on {indices.device}")
    if q_positions is not None:
        shape, dtype = tuple(q_positions.shape), q_positions.dtype
        if batched:
            _loss_check(shape == lead or shape == lead[-1:], lambda: f"batched q_positions must be "
                     f"[B, T] = {list(lead)} or [T], got shape {shape}")
        else:
            _loss_check(shape == lead, lambda: f"q_positions must be [T] = {list(lead)} (batched: "
                     f"[B, T]), got shape {shape}")
        _loss_check(not q_positions.is_floating_point() and not q_positions.is_complex()
                 and dtype != torch.bool,
                 lambda: f"q_positions must be an integer tensor (int32 or int64), got {dtype}")
        _loss_check(q_positions.device == indices.device, lambda: f"q_positions on "
                 f"{q_positions.device}, indices on {indices.device}")
