"""Host side of the SM90 sparse-MLA backward (the kernel is :mod:`.bwd`): its preconditions
(asserted: the op checks the arguments and the backend's selection the kernel's limits), the
static compile key, the kernel cache, the launch on torch's current stream, and the dkv
accumulator's column order (:func:`dkv_interleave`, :func:`dkv_deinterleave`,
:func:`dkv_from_accum`), and the choice to sort each row's slots first (:func:`sorts_rows`,
the sort in :mod:`.rowsort_host`). It imports the CuTe DSL only to compile a kernel that the cache
(memory, then disk) does not have, so a process whose disk cache is warm never imports it (see
:mod:`mla_inductor.kernels.cache`).
"""

from __future__ import annotations

import functools
import itertools

import torch

from ..cache import KernelCache
from . import rowsort_host
from .host import DKV_GROUP as _GROUP
from .host import (SUPPORTED_DIMS, compile_for_arch, contiguous_aligned, fixed_point_scale_for,
                   int32_contiguous)

_CACHE = KernelCache("mla_sm90_bwd")


def compile_key(dtype: torch.dtype, heads: int, d_qk: int, d_v: int, has_topk_length: bool,
                has_o_lo: bool = True, arch: str = "sm_90a", *, has_positions: bool = False,
                has_dlse: bool = False, writes_dpsum: bool = False,
                gather_evict_first: bool = False, deterministic: bool = False,
                has_sink: bool = False) -> tuple:
    """The static compile key: T, S and topk are symbolic; the head count is static, and so
    are whether ``topk_length``, a non-empty ``o_lo`` (read for dpsum only when passed), causal
    positions and dlse are passed, whether dpsum is written out, whether the gathers carry
    an L2 evict_first policy (:func:`gathers_evict_first`), whether dkv is accumulated in
    64-bit fixed point (``deterministic``) and whether an attention sink is passed. The arch is
    last."""
    return (str(dtype).removeprefix("torch."), int(heads), int(d_qk), int(d_v),
            bool(has_topk_length), bool(has_o_lo), bool(has_positions), bool(has_dlse),
            bool(writes_dpsum), bool(gather_evict_first), bool(deterministic), bool(has_sink),
            arch)


def gathers_evict_first(kv: torch.Tensor, accum_bytes: int = 4) -> bool:
    """Whether the backward's kv gathers carry an L2 evict_first policy: True when kv and the
    dkv accumulator (``S * d_qk * (kv.element_size() + accum_bytes)`` bytes: 4 for float32, 8
    for the deterministic int64 one) do not fit in the
    device's L2 (torch's ``L2_cache_size``, 60 MiB on the H200) together, so that the streamed
    kv rows make way for the accumulator's lines (H200: 1.3-3.2% faster at S = 32768; when both
    fit, the policy cost 2%: the module docstring of :mod:`.bwd`).

    Args:
        kv: ``[S, d_qk]`` bf16/fp16 tensor on a CUDA device (only its size, dtype and device
            are read).

    Raises:
        torch's own error (ValueError; AssertionError in a torch built without CUDA) for a
            ``kv`` that is not on a CUDA device.
    """
    return kv.numel() * (kv.element_size() + accum_bytes) > _l2_bytes(kv.device)


def sorts_rows(kv: torch.Tensor, topk: int, accum_bytes: int = 4) -> bool:
    """Whether the backward sorts each row's slots first (:mod:`.rowsort`): when the kv gathers
    evict first (:func:`gathers_evict_first`: kv and the dkv accumulator do not fit in L2
    together) and a row has at most :data:`.rowsort_host.MAX_SLOTS` slots. Ascending rows keep
    the accumulator's lines of the keys a wave of CTAs adds into in L2: measured (H100,
    2026-12-06, the whole backward, T 16384, S 32768, topk 2048, the sort included) 0.84x the
    time on random rows at H 128 and 0.63x at H 64; with ``torch.sort`` first at S 8192, where
    both fit, 1.02x, so the rows stay as given there. Rows that are already ascending cost one
    read and one write of the indices (0.10 ms at T 16384).

    Args:
        kv: ``[S, d_qk]`` bf16/fp16 CUDA tensor (only its size, dtype and device are read).
        topk: the slots a row.
        accum_bytes: 4 (float32 accumulator) or 8 (the deterministic int64 one).

    Raises:
        as :func:`gathers_evict_first`.
    """
    return topk <= rowsort_host.MAX_SLOTS and gathers_evict_first(kv, accum_bytes)


