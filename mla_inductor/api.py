"""The public entry points: :func:`sparse_mla` (argument types in, the entry op, outputs out), and
the indexer's training signal, :func:`indexer_target` and :func:`indexer_kl_loss`, the
indexer's selection, :func:`lightning_indexer` (:func:`lightning_indexer_seen` under a dense
mask), and its differentiable scores of the selected keys, :func:`lightning_indexer_scores`."""

from __future__ import annotations

import math
import numbers
from typing import Optional

import torch
from torch import Tensor

from . import custom_ops  # noqa: F401  (defines every op of torch.ops.mla_inductor)
from . import layout
from .ops import lightning_indexer as ops_lightning_indexer
from .ops.indexer_kl import check_loss_inputs, check_loss_lengths


def _require(cond: bool, message, op: str = "sparse_mla") -> None:
    """A check of the Python argument types, which the op's schema needs before it can be called
    (a plain raise; under torch.compile Dynamo reports it as an observed exception). Layouts,
    shapes and dtypes are checked by the entry op (:mod:`mla_inductor.validation`), whose
    messages end the second line of Dynamo's error at trace time (docs/api.md, "What a compiled
    caller sees"). ``message`` is a string or, where it formats
    a value that may be symbolic under ``torch.compile`` (a size, a Python int argument), a
    function returning one, called only on failure (Dynamo cannot trace the formatting of a
    symbolic value, and must not see a size turned into a constant). ``op`` prefixes the
    message: the public function's name."""
    if not cond:
        raise RuntimeError(f"{op}: {message if isinstance(message, str) else message()}")


def _number(name: str, value, integral: bool = False, op: str = "sparse_mla"):
    """``value`` as the Python number the op's schema takes (``int`` if ``integral``, else
    ``float``); a Python ``int`` (``float``) and torch's symbolic numbers pass through unchanged,
    so that a size that ``torch.compile`` traces as a symbol (a Python int argument under
    ``dynamic=True``, ``kv.shape[0]`` of a dynamic dimension) stays symbolic: one graph for every
    value, no specialisation. Under Dynamo such a symbol is seen as an ``int`` (not a
    ``torch.SymInt``), so it is neither cast nor formatted here. A tensor, even a 0-d one, is
    refused in eager and compiled code alike: under torch.compile its value is not known while
    tracing, and the op needs it then (it is a compile-time constant of the kernels)."""
    kind = "int" if integral else "float"
    if isinstance(value, Tensor):
        raise RuntimeError(
            f"{op}: {name} must be a Python {kind}, got a {value.dim()}-d tensor; pass "
            f"{name}={kind}(t) (or t.item()) outside the compiled region"
        )
    if isinstance(value, (torch.SymInt, torch.SymFloat)):
        return value
    ok = isinstance(value, numbers.Integral if integral else numbers.Real)
    _require(ok and not isinstance(value, bool),
             lambda: f"{name} must be a Python {kind}, got {value!r}", op)
    if isinstance(value, int if integral else float):
        return value
    return int(value) if integral else float(value)


