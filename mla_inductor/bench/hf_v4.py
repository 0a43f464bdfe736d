"""hf-v4: one transformers DeepSeek-V4 attention layer (CSA or HCA), unpatched against patched and FlexAttention.

transformers' ``DeepseekV4Attention`` (``models/deepseek_v4``) at DeepSeek-V4-Flash's sizes
(hidden 4096, 64 heads of ``head_dim`` 512 with one key-and-value head, q_lora 1024, RoPE on 64
channels, 8 output groups of rank 1024, sliding window 128; CSA: entries of 4 tokens, an indexer
of 64 heads x 128 picking 512 of them; HCA: entries of 128 tokens, every one visible), random
init, bf16, batch 1, forward + backward (hidden states requiring grad, a random output gradient,
every parameter's gradient) at each T, in these modes:

- ``eager``: the layer as transformers runs it (dense attention over ``cat(window keys,
  compressed entries)`` under an additive ``[1, 1, T, T + C]`` mask, float32 logits; the CSA
  indexer's scores ``[1, T, 64, C]``); transformers 5.24's V4 has no other attention
  implementation (``_supports_sdpa``, ``_supports_flash_attn`` and ``_supports_flex_attn`` are
  False);
- ``patched``: the same layer after :func:`mla_inductor.integrations.transformers.apply`
  (:mod:`mla_inductor.integrations.transformers.deepseek_v4`: the window and the entries as
  ``sparse_mla``'s slots, the indexer on ``lightning_indexer``), given the positions and the
  window the patched model passes its layers instead of a mask;
- ``compiled``: ``patched`` under ``torch.compile`` (the layer's elementwise work, its RMS norms
  and RoPE, fused by inductor around the ops; compiled once per T, outside the timed calls);
- ``flex``: ``patched`` with the attention on FlexAttention instead of ``sparse_mla``
  (:func:`mla_inductor.bench.flex.flex_sparse_mla`: a block mask of the same slots), the path
  torchtitan's V4 has; everything else is the patched layer's.

With ``--breakdown``, after each T the patched step's kernel time per part from a profiler trace:
``compressors`` (the attention's and the indexer's pooling), ``indexer`` (its queries, head
weights, scores and top-k), ``attention`` (``sparse_mla``), ``projections`` (the other GEMMs),
``other``, and ``busy / wall``. Then the attention op alone on the patched step's own inputs:
forward and backward TFLOPS on the valid slots (``2·H·n_valid·(d_qk + d_v)`` forward,
``2·H·n_valid·(3·d_qk + 2·d_v)`` backward, ``n_valid`` the slots summed over tokens), each the
median of ``triton.testing.do_bench``; after the table, the same at DeepSeek-V3.2's shapes
(:func:`v32_tflops`), the V4 shapes' bar.

ms = median of ``--iters`` calls after ``--warmup`` untimed ones, CUDA events; peak GiB as in
``hf``. An out-of-memory prints ``OOM``, and an error of FlexAttention (its compiler may refuse
a shape) ``fails:`` with the error's first line; the run goes on. Needs the ``transformers`` extra.
``--tiny``: a small config on the CPU in float32 (eager, patched and compiled; FlexAttention has
no CPU backward), T 64 and 128, on one CPU thread (:mod:`mla_inductor.threads`: with more, the
small ops' timings swing by 50x when other processes share the cores): a smoke run in about a
minute (mostly compiling).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
from typing import NamedTuple

import torch

from .flex import failure
from .hf import _cells, breakdown, measure
from .problems import (D_QK, D_V, make_indices, require_sm90, require_transformers,
                       run_threads)
from .timing import time_ms

LAYER_TYPES = {"csa": "compressed_sparse_attention", "hca": "heavily_compressed_attention"}
# DeepSeek-V4-Flash's attention (its config.json).
REAL = dict(hidden_size=4096, num_attention_heads=64, head_dim=512, q_lora_rank=1024, o_groups=8,
            o_lora_rank=1024, index_n_heads=64, index_head_dim=128, index_topk=512,
            sliding_window=128, compress_rates={LAYER_TYPES["csa"]: 4, LAYER_TYPES["hca"]: 128})
TINY = dict(hidden_size=64, num_attention_heads=4, head_dim=64, q_lora_rank=32, o_groups=2,
            o_lora_rank=16, index_n_heads=32, index_head_dim=32, index_topk=6, sliding_window=8,
            compress_rates={LAYER_TYPES["csa"]: 4, LAYER_TYPES["hca"]: 16})
MODES = ("eager", "patched", "compiled", "flex")
# The breakdown's categories (hf's mechanism): the first whose prefix names an op or a range on a
# kernel's launch stack takes the kernel's time.
CATEGORIES = (
    ("compressors", ("v4::compressor",)),
    ("indexer", ("mla_inductor::lightning_indexer", "v4::indexer")),
    ("attention", ("mla_inductor::sparse_mla",)),
    ("projections", ("aten::mm", "aten::addmm", "aten::bmm", "aten::linear", "aten::matmul")),
)


class Inputs(NamedTuple):
    """One forward's inputs at T tokens, batch 1, as ``DeepseekV4Model`` passes them to a layer."""

    hidden_states: torch.Tensor  # [1, T, hidden_size], requires grad
    grad_output: torch.Tensor  # [1, T, hidden_size]
    position_ids: torch.Tensor  # [1, T] int64, 0..T-1
    position_embeddings: dict  # {"main", "compress"}: (cos, sin), each [1, T, 32]


