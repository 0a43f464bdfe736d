"""Our Hopper (SM90a) sparse-MLA kernels, written in CuTe DSL (the backend protocol,
:class:`mla_inductor.backends.Backend`). The forward's kernel is in :mod:`.fwd`, the backward's in
:mod:`.bwd`, the indexer's training target in :mod:`.indexer_target_kernel`, the lightning
indexer's scores for every key in :mod:`.lightning_every_key` (bf16 / fp16, and float8_e4m3fn
with its scales); each has its launcher (its preconditions asserted, compile key, kernel cache,
launch) in :mod:`.fwd_host`, :mod:`.bwd_host`, :mod:`.indexer_target_host`,
:mod:`.lightning_every_key_host`, which import the CuTe DSL only to compile a kernel that is not
cached. Over long kv the backward first sorts each row's slots (:mod:`.rowsort`, launched by
:mod:`.rowsort_host`). The lightning indexer's scores and its top-k select (:mod:`.topk`,
launched by :mod:`.topk_host`) are composed in :mod:`.lightning_indexer_host`. Its scores at
the selected slots (the op ``lightning_indexer_scores``), forward and backward, are in
:mod:`.lightning_selected_slots`, launched by :mod:`.lightning_selected_slots_host`; the indexer
loss's per-row KL and its gradient in :mod:`.kl`, launched by :mod:`.kl_host`."""

from __future__ import annotations

import importlib.util

import torch

from ...thresholds import EXACT_THRESHOLD, LAZY_THRESHOLD
from . import (bwd_host, fwd_host, indexer_target_host, kl_host, lightning_every_key_host,
               lightning_selected_slots_host, rowsort_host, topk_host)
from .host import (INDEXER_D_QK, INDEXER_MAX_HEADS, LIGHTNING_D, LIGHTNING_MAX_HEADS,
                   SUPPORTED_DIMS)

# The backend protocol's kernel functions (:class:`mla_inductor.backends.Backend`): the
# launchers take its argument order.
from .bwd_host import backward
from .fwd_host import forward
from .indexer_target_host import indexer_target
from .kl_host import backward as indexer_kl_bwd
from .kl_host import forward as indexer_kl
from .lightning_indexer_host import lightning_indexer
from .lightning_selected_slots_host import backward as lightning_indexer_scores_bwd
from .lightning_selected_slots_host import forward as lightning_indexer_scores


def available() -> tuple[bool, str]:
    """True only on a CUDA device of capability (9, 0) with nvidia-cutlass-dsl and
    apache-tvm-ffi installed. Checked without importing them (``importlib.util.find_spec``):
    a process whose kernels are all in the disk cache never imports the CuTe DSL."""
    if not torch.cuda.is_available():
        return False, "sm90: no CUDA device"
    cap = torch.cuda.get_device_capability()
    if cap != (9, 0):
        return False, f"sm90: device capability {cap}, need (9, 0)"
    for module, package in (("cutlass", "nvidia-cutlass-dsl"), ("tvm_ffi", "apache-tvm-ffi")):
        try:
            found = importlib.util.find_spec(module) is not None
        except (ImportError, ValueError) as e:  # a broken entry in sys.modules or sys.path
            return False, f"sm90: {package} not importable ({e})"
        if not found:
            return False, f"sm90: {package} not installed (no module named {module!r})"
    return True, ""


def supports(dtype, direction, T, H, S, d_qk, d_v, features=frozenset()) -> tuple[bool, str]:
    """Whether the kernels handle this problem (``auto`` falls back to the reference if not):
    bf16/fp16 and ``(d_qk, d_v)`` in :data:`SUPPORTED_DIMS`. Every T, S, H and topk is supported
    (64-bit offsets wherever a product of sizes can pass 2**31), limited only by GPU memory, and
    every feature (``causal``, ``sink``, ``max_logits``, ``dlse``). The indexer target
    (``direction`` ``"indexer_target"``, which reads no values: ``d_v`` is not looked at) takes
    ``d_qk`` in :data:`INDEXER_D_QK` and at most :data:`INDEXER_MAX_HEADS` heads (one CTA holds
    all the heads of a token). The lightning indexer (``"lightning_indexer"``, ``d_qk`` = its
    head dim D) takes D = :data:`LIGHTNING_D` and 1 to :data:`LIGHTNING_MAX_HEADS` index heads,
    causal or not, in bf16/fp16 and in float8_e4m3fn (q and k with their float32 q_scale and
    k_scale; other D or head counts in fp8 run on the reference under ``auto``). The lightning
    indexer's scores at the selected slots
    (``"lightning_indexer_scores"`` and ``"lightning_indexer_scores_bwd"``, ``d_qk`` = D) take
    the same D and head counts, every B, T, S and topk."""
    fp8 = direction == "lightning_indexer" and dtype == torch.float8_e4m3fn
    if dtype not in (torch.bfloat16, torch.float16) and not fp8:
        return False, f"sm90 kernels take bfloat16 or float16, got {dtype}"
    if direction == "indexer_target":
        if d_qk not in INDEXER_D_QK:
            return False, f"sm90 indexer target supports d_qk in {INDEXER_D_QK}, got {d_qk}"
        if H > INDEXER_MAX_HEADS:
            return False, (f"sm90 indexer target supports at most {INDEXER_MAX_HEADS} heads, "
                           f"got {H}")
        return True, ""
    if direction in ("lightning_indexer", "lightning_indexer_scores",
                     "lightning_indexer_scores_bwd"):
        what = "lightning indexer" if direction == "lightning_indexer" else direction
        if d_qk != LIGHTNING_D:
            return False, f"sm90 {what} supports D = {LIGHTNING_D}, got {d_qk}"
        if not 1 <= H <= LIGHTNING_MAX_HEADS:
            return False, (f"sm90 {what} supports 1 to {LIGHTNING_MAX_HEADS} index heads, got "
                           f"{H}")
        return True, ""
    if (d_qk, d_v) not in SUPPORTED_DIMS:
        return False, f"sm90 kernels support (d_qk, d_v) in {SUPPORTED_DIMS}, got {(d_qk, d_v)}"
    return True, ""



