"""hf: one transformers DeepSeek-V3.2 attention layer, unpatched (eager, sdpa) against patched.

transformers' ``DeepseekV32Attention`` (``models/deepseek_v32``, with its DSA indexer) at
DeepSeek-V3.2's sizes (hidden 7168, 128 heads, q_lora 1536, kv_lora 512, rope 64, nope 128,
v 128, index_topk 2048 over 64 index heads of 128, YaRN factor 40 as in the released config),
random init, bf16, batch 1, forward + backward (hidden states requiring grad, a random output
gradient, every parameter's gradient) at each T, in these modes:

- ``eager``, ``sdpa``: the layer as transformers runs it with that ``attn_implementation`` (keys
  and values expanded per head, the indexer's top-k folded into a dense [1, 1, T, T] mask);
- ``patched``: the same layer after :func:`mla_inductor.integrations.transformers.apply` (the
  absorbed form on ``sparse_mla``, the indexer's top-k from ``lightning_indexer``), given what the
  patched model passes its layers instead of a mask: each token's position (no ``[T, T]`` tensor);
- ``compiled``: ``patched`` under ``torch.compile(fullgraph=True)`` (inductor fuses the layer's
  elementwise work around the ops; compiled once per T, outside the timed calls), what a user who
  compiles the model runs. Its last column is its time over ``patched``'s;
- ``patched+loss`` (only when asked for with ``--modes``): ``patched`` with DeepSeek-V3.2's
  indexer loss on (``apply(model, indexer_loss=True)``): the step also computes the layer's
  indexer KL loss and backpropagates it with the output's gradient (the target,
  ``indexer_target``; the KL; the backward of the selection's own scores, which are the
  logits). Its speedup column is its time over ``patched``'s.

Two more rows time the layer's indexer alone (forward, under ``no_grad`` as in the layer; the
same top-k definition): ``transformers' indexer alone (fwd)``, the module's own forward, which
runs inside eager and sdpa (float32 scores ``[1, T, 64, T]`` and a float32 copy of its keys per
query token, ``[T, 128, T]``: O(T²)), and ``lightning indexer alone (fwd)``,
:func:`mla_inductor.integrations.transformers.indexer.indexer_topk`, which runs inside patched
(the indexer's projections, then :func:`mla_inductor.lightning_indexer`, causal). The masks and
the position embeddings are built as ``DeepseekV32Model`` builds them, once per T and mode,
outside the timed calls (the model builds them once for all its layers).

ms = median of ``--iters`` calls after ``--warmup`` untimed ones, CUDA events
(:func:`mla_inductor.bench.timing.time_ms_calls`; the patched mode's first call compiles its
kernels); peak GiB = ``torch.cuda.max_memory_allocated`` over those calls minus what was
allocated before them (weights, inputs, mask). An out-of-memory prints ``OOM`` and the run goes
on. Needs the ``transformers`` extra. ``--tiny``: a small config (hidden 64, 4 heads, q_lora 32,
kv_lora 32, rope 16, topk 16) on the CPU in float32 (the op's reference backend), T 64 and 128,
on one CPU thread (:mod:`mla_inductor.threads`): a smoke run in seconds, no memory figures.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
from typing import NamedTuple, Optional

import torch

from .problems import require_sm90, require_transformers, run_threads
from .timing import time_ms_calls

# DeepSeek-V3.2's attention widths (its config.json); index_topk comes from --topk.
REAL = dict(hidden_size=7168, num_attention_heads=128, num_key_value_heads=128, q_lora_rank=1536,
            kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128,
            index_n_heads=64, index_head_dim=128)
TINY = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=32,
            kv_lora_rank=32, qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=16,
            index_n_heads=2, index_head_dim=32)
# The released config's rope_scaling (rope_theta 10000).
YARN = dict(rope_type="yarn", rope_theta=10000.0, factor=40.0,
            original_max_position_embeddings=4096, beta_fast=32.0, beta_slow=1.0, mscale=1.0,
            mscale_all_dim=1.0)
MODES = ("eager", "sdpa", "patched", "compiled", "patched+loss")
DEFAULT_MODES = MODES[:4]
UNPATCHED = ("eager", "sdpa")
INDEXER_ROWS = ("transformers' indexer alone (fwd)", "lightning indexer alone (fwd)")


class Inputs(NamedTuple):
    """One forward's inputs at T tokens, batch 1, as ``DeepseekV32Model`` passes them to a layer."""

    hidden_states: torch.Tensor  # [1, T, hidden_size], the layer's dtype, requires grad
    grad_output: torch.Tensor  # [1, T, hidden_size], the layer's dtype
    position_ids: torch.Tensor  # [1, T] int64, 0..T-1
    position_embeddings: tuple  # (cos, sin), each [1, T, qk_rope_head_dim], the layer's dtype


