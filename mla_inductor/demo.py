"""The main job: ``python -m mla_inductor.demo``.

Trains a small causal byte-level language model whose attention is DeepSeek Sparse Attention
(DSA) over absorbed-form MLA, compiled with ``torch.compile(fullgraph=True)``, on real text that
every Python install has offline (the standard library's own source files), then evaluates and
samples under ``torch.no_grad()`` with the same compiled model.

Per layer (shapes for batch ``B``, tokens ``T``, ``H`` heads):

- a lightning indexer (:func:`mla_inductor.lightning_indexer`: ``index_heads`` heads of width
  ``d_index``, ``score[t, s] = sum_h w[t, h] relu(q_idx[t, h] . k_idx[s])`` with head weights
  ``w`` from the token) selects each token's top ``topk`` among the tokens ``s <= t`` (causal);
  slots beyond a token's ``t + 1`` candidates are ``-1`` (empty); with ``--indexer-precision
  fp8`` it selects from fp8 queries and keys quantised per row (:func:`mla_inductor.quantize_fp8`,
  as DeepSeek-V3.2-Exp's inference code runs its indexer). It learns as in DeepSeek-V3.2's
  sparse training stage: its input is detached, and its scores of the selected slots are pulled
  towards the main
  attention's head-summed, L1-normalised probabilities of those slots
  (:func:`mla_inductor.indexer_target`, from the lse the attention returns) by
  :func:`mla_inductor.indexer_kl_loss`, weighted by ``indexer_loss_weight`` and added to the LM
  loss in the same compiled graph;
- the latent ``c_kv [B, T, d_latent]`` and a rotary part ``k_rope [B, T, d_rope]`` form
  ``kv [B, T, d_latent + d_rope]`` (one latent head, MQA); queries are absorbed into the latent
  space, ``q [B, T, H, d_latent + d_rope]``;
- :func:`mla_inductor.sparse_mla` attends over the selected rows with ``d_qk = d_latent + d_rope``
  and ``d_v = d_latent``, followed by the output up-projection ``[H * d_latent] -> d_model``.

Sources: the DSA indexer, its KL objective and absorbed MLA follow DeepSeek-V3.2-Exp
(DeepSeek-AI, 2025, section 2.1) and
DeepSeek-V2 (arXiv:2405.04434); the rotary embedding is RoFormer (arXiv:2104.09864).

The threshold the policy picks for each captured graph is read from the ``mla_inductor``
logger's INFO records; graph breaks and compiled-graph counts from ``torch._dynamo``'s counters.
The indexer's recall (:meth:`ByteLM.indexer_recall`) is measured on a held-out batch before and
after training. Exits non-zero when the training loss did not fall, the recall did not rise (when
the indexer is trained), or there was a graph break.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import logging
import math
import os
import sys
import time
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from . import backends, logs
from .threads import cpu_threads, default_threads
from .api import (indexer_kl_loss, indexer_target, lightning_indexer, lightning_indexer_scores,
                  sparse_mla)
from .quantize import quantize_fp8

VOCAB = 256  # bytes
PROMPT = b"def __init__(self"


@dataclasses.dataclass
class Config:
    """Run settings; ``None`` fields take device-dependent defaults (:meth:`resolved`)."""

    steps: int = 250
    batch: int = 8
    seq_len: int = 128
    d_model: int = 128
    d_latent: Optional[int] = None
    d_rope: Optional[int] = None
    heads: int = 4
    layers: int = 2
    topk: int = 32
    index_heads: int = 4
    d_index: Optional[int] = None
    indexer_loss_weight: float = 1.0
    lr: float = 3e-3
    val_batches: int = 8
    sample_tokens: int = 64
    temperature: float = 0.8
    device: str = "cuda" if torch.cuda.is_available() else "cpu"
    dtype: Optional[str] = None
    threads: Optional[int] = None
    seed: int = 0
    deterministic: bool = False  # torch.use_deterministic_algorithms(True) for the run
    indexer_precision: str = "bf16"  # "fp8": the indexer selects from per-row fp8 q and k

    def resolved(self) -> "Config":
        """On CUDA: bfloat16 and DeepSeek's d_latent 512, d_rope 64 and index head width
        d_index 128 (the shapes the GPU kernels implement); elsewhere float32, d_latent 64,
        d_rope 16, d_index 16 (the reference backend takes any) and one CPU thread
        (:func:`mla_inductor.threads.default_threads`, which says why)."""
        cuda = torch.device(self.device).type == "cuda"

        def pick(value, on_cuda, elsewhere):
            return value if value is not None else on_cuda if cuda else elsewhere

        return dataclasses.replace(
            self,
            d_latent=pick(self.d_latent, 512, 64),
            d_rope=pick(self.d_rope, 64, 16),
            d_index=pick(self.d_index, 128, 16),
            dtype=pick(self.dtype, "bfloat16", "float32"),
            threads=default_threads(self.device) if self.threads is None else self.threads,
        )


@dataclasses.dataclass
class Report:
    """What :func:`run` measured (losses are natural-log cross-entropy per byte)."""

    device: str
    dtype: str
    backend_requested: str
    backend_forward: str
    backend_backward: str
    thresholds: dict  # graph kind ("training" / "inference") -> sorted distinct thresholds
    graph_breaks: int
    graphs_train: int  # dynamo graphs compiled while training (1 = no recompile)
    graphs_eval: int  # ... during evaluation and sampling (1 = the no_grad graph, no recompile)
    losses: list  # the LM loss of each step
    loss_start: float  # mean training loss of the first steps (window of max(1, steps // 10))
    loss_end: float  # ... of the last steps
    indexer_losses: list  # the indexer's KL loss of each step (mean over layers; empty untrained)
    recall_start: float  # ByteLM.indexer_recall on the held-out batch before training
    recall_end: float  # ... after training
    indexer_trained: bool  # indexer_loss_weight > 0
    first_step_s: float  # the first training step, compile included
    train_tokens_per_s: float  # steps after the first
    val_loss: float
    sample: str

    @property
    def ok(self) -> bool:
        """No graph break, the mean loss of the last steps is below that of the first, and the
        indexer's recall rose when it was trained (and measured: NaN when ``seq_len <= topk``)."""
        recall_ok = (not self.indexer_trained or math.isnan(self.recall_start)
                     or self.recall_end > self.recall_start)
        return self.graph_breaks == 0 and self.loss_end < self.loss_start and recall_ok


