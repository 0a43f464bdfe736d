"""SM100 (Blackwell) backend: FlashAttention-4's sparse-MLA CuTe DSL kernels.

Runs the kernels that ``flash-attn-4==4.0.0b36`` ships under ``flash_attn/cute/`` (install with
``pip install 'mla-inductor[sm100]'``); this module only adapts layouts and arguments, it holds no
kernel code. Implements the backend protocol, :class:`mla_inductor.backends.Backend`.

Layout mapping (no copies: views of our packed tensors, batch dimension 1). FA4 computes
``softmax(sm_scale * (q_pe . k_pe + qv . v)) . v`` with ``q_pe``/``k_pe`` the 64-wide RoPE part
and ``qv``/``v`` the 512-wide latent part; in our packed layout the latent part is columns
``:d_v`` and the RoPE part columns ``d_v:d_qk``:

- ``q [T, H, 576]`` -> ``qv = q[..., :512]`` as ``[1, T, H, 512]`` and ``q_pe = q[..., 512:]``
  as ``[1, T, H, 64]``
- ``kv [S, 576]`` -> ``v = kv[:, :512]`` as ``[1, S, 1, 512]`` and ``k_pe = kv[:, 512:]`` as
  ``[1, S, 1, 64]``
- ``d_qk == d_v == 512`` (no RoPE part) runs with ``q_pe = k_pe = None``.
- ``indices [T, topk]`` -> ``[1, T, topk_pad]`` int32 with every empty slot (< 0, >= S, or at a
  position >= ``topk_length[t]``) set to -1 and ``topk`` padded with -1 to a multiple of 128.
- Heads: 1 to 128; FA4 pads a token's heads to its 64/128-row tile inside the kernels.

Forward: this module builds FA4's forward kernel itself, because FA4's interface derives the
threshold and the o_lo output from ``requires_grad`` (which tensors inside a custom op never
carry). The kernel class is the one FA4's interface routes to (its ``_mla_1cta_route``): the
2-CTA ``FlashAttentionMLAForwardSm100``, or for at most 64 heads past one wave of tokens the
1-CTA ``FlashAttentionMLAForward1CtaKb64Sm100``. ``rescale_threshold`` and ``return_o_lo`` go
into its constructor / arguments and into the compile key; with (8.0, no o_lo) the kernel is
FA4's own inference kernel, with (0.0, o_lo) FA4's training kernel in its recompute-P mode.
FA4's o_lo is in the output dtype (bf16(fp32(O) - bf16(O))), as the op's o_lo is.

Backward: FA4's ``_flash_attn_bwd_sparse_mla`` in recompute-P mode (P is rebuilt from lse, so the
forward saves no P / row_max): preprocess ``dpsum = rowsum(dout * (out + o_lo))``, the main
kernel (dS, dV), the dQ/dQv gather GEMM and the dK_rope scatter GEMM. Its ``(dq_pe, dk_pe, dv,
dqv)`` are packed back into ``dq [T, H, d_qk] = [dqv | dq_pe]`` and
``dkv [S, d_qk] = [dv | dk_pe]`` in kv's dtype.

Compiled kernels are cached by FA4's cache (``flash_attn.cute.cache_utils.get_jit_cache``: in
memory, and on disk with ``FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED=1``).
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import os
from typing import Optional

import torch
from torch import Tensor
from torch.overrides import TorchFunctionMode

from ..thresholds import EXACT_THRESHOLD, LAZY_THRESHOLD

INSTALL_HINT = "pip install 'mla-inductor[sm100]'"
D_LATENT = 512  # FA4's hdim_v (qv / v width)
D_ROPE = 64  # FA4's hdim (q / k width)
MAX_HEADS = 128
MAX_TOKENS = 2**24 - 1  # 128 rows a token, counted in int32 inside FA4 (see supports)
TOPK_MULTIPLE = 128


@functools.cache
def _fa4():
    """FA4's interface module (imported on first use; it pulls in triton via quack)."""
    from flash_attn.cute import interface

    return interface


@functools.cache
def _forward_cache():
    from flash_attn.cute.cache_utils import get_jit_cache

    return get_jit_cache("mla_inductor_sparse_mla_fwd")