def build_layer(layer_type: str, sizes: dict, device: torch.device, dtype: torch.dtype,
                rope_dim: int = 64):
    """``(attention, rotary)``: a seeded random-init ``DeepseekV4Attention`` of ``layer_type``
    (``compressed_sparse_attention`` or ``heavily_compressed_attention``) of a one-layer
    ``DeepseekV4Config`` with ``sizes`` (:data:`REAL` or :data:`TINY`), its weights N(0, 0.02),
    norms 1, sinks and position biases N(0, 0.5), RoPE on ``rope_dim`` channels, in ``dtype`` on
    ``device`` (the float32 modules the model keeps in float32 too), and the model's
    ``DeepseekV4RotaryEmbedding``."""
    from transformers import DeepseekV4Config
    from transformers.models.deepseek_v4 import modeling_deepseek_v4 as v4

    rope = {"rope_type": "default", "partial_rotary_factor": rope_dim / sizes["head_dim"]}
    config = DeepseekV4Config(
        **sizes, num_hidden_layers=1, layer_types=[layer_type], mlp_layer_types=["moe"],
        attn_implementation="eager", rope_parameters={
            "main": dict(rope, rope_theta=10000.0), "compress": dict(rope, rope_theta=160000.0)})
    torch.manual_seed(0)
    with torch.device(device):
        attn = v4.DeepseekV4Attention(config, layer_idx=0)
        rotary = v4.DeepseekV4RotaryEmbedding(config)
    with torch.no_grad():
        for name, p in attn.named_parameters():
            if name.endswith(("sinks", "position_bias")):
                p.normal_(0, 0.5)
            elif "norm" in name:
                p.fill_(1.0)
            else:
                p.normal_(0, 0.02)
    keep = ("q_a_norm", "kv_norm", "sinks", "position_bias")  # the model's float32 parts
    for name, p in attn.named_parameters():
        if not any(part in name for part in keep):
            p.data = p.data.to(dtype)
    return attn, rotary


def make_inputs(attn, rotary, T: int) -> Inputs:
    """Seeded ``N(0, 1)`` hidden states and output gradient for ``attn`` at ``T`` tokens, with
    positions 0..T-1 and both RoPE tables from ``rotary``."""
    weight = attn.q_a_proj.weight
    gen = torch.Generator(device=weight.device).manual_seed(T)
    shape = (1, T, attn.config.hidden_size)
    x = torch.randn(shape, generator=gen, device=weight.device, dtype=weight.dtype)
    grad_output = torch.randn(shape, generator=gen, device=weight.device, dtype=weight.dtype)
    pos = torch.arange(T, device=weight.device)[None]
    embeddings = {kind: rotary(x, pos, layer_type=kind) for kind in ("main", "compress")}
    return Inputs(x.requires_grad_(), grad_output, pos, embeddings)