@functools.cache
def _l2_bytes(device: torch.device) -> int:
    """The L2 cache of ``device`` in bytes."""
    return torch.cuda.get_device_properties(device).L2_cache_size


def get_kernel(key: tuple):
    """Compiled kernel for ``key`` (see :func:`compile_key`), from the cache or compiled now
    for the key's arch (only compiling imports the CuTe DSL: :func:`.host.compile_for_arch`;
    raises :class:`~mla_inductor.kernels.cache.CompileDuringCaptureError` during capture)."""
    return _CACHE.get(key, lambda: compile_for_arch("bwd", "compile_backward", key))


def precompile_backward(arch: str = "sm_90a", *, dtypes=(torch.bfloat16,), heads=(128,),
                        d_qk: int = 576, d_v: int = 512, topk_length=(False, True),
                        o_lo=(True,), gather_evict_first=(False,),
                        deterministic=(False,), attn_sink=(False,)) -> dict:
    """Compiles the backward kernel for ``arch`` without a GPU, for every combination of
    ``dtypes`` x ``heads`` x ``topk_length`` x ``o_lo`` (whether the forward's o_lo is passed:
    a training forward always returns it) x ``gather_evict_first`` (add True for kv too long
    to fit in L2 with its accumulator: :func:`gathers_evict_first`) x ``deterministic`` (add
    True for the fixed-point dkv of ``torch.use_deterministic_algorithms(True)``) x
    ``attn_sink`` (add True for a model with attention sinks); returns
    ``{compile_key: fn}`` (also cached).

    Raises:
        ValueError: for an arch other than ``sm_90a``.
    """
    if arch != "sm_90a":
        raise ValueError(f"sm90 backward: cannot compile for {arch!r}; use 'sm_90a'")
    compiled = {}
    for dtype, h, with_len, with_o_lo, evict_first, det, sink in itertools.product(
            dtypes, heads, topk_length, o_lo, gather_evict_first, deterministic, attn_sink):
        key = compile_key(dtype, h, d_qk, d_v, with_len, with_o_lo, arch,
                          gather_evict_first=evict_first, deterministic=det, has_sink=sink)
        compiled[key] = get_kernel(key)
    return compiled