# ---------------------------------------------------------------------------------------------
# Model


def rope_tables(T: int, dim: int) -> tuple[Tensor, Tensor]:
    """``cos, sin [T, dim // 2]`` float32 for RoFormer's rotary embedding (base 10000)."""
    inv_freq = 10000.0 ** (-torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    angles = torch.arange(T, dtype=torch.float32)[:, None] * inv_freq
    return angles.cos(), angles.sin()


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotates pairs ``(x[..., i], x[..., i + dim/2])`` by the angles in ``cos``/``sin``, which
    broadcast against ``x[..., : dim / 2]``."""
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).to(x.dtype)


class Indexer(nn.Module):
    """DSA's lightning indexer: ``(indices [B, T, k] int32, logits [B, T, k] float32)``, ``k =
    min(topk, T)``: each token's highest-scoring tokens ``j <= t`` (ascending, then -1 where it
    has fewer than ``k``) and their scores.

    ``score[t, j] = sum_h w[t, h] relu(q[t, h] . k[j])`` over ``heads`` index heads of width
    ``d_index`` (DeepSeek-V3.2-Exp, section 2.1), ``w = weights(x) * (heads * d_index)**-0.5``,
    of the detached input, so the indexer's gradient (from :func:`mla_inductor.indexer_kl_loss`
    on ``logits``) reaches its projections only, as in DSA. The selection is
    :func:`mla_inductor.lightning_indexer` (causal), and the logits are its scores of the
    selected slots (``return_scores``: differentiable, their backward the
    :func:`mla_inductor.lightning_indexer_scores` backward; 0 on -1 slots, which the loss does
    not read). With ``precision`` ``"fp8"`` the selection runs on ``q`` and ``k`` quantised per
    row by :func:`mla_inductor.quantize_fp8` (the fp8 indexer of DeepSeek-V3.2-Exp's inference
    code) and the logits are :func:`mla_inductor.lightning_indexer_scores` of the unquantised
    ``q`` and ``k`` at its slots (the loss stays in the model's dtype).
    """

    def __init__(self, d_model: int, d_index: int, heads: int, topk: int,
                 precision: str = "bf16"):
        super().__init__()
        self.wq = nn.Linear(d_model, heads * d_index, bias=False)
        self.wk = nn.Linear(d_model, d_index, bias=False)
        self.weights = nn.Linear(d_model, heads, bias=False)
        self.heads, self.d_index, self.topk = heads, d_index, topk
        self.precision = precision

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        B, T, _ = x.shape
        x = x.detach()
        q = self.wq(x).view(B, T, self.heads, self.d_index)
        k = self.wk(x).to(q.dtype)
        w = self.weights(x).float() * (self.heads * self.d_index) ** -0.5
        topk = min(self.topk, T)
        if self.precision != "fp8":
            return lightning_indexer(q, k, w, topk, causal=True, return_scores=True)
        (q8, q_scale), (k8, k_scale) = quantize_fp8(q), quantize_fp8(k)
        indices = lightning_indexer(q8, k8, w.detach(), topk, causal=True, q_scale=q_scale,
                                    k_scale=k_scale)
        return indices, lightning_indexer_scores(q, k, w, indices)


class SparseMLA(nn.Module):
    """Absorbed-form MLA attention over the indexer's top-k tokens."""

    def __init__(self, cfg: Config, dtype: torch.dtype):
        super().__init__()
        self.heads, self.d_latent, self.d_rope = cfg.heads, cfg.d_latent, cfg.d_rope
        self.dtype = dtype
        d_qk = cfg.d_latent + cfg.d_rope
        self.wq = nn.Linear(cfg.d_model, cfg.heads * d_qk, bias=False)
        self.wkv = nn.Linear(cfg.d_model, d_qk, bias=False)
        self.kv_norm = nn.RMSNorm(cfg.d_latent)
        self.wo = nn.Linear(cfg.heads * cfg.d_latent, cfg.d_model, bias=False)
        self.indexer = Indexer(cfg.d_model, cfg.d_index, cfg.index_heads, cfg.topk,
                               cfg.indexer_precision)

    def project(self, x: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
        """``q [B, T, H, d_qk]`` and ``kv [B, T, d_qk]`` in the attention's dtype."""
        B, T, _ = x.shape
        q = self.wq(x).view(B, T, self.heads, self.d_latent + self.d_rope)
        q_nope, q_rope = q.split([self.d_latent, self.d_rope], dim=-1)
        q = torch.cat((q_nope, apply_rope(q_rope, cos[:, None], sin[:, None])), dim=-1)
        c_kv, k_rope = self.wkv(x).split([self.d_latent, self.d_rope], dim=-1)
        c_kv = self.kv_norm(c_kv.float()).to(k_rope.dtype)
        kv = torch.cat((c_kv, apply_rope(k_rope, cos, sin)), dim=-1)
        return q.to(self.dtype), kv.to(self.dtype)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor,
                indexer_loss: bool = False) -> tuple[Tensor, Optional[Tensor]]:
        """``(y [B, T, d_model], the indexer's KL loss or None)``; the loss when asked."""
        B, T, _ = x.shape
        q, kv = self.project(x, cos, sin)
        indices, logits = self.indexer(x)
        loss = None
        if indexer_loss:
            out, lse = sparse_mla(q, kv, indices, d_v=self.d_latent, return_lse=True)
            target = indexer_target(q, kv, indices, lse)
            loss = indexer_kl_loss(logits, target, indices, kv_len=T)
        else:
            out = sparse_mla(q, kv, indices, d_v=self.d_latent)
        return self.wo(out.reshape(B, T, self.heads * self.d_latent)), loss


class Block(nn.Module):
    """Pre-norm transformer block: sparse MLA attention, then a GELU MLP."""

    def __init__(self, cfg: Config, dtype: torch.dtype):
        super().__init__()
        self.norm1 = nn.RMSNorm(cfg.d_model)
        self.attn = SparseMLA(cfg, dtype)
        self.norm2 = nn.RMSNorm(cfg.d_model)
        self.mlp = nn.Sequential(
            nn.Linear(cfg.d_model, 4 * cfg.d_model),
            nn.GELU(),
            nn.Linear(4 * cfg.d_model, cfg.d_model),
        )

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor,
                indexer_loss: bool = False) -> tuple[Tensor, Optional[Tensor]]:
        """``(x [B, T, d_model], the attention's indexer loss or None)``."""
        y, loss = self.attn(self.norm1(x), cos, sin, indexer_loss)
        x = x + y
        return x + self.mlp(self.norm2(x)), loss