class Measurement(NamedTuple):
    ms: float  # median milliseconds per call
    peak_gib: Optional[float]  # peak memory over the calls, GiB; None off CUDA


def build_layer(sizes: dict, topk: int, device: torch.device, dtype: torch.dtype):
    """``(attention, rotary)``: a random-init ``DeepseekV32Attention`` (layer 0, its indexer
    included) of a one-layer ``DeepseekV32Config`` with ``sizes`` (:data:`REAL` or :data:`TINY`),
    ``index_topk = topk`` and :data:`YARN`, in ``dtype`` on ``device`` (the indexer's
    ``weights_proj`` in float32, as the model keeps it), and the model's
    ``DeepseekV32RotaryEmbedding``. Seeded: the same weights at every call."""
    from transformers import DeepseekV32Config
    from transformers.models.deepseek_v32 import modeling_deepseek_v32 as dsv32

    config = DeepseekV32Config(**sizes, index_topk=topk, num_hidden_layers=1,
                               rope_parameters=dict(YARN), attn_implementation="eager")
    torch.manual_seed(0)
    with torch.device(device):
        attn = dsv32.DeepseekV32Attention(config, layer_idx=0).to(dtype)
        rotary = dsv32.DeepseekV32RotaryEmbedding(config)
    attn.indexer.weights_proj.float()
    return attn, rotary


def make_inputs(attn, rotary, T: int) -> Inputs:
    """Seeded ``N(0, 1)`` hidden states and output gradient for ``attn`` (from :func:`build_layer`)
    at ``T`` tokens, with positions 0..T-1 and their RoPE from ``rotary``."""
    weight = attn.q_a_proj.weight
    gen = torch.Generator(device=weight.device).manual_seed(T)
    shape = (1, T, attn.hidden_size)
    x = torch.randn(shape, generator=gen, device=weight.device, dtype=weight.dtype)
    grad_output = torch.randn(shape, generator=gen, device=weight.device, dtype=weight.dtype)
    position_ids = torch.arange(T, device=weight.device)[None]
    return Inputs(x.requires_grad_(), grad_output, position_ids, rotary(x, position_ids))


@contextlib.contextmanager
def layer_mode(attn, mode: str):
    """Runs the block with ``attn`` in ``mode`` (one of :data:`MODES`): its config's
    ``attn_implementation`` set to ``eager`` or ``sdpa`` (which also picks the mask
    :func:`causal_mask` builds), or, for the other modes, ``sdpa`` with the layer switched by
    :func:`mla_inductor.integrations.transformers.switched` (its indexer loss on for
    ``patched+loss``)."""
    from mla_inductor.integrations import transformers as mla_hf

    attn.config._attn_implementation = "eager" if mode == "eager" else "sdpa"
    patched = mode not in UNPATCHED
    with (mla_hf.switched(attn, indexer_loss=mode == "patched+loss") if patched
          else contextlib.nullcontext()):
        yield