@contextlib.contextmanager
def layer_mode(attn, mode: str):
    """Runs the block with ``attn`` in ``mode`` (:data:`MODES`): unpatched on eager, or switched
    by :func:`mla_inductor.integrations.transformers.switched`, its attention op replaced by
    :func:`mla_inductor.bench.flex.flex_sparse_mla` for ``flex``."""
    from mla_inductor.integrations import transformers as mla_hf
    from mla_inductor.integrations.transformers import deepseek_v4

    from .flex import flex_sparse_mla

    if mode == "eager":
        yield
        return
    op = deepseek_v4.sparse_mla
    try:
        if mode == "flex":
            deepseek_v4.sparse_mla = flex_sparse_mla
        with mla_hf.switched(attn):
            yield
    finally:
        deepseek_v4.sparse_mla = op


def layer_mask(attn, inputs: Inputs, mode: str):
    """What the model passes the layer: the sliding-window causal mask ``[1, 1, T, T]`` transformers
    builds for eager, or the patched model's positions and window (no ``[T, T]`` tensor)."""
    from transformers.masking_utils import create_sliding_window_causal_mask

    from mla_inductor.integrations.transformers.visibility import Visibility

    if mode != "eager":
        T = inputs.position_ids.shape[1]
        return Visibility(torch.arange(T, device=inputs.position_ids.device), None,
                          attn.config.sliding_window)
    return create_sliding_window_causal_mask(
        config=attn.config, inputs_embeds=inputs.hidden_states, attention_mask=None, cache=None,
        position_ids=inputs.position_ids)


@contextlib.contextmanager
def labelled_parts():
    """Profiler ranges ``v4::compressor`` and ``v4::indexer`` around the switched layer's pooling
    and indexer (for :data:`CATEGORIES`), for the block."""
    from mla_inductor.integrations.transformers import deepseek_v4

    originals = {"_pool": deepseek_v4._pool, "_indexer_topk": deepseek_v4._indexer_topk}

    def labelled(fn, label):
        def call(*args, **kwargs):
            with torch.profiler.record_function(label):
                return fn(*args, **kwargs)
        return call

    deepseek_v4._pool = labelled(originals["_pool"], "v4::compressor")
    deepseek_v4._indexer_topk = labelled(originals["_indexer_topk"], "v4::indexer")
    try:
        yield
    finally:
        for name, fn in originals.items():
            setattr(deepseek_v4, name, fn)


def op_tflops(q, kv, indices, **kwargs) -> str:
    """:func:`op_rates` as one line of text (:func:`rates_line`)."""
    return rates_line(op_rates(q, kv, indices, **kwargs))


def rates_line(r: dict) -> str:
    """One line of text from :func:`op_rates`'s dict."""
    return (f"{r['slots_per_token']:.0f} valid slots per token, forward {r['fwd_ms']:.2f} ms "
            f"({r['fwd_tflops']:.0f} TFLOPS), backward {r['bwd_ms']:.2f} ms "
            f"({r['bwd_tflops']:.0f} TFLOPS)")


def op_rates(q, kv, indices, **kwargs) -> dict:
    """``sparse_mla(q, kv, indices, **kwargs)`` alone on CUDA: ``{"slots_per_token", "fwd_ms",
    "fwd_tflops", "bwd_ms", "bwd_tflops"}``, the valid slots per token, forward and backward
    milliseconds (medians of ``triton.testing.do_bench``; the backward: dq and dkv from a fixed
    random output gradient) and their TFLOPS on the valid slots (module docstring). ``q [..., T,
    H, d_qk]``, ``kv [..., S, d_qk]`` (bf16 / fp16), ``indices [..., T, topk]`` int32, ``kwargs``
    as :func:`mla_inductor.sparse_mla` takes them (``d_v`` default ``d_qk``); a slot counts when
    ``0 <= index < S`` and it lies below ``topk_length``. Errors are the op's."""
    from mla_inductor import sparse_mla

    q, kv = q.detach().requires_grad_(), kv.detach().requires_grad_()
    slots = torch.arange(indices.shape[-1], device=indices.device)
    length = kwargs.get("topk_length")
    valid = (indices >= 0) & (indices < kv.shape[-2])
    if length is not None:
        valid &= slots < length[..., None]
    n_valid = valid.sum().item()
    H, d_qk, d_v = q.shape[-2], q.shape[-1], kwargs.get("d_v", q.shape[-1])
    out = sparse_mla(q, kv, indices, **kwargs)
    grad = torch.randn_like(out)
    fwd = time_ms(lambda: sparse_mla(q, kv, indices, **kwargs))
    bwd = time_ms(lambda: torch.autograd.grad(out, (q, kv), grad, retain_graph=True))
    f_fwd = 2 * H * n_valid * (d_qk + d_v)
    f_bwd = 2 * H * n_valid * (3 * d_qk + 2 * d_v)
    return {"slots_per_token": n_valid / q.shape[-3], "fwd_ms": fwd,
            "fwd_tflops": f_fwd / fwd / 1e9, "bwd_ms": bwd, "bwd_tflops": f_bwd / bwd / 1e9}