def sparse_mla(
    q: Tensor,
    kv: Tensor,
    indices: Tensor,
    *,
    sm_scale: Optional[float] = None,
    d_v: int = 512,
    topk_length: Optional[Tensor] = None,
    causal: bool = False,
    q_positions: Optional[Tensor] = None,
    attn_sink: Optional[Tensor] = None,
    rescale_threshold: Optional[float] = None,
    return_lse: bool = False,
    return_max_logits: bool = False,
):
    """Sparse MLA attention (DeepSeek Sparse Attention, absorbed MLA form, MQA).

    For each token ``t`` and head ``h``: ``softmax_j(sm_scale * q[t, h] . kv[indices[t, j], :d_qk])``
    applied to the values ``kv[indices[t, j], :d_v]`` (key and value share the latent row).

    Args:
        q: ``[T, H, d_qk]`` or batched ``[B, T, H, d_qk]``; bfloat16 or float16 (float32 on the
            reference backend).
        kv: ``[S, d_qk]`` or ``[S, 1, d_qk]``; batched ``[B, S, d_qk]`` or ``[B, S, 1, d_qk]``.
            Same dtype as q.
        indices: ``[T, topk]`` or ``[T, 1, topk]``; batched ``[B, T, topk]`` with indices local to
            each batch element. int32 (int64 accepted). An index < 0 or >= S is an empty slot:
            never read, contributes nothing. Duplicates count once per occurrence. ``topk`` may
            be 0: every row is one without a valid slot.
        sm_scale: softmax scale, a Python float (not a tensor); defaults to ``d_qk ** -0.5``.
        d_v: value width, a Python int ``<= d_qk``; default 512 (DeepSeek V3.2, d_qk = 576).
        topk_length: optional int32 ``[T]`` (batched ``[B, T]``; int64 accepted); slots at
            positions ``>= topk_length[t]`` are empty (whatever their index).
        causal: a slot whose index is greater than the query's own position is empty (the
            indexers of DeepSeek-V3.2 and GLM-5 return future keys for early tokens; their
            attention drops them with a causal mask). Masked inside the kernels.
        q_positions: with ``causal``: each token's position, int32 or int64 ``[T]`` (batched
            ``[B, T]`` or ``[T]``), in the same coordinates as the indices (for packed sequences
            with global indices). Default: ``S - T + t`` within each batch element
            (bottom-right aligned, as flash-attn's causal mask when T <= S).
        attn_sink: optional ``[H]``, float32, bfloat16 or float16 (a learnable parameter in
            practice, in the model's dtype; the softmax runs in float32): one logit per
            head, natural-log units like ``sm_scale * q.k``, that joins the softmax denominator
            and has no value: ``P_j = exp(s_j - lse)``, ``lse = log(exp(sink_h) + sum_j
            exp(s_j))``. Its gradient ``-sum_t exp(sink_h - lse) * (dpsum - dlse)`` flows when it
            requires grad. The definition of FlashMLA's and cuDNN's ``attn_sink``.
        rescale_threshold: online-softmax lazy-rescale threshold in log2 units, a Python float:
            finite, ``>= 0`` and below 15 for float16, 64 for bfloat16 / float32. ``None`` (the
            default) lets :mod:`mla_inductor.threshold_policy` decide at graph capture: 0.0 (exact running
            max) when a backward consumes the forward, 8.0 otherwise.
        return_lse: also return the log-sum-exp (differentiable: a gradient through it, e.g.
            from merging partial attention results, reaches q, kv and the sink).
        return_max_logits: also return ``max_logits [.., T, H]`` float32: the maximum of
            ``sm_scale * q.k`` over each row's valid slots (natural-log units, the sink not
            included, -inf for a row with none), the true maximum also under the lazy rescale
            (QK-clip / MuonClip need it). Not differentiable.

    Returns:
        ``out [.., T, H, d_v]`` in q's dtype; or a tuple ``(out, lse)``, ``(out, max_logits)`` or
        ``(out, lse, max_logits)`` in that order, as asked for: ``lse [.., T, H]`` float32, the
        natural log of the softmax denominator (the sink included). A row with no valid slot
        gives ``out = 0``, ``lse`` = its head's sink (``-inf`` without a sink) and zero
        gradients for q and kv. A NaN or inf in
        q, or in a kv row that a valid slot names, gives NaN ``out`` (and NaN ``lse`` where a
        score is NaN or +inf) on the rows it reaches; rows of kv that no valid slot names are
        never read.

    Raises:
        RuntimeError (every message starts ``sparse_mla:``): q, kv or indices not a tensor;
            sm_scale, d_v or rescale_threshold not a Python number (a tensor, also 0-d, is
            refused); wrong ranks, a batched layout whose sizes do not match (the message gives
            the expected layout and the sizes found), mismatched d_qk, ``d_v > d_qk``, a T or
            head mismatch between q and indices, a ``topk_length`` that is not ``[T]``
            (``[B, T]``), non-integer indices, mixed devices or an unsupported dtype;
            ``q_positions`` without ``causal``, of a non-integer dtype or not ``[T]``
            (``[B, T]`` or ``[T]`` batched); an ``attn_sink`` that is not ``[H]`` of float32, bfloat16 or float16; a
            rescale_threshold that is not finite, negative or too large for the dtype (all of
            these also at trace time under ``torch.compile``); forward-mode AD or a ``torch.func``
            transform that differentiates (only reverse mode is implemented; ``vmap`` works); a
            forced backend that cannot run here.
    """
    for name, t in (("q", q), ("kv", kv), ("indices", indices)):
        _require(isinstance(t, Tensor), f"{name} must be a torch.Tensor, got {type(t).__name__}")
    for name, t in (("topk_length", topk_length), ("q_positions", q_positions),
                    ("attn_sink", attn_sink)):
        _require(t is None or isinstance(t, Tensor),
                 f"{name} must be a torch.Tensor or None, got {type(t).__name__}")
    sm_scale = _sm_scale(q, sm_scale)
    if rescale_threshold is not None:
        rescale_threshold = _number("rescale_threshold", rescale_threshold)
    out, lse, max_logits = torch.ops.mla_inductor.sparse_mla(
        q, kv, indices, topk_length, q_positions, attn_sink, _flag("causal", causal), sm_scale,
        _number("d_v", d_v, integral=True), rescale_threshold,
        _flag("return_max_logits", return_max_logits),
    )
    return_lse, return_max_logits = _flag("return_lse", return_lse), bool(return_max_logits)
    extra = ((lse,) if return_lse else ()) + ((max_logits,) if return_max_logits else ())
    return (out, *extra) if extra else out


