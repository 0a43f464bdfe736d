"""hf-glm5-next: one transformers GLM-5.3-Flash DSA layer, unpatched (eager, sdpa) against patched, compiled and FlexAttention.

transformers' ``Glm5NextTextAttention`` (``models/glm5_next``, an ``indexed_attention`` layer
with its pooled indexer) at GLM-5.3-Flash's sizes (hidden 4096, 64 heads, q_lora 1536, kv_lora
512, no RoPE, ``qk_nope_head_dim`` = ``v_head_dim`` = 256; an indexer of 32 heads x 128,
``index_topk`` 2048, pools of ``--kpool`` 4 keys with the tail), random init (weights N(0, 0.02),
norms 1, the pools' position biases N(0, 0.5)), bf16, batch 1, forward + backward (hidden states
requiring grad, a random output gradient, every parameter's gradient) at each T, in these modes:

- ``eager``, ``sdpa``: the layer as transformers runs it with that ``attn_implementation`` (its
  indexer's float32 scores ``[1, T, 32, T/kpool]`` and visibility ``[1, T, T]``; keys and values
  expanded per head, ``[1, 64, T, 256]`` each, under a ``[1, 1, T, T]`` mask built from the
  selection), run until they run out of memory (larger T are then not tried);
- ``patched``: the same layer after :func:`mla_inductor.integrations.transformers.apply`
  (:mod:`mla_inductor.integrations.transformers.glm5_next`: the pooled keys, the pools'
  top-k on ``lightning_indexer``, the slots by index arithmetic, the absorbed attention on
  ``sparse_mla`` at ``d_qk = d_v = 512``), given the 2D padding mask the model passes;
- ``compiled``: ``patched`` under ``torch.compile(fullgraph=True)`` (compiled once per T,
  outside the timed calls), what a user who compiles the model runs;
- ``flex``: ``patched`` with the attention on FlexAttention instead of ``sparse_mla``
  (:func:`mla_inductor.bench.flex.flex_sparse_mla`: a block mask from each call's slots), up to
  ``--flex-max-T`` (it computes every key block a query block's slots touch);
- ``patched+loss``, ``compiled+loss`` (only when asked for with ``--modes``): with the indexer
  loss on (``apply(model, indexer_loss=True)``), the step backpropagating it with the output's
  gradient.

The last column is the mode's time over ``compiled``'s (above 1: slower than compiled). Two more
rows time the indexer alone (forward, no grad): ``transformers' indexer alone (fwd)`` (the
module's own forward, O(T²) memory) while an unpatched mode still fits, and ``pooled indexer alone
(fwd)`` (:func:`mla_inductor.integrations.transformers.glm5_next.select`: keys, pooling, the
pools' top-k, the slots).

With ``--breakdown``, after each T the patched step's kernel time per part from a profiler trace:
``pooling`` (the softmax-weighted sum of each pool's keys), ``slots`` (the pools' and the tail's
expansion to key indices), ``indexer`` (its projections, the pooled keys' gather, the scores and
top-k), ``attention`` (``sparse_mla``), ``projections`` (the other GEMMs), ``other``, and ``busy /
wall``; then the anchors, each in the same process:

- the attention op alone on the patched step's own inputs: forward and backward TFLOPS on the
  valid slots (``2·H·n_valid·(d_qk + d_v)`` forward, ``2·H·n_valid·(3·d_qk + 2·d_v)`` backward),
  and the same at DeepSeek-V3.2's shapes and T (H 128, d_qk 576, d_v 512, topk 2048, random
  indices, S = T; at the largest T / 2**k that fits where T does not); their ratio is the
  attention's share of the V3.2 kernels' rate;
- the lightning indexer alone on the patched step's own call (32 heads over the T/kpool pooled
  keys, topk 2048/kpool, each token's pools up to ``(t + 1) // kpool - 1``), TFLOPS on the
  visible (token, pool) pairs (``2·H·D`` each; the top-k's time included), and the same at
  DeepSeek-V3.2's indexer configuration on the same T x T/kpool problem (64 heads of 128, topk
  2048, the same visibility); their ratio is the pooled indexer's share of the lightning
  indexer's rate.

ms = median of ``--iters`` calls after ``--warmup`` untimed ones, CUDA events; peak GiB =
``torch.cuda.max_memory_allocated`` over those calls minus what was allocated before them. An
out-of-memory prints ``OOM``, and an error of FlexAttention ``fails:`` with the error's first
line; the run goes on. ``--json PATH`` also writes every row, breakdown and anchor as JSON. Needs
the ``transformers`` extra. ``--tiny``: a small config (hidden 64, 4 heads, kv_lora 32, index 32
heads x 16, topk 16) on the CPU in float32 (eager, sdpa, patched and compiled; FlexAttention has
no CPU backward), T 64 and 128, on one CPU thread (:mod:`mla_inductor.threads`): a smoke run of
about a minute (mostly compiling).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
from typing import NamedTuple

import torch

from .flex import failure
from .hf import _cells, breakdown, measure
from .hf_v4 import op_rates, rates_line, v32_rates
from .problems import require_sm90, require_transformers, run_threads
from .timing import time_ms

# GLM-5.3-Flash's DSA layer (transformers' Glm5NextTextConfig defaults; the released checkpoint's
# pools are reported at 4 keys: --kpool).
REAL = dict(hidden_size=4096, num_attention_heads=64, num_key_value_heads=64, q_lora_rank=1536,
            kv_lora_rank=512, qk_nope_head_dim=256, v_head_dim=256, index_n_heads=32,
            index_head_dim=128, index_topk=2048)
TINY = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=32,
            kv_lora_rank=32, qk_nope_head_dim=16, v_head_dim=16, index_n_heads=32,
            index_head_dim=16, index_topk=16)
MODES = ("eager", "sdpa", "patched", "compiled", "flex", "patched+loss", "compiled+loss")
DEFAULT_MODES = MODES[:5]
UNPATCHED = ("eager", "sdpa")
INDEXER_ROWS = ("transformers' indexer alone (fwd)", "pooled indexer alone (fwd)")
# The breakdown's categories (hf's mechanism): the first whose prefix names an op or a range on a
# kernel's launch stack takes the kernel's time.
CATEGORIES = (
    ("pooling", ("glm5::pooling",)),
    ("slots", ("glm5::slots",)),
    ("indexer", ("mla_inductor::lightning_indexer", "glm5::indexer")),
    ("indexer target", ("mla_inductor::indexer_target",)),
    ("attention", ("mla_inductor::sparse_mla",)),
    ("projections", ("aten::mm", "aten::addmm", "aten::bmm", "aten::linear", "aten::matmul")),
)
V32_INDEXER = dict(heads=64, topk=2048)  # DeepSeek-V3.2's lightning indexer (D 128)


class Inputs(NamedTuple):
    """One forward's inputs at T tokens, batch 1, as ``Glm5NextTextModel`` passes them to a DSA
    layer (no RoPE: no position embeddings)."""

    hidden_states: torch.Tensor  # [1, T, hidden_size], requires grad
    grad_output: torch.Tensor  # [1, T, hidden_size]
    attention_mask: torch.Tensor  # [1, T] bool, all True: the model's padding mask


def build_layer(sizes: dict, kpool: int, device: torch.device, dtype: torch.dtype):
    """A seeded random-init ``Glm5NextTextAttention`` (layer 0, a ``full`` indexer) of a one-layer
    ``Glm5NextTextConfig`` with ``sizes`` (:data:`REAL` or :data:`TINY`) and ``index_kpool =
    kpool`` (the tail always selected), its weights N(0, 0.02), norms 1 (the indexer's key
    LayerNorm's bias 0), the pools' position biases N(0, 0.5), in ``dtype`` on ``device``."""
    from transformers import Glm5NextTextConfig
    from transformers.models.glm5_next import modeling_glm5_next as glm5_next

    config = Glm5NextTextConfig(**sizes, index_kpool=kpool, num_hidden_layers=1,
                                layer_types=["indexed_attention"], indexer_types=["full"],
                                mlp_layer_types=["dense"], attn_implementation="eager")
    torch.manual_seed(0)
    with torch.device(device):
        attn = glm5_next.Glm5NextTextAttention(config, layer_idx=0)
    with torch.no_grad():
        for name, p in attn.named_parameters():
            if name.endswith("k_norm.bias"):
                p.zero_()
            elif "norm" in name:
                p.fill_(1.0)
            elif name.endswith("index_kpool_compress_ape"):
                p.normal_(0, 0.5)
            else:
                p.normal_(0, 0.02)
    return attn.to(dtype)


def make_inputs(attn, T: int) -> Inputs:
    """Seeded ``N(0, 1)`` hidden states and output gradient for ``attn`` at ``T`` tokens, and the
    padding mask of an unpadded batch of one."""
    weight = attn.q_a_proj.weight
    gen = torch.Generator(device=weight.device).manual_seed(T)
    shape = (1, T, attn.config.hidden_size)
    x = torch.randn(shape, generator=gen, device=weight.device, dtype=weight.dtype)
    grad_output = torch.randn(shape, generator=gen, device=weight.device, dtype=weight.dtype)
    mask = torch.ones(1, T, dtype=torch.bool, device=weight.device)
    return Inputs(x.requires_grad_(), grad_output, mask)


@contextlib.contextmanager
def layer_mode(attn, mode: str):
    """Runs the block with ``attn`` in ``mode`` (:data:`MODES`): unpatched with that attention
    implementation, or switched by :func:`mla_inductor.integrations.transformers.switched` (the
    indexer loss on for the ``+loss`` modes), its attention op replaced by
    :func:`mla_inductor.bench.flex.flex_sparse_mla` for ``flex``."""
    from mla_inductor.integrations import transformers as mla_hf
    from mla_inductor.integrations.transformers import glm5_next

    from .flex import flex_sparse_mla

    attn.config._attn_implementation = "eager" if mode == "eager" else "sdpa"
    if mode in UNPATCHED:
        yield
        return
    op = glm5_next.sparse_mla
    try:
        if mode == "flex":
            glm5_next.sparse_mla = flex_sparse_mla
        with mla_hf.switched(attn, indexer_loss=mode.endswith("+loss")):
            yield
    finally:
        glm5_next.sparse_mla = op


@contextlib.contextmanager
def labelled_parts():
    """Profiler ranges ``glm5::indexer``, ``glm5::pooling`` and ``glm5::slots`` around the switched
    layer's selection, its pooling and its expansion to slots (for :data:`CATEGORIES`), for the
    block."""
    from mla_inductor.integrations.transformers import glm5_next

    labels = {"select": "glm5::indexer", "softmax_pool": "glm5::pooling",
              "expand_pools": "glm5::slots"}
    originals = {name: getattr(glm5_next, name) for name in labels}

    def labelled(fn, label):
        def call(*args, **kwargs):
            with torch.profiler.record_function(label):
                return fn(*args, **kwargs)
        return call

    for name, label in labels.items():
        setattr(glm5_next, name, labelled(originals[name], label))
    try:
        yield
    finally:
        for name, fn in originals.items():
            setattr(glm5_next, name, fn)


def captured_calls(step) -> dict:
    """``{"sparse_mla": (args, kwargs), "lightning_indexer": (args, kwargs)}``: the first call of
    each op by the switched layer in one ``step()``."""
    from mla_inductor.integrations.transformers import glm5_next

    seen = {}
    originals = {name: getattr(glm5_next, name) for name in ("sparse_mla", "lightning_indexer")}

    def recording(name, op):
        def call(*args, **kwargs):
            seen.setdefault(name, (args, kwargs))
            return op(*args, **kwargs)
        return call

    for name, op in originals.items():
        setattr(glm5_next, name, recording(name, op))
    try:
        step()
    finally:
        for name, op in originals.items():
            setattr(glm5_next, name, op)
    return seen


def kernel_ms(fn) -> dict:
    """``{kernel name: ms}`` of one ``fn()`` on CUDA after a warm call, from a ``torch.profiler``
    trace, largest first (names cut to 60 characters)."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    totals: dict = {}
    for event in prof.events():
        for kernel in event.kernels:
            name = kernel.name[:60]
            totals[name] = totals.get(name, 0.0) + kernel.duration / 1e3
    return dict(sorted(totals.items(), key=lambda kv: -kv[1]))


def indexer_tflops(q, k, weights, topk: int, q_positions) -> tuple[float, float, dict]:
    """``(ms, TFLOPS, {kernel: ms})`` of :func:`mla_inductor.lightning_indexer` ``(q [1, T, H, D],
    k [1, S, D], weights, topk, causal, q_positions [1, T])`` alone on CUDA (median of
    ``triton.testing.do_bench``), the FLOPs ``2·H·D`` per visible (token, key) pair, and the
    call's kernel times on CUDA (:func:`kernel_ms`: the scores' kernel apart from the select's;
    ``{}`` on the CPU)."""
    from mla_inductor import lightning_indexer

    H, D, S = q.shape[-2], q.shape[-1], k.shape[-2]
    pairs = (q_positions.long() + 1).clamp(0, S).sum().item()

    def call():
        return lightning_indexer(q, k, weights, topk, causal=True, q_positions=q_positions)

    ms = time_ms(call)
    return ms, 2 * H * D * pairs / ms / 1e9, kernel_ms(call) if q.is_cuda else {}


def _kernels_line(kernels: dict) -> str:
    """The three longest kernels of :func:`kernel_ms`'s dict, ``"name ms, ..."``."""
    return ", ".join(f"{name} {ms:.2f} ms" for name, ms in list(kernels.items())[:3]) or "-"


def anchors(step, T: int) -> dict:
    """The breakdown's anchors (module docstring) on the patched ``step()``'s own op calls:
    ``{"attention": op_rates, "attention_v32": op_rates and its T, "indexer": ms and TFLOPS,
    "indexer_v32": the same, "lines": the lines of text the table prints}``."""
    calls = captured_calls(step)
    (iq, ik, iw, topk), ikw = calls["lightning_indexer"]
    positions = ikw["q_positions"]
    args, kwargs = calls.pop("sparse_mla")
    ours = op_rates(*args, **kwargs)
    del args, kwargs  # the layer's q and o (GiBs at long T) before V3.2's problem is made
    v32, v32_T = _fitting(v32_rates, T)
    ms, tflops, kernels = indexer_tflops(iq, ik, iw, topk, positions)
    gen = torch.Generator(device=iq.device).manual_seed(1)
    H, D = V32_INDEXER["heads"], iq.shape[-1]
    vq = torch.randn(1, T, H, D, device=iq.device, generator=gen).to(iq.dtype)
    vk = torch.randn(ik.shape, device=iq.device, generator=gen).to(ik.dtype)
    vw = torch.randn(1, T, H, device=iq.device, generator=gen) * H**-0.5
    v32_ms, v32_tflops_, v32_kernels = indexer_tflops(vq, vk, vw, V32_INDEXER["topk"], positions)
    lines = [
        "attention op alone: " + rates_line(ours),
        (f"the op at DeepSeek-V3.2's shapes (T {v32_T}, H 128, d_qk 576, d_v 512, topk 2048, "
         f"random): {rates_line(v32)}; attention / V3.2 rate: forward "
         f"{ours['fwd_tflops'] / v32['fwd_tflops']:.2f}, backward "
         f"{ours['bwd_tflops'] / v32['bwd_tflops']:.2f}"),
        (f"pooled indexer alone ({iq.shape[-2]} heads over {ik.shape[-2]} pools, topk {topk}): "
         f"{ms:.2f} ms ({tflops:.0f} TFLOPS); kernels: {_kernels_line(kernels)}"),
        (f"lightning indexer at V3.2's configuration ({H} heads, topk {V32_INDEXER['topk']}) "
         f"over the same {T} x {ik.shape[-2]}: {v32_ms:.2f} ms ({v32_tflops_:.0f} TFLOPS); "
         f"pooled / V3.2 rate {tflops / v32_tflops_:.2f}; kernels: {_kernels_line(v32_kernels)}"),
    ]
    return {"attention": ours, "attention_v32": dict(v32, T=v32_T),
            "indexer": {"ms": ms, "tflops": tflops, "kernels": kernels},
            "indexer_v32": {"ms": v32_ms, "tflops": v32_tflops_, "kernels": v32_kernels},
            "lines": lines}


def _fitting(fn, T: int) -> tuple:
    """``(fn(n), n)`` for ``n = T``, or where that runs out of GPU memory (DeepSeek-V3.2's
    attention at T 131072 holds about 75 GB) the largest ``T / 2**k`` that fits."""
    n = T
    while True:
        try:
            return fn(n), n
        except torch.cuda.OutOfMemoryError:
            torch.cuda.empty_cache()
            n //= 2


def bench_hf_glm5_next(Ts, kpool: int = 4, tiny: bool = False, warmup: int = 2, iters: int = 5,
                       show_breakdown: bool = False, modes=DEFAULT_MODES,
                       flex_max_T: int = 32768) -> dict:
    """Prints the table (module docstring) for token counts ``Ts`` (ascending) and pools of
    ``kpool`` keys: real sizes in bf16 on CUDA, or with ``tiny`` :data:`TINY` in float32 on the
    CPU. Returns what it printed as a dict (``header``, ``rows``: one per T and mode,
    ``breakdown``, ``anchors``)."""
    import transformers

    from mla_inductor.integrations import transformers as mla_hf
    from mla_inductor.integrations.transformers import glm5_next

    device = torch.device("cpu" if tiny else "cuda")
    dtype = torch.float32 if tiny else torch.bfloat16
    sizes = TINY if tiny else REAL
    attn = build_layer(sizes, kpool, device, dtype)
    params = list(attn.parameters())
    where = "CPU" if tiny else torch.cuda.get_device_name()
    header = (f"One transformers Glm5NextTextAttention layer (its pooled indexer included), "
              f"forward + backward, {datetime.date.today()}, {where}, torch {torch.__version__}, "
              f"transformers {transformers.__version__}, hidden {sizes['hidden_size']}, "
              f"{sizes['num_attention_heads']} heads, kv_lora {sizes['kv_lora_rank']}, nope = v "
              f"{sizes['v_head_dim']}, no RoPE, index_topk {sizes['index_topk']} "
              f"({sizes['index_n_heads']} index heads x {sizes['index_head_dim']}), kpool "
              f"{kpool}, batch 1, {str(dtype).removeprefix('torch.')}; ms: median of {iters} "
              f"calls after {warmup}")
    report = {"header": header, "rows": [], "breakdown": [], "anchors": []}
    print(f"# {header}")
    print("| T | mode | ms | peak GiB | mode ms / compiled ms (above 1: slower than compiled) |")
    print("|---|---|---|---|---|")
    out_of_memory = set()  # modes that ran out of memory at a smaller T
    for T in sorted(Ts):
        inputs = make_inputs(attn, T)
        results, parts, notes, extra = {}, {}, {}, {}
        for mode in modes:
            if mode in out_of_memory:
                results[mode], notes[mode] = None, "OOM at a smaller T | -"
                continue
            if mode == "flex" and T > flex_max_T:
                results[mode], notes[mode] = None, f"not run (T > --flex-max-T {flex_max_T}) | -"
                continue
            with layer_mode(attn, mode):
                layer = attn
                if mode.startswith("compiled"):
                    layer = torch.compile(attn, dynamic=False, fullgraph=True)

                def step():
                    for p in (inputs.hidden_states, *params):
                        p.grad = None
                    out = layer(hidden_states=inputs.hidden_states,
                                attention_mask=inputs.attention_mask)[0]
                    if mode.endswith("+loss"):
                        loss = mla_hf.indexer_loss(attn)
                        torch.autograd.backward((out, loss), (inputs.grad_output, None))
                    else:
                        out.backward(inputs.grad_output)

                try:
                    results[mode] = measure(step, device, warmup, iters)
                except Exception as e:  # FlexAttention's compile may refuse the shape
                    if mode != "flex":
                        raise
                    results[mode], notes[mode] = None, "fails: " + failure(e) + " | -"
                if results[mode] is None and mode not in notes:
                    out_of_memory.add(mode)
                if show_breakdown and mode == "patched" and results[mode] is not None:
                    with labelled_parts():
                        parts[mode] = breakdown(step, device, results[mode].ms, CATEGORIES)
                    if not tiny:
                        extra = anchors(step, T)
            for p in (inputs.hidden_states, *params):
                p.grad = None
            del step, layer
        base = results.get("compiled")
        for mode in modes:
            m = results[mode]
            ratio = f"{m.ms / base.ms:.2f}x" if (base and m and mode != "compiled") else ""
            cells = notes.get(mode) or _cells(m)
            print(f"| {T} | {mode} | {cells} | {ratio} |", flush=True)
            report["rows"].append({"T": T, "mode": mode, "ms": m.ms if m else None,
                                   "peak_gib": m.peak_gib if m else None,
                                   "note": notes.get(mode, "").removesuffix(" | -") or None})
        unit = "CPU self" if tiny else "kernel"
        for mode, part in parts.items():
            print(f"| {T} | {mode}, {unit} ms: " + ", ".join(
                f"{name} {ms:.1f}" for name, ms in part.items()) +
                f"; busy / wall {part['busy'] / results[mode].ms:.2f} | | | |", flush=True)
            report["breakdown"].append({"T": T, "mode": mode, "unit": unit, "ms": part})
        for line in extra.get("lines", ()):
            print(f"| {T} | {line} | | | |", flush=True)
        if extra:
            report["anchors"].append({"T": T, **extra})
        _indexer_rows(attn, inputs, device, warmup, iters, report,
                      unpatched=any(m in modes and m not in out_of_memory for m in UNPATCHED))
        del inputs
    return report


def _indexer_rows(attn, inputs: Inputs, device, warmup: int, iters: int, report: dict,
                  unpatched: bool) -> None:
    """Prints (and adds to ``report``) the indexer-alone rows of the table at ``inputs``'s T:
    transformers' indexer only while an unpatched mode still fits (``unpatched``)."""
    from mla_inductor.integrations.transformers import glm5_next

    T = inputs.hidden_states.shape[1]
    with torch.no_grad():
        x = inputs.hidden_states.detach()
        q_resid = attn.q_a_layernorm(attn.q_a_proj(x))
        mask = inputs.attention_mask
        indexers = (lambda: attn.indexer(x, q_resid, mask, None),
                    lambda: glm5_next.select(attn.indexer, x, q_resid, mask, None))
        for row, fn in list(zip(INDEXER_ROWS, indexers))[0 if unpatched else 1:]:
            m = measure(fn, device, warmup, iters)
            print(f"| {T} | {row} | {_cells(m)} | |", flush=True)
            report["rows"].append({"T": T, "mode": row, "ms": m.ms if m else None,
                                   "peak_gib": m.peak_gib if m else None, "note": None})


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``hf-glm5-next`` subcommand's flags: ``--T``, ``--kpool``, ``--modes``,
    ``--flex-max-T``, ``--warmup``, ``--iters``, ``--tiny``, ``--breakdown``, ``--json``."""
    parser.add_argument("--T", type=int, nargs="+", default=None,
                        help="token counts T (batch 1); default: 16384 32768 65536 131072 (with "
                             "--tiny: 64 128)")
    parser.add_argument("--kpool", type=int, default=4,
                        help="keys per pool (index_kpool); default: 4 (transformers' config "
                             "default is 16)")
    parser.add_argument("--modes", nargs="+", choices=MODES, default=None,
                        help="default: eager sdpa patched compiled flex (with --tiny: eager sdpa "
                             "patched compiled); patched+loss, compiled+loss: with the indexer "
                             "loss")
    parser.add_argument("--flex-max-T", type=int, default=32768,
                        help="the largest T FlexAttention runs at; default: 32768")
    parser.add_argument("--warmup", type=int, default=2, help="untimed calls; default: 2")
    parser.add_argument("--iters", type=int, default=5,
                        help="timed calls, the median reported; default: 5")
    parser.add_argument("--tiny", action="store_true",
                        help="a small config on the CPU in float32, one CPU thread: a smoke run "
                             "of about a minute (mostly compiling)")
    parser.add_argument("--breakdown", action="store_true",
                        help="after each T, the patched step's kernel time per part, and the "
                             "attention's and the pooled indexer's TFLOPS against DeepSeek-V3.2's "
                             "in the same process")
    parser.add_argument("--json", metavar="PATH", default=None,
                        help="also write the rows, breakdowns and anchors to PATH as JSON")


def run(args: argparse.Namespace) -> None:
    """Runs the subcommand for parsed flags (:func:`add_arguments`). Exits with a message when the
    sm90 kernels cannot run here (unless ``--tiny``) or transformers is not installed."""
    if not args.tiny:
        require_sm90("kernels", tiny=True)
    require_transformers("hf-glm5-next", "transformers.models.glm5_next")
    modes = tuple(args.modes or (DEFAULT_MODES[:4] if args.tiny else DEFAULT_MODES))
    with run_threads(args.tiny):
        report = bench_hf_glm5_next(
            args.T or ([64, 128] if args.tiny else [16384, 32768, 65536, 131072]),
            kpool=args.kpool, tiny=args.tiny, warmup=args.warmup, iters=args.iters,
            show_breakdown=args.breakdown, modes=modes, flex_max_T=args.flex_max_T)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