def visibility(inputs: Inputs):
    """What the patched model passes its layers in place of a mask at ``inputs`` (batch 1, no
    cache, no padding): each token's position, ``Visibility(positions [1, T], None)``."""
    from mla_inductor.integrations.transformers.visibility import Visibility

    return Visibility(inputs.position_ids, None)


def causal_mask(attn, inputs: Inputs) -> torch.Tensor:
    """The mask ``DeepseekV32Model`` builds for the layer's current ``attn_implementation``:
    ``[1, 1, T, T]``, additive in the hidden states' dtype for eager (0 = seen), bool for sdpa
    (True = seen)."""
    from transformers.masking_utils import create_causal_mask

    return create_causal_mask(config=attn.config, inputs_embeds=inputs.hidden_states,
                              attention_mask=None, cache=None, position_ids=inputs.position_ids,
                              allow_is_causal_skip=False)


def forward(attn, inputs: Inputs, mask: torch.Tensor) -> torch.Tensor:
    """The layer's output ``[1, T, hidden_size]``, called as ``DeepseekV32DecoderLayer`` calls it
    (no cache)."""
    out, _ = attn(hidden_states=inputs.hidden_states,
                  position_embeddings=inputs.position_embeddings, attention_mask=mask,
                  position_ids=inputs.position_ids)
    return out


def measure(fn, device: torch.device, warmup: int, iters: int) -> Optional[Measurement]:
    """``fn()`` timed by :func:`mla_inductor.bench.timing.time_ms_calls`, with its peak memory
    on CUDA; None after a CUDA out-of-memory (what the failed call held is freed)."""
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    try:
        ms = time_ms_calls(fn, warmup, iters, device)
    except torch.cuda.OutOfMemoryError:
        ms = None
    if ms is None:  # outside the handler, so that the traceback's frames are already released
        gc.collect()
        torch.cuda.empty_cache()
        return None
    return Measurement(ms, (torch.cuda.max_memory_allocated() - base) / 2**30 if cuda else None)


# The breakdown's categories: the first whose prefix names an op on a kernel's launch stack (the
# op that launched it, then its parents) takes the kernel's time.
CATEGORIES = (
    ("indexer scores", ("mla_inductor::lightning_indexer_scores",)),  # the loss's logits
    ("indexer", ("mla_inductor::lightning_indexer",)),
    ("indexer target", ("mla_inductor::indexer_target",)),  # the loss's target
    ("attention", ("mla_inductor::sparse_mla",)),
    ("projections", ("aten::mm", "aten::addmm", "aten::bmm", "aten::linear", "aten::matmul")),
)


def category(event, categories=CATEGORIES) -> str:
    """The category (of ``categories``, :data:`CATEGORIES` by default, else ``other``) of a
    profiler ``FunctionEvent``: the first category with an op of its prefixes on the event's
    stack, innermost first, where the indexer's and the attention's ops outrank the GEMMs they
    launch."""
    stack = []
    while event is not None:
        stack.append(event.name)
        event = event.cpu_parent
    for name, prefixes in categories:
        if any(op.startswith(prefixes) for op in stack):
            return name
    return "other"


def breakdown(step, device: torch.device, wall_ms: float, categories=CATEGORIES) -> dict:
    """Milliseconds of one ``step()`` per category of ``categories`` (:data:`CATEGORIES` by
    default; and ``other``), from one
    ``torch.profiler`` trace after a warm call: on CUDA the kernels' durations (each kernel counted
    for the op that launched it), on the CPU the ops' self times; ``busy`` is their sum, and
    ``idle = wall_ms - busy`` (``wall_ms``: the step's median time without the profiler; kernels
    do not overlap on one stream, so busy is the time the GPU computed)."""
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    step()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        step()
        if cuda:
            torch.cuda.synchronize()
    totals = {name: 0.0 for name, _ in categories} | {"other": 0.0}
    for event in prof.events():
        if cuda:
            us = sum(k.duration for k in event.kernels)
        else:
            us = event.self_cpu_time_total
        if us:
            totals[category(event, categories)] += us / 1e3
    totals["busy"] = sum(totals.values())
    totals["idle"] = wall_ms - totals["busy"]
    return totals