def _sm_scale(q: Tensor, sm_scale, op: str = "sparse_mla") -> float:
    """sm_scale as a Python float (``d_qk ** -0.5`` for None); refuses a tensor and a non-number.
    NaN and inf are refused by the op (:func:`mla_inductor.validation.check_sm_scale`), where the
    value is known under ``torch.compile`` too."""
    if sm_scale is None:
        return (q.shape[-1] if q.dim() else 1) ** -0.5
    return _number("sm_scale", sm_scale, op=op)


def _flag(name: str, value, op: str = "sparse_mla") -> bool:
    """``value`` as the Python bool the op's schema takes. A tensor, even a 0-d one, is refused
    in eager and compiled code alike (as for sm_scale): under torch.compile its value is not
    known while tracing, and it decides what the op computes."""
    if isinstance(value, Tensor):
        raise RuntimeError(
            f"{op}: {name} must be a Python bool, got a {value.dim()}-d tensor; pass "
            f"{name}=bool(t) (or t.item()) outside the compiled region"
        )
    return bool(value)


def indexer_target(
    q: Tensor,
    kv: Tensor,
    indices: Tensor,
    lse: Tensor,
    *,
    sm_scale: Optional[float] = None,
    topk_length: Optional[Tensor] = None,
    causal: bool = False,
    q_positions: Optional[Tensor] = None,
    attn_sink: Optional[Tensor] = None,
) -> Tensor:
    """The target of DSA's indexer loss: the main attention's probability of each selected slot,
    summed over heads and L1-normalised over the token's valid slots.

    ``target[t, j] = w[t, j] / sum_{valid i} w[t, i]``, ``w[t, j] = sum_h exp(sm_scale *
    q[t, h] . kv[indices[t, j], :d_qk] - lse[t, h])``: DeepSeek-V3.2's sparse training stage
    trains the indexer towards it with ``KL(target || softmax(indexer logits over the selected
    set))`` (DeepSeek-V3.2-Exp technical report, section 2.1; :func:`indexer_kl_loss`). The op
    reads the ``lse`` that :func:`sparse_mla` returned for the same inputs (no second softmax
    pass), and never forms a ``[T, H, topk]`` tensor of the whole problem.

    Args:
        q, kv, indices, sm_scale, topk_length, causal, q_positions, attn_sink: as for
            :func:`sparse_mla`, the same values as the call that returned ``lse`` (batched or
            unbatched layouts alike; int64 indices accepted).
        lse: ``[T, H]`` (batched ``[B, T, H]``) float32, ``sparse_mla(..., return_lse=True)``'s
            lse for these inputs (the sink included, so the sink's mass is left out of ``w``).

    Tensors that require grad are fine: the target is a constant of the indexer loss, computed
    from detached inputs, and carries no gradient.

    Returns:
        ``target [T, topk]`` (batched ``[B, T, topk]``) float32: rows sum to 1 over their valid
        slots; empty slots (the rules of :func:`sparse_mla`: an index < 0 or >= S, a position
        >= ``topk_length[t]``, with ``causal`` an index past the token's position) are exactly 0;
        a row with no valid slot is all 0. Duplicated indices get one entry per slot, each with
        the probability the attention gives it. A NaN in q, in a named kv row or in lse gives NaN
        on that row's valid slots.

    Raises:
        RuntimeError (every message starts ``indexer_target:``): the layout, shape, dtype and device
            checks of :func:`sparse_mla`, q without a head (``H = 0``), an lse that is not
            float32 ``[T, H]`` (``[B, T, H]``), sm_scale not a Python number; also at trace time
            under ``torch.compile``. On a CUDA device without a kernel for it (not Hopper, or
            beyond the sm90 kernel's limits) the target runs on the PyTorch reference, with a
            warning.
    """
    op = "indexer_target"
    for name, t in (("q", q), ("kv", kv), ("indices", indices), ("lse", lse)):
        _require(isinstance(t, Tensor), f"{name} must be a torch.Tensor, got {type(t).__name__}",
                 op=op)
    for name, t in (("topk_length", topk_length), ("q_positions", q_positions),
                    ("attn_sink", attn_sink)):
        _require(t is None or isinstance(t, Tensor),
                 f"{name} must be a torch.Tensor or None, got {type(t).__name__}", op=op)
    return torch.ops.mla_inductor.indexer_target_entry(
        q, kv, indices, lse, topk_length, q_positions, attn_sink, _flag("causal", causal, op=op),
        _sm_scale(q, sm_scale, op=op),
    )


