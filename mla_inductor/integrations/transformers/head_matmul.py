"""``torch.ops.mla_inductor.head_matmul``: the absorbed MLA form's per-head products, written
token-major.

The absorbed attention (:mod:`.deepseek_v32`) multiplies each head's rows by that head's matrix
twice: ``q_nope [N, H, qk_nope] @ W_uk[h]`` before the attention and ``o_lat [N, H,
kv_lora_rank] @ W_uv[h]ᵀ`` after it, ``N`` tokens. As ``torch.einsum`` runs them, the batched GEMM
writes head-major ``[H, N, .]`` and the caller's token-major ``[N, H, .]`` is a copy: ``cat((q_lat,
q_rope), -1)`` copies the whole query ``[N, H, kv_lora_rank + qk_rope]``, the output's
``reshape(N, H * v_head_dim)`` copies it, and in the backward the attention's op makes the
gradient ``d o_lat`` contiguous (a copy of ``[N, H, kv_lora_rank]``). This op gives the GEMM the
token-major result as its output (``torch.bmm`` passes a row stride of ``H · width`` and a batch
stride of ``width`` to cuBLAS as they are), so none of those copies is made; the products are the
same GEMMs on the same operands.

Measured on the CPU (2026-12-03, torch 2.13, transformers 5.24, bf16, DeepSeek-V3.2's sizes: 128
heads, ``kv_lora_rank`` 512, ``qk_rope`` 64, ``qk_nope`` = ``v_head_dim`` = 128, the bytes each op
reads and writes), one layer's forward + backward at T = 384 moved in those copies 108 MiB (the
query's cat), 24 MiB (the output's reshape) and 96 MiB (``d o_lat`` made contiguous). With this op
only the query's ``q_rope`` columns are copied (12 MiB, which the cat also moved): 216 MiB, 576 KiB
per token, fewer; the GEMMs are unchanged. On an NVIDIA H200 (2026-12-03, torch 2.11, transformers
5.17, bf16, the same sizes, ``python -m mla_inductor.bench hf --modes patched --breakdown``, median
of 3): the layer's forward + backward took 121.2 ms instead of 130.1 at T = 16384 and 256.6 instead
of 268.6 at T = 32768 (the kernels outside the attention, the indexer and the GEMMs: 7.5 ms instead
of 18.8, 15.2 instead of 31.5; peak memory 2.0 and 4.0 GiB lower), and the two products with their
three gradients at N = 16384 were bitwise those of the einsum + cat.

DTensor: the op shards the heads (x, tail and y ``Shard(1)``, w ``Shard(0)``: the
tensor-parallel layout of the absorbed projections) or the tokens (x, tail and y ``Shard(0)``, w
replicated), or runs replicated; its backward is ``head_matmul`` again and ``torch.bmm``, so the
gradients follow (dw is ``Partial`` under the tokens rule). Registered through
:func:`mla_inductor.distributed.register_when_dtensor_imported`.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from ... import lowering


@torch.library.custom_op("mla_inductor::head_matmul", mutates_args=())
def head_matmul(x: Tensor, w: Tensor, tail: Optional[Tensor]) -> Tensor:
    """``y [N, H, m + e]``, contiguous, in x's dtype: ``y[n, h, :m] = x[n, h] @ w[h]`` and
    ``y[..., m:] = tail``.

    ``x [N, H, k]`` and ``w [H, k, m]`` of one dtype, ``tail [N, H, e]`` or None (``e = 0``), any
    strides (a GEMM operand whose strides it cannot take is copied by ``torch.bmm``: with a unit
    stride in either of its last two axes none is). Differentiable in all three; the backward is
    ``dx = head_matmul(dy[..., :m], wᵀ)`` (token-major again), ``dw[h] = x[:, h]ᵀ @ dy[:, h, :m]``
    and ``d tail = dy[..., m:]``, read in place. An integration-internal op: the switched layer
    passes its own tensors, so it checks nothing itself.

    Raises:
        RuntimeError: ``torch.bmm``'s and ``copy_``'s own errors for operands whose heads, widths
            or dtypes do not match (not at trace time: the fake kernel only forms the shape).
    """
    N, H, _ = x.shape
    m = w.shape[-1]
    y = x.new_empty((N, H, m + (0 if tail is None else tail.shape[-1])))
    torch.bmm(x.transpose(0, 1), w, out=y.transpose(0, 1)[..., :m])
    if tail is not None:
        y[..., m:].copy_(tail)
    return y


@head_matmul.register_fake
def _(x, w, tail):
    lowering.install_like_implicit(torch.ops.mla_inductor.head_matmul.default)
    return x.new_empty((x.shape[0], x.shape[1], w.shape[-1] + (0 if tail is None else
                                                               tail.shape[-1])))


def _setup_context(ctx, inputs, output):
    x, w, tail = inputs
    ctx.save_for_backward(x, w)
    ctx.has_tail = tail is not None


def _backward(ctx, dy):
    x, w = ctx.saved_tensors
    m = w.shape[-1]
    dy_m = dy[..., :m]
    dx = head_matmul(dy_m, w.transpose(1, 2), None) if ctx.needs_input_grad[0] else None
    dw = (torch.bmm(x.transpose(0, 1).transpose(1, 2), dy_m.transpose(0, 1))
          if ctx.needs_input_grad[1] else None)
    d_tail = dy[..., m:] if ctx.has_tail and ctx.needs_input_grad[2] else None
    return dx, dw, d_tail


head_matmul.register_autograd(_backward, setup_context=_setup_context)


def _register_sharding() -> None:
    """head_matmul's DTensor rules (module docstring): per mesh dimension, (outputs, inputs)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.experimental import register_sharding

    @register_sharding(torch.ops.mla_inductor.head_matmul.default)
    def _rules(x, w, tail):
        return [([y], [y, w_p, None if tail is None else y])
                for y, w_p in ((Shard(1), Shard(0)), (Shard(0), Replicate()),
                               (Replicate(), Replicate()))]


if torch.distributed.is_available():
    from ... import distributed

    distributed.register_when_dtensor_imported(_register_sharding)
