"""Numerics of sparse MLA, the package's tool: the order table and the peakedness ladder, the
input builders of their experiments, and the command ``python -m mla_inductor.numerics``.

The questions this module answers (docs/design.md): does a forward leave a
*coherent* gain error on peaked rows (the lazy running max does when the dominant key is processed
last; the exact running max does not), and does the forward's ``o_lo`` residual make the
backward's ``dpsum`` precise?

The float64 references and the error metrics it measures with are in
:mod:`mla_inductor.accuracy`.

Input builders reproduce the published experiment: :func:`peaked_inputs` (``q_t = z + alpha *
kv_t``, so each token's own key dominates its scores; alpha 0.25 peaked, beta 0.4 ~80% self
weight at topk 2048), :func:`causal_topk_indices` (self key in slot 0, -1 padding) and
:func:`self_last` (the same set with slot 0 moved to the last slot). Kernels walk the key blocks
from last to first, so slot 0 is processed *last* ("dominant last", where the lazy rescale bites)
and :func:`self_last` makes the dominant key processed *first*.

Run ``python -m mla_inductor.numerics --help`` for the order table of a backend.
"""

from __future__ import annotations

import argparse
import json
import math
import time
import sys
from typing import Callable, Optional

import torch

from mla_inductor import backends, use_backend
from mla_inductor.accuracy import (compare_orders, gain_stats, output_floor, reference_backward,
                                   reference_forward, rel_l2, row_gain, self_weight, token_chunks)
from mla_inductor.threads import cpu_threads, default_threads
from mla_inductor.thresholds import EXACT_THRESHOLD, LAZY_THRESHOLD

PEAKED_ALPHA = 0.25
SELF_ATTENTION_BETA = 0.4


# ----------------------------------------------------------------------------- input builders