def indexer_kl_loss(
    indexer_logits: Tensor,
    target: Tensor,
    indices: Tensor,
    *,
    kv_len: int,
    topk_length: Optional[Tensor] = None,
    causal: bool = False,
    q_positions: Optional[Tensor] = None,
) -> Tensor:
    """DSA's indexer loss: ``KL(target || softmax(indexer_logits))`` over each token's valid
    slots, averaged over the tokens that have one (DeepSeek-V3.2-Exp technical report, section
    2.1, sparse training stage).

    Per token ``t`` with valid slots ``V_t``: ``sum_{j in V_t} target[t, j] * (log target[t, j] -
    log_softmax_{V_t}(indexer_logits[t])[j])``, ``0 * log 0 = 0`` (for the target's 0
    and for a softmax of 0, a logit of -inf, alike). Validity follows the rules of
    :func:`sparse_mla` from ``indices``, ``kv_len``, ``topk_length``, ``causal`` and
    ``q_positions`` (pass the values of the :func:`indexer_target` call), not from the target,
    whose valid slots can be 0. Empty slots and rows without a valid slot contribute nothing and
    get a zero gradient, whatever their logits (NaN and inf included). Computed by the op
    ``indexer_kl`` (:mod:`mla_inductor.ops.indexer_kl`: one pass over the slots per direction on
    SM90, the per-row sums in a fixed order, so the loss and its gradient are bitwise the same in
    every run on every backend).

    Args:
        indexer_logits: ``[.., T, topk]`` the indexer's scores of the selected slots, any float
            dtype (computed in float32); the only input the gradient reaches.
        target: ``[.., T, topk]`` float, :func:`indexer_target`'s (detached here).
        indices: ``[.., T, topk]`` the selected indices (local to each batch element).
        kv_len: keys per batch element (S of kv), a Python int.
        topk_length, causal, q_positions: as for :func:`sparse_mla`.

    Returns:
        a 0-d float32 tensor: the sum of the per-token KLs over the number of tokens with at
        least one valid slot (0 when there is none).

    Raises:
        RuntimeError (messages start ``indexer_kl_loss:``): shapes of logits, target and indices
        that differ, non-integer indices, kv_len not a Python int, a ``topk_length`` or
        ``q_positions`` that :func:`sparse_mla` refuses (not ``[T]`` / ``[B, T]``, also a
        broadcastable ``[1]`` or ``[B, 1]``; a wrong dtype or device), all also at trace time.
    """
    op = "indexer_kl_loss"
    for name, t in (("indexer_logits", indexer_logits), ("target", target), ("indices", indices)):
        _require(isinstance(t, Tensor), f"{name} must be a torch.Tensor, got {type(t).__name__}",
                 op=op)
    check_loss_inputs(indexer_logits, target, indices)
    kv_len = _number("kv_len", kv_len, integral=True, op=op)
    causal = _flag("causal", causal, op=op)
    check_loss_lengths(indices, causal, topk_length, q_positions)
    lead, K = indices.shape[:-1], indices.shape[-1]
    rows = math.prod(lead)  # symbolic under export (torch.Size.numel() specialises)
    # each row's valid slots as the op takes them: 0 <= index <= hi[r] and slot < length[r]
    if causal:
        positions = layout.token_positions(indices.shape[-2], kv_len, indices, q_positions)
        hi = positions.clamp_max(kv_len - 1).expand(lead)
    else:
        hi = indices.new_full(lead, kv_len - 1, dtype=torch.int32)
    if topk_length is None:
        length = indices.new_full(lead, K, dtype=torch.int32)
    else:
        length = topk_length.to(torch.int64).clamp(0, K).expand(lead)
    if indices.dtype != torch.int32:
        indices = layout.int32_indices(indices, kv_len)
    kl, _, _, count = torch.ops.mla_inductor.indexer_kl(
        indexer_logits.float().reshape(rows, K), target.detach().float().reshape(rows, K),
        indices.reshape(rows, K), hi.reshape(rows).to(torch.int32),
        length.reshape(rows).to(torch.int32))
    return kl.sum() / (count > 0).sum().clamp_min(1)