class ByteLM(nn.Module):
    """Causal byte-level LM: ``tokens [B, T]`` int64, ``T <= cfg.seq_len`` -> ``logits [B, T, 256]``
    float32; with ``indexer_loss=True``, ``(logits, the indexers' KL loss averaged over layers)``.

    Parameters are float32; with a 16-bit ``dtype`` the body runs under autocast and the
    attention gets ``q``/``kv`` in that dtype.
    """

    def __init__(self, cfg: Config, dtype: torch.dtype):
        super().__init__()
        self.dtype = dtype
        cos, sin = rope_tables(cfg.seq_len, cfg.d_rope)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)
        self.embed = nn.Embedding(VOCAB, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg, dtype) for _ in range(cfg.layers))
        self.norm = nn.RMSNorm(cfg.d_model)
        nn.init.normal_(self.embed.weight, std=0.02)

    def forward(self, tokens: Tensor, indexer_loss: bool = False):
        cos, sin = self.cos[: tokens.shape[1]], self.sin[: tokens.shape[1]]
        half = self.dtype != torch.float32
        with torch.autocast(tokens.device.type, dtype=self.dtype, enabled=half):
            x = self.embed(tokens)
            losses = []
            for block in self.blocks:
                x, loss = block(x, cos, sin, indexer_loss)
                losses.append(loss)
            logits = (self.norm(x) @ self.embed.weight.T).float()  # tied output projection
        if not indexer_loss:
            return logits
        return logits, torch.stack(losses).mean()

    @torch.no_grad()
    def indexer_recall(self, tokens: Tensor) -> float:
        """The indexers' recall of the dense attention's top-k, eager, averaged over layers.

        Per layer, a dense PyTorch attention of the same ``q`` and ``kv`` (causal, computed only
        for this measurement) gives each token's head-mean probability of every earlier token;
        its ``topk`` most probable keys are the reference set, and the recall is the fraction of
        them that the indexer selects, over the tokens with more than ``topk`` candidates (the
        others select every candidate). NaN when ``T <= topk``.
        """
        T = tokens.shape[1]
        cos, sin = self.cos[:T], self.sin[:T]
        half = self.dtype != torch.float32
        causal = torch.ones(T, T, dtype=torch.bool, device=tokens.device).tril()
        chosen = torch.arange(T, device=tokens.device) >= self.blocks[0].attn.indexer.topk
        hits, total = 0.0, 0
        with torch.autocast(tokens.device.type, dtype=self.dtype, enabled=half):
            x = self.embed(tokens)
            for block in self.blocks:
                h = block.norm1(x)
                q, kv = block.attn.project(h, cos, sin)
                s = torch.einsum("bthd,bsd->bhts", q.float(), kv.float()) * q.shape[-1] ** -0.5
                p = s.masked_fill(~causal, -math.inf).softmax(-1).mean(1)  # [B, T, T]
                indices, _ = block.attn.indexer(h)
                dense = p.topk(indices.shape[-1], dim=-1).indices  # [B, T, topk]
                found = (dense[..., :, None] == indices[..., None, :].long()).any(-1)
                hits += found[:, chosen].float().sum().item()
                total += found[:, chosen].numel()
                x, _ = block(x, cos, sin)
        return hits / total if total else math.nan