def precompile(arch: str = "sm_90a", *, dtypes=(torch.bfloat16,), d_qk: int = 576, d_v: int = 512,
               thresholds=(EXACT_THRESHOLD, LAZY_THRESHOLD), o_lo=(False, True),
               topk_length=(False, True),
               backward_heads=(128,), backward_o_lo=(True,), backward_topk=(2048,),
               indexer_heads=(128,),
               indexer_positions=(False, True), lightning_heads=(),
               lightning_causal=(False, True), lightning_dtypes=None, lightning_scores=False,
               lightning_scores_deterministic=(False, True), indexer_kl=False) -> dict:
    """Compiles the kernels for ``arch`` without a GPU; returns ``{compile_key: fn}``.

    Forward: every combination of ``dtypes`` x ``thresholds`` x ``o_lo`` x ``topk_length``.
    Backward (its head count is static): ``dtypes`` x ``backward_heads`` x ``topk_length`` x
    ``backward_o_lo`` (whether the forward's o_lo is passed; a training forward always returns
    it); with it, the sort of the rows that a backward over long kv runs first (:mod:`.rowsort`),
    for ``backward_topk`` (slots a row) x ``topk_length``; pass ``backward_heads=()`` to skip
    both. Indexer target (its head tile, 64 or 128, is
    static): ``dtypes`` x the tiles of ``indexer_heads`` x ``topk_length`` x
    ``indexer_positions`` (causal positions given); pass ``indexer_heads=()`` to skip it.
    Lightning-indexer scores (head tile 16, 32 or 64 static): ``lightning_dtypes`` (None:
    ``dtypes``; ``torch.float8_e4m3fn`` too) x the tiles of ``lightning_heads`` x
    ``lightning_causal``, and the top-k select's configurations; skipped unless
    ``lightning_heads`` is given.
    Lightning-indexer scores at the selected slots (``lightning_scores=True``): the forward per
    dtype and the backward for ``dtypes`` x ``lightning_scores_deterministic``. The indexer
    loss's KL (``indexer_kl=True``): its forward and backward (float32, no other key).
    Everything is cached, so later calls on a GPU do not compile again.

    Raises:
        ValueError: for an arch other than ``sm_90a``.
    """
    if arch != "sm_90a":
        raise ValueError(f"sm90 backend: cannot compile for {arch!r}; use 'sm_90a'")
    compiled = fwd_host.precompile_forward(arch, dtypes=dtypes, d_qk=d_qk, d_v=d_v,
                                           thresholds=thresholds, o_lo=o_lo,
                                           topk_length=topk_length)
    if backward_heads:
        compiled.update(bwd_host.precompile_backward(
            arch, dtypes=dtypes, heads=backward_heads, d_qk=d_qk, d_v=d_v, topk_length=topk_length,
            o_lo=backward_o_lo))
        compiled.update(rowsort_host.precompile_sort(arch, topks=backward_topk,
                                                     topk_length=topk_length))
    if indexer_heads:
        compiled.update(indexer_target_host.precompile_target(
            arch, dtypes=dtypes, d_qk=d_qk, heads=indexer_heads, topk_length=topk_length,
            positions=indexer_positions))
    if lightning_heads:
        compiled.update(lightning_every_key_host.precompile_scores(
            arch, dtypes=dtypes if lightning_dtypes is None else lightning_dtypes,
            heads=lightning_heads, causal=lightning_causal))
        compiled.update(topk_host.precompile_select(arch))
    if lightning_scores:
        compiled.update(lightning_selected_slots_host.precompile_scores(
            arch, dtypes=dtypes, deterministic=lightning_scores_deterministic))
    if indexer_kl:
        compiled.update(kl_host.precompile_kl(arch))
    return compiled