def _lightning_arguments(op: str, tensors: dict, optional: dict, topk):
    """The Python argument types of a lightning-indexer function ``op``: ``tensors`` (name:
    value) tensors, ``optional`` tensors or None, ``topk`` a Python int (a SymInt under
    ``torch.compile``). Returns ``topk`` as an ``int`` (a symbolic size stays symbolic).

    Raises:
        RuntimeError: ``"<op>: ..."`` for a wrong type (a bool, float or tensor topk, also 0-d).
    """
    for name, t in tensors.items():
        _require(isinstance(t, Tensor), f"{name} must be a torch.Tensor, got {type(t).__name__}",
                 op=op)
    for name, t in optional.items():
        _require(t is None or isinstance(t, Tensor),
                 f"{name} must be a torch.Tensor or None, got {type(t).__name__}", op=op)
    if isinstance(topk, Tensor):
        _require(False, f"topk must be a Python int, got a {topk.dim()}-d tensor; pass "
                 "topk=int(t) outside the compiled region", op=op)
    if isinstance(topk, bool) or not isinstance(topk, (numbers.Integral, torch.SymInt)):
        _require(False, f"topk must be a Python int, got {topk!r}", op=op)
    if not isinstance(topk, (int, torch.SymInt)):
        topk = int(topk)  # e.g. a NumPy integer; a symbolic size stays symbolic
    return topk