def attention_op_tflops(step) -> str:
    """:func:`op_tflops` on the inputs the patched ``step()`` (one forward + backward of the
    switched layer, which is run once) passes the op, prefixed ``attention op alone: ``."""
    from mla_inductor.integrations.transformers import deepseek_v4

    seen = []
    op = deepseek_v4.sparse_mla
    deepseek_v4.sparse_mla = lambda *a, **k: seen.append((a, k)) or op(*a, **k)
    try:
        step()
    finally:
        deepseek_v4.sparse_mla = op
    args, kwargs = seen[0]
    return "attention op alone: " + op_tflops(*args, **kwargs)


def v32_tflops(T: int = 16384) -> str:
    """:func:`op_tflops` at DeepSeek-V3.2's attention shapes, the bar the V4 shapes are held to
    (:func:`v32_rates`); the line prefixed with the shape."""
    return (f"the op at DeepSeek-V3.2's shapes (T {T}, H 128, d_qk 576, d_v 512, topk 2048, "
            "random): " + op_tflops(*v32_problem(T), sm_scale=D_QK**-0.5, d_v=D_V))


def v32_rates(T: int = 16384) -> dict:
    """:func:`op_rates` at DeepSeek-V3.2's attention shapes: H 128, ``(d_qk, d_v) = (576,
    512)``, topk 2048, S = T keys, random indices, no sink, bf16, batch 1, on CUDA (about 2.5
    GiB of inputs at T 16384)."""
    return op_rates(*v32_problem(T), sm_scale=D_QK**-0.5, d_v=D_V)


