"""Sparse-MLA kernel backends.

Every backend module (``reference``, ``emulate``, ``sm90``, ``sm100``) exposes the same surface,
so that :mod:`mla_inductor.backends` dispatches by table lookup and tests parametrise over
backends:

``available() -> tuple[bool, str]``
    Whether the backend can run here; the string says what is missing when it cannot.

``forward(q, kv, indices, topk_length, sm_scale, d_v, rescale_threshold, return_o_lo)
-> (out, lse, o_lo)``
    ``q [T, H, d_qk]`` (bf16/fp16; fp32 on the reference path), last dim contiguous;
    ``kv [S, d_qk]`` same dtype, last dim contiguous; ``indices [T, topk]`` int32 contiguous
    (any value < 0 or >= S is an empty slot); ``topk_length [T]`` int32 or ``None`` (slots at
    positions >= topk_length[t] are empty). An empty slot is never read: no value of the row
    its index would name (NaN included) may reach a result. ``sm_scale`` float, ``d_v <= d_qk``
    int, ``rescale_threshold`` float in log2 units (0.0 = exact running max; the op has checked
    it against :data:`mla_inductor.validation.MAX_RESCALE_THRESHOLD`), ``return_o_lo`` bool.
    Returns contiguous ``out [T, H, d_v]`` in q's dtype, ``lse [T, H]`` float32 natural log
    (-inf for a row with no valid slot, whose out is 0; NaN where a score is NaN or +inf) and ``o_lo = float32(O) - out`` rounded
    to q's dtype, ``[T, H, d_v]``, when ``return_o_lo`` else ``q.new_empty(0)``. (The residual
    is about 2**-9 of ``out`` in bf16 and its own rounding about 2**-9 of the residual, so
    ``out + o_lo`` carries O to about 2**-17.)

``backward(dout, q, kv, indices, topk_length, out, lse, o_lo, sm_scale, d_v) -> (dq, dkv)``
    ``dout [T, H, d_v]``, ``out``/``lse``/``o_lo`` as returned by ``forward`` (``o_lo`` may be
    empty). The kernel backends (and ``emulate``) form ``dpsum = rowsum(dout * (out + o_lo))``
    in fp32 (``rowsum(dout * out)`` without o_lo); ``reference`` recomputes P and uses the
    textbook ``rowsum(P * dP)``, reading none of out, lse, o_lo. Returns contiguous ``dq [T, H, d_qk]`` in q's dtype and ``dkv [S, d_qk]`` in kv's
    dtype (fp32 accumulation; empty slots never written).

``supports(dtype, direction, T, H, S, d_qk, d_v) -> tuple[bool, str]`` (optional)
    Whether the backend handles this problem; ``auto`` falls back to the reference when not,
    a forced backend raises the reason.

``precompile(arch, **static_config)`` (GPU backends only)
    Compiles kernels without a GPU (``CUTE_DSL_ARCH``) and returns the compiled artefacts.
"""