def lightning_indexer(
    q: Tensor,
    k: Tensor,
    weights: Tensor,
    topk: int,
    *,
    causal: bool = False,
    q_positions: Optional[Tensor] = None,
    return_scores: bool = False,
    q_scale: Optional[Tensor] = None,
    k_scale: Optional[Tensor] = None,
):
    """DeepSeek-V3.2's lightning indexer: the ``topk`` keys of largest indexer score per token.

    ``score[t, s] = sum_h weights[t, h] * relu(q[t, h] . k[s])`` over the index heads ``h``
    (float32 accumulation; DeepSeek-V3.2-Exp technical report, section 2.1; GLM-5's indexer is
    the same). In fp8, as DeepSeek-V3.2-Exp's inference code runs it (q and k quantized to
    e4m3 with one scale per row by its ``act_quant``; DeepGEMM's fp8 MQA logits): ``score[t, s]
    = sum_h weights[t, h] * relu(q_scale[t, h] * k_scale[s] * (q[t, h] . k[s]))``, the dot of
    the fp8 values accumulated in float32 (:func:`quantize_fp8` gives the values and scales). Each token keeps the ``min(topk, n_seen)`` keys of largest score among the
    ``n_seen`` it sees; on an exact tie the smaller key index wins (``-0.0`` ties ``+0.0``), and a
    NaN score ranks above +inf (so a diverged indexer shows in its selection, which stays
    deterministic). The selection is a deterministic function of the inputs, computed without a
    host synchronisation (compiled code and CUDA graphs alike).

    Args:
        q: ``[T, H, D]`` or batched ``[B, T, H, D]`` index queries (``H`` index heads);
            bfloat16, float16 or float8_e4m3fn (float32 on the reference backend).
        k: ``[S, D]`` or ``[S, 1, D]``; batched ``[B, S, D]`` or ``[B, S, 1, D]``, each batch
            element its own keys. q's dtype (fp8 with fp8 only).
        weights: ``[T, H]`` (batched ``[B, T, H]``) float32 head weights, any scale folded in
            (DeepSeek-V3.2: ``weights_proj(x) * H**-0.5 * softmax_scale``).
        topk: a Python int ``>= 0`` (a SymInt under ``torch.compile``; not a tensor).
        causal: token ``t`` sees key ``s`` only if ``s <= pos[t]``: ``pos`` = ``q_positions``,
            else ``S - T + t`` (bottom-right aligned, the rule of :func:`sparse_mla`). Without
            it every token sees every key.
        q_positions: with ``causal``: int32 or int64 ``[T]`` (batched ``[B, T]``, or ``[T]``
            for every batch element), each token's position in key coordinates; values below 0
            see no key, values ``>= S`` every key.
        return_scores: also return each slot's score.
        q_scale: only with float8_e4m3fn q and k: ``[T, H]`` (batched ``[B, T, H]``) float32,
            the dequantisation scale of each query row (``x ≈ x_fp8 * scale``); None: 1.
        k_scale: required with float8_e4m3fn q and k, refused otherwise: ``[S]`` (batched
            ``[B, S]``) float32, the scale of each key row.

    Returns:
        ``indices [.., T, topk]`` int32: per row the selected keys in ASCENDING key index (not
        by score), then -1 in the remaining slots (a row that sees fewer than ``topk`` keys,
        and every slot past ``S`` when ``topk > S``); -1 is an empty slot for
        :func:`sparse_mla` and :func:`indexer_target`. Batched indices are local to their batch
        element, in ``[0, S)``. With ``return_scores``, ``(indices, scores)``: ``scores [.., T,
        topk]`` float32, each slot's score (the definition's float32 value), 0 on -1 slots,
        differentiable in q, k and weights (the backward of :func:`lightning_indexer_scores` at
        these indices: a loss on the selected keys' logits needs no second scoring; while
        ``scores`` is alive with a graph, q, k, weights and the indices are kept for it). The
        indices carry no gradient. In fp8 the scores are the fp8 definition's float32 values,
        differentiable in weights, q_scale and k_scale (the same backward on the float32
        ``q_scale * q`` and ``k_scale * k``; fp8 q and k get no gradient: None).

    Raises:
        RuntimeError (every message starts ``lightning_indexer:``): q, k, weights not tensors,
            q_positions not a tensor or None, topk not a Python int (a bool, float or tensor,
            also 0-d) or negative; ranks of q, k, weights that match no layout above, a batch,
            token, head or D mismatch, an unsupported dtype of q, k not of q's dtype, weights
            not float32, tensors on different devices; q_positions without ``causal``, of a
            non-integer dtype or a wrong shape; one of q and k in fp8 and not the other, fp8
            without k_scale, a scale with non-fp8 q and k, a scale of the wrong shape, not
            float32 or on another device (all of these also at trace time under
            ``torch.compile``); a forced backend that cannot run here (sm90: D other than 128
            or more than 64 heads, fp8 included). On a CUDA device without a kernel for the
            problem the reference runs, with a warning.
    """
    topk = _lightning_arguments("lightning_indexer", dict(q=q, k=k, weights=weights),
                                dict(q_positions=q_positions, q_scale=q_scale, k_scale=k_scale),
                                topk)
    indices, scores = torch.ops.mla_inductor.lightning_indexer_entry(
        q, k, weights, q_positions, bool(causal), topk, q_scale, k_scale
    )
    return (indices, scores) if return_scores else indices