def backward_into(dout, q, kv, indices, topk_length, out, lse, o_lo, sm_scale, d_v, dkv_accum, *,
                  q_positions=None, dlse=None, dpsum_out=None, dkv_scale=None, attn_sink=None,
                  sort_rows=None):
    """Runs the main kernel (its prologue computes dpsum and lse in log2 units); returns
    ``dq [T, H, d_qk]`` (q's dtype) and adds the dkv gradient into ``dkv_accum`` (``[S, d_qk]``
    float32, contiguous, 16-byte aligned; rows of empty slots are never touched).

    Inputs: ``dout``, ``out`` ``[T, H, d_v]`` and ``q [T, H, d_qk]``, ``kv [S, d_qk]``, all of one
    dtype (bf16 or fp16); ``indices [T, topk]`` int32; ``topk_length [T]`` or None; ``lse
    [T, H]`` float32, natural log (-inf for a row without a valid slot; with an attention sink,
    the forward's lse, which includes it); ``o_lo [T, H, d_v]`` in q's dtype or empty (dpsum
    from ``out`` alone); ``sm_scale`` float; ``d_v`` 512. Keyword-only: ``q_positions [T]``
    int32 (causal: slots naming a key past the token's position are empty), ``dlse [T, H]``
    float32 (the gradient reaching lse: the kernel uses ``dpsum - dlse``) and ``dpsum_out
    [T, H]`` float32, contiguous, which receives ``dpsum - dlse`` (for the sink's gradient).
    ``dkv_scale [1]`` float32 (with an int64 ``dkv_accum``): the deterministic path, which adds
    ``round(dkv term * dkv_scale)`` into the int64 accumulator in the column order of
    :func:`dkv_fixed_interleave` (:func:`fixed_point_scale` chooses the scale). ``attn_sink
    [H]`` float32 (natural log units, the forward's): its probability is part of the mass off a
    row's dominant key (see :meth:`.bwd.SparseMlaBackwardSm90.dominant_ds`). ``sort_rows``:
    whether the kernel walks each row's slots in ascending index order, a sorted copy of
    ``indices`` (:mod:`.rowsort`: the same valid slots, so the same gradients up to the order of
    the float32 sums; ``T * topk * 4`` bytes while the kernel runs); None decides by
    :func:`sorts_rows`.

    ``dkv_accum`` is in the kernel's **interleaved column order** (see :func:`dkv_interleave`):
    columns are permuted within aligned groups of 16, rows are not moved. A zeroed buffer needs no
    conversion; read the result with :func:`dkv_deinterleave` (or :func:`dkv_from_accum`), and
    seed a non-zero buffer with :func:`dkv_interleave`.

    Raises:
        CompileDuringCaptureError: first use of a configuration inside CUDA-graph capture.
    """
    T, H, d_qk = q.shape
    S = kv.shape[0]
    assert (d_qk, d_v) in SUPPORTED_DIMS
    assert q.dtype in (torch.bfloat16, torch.float16) and kv.dtype == dout.dtype == q.dtype
    assert kv.dim() == 2 and kv.shape[1] == d_qk
    assert dout.shape == out.shape == (T, H, d_v) and lse.shape == (T, H)
    assert o_lo.numel() == 0 or o_lo.shape == (T, H, d_v)
    assert out.dtype == o_lo.dtype == q.dtype and lse.dtype == torch.float32
    assert indices.dtype == torch.int32 and indices.dim() == 2 and indices.shape[0] == T
    deterministic = dkv_scale is not None
    assert dkv_accum.dtype == (torch.int64 if deterministic else torch.float32)
    assert dkv_accum.shape == (S, d_qk) and dkv_accum.is_contiguous()
    assert dkv_accum.data_ptr() % 16 == 0
    assert not deterministic or (dkv_scale.dtype == torch.float32 and dkv_scale.numel() == 1)
    assert attn_sink is None or (attn_sink.dtype == torch.float32 and attn_sink.shape == (H,))
    assert dpsum_out is None or (dpsum_out.dtype == torch.float32 and dpsum_out.shape == (T, H)
                                 and dpsum_out.is_contiguous())
    dq = torch.empty_like(q, memory_format=torch.contiguous_format)
    if T == 0 or H == 0:
        return dq
    if indices.shape[1] == 0:  # no slot: zero gradients without a launch; dpsum is 0
        if dpsum_out is not None:
            dpsum_out.copy_(-dlse if dlse is not None else torch.zeros_like(dpsum_out))
        return dq.zero_()
    tlen, qpos = int32_contiguous(topk_length), int32_contiguous(q_positions)
    if sort_rows is None:
        sort_rows = sorts_rows(kv, indices.shape[1], dkv_accum.element_size())
    if sort_rows:
        indices = rowsort_host.sorted_rows(indices.contiguous(), tlen, S)
    dlse = None if dlse is None else dlse.to(torch.float32).contiguous()
    has_o_lo = o_lo.numel() > 0
    fn = get_kernel(compile_key(q.dtype, H, d_qk, d_v, tlen is not None, has_o_lo,
                                has_positions=qpos is not None, has_dlse=dlse is not None,
                                writes_dpsum=dpsum_out is not None,
                                gather_evict_first=gathers_evict_first(kv, dkv_accum.element_size()),
                                deterministic=deterministic, has_sink=attn_sink is not None))
    q, kv, dout, out = (contiguous_aligned(x) for x in (q, kv, dout, out))
    fn(q, kv, dout, out, contiguous_aligned(o_lo) if has_o_lo else None, lse.contiguous(),
       indices.contiguous(), tlen, dq, dkv_accum, qpos, dlse, dpsum_out,
       dkv_scale.contiguous() if deterministic else None,
       None if attn_sink is None else attn_sink.contiguous(), float(sm_scale))
    return dq