def peaked_inputs(
    T: int,
    H: int,
    d_qk: int = 576,
    *,
    alpha: float = PEAKED_ALPHA,
    dtype: torch.dtype = torch.bfloat16,
    seed: int = 0,
    device="cpu",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal self-peaked inputs of the published experiment: ``kv [T, d_qk]`` standard normal
    and ``q[t, h] = z[t, h] + alpha * kv[t]`` with ``z`` standard normal, both rounded to
    ``dtype``. With ``sm_scale = d_qk ** -0.5`` the own key's score exceeds the others' by about
    ``alpha * sqrt(d_qk)`` (6 for alpha 0.25, d_qk 576). ``alpha = PEAKED_ALPHA`` (0.25) is the
    peaked set of the order table; ``alpha = SELF_ATTENTION_BETA`` (0.4) gives ~80% self weight
    at topk 2048 (more at smaller topk), the precise-dpsum set.

    Returns ``(q [T, H, d_qk], kv [T, d_qk])`` on ``device``; deterministic in ``seed``.
    """
    g = torch.Generator().manual_seed(seed)
    kv = torch.randn(T, d_qk, generator=g, dtype=torch.float64).to(dtype)
    z = torch.randn(T, H, d_qk, generator=g, dtype=torch.float64)
    q = (z + alpha * kv[:, None, :].double()).to(dtype)
    return q.to(device), kv.to(device)


def causal_topk_indices(T: int, topk: int, *, seed: int = 0, device="cpu") -> torch.Tensor:
    """Causal top-k sets with the self key in slot 0: ``indices [T, topk]`` int32 where
    ``indices[t, 0] = t``, the next ``min(t, topk - 1)`` slots hold distinct earlier keys
    (uniformly chosen, in random order) and the rest is -1 (empty). Deterministic in ``seed``.

    Raises:
        ValueError: if ``topk < 1``.
    """
    if topk < 1:
        raise ValueError(f"topk must be >= 1, got {topk}")
    g = torch.Generator().manual_seed(seed)
    keys = torch.rand(T, T, generator=g, dtype=torch.float64)
    earlier = torch.ones(T, T, dtype=torch.bool).tril(-1)
    keys = keys.masked_fill(~earlier, -math.inf)
    k = min(topk - 1, T)
    vals, others = keys.topk(k, dim=1)
    others = torch.where(vals == -math.inf, -1, others)
    pad = torch.full((T, topk - 1 - k), -1, dtype=others.dtype)
    self_col = torch.arange(T)[:, None]
    return torch.cat([self_col, others, pad], dim=1).to(torch.int32).to(device)


def self_last(indices: torch.Tensor) -> torch.Tensor:
    """The same top-k sets with slot 0 moved to the last slot (``[T, topk]``, same dtype): the
    key a kernel processed last is processed first. Meant for -1-padded indices without
    ``topk_length`` (which would cut off the moved slot)."""
    return torch.cat([indices[:, 1:], indices[:, :1]], dim=1)


# ----------------------------------------------------------------------------- the peakedness ladder

LADDER_GAPS = (0.0, 1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0)


def ladder_inputs(
    T: int,
    H: int,
    d_qk: int = 576,
    *,
    topk: int,
    kv_len: int,
    gap: float,
    dtype: torch.dtype = torch.bfloat16,
    seed: int = 0,
    device="cpu",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rows of a given peakedness: every (token, head) row's top logit exceeds the row's other
    logits by ``gap`` (natural-log units of ``sm_scale * q.k`` with ``sm_scale = d_qk ** -0.5``).

    ``kv [kv_len, d_qk]`` standard normal; ``indices [T, topk]`` int32 distinct random keys per
    token (no empty slot), slot 0 the dominant one; ``q[t, h] = z + c * kv[indices[t, 0]]`` with
    ``z`` standard normal (logits of spread 1 before the shift) and ``c >= 0`` solved per row in
    float64 (bisection) so that ``s_0 - max_{k > 0} s_k = gap``; then ``q`` and ``kv`` are rounded
    to ``dtype``, which moves the realised gap by about ``2**-9 * gap`` (:func:`top_gap` measures
    it). The shift also widens the other logits' spread (to about ``sqrt(1 + c**2)``).

    Returns ``(q [T, H, d_qk], kv [kv_len, d_qk], indices [T, topk])`` on ``device``,
    deterministic in ``seed``.

    Raises:
        ValueError: if ``topk < 2``, ``kv_len < topk`` or ``gap < 0``.
    """
    if topk < 2 or kv_len < topk or not gap >= 0:
        raise ValueError(f"need topk >= 2, kv_len >= topk and gap >= 0; got topk {topk}, "
                         f"kv_len {kv_len}, gap {gap}")
    g = torch.Generator().manual_seed(seed)
    kv = torch.randn(kv_len, d_qk, generator=g, dtype=torch.float64).to(dtype).to(device)
    keys = torch.rand(T, kv_len, generator=g).argsort(dim=1)[:, :topk]
    indices = keys.to(torch.int32).to(device)
    z = torch.randn(T, H, d_qk, generator=g, dtype=torch.float64).to(device)
    sm_scale = d_qk**-0.5
    q = torch.empty(T, H, d_qk, dtype=dtype, device=device)
    for t0, t1 in token_chunks(T, topk * (d_qk + 4 * H)):
        rows = kv[indices[t0:t1].long()].double()  # [c, topk, d_qk]
        k_dom = rows[:, 0]
        s0 = torch.bmm(z[t0:t1], rows.transpose(1, 2)) * sm_scale  # [c, H, topk]
        slope = torch.bmm(rows, k_dom[..., None]).transpose(1, 2) * sm_scale  # [c, 1, topk]

        def gap_at(c):
            s = s0 + c[..., None] * slope
            return s[..., 0] - s[..., 1:].amax(-1)

        lo = torch.zeros(s0.shape[:2], dtype=torch.float64, device=device)
        hi = torch.ones_like(lo)
        for _ in range(64):  # the gap grows about sqrt(d_qk) per unit of c: 2**64 is plenty
            short = gap_at(hi) < gap
            if not short.any():
                break
            hi = torch.where(short, 2 * hi, hi)
        for _ in range(60):
            mid = (lo + hi) / 2
            below = gap_at(mid) < gap
            lo, hi = torch.where(below, mid, lo), torch.where(below, hi, mid)
        c = (lo + hi) / 2
        q[t0:t1] = (z[t0:t1] + c[..., None] * k_dom[:, None, :]).to(dtype)
    return q, kv, indices


def top_gap(q, kv, indices, sm_scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row, in float64: the gap between the top logit and the next (``[T, H]``, natural-log
    units) and the softmax mass off the top key, ``1 - P_top`` (``[T, H]``, from the logits, not
    by subtraction, so it is exact down to float64's range). Inputs without empty slots."""
    T, H, d_qk = q.shape
    gap = torch.empty(T, H, dtype=torch.float64, device=q.device)
    mass = torch.empty_like(gap)
    for t0, t1 in token_chunks(T, indices.shape[1] * (d_qk + 2 * H)):
        rows = kv[indices[t0:t1].long()].double()
        s = torch.bmm(q[t0:t1].double(), rows.transpose(1, 2)) * sm_scale
        top = s.topk(2, dim=-1).values
        gap[t0:t1] = top[..., 0] - top[..., 1]
        rest = torch.logsumexp(s.scatter(-1, s.argmax(-1, keepdim=True), -math.inf), dim=-1)
        mass[t0:t1] = torch.exp(rest - torch.logsumexp(s, dim=-1))
    return gap, mass


def ladder(
    backend: str = "emulate",
    *,
    gaps=LADDER_GAPS,
    tokens: int = 16,
    heads: int = 16,
    topk: int = 256,
    kv_len: int = 1024,
    d_qk: int = 576,
    d_v: int = 512,
    seed: int = 0,
    device="cpu",
    progress: Optional[Callable[[str], None]] = None,
) -> dict:
    """The backward's error on rows of growing peakedness (:func:`ladder_inputs`, one gap for
    all rows per rung), as multiples of the ideal bf16 pipeline (the float64 gradients rounded
    to bf16; :func:`reference_backward` is exact at any gap).

    Per gap, ``sparse_mla_fwd`` (threshold 0.0, with ``o_lo``) and ``sparse_mla_bwd`` run under
    ``use_backend(backend)``: ``train`` with the forward's ``o_lo`` (the training path), ``no_o_lo``
    (dpsum from out alone). On a CPU backend also, with the dpsum form ``P (dP - dpsum)`` on
    every key, the dominant key's included (:func:`mla_inductor.kernels.reference.gradients`
    with ``dominant_from_row=False``; the training path forms the dominant key's dS from its
    row instead), given the backend's out: ``dpsum_form`` (the bf16 o_lo) and ``o_lo_f32``
    (``o_lo = float32(O) - out`` with O the float64 output rounded to float32, i.e. a float32
    O): what any precision of O gives without the dominant key's own form.

    Returns:
        A JSON-serialisable dict: the configuration and ``rungs``, one per gap, with the
        realised gap (median, min), the mass off the top key (median), ``ideal`` (dq, dkv rel-L2)
        and per variant the dq and dkv rel-L2 vs float64 divided by the ideal's.

    Raises:
        RuntimeError: if the backend cannot run on ``device``.
    """
    from mla_inductor.kernels import reference

    started = time.perf_counter()
    sm_scale = d_qk**-0.5
    ops = torch.ops.mla_inductor
    rungs = []
    for n, gap in enumerate(gaps):
        if progress is not None:
            progress(f"[{time.perf_counter() - started:6.1f} s] gap {gap:g} ({n + 1}/{len(gaps)})")
        q, kv, idx = ladder_inputs(tokens, heads, d_qk, topk=topk, kv_len=kv_len, gap=gap,
                                   seed=seed, device=device)
        realised, mass = top_gap(q, kv, idx, sm_scale)
        ref, _ = reference_forward(q, kv, idx, sm_scale=sm_scale, d_v=d_v)
        g = torch.Generator().manual_seed(seed + 1)
        dout = torch.randn(ref.shape, generator=g).to(q.dtype).to(device)
        dq_ref, dkv_ref = reference_backward(dout, q, kv, idx, sm_scale=sm_scale, d_v=d_v)
        ideal = {"dq": rel_l2(dq_ref.to(q.dtype), dq_ref),
                 "dkv": rel_l2(dkv_ref.to(kv.dtype), dkv_ref)}

        def ratios(dq, dkv):
            return {"dq": rel_l2(dq, dq_ref) / ideal["dq"], "dkv": rel_l2(dkv, dkv_ref) / ideal["dkv"]}

        with use_backend(backend):
            out, lse, o_lo, _ = ops.sparse_mla_fwd(q, kv, idx, None, None, None, sm_scale, d_v,
                                                   EXACT_THRESHOLD, True, False)
            runs = {
                key: ratios(*ops.sparse_mla_bwd(dout, None, q, kv, idx, None, None, None, out,
                                                lse, residual, sm_scale, d_v)[:2])
                for key, residual in (("train", o_lo), ("no_o_lo", o_lo.new_empty(0)))
            }
        if device == "cpu" or str(device) == "cpu":
            for key, o_full in (("dpsum_form", out.float() + o_lo.float()),
                                ("o_lo_f32", ref.float())):
                dpsum = (dout.float() * o_full).sum(-1)
                dq, dkv, _ = reference.gradients(dout, q, kv, idx, None, sm_scale, d_v, dpsum,
                                                 dominant_from_row=False)
                runs[key] = ratios(dq, dkv)
        rungs.append({
            "gap": gap,
            "realised_gap": {"median": realised.median().item(), "min": realised.min().item()},
            "mass_off_top": mass.median().item(),
            "ideal": ideal,
            **runs,
        })
    return {"backend": backend, "tokens": tokens, "heads": heads, "topk": topk, "kv_len": kv_len,
            "d_qk": d_qk, "d_v": d_v, "seed": seed, "rungs": rungs,
            "seconds": time.perf_counter() - started}


_LADDER_COLUMNS = (("train", "bf16 o_lo (training path)"), ("no_o_lo", "no o_lo"),
                   ("dpsum_form", "bf16 o_lo, dpsum form on every key"),
                   ("o_lo_f32", "float32 O, dpsum form on every key"))


def format_ladder(r: dict) -> str:
    """The ladder of :func:`ladder` as Markdown: per gap, dq and dkv rel-L2 vs float64 as a
    multiple of the ideal bf16 pipeline."""
    cols = [(k, name) for k, name in _LADDER_COLUMNS if k in r["rungs"][0]]
    lines = [
        f"backend {r['backend']}: T = {r['tokens']}, S = {r['kv_len']}, topk = {r['topk']}, "
        f"H = {r['heads']}, d_qk = {r['d_qk']}, d_v = {r['d_v']}, bf16, exact max; dq / dkv "
        "rel-L2 vs float64 as a multiple of the ideal bf16 pipeline",
        "",
        "| gap (realised median) | mass off the top key | ideal dq / dkv | "
        + " | ".join(name for _, name in cols) + " |",
        "|---" * (3 + len(cols)) + "|",
    ]
    for g in r["rungs"]:
        cells = [f"{g[k]['dq']:.2f} / {g[k]['dkv']:.2f}" if g[k]["dq"] < 1e4
                 else f"{g[k]['dq']:.1e} / {g[k]['dkv']:.2f}" for k, _ in cols]
        lines.append(
            f"| {g['gap']:g} ({g['realised_gap']['median']:.2f}) | {g['mass_off_top']:.1e} | "
            f"{g['ideal']['dq']:.2e} / {g['ideal']['dkv']:.2e} | " + " | ".join(cells) + " |"
        )
    lines += ["", f"({r['seconds']:.1f} s)"]
    return "\n".join(lines)


# ----------------------------------------------------------------------------- the order table


def order_table(
    backend: str = "emulate",
    *,
    tokens: int = 1024,
    heads: int = 16,
    topk: int = 512,
    d_qk: int = 576,
    d_v: int = 512,
    seed: int = 0,
    device="cpu",
    attn_sink: Optional[float] = None,
    progress: Optional[Callable[[str], None]] = None,
) -> dict:
    """Measures the published order table for one backend on :func:`peaked_inputs`
    (``alpha = PEAKED_ALPHA``, ``sm_scale = d_qk ** -0.5``, ``S = T``, bf16).

    Runs ``torch.ops.mla_inductor.sparse_mla_fwd`` under ``use_backend(backend)`` with thresholds
    8.0 (lazy) and 0.0 (exact) on both orders (slot 0 = dominant key processed last;
    :func:`self_last` = dominant first), then ``sparse_mla_bwd`` (one random bf16 ``dout``)
    without and with ``o_lo``. ``attn_sink``, when given, is one sink logit (natural-log units,
    as ``sm_scale * q.k``) for every head, passed to the kernels and the fp64 references alike.
    ``progress``, when given, is called with a line naming each of the 5 steps as it starts.

    Returns:
        A JSON-serialisable dict: the configuration, ``self_weight`` (median, p90), ``floor``
        (bf16 output floor: rel-L2 and row-gain rms), ``forward[lazy|exact][order]`` (rel-L2 and
        row-gain stats vs fp64), ``orders[lazy|exact]`` (:class:`OrderDiff` fields), ``backward``
        (rel-L2 of dq and dkv vs fp64 per threshold, order and o_lo use; ``ideal``: the fp64
        gradients rounded to bf16), ``attn_sink`` and ``sink_mass`` (the sink's share of each
        row's softmax, median and p90; None without a sink) and ``seconds``.

    Raises:
        RuntimeError: if the backend cannot run on ``device``.
    """
    started = time.perf_counter()

    def step(n: int, what: str) -> None:
        if progress is not None:
            progress(f"[{time.perf_counter() - started:6.1f} s] step {n}/5: {what}")

    step(1, "float64 reference forward and backward")
    sm_scale = d_qk**-0.5
    q, kv = peaked_inputs(tokens, heads, d_qk, seed=seed, device=device)
    last = causal_topk_indices(tokens, topk, seed=seed + 1, device=device)
    orders = {"dominant_last": last, "dominant_first": self_last(last)}
    sink = None
    if attn_sink is not None:
        sink = torch.full((heads,), float(attn_sink), dtype=torch.float32, device=device)
    ref, lse = reference_forward(q, kv, last, sm_scale=sm_scale, d_v=d_v, attn_sink=sink)
    g = torch.Generator().manual_seed(seed + 2)
    dout = torch.randn(tokens, heads, d_v, generator=g).to(q.dtype).to(device)
    dq_ref, dkv_ref = reference_backward(dout, q, kv, last, sm_scale=sm_scale, d_v=d_v,
                                         attn_sink=sink)
    w = self_weight(q, kv, lse, sm_scale).flatten()
    sink_mass = None
    if sink is not None:
        mass = torch.exp(sink.double()[None, :] - lse).flatten()
        sink_mass = {"median": mass.median().item(), "p90": torch.quantile(mass, 0.9).item()}
    result = {
        "backend": backend,
        "tokens": tokens,
        "heads": heads,
        "topk": topk,
        "d_qk": d_qk,
        "d_v": d_v,
        "alpha": PEAKED_ALPHA,
        "self_weight": {"median": w.median().item(), "p90": torch.quantile(w, 0.9).item()},
        "attn_sink": attn_sink,
        "sink_mass": sink_mass,
        "floor": output_floor(ref, q.dtype)._asdict(),
        "forward": {},
        "orders": {},
        "backward": {
            "ideal": {
                "dq": rel_l2(dq_ref.to(q.dtype), dq_ref),
                "dkv": rel_l2(dkv_ref.to(kv.dtype), dkv_ref),
            }
        },
    }
    ops = torch.ops.mla_inductor
    for name, threshold in (("lazy", LAZY_THRESHOLD), ("exact", EXACT_THRESHOLD)):
        outs, fwd, bwd = {}, {}, {}
        for order, idx in orders.items():
            n = 2 + (name == "exact") * 2 + (order == "dominant_first")
            step(n, f"{backend}, {name} max ({threshold}), {order.replace('_', ' ')}: forward, "
                    "backward without and with o_lo")
            with use_backend(backend):
                out, lse_k, o_lo, _ = ops.sparse_mla_fwd(
                    q, kv, idx, None, None, sink, sm_scale, d_v, threshold, True, False
                )
                grads = {
                    key: ops.sparse_mla_bwd(
                        dout, None, q, kv, idx, None, None, sink, out, lse_k, residual, sm_scale,
                        d_v,
                    )[:2]
                    for key, residual in (("no_o_lo", o_lo.new_empty(0)), ("o_lo", o_lo))
                }
            outs[order] = out
            fwd[order] = {
                "rel_l2": rel_l2(out, ref),
                "row_gain": gain_stats(row_gain(out, ref))._asdict(),
            }
            for key, (dq, dkv) in grads.items():
                bwd[f"{order}/{key}"] = {"dq": rel_l2(dq, dq_ref), "dkv": rel_l2(dkv, dkv_ref)}
        result["forward"][name] = fwd
        diff = compare_orders(outs["dominant_last"], outs["dominant_first"], ref)
        result["orders"][name] = diff._asdict()
        result["backward"][name] = bwd
    result["seconds"] = time.perf_counter() - started
    return result


def _range(a: float, b: float) -> str:
    lo, hi = sorted((a, b))
    return f"{lo:.2e}" if f"{lo:.2e}" == f"{hi:.2e}" else f"{lo:.2e} .. {hi:.2e}"


def format_table(r: dict) -> str:
    """The order table of :func:`order_table` as Markdown."""
    fl = r["floor"]
    sw = r["self_weight"]
    lines = [
        f"backend {r['backend']}: T = S = {r['tokens']}, topk = {r['topk']}, H = {r['heads']}, "
        f"d_qk = {r['d_qk']}, d_v = {r['d_v']}, bf16, peaked inputs (alpha {r['alpha']}; self "
        f"weight median {sw['median']:.2f}, p90 {sw['p90']:.2f}); bf16 output floor: rel-L2 "
        f"{fl['rel_l2']:.2e}, row-gain rms {fl['row_gain_rms']:.2e}",
    ]
    if r.get("attn_sink") is not None:
        sm = r["sink_mass"]
        lines.append(f"attention sink: logit {r['attn_sink']:g} on every head (its share of "
                     f"the softmax: median {sm['median']:.2f}, p90 {sm['p90']:.2f})")
    lines += [
        "",
        "| forward | out rel-L2 vs fp64 | row-gain rms vs fp64 (p99, max) | diff between orders "
        "| row-gain of diff / floor |",
        "|---|---|---|---|---|",
    ]

    def gain(f):
        g = f["row_gain"]
        return f"{g['rms']:.2e} ({g['p99']:.1e}, {g['max']:.1e})"

    def coherent(od):
        if od["floor"] == 0:  # the two orders gave identical outputs (an order-blind backend)
            return f"{od['rel_l2']:.2e} | identical outputs (n/a)"
        return (
            f"{od['rel_l2']:.2e} | {od['coherent_rms']:.2e} / {od['floor']:.2e} "
            f"= {od['ratio']:.2f}x"
        )

    lf, ll = r["forward"]["lazy"]["dominant_first"], r["forward"]["lazy"]["dominant_last"]
    ef, el = r["forward"]["exact"]["dominant_first"], r["forward"]["exact"]["dominant_last"]
    lines += [
        f"| lazy max (8.0), dominant first | {lf['rel_l2']:.2e} | {gain(lf)} | – | – |",
        f"| lazy max (8.0), dominant last | {ll['rel_l2']:.2e} | {gain(ll)} | "
        f"{coherent(r['orders']['lazy'])} |",
        f"| exact max (0.0), either order | {_range(ef['rel_l2'], el['rel_l2'])} | {gain(ef)} .. "
        f"{gain(el)} | {coherent(r['orders']['exact'])} |",
    ]
    b = r["backward"]
    lines += [
        "",
        "| backward of this backend, after the forward | dq rel-L2, dpsum from out "
        "| dq rel-L2, with o_lo | dkv rel-L2, dpsum from out | dkv rel-L2, with o_lo |",
        "|---|---|---|---|---|",
    ]
    for name in ("lazy", "exact"):
        for order in ("dominant_first", "dominant_last"):
            n, o = b[name][f"{order}/no_o_lo"], b[name][f"{order}/o_lo"]
            lines.append(
                f"| {name} max, {order.replace('_', ' ')} | {n['dq']:.2e} | {o['dq']:.2e} "
                f"| {n['dkv']:.2e} | {o['dkv']:.2e} |"
            )
    ideal = b["ideal"]
    lines.append(
        f"| ideal bf16 (fp64 gradients rounded to bf16) | {ideal['dq']:.2e} | {ideal['dq']:.2e} "
        f"| {ideal['dkv']:.2e} | {ideal['dkv']:.2e} |"
    )
    lines += ["", f"({r['seconds']:.1f} s)"]
    return "\n".join(lines)


def _default_backend() -> str:
    if torch.cuda.is_available():
        major, _ = torch.cuda.get_device_capability()
        name = {9: "sm90", 10: "sm100"}.get(major)
        if name is not None and backends.module(name).available()[0]:
            return name
    return "emulate"


def main(argv: Optional[list[str]] = None) -> None:
    """``python -m mla_inductor.numerics``: prints the order table (see :func:`order_table`), or
    with ``--ladder`` the peakedness ladder (:func:`ladder`)."""
    parser = argparse.ArgumentParser(
        prog="python -m mla_inductor.numerics",
        description="Sparse-MLA forward numerics: lazy vs exact running max, dominant key first "
        "vs last, and the backward with and without o_lo, against fp64.",
    )
    parser.add_argument(
        "--backend",
        choices=backends.NAMES,
        default=None,
        help="default: the GPU kernel of this machine when available, else emulate (CPU)",
    )
    parser.add_argument("--ladder", action="store_true",
                        help="the peakedness ladder instead (backward error per gap of the top "
                        "logit, see ladder())")
    parser.add_argument("--tokens", type=int, help="T (= S for the order table; default 1024, "
                        "ladder 16)")
    parser.add_argument("--heads", type=int, help="H (default 16)")
    parser.add_argument("--topk", type=int, help="top-k slots per token (default 512, ladder 256)")
    parser.add_argument("--kv-len", type=int, help="ladder only: S (default 1024)")
    parser.add_argument("--gaps", type=float, nargs="+", default=list(LADDER_GAPS),
                        help="ladder only: gaps of the top logit, natural-log units "
                        "(default %(default)s)")
    parser.add_argument("--d-qk", type=int, default=576,
                        help="query/key width: latent + rope (default 576)")
    parser.add_argument("--d-v", type=int, default=512, help="value width, <= d_qk (default 512)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the drawn inputs (default 0)")
    parser.add_argument(
        "--attn-sink",
        type=float,
        metavar="LOGIT",
        help="an attention sink of this logit (natural-log units) on every head (default: none)",
    )
    parser.add_argument("--json", action="store_true", help="print the measurements as JSON")
    parser.add_argument(
        "--threads",
        type=int,
        help="CPU threads (default: 1 for a CPU backend, as the demo; else torch's)",
    )
    args = parser.parse_args(argv)
    backend = args.backend or _default_backend()
    device = "cuda" if backend in ("sm90", "sm100") else "cpu"
    ok, why = backends.module(backend).available()
    if not ok:
        parser.error(f"--backend {backend} cannot run here: {why}")
    threads = default_threads(device) if args.threads is None else args.threads
    if threads < 1:
        parser.error(f"--threads must be >= 1, got {threads}")
    what = "peakedness ladder" if args.ladder else "order table"
    print(f"{what} of {backend} on {device}, {threads} CPU thread(s); progress on stderr, "
          "the table on stdout", file=sys.stderr, flush=True)
    heads = 16 if args.heads is None else args.heads
    if args.ladder:
        with cpu_threads(threads):
            r = ladder(
                backend,
                gaps=tuple(args.gaps),
                tokens=16 if args.tokens is None else args.tokens,
                heads=heads,
                topk=256 if args.topk is None else args.topk,
                kv_len=1024 if args.kv_len is None else args.kv_len,
                d_qk=args.d_qk,
                d_v=args.d_v,
                seed=args.seed,
                device=device,
                progress=lambda line: print(line, file=sys.stderr, flush=True),
            )
        print(json.dumps(r, indent=2) if args.json else format_ladder(r))
        return
    with cpu_threads(threads):
        r = order_table(
            backend,
            tokens=1024 if args.tokens is None else args.tokens,
            heads=heads,
            topk=512 if args.topk is None else args.topk,
            d_qk=args.d_qk,
            d_v=args.d_v,
            seed=args.seed,
            device=device,
            attn_sink=args.attn_sink,
            progress=lambda line: print(line, file=sys.stderr, flush=True),
        )
    print(json.dumps(r, indent=2) if args.json else format_table(r))


if __name__ == "__main__":
    main()