def available() -> tuple[bool, str]:
    """Whether this backend can run here: a compute-capability 10.x GPU and ``flash_attn.cute``.

    Returns:
        ``(True, "")`` or ``(False, reason)``; the reason names what is missing.
    """
    if not torch.cuda.is_available():
        return False, "no CUDA device"
    major, minor = torch.cuda.get_device_capability()
    if major != 10:
        return False, f"needs an SM100 GPU (compute capability 10.x), found {major}.{minor}"
    try:
        _fa4()
    except ImportError as e:
        return False, f"flash_attn.cute is not importable ({e}); {INSTALL_HINT}"
    return True, ""


UNMAPPED_FEATURES = frozenset({"sink", "max_logits", "dlse"})


def supports(dtype, direction, T, H, S, d_qk, d_v, features=frozenset()) -> tuple[bool, str]:
    """Whether FA4 has kernels for this problem (``auto`` falls back to the reference if not).

    Sizes: every global offset in FA4 4.0.0b36's sparse-MLA kernels is 64-bit (its tensors have
    64-bit dynamic strides), except row counts of the form T x (a 64- or 128-row head tile),
    which are 32-bit (``flash_fwd_mla_sm100.py``, ``flash_bwd_preprocess.py``,
    ``flash_bwd_mla_sm100.py``): hence ``T <= MAX_TOKENS``. Its backward also allocates a
    ``T x H x topk`` bf16 dS buffer (16 GiB at T 32768, H 128, topk 2048), which bounds T by memory
    long before that."""
    if dtype not in (torch.bfloat16, torch.float16):
        return False, f"sm100 backend (FlashAttention-4): needs bf16 or fp16, got {dtype}"
    if d_v != D_LATENT or d_qk not in (D_LATENT, D_LATENT + D_ROPE):
        return False, (
            f"sm100 backend (FlashAttention-4): needs d_v = {D_LATENT} and d_qk = {D_LATENT} or "
            f"{D_LATENT + D_ROPE}, got d_v = {d_v}, d_qk = {d_qk}"
        )
    if not 1 <= H <= MAX_HEADS:
        return False, f"sm100 backend (FlashAttention-4): supports 1 to {MAX_HEADS} heads, got {H}"
    if direction == "backward" and d_qk > D_LATENT and dtype != torch.bfloat16:
        return False, "sm100 backend (FlashAttention-4): the backward with a RoPE part needs bfloat16"
    unmapped = sorted(UNMAPPED_FEATURES & set(features))
    if unmapped:
        return False, (
            f"sm100 backend (FlashAttention-4): {', '.join(unmapped)} not mapped to FA4's "
            "sparse-MLA kernels by this adapter (causal masking is)"
        )
    if T > MAX_TOKENS:
        return False, (
            f"sm100 backend (FlashAttention-4): at most {MAX_TOKENS} tokens (its kernels count "
            f"packed head-tile rows, 128 per token, in 32 bits), got T = {T}"
        )
    return True, ""


def _check_features(sink: bool, max_logits: bool, dlse: bool) -> None:
    """Raises NotImplementedError naming the first of these features the adapter does not map."""
    for name, used in (("an attention sink", sink), ("max_logits", max_logits),
                       ("a gradient through lse", dlse)):
        if used:
            raise NotImplementedError(
                f"sm100 backend (FlashAttention-4): {name} is not mapped to FA4's sparse-MLA "
                "kernels by this adapter; use the reference backend (auto does)"
            )


def _check_supported(q: Tensor, kv: Tensor, d_v: int) -> bool:
    """Raises NotImplementedError for shapes FA4 has no kernel for; returns whether q has RoPE."""
    heads, d_qk = q.shape[1], q.shape[2]
    if d_v != D_LATENT or d_qk not in (D_LATENT, D_LATENT + D_ROPE):
        raise NotImplementedError(
            f"sm100 backend (FlashAttention-4): needs d_v = {D_LATENT} and d_qk = {D_LATENT} or "
            f"{D_LATENT + D_ROPE}, got d_v = {d_v}, d_qk = {d_qk}; use the reference backend"
        )
    if not 1 <= heads <= MAX_HEADS:
        raise NotImplementedError(
            f"sm100 backend (FlashAttention-4): supports 1 to {MAX_HEADS} heads, got {heads}"
        )
    if q.dtype not in (torch.bfloat16, torch.float16) or kv.dtype != q.dtype:
        raise NotImplementedError(
            f"sm100 backend (FlashAttention-4): needs bf16 or fp16 q and kv of one dtype, "
            f"got {q.dtype} and {kv.dtype}"
        )
    return d_qk > D_LATENT