def lightning_indexer_seen(
    q: Tensor,
    k: Tensor,
    weights: Tensor,
    seen: Tensor,
    topk: int,
    *,
    q_scale: Optional[Tensor] = None,
    k_scale: Optional[Tensor] = None,
) -> Tensor:
    """:func:`lightning_indexer`'s selection where the keys each token sees are a dense mask,
    which positions cannot express (padding, packed sequences, any attention mask): the same
    scores (the fp8 form with its scales too), the same selection rules and outputs' form, on
    the PyTorch reference on any device (no kernel takes a dense mask), in chunks of rows of
    about 256 MiB of temporaries; the mask itself is the caller's ``[B or 1, T, S]`` tensor.

    Args:
        q: ``[B, T, H, D]`` index queries; bfloat16, float16, float32 or float8_e4m3fn.
        k: ``[B, S, D]``, q's dtype.
        weights: ``[B, T, H]`` float32 head weights, any scale folded in.
        seen: ``[B, T, S]`` or ``[1, T, S]`` (every batch element) bool: token ``t`` sees key
            ``s`` where True.
        topk: a Python int ``>= 0``.
        q_scale: only with float8_e4m3fn q and k: ``[B, T, H]`` float32; None: 1.
        k_scale: required with float8_e4m3fn q and k, refused otherwise: ``[B, S]`` float32.

    Returns:
        ``indices [B, T, topk]`` int32: per row the selected keys in ascending key index, then
        -1 (the indices :func:`lightning_indexer` gives for the same visibility).

    Raises:
        RuntimeError (every message starts ``lightning_indexer_seen:``): an argument of the
            wrong type (topk not a Python int, or negative); the batched layouts above not met,
            a batch, token, head or D mismatch, an unsupported dtype, k not of q's dtype,
            weights not float32, a scale's error as :func:`lightning_indexer`'s, ``seen`` not
            bool or of another shape, tensors on different devices.
    """
    op = "lightning_indexer_seen"
    topk = _lightning_arguments(op, dict(q=q, k=k, weights=weights, seen=seen),
                                dict(q_scale=q_scale, k_scale=k_scale), topk)
    return ops_lightning_indexer.lightning_indexer_seen(q, k, weights, seen, topk, q_scale,
                                                        k_scale)


def lightning_indexer_scores(q: Tensor, k: Tensor, weights: Tensor, indices: Tensor) -> Tensor:
    """The lightning indexer's scores of the selected keys, differentiable in q, k and weights:
    the logits of DSA's indexer loss (:func:`indexer_kl_loss`).

    ``scores[.., t, j] = sum_h weights[.., t, h] * relu(q[.., t, h] . k[.., indices[.., t, j]])``
    (the lightning indexer of DeepSeek-V3.2-Exp technical report, section 2.1; any scale, e.g.
    ``softmax_scale * H**-0.5``, folded into ``weights``), float32 products and accumulation,
    computed at the ``topk`` selected slots only (never a ``[T, S]`` tensor, nor a ``[T, topk,
    D]`` gather of the whole problem). The backward is a gathered product like the attention's:
    ``dweights[t, h] = sum_j g[t, j] relu(q[t, h] . k_j)``, ``dq`` and ``dk`` through relu's
    gradient, which is 0 where ``q . k <= 0`` (0 at exactly 0, as ``torch.relu``'s); ``dk`` is
    accumulated in float32, once per occurrence of a duplicated index.

    Args:
        q: ``[T, H, D]`` or batched ``[B, T, H, D]`` (H index heads); bfloat16 or float16
            (float32 on the reference backend).
        k: ``[S, D]`` or ``[S, 1, D]``; batched ``[B, S, D]`` or ``[B, S, 1, D]``; q's dtype.
        weights: ``[T, H]`` (batched ``[B, T, H]``) float32, the per-token head weights.
        indices: ``[T, topk]`` (batched ``[B, T, topk]``, local to each batch element) int32 or
            int64, e.g. :func:`mla_inductor.lightning_indexer`'s. An index < 0 or >= S is an
            empty slot: never read, score exactly 0, no gradient. Duplicates count once per
            occurrence.

    Returns:
        ``scores [T, topk]`` (batched ``[B, T, topk]``) float32. A NaN in q or weights, or in a
        key a valid slot names, gives NaN on the slots it reaches; keys no valid slot names are
        never read.

    Raises:
        RuntimeError (every message starts ``lightning_indexer_scores:``): an argument that is
            not a tensor; wrong ranks or sizes (the message gives the expected layout and the
            shape found), a k head dimension other than 1, a D mismatch, q not bfloat16,
            float16 or float32, k not q's dtype, weights not float32, non-integer indices, mixed
            devices (all of these also at trace time under ``torch.compile``); a forced backend
            that cannot run here. On a CUDA device without a kernel for it, it runs on the
            PyTorch reference (with a warning).
    """
    for name, t in (("q", q), ("k", k), ("weights", weights), ("indices", indices)):
        if not isinstance(t, Tensor):
            raise RuntimeError(f"lightning_indexer_scores: {name} must be a torch.Tensor, got "
                               f"{type(t).__name__}")
    return torch.ops.mla_inductor.lightning_indexer_scores_entry(q, k, weights, indices)