# ---------------------------------------------------------------------------------------------
# Data


def load_corpus() -> Tensor:
    """The bytes of the standard library's top-level ``.py`` files, sorted by name, as uint8."""
    root = os.path.dirname(os.__file__)
    names = sorted(n for n in os.listdir(root) if n.endswith(".py"))
    data = b"".join(open(os.path.join(root, n), "rb").read() for n in names)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def batch_at(data: Tensor, starts: Tensor, seq_len: int, device) -> tuple[Tensor, Tensor]:
    """Inputs and next-byte targets ``[len(starts), seq_len]`` int64 on ``device``."""
    rows = torch.stack([data[s : s + seq_len + 1] for s in starts.tolist()]).long()
    return rows[:, :-1].contiguous().to(device), rows[:, 1:].contiguous().to(device)


# ---------------------------------------------------------------------------------------------
# Observation: thresholds from the policy's log, dynamo counters, progress


class ThresholdLog(logging.Handler):
    """Collects the policy's per-capture INFO records (their ``graph`` and ``rescale_threshold``
    fields) as ``{kind: sorted distinct thresholds}``, while attached to the ``mla_inductor``
    logger; kind is ``training`` or ``inference``."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.thresholds: dict[str, list[float]] = {}

    def emit(self, record: logging.LogRecord) -> None:
        graph = getattr(record, "graph", None)
        if graph is not None:
            seen = self.thresholds.setdefault(graph.split()[0], [])
            if record.rescale_threshold not in seen:
                seen.append(record.rescale_threshold)
                seen.sort()

    def __enter__(self):
        self.logger = logging.getLogger(logs.NAME)
        self.old_level = self.logger.level
        if not self.logger.isEnabledFor(logging.INFO):
            self.logger.setLevel(logging.INFO)
        self.logger.addHandler(self)
        return self

    def __exit__(self, *exc):
        self.logger.removeHandler(self)
        self.logger.setLevel(self.old_level)


def compiled_graphs() -> int:
    """Dynamo graphs compiled so far in this process (each recompile adds one)."""
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


def graph_breaks() -> int:
    """Dynamo graph breaks counted so far in this process."""
    return sum(torch._dynamo.utils.counters["graph_break"].values())


def progress(step: int, steps: int, loss: float, out: Callable[[str], None]) -> None:
    """A ``\\r`` progress bar on a terminal; otherwise one line every ``steps // 10`` steps."""
    if sys.stdout.isatty() and out is print:
        filled = 30 * step // steps
        bar = "#" * filled + "." * (30 - filled)
        sys.stdout.write(f"\r  [{bar}] {step}/{steps} loss {loss:.3f}")
        if step == steps:
            sys.stdout.write("\n")
        sys.stdout.flush()
    elif step == 1 or step == steps or step % max(1, steps // 10) == 0:
        out(f"  step {step:>5}/{steps}  loss {loss:.3f}")


# ---------------------------------------------------------------------------------------------
# The run


def train(compiled, model: nn.Module, data: Tensor, cfg: Config, g: torch.Generator, out) -> tuple:
    """AdamW steps on random windows of ``data``, on the LM loss plus ``indexer_loss_weight``
    times the indexers' KL loss (when the weight is > 0).

    Returns ``(LM losses, indexer losses, seconds of the first step, seconds of the later
    steps)``.
    """
    device = torch.device(cfg.device)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=0.1)
    trains_indexer = cfg.indexer_loss_weight > 0
    losses, indexer_losses, first_s, rest_s = [], [], 0.0, 0.0
    for step in range(1, cfg.steps + 1):
        starts = torch.randint(0, len(data) - cfg.seq_len - 1, (cfg.batch,), generator=g)
        x, y = batch_at(data, starts, cfg.seq_len, device)
        t0 = time.perf_counter()
        if trains_indexer:
            logits, indexer_loss = compiled(x, indexer_loss=True)
        else:
            logits = compiled(x)
        loss = F.cross_entropy(logits.reshape(-1, VOCAB), y.reshape(-1))
        total = loss + cfg.indexer_loss_weight * indexer_loss if trains_indexer else loss
        opt.zero_grad(set_to_none=True)
        total.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())  # synchronises
        if trains_indexer:
            indexer_losses.append(indexer_loss.item())
        if step == 1:
            first_s = time.perf_counter() - t0
        else:
            rest_s += time.perf_counter() - t0
        progress(step, cfg.steps, losses[-1], out)
    return losses, indexer_losses, first_s, rest_s