def _split_q(q: Tensor, has_rope: bool) -> tuple[Tensor, Optional[Tensor]]:
    """``q [T, H, d_qk]`` -> FA4's ``(qv [1, T, H, 512], q_pe [1, T, H, 64] or None)`` views."""
    fa4 = _fa4()
    q4 = q.unsqueeze(0)
    qv = fa4.maybe_contiguous(q4.narrow(-1, 0, D_LATENT))
    q_pe = fa4.maybe_contiguous(q4.narrow(-1, D_LATENT, D_ROPE)) if has_rope else None
    return qv, q_pe


def _split_kv(kv: Tensor, has_rope: bool) -> tuple[Tensor, Optional[Tensor]]:
    """``kv [S, d_qk]`` -> FA4's ``(v [1, S, 1, 512], k_pe [1, S, 1, 64] or None)`` views."""
    fa4 = _fa4()
    kv4 = kv.unsqueeze(0).unsqueeze(2)
    v = fa4.maybe_contiguous(kv4.narrow(-1, 0, D_LATENT))
    k_pe = fa4.maybe_contiguous(kv4.narrow(-1, D_LATENT, D_ROPE)) if has_rope else None
    return v, k_pe


def _gather_indices(indices: Tensor, topk_length: Optional[Tensor], num_kv: int,
                    q_positions: Optional[Tensor] = None) -> Tensor:
    """FA4's ``gather_kv_indices [1, T, topk_pad]`` int32: empty slots -1 (out of range, past
    ``topk_length``, or, with causal ``q_positions``, naming a key past the token's position),
    topk padded to 128. Device-side only (no host synchronisation).
    """
    topk = indices.shape[1]
    valid = (indices >= 0) & (indices < num_kv)
    if topk_length is not None:
        position = torch.arange(topk, device=indices.device, dtype=torch.int32)
        valid &= position.unsqueeze(0) < topk_length.unsqueeze(1)
    if q_positions is not None:
        valid &= indices <= q_positions.unsqueeze(1)
    gather = torch.where(valid, indices, -1).to(torch.int32)
    pad = -topk % TOPK_MULTIPLE
    if pad:
        gather = torch.nn.functional.pad(gather, (0, pad), value=-1)
    return gather.unsqueeze(0).contiguous()


def _target_arch() -> str:
    from cutlass.cutlass_dsl import CuTeDSL

    return CuTeDSL._get_dsl().envar.arch


def _one_cta_route(heads: int, tokens: int, device: torch.device, training: bool) -> bool:
    """FA4's own forward choice (``interface._mla_1cta_route``): its 1-CTA 64-key kernel for at
    most 64 heads once the 2-CTA grid (2 CTAs per token) exceeds one wave of SMs, else the
    2-CTA kernel. ``FLASH_ATTENTION_MLA_1CTA=0/1`` overrides it, as in FA4."""
    fa4 = _fa4()
    num_sms = fa4.get_num_sms_for_selection(device.index, fa4._get_device_arch())
    return fa4._mla_1cta_route(
        True, heads, training, True,  # topk gather, heads, requires_grad, recompute-P
        seqlen_q_hint=tokens, needs_1cta=False, ctas_2cta=2 * tokens, num_sms=num_sms,
    )  # fmt: skip