def backward(dout, dlse, q, kv, indices, topk_length, q_positions, attn_sink, out, lse, o_lo,
             sm_scale, d_v, deterministic=False, *, sort_rows=None):
    """The whole SM90 backward, in the backend protocol's argument order: returns ``(dq, dkv,
    d_sink)``, ``dq [T, H, d_qk]`` in q's dtype, ``dkv [S, d_qk]`` in kv's dtype (fp32 accumulation,
    empty slots never written) and, when ``attn_sink [H]`` float32 is given, ``d_sink [H]`` float32
    ``= -sum_t exp(sink - lse) * (dpsum - dlse)`` (else None). Inputs as :func:`backward_into`
    (``dlse``, ``q_positions`` and ``attn_sink`` may be None; ``sort_rows`` keyword-only). With
    ``deterministic``, dkv is accumulated in 64-bit fixed point (:func:`fixed_point_scale`) instead
    of with float32 atomics, so that it is bitwise the same in every run (dq and d_sink always are:
    no atomics); the accumulator then takes ``S * d_qk * 8`` bytes instead of 4.

    Raises:
        CompileDuringCaptureError: first use of a configuration inside CUDA-graph capture.
    """
    accum_dtype = torch.int64 if deterministic else torch.float32
    dkv_accum = torch.zeros(kv.shape[0], q.shape[2], dtype=accum_dtype, device=kv.device)
    scale = inverse = None
    if deterministic:
        scale, inverse = fixed_point_scale(dout, q, kv, dlse, sm_scale, d_v)
    dpsum = None
    if attn_sink is not None:
        dpsum = torch.zeros(q.shape[0], q.shape[1], dtype=torch.float32, device=q.device)
    dq = backward_into(dout, q, kv, indices, topk_length, out, lse, o_lo, sm_scale, d_v, dkv_accum,
                       q_positions=q_positions, dlse=dlse, dpsum_out=dpsum, dkv_scale=scale,
                       attn_sink=None if attn_sink is None else attn_sink.float(),
                       sort_rows=sort_rows)
    d_sink = None
    if attn_sink is not None:
        sink = attn_sink.float()[None, :]
        # the sink's probability per row: 1 where it is lse (a +inf sink: exp(inf - inf) is
        # NaN), 0 on a row without a valid slot and a -inf sink, NaN for a NaN sink
        p_sink = torch.where(sink == lse, 1.0, torch.exp(sink - lse))
        p_sink = torch.where(torch.isneginf(lse), 0.0, p_sink)
        d_sink = -(p_sink * dpsum).sum(0)
    if deterministic:
        return dq, dkv_from_fixed(dkv_accum, inverse, kv.dtype), d_sink
    return dq, dkv_from_accum(dkv_accum, kv.dtype), d_sink