@torch.no_grad()
def evaluate(compiled, data: Tensor, cfg: Config) -> float:
    """Mean next-byte loss over ``val_batches * batch`` evenly spaced windows of ``data``."""
    starts = torch.linspace(0, len(data) - cfg.seq_len - 2, cfg.val_batches * cfg.batch).long()
    losses = []
    for chunk in starts.split(cfg.batch):
        x, y = batch_at(data, chunk, cfg.seq_len, torch.device(cfg.device))
        losses.append(F.cross_entropy(compiled(x).reshape(-1, VOCAB), y.reshape(-1)).item())
    return sum(losses) / len(losses)


@torch.no_grad()
def sample(compiled, cfg: Config, g: torch.Generator) -> str:
    """Continues ``PROMPT`` by up to ``cfg.sample_tokens`` bytes (temperature sampling; greedy
    at temperature 0). Every step runs the full ``[batch, seq_len]`` forward, the shape of the
    compiled inference graph (positions past the written ones are padding that the causal model
    never reads); row 0 is returned."""
    device = torch.device(cfg.device)
    buf = torch.zeros(cfg.batch, cfg.seq_len, dtype=torch.long, device=device)
    n = min(len(PROMPT), cfg.seq_len - 1)
    buf[:, :n] = torch.tensor(list(PROMPT[:n]), dtype=torch.long, device=device)
    for pos in range(n, min(cfg.seq_len, n + cfg.sample_tokens)):
        logits = compiled(buf)[0, pos - 1].float().cpu()
        if cfg.temperature > 0:
            nxt = torch.multinomial(torch.softmax(logits / cfg.temperature, -1), 1, generator=g)
        else:
            nxt = logits.argmax(-1, keepdim=True)
        buf[:, pos] = nxt.to(device)
        n = pos + 1
    return bytes(buf[0, :n].tolist()).decode("utf-8", errors="replace")