def _forward_kernel(qv, q_pe, v, k_pe, out, lse, o_lo, gather, sm_scale, rescale_threshold):
    """The FA4 sparse-MLA forward kernel FA4 itself would pick, compiled once per static
    configuration, with our threshold and o_lo."""
    tokens, heads, topk = qv.shape[1], qv.shape[2], gather.shape[-1]
    has_qk, training = q_pe is not None, o_lo is not None
    one_cta = _one_cta_route(heads, tokens, qv.device, training)
    key = (
        _target_arch(),
        str(qv.dtype),
        heads,
        topk,
        has_qk,
        float(rescale_threshold),
        training,
        one_cta,
        # CuTe keeps stride-0 modes static, so broadcast inputs compile a different kernel.
        tuple(tuple(s == 0 for s in t.stride()) for t in (qv, q_pe, v, k_pe) if t is not None),
    )
    cache = _forward_cache()
    if key not in cache:
        import cutlass.cute as cute
        from flash_attn.cute.cute_dsl_utils import to_cute_tensor

        if one_cta:
            from flash_attn.cute.flash_fwd_mla_1cta_kb64_sm100 import (
                FlashAttentionMLAForward1CtaKb64Sm100 as Kernel,
            )

            kernel = Kernel(
                qhead_per_kvhead=heads,
                hdim=D_ROPE if has_qk else D_LATENT,
                use_clc_scheduler=Kernel.use_clc(
                    is_topk_gather=True, seqlen_q_hint=tokens, clc_default=True
                ),
                has_qk=has_qk,
                topk_length=topk,
                rescale_threshold=rescale_threshold,
            )
        else:
            from flash_attn.cute.flash_fwd_mla_sm100 import FlashAttentionMLAForwardSm100 as Kernel

            kernel = Kernel(
                use_cpasync_load_KV=True,
                topk_length=topk,
                is_topk_gather=True,
                pack_gqa=True,
                qhead_per_kvhead=heads,
                nheads_kv=1,
                has_qk=has_qk,
                rescale_threshold=rescale_threshold,
            )
        o_align = 32  # FA4's output alignment for hdim_v 512
        cache[key] = cute.compile(
            kernel,
            to_cute_tensor(q_pe),
            to_cute_tensor(qv),
            to_cute_tensor(k_pe),
            to_cute_tensor(v),
            to_cute_tensor(out, assumed_align=o_align),
            to_cute_tensor(lse, assumed_align=4),
            sm_scale,
            None,  # p: not saved (the backward recomputes P)
            None,  # row_max: likewise
            None,  # cu_seqlens_q
            None,  # cu_seqlens_k
            None,  # seqused_q
            None,  # seqused_k
            to_cute_tensor(gather),
            None,  # page_table
            None,  # descale tensors
            None,  # window_size_left
            None,  # window_size_right
            learnable_sink=None,
            mOlo=to_cute_tensor(o_lo, assumed_align=o_align),
            stream=cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True),
            options=_fa4()._compile_options(Kernel.ptxas_options),
        )
    return cache[key]