def _cells(m: Optional[Measurement]) -> str:
    if m is None:
        return "OOM | OOM"
    return f"{m.ms:.1f} | {'-' if m.peak_gib is None else f'{m.peak_gib:.2f}'}"


def _speedup(results: dict, mode: str) -> str:
    """The table's last column for ``mode``: patched's speedup over the best unpatched mode,
    compiled's and patched+loss's time over patched's; empty for the others or with nothing to
    compare."""
    if mode in ("compiled", "patched+loss"):
        base, other = results.get("patched"), results[mode]
        return f"{other.ms / base.ms:.2f}x patched's time" if base and other else ""
    if mode != "patched" or results["patched"] is None:
        return ""
    unpatched = [m for name, m in results.items() if name in UNPATCHED]
    if not unpatched:  # patched alone: nothing to compare
        return ""
    if all(m is None for m in unpatched):
        return "unpatched OOM"
    return f"{min(m.ms for m in unpatched if m) / results['patched'].ms:.1f}x"


def bench_hf(Ts, topk: int, tiny: bool = False, warmup: int = 2, iters: int = 5,
             show_breakdown: bool = False, modes=DEFAULT_MODES) -> None:
    """Prints the table (module docstring) for token counts ``Ts`` and ``index_topk = topk``: real
    sizes in bf16 on CUDA, or with ``tiny`` :data:`TINY` in float32 on the CPU; with
    ``show_breakdown``, after each T the patched steps' :func:`breakdown`; ``modes``: the rows of
    :data:`MODES` to run (the indexer rows always run)."""
    import transformers
    from transformers.models.deepseek_v32 import modeling_deepseek_v32 as dsv32

    from mla_inductor.integrations import transformers as mla_hf
    from mla_inductor.integrations.transformers.indexer import indexer_topk

    device = torch.device("cpu" if tiny else "cuda")
    dtype = torch.float32 if tiny else torch.bfloat16
    sizes = TINY if tiny else REAL
    attn, rotary = build_layer(sizes, topk, device, dtype)
    params = list(attn.parameters())
    where = "CPU" if tiny else torch.cuda.get_device_name()
    peak = ("no memory figures on the CPU" if tiny else
            "peak: max_memory_allocated over the calls minus the memory before them")
    print(f"# One transformers DeepseekV32Attention layer (its indexer included), forward + "
          f"backward, {datetime.date.today()}, {where}, torch {torch.__version__}, transformers "
          f"{transformers.__version__}, hidden {sizes['hidden_size']}, "
          f"{sizes['num_attention_heads']} heads, q_lora {sizes['q_lora_rank']}, kv_lora "
          f"{sizes['kv_lora_rank']}, rope {sizes['qk_rope_head_dim']}, nope "
          f"{sizes['qk_nope_head_dim']}, v {sizes['v_head_dim']}, index_topk {topk} "
          f"({sizes['index_n_heads']} index heads x {sizes['index_head_dim']}), YaRN factor 40, "
          f"batch 1, {str(dtype).removeprefix('torch.')}; ms: median of {iters} calls after "
          f"{warmup}; {peak}")
    print("| T | mode | ms | peak GiB | speedup (best unpatched ms / patched ms) |")
    print("|---|---|---|---|---|")
    for T in Ts:
        inputs = make_inputs(attn, rotary, T)
        results, parts = {}, {}
        for mode in modes:
            with layer_mode(attn, mode):
                mask = causal_mask(attn, inputs) if mode in UNPATCHED else visibility(inputs)
                layer = attn
                if mode == "compiled":
                    layer = torch.compile(attn, dynamic=False, fullgraph=True)

                def step():
                    for p in (inputs.hidden_states, *params):
                        p.grad = None
                    out = forward(layer, inputs, mask)
                    if mode == "patched+loss":
                        loss = mla_hf.indexer_loss(attn)
                        torch.autograd.backward((out, loss), (inputs.grad_output, None))
                    else:
                        out.backward(inputs.grad_output)

                results[mode] = measure(step, device, warmup, iters)
                if (show_breakdown and mode.startswith("patched")
                        and results[mode] is not None):
                    parts[mode] = breakdown(step, device, results[mode].ms)
            for p in (inputs.hidden_states, *params):
                p.grad = None
            del mask, step, layer
            speedup = _speedup(results, mode)
            print(f"| {T} | {mode} | {_cells(results[mode])} | {speedup} |", flush=True)
        unit = "kernel" if device.type == "cuda" else "CPU self"
        for mode, part in parts.items():
            print(f"| {T} | {mode}, {unit} ms: " + ", ".join(
                f"{name} {ms:.1f}" for name, ms in part.items()) +
                f"; busy / wall {part['busy'] / results[mode].ms:.2f} | | | |", flush=True)
        unpatched = any(mode in UNPATCHED for mode in modes)
        with layer_mode(attn, "sdpa"):
            mask = causal_mask(attn, inputs)[:, 0] if unpatched else None
        with torch.no_grad():
            q_resid = attn.q_a_layernorm(attn.q_a_proj(inputs.hidden_states))
        indexers = (
            lambda: attn.indexer(inputs.hidden_states, q_resid, inputs.position_embeddings, mask,
                                 inputs.position_ids),
            lambda: indexer_topk(attn.indexer, dsv32.apply_rotary_pos_emb, inputs.hidden_states,
                                 q_resid, inputs.position_embeddings, visibility(inputs)),
        )
        # transformers' own indexer runs inside the unpatched modes: timed only with them
        for row, fn in list(zip(INDEXER_ROWS, indexers))[0 if unpatched else 1:]:
            print(f"| {T} | {row} | {_cells(measure(fn, device, warmup, iters))} | |", flush=True)
        del inputs, mask, q_resid, indexers


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``hf`` subcommand's flags: ``--T``, ``--topk``, ``--warmup``, ``--iters``, ``--tiny``,
    ``--modes``, ``--breakdown``."""
    parser.add_argument("--T", type=int, nargs="+", default=None,
                        help="token counts T (batch 1); default: 4096 16384 (with --tiny: 64 128)")
    parser.add_argument("--topk", type=int, default=None,
                        help="the indexer's index_topk; default: 2048 (with --tiny: 16)")
    parser.add_argument("--warmup", type=int, default=2,
                        help="untimed calls per T and mode (the patched mode's first call "
                             "compiles its kernels); default: 2")
    parser.add_argument("--iters", type=int, default=5,
                        help="timed calls per T and mode, the median reported; default: 5")
    parser.add_argument("--tiny", action="store_true",
                        help="a small config on the CPU in float32, one CPU thread: a smoke run "
                             "in seconds")
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(DEFAULT_MODES),
                        help="the layer's modes to time; default: eager sdpa patched compiled "
                             "(patched+loss: patched with the indexer loss on)")
    parser.add_argument("--breakdown", action="store_true",
                        help="after each T, the patched steps' time per part (indexer, "
                             "attention, projections, other) from a profiler trace, and idle")


def run(args: argparse.Namespace) -> None:
    """Runs the subcommand for parsed flags (:func:`add_arguments`). Exits with a message when the
    sm90 kernels cannot run here (unless ``--tiny``) or transformers is not installed."""
    if not args.tiny:
        require_sm90("kernels", tiny=True)
    require_transformers("hf")
    with run_threads(args.tiny):
        bench_hf(args.T or ([64, 128] if args.tiny else [4096, 16384]),
                 args.topk or (16 if args.tiny else 2048), tiny=args.tiny, warmup=args.warmup,
                 iters=args.iters, show_breakdown=args.breakdown, modes=tuple(args.modes))