def run(cfg: Config, out: Callable[[str], None] = print) -> Report:
    """Trains, evaluates and samples as configured, printing through ``out``; returns the
    measurements. Resets ``torch._dynamo`` (caches and counters) first; sets torch's CPU thread
    count for the run and restores it after, and so with PyTorch's deterministic mode when
    ``cfg.deterministic`` (then two runs of one configuration give bitwise equal losses; on
    CUDA it also sets ``CUBLAS_WORKSPACE_CONFIG=:4096:8`` unless set, which deterministic
    cuBLAS needs).

    Raises:
        ValueError: ``steps < 2`` (the run checks that the loss falls from its first steps to its
            last), or a CUDA device when torch has none.
    """
    cfg = cfg.resolved()
    if cfg.steps < 2:
        raise ValueError(f"steps must be >= 2 (the loss of the first and the last steps is "
                         f"compared), got {cfg.steps}")
    if torch.device(cfg.device).type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {cfg.device!r}: this torch build or machine has no CUDA device "
                         "(omit --device to run on the CPU)")
    with cpu_threads(cfg.threads), _deterministic(cfg.deterministic):
        return _run(cfg, out)


@contextlib.contextmanager
def _deterministic(on: bool):
    """PyTorch's deterministic mode inside the block when ``on``, the previous mode after it."""
    if not on:
        yield
        return
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    before = (torch.are_deterministic_algorithms_enabled(),
              torch.is_deterministic_algorithms_warn_only_enabled())
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before[0], warn_only=before[1])