def forward(
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
    """Sparse-MLA forward on FA4's SM100 kernel (shapes, semantics:
    :class:`mla_inductor.backends.Backend`).

    ``rescale_threshold`` (log2 units) and ``return_o_lo`` select the compiled kernel: the
    threshold is a compile-time constant of FA4's online softmax, and o_lo is an extra epilogue
    output. Causal positions become empty (-1) gather slots. Inside ``FakeTensorMode`` the kernel
    is compiled but not launched.

    Raises:
        NotImplementedError: d_v != 512, d_qk not 512 or 576, more than 128 heads, a dtype
            other than bf16/fp16, an attention sink or max_logits (not mapped to FA4 here:
            ``auto`` runs those on the reference, see :func:`supports`).
    """
    _check_features(attn_sink is not None, return_max_logits, False)
    has_rope = _check_supported(q, kv, d_v)
    T, H, _ = q.shape
    S = kv.shape[0]
    out = q.new_empty(T, H, d_v)
    lse = q.new_empty(T, H, dtype=torch.float32)
    if T == 0 or S == 0 or indices.shape[1] == 0:  # nothing to read: no launch
        out.zero_()
        lse.fill_(float("-inf"))
        o_lo = q.new_zeros(T, H, d_v) if return_o_lo else q.new_empty(0)
        return out, lse, o_lo, q.new_empty(0, dtype=torch.float32)
    o_lo = torch.empty_like(out) if return_o_lo else q.new_empty(0)
    qv, q_pe = _split_q(q, has_rope)
    v, k_pe = _split_kv(kv, has_rope)
    gather = _gather_indices(indices, topk_length, S, q_positions)
    out4, lse3 = out.unsqueeze(0), lse.unsqueeze(0)
    o_lo4 = o_lo.unsqueeze(0) if return_o_lo else None
    kernel = _forward_kernel(
        qv, q_pe, v, k_pe, out4, lse3, o_lo4, gather, sm_scale, rescale_threshold
    )
    if not _fa4().is_fake_mode():
        kernel(q_pe, qv, k_pe, v, out4, lse3, sm_scale, None, None, None, None, None, None,
               gather, None, None, None, None, None, o_lo4)  # fmt: skip
    return out, lse, o_lo, q.new_empty(0, dtype=torch.float32)


def backward(
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
) -> tuple[Tensor, Tensor, None]:
    """Sparse-MLA backward on FA4's SM100 kernels (shapes, semantics:
    :class:`mla_inductor.backends.Backend`).

    ``dpsum = rowsum(dout * (out + o_lo))`` (o_lo in out's dtype, as FA4 stores it) or
    ``rowsum(dout * out)`` when o_lo is empty. dk/dv accumulate in fp32 inside FA4, with
    atomics: ``deterministic`` is refused before this is called (``backends.NONDETERMINISTIC``)
    and not read here.

    Raises:
        NotImplementedError: as :func:`forward`, for a gradient reaching lse, and for fp16 with
            a RoPE part (FA4's dK_rope kernel is bf16-only).
    """
    _check_features(attn_sink is not None, False, dlse is not None)
    has_rope = _check_supported(q, kv, d_v)
    if has_rope and q.dtype != torch.bfloat16:
        raise NotImplementedError(
            "sm100 backend (FlashAttention-4): the backward with a RoPE part needs bfloat16 "
            f"(FA4's dK_rope kernel is bf16-only), got {q.dtype}"
        )
    T, H, d_qk = q.shape
    S = kv.shape[0]
    if T == 0 or S == 0 or indices.shape[1] == 0:  # nothing to read: no launch
        return q.new_zeros(T, H, d_qk), kv.new_zeros(S, d_qk), None
    qv, q_pe = _split_q(q, has_rope)
    v, k_pe = _split_kv(kv, has_rope)
    gather = _gather_indices(indices, topk_length, S, q_positions)
    o_lo4 = o_lo.unsqueeze(0) if o_lo.numel() else None
    with _fake_cuda_indexing() if _fa4().is_fake_mode() else contextlib.nullcontext():
        dq_pe, dk_pe, dv, dqv, _ = _fa4()._flash_attn_bwd_sparse_mla(
            q_pe, k_pe, v, qv, out.unsqueeze(0), dout.unsqueeze(0), lse.unsqueeze(0),
            None, None, gather, softmax_scale=sm_scale, recompute_p=True, o_lo=o_lo4,
        )  # fmt: skip
    # Pack back in our column order: latent part first, RoPE part last.
    dq = torch.cat((dqv, dq_pe) if has_rope else (dqv,), dim=-1).reshape(T, H, d_qk)
    dkv = torch.cat((dv, dk_pe) if has_rope else (dv,), dim=-1).reshape(S, d_qk).to(kv.dtype)
    return dq, dkv, None


class _BasicIndexing(TorchFunctionMode):
    """Routes basic Python indexing (``t[..., :n]``, ints, step-1 slices) through narrow/select.

    ``Tensor.__getitem__`` takes a device guard for the tensor's device; a CPU-only torch build
    has none for ``cuda`` and raises "PyTorch is not linked with support for cuda devices" even
    for fake tensors, while the equivalent view ops work. FA4's backward host code indexes its
    buffers this way, so running it on fake ``cuda`` tensors from a CPU build needs this mode.
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.Tensor.__getitem__:
            view = _basic_index(*args)
            if view is not None:
                return view
        return func(*args, **(kwargs or {}))


def _basic_index(t: Tensor, index) -> Optional[Tensor]:
    items = index if isinstance(index, tuple) else (index,)
    basic = all(i is Ellipsis or isinstance(i, slice) or type(i) is int for i in items)
    n_ellipsis = sum(i is Ellipsis for i in items)
    if not basic or n_ellipsis > 1:
        return None
    fill = (slice(None),) * (t.dim() - (len(items) - n_ellipsis))
    view, dim = t, 0
    for item in items:
        if item is Ellipsis:
            dim += len(fill)
            continue
        if isinstance(item, int):
            view = view.select(dim, item)
            continue
        start, stop, step = item.indices(view.shape[dim])
        if step != 1:
            return None
        view = view.narrow(dim, start, max(stop - start, 0))
        dim += 1
    return view


def _fake_cuda_indexing():
    return contextlib.nullcontext() if torch.backends.cuda.is_built() else _BasicIndexing()


@contextlib.contextmanager
def cross_compile(arch: str = "sm_100a", num_sms: int = 148):
    """Context for compiling without launching: yields a ``FakeTensorMode``.

    Inside it, fake ``cuda`` tensors built with ``torch.empty(..., device="cuda")`` drive
    :func:`forward` / :func:`backward` through all their host code and FA4's ``cute.compile``
    calls; nothing is launched. Works on a machine without a GPU and with a CPU-only torch
    build. Sets the CuTe DSL target to ``arch``, FA4's kernel selection to SM100 and the target's
    SM count (``num_sms``, 148 on B200; it picks between FA4's 1-CTA and 2-CTA forward) for the
    duration, and restores them afterwards.

    Raises:
        ValueError: for an arch other than ``sm_100a`` / ``sm_103a``.
    """
    if arch not in ("sm_100a", "sm_103a"):
        raise ValueError(f"sm100 backend: cannot compile for {arch!r}; use 'sm_100a'")
    from cutlass.cutlass_dsl import CuTeDSL
    from torch._subclasses.fake_tensor import FakeTensorMode

    envar = CuTeDSL._get_dsl().envar  # the DSL reads CUTE_DSL_ARCH once, at import
    fa4 = _fa4()
    settings = {"FLASH_ATTENTION_ARCH": arch.rstrip("af"), "FLASH_ATTENTION_NUM_SMS": str(num_sms)}
    previous_arch, previous_env = envar._arch, {k: os.environ.get(k) for k in settings}
    envar.arch = arch
    os.environ.update(settings)
    fa4._get_device_arch.cache_clear()  # FA4 caches its arch choice
    try:
        with FakeTensorMode() as mode:
            yield mode
    finally:
        envar._arch = previous_arch
        for name, value in previous_env.items():
            if value is None:
                del os.environ[name]
            else:
                os.environ[name] = value
        fa4._get_device_arch.cache_clear()


def precompile(
    arch: str = "sm_100a",
    *,
    dtypes: tuple[torch.dtype, ...] = (torch.bfloat16,),
    heads: tuple[int, ...] = (128,),
    topk: tuple[int, ...] = (2048,),
    d_qk: int = D_LATENT + D_ROPE,
    d_v: int = D_LATENT,
    modes: tuple[tuple[float, bool], ...] = ((EXACT_THRESHOLD, True), (LAZY_THRESHOLD, False)),
    compile_backward: bool = True,
    num_sms: int = 148,
) -> dict:
    """Compiles FA4's SM100 sparse-MLA kernels for ``arch`` without a GPU (nothing is launched).

    Args:
        arch: CuTe DSL target, ``"sm_100a"`` (B200/GB200) or ``"sm_103a"`` (B300/GB300).
        dtypes, heads, topk: the static configurations to compile (topk is padded to a multiple
            of 128 as at run time).
        d_qk, d_v: 576/512 (with RoPE) or 512/512.
        modes: ``(rescale_threshold, return_o_lo)`` forward variants; the default is the
            training forward (0.0, with o_lo) and the inference forward (8.0, without).
        compile_backward: also compile the backward kernels (preprocess, main, dQ/dQv GEMM,
            dK GEMM).
        num_sms: the target's SM count (148 on B200); with at most 64 heads both of FA4's
            forward kernels are compiled (2-CTA for few tokens, 1-CTA past one wave).

    Returns:
        ``{"forward": {compile_key: compiled}, "backward": {fa4_cache_name: {compile_key:
        compiled}}}``: this module's forward kernels and FA4's backward caches (all their
        entries, including earlier ones).

    Raises:
        ValueError: for another arch. NotImplementedError: as :func:`forward` /
            :func:`backward` (e.g. fp16 with a RoPE part and ``compile_backward``).
    """
    fa4 = _fa4()
    kv_rows = 256  # any size: T and S are dynamic in every kernel
    scale = d_qk**-0.5
    with cross_compile(arch, num_sms):
        for dtype, h, k in itertools.product(dtypes, heads, topk):
            kv = torch.empty(kv_rows, d_qk, dtype=dtype, device="cuda")
            # One token fits one wave on the 2-CTA kernel; num_sms tokens do not (1-CTA route).
            for tokens in (1, num_sms) if h <= 64 else (num_sms,):
                q = torch.empty(tokens, h, d_qk, dtype=dtype, device="cuda")
                indices = torch.empty(tokens, k, dtype=torch.int32, device="cuda")
                for threshold, return_o_lo in modes:
                    forward(q, kv, indices, None, None, None, scale, d_v, threshold,
                            return_o_lo, False)
            if compile_backward:
                out = torch.empty(tokens, h, d_v, dtype=dtype, device="cuda")
                lse = torch.empty(tokens, h, dtype=torch.float32, device="cuda")
                o_lo = torch.empty(tokens, h, d_v, dtype=dtype, device="cuda")
                backward(out, None, q, kv, indices, None, None, None, out, lse, o_lo, scale, d_v)
    backward_caches = {
        "preprocess": fa4._bwd_preprocess.compile_cache,
        "main": fa4._flash_attn_bwd_sparse_mla.compile_cache,
        "dq_dqv_gemm": fa4._sparse_mla_dq_dqv.compile_cache,
        "dk_gemm": fa4._sparse_mla_dk.compile_cache,
    }
    return {
        "forward": dict(_forward_cache().cache),
        "backward": {name: dict(c.cache) for name, c in backward_caches.items()}
        if compile_backward
        else {},
    }
