"""Sparse-MLA kernel backends.

Every backend module (``reference``, ``emulate``, ``sm90``, ``sm100``) exposes the same surface,
so that :mod:`mla_inductor.backends` dispatches by table lookup and tests parametrise over
backends:

``available() -> tuple[bool, str]``
    Whether the backend can run here; the string says what is missing when it cannot.

``forward(q, kv, indices, topk_length, q_positions, attn_sink, sm_scale, d_v,
rescale_threshold, return_o_lo, return_max_logits) -> (out, lse, o_lo, max_logits)``
    ``q [T, H, d_qk]`` (bf16/fp16; fp32 on the reference path), last dim contiguous;
    ``kv [S, d_qk]`` same dtype, last dim contiguous; ``indices [T, topk]`` int32 contiguous
    (any value < 0 or >= S is an empty slot); ``topk_length [T]`` int32 or ``None`` (slots at
    positions >= topk_length[t] are empty); ``q_positions [T]`` int32 or ``None`` (causal: a
    slot whose index is greater than ``q_positions[t]`` is empty); ``attn_sink [H]`` float32 or
    ``None`` (one logit per head, natural-log units, in the softmax denominator, no value). An
    empty slot is never read: no value of the row its index would name (NaN included) may reach
    a result. ``sm_scale`` float, ``d_v <= d_qk`` int, ``rescale_threshold`` float in log2 units
    (0.0 = exact running max; the op has checked it against
    :data:`mla_inductor.thresholds.MAX_RESCALE_THRESHOLD`), ``return_o_lo`` and
    ``return_max_logits`` bool.
    Returns contiguous ``out [T, H, d_v]`` in q's dtype, ``lse [T, H]`` float32 natural log,
    the sink included (a row with no valid slot: out 0, lse = its head's sink, -inf without
    one; NaN where a score is NaN or +inf), ``o_lo = float32(O) - out`` rounded to q's dtype,
    ``[T, H, d_v]``, when ``return_o_lo`` else ``q.new_empty(0)`` (the residual is about 2**-9
    of ``out`` in bf16 and its own rounding about 2**-9 of the residual, so ``out + o_lo``
    carries O to about 2**-17), and ``max_logits [T, H]`` float32 (the maximum of
    ``sm_scale * q.k`` over the valid slots, -inf for none; the true maximum under any
    threshold) when ``return_max_logits`` else an empty float32 tensor.

``backward(dout, dlse, q, kv, indices, topk_length, q_positions, attn_sink, out, lse, o_lo,
sm_scale, d_v, deterministic=False) -> (dq, dkv, d_sink)``
    ``dout [T, H, d_v]``, ``dlse [T, H]`` float32 or ``None`` (the gradient reaching lse),
    the rest as the forward's arguments and outputs (``o_lo`` may be empty). The kernel backends
    (and ``emulate``) form ``dpsum = rowsum(dout * (out + o_lo))`` in fp32 (``rowsum(dout *
    out)`` without o_lo); ``reference`` recomputes P and uses the textbook ``rowsum(P * dP)``,
    reading none of out, lse, o_lo. ``dS = P (dP - dpsum + dlse)``. Returns contiguous
    ``dq [T, H, d_qk]`` in q's dtype, ``dkv [S, d_qk]`` in kv's dtype (fp32 accumulation; empty
    slots never written) and ``d_sink [H]`` float32 ``= -sum_t P_sink (dpsum - dlse)`` with a
    sink, else ``None``. ``deterministic``: bitwise the same results in every run (sm90: dkv in
    64-bit fixed point; reference and emulate: under PyTorch's deterministic mode).

``indexer_target(q, kv, indices, topk_length, q_positions, attn_sink, lse, sm_scale) -> target``
(optional)
    The indexer's training target (:mod:`mla_inductor.indexer_target`): ``q``, ``kv``, ``indices``,
    ``topk_length``, ``q_positions``, ``attn_sink``, ``sm_scale`` as the forward's, ``lse
    [T, H]`` float32 the forward's lse for them (the sink included). Returns contiguous
    ``target [T, topk]`` float32: ``sum_h exp(sm_scale * q[t, h] . k_j - lse[t, h])`` on the valid
    slots, divided by its sum over the row's valid slots; exactly 0 on empty slots and on rows
    without a valid slot (or whose sum is 0). Empty slots are never read, as in the forward.
    ``reference``, ``emulate`` and ``sm90`` have it; ``auto`` falls back to the reference (with
    the warning) on a CUDA backend without it, and a forced one does the same.

``lightning_indexer(q, k, weights, q_positions, topk) -> (indices, scores)`` (optional)
    The lightning indexer's top-k (:mod:`mla_inductor.lightning_indexer`): ``q [B, T, H, D]``
    (bf16/fp16; fp32 on the reference path), ``k [B, S, D]`` of q's dtype, ``weights [B, T, H]``
    float32, ``q_positions [B, T]`` int32 or ``None`` (causal: key ``s`` is seen by token ``t``
    when ``s <= q_positions[b, t]``; None: every key seen), all contiguous, ``topk >= 0`` int.
    ``score[t, s] = sum_h weights[t, h] * relu(q[t, h] . k[s])`` with float32 accumulation;
    per row the ``min(topk, n_seen)`` seen keys of largest score, exact ties to the smaller key
    index (``-0.0`` equals ``+0.0``), a NaN score above +inf. Returns contiguous ``indices
    [B, T, topk]`` int32, the selected keys in ascending key index and then -1, and ``scores
    [B, T, topk]`` float32, each slot's score, 0 on -1 slots. No host synchronisation, no
    ``[T, S]`` tensor beyond a bounded chunk. With float8_e4m3fn q and k (dispatched with that
    dtype) the call adds the keywords ``q_scale=`` (``[B, T, H]`` float32 or ``None``: 1) and
    ``k_scale=`` (``[B, S]`` float32), contiguous, and ``score[t, s] = sum_h weights[t, h] *
    relu(q_scale[t, h] * k_scale[s] * (q[t, h] . k[s]))``, the fp8 dot accumulated in float32;
    only a backend whose ``supports()`` accepts that dtype gets them. ``reference`` has it, fp8
    included (``emulate`` runs the reference's), and so has sm90 (fp8 too, for D = 128 and 1 to
    64 heads); ``auto`` on a CUDA backend without it (or whose ``supports()`` says no: sm90 for
    another D or head count) falls back to the reference with the warning.
``lightning_indexer_scores(q, k, weights, indices) -> scores`` (optional)
    The lightning indexer's scores at the selected slots (:mod:`mla_inductor.lightning_scores`):
    ``q [B, T, H, D]`` (bf16/fp16; fp32 on the reference path), ``k [B, S, D]`` q's dtype,
    ``weights [B, T, H]`` float32, ``indices [B, T, topk]`` int32 local to each batch element
    (any value < 0 or >= S is an empty slot, never read), all contiguous. Returns contiguous
    ``scores [B, T, topk]`` float32, ``sum_h weights[b, t, h] * relu(q[b, t, h] .
    k[b, indices[b, t, j]])`` with fp32 products and accumulation, exactly 0 on empty slots.
    Dispatched as ``"lightning_indexer_scores"`` with dims ``(T, H, S, D, 0, frozenset())``.

``lightning_indexer_scores_bwd(dscores, q, k, weights, indices, deterministic) -> (dq, dk,
dweights)`` (optional)
    Its backward: ``dscores [B, T, topk]`` float32, the rest as the forward's; ``deterministic``:
    bitwise the same results in every run (the op's autograd formula passes the mode as traced,
    as for ``backward``). Returns contiguous
    ``dq [B, T, H, D]`` in q's dtype, ``dk [B, S, D]`` in k's dtype (fp32 accumulation over the
    valid slots, once per occurrence of a duplicated index, as the attention backward's dkv; rows
    no valid slot names get exact zeros) and ``dweights [B, T, H]`` float32; relu's gradient is 0
    where ``q . k <= 0`` (0 at exactly 0, as ``torch.relu``'s). Empty slots contribute nothing,
    whatever their ``dscores``. Dispatched as ``"lightning_indexer_scores_bwd"`` with the
    forward's dims. ``reference`` has both; ``auto`` on a CUDA backend without one falls back to
    the reference with the warning, and a forced backend does the same.

``supports(dtype, direction, T, H, S, d_qk, d_v, features) -> tuple[bool, str]`` (optional)
    Whether the backend handles this problem (``direction``: ``"forward"``, ``"backward"``,
    ``"indexer_target"``, whose ``d_v`` is 0: it reads no values, or ``"lightning_indexer"``:
    ``T``, ``H``, ``S`` per batch element, ``d_qk`` the index head width D, ``d_v`` 0;
    ``features``: a frozenset of ``"causal"``,
    ``"sink"``, ``"max_logits"``, ``"dlse"``); ``auto`` falls back to the reference when not,
    a forced backend raises the reason.

``precompile(arch, **static_config)`` (GPU backends only)
    Compiles kernels without a GPU (``CUTE_DSL_ARCH``) and returns the compiled artefacts.
"""