def fixed_point_scale(dout, q, kv, dlse, sm_scale, d_v):
    """The deterministic backward's fixed-point scale, computed on the device (no host
    synchronisation): ``(scale [1] float32, inverse [] float64)``, ``scale = 2**k`` with ``k``
    the largest integer such that ``B * scale <= 2**(63 - 2)`` for a bound ``B`` on every dkv
    entry and every partial sum of its terms:

        B = T * H * (max|dout| + sm_scale * max|q| * (2 * d_v * max|dout| * max|kv| + max|dlse|))

    (per token and head the slots' softmax weights sum to at most 1, which bounds the
    ``P^T.dO`` terms; ``|dP|`` and ``|dpsum|`` are at most ``d_v * max|dout| * max|kv|``, which
    bounds the ``dS^T.Q`` ones). ``k`` is clamped to [-126, 126], float32's normal range. One
    term's rounding is at most ``2**-(k+1)``, about ``2**-62 * B``: far below float32's
    rounding, let alone bf16's. A non-finite bound (inf or NaN in an input) makes ``inverse``
    NaN, so that dkv is NaN rather than a silently wrong number. Raises nothing.
    """
    T, H = q.shape[0], q.shape[1]
    zero = torch.zeros((), dtype=torch.float64, device=q.device)

    def amax(x):
        return zero if x is None or x.numel() == 0 else x.abs().amax().to(torch.float64)

    m_do, m_q, m_kv, m_dlse = amax(dout), amax(q), amax(kv), amax(dlse)
    bound = T * H * (m_do + float(sm_scale) * m_q * (2 * d_v * m_do * m_kv + m_dlse))
    return fixed_point_scale_for(bound)


def dkv_from_fixed(dkv_accum: torch.Tensor, inverse: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Postprocess of the deterministic path: the int64 accumulator ``dkv_accum [S, d]`` (column
    order :func:`dkv_fixed_interleave`) times ``inverse`` (the scale's inverse, float64) ->
    plain-order ``[S, d]`` dkv in ``dtype`` (through float64: exact to 2**-53 relative)."""
    S, d = dkv_accum.shape
    plain = dkv_accum.view(S, d // _GROUP, 2, 2, 4).permute(0, 1, 2, 4, 3).reshape(S, d)
    return (plain.to(torch.float64) * inverse).to(dtype)


def dkv_fixed_interleave(x: torch.Tensor) -> torch.Tensor:
    """Plain ``[S, d]`` (``d`` a multiple of 16) -> the deterministic accumulator's column order,
    same dtype (a contiguous copy): within every aligned group of 16 columns, column ``8 * jh +
    2 * q + e`` (jh, e in {0, 1}, q in 0..3) is stored at ``8 * jh + 4 * e + q``, so that 16
    lanes of a warp add one key's group with one ``red.global.add.u64`` each, to 16 consecutive
    words (:meth:`.bwd.SparseMlaBackwardSm90.scatter_fixed`). Rows are not moved."""
    S, d = x.shape
    return x.view(S, d // _GROUP, 2, 4, 2).permute(0, 1, 2, 4, 3).reshape(S, d)


def dkv_from_accum(dkv_accum: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Postprocess: the interleaved accumulator ``dkv_accum [S, d]`` (float32 from the kernel; ``d``
    a multiple of 16) -> plain-order ``[S, d]`` dkv in ``dtype``, one fused un-interleave + cast
    (see :func:`dkv_interleave` for the order)."""
    S, d = dkv_accum.shape
    dkv = torch.empty(S, d, dtype=dtype, device=dkv_accum.device)
    dkv.view(S, d // _GROUP, 2, 4, 2).copy_(dkv_accum.view(S, d // _GROUP, 4, 2, 2).permute(0, 1, 3, 2, 4))
    return dkv


def dkv_interleave(x: torch.Tensor) -> torch.Tensor:
    """Plain ``[S, d]`` (any dtype, ``d`` a multiple of 16) -> the kernel's interleaved column
    order, same dtype (a contiguous copy).

    Within every aligned group of 16 columns, column ``8 * h + 2 * q + l`` (h, l in {0, 1},
    q in 0..3) is stored at position ``4 * q + 2 * h + l``: the four values that one thread of a
    wgmma accumulator holds for a row (columns c, c+1, c+8, c+9) are adjacent, so the kernel adds
    them with one 16-byte ``red.global.add.v4.f32``. Rows are not moved."""
    S, d = x.shape
    return x.view(S, d // _GROUP, 2, 4, 2).permute(0, 1, 3, 2, 4).reshape(S, d)


def dkv_deinterleave(x: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`dkv_interleave`: the kernel's accumulator ``[S, d]`` -> plain column
    order, same dtype (a contiguous copy; :func:`dkv_from_accum` with ``x``'s dtype)."""
    return dkv_from_accum(x, x.dtype)