def _run(cfg: Config, out: Callable[[str], None]) -> Report:
    wall0, cpu0 = time.perf_counter(), time.process_time()
    device, dtype = torch.device(cfg.device), getattr(torch, cfg.dtype)
    torch.manual_seed(cfg.seed)
    g = torch.Generator().manual_seed(cfg.seed)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()

    names = {d: backends.select(device, dtype, d).__name__ for d in ("forward", "backward")}
    index_dtype = torch.float8_e4m3fn if cfg.indexer_precision == "fp8" else dtype
    names["lightning_indexer"] = backends.select(device, index_dtype, "lightning_indexer").__name__
    where = str(device)
    if device.type == "cuda":
        where += f" ({torch.cuda.get_device_name(device)})"
    out(f"device {where}, dtype {cfg.dtype}, torch {torch.__version__}, "
        f"{cfg.threads} CPU thread(s)" + (", deterministic algorithms" if cfg.deterministic else ""))
    out(f"backend requested: {backends.requested()}; in use: forward {names['forward']}, "
        f"backward {names['backward']}, indexer {names['lightning_indexer']}"
        + (" (fp8)" if cfg.indexer_precision == "fp8" else ""))

    data = load_corpus()
    split = int(0.9 * len(data))
    train_data, val_data = data[:split], data[split:]
    out(f"corpus: {len(data):,} bytes of {os.path.dirname(os.__file__)}/*.py "
        f"(train {len(train_data):,}, val {len(val_data):,})")

    model = ByteLM(cfg, dtype).to(device)
    out(f"model: {cfg.layers} layers, d_model {cfg.d_model}, {cfg.heads} heads, d_latent "
        f"{cfg.d_latent}, d_rope {cfg.d_rope} (d_qk {cfg.d_latent + cfg.d_rope}, d_v "
        f"{cfg.d_latent}), topk {cfg.topk} of seq_len {cfg.seq_len}, batch {cfg.batch}; "
        f"{sum(p.numel() for p in model.parameters()):,} parameters")
    compiled = torch.compile(model, fullgraph=True)
    held_out, _ = batch_at(val_data, torch.linspace(0, len(val_data) - cfg.seq_len - 2,
                                                    cfg.batch).long(), cfg.seq_len, device)
    recall_start = model.indexer_recall(held_out)

    with ThresholdLog() as thresholds:
        out(f"training {cfg.steps} steps (the first compiles the training graph)")
        graphs0 = compiled_graphs()
        losses, indexer_losses, first_s, rest_s = train(compiled, model, train_data, cfg, g, out)
        graphs_train = compiled_graphs() - graphs0
        t_eval = time.perf_counter()
        val_loss = evaluate(compiled, val_data, cfg)
        t_sample = time.perf_counter()
        text = sample(compiled, cfg, g)
        t_end = time.perf_counter()
        graphs_eval = compiled_graphs() - graphs0 - graphs_train
    recall_end = model.indexer_recall(held_out)

    window = max(1, cfg.steps // 10)
    later_tokens = (cfg.steps - 1) * cfg.batch * cfg.seq_len
    report = Report(
        device=str(device),
        dtype=cfg.dtype,
        backend_requested=backends.requested(),
        backend_forward=names["forward"],
        backend_backward=names["backward"],
        thresholds=dict(thresholds.thresholds),
        graph_breaks=graph_breaks(),
        graphs_train=graphs_train,
        graphs_eval=graphs_eval,
        losses=losses,
        loss_start=sum(losses[:window]) / window,
        loss_end=sum(losses[-window:]) / window,
        indexer_losses=indexer_losses,
        recall_start=recall_start,
        recall_end=recall_end,
        indexer_trained=cfg.indexer_loss_weight > 0,
        first_step_s=first_s,
        train_tokens_per_s=later_tokens / rest_s if rest_s else math.nan,
        val_loss=val_loss,
        sample=text,
    )
    out(f"loss: start {report.loss_start:.3f} -> end {report.loss_end:.3f} (mean of {window} "
        f"step(s); ln 256 = {math.log(VOCAB):.3f})")
    if indexer_losses:
        out(f"indexer KL loss (weight {cfg.indexer_loss_weight:g}): start "
            f"{sum(indexer_losses[:window]) / window:.3f} -> end "
            f"{sum(indexer_losses[-window:]) / window:.3f} (mean of {window} step(s))")
    out(f"indexer recall of the dense attention's top-{cfg.topk} (held-out batch, tokens with "
        f"more than {cfg.topk} candidates): start {recall_start:.3f} -> end {recall_end:.3f}"
        f"{'' if indexer_losses else ' (indexer not trained: --indexer-loss-weight 0)'}")
    out(f"speed: first step {first_s:.1f} s (compile included), then "
        f"{report.train_tokens_per_s:,.0f} tokens/s")
    out(f"val loss (no_grad, {cfg.val_batches * cfg.batch} sequences): {val_loss:.3f} "
        f"[{t_sample - t_eval:.1f} s, compile of the no_grad graph included]")
    for kind in ("training", "inference"):
        out(f"rescale_threshold chosen at capture, {kind} graph: "
            f"{', '.join(map(str, report.thresholds.get(kind, []))) or 'not captured'}")
    out(f"graph breaks: {report.graph_breaks}; dynamo graphs compiled: training {graphs_train}, "
        f"eval + sampling {graphs_eval} (1 each = no recompiles beyond the no_grad graph)")
    out(f"sample (temperature {cfg.temperature}, {t_end - t_sample:.1f} s):\n{text!r}")
    out(f"total: {time.perf_counter() - wall0:.1f} s wall, {time.process_time() - cpu0:.1f} s CPU "
        "(this process; the compiler's worker processes not counted)")
    return report


class _DefaultsHelp(argparse.ArgumentDefaultsHelpFormatter):
    """Shows each flag's default, except where it is None (the help text then says it)."""

    def _get_help_string(self, action):
        if action.default is None:
            return action.help
        return super()._get_help_string(action)


def parse_args(argv=None) -> Config:
    """The command line (``--help`` lists the flags) as a :class:`Config`."""
    d = Config()
    p = argparse.ArgumentParser(
        prog="python -m mla_inductor.demo",
        description="Train a small DSA sparse-MLA byte-level LM with torch.compile, then sample.",
        formatter_class=_DefaultsHelp,
    )
    p.add_argument("--steps", type=int, default=d.steps, help="training steps")
    p.add_argument("--batch", type=int, default=d.batch, help="sequences per step")
    p.add_argument("--seq-len", type=int, default=d.seq_len, help="bytes per sequence")
    p.add_argument("--d-model", type=int, default=d.d_model, help="residual width")
    p.add_argument("--d-latent", type=int, help="d_v (default: 512 on cuda, else 64)")
    p.add_argument("--d-rope", type=int, help="rope width (default: 64 on cuda, else 16)")
    p.add_argument("--heads", type=int, default=d.heads, help="query heads")
    p.add_argument("--layers", type=int, default=d.layers, help="transformer layers")
    p.add_argument("--topk", type=int, default=d.topk, help="tokens each token attends to")
    p.add_argument("--index-heads", type=int, default=d.index_heads, help="indexer heads")
    p.add_argument("--d-index", type=int,
                   help="indexer head width (default: 128 on cuda, else 16)")
    p.add_argument("--indexer-loss-weight", type=float, default=d.indexer_loss_weight,
                   help="weight of the indexer's KL loss next to the LM loss (0: the indexer "
                   "keeps its random initialisation)")
    p.add_argument("--lr", type=float, default=d.lr, help="AdamW learning rate")
    p.add_argument("--val-batches", type=int, default=d.val_batches,
                   help="held-out batches for the validation loss")
    p.add_argument("--sample-tokens", type=int, default=d.sample_tokens, help="bytes to generate")
    p.add_argument("--temperature", type=float, default=d.temperature, help="0 = greedy")
    p.add_argument("--device", default=d.device, help="cuda if available, else cpu")
    p.add_argument(
        "--dtype",
        choices=("float32", "bfloat16", "float16"),
        help="compute dtype of the attention and of autocast (default: bfloat16 on cuda, float32 "
        "elsewhere; parameters stay float32)",
    )
    p.add_argument("--threads", type=int, help="CPU threads (default: 1 on cpu, else torch's)")
    p.add_argument("--seed", type=int, default=d.seed, help="random seed (data, init, sampling)")
    p.add_argument("--indexer-precision", choices=("bf16", "fp8"), default=d.indexer_precision,
                   help="the indexer's selection: bf16 (the model's dtype, default) or fp8 (q "
                        "and k quantised per row to e4m3; the loss logits stay in the model's "
                        "dtype)")
    p.add_argument("--deterministic", action="store_true",
                   help="torch.use_deterministic_algorithms(True): bitwise reproducible losses "
                        "(on sm90 the backward accumulates dkv in 64-bit fixed point)")
    return Config(**vars(p.parse_args(argv)))


def main(argv=None) -> int:
    """Runs the demo; returns 1 (and says why on stderr) if the loss did not fall, the trained
    indexer's recall did not rise or a graph broke, 2 on an invalid setting."""
    try:
        report = run(parse_args(argv))
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if not report.ok:
        print(
            f"FAILED: graph breaks {report.graph_breaks}, loss {report.loss_start:.3f} -> "
            f"{report.loss_end:.3f}, indexer recall {report.recall_start:.3f} -> "
            f"{report.recall_end:.3f}",
            file=sys.stderr,
        )
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