def v32_problem(T: int) -> tuple:
    """``(q [1, T, 128, 576], kv [1, T, 576], indices [1, T, 2048])``, seeded, bf16 on CUDA:
    DeepSeek-V3.2's attention shapes with random indices."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(1, T, 128, D_QK, device="cuda", dtype=torch.bfloat16, generator=gen)
    kv = torch.randn(1, T, D_QK, device="cuda", dtype=torch.bfloat16, generator=gen)
    return q, kv, make_indices(T, T, 2048, "random", gen)[None]


def bench_hf_v4(Ts, layer: str, tiny: bool = False, warmup: int = 2, iters: int = 5,
                show_breakdown: bool = False, modes=MODES) -> None:
    """Prints the table (module docstring) for token counts ``Ts`` and ``layer`` (``csa`` or
    ``hca``): real sizes in bf16 on CUDA, or with ``tiny`` :data:`TINY` in float32 on the CPU."""
    import transformers

    device = torch.device("cpu" if tiny else "cuda")
    dtype = torch.float32 if tiny else torch.bfloat16
    sizes = TINY if tiny else REAL
    attn, rotary = build_layer(LAYER_TYPES[layer], sizes, device, dtype, 16 if tiny else 64)
    params = list(attn.parameters())
    where = "CPU" if tiny else torch.cuda.get_device_name()
    print(f"# One transformers DeepseekV4Attention layer, {layer.upper()}, forward + backward, "
          f"{datetime.date.today()}, {where}, torch {torch.__version__}, transformers "
          f"{transformers.__version__}, hidden {sizes['hidden_size']}, "
          f"{sizes['num_attention_heads']} heads of {sizes['head_dim']}, window "
          f"{sizes['sliding_window']}, entries of {sizes['compress_rates'][LAYER_TYPES[layer]]} "
          f"tokens" + (f", index_topk {sizes['index_topk']} ({sizes['index_n_heads']} index heads"
                       f" x {sizes['index_head_dim']})" if layer == "csa" else "") +
          f", batch 1, {str(dtype).removeprefix('torch.')}; ms: median of {iters} calls after "
          f"{warmup}")
    print("| T | mode | ms | peak GiB | mode ms / patched ms (below 1: faster than patched) |")
    print("|---|---|---|---|---|")
    for T in Ts:
        inputs = make_inputs(attn, rotary, T)
        results, parts, failures, extra = {}, {}, {}, ""
        for mode in modes:
            with layer_mode(attn, mode):
                mask = layer_mask(attn, inputs, mode)

                layer = attn
                if mode == "compiled":
                    layer = torch.compile(attn, dynamic=False, fullgraph=True)

                def step():
                    for p in (inputs.hidden_states, *params):
                        p.grad = None
                    out, _ = layer(hidden_states=inputs.hidden_states,
                                  position_embeddings=inputs.position_embeddings,
                                  position_ids=inputs.position_ids, attention_mask=mask)
                    out.backward(inputs.grad_output)

                try:
                    results[mode] = measure(step, device, warmup, iters)
                except Exception as e:  # FlexAttention's compile may refuse the shape
                    if mode != "flex":
                        raise
                    results[mode], failures[mode] = None, failure(e)
                if show_breakdown and mode == "patched" and results[mode] is not None:
                    with labelled_parts():
                        parts[mode] = breakdown(step, device, results[mode].ms, CATEGORIES)
                    if not tiny:
                        extra = attention_op_tflops(step)
            for p in (inputs.hidden_states, *params):
                p.grad = None
            del mask, step, layer
        for mode in modes:
            base, m = results.get("patched"), results[mode]
            ratio = f"{m.ms / base.ms:.2f}x" if (base and m and mode != "patched") else ""
            cells = f"fails: {failures[mode]} | -" if mode in failures else _cells(m)
            print(f"| {T} | {mode} | {cells} | {ratio} |", flush=True)
        unit = "CPU self" if tiny else "kernel"
        for mode, part in parts.items():
            print(f"| {T} | {mode}, {unit} ms: " + ", ".join(
                f"{name} {ms:.1f}" for name, ms in part.items()) +
                f"; busy / wall {part['busy'] / results[mode].ms:.2f} | | | |", flush=True)
        if extra:
            print(f"| {T} | {extra} | | | |", flush=True)
        del inputs
    if show_breakdown and not tiny:
        print(f"| | {v32_tflops()} | | | |", flush=True)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``hf-v4`` subcommand's flags: ``--layer``, ``--T``, ``--modes``, ``--warmup``,
    ``--iters``, ``--tiny``, ``--breakdown``."""
    parser.add_argument("--layer", choices=tuple(LAYER_TYPES), nargs="+", default=["csa", "hca"],
                        help="the layer types, one table each; default: csa hca")
    parser.add_argument("--T", type=int, nargs="+", default=None,
                        help="token counts T (batch 1); default: 16384 32768 65536 131072 (with "
                             "--tiny: 64 128)")
    parser.add_argument("--modes", nargs="+", choices=MODES, default=None,
                        help="default: eager patched compiled flex (with --tiny: eager patched "
                             "compiled)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed calls; default: 2")
    parser.add_argument("--iters", type=int, default=5,
                        help="timed calls, the median reported; default: 5")
    parser.add_argument("--tiny", action="store_true",
                        help="a small config on the CPU in float32, one CPU thread: a smoke run "
                             "of about a minute (mostly compiling)")
    parser.add_argument("--breakdown", action="store_true",
                        help="after each T, the patched step's kernel time per part and the "
                             "attention op's TFLOPS alone")


def run(args: argparse.Namespace) -> None:
    """Runs the subcommand for parsed flags (:func:`add_arguments`). Exits with a message when the
    sm90 kernels cannot run here (unless ``--tiny``) or transformers is not installed."""
    if not args.tiny:
        require_sm90("kernels", tiny=True)
    require_transformers("hf-v4", "transformers.models.deepseek_v4")
    modes = tuple(args.modes or (MODES[:3] if args.tiny else MODES))
    with run_threads(args.tiny):
        for layer in args.layer:
            bench_hf_v4(args.T or ([64, 128] if args.tiny else [16384, 32768, 65536, 131072]),
                        layer, tiny=args.tiny, warmup=args.warmup, iters=args.iters,
                        show_breakdown=args.breakdown, modes=modes)
